//! One generation, from admission to the final output: incremental detokenization, stop
//! strings, and the engine's final numbers. Shared by the OpenAI and Anthropic routes.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use cachet_core::request::{InvalidRequest, StopCheck, StopStrings};
use cachet_core::stats::SpecDecodeCounts;
use cachet_core::{FinishReason, Report, RequestDraft, Sampled, SessionInfo};
use cachet_engine::{
    AddError, AddRequestError, EngineFailure, EngineState, RequestHandle, RequestStream,
};
use cachet_text::{IncrementalDetokenizer, StopMatcher, TokenStops};

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
    /// EOS (also when it is among the stop tokens).
    Eos,
    /// `max_tokens` or the context length.
    Length,
    /// One of the request's stop strings.
    StopString(String),
    /// One of the request's `stop_token_ids` (not EOS while EOS ends the request: that is
    /// [`StopKind::Eos`], as vLLM reports it).
    StopToken(u32),
    /// The engine aborted the request (e.g. shutdown).
    Abort,
    /// The engine failed while the request was live.
    Error,
}

impl StopKind {
    pub fn openai(&self) -> &'static str {
        match self {
            StopKind::Eos | StopKind::StopString(_) | StopKind::StopToken(_) => "stop",
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
    /// Which sequence (choice) ended; the request's last final holds the finished record.
    pub seq: u32,
    /// Every sequence of the request has ended with this one.
    pub last: bool,
    /// With per-request metrics: the text around the point where the prompt left a cached
    /// one (`{"before", "ours", "theirs"}`, each a few tokens, detokenized and clipped).
    pub divergence_text: Option<serde_json::Value>,
    /// Speculative decoding on: each sequence's draft counts by its index, for the sequences
    /// ended so far (the request's last final: all of them); empty when speculation is off.
    pub spec_decode: Vec<Option<SpecDecodeCounts>>,
}

/// Longest text shown for each side of a divergence point.
const DIVERGENCE_TEXT_CHARS: usize = 80;

fn divergence_text(
    tok: &dyn cachet_text::TextTokenizer,
    d: &cachet_core::recorder::Divergence,
) -> serde_json::Value {
    let text = |ids: &[u32]| -> String {
        let t = tok.decode(ids, false).unwrap_or_default();
        t.chars().take(DIVERGENCE_TEXT_CHARS).collect()
    };
    serde_json::json!({
        "before": text(&d.before),
        "ours": text(&d.ours),
        "theirs": text(&d.theirs),
    })
}

/// New text (possibly empty) of sequence `seq` and, when asked for, the sampled tokens with
/// their logprobs.
#[derive(Clone, Debug, Default)]
pub struct Delta {
    pub seq: u32,
    pub text: String,
    /// How many tokens this delta's engine output carried (always set; `tokens` only with
    /// logprobs).
    pub generated: usize,
    pub tokens: Vec<Sampled>,
}

/// One sequence's text state.
struct Seq {
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    stop_hit: Option<String>,
    /// The last token received.
    last_token: Option<u32>,
    tokens_received: u64,
    /// Generated tokens as the engine counted them (from the sequence's finished record).
    generated: Option<u64>,
    /// The sequence's speculation counts (from its final output).
    spec_decode: Option<SpecDecodeCounts>,
    done: bool,
}

#[derive(Debug)]
pub enum GenEvent {
    Delta(Delta),
    Done(Box<Final>),
}

/// A request's stop strings as the engine checks them.
#[derive(Debug)]
struct EngineStops(TokenStops);

impl StopStrings for EngineStops {
    fn ends_in_stop(&self, output: &[u32]) -> bool {
        self.0.ends_in_stop(output)
    }
}

/// A running request. Dropping it drops the engine stream, which aborts the request.
pub struct Generation {
    state: AppState,
    stream: RequestStream,
    request_id: String,
    /// The ids that end the request (EOS, stop tokens), never text unless the client asked for
    /// the stop's text ([`TextOptions::include_stop_str_in_output`]).
    drop_ids: Option<Vec<u32>>,
    /// The request's `stop_token_ids`, and the EOS ids when EOS ends it: what tells a stop
    /// token from EOS at the end.
    stop_token_ids: Vec<u32>,
    eos_ids: Vec<u32>,
    seqs: Vec<Seq>,
    want_tokens: bool,
    /// A sequence's first `min_tokens` tokens may not end it by a stop string (the engine's
    /// rule too): their text passes the matcher unmatched.
    min_tokens: u64,
    prompt_len: usize,
    report: Option<Report>,
    session: Option<SessionInfo>,
    prompt_logprobs: Option<Vec<Sampled>>,
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
        | InvalidRequest::CannotFit { .. } => ApiError::ContextLength {
            message: e.to_string(),
            param: "messages",
        },
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
        AddRequestError::Refused(AddError::SessionBusy(key)) => {
            ApiError::SessionBusy(cachet_core::request::session_id_of_key(&key).to_string())
        }
        AddRequestError::NotRunning(EngineState::Dead) => ApiError::EngineDead,
        AddRequestError::NotRunning(_) => ApiError::ShuttingDown,
    }
}

