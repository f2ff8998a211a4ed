//! What a block looks like in Redis: its key and its self-describing, checked value.
//!
//! **Key**: `{prefix}:kv1:{fp}:{layout}:{block_size}:{hash}` where `fp` is the first 16 hex digits
//! of the model fingerprint, `layout` the KV layout with every byte outside `[A-Za-z0-9._:-]`
//! percent-escaped (so a key never carries a `{…}` Redis Cluster hash tag by accident) and `hash`
//! the block hash's 64 hex digits. Every instance serving the same model with the same KV layout
//! and block size computes the same key for the same block, and nothing else does.
//!
//! **Value** (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `CKVT` |
//! | 2 | format version (1) |
//! | 2 | flags: bit 0 = a MAC follows the checksum |
//! | 4 | block size |
//! | 32 | model fingerprint |
//! | 32 | block hash (binds the value to its key: a value copied under another key is refused) |
//! | 2 + L | KV layout length and UTF-8 bytes |
//! | 8 + P | payload length and the payload (the executor's serialized block) |
//! | 32 | checksum = BLAKE3 over everything above |
//! | 32 | only with flag bit 0: MAC = HMAC-SHA256(secret, domain ‖ checksum) |
//!
//! A reader recomputes the checksum (truncation, bit rot, a foreign writer's bug), then, when it
//! has a secret, requires a valid MAC (someone who can write to Redis but lacks the secret
//! cannot make a value this reader accepts), then compares the namespace and the block hash.
//! Authenticating the BLAKE3 digest instead of the payload is the usual hash-then-MAC
//! construction: it is as strong as BLAKE3's collision resistance, and it keeps the cost of a
//! signed 46 MB load at one BLAKE3 pass (a few ms) rather than a SHA-256 pass over the payload.

use bytes::Bytes;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use cachet_core::BlockHash;

use crate::config::Secret;

/// Identifies what a stored block belongs to: every key and value carries it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TierNamespace {
    /// The fingerprint of the model's weights (the same one that seeds the block hashes).
    pub model_fingerprint: [u8; 32],
    /// The KV layout the payload is serialized in, e.g. `"f16:L30:H3:D64"`.
    pub kv_layout: String,
    /// Tokens per block.
    pub block_size: u32,
}

const MAGIC: &[u8; 4] = b"CKVT";
/// The value format this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
const FLAG_MAC: u16 = 1;
const FIXED_HEAD: usize = 4 + 2 + 2 + 4 + 32 + 32 + 2;
const TAG: usize = 32;
const MAC_DOMAIN: &[u8] = b"cachet/kv-tier/value-mac/v1\0";

/// Why a stored value was refused (see [`decode_value`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CorruptKind {
    /// Not a cachet value at all.
    BadMagic,
    /// Shorter than its header says.
    Truncated,
    /// Longer than its header says, or an unknown flag or a non-UTF-8 layout.
    Malformed,
    /// The checksum does not match the bytes.
    Checksum,
    /// A valid value of another block, stored under this block's key.
    WrongBlock,
}

impl std::fmt::Display for CorruptKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CorruptKind::BadMagic => "bad magic",
            CorruptKind::Truncated => "truncated",
            CorruptKind::Malformed => "malformed",
            CorruptKind::Checksum => "checksum mismatch",
            CorruptKind::WrongBlock => "value of another block",
        })
    }
}

/// Why one block of a load did not come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum LoadError {
    /// No tier holds the block (any more).
    #[error("block not in any tier")]
    Missing,
    /// The tier did not answer within `--kv-tier-timeout-ms`.
    #[error("tier call timed out")]
    Timeout,
    /// The tier is known to be down (not connected, or waiting for a probe to succeed); no call
    /// was made.
    #[error("tier unavailable")]
    Unavailable,
    /// The call failed (connection lost mid-call, an error reply).
    #[error("tier call failed")]
    Failed,
    /// The value failed its integrity check or does not belong to this key.
    #[error("stored value refused: {0}")]
    Corrupt(CorruptKind),
    /// A secret is configured and the value's MAC is missing or wrong.
    #[error("stored value refused: signature missing or invalid")]
    BadSignature,
    /// The value is intact but belongs to another model, KV layout or block size.
    #[error("stored value refused: another model or KV layout")]
    ForeignLayout,
    /// The value was written in a format version this build does not read.
    #[error("stored value refused: format version {0}")]
    UnsupportedVersion(u16),
}

