//! Attention of many query rows over one K/V stream, vectorised across the rows: the kernel of
//! a prefill chunk, and above all of a short chunk over a long cached context (the last 16
//! tokens of a 2,000-token prompt after a KV load: 16 tokens × 3 heads = 48 rows per kv group).
//!
//! The rows of a pass (its `nq` tokens × the `gs` heads of one kv group, at most 64) sit in
//! the lanes of `NV` vectors. Per tile of [`TP`] positions, each K/V row is read once
//! (converted from f16 once) for all the rows:
//! * scores `Sᵀ[p][rows] = Σ_d K[p][d] · Qᵀ[d][rows]`: a register block of positions × row
//!   vectors, one broadcast K element and one load of `Qᵀ` per FMA group, no horizontal sums;
//! * the online softmax is vertical too (running max, rescale and sum per lane);
//! * `Oᵀ[d][rows] += Σ_p V[p][d] · Pᵀ[p][rows]`: a register block of dims × row vectors.
//!
//! One macro body is instantiated for AVX-512 (16 lanes) and for AVX2 (8 lanes). Every lane
//! does the same operations in the same order on both (the same FMA chains over `d` and over
//! `p`, the same `exp`), so the two levels give bit-identical results (tested).

use std::arch::x86_64::*;

use super::avx2::exp256;
use super::avx512::exp512;
use super::AttnCtx;

/// Positions per tile (each K/V row of the tile is converted once for every row).
pub(crate) const TP: usize = 32;

/// Most rows (tokens × heads) of one pass.
pub(crate) const MAX_ROWS: usize = 64;

