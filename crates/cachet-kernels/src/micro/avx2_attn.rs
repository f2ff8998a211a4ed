//! AVX2 paged attention: the structure of the AVX-512 kernel (`super::avx512::attn_512`) on
//! 8-lane vectors. A pass takes a tile of `nq` query tokens × the heads of `ng` consecutive
//! kv groups (at most 64 rows): per chunk of positions and kv group, f16 K/V rows are
//! converted once into an f32 scratch (16 KB for head_dim 64, in L1) shared by every row of
//! the tile in that group; scores for 8 positions at a time with a
//! transposed reduction; one online-softmax rescale per chunk and row; then P·V with the
//! row's accumulators in registers. Rows past their causal end skip the chunk's tail.

use std::arch::x86_64::*;

use super::avx2::exp256;
use super::{AttnCtx, CHUNK};

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ld256(p: *const u8, is_f16: bool) -> __m256 {
    if is_f16 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// Horizontal sums of 8 vectors: lane `j` of the result is the sum of `v[j]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn reduce8(v: &[__m256; 8]) -> __m256 {
    reduce8_combine(
        reduce8_quad(&[v[0], v[1], v[2], v[3]]),
        reduce8_quad(&[v[4], v[5], v[6], v[7]]),
    )
}

/// First two levels of [`reduce8`] on four vectors: per 128-bit lane, the partial sums of
/// `v[0..4]`. Split out so that the grouped kernel reduces four positions at a time with the
/// very same operations (the same bits) as a whole [`reduce8`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn reduce8_quad(v: &[__m256; 4]) -> __m256 {
    _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]))
}

/// Last level of [`reduce8`]: the two [`reduce8_quad`] results into the 8 sums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn reduce8_combine(u0: __m256, u1: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_permute2f128_ps(u0, u1, 0x20),
        _mm256_permute2f128_ps(u0, u1, 0x31),
    )
}

/// Largest lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hmax256(v: __m256) -> f32 {
    let x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)))
}

/// Sum of the lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
    let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)))
}

/// All-ones in the lanes below `n` (0..=8).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lanes_below(n: usize) -> __m256 {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx))
}

thread_local! {
    /// Reused buffers of [`attn_avx2`].
    static ATTN_SCRATCH: std::cell::Cell<Vec<__m256>> = const { std::cell::Cell::new(Vec::new()) };
}

/// AVX2 attention for a tile of `nq` query tokens × the heads of `ng` kv groups (`HV` =
/// head_dim / 8 vectors per row); see the module docs.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn attn_avx2<const HV: usize>(c: &AttnCtx) {
    if c.nq == 1 {
        match (c.gs, c.is_f16) {
            (1, true) => return attn_avx2_group::<HV, true, 1>(c),
            (2, true) => return attn_avx2_group::<HV, true, 2>(c),
            (3, true) => return attn_avx2_group::<HV, true, 3>(c),
            (4, true) => return attn_avx2_group::<HV, true, 4>(c),
            (1, false) => return attn_avx2_group::<HV, false, 1>(c),
            (2, false) => return attn_avx2_group::<HV, false, 2>(c),
            (3, false) => return attn_avx2_group::<HV, false, 3>(c),
            (4, false) => return attn_avx2_group::<HV, false, 4>(c),
            _ => {}
        }
    }
    attn_avx2_rows::<HV>(c)
}

