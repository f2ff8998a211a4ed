//! The cachet side: the executor driven with hand-made block tables.

use std::time::Instant;

use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, Executor, SamplingParams, SeqChunk};
use cachet_model::{ExecutorConfig, KvDtype, LoadedModel};

use super::{KernelArgs, Rate, BLOCK};
use crate::error::BenchError;
use crate::rng::Rng;

/// A bump allocator over the executor's block ids.
pub(super) struct Blocks {
    pub(super) next: u32,
    pub(super) total: u32,
}

impl Blocks {
    pub(super) fn table(&mut self, positions: usize) -> Result<Vec<u32>, BenchError> {
        let n = positions.div_ceil(BLOCK) as u32;
        if self.next + n > self.total {
            return Err(BenchError::Peer(format!(
                "kernel bench needs more than {} KV blocks",
                self.total
            )));
        }
        let t = (self.next..self.next + n).collect();
        self.next += n;
        Ok(t)
    }
    pub(super) fn reset(&mut self) {
        self.next = 0;
    }
}

pub(super) struct Seq {
    pub(super) slot: u32,
    pub(super) prompt: Vec<u32>,
    pub(super) output: Vec<u32>,
    pub(super) table: Vec<u32>,
    /// Positions with KV written.
    pub(super) len: usize,
}

pub(super) fn tokens(model: &LoadedModel, seed: u64, n: usize) -> Result<Vec<u32>, BenchError> {
    let mut r = Rng::derive(seed, &[n as u64]);
    let mut out = Vec::new();
    while out.len() < n {
        let text = crate::workload::words(&mut r, n.max(64));
        out.extend(model.tokenizer.encode(&text, false)?);
    }
    out.truncate(n);
    Ok(out)
}

/// Runs one step: every seq in `seqs` gets `chunk(i)` tokens and is sampled; returns seconds.
pub(super) fn step(
    exec: &mut dyn Executor,
    params: &SamplingParams,
    seqs: &mut [Seq],
    chunks: &[Vec<u32>],
) -> Result<f64, BenchError> {
    let t0 = Instant::now();
    let out = {
        let batch = ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: seqs
                .iter()
                .zip(chunks)
                .map(|(s, c)| SeqChunk {
                    prompt_logprobs: None,
                    slot: s.slot,
                    tokens: c,
                    start_pos: s.len,
                    block_table: &s.table,
                    sample: Some(SampleSpec {
                        forks: &[],
                        drafts: &[],
                        params,
                        prompt: &s.prompt,
                        output: &s.output,
                    }),
                })
                .collect(),
        };
        exec.execute(&batch)?
    };
    let dt = t0.elapsed().as_secs_f64();
    for ((s, c), o) in seqs.iter_mut().zip(chunks).zip(out.sampled) {
        s.len += c.len();
        if let Some(o) = o {
            s.output.push(o.token);
        }
    }
    Ok(dt)
}

/// Decodes `steps` steps of every seq (feeding back the sampled token); returns seconds.
pub(super) fn decode(
    exec: &mut dyn Executor,
    params: &SamplingParams,
    seqs: &mut [Seq],
    steps: usize,
) -> Result<f64, BenchError> {
    let mut t = 0.0;
    for _ in 0..steps {
        let chunks: Vec<Vec<u32>> = seqs
            .iter()
            .map(|s| vec![*s.output.last().unwrap_or(&s.prompt[s.prompt.len() - 1])])
            .collect();
        t += step(exec, params, seqs, &chunks)?;
    }
    Ok(t)
}

