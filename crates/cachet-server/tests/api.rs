//! Every route and error path of the server, over the simulated engine.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};

fn chat_body(content: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn assert_openai_error(v: &Value) {
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

fn assert_anthropic_error(v: &Value, ty: &str) {
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], ty, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
}

#[tokio::test]
async fn health_models_tokenize_detokenize() {
    let h = start(Opts::default());
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
    let (s, body) = h.get("/v1/models").await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);

    let (s, v, _) = h.post("/tokenize", json!({"prompt": "hello world"})).await;
    assert_eq!(s, StatusCode::OK);
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert_eq!(v["count"].as_u64().unwrap() as usize, tokens.len());
    assert_eq!(v["max_model_len"], 1024);
    let (s, v2, _) = h
        .post(
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(v2["count"].as_u64().unwrap() > 0);
    let (s, _, _) = h.post("/tokenize", json!({})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    let plain: Vec<u32> = h.tokenizer.encode("hello world", false).unwrap();
    let (s, v, _) = h.post("/detokenize", json!({"tokens": plain})).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["prompt"], "hello world");
    let (s, _, _) = h.post("/detokenize", json!({"tokens": "x"})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn chat_non_streaming() {
    let h = start(Opts::default());
    let (s, v, resp) = h
        .post("/v1/chat/completions", chat_body("Tell me a story", 8))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"), "{id}");
    assert_eq!(resp.headers()["x-request-id"], id);
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], 8);
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + 8)
    );
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(u["prompt_tokens_details"]["created_cache_tokens"].is_u64());
    let m = &v["metrics"];
    for k in [
        "queue_time_ms",
        "time_to_first_token_ms",
        "generation_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
    ] {
        assert!(m[k].is_number(), "{k}: {m}");
    }
    let p = &m["prefix_cache"];
    for k in [
        "prompt_tokens",
        "local_cached_tokens",
        "external_cached_tokens",
        "cached_tokens",
        "computed_tokens",
        "cache_creation_tokens",
        "prefill_chunks",
        "blocks_allocated",
        "blocks_filled",
        "blocks_evicted",
        "preemptions",
        "prefill_time_ms",
        "queue_time_ms",
    ] {
        assert!(p[k].is_number(), "{k}: {p}");
    }
    assert_eq!(p["prompt_tokens"], u["prompt_tokens"]);
}

#[tokio::test]
async fn content_parts_and_chat_template_match_tokenize() {
    let h = start(Opts::default());
    let messages = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}
    ]);
    let (_, t, _) = h.post("/tokenize", json!({"messages": messages})).await;
    let (s, v, _) = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], t["count"]);
    let (s, v, _) = h
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "max_tokens": 2}))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v);
}

#[tokio::test]
async fn chat_streaming_with_usage() {
    let h = start(Opts::default());
    let mut body = chat_body("Stream please", 6);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (s, events, resp) = h.stream("/v1/chat/completions", body).await;
    assert_eq!(s, StatusCode::OK);
    // Declared UTF-8, as OpenAI and vLLM do (a client going by the header would otherwise
    // read the bytes as Latin-1: see `generate::utf8_event_stream`).
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].as_str().unwrap().to_string();
    assert_eq!(resp.headers()["x-request-id"], id.as_str());
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id.as_str());
    }
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 6);
    assert!(usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert!(usage_chunk["metrics"]["prefix_cache"].is_object());
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    for c in &chunks[..chunks.len() - 1] {
        assert!(c["usage"].is_null());
    }

    // Without include_usage: no usage chunk; metrics ride on the last chunk.
    let mut body = chat_body("Stream please", 3);
    body["stream"] = json!(true);
    let (_, events, _) = h.stream("/v1/chat/completions", body).await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert!(chunks.last().unwrap()["metrics"].is_object());
}

