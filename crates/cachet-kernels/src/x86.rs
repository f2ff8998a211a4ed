//! x86-64 SIMD kernels (AVX2 and AVX-512 VNNI), selected at run time by [`crate::isa`].
//!
//! Every `#[target_feature]` function here is only called after the corresponding
//! [`Isa`] level was detected (callers pass `isa::active()`, which never exceeds
//! `isa::detected()`).

use std::arch::x86_64::*;

use crate::attention::{KvElem, PagedAttnArgs};
use crate::isa::Isa;
use crate::quant::{Fmt, PFmt, TileJob, FQ4K, FQ4_0, FQ4_1, FQ6K, FQ8_0, GROUP};

// ------------------------------------------------------------------ activation quantization

pub(crate) fn quantize_act_row(
    isa: Isa,
    x: &[f32],
    bk: usize,
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
    debug_assert!(
        x.len().is_multiple_of(bk)
            && q.len() >= x.len()
            && d.len() >= x.len() / bk
            && s.len() >= x.len() / bk
    );
    if isa >= Isa::Avx512 && bk.is_multiple_of(16) {
        // SAFETY: AVX-512 was detected (isa <= detected); slice bounds checked above.
        unsafe { quantize_act_row_512(x, bk, q, d, s) }
    } else {
        crate::quant::quantize_act_row_scalar(x, bk, q, d, s)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn quantize_act_row_512(x: &[f32], bk: usize, q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    let nb = x.len() / bk;
    let vpb = bk / 16;
    let absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fff_ffff));
    for b in 0..nb {
        let xp = x.as_ptr().add(b * bk);
        let mut mx = _mm512_setzero_ps();
        for v in 0..vpb {
            mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_loadu_ps(xp.add(16 * v)), absmask));
        }
        let amax = _mm512_reduce_max_ps(mx);
        let db = amax / 127.0;
        let id = _mm512_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
        let mut sum = _mm512_setzero_si512();
        for v in 0..vpb {
            let qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xp.add(16 * v)), id));
            sum = _mm512_add_epi32(sum, qi);
            _mm_storeu_si128(
                q.as_mut_ptr().add(b * bk + 16 * v) as *mut __m128i,
                _mm512_cvtsepi32_epi8(qi),
            );
        }
        d[b] = db;
        s[b] = db * _mm512_reduce_add_epi32(sum) as f32;
    }
}

// ------------------------------------------------------------------ f32 dot

pub(crate) fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    if isa >= Isa::Avx512 {
        // SAFETY: AVX-512F detected; reads stay within n elements.
        unsafe { dot_f32_512(a.as_ptr(), b.as_ptr(), n) }
    } else {
        // SAFETY: AVX2+FMA detected; reads stay within n elements.
        unsafe { dot_f32_avx2(a.as_ptr(), b.as_ptr(), n) }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn dot_f32_512(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.add(i + 16 * j)),
                _mm512_loadu_ps(b.add(i + 16 * j)),
                *acc,
            );
        }
        i += 64;
    }
    while i + 16 <= n {
        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), acc[0]);
        i += 16;
    }
    if i < n {
        let m: __mmask16 = ((1u32 << (n - i)) - 1) as __mmask16;
        acc[1] = _mm512_fmadd_ps(
            _mm512_maskz_loadu_ps(m, a.add(i)),
            _mm512_maskz_loadu_ps(m, b.add(i)),
            acc[1],
        );
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(s)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.add(i + 8 * j)),
                _mm256_loadu_ps(b.add(i + 8 * j)),
                *acc,
            );
        }
        i += 32;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut t = [0f32; 8];
    _mm256_storeu_ps(t.as_mut_ptr(), s);
    let mut r: f32 = t.iter().sum();
    while i < n {
        r += *a.add(i) * *b.add(i);
        i += 1;
    }
    r
}

// ------------------------------------------------------------------ quantized GEMM tiles

