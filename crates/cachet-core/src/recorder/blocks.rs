//! What the recorder knows about each cached block: who created it, when, how often a lookup
//! found it, its tokens, and its place among its siblings (the blocks cached under the same
//! parent, most recently used first). Dense by block id, so keeping it up to date costs a few
//! stores per new entry and no hashing; the inspector, the divergence point and the "whose was
//! it" of an eviction read it.
//!
//! Laid out for the step, which creates and drops entries at every block boundary, over the
//! inspector, which is rare. What the step reads and writes of an entry is small and dense: its
//! sibling links and children's head (16 bytes, [`Node`]), a byte of state bits, and its
//! creator, an id into a small table of labels ([`Creators`], swept now and then, so an entry
//! costs no atomic reference count on a label that may have gone cold long ago). What only
//! queries read (its hash, times, hits, depth, root key: one 64-byte line, [`Entry`]) and its
//! tokens (one line for a 16-token block) are written whole past the caches when it is
//! created, and never read by the step.
//!
//! Dropping an entry touches only the creator id and the state byte: its links (and the
//! neighbours they name) were last touched a whole pool cycle ago. The dropped entry stays in
//! its sibling list and its children stay under it, skipped by every reader (none is live)
//! until its block becomes an entry again: creating it reads those links anyway, and detaches
//! the dropped one first.

use std::sync::Arc;

pub(crate) use super::creators::Creators;

use serde::{Deserialize, Serialize};

#[cfg(test)]
use crate::events::wire_hash;
#[cfg(test)]
use crate::hash::BlockHash;
use crate::{BlockId, TokenId};

/// No block, no creator.
pub(crate) const NONE: u32 = u32::MAX;

/// An entry's place among its siblings and its children's head: what the step reads and
/// writes of it, 16 bytes in a dense array, so that an entry's links and its neighbours' share
/// lines with other entries' and stay in the core's caches far longer than a line per entry
/// would. (Whether the slot is in the index's structure, and in a sibling list, are bits
/// beside it: [`BlockIndex::occupied`], [`BlockIndex::linked`].)
#[derive(Clone, Copy, Debug)]
#[repr(C, align(16))]
struct Node {
    /// Parent block id; `NONE` for a root block (depth 0) or an orphan (its parent's entry is
    /// gone).
    parent: u32,
    next: u32,
    prev: u32,
    /// The head of its children's list (most recently used first).
    first_child: u32,
}

const EMPTY: Node = Node {
    parent: NONE,
    next: NONE,
    prev: NONE,
    first_child: NONE,
};

const _: () = assert!(std::mem::size_of::<Node>() == 16);

/// A block's state bits ([`BlockIndex::state`]): it holds a live entry; its slot is in the
/// index's structure (a live entry, or a dropped one not detached yet); it is in a sibling
/// list (a root's list, or its parent's children).
const CACHED: u8 = 1;
const OCCUPIED: u8 = 2;
const LINKED: u8 = 4;

/// What only queries read of an entry (and a hit updates), one line, written whole past the
/// caches when the entry is created: the step never reads it.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Entry {
    /// The entry's hash as KV events carry it (64 bits of a cryptographic hash).
    hash: u64,
    created: f64,
    /// NaN: never found.
    last_hit: f64,
    /// Digest of the creating request's salt, adapter and tenant (`insight::root_key`): a
    /// divergence is only reported against an entry with the same one.
    root_key: u64,
    hits: u32,
    depth: u32,
}

const BLANK: Entry = Entry {
    hash: 0,
    created: 0.0,
    last_hit: f64::NAN,
    root_key: 0,
    hits: 0,
    depth: 0,
};

const _: () = assert!(std::mem::size_of::<Entry>() == 64);

/// One of the hottest cached prefixes (`GET /v1/cache`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HotPrefix {
    /// Index of the prefix's last block (0: the first block of a prompt).
    pub depth: u32,
    /// Tokens of the prefix: `(depth + 1) · B`.
    pub tokens: u64,
    /// First-admission lookups that found this block.
    pub hits: u64,
    /// Seconds since the entry was created.
    pub age_s: f64,
    /// Seconds since a lookup last found it.
    pub last_hit_s: Option<f64>,
    /// The request that created the entry.
    pub created_by: Option<Arc<str>>,
    /// The block's hash as KV events carry it.
    pub hash: u64,
}

