//! `cachet bench tiers`: what the external KV tiers buy, on the real model.
//!
//! 1. **Time to first token** of a prompt of `--prompt-tokens` (2,000) random token ids,
//!    through `cachet serve` over HTTP, five ways, in interleaved rounds (the order rotates each
//!    round): *computed* (a fresh prompt), *host* (the prompt's blocks were evicted from a pool
//!    that holds one prompt, into the host tier; loading it back evicts the filler prompt, whose
//!    blocks are copied to the host tier first), *host without spare buffers* (the same with
//!    `--kv-tier-spare-bytes 0`: those copies go into fresh allocations), *host saving on
//!    fill* (`--kv-tier-host-save filled`: every block was copied into the tier when it was
//!    computed, so the filler's eviction copies nothing), *Redis* (another
//!    instance computed the prompt and wrote it to a `redis-server` on loopback). Every loaded
//!    answer is checked: the same first token as computing, `floor((N-1)/16)*16` external
//!    tokens from the right tier.
//! 2. **Where the time goes** in a load, in-process (the same engine core, executor and tier
//!    client as the server, without HTTP): each engine step timed, the tier's own time, the
//!    copy of 124 blocks out of the arena, and the 16 tokens that are computed after a load.
//! 3. **Throughput of a shared-prefix workload** (`cachet bench serve`'s generator): one instance
//!    on every core; two instances of one thread each, behind one Redis (sessions split between
//!    them); and the same two without a shared tier.
//!
//! Writes section `cachet-bench-tiers` of a run file under `docs/bench-runs/` unless `--no-doc`.
//!
//! Files: [`ttft`] (part 1), [`breakdown`] (2), [`throughput`] (3), [`servers`] (the processes
//! and HTTP calls), [`rounds`] (the one interleaved-rounds loop all timings go through),
//! [`render`] (markdown).

mod breakdown;
mod render;
mod rounds;
mod servers;
mod throughput;
mod ttft;

use std::path::PathBuf;
use std::time::Duration;

use cachet_core::Executor;
use cachet_model::executor::{ExecutorConfig, KvDtype};
use cachet_model::LoadOptions;
use clap::Args;
use serde::Serialize;

use crate::error::BenchError;
use crate::rng::Rng;
use crate::serve::http_client;
use crate::stats::percentile_sorted;

pub use render::markdown;
pub use servers::scrape;
use servers::{Http, RedisProc};

const BLOCK: usize = 16;

#[derive(Args, Clone, Debug)]
pub struct TiersArgs {
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Tokens of the prompt whose time to first token is measured.
    #[arg(long, default_value_t = 2000)]
    pub prompt_tokens: usize,
    /// Interleaved rounds of the TTFT measurement (and of the in-process breakdown).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Compute threads of each single instance (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The `cachet` binary to serve with (default: this executable).
    #[arg(long)]
    pub cachet_bin: Option<PathBuf>,
    /// `redis-server` to start on a loopback port.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: PathBuf,
    /// Shared-prefix workload: users (sessions), split between the two instances.
    #[arg(long, default_value_t = 8)]
    pub users: usize,
    /// Shared-prefix workload: turns per user.
    #[arg(long, default_value_t = 2)]
    pub turns: usize,
    /// Shared-prefix workload: tokens of the shared system prompt.
    #[arg(long, default_value_t = 1500)]
    pub system_tokens: usize,
    /// Shared-prefix workload: output tokens per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Skip the shared-prefix throughput part.
    #[arg(long)]
    pub no_throughput: bool,
    /// Skip the in-process breakdown.
    #[arg(long)]
    pub no_breakdown: bool,
    /// Markdown file whose marked section gets the results (default: a run file of its own,
    /// docs/bench-runs/<date>-<cpu>-<topic>.md).
    #[arg(long)]
    pub doc: Option<PathBuf>,
    /// Do not write the run file.
    #[arg(long)]
    pub no_doc: bool,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    #[arg(long, default_value = "/tmp/cachet-bench-logs")]
    pub log_dir: PathBuf,
}

/// Milliseconds of one case over the rounds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Spread {
    pub samples: Vec<f64>,
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    fn of(samples: Vec<f64>) -> Spread {
        let mut v = samples.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let p = |q| percentile_sorted(&v, q).unwrap_or(f64::NAN);
        Spread {
            median: p(50.0),
            p10: p(10.0),
            p90: p(90.0),
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
            samples,
        }
    }
}

/// One TTFT case: the server's `time_to_first_token_ms` and the client's wall time.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TtftCase {
    pub name: String,
    pub server_ms: Spread,
    pub client_ms: Spread,
    /// External tokens of each loaded answer (0 for computing).
    pub external_tokens: Vec<u64>,
}

/// One phase of the in-process breakdown.
#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub name: String,
    pub ms: Spread,
}

