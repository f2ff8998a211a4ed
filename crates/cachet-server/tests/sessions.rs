//! Resumable sessions over HTTP (spec §5): `session_id`, the turn's usage, the `session` object,
//! 409 on a busy session, `DELETE /v1/sessions/{id}` and `POST /reset_prefix_cache`.
//!
//! Numbers are derived by hand: block size 16, byte tokenizer (one token per byte), the sim's
//! chat template renders `<|role|>\ncontent\n` per message and `<|assistant|>\n` as generation
//! prompt, so `<|user|>\n` is 9 tokens and `<|assistant|>\n` 14.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use serde_json::{json, Value};
use tower::ServiceExt;

fn msg(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

fn chat(messages: &[Value], max_tokens: u32, session: Option<&str>) -> Value {
    let mut b = json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    if let Some(s) = session {
        b["session_id"] = json!(s);
    }
    b
}

fn anth(messages: &[Value], max_tokens: u32, session: &str, stream: bool) -> Value {
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "session_id": session, "stream": stream})
}

fn usage3(v: &Value) -> (u64, u64, u64) {
    let u = &v["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        u["prompt_tokens_details"]["created_cache_tokens"]
            .as_u64()
            .unwrap(),
    )
}

fn reply(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Three turns, hand-derived: OpenAI non-streaming, OpenAI streaming, Anthropic streaming and
/// non-streaming numbers.
#[tokio::test]
async fn session_turn_usage_by_hand() {
    let h = start(Opts::default());
    let u1 = "abcdefgh"; // turn 1 prompt: 9 + 8 + 1 + 14 = 32 tokens
    let turn1 = [msg("user", u1)];
    let (s, v1, _) = h
        .post("/v1/chat/completions", chat(&turn1, 4, Some("s-usage")))
        .await;
    assert_eq!(s, StatusCode::OK, "{v1}");
    // Empty cache: nothing cached, both full blocks created.
    assert_eq!(usage3(&v1), (32, 0, 32), "{v1}");
    assert_eq!(
        v1["session"],
        json!({"id": "s-usage", "continued": false, "status": "new", "turn": 1})
    );
    assert_eq!(v1["metrics"]["session"]["session_continued"], false);
    assert_eq!(v1["metrics"]["session"]["retained_tokens"], 0);
    let r1 = reply(&v1);
    assert_eq!(r1.len(), 4);

    // Parked: 32 prompt + 3 generated tokens (the last sampled token has no KV) = 35.
    // Turn 2 prompt: 32 + 4 (reply) + 1 + 9 + 11 + 1 + 14 = 72 tokens; new = 72 - 35 = 37.
    // Newly full blocks: [32,48) holds 3 retained + 13 new, [48,64) 16 new → created 29.
    let u2 = "hello world"; // 11 bytes
    let turn2 = [msg("user", u1), msg("assistant", &r1), msg("user", u2)];
    let (s, v2, _) = h
        .post("/v1/chat/completions", chat(&turn2, 4, Some("s-usage")))
        .await;
    assert_eq!(s, StatusCode::OK, "{v2}");
    assert_eq!(usage3(&v2), (72, 35, 29), "{v2}");
    assert_eq!(v2["usage"]["total_tokens"], 76);
    assert_eq!(
        v2["session"],
        json!({"id": "s-usage", "continued": true, "status": "continued", "turn": 2})
    );
    let pc = &v2["metrics"]["prefix_cache"];
    assert_eq!(pc["prompt_tokens"], 37, "{v2}");
    assert_eq!(pc["computed_tokens"], 37);
    assert_eq!(pc["cached_tokens"], 0);
    assert_eq!(pc["cache_creation_tokens"], 29);
    let ms = &v2["metrics"]["session"];
    assert_eq!(ms["session_continued"], true);
    assert_eq!(ms["retained_tokens"], 35);
    assert_eq!(ms["cumulative"]["prompt_tokens"], 32 + 37);
    assert_eq!(ms["cumulative"]["computed_tokens"], 32 + 37);
    assert_eq!(ms["cumulative"]["cache_creation_tokens"], 32 + 29);
    let r2 = reply(&v2);

    // Turn 3 over Anthropic (streaming). Parked: 72 + 3 = 75. Prompt: 72 + 4 + 1 + 9 + 5 + 1 +
    // 14 = 106; new = 31. Newly full: [64,80) holds 11 retained + 5 new, [80,96) 16 new → 21.
    // input_tokens = 106 - 75 - 21 = 10.
    let turn3 = [
        msg("user", u1),
        msg("assistant", &r1),
        msg("user", u2),
        msg("assistant", &r2),
        msg("user", "again"),
    ];
    let (s, events, _) = h
        .stream("/v1/messages", anth(&turn3, 4, "s-usage", true))
        .await;
    assert_eq!(s, StatusCode::OK);
    let data = |name: &str| -> Value {
        let (_, d) = events
            .iter()
            .find(|(e, _)| e.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no {name} in {events:?}"));
        serde_json::from_str(d).unwrap()
    };
    let start_ev = data("message_start");
    let want_usage = |out: u64| json!({"input_tokens": 10, "output_tokens": out, "cache_creation_input_tokens": 21, "cache_read_input_tokens": 75});
    assert_eq!(start_ev["message"]["usage"], want_usage(0), "{start_ev}");
    let want_session =
        json!({"id": "s-usage", "continued": true, "status": "continued", "turn": 3});
    assert_eq!(start_ev["message"]["session"], want_session);
    let delta = data("message_delta");
    assert_eq!(delta["usage"], want_usage(4), "{delta}");
    assert_eq!(delta["session"], want_session);
    assert_eq!(delta["metrics"]["prefix_cache"]["computed_tokens"], 31);
    assert_eq!(
        delta["metrics"]["session"]["cumulative"]["cache_creation_tokens"],
        32 + 29 + 21
    );
    let r3: String = events
        .iter()
        .filter(|(e, _)| e.as_deref() == Some("content_block_delta"))
        .map(|(_, d)| {
            let v: Value = serde_json::from_str(d).unwrap();
            v["delta"]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(r3.len(), 4);

    // Turn 4, Anthropic non-streaming: parked 106 + 3 = 109; prompt 106 + 4 + 1 + 9 + 3 + 1 + 14
    // = 138; new 29; newly full: [96,112) holds 13 retained + 3 new, [112,128) 16 → 19;
    // input = 138 - 109 - 19 = 10.
    let mut turn4 = turn3.to_vec();
    turn4.push(msg("assistant", &r3));
    turn4.push(msg("user", "end"));
    let (s, v4, _) = h
        .post("/v1/messages", anth(&turn4, 4, "s-usage", false))
        .await;
    assert_eq!(s, StatusCode::OK, "{v4}");
    assert_eq!(
        v4["usage"],
        json!({"input_tokens": 10, "output_tokens": 4, "cache_creation_input_tokens": 19, "cache_read_input_tokens": 109})
    );
    assert_eq!(v4["session"]["turn"], 4);
    assert_eq!(v4["session"]["status"], "continued");
}

/// OpenAI streaming: `session` rides on the usage chunk (or on the finish chunk without usage).
#[tokio::test]
async fn session_streaming_openai() {
    let h = start(Opts::default());
    let turn1 = [msg("user", "abcdefgh")];
    let mut body = chat(&turn1, 4, Some("s-stream"));
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (s, events, _) = h.stream("/v1/chat/completions", body).await;
    assert_eq!(s, StatusCode::OK);
    let chunks: Vec<Value> = events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["session"]["status"], "new");
    assert_eq!(last["session"]["id"], "s-stream");
    assert_eq!(usage3(last), (32, 0, 32));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    // Without include_usage: on the finish chunk.
    let turn2 = [
        msg("user", "abcdefgh"),
        msg("assistant", &text),
        msg("user", "hello world"),
    ];
    let mut body = chat(&turn2, 4, Some("s-stream"));
    body["stream"] = json!(true);
    let (_, events, _) = h.stream("/v1/chat/completions", body).await;
    let fin: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    assert_eq!(fin["session"]["status"], "continued");
    assert_eq!(fin["session"]["turn"], 2);
    assert_eq!(fin["metrics"]["session"]["retained_tokens"], 35);
    assert_eq!(fin["metrics"]["prefix_cache"]["computed_tokens"], 37);
}

#[tokio::test]
async fn non_session_requests_unchanged() {
    let h = start(Opts::default());
    let (s, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "abcdefgh")], 4, None),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(v.get("session").is_none(), "{v}");
    assert!(v["metrics"].get("session").is_none(), "{v}");
    assert_eq!(usage3(&v), (32, 0, 32));
    // The same prompt again: prefix-cache hit capped at floor(31/16)*16 = 16.
    let (_, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "abcdefgh")], 4, None),
        )
        .await;
    assert_eq!(usage3(&v), (32, 16, 0));
}

