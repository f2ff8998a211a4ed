//! Continuous batching with chunked prefill, preemption by recompute and exact per-request
//! prefill accounting (spec §2-§3, §6).
//!
//! One engine step is `schedule(now)` → executor → `update(output, results, now)`. Running
//! requests are served first (oldest admission first); when the pool is exhausted the most
//! recently admitted request (FCFS) or the least important one (priority policy) is preempted:
//! its blocks are freed and it goes back to the front of the waiting queue. Waiting requests are
//! admitted only in steps without a preemption. A request's lookup is recorded exactly once, at
//! the admission whose allocation succeeded.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use thiserror::Error;

use crate::connector::KvConnector;
use crate::exec::{ExecBatch, SampleSpec, Sampled, SeqChunk};
use crate::hash::{BlockHash, ExtraKeys, HashSeed};
use crate::kv_manager::{KvCacheManager, ReqKv};
use crate::request::{FinishReason, NewRequest, SamplingParams};
use crate::stats::{CounterTotals, FinishedRequestStats, Gauges, PrefillStats};
use crate::{BlockId, TokenId};

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
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Cap on the tokens one prefill chunk may take in a step (0: no cap).
    pub long_prefill_token_threshold: usize,
    /// Prompt + generated tokens of one request.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    pub policy: SchedulingPolicy,
    /// The model's end-of-sequence tokens.
    pub eos_token_ids: Vec<TokenId>,
    /// Reporting on or off. Off: every counter and stat stays zero; decisions are identical.
    pub telemetry: bool,
    /// A parked session idle longer than this (seconds) is released.
    pub session_idle_timeout_s: f64,
    /// Most blocks all parked sessions may hold; the least recently used are released first.
    pub session_kv_budget_blocks: usize,
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
            telemetry: true,
            session_idle_timeout_s: 300.0,
            session_kv_budget_blocks: 512,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AddRequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt_tokens} tokens; the model's context is {max_model_len} and at least one token must be generated")]
    PromptTooLong {
        prompt_tokens: usize,
        max_model_len: usize,
    },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("the request needs {needed} KV blocks but the pool has only {available}")]
    CannotFit { needed: usize, available: usize },
    #[error("a request with id {0:?} is already live")]
    DuplicateId(String),
    #[error("session {0:?} already has a turn in flight")]
    SessionBusy(String),
}

/// Whether a session turn could continue the parked KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    /// The parked KV was extended by this turn.
    Continued,
    /// No parked session had this id (never seen, closed, expired or released): a new session.
    New,
    /// A parked session existed but the prompt did not extend its tokens (edited history) or
    /// used other cache keys (salt, adapter): it was released and this turn started afresh.
    HistoryMismatch,
}

/// How a session turn was served (spec §5), reported with its first and final outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionReport {
    pub session_id: Arc<str>,
    /// This turn continued the parked session's KV (false: new or fallen-back session).
    pub continued: bool,
    pub status: SessionStatus,
    /// 1 for the first turn of a session.
    pub turn: u32,
    /// Tokens whose KV was kept from earlier turns (not looked up, not computed).
    pub retained_tokens: u64,
    /// Tokens of the whole prompt the turn was sent with (retained + this chunk).
    pub total_prompt_tokens: u64,
    /// Sum of every turn's chunk stats, this one included.
    pub cumulative: PrefillStats,
}

impl SessionReport {
    /// Tokens of the whole prompt whose KV was not computed for this turn (retained or hit):
    /// the `cached` figure of the turn's API usage.
    pub fn turn_cached_tokens(&self, chunk: &PrefillStats) -> u64 {
        self.retained_tokens + chunk.cached_tokens
    }
}

/// A finished session turn whose KV is kept for the next one.
#[derive(Debug)]
struct ParkedSession {
    /// Tokens whose KV is valid (the last sampled token, never computed, is dropped).
    tokens: Vec<TokenId>,
    kv: ReqKv,
    parked_at: f64,
    cumulative: PrefillStats,
    turns: u32,
}

/// One request's work in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub slot: u32,
    pub start_pos: usize,
    pub num_tokens: usize,
    /// The chunk reaches the end of the known tokens: a token is sampled.
    pub sample: bool,
}

