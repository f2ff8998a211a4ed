//! Scheduler step time with 1,000 running decode requests on the simulated executor at zero
//! model cost (schedule + execute + update + stats). Requests generate 64-191 tokens each and
//! are replaced as they finish, so the batch stays at 1,000 in steady state
//! (`sim::decode_workload_core`).

use std::time::{Duration, Instant};

use cachet_engine::sim::{add_decode_workload_request, decode_workload_core};
use criterion::{criterion_group, criterion_main, Criterion};

fn step_1000_decodes(c: &mut Criterion) {
    let mut core = decode_workload_core(1000, true);
    assert_eq!(core.scheduler().num_running(), 1000);
    let mut next = 1000u64;
    let mut t = 0.0;
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
                    add_decode_workload_request(&mut core, next).expect("fits");
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
