//! Cache insight: why each request missed (the miss reasons of [`MissTokens`]), where its
//! prompt diverged from a cached one, what a larger pool would have hit, per-tenant totals,
//! and each recent request's block lifecycle. Observers like the rest of the recorder: fed by
//! the scheduler's effects, read by nothing that decides.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::blocks::{BlockIndex, NONE};
use super::deferred::IndexQueue;
use super::divergence::{ContextTokens, Divergence, DIVERGENCE_CONTEXT};
use super::hot::{Ids, Live};
use super::shadow::{Shadow, SCALES};
use super::tenants::Tenants;
use crate::block_pool::BlockPool;
use crate::events::wire_hash;
use crate::hash::BlockHash;
use crate::request::{FinishReason, DEFAULT_TENANT};
use crate::stats::{MissReason, MissTokens, PrefillStats, TenantTotals};
use crate::{BlockId, TokenId};

pub use super::blocks::HotPrefix;
pub use super::lifecycle::{BlockEvent, BlockEventKind, RequestLifecycle, MAX_BLOCK_EVENTS};
use super::lifecycle::{Chain, Kept, LifeLog, Part, Rec};

/// How much the recorder keeps for cache insight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InsightConfig {
    /// Recently evicted block hashes remembered for the `evicted` miss reason and the 2x/4x
    /// estimates; `None`: six times the pool (the 4x pool's victim region is three pools long,
    /// and the blocks a larger pool found in it stay in its span until they age out: the
    /// headroom keeps the estimate exact under heavy reuse), `Some(0)`: none
    /// (evicted blocks then count as `never_cached`).
    pub shadow_blocks: Option<usize>,
    /// Tenants with a label of their own (the rest are "other"); `None`: no per-tenant totals.
    pub max_tenant_labels: Option<usize>,
    /// Finished requests whose block lifecycle is kept (0: none).
    pub request_history: usize,
    /// Keep the per-block index (creator, hits, siblings): divergence points, the hottest
    /// prefixes and the owner of an evicted entry.
    pub block_index: bool,
}

impl InsightConfig {
    /// Everything, at the server's defaults.
    pub fn full() -> Self {
        InsightConfig {
            shadow_blocks: None,
            max_tenant_labels: Some(64),
            request_history: 256,
            block_index: true,
        }
    }

    /// Miss reasons only (with no shadow set: evicted blocks count as `never_cached`).
    pub fn off() -> Self {
        InsightConfig {
            shadow_blocks: Some(0),
            max_tenant_labels: None,
            request_history: 0,
            block_index: false,
        }
    }
}

impl Default for InsightConfig {
    fn default() -> Self {
        InsightConfig::off()
    }
}

/// The default shadow set, in pools.
pub const DEFAULT_SHADOW_POOLS: usize = 6;

/// One line of the recent-requests list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecentRequest {
    pub request_id: Arc<str>,
    pub tenant: Arc<str>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub computed_tokens: u64,
    pub cache_creation_tokens: u64,
    pub diverged_at: Option<u64>,
    pub finish_reason: FinishReason,
}

/// Recent requests kept for the list (newest first).
pub const RECENT_REQUESTS: usize = 32;

/// The recorder's per-request insight state that the step does not touch per block (the
/// record's; what a block boundary touches is dense by slot: its lifecycle's [`Chain`] and its
/// [`Ids`]).
#[derive(Debug, Default)]
pub(crate) struct RequestInsight {
    pub tenant: Option<usize>,
    /// Reasons of the tokens after the local hit and the pending external blocks.
    pub miss: MissTokens,
    /// A router's predicted cached prefix, capped at the prompt (tokens).
    pub predicted: Option<usize>,
    /// The part of `miss` in the predicted prefix.
    pub shortfall: MissTokens,
    pub local_blocks: usize,
    pub pending_blocks: usize,
    pub divergence: Option<Divergence>,
    /// A sequence of a request with several (n > 1): its lifecycle joins the others'.
    pub shared: bool,
}

