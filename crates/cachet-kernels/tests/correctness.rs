//! Kernels vs scalar references, on every ISA level this CPU supports.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

mod common;
use common::for_each_isa;

use cachet_kernels::attention::{
    attention_reference, paged_attention, paged_attention_parallel, try_paged_attention, KvElem,
    PagedAttnArgs,
};
use cachet_kernels::isa::{self, AmxStatus, Isa};
use cachet_kernels::quant::{
    self, dequantize_block, dequantize_row_bytes, quantize_row, BlockQ4K, BlockQ4_0, BlockQ4_1,
    BlockQ6K, BlockQ8_0,
};
use cachet_kernels::{QMatrix, ThreadPool, WeightType};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

const ALL_TYPES: [WeightType; 15] = WeightType::ALL;

/// The quantized types of 32-value blocks, and of 256-value super-blocks.
const BLOCK32: [WeightType; 6] = [
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q5_0,
    WeightType::Q5_1,
    WeightType::Q8_0,
    WeightType::IQ4NL,
];
const BLOCK256: [WeightType; 6] = [
    WeightType::Q2K,
    WeightType::Q3K,
    WeightType::Q4K,
    WeightType::Q5K,
    WeightType::Q6K,
    WeightType::IQ4XS,
];

// ------------------------------------------------------------------ ggml layouts

#[test]
fn q8_0_known_values() {
    let x: Vec<f32> = (0..32).map(|j| j as f32 - 16.0).collect();
    let b = quant::quantize_block_q8_0(&x);
    let d = 16.0f32 / 127.0;
    assert_eq!(b.d, f16::from_f32(d));
    for j in 0..32 {
        assert_eq!(b.qs[j] as i32, ((j as f32 - 16.0) / d).round() as i32);
    }
    let bytes = b.to_bytes();
    assert_eq!(bytes.len(), 34);
    assert_eq!(&bytes[..2], &f16::from_f32(d).to_bits().to_le_bytes());
    assert_eq!(BlockQ8_0::from_bytes(&bytes), b);
    let mut out = [0f32; 32];
    dequantize_block(WeightType::Q8_0, &bytes, &mut out).unwrap();
    for j in 0..32 {
        assert_eq!(out[j], b.qs[j] as f32 * b.d.to_f32());
        assert!((out[j] - x[j]).abs() < 0.1);
    }
}

#[test]
fn q4_0_known_layout() {
    let mut qs = [0u8; 16];
    for j in 0..16 {
        qs[j] = (j as u8) | ((15 - j as u8) << 4);
    }
    let blk = BlockQ4_0 {
        d: f16::from_f32(0.5),
        qs,
    };
    let bytes = blk.to_bytes();
    assert_eq!(bytes.len(), 18);
    let mut out = [0f32; 32];
    dequantize_block(WeightType::Q4_0, &bytes, &mut out).unwrap();
    for j in 0..16 {
        assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(out[j + 16], (15.0 - j as f32 - 8.0) * 0.5);
    }
    // ggml reference quantizer: the signed abs-max maps to -8.
    let x: Vec<f32> = (0..32).map(|j| (j as f32 - 10.0) * 0.25).collect();
    let b = quant::quantize_block_q4_0(&x);
    assert_eq!(b.d, f16::from_f32(5.25 / -8.0));
    dequantize_block(WeightType::Q4_0, &b.to_bytes(), &mut out).unwrap();
    for j in 0..32 {
        assert!(
            (out[j] - x[j]).abs() <= 0.33 + 1e-3,
            "{j}: {} vs {}",
            out[j],
            x[j]
        );
    }
    assert_eq!(out[31], x[31] * 0.0 + (0 - 8) as f32 * b.d.to_f32());
}

