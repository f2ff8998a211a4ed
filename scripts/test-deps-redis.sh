#!/usr/bin/env bash
# The Redis binaries the cachet-tiers tests start on loopback ports: `redis-server` and
# `redis-cli` (Debian packages redis-server and redis-tools). Idempotent: does nothing when both
# are on PATH; installs them with apt-get when run as root; otherwise warns (the tests then skip
# with a message saying so).
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} (Debian) for the cachet-tiers tests ..." >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The package starts a system-wide server on port 6379 where an init system runs; the tests
  # start their own on free ports and never use it.
else
  echo "warning: ${missing[*]} missing and not root; the Redis tier tests will be skipped" >&2
fi
