//! Resumable sessions (spec §5): a table of parked block tables that the scheduler consults.
//!
//! A request with a `session_id` is a *turn*. When a turn finishes (not aborted), its block
//! table and the tokens whose KV was computed are *parked* here instead of being freed. The next
//! turn of that session whose prompt extends those tokens under the same cache keys
//! *continues*: it starts with the retained KV. Anything else (no parked session, edited
//! history, other salt or adapter) releases the parked blocks — full ones stay in the prefix
//! cache — and the turn starts afresh. Parked sessions expire after an idle timeout, and the
//! least recently parked are released when all parked blocks exceed a budget.
//!
//! The table also knows each session's turn in flight: at most one per session (the engine
//! refuses a second one), and closing a session aborts it.
//!
//! Across a restart ([`SessionRecord`], kept by a disk KV tier): the parked sessions' tokens and
//! keys are written at shutdown and read back at start as *restorable*. A restorable session
//! holds no KV; its next turn whose prompt extends its tokens is `restored`: looked up like any
//! request (its blocks come back from the disk tier as external hits) and parked again.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::hash::ExtraKeys;
use crate::kv_manager::{KvCacheManager, ReqKv};
use crate::stats::PrefillStats;
use crate::{BlockId, TokenId};

/// Whether a session turn could continue the parked KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    /// The parked KV was extended by this turn.
    Continued,
    /// No parked session had this id (never seen, closed, expired or released): a new session.
    New,
    /// A parked session existed but the prompt did not extend its tokens (edited history) or
    /// used other cache keys (salt, adapter): it was released and this turn started afresh.
    HistoryMismatch,
    /// The session was parked before a restart and the prompt extends its tokens: no KV was
    /// retained here, so the turn was looked up (its KV loaded from the disk tier where held).
    Restored,
}

/// How a session turn was served (decision facts; its stats come from the recorder).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub session_id: Arc<str>,
    pub status: SessionStatus,
    /// 1 for the first turn of a session.
    pub turn: u32,
    /// Tokens whose KV was kept from earlier turns (not looked up, not computed).
    pub retained_tokens: u64,
    /// Tokens of the whole prompt the turn was sent with (retained + this chunk).
    pub total_prompt_tokens: u64,
}

impl SessionInfo {
    pub fn continued(&self) -> bool {
        self.status == SessionStatus::Continued
    }

    /// Tokens of the whole prompt whose KV was not computed for this turn (retained or hit):
    /// the `cached` figure of the turn's API usage.
    pub fn turn_cached_tokens(&self, chunk: &PrefillStats) -> u64 {
        self.retained_tokens + chunk.cached_tokens
    }
}

/// A finished turn whose KV is kept for the next one.
#[derive(Debug)]
struct Parked {
    /// Tokens whose KV is valid (the last sampled token, never computed, is dropped).
    tokens: Vec<TokenId>,
    kv: ReqKv,
    parked_at: f64,
    turns: u32,
}

/// What a new turn starts with.
#[derive(Debug)]
pub struct TurnStart {
    /// The retained block table (empty unless the turn continues).
    pub kv: ReqKv,
    /// Tokens whose KV is retained.
    pub retained: usize,
    pub info: SessionInfo,
}

/// A parked session as a restart keeps it: what the next process needs to recognise its next
/// turn. `key` is the session's key (the id under its tenant, as the engine names it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub key: String,
    pub tokens: Vec<TokenId>,
    pub turns: u32,
    pub cache_salt: Option<String>,
    pub adapter: Option<String>,
    /// Seconds the session has been idle (parked) when the record was taken.
    pub idle_s: f64,
}

/// A session known from before a restart.
#[derive(Debug)]
struct Restorable {
    tokens: Vec<TokenId>,
    extra: ExtraKeys,
    turns: u32,
    /// Engine time at which it expires (its idle timeout, counted from before the restart).
    expires_at: f64,
}

#[derive(Debug)]
pub struct SessionTable {
    parked: HashMap<Arc<str>, Parked>,
    restorable: HashMap<Arc<str>, Restorable>,
    /// Session → the slot of its turn in flight.
    active: HashMap<Arc<str>, u32>,
    idle_timeout_s: f64,
    budget_blocks: usize,
}

impl SessionTable {
    pub fn new(idle_timeout_s: f64, budget_blocks: usize) -> Self {
        SessionTable {
            parked: HashMap::new(),
            restorable: HashMap::new(),
            active: HashMap::new(),
            idle_timeout_s,
            budget_blocks,
        }
    }

    /// A turn of this session is in flight.
    pub fn is_busy(&self, session_id: &str) -> bool {
        self.active.contains_key(session_id)
    }

    /// The slot of the session's turn in flight.
    pub fn active_turn(&self, session_id: &str) -> Option<u32> {
        self.active.get(session_id).copied()
    }