/// Where a prompt first differs from a cached sibling of its first uncached block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Sibling {
    pub block: BlockId,
    /// Offset in the block of the first differing token.
    pub offset: usize,
}

#[derive(Debug, Default)]
pub(crate) struct BlockIndex {
    b: usize,
    nodes: Vec<Node>,
    entries: Vec<Entry>,
    /// Block `i`'s [`CACHED`], [`OCCUPIED`] and [`LINKED`] bits, a byte each.
    state: Vec<u8>,
    /// Block `i`'s entry's creator, an id in [`BlockIndex::creators`] held by the entry
    /// (`NONE`: no live entry); dense, so that dropping an entry reads no line of its slot.
    owner: Vec<u32>,
    /// Entries' tokens, block `i`'s at `tok0 + i·B`: `tok0` puts them on a 64-byte boundary, so
    /// that a 16-token block is one line (written whole at creation, past the caches), not
    /// parts of two.
    tokens: Vec<TokenId>,
    tok0: usize,
    root_first: u32,
    pub(crate) creators: Creators,
}

impl BlockIndex {
    pub(crate) fn new(num_blocks: usize, block_size: usize) -> Self {
        const LINE: usize = 64 / std::mem::size_of::<TokenId>();
        let tokens = vec![0; num_blocks * block_size + LINE];
        let tok0 = tokens.as_ptr().align_offset(64).min(LINE);
        BlockIndex {
            b: block_size,
            nodes: vec![EMPTY; num_blocks],
            entries: vec![BLANK; num_blocks],
            state: vec![0; num_blocks],
            owner: vec![NONE; num_blocks],
            tokens,
            tok0,
            root_first: NONE,
            creators: Creators::default(),
        }
    }

    fn n(&self, block: BlockId) -> Option<&Node> {
        self.nodes.get(block as usize)
    }

    #[inline]
    fn has(&self, i: usize, bit: u8) -> bool {
        self.state.get(i).is_some_and(|s| s & bit != 0)
    }

    #[inline]
    fn clear(&mut self, i: usize, bits: u8) {
        if let Some(s) = self.state.get_mut(i) {
            *s &= !bits;
        }
    }

    #[inline]
    fn is_cached(&self, i: usize) -> bool {
        self.has(i, CACHED)
    }

    #[inline]
    fn is_linked(&self, i: usize) -> bool {
        self.has(i, LINKED)
    }

    /// Start loading what creating an entry in `block` under `parent` (`NONE`: none) reads:
    /// the entry's links, its creator id and the parent's links (its children's head). (Its
    /// line and tokens are written past the caches, never read.)
    #[inline]
    pub(crate) fn prefetch_create(&self, block: BlockId, parent: BlockId) {
        if let Some(s) = self.nodes.get(block as usize) {
            super::prefetch(s);
        }
        if let Some(o) = self.owner.get(block as usize) {
            super::prefetch(o);
        }
        if let Some(p) = self.nodes.get(parent as usize) {
            super::prefetch(p);
        }
    }

    /// Tokens per block.
    pub(crate) fn block_size(&self) -> usize {
        self.b
    }

    /// Start loading what dropping the entry in `block` reads (its creator id).
    #[inline]
    pub(crate) fn prefetch_owner(&self, block: BlockId) {
        if let Some(o) = self.owner.get(block as usize) {
            super::prefetch(o);
        }
    }

    /// The creator ids live entries name (tests).
    #[cfg(test)]
    pub(crate) fn entry_creators(&self) -> Vec<u32> {
        named(&self.state, &self.owner).collect()
    }

    /// Whether [`BlockIndex::create`] makes an entry in `block` from `ntokens` tokens.
    pub(crate) fn takes(&self, block: BlockId, ntokens: usize) -> bool {
        (block as usize) < self.nodes.len() && ntokens == self.b
    }

