"""Codex CLI (npm `@openai/codex`, pinned in scripts/test-deps-codex.sh) against `cachet serve`
on the simulated executor over the Responses API: a custom model provider
(`wire_api = "responses"`, loopback `base_url`, a dummy key from an environment variable) in a
temporary `CODEX_HOME`, a long context for its ~28k-token prompt (byte tokens), a scripted reply,
any other address sent to a dead proxy, every run bounded by a timeout. Turn one completes; turn
two (`codex exec resume --last`) reads turn one's prompt from the prefix cache (Codex sends
`store: false` and the whole conversation each turn), and Codex's own usage report says so.
Codex's captured first request is replayed without the CLI too.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile

import pytest
import requests

from conftest import BLOCK_SIZE, ROOT, prefix_cache_hits, start_agent_cli_server

CODEX = os.environ.get("CACHET_CODEX_BIN", str(ROOT / ".tools" / "codex" / "node_modules" / ".bin" / "codex"))
FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "codex_0.171.0_first_request.json"
REPLY = "Hello from cachet."
MODEL = "cachet-sim"
KEY_ENV = "CACHET_CODEX_DUMMY_KEY"
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def long_server():
    s = start_agent_cli_server(REPLY)
    yield s
    s.stop()


def sse_events(r: requests.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data:")]


def test_captured_first_request_is_answered(long_server):
    req = json.loads(FIXTURE.read_text())
    assert req["stream"] is True and req["store"] is False
    headers = {"Authorization": "Bearer dummy", "Accept": "text/event-stream"}
    r = requests.post(f"{long_server.base_url}/v1/responses", json=req, headers=headers, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == REPLY
    done = events[-1]
    assert done["type"] == "response.completed"
    resp = done["response"]
    assert resp["output"][0]["content"][0]["text"] == REPLY
    assert resp["prompt_cache_key"] == req["prompt_cache_key"]
    u = resp["usage"]
    assert u["input_tokens_details"]["cached_tokens"] + resp["metrics"]["prefix_cache"]["computed_tokens"] == u["input_tokens"]
    # Sent with `store: false`: nothing kept.
    g = requests.get(f"{long_server.base_url}/v1/responses/{resp['id']}", timeout=10)
    assert g.status_code == 404


def run_codex(server, home: str, cwd: str, *args: str) -> list[dict]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "CODEX_HOME": home,
        KEY_ENV: "sk-dummy-key",
        # Anything but loopback goes to a closed port.
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    p = subprocess.run(
        [CODEX, "exec", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, f"codex exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}\n{server.log()}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def write_config(home: str, server) -> None:
    pathlib.Path(home, "config.toml").write_text(
        f'''model = "{MODEL}"
model_provider = "cachet"

[model_providers.cachet]
name = "cachet"
base_url = "{server.base_url}/v1"
env_key = "{KEY_ENV}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
'''
    )


def turn_usage(events: list[dict]) -> dict:
    done = [e for e in events if e.get("type") == "turn.completed"]
    assert len(done) == 1, events
    return done[0]["usage"]


def agent_text(events: list[dict]) -> str:
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    return "".join(i.get("text", "") for i in items if i.get("type") == "agent_message")


def test_codex_exec_completes_turns_and_the_second_reads_the_cache(long_server):
    if not os.path.exists(CODEX):
        pytest.skip(f"Codex CLI not installed at {CODEX}: run scripts/test-deps-codex.sh (npm)")
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as cwd:
        write_config(home, long_server)
        first = run_codex(long_server, home, cwd, "--json", "--skip-git-repo-check", "Say hello.")
        assert agent_text(first) == REPLY
        u1 = turn_usage(first)
        before = prefix_cache_hits(long_server)
        second = run_codex(long_server, home, cwd, "--json", "--skip-git-repo-check", "resume", "--last", "Say it again.")
        assert agent_text(second) == REPLY
        u2 = turn_usage(second)
        read = prefix_cache_hits(long_server) - before
        # In a resumed thread Codex reports the thread's totals: turn two's own numbers are the
        # difference. Its prompt starts with turn one's prompt and reply as the cache holds
        # them (the reply's KV too: blocks filled while decoding are cached), so exactly their
        # full blocks are read, and Codex reports what cachet's counters say it read.
        assert u2["input_tokens"] - u1["input_tokens"] > u1["input_tokens"] > 20_000, (u1, u2)
        assert read == BLOCK_SIZE * ((u1["input_tokens"] + len(REPLY)) // BLOCK_SIZE), (u1, u2, read)
        assert u2["cached_input_tokens"] - u1["cached_input_tokens"] == read, (u1, u2, read)
        # `cache_write_tokens` reaches Codex too.
        assert u2["cache_write_input_tokens"] > u1["cache_write_input_tokens"] > 0, (u1, u2)