#[tokio::test]
async fn unknown_id_edited_history_and_delete() {
    let h = start(Opts::default());
    // An id never seen: a new session, with the clear field saying so.
    let (s, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "abcdefgh")], 4, Some("never-seen")),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["session"]["status"], "new");
    assert_eq!(v["session"]["continued"], false);
    let r1 = reply(&v);

    // Edited history: the parked session is released and the turn starts afresh.
    let edited = [
        msg("user", "abcdefgX"),
        msg("assistant", &r1),
        msg("user", "more"),
    ];
    let (s, v, _) = h
        .post("/v1/chat/completions", chat(&edited, 4, Some("never-seen")))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["session"]["status"], "history_mismatch", "{v}");
    assert_eq!(v["session"]["continued"], false);
    assert_eq!(v["metrics"]["session"]["retained_tokens"], 0);
    // Nothing retained: cached is the prefix-cache hit only. The first block
    // "<|user|>\nabcdefg" (16 tokens) is shared with turn 1.
    let (p, cached, _) = usage3(&v);
    assert_eq!(p, 9 + 8 + 1 + 14 + 4 + 1 + 9 + 4 + 1 + 14);
    assert_eq!(cached, 16);
    let r2 = reply(&v);

    // DELETE, then the next turn of that conversation is a new session.
    let del = Request::delete("/v1/sessions/never-seen")
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(del).await.status(), StatusCode::NO_CONTENT);
    let next = [
        msg("user", "abcdefgX"),
        msg("assistant", &r1),
        msg("user", "more"),
        msg("assistant", &r2),
        msg("user", "x"),
    ];
    let (s, v, _) = h
        .post("/v1/chat/completions", chat(&next, 4, Some("never-seen")))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["session"]["status"], "new", "{v}");
    assert_eq!(v["session"]["turn"], 1);
    // Deleting an unknown id is not an error.
    let del = Request::delete("/v1/sessions/nobody")
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(del).await.status(), StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn reset_prefix_cache_route() {
    let h = start(Opts::default());
    let (_, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "abcdefgh")], 4, Some("r")),
        )
        .await;
    assert_eq!(v["session"]["status"], "new");
    // The parked session holds blocks: the reset is refused.
    let (s, v, _) = h.post("/reset_prefix_cache", json!({})).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v, json!({"reset": false}));
    let del = Request::delete("/v1/sessions/r")
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(del).await.status(), StatusCode::NO_CONTENT);
    // Released: its 2 full blocks are held only by the cache now.
    let m = h.scrape().await;
    assert_eq!(m.get("cachet:kv_cache_only_blocks", &[]), 2.0);
    let (s, v, _) = h.post("/reset_prefix_cache", json!({})).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v, json!({"reset": true}));
    // The gauge is true when scraped right after the reset, with no engine step in between.
    let m = h.scrape().await;
    assert_eq!(m.get("cachet:kv_cache_only_blocks", &[]), 0.0);
    // The cache is empty: the same prompt hits nothing.
    let (_, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "abcdefgh")], 4, None),
        )
        .await;
    assert_eq!(usage3(&v), (32, 0, 32));
}

