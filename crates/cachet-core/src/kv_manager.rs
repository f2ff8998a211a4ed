//! Block tables, the capped longest-prefix lookup, slot allocation and exact cache-creation
//! attribution (spec §1-§3).

use std::ops::Range;

use crate::block_pool::{BlockPool, CacheOutcome, Evicted, PoolExhausted};
use crate::hash::{hash_block, BlockHash, ExtraKeys, HashSeed};
use crate::{BlockId, TokenId};

/// One request's view of the KV cache.
#[derive(Clone, Debug, Default)]
#[repr(C)]
pub struct ReqKv {
    /// The block table: block `i` holds positions `i*B .. (i+1)*B`.
    pub blocks: Vec<BlockId>,
    /// Leading blocks that are full and have been offered to the cache (filled or hit).
    num_committed: usize,
    /// Hashes of the request's full token blocks, computed lazily in order.
    hashes: Vec<BlockHash>,
    /// Boxed: read only when a block is hashed, and the struct stays one cache line.
    pub extra: Box<ExtraKeys>,
}

impl ReqKv {
    pub fn new(extra: ExtraKeys) -> Self {
        ReqKv {
            extra: Box::new(extra),
            ..Default::default()
        }
    }

    /// The hashes of the request's full token blocks computed so far (block `i` at index `i`).
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Leading blocks that are full and have been offered to the cache.
    pub fn num_committed(&self) -> usize {
        self.num_committed
    }
}

/// What the KV manager's operations did since the buffer was last cleared: the raw material of
/// every block-level number (the recorder attributes it) and of what the engine may do with
/// blocks (offload the evicted ones before they are overwritten, save new entries).
///
/// One buffer is reused for every operation, so the common decode step allocates nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvEffects {
    /// Blocks taken from the free pool.
    pub allocated: u32,
    /// Cache entries dropped to satisfy those allocations.
    pub evicted: Vec<Evicted>,
    /// Blocks that became full (computed or loaded KV) and were offered to the cache.
    pub filled: u32,
    /// Block-table indices of the filled blocks that became **new** cache entries.
    pub created: Vec<u32>,
    /// Position up to which the request's blocks are committed (a multiple of B).
    pub committed_until: usize,
}

impl KvEffects {
    pub fn clear(&mut self) {
        self.allocated = 0;
        self.evicted.clear();
        self.filled = 0;
        self.created.clear();
        self.committed_until = 0;
    }

    pub fn is_empty(&self) -> bool {
        self.allocated == 0 && self.filled == 0 && self.evicted.is_empty()
    }
}

