//! The own-entry parent of a fill (`Insight::filled`) against the pool, the deferred work
//! against the same work done at once, and lifecycles kept in a log that must grow and move
//! them out against the same in a large one, over many small workloads.

use super::*;
use crate::{
    ExecOutput, HashSeed, Recorder, RequestDraft, Sampled, SamplingParams, Scheduler,
    SchedulerConfig,
};

/// (preemptions, evictions, the creator ids in use at the end), each request's lifecycle, the
/// hottest prefixes.
type Outcome = (
    (u64, u64, usize),
    Vec<Option<RequestLifecycle>>,
    Vec<HotPrefix>,
);

/// One workload on a small pool: `n` requests from `families` prompt families (shared
/// prefixes), sampled tokens from a small alphabet (duplicate blocks), run to the end.
/// Returns its [`Outcome`]: what the inspector shows, and the holds nothing shows.
fn workload(seed: u64, num_blocks: usize, n: u32, families: u32, alphabet: u32) -> Outcome {
    workload_with_log(seed, num_blocks, n, families, alphabet, None)
}

/// [`workload`] with the lifecycle log grown to at most `log_max` records.
fn workload_with_log(
    seed: u64,
    num_blocks: usize,
    n: u32,
    families: u32,
    alphabet: u32,
    log_max: Option<usize>,
) -> Outcome {
    let run = seed;
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut rnd = move |m: u32| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 33) % u64::from(m.max(1))) as u32
    };
    let cfg = SchedulerConfig {
        num_blocks,
        block_size: 4,
        ..Default::default()
    };
    let seed = HashSeed::new(&[9; 32], 4, "test");
    let rec = Recorder::new(4).with_insight(InsightConfig::full());
    let mut s = Scheduler::new(cfg, seed, rec);
    if let Some(m) = log_max {
        s.observer_mut().insight.log = LifeLog::with_max(m);
    }
    let limits = s.config().limits();
    let mut pending: Vec<(u32, RequestDraft)> = (0..n)
        .map(|i| {
            let fam = rnd(families);
            let len = 4 + rnd(8);
            let prompt: Vec<u32> = (0..len)
                .map(|k| if k < 4 { fam * 10 + k } else { rnd(alphabet) })
                .collect();
            let d = RequestDraft::new(
                format!("r{i}"),
                prompt,
                SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(4 + rnd(24))
                },
            );
            (rnd(12), d)
        })
        .collect();
    let mut t = 0.0;
    let mut step = 0u32;
    let mut handle = 0;
    while s.has_unfinished() || !pending.is_empty() {
        step += 1;
        t += 1.0;
        // Arrivals over the first steps.
        let (now, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(at, _)| *at < step);
        pending = later;
        for (_, d) in now {
            handle += 1;
            let v = limits.validate(d).expect("valid");
            s.add_request(handle, t, v).expect("queued");
        }
        let out = s.schedule(t, None);
        let results = {
            let batch = s.exec_batch(&out);
            let mut r = ExecOutput::default();
            for seq in &batch.seqs {
                let tok = rnd(alphabet);
                r.sampled
                    .push(seq.sample.as_ref().map(|_| Sampled::token(tok)));
            }
            r
        };
        s.update(&out, results, t);
        s.check_invariants().expect("invariants");
        assert!(t < 5_000.0, "no progress");
    }
    let rec = s.observer_mut();
    let totals = rec.totals();
    let lifecycles = (0..n).map(|i| rec.lifecycle(&format!("r{i}"))).collect();
    let hottest = rec.hottest(t, 64);
    // Every request has ended: each creator id a live entry or a kept lifecycle record names
    // has its label; a sweep keeps exactly those.
    let ins = &mut rec.insight;
    let records: Vec<u32> = ins.log.owners().collect();
    let ix = ins.index.as_mut().expect("block index kept");
    let entries = ix.entry_creators();
    for &id in records.iter().chain(&entries) {
        assert!(ix.creators.alive(id), "seed {run}: id {id} is named");
        assert!(!ix.creators.is_live(id), "seed {run}: id {id} finished");
    }
    ix.sweep_creators(records.iter().copied());
    let named: std::collections::HashSet<u32> = records.into_iter().chain(entries).collect();
    let holds = ix.creators.live();
    assert_eq!(holds, named.len(), "seed {run}: creator ids in use");
    (
        (totals.num_preemptions, totals.blocks_evicted, holds),
        lifecycles,
        hottest,
    )
}

