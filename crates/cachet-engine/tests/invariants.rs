//! Property tests over random workloads (arrivals, shared prefixes, aborts, tight memory) on
//! the simulated executor: no leaks, consistent ref counts and cache map, per-request invariants,
//! hits ≤ queries per interval, Σ per-request logical fields = aggregate counters, and identical
//! schedules and outputs with reporting on and off, and with the cache on and off.

use std::sync::{Arc, Mutex};

use cachet_core::events::CacheEvent;
use cachet_core::scheduler::SchedulerOutput;
use cachet_core::{FinishReason, RequestDraft, SamplingParams, SchedulerConfig, SchedulingPolicy};
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::step::{CoreOptions, EngineCore};
use cachet_engine::{FinishedRequestStats, StatLogger, StepStats};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Arrival {
    step: usize,
    prefix: usize,     // which shared prefix (0..3), or 3 = none
    prefix_len: usize, // tokens of the prefix used
    suffix: Vec<u32>,
    max_tokens: u32,
    abort_after: Option<usize>, // abort this many steps after arrival
    salt: Option<u8>,
    priority: i32,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (
        0usize..30,
        0usize..4,
        0usize..70,
        prop::collection::vec(0u32..50, 1..40),
        1u32..12,
        prop::option::of(0usize..8),
        prop::option::of(0u8..2),
        -1i32..2,
    )
        .prop_map(
            |(step, prefix, prefix_len, suffix, max_tokens, abort_after, salt, priority)| Arrival {
                step,
                prefix,
                prefix_len,
                suffix,
                max_tokens,
                abort_after,
                salt,
                priority,
            },
        )
}

#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<StepStats>>>);
impl StatLogger for Collect {
    fn record(&mut self, s: &StepStats) {
        self.0.lock().unwrap().push(s.clone());
    }
}

struct RunResult {
    outputs: Vec<(String, Vec<u32>, Option<FinishReason>)>,
    schedules: Vec<SchedulerOutput>,
    steps: Vec<StepStats>,
}

fn prompt(a: &Arrival) -> Vec<u32> {
    let mut p: Vec<u32> = if a.prefix < 3 {
        (0..a.prefix_len as u32)
            .map(|i| 1000 * (a.prefix as u32 + 1) + i)
            .collect()
    } else {
        Vec::new()
    };
    p.extend(&a.suffix);
    p
}

