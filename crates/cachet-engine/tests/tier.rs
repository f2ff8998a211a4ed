//! The tier seam on the simulated executor: engine A computes a prompt and saves its new cache
//! entries to a shared in-memory tier; engine B (another "instance", same model) finds them,
//! waits for the loads, writes the loaded fingerprints into its blocks and computes only the
//! rest — with the same output as A, and the accounting of spec §2-§3 and §6.

use cachet_core::{FinishReason, RequestDraft, SamplingParams, SchedulerConfig};
use cachet_engine::offline::TotalsLogger;
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::step::{CoreOptions, EngineCore};
use cachet_engine::tier::{KvTier, MemoryTier};
use cachet_engine::CounterDeltas;

const B: usize = 16;

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        block_size: B,
        num_blocks: 64,
        ..Default::default()
    }
}

fn engine(tier: MemoryTier, totals: &TotalsLogger) -> EngineCore<SimExecutor> {
    let sim = SimExecutor::new(SimConfig {
        num_blocks: 64,
        block_size: B,
        ..Default::default()
    });
    EngineCore::new(
        cfg(),
        sim,
        CoreOptions {
            telemetry: true,
            loggers: vec![Box::new(totals.clone())],
            tier: Some(Box::new(tier) as Box<dyn KvTier>),
            ..Default::default()
        },
    )
}

/// Runs one request to its end; returns (output tokens, final report).
fn run_one(
    core: &mut EngineCore<SimExecutor>,
    handle: u64,
    prompt: Vec<u32>,
) -> (Vec<u32>, cachet_core::Report) {
    let d = RequestDraft::new(
        format!("r{handle}"),
        prompt,
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(4)
        },
    );
    let v = cfg().limits().validate(d).unwrap();
    core.add_request(handle, 0.0, v).unwrap();
    let mut out = Vec::new();
    let mut report = None;
    for step in 1..100 {
        for u in core.step(|| step as f64).unwrap() {
            out.extend(u.token.map(|t| t.token));
            if u.finish.is_some() {
                assert_eq!(u.finish, Some(FinishReason::Length));
                report = u.report.map(|r| *r);
            }
        }
        if !core.scheduler().has_unfinished() {
            break;
        }
    }
    (out, report.expect("finished"))
}

#[test]
fn a_second_instance_loads_what_the_first_computed() {
    let shared = MemoryTier::new();
    let prompt: Vec<u32> = (0..100).map(|i| 40 + i % 70).collect();

    let a_totals = TotalsLogger::default();
    let mut a = engine(shared.share(), &a_totals);
    let (a_out, a_rep) = run_one(&mut a, 1, prompt.clone());
    let a_stats = a_rep.prefill_stats.unwrap();
    assert_eq!(
        (a_stats.external_cached_tokens, a_stats.computed_tokens),
        (0, 100)
    );
    // A saved its 6 new cache entries (96 tokens) to the tier.
    assert_eq!(shared.len(), 6);

    let b_totals = TotalsLogger::default();
    let mut b = engine(shared.share(), &b_totals);
    let (b_out, b_rep) = run_one(&mut b, 1, prompt);
    assert_eq!(b_out, a_out, "the loaded KV is the KV A computed");
    let s = b_rep.prefill_stats.unwrap();
    // N-1 = 99 → 6 whole blocks from the tier; 4 tokens computed in a 7th block.
    assert_eq!(
        (
            s.local_cached_tokens,
            s.external_cached_tokens,
            s.computed_tokens,
            s.cache_creation_tokens,
            s.blocks_filled
        ),
        (0, 96, 4, 0, 6)
    );
    assert_eq!(b_rep.external.redis, 96);
    let t: CounterDeltas = b_totals.0.lock().map(|t| *t).unwrap();
    assert_eq!(
        (
            t.prefix_cache_queries,
            t.prefix_cache_hits,
            t.external_prefix_cache_queries,
            t.external_prefix_cache_hits
        ),
        (100, 0, 100, 96)
    );
    assert_eq!(
        (
            t.prompt_tokens_external_kv_transfer,
            t.prompt_tokens_local_compute,
            t.prompt_tokens_cached_redis
        ),
        (96, 4, 96)
    );
}

/// A block whose value is missing from the tier at load time (evicted from Redis, say): the
/// blocks from it on are computed and counted as computed; the output is still A's.
#[test]
fn a_failed_load_is_computed_and_the_output_is_unchanged() {
    let shared = MemoryTier::new();
    let prompt: Vec<u32> = (0..100).map(|i| 40 + i % 70).collect();
    let a_totals = TotalsLogger::default();
    let mut a = engine(shared.share(), &a_totals);
    let (a_out, _) = run_one(&mut a, 1, prompt.clone());

    // B looks up (all 6 present), then the 3rd block vanishes before its load is answered.
    struct Vanishing {
        inner: MemoryTier,
        victim: Option<cachet_core::BlockHash>,
    }
    impl cachet_core::tier::KvLookup for Vanishing {
        fn lookup(&mut self, hashes: &[cachet_core::BlockHash]) -> usize {
            let n = self.inner.lookup(hashes);
            self.victim = hashes.get(2).copied();
            n
        }
    }
    impl KvTier for Vanishing {
        fn start_load(
            &mut self,
            t: cachet_engine::tier::LoadTicket,
            h: Vec<cachet_core::BlockHash>,
        ) {
            if let Some(v) = self.victim.take() {
                self.inner.set(v, None);
            }
            self.inner.start_load(t, h)
        }
        fn poll_loads(&mut self) -> Vec<cachet_engine::tier::LoadDone> {
            self.inner.poll_loads()
        }
        fn save(
            &mut self,
            hash: cachet_core::BlockHash,
            p: cachet_engine::tier::Payload,
            r: cachet_engine::tier::SaveReason,
        ) {
            self.inner.save(hash, p, r)
        }
        fn saves_on(&self) -> cachet_engine::tier::SaveOn {
            self.inner.saves_on()
        }
    }
    let b_totals = TotalsLogger::default();
    let sim = SimExecutor::new(SimConfig {
        num_blocks: 64,
        block_size: B,
        ..Default::default()
    });
    let mut b = EngineCore::new(
        cfg(),
        sim,
        CoreOptions {
            telemetry: true,
            loggers: vec![Box::new(b_totals.clone())],
            tier: Some(Box::new(Vanishing {
                inner: shared.share(),
                victim: None,
            })),
            ..Default::default()
        },
    );
    let (b_out, b_rep) = run_one(&mut b, 1, prompt);
    assert_eq!(b_out, a_out);
    let s = b_rep.prefill_stats.unwrap();
    // Blocks 0 and 1 loaded (32 tokens); from block 2 on computed (68 tokens).
    assert_eq!((s.external_cached_tokens, s.computed_tokens), (32, 68));
    let t = b_totals.0.lock().map(|t| *t).unwrap();
    assert_eq!(
        (
            t.external_prefix_cache_queries,
            t.external_prefix_cache_hits
        ),
        (100, 32)
    );
}
