"""The command-line program: generate, tokenize, option handling."""
import json
import os
import re

import pytest

from conftest import DFLASH_BIN, base_env, chatml, model_args, run_cli, tokenize

COMMAND_OPTIONS = {
    "generate": ["--model", "--prompt", "--chat", "--prompt-ids", "--temperature", "--top-p", "--top-k", "--min-p",
                 "--seed", "--max-tokens", "--stop", "--threads", "--json", "--help"],
    "tokenize": ["--model", "--tokenizer", "--text", "--decode", "--skip-special", "--help"],
    "serve": ["--model", "--host", "--port", "--model-id", "--threads", "--ctx-size", "--max-tokens", "--max-body",
              "--api-key", "--help"],
}


def generate_json(*args):
    p = run_cli("generate", *model_args(), *args, "--json", check=True)
    return json.loads(p.stdout)


def test_generate_json_shape():
    out = generate_json("--chat", "Hello", "--max-tokens", "8")
    assert set(out) >= {"prompt_ids", "ids", "text", "finish_reason"}
    assert all(isinstance(i, int) for i in out["prompt_ids"]) and out["prompt_ids"]
    assert all(isinstance(i, int) for i in out["ids"]) and len(out["ids"]) <= 8
    assert isinstance(out["text"], str)
    assert out["finish_reason"] in ("stop", "length")
    if out["finish_reason"] == "length":
        assert len(out["ids"]) == 8
    # --chat renders ChatML with thinking off
    assert out["prompt_ids"] == tokenize(chatml(("user", "Hello")))


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
    ["generate", "--chat", "hi", "--seed", "-1"],
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
])
def test_usage_errors_exit_2(args):
    p = run_cli(*args)
    assert p.returncode == 2, (args, p.stdout, p.stderr)
    assert p.stderr.strip()
    assert p.stdout == ""


def test_unknown_option_names_it():
    p = run_cli("generate", "--chat", "hi", "--frobnicate", "3")
    assert p.returncode == 2
    assert "--frobnicate" in p.stderr


def test_missing_model_is_an_error(tmp_path):
    p = run_cli("generate", "--model", str(tmp_path / "nope"), "--chat", "hi")
    assert p.returncode == 1
    assert p.stderr.strip()


def test_env_model_is_used(tmp_path):
    env = base_env()
    env["DFLASH_MODEL"] = str(tmp_path / "nope")
    p = run_cli("tokenize", "--text", "hi", env=env)
    assert p.returncode == 1
    assert "nope" in p.stderr


def test_binary_exists():
    assert os.access(DFLASH_BIN, os.X_OK)