/// Dispatch one tile to the best kernel for `isa`.
pub(crate) fn run_tile(isa: Isa, job: &TileJob) {
    macro_rules! go {
        ($kern:ident, $F:ty) => {
            // SAFETY: the kernel's target features were detected (isa <= detected()), and the
            // job's pointers/extents were validated by the tile driver.
            unsafe {
                match (job.mr, job.ng) {
                    (1, 1) => $kern::<$F, 1, 1>(job),
                    (1, _) => $kern::<$F, 1, 2>(job),
                    (2, 1) => $kern::<$F, 2, 1>(job),
                    (2, _) => $kern::<$F, 2, 2>(job),
                    (3, 1) => $kern::<$F, 3, 1>(job),
                    (3, _) => $kern::<$F, 3, 2>(job),
                    (_, 1) => $kern::<$F, 4, 1>(job),
                    (_, _) => $kern::<$F, 4, 2>(job),
                }
            }
        };
    }
    macro_rules! by_fmt {
        ($kern:ident) => {
            match job.p.fmt {
                PFmt::Q4_0 => go!($kern, FQ4_0),
                PFmt::Q4_1 => go!($kern, FQ4_1),
                PFmt::Q8_0 => go!($kern, FQ8_0),
                PFmt::Q4K => go!($kern, FQ4K),
                PFmt::Q6K => go!($kern, FQ6K),
            }
        };
    }
    debug_assert!(job.mr >= 1 && job.mr <= crate::quant::MR && job.ng >= 1 && job.ng <= 2);
    if isa >= Isa::Avx512 {
        by_fmt!(tile_512)
    } else {
        by_fmt!(tile_avx2)
    }
}

/// Scales `(d, c)` of one packed block's 16 weight rows (value = d·code + c); `block` points
/// at the block, `negoff` holds `-OFF` for formats without a stored minimum.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn block_scales_512<F: Fmt>(
    block: *const u8,
    negoff: __m512,
) -> (__m512, __m512) {
    let sp = block.add(F::QBYTES);
    let d = load_scales_512::<F>(sp);
    let c = if F::HASM {
        load_scales_512::<F>(sp.add(GROUP * F::SBYTES))
    } else {
        _mm512_mul_ps(d, negoff)
    };
    (d, c)
}

/// 16 per-row scales, stored as f32 or f16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn load_scales_512<F: Fmt>(p: *const u8) -> __m512 {
    if F::F32S {
        _mm512_loadu_ps(p as *const f32)
    } else {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// Fold one block's exact int32 sums of an activation row into its f32 accumulator:
/// `acc + sums · (d · dx) + c · sx`, with `dx`, `sx` the row's block scale and scaled sum.
/// The one order every int8 kernel uses, so their outputs are bit-identical.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn fold_block_512(
    acc: __m512,
    sums: __m512i,
    d: __m512,
    dx: f32,
    c: __m512,
    sx: f32,
) -> __m512 {
    let t = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(sums),
        _mm512_mul_ps(d, _mm512_set1_ps(dx)),
        acc,
    );
    _mm512_fmadd_ps(c, _mm512_set1_ps(sx), t)
}

