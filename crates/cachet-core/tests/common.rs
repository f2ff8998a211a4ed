//! Shared test driver: a scheduler run with a trivial executor (every sampled token is 7).
#![allow(dead_code)]

use cachet_core::scheduler::{RequestUpdate, SchedulerOutput};
use cachet_core::stats::{FinishedRequestStats, PrefillStats};
use cachet_core::{HashSeed, NewRequest, Sampled, SamplingParams, Scheduler, SchedulerConfig};

pub fn cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        ..Default::default()
    }
}

pub fn sched(cfg: SchedulerConfig) -> Scheduler {
    let seed = HashSeed::new(&[9; 32], cfg.block_size, "test");
    Scheduler::new(cfg, seed)
}

pub fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest::new(
        id,
        prompt,
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    )
}

/// One step: schedule, "execute" (token 7 for every sampled chunk), update.
pub fn step(s: &mut Scheduler, now: f64) -> (SchedulerOutput, Vec<RequestUpdate>) {
    let out = s.schedule(now);
    let results: Vec<Option<Sampled>> = out
        .chunks
        .iter()
        .map(|c| c.sample.then(|| Sampled::token(7)))
        .collect();
    let ups = s.update(&out, results, now);
    (out, ups)
}

/// Run until nothing is left; returns every finished request's stats.
pub fn run(s: &mut Scheduler) -> Vec<FinishedRequestStats> {
    let mut fin = Vec::new();
    let mut t = 0.0;
    while s.has_unfinished() {
        t += 1.0;
        step(s, t);
        s.check_invariants().unwrap();
        fin.extend(s.take_finished());
        assert!(t < 10_000.0, "no progress");
    }
    fin
}

pub fn stats_of(fin: &[FinishedRequestStats], id: &str) -> PrefillStats {
    fin.iter()
        .find(|f| f.request_id == id)
        .and_then(|f| f.prefill_stats)
        .expect("stats")
}

/// Logical + physical fields, without the two timing fields.
pub fn fields(p: &PrefillStats) -> [u64; 11] {
    [
        p.prompt_tokens,
        p.local_cached_tokens,
        p.external_cached_tokens,
        p.cached_tokens,
        p.computed_tokens,
        p.cache_creation_tokens,
        p.prefill_chunks,
        p.blocks_allocated,
        p.blocks_filled,
        p.blocks_evicted,
        p.preemptions,
    ]
}
