"""Fixtures that run the real `cachet` binary with the simulated executor.

Environment:
  CACHET_BIN               path of the binary (default: <repo>/target/release/cachet)
  CACHET_E2E_SERVER_ARGS   extra arguments for every `cachet serve` started here
  CACHET_E2E_REAL_MODEL=1  also run the real-model smoke test; its arguments come from
                           CACHET_E2E_MODEL_ARGS (e.g. "--model /path/model.gguf")
  CACHET_E2E_STARTUP_S     seconds to wait for /health (default 120)
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("CACHET_BIN", str(ROOT / "target" / "release" / "cachet"))
BLOCK_SIZE = 16
API_KEY = "e2e-secret-key"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    port: int
    proc: subprocess.Popen
    log_path: str
    api_key: str | None = None
    args: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def model(self) -> str:
        r = requests.get(f"{self.base_url}/v1/models", headers=self.headers, timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def log(self) -> str:
        try:
            return pathlib.Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(extra: list[str], api_key: str | None = None, executor_args: list[str] | None = None) -> Server:
    if not os.path.exists(BIN):
        pytest.fail(
            f"cachet binary not found at {BIN}: build it with `cargo build --release -p cachet` "
            "or point CACHET_BIN at it"
        )
    port = free_port()
    if executor_args is None:
        executor_args = ["--executor", "sim", "--block-size", str(BLOCK_SIZE)]
    cmd = [BIN, "serve", *executor_args, "--host", "127.0.0.1", "--port", str(port), *extra]
    cmd += shlex.split(os.environ.get("CACHET_E2E_SERVER_ARGS", ""))
    if api_key:
        cmd += ["--api-key", api_key]
    log = tempfile.NamedTemporaryFile(prefix="cachet-e2e-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    server = Server(port=port, proc=proc, log_path=log.name, api_key=api_key, args=cmd)
    deadline = time.monotonic() + float(os.environ.get("CACHET_E2E_STARTUP_S", "120"))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"cachet exited with {proc.returncode} at startup: {cmd}\n{server.log()}")
        try:
            if requests.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"cachet did not become healthy in time: {cmd}\n{server.log()}")


def start_agent_cli_server(reply: str) -> Server:
    """The server a coding-agent CLI (Claude Code, Codex) talks to: a context long enough for
    its tens of thousands of byte tokens, 32768 blocks of 16 (room for two turns' prompts in
    the cache), and every answer the scripted `reply`."""
    return start_server(
        [
            "--max-model-len", "200000",
            "--num-kv-blocks", "32768",
            "--max-num-batched-tokens", "8192",
            "--sim-reply", reply,
            "--enable-per-request-metrics",
        ]
    )


def prefix_cache_hits(server: Server) -> float:
    """`vllm:prefix_cache_hits_total` from the server's /metrics."""
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert m, "vllm:prefix_cache_hits_total missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def server():
    """Simulated executor, per-request metrics on."""
    s = start_server(["--enable-per-request-metrics"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server():
    """Simulated executor, default flags."""
    s = start_server([])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def auth_server():
    """Simulated executor behind an API key."""
    s = start_server([], api_key=API_KEY)
    yield s
    s.stop()
