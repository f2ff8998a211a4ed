"""Helpers of the external-KV-tier end-to-end tests (test_tiers*.py): real `redis-server`
processes (one node, or a Redis Cluster made with `redis-cli --cluster create`) on free loopback
ports, a minimal RESP client for the test's own admin commands, `/metrics` parsing, and
requests that return what a response said about its prompt's KV.

Redis comes from scripts/test-deps-redis.sh (installed by `make test` when missing); without
it these tests skip with a message.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import pytest
import requests

from conftest import BLOCK_SIZE, ROOT, Server, free_port, start_server

SIM = ["--executor", "sim", "--block-size", str(BLOCK_SIZE)]
# The simulator's KV: one u64 fingerprint per token.
SIM_BLOCK_BYTES = BLOCK_SIZE * 8


def need_redis() -> None:
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        return
    subprocess.run(["bash", str(ROOT / "scripts" / "test-deps-redis.sh")], check=False)
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server/redis-cli missing and scripts/test-deps-redis.sh could not install them")


def whole_blocks(n_prompt: int) -> int:
    """Tokens an external tier can supply for an N-token prompt: whole blocks, capped at N-1."""
    return (n_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


# --- a minimal RESP client (admin commands of the tests; the servers use the redis crate) ----


class RedisError(Exception):
    pass


class Resp:
    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        self.buf += chunk

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2 :]
        return data

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RedisError(f"unexpected reply {line!r}")

    def cmd(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        self.sock.sendall(b"".join(out))
        return self._reply()


def resp(port: int, *args, timeout: float = 10.0):
    c = Resp(port, timeout)
    try:
        return c.cmd(*args)
    finally:
        c.close()


class RedisNode:
    """One `redis-server` on a loopback port: no persistence, DEBUG enabled."""

    def __init__(self, port: int | None = None, extra: list[str] | None = None):
        need_redis()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="cachet-redis-")
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "RedisNode":
        cmd = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--enable-debug-command", "yes",
            "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log"), *self.extra,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = open(os.path.join(self.dir, "redis.log"), errors="replace").read()[-500:]
                self.proc = None
                raise RuntimeError(f"redis-server exited at start on port {self.port}: {log}")
            try:
                if resp(self.port, "PING", timeout=0.5) == "PONG":
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError("redis-server did not answer PING")

    def cmd(self, *args):
        return resp(self.port, *args)

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def keys(self, pattern: str = "cachet:*") -> list[bytes]:
        return sorted(self.cmd("KEYS", pattern))


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_cluster_port() -> int:
    """A free port p <= 55535 whose cluster bus port p + 10000 is free too."""
    import random

    for _ in range(200):
        p = random.randint(20000, 55535)
        if _bindable(p) and _bindable(p + 10000):
            return p
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisCluster:
    """`masters` masters (and `replicas` replicas each) made with `redis-cli --cluster create`."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000):
        need_redis()
        extra = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms)]
        self.nodes: list[RedisNode] = []
        try:
            self._create(masters, replicas, extra)
        except BaseException:
            self.stop()
            raise

    def _create(self, masters: int, replicas: int, extra: list[str]) -> None:
        for _ in range(masters * (1 + replicas)):
            n = RedisNode(port=free_cluster_port(), extra=extra + ["--cluster-config-file", "nodes.conf"])
            self.nodes.append(n)
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run(
            ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", str(replicas),
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}\n{out.stderr}")
        self.wait_ok(self.nodes)
        if replicas:
            wait_for(lambda: len(self.masters()) == masters and all(
                self.info(m, "replication").get("connected_slaves") == str(replicas)
                for m in self.masters()), "replicas attached", 30)

    @staticmethod
    def info(node: RedisNode, section: str) -> dict[str, str]:
        text = node.cmd("INFO", section).decode()
        return dict(l.split(":", 1) for l in text.splitlines() if ":" in l and not l.startswith("#"))

    def live(self) -> list[RedisNode]:
        return [n for n in self.nodes if n.proc is not None]

    def masters(self) -> list[RedisNode]:
        return [n for n in self.live() if self.info(n, "replication").get("role") == "master"]

    def wait_ok(self, nodes: list[RedisNode], timeout: float = 30) -> None:
        def ok() -> bool:
            try:
                return all(b"cluster_state:ok" in n.cmd("CLUSTER", "INFO") for n in nodes)
            except (OSError, RedisError):
                return False

        wait_for(ok, "cluster_state:ok", timeout)

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


