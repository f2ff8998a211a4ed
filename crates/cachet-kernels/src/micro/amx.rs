//! AMX int8 tile kernel for quantized GEMM with many activation rows (prefill, batched decode).
//!
//! One tile product computes one weight block for up to 16 activation rows × one 16-row weight
//! group: `C[i][n] = Σ_k x_q[i][k] · code[n][k]` with `tdpbsud` (signed int8 activations ×
//! unsigned weight codes, exact int32). The packed weight layout (see [`crate::formats`])
//! already stores each block as "4 consecutive codes of 16 rows" per 64 bytes, which is AMX's
//! B-tile (VNNI) layout: 8-bit formats load straight from the packed bytes, 4-bit formats are
//! unpacked once per group into a per-thread buffer (low nibbles are tile rows 0-3, high
//! nibbles rows 4-7). Activations load straight from [`QAct`]: row `i`, block `b` at
//! `q[i * cols + b * bk]`, stride `cols`.
//!
//! Block scales differ per block, so each block's int32 tile is stored and folded into f32
//! accumulators with the same two FMAs, in the same order, as the AVX-512 VNNI kernel
//! (`super::avx512`): the two kernels give bit-identical results, which the tests check. The
//! products alternate between two tile sets, the next block's issued before this block's
//! fold, so the tile unit and the vector unit work at once (a single set made every product
//! wait for the previous block's store; two sets measured +15-23 % at 512 rows).
//!
//! The tile operations go through [`Tiles`] (`crate::isa::amx`): the hardware, or its
//! software model on CPUs without AMX.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx512::{block_scales_512, fold_block_512};
use crate::formats::act::QAct;
use crate::formats::packed::{
    Fmt, PFmt, Packed, FIQ4XS, FQ2K, FQ4K, FQ4_0, FQ4_1, FQ5K, FQ5_0, FQ6K, FQ8_0, GROUP,
};
use crate::isa::amx::{TileCfg, Tiles, SETS};
use crate::util::{SendPtr, A64};

/// Activation rows per tile (the AMX tile height).
pub(crate) const TM: usize = 16;

/// Smallest number of activation rows that takes the AMX path; fewer rows use the VNNI
/// micro-kernel, which needs no tile store per block. Measured on an Intel Xeon with AMX
/// (`cachet bench kernel`, 2 interleaved pairs): with 8 here, decode at batch 8 ran 600-638
/// tok/s against 753-817 with 32, batch 16 852-862 against 907-972; batch 32 the same. Since
/// the VNNI kernel's 8-row tiles (`super::MR_512`), 64: the default model's matmul set at 32
/// rows 12.5-12.7 ms on them against 15.2-15.4 on tiles, equal at 64 and 512, AMX ahead at
/// 128 (40.7-45.1 against 44.0-45.2 ms; `MODEL=… examples/perf`, 3 rounds); decode at batch
/// 32 +1.0 to +4.9 % (3 interleaved pairs), batch 48 the same.
pub(crate) const MIN_M: usize = 64;

/// One task: weight groups `g0..g1` × activation rows `i0..i1` of `y[m][rows]`.
pub(crate) struct Job<'a> {
    pub(crate) p: &'a Packed,
    pub(crate) a: &'a QAct,
    pub(crate) rows: usize,
    pub(crate) y: SendPtr<f32>,
    pub(crate) g0: usize,
    pub(crate) g1: usize,
    pub(crate) i0: usize,
    pub(crate) i1: usize,
}

thread_local! {
    /// Unpacked 4-bit B tiles of one weight group (8 rows × 64 bytes per block).
    static UNPACKED: RefCell<Vec<A64>> = const { RefCell::new(Vec::new()) };
}

