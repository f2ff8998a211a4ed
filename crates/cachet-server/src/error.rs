//! Typed API errors and their two wire shapes (OpenAI and Anthropic).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use thiserror::Error;

/// Every error a route can answer with. The wire shape depends on the API family, see
/// [`OpenAiError`] and [`AnthropicError`].
#[derive(Debug, Error)]
pub enum ApiError {
    /// Malformed JSON, wrong types, missing fields, invalid values.
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<String>,
    },
    /// The prompt (plus `max_tokens`) does not fit the model's context.
    #[error("{0}")]
    ContextLength(String),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("Invalid or missing API key.")]
    Unauthorized,
    #[error("Request body exceeds the limit of {limit} bytes.")]
    PayloadTooLarge { limit: usize },
    /// Session `{0}` already has a turn in flight (409).
    #[error("Session `{0}` already has a turn in flight; send the next turn after it finishes.")]
    SessionBusy(String),
    #[error("The server is overloaded: the request queue is full. Retry later.")]
    QueueFull,
    #[error("The server is shutting down.")]
    ShuttingDown,
    /// The engine's core thread failed: nothing more is served until a restart.
    #[error("The engine failed and is not serving requests.")]
    EngineDead,
    #[error("Internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } | ApiError::ContextLength(_) => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::SessionBusy(_) => StatusCode::CONFLICT,
            ApiError::QueueFull | ApiError::ShuttingDown | ApiError::EngineDead => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::BadRequest { param, .. } => param.as_deref(),
            ApiError::ContextLength(_) => Some("messages"),
            ApiError::ModelNotFound(_) => Some("model"),
            ApiError::SessionBusy(_) => Some("session_id"),
            _ => None,
        }
    }

    fn openai_type_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self {
            ApiError::BadRequest { .. } => ("invalid_request_error", None),
            ApiError::ContextLength(_) => {
                ("invalid_request_error", Some("context_length_exceeded"))
            }
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            ApiError::Unauthorized => ("invalid_request_error", Some("invalid_api_key")),
            ApiError::PayloadTooLarge { .. } => {
                ("invalid_request_error", Some("request_too_large"))
            }
            ApiError::SessionBusy(_) => ("conflict_error", Some("session_busy")),
            ApiError::QueueFull => ("server_error", Some("overloaded")),
            ApiError::ShuttingDown => ("server_error", Some("shutting_down")),
            ApiError::EngineDead => ("server_error", Some("engine_dead")),
            ApiError::Internal(_) => ("server_error", Some("internal_error")),
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } | ApiError::ContextLength(_) | ApiError::SessionBusy(_) => {
                "invalid_request_error"
            }
            ApiError::ModelNotFound(_) => "not_found_error",
            ApiError::Unauthorized => "authentication_error",
            ApiError::PayloadTooLarge { .. } => "request_too_large",
            ApiError::QueueFull | ApiError::ShuttingDown => "overloaded_error",
            ApiError::EngineDead => "api_error",
            ApiError::Internal(_) => "api_error",
        }
    }

    fn finish(&self, body: serde_json::Value) -> Response {
        let mut resp = (self.status(), axum::Json(body)).into_response();
        if matches!(
            self,
            ApiError::QueueFull | ApiError::ShuttingDown | ApiError::EngineDead
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if matches!(self, ApiError::Unauthorized) {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }

    /// `{"error": {"message", "type", "param", "code"}}`
    pub fn openai_body(&self) -> serde_json::Value {
        let (ty, code) = self.openai_type_and_code();
        json!({
            "error": {
                "message": self.to_string(),
                "type": ty,
                "param": self.param(),
                "code": code,
            }
        })
    }

    pub fn openai_response(&self) -> Response {
        self.finish(self.openai_body())
    }

    /// `{"type": "error", "error": {"type", "message"}}`
    pub fn anthropic_body(&self) -> serde_json::Value {
        json!({
            "type": "error",
            "error": { "type": self.anthropic_type(), "message": self.to_string() }
        })
    }

    pub fn anthropic_response(&self) -> Response {
        self.finish(self.anthropic_body())
    }
}

/// An [`ApiError`] rendered in OpenAI's shape.
#[derive(Debug)]
pub struct OpenAiError(pub ApiError);

/// An [`ApiError`] rendered in Anthropic's shape.
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for OpenAiError {
    fn from(e: ApiError) -> Self {
        OpenAiError(e)
    }
}

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        self.0.openai_response()
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        self.0.anthropic_response()
    }
}
