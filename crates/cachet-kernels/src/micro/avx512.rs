//! AVX-512 micro-kernels (F/BW/VL/DQ + VNNI): int8 matmul tiles with `vpdpbusd`, activation
//! quantization, the f32 dot, SwiGLU and the vector exp; paged attention is in `avx512_attn`.

use std::arch::x86_64::*;

use super::TileJob;
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

// ------------------------------------------------------------------ exp

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
