//! The disk side of a [`crate::TierClient`]: a [`DiskStore`] and its two threads — the writer,
//! draining the bounded save queue, and the reader, running loads (and handing what the disk
//! lacks on to Redis when there is one).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use cachet_core::BlockHash;

use super::{finish_load, Shared, TierKind};
use crate::config::DiskConfig;
use crate::disk::{DiskStore, DiskWrite};
use crate::format::LoadError;
use crate::{Payload, TierError};

/// One queued save.
pub(super) struct DiskSave {
    pub(super) hash: BlockHash,
    pub(super) payload: Payload,
}

type Job = Box<dyn FnOnce() + Send>;

pub(super) struct DiskSide {
    pub(super) store: Arc<DiskStore>,
    pub(super) save_tx: mpsc::SyncSender<DiskSave>,
    load_tx: mpsc::Sender<Job>,
    pub(super) save_on_shutdown: bool,
    /// Joined on drop, so the directory's lock is released when the client goes (a new
    /// client on the same directory, in the same process, may open it at once).
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for DiskSide {
    fn drop(&mut self) {
        // Closing both channels ends both threads: the writer after the saves still queued,
        // the reader after the loads still queued.
        let (tx, _) = mpsc::sync_channel(1);
        drop(std::mem::replace(&mut self.save_tx, tx));
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.load_tx, tx));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Opens the store (lock, writability, index rebuild, logged) and starts its threads.
pub(super) fn open_disk(cfg: &DiskConfig, shared: Arc<Shared>) -> Result<DiskSide, TierError> {
    let t0 = Instant::now();
    let (store, rep) = DiskStore::open(cfg, &shared.ns)?;
    tracing::info!(
        target: "cachet_tiers",
        dir = %cfg.dir.display(),
        blocks = rep.blocks,
        bytes = rep.bytes,
        removed_torn = rep.removed,
        over_budget = rep.over_budget,
        ms = t0.elapsed().as_millis() as u64,
        "disk KV tier: index rebuilt from the directory"
    );
    if rep.foreign > 0 {
        tracing::warn!(
            target: "cachet_tiers",
            dir = %cfg.dir.display(),
            files = rep.foreign,
            "disk KV tier: files of another model, KV layout, block size or format version \
             refused (left on disk, not loaded)"
        );
    }
    if rep.unscanned > 0 {
        tracing::warn!(
            target: "cachet_tiers",
            files = rep.unscanned,
            "disk KV tier: the index rebuild ran out of time; these files are not indexed"
        );
    }
    let store = Arc::new(store);
    let (save_tx, save_rx) = mpsc::sync_channel::<DiskSave>(cfg.save_queue);
    let (load_tx, load_rx) = mpsc::channel::<Job>();
    let (s, sh) = (store.clone(), shared.clone());
    let w = std::thread::Builder::new()
        .name("cachet-disk-w".into())
        .spawn(move || writer(&s, &sh, save_rx))
        .map_err(TierError::Runtime)?;
    let r = std::thread::Builder::new()
        .name("cachet-disk-r".into())
        .spawn(move || {
            while let Ok(job) = load_rx.recv() {
                job();
            }
        })
        .map_err(TierError::Runtime)?;
    Ok(DiskSide {
        store,
        save_tx,
        load_tx,
        save_on_shutdown: cfg.save_on_shutdown,
        threads: vec![w, r],
    })
}

fn writer(store: &DiskStore, shared: &Shared, rx: mpsc::Receiver<DiskSave>) {
    let stats = &shared.stats;
    while let Ok(it) = rx.recv() {
        let t0 = Instant::now();
        match store.write(&it.hash, &it.payload) {
            Ok(DiskWrite::Stored { .. }) => {
                stats
                    .disk
                    .save_call(t0.elapsed(), 1, it.payload.len() as u64);
            }
            Ok(DiskWrite::Held) => {}
            Ok(DiskWrite::TooLarge) => {
                stats.disk_too_large.fetch_add(1, Relaxed);
            }
            Err(e) => {
                stats.save_failures.fetch_add(1, Relaxed);
                stats.disk_write_failures.fetch_add(1, Relaxed);
                shared.log.warn("disk write failed (save dropped)", &e);
            }
        }
        // The value was encoded (a copy): the payload's buffer serves the engine's next saves.
        shared.buffers.give_all(std::iter::once(it.payload));
        stats.saves_settled.fetch_add(1, Relaxed);
    }
}

impl DiskSide {
    /// Queues a save; `false` (counted) when the queue is full. The caller never waits.
    pub(super) fn save(&self, shared: &Shared, hash: BlockHash, payload: Payload) -> bool {
        let stats = &shared.stats;
        if self.store.touch(&hash) {
            stats.save_dedup_skips.fetch_add(1, Relaxed);
            return true;
        }
        stats.saves_enqueued.fetch_add(1, Relaxed);
        match self.save_tx.try_send(DiskSave { hash, payload }) {
            Ok(()) => true,
            Err(_) => {
                stats.saves_enqueued.fetch_sub(1, Relaxed);
                stats.save_queue_drops.fetch_add(1, Relaxed);
                false
            }
        }
    }

    /// Runs `then` on the reader thread after loading the unresolved slots the disk holds. A
    /// slot the disk fails to give (read error, refused file) is settled as that failure.
    pub(super) fn load(
        &self,
        shared: Arc<Shared>,
        ticket: u64,
        hashes: Vec<BlockHash>,
        mut results: Vec<Option<Result<(Payload, TierKind), LoadError>>>,
        then: Then,
    ) {
        let store = self.store.clone();
        let job: Job = Box::new(move || {
            let t0 = Instant::now();
            let (mut n, mut bytes, mut asked) = (0u64, 0u64, false);
            for (x, slot) in hashes.iter().zip(results.iter_mut()) {
                if slot.is_some() || !store.contains(x) {
                    continue;
                }
                asked = true;
                match store.read(x) {
                    Ok(p) => {
                        n += 1;
                        bytes += p.len() as u64;
                        *slot = Some(Ok((p, TierKind::Disk)));
                    }
                    // Evicted since the lookup: another tier may have it.
                    Err(LoadError::Missing) => {}
                    Err(e) => {
                        shared.stats.load_failure(&e);
                        shared.log.warn("disk block refused", &e);
                        *slot = Some(Err(e));
                    }
                }
            }
            if asked {
                let s = &shared.stats.disk;
                s.blocks_loaded.fetch_add(n, Relaxed);
                s.bytes_loaded.fetch_add(bytes, Relaxed);
                s.load_call(t0.elapsed(), bytes);
            }
            then(shared, ticket, hashes, results);
        });
        if let Err(mpsc::SendError(job)) = self.load_tx.send(job) {
            // The reader thread is gone (it never exits while the client lives): run it here.
            job();
        }
    }
}

/// A load's per-slot outcomes so far.
pub(super) type Results = Vec<Option<Result<(Payload, TierKind), LoadError>>>;

/// What a load does after the disk: ask the next tier for the open slots, or settle them.
pub(super) type Then = Box<dyn FnOnce(Arc<Shared>, u64, Vec<BlockHash>, Results) + Send>;

/// Settles every slot still open as missing (no tier after the disk).
pub(super) fn finish_missing(shared: Arc<Shared>, ticket: u64, _: Vec<BlockHash>, r: Results) {
    finish_load(&shared, ticket, r, LoadError::Missing);
}
