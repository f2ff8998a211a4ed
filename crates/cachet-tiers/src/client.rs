//! [`TierClient`]: the engine's handle on its tiers — the stacked lookup and load (host first,
//! then the disk, then Redis for the rest), saves, and the warm payload buffers. The Redis side
//! lives in [`redis_side`] (connection, health, `EXISTS` / `MGET`, the prober) and
//! [`save_queue`] (the write-behind writer and the byte budget); the disk side in
//! [`disk_side`] (its writer and reader threads over a [`crate::disk::DiskStore`]).

mod disk_side;
mod redis_side;
mod save_queue;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cachet_core::BlockHash;

use crate::buffers::BufferPool;
use crate::config::{HostSave, TierConfig};
use crate::format::{LoadError, TierNamespace};
use crate::health::RateLog;
use crate::host::{HostInsert, HostLru};
use crate::stats::{Counters, TierStats};
use crate::{Payload, TierError};
use disk_side::{finish_missing, open_disk, DiskSide, Then};
use redis_side::{open_redis, redis_load, RedisSide};
use save_queue::SaveItem;

/// Which tier supplied a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TierKind {
    Host,
    Redis,
    Disk,
}

impl TierKind {
    /// `host` / `redis`, for metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Host => "host",
            TierKind::Redis => "redis",
            TierKind::Disk => "disk",
        }
    }
}

/// Where [`TierClient::save`] stores a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveTarget {
    /// The host LRU (for blocks evicted from the local pool). Synchronous: an insert into an
    /// in-memory map, microseconds.
    Host,
    /// Redis, write-behind through the bounded queue (for newly computed blocks).
    Redis,
    /// The disk tier, write-behind through its own bounded queue (newly computed blocks, and
    /// evicted ones it lacks).
    Disk,
}

impl SaveTarget {
    /// The tier this target stores into.
    pub fn kind(self) -> TierKind {
        match self {
            SaveTarget::Host => TierKind::Host,
            SaveTarget::Redis => TierKind::Redis,
            SaveTarget::Disk => TierKind::Disk,
        }
    }
}

/// One finished load: a result per requested hash, in request order.
#[derive(Debug)]
pub struct LoadDone {
    pub ticket: u64,
    pub results: Vec<Result<(Payload, TierKind), LoadError>>,
}

/// The engine's handle on its external KV tiers. Cheap to clone; all clones share the tiers.
///
/// Redis work runs on a small tokio runtime of the client's own (one worker thread,
/// `cachet-tiers`); nothing of it runs on the caller's thread except [`TierClient::lookup`],
/// which waits for its one round trip, bounded by the timeout. The host tier needs no thread.
#[derive(Clone)]
pub struct TierClient {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    host: Option<Arc<Mutex<HostLru>>>,
    host_save: HostSave,
    redis: Option<RedisSide>,
    disk: Option<DiskSide>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.buffers.stop();
    }
}

/// What the caller's thread and the runtime's tasks both reach.
struct Shared {
    ns: TierNamespace,
    stats: Counters,
    done: Mutex<Vec<LoadDone>>,
    notify: OnceLock<Box<dyn Fn() + Send + Sync>>,
    log: RateLog,
    /// Warm buffers for the engine's saves: recycled from the host LRU's evictions and the
    /// Redis writer's encoded saves, topped up by a background thread.
    buffers: Arc<BufferPool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Shared {
    fn finish(&self, done: LoadDone) {
        lock(&self.done).push(done);
        if let Some(f) = self.notify.get() {
            f();
        }
    }
}

/// The scheduler's view: how many leading blocks the tiers hold.
impl cachet_core::tier::KvLookup for TierClient {
    fn lookup(&mut self, hashes: &[BlockHash]) -> usize {
        TierClient::lookup(self, hashes).len()
    }
}

impl TierClient {
    /// Opens the configured tiers. Redis being unreachable is not an error: the client starts
    /// with it down (lookups answer without it) and connects when it appears. Errors are
    /// configuration errors and a failure to start the runtime thread.
    pub fn open(cfg: TierConfig) -> Result<Self, TierError> {
        Self::open_with(cfg, true)
    }

