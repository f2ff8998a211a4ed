//! The pure engine core of cachet.
//!
//! Everything in this crate is synchronous and deterministic: no I/O, no clocks (time is passed
//! in as seconds by the caller), no threads, no tensors. It owns
//!
//! * [`block_pool::BlockPool`]: fixed KV blocks, ref counts, the O(1) LRU free queue and the
//!   hash → block map of the prefix cache;
//! * [`kv_manager::KvCacheManager`]: block tables, the capped longest-prefix lookup, slot
//!   allocation and exact cache-creation attribution;
//! * [`scheduler::Scheduler`]: continuous batching, chunked prefill, preemption by recompute and
//!   the per-request [`stats::PrefillStats`];
//! * [`stats`]: monotonic totals and the one place where they become per-interval deltas.
//!
//! The model sits behind [`exec::Executor`]; external KV tiers behind [`connector::KvConnector`].

pub mod block_pool;
pub mod connector;
pub mod events;
pub mod exec;
pub mod hash;
pub mod kv_manager;
pub mod request;
pub mod scheduler;
pub mod stats;

pub use block_pool::BlockPool;
pub use exec::{ExecBatch, ExecError, Executor, Sampled, SeqChunk};
pub use hash::{BlockHash, HashSeed};
pub use kv_manager::KvCacheManager;
pub use request::{FinishReason, NewRequest, SamplingParams};
pub use scheduler::{Scheduler, SchedulerConfig, SchedulingPolicy};
pub use stats::{FinishedRequestStats, PrefillStats};

/// A token id of the model's vocabulary.
pub type TokenId = u32;
/// Index of a KV block in the pool (and in the executor's block arena).
pub type BlockId = u32;
