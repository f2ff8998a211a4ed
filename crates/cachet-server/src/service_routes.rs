//! The service's own routes, beside generation: health, models, metrics, tokenize, detokenize,
//! session release, cache reset, and the 404/405 fallbacks.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use prometheus_client::encoding::prometheus_text;
use serde::Deserialize;
use serde_json::json;

use crate::body::read_json;
use crate::error::{ApiError, OpenAiError};
use crate::generate::check_session_id;
use crate::openai::{convert_messages, ChatMessageIn};
use crate::AppState;

/// 200 while the engine serves; 503 while it drains, once it died, or after it stopped.
pub async fn health(State(state): State<AppState>) -> Response {
    match state.engine().state() {
        cachet_engine::EngineState::Running => StatusCode::OK.into_response(),
        s => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": s.as_str()})),
        )
            .into_response(),
    }
}

pub async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let root = state.engine().model().name.clone();
    let data: Vec<_> = state
        .model_names()
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "cachet",
                "root": root, "parent": null, "max_model_len": state.max_model_len(),
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Prometheus text format by default; OpenMetrics when the scraper asks for it. Gauges are read
/// off the engine now, so they are true whenever they are scraped.
pub async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let engine = state.engine();
    state.metrics().set_gauges(&engine.gauges());
    state.metrics().set_engine_state(engine.state());
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let encoded = if wants_openmetrics {
        state
            .metrics()
            .encode_openmetrics()
            .map(|t| (OPENMETRICS_CONTENT_TYPE, t))
    } else {
        state
            .metrics()
            .encode_prometheus()
            .map(|t| (prometheus_text::CONTENT_TYPE, t))
    };
    match encoded {
        Ok((ct, text)) => ([(header::CONTENT_TYPE, ct)], text).into_response(),
        Err(_) => ApiError::Internal("failed to encode metrics".into()).openai_response(),
    }
}

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<ChatMessageIn>>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
}

/// `{prompt}` is encoded as `/v1/completions` does, `{messages}` as `/v1/chat/completions` does,
/// so `count` is the prompt length those routes will report.
pub async fn tokenize(
    State(state): State<AppState>,
    body: Body,
) -> Result<Json<serde_json::Value>, OpenAiError> {
    let req: TokenizeRequest = read_json(body, state.max_body_bytes()).await?;
    if req.model.is_some() {
        state.check_model(req.model.as_deref())?;
    }
    let tok = state.tokenizer().clone();
    let tokens = match (req.prompt, req.messages) {
        (Some(p), None) => tok
            .encode(&p, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?,
        (None, Some(m)) => {
            let msgs = convert_messages(&m)?;
            let text = tok
                .apply_chat_template(&msgs, req.add_generation_prompt.unwrap_or(true))
                .map_err(|e| {
                    ApiError::bad_param("messages", format!("Cannot apply the chat template: {e}"))
                })?;
            tok.encode(&text, req.add_special_tokens.unwrap_or(false))
                .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?
        }
        _ => {
            return Err(ApiError::bad_request("Send exactly one of `prompt` or `messages`.").into())
        }
    };
    Ok(Json(
        json!({"count": tokens.len(), "tokens": tokens, "max_model_len": state.max_model_len()}),
    ))
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

pub async fn detokenize(
    State(state): State<AppState>,
    body: Body,
) -> Result<Json<serde_json::Value>, OpenAiError> {
    let req: DetokenizeRequest = read_json(body, state.max_body_bytes()).await?;
    if req.model.is_some() {
        state.check_model(req.model.as_deref())?;
    }
    let text = state
        .tokenizer()
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::bad_param("tokens", format!("Cannot decode the tokens: {e}")))?;
    Ok(Json(json!({"prompt": text})))
}

/// `DELETE /v1/sessions/{id}`: closes a session of the caller's tenant (a named key's sessions
/// are its own: another key's session with the same id is another session). A turn in flight is
/// aborted (its response ends with finish reason `abort`), and the parked KV is released (full
/// blocks stay in the prefix cache). 204 whether or not the session existed (an unknown, closed
/// or expired id is not an error).
pub async fn delete_session(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<StatusCode, OpenAiError> {
    // A path that does not decode (e.g. `%FF`) is an invalid id too, in OpenAI's shape.
    let id = id.map(|Path(id)| id).unwrap_or_default();
    check_session_id(Some(&id))?;
    let key = cachet_core::request::session_key(crate::auth::current_tenant().as_deref(), &id);
    state.engine().release_session(&key).await;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /reset_prefix_cache` (as in vLLM): drops every prefix-cache entry. `{"reset": false}`
/// when a block is still held (a running request or a parked session: release those first).
pub async fn reset_prefix_cache(State(state): State<AppState>) -> Json<serde_json::Value> {
    let reset = state.engine().reset_prefix_cache().await;
    Json(json!({ "reset": reset }))
}

/// 404 for a path no route has, in the shape of the API the path belongs to (Anthropic's under
/// `/v1/messages`, OpenAI's elsewhere). The path is not echoed.
pub async fn not_found(uri: Uri) -> Response {
    ApiError::NotFound.response_for_path(uri.path())
}

/// 405 for a method a route does not answer, in the shape of the path's API.
pub async fn method_not_allowed(uri: Uri) -> Response {
    ApiError::MethodNotAllowed.response_for_path(uri.path())
}
