//! Hostile clients against the server (issue 17): slow headers and bodies on the real
//! listener, a declared body never sent, content types, CORS, error shapes by route, bounded
//! echoes, session ids, ranges and roles, stop-string limits, label cardinality.
//!
//! Every status is checked together with the error shape of the route's API: Anthropic's
//! (`{"type": "error", "error": {"type", "message"}}`) on `/v1/messages*`, OpenAI's
//! (`{"error": {"message", "type", "param", "code"}}`) everywhere else.

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use cachet_server::{router, serve_on, AppState, ServerArgs};
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn assert_openai_shape(v: &Value, code: Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    assert!(
        v.get("type").is_none(),
        "OpenAI errors have no top-level type: {v}"
    );
    if let Some(c) = code {
        assert_eq!(e["code"], c, "{v}");
    }
}

fn assert_anthropic_shape(v: &Value, ty: &str) {
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], ty, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"].get("code").is_none(), "{v}");
}

/// A server on a loopback port with `args` (small timeouts for the tests).
struct Live {
    addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), cachet_server::ServeError>>,
    /// The engine behind the server (kept alive with it).
    _h: Harness,
}

async fn live(opts: Opts, args: ServerArgs) -> Live {
    let h = start(opts);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve_on(
        listener,
        args,
        h.engine.clone(),
        h.tokenizer.clone(),
        h.metrics.clone(),
        async move {
            let _ = rx.await;
        },
    ));
    Live {
        addr,
        stop: Some(tx),
        task,
        _h: h,
    }
}

impl Live {
    async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the server stops")
            .unwrap()
            .unwrap();
    }

    /// One request on a fresh connection: (status, body as JSON or string).
    async fn roundtrip(&self, raw: &[u8]) -> (u16, Value) {
        let mut c = TcpStream::connect(self.addr).await.unwrap();
        c.write_all(raw).await.unwrap();
        read_response(&mut c).await
    }
}

/// Reads one HTTP/1.1 response (`Content-Length`, chunked, or up to EOF): (status, body as
/// JSON, or as a string when it is not JSON).
async fn read_response<R: tokio::io::AsyncRead + Unpin>(c: &mut R) -> (u16, Value) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut chunk))
            .await
            .expect("a response in time")
            .unwrap_or(0);
        assert!(n > 0, "connection closed before a response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status: u16 = head[9..12].parse().unwrap();
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse::<usize>().unwrap());
    let chunked = head.contains("transfer-encoding: chunked");
    let complete = |buf: &[u8]| -> bool {
        let body = &buf[head_end..];
        match (len, chunked) {
            (Some(n), _) => body.len() >= n,
            (None, true) => {
                find(body, b"0\r\n\r\n").is_some_and(|i| i == 0 || body[i - 2..i] == *b"\r\n")
            }
            (None, false) => false,
        }
    };
    while !complete(&buf) {
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut chunk))
            .await
            .expect("a response in time")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let mut body = buf[head_end..].to_vec();
    if chunked {
        body = dechunk(&body);
    }
    let v = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    (status, v)
}

