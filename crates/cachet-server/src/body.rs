//! Reading and decoding JSON bodies with our own limit and rejection handling (axum's `Json`
//! rejections would answer in the wrong shape).

use std::error::Error as StdError;

use axum::body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;

use crate::error::{clip, clip_quoted, ApiError};
use crate::limits::BodyTimedOut;

/// The first error of type `E` in `err`'s source chain.
fn find<'a, E: StdError + 'static>(err: &'a (dyn StdError + 'static)) -> Option<&'a E> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(found) = e.downcast_ref::<E>() {
            return Some(found);
        }
        cur = e.source();
    }
    None
}

/// Reads at most `limit` bytes and decodes them as `T`. A body cut off by its deadline
/// (`--body-read-timeout`, see [`crate::limits`]) is a 408.
pub async fn read_json<T: DeserializeOwned>(body: Body, limit: usize) -> Result<T, ApiError> {
    let bytes = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => {
            let err: &(dyn StdError + 'static) = &*err;
            if find::<LengthLimitError>(err).is_some() {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            if let Some(t) = find::<BodyTimedOut>(err) {
                return Err(ApiError::RequestTimeout { secs: t.secs });
            }
            return Err(ApiError::bad_request(format!(
                "Failed to read the request body: {}",
                clip_quoted(&err.to_string())
            )));
        }
    };
    decode_json(&bytes)
}

/// Decodes a JSON body: syntax errors and type/shape errors both become 400s, the latter naming
/// the offending field when serde tells us which. What serde quotes from the body (a value, a
/// variant, a field name) is clipped ([`clip_quoted`]).
pub fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "Malformed JSON body: {}",
            clip_quoted(&e.to_string())
        ))
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    }
    serde_json::from_value(value).map_err(|e| {
        let message = e.to_string();
        let param = backticked(&message).map(|p| clip(&p));
        ApiError::BadRequest {
            message: format!("Invalid request: {}", clip_quoted(&message)),
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

    #[test]
    fn a_huge_wrong_value_is_not_echoed_whole() {
        let body = format!(r#"{{"a": "{}"}}"#, "v".repeat(100_000));
        let e = decode_json::<T>(body.as_bytes()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(
            msg,
            format!(
                "Invalid request: invalid type: string \"{}… (100000 bytes)\", expected u32",
                "v".repeat(crate::error::MAX_ECHO_CHARS)
            )
        );
    }

    #[tokio::test]
    async fn limits_and_timeouts_of_the_read() {
        let e = read_json::<T>(Body::from(vec![b' '; 100]), 10)
            .await
            .unwrap_err();
        assert!(
            matches!(e, ApiError::PayloadTooLarge { limit: 10 }),
            "{e:?}"
        );
        let stream =
            futures_util::stream::iter([Err::<axum::body::Bytes, _>(BodyTimedOut { secs: 1.5 })]);
        let e = read_json::<T>(Body::from_stream(stream), 10)
            .await
            .unwrap_err();
        assert!(
            matches!(e, ApiError::RequestTimeout { secs } if secs == 1.5),
            "{e:?}"
        );
    }
}
