//! What a live request's block boundaries touch of its insight, dense by slot: its lifecycle
//! as it is recorded (records merged while they fit [`MAX_BLOCK_EVENTS`]) with its owners
//! ([`Hot`]), and its root key, creator id and newest entry ([`Ids`]).

use super::blocks::NONE;
use super::lifecycle::{
    expanded_len, BlockEventKind, Ev, MAX_BLOCK_EVENTS, MERGED_RECORDS, NEW_ENTRY,
};
use crate::BlockId;

/// What a live request's lifecycle recording touches, one cache line by slot: the
/// lifecycle's buffers and its counts. Kept apart from the request's record (hundreds of
/// bytes, a line the step otherwise does not read) so that a thousand of them stay in the
/// core's L2. (Its root key and creator id, which a fill reads, are in [`Ids`].)
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub(crate) struct Hot {
    /// The lifecycle (`None`: not kept).
    pub(super) life: Option<Vec<Ev>>,
    /// The owners of its lifecycle's `evicted` events, each held once.
    pub(super) owners: Vec<u32>,
    /// Events not kept (over [`MAX_BLOCK_EVENTS`]).
    pub(super) dropped: u32,
    /// The lifecycle's events, counted once it has [`MERGED_RECORDS`] records (0 before).
    pub(super) counted: u32,
}

const _: () = assert!(std::mem::size_of::<Hot>() == 64);

/// What a fill reads of a live request besides its tokens: 32 bytes by slot, so that a
/// thousand requests' take 32 KB and the fill touches no line of its [`Hot`] (the lifecycle
/// part of a fill is queued and applied with those lines prefetched).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ids {
    /// Digest of its salt, adapter and tenant (see `insight::root_key`).
    pub(super) root_key: u64,
    /// The request's id in the block index's creators (`NONE` until it creates an entry).
    pub(super) creator: u32,
    /// Entries it created, each holding `creator` (counted here while it lives).
    pub(super) entries: u32,
    /// The newest entry it created: its index in the block table and its block (`None`: none,
    /// or its blocks were freed since). The request holds that block until it is preempted or
    /// ends, so the pool keeps the entry (only free blocks are evicted; a reset needs every
    /// block free): a fill whose parent is that block need not read the pool's line for it.
    pub(super) own: Option<(u32, BlockId)>,
    /// The queue's batch its last lifecycle fill was queued in (`IndexQueue::epoch`): when it
    /// is the one being queued, the request may have fills queued.
    pub(super) fill_epoch: u32,
}

const _: () = assert!(std::mem::size_of::<Ids>() == 32);

impl Default for Ids {
    fn default() -> Self {
        Ids {
            root_key: 0,
            creator: NONE,
            entries: 0,
            own: None,
            fill_epoch: u32::MAX,
        }
    }
}

impl Hot {
    /// Record `e`; false when the lifecycle is full (or not kept) and `e` was not recorded.
    #[inline]
    pub(super) fn push(&mut self, e: Ev) -> bool {
        match self.life.as_mut() {
            // Below MERGED_RECORDS records the events fit (at most three per record).
            Some(l) if l.len() < MERGED_RECORDS => {
                l.push(e);
                true
            }
            Some(_) => self.push_counted(e),
            None => false,
        }
    }

    /// `push` past [`MERGED_RECORDS`] records: by the count of events (records are no longer
    /// merged).
    #[cold]
    #[inline(never)]
    fn push_counted(&mut self, e: Ev) -> bool {
        let Some(l) = self.life.as_mut() else {
            return false;
        };
        if self.counted == 0 {
            self.counted = expanded_len(l) as u32;
        }
        if (self.counted as usize) < MAX_BLOCK_EVENTS {
            l.push(e);
            self.counted += 1;
            return true;
        }
        self.dropped = self.dropped.saturating_add(1);
        false
    }

