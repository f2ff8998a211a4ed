//! Monotonic totals of the tier client, read with [`crate::TierClient::stats`].
//!
//! Every field except the gauges (`host_resident_*`, `redis_up`, `save_queue_len`) only grows,
//! so the engine's one delta tracker can turn two snapshots into per-interval increments. The
//! Prometheus names these map to (the server owns them): bytes and seconds per tier are vLLM's
//! `vllm:kv_offload_*` load/store family; blocks, save drops, load failures by cause and the
//! latency histogram are `cachet:` metrics.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::format::LoadError;
use crate::TierKind;

/// Upper bounds (seconds) of the load-latency histogram buckets; a last bucket is `+Inf`.
pub const LOAD_LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// vLLM's `TRANSFER_SIZE_BUCKETS` (bytes) of `vllm:kv_offload_load_size` / `_store_size`.
pub const TRANSFER_SIZE_BUCKETS: &[f64] =
    &[1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6];

/// vLLM's buckets (seconds) of `vllm:kv_offload_lookup_sync_delay_seconds`.
pub const LOOKUP_DELAY_BUCKETS: &[f64] = &[
    0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0,
];

/// A histogram's totals: `counts[i]` observations `<= bounds[i]` and above the previous bound
/// (not cumulative); the last entry counts those above every bound. `sum` is in the observed
/// unit (seconds or bytes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

/// The load-latency histogram's snapshot (seconds).
pub type LatencyHistogram = Histogram;

impl Histogram {
    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// `(upper bound, count)` pairs, not cumulative, the last one `+Inf` (what an exposition
    /// encoder takes).
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        self.bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
            .collect()
    }
}

/// One tier's traffic.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierIoStats {
    /// Lookups that consulted this tier.
    pub lookups: u64,
    /// Blocks those lookups reported this tier holds (within the leading run).
    pub lookup_blocks: u64,
    /// Blocks loaded successfully from this tier, and their payload bytes.
    pub blocks_loaded: u64,
    pub bytes_loaded: u64,
    /// Time spent in loads from this tier (per call: fetch and verification).
    pub load_seconds: f64,
    /// Blocks written to this tier, and their payload bytes.
    pub blocks_saved: u64,
    pub bytes_saved: u64,
    /// Time spent writing (Redis: per batch round trip, encoding included).
    pub save_seconds: f64,
    /// Latency of each load call to this tier (one per ticket that used the tier).
    pub load_latency: LatencyHistogram,
    /// Payload bytes of each load call that loaded something from this tier
    /// ([`TRANSFER_SIZE_BUCKETS`]).
    pub load_size: Histogram,
    /// Payload bytes of each save call (host: one block; Redis: one written batch).
    pub save_size: Histogram,
}

/// Failed blocks of loads, by cause (one count per block).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadFailures {
    pub missing: u64,
    pub timeout: u64,
    pub unavailable: u64,
    pub failed: u64,
    pub corrupt: u64,
    pub bad_signature: u64,
    pub foreign_layout: u64,
    pub unsupported_version: u64,
}

impl LoadFailures {
    pub fn total(&self) -> u64 {
        self.missing
            + self.timeout
            + self.unavailable
            + self.failed
            + self.corrupt
            + self.bad_signature
            + self.foreign_layout
            + self.unsupported_version
    }
}