/// The data of a chunked body.
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = find(b, b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16).unwrap_or(0);
        if size == 0 || b.len() < i + 2 + size {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + size]);
        b = &b[(i + 4 + size).min(b.len())..];
    }
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Whether the server closed `c` (EOF or reset) within `within`.
async fn closed_within(c: &mut TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 256];
    loop {
        match tokio::time::timeout(within, c.read(&mut b)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

fn raw_post(path: &str, content_type: Option<&str>, body: &str) -> Vec<u8> {
    let ct = content_type
        .map(|c| format!("Content-Type: {c}\r\n"))
        .unwrap_or_default();
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{ct}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn quick_args() -> ServerArgs {
    ServerArgs {
        header_read_timeout: 0.5,
        body_read_timeout: 1.0,
        log_stats_interval: 0.0,
        ..ServerArgs::default()
    }
}

/// 24 clients sending their headers a byte every 100 ms are all disconnected once the header
/// timeout (0.5 s) has passed, an idle keep-alive connection too, and the server answers
/// other clients meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_connections_are_closed() {
    let srv = live(Opts::default(), quick_args()).await;
    let mut slow = Vec::new();
    for _ in 0..24 {
        slow.push(TcpStream::connect(srv.addr).await.unwrap());
    }
    let header = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let started = Instant::now();
    let trickle = async {
        for &b in header.iter().take(12) {
            for c in slow.iter_mut() {
                let _ = c.write_all(&[b]).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // Meanwhile an ordinary client is served.
    let ordinary = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        srv.roundtrip(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
    };
    let ((), (status, models)) = tokio::join!(trickle, ordinary);
    assert_eq!(status, 200, "{models}");
    for c in slow.iter_mut() {
        assert!(
            closed_within(c, Duration::from_secs(3)).await,
            "a slow-header connection is still open after {:?}",
            started.elapsed()
        );
    }
    // The timer started with the first byte: no connection outlived twice the timeout much.
    assert!(started.elapsed() < Duration::from_secs(4));
    // A keep-alive connection that goes idle after one request is closed too.
    let mut ka = TcpStream::connect(srv.addr).await.unwrap();
    ka.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (status, _) = read_response(&mut ka).await;
    assert_eq!(status, 200);
    assert!(closed_within(&mut ka, Duration::from_secs(3)).await);
    srv.shutdown().await;
}

/// `Content-Length: 1 GiB` with no body: 413 at once, from the header, in each API's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_body_never_sent_is_413_at_once() {
    let srv = live(Opts::default(), quick_args()).await;
    for (path, anthropic) in [
        ("/v1/completions", false),
        ("/v1/chat/completions", false),
        ("/v1/messages", true),
        ("/tokenize", false),
    ] {
        let started = Instant::now();
        let raw = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n"
        );
        let (status, v) = srv.roundtrip(raw.as_bytes()).await;
        assert_eq!(status, 413, "{path} {v}");
        assert!(started.elapsed() < Duration::from_millis(800), "{path}");
        if anthropic {
            assert_anthropic_shape(&v, "request_too_large");
        } else {
            assert_openai_shape(&v, Some("request_too_large"));
        }
    }
    srv.shutdown().await;
}

/// A body trickled a byte every 100 ms, or stopped half way, is cut at the body deadline (1 s)
/// with a 408 in the route's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_stalled_bodies_are_408() {
    let srv = live(Opts::default(), quick_args()).await;
    let body = json!({"prompt": "x".repeat(200), "max_tokens": 1}).to_string();
    for (path, anthropic, trickle) in [
        ("/v1/completions", false, true),
        ("/v1/messages", true, false),
        ("/v1/chat/completions", false, false),
    ] {
        let mut c = TcpStream::connect(srv.addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        c.write_all(head.as_bytes()).await.unwrap();
        let started = Instant::now();
        let (mut rd, mut wr) = c.into_split();
        let writer = {
            let body = body.clone();
            tokio::spawn(async move {
                if trickle {
                    for b in body.bytes() {
                        if wr.write_all(&[b]).await.is_err() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                } else {
                    let _ = wr.write_all(&body.as_bytes()[..body.len() / 2]).await;
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                wr
            })
        };
        let (status, v) = read_response(&mut rd).await;
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(3),
            "{path}: {elapsed:?}"
        );
        assert_eq!(status, 408, "{path}: {v}");
        if anthropic {
            assert_anthropic_shape(&v, "invalid_request_error");
        } else {
            assert_openai_shape(&v, Some("request_timeout"));
        }
        writer.abort();
    }
    srv.shutdown().await;
}

/// `--max-connections 3`: a fourth connection is not served while three are open, and is served
/// as soon as one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_wait() {
    let args = ServerArgs {
        max_connections: 3,
        header_read_timeout: 30.0,
        ..quick_args()
    };
    let srv = live(Opts::default(), args).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = TcpStream::connect(srv.addr).await.unwrap();
        c.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (s, _) = read_response(&mut c).await;
        assert_eq!(s, 200);
        held.push(c);
    }
    let mut fourth = TcpStream::connect(srv.addr).await.unwrap();
    fourth
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut b = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), fourth.read(&mut b))
            .await
            .is_err(),
        "the fourth connection was served while three were open"
    );
    drop(held.pop());
    let (s, _) = read_response(&mut fourth).await;
    assert_eq!(s, 200);
    drop(held);
    srv.shutdown().await;
}

