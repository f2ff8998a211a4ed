//! Paged attention over the KV block arena of one layer (layout: `crate::formats::kv`).
//!
//! K/V are read in place (no gather, no repeat_kv): every K/V row is loaded once per query
//! token and used for all query heads of its GQA group, with an online (streaming) softmax
//! over chunks of positions. This module is the driver: it splits the work into (token
//! tile, kv group, context segment) items over the pool, runs the active level's kernel on
//! each (`crate::micro`), and merges and normalises the partial results.

pub use crate::formats::kv::{KvElem, PagedAttnArgs};

use crate::error::KernelError;
use crate::isa::{self, Isa};
use crate::micro::{self, scalar};
use crate::pool::ThreadPool;
use crate::util::SendPtr;

/// Positions per context segment. Every query row's context is split at the multiples of
/// `SEGMENT` (a multiple of the kernels' softmax chunk); each segment is an online softmax of
/// its own, and the segments are merged in position order with the log-sum-exp rule. The
/// split depends on positions only, never on the thread count, the batch or the tile a token
/// is computed in, so batch-1 decode (segments spread over the threads, flash-decoding), a
/// sequence of a batch (segments one after another) and a row of a prefill tile all get the
/// same bits. A context of at most one segment is not merged at all.
pub const SEGMENT: usize = 128;

const _: () = assert!(SEGMENT.is_multiple_of(micro::CHUNK));

thread_local! {
    /// Reused partial-result buffers (a decode step makes thousands of calls).
    static PARTS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Run `f` on a per-thread buffer of `len` floats (contents unspecified).
fn with_parts<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut b = PARTS.take();
    if b.len() < len {
        b.resize(len, 0.0);
    }
    let r = f(&mut b[..len]);
    PARTS.set(b);
    r
}

/// Segment `s` of a context ending at `end` (exclusive).
fn segment(s: usize, end: usize) -> (usize, usize) {
    ((s * SEGMENT).min(end), ((s + 1) * SEGMENT).min(end))
}

/// The first position query token `t` sees: `p + 1 - window` (at least 0) for a sliding
/// window, 0 without one.
fn window_start(a: &PagedAttnArgs, t: usize) -> usize {
    if a.window == 0 {
        0
    } else {
        (a.start_pos + t + 1).saturating_sub(a.window)
    }
}

/// Marks every `[m, l, acc]` row of `part` empty (no position seen; the merge skips it).
fn empty_rows(part: &mut [f32], hd: usize) {
    for row in part.chunks_exact_mut(hd + 2) {
        row.fill(0.0);
        row[0] = f32::NEG_INFINITY;
    }
}

/// Pool items per thread where a context's segments are spread over the pool. An item is a
/// run of consecutive segments, computed in order: the kernel's next-chunk prefetch carries
/// from each segment into the next, so only a run's first chunk would start on cold DRAM
/// reads, and the driver prefetches that one as the item starts. Two runs a thread keep the
/// load balanced when a thread is held up. The split changes no bits (the same segments,
/// merged in the same order).
const RUNS_PER_THREAD: usize = 2;

/// The segments of run `r` of `runs` over `nseg` segments (`runs <= nseg`: none is empty).
fn run_segments(r: usize, runs: usize, nseg: usize) -> std::ops::Range<usize> {
    r * nseg / runs..(r + 1) * nseg / runs
}

/// `q: [n_tokens][n_heads][head_dim]`; query token `i` sits at position `start_pos + i` and
/// attends to positions `0..=start_pos + i` (with a sliding window `W`, only the last `W` of
/// them). Writes `out: [n_tokens][n_heads][head_dim]`.
///
/// With a window, every query token runs alone over its own range of each segment (the range
/// clipped at its window's start, so a window starting mid-segment masks within it): the
/// same calls on the same ranges whether the token is decoded alone or is a row of a prefill
/// chunk, hence the same bits.
///
/// Panics if the arguments are inconsistent (slice lengths, block table too short, head
/// counts not divisible) — these are programmer errors in the caller.
pub fn paged_attention<T: KvElem>(
    args: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    out: &mut [f32],
) {
    check_args(args, q, k, v, out);
    let isa = isa::active();
    let qt = tile_tokens(args);
    let mut t = 0;
    while t < args.n_tokens {
        let nq = qt.min(args.n_tokens - t);
        // A decode token: every group in one pass over the positions (SIMD levels).
        if nq > 1 || !attend_token_all_groups(isa, args, q, k, v, t, out) {
            for g in 0..args.n_kv_heads {
                attend_tile(isa, args, q, k, v, (t, nq), g, out);
            }
        }
        t += nq;
    }
}