impl TierNamespace {
    /// The Redis key of `hash` under this namespace.
    pub fn redis_key(&self, prefix: &str, hash: &BlockHash) -> Vec<u8> {
        let mut k = Vec::with_capacity(prefix.len() + 6 + 17 + self.kv_layout.len() + 12 + 65);
        k.extend_from_slice(prefix.as_bytes());
        k.extend_from_slice(b":kv1:");
        for b in &self.model_fingerprint[..8] {
            push_hex(&mut k, *b);
        }
        k.push(b':');
        for &b in self.kv_layout.as_bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-') {
                k.push(b);
            } else {
                k.push(b'%');
                push_hex(&mut k, b);
            }
        }
        k.push(b':');
        k.extend_from_slice(self.block_size.to_string().as_bytes());
        k.push(b':');
        for b in &hash.0 {
            push_hex(&mut k, *b);
        }
        k
    }
}

fn push_hex(out: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(HEX[(b >> 4) as usize]);
    out.push(HEX[(b & 15) as usize]);
}

/// Bytes a value adds around a payload for this namespace (header and tags).
pub fn value_overhead(ns: &TierNamespace, signed: bool) -> usize {
    FIXED_HEAD + ns.kv_layout.len() + 8 + TAG + if signed { TAG } else { 0 }
}

/// Serializes `payload` as the value of block `hash`; signed when `secret` is given.
pub fn encode_value(
    ns: &TierNamespace,
    hash: &BlockHash,
    payload: &[u8],
    secret: Option<&Secret>,
) -> Vec<u8> {
    let mut v = Vec::with_capacity(payload.len() + value_overhead(ns, secret.is_some()));
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    let flags = if secret.is_some() { FLAG_MAC } else { 0 };
    v.extend_from_slice(&flags.to_le_bytes());
    v.extend_from_slice(&ns.block_size.to_le_bytes());
    v.extend_from_slice(&ns.model_fingerprint);
    v.extend_from_slice(&hash.0);
    let layout = ns.kv_layout.as_bytes();
    // A layout name is a short label; one longer than 64 KiB is cut (and then never matches).
    let layout = &layout[..layout.len().min(u16::MAX as usize)];
    v.extend_from_slice(&(layout.len() as u16).to_le_bytes());
    v.extend_from_slice(layout);
    v.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    v.extend_from_slice(payload);
    let checksum = *blake3::hash(&v).as_bytes();
    v.extend_from_slice(&checksum);
    if let Some(secret) = secret {
        v.extend_from_slice(&mac(secret, &checksum));
    }
    v
}

fn mac(secret: &Secret, checksum: &[u8; 32]) -> [u8; 32] {
    let mut m = secret.hmac();
    m.update(MAC_DOMAIN);
    m.update(checksum);
    m.finalize().into_bytes().into()
}

fn verify_mac(secret: &Secret, checksum: &[u8; 32], tag: &[u8]) -> bool {
    let mut m = secret.hmac();
    m.update(MAC_DOMAIN);
    m.update(checksum);
    // Constant-time comparison.
    m.verify_slice(tag).is_ok()
}

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Checks a stored value and returns its payload (a zero-copy slice of `value`).
///
/// Order of checks: format (magic, version, lengths), checksum, MAC (only when `secret` is
/// given, and then required), namespace, block hash.
pub fn decode_value(
    ns: &TierNamespace,
    hash: &BlockHash,
    value: Bytes,
    secret: Option<&Secret>,
) -> Result<Bytes, LoadError> {
    check_value(ns, hash, &value, secret).map(|r| value.slice(r))
}

