//! Typed API errors and their two wire shapes (OpenAI and Anthropic).
//!
//! Nothing an error repeats from the request is unbounded: [`clip`] shortens an echoed value
//! (a model name, a field name, a value quoted by serde) to [`MAX_ECHO_CHARS`], and every
//! rendered message is cut at [`MAX_MESSAGE_BYTES`] whatever it was built from.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use thiserror::Error;

/// Longest piece of the request an error message repeats, in characters.
pub const MAX_ECHO_CHARS: usize = 64;
/// Longest error message sent, in bytes (longer ones are cut at a character boundary).
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Room for `clip`'s "… (N bytes)" marker: a quoted run this much longer than
/// [`MAX_ECHO_CHARS`] is left as it is by [`clip_quoted`].
const CLIP_MARK_SLACK: usize = 24;
/// Longest `param` sent, in bytes.
const MAX_PARAM_BYTES: usize = 128;

/// `s` if it has at most [`MAX_ECHO_CHARS`] characters, else its start, an ellipsis and its
/// length: what an error may repeat of a value the client sent.
pub fn clip(s: &str) -> String {
    clip_to(s, MAX_ECHO_CHARS)
}

fn clip_to(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        None => s.to_string(),
        Some((cut, _)) => format!("{}… ({} bytes)", &s[..cut], s.len()),
    }
}

/// `s` cut to at most `max` bytes at a character boundary, marked when cut.
fn cut_bytes(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    const MARK: &str = "… (truncated)";
    let mut end = max.saturating_sub(MARK.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARK}", &s[..end])
}

/// Shortens every run quoted with `"` or `` ` `` in `message` (serde quotes the offending
/// value, variant or field name) to [`MAX_ECHO_CHARS`], keeping the explanation around them.
pub fn clip_quoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE_BYTES));
    let mut chars = message.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c != '"' && c != '`' {
            out.push(c);
            continue;
        }
        // Find the closing delimiter (a backslash escapes the next character in "...").
        let start = i + c.len_utf8();
        let mut end = None;
        while let Some((j, d)) = chars.next() {
            if d == '\\' && c == '"' {
                chars.next();
            } else if d == c {
                end = Some(j);
                break;
            }
        }
        let inner = &message[start..end.unwrap_or(message.len())];
        out.push(c);
        // A run already clipped by [`clip`] (its marker fits in the slack) stays as it is.
        match inner.char_indices().nth(MAX_ECHO_CHARS + CLIP_MARK_SLACK) {
            None => out.push_str(inner),
            Some(_) => out.push_str(&clip(inner)),
        }
        if end.is_some() {
            out.push(c);
        }
    }
    out
}

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
    /// The prompt (plus `max_tokens`) does not fit the model's context; `param` names the
    /// prompt's field (`messages`, or `prompt` on `/v1/completions`).
    #[error("{message}")]
    ContextLength {
        message: String,
        param: &'static str,
    },
    #[error("The model `{}` does not exist.", clip(.0))]
    ModelNotFound(String),
    #[error("Invalid or missing API key.")]
    Unauthorized,
    /// A tenant's (named) key on an operator route: the cache inspector, its event and stats
    /// streams and the resets read or drop every tenant's cache (403).
    #[error("This route needs an operator key: an --api-key entry without a NAME: (named keys are tenants, and this route shows or drops every tenant's cache).")]
    OperatorOnly,
    /// A cross-origin request from an origin `--allowed-origins` does not list (403).
    #[error("Requests from this origin are not allowed (see --allowed-origins).")]
    ForbiddenOrigin,
    /// No route has this path (404).
    #[error("Not found.")]
    NotFound,
    /// A stored object (a response) that does not exist for this API key (404); `param`
    /// names the field that gave its id, when a body did.
    #[error("{message}")]
    NotFoundId {
        message: String,
        param: Option<&'static str>,
    },
    /// The path exists, the method does not (405).
    #[error("Method not allowed.")]
    MethodNotAllowed,
    #[error("Request body exceeds the limit of {limit} bytes.")]
    PayloadTooLarge { limit: usize },
    /// A body that is not declared `application/json` (415).
    #[error("Unsupported content type: request bodies must be sent as `Content-Type: application/json`.")]
    UnsupportedMediaType,
    /// The body did not arrive within `--body-read-timeout` (408).
    #[error("The request body was not received within {secs} s.")]
    RequestTimeout { secs: f64 },
    /// Session `{0}` already has a turn in flight (409).
    #[error("Session `{}` already has a turn in flight; send the next turn after it finishes.", clip(.0))]
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

/// Which API family's error shape a path answers in: Anthropic's for `/v1/messages` and
/// everything under it, OpenAI's for every other path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    OpenAi,
    Anthropic,
}

impl Shape {
    pub fn of_path(path: &str) -> Shape {
        match path.strip_prefix("/v1/messages") {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => Shape::Anthropic,
            _ => Shape::OpenAi,
        }
    }
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

