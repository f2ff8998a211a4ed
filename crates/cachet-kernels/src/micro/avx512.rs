//! AVX-512 micro-kernels (F/BW/VL/DQ + VNNI): int8 matmul tiles with `vpdpbusd`, activation
//! quantization, the f32 dot, SwiGLU, and paged attention over 16-lane rows.

use std::arch::x86_64::*;

use super::{AttnCtx, TileJob, CHUNK};
use crate::formats::packed::{Fmt, GROUP};

// ------------------------------------------------------------------ activation quantization

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
pub(crate) unsafe fn quantize_act_row_512(
    x: &[f32],
    bk: usize,
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
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

#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn dot_f32_512(a: *const f32, b: *const f32, n: usize) -> f32 {
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

// ------------------------------------------------------------------ quantized GEMM tiles

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
pub(crate) unsafe fn tile_512<F: Fmt, const MR: usize, const NG: usize>(job: &TileJob) {
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
    // The next block to prefetch (see `TileJob::prefetch`).
    let mut pf_next = job.prefetch_phase;
    for b in 0..p.nb {
        let mut acci = [[_mm512_setzero_si512(); NG]; MR];
        if job.prefetch != 0 && b == pf_next {
            for g in 0..NG {
                let base = w0.add(g * gb + b * F::STRIDE);
                super::prefetch_lines(base.wrapping_add(job.prefetch), F::STRIDE);
            }
            pf_next += job.prefetch_every;
        }
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

// ------------------------------------------------------------------ SwiGLU

/// `silu(g) * u` as `g * u * s` with `s = 1 / (1 + e)` for `g >= 0` and `e / (1 + e)` below,
/// where `e = e^-|g|`: the exponential only ever sees arguments <= 0.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn swiglu_512(g: *const f32, u: *const f32, o: *mut f32, n: usize) {
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

// ------------------------------------------------------------------ attention

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
    let q = |i: usize| [v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]];
    reduce16_combine(&[
        reduce16_quad(&q(0)),
        reduce16_quad(&q(1)),
        reduce16_quad(&q(2)),
        reduce16_quad(&q(3)),
    ])
}

/// First two levels of [`reduce16`] on vectors `4i..4i + 4`: per 128-bit lane `l`, the lane-`l`
/// sums of the four vectors. Split out so a kernel can reduce four positions at a time with
/// the very same operations (the same bits) as a whole [`reduce16`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn reduce16_quad(v: &[__m512; 4]) -> __m512 {
    let w0 = _mm512_add_ps(
        _mm512_unpacklo_ps(v[0], v[1]),
        _mm512_unpackhi_ps(v[0], v[1]),
    );
    let w1 = _mm512_add_ps(
        _mm512_unpacklo_ps(v[2], v[3]),
        _mm512_unpackhi_ps(v[2], v[3]),
    );
    let (a, b) = (_mm512_castps_pd(w0), _mm512_castps_pd(w1));
    _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
    )
}

/// Last level of [`reduce16`]: the four [`reduce16_quad`] results into the 16 sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn reduce16_combine(x: &[__m512; 4]) -> __m512 {
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
pub(crate) unsafe fn exp512(x: __m512) -> __m512 {
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

/// Rows of one kv group in a pass (query tokens × heads of the group) up to which the kernel
/// reads f16 K/V in place, converting in the load, instead of converting each chunk into an
/// f32 scratch first. Decode has `gs` rows per group (3 for the default model): the scratch
/// of a 32-position chunk of all groups is 48 KB of stores, more than L1, for 3 reads each;
/// measured (`examples/perf`, `ATTN_BATCH=16x144`, one thread) the scratch stores were ~40 %
/// of decode attention. Both ways give the same bits (the f16 → f32 conversion is exact), so
/// the choice cannot make a token's logits depend on the tile it is computed in.
pub(crate) const DIRECT_ROWS: usize = 4;

/// AVX-512 attention for a tile of `nq` query tokens × the `gs` heads of `ng` kv groups
/// (`HV` = head_dim / 16 vectors per row). Per chunk of positions: scores for 16 positions
/// at a time with a transposed reduction; one online-softmax rescale per chunk and row; then
/// P·V with the row's accumulators in registers. f16 K/V rows are read in place when few
/// rows share them ([`DIRECT_ROWS`]), else converted once per chunk into an f32 scratch
/// shared by every row of the tile. Rows past their causal end skip the chunk's tail.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn attn_512<const HV: usize>(c: &AttnCtx) {
    if c.nq == 1 {
        match (c.gs, c.is_f16) {
            (1, true) => return attn_512_group::<HV, true, 1>(c),
            (2, true) => return attn_512_group::<HV, true, 2>(c),
            (3, true) => return attn_512_group::<HV, true, 3>(c),
            (4, true) => return attn_512_group::<HV, true, 4>(c),
            (1, false) => return attn_512_group::<HV, false, 1>(c),
            (2, false) => return attn_512_group::<HV, false, 2>(c),
            (3, false) => return attn_512_group::<HV, false, 3>(c),
            (4, false) => return attn_512_group::<HV, false, 4>(c),
            _ => {}
        }
    }
    if !c.is_f16 {
        attn_512_rows::<HV, false, false>(c)
    } else if c.nq * c.gs <= DIRECT_ROWS {
        attn_512_rows::<HV, true, false>(c)
    } else {
        attn_512_rows::<HV, false, true>(c)
    }
}

