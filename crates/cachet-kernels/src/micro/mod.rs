//! Micro-kernels: one module per instruction-set level, each depending only on the formats
//! (`crate::formats`) and the ISA primitives (`crate::isa`), never on the drivers above.
//!
//! * [`scalar`]: the portable reference of every kernel (any CPU; the tests compare every
//!   other level with it).
//! * `avx2`, `avx2_tile`: AVX2 + FMA + F16C (x86-64-v3); the matmul tile also in an AVX-VNNI
//!   variant (`vpdpbusd` on 256-bit registers) for the `Avx2Vnni` level.
//! * `avx512`: AVX-512 F/BW/VL/DQ with VNNI (`vpdpbusd`).
//! * `amx`: AMX tiles (`tdpbsud`), with the AVX-512 block fold of `avx512`, for matmuls of 8+
//!   activation rows.
//!
//! This module holds the contracts between the drivers and the kernels (the tile job, the
//! attention context) and the per-call dispatch on the active [`Isa`]. Every
//! `#[target_feature]` function is only called after the corresponding level was detected
//! (callers pass `isa::active()`, which never exceeds `isa::detected()`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_attn;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_tile;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_attn;
#[cfg(target_arch = "x86_64")]
pub(crate) mod peak;
pub(crate) mod scalar;

#[cfg(target_arch = "x86_64")]
use std::any::TypeId;

use crate::formats::act::QAct;
#[cfg(target_arch = "x86_64")]
use crate::formats::kv::{KvElem, PagedAttnArgs};
use crate::formats::packed::{PFmt, Packed};
#[cfg(target_arch = "x86_64")]
use crate::formats::packed::{FIQ4XS, FQ2K, FQ4K, FQ4_0, FQ4_1, FQ5K, FQ5_0, FQ6K, FQ8_0};
use crate::isa::Isa;
use crate::util::SendPtr;
#[cfg(target_arch = "x86_64")]
use avx2_attn::attn_avx2;
#[cfg(target_arch = "x86_64")]
use avx2_tile::{tile_avx2, tile_avx2_vnni};
#[cfg(target_arch = "x86_64")]
use avx512::tile_512;
#[cfg(target_arch = "x86_64")]
use avx512_attn::attn_512;

/// Activation rows per tile of the AVX2 and scalar kernels (16 `ymm` registers hold 4 rows'
/// accumulators), and of the AVX-512 kernel on Q8_0 and on CPUs other than Intel's.
pub(crate) const MR: usize = 4;

/// Activation rows per tile of the AVX-512 kernel on the 4- and 6-bit formats on Intel CPUs:
/// each unpacked weight vector then serves 8 rows instead of 4 (8 rows × 2 groups are 16 int32
/// and 16 f32 accumulators, which with the operands exceed the 32 `zmm` registers a little).
/// Measured on an Intel Xeon (AMX, AVX-512 VNNI, 2 threads, `CACHET_ISA=avx512`, interleaved
/// against 4-row tiles; docs/bench-runs/2026-12-05-xeon-amx-kernel-vs-llama.md): the default model's matmul
/// set 8–20 % faster at m = 5 to 32 (`MODEL=… examples/perf`, 4 rounds, one of them
/// disturbed), Q4_0, Q4_1, Q4_K and Q6_K matrices 2–10 % faster at m = 16 and 512 on one
/// thread, but the Q8_0 lm_head 35–40 % slower at m = 16 (so Q8_0 keeps 4 rows); `cachet bench
/// kernel` decode batch 8 +2 to +14 % and batch 16 +2 to +5 % (5 of 5 pairs each), prefill
/// +5 % (3 of 4). On an AMD EPYC (Zen 5) an 8-row × 2-group tile measured 35–60 % slower at
/// m = 16 on 2026-12-01 (docs/bench-runs/2026-12-01-epyc-tiles-batch16.md), so other CPUs keep
/// 4 rows until measured.
pub(crate) const MR_512: usize = 8;

