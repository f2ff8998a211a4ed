"""Prompt-lookup speculative decoding (`--speculative ngram`) on the real default model, against
a server without it: the same greedy text for an edit-style prompt, the same per-request prompt
and cache numbers, and vLLM's spec_decode counters on /metrics consistent with each other
(accepted <= drafted <= K x drafts, the per-position counts summing to the accepted tokens).
Skipped when the default model file is absent.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import requests

from conftest import start_server

MODEL = pathlib.Path.home() / ".cache" / "cachet" / "SmolLM2-135M-Instruct.Q4_1.gguf"
K = 5

CODE = "".join(
    f"pub fn f{i}(x: u64) -> u64 {{\n    x * {3 + 7 * i} + {i}\n}}\n\n" for i in range(12)
)
PROMPT = f"Return this Rust code unchanged except that `f3` is renamed to `g3`. Output only the code.\n\n```rust\n{CODE}```"

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"default model {MODEL} not found")


def real_server(extra: list[str]):
    return start_server(
        ["--enable-per-request-metrics", *extra],
        executor_args=["--model", str(MODEL), "--block-size", "16", "--threads", "2"],
    )


@pytest.fixture(scope="module")
def servers():
    plain = real_server([])
    spec = None
    try:
        spec = real_server(["--speculative", "ngram", "--num-speculative-tokens", str(K), "--spec-ngram-min", "2"])
        yield plain, spec
    finally:
        plain.stop()
        if spec:
            spec.stop()


def complete(s) -> dict:
    r = requests.post(
        f"{s.base_url}/v1/chat/completions",
        json={
            "model": s.model(),
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 200,
            "temperature": 0,
        },
        timeout=300,
    )
    r.raise_for_status()
    return r.json()


def spec_counters(s) -> dict:
    text = requests.get(f"{s.base_url}/metrics", timeout=10).text
    out = {"per_pos": {}}
    for line in text.splitlines():
        m = re.match(r'^(vllm:spec_decode_\w+)\{([^}]*)\} ([0-9.e+]+)$', line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(2), float(m.group(3))
        pos = re.search(r'position="(\d+)"', labels)
        if pos:
            out["per_pos"][int(pos.group(1))] = v
        else:
            out[name] = v
    return out


def test_same_greedy_text_same_cache_numbers_and_consistent_counters(servers):
    plain, spec = servers
    before = spec_counters(spec)
    a, b = complete(plain), complete(spec)
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
    # Drafts move no prompt or cache number.
    def numbers(r):
        return {k: v for k, v in r["metrics"]["prefix_cache"].items() if not k.endswith("_ms")}

    assert numbers(b) == numbers(a)
    assert numbers(a)["prompt_tokens"] == a["usage"]["prompt_tokens"]

    after = spec_counters(spec)
    d = {k: after[k] - before.get(k, 0.0) for k in after if k != "per_pos"}
    drafts = d["vllm:spec_decode_num_drafts_total"]
    drafted = d["vllm:spec_decode_num_draft_tokens_total"]
    accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0, after
    assert accepted <= drafted <= K * drafts
    per_pos = {p: v - before["per_pos"].get(p, 0.0) for p, v in after["per_pos"].items()}
    assert set(per_pos) <= set(range(K))
    assert sum(per_pos.values()) == accepted
    # Acceptance decays with position: a later position is accepted only after the earlier ones.
    counts = [per_pos.get(p, 0.0) for p in range(K)]
    assert all(x >= y for x, y in zip(counts, counts[1:])), counts
    # The plain server drafted nothing.
    p = spec_counters(plain)
    assert p["vllm:spec_decode_num_drafts_total"] == 0
