#!/usr/bin/env python3
"""Issue 15's cost in instructions: what the cache insight adds to the engine step, counted.

Timing pairs (`scripts/insight-pairs.py`) move by +-0.015 between identical runs on the 2-vCPU
machines, more than most single changes to the insight's hot path are worth. Instruction counts
do not move: this runs `examples/steptime` (1,000 decodes, 10,000 steps) under
`valgrind --tool=callgrind` with reporting `on` and `full` (every piece of insight), and prints
the instructions the insight adds per step and per block filled (each a block boundary of one
request: the unit the insight's per-step work comes in), and the functions that add them.
With everything in cache (100 decodes) the insight still costs 6-10 % of the step, so most of
its cost is executing these instructions (docs/bench-runs/2026-12-07-icelake-insight-instructions.md): a change
that lowers them lowers the cost; cache misses come on top.

    cargo build --release -p cachet-engine --example steptime
    cp target/release/examples/steptime /tmp/steptime_a      # (then rebuild B, copy it too)
    scripts/insight-instructions.py /tmp/steptime_a [/tmp/steptime_b] [--decodes 1000]

Each callgrind run takes about a minute (valgrind must be installed).
"""

import argparse
import os
import re
import subprocess
import tempfile

LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*\S)\s*$")


def profile(binary: str, mode: str, decodes: int, tmp: str):
    """(total instructions, steps, blocks filled per step, exclusive instructions by function)."""
    out = os.path.join(tmp, f"cg.{os.path.basename(binary)}.{mode}")
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", binary, mode, str(decodes)],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"blocks filled per step: ([\d.]+) \((\d+) steps\)", run.stdout)
    if not m:
        raise SystemExit(f"{binary} {mode}: no 'blocks filled per step' line in {run.stdout!r}")
    filled, steps = float(m.group(1)), int(m.group(2))
    ann = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", out],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total, funcs = 0, {}
    for line in ann.splitlines():
        g = LINE.match(line)
        if not g:
            continue
        n, name = int(g.group(1).replace(",", "")), g.group(2)
        if name.startswith("PROGRAM TOTALS"):
            total = n
        else:
            # Drop the binary's path, so that two builds' functions compare by name.
            funcs[re.sub(r"\s*\[[^\]]*\]$", "", name)] = n
    return total, steps, filled, funcs


def added(binary: str, decodes: int, top: int, tmp: str) -> float:
    on = profile(binary, "on", decodes, tmp)
    full = profile(binary, "full", decodes, tmp)
    steps, filled = full[1], full[2]
    per_step = (full[0] - on[0]) / steps
    per_block = per_step / filled if filled else float("nan")
    print(f"{binary}: the insight adds {per_step:,.0f} instructions a step "
          f"({100 * (full[0] - on[0]) / on[0]:.1f} % of `on`), "
          f"{per_block:,.0f} per block filled ({filled:.1f} filled a step)")
    names = set(on[3]) | set(full[3])
    deltas = sorted(((full[3].get(k, 0) - on[3].get(k, 0)) / steps, k) for k in names)
    for d, k in reversed(deltas[len(deltas) - top:] if top > 0 else []):
        print(f"  {d:+10,.0f} a step  {k}")
    return per_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="steptime binary A")
    ap.add_argument("b", nargs="?", help="steptime binary B, to compare with A")
    ap.add_argument("--decodes", type=int, default=1000)
    ap.add_argument("--top", type=int, default=12, help="functions listed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a = added(args.a, args.decodes, args.top, tmp)
        if args.b:
            b = added(args.b, args.decodes, args.top, tmp)
            print(f"B - A: {b - a:+,.0f} instructions per block filled ({100 * (b - a) / a:+.1f} %)")


if __name__ == "__main__":
    main()
