//! The host-memory tier: a least-recently-used map of block payloads, bounded by bytes.
//!
//! The bound counts payload bytes only (`Payload::len()`), exactly: after every insert the
//! payloads held sum to at most the capacity. The map's own bookkeeping (about 100 bytes per
//! entry) is not counted; at the default block of 368 KB that is under 0.03 %.
//!
//! Recency: an insert, a [`HostLru::get`] (a load) and a positive [`HostLru::touch`] (a lookup
//! that found the block, which is about to be loaded) make a block the most recently used.
//! Eviction takes the least recently used first.

use cachet_core::BlockHash;
use lru::LruCache;

use crate::Payload;

/// What [`HostLru::insert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostInsert {
    /// Stored; `evicted` older blocks made room.
    Stored { evicted: usize },
    /// The payload alone is larger than the capacity; nothing changed.
    TooLarge,
}

pub struct HostLru {
    map: LruCache<BlockHash, Payload>,
    bytes: u64,
    capacity: u64,
    evictions: u64,
}

impl HostLru {
    pub fn new(capacity_bytes: u64) -> Self {
        HostLru {
            map: LruCache::unbounded(),
            bytes: 0,
            capacity: capacity_bytes,
            evictions: 0,
        }
    }

    /// Stores `payload` as the most recently used block (replacing an older copy of `hash`),
    /// then evicts least recently used blocks until the bytes fit.
    pub fn insert(&mut self, hash: BlockHash, payload: Payload) -> HostInsert {
        self.insert_reclaim(hash, payload, &mut Vec::new())
    }

    /// [`HostLru::insert`], handing the payloads it dropped (the replaced copy, the evicted
    /// blocks) to `dropped` instead of freeing them, so their buffers can be reused.
    pub fn insert_reclaim(
        &mut self,
        hash: BlockHash,
        payload: Payload,
        dropped: &mut Vec<Payload>,
    ) -> HostInsert {
        let len = payload.len() as u64;
        if len > self.capacity {
            return HostInsert::TooLarge;
        }
        if let Some(old) = self.map.put(hash, payload) {
            self.bytes -= old.len() as u64;
            dropped.push(old);
        }
        self.bytes += len;
        let mut evicted = 0;
        while self.bytes > self.capacity {
            match self.map.pop_lru() {
                Some((_, p)) => {
                    self.bytes -= p.len() as u64;
                    evicted += 1;
                    dropped.push(p);
                }
                None => break,
            }
        }
        self.evictions += evicted as u64;
        HostInsert::Stored { evicted }
    }

    /// The payload of `hash`, made most recently used.
    pub fn get(&mut self, hash: &BlockHash) -> Option<Payload> {
        self.map.get(hash).cloned()
    }

    /// Whether `hash` is held; a held block becomes most recently used.
    pub fn touch(&mut self, hash: &BlockHash) -> bool {
        self.map.get(hash).is_some()
    }

