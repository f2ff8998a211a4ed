//! `cachet bench spec`: prompt-lookup speculative decoding on the real model, batch 1, greedy.
//!
//! Two workloads, each run with speculation off and on, interleaved (off, on, off, on, ...) and
//! repeated, through the core's scheduler and the model executor (no HTTP):
//! * **edit**: a generated ~1,000-token Rust file with the request to return it with one
//!   function renamed: the answer copies the prompt, so drafts are accepted;
//! * **free**: free-form text generation with nothing to look up.
//!
//! Reported per workload: decode tokens/s (output tokens after the first over the time after
//! the first token) off and on, the ratio (median and range over the repetitions), the draft
//! acceptance, and whether the greedy text was identical.

use std::path::PathBuf;
use std::time::Instant;

use cachet_core::spec_decode::{SpecConfig, SpecDecodeStats};
use cachet_core::{
    Executor, HashSeed, RequestDraft, SamplingParams, Scheduler, SchedulerConfig, TokenId,
};
use cachet_model::{ExecutorConfig, KvDtype, LoadOptions, LoadedModel};
use clap::Args;
use serde::Serialize;

use crate::error::BenchError;

const BLOCK: usize = 16;

#[derive(Args, Clone, Debug)]
pub struct SpecArgs {
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 2, value_parser = crate::positive::<usize>)]
    pub threads: usize,
    /// Repetitions of each (workload, mode), interleaved.
    #[arg(long, default_value_t = 3, value_parser = crate::positive::<usize>)]
    pub reps: usize,
    /// Functions in the generated code file (about 40 tokens each).
    #[arg(long, default_value_t = 17, value_parser = crate::positive::<usize>)]
    pub functions: usize,
    /// Most tokens generated for the free-form workload.
    #[arg(long, default_value_t = 256, value_parser = crate::positive::<u32>)]
    pub free_tokens: u32,
    #[arg(long, default_value_t = 5, value_parser = crate::positive::<usize>)]
    pub num_speculative_tokens: usize,
    #[arg(long, default_value_t = 2, value_parser = crate::positive::<usize>)]
    pub spec_ngram_min: usize,
    #[arg(long, default_value_t = 4, value_parser = crate::positive::<usize>)]
    pub spec_ngram_max: usize,
    /// Also run speculation with fixed drafts (`adaptive: false`: no backoff, no shortening), interleaved
    /// with the other two modes.
    #[arg(long)]
    pub compare_adaptive: bool,
    /// Skip the verification-cost and proposer measurements.
    #[arg(long)]
    pub no_cost: bool,
    /// Interleaved repetitions of each step of the verification-cost measurement.
    #[arg(long, default_value_t = 60, value_parser = crate::positive::<usize>)]
    pub cost_reps: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Write each workload's prompt and greedy answer (token ids, the first plain run) to
    /// `DIR/spec-tokens-<i>.json` (`{"name", "prompt", "output"}`): the input of
    /// `scripts/spec-replay.py`, which replays the proposer and the draft rules on them.
    #[arg(long, value_name = "DIR")]
    pub dump_tokens: Option<PathBuf>,
}

/// One run of one request.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunStats {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub steps: usize,
    pub ttft_s: f64,
    pub total_s: f64,
    /// (output_tokens - 1) / (total - ttft).
    pub decode_tok_s: f64,
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    #[serde(skip)]
    pub tokens: Vec<TokenId>,
}

#[derive(Clone, Debug, Serialize)]
pub struct WorkloadResult {
    pub name: String,
    pub off: Vec<RunStats>,
    pub on: Vec<RunStats>,
    /// on/off decode tokens/s of each interleaved pair.
    pub ratios: Vec<f64>,
    /// With `--compare-adaptive`: speculation with fixed drafts, and its ratios to off.
    pub on_fixed: Vec<RunStats>,
    pub ratios_fixed: Vec<f64>,
    pub identical: bool,
}

/// What a rejected draft costs: one batch-1 step at a context of `context` tokens carrying
/// `drafts` draft tokens (all rejected), as the median over interleaved repetitions.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyCost {
    pub context: usize,
    pub drafts: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct SpecReport {
    pub machine: String,
    pub loadavg: String,
    pub threads: usize,
    pub spec: String,
    pub workloads: Vec<WorkloadResult>,
    /// Step time by number of rejected drafts, at the free-form and the edit prompt's context.
    pub verify_cost: Vec<VerifyCost>,
    /// The proposer's time per call on the edit prompt when nothing matches (a full scan for
    /// every n), microseconds.
    pub proposer_us: f64,
}

