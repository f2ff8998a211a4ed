//! The Redis side of a [`crate::TierClient`]: its runtime, connection and health, the lookup
//! (`EXISTS`) and load (`MGET` + verify) calls, the prober that reconnects, and the memory of
//! blocks recently present in Redis (so a save of one is skipped).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cachet_core::BlockHash;
use tokio::sync::mpsc;

use super::save_queue::{self, SaveItem};
use super::{finish_load, lock, Shared, TierKind};
use crate::config::RedisConfig;
use crate::format::{check_value, decode_value, LoadError};
use crate::health::Health;
use crate::raw_mget::{RawConn, RawTarget};
use crate::redis_conn::{self, is_outage, Conn};
use crate::{Payload, TierError};

pub(super) struct RedisSide {
    rt: Option<tokio::runtime::Runtime>,
    pub(super) handle: tokio::runtime::Handle,
    pub(super) r: Arc<RedisShared>,
    pub(super) save_tx: mpsc::Sender<SaveItem>,
}

impl Drop for RedisSide {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            // Never blocks, so dropping the last client is fine on any thread, async or not.
            rt.shutdown_background();
        }
    }
}

pub(super) struct RedisShared {
    pub(super) cfg: RedisConfig,
    conn: RwLock<Option<Conn>>,
    pub(super) health: Health,
    pub(super) shared: Arc<Shared>,
    /// Blocks this client recently loaded from or stored in Redis, with when: a save of one of
    /// them is skipped (the engine saves every new cache entry, loaded ones included, and
    /// re-sending 368 KB that Redis already holds is pure waste).
    present: Mutex<lru::LruCache<BlockHash, Instant>>,
    /// A plain `redis://` server: loads read their `MGET` reply themselves ([`crate::raw_mget`]).
    raw: Option<RawTarget>,
    /// Idle load connections of [`RedisShared::raw`] (one per load in flight at most).
    raw_pool: Mutex<Vec<RawConn>>,
}

/// Idle raw load connections kept.
const RAW_POOL: usize = 4;

/// How many recently present blocks [`RedisShared::present`] remembers (about 3 MB).
const PRESENT_CAPACITY: usize = 1 << 16;

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
    pub(super) fn call_failed(&self, e: CallError) {
        match e {
            CallError::Timeout => self.went_down("a call ran past the timeout"),
            CallError::Redis(e) if is_outage(&e) => self.went_down(&e.to_string()),
            CallError::Redis(e) => {
                self.shared.log.warn("Redis error reply", &e);
            }
            CallError::Down => {}
        }
    }

    pub(super) fn went_down(&self, why: &str) {
        if self.health.mark_down(why) {
            self.shared.stats.redis_outages.fetch_add(1, Relaxed);
        }
        // A restarted server or a failed-over master may have lost what we remember, and the
        // idle load connections opened before the outage are dead or point at the old master.
        lock(&self.present).clear();
        lock(&self.raw_pool).clear();
    }

    /// A stored block is trusted to still be there for half its TTL (ten minutes without one).
    fn fresh_for(&self) -> Duration {
        self.cfg.ttl.map_or(Duration::from_secs(600), |t| t / 2)
    }

    pub(super) fn mark_present(&self, hashes: impl IntoIterator<Item = BlockHash>) {
        let now = Instant::now();
        let mut p = lock(&self.present);
        for h in hashes {
            p.put(h, now);
        }
    }

    pub(super) fn recently_present(&self, hash: &BlockHash) -> bool {
        let fresh = self.fresh_for();
        lock(&self.present)
            .peek(hash)
            .is_some_and(|at| at.elapsed() < fresh)
    }

    pub(super) fn key(&self, hash: &BlockHash) -> Vec<u8> {
        self.shared.ns.redis_key(&self.cfg.key_prefix, hash)
    }

    /// Runs `f` on the current connection, bounded by the timeout.
    pub(super) async fn call<T, F, Fut>(&self, f: F) -> Result<T, CallError>
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

pub(super) enum CallError {
    /// Known down; no call made.
    Down,
    Timeout,
    Redis(redis::RedisError),
}

impl CallError {
    pub(super) fn load_error(&self) -> LoadError {
        match self {
            CallError::Down => LoadError::Unavailable,
            CallError::Timeout => LoadError::Timeout,
            CallError::Redis(e) if is_outage(e) => LoadError::Unavailable,
            CallError::Redis(_) => LoadError::Failed,
        }
    }
}