#[tokio::test]
async fn busy_session_is_409() {
    let h = start(Opts {
        step_ms: 5,
        ..Opts::default()
    });
    let app = h.app.clone();
    let first = tokio::spawn(async move {
        let req = Request::post("/v1/chat/completions")
            .header("content-type", "application/json")
            .body(Body::from(
                chat(&[msg("user", "long turn")], 100, Some("busy")).to_string(),
            ))
            .unwrap();
        let resp = app.oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        (status, serde_json::from_slice::<Value>(&bytes).unwrap())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (s, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "long turn")], 4, Some("busy")),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["type"], "conflict_error", "{v}");
    assert_eq!(v["error"]["code"], "session_busy");
    assert_eq!(v["error"]["param"], "session_id");
    assert!(v["error"]["message"].as_str().unwrap().contains("busy"));
    let (s, v, _) = h
        .post(
            "/v1/messages",
            anth(&[msg("user", "long turn")], 4, "busy", false),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // Another session is not affected.
    let (s, _, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "other")], 2, Some("other")),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = first.await.unwrap();
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["session"]["status"], "new");
    // Once the turn has finished, the next one is accepted.
    let (s, _, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "long turn")], 2, Some("busy")),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn session_id_validation_and_auth() {
    let h = start(Opts::default());
    // Ids are restricted to [A-Za-z0-9._:-]{1,128}: safe as store keys, log fields and URL
    // path segments.
    for bad in [
        json!(""),
        json!("x".repeat(129)),
        json!(5),
        json!("../../etc/passwd"),
        json!("a/../../b"),
        json!("a\u{0}b"),
        json!("a\r\nb"),
        json!("é"),
    ] {
        let mut b = chat(&[msg("user", "hi")], 2, None);
        b["session_id"] = bad.clone();
        let (s, v, _) = h.post("/v1/chat/completions", b).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        let mut b = anth(&[msg("user", "hi")], 2, "x", false);
        b["session_id"] = bad.clone();
        let (s, v, _) = h.post("/v1/messages", b).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert_eq!(v["type"], "error");
    }
    let (s, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(&[msg("user", "hi")], 2, Some(&"x".repeat(128))),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    for path in [
        "/v1/sessions/..%2F..%2Fetc%2Fpasswd",
        "/v1/sessions/a%0D%0Ab",
        "/v1/sessions/a%00b",
    ] {
        let del = Request::delete(path).body(Body::empty()).unwrap();
        let resp = h.send(del).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{path}");
    }

    let h = start(Opts {
        api_key: Some("sekret".into()),
        ..Opts::default()
    });
    let del = Request::delete("/v1/sessions/a")
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(del).await.status(), StatusCode::UNAUTHORIZED);
    let (s, _, _) = h.post("/reset_prefix_cache", json!({})).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let del = Request::delete("/v1/sessions/a")
        .header("authorization", "Bearer sekret")
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(del).await.status(), StatusCode::NO_CONTENT);
    let (s, v, _) = h
        .post_with(
            "/reset_prefix_cache",
            json!({}),
            &[("authorization", "Bearer sekret")],
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v, json!({"reset": true}));
}

