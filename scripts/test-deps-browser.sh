#!/usr/bin/env bash
# What the dashboard's browser test (tests/e2e/test_dashboard.py) needs: Debian's `chromium`
# (installed with apt-get when run as root) and the Python `playwright` package in the repo's
# .venv. Playwright drives the system Chromium (`executable_path=/usr/bin/chromium`);
# `playwright install` is never run (it downloads its own browser builds, which this project
# does not fetch). Idempotent: does nothing when both are present. Without root and without
# chromium it warns, and the test skips with a message saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAYWRIGHT_VERSION=1.65.2
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium (Debian) for the dashboard browser test ..." >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium fonts-dejavu-core >/dev/null
  else
    echo "warning: chromium missing and not root; the dashboard browser test will be skipped" >&2
  fi
fi
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import playwright, importlib.metadata as m; \
    raise SystemExit(m.version('playwright') != '$PLAYWRIGHT_VERSION')" 2>/dev/null; then
  echo "installing playwright==$PLAYWRIGHT_VERSION into $VENV (driver only; no browser download) ..." >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "playwright==$PLAYWRIGHT_VERSION"
fi
