//! The replay socket's two protocols, and what a request is answered with.
//!
//! - **Legacy** (vLLM's first replay, what Dynamo's client sends): the request frame is the start
//!   sequence, 8 bytes big-endian; the answer is one `[seq, payload]` message per buffered batch
//!   with `seq >= start`, then `[-1, b""]`.
//! - **Current** (vLLM's msgpack replay): the request frame is a msgpack map
//!   `{"start_seq": int, "publisher_epoch": str | nil, "force_snapshot": bool}` (every key
//!   optional; unknown keys ignored) and the answer is **one** message, a msgpack map:
//!   `{"publisher_epoch": str, "next_seq": int, "replayed_batches": [[seq, batch], ...]}` when the
//!   buffer still holds every batch from `start_seq` on, or
//!   `{"publisher_epoch", "next_seq", "snapshot": batch}` when it does not (or the consumer asked
//!   for one, or knew another epoch: a restarted publisher's numbers start again at 0), where the
//!   snapshot batch is `AllBlocksCleared` then one `BlockStored` per medium with every held hash
//!   ([`crate::held::HeldBlocks::snapshot`]). `batch` is the batch as the PUB socket sends it
//!   (`[ts, events, data_parallel_rank]`), inline. After applying the answer the consumer
//!   continues with live batch `next_seq`. A snapshot that cannot be exact (a batch was dropped
//!   since the last full clear) is answered with `"error"` instead of `"snapshot"`; a request
//!   that is not a map is answered with `"error"` alone beside the epoch and `next_seq`.

use std::collections::VecDeque;

use bytes::Bytes;

/// A parsed replay request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayRequest {
    /// The 8-byte start sequence.
    Legacy { start_seq: u64 },
    /// The msgpack map.
    Current {
        start_seq: u64,
        publisher_epoch: Option<String>,
        force_snapshot: bool,
    },
}

/// Parses a request frame: 8 bytes is the legacy form, anything else must be a msgpack map.
pub fn parse_request(frame: &[u8]) -> Result<ReplayRequest, String> {
    if let Ok(b) = <[u8; 8]>::try_from(frame) {
        return Ok(ReplayRequest::Legacy {
            start_seq: u64::from_be_bytes(b),
        });
    }
    let mut r = frame;
    let value = rmpv::decode::read_value(&mut r).map_err(|e| format!("not msgpack: {e}"))?;
    let map = value
        .as_map()
        .ok_or_else(|| "a replay request is a msgpack map".to_string())?;
    let mut start_seq = 0;
    let mut publisher_epoch = None;
    let mut force_snapshot = false;
    for (k, v) in map {
        match k.as_str() {
            Some("start_seq") => {
                start_seq = v
                    .as_u64()
                    .ok_or_else(|| "start_seq must be a non-negative integer".to_string())?;
            }
            Some("publisher_epoch") => {
                publisher_epoch = match v {
                    rmpv::Value::Nil => None,
                    v => Some(
                        v.as_str()
                            .ok_or_else(|| "publisher_epoch must be a string".to_string())?
                            .to_string(),
                    ),
                };
            }
            Some("force_snapshot") => {
                force_snapshot = v
                    .as_bool()
                    .ok_or_else(|| "force_snapshot must be a boolean".to_string())?;
            }
            _ => {}
        }
    }
    Ok(ReplayRequest::Current {
        start_seq,
        publisher_epoch,
        force_snapshot,
    })
}

/// What a current request gets.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// The buffer holds every batch from the start on: replay them.
    Replay,
    /// A snapshot instead.
    Snapshot,
}

/// Whether `buffer` (increasing sequence numbers; gaps where batches were dropped) can replay
/// every batch from `start_seq` up to `next_seq` (exclusive) to a consumer that knew `epoch`.
pub fn answer_for(
    request_epoch: Option<&str>,
    force_snapshot: bool,
    start_seq: u64,
    our_epoch: &str,
    next_seq: u64,
    buffer: &VecDeque<(u64, Bytes)>,
) -> Answer {
    if force_snapshot || request_epoch.is_some_and(|e| e != our_epoch) {
        return Answer::Snapshot;
    }
    if start_seq >= next_seq {
        return Answer::Replay;
    }
    let held = buffer.iter().filter(|(s, _)| *s >= start_seq).count() as u64;
    if held == next_seq - start_seq {
        Answer::Replay
    } else {
        Answer::Snapshot
    }
}

fn header(out: &mut Vec<u8>, entries: u32, epoch: &str, next_seq: u64) {
    let _ = rmp::encode::write_map_len(out, entries);
    let _ = rmp::encode::write_str(out, "publisher_epoch");
    let _ = rmp::encode::write_str(out, epoch);
    let _ = rmp::encode::write_str(out, "next_seq");
    let _ = rmp::encode::write_uint(out, next_seq);
}

/// `{"publisher_epoch", "next_seq", "replayed_batches": [[seq, batch], ...]}` with the buffered
/// batches from `start_seq` on (their encoded payloads spliced in as they are).
pub fn encode_replayed(
    epoch: &str,
    next_seq: u64,
    start_seq: u64,
    buffer: &VecDeque<(u64, Bytes)>,
) -> Vec<u8> {
    let batches: Vec<&(u64, Bytes)> = buffer.iter().filter(|(s, _)| *s >= start_seq).collect();
    let mut out = Vec::with_capacity(64 + batches.iter().map(|(_, p)| p.len() + 10).sum::<usize>());
    header(&mut out, 3, epoch, next_seq);
    let _ = rmp::encode::write_str(&mut out, "replayed_batches");
    let _ = rmp::encode::write_array_len(&mut out, batches.len() as u32);
    for (seq, payload) in batches {
        let _ = rmp::encode::write_array_len(&mut out, 2);
        let _ = rmp::encode::write_uint(&mut out, *seq);
        out.extend_from_slice(payload);
    }
    out
}

