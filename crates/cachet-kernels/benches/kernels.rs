//! Kernel benchmarks for the default model's shapes (SmolLM2-135M: hidden 576, ffn 1536,
//! 9/3 heads, head_dim 64, 30 layers, vocab 49152).
//!
//! `cargo bench -p cachet-kernels --bench kernels`; filter e.g. `-- decode`.
//! `CACHET_ISA=avx2|scalar` caps the ISA; `CACHET_BENCH_THREADS` sets the pool size (default 2).

use std::time::Duration;

use cachet_kernels::attention::{paged_attention, paged_attention_parallel, PagedAttnArgs};
use cachet_kernels::{quant, QMatrix, ThreadPool, WeightType};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const HIDDEN: usize = 576;
const FFN: usize = 1536;
const KV: usize = 192;
const LAYERS: usize = 30;
const VOCAB: usize = 49152;

/// Random but well-formed ggml bytes (small f16 scales, random codes).
fn random_matrix(ty: WeightType, rows: usize, cols: usize, rng: &mut StdRng) -> QMatrix {
    let n_blocks = rows * cols / ty.block_len();
    let bb = ty.block_bytes();
    let mut bytes = vec![0u8; n_blocks * bb];
    rng.fill(&mut bytes[..]);
    let h = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    for blk in bytes.chunks_mut(bb) {
        match ty {
            WeightType::Q4_0
            | WeightType::Q8_0
            | WeightType::Q5_0
            | WeightType::IQ4NL
            | WeightType::IQ4XS => blk[..2].copy_from_slice(&h(0.01)),
            WeightType::Q4_1 | WeightType::Q5_1 => {
                blk[..2].copy_from_slice(&h(0.01));
                blk[2..4].copy_from_slice(&h(-0.08));
            }
            WeightType::Q4K | WeightType::Q5K => {
                blk[..2].copy_from_slice(&h(0.001));
                blk[2..4].copy_from_slice(&h(0.001));
            }
            WeightType::Q6K => blk[208..].copy_from_slice(&h(0.001)),
            WeightType::Q3K => blk[108..].copy_from_slice(&h(0.001)),
            WeightType::Q2K => {
                blk[80..82].copy_from_slice(&h(0.001));
                blk[82..84].copy_from_slice(&h(0.001));
            }
            WeightType::BF16 => {
                blk.copy_from_slice(&quant::f32_to_bf16(rng.gen_range(-0.1..0.1)).to_le_bytes())
            }
            WeightType::F16 => blk.copy_from_slice(&h(rng.gen_range(-0.1..0.1))),
            WeightType::F32 => blk.copy_from_slice(&rng.gen_range(-0.1f32..0.1).to_le_bytes()),
        }
    }
    QMatrix::from_gguf_bytes(ty, rows, cols, &bytes).expect("valid matrix")
}

fn pool() -> ThreadPool {
    let n = std::env::var("CACHET_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    ThreadPool::new(n)
}

/// Per-shape matmul throughput for each type at m = 1, 16, 512.
fn bench_matmul(c: &mut Criterion) {
    let pool = pool();
    let mut rng = StdRng::seed_from_u64(1);
    let mut g = c.benchmark_group("matmul");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10);
    let types = [
        WeightType::Q4_1,
        WeightType::Q4_0,
        WeightType::Q8_0,
        WeightType::Q4K,
        WeightType::Q6K,
    ];
    for ty in types {
        for (name, rows, cols) in [
            ("qo", HIDDEN, HIDDEN),
            ("up", FFN, HIDDEN),
            ("down", HIDDEN, FFN),
        ] {
            let cols = if ty.block_len() == 256 && cols == HIDDEN {
                512
            } else {
                cols
            };
            let mat = random_matrix(ty, rows, cols, &mut rng);
            for m in [1usize, 16, 512] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let mut y = vec![0f32; m * rows];
                g.throughput(Throughput::Elements((2 * m * rows * cols) as u64));
                g.bench_function(
                    BenchmarkId::new(format!("{ty:?}/{name}_{rows}x{cols}"), m),
                    |b| b.iter(|| mat.matmul(&pool, &x, m, &mut y)),
                );
            }
        }
    }
    g.finish();
}

struct Model {
    layers: Vec<[QMatrix; 7]>,
    lm_head: QMatrix,
}

