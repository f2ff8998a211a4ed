//! Work the recorder defers and does in batches, because what it touches is cold: evictions
//! queued for the block index, and the releases of lifecycles dropped from the history (with
//! the buffers they leave, kept for new requests). Each batch prefetches its lines ahead.

use super::blocks::{BlockIndex, Creators, NONE};
use super::hot::Hot;
use super::lifecycle::{Ev, Kept, SPARE_BUFFERS};
use crate::BlockId;

/// Lifecycles dropped from the history released together ([`Retirement::retire`]).
const RETIRE_BATCH: usize = 16;

/// Lines prefetched ahead of the one a batch works on.
const AHEAD: usize = 8;

/// An eviction the block index has not seen yet: the step's allocations each evict a block
/// whose entry was created long ago (its line is cold), so they are applied together, their
/// lines prefetched ahead, before anything reads the index.
#[derive(Clone, Copy, Debug)]
struct PendingEviction {
    block: BlockId,
    /// The request it was evicted for, and its `evicted` event's place in the request's
    /// lifecycle (`NONE`: not recorded), whose owner is filled in when applied.
    slot: u32,
    event: u32,
}

/// Evictions not yet applied to the block index, in order.
#[derive(Debug, Default)]
pub(super) struct Evictions {
    pending: Vec<PendingEviction>,
}

impl Evictions {
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// `block`'s entry was evicted for the request in `slot` (`NONE`: none live), recorded as
    /// event `event` of its lifecycle (`NONE`: not recorded).
    #[inline]
    pub(super) fn push(&mut self, block: BlockId, slot: u32, event: u32) {
        self.pending.push(PendingEviction { block, slot, event });
    }

    /// The blocks whose eviction has not reached the index.
    pub(super) fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.pending.iter().map(|p| p.block)
    }

    /// Apply them to `index`, in order: each entry's creator passes to the `evicted` event
    /// recorded for it (and its lifecycle's owners, in `hot` by slot), or is released.
    #[inline(never)]
    pub(super) fn apply(&mut self, index: Option<&mut BlockIndex>, hot: &mut [Hot]) {
        let Some(ix) = index else {
            self.pending.clear();
            return;
        };
        for p in self.pending.iter().take(AHEAD) {
            ix.prefetch_slot(p.block);
        }
        for k in 0..self.pending.len() {
            if let Some(q) = self.pending.get(k + AHEAD) {
                ix.prefetch_slot(q.block);
            }
            let p = self.pending[k];
            let owner = ix.evicted(p.block);
            let h = (p.event != NONE)
                .then(|| hot.get_mut(p.slot as usize))
                .flatten();
            match (h, owner) {
                (Some(h), Some(o)) => {
                    if let Some(e) = h.life.as_mut().and_then(|l| l.get_mut(p.event as usize)) {
                        e.owner = o;
                    }
                    h.owners.push(o);
                }
                (None, Some(o)) => ix.creators.release(o),
                (_, None) => {}
            }
        }
        self.pending.clear();
    }
}

/// Lifecycles dropped from the history whose owners' holds (and labels) are not released
/// yet, and the buffers of released ones. A dropped lifecycle is hundreds of requests old, its
/// owners' lines in the creators' table cold, so they are released together, prefetched
/// ahead, once [`RETIRE_BATCH`] have gathered. Nothing reads a hold's count but the release
/// that ends it, so releasing late changes no answer.
#[derive(Debug, Default)]
pub(super) struct Retirement {
    retired: Vec<Kept>,
    spare: Vec<(Vec<Ev>, Vec<u32>)>,
}

impl Retirement {
    /// `old` was dropped from the history; its owners are released with the batch it
    /// completes.
    pub(super) fn retire(&mut self, old: Kept, creators: Option<&mut Creators>) {
        self.retired.push(old);
        if self.retired.len() >= RETIRE_BATCH {
            self.release(creators);
        }
    }

    /// Release the holds of the retired lifecycles' owners, their lines prefetched ahead, and
    /// keep their buffers for new requests.
    #[inline(never)]
    fn release(&mut self, creators: Option<&mut Creators>) {
        let mut retired = std::mem::take(&mut self.retired);
        if let Some(c) = creators {
            let owners = || retired.iter().flat_map(|k| k.owners.iter().copied());
            for o in owners().take(AHEAD) {
                c.prefetch(o);
            }
            for (o, ahead) in owners().zip(
                owners()
                    .skip(AHEAD)
                    .map(Some)
                    .chain(std::iter::repeat(None)),
            ) {
                if let Some(a) = ahead {
                    c.prefetch(a);
                }
                c.release(o);
            }
        }
        for k in retired.drain(..) {
            self.recycle(k.events, k.owners);
        }
        // The (empty) list's room, for the next batch.
        self.retired = retired;
    }

    /// Keep a lifecycle buffer whose events are released for a new request.
    pub(super) fn recycle(&mut self, mut events: Vec<Ev>, mut owners: Vec<u32>) {
        if self.spare.len() < SPARE_BUFFERS && events.capacity() > 0 {
            events.clear();
            owners.clear();
            self.spare.push((events, owners));
        }
    }

    /// A kept buffer (or new empty ones).
    pub(super) fn spare(&mut self) -> (Vec<Ev>, Vec<u32>) {
        self.spare.pop().unwrap_or_default()
    }
}