/// Tokens `t..t + nq` against kv group `g`: every segment, merged and normalised into `out`.
#[allow(clippy::too_many_arguments)]
fn attend_tile<T: KvElem>(
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    (t, nq): (usize, usize),
    g: usize,
    out: &mut [f32],
) {
    let len = nq * (a.n_heads / a.n_kv_heads) * (a.head_dim + 2);
    let end = a.start_pos + t + nq;
    let nseg = end.div_ceil(SEGMENT).max(1);
    let extra = if nseg > 1 { len } else { 0 };
    with_parts(len * nseg + extra, |buf| {
        let (parts, merged) = buf.split_at_mut(len * nseg);
        for (s, part) in parts.chunks_exact_mut(len).enumerate() {
            attend_part(isa, a, q, k, v, (t, nq), g, segment(s, end), end, part);
        }
        if nseg == 1 {
            finalize(a, parts, (t, nq), g, out);
        } else {
            merge(parts, nseg, a.head_dim, merged);
            finalize(a, merged, (t, nq), g, out);
        }
    });
}

/// Token `t` against every kv group in one pass per segment (SIMD only), merged and
/// normalised into `out`; false (nothing written) if the kernel does not take the shape.
#[allow(clippy::too_many_arguments)]
fn attend_token_all_groups<T: KvElem>(
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    t: usize,
    out: &mut [f32],
) -> bool {
    let stride = (a.n_heads / a.n_kv_heads) * (a.head_dim + 2);
    let len = a.n_kv_heads * stride;
    let end = a.start_pos + t + 1;
    let nseg = end.div_ceil(SEGMENT).max(1);
    let extra = if nseg > 1 { len } else { 0 };
    with_parts(len * nseg + extra, |buf| {
        let (parts, merged) = buf.split_at_mut(len * nseg);
        for (s, part) in parts.chunks_exact_mut(len).enumerate() {
            if !attend_all_groups(isa, a, q, k, v, t, segment(s, end), end, part) {
                return false;
            }
        }
        let res: &[f32] = if nseg == 1 {
            parts
        } else {
            merge(parts, nseg, a.head_dim, merged);
            merged
        };
        for g in 0..a.n_kv_heads {
            finalize(a, &res[g * stride..], (t, 1), g, out);
        }
        true
    })
}

/// Token `t` against every kv group in one pass (SIMD only), prefetching ahead up to `pf_end`
/// (see [`micro::attend_groups`]); false if not handled.
#[allow(clippy::too_many_arguments)]
fn attend_all_groups<T: KvElem>(
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    t: usize,
    range: (usize, usize),
    pf_end: usize,
    part: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if a.n_kv_heads > 1 && isa >= Isa::Avx2 {
        let range = (range.0.max(window_start(a, t)), range.1);
        if range.0 >= range.1 {
            empty_rows(part, a.head_dim);
            return true;
        }
        let groups = (0, a.n_kv_heads);
        return micro::attend_groups(isa, a, q, k, v, (t, 1), groups, range, pf_end, part);
    }
    let _ = (isa, a, q, k, v, t, range, pf_end, part);
    false
}

/// Most floats of partial results the few-token paths hold at once (4 MiB): the default
/// model's decode token and 5 drafts at 32,768 positions take 0.9 M; a model with 64 heads of
/// 128 takes its kv groups in rounds there (a decode token beyond 16,384 positions too).
const MAX_PARTS: usize = 1 << 20;

