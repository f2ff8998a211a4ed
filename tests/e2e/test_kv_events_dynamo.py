"""cachet's KV events, read by a real router's index: NVIDIA Dynamo's standalone KV indexer.

The publisher is the `publish_script` example of `cachet-kv-events` (the crate `cachet serve`
publishes with): it emits vLLM-format batches on a ZMQ PUB socket, with a ROUTER replay socket,
for a script of stores, evictions and resets that the test sends it on stdin. The indexer
(`python -m dynamo.indexer`, PyPI `ai-dynamo-runtime`, installed by scripts/test-deps-dynamo.sh)
subscribes to each publisher after `POST /register` and answers `POST /query` with the number
of prompt tokens each instance holds: it hashes the query's tokens itself and matches them
against the `token_ids` of the stored events (split by the registered `block_size`), so only
full blocks count and the engine's own hash values only link blocks to their parents.

Environment:
  CACHET_KV_PUBLISH_SCRIPT_BIN  the example binary (default
                                <repo>/target/release/examples/publish_script; build it with
                                `cargo build --release -p cachet-kv-events --examples`)
  CACHET_DYNAMO_PYTHON          the Python that has `dynamo.indexer` (default: this one)
  CACHET_E2E_REQUIRE_DYNAMO=1   fail, rather than skip, when the indexer is not installed
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
PUBLISHER_BIN = os.environ.get(
    "CACHET_KV_PUBLISH_SCRIPT_BIN", str(ROOT / "target" / "release" / "examples" / "publish_script")
)
DYNAMO_PYTHON = os.environ.get("CACHET_DYNAMO_PYTHON", sys.executable)
BLOCK = 4
MODEL = "cachet-e2e"


def _dynamo_installed() -> bool:
    r = subprocess.run([DYNAMO_PYTHON, "-c", "import dynamo.indexer"], capture_output=True)
    return r.returncode == 0


if not _dynamo_installed():
    if os.environ.get("CACHET_E2E_REQUIRE_DYNAMO") == "1":
        raise RuntimeError(f"dynamo.indexer is not importable by {DYNAMO_PYTHON}")
    pytest.skip(
        "Dynamo's KV indexer is not installed: run scripts/test-deps-dynamo.sh",
        allow_module_level=True,
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(read, want, timeout: float = 10.0):
    """Polls `read()` until it equals `want`; the events reach the index asynchronously."""
    deadline = time.monotonic() + timeout
    got = read()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = read()
    assert got == want
    return got


class Publisher:
    def __init__(self, *args: str):
        if not os.path.exists(PUBLISHER_BIN):
            pytest.fail(
                f"{PUBLISHER_BIN} not found: build it with "
                "`cargo build --release -p cachet-kv-events --examples` or set CACHET_KV_PUBLISH_SCRIPT_BIN"
            )
        self.proc = subprocess.Popen(
            [PUBLISHER_BIN, "--block-size", str(BLOCK), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = json.loads(self._line())
        # Bound on every interface ("tcp://*:0"); reached on loopback.
        self.endpoint = hello["endpoint"].replace("0.0.0.0", "127.0.0.1")
        self.replay_endpoint = hello["replay_endpoint"].replace("0.0.0.0", "127.0.0.1")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"publish_script exited with {self.proc.wait()}")
        return line

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Indexer:
    def __init__(self):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="dynamo-indexer-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [DYNAMO_PYTHON, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"dynamo.indexer exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if requests.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"dynamo.indexer did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        return pathlib.Path(self.log.name).read_text(errors="replace")[-4000:]

    def register(self, instance_id: int, pub: Publisher) -> None:
        r = requests.post(
            f"{self.base}/register",
            json={
                "instance_id": instance_id,
                "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
                "model_name": MODEL,
                "block_size": BLOCK,
            },
            timeout=10,
        )
        assert r.status_code in (200, 201), r.text
        # The listener subscribes in the background: wait until it is connected, then a moment
        # for the subscription to reach the PUB socket. A batch lost to that race is recovered
        # from the replay socket at the next batch (the indexer detects the gap).
        eventually(lambda: self.status(instance_id), "active")
        time.sleep(0.3)

    def status(self, instance_id: int):
        for w in requests.get(f"{self.base}/workers", timeout=10).json():
            if w["instance_id"] == instance_id:
                return w["status"]
        return None

    def raw_query(self, tokens: list[int]) -> dict:
        r = requests.post(f"{self.base}/query", json={"token_ids": tokens, "model_name": MODEL}, timeout=10)
        r.raise_for_status()
        return r.json()

    def gpu(self, tokens: list[int]) -> dict[int, int]:
        """Matched tokens held by each instance's engine (device tier), instances with none left out."""
        scores = self.raw_query(tokens)["scores"]
        out = {int(i): max(ranks.values()) for i, ranks in scores.items()}
        return {i: n for i, n in out.items() if n > 0}

    def reach(self, tokens: list[int], instance_id: int) -> dict | None:
        return self.raw_query(tokens)["instances"].get(str(instance_id))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cleanup():
    procs: list = []
    yield procs
    for p in reversed(procs):
        p.stop()