/// A snapshot of [`crate::TierClient`]'s totals.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierStats {
    pub host: TierIoStats,
    pub redis: TierIoStats,
    pub disk: TierIoStats,
    /// Saves refused because the write-behind queue was full.
    pub save_queue_drops: u64,
    /// Saves skipped because they would exceed the instance's Redis byte budget.
    pub save_budget_drops: u64,
    /// Saves that reached the writer but were not stored (Redis down, error, timeout; a disk
    /// write that failed).
    pub save_failures: u64,
    /// Saves skipped because the tier already holds the block (host: in the LRU; Redis: this
    /// client loaded or stored it within half the TTL).
    pub save_dedup_skips: u64,
    /// Host saves refused because one payload exceeds the whole host capacity.
    pub host_too_large: u64,
    /// Blocks the host tier evicted to stay within its bytes.
    pub host_evictions: u64,
    /// Disk saves refused because one value exceeds the whole disk budget.
    pub disk_too_large: u64,
    /// Disk writes that failed (a full disk, an I/O error): the save dropped. Also counted in
    /// `save_failures`.
    pub disk_write_failures: u64,
    /// Block files the disk tier removed to stay within its bytes.
    pub disk_evictions: u64,
    /// Lookups whose Redis part failed (error or timeout) and answered without Redis.
    pub lookup_failures: u64,
    /// Of those, the ones that ran past the timeout.
    pub lookup_timeouts: u64,
    /// Lookups that skipped Redis because it was known to be down.
    pub lookup_skips: u64,
    pub load_failures: LoadFailures,
    /// Time of each [`crate::TierClient::lookup`] call, the caller's wait
    /// ([`LOOKUP_DELAY_BUCKETS`]).
    pub lookup_delay: Histogram,
    /// Times the Redis tier went down (a call failed while it was up).
    pub redis_outages: u64,
    /// Gauges.
    pub host_resident_bytes: u64,
    pub host_resident_blocks: u64,
    /// Bytes and blocks of the disk tier's indexed files.
    pub disk_resident_bytes: u64,
    pub disk_resident_blocks: u64,
    pub redis_up: bool,
    /// Saves waiting in the write-behind queue (not counting the batch being written).
    pub save_queue_len: u64,
    /// Saves accepted and not yet settled: the queue plus the batch being written.
    pub saves_pending: u64,
    /// The warm payload buffers handed to the engine's saves ([`crate::buffers`]).
    pub buffers: crate::buffers::BufferStats,
}

impl TierStats {
    pub fn tier(&self, kind: TierKind) -> &TierIoStats {
        match kind {
            TierKind::Host => &self.host,
            TierKind::Redis => &self.redis,
            TierKind::Disk => &self.disk,
        }
    }
}

/// A histogram of atomics over fixed bounds. Values are kept as integers in `1/scale` units
/// (nanoseconds for durations, bytes for sizes) so the sum is exact and lock-free.
pub(crate) struct Histo {
    bounds: &'static [f64],
    scale: f64,
    buckets: Box<[AtomicU64]>,
    sum: AtomicU64,
    count: AtomicU64,
}

