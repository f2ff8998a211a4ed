"""External KV tiers through the real binary: two instances sharing one Redis (simulated
executor, the real model, a Redis Cluster), and evict-then-reload through the host tier.

Expected numbers, B = 16: a prompt of N tokens computed by instance 1 is served by instance 2
with `external_cached_tokens` = floor((N-1)/B)*B (whole blocks, capped so the last token is
computed), `local_cached_tokens` 0, the same greedy output, and its `/metrics` saying the same.
"""

from __future__ import annotations

import pytest

from tiers_lib import (
    SIM,
    SIM_BLOCK_BYTES,
    Metrics,
    RedisCluster,
    RedisNode,
    complete,
    model_args,
    prompt_text,
    real_model,
    redis_tier,
    serve,
    settled,
    whole_blocks,
)

BS = 16


@pytest.fixture
def redis():
    r = RedisNode().start()
    yield r
    r.stop()


def check_second_instance_metrics(m2: Metrics, n: int, ext: int, block_bytes: int) -> None:
    """Instance 2 served one N-token prompt with `ext` tokens from Redis."""
    blocks = ext // BS
    assert m2.get("vllm:prefix_cache_queries_total") == n
    assert m2.get("vllm:prefix_cache_hits_total") == 0
    assert m2.get("vllm:external_prefix_cache_queries_total") == n
    assert m2.get("vllm:external_prefix_cache_hits_total") == ext
    assert m2.get("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == ext
    assert m2.get("vllm:prompt_tokens_by_source_total", source="local_compute") == n - ext
    assert m2.get("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0
    assert m2.get("vllm:prompt_tokens_cached_total") == ext
    assert m2.get("vllm:prompt_tokens_cached_by_source_total", source="redis") == ext
    assert m2.get("vllm:prompt_tokens_cached_by_source_total", source="device") == 0
    assert m2.get("cachet:cache_creation_tokens_total") == 0
    assert m2.get("cachet:kv_tier_lookups_total", tier="redis") == 1
    assert m2.get("cachet:kv_tier_lookup_blocks_total", tier="redis") == blocks
    assert m2.get("cachet:kv_tier_blocks_loaded_total", tier="redis") == blocks
    assert m2.get("vllm:kv_offload_load_bytes_total", tier="redis") == blocks * block_bytes
    assert m2.get("vllm:kv_offload_load_size_count", tier="redis") == 1
    assert m2.get("cachet:kv_tier_load_latency_seconds_count", tier="redis") == 1
    assert m2.get("cachet:kv_tier_load_failures_total") == 0
    assert m2.get("cachet:kv_tier_up", tier="redis") == 1


def share_one_prompt(url: str, prompt, executor_args: list[str], block_bytes: int | None, max_tokens: int = 6):
    s1 = serve(redis_tier(url), executor_args)
    s2 = serve(redis_tier(url), executor_args)
    try:
        r1 = complete(s1, prompt, max_tokens)
        n = r1.prefix["prompt_tokens"]
        ext = whole_blocks(n)
        assert r1.prefix["computed_tokens"] == n and r1.prefix["cache_creation_tokens"] == ext
        # Write-behind: instance 1's new entries reach Redis after its response.
        settled(s1, ext // BS)
        m1 = Metrics(s1)
        per_block = m1.get("vllm:kv_offload_store_bytes_total", tier="redis") / m1.get(
            "cachet:kv_tier_blocks_saved_total", tier="redis")
        if block_bytes is not None:
            assert per_block == block_bytes

        r2 = complete(s2, prompt, max_tokens)
        assert r2.text == r1.text
        assert r2.prefix["prompt_tokens"] == n
        assert r2.prefix["local_cached_tokens"] == 0
        assert r2.prefix["external_cached_tokens"] == ext
        assert r2.prefix["external_sources"] == {"host": 0, "redis": ext, "disk": 0}
        assert r2.prefix["computed_tokens"] == n - ext
        assert r2.prefix["cache_creation_tokens"] == 0
        assert r2.usage["prompt_tokens_details"]["cached_tokens"] == ext
        check_second_instance_metrics(Metrics(s2), n, ext, int(per_block))
        return r1, r2
    finally:
        s1.stop()
        s2.stop()


def test_two_sim_instances_share_a_prompt_through_redis(redis):
    share_one_prompt(redis.url, prompt_text(1, 300), SIM, SIM_BLOCK_BYTES)
    # Every full block of KV: 300 prompt + 5 generated tokens (the last one has no KV).
    assert len(redis.keys()) == (300 + 6 - 1) // BS


@pytest.mark.skipif(not real_model(), reason="set CACHET_E2E_REAL_MODEL=1 (and CACHET_E2E_MODEL_ARGS)")
def test_two_real_model_instances_share_a_prompt_through_redis(redis):
    prompt = "The history of the lighthouse keepers of the northern coast, told plainly. " * 8
    r1, r2 = share_one_prompt(redis.url, prompt, model_args(), None, max_tokens=12)
    assert r1.prefix["prompt_tokens"] > 100
    assert r2.text.strip()


def test_two_instances_share_through_a_redis_cluster():
    cluster = RedisCluster(masters=3)
    try:
        share_one_prompt(cluster.url, prompt_text(2, 500), SIM, SIM_BLOCK_BYTES)
        # Keys carry no hash tag: they spread over every master.
        sizes = [n.cmd("DBSIZE") for n in cluster.nodes]
        assert sum(sizes) == (500 + 6 - 1) // BS, sizes
        assert all(s > 0 for s in sizes), sizes
    finally:
        cluster.stop()


def assert_reloaded_from_host(r2, r1) -> None:
    """The 165-token prompt of the host tests, served again after a filler evicted it from the
    11-block pool: its ten full blocks (160 tokens) load from the host tier, the 5-token tail
    is computed, nothing is created anew, and loading evicts the filler's ten entries."""
    assert r2.text == r1.text
    assert r2.prefix["local_cached_tokens"] == 0
    assert r2.prefix["external_cached_tokens"] == 160
    assert r2.prefix["external_sources"] == {"host": 160, "redis": 0, "disk": 0}
    assert r2.prefix["computed_tokens"] == 5
    assert r2.prefix["cache_creation_tokens"] == 0
    assert r2.prefix["blocks_evicted"] == 10

def test_host_tier_keeps_evicted_blocks_and_reloads_them():
    # A pool of 11 blocks holds exactly one 165-token prompt (10 full blocks + 1 partial).
    s = serve(["--kv-tier", "host", "--num-kv-blocks", "11"])
    try:
        a, b = prompt_text(3, 165), prompt_text(4, 165)
        r1 = complete(s, a, 1)
        assert r1.prefix["computed_tokens"] == 165
        rb = complete(s, b, 1)
        # B takes every block: A's ten cache entries are evicted, into the host tier.
        assert rb.prefix["blocks_evicted"] == 10
        m = Metrics(s)
        assert m.get("cachet:kv_tier_blocks_saved_total", tier="host") == 10
        assert m.get("cachet:kv_tier_host_blocks") == 10
        assert m.get("cachet:kv_tier_host_bytes") == 10 * SIM_BLOCK_BYTES

        r2 = complete(s, a, 1)
        assert_reloaded_from_host(r2, r1)
        # Loading A evicted B's ten entries: the host tier now holds both prompts.
        m = Metrics(s)
        assert m.get("vllm:prompt_tokens_cached_by_source_total", source="host") == 160
        assert m.get("vllm:prompt_tokens_cached_by_source_total", source="redis") == 0
        assert m.get("vllm:external_prefix_cache_hits_total") == 160
        # Queried: N - local hit per lookup = 165 * 3.
        assert m.get("vllm:external_prefix_cache_queries_total") == 495
        assert m.get("cachet:kv_tier_blocks_loaded_total", tier="host") == 10
        assert m.get("vllm:kv_offload_load_bytes_total", tier="host") == 10 * SIM_BLOCK_BYTES
        assert m.get("cachet:kv_tier_blocks_saved_total", tier="host") == 20
        assert m.get("cachet:kv_tier_host_blocks") == 20
        # Every one of the 20 saves copied its block into one payload buffer, warm or fresh.
        taken = [m.get("cachet:kv_tier_save_buffers_total", source=x) for x in ("warm", "fresh")]
        assert sum(taken) == 20, taken
        assert m.get("cachet:kv_tier_up", tier="host") == 1
        assert not m.has("cachet:kv_tier_redis_outages_total")
        assert 'num_cpu_blocks="' in m.text
    finally:
        s.stop()



def test_host_tier_saving_on_fill_copies_nothing_on_eviction():
    # The pool of the test above, with `--kv-tier-host-save filled`: blocks enter the host tier
    # when they are computed, so an eviction finds its block already there and copies nothing
    # (counted as a dedup skip), and a reload is served exactly as with saves on eviction.
    s = serve(["--kv-tier", "host", "--num-kv-blocks", "11", "--kv-tier-host-save", "filled"])
    try:
        a, b = prompt_text(3, 165), prompt_text(4, 165)
        r1 = complete(s, a, 1)
        assert r1.prefix["computed_tokens"] == 165
        m = Metrics(s)
        # A's ten full blocks were saved as they were filled; nothing was evicted yet.
        assert m.get("cachet:kv_tier_blocks_saved_total", tier="host") == 10
        assert m.get("cachet:kv_tier_host_blocks") == 10
        assert m.get("cachet:kv_tier_save_dedup_skips_total") == 0

        rb = complete(s, b, 1)
        assert rb.prefix["blocks_evicted"] == 10
        m = Metrics(s)
        # B's ten fills saved; A's ten evictions found their blocks in the tier: no copy.
        assert m.get("cachet:kv_tier_blocks_saved_total", tier="host") == 20
        assert m.get("cachet:kv_tier_save_dedup_skips_total") == 10
        assert m.get("cachet:kv_tier_host_blocks") == 20
        assert m.get("cachet:kv_tier_host_bytes") == 20 * SIM_BLOCK_BYTES

        r2 = complete(s, a, 1)
        assert_reloaded_from_host(r2, r1)
        m = Metrics(s)
        assert m.get("vllm:prompt_tokens_cached_by_source_total", source="host") == 160
        assert m.get("cachet:kv_tier_blocks_loaded_total", tier="host") == 10
        # No new copy: B's ten evictions and A's ten reloaded blocks (new cache entries again,
        # which the tier already holds) are all skips.
        assert m.get("cachet:kv_tier_blocks_saved_total", tier="host") == 20
        assert m.get("cachet:kv_tier_save_dedup_skips_total") == 30
        taken = [m.get("cachet:kv_tier_save_buffers_total", source=x) for x in ("warm", "fresh")]
        assert sum(taken) == 20, taken
    finally:
        s.stop()

def test_host_in_front_of_redis():
    """Stacked: what the host tier holds comes from it, the rest from Redis."""
    r = RedisNode().start()
    s1 = serve(redis_tier(r.url))
    s2 = serve(["--kv-tier", "host,redis", "--kv-tier-redis-url", r.url, "--num-kv-blocks", "11"])
    try:
        a, b = prompt_text(5, 165), prompt_text(6, 165)
        ra = complete(s1, a, 1)
        settled(s1, 10)
        # s2 computes B, then loads A from Redis (evicting B into its host tier) ...
        complete(s2, b, 1)
        r2 = complete(s2, a, 1)
        assert r2.text == ra.text
        assert r2.prefix["external_sources"] == {"host": 0, "redis": 160, "disk": 0}
        # ... and B again comes from its host tier (its own eviction), not from Redis.
        r3 = complete(s2, b, 1)
        assert r3.prefix["external_sources"] == {"host": 160, "redis": 0, "disk": 0}
        m = Metrics(s2)
        assert m.get("vllm:prompt_tokens_cached_by_source_total", source="host") == 160
        assert m.get("vllm:prompt_tokens_cached_by_source_total", source="redis") == 160
        assert m.get("cachet:kv_tier_blocks_loaded_total", tier="host") == 10
        assert m.get("cachet:kv_tier_blocks_loaded_total", tier="redis") == 10
    finally:
        s1.stop()
        s2.stop()
        r.stop()
