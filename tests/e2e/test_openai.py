"""The OpenAI API end to end: streaming, reasoning, tool calls, logprobs, logit_bias, routing
(x-dflash), speculative == plain through the server, /v1/completions, /metrics, the queue.

How tool calls and reasoning are exercised with a random-weight model: such a model never
writes `<tool_call>` or `</think>` on its own, so two honest routes are used.
 1. Forcing through the public API: a named tool_choice makes the server start the answer
    with "<tool_call>\\n<function=NAME>\\n" (documented behaviour) and logit_bias +100 on the
    `</tool_call>` token makes the model close it; the real model, decoder, detokenizer, parser
    and SSE writer produce the call. Likewise logit_bias on `</think>` closes reasoning.
 2. The server's --test-hooks option (off by default, testing only) honours a request field
    "dflash_forced_output": its tokens replace the sampled ones inside the generation loop
    (the model still runs every step), so a full tool call with parameters, or a reasoning
    block, goes through exactly the production path after sampling.
The split of a real (unforced) output is also checked against the raw text of the same greedy
generation read through /v1/completions.
"""
import json
import re
import signal
import socket
import threading
import time

import openai
import pytest
import requests

from conftest import DRAFTER, SANITIZED, Server, assert_error, check_clean_exit, run_cli, model_args

