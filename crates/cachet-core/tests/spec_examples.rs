//! The worked examples of spec §4 and the accounting scenarios of the engine-core issue, with
//! expected values derived by hand (B = 16 unless stated).

mod common;
use common::*;

use cachet_core::tier::TierTag;

/// A block the (fake) Redis tier supplied.
const R: Option<TierTag> = Some(TierTag::Redis);
use cachet_core::FinishReason;

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

// Field order: prompt, local, external, cached, computed, creation, chunks, allocated, filled,
// evicted, preemptions.

#[test]
fn example_1_cold_prompt_of_100() {
    let mut s = Core::new(cfg(64, 16));
    s.add(req("a", toks(1000, 100), 1)).unwrap();
    let fin = s.run();
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
    let mut s = Core::new(cfg(64, 16));
    s.add(req("a", toks(1000, 100), 1)).unwrap();
    s.run();
    s.add(req("b", toks(1000, 100), 1)).unwrap();
    let fin = s.run();
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
    let mut s = Core::new(cfg(64, 16));
    s.add(req("a", toks(0, 96), 1)).unwrap();
    let fin_a = s.run();
    assert_eq!(stats_of(&fin_a, "a").cache_creation_tokens, 96);
    s.add(req("b", toks(0, 96), 1)).unwrap();
    let fin = s.run();
    // Cap floor(95/16)*16 = 80; the recomputed 6th block's hash already exists → no creation.
    assert_eq!(
        fields(&stats_of(&fin, "b")),
        [96, 80, 0, 80, 16, 0, 1, 1, 1, 0, 0]
    );
}

#[test]
fn example_4_shared_prefix_then_other_suffix() {
    let mut s = Core::new(cfg(64, 16));
    let p = toks(0, 64);
    let a = [p.clone(), toks(500, 40)].concat();
    let b = [p, toks(900, 40)].concat();
    s.add(req("a", a, 1)).unwrap();
    s.run();
    s.add(req("b", b, 1)).unwrap();
    let fin = s.run();
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
    let mut s = Core::new(cfg(8, 16));
    s.add(req("a", toks(0, 100), 1)).unwrap();
    let fin_a = s.run();
    let a_before = stats_of(&fin_a, "a");
    s.add(req("b", toks(5000, 100), 1)).unwrap();
    let fin_b = s.run();
    assert_eq!(
        fields(&stats_of(&fin_b, "b")),
        [100, 0, 0, 0, 100, 96, 1, 7, 6, 5, 0]
    );
    assert_eq!(a_before.blocks_evicted, 0);
    assert_eq!(s.totals().blocks_evicted, 5);
}

#[test]
fn cache_salt_isolates_tenants() {
    let mut s = Core::new(cfg(64, 16));
    let mut a = req("a", toks(0, 100), 1);
    a.cache_salt = Some("tenant-a".into());
    s.add(a).unwrap();
    s.run();
    let mut b = req("b", toks(0, 100), 1);
    b.cache_salt = Some("tenant-b".into());
    s.add(b).unwrap();
    let fin = s.run();
    assert_eq!(stats_of(&fin, "b").local_cached_tokens, 0);
    // Same salt again does hit.
    let mut c = req("c", toks(0, 100), 1);
    c.cache_salt = Some("tenant-a".into());
    s.add(c).unwrap();
    let fin = s.run();
    assert_eq!(stats_of(&fin, "c").local_cached_tokens, 96);
}

#[test]
fn caching_disabled_counts_no_queries() {
    let mut c = cfg(64, 16);
    c.enable_prefix_caching = false;
    let mut s = Core::new(c);
    s.add(req("a", toks(0, 100), 1)).unwrap();
    s.run();
    s.add(req("b", toks(0, 100), 1)).unwrap();
    let fin = s.run();
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
    let mut s = Core::new(cfg(64, 16));
    let mut a = req("a", toks(0, 100), 1);
    a.skip_prefix_cache_read = true;
    s.add(a).unwrap();
    let fin = s.run();
    assert_eq!(stats_of(&fin, "a").cache_creation_tokens, 96);
    assert_eq!(s.totals().prefix_cache_queries, 0);
    s.add(req("b", toks(0, 100), 1)).unwrap();
    let fin = s.run();
    assert_eq!(stats_of(&fin, "b").local_cached_tokens, 96);
}

