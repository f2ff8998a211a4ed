//! Usage and per-request metrics objects: formatting of the engine's numbers, nothing computed
//! beyond the sums and differences the APIs define.

use cachet_core::stats::SpecDecodeCounts;
use cachet_core::{PrefillStats, Report, SessionInfo};
use serde_json::{json, Value};

use crate::generate::Final;

/// The three prompt-side numbers every API's usage is built from: (prompt, cached, created).
///
/// A plain request: the engine's prefill stats as they are. A session turn (spec §5): the client
/// sent the whole conversation, so `prompt` is the whole prompt of the turn, `cached` every token
/// whose KV was not computed for it (retained from earlier turns, or a prefix-cache hit; the
/// engine's [`SessionInfo::turn_cached_tokens`]) and `created` the turn's own chunk
/// cache-creation count.
fn prompt_numbers(
    prefill: Option<&PrefillStats>,
    session: Option<&SessionInfo>,
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
    fn prefill(&self) -> Option<&PrefillStats> {
        self.report.as_ref().and_then(|r| r.prefill_stats.as_ref())
    }

    fn numbers(&self) -> (u64, u64, u64) {
        let fallback = self
            .report
            .as_ref()
            .and_then(|r| r.finished.as_ref())
            .map_or(self.prompt_len as u64, |f| f.prompt_tokens);
        prompt_numbers(self.prefill(), self.session.as_ref(), fallback)
    }

    /// Prompt tokens as the engine counted them (a session turn: the whole prompt sent).
    pub fn prompt_tokens(&self) -> u64 {
        self.numbers().0
    }

    /// Generated tokens as the engine counted them.
    pub fn completion_tokens(&self) -> u64 {
        self.report
            .as_ref()
            .and_then(|r| r.finished.as_ref())
            .map_or(self.tokens_received, |f| f.generation_tokens)
    }

    /// Prompt tokens not computed for this request (a session turn: retained + hit).
    pub fn cached_tokens(&self) -> u64 {
        self.numbers().1
    }

    pub fn cache_creation_tokens(&self) -> u64 {
        self.numbers().2
    }
}

/// OpenAI `usage`, with `prompt_tokens_details` always present: the cache-creation count under
/// OpenAI's name (`cache_write_tokens`) and vLLM's (`created_cache_tokens`), spec §7.
pub fn openai_usage(f: &Final) -> Value {
    let (prompt, cached, created) = f.numbers();
    let completion = f.completion_tokens();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": created,
            "created_cache_tokens": created,
        },
    })
}

/// OpenAI's `completion_tokens_details.reasoning_tokens` (sent when a reasoning parser runs):
/// the generated tokens whose text lay in the reasoning block, its tags included.
pub fn with_reasoning_tokens(usage: &mut Value, reasoning_tokens: u64) {
    usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning_tokens});
}

/// The Responses API's `usage` (spec §7): `input_tokens` the whole prompt (a continued turn:
/// the whole conversation), `input_tokens_details.cached_tokens` every token not computed for
/// this turn, `cache_write_tokens` the cache-creation count, `reasoning_tokens` the generated
/// tokens inside the model's reasoning.
pub fn responses_usage(f: &Final, reasoning_tokens: u64) -> Value {
    let (prompt, cached, created) = f.numbers();
    let output = f.completion_tokens();
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": created},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens.min(output)},
        "total_tokens": prompt + output,
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
    report: Option<&Report>,
    session: Option<&SessionInfo>,
    prompt_len: usize,
) -> Value {
    let prefill = report.and_then(|r| r.prefill_stats.as_ref());
    anthropic_usage_of(prompt_numbers(prefill, session, prompt_len as u64), 0)
}

/// The top-level `session` object of a session turn's response:
/// `{"id", "continued", "status": "continued"|"new"|"history_mismatch"|"restored", "turn"}`.
pub fn session_json(s: &SessionInfo) -> Value {
    json!({
        "id": cachet_core::request::session_id_of_key(&s.session_id),
        "continued": s.continued(),
        "status": s.status,
        "turn": s.turn,
    })
}

/// Every field of spec §3: the engine's [`PrefillStats`] as they serialize, plus the two times
/// derived from the request's timestamps.
pub fn prefix_cache_json(p: &PrefillStats, queue_s: f64, prefill_s: f64) -> Value {
    let mut v = serde_json::to_value(p).unwrap_or_else(|_| json!({}));
    v["queue_time_ms"] = json!(queue_s * 1000.0);
    v["prefill_time_ms"] = json!(prefill_s * 1000.0);
    v
}

