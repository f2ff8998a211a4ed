#!/usr/bin/env bash
# Everything `make test` needs beyond the Rust toolchain and Python: promtool (Debian package
# `prometheus`), redis-server and redis-cli (when run as root), and a virtual environment with
# the e2e test clients and Dynamo's KV indexer.
set -euo pipefail
# The whole run writes ~4 GB (release and clippy builds, the fuzz build, the venv, Chromium):
# say so up front when the disk is short, rather than as a linker's bus error later.
free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
echo "disk: $((free_kb / 1024)) MiB free under $(pwd)" >&2
if [ "${free_kb:-0}" -lt $((5 * 1024 * 1024)) ]; then
  echo "warning: under 5 GiB free; the build may fail for want of disk" >&2
fi
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing promtool (Debian package prometheus) ..." >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "warning: promtool missing and not root; the promtool check will be skipped" >&2
  fi
fi
if ! rustup component list --installed 2>/dev/null | grep -q clippy; then
  rustup component add clippy rustfmt >/dev/null 2>&1 || true
fi
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt
# Gemma 3 270M for its real-model tests (crates/cachet-model/tests/real_gemma3.rs).
scripts/fetch-gemma3.sh
# Redis for the external-tier tests; NVIDIA Dynamo's KV indexer for the KV-events e2e test;
# Chromium and Playwright for the dashboard's browser test; Claude Code; Codex CLI.
scripts/test-deps-redis.sh
scripts/test-deps-dynamo.sh
scripts/test-deps-browser.sh
# Claude Code (npm) for its end-to-end test.
scripts/test-deps-claude-code.sh
# Codex CLI (npm) for its end-to-end test.
scripts/test-deps-codex.sh