    /// Start a turn of `id` for the request in `slot`: continue the parked KV when `prompt`
    /// extends its tokens under the same keys, else release it and start afresh.
    pub fn begin_turn(
        &mut self,
        id: Arc<str>,
        slot: u32,
        prompt: &[TokenId],
        extra: ExtraKeys,
        kvm: &mut KvCacheManager,
    ) -> TurnStart {
        let mut start = TurnStart {
            kv: ReqKv::new(extra),
            retained: 0,
            info: SessionInfo {
                session_id: id.clone(),
                status: SessionStatus::New,
                turn: 1,
                retained_tokens: 0,
                total_prompt_tokens: prompt.len() as u64,
            },
        };
        if let Some(mut p) = self.parked.remove(&id) {
            let extends = *p.kv.extra == *start.kv.extra
                && prompt.len() > p.tokens.len()
                && prompt.starts_with(&p.tokens);
            if extends {
                start.retained = p.tokens.len();
                start.kv = p.kv;
                start.info.status = SessionStatus::Continued;
                start.info.turn = p.turns + 1;
                start.info.retained_tokens = start.retained as u64;
            } else {
                start.info.status = SessionStatus::HistoryMismatch;
                kvm.free(&mut p.kv);
            }
        } else if let Some(r) = self.restorable.remove(&id) {
            let extends = r.extra == *start.kv.extra
                && prompt.len() > r.tokens.len()
                && prompt.starts_with(&r.tokens);
            if extends {
                start.info.status = SessionStatus::Restored;
                start.info.turn = r.turns + 1;
            } else {
                start.info.status = SessionStatus::HistoryMismatch;
            }
        }
        self.active.insert(id, slot);
        start
    }

    /// Sessions from before a restart, now restorable (those already past their idle timeout
    /// are dropped). `now`: engine time.
    pub fn restore(&mut self, records: Vec<SessionRecord>, now: f64) {
        for r in records {
            let left = self.idle_timeout_s - r.idle_s;
            if left <= 0.0 || r.tokens.is_empty() {
                continue;
            }
            self.restorable.insert(
                Arc::from(r.key),
                Restorable {
                    tokens: r.tokens,
                    extra: ExtraKeys {
                        adapter: r.adapter,
                        cache_salt: r.cache_salt,
                    },
                    turns: r.turns,
                    expires_at: now + left,
                },
            );
        }
    }

    /// Every parked or still restorable session as a restart keeps it, sorted by key.
    pub fn records(&self, now: f64) -> Vec<SessionRecord> {
        let parked = self.parked.iter().map(|(k, p)| SessionRecord {
            key: k.to_string(),
            tokens: p.tokens.clone(),
            turns: p.turns,
            cache_salt: p.kv.extra.cache_salt.clone(),
            adapter: p.kv.extra.adapter.clone(),
            idle_s: (now - p.parked_at).max(0.0),
        });
        let restorable = self.restorable.iter().map(|(k, r)| SessionRecord {
            key: k.to_string(),
            tokens: r.tokens.clone(),
            turns: r.turns,
            cache_salt: r.extra.cache_salt.clone(),
            adapter: r.extra.adapter.clone(),
            idle_s: (self.idle_timeout_s - (r.expires_at - now)).max(0.0),
        });
        let mut out: Vec<SessionRecord> = parked.chain(restorable).collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// The turn of `id` ended. `park`: keep `kv` for the next turn (the tokens whose KV it
    /// holds); otherwise the caller frees the blocks.
    pub fn end_turn(&mut self, id: &str, park: Option<(Vec<TokenId>, ReqKv, u32)>, now: f64) {
        self.active.remove(id);
        if let Some((tokens, kv, turns)) = park {
            self.parked.insert(
                Arc::from(id),
                Parked {
                    tokens,
                    kv,
                    parked_at: now,
                    turns,
                },
            );
        }
    }

    /// Release a parked session now (its full blocks stay cached). False if none is parked.
    pub fn release(&mut self, session_id: &str, kvm: &mut KvCacheManager) -> bool {
        let restorable = self.restorable.remove(session_id).is_some();
        match self.parked.remove(session_id) {
            Some(mut p) => {
                kvm.free(&mut p.kv);
                true
            }
            None => restorable,
        }
    }

    /// Release parked sessions idle past the timeout, then the least recently parked ones
    /// until the parked blocks fit the budget. Returns the ids released.
    pub fn expire(&mut self, now: f64, kvm: &mut KvCacheManager) -> Vec<Arc<str>> {
        if !self.restorable.is_empty() {
            self.restorable.retain(|_, r| r.expires_at >= now);
        }
        if self.parked.is_empty() {
            return Vec::new();
        }
        let timeout = self.idle_timeout_s;
        let mut lru: Vec<(f64, Arc<str>, usize)> = self
            .parked
            .iter()
            .map(|(k, p)| (p.parked_at, k.clone(), p.kv.blocks.len()))
            .collect();
        lru.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
        let mut held: usize = lru.iter().map(|e| e.2).sum();
        let mut released = Vec::new();
        for (parked_at, id, n) in lru {
            if now - parked_at > timeout || held > self.budget_blocks {
                held -= n;
                self.release(&id, kvm);
                released.push(id);
            }
        }
        released
    }

    pub fn is_parked(&self, session_id: &str) -> bool {
        self.parked.contains_key(session_id)
    }

    /// Tokens whose KV a parked session holds.
    pub fn parked_tokens(&self, session_id: &str) -> Option<&[TokenId]> {
        self.parked.get(session_id).map(|p| p.tokens.as_slice())
    }

    pub fn num_parked(&self) -> usize {
        self.parked.len()
    }

    pub fn parked_blocks(&self) -> usize {
        self.parked.values().map(|p| p.kv.blocks.len()).sum()
    }

    /// Every block held by a parked session (for the ref-count invariant).
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.parked
            .values()
            .flat_map(|p| p.kv.blocks.iter().copied())
    }
}