#[derive(Clone, Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    caching: bool,
    seed: HashSeed,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool, seed: HashSeed) -> Self {
        assert!(block_size > 0, "block size must be positive");
        KvCacheManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            caching: enable_caching,
            seed,
        }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn caching_enabled(&self) -> bool {
        self.caching
    }

    /// Blocks needed to hold `num_tokens` positions.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    fn ensure_hashes(&self, kv: &mut ReqKv, tokens: &[TokenId], upto_blocks: usize) {
        let b = self.block_size;
        let upto = upto_blocks.min(tokens.len() / b);
        while kv.hashes.len() < upto {
            let i = kv.hashes.len();
            let parent = if i == 0 {
                self.seed.0
            } else {
                kv.hashes[i - 1]
            };
            kv.hashes.push(hash_block(
                &parent,
                &tokens[i * b..(i + 1) * b],
                &kv.extra,
                i,
            ));
        }
    }

    /// Longest run of leading full blocks of `tokens` found in the local cache, capped so that
    /// at least one token is computed: at most `floor((N-1)/B)` blocks (spec §2).
    pub fn find_cached_prefix(&self, kv: &mut ReqKv, tokens: &[TokenId]) -> Vec<BlockId> {
        if !self.caching || tokens.is_empty() {
            return Vec::new();
        }
        let max_blocks = max_cached_blocks(tokens.len(), self.block_size);
        self.ensure_hashes(kv, tokens, max_blocks);
        let mut hits = Vec::new();
        for h in &kv.hashes[..max_blocks] {
            match self.pool.lookup(h) {
                Some(b) => hits.push(b),
                None => break,
            }
        }
        hits
    }

    /// Hash every full block of `tokens` (no-op with caching off).
    pub fn hash_full_blocks(&self, kv: &mut ReqKv, tokens: &[TokenId]) {
        if self.caching {
            self.ensure_hashes(kv, tokens, tokens.len() / self.block_size);
        }
    }

    /// Hashes of full blocks `range` of `tokens` (for an external tier lookup).
    pub fn block_hashes(
        &self,
        kv: &mut ReqKv,
        tokens: &[TokenId],
        range: Range<usize>,
    ) -> Vec<BlockHash> {
        self.ensure_hashes(kv, tokens, range.end);
        let end = range.end.min(kv.hashes.len());
        kv.hashes[range.start.min(end)..end].to_vec()
    }

    /// Make room for `num_new` more tokens after `num_computed` (which includes the hit blocks
    /// `hits`, appended to the table first). Adds what it did to `fx`. All or nothing: on `Err`
    /// nothing changed.
    pub fn allocate_slots(
        &mut self,
        kv: &mut ReqKv,
        hits: &[BlockId],
        num_computed: usize,
        num_new: usize,
        fx: &mut KvEffects,
    ) -> Result<(), PoolExhausted> {
        let have = kv.blocks.len() + hits.len();
        if hits.is_empty() && num_computed + num_new <= have * self.block_size {
            // The common decode step: the new token fits in the last block.
            return Ok(());
        }
        let needed = self.blocks_for(num_computed + num_new);
        let new_blocks = needed.saturating_sub(have);
        let hits_from_free = self.pool.count_free(hits);
        if new_blocks + hits_from_free > self.pool.num_free() {
            return Err(PoolExhausted {
                requested: new_blocks + hits_from_free,
                free: self.pool.num_free(),
            });
        }
        // Touch hits before allocating so the allocation cannot evict them.
        self.pool.touch(hits);
        kv.blocks.extend_from_slice(hits);
        if kv.num_committed + hits.len() == kv.blocks.len() {
            kv.num_committed = kv.blocks.len();
        }
        self.pool
            .allocate(new_blocks, &mut kv.blocks, &mut fx.evicted)?;
        fx.allocated += new_blocks as u32;
        Ok(())
    }

    /// Offer every block that is now full (`num_tokens_with_kv` positions hold KV) to the
    /// cache, adding to `fx` the blocks filled, the ones that became new cache entries and the
    /// committed position. Returns whether any block became full (false in most decode steps,
    /// which then touch nothing but the request's own line).
    pub fn commit(
        &mut self,
        kv: &mut ReqKv,
        tokens: &[TokenId],
        num_tokens_with_kv: usize,
        fx: &mut KvEffects,
    ) -> bool {
        let b = self.block_size;
        if num_tokens_with_kv < (kv.num_committed + 1) * b {
            return false;
        }
        let full = (num_tokens_with_kv / b).min(kv.blocks.len());
        if self.caching {
            self.ensure_hashes(kv, tokens, full);
        }
        for i in kv.num_committed..full {
            fx.filled += 1;
            if self.caching
                && self.pool.cache_full_block(kv.blocks[i], kv.hashes[i]) == CacheOutcome::Created
            {
                fx.created.push(i as u32);
            }
        }
        kv.num_committed = kv.num_committed.max(full);
        fx.committed_until = kv.num_committed * b;
        true
    }

    /// A second table for a sequence forked from `parent` once `num_tokens` positions hold KV:
    /// the full blocks are shared (one more reference each) and the partial last block, if
    /// any, gets a fresh block the caller must fill with a copy of the parent's (returned as
    /// `(source, destination)`). All or nothing.
    pub fn fork(
        &mut self,
        parent: &ReqKv,
        num_tokens: usize,
        fx: &mut KvEffects,
    ) -> Result<(ReqKv, Option<(BlockId, BlockId)>), PoolExhausted> {
        let b = self.block_size;
        let full = (num_tokens / b).min(parent.blocks.len());
        let partial = !num_tokens.is_multiple_of(b) && parent.blocks.len() > full;
        if partial && self.pool.num_free() == 0 {
            return Err(PoolExhausted {
                requested: 1,
                free: 0,
            });
        }
        let mut child = ReqKv {
            blocks: parent.blocks[..full].to_vec(),
            num_committed: parent.num_committed.min(full),
            hashes: parent.hashes.clone(),
            extra: parent.extra.clone(),
        };
        self.pool.touch(&child.blocks);
        let mut copy = None;
        if partial {
            self.pool.allocate(1, &mut child.blocks, &mut fx.evicted)?;
            fx.allocated += 1;
            copy = Some((parent.blocks[full], child.blocks[full]));
        }
        Ok((child, copy))
    }

    /// Release the request's blocks (finish, abort or preemption). Hashes of its tokens are
    /// kept: they do not change.
    pub fn free(&mut self, kv: &mut ReqKv) {
        self.pool.free(&kv.blocks);
        kv.blocks.clear();
        kv.num_committed = 0;
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }
}

