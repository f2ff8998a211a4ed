//! The recorder: the one home of every accounting number.
//!
//! It observes the scheduler's effects ([`Effect`]) and from them alone keeps each request's
//! [`PrefillStats`] (both families of spec §3), its [`RequestTimes`], the session-cumulative
//! stats, the monotonic [`CounterTotals`] (spec §6), the latency samples and the finished-request
//! records. Nothing it computes flows back into a decision: the scheduler knows it only as an
//! [`Observer`].
//!
//! Where a number lives:
//! - logical fields and the query/hit/by-source totals: [`Recorder::settle`], called once per
//!   request when its lookup (and its external loads) are known;
//! - physical fields, fills, allocations, evictions, creation: the `Admitted`, `Allocated`,
//!   `Computed` and `Preempted` effects;
//! - times: `Admitted` (first scheduling), `Sampled` (first token), `Finished`.

mod blocks;
mod creators;
mod deferred;
mod divergence;
mod hot;
mod insight;
mod lifecycle;
mod shadow;
mod tenants;

use std::collections::HashMap;
use std::sync::Arc;

pub use divergence::{ContextTokens, Divergence, DIVERGENCE_CONTEXT};
pub use insight::{
    BlockEvent, BlockEventKind, HotPrefix, InsightConfig, RecentRequest, RequestLifecycle,
    MAX_BLOCK_EVENTS, RECENT_REQUESTS,
};

use crate::events::{CacheEvent, EventCause, Medium};
use crate::observe::{Effect, Lookup, Observer};
use crate::stats::{
    CounterTotals, FinishedRequestStats, MissTokens, PrefillStats, RequestTimes, TenantTotals,
};
use crate::tier::TierTag;
use insight::{Insight, RequestInsight};

/// Hint the CPU to load the cache line holding `v` (no effect on results).
#[inline(always)]
pub(crate) fn prefetch<T>(v: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults, and `v` is a valid reference anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (v as *const T).cast::<i8>(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// Write `v` to `to` past the caches (streaming stores): for a line the step writes whole and
/// does not read back soon, last touched long ago, so that a plain store would first read it in
/// and leave it in the core's caches in place of what the step reads again. The engine fences
/// once a step (`Recorder::end_step`) before another thread may read it; this thread's own
/// later reads see it as any store. (`T` is a multiple of 16 bytes on a 16-byte boundary.)
#[inline(always)]
pub(crate) fn stream<T: Copy>(to: &mut T, v: T) {
    const {
        assert!(std::mem::size_of::<T>().is_multiple_of(16) && std::mem::align_of::<T>() >= 16);
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `to` is valid for writes of `size_of::<T>()` bytes and 16-byte aligned (checked
    // at compile time above), so each 16-byte piece is an aligned `__m128i`; `v` is plain data
    // (`Copy`), read as such.
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_stream_si128};
        let src = (&v as *const T).cast::<__m128i>();
        let dst = (to as *mut T).cast::<__m128i>();
        for k in 0..std::mem::size_of::<T>() / 16 {
            _mm_stream_si128(dst.add(k), src.add(k).read_unaligned());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        *to = v;
    }
}

/// Copy `from` to `to` (equal lengths) past the caches where `to` is 16-byte aligned and a
/// multiple of 16 bytes long (a block's tokens in the block index), else as a plain copy.
#[inline]
pub(crate) fn stream_tokens(to: &mut [crate::TokenId], from: &[crate::TokenId]) {
    const PER: usize = 16 / std::mem::size_of::<crate::TokenId>();
    #[cfg(target_arch = "x86_64")]
    if to.len() == from.len()
        && to.len().is_multiple_of(PER)
        && (to.as_ptr() as usize).is_multiple_of(16)
    {
        // SAFETY: `to` and `from` hold `len` tokens each; `to` starts 16-byte aligned and
        // `len` is a multiple of 16 bytes, so each store is an aligned 16-byte write inside
        // `to`; each load reads 16 bytes inside `from` (unaligned loads allowed).
        unsafe {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let src = from.as_ptr().cast::<__m128i>();
            let dst = to.as_mut_ptr().cast::<__m128i>();
            for k in 0..to.len() / PER {
                _mm_stream_si128(dst.add(k), _mm_loadu_si128(src.add(k)));
            }
        }
        return;
    }
    to.copy_from_slice(from);
}

/// Session-cumulative numbers: the sum over a session's turns, this one included.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SessionTotals {
    pub stats: PrefillStats,
    pub queue_s: f64,
    pub prefill_s: f64,
}

impl SessionTotals {
    fn add(&mut self, stats: &PrefillStats, times: &RequestTimes) {
        self.stats.accumulate(stats);
        self.queue_s += times.queue_s();
        self.prefill_s += times.prefill_s();
    }
}

/// External tokens of one request by the tier that supplied them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExternalSources {
    pub host: u64,
    pub redis: u64,
    pub disk: u64,
}

/// What the recorder says about one request on its first-token update and on its final one.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// `None` for a request that was never admitted.
    pub prefill_stats: Option<PrefillStats>,
    /// Where its `external_cached_tokens` came from.
    pub external: ExternalSources,
    /// The request's timestamps so far.
    pub times: RequestTimes,
    /// Session turns: the session's cumulative numbers.
    pub session: Option<SessionTotals>,
    /// On the final update.
    pub finished: Option<FinishedRequestStats>,
    /// Where the prompt diverged from a cached one (`prefill_stats.diverged_at`), with the
    /// tokens around it.
    pub divergence: Option<Divergence>,
}