/// A deterministic Rust file of `n` small functions (names and constants vary).
pub fn code_file(n: usize) -> String {
    const OPS: [(&str, &str); 4] = [("add", "+"), ("sub", "-"), ("mul", "*"), ("xor", "^")];
    let mut s = String::from("//! Small arithmetic helpers.\n\n");
    for i in 0..n {
        let (name, op) = OPS[i % 4];
        s.push_str(&format!(
            "/// Applies `{name}` with the constant {c}.\npub fn {name}_{i}(x: u64) -> u64 {{\n    let y = x {op} {c};\n    y.wrapping_mul({m})\n}}\n\n",
            c = 3 + 7 * i,
            m = 2 + i % 5,
        ));
    }
    s
}

fn chat(m: &LoadedModel, user: &str) -> Result<Vec<TokenId>, BenchError> {
    let text = m
        .tokenizer
        .apply_chat_template(&[cachet_model::ChatMessage::user(user)], true)
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    m.tokenizer
        .encode(&text, true)
        .map_err(|e| BenchError::Setup(e.to_string()))
}

/// Runs one greedy request to the end on a fresh executor arena.
fn run_one(
    m: &LoadedModel,
    prompt: &[TokenId],
    max_tokens: u32,
    spec: Option<SpecConfig>,
) -> Result<RunStats, BenchError> {
    let num_blocks = (prompt.len() + max_tokens as usize).div_ceil(BLOCK) + 4;
    let mut exec = m.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks,
        kv_dtype: KvDtype::F16,
    })?;
    let cfg = SchedulerConfig {
        block_size: BLOCK,
        num_blocks,
        max_model_len: prompt.len() + max_tokens as usize + 1,
        eos_token_ids: m.tokenizer.eos_token_ids(),
        enable_prefix_caching: false,
        speculative: spec,
        ..Default::default()
    };
    let seed = HashSeed::new(&exec.model_fingerprint(), BLOCK, &exec.kv_layout());
    let mut s = Scheduler::new(cfg, seed, ());
    let v = s
        .config()
        .limits()
        .validate(RequestDraft::new(
            "bench",
            prompt.to_vec(),
            SamplingParams::greedy(max_tokens),
        ))
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    s.add_request(1, 0.0, v)
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    let mut st = RunStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut spec_tot = SpecDecodeStats::default();
    let t0 = Instant::now();
    while s.has_unfinished() {
        let plan = s.schedule(0.0, None);
        let res = exec.execute(&s.exec_batch(&plan))?;
        for u in s.update(&plan, res, 0.0) {
            if let Some(t) = u.token {
                if st.tokens.is_empty() {
                    st.ttft_s = t0.elapsed().as_secs_f64();
                }
                st.tokens.push(t.token);
            }
        }
        let d = s.take_spec_stats();
        spec_tot.num_drafts += d.num_drafts;
        spec_tot.num_draft_tokens += d.num_draft_tokens;
        spec_tot.num_accepted_tokens += d.num_accepted_tokens;
        st.steps += 1;
    }
    st.total_s = t0.elapsed().as_secs_f64();
    st.output_tokens = st.tokens.len();
    let decode_s = st.total_s - st.ttft_s;
    st.decode_tok_s = if decode_s > 0.0 {
        (st.output_tokens.saturating_sub(1)) as f64 / decode_s
    } else {
        0.0
    };
    st.drafts = spec_tot.num_drafts;
    st.draft_tokens = spec_tot.num_draft_tokens;
    st.accepted_tokens = spec_tot.num_accepted_tokens;
    Ok(st)
}

