//! AVX-512 paged attention over 16-lane rows: the rows kernel, the grouped decode kernel, the
//! tile kernel, and the per-chunk body the latter two share (`group_chunk`).

use std::arch::x86_64::*;

use super::avx512::exp512;
use super::{AttnCtx, CHUNK};

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
    // A tile: each token's gs heads together, unless few rows read f16 in place.
    if c.nq > 1 && (!c.is_f16 || c.nq * c.gs > DIRECT_ROWS) {
        return if c.is_f16 {
            attn_512_tile::<HV, true>(c)
        } else {
            attn_512_tile::<HV, false>(c)
        };
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
        let chunk = ChunkRows {
            kp: &mut kp,
            krow: &mut krow,
            vrow: &mut vrow,
        };
        chunk_rows::<SCR>(c, c0, n, pv, kbuf, vbuf, chunk);
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

/// A chunk's position arrays: byte offsets, and the K and V row each position reads.
struct ChunkRows<'a> {
    kp: &'a mut [usize; CHUNK],
    krow: &'a mut [*const u8; CHUNK],
    vrow: &'a mut [*const u8; CHUNK],
}

/// Points the chunk's `n` positions from `c0` at their K/V rows (positions past `n` at the
/// first one, never read unmasked) and prefetches the next chunk: with `SCR` the rows are
/// first converted from f16 into the f32 scratch `kbuf`/`vbuf` (`pv` vectors a position).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn chunk_rows<const SCR: bool>(
    c: &AttnCtx,
    c0: usize,
    n: usize,
    pv: usize,
    kbuf: &mut [__m512],
    vbuf: &mut [__m512],
    r: ChunkRows,
) {
    c.offsets(c0, &mut r.kp[..n]);
    c.prefetch(c0 + n, CHUNK, pv * 16 * if c.is_f16 { 2 } else { 4 });
    for j in 0..CHUNK {
        let jj = if j < n { j } else { 0 };
        if SCR {
            if j < n {
                let (kr, vr) = (c.kb.add(r.kp[j]), c.vb.add(r.kp[j]));
                for i in 0..pv {
                    kbuf[j * pv + i] = ld512(kr.add(32 * i), true);
                    vbuf[j * pv + i] = ld512(vr.add(32 * i), true);
                }
            }
            r.krow[j] = kbuf.as_ptr().add(jj * pv) as *const u8;
            r.vrow[j] = vbuf.as_ptr().add(jj * pv) as *const u8;
        } else {
            r.krow[j] = c.kb.add(r.kp[jj]);
            r.vrow[j] = c.vb.add(r.kp[jj]);
        }
    }
}

