//! API-key check for the `/v1` routes.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::AppState;

fn provided_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        if let (Some(scheme), Some(token)) = (v.get(..7), v.get(7..)) {
            if scheme.eq_ignore_ascii_case("bearer ") {
                return Some(token.trim());
            }
        }
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// Constant-time comparison (the length is not secret).
pub fn key_matches(provided: Option<&str>, expected: &str) -> bool {
    match provided {
        Some(p) => bool::from(p.as_bytes().ct_eq(expected.as_bytes())),
        None => false,
    }
}

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(expected) = state.api_key() {
        if !key_matches(provided_key(req.headers()), expected) {
            let err = ApiError::Unauthorized;
            return if req.uri().path().starts_with("/v1/messages") {
                err.anthropic_response()
            } else {
                err.openai_response()
            };
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_and_x_api_key() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer sk-1".parse().unwrap());
        assert_eq!(provided_key(&h), Some("sk-1"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "sk-2".parse().unwrap());
        assert_eq!(provided_key(&h), Some("sk-2"));
        assert!(key_matches(Some("abc"), "abc"));
        assert!(!key_matches(Some("abd"), "abc"));
        assert!(!key_matches(Some("ab"), "abc"));
        assert!(!key_matches(None, "abc"));
    }
}