#[test]
fn abort_during_prefill_counts_lookup_once_and_frees_everything() {
    let mut c = cfg(64, 16);
    c.max_num_batched_tokens = 32; // 100-token prompt needs 4 steps
    let mut s = Core::new(c);
    s.add(req("warm", toks(0, 40), 1)).unwrap();
    s.run();
    s.add(req("a", toks(0, 100), 4)).unwrap();
    s.step(10.0);
    s.step(11.0);
    let up = s.finish("a", FinishReason::Abort, 12.0).unwrap();
    assert_eq!(up.finish, Some(FinishReason::Abort));
    let fin = s.take_finished();
    assert_eq!(fin.len(), 1);
    let st = stats_of(&fin, "a");
    // Hit 2 blocks (32 tokens of the 40-token warm prompt), then chunks of 32 and 32.
    assert_eq!(fields(&st), [100, 32, 0, 32, 68, 64, 2, 4, 4, 0, 0]);
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (140, 32));
    assert_eq!(t.cache_creation_tokens, 32 + 64);
    assert!(!s.s.has_unfinished());
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
    s.s.check_invariants().unwrap();
    // Nothing later re-adds it.
    s.step(13.0);
    assert_eq!(s.totals().prefix_cache_queries, 140);
}

#[test]
fn abort_while_waiting_reports_no_prefill_stats() {
    let mut s = Core::new(cfg(64, 16));
    s.add(req("a", toks(0, 10), 1)).unwrap();
    s.finish("a", FinishReason::Abort, 0.5).unwrap();
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
    let mut s = Core::new(c);
    s.add(req("a", toks(1, 4), 3)).unwrap();
    s.add(req("b", toks(100, 12), 1)).unwrap();
    let fin = s.run();
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
    let mut s = Core::new(c);
    s.add(req("a", toks(1, 4), 3)).unwrap();
    s.add(req("b", toks(100, 12), 1)).unwrap();
    let fin = s.run();
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

/// The tier holds blocks 0..3 of a 100-token prompt. Step 1: the request is admitted, 3 blocks
/// allocated for the loads, nothing computed; it waits. The loads resolve (all intact): 48
/// tokens loaded. Step 2: 52 tokens computed in 4 more blocks; blocks 3..=5 become new entries
/// with 48 computed tokens; blocks 0..=2 (loaded) are filled and cached, but not creations:
/// 6 blocks filled in all.
#[test]
fn external_tier_tokens_are_cached_not_computed() {
    let mut s = Core::new(cfg(64, 16));
    let mut tier = FakeTier { held: 3 };
    let slot = s.add(req("a", toks(0, 100), 1)).unwrap();
    let (out, ups) = s.step_with(1.0, Some(&mut tier));
    assert!(out.chunks.is_empty() && ups.is_empty());
    assert_eq!(out.kv_loads.len(), 1);
    let load = &out.kv_loads[0];
    assert_eq!((load.slot, load.blocks.len()), (slot, 3));
    // Waiting for its KV: counted as waiting, not running.
    let g = s.s.gauges();
    assert_eq!(
        (
            g.num_requests_running,
            g.num_requests_waiting,
            g.num_requests_waiting_for_kv
        ),
        (0, 1, 1)
    );
    // A stale resolution (another handle) is ignored.
    assert_eq!(s.s.resolve_loads(slot, load.handle + 1, &[R; 3]), None);
    assert_eq!(s.s.resolve_loads(slot, load.handle, &[R; 3]), Some(3));
    let (out, _) = s.step_with(2.0, Some(&mut tier));
    assert_eq!(
        (out.chunks[0].start_pos, out.chunks[0].num_tokens),
        (48, 52)
    );
    let fin = s.take_finished();
    assert_eq!(
        fields(&stats_of(&fin, "a")),
        [100, 0, 48, 48, 52, 48, 1, 7, 6, 0, 0]
    );
    let t = s.totals();
    // External queries are N - local_hit = 100 (spec §6).
    assert_eq!(
        (
            t.external_prefix_cache_queries,
            t.external_prefix_cache_hits
        ),
        (100, 48)
    );
    assert_eq!(
        (
            t.prompt_tokens_external_kv_transfer,
            t.prompt_tokens_local_compute
        ),
        (48, 52)
    );
    assert_eq!(t.blocks_filled, 6);
    assert_eq!(
        (
            t.prompt_tokens_cached_device,
            t.prompt_tokens_cached_redis,
            t.prompt_tokens_cached_host
        ),
        (0, 48, 0)
    );
}

/// Spec §2: the second of three blocks fails to load. The first counts as loaded; the second
/// and the third (after the failure) are computed and count as computed tokens; the external
/// hit counter adds only the 16 loaded tokens; the lookup is recorded once.
#[test]
fn failed_loads_are_computed_and_counted_as_computed() {
    let mut s = Core::new(cfg(64, 16));
    let mut tier = FakeTier { held: 3 };
    let slot = s.add(req("a", toks(0, 100), 1)).unwrap();
    let (out, _) = s.step_with(1.0, Some(&mut tier));
    let handle = out.kv_loads[0].handle;
    assert_eq!(s.s.resolve_loads(slot, handle, &[R, None, R]), Some(1));
    let (out, _) = s.step_with(2.0, Some(&mut tier));
    assert_eq!(
        (out.chunks[0].start_pos, out.chunks[0].num_tokens),
        (16, 84)
    );
    let st = stats_of(&s.take_finished(), "a");
    // 84 computed; blocks 1..=5 new entries from computed tokens: 80 creation tokens.
    assert_eq!(fields(&st), [100, 0, 16, 16, 84, 80, 1, 7, 6, 0, 0]);
    let t = s.totals();
    assert_eq!(
        (
            t.prefix_cache_queries,
            t.external_prefix_cache_queries,
            t.external_prefix_cache_hits
        ),
        (100, 100, 16)
    );
}

/// A request aborted while its loads are in flight: freed at once, its lookup counted once, a
/// late resolution ignored.
#[test]
fn abort_while_loading_frees_and_ignores_the_late_resolution() {
    let mut s = Core::new(cfg(64, 16));
    let mut tier = FakeTier { held: 2 };
    let slot = s.add(req("a", toks(0, 100), 1)).unwrap();
    let (out, _) = s.step_with(1.0, Some(&mut tier));
    let handle = out.kv_loads[0].handle;
    let up = s.finish("a", FinishReason::Abort, 1.5).unwrap();
    assert_eq!(up.finish, Some(FinishReason::Abort));
    assert_eq!(s.s.resolve_loads(slot, handle, &[R, R]), None);
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
    assert!(!s.s.has_unfinished());
    let st = stats_of(&s.take_finished(), "a");
    assert_eq!(fields(&st)[..5], [100, 0, 0, 0, 100]);
    assert_eq!(s.totals().prefix_cache_queries, 100);
    s.s.check_invariants().unwrap();
}

#[test]
fn rejects_what_can_never_run_and_what_the_state_forbids() {
    use cachet_core::request::InvalidRequest;
    let mut c = cfg(4, 16);
    c.max_model_len = 128;
    c.max_waiting_requests = 1;
    let mut s = Core::new(c);
    assert_eq!(
        s.add(req("e", vec![], 1)),
        Err(Refused::Invalid(InvalidRequest::EmptyPrompt))
    );
    assert!(matches!(
        s.add(req("long", toks(0, 128), 1)),
        Err(Refused::Invalid(InvalidRequest::PromptTooLong { .. }))
    ));
    assert_eq!(
        s.add(req("zero", toks(0, 8), 0)),
        Err(Refused::Invalid(InvalidRequest::ZeroMaxTokens))
    );
    // 100 + 1 tokens need 7 blocks of 16; the pool has 4.
    assert_eq!(
        s.add(req("big", toks(0, 100), 1)),
        Err(Refused::Invalid(InvalidRequest::CannotFit {
            needed: 7,
            available: 4
        }))
    );
    s.add(req("ok", toks(0, 8), 1)).unwrap();
    // The same label twice is fine (labels are not ids); the queue of 1 is full, though.
    assert_eq!(
        s.add(req("ok", toks(0, 8), 1)),
        Err(Refused::Add(cachet_core::scheduler::AddError::QueueFull {
            waiting: 1
        }))
    );
}
