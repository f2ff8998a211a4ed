//! AMX int8 tile kernel for quantized GEMM with many activation rows (prefill, batched decode).
//!
//! One tile product computes one weight block for up to 16 activation rows × one 16-row weight
//! group: `C[i][n] = Σ_k x_q[i][k] · code[n][k]` with `tdpbsud` (signed int8 activations ×
//! unsigned weight codes, exact int32). The packed weight layout (see [`crate::quant`]) already
//! stores each block as "4 consecutive codes of 16 rows" per 64 bytes, which is AMX's B-tile
//! (VNNI) layout: 8-bit formats load straight from the packed bytes, 4-bit formats are
//! unpacked once per group into a per-thread buffer (low nibbles are tile rows 0-3, high
//! nibbles rows 4-7). Activations load straight from [`QAct`]: row `i`, block `b` at
//! `q[i * cols + b * bk]`, stride `cols`.
//!
//! Block scales differ per block, so each block's int32 tile is stored and folded into f32
//! accumulators with the same two FMAs, in the same order, as the AVX-512 VNNI kernel: the
//! two kernels give bit-identical results, which the tests check.
//!
//! The tile operations go through the small [`Tiles`] trait: [`Hw`] issues the instructions,
//! and [`Emu`] models them in plain Rust, including the shape rules the hardware
//! enforces with `#UD`, so the whole kernel is tested on CPUs without AMX too. On a CPU with
//! AMX, [`self_test`] compares [`Hw`] with the model before [`crate::isa`] reports the level.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use crate::pool::ThreadPool;
use crate::quant::{
    Fmt, PFmt, Packed, QAct, SendPtr, TaskGrid, A64, FQ4K, FQ4_0, FQ4_1, FQ6K, FQ8_0, GROUP,
};
use crate::x86::{block_scales_512, fold_block_512};

/// Activation rows per tile (the AMX tile height).
pub(crate) const TM: usize = 16;

/// Smallest number of activation rows that takes the AMX path; fewer rows use the VNNI
/// micro-kernel, which needs no tile store per block.
pub(crate) const MIN_M: usize = 8;

/// A 64-byte `ldtilecfg` operand (palette 1).
#[repr(C, align(64))]
pub(crate) struct TileCfg([u8; 64]);

impl TileCfg {
    /// tmm0 = C (`mr` × 16 i32), tmm1 = A (`mr` × `k` i8), tmm2 = B (`k / 4` × 64 u8).
    pub(crate) fn new(mr: usize, k: usize) -> TileCfg {
        debug_assert!((1..=16).contains(&mr) && k.is_multiple_of(4) && (4..=64).contains(&k));
        let mut c = [0u8; 64];
        c[0] = 1;
        for (t, rows, colsb) in [(0, mr, 64), (1, mr, k), (2, k / 4, 64)] {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(colsb as u16).to_le_bytes());
            c[48 + t] = rows as u8;
        }
        TileCfg(c)
    }

    fn rows(&self, t: usize) -> usize {
        self.0[48 + t] as usize
    }

    fn colsb(&self, t: usize) -> usize {
        u16::from_le_bytes([self.0[16 + 2 * t], self.0[17 + 2 * t]]) as usize
    }
}

/// The tile operations the kernel uses, with fixed roles: tmm0 = C, tmm1 = A, tmm2 = B.
///
/// # Safety
/// Implementations read and write raw pointers: `load_*` reads `rows` rows of `colsb` bytes
/// at `p + r * stride`, `store_c` writes them; the caller guarantees those ranges are valid.
pub(crate) unsafe trait Tiles {
    unsafe fn config(&mut self, cfg: &TileCfg);
    unsafe fn zero_c(&mut self);
    unsafe fn load_a(&mut self, p: *const u8, stride: usize);
    unsafe fn load_b(&mut self, p: *const u8, stride: usize);
    /// `C += A · B` (signed bytes of A × unsigned bytes of B, int32 sums).
    unsafe fn dp(&mut self);
    unsafe fn store_c(&mut self, p: *mut u8, stride: usize);
    unsafe fn release(&mut self);
}

/// The AMX hardware. Only used after [`crate::isa`] detected AMX-TILE + AMX-INT8, the OS
/// enabled tile state and granted this process permission (`arch_prctl`).
#[derive(Default)]
pub(crate) struct Hw;

