//! One generation, from admission to the final output: incremental detokenization, stop
//! strings, and the engine's final numbers. Shared by the OpenAI and Anthropic routes.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::http::HeaderMap;
use cachet_core::request::InvalidRequest;
use cachet_core::{FinishReason, Report, RequestDraft, Sampled, SessionInfo};
use cachet_engine::{
    AddError, AddRequestError, EngineFailure, EngineState, RequestHandle, RequestStream,
};
use cachet_text::{IncrementalDetokenizer, StopMatcher};

use crate::error::ApiError;
use crate::AppState;

/// Header carrying the caller's request id (echoed back).
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Longest accepted `X-Request-Id`.
pub const MAX_REQUEST_ID_LEN: usize = 256;

/// Checks a `session_id` the way the engine will (one rule, in the core).
pub fn check_session_id(id: Option<&str>) -> Result<(), ApiError> {
    match id {
        Some(s) if !cachet_core::request::valid_session_id(s) => Err(ApiError::bad_param(
            "session_id",
            InvalidRequest::BadSessionId.to_string(),
        )),
        _ => Ok(()),
    }
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
    /// The engine failed while the request was live.
    Error,
}

impl StopKind {
    pub fn openai(&self) -> &'static str {
        match self {
            StopKind::Eos | StopKind::StopString(_) => "stop",
            StopKind::Length => "length",
            StopKind::Abort => "abort",
            StopKind::Error => "error",
        }
    }
}

/// The end of a generation: everything the engine reported about it.
#[derive(Clone, Debug)]
pub struct Final {
    pub stop: StopKind,
    /// The recorder's final report (first-token report when the final one is missing).
    pub report: Option<Report>,
    /// Session turns: how the engine served the turn.
    pub session: Option<SessionInfo>,
    /// Prompt length the server sent (used only if the engine reported none).
    pub prompt_len: usize,
    /// Tokens received from the engine (used only if the engine reported no count).
    pub tokens_received: u64,
    /// Set when the engine failed (the response is an error).
    pub error: Option<EngineFailure>,
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
    Done(Box<Final>),
}

/// A running request. Dropping it drops the engine stream, which aborts the request.
pub struct Generation {
    state: AppState,
    stream: RequestStream,
    request_id: String,
    detok: IncrementalDetokenizer,
    /// With special tokens kept (tool-call markers that are control tokens): the ids that end
    /// the request (EOS, stop tokens), never text.
    drop_ids: Option<Vec<u32>>,
    stop: StopMatcher,
    want_tokens: bool,
    prompt_len: usize,
    tokens_received: u64,
    report: Option<Report>,
    session: Option<SessionInfo>,
    stop_hit: Option<String>,
    queue: VecDeque<GenEvent>,
    done: bool,
}

/// The response id: the caller's `X-Request-Id` when it is usable, else `<prefix><uuid>`. A
/// label only: two requests may carry the same one.
pub fn response_id(headers: &HeaderMap, prefix: &str) -> String {
    let caller = headers
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID_LEN);
    match caller {
        Some(v) => v.to_string(),
        None => format!("{prefix}{}", uuid::Uuid::new_v4().simple()),
    }
}

fn map_invalid(e: InvalidRequest) -> ApiError {
    match e {
        InvalidRequest::PromptTooLong { .. }
        | InvalidRequest::TooManyTokens { .. }
        | InvalidRequest::CannotFit { .. } => ApiError::ContextLength(e.to_string()),
        InvalidRequest::ZeroMaxTokens => ApiError::bad_param("max_tokens", e.to_string()),
        InvalidRequest::MinTokensAboveMax { .. } => {
            ApiError::bad_param("min_tokens", e.to_string())
        }
        InvalidRequest::BadSessionId => ApiError::bad_param("session_id", e.to_string()),
        InvalidRequest::BadN(_) | InvalidRequest::NWithSession => {
            ApiError::bad_param("n", e.to_string())
        }
        InvalidRequest::EmptyPrompt => ApiError::bad_request(e.to_string()),
    }
}

fn map_add_error(e: AddRequestError) -> ApiError {
    match e {
        AddRequestError::Refused(AddError::QueueFull { .. }) => ApiError::QueueFull,
        AddRequestError::Refused(AddError::SessionBusy(id)) => {
            ApiError::SessionBusy(id.to_string())
        }
        AddRequestError::NotRunning(EngineState::Dead) => ApiError::EngineDead,
        AddRequestError::NotRunning(_) => ApiError::ShuttingDown,
    }
}