    /// [`TierClient::open`]; `prefault: false` leaves the buffer pool without its background
    /// filler (only recycled buffers are warm), for tests that count buffers exactly.
    pub(crate) fn open_with(cfg: TierConfig, prefault: bool) -> Result<Self, TierError> {
        cfg.validate()?;
        let shared = Arc::new(Shared {
            ns: cfg.namespace.clone(),
            stats: Counters::default(),
            done: Mutex::new(Vec::new()),
            notify: OnceLock::new(),
            log: RateLog::new(Duration::from_secs(60)),
            buffers: Arc::new(BufferPool::new(cfg.spare_bytes)),
        });
        if prefault {
            shared.buffers.start_filler().map_err(TierError::Runtime)?;
        }
        let host = cfg
            .host
            .as_ref()
            .map(|h| Arc::new(Mutex::new(HostLru::new(h.capacity_bytes))));
        let host_save = cfg.host.as_ref().map_or(HostSave::Evicted, |h| h.save);
        let disk = match &cfg.disk {
            Some(dc) => Some(open_disk(dc, shared.clone())?),
            None => None,
        };
        let redis = match cfg.redis {
            Some(rc) => Some(open_redis(rc, shared.clone())?),
            None => None,
        };
        Ok(TierClient {
            inner: Arc::new(Inner {
                shared,
                host,
                host_save,
                redis,
                disk,
            }),
        })
    }

    /// Calls `f` (from a tier thread) whenever a load finishes, so an engine that sleeps while
    /// requests wait for loads can wake up and [`TierClient::poll`]. Set once; later calls are
    /// ignored.
    pub fn set_load_notify(&self, f: impl Fn() + Send + Sync + 'static) {
        let _ = self.inner.shared.notify.set(Box::new(f));
    }

    /// Whether a tier of this kind is configured.
    pub fn has(&self, kind: TierKind) -> bool {
        match kind {
            TierKind::Host => self.inner.host.is_some(),
            TierKind::Redis => self.inner.redis.is_some(),
            TierKind::Disk => self.inner.disk.is_some(),
        }
    }

    /// Whether the disk tier wants the local pool's cached blocks written at shutdown
    /// (`--kv-tier-disk-save-on-shutdown`).
    pub fn disk_saves_on_shutdown(&self) -> bool {
        self.inner.disk.as_ref().is_some_and(|d| d.save_on_shutdown)
    }

    /// The disk tier's directory (`--kv-tier-disk-path`), when there is a disk tier.
    pub fn disk_dir(&self) -> Option<&std::path::Path> {
        self.inner.disk.as_ref().map(|d| d.store.dir())
    }

    /// The sessions the disk tier kept from the last process (none without a disk tier).
    pub fn saved_sessions(&self) -> Vec<cachet_core::sessions::SessionRecord> {
        match &self.inner.disk {
            Some(d) => crate::disk_sessions::read(d.store.dir(), d.store.namespace()),
            None => Vec::new(),
        }
    }

    /// Keeps `records` in the disk tier's directory for the next start (no-op without one).
    pub fn save_sessions(&self, records: Vec<cachet_core::sessions::SessionRecord>) {
        if let Some(d) = &self.inner.disk {
            let n = records.len();
            match crate::disk_sessions::write(d.store.dir(), d.store.namespace(), records) {
                Ok(()) => tracing::info!(sessions = n, "parked sessions kept on disk"),
                Err(e) => tracing::warn!(error = %e, "cannot keep the parked sessions on disk"),
            }
        }
    }

