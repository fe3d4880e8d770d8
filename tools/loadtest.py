#!/usr/bin/env python3
"""Load test for `dflash serve` (loopback only, bounded).

Sends --requests chat completions (half of them streamed) with at most --concurrency in flight,
each with a distinct prompt and small max_tokens, and checks the accounting:
  - every request got exactly one answer: 200, or 503 (queue full, with Retry-After);
  - a 200 carries one completion (one finish_reason; a stream ends with exactly one [DONE])
    whose id no other answer has;
  - the server's /metrics counted exactly the 200s and 503s the clients saw.
Prints latency percentiles (p50/p90/p99 of the 200s), the engine's busy time (prefill + decode,
from /metrics: the floor of the wall time, as one request generates at a time) and a JSON
summary line; exits 1 if a check fails.

  tools/loadtest.py --bin build/dflash [--requests 200] [--concurrency 8] [--max-tokens 8] [--queue 16]
  tools/loadtest.py --url http://127.0.0.1:8080 ...      # an already running server

With --bin it starts the server itself on a free loopback port (extra serve options after --).
Only 127.0.0.1 / localhost URLs are accepted.
"""
import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.parse


async def http(host, port, method, path, body=None, timeout=600):
    """One HTTP/1.1 request on its own connection; returns (status, headers, body bytes)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        writer.write(head + data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, pos = b"", 0
        while True:
            nl = rest.index(b"\r\n", pos)
            size = int(rest[pos:nl].split(b";")[0], 16)
            if size == 0:
                break
            out += rest[nl + 2:nl + 2 + size]
            pos = nl + 2 + size + 2
        rest = out
    return status, headers, rest


def metrics(text):
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def check_answer(i, stream, status, headers, body, problems):
    """The id of a 200 answer (None otherwise); problems gets what is wrong."""
    if status == 503:
        if "retry-after" not in headers:
            problems.append(f"request {i}: 503 without Retry-After")
        return None
    if status != 200:
        problems.append(f"request {i}: status {status}: {body[:200]!r}")
        return None
    if not stream:
        j = json.loads(body)
        if len(j["choices"]) != 1 or j["choices"][0]["finish_reason"] not in ("stop", "length"):
            problems.append(f"request {i}: bad choices {j['choices']}")
        return j["id"]
    events = [l[6:] for l in body.decode().split("\n") if l.startswith("data: ")]
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        problems.append(f"request {i}: stream without exactly one final [DONE]")
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    ids = {c["id"] for c in chunks}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    if len(ids) != 1 or len(finishes) != 1:
        problems.append(f"request {i}: {len(ids)} ids, {len(finishes)} finish chunks in one stream")
    return ids.pop() if ids else None


async def run(host, port, n, concurrency, max_tokens):
    sem = asyncio.Semaphore(concurrency)
    results = [None] * n
    problems = []

    async def one(i):
        stream = i % 2 == 1
        body = {"messages": [{"role": "user", "content": f"Request {i}: say something about the number {i}."}],
                "max_tokens": max_tokens, "temperature": 0, "user": f"load-{i}"}
        if stream:
            body["stream"] = True
        async with sem:
            t0 = time.perf_counter()
            try:
                status, headers, data = await http(host, port, "POST", "/v1/chat/completions", body)
            except Exception as e:  # noqa: BLE001 - a lost request is reported, not raised
                problems.append(f"request {i}: no answer ({e!r})")
                return
            dt = time.perf_counter() - t0
        results[i] = (status, dt, check_answer(i, stream, status, headers, data, problems))

    before = metrics((await http(host, port, "GET", "/metrics"))[2].decode())
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    after = metrics((await http(host, port, "GET", "/metrics"))[2].decode())

    answered = [r for r in results if r is not None]
    ok = [r for r in answered if r[0] == 200]
    busy = [r for r in answered if r[0] == 503]
    if len(answered) != n:
        problems.append(f"{n - len(answered)} requests lost")
    ids = [r[2] for r in ok if r[2]]
    if len(set(ids)) != len(ids):
        problems.append("an answer id was given twice")
    route = 'dflash_requests_total{route="/v1/chat/completions",status="%d"}'
    for status, got in [(200, len(ok)), (503, len(busy))]:
        counted = after.get(route % status, 0) - before.get(route % status, 0)
        if counted != got:
            problems.append(f"/metrics counted {counted:.0f} answers with status {status}, the clients saw {got}")
    lat = sorted(r[1] for r in ok)

    def pct(p):
        return lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] * 1000 if lat else 0.0
    summary = {"requests": n, "concurrency": concurrency, "max_tokens": max_tokens, "ok": len(ok), "busy_503": len(busy),
               "lost": n - len(answered), "wall_s": round(wall, 3), "req_per_s": round(n / wall, 2),
               "p50_ms": round(pct(50), 1), "p90_ms": round(pct(90), 1), "p99_ms": round(pct(99), 1),
               "max_ms": round(lat[-1] * 1000, 1) if lat else 0.0,
               "generated_tokens": int(after["dflash_generated_tokens_total"] - before["dflash_generated_tokens_total"]),
               # time the engine spent prefilling and decoding: the floor of the wall time,
               # since one request generates at a time
               "engine_s": round(after["dflash_generation_seconds_total"] - before["dflash_generation_seconds_total"], 3),
               "problems": problems}
    return summary


def start_server(binary, extra):
    proc = subprocess.Popen([binary, "serve", "--port", "0", *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    port = None
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"dflash serve exited {proc.wait()}")
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
        if port and "serving model" in line:
            break
    if not port:
        proc.kill()
        raise SystemExit("dflash serve did not start")
    # keep draining its log so it never blocks on a full pipe
    import threading
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, port


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback only)")
    ap.add_argument("--bin", help="the dflash binary: start a server for the test")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--queue", type=int, default=None, help="with --bin: the server's --queue")
    ap.add_argument("serve_args", nargs="*", help="with --bin: more `dflash serve` options (after --)")
    a = ap.parse_args()
    if not 1 <= a.requests <= 10000 or not 1 <= a.concurrency <= 256:
        ap.error("--requests must lie within 1..10000 and --concurrency within 1..256")
    proc = None
    if a.bin:
        extra = list(a.serve_args) + (["--queue", str(a.queue)] if a.queue is not None else [])
        proc, port = start_server(a.bin, extra)
        host = "127.0.0.1"
    elif a.url:
        u = urllib.parse.urlparse(a.url)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            ap.error("only loopback URLs are allowed")
        host, port = u.hostname, u.port or 80
    else:
        ap.error("give --bin or --url")
    try:
        s = asyncio.run(run(host, port, a.requests, a.concurrency, a.max_tokens))
    finally:
        if proc:
            proc.terminate()
            proc.wait(60)
    print(f"{s['requests']} requests, concurrency {s['concurrency']}, max_tokens {s['max_tokens']}: "
          f"{s['ok']} ok, {s['busy_503']} busy (503), {s['lost']} lost in {s['wall_s']} s "
          f"({s['req_per_s']} req/s); latency p50 {s['p50_ms']} ms, p90 {s['p90_ms']} ms, p99 {s['p99_ms']} ms, "
          f"max {s['max_ms']} ms; engine busy {s['engine_s']} s = {100 * s['engine_s'] / s['wall_s']:.1f}% of the wall time")
    for p in s["problems"]:
        print("PROBLEM:", p)
    print(json.dumps(s))
    return 1 if s["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
