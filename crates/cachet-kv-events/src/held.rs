//! `HeldBlocks`: what the published event stream says is held, so that a replay request whose
//! start the buffer no longer reaches gets a snapshot instead (vLLM's replay protocol).
//!
//! Built from the events themselves on the publisher thread, after each batch is sent: a
//! `BlockStored` adds its hashes, a `BlockRemoved` drops them, an `AllBlocksCleared` empties its
//! medium. The events reproduce the pool's cache map exactly (ARCHITECTURE invariant 9), so this
//! is the cache map as of the last batch sent — unless a batch was dropped (queue full) and never
//! reached this thread: then the set is marked incomplete until a clear of every medium it
//! holds makes it exact again, and no snapshot is served from it meanwhile.

use std::collections::HashMap;

use cachet_core::events::{CacheEvent, EventBatch, Medium};
use cachet_core::hash::BlockHash;
use cachet_core::TokenId;

const MEDIA: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::External];

fn index(m: Medium) -> usize {
    match m {
        Medium::Gpu => 0,
        Medium::Cpu => 1,
        Medium::External => 2,
    }
}

/// One held block: when it was stored (snapshots list blocks in that order, so a parent comes
/// before its children) and its tokens (empty when its event carried none).
struct Held {
    order: u64,
    tokens: Vec<TokenId>,
}

#[derive(Default)]
struct MediumSet {
    blocks: HashMap<BlockHash, Held>,
    block_size: u32,
}

/// The held blocks of each medium, and whether the set is known to be exact.
#[derive(Default)]
pub struct HeldBlocks {
    media: [MediumSet; 3],
    next_order: u64,
    incomplete: bool,
}

impl HeldBlocks {
    /// Applies one published batch.
    pub fn apply(&mut self, batch: &EventBatch) {
        for e in &batch.events {
            match e {
                CacheEvent::Stored {
                    hashes,
                    token_ids,
                    block_size,
                    medium,
                    ..
                } => {
                    let set = &mut self.media[index(*medium)];
                    set.block_size = *block_size;
                    let bs = *block_size as usize;
                    let per_block = token_ids.len() == hashes.len() * bs;
                    for (i, h) in hashes.iter().enumerate() {
                        let tokens = if per_block {
                            token_ids[i * bs..(i + 1) * bs].to_vec()
                        } else {
                            Vec::new()
                        };
                        let order = self.next_order;
                        self.next_order += 1;
                        set.blocks.entry(*h).or_insert(Held { order, tokens });
                    }
                }
                CacheEvent::Removed { hashes, medium, .. } => {
                    let set = &mut self.media[index(*medium)];
                    for h in hashes {
                        set.blocks.remove(h);
                    }
                }
                CacheEvent::AllCleared { medium } => {
                    self.media[index(*medium)].blocks.clear();
                    if self.media.iter().all(|s| s.blocks.is_empty()) {
                        self.incomplete = false;
                    }
                }
            }
        }
    }

    /// A batch never reached the publisher thread: the set is no longer known to be exact.
    pub fn mark_incomplete(&mut self) {
        self.incomplete = true;
    }

    /// Whether a snapshot can be served from this set.
    pub fn is_exact(&self) -> bool {
        !self.incomplete
    }

    /// Blocks held in `medium`.
    pub fn len(&self, medium: Medium) -> usize {
        self.media[index(medium)].blocks.len()
    }

