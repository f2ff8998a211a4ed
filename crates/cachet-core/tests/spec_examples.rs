//! The worked examples of spec §4 and the accounting scenarios of the engine-core issue, with
//! expected values derived by hand (B = 16 unless stated).

mod common;
use common::*;

use cachet_core::connector::KvConnector;
use cachet_core::hash::BlockHash;
use cachet_core::FinishReason;

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

// Field order: prompt, local, external, cached, computed, creation, chunks, allocated, filled,
// evicted, preemptions.

#[test]
fn example_1_cold_prompt_of_100() {
    let mut s = sched(cfg(64, 16));
    s.add_request(req("a", toks(1000, 100), 1)).unwrap();
    let fin = run(&mut s);
    // 100 tokens: 6 full blocks + 4 tokens; 7 blocks allocated; 96 tokens land in new entries.
    assert_eq!(
        fields(&stats_of(&fin, "a")),
        [100, 0, 0, 0, 100, 96, 1, 7, 6, 0, 0]
    );
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (100, 0));
    assert_eq!(t.cache_creation_tokens, 96);
}

#[test]
fn example_2_same_prompt_again() {
    let mut s = sched(cfg(64, 16));
    s.add_request(req("a", toks(1000, 100), 1)).unwrap();
    run(&mut s);
    s.add_request(req("b", toks(1000, 100), 1)).unwrap();
    let fin = run(&mut s);
    // Cap floor(99/16)*16 = 96 → 6 blocks hit; 4 tokens computed in 1 new block, not full.
    assert_eq!(
        fields(&stats_of(&fin, "b")),
        [100, 96, 0, 96, 4, 0, 1, 1, 0, 0, 0]
    );
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (200, 96));
    assert_eq!(
        (
            t.prompt_tokens_local_compute,
            t.prompt_tokens_local_cache_hit
        ),
        (104, 96)
    );
}

#[test]
fn example_3_block_aligned_prompt_twice() {
    let mut s = sched(cfg(64, 16));
    s.add_request(req("a", toks(0, 96), 1)).unwrap();
    let fin_a = run(&mut s);
    assert_eq!(stats_of(&fin_a, "a").cache_creation_tokens, 96);
    s.add_request(req("b", toks(0, 96), 1)).unwrap();
    let fin = run(&mut s);
    // Cap floor(95/16)*16 = 80; the recomputed 6th block's hash already exists → no creation.
    assert_eq!(
        fields(&stats_of(&fin, "b")),
        [96, 80, 0, 80, 16, 0, 1, 1, 1, 0, 0]
    );
}

#[test]
fn example_4_shared_prefix_then_other_suffix() {
    let mut s = sched(cfg(64, 16));
    let p = toks(0, 64);
    let a = [p.clone(), toks(500, 40)].concat();
    let b = [p, toks(900, 40)].concat();
    s.add_request(req("a", a, 1)).unwrap();
    run(&mut s);
    s.add_request(req("b", b, 1)).unwrap();
    let fin = run(&mut s);
    // 104 tokens: 4 blocks hit (64), blocks 4,5 new and full (32 creation), block 6 partial.
    assert_eq!(
        fields(&stats_of(&fin, "b")),
        [104, 64, 0, 64, 40, 32, 1, 3, 2, 0, 0]
    );
}

#[test]
fn example_5_eviction_belongs_to_the_evicting_request() {
    // 8 blocks: A takes 7 (0..=6), leaving block 7 at the front of the queue. A frees tail-first:
    // queue = [7, 6, 5, 4, 3, 2, 1, 0], blocks 0..=5 cached. B (no common prefix) takes 7, 6 and
    // then 5, 4, 3, 2, 1: five cached blocks evicted, by B.
    let mut s = sched(cfg(8, 16));
    s.add_request(req("a", toks(0, 100), 1)).unwrap();
    let fin_a = run(&mut s);
    let a_before = stats_of(&fin_a, "a");
    s.add_request(req("b", toks(5000, 100), 1)).unwrap();
    let fin_b = run(&mut s);
    assert_eq!(
        fields(&stats_of(&fin_b, "b")),
        [100, 0, 0, 0, 100, 96, 1, 7, 6, 5, 0]
    );
    assert_eq!(a_before.blocks_evicted, 0);
    assert_eq!(s.totals().blocks_evicted, 5);
}

