//! AVX2 matmul micro-kernels over the packed layout (`crate::formats::packed`), with and
//! without AVX-VNNI.
//!
//! Each 16-row group is read as two 8-row halves (one 256-bit vector holds 4 consecutive
//! codes of 8 rows). A pass computes one half for `MR` activation rows over every block;
//! the activation quads are broadcast and multiplied with the codes:
//!
//! * AVX-VNNI: `vpdpbusd` accumulates exact int32 sums of unsigned codes × signed
//!   activations, for every format.
//! * plain AVX2: `vpmaddubsw` (unsigned × signed bytes, pairs summed into saturating int16).
//!   4-bit codes: 8 products per block sum to at most 8 · 2 · 15 · 127 = 30,480, so they
//!   accumulate in int16 across the block and widen once (`vpmaddwd` by 1). Codes below 64
//!   (Q6_K's and Q3_K's 6-bit codes, the 5-bit formats, Q2_K): two products at most
//!   2 · 2 · 63 · 127 = 32,004, widened every second step. Q8_0's and IQ4's 8-bit codes would
//!   saturate, so each code is split into its two nibbles
//!   (`code = 16 h + l`), both accumulated like 4-bit codes, and recombined exactly as
//!   `16 Σh·a + Σl·a`.
//!
//! Both variants therefore produce the exact int32 block sums `Σ code · a` of the AVX-512
//! kernel and fold them with the same two FMAs in the same order (`acc + sums · (d · dx) +
//! c · sx`, with `c = m` or `-off · d`), so every SIMD level gives bit-identical outputs (a
//! test checks it).

use std::arch::x86_64::*;

use super::TileJob;
use crate::formats::packed::{Fmt, GROUP};

/// One packed block's per-row scale vector (8 rows), stored as f32 or f16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_scales8<F: Fmt>(p: *const u8) -> __m256 {
    if F::F32S {
        _mm256_loadu_ps(p as *const f32)
    } else {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// `(d, c)` of one half (8 rows) of a packed block, value = `d · code + c`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_scales8<F: Fmt>(block: *const u8, h: usize, negoff: __m256) -> (__m256, __m256) {
    let sp = block.add(F::QBYTES + h * 8 * F::SBYTES);
    let d = load_scales8::<F>(sp);
    let c = if F::HASM {
        load_scales8::<F>(sp.add(GROUP * F::SBYTES))
    } else {
        _mm256_mul_ps(d, negoff)
    };
    (d, c)
}

/// Store the `MR` rows of one 8-row half of the output tile (masked at the matrix's end).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store8<const MR: usize>(job: &TileJob, accf: &[__m256; MR], r: usize) {
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

/// The tile kernel of both variants (`VNNI` selects `vpdpbusd`; the other branch is removed
/// at compile time; `SPREAD`: the job's pair is walked by this tile alone, see below). Always
/// inlined into a wrapper that enables the instruction set.
#[inline(always)]
unsafe fn tile_body<
    F: Fmt,
    const MR: usize,
    const NG: usize,
    const VNNI: bool,
    const SPREAD: bool,
