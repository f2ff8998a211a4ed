//! The msgpack encoding of an [`EventBatch`], as vLLM's `ZmqEventPublisher` writes it.
//!
//! A batch is the 3-element array `[ts, events, data_parallel_rank]` (vLLM's `EventBatch` is an
//! `array_like` msgspec struct). Each event is, by default, a map whose first key is `type`
//! (msgspec's `tag=True` map form, which vLLM switched to from positional arrays):
//!
//! | `type` | keys, in this order |
//! |---|---|
//! | `BlockStored` | `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, `extra_keys`, `group_idx`, `request_id`, `session_id` |
//! | `BlockRemoved` | `block_hashes`, `medium`, `group_idx`, `request_id`, `session_id` |
//! | `AllBlocksCleared` | (`medium`, only when it is not `"GPU"`) |
//!
//! `request_id` and `session_id` are cachet's additions (nil when no request caused the event);
//! consumers that decode by key ignore them. Hashes are [`wire_hash`]: the low 64 bits of the
//! block hash, as vLLM's `maybe_convert_block_hash` turns its hashes into integers. `lora_id` is
//! always nil (cachet names adapters, it does not number them), `extra_keys` is one nil per block
//! (cachet's salt is already in block 0's hash) and `group_idx` is 0 (one KV cache group).
//!
//! [`Encoding::Array`] writes the older positional form instead, as vLLM's msgspec structs with
//! `array_like=True, tag=True` did: `["BlockStored", block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
//! `["AllBlocksCleared"]`. It carries no field a positional consumer does not expect, so it
//! has no `request_id`/`session_id`.
//!
//! Integers are written in their shortest msgpack form and the timestamp as a float64, which is
//! what msgspec writes: the bytes are the bytes vLLM would send for the same events.

use cachet_core::events::{wire_hash, CacheEvent, EventBatch, EventCause, Medium};
use serde::{Deserialize, Serialize};

/// How events are laid out inside a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Tagged maps (vLLM's current form).
    #[default]
    Map,
    /// Tagged positional arrays (vLLM's form before the switch to maps).
    Array,
}

/// The sequence number frame of the end-of-replay marker: -1 as 8 big-endian bytes.
pub const END_OF_REPLAY_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// The sequence number frame of batch `seq`: 8 bytes, big-endian.
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Encodes one batch as vLLM does: `[ts, events, data_parallel_rank]`.
pub fn encode_batch(batch: &EventBatch, encoding: Encoding, data_parallel_rank: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 96);
    // Writes into a Vec cannot fail; the `Result`s of rmp's writers are for fallible sinks.
    let w = &mut out;
    let _ = rmp::encode::write_array_len(w, 3);
    let _ = rmp::encode::write_f64(w, batch.ts);
    let _ = rmp::encode::write_array_len(w, len_u32(batch.events.len()));
    for event in &batch.events {
        match encoding {
            Encoding::Map => write_event_map(w, event),
            Encoding::Array => write_event_array(w, event),
        }
    }
    let _ = rmp::encode::write_uint(w, u64::from(data_parallel_rank));
    out
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn write_str(w: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(w, s);
}

fn write_nil(w: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(w);
}

fn write_opt_str(w: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => write_str(w, s),
        None => write_nil(w),
    }
}

fn write_uint(w: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(w, v);
}

fn write_hashes(w: &mut Vec<u8>, hashes: &[cachet_core::hash::BlockHash]) {
    let _ = rmp::encode::write_array_len(w, len_u32(hashes.len()));
    for h in hashes {
        write_uint(w, wire_hash(h));
    }
}

fn write_tokens(w: &mut Vec<u8>, tokens: &[cachet_core::TokenId]) {
    let _ = rmp::encode::write_array_len(w, len_u32(tokens.len()));
    for &t in tokens {
        write_uint(w, u64::from(t));
    }
}

fn write_cause(w: &mut Vec<u8>, cause: Option<&EventCause>) {
    write_str(w, "request_id");
    write_opt_str(w, cause.map(|c| &*c.request_id));
    write_str(w, "session_id");
    write_opt_str(w, cause.and_then(|c| c.session_id.as_deref()));
}

