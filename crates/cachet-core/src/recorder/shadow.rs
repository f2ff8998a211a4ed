//! The shadow set: hashes of recently evicted blocks, and what a pool 2x and 4x as large would
//! still hold.
//!
//! Why it estimates a larger pool. The pool's free queue is an LRU list; a pool with `k·C`
//! blocks run on the same request stream holds, in front of the queue of the `C`-block pool, a
//! *victim region* `V` of `(k-1)·C` blocks: the ones the small pool evicted most recently (the
//! first `(k-1)·C` entries are the never-used blocks it starts with). Every allocation of `m`
//! blocks appends the `m` blocks the small pool took (evicted entries, or blocks with no
//! entry) to `V`; the large pool, which found `h` of the request's blocks in `V` (removed from
//! it as hits), takes only `m - h` from `V`'s front. So `V` stays `(k-1)·C` long and the large
//! pool's lookup finds exactly the small pool's hits plus the run of following blocks that sit
//! in `V`. That holds while both pools see the same schedule — one request at a time, no
//! preemption — and while a request that recomputes a block already cached elsewhere (a
//! broken chain, a capped last block later extended) does not reorder the queue differently in
//! the two pools. Beyond that (concurrency, where a larger pool would also admit and preempt
//! differently) it is an estimate; the simulator test compares it with real 2x and 4x runs.
//!
//! Keys are the first 8 bytes of the block hash (a cryptographic hash: a collision among the
//! few thousand keys held is negligible, and would only mislabel one block's miss reason).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::hash::BlockHash;

/// The first 8 bytes of a block hash, as the shadow set's key.
pub(crate) fn key(h: &BlockHash) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&h.0[..8]);
    u64::from_le_bytes(w)
}

/// Keys are already uniform: no second hash.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// The scales estimated: a pool 2x and 4x as large.
pub(crate) const SCALES: [usize; 2] = [2, 4];

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// `None`: a block the small pool took that held no cache entry.
    key: Option<u64>,
    /// Taken from the victim region of scale `i` as a hit.
    taken: [bool; 2],
}

/// The victim region of one larger pool, as a window of the shadow's entries.
#[derive(Debug)]
struct Ghost {
    /// `(k-1)·C`, at most the shadow's capacity.
    cap: usize,
    /// Sequence number of the region's first entry.
    front: u64,
    /// Never-used blocks in front of `front`.
    virgin: usize,
    /// Blocks in the region (virgin ones included, taken ones not).
    live: usize,
}

