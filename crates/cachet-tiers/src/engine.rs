//! [`EngineTier`]: a [`TierClient`] as the engine's [`KvTier`] (`cachet-engine/src/tier.rs`).
//!
//! The mapping: `lookup` → [`KvLookup`] (the length of the leading run the tiers hold);
//! `start_load(LoadTicket { slot, handle }, ..)` → [`TierClient::start_load`] with the handle as
//! the ticket and the slot kept beside it until the load comes back; [`TierKind`] →
//! [`TierTag`]; [`crate::LoadError`] → [`LoadFailure`] (its message);
//! [`SaveReason::Evicted`] → [`SaveTarget::Host`] (a block leaving the local pool goes to the
//! host LRU) and [`SaveReason::Filled`] → [`SaveTarget::Redis`] (a new cache entry is published
//! to the instances sharing the Redis), and also → [`SaveTarget::Host`] with
//! `--kv-tier-host-save filled` (write-through: the host tier then already holds what the
//! pool evicts, and the eviction copies nothing); [`KvTier::saves_on`] asks only for the saves a
//! configured tier takes, and [`KvTier::wants_save`] says no for a block the tier already
//! holds (the host LRU has it, or this instance loaded or stored it in Redis recently), so the
//! engine does not copy it out for nothing.
//!
//! The disk tier takes every fill (so a restart finds what was computed) and the evictions it
//! lacks; [`SaveReason::Shutdown`] (`--kv-tier-disk-save-on-shutdown`) goes to it alone, and
//! those saves wait for queue room up to [`SHUTDOWN_SAVE_LIMIT`] instead of dropping.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cachet_core::sessions::SessionRecord;
use cachet_core::tier::{KvLookup, TierTag};
use cachet_core::BlockHash;
use cachet_engine::tier::{self, KvTier, LoadFailure, LoadTicket, SaveOn, SaveReason};

use crate::{HostSave, Payload, SaveTarget, TierClient, TierKind};

/// The engine's view of a [`TierClient`]. Owned by the engine's core thread; the client it
/// wraps is a clone of the one the binary keeps for metrics and shutdown.
pub struct EngineTier {
    client: TierClient,
    /// Loads in flight: handle (the client's ticket) → slot.
    slots: HashMap<u64, u32>,
    /// Set by the first shutdown save: when the shutdown's saves stop waiting for queue room.
    shutdown_deadline: Option<Instant>,
}

/// How long the shutdown's saves (`--kv-tier-disk-save-on-shutdown`) may wait for room in the
/// disk queue, in all; the binary then waits as long again for the queue to reach the disk.
pub const SHUTDOWN_SAVE_LIMIT: Duration = Duration::from_secs(10);

impl EngineTier {
    pub fn new(client: TierClient) -> Self {
        EngineTier {
            client,
            slots: HashMap::new(),
            shutdown_deadline: None,
        }
    }

    pub fn client(&self) -> &TierClient {
        &self.client
    }
}

/// Which engine tag a tier kind becomes.
pub fn tag(kind: TierKind) -> TierTag {
    match kind {
        TierKind::Host => TierTag::Host,
        TierKind::Redis => TierTag::Redis,
        TierKind::Disk => TierTag::Disk,
    }
}

/// Where a save of this reason goes: evictions to the host tier and the disk (which has them
/// already unless a save was dropped); fills to the disk and Redis, and to the host tier too
/// when it saves on fill; the shutdown's saves to the disk alone.
pub fn targets(reason: SaveReason, host_save: HostSave) -> &'static [SaveTarget] {
    match (reason, host_save) {
        (SaveReason::Evicted, _) => &[SaveTarget::Host, SaveTarget::Disk],
        (SaveReason::Filled, HostSave::Evicted) => &[SaveTarget::Disk, SaveTarget::Redis],
        (SaveReason::Filled, HostSave::Filled) => {
            &[SaveTarget::Host, SaveTarget::Disk, SaveTarget::Redis]
        }
        (SaveReason::Shutdown, _) => &[SaveTarget::Disk],
    }
}

