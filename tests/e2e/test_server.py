"""End-to-end tests of `cachet serve --executor sim` through the official SDKs."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import uuid

import anthropic
import openai
import pytest
import requests

from conftest import API_KEY, BLOCK_SIZE, start_server


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=server.api_key or "unused", base_url=f"{server.base_url}/v1", max_retries=0)


def anth(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=server.api_key or "unused", base_url=server.base_url, max_retries=0)


def unique(n_words: int = 30) -> str:
    """A prompt no other test sends: a random head, so its first block is new."""
    head = uuid.uuid4().hex
    return head + " " + " ".join(f"w{i}" for i in range(n_words))


def tokenize(server, **body) -> int:
    r = requests.post(f"{server.base_url}/tokenize", json=body, headers=server.headers, timeout=30)
    r.raise_for_status()
    data = r.json()
    assert data["count"] == len(data["tokens"])
    return data["count"]


def floor_block(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


# --- OpenAI ---------------------------------------------------------------------------------


def test_models_and_health(server):
    assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 200
    models = oai(server).models.list()
    assert len(models.data) >= 1


def test_chat_non_streaming(server):
    c = oai(server)
    r = c.chat.completions.create(
        model=server.model(), messages=[{"role": "user", "content": unique()}], max_tokens=8
    )
    assert r.id
    choice = r.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    details = r.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert "created_cache_tokens" in details.model_extra


def test_chat_streaming_with_usage(server):
    c = oai(server)
    stream = c.chat.completions.create(
        model=server.model(),
        messages=[{"role": "user", "content": unique()}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert isinstance(text, str)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens_details.cached_tokens is not None
    assert last.model_extra.get("metrics") is not None


def test_completions_non_streaming_and_streaming(server):
    c = oai(server)
    prompt = unique()
    r = c.completions.create(model=server.model(), prompt=prompt, max_tokens=6)
    assert isinstance(r.choices[0].text, str)
    assert r.usage.prompt_tokens == tokenize(server, prompt=prompt)
    chunks = list(
        c.completions.create(
            model=server.model(), prompt=unique(), max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1


def test_repeated_prompt_reports_cached_tokens_as_spec_predicts(server):
    """Spec §4: creation = floor(N/B)*B on the first request; cached = floor((N-1)/B)*B on the repeat."""
    c = oai(server)
    prompt = unique(60)
    n = tokenize(server, prompt=prompt)
    first = c.completions.create(model=server.model(), prompt=prompt, max_tokens=4)
    d1 = first.usage.prompt_tokens_details
    assert first.usage.prompt_tokens == n
    assert d1.cached_tokens == 0
    assert d1.model_extra["created_cache_tokens"] == floor_block(n)
    # OpenAI's name for the same number (spec section 7), a field of the SDK's type.
    assert d1.cache_write_tokens == floor_block(n)
    second = c.completions.create(model=server.model(), prompt=prompt, max_tokens=4)
    d2 = second.usage.prompt_tokens_details
    assert d2.cached_tokens == floor_block(n - 1)
    assert d2.model_extra["created_cache_tokens"] == 0
    assert d2.cache_write_tokens == 0


def test_repeated_chat_reports_cached_tokens(server):
    c = oai(server)
    messages = [{"role": "user", "content": unique(60)}]
    n = tokenize(server, messages=messages)
    first = c.chat.completions.create(model=server.model(), messages=messages, max_tokens=4)
    assert first.usage.prompt_tokens == n
    second = c.chat.completions.create(model=server.model(), messages=messages, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens == floor_block(n - 1)


def test_openai_errors(server):
    c = oai(server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=server.model(), messages=[{"role": "user", "content": "hi"}], n=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=server.model(), messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model=server.model(), messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    r = requests.post(
        f"{server.base_url}/v1/chat/completions",
        data="{not json",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


# --- Anthropic ------------------------------------------------------------------------------


def test_anthropic_non_streaming_usage_adds_up(server):
    a = anth(server)
    system = "You are terse."
    content = unique(40)
    n = tokenize(server, messages=[{"role": "system", "content": system}, {"role": "user", "content": content}])
    for _ in range(2):
        m = a.messages.create(
            model=server.model(),
            max_tokens=8,
            system=system,
            messages=[{"role": "user", "content": [{"type": "text", "text": content, "cache_control": {"type": "ephemeral"}}]}],
        )
        u = m.usage
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == n
        assert m.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
        assert m.content and m.content[0].type == "text"
    assert u.cache_read_input_tokens == floor_block(n - 1)


def test_anthropic_streaming_event_sequence(server):
    a = anth(server)
    content = unique(20)
    with a.messages.stream(
        model=server.model(), max_tokens=8, messages=[{"role": "user", "content": content}]
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [e for e in events if e in {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"}]
    assert raw[0] == "message_start"
    assert raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    n = tokenize(server, messages=[{"role": "user", "content": content}])
    u = final.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == n
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_errors(server):
    a = anth(server)
    with pytest.raises(anthropic.NotFoundError):
        a.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = requests.post(f"{server.base_url}/v1/messages", json={"model": server.model(), "messages": []}, timeout=10)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


# --- per-request metrics --------------------------------------------------------------------

PREFIX_FIELDS = {
    "prompt_tokens", "local_cached_tokens", "external_cached_tokens", "cached_tokens", "computed_tokens",
    "cache_creation_tokens", "prefill_chunks", "blocks_allocated", "blocks_filled", "blocks_evicted",
    "preemptions", "prefill_time_ms", "queue_time_ms",
}
TIMING_FIELDS = {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms", "tokens_per_second"}


def _chat_raw(server, **extra):
    body = {"model": server.model(), "messages": [{"role": "user", "content": unique()}], "max_tokens": 4, **extra}
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)


def test_per_request_metrics_only_with_flag(server, plain_server):
    with_flag = _chat_raw(server).json()
    assert TIMING_FIELDS <= set(with_flag["metrics"])
    assert PREFIX_FIELDS <= set(with_flag["metrics"]["prefix_cache"])
    assert with_flag["metrics"]["prefix_cache"]["cached_tokens"] == with_flag["usage"]["prompt_tokens_details"]["cached_tokens"]
    without = _chat_raw(plain_server).json()
    assert "metrics" not in without
    assert without["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    m = requests.post(
        f"{server.base_url}/v1/messages",
        json={"model": server.model(), "max_tokens": 4, "messages": [{"role": "user", "content": unique()}]},
        timeout=60,
    ).json()
    assert PREFIX_FIELDS <= set(m["metrics"]["prefix_cache"])


# --- /metrics -------------------------------------------------------------------------------


def test_metrics_exposition_and_promtool(server):
    _chat_raw(server)
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    for name in [
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc", "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
        "vllm:prompt_tokens_by_source_total", "cachet:cache_creation_tokens_total",
    ]:
        assert name in text, name
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`): exposition not linted")
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    # Exit 1 is a parse error. Exit 3 lists lint problems: the only ones allowed are those that
    # vLLM's own names carry (the spec mandates them for dashboard compatibility): the `vllm:` /
    # `cachet:` colon prefix, and the histogram named `vllm:iteration_tokens_total`.
    problems = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    allowed = [
        p for p in problems
        if p.endswith("metric names should not contain ':'")
        or p == 'vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix'
    ]
    assert res.returncode in (0, 3), res.stdout + res.stderr
    assert problems == allowed, "unexpected promtool problems:\n" + "\n".join(set(problems) - set(allowed))


# --- auth -----------------------------------------------------------------------------------


def test_api_key(auth_server):
    base = auth_server.base_url
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    assert requests.get(f"{base}/metrics", timeout=10).status_code == 200
    r = requests.get(f"{base}/v1/models", timeout=10)
    assert r.status_code == 401 and "error" in r.json()
    r = requests.post(f"{base}/v1/messages", json={}, headers={"x-api-key": "wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    c = oai(auth_server)
    r = c.chat.completions.create(model=auth_server.model(), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices
    m = anth(auth_server).messages.create(model=auth_server.model(), max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert m.content is not None
    bad = openai.OpenAI(api_key="wrong", base_url=f"{base}/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert API_KEY == auth_server.api_key


# --- real model -----------------------------------------------------------------------------


@pytest.mark.skipif(os.environ.get("CACHET_E2E_REAL_MODEL") != "1", reason="set CACHET_E2E_REAL_MODEL=1 (and CACHET_E2E_MODEL_ARGS)")
def test_real_model_smoke():
    model_args = shlex.split(os.environ.get("CACHET_E2E_MODEL_ARGS", ""))
    s = start_server(["--enable-per-request-metrics"], executor_args=model_args)
    try:
        c = oai(s)
        messages = [{"role": "user", "content": "Write one sentence about the sea. " * 4}]
        r1 = c.chat.completions.create(model=s.model(), messages=messages, max_tokens=24, temperature=0)
        assert r1.choices[0].message.content.strip()
        r2 = c.chat.completions.create(model=s.model(), messages=messages, max_tokens=24, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens > 0
        assert json.loads(r2.model_dump_json())["usage"]["prompt_tokens"] == r1.usage.prompt_tokens
    finally:
        s.stop()


# --- lifecycle: disconnects, request ids, SIGTERM ------------------------------------------

SLOW = ["--sim-decode-us-per-seq", "3000"]


def _metric(server, name: str, **labels) -> float:
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def _wait(pred, what: str, timeout: float = 20.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_client_disconnect_aborts_and_frees_blocks():
    s = start_server(["--log-stats-interval", "0.5"], executor_args=["--executor", "sim", "--block-size", str(BLOCK_SIZE), *SLOW])
    try:
        body = {"model": s.model(), "max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": unique()}]}
        with requests.post(f"{s.base_url}/v1/chat/completions", json=body, stream=True, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        _wait(lambda: _metric(s, "vllm:request_success_total", finished_reason="abort") == 1.0, "the abort")
        _wait(lambda: _metric(s, "vllm:num_requests_running") == 0 and _metric(s, "vllm:kv_cache_usage_perc") == 0, "free blocks")
        assert _metric(s, "vllm:prefix_cache_queries_total") > 0
    finally:
        s.stop()


def test_request_id_header_round_trip(server):
    rid = "e2e-" + uuid.uuid4().hex
    r = requests.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": server.model(), "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Request-Id": rid},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == rid
    assert r.json()["id"] == rid
    r = requests.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")


def test_stop_sequences_via_sdks(server):
    c = oai(server)
    prompt = unique()
    full = c.completions.create(model=server.model(), prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[8:11]
    cut = c.completions.create(model=server.model(), prompt=prompt, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=server.model(), prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True}
        )
        if ch.choices
    )
    assert streamed == text[: text.index(stop)]


def test_sigterm_drains_running_requests():
    import signal
    import threading

    s = start_server([], executor_args=["--executor", "sim", "--block-size", str(BLOCK_SIZE), *SLOW])
    try:
        body = {"model": s.model(), "prompt": unique(), "max_tokens": 60, "stream": True, "ignore_eos": True}
        got: list[str] = []
        with requests.post(f"{s.base_url}/v1/completions", json=body, stream=True, timeout=60) as r:
            lines = r.iter_lines(decode_unicode=True)
            got.append(next(lines))
            threading.Timer(0.05, lambda: s.proc.send_signal(signal.SIGTERM)).start()
            got.extend(line for line in lines)
        data = [line for line in got if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=30) == 0
    finally:
        s.stop()


def test_tokenize_detokenize_round_trip(server):
    r = requests.post(f"{server.base_url}/tokenize", json={"prompt": "round trip", "add_special_tokens": False}, timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    r = requests.post(f"{server.base_url}/detokenize", json={"tokens": body["tokens"]}, timeout=10)
    assert r.status_code == 200 and r.json()["prompt"] == "round trip"
    # A completions prompt given as token ids reports exactly that many prompt tokens.
    c = oai(server).completions.create(model=server.model(), prompt=body["tokens"], max_tokens=2)
    assert c.usage.prompt_tokens == body["count"]
