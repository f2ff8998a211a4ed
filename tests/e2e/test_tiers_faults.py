"""Faults of the Redis tier through the real binary (simulated executor): Redis down at start,
killed mid-run, slow, refused values (truncated, flipped bit, another block's, a foreign
layout's, unsigned or signed with another secret), a cluster master failing over.

Always: the output is the one computed without the tier, every block that did not load is
computed and counted as computed (the leading intact blocks are the external tokens), each state
change is logged once (not once per request), and the tier comes back when Redis does.
"""

from __future__ import annotations

import threading
import time

import pytest

from tiers_lib import (
    BLOCK_SIZE,
    SIM,
    Metrics,
    RedisCluster,
    RedisNode,
    complete,
    free_port,
    log_lines,
    metric,
    prompt_text,
    redis_tier,
    serve,
    settled,
    wait_for,
)

BS = BLOCK_SIZE
N = 300  # prompt tokens: 18 whole blocks can come from a tier (288 tokens)
DOWN = "Redis KV tier down"
UP = "Redis KV tier up"
AT_START = "Redis KV tier unreachable at start"


@pytest.fixture
def redis():
    r = RedisNode().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def reference():
    """An instance without a tier: the outputs every tier case must reproduce."""
    s = serve([])
    yield s
    s.stop()


def expect(reference, prompt, max_tokens: int = 4) -> str:
    return complete(reference, prompt, max_tokens).text


def no_redis_crate_warnings(server) -> None:
    # The binary's default filter keeps the redis crate's reconnect chatter out of the log.
    assert not [l for l in log_lines(server, "WARN") if "redis::" in l], server.log()


def test_redis_down_at_start_then_up(reference):
    port = free_port()
    node = RedisNode(port=port)
    s = serve(redis_tier(node.url))
    try:
        assert len(log_lines(s, AT_START)) == 1
        a, b = prompt_text(10, N), prompt_text(11, N)
        for p in (a, b):
            r = complete(s, p)
            assert r.text == expect(reference, p)
            assert r.prefix["external_cached_tokens"] == 0 and r.prefix["computed_tokens"] == N
        # A again: a local hit; nothing is asked of the tier.
        r = complete(s, a)
        assert r.prefix["local_cached_tokens"] == 288 and r.prefix["external_cached_tokens"] == 0
        m = Metrics(s)
        assert m.get("cachet:kv_tier_up", tier="redis") == 0
        assert m.get("cachet:kv_tier_lookup_failures_total", reason="skipped") == 2
        assert m.get("vllm:external_prefix_cache_queries_total") == N + N + (N - 288)
        assert m.get("vllm:external_prefix_cache_hits_total") == 0
        assert m.get("cachet:kv_tier_blocks_saved_total", tier="redis") == 0
        assert m.get("cachet:kv_tier_save_failures_total") > 0

        node.start()
        wait_for(lambda: metric(s, "cachet:kv_tier_up", tier="redis") == 1, "the tier up", 15)
        assert len(log_lines(s, UP)) == 1
        assert len(log_lines(s, AT_START)) == 1
        assert not log_lines(s, DOWN)
        c = prompt_text(12, N)
        complete(s, c)
        settled(s, 18)
        assert len(node.keys()) == (N + 3) // BS
        no_redis_crate_warnings(s)
    finally:
        s.stop()
        node.stop()


def test_redis_killed_mid_run_then_restarted(redis, reference):
    s1 = serve(redis_tier(redis.url))
    s2 = serve(redis_tier(redis.url))
    try:
        p1 = prompt_text(20, N)
        complete(s1, p1)
        settled(s1, 18)
        redis.kill()
        # s2 would load p1, but Redis is gone: the lookup fails, p1 is computed.
        for i, p in enumerate([p1, prompt_text(21, N), prompt_text(22, N)]):
            r = complete(s2, p)
            assert r.text == expect(reference, p)
            assert r.prefix["external_cached_tokens"] == 0 and r.prefix["computed_tokens"] == N
        m = Metrics(s2)
        assert m.get("cachet:kv_tier_up", tier="redis") == 0
        assert m.get("cachet:kv_tier_redis_outages_total") == 1
        assert m.get("cachet:kv_tier_lookup_failures_total", reason="error") == 1
        assert m.get("cachet:kv_tier_lookup_failures_total", reason="skipped") == 2
        assert m.get("vllm:external_prefix_cache_hits_total") == 0
        assert m.get("vllm:prompt_tokens_by_source_total", source="local_compute") == 3 * N
        # One line for the outage, however many requests ran through it.
        assert len(log_lines(s2, DOWN)) == 1
        # s1 learns of it at its first call.
        complete(s1, prompt_text(24, N))
        assert metric(s1, "cachet:kv_tier_up", tier="redis") == 0

        redis.start()  # same port, empty
        for s in (s1, s2):
            wait_for(lambda: metric(s, "cachet:kv_tier_up", tier="redis") == 1, "reconnect", 15)
            # Up at start, down once, up again.
            assert len(log_lines(s, UP)) == 2 and len(log_lines(s, DOWN)) == 1
        p5 = prompt_text(23, N)
        complete(s1, p5)
        settled(s1, 18 + 18)
        r = complete(s2, p5)
        assert r.text == expect(reference, p5)
        assert r.prefix["external_cached_tokens"] == 288
        no_redis_crate_warnings(s2)
    finally:
        s1.stop()
        s2.stop()