PROMPTS = ["Hello", "def fib(n):", "Write a poem about the sea.", "import os", "class Stack:"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
TOOL_CALL_END = 1999   # </tool_call>
THINK_END = 2009       # </think>
IM_END = "<|im_end|>"


def msgs(text):
    return [{"role": "user", "content": text}]


def post(url, path, body, **kw):
    return requests.post(url + path, json=body, timeout=kw.pop("timeout", 300), **kw)


def chat(url, body):
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json(), r.headers


def stream(url, body, path="/v1/chat/completions"):
    """Posts a streaming request; returns (headers, [events]) with "[DONE]" kept as a string."""
    r = requests.post(url + path, json={**body, "stream": True}, stream=True, timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for raw in r.iter_lines():
        line = raw.decode("utf-8")
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[6:]
        events.append(data if data == "[DONE]" else json.loads(data))
    return r.headers, events


def assemble(events):
    """Concatenates a chat stream: (role, content, reasoning, tool_calls, finish, last chunk)."""
    role, content, reasoning, calls, finish, last = None, "", "", {}, None, None
    for e in events:
        if e == "[DONE]" or not e.get("choices"):
            continue
        ch = e["choices"][0]
        d = ch["delta"]
        role = role or d.get("role")
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            c["id"] = tc.get("id") or c["id"]
            fn = tc.get("function") or {}
            c["name"] = fn.get("name") or c["name"]
            c["arguments"] += fn.get("arguments") or ""
        if ch["finish_reason"]:
            finish, last = ch["finish_reason"], e
    return role, content, reasoning, [calls[k] for k in sorted(calls)], finish, last


def message_calls(msg):
    return [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls") or []]


# ---- streaming ------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_stream_equals_non_stream(server, prompt):
    body = {"messages": msgs(prompt), "max_tokens": 20, "temperature": 0}
    full, _ = chat(server.url, body)
    headers, events = stream(server.url, {**body, "stream_options": {"include_usage": True}})
    assert headers["x-dflash"] == "speculative"
    assert events[-1] == "[DONE]"
    first = events[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert len({e["id"] for e in events[:-1]}) == 1
    role, content, reasoning, calls, finish, last = assemble(events)
    assert role == "assistant" and reasoning == "" and calls == []
    assert content == (full["choices"][0]["message"]["content"] or "")
    assert finish == full["choices"][0]["finish_reason"]
    # the usage chunk comes last, with no choices; every other chunk has "usage": null
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    assert all(e["usage"] is None for e in events[:-2])
    # llama.cpp timings on the final chunk, with the draft counts (speculative)
    t = last["timings"]
    assert t["predicted_n"] == full["usage"]["completion_tokens"] and t["prompt_n"] == full["usage"]["prompt_tokens"]
    assert t["draft_rounds"] > 0 and {"draft_n", "draft_n_accepted", "plain_steps"} <= set(t)
    # every token after the prompt's first one comes from a drafted round or a plain step (a
    # stop inside a round commits less than the round accepted)
    counted = 1 + t["draft_rounds"] + t["draft_n_accepted"] + t["plain_steps"]
    assert t["predicted_n"] == counted if finish == "length" else t["predicted_n"] <= counted


def test_stream_without_usage(server):
    _, events = stream(server.url, {"messages": msgs("Hi"), "max_tokens": 4, "temperature": 0})
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_sdk_streaming(server, model_id):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=model_id, messages=msgs("def fib(n):"), max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    # completions through the SDK too
    comp = client.completions.create(model=model_id, prompt="def fib(n):", max_tokens=8, temperature=0)
    scomp = client.completions.create(model=model_id, prompt="def fib(n):", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in scomp) == comp.choices[0].text


def test_stream_stop_string(server):
    body = {"messages": msgs("Write a poem about the sea."), "max_tokens": 40, "temperature": 0}
    text = chat(server.url, body)[0]["choices"][0]["message"]["content"]
    assert len(text) > 8
    stop = text[len(text) // 2:len(text) // 2 + 3]
    full, _ = chat(server.url, {**body, "stop": [stop]})
    _, events = stream(server.url, {**body, "stop": [stop]})
    _, content, _, _, finish, _ = assemble(events)
    assert content == full["choices"][0]["message"]["content"] == text[:text.find(stop)]
    assert stop not in content and finish == "stop"


def test_seed_reproducible_streamed_and_not(server):
    body = {"messages": msgs("Tell me a story."), "max_tokens": 16, "temperature": 1.0, "top_p": 1, "top_k": 0,
            "seed": 4242}
    a, h = chat(server.url, body)
    b, _ = chat(server.url, body)
    _, events = stream(server.url, body)
    assert h["x-dflash"] == "fallback; reason=sampled"
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert assemble(events)[1] == (a["choices"][0]["message"]["content"] or "")


def test_tiny_top_p_and_repetition_penalty(server):
    """Values in range that float32 rounds to 0: top_p stays nearly greedy (never off), and a
    repetition penalty near 0 keeps the logits finite (no 500 blaming the model)."""
    body = {"messages": msgs("hi hi hi hi"), "max_tokens": 8}
    greedy, _ = chat(server.url, {**body, "temperature": 0})
    tiny, _ = chat(server.url, {**body, "temperature": 2, "seed": 42, "top_p": 1e-300})
    assert tiny["choices"][0]["message"] == greedy["choices"][0]["message"]
    for rp in (1e-40, 1e-46):
        r, _ = chat(server.url, {**body, "temperature": 0, "repetition_penalty": rp})
        assert r["choices"][0]["finish_reason"] in ("stop", "length"), r


# ---- reasoning ------------------------------------------------------------------------------

def test_reasoning_split_forced(server):
    forced = "  Let me think about it.\nStep 1.  </think>\n\nThe answer is 4." + IM_END
    body = {"messages": msgs("2+2?"), "enable_thinking": True, "max_tokens": 64, "temperature": 0,
            "dflash_forced_output": forced}
    full, h = chat(server.url, body)
    assert h["x-dflash"] == "fallback; reason=forced"
    m = full["choices"][0]["message"]
    assert m["reasoning_content"] == "Let me think about it.\nStep 1."
    assert m["content"] == "The answer is 4."
    assert full["choices"][0]["finish_reason"] == "stop"
    _, events = stream(server.url, body)
    _, content, reasoning, calls, finish, _ = assemble(events)
    assert (reasoning, content, calls, finish) == (m["reasoning_content"], m["content"], [], "stop")
    # chat_template_kwargs.enable_thinking works the same; thinking off: no reasoning at all
    m2 = chat(server.url, {**body, "enable_thinking": None, "chat_template_kwargs": {"enable_thinking": True}})[0]
    assert m2["choices"][0]["message"] == m
    off = chat(server.url, {**body, "enable_thinking": False,
                            "dflash_forced_output": "Plain answer." + IM_END})[0]["choices"][0]["message"]
    assert off["content"] == "Plain answer." and "reasoning_content" not in off


def test_reasoning_split_of_a_real_output(server, tmp_path):
    """Unforced: the chat answer's reasoning/content are the raw greedy text split at </think>
    (the raw text read through /v1/completions with the rendered prompt)."""
    req = {"messages": msgs("Explain recursion."), "enable_thinking": True}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(req))
    prompt = run_cli("render", *model_args(), "--request", str(f), check=True).stdout
    assert prompt.endswith("<think>\n")
    for bias in [{}, {str(THINK_END): 100}]:   # unforced, then </think> forced at once
        raw = post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                    "logit_bias": bias}).json()["choices"][0]["text"]
        m = chat(server.url, {**req, "max_tokens": 24, "temperature": 0, "logit_bias": bias})[0]["choices"][0]["message"]
        ws = " \t\n\r"
        if "</think>" in raw:
            reasoning, _, content = raw.partition("</think>")
        else:
            reasoning, content = raw, ""
        assert m.get("reasoning_content", "") == reasoning.strip(ws)
        assert (m["content"] or "") == content.strip(ws)


def test_server_enable_thinking_default(server):
    on = chat(server.url, {"messages": msgs("Hi"), "max_tokens": 1, "temperature": 0, "enable_thinking": True})[0]
    off = chat(server.url, {"messages": msgs("Hi"), "max_tokens": 1, "temperature": 0})[0]
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]   # "<think>\n\n</think>\n\n" vs "<think>\n"
    with Server("--enable-thinking") as s:
        default = chat(s.url, {"messages": msgs("Hi"), "max_tokens": 1, "temperature": 0})[0]
        assert default["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"]
        turned_off = chat(s.url, {"messages": msgs("Hi"), "max_tokens": 1, "temperature": 0,
                                  "enable_thinking": False})[0]
        assert turned_off["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]


# ---- tool calls -----------------------------------------------------------------------------

def test_tool_call_named_choice_with_logit_bias(server):
    """The real model closes the call the named tool_choice opened (</tool_call> biased +100)."""
    body = {"messages": msgs("Weather in Paris?"), "tools": TOOLS, "max_tokens": 1, "temperature": 0, "seed": 9,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "logit_bias": {str(TOOL_CALL_END): 100}}
    full, h = chat(server.url, body)
    assert h["x-dflash"] == "fallback; reason=logit_bias"
    choice = full["choices"][0]
    assert choice["finish_reason"] == "length"   # the call is whole, but max_tokens ended the output
    assert choice["message"]["content"] is None
    calls = message_calls(choice["message"])
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {}
    assert calls[0]["id"].startswith("call_")
    _, events = stream(server.url, body)
    _, content, _, scalls, finish, _ = assemble(events)
    assert scalls == calls and finish == "length" and content == ""   # same ids: same seed


def test_tool_calls_streamed_arguments_equal(server):
    forced = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
              "</function>\n</tool_call>" + IM_END)
    body = {"messages": msgs("Weather and time?"), "tools": TOOLS, "max_tokens": 200, "temperature": 0, "seed": 3,
            "dflash_forced_output": forced}
    full, _ = chat(server.url, body)
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will check."
    calls = message_calls(choice["message"])
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}   # "days" typed by the schema
    assert json.loads(calls[1]["arguments"]) == {}
    assert len({c["id"] for c in calls}) == 2
    _, events = stream(server.url, body)
    _, content, _, scalls, finish, _ = assemble(events)
    assert scalls == calls   # concatenated argument deltas == the non-streamed arguments, byte for byte
    assert content == "I will check." and finish == "tool_calls"
    # the SDK assembles the same calls
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {"dflash_forced_output": forced}
    sdk = client.chat.completions.create(model=full["model"], messages=body["messages"], tools=TOOLS, max_tokens=200,
                                         temperature=0, seed=3, extra_body=extra)
    assert [(c.function.name, c.function.arguments) for c in sdk.choices[0].message.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls]


