//! This machine's limits (`cachet_kernels::probe`): int8 and f32 peaks per ISA level and the
//! read bandwidth, at 1 thread and at `T` threads (default 2).
//! `cargo run --release -p cachet-kernels --example limits`

use cachet_kernels::{probe, ThreadPool};

fn main() {
    let t: usize = std::env::var("T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    for threads in [1, t] {
        let pool = ThreadPool::new(threads);
        let lim = probe::measure(&pool, 512 << 20);
        println!("threads {threads}: read {:.1} GB/s", lim.read_gbs);
        for ((l, i8), (_, f)) in lim.int8_gops.iter().zip(&lim.f32_gflops) {
            let show = |v: &Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
            println!(
                "  {l:9} int8 {:>6} GOP/s   f32 {:>5} GFLOP/s",
                show(i8),
                show(f)
            );
        }
    }
}