fn write_event_map(w: &mut Vec<u8>, event: &CacheEvent) {
    match event {
        CacheEvent::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            cache_salt,
            medium,
            cause,
        } => {
            // `cache_salt` (as vLLM's router-facing field) only when the request had one.
            let _ = rmp::encode::write_map_len(w, 12 + u32::from(cache_salt.is_some()));
            write_str(w, "type");
            write_str(w, "BlockStored");
            write_str(w, "block_hashes");
            write_hashes(w, hashes);
            write_str(w, "parent_block_hash");
            match parent {
                Some(p) => write_uint(w, wire_hash(p)),
                None => write_nil(w),
            }
            write_str(w, "token_ids");
            write_tokens(w, token_ids);
            write_str(w, "block_size");
            write_uint(w, u64::from(*block_size));
            write_str(w, "lora_id");
            write_nil(w);
            write_str(w, "medium");
            write_str(w, medium.as_str());
            write_str(w, "lora_name");
            write_opt_str(w, lora_name.as_deref());
            write_str(w, "extra_keys");
            let _ = rmp::encode::write_array_len(w, len_u32(hashes.len()));
            for _ in hashes {
                write_nil(w);
            }
            write_str(w, "group_idx");
            write_uint(w, 0);
            if let Some(salt) = cache_salt {
                write_str(w, "cache_salt");
                write_str(w, salt);
            }
            write_cause(w, cause.as_ref());
        }
        CacheEvent::Removed {
            hashes,
            medium,
            cause,
        } => {
            let _ = rmp::encode::write_map_len(w, 6);
            write_str(w, "type");
            write_str(w, "BlockRemoved");
            write_str(w, "block_hashes");
            write_hashes(w, hashes);
            write_str(w, "medium");
            write_str(w, medium.as_str());
            write_str(w, "group_idx");
            write_uint(w, 0);
            write_cause(w, cause.as_ref());
        }
        CacheEvent::AllCleared { medium } => {
            if *medium == Medium::Gpu {
                let _ = rmp::encode::write_map_len(w, 1);
            } else {
                let _ = rmp::encode::write_map_len(w, 2);
            }
            write_str(w, "type");
            write_str(w, "AllBlocksCleared");
            if *medium != Medium::Gpu {
                write_str(w, "medium");
                write_str(w, medium.as_str());
            }
        }
    }
}

