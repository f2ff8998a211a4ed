//! `POST /v1/chat/completions` and `POST /v1/completions`.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_core::{RequestDraft, Sampled};
use cachet_text::{ChatMessage, Role, TextTokenizer};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::body::read_json;
use crate::error::{ApiError, OpenAiError};
use crate::generate::{
    check_session_id, response_id, Delta, Final, GenEvent, Generation, REQUEST_ID_HEADER,
};
use crate::sampling::{build_sampling, check_cache_salt, Api, SamplingInput, StopField};
use crate::usage::{openai_usage, request_metrics_json, session_json};
use crate::AppState;

/// A message's content: a string or a list of `{type: "text", text}` parts.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl MessageContent {
    /// Joins the text parts; any other part type is rejected.
    pub fn to_text(&self, param: &str) -> Result<String, ApiError> {
        match self {
            MessageContent::Text(s) => Ok(s.clone()),
            MessageContent::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad_param(
                            param,
                            format!(
                                "Unsupported content part type `{}`: only `text` is supported.",
                                p.kind
                            ),
                        ));
                    }
                    match &p.text {
                        Some(t) => out.push_str(t),
                        None => {
                            return Err(ApiError::bad_param(
                                param,
                                "A `text` content part needs a `text` field.",
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// Renders OpenAI messages into engine chat messages.
pub fn convert_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must contain at least one message.",
        ));
    }
    messages
        .iter()
        .map(|m| {
            let content = match &m.content {
                Some(c) => c.to_text("messages")?,
                None => String::new(),
            };
            let role: Role = m.role.parse().map_err(|e: cachet_text::MessageError| {
                ApiError::bad_param("messages", e.to_string())
            })?;
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields shared by chat and text completions.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CommonParams {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub min_tokens: Option<u32>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub priority: Option<i32>,
}

impl CommonParams {
    fn sampling_input(&self, max_tokens: Option<u32>, logprobs: Option<u32>) -> SamplingInput {
        SamplingInput {
            max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_tokens: self.min_tokens,
            n: self.n,
            logprobs,
        }
    }

    /// The request as the engine will validate it: sampling checked against OpenAI's ranges,
    /// cache and session options.
    fn draft(
        &self,
        label: String,
        prompt: Vec<u32>,
        input: &SamplingInput,
        max_tokens_param: &str,
        session_id: Option<&str>,
    ) -> Result<RequestDraft, ApiError> {
        let (sampling, max_tokens) = build_sampling(input, Api::OpenAi, max_tokens_param)?;
        check_cache_salt(&self.cache_salt)?;
        check_session_id(session_id)?;
        let mut d = RequestDraft::new(label, prompt, sampling);
        d.max_tokens = max_tokens;
        d.cache_salt = self.cache_salt.clone();
        d.priority = self.priority.unwrap_or(0);
        d.session_id = session_id.map(std::sync::Arc::from);
        Ok(d)
    }

    fn stop_strings(&self) -> Vec<String> {
        self.stop
            .clone()
            .map(StopField::into_vec)
            .unwrap_or_default()
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Resumable session (cachet extension; the SDKs send it via `extra_body`).
    #[serde(default)]
    pub session_id: Option<String>,
}

/// A completions prompt: one string or one token list (a batch of several is rejected).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Resumable session (cachet extension, as on chat completions): the next turn's prompt
    /// extends this one's prompt and completion.
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub echo: Option<bool>,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn token_text(tok: &dyn TextTokenizer, id: u32) -> String {
    tok.token_to_piece(id).unwrap_or_default()
}

fn chat_logprobs(tok: &dyn TextTokenizer, tokens: &[Sampled]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|s| {
            let text = token_text(tok, s.token);
            let top: Vec<Value> = s
                .top_logprobs
                .iter()
                .map(|(id, lp)| {
                    let t = token_text(tok, *id);
                    json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
                })
                .collect();
            json!({"token": text, "logprob": s.logprob, "bytes": text.as_bytes(), "top_logprobs": top})
        })
        .collect();
    json!({ "content": content })
}

fn completion_logprobs(tok: &dyn TextTokenizer, tokens: &[Sampled], offset: &mut usize) -> Value {
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for s in tokens {
        let t = token_text(tok, s.token);
        offsets.push(*offset);
        *offset += t.len();
        texts.push(t);
        lps.push(s.logprob);
        let top: serde_json::Map<String, Value> = s
            .top_logprobs
            .iter()
            .map(|(id, lp)| (token_text(tok, *id), json!(lp)))
            .collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    resp
}

/// Which OpenAI route a generation belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Runs a generation to its end, collecting text and logprob tokens.
async fn collect(gen: &mut Generation) -> (String, Vec<Sampled>, Option<Box<Final>>) {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut fin = None;
    while let Some(ev) = gen.next().await {
        match ev {
            GenEvent::Delta(Delta { text: t, tokens: s }) => {
                text.push_str(&t);
                tokens.extend(s);
            }
            GenEvent::Done(f) => fin = Some(f),
        }
    }
    (text, tokens, fin)
}

fn final_or_abort(gen: &Generation, fin: Option<Box<Final>>) -> Final {
    fin.map(|f| *f).unwrap_or_else(|| Final {
        stop: crate::generate::StopKind::Abort,
        report: gen.report().cloned(),
        session: gen.session().cloned(),
        prompt_len: gen.prompt_len(),
        tokens_received: 0,
        error: None,
    })
}

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: ChatRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    let messages = convert_messages(&req.messages)?;
    let tok = state.tokenizer().clone();
    let rendered = tok.apply_chat_template(&messages, true).map_err(|e| {
        ApiError::bad_param("messages", format!("Cannot apply the chat template: {e}"))
    })?;
    let prompt = tok
        .encode(&rendered, false)
        .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), top) => Some(top.unwrap_or(0)),
        (_, Some(t)) if t > 0 => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "`top_logprobs` requires `logprobs` to be true.",
            )
            .into())
        }
        _ => None,
    };
    let (max_tokens, param) = match req.max_completion_tokens {
        Some(m) => (Some(m), "max_completion_tokens"),
        None => (req.common.max_tokens, "max_tokens"),
    };
    let input = req.common.sampling_input(max_tokens, logprobs);
    let draft = req.common.draft(
        response_id(&headers, "chatcmpl-"),
        prompt,
        &input,
        param,
        req.session_id.as_deref(),
    )?;
    let gen = Generation::start(&state, draft, req.common.stop_strings()).await?;
    run(
        state,
        gen,
        model,
        Kind::Chat,
        req.common.stream.unwrap_or(false),
        req.common.include_usage(),
    )
    .await
}

pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: CompletionRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    if req.echo == Some(true) {
        return Err(ApiError::bad_param("echo", "`echo` is not supported.").into());
    }
    let tok = state.tokenizer().clone();
    let several = || {
        ApiError::bad_param(
            "prompt",
            "Only a single prompt is supported per request; send several requests instead.",
        )
    };
    let prompt = match req.prompt {
        PromptField::Text(s) => tok
            .encode(&s, true)
            .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?,
        PromptField::Tokens(t) => {
            if !t.is_empty() {
                tok.decode(&t, false).map_err(|e| {
                    ApiError::bad_param("prompt", format!("Invalid token ids in prompt: {e}"))
                })?;
            }
            t
        }
        PromptField::Texts(mut v) => {
            if v.len() != 1 {
                return Err(several().into());
            }
            let s = v.pop().unwrap_or_default();
            tok.encode(&s, true)
                .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?
        }
        PromptField::TokenLists(mut v) => {
            if v.len() != 1 {
                return Err(several().into());
            }
            v.pop().unwrap_or_default()
        }
    };
    let input = req
        .common
        .sampling_input(req.common.max_tokens.or(Some(16)), req.logprobs);
    let draft = req.common.draft(
        response_id(&headers, "cmpl-"),
        prompt,
        &input,
        "max_tokens",
        req.session_id.as_deref(),
    )?;
    let gen = Generation::start(&state, draft, req.common.stop_strings()).await?;
    run(
        state,
        gen,
        model,
        Kind::Completion,
        req.common.stream.unwrap_or(false),
        req.common.include_usage(),
    )
    .await
}

