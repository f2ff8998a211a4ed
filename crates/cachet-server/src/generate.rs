//! One generation, from `add_request` to the final output: incremental detokenization, stop
//! strings, and the engine's final numbers. Shared by the OpenAI and Anthropic routes.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::http::HeaderMap;
use cachet_core::{FinishReason, NewRequest, PrefillStats, Sampled, SamplingParams};
use cachet_engine::{
    AddRequestError, CoreAddError, IncrementalDetokenizer, RequestMetrics, RequestStream,
    SessionReport,
};

use crate::error::ApiError;
use crate::AppState;

/// Header carrying the caller's request id (echoed back).
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Longest accepted `X-Request-Id`.
const MAX_REQUEST_ID_LEN: usize = 256;
/// Longest accepted `session_id` (characters).
pub const MAX_SESSION_ID_LEN: usize = 256;

/// Validates an optional `session_id`: non-empty and at most [`MAX_SESSION_ID_LEN`] characters.
pub fn check_session_id(id: &Option<String>) -> Result<(), ApiError> {
    match id {
        Some(s) if s.is_empty() => Err(ApiError::bad_param(
            "session_id",
            "`session_id` must not be empty.",
        )),
        Some(s) if s.chars().count() > MAX_SESSION_ID_LEN => Err(ApiError::bad_param(
            "session_id",
            format!("`session_id` must be at most {MAX_SESSION_ID_LEN} characters."),
        )),
        _ => Ok(()),
    }
}

/// What the route asks the engine for.
pub struct GenSpec {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub cache_salt: Option<String>,
    pub priority: i32,
    /// Resumable session the request is a turn of (validated by [`check_session_id`]).
    pub session_id: Option<String>,
}

/// Why a generation ended, in the server's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopKind {
    /// EOS or a stop token.
    Eos,
    /// `max_tokens` or the context length.
    Length,
    /// One of the request's stop strings (not included in the text).
    StopString(String),
    /// The engine aborted the request (e.g. shutdown).
    Abort,
}

impl StopKind {
    pub fn openai(&self) -> &'static str {
        match self {
            StopKind::Eos | StopKind::StopString(_) => "stop",
            StopKind::Length => "length",
            StopKind::Abort => "abort",
        }
    }
}

/// The end of a generation: everything the engine reported about it.
#[derive(Clone, Debug)]
pub struct Final {
    pub stop: StopKind,
    pub prefill: Option<PrefillStats>,
    pub metrics: Option<RequestMetrics>,
    /// Session turns: how the engine served the turn (from the final output, else the first).
    pub session: Option<Box<SessionReport>>,
    /// Prompt length the server sent (used only if the engine reported none).
    pub prompt_len: usize,
    /// Tokens received from the engine (used only if the engine reported no count).
    pub tokens_received: u64,
}

/// New text (possibly empty) and, when asked for, the sampled tokens with their logprobs.
#[derive(Clone, Debug, Default)]
pub struct Delta {
    pub text: String,
    pub tokens: Vec<Sampled>,
}

#[derive(Debug)]
pub enum GenEvent {
    Delta(Delta),
    Done(Final),
}

/// A running request. Dropping it drops the engine stream, which aborts the request.
pub struct Generation {
    state: AppState,
    stream: RequestStream,
    request_id: String,
    detok: IncrementalDetokenizer,
    stop: crate::stop::StopMatcher,
    want_tokens: bool,
    prompt_len: usize,
    tokens_received: u64,
    prefill: Option<PrefillStats>,
    session: Option<SessionReport>,
    stop_hit: Option<String>,
    queue: VecDeque<GenEvent>,
    done: bool,
}

fn caller_request_id(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(REQUEST_ID_HEADER)?.to_str().ok()?.trim();
    if v.is_empty() || v.len() > MAX_REQUEST_ID_LEN {
        return None;
    }
    Some(v.to_string())
}

fn fresh_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

fn map_add_error(e: AddRequestError) -> ApiError {
    match e {
        AddRequestError::QueueFull(_) => ApiError::QueueFull,
        AddRequestError::ShuttingDown => ApiError::ShuttingDown,
        AddRequestError::Invalid(core) => match core {
            CoreAddError::PromptTooLong { .. } | CoreAddError::CannotFit { .. } => {
                ApiError::ContextLength(core.to_string())
            }
            CoreAddError::DuplicateId(_) => ApiError::Internal(core.to_string()),
            CoreAddError::SessionBusy(id) => ApiError::SessionBusy(id),
            other => ApiError::bad_request(other.to_string()),
        },
    }
}

