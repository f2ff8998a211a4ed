"""Two real `cachet serve` instances and NVIDIA Dynamo's KV indexer on one machine: the index
learns from cachet's KV events (vLLM's wire format over ZMQ, `--kv-events-config`) which
instance holds which prompt, follows evictions and resets, rebuilds after a restart from the
replay socket, and the instance it names serves the predicted tokens from its cache.

Both instances run the simulated executor with 16-token blocks; prompts are token lists, so the
expected matched-token counts follow from the block arithmetic alone (spec §2: a prompt of N
tokens caches its floor(N/B) full blocks; a lookup is capped at floor((N-1)/B) blocks).
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from conftest import start_server
from test_kv_events_dynamo import Indexer, eventually, free_port

BLOCK = 16
MODEL = "cachet-e2e"


class Instance:
    def __init__(self, extra: list[str] | None = None):
        self.pub_port = free_port()
        self.replay_port = free_port()
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.pub_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
        }
        self.server = start_server(
            ["--kv-events-config", json.dumps(cfg), "--enable-per-request-metrics", *(extra or [])],
            executor_args=["--executor", "sim", "--block-size", str(BLOCK), *(extra_exec(extra))],
        )

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def complete(self, prompt: list[int]) -> dict:
        r = requests.post(
            f"{self.server.base_url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.server.stop()


def extra_exec(extra):
    return []


def register(ix: Indexer, instance_id: int, inst: Instance) -> None:
    r = requests.post(
        f"{ix.base}/register",
        json={
            "instance_id": instance_id,
            "endpoint": inst.endpoint,
            "replay_endpoint": inst.replay_endpoint,
            "model_name": MODEL,
            "block_size": BLOCK,
        },
        timeout=10,
    )
    assert r.status_code in (200, 201), r.text
    eventually(lambda: ix.status(instance_id), "active")
    time.sleep(0.3)


def gpu(ix: Indexer, tokens: list[int]) -> dict[int, int]:
    r = requests.post(f"{ix.base}/query", json={"token_ids": tokens, "model_name": MODEL}, timeout=10)
    r.raise_for_status()
    scores = r.json()["scores"]
    out = {int(i): max(ranks.values()) for i, ranks in scores.items()}
    return {i: n for i, n in out.items() if n > 0}


@pytest.fixture
def procs():
    ps: list = []
    yield ps
    for p in reversed(ps):
        p.stop()


# 100 tokens: 6 full blocks (96 tokens) are cached after one request (ids inside the simulated
# model's 259-token vocabulary).
LONG = list(range(3, 103))


def test_the_indexer_names_the_instance_that_holds_a_prompt(procs):
    a = Instance(["--num-kv-blocks", "16"])
    procs.append(a)
    b = Instance()
    procs.append(b)
    ix = Indexer()
    procs.append(ix)
    register(ix, 1, a)
    register(ix, 2, b)

    # A serves the long prompt: the index names A for 96 tokens, and B for none.
    a.complete(LONG)
    eventually(lambda: gpu(ix, LONG), {1: 96})

    # Sent to the instance the index named, the request reports the cached tokens it predicted
    # (capped at N-1 = 99 → 6 blocks = 96 tokens).
    r = a.complete(LONG)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert r["metrics"]["prefix_cache"]["local_cached_tokens"] == 96
    # B, not named, computes everything.
    r = b.complete(LONG)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    eventually(lambda: gpu(ix, LONG), {1: 96, 2: 96})

    # A's pool is 16 blocks: a 200-token prompt (13 blocks, 12 full) evicts LONG's blocks from
    # the tail (freed tail-first), keeping its first 3 blocks (16 - 13 = 3 remain).
    other = [103 + (i % 150) for i in range(200)]
    a.complete(other)
    eventually(lambda: gpu(ix, LONG), {1: 48, 2: 96})
    eventually(lambda: gpu(ix, other), {1: 192})

    # A resets its prefix cache: its score drops to nothing.
    requests.post(f"{a.server.base_url}/reset_prefix_cache", json={}, timeout=10).raise_for_status()
    eventually(lambda: gpu(ix, LONG), {2: 96})
    eventually(lambda: gpu(ix, other), {})

    # The indexer restarts: replay restores its view of both instances at their next batch.
    ix.stop()
    ix2 = Indexer()
    procs.append(ix2)
    register(ix2, 1, a)
    register(ix2, 2, b)
    a.complete(LONG)  # a new batch on A (stores LONG again); the index replays from 0
    b.complete(list(range(210, 250)))  # a new batch on B, so it replays too
    eventually(lambda: gpu(ix2, LONG), {1: 96, 2: 96})


def test_a_routed_request_reports_the_predicted_hit_and_why_it_fell_short(procs):
    """A gateway routes by the indexer's score and passes it on in
    `x-prefix-cache-predicted-tokens`; the instance evicts part of the prefix between the
    prediction and the request, and reports the shortfall as `evicted`."""
    a = Instance(["--num-kv-blocks", "16"])
    procs.append(a)
    ix = Indexer()
    procs.append(ix)
    register(ix, 1, a)
    a.complete(LONG)
    eventually(lambda: gpu(ix, LONG), {1: 96})
    predicted = gpu(ix, LONG)[1]  # the router's prediction for A: 96 tokens
    # Before the routed request arrives, A serves a 200-token prompt that evicts LONG's last
    # three full blocks (as in the test above: its first 3 blocks remain).
    a.complete([103 + (i % 150) for i in range(200)])
    r = requests.post(
        f"{a.server.base_url}/v1/completions",
        json={"prompt": LONG, "max_tokens": 1, "temperature": 0, "ignore_eos": True},
        headers={"x-prefix-cache-predicted-tokens": str(predicted)},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    pc = r.json()["metrics"]["prefix_cache"]
    assert pc["local_cached_tokens"] == 48
    assert pc["predicted_tokens"] == 96
    # Tokens 48..96 were predicted and computed: blocks 3, 4 and 5, evicted since (the shadow
    # set remembers them); the partial block (96..100) lies outside the prediction.
    assert pc["shortfall_tokens"] == {
        "capped_for_logits": 0, "partial_block": 0, "evicted": 48, "never_cached": 0,
        "lookup_skipped": 0, "load_failed": 0,
    }
    def counters():
        text = requests.get(f"{a.server.base_url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("cachet:router_predicted_tokens_total"):
                out["predicted"] = float(value)
            elif name.startswith("cachet:router_shortfall_tokens_total") and float(value):
                out[name.split('reason="')[1].rstrip('"}')] = float(value)
        return out

    eventually(counters, {"predicted": 96.0, "evicted": 48.0})