/// [`decode_value`]'s checks on borrowed bytes: where the payload lies in `v` when every check
/// passes.
pub fn check_value(
    ns: &TierNamespace,
    hash: &BlockHash,
    v: &[u8],
    secret: Option<&Secret>,
) -> Result<std::ops::Range<usize>, LoadError> {
    if v.len() >= MAGIC.len() && &v[..MAGIC.len()] != MAGIC {
        return Err(LoadError::Corrupt(CorruptKind::BadMagic));
    }
    if v.len() < FIXED_HEAD {
        return Err(LoadError::Corrupt(CorruptKind::Truncated));
    }
    let version = u16::from_le_bytes([v[4], v[5]]);
    if version != FORMAT_VERSION {
        return Err(LoadError::UnsupportedVersion(version));
    }
    let flags = u16::from_le_bytes([v[6], v[7]]);
    if flags & !FLAG_MAC != 0 {
        return Err(LoadError::Corrupt(CorruptKind::Malformed));
    }
    let layout_len = u16::from_le_bytes([v[FIXED_HEAD - 2], v[FIXED_HEAD - 1]]) as usize;
    let layout_end = FIXED_HEAD + layout_len;
    if v.len() < layout_end + 8 {
        return Err(LoadError::Corrupt(CorruptKind::Truncated));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&v[layout_end..layout_end + 8]);
    let payload_len = u64::from_le_bytes(len8);
    let payload_start = layout_end + 8;
    let tags = if flags & FLAG_MAC != 0 { 2 * TAG } else { TAG };
    let expected = (payload_start as u64)
        .checked_add(payload_len)
        .and_then(|n| n.checked_add(tags as u64));
    let Some(expected) = expected else {
        return Err(LoadError::Corrupt(CorruptKind::Malformed));
    };
    if (v.len() as u64) < expected {
        return Err(LoadError::Corrupt(CorruptKind::Truncated));
    }
    if v.len() as u64 > expected {
        return Err(LoadError::Corrupt(CorruptKind::Malformed));
    }
    let payload_end = payload_start + payload_len as usize;
    let mut checksum = [0u8; 32];
    checksum.copy_from_slice(&v[payload_end..payload_end + TAG]);
    if *blake3::hash(&v[..payload_end]).as_bytes() != checksum {
        return Err(LoadError::Corrupt(CorruptKind::Checksum));
    }
    if let Some(secret) = secret {
        if flags & FLAG_MAC == 0 || !verify_mac(secret, &checksum, &v[payload_end + TAG..]) {
            return Err(LoadError::BadSignature);
        }
    }
    let block_size = u32::from_le_bytes([v[8], v[9], v[10], v[11]]);
    if block_size != ns.block_size
        || v[12..44] != ns.model_fingerprint
        || &v[FIXED_HEAD..layout_end] != ns.kv_layout.as_bytes()
    {
        return Err(LoadError::ForeignLayout);
    }
    if v[44..76] != hash.0 {
        return Err(LoadError::Corrupt(CorruptKind::WrongBlock));
    }
    Ok(payload_start..payload_end)
}

/// What a value's header says, read without its payload (the disk tier's index rebuild reads
/// only this much of each file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValueHeader {
    /// The block the value says it holds.
    pub hash: BlockHash,
    /// The whole value's length its header implies (a file of another length is torn).
    pub total_len: u64,
}

/// The bytes [`read_header`] needs at most for this namespace (a value's head up to its payload).
pub fn header_len(ns: &TierNamespace) -> usize {
    FIXED_HEAD + ns.kv_layout.len() + 8
}