/// `metrics.spec_decode` with speculative decoding on: the request's
/// `{"num_drafts", "num_draft_tokens", "num_accepted_tokens"}`, summed over its sequences, and
/// with `n > 1` each sequence's own in `choices: [{"index", ...the three}]` (index = the
/// sequence, 0-based, of every sequence generated). `None` when speculation is off.
pub fn spec_decode_json(per_seq: &[Option<SpecDecodeCounts>]) -> Option<Value> {
    if per_seq.iter().all(Option::is_none) {
        return None;
    }
    let mut total = SpecDecodeCounts::default();
    for c in per_seq.iter().flatten() {
        total.accumulate(c);
    }
    let mut v = json!(total);
    if per_seq.len() > 1 {
        v["choices"] = per_seq
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let mut j = json!(c.as_ref()?);
                j["index"] = json!(i);
                Some(j)
            })
            .collect();
    }
    Some(v)
}

/// The top-level `metrics` object of `--enable-per-request-metrics`. `prefix_cache` is the
/// request's (a session turn: the turn's own chunk) stats, with `external_sources` naming the
/// tier of its external tokens; a session turn adds `session`:
/// `{"session_continued", "retained_tokens", "cumulative": {every spec §3 field}}`; speculative
/// decoding adds `spec_decode` ([`spec_decode_json`]).
pub fn request_metrics_json(f: &Final) -> Value {
    let rep = f.report.as_ref();
    let fin = rep.and_then(|r| r.finished.as_ref());
    let times = fin.map(|x| x.times).or(rep.map(|r| r.times));
    let gen = fin.map_or(0, |x| x.generation_tokens);
    let decode_ms = times.map(|t| t.decode_s() * 1000.0);
    let mut v = json!({
        "queue_time_ms": times.map(|t| t.queue_s() * 1000.0),
        "time_to_first_token_ms": times.and_then(|t| t.ttft_s()).map(|t| t * 1000.0),
        "generation_time_ms": decode_ms,
        "mean_itl_ms": fin.map(|x| x.time_per_output_token_s().map_or(0.0, |t| t * 1000.0)),
        "tokens_per_second": times.map(|t| if t.e2e_s() > 0.0 { gen as f64 / t.e2e_s() } else { 0.0 }),
        "prefix_cache": rep.and_then(|r| {
            let p = r.prefill_stats.as_ref()?;
            let t = times.unwrap_or(r.times);
            let mut j = prefix_cache_json(p, t.queue_s(), t.prefill_s());
            j["external_sources"] = json!(r.external);
            // Where the prompt left a cached one (same tenant only), with the tokens around.
            if let Some(d) = &r.divergence {
                j["divergence"] = json!(d);
                if let Some(t) = &f.divergence_text {
                    j["divergence"]["text"] = t.clone();
                }
            }
            Some(j)
        }),
    });
    if let Some(sd) = spec_decode_json(&f.spec_decode) {
        v["spec_decode"] = sd;
    }
    if let (Some(s), Some(cum)) = (&f.session, rep.and_then(|r| r.session)) {
        v["session"] = json!({
            "session_continued": s.continued(),
            "retained_tokens": s.retained_tokens,
            "cumulative": prefix_cache_json(&cum.stats, cum.queue_s, cum.prefill_s),
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(d: u64, t: u64, a: u64) -> Option<SpecDecodeCounts> {
        Some(SpecDecodeCounts {
            num_drafts: d,
            num_draft_tokens: t,
            num_accepted_tokens: a,
        })
    }

    #[test]
    fn spec_decode_is_absent_when_off_and_summed_over_choices() {
        assert_eq!(spec_decode_json(&[]), None);
        assert_eq!(spec_decode_json(&[None, None]), None);
        // One sequence: the three counts, no `choices`.
        assert_eq!(
            spec_decode_json(&[c(2, 7, 3)]),
            Some(json!({"num_drafts": 2, "num_draft_tokens": 7, "num_accepted_tokens": 3}))
        );
        // n = 3: 2+0+4 drafts, 7+0+9 tokens, 3+0+8 accepted; a sequence without counts (its
        // final never came) is left out of `choices`.
        assert_eq!(
            spec_decode_json(&[c(2, 7, 3), c(0, 0, 0), c(4, 9, 8), None]),
            Some(json!({
                "num_drafts": 6, "num_draft_tokens": 16, "num_accepted_tokens": 11,
                "choices": [
                    {"index": 0, "num_drafts": 2, "num_draft_tokens": 7, "num_accepted_tokens": 3},
                    {"index": 1, "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0},
                    {"index": 2, "num_drafts": 4, "num_draft_tokens": 9, "num_accepted_tokens": 8},
                ],
            }))
        );
    }
}