/// One batch-1 step of `[t, d1..dk]` at position `prompt.len()` with `k` drafts the model rejects,
/// for every `k` of `ks`, interleaved round-robin `reps` times after a prefill of `prompt`.
fn verify_cost(
    m: &LoadedModel,
    prompt: &[TokenId],
    ks: &[usize],
    reps: usize,
) -> Result<Vec<VerifyCost>, BenchError> {
    let kmax = ks.iter().copied().max().unwrap_or(0);
    let num_blocks = (prompt.len() + kmax + 2).div_ceil(BLOCK) + 1;
    let mut exec = m.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks,
        kv_dtype: KvDtype::F16,
    })?;
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let params = SamplingParams::greedy(64);
    let seq = |tokens, output, drafts| cachet_core::exec::SeqChunk {
        slot: 0,
        tokens,
        start_pos: 0,
        block_table: &table,
        sample: Some(cachet_core::exec::SampleSpec {
            params: &params,
            prompt,
            output,
            forks: &[],
            drafts,
        }),
        prompt_logprobs: None,
    };
    let batch = |seqs| cachet_core::exec::ExecBatch {
        copies: Vec::new(),
        loads: Vec::new(),
        seqs,
    };
    let out = exec.execute(&batch(vec![seq(prompt, &[], &[])]))?;
    let first = out
        .sampled
        .first()
        .and_then(|s| s.as_ref())
        .map(|s| s.token)
        .ok_or_else(|| BenchError::Setup("no first token".into()))?;
    let output = [first];
    // The greedy token after `first`, so that every draft can be made to differ from it.
    let mut one = seq(&output, &output, &[]);
    one.start_pos = prompt.len();
    let next = exec
        .execute(&batch(vec![one]))?
        .sampled
        .first()
        .and_then(|s| s.as_ref())
        .map_or(0, |s| s.token);
    let mut chunk = vec![first];
    chunk.extend((0..kmax).map(|j| {
        if prompt[j] == next {
            next ^ 1
        } else {
            prompt[j]
        }
    }));
    let mut times = vec![Vec::with_capacity(reps); ks.len()];
    for _ in 0..reps {
        for (i, &k) in ks.iter().enumerate() {
            let mut c = seq(&chunk[..=k], &output, &chunk[1..=k]);
            c.start_pos = prompt.len();
            let t = Instant::now();
            exec.execute(&batch(vec![c]))?;
            times[i].push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(ks
        .iter()
        .zip(times)
        .map(|(&k, t)| {
            let (lo, hi) = range(&t);
            VerifyCost {
                context: prompt.len(),
                drafts: k,
                median_ms: median(&t),
                min_ms: lo,
                max_ms: hi,
            }
        })
        .collect())
}

/// Microseconds per proposer call on `tokens` with nothing to find: the tokens followed by a
/// fresh id, so every n-gram suffix is scanned to the start.
fn proposer_us(tokens: &[TokenId], spec: &SpecConfig) -> f64 {
    let mut t = tokens.to_vec();
    t.push(u32::MAX);
    let mut out = Vec::new();
    let calls = 2000;
    let start = Instant::now();
    let mut found = 0;
    for _ in 0..calls {
        found += cachet_core::spec_decode::propose_ngram(
            std::hint::black_box(&t),
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
            spec.num_speculative_tokens,
            &mut out,
        );
    }
    std::hint::black_box(found);
    start.elapsed().as_secs_f64() * 1e6 / calls as f64
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

pub fn bench_spec(a: &SpecArgs) -> Result<SpecReport, BenchError> {
    let spec = SpecConfig {
        num_speculative_tokens: a.num_speculative_tokens,
        prompt_lookup_min: a.spec_ngram_min,
        prompt_lookup_max: a.spec_ngram_max,
        adaptive: true,
    };
    spec.check_ngram_range().map_err(BenchError::Setup)?;
    let path = a
        .model
        .clone()
        .unwrap_or_else(cachet_model::default_model_path);
    let m = cachet_model::load_model(
        &path,
        &LoadOptions {
            threads: a.threads,
            progress: false,
            ..Default::default()
        },
    )?;
    let fixed = SpecConfig {
        adaptive: false,
        ..spec
    };
    let file = code_file(a.functions);
    // The file first, the request after it: the 135M model then copies the file.
    let edit_prompt = chat(
        &m,
        &format!(
            "```rust\n{file}```\n\nRewrite the whole file above with the function `mul_2` renamed to `times_2`. Keep everything else exactly the same."
        ),
    )?;
    // The request first (the workload of the first measurements): the model answers with
    // prose about the code, which repeats its identifiers without copying it.
    let ask_first_prompt = chat(
        &m,
        &format!(
            "Return this Rust file unchanged except that the function `mul_2` is renamed to `times_2`. Output only the code.\n\n```rust\n{file}```"
        ),
    )?;
    let file_tokens = m
        .tokenizer
        .encode(&file, false)
        .map_err(|e| BenchError::Setup(e.to_string()))?
        .len();
    let edit_max = (file_tokens + 32) as u32;
    let free_prompt = chat(
        &m,
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    )?;
    let mut workloads = Vec::new();
    for (name, prompt, max) in [
        (
            format!("edit ({file_tokens}-token file)"),
            &edit_prompt,
            edit_max,
        ),
        (
            format!("edit, request first ({file_tokens}-token file): prose answer"),
            &ask_first_prompt,
            edit_max,
        ),
        ("free-form text".to_string(), &free_prompt, a.free_tokens),
    ] {
        let (mut off, mut on, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut on_nb, mut ratios_nb) = (Vec::new(), Vec::new());
        // Warm-up (page in the weights, grow scratch buffers).
        run_one(&m, prompt, 16, None)?;
        let mut modes = vec![None, Some(spec)];
        if a.compare_adaptive {
            modes.push(Some(fixed));
        }
        for rep in 0..a.reps {
            // Rotate which mode goes first, so drift hits every mode alike.
            let mut runs: Vec<Option<RunStats>> = vec![None; modes.len()];
            for j in 0..modes.len() {
                let i = (j + rep) % modes.len();
                runs[i] = Some(run_one(&m, prompt, max, modes[i])?);
            }
            let mut runs = runs.into_iter().flatten();
            let (Some(x), Some(y)) = (runs.next(), runs.next()) else {
                return Err(BenchError::Setup("a run is missing".into()));
            };
            ratios.push(y.decode_tok_s / x.decode_tok_s.max(1e-9));
            eprintln!(
                "{name} rep {rep}: off {:.1} tok/s, on {:.1} tok/s ({} tokens, {} accepted of {} drafted)",
                x.decode_tok_s, y.decode_tok_s, y.output_tokens, y.accepted_tokens, y.draft_tokens
            );
            if let Some(z) = runs.next() {
                ratios_nb.push(z.decode_tok_s / x.decode_tok_s.max(1e-9));
                eprintln!(
                    "{name} rep {rep}: on, not adaptive, {:.1} tok/s ({} accepted of {} drafted)",
                    z.decode_tok_s, z.accepted_tokens, z.draft_tokens
                );
                on_nb.push(z);
            }
            off.push(x);
            on.push(y);
        }
        if let (Some(dir), Some(r)) = (&a.dump_tokens, off.first()) {
            let p = dir.join(format!("spec-tokens-{}.json", workloads.len()));
            let j = serde_json::json!({ "name": name, "prompt": prompt, "output": r.tokens });
            std::fs::write(&p, j.to_string())
                .map_err(|e| BenchError::io(p.display().to_string(), e))?;
        }
        if let Some(r) = off.first() {
            let text = m.tokenizer.decode(&r.tokens, false).unwrap_or_default();
            let head: String = text.chars().take(400).collect();
            eprintln!("{name}: the answer begins {head:?}");
        }
        for (label, r) in off
            .iter()
            .map(|r| ("off", r))
            .chain(on.iter().map(|r| ("on", r)))
        {
            let first_diff = r
                .tokens
                .iter()
                .zip(&off[0].tokens)
                .position(|(a, b)| a != b);
            eprintln!(
                "{name}: {label} run: {} tokens, first difference from the first plain run at {first_diff:?}",
                r.tokens.len()
            );
        }
        let identical = off
            .iter()
            .chain(&on)
            .chain(&on_nb)
            .all(|r| r.tokens == off[0].tokens);
        workloads.push(WorkloadResult {
            name,
            off,
            on,
            ratios,
            on_fixed: on_nb,
            ratios_fixed: ratios_nb,
            identical,
        });
    }
    let (mut verify, mut proposer) = (Vec::new(), 0.0);
    if !a.no_cost {
        let ks = [0, 1, 2, 3, 4, 5];
        verify = verify_cost(&m, &free_prompt, &ks, a.cost_reps)?;
        verify.extend(verify_cost(&m, &edit_prompt, &ks, a.cost_reps)?);
        proposer = proposer_us(&edit_prompt, &spec);
    }
    let rep = SpecReport {
        machine: cpu_name(),
        loadavg: std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default(),
        threads: a.threads,
        spec: format!(
            "ngram, K = {}, n = {}..{}",
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        ),
        workloads,
        verify_cost: verify,
        proposer_us: proposer,
    };
    if let Some(p) = &a.output_json {
        let j = serde_json::to_string_pretty(&rep)?;
        std::fs::write(p, j).map_err(|e| BenchError::io(p.display().to_string(), e))?;
    }
    Ok(rep)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        })
}

