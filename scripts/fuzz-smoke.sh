#!/usr/bin/env bash
# Runs every fuzz target of the repository for a bounded time from its committed seeds (the
# `make test` smoke run): cachet-text's (stop-string holdback, incremental detokenizer, chat
# template; through crates/cachet-text/fuzz/smoke.sh), cachet-server's (request decoding and
# validation, whole requests through the router) and cachet-model's (crafted GGUF files, the
# GGUF tokenizer from crafted metadata).
#
#   scripts/fuzz-smoke.sh                    # FUZZ_SECONDS=15 per target
#   FUZZ_SECONDS=600 scripts/fuzz-smoke.sh   # longer, by hand
#   FUZZ_ONLY=crates/cachet-model/fuzz scripts/fuzz-smoke.sh
#   FUZZ_BUILD=dev scripts/fuzz-smoke.sh     # unoptimised build (what `make test` runs)
#
# FUZZ_BUILD=dev builds with `cargo fuzz --dev` (still ASan and coverage, no optimisation):
# measured cold for cachet-model's targets on the 2-core VM, 1 m 50 s wall / 2 m 13 s CPU
# against 6 m 20 s / 6 m 01 s for the default release build, at about a third of the
# executions per second. Every target of the repo, cold, on stable with RUSTC_BOOTSTRAP=1,
# 10 s each, while other builds ran: dev 4 m 07 s wall / 5 m 43 s CPU; release 25 m wall /
# 15 m 12 s CPU (cargo-fuzz's release flags include -Ccodegen-units=1), with 3 to 35 times the
# executions. The right trade for a smoke in CI, not for a long run by hand.
# In dev mode cachet-text's targets are run here directly rather than by its smoke.sh.
#
# Needs cargo-fuzz (installed here when missing) and nightly rustc flags: with a nightly
# toolchain installed it is used, otherwise the stable compiler runs with RUSTC_BOOTSTRAP=1.
# All fuzz crates build into one target folder (CARGO_TARGET_DIR, default
# $TMPDIR/cachet-fuzz-target), so their shared dependencies are compiled once.
#
# A crash leaves its input in <crate>/fuzz/artifacts/<target>/ and fails the script; fix it and
# add the input to <crate>/fuzz/seeds/<target>/ and a regression test to the crate
# (tests/fuzz_regressions.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
export FUZZ_SECONDS="${FUZZ_SECONDS:-15}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${TMPDIR:-/tmp}/cachet-fuzz-target}"
BUILD_FLAGS=()
if [ "${FUZZ_BUILD:-release}" = dev ]; then
    BUILD_FLAGS=(--dev)
    # No debug info (a crash report still names the functions) and no incremental state: the
    # build with both was ~12 GB here after a few runs (each target ~230 MB), with line tables
    # only 2.9 GB cold, more than a CI runner may have to spare. Reproduce a crash with a
    # debug build by hand.
    export CARGO_INCREMENTAL=0
    export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-0}"
fi
DIRS=(${FUZZ_ONLY:-crates/cachet-text/fuzz crates/cachet-server/fuzz crates/cachet-model/fuzz})

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz ..." >&2
    cargo install --locked cargo-fuzz >/dev/null
fi
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    FUZZ=(cargo +nightly fuzz)
else
    export RUSTC_BOOTSTRAP=1
    FUZZ=(cargo fuzz)
fi

# One target for FUZZ_SECONDS: a fresh corpus folder collects new inputs (thrown away), the
# seeds are only read; -rss_limit_mb bounds memory, -timeout catches an input that hangs.
run_target() {
    local dir="$1" t="$2" work log status=0
    work="$(mktemp -d)"
    log="$work.log"
    echo "== ${dir%/fuzz}: $t, ${FUZZ_SECONDS}s"
    (cd "$dir" && "${FUZZ[@]}" run "${BUILD_FLAGS[@]}" "$t" "$work" "seeds/$t" -- \
        -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1) \
        >"$log" 2>&1 || status=$?
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)|^#[0-9]+ +DONE' "$log" || true
    if [ "$status" -ne 0 ]; then
        tail -n 40 "$log" >&2
        echo "FAIL: $dir $t (exit $status); reproducer in $ROOT/$dir/artifacts/$t/" >&2
        rm -rf "$work" "$log"
        return 1
    fi
    rm -rf "$work" "$log"
}

started=$SECONDS
for dir in "${DIRS[@]}"; do
    if [ -x "$dir/smoke.sh" ] && [ "${#BUILD_FLAGS[@]}" -eq 0 ]; then
        # The crate's own driver (same conventions).
        "$dir/smoke.sh"
        continue
    fi
    (cd "$dir" && "${FUZZ[@]}" build "${BUILD_FLAGS[@]}")
    mapfile -t targets < <(cd "$dir" && "${FUZZ[@]}" list)
    for t in "${targets[@]}"; do
        run_target "$dir" "$t"
    done
done
echo "fuzz smoke: every target ran ${FUZZ_SECONDS}s without a crash ($((SECONDS - started))s in all)"