/// AVX-512 VNNI micro-kernel: `MR` activation rows × `NG` groups of 16 weight rows.
/// Each weight vector holds 4 consecutive codes of 16 rows; activation quads are broadcast
/// and `vpdpbusd` accumulates exact int32 block dot products, converted to f32 per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_512<F: Fmt, const MR: usize, const NG: usize>(job: &TileJob) {
    let p = job.p;
    let gb = p.group_bytes();
    let w0 = p.bytes().as_ptr().add(job.g0 * gb);
    let a = job.a;
    let (cols, anb) = (a.cols, a.nb);
    let xq0 = a.q.as_ptr().add(job.i0 * cols);
    let xd0 = a.d.as_ptr().add(job.i0 * anb);
    let xs0 = a.s.as_ptr().add(job.i0 * anb);
    let m4 = _mm512_set1_epi8(0x0F);
    let negoff = _mm512_set1_ps(-(F::OFF as f32));
    let mut accf = [[_mm512_setzero_ps(); NG]; MR];
    for b in 0..p.nb {
        let mut acci = [[_mm512_setzero_si512(); NG]; MR];
        for g in 0..NG {
            let base = w0.add(g * gb + b * F::STRIDE);
            if F::NIB {
                for s in 0..4 {
                    let pv = _mm512_loadu_si512(base.add(64 * s) as *const _);
                    let lo = _mm512_and_si512(pv, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(pv, 4), m4);
                    for (i, acc) in acci.iter_mut().enumerate() {
                        let xp = xq0.add(i * cols + b * F::BK);
                        let al = _mm512_set1_epi32((xp.add(4 * s) as *const i32).read_unaligned());
                        let ah =
                            _mm512_set1_epi32((xp.add(16 + 4 * s) as *const i32).read_unaligned());
                        acc[g] = _mm512_dpbusd_epi32(acc[g], lo, al);
                        acc[g] = _mm512_dpbusd_epi32(acc[g], hi, ah);
                    }
                }
            } else {
                for t in 0..F::BK / 4 {
                    let v = _mm512_loadu_si512(base.add(64 * t) as *const _);
                    for (i, acc) in acci.iter_mut().enumerate() {
                        let xp = xq0.add(i * cols + b * F::BK);
                        let ax = _mm512_set1_epi32((xp.add(4 * t) as *const i32).read_unaligned());
                        acc[g] = _mm512_dpbusd_epi32(acc[g], v, ax);
                    }
                }
            }
        }
        for g in 0..NG {
            let (d, c) = block_scales_512::<F>(w0.add(g * gb + b * F::STRIDE), negoff);
            for i in 0..MR {
                let (dx, sx) = (*xd0.add(i * anb + b), *xs0.add(i * anb + b));
                accf[i][g] = fold_block_512(accf[i][g], acci[i][g], d, dx, c, sx);
            }
        }
    }
    for (i, accf) in accf.iter().enumerate() {
        let yrow = job.y.get().add((job.i0 + i) * job.ystride + job.r0);
        for (g, acc) in accf.iter().enumerate() {
            let r = g * GROUP;
            if job.nvalid >= r + GROUP {
                _mm512_storeu_ps(yrow.add(r), *acc);
            } else if job.nvalid > r {
                let mask = ((1u32 << (job.nvalid - r)) - 1) as __mmask16;
                _mm512_mask_storeu_ps(yrow.add(r), mask, *acc);
            }
        }
    }
}

