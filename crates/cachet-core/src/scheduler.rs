//! Continuous batching with chunked prefill, preemption by recompute and external KV loads
//! (spec §2).
//!
//! One engine step is `schedule(now)` → executor → `update(plan, results, now)`. Running
//! requests are served first (oldest admission first); when the pool is exhausted the most
//! recently admitted request (FCFS) or the least important one (priority policy) is preempted:
//! its blocks are freed and it goes back to the front of the waiting queue. Waiting requests are
//! admitted only in steps without a preemption. A request whose prompt continues in an external
//! tier waits for those blocks ([`Scheduler::resolve_loads`]) while the others keep stepping.
//!
//! The scheduler decides and nothing else: every effect of a decision goes to its
//! [`Observer`] (the recorder keeps the accounting), and no decision can read what an observer
//! computed (see [`crate::observe`]). Sessions are the [`SessionTable`]'s.

use std::collections::VecDeque;
use std::sync::Arc;

use thiserror::Error;

use crate::block_pool::Evicted;
use crate::exec::Sampled;
use crate::hash::{BlockHash, ExtraKeys, HashSeed};
use crate::kv_manager::{KvCacheManager, KvEffects, ReqKv};
use crate::observe::{Effect, Lookup, Observer};
use crate::recorder::Report;
use crate::request::{FinishReason, SamplingParams, ValidRequest};
use crate::sessions::{SessionInfo, SessionTable};
use crate::stats::{Gauges, SpecDecodeCounts};
use crate::tier::{KvLoadRequest, KvLookup, TierTag};
use crate::{BlockId, TokenId};

#[path = "fork.rs"]
mod fork;
#[path = "spec_decode.rs"]
pub mod spec_decode;
#[path = "step.rs"]
mod step;

use spec_decode::{SpecConfig, SpecDecodeStats, SpecState};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SchedulingPolicy {
    #[default]
    Fcfs,
    /// Lowest `priority` value first; ties by arrival. Preempts the least important request.
    Priority,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Most requests running (or waiting for their loads) at once.
    pub max_num_seqs: usize,
    /// Cap on the tokens one prefill chunk may take in a step (0: no cap).
    pub long_prefill_token_threshold: usize,
    /// Prompt + generated tokens of one request.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    pub policy: SchedulingPolicy,
    /// The model's end-of-sequence tokens.
    pub eos_token_ids: Vec<TokenId>,
    /// Requests waiting for admission beyond which new ones are refused.
    pub max_waiting_requests: usize,
    /// A parked session idle longer than this (seconds) is released.
    pub session_idle_timeout_s: f64,
    /// Most blocks all parked sessions may hold; the least recently used are released first.
    pub session_kv_budget_blocks: usize,
    /// List in each plan the cache entries its allocations evicted (a host tier offloads them
    /// before they are overwritten).
    pub report_evictions: bool,
    /// List after each update the blocks that became new cache entries (a tier saves them).
    pub report_new_entries: bool,
    /// Prompt-lookup speculative decoding (off: `None`).
    pub speculative: Option<SpecConfig>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            block_size: 16,
            num_blocks: 1024,
            max_num_batched_tokens: 2048,
            max_num_seqs: 128,
            long_prefill_token_threshold: 0,
            max_model_len: 8192,
            enable_prefix_caching: true,
            policy: SchedulingPolicy::Fcfs,
            eos_token_ids: Vec::new(),
            max_waiting_requests: 1024,
            session_idle_timeout_s: 300.0,
            session_kv_budget_blocks: 512,
            report_evictions: false,
            report_new_entries: false,
            speculative: None,
        }
    }
}

impl SchedulerConfig {
    /// The static limits a request must fit.
    pub fn limits(&self) -> crate::request::RequestLimits {
        crate::request::RequestLimits {
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
        }
    }
}

/// Why a valid request was refused now (what depends on the engine's state).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AddError {
    #[error("the waiting queue is full ({waiting} requests)")]
    QueueFull { waiting: usize },
    #[error("session {0:?} already has a turn in flight")]
    SessionBusy(Arc<str>),
}

/// One request's work in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub slot: u32,
    pub start_pos: usize,
    pub num_tokens: usize,
    /// The chunk reaches the end of the known tokens: a token is sampled.
    pub sample: bool,
    /// Draft tokens at the end of the chunk (speculative decoding; counted in `num_tokens`).
    pub drafts: usize,
}