def test_slow_redis_is_cut_off_at_the_timeout(redis, reference):
    s1 = serve(redis_tier(redis.url))
    s2 = serve(redis_tier(redis.url, "--kv-tier-timeout-ms", "300"))
    try:
        p1 = prompt_text(30, N)
        complete(s1, p1)
        settled(s1, 18)
        sleeper = threading.Thread(target=lambda: redis.cmd("DEBUG", "SLEEP", "2"))
        sleeper.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        r = complete(s2, p1)
        took = time.monotonic() - t0
        sleeper.join()
        assert r.text == expect(reference, p1)
        assert r.prefix["external_cached_tokens"] == 0 and r.prefix["computed_tokens"] == N
        # Bounded by the timeout (300 ms), not by Redis' 2 s.
        assert took < 1.5, took
        m = Metrics(s2)
        assert m.get("cachet:kv_tier_lookup_failures_total", reason="timeout") == 1
        assert m.get("cachet:kv_tier_redis_outages_total") == 1
        wait_for(lambda: metric(s2, "cachet:kv_tier_up", tier="redis") == 1, "the tier back up", 15)
        assert len(log_lines(s2, DOWN)) == 1
        p2 = prompt_text(31, N)
        complete(s1, p2)
        settled(s1, 36)
        r = complete(s2, p2)
        assert r.prefix["external_cached_tokens"] == 288
    finally:
        s1.stop()
        s2.stop()


def block_keys(redis: RedisNode, writer, prompt: str, upto: int) -> list[bytes]:
    """The Redis keys of the prompt's blocks 0..upto-1, in order: the writer computes one more
    block at a time and each new key is that block's."""
    keys: list[bytes] = []
    for k in range(1, upto + 1):
        before = set(redis.keys())
        complete(writer, prompt[: k * BS + 1], 1)
        wait_for(lambda: len(set(redis.keys()) - before) == 1 and metric(writer, "cachet:kv_tier_saves_pending") == 0,
                 f"block {k - 1}'s key")
        (new,) = set(redis.keys()) - before
        keys.append(new)
    return keys


