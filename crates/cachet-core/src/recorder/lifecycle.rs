//! A request's block lifecycle (`GET /v1/cache/requests/{id}`): the events as the step records
//! them, and what the inspector is answered ([`BlockEvent`], [`RequestLifecycle`]).
//!
//! The step records events into one log for all requests ([`LifeLog`]), a ring of 32-byte
//! records ([`Rec`]) written one after the other, each linked to the one before it of the same
//! request ([`Chain`]). A block boundary of a request comes every `B` of its tokens, so whatever
//! is kept per request was last touched many steps earlier and has left the core's caches; the
//! log's end was written a moment ago. A lifecycle is gathered by following its links only when
//! the inspector asks. Records stay in the ring while their request lives or is kept in the
//! history; the ring grows to keep them, up to [`MAX_LOG`] records, past which the lifecycles
//! that hold the oldest records are moved out of it into their own buffers ([`Chain::spill`]).
//! The evicted entry's owner of an `evicted` record is an id of the block index's [`Creators`],
//! in use while the record is kept (in the ring, not passed by its tail, or moved out of it):
//! [`LifeLog::owners`] lists them for the creators' sweep.
//! Records are written with streaming stores (the step never reads them back); the engine
//! fences once a step (`Recorder::end_step`), so a thread that reads the log later sees them.

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

/// A lifecycle record: 32 bytes, one event, linked to its request's record before it.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub(super) struct Rec {
    /// The block's hash as KV events carry it (`evicted`: the dropped entry's).
    pub(super) hash: u64,
    /// The position of the request's record before it ([`NO`]: none in the ring).
    prev: u64,
    pub(super) index: u32,
    pub(super) block: u32,
    /// `evicted`: the dropped entry's creator, an id of [`Creators`] held by this record
    /// (`NONE`: none).
    pub(super) owner: u32,
    pub(super) kind: BlockEventKind,
    pub(super) flags: u8,
}

// A record never straddles two lines.
const _: () = assert!(std::mem::size_of::<Rec>() == 32 && std::mem::align_of::<Rec>() == 32);

const HAS_INDEX: u8 = 1;
const HAS_BLOCK: u8 = 2;
const HAS_HASH: u8 = 4;
const NEW_ENTRY: u8 = 8;
/// An `allocated` record that is also the `evicted` event before it (same index and block:
/// `hash` and `owner` are the dropped entry's), as a decode block's allocation records it.
const WITH_EVICTED: u8 = 16;

/// No position.
pub(super) const NO: u64 = u64::MAX;

impl Rec {
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
        Rec {
            hash: hash.unwrap_or(0),
            prev: NO,
            index: index.unwrap_or(0),
            block: block.unwrap_or(0),
            owner: NONE,
            kind,
            flags,
        }
    }

    /// The allocation of `block` at `index`, for which the entry `hash` (created by `owner`)
    /// in it was dropped: the `evicted` and `allocated` events in one record.
    pub(super) fn evicted_for(index: u32, block: BlockId, hash: u64, owner: u32) -> Self {
        let mut r = Rec::new(
            BlockEventKind::Allocated,
            Some(index),
            Some(block),
            Some(hash),
        );
        r.owner = owner;
        r.flags |= WITH_EVICTED;
        r
    }

    /// How many events it stands for.
    #[inline]
    pub(super) fn events(&self) -> usize {
        1 + usize::from(self.flags & WITH_EVICTED != 0)
    }

    /// The events it stands for, in order, each as a record of one.
    fn expand(&self, mut f: impl FnMut(Rec)) {
        if self.flags & WITH_EVICTED == 0 {
            f(*self);
            return;
        }
        let mut e = *self;
        e.kind = BlockEventKind::Evicted;
        e.flags &= !WITH_EVICTED;
        f(e);
        let mut a = *self;
        a.flags &= !(WITH_EVICTED | HAS_HASH);
        a.hash = 0;
        a.owner = NONE;
        f(a);
    }

    /// A `filled` record (`new_entry`: the block became a cache entry).
    pub(super) fn filled(
        index: u32,
        block: Option<BlockId>,
        hash: Option<u64>,
        new_entry: bool,
    ) -> Self {
        let mut r = Rec::new(BlockEventKind::Filled, Some(index), block, hash);
        if new_entry {
            r.flags |= NEW_ENTRY;
        }
        r
    }

    pub(super) fn event(&self, creators: Option<&Creators>, seq: Option<u32>) -> BlockEvent {
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
            seq,
        }
    }
}

/// One sequence's lifecycle as recorded: its newest and oldest records in the ring, the count
/// of its events, and the records moved out of the ring before them. 32 bytes, dense by slot.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub(super) struct Chain {
    last: u64,
    first: u64,
    /// Events kept (in the ring and moved out).
    count: u32,
    /// Events not recorded (over [`MAX_BLOCK_EVENTS`]).
    pub(super) dropped: u32,
    /// Its records moved out of the ring, older than those in it: an index of
    /// [`LifeLog::spills`] (`NONE`: none).
    spill: u32,
    /// Kept at all (a request's lifecycle is kept when the history is).
    pub(super) on: bool,
}

