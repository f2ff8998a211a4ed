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
//!
//! Layout. The entries are a FIFO ring by sequence number (keys, and a byte of flags apart: the
//! regions' fronts walk the flags); each key's latest sequence number is found through a table
//! of 64-byte buckets (seven slots of a 32-bit tag and the low 32 bits of a sequence number, and
//! an overflow mark). Expiry is lazy: a slot whose sequence number has left the ring's window is
//! free, so an entry that ages out costs nothing, and remembering an eviction touches one
//! bucket. A bucket that overflowed into the next one keeps the newest sequence number that
//! went past it, so a lookup goes on to the next bucket only while that one is still in the
//! window. A tag match is confirmed against the ring: the set is exact. Entries reach the table
//! in order at the next lookup (one batch, its buckets prefetched), so the misses of a step's
//! evictions overlap, and an entry that ages out before any lookup never reaches it.

use super::prefetch;
use crate::hash::BlockHash;

/// The first 8 bytes of a block hash, as the shadow set's key.
pub(crate) fn key(h: &BlockHash) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&h.0[..8]);
    u64::from_le_bytes(w)
}

/// The scales estimated: a pool 2x and 4x as large.
pub(crate) const SCALES: [usize; 2] = [2, 4];

/// The entry holds a key (else: a block the small pool took that held no cache entry).
const HAS_KEY: u8 = 1;
/// Taken from the victim region of scale `i` as a hit: `TAKEN << i`.
const TAKEN: u8 = 2;

const SLOTS: usize = 7;

/// Seven (tag, sequence) slots and an overflow mark: one cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Bucket {
    /// 0: never used (a live tag is odd).
    tags: [u32; SLOTS],
    seqs: [u32; SLOTS],
    /// The newest sequence number placed past this bucket, when `overflowed`.
    over: u32,
    overflowed: u32,
}

const BUCKET: Bucket = Bucket {
    tags: [0; SLOTS],
    seqs: [0; SLOTS],
    over: 0,
    overflowed: 0,
};

/// Stale slots are cleared this often (in entries), so a 32-bit sequence number is never
/// mistaken for one 2^32 entries later.
const SWEEP_EVERY: u64 = 1 << 30;
/// The most entries a shadow keeps (the window must stay well under 2^31).
const MAX_CAP: usize = 1 << 29;

fn tag(k: u64) -> u32 {
    (k >> 32) as u32 | 1
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
    /// Entries by sequence number, a ring: entry `seq` (`base <= seq < head`) is at
    /// `keys[seq & mask]` and `flags[seq & mask]`; both a power of two long (or empty), grown
    /// when full. (Dropping the oldest entries is moving `base`: no work per entry.)
    keys: Vec<u64>,
    flags: Vec<u8>,
    mask: usize,
    base: u64,
    head: u64,
    /// Entries from this sequence number on are not in the table yet.
    pending: u64,
    /// The table was last swept of stale slots (or built) at this sequence number.
    swept: u64,
    /// Latest sequence number of each key in `entries`, with lazy expiry.
    table: Vec<Bucket>,
    /// Most entries kept (`--eviction-shadow-blocks`).
    cap: usize,
    ghosts: [Ghost; 2],
    /// `SWEEP_EVERY` (tests sweep more often; a power of two).
    sweep_every: u64,
}

impl Shadow {
    /// A shadow of `cap` entries for a pool of `num_blocks` blocks.
    pub(crate) fn new(num_blocks: usize, cap: usize) -> Self {
        let cap = cap.min(MAX_CAP);
        let ghost = |k: usize| Ghost::new(((k - 1) * num_blocks).min(cap), 0);
        Shadow {
            keys: Vec::new(),
            flags: Vec::new(),
            mask: 0,
            base: 0,
            head: 0,
            pending: 0,
            swept: 0,
            // Grown with the window (rebuilt from the ring, doubling).
            table: vec![BUCKET; 1],
            cap,
            ghosts: [ghost(SCALES[0]), ghost(SCALES[1])],
            sweep_every: SWEEP_EVERY,
        }
    }

    /// Buckets for a window of `n` entries: at most half the slots live.
    fn buckets_for(n: usize) -> usize {
        (2 * n).div_ceil(SLOTS).next_power_of_two().max(1)
    }

    #[inline]
    fn next(&self) -> u64 {
        self.head
    }

    /// Entries in the window.
    #[inline]
    fn window(&self) -> usize {
        (self.head - self.base) as usize
    }

