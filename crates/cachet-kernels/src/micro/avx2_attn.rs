//! AVX2 paged attention: the structure of the AVX-512 kernels (`super::avx512_attn`) on
//! 8-lane vectors. A pass takes a tile of `nq` query tokens × the heads of `ng` consecutive
//! kv groups (at most 64 rows). Per chunk of positions and kv group, a token's heads of the
//! group advance together ([`group_chunk`]): each K and V vector is loaded once for all of
//! them; scores for 8 positions at a time with a transposed reduction; one online-softmax
//! rescale per chunk and row; then P·V with the rows' accumulators in registers. A decode
//! token reads f16 K/V in place; a tile of several tokens converts each chunk once into an
//! f32 scratch (16 KB for head_dim 64, in L1) shared by all its tokens. Rows past their
//! causal end skip the chunk's tail.

use std::arch::x86_64::*;

use super::avx2::exp256;
use super::{AttnCtx, CHUNK};

/// Horizontal sums of 8 vectors (lane `j` the sum of vector `j`), in two steps: first, per
/// 128-bit lane, the partial sums of four vectors `v[0..4]` (four positions' scores as they
/// are computed), then [`reduce8_combine`] of two such results.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn reduce8_quad(v: &[__m256; 4]) -> __m256 {
    _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]))
}

/// Last step of the 8-vector sum: the two [`reduce8_quad`] results into the 8 sums.
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
/// head_dim / 8 vectors per row); see the module docs. A decode token with at most 4 heads per
/// group reads f16 K/V in place ([`attn_avx2_group`]); anything else converts each chunk once
/// into an f32 scratch ([`attn_avx2_tile`]). Both advance a token's heads of a group together
/// ([`group_chunk`]), so a row gets the same bits on either path.
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
    // Rows per K/V load: a token's heads of one group (they share its causal end), in blocks
    // of the largest of 4, 3, 2 dividing them.
    match c.gs {
        g if g.is_multiple_of(4) => attn_avx2_tile::<HV, 4>(c),
        g if g.is_multiple_of(3) => attn_avx2_tile::<HV, 3>(c),
        g if g.is_multiple_of(2) => attn_avx2_tile::<HV, 2>(c),
        _ => attn_avx2_tile::<HV, 1>(c),
    }
}

/// [`attn_avx2`] for a tile of `nq` query tokens (or a decode token it does not read in place):
/// per chunk of positions and kv group, f16 K/V rows are converted once into an f32 scratch
/// (16 KB for head_dim 64, in L1; an f32 arena is read in place), then each token's heads of
/// the group are advanced `R` at a time by [`group_chunk`], sharing each K and V vector load.
/// Row r is token r / (gs·ng), head r % (gs·ng) of the pass.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attn_avx2_tile<const HV: usize, const R: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let gs = c.gs;
    let ng = c.ng;
    debug_assert!(gs.is_multiple_of(R));
    let per_tok = gs * ng;
    let rows = c.nq * per_tok;
    debug_assert!(rows <= 64);
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut kpn = [0usize; CHUNK];
    let none = [usize::MAX; CHUNK];
    let buf_rows = if c.is_f16 { CHUNK.min(c.ctx - c.p0) } else { 0 };
    let mut scratch = ATTN_SCRATCH.take();
    let need = 2 * rows * HV + 2 * buf_rows * HV;
    if scratch.len() < need {
        scratch.resize(need, _mm256_setzero_ps());
    }
    let (acc, rest) = scratch.split_at_mut(rows * HV);
    acc.fill(_mm256_setzero_ps());
    let (qs, rest) = rest.split_at_mut(rows * HV);
    scaled_queries::<HV>(c, rows, qs);
    let (kbuf, rest) = rest.split_at_mut(buf_rows * HV);
    let vbuf = &mut rest[..buf_rows * HV];
    let mut krow = [std::ptr::null::<u8>(); CHUNK];
    let mut vrow = [std::ptr::null::<u8>(); CHUNK];
    let esz = if c.is_f16 { 2 } else { 4 };
    // The causal end of the tile's last token.
    let last = (c.ctx0 + c.nq - 1).min(c.ctx);
    let mut c0 = c.p0;
    while c0 < last {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        // The next chunk's K/V, prefetched (into L2) position by position as this chunk is
        // converted (a burst of prefetches stalls on the miss buffers).
        let n2 = c.pf_end.saturating_sub(c0 + n).min(CHUNK);
        c.offsets(c0 + n, &mut kpn[..n2]);
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
                        let off = kp[j] + gg * hd * 2;
                        let (kr, vr) = (c.kb.add(off), c.vb.add(off));
                        for i in 0..HV {
                            kbuf[j * HV + i] = ldv::<true>(kr.add(16 * i));
                            vbuf[j * HV + i] = ldv::<true>(vr.add(16 * i));
                        }
                    }
                    krow[j] = kbuf.as_ptr().add(jj * HV) as *const u8;
                    vrow[j] = vbuf.as_ptr().add(jj * HV) as *const u8;
                } else {
                    krow[j] = c.kb.add(kp[jj] + gg * hd * 4);
                    vrow[j] = c.vb.add(kp[jj] + gg * hd * 4);
                }
            }
            for ti in 0..c.nq {
                let end = (c.ctx0 + ti).min(c.ctx);
                if end <= c0 {
                    continue;
                }
                let nr = (end - c0).min(n);
                for sb in 0..gs / R {
                    let rb = ti * per_tok + gg * gs + sb * R;
                    let g = GroupRows {
                        q: qs[rb * HV..].as_ptr(),
                        go: 0,
                        mx: &mut mx[rb..rb + R],
                        lsum: &mut lsum[rb..rb + R],
                        acc: &mut acc[rb * HV..(rb + R) * HV],
                    };
                    group_chunk::<HV, false, R>(c, &krow, &vrow, &none, nr, g);
                }
            }
        }
        c0 += n;
    }
    store_parts::<HV>(c, rows, &mx, &lsum, acc);
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

