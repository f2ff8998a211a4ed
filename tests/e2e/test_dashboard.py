"""The live dashboard (`GET /dashboard`, issue 15 item 6) in headless Chromium.

A real `cachet serve --executor sim` behind an API key serves the page from the binary. Its data
comes from `/v1/cache/stats/stream`, `/v1/cache` and `/v1/cache/requests/{id}`: from the same
server when it answers `GET /v1/cache`; otherwise (those routes not built yet, or
CACHET_DASHBOARD_DATA=fake) from a small fake server in this file that serves the contract's
shapes, proxies `/dashboard*` to the real binary, and runs a toy block cache over the traffic it
gets. CACHET_DASHBOARD_DATA=real requires the real routes (see DATA below).

Either way the test drives traffic over HTTP and checks what the page shows against numbers
derived by hand from that traffic (block size 16):
  request A: tokens 100..163 (64 tokens), empty cache: 0 cached, 64 computed, 64 written to new
             cache entries (4 full blocks); its misses are 64 `never_cached`.
  request B: the same 64 tokens: 4 blocks found, capped at floor(63/16)*16 = 48 tokens (the last
             token must be computed); 16 computed, 0 cache creation (block 3's hash exists);
             its misses are 16 `capped_for_logits`; its lifecycle has 3 `hit` blocks.
  totals:    prompt tokens 128, queried 128, hit 48 -> hit rate 37.5 %; 2x/4x what-if the same
             (nothing evicted); no divergence.
  request C: A with a nonce at position 37: 32 cached, diverged_at 37 (A's block 2 is the cached
             sibling), 32 computed and written to new entries.
  KV events: 4 blocks stored, all by A (B's block 3 was already an entry), none removed. The page
             reads `/v1/cache/events` from the real binary in both modes (the fake proxies that
             stream and sends each request to the binary as well).

Browsers: Debian's chromium through Playwright (scripts/test-deps-browser.sh installs both; a
fresh --user-data-dir per test). With CACHET_DASHBOARD_SCREENSHOT=PATH the screenshot test
drives a mixed workload and writes the README's picture (docs/dashboard.png) to PATH.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import http.server
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import requests

from conftest import BLOCK_SIZE, start_server

try:
    import playwright.sync_api as pw
except ImportError:
    pw = None

CHROMIUM = os.environ.get("CACHET_CHROMIUM", "/usr/bin/chromium")
KEY = "dash-e2e-key-5c1f"
# A tenant's (named) key: the cache routes answer it 403 (the fake as the real server does).
TENANT_KEY = "dash-e2e-tenant-key"
PROMPT = list(range(100, 164))  # the simulated executor's vocabulary is 259 tokens
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 15000
# Where the page's data comes from: "real" (the binary's /v1/cache routes, required), "fake" (the
# stand-in below) or "auto" (real when `GET /v1/cache` answers 200, else fake). Once those routes
# have landed, the default becomes "real" (this one line), so that a broken route fails the test
# instead of falling back to the stand-in.
DATA = os.environ.get("CACHET_DASHBOARD_DATA", "real")
assert DATA in ("auto", "real", "fake"), DATA

# What the browser tests lack, if anything. `make test` sets CACHET_E2E_REQUIRE_BROWSER=1: there
# a missing browser or driver fails those tests instead of skipping them.
REQUIRE_BROWSER = os.environ.get("CACHET_E2E_REQUIRE_BROWSER") == "1"
if pw is None:
    BROWSER_MISSING = "the playwright package is missing: run scripts/test-deps-browser.sh"
elif not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
    BROWSER_MISSING = f"{CHROMIUM} is missing: run scripts/test-deps-browser.sh"
else:
    BROWSER_MISSING = None


# ---------------------------------------------------------------------------------------------
# The fake data server (until the real routes answer).


class ToyCache:
    """A block cache in the contract's terms, enough for the shapes and the numbers above."""

    def __init__(self, num_blocks: int = 64, shadow: int = 256):
        self.lock = threading.Lock()
        self.num_blocks = num_blocks
        self.cached: collections.OrderedDict[str, dict] = collections.OrderedDict()  # LRU
        self.shadow: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.shadow_cap = shadow
        self.children: dict[str, list[tuple[str, list[int]]]] = {}
        self.c = collections.Counter()
        self.miss = collections.Counter(
            {k: 0 for k in ["capped_for_logits", "partial_block", "evicted", "never_cached", "lookup_skipped", "load_failed"]}
        )
        self.shadow_hits = {"2x": 0, "4x": 0}
        self.diverged = {"requests": 0, "within_64": 0}
        self.tenants: dict[str, collections.Counter] = {}
        self.recent: collections.deque = collections.deque(maxlen=20)
        self.lifecycle: dict[str, dict] = {}
        self.started = time.time()

    @staticmethod
    def block_hash(parent: str, toks: list[int], salt: str | None) -> str:
        return hashlib.sha256(json.dumps([parent, toks, salt]).encode()).hexdigest()

    def run(self, rid: str, toks: list[int], salt: str | None, tenant: str) -> dict:
        with self.lock:
            return self._run(rid, toks, salt, tenant)

    def _run(self, rid, toks, salt, tenant):
        n, b = len(toks), BLOCK_SIZE
        full = n // b
        hashes, parent = [], "seed"
        for i in range(full):
            parent = self.block_hash(parent, toks[i * b : (i + 1) * b], salt)
            hashes.append(parent)
        found = 0
        while found < full and hashes[found] in self.cached:
            found += 1
        cap = (n - 1) // b
        hit_blocks = min(found, cap)
        cached = hit_blocks * b
        computed = n - cached
        # What-if: an LRU pool k times larger holds what this one holds plus the (k-1) * num_blocks
        # most recently evicted hashes; its hit is the run of leading blocks found there.
        rank = {h: i for i, h in enumerate(reversed(self.shadow))}  # 0: evicted last

        def reach(extra: int) -> int:
            k = 0
            while k < cap and k < full and (hashes[k] in self.cached or rank.get(hashes[k], extra) < extra):
                k += 1
            return k

        self.shadow_hits["2x"] += (reach(self.num_blocks) - hit_blocks) * b
        self.shadow_hits["4x"] += (reach(3 * self.num_blocks) - hit_blocks) * b
        blocks, evicted_now, created = [], 0, 0
        for i in range(hit_blocks):
            e = self.cached[hashes[i]]
            e["hits"] += 1
            e["last_hit"] = time.time()
            self.cached.move_to_end(hashes[i])
            blocks.append({"index": i, "hash": hashes[i], "event": "hit", "owner": None})
        # Divergence: the first uncached block's most recent sibling under the same parent.
        diverged_at = None
        if hit_blocks < full and found == hit_blocks:
            par = hashes[hit_blocks - 1] if hit_blocks else "seed"
            mine = toks[hit_blocks * b : (hit_blocks + 1) * b]
            sibs = [t for h, t in self.children.get(par + str(salt), []) if h in self.cached and t != mine]
            if sibs:
                other = sibs[-1]
                k = next(j for j in range(b) if other[j] != mine[j])
                diverged_at = hit_blocks * b + k
                self.diverged["requests"] += 1
                self.diverged["within_64"] += diverged_at < 64
        # Misses, one reason per computed token.
        reasons = collections.Counter()
        for i in range(hit_blocks, full):
            if i < found:
                reasons["capped_for_logits"] += b
            elif hashes[i] in self.shadow:
                reasons["evicted"] += b
            else:
                reasons["never_cached"] += b
        reasons["partial_block"] += n - full * b
        self.miss.update(reasons)
        # Allocate and fill the rest.
        for i in range(hit_blocks, (n + b - 1) // b):
            blocks.append({"index": i, "hash": None, "event": "allocated", "owner": None})
            while len(self.cached) >= self.num_blocks:
                old, e = self.cached.popitem(last=False)
                self.shadow[old] = None
                if len(self.shadow) > self.shadow_cap:
                    self.shadow.popitem(last=False)
                evicted_now += 1
                blocks.append({"index": i, "hash": old, "event": "evicted", "owner": e["created_by"]})
            if i < full:
                h = hashes[i]
                blocks.append({"index": i, "hash": h, "event": "filled", "new_entry": h not in self.cached, "owner": None})
                if h not in self.cached:
                    self.cached[h] = {"depth": i, "parent": hashes[i - 1] if i else None, "hits": 0,
                                      "created": time.time(), "last_hit": None, "created_by": rid}
                    par = hashes[i - 1] if i else "seed"
                    self.children.setdefault(par + str(salt), []).append((h, toks[i * b : (i + 1) * b]))
                    created += b
                    self.shadow.pop(h, None)
        self.c["prefix_cache_queries"] += n
        self.c["prefix_cache_hits"] += cached
        self.c["prompt_tokens"] += n
        self.c["prompt_tokens_local_compute"] += computed
        self.c["prompt_tokens_local_cache_hit"] += cached
        self.c["cache_creation_tokens"] += created
        self.c["blocks_evicted"] += evicted_now
        t = self.tenants.setdefault(tenant, collections.Counter())
        t.update(queries=n, hits=cached, cached_tokens=cached)
        pc = {
            "prompt_tokens": n, "cached_tokens": cached, "local_cached_tokens": cached,
            "external_cached_tokens": 0, "computed_tokens": computed, "cache_creation_tokens": created,
            "blocks_evicted": evicted_now, "diverged_at": diverged_at, "miss_tokens": dict(reasons),
        }
        self.recent.appendleft({
            "request_id": rid, "prompt_tokens": n, "cached_tokens": cached, "computed_tokens": computed,
            "cache_creation_tokens": created, "diverged_at": diverged_at, "finish_reason": "length",
        })
        self.lifecycle[rid] = {"request_id": rid, "blocks": blocks, "prefix_cache": pc}
        return pc

    def snapshot(self) -> dict:
        with self.lock:
            q = self.c["prefix_cache_queries"]
            idle = len(self.cached)
            counters = {k: self.c[k] for k in [
                "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
                "external_prefix_cache_hits", "prompt_tokens", "prompt_tokens_local_compute",
                "prompt_tokens_local_cache_hit", "prompt_tokens_external_kv_transfer",
                "cache_creation_tokens", "blocks_evicted"]}
            hits = self.c["prefix_cache_hits"]
            return {
                "ts": time.time(),
                "counters": counters,
                "gauges": {
                    "num_requests_running": 0, "num_requests_waiting": 0, "num_blocks": self.num_blocks,
                    "blocks_in_use": 0, "blocks_cached_idle": idle, "blocks_free": self.num_blocks - idle,
                    "kv_cache_usage_perc": 0.0,
                },
                "miss_tokens": dict(self.miss),
                "whatif": {
                    "hit_rate": hits / q if q else 0.0,
                    "hit_rate_2x": (hits + self.shadow_hits["2x"]) / q if q else 0.0,
                    "hit_rate_4x": (hits + self.shadow_hits["4x"]) / q if q else 0.0,
                },
                "diverged": dict(self.diverged),
                "tenants": [{"tenant": k, "queries": v["queries"], "hits": v["hits"], "cached_tokens": v["cached_tokens"]}
                            for k, v in sorted(self.tenants.items())],
                "recent": list(self.recent),
            }

    def inspector(self) -> dict:
        with self.lock:
            now = time.time()
            # As the engine reports them: blocks found at least once, each the deepest of its run
            # (a block with a cached child found as often is reported as the child); depth from 0.
            hot = [e for h, e in self.cached.items() if e["hits"] > 0 and not any(
                c["parent"] == h and c["hits"] >= e["hits"] for c in self.cached.values())]
            hot = sorted(hot, key=lambda e: (-e["hits"], -e["depth"]))[:10]
            return {
                "pool": {"num_blocks": self.num_blocks, "blocks_in_use": 0, "blocks_cached_idle": len(self.cached),
                         "blocks_free": self.num_blocks - len(self.cached), "tokens_held": len(self.cached) * BLOCK_SIZE},
                "hottest": [{"depth": e["depth"], "tokens": (e["depth"] + 1) * BLOCK_SIZE, "hits": e["hits"],
                             "age_s": round(now - e["created"], 1),
                             "last_hit_s": None if e["last_hit"] is None else round(now - e["last_hit"], 1),
                             "created_by": e["created_by"]} for e in hot],
            }


class FakeServer:
    def __init__(self, upstream: str, key: str):
        self.cache = ToyCache()
        self.model = requests.get(upstream + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                                  timeout=10).json()["data"][0]["id"]
        self.paths: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.upstream_socks: list[socket.socket] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _json(self, code: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self) -> bool:
                given = self.headers.get("Authorization", "")
                if given == f"Bearer {key}":
                    return True
                if given == f"Bearer {TENANT_KEY}":
                    # What the real server answers a named (tenant) key on the cache routes.
                    self._json(403, {"error": {"message": "operator key needed", "type": "permission_error",
                                               "code": "operator_key_required"}})
                    return False
                self._json(401, {"error": {"message": "unauthorized", "type": "invalid_request_error"}})
                return False

            def do_GET(self):
                fake.paths.append(self.path)
                if self.path.startswith("/dashboard"):
                    return self._proxy()
                if not self._authorized():
                    return
                if self.path.split("?")[0] == "/v1/cache/events":
                    return self._proxy_stream()  # the real binary's stream (it exists)
                if self.path == "/v1/cache":
                    return self._json(200, fake.cache.inspector())
                if self.path.startswith("/v1/cache/requests/"):
                    rid = urllib.parse.unquote(self.path[len("/v1/cache/requests/"):])
                    life = fake.cache.lifecycle.get(rid)
                    return self._json(200, life) if life else self._json(404, {"error": {"message": "unknown"}})
                if self.path == "/v1/cache/stats/stream":
                    return self._stream()
                self._json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                fake.paths.append(self.path)
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                if self.path != "/v1/completions":
                    return self._json(404, {"error": {"message": "not found"}})
                prompt = body["prompt"]
                toks = prompt if isinstance(prompt, list) else list(prompt.encode())
                salt = body.get("cache_salt")
                tenant = "default" if salt is None else "salt-" + hashlib.sha256(salt.encode()).hexdigest()[:8]
                rid = self.headers.get("X-Request-Id") or f"cmpl-{len(fake.paths)}"
                pc = fake.cache.run(rid, toks, salt, tenant)
                # The same request to the real binary too, so its KV events follow the traffic.
                up = {**body, "model": fake.model}
                requests.post(upstream + "/v1/completions", json=up, timeout=30,
                              headers={"Authorization": f"Bearer {key}", "X-Request-Id": rid}).raise_for_status()
                self._json(200, {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": len(toks), "completion_tokens": 1},
                                 "metrics": {"prefix_cache": pc}})

            def _stream(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    while not fake.stop.is_set():
                        data = json.dumps(fake.cache.snapshot())
                        self.wfile.write(f"event: snapshot\ndata: {data}\n\n".encode())
                        self.wfile.flush()
                        fake.stop.wait(1.0)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def _proxy_stream(self):
                hdrs = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "accept", "last-event-id")}
                u = urllib.parse.urlsplit(upstream)
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
                conn.connect()
                with fake.lock:
                    fake.upstream_socks.append(conn.sock)  # shut down by close(), which ends read1
                conn.request("GET", self.path, headers=hdrs)
                r = conn.getresponse()
                if r.status != 200:
                    return self._json(r.status, {"error": {"message": r.read().decode(errors="replace")}})
                self.send_response(200)
                self.send_header("Content-Type", r.headers.get("Content-Type", "text/event-stream"))
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    while not fake.stop.is_set():
                        chunk = r.read1(65536)
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
                    pass
                finally:
                    conn.close()
                self.close_connection = True

            def _proxy(self):
                req = urllib.request.Request(upstream + self.path, headers={
                    k: v for k, v in self.headers.items() if k.lower() in ("if-none-match", "accept")})
                try:
                    r = urllib.request.urlopen(req, timeout=10)
                    code, hdrs, body = r.status, r.headers, r.read()
                except urllib.error.HTTPError as e:
                    code, hdrs, body = e.code, e.headers, e.read()
                self.send_response(code)
                for k, v in hdrs.items():
                    if k.lower() not in ("content-length", "connection", "transfer-encoding", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            for sock in self.upstream_socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------------------------------------
# Fixtures.


class Target:
    """Where the browser and the traffic go: the real server, or the fake in front of it."""

    def __init__(self, real, fake: FakeServer | None):
        self.real = real
        self.fake = fake
        self.base_url = fake.base_url if fake else real.base_url
        self.headers = {"Authorization": f"Bearer {KEY}"}

    def complete(self, prompt, rid: str, salt: str | None = None) -> dict:
        body = {"model": "cachet-sim", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if self.fake is None:
            body["model"] = self.real.model()
        if salt is not None:
            body["cache_salt"] = salt
        r = requests.post(f"{self.base_url}/v1/completions", json=body,
                          headers={**self.headers, "X-Request-Id": rid}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def urls_seen(self) -> str:
        """Every request line the data server saw (fake) or its log (real)."""
        return "\n".join(self.fake.paths) if self.fake else self.real.log()


def _start_target(extra: list[str]) -> Target:
    # KEY is the operator's; TENANT_KEY a tenant's (named), which the cache routes refuse (403).
    real = start_server(["--enable-per-request-metrics", *extra], api_key=f"{KEY},dash-tenant:{TENANT_KEY}")
    real.api_key = KEY
    fake = None
    try:
        if DATA == "fake":
            use_real = False
        else:
            r = requests.get(f"{real.base_url}/v1/cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
            use_real = r.status_code == 200
            if DATA == "real":
                assert use_real, f"GET /v1/cache answered {r.status_code}: {r.text[:200]}"
        if not use_real:
            fake = FakeServer(real.base_url, KEY)
        return Target(real, fake)
    except BaseException:
        real.stop()
        raise


def _stop_target(t: Target) -> None:
    if t.fake:
        t.fake.close()
    t.real.stop()


@pytest.fixture()
def target():
    t = _start_target([])
    yield t
    _stop_target(t)


@pytest.fixture()
def browser_page():
    if BROWSER_MISSING:
        if REQUIRE_BROWSER:
            pytest.fail(BROWSER_MISSING + " (CACHET_E2E_REQUIRE_BROWSER=1)")
        pytest.skip(BROWSER_MISSING)
    profile = tempfile.mkdtemp(prefix="cachet-chromium-")
    with pw.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000}, color_scheme="light",
        )
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        try:
            yield page, errors
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


def _text(page, sel: str) -> str:
    return page.locator(sel).inner_text().strip()


def _wait_text(page, sel: str, want: str) -> None:
    page.wait_for_function(
        "([sel, want]) => { const e = document.querySelector(sel); return e && e.textContent.trim() === want; }",
        arg=[sel, want], timeout=WAIT_MS)


# ---------------------------------------------------------------------------------------------
# Tests.


def test_dashboard_goes_live_and_follows_traffic(target, browser_page):
    page, errors = browser_page
    page.goto(f"{target.base_url}/dashboard#key={KEY}")
    # The key leaves the address bar at once; it is sent as a header only.
    assert "key=" not in page.url
    _wait_text(page, "#conn", "live")
    _wait_text(page, "#ev-status", "live")
    page.wait_for_function("() => window.cachetDashboard.snapshots >= 2", timeout=WAIT_MS)
    assert _text(page, "#t-prompt") == "0"
    assert _text(page, "#t-hit") == "–"
    n0 = page.evaluate("window.cachetDashboard.series.hit[0].length")

    a = target.complete(PROMPT, "dash-req-a")
    b = target.complete(PROMPT, "dash-req-b")
    assert a["metrics"]["prefix_cache"]["cached_tokens"] == 0
    assert b["metrics"]["prefix_cache"]["cached_tokens"] == 48

    # Numbers derived from the traffic (see the module docstring).
    _wait_text(page, "#t-prompt", "128")
    _wait_text(page, "#t-hit", "37.5 %")
    # The charts kept growing, one point a snapshot, and the hit-rate series saw the hit.
    page.wait_for_function(f"() => window.cachetDashboard.series.hit[0].length >= {n0 + 2}", timeout=WAIT_MS)
    assert page.evaluate("window.cachetDashboard.charts.hit.data[0].length") >= n0 + 2
    assert page.evaluate("window.cachetDashboard.series.hit[1].some(v => v != null && v > 0)")
    n_src = page.evaluate("window.cachetDashboard.series.src[2].filter(v => v != null).reduce((a, v) => a + v, 0)")
    assert n_src > 0, "computed tokens per second never moved"

    # Prompt tokens by source, as numbers beside the chart.
    src = _text(page, "#n-src")
    assert "48 total" in src and "80 total" in src, src

    # Miss reasons: 64 never cached (A), 16 kept for logits (B).
    _wait_text(page, '#miss li[data-reason="never_cached"] .num', "64 (80 %)")
    assert _text(page, '#miss li[data-reason="capped_for_logits"] .num') == "16 (20 %)"

    # What more memory would buy: nothing here (nothing was evicted), so 2x and 4x equal the
    # hit rate; no divergence yet (A had no cached sibling, B matched); A's 4 entries idle.
    _wait_text(page, '#whatif li[data-whatif="2x"] .num', "37.5 %")
    assert _text(page, '#whatif li[data-whatif="4x"] .num') == "37.5 %"
    assert (_text(page, "#div-early"), _text(page, "#div-all")) == ("0", "0")
    kv = dict(zip(page.locator("#n-kv dt").all_inner_texts(), page.locator("#n-kv dd").all_inner_texts()))
    assert (kv["in use"], kv["cached idle"]) == ("0", "4"), kv

    # Per-tenant: everything under "default".
    row = page.locator('#tenants tr[data-tenant="default"]')
    assert [c.strip() for c in row.locator("td").all_inner_texts()] == ["37.5 %", "128", "48", "48"]

    # The last requests, newest first, each with its cached / computed / created split.
    page.wait_for_selector('#recent button[data-request-id="dash-req-b"]', timeout=WAIT_MS)
    ids = page.eval_on_selector_all("#recent button", "bs => bs.map(b => b.dataset.requestId)")
    assert ids[:2] == ["dash-req-b", "dash-req-a"], ids
    text_b = _text(page, '#recent button[data-request-id="dash-req-b"] .rtext')
    text_a = _text(page, '#recent button[data-request-id="dash-req-a"] .rtext')
    assert text_b.startswith("48 cached · 16 computed · 0 created / 64"), text_b
    assert text_a.startswith("0 cached · 64 computed · 64 created / 64"), text_a
    widths = page.eval_on_selector_all(
        '#recent button[data-request-id="dash-req-b"] .rbar span', "ss => ss.map(s => s.style.width)")
    assert widths == ["75%", "25%", "0%"], widths

    # KV cache events (the real binary's stream): A stored its 4 full blocks as new entries, B
    # none (its recomputed block 3 was already an entry); nothing removed.
    _wait_text(page, "#ev-stored", "4")
    assert _text(page, "#ev-removed") == "0"
    stored = page.locator('#ev-list li[data-kind="stored"]').all_inner_texts()
    assert stored and all("dash-req-a" in x for x in stored), stored

    # Clicking a request opens its block lifecycle.
    page.click('#recent button[data-request-id="dash-req-b"]')
    page.wait_for_selector('#life-blocks tr[data-event="hit"]', timeout=WAIT_MS)
    assert _text(page, "#life-id") == "dash-req-b"
    assert page.locator('#life-blocks tr[data-event="hit"]').count() == 3
    assert _text(page, '#life-fields dd[data-field="cached_tokens"]') == "48"
    assert _text(page, '#life-fields dd[data-field="computed_tokens"]') == "16"
    assert page.get_attribute('#recent button[data-request-id="dash-req-b"]', "aria-pressed") == "true"

    # Hottest prefixes (polled every 5 s): A created 4 blocks, B found the first 3 once; one
    # prefix is reported, the deepest of that run: block 2 (from 0), 48 tokens, 1 hit, by A.
    page.wait_for_function("() => document.querySelector('#hottest tr td.mono') !== null", timeout=WAIT_MS)
    rows = page.locator("#hottest tr")
    assert rows.count() == 1
    cells = [c.strip() for c in rows.nth(0).locator("td").all_inner_texts()]
    assert cells[:3] == ["2", "48", "1"] and cells[5] == "dash-req-a", cells
    assert cells[4].endswith(" ago"), cells

    # Divergence: C is A with a nonce at position 37. Blocks 0-1 hit (32 tokens); block 2 (tokens
    # 32..47) has A's block 2 as a cached sibling, first different at 37 -> diverged_at 37, within
    # the first 64 tokens.
    c = target.complete(PROMPT[:37] + [7] + PROMPT[38:], "dash-req-c")
    assert c["metrics"]["prefix_cache"]["cached_tokens"] == 32
    assert c["metrics"]["prefix_cache"]["diverged_at"] == 37
    _wait_text(page, "#div-early", "1")
    assert _text(page, "#div-all") == "1"
    assert _text(page, "#div-recent") == "Recent: dash-req-c at token 37"
    text_c = _text(page, '#recent button[data-request-id="dash-req-c"] .rtext')
    assert text_c.startswith("32 cached · 32 computed · 32 created / 64 · diverged at 37"), text_c

    # The key never travelled in a URL.
    assert KEY not in target.urls_seen()
    assert not errors, errors


def test_a_forked_requests_lifecycle_names_each_sequence(target, browser_page):
    # n = 2 over a 40-token prompt (blocks 0 and 1 full, block 2 partial): sequence 0 allocates
    # blocks 0-2; at the first token sequence 1 shares 0 and 1 and gets its own block 2 (the
    # copy of the partial one): the page names that allocation's sequence.
    if target.fake is not None:
        pytest.skip("the fake data server keeps no sequences")
    page, errors = browser_page
    page.goto(f"{target.base_url}/dashboard#key={KEY}")
    _wait_text(page, "#conn", "live")
    body = {"model": target.real.model(), "prompt": list(range(200, 240)), "max_tokens": 2,
            "n": 2, "temperature": 1.0, "seed": 5}
    r = requests.post(f"{target.base_url}/v1/completions", json=body,
                      headers={**target.headers, "X-Request-Id": "dash-req-n2"}, timeout=30)
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    page.wait_for_selector('#recent button[data-request-id="dash-req-n2"]', timeout=WAIT_MS)
    page.click('#recent button[data-request-id="dash-req-n2"]')
    page.wait_for_selector('#life-blocks tr[data-event="allocated"]', timeout=WAIT_MS)
    rows = page.locator('#life-blocks tr[data-event="allocated"]').all_inner_texts()
    mine = [x for x in rows if "(seq 1)" in x]
    assert len(mine) == 1, rows
    assert sum("(seq 0)" in x for x in rows) == 3, rows
    assert not errors, errors


def test_dashboard_asks_for_the_key(target, browser_page):
    page, errors = browser_page
    page.goto(f"{target.base_url}/dashboard")
    page.wait_for_selector("#keyform:not([hidden])", timeout=WAIT_MS)
    _wait_text(page, "#conn", "API key needed")
    page.fill("#keyinput", "not-the-key")
    page.click("#keyform button")
    _wait_text(page, "#conn", "wrong API key")
    page.fill("#keyinput", TENANT_KEY)
    page.click("#keyform button")
    _wait_text(page, "#conn", "a tenant's key: this page needs an operator key")
    assert not page.is_hidden("#keyform")
    page.fill("#keyinput", KEY)
    page.click("#keyform button")
    _wait_text(page, "#conn", "live")
    assert page.is_hidden("#keyform")
    page.wait_for_function("() => window.cachetDashboard.snapshots >= 1", timeout=WAIT_MS)
    # The 401s and 403s are the browser's console errors for the refused fetches; nothing else.
    assert all("401" in e or "403" in e for e in errors), errors


def test_dashboard_page_is_served_from_the_binary(target):
    # The real binary's route, not the fake's proxy, and every asset it links.
    r = requests.get(f"{target.real.base_url}/dashboard", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    links = [x for x in re.findall(r'(?:src|href)="([^"]+)"', r.text) if not x.startswith("data:")]
    assert len(links) == 4, links
    for link in links:
        a = requests.get(f"{target.real.base_url}{link}", timeout=10)
        assert a.status_code == 200, link
        assert a.headers["Cache-Control"] == "public, max-age=31536000, immutable", link
        assert a.headers["Content-Type"].startswith("text/javascript" if link.split("?")[0].endswith(".js") else "text/css")
    again = requests.get(f"{target.real.base_url}/dashboard", headers={"If-None-Match": r.headers["ETag"]}, timeout=10)
    assert again.status_code == 304


@pytest.mark.skipif(not os.environ.get("CACHET_DASHBOARD_SCREENSHOT"), reason="set CACHET_DASHBOARD_SCREENSHOT=PATH to take the README picture")
def test_dashboard_screenshot(browser_page):
    """A mixed workload (shared system prompt, per-user turns, a nonce, two tenants, a pool small
    enough to evict), then a picture of the page."""
    t = _start_target(["--num-kv-blocks", "64"])
    try:
        page, _ = browser_page
        page.goto(f"{t.base_url}/dashboard#key={KEY}")
        _wait_text(page, "#conn", "live")
        system = list(range(10, 58))
        stop = threading.Event()
        failed: list[BaseException] = []

        def traffic() -> None:
            n = 0
            try:
                while not stop.is_set():
                    n += 1
                    user = n % 5
                    turn = system + [60 + user] * 16 + [70 + (40 * user + j) % 150 for j in range(8 + n % 23)]
                    t.complete(turn, f"chat-{n:03d}", salt="team-b" if user == 4 else None)
                    if n % 7 == 0:  # a per-request nonce at token 37 of the system prompt
                        t.complete(system[:37] + [200 + n % 50] + system[38:] + [1] * 20, f"nonce-{n:03d}")
                    doc = n % 6  # six documents asked about in turn, pushed out by the batches below
                    t.complete([(37 * doc + 11 * j) % 240 + 5 for j in range(80)] + [250 + n % 8] * 5, f"doc-{n:03d}")
                    if n % 9 == 0:  # something long and new, to push older blocks out
                        t.complete([(13 * n + 7 * j + j * j % 17) % 255 + 1 for j in range(300)], f"batch-{n:03d}")
                    stop.wait(0.15)
            except BaseException as e:  # reported by the test below
                failed.append(e)

        th = threading.Thread(target=traffic, daemon=True)
        th.start()
        try:
            # The traffic keeps running while the picture is taken, so the rates are live.
            page.wait_for_timeout(20000)
            page.click("#recent button >> nth=1")
            page.wait_for_selector("#life-blocks tr", timeout=WAIT_MS)
            page.mouse.move(0, 0)  # no hover highlight in the picture
            page.wait_for_timeout(1200)
            out = pathlib.Path(os.environ["CACHET_DASHBOARD_SCREENSHOT"])
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            stop.set()
            th.join(timeout=30)
        assert not failed, failed
    finally:
        _stop_target(t)
