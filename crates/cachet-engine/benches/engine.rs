//! Scheduler step time with 1,000 running decode requests on the simulated executor at zero
//! model cost (schedule + execute + update + stats). Requests generate 64-191 tokens each and
//! are replaced as they finish, so the batch stays at 1,000 in steady state
//! (`sim::decode_workload_core`).
//!
//! What is measured is each step's **thread CPU time** (`CLOCK_THREAD_CPUTIME_ID`), summed: on
//! a shared machine a step that lost the CPU to another process takes a scheduler time slice
//! (milliseconds) of wall time, and a few of them would make a wall-time mean a measure of the
//! load; a thread's CPU time does not count the time it was not running. (It still counts the
//! cache misses other processes cause by sharing the L3.) Replacing finished requests is not
//! timed.

use std::time::Duration;

use cachet_engine::sim::{add_decode_workload_request, decode_workload_core_with, insight_without};
use cachet_engine::InsightConfig;
use criterion::{criterion_group, Criterion};

/// The same workload with reporting off, on (miss reasons only), and on with every piece of
/// cache insight (shadow set, block index, tenants, lifecycles): the cost of each, same run.
fn step_1000_decodes(c: &mut Criterion) {
    for (name, telemetry, insight) in [
        ("off", false, InsightConfig::off()),
        ("on", true, InsightConfig::off()),
        ("on_insight", true, ablated()),
    ] {
        one(c, name, telemetry, insight);
    }
}

/// Experiments: `CACHET_ABLATE` takes pieces out of the full insight (comma-separated:
/// `history`, `index`, `shadow`, `tenants`).
fn ablated() -> InsightConfig {
    insight_without(&std::env::var("CACHET_ABLATE").unwrap_or_default())
}

/// This thread's CPU time.
fn thread_cpu() -> Duration {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable `struct timespec` (two 64-bit fields on x86_64 and
    // aarch64 Linux); glibc's `clock_gettime` writes it and reads nothing else.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn one(c: &mut Criterion, name: &str, telemetry: bool, insight: InsightConfig) {
    let mut core = decode_workload_core_with(1000, telemetry, insight);
    assert_eq!(core.scheduler().num_running(), 1000);
    let mut next = 1000u64;
    let mut t = 0.0;
    c.bench_function(&format!("engine_step_1000_running_decodes/{name}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                t += 0.001;
                let tt = t;
                let start = thread_cpu();
                let outs = core.step(|| tt).expect("step");
                total += thread_cpu() - start;
                let finished = outs.iter().filter(|o| o.finish.is_some()).count();
                for _ in 0..finished {
                    add_decode_workload_request(&mut core, next).expect("fits");
                    next += 1;
                }
            }
            total
        })
    });
    assert!(core.scheduler().num_running() + core.scheduler().num_waiting() == 1000);
}

/// One workload of the interleaved comparison.
struct Runner {
    core: cachet_engine::step::EngineCore<cachet_engine::sim::SimExecutor>,
    next: u64,
    t: f64,
}

impl Runner {
    fn new(telemetry: bool, insight: InsightConfig) -> Self {
        Runner {
            core: decode_workload_core_with(1000, telemetry, insight),
            next: 1000,
            t: 0.0,
        }
    }

    /// `n` steps; their thread CPU time per step, in µs.
    fn steps(&mut self, n: usize) -> f64 {
        let mut total = Duration::ZERO;
        for _ in 0..n {
            self.t += 0.001;
            let tt = self.t;
            let start = thread_cpu();
            let outs = self.core.step(|| tt).expect("step");
            total += thread_cpu() - start;
            let finished = outs.iter().filter(|o| o.finish.is_some()).count();
            for _ in 0..finished {
                add_decode_workload_request(&mut self.core, self.next).expect("fits");
                self.next += 1;
            }
        }
        total.as_secs_f64() * 1e6 / n as f64
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// `CACHET_INTERLEAVED=ROUNDS`: `on` and `on_insight` in one process, in alternating blocks of
/// 1,000 steps, each block's thread CPU time per step; prints each round's ratio and the
/// median and range. The machine's drift (other processes, the CPU's clock) then falls on
/// both alike, which two criterion runs one after the other cannot promise. Each block
/// follows one of the other workload (so each starts with the caches the other left: the
/// same for both). `CACHET_BLOCK` sets the block's steps (1,000 unless told): shorter blocks
/// put the two closer in time, so the bursts of another process's load fall on both alike.
fn interleaved(rounds: usize) {
    let block: usize = std::env::var("CACHET_BLOCK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let mut on = Runner::new(true, InsightConfig::off());
    let mut full = Runner::new(true, ablated());
    // Past the first generation of requests (64-191 tokens): the steady state.
    on.steps(400);
    full.steps(400);
    let (mut a, mut b, mut r) = (Vec::new(), Vec::new(), Vec::new());
    println!("round  on µs/step  on_insight µs/step  ratio");
    // `CACHET_ONLY=on|on_insight`: run one of the two (for a profiler's per-function counts).
    let only = std::env::var("CACHET_ONLY").unwrap_or_default();
    for i in 0..rounds {
        let x = if only == "on_insight" {
            1.0
        } else {
            on.steps(block)
        };
        let y = if only == "on" { 1.0 } else { full.steps(block) };
        println!("{i:5}  {x:10.1}  {y:18.1}  {:.3}", y / x);
        a.push(x);
        b.push(y);
        r.push(y / x);
    }
    let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = r.iter().copied().fold(0.0, f64::max);
    println!(
        "median  {:10.1}  {:18.1}  {:.3}  (ratio min {lo:.3}, max {hi:.3}, {rounds} rounds of {block} steps each)",
        median(&a),
        median(&b),
        median(&r)
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = step_1000_decodes
}

fn main() {
    if let Some(rounds) = std::env::var("CACHET_INTERLEAVED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        interleaved(rounds);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
