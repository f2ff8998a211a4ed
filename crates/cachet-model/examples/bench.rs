//! Throughput of the default model on this machine:
//! `cargo run --release -p cachet-model --example bench [-- THREADS] [--exact] [--batch=N]
//! [--chunk=M@CTX]`.
//!
//! * prefill: one 512-token prompt in a single step (tokens/s);
//! * decode at batch 1 and 16: 32 greedy steps after a 128-token prompt (generated tokens/s),
//!   the shape of `cachet bench kernel`'s batched rows;
//! * `--chunk=M@CTX` (only this): the last M tokens of a prompt computed after CTX positions
//!   of KV are in place (a cached-prefix TTFT step; `--chunk=16@1984` is the 2,000-token
//!   prompt after a KV load), best of 7 and its per-phase profile.

use std::time::Instant;

use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, Executor, SamplingParams, SeqChunk};
use cachet_model::{
    default_model_path, load_model, ExecutorConfig, KvDtype, LlamaExecutor, LoadOptions,
};

const BLOCK: usize = 16;

struct Seq {
    tokens: Vec<u32>,
    computed: usize,
    table: Vec<u32>,
}

fn step(e: &mut LlamaExecutor, seqs: &mut [Seq], params: &SamplingParams) {
    let out = {
        let batch = ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: seqs
                .iter()
                .enumerate()
                .map(|(i, s)| SeqChunk {
                    prompt_logprobs: None,
                    slot: i as u32,
                    tokens: &s.tokens[s.computed..],
                    start_pos: s.computed,
                    block_table: &s.table,
                    sample: Some(SampleSpec {
                        forks: &[],
                        drafts: &[],
                        params,
                        prompt: &s.tokens,
                        output: &[],
                    }),
                })
                .collect(),
        };
        e.execute(&batch).expect("execute")
    };
    for (s, o) in seqs.iter_mut().zip(out.sampled) {
        s.computed = s.tokens.len();
        s.tokens.push(o.map(|x| x.token).unwrap_or(0));
    }
}

fn seqs(n: usize, prompt_len: usize, max_len: usize) -> Vec<Seq> {
    let per = max_len.div_ceil(BLOCK) as u32;
    (0..n)
        .map(|i| Seq {
            tokens: (0..prompt_len)
                .map(|j| (100 + (i * 7919 + j * 104729) % 40000) as u32)
                .collect(),
            computed: 0,
            table: (i as u32 * per..(i as u32 + 1) * per).collect(),
        })
        .collect()
}

/// Time of the model's matmuls alone for `m` rows (all layers; lm_head for `lm_rows` rows).
fn matmul_only(m_model: &cachet_model::LoadedModel, m: usize, lm_rows: usize) -> f64 {
    use cachet_model::gguf::Fused;
    let w = &m_model.weights;
    let pool = cachet_kernels::ThreadPool::new(m_model.threads);
    let mut x = vec![0.01f32; m * w.config.ffn.max(w.config.hidden) * 2];
    for (i, v) in x.iter_mut().enumerate() {
        *v = ((i % 97) as f32 - 48.0) / 97.0;
    }
    let mut y = vec![0f32; m * (w.config.vocab_size.max(4 * w.config.ffn))];
    let run = |q: &cachet_kernels::QMatrix, rows: usize, y: &mut [f32]| {
        q.matmul(
            &pool,
            &x[..rows * q.cols()],
            rows,
            &mut y[..rows * q.rows()],
        )
    };
    let t = Instant::now();
    for l in &w.layers {
        for f in [&l.qkv, &l.gate_up] {
            match f {
                Fused::One(q) => run(q, m, &mut y),
                Fused::Many(v) => v.iter().for_each(|q| run(q, m, &mut y)),
            }
        }
        run(&l.wo, m, &mut y);
        run(&l.down, m, &mut y);
    }
    run(w.lm_head(), lm_rows, &mut y);
    t.elapsed().as_secs_f64()
}