/// [`attn_avx2`] one row after another (any tile).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attn_avx2_rows<const HV: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let gs = c.gs;
    let ng = c.ng;
    // Row r: token r / (gs·ng), head (r % (gs·ng)) of the pass, in group (r % (gs·ng)) / gs.
    let per_tok = gs * ng;
    let rows = (c.nq * per_tok).min(64);
    // Vectors per position in the f32 copies (one group at a time: a decode token's chunk of
    // all groups would be 48 KB of scratch, more than L1; one group's is 16 KB).
    let pv = HV;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut kpn = [0usize; CHUNK];
    let mut s = [0f32; CHUNK];
    let buf_rows = if c.is_f16 { CHUNK.min(c.ctx - c.p0) } else { 0 };
    let mut scratch = ATTN_SCRATCH.take();
    let need = rows * HV + 2 * buf_rows * pv;
    if scratch.len() < need {
        scratch.resize(need, _mm256_setzero_ps());
    }
    let (acc, rest) = scratch.split_at_mut(rows * HV);
    acc.fill(_mm256_setzero_ps());
    let (kbuf, rest) = rest.split_at_mut(buf_rows * pv);
    let vbuf = &mut rest[..buf_rows * pv];
    let mut krow = [std::ptr::null::<f32>(); CHUNK];
    let mut vrow = [std::ptr::null::<f32>(); CHUNK];
    let mut c0 = c.p0;
    while c0 < c.ctx {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        // The next chunk's K/V, prefetched position by position as this chunk is converted
        // (as `attn_512`'s decode rows do; a burst of prefetches stalls on the miss buffers).
        let n2 = (c.ctx - c0 - n).min(CHUNK);
        c.offsets(c0 + n, &mut kpn[..n2]);
        let esz = if c.is_f16 { 2 } else { 4 };
        for gg in 0..ng {
            for j in 0..CHUNK {
                if j < n2 {
                    let o = kpn[j] + gg * hd * esz;
                    super::prefetch_lines(c.kb.wrapping_add(o), HV * 8 * esz);
                    super::prefetch_lines(c.vb.wrapping_add(o), HV * 8 * esz);
                }
                let jj = if j < n { j } else { 0 };
                if c.is_f16 {
                    if j < n {
                        let off = kp[j] + gg * c.hd * 2;
                        let (kr, vr) = (c.kb.add(off), c.vb.add(off));
                        for i in 0..pv {
                            kbuf[j * pv + i] = ld256(kr.add(16 * i), true);
                            vbuf[j * pv + i] = ld256(vr.add(16 * i), true);
                        }
                    }
                    krow[j] = kbuf.as_ptr().add(jj * pv) as *const f32;
                    vrow[j] = vbuf.as_ptr().add(jj * pv) as *const f32;
                } else {
                    krow[j] = (c.kb.add(kp[jj]) as *const f32).add(gg * hd);
                    vrow[j] = (c.vb.add(kp[jj]) as *const f32).add(gg * hd);
                }
            }
            for rr in 0..c.nq * gs {
                let (ti, h) = (rr / gs, gg * gs + rr % gs);
                let r = ti * per_tok + h;
                if r >= rows {
                    continue;
                }
                // causal end of this row within the chunk
                let end = (c.ctx0 + ti).min(c.ctx);
                if end <= c0 {
                    continue;
                }
                let nr = (end - c0).min(n);
                let qh = c.qp.add(ti * c.qstride + h * hd);
                let mut qv = [_mm256_setzero_ps(); HV];
                for (i, qv) in qv.iter_mut().enumerate() {
                    *qv = _mm256_mul_ps(_mm256_loadu_ps(qh.add(8 * i)), _mm256_set1_ps(c.scale));
                }
                let mut cmax = _mm256_set1_ps(f32::NEG_INFINITY);
                let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
                let mut j = 0;
                while j < nr {
                    let cnt = (nr - j).min(8);
                    let mut dv = [_mm256_setzero_ps(); 8];
                    for (jj, dv) in dv.iter_mut().enumerate() {
                        let kr = krow[(j + jj).min(CHUNK - 1)];
                        let mut d = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
                        for (i, qv) in qv.iter().enumerate().skip(1) {
                            d = _mm256_fmadd_ps(*qv, _mm256_loadu_ps(kr.add(8 * i)), d);
                        }
                        *dv = d;
                    }
                    let rv = _mm256_blendv_ps(ninf, reduce8(&dv), lanes_below(cnt));
                    cmax = _mm256_max_ps(cmax, rv);
                    _mm256_storeu_ps(s.as_mut_ptr().add(j), rv);
                    j += 8;
                }
                // online softmax over the chunk
                let new_m = mx[r].max(hmax256(cmax));
                let alpha = if mx[r] == f32::NEG_INFINITY {
                    0.0
                } else {
                    (mx[r] - new_m).exp()
                };
                mx[r] = new_m;
                let nm = _mm256_set1_ps(new_m);
                let mut sum = _mm256_setzero_ps();
                let mut j = 0;
                while j < nr {
                    let valid = lanes_below((nr - j).min(8));
                    let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(j)), nm));
                    let e = _mm256_and_ps(e, valid);
                    sum = _mm256_add_ps(sum, e);
                    _mm256_storeu_ps(s.as_mut_ptr().add(j), e);
                    j += 8;
                }
                lsum[r] = lsum[r] * alpha + hsum256(sum);
                // P·V; with fewer than 8 vectors per row, two accumulator sets (even/odd
                // positions) hide the FMA latency.
                let al = _mm256_set1_ps(alpha);
                let mut a0 = [_mm256_setzero_ps(); HV];
                for (i, a0) in a0.iter_mut().enumerate() {
                    *a0 = _mm256_mul_ps(acc[r * HV + i], al);
                }
                let mut j = 0;
                if HV < 8 {
                    let mut a1 = [_mm256_setzero_ps(); HV];
                    while j + 2 <= nr {
                        let (p0, p1) = (_mm256_set1_ps(s[j]), _mm256_set1_ps(s[j + 1]));
                        let (v0, v1) = (vrow[j], vrow[j + 1]);
                        for i in 0..HV {
                            a0[i] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0.add(8 * i)), a0[i]);
                            a1[i] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1.add(8 * i)), a1[i]);
                        }
                        j += 2;
                    }
                    for i in 0..HV {
                        a0[i] = _mm256_add_ps(a0[i], a1[i]);
                    }
                }
                while j < nr {
                    let p0 = _mm256_set1_ps(s[j]);
                    let v0 = vrow[j];
                    for (i, a0) in a0.iter_mut().enumerate() {
                        *a0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0.add(8 * i)), *a0);
                    }
                    j += 1;
                }
                acc[r * HV..(r + 1) * HV].copy_from_slice(&a0);
            }
        }
        c0 += n;
    }
    for r in 0..rows {
        let ph = c.op.add(r * (hd + 2));
        *ph = mx[r];
        *ph.add(1) = lsum[r];
        for i in 0..HV {
            _mm256_storeu_ps(ph.add(2 + 8 * i), acc[r * HV + i]);
        }
    }
    ATTN_SCRATCH.set(scratch);
}

