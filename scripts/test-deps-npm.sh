#!/usr/bin/env bash
# One pinned npm package for an end-to-end test, under .tools/<dir>:
#   scripts/test-deps-npm.sh PACKAGE VERSION DIR BIN WHAT
# installs PACKAGE@VERSION into .tools/DIR (its executable at .tools/DIR/node_modules/.bin/BIN;
# a package's own platform binary comes as an npm optional dependency). Idempotent: does
# nothing when BIN --version names VERSION. Without npm, or when the install fails, it warns
# and WHAT's e2e test skips saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGE="$1" VERSION="$2" PREFIX=".tools/$3" WHAT="$5"
BIN="$PREFIX/node_modules/.bin/$4"
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -qwF -- "$VERSION"; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "warning: npm missing; the $WHAT e2e test will be skipped" >&2
  exit 0
fi
echo "installing $PACKAGE@$VERSION into $PREFIX ..." >&2
mkdir -p "$PREFIX"
if ! npm install --prefix "$PREFIX" --no-audit --no-fund "$PACKAGE@$VERSION" >/dev/null; then
  echo "warning: npm could not install $WHAT; its e2e test will be skipped" >&2
fi
