//! This machine's limits, measured with the pool's threads, for a roofline: int8
//! multiply-add throughput per ISA level (the instruction the level's matmul kernel is built
//! on), f32 FMA throughput (attention), and streaming read bandwidth (decode).
//!
//! Throughputs are in operations per second with one multiply-add counted as 2 operations,
//! the way matmul GOP/s are counted (`2 · m · rows · cols`). Each figure is the best of a few
//! runs of about 20 ms (a shared machine only ever makes a run slower).

use std::time::Instant;

use crate::isa::{self, Isa};
use crate::pool::ThreadPool;

/// Measured limits of this machine at one thread count.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    pub threads: usize,
    /// Int8 multiply-add peak per usable level, GOP/s (`None` where no probe exists: the
    /// scalar level; the AMX level's is the tile unit's `tdpbsud` throughput).
    pub int8_gops: Vec<(Isa, Option<f64>)>,
    /// f32 FMA peak per usable level, GFLOP/s.
    pub f32_gflops: Vec<(Isa, Option<f64>)>,
    /// Streaming read bandwidth from DRAM, GB/s.
    pub read_gbs: f64,
}

impl Limits {
    /// The int8 peak of `level` (GOP/s), if measured.
    pub fn int8(&self, level: Isa) -> Option<f64> {
        self.int8_gops
            .iter()
            .find(|p| p.0 == level)
            .and_then(|p| p.1)
    }

    /// The f32 FMA peak of `level` (GFLOP/s), if measured.
    pub fn f32(&self, level: Isa) -> Option<f64> {
        self.f32_gflops
            .iter()
            .find(|p| p.0 == level)
            .and_then(|p| p.1)
    }
}

/// Measure every usable level and the read bandwidth (`read_bytes` streamed per pass; use
/// several times the last-level cache). Takes about a second.
pub fn measure(pool: &ThreadPool, read_bytes: usize) -> Limits {
    let levels = Isa::supported();
    Limits {
        threads: pool.n_threads(),
        int8_gops: levels.iter().map(|&l| (l, int8_peak(pool, l))).collect(),
        f32_gflops: levels.iter().map(|&l| (l, f32_peak(pool, l))).collect(),
        read_gbs: read_bandwidth(pool, read_bytes),
    }
}

/// Best rate (units per second) of `runs` timed runs of `n_tasks` tasks, each calling
/// `work(iters)` which returns the units it did.
fn best_rate(pool: &ThreadPool, work: &(dyn Fn(usize) -> u64 + Sync)) -> f64 {
    let tasks = pool.n_threads() * 4;
    // Calibrate to about 20 ms per run.
    let mut iters = 1000usize;
    loop {
        let t0 = Instant::now();
        pool.parallel_for(tasks, &|_| {
            std::hint::black_box(work(iters));
        });
        let dt = t0.elapsed().as_secs_f64();
        if dt > 0.005 || iters > 1 << 30 {
            iters = ((iters as f64) * 0.02 / dt.max(1e-9)).max(1.0) as usize;
            break;
        }
        iters *= 8;
    }
    let mut best = 0f64;
    for _ in 0..5 {
        let units = std::sync::atomic::AtomicU64::new(0);
        let t0 = Instant::now();
        pool.parallel_for(tasks, &|_| {
            units.fetch_add(work(iters), std::sync::atomic::Ordering::Relaxed);
        });
        let dt = t0.elapsed().as_secs_f64();
        best = best.max(units.into_inner() as f64 / dt);
    }
    best
}

/// Int8 multiply-add peak of `level` with the pool's threads, GOP/s; `None` for a level
/// without a probe or one this CPU cannot run.
pub fn int8_peak(pool: &ThreadPool, level: Isa) -> Option<f64> {
    if !Isa::supported().contains(&level) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::micro::peak;
        let seed = (isa::detected() as i8) + 1;
        // SAFETY (each closure): the level's target features were detected (checked above).
        let macs = match level {
            Isa::Scalar => return None,
            Isa::Avx2 => best_rate(pool, &|n| unsafe { peak::avx2_maddubs(n, seed) }.0),
            Isa::Avx2Vnni => best_rate(pool, &|n| unsafe { peak::avx_vnni_dpbusd(n, seed) }.0),
            Isa::Avx512 => best_rate(pool, &|n| unsafe { peak::avx512_dpbusd(n, seed) }.0),
            // The tile unit's own peak: the AMX kernels' matmuls are measured against it.
            Isa::Amx => best_rate(pool, &|n| unsafe { peak::amx_dpbsud(n, seed) }.0),
        };
        Some(2.0 * macs / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = pool;
        None
    }
}

/// f32 FMA peak of `level` with the pool's threads, GFLOP/s.
pub fn f32_peak(pool: &ThreadPool, level: Isa) -> Option<f64> {
    if !Isa::supported().contains(&level) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::micro::peak;
        let seed = 1.0 + isa::detected() as u8 as f32 * 1e-3;
        // SAFETY (each closure): the level's target features were detected (checked above).
        let fmas = match level {
            Isa::Scalar => return None,
            Isa::Avx2 | Isa::Avx2Vnni => best_rate(pool, &|n| unsafe { peak::avx2_fma(n, seed) }.0),
            Isa::Avx512 | Isa::Amx => best_rate(pool, &|n| unsafe { peak::avx512_fma(n, seed) }.0),
        };
        Some(2.0 * fmas / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = pool;
        None
    }
}

/// Streaming read bandwidth, GB/s: every thread reads its share of a `bytes`-long buffer
/// (rounded up to 1 MiB chunks), best of 3 passes after a first touch.
pub fn read_bandwidth(pool: &ThreadPool, bytes: usize) -> f64 {
    const CHUNK: usize = 1 << 20;
    let chunks = bytes.div_ceil(CHUNK).max(1);
    let buf: Vec<u8> = (0..chunks * CHUNK).map(|i| (i >> 12) as u8 | 1).collect();
    let read = |c: usize| -> i64 {
        let s = &buf[c * CHUNK..(c + 1) * CHUNK];
        #[cfg(target_arch = "x86_64")]
        if isa::detected() >= Isa::Avx2 {
            // SAFETY: AVX2 detected; the loop reads only inside `s`.
            return unsafe { crate::micro::peak::avx2_read(s) };
        }
        s.chunks_exact(8).fold(0u64, |a, w| {
            a ^ u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]])
        }) as i64
    };
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        pool.parallel_for(chunks, &|c| {
            std::hint::black_box(read(c));
        });
        let dt = t0.elapsed().as_secs_f64();
        best = best.max((chunks * CHUNK) as f64 / dt / 1e9);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probes run, give positive figures where a probe exists, and none elsewhere; the
    /// wider instruction is not slower than the narrower one on the same machine (a loose
    /// check: the figures are machine-dependent).
    #[test]
    fn probes_report_every_usable_level() {
        let pool = ThreadPool::new(1);
        let lim = measure(&pool, 8 << 20);
        assert_eq!(lim.threads, 1);
        assert!(lim.read_gbs > 0.1, "{lim:?}");
        assert_eq!(lim.int8(Isa::Scalar), None);
        for &(l, g) in &lim.int8_gops {
            if l != Isa::Scalar && cfg!(target_arch = "x86_64") {
                assert!(g.is_some_and(|g| g > 1.0), "{l}: {g:?}");
                assert!(lim.f32(l).is_some_and(|g| g > 1.0), "{l}");
            }
        }
        assert_eq!(lim.int8_gops.len(), Isa::supported().len());
    }
}
