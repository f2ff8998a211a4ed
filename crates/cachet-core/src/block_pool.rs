//! The KV block pool: fixed blocks, reference counts, an O(1) LRU free queue and the prefix
//! cache's hash → block map (spec §1).
//!
//! A block whose reference count drops to zero keeps its cache entry and goes to the back of the
//! free queue. Allocation takes from the front; taking a block that still has a cache entry
//! evicts that entry (lazy eviction). The free queue is an intrusive doubly linked list over
//! block indices, so a cache hit can pull a block out of the middle in O(1).
//!
//! The pool knows nothing about requests and counts nothing: each operation reports its effects
//! (the blocks it evicted, whether a fill created a cache entry) and the caller attributes them.

use hashbrown::HashTable;

use crate::hash::BlockHash;
use crate::BlockId;

const NIL: u32 = u32::MAX;

/// Hot per-block state, 16 bytes; the cache key lives apart in `BlockPool::hashes`.
#[derive(Clone, Debug)]
struct BlockMeta {
    ref_cnt: u32,
    prev: u32,
    next: u32,
    in_free_queue: bool,
    /// This block is the cache entry for `hashes[block]`.
    cached: bool,
}

/// A cache entry dropped because its block was taken by an allocation: the block now belongs to
/// the allocating request, and `hash` is what it held until then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub block: BlockId,
    pub hash: BlockHash,
}

/// What caching a newly full block did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// The block is a new cache entry.
    Created,
    /// Another block already holds this hash; the existing entry is kept.
    AlreadyCached,
}

/// Not enough free blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV block pool exhausted: {requested} blocks requested, {free} free")]
pub struct PoolExhausted {
    pub requested: usize,
    pub free: usize,
}

