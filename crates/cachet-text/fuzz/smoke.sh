#!/usr/bin/env bash
# Runs every cachet-text fuzz target for a bounded time (default 20 s each) from the committed
# seeds. Longer by hand: FUZZ_SECONDS=600 crates/cachet-text/fuzz/smoke.sh, or one target from
# this folder with `cargo +nightly fuzz run <target> corpus/<target> seeds/<target>` (libFuzzer
# writes new inputs into the first folder: keep that one out of seeds/; corpus/ is ignored).
#
# cargo-fuzz needs nightly rustc flags (-Zsanitizer=address). With a nightly toolchain
# installed (rustup toolchain install nightly) it is used; otherwise the stable compiler is run
# with RUSTC_BOOTSTRAP=1, which unlocks those flags on stable (the usual workaround; the
# sanitizer runtime ships with the stable toolchain too). Needs `cargo install cargo-fuzz`.
#
# A crash leaves its input in fuzz/artifacts/<target>/ and fails the script; fix it and add a
# regression test to crates/cachet-text (see tests/fuzz_regressions.rs).
set -euo pipefail
cd "$(dirname "$0")"
SECONDS_EACH="${FUZZ_SECONDS:-20}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${TMPDIR:-/tmp}/cachet-text-fuzz-target}"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
    exit 1
fi
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    FUZZ=(cargo +nightly fuzz)
else
    export RUSTC_BOOTSTRAP=1
    FUZZ=(cargo fuzz)
fi

targets=(stop_holdback detokenizer chat_template)
"${FUZZ[@]}" build
for t in "${targets[@]}"; do
    work="$(mktemp -d)"
    log="$work.log"
    echo "== $t: ${SECONDS_EACH}s"
    # The first corpus folder collects new inputs (thrown away); the seeds are only read.
    # -rss_limit_mb bounds memory; -timeout catches an input that does not finish.
    status=0
    "${FUZZ[@]}" run "$t" "$work" "seeds/$t" -- \
        -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"$log" 2>&1 || status=$?
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)|^#[0-9]+ +DONE' "$log" || true
    if [ "$status" -ne 0 ]; then
        tail -n 40 "$log" >&2
        echo "FAIL: $t (exit $status); reproducer in $(pwd)/artifacts/$t/" >&2
        rm -rf "$work" "$log"
        exit 1
    fi
    rm -rf "$work" "$log"
done
echo "fuzz smoke: all targets ran ${SECONDS_EACH}s each without a crash"