    /// Whether `block` holds the entry `hash` as far as the index knows.
    #[cfg(test)]
    pub(crate) fn holds(&self, block: BlockId, hash: &BlockHash) -> bool {
        self.is_cached(block as usize)
            && self.entries.get(block as usize).map(|e| e.hash) == Some(wire_hash(hash))
    }

    /// The request that created the entry `block` holds.
    pub(crate) fn creator(&self, block: BlockId) -> Option<Arc<str>> {
        if !self.is_cached(block as usize) {
            return None;
        }
        self.creators.label(*self.owner.get(block as usize)?)
    }

    fn head(&self, parent: u32) -> u32 {
        if parent == NONE {
            self.root_first
        } else {
            self.nodes[parent as usize].first_child
        }
    }

    fn set_head(&mut self, parent: u32, v: u32) {
        if parent == NONE {
            self.root_first = v;
        } else {
            self.nodes[parent as usize].first_child = v;
        }
    }

    fn unlink(&mut self, i: u32) {
        if !self.is_linked(i as usize) {
            return;
        }
        let m = &self.nodes[i as usize];
        let (prev, next, parent) = (m.prev, m.next, m.parent);
        if prev == NONE {
            self.set_head(parent, next);
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next != NONE {
            self.nodes[next as usize].prev = prev;
        }
        self.clear(i as usize, LINKED);
        let m = &mut self.nodes[i as usize];
        m.prev = NONE;
        m.next = NONE;
    }

    fn link_front(&mut self, i: u32) {
        let parent = self.nodes[i as usize].parent;
        self.link_front_under(i, parent);
    }

    /// [`BlockIndex::link_front`] with the entry's parent given (not read back from a slot
    /// just written).
    fn link_front_under(&mut self, i: u32, parent: u32) {
        let head = self.head(parent);
        if head != NONE {
            self.nodes[head as usize].prev = i;
        }
        let m = &mut self.nodes[i as usize];
        m.next = head;
        m.prev = NONE;
        self.state[i as usize] |= LINKED;
        self.set_head(parent, i);
    }

    /// `block` became the entry `hash` at `depth`, under `parent` (`None` at depth 0, or when
    /// the parent's entry is not known: an orphan, in no sibling list), created by the request
    /// with the id `creator` of [`BlockIndex::creators`] (which the entry names from then on).
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn created(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        depth: u32,
        parent: Option<BlockId>,
        tokens: &[TokenId],
        root_key: u64,
        creator: u32,
        now: f64,
    ) {
        self.create(
            block,
            wire_hash(&hash),
            depth,
            parent.unwrap_or(NONE),
            tokens,
            root_key,
            creator,
            now,
        );
    }

    /// [`BlockIndex::created`], with the entry's hash as KV events carry it and `parent`
    /// `NONE` at depth 0 or when not known.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(crate) fn create(
        &mut self,
        block: BlockId,
        wire: u64,
        depth: u32,
        parent: BlockId,
        tokens: &[TokenId],
        root_key: u64,
        creator: u32,
        now: f64,
    ) -> bool {
        let i = block as usize;
        if !self.takes(block, tokens.len()) {
            return false;
        }
        if self.is_cached(i) {
            self.evicted(block);
        }
        if self.has(i, OCCUPIED) {
            self.detach(block);
        }
        let parent = if self.is_cached(parent as usize) {
            parent
        } else {
            NONE
        };
        let orphan = depth > 0 && parent == NONE;
        self.owner[i] = creator;
        // Linked at the front of its siblings as it is written (no read-back of the line).
        let head = if orphan { NONE } else { self.head(parent) };
        self.state[i] = if orphan {
            CACHED | OCCUPIED
        } else {
            CACHED | OCCUPIED | LINKED
        };
        self.nodes[i] = Node {
            parent,
            next: head,
            prev: NONE,
            first_child: NONE,
        };
        super::stream(
            &mut self.entries[i],
            Entry {
                hash: wire,
                created: now,
                last_hit: f64::NAN,
                root_key,
                hits: 0,
                depth,
            },
        );
        let t = self.tokens_at(i);
        super::stream_tokens(&mut self.tokens[t..t + self.b], tokens);
        if !orphan {
            if head != NONE {
                self.nodes[head as usize].prev = block;
            }
            self.set_head(parent, block);
        }
        true
    }

