//! Chained, cryptographic block hashes (spec §1).
//!
//! `hash(block i) = BLAKE3(parent || tokens || extra keys)`, where the parent of block 0 is a seed
//! derived from the model identity, the block size and the KV layout. Two processes serving the
//! same model compute the same hash for the same tokens; any other model gets other hashes.

use std::fmt;
use std::hash::Hasher;

use crate::TokenId;

/// The key of one full block in the prefix cache.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl BlockHash {
    /// Lower-case hex of all 32 bytes.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in &self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// Parses what [`BlockHash::to_hex`] writes.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(BlockHash(out))
    }
}

/// Serialized as 64 hex characters.
impl serde::Serialize for BlockHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for BlockHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        BlockHash::from_hex(&s).ok_or_else(|| serde::de::Error::custom("expected 64 hex digits"))
    }
}

impl std::hash::Hash for BlockHash {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.0[..8]);
    }
}

/// The parent of every request's first block: fixed per (model, block size, KV layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashSeed(pub BlockHash);

impl HashSeed {
    /// `model_fingerprint` identifies the weights (or the simulated model's config);
    /// `kv_layout` names the KV dtype and shape, e.g. `"f16:L30:H3:D64"`.
    pub fn new(model_fingerprint: &[u8; 32], block_size: usize, kv_layout: &str) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(b"cachet/block-hash/v1\0");
        h.update(model_fingerprint);
        h.update(&(block_size as u64).to_le_bytes());
        h.update(&(kv_layout.len() as u64).to_le_bytes());
        h.update(kv_layout.as_bytes());
        HashSeed(BlockHash(*h.finalize().as_bytes()))
    }
}

/// Extra keys mixed into block hashes: the adapter (every block) and the cache salt (first block
/// only; the chain carries it on).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    pub adapter: Option<String>,
    pub cache_salt: Option<String>,
}

/// Hash of block `index` with the given parent.
pub fn hash_block(
    parent: &BlockHash,
    tokens: &[TokenId],
    extra: &ExtraKeys,
    index: usize,
) -> BlockHash {
    // The bytes are gathered first and hashed with one `update`: the same byte stream as
    // feeding each piece separately, without the per-call overhead.
    let mut buf: Vec<u8> = Vec::new();
    let mut stack = [0u8; 32 + 4 + 4 * 64];
    let fixed = 32 + 4 + 4 * tokens.len();
    let bytes: &mut [u8] = if fixed <= stack.len() {
        &mut stack[..fixed]
    } else {
        buf.resize(fixed, 0);
        &mut buf
    };
    bytes[..32].copy_from_slice(&parent.0);
    bytes[32..36].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
    for (dst, t) in bytes[36..].chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    let salted = index == 0 && extra.cache_salt.is_some();
    if extra.adapter.is_none() && !salted {
        return BlockHash(*blake3::hash(bytes).as_bytes());
    }
    let mut h = blake3::Hasher::new();
    h.update(bytes);
    // Tagged, length-prefixed extra keys so that no two different key sets share bytes.
    if let Some(a) = &extra.adapter {
        h.update(b"\x01");
        h.update(&(a.len() as u64).to_le_bytes());
        h.update(a.as_bytes());
    }
    if index == 0 {
        if let Some(s) = &extra.cache_salt {
            h.update(b"\x02");
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
    }
    BlockHash(*h.finalize().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let h = BlockHash(std::array::from_fn(|i| (i * 37) as u8));
        let hex = h.to_hex();
        assert_eq!(&hex[..6], "00254a");
        assert_eq!(BlockHash::from_hex(&hex), Some(h));
        assert_eq!(BlockHash::from_hex("zz"), None);
    }

    #[test]
    fn seed_depends_on_model_block_size_and_layout() {
        let a = HashSeed::new(&[1; 32], 16, "f16");
        assert_eq!(a, HashSeed::new(&[1; 32], 16, "f16"));
        assert_ne!(a, HashSeed::new(&[2; 32], 16, "f16"));
        assert_ne!(a, HashSeed::new(&[1; 32], 32, "f16"));
        assert_ne!(a, HashSeed::new(&[1; 32], 16, "f32"));
    }

    #[test]
    fn salt_changes_first_block_and_chain_carries_it() {
        let seed = HashSeed::new(&[0; 32], 4, "x").0;
        let plain = ExtraKeys::default();
        let salted = ExtraKeys {
            cache_salt: Some("tenant-a".into()),
            ..Default::default()
        };
        let b0 = hash_block(&seed, &[1, 2, 3, 4], &plain, 0);
        let s0 = hash_block(&seed, &[1, 2, 3, 4], &salted, 0);
        assert_ne!(b0, s0);
        // The salt is only mixed into block 0, but block 1 differs through its parent.
        assert_ne!(
            hash_block(&b0, &[5, 6, 7, 8], &plain, 1),
            hash_block(&s0, &[5, 6, 7, 8], &salted, 1)
        );
        // Same parent, later block: salt not mixed again.
        assert_eq!(
            hash_block(&b0, &[5, 6, 7, 8], &plain, 1),
            hash_block(&b0, &[5, 6, 7, 8], &salted, 1)
        );
    }

    #[test]
    fn adapter_changes_every_block() {
        let seed = HashSeed::new(&[0; 32], 4, "x").0;
        let a = ExtraKeys {
            adapter: Some("lora-1".into()),
            ..Default::default()
        };
        assert_ne!(
            hash_block(&seed, &[5, 6, 7, 8], &a, 3),
            hash_block(&seed, &[5, 6, 7, 8], &ExtraKeys::default(), 3)
        );
    }

    #[test]
    fn block_hash_is_blake3_of_the_documented_bytes() {
        // parent || u32 token count || u32 tokens || 0x01 len adapter || 0x02 len salt (block 0)
        let seed = HashSeed::new(&[7; 32], 4, "x").0;
        let e = ExtraKeys {
            adapter: Some("ad".into()),
            cache_salt: Some("salt".into()),
        };
        let mut bytes = seed.0.to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        for t in [10u32, 20, 30] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        bytes.push(1);
        bytes.extend_from_slice(&2u64.to_le_bytes());
        bytes.extend_from_slice(b"ad");
        let later = *blake3::hash(&bytes).as_bytes();
        bytes.push(2);
        bytes.extend_from_slice(&4u64.to_le_bytes());
        bytes.extend_from_slice(b"salt");
        let first = *blake3::hash(&bytes).as_bytes();
        assert_eq!(hash_block(&seed, &[10, 20, 30], &e, 0).0, first);
        assert_eq!(hash_block(&seed, &[10, 20, 30], &e, 1).0, later);
        // More tokens than the stack buffer holds.
        let long: Vec<u32> = (0..100).collect();
        let mut bytes = seed.0.to_vec();
        bytes.extend_from_slice(&100u32.to_le_bytes());
        for t in &long {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let plain = ExtraKeys::default();
        assert_eq!(
            hash_block(&seed, &long, &plain, 0).0,
            *blake3::hash(&bytes).as_bytes()
        );
    }
}
