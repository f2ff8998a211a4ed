//! A router's prediction of this instance's cache hit for a request
//! (`x-prefix-cache-predicted-tokens`: how many leading prompt tokens a gateway such as Dynamo's
//! KV router or llm-d's scorer expected to be cached here when it picked this instance). The
//! engine reports it beside what happened (`predicted_tokens` and the shortfall by reason in the
//! per-request metrics, `cachet:router_*` on `/metrics`); it never changes what is served.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

use crate::error::ApiError;

/// The request header a router sets.
pub const PREDICTED_TOKENS_HEADER: &str = "x-prefix-cache-predicted-tokens";

tokio::task_local! {
    static PREDICTED: Option<u64>;
}

/// The prediction of the request this task handles, if it carried one.
pub fn current() -> Option<u64> {
    PREDICTED.try_with(|p| *p).ok().flatten()
}

/// The header's value: a non-negative integer; `Err` names what is wrong.
pub fn parse(value: &[u8]) -> Result<u64, String> {
    std::str::from_utf8(value)
        .ok()
        .map(str::trim)
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| {
            format!("header {PREDICTED_TOKENS_HEADER} must be a non-negative integer (tokens)")
        })
}

/// Reads the header into the request's task; a malformed one is a 400 naming it.
pub async fn scope(req: Request, next: Next) -> Response {
    let predicted = match req.headers().get(PREDICTED_TOKENS_HEADER) {
        None => None,
        Some(v) => match parse(v.as_bytes()) {
            Ok(n) => Some(n),
            Err(msg) => {
                let err = ApiError::bad_request(msg);
                return if req.uri().path().starts_with("/v1/messages") {
                    err.anthropic_response()
                } else {
                    err.openai_response()
                };
            }
        },
    };
    PREDICTED.scope(predicted, next.run(req)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_token_counts_only() {
        assert_eq!(parse(b"0"), Ok(0));
        assert_eq!(parse(b" 4096 "), Ok(4096));
        for bad in [&b""[..], b"-1", b"12.5", b"many", b"\xff"] {
            assert!(parse(bad).unwrap_err().contains(PREDICTED_TOKENS_HEADER));
        }
    }
}