    /// Record the fill of block `block` at `index` (`hash`: its hash; `new_entry`: it became a
    /// cache entry): joined to its allocation's record when that is the last one and merged
    /// records still fit, else an event of its own.
    pub(super) fn record_fill(
        &mut self,
        index: u32,
        block: Option<BlockId>,
        hash: Option<u64>,
        new_entry: bool,
    ) {
        if let (Some(blk), true) = (
            block,
            // Growing a record to three events keeps the events within bounds up to
            // MERGED_RECORDS records.
            self.life
                .as_ref()
                .is_some_and(|l| l.len() <= MERGED_RECORDS),
        ) {
            if let Some(last) = self
                .life
                .as_mut()
                .and_then(|l| l.last_mut())
                .filter(|r| r.takes_fill(index, blk))
            {
                last.fill(hash, new_entry);
                return;
            }
        }
        let mut e = Ev::new(BlockEventKind::Filled, Some(index), block, hash);
        if new_entry {
            e.flags |= NEW_ENTRY;
        }
        self.push(e);
    }

    /// Whether a merged record may be added or grow (its events fit).
    #[inline]
    pub(super) fn merges(&self) -> bool {
        self.life.as_ref().is_some_and(|l| l.len() < MERGED_RECORDS)
    }
}

#[cfg(test)]
mod tests {
    use super::super::lifecycle::{expand, BlockEvent, FILL_HASH, WITH_EVICTED, WITH_FILLED};
    use super::*;

    /// A decode block's record: allocated at index `j`, evicting the entry hashed `j + 100`
    /// (owner 7), filled as a new entry hashed `j + 200`.
    fn decode_block(j: u32) -> Ev {
        let mut e = Ev::new(BlockEventKind::Allocated, Some(j), Some(j + 10), None);
        e.hash = u64::from(j) + 100;
        e.owner = 7;
        e.flags |= WITH_EVICTED;
        assert!(e.takes_fill(j, j + 10));
        e.fill(Some(u64::from(j) + 200), true);
        assert!(!e.takes_fill(j, j + 10));
        e
    }

    #[test]
    fn a_merged_record_expands_to_its_three_events_in_order() {
        let e = decode_block(3);
        assert_eq!(e.events(), 3);
        let mut v = Vec::new();
        e.expand(|x| v.push(x.event(None)));
        let ev = |event, hash, new_entry| BlockEvent {
            event,
            index: Some(3),
            block: Some(13),
            hash,
            new_entry,
            owner: None,
            seq: None,
        };
        assert_eq!(
            v,
            vec![
                ev(BlockEventKind::Evicted, Some(103), false),
                ev(BlockEventKind::Allocated, None, false),
                ev(BlockEventKind::Filled, Some(203), true),
            ]
        );
        assert_eq!(v.len(), 3);
        // The owner id stays with the eviction alone.
        let mut owners = Vec::new();
        e.expand(|x| owners.push(x.owner));
        assert_eq!(owners, vec![7, NONE, NONE]);
        // A fill without a hash sets no FILL_HASH.
        let mut f = Ev::new(BlockEventKind::Allocated, Some(1), Some(2), None);
        f.fill(None, false);
        assert_eq!(f.flags & (WITH_FILLED | FILL_HASH), WITH_FILLED);
        let mut w = Vec::new();
        f.expand(|x| w.push(x.event(None)));
        assert_eq!(w[1].event, BlockEventKind::Filled);
        assert_eq!((w[1].hash, w[1].new_entry), (None, false));
    }

    /// 1,365 merged records stand for 4,095 events: one more event fits the 4,096, the next
    /// two are counted as dropped; past 1,365 records nothing merges.
    #[test]
    fn merged_records_keep_the_event_limit() {
        let mut h = Hot {
            life: Some(Vec::new()),
            ..Default::default()
        };
        for j in 0..MERGED_RECORDS as u32 {
            assert!(h.merges());
            assert!(h.push(decode_block(j)));
        }
        assert_eq!(MERGED_RECORDS, 1365);
        assert!(!h.merges());
        let plain = Ev::new(BlockEventKind::Hit, Some(0), Some(0), None);
        assert!(h.push(plain));
        assert!(!h.push(plain));
        assert!(!h.push(plain));
        let l = h.life.as_ref().unwrap();
        assert_eq!((l.len(), expanded_len(l)), (1366, MAX_BLOCK_EVENTS));
        assert_eq!((h.counted, h.dropped), (4096, 2));
        assert_eq!(expand(l).len(), MAX_BLOCK_EVENTS);
    }
}
