//! The pure engine core of cachet.
//!
//! Everything in this crate is synchronous and deterministic: no I/O, no clocks (time is passed
//! in as seconds by the caller), no threads, no tensors. It owns
//!
//! * [`block_pool::BlockPool`]: fixed KV blocks, ref counts, the O(1) LRU free queue and the
//!   hash → block map of the prefix cache;
//! * [`kv_manager::KvCacheManager`]: block tables, the capped longest-prefix lookup and slot
//!   allocation, each reporting its effects ([`kv_manager::KvEffects`]);
//! * [`scheduler::Scheduler`]: admission, continuous batching, chunked prefill, preemption by
//!   recompute and external loads — decisions only;
//! * [`sessions::SessionTable`]: parked block tables of resumable sessions;
//! * [`recorder::Recorder`]: every accounting number, from the effects the scheduler reports
//!   through [`observe::Observer`] (which gives nothing back to a decision);
//! * [`stats`]: the accounting types, the one counter table and the one place where totals
//!   become per-interval deltas;
//! * [`request`]: requests as the engine trusts them (validated once, against
//!   [`request::RequestLimits`]).
//!
//! The model sits behind [`exec::Executor`]; external KV tiers behind [`tier::KvLookup`].

pub mod block_pool;
pub mod events;
pub mod exec;
pub mod hash;
pub mod kv_manager;
pub mod observe;
pub mod recorder;
pub mod request;
pub mod scheduler;
pub mod sessions;
pub mod tier;
pub use scheduler::spec_decode;
pub mod stats;

pub use block_pool::BlockPool;
pub use exec::{BlockLoad, ExecBatch, ExecError, ExecOutput, Executor, Sampled, SeqChunk};
pub use hash::{BlockHash, HashSeed};
pub use kv_manager::KvCacheManager;
pub use observe::{Effect, Observer};
pub use recorder::{Recorder, Report};
pub use request::{
    tenant_label, FinishReason, RequestDraft, RequestLimits, SamplingParams, ValidRequest,
    DEFAULT_TENANT,
};
pub use scheduler::{Scheduler, SchedulerConfig, SchedulingPolicy};
pub use sessions::{SessionInfo, SessionStatus};
pub use stats::{FinishedRequestStats, PrefillStats, RequestTimes};

/// A token id of the model's vocabulary.
pub type TokenId = u32;
/// Index of a KV block in the pool (and in the executor's block arena).
pub type BlockId = u32;