#[test]
fn q4_1_known_layout() {
    let mut qs = [0u8; 16];
    for j in 0..16 {
        qs[j] = (j as u8) | (((j as u8 * 7) % 16) << 4);
    }
    let blk = BlockQ4_1 {
        d: f16::from_f32(0.25),
        m: f16::from_f32(-1.0),
        qs,
    };
    let bytes = blk.to_bytes();
    assert_eq!(bytes.len(), 20);
    assert_eq!(BlockQ4_1::from_bytes(&bytes), blk);
    let mut out = [0f32; 32];
    dequantize_block(WeightType::Q4_1, &bytes, &mut out).unwrap();
    for j in 0..16 {
        assert_eq!(out[j], j as f32 * 0.25 - 1.0);
        assert_eq!(out[j + 16], ((j * 7) % 16) as f32 * 0.25 - 1.0);
    }
    let x: Vec<f32> = (0..32).map(|j| j as f32 * 0.1 - 1.0).collect();
    let b = quant::quantize_block_q4_1(&x);
    assert_eq!(b.m, f16::from_f32(-1.0));
    assert_eq!(b.d, f16::from_f32(3.1 / 15.0));
    assert_eq!(b.qs[0] & 0xF, 0);
    assert_eq!(b.qs[15] >> 4, 15);
}

#[test]
fn q4k_known_layout() {
    let ls: [u8; 8] = [1, 63, 17, 33, 2, 40, 63, 9];
    let lm: [u8; 8] = [0, 5, 48, 31, 63, 16, 1, 20];
    let scales = quant::q4k_pack_scales(&ls, &lm);
    for j in 0..8 {
        assert_eq!(quant::q4k_scale_min(j, &scales), (ls[j], lm[j]));
    }
    let mut rng = StdRng::seed_from_u64(1);
    let mut qs = [0u8; 128];
    rng.fill(&mut qs[..]);
    let blk = BlockQ4K {
        d: f16::from_f32(0.5),
        dmin: f16::from_f32(0.25),
        scales,
        qs,
    };
    let bytes = blk.to_bytes();
    assert_eq!(bytes.len(), 144);
    assert_eq!(&bytes[4..16], &scales);
    let mut out = [0f32; 256];
    dequantize_block(WeightType::Q4K, &bytes, &mut out).unwrap();
    for i in 0..256 {
        let (j, w) = (i / 64, i % 64);
        let sub = 2 * j + usize::from(w >= 32);
        let q = if w < 32 {
            qs[32 * j + w] & 0xF
        } else {
            qs[32 * j + w - 32] >> 4
        };
        let want = 0.5 * ls[sub] as f32 * q as f32 - 0.25 * lm[sub] as f32;
        assert_eq!(out[i], want, "value {i}");
    }
}

#[test]
fn q6k_known_layout() {
    let mut rng = StdRng::seed_from_u64(2);
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    rng.fill(&mut ql[..]);
    rng.fill(&mut qh[..]);
    let mut scales = [0i8; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        *s = (i as i8 - 8) * 9;
    }
    let blk = BlockQ6K {
        ql,
        qh,
        scales,
        d: f16::from_f32(0.125),
    };
    let bytes = blk.to_bytes();
    assert_eq!(bytes.len(), 210);
    assert_eq!(BlockQ6K::from_bytes(&bytes), blk);
    let mut out = [0f32; 256];
    dequantize_block(WeightType::Q6K, &bytes, &mut out).unwrap();
    for i in 0..256 {
        let (n, r) = (i / 128, i % 128);
        let (k, l) = (r / 32, r % 32);
        let byte = ql[64 * n + l + 32 * (k % 2)];
        let lo = if k < 2 { byte & 0xF } else { byte >> 4 };
        let hi = (qh[32 * n + l] >> (2 * k)) & 3;
        let code = (lo | (hi << 4)) as i32;
        let want = 0.125 * scales[i / 16] as f32 * (code - 32) as f32;
        assert_eq!(out[i], want, "value {i}");
    }
}

