//! Speculative decoding on the simulated executor, as property tests: random workloads with
//! speculation on and off give identical greedy outputs; every invariant of the engine's
//! property test (`invariants.rs`) still holds with speculation on; and when requests run one
//! at a time (so that no decision depends on how many steps a request took) every
//! per-request prompt/cache number is identical too.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use cachet_core::events::CacheEvent;
use cachet_core::spec_decode::SpecConfig;
use cachet_core::{FinishReason, RequestDraft, SamplingParams, SchedulerConfig};
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::step::{CoreOptions, EngineCore};
use cachet_engine::{FinishedRequestStats, StatLogger, StepStats};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Arrival {
    step: usize,
    /// Which shared prefix (0..3), or 3 = none.
    prefix: usize,
    prefix_len: usize,
    suffix: Vec<u32>,
    max_tokens: u32,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (
        0usize..20,
        0usize..4,
        0usize..40,
        prop::collection::vec(35u32..40, 1..30),
        1u32..30,
    )
        .prop_map(|(step, prefix, prefix_len, suffix, max_tokens)| Arrival {
            step,
            prefix,
            prefix_len,
            suffix,
            max_tokens,
        })
}

fn prompt(a: &Arrival) -> Vec<u32> {
    let mut p: Vec<u32> = if a.prefix < 3 {
        // A repetitive prefix (period 5), so the proposer finds matches in the prompt.
        (0..a.prefix_len as u32)
            .map(|i| 1000 * (a.prefix as u32 + 1) + i % 5)
            .collect()
    } else {
        Vec::new()
    };
    p.extend(&a.suffix);
    p
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
    steps: Vec<StepStats>,
    num_steps: usize,
}

/// Run the arrivals; `sequential`: each request arrives when the previous one has finished.
fn run(arrivals: &[Arrival], cfg: SchedulerConfig, vocab: u32, sequential: bool) -> RunResult {
    let collect = Collect::default();
    let sim = SimExecutor::new(SimConfig {
        num_blocks: cfg.num_blocks,
        block_size: cfg.block_size,
        vocab_size: vocab,
        ..Default::default()
    });
    let index: Arc<Mutex<HashSet<cachet_core::BlockHash>>> = Default::default();
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
        telemetry: true,
        loggers: vec![Box::new(collect.clone())],
        tier: None,
        event_sinks: vec![Box::new(sink)],
        insight: cachet_core::recorder::InsightConfig::full(),
    };
    let limits = cfg.limits();
    let max_model_len = cfg.max_model_len;
    let mut core = EngineCore::new(cfg, sim, opts);
    let mut outputs: Vec<(String, Vec<u32>, Option<FinishReason>)> = Vec::new();
    let mut by_slot: HashMap<u32, usize> = HashMap::new();
    let mut step = 0usize;
    let mut next = 0usize;
    let mut t = 0.0;
    loop {
        t += 1.0;
        for (i, a) in arrivals.iter().enumerate() {
            let due = if sequential {
                i == next && !core.scheduler().has_unfinished()
            } else {
                a.step == step
            };
            if !due {
                continue;
            }
            next += 1;
            let r = RequestDraft::new(
                format!("r{i}"),
                prompt(a),
                SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(a.max_tokens)
                },
            );
            let added = limits
                .validate(r)
                .ok()
                .and_then(|v| core.add_request(i as u64 + 1, t, v).ok());
            if let Some(slot) = added {
                by_slot.insert(slot, outputs.len());
                outputs.push((format!("r{i}"), Vec::new(), None));
            }
        }
        let tt = t;
        for o in core.step(|| tt).unwrap() {
            let e = &mut outputs[by_slot[&o.slot]];
            if let Some(tok) = &o.token {
                e.1.push(tok.token);
            }
            if o.finish.is_some() {
                if let Some(f) = o.report.as_ref().and_then(|r| r.finished.as_ref()) {
                    assert_eq!(&*f.request_id, e.0);
                }
                e.2 = o.finish;
                by_slot.remove(&o.slot);
            }
        }
        core.scheduler().check_invariants().unwrap();
        let pool: HashSet<_> = core
            .scheduler()
            .kv_manager()
            .pool()
            .cache_entries()
            .map(|(h, _)| h)
            .collect();
        assert_eq!(*index.lock().unwrap(), pool, "events differ at step {step}");
        step += 1;
        let all_in = if sequential {
            next >= arrivals.len()
        } else {
            step > 25
        };
        if all_in && !core.scheduler().has_unfinished() {
            break;
        }
        assert!(step < 5000, "no progress");
    }
    let pool = core.scheduler().kv_manager().pool();
    assert_eq!(pool.num_free(), pool.num_blocks());
    pool.check_invariants().unwrap();
    // Every output within max_tokens and the context.
    for o in &outputs {
        let a = &arrivals[o.0[1..].parse::<usize>().unwrap()];
        assert!(o.1.len() <= a.max_tokens as usize);
        assert!(prompt(a).len() + o.1.len() <= max_model_len);
    }
    let steps = collect.0.lock().unwrap().clone();
    RunResult {
        outputs,
        steps,
        num_steps: step,
    }
}