pub(super) fn cachet_side(a: &KernelArgs, model: &LoadedModel) -> Result<CachetSide, BenchError> {
    let reps = a.reps.max(1);
    let all_b: usize = a.batches.iter().sum();
    let need = [
        all_b * (a.batch_ctx + reps * a.batch_steps + 1).div_ceil(BLOCK),
        (a.depth + reps * a.depth_steps + 1).div_ceil(BLOCK),
        (a.prompt + 1).div_ceil(BLOCK) + (a.gen + 2).div_ceil(BLOCK),
        2 * (a.ttft_prompt + 1).div_ceil(BLOCK),
    ]
    .into_iter()
    .max()
    .unwrap_or(64);
    let mut exec = model.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks: need,
        kv_dtype: KvDtype::F16,
    })?;
    let exec: &mut dyn Executor = &mut exec;
    let params = SamplingParams::greedy(u32::MAX);
    let mut blocks = Blocks {
        next: 0,
        total: need as u32,
    };
    let mut rows = Vec::new();
    let mk =
        |slot: u32, prompt: Vec<u32>, blocks: &mut Blocks, cap: usize| -> Result<Seq, BenchError> {
            Ok(Seq {
                slot,
                table: blocks.table(cap)?,
                prompt,
                output: Vec::new(),
                len: 0,
            })
        };

    // Prefill: one chunk of `prompt` tokens, fresh blocks, after one warm-up.
    let ptoks = tokens(model, 1, a.prompt)?;
    let mut pp = Vec::new();
    for r in 0..=reps {
        blocks.reset();
        let mut s = [mk(0, ptoks.clone(), &mut blocks, a.prompt + 1)?];
        let dt = step(exec, &params, &mut s, std::slice::from_ref(&ptoks))?;
        if r > 0 {
            pp.push(a.prompt as f64 / dt);
        }
        eprintln!(
            "[kernel] cachet pp{}: {:.1} tok/s",
            a.prompt,
            a.prompt as f64 / dt
        );
    }
    rows.push((format!("prefill pp{}", a.prompt), Rate::of(&pp)));

    // Decode at batch 1 from an empty context (like llama-bench tg).
    let mut tg = Vec::new();
    for _ in 0..reps {
        blocks.reset();
        let first = vec![ptoks[0]];
        let mut s = [mk(0, first.clone(), &mut blocks, a.gen + 2)?];
        step(exec, &params, &mut s, &[first])?;
        let dt = decode(exec, &params, &mut s, a.gen)?;
        tg.push(a.gen as f64 / dt);
        eprintln!(
            "[kernel] cachet tg{}: {:.1} tok/s",
            a.gen,
            a.gen as f64 / dt
        );
    }
    rows.push((format!("decode tg{}, batch 1", a.gen), Rate::of(&tg)));

    // Batched decode: for every batch size B, B sequences with `batch_ctx` tokens each; then
    // `batch_steps` steps per size, the sizes interleaved within each repetition so that
    // they see the same machine (this VM's speed drifts by 20 % and more within a minute,
    // which made sequential runs of each size disagree on cachet's own scaling).
    blocks.reset();
    let mut groups: Vec<Vec<Seq>> = Vec::with_capacity(a.batches.len());
    for (gi, &b) in a.batches.iter().enumerate() {
        let mut seqs = Vec::with_capacity(b);
        for i in 0..b {
            let p = tokens(model, 100 + i as u64, a.batch_ctx)?;
            seqs.push(mk(
                (gi * 1000 + i) as u32,
                p,
                &mut blocks,
                a.batch_ctx + reps * a.batch_steps + 1,
            )?);
        }
        // Prefill, 8 sequences per step (untimed).
        for lo in (0..b).step_by(8) {
            let hi = (lo + 8).min(b);
            let chunks: Vec<Vec<u32>> = seqs[lo..hi].iter().map(|s| s.prompt.clone()).collect();
            step(exec, &params, &mut seqs[lo..hi], &chunks)?;
        }
        groups.push(seqs);
    }
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); a.batches.len()];
    for _ in 0..reps {
        for (gi, seqs) in groups.iter_mut().enumerate() {
            let dt = decode(exec, &params, seqs, a.batch_steps)?;
            rates[gi].push((seqs.len() * a.batch_steps) as f64 / dt);
        }
    }
    for (&b, v) in a.batches.iter().zip(&rates) {
        eprintln!("[kernel] cachet decode batch {b}: {}", Rate::of(v).show());
        rows.push((
            format!("decode batch {b} at ctx {} (aggregate)", a.batch_ctx),
            Rate::of(v),
        ));
    }
    // Own scaling: batch B over batch 1 of the same repetition.
    let mut scaling = Vec::new();
    if let Some(one) = a.batches.iter().position(|&b| b == 1) {
        for (gi, &b) in a.batches.iter().enumerate().filter(|&(_, &b)| b > 1) {
            let r: Vec<f64> = rates[gi]
                .iter()
                .zip(&rates[one])
                .map(|(x, y)| x / y)
                .collect();
            scaling.push((b, Rate::of(&r)));
        }
    }

    // Batch 1 at depth.
    {
        blocks.reset();
        let p = tokens(model, 7, a.depth)?;
        let mut s = [mk(
            0,
            p.clone(),
            &mut blocks,
            a.depth + reps * a.depth_steps + 1,
        )?];
        for c in p.chunks(512) {
            // Sample only on the last chunk; intermediate samples are harmless here.
            step(exec, &params, &mut s, &[c.to_vec()])?;
        }
        let mut v = Vec::new();
        for _ in 0..reps {
            let dt = decode(exec, &params, &mut s, a.depth_steps)?;
            v.push(a.depth_steps as f64 / dt);
        }
        eprintln!(
            "[kernel] cachet decode at depth {}: {}",
            a.depth,
            Rate::of(&v).show()
        );
        rows.push((
            format!("decode tg{} at depth {}, batch 1", a.depth_steps, a.depth),
            Rate::of(&v),
        ));
    }

    // TTFT cold vs fully cached: the second request's table reuses the first's full blocks
    // that a lookup may take (the N-1 rule: a prompt that fills its last block recomputes that
    // block) and computes only the rest.
    let full = cachet_core::kv_manager::max_cached_blocks(a.ttft_prompt, BLOCK);
    let cached_tokens = full * BLOCK;
    let p = tokens(model, 11, a.ttft_prompt)?;
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for r in 0..reps {
        blocks.reset();
        let mut s1 = [mk(0, p.clone(), &mut blocks, a.ttft_prompt + 1)?];
        let dt = step(exec, &params, &mut s1, std::slice::from_ref(&p))?;
        cold.push(dt * 1e3);
        let mut table: Vec<u32> = s1[0].table[..full].to_vec();
        table.extend(blocks.table(a.ttft_prompt + 1 - cached_tokens)?);
        let mut s2 = [Seq {
            slot: 1,
            prompt: p.clone(),
            output: Vec::new(),
            table,
            len: cached_tokens,
        }];
        let dt2 = step(exec, &params, &mut s2, &[p[cached_tokens..].to_vec()])?;
        warm.push(dt2 * 1e3);
        // The cached run must pick the same first token as the cold one.
        if s1[0].output != s2[0].output && r == 0 {
            eprintln!(
                "[kernel] warning: cached first token {:?} != cold {:?}",
                s2[0].output, s1[0].output
            );
        }
        eprintln!(
            "[kernel] cachet TTFT {} tokens: cold {:.1} ms, cached {:.1} ms",
            a.ttft_prompt,
            dt * 1e3,
            dt2 * 1e3
        );
    }
    Ok(CachetSide {
        rows,
        ttft_cold_ms: Rate::of(&cold),
        ttft_cached_ms: Rate::of(&warm),
        cached_tokens,
        scaling,
    })
}

/// Named rates, TTFT cold and cached (ms), and the cached token count.
pub(super) struct CachetSide {
    pub(super) rows: Vec<(String, Rate)>,
    pub(super) ttft_cold_ms: Rate,
    pub(super) ttft_cached_ms: Rate,
    pub(super) cached_tokens: usize,
    /// (B, aggregate at batch B / at batch 1, paired by repetition).
    pub(super) scaling: Vec<(usize, Rate)>,
}