/// [`attn_512_rows`] for one query token whose `R` = gs heads per kv group are computed
/// together: each position's K and V vectors are loaded (and converted) once per group and
/// used by all `R` rows, instead of once per row. Every row's arithmetic is that of
/// [`attn_512_rows`] (see [`group_chunk`]), so a token gets the same bits here as in a
/// prefill tile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attn_512_group<const HV: usize, const CV: bool, const R: usize>(c: &AttnCtx) {
    let hd = c.hd;
    let ng = c.ng;
    let es = if CV { 2 } else { 4 };
    let rows = R * ng;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let mut kpn = [usize::MAX; CHUNK];
    let mut scratch = ATTN_SCRATCH.take();
    if scratch.len() < rows * HV {
        scratch.resize(rows * HV, _mm512_setzero_ps());
    }
    let acc = &mut scratch[..rows * HV];
    acc.fill(_mm512_setzero_ps());
    let mut krow = [std::ptr::null::<u8>(); CHUNK];
    let mut vrow = [std::ptr::null::<u8>(); CHUNK];
    let end = c.ctx0.min(c.ctx);
    let mut c0 = c.p0;
    while c0 < end {
        let n = (c.ctx - c0).min(CHUNK);
        c.offsets(c0, &mut kp[..n]);
        // The next chunk's K/V, prefetched position by position as this chunk's scores are
        // computed (in `group_chunk`), not in one burst: a burst of 384 prefetches stalls the
        // core on the miss buffers (`examples/perf` ATTN_BATCH=16x144, one thread: 5.6 -> 4.4 ms).
        let n2 = c.pf_end.saturating_sub(c0 + n).min(CHUNK);
        c.offsets(c0 + n, &mut kpn[..n2]);
        kpn[n2..].fill(usize::MAX);
        for j in 0..CHUNK {
            let jj = if j < n { j } else { 0 };
            krow[j] = c.kb.add(kp[jj]);
            vrow[j] = c.vb.add(kp[jj]);
        }
        let nr = (end - c0).min(n);
        for gg in 0..ng {
            let rb = gg * R;
            let rows = GroupRows {
                q: std::array::from_fn(|r| c.qp.add((rb + r) * hd)),
                go: gg * hd * es,
                mx: &mut mx[rb..rb + R],
                lsum: &mut lsum[rb..rb + R],
                acc: &mut acc[rb * HV..(rb + R) * HV],
            };
            group_chunk::<HV, CV, R, true>(c, &krow, &vrow, &kpn, nr, rows);
        }
        c0 += n;
    }
    store_parts::<HV>(c, rows, &mx, &lsum, acc);
    ATTN_SCRATCH.set(scratch);
}

/// [`attn_512_rows`] for a tile of `nq` query tokens (f16 K/V beyond [`DIRECT_ROWS`] rows, or
/// f32): per chunk the K/V rows are converted to f32 once (`SCR`; an f32 arena is read in
/// place), then rows are advanced three or two at a time by [`group_chunk`] ([`tile_chunk`]),
/// sharing each K and V vector load, wherever consecutive rows of the same group have the same
/// causal end in the chunk (every chunk before the tile's diagonal). The per-row arithmetic is
/// [`group_chunk`]'s, so a row gets the same bits here as in decode or in any other tile.
/// Measured against [`attn_512_rows`] (`examples/perf`, one thread, interleaved, 3 runs each):
/// 16 tokens after 1,984 cached 41–43 → 35–36 ms over 30 layers, 512 tokens 177–196 →
/// 156–161 ms.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn attn_512_tile<const HV: usize, const SCR: bool>(c: &AttnCtx) {
    let hd = c.hd;
    let ng = c.ng;
    let per_tok = c.gs * ng;
    let rows = (c.nq * per_tok).min(64);
    let pv = ng * HV;
    let mut mx = [f32::NEG_INFINITY; 64];
    let mut lsum = [0f32; 64];
    let mut kp = [0usize; CHUNK];
    let buf_rows = if SCR { CHUNK.min(c.ctx - c.p0) } else { 0 };
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
    let none = [usize::MAX; CHUNK];
    // Row r is token r / per_tok, head r % per_tok (of the pass's groups): its q, its group's
    // byte offset in a position's (f32) K/V row, its causal end.
    let mut row_q = [std::ptr::null::<f32>(); 64];
    let mut row_go = [0usize; 64];
    let mut row_end = [0usize; 64];
    for r in 0..rows {
        let (ti, h) = (r / per_tok, r % per_tok);
        row_q[r] = c.qp.add(ti * c.qstride + h * hd);
        row_go[r] = (h / c.gs) * hd * 4;
        row_end[r] = (c.ctx0 + ti).min(c.ctx);
    }
    let last = (c.ctx0 + c.nq - 1).min(c.ctx);
    let mut c0 = c.p0;
    while c0 < last {
        let n = (c.ctx - c0).min(CHUNK);
        let chunk = ChunkRows {
            kp: &mut kp,
            krow: &mut krow,
            vrow: &mut vrow,
        };
        chunk_rows::<SCR>(c, c0, n, pv, kbuf, vbuf, chunk);
        let mut row_nr = [0usize; 64];
        for (nr, &end) in row_nr.iter_mut().zip(&row_end[..rows]) {
            *nr = end.saturating_sub(c0).min(n);
        }
        let t = TileRows {
            rows,
            q: &row_q,
            go: &row_go,
            nr: &row_nr,
            none: &none,
        };
        let st = (&mut mx[..], &mut lsum[..], &mut acc[..]);
        // Rows per K/V load: the heads of a token where they are a multiple of 3 (they share
        // the token's causal end, so every chunk takes them together), else 2. Measured
        // (`examples/perf`, interleaved, 3 rounds): 3 against 2 with the default model's 3
        // heads per group, a decode token and 5 drafts after 1,044 positions 211-214 ->
        // 195-200 µs a layer (one thread), 16 tokens after 1,984 31.8-32.5 -> 28.9-30.1 ms
        // over 30 layers, 512 tokens 136-144 -> 125-127 ms; 4 slower than 2 (spills).
        if c.gs.is_multiple_of(3) {
            tile_chunk::<HV, 3>(c, &krow, &vrow, &t, st);
        } else {
            tile_chunk::<HV, 2>(c, &krow, &vrow, &t, st);
        }
        c0 += n;
    }
    store_parts::<HV>(c, rows, &mx, &lsum, acc);
    ATTN_SCRATCH.set(scratch);
}