/// The workloads both tests run: pools of 12 to 27 blocks, 8 requests of 3 prompt families,
/// alphabets of 2 to 4 tokens.
fn varied(seed: u64) -> Outcome {
    workload(seed, 12 + (seed % 16) as usize, 8, 3, 2 + (seed % 3) as u32)
}

/// A new entry's parent taken from the request's own newest entry (not read from the
/// pool) is what the pool says, through decode, preemption (blocks freed and handed out
/// again), shared prefixes (hits) and duplicate blocks: `filled` asserts it at each such
/// fill, over many small workloads.
#[test]
fn a_fill_trusts_its_own_entry_only_while_it_holds_it() {
    OWN_PARENTS.with(|n| n.set(0));
    let (mut preempted, mut evicted) = (0, 0);
    for seed in 0..300 {
        let ((p, e, _), _, _) = varied(seed);
        preempted += p;
        evicted += e;
    }
    assert!(preempted > 0 && evicted > 0, "{preempted} {evicted}");
    let own = OWN_PARENTS.with(|n| n.get());
    assert!(own > 1000, "own parents taken: {own}");
}

/// What the queue defers (new entries) ends as if each had been applied at once: every
/// lifecycle, the hottest prefixes and the creator ids in use are the same as with the queue
/// applied after every fill.
#[test]
fn deferred_work_ends_as_if_applied_at_once() {
    for seed in 0..200 {
        let run = |immediate: bool| {
            IMMEDIATE.with(|c| c.set(immediate));
            let r = varied(seed);
            IMMEDIATE.with(|c| c.set(false));
            r
        };
        let (deferred, at_once) = (run(false), run(true));
        assert_eq!(deferred.0, at_once.0, "seed {seed}");
        assert_eq!(deferred.1, at_once.1, "seed {seed}: lifecycles");
        assert_eq!(deferred.2, at_once.2, "seed {seed}: hottest");
        assert!(deferred.1.iter().all(Option::is_some), "seed {seed}");
    }
}

/// Sweeping the creator ids at every arrival (instead of when the table has doubled) frees
/// ids sooner and hands them out again: no lifecycle's owner, no hottest prefix's creator and
/// no count changes.
#[test]
fn sweeping_creator_ids_changes_nothing_shown() {
    use super::super::creators::SWEEP_OFTEN;
    for seed in 0..200 {
        let rare = varied(seed);
        SWEEP_OFTEN.with(|c| c.set(true));
        let often = varied(seed);
        SWEEP_OFTEN.with(|c| c.set(false));
        assert_eq!(often.0, rare.0, "seed {seed}");
        assert_eq!(often.1, rare.1, "seed {seed}: lifecycles");
        assert_eq!(often.2, rare.2, "seed {seed}: hottest");
    }
}

/// A log of at most 8 or 32 records must grow, then move the lifecycles that hold its oldest
/// records out of it, many times over a workload: every lifecycle, the hottest prefixes and
/// the evictions come out as with a log that never runs short.
#[test]
fn lifecycles_moved_out_of_a_short_log_are_the_same() {
    use super::super::lifecycle::SPILLS;
    SPILLS.with(|n| n.set(0));
    for seed in 0..200 {
        let big = varied(seed);
        for max in [8, 32] {
            let short = workload_with_log(
                seed,
                12 + (seed % 16) as usize,
                8,
                3,
                2 + (seed % 3) as u32,
                Some(max),
            );
            // (The ids in use differ: a short log's tail passes records sooner.)
            assert_eq!(
                (short.0 .0, short.0 .1),
                (big.0 .0, big.0 .1),
                "seed {seed}, log of {max}"
            );
            assert_eq!(short.1, big.1, "seed {seed}, log of {max}: lifecycles");
            assert_eq!(short.2, big.2, "seed {seed}, log of {max}: hottest");
        }
    }
    let spills = SPILLS.with(|n| n.get());
    assert!(spills > 1000, "lifecycles moved out: {spills}");
}

