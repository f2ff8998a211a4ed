#!/usr/bin/env bash
# NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`) for the KV events e2e tests
# (tests/e2e/test_kv_events_dynamo.py). It ships in the PyPI wheel `ai-dynamo-runtime`
# (manylinux_2_28 x86_64/aarch64, abi3 for CPython >= 3.10; dependencies pydantic and uvloop),
# which is installed into the repo's .venv (created here if scripts/test-deps.sh has not run).
# Idempotent: does nothing when the pinned version is already there. Nothing else is fetched:
# the wheel holds the compiled indexer, no CUDA or GPU is needed to run it.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${CACHET_DYNAMO_VERSION:-1.6.1}"
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("ai-dynamo-runtime"))' 2>/dev/null || true)"
if [ "$have" != "$VERSION" ]; then
  echo "installing ai-dynamo-runtime==$VERSION (Dynamo's standalone KV indexer) into $VENV ..." >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "ai-dynamo-runtime==$VERSION"
fi
# The e2e test also needs its HTTP client; requirements.txt pins it.
"$VENV/bin/python" -c 'import requests, pytest' 2>/dev/null \
  || "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt
"$VENV/bin/python" -m dynamo.indexer --help >/dev/null
