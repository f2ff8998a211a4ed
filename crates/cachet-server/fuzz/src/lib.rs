//! What every fuzz target checks about an error: a client error (never a 5xx), in the shape of
//! the route's API, and bounded whatever the input (nothing echoed from the request is longer
//! than the limits of `cachet_server::error`).

use cachet_server::error::{ApiError, MAX_MESSAGE_BYTES};
use serde_json::Value;

/// An error a request body can cause: a 4xx whose rendered bodies are bounded.
pub fn check_error(e: &ApiError) {
    let status = e.status().as_u16();
    assert!((400..500).contains(&status), "{status} for {e:?}");
    for body in [e.openai_body(), e.anthropic_body()] {
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.len() <= MAX_MESSAGE_BYTES,
            "a {}-byte message",
            msg.len()
        );
        assert!(body.to_string().len() <= MAX_MESSAGE_BYTES + 512, "{body}");
    }
}

/// An error response body of `path`: Anthropic's shape on `/v1/messages*`, OpenAI's elsewhere,
/// and bounded.
pub fn check_error_body(path: &str, status: u16, bytes: &[u8]) {
    assert!(
        bytes.len() <= MAX_MESSAGE_BYTES + 512,
        "{path} {status}: a {}-byte error",
        bytes.len()
    );
    let v: Value = serde_json::from_slice(bytes).unwrap_or_else(|e| {
        panic!(
            "{path} {status}: not JSON ({e}): {:?}",
            String::from_utf8_lossy(bytes)
        )
    });
    if path.starts_with("/v1/messages") {
        assert_eq!(v["type"], "error", "{path} {status}: {v}");
        assert!(
            v["error"]["type"].is_string() && v["error"]["message"].is_string(),
            "{v}"
        );
    } else {
        assert!(v.get("type").is_none(), "{path} {status}: {v}");
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    }
}