const _: () = assert!(std::mem::size_of::<Chain>() == 32);

impl Default for Chain {
    fn default() -> Self {
        Chain {
            last: NO,
            first: NO,
            count: 0,
            dropped: 0,
            spill: NONE,
            on: false,
        }
    }
}

impl Chain {
    /// A lifecycle to keep.
    pub(super) fn kept() -> Self {
        Chain {
            on: true,
            ..Default::default()
        }
    }

    /// Its events kept.
    #[inline]
    pub(super) fn count(&self) -> usize {
        self.count as usize
    }
}

/// Records the ring starts with (grown as lifecycles need it).
const FIRST_LOG: usize = 1 << 12;
/// The most records the ring grows to; past it, lifecycles holding its oldest records are moved
/// out of it.
pub(super) const MAX_LOG: usize = 1 << 21;

/// The ring of every kept lifecycle's records (see the module's comment).
#[derive(Debug, Default)]
pub(super) struct LifeLog {
    ring: Vec<Rec>,
    /// Records moved out of the ring, by chain ([`Chain::spill`]), in order; and the free
    /// indices.
    spills: Vec<Vec<Rec>>,
    free_spills: Vec<u32>,
    /// Position of the next record.
    head: u64,
    /// Records below it are released.
    tail: u64,
    /// The most records the ring grows to (tests make it small).
    max: usize,
}

impl LifeLog {
    pub(super) fn new() -> Self {
        LifeLog {
            max: MAX_LOG,
            ..Default::default()
        }
    }

    #[cfg(test)]
    pub(super) fn with_max(max: usize) -> Self {
        LifeLog {
            max,
            ..Default::default()
        }
    }

    fn at(&self, pos: u64) -> usize {
        (pos as usize) & (self.ring.len() - 1)
    }

    /// Whether the next record needs room made first ([`LifeLog::make_room`]).
    #[inline]
    pub(super) fn full(&self) -> bool {
        (self.head - self.tail) as usize == self.ring.len()
    }

    /// Append `rec` to `chain` (the caller made room).
    #[inline]
    pub(super) fn push(&mut self, chain: &mut Chain, mut rec: Rec) {
        rec.prev = chain.last;
        let p = self.head;
        let i = self.at(p);
        let n = rec.events() as u32;
        super::stream(&mut self.ring[i], rec);
        self.head += 1;
        if chain.first == NO {
            chain.first = p;
        }
        chain.last = p;
        chain.count += n;
    }

    /// Make the records written past the caches visible to every core (a store fence): at
    /// the end of a step, before anything (another thread included) may read the log.
    pub(super) fn fence(&self) {
        #[cfg(target_arch = "x86_64")]
        if self.head > 0 {
            // SAFETY: a store fence has no operands and no effect but ordering.
            unsafe { std::arch::x86_64::_mm_sfence() };
        }
    }

    /// `chain` is dropped: its moved records go (its records in the ring are released when
    /// the ring's tail passes them).
    pub(super) fn drop_chain(&mut self, chain: &Chain) {
        let Some(v) = self.spills.get_mut(chain.spill as usize) else {
            return;
        };
        *v = Vec::new();
        self.free_spills.push(chain.spill);
    }