#[derive(Clone, Debug)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    hashes: Vec<BlockHash>,
    head: u32,
    tail: u32,
    num_free: usize,
    /// Free blocks that still hold a cache entry.
    num_cached_free: usize,
    /// The cache map: block ids keyed by the hash in `hashes[id]` (4 bytes per entry, so the
    /// table stays cache-resident; removing an evicted entry compares ids, not hashes).
    cached: HashTable<BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` free, uncached blocks.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks");
        let n = num_blocks as u32;
        let blocks = (0..n)
            .map(|i| BlockMeta {
                ref_cnt: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
                in_free_queue: true,
                cached: false,
            })
            .collect();
        BlockPool {
            blocks,
            hashes: vec![BlockHash([0; 32]); num_blocks],
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: num_blocks,
            num_cached_free: 0,
            cached: HashTable::with_capacity(num_blocks),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks held by at least one live request.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.num_free
    }

    /// Free blocks that still hold a cache entry (held only by the cache).
    pub fn num_cached_free(&self) -> usize {
        self.num_cached_free
    }

    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Every cache entry as (hash, block), in no particular order (tests, the inspector).
    pub fn cache_entries(&self) -> impl Iterator<Item = (BlockHash, BlockId)> + '_ {
        self.cached.iter().map(|&b| (self.hashes[b as usize], b))
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].ref_cnt
    }

    /// The cache entry a block holds, if any.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks[block as usize]
            .cached
            .then(|| self.hashes[block as usize])
    }

    /// The block that holds `hash` in the prefix cache.
    pub fn lookup(&self, hash: &BlockHash) -> Option<BlockId> {
        self.cached
            .find(key(hash), |&b| self.hashes[b as usize] == *hash)
            .copied()
    }

    /// Take `n` blocks from the front of the free queue, each with ref count 1, and append their
    /// ids to `out`. Blocks that hold a cache entry lose it; each such eviction is appended to
    /// `evicted`. All or nothing: on `Err` nothing changed.
    pub fn allocate(
        &mut self,
        n: usize,
        out: &mut Vec<BlockId>,
        evicted: &mut Vec<Evicted>,
    ) -> Result<(), PoolExhausted> {
        if n > self.num_free {
            return Err(PoolExhausted {
                requested: n,
                free: self.num_free,
            });
        }
        out.reserve(n);
        let mut id = self.head;
        for _ in 0..n {
            let meta = &mut self.blocks[id as usize];
            let next = meta.next;
            meta.ref_cnt = 1;
            meta.prev = NIL;
            meta.next = NIL;
            meta.in_free_queue = false;
            if meta.cached {
                meta.cached = false;
                self.num_cached_free -= 1;
                if let Ok(entry) = self
                    .cached
                    .find_entry(key(&self.hashes[id as usize]), |&b| b == id)
                {
                    entry.remove();
                }
                evicted.push(Evicted {
                    block: id,
                    hash: self.hashes[id as usize],
                });
            }
            out.push(id);
            id = next;
        }
        // Detach the taken run from the front of the queue.
        self.head = id;
        if id == NIL {
            self.tail = NIL;
        } else {
            self.blocks[id as usize].prev = NIL;
        }
        self.num_free -= n;
        Ok(())
    }

    /// Add a reference to each (cache-hit) block, pulling free ones out of the free queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &id in blocks {
            if self.blocks[id as usize].ref_cnt == 0 {
                self.unlink(id);
                if self.blocks[id as usize].cached {
                    self.num_cached_free -= 1;
                }
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Number of `blocks` that are free now (and would leave the free queue if touched).
    pub fn count_free(&self, blocks: &[BlockId]) -> usize {
        blocks
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count()
    }

    /// Drop one reference to each block of a block table. Blocks reaching zero go to the back of
    /// the free queue, the table's tail first, so a prompt's end is evicted before its prefix.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let meta = &mut self.blocks[id as usize];
            debug_assert!(meta.ref_cnt > 0, "double free of block {id}");
            meta.ref_cnt -= 1;
            if meta.ref_cnt == 0 {
                if meta.cached {
                    self.num_cached_free += 1;
                }
                self.push_back(id);
            }
        }
    }

    /// `block` became full: make it the cache entry for `hash` unless another block already is.
    pub fn cache_full_block(&mut self, block: BlockId, hash: BlockHash) -> CacheOutcome {
        let hashes = &mut self.hashes;
        let h = hash;
        match self.cached.entry(
            key(&h),
            |&b| hashes[b as usize] == h,
            |&b| key(&hashes[b as usize]),
        ) {
            hashbrown::hash_table::Entry::Occupied(_) => CacheOutcome::AlreadyCached,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(block);
                self.blocks[block as usize].cached = true;
                hashes[block as usize] = h;
                CacheOutcome::Created
            }
        }
    }

    /// The hashes of the cache entries, in free-queue order (the next evicted first).
    pub fn cached_in_queue_order(&self) -> Vec<BlockHash> {
        self.free_queue()
            .into_iter()
            .filter_map(|b| self.block_hash(b))
            .collect()
    }

    /// Every cache entry's block and hash: those in use first, then the free ones in free-queue
    /// order (the next evicted first).
    pub fn cached_blocks(&self) -> Vec<(BlockId, BlockHash)> {
        let free = self.free_queue();
        let mut in_free = vec![false; self.blocks.len()];
        for b in &free {
            in_free[*b as usize] = true;
        }
        let used = (0..self.blocks.len() as BlockId).filter(|b| !in_free[*b as usize]);
        used.chain(free)
            .filter_map(|b| self.block_hash(b).map(|h| (b, h)))
            .collect()
    }

    /// Drop every cache entry. Only allowed while no block is in use; returns whether it ran.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.blocks.len() {
            return false;
        }
        for meta in &mut self.blocks {
            meta.cached = false;
        }
        self.cached.clear();
        self.num_cached_free = 0;
        true
    }

    /// Free-queue order, front first (for tests and debugging).
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut cur = self.head;
        while cur != NIL {
            out.push(cur);
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    /// Check every structural invariant; returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let queue = self.free_queue();
        if queue.len() != self.num_free {
            return Err(format!(
                "free queue has {} blocks, num_free is {}",
                queue.len(),
                self.num_free
            ));
        }
        let mut seen = vec![false; self.blocks.len()];
        let mut prev = NIL;
        for &id in &queue {
            let meta = &self.blocks[id as usize];
            if seen[id as usize] {
                return Err(format!("block {id} twice in the free queue"));
            }
            seen[id as usize] = true;
            if meta.ref_cnt != 0 || !meta.in_free_queue || meta.prev != prev {
                return Err(format!(
                    "block {id} in the free queue is inconsistent: {meta:?}"
                ));
            }
            prev = id;
        }
        if self.tail != prev {
            return Err("free queue tail is wrong".into());
        }
        let mut cached_free = 0;
        for (id, meta) in self.blocks.iter().enumerate() {
            if meta.in_free_queue != (meta.ref_cnt == 0) {
                return Err(format!(
                    "block {id}: ref {} but in_free_queue {}",
                    meta.ref_cnt, meta.in_free_queue
                ));
            }
            if meta.cached {
                let h = self.hashes[id];
                if self.lookup(&h) != Some(id as BlockId) {
                    return Err(format!("block {id} holds hash {h:?} that maps elsewhere"));
                }
                if meta.ref_cnt == 0 {
                    cached_free += 1;
                }
            }
        }
        for &id in self.cached.iter() {
            match self.block_hash(id) {
                Some(h) if self.lookup(&h) == Some(id) => {}
                _ => {
                    return Err(format!(
                        "cache map holds block {id}, which is not its entry"
                    ))
                }
            }
        }
        if cached_free != self.num_cached_free {
            return Err(format!(
                "num_cached_free {} but counted {cached_free}",
                self.num_cached_free
            ));
        }
        Ok(())
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let m = &self.blocks[id as usize];
            debug_assert!(m.in_free_queue);
            (m.prev, m.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let m = &mut self.blocks[id as usize];
        m.prev = NIL;
        m.next = NIL;
        m.in_free_queue = false;
        self.num_free -= 1;
    }

    fn push_back(&mut self, id: BlockId) {
        let old_tail = self.tail;
        {
            let m = &mut self.blocks[id as usize];
            m.prev = old_tail;
            m.next = NIL;
            m.in_free_queue = true;
        }
        if old_tail == NIL {
            self.head = id;
        } else {
            self.blocks[old_tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }
}

/// The table key of a block hash: its first eight bytes (already uniformly random).
fn key(hash: &BlockHash) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&hash.0[..8]);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn alloc(p: &mut BlockPool, n: usize, out: &mut Vec<BlockId>) -> Vec<Evicted> {
        let mut ev = Vec::new();
        p.allocate(n, out, &mut ev).unwrap();
        ev
    }

    #[test]
    fn allocate_takes_from_front_and_free_appends_tail_first() {
        let mut p = BlockPool::new(4);
        let mut a = Vec::new();
        assert!(alloc(&mut p, 3, &mut a).is_empty());
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(p.free_queue(), vec![3]);
        p.free(&a);
        // Tail first: 2, then 1, then 0.
        assert_eq!(p.free_queue(), vec![3, 2, 1, 0]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn hit_pulls_block_from_middle_and_allocation_evicts_lazily() {
        let mut p = BlockPool::new(3);
        let mut a = Vec::new();
        alloc(&mut p, 3, &mut a);
        for (i, &b) in a.iter().enumerate() {
            assert_eq!(p.cache_full_block(b, h(i as u8)), CacheOutcome::Created);
        }
        p.free(&a);
        assert_eq!(p.free_queue(), vec![2, 1, 0]);
        assert_eq!(p.num_cached_free(), 3);
        // A hit on block 1 (middle of the queue).
        assert_eq!(p.lookup(&h(1)), Some(1));
        p.touch(&[1]);
        assert_eq!(p.free_queue(), vec![2, 0]);
        assert_eq!(p.num_cached_free(), 2);
        let mut b = Vec::new();
        let ev = alloc(&mut p, 1, &mut b);
        assert_eq!(b, vec![2]);
        assert_eq!(
            ev,
            vec![Evicted {
                block: 2,
                hash: h(2)
            }]
        );
        assert_eq!(p.lookup(&h(2)), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_hash_keeps_existing_entry() {
        let mut p = BlockPool::new(2);
        let mut a = Vec::new();
        alloc(&mut p, 2, &mut a);
        assert_eq!(p.cache_full_block(0, h(7)), CacheOutcome::Created);
        assert_eq!(p.cache_full_block(1, h(7)), CacheOutcome::AlreadyCached);
        assert_eq!(p.lookup(&h(7)), Some(0));
        assert_eq!(p.block_hash(1), None);
        p.free(&a);
        p.check_invariants().unwrap();
    }

    #[test]
    fn exhaustion_is_an_error_and_changes_nothing() {
        let mut p = BlockPool::new(2);
        let mut a = Vec::new();
        let mut ev = Vec::new();
        assert_eq!(
            p.allocate(3, &mut a, &mut ev),
            Err(PoolExhausted {
                requested: 3,
                free: 2
            })
        );
        assert!(a.is_empty() && ev.is_empty());
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn reset_only_when_idle() {
        let mut p = BlockPool::new(2);
        let mut a = Vec::new();
        alloc(&mut p, 1, &mut a);
        p.cache_full_block(a[0], h(1));
        assert!(!p.reset_prefix_cache());
        p.free(&a);
        assert!(p.reset_prefix_cache());
        assert_eq!(p.lookup(&h(1)), None);
        assert_eq!(p.num_cached_free(), 0);
        p.check_invariants().unwrap();
    }
}