fn print_profile(e: &LlamaExecutor, calls: f64) {
    let parts: Vec<String> = e
        .profile()
        .into_iter()
        .map(|(n, t)| format!("{n} {:.2}ms", t * 1000.0 / calls))
        .collect();
    println!("    per step: {}", parts.join(", "));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads = args.iter().find_map(|s| s.parse().ok()).unwrap_or(0);
    // `--exact`: weights dequantized to f32 at load (no int8 activation quantization).
    let dequantize_weights = args.iter().any(|a| a == "--exact");
    let path = default_model_path();
    let t0 = Instant::now();
    let m = load_model(
        &path,
        &LoadOptions {
            threads,
            dequantize_weights,
            ..Default::default()
        },
    )
    .expect("load model");
    println!(
        "loaded {} ({}) in {:.2}s with {} threads{}",
        m.info.name,
        path.display(),
        t0.elapsed().as_secs_f64(),
        m.threads,
        if dequantize_weights {
            " (weights dequantized to f32)"
        } else {
            ""
        }
    );
    let mut e = m
        .executor(ExecutorConfig {
            block_size: BLOCK,
            num_blocks: 1024,
            kv_dtype: KvDtype::F16,
        })
        .expect("executor");
    let params = SamplingParams::greedy(1);

    // `--chunk=M@CTX`: one short chunk over a long cached context.
    if let Some((mq, ctx)) = args.iter().find_map(|a| {
        let (m, c) = a.strip_prefix("--chunk=")?.split_once('@')?;
        Some((m.parse::<usize>().ok()?, c.parse::<usize>().ok()?))
    }) {
        let mut s = seqs(1, ctx + mq, ctx + mq + 8);
        s[0].tokens.truncate(ctx);
        step(&mut e, &mut s, &params); // the context's KV
        let full = seqs(1, ctx + mq, ctx + mq + 8);
        let (mut best, mut all) = (f64::MAX, Vec::new());
        for rep in 0..8 {
            if rep == 1 {
                e.set_profiling(true); // the first run warms up
            }
            s[0].tokens = full[0].tokens.clone();
            s[0].computed = ctx;
            let t = Instant::now();
            step(&mut e, &mut s, &params);
            let dt = t.elapsed().as_secs_f64();
            if rep > 0 {
                best = best.min(dt);
                all.push(dt * 1000.0);
            }
        }
        all.sort_by(f64::total_cmp);
        println!(
            "chunk of {mq} after {ctx}: best {:.2} ms, median {:.2} ms, max {:.2} ms",
            best * 1000.0,
            all[all.len() / 2],
            all[all.len() - 1]
        );
        print_profile(&e, all.len() as f64);
        return;
    }

    // Prefill: 512 tokens in one step (warm up once); skipped with `--batch=N`.
    if !args.iter().any(|a| a.starts_with("--batch=")) {
        let mut best = f64::MAX;
        e.set_profiling(true);
        for _ in 0..3 {
            let mut s = seqs(1, 512, 600);
            let t = Instant::now();
            step(&mut e, &mut s, &params);
            best = best.min(t.elapsed().as_secs_f64());
        }
        let mm = (0..3)
            .map(|_| matmul_only(&m, 512, 1))
            .fold(f64::MAX, f64::min);
        println!(
            "prefill 512 tokens: {:.3}s = {:.0} tok/s (matmuls alone {:.3}s = {:.0}%)",
            best,
            512.0 / best,
            mm,
            100.0 * mm / best
        );
        print_profile(&e, 3.0);
    }

    // `--batch=N`: only decode at batch N (for profiling one shape).
    let batches: Vec<usize> = args
        .iter()
        .find_map(|a| a.strip_prefix("--batch=")?.parse().ok())
        .map_or(vec![1, 16], |b| vec![b]);
    for batch in batches {
        let steps = 32;
        let mut s = seqs(batch, 128, 128 + steps + 8);
        step(&mut e, &mut s, &params);
        step(&mut e, &mut s, &params); // warm-up decode
        e.set_profiling(true);
        let t = Instant::now();
        for _ in 0..steps {
            step(&mut e, &mut s, &params);
        }
        let dt = t.elapsed().as_secs_f64();
        let mm = (0..5)
            .map(|_| matmul_only(&m, batch, batch))
            .fold(f64::MAX, f64::min);
        println!(
            "decode batch {batch}: {:.1} ms/step, {:.1} tok/s (matmuls alone {:.1} ms/step)",
            dt * 1000.0 / steps as f64,
            (batch * steps) as f64 / dt,
            mm * 1000.0
        );
        print_profile(&e, steps as f64);
    }
}