/// The plan of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub chunks: Vec<ScheduledChunk>,
    /// Requests admitted this step that wait for external blocks.
    pub kv_loads: Vec<KvLoadRequest>,
    /// Requests preempted while making this plan.
    pub preempted: Vec<u32>,
    /// Cache entries this plan's allocations evicted (with `report_evictions`): their blocks
    /// still hold the old KV until the step executes.
    pub evicted: Vec<Evicted>,
    /// Block copies the executor must do first (copy-on-write of forked sequences' partial
    /// blocks): `(source, destination)`.
    pub copies: Vec<(BlockId, BlockId)>,
}

impl SchedulerOutput {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.num_tokens).sum()
    }
    /// Nothing to execute: no chunk and no copy.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.copies.is_empty()
    }
}

/// What happened to one request in a step (or on abort), named by its slot (a request's slot
/// is its own until its final update) and handle.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestUpdate {
    pub slot: u32,
    pub handle: u64,
    pub token: Option<Sampled>,
    /// `token` is the request's first output token.
    pub first_token: bool,
    pub finish: Option<FinishReason>,
    /// Session turns: how the turn was served (on the first-token and final updates).
    pub session: Option<Box<SessionInfo>>,
    /// The recorder's numbers for this update (first token and final updates), attached by the
    /// owner of the recorder; the scheduler always leaves it `None`.
    pub report: Option<Box<Report>>,
    /// Which of the request's `n` sequences this is (0 for the first).
    pub seq: u32,
    /// Requests with prompt logprobs: one per prompt token after the first, on the first-token
    /// update (or the final one with `max_tokens: 0`).
    pub prompt_logprobs: Option<Box<Vec<Sampled>>>,
    /// Speculative decoding on: this sequence's draft counts (final update only).
    pub spec_decode: Option<SpecDecodeCounts>,
}

