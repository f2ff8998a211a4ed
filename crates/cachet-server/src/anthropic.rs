//! `POST /v1/messages`: the Anthropic Messages API.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_core::RequestDraft;
use cachet_text::{ChatMessage, Role};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::body::read_json;
use crate::error::{AnthropicError, ApiError};
use crate::generate::{
    check_session_id, response_id, Final, GenEvent, Generation, StopKind, REQUEST_ID_HEADER,
};
use crate::sampling::{build_sampling, check_cache_salt, Api, SamplingInput};
use crate::usage::{anthropic_start_usage, anthropic_usage, request_metrics_json, session_json};
use crate::AppState;

/// A content block; only text blocks are accepted (`cache_control` is accepted and ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub cache_control: Option<Value>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

impl Content {
    fn to_text(&self, param: &str) -> Result<String, ApiError> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Blocks(blocks) => {
                let mut out = String::new();
                for b in blocks {
                    if b.kind != "text" {
                        return Err(ApiError::bad_param(
                            param,
                            format!(
                                "Unsupported content block type `{}`: only `text` is supported.",
                                b.kind
                            ),
                        ));
                    }
                    match &b.text {
                        Some(t) => out.push_str(t),
                        None => {
                            return Err(ApiError::bad_param(
                                param,
                                "A `text` block needs a `text` field.",
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
pub struct MessageIn {
    pub role: String,
    pub content: Content,
}

#[derive(Clone, Debug, Deserialize)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    #[serde(default)]
    pub system: Option<Content>,
    pub max_tokens: u32,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    /// An object (`{"user_id": ...}`); any other JSON type is a 400.
    #[serde(default)]
    pub metadata: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Resumable session (cachet extension; the SDK sends it via `extra_body`).
    #[serde(default)]
    pub session_id: Option<String>,
}

fn stop_reason(f: &Final) -> (&'static str, Value) {
    match &f.stop {
        StopKind::Eos | StopKind::Abort | StopKind::Error => ("end_turn", Value::Null),
        StopKind::Length => ("max_tokens", Value::Null),
        StopKind::StopString(s) => ("stop_sequence", json!(s)),
    }
}

fn event(name: &str, v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(v.to_string()))
}

pub async fn messages(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AnthropicError> {
    let req: MessagesRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.model.as_deref())?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must contain at least one message.",
        )
        .into());
    }
    let mut chat = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        let s = system.to_text("system")?;
        if !s.is_empty() {
            chat.push(ChatMessage::new(Role::System, s));
        }
    }
    for m in &req.messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::bad_param(
                "messages",
                format!("Unexpected role `{}`: use `user` or `assistant`.", m.role),
            )
            .into());
        }
        let role = if m.role == "user" {
            Role::User
        } else {
            Role::Assistant
        };
        chat.push(ChatMessage::new(role, m.content.to_text("messages")?));
    }
    let tok = state.tokenizer().clone();
    let rendered = tok.apply_chat_template(&chat, true).map_err(|e| {
        ApiError::bad_param("messages", format!("Cannot apply the chat template: {e}"))
    })?;
    let prompt = tok
        .encode(&rendered, false)
        .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?;
    let input = SamplingInput {
        max_tokens: Some(req.max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        ..Default::default()
    };
    let (sampling, max_tokens) = build_sampling(&input, Api::Anthropic, "max_tokens")?;
    check_cache_salt(&req.cache_salt)?;
    check_session_id(req.session_id.as_deref())?;
    let mut draft = RequestDraft::new(response_id(&headers, "msg_"), prompt, sampling);
    draft.max_tokens = max_tokens;
    draft.cache_salt = req.cache_salt.clone();
    draft.session_id = req.session_id.as_deref().map(std::sync::Arc::from);
    let mut gen = Generation::start(
        &state,
        draft,
        req.stop_sequences.clone().unwrap_or_default(),
    )
    .await?;
    let id = gen.request_id().to_string();
    let mut resp = if req.stream.unwrap_or(false) {
        Sse::new(stream_events(state, gen, model)).into_response()
    } else {
        let mut text = String::new();
        let mut fin = None;
        while let Some(ev) = gen.next().await {
            match ev {
                GenEvent::Delta(d) => text.push_str(&d.text),
                GenEvent::Done(f) => fin = Some(f),
            }
        }
        let fin = fin.map(|f| *f).unwrap_or_else(|| aborted(&gen));
        if let Some(e) = &fin.error {
            let mut resp = ApiError::Internal(e.to_string()).anthropic_response();
            if let Ok(v) = HeaderValue::from_str(&id) {
                resp.headers_mut().insert(REQUEST_ID_HEADER, v);
            }
            return Ok(resp);
        }
        let (reason, seq) = stop_reason(&fin);
        let mut body = json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": anthropic_usage(&fin),
        });
        if let Some(s) = &fin.session {
            body["session"] = session_json(s);
        }
        if state.per_request_metrics() {
            body["metrics"] = request_metrics_json(&fin);
        }
        Json(body).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    Ok(resp)
}

fn aborted(gen: &Generation) -> Final {
    Final {
        stop: StopKind::Abort,
        report: gen.report().cloned(),
        session: gen.session().cloned(),
        prompt_len: gen.prompt_len(),
        tokens_received: 0,
        error: None,
    }
}

fn stream_events(
    state: AppState,
    mut gen: Generation,
    model: String,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let id = gen.request_id().to_string();
        // message_start carries the prefill stats, so it waits for the first output.
        let first = gen.next().await;
        let mut start = json!({
            "type": "message_start",
            "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": anthropic_start_usage(gen.report(), gen.session(), gen.prompt_len()),
            }
        });
        if let Some(s) = gen.session() {
            start["message"]["session"] = session_json(s);
        }
        yield event("message_start", &start);
        yield event("content_block_start", &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}));
        yield event("ping", &json!({"type": "ping"}));
        let mut fin = None;
        let mut next = first;
        while let Some(ev) = next {
            match ev {
                GenEvent::Delta(d) => {
                    if !d.text.is_empty() {
                        yield event("content_block_delta", &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d.text}}));
                    }
                }
                GenEvent::Done(f) => fin = Some(f),
            }
            next = gen.next().await;
        }
        let fin = fin.map(|f| *f).unwrap_or_else(|| aborted(&gen));
        if let Some(e) = &fin.error {
            // The engine failed mid-stream: Anthropic's error event ends the stream.
            yield event("error", &ApiError::Internal(e.to_string()).anthropic_body());
            return;
        }
        yield event("content_block_stop", &json!({"type": "content_block_stop", "index": 0}));
        let (reason, seq) = stop_reason(&fin);
        let mut delta = json!({
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": anthropic_usage(&fin),
        });
        if let Some(s) = &fin.session {
            delta["session"] = session_json(s);
        }
        if state.per_request_metrics() {
            delta["metrics"] = request_metrics_json(&fin);
        }
        yield event("message_delta", &delta);
        yield event("message_stop", &json!({"type": "message_stop"}));
    }
}
