//! The `x-cachet-cache` header on non-streamed generation responses (spec §3's split), with
//! per-request metrics off, on the simulated engine (B = 16, one byte = one token).

mod common;
use common::*;

use axum::http::StatusCode;
use serde_json::{json, Value};

fn off() -> Opts {
    Opts {
        per_request_metrics: false,
        ..Opts::default()
    }
}

/// `n` token ids of the byte tokenizer (no BOS: a token prompt is sent as it is), led by `lead`.
fn ids(n: usize, lead: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (lead + i * 7) % 200).collect()
}

async fn header_of(h: &Harness, path: &str, body: Value) -> String {
    let (s, v, resp) = h.post(path, body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v.get("metrics").is_none(), "metrics are off: {v}");
    resp.headers()["x-cachet-cache"]
        .to_str()
        .expect("ascii")
        .to_string()
}

/// Spec §4 examples 1 and 2 (a 100-token prompt, then the same again) and example 3 (96 twice).
#[tokio::test]
async fn completions_carry_the_split_without_per_request_metrics() {
    let h = start(off());
    let p = ids(100, 0);
    let body = json!({"model": MODEL, "prompt": p, "max_tokens": 1});
    assert_eq!(
        header_of(&h, "/v1/completions", body.clone()).await,
        "local=0; external=0; computed=100; created=96"
    );
    assert_eq!(
        header_of(&h, "/v1/completions", body).await,
        "local=96; external=0; computed=4; created=0"
    );
    let body = json!({"model": MODEL, "prompt": ids(96, 1), "max_tokens": 1});
    assert_eq!(
        header_of(&h, "/v1/completions", body.clone()).await,
        "local=0; external=0; computed=96; created=96"
    );
    assert_eq!(
        header_of(&h, "/v1/completions", body).await,
        "local=80; external=0; computed=16; created=0"
    );
}

/// Two prompts in one request (no common first block): the header is the sum of both.
#[tokio::test]
async fn several_prompts_sum_into_one_header() {
    let h = start(off());
    let body = json!({"model": MODEL, "prompt": [ids(40, 0), ids(50, 1)], "max_tokens": 1});
    // 40 → 32 created; 50 → 48 created.
    assert_eq!(
        header_of(&h, "/v1/completions", body).await,
        "local=0; external=0; computed=90; created=80"
    );
}

/// Chat and Anthropic messages: the same conversation twice; the second hits every full block
/// below the N-1 cap.
#[tokio::test]
async fn chat_and_messages_carry_the_split() {
    let h = start(off());
    let msg = "A prompt long enough to fill a few KV blocks of sixteen tokens each, at least.";
    let (_, t, _) = h
        .post(
            "/tokenize",
            json!({"messages": [{"role": "user", "content": msg}]}),
        )
        .await;
    let n = t["count"].as_u64().unwrap();
    let full = n / BLOCK as u64 * BLOCK as u64;
    let hit = (n - 1) / BLOCK as u64 * BLOCK as u64;
    let chat = json!({"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": msg}]});
    assert_eq!(
        header_of(&h, "/v1/chat/completions", chat.clone()).await,
        format!("local=0; external=0; computed={n}; created={full}")
    );
    assert_eq!(
        header_of(&h, "/v1/chat/completions", chat).await,
        format!("local={hit}; external=0; computed={}; created=0", n - hit)
    );
    // Anthropic's template renders the same single user turn: every block is cached now.
    let anth = json!({"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": msg}]});
    assert_eq!(
        header_of(&h, "/v1/messages", anth).await,
        format!("local={hit}; external=0; computed={}; created=0", n - hit)
    );
}

/// A streamed response has no such header (its split rides on the final usage instead).
#[tokio::test]
async fn streamed_responses_have_no_header() {
    let h = start(off());
    let (s, _, resp) = h
        .stream(
            "/v1/completions",
            json!({"model": MODEL, "prompt": ids(20, 0), "max_tokens": 1, "stream": true}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(resp.headers().get("x-cachet-cache").is_none());
}