/// A tile's rows as [`attn_512_tile`] lays them out: how many, each row's query, its group's
/// byte offset in a position's (f32) K/V row, and its positions in the current chunk.
struct TileRows<'a> {
    rows: usize,
    q: &'a [*const f32; 64],
    go: &'a [usize; 64],
    nr: &'a [usize; 64],
    /// No next chunk to prefetch (`group_chunk`'s `next`, all `usize::MAX`).
    none: &'a [usize; CHUNK],
}

/// One chunk of a tile: rows advanced `B` at a time by [`group_chunk`] (sharing each K and V
/// vector load) where `B` consecutive rows have the same group and causal end in the chunk,
/// else one at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn tile_chunk<const HV: usize, const B: usize>(
    c: &AttnCtx,
    krow: &[*const u8; CHUNK],
    vrow: &[*const u8; CHUNK],
    t: &TileRows,
    (mx, lsum, acc): (&mut [f32], &mut [f32], &mut [__m512]),
) {
    let mut r = 0;
    while r < t.rows {
        let nr = t.nr[r];
        if r + B <= t.rows && nr > 0 && (1..B).all(|i| t.nr[r + i] == nr && t.go[r + i] == t.go[r])
        {
            let g = GroupRows {
                q: std::array::from_fn(|i| t.q[r + i]),
                go: t.go[r],
                mx: &mut mx[r..r + B],
                lsum: &mut lsum[r..r + B],
                acc: &mut acc[r * HV..(r + B) * HV],
            };
            group_chunk::<HV, false, B, false>(c, krow, vrow, t.none, nr, g);
            r += B;
        } else {
            if nr > 0 {
                let g = GroupRows {
                    q: [t.q[r]],
                    go: t.go[r],
                    mx: &mut mx[r..r + 1],
                    lsum: &mut lsum[r..r + 1],
                    acc: &mut acc[r * HV..(r + 1) * HV],
                };
                group_chunk::<HV, false, 1, false>(c, krow, vrow, t.none, nr, g);
            }
            r += 1;
        }
    }
}

/// The `R` rows (query token × head, all of one kv group) that [`group_chunk`] advances: each
/// row's q, the group's byte offset in a position's K/V row, and the rows' softmax state and
/// accumulators.
struct GroupRows<'a, const R: usize> {
    q: [*const f32; R],
    go: usize,
    mx: &'a mut [f32],
    lsum: &'a mut [f32],
    acc: &'a mut [__m512],
}

