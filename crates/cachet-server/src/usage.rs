//! Usage and per-request metrics objects: formatting of the engine's numbers, nothing computed
//! beyond the sums and differences the APIs define.

use cachet_core::PrefillStats;
use cachet_engine::SessionReport;
use serde_json::{json, Value};

use crate::generate::Final;

/// The three prompt-side numbers every API's usage is built from: (prompt, cached, created).
///
/// A plain request: the engine's prefill stats as they are. A session turn (spec §5): the client
/// sent the whole conversation, so `prompt` is the whole prompt of the turn, `cached` every token
/// whose KV was not computed for it (retained from earlier turns, or a prefix-cache hit; the
/// engine's [`SessionReport::turn_cached_tokens`]) and `created` the turn's own chunk
/// cache-creation count.
fn prompt_numbers(
    prefill: Option<&PrefillStats>,
    session: Option<&SessionReport>,
    fallback_prompt: u64,
) -> (u64, u64, u64) {
    let chunk = prefill.copied().unwrap_or_default();
    match (session, prefill) {
        (Some(s), _) => (
            s.total_prompt_tokens,
            s.turn_cached_tokens(&chunk),
            chunk.cache_creation_tokens,
        ),
        (None, Some(p)) => (p.prompt_tokens, p.cached_tokens, p.cache_creation_tokens),
        (None, None) => (fallback_prompt, 0, 0),
    }
}

impl Final {
    fn numbers(&self) -> (u64, u64, u64) {
        let fallback = match &self.metrics {
            Some(m) => m.prompt_tokens,
            None => self.prompt_len as u64,
        };
        prompt_numbers(self.prefill.as_ref(), self.session.as_deref(), fallback)
    }

    /// Prompt tokens as the engine counted them (a session turn: the whole prompt sent).
    pub fn prompt_tokens(&self) -> u64 {
        self.numbers().0
    }

    /// Generated tokens as the engine counted them.
    pub fn completion_tokens(&self) -> u64 {
        match &self.metrics {
            Some(m) => m.generation_tokens,
            None => self.tokens_received,
        }
    }

    /// Prompt tokens not computed for this request (a session turn: retained + hit).
    pub fn cached_tokens(&self) -> u64 {
        self.numbers().1
    }

    pub fn cache_creation_tokens(&self) -> u64 {
        self.numbers().2
    }
}

/// OpenAI `usage`, with `prompt_tokens_details` always present.
pub fn openai_usage(f: &Final) -> Value {
    let (prompt, cached, created) = f.numbers();
    let completion = f.completion_tokens();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": cached,
            "created_cache_tokens": created,
        },
    })
}

/// Anthropic `usage` from the prompt numbers: `input_tokens` is what was neither read from nor
/// written to the cache (never negative).
fn anthropic_usage_of((prompt, read, creation): (u64, u64, u64), output: u64) -> Value {
    json!({
        "input_tokens": prompt.saturating_sub(read).saturating_sub(creation),
        "output_tokens": output,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
    })
}

/// Anthropic `usage` of a finished request.
pub fn anthropic_usage(f: &Final) -> Value {
    anthropic_usage_of(f.numbers(), f.completion_tokens())
}

/// Anthropic `usage` of `message_start`: known before any output token.
pub fn anthropic_start_usage(
    prefill: Option<&PrefillStats>,
    session: Option<&SessionReport>,
    prompt_len: usize,
) -> Value {
    anthropic_usage_of(prompt_numbers(prefill, session, prompt_len as u64), 0)
}

/// The top-level `session` object of a session turn's response:
/// `{"id", "continued", "status": "continued"|"new"|"history_mismatch", "turn"}`.
pub fn session_json(s: &SessionReport) -> Value {
    json!({
        "id": &*s.session_id,
        "continued": s.continued,
        "status": s.status,
        "turn": s.turn,
    })
}

/// Every field of the engine's [`PrefillStats`].
pub fn prefix_cache_json(p: &PrefillStats) -> Value {
    json!({
        "prompt_tokens": p.prompt_tokens,
        "local_cached_tokens": p.local_cached_tokens,
        "external_cached_tokens": p.external_cached_tokens,
        "cached_tokens": p.cached_tokens,
        "computed_tokens": p.computed_tokens,
        "cache_creation_tokens": p.cache_creation_tokens,
        "prefill_chunks": p.prefill_chunks,
        "blocks_allocated": p.blocks_allocated,
        "blocks_filled": p.blocks_filled,
        "blocks_evicted": p.blocks_evicted,
        "preemptions": p.preemptions,
        "prefill_time_ms": p.prefill_time_ms,
        "queue_time_ms": p.queue_time_ms,
    })
}

/// The top-level `metrics` object of `--enable-per-request-metrics`. `prefix_cache` is the
/// request's (a session turn: the turn's own chunk) stats; a session turn adds `session`:
/// `{"session_continued", "retained_tokens", "cumulative": {every PrefillStats field}}`.
pub fn request_metrics_json(f: &Final) -> Value {
    let m = f.metrics.as_ref();
    let mut v = json!({
        "queue_time_ms": m.map(|m| m.queue_time_ms),
        "time_to_first_token_ms": m.and_then(|m| m.time_to_first_token_ms),
        "generation_time_ms": m.map(|m| m.generation_time_ms),
        "mean_itl_ms": m.map(|m| m.mean_itl_ms),
        "tokens_per_second": m.map(|m| m.tokens_per_second),
        "prefix_cache": f.prefill.as_ref().map(prefix_cache_json),
    });
    if let Some(s) = &f.session {
        v["session"] = json!({
            "session_continued": s.continued,
            "retained_tokens": s.retained_tokens,
            "cumulative": prefix_cache_json(&s.cumulative),
        });
    }
    v
}