/// Load 16 lanes at `p`: f16 converted (`CV`) or f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn ldv<const CV: bool>(p: *const u8) -> __m512 {
    if CV {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// [`attn_512`] with K/V read as f16 in place (`CV`), or as f32 from the arena or from an f32
/// scratch of the chunk (`SCR`, f16 arena only).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attn_512_rows<const HV: usize, const CV: bool, const SCR: bool>(c: &AttnCtx) {
    let hd = c.hd;
    let gs = c.gs;
    let ng = c.ng;
    // Bytes per element as the row loops read them.
    let es = if CV { 2 } else { 4 };
    // Row r: token r / (gs·ng), head (r % (gs·ng)) of the pass, in group (r % (gs·ng)) / gs.
    let per_tok = gs * ng;
    let rows = (c.nq * per_tok).min(64);
    // Vectors per position in the f32 copies (all groups of the pass).
    let pv = ng * HV;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut s = [0f32; CHUNK];
    let buf_rows = if SCR { CHUNK.min(c.ctx - c.p0) } else { 0 };
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
    let mut krow = [std::ptr::null::<u8>(); CHUNK];
    let mut vrow = [std::ptr::null::<u8>(); CHUNK];
    let mut c0 = c.p0;
    while c0 < c.ctx {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        c.prefetch(c0 + n, CHUNK, pv * 16 * if c.is_f16 { 2 } else { 4 });
        for j in 0..CHUNK {
            let jj = if j < n { j } else { 0 };
            if SCR {
                if j < n {
                    let (kr, vr) = (c.kb.add(kp[j]), c.vb.add(kp[j]));
                    for i in 0..pv {
                        kbuf[j * pv + i] = ld512(kr.add(32 * i), true);
                        vbuf[j * pv + i] = ld512(vr.add(32 * i), true);
                    }
                }
                krow[j] = kbuf.as_ptr().add(jj * pv) as *const u8;
                vrow[j] = vbuf.as_ptr().add(jj * pv) as *const u8;
            } else {
                krow[j] = c.kb.add(kp[jj]);
                vrow[j] = c.vb.add(kp[jj]);
            }
        }
        for r in 0..rows {
            let (ti, h) = (r / per_tok, r % per_tok);
            // This row's group within the position rows: `go` bytes in.
            let go = (h / gs) * hd * es;
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
                    let mut d = _mm512_mul_ps(qv[0], ldv::<CV>(kr));
                    for (i, qv) in qv.iter().enumerate().skip(1) {
                        d = _mm512_fmadd_ps(*qv, ldv::<CV>(kr.add(16 * i * es)), d);
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
                    a0[i] = _mm512_fmadd_ps(p0, ldv::<CV>(v0.add(16 * i * es)), a0[i]);
                    a1[i] = _mm512_fmadd_ps(p1, ldv::<CV>(v1.add(16 * i * es)), a1[i]);
                }
                j += 2;
            }
            if j < nr {
                let p0 = _mm512_set1_ps(s[j]);
                let v0 = vrow[j].add(go);
                for (i, a0) in a0.iter_mut().enumerate() {
                    *a0 = _mm512_fmadd_ps(p0, ldv::<CV>(v0.add(16 * i * es)), *a0);
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

/// [`attn_512_rows`] for one query token whose `R` = gs heads per kv group are computed
/// together: each position's K and V vectors are loaded (and converted) once per group and
/// used by all `R` rows, instead of once per row. Every row's arithmetic is that of
/// [`attn_512_rows`] (the same products, the same [`reduce16`] tree four positions at a time,
/// the same softmax and even/odd P·V sums), so a token gets the same bits here as in a
/// prefill tile.
// Indices address several arrays at once (rows × positions × vectors).
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attn_512_group<const HV: usize, const CV: bool, const R: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let ng = c.ng;
    let es = if CV { 2 } else { 4 };
    let rows = R * ng;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut s = [[0f32; CHUNK]; R];
    let mut kpn = [usize::MAX; CHUNK];
    let mut scratch = ATTN_SCRATCH.take();
    if scratch.len() < rows * HV {
        scratch.resize(rows * HV, _mm512_setzero_ps());
    }
    let acc = &mut scratch[..rows * HV];
    acc.fill(_mm512_setzero_ps());
    let mut krow = [std::ptr::null::<u8>(); CHUNK];
    let mut vrow = [std::ptr::null::<u8>(); CHUNK];
    let sc = _mm512_set1_ps(c.scale);
    let end = c.ctx0.min(c.ctx);
    let mut c0 = c.p0;
    while c0 < end {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        // The next chunk into L1, the one after into L2 (L1 holds two chunks of a decode
        // token's K/V at most; measured `examples/perf` ATTN_BATCH=16x144: ~4 % less CPU time
        // than the next chunk alone).
        // The next chunk's K/V, prefetched position by position as this chunk's scores are
        // computed (below), not in one burst: a burst of 384 prefetches stalls the core on
        // the miss buffers (`examples/perf` ATTN_BATCH=16x144, one thread: 5.6 -> 4.4 ms).
        let n2 = (c.ctx - c0 - n).min(CHUNK);
        c.offsets(c0 + n, &mut kpn[..n2]);
        kpn[n2..].fill(usize::MAX);
        for j in 0..CHUNK {
            let jj = if j < n { j } else { 0 };
            krow[j] = c.kb.add(kp[jj]);
            vrow[j] = c.vb.add(kp[jj]);
        }
        let nr = (end - c0).min(n);
        for gg in 0..ng {
            let go = gg * hd * es;
            let rb = gg * R;
            let mut qv = [[_mm512_setzero_ps(); HV]; R];
            for (r, qv) in qv.iter_mut().enumerate() {
                let qh = c.qp.add((rb + r) * hd);
                for (i, qv) in qv.iter_mut().enumerate() {
                    *qv = _mm512_mul_ps(_mm512_loadu_ps(qh.add(16 * i)), sc);
                }
            }
            // Scores, 16 positions at a time, reduced four positions at a time.
            let mut cmax = [_mm512_set1_ps(f32::NEG_INFINITY); R];
            let mut j = 0;
            while j < nr {
                let cnt = (nr - j).min(16);
                let mut x = [[_mm512_setzero_ps(); 4]; R];
                for quad in 0..4 {
                    let mut d = [[_mm512_setzero_ps(); 4]; R];
                    for jj in 0..4 {
                        let pj = j + 4 * quad + jj;
                        if pj < CHUNK && kpn[pj] != usize::MAX {
                            let o = kpn[pj] + go;
                            super::prefetch_lines(c.kb.wrapping_add(o), HV * 16 * es);
                            super::prefetch_lines(c.vb.wrapping_add(o), HV * 16 * es);
                        }
                        let kr = krow[pj.min(CHUNK - 1)].add(go);
                        let mut kv = [_mm512_setzero_ps(); HV];
                        for (i, kv) in kv.iter_mut().enumerate() {
                            *kv = ldv::<CV>(kr.add(16 * i * es));
                        }
                        for r in 0..R {
                            let mut dd = _mm512_mul_ps(qv[r][0], kv[0]);
                            for i in 1..HV {
                                dd = _mm512_fmadd_ps(qv[r][i], kv[i], dd);
                            }
                            d[r][jj] = dd;
                        }
                    }
                    for r in 0..R {
                        x[r][quad] = reduce16_quad(&d[r]);
                    }
                }
                let m: __mmask16 = if cnt == 16 {
                    0xffff
                } else {
                    ((1u32 << cnt) - 1) as __mmask16
                };
                for r in 0..R {
                    let rv = reduce16_combine(&x[r]);
                    cmax[r] = _mm512_mask_max_ps(cmax[r], m, cmax[r], rv);
                    _mm512_mask_storeu_ps(s[r].as_mut_ptr().add(j), m, rv);
                }
                j += 16;
            }
            // Online softmax over the chunk, per row.
            let mut al = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let row = rb + r;
                let new_m = mx[row].max(_mm512_reduce_max_ps(cmax[r]));
                let alpha = if mx[row] == f32::NEG_INFINITY {
                    0.0
                } else {
                    (mx[row] - new_m).exp()
                };
                mx[row] = new_m;
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
                        _mm512_maskz_loadu_ps(m, s[r].as_ptr().add(j)),
                        nm,
                    ));
                    let e = _mm512_maskz_mov_ps(m, e);
                    sum = _mm512_add_ps(sum, e);
                    _mm512_storeu_ps(s[r].as_mut_ptr().add(j), e);
                    j += 16;
                }
                lsum[row] = lsum[row] * alpha + _mm512_reduce_add_ps(sum);
                al[r] = _mm512_set1_ps(alpha);
            }
            // P·V: even positions into a0, odd ones into a1 (as attn_512_rows).
            let mut a0 = [[_mm512_setzero_ps(); HV]; R];
            let mut a1 = [[_mm512_setzero_ps(); HV]; R];
            for r in 0..R {
                for i in 0..HV {
                    a0[r][i] = _mm512_mul_ps(acc[(rb + r) * HV + i], al[r]);
                }
            }
            let mut j = 0;
            while j < nr {
                let v0 = vrow[j].add(go);
                let mut vv = [_mm512_setzero_ps(); HV];
                for (i, vv) in vv.iter_mut().enumerate() {
                    *vv = ldv::<CV>(v0.add(16 * i * es));
                }
                let odd = j % 2 == 1;
                for r in 0..R {
                    let p = _mm512_set1_ps(s[r][j]);
                    let a = if odd { &mut a1[r] } else { &mut a0[r] };
                    for i in 0..HV {
                        a[i] = _mm512_fmadd_ps(p, vv[i], a[i]);
                    }
                }
                j += 1;
            }
            for r in 0..R {
                for i in 0..HV {
                    acc[(rb + r) * HV + i] = _mm512_add_ps(a0[r][i], a1[r][i]);
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;

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
