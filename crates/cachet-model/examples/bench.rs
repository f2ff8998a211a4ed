//! Throughput of the default model on this machine:
//! `cargo run --release -p cachet-model --example bench [-- THREADS] [--exact]`.
//!
//! * prefill: one 512-token prompt in a single step (tokens/s);
//! * decode at batch 1 and 8: greedy steps after a 64-token prompt (generated tokens/s).

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
            seqs: seqs
                .iter()
                .enumerate()
                .map(|(i, s)| SeqChunk {
                    slot: i as u32,
                    tokens: &s.tokens[s.computed..],
                    start_pos: s.computed,
                    block_table: &s.table,
                    sample: Some(SampleSpec {
                        params,
                        prompt: &s.tokens,
                        output: &[],
                    }),
                })
                .collect(),
        };
        e.execute(&batch).expect("execute")
    };
    for (s, o) in seqs.iter_mut().zip(out) {
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

    // Prefill: 512 tokens in one step (warm up once).
    let mut best = f64::MAX;
    for _ in 0..3 {
        let mut s = seqs(1, 512, 600);
        let t = Instant::now();
        step(&mut e, &mut s, &params);
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "prefill 512 tokens: {:.3}s = {:.0} tok/s",
        best,
        512.0 / best
    );

    for batch in [1usize, 8] {
        let steps = 64;
        let mut s = seqs(batch, 64, 64 + steps + 8);
        step(&mut e, &mut s, &params);
        step(&mut e, &mut s, &params); // warm-up decode
        let t = Instant::now();
        for _ in 0..steps {
            step(&mut e, &mut s, &params);
        }
        let dt = t.elapsed().as_secs_f64();
        println!(
            "decode batch {batch}: {:.1} ms/step, {:.1} tok/s",
            dt * 1000.0 / steps as f64,
            (batch * steps) as f64 / dt
        );
    }
}