/// Run one job on `tiles`, monomorphised for the packed format.
///
/// # Safety
/// AVX-512 must be present (the AMX level implies it); the job's ranges lie inside `p`, `a`
/// and `y`, and no other task writes its (row range × group range) part of `y`.
pub(crate) unsafe fn run_job<T: Tiles>(tiles: &mut T, job: &Job) {
    match job.p.fmt {
        PFmt::Q4_0 => kernel::<FQ4_0, T>(tiles, job),
        PFmt::Q4_1 => kernel::<FQ4_1, T>(tiles, job),
        PFmt::Q8_0 => kernel::<FQ8_0, T>(tiles, job),
        PFmt::Q4K => kernel::<FQ4K, T>(tiles, job),
        PFmt::Q6K => kernel::<FQ6K, T>(tiles, job),
        PFmt::Q5_0 => kernel::<FQ5_0, T>(tiles, job),
        PFmt::Q5K => kernel::<FQ5K, T>(tiles, job),
        PFmt::Q2K => kernel::<FQ2K, T>(tiles, job),
        PFmt::IQ4XS => kernel::<FIQ4XS, T>(tiles, job),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn kernel<F: Fmt, T: Tiles>(tiles: &mut T, job: &Job) {
    UNPACKED.with(|u| {
        let mut u = u.borrow_mut();
        let need = if F::NIB { job.p.nb * 8 } else { 0 };
        if u.len() < need {
            u.resize(need, A64([0; 64]));
        }
        kernel_inner::<F, T>(tiles, job, u.as_mut_ptr() as *mut u8);
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn kernel_inner<F: Fmt, T: Tiles>(tiles: &mut T, job: &Job, unpacked: *mut u8) {
    let p = job.p;
    let a = job.a;
    let (gb, nb) = (p.group_bytes(), p.nb);
    let (cols, anb) = (a.cols, a.nb);
    let m4 = _mm512_set1_epi8(0x0F);
    let negoff = _mm512_set1_ps(-(F::OFF as f32));
    // One 16-row C store per tile set (see `SETS`).
    let mut cbuf = [A64([0; 64]); TM * SETS];
    let cp = cbuf.as_mut_ptr() as *mut u8;
    let mut configured = 0;
    for g in job.g0..job.g1 {
        let w = p.bytes().as_ptr().add(g * gb);
        if F::NIB {
            for b in 0..nb {
                let (src, dst) = (w.add(b * F::STRIDE), unpacked.add(b * 512));
                for s in 0..4 {
                    let v = _mm512_loadu_si512(src.add(64 * s) as *const _);
                    _mm512_store_si512(dst.add(64 * s) as *mut _, _mm512_and_si512(v, m4));
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    _mm512_store_si512(dst.add(64 * (4 + s)) as *mut _, hi);
                }
            }
        }
        let r0 = g * GROUP;
        let nvalid = (job.rows - r0).min(GROUP);
        let mut i0 = job.i0;
        while i0 < job.i1 {
            let mr = (job.i1 - i0).min(TM);
            if mr != configured {
                tiles.config(&TileCfg::new(mr, F::BK));
                configured = mr;
            }
            let xq = a.q.as_ptr().add(i0 * cols) as *const u8;
            let xd = a.d.as_ptr().add(i0 * anb);
            let xs = a.s.as_ptr().add(i0 * anb);
            let rt = RowTile {
                xq,
                xd,
                xs,
                cols,
                anb,
                mr,
                w,
                unpacked,
                cp,
                negoff,
            };
            // A full tile's fold has a constant row count, so its accumulators stay in
            // registers.
            let acc = if mr == TM {
                row_tile::<F, T, true>(tiles, &rt, nb)
            } else {
                row_tile::<F, T, false>(tiles, &rt, nb)
            };
            let mask = if nvalid >= GROUP {
                0xFFFF
            } else {
                ((1u32 << nvalid) - 1) as __mmask16
            };
            for (i, acc) in acc.iter().enumerate().take(mr) {
                let yrow = job.y.get().add((i0 + i) * job.rows + r0);
                _mm512_mask_storeu_ps(yrow, mask, *acc);
            }
            i0 += mr;
        }
    }
    tiles.release();
}

/// What [`row_tile`] reads: one tile of activation rows (`mr` of them at `xq`, with their
/// block scales `xd`, `xs`), one weight group (`w`, or its unpacked B tiles), and the C
/// buffers of the tile sets.
struct RowTile {
    xq: *const u8,
    xd: *const f32,
    xs: *const f32,
    cols: usize,
    anb: usize,
    mr: usize,
    w: *const u8,
    unpacked: *const u8,
    cp: *mut u8,
    negoff: __m512,
}

/// One row tile × one weight group over all `nb` blocks: each block's product on tile set
/// `b % SETS`, issued before the previous block's fold (so the tile unit works while the
/// vector unit folds), then folded with the VNNI kernel's scales and operations in its order
/// (bit-identical results). `FULL`: `mr == TM`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn row_tile<F: Fmt, T: Tiles, const FULL: bool>(
    tiles: &mut T,
    t: &RowTile,
    nb: usize,
) -> [__m512; TM] {
    let rows = if FULL { TM } else { t.mr };
    let product = |tiles: &mut T, b: usize| {
        let s = b % SETS;
        tiles.zero_c(s);
        tiles.load_a(s, t.xq.add(b * F::BK), t.cols);
        let bsrc = if F::NIB {
            t.unpacked.add(b * 512)
        } else {
            t.w.add(b * F::STRIDE)
        };
        tiles.load_b(s, bsrc, 64);
        tiles.dp(s);
        tiles.store_c(s, t.cp.add(s * TM * 64), 64);
    };
    let mut acc = [_mm512_setzero_ps(); TM];
    if nb > 0 {
        product(tiles, 0);
    }
    for b in 0..nb {
        if b + 1 < nb {
            product(tiles, b + 1);
        }
        let c_b = t.cp.add((b % SETS) * TM * 64);
        let (d, c) = block_scales_512::<F>(t.w.add(b * F::STRIDE), t.negoff);
        for (i, acc) in acc.iter_mut().enumerate().take(rows) {
            let sums = _mm512_load_si512(c_b.add(64 * i) as *const _);
            let (dx, sx) = (*t.xd.add(i * t.anb + b), *t.xs.add(i * t.anb + b));
            *acc = fold_block_512(*acc, sums, d, dx, c, sx);
        }
    }
    acc
}