async fn run(
    state: AppState,
    mut gen: Generation,
    model: String,
    kind: Kind,
    stream: bool,
    include_usage: bool,
) -> Result<Response, OpenAiError> {
    let id = gen.request_id().to_string();
    if stream {
        let sse = Sse::new(stream_events(state, gen, model, kind, include_usage));
        return Ok(with_request_id(sse.into_response(), &id));
    }
    let tok = state.tokenizer().clone();
    let (text, tokens, fin) = collect(&mut gen).await;
    let fin = final_or_abort(&gen, fin);
    if let Some(e) = &fin.error {
        let resp = ApiError::Internal(e.to_string()).openai_response();
        return Ok(with_request_id(resp, &id));
    }
    let want_lp = !tokens.is_empty();
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": if want_lp { chat_logprobs(tok.as_ref(), &tokens) } else { Value::Null },
            "finish_reason": fin.stop.openai(),
            "stop_reason": stop_reason(&fin),
        }),
        Kind::Completion => json!({
            "index": 0,
            "text": text,
            "logprobs": if want_lp { completion_logprobs(tok.as_ref(), &tokens, &mut 0) } else { Value::Null },
            "finish_reason": fin.stop.openai(),
            "stop_reason": stop_reason(&fin),
        }),
    };
    let mut body = json!({
        "id": id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": now_secs(),
        "model": model,
        "choices": [choice],
        "usage": openai_usage(&fin),
    });
    if let Some(s) = &fin.session {
        body["session"] = session_json(s);
    }
    if state.per_request_metrics() {
        body["metrics"] = request_metrics_json(&fin);
    }
    Ok(with_request_id(Json(body).into_response(), &id))
}

/// vLLM's `stop_reason`: the matched stop string, else null.
fn stop_reason(fin: &Final) -> Value {
    match &fin.stop {
        crate::generate::StopKind::StopString(s) => json!(s),
        _ => Value::Null,
    }
}

fn data(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

fn stream_events(
    state: AppState,
    mut gen: Generation,
    model: String,
    kind: Kind,
    include_usage: bool,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let tok = state.tokenizer().clone();
        let id = gen.request_id().to_string();
        let created = now_secs();
        let object = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let usage_field = |v: &mut Value| {
            if include_usage {
                v["usage"] = Value::Null;
            }
        };
        let mut text_offset = 0usize;
        if kind == Kind::Chat {
            let mut first = json!({
                "id": id, "object": object, "created": created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
            });
            usage_field(&mut first);
            yield data(&first);
        }
        let mut fin = None;
        while let Some(ev) = gen.next().await {
            match ev {
                GenEvent::Delta(d) => {
                    let lp = if d.tokens.is_empty() {
                        Value::Null
                    } else if kind == Kind::Chat {
                        chat_logprobs(tok.as_ref(), &d.tokens)
                    } else {
                        completion_logprobs(tok.as_ref(), &d.tokens, &mut text_offset)
                    };
                    let choice = if kind == Kind::Chat {
                        json!({"index": 0, "delta": {"content": d.text}, "logprobs": lp, "finish_reason": null})
                    } else {
                        json!({"index": 0, "text": d.text, "logprobs": lp, "finish_reason": null})
                    };
                    let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                    usage_field(&mut chunk);
                    yield data(&chunk);
                }
                GenEvent::Done(f) => fin = Some(f),
            }
        }
        let fin = final_or_abort(&gen, fin);
        if let Some(e) = &fin.error {
            // The engine failed mid-stream: an error event in OpenAI's shape, then [DONE].
            yield data(&ApiError::Internal(e.to_string()).openai_body());
            yield Ok(Event::default().data("[DONE]"));
            return;
        }
        let choice = if kind == Kind::Chat {
            json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": fin.stop.openai(), "stop_reason": stop_reason(&fin)})
        } else {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": fin.stop.openai(), "stop_reason": stop_reason(&fin)})
        };
        let mut last = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
        usage_field(&mut last);
        let metrics = state.per_request_metrics().then(|| request_metrics_json(&fin));
        let session = fin.session.as_ref().map(session_json);
        // `session` and `metrics` ride on the usage chunk, or on the finish chunk without one.
        let extras = |v: &mut Value| {
            if let Some(s) = &session {
                v["session"] = s.clone();
            }
            if let Some(m) = &metrics {
                v["metrics"] = m.clone();
            }
        };
        if include_usage {
            yield data(&last);
            let mut usage = json!({
                "id": id, "object": object, "created": created, "model": model,
                "choices": [], "usage": openai_usage(&fin),
            });
            extras(&mut usage);
            yield data(&usage);
        } else {
            extras(&mut last);
            yield data(&last);
        }
        yield Ok(Event::default().data("[DONE]"));
    }
}
