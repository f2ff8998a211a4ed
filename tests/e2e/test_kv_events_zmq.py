"""cachet's KV events read with plain pyzmq sockets, as llm-d's indexer and vLLM's own
consumers read them.

- A SUB socket **bound** at an address, cachet's PUB **connecting** to it (an endpoint without
  `*`): the deployment llm-d uses (the indexer binds, engines connect).
- vLLM's current replay protocol on the ROUTER socket: a msgpack request
  (`start_seq`, `publisher_epoch`, `force_snapshot`) answered with one msgpack map (the batches,
  or a snapshot when the buffer no longer reaches back), beside the 8-byte legacy request.

The simulated executor with 16-token blocks; prompts are token lists, so what each request
stores follows from the block arithmetic (a prompt of N tokens caches floor(N/16) blocks).
"""

from __future__ import annotations

import json
import time

import msgpack
import pytest
import requests
import zmq

from conftest import free_port, start_server

BLOCK = 16


def prompt(seed: int, n: int = 40) -> list[int]:
    """n tokens sharing no first block with another seed's."""
    return [100 + seed] + [103 + (seed * 37 + i * 11) % 150 for i in range(n - 1)]


def complete(server, tokens: list[int]) -> None:
    r = requests.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": tokens, "max_tokens": 1, "temperature": 0, "ignore_eos": True},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def start(endpoint: str, extra_cfg: dict | None = None, extra: list[str] | None = None):
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    cfg.update(extra_cfg or {})
    return start_server(["--kv-events-config", json.dumps(cfg), *(extra or [])])


def events_of(payload: bytes) -> list[dict]:
    ts, events, _rank = msgpack.unpackb(payload, raw=False)
    return events


def recv_until_quiet(sub: zmq.Socket, quiet_s: float = 1.0) -> list[tuple[int, list[dict]]]:
    """Every batch until none has come for `quiet_s`."""
    out = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        out.append((int.from_bytes(seq, "big"), events_of(payload)))
    return out


def recv_batches(sub: zmq.Socket, n: int, timeout_s: float = 10.0) -> list[tuple[int, list[dict]]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""
            out.append((int.from_bytes(seq, "big"), events_of(payload)))
    return out


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def wait_polling(sub: zmq.Socket, seconds: float) -> None:
    """Waits while touching the socket, as a consumer's receive loop does: libzmq handles a
    socket's commands (a new connection's pipe, and with it the subscription a SUB sends on it)
    only inside calls on that socket, so a SUB left untouched has not yet subscribed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not sub.poll(50), "nothing is published before the first request"


def test_a_bound_sub_receives_a_connecting_publishers_events(ctx):
    port = free_port()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    server = start(f"tcp://127.0.0.1:{port}")
    try:
        # The subscription reaches cachet's PUB some time after it connects, and a PUB drops
        # what no subscription asks for: every PUB/SUB consumer waits for it, receiving.
        wait_polling(sub, 0.5)
        for seed in range(3):
            complete(server, prompt(seed))
        got = recv_batches(sub, 3)
        # One batch per request (each ran alone), numbered from 0, each storing its 2 full
        # blocks (40 tokens: blocks [0, 16) and [16, 32)).
        assert [seq for seq, _ in got] == [0, 1, 2]
        for seed, (_, events) in enumerate(got):
            assert [e["type"] for e in events] == ["BlockStored"]
            assert len(events[0]["block_hashes"]) == 2
            assert events[0]["token_ids"] == prompt(seed)[:32]
    finally:
        server.stop()


def test_an_untouched_bound_sub_loses_a_libzmq_publishers_messages_too(ctx):
    """The behaviour issue 52 reported as cachet's bug (a bound SUB that receives nothing) is
    libzmq's: a SUB the application does not call between the connection and the sends has sent
    no subscription yet, and libzmq's own PUB (vLLM's) drops the messages exactly as cachet's
    does. Shown here with a pyzmq PUB, so the test above is the fair check of cachet."""
    port = free_port()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.5)  # the SUB is not called meanwhile
        for i in range(3):
            pub.send_multipart([b"", i.to_bytes(8, "big"), b"x"])
        assert recv_until_quiet(sub, 0.5) == []
        pub.send_multipart([b"", (3).to_bytes(8, "big"), b"x"])
        # The poll above sent the subscription: now messages flow.
        assert sub.poll(2000)
        assert sub.recv_multipart()[1] == (3).to_bytes(8, "big")
    finally:
        pub.close(linger=0)
        sub.close(linger=0)


def test_a_sub_bound_after_the_publisher_started_still_gets_the_stream(ctx):
    port = free_port()
    server = start(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.5)  # cachet retries the connection meanwhile
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 15
        got = []
        seed = 0
        # Whatever was published before the connection is gone; keep sending until the
        # stream flows, then three more requests arrive in order.
        while not got and time.monotonic() < deadline:
            complete(server, prompt(seed))
            seed += 1
            got = recv_batches(sub, 1, timeout_s=0.5)
        assert got, "no batch reached the bound SUB"
        first = got[-1][0]
        for s in range(3):
            complete(server, prompt(100 + s))
        more = recv_batches(sub, 3)
        assert [seq for seq, _ in more] == [first + 1, first + 2, first + 3]
    finally:
        server.stop()


def bind_retrying(sock: zmq.Socket, endpoint: str, timeout_s: float = 5.0) -> None:
    """Binds where a socket just closed: libzmq releases the address asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_restarted_sub_gets_the_stream_again(ctx):
    """The subscriber at the bound address goes away and comes back: cachet's PUB connects
    again (the `zeromq` crate's PUB does not reconnect by itself)."""
    port = free_port()
    server = start(f"tcp://127.0.0.1:{port}")
    try:
        seed = 0
        for round_ in range(2):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            bind_retrying(sub, f"tcp://127.0.0.1:{port}")
            deadline = time.monotonic() + 15
            got = []
            while not got and time.monotonic() < deadline:
                complete(server, prompt(seed))
                seed += 1
                got = recv_batches(sub, 1, timeout_s=0.5)
            assert got, f"round {round_}: no batch reached the bound SUB"
            complete(server, prompt(seed))
            seed += 1
            (seq, _), = recv_batches(sub, 1)
            assert seq == got[-1][0] + 1
            sub.close(linger=0)
    finally:
        server.stop()


