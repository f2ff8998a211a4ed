#!/usr/bin/env bash
# Codex CLI for tests/e2e/test_codex.py: the npm package `@openai/codex`, pinned, installed
# under .tools/codex (its `codex` at .tools/codex/node_modules/.bin/codex; the package's own
# platform binary comes as an npm optional dependency). Idempotent: does nothing when the
# pinned version is there. Without npm, or when the install fails, it warns and the test
# skips saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${CACHET_CODEX_VERSION:-0.171.0}"
PREFIX=.tools/codex
BIN="$PREFIX/node_modules/.bin/codex"
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q " $VERSION\$"; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "warning: npm missing; the Codex e2e test will be skipped" >&2
  exit 0
fi
echo "installing @openai/codex@$VERSION into $PREFIX ..." >&2
mkdir -p "$PREFIX"
if ! npm install --prefix "$PREFIX" --no-audit --no-fund \
    "@openai/codex@$VERSION" >/dev/null; then
  echo "warning: npm could not install Codex; its e2e test will be skipped" >&2
fi
