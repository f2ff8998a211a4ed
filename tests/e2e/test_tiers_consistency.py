"""The consistency test with tiers: two instances (`--kv-tier host,redis`, small KV pools, so
that blocks are evicted into the host tier, prefixes cross instances through Redis, and
requests are preempted) run a mixed concurrent workload (OpenAI chat, streamed completions,
Anthropic messages) over shared prefixes. Afterwards every scraped counter of each instance
equals the sum of the per-request numbers its responses reported, per source and per tier.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import requests

from tiers_lib import Metrics, RedisNode, prompt_text, serve, settled

# Slow enough that the 8 client threads keep the 6 sequences of the small pool overlapping
# (and so preempting) even on a loaded machine.
SLOW = ["--sim-decode-us-per-seq", "2000", "--sim-prefill-us-per-token", "5"]
POOL = ["--num-kv-blocks", "48", "--max-num-seqs", "6"]


def check(p: dict) -> dict:
    assert p["cached_tokens"] + p["computed_tokens"] == p["prompt_tokens"], p
    assert p["local_cached_tokens"] + p["external_cached_tokens"] == p["cached_tokens"], p
    assert sum(p["external_sources"].values()) == p["external_cached_tokens"], p
    assert p["cache_creation_tokens"] <= p["computed_tokens"], p
    return p


def chat(base: str, prompt: str, max_tokens: int) -> dict:
    r = requests.post(f"{base}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    v = r.json()
    p = check(v["metrics"]["prefix_cache"])
    assert v["usage"]["prompt_tokens_details"]["cached_tokens"] == p["cached_tokens"]
    return p


def completion_stream(base: str, prompt: str, max_tokens: int) -> dict:
    r = requests.post(f"{base}/v1/completions", timeout=120, stream=True, json={
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    found = None
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk.get("metrics"):
                found = chunk["metrics"]["prefix_cache"]
    assert found is not None
    return check(found)


def messages(base: str, prompt: str, max_tokens: int) -> dict:
    r = requests.post(f"{base}/v1/messages", timeout=120, json={
        "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]})
    assert r.status_code == 200, r.text
    v = r.json()
    p = check(v["metrics"]["prefix_cache"])
    u = v["usage"]
    assert u["cache_read_input_tokens"] == p["cached_tokens"]
    assert u["cache_creation_input_tokens"] == p["cache_creation_tokens"]
    return p


def test_counters_equal_the_sum_of_reported_numbers_with_tiers():
    redis = RedisNode().start()
    tier = ["--kv-tier", "host,redis", "--kv-tier-redis-url", redis.url]
    a = serve(tier, extra=SLOW + POOL)
    b = serve(tier, extra=SLOW + POOL)
    try:
        prefixes = [prompt_text(70, 112), prompt_text(71, 96), prompt_text(72, 128)]
        # Each instance first computes one prefix alone, so that the other finds it in Redis.
        warm = {a.base_url: [chat(a.base_url, prefixes[0], 2)], b.base_url: [chat(b.base_url, prefixes[1], 2)]}
        settled(a, 1)
        settled(b, 1)

        jobs = []
        for i in range(36):
            base = (a if i % 2 == 0 else b).base_url
            prompt = prefixes[i % 3] + f" request {i}: " + prompt_text(100 + i, 10 + (i % 5) * 9)
            fn = (chat, completion_stream, messages)[i % 3]
            jobs.append((base, fn, prompt, 8 + (i % 4) * 10))
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda j: (j[0], j[1](j[0], j[2], j[3])), jobs))
        # The first requests again, on the same instance: their own blocks were evicted from
        # the small pools meanwhile, into the host tier.
        results += [(j[0], j[1](j[0], j[2], j[3])) for j in jobs[:8]]
        per: dict[str, list[dict]] = {a.base_url: list(warm[a.base_url]), b.base_url: list(warm[b.base_url])}
        for base, p in results:
            per[base].append(p)

        totals = {"host": 0, "redis": 0, "preemptions": 0, "evicted": 0}
        for s in (a, b):
            rs = per[s.base_url]
            m = Metrics(s)
            sm = lambda f: sum(f(p) for p in rs)
            assert m.get("vllm:request_success_total") == len(rs)
            assert m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0
            assert m.get("vllm:prompt_tokens_total") == sm(lambda p: p["prompt_tokens"])
            assert m.get("vllm:prefix_cache_queries_total") == sm(lambda p: p["prompt_tokens"])
            assert m.get("vllm:prefix_cache_hits_total") == sm(lambda p: p["local_cached_tokens"])
            assert m.get("vllm:external_prefix_cache_queries_total") == sm(
                lambda p: p["prompt_tokens"] - p["local_cached_tokens"])
            assert m.get("vllm:external_prefix_cache_hits_total") == sm(lambda p: p["external_cached_tokens"])
            assert m.get("vllm:prompt_tokens_cached_total") == sm(lambda p: p["cached_tokens"])
            by_source = {
                "local_compute": "computed_tokens",
                "local_cache_hit": "local_cached_tokens",
                "external_kv_transfer": "external_cached_tokens",
            }
            for source, field in by_source.items():
                assert m.get("vllm:prompt_tokens_by_source_total", source=source) == sm(lambda p: p[field]), source
            assert m.get("vllm:prompt_tokens_cached_by_source_total", source="device") == sm(
                lambda p: p["local_cached_tokens"])
            for t in ("host", "redis"):
                want = sm(lambda p: p["external_sources"][t])
                assert m.get("vllm:prompt_tokens_cached_by_source_total", source=t) == want, t
                # Every block a tier delivered was used: no load failed in this run.
                assert m.get("cachet:kv_tier_blocks_loaded_total", tier=t) * 16 == want, t
                totals[t] += want
            assert m.get("cachet:kv_tier_load_failures_total") == 0
            assert m.get("cachet:cache_creation_tokens_total") == sm(lambda p: p["cache_creation_tokens"])
            assert m.get("vllm:e2e_request_latency_seconds_count") == len(rs)
            totals["preemptions"] += m.get("vllm:num_preemptions_total")
            totals["evicted"] += m.get("cachet:kv_blocks_evicted_total")
        # The workload did exercise what it is meant to.
        assert totals["redis"] > 0, totals
        assert totals["host"] > 0, totals
        assert totals["evicted"] > 0, totals
        assert totals["preemptions"] > 0, totals
    finally:
        a.stop()
        b.stop()
        redis.stop()