/// One chunk of positions (`nr` of them, at `krow`/`vrow`) for `R` rows sharing each K and V
/// vector load: scores 16 positions at a time, [`reduce16_quad`] four positions at a time and
/// [`reduce16_combine`] (the operations of [`reduce16`]), the online-softmax rescale, and P·V
/// with even positions into one accumulator set and odd ones into another. Per row that is
/// exactly [`attn_512_rows`]'s arithmetic in its order. With `PF`, the positions of `next`
/// (the following chunk's offsets, `usize::MAX` past its end) are prefetched one by one.
// Indices address several arrays at once (rows × positions × vectors).
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn group_chunk<const HV: usize, const CV: bool, const R: usize, const PF: bool>(
    c: &AttnCtx,
    krow: &[*const u8; CHUNK],
    vrow: &[*const u8; CHUNK],
    next: &[usize; CHUNK],
    nr: usize,
    g: GroupRows<R>,
) {
    let es = if CV { 2 } else { 4 };
    let go = g.go;
    let sc = _mm512_set1_ps(c.scale);
    let mut s = [[0f32; CHUNK]; R];
    let mut qv = [[_mm512_setzero_ps(); HV]; R];
    for (r, qv) in qv.iter_mut().enumerate() {
        let qh = g.q[r];
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
                if PF && pj < CHUNK && next[pj] != usize::MAX {
                    let o = next[pj] + go;
                    // Into L2, not L1, as `avx2_attn::group_chunk` (measured there).
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
        let new_m = g.mx[r].max(_mm512_reduce_max_ps(cmax[r]));
        let alpha = if g.mx[r] == f32::NEG_INFINITY {
            0.0
        } else {
            (g.mx[r] - new_m).exp()
        };
        g.mx[r] = new_m;
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
        g.lsum[r] = g.lsum[r] * alpha + _mm512_reduce_add_ps(sum);
        al[r] = _mm512_set1_ps(alpha);
    }
    // P·V: even positions into a0, odd ones into a1 (as attn_512_rows).
    let mut a0 = [[_mm512_setzero_ps(); HV]; R];
    let mut a1 = [[_mm512_setzero_ps(); HV]; R];
    for r in 0..R {
        for i in 0..HV {
            a0[r][i] = _mm512_mul_ps(g.acc[r * HV + i], al[r]);
        }
    }
    // Two positions per step, named accumulators (a position-dependent choice between the
    // two sets would keep them in memory).
    let mut j = 0;
    while j + 2 <= nr {
        let (v0, v1) = (vrow[j].add(go), vrow[j + 1].add(go));
        for i in 0..HV {
            let (x0, x1) = (
                ldv::<CV>(v0.add(16 * i * es)),
                ldv::<CV>(v1.add(16 * i * es)),
            );
            for r in 0..R {
                a0[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][j]), x0, a0[r][i]);
                a1[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][j + 1]), x1, a1[r][i]);
            }
        }
        j += 2;
    }
    if j < nr {
        let v0 = vrow[j].add(go);
        for i in 0..HV {
            let x0 = ldv::<CV>(v0.add(16 * i * es));
            for r in 0..R {
                a0[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][j]), x0, a0[r][i]);
            }
        }
    }
    for r in 0..R {
        for i in 0..HV {
            g.acc[r * HV + i] = _mm512_add_ps(a0[r][i], a1[r][i]);
        }
    }
}

/// Writes each row's `[m, l, acc[hd]]` into the partial output.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn store_parts<const HV: usize>(
    c: &AttnCtx,
    rows: usize,
    mx: &[f32],
    lsum: &[f32],
    acc: &[__m512],
) {
    for r in 0..rows {
        let ph = c.op.add(r * (c.hd + 2));
        *ph = mx[r];
        *ph.add(1) = lsum[r];
        for i in 0..HV {
            _mm512_storeu_ps(ph.add(2 + 16 * i), acc[r * HV + i]);
        }
    }
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