/// `session_id` on `/v1/completions`, hand-derived. Turn 1: 20 prompt tokens, one full block
/// created. Parked: 20 + 3 generated (the last sampled token has no KV) = 23. Turn 2 sends
/// turn 1's prompt + its 4-character completion + 10 more = 34 tokens: 23 retained, 11 new;
/// block [16,32) becomes full with 7 retained + 9 new tokens, so 9 are created.
#[tokio::test]
async fn completions_take_a_session_id() {
    let h = start(Opts::default());
    let p1 = "abcdefghijklmnopqrst";
    let body = |prompt: &str| {
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
               "ignore_eos": true, "session_id": "c-1"})
    };
    let (s, v1, _) = h.post("/v1/completions", body(p1)).await;
    assert_eq!(s, StatusCode::OK, "{v1}");
    assert_eq!(usage3(&v1), (20, 0, 16), "{v1}");
    assert_eq!(
        v1["session"],
        json!({"id": "c-1", "continued": false, "status": "new", "turn": 1})
    );
    let text1 = v1["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(text1.len(), 4);
    let p2 = format!("{p1}{text1}0123456789");
    let (s, v2, _) = h.post("/v1/completions", body(&p2)).await;
    assert_eq!(s, StatusCode::OK, "{v2}");
    assert_eq!(usage3(&v2), (34, 23, 9), "{v2}");
    assert_eq!(
        v2["session"],
        json!({"id": "c-1", "continued": true, "status": "continued", "turn": 2})
    );
    // An empty id is a 400 naming the parameter, as on chat completions.
    let mut bad = body(p1);
    bad["session_id"] = json!("");
    let (s, v3, _) = h.post("/v1/completions", bad).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v3}");
    assert_eq!(v3["error"]["param"], "session_id", "{v3}");
}

