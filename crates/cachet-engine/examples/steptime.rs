//! Step-time probe for the decode workload of `benches/engine.rs`, with the request count as
//! a knob: `cargo run --release -p cachet-engine --example steptime -- [on|off|full] [N]`
//! (`full`: with every piece of cache insight). Prints the
//! min / median / max of 20 rounds of 400 steps (replacing finished requests is included), and
//! with reporting on the blocks filled per step (each a block boundary of one request; what
//! `scripts/insight-instructions.py` divides by).
use std::time::Instant;

use cachet_engine::sim::{add_decode_workload_request, decode_workload_core_with, insight_without};
use cachet_engine::InsightConfig;

/// Rounds of steps, the first few of which warm up and are not timed.
const ROUNDS: usize = 25;
const WARM_ROUNDS: usize = 5;
const STEPS: usize = 400;

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let telemetry = mode != "off";
    let insight = if mode == "full" {
        // `CACHET_ABLATE` takes pieces out, as in `benches/engine.rs`.
        insight_without(&std::env::var("CACHET_ABLATE").unwrap_or_default())
    } else {
        InsightConfig::off()
    };
    let n: u64 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let mut core = decode_workload_core_with(n, telemetry, insight);
    let mut next = n;
    let mut t = 0.0;
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..STEPS {
            t += 0.001;
            let tt = t;
            let outs = core.step(|| tt).expect("step");
            let finished = outs.iter().filter(|o| o.finish.is_some()).count();
            for _ in 0..finished {
                add_decode_workload_request(&mut core, next).expect("fits");
                next += 1;
            }
        }
        if round >= WARM_ROUNDS {
            rounds.push(start.elapsed().as_secs_f64() / STEPS as f64 * 1e6);
        }
    }
    rounds.sort_by(|a, b| a.total_cmp(b));
    println!(
        "step µs: min {:.1} median {:.1} max {:.1}",
        rounds[0],
        rounds[rounds.len() / 2],
        rounds[rounds.len() - 1]
    );
    if let Some(r) = core.recorder() {
        println!(
            "blocks filled per step: {:.2} ({} steps)",
            r.totals().blocks_filled as f64 / (ROUNDS * STEPS) as f64,
            ROUNDS * STEPS
        );
    }
}
