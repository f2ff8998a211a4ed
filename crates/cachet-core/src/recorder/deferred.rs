//! Work the recorder defers and does in batches, because what it touches is cold: new entries
//! queued for the block index, and lifecycle fills (one ordered list, so the index and the
//! lifecycles end as if each had been applied at once), and the releases of lifecycles dropped
//! from the history (with the buffers they leave, kept for new requests). Each batch
//! prefetches its lines ahead. (Evictions are not queued: dropping an entry touches no line of
//! it, see `blocks.rs`.)

use super::blocks::{BlockIndex, Creators};
use super::hot::Hot;
use super::lifecycle::{Ev, Kept, SPARE_BUFFERS};
use crate::BlockId;

/// Lifecycles dropped from the history released together ([`Retirement::retire`]).
const RETIRE_BATCH: usize = 16;

/// Lines prefetched ahead of the one a batch works on.
const AHEAD: usize = 8;

/// An entry the block index has not seen yet (see [`IndexQueue::push_create`]).
#[derive(Clone, Copy, Debug)]
struct PendingCreate {
    block: BlockId,
    hash: crate::hash::BlockHash,
    depth: u32,
    /// `None` at depth 0; `Some(BlockId::MAX)`: none known.
    parent: Option<BlockId>,
    root_key: u64,
    creator: u32,
    now: f64,
    hold: bool,
    /// Offset and count of its tokens in [`IndexQueue::tokens`].
    tok: u32,
    ntok: u32,
}

/// A block filled for the request in `slot`, for its lifecycle ([`Hot::record_fill`]).
#[derive(Clone, Copy, Debug)]
struct PendingFill {
    slot: u32,
    index: u32,
    block: Option<BlockId>,
    hash: Option<u64>,
    new_entry: bool,
}

