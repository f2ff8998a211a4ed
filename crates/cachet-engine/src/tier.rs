//! The engine's side of an external KV tier: what [`crate::step::EngineCore`] needs to
//! look blocks up, load them without blocking the step, and save blocks behind the step.
//!
//! `cachet-tiers` implements it for the host-memory LRU and Redis; [`MemoryTier`] is a plain
//! in-process map for tests and examples.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cachet_core::sessions::SessionRecord;
use cachet_core::tier::{KvLookup, TierTag};
use cachet_core::BlockHash;

/// One block's KV as the executor saved it.
pub type Payload = bytes::Bytes;

/// Names a request's loads: its slot and handle (a completion for a handle no longer in that
/// slot is ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoadTicket {
    pub slot: u32,
    pub handle: u64,
}

/// Why a block did not load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadFailure(pub String);

/// The outcome of one request's loads, one entry per requested hash, in order.
#[derive(Clone, Debug)]
pub struct LoadDone {
    pub ticket: LoadTicket,
    pub blocks: Vec<Result<(Payload, TierTag), LoadFailure>>,
}

/// Why the engine saves a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveReason {
    /// Its cache entry is being evicted from the local pool (a host tier keeps it).
    Evicted,
    /// It just became a new cache entry (a shared tier publishes it to other instances).
    Filled,
    /// The engine is shutting down and the tier asked for the pool's cached blocks
    /// ([`KvTier::saves_on_shutdown`]): a disk tier keeps them for the next start.
    Shutdown,
}

/// Which saves a tier wants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveOn {
    pub evicted: bool,
    pub filled: bool,
}

pub trait KvTier: KvLookup + Send {
    /// Start fetching `hashes`; never blocks. The outcome comes back through `poll_loads`.
    fn start_load(&mut self, ticket: LoadTicket, hashes: Vec<BlockHash>);
    /// Loads finished since the last call.
    fn poll_loads(&mut self) -> Vec<LoadDone>;
    /// Keep `payload` as the KV of `hash` (write-behind: never blocks; may drop and count).
    fn save(&mut self, hash: BlockHash, payload: Payload, reason: SaveReason);
    fn saves_on(&self) -> SaveOn;
    /// Asked before a block is copied out for a save: `false` when the tier already holds
    /// `hash` (a block it just loaded, say), so the engine skips the copy (368 KB per block of
    /// the default model, on the engine thread). Default: every save is wanted.
    fn wants_save(&mut self, _hash: &BlockHash, _reason: SaveReason) -> bool {
        true
    }
    /// An empty buffer with capacity for `len` bytes, to copy a block into for
    /// [`KvTier::save`]. A tier that recycles payload buffers hands out a warm one, so that the
    /// copy on the engine thread is a memcpy rather than a page fault per 4 KiB (a fresh
    /// 368 KB allocation is a new mapping). Default: a fresh allocation.
    fn take_buffer(&mut self, len: usize) -> Vec<u8> {
        Vec::with_capacity(len)
    }
    /// Whether the engine, shutting down, should hand the tier every cached block of its pool
    /// ([`SaveReason::Shutdown`]; each still asked with [`KvTier::wants_save`] first).
    /// Default: no.
    fn saves_on_shutdown(&self) -> bool {
        false
    }
    /// The sessions the last process parked ([`KvTier::save_sessions`]), read once when the
    /// engine starts. Default: none.
    fn saved_sessions(&mut self) -> Vec<SessionRecord> {
        Vec::new()
    }
    /// At shutdown: the parked sessions, kept for the next start beside their blocks.
    /// Default: not kept.
    fn save_sessions(&mut self, _records: Vec<SessionRecord>) {}
}

/// An in-process tier over a shared map: every block saved on fill, loads answered at the next
/// poll. Several engines holding clones share one store (as instances share a Redis).
#[derive(Clone, Default)]
pub struct MemoryTier {
    store: Arc<Mutex<HashMap<BlockHash, Payload>>>,
    pending: Vec<(LoadTicket, Vec<BlockHash>)>,
    tag: Option<TierTag>,
}

impl MemoryTier {
    pub fn new() -> Self {
        MemoryTier::default()
    }

    /// A tier sharing this one's store.
    pub fn share(&self) -> Self {
        MemoryTier {
            store: Arc::clone(&self.store),
            pending: Vec::new(),
            tag: self.tag,
        }
    }

    pub fn len(&self) -> usize {
        self.store.lock().map_or(0, |s| s.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replace (or drop, with `None`) the value of `hash` (fault injection in tests).
    pub fn set(&self, hash: BlockHash, payload: Option<Payload>) {
        if let Ok(mut s) = self.store.lock() {
            match payload {
                Some(p) => s.insert(hash, p),
                None => s.remove(&hash),
            };
        }
    }

    pub fn hashes(&self) -> Vec<BlockHash> {
        self.store
            .lock()
            .map(|s| s.keys().copied().collect())
            .unwrap_or_default()
    }
}

impl KvLookup for MemoryTier {
    fn lookup(&mut self, hashes: &[BlockHash]) -> usize {
        let Ok(s) = self.store.lock() else { return 0 };
        hashes.iter().take_while(|h| s.contains_key(h)).count()
    }
}

impl KvTier for MemoryTier {
    fn start_load(&mut self, ticket: LoadTicket, hashes: Vec<BlockHash>) {
        self.pending.push((ticket, hashes));
    }

    fn poll_loads(&mut self) -> Vec<LoadDone> {
        let tag = self.tag.unwrap_or(TierTag::Redis);
        let Ok(s) = self.store.lock() else {
            return Vec::new();
        };
        std::mem::take(&mut self.pending)
            .into_iter()
            .map(|(ticket, hashes)| LoadDone {
                ticket,
                blocks: hashes
                    .iter()
                    .map(|h| {
                        s.get(h)
                            .cloned()
                            .map(|p| (p, tag))
                            .ok_or_else(|| LoadFailure("missing".into()))
                    })
                    .collect(),
            })
            .collect()
    }

    fn save(&mut self, hash: BlockHash, payload: Payload, _reason: SaveReason) {
        if let Ok(mut s) = self.store.lock() {
            s.entry(hash).or_insert(payload);
        }
    }

    fn saves_on(&self) -> SaveOn {
        SaveOn {
            evicted: false,
            filled: true,
        }
    }
}