#[test]
fn quantize_roundtrip_all_types() {
    let mut rng = StdRng::seed_from_u64(3);
    for ty in ALL_TYPES {
        let x = rand_vec(&mut rng, 512);
        let bytes = quantize_row(ty, &x).unwrap();
        assert_eq!(bytes.len(), ty.row_bytes(512));
        let mut out = vec![0f32; 512];
        dequantize_row_bytes(ty, &bytes, &mut out).unwrap();
        let tol = match ty {
            WeightType::F32 => 0.0,
            WeightType::F16 => 1e-3,
            WeightType::BF16 | WeightType::Q8_0 => 0.01,
            WeightType::Q6K | WeightType::Q5_1 | WeightType::Q5K => 0.04,
            // The signed abs-max maps to level −16: the other side's top step is clamped.
            WeightType::Q5_0 => 0.07,
            WeightType::Q3K => 0.3,
            WeightType::Q2K => 0.45,
            _ => 0.15,
        };
        for (a, b) in out.iter().zip(&x) {
            assert!((a - b).abs() <= tol, "{ty:?}: {a} vs {b}");
        }
    }
}

#[test]
fn constructor_errors() {
    assert!(QMatrix::from_gguf_bytes(WeightType::Q4_1, 2, 33, &[0; 40]).is_err());
    assert!(QMatrix::from_gguf_bytes(WeightType::Q4_1, 2, 32, &[0; 39]).is_err());
    assert!(QMatrix::from_gguf_bytes(WeightType::Q4K, 1, 128, &[0; 72]).is_err());
    assert!(QMatrix::from_gguf_bytes(WeightType::Q4_1, 0, 32, &[]).is_err());
    assert!(QMatrix::from_gguf_bytes(WeightType::Q4_1, 2, 32, &[0; 40]).is_ok());
    let m = QMatrix::from_gguf_bytes(WeightType::Q8_0, 2, 32, &[0; 68]).unwrap();
    let pool = ThreadPool::new(1);
    let mut y = [0f32; 1];
    assert!(m.try_matmul(&pool, &[0.0; 32], 1, &mut y).is_err());
    assert!(m.try_matmul(&pool, &[0.0; 31], 1, &mut [0.0; 2]).is_err());
    assert!(WeightType::from_ggml_type_id(99).is_err());
    for ty in ALL_TYPES {
        assert_eq!(
            WeightType::from_ggml_type_id(ty.ggml_type_id()).unwrap(),
            ty
        );
    }
}

// ------------------------------------------------------------------ matmul

/// On a CPU with AMX the level is offered only after the hardware tile product matched the
/// software model; a mismatch must fail here rather than quietly fall back to AVX-512.
#[test]
fn amx_level_only_after_a_passing_self_test() {
    let status = isa::amx_status();
    eprintln!("AMX: {status}; detected level: {}", isa::detected());
    assert_ne!(
        status,
        AmxStatus::SelfTestFailed,
        "AMX tiles disagree with the model"
    );
    if isa::detected() == Isa::Amx {
        assert_eq!(status, AmxStatus::Usable);
    }
}

fn check_matmul(
    ty: WeightType,
    rows: usize,
    cols: usize,
    ms: &[usize],
    pool: &ThreadPool,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w = rand_vec(&mut rng, rows * cols);
    let mut bytes = Vec::new();
    for r in w.chunks(cols) {
        bytes.extend_from_slice(&quantize_row(ty, r).unwrap());
    }
    let mat = QMatrix::from_gguf_bytes(ty, rows, cols, &bytes).unwrap();
    // Reference weights: dequantized straight from the ggml bytes.
    let rb = ty.row_bytes(cols);
    let mut wd = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row_bytes(
            ty,
            &bytes[r * rb..(r + 1) * rb],
            &mut wd[r * cols..(r + 1) * cols],
        )
        .unwrap();
    }
    // dequantize_row of the repacked matrix is bit-exact.
    let mut row = vec![0f32; cols];
    for r in [0, rows / 2, rows - 1] {
        mat.dequantize_row(r, &mut row);
        assert_eq!(
            &row[..],
            &wd[r * cols..(r + 1) * cols],
            "{ty:?} dequantize_row {r}"
        );
    }
    let wn: Vec<f64> = wd
        .chunks(cols)
        .map(|r| r.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt())
        .collect();
    for &m in ms {
        let mut x = rand_vec(&mut rng, m * cols);
        if m > 2 {
            // an outlier row and an all-zero row
            x[cols..2 * cols].iter_mut().for_each(|v| *v *= 30.0);
            x[2 * cols..3 * cols].iter_mut().for_each(|v| *v = 0.0);
        }
        let mut y = vec![f32::NAN; m * rows + 3];
        mat.matmul(pool, &x, m, &mut y);
        assert!(
            y[m * rows..].iter().all(|v| v.is_nan()),
            "wrote past m*rows"
        );
        let tol_rel = match ty {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => 1e-5,
            _ => 2e-2,
        };
        for i in 0..m {
            let xi = &x[i * cols..(i + 1) * cols];
            let xn = xi.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            for r in 0..rows {
                let want: f64 = xi
                    .iter()
                    .zip(&wd[r * cols..(r + 1) * cols])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                let got = y[i * rows + r] as f64;
                let tol = tol_rel * xn * wn[r] + 1e-6;
                assert!(
                    (got - want).abs() <= tol,
                    "{ty:?} isa={} {rows}x{cols} m={m} y[{i}][{r}] = {got}, want {want} (tol {tol})",
                    isa::active()
                );
            }
        }
    }
}

