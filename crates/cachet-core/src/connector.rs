//! The seam for external KV tiers (host memory, disk, Redis; spec §2 step 2).
//!
//! At a request's first admission, after the local lookup, the scheduler asks the connector how
//! many of the blocks that follow the local hit it can supply. Those blocks are allocated locally
//! and listed in the step's [`crate::scheduler::SchedulerOutput::kv_loads`] for the executor to
//! fill instead of computing them. Implementations must answer without unbounded blocking.

use crate::hash::BlockHash;

pub trait KvConnector: Send {
    /// How many leading blocks of `hashes` (the blocks after the local hit) the tier holds.
    fn lookup(&mut self, hashes: &[BlockHash]) -> usize;
}
