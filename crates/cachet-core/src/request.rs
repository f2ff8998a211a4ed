//! Requests as the core sees them: token ids, sampling parameters and cache options.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

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
    /// Added to the logits of these tokens before any other step (OpenAI's `logit_bias`, each
    /// in [-100, 100]; -100 in effect bans a token, +100 in effect forces it). Logprobs stay
    /// those of the raw logits.
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Which tokens may be sampled next (structured outputs, forced tool calls). Sampling data
    /// the executor interprets; the scheduler never reads it.
    #[serde(skip)]
    pub constraint: Option<Constraint>,
    /// Stop strings, checked on every generated token so a request ends at the token that
    /// completes one (reason `stop`), whatever the batch, the step timing or speculation; the
    /// text side still cuts the string from the text.
    #[serde(skip)]
    pub stop_strings: Option<StopCheck>,
}

/// A per-request rule on which tokens may come next, consulted by the executor's sampler: it
/// samples first and asks [`TokenConstraint::allows`]; only when the token is refused does it
/// compute the full [`TokenConstraint::fill_mask`] and sample again from the masked
/// distribution; then it calls [`TokenConstraint::accept`] with the token it chose.
///
/// Implementations keep their state behind interior mutability (one request, one sampler
/// thread at a time, so a lock is never contended).
pub trait TokenConstraint: Send + Sync + std::fmt::Debug {
    /// Whether `token` may come next.
    fn allows(&self, token: TokenId) -> bool;
    /// Writes the set of tokens that may come next as a bitset over the vocabulary (bit
    /// `t % 32` of word `t / 32`); `mask` is resized to `vocab_size.div_ceil(32)` words.
    fn fill_mask(&self, mask: &mut Vec<u32>);
    /// Advances past `token` (the token the sampler chose).
    fn accept(&self, token: TokenId);
    /// A second constraint in this one's present state, advancing on its own from now on: a
    /// request with `n > 1` gives each further sequence one, made before any token is accepted.
    fn fork(&self) -> Constraint;
}

/// A shared handle on one request's rule (a [`TokenConstraint`], [`StopStrings`]): plain data
/// to the scheduler's types, equal only to itself (by pointer).
#[derive(Debug)]
pub struct Shared<T: ?Sized>(pub Arc<T>);

impl<T: ?Sized> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(Arc::clone(&self.0))
    }
}

impl<T: ?Sized> std::ops::Deref for Shared<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: ?Sized> PartialEq for Shared<T> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A request's [`TokenConstraint`].
pub type Constraint = Shared<dyn TokenConstraint>;

impl Shared<dyn TokenConstraint> {
    pub fn new(c: impl TokenConstraint + 'static) -> Self {
        Shared(Arc::new(c))
    }
}

/// A request's stop strings over its generated tokens (the text side implements it on the
/// tokens' bytes). Pure: the answer depends on `output` alone.
pub trait StopStrings: Send + Sync + std::fmt::Debug {
    /// Whether the last token of `output` (the tokens generated so far, that token included)
    /// completes a stop string: an occurrence that ends within that token's text.
    fn ends_in_stop(&self, output: &[TokenId]) -> bool;
}

/// A request's [`StopStrings`].
pub type StopCheck = Shared<dyn StopStrings>;

impl Shared<dyn StopStrings> {
    pub fn new(s: impl StopStrings + 'static) -> Self {
        Shared(Arc::new(s))
    }
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
            logit_bias: Vec::new(),
            constraint: None,
            stop_strings: None,
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

/// A request as the server builds it, before it is checked against the engine's limits.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestDraft {
    /// A label for logs, stats and responses (the client's `X-Request-Id`, or a generated
    /// id). Not unique and never used to address the request: the engine names requests by
    /// the handles it assigns.
    pub label: Arc<str>,
    pub prompt: Vec<TokenId>,
    /// Most tokens to generate; `None` fills the context (`max_model_len - prompt`).
    pub max_tokens: Option<u32>,
    /// Everything else about sampling (`sampling.max_tokens` is set by validation).
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
    /// Resumable session (spec §5): keep this request's KV when it finishes, and continue a
    /// parked session of this id when `prompt` extends its retained tokens.
    pub session_id: Option<Arc<str>>,
    /// Return the log-probability of every prompt token after the first, with this many
    /// alternatives. Such a request does not read the prefix cache (spec §2: cached tokens have
    /// no logits), and may ask for `max_tokens: 0`.
    pub prompt_logprobs: Option<u32>,
    /// Sequences to generate: one prefill, then `n` sequences forked on the shared prompt
    /// blocks.
    pub n: u32,
    /// Who the request is accounted to: the API key's name when the server knows one. When
    /// `None`, validation names the tenant after a digest of `cache_salt`, else "default"
    /// (see [`tenant_label`]).
    pub tenant: Option<Arc<str>>,
    /// The cached prefix (tokens) a router predicted this instance holds for the prompt, when
    /// it said (`x-prefix-cache-predicted-tokens`): reported beside what happened, never used
    /// to decide anything.
    pub predicted_cached_tokens: Option<u64>,
}