/// How a generation's tokens become text.
#[derive(Clone, Debug)]
pub struct TextOptions {
    /// Stop strings: the text ends before the first (or through it, below).
    pub stop: Vec<String>,
    /// Special tokens are not text (vLLM's `skip_special_tokens`, default true).
    pub skip_special_tokens: bool,
    /// vLLM's `include_stop_str_in_output`: the stop string that ended the text, and the text
    /// of a stop token (`stop_token_ids`, EOS) that ended it, stay in it (a special one only
    /// with `skip_special_tokens` false).
    pub include_stop_str_in_output: bool,
}

impl TextOptions {
    /// Stop strings cut from the text, special tokens skipped.
    pub fn stops(stop: Vec<String>) -> Self {
        TextOptions {
            stop,
            skip_special_tokens: true,
            include_stop_str_in_output: false,
        }
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
        Self::start_with(state, draft, TextOptions::stops(stop)).await
    }

    /// [`Generation::start`] with the text's options: unless the stop token's text is asked
    /// for, EOS and stop tokens never become text, also when special tokens are kept.
    pub async fn start_with(
        state: &AppState,
        draft: RequestDraft,
        text: TextOptions,
    ) -> Result<Self, ApiError> {
        let TextOptions {
            stop,
            skip_special_tokens,
            include_stop_str_in_output: include_stop,
        } = text;
        let drop_ids = (!include_stop).then(|| {
            let mut v = state.tokenizer().eos_token_ids().to_vec();
            v.extend_from_slice(&draft.sampling.stop_token_ids);
            v
        });
        let want_tokens = draft.sampling.logprobs.is_some();
        let stop_token_ids = draft.sampling.stop_token_ids.clone();
        let eos_ids = if draft.sampling.ignore_eos {
            Vec::new()
        } else {
            state.tokenizer().eos_token_ids().to_vec()
        };
        let min_tokens = u64::from(draft.sampling.min_tokens);
        let prompt_len = draft.prompt.len();
        let request_id = draft.label.to_string();
        // Stop strings are bounded in count and size (one automaton matches them all).
        let n = draft.n.max(1);
        let mut seqs = Vec::with_capacity(n as usize);
        for _ in 0..n {
            seqs.push(Seq {
                detok: IncrementalDetokenizer::new(
                    Arc::clone(state.tokenizer()),
                    skip_special_tokens,
                ),
                stop: StopMatcher::new(stop.clone())
                    .map(|m| if include_stop { m.including_match() } else { m })
                    .map_err(|e| ApiError::bad_param("stop", e.to_string()))?,
                stop_hit: None,
                last_token: None,
                tokens_received: 0,
                generated: None,
                spec_decode: None,
                done: false,
            });
        }
        let engine = state.engine();
        let mut draft = draft;
        // The engine ends the request at the token that completes a stop string (its count,
        // KV and counters are those of the text returned, with or without speculation); the
        // matchers above cut the text.
        draft.sampling.stop_strings = TokenStops::new(
            &stop,
            Arc::clone(state.token_bytes()),
            skip_special_tokens,
            drop_ids.as_deref().unwrap_or_default(),
        )
        .map_err(|e| ApiError::bad_param("stop", e.to_string()))?
        .map(|s| StopCheck::new(EngineStops(s)));
        if draft.tenant.is_none() {
            draft.tenant = crate::auth::current_tenant();
        }
        if draft.predicted_cached_tokens.is_none() {
            draft.predicted_cached_tokens = crate::router_prediction::current();
        }
        let valid = engine.limits().validate(draft).map_err(map_invalid)?;
        let stream = engine.add_request(valid).await.map_err(map_add_error)?;
        Ok(Generation {
            state: state.clone(),
            stream,
            request_id,
            drop_ids,
            stop_token_ids,
            eos_ids,
            seqs,
            want_tokens,
            min_tokens,
            prompt_len,
            report: None,
            session: None,
            prompt_logprobs: None,
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

    /// The generation's end: `fin` as the engine reported it, or, when the stream ended
    /// without one, an abort with what the first output reported.
    pub fn final_or_abort(&self, fin: Option<Box<Final>>) -> Final {
        fin.map(|f| *f).unwrap_or_else(|| Final {
            stop: StopKind::Abort,
            report: self.report().cloned(),
            session: self.session().cloned(),
            prompt_len: self.prompt_len(),
            tokens_received: 0,
            error: None,
            seq: 0,
            last: true,
            divergence_text: None,
            spec_decode: Vec::new(),
        })
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
                    let si = (out.seq as usize).min(self.seqs.len().saturating_sub(1));
                    if let Some(r) = out.report.map(|r| *r) {
                        // A forked sequence's report has no prompt of its own (the first
                        // sequence's covers it, computed once): only its token count is kept.
                        if let (Some(f), Some(seq)) = (&r.finished, self.seqs.get_mut(si)) {
                            seq.generated = Some(f.generation_tokens);
                        }
                        if si == 0 || self.report.is_none() {
                            self.report = Some(r);
                        }
                    }
                    if out.session.is_some() {
                        self.session = out.session;
                    }
                    if out.prompt_logprobs.is_some() {
                        self.prompt_logprobs = out.prompt_logprobs;
                    }
                    let handle = self.stream.handle();
                    let engine = self.state.engine().clone();
                    let n = self.seqs.len();
                    let drop_ids = self.drop_ids.clone();
                    let want_tokens = self.want_tokens;
                    let min_tokens = self.min_tokens;
                    let Some(seq) = self.seqs.get_mut(si) else {
                        continue;
                    };
                    let before = seq.tokens_received;
                    seq.tokens_received += out.tokens.len() as u64;
                    if let Some(t) = out.tokens.last() {
                        seq.last_token = Some(t.token);
                    }
                    if out.spec_decode.is_some() {
                        seq.spec_decode = out.spec_decode;
                    }
                    let mut delta = Delta {
                        seq: si as u32,
                        generated: out.tokens.len(),
                        ..Delta::default()
                    };
                    if seq.stop_hit.is_none() {
                        let ids = |toks: &[Sampled]| -> Vec<u32> {
                            toks.iter()
                                .map(|s| s.token)
                                .filter(|t| !drop_ids.as_ref().is_some_and(|d| d.contains(t)))
                                .collect()
                        };
                        // Tokens within `min_tokens`: their text cannot end a stop string.
                        let within =
                            (min_tokens.saturating_sub(before) as usize).min(out.tokens.len());
                        if within > 0 {
                            let text = seq
                                .detok
                                .push(&ids(&out.tokens[..within]))
                                .unwrap_or_default();
                            delta.text = seq.stop.push_unmatched(&text).emit;
                        }
                        let text = seq
                            .detok
                            .push(&ids(&out.tokens[within..]))
                            .unwrap_or_default();
                        let outcome = seq.stop.push(&text);
                        delta.text.push_str(&outcome.emit);
                        if want_tokens {
                            delta.tokens = out.tokens;
                        }
                        if let Some(i) = outcome.matched {
                            let s = seq.stop.stops().get(i).cloned().unwrap_or_default();
                            seq.stop_hit = Some(s);
                            if out.finish_reason.is_none() {
                                if n == 1 {
                                    engine.finish(handle, FinishReason::Stop);
                                } else {
                                    engine.finish_seq(handle, si as u32, FinishReason::Stop);
                                }
                            }
                        }
                    }
                    if out.finish_reason.is_some() && seq.stop_hit.is_none() {
                        // Release what the detokenizer and the stop matcher still hold.
                        let tail = seq.detok.flush().unwrap_or_default();
                        let outcome = if seq.tokens_received > min_tokens {
                            seq.stop.push(&tail)
                        } else {
                            seq.stop.push_unmatched(&tail)
                        };
                        delta.text.push_str(&outcome.emit);
                        if let Some(i) = outcome.matched {
                            seq.stop_hit =
                                Some(seq.stop.stops().get(i).cloned().unwrap_or_default());
                        } else {
                            delta.text.push_str(&seq.stop.flush());
                        }
                    }
                    if !delta.text.is_empty() || !delta.tokens.is_empty() {
                        self.queue.push_back(GenEvent::Delta(delta));
                    }
                    if out.error.is_some() {
                        // The engine failed: every sequence ends with this output.
                        let err = out.error;
                        for i in 0..self.seqs.len() {
                            if !self.seqs[i].done {
                                self.end_seq(i, Some(FinishReason::Error), err.clone());
                            }
                        }
                    } else if let Some(reason) = out.finish_reason {
                        self.end_seq(si, Some(reason), None);
                    }
                }
            }
        }
    }

