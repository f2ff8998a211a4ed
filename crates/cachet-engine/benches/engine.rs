//! Scheduler step time with 1,000 running decode requests on the simulated executor at zero
//! model cost (schedule + execute + update + stats). Requests generate 64-191 tokens each and
//! are replaced as they finish, so the batch stays at 1,000 in steady state.

use std::time::{Duration, Instant};

use cachet_core::{NewRequest, SamplingParams, SchedulerConfig};
use cachet_engine::core_loop::EngineCore;
use cachet_engine::sim::{SimConfig, SimExecutor};
use criterion::{criterion_group, criterion_main, Criterion};

fn request(i: u64) -> NewRequest {
    let prompt: Vec<u32> = (0..8).map(|j| ((i * 8 + j) % 40_000) as u32).collect();
    // Staggered lengths so that a few requests finish (and are replaced) in every step.
    let max_tokens = 64 + (i % 128) as u32;
    NewRequest::new(
        format!("r{i}"),
        prompt,
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    )
}

fn step_1000_decodes(c: &mut Criterion) {
    let cfg = SchedulerConfig {
        num_blocks: 16_000,
        max_num_seqs: 1000,
        max_num_batched_tokens: 8192,
        ..Default::default()
    };
    let sim = SimExecutor::new(SimConfig {
        num_blocks: cfg.num_blocks,
        full_context_check: false,
        ..Default::default()
    });
    let mut core = EngineCore::new(cfg, sim, Vec::new());
    let mut next = 0u64;
    for _ in 0..1000 {
        core.add_request(request(next)).expect("fits");
        next += 1;
    }
    let mut t = 0.0;
    core.step(|| 0.0).expect("prefill");
    assert_eq!(core.scheduler().num_running(), 1000);
    c.bench_function("engine_step_1000_running_decodes", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                t += 0.001;
                let tt = t;
                let start = Instant::now();
                let outs = core.step(|| tt).expect("step");
                spent += start.elapsed();
                let finished = outs.iter().filter(|o| o.finish.is_some()).count();
                for _ in 0..finished {
                    core.add_request(request(next)).expect("fits");
                    next += 1;
                }
            }
            spent
        })
    });
    assert!(core.scheduler().num_running() + core.scheduler().num_waiting() == 1000);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = step_1000_decodes
}
criterion_main!(benches);
