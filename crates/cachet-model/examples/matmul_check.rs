//! Compares QMatrix::matmul with a dense product of dequantized rows (diagnostic).
use cachet_kernels::{QMatrix, ThreadPool, WeightType};

fn main() {
    let pool = ThreadPool::new(2);
    let (rows, cols, m) = (64usize, 64usize, 3usize);
    let mut s = 1u64;
    let mut r = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let w: Vec<f32> = (0..rows * cols).map(|_| r() * 0.5).collect();
    let x: Vec<f32> = (0..m * cols).map(|_| r()).collect();
    for ty in [WeightType::F32, WeightType::F16, WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_1] {
        let q = QMatrix::quantize_f32(ty, rows, cols, &w).expect("q");
        let mut y = vec![0f32; m * rows];
        q.matmul(&pool, &x, m, &mut y);
        let mut row = vec![0f32; cols];
        let mut err = 0f32;
        let mut mx = 0f32;
        for j in 0..rows {
            q.dequantize_row(j, &mut row);
            for i in 0..m {
                let d: f32 = row.iter().zip(&x[i * cols..(i + 1) * cols]).map(|(a, b)| a * b).sum();
                err = err.max((d - y[i * rows + j]).abs());
                mx = mx.max(d.abs());
            }
        }
        println!("{ty:?}: max err {err} max |y| {mx}");
    }
}