/// Load 8 lanes at `p`: f16 converted (`CV`) or f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ldv<const CV: bool>(p: *const u8) -> __m256 {
    if CV {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// Most vectors of a row in one P·V pass of [`attn_avx2_group`].
const PV_MAX: usize = 12;

/// Registers a P·V pass of [`attn_avx2_group`] may hold accumulators and broadcast weights
/// in (the V vector takes one more). With all 16 (4 vectors × 3 rows for the default model)
/// LLVM spilled one accumulator to the stack inside the position loop, a store-to-load
/// round trip in its FMA chain: measured (`examples/perf`, `ATTN=2000`, f16, one thread,
/// median of 5 interleaved) 141 -> 124 us per layer with 15 (2 vectors × 3 rows per pass).
const PV_REGS: usize = 14;

/// Vectors of a row's P·V accumulators updated per pass over a chunk's positions in
/// [`attn_avx2_group`]: the largest divisor of `hv` whose accumulators (`sets` per row, one
/// set, or two for the even/odd sums) and `R · sets` broadcast weights fit [`PV_REGS`].
const fn pv_block(hv: usize, r: usize, sets: usize) -> usize {
    let mut ib = if hv < PV_MAX { hv } else { PV_MAX };
    while ib > 1 {
        if hv.is_multiple_of(ib) && r * sets * ib + r * sets <= PV_REGS {
            return ib;
        }
        ib -= 1;
    }
    1
}

/// [`attn_avx2_rows`] for one query token whose `R` = gs heads per kv group are computed
/// together: each position's K and V vectors are loaded (and f16-converted) once per group
/// and used by all `R` rows, instead of once into an f32 scratch and once more per row.
/// Every row's arithmetic is that of [`attn_avx2_rows`] (the same products in the same
/// order, the same [`reduce8`] tree four positions at a time, the same softmax and P·V
/// sums), so a token gets the same bits here as in a prefill tile.
// Indices address several arrays at once (rows × positions × vectors).
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attn_avx2_group<const HV: usize, const CV: bool, const R: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let ng = c.ng;
    let es = if CV { 2 } else { 4 };
    let gs = c.gs;
    debug_assert!(gs.is_multiple_of(R));
    let rows = gs * ng;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut kpn = [usize::MAX; CHUNK];
    let mut s = [[0f32; CHUNK]; R];
    let mut scratch = ATTN_SCRATCH.take();
    if scratch.len() < rows * HV {
        scratch.resize(rows * HV, _mm256_setzero_ps());
    }
    let acc = &mut scratch[..rows * HV];
    acc.fill(_mm256_setzero_ps());
    let mut krow = [std::ptr::null::<u8>(); CHUNK];
    let mut vrow = [std::ptr::null::<u8>(); CHUNK];
    let sc = _mm256_set1_ps(c.scale);
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let end = c.ctx0.min(c.ctx);
    let mut c0 = c.p0;
    while c0 < end {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        // The next chunk's K/V, prefetched position by position as this chunk's scores are
        // computed (as `attn_avx2_rows` does while it converts; a burst stalls on the miss
        // buffers).
        let n2 = (c.ctx - c0 - n).min(CHUNK);
        c.offsets(c0 + n, &mut kpn[..n2]);
        kpn[n2..].fill(usize::MAX);
        for j in 0..CHUNK {
            let jj = if j < n { j } else { 0 };
            krow[j] = c.kb.add(kp[jj]);
            vrow[j] = c.vb.add(kp[jj]);
        }
        let nr = (end - c0).min(n);
        for gsb in 0..ng * (gs / R) {
            // Group `gg`, its rows `sb · R..(sb + 1) · R`.
            let (gg, sb) = (gsb / (gs / R), gsb % (gs / R));
            let go = gg * hd * es;
            let rb = gg * gs + sb * R;
            // The group's queries, scaled as `attn_avx2_rows` scales them; read from memory
            // by the FMAs (R · HV vectors do not fit the registers, K's do one at a time).
            let mut qv = [[_mm256_setzero_ps(); HV]; R];
            for (r, qv) in qv.iter_mut().enumerate() {
                let qh = c.qp.add((rb + r) * hd);
                for (i, qv) in qv.iter_mut().enumerate() {
                    *qv = _mm256_mul_ps(_mm256_loadu_ps(qh.add(8 * i)), sc);
                }
            }
            // Scores, 8 positions at a time, reduced four positions at a time.
            let mut cmax = [ninf; R];
            let mut j = 0;
            while j < nr {
                let cnt = (nr - j).min(8);
                let mut x = [[_mm256_setzero_ps(); 2]; R];
                for half in 0..2 {
                    let mut d = [[_mm256_setzero_ps(); 4]; R];
                    for jj in 0..4 {
                        let pj = j + 4 * half + jj;
                        if sb == 0 && kpn[pj] != usize::MAX {
                            let o = kpn[pj] + go;
                            super::prefetch_lines(c.kb.wrapping_add(o), HV * 8 * es);
                            super::prefetch_lines(c.vb.wrapping_add(o), HV * 8 * es);
                        }
                        // Lanes past the row's end are blended to -inf below: not computed.
                        if 4 * half + jj >= cnt {
                            continue;
                        }
                        let kr = krow[pj].add(go);
                        let k0 = ldv::<CV>(kr);
                        let mut dd = [_mm256_setzero_ps(); R];
                        for r in 0..R {
                            dd[r] = _mm256_mul_ps(qv[r][0], k0);
                        }
                        for i in 1..HV {
                            let ki = ldv::<CV>(kr.add(8 * i * es));
                            for r in 0..R {
                                dd[r] = _mm256_fmadd_ps(qv[r][i], ki, dd[r]);
                            }
                        }
                        for r in 0..R {
                            d[r][jj] = dd[r];
                        }
                    }
                    for r in 0..R {
                        x[r][half] = reduce8_quad(&d[r]);
                    }
                }
                let valid = lanes_below(cnt);
                for r in 0..R {
                    let rv = _mm256_blendv_ps(ninf, reduce8_combine(x[r][0], x[r][1]), valid);
                    cmax[r] = _mm256_max_ps(cmax[r], rv);
                    _mm256_storeu_ps(s[r].as_mut_ptr().add(j), rv);
                }
                j += 8;
            }
            // Online softmax over the chunk, per row (as `attn_avx2_rows`).
            let mut al = [_mm256_setzero_ps(); R];
            for r in 0..R {
                let row = rb + r;
                let new_m = mx[row].max(hmax256(cmax[r]));
                let alpha = if mx[row] == f32::NEG_INFINITY {
                    0.0
                } else {
                    (mx[row] - new_m).exp()
                };
                mx[row] = new_m;
                let nm = _mm256_set1_ps(new_m);
                let mut sum = _mm256_setzero_ps();
                let mut j = 0;
                while j < nr {
                    let valid = lanes_below((nr - j).min(8));
                    let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s[r].as_ptr().add(j)), nm));
                    let e = _mm256_and_ps(e, valid);
                    sum = _mm256_add_ps(sum, e);
                    _mm256_storeu_ps(s[r].as_mut_ptr().add(j), e);
                    j += 8;
                }
                lsum[row] = lsum[row] * alpha + hsum256(sum);
                al[r] = _mm256_set1_ps(alpha);
            }
            // P·V, a few vectors of every row per pass over the positions (the lanes are
            // independent: each accumulator gets the same FMAs in the same order).
            let accg = acc.as_mut_ptr().add(rb * HV);
            let mut vg = [std::ptr::null::<u8>(); CHUNK];
            for (vg, v) in vg.iter_mut().zip(&vrow) {
                *vg = v.wrapping_add(go);
            }
            if HV < 8 {
                pv_pass::<HV, CV, R, true>(&vg, nr, &s, &al, accg)
            } else {
                pv_pass::<HV, CV, R, false>(&vg, nr, &s, &al, accg)
            }
        }
        c0 += n;
    }
    for r in 0..rows {
        let ph = c.op.add(r * (hd + 2));
        *ph = mx[r];
        *ph.add(1) = lsum[r];
        for i in 0..HV {
            _mm256_storeu_ps(ph.add(2 + 8 * i), acc[r * HV + i]);
        }
    }
    ATTN_SCRATCH.set(scratch);
}

