//! Scheduler step time with 1,000 running decode requests on the simulated executor at zero
//! model cost (schedule + execute + update + stats).

use cachet_core::{NewRequest, SamplingParams, SchedulerConfig};
use cachet_engine::core_loop::EngineCore;
use cachet_engine::sim::{SimConfig, SimExecutor};
use criterion::{criterion_group, criterion_main, Criterion};

fn step_1000_decodes(c: &mut Criterion) {
    let cfg = SchedulerConfig {
        num_blocks: 20_000,
        max_num_seqs: 1000,
        max_num_batched_tokens: 100_000,
        ..Default::default()
    };
    let sim = SimExecutor::new(SimConfig {
        num_blocks: cfg.num_blocks,
        ..Default::default()
    });
    let mut core = EngineCore::new(cfg, sim, Vec::new());
    for i in 0..1000u32 {
        // 8-token prompts so that the simulator's context read stays small.
        let prompt: Vec<u32> = (0..8).map(|j| i * 8 + j).collect();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(1_000_000)
        };
        core.add_request(NewRequest::new(format!("r{i}"), prompt, params))
            .expect("fits");
    }
    let mut t = 0.0;
    core.step(|| 0.0).expect("prefill");
    assert_eq!(core.scheduler().num_running(), 1000);
    c.bench_function("engine_step_1000_running_decodes", |b| {
        b.iter(|| {
            t += 0.001;
            let tt = t;
            core.step(|| tt).expect("step")
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = step_1000_decodes
}
criterion_main!(benches);