/// Digest of what decides whose cached blocks a request may be shown as a divergence point: the
/// salt and adapter its root block is hashed with, and its tenant. Another tenant's prompt may
/// share this one's cached prefix (without a salt the cache is shared), but its tokens and
/// request id are never shown to it. 0 for the anonymous tenant with neither.
pub(crate) fn root_key(cache_salt: Option<&str>, adapter: Option<&str>, tenant: &str) -> u64 {
    if cache_salt.is_none() && adapter.is_none() && tenant == DEFAULT_TENANT {
        return 0;
    }
    let mut h = blake3::Hasher::new();
    for part in [cache_salt, adapter, Some(tenant)] {
        match part {
            Some(s) => {
                h.update(&[1]);
                h.update(&(s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
            None => {
                h.update(&[0]);
            }
        }
    }
    let mut w = [0u8; 8];
    w.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(w) | 1
}

/// What the insight adds up (counters go to the recorder's totals).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LookupInsight {
    pub estimated_hits: [u64; 2],
    pub diverged_at: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct Insight {
    cfg: InsightConfig,
    block_size: usize,
    /// Built at the first effect that shows the pool (`built`); the shadow set only when it
    /// holds something (`--eviction-shadow-blocks` above 0: with none, its larger pools hold
    /// nothing either, and keeping their books would be work for no number).
    shadow: Option<Shadow>,
    index: Option<BlockIndex>,
    built: bool,
    tenants: Option<Tenants>,
    history: VecDeque<Kept>,
    recent: VecDeque<RecentRequest>,
    /// Every kept lifecycle's records.
    log: LifeLog,
    /// By slot: the live request's lifecycle and what its fills read (empty when neither
    /// lifecycles nor the block index are kept).
    live: Vec<Live>,
    /// New entries not yet applied to the block index, in order ([`Insight::flush`]).
    pending: IndexQueue,
}

impl Insight {
    pub(crate) fn new(cfg: InsightConfig, block_size: usize) -> Self {
        Insight {
            cfg,
            block_size,
            shadow: None,
            index: None,
            built: false,
            tenants: cfg.max_tenant_labels.map(Tenants::new),
            history: VecDeque::new(),
            recent: VecDeque::new(),
            log: LifeLog::new(),
            live: Vec::new(),
            pending: IndexQueue::default(),
        }
    }

    /// Apply the queued new entries, in order. Called before anything reads or changes the
    /// index, so nothing sees it late.
    #[inline]
    fn flush(&mut self) {
        if !self.pending.is_empty() {
            self.pending.apply(self.index.as_mut());
        }
    }

    /// Record `rec` in the lifecycle of the request in `slot`; false when it keeps none, or
    /// has reached [`MAX_BLOCK_EVENTS`] (then the event is counted as dropped).
    #[inline(always)]
    fn record(&mut self, slot: u32, rec: Rec) -> bool {
        let i = slot as usize;
        match self.live.get_mut(i).map(|l| &mut l.chain) {
            Some(c) if c.on => {
                if c.count() + rec.events() > MAX_BLOCK_EVENTS {
                    c.dropped = c.dropped.saturating_add(rec.events() as u32);
                    return false;
                }
            }
            _ => return false,
        }
        if self.log.full() {
            self.make_room();
        }
        self.log.push(&mut self.live[i].chain, rec);
        true
    }

    /// Room in the log for the next record (the live and kept lifecycles hold theirs).
    #[cold]
    #[inline(never)]
    fn make_room(&mut self) {
        let chains = self
            .live
            .iter_mut()
            .map(|l| &mut l.chain)
            .filter(|c| c.on)
            .chain(
                self.history
                    .iter_mut()
                    .flat_map(|k| k.parts_mut().map(|p| &mut p.chain)),
            );
        self.log.make_room(chains);
    }

    /// The step ended: what it recorded is visible to any thread that reads it next.
    pub(crate) fn end_step(&self) {
        self.log.fence();
    }

    /// Whether requests have a lifecycle chain and [`Ids`] (lifecycles or the block index are
    /// kept).
    fn keeps_live(&self) -> bool {
        self.cfg.request_history > 0 || self.cfg.block_index
    }

    #[inline]
    fn ensure(&mut self, pool: &BlockPool) {
        if !self.built {
            self.build(pool);
        }
    }

    #[cold]
    #[inline(never)]
    fn build(&mut self, pool: &BlockPool) {
        self.built = true;
        let c = pool.num_blocks();
        let cap = self.cfg.shadow_blocks.unwrap_or(DEFAULT_SHADOW_POOLS * c);
        if cap > 0 {
            self.shadow = Some(Shadow::new(c, cap));
        }
        if self.cfg.block_index {
            self.index = Some(BlockIndex::new(c, self.block_size));
        }
    }

    /// Put `chain` and `ids` in `slot` (grown to it); returns what was there.
    fn put(&mut self, slot: u32, chain: Chain, ids: Ids) -> (Chain, Ids) {
        let i = slot as usize;
        if self.live.len() <= i {
            self.live.resize_with(i + 1, Live::default);
        }
        let old = std::mem::replace(&mut self.live[i], Live { chain, ids });
        (old.chain, old.ids)
    }

    /// A new request in `slot`.
    pub(crate) fn arrived(
        &mut self,
        slot: u32,
        tenant: &Arc<str>,
        cache_salt: Option<&str>,
        adapter: Option<&str>,
    ) -> RequestInsight {
        self.flush();
        if let Some(ix) = self.index.as_mut() {
            if ix.creators.wants_sweep() {
                ix.sweep_creators(self.log.owners());
            }
        }
        if self.keeps_live() {
            let chain = if self.cfg.request_history > 0 {
                Chain::kept()
            } else {
                Chain::default()
            };
            let root_key = if self.cfg.block_index {
                root_key(cache_salt, adapter, tenant)
            } else {
                0
            };
            let old = self.put(
                slot,
                chain,
                Ids {
                    root_key,
                    ..Default::default()
                },
            );
            self.drop_live(old);
        }
        RequestInsight {
            tenant: self.tenants.as_mut().map(|t| t.index_of(tenant)),
            ..Default::default()
        }
    }

    /// A child sequence (n > 1) of the request in `parent`, in `child`.
    pub(crate) fn forked(
        &mut self,
        parent_slot: u32,
        child_slot: u32,
        tenant: Option<usize>,
    ) -> RequestInsight {
        self.flush();
        if self.keeps_live() {
            let parent = self.live.get(parent_slot as usize);
            let keeps = parent.is_some_and(|l| l.chain.on);
            let root_key = parent.map_or(0, |l| l.ids.root_key);
            let old = self.put(
                child_slot,
                if keeps {
                    Chain::kept()
                } else {
                    Chain::default()
                },
                Ids {
                    root_key,
                    ..Default::default()
                },
            );
            self.drop_live(old);
        }
        RequestInsight {
            tenant,
            shared: true,
            ..Default::default()
        }
    }

    /// Release what a slot's state left holds (none: a finished request's is taken). Its
    /// records in the log are released when the log's tail passes them.
    fn drop_live(&mut self, (old, ids): (Chain, Ids)) {
        self.finish_creator(&ids);
        self.log.drop_chain(&old);
    }

    /// The request whose `ids` these are ended: its creator id (if it took one) is no longer
    /// live; its entries and records may still name it.
    fn finish_creator(&mut self, ids: &Ids) {
        if let (true, Some(ix)) = (ids.creator != NONE, self.index.as_mut()) {
            ix.creators.finish(ids.creator);
        }
    }

    /// Whether the 2x/4x estimates mean anything (a shadow set is kept).
    pub(crate) fn estimates(&self) -> bool {
        self.cfg.shadow_blocks != Some(0)
    }

    pub(crate) fn tenant_mut(&mut self, i: Option<usize>) -> Option<&mut TenantTotals> {
        self.tenants.as_mut()?.get_mut(i?)
    }

    pub(crate) fn tenant_totals(&self) -> &[TenantTotals] {
        self.tenants.as_ref().map_or(&[], Tenants::list)
    }

    pub(crate) fn tenant_name(&self, i: Option<usize>) -> Arc<str> {
        self.tenants
            .as_ref()
            .and_then(|t| t.name(i?))
            .unwrap_or_else(|| Arc::from(DEFAULT_TENANT))
    }

    /// The first admission's lookup, after its allocation was recorded ([`Insight::allocated`],
    /// so the blocks it evicted count as evicted): the 2x/4x estimates, the miss reasons of the
    /// blocks after the local hit and the pending external ones, and the divergence point.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn first_lookup(
        &mut self,
        slot: u32,
        ri: &mut RequestInsight,
        pool: &BlockPool,
        tokens: &[TokenId],
        prompt_len: usize,
        hashes: &[BlockHash],
        blocks: &[BlockId],
        local_tokens: usize,
        pending_tokens: usize,
    ) -> LookupInsight {
        self.ensure(pool);
        self.flush();
        let b = self.block_size;
        let local = local_tokens / b;
        let pending = pending_tokens / b;
        ri.local_blocks = local;
        ri.pending_blocks = pending;
        let mut out = LookupInsight::default();
        // What a pool of each larger scale would have found after the local hit.
        let cap = crate::kv_manager::max_cached_blocks(prompt_len, b);
        if let Some(sh) = self.shadow.as_mut() {
            for g in 0..SCALES.len() {
                let mut est = local;
                while est < cap {
                    let Some(h) = hashes.get(est) else { break };
                    if pool.lookup(h).is_some() {
                    } else if sh.ghost_holds(g, h) {
                        sh.ghost_take(g, h);
                    } else {
                        break;
                    }
                    est += 1;
                }
                out.estimated_hits[g] = (est * b) as u64;
            }
        }
        // Why the rest is computed.
        let full = prompt_len / b;
        let cached = local + pending;
        // Each block's reason counts for all its tokens in `miss`, and for those below the
        // predicted prefix's end in `shortfall`.
        let predicted_end = ri.predicted.unwrap_or(0);
        let in_prediction = |from: usize, to: usize| predicted_end.clamp(from, to) - from;
        let mut m = MissTokens::default();
        let mut short = MissTokens::default();
        let mut count = |reason: MissReason, from: usize, to: usize| {
            m.add(reason, (to - from) as u64);
            short.add(reason, in_prediction(from, to) as u64);
        };
        count(MissReason::PartialBlock, full * b, prompt_len);
        for j in cached..full {
            let reason = match hashes.get(j) {
                None => MissReason::NeverCached,
                Some(h) => {
                    let in_pool = pool.lookup(h).is_some();
                    if in_pool && j == cap && j == cached {
                        MissReason::CappedForLogits
                    } else if in_pool || self.shadow.as_mut().is_some_and(|s| s.contains(h)) {
                        MissReason::Evicted
                    } else {
                        MissReason::NeverCached
                    }
                }
            };
            count(reason, j * b, (j + 1) * b);
        }
        ri.miss = m;
        ri.shortfall = short;
        // Where it diverged from a cached sibling of its first uncached block.
        let root_key = self.live.get(slot as usize).map_or(0, |l| l.ids.root_key);
        if let Some(ix) = self.index.as_ref() {
            let j = cached;
            let ours = &tokens[(j * b).min(prompt_len)..((j + 1) * b).min(prompt_len)];
            let own_cached = hashes.get(j).is_some_and(|h| pool.lookup(h).is_some());
            let parent = if j == 0 {
                Some(None)
            } else if j <= local {
                blocks.get(j - 1).map(|&p| Some(p))
            } else {
                hashes.get(j - 1).and_then(|h| pool.lookup(h)).map(Some)
            };
            if let (false, false, Some(parent)) = (ours.is_empty(), own_cached, parent) {
                if let Some(s) = ix.diverging_sibling(parent, root_key, ours) {
                    let at = j * b + s.offset;
                    let theirs = ix.tokens(s.block);
                    let end = (at + DIVERGENCE_CONTEXT).min((j + 1) * b).min(prompt_len);
                    ri.divergence = Some(Divergence {
                        at: at as u64,
                        before: ContextTokens::new(
                            &tokens[at.saturating_sub(DIVERGENCE_CONTEXT)..at],
                        ),
                        ours: ContextTokens::new(&tokens[at..end]),
                        theirs: ContextTokens::new(
                            &theirs[s.offset..(s.offset + DIVERGENCE_CONTEXT).min(theirs.len())],
                        ),
                        cached_by: ix.creator(s.block),
                    });
                    out.diverged_at = Some(at as u64);
                }
            }
        }
        out
    }

    /// The lookup found the first `hits` blocks of `blocks` (`first`: at the first admission,
    /// when they count as found in the per-block index).
    pub(crate) fn hits(
        &mut self,
        slot: u32,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        hits: usize,
        first: bool,
        now: f64,
    ) {
        self.flush();
        if first {
            if let Some(ix) = self.index.as_mut() {
                for &blk in blocks.iter().take(hits) {
                    ix.hit(blk, now);
                }
            }
        }
        if self.live.get(slot as usize).is_none_or(|l| !l.chain.on) {
            return;
        }
        for (j, &blk) in blocks.iter().enumerate().take(hits) {
            self.record(
                slot,
                Rec::new(
                    BlockEventKind::Hit,
                    Some(j as u32),
                    Some(blk),
                    hashes.get(j).map(wire_hash),
                ),
            );
        }
    }

    /// The end of an effect that took blocks: the larger pools' victim regions back to length.
    #[inline]
    pub(crate) fn trim(&mut self) {
        if let Some(sh) = self.shadow.as_mut() {
            sh.trim();
        }
    }

    pub(crate) fn loaded(&mut self, slot: u32, hashes_from: usize, n: usize) {
        for j in hashes_from..hashes_from + n {
            self.record(
                slot,
                Rec::new(BlockEventKind::Loaded, Some(j as u32), None, None),
            );
        }
    }

    pub(crate) fn preempted(&mut self, slot: u32) {
        // Its blocks are freed: its entries may go.
        if let Some(l) = self.live.get_mut(slot as usize) {
            l.ids.own = None;
        }
        self.record(slot, Rec::new(BlockEventKind::Preempted, None, None, None));
    }

    /// The cache was reset, dropping the entries `dropped` (in free-queue order).
    pub(crate) fn reset(&mut self, dropped: &[BlockHash]) {
        self.flush();
        for l in &mut self.live {
            l.ids.own = None;
        }
        if let Some(ix) = self.index.as_mut() {
            ix.reset();
        }
        if let Some(sh) = self.shadow.as_mut() {
            sh.reset(dropped);
        }
    }

    /// A request (or one sequence of it) ended.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finished(
        &mut self,
        slot: u32,
        ri: RequestInsight,
        request_id: &Arc<str>,
        handle: u64,
        reason: FinishReason,
        prompt_tokens: u64,
        generation_tokens: u64,
        stats: Option<PrefillStats>,
        seq: u32,
    ) {
        // Sequence 0 is the request itself: its prompt, stats and finish reason.
        let primary = seq == 0;
        let tenant = self.tenant_name(ri.tenant);
        if primary {
            if self.recent.len() == RECENT_REQUESTS {
                self.recent.pop_back();
            }
            let s = stats.unwrap_or_default();
            self.recent.push_front(RecentRequest {
                request_id: request_id.clone(),
                tenant: tenant.clone(),
                prompt_tokens,
                cached_tokens: s.cached_tokens,
                computed_tokens: s.computed_tokens,
                cache_creation_tokens: s.cache_creation_tokens,
                diverged_at: s.diverged_at,
                finish_reason: reason,
            });
        }
        let Live { chain, ids } = self
            .live
            .get_mut(slot as usize)
            .map(std::mem::take)
            .unwrap_or_default();
        self.finish_creator(&ids);
        if !chain.on {
            return;
        }
        // The sequences of one request share its entry.
        let joined = if ri.shared {
            self.history.iter_mut().rev().find(|h| h.handle == handle)
        } else {
            None
        };
        if let Some(h) = joined {
            // Past the limit its later events are cut (their records stay unread in the log).
            let shown: usize = h.parts().map(|p| p.take as usize).sum();
            let take = chain.count().min(MAX_BLOCK_EVENTS.saturating_sub(shown));
            h.dropped += (chain.count() - take) as u64 + u64::from(chain.dropped);
            h.more.push(Part {
                seq: Some(seq),
                chain,
                take: take as u32,
            });
            h.generation_tokens += generation_tokens;
            if primary {
                h.prefill_stats = stats;
                h.finish_reason = reason;
                h.prompt_tokens = prompt_tokens;
            }
            return;
        }
        if self.history.len() >= self.cfg.request_history {
            if let Some(old) = self.history.pop_front() {
                for p in old.parts() {
                    self.log.drop_chain(&p.chain);
                }
            }
        }
        let dropped = u64::from(chain.dropped);
        let take = chain.count() as u32;
        self.history.push_back(Kept {
            request_id: request_id.clone(),
            handle,
            tenant,
            finish_reason: reason,
            prompt_tokens,
            generation_tokens,
            prefill_stats: stats,
            first: Part {
                seq: ri.shared.then_some(seq),
                chain,
                take,
            },
            more: Vec::new(),
            dropped,
        });
    }

    pub(crate) fn lifecycle(&self, request_id: &str) -> Option<RequestLifecycle> {
        let h = self
            .history
            .iter()
            .rev()
            .find(|h| &*h.request_id == request_id)?;
        let creators = self.index.as_ref().map(|ix| &ix.creators);
        Some(RequestLifecycle {
            request_id: h.request_id.clone(),
            handle: h.handle,
            tenant: h.tenant.clone(),
            finish_reason: h.finish_reason,
            prompt_tokens: h.prompt_tokens,
            generation_tokens: h.generation_tokens,
            prefill_stats: h.prefill_stats,
            blocks: {
                let mut v = Vec::new();
                for p in h.parts() {
                    for r in self.log.records(&p.chain, p.take as usize) {
                        v.push(r.event(creators, p.seq));
                    }
                }
                v
            },
            blocks_dropped: h.dropped,
        })
    }

    pub(crate) fn recent(&self) -> impl Iterator<Item = &RecentRequest> {
        self.recent.iter()
    }

    pub(crate) fn hottest(&mut self, now: f64, n: usize) -> Vec<HotPrefix> {
        self.flush();
        self.index
            .as_ref()
            .map_or_else(Vec::new, |ix| ix.hottest(now, n))
    }
}

mod boundary;
pub(crate) use boundary::Table;
#[cfg(test)]
pub(super) mod tests;