fn run(arrivals: &[Arrival], cfg: SchedulerConfig, telemetry: bool) -> RunResult {
    let collect = Collect::default();
    let sim = SimExecutor::new(SimConfig {
        num_blocks: cfg.num_blocks,
        block_size: cfg.block_size,
        ..Default::default()
    });
    // KV cache events, replayed into an index as they come: after every step the index must
    // equal the pool's cache map exactly (hash → block is the pool's; the index keeps hashes).
    let index: Arc<Mutex<std::collections::HashSet<cachet_core::BlockHash>>> = Default::default();
    let idx = Arc::clone(&index);
    let sink = move |batch: Arc<cachet_core::events::EventBatch>| {
        let mut set = idx.lock().unwrap();
        for ev in &batch.events {
            match ev {
                CacheEvent::Stored { hashes, .. } => {
                    for h in hashes {
                        assert!(set.insert(*h), "stored twice without a removal: {h:?}");
                    }
                }
                CacheEvent::Removed { hashes, .. } => {
                    for h in hashes {
                        assert!(set.remove(h), "removed without being stored: {h:?}");
                    }
                }
                CacheEvent::AllCleared { .. } => set.clear(),
            }
        }
    };
    let opts = CoreOptions {
        telemetry,
        loggers: vec![Box::new(collect.clone())],
        tier: None,
        event_sinks: if telemetry {
            vec![Box::new(sink)]
        } else {
            Vec::new()
        },
        // Cache insight in full: it must not change a schedule or an output either.
        insight: if telemetry {
            cachet_core::recorder::InsightConfig::full()
        } else {
            cachet_core::recorder::InsightConfig::off()
        },
    };
    let limits = cfg.limits();
    let mut core = EngineCore::new(cfg.clone(), sim, opts);
    core.record_schedules();
    let mut outputs: Vec<(String, Vec<u32>, Option<FinishReason>)> = Vec::new();
    // Live slot → index in `outputs`; arrival index → live slot.
    let mut by_slot: std::collections::HashMap<u32, usize> = Default::default();
    let mut slot_of: std::collections::HashMap<usize, u32> = Default::default();
    let mut step = 0usize;
    let mut t = 0.0;
    loop {
        t += 1.0;
        for (i, a) in arrivals.iter().enumerate() {
            if a.step == step {
                let mut r = RequestDraft::new(
                    format!("r{i}"),
                    prompt(a),
                    SamplingParams {
                        ignore_eos: true,
                        ..SamplingParams::greedy(a.max_tokens)
                    },
                );
                r.cache_salt = a.salt.map(|s| format!("salt{s}"));
                r.priority = a.priority;
                // A router's prediction on every other request (observed only: the stats'
                // check bounds its shortfall by the computed and the predicted tokens).
                r.predicted_cached_tokens =
                    (i % 2 == 0).then(|| (i as u64 * 37) % (r.prompt.len() as u64 + 20));
                let added = limits
                    .validate(r)
                    .ok()
                    .and_then(|v| core.add_request(i as u64 + 1, t, v).ok());
                if let Some(slot) = added {
                    by_slot.insert(slot, outputs.len());
                    slot_of.insert(i, slot);
                    outputs.push((format!("r{i}"), Vec::new(), None));
                }
            }
            if a.abort_after.map(|d| a.step + d) == Some(step) {
                let live = slot_of.remove(&i);
                if let Some(o) = live.and_then(|slot| core.finish(slot, FinishReason::Abort, t)) {
                    let e = &mut outputs[by_slot.remove(&o.slot).unwrap()];
                    if let Some(f) = o.report.as_ref().and_then(|r| r.finished.as_ref()) {
                        assert_eq!(&*f.request_id, e.0);
                    }
                    e.2 = o.finish;
                }
            }
        }
        let tt = t;
        for o in core.step(|| tt).unwrap() {
            let idx = by_slot[&o.slot];
            let e = &mut outputs[idx];
            if let Some(tok) = &o.token {
                e.1.push(tok.token);
            }
            if o.finish.is_some() {
                // The slot named this request until now: the final report carries its label.
                if let Some(f) = o.report.as_ref().and_then(|r| r.finished.as_ref()) {
                    assert_eq!(&*f.request_id, e.0);
                }
                e.2 = o.finish;
                by_slot.remove(&o.slot);
                slot_of.retain(|_, s| *s != o.slot);
            }
        }
        core.scheduler().check_invariants().unwrap();
        if telemetry {
            let pool: std::collections::HashSet<_> = core
                .scheduler()
                .kv_manager()
                .pool()
                .cache_entries()
                .map(|(h, _)| h)
                .collect();
            assert_eq!(
                *index.lock().unwrap(),
                pool,
                "replayed events differ from the cache map at step {step}"
            );
        }
        step += 1;
        if step > 40 && !core.scheduler().has_unfinished() {
            break;
        }
        assert!(step < 5000, "no progress");
    }
    // Invariant 1: everything is free again, and the cache map is consistent.
    let pool = core.scheduler().kv_manager().pool();
    assert_eq!(pool.num_free(), pool.num_blocks());
    pool.check_invariants().unwrap();
    // A reset clears the cache and the replayed index alike.
    assert!(core.reset_prefix_cache());
    if telemetry {
        assert!(index.lock().unwrap().is_empty());
    }
    let steps = collect.0.lock().unwrap().clone();
    RunResult {
        outputs,
        schedules: core.take_schedules(),
        steps,
    }
}