def test_refused_values_are_computed(redis, reference):
    writer = serve(redis_tier(redis.url))
    foreign = serve(redis_tier(redis.url), executor_args=["--executor", "sim", "--block-size", "32"])
    try:
        p = prompt_text(40, N)
        keys = block_keys(redis, writer, p, 6)
        complete(writer, p, 1)
        settled(writer, 18)
        good = {k: redis.cmd("GET", k) for k in keys}
        want = expect(reference, p)

        def read_with(corrupt: dict[bytes, bytes], external: int, cause: str, log: str) -> None:
            for k, v in corrupt.items():
                assert redis.cmd("SET", k, v) == "OK"
            s = serve(redis_tier(redis.url))
            try:
                r = complete(s, p)
                assert r.text == want
                assert r.prefix["external_cached_tokens"] == external, (cause, r.prefix)
                assert r.prefix["computed_tokens"] == N - external
                m = Metrics(s)
                assert m.get("cachet:kv_tier_load_failures_total", cause=cause) == 1
                assert m.get("cachet:kv_tier_load_failures_total") == 1
                assert m.get("vllm:external_prefix_cache_hits_total") == external
                assert m.get("vllm:prompt_tokens_cached_by_source_total", source="redis") == external
                assert len(log_lines(s, log)) == 1
                settled(s, 0)
            finally:
                s.stop()
            for k, v in good.items():
                redis.cmd("SET", k, v)

        v5 = good[keys[5]]
        # Truncated: blocks 0-4 load (80 tokens), block 5 and everything after it is computed.
        read_with({keys[5]: v5[: len(v5) - 7]}, 80, "corrupt", "value refused (integrity)")
        # One flipped payload bit in block 2: the checksum refuses it.
        v2 = bytearray(good[keys[2]])
        v2[len(v2) // 2] ^= 0x01
        read_with({keys[2]: bytes(v2)}, 32, "corrupt", "value refused (integrity)")
        # A valid value of another block, stored under block 3's key.
        read_with({keys[3]: good[keys[1]]}, 48, "corrupt", "value refused (integrity)")
        # A valid value of another layout (block size 32) under block 0's key.
        complete(foreign, prompt_text(41, 100), 1)
        wait_for(lambda: [k for k in redis.keys() if b":32:" in k], "a block-size-32 key")
        fk = [k for k in redis.keys() if b":32:" in k][0]
        read_with({keys[0]: redis.cmd("GET", fk)}, 0, "foreign_layout", "value refused (foreign layout)")
    finally:
        writer.stop()
        foreign.stop()


def test_values_of_another_secret_or_unsigned_are_refused(redis, reference):
    alpha = ["--kv-tier-secret", "alpha"]
    w = serve(redis_tier(redis.url, *alpha))
    try:
        p = prompt_text(50, N)
        want = expect(reference, p)
        complete(w, p)
        settled(w, 18)
        # The same secret loads it ...
        same = serve(redis_tier(redis.url, *alpha))
        try:
            r = complete(same, p)
            assert r.text == want and r.prefix["external_cached_tokens"] == 288
        finally:
            same.stop()
        # ... another secret refuses every block and computes them.
        other = serve(redis_tier(redis.url, "--kv-tier-secret", "beta"))
        try:
            r = complete(other, p)
            assert r.text == want
            assert r.prefix["external_cached_tokens"] == 0 and r.prefix["computed_tokens"] == N
            m = Metrics(other)
            assert m.get("cachet:kv_tier_load_failures_total", cause="bad_signature") == 18
            assert m.get("vllm:external_prefix_cache_hits_total") == 0
            # Rate-limited: one line for the 18 refusals.
            assert len(log_lines(other, "value refused (signature)")) == 1
        finally:
            other.stop()
        # An unsigned value (written by an instance without a secret) is refused by a signed one.
        unsigned = serve(redis_tier(redis.url))
        try:
            q = prompt_text(51, N)
            complete(unsigned, q)
            settled(unsigned, 18)
        finally:
            unsigned.stop()
        r = complete(w, q)
        assert r.text == expect(reference, q)
        assert r.prefix["external_cached_tokens"] == 0
        assert metric(w, "cachet:kv_tier_load_failures_total", cause="bad_signature") == 18
    finally:
        w.stop()


def test_cluster_master_failover(reference):
    cluster = RedisCluster(masters=3, replicas=1, node_timeout_ms=1000)
    s1 = serve(redis_tier(cluster.url))
    s2 = serve(redis_tier(cluster.url))
    try:
        p = prompt_text(60, 500)
        want = expect(reference, p)
        complete(s1, p)
        settled(s1, 31)
        for m in cluster.masters():
            assert m.cmd("WAIT", 1, 5000) == 1  # every write reached the replica
        victim = cluster.masters()[0]
        victim.kill()
        # During the failover: the right output, and every block that did not load computed.
        r = complete(s2, p)
        assert r.text == want
        ext = r.prefix["external_cached_tokens"]
        assert ext % BS == 0 and r.prefix["computed_tokens"] == 500 - ext
        assert metric(s2, "vllm:external_prefix_cache_hits_total") == ext
        # The replica is promoted; the tier comes back on its own.
        cluster.wait_ok(cluster.live(), timeout=30)
        wait_for(lambda: metric(s2, "cachet:kv_tier_up", tier="redis") == 1, "the tier up after failover", 30)
        # One log line per outage (s2's own saves may meet the cluster still settling: read
        # both until they agree).
        wait_for(lambda: len(log_lines(s2, DOWN)) == metric(s2, "cachet:kv_tier_redis_outages_total") >= 1,
                 "one log line per outage", 10)
        # Everything s1 wrote is still there, on the promoted replicas.
        s3 = serve(redis_tier(cluster.url))
        try:
            wait_for(lambda: metric(s3, "cachet:kv_tier_up", tier="redis") == 1, "s3 connected", 15)
            r = complete(s3, p)
            assert r.text == want
            assert r.prefix["external_cached_tokens"] == 496
            assert metric(s3, "cachet:kv_tier_load_failures_total") == 0
        finally:
            s3.stop()
    finally:
        s1.stop()
        s2.stop()
        cluster.stop()