#[test]
fn cache_salt_isolates_tenants() {
    let mut s = sched(cfg(64, 16));
    let mut a = req("a", toks(0, 100), 1);
    a.cache_salt = Some("tenant-a".into());
    s.add_request(a).unwrap();
    run(&mut s);
    let mut b = req("b", toks(0, 100), 1);
    b.cache_salt = Some("tenant-b".into());
    s.add_request(b).unwrap();
    let fin = run(&mut s);
    assert_eq!(stats_of(&fin, "b").local_cached_tokens, 0);
    // Same salt again does hit.
    let mut c = req("c", toks(0, 100), 1);
    c.cache_salt = Some("tenant-a".into());
    s.add_request(c).unwrap();
    let fin = run(&mut s);
    assert_eq!(stats_of(&fin, "c").local_cached_tokens, 96);
}

#[test]
fn caching_disabled_counts_no_queries() {
    let mut c = cfg(64, 16);
    c.enable_prefix_caching = false;
    let mut s = sched(c);
    s.add_request(req("a", toks(0, 100), 1)).unwrap();
    run(&mut s);
    s.add_request(req("b", toks(0, 100), 1)).unwrap();
    let fin = run(&mut s);
    assert_eq!(
        fields(&stats_of(&fin, "b")),
        [100, 0, 0, 0, 100, 0, 1, 7, 6, 0, 0]
    );
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (0, 0));
    assert_eq!(t.prompt_tokens, 200);
}

#[test]
fn skip_read_writes_but_does_not_query() {
    let mut s = sched(cfg(64, 16));
    let mut a = req("a", toks(0, 100), 1);
    a.skip_prefix_cache_read = true;
    s.add_request(a).unwrap();
    let fin = run(&mut s);
    assert_eq!(stats_of(&fin, "a").cache_creation_tokens, 96);
    assert_eq!(s.totals().prefix_cache_queries, 0);
    s.add_request(req("b", toks(0, 100), 1)).unwrap();
    let fin = run(&mut s);
    assert_eq!(stats_of(&fin, "b").local_cached_tokens, 96);
}

#[test]
fn abort_during_prefill_counts_lookup_once_and_frees_everything() {
    let mut c = cfg(64, 16);
    c.max_num_batched_tokens = 32; // 100-token prompt needs 4 steps
    let mut s = sched(c);
    s.add_request(req("warm", toks(0, 40), 1)).unwrap();
    run(&mut s);
    s.add_request(req("a", toks(0, 100), 4)).unwrap();
    step(&mut s, 10.0);
    step(&mut s, 11.0);
    let up = s.finish_request("a", FinishReason::Abort, 12.0).unwrap();
    assert_eq!(up.finish, Some(FinishReason::Abort));
    let fin = s.take_finished();
    assert_eq!(fin.len(), 1);
    let st = stats_of(&fin, "a");
    // Hit 2 blocks (32 tokens of the 40-token warm prompt), then chunks of 32 and 32.
    assert_eq!(fields(&st), [100, 32, 0, 32, 68, 64, 2, 4, 4, 0, 0]);
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (140, 32));
    assert_eq!(t.cache_creation_tokens, 32 + 64);
    assert!(!s.has_unfinished());
    assert_eq!(s.kv_manager().pool().num_free(), 64);
    s.check_invariants().unwrap();
    // Nothing later re-adds it.
    step(&mut s, 13.0);
    assert_eq!(s.totals().prefix_cache_queries, 140);
}

#[test]
fn abort_while_waiting_reports_no_prefill_stats() {
    let mut s = sched(cfg(64, 16));
    s.add_request(req("a", toks(0, 10), 1)).unwrap();
    s.finish_request("a", FinishReason::Abort, 0.5).unwrap();
    let fin = s.take_finished();
    assert_eq!(fin[0].prefill_stats, None);
    assert_eq!(s.totals().prompt_tokens, 0);
}