    /// Whether `hash` is held, without changing recency.
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.map.contains(hash)
    }

    /// Payload bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Blocks evicted since creation.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The held blocks from least to most recently used.
    pub fn lru_order(&self) -> Vec<BlockHash> {
        self.map.iter().rev().map(|(h, _)| *h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn p(len: usize, fill: u8) -> Payload {
        Payload::from(vec![fill; len])
    }

    #[test]
    fn evicts_least_recently_used_first_and_keeps_the_byte_bound() {
        let mut c = HostLru::new(1000);
        assert_eq!(c.insert(h(1), p(300, 1)), HostInsert::Stored { evicted: 0 });
        assert_eq!(c.insert(h(2), p(300, 2)), HostInsert::Stored { evicted: 0 });
        assert_eq!(c.insert(h(3), p(300, 3)), HostInsert::Stored { evicted: 0 });
        assert_eq!(c.bytes(), 900);
        assert_eq!(c.lru_order(), vec![h(1), h(2), h(3)]);

        // A load of 1 makes it most recent: 2 is now the oldest.
        assert_eq!(c.get(&h(1)).unwrap()[0], 1);
        assert_eq!(c.lru_order(), vec![h(2), h(3), h(1)]);

        // 900 + 300 = 1200 > 1000: exactly one eviction (2), leaving 900.
        assert_eq!(c.insert(h(4), p(300, 4)), HostInsert::Stored { evicted: 1 });
        assert_eq!(c.lru_order(), vec![h(3), h(1), h(4)]);
        assert_eq!(c.bytes(), 900);
        assert!(!c.contains(&h(2)));

        // A lookup hit (touch) also refreshes; a miss changes nothing.
        assert!(c.touch(&h(3)));
        assert!(!c.touch(&h(9)));
        assert_eq!(c.lru_order(), vec![h(1), h(4), h(3)]);

        // 900 + 600 = 1500: evicting 1 leaves 1200, still over; evicting 4 leaves 900.
        assert_eq!(c.insert(h(5), p(600, 5)), HostInsert::Stored { evicted: 2 });
        assert_eq!(c.lru_order(), vec![h(3), h(5)]);
        assert_eq!(c.bytes(), 900);
        assert_eq!(c.evictions(), 3);

        // Filling to exactly the capacity evicts nothing.
        assert_eq!(c.insert(h(6), p(100, 6)), HostInsert::Stored { evicted: 0 });
        assert_eq!(c.bytes(), 1000);
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn replacing_a_block_counts_only_its_new_size() {
        let mut c = HostLru::new(1000);
        c.insert(h(1), p(400, 1));
        c.insert(h(2), p(400, 2));
        // Re-inserting 1 with 500 bytes: 400 + 500 = 900, no eviction, 1 is most recent.
        assert_eq!(c.insert(h(1), p(500, 7)), HostInsert::Stored { evicted: 0 });
        assert_eq!(c.bytes(), 900);
        assert_eq!(c.lru_order(), vec![h(2), h(1)]);
        assert_eq!(c.get(&h(1)).unwrap().len(), 500);
    }

    #[test]
    fn an_insert_hands_back_what_it_dropped() {
        let mut c = HostLru::new(1000);
        let mut dropped = Vec::new();
        c.insert_reclaim(h(1), p(400, 1), &mut dropped);
        c.insert_reclaim(h(2), p(400, 2), &mut dropped);
        assert!(dropped.is_empty());
        // Replacing 2 hands back its old copy; 400 + 500 = 900 fits.
        c.insert_reclaim(h(2), p(500, 3), &mut dropped);
        assert_eq!(
            dropped.iter().map(|d| (d.len(), d[0])).collect::<Vec<_>>(),
            vec![(400, 2)]
        );
        // 900 + 300 = 1200: block 1 (the least recently used) is evicted and handed back.
        dropped.clear();
        assert_eq!(
            c.insert_reclaim(h(4), p(300, 4), &mut dropped),
            HostInsert::Stored { evicted: 1 }
        );
        assert_eq!(
            dropped.iter().map(|d| (d.len(), d[0])).collect::<Vec<_>>(),
            vec![(400, 1)]
        );
        assert_eq!(c.bytes(), 800);
    }

    #[test]
    fn a_payload_larger_than_the_capacity_is_refused_without_evicting() {
        let mut c = HostLru::new(1000);
        c.insert(h(1), p(600, 1));
        assert_eq!(c.insert(h(2), p(1001, 2)), HostInsert::TooLarge);
        assert_eq!(c.lru_order(), vec![h(1)]);
        assert_eq!(c.bytes(), 600);
        // One exactly the capacity evicts everything else.
        assert_eq!(
            c.insert(h(3), p(1000, 3)),
            HostInsert::Stored { evicted: 1 }
        );
        assert_eq!(c.lru_order(), vec![h(3)]);
    }
}
