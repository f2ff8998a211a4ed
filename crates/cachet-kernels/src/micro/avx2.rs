//! AVX2 micro-kernels (AVX2 + FMA + F16C): int8 matmul tiles with `vpmaddubsw`, the f32 dot,
//! SwiGLU, and paged attention over 8-lane rows.

use std::arch::x86_64::*;

use super::{AttnCtx, TileJob, CHUNK};
use crate::formats::packed::{Fmt, GROUP};

// ------------------------------------------------------------------ f32 dot

#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_f32_avx2(a: *const f32, b: *const f32, n: usize) -> f32 {
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

/// AVX2 micro-kernel over the same layout: each 16-row group is two 8-lane halves; int8
/// products via `vpmaddubsw` (4-bit codes accumulate in i16 across a block without
/// overflow; 8-bit codes use the sign trick on `code - 128` and widen every step).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_avx2<F: Fmt, const MR: usize, const NG: usize>(job: &TileJob) {
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
pub(crate) unsafe fn exp256(x: __m256) -> __m256 {
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
pub(crate) unsafe fn attn_avx2<const HV: usize>(c: &AttnCtx) {
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

// ------------------------------------------------------------------ SwiGLU

/// AVX2 version of [`swiglu_512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn swiglu_avx2(g: *const f32, u: *const f32, o: *mut f32, n: usize) {
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
