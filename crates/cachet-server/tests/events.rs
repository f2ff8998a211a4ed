//! `GET /v1/cache/events` (the engine's KV cache events as SSE, replay by id) and the render
//! routes (the token ids a request would run), on the simulated engine with B = 16.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};

/// Reads SSE events from `path` until `n` have arrived (or panics after 10 s).
async fn read_events(
    h: &Harness,
    path: &str,
    last_id: Option<&str>,
    n: usize,
) -> Vec<(Option<String>, Option<String>, Value)> {
    let mut req = Request::get(path);
    if let Some(id) = last_id {
        req = req.header("last-event-id", id);
    }
    let resp = h.send(req.body(Body::empty()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    // Request and session ids, adapters and salts are any text: declared UTF-8.
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let mut body = resp.into_body();
    let mut text = String::new();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while out.len() < n {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .expect("events in time")
            .expect("frame")
            .expect("ok");
        if let Ok(d) = frame.into_data() {
            text.push_str(&String::from_utf8_lossy(&d));
        }
        while let Some(end) = text.find("\n\n") {
            let chunk: String = text.drain(..end + 2).collect();
            let (mut event, mut id, mut data) = (None, None, String::new());
            for line in chunk.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = Some(v.trim().to_string());
                } else if let Some(v) = line.strip_prefix("id:") {
                    id = Some(v.trim().to_string());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim());
                }
            }
            if event.is_some() || !data.is_empty() {
                out.push((
                    event,
                    id,
                    serde_json::from_str(&data).unwrap_or(Value::Null),
                ));
            }
        }
    }
    out
}

fn complete(prompt: &[u32]) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": true})
}

#[tokio::test]
async fn cache_events_name_what_entered_and_left_the_cache() {
    let h = start(Opts {
        event_log: 64,
        ..Opts::default()
    });
    let a: Vec<u32> = (35..75).collect(); // 40 tokens: blocks 0 and 1 full
    let (s, _, _) = h.post("/v1/completions", complete(&a)).await;
    assert_eq!(s, StatusCode::OK);
    // The same prompt again: a hit, nothing new is stored.
    h.post("/v1/completions", complete(&a)).await;
    // Another prompt sharing the first block: one new block stored, parented on A's block 0.
    let mut b = a[..16].to_vec();
    b.extend(100..124);
    h.post("/v1/completions", complete(&b)).await;
    h.engine.wait_idle().await;
    let (s, v, _) = h.post("/reset_prefix_cache", json!({})).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"reset": true})));

    let evs = read_events(&h, "/v1/cache/events?from=0", None, 3).await;
    let ids: Vec<_> = evs.iter().map(|e| e.1.clone().unwrap()).collect();
    assert_eq!(ids, ["0", "1", "2"]);
    let e0 = &evs[0].2["events"];
    assert_eq!(e0.as_array().unwrap().len(), 1);
    assert_eq!(e0[0]["type"], "BlockStored");
    assert_eq!(e0[0]["block_hashes"].as_array().unwrap().len(), 2);
    assert_eq!(e0[0]["parent_block_hash"], Value::Null);
    assert_eq!(e0[0]["token_ids"], json!(a[..32]));
    assert_eq!(e0[0]["medium"], "GPU");
    assert!(e0[0]["request_id"].as_str().unwrap().starts_with("cmpl-"));
    let e1 = &evs[1].2["events"];
    assert_eq!(e1[0]["type"], "BlockStored");
    assert_eq!(e1[0]["block_hashes"].as_array().unwrap().len(), 1);
    assert_eq!(e1[0]["parent_block_hash"], e0[0]["block_hashes"][0]);
    assert_eq!(e1[0]["token_ids"], json!(b[16..32]));
    assert_eq!(
        evs[2].2["events"],
        json!([{"type": "AllBlocksCleared", "medium": "GPU"}])
    );

    // Replay from Last-Event-ID: only what came after batch 0.
    let evs = read_events(&h, "/v1/cache/events", Some("0"), 2).await;
    assert_eq!(evs[0].1.as_deref(), Some("1"));
    assert_eq!(evs[1].1.as_deref(), Some("2"));
    // An id from the future (another process): the stream says it cannot replay.
    let evs = read_events(&h, "/v1/cache/events", Some("999"), 1).await;
    assert_eq!(evs[0].0.as_deref(), Some("reset"));
}

#[tokio::test]
async fn cache_events_are_behind_the_api_key_and_off_without_a_log() {
    let h = start(Opts {
        event_log: 8,
        api_key: Some("k".into()),
        ..Opts::default()
    });
    let resp = h
        .send(
            Request::get("/v1/cache/events")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let h = start(Opts::default());
    let resp = h
        .send(
            Request::get("/v1/cache/events")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn render_routes_return_the_token_ids_a_request_would_run() {
    let h = start(Opts::default());
    let (s, v, _) = h
        .post(
            "/v1/chat/completions/render",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // The byte tokenizer's template: "<|user|>\nhi\n<|assistant|>\n", one token per byte.
    let rendered = "<|user|>\nhi\n<|assistant|>\n";
    assert_eq!(v["prompt"], rendered);
    let want: Vec<u32> = rendered.bytes().map(|b| b as u32 + 3).collect();
    assert_eq!(v["token_ids"], json!(want));
    // The same count /v1/chat/completions reports as prompt tokens.
    let (_, c, _) = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        )
        .await;
    assert_eq!(c["usage"]["prompt_tokens"], json!(want.len()));
    let (s, v, _) = h
        .post(
            "/v1/completions/render",
            json!({"model": MODEL, "prompt": ["ab", "c"]}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["token_ids"], json!([100, 101]));
    assert_eq!(list[1]["token_ids"], json!([102]));
    assert_eq!(list[0]["model"], MODEL);
}