fn model(rng: &mut StdRng) -> Model {
    let ty = WeightType::Q4_1;
    let layers = (0..LAYERS)
        .map(|_| {
            [
                random_matrix(ty, HIDDEN, HIDDEN, rng),
                random_matrix(ty, KV, HIDDEN, rng),
                random_matrix(ty, KV, HIDDEN, rng),
                random_matrix(ty, HIDDEN, HIDDEN, rng),
                random_matrix(ty, FFN, HIDDEN, rng),
                random_matrix(ty, FFN, HIDDEN, rng),
                random_matrix(ty, HIDDEN, FFN, rng),
            ]
        })
        .collect();
    Model {
        layers,
        lm_head: random_matrix(WeightType::Q8_0, VOCAB, HIDDEN, rng),
    }
}

fn run_model(
    model: &Model,
    pool: &ThreadPool,
    m: usize,
    x: &[f32],
    xf: &[f32],
    y: &mut [f32],
    with_head: bool,
) {
    for l in &model.layers {
        for w in l {
            let inp = if w.cols() == FFN { xf } else { x };
            w.matmul(pool, inp, m, y);
        }
    }
    if with_head {
        model.lm_head.matmul(pool, &x[..HIDDEN], 1, y);
    }
}

/// Whole-model matmul set: decode (m=1, with lm_head) and 512-token prefill (lm_head on
/// the last token only). One iteration = one token (decode) or one 512-token chunk.
fn bench_model(c: &mut Criterion) {
    let pool = pool();
    let mut rng = StdRng::seed_from_u64(2);
    let model = model(&mut rng);
    let bytes: usize = model
        .layers
        .iter()
        .flat_map(|l| l.iter())
        .map(|w| w.storage_bytes())
        .sum::<usize>()
        + model.lm_head.storage_bytes();
    let mut g = c.benchmark_group("model");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10);
    for m in [1usize, 16, 512] {
        let x: Vec<f32> = (0..m * HIDDEN).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let xf: Vec<f32> = (0..m * FFN).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut y = vec![0f32; (m * FFN).max(VOCAB)];
        if m == 1 {
            g.throughput(Throughput::Bytes(bytes as u64));
        } else {
            g.throughput(Throughput::Elements(m as u64));
        }
        g.bench_function(BenchmarkId::new("all_matmuls_q4_1", m), |b| {
            b.iter(|| run_model(&model, &pool, m, &x, &xf, &mut y, true))
        });
    }
    g.finish();
}

