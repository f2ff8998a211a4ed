"""Hostile clients against the real binary (`cachet serve --executor sim`, issue 17).

One server for the module, started as an operator would harden it: an API key, a small waiting
queue, a small body limit and short header/body timeouts. The tests run in file order:

1. the input matrix: every route with malformed, truncated, wrong-typed, deeply nested,
   invalid-UTF-8, oversized, wrongly typed and out-of-range input, each with its expected
   status and the error shape of the route's API;
2. slow-header clients (slowloris), slow-body and stalled-body clients, a body declared but
   never sent;
3. a burst past the queue (503 with Retry-After, in the route's shape);
4. a disconnect storm: connections that close before sending a request, halfway through one,
   after the request was accepted but before the first response byte, mid-prefill and
   mid-decode;
5. the idle checks: nothing running or waiting, no KV held, every counter only grew, prefix
   hits never above queries, finished requests equal to the accepted ones by finish reason,
   prompt-token sources summing to the prompt tokens, and the process alive with flat memory
   and file descriptors.

Everything is on loopback and bounded (about 30 s on a 2-core machine).
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import threading
import time

import pytest
import requests

from conftest import start_server

KEY = "hostile-key"
MAX_BODY = 64 * 1024
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
MAX_NUM_SEQS = 8
MAX_WAITING = 16
# Prefill 400 us per token, decode 1 ms per sequence and step.
PREFILL_US = 400
DECODE_US = 1000

ARGS = [
    "--max-waiting-requests", str(MAX_WAITING),
    "--max-num-seqs", str(MAX_NUM_SEQS),
    "--num-kv-blocks", "1024",
    "--max-model-len", "4096",
    "--max-body-bytes", str(MAX_BODY),
    "--header-read-timeout", str(HEADER_TIMEOUT_S),
    "--body-read-timeout", str(BODY_TIMEOUT_S),
    "--sim-prefill-us-per-token", str(PREFILL_US),
    "--sim-decode-us-per-seq", str(DECODE_US),
    "--log-stats-interval", "0",
]

AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv():
    s = start_server(ARGS, api_key=KEY)
    yield s
    s.stop()


# --- helpers --------------------------------------------------------------------------------


def scrape(srv) -> dict[tuple[str, tuple], float]:
    text = requests.get(f"{srv.base_url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', rest)))
        out[(name, labels)] = float(value)
    return out


def total(m, name: str, **labels) -> float:
    return sum(
        v for (n, l), v in m.items() if n == name and all((k, lv) in l for k, lv in labels.items())
    )


def monotonic(m) -> dict:
    return {k: v for k, v in m.items() if k[0].endswith(("_total", "_count", "_bucket", "_sum"))}


def wait_idle(srv, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(srv)
        if total(m, "vllm:num_requests_running") == 0 and total(m, "vllm:num_requests_waiting") == 0:
            return m
        assert time.monotonic() < deadline, "requests still running or waiting"
        time.sleep(0.05)


def raw(srv, data: bytes, timeout: float = 10.0) -> tuple[int, dict | str, float]:
    """Sends `data` on a fresh connection; returns (status, JSON body or text, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(data)
        status, body = read_response(s)
    return status, body, time.monotonic() - t0


def read_response(s: socket.socket) -> tuple[int, dict | str]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    if "content-length" in hdrs:
        n = int(hdrs["content-length"])
        while len(body) < n:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    elif hdrs.get("transfer-encoding") == "chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        out, rest = b"", body
        while rest:
            size_s, _, rest = rest.partition(b"\r\n")
            size = int(size_s, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("utf-8", "replace")


def post_bytes(path: str, body: bytes, content_type: str | None = "application/json", key: str | None = KEY, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    return (head + extra + "\r\n").encode() + body


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def check_shape(path: str, status: int, body) -> None:
    assert isinstance(body, dict), f"{path} {status}: not JSON: {body!r}"
    if is_anthropic(path):
        assert body.get("type") == "error", f"{path} {status}: {body}"
        assert set(body["error"]) >= {"type", "message"}, body
        assert "code" not in body["error"], body
    else:
        assert "type" not in body, f"{path} {status}: {body}"
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert len(json.dumps(body)) < 2048, f"{path}: an unbounded error body"


# --- 1. the input matrix -------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPL = {"prompt": "hi", "max_tokens": 2}
GEN_ROUTES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPL,
    "/v1/messages": CHAT,
}


def with_(base: dict, **kw) -> bytes:
    d = dict(base)
    d.update(kw)
    return json.dumps(d).encode()


def matrix() -> list[tuple[str, str, bytes, dict, int]]:
    """(name, path, body, options, expected status)."""
    cases = []
    nested = b"[" * 10_000 + b"]" * 10_000
    for path, base in GEN_ROUTES.items():
        good = json.dumps(base).encode()
        cases += [
            ("valid", path, good, {}, 200),
            ("malformed", path, b'{"messages": [', {}, 400),
            ("truncated", path, good[: len(good) // 2], {}, 400),
            ("not an object", path, b"[1, 2]", {}, 400),
            ("empty", path, b"", {}, 400),
            ("invalid utf-8", path, b'{"prompt": "\xff\xfe", "messages": "\xc3\x28"}', {}, 400),
            ("deeply nested", path, b'{"messages": ' + nested + b', "prompt": ' + nested + b"}", {}, 400),
            ("wrong types", path, with_(base, max_tokens="lots", stream=[1]), {}, 400),
            ("null fields", path, with_(base, messages=None, prompt=None), {}, 400),
            ("negative max_tokens", path, with_(base, max_tokens=-1), {}, 400),
            ("zero max_tokens", path, with_(base, max_tokens=0), {}, 400),
            ("huge max_tokens", path, with_(base, max_tokens=2**40), {}, 400),
            ("unknown model", path, with_(base, model="no-such-model"), {}, 404),
            ("100 KB model name", path, with_(base, model="m" * 60_000), {}, 404),
            ("temperature NaN-like", path, with_(base, temperature=1e39), {}, 400),
            ("temperature above the API's", path, with_(base, temperature=2.5 if not is_anthropic(path) else 1.5), {}, 400),
            ("bad session id", path, with_(base, session_id="../../etc/passwd"), {}, 400),
            ("session id with CRLF", path, with_(base, session_id="a\r\nb"), {}, 400),
            ("bad cache_salt", path, with_(base, cache_salt=""), {}, 400),
            ("text/plain", path, good, {"content_type": "text/plain"}, 415),
            ("form", path, good, {"content_type": "application/x-www-form-urlencoded"}, 415),
            ("no content type", path, good, {"content_type": None}, 415),
            ("no key", path, good, {"key": None}, 401),
            ("wrong key", path, good, {"key": "wrong"}, 401),
            ("body over the limit", path, b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}', {}, 413),
            ("foreign origin", path, good, {"extra": "Origin: http://evil.test\r\n"}, 403),
        ]
    for path in ("/v1/chat/completions", "/v1/messages"):
        base = GEN_ROUTES[path]
        cases += [
            ("unknown role", path, with_(base, messages=[{"role": "wizard", "content": "x"}]), {}, 400),
            ("content part of another type", path, with_(base, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), {}, 400),
            ("no messages", path, with_(base, messages=[]), {}, 400),
        ]
    stops = {"/v1/chat/completions": "stop", "/v1/completions": "stop", "/v1/messages": "stop_sequences"}
    for path, field in stops.items():
        base = GEN_ROUTES[path]
        cases += [
            ("10,000 stop strings", path, with_(base, **{field: ["s"] * 10_000}), {}, 400),
            ("a 600-byte stop string", path, with_(base, **{field: ["y" * 600]}), {}, 400),
            ("stop strings within limits", path, with_(base, **{field: [f"s{i}" for i in range(64)]}), {}, 200),
        ]
    cases += [
        ("metadata as a string", "/v1/messages", with_(CHAT, metadata="user-1"), {}, 400),
        ("metadata object", "/v1/messages", with_(CHAT, metadata={"user_id": "u"}), {}, 200),
        ("system role in messages", "/v1/messages", with_(CHAT, messages=[{"role": "system", "content": "x"}]), {}, 400),
        ("tokenize valid", "/tokenize", b'{"prompt": "hi"}', {}, 200),
        ("tokenize malformed", "/tokenize", b'{"prompt": ', {}, 400),
        ("tokenize both", "/tokenize", b'{"prompt": "a", "messages": []}', {}, 400),
        ("tokenize text/plain", "/tokenize", b'{"prompt": "hi"}', {"content_type": "text/plain"}, 415),
        ("detokenize valid", "/detokenize", b'{"tokens": [104, 105]}', {}, 200),
        ("detokenize negative id", "/detokenize", b'{"tokens": [-1]}', {}, 400),
        ("detokenize id outside the vocabulary", "/detokenize", b'{"tokens": [4294967295]}', {}, 400),
        ("unknown path", "/v1/nope", b"{}", {}, 404),
        ("unknown Anthropic path", "/v1/messages/no_such_route", b"{}", {}, 404),
        ("reset without key", "/reset_prefix_cache", b"", {"key": None, "content_type": None}, 401),
    ]
    return cases


def test_input_matrix(srv):
    srv.before = scrape(srv)
    failures = []
    for name, path, body, opts, want in matrix():
        status, got, _ = raw(srv, post_bytes(path, body, content_type=opts.get("content_type", "application/json"), key=opts.get("key", KEY), extra=opts.get("extra", "")))
        if status != want:
            failures.append(f"{path} [{name}]: {status}, want {want}: {str(got)[:200]}")
            continue
        if status >= 400:
            try:
                check_shape(path, status, got)
            except AssertionError as e:
                failures.append(f"{path} [{name}]: {e}")
    # Methods and paths.
    for method, path, want in [
        ("GET", "/v1/messages", 405),
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/v1/completions", 405),
        ("POST", "/v1/models", 405),
        ("DELETE", "/v1/messages", 405),
        ("GET", "/v1/messages/batches", 404),
        ("HACK", "/v1/models", 405),
        ("DELETE", "/v1/sessions/..%2F..%2Fetc%2Fpasswd", 400),
        ("DELETE", "/v1/sessions/a%00b", 400),
        ("DELETE", "/v1/sessions/a%0D%0Ab", 400),
        ("DELETE", "/v1/sessions/%FF", 400),
        ("DELETE", "/v1/sessions/" + "s" * 129, 400),
        ("DELETE", "/v1/sessions/ok-session.1", 204),
    ]:
        r = requests.request(method, srv.base_url + path, headers=AUTH, timeout=10)
        if r.status_code != want:
            failures.append(f"{method} {path}: {r.status_code}, want {want}: {r.text[:200]}")
        elif want >= 400:
            try:
                check_shape(path, want, r.json())
            except (AssertionError, ValueError) as e:
                failures.append(f"{method} {path}: {e}")
    # A preflight from a page is refused; no CORS header is ever sent.
    r = requests.options(
        f"{srv.base_url}/v1/chat/completions",
        headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"},
        timeout=10,
    )
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = requests.get(f"{srv.base_url}/v1/models", headers={**AUTH, "Origin": "http://evil.test"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert not failures, "\n".join(failures)
    # The 200 cases of the matrix were accepted and finished normally.
    srv.accepted = sum(1 for c in matrix() if c[4] == 200 and c[1] in GEN_ROUTES)
    srv.completed = srv.accepted
    srv.aborted = 0
    assert requests.get(f"{srv.base_url}/health", timeout=10).status_code == 200


# --- 2. slow clients -----------------------------------------------------------------------


def open_fds(srv) -> float:
    return total(scrape(srv), "process_open_fds")


def test_slow_headers_are_cut_off(srv):
    fds_before = open_fds(srv)
    socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(24)]
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    stop = threading.Event()

    def trickle():
        for b in request:
            if stop.is_set():
                return
            for s in socks:
                try:
                    s.send(bytes([b]))
                except OSError:
                    pass
            time.sleep(0.1)

    t = threading.Thread(target=trickle)
    t.start()
    # Meanwhile the server answers at once.
    t0 = time.monotonic()
    assert requests.get(f"{srv.base_url}/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0
    time.sleep(HEADER_TIMEOUT_S + 1.0)
    closed = 0
    for s in socks:
        s.settimeout(2.0)
        try:
            closed += s.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        except socket.timeout:
            pass
    stop.set()
    t.join()
    for s in socks:
        s.close()
    assert closed == len(socks), f"only {closed} of {len(socks)} slow-header connections were closed"
    # Their descriptors are released.
    deadline = time.monotonic() + 5
    while open_fds(srv) > fds_before + 2:
        assert time.monotonic() < deadline, f"fds {open_fds(srv)} vs {fds_before} before"
        time.sleep(0.1)


def test_slow_and_stalled_bodies_are_408(srv):
    body = json.dumps({"prompt": "x" * 300, "max_tokens": 1}).encode()
    for path, trickle in [("/v1/completions", True), ("/v1/messages", False)]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(head.encode())
            t0 = time.monotonic()
            stop = threading.Event()

            def send_slowly():
                # A byte every 100 ms: 33 s for the whole body.
                for b in body:
                    if stop.is_set():
                        return
                    try:
                        s.send(bytes([b]))
                    except OSError:
                        return
                    time.sleep(0.1)

            writer = threading.Thread(target=send_slowly)
            if trickle:
                writer.start()
            else:
                s.sendall(body[: len(body) // 2])
            status, resp = read_response(s)
            elapsed = time.monotonic() - t0
            stop.set()
            if trickle:
                writer.join()
        assert status == 408, f"{path}: {status} {resp}"
        check_shape(path, status, resp)
        assert BODY_TIMEOUT_S - 0.2 <= elapsed < BODY_TIMEOUT_S + 2, f"{path}: {elapsed:.2f} s"


def test_a_declared_body_never_sent_is_413_at_once(srv):
    for path in ["/v1/chat/completions", "/v1/messages"]:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n"
        status, body, secs = raw(srv, head.encode())
        assert status == 413, body
        check_shape(path, status, body)
        assert secs < 1.0, f"{path}: {secs:.2f} s"


# --- 3. a burst past the queue ------------------------------------------------------------


def stream_request(srv, path: str, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    s.sendall(post_bytes(path, json.dumps(body).encode()))
    return s


def test_burst_past_the_queue_is_503(srv):
    n = 60
    statuses: list[int] = [0] * n
    bodies: list = [None] * n
    headers: list[str] = [""] * n

    def one(i: int):
        path = "/v1/completions" if i % 2 else "/v1/messages"
        body = {"prompt": f"burst {i}", "max_tokens": 60, "ignore_eos": True} if i % 2 else {
            "messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 60}
        r = requests.post(srv.base_url + path, json=body, headers=AUTH, timeout=60)
        statuses[i] = r.status_code
        headers[i] = r.headers.get("retry-after", "")
        try:
            bodies[i] = r.json()
        except ValueError:
            bodies[i] = r.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = statuses.count(200)
    refused = statuses.count(503)
    assert ok + refused == n, statuses
    # The engine holds at most MAX_NUM_SEQS running + MAX_WAITING waiting (more are accepted
    # only if earlier ones finished before the last arrived).
    assert refused >= 10, statuses
    assert ok >= MAX_NUM_SEQS, statuses
    for i in range(n):
        if statuses[i] == 503:
            path = "/v1/completions" if i % 2 else "/v1/messages"
            assert headers[i] == "1"
            check_shape(path, 503, bodies[i])
    srv.accepted += ok
    srv.completed += ok
    wait_idle(srv)


# --- 4. a disconnect storm -----------------------------------------------------------------


def test_disconnect_storm(srv):
    before = wait_idle(srv)
    # (a) Connections that close before sending anything, or halfway through a request: never
    # requests at all.
    for i in range(20):
        s = socket.create_connection(("127.0.0.1", srv.port))
        if i % 2:
            s.sendall(post_bytes("/v1/completions", json.dumps(COMPL).encode())[:40])
        s.close()
    # (b) Accepted, then gone before the first response byte: non-streaming requests, dropped
    # once the engine holds all of them (running or waiting).
    n_b = 12
    socks = [
        stream_request(srv, "/v1/completions", {"prompt": f"quiet {i} " + "p" * 200, "max_tokens": 300, "ignore_eos": True})
        for i in range(n_b)
    ]
    deadline = time.monotonic() + 10
    while True:
        m = scrape(srv)
        live = total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting")
        if live >= n_b:
            break
        assert time.monotonic() < deadline, f"only {live} of {n_b} requests reached the engine"
        time.sleep(0.02)
    for s in socks:
        s.close()
    # (c) Mid-prefill: a 1,500-token prompt takes 0.6 s to prefill; the stream's headers come at
    # admission, its first token after prefill. Gone in between.
    n_c = 6
    socks = []
    for i in range(n_c):
        s = stream_request(srv, "/v1/completions", {"prompt": f"long {i} " + "q" * 1500, "max_tokens": 50, "stream": True})
        socks.append(s)
    for s in socks:
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"data:" not in head.partition(b"\r\n\r\n")[2], "the first token came before the disconnect"
        s.close()
    # (d) Mid-decode: read a few tokens of each stream, then vanish.
    n_d = 12
    socks = []
    for i in range(n_d):
        path = "/v1/chat/completions" if i % 2 else "/v1/messages"
        body = {"messages": [{"role": "user", "content": f"decode {i}"}], "max_tokens": 400, "stream": True}
        if i % 2:
            body["ignore_eos"] = True
        socks.append(stream_request(srv, path, body))
    # Twelve streams for eight slots: four wait until others end, and which four depends on the
    # order the server took them in, not the order they were sent. So each is read as its bytes
    # come (a stream read in send order could be a waiting one, while the running ones ran to
    # their end unread: the flake this replaced).
    sel = selectors.DefaultSelector()
    got = {}
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    deadline = time.monotonic() + 30
    while got:
        assert time.monotonic() < deadline, f"{len(got)} streams sent no 4 events in 30 s"
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            chunk = s.recv(4096)
            assert chunk, got[s]
            got[s] += chunk
            if got[s].count(b"data:") >= 4:
                assert got[s].startswith(b"HTTP/1.1 200"), got[s][:100]
                sel.unregister(s)
                del got[s]
                s.close()
    sel.close()
    after = wait_idle(srv)
    aborted = total(after, "vllm:request_success_total", finished_reason="abort") - total(
        before, "vllm:request_success_total", finished_reason="abort"
    )
    by_reason = {
        r: total(after, "vllm:request_success_total", finished_reason=r) - total(before, "vllm:request_success_total", finished_reason=r)
        for r in ("stop", "length", "abort", "error")
    }
    assert aborted == n_b + n_c + n_d, f"{aborted} aborts for {n_b + n_c + n_d} vanished clients: {by_reason}"
    srv.accepted += n_b + n_c + n_d
    srv.aborted += n_b + n_c + n_d
    # The server still serves.
    r = requests.post(f"{srv.base_url}/v1/completions", json=COMPL, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    srv.accepted += 1
    srv.completed += 1


# --- 5. idle checks ------------------------------------------------------------------------


def test_idle_checks(srv):
    m = wait_idle(srv)
    before = srv.before
    assert srv.proc.poll() is None, "the server died"
    assert requests.get(f"{srv.base_url}/health", timeout=10).status_code == 200
    # No KV held by anyone.
    assert total(m, "vllm:kv_cache_usage_perc") == 0.0
    assert total(m, "cachet:parked_sessions") == 0
    # Every counter only grew.
    grew_back = [k for k, v in monotonic(before).items() if m.get(k, 0.0) < v]
    assert not grew_back, f"counters that went down: {grew_back}"
    # Prefix-cache hits never above queries.
    for name in ("vllm:prefix_cache", "vllm:external_prefix_cache", "cachet:preempted_prefix_cache"):
        assert total(m, f"{name}_hits_total") <= total(m, f"{name}_queries_total"), name
    # Finished requests = accepted requests, by finish reason.
    d = lambda name, **kw: total(m, name, **kw) - total(before, name, **kw)  # noqa: E731
    finished = d("vllm:request_success_total")
    assert finished == srv.accepted, f"{finished} finished, {srv.accepted} accepted"
    assert d("vllm:request_success_total", finished_reason="abort") == srv.aborted
    assert d("vllm:request_success_total", finished_reason="error") == 0
    normal = d("vllm:request_success_total", finished_reason="length") + d(
        "vllm:request_success_total", finished_reason="stop"
    )
    assert normal == srv.completed
    # Prompt-token sources sum to the prompt tokens; cached sources to the cached tokens.
    prompt = total(m, "vllm:prompt_tokens_total")
    assert prompt > 0
    assert total(m, "vllm:prompt_tokens_by_source_total") == prompt
    assert total(m, "vllm:prompt_tokens_cached_by_source_total") == total(m, "vllm:prompt_tokens_cached_total")
    assert total(m, "vllm:prompt_tokens_cached_total") == total(
        m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
    ) + total(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    # Flat memory and descriptors: what the storm left compared with the start of the module.
    rss0, rss1 = total(before, "process_resident_memory_bytes"), total(m, "process_resident_memory_bytes")
    fds0, fds1 = total(before, "process_open_fds"), total(m, "process_open_fds")
    assert fds1 <= fds0 + 2, f"open fds {fds0} -> {fds1}"
    assert rss1 <= rss0 + 64 * 2**20, f"RSS {rss0 / 2**20:.0f} MiB -> {rss1 / 2**20:.0f} MiB"
    print(f"\nhostile idle checks: {srv.accepted} accepted ({srv.aborted} aborted), RSS "
          f"{rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, fds {fds0:.0f} -> {fds1:.0f}")