/// AVX2 micro-kernel over the same layout: each 16-row group is two 8-lane halves; int8
/// products via `vpmaddubsw` (4-bit codes accumulate in i16 across a block without
/// overflow; 8-bit codes use the sign trick on `code - 128` and widen every step).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<F: Fmt, const MR: usize, const NG: usize>(job: &TileJob) {
    let p = job.p;
    let gb = p.group_bytes();
    let w0 = p.bytes().as_ptr().add(job.g0 * gb);
    let a = job.a;
    let (cols, anb) = (a.cols, a.nb);
    let xq0 = a.q.as_ptr().add(job.i0 * cols);
    let xd0 = a.d.as_ptr().add(job.i0 * anb);
    let xs0 = a.s.as_ptr().add(job.i0 * anb);
    let m4 = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    // int sums are Σ code·a for 4-bit, Σ (code-128)·a for 8-bit: c' = c + 128 d there.
    let coff = if F::NIB {
        -(F::OFF as f32)
    } else {
        128.0 - F::OFF as f32
    };
    let coffv = _mm256_set1_ps(coff);
    let cadj = _mm256_set1_ps(if F::NIB { 0.0 } else { 128.0 });
    for g in 0..NG {
        for h in 0..2 {
            let mut accf = [_mm256_setzero_ps(); MR];
            for b in 0..p.nb {
                let base = w0.add(g * gb + b * F::STRIDE);
                let mut acci = [_mm256_setzero_si256(); MR];
                if F::NIB {
                    let mut acc16 = [_mm256_setzero_si256(); MR];
                    for s in 0..4 {
                        let pv = _mm256_loadu_si256(base.add(64 * s + 32 * h) as *const __m256i);
                        let lo = _mm256_and_si256(pv, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(pv, 4), m4);
                        for (i, acc) in acc16.iter_mut().enumerate() {
                            let xp = xq0.add(i * cols + b * F::BK);
                            let al =
                                _mm256_set1_epi32((xp.add(4 * s) as *const i32).read_unaligned());
                            let ah = _mm256_set1_epi32(
                                (xp.add(16 + 4 * s) as *const i32).read_unaligned(),
                            );
                            *acc = _mm256_add_epi16(*acc, _mm256_maddubs_epi16(lo, al));
                            *acc = _mm256_add_epi16(*acc, _mm256_maddubs_epi16(hi, ah));
                        }
                    }
                    for i in 0..MR {
                        acci[i] = _mm256_madd_epi16(acc16[i], ones);
                    }
                } else {
                    for t in 0..F::BK / 4 {
                        let v = _mm256_xor_si256(
                            _mm256_loadu_si256(base.add(64 * t + 32 * h) as *const __m256i),
                            flip,
                        );
                        let av = _mm256_sign_epi8(v, v);
                        for (i, acc) in acci.iter_mut().enumerate() {
                            let xp = xq0.add(i * cols + b * F::BK);
                            let ax =
                                _mm256_set1_epi32((xp.add(4 * t) as *const i32).read_unaligned());
                            let sx = _mm256_sign_epi8(ax, v);
                            *acc = _mm256_add_epi32(
                                *acc,
                                _mm256_madd_epi16(_mm256_maddubs_epi16(av, sx), ones),
                            );
                        }
                    }
                }
                let sp = base.add(F::QBYTES + h * 8 * F::SBYTES);
                let d = if F::F32S {
                    _mm256_loadu_ps(sp as *const f32)
                } else {
                    _mm256_cvtph_ps(_mm_loadu_si128(sp as *const __m128i))
                };
                let c = if F::HASM {
                    let mp = sp.add(GROUP * F::SBYTES);
                    let m = if F::F32S {
                        _mm256_loadu_ps(mp as *const f32)
                    } else {
                        _mm256_cvtph_ps(_mm_loadu_si128(mp as *const __m128i))
                    };
                    _mm256_fmadd_ps(d, cadj, m)
                } else {
                    _mm256_mul_ps(d, coffv)
                };
                for i in 0..MR {
                    let dx = _mm256_set1_ps(*xd0.add(i * anb + b));
                    let sx = _mm256_set1_ps(*xs0.add(i * anb + b));
                    let t =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[i]), _mm256_mul_ps(d, dx), accf[i]);
                    accf[i] = _mm256_fmadd_ps(c, sx, t);
                }
            }
            let r = g * GROUP + h * 8;
            for (i, acc) in accf.iter().enumerate() {
                let yrow = job.y.get().add((job.i0 + i) * job.ystride + job.r0);
                if job.nvalid >= r + 8 {
                    _mm256_storeu_ps(yrow.add(r), *acc);
                } else if job.nvalid > r {
                    let mut tmp = [0f32; 8];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), *acc);
                    for (j, v) in tmp.iter().enumerate().take(job.nvalid - r) {
                        *yrow.add(r + j) = *v;
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------ attention

use crate::attention::CHUNK;
use std::any::TypeId;

/// Element kind of the KV arena, resolved by type id (never by trusting a user impl).
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
/// over the positions (`ng > 1`, AVX-512 only: a decode token reads each position's K/V row
/// of all heads at once, one sequential stream instead of one strided pass per group).
/// `part` gets `[m, l, acc[hd]]` per (token, head of the groups) row. Returns false if the
/// shape is not handled (the caller then runs the portable version).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_groups<T: KvElem>(
    isa: Isa,
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    (t, nq): (usize, usize),
    (g, ng): (usize, usize),
    (p0, p1): (usize, usize),
    part: &mut [f32],
) -> bool {
    let Some(is_f16) = kv_kind::<T>() else {
        return false;
    };
    let hd = a.head_dim;
    let gs = a.n_heads / a.n_kv_heads;
    // Multi-token tiles and multi-group passes only in the AVX-512 kernel; at most 64 rows
    // (tokens × heads).
    if nq == 0
        || ng == 0
        || g + ng > a.n_kv_heads
        || nq * gs * ng > 64
        || ((nq > 1 || ng > 1) && isa < Isa::Avx512)
    {
        return false;
    }
    let row = a.n_kv_heads * hd;
    if part.len() < nq * gs * ng * (hd + 2)
        || p1 > a.start_pos + t + nq
        || p0 > p1
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
            _ => return false,
        }
    }
    true
}