/// Bodies must be declared `application/json`: a valid body as `text/plain`, form-urlencoded
/// or without a content type is a 415 in the route's shape; a charset parameter is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_type_must_be_json() {
    let srv = live(Opts::default(), quick_args()).await;
    let chat =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let prompt = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    let cases = [
        ("/v1/chat/completions", &chat, false),
        ("/v1/completions", &prompt, false),
        ("/v1/messages", &chat, true),
        ("/tokenize", &prompt, false),
    ];
    for (path, body, anthropic) in cases {
        for ct in [
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            None,
        ] {
            let (s, v) = srv.roundtrip(&raw_post(path, ct, body)).await;
            assert_eq!(s, 415, "{path} {ct:?}: {v}");
            if anthropic {
                assert_anthropic_shape(&v, "invalid_request_error");
            } else {
                assert_openai_shape(&v, Some("unsupported_media_type"));
            }
        }
        let (s, v) = srv
            .roundtrip(&raw_post(
                path,
                Some("application/json; charset=utf-8"),
                body,
            ))
            .await;
        assert_eq!(s, 200, "{path}: {v}");
    }
    // A POST without a body needs no content type (vLLM's `POST /reset_prefix_cache`).
    let (s, v) = srv
        .roundtrip(b"POST /reset_prefix_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(s, 200, "{v}");
    srv.shutdown().await;
}

fn cors_router(h: &Harness, origins: &[&str]) -> axum::Router {
    let args = ServerArgs {
        allowed_origins: origins.iter().map(|s| s.to_string()).collect(),
        ..ServerArgs::default()
    };
    router(AppState::new(
        h.engine.clone(),
        h.tokenizer.clone(),
        h.metrics.clone(),
        &args,
    ))
}

async fn send(
    app: &axum::Router,
    req: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, Value) {
    use tower::ServiceExt;
    let resp = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn preflight(path: &str, origin: &str) -> Request<Body> {
    Request::options(path)
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization, content-type",
        )
        .body(Body::empty())
        .unwrap()
}

