//! `cachet bench fidelity`: how far the served path's numbers are from exact arithmetic.
//!
//! A fixed text (`tests/data/fidelity/keeper.txt`, compiled in) is teacher-forced through two
//! executors over the same weights file:
//! * **served**: the model as `cachet serve` runs it — quantized weights, int8-quantized
//!   activations in every matmul, f16 KV, the active ISA level's kernels;
//! * **exact**: every weight dequantized to f32 at load, f32 activations (no activation
//!   quantization) and f32 KV.
//!
//! Every position's next-token distribution is compared: mean (and tail) KL divergence
//! `KL(exact ‖ served)` in nats, top-1 agreement, and the perplexity of the text under each,
//! with the served path's shift in percent. Each step computes `--chunk` positions as that
//! many one-token sequences over one shared block table (K/V of all of them are written
//! before attention, and each attends causally to its own prefix), so every position gets
//! its logits while the matmuls still run with `--chunk` activation rows.

use std::path::PathBuf;
use std::time::Instant;

use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, SamplingParams, SeqChunk};
use cachet_model::{ExecutorConfig, KvDtype, LlamaExecutor, LoadOptions, LoadedModel};
use clap::Args;
use serde::Serialize;

use crate::error::BenchError;

pub const DOC_SECTION: &str = "cachet-bench-fidelity";

/// The committed text (public domain; see `tests/data/fidelity/README.md`).
pub const TEXT: &str = include_str!("../../../tests/data/fidelity/keeper.txt");

const BLOCK: usize = 16;

#[derive(Args, Clone, Debug)]
pub struct FidelityArgs {
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 2, value_parser = crate::positive::<usize>)]
    pub threads: usize,
    /// Positions per executor step.
    #[arg(long, default_value_t = 64, value_parser = crate::positive::<usize>)]
    pub chunk: usize,
    /// Use only the first N tokens of the text (0: all).
    #[arg(long, default_value_t = 0)]
    pub max_tokens: usize,
    /// Markdown file whose marked section gets the results (default: a run file of its own,
    /// docs/bench-runs/<date>-<cpu>-<topic>.md).
    #[arg(long)]
    pub doc: Option<PathBuf>,
    /// Do not touch the doc.
    #[arg(long)]
    pub no_doc: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

/// Perplexity and top-1 accuracy of one path on the text.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PathStats {
    pub mean_nll: f64,
    pub perplexity: f64,
    /// Fraction of positions whose most likely token is the text's next token.
    pub top1_accuracy: f64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct FidelityReport {
    pub date: String,
    pub machine: String,
    pub model: String,
    pub isa: String,
    pub threads: usize,
    /// Tokens of the text, and positions compared (one fewer).
    pub tokens: usize,
    pub positions: usize,
    pub served: PathStats,
    pub exact: PathStats,
    pub mean_kl: f64,
    pub median_kl: f64,
    pub p99_kl: f64,
    pub max_kl: f64,
    /// Fraction of positions where both paths rank the same token first.
    pub top1_agreement: f64,
    /// `(ppl_served / ppl_exact - 1) · 100`.
    pub ppl_shift_pct: f64,
}

/// Log-softmax in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits
        .iter()
        .fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
    let z: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    let lz = m + z.ln();
    logits.iter().map(|&v| v as f64 - lz).collect()
}

/// `KL(p ‖ q) = Σ p (log p − log q)` from log-probabilities, in nats.
pub fn kl(logp: &[f64], logq: &[f64]) -> f64 {
    logp.iter()
        .zip(logq)
        .map(|(&a, &b)| {
            if a == f64::NEG_INFINITY {
                0.0
            } else {
                a.exp() * (a - b)
            }
        })
        .sum()
}

/// Index of the largest value (the first one on ties).
pub fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Per-position comparison of the two paths.
#[derive(Default)]
struct Acc {
    kls: Vec<f64>,
    agree: usize,
    nll: [f64; 2],
    top1: [usize; 2],
}