impl RedisSide {
    /// Which of `hashes` not in the host tier (`in_host`) Redis holds, into `in_redis`: one
    /// `EXISTS` pipeline, waited for on the caller's thread, bounded by the timeout. A failure
    /// leaves `in_redis` false, is counted, and takes Redis down when it is an outage.
    pub(super) fn lookup(&self, hashes: &[BlockHash], in_host: &[bool], in_redis: &mut [bool]) {
        let r = self;
        let stats = &self.r.shared.stats;
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
}

pub(super) async fn redis_load(
    rs: Arc<RedisShared>,
    ticket: u64,
    hashes: Vec<BlockHash>,
    rest: Vec<usize>,
    mut results: Vec<Option<Result<(Payload, TierKind), LoadError>>>,
) {
    let shared = rs.shared.clone();
    let t0 = Instant::now();
    let keys: Vec<Vec<u8>> = rest.iter().map(|i| rs.key(&hashes[*i])).collect();
    let got = match &rs.raw {
        Some(t) => raw_mget(&rs, t, &keys, &hashes, &rest).await,
        None => crate_mget(&rs, keys, &hashes, &rest).await,
    };
    let values = match got {
        Ok(v) => v,
        Err(e) => {
            let err = e.load_error();
            rs.call_failed(e);
            finish_load(&shared, ticket, results, err);
            return;
        }
    };
    let (mut n, mut bytes) = (0u64, 0u64);
    let mut loaded = Vec::new();
    for (i, v) in rest.into_iter().zip(values) {
        let r = match v {
            None => {
                lock(&rs.present).pop(&hashes[i]);
                Err(LoadError::Missing)
            }
            Some(r) => r,
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
    tracing::debug!(
        ticket,
        blocks = n,
        load_ms = t0.elapsed().as_secs_f64() * 1e3,
        raw = rs.raw.is_some(),
        "Redis load done"
    );
    rs.mark_present(loaded);
    finish_load(&shared, ticket, results, LoadError::Missing);
}

/// Per requested key: `None` when absent, else the checked payload or why it was refused.
type Checked = Vec<Option<Result<Payload, LoadError>>>;

/// The `redis` crate's `MGET` (a cluster, TLS), each value checked once all are in.
async fn crate_mget(
    rs: &RedisShared,
    keys: Vec<Vec<u8>>,
    hashes: &[BlockHash],
    rest: &[usize],
) -> Result<Checked, CallError> {
    let values = rs.call(|mut c| async move { c.mget(&keys).await }).await?;
    let secret = rs.cfg.secret.as_ref();
    Ok(rest
        .iter()
        .zip(values)
        .map(|(&i, v)| v.map(|v| decode_value(&rs.shared.ns, &hashes[i], Bytes::from(v), secret)))
        .collect())
}

/// The raw `MGET` ([`crate::raw_mget`]): every value checked as soon as its bytes are in,
/// payloads sliced out of the one reply buffer. Bounded by the timeout like every call; a
/// connection is reused only after a complete reply.
async fn raw_mget(
    rs: &RedisShared,
    target: &RawTarget,
    keys: &[Vec<u8>],
    hashes: &[BlockHash],
    rest: &[usize],
) -> Result<Checked, CallError> {
    if !rs.health.is_up() {
        return Err(CallError::Down);
    }
    let idle = lock(&rs.raw_pool).pop();
    let secret = rs.cfg.secret.as_ref();
    let ns = &rs.shared.ns;
    let timeout = rs.cfg.timeout;
    let call = async {
        let mut c = match idle {
            Some(c) => c,
            None => RawConn::connect(target, timeout).await?,
        };
        let got = c
            .mget(keys, |j, v| check_value(ns, &hashes[rest[j]], v, secret))
            .await?;
        Ok::<_, redis::RedisError>((c, got))
    };
    let (conn, (reply, elements)) = match tokio::time::timeout(timeout, call).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return Err(CallError::Redis(e)),
        Err(_) => return Err(CallError::Timeout),
    };
    {
        let mut pool = lock(&rs.raw_pool);
        if pool.len() < RAW_POOL {
            pool.push(conn);
        }
    }
    Ok(elements
        .into_iter()
        .map(|el| {
            el.map(|(at, checked)| {
                checked.map(|p| reply.slice(at.start + p.start..at.start + p.end))
            })
        })
        .collect())
}

fn refusal_kind(e: &LoadError) -> &'static str {
    match e {
        LoadError::BadSignature => "value refused (signature)",
        LoadError::ForeignLayout => "value refused (foreign layout)",
        LoadError::UnsupportedVersion(_) => "value refused (format version)",
        _ => "value refused (integrity)",
    }
}

pub(super) fn open_redis(cfg: RedisConfig, shared: Arc<Shared>) -> Result<RedisSide, TierError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("cachet-tiers")
        .enable_all()
        .build()
        .map_err(TierError::Runtime)?;
    let handle = rt.handle().clone();
    let (save_tx, save_rx) = mpsc::channel(cfg.save_queue);
    let raw = match &cfg.target {
        crate::config::RedisTarget::Single(url) => RawTarget::from_url(url),
        crate::config::RedisTarget::Cluster(_) => None,
    };
    let r = Arc::new(RedisShared {
        raw,
        raw_pool: Mutex::new(Vec::new()),
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
    handle.spawn(save_queue::writer(r.clone(), save_rx));
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