/// TTFT and inter-token latency samples (seconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatencySamples {
    pub ttft_s: Vec<f64>,
    pub itl_s: Vec<f64>,
}

/// Per-request state of the recorder, by slot, while the request lives (what a decode token
/// touches, its last token's time, lives apart in a dense array).
#[derive(Debug)]
struct Record {
    /// The first output token exists: physical fields are final.
    finalized: bool,
    handle: u64,
    label: Arc<str>,
    session_id: Option<Arc<str>>,
    prompt_len: usize,
    max_tokens: u32,
    times: RequestTimes,
    stats: PrefillStats,
    admitted: bool,
    /// Logical fields are fixed.
    settled: bool,
    /// Prompt positions below this are not counted as cache creation (again).
    creation_floor: usize,
    num_preemptions: u64,
    lookup: Option<Lookup>,
    retained: usize,
    /// Earlier turns of the request's session.
    session_base: SessionTotals,
    external: ExternalSources,
    cache_salt: Option<String>,
    adapter: Option<String>,
    /// The request's sequence number (n > 1): 0 for the request itself, 1 to n - 1 for the
    /// sequences forked from it (no prompt of their own).
    seq: u32,
    ins: RequestInsight,
}

#[derive(Debug)]
pub struct Recorder {
    block_size: usize,
    records: Vec<Option<Record>>,
    /// Time of each live request's latest token, by slot: the one thing a decode token reads,
    /// kept dense so a step over a thousand requests stays in L1.
    last_token: Vec<f64>,
    totals: CounterTotals,
    samples: LatencySamples,
    finished: Vec<FinishedRequestStats>,
    reports: Vec<(u32, Report)>,
    /// Cumulative numbers of parked sessions.
    sessions: HashMap<Arc<str>, SessionTotals>,
    /// KV cache events since the last `take_events` (`None`: not collected).
    events: Option<Vec<CacheEvent>>,
    insight: Insight,
}

impl Recorder {
    pub fn new(block_size: usize) -> Self {
        Recorder {
            block_size,
            records: Vec::new(),
            last_token: Vec::new(),
            totals: CounterTotals::default(),
            samples: LatencySamples::default(),
            finished: Vec::new(),
            reports: Vec::new(),
            sessions: HashMap::new(),
            events: None,
            insight: Insight::new(InsightConfig::off(), block_size),
        }
    }

    /// Keep what `cfg` asks for of cache insight (by default only the miss reasons, without
    /// the shadow set).
    pub fn with_insight(mut self, cfg: InsightConfig) -> Self {
        self.insight = Insight::new(cfg, self.block_size);
        self
    }

    /// Per-tenant monotonic totals (empty without per-tenant insight). Tenants keep their
    /// index: the list only grows.
    pub fn tenant_totals(&self) -> &[TenantTotals] {
        self.insight.tenant_totals()
    }

    /// The last finished requests, newest first.
    pub fn recent(&self) -> Vec<RecentRequest> {
        self.insight.recent().cloned().collect()
    }

    /// A recent finished request's block lifecycle, by its label (the newest with it).
    pub fn lifecycle(&self, request_id: &str) -> Option<RequestLifecycle> {
        self.insight.lifecycle(request_id)
    }

