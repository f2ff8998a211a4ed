//! KV cache events: what entered and what left a KV store (the local block pool, or a tier).
//!
//! The recorder emits these from the pool's own effects: a block is *stored* when its hash
//! becomes a cache entry, *removed* when that entry is evicted, and every entry is *cleared* by a
//! reset. A fill of an already cached hash stores nothing. Replayed in order into an empty
//! index, the events of the local pool reproduce its cache map exactly.
//!
//! Transports (the ZMQ publisher in vLLM's wire format, the server's SSE endpoint) read batches
//! of these; the core only produces them.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::hash::BlockHash;
use crate::TokenId;

/// Where a block lives. Routers treat only [`Medium::Gpu`] as "held by the engine": it is the
/// local block pool (named as vLLM names its device pool, whatever the device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Medium {
    /// The engine's own block pool.
    Gpu,
    /// The host-memory tier (`"CPU"`, as vLLM's CPU offloading names it; Dynamo 1.6 counts it
    /// as host-pinned reach, not as held by the engine).
    Cpu,
    /// A shared external store (Redis).
    External,
}

impl Medium {
    /// The string vLLM puts in an event's `medium` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::External => "EXTERNAL",
        }
    }
}

/// The request (and session) on whose behalf an event happened: cachet's addition to vLLM's
/// events, so that a router or an operator can say which request filled or evicted what.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventCause {
    /// The engine's handle of the request.
    pub handle: u64,
    /// The request's label (the client's `X-Request-Id`, or the generated response id).
    pub request_id: Arc<str>,
    pub session_id: Option<Arc<str>>,
}

/// One change to a store's set of cached blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheEvent {
    /// Consecutive blocks of one request became cache entries: `parent -> hashes[0] -> hashes[1]
    /// -> ...`. `token_ids` holds every token of those blocks, concatenated
    /// (`hashes.len() * block_size` ids).
    Stored {
        hashes: Vec<BlockHash>,
        /// The cache key of the block before `hashes[0]`; `None` for a request's first block.
        parent: Option<BlockHash>,
        token_ids: Vec<TokenId>,
        block_size: u32,
        /// Adapter name mixed into the hashes, if any.
        lora_name: Option<String>,
        /// The request's `cache_salt`, mixed into its first block's hash (a router must key by
        /// it too, or it would predict hits across tenants that the engine never serves).
        cache_salt: Option<String>,
        medium: Medium,
        /// Who caused it (`None` when no request did, e.g. a tier's own bookkeeping).
        cause: Option<EventCause>,
    },
    /// These cache entries were dropped (evicted, or released by a tier).
    Removed {
        hashes: Vec<BlockHash>,
        medium: Medium,
        cause: Option<EventCause>,
    },
    /// Every entry of `medium` was dropped (a prefix-cache reset).
    AllCleared { medium: Medium },
}

/// The events of one engine step, in the order they happened.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EventBatch {
    /// Wall-clock time of the step, seconds since the Unix epoch (stamped by the engine).
    pub ts: f64,
    pub events: Vec<CacheEvent>,
}

impl EventBatch {
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

/// The 64-bit integer form of a block hash used on the wire, as vLLM's
/// `maybe_convert_block_hash` makes it (`int.from_bytes(hash, "big") & (2**64 - 1)`): the
/// hash's low 64 bits, i.e. its last eight bytes read big-endian. msgpack carries it as an
/// unsigned integer (uint64 from 2^63 up), which Dynamo's decoder accepts.
pub fn wire_hash(hash: &BlockHash) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&hash.0[24..32]);
    u64::from_be_bytes(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_hash_is_the_low_64_bits_big_endian() {
        let mut h = [0u8; 32];
        h[24..32].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        h[0] = 0xff; // high bytes do not matter
        assert_eq!(wire_hash(&BlockHash(h)), 0x0102_0304_0506_0708);
    }
}
