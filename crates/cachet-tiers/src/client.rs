//! [`TierClient`]: the engine's handle on its tiers.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cachet_core::BlockHash;
use tokio::sync::mpsc;

use crate::config::{RedisConfig, TierConfig};
use crate::format::{decode_value, encode_value, value_overhead, LoadError, TierNamespace};
use crate::health::{Health, RateLog};
use crate::host::{HostInsert, HostLru};
use crate::redis_conn::{self, is_outage, Conn};
use crate::stats::{Counters, TierStats};
use crate::{Payload, TierError};

/// Which tier supplied a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TierKind {
    Host,
    Redis,
}

impl TierKind {
    /// `host` / `redis`, for metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Host => "host",
            TierKind::Redis => "redis",
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
    redis: Option<RedisSide>,
}

/// What the caller's thread and the runtime's tasks both reach.
struct Shared {
    ns: TierNamespace,
    stats: Counters,
    done: Mutex<Vec<LoadDone>>,
    notify: OnceLock<Box<dyn Fn() + Send + Sync>>,
    log: RateLog,
}

struct RedisSide {
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    r: Arc<RedisShared>,
    save_tx: mpsc::Sender<SaveItem>,
}

impl Drop for RedisSide {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            // Never blocks, so dropping the last client is fine on any thread, async or not.
            rt.shutdown_background();
        }
    }
}

struct RedisShared {
    cfg: RedisConfig,
    conn: RwLock<Option<Conn>>,
    health: Health,
    shared: Arc<Shared>,
    /// Blocks this client recently loaded from or stored in Redis, with when: a save of one of
    /// them is skipped (the engine saves every new cache entry, loaded ones included, and
    /// re-sending 368 KB that Redis already holds is pure waste).
    present: Mutex<lru::LruCache<BlockHash, Instant>>,
}

/// How many recently present blocks [`RedisShared::present`] remembers (about 3 MB).
const PRESENT_CAPACITY: usize = 1 << 16;