macro_rules! rows_kernel {
    (
        $name:ident, $feat:literal, $V:ty, $W:literal,
        // row vectors per register block of the score and P·V loops
        rb = $RB:expr,
        // positions per score block and dims per P·V block, for blocks of 1, 2, 3, 4 row vectors
        pb = ($P1:literal, $P2:literal, $P3:literal, $P4:literal),
        db = ($D1:literal, $D2:literal, $D3:literal, $D4:literal),
        zero = $zero:ident, set1 = $set1:ident, load = $load:ident, store = $store:ident,
        fma = $fma:ident, mul = $mul:ident, add = $add:ident, max = $max:ident,
        exp = $exp:ident, cvt = $cvt:expr, mask_tok = $mask_tok:ident, pexp = $pexp:ident,
        safe_max = $safe_max:ident, sub = $sub:ident, scratch = $SCR:ident
    ) => {
        thread_local! {
            static $SCR: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
        }

        /// Scores of positions `j..j + P` for row vectors `rb..rb + R`.
        #[target_feature(enable = $feat)]
        #[inline]
        unsafe fn qk_block<const R: usize, const P: usize>(
            qt: *const f32,
            nvw: usize,
            kr: &[*const f32],
            hd: usize,
            st: *mut f32,
        ) {
            let mut acc = [[$zero(); R]; P];
            for d in 0..hd {
                let mut q = [$zero(); R];
                for (r, q) in q.iter_mut().enumerate() {
                    *q = $load(qt.add(d * nvw + r * $W));
                }
                for p in 0..P {
                    let b = $set1(*kr[p].add(d));
                    for r in 0..R {
                        acc[p][r] = $fma(b, q[r], acc[p][r]);
                    }
                }
            }
            for p in 0..P {
                for r in 0..R {
                    $store(st.add(p * nvw + r * $W), acc[p][r]);
                }
            }
        }

        /// `Oᵀ[d0..d0 + D][rb..rb + R] = Oᵀ · α + Σ_j V[j][d] · Pᵀ[j]` over the tile's `n` positions.
        #[target_feature(enable = $feat)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        unsafe fn pv_block<const R: usize, const D: usize>(
            ot: *mut f32,
            alpha: *const f32,
            st: *const f32,
            nvw: usize,
            vr: &[*const f32],
            n: usize,
            d0: usize,
        ) {
            let mut acc = [[$zero(); R]; D];
            for (dd, acc) in acc.iter_mut().enumerate() {
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = $mul($load(ot.add(dd * nvw + r * $W)), $load(alpha.add(r * $W)));
                }
            }
            for (j, vr) in vr.iter().enumerate().take(n) {
                let mut p = [$zero(); R];
                for (r, p) in p.iter_mut().enumerate() {
                    *p = $load(st.add(j * nvw + r * $W));
                }
                for dd in 0..D {
                    let b = $set1(*vr.add(d0 + dd));
                    for r in 0..R {
                        acc[dd][r] = $fma(b, p[r], acc[dd][r]);
                    }
                }
            }
            for (dd, acc) in acc.iter().enumerate() {
                for (r, a) in acc.iter().enumerate() {
                    $store(ot.add(dd * nvw + r * $W), *a);
                }
            }
        }

        /// Scores of the tile for row vectors `rb..rb + R` (all positions).
        #[target_feature(enable = $feat)]
        #[inline]
        unsafe fn qk_rows<const R: usize, const P: usize>(
            qt: *const f32,
            nvw: usize,
            kr: &[*const f32],
            n: usize,
            hd: usize,
            st: *mut f32,
        ) {
            let mut j = 0;
            while j + P <= n {
                qk_block::<R, P>(qt, nvw, &kr[j..j + P], hd, st.add(j * nvw));
                j += P;
            }
            while j < n {
                qk_block::<R, 1>(qt, nvw, &kr[j..j + 1], hd, st.add(j * nvw));
                j += 1;
            }
        }

        /// P·V of the tile for row vectors `rb..rb + R` (all dims).
        #[target_feature(enable = $feat)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        unsafe fn pv_rows<const R: usize, const D: usize>(
            ot: *mut f32,
            alpha: *const f32,
            st: *const f32,
            nvw: usize,
            vr: &[*const f32],
            n: usize,
            hd: usize,
        ) {
            let mut d0 = 0;
            while d0 + D <= hd {
                pv_block::<R, D>(ot.add(d0 * nvw), alpha, st, nvw, vr, n, d0);
                d0 += D;
            }
            while d0 < hd {
                pv_block::<R, 1>(ot.add(d0 * nvw), alpha, st, nvw, vr, n, d0);
                d0 += 1;
            }
        }

        /// Attention of the pass's rows (`c.nq` tokens × `c.gs` heads of one kv group, `NV`
        /// vectors of lanes) over positions `c.p0..c.ctx`; writes `[m, l, acc[hd]]` per row.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn $name<const NV: usize>(c: &AttnCtx) {
            const W: usize = $W;
            let rbn: usize = $RB;
            let hd = c.hd;
            let gs = c.gs;
            let rows = c.nq * gs;
            debug_assert!(c.ng == 1 && rows <= NV * W && rows > (NV - 1) * W);
            let nvw = NV * W;
            let esz = if c.is_f16 { 2 } else { 4 };
            // Scratch: Qᵀ (scaled), Oᵀ, Sᵀ/Pᵀ, α, m, l, the lanes' token index, and the f32
            // copies of a tile's K and V rows.
            let kv_f32 = if c.is_f16 { 2 * TP * hd } else { 0 };
            let need = 2 * hd * nvw + TP * nvw + 4 * nvw + kv_f32;
            let mut scratch = $SCR.take();
            if scratch.len() < need {
                scratch.resize(need, 0.0);
            }
            let (qt, rest) = scratch.split_at_mut(hd * nvw);
            let (ot, rest) = rest.split_at_mut(hd * nvw);
            let (st, rest) = rest.split_at_mut(TP * nvw);
            let (alpha, rest) = rest.split_at_mut(nvw);
            let (mx, rest) = rest.split_at_mut(nvw);
            let (ls, rest) = rest.split_at_mut(nvw);
            let (tok, rest) = rest.split_at_mut(nvw);
            let (kf, rest) = rest.split_at_mut(kv_f32 / 2);
            let vf = &mut rest[..kv_f32 / 2];
            for r in 0..nvw {
                // Padding lanes act as the last token with a zero query (never written out).
                let (ti, h) = if r < rows {
                    (r / gs, r % gs)
                } else {
                    (c.nq - 1, 0)
                };
                tok[r] = ti as f32;
                for d in 0..hd {
                    qt[d * nvw + r] = if r < rows {
                        *c.qp.add(ti * c.qstride + h * hd + d) * c.scale
                    } else {
                        0.0
                    };
                }
            }
            ot.fill(0.0);
            mx.fill(f32::NEG_INFINITY);
            ls.fill(0.0);
            let mut kp = [0usize; TP];
            let mut kr = [std::ptr::null::<f32>(); TP];
            let mut vr = [std::ptr::null::<f32>(); TP];
            let mut c0 = c.p0;
            while c0 < c.ctx {
                let n = (c.ctx - c0).min(TP);
                c.offsets(c0, &mut kp[..n]);
                c.prefetch(c0 + n, TP, hd * esz);
                for j in 0..n {
                    if c.is_f16 {
                        let (ks, vs) = (c.kb.add(kp[j]), c.vb.add(kp[j]));
                        let (kd, vd) = (kf.as_mut_ptr().add(j * hd), vf.as_mut_ptr().add(j * hd));
                        let mut d = 0;
                        while d < hd {
                            $store(kd.add(d), $cvt(ks.add(2 * d)));
                            $store(vd.add(d), $cvt(vs.add(2 * d)));
                            d += W;
                        }
                        kr[j] = kd;
                        vr[j] = vd;
                    } else {
                        kr[j] = c.kb.add(kp[j]) as *const f32;
                        vr[j] = c.vb.add(kp[j]) as *const f32;
                    }
                }
                // Scores.
                let mut rb = 0;
                while rb < NV {
                    let (q, s) = (qt.as_ptr().add(rb * W), st.as_mut_ptr().add(rb * W));
                    match (NV - rb).min(rbn) {
                        1 => qk_rows::<1, $P1>(q, nvw, &kr, n, hd, s),
                        2 => qk_rows::<2, $P2>(q, nvw, &kr, n, hd, s),
                        3 => qk_rows::<3, $P3>(q, nvw, &kr, n, hd, s),
                        _ => qk_rows::<4, $P4>(q, nvw, &kr, n, hd, s),
                    }
                    rb += rbn;
                }
                // Causal mask: position c0 + j is past the end of the lanes whose token index
                // is below c0 + j - ctx0 + 1.
                let first_masked = c.ctx0.saturating_sub(c0);
                for j in first_masked..n {
                    let thr = $set1((c0 + j + 1 - c.ctx0) as f32);
                    for v in 0..NV {
                        let p = st.as_mut_ptr().add(j * nvw + v * W);
                        $store(p, $mask_tok($load(p), $load(tok.as_ptr().add(v * W)), thr));
                    }
                }
                // Online softmax, per lane.
                for v in 0..NV {
                    let o = v * W;
                    let mut cm = $set1(f32::NEG_INFINITY);
                    for j in 0..n {
                        cm = $max(cm, $load(st.as_ptr().add(j * nvw + o)));
                    }
                    let m_old = $load(mx.as_ptr().add(o));
                    let m_new = $max(m_old, cm);
                    let ms = $safe_max(m_new);
                    $store(alpha.as_mut_ptr().add(o), $exp($sub(m_old, ms)));
                    $store(mx.as_mut_ptr().add(o), m_new);
                    let mut t = $zero();
                    for j in 0..n {
                        let p = st.as_mut_ptr().add(j * nvw + o);
                        let e = $pexp($load(p), ms);
                        $store(p, e);
                        t = $add(t, e);
                    }
                    let l = $load(ls.as_ptr().add(o));
                    $store(
                        ls.as_mut_ptr().add(o),
                        $fma(l, $load(alpha.as_ptr().add(o)), t),
                    );
                }
                // P·V.
                let mut rb = 0;
                while rb < NV {
                    let o = rb * W;
                    let (op, ap, sp) = (
                        ot.as_mut_ptr().add(o),
                        alpha.as_ptr().add(o),
                        st.as_ptr().add(o),
                    );
                    match (NV - rb).min(rbn) {
                        1 => pv_rows::<1, $D1>(op, ap, sp, nvw, &vr, n, hd),
                        2 => pv_rows::<2, $D2>(op, ap, sp, nvw, &vr, n, hd),
                        3 => pv_rows::<3, $D3>(op, ap, sp, nvw, &vr, n, hd),
                        _ => pv_rows::<4, $D4>(op, ap, sp, nvw, &vr, n, hd),
                    }
                    rb += rbn;
                }
                c0 += n;
            }
            for r in 0..rows {
                let ph = c.op.add(r * (hd + 2));
                *ph = mx[r];
                *ph.add(1) = ls[r];
                for d in 0..hd {
                    *ph.add(2 + d) = ot[d * nvw + r];
                }
            }
            $SCR.set(scratch);
        }
    };
}