#[test]
fn matmul_legacy_types_all_isas() {
    let pool = ThreadPool::new(2);
    for_each_isa(|_| {
        for ty in BLOCK32
            .into_iter()
            .chain([WeightType::F32, WeightType::F16, WeightType::BF16])
        {
            for (rows, cols) in [(1, 32), (17, 96), (50, 576), (33, 1536), (200, 64)] {
                check_matmul(
                    ty,
                    rows,
                    cols,
                    &[1, 3, 7, 16, 33],
                    &pool,
                    rows as u64 * 31 + cols as u64,
                );
            }
        }
    });
}

#[test]
fn matmul_kquants_all_isas() {
    let pool = ThreadPool::new(3);
    for_each_isa(|_| {
        for ty in BLOCK256 {
            for (rows, cols) in [(1, 256), (19, 512), (40, 256)] {
                check_matmul(
                    ty,
                    rows,
                    cols,
                    &[1, 3, 7, 16, 33],
                    &pool,
                    rows as u64 * 7 + cols as u64,
                );
            }
        }
    });
}

#[test]
fn isa_levels_agree_closely() {
    // All levels run the same integer math: results agree up to f32 summation order.
    let pool = ThreadPool::new(2);
    let mut rng = StdRng::seed_from_u64(9);
    let (rows, cols, m) = (45, 576, 5);
    let w = rand_vec(&mut rng, rows * cols);
    let x = rand_vec(&mut rng, m * cols);
    for ty in BLOCK32.into_iter().chain(BLOCK256) {
        let cols = if ty.block_len() == 256 { 512 } else { cols };
        let mat = QMatrix::quantize_f32(ty, rows, cols, &w[..rows * cols]).unwrap();
        let mut outs = Vec::new();
        for_each_isa(|_| {
            let mut y = vec![0f32; m * rows];
            mat.matmul(&pool, &x[..m * cols], m, &mut y);
            outs.push(y);
        });
        for o in &outs[1..] {
            for (a, b) in o.iter().zip(&outs[0]) {
                assert!(
                    (a - b).abs() <= 1e-3 * (1.0 + b.abs()),
                    "{ty:?}: {a} vs {b}"
                );
            }
        }
    }
}

