"""README.md's examples, run as written against a live `cachet serve`.

Every ```python block runs in its own interpreter, and every ```sh block that talks to
`localhost:8000` with curl runs in bash, against a server started here under the README's own
model id (`--served-model-name SmolLM2-135M-Instruct.Q4_1`, on the simulated executor unless
CACHET_E2E_REAL_MODEL=1 with CACHET_E2E_MODEL_ARGS); the only change made to a block is the
port, 8000 becoming the test server's. Blocks that start servers of their own (the external-tier
walk-through, which needs Redis and two instances) are listed in SKIPPED by their first line and
covered by tests/e2e/test_tiers.py instead; a new block that is neither run nor listed fails.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from conftest import start_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"

# First lines of the blocks this test does not run (with where they are covered).
SKIPPED = {
    "make serve   # fetch the default model if missing, build in release mode, serve on 127.0.0.1:8000",
    "redis-server --port 6379 --save '' &",  # test_tiers.py
    "cachet serve --kv-tier host,redis \\",  # test_tiers.py (cluster)
    "scripts/test-deps-dynamo.sh",  # test_kv_events_cachet.py (two instances, Dynamo's indexer)
    "P=$(python3 -c 'print(\"The tide tables of the northern coast, in full. \" * 60)')",  # same
    "cargo test -p cachet-core --release    # one crate's tests",  # how to run tests, no server
    "scripts/fetch-gemma3.sh",  # test_gemma3.py (serves the Gemma file)
}


def blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", text, re.S)]


def runnable():
    out = []
    for lang, code in blocks():
        first = code.splitlines()[0] if code.strip() else ""
        if first in SKIPPED:
            continue
        if lang == "python":
            out.append(("python", code))
        elif lang == "sh" and "localhost:8000" in code and "curl" in code:
            out.append(("sh", code))
        elif lang in ("sh", "python"):
            out.append(("unlisted", first))
    return out


@pytest.fixture(scope="module")
def readme_server():
    args = ["--served-model-name", MODEL_ID]
    if os.environ.get("CACHET_E2E_REAL_MODEL") == "1":
        s = start_server(args, executor_args=shlex.split(os.environ.get("CACHET_E2E_MODEL_ARGS", "")))
    else:
        s = start_server(args)
    yield s
    s.stop()


def test_every_block_is_run_or_listed():
    unlisted = [first for kind, first in runnable() if kind == "unlisted"]
    assert not unlisted, f"README blocks neither run by this test nor listed in SKIPPED: {unlisted}"
    assert sum(1 for k, _ in runnable() if k == "python") >= 4


@pytest.mark.parametrize("i", range(len(runnable())))
def test_readme_example(readme_server, i):
    kind, code = runnable()[i]
    if kind == "unlisted":
        pytest.skip("reported by test_every_block_is_run_or_listed")
    port = str(readme_server.port)
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("localhost:8000", f"localhost:{port}")
    if kind == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"README block {i} failed:\n{code}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}\n{readme_server.log()}"
    assert r.stdout.strip(), f"README block {i} printed nothing"
