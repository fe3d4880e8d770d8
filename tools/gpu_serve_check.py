#!/usr/bin/env python3
"""The server on the GPU with a large pack: answers, token identity and speed (a device check).

Starts `dflash serve --device cuda` (with the drafter: greedy requests are speculative) on a free
loopback port and checks, for each prompt:
  - a greedy completion (/v1/completions, non-streamed) has the text of `dflash generate
    --device cuda --prompt` without a drafter (plain greedy decoding);
  - the same request streamed gives the same text;
  - the first request runs at nearly the speed of the next ones (the server warms up while
    loading);
  - the prompts sent at once (they queue behind each other) give the same answers again;
then stops the server with SIGTERM (exit status 0). Prints per request the wall time, the
completion tokens, tokens/s and the server's x-dflash header, and one JSON summary line; exits 1
if a check fails.

  tools/gpu_serve_check.py --bin prebuilt/dflash-srv --model /tmp/p27 --drafter /tmp/p27/drafter
"""
import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["Write a function that reverses a linked list.", "What is the capital of France?",
           "List five prime numbers and explain why each is prime."]


def post(url, body, timeout=600):
    """POST body as JSON; returns (status, headers, body bytes, seconds)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
            return r.status, dict(r.headers), data, time.time() - t0
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read(), time.time() - t0


def stream_text(url, body, timeout=600):
    """The streamed answer's text, its first chunk's latency and the total seconds."""
    req = urllib.request.Request(url, data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    first = None
    text = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text")
            if piece:
                first = first if first is not None else time.time() - t0
                text.append(piece)
    return "".join(text), first, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    prompts = PROMPTS[:a.prompts]
    fails = []

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open("/tmp/gpu-serve.log", "w")
    t0 = time.time()
    srv = subprocess.Popen([a.bin, "serve", "--device", a.device, "--model", a.model, "--drafter", a.drafter,
                            "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        if srv.poll() is not None or time.time() - t0 > 300:
            print(open("/tmp/gpu-serve.log").read()[-3000:])
            sys.exit("the server did not start")
        time.sleep(0.2)
    print(f"server ready in {time.time() - t0:.1f} s")

    def body(p):
        return {"prompt": p, "max_tokens": a.max_tokens, "temperature": 0}

    answers, speeds = [], []
    for p in prompts:
        st, hdr, data, sec = post(url + "/v1/completions", body(p))
        if st != 200:
            fails.append(f"{p!r}: status {st}: {data[:300]!r}")
            answers.append(None)
            continue
        j = json.loads(data)
        text, n = j["choices"][0]["text"], j["usage"]["completion_tokens"]
        answers.append(text)
        speeds.append(n / sec)
        print(f"completion {p[:30]!r}: {n} tokens in {sec:.3f} s = {n / sec:.1f} tok/s (prompt {j['usage']['prompt_tokens']}),"
              f" x-dflash: {hdr.get('x-dflash', hdr.get('X-Dflash', '-'))}")
        stext, first, ssec = stream_text(url + "/v1/completions", body(p))
        print(f"  streamed: first text after {first if first is None else round(first, 3)} s, all in {ssec:.3f} s")
        if stext != text:
            fails.append(f"{p!r}: the streamed text differs from the non-streamed one")
    # the server warms up while loading: its first request is not slowed by uploads
    if len(speeds) >= 2 and speeds[0] < 0.7 * max(speeds[1:]):
        fails.append(f"the first request ran at {speeds[0]:.1f} tok/s, the next at {max(speeds[1:]):.1f}")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        t1 = time.time()
        res = list(ex.map(lambda p: post(url + "/v1/completions", body(p)), prompts))
        print(f"{len(prompts)} requests at once: all answered in {time.time() - t1:.3f} s")
    for p, want, (st, _, data, _) in zip(prompts, answers, res):
        got = json.loads(data)["choices"][0]["text"] if st == 200 else None
        if st != 200 or got != want:
            fails.append(f"{p!r}: concurrent answer differs (status {st})")
    srv.send_signal(signal.SIGTERM)
    rc = srv.wait(timeout=120)
    if rc != 0:
        fails.append(f"the server exited {rc} on SIGTERM")

    for p, want in zip(prompts, answers):
        t1 = time.time()
        g = subprocess.run([a.bin, "generate", "--device", a.device, "--model", a.model, "--prompt", p, "--max-tokens",
                            str(a.max_tokens), "--temperature", "0", "--json"], capture_output=True, text=True)
        if g.returncode != 0:
            fails.append(f"generate {p!r} exited {g.returncode}: {g.stderr[-500:]}")
            continue
        j = json.loads(g.stdout)
        print(f"generate (plain, a process of its own) {p[:30]!r}: {len(j['ids'])} tokens, {time.time() - t1:.1f} s with loading")
        if want is not None and j["text"] != want:
            fails.append(f"{p!r}: the server's speculative answer differs from plain generate's")
    for f in fails:
        print("FAIL:", f)
    print(json.dumps({"prompts": len(prompts), "failures": len(fails)}))
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
