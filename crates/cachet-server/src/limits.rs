//! What every request passes before a route sees it: origin (CORS, [`crate::cors`]), declared
//! size, content type, and a deadline on its body. Each refusal answers in the shape of the API
//! the path belongs to ([`Shape::of_path`]).
//!
//! - `Content-Length` above `--max-body-bytes`: 413 at once, from the header, before a byte of
//!   the body is read (a client declaring 1 GiB and sending nothing is answered immediately).
//!   A chunked body is cut at the limit while it is read ([`crate::body::read_json`]).
//! - A body on any method but GET/HEAD/OPTIONS must be declared `application/json` (415
//!   otherwise): a browser sends `text/plain` and form bodies cross-site without a preflight.
//! - The body must arrive within `--body-read-timeout` seconds of the headers: the body is
//!   wrapped so that reading it fails with [`BodyTimedOut`] after the deadline (408), however
//!   slowly or steadily the client trickles it.
//! - A request whose body is over [`LARGE_BODY_BYTES`] (or chunked) first takes one of
//!   `--max-large-requests` slots, waiting for one without reading its body, and holds it until
//!   its response starts: that bounds the large bodies held in memory and the threads their
//!   tokenization takes ([`crate::blocking`]). Its body deadline starts once it has a slot.
//!
//! The time to send the headers is bounded by the listener (`--header-read-timeout`, in
//! [`crate::serve_on`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use thiserror::Error;
use tokio::sync::Semaphore;

use crate::cors::{is_preflight, Cors};
use crate::error::{ApiError, Shape};
use crate::{AppState, ServerArgs};

/// The request policy built from the server's flags.
#[derive(Clone, Debug)]
pub struct HttpPolicy {
    pub max_body_bytes: usize,
    /// `None`: bodies may take as long as they like.
    pub body_read_timeout: Option<Duration>,
    pub cors: Cors,
    /// The `--max-large-requests` slots.
    pub large: Arc<Semaphore>,
}

/// A body over this many bytes makes a request large (the size above which tokenization
/// leaves the runtime's threads).
pub const LARGE_BODY_BYTES: u64 = crate::blocking::INLINE_TEXT_BYTES as u64;

impl HttpPolicy {
    pub fn from_args(args: &ServerArgs) -> Self {
        HttpPolicy {
            max_body_bytes: args.max_body_bytes,
            body_read_timeout: positive_secs(args.body_read_timeout),
            cors: Cors::new(&args.allowed_origins),
            large: Arc::new(Semaphore::new(
                args.max_large_requests.clamp(1, Semaphore::MAX_PERMITS),
            )),
        }
    }
}

/// `secs` as a duration; `None` for 0, negative or not finite (no limit).
pub fn positive_secs(secs: f64) -> Option<Duration> {
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
}

/// Reading a body failed because its deadline passed.
#[derive(Debug, Error)]
#[error("the request body was not received within {secs} s")]
pub struct BodyTimedOut {
    pub secs: f64,
}