    /// A lookup found `block`: it becomes the most recently used of its siblings.
    pub(crate) fn hit(&mut self, block: BlockId, now: f64) {
        let i = block as usize;
        // (Out of range: not cached.)
        if !self.is_cached(i) {
            return;
        }
        let linked = self.is_linked(i);
        let c = &mut self.entries[i];
        c.hits = c.hits.saturating_add(1);
        c.last_hit = now;
        if linked {
            self.unlink(block);
            self.link_front(block);
        }
    }

    /// The entry `block` held was dropped; returns its creator's id (for the lifecycle record
    /// of the eviction to name). Reads and writes no line of its slot: it stays in its sibling
    /// list, and its children under it, until it is detached ([`BlockIndex::detach`]), which
    /// creating an entry in the block does first.
    pub(crate) fn evicted(&mut self, block: BlockId) -> Option<u32> {
        let i = block as usize;
        if !self.is_cached(i) {
            return None;
        }
        self.clear(i, CACHED);
        let creator = std::mem::replace(&mut self.owner[i], NONE);
        (creator != NONE).then_some(creator)
    }

    /// Take the dropped entry in `block` out of the structure: out of its sibling list, its
    /// children orphans.
    fn detach(&mut self, block: BlockId) {
        let i = block as usize;
        self.unlink(block);
        let mut c = self.nodes[i].first_child;
        while c != NONE {
            let m = &mut self.nodes[c as usize];
            let next = m.next;
            m.parent = NONE;
            m.prev = NONE;
            m.next = NONE;
            self.clear(c as usize, LINKED);
            c = next;
        }
        // What only queries read is left as it was: nothing reads it of an uncached block, and
        // the next entry here writes it anew.
        self.nodes[i] = EMPTY;
        self.clear(i, OCCUPIED | LINKED);
    }

    /// Sweep the creator ids ([`Creators::sweep`]): in use are the live entries' and those of
    /// `records` (the lifecycle log's).
    pub(crate) fn sweep_creators(&mut self, records: impl Iterator<Item = u32>) {
        self.creators
            .sweep(named(&self.state, &self.owner).chain(records));
    }

    /// Every entry was dropped.
    pub(crate) fn reset(&mut self) {
        for i in 0..self.nodes.len() {
            self.owner[i] = NONE;
            self.nodes[i] = EMPTY;
            self.entries[i] = BLANK;
        }
        self.state.fill(0);
        self.root_first = NONE;
    }

    /// The most recently used cached sibling of a block with `ours` tokens (a full block or a
    /// prompt's tail) under `parent` (`None`: a root block) whose tokens differ from ours
    /// within `ours`, and where; only siblings created under the same `root_key` are visible
    /// (another tenant's tokens are never shown, even where the tenants share the cache).
    pub(crate) fn diverging_sibling(
        &self,
        parent: Option<BlockId>,
        root_key: u64,
        ours: &[TokenId],
    ) -> Option<Sibling> {
        const MAX_SCAN: usize = 64;
        // Dropped entries not detached yet are passed over, up to as many again (they are
        // mostly at the least recently used end, where eviction takes its blocks).
        const MAX_DROPPED: usize = MAX_SCAN;
        let mut c = match parent {
            None => self.root_first,
            Some(p) if self.is_cached(p as usize) => self.n(p)?.first_child,
            Some(_) => return None,
        };
        let (mut scanned, mut passed) = (0, 0);
        while c != NONE && scanned < MAX_SCAN {
            let next = self.nodes[c as usize].next;
            if !self.is_cached(c as usize) {
                passed += 1;
                if passed > MAX_DROPPED {
                    break;
                }
                c = next;
                continue;
            }
            scanned += 1;
            if self.entries[c as usize].root_key == root_key {
                let theirs = self.tokens(c);
                if let Some(offset) = ours.iter().zip(theirs).position(|(a, b)| a != b) {
                    return Some(Sibling { block: c, offset });
                }
            }
            c = next;
        }
        None
    }

    /// Tokens of a cached block.
    pub(crate) fn tokens(&self, block: BlockId) -> &[TokenId] {
        let t = self.tokens_at(block as usize);
        self.tokens.get(t..t + self.b).unwrap_or(&[])
    }