fn post_from(path: &str, origin: &str, body: &Value) -> Request<Body> {
    Request::post(path)
        .header("origin", origin)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// Without `--allowed-origins`: no CORS header anywhere, preflights and cross-origin POSTs or
/// DELETEs refused with 403 (the route's shape), GETs served without CORS headers. With it:
/// the listed origin gets preflights and readable responses, others are still refused.
#[tokio::test]
async fn cors_is_off_unless_origins_are_allowed() {
    let h = start(Opts::default());
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let evil = "http://evil.test";
    let closed = cors_router(&h, &[]);
    for (path, anthropic) in [("/v1/chat/completions", false), ("/v1/messages", true)] {
        let (s, hd, v) = send(&closed, preflight(path, evil)).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{path}");
        assert!(hd.get("access-control-allow-origin").is_none());
        if anthropic {
            assert_anthropic_shape(&v, "permission_error");
        } else {
            assert_openai_shape(&v, Some("forbidden_origin"));
        }
        let (s, hd, _) = send(&closed, post_from(path, evil, &chat)).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{path}");
        assert!(hd.get("access-control-allow-origin").is_none());
    }
    let del = Request::delete("/v1/sessions/abc")
        .header("origin", evil)
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&closed, del).await.0, StatusCode::FORBIDDEN);
    let get = Request::get("/v1/models")
        .header("origin", evil)
        .body(Body::empty())
        .unwrap();
    let (s, hd, _) = send(&closed, get).await;
    assert_eq!(s, StatusCode::OK);
    assert!(hd.get("access-control-allow-origin").is_none());
    // OPTIONS that is not a preflight is just a method the routes do not answer.
    let opt = Request::options("/v1/messages")
        .body(Body::empty())
        .unwrap();
    let (s, _, v) = send(&closed, opt).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert_anthropic_shape(&v, "invalid_request_error");

    let ok = "http://app.test";
    let open = cors_router(&h, &[ok]);
    let (s, hd, _) = send(&open, preflight("/v1/chat/completions", ok)).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert_eq!(hd["access-control-allow-origin"], ok);
    assert_eq!(
        hd["access-control-allow-headers"],
        "authorization, content-type"
    );
    assert!(hd["access-control-allow-methods"]
        .to_str()
        .unwrap()
        .contains("POST"));
    let (s, hd, v) = send(&open, post_from("/v1/chat/completions", ok, &chat)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(hd["access-control-allow-origin"], ok);
    assert_eq!(hd["vary"], "origin");
    // An error is readable by the allowed page too.
    let (s, hd, _) = send(&open, post_from("/v1/messages", ok, &json!({}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(hd["access-control-allow-origin"], ok);
    let (s, _, _) = send(&open, preflight("/v1/chat/completions", evil)).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _, _) = send(&open, post_from("/v1/chat/completions", evil, &chat)).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
}

/// Every status a `/v1/messages*` path can answer is in Anthropic's shape; the same statuses
/// elsewhere are in OpenAI's.
#[tokio::test]
async fn error_shapes_follow_the_route() {
    let h = start(Opts {
        api_key: Some("sk-test".into()),
        max_body_bytes: 4096,
        ..Opts::default()
    });
    let key = [("authorization", "Bearer sk-test")];
    let msgs = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    // (method, path, headers, body, expected status, anthropic type, openai code)
    let big = "x".repeat(5000);
    type Case<'a> = (
        &'a str,
        &'a str,
        Vec<(&'a str, &'a str)>,
        String,
        u16,
        &'a str,
        Option<&'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            "GET",
            "/v1/messages",
            key.to_vec(),
            String::new(),
            405,
            "invalid_request_error",
            Some("method_not_allowed"),
        ),
        (
            "GET",
            "/v1/chat/completions",
            key.to_vec(),
            String::new(),
            405,
            "",
            Some("method_not_allowed"),
        ),
        (
            "POST",
            "/v1/messages/no_such_route",
            key.to_vec(),
            msgs.to_string(),
            404,
            "not_found_error",
            None,
        ),
        (
            "POST",
            "/v1/messages/batches/x/y",
            key.to_vec(),
            msgs.to_string(),
            404,
            "not_found_error",
            None,
        ),
        (
            "POST",
            "/v1/nope",
            key.to_vec(),
            msgs.to_string(),
            404,
            "",
            Some("not_found"),
        ),
        (
            "POST",
            "/v1/messages",
            vec![],
            msgs.to_string(),
            401,
            "authentication_error",
            None,
        ),
        (
            "POST",
            "/v1/chat/completions",
            vec![],
            msgs.to_string(),
            401,
            "",
            Some("invalid_api_key"),
        ),
        (
            "POST",
            "/v1/messages",
            key.to_vec(),
            format!("{{\"x\": \"{big}\"}}"),
            413,
            "request_too_large",
            None,
        ),
        (
            "POST",
            "/v1/completions",
            key.to_vec(),
            format!("{{\"x\": \"{big}\"}}"),
            413,
            "",
            Some("request_too_large"),
        ),
        (
            "POST",
            "/v1/messages",
            key.to_vec(),
            "{".into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            "POST",
            "/v1/chat/completions",
            key.to_vec(),
            "{".into(),
            400,
            "",
            None,
        ),
    ];
    for (method, path, headers, body, status, anthropic, code) in cases {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json");
        for (k, v) in &headers {
            b = b.header(*k, *v);
        }
        let (s, _, v) = send(&h.app, b.body(Body::from(body)).unwrap()).await;
        assert_eq!(s.as_u16(), status, "{method} {path}: {v}");
        if path.starts_with("/v1/messages") {
            assert_anthropic_shape(&v, anthropic);
        } else {
            assert_openai_shape(&v, code);
        }
    }
    // 415 without content type.
    let req = Request::post("/v1/messages")
        .header("authorization", "Bearer sk-test")
        .header("content-type", "text/plain")
        .header("content-length", "2")
        .body(Body::from("{}"))
        .unwrap();
    let (s, _, v) = send(&h.app, req).await;
    assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_anthropic_shape(&v, "invalid_request_error");
    // 503 on both families once the engine is shutting down.
    h.engine.shutdown(Duration::from_secs(1)).await;
    let (s, v, resp) = h.post_with("/v1/messages", msgs.clone(), &key).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(resp.headers()["retry-after"], "1");
    assert_anthropic_shape(&v, "overloaded_error");
    let (s, v, _) = h
        .post_with(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1}),
            &key,
        )
        .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_openai_shape(&v, Some("shutting_down"));
}

