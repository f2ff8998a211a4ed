//! The engine around the pure core.
//!
//! * [`step::EngineCore`]: one step (resolve loads → plan → offload → execute → update →
//!   save → report), shared by the threaded engine and the offline API.
//! * [`start_engine`] spawns the core thread (`thread`), which owns the core and the executor;
//!   [`EngineHandle`] is the async handle the server uses, [`RequestStream`] one request's
//!   outputs. Requests are named by engine-assigned [`RequestHandle`]s.
//! * The engine's life is an [`EngineState`]: running, draining, dead (the core thread
//!   panicked) or stopped.
//! * [`tier::KvTier`]: the engine's side of an external KV tier.
//! * [`offline::OfflineEngine`] runs requests to completion on the calling thread.
//! * [`sim`] is the deterministic simulated model.
//!
//! The engine sees token ids only: the text side (tokenizer, templates, detokenizing, stop
//! strings) is `cachet-text`'s, held by the server.
//! * Stat loggers ([`StatLogger`]) receive one [`StepStats`] per step with per-interval deltas.

mod handle;
pub mod inspect;
pub mod offline;
pub mod sim;
pub mod step;
mod thread;
pub mod tier;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use cachet_core::recorder::InsightConfig;
pub use cachet_core::recorder::{ExternalSources, SessionTotals};
pub use cachet_core::scheduler::AddError;
pub use cachet_core::stats::{
    CounterDeltas, FinishedRequestStats, Gauges, HitRates, PrefillStats, TenantDelta,
};
pub use cachet_core::{
    Executor, FinishReason, Report, RequestDraft, RequestLimits, RequestTimes, Sampled,
    SamplingParams, SchedulerConfig, SessionInfo, SessionStatus, ValidRequest,
};
pub use handle::{
    AddRequestError, EngineFailure, EngineHandle, EngineState, RequestHandle, RequestOutput,
    RequestStream,
};

use step::{CoreOptions, EngineCore};

/// What a stat logger receives after each step that changed anything.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    pub deltas: CounterDeltas,
    pub gauges: Gauges,
    pub finished: Vec<FinishedRequestStats>,
    pub ttft_s: Vec<f64>,
    pub itl_s: Vec<f64>,
    /// Tokens scheduled in this step (absent in steps that only finished or aborted requests).
    pub iteration_tokens: Option<u64>,
    /// Per-tenant increments (only tenants whose numbers moved).
    pub tenants: Vec<TenantDelta>,
    /// Hit rates since the start, measured and estimated for larger pools.
    pub hit_rates: HitRates,
    /// Speculative decoding: this step's drafts (zero with speculation off).
    pub spec: cachet_core::spec_decode::SpecDecodeStats,
}

/// Observes the engine. Called on the engine thread: keep it cheap, never block.
pub trait StatLogger: Send {
    fn record(&mut self, step: &StepStats);
}

/// Static facts about the served model.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_kv_blocks: usize,
}

#[derive(Clone, Debug, Default)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("could not start the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// Spawn the core thread.
pub fn start_engine<E: Executor + 'static>(
    cfg: EngineConfig,
    executor: E,
    model: ModelInfo,
    opts: CoreOptions,
) -> Result<EngineHandle, EngineError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let shared = std::sync::Arc::new(handle::Shared::new(cfg.clone(), model));
    let core = EngineCore::new(cfg.scheduler.clone(), executor, opts);
    let sh = shared.clone();
    std::thread::Builder::new()
        .name("cachet-core".into())
        .spawn(move || thread::run(core, rx, sh))?;
    Ok(EngineHandle { tx, shared })
}
