"""Resumable sessions (GitHub issue 5) through the official SDKs: `session_id` via `extra_body`.

The server simulates 300 us of prefill per computed prompt token, so a turn that recomputes a
long conversation is measurably slower to its first token than one that continues a session.
"""

from __future__ import annotations

import threading
import time
import uuid

import anthropic
import openai
import pytest
import requests

from conftest import start_server

PREFILL_US_PER_TOKEN = 300


@pytest.fixture(scope="module")
def slow_server():
    s = start_server(["--enable-per-request-metrics", "--sim-prefill-us-per-token", str(PREFILL_US_PER_TOKEN)])
    yield s
    s.stop()


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=server.api_key or "unused", base_url=f"{server.base_url}/v1", max_retries=0)


def anth(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=server.api_key or "unused", base_url=server.base_url, max_retries=0)


def count(server, messages) -> int:
    r = requests.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


def long_text(n_words: int) -> str:
    return uuid.uuid4().hex + " " + " ".join(f"w{i}" for i in range(n_words))


def stream_turn(server, messages, session_id=None, max_tokens=4):
    """Streams one chat turn: (text, client-side time to the first content token, usage chunk)."""
    extra = {"ignore_eos": True}
    if session_id is not None:
        extra["session_id"] = session_id
    t0 = time.perf_counter()
    stream = oai(server).chat.completions.create(
        model=server.model(),
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    ttft = None
    text = ""
    last = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        last = chunk
    assert ttft is not None
    return text, ttft, last


def delete_session(server, sid: str) -> None:
    r = requests.delete(f"{server.base_url}/v1/sessions/{sid}", headers=server.headers, timeout=30)
    assert r.status_code == 204, r.text


def reset_cache(server) -> bool:
    r = requests.post(f"{server.base_url}/reset_prefix_cache", headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["reset"]


def test_turn2_computes_only_new_tokens_and_is_faster(slow_server):
    s = slow_server
    sid = "e2e-" + uuid.uuid4().hex
    turn1 = [{"role": "user", "content": long_text(400)}]
    c = oai(s)
    r1 = c.chat.completions.create(
        model=s.model(), messages=turn1, max_tokens=4, temperature=0, extra_body={"session_id": sid, "ignore_eos": True}
    )
    body1 = r1.model_dump()
    assert body1["session"] == {"id": sid, "continued": False, "status": "new", "turn": 1}
    p1 = count(s, turn1)
    assert r1.usage.prompt_tokens == p1
    reply = r1.choices[0].message.content
    n_out = r1.usage.completion_tokens

    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    p2 = count(s, turn2)
    # Parked KV: turn 1's prompt and its generated tokens but the last (never computed).
    retained = p1 + n_out - 1
    new_tokens = p2 - retained
    text, ttft_session, last = stream_turn(s, turn2, session_id=sid)
    extra = last.model_extra
    assert extra["session"] == {"id": sid, "continued": True, "status": "continued", "turn": 2}
    assert last.usage.prompt_tokens == p2
    assert last.usage.prompt_tokens_details.cached_tokens == retained
    pc = extra["metrics"]["prefix_cache"]
    assert pc["computed_tokens"] == new_tokens
    assert pc["computed_tokens"] == last.usage.prompt_tokens - extra["metrics"]["session"]["retained_tokens"]
    assert pc["prompt_tokens"] == new_tokens
    assert extra["metrics"]["session"]["session_continued"] is True
    assert extra["metrics"]["session"]["cumulative"]["computed_tokens"] == p1 + new_tokens

    # The same turn-2 conversation, from nothing: release the session, empty the cache.
    assert reset_cache(s) is False  # the parked session still holds blocks
    delete_session(s, sid)
    assert reset_cache(s) is True
    _, ttft_fresh, last_fresh = stream_turn(s, turn2)
    assert "session" not in (last_fresh.model_extra or {})
    assert last_fresh.usage.prompt_tokens == p2
    assert last_fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert last_fresh.model_extra["metrics"]["prefix_cache"]["computed_tokens"] == p2
    # ~p2 * 300 us of simulated prefill against ~new_tokens * 300 us.
    print(f"turn 2: {p2} prompt tokens, {new_tokens} new; ttft session {ttft_session:.3f}s, fresh {ttft_fresh:.3f}s")
    assert ttft_session < ttft_fresh, (ttft_session, ttft_fresh)
    assert ttft_session < ttft_fresh / 2, (ttft_session, ttft_fresh)


def test_unknown_deleted_and_edited_sessions_say_so(slow_server):
    s = slow_server
    c = oai(s)
    sid = "e2e-" + uuid.uuid4().hex
    msgs = [{"role": "user", "content": long_text(20)}]
    r = c.chat.completions.create(model=s.model(), messages=msgs, max_tokens=3, extra_body={"session_id": sid})
    assert r.model_dump()["session"]["status"] == "new"
    edited = [
        {"role": "user", "content": "edited " + msgs[0]["content"]},
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "next"},
    ]
    r = c.chat.completions.create(model=s.model(), messages=edited, max_tokens=3, extra_body={"session_id": sid})
    session = r.model_dump()["session"]
    assert session["status"] == "history_mismatch" and session["continued"] is False, session
    delete_session(s, sid)
    r = c.chat.completions.create(model=s.model(), messages=edited, max_tokens=3, extra_body={"session_id": sid})
    assert r.model_dump()["session"]["status"] == "new"
    delete_session(s, sid)


def test_anthropic_session_usage(slow_server):
    s = slow_server
    a = anth(s)
    sid = "e2e-" + uuid.uuid4().hex
    msgs = [{"role": "user", "content": long_text(40)}]
    m1 = a.messages.create(model=s.model(), max_tokens=4, messages=msgs, extra_body={"session_id": sid})
    assert m1.model_extra["session"]["status"] == "new"
    p1 = count(s, msgs)
    msgs2 = msgs + [{"role": "assistant", "content": m1.content[0].text}, {"role": "user", "content": "more please"}]
    p2 = count(s, msgs2)
    retained = p1 + m1.usage.output_tokens - 1
    with a.messages.stream(model=s.model(), max_tokens=4, messages=msgs2, extra_body={"session_id": sid}) as st:
        final = st.get_final_message()
    u = final.usage
    assert u.cache_read_input_tokens == retained
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == p2
    delete_session(s, sid)


def test_concurrent_turn_is_409(slow_server):
    s = slow_server
    sid = "e2e-" + uuid.uuid4().hex
    # A long first turn (~600 ms of simulated prefill) in the background.
    body = {"model": s.model(), "messages": [{"role": "user", "content": long_text(400)}], "max_tokens": 4, "session_id": sid}
    result = {}

    def first():
        result["r"] = requests.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.2)
    with pytest.raises(openai.ConflictError) as ei:
        oai(s).chat.completions.create(
            model=s.model(), messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body={"session_id": sid}
        )
    assert ei.value.status_code == 409
    err = ei.value.response.json()["error"]
    assert err["type"] == "conflict_error" and err["code"] == "session_busy", err
    t.join()
    assert result["r"].status_code == 200
    delete_session(s, sid)
