#!/usr/bin/env python3
"""Issue 15's cost as the issue states it: criterion's engine step, the insight on and off, same run.

Runs the engine bench (`off`, `on`, `on_insight`: see `crates/cachet-engine/benches/engine.rs`)
`--runs` times, each a whole criterion run measuring the three one after the other, and prints
each run's estimates and its ratios `on_insight / on` (the insight's cost: `on` is reporting with
miss reasons only) and `on_insight / off`, then their median and range. With several binaries
their runs alternate, so a comparison sees the same drift. Pinned to one CPU (`--cpu`, default
1) so that the scheduler moving the thread does not add to the noise.

    cargo bench -p cachet-engine --bench engine --no-run
    cp target/release/deps/engine-<hash> /tmp/engine_a
    scripts/insight-criterion.py /tmp/engine_a [/tmp/engine_b] --runs 10

One run takes about 45 s (3 s warm-up and 10 s of measurement per variant, criterion's
analysis between).
"""

import argparse
import re
import shutil
import statistics
import subprocess
import time

NAME = "engine_step_1000_running_decodes"
ESTIMATE = re.compile(NAME + r"/(\w+)\s+time:\s+\[\S+ \S+ ([\d.]+) (\S+)")
UNIT = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}


def run(binary: str, cpu, warm_up: float, measurement: float) -> dict:
    """One criterion run: the middle estimate of each variant, in µs."""
    cmd = [binary, "--bench", "--warm-up-time", str(warm_up), "--measurement-time", str(measurement)]
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu)] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    got = {m[0]: float(m[1]) * UNIT[m[2]] for m in ESTIMATE.findall(out)}
    missing = {"off", "on", "on_insight"} - got.keys()
    if missing:
        raise SystemExit(f"{binary}: no estimate for {sorted(missing)} in its output")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+", help="engine bench binaries (runs alternate between them)")
    ap.add_argument("--runs", type=int, default=10, help="criterion runs of each binary")
    ap.add_argument("--cpu", type=int, default=1, help="CPU to pin to (-1: none)")
    ap.add_argument("--warm-up", type=float, default=3.0, help="criterion warm-up seconds")
    ap.add_argument("--measurement", type=float, default=10.0, help="criterion measurement seconds")
    args = ap.parse_args()
    cpu = None if args.cpu < 0 else args.cpu
    ratios = {b: ([], []) for b in args.binaries}
    print("time      binary  off µs  on µs  on_insight µs  on_insight/on  on_insight/off")
    for _ in range(args.runs):
        for k, b in enumerate(args.binaries):
            t = run(b, cpu, args.warm_up, args.measurement)
            r_on, r_off = t["on_insight"] / t["on"], t["on_insight"] / t["off"]
            ratios[b][0].append(r_on)
            ratios[b][1].append(r_off)
            print(f"{time.strftime('%H:%M:%S')}  {chr(ord('A') + k):>6}  {t['off']:6.1f}  {t['on']:5.1f}  "
                  f"{t['on_insight']:13.1f}  {r_on:13.3f}  {r_off:14.3f}", flush=True)
    for k, b in enumerate(args.binaries):
        on, off = ratios[b]
        print(f"{chr(ord('A') + k)} ({b}): on_insight/on median {statistics.median(on):.3f} "
              f"(range {min(on):.3f}-{max(on):.3f}, {sum(1 for r in on if r <= 1.10)} of {len(on)} "
              f"within 1.10); on_insight/off median {statistics.median(off):.3f}")


if __name__ == "__main__":
    main()