/// Activation rows per tile of the plain AVX2 kernel (`vpmaddubsw`, no AVX-VNNI) for the 4-bit
/// formats on Intel CPUs: the nibble unpack of each weight vector (two ANDs and a shift) and its
/// load serve 6 rows instead of 4, and m = 5 or 6 (a token and its drafts) is one tile instead
/// of 4 + 1 or 4 + 2. Each output row is the same operations in the same order as in a 4-row
/// tile (a unit test holds them bit-identical). Measured on an Intel Xeon (`CACHET_ISA=avx2`,
/// docs/bench-runs/2026-12-06-xeon-amx-avx2-6row-tiles.md), against 4-row tiles: the default model's matmul
/// set (`MODEL=… examples/perf`, 2 threads, interleaved rounds) m = 16 15.8–17.9 → 14.3–15.5
/// ms, m = 32 29.3–33.3 → 27.5–29.7, m = 512 430–433 → 416–422, m = 5, 6 and 8 inside the
/// noise; single 4-bit matrices at m = 6 5–10 % faster, at m = 16 the same (one thread, in
/// cache); `cachet bench kernel` decode batch 16 +5 % (3 of 3 pairs). Q8_0 (two `vpmaddubsw`
/// per code) was 6–11 % slower at m = 16 (and no faster at m = 5 and 6: its per-row work
/// bounds it) and Q6_K 3 %, and the AVX-VNNI kernel 5 % slower at m = 32: they keep 4 rows, as
/// do other vendors' CPUs until measured (the AVX-512 precedent of [`MR_512`]).
pub(crate) const MR_AVX2: usize = 6;

/// Activation rows per tile for format `fmt` on `isa` (on this CPU).
pub(crate) fn tile_rows(isa: Isa, fmt: PFmt) -> usize {
    tile_rows_for(isa, fmt, crate::isa::intel())
}

/// [`tile_rows`] on an Intel CPU (`intel`) or not.
pub(crate) fn tile_rows_for(isa: Isa, fmt: PFmt, intel: bool) -> usize {
    if intel && isa >= Isa::Avx512 && !wide_blocks(fmt) {
        MR_512
    } else if intel && isa == Isa::Avx2 && fmt.nib() {
        MR_AVX2
    } else {
        MR
    }
}

/// Formats with one byte per code in blocks of 32 (Q8_0's inner loop: 8 `vpdpbusd` per block
/// and row): their AVX-512 tiles keep 4 rows, as Q8_0's measured best (see [`MR_512`]); the
/// 5-bit and IQ4_XS formats share the loop and were not measured apart.
pub(crate) fn wide_blocks(fmt: PFmt) -> bool {
    !fmt.nib() && fmt.bk() == 32
}

/// Positions processed per softmax chunk.
pub(crate) const CHUNK: usize = 32;

// ------------------------------------------------------------------ quantized matmul tiles

/// One micro-kernel invocation: rows `r0..r0+nvalid` (groups g0..g0+ng) × x rows i0..i0+mr.
pub(crate) struct TileJob<'a> {
    pub(crate) p: &'a Packed,
    pub(crate) g0: usize,
    pub(crate) ng: usize,
    pub(crate) a: &'a QAct,
    pub(crate) i0: usize,
    pub(crate) mr: usize,
    pub(crate) y: SendPtr<f32>,
    pub(crate) ystride: usize,
    pub(crate) r0: usize,
    pub(crate) nvalid: usize,
    /// Byte distance from this job's weights to the next weights its task will read (`0`:
    /// none): the kernel prefetches them block by block, into L2, while it computes, so that
    /// the first tile of the next groups does not wait for DRAM. Only the blocks `b` with
    /// `b % prefetch_every == prefetch_phase` (the driver spreads one prefetch over several
    /// tiles). Into L2 rather than L1 (an L1 prefetch holds one of the core's few fill
    /// buffers until DRAM answers): measured (`examples/perf` `MODEL=1`, the default model's
    /// matmul set, 2 threads, 4 interleaved rounds) avx2 2.94-3.04 -> 2.80-2.85 ms, avx512
    /// 2.14-2.34 -> 2.07-2.15; m = 6, 16 and 512 and the AMX level no slower.
    pub(crate) prefetch: usize,
    pub(crate) prefetch_every: usize,
    pub(crate) prefetch_phase: usize,
}

/// Prefetch, into L2, the `bytes` bytes at `p` (one hint per cache line): what the kernels do
/// with the weights and KV they stream from DRAM. Into L2 rather than L1: an L1 prefetch holds
/// one of the core's few fill buffers until DRAM answers (measured where the kernels use it:
/// `TileJob::prefetch`, `avx2_attn::group_chunk`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_lines(p: *const u8, bytes: usize) {
    prefetch_lines_to::<{ std::arch::x86_64::_MM_HINT_T1 }>(p, bytes)
}