impl Acc {
    /// Position with next token `next`: `exact` and `served` logits.
    fn add(&mut self, exact: &[f32], served: &[f32], next: usize) {
        let (le, ls) = (log_softmax(exact), log_softmax(served));
        self.kls.push(kl(&le, &ls));
        let (ae, as_) = (argmax(&le), argmax(&ls));
        self.agree += usize::from(ae == as_);
        self.nll[0] -= le[next];
        self.nll[1] -= ls[next];
        self.top1[0] += usize::from(ae == next);
        self.top1[1] += usize::from(as_ == next);
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Logits of positions `lo..hi` (each predicting the token after it), computed as one-token
/// sequences over the shared `table`.
fn logits(
    exec: &mut LlamaExecutor,
    toks: &[u32],
    table: &[u32],
    lo: usize,
    hi: usize,
) -> Result<Vec<Vec<f32>>, BenchError> {
    let params = SamplingParams::greedy(1);
    let batch = ExecBatch {
        copies: Vec::new(),
        loads: Vec::new(),
        seqs: (lo..hi)
            .map(|p| SeqChunk {
                prompt_logprobs: None,
                slot: (p - lo) as u32,
                tokens: &toks[p..p + 1],
                start_pos: p,
                block_table: table,
                sample: Some(SampleSpec {
                    forks: &[],
                    drafts: &[],
                    params: &params,
                    prompt: &toks[..p + 1],
                    output: &[],
                }),
            })
            .collect(),
    };
    Ok(exec.execute_logits(&batch)?)
}

fn executor(model: &LoadedModel, n: usize, kv: KvDtype) -> Result<LlamaExecutor, BenchError> {
    Ok(model.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks: n.div_ceil(BLOCK) + 1,
        kv_dtype: kv,
    })?)
}

pub fn bench_fidelity(a: &FidelityArgs) -> Result<FidelityReport, BenchError> {
    let path = a
        .model
        .clone()
        .unwrap_or_else(cachet_model::default_model_path);
    let load = |dequantize_weights: bool| {
        cachet_model::load_model(
            &path,
            &LoadOptions {
                threads: a.threads,
                progress: false,
                full_fingerprint: false,
                dequantize_weights,
            },
        )
    };
    let served_model = load(false)?;
    let mut toks = served_model.tokenizer.encode(TEXT, true)?;
    if a.max_tokens > 0 {
        toks.truncate(a.max_tokens);
    }
    let n = toks.len();
    if n < 2 {
        return Err(BenchError::Peer(
            "fidelity text has fewer than 2 tokens".into(),
        ));
    }
    if n > served_model.weights.config.context_length {
        return Err(BenchError::Peer(format!(
            "fidelity text has {n} tokens, more than the model's context ({})",
            served_model.weights.config.context_length
        )));
    }
    let table: Vec<u32> = (0..n.div_ceil(BLOCK) as u32).collect();
    let chunk = a.chunk.max(1);
    let positions = n - 1;
    // Served path first, its logits kept per chunk only while the exact path catches up:
    // both executors advance chunk by chunk.
    let mut served = executor(&served_model, n, KvDtype::F16)?;
    let exact_model = load(true)?;
    let mut exact = executor(&exact_model, n, KvDtype::F32)?;
    let mut acc = Acc::default();
    let (mut t_served, mut t_exact) = (0f64, 0f64);
    let mut lo = 0;
    while lo < positions {
        let hi = (lo + chunk).min(positions);
        let t0 = Instant::now();
        let ls = logits(&mut served, &toks, &table, lo, hi)?;
        t_served += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let le = logits(&mut exact, &toks, &table, lo, hi)?;
        t_exact += t0.elapsed().as_secs_f64();
        for (i, (e, s)) in le.iter().zip(&ls).enumerate() {
            acc.add(e, s, toks[lo + i + 1] as usize);
        }
        lo = hi;
        eprint!("\r[fidelity] {lo}/{positions} positions");
    }
    eprintln!();
    let np = positions as f64;
    let mut sorted = acc.kls.clone();
    sorted.sort_by(f64::total_cmp);
    let stats = |i: usize, secs: f64| PathStats {
        mean_nll: acc.nll[i] / np,
        perplexity: (acc.nll[i] / np).exp(),
        top1_accuracy: acc.top1[i] as f64 / np,
        seconds: secs,
    };
    let (ex, sv) = (stats(0, t_exact), stats(1, t_served));
    let rep = FidelityReport {
        date: crate::peer::utc_now(),
        machine: crate::peer::machine_description(),
        model: path.display().to_string(),
        isa: cachet_kernels::isa::active().to_string(),
        threads: a.threads,
        tokens: n,
        positions,
        mean_kl: acc.kls.iter().sum::<f64>() / np,
        median_kl: quantile(&sorted, 0.5),
        p99_kl: quantile(&sorted, 0.99),
        max_kl: sorted.last().copied().unwrap_or(f64::NAN),
        top1_agreement: acc.agree as f64 / np,
        ppl_shift_pct: (sv.perplexity / ex.perplexity - 1.0) * 100.0,
        served: sv,
        exact: ex,
    };
    crate::doc::publish(
        &rep,
        a.output_json.as_deref(),
        a.doc.as_deref(),
        a.no_doc,
        DOC_SECTION,
        markdown,
        "fidelity",
    )?;
    Ok(rep)
}