/// A named key's sessions are its own. alice and bob both use session id "chat": bob's first
/// turn is a new session of his (turn 1, `new`), not a history mismatch that would release
/// alice's KV; alice's second turn continues hers (23 tokens retained, as in
/// `completions_take_a_session_id`); bob closing "chat" closes his, and alice's third turn
/// still continues; both responses name the session "chat".
#[tokio::test]
async fn tenants_sessions_with_one_id_are_apart() {
    let h = start(Opts {
        api_key: Some("alice:ka,bob:kb".into()),
        ..Opts::default()
    });
    let body = |prompt: &str| {
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
               "ignore_eos": true, "session_id": "chat"})
    };
    let alice = [("authorization", "Bearer ka")];
    let bob = [("authorization", "Bearer kb")];
    let p1 = "abcdefghijklmnopqrst";
    let (s, a1, _) = h.post_with("/v1/completions", body(p1), &alice).await;
    assert_eq!(s, StatusCode::OK, "{a1}");
    let (s, b1, _) = h
        .post_with("/v1/completions", body("zyxwvutsrqponmlkjihg"), &bob)
        .await;
    assert_eq!(s, StatusCode::OK, "{b1}");
    assert_eq!(
        b1["session"],
        json!({"id": "chat", "continued": false, "status": "new", "turn": 1})
    );
    let text1 = a1["choices"][0]["text"].as_str().unwrap().to_string();
    let p2 = format!("{p1}{text1}0123456789");
    let (s, a2, _) = h.post_with("/v1/completions", body(&p2), &alice).await;
    assert_eq!(s, StatusCode::OK, "{a2}");
    assert_eq!(usage3(&a2), (34, 23, 9), "{a2}");
    assert_eq!(
        a2["session"],
        json!({"id": "chat", "continued": true, "status": "continued", "turn": 2})
    );
    let del = Request::delete("/v1/sessions/chat")
        .header("authorization", "Bearer kb")
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(del).await.status(), StatusCode::NO_CONTENT);
    let text2 = a2["choices"][0]["text"].as_str().unwrap().to_string();
    let p3 = format!("{p2}{text2}!");
    let (s, a3, _) = h.post_with("/v1/completions", body(&p3), &alice).await;
    assert_eq!(s, StatusCode::OK, "{a3}");
    assert_eq!(a3["session"]["status"], "continued", "{a3}");
    assert_eq!(a3["session"]["turn"], 3, "{a3}");
}