/// Most vectors of a row in one P·V pass of [`group_chunk`].
const PV_MAX: usize = 12;

/// Registers a P·V pass of [`group_chunk`] may hold accumulators and broadcast weights
/// in (the V vector takes one more). With all 16 (4 vectors × 3 rows for the default model)
/// LLVM spilled one accumulator to the stack inside the position loop, a store-to-load
/// round trip in its FMA chain: measured (`examples/perf`, `ATTN=2000`, f16, one thread,
/// median of 5 interleaved) 141 -> 124 us per layer with 15 (2 vectors × 3 rows per pass).
const PV_REGS: usize = 14;

/// Vectors of a row's P·V accumulators updated per pass over a chunk's positions in
/// [`group_chunk`]: the largest divisor of `hv` whose accumulators (`sets` per row, one
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

/// Attention for one query token whose `R` = gs heads per kv group are computed together,
/// K/V read in place (f16 converted in the load, `CV`, or f32): each position's K and V
/// vectors are loaded once per group and used by all `R` rows. Every row's arithmetic is
/// [`group_chunk`]'s, as in [`attn_avx2_tile`], so a token gets the same bits here as in a
/// prefill tile.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attn_avx2_group<const HV: usize, const CV: bool, const R: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let ng = c.ng;
    let gs = c.gs;
    debug_assert!(gs.is_multiple_of(R));
    let rows = gs * ng;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut kpn = [usize::MAX; CHUNK];
    let none = [usize::MAX; CHUNK];
    let mut scratch = ATTN_SCRATCH.take();
    if scratch.len() < 2 * rows * HV {
        scratch.resize(2 * rows * HV, _mm256_setzero_ps());
    }
    let (acc, qs) = scratch[..2 * rows * HV].split_at_mut(rows * HV);
    acc.fill(_mm256_setzero_ps());
    scaled_queries::<HV>(c, rows, qs);
    let mut krow = [std::ptr::null::<u8>(); CHUNK];
    let mut vrow = [std::ptr::null::<u8>(); CHUNK];
    let es = if CV { 2 } else { 4 };
    let end = c.ctx0.min(c.ctx);
    let mut c0 = c.p0;
    while c0 < end {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        // The next chunk's K/V, prefetched position by position as this chunk's scores are
        // computed (in `group_chunk`; a burst stalls on the miss buffers).
        let n2 = c.pf_end.saturating_sub(c0 + n).min(CHUNK);
        c.offsets(c0 + n, &mut kpn[..n2]);
        kpn[n2..].fill(usize::MAX);
        for j in 0..CHUNK {
            let jj = if j < n { j } else { 0 };
            krow[j] = c.kb.add(kp[jj]);
            vrow[j] = c.vb.add(kp[jj]);
        }
        let nr = (end - c0).min(n);
        for gsb in 0..ng * (gs / R) {
            // Group `gg`, its rows `sb · R..(sb + 1) · R`; the first block of a group
            // prefetches the group's part of the next chunk.
            let (gg, sb) = (gsb / (gs / R), gsb % (gs / R));
            let rb = gg * gs + sb * R;
            let g = GroupRows {
                q: qs[rb * HV..].as_ptr(),
                go: gg * hd * es,
                mx: &mut mx[rb..rb + R],
                lsum: &mut lsum[rb..rb + R],
                acc: &mut acc[rb * HV..(rb + R) * HV],
            };
            let next = if sb == 0 { &kpn } else { &none };
            group_chunk::<HV, CV, R>(c, &krow, &vrow, next, nr, g);
        }
        c0 += n;
    }
    store_parts::<HV>(c, rows, &mx, &lsum, acc);
    ATTN_SCRATCH.set(scratch);
}