struct AttnCtx<'a> {
    kb: *const u8,
    vb: *const u8,
    table: &'a [u32],
    bs: usize,
    row_bytes: usize,
    goff: usize,
    ctx: usize,
    gs: usize,
    hd: usize,
    scale: f32,
    qp: *const f32,
    /// Partial output: per head `[m, l, acc[hd]]` (running max, sum, unnormalised P·V).
    op: *mut f32,
    p0: usize,
    /// Context end (exclusive) of the first query token; token `i` of the tile ends at
    /// `ctx0 + i` (causal), capped by `ctx`.
    ctx0: usize,
    /// Query tokens in the tile (rows = nq × gs × ng), and the q stride between tokens.
    nq: usize,
    /// Consecutive kv groups in this pass (their K/V rows are adjacent in a position's row).
    ng: usize,
    qstride: usize,
    is_f16: bool,
}

impl AttnCtx<'_> {
    /// Byte offsets (into K and V) of positions `c0..c0 + out.len()` for this group.
    #[inline]
    fn offsets(&self, c0: usize, out: &mut [usize]) {
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
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn ld512(p: *const u8, is_f16: bool) -> __m512 {
    if is_f16 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// Horizontal sums of 16 vectors: lane `j` of the result is the sum of `v[j]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
    let mut w = [_mm512_setzero_ps(); 8];
    for (i, w) in w.iter_mut().enumerate() {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        *w = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    let mut x = [_mm512_setzero_ps(); 4];
    for (i, x) in x.iter_mut().enumerate() {
        let (a, b) = (_mm512_castps_pd(w[2 * i]), _mm512_castps_pd(w[2 * i + 1]));
        *x = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        );
    }
    // x[i] holds, per 128-bit lane l, the lane-l sums of vectors 4i..4i+4.
    let z01 = _mm512_add_ps(
        _mm512_shuffle_f32x4(x[0], x[1], 0b10_00_10_00),
        _mm512_shuffle_f32x4(x[0], x[1], 0b11_01_11_01),
    );
    let z23 = _mm512_add_ps(
        _mm512_shuffle_f32x4(x[2], x[3], 0b10_00_10_00),
        _mm512_shuffle_f32x4(x[2], x[3], 0b11_01_11_01),
    );
    _mm512_add_ps(
        _mm512_shuffle_f32x4(z01, z23, 0b10_00_10_00),
        _mm512_shuffle_f32x4(z01, z23, 0b11_01_11_01),
    )
}

/// exp(x) for x <= 0 (inputs below -87 flush to ~0). Max rel. error ~2e-7.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn exp512(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
    let n = _mm512_roundscale_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        0x08,
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0 / 120.0));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0 / 24.0));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0 / 6.0));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
    _mm512_scalef_ps(p, n)
}

