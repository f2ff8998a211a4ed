//! Usage and per-request metrics objects: formatting of the engine's numbers, nothing computed
//! beyond the sums and differences the APIs define.

use cachet_core::PrefillStats;
use serde_json::{json, Value};

use crate::generate::Final;

impl Final {
    /// Prompt tokens as the engine counted them.
    pub fn prompt_tokens(&self) -> u64 {
        if let Some(p) = &self.prefill {
            return p.prompt_tokens;
        }
        if let Some(m) = &self.metrics {
            return m.prompt_tokens;
        }
        self.prompt_len as u64
    }

    /// Generated tokens as the engine counted them.
    pub fn completion_tokens(&self) -> u64 {
        match &self.metrics {
            Some(m) => m.generation_tokens,
            None => self.tokens_received,
        }
    }

    pub fn cached_tokens(&self) -> u64 {
        self.prefill.as_ref().map_or(0, |p| p.cached_tokens)
    }

    pub fn cache_creation_tokens(&self) -> u64 {
        self.prefill.as_ref().map_or(0, |p| p.cache_creation_tokens)
    }
}

/// OpenAI `usage`, with `prompt_tokens_details` always present.
pub fn openai_usage(f: &Final) -> Value {
    let prompt = f.prompt_tokens();
    let completion = f.completion_tokens();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": f.cached_tokens(),
            "created_cache_tokens": f.cache_creation_tokens(),
        },
    })
}

/// Anthropic `usage`: `input_tokens` is what was neither read from nor written to the cache.
pub fn anthropic_usage(f: &Final) -> Value {
    let read = f.cached_tokens();
    let creation = f.cache_creation_tokens();
    json!({
        "input_tokens": f.prompt_tokens().saturating_sub(read).saturating_sub(creation),
        "output_tokens": f.completion_tokens(),
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
    })
}

/// Anthropic `usage` of `message_start`: known before any output token.
pub fn anthropic_start_usage(prefill: Option<&PrefillStats>, prompt_len: usize) -> Value {
    let (prompt, read, creation) = match prefill {
        Some(p) => (p.prompt_tokens, p.cached_tokens, p.cache_creation_tokens),
        None => (prompt_len as u64, 0, 0),
    };
    json!({
        "input_tokens": prompt.saturating_sub(read).saturating_sub(creation),
        "output_tokens": 0,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
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

/// The top-level `metrics` object of `--enable-per-request-metrics`.
pub fn request_metrics_json(f: &Final) -> Value {
    let m = f.metrics.as_ref();
    json!({
        "queue_time_ms": m.map(|m| m.queue_time_ms),
        "time_to_first_token_ms": m.and_then(|m| m.time_to_first_token_ms),
        "generation_time_ms": m.map(|m| m.generation_time_ms),
        "mean_itl_ms": m.map(|m| m.mean_itl_ms),
        "tokens_per_second": m.map(|m| m.tokens_per_second),
        "prefix_cache": f.prefill.as_ref().map(prefix_cache_json),
    })
}
