#!/usr/bin/env python3
"""Soak run: the real model under mixed load for a long time, then memory, latency and
counters checked (issue 17). By hand, not in `make test`; see docs/soak.md.

    scripts/soak.py                       # 30 minutes, default model, 2 engine threads
    scripts/soak.py --minutes 10 --threads 1 --out bench-out/soak.json

It starts `cachet serve` (the release binary) on a free loopback port and runs WORKERS client
threads, each drawing, with a fixed seed, one of these per iteration:

  chat        /v1/chat/completions, non-streaming, shared system prompt (prefix-cache hits)
  chat_stream /v1/chat/completions, streaming with usage and a stop string
  completion  /v1/completions, streaming, a random token prompt (no hits)
  messages    /v1/messages, streaming
  session     a 3-turn session (session_id), then DELETE /v1/sessions/{id}
  vanish      a stream dropped after its first tokens (abort)
  hostile     malformed JSON, a text/plain body, a 100 KB model name, a slow header (408-free
              close), a Content-Length never sent: each must get its 4xx
  tokenize    /tokenize and /detokenize

Every 30 s it scrapes /metrics (RSS, open fds, running / waiting, counters). At the end, once
idle, it checks: nothing running or waiting, no KV held, every counter only grew, prefix hits
never above queries, finished requests equal to the accepted ones, the prompt-token sources
summing to the prompt tokens, RSS and fds flat after warm-up; and it prints client-side
latency percentiles per kind for the first and the last fifth of the run. Exit status 1 when a
check fails. Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    def __init__(self, port: int):
        self.port = port

    def conn(self, timeout=300) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, path, body, headers=None, raw: bytes | None = None):
        c = self.conn()
        data = raw if raw is not None else json.dumps(body).encode()
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        c.request("POST", path, body=data, headers=h)
        r = c.getresponse()
        out = r.read()
        c.close()
        return r.status, out

    def stream(self, path, body, stop_after: int | None = None):
        """(status, first-token seconds or None, events read, aborted)."""
        c = self.conn()
        t0 = time.monotonic()
        # Connection: close, so the end of the stream is the end of the connection.
        c.request("POST", path, body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json", "Connection": "close"})
        r = c.getresponse()
        if r.status != 200:
            r.read()
            c.close()
            return r.status, None, 0, False
        ttft, events = None, 0
        while True:
            line = r.fp.readline()
            if not line:
                break
            if line.startswith(b"data:") and b"[DONE]" not in line:
                events += 1
                token = (b'"text":"' in line and b'"text":""' not in line) or (
                    b'"content":"' in line and b'"content":""' not in line) or b"text_delta" in line
                if ttft is None and token:
                    ttft = time.monotonic() - t0
                if stop_after is not None and events >= stop_after:
                    r.close()  # the connection goes with the response (Connection: close)
                    return 200, ttft, events, True
        c.close()
        return 200, ttft, events, False

    def get(self, path):
        c = self.conn(timeout=30)
        c.request("GET", path)
        r = c.getresponse()
        out = r.read()
        c.close()
        return r.status, out

    def delete(self, path):
        c = self.conn(timeout=30)
        c.request("DELETE", path)
        r = c.getresponse()
        r.read()
        c.close()
        return r.status


def scrape(cl: Client) -> dict[tuple[str, tuple], float]:
    _, text = cl.get("/metrics")
    out = {}
    for line in text.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        out[(name, tuple(sorted(re.findall(r'(\w+)="([^"]*)"', rest))))] = float(value)
    return out


def total(m, name, **labels) -> float:
    return sum(v for (n, l), v in m.items() if n == name and all((k, x) in l for k, x in labels.items()))


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.samples: list[tuple[float, str, float]] = []  # (time, kind, seconds)
        self.accepted = 0
        self.aborted = 0
        self.errors: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, kind, secs, accepted=1, aborted=0):
        with self.lock:
            self.samples.append((time.monotonic(), kind, secs))
            self.accepted += accepted
            self.aborted += aborted
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def error(self, msg):
        with self.lock:
            self.errors.append(msg)


SYSTEM = "You are a concise assistant. Answer in one short sentence. " * 4


def one(cl: Client, rng: random.Random, stats: Stats, model: str):
    kind = rng.choices(
        ["chat", "chat_stream", "completion", "messages", "session", "vanish", "hostile", "tokenize"],
        weights=[20, 20, 15, 15, 10, 8, 7, 5],
    )[0]
    t0 = time.monotonic()
    q = f"Question {rng.randrange(10**6)}: what is {rng.randrange(100)} plus {rng.randrange(100)}?"
    if kind == "chat":
        s, body = cl.post("/v1/chat/completions", {
            "model": model, "max_tokens": rng.randrange(8, 48), "temperature": 0.7, "seed": rng.randrange(1 << 30),
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
        if s != 200:
            return stats.error(f"chat {s} {body[:200]!r}")
        stats.add(kind, time.monotonic() - t0)
    elif kind == "chat_stream":
        s, ttft, _, _ = cl.stream("/v1/chat/completions", {
            "model": model, "max_tokens": rng.randrange(8, 64), "stream": True, "stop": ["\n\n"],
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
        if s != 200:
            return stats.error(f"chat_stream {s}")
        stats.add(kind, ttft if ttft is not None else time.monotonic() - t0)
    elif kind == "completion":
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 400))]
        s, ttft, _, _ = cl.stream("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": rng.randrange(4, 32), "stream": True, "ignore_eos": True})
        if s != 200:
            return stats.error(f"completion {s}")
        stats.add(kind, ttft if ttft is not None else time.monotonic() - t0)
    elif kind == "messages":
        s, ttft, _, _ = cl.stream("/v1/messages", {
            "model": model, "max_tokens": rng.randrange(8, 48), "stream": True, "system": SYSTEM,
            "messages": [{"role": "user", "content": q}]})
        if s != 200:
            return stats.error(f"messages {s}")
        stats.add(kind, ttft if ttft is not None else time.monotonic() - t0)
    elif kind == "session":
        sid = f"soak-{uuid.uuid4().hex[:12]}"
        msgs = [{"role": "system", "content": SYSTEM}]
        for turn in range(3):
            msgs.append({"role": "user", "content": f"{q} (turn {turn})"})
            s, body = cl.post("/v1/chat/completions", {
                "model": model, "max_tokens": 16, "temperature": 0, "session_id": sid, "messages": msgs})
            if s != 200:
                return stats.error(f"session {s} {body[:200]!r}")
            stats.add(kind, time.monotonic() - t0)
            t0 = time.monotonic()
            msgs.append({"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"]})
        if cl.delete(f"/v1/sessions/{sid}") != 204:
            stats.error("session delete")
    elif kind == "vanish":
        s, ttft, events, aborted = cl.stream("/v1/chat/completions", {
            "model": model, "max_tokens": 200, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": q}]}, stop_after=3)
        if s != 200:
            return stats.error(f"vanish {s}")
        stats.add(kind, ttft or 0.0, aborted=1 if aborted else 0)
    elif kind == "hostile":
        which = rng.randrange(5)
        if which == 0:
            s, _ = cl.post("/v1/chat/completions", None, raw=b'{"messages": [')
            want = 400
        elif which == 1:
            s, _ = cl.post("/v1/messages", None, raw=b'{"max_tokens": 1, "messages": []}', headers={"Content-Type": "text/plain"})
            want = 415
        elif which == 2:
            s, body = cl.post("/v1/completions", {"model": "m" * 100_000, "prompt": "x"})
            want = 404
            if len(body) > 2048:
                stats.error(f"a {len(body)}-byte 404")
        elif which == 3:
            with socket.create_connection(("127.0.0.1", cl.port), timeout=30) as sk:
                sk.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")
                s = int(sk.recv(64).split()[1])
            want = 413
        else:
            with socket.create_connection(("127.0.0.1", cl.port), timeout=30) as sk:
                sk.sendall(b"GET /health HTTP/1.1\r\nHo")
                sk.settimeout(30)
                s = 0 if sk.recv(1) == b"" else -1  # closed by the header timeout
            want = 0
        if s != want:
            stats.error(f"hostile {which}: {s}, want {want}")
        stats.add(kind, time.monotonic() - t0, accepted=0)
    else:
        s, body = cl.post("/tokenize", {"model": model, "prompt": q})
        if s != 200:
            return stats.error(f"tokenize {s}")
        ids = json.loads(body)["tokens"]
        s, _ = cl.post("/detokenize", {"model": model, "tokens": ids})
        if s != 200:
            return stats.error(f"detokenize {s}")
        stats.add(kind, time.monotonic() - t0, accepted=0)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2, help="engine compute threads")
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "cachet"))
    ap.add_argument("--model", default=None, help="GGUF file (default: the binary's default model)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    port = free_port()
    cmd = [args.bin, "serve", "--port", str(port), "--threads", str(args.threads), "--max-num-seqs", "16",
           "--max-waiting-requests", "64", "--max-model-len", "2048", "--header-read-timeout", "5",
           "--log-stats-interval", "60"]
    if args.model:
        cmd += ["--model", args.model]
    log = open(os.environ.get("SOAK_LOG", "/tmp/cachet-soak.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    cl = Client(port)
    deadline = time.monotonic() + 300
    while True:
        try:
            if cl.get("/health")[0] == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"cachet did not start: {cmd}")
        time.sleep(0.5)
    model = json.loads(cl.get("/v1/models")[1])["data"][0]["id"]
    print(f"soak: {args.minutes} min, {args.workers} workers, pid {proc.pid}, port {port}", flush=True)

    stats = Stats()
    stop = threading.Event()
    start = time.monotonic()
    end = start + args.minutes * 60

    def worker(i):
        rng = random.Random(args.seed * 1000 + i)
        while not stop.is_set() and time.monotonic() < end:
            try:
                one(cl, rng, stats, model)
            except Exception as e:  # noqa: BLE001 - a soak run records and goes on
                stats.error(f"worker {i}: {type(e).__name__}: {e}")

    first = scrape(cl)
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.workers)]
    for t in threads:
        t.start()
    series = []
    while time.monotonic() < end:
        time.sleep(min(30, max(0.1, end - time.monotonic())))
        m = scrape(cl)
        series.append({
            "t_s": round(time.monotonic() - start, 1),
            "rss_mib": total(m, "process_resident_memory_bytes") / 2**20,
            "fds": total(m, "process_open_fds"),
            "running": total(m, "vllm:num_requests_running"),
            "waiting": total(m, "vllm:num_requests_waiting"),
            "finished": total(m, "vllm:request_success_total"),
            "_m": m,
        })
        print(f"  t={series[-1]['t_s']:7.1f}s rss={series[-1]['rss_mib']:.1f} MiB fds={series[-1]['fds']:.0f} "
              f"running={series[-1]['running']:.0f} finished={series[-1]['finished']:.0f} errors={len(stats.errors)}", flush=True)
    stop.set()
    for t in threads:
        t.join(timeout=600)
    idle_deadline = time.monotonic() + 120
    while True:
        m = scrape(cl)
        if total(m, "vllm:num_requests_running") == 0 and total(m, "vllm:num_requests_waiting") == 0:
            break
        if time.monotonic() > idle_deadline:
            break
        time.sleep(0.2)
    failures = list(stats.errors[:20])
    check = lambda ok, msg: ok or failures.append(msg)  # noqa: E731
    check(proc.poll() is None, "the server died")
    check(total(m, "vllm:num_requests_running") == 0 and total(m, "vllm:num_requests_waiting") == 0, "not idle")
    check(total(m, "vllm:kv_cache_usage_perc") == 0.0, f"KV held: {total(m, 'vllm:kv_cache_usage_perc')}")
    check(total(m, "cachet:parked_sessions") == 0, "parked sessions left")
    prev = first
    for snap in [s["_m"] for s in series] + [m]:
        down = [k for k, v in prev.items() if k[0].endswith(("_total", "_count", "_sum", "_bucket")) and snap.get(k, 0) < v]
        check(not down, f"counters went down: {down[:5]}")
        prev = snap
    check(total(m, "vllm:prefix_cache_hits_total") <= total(m, "vllm:prefix_cache_queries_total"), "hits > queries")
    finished = total(m, "vllm:request_success_total") - total(first, "vllm:request_success_total")
    check(finished == stats.accepted, f"{finished:.0f} finished, {stats.accepted} accepted")
    aborted = total(m, "vllm:request_success_total", finished_reason="abort") - total(first, "vllm:request_success_total", finished_reason="abort")
    check(aborted == stats.aborted, f"{aborted:.0f} aborts, {stats.aborted} vanished clients")
    check(total(m, "vllm:request_success_total", finished_reason="error") == 0, "requests failed")
    check(total(m, "vllm:prompt_tokens_by_source_total") == total(m, "vllm:prompt_tokens_total"), "sources != prompt tokens")
    warm = [s for s in series if s["t_s"] >= min(300, args.minutes * 60 / 5)]
    rss_warm = warm[0]["rss_mib"] if warm else series[0]["rss_mib"]
    rss_end = total(m, "process_resident_memory_bytes") / 2**20
    fds_warm = warm[0]["fds"] if warm else series[0]["fds"]
    fds_end = total(m, "process_open_fds")
    check(rss_end <= rss_warm * 1.10 + 16, f"RSS grew {rss_warm:.1f} -> {rss_end:.1f} MiB after warm-up")
    check(fds_end <= fds_warm + 4, f"fds grew {fds_warm:.0f} -> {fds_end:.0f}")

    span = end - start
    lat = {}
    for kind in sorted(stats.counts):
        a = [x for t, k, x in stats.samples if k == kind and t - start < span / 5]
        b = [x for t, k, x in stats.samples if k == kind and t - start >= span * 4 / 5]
        lat[kind] = {
            "n": stats.counts[kind],
            "first_p50_ms": 1000 * statistics.median(a) if a else None,
            "first_p99_ms": 1000 * pct(a, 99) if a else None,
            "last_p50_ms": 1000 * statistics.median(b) if b else None,
            "last_p99_ms": 1000 * pct(b, 99) if b else None,
        }
    result = {
        "minutes": args.minutes, "workers": args.workers, "threads": args.threads,
        "accepted": stats.accepted, "aborted": stats.aborted, "finished": finished,
        "generation_tokens": total(m, "vllm:generation_tokens_total") - total(first, "vllm:generation_tokens_total"),
        "prompt_tokens": total(m, "vllm:prompt_tokens_total") - total(first, "vllm:prompt_tokens_total"),
        "cached_prompt_tokens": total(m, "vllm:prompt_tokens_cached_total") - total(first, "vllm:prompt_tokens_cached_total"),
        "rss_mib": {"start": series[0]["rss_mib"] if series else None, "after_warmup": rss_warm, "end": rss_end,
                    "max": max(s["rss_mib"] for s in series) if series else None},
        "fds": {"after_warmup": fds_warm, "end": fds_end, "max": max(s["fds"] for s in series) if series else None},
        "latency": lat, "errors": stats.errors[:50], "failures": failures,
        "series": [{k: v for k, v in s.items() if k != "_m"} for s in series],
    }
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    result["exit_code"] = proc.returncode
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=1))
    if failures:
        print("SOAK FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("soak: all checks held")


if __name__ == "__main__":
    main()