/// Each row's query times the softmax scale into `qs` (`HV` vectors a row), once per call
/// rather than per chunk. Row r is token r / (gs·ng), head r % (gs·ng) of the pass.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scaled_queries<const HV: usize>(c: &AttnCtx, rows: usize, qs: &mut [__m256]) {
    let per_tok = c.gs * c.ng;
    let sc = _mm256_set1_ps(c.scale);
    for r in 0..rows {
        let qh = c.qp.add((r / per_tok) * c.qstride + (r % per_tok) * c.hd);
        for i in 0..HV {
            qs[r * HV + i] = _mm256_mul_ps(_mm256_loadu_ps(qh.add(8 * i)), sc);
        }
    }
}

/// Writes each row's `[m, l, acc[hd]]` into the partial output.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store_parts<const HV: usize>(
    c: &AttnCtx,
    rows: usize,
    mx: &[f32],
    lsum: &[f32],
    acc: &[__m256],
) {
    for r in 0..rows {
        let ph = c.op.add(r * (c.hd + 2));
        *ph = mx[r];
        *ph.add(1) = lsum[r];
        for i in 0..HV {
            _mm256_storeu_ps(ph.add(2 + 8 * i), acc[r * HV + i]);
        }
    }
}

/// The `R` rows (query token × head, all of one kv group) that [`group_chunk`] advances: each
/// row's q, the group's byte offset in a position's K/V row, and the rows' softmax state and
/// accumulators.
struct GroupRows<'a, const R: usize> {
    /// The rows' scaled queries, `HV` vectors each, one row after another.
    q: *const __m256,
    go: usize,
    mx: &'a mut [f32],
    lsum: &'a mut [f32],
    acc: &'a mut [__m256],
}