#[derive(Clone, Debug, Serialize)]
pub struct ThroughputRow {
    pub name: String,
    pub requests: usize,
    pub duration_s: f64,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
    pub cached_fraction: f64,
    /// Prompt tokens loaded from Redis (from the instances' `/metrics`).
    pub redis_tokens: u64,
    pub ttft_p50_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TiersReport {
    pub model: String,
    pub prompt_tokens: usize,
    pub loaded_tokens: usize,
    pub rounds: usize,
    pub threads: usize,
    pub cpus: usize,
    pub block_bytes: u64,
    pub ttft: Vec<TtftCase>,
    pub breakdown: Vec<Phase>,
    pub throughput: Vec<ThroughputRow>,
    /// Why the shared-prefix workload has no rows, when it failed.
    pub throughput_error: Option<String>,
    pub load_average: String,
}

fn err(msg: impl Into<String>) -> BenchError {
    BenchError::Peer(msg.into())
}

/// `n` random token ids of a prompt that shares nothing with another seed's.
fn prompt_ids(seed: u64, n: usize) -> Vec<u32> {
    let mut r = Rng::derive(seed, &[0x71e5]);
    (0..n).map(|_| 1000 + r.below(39_000) as u32).collect()
}

/// The host case's pool: the prompt's blocks and one more, so that a filler prompt of
/// [`filler_tokens`] takes every block (the prompt is evicted whole, into the host tier) and
/// loading the prompt back evicts the filler in turn.
fn host_pool_blocks(n: usize) -> usize {
    n.div_ceil(BLOCK) + 1
}

/// The longest prompt the host pool holds (its KV fills every block; one token left for the
/// generated one).
fn filler_tokens(n: usize) -> usize {
    host_pool_blocks(n) * BLOCK - 1
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

// --- the run ---------------------------------------------------------------------------------

pub async fn bench_tiers(a: &TiersArgs) -> Result<TiersReport, BenchError> {
    let model = a
        .model
        .clone()
        .unwrap_or_else(cachet_model::default_model_path);
    if !model.exists() {
        return Err(err(format!(
            "model {} not found (make model)",
            model.display()
        )));
    }
    let bin = match &a.cachet_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe().map_err(|e| BenchError::io("finding this binary", e))?,
    };
    let http = Http {
        client: http_client(Duration::from_secs(600))?,
    };
    let redis = RedisProc::start(&a.redis_server, &a.log_dir)?;
    let ttft = ttft::ttft_part(a, &bin, &model, &redis, &http).await?;

    let loaded = cachet_model::load_model(
        &model,
        &LoadOptions {
            threads: a.threads,
            full_fingerprint: true,
            ..LoadOptions::default()
        },
    )?;
    let block_bytes = loaded
        .executor(ExecutorConfig {
            block_size: BLOCK,
            num_blocks: 1,
            kv_dtype: KvDtype::F16,
        })?
        .block_bytes() as u64;
    let breakdown = if a.no_breakdown {
        Vec::new()
    } else {
        let redis2 = RedisProc::start(&a.redis_server, &a.log_dir)?;
        tokio::task::block_in_place(|| breakdown::breakdown_part(a, &loaded, &redis2))?
    };
    drop(redis);
    let mut throughput_error = None;
    let throughput = if a.no_throughput {
        Vec::new()
    } else {
        // A failed workload does not lose the TTFT figures: it is reported beside them.
        match throughput::throughput_part(a, &bin, &model, &a.redis_server, &http).await {
            Ok(rows) => rows,
            Err(e) => {
                eprintln!("[tiers] shared-prefix workload failed: {e}");
                throughput_error = Some(e.to_string());
                Vec::new()
            }
        }
    };
    let report = TiersReport {
        model: loaded.info.name.clone(),
        prompt_tokens: a.prompt_tokens,
        loaded_tokens: (a.prompt_tokens - 1) / BLOCK * BLOCK,
        rounds: a.rounds,
        threads: loaded.threads,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        block_bytes,
        ttft,
        breakdown,
        throughput,
        throughput_error,
        load_average: load_average(),
    };
    crate::doc::publish(
        &report,
        a.output_json.as_deref(),
        a.doc.as_deref(),
        a.no_doc,
        "cachet-bench-tiers",
        markdown,
        "tiers",
    )?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::servers::scrape;

    #[test]
    fn scrape_sums_matching_series() {
        let text = "# HELP x y\nvllm:a_total{model_name=\"m\",tier=\"redis\"} 3\nvllm:a_total{model_name=\"m\",tier=\"host\"} 4\nvllm:ab_total 100\n";
        assert_eq!(scrape(text, "vllm:a_total", &[]), 7.0);
        assert_eq!(scrape(text, "vllm:a_total", &[("tier", "host")]), 4.0);
        assert_eq!(scrape(text, "vllm:missing", &[]), 0.0);
    }

    #[test]
    fn prompts_are_distinct_and_in_range() {
        let a = prompt_ids(1, 2000);
        let b = prompt_ids(2, 2000);
        assert_eq!(a.len(), 2000);
        assert_ne!(a[..16], b[..16]);
        assert!(a.iter().all(|t| (1000..40_000).contains(t)));
        assert_eq!(a, prompt_ids(1, 2000));
    }

    #[test]
    fn spread_of_five() {
        let s = Spread::of(vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 5.0));
        assert!((s.p10 - 1.4).abs() < 1e-12 && (s.p90 - 4.6).abs() < 1e-12);
    }
}