    /// Test hook: make every following disk write fail as a full disk would (`true`), or stop.
    /// No-op without a disk tier.
    pub fn inject_disk_write_failure(&self, on: bool) {
        if let Some(d) = &self.inner.disk {
            d.store.inject_write_failure(on);
        }
    }

    /// When blocks enter the host tier (meaningful only with one).
    pub fn host_save(&self) -> HostSave {
        self.inner.host_save
    }

    /// The namespace every key and value carries.
    pub fn namespace(&self) -> &TierNamespace {
        &self.inner.shared.ns
    }

    /// Whether Redis is configured and currently considered up.
    pub fn redis_up(&self) -> bool {
        self.inner
            .redis
            .as_ref()
            .is_some_and(|r| r.r.health.is_up())
    }

    /// The leading run of `hashes` (consecutive blocks of one prompt) that the tiers hold, and
    /// which tier holds each: host first, then the disk's index, then Redis for the rest.
    /// Redis is asked in one round trip bounded by the timeout; when it fails, times out or is
    /// down, the answer is what the host and disk tiers hold, the failure is counted, and an
    /// outage is logged once. Host and disk blocks found become most recently used.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<TierKind> {
        if hashes.is_empty() {
            return Vec::new();
        }
        let t0 = Instant::now();
        let stats = &self.inner.shared.stats;
        let in_host: Vec<bool> = match &self.inner.host {
            Some(h) => {
                let h = lock(h);
                hashes.iter().map(|x| h.contains(x)).collect()
            }
            None => vec![false; hashes.len()],
        };
        let in_disk: Vec<bool> = match &self.inner.disk {
            Some(d) => hashes
                .iter()
                .zip(&in_host)
                .map(|(x, h)| !h && d.store.contains(x))
                .collect(),
            None => vec![false; hashes.len()],
        };
        let held: Vec<bool> = in_host.iter().zip(&in_disk).map(|(a, b)| a | b).collect();
        let mut in_redis = vec![false; hashes.len()];
        if let Some(r) = &self.inner.redis {
            if held.iter().any(|b| !b) {
                r.lookup(hashes, &held, &mut in_redis);
            }
        }
        let mut run = Vec::new();
        for i in 0..hashes.len() {
            if in_host[i] {
                run.push(TierKind::Host);
            } else if in_disk[i] {
                run.push(TierKind::Disk);
            } else if in_redis[i] {
                run.push(TierKind::Redis);
            } else {
                break;
            }
        }
        if let Some(h) = &self.inner.host {
            let mut h = lock(h);
            for (x, k) in hashes.iter().zip(&run) {
                if *k == TierKind::Host {
                    h.touch(x);
                }
            }
            stats.host.lookups.fetch_add(1, Relaxed);
            let n = run.iter().filter(|k| **k == TierKind::Host).count();
            stats.host.lookup_blocks.fetch_add(n as u64, Relaxed);
        }
        if let Some(d) = &self.inner.disk {
            for (x, k) in hashes.iter().zip(&run) {
                if *k == TierKind::Disk {
                    d.store.touch(x);
                }
            }
            stats.disk.lookups.fetch_add(1, Relaxed);
            let n = run.iter().filter(|k| **k == TierKind::Disk).count();
            stats.disk.lookup_blocks.fetch_add(n as u64, Relaxed);
        }
        if self.inner.redis.is_some() {
            let n = run.iter().filter(|k| **k == TierKind::Redis).count();
            stats.redis.lookup_blocks.fetch_add(n as u64, Relaxed);
        }
        stats.lookup_delay.observe(t0.elapsed());
        run
    }