/// AVX-512 attention for a tile of `nq` query tokens × the `gs` heads of one kv group
/// (`HV` = head_dim / 16 vectors per row). Per chunk of positions: f16 K/V rows are
/// converted once into an f32 scratch shared by every row of the tile; scores for 16
/// positions at a time with a transposed reduction; one online-softmax rescale per chunk
/// and row; then P·V with the row's accumulators in registers. Rows past their causal end
/// skip the chunk's tail.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attn_512<const HV: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let gs = c.gs;
    let ng = c.ng;
    // Row r: token r / (gs·ng), head (r % (gs·ng)) of the pass, in group (r % (gs·ng)) / gs.
    let per_tok = gs * ng;
    let rows = (c.nq * per_tok).min(64);
    // Vectors per position in the f32 copies (all groups of the pass).
    let pv = ng * HV;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut s = [0f32; CHUNK];
    let buf_rows = if c.is_f16 { CHUNK.min(c.ctx - c.p0) } else { 0 };
    // Accumulators and the f32 copies of a chunk's K/V rows live in a per-thread scratch
    // (a decode step makes thousands of these calls; allocating and zeroing 16 KB each
    // cost more than the arithmetic).
    let mut scratch = ATTN_SCRATCH.take();
    let need = rows * HV + 2 * buf_rows * pv;
    if scratch.len() < need {
        scratch.resize(need, _mm512_setzero_ps());
    }
    let (acc, rest) = scratch.split_at_mut(rows * HV);
    acc.fill(_mm512_setzero_ps());
    let (kbuf, rest) = rest.split_at_mut(buf_rows * pv);
    let vbuf = &mut rest[..buf_rows * pv];
    let mut krow = [std::ptr::null::<f32>(); CHUNK];
    let mut vrow = [std::ptr::null::<f32>(); CHUNK];
    let mut c0 = c.p0;
    while c0 < c.ctx {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        for j in 0..CHUNK {
            let jj = if j < n { j } else { 0 };
            if c.is_f16 {
                if j < n {
                    let (kr, vr) = (c.kb.add(kp[j]), c.vb.add(kp[j]));
                    for i in 0..pv {
                        kbuf[j * pv + i] = ld512(kr.add(32 * i), true);
                        vbuf[j * pv + i] = ld512(vr.add(32 * i), true);
                    }
                }
                krow[j] = kbuf.as_ptr().add(jj * pv) as *const f32;
                vrow[j] = vbuf.as_ptr().add(jj * pv) as *const f32;
            } else {
                krow[j] = c.kb.add(kp[jj]) as *const f32;
                vrow[j] = c.vb.add(kp[jj]) as *const f32;
            }
        }
        for r in 0..rows {
            let (ti, h) = (r / per_tok, r % per_tok);
            // This row's group within the position rows: `go` floats in.
            let go = (h / gs) * hd;
            // causal end of this row within the chunk
            let end = (c.ctx0 + ti).min(c.ctx);
            if end <= c0 {
                continue;
            }
            let nr = (end - c0).min(n);
            let qh = c.qp.add(ti * c.qstride + h * hd);
            let mut qv = [_mm512_setzero_ps(); HV];
            for (i, qv) in qv.iter_mut().enumerate() {
                *qv = _mm512_mul_ps(_mm512_loadu_ps(qh.add(16 * i)), _mm512_set1_ps(c.scale));
            }
            let mut cmax = _mm512_set1_ps(f32::NEG_INFINITY);
            let mut j = 0;
            while j < nr {
                let cnt = (nr - j).min(16);
                let mut dv = [_mm512_setzero_ps(); 16];
                for (jj, dv) in dv.iter_mut().enumerate() {
                    let kr = krow[(j + jj).min(CHUNK - 1)].add(go);
                    let mut d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
                    for (i, qv) in qv.iter().enumerate().skip(1) {
                        d = _mm512_fmadd_ps(*qv, _mm512_loadu_ps(kr.add(16 * i)), d);
                    }
                    *dv = d;
                }
                let rv = reduce16(&dv);
                let m: __mmask16 = if cnt == 16 {
                    0xffff
                } else {
                    ((1u32 << cnt) - 1) as __mmask16
                };
                cmax = _mm512_mask_max_ps(cmax, m, cmax, rv);
                _mm512_mask_storeu_ps(s.as_mut_ptr().add(j), m, rv);
                j += 16;
            }
            // online softmax over the chunk
            let new_m = mx[r].max(_mm512_reduce_max_ps(cmax));
            let alpha = if mx[r] == f32::NEG_INFINITY {
                0.0
            } else {
                (mx[r] - new_m).exp()
            };
            mx[r] = new_m;
            let nm = _mm512_set1_ps(new_m);
            let mut sum = _mm512_setzero_ps();
            let mut j = 0;
            while j < nr {
                let m: __mmask16 = if nr - j >= 16 {
                    0xffff
                } else {
                    ((1u32 << (nr - j)) - 1) as __mmask16
                };
                let e = exp512(_mm512_sub_ps(
                    _mm512_maskz_loadu_ps(m, s.as_ptr().add(j)),
                    nm,
                ));
                let e = _mm512_maskz_mov_ps(m, e);
                sum = _mm512_add_ps(sum, e);
                _mm512_storeu_ps(s.as_mut_ptr().add(j), e);
                j += 16;
            }
            lsum[r] = lsum[r] * alpha + _mm512_reduce_add_ps(sum);
            // P·V with two accumulator sets (even/odd positions) to hide FMA latency
            let al = _mm512_set1_ps(alpha);
            let mut a0 = [_mm512_setzero_ps(); HV];
            let mut a1 = [_mm512_setzero_ps(); HV];
            for (i, a0) in a0.iter_mut().enumerate() {
                *a0 = _mm512_mul_ps(acc[r * HV + i], al);
            }
            let mut j = 0;
            while j + 2 <= nr {
                let (p0, p1) = (_mm512_set1_ps(s[j]), _mm512_set1_ps(s[j + 1]));
                let (v0, v1) = (vrow[j].add(go), vrow[j + 1].add(go));
                for i in 0..HV {
                    a0[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0.add(16 * i)), a0[i]);
                    a1[i] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1.add(16 * i)), a1[i]);
                }
                j += 2;
            }
            if j < nr {
                let p0 = _mm512_set1_ps(s[j]);
                for (i, a0) in a0.iter_mut().enumerate() {
                    *a0 = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vrow[j].add(go + 16 * i)), *a0);
                }
            }
            for i in 0..HV {
                acc[r * HV + i] = _mm512_add_ps(a0[i], a1[i]);
            }
        }
        c0 += n;
    }
    for r in 0..rows {
        let ph = c.op.add(r * (hd + 2));
        *ph = mx[r];
        *ph.add(1) = lsum[r];
        for i in 0..HV {
            _mm512_storeu_ps(ph.add(2 + 16 * i), acc[r * HV + i]);
        }
    }
    ATTN_SCRATCH.set(scratch);
}