    /// Room for the next record: the records older than every chain in `chains` (the live and
    /// kept lifecycles) are released; if that frees less than half the ring, the ring grows,
    /// or (at its largest) the chains holding its older half are moved out of it.
    pub(super) fn make_room<'a>(&mut self, chains: impl Iterator<Item = &'a mut Chain>) {
        if self.ring.is_empty() {
            self.ring = blank(FIRST_LOG.min(self.max).max(2).next_power_of_two());
            return;
        }
        let cap = self.ring.len();
        let mut chains: Vec<&mut Chain> = chains.filter(|c| c.first != NO).collect();
        let floor = chains.iter().map(|c| c.first).min().unwrap_or(self.head);
        let half = self.tail + (cap / 2) as u64;
        if floor < half && cap < self.max {
            self.grow();
        } else if floor < half {
            // At its largest: move the chains that start in the older half out of the ring.
            for c in chains.iter_mut().filter(|c| c.first < half) {
                self.spill(c);
            }
            self.release_to(half);
            return;
        }
        self.release_to(floor);
    }

    /// Move `chain`'s records out of the ring.
    fn spill(&mut self, chain: &mut Chain) {
        #[cfg(test)]
        SPILLS.with(|n| n.set(n.get() + 1));
        let mut v = Vec::new();
        for (_, mut r) in self.in_ring(chain) {
            r.prev = NO;
            v.push(r);
        }
        if chain.spill == NONE {
            chain.spill = match self.free_spills.pop() {
                Some(i) => i,
                None => {
                    self.spills.push(Vec::new());
                    (self.spills.len() - 1) as u32
                }
            };
        }
        self.spills[chain.spill as usize].extend(v);
        chain.first = NO;
        chain.last = NO;
    }

    /// `chain`'s records in the ring with their positions, oldest first.
    fn in_ring(&self, chain: &Chain) -> Vec<(u64, Rec)> {
        let mut v = Vec::new();
        let mut p = chain.last;
        while p != NO {
            let r = self.ring[self.at(p)];
            v.push((p, r));
            p = r.prev;
        }
        v.reverse();
        v
    }

    fn grow(&mut self) {
        let cap = self.ring.len() * 2;
        let mut ring = blank(cap);
        for p in self.tail..self.head {
            ring[(p as usize) & (cap - 1)] = self.ring[self.at(p)];
        }
        self.ring = ring;
    }

    /// Release the records below `to`.
    fn release_to(&mut self, to: u64) {
        self.tail = self.tail.max(to.min(self.head));
    }

    /// The owners the kept records name (in the ring, not passed by its tail, and moved out
    /// of it), with repeats: what the creators' sweep keeps. Reads the ring back (written
    /// past the caches): rare.
    pub(super) fn owners(&self) -> impl Iterator<Item = u32> + '_ {
        let ring = (self.tail..self.head).map(|p| self.ring[self.at(p)].owner);
        let moved = self.spills.iter().flatten().map(|r| r.owner);
        ring.chain(moved).filter(|&o| o != NONE)
    }

    /// `chain`'s first `take` events in order (moved records first), a record each.
    pub(super) fn records(&self, chain: &Chain, take: usize) -> Vec<Rec> {
        let v = self.in_ring(chain);
        let moved = self
            .spills
            .get(chain.spill as usize)
            .map_or(&[][..], |s| &s[..]);
        let mut all = Vec::with_capacity(chain.count());
        for r in moved.iter().chain(v.iter().map(|(_, r)| r)) {
            r.expand(|e| all.push(e));
        }
        all.truncate(take);
        all
    }
}

/// One sequence of a kept lifecycle.
#[derive(Debug)]
pub(super) struct Part {
    /// The sequence (n > 1), `None` for a request with one.
    pub(super) seq: Option<u32>,
    pub(super) chain: Chain,
    /// Of its records, those shown (the lifecycle's limit cut the rest).
    pub(super) take: u32,
}

impl Kept {
    pub(super) fn parts(&self) -> impl Iterator<Item = &Part> {
        std::iter::once(&self.first).chain(&self.more)
    }

    pub(super) fn parts_mut(&mut self) -> impl Iterator<Item = &mut Part> {
        std::iter::once(&mut self.first).chain(&mut self.more)
    }
}

/// A kept lifecycle.
#[derive(Debug)]
pub(super) struct Kept {
    pub(super) request_id: Arc<str>,
    pub(super) handle: u64,
    pub(super) tenant: Arc<str>,
    pub(super) finish_reason: FinishReason,
    pub(super) prompt_tokens: u64,
    pub(super) generation_tokens: u64,
    pub(super) prefill_stats: Option<PrefillStats>,
    /// Its sequences' records, in the order the sequences ended: the first's, the others'.
    pub(super) first: Part,
    pub(super) more: Vec<Part>,
    pub(super) dropped: u64,
}

#[cfg(test)]
thread_local! {
    /// Lifecycles moved out of the log (tests).
    pub(super) static SPILLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A ring of `n` unused records.
fn blank(n: usize) -> Vec<Rec> {
    vec![Rec::new(BlockEventKind::Hit, None, None, None); n]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record written past the caches reads back field by field as it was.
    #[test]
    fn a_streamed_record_reads_back_whole() {
        for kind in [
            BlockEventKind::Hit,
            BlockEventKind::Loaded,
            BlockEventKind::Allocated,
            BlockEventKind::Filled,
            BlockEventKind::Evicted,
            BlockEventKind::Preempted,
        ] {
            let mut r = Rec::new(
                kind,
                Some(0xdead_beef),
                Some(0x0123_4567),
                Some(u64::MAX - 5),
            );
            r.prev = 0x8000_0000_0000_0001;
            r.owner = 0xfeed_f00d;
            r.flags |= NEW_ENTRY | WITH_EVICTED;
            let mut to = Rec::new(BlockEventKind::Hit, None, None, None);
            super::super::stream(&mut to, r);
            assert_eq!(
                (to.hash, to.prev, to.index, to.block, to.owner, to.kind, to.flags),
                (r.hash, r.prev, r.index, r.block, r.owner, r.kind, r.flags)
            );
        }
    }
}