/// What an error repeats from the request is bounded: a 100 KB model name, a 100 KB wrong-typed
/// value, a 100 KB role, a 300-byte `X-Request-Id`.
#[tokio::test]
async fn echoes_are_bounded() {
    let h = start(Opts::default());
    let huge = "m".repeat(100_000);
    let bodies = [
        (
            "/v1/chat/completions",
            json!({"model": huge, "messages": [{"role": "user", "content": "x"}]}),
            404,
        ),
        (
            "/v1/messages",
            json!({"model": huge, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
            404,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": huge}),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": huge, "content": "x"}]}),
            400,
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 1, "messages": [{"role": huge, "content": "x"}]}),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": huge}]}]}),
            400,
        ),
        ("/tokenize", json!({"model": huge, "prompt": "x"}), 404),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": [huge]}),
            400,
        ),
    ];
    for (path, body, status) in bodies {
        let (s, v, _) = h.post(path, body).await;
        assert_eq!(
            s.as_u16(),
            status,
            "{path}: {}",
            &v.to_string()[..200.min(v.to_string().len())]
        );
        let text = v.to_string();
        assert!(text.len() < 1500, "{path}: a {}-byte error", text.len());
        assert!(!text.contains(&"m".repeat(200)), "{path}");
    }
    let long_id = "r".repeat(300);
    let (s, _, resp) = h
        .post_with("/v1/nope", json!({}), &[("x-request-id", &long_id)])
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(resp.headers().get("x-request-id").is_none());
    let (_, _, resp) = h
        .post_with("/v1/nope", json!({}), &[("x-request-id", "short-id")])
        .await;
    assert_eq!(resp.headers()["x-request-id"], "short-id");
}

/// Session ids outside `[A-Za-z0-9._:-]{1,128}` are a 400 in the body field of all three routes
/// and in `DELETE /v1/sessions/{id}`.
#[tokio::test]
async fn session_ids_are_restricted() {
    let h = start(Opts::default());
    let bad = [
        "../../etc/passwd",
        "a/../../b",
        "a\u{0}b",
        "a\r\nb",
        "",
        "sp ace",
        "é",
    ];
    let long = "s".repeat(129);
    for id in bad.iter().copied().chain([long.as_str()]) {
        for (path, mut body) in [
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
            ),
            ("/v1/completions", json!({"prompt": "x", "max_tokens": 1})),
            (
                "/v1/messages",
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
            ),
        ] {
            body["session_id"] = json!(id);
            let (s, v, _) = h.post(path, body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{path} {id:?}: {v}");
            if path == "/v1/messages" {
                assert_anthropic_shape(&v, "invalid_request_error");
            } else {
                assert_eq!(v["error"]["param"], "session_id", "{v}");
            }
        }
    }
    for raw in [
        "..%2F..%2Fetc%2Fpasswd",
        "a%00b",
        "a%0D%0Ab",
        "%FF",
        "sp%20ace",
    ] {
        let req = Request::delete(format!("/v1/sessions/{raw}"))
            .body(Body::empty())
            .unwrap();
        let (s, _, v) = send(&h.app, req).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{raw}: {v}");
        assert_openai_shape(&v, None);
        assert_eq!(v["error"]["param"], "session_id");
    }
    let ok = "tenant-1:conv.42_a";
    let req = Request::delete(format!("/v1/sessions/{ok}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&h.app, req).await.0, StatusCode::NO_CONTENT);
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "session_id": ok}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

/// Temperature ranges are each API's, unknown roles and a string `metadata` are 400s, and stop
/// strings are bounded (64 strings, 512 bytes each, 8 KiB in all).
#[tokio::test]
async fn ranges_roles_metadata_and_stop_limits() {
    let h = start(Opts::default());
    let user = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 1, "temperature": 2.5}),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 1, "temperature": 2.0}),
            200,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "temperature": 2.01}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 1, "temperature": 1.5}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 1, "temperature": 1.0}),
            200,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 1}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 1}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": [{"role": "system", "content": "x"}], "max_tokens": 1}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 1, "metadata": "user-1"}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 1, "metadata": ["u"]}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 1, "metadata": {"user_id": "u"}}),
            200,
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 1, "metadata": null}),
            200,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "stop": vec!["s"; 10_000]}),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "stop": vec!["s"; 65]}),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "stop": (0..64).map(|i| format!("stop{i}")).collect::<Vec<_>>()}),
            200,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "stop": ["y".repeat(513)]}),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "stop": vec!["z".repeat(200); 41]}),
            400,
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 1, "stop_sequences": vec!["s"; 10_000]}),
            400,
        ),
    ];
    for (path, body, status) in cases {
        let (s, v, _) = h.post(path, body.clone()).await;
        assert_eq!(s.as_u16(), status, "{path} {body}: {v}");
        if status == 400 {
            if path == "/v1/messages" {
                assert_anthropic_shape(&v, "invalid_request_error");
            } else {
                assert_openai_shape(&v, None);
            }
        }
    }
}