/// [`prefetch_lines`] with the cache-level hint `H` (`_MM_HINT_T0`: L1, `_MM_HINT_T1`: L2).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_lines_to<const H: i32>(p: *const u8, bytes: usize) {
    let mut off = 0;
    while off < bytes {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<H>(p.wrapping_add(off) as *const i8) };
        off += 64;
    }
}

/// Run one tile on the best kernel for `isa`.
pub(crate) fn run_tile(isa: Isa, job: &TileJob) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        run_tile_x86(isa, job);
        return;
    }
    let _ = isa;
    scalar::tile(job);
}

/// The x86 kernels of one tile, by format and tile shape.
#[cfg(target_arch = "x86_64")]
fn run_tile_x86(isa: Isa, job: &TileJob) {
    // The tile heights the macros below spell out as literals.
    const _: () = assert!(MR == 4 && MR_AVX2 == 6 && MR_512 == 8);
    // `$kern::<$F, MR, NG>` for the job's tile: `MR` one of the listed heights, else `$top`.
    macro_rules! tiles {
        ($kern:ident, $F:ty; $($n:literal)*; $top:literal) => {
            // SAFETY: the kernel's target features were detected (isa <= detected()), and the
            // job's pointers/extents were validated by the tile driver.
            unsafe {
                match (job.mr, job.ng) {
                    $(($n, 1) => $kern::<$F, $n, 1>(job), ($n, _) => $kern::<$F, $n, 2>(job),)*
                    (_, 1) => $kern::<$F, $top, 1>(job),
                    (_, _) => $kern::<$F, $top, 2>(job),
                }
            }
        };
    }
    // Tiles of up to `MR` rows (every kernel), or of 5 to `$top` rows (`MR_512`, `MR_AVX2`).
    macro_rules! go {
        ($kern:ident, $F:ty) => {
            go!($kern, $F, 4)
        };
        ($kern:ident, $F:ty, 4) => {
            tiles!($kern, $F; 1 2 3; 4)
        };
        ($kern:ident, $F:ty, 6) => {
            if job.mr <= MR { go!($kern, $F) } else { tiles!($kern, $F; 5; 6) }
        };
        ($kern:ident, $F:ty, 8) => {
            if job.mr <= MR { go!($kern, $F) } else { tiles!($kern, $F; 5 6 7; 8) }
        };
    }
    // Every format, tiles of up to `$top` rows.
    macro_rules! by_fmt {
        ($kern:ident, $top:tt) => {
            match job.p.fmt {
                PFmt::Q4_0 => go!($kern, FQ4_0, $top),
                PFmt::Q4_1 => go!($kern, FQ4_1, $top),
                PFmt::Q8_0 => go!($kern, FQ8_0, $top),
                PFmt::Q4K => go!($kern, FQ4K, $top),
                PFmt::Q6K => go!($kern, FQ6K, $top),
                PFmt::Q5_0 => go!($kern, FQ5_0, $top),
                PFmt::Q5K => go!($kern, FQ5K, $top),
                PFmt::Q2K => go!($kern, FQ2K, $top),
                PFmt::IQ4XS => go!($kern, FIQ4XS, $top),
            }
        };
    }
    // The tallest tile the dispatch below runs: the plain AVX2 kernel has 6-row instances of
    // every format (only the 4-bit ones are given them), the other levels as chosen.
    let most = if isa == Isa::Avx2 {
        MR_AVX2
    } else {
        tile_rows_for(isa, job.p.fmt, true)
    };
    debug_assert!(job.mr >= 1 && job.mr <= most && job.ng >= 1 && job.ng <= 2);
    if isa >= Isa::Avx512 {
        match job.p.fmt {
            PFmt::Q4_0 => go!(tile_512, FQ4_0, 8),
            PFmt::Q4_1 => go!(tile_512, FQ4_1, 8),
            // 4-row tiles only (`tile_rows`): no 8-row instances.
            PFmt::Q8_0 => go!(tile_512, FQ8_0),
            PFmt::Q4K => go!(tile_512, FQ4K, 8),
            PFmt::Q6K => go!(tile_512, FQ6K, 8),
            PFmt::Q2K => go!(tile_512, FQ2K, 8),
            // 8-bit codes in blocks of 32, Q8_0's inner loop: 4-row tiles as Q8_0's.
            PFmt::Q5_0 => go!(tile_512, FQ5_0),
            PFmt::Q5K => go!(tile_512, FQ5K),
            PFmt::IQ4XS => go!(tile_512, FIQ4XS),
        }
    } else if isa == Isa::Avx2Vnni {
        by_fmt!(tile_avx2_vnni, 4)
    } else {
        // Up to `MR_AVX2` rows: the 4-bit formats get them; the others never do, but would be
        // computed right.
        by_fmt!(tile_avx2, 6)
    }
}