impl EngineTier {
    /// The configured tiers a save of this reason goes to ([`targets`], less the tiers this
    /// client lacks): the one place `save`, `wants_save` and `saves_on` take them from.
    fn configured(&self, reason: SaveReason) -> impl Iterator<Item = SaveTarget> + '_ {
        targets(reason, self.client.host_save())
            .iter()
            .copied()
            .filter(|t| self.client.has(t.kind()))
    }
}

impl KvLookup for EngineTier {
    fn lookup(&mut self, hashes: &[BlockHash]) -> usize {
        self.client.lookup(hashes).len()
    }
}

impl KvTier for EngineTier {
    fn start_load(&mut self, ticket: LoadTicket, hashes: Vec<BlockHash>) {
        self.slots.insert(ticket.handle, ticket.slot);
        self.client.start_load(ticket.handle, hashes);
    }

    fn poll_loads(&mut self) -> Vec<tier::LoadDone> {
        self.client
            .poll()
            .into_iter()
            .filter_map(|done| {
                let slot = self.slots.remove(&done.ticket)?;
                Some(tier::LoadDone {
                    ticket: LoadTicket {
                        slot,
                        handle: done.ticket,
                    },
                    blocks: done
                        .results
                        .into_iter()
                        .map(|r| {
                            r.map(|(p, k)| (p, tag(k)))
                                .map_err(|e| LoadFailure(e.to_string()))
                        })
                        .collect(),
                })
            })
            .collect()
    }

    fn save(&mut self, hash: BlockHash, payload: Payload, reason: SaveReason) {
        if reason == SaveReason::Shutdown {
            // The engine is stopping: wait for room in the disk queue (bounded), not drop.
            let deadline = *self
                .shutdown_deadline
                .get_or_insert_with(|| Instant::now() + SHUTDOWN_SAVE_LIMIT);
            let _ = self.client.save_disk_until(hash, payload, deadline);
            return;
        }
        // A full queue or an oversized block is counted by the client; the engine never waits.
        // The payload is shared between targets, not copied.
        for t in self.configured(reason) {
            let _ = self.client.save(hash, payload.clone(), t);
        }
    }

    fn wants_save(&mut self, hash: &BlockHash, reason: SaveReason) -> bool {
        // Wanted when some configured target lacks it. Every target is asked (no short
        // circuit), so each counts its own skip and the host's copy becomes most recently used.
        let mut wanted = false;
        for t in self.configured(reason) {
            wanted |= !self.client.skip_save(hash, t);
        }
        wanted
    }

    fn take_buffer(&mut self, len: usize) -> Vec<u8> {
        self.client.take_buffer(len)
    }

    fn saves_on_shutdown(&self) -> bool {
        self.client.disk_saves_on_shutdown()
    }

    fn saved_sessions(&mut self) -> Vec<SessionRecord> {
        self.client.saved_sessions()
    }

    fn save_sessions(&mut self, records: Vec<SessionRecord>) {
        self.client.save_sessions(records);
    }

