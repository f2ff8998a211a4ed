//! What Claude Code sends to `/v1/messages`: `context_management` edits, `role: "system"`
//! messages inside `messages` (a beta), tool results that must answer the previous turn's tool
//! uses, `max_tokens` sized for 200k-token models; and its captured first request replayed.

mod common;

use axum::http::StatusCode;
use common::{start, Harness, Opts, MODEL};
use serde_json::{json, Value};

const BETA: (&str, &str) = (
    "anthropic-beta",
    "claude-code-20250219,mid-conversation-system-2026-04-07,effort-2025-11-24",
);

fn harness() -> Harness {
    start(Opts {
        reply: Some("Done.".into()),
        ..Opts::default()
    })
}

fn messages(msgs: Value) -> Value {
    json!({"model": MODEL, "max_tokens": 16, "messages": msgs})
}

fn assert_anthropic_400(status: StatusCode, body: &Value, needle: &str) {
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(needle), "{msg}");
}

async fn count_tokens(h: &Harness, body: Value) -> u64 {
    let (s, v, _) = h
        .post_with("/v1/messages/count_tokens", body, &[BETA])
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["input_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn system_messages_inside_messages_need_the_beta() {
    let h = harness();
    let body = messages(json!([
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    ]));
    let (status, err, _) = h.post("/v1/messages", body.clone()).await;
    assert_anthropic_400(status, &err, "mid-conversation-system-2026-04-07");
    let (status, ok, _) = h.post_with("/v1/messages", body.clone(), &[BETA]).await;
    assert_eq!(status, StatusCode::OK, "{ok}");
    assert_eq!(ok["content"][0]["text"], "Done.");
    // The system message is in the prompt where it was sent: after the user turn.
    let with = count_tokens(&h, body).await;
    let without = count_tokens(&h, messages(json!([{"role": "user", "content": "hi"}]))).await;
    // "<|system|>\nBe brief.\n" is 21 bytes.
    assert_eq!(with - without, 21);
}

#[tokio::test]
async fn a_tool_result_must_answer_a_tool_use_of_the_previous_turn() {
    let h = harness();
    let turn = |result_id: &str| {
        messages(json!([
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": result_id, "content": "a.txt"}]},
        ]))
    };
    let (status, body, _) = h.post("/v1/messages", turn("toolu_1")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body, _) = h.post("/v1/messages", turn("toolu_9")).await;
    assert_anthropic_400(
        status,
        &body,
        "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9",
    );
    // A result with no assistant turn before it at all.
    let (status, body, _) = h
        .post(
            "/v1/messages",
            messages(json!([{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}])),
        )
        .await;
    assert_anthropic_400(status, &body, "messages.0.content.0");
}

#[tokio::test]
async fn max_tokens_is_clamped_for_messages_only() {
    let h = harness();
    // 32000 is far over the 1024-token context: the Messages API clamps it.
    let mut body = messages(json!([{"role": "user", "content": "hi"}]));
    body["max_tokens"] = json!(32000);
    let (status, v, _) = h.post("/v1/messages", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["content"][0]["text"], "Done.");
    // Chat and text completions keep vLLM's 400.
    let chat = json!({"model": MODEL, "max_tokens": 32000,
        "messages": [{"role": "user", "content": "hi"}]});
    let (status, v, _) = h.post("/v1/chat/completions", chat).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let text = json!({"model": MODEL, "max_tokens": 32000, "prompt": "hi"});
    let (status, v, _) = h.post("/v1/completions", text).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    // A prompt that fills the context is still refused.
    let mut body = messages(json!([{"role": "user", "content": "x".repeat(1100)}]));
    body["max_tokens"] = json!(32000);
    let (status, v, _) = h.post("/v1/messages", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
}

/// Three tool uses with 100-byte results; the edit clears all but the last.
fn tool_conversation() -> Value {
    let mut msgs = vec![json!({"role": "user", "content": "go"})];
    for id in ["t1", "t2", "t3"] {
        msgs.push(json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "x"},
            {"type": "tool_use", "id": id, "name": "read", "input": {}}]}));
        msgs.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": "x".repeat(100)}]}));
    }
    Value::Array(msgs)
}