/// `{"publisher_epoch", "next_seq", "snapshot": batch}` with the encoded snapshot batch.
pub fn encode_snapshot(epoch: &str, next_seq: u64, batch: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + batch.len());
    header(&mut out, 3, epoch, next_seq);
    let _ = rmp::encode::write_str(&mut out, "snapshot");
    out.extend_from_slice(batch);
    out
}

/// `{"publisher_epoch", "next_seq", "error": message}`.
pub fn encode_error(epoch: &str, next_seq: u64, message: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + message.len());
    header(&mut out, 3, epoch, next_seq);
    let _ = rmp::encode::write_str(&mut out, "error");
    let _ = rmp::encode::write_str(&mut out, message);
    out
}

/// A publisher epoch: 128 random bits as 32 hex digits, new at every start (the standard
/// library's per-process random hash keys, mixed with the time and the process id).
pub fn new_epoch() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut words = [0u64; 2];
    for (i, w) in words.iter_mut().enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        h.write_usize(i);
        *w = h.finish();
    }
    format!("{:016x}{:016x}", words[0], words[1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn request(entries: Vec<(&str, Value)>) -> Vec<u8> {
        let map = Value::Map(
            entries
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        );
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &map).unwrap();
        out
    }

    fn buffer(seqs: &[u64]) -> VecDeque<(u64, Bytes)> {
        seqs.iter()
            .map(|&s| (s, Bytes::from(vec![s as u8])))
            .collect()
    }

    #[test]
    fn eight_bytes_are_the_legacy_request_and_a_map_the_current_one() {
        assert_eq!(
            parse_request(&7u64.to_be_bytes()),
            Ok(ReplayRequest::Legacy { start_seq: 7 })
        );
        let r = request(vec![
            ("start_seq", Value::from(12)),
            ("publisher_epoch", Value::from("abc")),
            ("force_snapshot", Value::from(true)),
            ("something_new", Value::from(1)),
        ]);
        assert_eq!(
            parse_request(&r),
            Ok(ReplayRequest::Current {
                start_seq: 12,
                publisher_epoch: Some("abc".into()),
                force_snapshot: true
            })
        );
        let r = request(vec![("publisher_epoch", Value::Nil)]);
        assert_eq!(
            parse_request(&r),
            Ok(ReplayRequest::Current {
                start_seq: 0,
                publisher_epoch: None,
                force_snapshot: false
            })
        );
        assert!(parse_request(&request(vec![("start_seq", Value::from(-1))])).is_err());
        assert!(parse_request(&request(vec![("force_snapshot", Value::from(1))])).is_err());
        assert!(parse_request(b"\x93\x01\x02\x03").is_err());
        assert!(parse_request(b"\xc1").is_err());
    }

    #[test]
    fn a_snapshot_when_the_buffer_no_longer_reaches_back_or_the_epoch_changed() {
        let b = buffer(&[5, 6, 7]);
        // Everything from 5 (or later) is held: replay.
        assert_eq!(answer_for(None, false, 5, "e", 8, &b), Answer::Replay);
        assert_eq!(answer_for(Some("e"), false, 7, "e", 8, &b), Answer::Replay);
        assert_eq!(answer_for(None, false, 8, "e", 8, &b), Answer::Replay);
        // Batch 4 is gone.
        assert_eq!(answer_for(None, false, 4, "e", 8, &b), Answer::Snapshot);
        // Another epoch's numbers, or asked for.
        assert_eq!(
            answer_for(Some("old"), false, 5, "e", 8, &b),
            Answer::Snapshot
        );
        assert_eq!(answer_for(None, true, 5, "e", 8, &b), Answer::Snapshot);
        // A dropped batch (6) left a gap.
        let g = buffer(&[5, 7]);
        assert_eq!(answer_for(None, false, 5, "e", 8, &g), Answer::Snapshot);
        assert_eq!(answer_for(None, false, 7, "e", 8, &g), Answer::Replay);
    }

    #[test]
    fn responses_are_one_msgpack_map_with_the_batches_inline() {
        let b = buffer(&[5, 6, 7]);
        let bytes = encode_replayed("ep", 8, 6, &b);
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let m: Vec<(String, Value)> = v
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().to_string(), v.clone()))
            .collect();
        assert_eq!(m[0], ("publisher_epoch".into(), Value::from("ep")));
        assert_eq!(m[1], ("next_seq".into(), Value::from(8)));
        // Each payload (here a one-byte msgpack integer, the batch's seq) spliced in as it is.
        assert_eq!(
            m[2],
            (
                "replayed_batches".into(),
                Value::Array(vec![
                    Value::Array(vec![6.into(), 6.into()]),
                    Value::Array(vec![7.into(), 7.into()]),
                ])
            )
        );
        assert_eq!(m.len(), 3);

        let snap = encode_snapshot("ep", 3, &[0x93, 0x00, 0x90, 0x00]);
        let v = rmpv::decode::read_value(&mut &snap[..]).unwrap();
        assert_eq!(
            v["snapshot"],
            Value::Array(vec![0.into(), Value::Array(vec![]), 0.into()])
        );
        assert_eq!(v["next_seq"], Value::from(3));
        let err = encode_error("ep", 3, "no");
        let v = rmpv::decode::read_value(&mut &err[..]).unwrap();
        assert_eq!(v["error"], Value::from("no"));
    }

    #[test]
    fn epochs_differ_between_starts() {
        let (a, b) = (new_epoch(), new_epoch());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}
