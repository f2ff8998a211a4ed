//! A request's block lifecycle (`GET /v1/cache/requests/{id}`): the events as the step records
//! them (32-byte [`Ev`]s whose evicted-entry owners are ids of the block index's
//! [`Creators`]), and what the inspector is answered ([`BlockEvent`], [`RequestLifecycle`]).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::blocks::{Creators, NONE};
use crate::request::FinishReason;
use crate::stats::PrefillStats;
use crate::BlockId;

/// What happened to one block of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockEventKind {
    /// The lookup found it in the local cache.
    Hit,
    /// Its KV came from the external tier.
    Loaded,
    /// Taken from the free pool for the request.
    Allocated,
    /// Became full with KV computed or loaded for the request.
    Filled,
    /// The entry it held was dropped to make room for this request.
    Evicted,
    /// The request lost its blocks (recomputed later).
    Preempted,
}

/// One entry of a request's block lifecycle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockEvent {
    pub event: BlockEventKind,
    /// Index in the request's block table.
    pub index: Option<u32>,
    /// Physical block id.
    pub block: Option<BlockId>,
    /// The block's hash as KV events carry it (for `evicted`: the dropped entry's).
    pub hash: Option<u64>,
    /// `filled`: the block became a new cache entry.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub new_entry: bool,
    /// `evicted`: the request that had created the dropped entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Arc<str>>,
    /// A request with several sequences (n > 1): the sequence the event happened for, 0 to
    /// n - 1 (the prompt's blocks are sequence 0's, which computed them for all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u32>,
}

/// Most lifecycle entries kept per request (a long generation fills a block every `B` tokens).
pub const MAX_BLOCK_EVENTS: usize = 4096;

/// A finished request's block lifecycle (`GET /v1/cache/requests/{id}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestLifecycle {
    pub request_id: Arc<str>,
    pub handle: u64,
    pub tenant: Arc<str>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub prefill_stats: Option<PrefillStats>,
    pub blocks: Vec<BlockEvent>,
    /// Entries beyond [`MAX_BLOCK_EVENTS`] not kept.
    pub blocks_dropped: u64,
}

/// A lifecycle record as the step records it: 32 bytes on a 32-byte boundary, the evicted entry's
/// owner an id of the block index's [`Creators`] (held by the record until its lifecycle is
/// dropped); made [`BlockEvent`]s when the inspector asks. A decode block's three events (the
/// eviction of another's entry for it, its allocation and its fill) are one record: an `Allocated`
/// one with [`WITH_EVICTED`] (`hash` and `owner` are the evicted entry's) and [`WITH_FILLED`]
/// (`fill_hash`), expanded in that order ([`Ev::expand`]); merged only when nothing came between
/// them, so the expansion is the events as they happened.
#[derive(Clone, Copy, Debug)]
#[repr(align(32))]
pub(crate) struct Ev {
    pub(super) hash: u64,
    pub(super) fill_hash: u64,
    pub(super) index: u32,
    pub(super) block: u32,
    pub(super) owner: u32,
    pub(super) kind: BlockEventKind,
    pub(super) flags: u8,
}

const HAS_INDEX: u8 = 1;
const HAS_BLOCK: u8 = 2;
const HAS_HASH: u8 = 4;
pub(super) const NEW_ENTRY: u8 = 8;
/// An `Allocated` record that is also the `Evicted` event before it (same index and block).
pub(super) const WITH_EVICTED: u8 = 16;
/// An `Allocated` record that is also the `Filled` event after it (same index and block).
pub(super) const WITH_FILLED: u8 = 32;
/// The merged `Filled` event has a hash (`fill_hash`).
pub(super) const FILL_HASH: u8 = 64;

/// Records kept before any can hold more events than [`MAX_BLOCK_EVENTS`] allows: below it a
/// lifecycle's events (at most three per record) fit, and records are merged.
pub(super) const MERGED_RECORDS: usize = MAX_BLOCK_EVENTS / 3;

/// How many events `records` stand for.
pub(super) fn expanded_len(records: &[Ev]) -> usize {
    records.iter().map(Ev::events).sum()
}

/// `records` as one record per event (none merged), in order.
pub(super) fn expand(records: &[Ev]) -> Vec<Ev> {
    let mut out = Vec::with_capacity(expanded_len(records));
    for r in records {
        r.expand(|e| out.push(e));
    }
    out
}

impl Ev {
    pub(super) fn new(
        kind: BlockEventKind,
        index: Option<u32>,
        block: Option<BlockId>,
        hash: Option<u64>,
    ) -> Self {
        let mut flags = 0;
        if index.is_some() {
            flags |= HAS_INDEX;
        }
        if block.is_some() {
            flags |= HAS_BLOCK;
        }
        if hash.is_some() {
            flags |= HAS_HASH;
        }
        Ev {
            hash: hash.unwrap_or(0),
            fill_hash: 0,
            index: index.unwrap_or(0),
            block: block.unwrap_or(0),
            owner: NONE,
            kind,
            flags,
        }
    }