impl Generation {
    /// Submits the request. The engine id is the caller's `X-Request-Id` when it is unique among
    /// live requests, otherwise `<prefix><uuid>`.
    pub fn start(
        state: &AppState,
        headers: &HeaderMap,
        prefix: &str,
        spec: GenSpec,
    ) -> Result<Self, ApiError> {
        let want_tokens = spec.sampling.logprobs.is_some();
        let prompt_len = spec.prompt.len();
        let mut req = NewRequest::new(
            caller_request_id(headers).unwrap_or_else(|| fresh_id(prefix)),
            spec.prompt,
            spec.sampling,
        );
        req.cache_salt = spec.cache_salt;
        req.priority = spec.priority;
        req.session_id = spec.session_id;
        let engine = state.engine();
        let mut attempt = 0;
        let stream = loop {
            match engine.add_request(req.clone()) {
                Ok(s) => break s,
                Err(AddRequestError::Invalid(CoreAddError::DuplicateId(_))) if attempt < 3 => {
                    attempt += 1;
                    req.request_id = fresh_id(prefix);
                }
                Err(e) => return Err(map_add_error(e)),
            }
        };
        Ok(Generation {
            state: state.clone(),
            stream,
            request_id: req.request_id,
            detok: IncrementalDetokenizer::new(Arc::clone(engine.tokenizer())),
            stop: crate::stop::StopMatcher::new(spec.stop),
            want_tokens,
            prompt_len,
            tokens_received: 0,
            prefill: None,
            session: None,
            stop_hit: None,
            queue: VecDeque::new(),
            done: false,
        })
    }

    /// The engine request id (also the response id).
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Prefill stats of the first output (known once the first event has been returned).
    pub fn prefill(&self) -> Option<&PrefillStats> {
        self.prefill.as_ref()
    }

    /// The session report of the latest output that carried one (session turns only).
    pub fn session(&self) -> Option<&SessionReport> {
        self.session.as_ref()
    }

    /// Prompt length as sent.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// The next event; `None` after [`GenEvent::Done`].
    pub async fn next(&mut self) -> Option<GenEvent> {
        loop {
            if let Some(ev) = self.queue.pop_front() {
                return Some(ev);
            }
            if self.done {
                return None;
            }
            match self.stream.next().await {
                None => {
                    // The engine closed the stream without a final output.
                    self.end(None, None, None);
                }
                Some(out) => {
                    if self.prefill.is_none() {
                        self.prefill = out.prefill_stats;
                    }
                    if out.session.is_some() {
                        self.session = out.session.clone();
                    }
                    self.tokens_received += out.tokens.len() as u64;
                    let mut delta = Delta::default();
                    if self.stop_hit.is_none() {
                        let ids: Vec<u32> = out.tokens.iter().map(|s| s.token).collect();
                        let text = self.detok.push(&ids);
                        let outcome = self.stop.push(&text);
                        delta.text = outcome.emit;
                        if self.want_tokens {
                            delta.tokens = out.tokens;
                        }
                        if let Some(i) = outcome.matched {
                            let s = self.stop.stops().get(i).cloned().unwrap_or_default();
                            self.stop_hit = Some(s);
                            if out.finish_reason.is_none() {
                                self.state
                                    .engine()
                                    .finish(&self.request_id, FinishReason::Stop);
                            }
                        }
                    }
                    if out.finish_reason.is_some() && self.stop_hit.is_none() {
                        // Release what the detokenizer and the stop matcher still hold.
                        let tail = self.detok.flush();
                        let outcome = self.stop.push(&tail);
                        delta.text.push_str(&outcome.emit);
                        if let Some(i) = outcome.matched {
                            self.stop_hit =
                                Some(self.stop.stops().get(i).cloned().unwrap_or_default());
                        } else {
                            delta.text.push_str(&self.stop.flush());
                        }
                    }
                    if !delta.text.is_empty() || !delta.tokens.is_empty() {
                        self.queue.push_back(GenEvent::Delta(delta));
                    }
                    if let Some(reason) = out.finish_reason {
                        let prefill = out.prefill_stats.or(self.prefill);
                        self.end(Some(reason), prefill, out.metrics);
                    }
                }
            }
        }
    }

    fn end(
        &mut self,
        reason: Option<FinishReason>,
        prefill: Option<PrefillStats>,
        metrics: Option<RequestMetrics>,
    ) {
        let stop = match (&self.stop_hit, reason) {
            (Some(s), _) => StopKind::StopString(s.clone()),
            (None, Some(FinishReason::Stop)) => StopKind::Eos,
            (None, Some(FinishReason::Length)) => StopKind::Length,
            (None, Some(FinishReason::Abort)) | (None, None) => StopKind::Abort,
        };
        self.queue.push_back(GenEvent::Done(Final {
            stop,
            prefill,
            metrics,
            session: self.session.clone().map(Box::new),
            prompt_len: self.prompt_len,
            tokens_received: self.tokens_received,
        }));
        self.done = true;
    }
}
