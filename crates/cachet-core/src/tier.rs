//! The seam for external KV tiers (host memory, Redis; spec §2 step 2).
//!
//! At a request's first admission, after the local lookup, the scheduler asks the tier how many
//! of the blocks that follow the local hit it holds ([`KvLookup`]). Those blocks are allocated
//! locally and the request waits for them: the plan lists them as a [`KvLoadRequest`], the
//! engine fetches them (off the engine thread) and reports each block's outcome back
//! ([`crate::Scheduler::resolve_loads`]); the loaded bytes travel to the executor in the next
//! step's [`crate::exec::ExecBatch::loads`], which writes them into the blocks before any
//! attention reads them. Blocks that failed to load are computed instead.

use crate::hash::BlockHash;
use crate::BlockId;

/// Asked at first admission: how many leading blocks of `hashes` (the blocks after the local
/// hit, consecutive blocks of one prompt) the tier holds. Implementations answer within a
/// bound (a timeout), never block the engine indefinitely, and answer 0 when unsure.
pub trait KvLookup {
    fn lookup(&mut self, hashes: &[BlockHash]) -> usize;
}

/// The blocks one request waits for, to be fetched from the tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLoadRequest {
    pub slot: u32,
    /// The request's handle: a resolution naming another handle (the slot was reused after an
    /// abort) is ignored.
    pub handle: u64,
    /// The local blocks to fill and the hash each must hold, in table order.
    pub blocks: Vec<(BlockId, BlockHash)>,
}

/// Which tier supplied a loaded block (per-request metrics and the by-source counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TierTag {
    /// The host-memory tier.
    Host,
    /// A shared Redis (or Redis Cluster) tier.
    Redis,
    /// The local disk tier (files under `--kv-tier-disk-path`; survives a restart).
    Disk,
}

impl TierTag {
    pub fn as_str(self) -> &'static str {
        match self {
            TierTag::Host => "host",
            TierTag::Redis => "redis",
            TierTag::Disk => "disk",
        }
    }
}
