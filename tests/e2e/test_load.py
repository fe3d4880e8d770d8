"""The load test (tools/loadtest.py) in a small configuration: no request lost or answered
twice, /metrics agrees with what the clients saw, and a full queue answers 503 + Retry-After.
The 200-request figures of docs/PERFORMANCE.md come from the same script."""
import json
import subprocess
import sys

from conftest import DFLASH_BIN, SANITIZED, SOURCE_DIR, base_env, model_args

SCRIPT = str(SOURCE_DIR / "tools" / "loadtest.py")


def loadtest(*args):
    p = subprocess.run([sys.executable, SCRIPT, "--bin", DFLASH_BIN, *args, "--", *model_args()],
                       capture_output=True, text=True, timeout=900, env=base_env())
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and not summary["problems"], p.stdout + p.stderr
    return summary


def test_load_all_answered():
    n = 16 if SANITIZED else 40
    s = loadtest("--requests", str(n), "--concurrency", "8", "--max-tokens", "6")
    assert s["ok"] == n and s["busy_503"] == 0 and s["lost"] == 0
    assert s["generated_tokens"] <= n * 6 and s["p50_ms"] <= s["p99_ms"]


def test_load_full_queue_503():
    s = loadtest("--requests", "24", "--concurrency", "8", "--max-tokens", "6", "--queue", "1")
    assert s["busy_503"] > 0 and s["ok"] >= 2 and s["ok"] + s["busy_503"] == 24