def replay(ctx, endpoint: str, request: dict) -> dict:
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    try:
        d.send_multipart([b"", msgpack.packb(request)])
        assert d.poll(10_000), "no replay answer"
        empty, answer = d.recv_multipart()
        assert empty == b""
        return msgpack.unpackb(answer, raw=False)
    finally:
        d.close(linger=0)


def apply(index: set, events: list[dict]) -> None:
    """A consumer's index: the hashes the stream says are held on the GPU."""
    for e in events:
        if e["type"] == "BlockStored":
            index.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            index.difference_update(e["block_hashes"])
        elif e["type"] == "AllBlocksCleared":
            index.clear()


def test_a_consumer_that_fell_behind_rebuilds_its_index_from_a_snapshot(ctx):
    pub_port, replay_port = free_port(), free_port()
    # A 16-block pool and a replay buffer of 2 batches: later prompts evict earlier blocks, and
    # the buffer soon no longer reaches back to batch 0.
    server = start(
        f"tcp://*:{pub_port}",
        {"replay_endpoint": f"tcp://*:{replay_port}", "buffer_steps": 2},
        ["--num-kv-blocks", "16"],
    )
    replay_ep = f"tcp://127.0.0.1:{replay_port}"
    try:
        live = ctx.socket(zmq.SUB)
        live.setsockopt(zmq.SUBSCRIBE, b"")
        live.connect(f"tcp://127.0.0.1:{pub_port}")
        time.sleep(0.5)
        # Five prompts of 100 tokens (6 full blocks, 7 allocated): the 16-block pool evicts.
        for seed in range(5):
            complete(server, prompt(seed, 100))
        batches = recv_until_quiet(live)
        n = len(batches)
        assert [s for s, _ in batches] == list(range(n))
        assert n >= 5
        truth: set = set()
        for _, events in batches:
            apply(truth, events)
        assert any(e["type"] == "BlockRemoved" for _, ev in batches for e in ev)

        # A consumer that saw nothing asks from 0: the buffer holds only the last 2 batches, so a
        # snapshot, after which the live stream continues at next_seq.
        first = replay(ctx, replay_ep, {"start_seq": 0, "publisher_epoch": None, "force_snapshot": False})
        epoch = first["publisher_epoch"]
        assert len(epoch) == 32
        assert first["next_seq"] == n
        assert "replayed_batches" not in first
        ts, events, rank = first["snapshot"]
        assert rank == 0
        assert events[0]["type"] == "AllBlocksCleared"
        assert [e["type"] for e in events[1:]] == ["BlockStored"]
        index: set = set()
        apply(index, events)
        assert index == truth
        assert len(index) == len(events[1]["block_hashes"])
        assert len(events[1]["token_ids"]) == BLOCK * len(index)

        # One more request; the consumer, now at next_seq n of this epoch, gets it replayed.
        complete(server, prompt(9, 100))
        new_batches = recv_until_quiet(live)
        assert [s for s, _ in new_batches] == list(range(n, n + len(new_batches)))
        for _, ev in new_batches:
            apply(truth, ev)
        m = n + len(new_batches)
        again = replay(ctx, replay_ep, {"start_seq": n, "publisher_epoch": epoch, "force_snapshot": False})
        assert again["next_seq"] == m
        assert "snapshot" not in again
        assert 1 <= len(new_batches) <= 2  # the buffer's 2 batches reach back to n
        assert [s for s, _ in again["replayed_batches"]] == list(range(n, m))
        for _, batch in again["replayed_batches"]:
            apply(index, batch[1])
        assert index == truth

        # Asked for, or from a consumer of another epoch: a snapshot, equal to the index.
        for req in (
            {"start_seq": m, "publisher_epoch": epoch, "force_snapshot": True},
            {"start_seq": m, "publisher_epoch": "0" * 32, "force_snapshot": False},
        ):
            snap = replay(ctx, replay_ep, req)
            rebuilt: set = set()
            apply(rebuilt, snap["snapshot"][1])
            assert rebuilt == truth
            assert snap["next_seq"] == m

        # The legacy 8-byte request still gets one message per buffered batch, then the end.
        d = ctx.socket(zmq.DEALER)
        d.connect(replay_ep)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert d.poll(10_000)
            empty, seq, payload = d.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b""
                break
            seqs.append(n)
        d.close(linger=0)
        assert seqs == [m - 2, m - 1]
    finally:
        server.stop()

    # A restarted publisher has another epoch.
    server = start(f"tcp://*:{pub_port}", {"replay_endpoint": f"tcp://*:{replay_port}"})
    try:
        fresh = replay(ctx, replay_ep, {"start_seq": 0})
        assert fresh["publisher_epoch"] != epoch
        assert fresh["next_seq"] == 0
        assert fresh["replayed_batches"] == []
    finally:
        server.stop()
