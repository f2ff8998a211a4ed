#!/usr/bin/env bash
# Codex CLI for tests/e2e/test_codex.py: the npm package `@openai/codex`, pinned, installed
# under .tools/codex (its `codex` at .tools/codex/node_modules/.bin/codex); see
# scripts/test-deps-npm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
exec scripts/test-deps-npm.sh @openai/codex "${CACHET_CODEX_VERSION:-0.171.0}" codex codex "Codex"