    /// The snapshot batch: `AllBlocksCleared`, then one `BlockStored` per medium that holds
    /// blocks (GPU first) with every held hash in the order stored, their tokens when every
    /// block's are known, no parent.
    pub fn snapshot(&self, ts: f64) -> EventBatch {
        let mut events = vec![CacheEvent::AllCleared {
            medium: Medium::Gpu,
        }];
        for m in MEDIA {
            let set = &self.media[index(m)];
            if set.blocks.is_empty() {
                continue;
            }
            let mut blocks: Vec<(&BlockHash, &Held)> = set.blocks.iter().collect();
            blocks.sort_unstable_by_key(|(_, b)| b.order);
            let with_tokens = blocks.iter().all(|(_, b)| !b.tokens.is_empty());
            let token_ids = if with_tokens {
                blocks
                    .iter()
                    .flat_map(|(_, b)| b.tokens.iter().copied())
                    .collect()
            } else {
                Vec::new()
            };
            events.push(CacheEvent::Stored {
                hashes: blocks.iter().map(|(h, _)| **h).collect(),
                parent: None,
                token_ids,
                block_size: set.block_size,
                lora_name: None,
                cache_salt: None,
                medium: m,
                cause: None,
            });
        }
        EventBatch { ts, events }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> BlockHash {
        BlockHash([n; 32])
    }

    fn stored(hashes: &[u8], medium: Medium) -> CacheEvent {
        CacheEvent::Stored {
            hashes: hashes.iter().map(|&n| h(n)).collect(),
            parent: None,
            token_ids: hashes
                .iter()
                .flat_map(|&n| [u32::from(n), u32::from(n) + 100])
                .collect(),
            block_size: 2,
            lora_name: None,
            cache_salt: None,
            medium,
            cause: None,
        }
    }

    fn removed(hashes: &[u8]) -> CacheEvent {
        CacheEvent::Removed {
            hashes: hashes.iter().map(|&n| h(n)).collect(),
            medium: Medium::Gpu,
            cause: None,
        }
    }

    fn batch(events: Vec<CacheEvent>) -> EventBatch {
        EventBatch { ts: 0.0, events }
    }

    #[test]
    fn stores_removals_and_clears_leave_the_held_set_in_store_order() {
        let mut held = HeldBlocks::default();
        held.apply(&batch(vec![stored(&[1, 2, 3], Medium::Gpu)]));
        held.apply(&batch(vec![removed(&[2]), stored(&[4], Medium::Gpu)]));
        held.apply(&batch(vec![stored(&[9], Medium::Cpu)]));
        assert_eq!(held.len(Medium::Gpu), 3);
        let snap = held.snapshot(1.5);
        assert_eq!(snap.ts, 1.5);
        assert_eq!(
            snap.events[0],
            CacheEvent::AllCleared {
                medium: Medium::Gpu
            }
        );
        match &snap.events[1] {
            CacheEvent::Stored {
                hashes,
                token_ids,
                parent,
                medium,
                block_size,
                ..
            } => {
                assert_eq!(hashes, &vec![h(1), h(3), h(4)]);
                assert_eq!(token_ids, &vec![1, 101, 3, 103, 4, 104]);
                assert_eq!(*parent, None);
                assert_eq!(*medium, Medium::Gpu);
                assert_eq!(*block_size, 2);
            }
            e => panic!("not a store: {e:?}"),
        }
        match &snap.events[2] {
            CacheEvent::Stored { hashes, medium, .. } => {
                assert_eq!(hashes, &vec![h(9)]);
                assert_eq!(*medium, Medium::Cpu);
            }
            e => panic!("not a store: {e:?}"),
        }
        assert_eq!(snap.events.len(), 3);
        held.apply(&batch(vec![CacheEvent::AllCleared {
            medium: Medium::Gpu,
        }]));
        assert_eq!(held.len(Medium::Gpu), 0);
        assert_eq!(held.len(Medium::Cpu), 1);
    }

    #[test]
    fn a_missed_batch_makes_it_inexact_until_everything_is_cleared() {
        let mut held = HeldBlocks::default();
        held.apply(&batch(vec![
            stored(&[1], Medium::Gpu),
            stored(&[2], Medium::Cpu),
        ]));
        held.mark_incomplete();
        assert!(!held.is_exact());
        held.apply(&batch(vec![CacheEvent::AllCleared {
            medium: Medium::Gpu,
        }]));
        assert!(!held.is_exact(), "the CPU medium still holds blocks");
        held.apply(&batch(vec![CacheEvent::AllCleared {
            medium: Medium::Cpu,
        }]));
        assert!(held.is_exact());
    }
}