/// The most leading full blocks of an `n`-token prompt a lookup may take from a cache, so that
/// at least one token is computed (its logits are needed): `floor((N-1)/B)` (spec §2).
pub fn max_cached_blocks(n: usize, block_size: usize) -> usize {
    n.saturating_sub(1) / block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt that fills its last block recomputes that block; a shorter tail leaves every
    /// full block to the cache; an empty prompt takes none.
    #[test]
    fn the_n_minus_1_cap_keeps_one_token_to_compute() {
        let cap = |n| max_cached_blocks(n, 16);
        assert_eq!(
            [cap(0), cap(1), cap(16), cap(17), cap(64), cap(1500)],
            [0, 0, 0, 1, 3, 93]
        );
    }

    fn mgr(blocks: usize) -> KvCacheManager {
        KvCacheManager::new(blocks, 4, true, HashSeed::new(&[0; 32], 4, "t"))
    }

    #[test]
    fn lookup_is_capped_at_n_minus_one() {
        let mut m = mgr(8);
        let toks: Vec<u32> = (0..8).collect();
        let mut a = ReqKv::default();
        let mut fx = KvEffects::default();
        m.allocate_slots(&mut a, &[], 0, 8, &mut fx).unwrap();
        assert!(m.commit(&mut a, &toks, 8, &mut fx));
        assert_eq!(
            (fx.allocated, fx.filled, fx.created.clone()),
            (2, 2, vec![0, 1])
        );
        assert_eq!(fx.committed_until, 8);
        m.free(&mut a);
        // Same 8 tokens: cap floor(7/4) = 1 block.
        let mut b = ReqKv::default();
        assert_eq!(m.find_cached_prefix(&mut b, &toks).len(), 1);
        // 9 tokens with the same prefix: both blocks.
        let toks9: Vec<u32> = (0..9).collect();
        let mut c2 = ReqKv::default();
        assert_eq!(m.find_cached_prefix(&mut c2, &toks9).len(), 2);
    }

    #[test]
    fn refill_of_a_cached_hash_is_filled_but_not_created() {
        let mut m = mgr(4);
        let toks: Vec<u32> = (0..4).collect();
        let (mut a, mut b) = (ReqKv::default(), ReqKv::default());
        let mut fx = KvEffects::default();
        m.allocate_slots(&mut a, &[], 0, 4, &mut fx).unwrap();
        m.allocate_slots(&mut b, &[], 0, 4, &mut fx).unwrap();
        m.commit(&mut a, &toks, 4, &mut fx);
        m.commit(&mut b, &toks, 4, &mut fx);
        assert_eq!(
            (fx.allocated, fx.filled, fx.created.clone()),
            (2, 2, vec![0])
        );
    }

    #[test]
    fn a_fork_shares_full_blocks_and_copies_the_partial_one() {
        let mut m = mgr(8);
        let toks: Vec<u32> = (0..10).collect(); // B = 4: blocks 0, 1 full, 2 partial
        let mut a = ReqKv::default();
        let mut fx = KvEffects::default();
        m.allocate_slots(&mut a, &[], 0, 10, &mut fx).unwrap();
        m.commit(&mut a, &toks, 10, &mut fx);
        let mut fx = KvEffects::default();
        let (b, copy) = m.fork(&a, 10, &mut fx).unwrap();
        assert_eq!(b.blocks[..2], a.blocks[..2]);
        assert_ne!(b.blocks[2], a.blocks[2]);
        assert_eq!(copy, Some((a.blocks[2], b.blocks[2])));
        assert_eq!(fx.allocated, 1);
        assert_eq!(m.pool().ref_count(a.blocks[0]), 2);
        assert_eq!(m.pool().ref_count(a.blocks[2]), 1);
        // Block-aligned: nothing to copy.
        let (_, copy) = m.fork(&a, 8, &mut fx).unwrap();
        assert_eq!(copy, None);
    }

    #[test]
    fn allocation_failure_changes_nothing() {
        let mut m = mgr(2);
        let mut a = ReqKv::default();
        let mut fx = KvEffects::default();
        assert!(m.allocate_slots(&mut a, &[], 0, 9, &mut fx).is_err());
        assert!(a.blocks.is_empty());
        assert!(fx.is_empty());
        assert_eq!(m.pool().num_free(), 2);
    }
}
