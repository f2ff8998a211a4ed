//! Reasoning output (`--reasoning-parser`) on the simulated model scripted to think in the open:
//! chat completions (`reasoning_content` / `reasoning`, streamed as deltas,
//! `completion_tokens_details.reasoning_tokens`) and Anthropic Messages (`thinking` blocks).

mod common;

use axum::http::StatusCode;
use cachet_text::ReasoningFormat;
use common::{start, Harness, Opts, MODEL};
use serde_json::{json, Value};

/// 7 + 13 + 8 = 28 bytes of reasoning block, then 8 of answer: one byte token each.
const REPLY: &str = "<think>Two plus two.</think>It is 4.";

fn harness(parser: Option<ReasoningFormat>, reply: &str) -> Harness {
    start(Opts {
        reply: Some(reply.into()),
        reasoning_parser: parser,
        ..Opts::default()
    })
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 64,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn chat_separates_reasoning_and_counts_its_tokens() {
    let h = harness(Some(ReasoningFormat::Qwen3), REPLY);
    let (status, body, _) = h.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let m = &body["choices"][0]["message"];
    assert_eq!(m["content"], "It is 4.");
    assert_eq!(m["reasoning_content"], "Two plus two.");
    assert_eq!(m["reasoning"], "Two plus two.");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    // 36 scripted tokens and EOS; the 28 of the block (tags included) are reasoning.
    assert_eq!(body["usage"]["completion_tokens"], 37);
    assert_eq!(
        body["usage"]["completion_tokens_details"]["reasoning_tokens"],
        28
    );

    // Without a parser the reasoning stays in the text, and no details are sent.
    let plain = harness(None, REPLY);
    let (_, body, _) = plain.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(body["choices"][0]["message"]["content"], REPLY);
    assert!(body["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());
    assert!(body["usage"].get("completion_tokens_details").is_none());
}

#[tokio::test]
async fn deepseek_r1_reasoning_without_an_opening_tag() {
    let h = harness(Some(ReasoningFormat::DeepSeekR1), "Hmm.</think>Four.");
    let (_, body, _) = h.post("/v1/chat/completions", chat(json!({}))).await;
    let m = &body["choices"][0]["message"];
    assert_eq!(
        (m["reasoning"].as_str(), m["content"].as_str()),
        (Some("Hmm."), Some("Four."))
    );
    assert_eq!(
        body["usage"]["completion_tokens_details"]["reasoning_tokens"],
        12
    );
    // Qwen3 does not read an unopened block as reasoning: all answer.
    let q = harness(Some(ReasoningFormat::Qwen3), "Hmm.</think>Four.");
    let (_, body, _) = q.post("/v1/chat/completions", chat(json!({}))).await;
    let m = &body["choices"][0]["message"];
    assert_eq!(m["content"], "Hmm.</think>Four.");
    assert_eq!(m["reasoning"], Value::Null);
    assert_eq!(
        body["usage"]["completion_tokens_details"]["reasoning_tokens"],
        0
    );
}

#[tokio::test]
async fn streamed_chat_sends_reasoning_deltas_then_content() {
    let h = harness(Some(ReasoningFormat::Qwen3), REPLY);
    let body = chat(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (status, events, _) = h.stream("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK);
    let (mut reasoning, mut reasoning_new, mut content) =
        (String::new(), String::new(), String::new());
    let mut usage = Value::Null;
    let mut order = Vec::new();
    for (_, data) in &events {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        let Some(d) = v["choices"].get(0).map(|c| &c["delta"]) else {
            continue;
        };
        if let Some(r) = d["reasoning_content"].as_str() {
            reasoning += r;
            order.push('r');
        }
        if let Some(r) = d["reasoning"].as_str() {
            reasoning_new += r;
        }
        if let Some(c) = d["content"].as_str() {
            if !c.is_empty() {
                content += c;
                order.push('c');
            }
        }
    }
    assert_eq!(reasoning, "Two plus two.");
    assert_eq!(reasoning_new, reasoning);
    assert_eq!(content, "It is 4.");
    // All reasoning comes before any content.
    let first_c = order.iter().position(|&c| c == 'c').unwrap();
    assert!(order[first_c..].iter().all(|&c| c == 'c'), "{order:?}");
    assert_eq!(usage["completion_tokens_details"]["reasoning_tokens"], 28);
    assert_eq!(usage["completion_tokens"], 37);
}

fn messages(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn anthropic_thinking_blocks_when_thinking_is_on() {
    let h = harness(Some(ReasoningFormat::Qwen3), REPLY);
    for thinking in [
        json!({"type": "enabled", "budget_tokens": 1024}),
        json!({"type": "adaptive"}),
    ] {
        let (status, body, _) = h
            .post("/v1/messages", messages(json!({"thinking": thinking})))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            body["content"],
            json!([
                {"type": "thinking", "thinking": "Two plus two.", "signature": "cachet-unsigned"},
                {"type": "text", "text": "It is 4."},
            ])
        );
        assert_eq!(body["usage"]["output_tokens"], 37);
    }
    // Thinking off (or absent): the reasoning is dropped, never shown as text or redacted.
    for extra in [json!({"thinking": {"type": "disabled"}}), json!({})] {
        let (_, body, _) = h.post("/v1/messages", messages(extra)).await;
        assert_eq!(
            body["content"],
            json!([{"type": "text", "text": "It is 4."}])
        );
    }
    // `display: "omitted"`: the block is there, its text is not.
    let (_, body, _) = h
        .post(
            "/v1/messages",
            messages(json!({"thinking": {"type": "adaptive", "display": "omitted"}})),
        )
        .await;
    assert_eq!(
        body["content"][0],
        json!({"type": "thinking", "thinking": "", "signature": "cachet-unsigned"})
    );
    // A thinking type Anthropic does not define is a 400.
    let (status, body, _) = h
        .post(
            "/v1/messages",
            messages(json!({"thinking": {"type": "deep"}})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn anthropic_streams_thinking_deltas_then_a_signature() {
    let h = harness(Some(ReasoningFormat::Qwen3), REPLY);
    let body =
        messages(json!({"stream": true, "thinking": {"type": "enabled", "budget_tokens": 2048}}));
    let (status, events, _) = h.stream("/v1/messages", body).await;
    assert_eq!(status, StatusCode::OK);
    let mut seq = Vec::new();
    let (mut thinking, mut text) = (String::new(), String::new());
    for (name, data) in &events {
        let v: Value = serde_json::from_str(data).unwrap();
        let name = name.clone().unwrap_or_default();
        match name.as_str() {
            "content_block_start" => seq.push(format!(
                "start {} {}",
                v["index"],
                v["content_block"]["type"].as_str().unwrap()
            )),
            "content_block_stop" => seq.push(format!("stop {}", v["index"])),
            "content_block_delta" => {
                let d = &v["delta"];
                match d["type"].as_str().unwrap() {
                    "thinking_delta" => thinking += d["thinking"].as_str().unwrap(),
                    "text_delta" => text += d["text"].as_str().unwrap(),
                    "signature_delta" => {
                        assert_eq!(d["signature"], "cachet-unsigned");
                        seq.push(format!("signature {}", v["index"]));
                    }
                    other => panic!("unexpected delta {other}"),
                }
            }
            _ => {}
        }
    }
    assert_eq!(thinking, "Two plus two.");
    assert_eq!(text, "It is 4.");
    assert_eq!(
        seq,
        [
            "start 0 thinking",
            "signature 0",
            "stop 0",
            "start 1 text",
            "stop 1"
        ]
    );
}