    /// How many events it stands for.
    pub(super) fn events(&self) -> usize {
        1 + usize::from(self.flags & WITH_EVICTED != 0) + usize::from(self.flags & WITH_FILLED != 0)
    }

    /// The events it stands for, in order, each as an unmerged record.
    pub(super) fn expand(&self, mut f: impl FnMut(Ev)) {
        if self.flags & (WITH_EVICTED | WITH_FILLED) == 0 {
            f(*self);
            return;
        }
        let base = HAS_INDEX | HAS_BLOCK;
        let plain = |kind, flags, hash, owner| Ev {
            hash,
            fill_hash: 0,
            index: self.index,
            block: self.block,
            owner,
            kind,
            flags,
        };
        if self.flags & WITH_EVICTED != 0 {
            f(plain(
                BlockEventKind::Evicted,
                base | HAS_HASH,
                self.hash,
                self.owner,
            ));
        }
        f(plain(BlockEventKind::Allocated, base, 0, NONE));
        if self.flags & WITH_FILLED != 0 {
            let mut flags = base | (self.flags & NEW_ENTRY);
            if self.flags & FILL_HASH != 0 {
                flags |= HAS_HASH;
            }
            f(plain(BlockEventKind::Filled, flags, self.fill_hash, NONE));
        }
    }

    /// Whether the `Filled` event of block `block` at `index` can join this record: an
    /// allocation of the same block, not yet filled.
    pub(super) fn takes_fill(&self, index: u32, block: BlockId) -> bool {
        self.kind == BlockEventKind::Allocated
            && self.flags & WITH_FILLED == 0
            && self.flags & (HAS_INDEX | HAS_BLOCK) == HAS_INDEX | HAS_BLOCK
            && self.index == index
            && self.block == block
    }

    /// Join the `Filled` event (`hash`, `new_entry`) to this allocation.
    pub(super) fn fill(&mut self, hash: Option<u64>, new_entry: bool) {
        self.flags |= WITH_FILLED;
        if let Some(h) = hash {
            self.flags |= FILL_HASH;
            self.fill_hash = h;
        }
        if new_entry {
            self.flags |= NEW_ENTRY;
        }
    }

    pub(super) fn event(&self, creators: Option<&Creators>) -> BlockEvent {
        let f = self.flags;
        BlockEvent {
            event: self.kind,
            index: (f & HAS_INDEX != 0).then_some(self.index),
            block: (f & HAS_BLOCK != 0).then_some(self.block),
            hash: (f & HAS_HASH != 0).then_some(self.hash),
            new_entry: f & NEW_ENTRY != 0,
            owner: (self.owner != NONE)
                .then(|| creators.and_then(|c| c.label(self.owner)))
                .flatten(),
            seq: None,
        }
    }
}

/// Release the owners `events` hold.
pub(super) fn release_owners(creators: Option<&mut Creators>, owners: impl Iterator<Item = u32>) {
    if let Some(c) = creators {
        for o in owners {
            c.release(o);
        }
    }
}

pub(super) fn owners_of(events: &[Ev]) -> impl Iterator<Item = u32> + '_ {
    events.iter().map(|e| e.owner).filter(|&o| o != NONE)
}

/// A kept lifecycle, as recorded.
#[derive(Debug)]
pub(super) struct Kept {
    pub(super) request_id: Arc<str>,
    pub(super) handle: u64,
    pub(super) tenant: Arc<str>,
    pub(super) finish_reason: FinishReason,
    pub(super) prompt_tokens: u64,
    pub(super) generation_tokens: u64,
    pub(super) prefill_stats: Option<PrefillStats>,
    /// A request with several sequences (n > 1): each sequence's number and the position of its
    /// first event (counted as expanded events, which cutting merged records keeps), in the
    /// order the sequences ended. Empty for a single sequence.
    pub(super) runs: Vec<(u32, u32)>,
    pub(super) events: Vec<Ev>,
    /// The owners its events hold (read when it is dropped, instead of its events).
    pub(super) owners: Vec<u32>,
    pub(super) dropped: u64,
}

/// Spare lifecycle buffers kept for new requests (a dropped lifecycle's, cleared).
pub(super) const SPARE_BUFFERS: usize = 64;

// A record never straddles two lines (a fill reads the one its allocation wrote, long ago).
const _: () = assert!(std::mem::size_of::<Ev>() == 32 && std::mem::align_of::<Ev>() == 32);