/// An HTTP method is a label of `http_requests_total`: made-up methods must not each create a
/// series (a client could grow the registry without bound).
#[tokio::test]
async fn made_up_methods_do_not_grow_the_metrics() {
    let h = start(Opts::default());
    for i in 0..50 {
        let req = Request::builder()
            .method(format!("HACK{i}").as_str())
            .uri("/v1/models")
            .body(Body::empty())
            .unwrap();
        let (s, _, v) = send(&h.app, req).await;
        assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED, "{v}");
    }
    let m = h.scrape().await;
    let series: Vec<_> = m
        .samples
        .iter()
        .filter(|(n, _, _)| n == "http_requests_total")
        .map(|(_, l, _)| l.get("method").cloned().unwrap_or_default())
        .collect();
    assert!(series.iter().all(|m| !m.starts_with("HACK")), "{series:?}");
    assert_eq!(
        m.get(
            "http_requests_total",
            &[("method", "other"), ("handler", "/v1/models")]
        ),
        50.0
    );
}

/// `--max-large-requests 1`: while one request with a body over 32 KiB is in flight, a second
/// one waits without reaching the engine; a small request does not wait; the second runs once
/// the first is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_wait_for_a_slot() {
    let h = start(Opts {
        step_ms: 5,
        ..Opts::default()
    });
    let args = ServerArgs {
        max_large_requests: 1,
        ..ServerArgs::default()
    };
    let app = router(AppState::new(
        h.engine.clone(),
        h.tokenizer.clone(),
        h.metrics.clone(),
        &args,
    ));
    // A short prompt, padded with 40 KB of JSON whitespace: a large body.
    let large = |tag: &str| {
        let body = format!(
            "{}{}",
            json!({"prompt": tag, "max_tokens": 40, "ignore_eos": true}),
            " ".repeat(40_000)
        );
        Request::post("/v1/completions")
            .header("content-type", "application/json")
            .header("content-length", body.len())
            .body(Body::from(body))
            .unwrap()
    };
    let live = |h: &Harness| {
        let g = h.engine.gauges();
        g.num_requests_running + g.num_requests_waiting
    };
    let first = tokio::spawn({
        let app = app.clone();
        let req = large("first");
        async move { send(&app, req).await.0 }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while live(&h) < 1 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let second = tokio::spawn({
        let app = app.clone();
        let req = large("second");
        async move { send(&app, req).await.0 }
    });
    // A small request is served meanwhile.
    let small = Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"prompt": "s", "max_tokens": 1}).to_string(),
        ))
        .unwrap();
    assert_eq!(send(&app, small).await.0, StatusCode::OK);
    // The gauges are a snapshot taken at the end of a step: wait a few steps (5 ms each) so the
    // small request has left them; a second large request let in would stay for its 40 steps.
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The second large one never reached the engine while the first was running.
    let mut peak = 0;
    while !first.is_finished() {
        peak = peak.max(live(&h));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    assert!(peak <= 1, "{peak} large requests in the engine at once");
    assert_eq!(second.await.unwrap(), StatusCode::OK);
}
