//! AVX2 micro-kernels (AVX2 + FMA + F16C): activation quantization, the f32 dot, SwiGLU and
//! the vector exponential. The matmul tiles are in `super::avx2_tile`, attention in
//! `super::avx2_attn`.

use std::arch::x86_64::*;

// ------------------------------------------------------------------ activation quantization

/// Quantize one row into int8 blocks of `bk` (a multiple of 16): the same bytes, scales and
/// sums as the AVX-512 and portable versions (round half to even, saturating packs).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_act_row_avx2(
    x: &[f32],
    bk: usize,
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
    debug_assert!(bk.is_multiple_of(16) && q.len() >= x.len());
    let nb = x.len() / bk;
    let absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // packs interleave 128-bit lanes; this puts the 4-byte groups back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nb {
        let xp = x.as_ptr().add(b * bk);
        let mut mx = _mm256_setzero_ps();
        for v in 0..bk / 8 {
            mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xp.add(8 * v)), absmask));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
        let db = amax / 127.0;
        let id = _mm256_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
        let mut sum = _mm256_setzero_si256();
        for u in 0..bk / 16 {
            let q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp.add(16 * u)), id));
            let q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp.add(16 * u + 8)), id));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(q0, q1));
            let w = _mm256_packs_epi32(q0, q1);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w, w), order);
            _mm_storeu_si128(
                q.as_mut_ptr().add(b * bk + 16 * u) as *mut __m128i,
                _mm256_castsi256_si128(bytes),
            );
        }
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        let total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
        d[b] = db;
        s[b] = db * total as f32;
    }
}

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

// ------------------------------------------------------------------ attention

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

// ------------------------------------------------------------------ SwiGLU

/// AVX2 version of [`super::avx512::swiglu_512`].
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

// ------------------------------------------------------------------ RMS norm pieces

/// `Σ x²` over `n` values in the scalar version's order exactly (see
/// `super::scalar::sum_squares`): four independent FMA chains over blocks of 32, so the
/// latency of one chain does not bound the loop.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sum_squares_avx2(x: *const f32, n: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let v = _mm256_loadu_ps(x.add(i + 8 * k));
            *a = _mm256_fmadd_ps(v, v, *a);
        }
        i += 32;
    }
    while i + 8 <= n {
        let v = _mm256_loadu_ps(x.add(i));
        acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
        i += 8;
    }
    let t = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let mut s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    while i < n {
        let v = *x.add(i);
        s = v.mul_add(v, s);
        i += 1;
    }
    s
}

/// `out[i] = x[i] * r * w[i]` for `i < n`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scale_mul_avx2(x: *const f32, r: f32, w: *const f32, out: *mut f32, n: usize) {
    let rv = _mm256_set1_ps(r);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(i)), rv);
        _mm256_storeu_ps(out.add(i), _mm256_mul_ps(v, _mm256_loadu_ps(w.add(i))));
        i += 8;
    }
    while i < n {
        *out.add(i) = *x.add(i) * r * *w.add(i);
        i += 1;
    }
}

/// `x[i] += d[i]` for `i < n`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn add_assign_avx2(x: *mut f32, d: *const f32, n: usize) {
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_add_ps(_mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(d.add(i)));
        _mm256_storeu_ps(x.add(i), v);
        i += 8;
    }
    while i < n {
        *x.add(i) += *d.add(i);
        i += 1;
    }
}