impl PendingFill {
    /// Record it in its request's lifecycle (when one is kept).
    #[inline]
    fn record(self, hot: &mut [Hot]) {
        if let Some(h) = hot.get_mut(self.slot as usize).filter(|h| h.life.is_some()) {
            h.record_fill(self.index, self.block, self.hash, self.new_entry);
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Create(PendingCreate),
    Release(u32),
    Fill(PendingFill),
    /// A fill already recorded ([`IndexQueue::apply_fills_of`]).
    Done,
}

/// New entries not yet applied to the block index, and fills not yet recorded in their
/// lifecycles, in order, with the new entries' tokens. A fill creates one entry per
/// call, and its lines (the entry's, the parent's children's head, the request's hot line and
/// the record its fill joins) are cold: applied one by one, each waited for its misses; queued
/// and applied together, [`AHEAD`] are in flight at once.
#[derive(Debug, Default)]
pub(super) struct IndexQueue {
    pending: Vec<Op>,
    tokens: Vec<crate::TokenId>,
    /// `Fill`s among them.
    fills: usize,
    /// Which batch is being queued: counts the batches applied (see [`IndexQueue::epoch`]).
    epoch: u32,
}

impl IndexQueue {
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Whether lifecycle fills are queued.
    #[inline]
    pub(super) fn has_fills(&self) -> bool {
        self.fills > 0
    }

    /// The batch being queued: a slot whose fill was queued in this batch has it (or had it,
    /// if [`IndexQueue::apply_fills_of`] took it) until the batch is applied.
    #[inline]
    pub(super) fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Record the queued fills of the request in `slot` in its lifecycle now, in order, and
    /// leave the rest queued: before its lifecycle is taken when it ends. Nothing else queued
    /// reads or writes its hot state, and everything else its lifecycle records applies the
    /// queue first, so its records end as they would have.
    pub(super) fn apply_fills_of(&mut self, slot: u32, hot: &mut [Hot]) {
        for op in self.pending.iter_mut() {
            if let Op::Fill(f) = *op {
                if f.slot == slot {
                    f.record(hot);
                    *op = Op::Done;
                    self.fills -= 1;
                    #[cfg(test)]
                    super::insight::tests::FILLS_AT_END.with(|n| n.set(n.get() + 1));
                }
            }
        }
    }

    /// Block `block` at `index` of the request in `slot` was filled (`hash`; `new_entry`: it
    /// became a cache entry), for its lifecycle.
    #[inline]
    pub(super) fn push_fill(
        &mut self,
        slot: u32,
        index: u32,
        block: Option<BlockId>,
        hash: Option<u64>,
        new_entry: bool,
    ) {
        self.fills += 1;
        self.pending.push(Op::Fill(PendingFill {
            slot,
            index,
            block,
            hash,
            new_entry,
        }));
    }

    /// A new entry in `block` (see [`BlockIndex::create`]); `parent`: `None` at depth 0.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_create(
        &mut self,
        block: BlockId,
        hash: crate::hash::BlockHash,
        depth: u32,
        parent: Option<BlockId>,
        tokens: &[crate::TokenId],
        root_key: u64,
        creator: u32,
        now: f64,
        hold: bool,
    ) {
        let tok = self.tokens.len() as u32;
        self.tokens.extend_from_slice(tokens);
        self.pending.push(Op::Create(PendingCreate {
            block,
            hash,
            depth,
            parent,
            root_key,
            creator,
            now,
            hold,
            tok,
            ntok: tokens.len() as u32,
        }));
    }

    /// One hold of `creator` to release after what is queued before it.
    pub(super) fn push_release(&mut self, creator: u32) {
        self.pending.push(Op::Release(creator));
    }

    /// Apply them to `index` and the lifecycles in `hot`, in order. A fill's lines come in two
    /// stages: its hot line [`AHEAD`] before the record it may join (whose address is in that
    /// line), [`AHEAD`] before it is applied.
    #[inline(never)]
    pub(super) fn apply(&mut self, mut index: Option<&mut BlockIndex>, hot: &mut [Hot]) {
        let far = |ix: Option<&BlockIndex>, hot: &[Hot], op: &Op| match (*op, ix) {
            (Op::Create(c), Some(ix)) => ix.prefetch_create(c.block, c.parent),
            (Op::Fill(f), _) => {
                if let Some(h) = hot.get(f.slot as usize) {
                    super::prefetch(h);
                }
            }
            _ => {}
        };
        let near = |hot: &[Hot], op: &Op| {
            if let Op::Fill(f) = *op {
                if let Some(last) = hot
                    .get(f.slot as usize)
                    .and_then(|h| h.life.as_ref())
                    .and_then(|l| l.last())
                {
                    super::prefetch(last);
                }
            }
        };
        for p in self.pending.iter().take(2 * AHEAD) {
            far(index.as_deref(), hot, p);
        }
        for p in self.pending.iter().take(AHEAD) {
            near(hot, p);
        }
        for k in 0..self.pending.len() {
            if let Some(q) = self.pending.get(k + 2 * AHEAD) {
                far(index.as_deref(), hot, q);
            }
            if let Some(q) = self.pending.get(k + AHEAD) {
                near(hot, q);
            }
            match self.pending[k] {
                Op::Create(c) => {
                    let t = c.tok as usize;
                    // (`create` refuses tokens that are not one block's.)
                    if let (Some(ix), Some(tokens)) = (
                        index.as_deref_mut(),
                        self.tokens.get(t..t + c.ntok as usize),
                    ) {
                        ix.create(
                            c.block, c.hash, c.depth, c.parent, tokens, c.root_key, c.creator,
                            c.now, c.hold,
                        );
                    }
                }
                Op::Release(c) => {
                    if let Some(ix) = index.as_deref_mut() {
                        ix.creators.release(c);
                    }
                }
                Op::Fill(f) => f.record(hot),
                Op::Done => {}
            }
        }
        self.pending.clear();
        self.tokens.clear();
        self.fills = 0;
        self.epoch = self.epoch.wrapping_add(1);
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

    /// Owner holds of the lifecycles retired but not released yet.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.retired.iter().map(|k| k.owners.len()).sum()
    }

    /// A kept buffer (or new empty ones).
    pub(super) fn spare(&mut self) -> (Vec<Ev>, Vec<u32>) {
        self.spare.pop().unwrap_or_default()
    }
}
