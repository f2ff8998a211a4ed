#!/usr/bin/env bash
# Claude Code for tests/e2e/test_claude_code.py: the npm package `@anthropic-ai/claude-code`,
# pinned, installed under .tools/claude-code (its `claude` at
# .tools/claude-code/node_modules/.bin/claude; the package's own platform binary comes as an
# npm optional dependency). Idempotent: does nothing when
# the pinned version is there. Without npm, or when the install fails, it warns and the test
# skips saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${CACHET_CLAUDE_CODE_VERSION:-2.1.197}"
PREFIX=.tools/claude-code
BIN="$PREFIX/node_modules/.bin/claude"
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q "^$VERSION "; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "warning: npm missing; the Claude Code e2e test will be skipped" >&2
  exit 0
fi
echo "installing @anthropic-ai/claude-code@$VERSION into $PREFIX ..." >&2
mkdir -p "$PREFIX"
if ! npm install --prefix "$PREFIX" --no-audit --no-fund \
    "@anthropic-ai/claude-code@$VERSION" >/dev/null; then
  echo "warning: npm could not install Claude Code; its e2e test will be skipped" >&2
fi