#[tokio::test]
async fn completions_string_tokens_and_streaming() {
    let h = start(Opts::default());
    let (s, v, resp) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 5, "ignore_eos": true}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(resp.headers()["x-request-id"], v["id"].as_str().unwrap());
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        h.tokenize_prompt("Once upon").await
    );

    let ids = h.tokenizer.encode("token prompt", true).unwrap();
    let (s, v, _) = h
        .post("/v1/completions", json!({"prompt": ids, "max_tokens": 2}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        ids.len()
    );
    let (s, _, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": ["one prompt"], "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": ["a", "b"], "max_tokens": 2}),
        )
        .await;
    // Several prompts: one choice each, in order.
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][1]["index"], 1);
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": [[1, 2], [3, 4]], "max_tokens": 2, "stream": true}),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["param"], "prompt");
    let (s, _, _) = h
        .post("/v1/completions", json!({"prompt": [], "max_tokens": 2}))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    let (s, events, _) = h
        .stream("/v1/completions", json!({"prompt": "Once upon", "max_tokens": 4, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn logprobs_chat_and_completions() {
    let h = start(Opts::default());
    let mut body = chat_body("logprobs", 3);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let (s, v, _) = h.post("/v1/chat/completions", body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    assert!(content[0]["logprob"].is_number());
    assert!(content[0]["top_logprobs"].is_array());
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "abc", "max_tokens": 3, "logprobs": 1, "ignore_eos": true}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    let mut body = chat_body("x", 2);
    body["top_logprobs"] = json!(2);
    let (s, _, _) = h.post("/v1/chat/completions", body).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, v, _) = h.post("/v1/chat/completions", chat_body("x", 2)).await;
    assert_eq!(s, StatusCode::OK);
    assert!(v["choices"][0]["logprobs"].is_null());
}

/// Greedy text of a prompt, with EOS ignored.
async fn greedy_text(h: &Harness, prompt: &str, max_tokens: u32) -> String {
    let (s, v, _) = h.post("/v1/completions", json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// A stop string taken from the middle of the greedy text, and the byte offset where it first
/// occurs in it (where a stop ends the text).
fn pick_stop(text: &str) -> (String, usize) {
    let chars: Vec<char> = text.chars().collect();
    assert!(
        chars.len() >= 16,
        "greedy text too short to pick a stop string: {text:?}"
    );
    let stop: String = chars[8..11].iter().collect();
    let cut = text.find(&stop).unwrap();
    (stop, cut)
}

#[tokio::test]
async fn stop_strings_non_streaming_and_streaming() {
    let h = start(Opts::default());
    let prompt = "The stop string test prompt";
    let full = greedy_text(&h, prompt, 40).await;
    let (stop, cut) = pick_stop(&full);
    let expected = &full[..cut];

    let (s, v, _) = h
        .post("/v1/completions", json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true, "stop": stop}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], expected);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], stop.as_str());
    // One byte, one token: the request ended at the token that completed the stop string
    // (the engine checks it), not a step later.
    let through_stop = (expected.len() + stop.len()) as u64;
    assert_eq!(v["usage"]["completion_tokens"], through_stop, "{v}");

    // Streaming: the concatenation equals the non-streaming text and no chunk leaks the stop.
    let (_, events, _) = h
        .stream(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true, "stop": ["zzzz-never", stop], "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    let mut text = String::new();
    let mut finish = Value::Null;
    // The last event is `[DONE]`, the one before it the usage chunk (no choices).
    for (_, d) in &events[..events.len() - 2] {
        let c: Value = serde_json::from_str(d).unwrap();
        let piece = c["choices"][0]["text"].as_str().unwrap();
        assert!(!piece.contains(&stop));
        text.push_str(piece);
        if !c["choices"][0]["finish_reason"].is_null() {
            finish = c["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(text, expected);
    assert_eq!(finish, "stop");
    assert_eq!(events[events.len() - 1].1, "[DONE]");
    let usage: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], through_stop, "{usage}");

    // Anthropic stop_sequences.
    let (_, chat_full, _) = h.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, "ignore_eos": true})).await;
    let chat_text = chat_full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let (stop, cut) = pick_stop(&chat_text);
    let expected = &chat_text[..cut];
    let (s, v, _) = h
        .post("/v1/messages", json!({"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": prompt}], "stop_sequences": [stop]}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], stop.as_str());
    assert_eq!(v["content"][0]["text"], expected);
    assert_eq!(
        v["usage"]["output_tokens"],
        (expected.len() + stop.len()) as u64,
        "{v}"
    );

    // The engine finished the request: nothing left running.
    h.wait_metrics("no running requests", |m| {
        m.val("vllm:num_requests_running") == 0
    })
    .await;
}