    /// Where block `i`'s tokens start in [`BlockIndex::tokens`].
    #[inline]
    fn tokens_at(&self, i: usize) -> usize {
        self.tok0 + i * self.b
    }

    /// The `n` hottest cached prefixes: blocks found by the most lookups, each the deepest
    /// block of its run (a block whose cached child was found as often is reported as the
    /// child), ties broken by depth. (The caller applies queued changes first.)
    pub(crate) fn hottest(&self, now: f64, n: usize) -> Vec<HotPrefix> {
        let mut out: Vec<(u64, u32, u32)> = Vec::new();
        for (i, m) in self.nodes.iter().enumerate() {
            let hits = self.entries[i].hits;
            if !self.is_cached(i) || hits == 0 {
                continue;
            }
            let mut c = m.first_child;
            let mut extended = false;
            while c != NONE {
                if self.is_cached(c as usize) && self.entries[c as usize].hits >= hits {
                    extended = true;
                    break;
                }
                c = self.nodes[c as usize].next;
            }
            if !extended {
                out.push((u64::from(hits), self.entries[i].depth, i as u32));
            }
        }
        out.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        out.truncate(n);
        out.into_iter()
            .map(|(hits, depth, i)| {
                let c = &self.entries[i as usize];
                HotPrefix {
                    depth,
                    tokens: (depth as u64 + 1) * self.b as u64,
                    hits,
                    age_s: (now - c.created).max(0.0),
                    last_hit_s: (!c.last_hit.is_nan()).then(|| (now - c.last_hit).max(0.0)),
                    created_by: self.creators.label(self.owner[i as usize]),
                    hash: c.hash,
                }
            })
            .collect()
    }

    #[cfg(test)]
    fn siblings(&self, parent: Option<BlockId>) -> Vec<BlockId> {
        let mut v = Vec::new();
        let mut c = match parent {
            None => self.root_first,
            Some(p) => self.nodes[p as usize].first_child,
        };
        while c != NONE {
            if self.is_cached(c as usize) {
                v.push(c);
            }
            c = self.nodes[c as usize].next;
        }
        v
    }
}