/// Quantize one row of activations into int8 blocks of `bk` (see [`QAct`]).
pub(crate) fn quantize_act_row(
    isa: Isa,
    x: &[f32],
    bk: usize,
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        debug_assert!(
            x.len().is_multiple_of(bk)
                && q.len() >= x.len()
                && d.len() >= x.len() / bk
                && s.len() >= x.len() / bk
        );
        if isa >= Isa::Avx512 && bk.is_multiple_of(16) {
            // SAFETY: AVX-512 was detected (isa <= detected); slice bounds checked above.
            unsafe { avx512::quantize_act_row_512(x, bk, q, d, s) }
            return;
        }
        if bk.is_multiple_of(16) {
            // SAFETY: AVX2 was detected (isa <= detected); slice bounds checked above.
            unsafe { avx2::quantize_act_row_avx2(x, bk, q, d, s) }
            return;
        }
    }
    let _ = isa;
    crate::formats::act::quantize_act_row_scalar(x, bk, q, d, s)
}

// ------------------------------------------------------------------ f32 dot, SwiGLU

/// `Σ a_i b_i` over the shorter of the two slices.
pub(crate) fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        let n = a.len().min(b.len());
        return if isa >= Isa::Avx512 {
            // SAFETY: AVX-512F detected; reads stay within n elements.
            unsafe { avx512::dot_f32_512(a.as_ptr(), b.as_ptr(), n) }
        } else {
            // SAFETY: AVX2+FMA detected; reads stay within n elements.
            unsafe { avx2::dot_f32_avx2(a.as_ptr(), b.as_ptr(), n) }
        };
    }
    let _ = isa;
    scalar::dot_f32(a, b)
}

/// SwiGLU `out[i] = silu(gate[i]) * up[i]` on the best vector unit (the caller checked that
/// `gate` and `up` hold at least `out.len()` values).
pub(crate) fn swiglu(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    debug_assert!(gate.len() >= out.len() && up.len() >= out.len());
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && gate.len() >= out.len() && up.len() >= out.len() {
        // SAFETY: the target features were detected (isa <= detected()); the lengths were
        // checked above and every access is below `out.len()`.
        unsafe {
            if isa >= Isa::Avx512 {
                avx512::swiglu_512(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), out.len());
            } else {
                avx2::swiglu_avx2(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), out.len());
            }
        }
        return;
    }
    let _ = isa;
    scalar::swiglu(gate, up, out);
}

// ------------------------------------------------------------------ RMS norm

/// `Σ x²`, in one fixed order on every level (so norms are bit-identical across levels).
pub(crate) fn sum_squares(isa: Isa, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: AVX2 + FMA detected; reads stay within `x`.
        return unsafe { avx2::sum_squares_avx2(x.as_ptr(), x.len()) };
    }
    let _ = isa;
    scalar::sum_squares(x)
}

/// `out[i] = x[i] * r * w[i]` over the shortest of the three.
pub(crate) fn scale_mul(isa: Isa, x: &[f32], r: f32, w: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        let n = out.len().min(x.len()).min(w.len());
        // SAFETY: AVX2 detected; every access is below `n`.
        unsafe { avx2::scale_mul_avx2(x.as_ptr(), r, w.as_ptr(), out.as_mut_ptr(), n) };
        return;
    }
    let _ = isa;
    scalar::scale_mul(x, r, w, out);
}

/// `x[i] += d[i]` over the shorter of the two.
pub(crate) fn add_assign(isa: Isa, x: &mut [f32], d: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        let n = x.len().min(d.len());
        // SAFETY: AVX2 detected; every access is below `n`.
        unsafe { avx2::add_assign_avx2(x.as_mut_ptr(), d.as_ptr(), n) };
        return;
    }
    let _ = isa;
    scalar::add_assign(x, d);
}

// ------------------------------------------------------------------ attention

/// Element kind of the KV arena, resolved by type id (never by trusting a user impl).
#[cfg(target_arch = "x86_64")]
fn kv_kind<T: KvElem>() -> Option<bool> {
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        Some(false)
    } else if TypeId::of::<T>() == TypeId::of::<half::f16>() {
        Some(true)
    } else {
        None
    }
}

