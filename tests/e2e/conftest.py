"""End-to-end fixtures: the real `dflash` binary, run as a server on a free port.

Environment (set by CTest):
  DFLASH_BIN         the dflash executable (default: <source>/build/dflash)
  DFLASH_SOURCE_DIR  the source tree (default: two levels above this file)
  DFLASH_FIXTURES    the decompressed test fixtures (for DFLASH_E2E_MODEL=tiny-bonsai2)
  DFLASH_E2E_MODEL   "demo" (default: the embedded demo model, found with no --model),
                     "tiny-bonsai2" (the fixture pack) or a pack folder
  DFLASH_E2E_SANITIZED  set when DFLASH_BIN is an ASan/UBSan build: slower, so timing
                     bounds are relaxed
  DFLASH_E2E_DEVICE  "cuda" runs every server and every `generate` of the tests on the GPU
                     (`--device cuda`; default: the CPU)

The drafter of every speculative test is tests/fixtures/tiny-dflash (random weights, made
for tiny-bonsai2, whose shapes the demo model shares).
"""
import json
import os
import pathlib
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time

import pytest
import requests

SOURCE_DIR = pathlib.Path(os.environ.get("DFLASH_SOURCE_DIR") or pathlib.Path(__file__).resolve().parents[2])
DFLASH_BIN = os.environ.get("DFLASH_BIN") or str(SOURCE_DIR / "build" / "dflash")
STARTUP_TIMEOUT_S = 120
SANITIZED = bool(os.environ.get("DFLASH_E2E_SANITIZED"))
FIXTURES = pathlib.Path(os.environ.get("DFLASH_FIXTURES") or (SOURCE_DIR / "tests" / "fixtures"))
DRAFTER = str(FIXTURES / "tiny-dflash")
DEVICE = os.environ.get("DFLASH_E2E_DEVICE", "")
DEVICE_ARGS = ["--device", DEVICE] if DEVICE else []


def model_dir():
    """The pack the tests run on, or None for the embedded demo model (no --model)."""
    choice = os.environ.get("DFLASH_E2E_MODEL", "demo")
    if choice == "demo":
        return None
    if choice == "tiny-bonsai2":
        return str(FIXTURES / "tiny-bonsai2")
    return choice


def model_args():
    d = model_dir()
    return ["--model", d] if d else []


def nan_pack(dst):
    """A copy of the tests' pack in dst with every F16 tensor filled with NaN (0x7fff): its
    logits are never finite. Returns dst as a string."""
    src = pathlib.Path(model_dir() or SOURCE_DIR / "models" / "demo")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference*"))
    path = pathlib.Path(dst) / "model.safetensors"
    b = bytearray(path.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    for name, t in json.loads(b[8:8 + n]).items():
        if name != "__metadata__" and t["dtype"] == "F16":
            lo, hi = t["data_offsets"]
            b[8 + n + lo:8 + n + hi] = b"\xff\x7f" * ((hi - lo) // 2)
    path.write_bytes(bytes(b))
    return str(dst)


def base_env():
    """The environment for the binary: no DFLASH_MODEL / DFLASH_API_KEY from the caller."""
    env = dict(os.environ)
    env.pop("DFLASH_MODEL", None)
    env.pop("DFLASH_API_KEY", None)
    return env


def run_cli(*args, env=None, timeout=300, check=False):
    """Runs `dflash ARGS...` (a `generate` on DFLASH_E2E_DEVICE); returns the CompletedProcess
    (text mode)."""
    if args and args[0] == "generate" and "--device" not in args:
        args = (args[0], *DEVICE_ARGS, *args[1:])
    p = subprocess.run([DFLASH_BIN, *args], capture_output=True, text=True, timeout=timeout,
                       env=env if env is not None else base_env())
    if check and p.returncode != 0:
        raise AssertionError(f"dflash {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `dflash serve` process on a free port, its stderr in a log file."""

    def __init__(self, *extra, env=None, model=None):
        """model: a pack folder instead of the tests' pack."""
        self.extra = list(extra)
        self.model_args = ["--model", model] if model else model_args()
        self.env = env if env is not None else base_env()
        self.log = tempfile.NamedTemporaryFile(prefix="dflash-serve-", suffix=".log", delete=False)
        self.proc = None
        for _ in range(5):   # a free port can be taken between the probe and the bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.proc = subprocess.Popen(
                [DFLASH_BIN, "serve", "--port", str(self.port), *DEVICE_ARGS, *self.model_args, *self.extra],
                stdout=subprocess.DEVNULL, stderr=self.log, env=self.env)
            if self._wait_ready():
                return
            if "cannot listen" not in self.log_text():
                break
        raise RuntimeError(f"dflash serve did not start:\n{self.log_text()}")

    def _wait_ready(self):
        deadline = time.time() + STARTUP_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.proc.kill()
        self.proc.wait()
        return False

    def log_text(self):
        with open(self.log.name, "r", errors="replace") as f:
            return f.read()

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Stops the server with sig; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("dflash serve did not stop within %ds" % timeout)
        return self.proc.returncode

    def close(self):
        try:
            self.stop()
        finally:
            if os.path.exists(self.log.name):
                os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for_log(s, text, timeout=60):
    """s's log once it holds text (asserted within timeout seconds)."""
    deadline = time.time() + timeout
    while text not in s.log_text():
        assert time.time() < deadline, f"{text!r} not logged:\n{s.log_text()[-2000:]}"
        time.sleep(0.05)
    return s.log_text()


def check_clean_exit(s):
    """Stops s with SIGTERM: it must exit 0 after logging "stopped" (and, under a sanitizer,
    without a report)."""
    status = s.stop()
    log = s.log_text()
    s.close()
    assert status == 0, f"dflash serve exited {status} on SIGTERM:\n{log[-4000:]}"
    assert "stopped" in log
    assert "Sanitizer" not in log, log[-4000:]


@pytest.fixture(scope="session")
def server():
    """The main server: the drafter loaded (greedy requests are speculative) and the test hook
    that forces a request's output (dflash_forced_output) enabled."""
    s = Server("--drafter", DRAFTER, "--test-hooks")
    yield s
    check_clean_exit(s)


@pytest.fixture(scope="session")
def plain_server():
    """A server without a drafter: every request decodes plainly."""
    s = Server()
    yield s
    check_clean_exit(s)


@pytest.fixture(scope="session")
def model_id(server):
    return requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="session")
def chat(server, model_id):
    """chat(messages or text, **fields) -> (status, json body, headers)."""
    def call(messages, **fields):
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = {"model": model_id, "messages": messages, **fields}
        r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        return r.status_code, r.json(), r.headers
    return call


def chatml(*turns):
    """The prompt the pack's (Qwen3.5) template renders for plain turns, thinking off."""
    s = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return s + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def tokenize(text):
    p = run_cli("tokenize", *model_args(), "--text", text, check=True)
    return json.loads(p.stdout)


def assert_error(r, status, code=None, param=None):
    """r answers with `status` and an OpenAI error object; returns the error."""
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "code", "param"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err
