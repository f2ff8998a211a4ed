//! Block tables, the capped longest-prefix lookup, slot allocation and exact cache-creation
//! attribution (spec §1-§3).

use std::ops::Range;

use crate::block_pool::{AllocEffects, BlockPool, CacheOutcome, PoolExhausted};
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
}

/// What committing newly full blocks did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitEffects {
    pub filled: u64,
    /// Tokens inside the `creation_range` of blocks that became new cache entries.
    pub creation_tokens: u64,
    /// Position up to which blocks have been committed (a multiple of B).
    pub committed_until: usize,
}

#[derive(Clone, Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    caching: bool,
    seed: HashSeed,
}

impl KvCacheManager {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_caching: bool,
        seed: HashSeed,
        observe: bool,
    ) -> Self {
        assert!(block_size > 0, "block size must be positive");
        KvCacheManager {
            pool: BlockPool::new(num_blocks, observe),
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
        let max_blocks = (tokens.len() - 1) / self.block_size;
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
    /// `hits`, appended to the table first). All or nothing: on `Err` nothing changed.
    pub fn allocate_slots(
        &mut self,
        kv: &mut ReqKv,
        hits: &[BlockId],
        num_computed: usize,
        num_new: usize,
    ) -> Result<AllocEffects, PoolExhausted> {
        let have = kv.blocks.len() + hits.len();
        if hits.is_empty() && num_computed + num_new <= have * self.block_size {
            // The common decode step: the new token fits in the last block.
            return Ok(AllocEffects::default());
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
        let effects = self.pool.allocate(new_blocks, &mut kv.blocks)?;
        Ok(effects)
    }

    /// Offer every block that is now full (`num_tokens_with_kv` positions hold KV) to the
    /// cache. A block counts as a creation only when it becomes a new cache entry; its tokens
    /// inside `creation_range` are the creation tokens.
    pub fn commit(
        &mut self,
        kv: &mut ReqKv,
        tokens: &[TokenId],
        num_tokens_with_kv: usize,
        creation_range: Range<usize>,
    ) -> CommitEffects {
        let b = self.block_size;
        let mut effects = CommitEffects::default();
        if num_tokens_with_kv < (kv.num_committed + 1) * b {
            // No block became full (most decode steps).
            effects.committed_until = kv.num_committed * b;
            return effects;
        }
        let full = (num_tokens_with_kv / b).min(kv.blocks.len());
        if self.caching {
            self.ensure_hashes(kv, tokens, full);
        }
        for i in kv.num_committed..full {
            let hash = if self.caching {
                Some(kv.hashes[i])
            } else {
                None
            };
            effects.filled += 1;
            if self.pool.fill_and_cache(kv.blocks[i], hash) == Some(CacheOutcome::Created) {
                let lo = (i * b).max(creation_range.start);
                let hi = ((i + 1) * b).min(creation_range.end);
                effects.creation_tokens += hi.saturating_sub(lo) as u64;
            }
        }
        kv.num_committed = kv.num_committed.max(full);
        effects.committed_until = kv.num_committed * b;
        effects
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

#[cfg(test)]
mod tests {
    use super::*;

    fn mgr(blocks: usize) -> KvCacheManager {
        KvCacheManager::new(blocks, 4, true, HashSeed::new(&[0; 32], 4, "t"), true)
    }

    #[test]
    fn lookup_is_capped_at_n_minus_one() {
        let mut m = mgr(8);
        let toks: Vec<u32> = (0..8).collect();
        let mut a = ReqKv::default();
        m.allocate_slots(&mut a, &[], 0, 8).unwrap();
        let c = m.commit(&mut a, &toks, 8, 0..8);
        assert_eq!((c.filled, c.creation_tokens), (2, 8));
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
    fn allocation_failure_changes_nothing() {
        let mut m = mgr(2);
        let mut a = ReqKv::default();
        assert!(m.allocate_slots(&mut a, &[], 0, 9).is_err());
        assert!(a.blocks.is_empty());
        assert_eq!(m.pool().num_free(), 2);
    }
}
