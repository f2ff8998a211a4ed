"""The disk KV tier (`--kv-tier disk`): warm restarts and their faults, on the simulator with
16-token blocks.

A 100-token prompt fills floor(100/16) = 6 blocks (the 4 generated tokens do not reach a 7th),
so the disk holds 6 block files after it. After a restart the local pool is empty: the same
prompt's lookup finds 6 blocks on disk, the external tier supplies whole_blocks(100) = 96
tokens (the last prompt token is always computed), 4 are computed, and every number says tier
`disk`. Each block file is a Redis-format value: 78 fixed header bytes + 7 (layout `sim:u64`) +
8 (payload length) + 128 (16 tokens x 8 bytes) + 32 (checksum) = 253 bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import requests

from conftest import BIN, BLOCK_SIZE, ROOT, free_port
from tiers_lib import (
    SIM,
    Metrics,
    complete,
    log_lines,
    metric,
    prompt_text,
    serve,
    wait_for,
    whole_blocks,
)

N = 100
BLOCKS = N // BLOCK_SIZE  # 6
VALUE = 78 + 7 + 8 + BLOCK_SIZE * 8 + 32  # 253


def disk_tier(path: str, tiers: str = "disk", *more: str) -> list[str]:
    return ["--kv-tier", tiers, "--kv-tier-disk-path", path, *more]


def block_files(path: str) -> list[Path]:
    return sorted(Path(path, "blocks").glob("*.kv"))


def saved(server, blocks: int) -> None:
    wait_for(
        lambda: metric(server, "cachet:kv_tier_disk_blocks") == blocks
        and metric(server, "cachet:kv_tier_blocks_saved_total", tier="disk") == blocks,
        f"{blocks} blocks on disk",
    )


@pytest.fixture
def kvdir():
    d = tempfile.mkdtemp(prefix="cachet-disk-")
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.mark.parametrize("tiers", ["disk", "host,disk"])
def test_a_restart_loads_what_the_last_process_saved(kvdir, tiers):
    prompt = prompt_text(1, N)
    a = serve(disk_tier(kvdir, tiers))
    try:
        r1 = complete(a, prompt)
        assert r1.prefix["external_cached_tokens"] == 0
        saved(a, BLOCKS)
        assert metric(a, "cachet:kv_tier_disk_bytes") == BLOCKS * VALUE
    finally:
        a.stop()
    assert len(block_files(kvdir)) == BLOCKS

    b = serve(disk_tier(kvdir, tiers))
    try:
        rebuilt = log_lines(b, "index rebuilt")
        assert len(rebuilt) == 1 and f"blocks={BLOCKS}" in rebuilt[0], rebuilt
        assert f"bytes={BLOCKS * VALUE}" in rebuilt[0], rebuilt
        r2 = complete(b, prompt)
        ext = whole_blocks(N)  # 96
        p = r2.prefix
        assert (p["local_cached_tokens"], p["external_cached_tokens"], p["computed_tokens"]) == (0, ext, N - ext)
        assert p["external_sources"] == {"host": 0, "redis": 0, "disk": ext}
        assert r2.text == r1.text
        m = Metrics(b)
        assert m.get("vllm:prompt_tokens_cached_by_source_total", source="disk") == ext
        assert m.get("vllm:external_prefix_cache_hits_total") == ext
        assert m.get("vllm:external_prefix_cache_queries_total") == N
        assert m.get("cachet:kv_tier_blocks_loaded_total", tier="disk") == BLOCKS
        assert m.get("vllm:kv_offload_load_bytes_total", tier="disk") == BLOCKS * BLOCK_SIZE * 8
        assert m.get("cachet:kv_tier_load_failures_total") == 0
        # The loaded blocks are not written again (the disk holds them).
        assert m.get("cachet:kv_tier_blocks_saved_total", tier="disk") == 0
    finally:
        b.stop()


def start_refused(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [BIN, "serve", *SIM, "--host", "127.0.0.1", "--port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_two_instances_cannot_share_a_directory(kvdir):
    a = serve(disk_tier(kvdir))
    try:
        out = start_refused(disk_tier(kvdir))
        assert out.returncode == 2, out
        errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
        assert len(errors) == 1, out.stderr
        assert "in use by another cachet process" in errors[0]
        assert f"pid {a.proc.pid}" in errors[0]
        # The first instance serves on.
        assert complete(a, prompt_text(2, 40)).prefix["prompt_tokens"] == 40
    finally:
        a.stop()


def test_a_path_that_cannot_be_written_is_refused(kvdir):
    plain = os.path.join(kvdir, "a-file")
    Path(plain).write_text("x")
    out = start_refused(disk_tier(os.path.join(plain, "kv")))
    assert out.returncode == 2, out
    errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "cannot create the directory" in errors[0], out.stderr


def test_a_budget_below_one_block_drops_every_save_and_serves(kvdir):
    s = serve(disk_tier(kvdir, "disk", "--kv-tier-disk-bytes", str(VALUE - 1)))
    try:
        prompt = prompt_text(3, N)
        r1 = complete(s, prompt)
        wait_for(lambda: metric(s, "cachet:kv_tier_save_drops_total", reason="too_large") == BLOCKS,
                 "6 saves dropped")
        r2 = complete(s, prompt)
        # Served from the local pool as usual; nothing on disk.
        assert r2.prefix["local_cached_tokens"] == whole_blocks(N) and r2.text == r1.text
        assert metric(s, "cachet:kv_tier_disk_blocks") == 0
        assert block_files(kvdir) == []
    finally:
        s.stop()


def can_mount_tmpfs() -> bool:
    if os.geteuid() != 0:
        return False
    d = tempfile.mkdtemp(prefix="cachet-tmpfs-probe-")
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", d], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", d], check=False)
    os.rmdir(d)
    return ok


@pytest.mark.skipif(not can_mount_tmpfs(), reason="mounting a tmpfs needs root")
def test_a_full_disk_drops_saves_counts_them_and_serves():
    # 16 KiB = 4 pages: the LOCK file takes one, each 253-byte block file one: 3 blocks fit.
    d = tempfile.mkdtemp(prefix="cachet-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", d], check=True)
    try:
        s = serve(disk_tier(d, "disk", "--kv-tier-disk-bytes", "1M"))
        try:
            prompt = prompt_text(4, N)
            r1 = complete(s, prompt)
            wait_for(lambda: metric(s, "cachet:kv_tier_disk_write_failures_total")
                     + metric(s, "cachet:kv_tier_blocks_saved_total", tier="disk") == BLOCKS,
                     "every save settled")
            m = Metrics(s)
            assert m.get("cachet:kv_tier_blocks_saved_total", tier="disk") == 3
            assert m.get("cachet:kv_tier_disk_write_failures_total") == 3
            assert m.get("cachet:kv_tier_disk_blocks") == 3
            assert len(log_lines(s, "disk write failed")) == 1
            r2 = complete(s, prompt_text(5, N))
            assert r2.prefix["prompt_tokens"] == N
            assert complete(s, prompt).text == r1.text
        finally:
            s.stop()
        assert not list(Path(d, "blocks").glob("*.tmp"))
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def corrupt_payloads(path: str) -> None:
    for f in block_files(path):
        v = bytearray(f.read_bytes())
        v[120] ^= 0xFF  # a payload byte: the length still agrees, the checksum does not
        f.write_bytes(bytes(v))


def truncate(path: str) -> None:
    for f in block_files(path):
        os.truncate(f, 60)


@pytest.mark.parametrize("fault", ["changed_before_start", "truncated_under_the_server"])
def test_a_bad_file_is_refused_and_computed(kvdir, fault):
    prompt = prompt_text(6, N)
    a = serve(disk_tier(kvdir))
    try:
        r1 = complete(a, prompt)
        saved(a, BLOCKS)
    finally:
        a.stop()
    if fault == "changed_before_start":
        corrupt_payloads(kvdir)
    b = serve(disk_tier(kvdir))
    try:
        # Header and length intact: all 6 indexed at start.
        assert f"blocks={BLOCKS}" in log_lines(b, "index rebuilt")[0]
        if fault == "truncated_under_the_server":
            truncate(kvdir)
        r2 = complete(b, prompt)
        p = r2.prefix
        assert (p["external_cached_tokens"], p["computed_tokens"]) == (0, N)
        assert p["external_sources"] == {"host": 0, "redis": 0, "disk": 0}
        assert r2.text == r1.text
        m = Metrics(b)
        # The lookup found the leading block; its load failed, so the whole request computed.
        assert m.get("cachet:kv_tier_load_failures_total", cause="corrupt") >= 1
        assert m.get("cachet:kv_tier_blocks_loaded_total", tier="disk") + m.get(
            "cachet:kv_tier_load_failures_total", cause="corrupt") == BLOCKS
        assert m.get("vllm:prompt_tokens_cached_by_source_total", source="disk") == 0
        # The refused files were removed and the recomputed blocks written anew.
        saved(b, BLOCKS)
    finally:
        b.stop()


def test_another_block_size_loads_nothing(kvdir):
    prompt = prompt_text(7, N)
    a = serve(disk_tier(kvdir))
    try:
        complete(a, prompt)
        saved(a, BLOCKS)
    finally:
        a.stop()
    other = ["--executor", "sim", "--block-size", "32"]
    b = serve(disk_tier(kvdir), executor_args=other)
    try:
        refused = log_lines(b, "another model, KV layout, block size")
        assert len(refused) == 1 and f"files={BLOCKS}" in refused[0], refused
        assert "blocks=0" in log_lines(b, "index rebuilt")[0]
        r = complete(b, prompt)
        assert r.prefix["external_cached_tokens"] == 0
        assert metric(b, "cachet:kv_tier_load_failures_total") == 0
    finally:
        b.stop()
    # Left on disk: the first model's files are still there for it.
    assert len(block_files(kvdir)) >= BLOCKS


def test_save_on_shutdown_writes_what_the_queue_dropped(kvdir):
    # A one-slot save queue drops most of a 2,000-token prompt's 125 fills; SIGTERM with
    # --kv-tier-disk-save-on-shutdown writes the pool's cached blocks that are not on disk.
    n = 2000
    prompt = prompt_text(8, n)
    args = disk_tier(kvdir, "disk", "--kv-tier-save-queue", "1", "--kv-tier-disk-save-on-shutdown")
    a = serve(args)
    try:
        complete(a, prompt)
        wait_for(lambda: metric(a, "cachet:kv_tier_blocks_saved_total", tier="disk")
                 + metric(a, "cachet:kv_tier_save_drops_total", reason="queue_full") == n // BLOCK_SIZE,
                 "every fill saved or dropped")
        dropped = metric(a, "cachet:kv_tier_save_drops_total", reason="queue_full")
    finally:
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=60)
        a.stop()
    assert dropped > 0
    assert len(log_lines(a, "handed to the disk KV tier")) == 1
    assert len(block_files(kvdir)) == n // BLOCK_SIZE  # 125
    b = serve(disk_tier(kvdir))
    try:
        r = complete(b, prompt)
        assert r.prefix["external_sources"]["disk"] == whole_blocks(n)  # 1,984
    finally:
        b.stop()


def session_turn(server, prompt: str, session_id: str) -> dict:
    r = requests.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
              "session_id": session_id},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_parked_session_continues_after_a_restart(kvdir):
    # Turn 1: 100 prompt tokens and 4 generated; the session parks 103 tokens (the last
    # generated one was never computed) and the disk holds its 6 full blocks. SIGTERM keeps the
    # session in sessions.json. After the restart, turn 2 sends turn 1's prompt and reply and 20
    # new tokens (124): the session is `restored` (turn 2), its 6 blocks come from the disk
    # (96 tokens, tier disk), and 28 are computed.
    p1 = prompt_text(11, N)
    a = serve(disk_tier(kvdir))
    try:
        v1 = session_turn(a, p1, "conv-1")
        assert v1["session"]["status"] == "new"
        saved(a, BLOCKS)
    finally:
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=60)
        a.stop()
    assert len(log_lines(a, "parked sessions kept on disk")) == 1
    assert Path(kvdir, "sessions.json").exists()
    b = serve(disk_tier(kvdir))
    try:
        assert len(log_lines(b, "sessions parked before the restart are restorable")) == 1
        reply = v1["choices"][0]["text"]
        assert len(reply.encode()) == 4, reply
        v2 = session_turn(b, p1 + reply + prompt_text(12, 20), "conv-1")
        assert v2["session"]["status"] == "restored"
        assert v2["session"]["turn"] == 2
        p = v2["metrics"]["prefix_cache"]
        assert (p["prompt_tokens"], p["local_cached_tokens"], p["external_cached_tokens"],
                p["computed_tokens"]) == (124, 0, 96, 28)
        assert p["external_sources"]["disk"] == 96
        assert v2["usage"]["prompt_tokens"] == 124
        assert v2["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        # A turn that does not extend the kept tokens starts afresh.
        v3 = session_turn(b, prompt_text(13, 40), "conv-2")
        assert v3["session"]["status"] == "new"
    finally:
        b.stop()


def test_a_stored_response_chain_continues_after_a_restart(kvdir):
    # Turn 1 (as test_responses.py's chain): 38 input tokens, 4 reply tokens before EOS; the
    # session parks 42 tokens, whose 2 full blocks are on disk. SIGTERM keeps the response and
    # the session. After the restart the response reads back, and turn 2 (78 tokens) continues
    # it: no KV is retained here, so the lookup loads the 2 blocks from the disk (32 cached) and
    # [32, 48) and [48, 64) are written anew (32).
    import openai

    args = disk_tier(kvdir)
    extra = ["--sim-eos-at-output", "5"]
    a = serve(args, extra=extra)
    try:
        c = openai.OpenAI(api_key="unused", base_url=f"{a.base_url}/v1", max_retries=0)
        r1 = c.responses.create(model=a.model(), input="abcdefgh-chain", max_output_tokens=16)
        assert r1.usage.input_tokens == 38
        saved(a, 2)
    finally:
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=60)
        a.stop()
    assert len(log_lines(a, "stored responses kept")) == 1
    b = serve(args, extra=extra)
    try:
        assert len(log_lines(b, "stored responses from before the restart are kept")) == 1
        c = openai.OpenAI(api_key="unused", base_url=f"{b.base_url}/v1", max_retries=0)
        back = c.responses.retrieve(r1.id)
        assert back.output_text == r1.output_text
        r2 = c.responses.create(
            model=b.model(), input="hello world", previous_response_id=r1.id, max_output_tokens=16
        )
        u = r2.usage
        assert u.input_tokens == 78
        assert u.input_tokens_details.cached_tokens == 32
        assert u.input_tokens_details.cache_write_tokens == 32
        p = r2.model_extra["metrics"]["prefix_cache"]
        assert (p["local_cached_tokens"], p["external_sources"]["disk"]) == (0, 32)
        assert r2.model_extra["metrics"]["previous_response"] == {"id": r1.id, "kv": "prefix_cache"}
    finally:
        b.stop()