#[tokio::test]
async fn context_management_edits_are_applied_and_reported() {
    let h = harness();
    let mut body = messages(tool_conversation());
    body["context_management"] = json!({"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
        {"type": "clear_tool_uses_20250919",
         "trigger": {"type": "input_tokens", "value": 100},
         "keep": {"type": "tool_uses", "value": 1}},
    ]});
    let (status, v, _) = h.post("/v1/messages", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // Two results of 100 bytes become the 37-byte placeholder: 2 x 63 tokens freed. Thinking
    // never reaches cachet's prompt, so clearing it frees none.
    assert_eq!(
        v["context_management"],
        json!({"applied_edits": [
            {"type": "clear_thinking_20251015", "cleared_thinking_turns": 2, "cleared_input_tokens": 0},
            {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2, "cleared_input_tokens": 126},
        ]})
    );
    // The prompt that ran is the edited one: 126 tokens shorter than the unedited request's.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("context_management");
    let (_, p, _) = h.post("/v1/messages", plain).await;
    let input = |v: &Value| {
        v["usage"]["input_tokens"].as_u64().unwrap()
            + v["usage"]["cache_read_input_tokens"].as_u64().unwrap()
            + v["usage"]["cache_creation_input_tokens"].as_u64().unwrap()
    };
    assert_eq!(input(&p) - input(&v), 126);
    assert!(p.get("context_management").is_none());
    // Claude Code's edit keeps all thinking: nothing applied, the field still answered.
    body["context_management"] =
        json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]});
    let (_, v, _) = h.post("/v1/messages", body.clone()).await;
    assert_eq!(v["context_management"], json!({"applied_edits": []}));
    // Streamed: on message_delta.
    body["stream"] = json!(true);
    let (_, events, _) = h.stream("/v1/messages", body.clone()).await;
    let delta = events
        .iter()
        .find(|(n, _)| n.as_deref() == Some("message_delta"))
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
        .unwrap();
    assert_eq!(delta["context_management"], json!({"applied_edits": []}));
    // An unknown edit is a 400.
    body["context_management"] = json!({"edits": [{"type": "clear_all"}]});
    let (status, v, _) = h.post("/v1/messages", body).await;
    assert_anthropic_400(status, &v, "clear_all");
}

/// Claude Code 2.1.197's first request of `claude -p "Say hello."`, as captured: billing line,
/// `thinking: adaptive`, `context_management`, `output_config.effort`, a `role: "system"`
/// message, 24 tools and `max_tokens: 32000`; answered, with the billing line removed.
#[tokio::test]
async fn claude_codes_captured_first_request_is_answered() {
    let fixture =
        include_str!("../../../tests/e2e/fixtures/claude_code_2.1.197_first_request.json");
    let mut req: Value = serde_json::from_str(fixture).unwrap();
    req["model"] = json!(MODEL);
    let h = start(Opts {
        reply: Some("Hello.".into()),
        max_model_len: 131_072,
        num_kv_blocks: 131_072 / common::BLOCK,
        ..Opts::default()
    });
    let beta = (
        "anthropic-beta",
        "claude-code-20250219,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,context-management-2025-06-27,prompt-caching-scope-2026-01-05,mid-conversation-system-2026-04-07,effort-2025-11-24",
    );
    req["stream"] = json!(false);
    let (status, v, _) = h.post_with("/v1/messages", req.clone(), &[beta]).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["content"], json!([{"type": "text", "text": "Hello."}]));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["context_management"], json!({"applied_edits": []}));
    assert_eq!(v["metrics"]["billing_header_removed"], true);
    // The second send reads every full block of the prompt but the one holding its last
    // token (which must be computed) from the cache.
    let (_, again, _) = h.post_with("/v1/messages", req, &[beta]).await;
    let prompt = v["usage"]["input_tokens"].as_u64().unwrap()
        + v["usage"]["cache_creation_input_tokens"].as_u64().unwrap();
    let read = again["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let block = common::BLOCK as u64;
    assert_eq!(read, (prompt - 1) / block * block);
    assert!(read > 40_000, "{read}");
}
