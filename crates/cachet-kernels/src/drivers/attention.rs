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

/// `q: [n_tokens][n_heads][head_dim]`; query token `i` sits at position `start_pos + i` and
/// attends to positions `0..=start_pos + i`. Writes `out: [n_tokens][n_heads][head_dim]`.
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
    let gs = args.n_heads / args.n_kv_heads;
    let qt = tile_tokens(gs);
    let stride = gs * (args.head_dim + 2);
    let mut part = vec![0f32; qt.max(1) * stride * args.n_kv_heads];
    let mut t = 0;
    while t < args.n_tokens {
        let nq = qt.min(args.n_tokens - t);
        let range = (0, args.start_pos + t + nq);
        if nq == 1 && attend_all_groups(isa, args, q, k, v, t, range, &mut part) {
            // A decode token: every group in one pass over the positions.
            for g in 0..args.n_kv_heads {
                finalize(args, &part[g * stride..], (t, 1), g, out);
            }
        } else {
            for g in 0..args.n_kv_heads {
                attend_part(isa, args, q, k, v, (t, nq), g, range, &mut part);
                finalize(args, &part, (t, nq), g, out);
            }
        }
        t += nq;
    }
}

/// Token `t` against every kv group in one pass (SIMD only); false if not handled.
#[allow(clippy::too_many_arguments)]
fn attend_all_groups<T: KvElem>(
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    t: usize,
    range: (usize, usize),
    part: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if a.n_kv_heads > 1 && isa >= Isa::Avx2 {
        return micro::attend_groups(isa, a, q, k, v, (t, 1), (0, a.n_kv_heads), range, part);
    }
    let _ = (isa, a, q, k, v, t, range, part);
    false
}

/// Query tokens processed together per K/V pass (rows = tokens × group size <= 64).
fn tile_tokens(gs: usize) -> usize {
    (64 / gs.max(1)).clamp(1, 8)
}

/// Positions per context segment below which decode attention is not split further.
const MIN_SEGMENT: usize = 128;

/// Like [`paged_attention`], parallel over `pool`: work items are (token, kv head) pairs,
/// and when there are fewer of those than threads (batch-1 decode) each context is also
/// split into segments whose partial softmax results are merged (flash-decoding).
pub fn paged_attention_parallel<T: KvElem>(
    pool: &ThreadPool,
    args: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    out: &mut [f32],
) {
    check_args(args, q, k, v, out);
    let isa = isa::active();
    let a = args;
    let gs = a.n_heads / a.n_kv_heads;
    let stride = gs * (a.head_dim + 2);
    let pairs = a.n_tokens * a.n_kv_heads;
    let nt = pool.n_threads();
    let ctx_max = a.start_pos + a.n_tokens;
    let segs = if pairs >= 2 * nt || nt == 1 {
        1
    } else {
        (2 * nt).div_ceil(pairs).min(ctx_max / MIN_SEGMENT).max(1)
    };
    if segs == 1 {
        // Tiles of query tokens (fewer when that would leave threads idle).
        let mut qt = tile_tokens(gs);
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
            let mut part = vec![0f32; nq * stride];
            let range = (0, a.start_pos + t + nq);
            attend_part(isa, a, q, k, v, (t, nq), g, range, &mut part);
            // SAFETY: item (tile, g) writes only its tokens' rows of the heads of group g,
            // which are disjoint across items; `out` outlives the parallel_for.
            let out = unsafe { std::slice::from_raw_parts_mut(op.get(), out_len) };
            finalize(a, &part, (t, nq), g, out);
        });
        return;
    }
    if a.n_tokens == 1 && a.n_kv_heads > 1 && isa >= Isa::Avx2 {
        if let Some((parts, segs)) = decode_segments_all_groups(pool, isa, a, q, k, v) {
            let nkv = a.n_kv_heads;
            let at = |g: usize, seg: usize| (seg * nkv + g) * stride;
            return merge_segments(a, &parts, nkv, segs, at, out);
        }
    }
    let mut parts = vec![0f32; pairs * segs * stride];
    let pp = SendPtr(parts.as_mut_ptr());
    pool.parallel_for(pairs * segs, &|item| {
        let (pair, seg) = (item / segs, item % segs);
        let (t, g) = (pair / a.n_kv_heads, pair % a.n_kv_heads);
        let ctx = a.start_pos + t + 1;
        let len = ctx.div_ceil(segs);
        let p0 = (seg * len).min(ctx);
        let p1 = ((seg + 1) * len).min(ctx);
        // SAFETY: each item owns the disjoint slice `item * stride..(item + 1) * stride`.
        let part = unsafe { std::slice::from_raw_parts_mut(pp.get().add(item * stride), stride) };
        attend_part(isa, a, q, k, v, (t, 1), g, (p0, p1), part);
    });
    merge_segments(
        a,
        &parts,
        pairs,
        segs,
        |pair, seg| (pair * segs + seg) * stride,
        out,
    );
}

