//! Requests as the core sees them: token ids, sampling parameters and cache options.

use serde::{Deserialize, Serialize};

use crate::TokenId;

/// How a request's tokens are chosen. Plain data: the executor interprets it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Generate at least this many tokens before EOS may end the request.
    pub min_tokens: u32,
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0.0 disables min-p.
    pub min_p: f32,
    /// 1.0 disables the repetition penalty.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Same seed, same output, whatever else is in the batch.
    pub seed: Option<u64>,
    /// Token ids that end the request (reason `stop`).
    pub stop_token_ids: Vec<TokenId>,
    /// Do not stop at the model's EOS tokens.
    pub ignore_eos: bool,
    /// Return the log-probability of each sampled token and this many alternatives.
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            min_tokens: 0,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: u32) -> Self {
        SamplingParams {
            max_tokens,
            ..Default::default()
        }
    }
}

/// A request handed to [`crate::Scheduler::add_request`].
#[derive(Clone, Debug, PartialEq)]
pub struct NewRequest {
    /// The caller's id: used in stats and logs.
    pub request_id: String,
    pub prompt: Vec<TokenId>,
    pub sampling: SamplingParams,
    /// Tenant isolation: blocks hashed under another salt are never shared.
    pub cache_salt: Option<String>,
    /// Adapter identity (mixed into every block hash).
    pub adapter: Option<String>,
    /// Lower value = more important (as in vLLM's priority policy).
    pub priority: i32,
    /// Do not read the prefix cache (e.g. prompt logprobs are requested); full blocks are still
    /// written.
    pub skip_prefix_cache_read: bool,
    /// Arrival time in seconds on the engine's clock.
    pub arrival_time: f64,
    /// Resumable session (spec §5): keep this request's KV when it finishes, and continue a
    /// parked session of this id when `prompt` extends its retained tokens.
    pub session_id: Option<String>,
}

impl NewRequest {
    pub fn new(
        request_id: impl Into<String>,
        prompt: Vec<TokenId>,
        sampling: SamplingParams,
    ) -> Self {
        NewRequest {
            request_id: request_id.into(),
            prompt,
            sampling,
            cache_salt: None,
            adapter: None,
            priority: 0,
            skip_prefix_cache_read: false,
            arrival_time: 0.0,
            session_id: None,
        }
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or (set by the frontend) a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    /// Aborted by the client or the server.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}