// ------------------------------------------------------------------ AVX-512

mod v512 {
    use super::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    #[inline]
    unsafe fn cvt(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }

    /// `s` where the lane's token index is at least `thr`, else −∞.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    #[inline]
    unsafe fn mask_tok(s: __m512, tok: __m512, thr: __m512) -> __m512 {
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(tok, thr);
        _mm512_mask_blend_ps(keep, _mm512_set1_ps(f32::NEG_INFINITY), s)
    }

    /// `exp(s − m)`, exactly 0 where `s` is −∞ (masked).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    #[inline]
    unsafe fn pexp(s: __m512, m: __m512) -> __m512 {
        let live = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(s, _mm512_set1_ps(f32::NEG_INFINITY));
        _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, m)))
    }

    /// The running max to subtract: 0 where it is still −∞ (no position seen).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    #[inline]
    unsafe fn safe_max(m: __m512) -> __m512 {
        let seen = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(m, _mm512_set1_ps(f32::NEG_INFINITY));
        _mm512_maskz_mov_ps(seen, m)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    #[inline]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        _mm512_sub_ps(a, b)
    }

    rows_kernel!(
        attn_rows_512,
        "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
        __m512,
        16,
        rb = NV,
        pb = (8, 8, 8, 6),
        db = (8, 8, 8, 4),
        zero = _mm512_setzero_ps,
        set1 = _mm512_set1_ps,
        load = _mm512_loadu_ps,
        store = _mm512_storeu_ps,
        fma = _mm512_fmadd_ps,
        mul = _mm512_mul_ps,
        add = _mm512_add_ps,
        max = _mm512_max_ps,
        exp = exp512,
        cvt = cvt,
        mask_tok = mask_tok,
        pexp = pexp,
        safe_max = safe_max,
        sub = sub,
        scratch = SCRATCH_512
    );
}