    /// The error as `/v1/completions` names its fields: a prompt too long is `prompt`'s.
    pub fn for_prompt(self) -> Self {
        match self {
            ApiError::ContextLength { message, .. } => ApiError::ContextLength {
                message,
                param: "prompt",
            },
            e => e,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } | ApiError::ContextLength { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) | ApiError::NotFound | ApiError::NotFoundId { .. } => {
                StatusCode::NOT_FOUND
            }
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ForbiddenOrigin | ApiError::OperatorOnly => StatusCode::FORBIDDEN,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
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
            ApiError::ContextLength { param, .. } => Some(param),
            ApiError::ModelNotFound(_) => Some("model"),
            ApiError::SessionBusy(_) => Some("session_id"),
            ApiError::NotFoundId { param, .. } => *param,
            _ => None,
        }
    }

    fn openai_type_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self {
            ApiError::BadRequest { .. } => ("invalid_request_error", None),
            ApiError::ContextLength { .. } => {
                ("invalid_request_error", Some("context_length_exceeded"))
            }
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            ApiError::NotFound => ("invalid_request_error", Some("not_found")),
            ApiError::NotFoundId { .. } => ("invalid_request_error", Some("not_found")),
            ApiError::Unauthorized => ("invalid_request_error", Some("invalid_api_key")),
            ApiError::ForbiddenOrigin => ("permission_error", Some("forbidden_origin")),
            ApiError::OperatorOnly => ("permission_error", Some("operator_key_required")),
            ApiError::MethodNotAllowed => ("invalid_request_error", Some("method_not_allowed")),
            ApiError::PayloadTooLarge { .. } => {
                ("invalid_request_error", Some("request_too_large"))
            }
            ApiError::UnsupportedMediaType => {
                ("invalid_request_error", Some("unsupported_media_type"))
            }
            ApiError::RequestTimeout { .. } => ("invalid_request_error", Some("request_timeout")),
            ApiError::SessionBusy(_) => ("conflict_error", Some("session_busy")),
            ApiError::QueueFull => ("server_error", Some("overloaded")),
            ApiError::ShuttingDown => ("server_error", Some("shutting_down")),
            ApiError::EngineDead => ("server_error", Some("engine_dead")),
            ApiError::Internal(_) => ("server_error", Some("internal_error")),
        }
    }

    /// Anthropic's error types; `invalid_request_error` also stands for the 4xx statuses its
    /// documentation does not list (405, 408, 409, 415).
    fn anthropic_type(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. }
            | ApiError::ContextLength { .. }
            | ApiError::SessionBusy(_)
            | ApiError::MethodNotAllowed
            | ApiError::UnsupportedMediaType
            | ApiError::RequestTimeout { .. } => "invalid_request_error",
            ApiError::ModelNotFound(_) | ApiError::NotFound | ApiError::NotFoundId { .. } => {
                "not_found_error"
            }
            ApiError::Unauthorized => "authentication_error",
            ApiError::ForbiddenOrigin | ApiError::OperatorOnly => "permission_error",
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
        if matches!(
            self,
            ApiError::MethodNotAllowed | ApiError::PayloadTooLarge { .. }
        ) {
            // The request was not (fully) read: the connection cannot carry another one.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }

    /// The message as sent: every quoted run clipped ([`clip_quoted`]: what a message quotes is
    /// what it repeats from the request), never longer than [`MAX_MESSAGE_BYTES`].
    pub fn message(&self) -> String {
        cut_bytes(&clip_quoted(&self.to_string()), MAX_MESSAGE_BYTES)
    }

    /// `{"error": {"message", "type", "param", "code"}}`
    pub fn openai_body(&self) -> serde_json::Value {
        let (ty, code) = self.openai_type_and_code();
        json!({
            "error": {
                "message": self.message(),
                "type": ty,
                "param": self.param().map(|p| cut_bytes(p, MAX_PARAM_BYTES)),
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
            "error": { "type": self.anthropic_type(), "message": self.message() }
        })
    }

    pub fn anthropic_response(&self) -> Response {
        self.finish(self.anthropic_body())
    }

    /// The response in the shape of the API `path` belongs to ([`Shape::of_path`]).
    pub fn response_for_path(&self, path: &str) -> Response {
        match Shape::of_path(path) {
            Shape::OpenAi => self.openai_response(),
            Shape::Anthropic => self.anthropic_response(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_keeps_short_values_and_shortens_long_ones() {
        assert_eq!(clip("gpt-4o"), "gpt-4o");
        let exact = "é".repeat(MAX_ECHO_CHARS);
        assert_eq!(clip(&exact), exact);
        let long = "x".repeat(100_000);
        let c = clip(&long);
        assert_eq!(c, format!("{}… (100000 bytes)", "x".repeat(MAX_ECHO_CHARS)));
        // Multi-byte characters are never split.
        let c = clip(&"é".repeat(100));
        assert_eq!(c, format!("{}… (200 bytes)", "é".repeat(MAX_ECHO_CHARS)));
    }

    #[test]
    fn model_not_found_echoes_a_bounded_name() {
        let e = ApiError::ModelNotFound("m".repeat(100_000));
        let body = e.openai_body();
        let msg = body["error"]["message"].as_str().unwrap();
        assert_eq!(
            msg,
            format!(
                "The model `{}… (100000 bytes)` does not exist.",
                "m".repeat(MAX_ECHO_CHARS)
            )
        );
        assert_eq!(body["error"]["code"], "model_not_found");
    }

    #[test]
    fn every_message_is_cut_at_the_limit() {
        let e = ApiError::bad_param("stop", "y".repeat(5000));
        let msg = e.message();
        assert!(msg.len() <= MAX_MESSAGE_BYTES, "{}", msg.len());
        assert!(msg.ends_with("… (truncated)"));
        assert!(msg.starts_with("yyyy"));
        // A quoted echo built by a route is clipped when rendered.
        let e = ApiError::bad_param(
            "messages",
            format!("Unexpected role `{}`.", "w".repeat(1000)),
        );
        assert_eq!(
            e.message(),
            format!(
                "Unexpected role `{}… (1000 bytes)`.",
                "w".repeat(MAX_ECHO_CHARS)
            )
        );
        let e = ApiError::Internal("ü".repeat(3000));
        let msg = e.anthropic_body()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(msg.len() <= MAX_MESSAGE_BYTES);
        let e = ApiError::BadRequest {
            message: "m".into(),
            param: Some("p".repeat(1000)),
        };
        assert_eq!(
            e.openai_body()["error"]["param"].as_str().unwrap().len(),
            MAX_PARAM_BYTES
        );
    }

    #[test]
    fn quoted_runs_are_clipped_and_the_explanation_kept() {
        let long = "z".repeat(500);
        let msg = format!("invalid type: string \"{long}\", expected u32 at line 1 column 510");
        assert_eq!(
            clip_quoted(&msg),
            format!(
                "invalid type: string \"{}… (500 bytes)\", expected u32 at line 1 column 510",
                "z".repeat(MAX_ECHO_CHARS)
            )
        );
        // Escaped quotes stay inside their run; backticks delimit too; unclosed runs end it.
        assert_eq!(
            clip_quoted(r#"string "a\"b", field `c`"#),
            r#"string "a\"b", field `c`"#
        );
        let name = "k".repeat(100);
        assert_eq!(
            clip_quoted(&format!("unknown field `{name}`")),
            format!(
                "unknown field `{}… (100 bytes)`",
                "k".repeat(MAX_ECHO_CHARS)
            )
        );
        // Up to the marker's slack a run is kept whole (so a clipped run is not clipped again).
        let near = "n".repeat(MAX_ECHO_CHARS + CLIP_MARK_SLACK);
        assert_eq!(clip_quoted(&format!("`{near}`")), format!("`{near}`"));
        let once = clip(&"q".repeat(10_000));
        assert_eq!(clip_quoted(&format!("`{once}`")), format!("`{once}`"));
        assert_eq!(clip_quoted("open \"abc"), "open \"abc");
    }

    #[test]
    fn shapes_by_path() {
        assert_eq!(Shape::of_path("/v1/messages"), Shape::Anthropic);
        assert_eq!(
            Shape::of_path("/v1/messages/count_tokens"),
            Shape::Anthropic
        );
        assert_eq!(Shape::of_path("/v1/messagesx"), Shape::OpenAi);
        assert_eq!(Shape::of_path("/v1/chat/completions"), Shape::OpenAi);
        assert_eq!(Shape::of_path("/"), Shape::OpenAi);
    }

    #[test]
    fn statuses_and_types_of_the_transport_errors() {
        let cases = [
            (ApiError::NotFound, 404, "not_found_error", "not_found"),
            (
                ApiError::MethodNotAllowed,
                405,
                "invalid_request_error",
                "method_not_allowed",
            ),
            (
                ApiError::UnsupportedMediaType,
                415,
                "invalid_request_error",
                "unsupported_media_type",
            ),
            (
                ApiError::RequestTimeout { secs: 2.0 },
                408,
                "invalid_request_error",
                "request_timeout",
            ),
            (
                ApiError::ForbiddenOrigin,
                403,
                "permission_error",
                "forbidden_origin",
            ),
            (
                ApiError::OperatorOnly,
                403,
                "permission_error",
                "operator_key_required",
            ),
        ];
        for (e, status, anthropic, code) in cases {
            assert_eq!(e.status().as_u16(), status, "{e:?}");
            assert_eq!(e.anthropic_body()["error"]["type"], anthropic, "{e:?}");
            assert_eq!(e.anthropic_body()["type"], "error");
            assert_eq!(e.openai_body()["error"]["code"], code, "{e:?}");
        }
    }
}