/// P·V of [`attn_avx2_group`] for one chunk and group: `R` rows' accumulators (`acc`, `HV`
/// vectors per row) rescaled by `al` and updated with the weights `s` of positions `0..nr`
/// (V rows at `vrow`), [`pv_block`] vectors of each row at a time. With `EO` (fewer than 8 vectors
/// per row) even and odd positions go into two sets, summed before an odd last position, as
/// in [`attn_avx2_rows`].
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pv_pass<const HV: usize, const CV: bool, const R: usize, const EO: bool>(
    vrow: &[*const u8; CHUNK],
    nr: usize,
    s: &[[f32; CHUNK]; R],
    al: &[__m256; R],
    acc: *mut __m256,
) {
    let es = if CV { 2 } else { 4 };
    // A constant per instance: the loops over it unroll and the accumulators stay in
    // registers (the arrays' unused tail is dead).
    let nb = const { pv_block(HV, R, if EO { 2 } else { 1 }) };
    let mut ib = 0;
    while ib < HV {
        let mut a0 = [[_mm256_setzero_ps(); PV_MAX]; R];
        let mut a1 = [[_mm256_setzero_ps(); PV_MAX]; R];
        for r in 0..R {
            for i in 0..nb {
                a0[r][i] = _mm256_mul_ps(*acc.add(r * HV + ib + i), al[r]);
            }
        }
        let mut j = 0;
        if EO {
            while j + 2 <= nr {
                let mut p0 = [_mm256_setzero_ps(); R];
                let mut p1 = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    p0[r] = _mm256_set1_ps(s[r][j]);
                    p1[r] = _mm256_set1_ps(s[r][j + 1]);
                }
                let (v0, v1) = (vrow[j], vrow[j + 1]);
                for i in 0..nb {
                    let x0 = ldv::<CV>(v0.add(8 * (ib + i) * es));
                    for r in 0..R {
                        a0[r][i] = _mm256_fmadd_ps(p0[r], x0, a0[r][i]);
                    }
                    let x1 = ldv::<CV>(v1.add(8 * (ib + i) * es));
                    for r in 0..R {
                        a1[r][i] = _mm256_fmadd_ps(p1[r], x1, a1[r][i]);
                    }
                }
                j += 2;
            }
            for r in 0..R {
                for i in 0..nb {
                    a0[r][i] = _mm256_add_ps(a0[r][i], a1[r][i]);
                }
            }
        }
        while j < nr {
            let mut p = [_mm256_setzero_ps(); R];
            for r in 0..R {
                p[r] = _mm256_set1_ps(s[r][j]);
            }
            let v0 = vrow[j];
            for i in 0..nb {
                let x = ldv::<CV>(v0.add(8 * (ib + i) * es));
                for r in 0..R {
                    a0[r][i] = _mm256_fmadd_ps(p[r], x, a0[r][i]);
                }
            }
            j += 1;
        }
        for r in 0..R {
            for i in 0..nb {
                *acc.add(r * HV + ib + i) = a0[r][i];
            }
        }
        ib += nb;
    }
}
