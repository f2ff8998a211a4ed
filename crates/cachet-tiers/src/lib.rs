//! External KV tiers for cachet (spec §2 step 2, §6): everything from "here are block hashes"
//! to bytes in host memory or Redis and back, off the engine thread.
//!
//! * **host** — a least-recently-used map bounded by payload bytes
//!   (`--kv-tier-host-bytes`); the engine saves blocks into it when its local pool evicts them,
//!   or, with `--kv-tier-host-save filled`, when they are filled ([`HostSave`]).
//! * **redis** — one server (`redis://`, `rediss://`) or a Redis Cluster (a comma-separated list
//!   of nodes). Keys carry the model fingerprint, KV layout, block size and block hash, so every
//!   instance serving the same model finds what another computed ([`format`]). Values carry a
//!   format version, the namespace and a BLAKE3 checksum; with `--kv-tier-secret` an
//!   HMAC-SHA256 too, and then unsigned or wrongly signed values are refused. Saves are
//!   write-behind through a bounded queue; every call is bounded by `--kv-tier-timeout-ms`.
//! * **disk** — one file per block under a directory, in the Redis value format, bounded by
//!   `--kv-tier-disk-bytes`, surviving a restart ([`disk`]).
//! * **host,disk,redis** (any subset) — stacked: lookups and loads take what the host tier
//!   holds, then what the disk holds, then ask Redis for the rest.
//!
//! The engine holds a [`TierClient`]: [`TierClient::lookup`] at a request's first admission,
//! [`TierClient::start_load`] + [`TierClient::poll`] to fill the blocks it allocated for the hit,
//! [`TierClient::save`] for evicted (host) and newly computed (Redis) blocks, and
//! [`TierClient::stats`] for metrics. [`EngineTier`] adapts it to the engine's
//! `cachet_engine::tier::KvTier`.
//!
//! **Faults.** Redis down at start, killed, slow, returning refused values, a cluster node
//! failing over: the client keeps answering (lookups without Redis, loads with per-block
//! [`LoadError`]s), logs each state change once, and a prober reconnects when Redis returns.
//! While Redis is down, lookups and loads skip it without waiting for a timeout.
//!
//! **Byte budget.** A shared Redis' total is its own `maxmemory` (with an eviction policy such
//! as `volatile-lru`: every value we write has a TTL). What one instance can promise without
//! coordinating with the others is a bound on its own share: `--kv-tier-redis-bytes` caps the
//! value bytes it wrote within the last TTL, and since each value expires one TTL after its
//! write, the instance never holds more than that in Redis (N instances: at most N times).
//! Saves over the budget are skipped and counted.

pub mod buffers;
pub mod config;
pub mod disk;
pub mod disk_sessions;
pub mod engine;
pub mod format;
pub mod host;
pub mod stats;

mod client;
mod health;
mod raw_mget;
mod redis_conn;

pub use buffers::{BufferPool, BufferStats};
pub use cachet_core::BlockHash;
pub use client::{LoadDone, SaveTarget, TierClient, TierKind};
pub use config::{
    DiskConfig, HostConfig, HostSave, RedisConfig, RedisTarget, Secret, TierArgs, TierConfig,
    TierSpec, DEFAULT_SPARE_BYTES,
};
pub use engine::EngineTier;
pub use format::{CorruptKind, LoadError, TierNamespace};
pub use stats::{Histogram, LatencyHistogram, LoadFailures, TierIoStats, TierStats};

/// One block's KV as the executor serializes it (opaque bytes; the layout is named by
/// [`TierNamespace::kv_layout`]). Cloning shares the bytes.
pub type Payload = bytes::Bytes;

/// Errors of [`TierClient::open`] and of turning flags into a [`TierConfig`].
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("KV tier configuration: {0}")]
    Config(String),
    #[error("cannot start the KV tier runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The disk tier's directory cannot be used (another instance holds it, it is not
    /// writable); the message names the directory and the cause in one line.
    #[error("disk KV tier: {0}")]
    DiskUnusable(String),
}
