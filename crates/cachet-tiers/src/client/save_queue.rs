//! The write-behind save queue to Redis: [`SaveItem`]s queued by [`crate::TierClient::save`]
//! (bounded; a full queue drops the save and counts it), drained by one task on the tier
//! runtime in pipelined batches, within the instance's byte budget ([`Budget`]).

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use cachet_core::BlockHash;
use tokio::sync::mpsc;

use super::redis_side::RedisShared;
use crate::format::{encode_value, value_overhead};
use crate::Payload;

/// One queued save.
pub(super) struct SaveItem {
    pub(super) hash: BlockHash,
    pub(super) payload: Payload,
}

const SAVE_BATCH_BLOCKS: usize = 64;
const SAVE_BATCH_BYTES: usize = 8 << 20;

/// The write-behind writer: drains the queue in batches of up to 64 blocks / 8 MiB (small
/// enough to fit the call timeout on a slow link), each written in one pipelined round trip.
pub(super) async fn writer(r: std::sync::Arc<RedisShared>, mut rx: mpsc::Receiver<SaveItem>) {
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
        r.shared
            .buffers
            .give_all(batch.into_iter().map(|it| it.payload));
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
    // Every value is encoded (a copy): the payload buffers go back to the pool for the
    // engine's next saves.
    r.shared
        .buffers
        .give_all(batch.into_iter().map(|it| it.payload));
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