impl RequestUpdate {
    fn new(slot: u32, handle: u64, seq: u32) -> Self {
        RequestUpdate {
            slot,
            handle,
            token: None,
            first_token: false,
            finish: None,
            session: None,
            report: None,
            seq,
            prompt_logprobs: None,
            spec_decode: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Waiting,
    /// Admitted; its external blocks are being loaded.
    Loading,
    Running,
}

/// A live request, as decisions need it. `repr(C)` with the fields a decode step touches first.
#[derive(Debug)]
#[repr(C, align(64))]
struct Request {
    kv: ReqKv,
    tokens: Vec<TokenId>,
    num_computed: usize,
    prompt_len: usize,
    status: Status,
    admitted_once: bool,
    skip_read: bool,
    priority: i32,
    handle: u64,
    /// Order of the latest admission (FCFS preemption picks the largest).
    admit_seq: u64,
    arrival: f64,
    sampling: SamplingParams,
    session: Option<Box<SessionInfo>>,
    /// The sampling of the sequences still to fork at the first token (`n - 1` of them, each
    /// with its own seed and constraint; empty: none).
    forks: Vec<SamplingParams>,
    /// Which sequence of its request this is.
    seq: u32,
    /// Prompt logprobs asked for (alternatives per token), and those computed so far.
    prompt_lp: Option<u32>,
    prompt_lps: Vec<Sampled>,
    /// Speculative decoding: the planned chunk's drafts and the request's counts.
    spec: SpecState,
}

impl Request {
    fn has_output(&self) -> bool {
        self.tokens.len() > self.prompt_len
    }
}

/// Most output tokens a request's token buffer reserves room for at admission.
const MAX_OUTPUT_RESERVE: usize = 1024;

/// How an admission went.
enum Admission {
    /// Running, with this many tokens scheduled.
    Running(usize),
    /// Waiting for its external blocks.
    Loading,
}

pub struct Scheduler<O: Observer = ()> {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    sessions: SessionTable,
    slots: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    loading: Vec<u32>,
    /// Some slot in `running` is empty (its request finished); see `compact_running`.
    running_gone: bool,
    next_admit_seq: u64,
    /// Effects of the operation in progress (one buffer, reused).
    fx: KvEffects,
    /// New cache entries since the last `take_new_entries` (with `report_new_entries`).
    new_entries: Vec<(BlockId, BlockHash)>,
    /// Copies owed to forked sequences, handed out with the next plan.
    pending_copies: Vec<(BlockId, BlockId)>,
    /// Speculation counts since the last `take_spec_stats`.
    spec_stats: SpecDecodeStats,
    obs: O,
}

impl<O: Observer> Scheduler<O> {
    pub fn new(cfg: SchedulerConfig, seed: HashSeed, observer: O) -> Self {
        let kv = KvCacheManager::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            seed,
        );
        let sessions = SessionTable::new(cfg.session_idle_timeout_s, cfg.session_kv_budget_blocks);
        Scheduler {
            cfg,
            kv,
            sessions,
            slots: Vec::new(),
            free_slots: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            loading: Vec::new(),
            running_gone: false,
            next_admit_seq: 0,
            fx: KvEffects::default(),
            new_entries: Vec::new(),
            pending_copies: Vec::new(),
            spec_stats: SpecDecodeStats::default(),
            obs: observer,
        }
    }

    /// The observer, for its owner to read. (Inside the scheduler it is only `O: Observer`.)
    pub fn observer(&self) -> &O {
        &self.obs
    }

    pub fn observer_mut(&mut self) -> &mut O {
        &mut self.obs
    }

    /// The observer, mutably, beside the KV manager (for a reader that settles the
    /// observer's deferred work while it reads the pool).
    pub fn observer_mut_and_kv(&mut self) -> (&mut O, &KvCacheManager) {
        (&mut self.obs, &self.kv)
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn kv_manager(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn sessions(&self) -> &SessionTable {
        &self.sessions
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests not running: waiting for admission or for their loads.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.loading.len()
    }

    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.loading.is_empty()
    }

    /// The handle of the live request in `slot`.
    pub fn handle(&self, slot: u32) -> Option<u64> {
        self.slot(slot).map(|r| r.handle)
    }

    fn slot(&self, slot: u32) -> Option<&Request> {
        self.slots.get(slot as usize).and_then(|s| s.as_ref())
    }

    pub fn gauges(&self) -> Gauges {
        let pool = self.kv.pool();
        let n = pool.num_blocks().max(1) as f64;
        let live_tokens: usize = self
            .running
            .iter()
            .filter_map(|&s| self.slot(s))
            .map(|r| r.num_computed)
            .sum();
        Gauges {
            num_requests_running: self.running.len() as u64,
            num_requests_waiting: self.num_waiting() as u64,
            num_requests_waiting_for_kv: self.loading.len() as u64,
            kv_cache_usage_perc: pool.num_used() as f64 / n,
            cache_only_blocks: pool.num_cached_free() as u64,
            kv_token_occupancy_perc: live_tokens as f64 / (n * self.cfg.block_size as f64),
            num_blocks: pool.num_blocks() as u64,
            parked_sessions: self.sessions.num_parked() as u64,
            parked_session_blocks: self.sessions.parked_blocks() as u64,
        }
    }

    /// Drop every cache entry; only while no request holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        // Listed before the reset (which the pool refuses while a block is in use).
        let dropped = self.kv.pool().cached_in_queue_order();
        let done = self.kv.reset_prefix_cache();
        if done {
            self.obs.observe(Effect::CacheReset { dropped: &dropped });
        }
        done
    }

    /// Queue a validated request under the engine's `handle`. Refused only for what depends on
    /// the engine's state: a full queue, or a session with a turn in flight.
    pub fn add_request(
        &mut self,
        handle: u64,
        arrival: f64,
        req: ValidRequest,
    ) -> Result<u32, AddError> {
        if self.num_waiting() >= self.cfg.max_waiting_requests {
            return Err(AddError::QueueFull {
                waiting: self.num_waiting(),
            });
        }
        if let Some(sid) = req.session_id() {
            if self.sessions.is_busy(sid) {
                return Err(AddError::SessionBusy(sid.clone()));
            }
        }
        let mut d = req.into_draft();
        // Room for the output up front (bounded): no reallocation per generated token.
        d.prompt
            .reserve_exact((d.sampling.max_tokens as usize).min(MAX_OUTPUT_RESERVE));
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.slots.push(None);
            (self.slots.len() - 1) as u32
        });
        let extra = ExtraKeys {
            adapter: d.adapter,
            cache_salt: d.cache_salt,
        };
        let (kv, retained, session) = match d.session_id {
            Some(sid) => {
                let t = self
                    .sessions
                    .begin_turn(sid, slot, &d.prompt, extra, &mut self.kv);
                (t.kv, t.retained, Some(Box::new(t.info)))
            }
            None => (ReqKv::new(extra), 0, None),
        };
        let tenant = d
            .tenant
            .take()
            .unwrap_or_else(|| Arc::from(crate::request::DEFAULT_TENANT));
        let forks = fork::fork_sampling(&d.sampling, d.n);
        let r = Request {
            kv,
            prompt_len: d.prompt.len(),
            tokens: d.prompt,
            num_computed: retained,
            status: Status::Waiting,
            admitted_once: false,
            skip_read: d.skip_prefix_cache_read,
            priority: d.priority,
            handle,
            admit_seq: 0,
            arrival,
            sampling: d.sampling,
            session,
            forks,
            seq: 0,
            prompt_lp: d.prompt_logprobs,
            prompt_lps: Vec::new(),
            spec: SpecState::default(),
        };
        self.obs.observe(Effect::Arrived {
            slot,
            handle,
            label: &d.label,
            prompt_len: r.prompt_len,
            max_tokens: r.sampling.max_tokens,
            arrival,
            cache_salt: r.kv.extra.cache_salt.as_deref(),
            adapter: r.kv.extra.adapter.as_deref(),
            tenant: &tenant,
            session: r.session.as_deref(),
            predicted_tokens: d.predicted_cached_tokens,
        });
        self.slots[slot as usize] = Some(r);
        self.waiting.push_back(slot);
        Ok(slot)
    }

    /// Sessions parked before a restart become restorable ([`SessionTable::restore`]).
    pub fn restore_sessions(&mut self, records: Vec<crate::sessions::SessionRecord>, now: f64) {
        self.sessions.restore(records, now);
    }

    /// The parked and restorable sessions as a restart keeps them.
    pub fn session_records(&self, now: f64) -> Vec<crate::sessions::SessionRecord> {
        self.sessions.records(now)
    }

    /// Release parked sessions idle past the timeout or beyond the budget.
    pub fn expire_sessions(&mut self, now: f64) -> usize {
        let released = self.sessions.expire(now, &mut self.kv);
        for id in &released {
            self.obs.observe(Effect::SessionReleased { session_id: id });
        }
        released.len()
    }

    /// Release a parked session now (its full blocks stay cached). False if none is parked.
    pub fn release_session(&mut self, session_id: &str) -> bool {
        let done = self.sessions.release(session_id, &mut self.kv);
        if done {
            let id: Arc<str> = Arc::from(session_id);
            self.obs
                .observe(Effect::SessionReleased { session_id: &id });
        }
        done
    }

    /// The slot of the session's turn in flight.
    pub fn session_turn(&self, session_id: &str) -> Option<u32> {
        self.sessions.active_turn(session_id)
    }

    /// Plan one step. `tier` answers external lookups at first admissions.
    pub fn schedule(&mut self, now: f64, mut tier: Option<&mut dyn KvLookup>) -> SchedulerOutput {
        let mut out = SchedulerOutput {
            copies: std::mem::take(&mut self.pending_copies),
            ..Default::default()
        };
        out.chunks
            .reserve(self.running.len() + self.waiting.len().min(self.cfg.max_num_seqs));
        let mut budget = self.cfg.max_num_batched_tokens;
        let threshold = self.cfg.long_prefill_token_threshold;

        // 1. Running requests, oldest admission first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let Some(r) = self.slots[slot as usize].as_ref() else {
                i += 1;
                continue;
            };
            let mut n = r.tokens.len() - r.num_computed;
            if threshold > 0 {
                n = n.min(threshold);
            }
            n = n.min(budget);
            let mut scheduled = false;
            while let Some(r) = self.slots[slot as usize].as_mut() {
                self.fx.allocated = 0;
                self.fx.evicted.clear();
                match self
                    .kv
                    .allocate_slots(&mut r.kv, &[], r.num_computed, n, &mut self.fx)
                {
                    Ok(()) => {
                        if self.fx.allocated > 0 {
                            self.obs.observe(Effect::Allocated {
                                slot,
                                kv: &self.fx,
                                blocks: &r.kv.blocks,
                                pool: self.kv.pool(),
                            });
                            if self.cfg.report_evictions {
                                out.evicted.extend_from_slice(&self.fx.evicted);
                            }
                        }
                        scheduled = true;
                        break;
                    }
                    Err(_) => {
                        let victim = self.pick_victim();
                        let vslot = self.running[victim];
                        if let Some(pos) = out.chunks.iter().position(|c| c.slot == vslot) {
                            budget += out.chunks[pos].num_tokens;
                            out.chunks.remove(pos);
                        }
                        self.running.remove(victim);
                        if victim < i {
                            i -= 1;
                        }
                        self.preempt(vslot);
                        out.preempted.push(vslot);
                        if vslot == slot {
                            break;
                        }
                    }
                }
            }
            if scheduled {
                let mut drafts = 0;
                if let Some(r) = self.slots[slot as usize].as_mut() {
                    if let Some(sc) = &self.cfg.speculative {
                        if n == 1 && spec_decode::eligible(r) {
                            let slots = r.kv.blocks.len() * self.cfg.block_size;
                            drafts = spec_decode::plan(sc, &self.cfg, r, slots, budget - 1);
                        }
                    }
                    out.chunks.push(ScheduledChunk {
                        slot,
                        start_pos: r.num_computed,
                        num_tokens: n + drafts,
                        sample: r.num_computed + n == r.tokens.len() && r.sampling.max_tokens > 0,
                        drafts,
                    });
                }
                budget -= n + drafts;
                i += 1;
            }
        }

        // 2. Waiting requests, only if nothing was preempted this step.
        if out.preempted.is_empty() {
            while budget > 0
                && self.running.len() + self.loading.len() < self.cfg.max_num_seqs
                && !self.waiting.is_empty()
            {
                let widx = self.pick_waiting();
                let slot = self.waiting[widx];
                let tier = tier.as_mut().map(|t| &mut **t as &mut dyn KvLookup);
                match self.try_admit(slot, budget, threshold, now, &mut out, tier) {
                    Some(Admission::Running(n)) => {
                        budget -= n;
                        self.waiting.remove(widx);
                        self.running.push(slot);
                    }
                    Some(Admission::Loading) => {
                        self.waiting.remove(widx);
                        self.loading.push(slot);
                    }
                    None => break,
                }
            }
        }
        out
    }

    /// Look up, allocate and admit one waiting request.
    fn try_admit(
        &mut self,
        slot: u32,
        budget: usize,
        threshold: usize,
        now: f64,
        out: &mut SchedulerOutput,
        tier: Option<&mut dyn KvLookup>,
    ) -> Option<Admission> {
        let b = self.cfg.block_size;
        let r = self.slots[slot as usize].as_mut()?;
        let total = r.tokens.len();
        let first = !r.admitted_once;
        // A session continuation's first admission: its retained KV is its own; no lookup, and
        // the logical counts cover only the new chunk (spec §5).
        let retained = if first { r.num_computed } else { 0 };
        let do_lookup = self.kv.caching_enabled() && !r.skip_read && retained == 0;
        let hits = if do_lookup {
            // Every full prompt block is hashed now (commit would hash them anyway): the
            // observer is shown why the ones after the hit were not found.
            self.kv.hash_full_blocks(&mut r.kv, &r.tokens);
            self.kv.find_cached_prefix(&mut r.kv, &r.tokens)
        } else {
            Vec::new()
        };
        let local = hits.len() * b;
        // External tier: first admission only, for the blocks after the local hit.
        let mut ext_hashes: Vec<BlockHash> = Vec::new();
        let consulted = do_lookup && first && tier.is_some();
        if let (true, Some(tier)) = (consulted, tier) {
            let max_blocks = (total - 1) / b;
            let hashes = self
                .kv
                .block_hashes(&mut r.kv, &r.tokens, hits.len()..max_blocks);
            let k = tier.lookup(&hashes).min(hashes.len());
            ext_hashes = hashes[..k].to_vec();
        }
        let ext = ext_hashes.len() * b;
        let num_computed = retained + local;
        let n = if ext > 0 {
            ext
        } else {
            let mut n = total - num_computed;
            if threshold > 0 {
                n = n.min(threshold);
            }
            n.min(budget)
        };
        self.fx.clear();
        self.kv
            .allocate_slots(&mut r.kv, &hits, num_computed, n, &mut self.fx)
            .ok()?;

        // Admission succeeded: the lookup is reported exactly once, now.
        let lookup = do_lookup.then_some(Lookup {
            queried_tokens: total,
            local_hit_tokens: local,
            external_consulted: consulted,
            external_pending_tokens: ext,
        });
        self.obs.observe(Effect::Admitted {
            slot,
            now,
            first,
            lookup,
            retained,
            num_computed,
            kv: &self.fx,
            tokens: &r.tokens,
            hashes: if do_lookup { r.kv.hashes() } else { &[] },
            blocks: &r.kv.blocks,
            pool: self.kv.pool(),
        });
        if self.cfg.report_evictions {
            out.evicted.extend_from_slice(&self.fx.evicted);
        }
        r.admitted_once = true;
        r.num_computed = num_computed;
        r.admit_seq = self.next_admit_seq;
        self.next_admit_seq += 1;
        if ext > 0 {
            r.status = Status::Loading;
            out.kv_loads.push(KvLoadRequest {
                slot,
                handle: r.handle,
                blocks: ext_hashes
                    .into_iter()
                    .enumerate()
                    .map(|(j, h)| (r.kv.blocks[hits.len() + j], h))
                    .collect(),
            });
            return Some(Admission::Loading);
        }
        r.status = Status::Running;
        out.chunks.push(ScheduledChunk {
            slot,
            start_pos: num_computed,
            num_tokens: n,
            sample: num_computed + n == total && r.sampling.max_tokens > 0,
            drafts: 0,
        });
        Some(Admission::Running(n))
    }

    /// A waiting request's loads are done: `outcome[j]` names the tier block `j` of its
    /// [`KvLoadRequest`] came from, or `None` when it failed (missing, timed out, rejected by
    /// its integrity check). The leading intact blocks count as loaded (the executor must
    /// write exactly those, in the next step's batch); from the first failure on, every block
    /// is computed. Returns how many leading blocks to write, or `None` when the request is
    /// gone (aborted) or `handle` names another request.
    pub fn resolve_loads(
        &mut self,
        slot: u32,
        handle: u64,
        outcome: &[Option<TierTag>],
    ) -> Option<usize> {
        let b = self.cfg.block_size;
        let r = self.slots.get_mut(slot as usize)?.as_mut()?;
        if r.handle != handle || r.status != Status::Loading {
            return None;
        }
        let sources: Vec<TierTag> = outcome.iter().map_while(|o| *o).collect();
        let loaded = sources.len();
        r.num_computed += loaded * b;
        r.status = Status::Running;
        self.obs.observe(Effect::LoadsResolved {
            slot,
            sources: &sources,
            failed_tokens: (outcome.len() - loaded) * b,
        });
        self.loading.retain(|&s| s != slot);
        self.running.push(slot);
        Some(loaded)
    }

    /// Index in `running` of the request to preempt.
    fn pick_victim(&self) -> usize {
        let key = |s: u32| self.slot(s).map(|r| (r.admit_seq, r.priority, r.arrival));
        let mut best = 0;
        for (i, &s) in self.running.iter().enumerate().skip(1) {
            let (Some(k), Some(b)) = (key(s), key(self.running[best])) else {
                continue;
            };
            let worse = match self.cfg.policy {
                // Most recently admitted.
                SchedulingPolicy::Fcfs => k.0 > b.0,
                // Least important, then latest arrival.
                SchedulingPolicy::Priority => k.1 > b.1 || (k.1 == b.1 && k.2 > b.2),
            };
            if worse {
                best = i;
            }
        }
        best
    }

    /// Index in `waiting` of the next request to admit.
    fn pick_waiting(&self) -> usize {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => 0,
            SchedulingPolicy::Priority => {
                let key = |s: u32| self.slot(s).map(|r| (r.priority, r.arrival));
                let mut best = 0;
                for (i, &s) in self.waiting.iter().enumerate().skip(1) {
                    let (Some(k), Some(b)) = (key(s), key(self.waiting[best])) else {
                        continue;
                    };
                    if k.0 < b.0 || (k.0 == b.0 && k.1 < b.1) {
                        best = i;
                    }
                }
                best
            }
        }
    }

    fn preempt(&mut self, slot: u32) {
        let Some(r) = self.slots[slot as usize].as_mut() else {
            return;
        };
        self.kv.free(&mut r.kv);
        r.num_computed = 0;
        r.status = Status::Waiting;
        self.obs.observe(Effect::Preempted { slot });
        self.waiting.push_front(slot);
    }

    /// End the live request in `slot` now (client abort, a stop string found by the frontend,
    /// an engine error). Its blocks are freed. `None` when the slot is empty.
    pub fn finish(&mut self, slot: u32, reason: FinishReason, now: f64) -> Option<RequestUpdate> {
        self.slot(slot)?;
        let update = self.finish_slot(slot, reason, now);
        self.compact_running();
        Some(update)
    }

    /// Drop finished requests from `running` (before their slots can be reused).
    fn compact_running(&mut self) {
        if std::mem::take(&mut self.running_gone) {
            let slots = &self.slots;
            self.running.retain(|&s| slots[s as usize].is_some());
        }
    }

    fn finish_slot(&mut self, slot: u32, reason: FinishReason, now: f64) -> RequestUpdate {
        let Some(mut r) = self.slots[slot as usize].take() else {
            let mut u = RequestUpdate::new(slot, 0, 0);
            u.finish = Some(reason);
            return u;
        };
        self.free_slots.push(slot);
        match r.status {
            // Left in `running` as an empty slot until `compact_running`: removing each
            // finished request on its own would scan the running list once per finish.
            Status::Running => self.running_gone = true,
            Status::Waiting => self.waiting.retain(|&s| s != slot),
            Status::Loading => self.loading.retain(|&s| s != slot),
        }
        let mut parked = false;
        match &r.session {
            // A finished session turn keeps its KV: every token whose KV was computed (the
            // last sampled token never was). An aborted or failed turn releases the session.
            Some(info)
                if matches!(reason, FinishReason::Stop | FinishReason::Length)
                    && r.num_computed > 0 =>
            {
                let mut tokens = r.tokens.clone();
                tokens.truncate(r.num_computed);
                let kv = std::mem::take(&mut r.kv);
                self.sessions
                    .end_turn(&info.session_id, Some((tokens, kv, info.turn)), now);
                parked = true;
            }
            Some(info) => {
                self.sessions.end_turn(&info.session_id, None, now);
                self.kv.free(&mut r.kv);
            }
            None => self.kv.free(&mut r.kv),
        }
        self.obs.observe(Effect::Finished {
            slot,
            now,
            reason,
            generation_tokens: r.tokens.len() - r.prompt_len,
            parked,
        });
        let mut u = RequestUpdate::new(slot, r.handle, r.seq);
        u.finish = Some(reason);
        u.session = r.session;
        u.spec_decode = self.cfg.speculative.is_some().then_some(r.spec.counts);
        u
    }

    /// Per-request snapshot for tests: (prompt + output tokens, blocks held).
    pub fn debug_request(&self, slot: u32) -> Option<(Vec<TokenId>, Vec<BlockId>)> {
        let r = self.slot(slot)?;
        Some((r.tokens.clone(), r.kv.blocks.clone()))
    }

    /// Structural check used by tests: pool invariants, every ref count equals the tables
    /// holding the block, and every running request's table covers its computed tokens.
    pub fn check_invariants(&self) -> Result<(), String> {
        let pool = self.kv.pool();
        pool.check_invariants()?;
        let mut refs = vec![0u32; pool.num_blocks()];
        for b in self.sessions.held_blocks() {
            refs[b as usize] += 1;
        }
        for (slot, r) in self.slots.iter().enumerate() {
            let Some(r) = r else { continue };
            for &b in &r.kv.blocks {
                refs[b as usize] += 1;
            }
            if r.kv.blocks.len() < self.kv.blocks_for(r.num_computed) {
                return Err(format!("request in slot {slot} has too few blocks"));
            }
        }
        for (b, &n) in refs.iter().enumerate() {
            if pool.ref_count(b as BlockId) != n {
                return Err(format!(
                    "block {b}: ref count {} but {n} tables hold it",
                    pool.ref_count(b as BlockId)
                ));
            }
        }
        Ok(())
    }
}