fn write_event_array(w: &mut Vec<u8>, event: &CacheEvent) {
    match event {
        CacheEvent::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            medium,
            ..
        } => {
            let _ = rmp::encode::write_array_len(w, 8);
            write_str(w, "BlockStored");
            write_hashes(w, hashes);
            match parent {
                Some(p) => write_uint(w, wire_hash(p)),
                None => write_nil(w),
            }
            write_tokens(w, token_ids);
            write_uint(w, u64::from(*block_size));
            write_nil(w); // lora_id
            write_str(w, medium.as_str());
            write_opt_str(w, lora_name.as_deref());
        }
        CacheEvent::Removed { hashes, medium, .. } => {
            let _ = rmp::encode::write_array_len(w, 3);
            write_str(w, "BlockRemoved");
            write_hashes(w, hashes);
            write_str(w, medium.as_str());
        }
        CacheEvent::AllCleared { .. } => {
            let _ = rmp::encode::write_array_len(w, 1);
            write_str(w, "AllBlocksCleared");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_core::hash::BlockHash;
    use std::sync::Arc;

    fn h(low: u64) -> BlockHash {
        let mut b = [0xaau8; 32];
        b[24..].copy_from_slice(&low.to_be_bytes());
        BlockHash(b)
    }

    #[test]
    fn empty_batch_is_a_three_element_array() {
        let b = EventBatch {
            ts: 1.5,
            events: vec![],
        };
        // 0x93 = array(3); 0xcb + 1.5 as f64 BE; 0x90 = array(0); 0x00 = dp rank 0.
        let expected = [0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90, 0x00];
        assert_eq!(encode_batch(&b, Encoding::Map, 0), expected);
        assert_eq!(encode_batch(&b, Encoding::Array, 0), expected);
        // dp rank 300 needs uint16 (0xcd 0x01 0x2c).
        assert_eq!(
            &encode_batch(&b, Encoding::Map, 300)[11..],
            &[0xcd, 0x01, 0x2c]
        );
    }

    #[test]
    fn stored_map_bytes() {
        let b = EventBatch {
            ts: 0.0,
            events: vec![CacheEvent::Stored {
                hashes: vec![h(5)],
                parent: Some(h(0xffff_ffff_ffff_ffff)),
                token_ids: vec![1, 200],
                block_size: 2,
                lora_name: None,
                cache_salt: None,
                medium: Medium::Gpu,
                cause: Some(EventCause {
                    handle: 9,
                    request_id: Arc::from("r"),
                    session_id: None,
                }),
            }],
        };
        let mut e: Vec<u8> = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x8c];
        e.extend([0xa4]);
        e.extend(b"type");
        e.extend([0xab]);
        e.extend(b"BlockStored");
        e.extend([0xac]);
        e.extend(b"block_hashes");
        e.extend([0x91, 0x05]);
        e.extend([0xb1]);
        e.extend(b"parent_block_hash");
        e.extend([0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        e.extend([0xa9]);
        e.extend(b"token_ids");
        e.extend([0x92, 0x01, 0xcc, 0xc8]);
        e.extend([0xaa]);
        e.extend(b"block_size");
        e.extend([0x02]);
        e.extend([0xa7]);
        e.extend(b"lora_id");
        e.extend([0xc0]);
        e.extend([0xa6]);
        e.extend(b"medium");
        e.extend([0xa3]);
        e.extend(b"GPU");
        e.extend([0xa9]);
        e.extend(b"lora_name");
        e.extend([0xc0]);
        e.extend([0xaa]);
        e.extend(b"extra_keys");
        e.extend([0x91, 0xc0]);
        e.extend([0xa9]);
        e.extend(b"group_idx");
        e.extend([0x00]);
        e.extend([0xaa]);
        e.extend(b"request_id");
        e.extend([0xa1, b'r']);
        e.extend([0xaa]);
        e.extend(b"session_id");
        e.extend([0xc0]);
        e.extend([0x00]);
        assert_eq!(encode_batch(&b, Encoding::Map, 0), e);
    }

    #[test]
    fn array_form_bytes() {
        let b = EventBatch {
            ts: 0.0,
            events: vec![
                CacheEvent::Stored {
                    hashes: vec![h(1), h(2)],
                    parent: None,
                    token_ids: vec![7, 8],
                    block_size: 1,
                    lora_name: Some("ad".into()),
                    cache_salt: None,
                    medium: Medium::Gpu,
                    cause: None,
                },
                CacheEvent::Removed {
                    hashes: vec![h(1)],
                    medium: Medium::Cpu,
                    cause: None,
                },
                CacheEvent::AllCleared {
                    medium: Medium::Gpu,
                },
            ],
        };
        let mut e: Vec<u8> = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x93];
        e.extend([0x98, 0xab]);
        e.extend(b"BlockStored");
        e.extend([0x92, 0x01, 0x02, 0xc0, 0x92, 0x07, 0x08, 0x01, 0xc0, 0xa3]);
        e.extend(b"GPU");
        e.extend([0xa2]);
        e.extend(b"ad");
        e.extend([0x93, 0xac]);
        e.extend(b"BlockRemoved");
        e.extend([0x91, 0x01, 0xa3]);
        e.extend(b"CPU");
        e.extend([0x91, 0xb0]);
        e.extend(b"AllBlocksCleared");
        e.extend([0x00]);
        assert_eq!(encode_batch(&b, Encoding::Array, 0), e);
    }

    #[test]
    fn clear_of_another_medium_names_it() {
        let b = EventBatch {
            ts: 0.0,
            events: vec![CacheEvent::AllCleared {
                medium: Medium::Cpu,
            }],
        };
        let mut e: Vec<u8> = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x82, 0xa4];
        e.extend(b"type");
        e.extend([0xb0]);
        e.extend(b"AllBlocksCleared");
        e.extend([0xa6]);
        e.extend(b"medium");
        e.extend([0xa3]);
        e.extend(b"CPU");
        e.extend([0x00]);
        assert_eq!(encode_batch(&b, Encoding::Map, 0), e);
    }

    #[test]
    fn frames() {
        assert_eq!(seq_frame(0), [0; 8]);
        assert_eq!(seq_frame(258), [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(END_OF_REPLAY_SEQ, [0xff; 8]);
    }
}