/// Up to this many tokens over several segments, each token runs the decode kernel (every kv
/// group in one pass over f16 K/V read in place); more share one tile pass per group (K/V
/// converted to f32 once per chunk for all rows). Measured (`examples/perf` DRAFT_ATTN, two
/// threads, default model shape, 1,044 positions, one layer): 2 tokens 45 µs as decode tokens
/// against 52 as a tile, 3 tokens 66-70 against 68-73, 4 tokens 85-87 against 82-87.
const FEW_TOKENS: usize = 3;

/// Query tokens processed together per K/V pass (rows = tokens × group size <= 64); one
/// under a sliding window (each token's range has its own start).
fn tile_tokens(a: &PagedAttnArgs) -> usize {
    if a.window > 0 {
        return 1;
    }
    (64 / (a.n_heads / a.n_kv_heads).max(1)).clamp(1, 8)
}

/// Like [`paged_attention`] (the same bits), parallel over `pool`: a decode token (or up to a
/// tile of tokens) over a context of several segments is spread over the threads by segment
/// (flash-decoding), each item attending with all kv groups in one pass ([`tokens_segments`];
/// per kv group where that kernel does not take the shape, [`tile_segments`]); otherwise the
/// work items are (token tile, kv group) pairs.
pub fn paged_attention_parallel<T: KvElem>(
    pool: &ThreadPool,
    args: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    out: &mut [f32],
) {
    let a = args;
    let nt = pool.n_threads();
    if nt == 1 {
        return paged_attention(a, q, k, v, out);
    }
    check_args(a, q, k, v, out);
    let isa = isa::active();
    let end = a.start_pos + a.n_tokens;
    let nseg = end.div_ceil(SEGMENT).max(1);
    // Tiles of query tokens (fewer when that would leave threads idle).
    let mut qt = tile_tokens(a);
    if a.n_tokens <= qt && nseg > 1 {
        // A decode token, or a few tokens over a long context (a decode token with its
        // drafts): the context's segments spread over the threads (flash-decoding), every
        // token in each item (so each segment's K/V is read once for all of them).
        if a.n_tokens <= FEW_TOKENS && tokens_segments(pool, isa, a, q, k, v, nseg, out) {
            return;
        }
        return tile_segments(pool, isa, a, q, k, v, nseg, MAX_PARTS, out);
    }
    while qt > 1 && a.n_tokens.div_ceil(qt) * a.n_kv_heads < 2 * nt {
        qt /= 2;
    }
    let n_tiles = a.n_tokens.div_ceil(qt);
    let op = SendPtr(out.as_mut_ptr());
    let out_len = out.len();
    pool.parallel_for(n_tiles * a.n_kv_heads, &|item| {
        let (tile, g) = (item / a.n_kv_heads, item % a.n_kv_heads);
        let t = tile * qt;
        let nq = qt.min(a.n_tokens - t);
        // SAFETY: item (tile, g) writes only its tokens' rows of the heads of group g,
        // which are disjoint across items; `out` outlives the parallel_for.
        let out = unsafe { std::slice::from_raw_parts_mut(op.get(), out_len) };
        attend_tile(isa, a, q, k, v, (t, nq), g, out);
    });
}

