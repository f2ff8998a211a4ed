"""Claude Code (npm `@anthropic-ai/claude-code`, pinned in scripts/test-deps-claude-code.sh)
against `cachet serve` on the simulated executor: a long context for its ~80k-byte prompt
(byte tokens), a scripted reply, a dummy key, loopback only (any other address goes to a dead
proxy), every run bounded by a timeout. Turn one completes; turn two (`--continue`) reads the
shared prefix from the cache, which only works because cachet removes the billing line's
per-request nonce. Claude Code's captured first request is replayed without the CLI too.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile

import pytest
import requests

from conftest import ROOT, prefix_cache_hits, start_agent_cli_server

CLAUDE = os.environ.get(
    "CACHET_CLAUDE_BIN", str(ROOT / ".tools" / "claude-code" / "node_modules" / ".bin" / "claude")
)
FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "claude_code_2.1.197_first_request.json"
REPLY = "Hello from cachet."
MODEL = "cachet-sim"
# What the CLI sends (captured with the fixture).
BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24"
)
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def long_server():
    s = start_agent_cli_server(REPLY)
    yield s
    s.stop()


def test_captured_first_request_is_answered(long_server):
    req = json.loads(FIXTURE.read_text())
    req["model"] = MODEL
    headers = {"anthropic-beta": BETAS, "x-api-key": "sk-dummy", "anthropic-version": "2023-06-01"}
    r = requests.post(f"{long_server.base_url}/v1/messages", json=req, headers=headers, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data:")]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == REPLY
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["context_management"] == {"applied_edits": []}
    assert delta["metrics"]["billing_header_removed"] is True
    assert events[-1]["type"] == "message_stop"


def run_claude(server, home: str, cwd: str, *args: str) -> dict:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "ANTHROPIC_BASE_URL": server.base_url,
        "ANTHROPIC_API_KEY": "sk-dummy-key",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # Anything but loopback goes to a closed port.
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    p = subprocess.run(
        [CLAUDE, "-p", *args, "--output-format", "json"],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert p.returncode == 0, f"claude exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}\n{server.log()}"
    return json.loads(p.stdout)


def test_claude_code_completes_turns_and_the_second_reads_the_cache(long_server):
    if not os.path.exists(CLAUDE):
        pytest.skip(f"Claude Code not installed at {CLAUDE}: run scripts/test-deps-claude-code.sh (npm)")
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as cwd:
        first = run_claude(long_server, home, cwd, "Say hello.")
        assert first["is_error"] is False, first
        assert first["result"] == REPLY
        before = prefix_cache_hits(long_server)
        second = run_claude(long_server, home, cwd, "--continue", "Say it again.")
        assert second["is_error"] is False, second
        assert second["result"] == REPLY
        # The second turn's prompt starts with the first's system prompt and tools (tens of
        # thousands of byte tokens): read from the cache, not recomputed.
        read = prefix_cache_hits(long_server) - before
        assert read > 30_000, f"turn two read {read} tokens from the cache\n{long_server.log()}"