# A long prompt of 6 full blocks, a second one sharing its first 2 blocks, and others.
P = list(range(1000, 1024))
Q = P[:8] + list(range(2000, 2016))
R = list(range(3000, 3012))
S = list(range(4000, 4016))


def test_the_index_follows_stores_shared_prefixes_evictions_and_resets(cleanup):
    a, b = Publisher(), Publisher()
    idx = Indexer()
    cleanup += [a, b, idx]
    idx.register(1, a)
    idx.register(2, b)

    # A serves P: the indexer names A with all 24 tokens, B with none.
    assert a.send(store=P, request_id="req-a", session_id="sess-1") == {"seq": 0, "events": 1}
    eventually(lambda: idx.gpu(P), {1: 24})
    # Only full blocks count: 10 tokens are 2 blocks (8 tokens) and a partial one.
    assert idx.gpu(P[:10]) == {1: 8}
    # Q shares P's first two blocks.
    assert idx.gpu(Q) == {1: 8}

    # B serves Q.
    assert b.send(store=Q, request_id="req-b") == {"seq": 0, "events": 1}
    eventually(lambda: idx.gpu(Q), {1: 8, 2: 24})
    assert idx.gpu(P) == {1: 24, 2: 8}

    # A fills a block it already holds: nothing is stored, nothing published.
    assert a.send(store=P[:8]) == {"seq": None, "events": 0}

    # One step on A: blocks 3..5 of P are evicted to make room for R.
    assert a.send(ops=[{"remove": P, "from_block": 3}, {"store": R, "request_id": "req-r"}]) == {
        "seq": 1,
        "events": 2,
    }
    eventually(lambda: idx.gpu(R), {1: 12})
    assert idx.gpu(P) == {1: 12, 2: 8}

    # A recomputes P: only the evicted blocks are stored again, under parent block 2.
    assert a.send(store=P) == {"seq": 2, "events": 1}
    eventually(lambda: idx.gpu(P), {1: 24, 2: 8})

    # A host-tier copy (medium CPU) is not "held by the engine": no GPU score, lower-tier reach.
    assert a.send(store=S, medium="CPU") == {"seq": 3, "events": 1}
    eventually(lambda: (idx.reach(S, 1) or {}).get("cpu"), 16)
    assert idx.gpu(S) == {}
    assert idx.reach(S, 1)["gpu"] == 0

    # A's prefix cache is reset: A holds nothing, B keeps its blocks.
    assert a.send(clear=True) == {"seq": 4, "events": 1}
    eventually(lambda: idx.gpu(P), {2: 8})
    assert idx.gpu(R) == {}
    assert idx.gpu(Q) == {2: 24}


def test_a_restarted_indexer_rebuilds_its_view_by_replay(cleanup):
    a = Publisher()
    idx = Indexer()
    cleanup += [a, idx]
    idx.register(1, a)
    a.send(store=P)
    a.send(remove=P, from_block=4)
    eventually(lambda: idx.gpu(P), {1: 16})
    idx.stop()

    # A goes on while no indexer listens.
    a.send(store=Q)
    fresh = Indexer()
    cleanup.append(fresh)
    fresh.register(1, a)
    assert fresh.gpu(P) == {}
    # The next live batch (sequence 3) shows the new listener that 0..2 are missing; it asks the
    # replay socket for them and the view is A's again.
    assert a.send(store=R) == {"seq": 3, "events": 1}
    eventually(lambda: fresh.gpu(P), {1: 16})
    assert fresh.gpu(Q) == {1: 24}
    assert fresh.gpu(R) == {1: 12}


def test_the_older_array_encoding_is_read_too(cleanup):
    a = Publisher("--encoding", "array")
    idx = Indexer()
    cleanup += [a, idx]
    idx.register(1, a)
    assert a.send(store=P) == {"seq": 0, "events": 1}
    eventually(lambda: idx.gpu(P), {1: 24})
    a.send(remove=P, from_block=1)
    eventually(lambda: idx.gpu(P), {1: 4})
    a.send(clear=True)
    eventually(lambda: idx.gpu(P), {})