/// The `n_tokens` query tokens as one tile over `nseg` segments, one item per (segment, kv
/// group) spread over the pool, merged per group as [`paged_attention`] merges a tile's
/// segments (the same calls on the same ranges, so the same bits as each token alone). The
/// groups go in rounds whose partial results fit `max_parts` floats (all in one where they do).
#[allow(clippy::too_many_arguments)]
fn tile_segments<T: KvElem>(
    pool: &ThreadPool,
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    nseg: usize,
    max_parts: usize,
    out: &mut [f32],
) {
    let nkv = a.n_kv_heads;
    let nq = a.n_tokens;
    // One group's rows of one segment: [token][head of the group][m, l, acc].
    let glen = nq * (a.n_heads / nkv) * (a.head_dim + 2);
    let end = a.start_pos + nq;
    // Groups per round: all of them unless their parts would pass `max_parts`.
    let per_round = (max_parts / (glen * nseg)).clamp(1, nkv);
    // Parts laid out [kv group of the round][segment][rows], then one merged group.
    with_parts(glen * (per_round * nseg + 1), |buf| {
        let (parts, merged) = buf.split_at_mut(glen * per_round * nseg);
        let pp = SendPtr(parts.as_mut_ptr());
        for g0 in (0..nkv).step_by(per_round) {
            let ng = per_round.min(nkv - g0);
            // Items: (group, segment) pairs. Runs of segments (as `tokens_segments` takes)
            // gave this compute-bound tile nothing in `examples/perf` and cost it 0-5 % in
            // served steps (coarser balance): each item prefetches within its segment only.
            pool.parallel_for(nseg * ng, &|item| {
                let (g, s) = (item / nseg, item % nseg);
                // SAFETY: each (group, segment) owns the disjoint slice `item * glen..` of
                // `glen`.
                let part =
                    unsafe { std::slice::from_raw_parts_mut(pp.get().add(item * glen), glen) };
                let range = segment(s, end);
                attend_part(isa, a, q, k, v, (0, nq), g0 + g, range, range.1, part);
            });
            for (g, group) in parts.chunks_exact(glen * nseg).take(ng).enumerate() {
                merge(group, nseg, a.head_dim, merged);
                finalize(a, merged, (0, nq), g0 + g, out);
            }
        }
    });
}

