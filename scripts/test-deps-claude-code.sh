#!/usr/bin/env bash
# Claude Code for tests/e2e/test_claude_code.py: the npm package `@anthropic-ai/claude-code`,
# pinned, installed under .tools/claude-code (its `claude` at
# .tools/claude-code/node_modules/.bin/claude); see scripts/test-deps-npm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
exec scripts/test-deps-npm.sh @anthropic-ai/claude-code "${CACHET_CLAUDE_CODE_VERSION:-2.1.197}" \
  claude-code claude "Claude Code"