pub fn table(r: &FidelityReport, markdown: bool) -> String {
    let header: Vec<String> = ["measure", "served", "exact", "served vs exact"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let rows = vec![
        vec![
            "perplexity".to_string(),
            format!("{:.4}", r.served.perplexity),
            format!("{:.4}", r.exact.perplexity),
            format!("{:+.2} %", r.ppl_shift_pct),
        ],
        vec![
            "top-1 = next token".to_string(),
            format!("{:.2} %", r.served.top1_accuracy * 100.0),
            format!("{:.2} %", r.exact.top1_accuracy * 100.0),
            String::new(),
        ],
        vec![
            "KL(exact ‖ served), nats: mean / median / p99 / max".to_string(),
            String::new(),
            String::new(),
            format!(
                "{:.4} / {:.4} / {:.4} / {:.4}",
                r.mean_kl, r.median_kl, r.p99_kl, r.max_kl
            ),
        ],
        vec![
            "top-1 agreement".to_string(),
            String::new(),
            String::new(),
            format!("{:.2} %", r.top1_agreement * 100.0),
        ],
        vec![
            "time (s)".to_string(),
            format!("{:.1}", r.served.seconds),
            format!("{:.1}", r.exact.seconds),
            String::new(),
        ],
    ];
    crate::report::render(&header, &rows, markdown)
}

pub fn markdown(r: &FidelityReport) -> String {
    format!(
        "_Generated by `cachet bench fidelity` on {} — rerun to refresh._\n\n- Machine: {}; kernels: {}, {} threads\n- Model: `{}`\n- Text: `tests/data/fidelity/keeper.txt`, {} tokens, {} positions compared; served = quantized weights, int8 activations, f16 KV; exact = weights dequantized to f32, f32 activations and KV\n\n{}",
        r.date,
        r.machine,
        r.isa,
        r.threads,
        r.model,
        r.tokens,
        r.positions,
        table(r, true)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two tokens: exact p = (1/2, 1/2), served q = (3/4, 1/4).
    /// KL(p‖q) = ½ ln(½ / ¾) + ½ ln(½ / ¼) = ½ ln(4/3) = 0.143841...
    #[test]
    fn kl_top1_and_nll_of_a_hand_computed_pair() {
        let exact = [0.0f32, 0.0];
        let served = [3f32.ln(), 0.0];
        let (le, ls) = (log_softmax(&exact), log_softmax(&served));
        assert!((le[0] - 0.5f64.ln()).abs() < 1e-12);
        assert!((ls[1] - 0.25f64.ln()).abs() < 1e-7);
        let k = kl(&le, &ls);
        assert!((k - 0.5 * (4.0f64 / 3.0).ln()).abs() < 1e-7, "{k}");
        assert_eq!(kl(&le, &le), 0.0);
        let mut acc = Acc::default();
        acc.add(&exact, &served, 1);
        // Exact ties rank the first token first, like the served path: they agree.
        assert_eq!(acc.agree, 1);
        assert!((acc.nll[0] - 2f64.ln()).abs() < 1e-12);
        assert!((acc.nll[1] - 4f64.ln()).abs() < 1e-7);
        assert_eq!(acc.top1, [0, 0]);
        acc.add(&served, &exact, 0);
        assert_eq!(acc.agree, 2);
        assert_eq!(acc.top1, [1, 1]);
    }

    #[test]
    fn quantiles_of_a_sorted_list() {
        let v: Vec<f64> = (0..101).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn the_text_is_several_thousand_words() {
        assert!(TEXT.split_whitespace().count() > 2000);
    }
}