/// The tenant label of a request: the API key's `name` when there is one, else a short digest
/// of its `cache_salt` (never the salt: labels are public on `/metrics`, and the salt is what
/// keeps tenants from probing each other's cache), else "default".
pub fn tenant_label(name: Option<&str>, cache_salt: Option<&str>) -> Arc<str> {
    if let Some(n) = name.filter(|n| !n.is_empty()) {
        return Arc::from(n);
    }
    match cache_salt {
        Some(salt) => {
            let mut h = blake3::Hasher::new();
            h.update(b"cachet tenant label v1\0");
            h.update(salt.as_bytes());
            let d = h.finalize();
            let hex: String = d.as_bytes()[..4]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            Arc::from(format!("salt-{hex}"))
        }
        None => Arc::from(DEFAULT_TENANT),
    }
}

/// The tenant of a request with no API key name and no `cache_salt`.
pub const DEFAULT_TENANT: &str = "default";

impl RequestDraft {
    /// A draft with `sampling.max_tokens` as the limit and every option at its default.
    pub fn new(label: impl Into<Arc<str>>, prompt: Vec<TokenId>, sampling: SamplingParams) -> Self {
        RequestDraft {
            label: label.into(),
            prompt,
            max_tokens: Some(sampling.max_tokens),
            sampling,
            cache_salt: None,
            adapter: None,
            priority: 0,
            skip_prefix_cache_read: false,
            session_id: None,
            prompt_logprobs: None,
            n: 1,
            tenant: None,
            predicted_cached_tokens: None,
        }
    }
}

/// Most sequences one request may fork into.
pub const MAX_N: u32 = 64;

/// The static limits a request must fit: the model's context and the pool's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Prompt + generated tokens of one request.
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

/// Longest accepted session id.
pub const MAX_SESSION_ID_LEN: usize = 128;

/// Why a draft is not a request the engine can run. Every variant is the client's fault (400).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum InvalidRequest {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_tokens}, which leaves no room for a completion")]
    PromptTooLong {
        prompt_tokens: usize,
        max_model_len: usize,
    },
    #[error("this model's maximum context length is {max_model_len} tokens; {prompt_tokens} prompt tokens and {max_tokens} requested for the completion exceed it")]
    TooManyTokens {
        prompt_tokens: usize,
        max_tokens: u32,
        max_model_len: usize,
    },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")]
    MinTokensAboveMax { min_tokens: u32, max_tokens: u32 },
    #[error("the request needs {needed} KV blocks but the pool has only {available}")]
    CannotFit { needed: usize, available: usize },
    #[error("a session id must be 1 to {MAX_SESSION_ID_LEN} characters from [A-Za-z0-9._:-]")]
    BadSessionId,
    #[error("n must be between 1 and {MAX_N} (got {0})")]
    BadN(u32),
    #[error("n > 1 cannot be combined with a session (a session keeps one sequence)")]
    NWithSession,
}

/// The engine's key of session `id` of the tenant named `tenant` (an API key's name; `None` or
/// empty: no name): `NAME/ID`, or `ID` without a name. `/` is in no valid session id, so no
/// two (tenant, id) pairs share a key ([`session_id_of_key`] gives the id back).
pub fn session_key(tenant: Option<&str>, id: &str) -> Arc<str> {
    match tenant.filter(|t| !t.is_empty()) {
        Some(t) => Arc::from(format!("{t}/{id}")),
        None => Arc::from(id),
    }
}

/// The session id a client gave, from the engine's key ([`session_key`]).
pub fn session_id_of_key(key: &str) -> &str {
    key.rsplit_once('/').map_or(key, |(_, id)| id)
}

