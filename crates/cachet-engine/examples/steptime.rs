//! Step-time probe for the 1,000-decode setup of `benches/engine.rs`, with the request count as
//! a knob: `cargo run --release -p cachet-engine --example steptime -- [on|off] [N]`. Prints the
//! min / median / max of 20 rounds of 400 steps (replacing finished requests is included).
use std::time::Instant;

use cachet_core::{NewRequest, SamplingParams, SchedulerConfig};
use cachet_engine::core_loop::EngineCore;
use cachet_engine::sim::{SimConfig, SimExecutor};

fn request(i: u64) -> NewRequest {
    let prompt: Vec<u32> = (0..8).map(|j| ((i * 8 + j) % 40_000) as u32).collect();
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

fn main() {
    let telemetry = std::env::args().nth(1).is_none_or(|a| a != "off");
    let n: u64 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let cfg = SchedulerConfig {
        num_blocks: 16 * n as usize,
        max_num_seqs: n as usize,
        max_num_batched_tokens: 8192,
        telemetry,
        ..Default::default()
    };
    let sim = SimExecutor::new(SimConfig {
        num_blocks: cfg.num_blocks,
        full_context_check: false,
        ..Default::default()
    });
    let mut core = EngineCore::new(cfg, sim, Vec::new());
    let mut next = 0u64;
    for _ in 0..n {
        core.add_request(request(next)).expect("fits");
        next += 1;
    }
    let mut t = 0.0;
    let mut rounds = Vec::new();
    for round in 0..25 {
        let start = Instant::now();
        for _ in 0..400 {
            t += 0.001;
            let tt = t;
            let outs = core.step(|| tt).expect("step");
            let finished = outs.iter().filter(|o| o.finish.is_some()).count();
            for _ in 0..finished {
                core.add_request(request(next)).expect("fits");
                next += 1;
            }
        }
        if round >= 5 {
            rounds.push(start.elapsed().as_secs_f64() / 400.0 * 1e6);
        }
    }
    rounds.sort_by(|a, b| a.total_cmp(b));
    println!(
        "step µs: min {:.1} median {:.1} max {:.1}",
        rounds[0],
        rounds[rounds.len() / 2],
        rounds[rounds.len() - 1]
    );
}
