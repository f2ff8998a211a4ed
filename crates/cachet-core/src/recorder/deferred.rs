//! Work the recorder defers and does in batches, because what it touches is cold: new entries
//! queued for the block index, applied in order with their lines prefetched ahead. (Evictions
//! are not queued: dropping an entry touches no line of it, see `blocks.rs`.)

use super::blocks::BlockIndex;
use crate::BlockId;

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

#[derive(Clone, Copy, Debug)]
enum Op {
    Create(PendingCreate),
    Release(u32),
}

/// New entries not yet applied to the block index, in order, with their tokens. A fill
/// creates one entry per call, and its lines (the entry's, the parent's children's head) are
/// cold: applied one by one, each waited for its misses; queued and applied together,
/// [`AHEAD`] are in flight at once.
#[derive(Debug, Default)]
pub(super) struct IndexQueue {
    pending: Vec<Op>,
    tokens: Vec<crate::TokenId>,
}

impl IndexQueue {
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.pending.is_empty()
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

    /// Apply them to `index`, in order, the lines of the one [`AHEAD`] prefetched.
    #[inline(never)]
    pub(super) fn apply(&mut self, mut index: Option<&mut BlockIndex>) {
        let ahead = |ix: Option<&BlockIndex>, op: &Op| {
            if let (Op::Create(c), Some(ix)) = (*op, ix) {
                ix.prefetch_create(c.block, c.parent);
            }
        };
        for p in self.pending.iter().take(AHEAD) {
            ahead(index.as_deref(), p);
        }
        for k in 0..self.pending.len() {
            if let Some(q) = self.pending.get(k + AHEAD) {
                ahead(index.as_deref(), q);
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
            }
        }
        self.pending.clear();
        self.tokens.clear();
    }
}