/// Each of the `n_tokens` query tokens as a decode token (all kv groups in one pass), one item
/// per run of consecutive segments ([`RUNS_PER_THREAD`]) for all of them, merged per token:
/// each token gets what its own decode step computes (the same kernel on the same segments; a
/// segment past a token's causal end is empty, which the merge skips). False (nothing
/// written) if the kernel does not take the shape (scalar level, a single kv group) or its
/// partial results would pass [`MAX_PARTS`].
#[allow(clippy::too_many_arguments)]
fn tokens_segments<T: KvElem>(
    pool: &ThreadPool,
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    nseg: usize,
    out: &mut [f32],
) -> bool {
    let nkv = a.n_kv_heads;
    let nq = a.n_tokens;
    let stride = (a.n_heads / nkv) * (a.head_dim + 2);
    // One token's rows: [group][head][m, l, acc].
    let tlen = nkv * stride;
    let slen = nq * tlen;
    if slen * nseg > MAX_PARTS {
        return false;
    }
    with_parts(slen * nseg + tlen, |buf| {
        let (parts, merged) = buf.split_at_mut(slen * nseg);
        let pp = SendPtr(parts.as_mut_ptr());
        let all_done = std::sync::atomic::AtomicBool::new(true);
        let end = a.start_pos + nq;
        // Items: runs of consecutive segments, enough for every thread.
        let runs = nseg.min(RUNS_PER_THREAD * pool.n_threads());
        pool.parallel_for(runs, &|r| {
            let segs = run_segments(r, runs, nseg);
            let run_end = segment(segs.end - 1, end).1;
            prefetch_rows(a, k, v, segment(segs.start, end).0, micro::CHUNK);
            for s in segs {
                // SAFETY: each segment owns the disjoint slice `s * slen..` of `slen`, and
                // each is in exactly one run.
                let seg = unsafe { std::slice::from_raw_parts_mut(pp.get().add(s * slen), slen) };
                for (t, part) in seg.chunks_exact_mut(tlen).enumerate() {
                    let (p0, p1) = segment(s, a.start_pos + t + 1);
                    if p0.max(window_start(a, t)) >= p1 {
                        empty_rows(part, a.head_dim);
                    } else if !attend_all_groups(isa, a, q, k, v, t, (p0, p1), run_end, part) {
                        all_done.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
        });
        if !all_done.into_inner() {
            return false;
        }
        for t in 0..nq {
            merge_strided(&parts[t * tlen..], nseg, slen, a.head_dim, merged);
            for gi in 0..nkv {
                finalize(a, &merged[gi * stride..], (t, 1), gi, out);
            }
        }
        true
    })
}

/// Merge per-segment partial results (`parts`: `nseg` runs of `dst.len()` floats, each row
/// `[m, l, acc[hd]]`) with the log-sum-exp rule, in segment order, into `dst`.
fn merge(parts: &[f32], nseg: usize, hd: usize, dst: &mut [f32]) {
    merge_strided(parts, nseg, dst.len(), hd, dst);
}

/// [`merge`] with segment `s`'s partial results at `parts[s * stride..]`.
fn merge_strided(parts: &[f32], nseg: usize, stride: usize, hd: usize, dst: &mut [f32]) {
    let w = hd + 2;
    for r in 0..dst.len() / w {
        let mut m = f32::NEG_INFINITY;
        for s in 0..nseg {
            m = m.max(parts[s * stride + r * w]);
        }
        let d = &mut dst[r * w..(r + 1) * w];
        d[2..].fill(0.0);
        let mut l = 0f32;
        for s in 0..nseg {
            let p = &parts[s * stride + r * w..][..w];
            if p[0] == f32::NEG_INFINITY {
                continue; // empty segment (the row's causal end is before it)
            }
            let wt = (p[0] - m).exp();
            l += p[1] * wt;
            for (o, x) in d[2..].iter_mut().zip(&p[2..]) {
                *o += x * wt;
            }
        }
        d[0] = m;
        d[1] = l;
    }
}

/// Normalise a partial result (`[m, l, acc[hd]]` per head) into `out`.
fn finalize(a: &PagedAttnArgs, part: &[f32], (t0, nq): (usize, usize), g: usize, out: &mut [f32]) {
    let hd = a.head_dim;
    let gs = a.n_heads / a.n_kv_heads;
    for ti in 0..nq {
        for h in 0..gs {
            let p = &part[(ti * gs + h) * (hd + 2)..][..hd + 2];
            let inv = if p[1] > 0.0 { 1.0 / p[1] } else { 0.0 };
            let o = &mut out[((t0 + ti) * a.n_heads + g * gs + h) * hd..][..hd];
            for (o, x) in o.iter_mut().zip(&p[2..]) {
                *o = x * inv;
            }
        }
    }
}

/// Validate [`PagedAttnArgs`] against the slices (what [`paged_attention`] asserts).
pub fn validate_args<T>(
    args: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    out: &[f32],
) -> Result<(), KernelError> {
    let a = args;
    let bad = |s: String| Err(KernelError::InvalidShape(s));
    if a.n_kv_heads == 0 || !a.n_heads.is_multiple_of(a.n_kv_heads) {
        return bad(format!(
            "n_heads {} is not a multiple of n_kv_heads {}",
            a.n_heads, a.n_kv_heads
        ));
    }
    if a.block_size == 0 || a.head_dim == 0 {
        return bad("block_size and head_dim must be > 0".into());
    }
    let qn = a.n_tokens * a.n_heads * a.head_dim;
    if q.len() < qn {
        return Err(KernelError::SizeMismatch {
            what: "q",
            expected: qn,
            got: q.len(),
        });
    }
    if out.len() < qn {
        return Err(KernelError::SizeMismatch {
            what: "out",
            expected: qn,
            got: out.len(),
        });
    }
    let ctx = a.start_pos + a.n_tokens;
    let nblk = ctx.div_ceil(a.block_size);
    if a.block_table.len() < nblk {
        return Err(KernelError::SizeMismatch {
            what: "block_table",
            expected: nblk,
            got: a.block_table.len(),
        });
    }
    let blk = a.block_size * a.n_kv_heads * a.head_dim;
    if let Some(max_b) = a.block_table[..nblk].iter().copied().max() {
        let need = (max_b as usize + 1) * blk;
        if k.len() < need || v.len() < need {
            return Err(KernelError::SizeMismatch {
                what: "K/V arena",
                expected: need,
                got: k.len().min(v.len()),
            });
        }
    }
    Ok(())
}

fn check_args<T>(args: &PagedAttnArgs, q: &[f32], k: &[T], v: &[T], out: &[f32]) {
    if let Err(e) = validate_args(args, q, k, v, out) {
        panic!("paged_attention: {e}");
    }
}

/// [`paged_attention`] returning an error instead of panicking on inconsistent arguments.
pub fn try_paged_attention<T: KvElem>(
    args: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    out: &mut [f32],
) -> Result<(), KernelError> {
    validate_args(args, q, k, v, out)?;
    paged_attention(args, q, k, v, out);
    Ok(())
}

/// Partial attention of all query heads in kv group `g` for query tokens `t0..t0 + nq` over
/// positions `p0..p1` (the SIMD kernels prefetching ahead up to `pf_end`): writes
/// `[m, l, acc[head_dim]]` per (token, head) into `part`.
#[allow(clippy::too_many_arguments)]
fn attend_part<T: KvElem>(
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    (t0, nq): (usize, usize),
    g: usize,
    range: (usize, usize),
    pf_end: usize,
    part: &mut [f32],
) {
    // Without a window all the tokens share the range (the kernel masks each one's causal
    // end); with one, each token gets its own range below.
    let windowed = a.window > 0;
    #[cfg(target_arch = "x86_64")]
    if !windowed
        && isa >= Isa::Avx2
        && micro::attend_groups(isa, a, q, k, v, (t0, nq), (g, 1), range, pf_end, part)
    {
        return;
    }
    // One token at a time (SIMD single-token kernel if available, else portable).
    let stride = (a.n_heads / a.n_kv_heads) * (a.head_dim + 2);
    for ti in 0..nq {
        let t = t0 + ti;
        let r = (
            range.0.max(window_start(a, t)),
            range.1.min(a.start_pos + t + 1),
        );
        let p = &mut part[ti * stride..(ti + 1) * stride];
        if windowed && r.0 >= r.1 {
            empty_rows(p, a.head_dim);
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if (nq > 1 || windowed)
            && isa >= Isa::Avx2
            && micro::attend_groups(isa, a, q, k, v, (t, 1), (g, 1), r, pf_end, p)
        {
            continue;
        }
        scalar::attend_part(a, q, k, v, t, g, r, p);
    }
    let _ = (isa, pf_end);
}

/// Prefetch into the cache the K/V rows of positions `0..n` (capped at the context end) of a
/// decode token's context: the batched decode path calls it for the next sequence while it
/// computes the current one, so that the first chunk of every call does not start on a cold
/// DRAM read (the kernel prefetches each further chunk while it computes the one before).
/// A hint only: it reads nothing and cannot fault.
pub fn prefetch_context<T: KvElem>(a: &PagedAttnArgs, k: &[T], v: &[T], n: usize) {
    prefetch_rows(a, k, v, window_start(a, 0), n);
}

/// Prefetch the K/V rows of positions `p0..p0 + n` (capped at the context end), one range
/// per block. A hint only: it reads nothing and cannot fault.
fn prefetch_rows<T: KvElem>(a: &PagedAttnArgs, k: &[T], v: &[T], p0: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = (p0 + n).min(a.start_pos + a.n_tokens);
        let row = a.n_kv_heads * a.head_dim * std::mem::size_of::<T>();
        let (kb, vb) = (k.as_ptr() as *const u8, v.as_ptr() as *const u8);
        let mut p = p0;
        while p < end && a.block_size > 0 {
            let (blk, slot) = (p / a.block_size, p % a.block_size);
            let Some(&b) = a.block_table.get(blk) else {
                return;
            };
            let run = (a.block_size - slot).min(end - p);
            let off = (b as usize * a.block_size + slot) * row;
            // Into L1 (`prefetch_lines` is L2): into L2 measured within noise here.
            micro::prefetch_lines_to::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                kb.wrapping_add(off),
                run * row,
            );
            micro::prefetch_lines_to::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                vb.wrapping_add(off),
                run * row,
            );
            p += run;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (a, k, v, p0, n);
}

/// Naive reference: gathers the context (the window's part of it, with a window) and computes
/// softmax(q·Kᵀ·scale)·V per head.
pub fn attention_reference<T: KvElem>(
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    out: &mut [f32],
) {
    let hd = a.head_dim;
    let gs = a.n_heads / a.n_kv_heads;
    let row = a.n_kv_heads * hd;
    for t in 0..a.n_tokens {
        let ctx = a.start_pos + t + 1;
        let lo = window_start(a, t);
        for h in 0..a.n_heads {
            let g = h / gs;
            let qh = &q[(t * a.n_heads + h) * hd..][..hd];
            let pos_off = |p: usize| {
                (a.block_table[p / a.block_size] as usize * a.block_size + p % a.block_size) * row
                    + g * hd
            };
            let scores: Vec<f64> = (lo..ctx)
                .map(|p| {
                    let kr = &k[pos_off(p)..][..hd];
                    qh.iter()
                        .zip(kr)
                        .map(|(x, y)| *x as f64 * y.to_f32() as f64)
                        .sum::<f64>()
                        * a.scale as f64
                })
                .collect();
            let mx = scores.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
            let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            let o = &mut out[(t * a.n_heads + h) * hd..][..hd];
            for (dd, o) in o.iter_mut().enumerate() {
                let mut acc = 0f64;
                for (p, w) in (lo..ctx).zip(&e) {
                    acc += w * v[pos_off(p) + dd].to_f32() as f64;
                }
                *o = (acc / z) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// The runs of segments a parallel call hands out cover every segment exactly once, in
    /// order, none empty, and at most one segment apart in length.
    #[test]
    fn runs_cover_every_segment_once_in_order() {
        for nseg in 1..40 {
            for runs in 1..=nseg {
                let all: Vec<std::ops::Range<usize>> =
                    (0..runs).map(|r| run_segments(r, runs, nseg)).collect();
                let flat: Vec<usize> = all.iter().flat_map(|r| r.clone()).collect();
                assert_eq!(flat, (0..nseg).collect::<Vec<_>>(), "{nseg} {runs}");
                let lens: Vec<usize> = all.iter().map(|r| r.len()).collect();
                let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
                assert!(*lo >= 1 && *hi <= lo + 1, "{nseg} {runs}: {lens:?}");
            }
        }
    }

    /// The few-token tile path gives [`paged_attention`]'s bits whether its kv groups go in one
    /// round or one at a time, on 2 and 3 threads (the memory bound `MAX_PARTS` makes rounds
    /// only for large models at long contexts, too slow for a test; here the bound is lowered).
    #[test]
    fn tile_segments_in_rounds_equal_the_sequential_tile() {
        for threads in [2, 3] {
            tile_segments_in_rounds(threads);
        }
    }

    fn tile_segments_in_rounds(threads: usize) {
        let pool = ThreadPool::new(threads);
        let (nh, nkv, hd, bs, start, n) = (9usize, 3usize, 64usize, 16usize, 700usize, 5usize);
        let ctx = start + n;
        let nblk = ctx.div_ceil(bs);
        let table: Vec<u32> = (0..nblk as u32).rev().collect();
        let len = nblk * bs * nkv * hd;
        let kv = |m: usize| -> Vec<f16> {
            (0..len)
                .map(|i| f16::from_f32(((i * m) % 1013) as f32 / 506.0 - 1.0))
                .collect()
        };
        let (k, v) = (kv(7919), kv(104_729));
        let q: Vec<f32> = (0..n * nh * hd)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let a = PagedAttnArgs {
            block_table: &table,
            block_size: bs,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            start_pos: start,
            n_tokens: n,
            scale: 0.125,
            window: 0,
        };
        let mut want = vec![0f32; n * nh * hd];
        paged_attention(&a, &q, &k, &v, &mut want);
        let nseg = ctx.div_ceil(SEGMENT);
        let glen = n * (nh / nkv) * (hd + 2);
        for max_parts in [usize::MAX, glen * nseg * 2, 1] {
            let mut got = vec![0f32; n * nh * hd];
            tile_segments(
                &pool,
                isa::active(),
                &a,
                &q,
                &k,
                &v,
                nseg,
                max_parts,
                &mut got,
            );
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{threads} threads, max_parts {max_parts}"
            );
        }
    }
}
