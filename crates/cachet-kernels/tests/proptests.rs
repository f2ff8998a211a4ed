//! Randomised shapes: every kernel level vs the dequantize-then-f32 reference.

use cachet_kernels::isa::{self, Isa};
use cachet_kernels::quant::{dequantize_row_bytes, quantize_row};
use cachet_kernels::{QMatrix, ThreadPool, WeightType};
use proptest::prelude::*;

const TYPES: [WeightType; 5] = [
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q8_0,
    WeightType::Q4K,
    WeightType::Q6K,
];

fn check(
    ty: WeightType,
    rows: usize,
    blocks: usize,
    m: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let cols = blocks * ty.block_len();
    let mut state = seed | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 20001) as f32 / 10000.0 - 1.0
    };
    let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
    let x: Vec<f32> = (0..m * cols).map(|_| next()).collect();
    let mut bytes = Vec::new();
    for r in w.chunks(cols) {
        bytes.extend_from_slice(
            &quantize_row(ty, r).map_err(|e| TestCaseError::fail(e.to_string()))?,
        );
    }
    let mat = QMatrix::from_gguf_bytes(ty, rows, cols, &bytes)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let rb = ty.row_bytes(cols);
    let mut wd = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row_bytes(
            ty,
            &bytes[r * rb..(r + 1) * rb],
            &mut wd[r * cols..(r + 1) * cols],
        )
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    let pool = ThreadPool::new(2);
    for level in Isa::supported() {
        isa::set_override(Some(level));
        let mut y = vec![0f32; m * rows];
        mat.matmul(&pool, &x, m, &mut y);
        for i in 0..m {
            let xi = &x[i * cols..(i + 1) * cols];
            let xn = xi.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            for r in 0..rows {
                let wr = &wd[r * cols..(r + 1) * cols];
                let wn = wr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                let want: f64 = xi.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = y[i * rows + r] as f64;
                prop_assert!(
                    (got - want).abs() <= 2e-2 * xn * wn + 1e-6,
                    "{:?} {} {}x{} m={} [{}][{}]: {} vs {}",
                    ty,
                    level,
                    rows,
                    cols,
                    m,
                    i,
                    r,
                    got,
                    want
                );
            }
        }
    }
    isa::set_override(None);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn matmul_matches_reference(t in 0usize..5, rows in 1usize..70, blocks in 1usize..5, m in 1usize..10, seed in any::<u64>()) {
        check(TYPES[t], rows, blocks, m, seed)?;
    }
}