/// A request body that fails with [`BodyTimedOut`] once its deadline has passed.
struct DeadlineBody {
    inner: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
    secs: f64,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        // The deadline first: a client that keeps a trickle flowing still runs out of time.
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyTimedOut { secs: this.secs }))));
        }
        Pin::new(&mut this.inner)
            .poll_frame(cx)
            .map(|f| f.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether the request carries a body (a non-zero `Content-Length`, or any
/// `Transfer-Encoding`).
fn has_body(headers: &HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || declared_length(headers).is_some_and(|n| n > 0)
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `application/json`, with or without parameters (`; charset=utf-8`), in any case.
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// The middleware (see the module documentation).
pub async fn guard(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let policy = state.http_policy();
    let shape = Shape::of_path(req.uri().path());
    let refuse = |e: ApiError| match shape {
        Shape::OpenAi => e.openai_response(),
        Shape::Anthropic => e.anthropic_response(),
    };
    let origin = req.headers().get(header::ORIGIN).cloned();
    let allowed_origin = origin.as_ref().filter(|o| policy.cors.allows(o)).cloned();
    if origin.is_some() && allowed_origin.is_none() {
        let reads_only = matches!(*req.method(), Method::GET | Method::HEAD);
        if is_preflight(req.method(), req.headers()) || !reads_only {
            return refuse(ApiError::ForbiddenOrigin);
        }
    }
    if let Some(o) = &allowed_origin {
        if is_preflight(req.method(), req.headers()) {
            return policy.cors.preflight(o, req.headers());
        }
    }
    if let Some(n) = declared_length(req.headers()) {
        if n > policy.max_body_bytes as u64 {
            return refuse(ApiError::PayloadTooLarge {
                limit: policy.max_body_bytes,
            });
        }
    }
    let sends_body = !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS)
        && has_body(req.headers());
    if sends_body && !is_json(req.headers()) {
        return refuse(ApiError::UnsupportedMediaType);
    }
    let large = sends_body && declared_length(req.headers()).is_none_or(|n| n > LARGE_BODY_BYTES);
    let _slot = if large {
        // Closed never: the semaphore lives as long as the policy.
        Arc::clone(&policy.large).acquire_owned().await.ok()
    } else {
        None
    };
    let req = match (sends_body, policy.body_read_timeout) {
        (true, Some(t)) => req.map(|inner| {
            Body::new(DeadlineBody {
                inner,
                deadline: Box::pin(tokio::time::sleep(t)),
                secs: t.as_secs_f64(),
            })
        }),
        _ => req,
    };
    let mut resp = next.run(req).await;
    if let Some(o) = &allowed_origin {
        policy.cors.decorate(o, &mut resp);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use http_body_util::BodyExt;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn json_content_types() {
        assert!(is_json(&headers(&[("content-type", "application/json")])));
        assert!(is_json(&headers(&[(
            "content-type",
            "Application/JSON; charset=utf-8"
        )])));
        assert!(!is_json(&headers(&[("content-type", "text/plain")])));
        assert!(!is_json(&headers(&[(
            "content-type",
            "application/x-www-form-urlencoded"
        )])));
        assert!(!is_json(&headers(&[("content-type", "application/jsonx")])));
        assert!(!is_json(&headers(&[])));
    }

    #[test]
    fn bodies_are_declared_by_length_or_encoding() {
        assert!(!has_body(&headers(&[])));
        assert!(!has_body(&headers(&[("content-length", "0")])));
        assert!(has_body(&headers(&[("content-length", "3")])));
        assert!(has_body(&headers(&[("transfer-encoding", "chunked")])));
        assert_eq!(
            declared_length(&headers(&[("content-length", "1073741824")])),
            Some(1 << 30)
        );
    }

    #[test]
    fn timeouts_of_zero_mean_none() {
        assert_eq!(positive_secs(0.0), None);
        assert_eq!(positive_secs(-1.0), None);
        assert_eq!(positive_secs(f64::NAN), None);
        assert_eq!(positive_secs(1.5), Some(Duration::from_millis(1500)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_ends_fails_at_its_deadline() {
        let (mut tx, rx) = futures_channel_body();
        let body = DeadlineBody {
            inner: rx,
            deadline: Box::pin(tokio::time::sleep(Duration::from_secs(2))),
            secs: 2.0,
        };
        tx.send(Bytes::from_static(b"{\"a\"")).await;
        let started = tokio::time::Instant::now();
        let err = body.collect().await.unwrap_err();
        assert!(err.downcast_ref::<BodyTimedOut>().is_some(), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_in_time_is_read_whole() {
        let body = DeadlineBody {
            inner: Body::from("{\"a\": 1}"),
            deadline: Box::pin(tokio::time::sleep(Duration::from_secs(2))),
            secs: 2.0,
        };
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"{\"a\": 1}");
    }

    /// A body fed by hand: chunks are sent one at a time; it never ends while the sender lives.
    struct Sender(tokio::sync::mpsc::Sender<Bytes>);

    impl Sender {
        async fn send(&mut self, b: Bytes) {
            self.0.send(b).await.unwrap();
        }
    }

    fn futures_channel_body() -> (Sender, Body) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
        });
        (Sender(tx), Body::from_stream(stream))
    }
}