/// SIMD attention for query tokens `t..t + nq` and the `ng` kv groups from `g`, in one pass
/// over the positions `p0..p1` (with `ng > 1` a decode token reads each position's K/V row of
/// all heads at once, one sequential stream instead of one strided pass per group), the
/// next-chunk prefetch running up to `pf_end` ([`AttnCtx::pf_end`]; `p1` or less: none past
/// the range). `part` gets `[m, l, acc[hd]]` per (token, head of the groups) row. Returns
/// false if the shape is not handled (the caller then runs the portable version).
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
pub(crate) fn attend_groups<T: KvElem>(
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    (t, nq): (usize, usize),
    (g, ng): (usize, usize),
    (p0, p1): (usize, usize),
    pf_end: usize,
    part: &mut [f32],
) -> bool {
    let Some(is_f16) = kv_kind::<T>() else {
        return false;
    };
    let hd = a.head_dim;
    let gs = a.n_heads / a.n_kv_heads;
    // At most 64 rows (tokens × heads) per pass.
    if nq == 0 || ng == 0 || g + ng > a.n_kv_heads || nq * gs * ng > 64 || isa < Isa::Avx2 {
        return false;
    }
    let row = a.n_kv_heads * hd;
    if part.len() < nq * gs * ng * (hd + 2)
        || p1 > a.start_pos + t + nq
        || p0 > p1
        || pf_end > a.start_pos + a.n_tokens
        || t + nq > a.n_tokens
    {
        return false;
    }
    // Row pointers are computed from the block table; bounds were checked by the caller
    // (check_args: every block id < arena blocks, q/out long enough).
    let kb = k.as_ptr() as *const u8;
    let vb = v.as_ptr() as *const u8;
    let esz = if is_f16 { 2 } else { 4 };
    let qp = q.as_ptr().wrapping_add((t * a.n_heads + g * gs) * hd);
    let op = part.as_mut_ptr();
    let ctxs = AttnCtx {
        kb,
        vb,
        table: a.block_table,
        bs: a.block_size,
        row_bytes: row * esz,
        goff: g * hd * esz,
        p0,
        ctx: p1,
        ctx0: a.start_pos + t + 1,
        nq,
        qstride: a.n_heads * hd,
        gs,
        ng,
        hd,
        scale: a.scale,
        qp,
        op,
        is_f16,
        pf_end: pf_end.max(p1),
    };
    macro_rules! run {
        ($f:ident, $n:literal) => {
            // SAFETY: the ISA level was detected; all row offsets come from a validated block
            // table and q/out ranges were validated by check_args.
            unsafe { $f::<$n>(&ctxs) }
        };
    }
    if isa >= Isa::Avx512 {
        match hd {
            16 => run!(attn_512, 1),
            32 => run!(attn_512, 2),
            48 => run!(attn_512, 3),
            64 => run!(attn_512, 4),
            80 => run!(attn_512, 5),
            96 => run!(attn_512, 6),
            128 => run!(attn_512, 8),
            256 => run!(attn_512, 16),
            _ => return false,
        }
    } else {
        match hd {
            16 => run!(attn_avx2, 2),
            32 => run!(attn_avx2, 4),
            48 => run!(attn_avx2, 6),
            64 => run!(attn_avx2, 8),
            80 => run!(attn_avx2, 10),
            96 => run!(attn_avx2, 12),
            128 => run!(attn_avx2, 16),
            256 => run!(attn_avx2, 32),
            _ => return false,
        }
    }
    true
}

#[cfg(target_arch = "x86_64")]
pub(crate) struct AttnCtx<'a> {
    pub(crate) kb: *const u8,
    pub(crate) vb: *const u8,
    pub(crate) table: &'a [u32],
    pub(crate) bs: usize,
    pub(crate) row_bytes: usize,
    pub(crate) goff: usize,
    pub(crate) ctx: usize,
    pub(crate) gs: usize,
    pub(crate) hd: usize,
    pub(crate) scale: f32,
    pub(crate) qp: *const f32,
    /// Partial output: per head `[m, l, acc[hd]]` (running max, sum, unnormalised P·V).
    pub(crate) op: *mut f32,
    pub(crate) p0: usize,
    /// Context end (exclusive) of the first query token; token `i` of the tile ends at
    /// `ctx0 + i` (causal), capped by `ctx`.
    pub(crate) ctx0: usize,
    /// Query tokens in the tile (rows = nq × gs × ng), and the q stride between tokens.
    pub(crate) nq: usize,
    /// Consecutive kv groups in this pass (their K/V rows are adjacent in a position's row).
    pub(crate) ng: usize,
    pub(crate) qstride: usize,
    pub(crate) is_f16: bool,
    /// Positions up to which the next-chunk prefetch runs (`>= ctx`): past `ctx` when the
    /// caller's next call continues at `ctx` (a run of segments), so that call's first chunk
    /// is fetched while this one's last is computed.
    pub(crate) pf_end: usize,
}

