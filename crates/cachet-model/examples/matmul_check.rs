//! Compares QMatrix::matmul with a dense product of dequantized rows on the default model's
//! layer-0 matrices and the lm_head (diagnostic).
use cachet_kernels::{QMatrix, ThreadPool};
use cachet_model::gguf::Fused;
use cachet_model::{default_model_path, load_model, LoadOptions};

fn check(name: &str, q: &QMatrix, pool: &ThreadPool, m: usize) {
    let (rows, cols) = (q.rows(), q.cols());
    let mut s = 1u64;
    let x: Vec<f32> = (0..m * cols)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let mut y = vec![0f32; m * rows];
    q.matmul(pool, &x, m, &mut y);
    let mut row = vec![0f32; cols];
    let (mut err, mut mx, mut nan) = (0f32, 0f32, 0usize);
    for j in 0..rows {
        q.dequantize_row(j, &mut row);
        for i in 0..m {
            let d: f32 = row
                .iter()
                .zip(&x[i * cols..(i + 1) * cols])
                .map(|(a, b)| a * b)
                .sum();
            let g = y[i * rows + j];
            if !g.is_finite() {
                nan += 1;
            }
            err = err.max((d - g).abs());
            mx = mx.max(d.abs());
        }
    }
    println!(
        "{name} {:?} {rows}x{cols} m={m}: max err {err} max |y| {mx} non-finite {nan}",
        q.weight_type()
    );
}

fn main() {
    let pool = ThreadPool::new(2);
    let m = load_model(default_model_path(), &LoadOptions::default()).expect("load");
    let l0 = &m.weights.layers[0];
    for mm in [1, 3, 17] {
        if let Fused::One(q) = &l0.qkv {
            check("qkv", q, &pool, mm);
        }
        check("wo", &l0.wo, &pool, mm);
        if let Fused::One(q) = &l0.gate_up {
            check("gate_up", q, &pool, mm);
        }
        check("down", &l0.down, &pool, mm);
        check("lm_head", m.weights.lm_head(), &pool, mm);
    }
}
