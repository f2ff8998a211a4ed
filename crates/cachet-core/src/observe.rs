//! The boundary between decisions and observations.
//!
//! The scheduler decides (admit, plan, preempt, park) and reports each decision's effects as an
//! [`Effect`] to an [`Observer`]. Every method of the trait returns nothing, and the scheduler
//! only knows its observer as `O: Observer`, so no decision can read anything an observer
//! computed: telemetry observes and never decides, by construction of the types. The recorder
//! ([`crate::recorder::Recorder`]) is the observer that turns effects into every accounting
//! number; `()` observes nothing (reporting off).

use std::sync::Arc;

use crate::block_pool::BlockPool;
use crate::hash::BlockHash;
use crate::kv_manager::KvEffects;
use crate::request::FinishReason;
use crate::sessions::SessionInfo;
use crate::tier::TierTag;
use crate::{BlockId, TokenId};

/// What the scheduler found when it looked a request's prompt up (first admission, or
/// re-admission after a preemption).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lookup {
    /// `N`: the prompt tokens the lookup covered (what the query counters add).
    pub queried_tokens: usize,
    /// Tokens of the leading full blocks found in the local cache, capped at `N-1`.
    pub local_hit_tokens: usize,
    /// Whether an external tier was consulted (first admissions only).
    pub external_consulted: bool,
    /// Tokens the tier said it holds after the local hit: being loaded now.
    pub external_pending_tokens: usize,
}

/// One effect of a scheduler decision, borrowed from the scheduler's state for the duration of
/// the call.
#[derive(Debug)]
pub enum Effect<'a> {
    /// A request joined the waiting queue.
    Arrived {
        slot: u32,
        handle: u64,
        label: &'a Arc<str>,
        prompt_len: usize,
        max_tokens: u32,
        arrival: f64,
        cache_salt: Option<&'a str>,
        adapter: Option<&'a str>,
        /// Who the request is accounted to (resolved by validation: never the salt itself).
        tenant: &'a Arc<str>,
        /// Set for a session turn: how the session table served it.
        session: Option<&'a SessionInfo>,
        /// A router's predicted cached prefix, in tokens (observed only).
        predicted_tokens: Option<u64>,
    },
    /// The request's blocks were allocated and it joined the running batch (or, with external
    /// loads pending, started waiting for them).
    Admitted {
        slot: u32,
        now: f64,
        /// First admission (false: re-admission after a preemption).
        first: bool,
        /// `None` when no lookup happened (cache off, skipped by the request, or a session
        /// continuation).
        lookup: Option<Lookup>,
        /// Tokens retained from earlier session turns (not looked up, not computed).
        retained: usize,
        /// Tokens whose KV exists once the admission is done (retained + local hit).
        num_computed: usize,
        kv: &'a KvEffects,
        /// The request's tokens.
        tokens: &'a [TokenId],
        /// With a lookup: the hashes of every full prompt block (block `i` at index `i`).
        hashes: &'a [BlockHash],
        /// The block table after the admission (hits first).
        blocks: &'a [BlockId],
        /// The pool after the admission, read-only.
        pool: &'a BlockPool,
    },
    /// A request's external loads resolved: the leading blocks listed in `sources` (the tier
    /// each came from) arrived intact and count as loaded; the `failed_tokens` after them will
    /// be computed.
    LoadsResolved {
        slot: u32,
        sources: &'a [TierTag],
        failed_tokens: usize,
    },
    /// Blocks were allocated for a running request's next chunk (the last `kv.allocated`
    /// entries of `blocks`).
    Allocated {
        slot: u32,
        kv: &'a KvEffects,
        blocks: &'a [BlockId],
        /// The pool after the allocation, read-only.
        pool: &'a BlockPool,
    },
    /// The request lost its blocks and went back to the waiting queue.
    Preempted { slot: u32 },
    /// A chunk's KV was written (or its loaded blocks committed). `prefill` while the request
    /// has no output token yet. Reported for every prefill chunk, and for decode chunks only
    /// when a block became full.
    Computed {
        slot: u32,
        now: f64,
        prefill: bool,
        kv: &'a KvEffects,
        /// The request's block hashes (block `i` at index `i`).
        hashes: &'a [BlockHash],
        /// The request's tokens (prompt and output).
        tokens: &'a [TokenId],
        /// The request's block table.
        blocks: &'a [BlockId],
        /// The pool after the commit, read-only.
        pool: &'a BlockPool,
    },
    /// Sequence `child` was forked from `parent` at its first token (n > 1): it shares the
    /// prompt's blocks, and its first token (the fork's draw) exists.
    Forked {
        parent: u32,
        child: u32,
        /// The child's sequence number (1 to n - 1; the parent is sequence 0).
        seq: u32,
        now: f64,
        /// The block the child got for its copy of the partial last block, if any.
        kv: &'a KvEffects,
        /// The child's block table.
        blocks: &'a [BlockId],
        /// The pool after the fork, read-only.
        pool: &'a BlockPool,
    },
    /// A token was appended to the request (`first`: its first output token). `same_step`: a
    /// token after an accepted draft, committed in the same step as the request's previous
    /// token — a generated token, but no inter-token interval of its own (vLLM observes the
    /// inter-token latency once per step and request).
    Sampled {
        slot: u32,
        now: f64,
        first: bool,
        same_step: bool,
    },
    /// The request ended; its slot is free after this call.
    Finished {
        slot: u32,
        now: f64,
        reason: FinishReason,
        generation_tokens: usize,
        /// A session turn that kept its KV for the next turn.
        parked: bool,
    },
    /// A parked session's KV was released (closed, expired or over budget).
    SessionReleased { session_id: &'a Arc<str> },
    /// Every prefix-cache entry of the local pool was dropped: `dropped`, in free-queue order
    /// (the one that would have been evicted next first).
    CacheReset { dropped: &'a [BlockHash] },
}

/// Receives the scheduler's effects. Implementations must not panic on any sequence the
/// scheduler can produce, and give nothing back.
pub trait Observer {
    fn observe(&mut self, effect: Effect<'_>);
}

/// Reporting off.
impl Observer for () {
    #[inline(always)]
    fn observe(&mut self, _: Effect<'_>) {}
}

/// An optional observer (reporting switched at run time).
impl<O: Observer> Observer for Option<O> {
    #[inline(always)]
    fn observe(&mut self, effect: Effect<'_>) {
        if let Some(o) = self {
            o.observe(effect);
        }
    }
}