// ------------------------------------------------------------------ AVX2

mod v256 {
    use super::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn cvt(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// `s` where the lane's token index is at least `thr`, else −∞.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn mask_tok(s: __m256, tok: __m256, thr: __m256) -> __m256 {
        let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(tok, thr);
        _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), s, keep)
    }

    /// `exp(s − m)`, exactly 0 where `s` is −∞ (masked).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn pexp(s: __m256, m: __m256) -> __m256 {
        let live = _mm256_cmp_ps::<_CMP_NEQ_OQ>(s, _mm256_set1_ps(f32::NEG_INFINITY));
        _mm256_and_ps(live, exp256(_mm256_sub_ps(s, m)))
    }

    /// The running max to subtract: 0 where it is still −∞ (no position seen).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn safe_max(m: __m256) -> __m256 {
        let seen = _mm256_cmp_ps::<_CMP_NEQ_OQ>(m, _mm256_set1_ps(f32::NEG_INFINITY));
        _mm256_and_ps(seen, m)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        _mm256_sub_ps(a, b)
    }

    rows_kernel!(
        attn_rows_avx2,
        "avx2,fma,f16c",
        __m256,
        8,
        rb = 2,
        pb = (6, 6, 6, 6),
        db = (4, 4, 4, 4),
        zero = _mm256_setzero_ps,
        set1 = _mm256_set1_ps,
        load = _mm256_loadu_ps,
        store = _mm256_storeu_ps,
        fma = _mm256_fmadd_ps,
        mul = _mm256_mul_ps,
        add = _mm256_add_ps,
        max = _mm256_max_ps,
        exp = exp256,
        cvt = cvt,
        mask_tok = mask_tok,
        pexp = pexp,
        safe_max = safe_max,
        sub = sub,
        scratch = SCRATCH_256
    );
}

pub(crate) use v256::attn_rows_avx2;
pub(crate) use v512::attn_rows_512;
