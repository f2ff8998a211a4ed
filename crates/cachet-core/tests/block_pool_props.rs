//! Property test of the block pool against a plain reference model: random allocations,
//! frees, fills and cache hits by a few owners, on a small pool. After every operation the
//! pool's free-queue order, reference counts and cache map must equal the model's, every
//! reported eviction must be exactly the model's, and `check_invariants` must pass.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

use cachet_core::block_pool::{BlockPool, CacheOutcome, Evicted};
use cachet_core::BlockHash;
use proptest::prelude::*;

const OWNERS: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    Alloc { owner: usize, n: usize },
    Free { owner: usize },
    Fill { owner: usize, pick: usize, key: u8 },
    Hit { owner: usize, key: u8 },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..OWNERS, 0usize..6).prop_map(|(owner, n)| Op::Alloc { owner, n }),
        2 => (0..OWNERS).prop_map(|owner| Op::Free { owner }),
        4 => (0..OWNERS, any::<usize>(), 0u8..10).prop_map(|(owner, pick, key)| Op::Fill { owner, pick, key }),
        3 => (0..OWNERS, 0u8..10).prop_map(|(owner, key)| Op::Hit { owner, key }),
        1 => Just(Op::Reset),
    ]
}

/// Keys 0..10 map to hashes whose first eight bytes (the table's key) collide in threes, so
/// lookups must compare whole hashes.
fn hash(key: u8) -> BlockHash {
    let mut h = [key; 32];
    h[..8].copy_from_slice(&[key % 3; 8]);
    BlockHash(h)
}

#[derive(Default)]
struct Model {
    ref_cnt: Vec<u32>,
    queue: VecDeque<u32>,
    entry: Vec<Option<BlockHash>>,
    cached: HashMap<[u8; 32], u32>,
}

impl Model {
    fn new(n: u32) -> Self {
        Model {
            ref_cnt: vec![0; n as usize],
            queue: (0..n).collect(),
            entry: vec![None; n as usize],
            ..Default::default()
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_reference_model(n in 1u32..12, ops in prop::collection::vec(op(), 1..80)) {
        let mut pool = BlockPool::new(n as usize);
        let mut m = Model::new(n);
        let mut tables: Vec<Vec<u32>> = vec![Vec::new(); OWNERS];
        for op in ops {
            match op {
                Op::Alloc { owner, n: k } => {
                    let before = tables[owner].len();
                    let mut got = Vec::new();
                    let res = pool.allocate(k, &mut tables[owner], &mut got);
                    if k > m.queue.len() {
                        prop_assert!(res.is_err());
                        prop_assert_eq!(tables[owner].len(), before);
                        continue;
                    }
                    let mut evicted = Vec::new();
                    for i in 0..k {
                        let b = m.queue.pop_front().unwrap();
                        prop_assert_eq!(tables[owner][before + i], b, "allocation order");
                        m.ref_cnt[b as usize] = 1;
                        if let Some(h) = m.entry[b as usize].take() {
                            m.cached.remove(&h.0);
                            evicted.push(Evicted { block: b, hash: h });
                        }
                    }
                    prop_assert!(res.is_ok());
                    prop_assert_eq!(got, evicted);
                }
                Op::Free { owner } => {
                    pool.free(&tables[owner]);
                    for &b in tables[owner].iter().rev() {
                        m.ref_cnt[b as usize] -= 1;
                        if m.ref_cnt[b as usize] == 0 {
                            m.queue.push_back(b);
                        }
                    }
                    tables[owner].clear();
                }
                Op::Fill { owner, pick, key } => {
                    // A block is filled once while held: pick one without a cache entry.
                    let open: Vec<u32> = tables[owner]
                        .iter()
                        .copied()
                        .filter(|&b| m.entry[b as usize].is_none())
                        .collect();
                    if open.is_empty() {
                        continue;
                    }
                    let b = open[pick % open.len()];
                    let h = hash(key);
                    let expect = match m.cached.entry(h.0) {
                        Entry::Occupied(_) => CacheOutcome::AlreadyCached,
                        Entry::Vacant(v) => {
                            v.insert(b);
                            m.entry[b as usize] = Some(h);
                            CacheOutcome::Created
                        }
                    };
                    prop_assert_eq!(pool.cache_full_block(b, h), expect);
                }
                Op::Hit { owner, key } => {
                    let h = hash(key);
                    let found = pool.lookup(&h);
                    prop_assert_eq!(found, m.cached.get(&h.0).copied());
                    if let Some(b) = found {
                        pool.touch(&[b]);
                        tables[owner].push(b);
                        if m.ref_cnt[b as usize] == 0 {
                            let pos = m.queue.iter().position(|&x| x == b).unwrap();
                            m.queue.remove(pos);
                        }
                        m.ref_cnt[b as usize] += 1;
                    }
                }
                Op::Reset => {
                    let all_free = m.queue.len() == n as usize;
                    prop_assert_eq!(pool.reset_prefix_cache(), all_free);
                    if all_free {
                        m.cached.clear();
                        m.entry.iter_mut().for_each(|e| *e = None);
                    }
                }
            }
            pool.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(pool.free_queue(), m.queue.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(pool.num_cached(), m.cached.len());
            let cached_free = (0..n as usize)
                .filter(|&b| m.ref_cnt[b] == 0 && m.entry[b].is_some())
                .count();
            prop_assert_eq!(pool.num_cached_free(), cached_free);
            for b in 0..n {
                prop_assert_eq!(pool.ref_count(b), m.ref_cnt[b as usize]);
                prop_assert_eq!(pool.block_hash(b), m.entry[b as usize]);
            }
        }
    }
}