impl Generation {
    /// Validates the draft against the engine's limits (the one validation of the request) and
    /// submits it. `draft.label` is the response id.
    pub async fn start(
        state: &AppState,
        draft: RequestDraft,
        stop: Vec<String>,
    ) -> Result<Self, ApiError> {
        Self::start_with(state, draft, stop, true).await
    }

    /// [`Generation::start`] with the choice of dropping special tokens from the text
    /// (`skip_special_tokens`); when they are kept, EOS and stop tokens still never become text.
    pub async fn start_with(
        state: &AppState,
        draft: RequestDraft,
        stop: Vec<String>,
        skip_special_tokens: bool,
    ) -> Result<Self, ApiError> {
        let drop_ids = (!skip_special_tokens).then(|| {
            let mut v = state.tokenizer().eos_token_ids().to_vec();
            v.extend_from_slice(&draft.sampling.stop_token_ids);
            v
        });
        let want_tokens = draft.sampling.logprobs.is_some();
        let prompt_len = draft.prompt.len();
        let request_id = draft.label.to_string();
        // Stop strings are bounded in count and size (one automaton matches them all).
        let stop =
            StopMatcher::new(stop).map_err(|e| ApiError::bad_param("stop", e.to_string()))?;
        let engine = state.engine();
        let valid = engine.limits().validate(draft).map_err(map_invalid)?;
        let stream = engine.add_request(valid).await.map_err(map_add_error)?;
        Ok(Generation {
            state: state.clone(),
            stream,
            request_id,
            detok: IncrementalDetokenizer::new(Arc::clone(state.tokenizer()), skip_special_tokens),
            drop_ids,
            stop,
            want_tokens,
            prompt_len,
            tokens_received: 0,
            report: None,
            session: None,
            stop_hit: None,
            queue: VecDeque::new(),
            done: false,
        })
    }

    /// The response id (the request's label).
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The engine's handle of the request.
    pub fn handle(&self) -> RequestHandle {
        self.stream.handle()
    }

    /// The recorder's report of the first output (known once the first event was returned).
    pub fn report(&self) -> Option<&Report> {
        self.report.as_ref()
    }

    /// How the engine served a session turn (known with the first output).
    pub fn session(&self) -> Option<&SessionInfo> {
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
                    let died = (self.state.engine().state() == EngineState::Dead)
                        .then(|| EngineFailure::Died("the engine stopped".into()));
                    self.end(None, died);
                }
                Some(out) => {
                    if out.report.is_some() {
                        self.report = out.report.map(|r| *r);
                    }
                    if out.session.is_some() {
                        self.session = out.session;
                    }
                    self.tokens_received += out.tokens.len() as u64;
                    let mut delta = Delta::default();
                    if self.stop_hit.is_none() {
                        let ids: Vec<u32> = out
                            .tokens
                            .iter()
                            .map(|s| s.token)
                            .filter(|t| !self.drop_ids.as_ref().is_some_and(|d| d.contains(t)))
                            .collect();
                        let text = self.detok.push(&ids).unwrap_or_default();
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
                                    .finish(self.stream.handle(), FinishReason::Stop);
                            }
                        }
                    }
                    if out.finish_reason.is_some() && self.stop_hit.is_none() {
                        // Release what the detokenizer and the stop matcher still hold.
                        let tail = self.detok.flush().unwrap_or_default();
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
                        self.end(Some(reason), out.error);
                    }
                }
            }
        }
    }

    fn end(&mut self, reason: Option<FinishReason>, error: Option<EngineFailure>) {
        let stop = match (&self.stop_hit, reason, &error) {
            (_, _, Some(_)) | (None, Some(FinishReason::Error), _) => StopKind::Error,
            (Some(s), _, _) => StopKind::StopString(s.clone()),
            (None, Some(FinishReason::Stop), _) => StopKind::Eos,
            (None, Some(FinishReason::Length), _) => StopKind::Length,
            (None, Some(FinishReason::Abort), _) | (None, None, _) => StopKind::Abort,
        };
        let error = match (stop == StopKind::Error, error) {
            (true, None) => Some(EngineFailure::Model("the request failed".into())),
            (_, e) => e,
        };
        self.queue.push_back(GenEvent::Done(Box::new(Final {
            stop,
            report: self.report.clone(),
            session: self.session.clone(),
            prompt_len: self.prompt_len,
            tokens_received: self.tokens_received,
            error,
        })));
        self.done = true;
    }
}