/// The results as a markdown table.
pub fn table(r: &SpecReport) -> String {
    let mut out = format!(
        "{} · {} threads · {} · load average at the end {}\n\n| workload | output tokens | decode tok/s off (range) | on (range) | on/off median (range) | accepted / drafted | tokens per step | identical greedy text |\n|---|---|---|---|---|---|---|---|\n",
        r.machine, r.threads, r.spec, r.loadavg
    );
    for w in &r.workloads {
        let off: Vec<f64> = w.off.iter().map(|x| x.decode_tok_s).collect();
        let on: Vec<f64> = w.on.iter().map(|x| x.decode_tok_s).collect();
        let (o0, o1) = range(&off);
        let (n0, n1) = range(&on);
        let (r0, r1) = range(&w.ratios);
        let first = w.on.first().cloned().unwrap_or_default();
        let acc = if first.draft_tokens > 0 {
            format!(
                "{} / {} ({:.0} %)",
                first.accepted_tokens,
                first.draft_tokens,
                100.0 * first.accepted_tokens as f64 / first.draft_tokens as f64
            )
        } else {
            "0 / 0".into()
        };
        out.push_str(&format!(
            "| {} | {} | {:.1} ({:.1}–{:.1}) | {:.1} ({:.1}–{:.1}) | **{:.2}x** ({:.2}–{:.2}) | {} | {:.2} | {} |\n",
            w.name,
            first.output_tokens,
            median(&off),
            o0,
            o1,
            median(&on),
            n0,
            n1,
            median(&w.ratios),
            r0,
            r1,
            acc,
            first.output_tokens as f64 / first.steps.max(1) as f64,
            if w.identical { "yes" } else { "**no**" },
        ));
        if let Some(nb) = w.on_fixed.first() {
            let v: Vec<f64> = w.on_fixed.iter().map(|x| x.decode_tok_s).collect();
            let (b0, b1) = range(&v);
            let (q0, q1) = range(&w.ratios_fixed);
            out.push_str(&format!(
                "| {} (not adaptive) | {} | | {:.1} ({:.1}–{:.1}) | **{:.2}x** ({:.2}–{:.2}) | {} / {} | {:.2} | |\n",
                w.name,
                nb.output_tokens,
                median(&v),
                b0,
                b1,
                median(&w.ratios_fixed),
                q0,
                q1,
                nb.accepted_tokens,
                nb.draft_tokens,
                nb.output_tokens as f64 / nb.steps.max(1) as f64,
            ));
        }
    }
    if !r.verify_cost.is_empty() {
        out.push_str(
        "\nOne batch-1 step with k rejected drafts (median of interleaved repetitions):\n\n| context tokens | k | step ms (range) | vs k = 0 |\n|---|---|---|---|\n",
    );
        for v in &r.verify_cost {
            let base = r
                .verify_cost
                .iter()
                .find(|x| x.context == v.context && x.drafts == 0)
                .map_or(v.median_ms, |x| x.median_ms);
            out.push_str(&format!(
                "| {} | {} | {:.2} ({:.2}–{:.2}) | {:.2}x |\n",
                v.context,
                v.drafts,
                v.median_ms,
                v.min_ms,
                v.max_ms,
                v.median_ms / base.max(1e-9)
            ));
        }
        out.push_str(&format!(
            "\nProposer, a full scan of the edit prompt with nothing found: {:.1} µs per call\n",
            r.proposer_us
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_file_is_deterministic_and_varied() {
        let f = code_file(3);
        assert_eq!(f, code_file(3));
        assert!(f.contains(
            "pub fn add_0(x: u64) -> u64 {\n    let y = x + 3;\n    y.wrapping_mul(2)\n}"
        ));
        assert!(f.contains(
            "pub fn mul_2(x: u64) -> u64 {\n    let y = x * 17;\n    y.wrapping_mul(4)\n}"
        ));
        assert_eq!(f.matches("pub fn").count(), 3);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0]), 2.5);
    }

    /// An n-gram range that matches nothing is refused before any model is read.
    #[test]
    fn an_empty_ngram_range_is_refused_before_the_model_loads() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: SpecArgs,
        }
        // (0 is refused by the argument parser already.)
        for (min, max) in [("3", "2"), ("5", "1")] {
            let cli = <Cli as clap::Parser>::parse_from([
                "x",
                "--model",
                "/nonexistent/model.gguf",
                "--spec-ngram-min",
                min,
                "--spec-ngram-max",
                max,
            ]);
            match bench_spec(&cli.a) {
                Err(BenchError::Setup(m)) => {
                    assert!(m.contains(&format!("got {min} and {max}")), "{m}")
                }
                Err(e) => panic!("{e}"),
                Ok(_) => panic!("accepted"),
            }
        }
    }
}