/// A block the executor must fill from the external tier instead of computing it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLoad {
    pub slot: u32,
    pub block: BlockId,
    pub hash: BlockHash,
}

/// The plan of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub chunks: Vec<ScheduledChunk>,
    pub kv_loads: Vec<KvLoad>,
    /// Requests preempted while making this plan.
    pub preempted: Vec<u32>,
}

impl SchedulerOutput {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.num_tokens).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

/// What happened to one request in a step (or on abort).
///
/// A request is named by its slot (what [`Scheduler::add_request`] returned), which stays its
/// own until its final update; [`Scheduler::request_id`] maps a live slot to its id and the
/// final update carries the id in `finished`. (A per-token id would cost every update a
/// reference-count round trip on a cold cache line.)
#[derive(Clone, Debug, PartialEq)]
pub struct RequestUpdate {
    pub slot: u32,
    pub token: Option<Sampled>,
    pub finish: Option<FinishReason>,
    /// Set on the update carrying the first output token, and on the final update.
    pub prefill_stats: Option<Box<PrefillStats>>,
    /// For session turns: set with `prefill_stats`.
    pub session: Option<Box<SessionReport>>,
    /// On the final update: the request's id, finish reason, timings and stats (the same record
    /// [`Scheduler::take_finished`] hands to the loggers).
    pub finished: Option<Box<FinishedRequestStats>>,
}

/// Latency samples observed in a step (seconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatencySamples {
    pub ttft_s: Vec<f64>,
    pub itl_s: Vec<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Waiting,
    Running,
}

/// A live request. `repr(C)` with the fields a decode step touches first (id, tokens, block
/// table, positions, stop conditions), so a step reads about three cache lines per request
/// instead of fields scattered over ten.
#[derive(Debug)]
#[repr(C, align(64))]
struct Request {
    kv: ReqKv,
    id: Arc<str>,
    tokens: Vec<TokenId>,
    num_computed: usize,
    prompt_len: usize,
    last_token: f64,
    status: Status,
    /// The first output token exists: `stats` is final.
    finalized: bool,
    admitted_once: bool,
    skip_read: bool,
    priority: i32,
    sampling: SamplingParams,
    /// Order of the latest admission (FCFS preemption picks the largest).
    admit_seq: u64,
    /// Prompt positions below this are not counted as cache creation (again).
    creation_floor: usize,
    arrival: f64,
    first_scheduled: Option<f64>,
    first_token: Option<f64>,
    num_preemptions: u64,
    stats: PrefillStats,
    session: Option<SessionState>,
}

