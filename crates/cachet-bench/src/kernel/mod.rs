//! `cachet bench kernel`: cachet's model executor driven directly (no scheduler, no HTTP)
//! beside llama.cpp's `llama-bench` / `llama-batched-bench` on the same file and threads.
//!
//! `cachet` drives the executor, `llama` runs and parses the peer's tools, [`roofline`]
//! measures the machine's limits and each phase's share of them, `render` writes the table;
//! this module holds the arguments, the report types and the run.

mod cachet;
mod llama;
mod render;
pub mod roofline;

use std::path::PathBuf;

use cachet_model::LoadOptions;
use clap::Args;
use serde::Serialize;

use crate::error::BenchError;
use crate::stats::mean_std;

pub use llama::{parse_batched_bench, parse_llama_bench};
pub use render::{markdown, table};

pub const DOC_SECTION: &str = "cachet-bench-kernel";
const BLOCK: usize = 16;

#[derive(Args, Clone, Debug)]
pub struct KernelArgs {
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 2, value_parser = crate::positive::<usize>)]
    pub threads: usize,
    /// Repetitions of each measurement (mean ± sample std reported).
    #[arg(long, default_value_t = 3, value_parser = crate::positive::<usize>)]
    pub reps: usize,
    /// Prefill length (llama-bench -p).
    #[arg(long, default_value_t = 512, value_parser = crate::positive::<usize>)]
    pub prompt: usize,
    /// Decode steps at batch 1 from an empty context (llama-bench -n).
    #[arg(long, default_value_t = 128, value_parser = crate::positive::<usize>)]
    pub gen: usize,
    /// Batch sizes for batched decode (aggregate tok/s).
    #[arg(long, value_delimiter = ',', default_value = "1,8,16,32", value_parser = crate::positive::<usize>)]
    pub batches: Vec<usize>,
    /// Context of each sequence before the timed batched decode steps
    /// (llama-batched-bench -npp).
    #[arg(long, default_value_t = 128, value_parser = crate::positive::<usize>)]
    pub batch_ctx: usize,
    /// Timed decode steps per batched measurement (llama-batched-bench -ntg).
    #[arg(long, default_value_t = 32, value_parser = crate::positive::<usize>)]
    pub batch_steps: usize,
    /// Context depth of the batch-1 long-context decode (llama-bench -d).
    #[arg(long, default_value_t = 1000, value_parser = crate::positive::<usize>)]
    pub depth: usize,
    /// Decode steps at --depth (llama-bench -n with -d).
    #[arg(long, default_value_t = 32, value_parser = crate::positive::<usize>)]
    pub depth_steps: usize,
    /// Prompt length of the cold vs cached TTFT measurement.
    #[arg(long, default_value_t = 1500, value_parser = crate::positive::<usize>)]
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
    /// Skip the roofline (machine limits and per-phase fractions of them).
    #[arg(long)]
    pub no_roofline: bool,
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
            no_roofline: false,
            doc: None,
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
    pub(crate) fn of(v: &[f64]) -> Rate {
        let (mean, std) = mean_std(v);
        Rate { mean, std }
    }
    pub(crate) fn show(self) -> String {
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
    /// Machine limits and per-phase fractions of them (absent with `--no-roofline`).
    pub roofline: Option<roofline::RooflineReport>,
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
    let roofline = if a.no_roofline {
        None
    } else {
        Some(roofline::roofline_side(a, &model)?)
    };
    let side = cachet::cachet_side(a, &model)?;
    drop(model);
    let mut cmds = Vec::new();
    let (llama, llama_error) = if a.no_llama {
        (Vec::new(), None)
    } else {
        match llama::llama_side(a, &path, &mut cmds) {
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
        roofline,
    };
    crate::doc::publish(
        &rep,
        a.output_json.as_deref(),
        a.doc.as_deref(),
        a.no_doc,
        DOC_SECTION,
        markdown,
        "kernel",
    )?;
    Ok(rep)
}
