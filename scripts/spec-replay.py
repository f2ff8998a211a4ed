#!/usr/bin/env python3
"""Replay prompt-lookup drafting on a recorded greedy answer: how many steps, draft tokens
and accepted tokens a drafting rule gives, and what that would cost.

Greedy output does not depend on what is drafted, so one recorded answer (prompt and output
token ids) replays every rule exactly: a draft token is accepted when it equals the recorded
token at its position. The replay mirrors the scheduler's rules (crates/cachet-core/src/spec.rs:
`propose_ngram`, `draft_cap`, `SpecState::record`, `backoff_skips`; the block room of 16-token
blocks, `max_tokens - 1` still to generate). Its first line is the rule as shipped, whose
counts must equal the bench's (the report's `accepted / drafted`): if they differ, the replay
has drifted from the scheduler and nothing below it means anything.

Time is an estimate: each step costs the bench's measured batch-1 step with `k` rejected drafts
(`verify_cost`, interpolated over k and linearly over the context), shifted by one constant so
that the plain steps sum to the plain run's measured decode time.

    target/release/cachet bench spec --reps 1 --free-tokens 96 --cost-reps 20 \\
        --dump-tokens /tmp/spec --output-json /tmp/spec/report.json
    scripts/spec-replay.py /tmp/spec/spec-tokens-0.json --report /tmp/spec/report.json
"""

import argparse
import json

BLOCK = 16


def backoff_skips(misses: int) -> int:
    if misses <= 1:
        return 0
    return min((1 << min(misses - 1, 5)) - 1, 15)


def propose_recent(tokens, k, min_n, max_n):
    """The tokens after the most recent earlier occurrence of the longest suffix n-gram."""
    n_tok = len(tokens)
    if k == 0 or n_tok < 2:
        return []
    for n in range(min(max_n, n_tok - 1), max(min_n, 1) - 1, -1):
        suffix = tokens[n_tok - n:]
        for i in range(n_tok - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:min(i + n + k, n_tok)]
    return []


def replay(prompt, output, k_max=5, min_n=2, max_n=4, adaptive=True, block=BLOCK, oracle=False):
    """Steps of one greedy request; returns (steps, drafted, accepted, [(k, position)])."""
    tokens = list(prompt) + [output[0]]  # the first token comes from the prefill
    limit, misses, skip, taken = 0, 0, 0, 0
    steps = []
    drafted = accepted = 0
    while len(tokens) - len(prompt) < len(output):
        p = len(tokens) - 1
        out_len = len(tokens) - len(prompt)
        allocated = -(-(p + 1) // block) * block
        cap = min(k_max, allocated - (p + 1), len(output) - (out_len + 1))
        if adaptive:
            cap = min(cap, k_max if limit == 0 else min(limit, k_max))
        drafts = []
        if cap > 0:
            drafts = (output[out_len:out_len + cap] if oracle
                      else propose_recent(tokens, cap, min_n, max_n))
            if drafts and skip > 0:
                skip -= 1
                drafts = []
        truth = output[out_len:]
        a = 0
        while a < len(drafts) and a < len(truth) - 1 and drafts[a] == truth[a]:
            a += 1
        steps.append((len(drafts), p))
        if drafts:
            drafted += len(drafts)
            accepted += a
            taken += a
            misses = 0 if a > 0 else misses + 1
            if adaptive:
                skip = backoff_skips(misses)
                lim = k_max if limit == 0 else min(limit, k_max)
                if a >= len(drafts):
                    limit = min(lim + 1, k_max)
                elif taken == 0:
                    limit = a + 1
                else:
                    limit = max(a + 1, lim - 1)
        tokens += truth[:a + 1]
    return len(steps), drafted, accepted, steps


def cost_model(report):
    """Step ms as a function of (k, context) from the report's `verify_cost`, or None."""
    rows = report.get("verify_cost") or []
    by_ctx = {}
    for r in rows:
        by_ctx.setdefault(r["context"], {})[r["drafts"]] = r["median_ms"]
    ctxs = sorted(by_ctx)
    if len(ctxs) < 2:
        return None

    def at_ctx(c, k):
        """Linear in k between the measured k, extended past the largest one by its slope."""
        t = by_ctx[c]
        ks = sorted(t)
        if k in t:
            return t[k]
        if k > ks[-1]:
            lo, hi = ks[-2], ks[-1]
        else:
            lo = max(x for x in ks if x < k)
            hi = min(x for x in ks if x > k)
        return t[lo] + (t[hi] - t[lo]) * (k - lo) / (hi - lo)

    def step(k, ctx):
        a, b = (ctxs[0], ctxs[1]) if ctx <= ctxs[1] or len(ctxs) == 2 else (ctxs[-2], ctxs[-1])
        f = (ctx - a) / (b - a)
        return at_ctx(a, k) + (at_ctx(b, k) - at_ctx(a, k)) * f

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokens", help="a spec-tokens-<i>.json of `cachet bench spec --dump-tokens`")
    ap.add_argument("--report", help="the same run's `--output-json` (for the time estimate)")
    args = ap.parse_args()
    d = json.load(open(args.tokens))
    prompt, output = d["prompt"], d["output"]
    report = json.load(open(args.report)) if args.report else {}
    step = cost_model(report)
    offset = 0.0
    wl = next((w for w in report.get("workloads", []) if w["name"] == d.get("name")), None)
    if step and wl and wl["off"]:
        plain = [step(0, len(prompt) + i) for i in range(1, len(output))]
        measured = 1e3 / wl["off"][0]["decode_tok_s"]  # ms per plain step
        offset = measured - sum(plain) / len(plain)
        print(f"{d.get('name')}: {len(prompt)} prompt tokens, {len(output)} output tokens; "
              f"plain step {measured:.2f} ms measured, cost table shifted by {offset:+.2f} ms")
        if wl["on"]:
            on = wl["on"][0]
            print(f"the bench's speculative run: {on['accepted_tokens']} accepted of "
                  f"{on['draft_tokens']} drafted, {on['steps']} steps with the prefill, "
                  f"{on['decode_tok_s'] / wl['off'][0]['decode_tok_s']:.2f}x")
    plain_ms = (sum(step(0, len(prompt) + i) + offset for i in range(1, len(output)))
                if step else None)
    print("| rule | decode steps | drafted | accepted | tokens per step | estimated speedup |")
    print("|---|--:|--:|--:|--:|--:|")
    variants = [("as shipped (K = 5, n = 2..4, adaptive)", {})]
    variants += [(f"K = {k}", {"k_max": k}) for k in (2, 3, 4, 6, 8)]
    variants += [("not adaptive", {"adaptive": False}),
                 ("n = 2..8", {"max_n": 8}),
                 ("n = 2..16", {"max_n": 16}),
                 ("no block-room cap", {"block": 1 << 30}),
                 ("oracle drafts (the recorded answer itself)", {"oracle": True})]
    for name, kw in variants:
        n_steps, drafted, accepted, steps = replay(prompt, output, **kw)
        est = ""
        if step:
            t = sum(step(k, p) + offset for k, p in steps)
            est = f"{plain_ms / t:.2f}x"
        print(f"| {name} | {n_steps} | {drafted} | {accepted} | "
              f"{len(output) / n_steps:.2f} | {est} |")


if __name__ == "__main__":
    main()