def test_tool_call_ids_new_in_each_turn_with_a_fixed_seed(server):
    """A pinned seed repeats a request's ids, but the next turn of the conversation (its prompt
    holding the first call and its result) gets a new one: results must match their calls."""
    def turn(messages, city):
        forced = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n" + city +
                  "\n</parameter>\n</function>\n</tool_call>" + IM_END)
        body = {"messages": messages, "tools": TOOLS, "max_tokens": 100, "temperature": 0, "seed": 7,
                "dflash_forced_output": forced}
        return chat(server.url, body)[0]["choices"][0]["message"]
    first = turn(msgs("Weather in A, then B?"), "A")
    assert turn(msgs("Weather in A, then B?"), "A")["tool_calls"][0]["id"] == first["tool_calls"][0]["id"]
    history = msgs("Weather in A, then B?") + [
        first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "{\"temp\": 20}"}]
    second = turn(history, "B")
    assert second["tool_calls"][0]["id"] != first["tool_calls"][0]["id"]


def test_tool_calls_cut_by_max_tokens_finish_with_length(server):
    """A complete call followed by one that max_tokens cuts: the complete one is a tool call,
    the unfinished rest stays content, and finish_reason is "length", streamed and not."""
    forced = ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
              "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" + IM_END)
    body = {"messages": msgs("Time and weather?"), "tools": TOOLS, "temperature": 0, "seed": 3,
            "dflash_forced_output": forced}
    whole, _ = chat(server.url, {**body, "max_tokens": 200})
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert len(whole["choices"][0]["message"]["tool_calls"]) == 2
    n = whole["usage"]["completion_tokens"]
    cut, _ = chat(server.url, {**body, "max_tokens": n - 6})
    c = cut["choices"][0]
    assert cut["usage"]["completion_tokens"] == n - 6
    assert c["finish_reason"] == "length"
    assert [x["name"] for x in message_calls(c["message"])] == ["get_time"]
    assert "<tool_call>" in c["message"]["content"]   # the unfinished second call
    _, events = stream(server.url, {**body, "max_tokens": n - 6})
    _, content, _, scalls, finish, _ = assemble(events)
    assert finish == "length" and [x["name"] for x in scalls] == ["get_time"]
    assert content == c["message"]["content"]


def test_tool_call_json_form_and_none(server):
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' + IM_END
    body = {"messages": msgs("Weather?"), "tools": TOOLS, "max_tokens": 100, "temperature": 0,
            "dflash_forced_output": forced}
    m = chat(server.url, body)[0]["choices"][0]["message"]
    assert message_calls(m)[0]["name"] == "get_weather"
    assert json.loads(message_calls(m)[0]["arguments"]) == {"city": "Oslo"}
    # tool_choice "none": tools are left out of the prompt and calls stay text
    with_tools = chat(server.url, {**body, "max_tokens": 1})[0]["usage"]["prompt_tokens"]
    none, _ = chat(server.url, {**body, "tool_choice": "none"})
    n = none["choices"][0]
    assert n["finish_reason"] == "stop" and "tool_calls" not in n["message"]
    assert n["message"]["content"] == forced[:-len(IM_END)]
    assert none["usage"]["prompt_tokens"] < with_tools


def test_tool_choice_required_prefix(server):
    """required: the answer starts with "<tool_call>\\n" (the model writes the rest)."""
    forced = "<function=get_time>\n</function>\n</tool_call>" + IM_END
    body = {"messages": msgs("Time?"), "tools": TOOLS, "tool_choice": "required", "max_tokens": 50,
            "temperature": 0, "dflash_forced_output": forced}
    c = chat(server.url, body)[0]["choices"][0]
    assert c["finish_reason"] == "tool_calls" and message_calls(c["message"])[0]["name"] == "get_time"
    # with thinking on, the forced call closes the reasoning first
    c = chat(server.url, {**body, "enable_thinking": True})[0]["choices"][0]
    assert message_calls(c["message"])[0]["name"] == "get_time" and "reasoning_content" not in c["message"]


