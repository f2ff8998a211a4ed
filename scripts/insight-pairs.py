#!/usr/bin/env python3
"""Issue 15's cost as pairs: run two builds of the engine bench alternately and compare.

Each run is one `CACHET_INTERLEAVED` process (the `on` and `on_insight` engines in one process,
alternating blocks of steps); its last line's median on_insight / on ratio is what is compared.
One run's median moves by about +-0.03 between identical runs on the 2-vCPU machines, and the
machine drifts over minutes, so builds are compared in pairs: run A and run B back to back, the
order flipped every pair, and the per-pair difference B - A reported with how many pairs went
down. Run the same binary as A and B to see the noise (10 pairs: within +-0.005 here).

    cargo bench -p cachet-engine --no-run
    cp target/release/deps/engine-<hash> /tmp/engine_a      # (then rebuild B, copy it too)
    scripts/insight-pairs.py /tmp/engine_a /tmp/engine_b --pairs 10 --block 100

`--env A_ENV B_ENV` compares two settings of one binary instead (e.g. `CACHET_ABLATE=`
against `CACHET_ABLATE=index,history`; several settings are separated by spaces).
"""

import argparse
import os
import statistics
import subprocess


def ratio(binary: str, env: dict) -> float:
    out = subprocess.run([binary, "--bench"], env=env, capture_output=True, text=True, check=True)
    last = out.stdout.strip().splitlines()[-1].split()
    if last[0] != "median":
        raise SystemExit(f"{binary}: unexpected last line {last}")
    return float(last[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="bench binary A")
    ap.add_argument("b", nargs="?", help="bench binary B (default: A, with --env)")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--block", type=int, default=100, help="steps per block (CACHET_BLOCK)")
    ap.add_argument("--rounds", type=int, help="rounds per run (default: 120 at 100-step blocks, else 20)")
    ap.add_argument("--env", nargs=2, metavar=("A_ENV", "B_ENV"), default=("", ""),
                    help="space-separated KEY=VALUE settings for A and for B (a value may hold "
                         "commas: 'CACHET_ABLATE=index,history')")
    args = ap.parse_args()
    rounds = args.rounds or (120 if args.block <= 100 else 20)

    def env_of(spec: str) -> dict:
        env = dict(os.environ, CACHET_BLOCK=str(args.block), CACHET_INTERLEAVED=str(rounds))
        for kv in spec.split():
            k, v = kv.split("=", 1)
            env[k] = v
        return env

    sides = [(args.a, env_of(args.env[0])), (args.b or args.a, env_of(args.env[1]))]
    got = ([], [])
    for i in range(args.pairs):
        for s in ((0, 1) if i % 2 == 0 else (1, 0)):
            got[s].append(ratio(*sides[s]))
        print(f"pair {i + 1}: A {got[0][-1]:.3f}  B {got[1][-1]:.3f}", flush=True)
    diff = [b - a for a, b in zip(*got)]
    for name, v in zip("AB", got):
        print(f"{name}: median {statistics.median(v):.3f} (range {min(v):.3f}-{max(v):.3f})")
    down = sum(1 for d in diff if d < 0)
    print(f"B - A per pair: median {statistics.median(diff):+.3f}, {down} of {args.pairs} lower "
          f"({args.block}-step blocks, {rounds} rounds a run)")


if __name__ == "__main__":
    main()
