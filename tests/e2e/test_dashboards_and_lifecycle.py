"""vLLM's published Grafana dashboards work unchanged on cachet, and the engine lifecycle as an
operator sees it through the real binary.

tests/data/vllm-dashboards.json holds every expression of vLLM's dashboards and its ecosystem's
(examples/observability, production-stack, AIBrix, llm-d) with the metrics each one reads. For
every expression whose metrics cachet exports, each literal label matcher on a label whose
values vLLM creates at start (finish reason, sleep state, waiting reason, token source) must
select a series: otherwise the panel comes back empty, as the error panels did when
`finished_reason="error"` had no series.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import time

import requests

from conftest import ROOT, start_server

# Labels whose every value vLLM exports from the start (at zero).
ZERO_CREATED = {"finished_reason", "sleep_state", "reason", "source"}


def scrape(server) -> dict[str, list[dict[str, str]]]:
    """Metric name → label sets of its series."""
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    series: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head = line.rsplit(" ", 1)[0]
        name, _, rest = head.partition("{")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        series.setdefault(name, []).append(labels)
    return series


def matchers(expr: str, metric: str) -> list[tuple[str, str]]:
    """Literal `label="value"` matchers written on `metric{...}` in `expr` (template variables
    and regex matchers skipped)."""
    out = []
    for m in re.finditer(re.escape(metric) + r"\{([^}]*)\}", expr):
        for k, v in re.findall(r'(\w+)="([^"$]*)"', m.group(1)):
            out.append((k, v))
    return out


def test_dashboard_expressions_find_their_series(server):
    # Some traffic first, so that request-driven series exist.
    for i in range(3):
        r = requests.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": f"dash {i}", "max_tokens": 3, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    series = scrape(server)
    exported = set(series)
    entries = json.loads((ROOT / "tests" / "data" / "vllm-dashboards.json").read_text())
    usable = [e for e in entries if e["metrics"] and all(m in exported for m in e["metrics"])]
    assert len(usable) >= 100, f"only {len(usable)} dashboard expressions are usable"
    empty = []
    for e in usable:
        for metric in e["metrics"]:
            for k, v in matchers(e["expr"], metric):
                if k in ZERO_CREATED and not any(s.get(k) == v for s in series[metric]):
                    empty.append((e["source"], e["panel"], metric, k, v))
    assert not empty, f"panels that would come back empty: {empty}"
    # What the restructuring issue named, by name and type.
    for name in [
        "vllm:engine_sleep_state",
        "vllm:request_time_per_output_token_seconds_bucket",
        "vllm:num_requests_waiting_by_reason",
        "vllm:request_max_num_generation_tokens_sum",
        "vllm:cache_config_info",
        "vllm:prompt_tokens_cached_by_source_total",
        "http_requests_total",
        "http_request_duration_seconds_count",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ]:
        assert name in exported, name
    assert {"finished_reason": "error"}.items() <= next(
        s for s in series["vllm:request_success_total"] if s.get("finished_reason") == "error"
    ).items()
    awake = [s for s in series["vllm:engine_sleep_state"] if s.get("sleep_state") == "awake"]
    assert awake
    handlers = {s.get("handler") for s in series["http_requests_total"]}
    assert "/v1/completions" in handlers


def test_engine_death_fails_health_and_exits_non_zero():
    """A panic on the core thread (injected through the simulated executor): the request gets a
    500, /health answers 503, and the process exits non-zero so a supervisor restarts it."""
    s = start_server(["--shutdown-timeout", "5"], executor_args=[
        "--executor", "sim", "--block-size", "16", "--sim-panic-on", "KILL-THE-ENGINE",
    ])
    try:
        r = requests.post(
            f"{s.base_url}/v1/completions",
            json={"prompt": "KILL-THE-ENGINE", "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error"
        try:
            h = requests.get(f"{s.base_url}/health", timeout=5)
            assert h.status_code == 503
        except requests.ConnectionError:
            pass  # already exited
        assert s.proc.wait(timeout=30) != 0
        assert "panicked" in s.log()
    finally:
        s.stop()


def test_sigterm_with_a_short_drain_timeout_aborts_what_is_left():
    """`--shutdown-timeout 1`: a long request still running after a second is aborted, the
    process exits 0."""
    s = start_server(["--shutdown-timeout", "1", "--enable-per-request-metrics"], executor_args=[
        "--executor", "sim", "--block-size", "16", "--sim-decode-us-per-seq", "20000",
    ])
    try:
        resp = requests.post(
            f"{s.base_url}/v1/completions",
            json={"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True},
            stream=True,
            timeout=60,
        )
        lines = resp.iter_lines()
        next(lines)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        body = b"\n".join(lines).decode()
        assert '"finish_reason":"abort"' in body, body[-500:]
        assert s.proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 15
        assert "drain timeout reached" in s.log()
    finally:
        s.stop()
