//! Bit-level fingerprints of every kernel's output on every ISA level this CPU supports:
//! `cargo run --release -p cachet-kernels --example golden > before.txt`, change the code,
//! run it again and `diff` the two files. A refactoring that must not change behaviour
//! (bit-identical outputs) shows no difference; each line names the kernel, level and shape.

use cachet_kernels::attention::{paged_attention, paged_attention_parallel, PagedAttnArgs};
use cachet_kernels::isa::{self, Isa};
use cachet_kernels::{QMatrix, ThreadPool, WeightType};
use half::f16;

/// FNV-1a over the f32 bit patterns.
fn fingerprint(v: &[f32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for x in v {
        for b in x.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % 20001) as f32 / 10000.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn main() {
    let levels: Vec<Isa> = match std::env::var("LEVELS") {
        Ok(s) => s.split(',').filter_map(Isa::parse).collect(),
        Err(_) => Isa::supported(),
    };
    let pools = [ThreadPool::new(1), ThreadPool::new(2), ThreadPool::new(3)];
    for level in levels {
        isa::set_override(Some(level));
        let level = isa::active();
        matmuls(level, &pools);
        attention(level, &pools);
        let mut rng = XorShift(99);
        for n in [1usize, 7, 8, 9, 16, 17, 33, 1536] {
            let g: Vec<f32> = rng.vec(n).iter().map(|v| v * 12.0).collect();
            let u = rng.vec(n);
            let mut out = vec![0f32; n];
            cachet_kernels::act::swiglu(&g, &u, &mut out);
            println!("{level} swiglu n={n} {:016x}", fingerprint(&out));
        }
    }
    isa::set_override(None);
}

fn matmuls(level: Isa, pools: &[ThreadPool]) {
    let types = [
        WeightType::F32,
        WeightType::F16,
        WeightType::Q8_0,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q4K,
        WeightType::Q6K,
        // Appended (the earlier types keep their seeds and fingerprints).
        WeightType::BF16,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::IQ4NL,
        WeightType::Q2K,
        WeightType::Q3K,
        WeightType::Q5K,
        WeightType::IQ4XS,
    ];
    for (ti, ty) in types.into_iter().enumerate() {
        let shapes: &[(usize, usize)] = if ty.block_len() == 256 {
            &[(1, 256), (19, 512), (40, 256), (70, 768)]
        } else {
            &[(1, 32), (17, 96), (50, 576), (33, 1536), (200, 64)]
        };
        for &(rows, cols) in shapes {
            let mut rng = XorShift((ti * 7919 + rows * 31 + cols) as u64 | 1);
            let w = rng.vec(rows * cols);
            let mat = QMatrix::quantize_f32(ty, rows, cols, &w).expect("valid shape");
            let mut row = vec![0f32; cols];
            mat.dequantize_row(rows / 2, &mut row);
            println!(
                "{level} dequant {ty:?} {rows}x{cols} {:016x}",
                fingerprint(&row)
            );
            for m in [1usize, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64] {
                let mut x = rng.vec(m * cols);
                if m > 2 {
                    x[cols..2 * cols].iter_mut().for_each(|v| *v *= 30.0);
                    x[2 * cols..3 * cols].iter_mut().for_each(|v| *v = 0.0);
                }
                for pool in pools {
                    let mut y = vec![0f32; m * rows];
                    mat.matmul(pool, &x, m, &mut y);
                    println!(
                        "{level} matmul {ty:?} {rows}x{cols} m={m} t={} {:016x}",
                        pool.n_threads(),
                        fingerprint(&y)
                    );
                }
            }
        }
    }
}

fn attention(level: Isa, pools: &[ThreadPool]) {
    for &(nh, nkv, hd, bs, start, n) in &[
        (9usize, 3usize, 64usize, 16usize, 0usize, 1usize),
        (9, 3, 64, 16, 37, 1),
        (9, 3, 64, 16, 100, 5),
        (4, 4, 32, 8, 0, 9),
        (8, 2, 128, 32, 70, 3),
        (6, 1, 48, 5, 13, 4),
        (2, 1, 20, 3, 7, 2),
        (16, 8, 64, 16, 45, 1),
        (72, 8, 16, 4, 10, 1),
        (9, 3, 64, 16, 700, 1),
        (16, 8, 64, 16, 600, 1),
        (8, 1, 64, 16, 1000, 1),
        (4, 2, 32, 7, 400, 2),
        (9, 3, 64, 16, 0, 40),
        (9, 3, 64, 16, 50, 20),
        (9, 3, 64, 16, 0, 130),
    ] {
        let mut rng = XorShift((nh * 1000 + start * 7 + n) as u64 | 1);
        let ctx = start + n;
        let nblk = ctx.div_ceil(bs);
        let num_blocks = nblk + 3;
        let table: Vec<u32> = (0..nblk as u32)
            .map(|i| (i * 7 + 2) % num_blocks as u32)
            .collect();
        let arena = num_blocks * bs * nkv * hd;
        let kf: Vec<f32> = rng.vec(arena).iter().map(|v| v * 2.0).collect();
        let vf = rng.vec(arena);
        let kh: Vec<f16> = kf.iter().map(|&v| f16::from_f32(v)).collect();
        let vh: Vec<f16> = vf.iter().map(|&v| f16::from_f32(v)).collect();
        let q = rng.vec(n * nh * hd);
        let args = PagedAttnArgs {
            block_table: &table,
            block_size: bs,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            start_pos: start,
            n_tokens: n,
            scale: 1.0 / (hd as f32).sqrt(),
            window: 0,
        };
        let shape = format!("h={nh}/{nkv} hd={hd} bs={bs} start={start} n={n}");
        let mut out = vec![0f32; q.len()];
        paged_attention(&args, &q, &kf, &vf, &mut out);
        println!("{level} attn f32 {shape} {:016x}", fingerprint(&out));
        paged_attention(&args, &q, &kh, &vh, &mut out);
        println!("{level} attn f16 {shape} {:016x}", fingerprint(&out));
        for pool in pools {
            paged_attention_parallel(pool, &args, &q, &kf, &vf, &mut out);
            println!(
                "{level} attn_par f32 t={} {shape} {:016x}",
                pool.n_threads(),
                fingerprint(&out)
            );
            paged_attention_parallel(pool, &args, &q, &kh, &vh, &mut out);
            println!(
                "{level} attn_par f16 t={} {shape} {:016x}",
                pool.n_threads(),
                fingerprint(&out)
            );
        }
    }
}