// SAFETY: each method is one instruction whose memory accesses are exactly the ones the trait
// documents; the tile registers are not visible to the compiler, and every `asm!` block is
// volatile, so their order is kept.
unsafe impl Tiles for Hw {
    #[inline(always)]
    unsafe fn config(&mut self, cfg: &TileCfg) {
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    }
    #[inline(always)]
    unsafe fn zero_c(&mut self) {
        asm!("tilezero tmm0", options(nostack, nomem));
    }
    #[inline(always)]
    unsafe fn load_a(&mut self, p: *const u8, stride: usize) {
        asm!("tileloadd tmm1, [{p} + {s} * 1]", p = in(reg) p, s = in(reg) stride,
            options(nostack, readonly));
    }
    #[inline(always)]
    unsafe fn load_b(&mut self, p: *const u8, stride: usize) {
        asm!("tileloadd tmm2, [{p} + {s} * 1]", p = in(reg) p, s = in(reg) stride,
            options(nostack, readonly));
    }
    #[inline(always)]
    unsafe fn dp(&mut self) {
        asm!("tdpbsud tmm0, tmm1, tmm2", options(nostack, nomem));
    }
    #[inline(always)]
    unsafe fn store_c(&mut self, p: *mut u8, stride: usize) {
        asm!("tilestored [{p} + {s} * 1], tmm0", p = in(reg) p, s = in(reg) stride,
            options(nostack));
    }
    #[inline(always)]
    unsafe fn release(&mut self) {
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// A software model of the three tiles (Intel SDM semantics of the instructions above).
/// Panics where the hardware raises `#UD`: unconfigured tiles and mismatched shapes.
pub(crate) struct Emu {
    cfg: Option<TileCfg>,
    t: [[u8; 1024]; 3],
}

impl Default for Emu {
    fn default() -> Self {
        Emu {
            cfg: None,
            t: [[0; 1024]; 3],
        }
    }
}

impl Emu {
    fn shape(&self, t: usize) -> (usize, usize) {
        let c = self
            .cfg
            .as_ref()
            .expect("tile instruction before ldtilecfg (#UD)");
        let (rows, colsb) = (c.rows(t), c.colsb(t));
        assert!(
            rows > 0 && rows <= 16 && colsb > 0 && colsb <= 64,
            "tile {t} unconfigured"
        );
        (rows, colsb)
    }

    unsafe fn load(&mut self, t: usize, p: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(t);
        self.t[t] = [0; 1024];
        for r in 0..rows {
            std::ptr::copy_nonoverlapping(
                p.add(r * stride),
                self.t[t][64 * r..].as_mut_ptr(),
                colsb,
            );
        }
    }
}

// SAFETY: memory is touched only through the documented row ranges.
unsafe impl Tiles for Emu {
    unsafe fn config(&mut self, cfg: &TileCfg) {
        assert_eq!(cfg.0[0], 1, "palette");
        self.cfg = Some(TileCfg(cfg.0));
        self.t = [[0; 1024]; 3];
    }
    unsafe fn zero_c(&mut self) {
        self.shape(0);
        self.t[0] = [0; 1024];
    }
    unsafe fn load_a(&mut self, p: *const u8, stride: usize) {
        self.load(1, p, stride)
    }
    unsafe fn load_b(&mut self, p: *const u8, stride: usize) {
        self.load(2, p, stride)
    }
    unsafe fn dp(&mut self) {
        let ((cr, cc), (ar, ac), (br, bc)) = (self.shape(0), self.shape(1), self.shape(2));
        assert!(cr == ar && cc == bc && ac == 4 * br, "tdpbsud shapes (#UD)");
        for m in 0..cr {
            for n in 0..cc / 4 {
                let mut sum = i32::from_le_bytes(
                    self.t[0][64 * m + 4 * n..64 * m + 4 * n + 4]
                        .try_into()
                        .expect("4 bytes"),
                );
                for k in 0..br {
                    for i in 0..4 {
                        let a = self.t[1][64 * m + 4 * k + i] as i8 as i32;
                        let b = self.t[2][64 * k + 4 * n + i] as i32;
                        sum = sum.wrapping_add(a * b);
                    }
                }
                self.t[0][64 * m + 4 * n..64 * m + 4 * n + 4].copy_from_slice(&sum.to_le_bytes());
            }
        }
    }
    unsafe fn store_c(&mut self, p: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(0);
        for r in 0..rows {
            std::ptr::copy_nonoverlapping(self.t[0][64 * r..].as_ptr(), p.add(r * stride), colsb);
        }
    }
    unsafe fn release(&mut self) {
        self.cfg = None;
        self.t = [[0; 1024]; 3];
    }
}

/// One task: weight groups `g0..g1` × activation rows `i0..i1`.
struct Job<'a> {
    p: &'a Packed,
    a: &'a QAct,
    rows: usize,
    y: SendPtr<f32>,
    g0: usize,
    g1: usize,
    i0: usize,
    i1: usize,
}

thread_local! {
    /// Unpacked 4-bit B tiles of one weight group (8 rows × 64 bytes per block).
    static UNPACKED: RefCell<Vec<A64>> = const { RefCell::new(Vec::new()) };
}

/// `y[m][rows] = x · Wᵀ` on the AMX hardware (see [`matmul_with`]).
pub(crate) fn matmul(
    pool: &ThreadPool,
    p: &Packed,
    rows: usize,
    a: &QAct,
    m: usize,
    y: &mut [f32],
) {
    matmul_with::<Hw>(pool, p, rows, a, m, y)
}

/// Split (weight-group chunks × activation-row ranges) into pool tasks and run the tile
/// kernel on each, with a fresh `T` per task. `y` holds `m × rows` floats (checked by
/// `QMatrix::try_matmul`); `a` was quantized with the packed format's block size.
pub(crate) fn matmul_with<T: Tiles + Default>(
    pool: &ThreadPool,
    p: &Packed,
    rows: usize,
    a: &QAct,
    m: usize,
    y: &mut [f32],
) {
    assert!(y.len() >= m * rows && a.q.len() >= m * a.cols && a.nb == p.nb);
    let grid = TaskGrid::new(p.n_groups, m.div_ceil(TM), pool.n_threads());
    let yp = SendPtr(y.as_mut_ptr());
    pool.parallel_for(grid.tasks(), &|task| {
        let (groups, tiles) = grid.ranges(task);
        if groups.is_empty() || tiles.is_empty() {
            return;
        }
        let job = Job {
            p,
            a,
            rows,
            y: yp,
            g0: groups.start,
            g1: groups.end,
            i0: tiles.start * TM,
            i1: (tiles.end * TM).min(m),
        };
        let mut unit = T::default();
        // SAFETY: AVX-512 is present wherever this runs (the AMX level implies it, and the
        // tests only call it after checking); the job's ranges lie inside `p`, `a` and `y`
        // (asserted above), and tasks write disjoint (row range × group range) parts of `y`.
        unsafe {
            match p.fmt {
                PFmt::Q4_0 => kernel::<FQ4_0, T>(&mut unit, &job),
                PFmt::Q4_1 => kernel::<FQ4_1, T>(&mut unit, &job),
                PFmt::Q8_0 => kernel::<FQ8_0, T>(&mut unit, &job),
                PFmt::Q4K => kernel::<FQ4K, T>(&mut unit, &job),
                PFmt::Q6K => kernel::<FQ6K, T>(&mut unit, &job),
            }
        }
    });
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
    let mut cbuf = [A64([0; 64]); TM];
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
            let mut acc = [_mm512_setzero_ps(); TM];
            for b in 0..nb {
                tiles.zero_c();
                tiles.load_a(xq.add(b * F::BK), cols);
                let bsrc = if F::NIB {
                    unpacked.add(b * 512) as *const u8
                } else {
                    w.add(b * F::STRIDE)
                };
                tiles.load_b(bsrc, 64);
                tiles.dp();
                tiles.store_c(cp, 64);
                // The VNNI kernel's scales and block fold: bit-identical results.
                let (d, c) = block_scales_512::<F>(w.add(b * F::STRIDE), negoff);
                for (i, acc) in acc.iter_mut().enumerate().take(mr) {
                    let sums = _mm512_load_si512(cp.add(64 * i) as *const _);
                    let (dx, sx) = (*xd.add(i * anb + b), *xs.add(i * anb + b));
                    *acc = fold_block_512(*acc, sums, d, dx, c, sx);
                }
            }
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

/// Run one 16 × 64 × 16 tile product on the hardware and compare it with the model, over
/// values that reach every byte of both signednesses. Call only on a CPU that reports
/// AMX-TILE/AMX-INT8 after permission was granted.
pub(crate) fn self_test() -> bool {
    let a: Vec<u8> = (0..16 * 64).map(|i| (i * 37 + 11) as u8).collect();
    let b: Vec<u8> = (0..16 * 64).map(|i| (i * 101 + 7) as u8).collect();
    let cfg = TileCfg::new(16, 64);
    let (mut hw, mut model) = ([A64([0; 64]); 16], [A64([0; 64]); 16]);
    // SAFETY: the caller checked AMX support and permission; buffers are 16 rows of 64 bytes.
    unsafe {
        product(&mut Hw, &cfg, &a, &b, &mut hw);
        product(&mut Emu::default(), &cfg, &a, &b, &mut model);
    }
    hw.iter().zip(&model).all(|(h, m)| h.0 == m.0)
}

unsafe fn product<T: Tiles>(t: &mut T, cfg: &TileCfg, a: &[u8], b: &[u8], c: &mut [A64; 16]) {
    t.config(cfg);
    t.zero_c();
    t.load_a(a.as_ptr(), 64);
    t.load_b(b.as_ptr(), 64);
    t.dp();
    t.store_c(c.as_mut_ptr() as *mut u8, 64);
    t.release();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::{self, Isa};
    use crate::quant::{matmul_packed, quantize_act, QMatrix, WeightType};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    /// The model against a hand-computed product: row m of A is all `m - 8` (signed), row k
    /// of B holds `n` in every byte of column n, so C[m][n] = Σ_k 4 · (m - 8) · n over K/4
    /// rows = 16 · 4 · (m - 8) · n for K = 64.
    #[test]
    fn emulator_matches_hand_computed_product() {
        let a: Vec<u8> = (0..16 * 64).map(|i| ((i / 64) as i8 - 8) as u8).collect();
        let b: Vec<u8> = (0..16 * 64).map(|i| ((i % 64) / 4) as u8).collect();
        let mut c = [A64([0; 64]); 16];
        // SAFETY: 16 rows of 64 bytes each.
        unsafe { product(&mut Emu::default(), &TileCfg::new(16, 64), &a, &b, &mut c) };
        for (m, row) in c.iter().enumerate() {
            for n in 0..16 {
                let got = i32::from_le_bytes(row.0[4 * n..4 * n + 4].try_into().unwrap());
                assert_eq!(got, 64 * (m as i32 - 8) * n as i32, "C[{m}][{n}]");
            }
        }
    }

    #[test]
    #[should_panic(expected = "tdpbsud shapes")]
    fn emulator_rejects_mismatched_shapes() {
        let mut cfg = TileCfg::new(16, 32);
        cfg.0[48 + 2] = 4; // B with 4 rows while A has 32 bytes per row
        let (a, b) = ([0u8; 1024], [0u8; 1024]);
        let mut t = Emu::default();
        // SAFETY: buffers hold 16 rows of 64 bytes.
        unsafe {
            t.config(&cfg);
            t.zero_c();
            t.load_a(a.as_ptr(), 64);
            t.load_b(b.as_ptr(), 64);
            t.dp();
        }
    }

    /// The tile kernel (on the model, and on the hardware where present) against the AVX-512
    /// VNNI kernel: the same integer sums and the same float operations, so the outputs must
    /// be bit-identical, including tails (rows not a multiple of 16, m not a multiple of 16).
    #[test]
    fn tile_kernel_is_bit_identical_to_vnni() {
        if isa::detected() < Isa::Avx512 {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let pool = ThreadPool::new(3);
        let types = [
            WeightType::Q4_0,
            WeightType::Q4_1,
            WeightType::Q8_0,
            WeightType::Q4K,
            WeightType::Q6K,
        ];
        for (ti, ty) in types.into_iter().enumerate() {
            let kq = matches!(ty, WeightType::Q4K | WeightType::Q6K);
            let shapes: &[(usize, usize)] = if kq {
                &[(1, 256), (19, 512), (40, 256)]
            } else {
                &[(1, 32), (17, 96), (50, 576), (33, 1536), (200, 64)]
            };
            for &(rows, cols) in shapes {
                let w = rand_vec((ti * 1000 + rows) as u64, rows * cols);
                let mat = QMatrix::quantize_f32(ty, rows, cols, &w).unwrap();
                let p = mat.packed().expect("quantized types are packed");
                for m in [8, 16, 17, 33, 50] {
                    let mut x = rand_vec((rows * cols + m) as u64, m * cols);
                    x[cols..2 * cols].iter_mut().for_each(|v| *v *= 30.0);
                    let mut act = QAct::default();
                    quantize_act(Isa::Avx512, &pool, &x, m, cols, p.fmt.bk(), &mut act);
                    let mut want = vec![f32::NAN; m * rows + 5];
                    matmul_packed(Isa::Avx512, &pool, p, rows, &act, m, &mut want);
                    let mut got = vec![f32::NAN; m * rows + 5];
                    matmul_with::<Emu>(&pool, p, rows, &act, m, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{ty:?} {rows}x{cols} m={m} (model)"
                    );
                    if isa::detected() == Isa::Amx {
                        let mut hw = vec![f32::NAN; m * rows + 5];
                        matmul_with::<Hw>(&pool, p, rows, &act, m, &mut hw);
                        assert_eq!(bits(&hw), bits(&want), "{ty:?} {rows}x{cols} m={m} (AMX)");
                    }
                }
            }
        }
    }
}