fn config(num_blocks: usize, budget: usize, spec: Option<SpecConfig>) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_batched_tokens: budget,
        max_num_seqs: 8,
        max_model_len: 256,
        eos_token_ids: vec![2],
        speculative: spec,
        ..SchedulerConfig::default()
    }
}

fn spec(k: usize, min: usize, max: usize) -> Option<SpecConfig> {
    Some(SpecConfig {
        num_speculative_tokens: k,
        prompt_lookup_min: min,
        prompt_lookup_max: max.max(min),
        ..Default::default()
    })
}

/// Per-request stats by label.
fn finished(r: &RunResult) -> HashMap<String, FinishedRequestStats> {
    r.steps
        .iter()
        .flat_map(|s| s.finished.clone())
        .map(|f| (f.request_id.to_string(), f))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn speculation_changes_no_output_and_keeps_every_invariant(
        arrivals in prop::collection::vec(arrival(), 1..10),
        num_blocks in 30usize..80,
        budget in 8usize..64,
        vocab in 2u32..6,
        k in 1usize..6,
        min in 1usize..3,
        max in 1usize..5,
    ) {
        let on = run(&arrivals, config(num_blocks, budget, spec(k, min, max)), vocab, false);
        let off = run(&arrivals, config(num_blocks, budget, None), vocab, false);
        prop_assert_eq!(&on.outputs, &off.outputs);

        // The invariants of the plain property test, with speculation on.
        let fin = finished(&on);
        prop_assert_eq!(fin.len(), on.outputs.len());
        let mut sum = [0u64; 5];
        for f in fin.values() {
            if let Some(p) = f.prefill_stats {
                p.check().map_err(TestCaseError::fail)?;
                sum[0] += p.prompt_tokens;
                sum[1] += p.local_cached_tokens;
                sum[2] += p.computed_tokens;
                sum[3] += p.cached_tokens;
                sum[4] += p.cache_creation_tokens;
            }
        }
        let mut totals = cachet_engine::CounterDeltas::default();
        let mut spec_tot = cachet_core::spec_decode::SpecDecodeStats::default();
        for s in &on.steps {
            prop_assert!(s.deltas.prefix_cache_hits <= s.deltas.prefix_cache_queries);
            totals.accumulate(&s.deltas);
            spec_tot.num_drafts += s.spec.num_drafts;
            spec_tot.num_draft_tokens += s.spec.num_draft_tokens;
            spec_tot.num_accepted_tokens += s.spec.num_accepted_tokens;
            // Per position: at most K positions, each accepted count at most the drafts, and
            // they sum to the accepted tokens.
            prop_assert!(s.spec.accepted_per_pos.len() <= k);
            prop_assert_eq!(s.spec.accepted_per_pos.iter().sum::<u64>(), s.spec.num_accepted_tokens);
            prop_assert!(s.spec.accepted_per_pos.iter().all(|&c| c <= s.spec.num_drafts));
        }
        prop_assert_eq!(sum[0], totals.prompt_tokens);
        prop_assert_eq!(sum[1], totals.prompt_tokens_local_cache_hit);
        prop_assert_eq!(sum[2], totals.prompt_tokens_local_compute);
        prop_assert_eq!(sum[3], totals.prompt_tokens_cached);
        prop_assert_eq!(sum[4], totals.cache_creation_tokens);
        prop_assert!(spec_tot.num_accepted_tokens <= spec_tot.num_draft_tokens);
        prop_assert!(spec_tot.num_draft_tokens <= k as u64 * spec_tot.num_drafts);
        // Generation tokens are counted once each, drafts or not.
        let gen: u64 = fin.values().map(|f| f.generation_tokens).sum();
        let out: usize = on.outputs.iter().map(|o| o.1.len()).sum();
        prop_assert_eq!(gen, out as u64);
        prop_assert!(off.steps.iter().all(|s| s.spec.is_zero()));
    }

    /// One request at a time: each request's prompt/cache numbers and its finish are exactly
    /// those of plain decoding, and speculation never takes more steps.
    #[test]
    fn one_at_a_time_every_per_request_number_is_identical(
        arrivals in prop::collection::vec(arrival(), 1..8),
        num_blocks in 40usize..80,
        vocab in 2u32..5,
        k in 1usize..6,
    ) {
        let on = run(&arrivals, config(num_blocks, 32, spec(k, 1, 3)), vocab, true);
        let off = run(&arrivals, config(num_blocks, 32, None), vocab, true);
        prop_assert_eq!(&on.outputs, &off.outputs);
        prop_assert!(on.num_steps <= off.num_steps);
        let (a, b) = (finished(&on), finished(&off));
        prop_assert_eq!(a.len(), b.len());
        for (id, f) in &a {
            let g = &b[id];
            prop_assert_eq!(f.prefill_stats, g.prefill_stats, "{}", id);
            prop_assert_eq!(f.generation_tokens, g.generation_tokens);
            prop_assert_eq!(f.finish_reason, g.finish_reason);
            prop_assert_eq!(f.num_preemptions, g.num_preemptions);
        }
        let (mut ta, mut tb) = (cachet_engine::CounterDeltas::default(), cachet_engine::CounterDeltas::default());
        for s in &on.steps { ta.accumulate(&s.deltas); }
        for s in &off.steps { tb.accumulate(&s.deltas); }
        prop_assert_eq!(ta, tb);
    }
}

/// The generator exercises speculation: a fixed workload whose prompt repeats gets drafts and
/// accepts some.
#[test]
fn a_repetitive_workload_drafts_and_accepts() {
    let arrivals: Vec<Arrival> = (0..4)
        .map(|i| Arrival {
            step: i,
            prefix: i % 3,
            prefix_len: 30,
            suffix: vec![35, 36, 35, 36, 35, 36],
            max_tokens: 25,
        })
        .collect();
    let r = run(&arrivals, config(60, 32, spec(4, 1, 3)), 2, false);
    let mut st = cachet_core::spec_decode::SpecDecodeStats::default();
    for s in &r.steps {
        st.num_drafts += s.spec.num_drafts;
        st.num_accepted_tokens += s.spec.num_accepted_tokens;
    }
    assert!(st.num_drafts > 0, "{st:?}");
    assert!(st.num_accepted_tokens > 0, "{st:?}");
    let off = run(&arrivals, config(60, 32, None), 2, false);
    assert_eq!(r.outputs, off.outputs);
    assert!(r.num_steps < off.num_steps);
}