impl Ghost {
    fn new(cap: usize, front: u64) -> Self {
        Ghost {
            cap,
            front,
            virgin: cap,
            live: cap,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Shadow {
    /// Entries by sequence number: `entries[i]` has number `base + i`.
    entries: VecDeque<Entry>,
    base: u64,
    /// Latest sequence number of each key in `entries`.
    seq_of: IdMap<u64>,
    /// Most entries kept (`--eviction-shadow-blocks`).
    cap: usize,
    ghosts: [Ghost; 2],
}

impl Shadow {
    /// A shadow of `cap` entries for a pool of `num_blocks` blocks.
    pub(crate) fn new(num_blocks: usize, cap: usize) -> Self {
        let ghost = |k: usize| Ghost::new(((k - 1) * num_blocks).min(cap), 0);
        Shadow {
            entries: VecDeque::new(),
            base: 0,
            seq_of: IdMap::default(),
            cap,
            ghosts: [ghost(SCALES[0]), ghost(SCALES[1])],
        }
    }

    fn next(&self) -> u64 {
        self.base + self.entries.len() as u64
    }

    /// Whether `h` was evicted within the last `cap` blocks taken.
    pub(crate) fn contains(&self, h: &BlockHash) -> bool {
        self.seq_of.contains_key(&key(h))
    }

    /// Whether the pool of scale `SCALES[g]` would still hold `h` (it is in its victim region).
    pub(crate) fn ghost_holds(&self, g: usize, h: &BlockHash) -> bool {
        let Some(&seq) = self.seq_of.get(&key(h)) else {
            return false;
        };
        seq >= self.ghosts[g].front
            && self
                .entries
                .get((seq - self.base) as usize)
                .is_some_and(|e| !e.taken[g])
    }

    /// The larger pool found `h` in its victim region: it leaves the region (in use there).
    pub(crate) fn ghost_take(&mut self, g: usize, h: &BlockHash) {
        let Some(&seq) = self.seq_of.get(&key(h)) else {
            return;
        };
        if seq < self.ghosts[g].front {
            return;
        }
        if let Some(e) = self.entries.get_mut((seq - self.base) as usize) {
            if !e.taken[g] {
                e.taken[g] = true;
                self.ghosts[g].live -= 1;
            }
        }
    }

    /// The small pool took these blocks from its free queue, in queue order, each with the
    /// hash of the entry it evicted (`None`: a block that held no entry). The regions are
    /// trimmed back to length by [`Shadow::trim`], after the larger pools' hits of the same
    /// admission are taken out.
    pub(crate) fn take_blocks(&mut self, taken: impl Iterator<Item = Option<BlockHash>>) {
        for h in taken {
            self.push(h.as_ref().map(key));
        }
    }

    /// Tests: `evicted` entries first, then blocks with none, `taken` in all.
    #[cfg(test)]
    fn taken(&mut self, evicted: impl Iterator<Item = BlockHash>, taken: usize) {
        let ev: Vec<_> = evicted.map(Some).collect();
        let n = ev.len();
        self.take_blocks(ev.into_iter().chain((n..taken).map(|_| None)));
    }

    fn push(&mut self, k: Option<u64>) {
        let seq = self.next();
        if let Some(k) = k {
            self.seq_of.insert(k, seq);
        }
        self.entries.push_back(Entry {
            key: k,
            taken: [false; 2],
        });
        for g in &mut self.ghosts {
            g.live += 1;
        }
    }

    pub(crate) fn trim(&mut self) {
        let next = self.next();
        for gi in 0..self.ghosts.len() {
            loop {
                let g = &self.ghosts[gi];
                // The region spans at most `cap` entries even when hits thinned it out.
                let over_span = g.front < next && (next - g.front) as usize > self.cap;
                if !over_span {
                    if g.live <= g.cap {
                        break;
                    }
                    if g.virgin > 0 {
                        let g = &mut self.ghosts[gi];
                        g.virgin -= 1;
                        g.live -= 1;
                        continue;
                    }
                    if g.front >= next {
                        break;
                    }
                }
                let taken = self
                    .entries
                    .get((g.front - self.base) as usize)
                    .is_some_and(|e| e.taken[gi]);
                let g = &mut self.ghosts[gi];
                if !taken {
                    g.live -= 1;
                }
                g.front += 1;
            }
        }
        // `contains` remembers the last `cap` entries; no region reaches further back.
        let lo = next.saturating_sub(self.cap as u64);
        while self.base < lo {
            let Some(e) = self.entries.pop_front() else {
                break;
            };
            if let Some(k) = e.key {
                // One probe: remove only if this entry is still the key's latest.
                if let std::collections::hash_map::Entry::Occupied(o) = self.seq_of.entry(k) {
                    if *o.get() == self.base {
                        o.remove();
                    }
                }
            }
            self.base += 1;
        }
    }

    /// The cache was reset: the larger pools would have dropped everything too. What was
    /// evicted before stays remembered as evicted.
    pub(crate) fn reset(&mut self) {
        let next = self.next();
        for g in &mut self.ghosts {
            *g = Ghost::new(g.cap, next);
        }
        self.trim();
    }

    #[cfg(test)]
    fn live(&self, g: usize) -> usize {
        self.ghosts[g].live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn remembers_the_last_cap_evictions() {
        let mut s = Shadow::new(2, 3);
        s.taken([h(1), h(2)].into_iter(), 2);
        s.trim();
        s.taken([h(3), h(4)].into_iter(), 2);
        s.trim();
        assert!(!s.contains(&h(1)));
        assert!(s.contains(&h(2)) && s.contains(&h(4)));
        // A block with no entry takes a place too.
        s.taken(std::iter::empty(), 1);
        s.trim();
        assert!(!s.contains(&h(2)));
    }

    #[test]
    fn victim_regions_hold_k_minus_one_pools() {
        // C = 2: the 2x region holds 2 blocks, the 4x region 6 (shadow 6).
        let mut s = Shadow::new(2, 6);
        assert_eq!((s.live(0), s.live(1)), (2, 6));
        s.taken([h(1), h(2), h(3)].into_iter(), 3);
        s.trim();
        // Regions keep their length: the virgin blocks go first.
        assert_eq!((s.live(0), s.live(1)), (2, 6));
        assert!(!s.ghost_holds(0, &h(1)));
        assert!(s.ghost_holds(0, &h(2)) && s.ghost_holds(0, &h(3)));
        assert!(s.ghost_holds(1, &h(1)));
        // The 2x pool finds 3 as a hit: it leaves the region, and the next block the small
        // pool takes does not push 2 out.
        s.ghost_take(0, &h(3));
        assert!(!s.ghost_holds(0, &h(3)));
        assert!(s.ghost_holds(1, &h(3)));
        s.taken([h(4)].into_iter(), 1);
        s.trim();
        assert!(s.ghost_holds(0, &h(2)) && s.ghost_holds(0, &h(4)));
        s.taken(std::iter::empty(), 1);
        s.trim();
        assert!(!s.ghost_holds(0, &h(2)));
        assert!(s.ghost_holds(0, &h(4)));
    }

    #[test]
    fn reset_empties_the_regions_but_not_the_memory_of_evictions() {
        let mut s = Shadow::new(4, 12);
        s.taken([h(1)].into_iter(), 1);
        s.trim();
        s.reset();
        assert!(!s.ghost_holds(0, &h(1)) && !s.ghost_holds(1, &h(1)));
        assert!(s.contains(&h(1)));
    }

    #[test]
    fn stays_bounded_under_hit_and_evict_cycles() {
        let mut s = Shadow::new(4, 8);
        for round in 0..1000u32 {
            let x = h((round % 7) as u8);
            s.taken([x].into_iter(), 1);
            s.ghost_take(0, &x);
            s.ghost_take(1, &x);
            s.trim();
            assert!(s.entries.len() <= 8, "{}", s.entries.len());
            assert!(s.seq_of.len() <= 8);
        }
    }
}