thread_local! {
    /// Fills whose parent came from the request's own entry (tests).
    pub(super) static OWN_PARENTS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Apply the queue after every fill (the reference the deferred run is checked against).
    pub(super) static IMMEDIATE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A lifecycle keeps its first [`MAX_BLOCK_EVENTS`] events and counts the rest: a long
/// generation whose every decode block evicts an entry (its eviction and allocation one
/// record, two events) reaches the limit with the log's records merged, and the events kept
/// plus those counted are the blocks the counters say it allocated, filled and evicted for.
#[test]
fn a_long_lifecycle_keeps_its_first_events_and_counts_the_rest() {
    let b = 4;
    let cfg = SchedulerConfig {
        num_blocks: 1600,
        block_size: b,
        ..Default::default()
    };
    let seed = HashSeed::new(&[9; 32], b, "test");
    let rec = Recorder::new(b).with_insight(InsightConfig::full());
    let mut s = Scheduler::new(cfg, seed, rec);
    let limits = s.config().limits();
    let mut t = 0.0;
    let mut run = |s: &mut Scheduler<Recorder>, id: &str, prompt: Vec<u32>, gen: u32, h: u64| {
        let d = RequestDraft::new(
            id.to_string(),
            prompt,
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(gen)
            },
        );
        s.add_request(h, t, limits.validate(d).expect("valid"))
            .expect("queued");
        let mut next = 1000 + h as u32 * 7919;
        while s.has_unfinished() {
            t += 1.0;
            let out = s.schedule(t, None);
            let results = {
                let batch = s.exec_batch(&out);
                let mut r = ExecOutput::default();
                for seq in &batch.seqs {
                    next = next.wrapping_mul(1103515245).wrapping_add(12345) % 30_000;
                    r.sampled
                        .push(seq.sample.as_ref().map(|_| Sampled::token(next)));
                }
                r
            };
            s.update(&out, results, t);
        }
    };
    // Fill the cache with entries of a first request (its blocks, freed, are all cached).
    run(&mut s, "fill", (0..8).collect(), 1500 * b as u32, 1);
    let before = s.observer_mut().totals();
    // 1,400 blocks: each decode block evicts one of those entries.
    run(
        &mut s,
        "long",
        (40_000..40_008).collect(),
        1400 * b as u32,
        2,
    );
    let rec = s.observer_mut();
    let after = rec.totals();
    let (alloc, filled, evicted) = (
        after.blocks_allocated - before.blocks_allocated,
        after.blocks_filled - before.blocks_filled,
        after.blocks_evicted - before.blocks_evicted,
    );
    assert!(evicted > 1300, "evictions: {evicted}");
    let l = rec.lifecycle("long").expect("kept");
    assert_eq!(l.blocks.len(), MAX_BLOCK_EVENTS);
    assert_eq!(
        l.blocks.len() as u64 + l.blocks_dropped,
        alloc + filled + evicted,
        "every event kept or counted"
    );
    // Kept in order: once the never-used blocks are taken, each decode block's eviction,
    // allocation and fill, one after the other (the last block's cut where the limit fell).
    let decode: Vec<_> = l
        .blocks
        .iter()
        .skip_while(|e| e.event != BlockEventKind::Evicted)
        .map(|e| (e.index.expect("indexed"), e.event))
        .collect();
    assert!(decode.len() > 3800, "{}", decode.len());
    let pattern = [
        BlockEventKind::Evicted,
        BlockEventKind::Allocated,
        BlockEventKind::Filled,
    ];
    for (k, &(i, ev)) in decode.iter().enumerate() {
        assert_eq!(ev, pattern[k % 3], "event {k}");
        assert_eq!(i, decode[0].0 + (k / 3) as u32, "event {k}");
    }
    // Here the limit falls inside a decode block's record: its eviction is the last event
    // kept, its allocation the first counted (the two are not merged when only one fits).
    assert_eq!(decode.len() % 3, 1);
    assert_eq!(
        l.blocks[MAX_BLOCK_EVENTS - 1].event,
        BlockEventKind::Evicted
    );
    assert!(l
        .blocks
        .iter()
        .any(|e| e.event == BlockEventKind::Evicted && e.owner.as_deref() == Some("fill")));
}

/// With no room for evicted hashes (`--eviction-shadow-blocks 0`) there is no shadow set at
/// all: its larger pools would hold nothing either, and keeping their books at every
/// allocation would be work for no number. Miss reasons still come: an evicted block counts
/// as `never_cached`.
#[test]
fn no_shadow_set_is_kept_when_it_may_hold_nothing() {
    let pool = crate::block_pool::BlockPool::new(8);
    for (cfg, kept) in [
        (InsightConfig::off(), false),
        (
            InsightConfig {
                shadow_blocks: Some(0),
                ..InsightConfig::full()
            },
            false,
        ),
        (InsightConfig::full(), true),
    ] {
        let mut ins = Insight::new(cfg, 4);
        ins.ensure(&pool);
        assert_eq!(ins.shadow.is_some(), kept, "{cfg:?}");
        assert_eq!(ins.index.is_some(), cfg.block_index, "{cfg:?}");
    }
}
