//! Core benchmarks: block pool allocate-8/free-8 (with and without the bookkeeping of its
//! effects, in the same run) and the prefix lookup of a 4,096-token prompt.

use cachet_core::hash::{ExtraKeys, HashSeed};
use cachet_core::kv_manager::{KvCacheManager, KvEffects, ReqKv};
use cachet_core::BlockPool;
use criterion::{black_box, criterion_group, criterion_main, Criterion};

fn pool_alloc_free(c: &mut Criterion) {
    // The pool reports evictions into a caller's buffer instead of counting (the recorder
    // counts); measured with a recorder-sized amount of bookkeeping on top, and without.
    let mut g = c.benchmark_group("block_pool_alloc8_free8");
    for observe in [false, true] {
        let mut pool = BlockPool::new(4096);
        let mut blocks = Vec::with_capacity(8);
        let mut evicted = Vec::with_capacity(8);
        let mut totals = [0u64; 2];
        g.bench_function(
            if observe {
                "counters_on"
            } else {
                "counters_off"
            },
            |b| {
                b.iter(|| {
                    blocks.clear();
                    evicted.clear();
                    pool.allocate(8, &mut blocks, &mut evicted)
                        .expect("free blocks");
                    if observe {
                        totals[0] += blocks.len() as u64;
                        totals[1] += evicted.len() as u64;
                    }
                    pool.free(black_box(&blocks));
                })
            },
        );
        black_box(totals);
    }
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let bs = 16;
    let seed = HashSeed::new(&[1; 32], bs, "bench");
    let mut mgr = KvCacheManager::new(1024, bs, true, seed);
    let prompt: Vec<u32> = (0..4096).map(|i| (i * 7 + 3) % 49152).collect();
    // Fill the cache with the prompt's blocks.
    let mut kv = ReqKv::new(ExtraKeys::default());
    let mut fx = KvEffects::default();
    mgr.allocate_slots(&mut kv, &[], 0, prompt.len(), &mut fx)
        .expect("room");
    mgr.commit(&mut kv, &prompt, prompt.len(), &mut fx);
    mgr.free(&mut kv);
    c.bench_function("prefix_lookup_4096_tokens_full_hit", |b| {
        b.iter(|| {
            // A new request each time: its block hashes are computed from scratch.
            let mut r = ReqKv::new(ExtraKeys::default());
            let hits = mgr.find_cached_prefix(&mut r, black_box(&prompt));
            assert_eq!(hits.len(), 255);
            hits
        })
    });
}

criterion_group!(benches, pool_alloc_free, prefix_lookup);
criterion_main!(benches);
