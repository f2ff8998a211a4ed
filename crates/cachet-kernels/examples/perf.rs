//! Quick timing of single matmul shapes: `cargo run --release -p cachet-kernels --example perf`.
//! `MODEL=1,16,512`: the default model's matmul set; `ATTN=512,1000`: decode attention of one
//! layer; `PREFILL_ATTN=512` (or `16@1984`: 16 tokens after 1,984 cached positions); `ATTN_BATCH=16x144`: batched decode attention over 30 layers;
//! `DRAFT_ATTN=5@1044`: a decode token and 5 drafts after 1,044 positions, a call per token
//! against one call (`ONLY_ONE=1`: the one call only, for a profiler; `LAYERS=120`: that many
//! layers' KV used in turn, 140 MB at 1,500 positions, so each call reads its KV from DRAM as
//! a served step does).
use std::time::Instant;

use cachet_kernels::{QMatrix, ThreadPool, WeightType};
use half::f16;

fn mat(ty: WeightType, rows: usize, cols: usize) -> QMatrix {
    let bb = ty.block_bytes();
    let n = rows * cols / ty.block_len();
    let mut bytes: Vec<u8> = (0..n * bb)
        .map(|i| ((i * 2654435761usize) >> 13) as u8)
        .collect();
    for blk in bytes.chunks_mut(bb) {
        match ty {
            WeightType::Q6K => {
                blk[208..].copy_from_slice(&f16::from_f32(0.001).to_bits().to_le_bytes())
            }
            WeightType::F32 | WeightType::F16 => {}
            _ => {
                blk[..2].copy_from_slice(&f16::from_f32(0.01).to_bits().to_le_bytes());
                if matches!(ty, WeightType::Q4_1 | WeightType::Q4K) {
                    blk[2..4].copy_from_slice(&f16::from_f32(-0.01).to_bits().to_le_bytes());
                }
            }
        }
    }
    QMatrix::from_gguf_bytes(ty, rows, cols, &bytes).expect("matrix")
}

fn cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer for clock_gettime.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Whole default-model matmul set (30 layers of Q4_1 + Q8_0 lm_head) at batch m.
fn model(pool: &ThreadPool, m: usize) {
    let shapes = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let layers: Vec<Vec<QMatrix>> = (0..30)
        .map(|_| {
            shapes
                .iter()
                .map(|&(r, c)| mat(WeightType::Q4_1, r, c))
                .collect()
        })
        .collect();
    let head = mat(WeightType::Q8_0, 49152, 576);
    let x: Vec<f32> = (0..m * 1536)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut y = vec![0f32; (m * 1536).max(49152)];
    let run = |y: &mut [f32]| {
        for l in &layers {
            for w in l {
                w.matmul(pool, &x, m, y);
            }
        }
        head.matmul(pool, &x, 1, y);
    };
    run(&mut y);
    let iters = if m == 1 {
        50
    } else if m <= 16 {
        10
    } else {
        2
    };
    let (t0, c0) = (Instant::now(), cpu_time());
    for _ in 0..iters {
        run(&mut y);
    }
    let wall = t0.elapsed().as_secs_f64() / iters as f64;
    let cpu = (cpu_time() - c0) / iters as f64;
    println!(
        "model m={m} threads={}: wall {:.2} ms/iter ({:.0} tok/s), process cpu {:.2} ms/iter",
        pool.n_threads(),
        wall * 1e3,
        m as f64 / wall,
        cpu * 1e3
    );
}