    /// Starts loading `hashes`: what the host tier holds is taken now (they cannot be evicted
    /// from under the load afterwards); what the disk holds is read on the disk's reader
    /// thread; the rest come from Redis in one `MGET`. The ticket's [`LoadDone`] is returned
    /// by a later [`TierClient::poll`].
    pub fn start_load(&self, ticket: u64, hashes: Vec<BlockHash>) {
        let shared = &self.inner.shared;
        let t0 = Instant::now();
        let mut results: Vec<Option<Result<(Payload, TierKind), LoadError>>> =
            (0..hashes.len()).map(|_| None).collect();
        if let Some(h) = &self.inner.host {
            let mut h = lock(h);
            let (mut n, mut bytes) = (0u64, 0u64);
            for (x, slot) in hashes.iter().zip(results.iter_mut()) {
                if let Some(p) = h.get(x) {
                    n += 1;
                    bytes += p.len() as u64;
                    *slot = Some(Ok((p, TierKind::Host)));
                }
            }
            drop(h);
            if n > 0 {
                let s = &shared.stats.host;
                s.blocks_loaded.fetch_add(n, Relaxed);
                s.bytes_loaded.fetch_add(bytes, Relaxed);
                s.load_call(t0.elapsed(), bytes);
            }
        }
        let then = self.after_disk();
        match &self.inner.disk {
            Some(d)
                if hashes
                    .iter()
                    .zip(&results)
                    .any(|(x, r)| r.is_none() && d.store.contains(x)) =>
            {
                d.load(shared.clone(), ticket, hashes, results, then);
            }
            _ => then(shared.clone(), ticket, hashes, results),
        }
    }

    /// What a load does with the slots the host and disk tiers left open: ask Redis, or settle
    /// them as missing.
    fn after_disk(&self) -> Then {
        let Some(r) = &self.inner.redis else {
            return Box::new(finish_missing);
        };
        let (rs, handle) = (r.r.clone(), r.handle.clone());
        Box::new(move |shared, ticket, hashes, results| {
            let rest: Vec<usize> = (0..hashes.len())
                .filter(|i| results[*i].is_none())
                .collect();
            if rest.is_empty() {
                finish_load(&shared, ticket, results, LoadError::Missing);
            } else if !rs.health.is_up() {
                finish_load(&shared, ticket, results, LoadError::Unavailable);
            } else {
                handle.spawn(async move {
                    redis_load(rs, ticket, hashes, rest, results).await;
                });
            }
        })
    }

    /// Loads finished since the last call.
    pub fn poll(&self) -> Vec<LoadDone> {
        std::mem::take(&mut *lock(&self.inner.shared.done))
    }

    /// Saves a block. `Host`: inserted now. `Redis`: queued for the write-behind writer;
    /// `false` (and a counted drop) when the queue is full — the caller never waits. A block
    /// this client loaded from or stored in Redis within half the TTL is not sent again
    /// (`save_dedup_skips`; returns `true`). Also
    /// `false`, uncounted, when that tier is not configured, and for a host block larger than
    /// the whole host capacity (counted as `host_too_large`).
    pub fn save(&self, hash: BlockHash, payload: Payload, target: SaveTarget) -> bool {
        let stats = &self.inner.shared.stats;
        match target {
            SaveTarget::Host => {
                let Some(h) = &self.inner.host else {
                    return false;
                };
                let t0 = Instant::now();
                let len = payload.len() as u64;
                let mut dropped = Vec::new();
                let out = lock(h).insert_reclaim(hash, payload, &mut dropped);
                // Outside the LRU's lock: evicted payloads' buffers serve the next saves.
                self.inner.shared.buffers.give_all(dropped);
                match out {
                    HostInsert::Stored { .. } => {
                        stats.host.save_call(t0.elapsed(), 1, len);
                        true
                    }
                    HostInsert::TooLarge => {
                        stats.host_too_large.fetch_add(1, Relaxed);
                        false
                    }
                }
            }
            SaveTarget::Redis => {
                let Some(r) = &self.inner.redis else {
                    return false;
                };
                if r.r.recently_present(&hash) {
                    stats.save_dedup_skips.fetch_add(1, Relaxed);
                    return true;
                }
                // Count before sending: the writer may settle it before try_send returns.
                stats.saves_enqueued.fetch_add(1, Relaxed);
                match r.save_tx.try_send(SaveItem { hash, payload }) {
                    Ok(()) => true,
                    Err(_) => {
                        stats.saves_enqueued.fetch_sub(1, Relaxed);
                        stats.save_queue_drops.fetch_add(1, Relaxed);
                        false
                    }
                }
            }
            SaveTarget::Disk => match &self.inner.disk {
                Some(d) => d.save(&self.inner.shared, hash, payload),
                None => false,
            },
        }
    }