thread_local! {
    /// Reused buffers of [`attn_512`].
    static ATTN_SCRATCH: std::cell::Cell<Vec<__m512>> = const { std::cell::Cell::new(Vec::new()) };
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ld256(p: *const u8, is_f16: bool) -> __m256 {
    if is_f16 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum256(v: __m256) -> f32 {
    let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    _mm_cvtss_f32(x)
}

/// exp(x) for x <= 0 with AVX2 (2^n built in the exponent bits).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn exp256(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        0x08,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 120.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 24.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 6.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(p, _mm256_castsi256_ps(e))
}

/// AVX2 version of [`attn_512`]: `HV` = head_dim / 8.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attn_avx2<const HV: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let gs = c.gs.min(64);
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut acc = vec![_mm256_setzero_ps(); gs * HV];
    let mut kp = [0usize; CHUNK];
    let mut s = [0f32; CHUNK];
    let esz = if c.is_f16 { 2 } else { 4 };
    let mut c0 = c.p0;
    while c0 < c.ctx {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        for h in 0..gs {
            let qh = c.qp.add(h * hd);
            let mut qv = [_mm256_setzero_ps(); HV];
            for (i, qv) in qv.iter_mut().enumerate() {
                *qv = _mm256_mul_ps(_mm256_loadu_ps(qh.add(8 * i)), _mm256_set1_ps(c.scale));
            }
            for j in 0..n {
                let kr = c.kb.add(kp[j]);
                let mut d = _mm256_mul_ps(qv[0], ld256(kr, c.is_f16));
                for (i, qv) in qv.iter().enumerate().skip(1) {
                    d = _mm256_fmadd_ps(*qv, ld256(kr.add(8 * i * esz), c.is_f16), d);
                }
                s[j] = hsum256(d);
            }
            let mut cm = f32::NEG_INFINITY;
            for &x in &s[..n] {
                cm = cm.max(x);
            }
            let new_m = mx[h].max(cm);
            let alpha = if mx[h] == f32::NEG_INFINITY {
                0.0
            } else {
                (mx[h] - new_m).exp()
            };
            mx[h] = new_m;
            let nm = _mm256_set1_ps(new_m);
            let mut sum = 0f32;
            let mut j = 0;
            while j + 8 <= n {
                let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(j)), nm));
                sum += hsum256(e);
                _mm256_storeu_ps(s.as_mut_ptr().add(j), e);
                j += 8;
            }
            while j < n {
                s[j] = (s[j] - new_m).exp();
                sum += s[j];
                j += 1;
            }
            lsum[h] = lsum[h] * alpha + sum;
            let mut av = [_mm256_setzero_ps(); HV];
            let al = _mm256_set1_ps(alpha);
            for (i, av) in av.iter_mut().enumerate() {
                *av = _mm256_mul_ps(acc[h * HV + i], al);
            }
            for (j, &pj) in s.iter().enumerate().take(n) {
                let vr = c.vb.add(kp[j]);
                let p = _mm256_set1_ps(pj);
                for (i, av) in av.iter_mut().enumerate() {
                    *av = _mm256_fmadd_ps(p, ld256(vr.add(8 * i * esz), c.is_f16), *av);
                }
            }
            acc[h * HV..(h + 1) * HV].copy_from_slice(&av);
        }
        c0 += n;
    }
    for h in 0..gs {
        let ph = c.op.add(h * (hd + 2));
        *ph = mx[h];
        *ph.add(1) = lsum[h];
        for i in 0..HV {
            _mm256_storeu_ps(ph.add(2 + 8 * i), acc[h * HV + i]);
        }
    }
}

