//! What a live request's block boundaries touch of its insight, one line by slot ([`Live`]):
//! its lifecycle's [`Chain`] and, for the block index, its root key, creator id and newest
//! entry ([`Ids`]).

use super::blocks::NONE;
use super::lifecycle::Chain;
use crate::BlockId;

/// A live request's insight state that its block boundaries touch: one 64-byte line by slot
/// (a thousand requests' take 64 KB), what the allocation and the fill of a block read and write.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
pub(crate) struct Live {
    pub(super) chain: Chain,
    pub(super) ids: Ids,
}

const _: () = assert!(std::mem::size_of::<Live>() == 64);

/// What a fill reads of a live request besides its tokens: 24 bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ids {
    /// Digest of its salt, adapter and tenant (see `insight::root_key`).
    pub(super) root_key: u64,
    /// The request's id in the block index's creators (`NONE` until it creates an entry).
    pub(super) creator: u32,
    /// The newest entry it created: its index in the block table and its block (`None`: none,
    /// or its blocks were freed since). The request holds that block until it is preempted or
    /// ends, so the pool keeps the entry (only free blocks are evicted; a reset needs every
    /// block free): a fill whose parent is that block need not read the pool's line for it.
    pub(super) own: Option<(u32, BlockId)>,
}

const _: () = assert!(std::mem::size_of::<Ids>() == 24);

impl Default for Ids {
    fn default() -> Self {
        Ids {
            root_key: 0,
            creator: NONE,
            own: None,
        }
    }
}
