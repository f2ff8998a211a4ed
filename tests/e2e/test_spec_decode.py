"""Prompt-lookup speculative decoding (`--speculative ngram`).

On the real default model, against a server without it: the same greedy text for an edit-style
prompt, the same per-request prompt and cache numbers, and vLLM's spec_decode counters on
/metrics consistent with each other (accepted <= drafted <= K x drafts, the per-position counts
summing to the accepted tokens). Skipped when the default model file is absent.

On the simulated executor (always): each response's `metrics.spec_decode` carries its own
request's counts (each choice of an `n > 1` request its own), exactly the values derived by
hand for a forced-token workload, and over a workload of OpenAI and Anthropic requests,
streamed and not, the per-request counts sum exactly to the deltas of
`vllm:spec_decode_num_drafts_total`, `_num_draft_tokens_total` and
`_num_accepted_tokens_total`. The real-model tests check the same sum.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import requests

from conftest import start_server

MODEL = pathlib.Path.home() / ".cache" / "cachet" / "SmolLM2-135M-Instruct.Q4_1.gguf"
K = 5
SPEC_ARGS = ["--speculative", "ngram", "--num-speculative-tokens", str(K), "--spec-ngram-min", "2"]
COUNT_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
METRIC = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}

CODE = "".join(
    f"pub fn f{i}(x: u64) -> u64 {{\n    x * {3 + 7 * i} + {i}\n}}\n\n" for i in range(12)
)
PROMPT = f"Return this Rust code unchanged except that `f3` is renamed to `g3`. Output only the code.\n\n```rust\n{CODE}```"

SHORT_CODE = "".join(f"pub fn h{i}(x: u64) -> u64 {{\n    x + {5 * i}\n}}\n\n" for i in range(4))
SHORT_PROMPT = f"Return this Rust code with `h1` renamed to `k1`. Output only the code.\n\n```rust\n{SHORT_CODE}```"

real_model = pytest.mark.skipif(not MODEL.exists(), reason=f"default model {MODEL} not found")


def real_server(extra: list[str]):
    return start_server(
        ["--enable-per-request-metrics", *extra],
        executor_args=["--model", str(MODEL), "--block-size", "16", "--threads", "2"],
    )


@pytest.fixture(scope="module")
def servers():
    if not MODEL.exists():
        pytest.skip(f"default model {MODEL} not found")
    plain = real_server([])
    spec = None
    try:
        spec = real_server(SPEC_ARGS)
        yield plain, spec
    finally:
        plain.stop()
        if spec:
            spec.stop()


@pytest.fixture(scope="module")
def sim_servers():
    """Simulated executor (block size 16), per-request metrics on; speculation off and on."""
    plain = start_server(["--enable-per-request-metrics"])
    spec = None
    try:
        spec = start_server(["--enable-per-request-metrics", *SPEC_ARGS])
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


def counter_deltas(before: dict, after: dict) -> dict:
    return {k: after[METRIC[k]] - before.get(METRIC[k], 0.0) for k in COUNT_KEYS}


def counts_of(sd: dict) -> dict:
    return {k: sd[k] for k in COUNT_KEYS}


def add(total: dict, sd: dict) -> None:
    for k in COUNT_KEYS:
        total[k] += sd[k]


def sse_events(r) -> list[dict]:
    # Lines as bytes, decoded as UTF-8 here: SSE is UTF-8 whatever a header says, and a
    # Latin-1 decode splits lines at the byte 0x85 inside a character such as "★".
    lines = (l.decode("utf-8") for l in r.iter_lines())
    return [json.loads(l[6:]) for l in lines if l.startswith("data: {")]


@real_model
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
    # The one request's own counts are exactly the counters' increments; the plain server
    # reports none (and drafted nothing).
    assert counts_of(b["metrics"]["spec_decode"]) == counter_deltas(before, after)
    assert "spec_decode" not in a["metrics"]
    p = spec_counters(plain)
    assert p["vllm:spec_decode_num_drafts_total"] == 0


@real_model
def test_per_request_counts_of_a_mixed_workload_sum_to_the_counters(servers):
    _, spec = servers
    base = spec.base_url
    before = spec_counters(spec)
    total = dict.fromkeys(COUNT_KEYS, 0)
    short = SHORT_PROMPT
    # Sampled, n = 3: each choice its own counts, summed in the request's.
    r = requests.post(f"{base}/v1/completions", json={
        "model": spec.model(), "prompt": short, "max_tokens": 48, "n": 3, "temperature": 0.7, "seed": 3,
    }, timeout=300).json()
    sd = r["metrics"]["spec_decode"]
    assert [c["index"] for c in sd["choices"]] == [0, 1, 2]
    for k in COUNT_KEYS:
        assert sd[k] == sum(c[k] for c in sd["choices"])
    add(total, sd)
    # Streamed chat, greedy.
    with requests.post(f"{base}/v1/chat/completions", json={
        "model": spec.model(), "messages": [{"role": "user", "content": short}], "max_tokens": 64,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }, stream=True, timeout=300) as resp:
        events = sse_events(resp)
    sd = [e for e in events if "metrics" in e][-1]["metrics"]["spec_decode"]
    add(total, sd)
    # Anthropic, not streamed and streamed.
    body = {"model": spec.model(), "max_tokens": 64, "messages": [{"role": "user", "content": short}]}
    m = requests.post(f"{base}/v1/messages", json=body, timeout=300).json()
    add(total, m["metrics"]["spec_decode"])
    with requests.post(f"{base}/v1/messages", json={**body, "stream": True}, stream=True, timeout=300) as resp:
        events = sse_events(resp)
    add(total, [e for e in events if "metrics" in e][-1]["metrics"]["spec_decode"])
    after = spec_counters(spec)
    assert total == counter_deltas(before, after)
    assert total["num_drafts"] > 0


# --- the simulated executor: counts derived by hand ------------------------------------------

# The forced token: 'a' (the byte tokenizer's id of byte b is b + 3), forced by a +100 bias, so
# every output token is 'a' whatever the context. The prompt has no 'a'.
A = ord("a") + 3
SIM_PROMPT = "Hello world, this is one xy"  # 27 bytes = 27 tokens, no 'a'
FORCE = {"logit_bias": {str(A): 100}, "temperature": 0}
SIM_MAX = 12
# Derivation (K = 5, n-grams 2..4, block size 16, L = 27 prompt tokens, max_tokens 12). With o
# output tokens so far the context is prompt + 'a' x o; its 2-gram suffix "aa" first has an
# earlier occurrence at o = 3, and the most recent occurrence of any suffix of a run is the run
# shifted by one, so every proposal is one token, 'a', and is accepted (the model says 'a').
# A draft also needs a free slot after p = L + o - 1 in p's block (p % 16 != 15) and one more
# token to generate after it (o + 1 < 12):
#   step 1 prefill -> o = 1; step 2 (o = 1) and 3 (o = 2): nothing recurs -> o = 3;
#   step 4: p = 29, 2 free slots, draft [a] accepted -> o = 5;
#   step 5: p = 31, the block's last slot: no draft -> o = 6;
#   step 6: p = 32, draft -> o = 8; step 7: p = 34, draft -> o = 10;
#   step 8: p = 36, draft (o + 1 = 11 < 12) -> o = 12, the end.
# So 4 drafts of one token, 4 draft tokens, 4 accepted. For an n = 2 request the second
# sequence's first token is the fork's draw r (not steered): when r is not 'a', "aa" first
# recurs at o = 4 (prompt + r + "aaa"), then step 5: p = 30, draft -> 6; p = 32 -> 8;
# p = 34 -> 10; p = 36 -> 12: again 4, 4, 4 (and when r is 'a' it is the first sequence's run).
SIM_COUNTS = {"num_drafts": 4, "num_draft_tokens": 4, "num_accepted_tokens": 4}


def sim_complete(s, **extra) -> dict:
    r = requests.post(f"{s.base_url}/v1/completions", json={
        "model": s.model(), "prompt": SIM_PROMPT, "max_tokens": SIM_MAX, **FORCE, **extra,
    }, timeout=60)
    r.raise_for_status()
    return r.json()


def test_sim_forced_run_reports_the_hand_derived_counts(sim_servers):
    plain, spec = sim_servers
    before = spec_counters(spec)
    r = sim_complete(spec)
    assert r["usage"]["prompt_tokens"] == 27
    assert r["choices"][0]["text"] == "a" * SIM_MAX
    assert r["metrics"]["spec_decode"] == SIM_COUNTS  # no `choices` for n = 1
    assert counter_deltas(before, spec_counters(spec)) == SIM_COUNTS
    # The same request without speculation: the same text, no spec_decode object.
    p = sim_complete(plain)
    assert p["choices"][0]["text"] == r["choices"][0]["text"]
    assert "spec_decode" not in p["metrics"]
    assert "prefix_cache" in p["metrics"]

    # n = 2: each choice its own counts (derived above), the request's the sum.
    before = spec_counters(spec)
    r = sim_complete(spec, n=2)
    texts = sorted(c["text"] for c in r["choices"])
    assert all(t.endswith("a" * (SIM_MAX - 1)) and len(t) == SIM_MAX for t in texts), texts
    sd = r["metrics"]["spec_decode"]
    assert sd["choices"] == [{"index": i, **SIM_COUNTS} for i in range(2)]
    assert counts_of(sd) == {k: 2 * v for k, v in SIM_COUNTS.items()}
    assert counter_deltas(before, spec_counters(spec)) == counts_of(sd)


def test_sim_workload_per_request_counts_sum_to_the_counters(sim_servers):
    _, spec = sim_servers
    base = spec.base_url
    before = spec_counters(spec)
    total = dict.fromkeys(COUNT_KEYS, 0)
    # Forced runs (hand-derived above), streamed and not.
    add(total, sim_complete(spec)["metrics"]["spec_decode"])
    with requests.post(f"{base}/v1/completions", json={
        "model": spec.model(), "prompt": SIM_PROMPT, "max_tokens": SIM_MAX, **FORCE, "stream": True,
        "stream_options": {"include_usage": True},
    }, stream=True, timeout=60) as resp:
        events = sse_events(resp)
    sd = [e for e in events if "metrics" in e][-1]["metrics"]["spec_decode"]
    assert sd == SIM_COUNTS
    add(total, sd)
    # Unforced chat requests (the simulator's hash-chosen tokens: whatever recurs is drafted
    # and mostly rejected), one with n = 3, and Anthropic ones, streamed and not.
    for i in range(3):
        r = requests.post(f"{base}/v1/chat/completions", json={
            "model": spec.model(), "messages": [{"role": "user", "content": f"tell me {i} " * 8}],
            "max_tokens": 80, "n": 3 if i == 1 else 1, "temperature": 0,
        }, timeout=60).json()
        sd = r["metrics"]["spec_decode"]
        if i == 1:
            assert len(sd["choices"]) == 3
            for k in COUNT_KEYS:
                assert sd[k] == sum(c[k] for c in sd["choices"])
        assert sd["num_accepted_tokens"] <= sd["num_draft_tokens"] <= K * sd["num_drafts"]
        add(total, sd)
    body = {"model": spec.model(), "max_tokens": 60, "messages": [{"role": "user", "content": "abc abc abc abc"}]}
    m = requests.post(f"{base}/v1/messages", json=body, timeout=60).json()
    add(total, m["metrics"]["spec_decode"])
    with requests.post(f"{base}/v1/messages", json={**body, "stream": True}, stream=True, timeout=60) as resp:
        events = sse_events(resp)
    add(total, [e for e in events if "metrics" in e][-1]["metrics"]["spec_decode"])
    assert total == counter_deltas(before, spec_counters(spec))
    assert total["num_drafts"] >= 8  # at least the two forced runs'
