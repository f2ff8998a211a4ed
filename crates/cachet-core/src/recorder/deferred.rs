//! Work the recorder defers and does in batches, because what it touches is cold: new entries
//! queued for the block index, applied in order with their lines prefetched ahead. (Evictions
//! are not queued: dropping an entry touches no line of it, see `blocks.rs`.)

use super::blocks::{BlockIndex, NONE};
use crate::BlockId;

/// Lines prefetched ahead of the one a batch works on.
const AHEAD: usize = 8;

/// A change the block index has not seen yet: an entry to create (its tokens in
/// [`IndexQueue::tokens`]), or a creator id taken for one fill to finish. 48 bytes: the queue
/// is lines the step writes and reads back, so it is kept small.
#[derive(Clone, Copy, Debug)]
struct Pending {
    /// The entry's hash as KV events carry it.
    wire: u64,
    root_key: u64,
    now: f64,
    block: BlockId,
    depth: u32,
    /// `NONE`: depth 0, or none known.
    parent: BlockId,
    creator: u32,
    /// `CREATE`, or `FINISH` (no entry: the fill that took `creator` is applied).
    op: u8,
}

const _: () = assert!(std::mem::size_of::<Pending>() == 48);

const CREATE: u8 = 1;
const FINISH: u8 = 2;

/// New entries not yet applied to the block index, in order, with their tokens. A fill
/// creates one entry per call, and its lines (the entry's, its tokens', the parent's
/// children's head) are cold: written one by one, each waited for its misses (a store that
/// misses holds up every store after it); queued and applied together, [`AHEAD`] are in
/// flight at once.
#[derive(Debug, Default)]
pub(super) struct IndexQueue {
    pending: Vec<Pending>,
    /// The queued entries' tokens, one block's each, in order.
    tokens: Vec<crate::TokenId>,
}

impl IndexQueue {
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// A new entry in `block` with one block's `tokens` (see [`BlockIndex::create`]).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn push_create(
        &mut self,
        block: BlockId,
        wire: u64,
        depth: u32,
        parent: BlockId,
        tokens: &[crate::TokenId],
        root_key: u64,
        creator: u32,
        now: f64,
    ) {
        // (A block of 16 tokens, the default, is copied as one: no call.)
        match <&[crate::TokenId; 16]>::try_from(tokens) {
            Ok(a) => self.tokens.extend_from_slice(a),
            Err(_) => self.tokens.extend_from_slice(tokens),
        }
        self.pending.push(Pending {
            wire,
            root_key,
            now,
            block,
            depth,
            parent,
            creator,
            op: CREATE,
        });
    }

    /// `creator` (taken for the fill queued before it) to finish.
    pub(super) fn push_finish(&mut self, creator: u32) {
        self.pending.push(Pending {
            wire: 0,
            root_key: 0,
            now: 0.0,
            block: NONE,
            depth: 0,
            parent: NONE,
            creator,
            op: FINISH,
        });
    }

    /// Apply them to `index`, in order, the lines of the one [`AHEAD`] prefetched.
    #[inline(never)]
    pub(super) fn apply(&mut self, mut index: Option<&mut BlockIndex>) {
        let ahead = |ix: Option<&BlockIndex>, p: &Pending| {
            if let (true, Some(ix)) = (p.op & CREATE != 0, ix) {
                ix.prefetch_create(p.block, p.parent);
            }
        };
        for p in self.pending.iter().take(AHEAD) {
            ahead(index.as_deref(), p);
        }
        let b = index.as_deref().map_or(1, BlockIndex::block_size).max(1);
        let mut tokens = self.tokens.chunks_exact(b);
        for k in 0..self.pending.len() {
            if let Some(q) = self.pending.get(k + AHEAD) {
                ahead(index.as_deref(), q);
            }
            let p = self.pending[k];
            let Some(ix) = index.as_deref_mut() else {
                continue;
            };
            if p.op & CREATE != 0 {
                // (Each queued entry has one block's tokens: `filled` checks `takes` first.)
                let Some(t) = tokens.next() else {
                    continue;
                };
                ix.create(
                    p.block, p.wire, p.depth, p.parent, t, p.root_key, p.creator, p.now,
                );
            } else {
                ix.creators.finish(p.creator);
            }
        }
        self.pending.clear();
        self.tokens.clear();
    }
}
