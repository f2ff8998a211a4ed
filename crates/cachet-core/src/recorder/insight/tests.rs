//! The own-entry parent of a fill (`Insight::filled`) against the pool, and the deferred
//! work against the same work done at once, over many small workloads.

use super::*;
use crate::{
    ExecOutput, HashSeed, Recorder, RequestDraft, Sampled, SamplingParams, Scheduler,
    SchedulerConfig,
};

/// (preemptions, evictions, the creator ids' holds), each request's lifecycle, the hottest
/// prefixes.
type Outcome = (
    (u64, u64, usize),
    Vec<Option<RequestLifecycle>>,
    Vec<HotPrefix>,
);

/// One workload on a small pool: `n` requests from `families` prompt families (shared
/// prefixes), sampled tokens from a small alphabet (duplicate blocks), run to the end.
/// Returns its [`Outcome`]: what the inspector shows, and the holds nothing shows.
fn workload(seed: u64, num_blocks: usize, n: u32, families: u32, alphabet: u32) -> Outcome {
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
    // Every request has ended: each hold of a creator id is a live entry's or an `evicted`
    // event's of a kept lifecycle (in the history, or retired and not released yet).
    let ins = &rec.insight;
    let ix = ins.index.as_ref().expect("block index kept");
    let holds = ix.creators.holds();
    let events: usize = ins.history.iter().map(|k| k.owners.len()).sum();
    assert_eq!(
        holds,
        ix.owned_entries() + events + ins.retirement.held(),
        "seed {run}: creator holds"
    );
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

/// What the queue defers (new entries, lifecycle fills) and what it applies early (the fills
/// of a request that ends, before its lifecycle is kept) ends as if each had been applied at
/// once: every lifecycle, the hottest prefixes and the creator ids' holds are the same as
/// with the queue applied after every fill, over workloads where requests end with fills of
/// theirs and of others queued.
#[test]
fn deferred_work_ends_as_if_applied_at_once() {
    FILLS_AT_END.with(|n| n.set(0));
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
    let early = FILLS_AT_END.with(|n| n.get());
    assert!(
        early > 100,
        "fills applied when their request ended: {early}"
    );
}

thread_local! {
    /// Fills whose parent came from the request's own entry (tests).
    pub(super) static OWN_PARENTS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Apply the queue after every fill (the reference the deferred run is checked against).
    pub(super) static IMMEDIATE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Fills recorded when their request ended, ahead of the rest of the queue.
    pub(crate) static FILLS_AT_END: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}