    /// The sequence number a slot holds, when it is in the window.
    #[inline]
    fn in_window(&self, s: u32) -> Option<u64> {
        let next = self.next();
        let d = u64::from((next as u32).wrapping_sub(s));
        (d >= 1 && d <= next - self.base).then(|| next - d)
    }

    #[inline]
    fn flags_at(&self, seq: u64) -> Option<u8> {
        (seq >= self.base && seq < self.head).then(|| self.flags[seq as usize & self.mask])
    }

    /// The key of entry `seq`, if it is in the window and has one.
    #[inline]
    fn key_at(&self, seq: u64) -> Option<u64> {
        (self.flags_at(seq)? & HAS_KEY != 0).then(|| self.keys[seq as usize & self.mask])
    }

    fn is_of(&self, seq: u64, k: u64) -> bool {
        self.key_at(seq) == Some(k)
    }

    /// Put the pending entries in the table, in order, their buckets prefetched a few ahead.
    fn flush(&mut self) {
        const AHEAD: u64 = 8;
        self.maintain();
        let next = self.next();
        let from = self.pending.max(self.base);
        self.pending = next;
        let mask = self.table.len() - 1;
        for s in from..(from + AHEAD).min(next) {
            if let Some(k) = self.key_at(s) {
                prefetch(&self.table[k as usize & mask]);
            }
        }
        for s in from..next {
            if let Some(k) = self.key_at(s + AHEAD) {
                prefetch(&self.table[k as usize & mask]);
            }
            if let Some(k) = self.key_at(s) {
                self.insert(k, s);
            }
        }
    }

    /// The latest sequence number of key `k` in the window.
    fn find(&self, k: u64) -> Option<u64> {
        let mask = self.table.len() - 1;
        let t = tag(k);
        let mut b = k as usize & mask;
        for _ in 0..self.table.len() {
            let bk = &self.table[b];
            for i in 0..SLOTS {
                if bk.tags[i] == t {
                    if let Some(seq) = self.in_window(bk.seqs[i]) {
                        if self.is_of(seq, k) {
                            return Some(seq);
                        }
                    }
                }
            }
            if bk.overflowed == 0 || self.in_window(bk.over).is_none() {
                return None;
            }
            b = (b + 1) & mask;
        }
        None
    }