/// Every SIMD level (AVX2, AVX2 + AVX-VNNI, AVX-512 VNNI, AMX) quantizes the activations to
/// the same bytes, computes the same exact int32 block sums and folds them with the same two
/// FMAs in the same order: their outputs are bit-identical, for every packed format and for
/// tails in both the weight rows and the activation rows.
#[test]
fn simd_levels_are_bit_identical() {
    let pool = ThreadPool::new(2);
    let mut rng = StdRng::seed_from_u64(21);
    for ty in BLOCK32.into_iter().chain(BLOCK256) {
        let shapes: &[(usize, usize)] = if ty.block_len() == 256 {
            &[(19, 512), (40, 256)]
        } else {
            &[(17, 96), (50, 576), (33, 64)]
        };
        for &(rows, cols) in shapes {
            let w = rand_vec(&mut rng, rows * cols);
            let mat = QMatrix::quantize_f32(ty, rows, cols, &w).unwrap();
            for m in [1usize, 3, 4, 5, 9, 17] {
                let mut x = rand_vec(&mut rng, m * cols);
                x[..cols].iter_mut().for_each(|v| *v *= 40.0);
                let mut outs: Vec<(Isa, Vec<u32>)> = Vec::new();
                for_each_isa(|level| {
                    if level >= Isa::Avx2 {
                        let mut y = vec![0f32; m * rows];
                        mat.matmul(&pool, &x, m, &mut y);
                        outs.push((level, y.iter().map(|v| v.to_bits()).collect()));
                    }
                });
                for (level, bits) in &outs[1.min(outs.len())..] {
                    assert!(
                        bits == &outs[0].1,
                        "{ty:?} {rows}x{cols} m={m}: {level} differs from {}",
                        outs[0].0
                    );
                }
            }
        }
    }
}

/// A long prefill is cut into row slices per task (`SPLIT_ROWS`, 64 rows); each activation
/// row's output must not depend on which slice, tile or task computed it: 201 rows at once
/// (51 tiles of 4 rows in four slices of at most 13 tiles; at the AVX-512 level of an Intel CPU
/// the 4- and 6-bit formats take 26 tiles of 8 rows, in four slices of at most 7; the last tile a
/// single row) equal
/// the same rows one at a time, bit for bit, on every level and with 1 and 3 threads.
#[test]
fn long_prefill_rows_match_one_row_at_a_time() {
    let mut rng = StdRng::seed_from_u64(44);
    for (ty, rows, cols) in [
        (WeightType::Q4_1, 50, 576),
        (WeightType::Q8_0, 33, 64),
        (WeightType::Q4K, 19, 512),
    ] {
        let w = rand_vec(&mut rng, rows * cols);
        let mat = QMatrix::quantize_f32(ty, rows, cols, &w).unwrap();
        let m = 201;
        let x = rand_vec(&mut rng, m * cols);
        for threads in [1, 3] {
            let pool = ThreadPool::new(threads);
            for_each_isa(|level| {
                let mut all = vec![0f32; m * rows];
                mat.matmul(&pool, &x, m, &mut all);
                for i in 0..m {
                    let mut one = vec![0f32; rows];
                    mat.matmul(&pool, &x[i * cols..(i + 1) * cols], 1, &mut one);
                    let got: Vec<u32> = all[i * rows..(i + 1) * rows]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let want: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                    assert!(
                        got == want,
                        "{ty:?} {level} {threads} threads: row {i} differs"
                    );
                }
            });
        }
    }
}

// ------------------------------------------------------------------ attention

fn check_attention<T: KvElem>(
    pool: &ThreadPool,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    bs: usize,
    start: usize,
    n_tok: usize,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let ctx = start + n_tok;
    let nblk = ctx.div_ceil(bs);
    let num_blocks = nblk + 3;
    // a shuffled block table
    let mut table: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..table.len()).rev() {
        let j = rng.gen_range(0..=i);
        table.swap(i, j);
    }
    table.truncate(nblk);
    let arena = num_blocks * bs * n_kv * hd;
    let k: Vec<T> = (0..arena)
        .map(|_| T::from_f32(rng.gen_range(-2.0..2.0)))
        .collect();
    let v: Vec<T> = (0..arena)
        .map(|_| T::from_f32(rng.gen_range(-1.0..1.0)))
        .collect();
    let q = rand_vec(&mut rng, n_tok * n_heads * hd);
    let args = PagedAttnArgs {
        block_table: &table,
        block_size: bs,
        n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        start_pos: start,
        n_tokens: n_tok,
        scale: 1.0 / (hd as f32).sqrt(),
        window: 0,
    };
    let mut want = vec![0f32; q.len()];
    attention_reference(&args, &q, &k, &v, &mut want);
    let mut got = vec![0f32; q.len()];
    paged_attention(&args, &q, &k, &v, &mut got);
    let mut got_par = vec![0f32; q.len()];
    paged_attention_parallel(pool, &args, &q, &k, &v, &mut got_par);
    for (i, ((a, b), c)) in got.iter().zip(&want).zip(&got_par).enumerate() {
        assert!(
            (a - b).abs() < 2e-4,
            "isa={} h={n_heads}/{n_kv} hd={hd} bs={bs} start={start} n={n_tok} [{i}] {a} vs {b}",
            isa::active()
        );
        assert!((c - b).abs() < 2e-4, "parallel [{i}] {c} vs {b}");
    }
}