/// A completion streamed with usage: its chunks' text joined, and the usage chunk's `usage`.
async fn streamed_text(h: &Harness, mut body: Value) -> (String, Value) {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (_, events, _) = h.stream("/v1/completions", body).await;
    // The last event is `[DONE]`, the one before it the usage chunk (no choices).
    let mut text = String::new();
    for (_, d) in &events[..events.len() - 2] {
        let c: Value = serde_json::from_str(d).unwrap();
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    let usage: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    (text, usage["usage"].clone())
}

#[tokio::test]
async fn min_tokens_holds_back_stop_strings() {
    // One byte, one token. A stop string may end the request only at a token after the
    // first `min_tokens` (vLLM's rule): with a one-character stop at byte p1 (token p1 + 1)
    // and again at p2, min_tokens p1 + 1 cuts at p2, min_tokens p1 still at p1.
    let h = start(Opts::default());
    let prompt = "The min tokens test prompt";
    let full = greedy_text(&h, prompt, 40).await;
    let b = full.as_bytes();
    let (p1, p2) = (0..b.len())
        .filter(|&i| b[i].is_ascii_graphic())
        .find_map(|i| {
            let j = b[i + 1..].iter().position(|&c| c == b[i])? + i + 1;
            (!b[..i].contains(&b[i])).then_some((i, j))
        })
        .unwrap_or_else(|| panic!("no repeated character in {full:?}"));
    let stop = (b[p1] as char).to_string();
    for (min_tokens, cut) in [(p1 + 1, p2), (p1, p1), (0, p1)] {
        let body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true, "stop": stop, "min_tokens": min_tokens});
        let (s, v, _) = h.post("/v1/completions", body.clone()).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(
            v["choices"][0]["text"],
            &full[..cut],
            "min_tokens {min_tokens}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["completion_tokens"], cut as u64 + 1, "{v}");
        let (text, usage) = streamed_text(&h, body).await;
        assert_eq!(text, &full[..cut], "streamed, min_tokens {min_tokens}");
        assert_eq!(usage["completion_tokens"], cut as u64 + 1);
    }
    // Never again after the minimum: the whole text, to max_tokens.
    let (s, v, _) = h
        .post("/v1/completions", json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true, "stop": stop, "min_tokens": p2 + 1}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let later = full[p2 + 1..].find(&stop).map(|k| k + p2 + 1);
    match later {
        Some(p3) => assert_eq!(v["choices"][0]["text"], &full[..p3]),
        None => {
            assert_eq!(v["choices"][0]["text"], full.as_str());
            assert_eq!(v["choices"][0]["finish_reason"], "length");
        }
    }
}

#[tokio::test]
async fn include_stop_str_in_output_keeps_what_ended_the_text() {
    // One byte, one token (byte b is token b + 3). A stop string first found at `cut` ends the
    // text at `cut`, or through the stop string when kept; a stop token at the first
    // occurrence `q` of its byte ends it at `q`, or at `q + 1` when kept. The engine ends the
    // request at the same token either way, so the usage does not change.
    let h = start(Opts::default());
    let prompt = "The include stop test prompt";
    let full = greedy_text(&h, prompt, 40).await;
    let (stop, cut) = pick_stop(&full);
    let q_byte = full.as_bytes()[cut];
    assert!(q_byte.is_ascii(), "{full:?}");
    let q = full.find(q_byte as char).unwrap();
    let stop_id = q_byte as u32 + 3;
    for include in [false, true] {
        let cases = [
            (
                json!({"stop": stop}),
                if include { cut + stop.len() } else { cut },
                cut + stop.len(),
                json!(stop),
            ),
            (
                json!({"stop_token_ids": [stop_id]}),
                if include { q + 1 } else { q },
                q + 1,
                json!(stop_id),
            ),
        ];
        for (extra, text_len, tokens, reason) in cases {
            let mut body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true, "include_stop_str_in_output": include});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (s, v, _) = h.post("/v1/completions", body.clone()).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            let c = &v["choices"][0];
            assert_eq!(c["text"], &full[..text_len], "{body}");
            assert_eq!(c["finish_reason"], "stop", "{body}");
            assert_eq!(c["stop_reason"], reason, "{body}");
            assert_eq!(v["usage"]["completion_tokens"], tokens as u64, "{body}");
            let (text, _) = streamed_text(&h, body.clone()).await;
            assert_eq!(text, &full[..text_len], "streamed {body}");
        }
    }
    // Chat takes it too.
    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let (_, v, _) = h.post("/v1/chat/completions", chat.clone()).await;
    let full = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let (stop, cut) = pick_stop(&full);
    let mut body = chat;
    body["stop"] = json!(stop);
    body["include_stop_str_in_output"] = json!(true);
    let (s, v, _) = h.post("/v1/chat/completions", body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        &full[..cut + stop.len()]
    );
    assert_eq!(v["choices"][0]["stop_reason"], json!(stop));
}