#[derive(Debug)]
struct SessionState {
    id: Arc<str>,
    /// The first admission continues retained KV (no lookup; logical counts exclude it).
    continuation: bool,
    continued: bool,
    status: SessionStatus,
    retained: usize,
    base: PrefillStats,
    turn: u32,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    connector: Option<Box<dyn KvConnector>>,
    slots: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    ids: HashMap<Arc<str>, u32>,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    /// Some slot in `running` is empty (its request finished); see `compact_running`.
    running_gone: bool,
    next_admit_seq: u64,
    totals: CounterTotals,
    finished: Vec<FinishedRequestStats>,
    samples: LatencySamples,
    parked: HashMap<Arc<str>, ParkedSession>,
    active_sessions: HashMap<Arc<str>, u32>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, seed: HashSeed) -> Self {
        let kv = KvCacheManager::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            seed,
            cfg.telemetry,
        );
        Scheduler {
            cfg,
            kv,
            connector: None,
            slots: Vec::new(),
            free_slots: Vec::new(),
            ids: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            running_gone: false,
            next_admit_seq: 0,
            totals: CounterTotals::default(),
            finished: Vec::new(),
            samples: LatencySamples::default(),
            parked: HashMap::new(),
            active_sessions: HashMap::new(),
        }
    }

    /// Attach an external KV tier (looked up at first admission, after the local cache).
    pub fn with_connector(mut self, connector: Box<dyn KvConnector>) -> Self {
        self.connector = Some(connector);
        self
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn kv_manager(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn is_live(&self, request_id: &str) -> bool {
        self.ids.contains_key(request_id)
    }

    /// The id of the live request in `slot`.
    pub fn request_id(&self, slot: u32) -> Option<&str> {
        self.slot(slot).map(|r| &*r.id)
    }

    /// Monotonic totals (turn them into deltas with [`crate::stats::DeltaTracker`]).
    pub fn totals(&self) -> CounterTotals {
        let pool = self.kv.pool().counters();
        CounterTotals {
            blocks_allocated: pool.blocks_allocated,
            blocks_filled: pool.blocks_filled,
            blocks_evicted: pool.blocks_evicted,
            ..self.totals
        }
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
            num_requests_waiting: self.waiting.len() as u64,
            kv_cache_usage_perc: pool.num_used() as f64 / n,
            cache_only_blocks: pool.num_cached_free() as u64,
            kv_token_occupancy_perc: live_tokens as f64 / (n * self.cfg.block_size as f64),
            num_blocks: pool.num_blocks() as u64,
            parked_sessions: self.parked.len() as u64,
            parked_session_blocks: self.parked.values().map(|p| p.kv.blocks.len() as u64).sum(),
        }
    }

    /// Finished-request stats since the last call.
    pub fn take_finished(&mut self) -> Vec<FinishedRequestStats> {
        std::mem::take(&mut self.finished)
    }

    /// TTFT and inter-token latency samples since the last call.
    pub fn take_latency_samples(&mut self) -> LatencySamples {
        std::mem::take(&mut self.samples)
    }

    /// Drop every cache entry; only while no request holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_prefix_cache()
    }

    pub fn add_request(&mut self, req: NewRequest) -> Result<u32, AddRequestError> {
        let n = req.prompt.len();
        if n == 0 {
            return Err(AddRequestError::EmptyPrompt);
        }
        if n >= self.cfg.max_model_len {
            return Err(AddRequestError::PromptTooLong {
                prompt_tokens: n,
                max_model_len: self.cfg.max_model_len,
            });
        }
        if req.sampling.max_tokens == 0 {
            return Err(AddRequestError::ZeroMaxTokens);
        }
        let max_len = (n + req.sampling.max_tokens as usize).min(self.cfg.max_model_len);
        let needed = self.kv.blocks_for(max_len);
        if needed > self.cfg.num_blocks {
            return Err(AddRequestError::CannotFit {
                needed,
                available: self.cfg.num_blocks,
            });
        }
        if self.ids.contains_key(req.request_id.as_str()) {
            return Err(AddRequestError::DuplicateId(req.request_id));
        }
        if let Some(sid) = &req.session_id {
            if self.active_sessions.contains_key(sid.as_str()) {
                return Err(AddRequestError::SessionBusy(sid.clone()));
            }
        }
        let id: Arc<str> = Arc::from(req.request_id);
        let extra = ExtraKeys {
            adapter: req.adapter,
            cache_salt: req.cache_salt,
        };
        // Resumable session: continue the parked KV when the prompt extends it under the same
        // keys; otherwise release it (its full blocks stay cached) and start afresh.
        let mut kv = ReqKv::new(extra.clone());
        let mut num_computed = 0;
        let mut session = None;
        if let Some(sid) = req.session_id {
            let sid: Arc<str> = Arc::from(sid);
            let mut state = SessionState {
                id: sid.clone(),
                continuation: false,
                continued: false,
                status: SessionStatus::New,
                retained: 0,
                base: PrefillStats::default(),
                turn: 1,
            };
            if let Some(mut parked) = self.parked.remove(&sid) {
                let extends = *parked.kv.extra == extra
                    && req.prompt.len() > parked.tokens.len()
                    && req.prompt.starts_with(&parked.tokens);
                if extends {
                    num_computed = parked.tokens.len();
                    kv = parked.kv;
                    state.continuation = true;
                    state.continued = true;
                    state.status = SessionStatus::Continued;
                    state.retained = num_computed;
                    state.base = parked.cumulative;
                    state.turn = parked.turns + 1;
                } else {
                    state.status = SessionStatus::HistoryMismatch;
                    self.kv.free(&mut parked.kv);
                }
            }
            self.active_sessions.insert(sid, 0);
            session = Some(state);
        }
        let request = Request {
            id: id.clone(),
            tokens: req.prompt,
            prompt_len: n,
            sampling: req.sampling,
            priority: req.priority,
            skip_read: req.skip_prefix_cache_read,
            arrival: req.arrival_time,
            status: Status::Waiting,
            num_computed,
            kv,
            admitted_once: false,
            admit_seq: 0,
            stats: PrefillStats::default(),
            finalized: false,
            creation_floor: 0,
            first_scheduled: None,
            first_token: None,
            last_token: req.arrival_time,
            num_preemptions: 0,
            session,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(request);
                s
            }
            None => {
                self.slots.push(Some(request));
                (self.slots.len() - 1) as u32
            }
        };
        self.ids.insert(id, slot);
        if let Some(sid) = self
            .slot(slot)
            .and_then(|r| r.session.as_ref())
            .map(|st| st.id.clone())
        {
            self.active_sessions.insert(sid, slot);
        }
        self.waiting.push_back(slot);
        Ok(slot)
    }

    /// Release parked sessions idle past the timeout, then the least recently used ones until
    /// the parked blocks fit the budget. Their full blocks stay in the prefix cache.
    pub fn expire_sessions(&mut self, now: f64) -> usize {
        let timeout = self.cfg.session_idle_timeout_s;
        let mut expired: Vec<Arc<str>> = self
            .parked
            .iter()
            .filter(|(_, p)| now - p.parked_at > timeout)
            .map(|(k, _)| k.clone())
            .collect();
        let mut held: usize = self.parked.values().map(|p| p.kv.blocks.len()).sum();
        for k in &expired {
            held -= self.parked.get(k).map_or(0, |p| p.kv.blocks.len());
        }
        if held > self.cfg.session_kv_budget_blocks {
            let mut lru: Vec<(f64, Arc<str>, usize)> = self
                .parked
                .iter()
                .filter(|(k, _)| !expired.contains(k))
                .map(|(k, p)| (p.parked_at, k.clone(), p.kv.blocks.len()))
                .collect();
            lru.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
            for (_, k, n) in lru {
                if held <= self.cfg.session_kv_budget_blocks {
                    break;
                }
                held -= n;
                expired.push(k);
            }
        }
        for k in &expired {
            self.release_session(k);
        }
        expired.len()
    }

    /// Release a parked session now (its full blocks stay cached). False if none is parked.
    pub fn release_session(&mut self, session_id: &str) -> bool {
        match self.parked.remove(session_id) {
            Some(mut p) => {
                self.kv.free(&mut p.kv);
                true
            }
            None => false,
        }
    }

    /// The id of the live request that is a turn of `session_id`, if one is in flight.
    pub fn session_turn(&self, session_id: &str) -> Option<&str> {
        let slot = *self.active_sessions.get(session_id)?;
        self.request_id(slot)
    }

    /// Whether a session is parked (its KV held).
    pub fn is_parked(&self, session_id: &str) -> bool {
        self.parked.contains_key(session_id)
    }

    /// Tokens whose KV a parked session holds.
    pub fn parked_tokens(&self, session_id: &str) -> Option<&[TokenId]> {
        self.parked.get(session_id).map(|p| p.tokens.as_slice())
    }

    pub fn has_parked_sessions(&self) -> bool {
        !self.parked.is_empty()
    }

    fn slot(&self, slot: u32) -> Option<&Request> {
        self.slots.get(slot as usize).and_then(|s| s.as_ref())
    }

    /// Plan one step.
    pub fn schedule(&mut self, now: f64) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        out.chunks
            .reserve(self.running.len() + self.waiting.len().min(self.cfg.max_num_seqs));
        let mut budget = self.cfg.max_num_batched_tokens;
        let threshold = self.cfg.long_prefill_token_threshold;

        // 1. Running requests, oldest admission first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let Some(r) = self.slots[slot as usize].as_mut() else {
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
                match self.kv.allocate_slots(&mut r.kv, &[], r.num_computed, n) {
                    Ok(eff) => {
                        if self.cfg.telemetry && !r.finalized {
                            r.stats.blocks_allocated += eff.allocated;
                            r.stats.blocks_evicted += eff.evicted;
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
                if let Some(r) = self.slots[slot as usize].as_ref() {
                    out.chunks.push(ScheduledChunk {
                        slot,
                        start_pos: r.num_computed,
                        num_tokens: n,
                        sample: r.num_computed + n == r.tokens.len(),
                    });
                }
                budget -= n;
                i += 1;
            }
        }

        // 2. Waiting requests, only if nothing was preempted this step.
        if out.preempted.is_empty() {
            while budget > 0
                && self.running.len() < self.cfg.max_num_seqs
                && !self.waiting.is_empty()
            {
                let widx = self.pick_waiting();
                let slot = self.waiting[widx];
                match self.try_admit(slot, budget, threshold, now, &mut out) {
                    Some(n) => {
                        budget -= n;
                        self.waiting.remove(widx);
                        self.running.push(slot);
                    }
                    None => break,
                }
            }
        }
        out
    }

    /// Look up, allocate and record one waiting request. Returns the tokens scheduled.
    fn try_admit(
        &mut self,
        slot: u32,
        budget: usize,
        threshold: usize,
        now: f64,
        out: &mut SchedulerOutput,
    ) -> Option<usize> {
        let b = self.cfg.block_size;
        let telemetry = self.cfg.telemetry;
        let r = self.slots[slot as usize].as_mut()?;
        let total = r.tokens.len();
        // A session continuation's first admission: its retained KV is its own; no lookup, and
        // the logical counts cover only the new chunk (spec §5).
        let continuation = !r.admitted_once && r.session.as_ref().is_some_and(|st| st.continuation);
        let base = if continuation { r.num_computed } else { 0 };
        let do_lookup = self.kv.caching_enabled() && !r.skip_read && !continuation;
        let hits = if do_lookup {
            self.kv.find_cached_prefix(&mut r.kv, &r.tokens)
        } else {
            Vec::new()
        };
        let local = hits.len() * b;
        // External tier: first admission only, for the blocks after the local hit.
        let mut ext_hashes: Vec<BlockHash> = Vec::new();
        let mut ext_queried = 0;
        if do_lookup && !r.admitted_once {
            if let Some(conn) = self.connector.as_mut() {
                let max_blocks = (total - 1) / b;
                let hashes = self
                    .kv
                    .block_hashes(&mut r.kv, &r.tokens, hits.len()..max_blocks);
                ext_queried = hashes.len() * b;
                let k = conn.lookup(&hashes).min(hashes.len());
                ext_hashes = hashes[..k].to_vec();
            }
        }
        let ext = ext_hashes.len() * b;
        let num_computed = base + local + ext;
        let mut n = total - num_computed;
        if threshold > 0 {
            n = n.min(threshold);
        }
        n = n.min(budget);
        let eff = self
            .kv
            .allocate_slots(&mut r.kv, &hits, num_computed, n)
            .ok()?;

        // Admission succeeded: record the lookup exactly once.
        for (j, hash) in ext_hashes.into_iter().enumerate() {
            out.kv_loads.push(KvLoad {
                slot,
                block: r.kv.blocks[hits.len() + j],
                hash,
            });
        }
        if telemetry {
            if !r.admitted_once {
                let cached = (local + ext) as u64;
                let prompt = (total - base) as u64;
                r.stats.prompt_tokens = prompt;
                r.stats.local_cached_tokens = local as u64;
                r.stats.external_cached_tokens = ext as u64;
                r.stats.cached_tokens = cached;
                r.stats.computed_tokens = prompt - cached;
                let t = &mut self.totals;
                if do_lookup {
                    t.prefix_cache_queries += total as u64;
                    t.prefix_cache_hits += local as u64;
                }
                if ext_queried > 0 {
                    t.external_prefix_cache_queries += ext_queried as u64;
                    t.external_prefix_cache_hits += ext as u64;
                }
                t.prompt_tokens += prompt;
                t.prompt_tokens_local_compute += prompt - cached;
                t.prompt_tokens_local_cache_hit += local as u64;
                t.prompt_tokens_external_kv_transfer += ext as u64;
                t.prompt_tokens_cached += cached;
            } else if do_lookup {
                self.totals.preempted_prefix_cache_queries += total as u64;
                self.totals.preempted_prefix_cache_hits += local as u64;
            }
            if !r.finalized {
                r.stats.blocks_allocated += eff.allocated;
                r.stats.blocks_evicted += eff.evicted;
            }
        }
        if !r.admitted_once {
            r.creation_floor = num_computed;
        }
        r.admitted_once = true;
        r.status = Status::Running;
        r.num_computed = num_computed;
        r.admit_seq = self.next_admit_seq;
        self.next_admit_seq += 1;
        if r.first_scheduled.is_none() {
            r.first_scheduled = Some(now);
            if telemetry {
                r.stats.queue_time_ms = ((now - r.arrival) * 1000.0).max(0.0);
            }
        }
        out.chunks.push(ScheduledChunk {
            slot,
            start_pos: num_computed,
            num_tokens: n,
            sample: num_computed + n == total,
        });
        Some(n)
    }

    /// Index in `running` of the request to preempt.
    fn pick_victim(&self) -> usize {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => {
                // Most recently admitted.
                let mut best = 0;
                let mut best_seq = 0;
                for (i, &s) in self.running.iter().enumerate() {
                    let seq = self.slot(s).map_or(0, |r| r.admit_seq);
                    if i == 0 || seq > best_seq {
                        best = i;
                        best_seq = seq;
                    }
                }
                best
            }
            SchedulingPolicy::Priority => {
                let mut best = 0;
                let mut best_key = (i32::MIN, f64::MIN);
                for (i, &s) in self.running.iter().enumerate() {
                    let key = self
                        .slot(s)
                        .map_or((i32::MIN, f64::MIN), |r| (r.priority, r.arrival));
                    if i == 0 || key.0 > best_key.0 || (key.0 == best_key.0 && key.1 > best_key.1) {
                        best = i;
                        best_key = key;
                    }
                }
                best
            }
        }
    }

    /// Index in `waiting` of the next request to admit.
    fn pick_waiting(&self) -> usize {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => 0,
            SchedulingPolicy::Priority => {
                let mut best = 0;
                let mut best_key = (i32::MAX, f64::MAX);
                for (i, &s) in self.waiting.iter().enumerate() {
                    let key = self
                        .slot(s)
                        .map_or((i32::MAX, f64::MAX), |r| (r.priority, r.arrival));
                    if i == 0 || key.0 < best_key.0 || (key.0 == best_key.0 && key.1 < best_key.1) {
                        best = i;
                        best_key = key;
                    }
                }
                best
            }
        }
    }

    fn preempt(&mut self, slot: u32) {
        let telemetry = self.cfg.telemetry;
        let Some(r) = self.slots[slot as usize].as_mut() else {
            return;
        };
        self.kv.free(&mut r.kv);
        r.num_computed = 0;
        r.status = Status::Waiting;
        r.num_preemptions += 1;
        if telemetry {
            self.totals.num_preemptions += 1;
            if !r.finalized {
                r.stats.preemptions += 1;
            }
        }
        self.waiting.push_front(slot);
    }

    /// Borrowed views of a plan for the executor.
    pub fn exec_batch<'a>(&'a self, out: &SchedulerOutput) -> ExecBatch<'a> {
        let seqs = out
            .chunks
            .iter()
            .filter_map(|c| {
                let r = self.slot(c.slot)?;
                Some(SeqChunk {
                    slot: c.slot,
                    tokens: &r.tokens[c.start_pos..c.start_pos + c.num_tokens],
                    start_pos: c.start_pos,
                    block_table: &r.kv.blocks,
                    sample: c.sample.then(|| SampleSpec {
                        params: &r.sampling,
                        prompt: &r.tokens[..r.prompt_len],
                        output: &r.tokens[r.prompt_len..],
                    }),
                })
            })
            .collect();
        ExecBatch { seqs }
    }

    /// Apply a step's results: advance computed tokens, commit full blocks, append sampled
    /// tokens, finalize prefill stats at the first token, finish requests.
    /// `results[i]` belongs to `out.chunks[i]`.
    pub fn update(
        &mut self,
        out: &SchedulerOutput,
        results: Vec<Option<Sampled>>,
        now: f64,
    ) -> Vec<RequestUpdate> {
        let telemetry = self.cfg.telemetry;
        let mut updates = Vec::with_capacity(out.chunks.len());
        if telemetry {
            self.samples.itl_s.reserve(out.chunks.len());
        }
        for (chunk, res) in out
            .chunks
            .iter()
            .zip(results.into_iter().chain(std::iter::repeat_with(|| None)))
        {
            let Some(r) = self.slots[chunk.slot as usize].as_mut() else {
                continue;
            };
            if r.status != Status::Running || r.num_computed != chunk.start_pos {
                continue; // stale plan entry (request gone or re-planned)
            }
            r.num_computed += chunk.num_tokens;
            let creation = if r.finalized {
                0..0
            } else {
                r.creation_floor..r.prompt_len
            };
            let eff = self
                .kv
                .commit(&mut r.kv, &r.tokens, r.num_computed, creation);
            if telemetry && !r.finalized {
                r.stats.prefill_chunks += 1;
                r.stats.blocks_filled += eff.filled;
                r.stats.cache_creation_tokens += eff.creation_tokens;
            }
            if !r.finalized {
                r.creation_floor = r.creation_floor.max(eff.committed_until);
            }
            if !chunk.sample {
                continue;
            }
            let Some(sampled) = res else {
                // The executor owed a token and gave none: end the request rather than loop.
                let slot = chunk.slot;
                updates.push(self.finish_slot(slot, FinishReason::Abort, now));
                continue;
            };
            r.tokens.push(sampled.token);
            let mut first_stats = None;
            if telemetry {
                self.totals.generation_tokens += 1;
            }
            if !r.finalized {
                r.finalized = true;
                r.first_token = Some(now);
                if telemetry {
                    let start = r.first_scheduled.unwrap_or(now);
                    r.stats.prefill_time_ms = ((now - start) * 1000.0).max(0.0);
                    self.totals.cache_creation_tokens += r.stats.cache_creation_tokens;
                    self.samples.ttft_s.push((now - r.arrival).max(0.0));
                }
                first_stats = telemetry.then_some(r.stats);
            } else if telemetry {
                self.samples.itl_s.push((now - r.last_token).max(0.0));
            }
            r.last_token = now;
            let finish = self.check_stop(chunk.slot, sampled.token);
            match finish {
                Some(reason) => {
                    let mut u = self.finish_slot(chunk.slot, reason, now);
                    u.token = Some(sampled);
                    updates.push(u);
                }
                None => {
                    let session = match (&first_stats, self.slot(chunk.slot)) {
                        (Some(_), Some(r)) => Self::session_report(r, telemetry).map(Box::new),
                        _ => None,
                    };
                    updates.push(RequestUpdate {
                        slot: chunk.slot,
                        token: Some(sampled),
                        finish: None,
                        prefill_stats: first_stats.map(Box::new),
                        session,
                        finished: None,
                    });
                }
            }
        }
        self.compact_running();
        updates
    }

    fn check_stop(&self, slot: u32, token: TokenId) -> Option<FinishReason> {
        let r = self.slot(slot)?;
        let out_len = r.tokens.len() - r.prompt_len;
        let p = &r.sampling;
        let past_min = out_len >= p.min_tokens as usize;
        if past_min && !p.ignore_eos && self.cfg.eos_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if past_min && p.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if out_len >= p.max_tokens as usize || r.tokens.len() >= self.cfg.max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }

    /// End a live request now (client abort, or a stop string found by the frontend). Its blocks
    /// are freed and its stats delivered. Returns `None` for an unknown id.
    pub fn finish_request(
        &mut self,
        request_id: &str,
        reason: FinishReason,
        now: f64,
    ) -> Option<RequestUpdate> {
        let slot = *self.ids.get(request_id)?;
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
        let telemetry = self.cfg.telemetry;
        let Some(mut r) = self.slots[slot as usize].take() else {
            return RequestUpdate {
                slot,
                token: None,
                finish: Some(reason),
                prefill_stats: None,
                session: None,
                finished: None,
            };
        };
        self.free_slots.push(slot);
        self.ids.remove(&r.id);
        match r.status {
            // Left in `running` as an empty slot until `compact_running`: removing each
            // finished request on its own would scan the running list once per finish.
            Status::Running => self.running_gone = true,
            Status::Waiting => self.waiting.retain(|&s| s != slot),
        }
        if telemetry && r.admitted_once && !r.finalized {
            // Aborted during prefill: its stats end here, and count once.
            let start = r.first_scheduled.unwrap_or(now);
            r.stats.prefill_time_ms = ((now - start) * 1000.0).max(0.0);
            self.totals.cache_creation_tokens += r.stats.cache_creation_tokens;
        }
        let prefill_stats = r.admitted_once.then_some(r.stats);
        let session = Self::session_report(&r, telemetry);
        match r.session.as_ref() {
            // A finished session turn keeps its KV: every token whose KV was computed (the
            // last sampled token never was). An aborted turn releases the session.
            Some(st) if reason != FinishReason::Abort && r.num_computed > 0 => {
                self.active_sessions.remove(&st.id);
                let mut tokens = r.tokens.clone();
                tokens.truncate(r.num_computed);
                let cumulative = session.as_ref().map(|s| s.cumulative).unwrap_or_default();
                self.parked.insert(
                    st.id.clone(),
                    ParkedSession {
                        tokens,
                        kv: std::mem::take(&mut r.kv),
                        parked_at: now,
                        cumulative,
                        turns: st.turn,
                    },
                );
            }
            Some(st) => {
                self.active_sessions.remove(&st.id);
                self.kv.free(&mut r.kv);
            }
            None => self.kv.free(&mut r.kv),
        }
        let generation_tokens = (r.tokens.len() - r.prompt_len) as u64;
        let first_sched = r.first_scheduled.unwrap_or(now);
        let first_token = r.first_token.unwrap_or(now);
        let finished = FinishedRequestStats {
            request_id: r.id.to_string(),
            finish_reason: reason,
            prompt_tokens: r.prompt_len as u64,
            generation_tokens,
            prefill_stats: if telemetry { prefill_stats } else { None },
            queue_time_s: (first_sched - r.arrival).max(0.0),
            ttft_s: r.first_token.map(|t| (t - r.arrival).max(0.0)),
            e2e_s: (now - r.arrival).max(0.0),
            prefill_time_s: (first_token - first_sched).max(0.0),
            decode_time_s: r.first_token.map_or(0.0, |t| (now - t).max(0.0)),
            inference_time_s: r.first_scheduled.map_or(0.0, |t| (now - t).max(0.0)),
            num_preemptions: r.num_preemptions,
        };
        self.finished.push(finished.clone());
        RequestUpdate {
            slot,
            token: None,
            finish: Some(reason),
            prefill_stats: if telemetry {
                prefill_stats.map(Box::new)
            } else {
                None
            },
            session: session.map(Box::new),
            finished: Some(Box::new(finished)),
        }
    }

    fn session_report(r: &Request, telemetry: bool) -> Option<SessionReport> {
        let st = r.session.as_ref()?;
        let mut cumulative = st.base;
        if telemetry && r.admitted_once {
            cumulative.accumulate(&r.stats);
        }
        Some(SessionReport {
            session_id: st.id.clone(),
            continued: st.continued,
            status: st.status,
            turn: st.turn,
            retained_tokens: st.retained as u64,
            total_prompt_tokens: r.prompt_len as u64,
            cumulative,
        })
    }

    /// Per-request snapshot for tests: (prompt + output tokens, blocks held).
    pub fn debug_request(&self, request_id: &str) -> Option<(Vec<TokenId>, Vec<BlockId>)> {
        let slot = *self.ids.get(request_id)?;
        let r = self.slot(slot)?;
        Some((r.tokens.clone(), r.kv.blocks.clone()))
    }

    /// Structural check used by tests: pool invariants, and every running request's table
    /// covers its computed tokens.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.pool().check_invariants()?;
        let mut refs = vec![0u32; self.kv.pool().num_blocks()];
        for p in self.parked.values() {
            for &b in &p.kv.blocks {
                refs[b as usize] += 1;
            }
        }
        for slot in self.slots.iter().flatten() {
            for &b in &slot.kv.blocks {
                refs[b as usize] += 1;
            }
            if slot.kv.blocks.len() < self.kv.blocks_for(slot.num_computed) {
                return Err(format!("request {} has too few blocks", slot.id));
            }
        }
        for (b, &n) in refs.iter().enumerate() {
            if self.kv.pool().ref_count(b as BlockId) != n {
                return Err(format!(
                    "block {b}: ref count {} but {n} tables hold it",
                    self.kv.pool().ref_count(b as BlockId)
                ));
            }
        }
        Ok(())
    }
}