    /// The `n` cached prefixes lookups found most often (`now` for their ages). `&mut`: the
    /// block index's queued changes are applied first.
    pub fn hottest(&mut self, now: f64, n: usize) -> Vec<HotPrefix> {
        self.insight.hottest(now, n)
    }

    /// Also collect KV cache events (what entered and left the local cache, and who caused
    /// it), for publishers.
    pub fn with_events(mut self) -> Self {
        self.events = Some(Vec::new());
        self
    }

    /// KV cache events since the last call, in the order they happened.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn cause(&self, slot: u32) -> Option<EventCause> {
        self.record(slot).map(|r| EventCause {
            handle: r.handle,
            request_id: r.label.clone(),
            session_id: r.session_id.clone(),
        })
    }

    /// Evictions become `BlockRemoved`, on behalf of the allocating request.
    fn removed(&mut self, slot: u32, kv: &crate::kv_manager::KvEffects) {
        if self.events.is_none() || kv.evicted.is_empty() {
            return;
        }
        let cause = self.cause(slot);
        if let Some(ev) = self.events.as_mut() {
            ev.push(CacheEvent::Removed {
                hashes: kv.evicted.iter().map(|e| e.hash).collect(),
                medium: Medium::Gpu,
                cause,
            });
        }
    }

    /// New cache entries become `BlockStored`, one event per run of consecutive blocks.
    fn stored(
        &mut self,
        slot: u32,
        kv: &crate::kv_manager::KvEffects,
        hashes: &[crate::hash::BlockHash],
        tokens: &[crate::TokenId],
    ) {
        if self.events.is_none() || kv.created.is_empty() {
            return;
        }
        let b = self.block_size;
        let cause = self.cause(slot);
        let (salt, lora) = self
            .record(slot)
            .map_or((None, None), |r| (r.cache_salt.clone(), r.adapter.clone()));
        let Some(ev) = self.events.as_mut() else {
            return;
        };
        let mut i = 0;
        while i < kv.created.len() {
            let start = kv.created[i] as usize;
            let mut end = start + 1;
            while i + 1 < kv.created.len() && kv.created[i + 1] as usize == end {
                i += 1;
                end += 1;
            }
            i += 1;
            let (Some(run), Some(toks)) = (hashes.get(start..end), tokens.get(start * b..end * b))
            else {
                continue;
            };
            ev.push(CacheEvent::Stored {
                hashes: run.to_vec(),
                parent: start.checked_sub(1).and_then(|p| hashes.get(p)).copied(),
                token_ids: toks.to_vec(),
                block_size: b as u32,
                lora_name: lora.clone(),
                cache_salt: salt.clone(),
                medium: Medium::Gpu,
                cause: cause.clone(),
            });
        }
    }

    /// The step ended (the engine calls it once a step): the lifecycle records it wrote with
    /// streaming stores are made visible to every core, so that a recorder read on another
    /// thread later sees them.
    pub fn end_step(&self) {
        self.insight.end_step();
    }

    /// Monotonic totals (turn them into deltas with [`crate::stats::DeltaTracker`]).
    pub fn totals(&self) -> CounterTotals {
        self.totals
    }

    /// Finished-request records since the last call.
    pub fn take_finished(&mut self) -> Vec<FinishedRequestStats> {
        std::mem::take(&mut self.finished)
    }

    /// Latency samples since the last call. The buffers start the next interval with the
    /// room this one needed (a decode step pushes one sample per running request).
    pub fn take_latency_samples(&mut self) -> LatencySamples {
        let next = LatencySamples {
            ttft_s: Vec::with_capacity(self.samples.ttft_s.len()),
            itl_s: Vec::with_capacity(self.samples.itl_s.len()),
        };
        std::mem::replace(&mut self.samples, next)
    }

    /// Reports for first-token and final updates since the last call, as (slot, report), in
    /// the order of the updates they belong to; at most one per slot and update. The vector
    /// keeps its room for the next step's (a report is large: grown from nothing every step,
    /// it was copied as it grew).
    pub fn drain_reports(&mut self) -> std::vec::Drain<'_, (u32, Report)> {
        self.reports.drain(..)
    }

    /// Whether any report is pending (cheap check for the common decode step).
    pub fn has_reports(&self) -> bool {
        !self.reports.is_empty()
    }

    /// The live request's stats so far (tests, the inspector).
    pub fn request_stats(&self, slot: u32) -> Option<PrefillStats> {
        self.record(slot).map(|r| r.stats)
    }

    fn record(&self, slot: u32) -> Option<&Record> {
        self.records.get(slot as usize).and_then(|r| r.as_ref())
    }

    /// Fix a request's logical fields (spec §3) and add them to the totals, once: `external`
    /// tokens came from the tier (0 when none, or when its loads failed).
    fn settle(
        totals: &mut CounterTotals,
        insight: &mut Insight,
        b: usize,
        r: &mut Record,
        external: usize,
    ) {
        if r.settled {
            return;
        }
        r.settled = true;
        let local = r.lookup.map_or(0, |l| l.local_hit_tokens) as u64;
        let ext = external as u64;
        let prompt = (r.prompt_len - r.retained) as u64;
        let cached = local + ext;
        let miss = match r.lookup {
            None => MissTokens {
                lookup_skipped: prompt - cached,
                ..MissTokens::default()
            },
            Some(_) => MissTokens {
                load_failed: ((r.ins.pending_blocks * b) as u64).saturating_sub(ext),
                ..r.ins.miss
            },
        };
        totals.add_miss(&miss);
        // The predicted prefix's tokens from `cached` on were computed: each for its miss reason.
        let shortfall = match (r.ins.predicted, r.lookup) {
            (None, _) => MissTokens::default(),
            (Some(p), None) => MissTokens {
                lookup_skipped: (p as u64).saturating_sub(r.retained as u64 + cached),
                ..MissTokens::default()
            },
            (Some(p), Some(_)) => {
                let failed_from = local + ext;
                let failed_to = local + (r.ins.pending_blocks * b) as u64;
                MissTokens {
                    load_failed: (p as u64).clamp(failed_from, failed_to.max(failed_from))
                        - failed_from,
                    ..r.ins.shortfall
                }
            }
        };
        if let Some(p) = r.ins.predicted {
            totals.add_shortfall(p as u64, &shortfall);
        }
        if let Some(t) = insight.tenant_mut(r.ins.tenant) {
            t.prompt_tokens += prompt;
            t.cached_tokens += cached;
        }
        let s = &mut r.stats;
        s.prompt_tokens = prompt;
        s.local_cached_tokens = local;
        s.external_cached_tokens = ext;
        s.cached_tokens = cached;
        s.computed_tokens = prompt - cached;
        s.miss_tokens = miss;
        s.predicted_tokens = r.ins.predicted.map(|p| p as u64);
        s.shortfall_tokens = shortfall;
        r.creation_floor = r.retained + (local + ext) as usize;
        if r.lookup.is_some_and(|l| l.external_consulted) {
            totals.external_prefix_cache_hits += ext;
        }
        totals.prompt_tokens += prompt;
        totals.prompt_tokens_local_compute += prompt - cached;
        totals.prompt_tokens_local_cache_hit += local;
        totals.prompt_tokens_external_kv_transfer += ext;
        totals.prompt_tokens_cached += cached;
        totals.prompt_tokens_cached_device += local;
    }

    /// Queue `report` for `slot`, replacing one queued for the same slot in this step (a
    /// request whose first token was also its last).
    fn push_report(&mut self, slot: u32, report: Report) {
        if let Some(last) = self.reports.last_mut() {
            if last.0 == slot && last.1.finished.is_none() {
                last.1 = report;
                return;
            }
        }
        self.reports.push((slot, report));
    }
}