    fn saves_on(&self) -> SaveOn {
        SaveOn {
            evicted: self.configured(SaveReason::Evicted).next().is_some(),
            filled: self.configured(SaveReason::Filled).next().is_some(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HostConfig, HostSave};
    use crate::{TierConfig, TierNamespace};

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn host_tier() -> EngineTier {
        host_tier_saving(HostSave::Evicted)
    }

    fn host_tier_saving(save: HostSave) -> EngineTier {
        EngineTier::new(
            TierClient::open(TierConfig {
                disk: None,
                namespace: TierNamespace {
                    model_fingerprint: [7; 32],
                    kv_layout: "sim:u64".into(),
                    block_size: 16,
                },
                spare_bytes: crate::DEFAULT_SPARE_BYTES,
                host: Some(HostConfig {
                    capacity_bytes: 1 << 20,
                    save,
                }),
                redis: None,
            })
            .unwrap(),
        )
    }

    #[test]
    fn host_only_takes_evictions_and_answers_loads_with_the_slot() {
        let mut t = host_tier();
        assert_eq!(
            t.saves_on(),
            SaveOn {
                evicted: true,
                filled: false
            }
        );
        t.save(h(1), Payload::from(vec![1u8; 128]), SaveReason::Evicted);
        t.save(h(2), Payload::from(vec![2u8; 128]), SaveReason::Evicted);
        // Filled goes to Redis, which is not configured: nothing stored.
        t.save(h(3), Payload::from(vec![3u8; 128]), SaveReason::Filled);
        assert_eq!(t.lookup(&[h(1), h(2), h(3)]), 2);
        assert_eq!(t.client().stats().host.blocks_saved, 2);

        t.start_load(
            LoadTicket {
                slot: 5,
                handle: 77,
            },
            vec![h(2), h(3)],
        );
        let done = t.poll_loads();
        assert_eq!(done.len(), 1);
        assert_eq!(
            done[0].ticket,
            LoadTicket {
                slot: 5,
                handle: 77
            }
        );
        let (p, tag) = done[0].blocks[0].as_ref().unwrap();
        assert_eq!((p.len(), p[0], *tag), (128, 2, TierTag::Host));
        assert_eq!(
            done[0].blocks[1],
            Err(LoadFailure("block not in any tier".into()))
        );
        assert!(t.poll_loads().is_empty());
    }

    #[test]
    fn a_block_the_host_tier_holds_is_not_copied_again() {
        let mut t = host_tier();
        assert!(t.wants_save(&h(1), SaveReason::Evicted));
        t.save(h(1), Payload::from(vec![1u8; 64]), SaveReason::Evicted);
        t.save(h(2), Payload::from(vec![2u8; 64]), SaveReason::Evicted);
        assert!(!t.wants_save(&h(1), SaveReason::Evicted));
        assert_eq!(t.client().stats().save_dedup_skips, 1);
        // A fill goes to Redis alone, which is not configured: no target wants it, and
        // nothing is counted as skipped.
        assert!(!t.wants_save(&h(1), SaveReason::Filled));
        assert_eq!(t.client().stats().save_dedup_skips, 1);
        // The skipped save still counts as use: h(1) is now more recent than h(2).
        let c = t.client();
        // 64 + 64 + 15 * 65,536 + 65,409 = 1 MiB + 1: exactly one eviction, the LRU block.
        for i in 3..=17u8 {
            c.save(h(i), Payload::from(vec![i; 65_536]), SaveTarget::Host);
        }
        c.save(h(18), Payload::from(vec![18; 65_409]), SaveTarget::Host);
        assert_eq!(c.stats().host_evictions, 1);
        assert_eq!(c.lookup(&[h(1)]).len(), 1, "h(1) kept");
        assert_eq!(c.lookup(&[h(2)]).len(), 0, "h(2) evicted first");
    }

    /// `--kv-tier-host-save filled`: fills are saved into the host tier (write-through), so
    /// the later eviction of a block it holds copies nothing and only refreshes it; a block
    /// the tier lost in between is copied on eviction as before.
    #[test]
    fn a_host_tier_saving_on_fill_makes_evictions_free() {
        let mut t = host_tier_saving(HostSave::Filled);
        assert_eq!(
            t.saves_on(),
            SaveOn {
                evicted: true,
                filled: true
            }
        );
        assert!(t.wants_save(&h(1), SaveReason::Filled));
        t.save(h(1), Payload::from(vec![1u8; 128]), SaveReason::Filled);
        t.save(h(2), Payload::from(vec![2u8; 128]), SaveReason::Filled);
        assert_eq!(t.lookup(&[h(1), h(2)]), 2);
        assert_eq!(t.client().stats().host.blocks_saved, 2);
        // Filled again (recomputed elsewhere in the pool): already held, no copy.
        assert!(!t.wants_save(&h(2), SaveReason::Filled));
        // Evicted later: held, so no copy; each skip counted once.
        assert!(!t.wants_save(&h(1), SaveReason::Evicted));
        assert_eq!(t.client().stats().save_dedup_skips, 2);
        assert!(t.wants_save(&h(3), SaveReason::Evicted));
        t.save(h(3), Payload::from(vec![3u8; 128]), SaveReason::Evicted);
        assert_eq!(t.lookup(&[h(3)]), 1);
        assert_eq!(t.client().stats().host.blocks_saved, 3);
    }
}