fn config(num_blocks: usize, budget: usize, caching: bool, priority: bool) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_batched_tokens: budget,
        max_num_seqs: 8,
        long_prefill_token_threshold: 0,
        max_model_len: 256,
        enable_prefix_caching: caching,
        policy: if priority {
            SchedulingPolicy::Priority
        } else {
            SchedulingPolicy::Fcfs
        },
        eos_token_ids: vec![2],
        ..SchedulerConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_every_invariant(
        arrivals in prop::collection::vec(arrival(), 1..14),
        num_blocks in 30usize..80,
        budget in 8usize..64,
        priority in any::<bool>(),
    ) {
        let cfg = config(num_blocks, budget, true, priority);
        let on = run(&arrivals, cfg.clone(), true);

        // Per-request invariants and Σ per-request logical fields = aggregate counters.
        let finished: Vec<FinishedRequestStats> = on.steps.iter().flat_map(|s| s.finished.clone()).collect();
        prop_assert_eq!(finished.len(), on.outputs.len());
        let mut sum = [0u64; 6];
        let mut miss = cachet_core::stats::MissTokens::default();
        for f in &finished {
            if let Some(p) = f.prefill_stats {
                p.check().map_err(TestCaseError::fail)?;
                miss.accumulate(&p.miss_tokens);
                sum[0] += p.prompt_tokens;
                sum[1] += p.local_cached_tokens;
                sum[2] += p.computed_tokens;
                sum[3] += p.cached_tokens;
                sum[4] += p.cache_creation_tokens;
                sum[5] += p.external_cached_tokens;
            }
        }
        let mut totals = cachet_engine::CounterDeltas::default();
        for s in &on.steps {
            // Hits never exceed queries within an interval.
            prop_assert!(s.deltas.prefix_cache_hits <= s.deltas.prefix_cache_queries);
            prop_assert!(s.deltas.preempted_prefix_cache_hits <= s.deltas.preempted_prefix_cache_queries);
            totals.accumulate(&s.deltas);
        }
        prop_assert_eq!(sum[0], totals.prompt_tokens);
        prop_assert_eq!(sum[1], totals.prompt_tokens_local_cache_hit);
        prop_assert_eq!(sum[1], totals.prefix_cache_hits);
        prop_assert_eq!(sum[2], totals.prompt_tokens_local_compute);
        prop_assert_eq!(sum[3], totals.prompt_tokens_cached);
        prop_assert_eq!(sum[4], totals.cache_creation_tokens);
        prop_assert_eq!(sum[5], totals.prompt_tokens_external_kv_transfer);
        prop_assert_eq!(sum[0], totals.prefix_cache_queries);
        // Each miss reason's counter is the sum of the requests' (they sum to computed tokens).
        prop_assert_eq!(
            [miss.capped_for_logits, miss.partial_block, miss.evicted, miss.never_cached, miss.lookup_skipped, miss.load_failed],
            [totals.miss_capped_for_logits, totals.miss_partial_block, totals.miss_evicted, totals.miss_never_cached, totals.miss_lookup_skipped, totals.miss_load_failed]
        );

        // Invariant 2: reporting off → identical schedules and outputs.
        let off = run(&arrivals, config(num_blocks, budget, true, priority), false);
        prop_assert_eq!(&on.schedules, &off.schedules);
        prop_assert_eq!(&on.outputs, &off.outputs);
        prop_assert!(off.steps.iter().all(|s| s.deltas.is_zero()));
    }

    /// Invariant 3 on the simulated model: a prefix hit never changes the output. Without aborts
    /// (whose timing depends on the schedule) every request's tokens are the same with the cache
    /// on and off.
    #[test]
    fn cache_hits_never_change_outputs(
        arrivals in prop::collection::vec(arrival(), 1..10),
        num_blocks in 40usize..80,
    ) {
        let arrivals: Vec<Arrival> = arrivals.into_iter().map(|a| Arrival { abort_after: None, ..a }).collect();
        let on = run(&arrivals, config(num_blocks, 32, true, false), true);
        let off = run(&arrivals, config(num_blocks, 32, false, false), true);
        prop_assert_eq!(&on.outputs, &off.outputs);
    }
}

/// The generator really produces what the properties are about: a fixed tight workload has
/// preemptions, prefix hits, aborts and evictions.
#[test]
fn tight_workload_exercises_preemption_hits_aborts_and_evictions() {
    let arrivals: Vec<Arrival> = (0..12)
        .map(|i| Arrival {
            step: i % 4,
            prefix: i % 2,
            prefix_len: 40,
            suffix: (0..(5 + i as u32 * 3)).collect(),
            max_tokens: 10,
            abort_after: if i % 5 == 0 { Some(3) } else { None },
            salt: None,
            priority: 0,
        })
        .collect();
    let r = run(&arrivals, config(40, 32, true, false), true);
    let mut t = cachet_engine::CounterDeltas::default();
    for s in &r.steps {
        t.accumulate(&s.deltas);
    }
    assert!(t.num_preemptions > 0, "{t:?}");
    assert!(t.prefix_cache_hits > 0, "{t:?}");
    assert!(t.blocks_evicted > 0, "{t:?}");
    assert!(r.outputs.iter().any(|o| o.2 == Some(FinishReason::Abort)));
}