#[test]
fn paged_attention_all_isas() {
    let pool = ThreadPool::new(2);
    for_each_isa(|_| {
        for &(nh, nkv, hd, bs, start, n) in &[
            (9, 3, 64, 16, 0, 1),
            (9, 3, 64, 16, 37, 1),
            (9, 3, 64, 16, 100, 5),
            (4, 4, 32, 8, 0, 9),
            (8, 2, 128, 32, 70, 3),
            (6, 1, 48, 5, 13, 4),
            (2, 1, 20, 3, 7, 2),
            // decode tokens with several kv groups (one pass over all groups), with odd head
            // sizes and block sizes, and more heads than one pass takes (falls back)
            (16, 8, 64, 16, 45, 1),
            (6, 2, 48, 5, 13, 1),
            (72, 8, 16, 4, 10, 1),
            // long contexts: the parallel version splits them into merged segments
            (9, 3, 64, 16, 700, 1),
            (16, 8, 64, 16, 600, 1),
            (6, 2, 48, 5, 333, 1),
            (8, 1, 64, 16, 1000, 1),
            (4, 2, 32, 7, 400, 2),
            // prefill-like: several query-token tiles and chunks, causal inside the chunk
            (9, 3, 64, 16, 0, 40),
            (9, 3, 64, 16, 50, 20),
            // several query tokens on the row-vectorised kernel: a short chunk over a long
            // context (split into merged segments when parallel), 63 rows in one pass, rows
            // that fill no whole vector, several tiles of 8 tokens × 8 heads, and a prefill
            // of many tiles from position 0
            (9, 3, 64, 16, 1984, 16),
            (9, 3, 64, 7, 250, 21),
            (9, 3, 64, 16, 130, 5),
            (16, 2, 64, 16, 200, 10),
            (9, 3, 64, 16, 0, 100),
            (4, 1, 32, 16, 300, 2),
        ] {
            check_attention::<f32>(&pool, nh, nkv, hd, bs, start, n, 5 + start as u64);
            check_attention::<f16>(&pool, nh, nkv, hd, bs, start, n, 6 + start as u64);
        }
    });
}

/// Several query tokens (the row-vectorised kernel): AVX2 and AVX-512 give the same bits,
/// sequential and parallel (context segments merged) alike.
#[test]
fn attention_bad_args_are_errors() {
    let table = [0u32, 5];
    let k = vec![0f32; 2 * 4 * 2 * 8];
    let q = vec![0f32; 4 * 8];
    let mut out = vec![0f32; 4 * 8];
    let mut args = PagedAttnArgs {
        block_table: &table,
        block_size: 4,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        start_pos: 3,
        n_tokens: 1,
        scale: 1.0,
        window: 0,
    };
    assert!(try_paged_attention(&args, &q, &k, &k, &mut out).is_ok());
    args.start_pos = 4; // needs block 5: arena too short
    assert!(try_paged_attention(&args, &q, &k, &k, &mut out).is_err());
    args.start_pos = 8; // needs a third block-table entry
    assert!(try_paged_attention(&args, &q, &k, &k, &mut out).is_err());
    args.start_pos = 0;
    args.n_kv_heads = 3;
    assert!(try_paged_attention(&args, &q, &k, &k, &mut out).is_err());
    args.n_kv_heads = 2;
    assert!(try_paged_attention(&args, &q[..8], &k, &k, &mut out).is_err());
}