struct SaveItem {
    hash: BlockHash,
    payload: Payload,
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

impl RedisShared {
    fn conn(&self) -> Option<Conn> {
        match self.conn.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn set_conn(&self, c: Option<Conn>) {
        match self.conn.write() {
            Ok(mut g) => *g = c,
            Err(p) => *p.into_inner() = c,
        }
    }

    /// Records a failed call: an outage (or timeout) takes the tier down, logged once.
    fn call_failed(&self, e: CallError) {
        match e {
            CallError::Timeout => self.went_down("a call ran past the timeout"),
            CallError::Redis(e) if is_outage(&e) => self.went_down(&e.to_string()),
            CallError::Redis(e) => {
                self.shared.log.warn("Redis error reply", &e);
            }
            CallError::Down => {}
        }
    }

    fn went_down(&self, why: &str) {
        if self.health.mark_down(why) {
            self.shared.stats.redis_outages.fetch_add(1, Relaxed);
        }
        // A restarted server or a failed-over master may have lost what we remember.
        lock(&self.present).clear();
    }

    /// A stored block is trusted to still be there for half its TTL (ten minutes without one).
    fn fresh_for(&self) -> Duration {
        self.cfg.ttl.map_or(Duration::from_secs(600), |t| t / 2)
    }

    fn mark_present(&self, hashes: impl IntoIterator<Item = BlockHash>) {
        let now = Instant::now();
        let mut p = lock(&self.present);
        for h in hashes {
            p.put(h, now);
        }
    }

    fn recently_present(&self, hash: &BlockHash) -> bool {
        let fresh = self.fresh_for();
        lock(&self.present)
            .peek(hash)
            .is_some_and(|at| at.elapsed() < fresh)
    }

    fn key(&self, hash: &BlockHash) -> Vec<u8> {
        self.shared.ns.redis_key(&self.cfg.key_prefix, hash)
    }

    /// Runs `f` on the current connection, bounded by the timeout.
    async fn call<T, F, Fut>(&self, f: F) -> Result<T, CallError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        if !self.health.is_up() {
            return Err(CallError::Down);
        }
        let Some(conn) = self.conn() else {
            return Err(CallError::Down);
        };
        match tokio::time::timeout(self.cfg.timeout, f(conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(CallError::Redis(e)),
            Err(_) => Err(CallError::Timeout),
        }
    }
}

enum CallError {
    /// Known down; no call made.
    Down,
    Timeout,
    Redis(redis::RedisError),
}

impl CallError {
    fn load_error(&self) -> LoadError {
        match self {
            CallError::Down => LoadError::Unavailable,
            CallError::Timeout => LoadError::Timeout,
            CallError::Redis(e) if is_outage(e) => LoadError::Unavailable,
            CallError::Redis(_) => LoadError::Failed,
        }
    }
}

/// The scheduler's view: how many leading blocks the tiers hold.
impl cachet_core::connector::KvLookup for TierClient {
    fn lookup(&mut self, hashes: &[BlockHash]) -> usize {
        TierClient::lookup(self, hashes).len()
    }
}

impl TierClient {
    /// Opens the configured tiers. Redis being unreachable is not an error: the client starts
    /// with it down (lookups answer without it) and connects when it appears. Errors are
    /// configuration errors and a failure to start the runtime thread.
    pub fn open(cfg: TierConfig) -> Result<Self, TierError> {
        cfg.validate()?;
        let shared = Arc::new(Shared {
            ns: cfg.namespace.clone(),
            stats: Counters::default(),
            done: Mutex::new(Vec::new()),
            notify: OnceLock::new(),
            log: RateLog::new(Duration::from_secs(60)),
        });
        let host = cfg
            .host
            .as_ref()
            .map(|h| Arc::new(Mutex::new(HostLru::new(h.capacity_bytes))));
        let redis = match cfg.redis {
            Some(rc) => Some(open_redis(rc, shared.clone())?),
            None => None,
        };
        Ok(TierClient {
            inner: Arc::new(Inner {
                shared,
                host,
                redis,
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
        }
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
    /// which tier holds each: host first, then Redis for the rest. Redis is asked in one round
    /// trip bounded by the timeout; when it fails, times out or is down, the answer is what
    /// the host tier holds (0 blocks without one), the failure is counted, and an outage is
    /// logged once. Host blocks found become most recently used.
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
        let mut in_redis = vec![false; hashes.len()];
        if let Some(r) = &self.inner.redis {
            if in_host.iter().any(|b| !b) {
                self.redis_lookup(r, hashes, &in_host, &mut in_redis);
            }
        }
        let mut run = Vec::new();
        for i in 0..hashes.len() {
            if in_host[i] {
                run.push(TierKind::Host);
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
        if self.inner.redis.is_some() {
            let n = run.iter().filter(|k| **k == TierKind::Redis).count();
            stats.redis.lookup_blocks.fetch_add(n as u64, Relaxed);
        }
        stats.lookup_delay.observe(t0.elapsed());
        run
    }

    fn redis_lookup(
        &self,
        r: &RedisSide,
        hashes: &[BlockHash],
        in_host: &[bool],
        in_redis: &mut [bool],
    ) {
        let stats = &self.inner.shared.stats;
        if !r.r.health.is_up() {
            stats.lookup_skips.fetch_add(1, Relaxed);
            return;
        }
        stats.redis.lookups.fetch_add(1, Relaxed);
        let idx: Vec<usize> = (0..hashes.len()).filter(|i| !in_host[*i]).collect();
        let keys: Vec<Vec<u8>> = idx.iter().map(|i| r.r.key(&hashes[*i])).collect();
        let rs = r.r.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        r.handle.spawn(async move {
            let res = rs.call(|mut c| async move { c.exists(&keys).await }).await;
            let _ = tx.send(res);
        });
        // The task bounds itself by the timeout; the margin covers a busy runtime.
        let res = rx
            .recv_timeout(r.r.cfg.timeout + Duration::from_millis(50))
            .unwrap_or(Err(CallError::Timeout));
        match res {
            Ok(found) => {
                for (i, f) in idx.into_iter().zip(found) {
                    in_redis[i] = f;
                }
            }
            Err(e) => {
                if !matches!(e, CallError::Down) {
                    stats.lookup_failures.fetch_add(1, Relaxed);
                }
                if matches!(e, CallError::Timeout) {
                    stats.lookup_timeouts.fetch_add(1, Relaxed);
                }
                r.r.call_failed(e);
            }
        }
    }

    /// Starts loading `hashes`; never blocks. Blocks the host tier holds are taken at once
    /// (they cannot be evicted from under the load afterwards); the rest come from Redis in
    /// one `MGET`. The ticket's [`LoadDone`] is returned by a later [`TierClient::poll`].
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
        let rest: Vec<usize> = (0..hashes.len())
            .filter(|i| results[*i].is_none())
            .collect();
        let Some(r) = self.inner.redis.as_ref().filter(|_| !rest.is_empty()) else {
            finish_load(shared, ticket, results, LoadError::Missing);
            return;
        };
        if !r.r.health.is_up() {
            finish_load(shared, ticket, results, LoadError::Unavailable);
            return;
        }
        let rs = r.r.clone();
        r.handle.spawn(async move {
            redis_load(rs, ticket, hashes, rest, results).await;
        });
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
                let out = lock(h).insert(hash, payload);
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

async fn redis_load(
    rs: Arc<RedisShared>,
    ticket: u64,
    hashes: Vec<BlockHash>,
    rest: Vec<usize>,
    mut results: Vec<Option<Result<(Payload, TierKind), LoadError>>>,
) {
    let shared = rs.shared.clone();
    let t0 = Instant::now();
    let keys: Vec<Vec<u8>> = rest.iter().map(|i| rs.key(&hashes[*i])).collect();
    let got = rs.call(|mut c| async move { c.mget(&keys).await }).await;
    let values = match got {
        Ok(v) => v,
        Err(e) => {
            let err = e.load_error();
            rs.call_failed(e);
            finish_load(&shared, ticket, results, err);
            return;
        }
    };
    let secret = rs.cfg.secret.as_ref();
    let (mut n, mut bytes) = (0u64, 0u64);
    let mut loaded = Vec::new();
    for (i, v) in rest.into_iter().zip(values) {
        let r = match v {
            None => {
                lock(&rs.present).pop(&hashes[i]);
                Err(LoadError::Missing)
            }
            Some(v) => decode_value(&shared.ns, &hashes[i], Bytes::from(v), secret),
        };
        let r = match r {
            Ok(p) => {
                n += 1;
                bytes += p.len() as u64;
                loaded.push(hashes[i]);
                Ok((p, TierKind::Redis))
            }
            Err(e) => {
                shared.stats.load_failure(&e);
                if e != LoadError::Missing {
                    let key = String::from_utf8_lossy(&rs.key(&hashes[i])).into_owned();
                    shared
                        .log
                        .warn(refusal_kind(&e), &format_args!("{e} (key {key})"));
                }
                Err(e)
            }
        };
        results[i] = Some(r);
    }
    let s = &shared.stats.redis;
    s.blocks_loaded.fetch_add(n, Relaxed);
    s.bytes_loaded.fetch_add(bytes, Relaxed);
    s.load_call(t0.elapsed(), bytes);
    rs.mark_present(loaded);
    finish_load(&shared, ticket, results, LoadError::Missing);
}

fn refusal_kind(e: &LoadError) -> &'static str {
    match e {
        LoadError::BadSignature => "value refused (signature)",
        LoadError::ForeignLayout => "value refused (foreign layout)",
        LoadError::UnsupportedVersion(_) => "value refused (format version)",
        _ => "value refused (integrity)",
    }
}

fn open_redis(cfg: RedisConfig, shared: Arc<Shared>) -> Result<RedisSide, TierError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("cachet-tiers")
        .enable_all()
        .build()
        .map_err(TierError::Runtime)?;
    let handle = rt.handle().clone();
    let (save_tx, save_rx) = mpsc::channel(cfg.save_queue);
    let r = Arc::new(RedisShared {
        health: Health::new(cfg.target.display()),
        conn: RwLock::new(None),
        cfg,
        shared,
        present: Mutex::new(lru::LruCache::new(
            std::num::NonZeroUsize::new(PRESENT_CAPACITY).unwrap_or(std::num::NonZeroUsize::MIN),
        )),
    });

    // The first connection, bounded by the timeout, so that the first requests see Redis.
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let r0 = r.clone();
    handle.spawn(async move {
        let res = tokio::time::timeout(
            r0.cfg.timeout,
            redis_conn::connect(
                &r0.cfg.target,
                r0.cfg.timeout,
                r0.cfg.ca_cert_pem.as_deref(),
            ),
        )
        .await;
        let _ = tx.send(res);
    });
    match rx.recv_timeout(r.cfg.timeout + Duration::from_millis(100)) {
        Ok(Ok(Ok(conn))) => {
            r.set_conn(Some(conn));
            r.health.mark_up();
        }
        Ok(Ok(Err(e))) => r.health.log_unreachable_at_start(&e.to_string()),
        _ => r.health.log_unreachable_at_start("connection timed out"),
    }

    handle.spawn(prober(r.clone()));
    handle.spawn(writer(r.clone(), save_rx));
    Ok(RedisSide {
        rt: Some(rt),
        handle,
        r,
        save_tx,
    })
}

/// While Redis is down, reconnects every `probe_interval`; a fresh connection that answers a
/// `PING` (every node, for a cluster) replaces the old one and brings the tier up.
async fn prober(r: Arc<RedisShared>) {
    loop {
        tokio::time::sleep(r.cfg.probe_interval).await;
        if r.health.is_up() {
            continue;
        }
        let res = tokio::time::timeout(
            r.cfg.timeout,
            redis_conn::connect(&r.cfg.target, r.cfg.timeout, r.cfg.ca_cert_pem.as_deref()),
        )
        .await;
        if let Ok(Ok(conn)) = res {
            r.set_conn(Some(conn));
            r.health.mark_up();
        }
    }
}

const SAVE_BATCH_BLOCKS: usize = 64;
const SAVE_BATCH_BYTES: usize = 8 << 20;

/// The write-behind writer: drains the queue in batches of up to 64 blocks / 8 MiB (small
/// enough to fit the call timeout on a slow link), each written in one pipelined round trip.
async fn writer(r: Arc<RedisShared>, mut rx: mpsc::Receiver<SaveItem>) {
    let mut budget = r.cfg.budget_bytes.map(|b| Budget::new(b, r.cfg.ttl));
    while let Some(first) = rx.recv().await {
        let mut bytes = first.payload.len();
        let mut batch = vec![first];
        while batch.len() < SAVE_BATCH_BLOCKS && bytes < SAVE_BATCH_BYTES {
            match rx.try_recv() {
                Ok(it) => {
                    bytes += it.payload.len();
                    batch.push(it);
                }
                Err(_) => break,
            }
        }
        write_batch(&r, batch, budget.as_mut()).await;
    }
}

async fn write_batch(r: &RedisShared, batch: Vec<SaveItem>, mut budget: Option<&mut Budget>) {
    let stats = &r.shared.stats;
    let n = batch.len() as u64;
    if !r.health.is_up() {
        stats.save_failures.fetch_add(n, Relaxed);
        stats.saves_settled.fetch_add(n, Relaxed);
        return;
    }
    let t0 = Instant::now();
    let secret = r.cfg.secret.as_ref();
    let overhead = value_overhead(&r.shared.ns, secret.is_some()) as u64;
    let now = Instant::now();
    let mut items = Vec::with_capacity(batch.len());
    let mut payload_lens = Vec::with_capacity(batch.len());
    let mut written = Vec::with_capacity(batch.len());
    let mut pending = 0u64;
    for it in &batch {
        let vlen = it.payload.len() as u64 + overhead;
        if let Some(b) = budget.as_deref_mut() {
            if !b.fits(now, pending + vlen) {
                stats.save_budget_drops.fetch_add(1, Relaxed);
                stats.saves_settled.fetch_add(1, Relaxed);
                continue;
            }
        }
        pending += vlen;
        items.push((
            r.key(&it.hash),
            encode_value(&r.shared.ns, &it.hash, &it.payload, secret),
        ));
        payload_lens.push(it.payload.len() as u64);
        written.push(it.hash);
    }
    if items.is_empty() {
        return;
    }
    let ttl = r.cfg.ttl;
    let m = items.len() as u64;
    let res = r
        .call(|mut c| async move { c.set_many(&items, ttl).await })
        .await;
    match res {
        Ok(stored) => {
            let (mut ok, mut ok_payload, mut ok_value) = (0u64, 0u64, 0u64);
            let mut present = Vec::with_capacity(written.len());
            for ((s, len), h) in stored.iter().zip(&payload_lens).zip(&written) {
                if *s {
                    ok += 1;
                    ok_payload += len;
                    ok_value += len + overhead;
                    present.push(*h);
                }
            }
            r.mark_present(present);
            if let Some(b) = budget {
                b.charge(now, ok_value);
            }
            let s = &stats.redis;
            s.save_call(t0.elapsed(), ok, ok_payload);
            if ok < m {
                stats.save_failures.fetch_add(m - ok, Relaxed);
                r.shared.log.warn(
                    "save refused by Redis",
                    &format_args!("{} of {m} blocks", m - ok),
                );
            }
        }
        Err(e) => {
            stats.save_failures.fetch_add(m, Relaxed);
            r.call_failed(e);
        }
    }
    stats.saves_settled.fetch_add(m, Relaxed);
}

/// The per-instance Redis byte budget: value bytes written within the last TTL, at one-second
/// granularity (a second's writes are released one second late, so the bound holds).
struct Budget {
    limit: u64,
    ttl: Duration,
    origin: Instant,
    /// (second since origin, bytes written in it), oldest first.
    window: VecDeque<(u64, u64)>,
    total: u64,
}

impl Budget {
    fn new(limit: u64, ttl: Option<Duration>) -> Self {
        Budget {
            limit,
            // validate() guarantees a TTL with a budget.
            ttl: ttl.unwrap_or(Duration::from_secs(3600)),
            origin: Instant::now(),
            window: VecDeque::new(),
            total: 0,
        }
    }

    fn expire(&mut self, now: Instant) {
        let now_s = now.duration_since(self.origin).as_secs();
        let ttl_s = self.ttl.as_secs().max(1);
        while let Some(&(s, b)) = self.window.front() {
            // Written during second s, so expired by s + 1 + ttl.
            if s + 1 + ttl_s <= now_s {
                self.total -= b;
                self.window.pop_front();
            } else {
                break;
            }
        }
    }

    fn fits(&mut self, now: Instant, extra: u64) -> bool {
        self.expire(now);
        self.total + extra <= self.limit
    }

    fn charge(&mut self, now: Instant, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let s = now.duration_since(self.origin).as_secs();
        match self.window.back_mut() {
            Some((last, b)) if *last == s => *b += bytes,
            _ => self.window.push_back((s, bytes)),
        }
        self.total += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HostConfig;

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
            namespace: ns(),
            host: Some(HostConfig {
                capacity_bytes: cap,
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

    #[test]
    fn budget_window_releases_bytes_one_ttl_after_their_second() {
        let mut b = Budget::new(1000, Some(Duration::from_secs(2)));
        let t = b.origin;
        assert!(b.fits(t, 600));
        b.charge(t, 600);
        assert!(b.fits(t, 400));
        assert!(!b.fits(t, 401));
        // Written in second 0: still held at 2.999 s, released at 3 s (0 + 1 + ttl).
        assert!(!b.fits(t + Duration::from_millis(2999), 401));
        assert!(b.fits(t + Duration::from_secs(3), 1000));
        assert_eq!(b.total, 0);
    }
}