/// The creator ids the live entries name, by the blocks' `state` and `owner`.
fn named<'a>(state: &'a [u8], owner: &'a [u32]) -> impl Iterator<Item = u32> + 'a {
    state
        .iter()
        .zip(owner)
        .filter(|&(&s, &o)| s & CACHED != 0 && o != NONE)
        .map(|(_, &o)| o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn siblings_are_most_recently_used_first_and_evictions_orphan_children() {
        let mut ix = BlockIndex::new(8, 2);
        let who = ix.creators.acquire(&"r".into());
        ix.created(0, h(0), 0, None, &[1, 2], 0, who, 0.0);
        ix.created(1, h(1), 1, Some(0), &[3, 4], 0, who, 0.0);
        ix.created(2, h(2), 1, Some(0), &[3, 5], 0, who, 1.0);
        assert_eq!(ix.siblings(Some(0)), vec![2, 1]);
        ix.hit(1, 2.0);
        assert_eq!(ix.siblings(Some(0)), vec![1, 2]);
        // Ours [3, 9]: the most recent sibling (1) differs at offset 1.
        assert_eq!(
            ix.diverging_sibling(Some(0), 0, &[3, 9]),
            Some(Sibling {
                block: 1,
                offset: 1
            })
        );
        // A tail that is a prefix of a sibling does not diverge from it.
        assert_eq!(ix.diverging_sibling(Some(0), 0, &[3]), None);
        // Roots are visible only under the same root key.
        assert_eq!(ix.diverging_sibling(None, 7, &[1, 9]), None);
        assert_eq!(
            ix.diverging_sibling(None, 0, &[1, 9]).map(|s| s.offset),
            Some(1)
        );
        let owner = ix.evicted(0).unwrap();
        assert_eq!(ix.creators.label(owner).as_deref(), Some("r"));
        assert!(ix.siblings(None).is_empty());
        assert!(ix.holds(1, &h(1)) && !ix.holds(0, &h(0)));
        assert_eq!(ix.diverging_sibling(Some(0), 0, &[3, 9]), None);
    }

    /// A dropped entry keeps its place in its sibling list (and its children under it) until its
    /// block becomes an entry again, and no reader sees it meanwhile: a scan passes over it, its
    /// creator is gone, lookups under it find nothing; reusing its block detaches it, and its
    /// children become orphans then.
    #[test]
    fn a_dropped_entry_is_invisible_until_its_block_is_reused() {
        let mut ix = BlockIndex::new(8, 2);
        let a = ix.creators.acquire(&"a".into());
        ix.created(0, h(0), 0, None, &[1, 2], 0, a, 0.0);
        ix.created(1, h(1), 1, Some(0), &[3, 4], 0, a, 0.0);
        ix.created(2, h(2), 1, Some(0), &[3, 5], 0, a, 1.0);
        ix.created(3, h(3), 1, Some(0), &[3, 6], 0, a, 2.0);
        assert_eq!(ix.siblings(Some(0)), vec![3, 2, 1]);
        // The middle sibling is dropped: its line is not touched, it is still linked ...
        assert_eq!(ix.evicted(2), Some(a));
        assert!(ix.is_linked(2) && ix.nodes[1].prev == 2);
        // ... and passed over: ours [3, 6] is block 3's, so the next live sibling (1, not the
        // dropped 2 with [3, 5]) is where it diverges.
        assert_eq!(ix.siblings(Some(0)), vec![3, 1]);
        assert_eq!(
            ix.diverging_sibling(Some(0), 0, &[3, 6]),
            Some(Sibling {
                block: 1,
                offset: 1
            })
        );
        assert_eq!((ix.creator(2), ix.holds(2, &h(2))), (None, false));
        // The parent is dropped: nothing is found under it, its children stay live.
        assert_eq!(ix.evicted(0), Some(a));
        assert_eq!(ix.diverging_sibling(Some(0), 0, &[3, 9]), None);
        assert!(ix.holds(1, &h(1)) && ix.holds(3, &h(3)));
        // Block 2 becomes a root: detached from 0's children first.
        ix.created(2, h(4), 0, None, &[7, 8], 0, a, 3.0);
        assert_eq!(ix.nodes[1].prev, 3);
        assert_eq!(ix.siblings(None), vec![2]);
        // Block 0 becomes a new root: the old entry's children are orphans (not linked, no
        // parent), the new one has none.
        ix.created(0, h(5), 0, None, &[1, 9], 0, a, 4.0);
        for c in [1, 3] {
            assert!(!ix.is_linked(c) && ix.nodes[c].parent == NONE, "block {c}");
        }
        assert!(ix.siblings(Some(0)).is_empty());
        assert_eq!(ix.siblings(None), vec![0, 2]);
        assert_eq!(
            ix.diverging_sibling(None, 0, &[7, 1]).map(|s| s.block),
            Some(0)
        );
        // Entries 0, 1, 2, 3 name the label; after a reset a sweep frees it.
        assert_eq!(ix.creator(3).as_deref(), Some("a"));
        ix.creators.finish(a);
        ix.reset();
        ix.sweep_creators(std::iter::empty());
        assert_eq!(ix.creators.live(), 0);
    }

    /// A 16-token block's tokens are one cache line: written whole, never half of two.
    #[test]
    fn a_blocks_tokens_start_on_a_line() {
        for n in [1, 7, 1000] {
            let ix = BlockIndex::new(n, 16);
            for blk in [0, n - 1] {
                let first = ix.tokens(blk as BlockId).as_ptr() as usize;
                assert_eq!(first % 64, 0, "{n} blocks, block {blk}");
            }
            assert_eq!(ix.tokens(0).len(), 16);
        }
    }

    #[test]
    fn hottest_reports_the_deepest_block_of_a_run() {
        let mut ix = BlockIndex::new(8, 4);
        let who = ix.creators.acquire(&"a".into());
        ix.created(0, h(0), 0, None, &[0; 4], 0, who, 0.0);
        ix.created(1, h(1), 1, Some(0), &[1; 4], 0, who, 0.0);
        ix.created(2, h(2), 1, Some(0), &[2; 4], 0, who, 0.0);
        for _ in 0..3 {
            ix.hit(0, 5.0);
        }
        for _ in 0..2 {
            ix.hit(1, 5.0);
        }
        ix.hit(2, 6.0);
        // Block 0 was found 3 times, more than either child: reported; 1 (2 hits) and 2 (1).
        let hot = ix.hottest(10.0, 5);
        let rows: Vec<_> = hot.iter().map(|p| (p.depth, p.tokens, p.hits)).collect();
        assert_eq!(rows, vec![(0, 4, 3), (1, 8, 2), (1, 8, 1)]);
        assert_eq!(hot[0].age_s, 10.0);
        assert_eq!(hot[2].last_hit_s, Some(4.0));
        // Once the child is found as often, the parent is covered by it.
        ix.hit(1, 7.0);
        let rows: Vec<_> = ix
            .hottest(10.0, 5)
            .iter()
            .map(|p| (p.depth, p.hits))
            .collect();
        assert_eq!(rows, vec![(1, 3), (1, 1)]);
    }

    #[test]
    fn a_creator_lives_while_its_request_an_entry_or_a_record_names_it() {
        let mut ix = BlockIndex::new(4, 2);
        let a = ix.creators.acquire(&"a".into());
        assert!(ix.create(0, 0, 0, NONE, &[1, 2], 0, a, 0.0));
        assert!(ix.create(1, 1, 1, 0, &[3, 4], 0, a, 0.0));
        // Evicted while it lives: the label stays (its request is live).
        assert_eq!(ix.evicted(1), Some(a));
        ix.sweep_creators(std::iter::empty());
        assert_eq!(ix.creator(0).as_deref(), Some("a"));
        // It ended: its entry left names it, so a sweep keeps it.
        ix.creators.finish(a);
        ix.sweep_creators(std::iter::empty());
        assert_eq!(
            (ix.creators.live(), ix.creator(0).as_deref()),
            (1, Some("a"))
        );
        // Its last entry goes too: a record of the eviction still names it.
        assert_eq!(ix.evicted(0), Some(a));
        ix.sweep_creators([a].into_iter());
        assert!(ix.creators.alive(a));
        // Nothing names it: a sweep frees it, and the id is reused.
        ix.sweep_creators(std::iter::empty());
        assert_eq!(ix.creators.live(), 0);
        let b = ix.creators.acquire(&"b".into());
        assert_eq!(b, a);
        assert_eq!(ix.creators.label(b).as_deref(), Some("b"));
        // Re-creating a block drops the entry it held.
        assert!(ix.create(0, 2, 0, NONE, &[5, 6], 0, b, 1.0));
        let c = ix.creators.acquire(&"c".into());
        assert!(ix.create(0, 3, 0, NONE, &[5, 7], 0, c, 2.0));
        ix.creators.finish(b);
        ix.creators.finish(c);
        ix.sweep_creators(std::iter::empty());
        assert_eq!(
            (ix.creators.live(), ix.creator(0).as_deref()),
            (1, Some("c"))
        );
        // A block out of range, or tokens of the wrong length, make no entry.
        assert!(!ix.create(9, 4, 0, NONE, &[1, 2], 0, c, 0.0));
        assert!(!ix.create(3, 4, 0, NONE, &[1], 0, c, 0.0));
    }

    /// A sweep is due when the table has no free id and grew by as many as were in use after
    /// the last one (at least 64).
    #[test]
    fn sweeps_come_when_the_table_doubled() {
        let mut ix = BlockIndex::new(4, 2);
        let mut ids = Vec::new();
        while !ix.creators.wants_sweep() {
            let id = ix.creators.acquire(&"r".into());
            ix.creators.finish(id);
            ids.push(id);
        }
        // At least 64 in use counts as 64: due after 65.
        assert_eq!(ids.len(), 65);
        ix.sweep_creators(std::iter::empty());
        assert_eq!(ix.creators.live(), 0);
        assert!(!ix.creators.wants_sweep());
        // The freed ids are handed out again, lowest first, before the table grows.
        assert_eq!(ix.creators.acquire(&"s".into()), 0);
        assert!(!ix.creators.wants_sweep());
    }
}