/// Batch-1 decode over context segments, each item attending with all kv groups in one pass
/// (one stream over each position's K/V row). Returns the partial results, laid out
/// `[segment][kv group][rows of the group]`, and the segment count; `None` when the SIMD kernel
/// does not take the shape or there is only one segment.
fn decode_segments_all_groups<T: KvElem>(
    pool: &ThreadPool,
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
) -> Option<(Vec<f32>, usize)> {
    let ctx = a.start_pos + 1;
    let segs = (2 * pool.n_threads()).min(ctx / MIN_SEGMENT);
    if segs < 2 {
        return None;
    }
    let span = a.n_kv_heads * (a.n_heads / a.n_kv_heads) * (a.head_dim + 2);
    let len = ctx.div_ceil(segs);
    let mut parts = vec![0f32; segs * span];
    let all_done = std::sync::atomic::AtomicBool::new(true);
    let pp = SendPtr(parts.as_mut_ptr());
    pool.parallel_for(segs, &|seg| {
        let p0 = (seg * len).min(ctx);
        let p1 = ((seg + 1) * len).min(ctx);
        // SAFETY: each segment owns the disjoint slice `seg * span..(seg + 1) * span`.
        let part = unsafe { std::slice::from_raw_parts_mut(pp.get().add(seg * span), span) };
        if !attend_all_groups(isa, a, q, k, v, 0, (p0, p1), part) {
            all_done.store(false, std::sync::atomic::Ordering::Relaxed);
        }
    });
    all_done.into_inner().then_some((parts, segs))
}

/// Merge per-segment partial results (`parts[at(pair, seg)..]`, pair = token × kv head) with
/// the log-sum-exp rule and normalise them into `out`.
fn merge_segments(
    a: &PagedAttnArgs,
    parts: &[f32],
    pairs: usize,
    segs: usize,
    at: impl Fn(usize, usize) -> usize,
    out: &mut [f32],
) {
    let gs = a.n_heads / a.n_kv_heads;
    let hd = a.head_dim;
    let stride = gs * (hd + 2);
    let mut merged = vec![0f32; stride];
    for pair in 0..pairs {
        let (t, g) = (pair / a.n_kv_heads, pair % a.n_kv_heads);
        for h in 0..gs {
            let mut m = f32::NEG_INFINITY;
            for seg in 0..segs {
                m = m.max(parts[at(pair, seg) + h * (hd + 2)]);
            }
            let (mut l, mo) = (0f32, h * (hd + 2));
            merged[mo + 2..mo + 2 + hd]
                .iter_mut()
                .for_each(|x| *x = 0.0);
            for seg in 0..segs {
                let p = &parts[at(pair, seg) + mo..][..hd + 2];
                if p[0] == f32::NEG_INFINITY {
                    continue; // empty segment
                }
                let w = (p[0] - m).exp();
                l += p[1] * w;
                for (o, x) in merged[mo + 2..mo + 2 + hd].iter_mut().zip(&p[2..]) {
                    *o += x * w;
                }
            }
            merged[mo] = m;
            merged[mo + 1] = l;
        }
        finalize(a, &merged, (t, 1), g, out);
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

/// Partial attention of all query heads in kv group `g` for query token `t` over positions
/// `p0..p1`: writes `[m, l, acc[head_dim]]` per head into `part`.
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
    part: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && micro::attend_groups(isa, a, q, k, v, (t0, nq), (g, 1), range, part) {
        return;
    }
    // One token at a time (SIMD single-token kernel if available, else portable).
    let stride = (a.n_heads / a.n_kv_heads) * (a.head_dim + 2);
    for ti in 0..nq {
        let t = t0 + ti;
        let r = (range.0, range.1.min(a.start_pos + t + 1));
        let p = &mut part[ti * stride..(ti + 1) * stride];
        #[cfg(target_arch = "x86_64")]
        if nq > 1 && isa >= Isa::Avx2 && micro::attend_groups(isa, a, q, k, v, (t, 1), (g, 1), r, p)
        {
            continue;
        }
        scalar::attend_part(a, q, k, v, t, g, r, p);
    }
    let _ = isa;
}

/// Naive reference: gathers the context and computes softmax(q·Kᵀ·scale)·V per head.
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
        for h in 0..a.n_heads {
            let g = h / gs;
            let qh = &q[(t * a.n_heads + h) * hd..][..hd];
            let pos_off = |p: usize| {
                (a.block_table[p / a.block_size] as usize * a.block_size + p % a.block_size) * row
                    + g * hd
            };
            let scores: Vec<f64> = (0..ctx)
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
                for (p, w) in e.iter().enumerate() {
                    acc += w * v[pos_off(p) + dd].to_f32() as f64;
                }
                *o = (acc / z) as f32;
            }
        }
    }
}