impl Observer for Recorder {
    /// The decode step's effect (a token appended to a request past its first) is handled
    /// inline at the call site; everything else out of line.
    #[inline]
    fn observe(&mut self, effect: Effect<'_>) {
        if let Effect::Sampled {
            slot,
            now,
            first: false,
            same_step,
        } = effect
        {
            self.totals.generation_tokens += 1;
            if same_step {
                return;
            }
            if let Some(last) = self.last_token.get_mut(slot as usize) {
                self.samples.itl_s.push((now - *last).max(0.0));
                *last = now;
            }
            return;
        }
        self.observe_rest(&effect);
    }
}

impl Recorder {
    #[inline(never)]
    fn observe_rest(&mut self, effect: &Effect<'_>) {
        let b = self.block_size;
        match *effect {
            Effect::Arrived {
                slot,
                handle,
                label,
                prompt_len,
                max_tokens,
                arrival,
                cache_salt,
                adapter,
                tenant,
                session,
                predicted_tokens,
            } => {
                let mut ins = self.insight.arrived(slot, tenant, cache_salt, adapter);
                ins.predicted = predicted_tokens.map(|p| p.min(prompt_len as u64) as usize);
                let i = slot as usize;
                if self.records.len() <= i {
                    self.records.resize_with(i + 1, || None);
                    self.last_token.resize(i + 1, 0.0);
                }
                self.last_token[i] = arrival;
                let session_base = match session {
                    Some(s) => {
                        let base = self.sessions.remove(&s.session_id);
                        if s.continued() {
                            base.unwrap_or_default()
                        } else {
                            SessionTotals::default()
                        }
                    }
                    None => SessionTotals::default(),
                };
                self.records[i] = Some(Record {
                    finalized: false,
                    handle,
                    label: label.clone(),
                    session_id: session.map(|s| s.session_id.clone()),
                    prompt_len,
                    max_tokens,
                    times: RequestTimes {
                        arrival,
                        ..Default::default()
                    },
                    stats: PrefillStats::default(),
                    admitted: false,
                    settled: false,
                    creation_floor: 0,
                    num_preemptions: 0,
                    lookup: None,
                    retained: 0,
                    session_base,
                    external: ExternalSources::default(),
                    cache_salt: cache_salt.map(str::to_string),
                    adapter: adapter.map(str::to_string),
                    seq: 0,
                    ins,
                });
            }
            Effect::Admitted {
                slot,
                now,
                first,
                lookup,
                retained,
                num_computed: _,
                kv,
                tokens,
                hashes,
                blocks,
                pool,
            } => {
                let (totals, insight) = (&mut self.totals, &mut self.insight);
                let Some(r) = self.records.get_mut(slot as usize).and_then(|r| r.as_mut()) else {
                    return;
                };
                let hits = lookup.map_or(0, |l| l.local_hit_tokens / b);
                insight.hits(slot, blocks, hashes, hits, first, now);
                insight.allocated(Some(slot), pool, kv, blocks);
                if first {
                    r.admitted = true;
                    r.times.first_scheduled = Some(now);
                    r.retained = retained;
                    r.lookup = lookup;
                    if let Some(l) = lookup {
                        totals.prefix_cache_queries += l.queried_tokens as u64;
                        totals.prefix_cache_hits += l.local_hit_tokens as u64;
                        if l.external_consulted {
                            totals.external_prefix_cache_queries +=
                                (l.queried_tokens - l.local_hit_tokens) as u64;
                        }
                        let li = insight.first_lookup(
                            slot,
                            &mut r.ins,
                            pool,
                            tokens,
                            r.prompt_len,
                            hashes,
                            blocks,
                            l.local_hit_tokens,
                            l.external_pending_tokens,
                        );
                        if insight.estimates() {
                            totals.estimated_hits_2x += li.estimated_hits[0];
                            totals.estimated_hits_4x += li.estimated_hits[1];
                        }
                        if let Some(at) = li.diverged_at {
                            r.stats.diverged_at = Some(at);
                            totals.diverged_requests += 1;
                            if at < 64 {
                                totals.diverged_requests_within_64 += 1;
                            }
                        }
                        if let Some(t) = insight.tenant_mut(r.ins.tenant) {
                            t.prefix_cache_queries += l.queried_tokens as u64;
                            t.prefix_cache_hits += l.local_hit_tokens as u64;
                        }
                    }
                    if lookup.is_none_or(|l| l.external_pending_tokens == 0) {
                        Self::settle(totals, insight, b, r, 0);
                    }
                } else if let Some(l) = lookup {
                    totals.preempted_prefix_cache_queries += l.queried_tokens as u64;
                    totals.preempted_prefix_cache_hits += l.local_hit_tokens as u64;
                }
                insight.trim();
                let (alloc, evicted) = (kv.allocated as u64, kv.evicted.len() as u64);
                totals.blocks_allocated += alloc;
                totals.blocks_evicted += evicted;
                if !r.finalized {
                    r.stats.blocks_allocated += alloc;
                    r.stats.blocks_evicted += evicted;
                }
                self.removed(slot, kv);
            }
            Effect::LoadsResolved {
                slot,
                sources,
                failed_tokens: _,
            } => {
                let (totals, insight) = (&mut self.totals, &mut self.insight);
                if let Some(r) = self.records.get_mut(slot as usize).and_then(|r| r.as_mut()) {
                    let from = r.ins.local_blocks;
                    insight.loaded(slot, from, sources.len());
                    for &t in sources {
                        let n = b as u64;
                        match t {
                            TierTag::Host => {
                                r.external.host += n;
                                totals.prompt_tokens_cached_host += n;
                            }
                            TierTag::Redis => {
                                r.external.redis += n;
                                totals.prompt_tokens_cached_redis += n;
                            }
                            TierTag::Disk => {
                                r.external.disk += n;
                                totals.prompt_tokens_cached_disk += n;
                            }
                        }
                    }
                    Self::settle(totals, insight, b, r, sources.len() * b);
                }
            }
            Effect::Allocated {
                slot,
                kv,
                blocks,
                pool,
            } => {
                let (alloc, evicted) = (kv.allocated as u64, kv.evicted.len() as u64);
                self.totals.blocks_allocated += alloc;
                self.totals.blocks_evicted += evicted;
                let r = self.records.get_mut(slot as usize).and_then(|r| r.as_mut());
                let live = r.map(|r| {
                    if !r.finalized {
                        r.stats.blocks_allocated += alloc;
                        r.stats.blocks_evicted += evicted;
                    }
                    slot
                });
                self.insight.allocated(live, pool, kv, blocks);
                self.insight.trim();
                self.removed(slot, kv);
            }
            Effect::Preempted { slot } => {
                self.totals.num_preemptions += 1;
                if let Some(r) = self.records.get_mut(slot as usize).and_then(|r| r.as_mut()) {
                    self.insight.preempted(slot);
                    r.num_preemptions += 1;
                    if !r.finalized {
                        r.stats.preemptions += 1;
                    }
                }
            }
            Effect::Computed {
                slot,
                now,
                prefill,
                kv,
                hashes,
                tokens,
                blocks,
                pool,
            } => {
                self.totals.blocks_filled += kv.filled as u64;
                self.stored(slot, kv, hashes, tokens);
                let table = insight::Table {
                    pool,
                    blocks,
                    hashes,
                    tokens,
                };
                let Some(r) = self.records.get_mut(slot as usize).and_then(|r| r.as_mut()) else {
                    let label = Arc::from("");
                    self.insight.filled(None, &label, table, kv, now);
                    return;
                };
                self.insight.filled(Some(slot), &r.label, table, kv, now);
                if !prefill || r.finalized {
                    return;
                }
                r.stats.prefill_chunks += 1;
                r.stats.blocks_filled += kv.filled as u64;
                for &i in &kv.created {
                    let lo = (i as usize * b).max(r.creation_floor);
                    let hi = ((i as usize + 1) * b).min(r.prompt_len);
                    r.stats.cache_creation_tokens += hi.saturating_sub(lo) as u64;
                }
                r.creation_floor = r.creation_floor.max(kv.committed_until);
            }
            Effect::Sampled {
                slot,
                now,
                first,
                same_step,
            } => {
                self.totals.generation_tokens += 1;
                if same_step && !first {
                    return;
                }
                let Some(r) = self.records.get_mut(slot as usize).and_then(|r| r.as_mut()) else {
                    return;
                };
                if first && !r.finalized {
                    r.finalized = true;
                    r.times.first_token = Some(now);
                    self.totals.cache_creation_tokens += r.stats.cache_creation_tokens;
                    self.samples.ttft_s.push((now - r.times.arrival).max(0.0));
                    let session = r.session_id.is_some().then(|| {
                        let mut t = r.session_base;
                        t.add(&r.stats, &r.times);
                        t
                    });
                    let report = Report {
                        prefill_stats: Some(r.stats),
                        external: r.external,
                        times: r.times,
                        session,
                        finished: None,
                        divergence: r.ins.divergence.clone(),
                    };
                    if let Some(last) = self.last_token.get_mut(slot as usize) {
                        *last = now;
                    }
                    self.push_report(slot, report);
                } else if let Some(last) = self.last_token.get_mut(slot as usize) {
                    self.samples.itl_s.push((now - *last).max(0.0));
                    *last = now;
                }
            }
            Effect::Finished {
                slot,
                now,
                reason,
                generation_tokens,
                parked,
            } => {
                let Some(mut r) = self.records.get_mut(slot as usize).and_then(|r| r.take()) else {
                    return;
                };
                if r.admitted {
                    Self::settle(&mut self.totals, &mut self.insight, b, &mut r, 0);
                    if !r.finalized {
                        // Ended during prefill: its creation count ends here, and counts once.
                        self.totals.cache_creation_tokens += r.stats.cache_creation_tokens;
                    }
                }
                r.times.finished = Some(now);
                let prefill_stats = r.admitted.then_some(r.stats);
                let session = r.session_id.as_ref().map(|id| {
                    let mut t = r.session_base;
                    if r.admitted {
                        t.add(&r.stats, &r.times);
                    }
                    if parked {
                        self.sessions.insert(id.clone(), t);
                    }
                    t
                });
                let finished = FinishedRequestStats {
                    handle: r.handle,
                    request_id: r.label,
                    finish_reason: reason,
                    prompt_tokens: r.prompt_len as u64,
                    generation_tokens: generation_tokens as u64,
                    max_tokens: r.max_tokens,
                    prefill_stats,
                    times: r.times,
                    num_preemptions: r.num_preemptions,
                };
                self.finished.push(finished.clone());
                let divergence = r.ins.divergence.take();
                self.insight.finished(
                    slot,
                    r.ins,
                    &finished.request_id,
                    r.handle,
                    reason,
                    r.prompt_len as u64,
                    generation_tokens as u64,
                    prefill_stats,
                    r.seq,
                );
                self.push_report(
                    slot,
                    Report {
                        prefill_stats,
                        external: r.external,
                        times: r.times,
                        session,
                        finished: Some(finished),
                        divergence,
                    },
                );
            }
            Effect::Forked {
                parent,
                child,
                seq,
                now,
                kv,
                blocks,
                pool,
            } => {
                // A sequence of its parent's request: no prompt of its own (the parent's stats
                // cover it, computed once), its first token drawn now.
                let Some(p) = self.record(parent) else {
                    return;
                };
                let times = RequestTimes {
                    arrival: p.times.arrival,
                    first_scheduled: p.times.first_scheduled,
                    first_token: Some(now),
                    finished: None,
                };
                let mut rec = Record {
                    finalized: true,
                    handle: p.handle,
                    label: p.label.clone(),
                    session_id: None,
                    prompt_len: 0,
                    max_tokens: p.max_tokens,
                    times,
                    stats: PrefillStats::default(),
                    admitted: false,
                    settled: true,
                    creation_floor: 0,
                    num_preemptions: 0,
                    lookup: None,
                    retained: 0,
                    session_base: SessionTotals::default(),
                    external: ExternalSources::default(),
                    cache_salt: p.cache_salt.clone(),
                    adapter: p.adapter.clone(),
                    seq,
                    ins: RequestInsight::default(),
                };
                let tenant = p.ins.tenant;
                rec.ins = self.insight.forked(parent, child, tenant);
                let i = child as usize;
                if self.records.len() <= i {
                    self.records.resize_with(i + 1, || None);
                    self.last_token.resize(i + 1, 0.0);
                }
                self.records[i] = Some(rec);
                self.last_token[i] = now;
                if let Some(p) = self
                    .records
                    .get_mut(parent as usize)
                    .and_then(|r| r.as_mut())
                {
                    p.ins.shared = true;
                }
                self.insight.allocated(Some(child), pool, kv, blocks);
                self.insight.trim();
                self.totals.generation_tokens += 1;
                self.totals.blocks_allocated += kv.allocated as u64;
                self.totals.blocks_evicted += kv.evicted.len() as u64;
                self.samples.ttft_s.push((now - times.arrival).max(0.0));
                self.removed(child, kv);
                self.push_report(
                    child,
                    Report {
                        prefill_stats: None,
                        external: ExternalSources::default(),
                        times,
                        session: None,
                        finished: None,
                        divergence: None,
                    },
                );
            }
            Effect::SessionReleased { session_id } => {
                self.sessions.remove(session_id);
            }
            Effect::CacheReset { dropped } => {
                self.insight.reset(dropped);
                if let Some(ev) = self.events.as_mut() {
                    ev.push(CacheEvent::AllCleared {
                        medium: Medium::Gpu,
                    });
                }
            }
        }
    }
}
