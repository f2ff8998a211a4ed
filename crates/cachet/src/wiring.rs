//! Build an engine (threaded or offline) from [`EngineArgs`].

use std::sync::Arc;
use std::time::Duration;

use cachet_core::{SchedulerConfig, SchedulingPolicy};
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::{EngineConfig, ModelInfo};
use cachet_model::executor::{ExecutorConfig, KvDtype, LlamaExecutor};
use cachet_model::{LoadOptions, LoadedModel};
use cachet_text::{ByteTokenizer, TextTokenizer};
use thiserror::Error;

use crate::args::{EngineArgs, ExecutorKind, Policy};

#[derive(Debug, Error)]
pub enum WiringError {
    #[error("unknown --kv-cache-dtype {0:?} (expected f16 or f32)")]
    KvDtype(String),
    #[error("model file {0} not found (run `make model` to fetch the default model)")]
    MissingModel(String),
    #[error(transparent)]
    Model(#[from] cachet_model::ModelError),
    #[error("invalid engine settings: {0}")]
    Invalid(String),
    #[error(transparent)]
    Tier(#[from] cachet_tiers::TierError),
}

/// An executor of either kind, behind one type.
pub enum AnyExecutor {
    Sim(SimExecutor),
    Model(Box<LlamaExecutor>),
}

impl cachet_core::Executor for AnyExecutor {
    fn model_fingerprint(&self) -> [u8; 32] {
        match self {
            AnyExecutor::Sim(e) => e.model_fingerprint(),
            AnyExecutor::Model(e) => e.model_fingerprint(),
        }
    }
    fn kv_layout(&self) -> String {
        match self {
            AnyExecutor::Sim(e) => e.kv_layout(),
            AnyExecutor::Model(e) => e.kv_layout(),
        }
    }
    fn block_bytes(&self) -> usize {
        match self {
            AnyExecutor::Sim(e) => e.block_bytes(),
            AnyExecutor::Model(e) => e.block_bytes(),
        }
    }
    fn save_block(
        &self,
        block: cachet_core::BlockId,
        out: &mut Vec<u8>,
    ) -> Result<(), cachet_core::ExecError> {
        match self {
            AnyExecutor::Sim(e) => e.save_block(block, out),
            AnyExecutor::Model(e) => e.save_block(block, out),
        }
    }
    fn save_blocks(
        &self,
        blocks: &[cachet_core::BlockId],
        outs: &mut [Vec<u8>],
    ) -> Vec<Result<(), cachet_core::ExecError>> {
        match self {
            AnyExecutor::Sim(e) => e.save_blocks(blocks, outs),
            AnyExecutor::Model(e) => e.save_blocks(blocks, outs),
        }
    }
    fn execute(
        &mut self,
        batch: &cachet_core::ExecBatch<'_>,
    ) -> Result<cachet_core::ExecOutput, cachet_core::ExecError> {
        match self {
            AnyExecutor::Sim(e) => e.execute(batch),
            AnyExecutor::Model(e) => e.execute(batch),
        }
    }
}

/// Everything needed to start an engine.
pub struct Built {
    pub executor: AnyExecutor,
    pub engine: EngineConfig,
    /// The KV element type's name (for `vllm:cache_config_info`).
    pub kv_cache_dtype: String,
    pub model: ModelInfo,
    pub tokenizer: Arc<dyn TextTokenizer>,
    pub loaded: Option<LoadedModel>,
}

fn scheduler_config(
    a: &EngineArgs,
    num_blocks: usize,
    max_model_len: usize,
    eos: Vec<u32>,
) -> SchedulerConfig {
    #[allow(clippy::needless_update)]
    SchedulerConfig {
        block_size: a.block_size,
        num_blocks,
        max_num_batched_tokens: a.max_num_batched_tokens,
        max_num_seqs: a.max_num_seqs,
        long_prefill_token_threshold: a.long_prefill_token_threshold,
        max_model_len,
        enable_prefix_caching: !a.no_enable_prefix_caching,
        policy: match a.scheduling_policy {
            Policy::Fcfs => SchedulingPolicy::Fcfs,
            Policy::Priority => SchedulingPolicy::Priority,
        },
        eos_token_ids: eos,
        max_waiting_requests: a.max_waiting_requests,
        session_idle_timeout_s: a.session_idle_timeout,
        session_kv_budget_blocks: a.session_kv_budget,
        speculative: a.spec_config(),
        ..SchedulerConfig::default()
    }
}

/// The simulator's scripted reply (`--sim-reply`, `--sim-reply-file`) in byte tokens.
fn sim_reply(a: &EngineArgs) -> Result<Option<Vec<u32>>, WiringError> {
    let text = match (&a.sim_reply, &a.sim_reply_file) {
        (Some(t), _) => t.clone(),
        (None, Some(path)) => std::fs::read_to_string(path).map_err(|e| {
            WiringError::Invalid(format!("--sim-reply-file {}: {e}", path.display()))
        })?,
        (None, None) => return Ok(None),
    };
    ByteTokenizer
        .encode(&text, false)
        .map(Some)
        .map_err(|e| WiringError::Invalid(format!("--sim-reply: {e}")))
}

pub fn build(a: &EngineArgs) -> Result<Built, WiringError> {
    if a.block_size == 0 || a.max_num_batched_tokens == 0 || a.max_num_seqs == 0 {
        return Err(WiringError::Invalid(
            "--block-size, --max-num-batched-tokens and --max-num-seqs must be positive".into(),
        ));
    }
    if let Some(spec) = a.spec_config() {
        spec.check_ngram_range().map_err(WiringError::Invalid)?;
    }
    match a.executor {
        ExecutorKind::Sim => {
            let num_blocks = a.num_kv_blocks.unwrap_or(4096);
            let max_model_len = a.max_model_len.unwrap_or(8192);
            let reply = sim_reply(a)?;
            let sim = SimExecutor::new(SimConfig {
                num_blocks,
                block_size: a.block_size,
                eos_at_output: a.sim_eos_at_output,
                prefill_cost_per_token: Duration::from_micros(a.sim_prefill_us_per_token),
                decode_cost_per_seq: Duration::from_micros(a.sim_decode_us_per_seq),
                panic_on: a
                    .sim_panic_on
                    .as_deref()
                    .and_then(|t| ByteTokenizer.encode(t, false).ok()),
                reply,
                ..Default::default()
            });
            let tok = ByteTokenizer;
            let eos = tok.eos_token_ids().to_vec();
            Ok(Built {
                executor: AnyExecutor::Sim(sim),
                engine: EngineConfig {
                    scheduler: scheduler_config(a, num_blocks, max_model_len, eos),
                },
                kv_cache_dtype: "u64".into(),
                model: ModelInfo {
                    name: "cachet-sim".into(),
                    max_model_len,
                    block_size: a.block_size,
                    num_kv_blocks: num_blocks,
                },
                tokenizer: Arc::new(tok),
                loaded: None,
            })
        }
        ExecutorKind::Model => {
            let path = a
                .model
                .clone()
                .unwrap_or_else(cachet_model::default_model_path);
            if !path.exists() {
                return Err(WiringError::MissingModel(path.display().to_string()));
            }
            let kv_dtype = KvDtype::parse(&a.kv_cache_dtype)
                .ok_or_else(|| WiringError::KvDtype(a.kv_cache_dtype.clone()))?;
            let loaded = cachet_model::load_model(
                &path,
                &LoadOptions {
                    threads: a.threads,
                    progress: true,
                    full_fingerprint: true,
                    ..LoadOptions::default()
                },
            )?;
            let num_blocks = a.num_kv_blocks.unwrap_or_else(|| {
                loaded.num_blocks_for_memory(a.kv_cache_memory, a.block_size, kv_dtype)
            });
            if num_blocks == 0 {
                return Err(WiringError::Invalid(
                    "the KV cache holds no block: raise --kv-cache-memory".into(),
                ));
            }
            let max_model_len = a
                .max_model_len
                .unwrap_or(loaded.info.context_length)
                .min(num_blocks * a.block_size);
            let exec = loaded.executor(ExecutorConfig {
                block_size: a.block_size,
                num_blocks,
                kv_dtype,
            })?;
            let tok = loaded.tokenizer.clone();
            let eos = tok.eos_token_ids().to_vec();
            tracing::info!(
                model = %loaded.info.name,
                arch = %loaded.info.architecture,
                num_blocks,
                block_size = a.block_size,
                kv_dtype = kv_dtype.as_str(),
                max_model_len,
                threads = loaded.threads,
                isa = %cachet_kernels::isa::active(),
                amx = %cachet_kernels::isa::amx_status(),
                "model loaded"
            );
            Ok(Built {
                executor: AnyExecutor::Model(Box::new(exec)),
                engine: EngineConfig {
                    scheduler: scheduler_config(a, num_blocks, max_model_len, eos),
                },
                kv_cache_dtype: kv_dtype.as_str().into(),
                model: ModelInfo {
                    // The file's stem: a name a person can guess (`general.name` is often not).
                    name: path
                        .file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_else(|| loaded.info.name.clone()),
                    max_model_len,
                    block_size: a.block_size,
                    num_kv_blocks: num_blocks,
                },
                tokenizer: Arc::new(tok),
                loaded: Some(loaded),
            })
        }
    }
}

/// The external KV tiers of `--kv-tier*` for this executor, or `None` without `--kv-tier`.
///
/// The namespace is what seeds the block hashes: the executor's model fingerprint, its KV
/// layout and the block size, so every instance serving the same model with the same layout
/// finds what another stored, and nothing else does. Redis being unreachable is not an error
/// (the tier comes up when it answers); a bad flag is.
pub fn open_tier(
    args: &cachet_tiers::TierArgs,
    executor: &AnyExecutor,
    block_size: usize,
) -> Result<Option<cachet_tiers::TierClient>, WiringError> {
    use cachet_core::Executor;
    let namespace = cachet_tiers::TierNamespace {
        model_fingerprint: executor.model_fingerprint(),
        kv_layout: executor.kv_layout(),
        block_size: u32::try_from(block_size)
            .map_err(|_| WiringError::Invalid("--block-size is too large".into()))?,
    };
    let Some(cfg) = args.to_config(namespace)? else {
        return Ok(None);
    };
    let host = cfg.host.as_ref().map(|h| h.capacity_bytes);
    let disk = cfg.disk.as_ref().map(|d| d.dir.display().to_string());
    let redis = cfg.redis.as_ref().map(|r| r.target.display());
    let signed = cfg.redis.as_ref().is_some_and(|r| r.secret.is_some())
        || cfg.disk.as_ref().is_some_and(|d| d.secret.is_some());
    let client = cachet_tiers::TierClient::open(cfg)?;
    tracing::info!(
        host_bytes = host.map(|b| b.to_string()).unwrap_or_else(|| "off".into()),
        redis = redis.as_deref().unwrap_or("off"),
        disk = disk.as_deref().unwrap_or("off"),
        redis_up = client.redis_up(),
        signed,
        block_bytes = executor.block_bytes(),
        kv_layout = %client.namespace().kv_layout,
        "external KV tiers configured"
    );
    Ok(Some(client))
}

/// Host-tier capacity in blocks (`vllm:cache_config_info`'s `num_cpu_blocks`).
pub fn host_tier_blocks(args: &cachet_tiers::TierArgs, executor: &AnyExecutor) -> Option<usize> {
    use cachet_core::Executor;
    let spec = args.kv_tier?;
    let per_block = executor.block_bytes().max(1) as u64;
    spec.host
        .then(|| usize::try_from(args.kv_tier_host_bytes / per_block).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_core::Executor;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        tiers: cachet_tiers::TierArgs,
    }

    fn sim() -> AnyExecutor {
        let built = build(&EngineArgs::default()).unwrap();
        built.executor
    }

    /// An n-gram range that matches nothing is refused, not silently widened.
    #[test]
    fn an_empty_ngram_range_is_refused() {
        let spec = |min, max| EngineArgs {
            speculative: Some(crate::args::Speculative::Ngram),
            spec_ngram_min: min,
            spec_ngram_max: max,
            ..EngineArgs::default()
        };
        for (min, max) in [(0, 4), (3, 2)] {
            let Err(WiringError::Invalid(msg)) = build(&spec(min, max)) else {
                panic!("--spec-ngram-min {min} --spec-ngram-max {max} was accepted");
            };
            assert!(msg.contains(&format!("got {min} and {max}")), "{msg}");
        }
        assert!(build(&spec(3, 3)).is_ok());
        assert_eq!(
            spec(3, 3)
                .spec_config()
                .map(|c| (c.prompt_lookup_min, c.prompt_lookup_max)),
            Some((3, 3))
        );
    }

    #[test]
    fn the_tier_namespace_is_the_executors() {
        let exec = sim();
        let none = Cli::parse_from(["x"]);
        assert!(open_tier(&none.tiers, &exec, 16).unwrap().is_none());
        assert_eq!(host_tier_blocks(&none.tiers, &exec), None);

        let host = Cli::parse_from(["x", "--kv-tier", "host", "--kv-tier-host-bytes", "1M"]);
        let c = open_tier(&host.tiers, &exec, 16).unwrap().unwrap();
        assert_eq!(c.namespace().model_fingerprint, exec.model_fingerprint());
        assert_eq!(c.namespace().kv_layout, "sim:u64");
        assert_eq!(c.namespace().block_size, 16);
        assert!(c.has(cachet_tiers::TierKind::Host) && !c.has(cachet_tiers::TierKind::Redis));
        // 1 MiB of 128-byte simulator blocks (16 tokens x 8 bytes).
        assert_eq!(host_tier_blocks(&host.tiers, &exec), Some(8192));

        let no_url = Cli::parse_from(["x", "--kv-tier", "redis"]);
        assert!(matches!(
            open_tier(&no_url.tiers, &exec, 16),
            Err(WiringError::Tier(_))
        ));
    }
}