#[cfg(target_arch = "x86_64")]
impl AttnCtx<'_> {
    /// Byte offsets (into K and V) of positions `c0..c0 + out.len()` for this group.
    #[inline]
    pub(crate) fn offsets(&self, c0: usize, out: &mut [usize]) {
        let (mut blk, mut slot) = (c0 / self.bs, c0 % self.bs);
        for o in out.iter_mut() {
            *o = (self.table[blk] as usize * self.bs + slot) * self.row_bytes + self.goff;
            slot += 1;
            if slot == self.bs {
                slot = 0;
                blk += 1;
            }
        }
    }

    /// Prefetch, into L2, the K and V bytes this pass reads (`span` bytes per position) of
    /// positions `c0..c0 + n` (capped at `pf_end`): the next chunk, fetched from DRAM while
    /// the current one is computed. Measured (`examples/perf`, one thread): batched decode
    /// over 53 MB of KV 5-9 % faster; a 768 KB context already in cache about 10 % slower.
    /// Serving reads KV from DRAM (a step's weights alone are three times the L3 cache). Into
    /// L2 rather than L1 since the eighteenth session (docs/bench-runs/2026-12-06-xeon-amx-served-step-phases.md): 1-2 % on a decode
    /// token's drafts (`DRAFT_ATTN=5@1500 LAYERS=120`), prefill the same.
    #[inline]
    pub(crate) fn prefetch(&self, c0: usize, n: usize, span: usize) {
        let end = (c0 + n).min(self.pf_end);
        let mut p = c0;
        while p < end {
            let (blk, slot) = (p / self.bs, p % self.bs);
            let run = (self.bs - slot).min(end - p);
            let off = (self.table[blk] as usize * self.bs + slot) * self.row_bytes + self.goff;
            if span == self.row_bytes {
                // The rows of one block are contiguous: one range per block.
                let bytes = run * self.row_bytes;
                prefetch_lines(self.kb.wrapping_add(off), bytes);
                prefetch_lines(self.vb.wrapping_add(off), bytes);
            } else {
                for j in 0..run {
                    let o = off + j * self.row_bytes;
                    prefetch_lines(self.kb.wrapping_add(o), span);
                    prefetch_lines(self.vb.wrapping_add(o), span);
                }
            }
            p += run;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every level quantizes activations to the same bytes, scales and sums, ties included
    /// (a block whose largest magnitude is 127 has scale 1, so `2.5` is a tie and rounds to
    /// even: 2).
    #[test]
    fn activation_quantization_is_the_same_on_every_level() {
        let mut state = 7u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 20001) as f32 / 100.0 - 100.0
        };
        for bk in [16usize, 32] {
            let n = bk * 6;
            let mut x: Vec<f32> = (0..n).map(|_| next()).collect();
            // Block 1: exact ties; block 2: all zero.
            x[bk] = 127.0;
            for (j, v) in x[bk + 1..2 * bk].iter_mut().enumerate() {
                *v = j as f32 - 7.5;
            }
            x[2 * bk..3 * bk].iter_mut().for_each(|v| *v = 0.0);
            let mut want = None;
            for level in Isa::supported() {
                let (mut q, mut d, mut s) = (vec![0i8; n], vec![0f32; n / bk], vec![0f32; n / bk]);
                quantize_act_row(level, &x, bk, &mut q, &mut d, &mut s);
                assert_eq!(q[bk + 1 + 5], -2, "{level}: -2.5 rounds to even");
                assert_eq!(q[bk + 1 + 10], 2, "{level}: 2.5 rounds to even");
                assert_eq!(&q[2 * bk..3 * bk], &[0i8; 32][..bk], "{level}: zero block");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let got = (q, bits(&d), bits(&s));
                match &want {
                    None => want = Some(got),
                    Some(w) => assert_eq!(&got, w, "{level} (bk {bk})"),
                }
            }
        }
    }
}
