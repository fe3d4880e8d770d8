"""The command-line program: generate, tokenize, option handling."""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import DFLASH_BIN, DRAFTER, SOURCE_DIR, base_env, chatml, model_args, model_dir, nan_pack, run_cli, tokenize

DRAFT_OPTIONS = ["--drafter", "--draft-block", "--draft-adaptive", "--draft-block-min", "--draft-block-max",
                 "--draft-always", "--draft-window", "--draft-quant", "--no-draft"]
COMMAND_OPTIONS = {
    "generate": ["--model", "--prompt", "--chat", "--messages", "--prompt-ids", "--enable-thinking", "--temperature",
                 "--top-p", "--top-k", "--min-p", "--seed", "--max-tokens", "--stop", "--threads", "--device", *DRAFT_OPTIONS,
                 "--stats", "--json", "--help"],
    "tokenize": ["--model", "--tokenizer", "--text", "--file", "--no-special", "--decode", "--skip-special", "--help"],
    "render": ["--model", "--request", "--enable-thinking", "--ids", "--help"],
    "serve": ["--model", "--host", "--port", "--model-id", "--api-key", "--threads", "--device", "--ctx-size", "--max-tokens",
              "--enable-thinking", "--top-logprobs-k", "--queue", *DRAFT_OPTIONS, "--max-body", "--max-header",
              "--max-connections", "--timeout", "--request-timeout", "--cors-origin", "--test-hooks", "--help"],
}


def generate_json(*args):
    p = run_cli("generate", *model_args(), *args, "--json", check=True)
    return json.loads(p.stdout)


def test_top_k_minus_one_is_off():
    """--top-k -1 means off, as the server's top_k: the same output as --top-k 0."""
    args = ("--prompt", "hi", "--max-tokens", "6", "--temperature", "1", "--seed", "5")
    assert generate_json(*args, "--top-k", "-1")["ids"] == generate_json(*args, "--top-k", "0")["ids"]


def test_sampling_options_at_temperature_zero_are_noted():
    """Sampling options given for a greedy run (no --temperature) are named on stderr as having
    no effect; with a temperature there is no note, and the output is sampled."""
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "2", "--seed", "5", "--top-p", "0.5")
    assert p.returncode == 0, p.stderr
    assert "--top-p, --seed: no effect at temperature 0" in p.stderr, p.stderr
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "2", "--seed", "5", "--temperature", "1")
    assert p.returncode == 0 and "no effect" not in p.stderr, p.stderr


def test_generate_json_shape():
    out = generate_json("--chat", "Hello", "--max-tokens", "8")
    assert set(out) >= {"prompt_ids", "ids", "text", "finish_reason"}
    assert all(isinstance(i, int) for i in out["prompt_ids"]) and out["prompt_ids"]
    assert all(isinstance(i, int) for i in out["ids"]) and len(out["ids"]) <= 8
    assert isinstance(out["text"], str)
    assert out["finish_reason"] in ("stop", "length")
    if out["finish_reason"] == "length":
        assert len(out["ids"]) == 8
    # --chat renders the pack's template with thinking off
    assert out["prompt_ids"] == tokenize(chatml(("user", "Hello")))
    assert out["message"]["role"] == "assistant"