def test_tool_conversation_renders(server):
    """A full tool round trip in the history: assistant tool_calls (arguments as a JSON string)
    and a tool message."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]
    full, _ = chat(server.url, {"messages": history, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
    assert full["usage"]["prompt_tokens"] > 100


def test_template_errors_are_400(server):
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "system", "content": "only a system turn"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == "No user query found in messages."   # raise_exception's text, as it is
    assert err["code"] == "chat_template_error"
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                                              {"role": "system", "content": "late system"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "System message must be at the beginning."


# ---- routing: x-dflash, speculative == plain -----------------------------------------------

ROUTES = [
    ({"temperature": 0}, "speculative"),
    ({"temperature": 0.7}, "fallback; reason=sampled"),
    ({"temperature": 0, "logprobs": True}, "fallback; reason=logprobs"),
    ({"temperature": 0, "presence_penalty": 0.5}, "fallback; reason=penalties"),
    ({"temperature": 0, "frequency_penalty": 0.5}, "fallback; reason=penalties"),
    ({"temperature": 0, "repetition_penalty": 1.2}, "fallback; reason=penalties"),
    ({"temperature": 0, "logit_bias": {"10": 5}}, "fallback; reason=logit_bias"),
    ({"temperature": 0, "dflash_forced_output": "x"}, "fallback; reason=forced"),
]


@pytest.mark.parametrize("fields,expected", ROUTES, ids=[r[1] + str(i) for i, r in enumerate(ROUTES)])
def test_x_dflash_routes(server, fields, expected):
    for path, body in [("/v1/chat/completions", {"messages": msgs("Hi")}), ("/v1/completions", {"prompt": "Hi"})]:
        f = dict(fields)
        if path == "/v1/completions" and f.get("logprobs") is True:
            f["logprobs"] = 1
        r = post(server.url, path, {**body, **f, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.headers["x-dflash"] == expected
        assert ("draft_rounds" in r.json()["timings"]) == (expected == "speculative")
        h, _ = stream(server.url, {**body, **f, "max_tokens": 2}, path=path)
        assert h["x-dflash"] == expected


def test_x_dflash_no_drafter_and_disabled(plain_server):
    r = post(plain_server.url, "/v1/chat/completions", {"messages": msgs("Hi"), "max_tokens": 2, "temperature": 0})
    assert r.headers["x-dflash"] == "fallback; reason=no-drafter"
    with Server("--drafter", DRAFTER, "--no-draft", "--draft-quant", "4") as s:
        r = post(s.url, "/v1/chat/completions", {"messages": msgs("Hi"), "max_tokens": 2, "temperature": 0})
        assert r.headers["x-dflash"] == "fallback; reason=disabled"
        assert "draft_rounds" not in r.json()["timings"]
        # a drafter that never runs is not quantized
        meta = requests.get(s.url + "/v1/models", timeout=30).json()["data"][0]["meta"]
        assert meta["speculative"] is False and meta["draft_quant_bits"] == 0
        assert "4-bit" not in s.log_text()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_equals_plain_through_the_server(server, plain_server, prompt):
    body = {"messages": msgs(prompt), "max_tokens": 32, "temperature": 0}
    spec, h = chat(server.url, body)
    plain, h2 = chat(plain_server.url, body)
    assert h["x-dflash"] == "speculative" and h2["x-dflash"].startswith("fallback")
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    assert spec["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert spec["usage"] == plain["usage"]
    # and streamed, and through /v1/completions
    assert assemble(stream(server.url, body)[1])[1] == (plain["choices"][0]["message"]["content"] or "")
    c1 = post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0}).json()
    c2 = post(plain_server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0}).json()
    assert c1["choices"] == c2["choices"]


def test_speculative_block_options_equal_plain(plain_server):
    body = {"messages": msgs("def fib(n):"), "max_tokens": 40, "temperature": 0}
    plain = chat(plain_server.url, body)[0]["choices"][0]["message"]
    with Server("--drafter", DRAFTER, "--draft-adaptive", "--draft-block-min", "2", "--draft-block-max", "10",
                "--draft-window", "16") as s:
        full, h = chat(s.url, body)
        assert h["x-dflash"] == "speculative" and full["choices"][0]["message"] == plain
        assert full["timings"]["draft_rounds"] > 0
        assert full["timings"]["draft_ms"] > 0 and full["timings"]["verify_ms"] > 0


# ---- logprobs, logit_bias --------------------------------------------------------------------

def test_logprobs_shape(server):
    full, _ = chat(server.url, {"messages": msgs("Hello"), "max_tokens": 6, "temperature": 0, "logprobs": True,
                                "top_logprobs": 3})
    lp = full["choices"][0]["logprobs"]["content"]
    assert len(lp) == full["usage"]["completion_tokens"]
    for e in lp:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(e["token"], str) and e["logprob"] <= 0 and all(0 <= b < 256 for b in e["bytes"])
        assert len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"] >= e["top_logprobs"][2]["logprob"]
        assert e["top_logprobs"][0]["token"] == e["token"]   # greedy: the chosen one is the most likely
        assert abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) < 1e-6
    # streamed logprobs concatenate to the same list
    _, events = stream(server.url, {"messages": msgs("Hello"), "max_tokens": 6, "temperature": 0, "logprobs": True,
                                    "top_logprobs": 3})
    slp = [x for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]
           for x in e["choices"][0]["logprobs"]["content"]]
    assert slp == lp
    # the limit is --top-logprobs-k (20)
    assert post(server.url, "/v1/chat/completions", {"messages": msgs("x"), "logprobs": True,
                                                     "top_logprobs": 20, "max_tokens": 1}).status_code == 200
    assert post(server.url, "/v1/chat/completions", {"messages": msgs("x"), "logprobs": True,
                                                     "top_logprobs": 21}).status_code == 400


def test_completions_logprobs_legacy_shape(server):
    r = post(server.url, "/v1/completions", {"prompt": "import os", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_completions_legacy_top_logprobs_hold_the_sampled_token(server):
    """OpenAI's legacy format: each entry holds the `logprobs` most likely tokens plus the
    sampled one when it is not among them (so logprobs 0 still names it), and byte pieces (part
    of a character) are written "bytes:\\xNN" in tokens and keys, so no two tokens share a key."""
    for k in (0, 1, 5):
        body = {"prompt": "x", "max_tokens": 6, "temperature": 2, "seed": 4, "logprobs": k}
        lp = post(server.url, "/v1/completions", body).json()["choices"][0]["logprobs"]
        for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert tok in top and abs(top[tok] - tlp) < 1e-6, (tok, top)
            assert k <= len(top) <= k + 1, top
    r = post(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0, "logprobs": 1,
                                             "dflash_forced_output": "é🙂"})
    lp = r.json()["choices"][0]["logprobs"]
    assert any(t.startswith("bytes:\\x") for t in lp["tokens"]), lp["tokens"]
    for t in lp["tokens"]:
        assert "\ufffd" not in t
        if t.startswith("bytes:"):
            raw_bytes = bytes(int(h, 16) for h in t[len("bytes:"):].split("\\x")[1:])
            assert raw_bytes, t
            with pytest.raises(UnicodeDecodeError):
                raw_bytes.decode("utf-8")   # a byte piece: not a character of its own
    r = post(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0, "logprobs": 20})
    assert all(len(top) >= 20 for top in r.json()["choices"][0]["logprobs"]["top_logprobs"])


def test_completions_text_offset_indexes_the_text(server):
    """text_offset counts characters of the returned text: a token that only begins a
    multi-byte character points at that character, and no offset passes the end; streamed
    chunks carry the same offsets."""
    body = {"prompt": "x", "temperature": 0, "logprobs": 1, "dflash_forced_output": "héllo wörld 🙂"}
    for max_tokens in (6, 9, 40):
        r = post(server.url, "/v1/completions", {**body, "max_tokens": max_tokens})
        c = r.json()["choices"][0]
        text, offs = c["text"], c["logprobs"]["text_offset"]
        assert offs == sorted(offs) and all(0 <= o <= len(text) for o in offs), (text, offs)
        if max_tokens == 6:
            assert text == "héllo w"
            assert offs == [0, 1, 1, 2, 3, 5]   # 'h', the two halves of 'é', 'l', 'lo', ' w'
        # each whole-character token's text stands at its offset (special tokens add no text)
        for tok, o in zip(c["logprobs"]["tokens"], offs):
            if not tok.startswith("bytes:") and not (tok.startswith("<|") and tok.endswith("|>")):
                assert text[o:o + len(tok)] == tok, (tok, o, text)
        _, events = stream(server.url, {**body, "max_tokens": max_tokens, "stream": True}, path="/v1/completions")
        soffs = [o for e in events if e != "[DONE]" and e["choices"][0]["logprobs"]
                 for o in e["choices"][0]["logprobs"]["text_offset"]]
        assert soffs == offs


@pytest.mark.parametrize("stop,content,tokens", [("lo w", "hel", ["he", "l"]), ("llo", "he", ["he"]),
                                                 ("he", "", []), ("xyz", "hello world", None)])
def test_logprobs_end_with_the_returned_text(server, stop, content, tokens):
    """Logprobs cover the tokens whose text is (at least partly) in the returned text: a matched
    stop string's tokens are left out, streamed and not, chat and completions; usage still
    counts every generated token."""
    base = {"temperature": 0, "stop": stop, "dflash_forced_output": "hello world" + IM_END}
    r = post(server.url, "/v1/completions", {**base, "prompt": "x", "max_tokens": 12, "logprobs": 1}).json()
    c = r["choices"][0]
    assert c["text"] == content
    got = c["logprobs"]["tokens"]
    if tokens is None:   # no stop string matched: every token, the end-of-text one included
        assert "".join(got[:-1]) == content and len(got) == r["usage"]["completion_tokens"]
    else:
        assert got == tokens
        assert r["usage"]["completion_tokens"] > len(tokens)   # the stop string's tokens were generated
    assert all(o <= len(content) for o in c["logprobs"]["text_offset"])
    _, events = stream(server.url, {**base, "prompt": "x", "max_tokens": 12, "logprobs": 1}, path="/v1/completions")
    assert [t for e in events if e != "[DONE]" and e["choices"][0]["logprobs"]
            for t in e["choices"][0]["logprobs"]["tokens"]] == got
    ch = chat(server.url, {**base, "messages": msgs("x"), "max_tokens": 12, "logprobs": True})[0]
    assert [e["token"] for e in ch["choices"][0]["logprobs"]["content"]] == got
    _, events = stream(server.url, {**base, "messages": msgs("x"), "max_tokens": 12, "logprobs": True})
    assert [x["token"] for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]
            for x in e["choices"][0]["logprobs"]["content"]] == got


def test_logit_bias_forces_and_bans(server):
    base = {"messages": msgs("Hello"), "max_tokens": 5, "temperature": 0}
    forced = chat(server.url, {**base, "logit_bias": {"1300": 100}, "logprobs": True})[0]
    piece = run_cli("tokenize", *model_args(), "--decode", "1300", check=True).stdout[:-1]
    assert [e["token"] for e in forced["choices"][0]["logprobs"]["content"]] == [piece] * 5
    assert forced["choices"][0]["message"]["content"] == (piece * 5).strip(" \t\n\r")  # the parser trims
    first = chat(server.url, {**base, "logprobs": True})[0]["choices"][0]["logprobs"]["content"][0]["token"]
    ids = json.loads(run_cli("tokenize", *model_args(), "--text", first, check=True).stdout)
    if len(ids) == 1:
        banned = chat(server.url, {**base, "logit_bias": {str(ids[0]): -100}, "logprobs": True})[0]
        assert banned["choices"][0]["logprobs"]["content"][0]["token"] != first


# ---- /v1/completions ----------------------------------------------------------------------

def test_completions_shapes(server, model_id):
    r = post(server.url, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 6, "temperature": 0})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == model_id
    text = body["choices"][0]["text"]
    ids = json.loads(run_cli("tokenize", *model_args(), "--text", "def fib(n):", check=True).stdout)
    # a list of prompts (strings or ids) gives one choice each, in order
    many = post(server.url, "/v1/completions", {"prompt": ["def fib(n):", "import os"], "max_tokens": 6,
                                                "temperature": 0}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1] and many["choices"][0]["text"] == text
    by_ids = post(server.url, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == text and by_ids["usage"]["prompt_tokens"] == len(ids)
    nested = post(server.url, "/v1/completions", {"prompt": [ids, ids], "max_tokens": 6, "temperature": 0}).json()
    assert [c["text"] for c in nested["choices"]] == [text, text]
    echo = post(server.url, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 6, "temperature": 0,
                                                "echo": True}).json()
    assert echo["choices"][0]["text"] == "def fib(n):" + text
    # streamed: text chunks then a finish chunk per choice
    _, events = stream(server.url, {"prompt": ["def fib(n):", "import os"], "max_tokens": 6, "temperature": 0},
                       path="/v1/completions")
    got = {0: "", 1: ""}
    for e in events[:-1]:
        assert e["object"] == "text_completion"
        got[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert [got[0], got[1]] == [c["text"] for c in many["choices"]]


# ---- /metrics ---------------------------------------------------------------------------

def metrics(url):
    out = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_metrics(server):
    r = requests.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert "# TYPE dflash_requests_total counter" in r.text
    before = metrics(server.url)
    full, _ = chat(server.url, {"messages": msgs("Hello"), "max_tokens": 8, "temperature": 0})
    assert post(server.url, "/v1/chat/completions", {"messages": "bad"}).status_code == 400
    after = metrics(server.url)
    key = 'dflash_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[key] - before.get(key, 0) == 1
    k400 = 'dflash_requests_total{route="/v1/chat/completions",status="400"}'
    assert after[k400] - before.get(k400, 0) == 1
    assert after["dflash_errors_total"] - before["dflash_errors_total"] == 1
    assert after["dflash_prompt_tokens_total"] - before["dflash_prompt_tokens_total"] == full["usage"]["prompt_tokens"]
    assert after["dflash_generated_tokens_total"] - before["dflash_generated_tokens_total"] == \
        full["usage"]["completion_tokens"]
    t = full["timings"]
    assert after["dflash_draft_tokens_total"] - before["dflash_draft_tokens_total"] == t["draft_n"]
    assert after["dflash_draft_tokens_accepted_total"] - before["dflash_draft_tokens_accepted_total"] == \
        t["draft_n_accepted"]
    assert after["dflash_plain_steps_total"] - before["dflash_plain_steps_total"] == t["plain_steps"]
    for name, ms in (("dflash_draft_seconds_total", t["draft_ms"]), ("dflash_verify_seconds_total", t["verify_ms"])):
        assert abs((after[name] - before[name]) - ms / 1000.0) < 1e-6, name
    assert after["dflash_tokens_per_second"] > 0
    assert after["dflash_queue_depth"] == 0 and after["dflash_model_loaded"] == 1


def test_decode_speed_counts_the_tokens_after_the_first(server):
    """predicted_per_second, the log's tok/s and dflash_tokens_per_second are the tokens after
    the first (which the prefill gives) over predicted_ms: 0 for a single token, and a single
    token leaves the gauge as the last real generation set it."""
    base = {"messages": msgs("Hello"), "temperature": 0, "logit_bias": {"1984": -100, "1986": -100}}
    many, _ = chat(server.url, {**base, "max_tokens": 6})
    t = many["timings"]
    assert t["predicted_n"] == 6
    assert abs(t["predicted_per_second"] - 5 * 1000.0 / t["predicted_ms"]) < 1e-6 * t["predicted_per_second"]
    gauge = metrics(server.url)["dflash_tokens_per_second"]
    assert abs(gauge - t["predicted_per_second"]) < 1e-3 * gauge
    one, _ = chat(server.url, {**base, "max_tokens": 1})
    assert one["timings"]["predicted_n"] == 1 and one["timings"]["predicted_per_second"] == 0
    assert metrics(server.url)["dflash_tokens_per_second"] == gauge
    _, events = stream(server.url, {**base, "max_tokens": 1})
    assert [e for e in events if e != "[DONE]" and "timings" in e][0]["timings"]["predicted_per_second"] == 0
    last = [l for l in server.log_text().splitlines() if "POST /v1/chat/completions 200" in l][-1]
    assert " completion=1 " in last and " 0.0 tok/s" in last, last
    p = run_cli("generate", *model_args(), "--prompt", "hi", "--max-tokens", "1")
    assert p.returncode == 0 and "generated 1 token in" in p.stderr and "(0.0 tok/s)" in p.stderr, p.stderr


# ---- queue, cancellation, shutdown ------------------------------------------------------

def test_delay_hook(server, plain_server):
    """dflash_delay_ms (--test-hooks only) slows a generation by its sleep at each token, and is
    range-checked; a server without --test-hooks ignores it like any unknown field."""
    body = {"messages": msgs("Hello"), "max_tokens": 8, "temperature": 0}
    t0 = time.time()
    r = post(server.url, "/v1/chat/completions", {**body, "dflash_delay_ms": 100})
    assert r.status_code == 200, r.text
    assert time.time() - t0 >= 0.1 * r.json()["usage"]["completion_tokens"]
    for bad in (-1, 1001, "5", 2.5):
        assert_error(post(server.url, "/v1/chat/completions", {**body, "dflash_delay_ms": bad}), 400,
                     param="dflash_delay_ms")
    r = post(plain_server.url, "/v1/chat/completions", {**body, "dflash_delay_ms": 1001})
    assert r.status_code == 200, r.text


def test_full_queue_answers_503():
    with Server("--queue", "1", "--test-hooks") as s:
        results = []

        def one():   # each 200 takes at least 1.2 s (the delay hook), on any device
            r = post(s.url, "/v1/chat/completions", {"messages": msgs("Tell me a story."), "max_tokens": 120,
                                                      "temperature": 0, "dflash_delay_ms": 10})
            results.append((r.status_code, r.headers.get("Retry-After"), r.json()))
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(300)
        statuses = sorted(r[0] for r in results)
        assert len(results) == 6
        assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
        assert set(statuses) <= {200, 503}
        for status, retry, body in results:
            if status == 503:
                assert body["error"]["code"] == "queue_full" and int(retry) >= 1
        ok = [b["choices"][0]["message"]["content"] for st, _, b in results if st == 200]
        assert len(set(ok)) == 1   # the same greedy request: the same answer every time
        m = metrics(s.url)
        assert m['dflash_requests_total{route="/v1/chat/completions",status="503"}'] == statuses.count(503)
        check_clean_exit(s)


def test_clients_that_leave_the_queue_free_their_places():
    """Waiting requests whose clients hang up are dropped before the queue is judged full."""
    with Server("--queue", "2", "--test-hooks") as s:
        long_req = {"messages": msgs("Hi"), "max_tokens": 100000, "temperature": 0,
                    "logit_bias": {"1984": -100, "1986": -100}, "stream": True, "dflash_delay_ms": 20}
        r = requests.post(s.url + "/v1/chat/completions", stream=True, timeout=60, json=long_req)
        it = r.iter_lines()
        next(it)   # the long generation is running
        host, port = s.url.split("//")[1].split(":")
        for _ in range(2):   # two waiting requests whose clients then leave
            body = json.dumps({"messages": msgs("x"), "max_tokens": 2, "temperature": 0}).encode()
            c = socket.create_connection((host, int(port)))
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.3)
            c.close()
        # no other request comes: the running generation's own checks find them within 250 ms
        deadline = time.time() + 10
        while len([l for l in s.log_text().splitlines() if " 499 " in l and "while waiting" in l]) < 2:
            assert time.time() < deadline, s.log_text()[-2000:]
            time.sleep(0.05)
        # their end lines give the prompt's tokens as their arrival lines do (none was processed)
        lines = s.log_text().splitlines()
        for end in [l for l in lines if " 499 " in l and "while waiting" in l]:
            seq = re.search(r"#(\d+) ", end).group(1)
            arrival = next(l for l in lines if f"#{seq} " in l and ": mode=" in l)
            assert re.search(r" prompt=(\d+)", end).group(1) == re.search(r" prompt=(\d+)", arrival).group(1)
        m = metrics(s.url)
        assert m["dflash_queue_depth"] == 0
        assert m["dflash_cancelled_total"] == 0 and m["dflash_plain_requests_total"] == 0   # no generation of theirs
        done = []
        t = threading.Thread(target=lambda: done.append(
            post(s.url, "/v1/chat/completions", {"messages": msgs("y"), "max_tokens": 2, "temperature": 0})))
        t.start()
        time.sleep(0.5)
        r.close()   # end the long generation: the new request runs next
        t.join(120)
        assert done and done[0].status_code == 200, done and done[0].text
        after = metrics(s.url)
        assert after["dflash_cancelled_total"] == 1   # the long stream; the two that left never ran
        check_clean_exit(s)


def test_error_details_and_log_lines_are_exact():
    """A range error quotes the value as sent; a context overflow among several prompts names
    the prompt; log lines keep UTF-8 text and give each request one number, without gaps."""
    with Server("--model-id", "mödel ü") as s:
        r = post(s.url, "/v1/chat/completions", {"messages": msgs("hi"), "temperature": 2.0000001})
        assert r.status_code == 400 and "but got 2.0000001 instead" in r.json()["error"]["message"], r.text
        r = post(s.url, "/v1/chat/completions", {"messages": msgs("hi"), "logit_bias": {"5": -100.0000001}})
        assert r.status_code == 400 and "-100.0000001" in r.json()["error"]["message"], r.text
        r = post(s.url, "/v1/chat/completions", {"messages": msgs("hi"), "seed": 9.2233720368547758e18})
        assert r.status_code == 400 and "but got 9.223372036854776e+18 instead" in r.json()["error"]["message"], r.text
        r = post(s.url, "/v1/completions", {"prompt": [[1, 2], [1] * 5000], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
        r = post(s.url, "/v1/chat/completions", {"model": "other", "messages": msgs("hi")})
        assert r.status_code == 404 and "mödel ü" in r.json()["error"]["message"], r.text
        r = post(s.url, "/v1/chat/completions", {"messages": msgs("hi"), "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        log = s.log_text()
        assert "POST /v1/chat/completions 404" in log and "'mödel ü'" in log, log
        assert "max_tokens=2" in log
        nums = [int(n) for n in re.findall(r"^\S+ #(\d+) ", log, re.M)]
        assert sorted(set(nums)) == list(range(1, max(nums) + 1)), log
        check_clean_exit(s)


def test_disconnect_mid_stream_cancels(server):
    before = metrics(server.url)
    r = requests.post(server.url + "/v1/chat/completions", stream=True, timeout=60,
                      json={"messages": msgs("Hi"), "max_tokens": 100000, "temperature": 0, "logit_bias": {"1984": -100, "1986": -100}, "stream": True})
    it = r.iter_lines()
    for _ in range(6):
        next(it)
    r.close()   # hang up mid-stream
    t0 = time.time()
    full, _ = chat(server.url, {"messages": msgs("Hello"), "max_tokens": 2, "temperature": 0})
    assert time.time() - t0 < (60 if SANITIZED else 15)
    after = metrics(server.url)
    assert after["dflash_cancelled_total"] - before["dflash_cancelled_total"] == 1
    assert after["dflash_generated_tokens_total"] - before["dflash_generated_tokens_total"] < 5000


def test_shutdown_during_stream():
    with Server() as s:
        r = requests.post(s.url + "/v1/chat/completions", stream=True, timeout=60,
                          json={"messages": msgs("Hi"), "max_tokens": 100000, "temperature": 0, "logit_bias": {"1984": -100, "1986": -100}, "stream": True})
        lines = (x.decode() for x in r.iter_lines())
        assert next(lines).startswith("data: ")
        s.proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]
        # the stream ends cleanly with an error event: the server is shutting down
        assert rest and "shutting down" in rest[-1]
        assert s.proc.wait(60) == 0
        assert "stopped" in s.log_text()


def test_queued_stream_turned_away_at_shutdown_gets_503():
    """A streamed request still waiting in the queue has no answer yet: at shutdown it gets a
    real 503 JSON error (the 200 and the events come only once its generation starts)."""
    with Server() as s:
        long_req = {"messages": msgs("Hi"), "max_tokens": 100000, "temperature": 0,
                    "logit_bias": {"1984": -100, "1986": -100}, "stream": True}
        r = requests.post(s.url + "/v1/chat/completions", stream=True, timeout=60, json=long_req)
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")   # the long generation runs
        queued = {}

        def wait_in_queue():
            q = requests.post(s.url + "/v1/completions", timeout=60,
                              json={"prompt": "x", "max_tokens": 4, "stream": True})
            queued.update(status=q.status_code, headers=q.headers, text=q.text)
        t = threading.Thread(target=wait_in_queue)
        t.start()
        deadline = time.time() + 30
        while metrics(s.url)["dflash_queue_depth"] < 1:
            assert time.time() < deadline
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert queued["status"] == 503, queued
        assert queued["headers"]["Content-Type"].startswith("application/json")
        assert int(queued["headers"]["Retry-After"]) >= 1
        assert json.loads(queued["text"])["error"]["code"] == "shutting_down"
        rest = [x.decode() for x in lines if x]
        assert rest and "shutting down" in rest[-1]   # the running stream ends with an error event
        assert s.proc.wait(60) == 0
        log = s.log_text()
        assert " 503 " in log   # the queued request's answer
        # the running stream's client got 200 and an error event: its end line says so
        ends = [l for l in log.splitlines() if "POST /v1/chat/completions 200" in l]
        assert ends and "error event 503: " in ends[-1], ends


def test_load_failure_exits_1(tmp_path):
    p = run_cli("serve", "--port", "0", "--model", str(tmp_path))
    assert p.returncode == 1
    log = [l for l in p.stderr.splitlines() if "loading failed" in l]
    final = [l for l in p.stderr.splitlines() if l.startswith("dflash serve:")]
    assert log and final
    assert str(tmp_path) not in log[0]   # the log (like HTTP answers) names the folder by its public id
    assert str(tmp_path) in final[0]     # the operator's final error names it as typed
    lines = p.stderr.splitlines()
    listen = [i for i, l in enumerate(lines) if "listening on http://" in l]
    failed = [i for i, l in enumerate(lines) if "loading failed" in l]
    assert listen and failed and listen[0] < failed[0], p.stderr   # where it listens, then the failure


def test_curl_streaming(server):
    import subprocess
    body = {"messages": msgs("def fib(n):"), "max_tokens": 10, "temperature": 0}
    full, _ = chat(server.url, body)
    out = subprocess.run(["curl", "-sN", "-D", "-", "-H", "Content-Type: application/json", "-d",
                          json.dumps({**body, "stream": True}), server.url + "/v1/chat/completions"],
                         capture_output=True, timeout=120, check=True).stdout.decode()
    head, _, sse = out.partition("\r\n\r\n")
    assert "x-dflash: speculative" in head and "text/event-stream" in head and "chunked" in head.lower()
    events = [json.loads(l[6:]) if l[6:] != "[DONE]" else "[DONE]" for l in sse.splitlines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert assemble(events)[1] == (full["choices"][0]["message"]["content"] or "")
