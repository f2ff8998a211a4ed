//! The Responses API through the router on the simulated executor: output items, the stream's
//! events, tools and `text.format` by grammar, stored responses per API key, background runs,
//! and `previous_response_id` continuing on retained KV.
//!
//! Numbers are derived by hand: block size 16, byte tokenizer (one token per byte), the sim's
//! chat template renders `<|role|>\ncontent\n` per message and `<|assistant|>\n` as generation
//! prompt, so `<|user|>\n` is 9 tokens and `<|assistant|>\n` 14. The simulator writes
//! printable bytes and never EOS, so a reply is `max_output_tokens` long (status `incomplete`).

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};

fn body(input: Value, max: u32) -> Value {
    json!({"model": MODEL, "input": input, "max_output_tokens": max, "temperature": 0})
}

fn with(mut b: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// (input, cached, cache_write, output, total).
fn usage(v: &Value) -> (u64, u64, u64, u64, u64) {
    let u = &v["usage"];
    (
        u["input_tokens"].as_u64().unwrap(),
        u["input_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        u["input_tokens_details"]["cache_write_tokens"]
            .as_u64()
            .unwrap(),
        u["output_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap(),
    )
}

fn text(v: &Value) -> String {
    v["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn req(
    h: &Harness,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    let r = match body {
        Some(v) => b
            .header("content-type", "application/json")
            .body(Body::from(v.to_string())),
        None => b.body(Body::empty()),
    };
    let resp = h.send(r.unwrap()).await;
    let s = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (s, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_string_input_is_one_user_message_and_usage_is_by_hand() {
    let h = start(Opts::default());
    // "<|user|>\nabcdefgh\n<|assistant|>\n": 9 + 8 + 1 + 14 = 32 tokens, two full blocks.
    let (s, v, resp) = h.post("/v1/responses", body(json!("abcdefgh"), 4)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "response");
    // The chat routes' headers: the prompt's split and the response id.
    assert_eq!(
        resp.headers()["x-cachet-cache"],
        "local=0; external=0; computed=32; created=32"
    );
    assert_eq!(resp.headers()["x-request-id"], v["id"].as_str().unwrap());
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["status"], "incomplete");
    assert_eq!(
        v["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(v["store"], true);
    assert_eq!(v["output"].as_array().unwrap().len(), 1);
    let m = &v["output"][0];
    assert_eq!(
        (m["type"].as_str(), m["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(m["content"][0]["type"], "output_text");
    assert_eq!(text(&v).len(), 4);
    assert_eq!(usage(&v), (32, 0, 32, 4, 36));
    assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
    // The same request again: the lookup is capped at 31 tokens, so one block (16) is read.
    let (_, v2, _) = h
        .post(
            "/v1/responses",
            with(body(json!("abcdefgh"), 4), json!({"store": false})),
        )
        .await;
    assert_eq!(usage(&v2), (32, 16, 0, 4, 36));
    // Instructions are a system message first: "<|system|>\nbe brief\n" adds 11 + 8 + 1.
    let (_, v3, _) = h
        .post(
            "/v1/responses",
            with(
                body(json!("abcdefgh"), 2),
                json!({"instructions": "be brief", "store": false}),
            ),
        )
        .await;
    assert_eq!(usage(&v3).0, 52);
    assert_eq!(v3["instructions"], "be brief");
}

#[tokio::test]
async fn chat_completions_send_cache_write_tokens_beside_created_cache_tokens() {
    let h = start(Opts::default());
    let (s, v, _) = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let d = &v["usage"]["prompt_tokens_details"];
    assert_eq!(d["cache_write_tokens"], 32);
    assert_eq!(d["created_cache_tokens"], 32);
}

#[tokio::test]
async fn previous_response_id_continues_on_the_retained_kv() {
    let h = start(Opts::default());
    let (s, v1, _) = h.post("/v1/responses", body(json!("abcdefgh"), 4)).await;
    assert_eq!(s, 200, "{v1}");
    assert_eq!(usage(&v1), (32, 0, 32, 4, 36));
    let id1 = v1["id"].as_str().unwrap().to_string();
    let r1 = text(&v1);

    // Parked: 32 prompt + 3 generated tokens (the last sampled token has no KV) = 35.
    // Turn 2 prompt: 32 + 4 (reply) + 1 + 9 + 11 + 1 + 14 = 72 tokens; new = 72 - 35 = 37.
    // Newly full blocks: [32,48) holds 3 retained + 13 new, [48,64) 16 new: written 29.
    let (s, v2, _) = h
        .post(
            "/v1/responses",
            with(
                body(json!("hello world"), 4),
                json!({"previous_response_id": id1}),
            ),
        )
        .await;
    assert_eq!(s, 200, "{v2}");
    assert_eq!(usage(&v2), (72, 35, 29, 4, 76));
    assert_eq!(v2["previous_response_id"], id1.as_str());
    assert_eq!(
        v2["metrics"]["previous_response"],
        json!({"id": id1, "kv": "retained"})
    );
    assert_eq!(v2["metrics"]["session"]["retained_tokens"], 35);
    assert_eq!(v2["metrics"]["prefix_cache"]["computed_tokens"], 37);

    // The conversation as stored: turn 1's input, its output, turn 2's input.
    let id2 = v2["id"].as_str().unwrap();
    let (s, items) = req(
        &h,
        "GET",
        &format!("/v1/responses/{id2}/input_items?order=asc"),
        None,
        None,
    )
    .await;
    assert_eq!(s, 200, "{items}");
    let data = items["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(data[0]["content"][0]["text"], "abcdefgh");
    assert_eq!(data[1]["content"][0]["text"], r1.as_str());
    assert_eq!(data[2]["content"][0]["text"], "hello world");
    assert_eq!(items["has_more"], false);
    assert_eq!(items["first_id"], data[0]["id"]);

    // A fork from turn 1 again: the parked KV is turn 2's now, which this prompt does not
    // extend, so the turn starts afresh on the prefix cache. Prompt: 32 + 4 + 1 + 9 + 3 + 1
    // + 14 = 64; it shares 46 tokens with turn 2 (cached in full blocks: [0,32)), so 32 are
    // read and [32,48), [48,64) are written.
    let (s, v3, _) = h
        .post(
            "/v1/responses",
            with(body(json!("xyz"), 4), json!({"previous_response_id": id1})),
        )
        .await;
    assert_eq!(s, 200, "{v3}");
    assert_eq!(usage(&v3), (64, 32, 32, 4, 68));
    assert_eq!(
        v3["metrics"]["previous_response"],
        json!({"id": id1, "kv": "prefix_cache"})
    );

    // An unknown id: 404 naming the field, in OpenAI's shape.
    let (s, e, _) = h
        .post(
            "/v1/responses",
            with(
                body(json!("x"), 1),
                json!({"previous_response_id": "resp_nope"}),
            ),
        )
        .await;
    assert_eq!(s, 404);
    assert_eq!(e["error"]["param"], "previous_response_id");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(
        e["error"]["message"],
        "Previous response with id 'resp_nope' not found."
    );
}

#[tokio::test]
async fn the_stream_sends_every_event_in_order_with_sequence_numbers() {
    let h = start(Opts::default());
    let (s, events, _) = h
        .stream(
            "/v1/responses",
            with(body(json!("abcdefgh"), 3), json!({"stream": true})),
        )
        .await;
    assert_eq!(s, 200);
    let evs: Vec<Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    // The SSE event name is the type.
    for ((name, _), k) in events.iter().zip(&kinds) {
        assert_eq!(name.as_deref(), Some(*k));
    }
    let deltas = kinds
        .iter()
        .filter(|k| **k == "response.output_text.delta")
        .count();
    assert!((1..=3).contains(&deltas), "{kinds:?}");
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(kinds, want);
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64);
    }
    let streamed: String = evs
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(streamed.len(), 3);
    let last = &evs[evs.len() - 1]["response"];
    assert_eq!(usage(last), (32, 0, 32, 3, 35));
    assert_eq!(text(last), streamed);
    assert_eq!(evs[0]["response"]["status"], "in_progress");
    // Stored: GET returns the final object.
    let id = last["id"].as_str().unwrap();
    let (s, got) = req(&h, "GET", &format!("/v1/responses/{id}"), None, None).await;
    assert_eq!(s, 200);
    assert_eq!(&got, last);
}

fn weather() -> Value {
    json!({"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": false}})
}

#[tokio::test]
async fn function_tools_are_forced_by_grammar_and_hosted_tools_are_ignored() {
    let h = start(Opts::default());
    let tools = json!([
        weather(),
        {"type": "web_search"},
        {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "inner"}]},
        {"type": "custom", "name": "apply_patch"},
    ]);
    for choice in [
        json!("required"),
        json!({"type": "function", "name": "get_weather"}),
    ] {
        let b = with(
            body(json!("Weather in Paris?"), 300),
            json!({"tools": tools, "tool_choice": choice, "parallel_tool_calls": false, "temperature": 1.0}),
        );
        let (s, v, _) = h.post("/v1/responses", b.clone()).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["status"], "completed", "{v}");
        let out = v["output"].as_array().unwrap();
        assert_eq!(out.len(), 1, "{v}");
        assert_eq!(out[0]["type"], "function_call");
        assert_eq!(out[0]["name"], "get_weather");
        assert!(out[0]["call_id"].as_str().unwrap().starts_with("call_"));
        let args: Value = serde_json::from_str(out[0]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].as_str().unwrap().chars().count() <= 10);
        // The tools are echoed as sent.
        assert_eq!(v["tools"], tools);

        // Streamed: the call's events, the argument pieces adding up.
        let (_, events, _) = h
            .stream("/v1/responses", with(b, json!({"stream": true})))
            .await;
        let evs: Vec<Value> = events
            .iter()
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect();
        let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(kinds[2], "response.output_item.added");
        assert_eq!(evs[2]["item"]["type"], "function_call");
        assert_eq!(evs[2]["item"]["arguments"], "");
        let n = kinds.len();
        assert_eq!(
            kinds[n - 3..],
            [
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let pieces: String = evs
            .iter()
            .filter(|e| e["type"] == "response.function_call_arguments.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(pieces, evs[n - 3]["arguments"].as_str().unwrap());
        assert_eq!(
            evs[n - 1]["response"]["output"][0]["arguments"]
                .as_str()
                .unwrap(),
            pieces
        );
    }
    // The call and its output as the next input: the history renders, a plain answer follows.
    let (s, v, _) = h
        .post(
            "/v1/responses",
            with(
                body(
                    json!([
                        {"role": "user", "content": "Weather in Paris?"},
                        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                        {"type": "reasoning", "summary": []},
                    ]),
                    4,
                ),
                json!({"tools": [weather()]}),
            ),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["output"][0]["type"], "message");
}

#[tokio::test]
async fn text_format_json_schema_is_followed() {
    let h = start(Opts::default());
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
        "required": ["n"], "additionalProperties": false});
    for format in [
        json!({"type": "json_schema", "name": "N", "schema": schema, "strict": true}),
        json!({"type": "json_object"}),
    ] {
        let (s, v, _) = h
            .post(
                "/v1/responses",
                with(
                    body(json!("a number"), 200),
                    json!({"text": {"format": format}, "temperature": 1.0}),
                ),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["status"], "completed", "{v}");
        let parsed: Value = serde_json::from_str(&text(&v)).unwrap();
        assert!(parsed.is_object(), "{parsed}");
        if format["type"] == "json_schema" {
            assert!(parsed["n"].is_i64(), "{parsed}");
        }
        assert_eq!(v["text"]["format"], format);
    }
}

#[tokio::test]
async fn stored_responses_belong_to_their_key() {
    let h = start(Opts {
        api_key: Some("alice:sk-a,sk-b".into()),
        ..Opts::default()
    });
    let (s, v) = req(
        &h,
        "POST",
        "/v1/responses",
        Some("sk-a"),
        Some(body(json!("abcdefgh"), 2)),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let path = format!("/v1/responses/{id}");
    let (s, got) = req(&h, "GET", &path, Some("sk-a"), None).await;
    assert_eq!((s, &got), (StatusCode::OK, &v));
    // Another key: as if it did not exist, on every route.
    for (method, p) in [
        ("GET", path.clone()),
        ("DELETE", path.clone()),
        ("GET", format!("{path}/input_items")),
        ("POST", format!("{path}/cancel")),
    ] {
        let (s, e) = req(&h, method, &p, Some("sk-b"), None).await;
        assert_eq!(s, 404, "{method} {p}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(
            e["error"]["message"],
            format!("No response found with id '{id}'.")
        );
    }
    let (s, e) = req(
        &h,
        "POST",
        "/v1/responses",
        Some("sk-b"),
        Some(with(
            body(json!("x"), 1),
            json!({"previous_response_id": id}),
        )),
    )
    .await;
    assert_eq!(s, 404, "{e}");
    // store: false keeps nothing.
    let (_, v2) = req(
        &h,
        "POST",
        "/v1/responses",
        Some("sk-a"),
        Some(with(body(json!("x"), 1), json!({"store": false}))),
    )
    .await;
    let (s, _) = req(
        &h,
        "GET",
        &format!("/v1/responses/{}", v2["id"].as_str().unwrap()),
        Some("sk-a"),
        None,
    )
    .await;
    assert_eq!(s, 404);
    // Its owner deletes it; then it is gone.
    let (s, d) = req(&h, "DELETE", &path, Some("sk-a"), None).await;
    assert_eq!(s, 200);
    assert_eq!(
        d,
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    let (s, _) = req(&h, "GET", &path, Some("sk-a"), None).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn background_responses_run_detached_and_cancel() {
    let h = start(Opts {
        step_ms: 20,
        ..Opts::default()
    });
    // A long one, cancelled while it runs.
    let (s, v, _) = h
        .post(
            "/v1/responses",
            with(body(json!("abcdefgh"), 200), json!({"background": true})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "in_progress");
    assert_eq!(v["background"], true);
    let id = v["id"].as_str().unwrap().to_string();
    let (s, c) = req(
        &h,
        "POST",
        &format!("/v1/responses/{id}/cancel"),
        None,
        None,
    )
    .await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["status"], "cancelled");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (_, g) = req(&h, "GET", &format!("/v1/responses/{id}"), None, None).await;
    assert_eq!(g["status"], "cancelled");
    // The engine let it go: nothing runs.
    h.wait_metrics("no request running", |m| {
        m.val("vllm:num_requests_running") == 0
    })
    .await;

    // A short one, polled to its end.
    let (_, v, _) = h
        .post(
            "/v1/responses",
            with(body(json!("abcdefgh"), 3), json!({"background": true})),
        )
        .await;
    let id = v["id"].as_str().unwrap().to_string();
    let mut last = Value::Null;
    for _ in 0..200 {
        let (_, g) = req(&h, "GET", &format!("/v1/responses/{id}"), None, None).await;
        last = g;
        if last["status"] != "in_progress" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(last["status"], "incomplete", "{last}");
    // (What the cancelled run cached depends on how far it got.)
    let u = usage(&last);
    assert_eq!((u.0, u.3, u.4), (32, 3, 35), "{last}");
    // background needs store.
    let (s, e, _) = h
        .post(
            "/v1/responses",
            with(
                body(json!("x"), 1),
                json!({"background": true, "store": false}),
            ),
        )
        .await;
    assert_eq!(s, 400);
    assert_eq!(e["error"]["param"], "background");
}

#[tokio::test]
async fn fields_a_client_relies_on_are_refused_and_the_rest_accepted() {
    let h = start(Opts::default());
    // What Codex sends beside the input: accepted.
    let (s, v, _) = h
        .post(
            "/v1/responses",
            with(
                body(json!([{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]}, {"role": "user", "content": "hi"}]), 2),
                json!({
                    "store": false, "reasoning": {"effort": "medium", "summary": "auto"},
                    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k1",
                    "tool_choice": "auto", "parallel_tool_calls": true, "service_tier": "auto",
                    "metadata": {"a": "b"}, "user": "u1", "truncation": "disabled",
                }),
            ),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["prompt_cache_key"], "k1");
    assert_eq!(
        v["reasoning"],
        json!({"effort": "medium", "summary": "auto"})
    );
    assert_eq!(v["metadata"], json!({"a": "b"}));
    for (extra, param) in [
        (json!({"frobnicate": 1}), "frobnicate"),
        (json!({"conversation": "conv_1"}), "conversation"),
        (json!({"max_tool_calls": 2}), "max_tool_calls"),
        (json!({"truncation": "sometimes"}), "truncation"),
        (json!({"text": {"format": {"type": "yaml"}}}), "text"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input",
        ),
        (json!({"temperature": 3}), "temperature"),
    ] {
        let (s, e, _) = h
            .post("/v1/responses", with(body(json!("x"), 1), extra.clone()))
            .await;
        assert_eq!(s, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], param, "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    // truncation auto drops the oldest turns to fit: 6 turns of 100 bytes do not fit 300.
    let h = start(Opts {
        max_model_len: 300,
        ..Opts::default()
    });
    let long = "y".repeat(100);
    let turns: Vec<Value> = (0..6)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": long}))
        .collect();
    let (s, _, _) = h.post("/v1/responses", body(json!(turns), 4)).await;
    assert_eq!(s, 400);
    let (s, v, _) = h
        .post(
            "/v1/responses",
            with(body(json!(turns), 4), json!({"truncation": "auto"})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    // The input must leave one token of the 300: 299 at most. User turns are 9 + 101,
    // assistant turns 14 + 101, the generation prompt 14: all six are 689, the last three 354;
    // the last two, 110 + 115 + 14 = 239, are what fits.
    assert_eq!(usage(&v).0, 239, "{v}");

    // max_output_tokens sized for a 200k-token model is clamped to what the context leaves
    // (chat completions keep vLLM's 400): 300 - 32 = 268 tokens written.
    let (s, v, _) = h
        .post("/v1/responses", body(json!("abcdefgh"), 32_000))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "incomplete");
    assert_eq!(usage(&v), (32, 0, 32, 268, 300));
    assert_eq!(v["max_output_tokens"], 32_000);
}

#[tokio::test]
async fn reasoning_is_an_output_item_and_its_tokens_are_counted() {
    let h = start(Opts {
        reply: Some("<think>Two plus two.</think>It is 4.".into()),
        reasoning_parser: Some(cachet_text::ReasoningFormat::Qwen3),
        ..Opts::default()
    });
    let b = json!({"model": MODEL, "input": "What is 2 + 2?", "max_output_tokens": 64,
        "reasoning": {"effort": "low", "summary": null}});
    let (s, v, _) = h.post("/v1/responses", b.clone()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "completed", "{v}");
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 2, "{v}");
    assert_eq!(
        (out[0]["type"].as_str(), out[0]["status"].as_str()),
        (Some("reasoning"), Some("completed"))
    );
    assert_eq!(
        out[0]["content"],
        json!([{"type": "reasoning_text", "text": "Two plus two."}])
    );
    assert_eq!(out[0]["summary"], json!([]));
    assert_eq!(out[1]["content"][0]["text"], "It is 4.");
    // "<|user|>\nWhat is 2 + 2?\n<|assistant|>\n": 9 + 14 + 1 + 14 = 38 tokens. 36 scripted
    // tokens and EOS; the block's 28 (7 + 13 + 8, tags included) are reasoning.
    assert_eq!(usage(&v), (38, 0, 32, 37, 75));
    assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"], 28);
    assert_eq!(v["reasoning"], json!({"effort": "low", "summary": null}));

    // Streamed: the reasoning item's events, then the message's.
    let (_, events, _) = h
        .stream(
            "/v1/responses",
            with(b.clone(), json!({"stream": true, "store": false})),
        )
        .await;
    let evs: Vec<Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let reasoning: String = evs
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(reasoning, "Two plus two.");
    let added: Vec<&str> = evs
        .iter()
        .filter(|e| e["type"] == "response.output_item.added")
        .map(|e| e["item"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(added, ["reasoning", "message"]);
    let done = evs
        .iter()
        .find(|e| e["type"] == "response.reasoning_text.done")
        .unwrap();
    assert_eq!(
        (&done["text"], &done["output_index"]),
        (&json!("Two plus two."), &json!(0))
    );
    let last = &evs[evs.len() - 1];
    assert_eq!(last["type"], "response.completed");
    assert_eq!(
        last["response"]["usage"]["output_tokens_details"]["reasoning_tokens"],
        28
    );

    // Asked for a summary: the reasoning text is its summary too (no summarizer here).
    let (_, v, _) = h
        .post(
            "/v1/responses",
            with(b, json!({"reasoning": {"summary": "auto"}, "store": false})),
        )
        .await;
    assert_eq!(
        v["output"][0]["summary"],
        json!([{"type": "summary_text", "text": "Two plus two."}])
    );
}