#[test]
fn shared_types_are_send_sync() {
    fn ok<T: Send + Sync>() {}
    ok::<QMatrix>();
    ok::<ThreadPool>();
    ok::<cachet_kernels::KernelError>();
}

/// SwiGLU on every ISA level against f64 arithmetic: lengths around the vector widths,
/// inputs across the range a feed-forward block produces and beyond (|x| up to 120).
#[test]
fn swiglu_matches_f64_on_every_isa() {
    let mut rng = StdRng::seed_from_u64(11);
    for_each_isa(|level| {
        for n in [1usize, 7, 8, 9, 15, 16, 17, 33, 1536] {
            let g: Vec<f32> = (0..n)
                .map(|i| match i % 5 {
                    0 => rng.gen_range(-120.0f32..120.0),
                    1 => 0.0,
                    _ => rng.gen_range(-8.0f32..8.0),
                })
                .collect();
            let u = rand_vec(&mut rng, n);
            let mut out = vec![f32::NAN; n + 1];
            cachet_kernels::act::swiglu(&g, &u, &mut out[..n]);
            assert!(out[n].is_nan(), "{level:?}: wrote past the output");
            for i in 0..n {
                let (x, y) = (g[i] as f64, u[i] as f64);
                let want = x / (1.0 + (-x).exp()) * y;
                let err = (out[i] as f64 - want).abs();
                assert!(
                    err <= 2e-6 * want.abs() + 1e-30,
                    "{level:?} n={n} i={i}: silu({x})*{y} = {} want {want}",
                    out[i]
                );
            }
        }
    });
}

/// RMS norms on every level against f64 arithmetic, and bit-identical across levels (one
/// summation order everywhere); the fused residual add gives the same as add-then-norm.
#[test]
fn rms_norms_match_f64_and_agree_bitwise_on_every_level() {
    let mut rng = StdRng::seed_from_u64(12);
    for n in [1usize, 7, 8, 9, 64, 576, 1000] {
        let x: Vec<f32> = rand_vec(&mut rng, n).iter().map(|v| v * 3.0).collect();
        let d = rand_vec(&mut rng, n);
        let w: Vec<f32> = rand_vec(&mut rng, n).iter().map(|v| 1.0 + v).collect();
        let eps = 1e-5f32;
        type Bits = Vec<u32>;
        let mut outs: Vec<(Isa, Bits, Bits, Bits)> = Vec::new();
        for_each_isa(|level| {
            let mut out = vec![f32::NAN; n + 1];
            cachet_kernels::act::rms_norm(&x, &w, eps, &mut out[..n]);
            assert!(out[n].is_nan(), "{level}: wrote past the output");
            let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64;
            let r = 1.0 / (ms + eps as f64).sqrt();
            for i in 0..n {
                let want = x[i] as f64 * r * w[i] as f64;
                assert!(
                    (out[i] as f64 - want).abs() <= 1e-5 * want.abs() + 1e-7,
                    "{level} n={n} [{i}]: {} vs {want}",
                    out[i]
                );
            }
            let mut inplace = x.clone();
            cachet_kernels::act::rms_norm_inplace(&mut inplace, &w, eps);
            let mut xr = x.clone();
            let mut fused = vec![0f32; n];
            cachet_kernels::act::add_rms_norm(&mut xr, &d, &w, eps, &mut fused);
            let added: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b).collect();
            assert_eq!(xr, added, "{level}: residual add");
            let mut sep = vec![0f32; n];
            cachet_kernels::act::rms_norm(&added, &w, eps, &mut sep);
            assert_eq!(fused, sep, "{level}: fused add + norm");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            outs.push((level, bits(&out[..n]), bits(&inplace), bits(&fused)));
        });
        for o in &outs[1..] {
            assert_eq!(
                (&o.1, &o.2, &o.3),
                (&outs[0].1, &outs[0].2, &outs[0].3),
                "{} vs {} n={n}",
                o.0,
                outs[0].0
            );
        }
    }
}
