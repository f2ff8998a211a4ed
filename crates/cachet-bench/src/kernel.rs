//! `cachet bench kernel`: cachet's model executor driven directly (no scheduler, no HTTP)
//! beside llama.cpp's `llama-bench` / `llama-batched-bench` on the same file and threads.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, Executor, SamplingParams, SeqChunk};
use cachet_model::{ExecutorConfig, KvDtype, LoadOptions, LoadedModel};
use clap::Args;
use serde::Serialize;
use serde_json::Value;

use crate::error::BenchError;
use crate::report;
use crate::rng::Rng;
use crate::stats::mean_std;

pub const DOC_SECTION: &str = "cachet-bench-kernel";
const BLOCK: usize = 16;

#[derive(Args, Clone, Debug)]
pub struct KernelArgs {
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Repetitions of each measurement (mean ± sample std reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Prefill length (llama-bench -p).
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Decode steps at batch 1 from an empty context (llama-bench -n).
    #[arg(long, default_value_t = 128)]
    pub gen: usize,
    /// Batch sizes for batched decode (aggregate tok/s).
    #[arg(long, value_delimiter = ',', default_value = "1,8,16,32")]
    pub batches: Vec<usize>,
    /// Context of each sequence before the timed batched decode steps
    /// (llama-batched-bench -npp).
    #[arg(long, default_value_t = 128)]
    pub batch_ctx: usize,
    /// Timed decode steps per batched measurement (llama-batched-bench -ntg).
    #[arg(long, default_value_t = 32)]
    pub batch_steps: usize,
    /// Context depth of the batch-1 long-context decode (llama-bench -d).
    #[arg(long, default_value_t = 1000)]
    pub depth: usize,
    /// Decode steps at --depth (llama-bench -n with -d).
    #[arg(long, default_value_t = 32)]
    pub depth_steps: usize,
    /// Prompt length of the cold vs cached TTFT measurement.
    #[arg(long, default_value_t = 1500)]
    pub ttft_prompt: usize,
    /// llama-bench binary (default: ~/.cache/cachet/peer/bin/llama-bench).
    #[arg(long)]
    pub llama_bench: Option<PathBuf>,
    /// llama-batched-bench binary (default: next to llama-bench).
    #[arg(long)]
    pub llama_batched_bench: Option<PathBuf>,
    /// Measure cachet only.
    #[arg(long)]
    pub no_llama: bool,
    /// Markdown file whose marked section gets the results.
    #[arg(long, default_value = "docs/benchmarks.md")]
    pub doc: PathBuf,
    /// Do not touch the doc.
    #[arg(long)]
    pub no_doc: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

impl Default for KernelArgs {
    fn default() -> Self {
        KernelArgs {
            model: None,
            threads: 2,
            reps: 3,
            prompt: 512,
            gen: 128,
            batches: vec![1, 8, 16, 32],
            batch_ctx: 128,
            batch_steps: 32,
            depth: 1000,
            depth_steps: 32,
            ttft_prompt: 1500,
            llama_bench: None,
            llama_batched_bench: None,
            no_llama: false,
            doc: PathBuf::from("docs/benchmarks.md"),
            no_doc: true,
            output_json: None,
        }
    }
}

/// Mean ± std of a rate over repetitions.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Rate {
    pub mean: f64,
    pub std: f64,
}

impl Rate {
    fn of(v: &[f64]) -> Rate {
        let (mean, std) = mean_std(v);
        Rate { mean, std }
    }
    fn show(self) -> String {
        format!("{:.1} ± {:.1}", self.mean, self.std)
    }
}

/// One row of the kernel table.
#[derive(Clone, Debug, Serialize)]
pub struct KernelRow {
    pub name: String,
    pub unit: String,
    pub cachet: Rate,
    pub llama: Option<Rate>,
    /// How llama.cpp's figure was measured.
    pub llama_source: Option<String>,
}

/// Aggregate decode throughput at batch `batch` over batch 1.
#[derive(Clone, Debug, Serialize)]
pub struct ScalingRow {
    pub batch: usize,
    /// Mean ± std of the per-repetition ratios (the sizes run interleaved).
    pub cachet: Rate,
    /// llama-batched-bench's ratio from the same run, when it ran.
    pub llama: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct KernelReport {
    pub date: String,
    pub machine: String,
    pub model: String,
    pub threads: usize,
    pub rows: Vec<KernelRow>,
    /// Each engine's own batched-decode scaling.
    pub scaling: Vec<ScalingRow>,
    pub ttft_cold_ms: Rate,
    pub ttft_cached_ms: Rate,
    pub ttft_prompt: usize,
    pub ttft_cached_tokens: usize,
    pub llama_commands: Vec<String>,
    pub llama_error: Option<String>,
}

/// A bump allocator over the executor's block ids.
struct Blocks {
    next: u32,
    total: u32,
}

impl Blocks {
    fn table(&mut self, positions: usize) -> Result<Vec<u32>, BenchError> {
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
    fn reset(&mut self) {
        self.next = 0;
    }
}

struct Seq {
    slot: u32,
    prompt: Vec<u32>,
    output: Vec<u32>,
    table: Vec<u32>,
    /// Positions with KV written.
    len: usize,
}

fn tokens(model: &LoadedModel, seed: u64, n: usize) -> Result<Vec<u32>, BenchError> {
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
fn step(
    exec: &mut dyn Executor,
    params: &SamplingParams,
    seqs: &mut [Seq],
    chunks: &[Vec<u32>],
) -> Result<f64, BenchError> {
    let t0 = Instant::now();
    let out = {
        let batch = ExecBatch {
            seqs: seqs
                .iter()
                .zip(chunks)
                .map(|(s, c)| SeqChunk {
                    slot: s.slot,
                    tokens: c,
                    start_pos: s.len,
                    block_table: &s.table,
                    sample: Some(SampleSpec {
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
    for ((s, c), o) in seqs.iter_mut().zip(chunks).zip(out) {
        s.len += c.len();
        if let Some(o) = o {
            s.output.push(o.token);
        }
    }
    Ok(dt)
}

/// Decodes `steps` steps of every seq (feeding back the sampled token); returns seconds.
fn decode(
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

fn cachet_side(a: &KernelArgs, model: &LoadedModel) -> Result<CachetSide, BenchError> {
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
    // and computes only the tail.
    let full = a.ttft_prompt / BLOCK;
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

/// Parses `llama-bench -o json` output: (n_prompt, n_gen, n_depth, avg_ts, stddev_ts).
pub fn parse_llama_bench(json: &str) -> Vec<(u64, u64, u64, f64, f64)> {
    let start = json.find('[').unwrap_or(0);
    let v: Value = serde_json::from_str(&json[start..]).unwrap_or(Value::Null);
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    (
                        t["n_prompt"].as_u64().unwrap_or(0),
                        t["n_gen"].as_u64().unwrap_or(0),
                        t["n_depth"].as_u64().unwrap_or(0),
                        t["avg_ts"].as_f64().unwrap_or(f64::NAN),
                        t["stddev_ts"].as_f64().unwrap_or(0.0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Parses `llama-batched-bench --output-format jsonl`: (pl, speed_tg).
pub fn parse_batched_bench(out: &str) -> Vec<(u64, f64)> {
    out.lines()
        .filter(|l| l.trim_start().starts_with('{') && l.contains("speed_tg"))
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .map(|v| {
            (
                v["pl"].as_u64().unwrap_or(0),
                v["speed_tg"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect()
}

fn run_tool(bin: &Path, args: &[String], cmds: &mut Vec<String>) -> Result<String, BenchError> {
    let line = format!("{} {}", bin.display(), args.join(" "));
    eprintln!("[kernel] {line}");
    cmds.push(line);
    let out = Command::new(bin)
        .args(args)
        .output()
        .map_err(|e| BenchError::io(format!("running {}", bin.display()), e))?;
    if !out.status.success() {
        return Err(BenchError::Peer(format!(
            "{} failed with {}: {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .chars()
                .rev()
                .take(1500)
                .collect::<String>()
                .chars()
                .rev()
                .collect::<String>()
        )));
    }
    Ok(format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// Named rates, TTFT cold and cached (ms), and the cached token count.
struct CachetSide {
    rows: Vec<(String, Rate)>,
    ttft_cold_ms: Rate,
    ttft_cached_ms: Rate,
    cached_tokens: usize,
    /// (B, aggregate at batch B / at batch 1, paired by repetition).
    scaling: Vec<(usize, Rate)>,
}

type LlamaRates = Vec<(String, Rate, String)>;

fn llama_side(
    a: &KernelArgs,
    model: &Path,
    cmds: &mut Vec<String>,
) -> Result<LlamaRates, BenchError> {
    let lb = crate::peer::find("llama-bench", a.llama_bench.as_ref())?;
    let m = model.display().to_string();
    let t = a.threads.to_string();
    let r = a.reps.max(1).to_string();
    let mut out = Vec::new();
    let s = |x: &str| x.to_string();
    let j1 = run_tool(
        &lb,
        &[
            s("-m"),
            m.clone(),
            s("-t"),
            t.clone(),
            s("-p"),
            a.prompt.to_string(),
            s("-n"),
            a.gen.to_string(),
            s("-r"),
            r.clone(),
            s("-o"),
            s("json"),
        ],
        cmds,
    )?;
    for (np, ng, _, avg, sd) in parse_llama_bench(&j1) {
        let rate = Rate { mean: avg, std: sd };
        if np > 0 && ng == 0 {
            out.push((
                format!("prefill pp{np}"),
                rate,
                format!("llama-bench pp{np}"),
            ));
        } else if ng > 0 && np == 0 {
            out.push((
                format!("decode tg{ng}, batch 1"),
                rate,
                format!("llama-bench tg{ng}"),
            ));
        }
    }
    let j2 = run_tool(
        &lb,
        &[
            s("-m"),
            m.clone(),
            s("-t"),
            t.clone(),
            s("-p"),
            s("0"),
            s("-n"),
            a.depth_steps.to_string(),
            s("-d"),
            a.depth.to_string(),
            s("-r"),
            r,
            s("-o"),
            s("json"),
        ],
        cmds,
    )?;
    for (_, ng, d, avg, sd) in parse_llama_bench(&j2) {
        out.push((
            format!("decode tg{ng} at depth {d}, batch 1"),
            Rate { mean: avg, std: sd },
            format!("llama-bench -p 0 -n {ng} -d {d}"),
        ));
    }
    let bb = match &a.llama_batched_bench {
        Some(p) => p.clone(),
        None => lb.with_file_name("llama-batched-bench"),
    };
    if bb.is_file() && !a.batches.is_empty() {
        let npl: Vec<String> = a.batches.iter().map(|b| b.to_string()).collect();
        let max_b = a.batches.iter().copied().max().unwrap_or(1);
        let ctx = (max_b * (a.batch_ctx + a.batch_steps) + 64).max(2048);
        let o = run_tool(
            &bb,
            &[
                s("-m"),
                m,
                s("-t"),
                t.clone(),
                s("-tb"),
                t,
                s("-c"),
                ctx.to_string(),
                s("-b"),
                s("2048"),
                s("-ub"),
                s("512"),
                s("-npp"),
                a.batch_ctx.to_string(),
                s("-ntg"),
                a.batch_steps.to_string(),
                s("-npl"),
                npl.join(","),
                s("--output-format"),
                s("jsonl"),
            ],
            cmds,
        )?;
        for (pl, tg) in parse_batched_bench(&o) {
            out.push((
                format!("decode batch {pl} at ctx {} (aggregate)", a.batch_ctx),
                Rate { mean: tg, std: 0.0 },
                format!(
                    "llama-batched-bench -npp {} -ntg {} (1 run)",
                    a.batch_ctx, a.batch_steps
                ),
            ));
        }
    }
    Ok(out)
}

pub fn bench_kernel(a: &KernelArgs) -> Result<KernelReport, BenchError> {
    let path = a
        .model
        .clone()
        .unwrap_or_else(cachet_model::default_model_path);
    let (date, machine) = (crate::peer::utc_now(), crate::peer::machine_description());
    let machine = format!(
        "{machine}; cachet kernels: {} (AMX: {})",
        cachet_kernels::isa::active(),
        cachet_kernels::isa::amx_status()
    );
    let model = cachet_model::load_model(
        &path,
        &LoadOptions {
            threads: a.threads,
            progress: false,
            full_fingerprint: false,
            ..Default::default()
        },
    )?;
    let side = cachet_side(a, &model)?;
    drop(model);
    let mut cmds = Vec::new();
    let (llama, llama_error) = if a.no_llama {
        (Vec::new(), None)
    } else {
        match llama_side(a, &path, &mut cmds) {
            Ok(v) => (v, None),
            Err(e) => {
                eprintln!("[kernel] llama.cpp side failed: {e}");
                (Vec::new(), Some(e.to_string()))
            }
        }
    };
    let llama_tg = |b: usize| {
        let name = format!("decode batch {b} at ctx {} (aggregate)", a.batch_ctx);
        llama.iter().find(|(n, _, _)| *n == name).map(|x| x.1.mean)
    };
    let scaling = side
        .scaling
        .iter()
        .map(|&(batch, cachet)| ScalingRow {
            batch,
            cachet,
            llama: llama_tg(batch).zip(llama_tg(1)).map(|(x, y)| x / y),
        })
        .collect();
    let rows = side
        .rows
        .into_iter()
        .map(|(name, c)| {
            let l = llama.iter().find(|(n, _, _)| *n == name);
            KernelRow {
                unit: "tok/s".into(),
                llama: l.map(|x| x.1),
                llama_source: l.map(|x| x.2.clone()),
                name,
                cachet: c,
            }
        })
        .collect();
    let rep = KernelReport {
        date,
        machine,
        model: path.display().to_string(),
        threads: a.threads,
        rows,
        scaling,
        ttft_cold_ms: side.ttft_cold_ms,
        ttft_cached_ms: side.ttft_cached_ms,
        ttft_prompt: a.ttft_prompt,
        ttft_cached_tokens: side.cached_tokens,
        llama_commands: cmds,
        llama_error,
    };
    crate::doc::publish(
        &rep,
        a.output_json.as_deref(),
        &a.doc,
        a.no_doc,
        DOC_SECTION,
        markdown,
        "kernel",
    )?;
    Ok(rep)
}

pub fn table(rep: &KernelReport, markdown: bool) -> String {
    let header: Vec<String> = [
        "measurement (tok/s)",
        "cachet",
        "llama.cpp",
        "cachet / llama.cpp",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut rows: Vec<Vec<String>> = rep
        .rows
        .iter()
        .map(|r| {
            vec![
                r.name.clone(),
                r.cachet.show(),
                r.llama.map_or("n/a".into(), |l| l.show()),
                r.llama
                    .filter(|l| l.mean > 0.0)
                    .map_or("n/a".into(), |l| format!("{:.2}×", r.cachet.mean / l.mean)),
            ]
        })
        .collect();
    for sc in &rep.scaling {
        rows.push(vec![
            format!("decode batch {} / batch 1 (own scaling, ×)", sc.batch),
            format!("{:.2} ± {:.2}", sc.cachet.mean, sc.cachet.std),
            sc.llama.map_or("n/a".into(), |l| format!("{l:.2}")),
            String::new(),
        ]);
    }
    rows.push(vec![
        format!("TTFT {} tokens cold (ms)", rep.ttft_prompt),
        rep.ttft_cold_ms.show(),
        String::new(),
        String::new(),
    ]);
    rows.push(vec![
        format!(
            "TTFT {} tokens, {} cached (ms)",
            rep.ttft_prompt, rep.ttft_cached_tokens
        ),
        rep.ttft_cached_ms.show(),
        String::new(),
        format!(
            "cold / cached = {}",
            report::fmt_num(rep.ttft_cold_ms.mean / rep.ttft_cached_ms.mean)
        ),
    ]);
    report::render(&header, &rows, markdown)
}

pub fn markdown(rep: &KernelReport) -> String {
    let mut s = format!(
        "_Generated by `cachet bench kernel` on {} — rerun to refresh._\n\n- Machine: {}\n- Model: `{}`, {} threads, f16 KV, block size 16\n",
        rep.date, rep.machine, rep.model, rep.threads
    );
    for c in &rep.llama_commands {
        s.push_str(&format!("- `{c}`\n"));
    }
    if let Some(e) = &rep.llama_error {
        s.push_str(&format!("- llama.cpp side failed: {e}\n"));
    }
    s.push('\n');
    s.push_str(&table(rep, true));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama_bench_json() {
        let j = r#"warming up
[
  {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 900.5, "stddev_ts": 12.0},
  {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 150.0, "stddev_ts": 3.0}
]"#;
        let v = parse_llama_bench(j);
        assert_eq!(v, vec![(512, 0, 0, 900.5, 12.0), (0, 128, 0, 150.0, 3.0)]);
    }

    #[test]
    fn parses_batched_bench_jsonl() {
        let o = "main: n_kv_max = 2048\n{\"n_kv_max\": 2048, \"pp\": 128, \"tg\": 32, \"pl\": 8, \"n_kv\": 1280, \"t_pp\": 1.0, \"speed_pp\": 1024.0, \"t_tg\": 1.0, \"speed_tg\": 256.0, \"t\": 2.0, \"speed\": 640.0}\n";
        assert_eq!(parse_batched_bench(o), vec![(8, 256.0)]);
    }
}