fn attention(depth: usize) {
    use cachet_kernels::attention::{paged_attention, PagedAttnArgs};
    let (nh, nkv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let ctx = depth + 1;
    let nblk = ctx.div_ceil(bs);
    let table: Vec<u32> = (0..nblk as u32).rev().collect();
    let n = nblk * bs * nkv * hd;
    let kf: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let vf: Vec<f32> = (0..n)
        .map(|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let kh: Vec<f16> = kf.iter().map(|&v| f16::from_f32(v)).collect();
    let vh: Vec<f16> = vf.iter().map(|&v| f16::from_f32(v)).collect();
    let q: Vec<f32> = (0..nh * hd).map(|i| (i % 17) as f32 / 17.0).collect();
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
    let iters = 2000;
    let c0 = cpu_time();
    for _ in 0..iters {
        paged_attention(&args, &q, &kf, &vf, &mut out);
    }
    let c1 = cpu_time();
    for _ in 0..iters {
        paged_attention(&args, &q, &kh, &vh, &mut out);
    }
    let c2 = cpu_time();
    let pool = ThreadPool::new(2);
    let t0 = Instant::now();
    for _ in 0..iters {
        cachet_kernels::attention::paged_attention_parallel(&pool, &args, &q, &kh, &vh, &mut out);
    }
    let par = t0.elapsed().as_secs_f64() / iters as f64;
    println!(
        "attention depth {depth}: f16 parallel (2 threads) {:.1} us wall",
        par * 1e6
    );
    println!(
        "attention depth {depth}: f32 {:.1} us, f16 {:.1} us (cpu time per layer call)",
        (c1 - c0) / iters as f64 * 1e6,
        (c2 - c1) / iters as f64 * 1e6
    );
}

/// One layer's block table (identity) and f16 K and V arenas for `positions` positions of
/// `row` values each, in blocks of `bs`.
fn layer_kv(positions: usize, bs: usize, row: usize) -> (Vec<u32>, Vec<f16>, Vec<f16>) {
    let nblk = positions.div_ceil(bs);
    let table: Vec<u32> = (0..nblk as u32).collect();
    let len = nblk * bs * row;
    let arena = |m: usize| -> Vec<f16> {
        (0..len)
            .map(|i| f16::from_f32(((i * m) % 1000) as f32 / 500.0 - 1.0))
            .collect()
    };
    (table, arena(7919), arena(104729))
}

/// Prefill attention of one layer: `n` tokens from position `start`, f16 KV.
fn attention_prefill(n: usize, start: usize) {
    use cachet_kernels::attention::{paged_attention, PagedAttnArgs};
    let (nh, nkv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let (table, kh, vh) = layer_kv(start + n, bs, nkv * hd);
    let q: Vec<f32> = (0..n * nh * hd).map(|i| (i % 17) as f32 / 17.0).collect();
    let mut out = vec![0f32; n * nh * hd];
    let args = PagedAttnArgs {
        block_table: &table,
        block_size: bs,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        start_pos: start,
        n_tokens: n,
        scale: 0.125,
        window: 0,
    };
    let iters = if start > 0 { 50 } else { 5 };
    paged_attention(&args, &q, &kh, &vh, &mut out);
    let c0 = cpu_time();
    for _ in 0..iters {
        paged_attention(&args, &q, &kh, &vh, &mut out);
    }
    let dt = (cpu_time() - c0) / iters as f64;
    println!(
        "prefill attention {n} tokens after {start} (one layer, f16 KV): {:.3} ms cpu; x30 layers = {:.1} ms",
        dt * 1e3,
        dt * 30e3
    );
}

/// A decode token and `k` drafts after `ctx` positions (one layer, f16 KV, the default
/// model's heads, a pool of `T` threads, 2 unless told): each token in a call of its own
/// against all in one call, interleaved; wall time per layer.
fn attention_drafts(k: usize, ctx: usize) {
    use cachet_kernels::attention::{paged_attention_parallel, PagedAttnArgs};
    let threads: usize = std::env::var("T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = ThreadPool::new(threads);
    let (nh, nkv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let n = k + 1;
    // `LAYERS=N`: N layers' KV, used in turn (30: each call finds its KV out of L2, in L3;
    // 120: 140 MB at 1,500 positions, more than the L3 cache, so in DRAM).
    let nl: usize = std::env::var("LAYERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);
    let kvs: Vec<_> = (0..nl).map(|_| layer_kv(ctx + n, bs, nkv * hd)).collect();
    let table = kvs[0].0.clone();
    let q: Vec<f32> = (0..n * nh * hd).map(|i| (i % 17) as f32 / 17.0).collect();
    let mut out = vec![0f32; n * nh * hd];
    let qd = nh * hd;
    let args = |start: usize, n_tokens: usize| PagedAttnArgs {
        block_table: &table,
        block_size: bs,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        start_pos: start,
        n_tokens,
        scale: 0.125,
        window: 0,
    };
    let iters = 300;
    let only_one = std::env::var_os("ONLY_ONE").is_some();
    let (mut split, mut one) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        if !only_one {
            let t0 = Instant::now();
            for it in 0..iters {
                let (_, kh, vh) = &kvs[it % nl];
                for t in 0..n {
                    paged_attention_parallel(
                        &pool,
                        &args(ctx + t, 1),
                        &q[t * qd..(t + 1) * qd],
                        kh,
                        vh,
                        &mut out[t * qd..(t + 1) * qd],
                    );
                }
            }
            split.push(t0.elapsed().as_secs_f64() * 1e6 / iters as f64);
        }
        let t0 = Instant::now();
        for it in 0..iters {
            let (_, kh, vh) = &kvs[it % nl];
            paged_attention_parallel(&pool, &args(ctx, n), &q, kh, vh, &mut out);
        }
        one.push(t0.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    // Median and range of the 7 rounds.
    let summary = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        format!("{:.1} µs ({:.1}-{:.1})", v[3], v[0], v[6])
    };
    let each = if only_one {
        String::new()
    } else {
        format!("a call each {}, ", summary(&mut split))
    };
    println!(
        "{n} tokens after {ctx} (one layer of {nl} in turn, f16 KV, {threads} threads): {each}one call {}",
        summary(&mut one)
    );
}

/// Batched decode attention as the executor runs it: `seqs` sequences at a `ctx`-position
/// context, 30 layers with their own f16 KV (53 MB at 16 × 144, more than the L3 cache), one
/// thread; process CPU time per step.
fn attention_batch(seqs: usize, ctx: usize) {
    use cachet_kernels::attention::{paged_attention, prefetch_context, PagedAttnArgs};
    let (nh, nkv, hd, bs, layers) = (9usize, 3usize, 64usize, 16usize, 30usize);
    let per_seq = ctx.div_ceil(bs);
    let n = seqs * per_seq * bs * nkv * hd;
    let kv: Vec<(Vec<f16>, Vec<f16>)> = (0..layers)
        .map(|l| {
            let v = |s: usize| -> Vec<f16> {
                (0..n)
                    .map(|i| {
                        f16::from_f32((((i + s) * 2654435761usize) >> 20) as f32 / 4096.0 - 0.5)
                    })
                    .collect()
            };
            (v(l), v(l + 99))
        })
        .collect();
    // Interleaved tables, as a pool shared by many requests hands them out.
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (0..per_seq).map(|j| (j * seqs + s) as u32).collect())
        .collect();
    let q: Vec<f32> = (0..nh * hd).map(|i| (i % 13) as f32 / 13.0 - 0.5).collect();
    let mut out = vec![0f32; nh * hd];
    // XPF=N: before each sequence, prefetch the next one's first N positions (as the
    // executor's batched decode does); XPF=0: no cross-call prefetch.
    let xpf: usize = std::env::var("XPF")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32);
    let args_of = |t: &'static [u32]| PagedAttnArgs {
        block_table: t,
        block_size: bs,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        start_pos: ctx - 1,
        n_tokens: 1,
        scale: 0.125,
        window: 0,
    };
    let tables: &'static [Vec<u32>] = Box::leak(tables.into_boxed_slice());
    let step = |out: &mut [f32]| {
        for (k, v) in &kv {
            for (i, t) in tables.iter().enumerate() {
                if xpf > 0 {
                    if let Some(nt) = tables.get(i + 1) {
                        prefetch_context(&args_of(nt), k, v, xpf);
                    }
                }
                paged_attention(&args_of(t), &q, k, v, out);
            }
        }
    };
    step(&mut out);
    let iters: usize = std::env::var("ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let c0 = cpu_time();
    for _ in 0..iters {
        step(&mut out);
    }
    let cpu = (cpu_time() - c0) / iters as f64;
    println!(
        "batched decode attention {seqs} x {ctx} x {layers} layers (f16 KV): {:.3} ms cpu per step",
        cpu * 1e3
    );
}

fn main() {
    if let Ok(v) = std::env::var("ATTN_BATCH") {
        let mut it = v.split('x').filter_map(|x| x.parse().ok());
        attention_batch(it.next().unwrap_or(16), it.next().unwrap_or(144));
        return;
    }
    if let Ok(v) = std::env::var("DRAFT_ATTN") {
        // `DRAFT_ATTN=K@CTX`: a decode token and K drafts after CTX positions, 2 threads.
        let (k, ctx) = v.split_once('@').unwrap_or((&v, "1044"));
        attention_drafts(k.parse().unwrap_or(5), ctx.parse().unwrap_or(1044));
        return;
    }
    if let Ok(n) = std::env::var("PREFILL_ATTN") {
        // `PREFILL_ATTN=N` or `N@START` (a short chunk after START cached positions).
        let (n, start) = n.split_once('@').unwrap_or((&n, "0"));
        attention_prefill(n.parse().unwrap_or(512), start.parse().unwrap_or(0));
        return;
    }
    if let Ok(ds) = std::env::var("ATTN") {
        for d in ds.split(',').filter_map(|v| v.parse().ok()) {
            attention(d);
        }
        return;
    }
    if let Ok(ms) = std::env::var("MODEL") {
        let threads: usize = std::env::var("T")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2);
        let pool = ThreadPool::new(threads);
        for m in ms.split(',').filter_map(|v| v.parse().ok()) {
            model(&pool, m);
        }
        return;
    }
    let threads: usize = std::env::var("T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = ThreadPool::new(threads);
    let ms: Vec<usize> = std::env::var("M")
        .ok()
        .map(|s| s.split(',').filter_map(|v| v.parse().ok()).collect())
        .unwrap_or(vec![1, 16, 512]);
    let shapes = [
        (WeightType::Q4_1, 576, 576),
        (WeightType::Q4_1, 192, 576),
        (WeightType::Q4_1, 1536, 576),
        (WeightType::Q4_1, 576, 1536),
        (WeightType::Q8_0, 49152, 576),
        (WeightType::Q4_0, 1536, 576),
        (WeightType::Q4K, 1536, 512),
        (WeightType::Q6K, 1536, 512),
    ];
    for (ty, rows, cols) in shapes {
        let w = mat(ty, rows, cols);
        for &m in &ms {
            if m > 16 && rows > 4096 {
                continue;
            }
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut y = vec![0f32; m * rows];
            let flops = 2.0 * (m * rows * cols) as f64;
            let target = 0.3f64;
            // Each call timed alone: the mean, and the best call (on a VM whose neighbours
            // steal cycles in bursts, the best call is the steadier figure to compare).
            let mut times = Vec::new();
            let t0 = Instant::now();
            while t0.elapsed().as_secs_f64() < target || times.len() < 3 {
                let t = Instant::now();
                w.matmul(&pool, &x, m, &mut y);
                times.push(t.elapsed().as_secs_f64());
            }
            let dt = t0.elapsed().as_secs_f64() / times.len() as f64;
            let best = times.iter().copied().fold(f64::INFINITY, f64::min);
            println!(
                "{ty:?} {rows}x{cols} m={m}: {:.1} us  {:.1} GFLOP/s  {:.2} GB/s weights  (best call {:.1} us, {:.1} GFLOP/s)",
                dt * 1e6,
                flops / dt / 1e9,
                w.storage_bytes() as f64 / dt / 1e9,
                best * 1e6,
                flops / best / 1e9
            );
        }
    }
}