#[tokio::test]
async fn anthropic_non_streaming_usage() {
    let h = start(Opts::default());
    let body = json!({
        "model": MODEL, "max_tokens": 5, "system": [{"type": "text", "text": "be nice", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "A long enough prompt to fill a couple of KV blocks, at least.", "cache_control": {"type": "ephemeral"}}]}],
        "metadata": {"user_id": "u1"}, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
    });
    let (_, t, _) = h
        .post("/tokenize", json!({"messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "A long enough prompt to fill a couple of KV blocks, at least."}]}))
        .await;
    let n = t["count"].as_u64().unwrap();
    let mut reads = Vec::new();
    for _ in 0..2 {
        let (s, v, resp) = h.post("/v1/messages", body.clone()).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["type"], "message");
        assert_eq!(v["role"], "assistant");
        assert!(v["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(resp.headers()["x-request-id"], v["id"].as_str().unwrap());
        assert_eq!(v["content"][0]["type"], "text");
        assert!(["end_turn", "max_tokens"].contains(&v["stop_reason"].as_str().unwrap()));
        let u = &v["usage"];
        let (i, r, c) = (
            u["input_tokens"].as_u64().unwrap(),
            u["cache_read_input_tokens"].as_u64().unwrap(),
            u["cache_creation_input_tokens"].as_u64().unwrap(),
        );
        assert_eq!(i + r + c, n, "{u}");
        assert_eq!(
            r,
            v["metrics"]["prefix_cache"]["cached_tokens"]
                .as_u64()
                .unwrap()
        );
        assert_eq!(
            c,
            v["metrics"]["prefix_cache"]["cache_creation_tokens"]
                .as_u64()
                .unwrap()
        );
        reads.push(r);
    }
    assert_eq!(reads[0], 0);
    assert_eq!(reads[1] as usize, (n as usize - 1) / BLOCK * BLOCK);
}

#[tokio::test]
async fn anthropic_streaming_event_sequence() {
    let h = start(Opts::default());
    let body = json!({"model": MODEL, "max_tokens": 6, "stream": true, "messages": [{"role": "user", "content": "stream it"}]});
    let (s, events, resp) = h.stream("/v1/messages", body).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream; charset=utf-8"
    );
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_deref().unwrap()).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(names[3..names.len() - 3]
        .iter()
        .all(|n| *n == "content_block_delta"));
    for (e, d) in &events {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["type"], e.as_deref().unwrap());
    }
    let start: Value = serde_json::from_str(&events[0].1).unwrap();
    assert_eq!(
        resp.headers()["x-request-id"],
        start["message"]["id"].as_str().unwrap()
    );
    let su = &start["message"]["usage"];
    let delta: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    let du = &delta["usage"];
    assert_eq!(su["input_tokens"], du["input_tokens"]);
    assert_eq!(su["cache_read_input_tokens"], du["cache_read_input_tokens"]);
    assert_eq!(
        su["cache_creation_input_tokens"],
        du["cache_creation_input_tokens"]
    );
    assert!(du["output_tokens"].as_u64().unwrap() >= 1);
    assert!(delta["delta"]["stop_reason"].is_string());
    assert!(delta["metrics"]["prefix_cache"].is_object());
    let text: String = events
        .iter()
        .filter(|(e, _)| e.as_deref() == Some("content_block_delta"))
        .map(|(_, d)| {
            serde_json::from_str::<Value>(d).unwrap()["delta"]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let _ = text;
}

#[tokio::test]
async fn per_request_metrics_absent_without_flag() {
    let h = start(Opts {
        per_request_metrics: false,
        ..Opts::default()
    });
    let (_, v, _) = h
        .post("/v1/chat/completions", chat_body("no metrics", 2))
        .await;
    assert!(v.get("metrics").is_none(), "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut b = chat_body("no metrics", 2);
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let (_, events, _) = h.stream("/v1/chat/completions", b).await;
    assert!(events.iter().all(|(_, d)| !d.contains("\"metrics\"")));
    let (_, v, _) = h
        .post(
            "/v1/messages",
            json!({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert!(v.get("metrics").is_none());
    let (_, v, _) = h
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert!(v.get("metrics").is_none());
}

#[tokio::test]
async fn openai_error_paths() {
    let h = start(Opts {
        max_model_len: 128,
        ..Opts::default()
    });
    let cases: Vec<(Value, StatusCode, Option<&str>)> = vec![
        (json!({"messages": "nope"}), StatusCode::BAD_REQUEST, None),
        (
            json!({"model": MODEL}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            json!({"messages": []}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x".repeat(400)}]}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}),
            StatusCode::BAD_REQUEST,
            Some("max_completion_tokens"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}),
            StatusCode::BAD_REQUEST,
            Some("top_p"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_k": -5}),
            StatusCode::BAD_REQUEST,
            Some("top_k"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "min_p": 2}),
            StatusCode::BAD_REQUEST,
            Some("min_p"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 9}),
            StatusCode::BAD_REQUEST,
            Some("presence_penalty"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}),
            StatusCode::BAD_REQUEST,
            Some("repetition_penalty"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 0}),
            StatusCode::BAD_REQUEST,
            Some("n"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}),
            StatusCode::BAD_REQUEST,
            Some("cache_salt"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
            StatusCode::BAD_REQUEST,
            None,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}),
            StatusCode::BAD_REQUEST,
            None,
        ),
    ];
    for (body, status, param) in cases {
        let (s, v, _) = h.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(s, status, "{body} -> {v}");
        assert_openai_error(&v);
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{body} -> {v}");
        }
        if status == StatusCode::NOT_FOUND {
            assert_eq!(v["error"]["code"], "model_not_found");
        }
    }
    // Too long for the context: `context_length_exceeded`, naming the prompt's own field.
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x".repeat(400)}]}),
            "messages",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x".repeat(400)}),
            "prompt",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 500}),
            "prompt",
        ),
    ] {
        let (s, v, _) = h.post(path, body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} -> {v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        assert_eq!(v["error"]["param"], param, "{path} {body} -> {v}");
    }
    let (s, v) = h.post_raw("/v1/chat/completions", "{\"messages\": [").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v);
    let (s, v) = h.post_raw("/v1/completions", "not json").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v);
    let (s, v) = h.post_raw("/v1/completions", "[1]").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v);
    // A valid cache_salt is accepted.
    let (s, _, _) = h.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "cache_salt": "tenant-a", "user": "u", "priority": 1, "seed": 7})).await;
    assert_eq!(s, StatusCode::OK);
    // Unknown route: JSON 404.
    let (s, v, _) = h.post("/v1/nope", json!({})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_openai_error(&v);
}