// ------------------------------------------------------------------ activations

/// SwiGLU on the best vector unit; `false` when `isa` has none (the caller runs scalar).
pub(crate) fn swiglu(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) -> bool {
    if gate.len() < out.len() || up.len() < out.len() {
        return false;
    }
    // SAFETY: the target features were detected (isa <= detected()); the lengths were
    // checked above and every access is below `out.len()`.
    unsafe {
        if isa >= Isa::Avx512 {
            swiglu_512(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), out.len());
        } else if isa >= Isa::Avx2 {
            swiglu_avx2(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), out.len());
        } else {
            return false;
        }
    }
    true
}

/// `silu(g) * u` as `g * u * s` with `s = 1 / (1 + e)` for `g >= 0` and `e / (1 + e)` below,
/// where `e = e^-|g|`: the exponential only ever sees arguments <= 0.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn swiglu_512(g: *const f32, u: *const f32, o: *mut f32, n: usize) {
    let one = _mm512_set1_ps(1.0);
    let zero = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let m: __mmask16 = if n - i >= 16 {
            0xffff
        } else {
            ((1u32 << (n - i)) - 1) as __mmask16
        };
        let x = _mm512_maskz_loadu_ps(m, g.add(i));
        let uv = _mm512_maskz_loadu_ps(m, u.add(i));
        let e = exp512(_mm512_sub_ps(zero, _mm512_abs_ps(x)));
        let pos = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, zero);
        let s = _mm512_div_ps(_mm512_mask_blend_ps(pos, e, one), _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(o.add(i), m, _mm512_mul_ps(_mm512_mul_ps(x, s), uv));
        i += 16;
    }
}

/// AVX2 version of [`swiglu_512`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu_avx2(g: *const f32, u: *const f32, o: *mut f32, n: usize) {
    let one = _mm256_set1_ps(1.0);
    let zero = _mm256_setzero_ps();
    let sign = _mm256_set1_ps(-0.0);
    let mut i = 0;
    while i + 8 <= n {
        let x = _mm256_loadu_ps(g.add(i));
        let uv = _mm256_loadu_ps(u.add(i));
        let e = exp256(_mm256_or_ps(x, sign)); // e^-|x|
        let pos = _mm256_cmp_ps::<_CMP_GE_OQ>(x, zero);
        let s = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
        _mm256_storeu_ps(o.add(i), _mm256_mul_ps(_mm256_mul_ps(x, s), uv));
        i += 8;
    }
    while i < n {
        let x = *g.add(i);
        *o.add(i) = x / (1.0 + (-x).exp()) * *u.add(i);
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce16_matches_scalar() {
        if crate::isa::detected() < Isa::Avx512 {
            return;
        }
        let vals: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32).collect();
        // SAFETY: AVX-512 detected above; loads read 16 floats of `vals` each.
        let got = unsafe {
            let mut v = [_mm512_setzero_ps(); 16];
            for (j, v) in v.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(vals.as_ptr().add(16 * j));
            }
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), reduce16(&v));
            out
        };
        for j in 0..16 {
            let want: f32 = vals[16 * j..16 * j + 16].iter().sum();
            assert_eq!(got[j], want, "lane {j}: {got:?}");
        }
    }
}