/// Batch-1 decode attention of one layer at several depths (9 heads, 3 kv heads, hd 64).
fn bench_attention(c: &mut Criterion) {
    let pool = pool();
    let mut rng = StdRng::seed_from_u64(3);
    let (nh, nkv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let mut g = c.benchmark_group("attention");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    for depth in [0usize, 512, 1000] {
        let ctx = depth + 1;
        let nblk = ctx.div_ceil(bs);
        let mut table: Vec<u32> = (0..nblk as u32).map(|i| (i * 7) % nblk as u32).collect();
        if nblk > 1 {
            table.swap(0, nblk - 1);
        }
        let n = nblk * bs * nkv * hd;
        let kf: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let vf: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let kh: Vec<f16> = kf.iter().map(|&v| f16::from_f32(v)).collect();
        let vh: Vec<f16> = vf.iter().map(|&v| f16::from_f32(v)).collect();
        let q: Vec<f32> = (0..nh * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut out = vec![0f32; nh * hd];
        let args = PagedAttnArgs {
            block_table: &table,
            block_size: bs,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            start_pos: depth,
            n_tokens: 1,
            scale: 0.125,
            window: 0,
        };
        g.throughput(Throughput::Elements(ctx as u64));
        g.bench_function(BenchmarkId::new("f32", depth), |b| {
            b.iter(|| paged_attention(&args, &q, &kf, &vf, &mut out))
        });
        g.bench_function(BenchmarkId::new("f16", depth), |b| {
            b.iter(|| paged_attention(&args, &q, &kh, &vh, &mut out))
        });
        g.bench_function(BenchmarkId::new("f16_parallel", depth), |b| {
            b.iter(|| paged_attention_parallel(&pool, &args, &q, &kh, &vh, &mut out))
        });
    }
    g.finish();
}

/// Batched decode attention as the executor runs it: 16 sequences at a 144-token context,
/// each layer one `parallel_for` over the sequences, 30 layers with their own KV (53 MB of
/// f16 K/V in all, more than the L3 cache, as in a real step). One iteration = one step.
fn bench_attention_batch(c: &mut Criterion) {
    let pool = pool();
    let mut rng = StdRng::seed_from_u64(4);
    let (nh, nkv, hd, bs, seqs, ctx) = (9usize, 3usize, 64usize, 16usize, 16usize, 144usize);
    let per_seq = ctx.div_ceil(bs);
    let blocks = seqs * per_seq;
    let n = blocks * bs * nkv * hd;
    let layers: Vec<(Vec<f16>, Vec<f16>)> = (0..LAYERS)
        .map(|_| {
            let k = (0..n)
                .map(|_| f16::from_f32(rng.gen_range(-1.0..1.0)))
                .collect();
            let v = (0..n)
                .map(|_| f16::from_f32(rng.gen_range(-1.0..1.0)))
                .collect();
            (k, v)
        })
        .collect();
    // Interleaved tables, as a pool shared by many requests hands them out.
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (0..per_seq).map(|j| (j * seqs + s) as u32).collect())
        .collect();
    let q: Vec<f32> = (0..seqs * nh * hd)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    // One output row per sequence (a lock each, uncontended: tasks own distinct rows).
    let out: Vec<std::sync::Mutex<Vec<f32>>> = (0..seqs)
        .map(|_| std::sync::Mutex::new(vec![0f32; nh * hd]))
        .collect();
    let mut g = c.benchmark_group("attention_batch");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .throughput(Throughput::Elements(seqs as u64));
    g.bench_function("decode_16x144_30_layers", |b| {
        b.iter(|| {
            for (k, v) in &layers {
                pool.parallel_for(seqs, &|si| {
                    let args = PagedAttnArgs {
                        block_table: &tables[si],
                        block_size: bs,
                        n_heads: nh,
                        n_kv_heads: nkv,
                        head_dim: hd,
                        start_pos: ctx - 1,
                        n_tokens: 1,
                        scale: 0.125,
                        window: 0,
                    };
                    let mut o = out[si].lock().unwrap_or_else(|e| e.into_inner());
                    paged_attention(&args, &q[si * nh * hd..(si + 1) * nh * hd], k, v, &mut o);
                });
            }
        })
    });
    g.finish();
}

/// The executor's norm as it is written today (`cachet-model`, `forward.rs`): 8 scalar
/// lanes the compiler vectorises for the baseline target, then a scaled copy.
fn rms_norm_executor_style(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i] * c[i];
        }
    }
    let ss = (acc.iter().sum::<f32>() + rest) / x.len() as f32;
    let r = 1.0 / (ss + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
}

/// RMS norm of 16 rows of the default model's hidden size (a batch-16 decode step's norm)
/// and the fused residual add + norm, against the executor's current formulation.
fn bench_norms(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(5);
    let rows = 16;
    let x: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| rng.gen_range(-2.0..2.0))
        .collect();
    let d: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let w: Vec<f32> = (0..HIDDEN).map(|_| rng.gen_range(0.5..1.5)).collect();
    let mut out = vec![0f32; rows * HIDDEN];
    let mut g = c.benchmark_group("norm");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Elements((rows * HIDDEN) as u64));
    g.bench_function("rms_norm_16x576_kernel", |b| {
        b.iter(|| {
            for (xr, o) in x.chunks(HIDDEN).zip(out.chunks_mut(HIDDEN)) {
                cachet_kernels::act::rms_norm(xr, &w, 1e-5, o);
            }
        })
    });
    g.bench_function("rms_norm_16x576_executor_style", |b| {
        b.iter(|| {
            for (xr, o) in x.chunks(HIDDEN).zip(out.chunks_mut(HIDDEN)) {
                rms_norm_executor_style(xr, &w, 1e-5, o);
            }
        })
    });
    let mut xr = x.clone();
    g.bench_function("add_rms_norm_16x576_kernel", |b| {
        b.iter(|| {
            for ((xr, dr), o) in xr
                .chunks_mut(HIDDEN)
                .zip(d.chunks(HIDDEN))
                .zip(out.chunks_mut(HIDDEN))
            {
                cachet_kernels::act::add_rms_norm(xr, dr, &w, 1e-5, o);
            }
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_model,
    bench_matmul,
    bench_attention,
    bench_attention_batch,
    bench_norms
);
criterion_main!(benches);