/// Checks a value's head (magic, version, flags, lengths) and its namespace, without the
/// checksum: [`LoadError::ForeignLayout`] for a value of another model, KV layout or block
/// size. `head` may be the whole value or its first [`header_len`] bytes.
pub fn read_header(ns: &TierNamespace, head: &[u8]) -> Result<ValueHeader, LoadError> {
    let v = head;
    if v.len() >= MAGIC.len() && &v[..MAGIC.len()] != MAGIC {
        return Err(LoadError::Corrupt(CorruptKind::BadMagic));
    }
    if v.len() < FIXED_HEAD {
        return Err(LoadError::Corrupt(CorruptKind::Truncated));
    }
    let version = u16::from_le_bytes([v[4], v[5]]);
    if version != FORMAT_VERSION {
        return Err(LoadError::UnsupportedVersion(version));
    }
    let flags = u16::from_le_bytes([v[6], v[7]]);
    if flags & !FLAG_MAC != 0 {
        return Err(LoadError::Corrupt(CorruptKind::Malformed));
    }
    let layout_len = u16::from_le_bytes([v[FIXED_HEAD - 2], v[FIXED_HEAD - 1]]) as usize;
    let layout_end = FIXED_HEAD + layout_len;
    let block_size = u32::from_le_bytes([v[8], v[9], v[10], v[11]]);
    if block_size != ns.block_size
        || v[12..44] != ns.model_fingerprint
        || layout_len != ns.kv_layout.len()
    {
        return Err(LoadError::ForeignLayout);
    }
    if v.len() < layout_end + 8 {
        return Err(LoadError::Corrupt(CorruptKind::Truncated));
    }
    if &v[FIXED_HEAD..layout_end] != ns.kv_layout.as_bytes() {
        return Err(LoadError::ForeignLayout);
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&v[layout_end..layout_end + 8]);
    let tags = if flags & FLAG_MAC != 0 { 2 * TAG } else { TAG };
    let total_len = ((layout_end + 8 + tags) as u64)
        .checked_add(u64::from_le_bytes(len8))
        .ok_or(LoadError::Corrupt(CorruptKind::Malformed))?;
    let mut hash = [0u8; 32];
    hash.copy_from_slice(&v[44..76]);
    Ok(ValueHeader {
        hash: BlockHash(hash),
        total_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> TierNamespace {
        TierNamespace {
            model_fingerprint: [7; 32],
            kv_layout: "f16:L2:H1:D4".into(),
            block_size: 16,
        }
    }

    fn h(b: u8) -> BlockHash {
        BlockHash([b; 32])
    }

    #[test]
    fn key_names_prefix_fingerprint_layout_block_size_and_hash() {
        let mut n = ns();
        n.model_fingerprint[0] = 0xab;
        n.kv_layout = "f16:{x} y".into();
        let key = n.redis_key("cachet", &h(0x01));
        let expect = format!(
            "cachet:kv1:ab07070707070707:f16:%7bx%7d%20y:16:{}",
            "01".repeat(32)
        );
        assert_eq!(String::from_utf8(key).unwrap(), expect);
    }

    #[test]
    fn round_trip_unsigned_and_signed() {
        let payload = (0..=255u8).collect::<Vec<_>>();
        let v = encode_value(&ns(), &h(1), &payload, None);
        // 78 fixed + 12 layout + 8 length + 256 payload + 32 checksum
        assert_eq!(v.len(), 78 + 12 + 8 + 256 + 32);
        assert_eq!(v.len(), payload.len() + value_overhead(&ns(), false));
        let got = decode_value(&ns(), &h(1), Bytes::from(v), None).unwrap();
        assert_eq!(&got[..], &payload[..]);

        let s = Secret::new(b"k1");
        let v = encode_value(&ns(), &h(1), &payload, Some(&s));
        assert_eq!(v.len(), 78 + 12 + 8 + 256 + 64);
        let got = decode_value(&ns(), &h(1), Bytes::from(v.clone()), Some(&s)).unwrap();
        assert_eq!(&got[..], &payload[..]);
        // A reader without a secret still checks integrity and accepts it.
        assert!(decode_value(&ns(), &h(1), Bytes::from(v), None).is_ok());
    }

    #[test]
    fn refusals() {
        let s1 = Secret::new(b"secret-one");
        let s2 = Secret::new(b"secret-two");
        let payload = vec![9u8; 1000];
        let good = encode_value(&ns(), &h(1), &payload, Some(&s1));

        // Another secret, or no MAC at all, when this reader has a secret.
        let e = decode_value(&ns(), &h(1), Bytes::from(good.clone()), Some(&s2));
        assert_eq!(e, Err(LoadError::BadSignature));
        let unsigned = encode_value(&ns(), &h(1), &payload, None);
        let e = decode_value(&ns(), &h(1), Bytes::from(unsigned), Some(&s1));
        assert_eq!(e, Err(LoadError::BadSignature));

        // Every truncation is refused, never returned.
        for cut in [0, 3, 10, 78, 90, 98, 500, good.len() - 33, good.len() - 1] {
            let e = decode_value(&ns(), &h(1), Bytes::from(good[..cut].to_vec()), Some(&s1));
            assert_eq!(
                e,
                Err(LoadError::Corrupt(CorruptKind::Truncated)),
                "cut {cut}"
            );
        }
        let mut longer = good.clone();
        longer.push(0);
        let e = decode_value(&ns(), &h(1), Bytes::from(longer), Some(&s1));
        assert_eq!(e, Err(LoadError::Corrupt(CorruptKind::Malformed)));

        // One flipped payload bit.
        let mut flipped = good.clone();
        flipped[200] ^= 1;
        let e = decode_value(&ns(), &h(1), Bytes::from(flipped), Some(&s1));
        assert_eq!(e, Err(LoadError::Corrupt(CorruptKind::Checksum)));

        // Not ours.
        let e = decode_value(&ns(), &h(1), Bytes::from_static(b"hello world"), None);
        assert_eq!(e, Err(LoadError::Corrupt(CorruptKind::BadMagic)));

        // Another layout, block size or model.
        let mut other = ns();
        other.kv_layout = "q8:L2:H1:D4".into();
        let v = encode_value(&other, &h(1), &payload, Some(&s1));
        let e = decode_value(&ns(), &h(1), Bytes::from(v), Some(&s1));
        assert_eq!(e, Err(LoadError::ForeignLayout));
        let mut other = ns();
        other.block_size = 32;
        let v = encode_value(&other, &h(1), &payload, None);
        assert_eq!(
            decode_value(&ns(), &h(1), Bytes::from(v), None),
            Err(LoadError::ForeignLayout)
        );
        let mut other = ns();
        other.model_fingerprint[31] = 0;
        let v = encode_value(&other, &h(1), &payload, None);
        assert_eq!(
            decode_value(&ns(), &h(1), Bytes::from(v), None),
            Err(LoadError::ForeignLayout)
        );

        // A valid, signed value of block 2 under block 1's key.
        let v = encode_value(&ns(), &h(2), &payload, Some(&s1));
        let e = decode_value(&ns(), &h(1), Bytes::from(v), Some(&s1));
        assert_eq!(e, Err(LoadError::Corrupt(CorruptKind::WrongBlock)));

        // A future format version.
        let mut v = encode_value(&ns(), &h(1), &payload, None);
        v[4] = 2;
        assert_eq!(
            decode_value(&ns(), &h(1), Bytes::from(v), None),
            Err(LoadError::UnsupportedVersion(2))
        );
    }

    #[test]
    fn stripping_the_mac_and_fixing_the_checksum_is_refused() {
        let s = Secret::new(b"k");
        let v = encode_value(&ns(), &h(1), b"payload", Some(&s));
        // Clear the MAC flag, drop the MAC, recompute the checksum: intact, but unsigned.
        let mut forged = v[..v.len() - 64].to_vec();
        forged[6] = 0;
        let sum = *blake3::hash(&forged).as_bytes();
        forged.extend_from_slice(&sum);
        assert!(decode_value(&ns(), &h(1), Bytes::from(forged.clone()), None).is_ok());
        assert_eq!(
            decode_value(&ns(), &h(1), Bytes::from(forged), Some(&s)),
            Err(LoadError::BadSignature)
        );
    }

    #[test]
    fn a_header_names_its_block_length_and_namespace() {
        let s = Secret::new(b"k");
        let v = encode_value(&ns(), &h(3), &[5u8; 100], Some(&s));
        let head = &v[..header_len(&ns())];
        // 78 fixed + 12 layout + 8 length, then 100 payload + 32 checksum + 32 MAC.
        assert_eq!(head.len(), 98);
        assert_eq!(
            read_header(&ns(), head),
            Ok(ValueHeader {
                hash: h(3),
                total_len: 98 + 100 + 64
            })
        );
        assert_eq!(
            read_header(&ns(), &v).map(|x| x.total_len),
            Ok(v.len() as u64)
        );
        let mut other = ns();
        other.block_size = 32;
        assert_eq!(read_header(&other, head), Err(LoadError::ForeignLayout));
        other = ns();
        other.kv_layout = "f16:L2:H1:D8".into();
        assert_eq!(read_header(&other, head), Err(LoadError::ForeignLayout));
        assert_eq!(
            read_header(&ns(), &head[..50]),
            Err(LoadError::Corrupt(CorruptKind::Truncated))
        );
        assert_eq!(
            read_header(&ns(), b"GARBAGE!"),
            Err(LoadError::Corrupt(CorruptKind::BadMagic))
        );
    }
}