/// B = 4, 4 blocks, budget 8, caching off. A: 4-token prompt, 3 output tokens. B: 12-token prompt.
/// Step 1: A [blk 0] computes 4 and samples; B [blk 1] computes 4 of 12.
/// Step 2: A needs a 2nd block (takes 2); B needs 2 more for 7 tokens but 1 is free → B (the
///         most recent admission) is preempted: its block freed, queue [3, 1].
/// Step 3: A decodes; B is re-admitted from scratch: 7 tokens in blocks [3, 1]; A finishes.
/// Step 4: B computes its last 5 tokens in 1 more block and samples.
#[test]
fn preemption_keeps_logical_fields_and_grows_physical_ones() {
    let mut c = cfg(4, 4);
    c.max_num_batched_tokens = 8;
    c.enable_prefix_caching = false;
    let mut s = sched(c);
    s.add_request(req("a", toks(1, 4), 3)).unwrap();
    s.add_request(req("b", toks(100, 12), 1)).unwrap();
    let fin = run(&mut s);
    assert_eq!(
        fields(&stats_of(&fin, "b")),
        [12, 0, 0, 0, 12, 0, 3, 4, 4, 0, 1]
    );
    assert_eq!(
        fields(&stats_of(&fin, "a")),
        [4, 0, 0, 0, 4, 0, 1, 1, 1, 0, 0]
    );
    assert_eq!(s.totals().num_preemptions, 1);
    assert_eq!(s.totals().prompt_tokens, 16);
}

/// Same workload with caching on. Step 3: B's lookup hits its own first block, but the
/// allocation (2 new + the hit, 3 > 2 free) fails: not recorded. Step 4 (A gone): recorded
/// once, in the preempted pair.
#[test]
fn re_admission_lookup_goes_to_the_preempted_pair_once() {
    let mut c = cfg(4, 4);
    c.max_num_batched_tokens = 8;
    let mut s = sched(c);
    s.add_request(req("a", toks(1, 4), 3)).unwrap();
    s.add_request(req("b", toks(100, 12), 1)).unwrap();
    let fin = run(&mut s);
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (16, 0));
    assert_eq!(
        (
            t.preempted_prefix_cache_queries,
            t.preempted_prefix_cache_hits
        ),
        (12, 4)
    );
    // Logical: all 12 computed, all 12 in new entries (block 0 created in step 1, blocks 1-2 in
    // step 4). Physical: chunks in steps 1 and 4; 1 + 2 allocated; 3 filled.
    assert_eq!(
        fields(&stats_of(&fin, "b")),
        [12, 0, 0, 0, 12, 12, 2, 3, 3, 0, 1]
    );
}

struct FakeTier {
    held: usize,
}
impl KvConnector for FakeTier {
    fn lookup(&mut self, hashes: &[BlockHash]) -> usize {
        self.held.min(hashes.len())
    }
}

#[test]
fn external_tier_tokens_are_cached_not_computed() {
    let s0 = sched(cfg(64, 16));
    let mut s = s0.with_connector(Box::new(FakeTier { held: 3 }));
    s.add_request(req("a", toks(0, 100), 1)).unwrap();
    let out = s.schedule(1.0);
    assert_eq!(out.kv_loads.len(), 3);
    assert_eq!(out.chunks[0].start_pos, 48);
    let res: Vec<_> = out
        .chunks
        .iter()
        .map(|c| c.sample.then(|| cachet_core::Sampled::token(7)))
        .collect();
    s.update(&out, res, 1.0);
    let fin = s.take_finished();
    // 48 loaded, 52 computed; blocks 3..=5 created with 48 computed tokens.
    assert_eq!(
        fields(&stats_of(&fin, "a")),
        [100, 0, 48, 48, 52, 48, 1, 7, 6, 0, 0]
    );
    let t = s.totals();
    assert_eq!(
        (
            t.external_prefix_cache_queries,
            t.external_prefix_cache_hits
        ),
        (96, 48)
    );
    assert_eq!(t.prompt_tokens_external_kv_transfer, 48);
}

#[test]
fn rejects_what_can_never_run() {
    let mut c = cfg(4, 16);
    c.max_model_len = 128;
    let mut s = sched(c);
    assert!(s.add_request(req("e", vec![], 1)).is_err());
    assert!(s.add_request(req("long", toks(0, 128), 1)).is_err());
    assert!(s.add_request(req("zero", toks(0, 8), 0)).is_err());
    assert!(s.add_request(req("big", toks(0, 100), 1)).is_err()); // 7 blocks > 4
    s.add_request(req("ok", toks(0, 8), 1)).unwrap();
    assert!(s.add_request(req("ok", toks(0, 8), 1)).is_err());
}