/// Whether `id` is an acceptable session id: 1 to [`MAX_SESSION_ID_LEN`] characters from
/// `[A-Za-z0-9._:-]` (so ids are safe as store keys, log fields and URL path segments).
pub fn valid_session_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_SESSION_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

impl RequestLimits {
    /// Check a draft against the limits, once: the engine trusts the result.
    pub fn validate(&self, mut d: RequestDraft) -> Result<ValidRequest, InvalidRequest> {
        let n = d.prompt.len();
        if n == 0 {
            return Err(InvalidRequest::EmptyPrompt);
        }
        if n >= self.max_model_len {
            return Err(InvalidRequest::PromptTooLong {
                prompt_tokens: n,
                max_model_len: self.max_model_len,
            });
        }
        let room = self.max_model_len - n;
        if d.n == 0 || d.n > MAX_N {
            return Err(InvalidRequest::BadN(d.n));
        }
        if d.n > 1 && d.session_id.is_some() {
            return Err(InvalidRequest::NWithSession);
        }
        let max_tokens = match d.max_tokens {
            // Only prompt logprobs are wanted: the prompt runs and nothing is generated.
            Some(0) if d.prompt_logprobs.is_some() && d.n == 1 => 0,
            Some(0) => return Err(InvalidRequest::ZeroMaxTokens),
            Some(m) if m as usize > room => {
                return Err(InvalidRequest::TooManyTokens {
                    prompt_tokens: n,
                    max_tokens: m,
                    max_model_len: self.max_model_len,
                })
            }
            Some(m) => m,
            None => u32::try_from(room).unwrap_or(u32::MAX),
        };
        if d.sampling.min_tokens > max_tokens {
            return Err(InvalidRequest::MinTokensAboveMax {
                min_tokens: d.sampling.min_tokens,
                max_tokens,
            });
        }
        // n sequences share the prompt's blocks; each needs its own for the output (and a copy
        // of the partial last block).
        let b = self.block_size.max(1);
        let needed = (n + max_tokens as usize).div_ceil(b)
            + (d.n as usize - 1) * ((n % b + max_tokens as usize).div_ceil(b));
        if needed > self.num_blocks {
            return Err(InvalidRequest::CannotFit {
                needed,
                available: self.num_blocks,
            });
        }
        if let Some(s) = &d.session_id {
            if !valid_session_id(s) {
                return Err(InvalidRequest::BadSessionId);
            }
            // A tenant's sessions are its own: the same id under another key is another session.
            d.session_id = Some(session_key(d.tenant.as_deref(), s));
        }
        if d.prompt_logprobs.is_some() {
            d.skip_prefix_cache_read = true;
        }
        d.tenant = Some(tenant_label(d.tenant.as_deref(), d.cache_salt.as_deref()));
        d.sampling.max_tokens = max_tokens;
        d.max_tokens = Some(max_tokens);
        Ok(ValidRequest(d))
    }
}

/// A request that passed [`RequestLimits::validate`]: non-empty, fits the context and the pool,
/// with a resolved `max_tokens`. Only validation makes one.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRequest(RequestDraft);

impl ValidRequest {
    pub fn draft(&self) -> &RequestDraft {
        &self.0
    }

    pub fn label(&self) -> &Arc<str> {
        &self.0.label
    }

    pub fn session_id(&self) -> Option<&Arc<str>> {
        self.0.session_id.as_ref()
    }

