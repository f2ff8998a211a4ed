//! Reading and decoding JSON bodies with our own limit and rejection handling (axum's `Json`
//! rejections would answer in the wrong shape).

use axum::body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Reads at most `limit` bytes and decodes them as `T`.
pub async fn read_json<T: DeserializeOwned>(body: Body, limit: usize) -> Result<T, ApiError> {
    let bytes = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => {
            if err.downcast_ref::<LengthLimitError>().is_some() {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            return Err(ApiError::bad_request(format!(
                "Failed to read the request body: {err}"
            )));
        }
    };
    decode_json(&bytes)
}

/// Decodes a JSON body: syntax errors and type/shape errors both become 400s, the latter naming
/// the offending field when serde tells us which.
pub fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("Malformed JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    }
    serde_json::from_value(value).map_err(|e| {
        let message = e.to_string();
        let param = backticked(&message);
        ApiError::BadRequest {
            message: format!("Invalid request: {message}"),
            param,
        }
    })
}

/// serde names a missing or unknown field between backticks: "missing field `messages`".
fn backticked(message: &str) -> Option<String> {
    if !message.contains("field") {
        return None;
    }
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(message[start..start + len].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct T {
        a: u32,
    }

    #[test]
    fn malformed_and_typed_errors() {
        let e = decode_json::<T>(b"{").unwrap_err();
        assert!(e.to_string().starts_with("Malformed JSON"), "{e}");
        let e = decode_json::<T>(b"{}").unwrap_err();
        match e {
            ApiError::BadRequest { param, .. } => assert_eq!(param.as_deref(), Some("a")),
            other => panic!("{other:?}"),
        }
        let e = decode_json::<T>(br#"{"a": "x"}"#).unwrap_err();
        assert!(matches!(e, ApiError::BadRequest { .. }));
        let e = decode_json::<T>(b"[1]").unwrap_err();
        assert!(matches!(e, ApiError::BadRequest { .. }));
        assert_eq!(decode_json::<T>(br#"{"a": 3}"#).unwrap().a, 3);
    }
}