# --- servers, requests, metrics ---------------------------------------------------------------


def wait_for(pred, what: str, timeout: float = 20.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def model_args() -> list[str]:
    return shlex.split(os.environ.get("CACHET_E2E_MODEL_ARGS", ""))


def real_model() -> bool:
    return os.environ.get("CACHET_E2E_REAL_MODEL") == "1"


def serve(tier_args: list[str], executor_args: list[str] | None = None, extra: list[str] | None = None) -> Server:
    return start_server(
        ["--enable-per-request-metrics", "--log-stats-interval", "0", *tier_args, *(extra or [])],
        executor_args=executor_args if executor_args is not None else SIM,
    )


def redis_tier(url: str, *more: str) -> list[str]:
    return ["--kv-tier", "redis", "--kv-tier-redis-url", url, *more]


@dataclass
class Done:
    text: str
    prefix: dict
    usage: dict


def complete(server: Server, prompt, max_tokens: int = 4) -> Done:
    """Greedy `/v1/completions` (a string prompt, or token ids)."""
    r = requests.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    v = r.json()
    p = v["metrics"]["prefix_cache"]
    assert p["cached_tokens"] + p["computed_tokens"] == p["prompt_tokens"], p
    assert p["local_cached_tokens"] + p["external_cached_tokens"] == p["cached_tokens"], p
    src = p["external_sources"]
    assert src["host"] + src["redis"] + src["disk"] == p["external_cached_tokens"], p
    assert p["cache_creation_tokens"] <= p["computed_tokens"], p
    return Done(v["choices"][0]["text"], p, v["usage"])


def tokenize(server: Server, prompt: str) -> int:
    r = requests.post(f"{server.base_url}/tokenize", json={"prompt": prompt}, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


class Metrics:
    """One scrape of `/metrics`."""

    def __init__(self, server: Server):
        self.text = requests.get(f"{server.base_url}/metrics", timeout=10).text
        self.series: list[tuple[str, dict[str, str], float]] = []
        for line in self.text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, value = line.rsplit(" ", 1)
            name, _, rest = head.partition("{")
            self.series.append((name, dict(re.findall(r'(\w+)="([^"]*)"', rest)), float(value)))

    def get(self, name: str, **labels) -> float:
        """The sum over the series of `name` matching `labels`."""
        return sum(v for n, l, v in self.series if n == name and all(l.get(k) == x for k, x in labels.items()))

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.series)


def metric(server: Server, name: str, **labels) -> float:
    return Metrics(server).get(name, **labels)


def settled(server: Server, blocks: int) -> None:
    """Waits until `server` has stored `blocks` blocks in Redis and has no save pending."""
    wait_for(
        lambda: metric(server, "cachet:kv_tier_blocks_saved_total", tier="redis") >= blocks
        and metric(server, "cachet:kv_tier_saves_pending") == 0,
        f"{blocks} blocks saved to Redis",
    )


def log_lines(server: Server, needle: str) -> list[str]:
    try:
        text = open(server.log_path, errors="replace").read()
    except OSError:
        return []
    # The log may be coloured (tracing's ANSI escapes): matched and returned without them.
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return [l for l in text.splitlines() if needle in l]


def prompt_text(seed: int, n: int) -> str:
    """An n-byte prompt (n tokens on the simulator's byte tokenizer), distinct per seed."""
    out = []
    x = seed * 2654435761 % 2**32 or 1
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(chr(97 + x % 26))
    return "".join(out)