    pub(crate) fn into_draft(self) -> RequestDraft {
        self.0
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
    /// The engine failed (a model error, or the engine died) while the request was live.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }

    /// Every reason, in the order metrics list them.
    pub const ALL: [FinishReason; 4] = [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Abort,
        FinishReason::Error,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> RequestLimits {
        RequestLimits {
            max_model_len: 100,
            block_size: 16,
            num_blocks: 8,
        }
    }

    fn draft(n: usize, max_tokens: Option<u32>) -> RequestDraft {
        let mut d = RequestDraft::new("r", vec![1; n], SamplingParams::default());
        d.max_tokens = max_tokens;
        d
    }

    #[test]
    fn validation_resolves_max_tokens_and_checks_every_limit() {
        let l = limits();
        // None fills the context: 100 - 10.
        let v = l.validate(draft(10, None)).unwrap();
        assert_eq!(v.draft().sampling.max_tokens, 90);
        assert_eq!(l.validate(draft(0, None)), Err(InvalidRequest::EmptyPrompt));
        assert_eq!(
            l.validate(draft(100, None)),
            Err(InvalidRequest::PromptTooLong {
                prompt_tokens: 100,
                max_model_len: 100
            })
        );
        assert_eq!(
            l.validate(draft(10, Some(91))),
            Err(InvalidRequest::TooManyTokens {
                prompt_tokens: 10,
                max_tokens: 91,
                max_model_len: 100
            })
        );
        assert_eq!(
            l.validate(draft(10, Some(0))),
            Err(InvalidRequest::ZeroMaxTokens)
        );
        // 10 + 90 tokens = 7 blocks of 16: fits 8; with 6 blocks it cannot.
        let small = RequestLimits { num_blocks: 6, ..l };
        assert_eq!(
            small.validate(draft(10, None)),
            Err(InvalidRequest::CannotFit {
                needed: 7,
                available: 6
            })
        );
        let mut d = draft(10, Some(5));
        d.sampling.min_tokens = 6;
        assert_eq!(
            l.validate(d),
            Err(InvalidRequest::MinTokensAboveMax {
                min_tokens: 6,
                max_tokens: 5
            })
        );
    }

    #[test]
    fn prompt_logprobs_skip_the_cache_and_allow_zero_tokens_n_is_bounded() {
        let l = limits();
        let mut d = draft(10, Some(0));
        d.prompt_logprobs = Some(1);
        let v = l.validate(d).unwrap();
        assert!(v.draft().skip_prefix_cache_read);
        assert_eq!(v.draft().sampling.max_tokens, 0);
        let mut d = draft(10, Some(1));
        d.n = 0;
        assert_eq!(l.validate(d), Err(InvalidRequest::BadN(0)));
        let mut d = draft(10, Some(1));
        d.n = 2;
        d.session_id = Some(Arc::from("s"));
        assert_eq!(l.validate(d), Err(InvalidRequest::NWithSession));
        // 10 + 20 tokens: 2 blocks for the first sequence; each other needs the rest of the
        // partial block (10) + 20 → 2 blocks: n = 3 needs 2 + 2·2 = 6 of 8; n = 4 needs 8; 5: 10.
        let mut d = draft(10, Some(20));
        d.n = 4;
        assert!(l.validate(d.clone()).is_ok());
        d.n = 5;
        assert_eq!(
            l.validate(d),
            Err(InvalidRequest::CannotFit {
                needed: 10,
                available: 8
            })
        );
    }

    /// A named tenant's session ids live under its name (ids hold no `/`, so the id after the last
    /// `/` and the name before it are unambiguous); validation applies it, and the id comes back.
    #[test]
    fn session_keys_are_per_tenant() {
        assert_eq!(&*session_key(Some("alice"), "chat-1"), "alice/chat-1");
        assert_eq!(&*session_key(None, "chat-1"), "chat-1");
        assert_eq!(&*session_key(Some(""), "chat-1"), "chat-1");
        // An unnamed key's session never has the key of a named tenant's: only those hold `/`.
        assert!(
            session_key(Some("a"), "b").contains('/') && !session_key(None, "a:b").contains('/')
        );
        for k in ["alice/chat-1", "chat-1", "a/b/c"] {
            assert!(!session_id_of_key(k).contains('/'), "{k}");
        }
        assert_eq!(session_id_of_key(&session_key(Some("a/b"), "c:1")), "c:1");
        let l = limits();
        let mut d = draft(10, Some(1));
        d.session_id = Some(Arc::from("s"));
        d.tenant = Some(Arc::from("bob"));
        assert_eq!(
            l.validate(d.clone()).unwrap().session_id().map(|s| &**s),
            Some("bob/s")
        );
        d.tenant = None;
        assert_eq!(l.validate(d).unwrap().session_id().map(|s| &**s), Some("s"));
    }

    #[test]
    fn session_ids_are_restricted() {
        for ok in ["a", "chat-1", "u:42.turns_x", &"x".repeat(128)] {
            assert!(valid_session_id(ok), "{ok}");
        }
        for bad in [
            "",
            "../../etc/passwd",
            "a/b",
            "a\0b",
            "a\r\nb",
            "é",
            &"x".repeat(129),
        ] {
            assert!(!valid_session_id(bad), "{bad:?}");
        }
        let mut d = draft(4, Some(1));
        d.session_id = Some(Arc::from("a/../../b"));
        assert_eq!(limits().validate(d), Err(InvalidRequest::BadSessionId));
    }
}