    /// Prompt logprobs (one per prompt token after the first), once the engine sent them.
    pub fn prompt_logprobs(&self) -> Option<&[Sampled]> {
        self.prompt_logprobs.as_deref()
    }

    /// Sequences of the request (`n`).
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    fn end(&mut self, reason: Option<FinishReason>, error: Option<EngineFailure>) {
        for i in 0..self.seqs.len() {
            if !self.seqs[i].done {
                self.end_seq(i, reason, error.clone());
            }
        }
        self.done = true;
    }

    fn end_seq(&mut self, si: usize, reason: Option<FinishReason>, error: Option<EngineFailure>) {
        let Some(seq) = self.seqs.get_mut(si) else {
            return;
        };
        seq.done = true;
        let stop_token = seq
            .last_token
            .filter(|t| !self.eos_ids.contains(t) && self.stop_token_ids.contains(t));
        let stop = match (&seq.stop_hit, reason, &error) {
            (_, _, Some(_)) | (None, Some(FinishReason::Error), _) => StopKind::Error,
            (Some(s), _, _) => StopKind::StopString(s.clone()),
            (None, Some(FinishReason::Stop), _) => {
                stop_token.map_or(StopKind::Eos, StopKind::StopToken)
            }
            (None, Some(FinishReason::Length), _) => StopKind::Length,
            (None, Some(FinishReason::Abort), _) | (None, None, _) => StopKind::Abort,
        };
        let error = match (stop == StopKind::Error, error) {
            (true, None) => Some(EngineFailure::Model("the request failed".into())),
            (_, e) => e,
        };
        let tokens_received = self.seqs.iter().map(|s| s.tokens_received).sum();
        let last = self.seqs.iter().all(|s| s.done);
        let mut report = self.report.clone();
        if last && self.seqs.len() > 1 {
            // Usage counts every sequence's tokens (OpenAI's `n`), the prompt once.
            let total = self
                .seqs
                .iter()
                .map(|s| s.generated.unwrap_or(s.tokens_received))
                .sum();
            if let Some(f) = report.as_mut().and_then(|r| r.finished.as_mut()) {
                f.generation_tokens = total;
            }
        }
        let divergence_text = report
            .as_ref()
            .and_then(|r| r.divergence.as_ref())
            .filter(|_| self.state.per_request_metrics())
            .map(|d| divergence_text(self.state.tokenizer().as_ref(), d));
        let spec_decode = if self.seqs.iter().any(|s| s.spec_decode.is_some()) {
            self.seqs.iter().map(|s| s.spec_decode).collect()
        } else {
            Vec::new()
        };
        self.queue.push_back(GenEvent::Done(Box::new(Final {
            spec_decode,
            stop,
            report,
            divergence_text,
            session: self.session.clone(),
            prompt_len: self.prompt_len,
            tokens_received,
            error,
            seq: si as u32,
            last,
        })));
        if last {
            self.done = true;
        }
    }
}

/// A server-sent event stream declared UTF-8 (a streamed generation's, the KV events', the
/// inspector's snapshots): `text/event-stream; charset=utf-8`, as OpenAI, Anthropic and vLLM
/// send it. Server-sent events are always UTF-8, but a client that
/// goes by the header alone (Python `requests` reads a `text/*` type without a charset as
/// ISO-8859-1) would otherwise split a line inside a character whose UTF-8 holds the byte 0x85,
/// which Latin-1 makes a line break (NEL): `"★"` is `E2 98 85`.
pub(crate) fn utf8_event_stream(mut resp: Response) -> Response {
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}