impl Histo {
    pub(crate) fn new(bounds: &'static [f64], scale: f64) -> Self {
        Histo {
            bounds,
            scale,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    fn seconds(bounds: &'static [f64]) -> Self {
        Histo::new(bounds, 1e-9)
    }

    fn bytes() -> Self {
        Histo::new(TRANSFER_SIZE_BUCKETS, 1.0)
    }

    /// One observation of `raw` units (`raw * scale` in the bounds' unit).
    fn observe_raw(&self, raw: u64) {
        let v = raw as f64 * self.scale;
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum.fetch_add(raw, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    pub(crate) fn observe(&self, d: Duration) {
        self.observe_raw(d.as_nanos() as u64);
    }

    pub(crate) fn observe_bytes(&self, n: u64) {
        self.observe_raw(n);
    }

    fn snapshot(&self) -> Histogram {
        Histogram {
            bounds: self.bounds,
            counts: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            sum: self.sum.load(Relaxed) as f64 * self.scale,
            count: self.count.load(Relaxed),
        }
    }
}

pub(crate) struct TierCounters {
    pub lookups: AtomicU64,
    pub lookup_blocks: AtomicU64,
    pub blocks_loaded: AtomicU64,
    pub bytes_loaded: AtomicU64,
    pub load_ns: AtomicU64,
    pub blocks_saved: AtomicU64,
    pub bytes_saved: AtomicU64,
    pub save_ns: AtomicU64,
    pub latency: Histo,
    pub load_size: Histo,
    pub save_size: Histo,
}

impl Default for TierCounters {
    fn default() -> Self {
        TierCounters {
            lookups: AtomicU64::new(0),
            lookup_blocks: AtomicU64::new(0),
            blocks_loaded: AtomicU64::new(0),
            bytes_loaded: AtomicU64::new(0),
            load_ns: AtomicU64::new(0),
            blocks_saved: AtomicU64::new(0),
            bytes_saved: AtomicU64::new(0),
            save_ns: AtomicU64::new(0),
            latency: Histo::seconds(LOAD_LATENCY_BUCKETS),
            load_size: Histo::bytes(),
            save_size: Histo::bytes(),
        }
    }
}

impl TierCounters {
    fn snapshot(&self) -> TierIoStats {
        TierIoStats {
            lookups: self.lookups.load(Relaxed),
            lookup_blocks: self.lookup_blocks.load(Relaxed),
            blocks_loaded: self.blocks_loaded.load(Relaxed),
            bytes_loaded: self.bytes_loaded.load(Relaxed),
            load_seconds: self.load_ns.load(Relaxed) as f64 * 1e-9,
            blocks_saved: self.blocks_saved.load(Relaxed),
            bytes_saved: self.bytes_saved.load(Relaxed),
            save_seconds: self.save_ns.load(Relaxed) as f64 * 1e-9,
            load_latency: self.latency.snapshot(),
            load_size: self.load_size.snapshot(),
            save_size: self.save_size.snapshot(),
        }
    }

    /// One load call that took `d` and brought `bytes` of payload from this tier.
    pub(crate) fn load_call(&self, d: Duration, bytes: u64) {
        self.load_ns.fetch_add(d.as_nanos() as u64, Relaxed);
        self.latency.observe(d);
        if bytes > 0 {
            self.load_size.observe_bytes(bytes);
        }
    }

    /// One save call that took `d` and stored `blocks` blocks of `bytes` payload bytes.
    pub(crate) fn save_call(&self, d: Duration, blocks: u64, bytes: u64) {
        self.blocks_saved.fetch_add(blocks, Relaxed);
        self.bytes_saved.fetch_add(bytes, Relaxed);
        add_ns(&self.save_ns, d);
        if blocks > 0 {
            self.save_size.observe_bytes(bytes);
        }
    }
}

pub(crate) struct Counters {
    pub host: TierCounters,
    pub redis: TierCounters,
    pub disk: TierCounters,
    pub disk_too_large: AtomicU64,
    pub disk_write_failures: AtomicU64,
    pub save_queue_drops: AtomicU64,
    pub save_budget_drops: AtomicU64,
    pub save_failures: AtomicU64,
    pub save_dedup_skips: AtomicU64,
    pub host_too_large: AtomicU64,
    pub lookup_failures: AtomicU64,
    pub lookup_timeouts: AtomicU64,
    pub lookup_skips: AtomicU64,
    pub redis_outages: AtomicU64,
    /// Saves accepted into the queue, and saves the writer has finished with (stored, failed
    /// or over budget): their difference is the queue's length plus the batch in flight
    /// (what [`crate::TierClient::flush`] waits for).
    pub saves_enqueued: AtomicU64,
    pub saves_settled: AtomicU64,
    pub lookup_delay: Histo,
    failures: [AtomicU64; 8],
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            host: TierCounters::default(),
            redis: TierCounters::default(),
            disk: TierCounters::default(),
            disk_too_large: AtomicU64::new(0),
            disk_write_failures: AtomicU64::new(0),
            save_queue_drops: AtomicU64::new(0),
            save_budget_drops: AtomicU64::new(0),
            save_failures: AtomicU64::new(0),
            save_dedup_skips: AtomicU64::new(0),
            host_too_large: AtomicU64::new(0),
            lookup_failures: AtomicU64::new(0),
            lookup_timeouts: AtomicU64::new(0),
            lookup_skips: AtomicU64::new(0),
            redis_outages: AtomicU64::new(0),
            saves_enqueued: AtomicU64::new(0),
            saves_settled: AtomicU64::new(0),
            lookup_delay: Histo::seconds(LOOKUP_DELAY_BUCKETS),
            failures: Default::default(),
        }
    }
}

impl Counters {
    pub(crate) fn load_failure(&self, e: &LoadError) {
        let i = match e {
            LoadError::Missing => 0,
            LoadError::Timeout => 1,
            LoadError::Unavailable => 2,
            LoadError::Failed => 3,
            LoadError::Corrupt(_) => 4,
            LoadError::BadSignature => 5,
            LoadError::ForeignLayout => 6,
            LoadError::UnsupportedVersion(_) => 7,
        };
        self.failures[i].fetch_add(1, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> TierStats {
        let f = |i: usize| self.failures[i].load(Relaxed);
        TierStats {
            host: self.host.snapshot(),
            redis: self.redis.snapshot(),
            disk: self.disk.snapshot(),
            disk_too_large: self.disk_too_large.load(Relaxed),
            disk_write_failures: self.disk_write_failures.load(Relaxed),
            disk_evictions: 0,
            disk_resident_bytes: 0,
            disk_resident_blocks: 0,
            save_queue_drops: self.save_queue_drops.load(Relaxed),
            save_budget_drops: self.save_budget_drops.load(Relaxed),
            save_failures: self.save_failures.load(Relaxed),
            save_dedup_skips: self.save_dedup_skips.load(Relaxed),
            host_too_large: self.host_too_large.load(Relaxed),
            host_evictions: 0,
            lookup_failures: self.lookup_failures.load(Relaxed),
            lookup_timeouts: self.lookup_timeouts.load(Relaxed),
            lookup_skips: self.lookup_skips.load(Relaxed),
            load_failures: LoadFailures {
                missing: f(0),
                timeout: f(1),
                unavailable: f(2),
                failed: f(3),
                corrupt: f(4),
                bad_signature: f(5),
                foreign_layout: f(6),
                unsupported_version: f(7),
            },
            lookup_delay: self.lookup_delay.snapshot(),
            redis_outages: self.redis_outages.load(Relaxed),
            host_resident_bytes: 0,
            host_resident_blocks: 0,
            redis_up: false,
            save_queue_len: 0,
            saves_pending: self
                .saves_enqueued
                .load(Relaxed)
                .saturating_sub(self.saves_settled.load(Relaxed)),
            buffers: Default::default(),
        }
    }
}

pub(crate) fn add_ns(a: &AtomicU64, d: Duration) {
    a.fetch_add(d.as_nanos() as u64, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_upper_inclusive() {
        let h = Histo::seconds(LOAD_LATENCY_BUCKETS);
        h.observe(Duration::from_micros(100)); // == first bound
        h.observe(Duration::from_micros(101)); // second bucket
        h.observe(Duration::from_millis(30)); // (0.025, 0.05]
        h.observe(Duration::from_secs(3)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.counts.len(), LOAD_LATENCY_BUCKETS.len() + 1);
        let mut expect = vec![0u64; 15];
        expect[0] = 1;
        expect[1] = 1;
        expect[8] = 1;
        expect[14] = 1;
        assert_eq!(s.counts, expect);
        assert_eq!(s.count, 4);
        assert!((s.sum - 3.030201).abs() < 1e-9);
        assert_eq!(s.buckets()[14], (f64::INFINITY, 1));
        assert_eq!(s.buckets()[8], (0.05, 1));
    }

    #[test]
    fn size_histogram_counts_bytes_exactly() {
        let h = Histo::bytes();
        h.observe_bytes(1_000_000); // == first bound
        h.observe_bytes(45_711_360); // 124 blocks of 368,640 B: (40e6, 60e6]
        h.observe_bytes(300_000_000); // +Inf
        let s = h.snapshot();
        assert_eq!(s.counts, vec![1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]);
        assert_eq!(s.sum, 346_711_360.0);
        assert_eq!(s.count, 3);
    }
}
