//! The real listener: graceful shutdown drains running requests; a TCP disconnect mid-stream
//! aborts the request in the engine.

mod common;

use std::time::Duration;

use cachet_server::{serve_on, ServerArgs};
use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn http_post(path: &str, body: &serde_json::Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn start_listener(
    h: &Harness,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), cachet_server::ServeError>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let args = ServerArgs {
        enable_per_request_metrics: true,
        log_stats_interval: 0.05,
        ..ServerArgs::default()
    };
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
    (addr, tx, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_running_requests() {
    let h = start(Opts {
        step_ms: 5,
        ..Opts::default()
    });
    let (addr, stop, task) = start_listener(&h).await;
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let body = json!({"prompt": "drain me", "max_tokens": 40, "ignore_eos": true, "stream": true});
    conn.write_all(&http_post("/v1/completions", &body))
        .await
        .unwrap();
    let mut first = [0u8; 64];
    let n = conn.read(&mut first).await.unwrap();
    assert!(std::str::from_utf8(&first[..n])
        .unwrap()
        .starts_with("HTTP/1.1 200"));
    stop.send(()).unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // The engine no longer accepts work, and the listener is closed.
    assert!(TcpStream::connect(addr).await.is_err());
    let m = h.scrape().await;
    assert_eq!(
        m.get(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_disconnect_mid_stream_aborts() {
    let h = start(Opts {
        step_ms: 5,
        ..Opts::default()
    });
    let (addr, stop, task) = start_listener(&h).await;
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let body = json!({"max_tokens": 300, "stream": true, "messages": [{"role": "user", "content": "bye"}]});
    conn.write_all(&http_post("/v1/messages", &body))
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = String::new();
    while !got.contains("content_block_delta") {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(conn);
    h.wait_metrics("the abort", |m| {
        m.get(
            "vllm:request_success_total",
            &[("finished_reason", "abort")],
        ) == 1.0
            && m.val("vllm:num_requests_running") == 0
            && m.get("vllm:kv_cache_usage_perc", &[]) == 0.0
    })
    .await;
    let g = h.engine.gauges();
    assert_eq!(g.num_requests_running, 0);
    assert_eq!(g.kv_cache_usage_perc, 0.0);
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

/// A panic on the engine's core thread, over HTTP: the stream in flight ends with an SSE error
/// event, the non-streaming request in flight gets a 500 in OpenAI's shape, `/health` and new
/// requests answer 503, and the server stops with `EngineDead` (the binary exits non-zero).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_fails_live_requests_and_stops_the_server() {
    use cachet_text::TextTokenizer;
    let trigger = cachet_text::ByteTokenizer.encode("PANIC!", false).unwrap();
    let h = start(Opts {
        step_ms: 5,
        panic_on: Some(trigger),
        ..Opts::default()
    });
    let (addr, _stop, task) = start_listener(&h).await;
    // A stream in flight.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let body = json!({"prompt": "long", "max_tokens": 500, "ignore_eos": true, "stream": true});
    conn.write_all(&http_post("/v1/completions", &body))
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // A non-streaming request in flight.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let app = h.app.clone();
    tokio::spawn(async move {
        use tower::ServiceExt;
        let req = axum::http::Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(
                json!({"prompt": "other", "max_tokens": 500, "ignore_eos": true}).to_string(),
            ))
            .unwrap();
        let resp = app.oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        let _ = tx.send((
            status,
            serde_json::from_slice::<serde_json::Value>(&bytes).unwrap(),
        ));
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The request that kills the engine.
    let (s, _, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "PANIC!", "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    let (status, v) = rx.await.unwrap();
    assert_eq!(status, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(v["error"]["type"], "server_error");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("\"error\":{"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    let (s, _) = h.get("/health").await;
    assert_eq!(s, axum::http::StatusCode::SERVICE_UNAVAILABLE);
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "after", "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, axum::http::StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["code"], "engine_dead");
    let m = h.scrape().await;
    assert_eq!(
        m.get("vllm:engine_sleep_state", &[("sleep_state", "awake")]),
        0.0
    );
    let res = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(res, Err(cachet_server::ServeError::EngineDead)),
        "{res:?}"
    );
}