def test_generate_prompt_forms_agree():
    """--prompt (raw, special tokens recognised) and --prompt-ids of its tokens give the same output
    as --chat of the same turn."""
    text = chatml(("user", "def fib(n):"))
    ids = tokenize(text)
    a = generate_json("--chat", "def fib(n):", "--max-tokens", "12")
    b = generate_json("--prompt", text, "--max-tokens", "12")
    c = generate_json("--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "12")
    assert a["prompt_ids"] == b["prompt_ids"] == c["prompt_ids"] == ids
    assert a["ids"] == b["ids"] == c["ids"]
    assert a["text"] == b["text"] == c["text"]


def test_generate_text_matches_ids():
    out = generate_json("--chat", "import os", "--max-tokens", "16")
    p = run_cli("tokenize", *model_args(), "--decode", ",".join(map(str, out["ids"])), "--skip-special",
                check=True) if out["ids"] else None
    if p is not None and out["finish_reason"] == "length":
        assert p.stdout[:-1] == out["text"]


def test_generate_streams_same_text():
    out = generate_json("--chat", "class Stack:", "--max-tokens", "16")
    p = run_cli("generate", *model_args(), "--chat", "class Stack:", "--max-tokens", "16", check=True)
    streamed = p.stdout[:-1] if p.stdout.endswith("\n") and not out["text"].endswith("\n") else p.stdout
    assert streamed == out["text"]
    assert "finish" in p.stderr


def test_generate_seed_and_stop():
    a = generate_json("--chat", "Tell me a story.", "--temperature", "1", "--seed", "11", "--max-tokens", "16")
    b = generate_json("--chat", "Tell me a story.", "--temperature", "1", "--seed", "11", "--max-tokens", "16")
    assert a["ids"] == b["ids"]
    g = generate_json("--chat", "Tell me a story.", "--max-tokens", "40")
    if len(g["text"]) >= 6:
        stop = g["text"][3:5]
        s = generate_json("--chat", "Tell me a story.", "--max-tokens", "40", "--stop", stop)
        assert s["text"] == g["text"][:g["text"].find(stop)]
        assert s["finish_reason"] == "stop"


def test_ctrl_c_interrupts_a_long_prefill():
    """Ctrl-C while a prompt of ~3900 tokens is prefilled (seconds on the CPU) stops at the next
    prefill chunk: no token is generated and the process exits 130 at once."""
    ids = ",".join(str(276 + i % 50) for i in range(3900))
    p = subprocess.Popen([DFLASH_BIN, "generate", *model_args(), "--prompt-ids", ids, "--max-tokens", "1", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env())
    time.sleep(1.5)   # loaded (a fraction of a second) and prefilling
    assert p.poll() is None, "the prefill ended before the test could interrupt it"
    p.send_signal(signal.SIGINT)
    t0 = time.time()
    out, err = p.communicate(timeout=120)
    elapsed = time.time() - t0
    assert p.returncode == 130, err
    res = json.loads(out)
    assert res["finish_reason"] == "cancelled"
    assert res["ids"] == []   # stopped during the prefill, before the first token
    assert elapsed < 2.5, f"took {elapsed:.1f} s to stop"
    # the text summary does not pretend the whole prompt was processed
    p = subprocess.Popen([DFLASH_BIN, "generate", *model_args(), "--prompt-ids", ids, "--max-tokens", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env())
    time.sleep(1.5)
    assert p.poll() is None, "the prefill ended before the test could interrupt it"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert "prompt of 3900 tokens: prefill cancelled after" in err and "tok/s" not in err, err


def test_non_finite_logits_fail_generation(tmp_path):
    """A pack whose logits are NaN fails with a message and exit status 1, plain, sampled and
    speculative, instead of generating token 0 over and over."""
    pack = nan_pack(tmp_path / "nan")
    for extra in ([], ["--temperature", "0.8", "--seed", "1"], ["--drafter", DRAFTER]):
        p = run_cli("generate", "--model", pack, "--prompt", "hi", "--max-tokens", "3", "--json", *extra)
        assert p.returncode == 1, (extra, p.stdout, p.stderr)
        assert p.stdout == ""
        assert "non-finite logits" in p.stderr


@pytest.mark.parametrize("text", ["Hello world", "def f(x):\n    return x * 2\n",
                                  "<|im_start|>user\nhi<|im_end|>\n", "naïve café — 日本語 🙂", " leading  spaces "])
def test_tokenize_round_trip(text):
    ids = tokenize(text)
    assert ids and all(isinstance(i, int) for i in ids)
    p = run_cli("tokenize", *model_args(), "--decode", ",".join(map(str, ids)), check=True)
    assert p.stdout[:-1] == text


def test_tokenize_with_tokenizer_file():
    from conftest import model_dir, SOURCE_DIR
    d = model_dir() or str(SOURCE_DIR / "models" / "demo")
    p = run_cli("tokenize", "--tokenizer", os.path.join(d, "tokenizer.json"), "--text", "Hello world", check=True)
    assert json.loads(p.stdout) == tokenize("Hello world")


def test_special_tokens_are_single_ids():
    ids = tokenize("<|im_start|><|im_end|>")
    assert len(ids) == 2


@pytest.mark.parametrize("command", sorted(COMMAND_OPTIONS))
def test_help_lists_every_option(command):
    p = run_cli(command, "--help")
    assert p.returncode == 0
    listed = re.findall(r"^\s+(--[a-z-]+)", p.stdout, re.M)
    assert sorted(listed) == sorted(COMMAND_OPTIONS[command])
    for line in p.stdout.splitlines():
        if line.strip().startswith("--") and not line.strip().startswith("--help"):
            assert "(default: " in line, line


def test_top_level_help_and_errors():
    p = run_cli("--help")
    assert p.returncode == 0
    for c in COMMAND_OPTIONS:
        assert c in p.stdout
    assert run_cli().returncode == 2
    p = run_cli("frobnicate")
    assert p.returncode == 2 and "unknown command" in p.stderr


@pytest.mark.parametrize("args", [
    ["generate", "--chat", "hi", "--bogus"],
    ["generate", "--chat", "hi", "--max-tokens"],
    ["generate", "--chat", "hi", "--temperature", "warm"],
    ["generate", "--chat", "hi", "--temperature", "9"],
    ["generate", "--chat", "hi", "--top-k", "1.5"],
    ["generate", "--chat", "hi", "--top-k", "-2"],
    ["generate", "--chat", "hi", "--seed", "x"],
    ["generate", "--chat", "hi", "--seed", "99999999999999999999"],
    ["generate", "--chat", "hi", "--prompt", "x"],
    ["generate"],
    ["generate", "--prompt-ids", "1,,2"],
    ["generate", "--chat", "hi", "--json=yes"],
    ["generate", "stray", "--chat", "hi"],
    ["tokenize", "--text", "hi", "--bogus"],
    ["tokenize"],
    ["tokenize", "--text", "a", "--decode", "1"],
    ["serve", "--bogus"],
    ["serve", "--port", "70000"],
    ["serve", "--host", "0.0.0.0"],
    ["serve", "--draft-block", "4"],
    ["serve", "--drafter", "x", "--draft-block", "17"],
    ["serve", "--drafter", "x", "--draft-block-min", "4"],
    ["serve", "--queue", "-1"],
    ["serve", "--top-logprobs-k", "21"],
    ["generate", "--chat", "hi", "--no-draft"],
    ["generate", "--chat", "hi", "--drafter", "x", "--draft-quant", "6"],
    ["generate", "--chat", "hi", "--drafter", "x", "--draft-quant", "16"],
    ["serve", "--draft-quant", "8"],
    ["generate", "--chat", "hi", "--drafter", "x", "--draft-adaptive", "--draft-block-min", "8",
     "--draft-block-max", "4"],
    ["generate", "--chat", "hi", "--drafter", "x", "--draft-adaptive", "--draft-block", "10",
     "--draft-block-max", "6"],
    ["generate", "--chat", "hi", "--drafter", "x", "--draft-always", "--no-draft"],
    ["serve", "--ctx-size", "40000"],
    ["serve", "--ctx-size", "1"],
    ["synth", "--out", "a", "--out", "b"],
    ["synth", "--out", "a", "--seed", "abc"],
    ["synth", "--out", "a", "--seed", "1.5"],
    ["synth", "--out", "a", "--seed", "-5"],
    ["synth", "--out", "a", "--seed", "18446744073709551616"],
    ["synth", "--out", "a", "--seed", ""],
    ["synth", "--out", "a", "--config", "huge"],
    ["generate", "--chat", "hi", "--messages", "f.json"],
    ["render"],
    ["render", "--request", "f.json", "--bogus"],
    ["generate", "--prompt", "hi", "--enable-thinking"],
    ["generate", "--chat", "hi", "--max-tokens", " 5"],
    ["generate", "--chat", "hi", "--temperature", " 1"],
    ["generate", "--chat", "hi", "--seed", " 1"],
])
def test_usage_errors_exit_2(args):
    p = run_cli(*args)
    assert p.returncode == 2, (args, p.stdout, p.stderr)
    assert p.stderr.strip()
    assert p.stdout == ""


@pytest.mark.parametrize("args,option", [
    (["generate", "--chat", "hi", "--model", "--json"], "--model"),
    (["generate", "--model", "--prompt", "hi"], "--model"),
    (["generate", "--chat", "hi", "--stop", "--json"], "--stop"),
    (["generate", "--chat", "hi", "--max-tokens", "--json"], "--max-tokens"),
    (["tokenize", "--text", "--skip-special"], "--text"),
    (["render", "--request", "--ids"], "--request"),
    (["serve", "--port", "--host", "127.0.0.1"], "--port"),
    (["serve", "--api-key", "--host", "0.0.0.0"], "--api-key"),
    (["synth", "--out", "--config", "tiny"], "--out"),
    (["bench", "--device", "cpu", "--model", "--ctx", "8"], "--model"),
])
def test_option_value_is_never_the_next_option(args, option):
    """An option that takes a value, followed by another option, lacks its value: a usage error
    naming it (the next option is not taken as its value)."""
    p = run_cli(*args)
    assert p.returncode == 2, (args, p.stdout, p.stderr)
    assert f"{option} needs a value" in p.stderr, p.stderr
    assert p.stdout == ""


def test_option_values_that_look_like_options():
    """Negative numbers are values; a value that starts with '--' is given as --name=VALUE."""
    p = run_cli("tokenize", *model_args(), "--text=--model")
    assert p.returncode == 0, p.stderr
    ids = json.loads(p.stdout)
    p = run_cli("tokenize", *model_args(), "--decode", ",".join(map(str, ids)))
    assert p.returncode == 0 and p.stdout.rstrip("\n") == "--model", (p.stdout, p.stderr)
    p = run_cli("generate", *model_args(), "--chat", "hi", "--seed", "-1", "--max-tokens", "1", "--stop=--", "--json")
    assert p.returncode == 0, p.stderr


def test_synth_and_bench_take_name_equals_value(tmp_path):
    """synth and bench walk their own options: --name=VALUE works there too, also for a value
    that starts with '--'."""
    out = tmp_path / "--pack"
    p = run_cli("synth", "--config=tiny", f"--out={out}", "--seed=5", "--no-drafter")
    assert p.returncode == 0, p.stderr
    q = run_cli("synth", "--config", "tiny", "--out", str(tmp_path / "b"), "--seed", "5", "--no-drafter")
    assert q.returncode == 0, q.stderr
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    p = run_cli("bench", "--device=cpu", f"--model={out}", "--ctx=8", "--gen=2", "--repeats=1", "--no-verify-curve")
    assert p.returncode == 0, p.stderr
    assert "plain decode" in p.stdout
    p = run_cli("synth", "--config=huge", f"--out={tmp_path / 'c'}")
    assert p.returncode == 2, p.stderr
    # a usage error as every command gives it: the message, one usage line, a pointer to --help
    assert "--config takes 27b or tiny" in p.stderr and "(see 'dflash synth --help')" in p.stderr, p.stderr
    assert "options:" not in p.stderr, p.stderr


def test_integer_past_64_bits_names_the_range():
    """An integer option given a value past 64 bits says the range, as one past the range does."""
    for v in ("99999999999999999999", "-5"):
        p = run_cli("generate", *model_args(), "--chat", "hi", "--max-tokens", v)
        assert p.returncode == 2, (v, p.stderr)
        assert "expected an integer from 0 to" in p.stderr, (v, p.stderr)


def test_readme_lists_every_generate_and_serve_option():
    """The README's Generate and Serve sections name every option their --help lists."""
    readme = (SOURCE_DIR / "README.md").read_text()
    sections = {"generate": readme.split("### Generate", 1)[1].split("### Render", 1)[0],
                "serve": readme.split("### Serve", 1)[1].split("Endpoints:", 1)[0]}
    for command, text in sections.items():
        for option in COMMAND_OPTIONS[command]:
            if option != "--help":
                assert f"`{option}" in text, (command, option)


def test_top_p_range_matches_the_server():
    """--top-p takes (0, 1] like the server's top_p, and numbers past the double range are judged
    as the server judges them; a size limit's error prints an integer."""
    for v in ("0", "-0.5", "1.5"):
        p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1", "--top-p", v)
        assert p.returncode == 2 and "above 0 and at most 1" in p.stderr, (v, p.stderr)
    for v in ("1e-7", "1"):
        p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1", "--top-p", v)
        assert p.returncode == 0, (v, p.stderr)
    # past the double range, as the server's JSON numbers: 1e400 is out of range, 1e-400 is 0
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1", "--top-p", "1e-400")
    assert p.returncode == 2 and "above 0 and at most 1" in p.stderr, p.stderr
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1", "--temperature", "1e400")
    assert p.returncode == 2 and "from 0 to 2" in p.stderr, p.stderr
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1", "--temperature", "1e-400")
    assert p.returncode == 0, p.stderr
    p = run_cli("serve", "--max-body", "99999999999")
    assert p.returncode == 2 and "from 1024 to 1073741824" in p.stderr, p.stderr


def test_more_threads_than_cpus_is_a_note():
    """--threads above the CPUs online runs, with a note on stderr saying it slows decoding."""
    n = (os.cpu_count() or 1) + 1
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1", "--threads", str(n))
    assert p.returncode == 0, p.stderr
    assert f"--threads {n} is more than the" in p.stderr, p.stderr
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1", "--threads", "1")
    assert p.returncode == 0 and "more than the" not in p.stderr, p.stderr


def test_unknown_option_names_it():
    p = run_cli("generate", "--chat", "hi", "--frobnicate", "3")
    assert p.returncode == 2
    assert "--frobnicate" in p.stderr


def test_missing_model_is_an_error(tmp_path):
    p = run_cli("generate", "--model", str(tmp_path / "nope"), "--chat", "hi")
    assert p.returncode == 1
    assert p.stderr.strip()


def test_serve_load_failure_names_the_paths(tmp_path):
    """The operator sees the paths as typed (HTTP clients get them redacted)."""
    p = run_cli("serve", "--port", "0", "--model", str(tmp_path / "nope"), timeout=60)
    assert p.returncode == 1
    assert str(tmp_path / "nope") + "/config.json" in p.stderr
    p = run_cli("serve", "--port", "0", "--drafter", str(tmp_path / "nodrafter"), timeout=60)
    assert p.returncode == 1
    assert str(tmp_path / "nodrafter") + "/config.json" in p.stderr


def test_pack_without_any_chat_template_uses_chatml(tmp_path):
    """tokenizer_config.json without "chat_template" and no template file: the built-in ChatML."""
    pack = tmp_path / "pack"
    shutil.copytree(model_dir() or str(SOURCE_DIR / "models" / "demo"), pack)
    (pack / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((pack / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (pack / "tokenizer_config.json").write_text(json.dumps(cfg))
    req = write_json(tmp_path, "req.json", {"messages": [{"role": "user", "content": "hi"}]})
    p = run_cli("render", "--model", str(pack), "--request", str(req))
    assert p.returncode == 0, p.stderr
    assert "<|im_start|>user\nhi<|im_end|>" in p.stdout
    p = run_cli("generate", "--model", str(pack), "--chat", "hi", "--max-tokens", "3")
    assert p.returncode == 0, p.stderr


def test_bad_input_values_exit_2():
    """Malformed values exit 2 (README), also those found wrong only once the model is known."""
    for args in (["--prompt", ""], ["--prompt-ids", "99999"], ["--chat", "\udcff"]):
        p = run_cli("generate", *model_args(), *args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip()


def test_bench_context_beyond_the_model_is_a_usage_error():
    """A --ctx the loaded model cannot hold is a malformed value: status 2, as in generate."""
    p = run_cli("bench", "--device", "cpu", *model_args(), "--ctx", "5000", "--gen", "2", "--no-verify-curve")
    assert p.returncode == 2 and "exceeds the model's context" in p.stderr, p.stderr


def test_drafter_errors_say_drafter_once(tmp_path):
    bad = tmp_path / "drafter"
    shutil.copytree(DRAFTER, bad)
    (bad / "config.json").write_text("{")
    p = run_cli("generate", *model_args(), "--chat", "hi", "--drafter", str(bad))
    assert p.returncode == 1 and "drafter config.json" in p.stderr and "drafter: drafter" not in p.stderr, p.stderr


@pytest.mark.parametrize("edit,message", [
    (("sliding_window", 10**12), "need a sliding_window from 2 to 2147483647"),
    (("dflash_config.final_logit_softcapping", -1), "final_logit_softcapping -1 must be positive"),
    (("vocab_size", 10**12), "vocab_size must be an integer from 1 to 2147483647"),
    (("vocab_size", 0), "vocab_size must be an integer from 1 to 2147483647"),
    (("dflash_config.output_multiplier", "x"), "dflash_config.output_multiplier must be a number"),
    (("dflash_config.output_multiplier", 0), "output_multiplier and input_embedding_scale must be positive"),
    (("dflash_config.output_multiplier", -1), "output_multiplier and input_embedding_scale must be positive"),
    (("dflash_config.input_embedding_scale", 0), "output_multiplier and input_embedding_scale must be positive"),
    (("dflash_config.final_logit_softcapping", "x"), "dflash_config.final_logit_softcapping must be a number"),
    (("dflash_config.selector_top_k", 0), "dflash_config.selector_top_k must be an integer from 1 to 64"),
    (("dflash_config.selector_top_k", "x"), "dflash_config.selector_top_k must be an integer"),
    (("dflash_config.selector_rank", 0), "dflash_config.selector_rank must be an integer from 1"),
    (("dflash_config.conv_kernel_size", 0), "dflash_config.conv_kernel_size must be an integer from 1 to 16"),
    (("dflash_config.conv_group_size", "x"), "dflash_config.conv_group_size must be an integer"),
    (("dflash_config.conv_group_size", None), "needs a dflash_config.conv_group_size that divides hidden_size 256 (got none)"),
    (("num_hidden_layers", 0), "num_hidden_layers must be an integer from 1"),
    (("hidden_size", -1), "hidden_size must be an integer from 1"),
    (("intermediate_size", 0), "intermediate_size must be an integer from 1"),
    (("layer_types", ["full_attention"]), "layer_types must be a list of 3 entries"),
])
def test_drafter2_values_out_of_range(tmp_path, edit, message):
    bad = tmp_path / "drafter"
    shutil.copytree(pathlib.Path(DRAFTER).parent / "tiny-dflash2", bad)
    cfg = json.loads((bad / "config.json").read_text())
    key, value = edit
    obj = cfg
    for part in key.split(".")[:-1]:
        obj = obj[part]
    obj[key.split(".")[-1]] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    p = run_cli("generate", *model_args(), "--chat", "hi", "--drafter", str(bad))
    assert p.returncode == 1 and message in p.stderr, p.stderr


def test_bench_defaults_to_the_default_model():
    p = run_cli("bench", "--device", "cpu", "--ctx", "8", "--gen", "2", "--no-verify-curve", *model_args())
    assert p.returncode == 0, p.stderr
    assert "plain decode" in p.stdout


def test_bench_checks_its_options():
    """Malformed bench values exit 2 with a message naming the option; a run prints its rounds' phases."""
    tiny = str(pathlib.Path(DRAFTER).parent / "tiny-bonsai2")
    base = ["bench", "--device", "cpu", "--model", tiny, "--ctx", "8", "--gen", "12", "--repeats", "1",
            "--no-verify-curve"]
    bad = [["--drafter", DRAFTER, "--synthetic-acceptance", v] for v in ("1", "nan", "abc", "2x", "1e10")]
    bad += [["--drafter", DRAFTER, "--synthetic-acceptance", "2", "--block", v] for v in ("", "4 8", "3.5", "4,,8", "17")]
    bad += [["--synthetic-acceptance", "2.7"], ["--gen", "3"], ["--ctx", "x"], ["--draft-quant", "8"]]
    bad += [["--drafter", DRAFTER, "--draft-quant", v] for v in ("6", "16", "x", "")]
    for args in bad:
        p = run_cli(*base, *args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert "dflash bench:" in p.stderr, (args, p.stderr)
    # the messages give what is taken
    p = run_cli(*base, "--drafter", DRAFTER, "--draft-quant", "2")
    assert p.returncode == 2 and "--draft-quant takes 8, 4 or 0 (as stored)" in p.stderr, p.stderr
    p = run_cli(*base, "--window", "99999999999")
    assert p.returncode == 2 and "--window takes an integer of at most 2147483647" in p.stderr, p.stderr
    # a drafter folder without a config: refused before the plain runs
    p = run_cli(*base, "--drafter", "/nonexistent-drafter", "--synthetic-acceptance", "2.7")
    assert p.returncode == 1 and "/nonexistent-drafter/config.json" in p.stderr, p.stderr
    assert "plain decode" not in p.stdout, p.stdout
    p = run_cli(*base, "--drafter", DRAFTER, "--synthetic-acceptance", "2.7", "--block", "4")
    assert p.returncode == 0, p.stderr
    assert "tokens identical to plain: yes" in p.stdout
    assert "out of reach" not in p.stdout
    # a tau above what the block can give is run and said to be out of reach
    p = run_cli(*base, "--drafter", DRAFTER, "--synthetic-acceptance", "5", "--block", "4")
    assert p.returncode == 0, p.stderr
    assert "a round of block 4 gives at most 4 tokens, so tau 5.00 is out of reach" in p.stdout, p.stdout
    assert re.search(r"per round \(phases awaited\): drafter pass [0-9.]+ ms, verify pass [0-9.]+ ms", p.stdout)
    # --draft-quant: the speculative runs' drafter quantized at load, labelled; the output unchanged
    p = run_cli(*base, "--drafter", DRAFTER, "--synthetic-acceptance", "2.7", "--block", "4", "--draft-quant", "8")
    assert p.returncode == 0, p.stderr
    assert "weights quantized to 8 bits at load" in p.stdout
    assert re.search(r"speed at synthetic acceptance tau 2\.70, block 4, drafter weights 8-bit: .*tokens identical "
                     r"to plain: yes", p.stdout), p.stdout
    # --identity: speculative == plain in its three modes (every round drafted, synthetic
    # acceptance, the default plain-step fallback), each named with its verdict
    p = run_cli(*base, "--drafter", DRAFTER, "--identity", "1,24")
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("identity: prompt 0"))
    assert re.search(r"with the drafter \(default block\): yes .*block 8: yes .*with the plain-step fallback: yes "
                     r"\(\d+ accepted, \d+ plain steps\)", line), line


def test_negative_seed_is_taken_modulo_2_64():
    """As the server's "seed": -1 is the 64-bit value 2^64 - 1."""
    a = run_cli("generate", *model_args(), "--chat", "hi", "--seed", "-1", "--temperature", "1", "--max-tokens", "8")
    b = run_cli("generate", *model_args(), "--chat", "hi", "--seed", str(2 ** 64 - 1), "--temperature", "1",
                "--max-tokens", "8")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


def test_version():
    p = run_cli("--version")
    assert p.returncode == 0
    assert re.match(r"dflash \d+\.\d+\.\d+ ", p.stdout)
    p = run_cli("--version", "extra")
    assert p.returncode == 2 and "unexpected argument 'extra'" in p.stderr, p.stderr


def test_help_command_and_option_scope():
    """'dflash help CMD' is CMD's help; an option of the other mode is refused, not ignored."""
    p = run_cli("help", "tokenize")
    assert p.returncode == 0 and p.stdout.startswith("usage: dflash tokenize"), p.stdout
    p = run_cli("help", "nope")
    assert p.returncode == 2 and "unknown command 'nope'" in p.stderr, p.stderr
    p = run_cli("tokenize", *model_args(), "--text", "hi", "--skip-special")
    assert p.returncode == 2 and "--skip-special applies to --decode only" in p.stderr, p.stderr


def _tokenizer_with_id(src_dir, dst_dir, new_id):
    """dst_dir/tokenizer.json: src_dir's with one more added token, id new_id."""
    t = json.loads((pathlib.Path(src_dir) / "tokenizer.json").read_text())
    t["added_tokens"].append({**t["added_tokens"][0], "id": new_id, "content": "<|extra|>"})
    (pathlib.Path(dst_dir) / "tokenizer.json").write_text(json.dumps(t))


def test_tokenizer_must_fit_the_vocabulary(tmp_path):
    """A tokenizer with ids past the model's vocabulary is refused when the pack loads (and by
    synth before it writes anything); a tokenizer that does not load is refused by synth."""
    demo = model_dir() or str(SOURCE_DIR / "models" / "demo")
    vocab = json.loads((pathlib.Path(demo) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    pack = tmp_path / "pack"
    shutil.copytree(demo, pack, ignore=shutil.ignore_patterns("reference*"))
    _tokenizer_with_id(demo, pack, vocab)
    p = run_cli("generate", "--model", str(pack), "--chat", "hi", "--max-tokens", "2")
    assert p.returncode == 1 and f"ids up to {vocab}" in p.stderr and "does not belong" in p.stderr, p.stderr
    tok = tmp_path / "tok"
    tok.mkdir()
    _tokenizer_with_id(demo, tok, 5000)   # the tiny preset's vocabulary is 4096
    p = run_cli("synth", "--config", "tiny", "--out", str(tmp_path / "s1"), "--tokenizer", str(tok))
    assert p.returncode != 0 and "ids up to 5000" in p.stderr and not (tmp_path / "s1").exists(), p.stderr
    (tok / "tokenizer.json").write_text('{"model": {"vocab": 5}}')
    p = run_cli("synth", "--config", "tiny", "--out", str(tmp_path / "s2"), "--tokenizer", str(tok))
    assert p.returncode != 0 and "--tokenizer" in p.stderr and not (tmp_path / "s2").exists(), p.stderr


def test_broken_tokenizer_config_is_reported(tmp_path):
    """A tokenizer_config.json that is not JSON is an error even where chat_template.jinja
    gives the template."""
    demo = model_dir() or str(SOURCE_DIR / "models" / "demo")
    pack = tmp_path / "pack"
    shutil.copytree(demo, pack, ignore=shutil.ignore_patterns("reference*"))
    (pack / "tokenizer_config.json").write_text("{{{")
    p = run_cli("generate", "--model", str(pack), "--chat", "hi", "--max-tokens", "2")
    assert p.returncode == 1 and "tokenizer_config.json: invalid JSON" in p.stderr, p.stderr


def test_synth_names_what_is_missing():
    p = run_cli("synth")
    assert p.returncode == 2
    assert "--out DIR is required" in p.stderr
    p = run_cli("synth", "--out", "/tmp/x", "--bogus")
    assert p.returncode == 2
    assert "--bogus" in p.stderr


def test_synth_out_must_be_a_folder(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    p = run_cli("synth", "--config", "tiny", "--out", str(f))
    assert p.returncode == 1
    assert "not a folder" in p.stderr, p.stderr
    assert f.read_text() == "x"


def test_env_model_is_used(tmp_path):
    env = base_env()
    env["DFLASH_MODEL"] = str(tmp_path / "nope")
    p = run_cli("tokenize", "--text", "hi", env=env)
    assert p.returncode == 1
    assert "nope" in p.stderr


def test_binary_exists():
    assert os.access(DFLASH_BIN, os.X_OK)


# ---- chat template: render, --messages -------------------------------------------------

def write_json(tmp_path, name, obj):
    f = tmp_path / name
    f.write_text(json.dumps(obj))
    return str(f)


def test_render_prints_the_exact_prompt(tmp_path):
    req = write_json(tmp_path, "r.json", {"messages": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}]})
    p = run_cli("render", *model_args(), "--request", req, check=True)
    assert p.stdout == chatml(("system", "Be brief."), ("user", "Hi"))
    # thinking: the server's default, overridden by the request either way
    p = run_cli("render", *model_args(), "--request", req, "--enable-thinking", check=True)
    assert p.stdout.endswith("<|im_start|>assistant\n<think>\n")
    off = write_json(tmp_path, "off.json", {"messages": [{"role": "user", "content": "Hi"}],
                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert run_cli("render", *model_args(), "--request", off, "--enable-thinking",
                   check=True).stdout.endswith("<think>\n\n</think>\n\n")
    on = write_json(tmp_path, "on.json", {"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": True})
    assert run_cli("render", *model_args(), "--request", on, check=True).stdout.endswith("assistant\n<think>\n")
    # --ids: the tokens of that text
    ids = json.loads(run_cli("render", *model_args(), "--request", req, "--ids", check=True).stdout)
    assert ids == tokenize(chatml(("system", "Be brief."), ("user", "Hi")))


def test_render_bare_message_list_and_tools(tmp_path):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather?"}]
    bare = write_json(tmp_path, "bare.json", msgs)
    assert run_cli("render", *model_args(), "--request", bare, check=True).stdout == chatml(("user", "Weather?"))
    auto = run_cli("render", *model_args(), "--request", write_json(tmp_path, "a.json", {"messages": msgs, "tools": tools}),
                   check=True).stdout
    assert "# Tools" in auto and "get_weather" in auto
    none = run_cli("render", *model_args(), "--request",
                   write_json(tmp_path, "n.json", {"messages": msgs, "tools": tools, "tool_choice": "none"}),
                   check=True).stdout
    assert none == chatml(("user", "Weather?"))
    req = run_cli("render", *model_args(), "--request",
                  write_json(tmp_path, "q.json", {"messages": msgs, "tools": tools, "tool_choice": "required"}),
                  check=True).stdout
    assert req == auto + "<tool_call>\n"
    named = run_cli("render", *model_args(), "--request", write_json(tmp_path, "f.json", {
        "messages": msgs, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        check=True).stdout
    assert named == auto + "<tool_call>\n<function=get_weather>\n"


def test_cli_requests_checked_as_generate_applies_them(tmp_path):
    """add_generation_prompt takes effect, so it is not named as ignored; render checks
    logit_bias ids against the model's vocabulary (2048 rows, more than the tokenizer's ids), as
    generate and the server do."""
    req = write_json(tmp_path, "agp.json", {"messages": [{"role": "user", "content": "x"}],
                                            "add_generation_prompt": False, "max_tokens": 2})
    p = run_cli("generate", *model_args(), "--messages", str(req), "--json", check=True)
    assert "does not act on" not in p.stderr, p.stderr
    rendered = run_cli("render", *model_args(), "--request", str(req), "--ids", check=True).stdout
    assert json.loads(p.stdout)["prompt_ids"] == json.loads(rendered)
    for key, ok in (("2047", True), ("2048", False)):
        lb = write_json(tmp_path, "lb%s.json" % key, {"messages": [{"role": "user", "content": "x"}],
                                                     "logit_bias": {key: 5}, "max_tokens": 1})
        r = run_cli("render", *model_args(), "--request", str(lb), "--ids")
        g = run_cli("generate", *model_args(), "--messages", str(lb))
        assert (r.returncode == 0) == ok and (g.returncode == 0) == ok, (key, r.stderr, g.stderr)


def test_generate_input_errors_exit_2():
    """An empty prompt names its option; a seed past 64 bits states the range; a prompt the
    context cannot hold is a malformed value (status 2), as the README's rule for values that
    only the loaded model can check says."""
    p = run_cli("generate", *model_args(), "--prompt", "")
    assert p.returncode == 2 and "--prompt" in p.stderr and "empty" in p.stderr, p.stderr
    for seed in ("18446744073709551616", "-9223372036854775809"):
        p = run_cli("generate", *model_args(), "--prompt", "hi", "--seed", seed)
        assert p.returncode == 2 and "-9223372036854775808 to 18446744073709551615" in p.stderr, p.stderr
    p = run_cli("generate", *model_args(), "--prompt", "word " * 5000, "--max-tokens", "1")
    assert p.returncode == 2 and "does not fit the context" in p.stderr, p.stderr


def test_tokenize_file_and_no_special(tmp_path):
    """--file encodes a file's text exactly (its trailing newlines kept, "-" = standard input),
    as --text would; --no-special encodes special tokens' text as plain text."""
    text = "hi <|im_end|> there\n\n"
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode())
    by_text = json.loads(run_cli("tokenize", *model_args(), "--text", text, check=True).stdout)
    by_file = json.loads(run_cli("tokenize", *model_args(), "--file", str(f), check=True).stdout)
    assert by_file == by_text
    p = subprocess.run([DFLASH_BIN, "tokenize", *model_args(), "--file", "-"], input=text, capture_output=True,
                       text=True, timeout=60, env=base_env())
    assert p.returncode == 0 and json.loads(p.stdout) == by_text
    special = json.loads(run_cli("tokenize", *model_args(), "--text", "<|im_end|>", check=True).stdout)
    plain = json.loads(run_cli("tokenize", *model_args(), "--text", "<|im_end|>", "--no-special", check=True).stdout)
    assert len(special) == 1 and len(plain) > 1 and special[0] not in plain
    decoded = run_cli("tokenize", *model_args(), "--decode", ",".join(map(str, plain)), check=True).stdout
    assert decoded == "<|im_end|>\n"   # decode ends its text with a newline
    assert run_cli("tokenize", *model_args(), "--text", "a", "--file", str(f)).returncode == 2
    assert run_cli("tokenize", *model_args(), "--decode", "1", "--no-special").returncode == 2
    (tmp_path / "nul.txt").write_bytes(b"a\0b")
    p = run_cli("tokenize", *model_args(), "--file", str(tmp_path / "nul.txt"))
    assert p.returncode == 1 and "NUL" in p.stderr


def test_render_template_error_exits_1(tmp_path):
    # Qwen3.5's template raises when no user message is present
    p = run_cli("render", *model_args(), "--request",
                write_json(tmp_path, "s.json", {"messages": [{"role": "system", "content": "x"}]}))
    assert p.returncode == 1
    assert "No user query found in messages." in p.stderr
    assert p.stdout == ""
    p = run_cli("render", *model_args(), "--request", write_json(tmp_path, "bad.json", {"messages": []}))
    assert p.returncode == 1 and "messages" in p.stderr
    (tmp_path / "broken.json").write_text("{")
    p = run_cli("render", *model_args(), "--request", str(tmp_path / "broken.json"))
    assert p.returncode == 1 and "invalid JSON" in p.stderr


def test_generate_messages_file(tmp_path):
    req = write_json(tmp_path, "m.json", {"messages": [{"role": "user", "content": "def fib(n):"}]})
    a = generate_json("--messages", req, "--max-tokens", "8")
    b = generate_json("--chat", "def fib(n):", "--max-tokens", "8")
    assert a["prompt_ids"] == b["prompt_ids"] and a["ids"] == b["ids"]
    assert a["message"]["content"] == b["message"]["content"]


def test_request_file_from_stdin_and_pipes(tmp_path):
    """--messages - reads standard input; a pipe (/dev/stdin) is read to its end as a file is;
    a folder is named as one."""
    body = json.dumps({"messages": [{"role": "user", "content": "def fib(n):"}]})
    want = generate_json("--chat", "def fib(n):", "--max-tokens", "6")
    for path in ("-", "/dev/stdin"):
        p = subprocess.run([DFLASH_BIN, "generate", *model_args(), "--messages", path, "--max-tokens", "6", "--json"],
                           input=body, capture_output=True, text=True, timeout=300, env=base_env())
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["ids"] == want["ids"]
    p = run_cli("render", *model_args(), "--request", str(tmp_path))
    assert p.returncode != 0 and "is a folder" in p.stderr, p.stderr


def test_ids_past_the_tokenizer_are_the_models():
    """The demo model's embedding has 2048 rows, its tokenizer 2017: ids in between are taken as
    prompts and decoded (as no text), as the model's outputs are; 2048 is refused."""
    if model_dir() is not None:
        pytest.skip("the token counts are those of the demo model")
    p = run_cli("tokenize", "--decode", "1766,2033,446")
    assert p.returncode == 0 and p.stdout == run_cli("tokenize", "--decode", "1766,446").stdout, p.stderr
    p = run_cli("tokenize", "--decode", "2048")
    assert p.returncode == 2 and "outside 0..2047 (the model's vocabulary)" in p.stderr, p.stderr
    a = generate_json("--prompt-ids", "1766,446,2033", "--max-tokens", "3")
    assert a["prompt_ids"] == [1766, 446, 2033]
    p = run_cli("generate", "--prompt-ids", "1766,2048", "--max-tokens", "1")
    assert p.returncode == 2 and "outside 0..2047" in p.stderr, p.stderr
    for bad, said in (("-1", "token id -1 is outside 0..2047"), ("4294967296", "outside every vocabulary"),
                      ("99999999999999999999", "outside every vocabulary"), ("+5", "expected comma-separated")):
        p = run_cli("tokenize", "--decode=" + bad)
        assert p.returncode == 2 and said in p.stderr, (bad, p.stderr)


def test_dash_h_as_an_option_value_is_a_value():
    """Only an argument where an option may stand asks for help: `--text -h` encodes "-h"."""
    p = run_cli("tokenize", "--text", "-h")
    assert p.returncode == 0 and p.stdout.startswith("["), (p.stdout, p.stderr)
    assert p.stdout == run_cli("tokenize", "--text=-h").stdout
    p = run_cli("tokenize", "--text", "hi", "-h")
    assert p.returncode == 0 and p.stdout.startswith("usage:"), p.stdout


def test_model_id_must_be_text(tmp_path):
    """--model-id goes into JSON answers and log lines: not UTF-8, or with control characters,
    is a usage error (exit 2) rather than a server that answers 500."""
    for bad in (b"bad\xffid", b"a\nb"):
        p = subprocess.run([DFLASH_BIN.encode(), b"serve", b"--model-id", bad], capture_output=True, timeout=60,
                           env=base_env())
        assert p.returncode == 2 and b"--model-id" in p.stderr, p.stderr


def test_model_folder_name_that_is_not_utf8_is_served_as_text(tmp_path):
    """The served id comes from the folder's name: a name that is not UTF-8 (or holds control
    characters) is made text ('_' for those bytes), so answers and logs stay valid."""
    import requests
    from conftest import Server
    src = os.path.abspath(str(model_dir() or SOURCE_DIR / "models" / "demo"))
    pack = os.path.join(os.fsencode(str(tmp_path)), b"m\xff\x01x")
    os.mkdir(pack)
    for f in os.listdir(src):
        os.symlink(os.path.join(src, f), os.path.join(pack, os.fsencode(f)))
    s = Server(model=os.fsdecode(pack))
    try:
        assert requests.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"] == "m__x"
        r = requests.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "m__x", r.text
    finally:
        s.stop()


def test_pack_file_that_is_a_fifo_is_an_error(tmp_path):
    """A pack whose config.json is a FIFO: a clear error at once, not a read that never ends."""
    src = str(model_dir() or SOURCE_DIR / "models" / "demo")
    pack = tmp_path / "pack"
    pack.mkdir()
    for f in os.listdir(src):
        os.symlink(os.path.join(os.path.abspath(src), f), pack / f)
    os.unlink(pack / "config.json")
    os.mkfifo(pack / "config.json")
    p = run_cli("generate", "--model", str(pack), "--prompt", "hi", "--max-tokens", "1", timeout=60)
    assert p.returncode != 0 and "not a regular file" in p.stderr, p.stderr


# ---- drafter ------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--draft-block", "4"], ["--draft-block", "16"],
                                   ["--draft-adaptive", "--draft-block-min", "2", "--draft-block-max", "12"],
                                   ["--draft-window", "8"], ["--draft-quant", "8"], ["--draft-quant", "4"],
                                   ["--draft-always"]])
def test_generate_speculative_equals_plain(extra):
    plain = generate_json("--chat", "def fib(n):", "--max-tokens", "40")
    spec = generate_json("--chat", "def fib(n):", "--max-tokens", "40", "--drafter", DRAFTER, *extra)
    assert spec["ids"] == plain["ids"]
    assert spec["text"] == plain["text"]
    assert spec["draft_rounds"] > 0 and spec["draft_n"] >= spec["draft_rounds"]
    assert 0 <= spec["draft_n_accepted"] <= spec["draft_n"]
    assert spec["plain_steps"] >= 0
    # every token after the prompt's first one comes from a drafted round or a plain step (a
    # stop inside a round commits less than the round accepted)
    counted = 1 + spec["draft_rounds"] + spec["draft_n_accepted"] + spec["plain_steps"]
    assert len(spec["ids"]) == counted if spec["finish_reason"] == "length" else len(spec["ids"]) <= counted
    if "--draft-always" in extra:  # only a last one-token step is plain
        assert spec["plain_steps"] <= 1
    assert "draft_rounds" not in plain


def test_generate_stats_and_no_draft():
    p = run_cli("generate", *model_args(), "--chat", "Hello", "--max-tokens", "12", "--drafter", DRAFTER, "--stats",
                check=True)
    m = re.search(r"draft_rounds (\d+), draft_n (\d+), draft_n_accepted (\d+), tokens/round ([0-9.]+), "
                  r"acceptance ([0-9.]+)", p.stderr)
    assert m, p.stderr
    rounds, n, acc = int(m[1]), int(m[2]), int(m[3])
    assert rounds > 0 and n > 0 and 0 <= acc <= n
    assert abs(float(m[4]) - (acc + rounds) / rounds) < 0.01
    assert "(speculative)" in p.stderr
    q = run_cli("generate", *model_args(), "--chat", "Hello", "--max-tokens", "12", "--drafter", DRAFTER, "--no-draft",
                "--stats", check=True)
    assert "draft_rounds 0," in q.stderr and "(plain decoding)" in q.stderr
    assert q.stdout == p.stdout


def test_generate_bad_drafter_fails(tmp_path):
    p = run_cli("generate", *model_args(), "--chat", "hi", "--drafter", str(tmp_path / "none"))
    assert p.returncode == 1 and "drafter" in p.stderr


def test_generate_dflash2_drafter_equals_plain():
    drafter2 = DRAFTER.replace("tiny-dflash", "tiny-dflash2")
    plain = generate_json("--chat", "class Stack:", "--max-tokens", "32")
    spec = generate_json("--chat", "class Stack:", "--max-tokens", "32", "--drafter", drafter2)
    assert spec["ids"] == plain["ids"] and spec["draft_rounds"] > 0


def test_decode_out_of_range_id_is_an_error():
    p = run_cli("tokenize", *model_args(), "--decode", "1,99999")
    assert p.returncode == 2 and "99999" in p.stderr


@pytest.mark.parametrize("args", [["--device", "tpu"], ["--stop", ""], ["--temperature", "0x1"],
                                  ["--top-p", "0x.8p0"], ["--temperature", "inf"], ["--min-p", "nan"]])
def test_malformed_generate_values_exit_2(args):
    p = run_cli("generate", *model_args(), "--chat", "hi", "--max-tokens", "2", *args)
    assert p.returncode == 2


def test_unwritable_output_fails():
    with open("/dev/full", "w") as full:
        p = subprocess.run([DFLASH_BIN, "generate", *model_args(), "--chat", "hi", "--max-tokens", "3"],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 1 and "cannot write" in p.stderr


def test_generation_stops_at_the_first_failed_write(tmp_path):
    """Streamed output that can no longer be written (a full disk; a reader that left, with
    SIGPIPE ignored) stops the generation there: the command exits 1 naming the error long
    before the 1500 tokens it was asked for (the end-of-text tokens are banned)."""
    eos = json.loads(run_cli("tokenize", *model_args(), "--text", "<|im_end|><|endoftext|>", check=True).stdout)
    req = write_json(tmp_path, "m.json", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
                                          "temperature": 0, "logit_bias": {str(i): -100 for i in eos}})
    cmd = [DFLASH_BIN, "generate", *model_args(), "--messages", str(req), "--stats"]
    t0 = time.monotonic()
    full_run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
                              env=base_env())
    t_full = time.monotonic() - t0
    assert full_run.returncode == 0 and "generated 1500 tokens" in full_run.stderr, full_run.stderr
    with open("/dev/full", "w") as full:
        t0 = time.monotonic()
        p = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, env=base_env())
        t_full_disk = time.monotonic() - t0
    assert p.returncode == 1 and "cannot write the output: No space left on device" in p.stderr, p.stderr
    # SIGPIPE at its default, as in a shell pipeline (`dflash generate ... | head -c 5`)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=base_env(), restore_signals=True)
    t0 = time.monotonic()
    p.stdout.read(1)
    p.stdout.close()   # the reader leaves
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    t_pipe = time.monotonic() - t0
    assert p.returncode == 1 and "cannot write the output: Broken pipe" in err, err
    assert t_full_disk < t_full / 2 and t_pipe < t_full / 2, (t_full, t_full_disk, t_pipe)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["help", "generate"], ["generate", "--help"]])
def test_unwritable_help_and_version_fail(args):
    with open("/dev/full", "w") as full:
        p = subprocess.run([DFLASH_BIN, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60,
                           env=base_env())
    assert p.returncode == 1 and "cannot write the output" in p.stderr


def test_closed_standard_streams():
    # standard input closed: "-" is refused, no file opened later is read in its place
    p = subprocess.run([DFLASH_BIN, "generate", *model_args(), "--messages", "-", "--max-tokens", "2"],
                       stdin=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120,
                       env=base_env(), pass_fds=(), preexec_fn=lambda: os.close(0))
    assert p.returncode == 1 and "standard input is closed" in p.stderr, p.stderr
    # standard output closed: output fails as on the closed stream, nothing else receives it
    p = subprocess.run([DFLASH_BIN, "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=60, env=base_env(), preexec_fn=lambda: os.close(1))
    assert p.returncode == 1 and "standard output is closed" in p.stderr, p.stderr


def test_messages_file_sampling_fields_apply(tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                               "temperature": 0}))
    p = run_cli("generate", *model_args(), "--messages", str(req), "--json", check=True)
    out = json.loads(p.stdout)
    assert len(out["ids"]) <= 3
    p2 = run_cli("generate", *model_args(), "--messages", str(req), "--max-tokens", "5", "--json", check=True)
    assert len(json.loads(p2.stdout)["ids"]) <= 5


def test_messages_file_logit_processors_apply_and_server_fields_are_noted(tmp_path):
    """The request file's logit_bias and penalties apply as on the server; fields that only the
    server acts on (stream, logprobs, model, ...) are named in a note on stderr."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    plain = json.loads(run_cli("generate", *model_args(), "--messages", str(write_json(tmp_path, "a.json", base)),
                               "--json", check=True).stdout)
    banned = plain["ids"][0]
    req = write_json(tmp_path, "b.json", {**base, "logit_bias": {str(banned): -100}, "stream": True,
                                          "logprobs": True, "model": "nope"})
    p = run_cli("generate", *model_args(), "--messages", str(req), "--json", check=True)
    out = json.loads(p.stdout)
    assert banned not in out["ids"], (banned, out["ids"])
    note = [l.split("are ignored: ", 1)[1].split(", ") for l in p.stderr.splitlines() if "does not act on" in l]
    assert note and sorted(note[0]) == ["logprobs", "model", "stream"], p.stderr
    # a file of applied fields only prints no note
    p = run_cli("generate", *model_args(), "--messages",
                str(write_json(tmp_path, "c.json", {**base, "presence_penalty": 2.0})), "--json", check=True)
    assert "does not act on" not in p.stderr, p.stderr


def test_bench_plain_run_ended_by_eos(tmp_path):
    """An EOS id that ends bench's plain run is reported, and the synthetic-acceptance runs (which
    replay the plain run's ids) are skipped rather than fed ids past its end."""
    p = run_cli("bench", "--device", "cpu", *model_args(), "--ctx", "16", "--gen", "120", "--repeats", "1",
                "--no-verify-curve", "--drafter", DRAFTER, "--synthetic-acceptance", "2")
    assert p.returncode == 0, p.stderr
    ended = "an EOS id ended the run" in p.stdout
    assert ended == ("skipped (the plain run hit an EOS id)" in p.stdout), p.stdout
    if not ended:
        assert "tokens identical to plain: yes" in p.stdout
    # non-finite logits: the message of generate, not an id out of range
    p = run_cli("bench", "--device", "cpu", "--model", nan_pack(tmp_path / "nan"), "--ctx", "8", "--gen", "4",
                "--repeats", "1", "--no-verify-curve")
    assert p.returncode == 1
    assert "non-finite logits" in p.stderr, p.stderr


def test_invalid_utf8_text_options_are_usage_errors():
    """--prompt, --stop and tokenize's --text must be UTF-8, as --chat: exit 2 naming the option."""
    bad = "a\udcbf\udcbdb"  # the bytes a, 0xBF, 0xBD, b (not UTF-8)
    for args in (["generate", *model_args(), "--prompt", bad], ["generate", *model_args(), "--prompt", "hi", "--stop", bad],
                 ["tokenize", *model_args(), "--text", bad], ["generate", *model_args(), "--chat", bad]):
        p = subprocess.run([DFLASH_BIN, *args], capture_output=True, timeout=60, env=base_env())
        assert p.returncode == 2, (args, p.stderr)
        opt = next(a for a in args if a in ("--prompt", "--stop", "--text", "--chat") and args[args.index(a) + 1] == bad)
        assert f"{opt}: the".encode() in p.stderr and b"not valid UTF-8 (byte 1)" in p.stderr, p.stderr
        assert b"usage:" in p.stderr, p.stderr


def test_tokenize_file_not_utf8_is_a_data_error(tmp_path):
    """tokenize --file with bytes that are not UTF-8: exit 1 naming the file and the byte, no
    usage text (the command line was right)."""
    f = tmp_path / "bad.txt"
    f.write_bytes(b"ab\xffcd")
    p = run_cli("tokenize", *model_args(), "--file", str(f))
    assert p.returncode == 1, p.stderr
    assert f"{f}: the text is not valid UTF-8 (byte 2)" in p.stderr and "usage:" not in p.stderr, p.stderr


def test_messages_file_number_out_of_range_names_the_field(tmp_path):
    """A number past the JSON parser's range in a --messages file is reported as the server does:
    the field and its range, not a bare parse error."""
    f = tmp_path / "m.json"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999999999999999}')
    p = run_cli("generate", *model_args(), "--messages", str(f))
    assert p.returncode == 1
    assert "max_tokens" in p.stderr, p.stderr
    f.write_text('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}, '
                 '{"role": "user", "content": "y", "n": 1e999}]')
    p = run_cli("generate", *model_args(), "--messages", str(f), "--max-tokens", "2")
    assert p.returncode in (0, 1), p.stderr
    assert "invalid JSON" not in p.stderr, p.stderr


def test_empty_paths_are_usage_errors():
    """An empty folder or file value is a malformed value (exit 2), never resolved against / or
    the current directory."""
    for args in (["generate", "--model", "", "--prompt", "hi"], ["generate", *model_args(), "--drafter", "",
                 "--prompt", "hi"], ["tokenize", "--tokenizer", "", "--text", "hi"],
                 ["generate", *model_args(), "--messages", ""], ["bench", "--device", "cpu", "--model", ""],
                 ["synth", "--out", ""]):
        p = run_cli(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert "empty" in p.stderr, (args, p.stderr)


def test_tokenizer_errors_name_the_file_once(tmp_path):
    """A missing tokenizer.json is named once, with the reason; a folder given as --tokenizer is
    called a folder."""
    pack = tmp_path / "pack"
    shutil.copytree(model_dir() or SOURCE_DIR / "models" / "demo", pack, ignore=shutil.ignore_patterns("reference*"))
    (pack / "tokenizer.json").unlink()
    p = run_cli("generate", "--model", str(pack), "--prompt", "hi")
    assert p.returncode == 1
    assert p.stderr.count("tokenizer.json") == 1 and "No such file" in p.stderr, p.stderr
    p = run_cli("tokenize", "--tokenizer", str(tmp_path), "--text", "hi")
    assert p.returncode == 1
    assert "is a folder" in p.stderr, p.stderr


def test_tied_embeddings_on_an_untied_pack_name_the_flag(tmp_path):
    """tie_word_embeddings: true on a pack with its own lm_head: the error says why the lm_head is
    not expected (whichever of its entries is found first)."""
    demo = model_dir() or str(SOURCE_DIR / "models" / "demo")
    pack = tmp_path / "pack"
    shutil.copytree(demo, pack, ignore=shutil.ignore_patterns("reference*"))
    cfg = json.loads((pack / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    cfg.get("text_config", {}).pop("tie_word_embeddings", None)
    (pack / "config.json").write_text(json.dumps(cfg))
    p = run_cli("generate", "--model", str(pack), "--chat", "hi", "--max-tokens", "2")
    assert p.returncode == 1 and "lm_head" in p.stderr and "tie_word_embeddings is true" in p.stderr, p.stderr