    /// A disk save that waits (until `deadline`) for room in the queue instead of dropping:
    /// for the shutdown's saves, never the step's. `false` (counted as a queue drop) past the
    /// deadline or without a disk tier.
    pub fn save_disk_until(&self, hash: BlockHash, payload: Payload, deadline: Instant) -> bool {
        let Some(d) = &self.inner.disk else {
            return false;
        };
        let stats = &self.inner.shared.stats;
        let mut item = disk_side::DiskSave { hash, payload };
        stats.saves_enqueued.fetch_add(1, Relaxed);
        loop {
            match d.save_tx.try_send(item) {
                Ok(()) => return true,
                Err(std::sync::mpsc::TrySendError::Full(it)) if Instant::now() < deadline => {
                    item = it;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => {
                    stats.saves_enqueued.fetch_sub(1, Relaxed);
                    stats.save_queue_drops.fetch_add(1, Relaxed);
                    return false;
                }
            }
        }
    }

    /// Whether a save of `hash` to `target` would be redundant, asked before the payload is
    /// made (the engine then skips copying the block out): the host tier already holds it
    /// (it becomes most recently used, as a save would make it), or Redis is known to hold it
    /// (this client loaded or stored it within half the TTL). A skip is counted in
    /// `save_dedup_skips`. `false` for a tier that is not configured.
    pub fn skip_save(&self, hash: &BlockHash, target: SaveTarget) -> bool {
        let skip = match target {
            SaveTarget::Host => self
                .inner
                .host
                .as_ref()
                .is_some_and(|h| lock(h).touch(hash)),
            SaveTarget::Redis => self
                .inner
                .redis
                .as_ref()
                .is_some_and(|r| r.r.recently_present(hash)),
            SaveTarget::Disk => self
                .inner
                .disk
                .as_ref()
                .is_some_and(|d| d.store.touch(hash)),
        };
        if skip {
            self.inner
                .shared
                .stats
                .save_dedup_skips
                .fetch_add(1, Relaxed);
        }
        skip
    }

    /// An empty buffer for one block's payload (capacity `len`), to copy a block into before
    /// [`TierClient::save`]: a warm one (recycled or pre-touched) when the pool has one, so the
    /// copy does not page-fault on the caller's thread; otherwise a fresh allocation.
    pub fn take_buffer(&self, len: usize) -> Vec<u8> {
        self.inner.shared.buffers.take(len)
    }

    /// Waits until every save accepted so far has been stored or given up on, or `timeout`
    /// passed; returns whether the queue drained. For shutdown and tests; never needed on the
    /// engine's step path.
    pub fn flush(&self, timeout: Duration) -> bool {
        let s = &self.inner.shared.stats;
        let deadline = Instant::now() + timeout;
        loop {
            if s.saves_settled.load(Relaxed) >= s.saves_enqueued.load(Relaxed) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Monotonic totals and current gauges.
    pub fn stats(&self) -> TierStats {
        let mut s = self.inner.shared.stats.snapshot();
        s.buffers = self.inner.shared.buffers.stats();
        if let Some(h) = &self.inner.host {
            let h = lock(h);
            s.host_resident_bytes = h.bytes();
            s.host_resident_blocks = h.len() as u64;
            s.host_evictions = h.evictions();
        }
        if let Some(r) = &self.inner.redis {
            s.redis_up = r.r.health.is_up();
            s.save_queue_len = (r.save_tx.max_capacity() - r.save_tx.capacity()) as u64;
        }
        if let Some(d) = &self.inner.disk {
            let (blocks, bytes, evictions) = d.store.usage();
            s.disk_resident_blocks = blocks;
            s.disk_resident_bytes = bytes;
            s.disk_evictions = evictions;
        }
        s
    }
}

/// Fills every unresolved slot with `err`, counts the failures and delivers the ticket.
fn finish_load(
    shared: &Shared,
    ticket: u64,
    results: Vec<Option<Result<(Payload, TierKind), LoadError>>>,
    err: LoadError,
) {
    let results = results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                shared.stats.load_failure(&err);
                Err(err)
            })
        })
        .collect();
    shared.finish(LoadDone { ticket, results });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HostConfig, HostSave, RedisConfig};

    fn ns() -> TierNamespace {
        TierNamespace {
            model_fingerprint: [1; 32],
            kv_layout: "f16:L1:H1:D8".into(),
            block_size: 16,
        }
    }

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn host_client(cap: u64) -> TierClient {
        TierClient::open(TierConfig {
            disk: None,
            namespace: ns(),
            spare_bytes: crate::DEFAULT_SPARE_BYTES,
            host: Some(HostConfig {
                capacity_bytes: cap,
                save: HostSave::Evicted,
            }),
            redis: None,
        })
        .unwrap()
    }

    #[test]
    fn host_tier_lookup_load_and_save() {
        let c = host_client(1000);
        assert!(c.has(TierKind::Host) && !c.has(TierKind::Redis));
        for i in 1..=3 {
            assert!(c.save(h(i), Payload::from(vec![i; 300]), SaveTarget::Host));
        }
        // Not configured: refused, not counted as a drop.
        assert!(!c.save(h(9), Payload::from(vec![0; 10]), SaveTarget::Redis));
        // Leading run only: 1, 2 held, 7 not, so 3 after it does not count.
        assert_eq!(c.lookup(&[h(1), h(2), h(7), h(3)]), vec![TierKind::Host; 2]);
        assert_eq!(c.lookup(&[h(7), h(1)]), vec![]);

        c.start_load(42, vec![h(2), h(7), h(1)]);
        let done = c.poll();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].ticket, 42);
        let r = &done[0].results;
        assert_eq!(r.len(), 3);
        let (p, k) = r[0].as_ref().unwrap();
        assert_eq!((p.len(), p[0], *k), (300, 2, TierKind::Host));
        assert_eq!(r[1].as_ref().unwrap_err(), &LoadError::Missing);
        assert_eq!(r[2].as_ref().unwrap().0[0], 1);
        assert!(c.poll().is_empty());

        let s = c.stats();
        assert_eq!(s.host.blocks_saved, 3);
        assert_eq!(s.host.bytes_saved, 900);
        assert_eq!(s.host.blocks_loaded, 2);
        assert_eq!(s.host.bytes_loaded, 600);
        assert_eq!(s.host.lookups, 2);
        assert_eq!(s.host.lookup_blocks, 2);
        assert_eq!(s.load_failures.missing, 1);
        assert_eq!(s.load_failures.total(), 1);
        assert_eq!(s.host.load_latency.count, 1);
        assert_eq!(s.host_resident_bytes, 900);
        assert_eq!(s.save_queue_drops, 0);

        // A fourth block evicts the least recently used: 3 (1 and 2 were loaded since).
        assert!(c.save(h(4), Payload::from(vec![4; 300]), SaveTarget::Host));
        assert_eq!(c.lookup(&[h(3)]), vec![]);
        assert_eq!(c.lookup(&[h(1), h(2), h(4)]).len(), 3);
        assert_eq!(c.stats().host_evictions, 1);
        assert!(!c.save(h(5), Payload::from(vec![5; 1001]), SaveTarget::Host));
        assert_eq!(c.stats().host_too_large, 1);
    }

    #[test]
    fn evicted_host_payloads_become_the_next_saves_buffers() {
        let c = TierClient::open_with(
            TierConfig {
                disk: None,
                namespace: ns(),
                host: Some(HostConfig {
                    capacity_bytes: 2000,
                    save: HostSave::Evicted,
                }),
                redis: None,
                spare_bytes: 2000,
            },
            false,
        )
        .unwrap();
        let save = |i: u8| {
            let mut b = c.take_buffer(1000);
            assert_eq!((b.len(), b.capacity()), (0, 1000));
            b.resize(1000, i);
            let at = b.as_ptr();
            assert!(c.save(h(i), Payload::from(b), SaveTarget::Host));
            at
        };
        let first = save(1);
        save(2);
        // 3 evicts 1 (least recently used), the only holder of its bytes: recycled.
        save(3);
        let s = c.stats().buffers;
        assert_eq!((s.fresh, s.warm, s.recycled), (3, 0, 1));
        // 4 is copied into block 1's old buffer, and evicts 2 (recycled).
        assert_eq!(save(4), first, "block 1's buffer again");
        // Order now 3, 4. A load of 3 makes it most recent and holds a clone of its bytes.
        c.start_load(7, vec![h(3)]);
        let held = c.poll().pop().unwrap().results.pop().unwrap().unwrap().0;
        // 5 (in 2's old buffer) evicts 4: recycled. 6 (in 4's) evicts 3, which the load still
        // holds: dropped, not recycled (and not copied either).
        save(5);
        save(6);
        let s = c.stats().buffers;
        assert_eq!((s.fresh, s.warm, s.recycled, s.pretouched), (3, 3, 3, 0));
        assert_eq!(c.inner.shared.buffers.free_buffers(), 0);
        assert_eq!(c.stats().host_evictions, 4);
        assert_eq!(held[0], 3);
    }

    #[test]
    fn the_redis_writer_gives_its_payloads_back() {
        // Redis down (nothing listens on the port): the writer settles each save as a failure
        // and hands its payload back, so the next save reuses the buffer.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let c = TierClient::open_with(
            TierConfig {
                disk: None,
                namespace: ns(),
                host: None,
                redis: Some(RedisConfig {
                    target: crate::RedisTarget::Single(format!("redis://127.0.0.1:{port}")),
                    secret: None,
                    ttl: None,
                    budget_bytes: None,
                    timeout: Duration::from_millis(200),
                    save_queue: 8,
                    probe_interval: Duration::from_secs(60),
                    key_prefix: "t".into(),
                    ca_cert_pem: None,
                }),
                spare_bytes: 4 * 500,
            },
            false,
        )
        .unwrap();
        assert!(!c.redis_up());
        let mut addrs = Vec::new();
        for i in 1..=2u8 {
            let mut b = c.take_buffer(500);
            b.resize(500, i);
            addrs.push(b.as_ptr());
            assert!(c.save(h(i), Payload::from(b), SaveTarget::Redis));
        }
        assert!(c.flush(Duration::from_secs(10)));
        let s = c.stats();
        assert_eq!(s.save_failures, 2);
        // The second take may already find the first payload given back (the writer runs on
        // its own thread): two takes, fresh or warm, and both payloads recycled.
        assert_eq!(s.buffers.fresh + s.buffers.warm, 2);
        assert_eq!(s.buffers.recycled, 2);
        let warm_before = s.buffers.warm;
        let again = c.take_buffer(500);
        assert!(
            addrs.contains(&again.as_ptr()),
            "a buffer the writer gave back"
        );
        assert_eq!(c.stats().buffers.warm, warm_before + 1);
    }

    fn disk_client(dir: &std::path::Path, host: bool) -> TierClient {
        TierClient::open_with(
            TierConfig {
                namespace: ns(),
                spare_bytes: 0,
                host: host.then_some(HostConfig {
                    capacity_bytes: 1000,
                    save: HostSave::Evicted,
                }),
                redis: None,
                disk: Some(crate::DiskConfig {
                    dir: dir.to_path_buf(),
                    capacity_bytes: 1 << 20,
                    secret: None,
                    save_queue: 4,
                    save_on_shutdown: false,
                }),
            },
            false,
        )
        .unwrap()
    }

    fn wait_load(c: &TierClient) -> LoadDone {
        let t0 = Instant::now();
        loop {
            if let Some(d) = c.poll().pop() {
                return d;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no load came back");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// host,disk: the host answers first, the disk the rest (on its reader thread), and a new
    /// client on the same directory (a restart) finds what the first one wrote.
    #[test]
    fn disk_blocks_stack_behind_the_host_and_survive_a_new_client() {
        let t = tempfile::tempdir().unwrap();
        let c = disk_client(t.path(), true);
        assert!(c.has(TierKind::Disk) && c.has(TierKind::Host));
        for i in 1..=3 {
            assert!(c.save(h(i), Payload::from(vec![i; 300]), SaveTarget::Disk));
        }
        assert!(c.flush(Duration::from_secs(10)));
        assert!(
            c.skip_save(&h(1), SaveTarget::Disk),
            "held: not copied again"
        );
        assert!(c.save(h(2), Payload::from(vec![2; 300]), SaveTarget::Host));
        assert_eq!(
            c.lookup(&[h(1), h(2), h(3), h(4)]),
            vec![TierKind::Disk, TierKind::Host, TierKind::Disk]
        );
        c.start_load(9, vec![h(1), h(2), h(3), h(4)]);
        let done = wait_load(&c);
        assert_eq!(done.ticket, 9);
        let kinds: Vec<_> = done
            .results
            .iter()
            .map(|r| r.as_ref().map(|(p, k)| (p[0], p.len(), *k)))
            .collect();
        assert_eq!(
            kinds,
            vec![
                Ok((1, 300, TierKind::Disk)),
                Ok((2, 300, TierKind::Host)),
                Ok((3, 300, TierKind::Disk)),
                Err(&LoadError::Missing)
            ]
        );
        let s = c.stats();
        assert_eq!((s.disk.blocks_saved, s.disk.bytes_saved), (3, 900));
        assert_eq!((s.disk.blocks_loaded, s.disk.bytes_loaded), (2, 600));
        assert_eq!((s.disk.lookups, s.disk.lookup_blocks), (1, 2));
        assert_eq!(s.disk.load_latency.count, 1);
        // 3 files of 78 + 12 + 8 + 300 + 32 bytes.
        assert_eq!(
            (s.disk_resident_blocks, s.disk_resident_bytes),
            (3, 3 * 430)
        );
        assert_eq!(s.load_failures.total(), 1);
        drop(c);

        let c = disk_client(t.path(), false);
        assert_eq!(c.lookup(&[h(1), h(2), h(3)]), vec![TierKind::Disk; 3]);
        c.inject_disk_write_failure(true);
        assert!(c.save(h(5), Payload::from(vec![5; 300]), SaveTarget::Disk));
        assert!(c.flush(Duration::from_secs(10)));
        let s = c.stats();
        assert_eq!((s.disk_write_failures, s.save_failures), (1, 1));
        assert_eq!(s.disk_resident_blocks, 3);
    }

    #[test]
    fn load_notify_fires_per_finished_load() {
        let c = host_client(1000);
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let n2 = n.clone();
        c.set_load_notify(move || {
            n2.fetch_add(1, Relaxed);
        });
        c.start_load(1, vec![h(1)]);
        c.start_load(2, vec![]);
        assert_eq!(n.load(Relaxed), 2);
        let done = c.poll();
        assert_eq!(
            done.iter().map(|d| d.ticket).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(done[1].results.is_empty());
    }
}