    /// Key `k`'s latest sequence number is now `seq` (newer than any in the table).
    fn insert(&mut self, k: u64, seq: u64) {
        let mask = self.table.len() - 1;
        let t = tag(k);
        let home = k as usize & mask;
        let mut b = home;
        let mut free = None;
        let mut at = None;
        'chain: for _ in 0..self.table.len() {
            let bk = &self.table[b];
            for i in 0..SLOTS {
                match (bk.tags[i] != 0)
                    .then(|| self.in_window(bk.seqs[i]))
                    .flatten()
                {
                    Some(s) if bk.tags[i] == t && self.is_of(s, k) => {
                        at = Some((b, i));
                        break 'chain;
                    }
                    Some(_) => {}
                    None => {
                        if free.is_none() {
                            free = Some((b, i));
                        }
                    }
                }
            }
            if bk.overflowed == 0 || self.in_window(bk.over).is_none() {
                break;
            }
            b = (b + 1) & mask;
        }
        // Else past the chain's end: the first bucket with room (the table is at most half
        // full, so there is one within a turn).
        let place = at.or(free).or_else(|| {
            (1..=self.table.len()).find_map(|d| {
                let c = (b + d) & mask;
                let bk = &self.table[c];
                (0..SLOTS)
                    .find(|&i| bk.tags[i] == 0 || self.in_window(bk.seqs[i]).is_none())
                    .map(|i| (c, i))
            })
        });
        let Some((tb, ti)) = place else {
            debug_assert!(false, "shadow table full");
            return;
        };
        let mut p = home;
        while p != tb {
            let bk = &mut self.table[p];
            bk.over = seq as u32;
            bk.overflowed = 1;
            p = (p + 1) & mask;
        }
        let bk = &mut self.table[tb];
        bk.tags[ti] = t;
        bk.seqs[ti] = seq as u32;
    }

    /// Room for the window, and no stale 32-bit sequence number: rebuilt from the ring when
    /// the window outgrew the table, swept every `SWEEP_EVERY` entries. (Before the table is
    /// used, and at every trim: a sweep is never more than one allocation late.)
    #[inline]
    fn maintain(&mut self) {
        if self.window() * 2 > self.table.len() * SLOTS
            || self.next() - self.swept >= self.sweep_every
        {
            self.rebuild_or_sweep();
        }
    }

    #[cold]
    #[inline(never)]
    fn rebuild_or_sweep(&mut self) {
        let window = self.window();
        if window * 2 > self.table.len() * SLOTS {
            self.table = vec![BUCKET; Self::buckets_for(window)];
            self.pending = self.base;
        } else {
            for b in 0..self.table.len() {
                for i in 0..SLOTS {
                    if self.in_window(self.table[b].seqs[i]).is_none() {
                        self.table[b].tags[i] = 0;
                    }
                }
                if self.in_window(self.table[b].over).is_none() {
                    self.table[b].overflowed = 0;
                }
            }
        }
        self.swept = self.next();
    }

    /// Whether `h` was evicted within the last `cap` blocks taken.
    pub(crate) fn contains(&mut self, h: &BlockHash) -> bool {
        self.flush();
        self.find(key(h)).is_some()
    }

    /// Whether the pool of scale `SCALES[g]` would still hold `h` (it is in its victim region).
    pub(crate) fn ghost_holds(&mut self, g: usize, h: &BlockHash) -> bool {
        self.flush();
        let Some(seq) = self.find(key(h)) else {
            return false;
        };
        seq >= self.ghosts[g].front && self.flags_at(seq).is_some_and(|f| f & (TAKEN << g) == 0)
    }

    /// The larger pool found `h` in its victim region: it leaves the region (in use there).
    pub(crate) fn ghost_take(&mut self, g: usize, h: &BlockHash) {
        self.flush();
        let Some(seq) = self.find(key(h)) else {
            return;
        };
        if seq < self.ghosts[g].front {
            return;
        }
        if seq < self.head {
            let f = &mut self.flags[seq as usize & self.mask];
            if *f & (TAKEN << g) == 0 {
                *f |= TAKEN << g;
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

    /// [`Shadow::take_blocks`] of one block.
    #[inline]
    pub(crate) fn take_one(&mut self, evicted: Option<&BlockHash>) {
        self.push(evicted.map(key));
    }

    /// Tests: `evicted` entries first, then blocks with none, `taken` in all.
    #[cfg(test)]
    fn taken(&mut self, evicted: impl Iterator<Item = BlockHash>, taken: usize) {
        let ev: Vec<_> = evicted.map(Some).collect();
        let n = ev.len();
        self.take_blocks(ev.into_iter().chain((n..taken).map(|_| None)));
    }

    #[inline]
    fn push(&mut self, k: Option<u64>) {
        if self.window() == self.keys.len() {
            self.grow();
        }
        let i = self.head as usize & self.mask;
        self.keys[i] = k.unwrap_or(0);
        self.flags[i] = if k.is_some() { HAS_KEY } else { 0 };
        self.head += 1;
        for g in &mut self.ghosts {
            g.live += 1;
        }
    }

    /// Twice the ring (at least 16 entries), the window where it was by sequence number.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let n = (2 * self.keys.len()).max(16);
        let mut keys = vec![0; n];
        let mut flags = vec![0; n];
        for seq in self.base..self.head {
            keys[seq as usize & (n - 1)] = self.keys[seq as usize & self.mask];
            flags[seq as usize & (n - 1)] = self.flags[seq as usize & self.mask];
        }
        self.keys = keys;
        self.flags = flags;
        self.mask = n - 1;
    }

    /// The larger pools' victim regions back to length, and the window to `cap` entries.
    #[inline(always)]
    pub(crate) fn trim(&mut self) {
        let (next, base, mask) = (self.head, self.base, self.mask);
        let flags = &self.flags;
        // The region spans at most `cap` entries even when hits thinned it out.
        let lo = next.saturating_sub(self.cap as u64);
        for (gi, g) in self.ghosts.iter_mut().enumerate() {
            let taken = |seq: u64| {
                seq >= base && seq < next && flags[seq as usize & mask] & (TAKEN << gi) != 0
            };
            while g.front < lo {
                if !taken(g.front) {
                    g.live -= 1;
                }
                g.front += 1;
            }
            while g.live > g.cap {
                if g.virgin > 0 {
                    g.virgin -= 1;
                    g.live -= 1;
                } else if g.front >= next {
                    break;
                } else {
                    if !taken(g.front) {
                        g.live -= 1;
                    }
                    g.front += 1;
                }
            }
        }
        // `contains` remembers the last `cap` entries; no region reaches further back. What
        // ages out of the ring leaves the table by itself.
        if self.base < lo {
            self.base = lo;
        }
        self.maintain();
    }

    /// The cache was reset, dropping the entries `dropped` (in free-queue order): they are
    /// remembered as evicted (they were cached, and are gone), as is what was evicted before;
    /// but the larger pools would have dropped everything too, so their regions start empty,
    /// after them.
    pub(crate) fn reset(&mut self, dropped: &[BlockHash]) {
        for h in dropped {
            self.push(Some(key(h)));
        }
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

    /// Tests: table slots holding a key of the window.
    #[cfg(test)]
    fn keys_held(&mut self) -> usize {
        self.flush();
        self.table
            .iter()
            .flat_map(|b| (0..SLOTS).map(move |i| (b.tags[i], b.seqs[i])))
            .filter(|&(t, s)| t != 0 && self.in_window(s).is_some())
            .count()
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

    /// `h(1)` evicted before the reset, `h(2)` and `h(3)` dropped by it: all three read as
    /// evicted, none is in a larger pool's region (those pools were reset too, and start with
    /// every block unused again), and a hash never cached is not remembered.
    #[test]
    fn reset_empties_the_regions_but_not_the_memory_of_evictions() {
        let mut s = Shadow::new(4, 12);
        s.taken([h(1)].into_iter(), 1);
        s.trim();
        s.reset(&[h(2), h(3)]);
        for x in 1..=3 {
            assert!(!s.ghost_holds(0, &h(x)) && !s.ghost_holds(1, &h(x)), "{x}");
            assert!(s.contains(&h(x)), "{x}");
        }
        assert!(!s.contains(&h(4)));
        assert_eq!((s.live(0), s.live(1)), (4, 12));
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
            assert!(s.window() <= 8, "{}", s.window());
            assert!(s.keys_held() <= 8);
        }
    }

    /// The latest entry of `k` in the window, by brute force over the ring.
    fn brute(s: &Shadow, k: u64) -> Option<u64> {
        (s.base..s.next()).rev().find(|&q| s.key_at(q) == Some(k))
    }

    /// The table against a brute-force scan of the ring, over keys made to collide (tags are
    /// the high 32 bits with the low bit set: 0 and 1 share one; buckets are the low bits),
    /// with windows from 0 to 40 entries, the table grown from one bucket, sweeps every few
    /// entries, and sequence numbers crossing 2^32.
    #[test]
    fn the_table_finds_exactly_the_latest_entry_of_each_key() {
        // Sixteen keys to each of two home buckets: more than a bucket holds.
        let keys: Vec<u64> = (0..16u64)
            .flat_map(|a| (0..2u64).map(move |b| (a << 32) | (b * 3)))
            .collect();
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for (cap, start) in [
            (0usize, 0u64),
            (1, 0),
            (5, 0),
            (17, (1 << 32) - 300),
            (40, u64::from(u32::MAX) - 7),
        ] {
            let mut s = Shadow::new(4, cap);
            s.base = start;
            s.head = start;
            s.pending = start;
            s.swept = start;
            for g in &mut s.ghosts {
                g.front = start;
            }
            s.sweep_every = 16;
            for _ in 0..3000 {
                match next() % 8 {
                    0..=4 => {
                        let n = next() % 4;
                        let taken: Vec<Option<BlockHash>> = (0..n)
                            .map(|_| {
                                let k = keys[(next() % keys.len() as u64) as usize];
                                let mut h = [0u8; 32];
                                h[..8].copy_from_slice(&k.to_le_bytes());
                                (next() % 5 != 0).then_some(BlockHash(h))
                            })
                            .collect();
                        s.take_blocks(taken.into_iter());
                    }
                    5 | 6 => s.trim(),
                    _ => {
                        let k = keys[(next() % keys.len() as u64) as usize];
                        let mut h = [0u8; 32];
                        h[..8].copy_from_slice(&k.to_le_bytes());
                        s.ghost_take((next() % 2) as usize, &BlockHash(h));
                    }
                }
                s.flush();
                for &k in &keys {
                    assert_eq!(s.find(k), brute(&s, k), "cap {cap} key {k:#x}");
                }
            }
        }
    }
}
