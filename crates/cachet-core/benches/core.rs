//! Core benchmarks: block pool allocate-8/free-8 (observer counters on and off, in the same
//! run) and the prefix lookup of a 4,096-token prompt.

use cachet_core::hash::{ExtraKeys, HashSeed};
use cachet_core::kv_manager::{KvCacheManager, ReqKv};
use cachet_core::BlockPool;
use criterion::{black_box, criterion_group, criterion_main, Criterion};

fn pool_alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_pool_alloc8_free8");
    for observe in [false, true] {
        let mut pool = BlockPool::new(4096, observe);
        let mut blocks = Vec::with_capacity(8);
        g.bench_function(
            if observe {
                "counters_on"
            } else {
                "counters_off"
            },
            |b| {
                b.iter(|| {
                    blocks.clear();
                    pool.allocate(8, &mut blocks).expect("free blocks");
                    pool.free(black_box(&blocks));
                })
            },
        );
    }
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let bs = 16;
    let seed = HashSeed::new(&[1; 32], bs, "bench");
    let mut mgr = KvCacheManager::new(1024, bs, true, seed, true);
    let prompt: Vec<u32> = (0..4096).map(|i| (i * 7 + 3) % 49152).collect();
    // Fill the cache with the prompt's blocks.
    let mut kv = ReqKv::new(ExtraKeys::default());
    mgr.allocate_slots(&mut kv, &[], 0, prompt.len())
        .expect("room");
    mgr.commit(&mut kv, &prompt, prompt.len(), 0..prompt.len());
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