/// One chunk of positions (`nr` of them, at `krow`/`vrow` plus the group offset) for `R` rows
/// sharing each K and V vector load: scores 8 positions at a time ([`reduce8_quad`] four
/// positions at a time and [`reduce8_combine`], the 8-vector sum), the
/// online-softmax rescale, then P·V ([`pv_pass`]). The positions of `next` (the following
/// chunk's offsets, `usize::MAX` where none) are prefetched one by one.
// Indices address several arrays at once (rows × positions × vectors).
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn group_chunk<const HV: usize, const CV: bool, const R: usize>(
    c: &AttnCtx,
    krow: &[*const u8; CHUNK],
    vrow: &[*const u8; CHUNK],
    next: &[usize; CHUNK],
    nr: usize,
    g: GroupRows<R>,
) {
    let es = if CV { 2 } else { 4 };
    let go = g.go;
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut s = [[0f32; CHUNK]; R];
    // The rows' scaled queries, read from memory by the FMAs (R · HV vectors do not fit the
    // registers).
    let qv = |r: usize, i: usize| *g.q.add(r * HV + i);
    // Scores, 8 positions at a time, reduced four positions at a time.
    let mut cmax = [ninf; R];
    let mut j = 0;
    while j < nr {
        let cnt = (nr - j).min(8);
        let mut x = [[_mm256_setzero_ps(); 2]; R];
        for half in 0..2 {
            // Four positions × the R rows in registers, vector by vector (each sum still
            // takes its products in vector order: the bits of a row alone). Lanes past the
            // rows' end read a valid row (`krow` points them at the chunk's first) and are
            // blended to -inf below.
            let mut kr = [std::ptr::null::<u8>(); 4];
            for jj in 0..4 {
                let pj = j + 4 * half + jj;
                if next[pj] != usize::MAX {
                    let o = next[pj] + go;
                    // Into L2, not L1: a decode token's K/V comes from DRAM in a served step,
                    // and L1 prefetches hold the core's few fill buffers while they wait
                    // (`examples/perf` DRAFT_ATTN=0@1500 LAYERS=120, 2 threads: avx2 55.6-59.0
                    // -> 49.8-54.2 us, avx512 49.5-57.8 -> 49.1-51.0; in cache no slower).
                    super::prefetch_lines(c.kb.wrapping_add(o), HV * 8 * es);
                    super::prefetch_lines(c.vb.wrapping_add(o), HV * 8 * es);
                }
                kr[jj] = krow[pj].add(go);
            }
            let mut d = [[_mm256_setzero_ps(); 4]; R];
            for pair in 0..2 {
                let (ka, kb) = (kr[2 * pair], kr[2 * pair + 1]);
                let (k0, k1) = (ldv::<CV>(ka), ldv::<CV>(kb));
                let mut d0 = [_mm256_setzero_ps(); R];
                let mut d1 = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    d0[r] = _mm256_mul_ps(qv(r, 0), k0);
                    d1[r] = _mm256_mul_ps(qv(r, 0), k1);
                }
                for i in 1..HV {
                    let (k0, k1) = (ldv::<CV>(ka.add(8 * i * es)), ldv::<CV>(kb.add(8 * i * es)));
                    for r in 0..R {
                        d0[r] = _mm256_fmadd_ps(qv(r, i), k0, d0[r]);
                        d1[r] = _mm256_fmadd_ps(qv(r, i), k1, d1[r]);
                    }
                }
                for r in 0..R {
                    d[r][2 * pair] = d0[r];
                    d[r][2 * pair + 1] = d1[r];
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
    // Online softmax over the chunk, per row.
    let mut al = [_mm256_setzero_ps(); R];
    for r in 0..R {
        let new_m = g.mx[r].max(hmax256(cmax[r]));
        // exp(0) = 1 exactly: most chunks past the first do not raise the maximum, and skip
        // the call (which also spills every vector register around it).
        let alpha = if g.mx[r] == f32::NEG_INFINITY {
            0.0
        } else if g.mx[r] == new_m {
            1.0
        } else {
            (g.mx[r] - new_m).exp()
        };
        g.mx[r] = new_m;
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
        g.lsum[r] = g.lsum[r] * alpha + hsum256(sum);
        al[r] = _mm256_set1_ps(alpha);
    }
    // P·V, a few vectors of every row per pass over the positions (the lanes are
    // independent: each accumulator gets the same FMAs in the same order).
    let mut vg = [std::ptr::null::<u8>(); CHUNK];
    for (vg, v) in vg.iter_mut().zip(vrow) {
        *vg = v.wrapping_add(go);
    }
    let accg = g.acc.as_mut_ptr();
    if HV < 8 {
        pv_pass::<HV, CV, R, true>(&vg, nr, &s, &al, accg)
    } else {
        pv_pass::<HV, CV, R, false>(&vg, nr, &s, &al, accg)
    }
}

/// P·V of [`group_chunk`] for one chunk and group: `R` rows' accumulators (`acc`, `HV`
/// vectors per row) rescaled by `al` and updated with the weights `s` of positions `0..nr`
/// (V rows at `vrow`), [`pv_block`] vectors of each row at a time. With `EO` (fewer than 8 vectors
/// per row) even and odd positions go into two sets, summed before an odd last position, as
/// every row of every path.
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
