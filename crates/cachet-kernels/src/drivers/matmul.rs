//! The matmul driver: [`QMatrix`] (construction repacks the GGUF bytes into the packed
//! layout of `crate::formats::packed`), activation quantization, and the split of a matmul
//! into pool tasks that run the active level's micro-kernel (`crate::micro`).

use half::f16;

use super::grid::{TaskGrid, CONTIGUOUS_ROWS};
use crate::error::KernelError;
use crate::formats::act::QAct;
use crate::formats::dequant::bf16_to_f32;
use crate::formats::packed::{PFmt, Packed, GROUP};
use crate::formats::quantize::quantize_row;
use crate::formats::WeightType;
#[cfg(target_arch = "x86_64")]
use crate::isa::amx::{Hw, Tiles};
use crate::isa::{self, Isa};
#[cfg(target_arch = "x86_64")]
use crate::micro::amx;
use crate::micro::{self, TileJob};
use crate::pool::ThreadPool;
use crate::util::SendPtr;

thread_local! {
    static ACT: std::cell::RefCell<QAct> = std::cell::RefCell::new(QAct::default());
}

enum Repr {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Packed(Packed),
}

/// A weight matrix of `rows` output features × `cols` input features, repacked at load time.
pub struct QMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    repr: Repr,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}
impl QMatrix {
    /// `data` = the raw GGUF tensor bytes; GGUF dims are `[cols, rows]` (ne0 = cols).
    pub fn from_gguf_bytes(
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<QMatrix, KernelError> {
        if rows == 0 || cols == 0 {
            return Err(KernelError::InvalidShape(format!(
                "empty matrix {rows}x{cols}"
            )));
        }
        let bl = ty.block_len();
        if !cols.is_multiple_of(bl) {
            return Err(KernelError::InvalidShape(format!(
                "cols {cols} is not a multiple of the {ty:?} block length {bl}"
            )));
        }
        let expected = rows
            .checked_mul(ty.row_bytes(cols))
            .ok_or_else(|| KernelError::InvalidShape(format!("{rows}x{cols} overflows")))?;
        if data.len() != expected {
            return Err(KernelError::SizeMismatch {
                what: "tensor bytes",
                expected,
                got: data.len(),
            });
        }
        let repr = match ty {
            WeightType::F32 => Repr::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            // BF16 widens to f32 exactly (its bits are the f32's top half).
            WeightType::BF16 => Repr::F32(
                data.chunks_exact(2)
                    .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            WeightType::F16 => Repr::F16(
                data.chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            _ => {
                let fmt =
                    PFmt::of(ty).ok_or_else(|| KernelError::UnsupportedType(format!("{ty:?}")))?;
                Repr::Packed(Packed::build(ty, fmt, rows, cols, data))
            }
        };
        Ok(QMatrix {
            ty,
            rows,
            cols,
            repr,
        })
    }

    /// Quantize a row-major f32 matrix (`rows x cols`) with the reference quantizers.
    pub fn quantize_f32(
        ty: WeightType,
        rows: usize,
        cols: usize,
        w: &[f32],
    ) -> Result<QMatrix, KernelError> {
        if w.len() != rows * cols {
            return Err(KernelError::SizeMismatch {
                what: "f32 weights",
                expected: rows * cols,
                got: w.len(),
            });
        }
        if !cols.is_multiple_of(ty.block_len()) || cols == 0 {
            return Err(KernelError::InvalidShape(format!("cols {cols} for {ty:?}")));
        }
        let mut bytes = Vec::with_capacity(rows * ty.row_bytes(cols));
        for r in w.chunks(cols) {
            bytes.extend_from_slice(&quantize_row(ty, r)?);
        }
        QMatrix::from_gguf_bytes(ty, rows, cols, &bytes)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn weight_type(&self) -> WeightType {
        self.ty
    }

    /// The repacked weights, for quantized types.
    #[cfg(test)]
    pub(crate) fn packed(&self) -> Option<&Packed> {
        match &self.repr {
            Repr::Packed(p) => Some(p),
            _ => None,
        }
    }

    /// Bytes of weight data the kernels stream per full pass (after repacking).
    pub fn storage_bytes(&self) -> usize {
        match &self.repr {
            Repr::F32(v) => v.len() * 4,
            Repr::F16(v) => v.len() * 2,
            Repr::Packed(p) => p.len,
        }
    }

    /// Dequantize one row (for embedding lookup) into `out[..cols]`.
    /// Panics if `row >= rows` or `out.len() < cols`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "row {row} out of range ({} rows)",
            self.rows
        );
        let out = &mut out[..self.cols];
        match &self.repr {
            Repr::F32(v) => out.copy_from_slice(&v[row * self.cols..(row + 1) * self.cols]),
            Repr::F16(v) => {
                for (o, h) in out
                    .iter_mut()
                    .zip(&v[row * self.cols..(row + 1) * self.cols])
                {
                    *o = h.to_f32();
                }
            }
            Repr::Packed(p) => p.dequantize_row(row, out),
        }
    }

    /// `y[m][rows] = x[m][cols] · Wᵀ` (row-major f32), parallel over `pool`.
    /// Panics if `x.len() < m * cols` or `y.len() < m * rows`; see [`QMatrix::try_matmul`].
    pub fn matmul(&self, pool: &ThreadPool, x: &[f32], m: usize, y: &mut [f32]) {
        if let Err(e) = self.try_matmul(pool, x, m, y) {
            panic!("QMatrix::matmul: {e}");
        }
    }

    /// Like [`QMatrix::matmul`] but reports bad sizes as errors.
    pub fn try_matmul(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        if x.len() < m * self.cols {
            return Err(KernelError::SizeMismatch {
                what: "x",
                expected: m * self.cols,
                got: x.len(),
            });
        }
        if y.len() < m * self.rows {
            return Err(KernelError::SizeMismatch {
                what: "y",
                expected: m * self.rows,
                got: y.len(),
            });
        }
        if m == 0 {
            return Ok(());
        }
        let isa = isa::active();
        match &self.repr {
            Repr::F32(w) => self.matmul_float(pool, isa, x, m, y, |r, buf| {
                buf.copy_from_slice(&w[r * self.cols..(r + 1) * self.cols])
            }),
            Repr::F16(w) => self.matmul_float(pool, isa, x, m, y, |r, buf| {
                for (o, h) in buf.iter_mut().zip(&w[r * self.cols..(r + 1) * self.cols]) {
                    *o = h.to_f32();
                }
            }),
            Repr::Packed(p) => ACT.with(|a| {
                let mut a = a.borrow_mut();
                quantize_act(isa, pool, x, m, self.cols, p.fmt.bk(), &mut a);
                matmul_packed(isa, pool, p, self.rows, &a, m, y);
            }),
        }
        Ok(())
    }

    fn matmul_float(
        &self,
        pool: &ThreadPool,
        isa: Isa,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        load_row: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        let (rows, cols) = (self.rows, self.cols);
        let chunk = 16usize;
        let n_tasks = rows.div_ceil(chunk);
        let yp = SendPtr(y.as_mut_ptr());
        pool.parallel_for(n_tasks, &|t| {
            let mut buf = vec![0f32; cols];
            for r in t * chunk..((t + 1) * chunk).min(rows) {
                load_row(r, &mut buf);
                for i in 0..m {
                    let v = micro::dot_f32(isa, &x[i * cols..(i + 1) * cols], &buf);
                    // SAFETY: element (i, r) is written by exactly one task (the one owning r).
                    unsafe { *yp.get().add(i * rows + r) = v };
                }
            }
        });
    }
}

/// Quantize the `m` rows of `x` into `a` (rows in parallel when there are many).
pub(crate) fn quantize_act(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    cols: usize,
    bk: usize,
    a: &mut QAct,
) {
    a.prepare(m, cols, bk);
    let nb = a.nb;
    let qp = SendPtr(a.q.as_mut_ptr());
    let dp = SendPtr(a.d.as_mut_ptr());
    let sp = SendPtr(a.s.as_mut_ptr());
    let run = |i: usize| {
        // SAFETY: each task writes a disjoint row `i` of the three buffers, which were sized
        // for `m` rows by `prepare`.
        let (q, d, s) = unsafe {
            (
                std::slice::from_raw_parts_mut(qp.get().add(i * cols), cols),
                std::slice::from_raw_parts_mut(dp.get().add(i * nb), nb),
                std::slice::from_raw_parts_mut(sp.get().add(i * nb), nb),
            )
        };
        let xr = &x[i * cols..(i + 1) * cols];
        micro::quantize_act_row(isa, xr, bk, q, d, s);
    };
    if m >= 8 && pool.n_threads() > 1 {
        pool.parallel_for(m, &run);
    } else {
        for i in 0..m {
            run(i);
        }
    }
}

/// Activation-row tiles of a pair over which the next pair's prefetch is spread.
const PF_TILES: usize = 4;

/// Activation rows one task runs over each pair of groups (a long prefill is cut into
/// slices of this many rows). Measured on an Intel Xeon (AVX-512 VNNI, 48 KiB L1D, 2 MiB L2)
/// at 2 threads, 512 rows of the default model's Q4_1 shapes, best call of many, 8
/// interleaved pairs: 64-row slices against one slice of all 512 rows took the median of
/// 576 × 576 from 705 to 637 µs, 576 × 1536 from 1,670 to 1,453 µs and 1536 × 576 from
/// 1,479 to 1,452 µs at the AVX-512 level, and lost nothing at the AVX2 level; 128-row slices
/// were slower than 64 for the whole model, 32 and 16 no faster (docs/bench-runs/2026-12-02-*.md). The
/// AMX driver cuts its rows the same way ([`matmul_amx_with`]).
const SPLIT_ROWS: usize = 64;

/// Tile driver: splits (group pairs × row tiles) into pool tasks and calls the ISA kernel.
pub(crate) fn matmul_packed(
    isa: Isa,
    pool: &ThreadPool,
    p: &Packed,
    rows: usize,
    a: &QAct,
    m: usize,
    y: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && m >= amx::MIN_M {
        matmul_amx_with::<Hw>(pool, p, rows, a, m, y);
        return;
    }
    matmul_tiles(isa, pool, p, rows, a, m, y, micro::tile_rows(isa, p.fmt));
}

/// [`matmul_packed`]'s SIMD path with tiles of `tr` activation rows (at most what the level's
/// kernel takes: [`micro::MR`], or [`micro::MR_512`] on AVX-512).
#[allow(clippy::too_many_arguments)]
fn matmul_tiles(
    isa: Isa,
    pool: &ThreadPool,
    p: &Packed,
    rows: usize,
    a: &QAct,
    m: usize,
    y: &mut [f32],
    tr: usize,
) {
    let n_pairs = p.n_groups.div_ceil(2);
    let grid = if m <= CONTIGUOUS_ROWS {
        TaskGrid::contiguous(n_pairs, m.div_ceil(tr), pool.n_threads())
    } else {
        TaskGrid::new(n_pairs, m.div_ceil(tr), pool.n_threads(), SPLIT_ROWS / tr)
    };
    let yp = SendPtr(y.as_mut_ptr());
    let run = |task: usize| {
        let (pairs, tiles) = grid.ranges(task);
        for pair in pairs.clone() {
            let g0 = pair * 2;
            let ng = (p.n_groups - g0).min(2);
            let r0 = g0 * GROUP;
            let nvalid = (rows - r0).min(ng * GROUP);
            // The first tile of a pair reads its weights from DRAM; the next pair's are
            // prefetched meanwhile (the later tiles find theirs in cache). The prefetch is
            // split over the pair's first `PF_TILES` tiles, tile k taking the blocks
            // b ≡ k (mod tiles): issued all in the first tile it measured ~4 % slower at
            // m = 16 on AVX-512 (the prefetches queue behind each other and stall the tile).
            let next = if pair + 1 < pairs.end {
                2 * p.group_bytes()
            } else {
                0
            };
            let pf_tiles = tiles.len().min(PF_TILES);
            for tile in tiles.clone() {
                let k = tile - tiles.start;
                let i0 = tile * tr;
                let mr = (m - i0).min(tr);
                let job = TileJob {
                    p,
                    g0,
                    ng,
                    a,
                    i0,
                    mr,
                    y: yp,
                    ystride: rows,
                    r0,
                    nvalid,
                    prefetch: if k < pf_tiles { next } else { 0 },
                    prefetch_every: pf_tiles,
                    prefetch_phase: k,
                };
                micro::run_tile(isa, &job);
            }
        }
    };
    pool.parallel_for(grid.tasks(), &run);
}

/// `y[m][rows] = x · Wᵀ` on AMX tiles (`T`: the hardware, or its model in the tests): splits
/// (weight-group chunks × activation-row ranges) into pool tasks and runs the tile kernel on
/// each, with a fresh `T` per task. `y` holds `m × rows` floats (checked by
/// `QMatrix::try_matmul`); `a` was quantized with the packed format's block size.
#[cfg(target_arch = "x86_64")]
pub(crate) fn matmul_amx_with<T: Tiles + Default>(
    pool: &ThreadPool,
    p: &Packed,
    rows: usize,
    a: &QAct,
    m: usize,
    y: &mut [f32],
) {
    assert!(y.len() >= m * rows && a.q.len() >= m * a.cols && a.nb == p.nb);
    // Row slices of `SPLIT_ROWS` here too: on an Intel Xeon with AMX (2 threads, 512 rows,
    // best call of many, 3 interleaved rounds) they took 576 × 576 from 571–596 to 512–531 µs,
    // 1536 × 576 from 1,223–1,267 to 1,094–1,157 and 576 × 1536 from 1,217–1,273 to
    // 1,131–1,150, and the default model's whole matmul set from 209–216 to 196–204 ms
    // (4 interleaved pairs); 128-row slices were no better for the whole model, 32-row ones
    // slower for two of the three matrices.
    let grid = TaskGrid::new(
        p.n_groups,
        m.div_ceil(amx::TM),
        pool.n_threads(),
        SPLIT_ROWS / amx::TM,
    );
    let yp = SendPtr(y.as_mut_ptr());
    pool.parallel_for(grid.tasks(), &|task| {
        let (groups, tiles) = grid.ranges(task);
        if groups.is_empty() || tiles.is_empty() {
            return;
        }
        let job = amx::Job {
            p,
            a,
            rows,
            y: yp,
            g0: groups.start,
            g1: groups.end,
            i0: tiles.start * amx::TM,
            i1: (tiles.end * amx::TM).min(m),
        };
        let mut unit = T::default();
        // SAFETY: AVX-512 is present wherever this runs (the AMX level implies it, and the
        // tests only call it after checking); the job's ranges lie inside `p`, `a` and `y`
        // (asserted above), and tasks write disjoint (row range × group range) parts of `y`.
        unsafe { amx::run_job(&mut unit, &job) };
    });
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::isa::amx::{Emu, Hw};
    use crate::isa::{self, Isa};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    /// Every format of `types` at 1, 17 and 50 weight rows and each m of `ms`: `tall`-row tiles
    /// on `isa` give the bits of 4-row ones. `check` sees each matrix's packed format first.
    fn tall_tiles_equal_four_row_tiles(
        isa: Isa,
        types: &[WeightType],
        seed: usize,
        ms: &[usize],
        tall: usize,
        check: impl Fn(WeightType, crate::formats::packed::PFmt),
    ) {
        let pool = ThreadPool::new(3);
        for (ti, &ty) in types.iter().enumerate() {
            let cols = if ty.block_len() == 256 { 512 } else { 96 };
            for rows in [1usize, 17, 50] {
                let w = rand_vec((ti * 100 + rows + seed) as u64, rows * cols);
                let mat = QMatrix::quantize_f32(ty, rows, cols, &w).unwrap();
                let p = mat.packed().expect("quantized types are packed");
                check(ty, p.fmt);
                for &m in ms {
                    let x = rand_vec((rows * cols + m) as u64, m * cols);
                    let mut act = QAct::default();
                    quantize_act(isa, &pool, &x, m, cols, p.fmt.bk(), &mut act);
                    let run = |tr: usize| {
                        let mut y = vec![f32::NAN; m * rows + 3];
                        matmul_tiles(isa, &pool, p, rows, &act, m, &mut y, tr);
                        y.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
                    };
                    assert_eq!(run(tall), run(4), "{ty:?} {rows}x{cols} m={m}");
                }
            }
        }
    }

    /// 8-row AVX-512 tiles (Intel CPUs) against 4-row ones, whatever this CPU's vendor: every
    /// output row is the same sequence of operations in either, so the bits must agree, for
    /// each format, tails of rows and of m (5, 6 or 7 rows in the last tile), and row slices
    /// (150 rows).
    #[test]
    fn eight_row_tiles_equal_four_row_tiles() {
        use crate::formats::packed::PFmt;
        use crate::micro::tile_rows_for;
        if isa::detected() < Isa::Avx512 {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let types = [
            WeightType::Q4_0,
            WeightType::Q4_1,
            WeightType::Q4K,
            WeightType::Q6K,
            WeightType::Q3K,
            WeightType::Q2K,
        ];
        tall_tiles_equal_four_row_tiles(
            Isa::Avx512,
            &types,
            0,
            &[5, 8, 13, 16, 23, 150],
            8,
            |_, fmt| assert_eq!(tile_rows_for(Isa::Avx512, fmt, true), 8),
        );
        // Q8_0, the other one-byte formats of 32-value blocks and the other vendors keep 4 rows.
        for fmt in [PFmt::Q8_0, PFmt::Q5_0, PFmt::Q5K, PFmt::IQ4XS] {
            assert_eq!(tile_rows_for(Isa::Avx512, fmt, true), 4, "{fmt:?}");
        }
        assert_eq!(tile_rows_for(Isa::Amx, PFmt::Q4_1, false), 4);
    }

    /// 6-row plain AVX2 tiles (4-bit formats, Intel CPUs) against 4-row ones, whatever this
    /// CPU's vendor: the same operations per output row, so the same bits, for tails of rows
    /// and of m (5 or 6 rows in a tile, a 1- to 5-row last tile) and row slices (150 rows). The
    /// other formats (two `vpmaddubsw` per 8-bit code: 6 rows were slower), the AVX-VNNI level
    /// and other vendors keep 4 rows; a 6-row tile of those formats would still compute right
    /// (checked here too, as the kernel dispatch has the instances).
    #[test]
    fn six_row_avx2_tiles_equal_four_row_tiles() {
        use crate::micro::tile_rows_for;
        if isa::detected() < Isa::Avx2 {
            eprintln!("skipped: no AVX2 on this CPU");
            return;
        }
        let types = [
            WeightType::Q4_0,
            WeightType::Q4_1,
            WeightType::Q4K,
            WeightType::Q8_0,
            WeightType::Q6K,
            WeightType::Q5_0,
            WeightType::Q5_1,
            WeightType::Q2K,
            WeightType::IQ4XS,
        ];
        tall_tiles_equal_four_row_tiles(
            Isa::Avx2,
            &types,
            7,
            &[5, 6, 7, 11, 16, 23, 150],
            6,
            |ty, fmt| {
                let want_rows = if fmt.nib() { 6 } else { 4 };
                assert_eq!(tile_rows_for(Isa::Avx2, fmt, true), want_rows, "{ty:?}");
                assert_eq!(tile_rows_for(Isa::Avx2, fmt, false), 4, "{ty:?}");
                assert_eq!(tile_rows_for(Isa::Avx2Vnni, fmt, true), 4, "{ty:?}");
            },
        );
    }

    /// The tile kernel (on the model, and on the hardware where present) against the AVX-512
    /// VNNI kernel: the same integer sums and the same float operations, so the outputs must
    /// be bit-identical, including tails (rows not a multiple of 16, m not a multiple of 16) and
    /// row slices.
    #[test]
    fn amx_tile_kernel_is_bit_identical_to_vnni() {
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
            WeightType::Q5_0,
            WeightType::Q5_1,
            WeightType::Q5K,
            WeightType::Q2K,
            WeightType::Q3K,
            WeightType::IQ4NL,
            WeightType::IQ4XS,
        ];
        for (ti, ty) in types.into_iter().enumerate() {
            let kq = ty.block_len() == 256;
            let shapes: &[(usize, usize)] = if kq {
                &[(1, 256), (19, 512), (40, 256)]
            } else {
                &[(1, 32), (17, 96), (50, 576), (33, 1536), (200, 64)]
            };
            for &(rows, cols) in shapes {
                let w = rand_vec((ti * 1000 + rows) as u64, rows * cols);
                let mat = QMatrix::quantize_f32(ty, rows, cols, &w).unwrap();
                let p = mat.packed().expect("quantized types are packed");
                // 150 rows: three row slices of at most 64 (the last a partial tile).
                for m in [8, 16, 17, 33, 50, 150] {
                    let mut x = rand_vec((rows * cols + m) as u64, m * cols);
                    x[cols..2 * cols].iter_mut().for_each(|v| *v *= 30.0);
                    let mut act = QAct::default();
                    quantize_act(Isa::Avx512, &pool, &x, m, cols, p.fmt.bk(), &mut act);
                    let mut want = vec![f32::NAN; m * rows + 5];
                    matmul_packed(Isa::Avx512, &pool, p, rows, &act, m, &mut want);
                    let mut got = vec![f32::NAN; m * rows + 5];
                    matmul_amx_with::<Emu>(&pool, p, rows, &act, m, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{ty:?} {rows}x{cols} m={m} (model)"
                    );
                    if isa::detected() == Isa::Amx {
                        let mut hw = vec![f32::NAN; m * rows + 5];
                        matmul_amx_with::<Hw>(&pool, p, rows, &act, m, &mut hw);
                        assert_eq!(bits(&hw), bits(&want), "{ty:?} {rows}x{cols} m={m} (AMX)");
                    }
                }
            }
        }
    }
}