>(
    job: &TileJob,
) {
    let p = job.p;
    let gb = p.group_bytes();
    let w0 = p.bytes().as_ptr().add(job.g0 * gb);
    let a = job.a;
    let (cols, anb) = (a.cols, a.nb);
    let xq0 = a.q.as_ptr().add(job.i0 * cols);
    let xd0 = a.d.as_ptr().add(job.i0 * anb);
    let xs0 = a.s.as_ptr().add(job.i0 * anb);
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let negoff = _mm256_set1_ps(-(F::OFF as f32));
    // Activation quad `j` (bytes 4j..4j+4) of row `i`, block `b`, broadcast.
    macro_rules! quad {
        ($i:expr, $b:expr, $j:expr) => {
            _mm256_set1_epi32(
                (xq0.add($i * cols + $b * F::BK + 4 * $j) as *const i32).read_unaligned(),
            )
        };
    }
    // A pair walked by one tile (a batch of up to `MR` rows: a decode token, or a token and
    // its drafts) spreads its prefetch of the next pair over both halves' passes, a block
    // every second step: the second pass reads its lines from L1, so with every prefetch
    // issued in the first one the memory idled through it (the default model's matmul set at
    // m = 1 to 6, one and two threads, 5–10 % faster on an Intel Xeon Ice Lake; docs/
    // bench-runs/2026-12-06-icelake-kernel-vs-llama.md). Pairs walked by several tiles keep the split of
    // `TileJob::prefetch_every`, in the first pass, and the loop they had before (a separate
    // instance: with the choice made inside the loop, the Q8_0 lm_head at batch 16 took 14–19 %
    // longer in `cachet bench kernel`'s phase table, against the unchanged o/ffn).
    for g in 0..NG {
        for h in 0..2 {
            let mut accf = [_mm256_setzero_ps(); MR];
            // The next block to prefetch (see `TileJob::prefetch`).
            let mut pf_next = job.prefetch_phase;
            for b in 0..p.nb {
                let base = w0.add(g * gb + b * F::STRIDE);
                if job.prefetch != 0 {
                    if SPREAD {
                        // Block step `h · nb + b` of the group's two passes.
                        let step = h * p.nb + b;
                        if step.is_multiple_of(2) {
                            let blk = w0.wrapping_add(g * gb + step / 2 * F::STRIDE);
                            super::prefetch_lines(blk.wrapping_add(job.prefetch), F::STRIDE);
                        }
                    } else if h == 0 && b == pf_next {
                        super::prefetch_lines(base.wrapping_add(job.prefetch), F::STRIDE);
                        pf_next += job.prefetch_every;
                    }
                }
                macro_rules! wv {
                    ($s:expr) => {
                        _mm256_loadu_si256(base.add(64 * $s + 32 * h) as *const __m256i)
                    };
                }
                let mut acci = [_mm256_setzero_si256(); MR];
                if VNNI {
                    if F::NIB {
                        for s in 0..4 {
                            let pv = wv!(s);
                            let lo = _mm256_and_si256(pv, m4);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(pv, 4), m4);
                            for (i, acc) in acci.iter_mut().enumerate() {
                                *acc = _mm256_dpbusd_avx_epi32(*acc, lo, quad!(i, b, s));
                                *acc = _mm256_dpbusd_avx_epi32(*acc, hi, quad!(i, b, 4 + s));
                            }
                        }
                    } else {
                        for t in 0..F::BK / 4 {
                            let v = wv!(t);
                            for (i, acc) in acci.iter_mut().enumerate() {
                                *acc = _mm256_dpbusd_avx_epi32(*acc, v, quad!(i, b, t));
                            }
                        }
                    }
                } else if F::NIB {
                    let mut acc16 = [_mm256_setzero_si256(); MR];
                    for s in 0..4 {
                        let pv = wv!(s);
                        let lo = _mm256_and_si256(pv, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(pv, 4), m4);
                        for (i, acc) in acc16.iter_mut().enumerate() {
                            *acc = _mm256_add_epi16(*acc, _mm256_maddubs_epi16(lo, quad!(i, b, s)));
                            *acc = _mm256_add_epi16(
                                *acc,
                                _mm256_maddubs_epi16(hi, quad!(i, b, 4 + s)),
                            );
                        }
                    }
                    for i in 0..MR {
                        acci[i] = _mm256_madd_epi16(acc16[i], ones);
                    }
                } else if F::NARROW {
                    // Codes below 64 (Q6_K, Q3_K, the 5-bit formats, Q2_K): two steps per
                    // int16 sum.
                    for t2 in 0..F::BK / 8 {
                        let (v0, v1) = (wv!(2 * t2), wv!(2 * t2 + 1));
                        for (i, acc) in acci.iter_mut().enumerate() {
                            let s16 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(v0, quad!(i, b, 2 * t2)),
                                _mm256_maddubs_epi16(v1, quad!(i, b, 2 * t2 + 1)),
                            );
                            *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(s16, ones));
                        }
                    }
                } else {
                    // 8-bit codes as two nibbles: Σ code·a = 16 Σ hi·a + Σ lo·a.
                    let mut acc_lo = [_mm256_setzero_si256(); MR];
                    let mut acc_hi = [_mm256_setzero_si256(); MR];
                    for t in 0..F::BK / 4 {
                        let v = wv!(t);
                        let lo = _mm256_and_si256(v, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        for i in 0..MR {
                            let x = quad!(i, b, t);
                            acc_lo[i] = _mm256_add_epi16(acc_lo[i], _mm256_maddubs_epi16(lo, x));
                            acc_hi[i] = _mm256_add_epi16(acc_hi[i], _mm256_maddubs_epi16(hi, x));
                        }
                    }
                    for i in 0..MR {
                        let l = _mm256_madd_epi16(acc_lo[i], ones);
                        let hh = _mm256_madd_epi16(acc_hi[i], ones);
                        acci[i] = _mm256_add_epi32(_mm256_slli_epi32(hh, 4), l);
                    }
                }
                let (d, c) = block_scales8::<F>(base, h, negoff);
                for i in 0..MR {
                    let dx = _mm256_set1_ps(*xd0.add(i * anb + b));
                    let sx = _mm256_set1_ps(*xs0.add(i * anb + b));
                    let t =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[i]), _mm256_mul_ps(d, dx), accf[i]);
                    accf[i] = _mm256_fmadd_ps(c, sx, t);
                }
            }
            store8::<MR>(job, &accf, g * GROUP + h * 8);
        }
    }
}

/// AVX2 micro-kernel: `MR` activation rows × `NG` groups of 16 weight rows, `vpmaddubsw`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_avx2<F: Fmt, const MR: usize, const NG: usize>(job: &TileJob) {
    if job.prefetch_every == 1 {
        tile_body::<F, MR, NG, false, true>(job)
    } else {
        tile_body::<F, MR, NG, false, false>(job)
    }
}

/// AVX-VNNI micro-kernel: as [`tile_avx2`] with `vpdpbusd` on 256-bit registers.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn tile_avx2_vnni<F: Fmt, const MR: usize, const NG: usize>(job: &TileJob) {
    if job.prefetch_every == 1 {
        tile_body::<F, MR, NG, true, true>(job)
    } else {
        tile_body::<F, MR, NG, true, false>(job)
    }
}