#[tokio::test]
async fn anthropic_error_paths() {
    let h = start(Opts {
        max_model_len: 128,
        ..Opts::default()
    });
    let cases: Vec<(Value, StatusCode, &str)> = vec![
        (
            json!({"messages": [{"role": "user", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 4, "messages": []}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 4, "temperature": -1, "messages": [{"role": "user", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": "x".repeat(300)}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
            StatusCode::NOT_FOUND,
            "not_found_error",
        ),
    ];
    for (body, status, ty) in cases {
        let (s, v, _) = h.post("/v1/messages", body.clone()).await;
        assert_eq!(s, status, "{body} -> {v}");
        assert_anthropic_error(&v, ty);
    }
    let (s, v) = h.post_raw("/v1/messages", "{oops").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_anthropic_error(&v, "invalid_request_error");
}

#[tokio::test]
async fn body_limit_is_413() {
    let h = start(Opts {
        max_body_bytes: 1024,
        ..Opts::default()
    });
    let big = json!({"messages": [{"role": "user", "content": "y".repeat(4096)}]});
    let (s, v, _) = h.post("/v1/chat/completions", big.clone()).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_openai_error(&v);
    let (s, v, _) = h.post("/v1/messages", big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_anthropic_error(&v, "request_too_large");
}

#[tokio::test]
async fn api_key_auth() {
    let h = start(Opts {
        api_key: Some("sekret".into()),
        ..Opts::default()
    });
    let (s, v, resp) = h.post("/v1/chat/completions", chat_body("x", 1)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_openai_error(&v);
    assert!(resp.headers().contains_key("www-authenticate"));
    let (s, v, _) = h
        .post_with(
            "/v1/chat/completions",
            chat_body("x", 1),
            &[("authorization", "Bearer wrong")],
        )
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    let (s, _, _) = h
        .post_with(
            "/v1/chat/completions",
            chat_body("x", 1),
            &[("authorization", "Bearer sekret")],
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let msg = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]});
    let (s, v, _) = h.post("/v1/messages", msg.clone()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_anthropic_error(&v, "authentication_error");
    let (s, _, _) = h
        .post_with("/v1/messages", msg, &[("x-api-key", "sekret")])
        .await;
    assert_eq!(s, StatusCode::OK);
    let resp = h
        .send(Request::get("/v1/models").body(Body::empty()).unwrap())
        .await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
    assert_eq!(h.get("/metrics").await.0, StatusCode::OK);
}

#[tokio::test]
async fn request_id_header_is_honoured_and_unique() {
    let h = start(Opts {
        step_ms: 5,
        ..Opts::default()
    });
    let (s, v, resp) = h
        .post_with(
            "/v1/chat/completions",
            chat_body("x", 2),
            &[("x-request-id", "my-req-1")],
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["id"], "my-req-1");
    assert_eq!(resp.headers()["x-request-id"], "my-req-1");

    // The header is a label: a second live request with the same value works and echoes it.
    let mut body = chat_body("long one", 200);
    body["stream"] = json!(true);
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("x-request-id", "dup-id")
        .body(Body::from(body.to_string()))
        .unwrap();
    let live = h.send(req).await;
    assert_eq!(live.headers()["x-request-id"], "dup-id");
    let mut live_body = live.into_body();
    let _ = live_body.frame().await;
    let (s, v, resp) = h
        .post_with(
            "/v1/chat/completions",
            chat_body("x", 2),
            &[("x-request-id", "dup-id")],
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["id"], "dup-id");
    assert_eq!(resp.headers()["x-request-id"], "dup-id");
    drop(live_body);

    // Errors echo the caller's id too.
    let (_, _, resp) = h
        .post_with(
            "/v1/chat/completions",
            json!({}),
            &[("x-request-id", "bad-1")],
        )
        .await;
    assert_eq!(resp.headers()["x-request-id"], "bad-1");
}

/// The race the engine used to lose: A's final output is delivered, B with the same
/// `X-Request-Id` is admitted, then A's client disconnects. B must run to its end: the engine
/// addresses requests by its own handles, never by the client's label.
#[tokio::test]
async fn a_late_disconnect_never_aborts_a_new_request_with_the_same_id() {
    let h = start(Opts {
        step_ms: 2,
        ..Opts::default()
    });
    let stream_req = |max_tokens: u32| {
        let mut body = chat_body("same id", max_tokens);
        body["stream"] = json!(true);
        Request::post("/v1/chat/completions")
            .header("content-type", "application/json")
            .header("x-request-id", "race")
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    // A: read frames until its final chunk arrived, but keep the connection (body) open.
    let mut a = h.send(stream_req(3)).await.into_body();
    let mut seen = String::new();
    while !seen.contains("finish_reason\":\"length") {
        let f = a.frame().await.expect("frame").expect("ok");
        if let Ok(d) = f.into_data() {
            seen.push_str(&String::from_utf8_lossy(&d));
        }
    }
    // B with the same id is admitted while A's connection is still open.
    let mut b = h.send(stream_req(40)).await.into_body();
    let _ = b.frame().await;
    // A's client goes away now.
    drop(a);
    let mut text = String::new();
    while let Some(f) = b.frame().await {
        if let Ok(d) = f.expect("ok").into_data() {
            text.push_str(&String::from_utf8_lossy(&d));
        }
    }
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    let m = h.scrape().await;
    assert_eq!(
        m.get(
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        0.0
    );
    assert_eq!(
        m.get(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        2.0
    );
}

#[tokio::test]
async fn client_disconnect_aborts_the_request() {
    let h = start(Opts {
        step_ms: 5,
        ..Opts::default()
    });
    let mut body = chat_body("a request the client abandons", 500);
    body["max_tokens"] = json!(400);
    body["stream"] = json!(true);
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = h.send(req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut b = resp.into_body();
    let mut seen = 0;
    while seen < 3 {
        let f = b.frame().await.expect("stream open").unwrap();
        if f.is_data() {
            seen += 1;
        }
    }
    h.wait_metrics("a running request", |m| {
        m.val("vllm:num_requests_running") == 1
    })
    .await;
    drop(b);
    let m = h
        .wait_metrics("the abort", |m| {
            m.get(
                "vllm:request_success_total",
                &[("finished_reason", "abort")],
            ) == 1.0
                && m.val("vllm:num_requests_running") == 0
                && m.get("vllm:kv_cache_usage_perc", &[]) == 0.0
        })
        .await;
    assert_eq!(
        m.get("vllm:request_success_total", &[("finished_reason", "stop")]),
        0.0
    );
    assert_eq!(
        m.get(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        0.0
    );
    assert!(m.val("vllm:prefix_cache_queries_total") > 0);
    assert_eq!(m.val("vllm:num_requests_waiting"), 0);
}

#[tokio::test]
async fn full_queue_is_503_with_retry_after() {
    let h = start(Opts {
        step_ms: 20,
        max_waiting_requests: 1,
        max_num_seqs: 1,
        ..Opts::default()
    });
    let mut body = chat_body("occupy", 300);
    body["stream"] = json!(true);
    let mut held = Vec::new();
    let mut saw_503 = false;
    for _ in 0..6 {
        let req = Request::post("/v1/chat/completions")
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = h.send(req).await;
        if resp.status() == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(resp.headers()["retry-after"], "1");
            let v: Value =
                serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes())
                    .unwrap();
            assert_openai_error(&v);
            saw_503 = true;
            break;
        }
        held.push(resp.into_body());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(saw_503, "the queue never filled up");
    drop(held);
    h.wait_metrics("all aborted", |m| {
        m.val("vllm:num_requests_running") == 0 && m.val("vllm:num_requests_waiting") == 0
    })
    .await;
}

#[tokio::test]
async fn odd_inputs_never_panic() {
    let h = start(Opts {
        max_model_len: 256,
        ..Opts::default()
    });
    let bodies = [
        json!(null),
        json!({}),
        json!({"messages": null, "prompt": null}),
        json!({"messages": [{}], "prompt": {}, "max_tokens": 1e30}),
        json!({"messages": [{"role": 5, "content": []}], "prompt": [-1]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text"}]}], "prompt": [[]], "max_tokens": 1}),
        json!({"messages": [{"role": "user", "content": "\u{0}\u{fffd}é😀"}], "prompt": "😀", "max_tokens": 1, "stop": [""]}),
        json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 2, "stop": 5}),
        json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 2, "stop_token_ids": [-1]}),
        json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 2, "temperature": 1e39}),
        json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 4294967296u64}),
        json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 2, "seed": -1, "top_k": 9223372036854775807i64}),
        json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 2, "logprobs": 99, "top_logprobs": 99}),
        json!({"messages": [{"role": "user", "content": "x"}], "prompt": [4294967295u64], "max_tokens": 2, "stream": "yes"}),
        json!({"system": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 2}),
        json!({"tokens": [1, 2, -3]}),
        json!({"tokens": [4294967295u64]}),
    ];
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/tokenize",
        "/detokenize",
    ] {
        for b in &bodies {
            let (s, v, _) = h.post(path, b.clone()).await;
            assert!(
                s.is_success() || s.is_client_error(),
                "{path} {b} -> {s} {v}"
            );
            if s.is_client_error() {
                assert!(v.get("error").is_some(), "{path} {b} -> {v}");
            }
        }
        let (s, _) = h.post_raw(path, "\u{1}\u{2}").await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
    }
    let resp = h
        .send(
            Request::get("/v1/chat/completions")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    // The engine is still healthy.
    let (s, _, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "still alive", "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn served_model_names() {
    let h = start(Opts {
        served_model_names: vec!["alias-a".into(), "alias-b".into()],
        ..Opts::default()
    });
    let (_, body) = h.get("/v1/models").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alias-a", "alias-b"]);
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"model": "alias-b", "prompt": "x", "max_tokens": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["model"], "alias-b");
    let (s, v, _) = h
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 1}))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["model"], "alias-a");
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
}
