//! Publishes a scripted sequence of KV event batches on a ZMQ endpoint, the way a cachet
//! instance would: the e2e test with NVIDIA Dynamo's standalone indexer drives it.
//!
//! ```text
//! publish_script [--endpoint tcp://*:0] [--replay-endpoint tcp://*:0] [--block-size 4]
//!                [--topic T] [--encoding map|array] [--model-fingerprint STR]
//! ```
//!
//! On start it prints one JSON line, `{"endpoint": ..., "replay_endpoint": ...}` (the bound
//! addresses). Then it reads one JSON command per line from stdin; each becomes one batch (a
//! command that changes nothing publishes nothing) and is answered with one line,
//! `{"seq": N | null, "events": K}`:
//!
//! - `{"store": [tokens], "request_id": "r", "session_id": "s"}`: the full blocks of `tokens`
//!   enter the cache. Blocks already cached are not stored again (as the pool: a fill of a
//!   cached hash stores nothing); the rest form one `BlockStored` whose parent is the block
//!   before the first new one.
//! - `{"remove": [tokens], "from_block": K}`: blocks `K..` of `tokens` that are cached leave it
//!   (one `BlockRemoved`).
//! - `{"clear": true}`: every block leaves (`AllBlocksCleared`).
//! - `{"ops": [command, ...]}`: several of the above in one batch.
//! - Any of these may carry `"medium": "CPU"` (default `"GPU"`): the event names that tier.
//! - `{"stats": true}`: answers `{"sent": N, "dropped": N, "replays": N}`, publishes nothing.
//!
//! Hashes are cachet's own chained BLAKE3 block hashes (`cachet_core::hash`), seeded by
//! `--model-fingerprint`, block size and a fixed KV layout name.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, Write};
use std::sync::Arc;

use cachet_core::events::{CacheEvent, EventBatch, EventCause, Medium};
use cachet_core::hash::{hash_block, BlockHash, ExtraKeys, HashSeed};
use cachet_kv_events::{Encoding, KvEventsConfig, PublisherKind, ZmqPublisher};
use serde_json::{json, Value};

struct Pool {
    seed: HashSeed,
    block_size: usize,
    /// What each medium holds.
    cached: HashMap<Medium, HashSet<BlockHash>>,
}

/// cachet's chained hashes of the full blocks of `tokens`.
fn chain(seed: HashSeed, block_size: usize, tokens: &[u32]) -> Vec<BlockHash> {
    let mut parent = seed.0;
    let mut out = Vec::new();
    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
        parent = hash_block(&parent, block, &ExtraKeys::default(), i);
        out.push(parent);
    }
    out
}

impl Pool {
    fn apply(&mut self, cmd: &Value, events: &mut Vec<CacheEvent>) -> Result<(), String> {
        if let Some(ops) = cmd.get("ops").and_then(Value::as_array) {
            for op in ops {
                self.apply(op, events)?;
            }
            return Ok(());
        }
        let medium = match cmd.get("medium").and_then(Value::as_str) {
            None | Some("GPU") => Medium::Gpu,
            Some("CPU") => Medium::Cpu,
            Some(other) => return Err(format!("unknown medium {other}")),
        };
        let cached = self.cached.entry(medium).or_default();
        if let Some(tokens) = cmd.get("store") {
            let tokens = token_list(tokens)?;
            let cause = cmd
                .get("request_id")
                .and_then(Value::as_str)
                .map(|r| EventCause {
                    handle: 0,
                    request_id: Arc::from(r),
                    session_id: cmd.get("session_id").and_then(Value::as_str).map(Arc::from),
                });
            let chain = chain(self.seed, self.block_size, &tokens);
            let Some(first_new) = chain.iter().position(|h| !cached.contains(h)) else {
                return Ok(());
            };
            let hashes = chain[first_new..].to_vec();
            cached.extend(hashes.iter().copied());
            let bs = self.block_size;
            events.push(CacheEvent::Stored {
                parent: first_new.checked_sub(1).map(|i| chain[i]),
                token_ids: tokens[first_new * bs..chain.len() * bs].to_vec(),
                hashes,
                block_size: bs as u32,
                lora_name: None,
                cache_salt: None,
                medium,
                cause,
            });
        } else if let Some(tokens) = cmd.get("remove") {
            let tokens = token_list(tokens)?;
            let from = cmd.get("from_block").and_then(Value::as_u64).unwrap_or(0) as usize;
            let hashes: Vec<BlockHash> = chain(self.seed, self.block_size, &tokens)
                .into_iter()
                .skip(from)
                .filter(|h| cached.remove(h))
                .collect();
            if !hashes.is_empty() {
                events.push(CacheEvent::Removed {
                    hashes,
                    medium,
                    cause: None,
                });
            }
        } else if cmd.get("clear").is_some() {
            cached.clear();
            events.push(CacheEvent::AllCleared { medium });
        } else {
            return Err(format!("unknown command {cmd}"));
        }
        Ok(())
    }
}

fn token_list(v: &Value) -> Result<Vec<u32>, String> {
    v.as_array()
        .ok_or("tokens must be an array")?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("bad token {t}"))
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: PublisherKind::Zmq,
        endpoint: "tcp://*:0".into(),
        replay_endpoint: Some("tcp://*:0".into()),
        ..KvEventsConfig::default()
    };
    let mut block_size = 4usize;
    let mut fingerprint = String::from("publish_script");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--endpoint" => cfg.endpoint = val()?,
            "--replay-endpoint" => cfg.replay_endpoint = Some(val()?),
            "--no-replay" => cfg.replay_endpoint = None,
            "--block-size" => block_size = val()?.parse()?,
            "--topic" => cfg.topic = val()?,
            "--model-fingerprint" => fingerprint = val()?,
            "--encoding" => {
                cfg.encoding = match val()?.as_str() {
                    "map" => Encoding::Map,
                    "array" => Encoding::Array,
                    other => return Err(format!("--encoding: {other}").into()),
                }
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if block_size == 0 {
        return Err("--block-size must be at least 1".into());
    }
    let publisher = ZmqPublisher::start(&cfg)?;
    let fp = *blake3::hash(fingerprint.as_bytes()).as_bytes();
    let mut pool = Pool {
        seed: HashSeed::new(&fp, block_size, "publish_script"),
        block_size,
        cached: HashMap::new(),
    };
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{}",
        json!({"endpoint": publisher.bound_endpoint(), "replay_endpoint": publisher.replay_endpoint()})
    )?;
    out.flush()?;
    let mut next_seq = 0u64;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let cmd: Value = serde_json::from_str(&line)?;
        if cmd.get("stats").is_some() {
            writeln!(
                out,
                "{}",
                json!({"sent": publisher.sent(), "dropped": publisher.dropped(), "replays": publisher.replays()})
            )?;
            out.flush()?;
            continue;
        }
        let mut events = Vec::new();
        pool.apply(&cmd, &mut events)?;
        let n = events.len();
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let reply = if n == 0 {
            json!({"seq": null, "events": 0})
        } else {
            publisher.publish(Arc::new(EventBatch { ts, events }));
            next_seq += 1;
            json!({"seq": next_seq - 1, "events": n})
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}
