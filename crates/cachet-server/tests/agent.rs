//! The agent API through the router on the simulated executor: grammar-forced tool calls and
//! structured outputs (the simulator writes random text, so every valid answer here is the
//! grammar's), streaming tool-call deltas, Anthropic tool_use, and the README's field tables.

mod common;

use common::{start, Opts};
use serde_json::{json, Value};

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": false}}})
}

fn chat(extra: Value) -> Value {
    let mut b =
        json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 300});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test]
async fn required_and_named_tool_choice_force_a_valid_call() {
    let h = start(Opts::default());
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        for seed in 0..4 {
            let (s, v, _) = h
                .post("/v1/chat/completions", chat(json!({"tools": [weather()], "tool_choice": choice, "seed": seed, "temperature": 1.0})))
                .await;
            assert_eq!(s, 200, "{v}");
            let c = &v["choices"][0];
            assert_eq!(c["finish_reason"], "tool_calls", "{v}");
            assert_eq!(c["message"]["content"], Value::Null);
            let calls = c["message"]["tool_calls"].as_array().unwrap();
            assert!(!calls.is_empty());
            for call in calls {
                assert_eq!(call["type"], "function");
                assert_eq!(call["function"]["name"], "get_weather");
                let args: Value =
                    serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
                let city = args["city"].as_str().unwrap();
                assert!(city.chars().count() <= 10, "{city}");
                assert_eq!(args.as_object().unwrap().len(), 1);
            }
        }
    }
    // Without a forced choice the simulator writes text: no call, the content as it came.
    let (_, v, _) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"tools": [weather()], "max_tokens": 8})),
        )
        .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null());
    // tool_choice none: never parsed.
    let (s, _, _) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"tools": [weather()], "tool_choice": "none", "max_tokens": 4})),
        )
        .await;
    assert_eq!(s, 200);
    // A named function that is not among the tools, and required without tools: 400.
    for bad in [
        json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "x"}}}),
        json!({"tool_choice": "required"}),
    ] {
        let (s, v, _) = h.post("/v1/chat/completions", chat(bad)).await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["error"]["param"], "tool_choice");
    }
}

#[tokio::test]
async fn streamed_tool_calls_carry_index_id_name_then_argument_pieces() {
    let h = start(Opts::default());
    let body = chat(
        json!({"tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false, "stream": true}),
    );
    let (s, events, _) = h.stream("/v1/chat/completions", body).await;
    assert_eq!(s, 200);
    let mut first = None;
    let mut args = String::new();
    let mut pieces = 0;
    let mut finish = None;
    for (_, data) in &events {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        let c = &v["choices"][0];
        if let Some(tcs) = c["delta"]["tool_calls"].as_array() {
            for tc in tcs {
                assert_eq!(tc["index"], 0);
                if tc.get("id").is_some() {
                    assert!(first.is_none(), "one start per call");
                    assert_eq!(tc["function"]["name"], "get_weather");
                    assert_eq!(tc["function"]["arguments"], "");
                    first = Some(tc["id"].as_str().unwrap().to_string());
                } else {
                    args.push_str(tc["function"]["arguments"].as_str().unwrap());
                    pieces += 1;
                }
            }
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert!(first.unwrap().starts_with("call_"));
    assert!(pieces > 1);
    let parsed: Value = serde_json::from_str(&args).unwrap();
    assert!(parsed["city"].is_string());
    assert_eq!(finish.as_deref(), Some("tool_calls"));
}

#[tokio::test]
async fn response_formats_and_guided_fields_are_enforced() {
    let h = start(Opts::default());
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}}, "required": ["n", "ok", "tag"], "additionalProperties": false});
    let (s, v, _) = h
        .post("/v1/chat/completions", chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}})))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let out: Value =
        serde_json::from_str(v["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert!(out["n"].is_i64() && out["ok"].is_boolean());
    assert!(out["tag"] == "a" || out["tag"] == "b");
    let (_, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "Pick:", "guided_choice": ["yes", "no"], "max_tokens": 10}),
        )
        .await;
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(t == "yes" || t == "no", "{t}");
    let (_, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "Digits:", "guided_regex": "[0-9]{4}", "max_tokens": 10}),
        )
        .await;
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(t.len() == 4 && t.bytes().all(|b| b.is_ascii_digit()), "{t}");
    // n = 4 under one schema, sampled: every choice follows the schema on its own (each
    // sequence has its own copy of the grammar from the first token).
    let (s, v, _) = h
        .post("/v1/chat/completions", chat(json!({"n": 4, "temperature": 1.0, "seed": 11, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}})))
        .await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for c in choices {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let text = c["message"]["content"].as_str().unwrap();
        let out: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(out["n"].is_i64() && out["ok"].is_boolean(), "{out}");
        assert!(out["tag"] == "a" || out["tag"] == "b", "{out}");
    }
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "Digits:", "guided_regex": "[0-9]{4}", "max_tokens": 10, "n": 3, "temperature": 1.0}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let mut texts: Vec<&str> = Vec::new();
    for c in v["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        assert!(t.len() == 4 && t.bytes().all(|b| b.is_ascii_digit()), "{t}");
        texts.push(t);
    }
    // Independent draws (the simulator's first draws differ by sequence).
    texts.sort();
    texts.dedup();
    assert_eq!(texts.len(), 3, "{v}");
    // Unsupported feature: 400 naming it.
    let (s, v, _) = h
        .post("/v1/chat/completions", chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}})))
        .await;
    assert_eq!(s, 400);
    assert_eq!(v["error"]["param"], "response_format");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("if"),
        "{v}"
    );
}

#[tokio::test]
async fn anthropic_any_tool_choice_gives_tool_use_blocks() {
    let h = start(Opts::default());
    let body = json!({"max_tokens": 300, "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"name": "get_weather", "input_schema": weather()["function"]["parameters"]}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true}});
    let (s, v, _) = h.post("/v1/messages", body.clone()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use");
    let blocks = v["content"].as_array().unwrap();
    assert_eq!(blocks.len(), 1, "{v}");
    assert_eq!(blocks[0]["type"], "tool_use");
    assert!(blocks[0]["id"].as_str().unwrap().starts_with("toolu_"));
    assert!(blocks[0]["input"]["city"].is_string());
    let mut sb = body;
    sb["stream"] = json!(true);
    let (_, events, _) = h.stream("/v1/messages", sb).await;
    let names: Vec<&str> = events.iter().filter_map(|(e, _)| e.as_deref()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    let mut json_text = String::new();
    for (e, d) in &events {
        let v: Value = serde_json::from_str(d).unwrap_or(Value::Null);
        if e.as_deref() == Some("content_block_start") {
            assert_eq!(v["content_block"]["type"], "tool_use");
        }
        if v["delta"]["type"] == "input_json_delta" {
            json_text.push_str(v["delta"]["partial_json"].as_str().unwrap());
        }
        if e.as_deref() == Some("message_delta") {
            assert_eq!(v["delta"]["stop_reason"], "tool_use");
        }
    }
    let input: Value = serde_json::from_str(&json_text).unwrap();
    assert!(input["city"].is_string());
}

#[test]
fn readme_field_tables_are_generated_from_the_declarations() {
    use cachet_server::fields::{markdown_table, Route};
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    let mut readme = std::fs::read_to_string(path).unwrap();
    // CACHET_REGEN_README=1 writes the tables (then this test checks them).
    if std::env::var_os("CACHET_REGEN_README").is_some() {
        for (name, route) in [
            ("chat", Route::Chat),
            ("completions", Route::Completions),
            ("messages", Route::Messages),
            ("responses", Route::Responses),
        ] {
            let start = format!("<!-- fields:{name} -->\n");
            let end = format!("<!-- /fields:{name} -->");
            let a = readme.find(&start).unwrap() + start.len();
            let b = readme[a..].find(&end).unwrap() + a;
            readme.replace_range(a..b, &markdown_table(route));
        }
        std::fs::write(path, &readme).unwrap();
    }
    for (name, route) in [
        ("chat", Route::Chat),
        ("completions", Route::Completions),
        ("messages", Route::Messages),
        ("responses", Route::Responses),
    ] {
        let start = format!("<!-- fields:{name} -->\n");
        let end = format!("<!-- /fields:{name} -->");
        let a = readme
            .find(&start)
            .unwrap_or_else(|| panic!("README lacks {start}"))
            + start.len();
        let b = readme[a..].find(&end).unwrap() + a;
        assert_eq!(
            &readme[a..b],
            markdown_table(route),
            "README table {name}: regenerate it from fields.rs"
        );
    }
}

#[tokio::test]
async fn n_choices_share_one_prefill_and_usage_counts_the_prompt_once() {
    let h = start(Opts::default());
    // 40 prompt tokens (byte tokenizer, no template on completions): 2 full blocks of 16 and a
    // partial one.
    let prompt = "0123456789abcdefghijklmnopqrstuvwxyzABCD";
    let before = h.scrape().await;
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "n": 3, "max_tokens": 5, "ignore_eos": true, "temperature": 1.0, "seed": 7}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2]
    );
    for c in choices {
        assert_eq!(c["text"].as_str().unwrap().len(), 5, "{c}");
        assert_eq!(c["finish_reason"], "length");
    }
    // OpenAI's usage: the prompt once, every choice's tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 40);
    assert_eq!(v["usage"]["completion_tokens"], 15);
    assert_eq!(v["usage"]["total_tokens"], 55);
    // The per-request numbers: 40 prompt tokens, all 40 computed, for the three choices.
    let pc = &v["metrics"]["prefix_cache"];
    assert_eq!(pc["prompt_tokens"], 40, "{v}");
    assert_eq!(pc["computed_tokens"], 40);
    assert_eq!(pc["cached_tokens"], 0);
    // The two full blocks became cache entries once.
    assert_eq!(pc["cache_creation_tokens"], 32);
    let after = h
        .wait_metrics("the request's counters", |m| {
            m.val("vllm:generation_tokens_total") >= before.val("vllm:generation_tokens_total") + 15
        })
        .await;
    assert_eq!(
        after.val("vllm:prompt_tokens_total") - before.val("vllm:prompt_tokens_total"),
        40
    );
    // Two prompts, two choices each: prompt i's choices are 2i and 2i + 1; per-request metrics
    // one object per prompt.
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": ["first prompt", "second"], "n": 2, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let idx: Vec<u64> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, [0, 1, 2, 3]);
    assert_eq!(v["usage"]["prompt_tokens"], 12 + 6);
    assert_eq!(v["usage"]["completion_tokens"], 8);
    let m = v["metrics"].as_array().unwrap();
    assert_eq!(m.len(), 2);
    assert_eq!(m[0]["prefix_cache"]["prompt_tokens"], 12);
    assert_eq!(m[1]["prefix_cache"]["prompt_tokens"], 6);
    // One token each: every choice gets its token (the first sequence ending with its first
    // token still forks the others).
    let (s, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": "one token each", "n": 3, "max_tokens": 1, "ignore_eos": true, "temperature": 1.0, "seed": 3}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["text"].as_str().unwrap().len(), 1, "{c}");
        assert_eq!(c["finish_reason"], "length", "{c}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 3);
    // The same prompt again: both full blocks come from the cache.
    let (_, v, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 32,
        "{v}"
    );
    // Chat, streamed: every index gets its own finish.
    let (s, events, _) = h
        .stream(
            "/v1/chat/completions",
            chat(json!({"n": 2, "max_tokens": 3, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})),
        )
        .await;
    assert_eq!(s, 200);
    let mut finished = Vec::new();
    let mut usage = Value::Null;
    for (_, d) in &events {
        let Ok(v) = serde_json::from_str::<Value>(d) else {
            continue;
        };
        for c in v["choices"].as_array().into_iter().flatten() {
            if c["finish_reason"].is_string() {
                finished.push(c["index"].as_u64().unwrap());
            }
        }
        if v["usage"].is_object() {
            usage = v["usage"].clone();
        }
    }
    finished.sort_unstable();
    assert_eq!(finished, [0, 1]);
    assert_eq!(usage["completion_tokens"], 6, "{usage}");
}

#[tokio::test]
async fn best_of_returns_the_n_sequences_of_highest_mean_logprob() {
    let h = start(Opts::default());
    let prompt = "best of these, please";
    let body = |extra: Value| {
        let mut b = json!({"prompt": prompt, "max_tokens": 6, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // The simulator's draws depend on the context only: n = 5 shows every candidate.
    let (s, all, _) = h
        .post("/v1/completions", body(json!({"n": 5, "logprobs": 0})))
        .await;
    assert_eq!(s, 200, "{all}");
    let mut scored: Vec<(f64, String)> = all["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
            assert_eq!(lps.len(), 6);
            let mean = lps.iter().map(|x| x.as_f64().unwrap()).sum::<f64>() / 6.0;
            (mean, c["text"].as_str().unwrap().to_string())
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let (s, v, _) = h
        .post("/v1/completions", body(json!({"n": 2, "best_of": 5})))
        .await;
    assert_eq!(s, 200, "{v}");
    let got: Vec<(u64, &str, bool)> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["index"].as_u64().unwrap(),
                c["text"].as_str().unwrap(),
                c["logprobs"].is_null(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (0, scored[0].1.as_str(), true),
            (1, scored[1].1.as_str(), true)
        ]
    );
    // Every sampled sequence is billed, the prompt once.
    assert_eq!(v["usage"]["completion_tokens"], 30);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    // best_of below n, and streamed: 400 naming best_of.
    for bad in [
        json!({"n": 3, "best_of": 2}),
        json!({"best_of": 2, "stream": true}),
        json!({"best_of": 65}),
    ] {
        let (s, v, _) = h.post("/v1/completions", body(bad)).await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["error"]["param"], "best_of");
    }
}

#[tokio::test]
async fn streamed_echo_sends_the_prompt_and_its_logprobs_first() {
    let h = start(Opts::default());
    let prompt = "abcde";
    let (_, whole, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 3, "ignore_eos": true}),
        )
        .await;
    let want = &whole["choices"][0];
    let (s, events, _) = h
        .stream(
            "/v1/completions",
            json!({"prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 3, "ignore_eos": true, "stream": true}),
        )
        .await;
    assert_eq!(s, 200);
    let chunks: Vec<Value> = events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    // The first chunk is the prompt, its first token without a logprob.
    let first = &chunks[0]["choices"][0];
    assert_eq!(first["text"], prompt);
    assert_eq!(
        first["logprobs"]["tokens"],
        json!(["a", "b", "c", "d", "e"])
    );
    assert_eq!(first["logprobs"]["token_logprobs"][0], Value::Null);
    assert_eq!(first["logprobs"]["text_offset"], json!([0, 1, 2, 3, 4]));
    // Streamed or not, the same text, tokens, logprobs and offsets.
    let mut text = String::new();
    let mut lists: [Vec<Value>; 3] = Default::default();
    for c in &chunks {
        let ch = &c["choices"][0];
        text.push_str(ch["text"].as_str().unwrap());
        for (k, key) in ["tokens", "token_logprobs", "text_offset"]
            .iter()
            .enumerate()
        {
            if let Some(a) = ch["logprobs"][key].as_array() {
                lists[k].extend(a.iter().cloned());
            }
        }
    }
    assert_eq!(text, want["text"].as_str().unwrap());
    assert_eq!(text.len(), 8);
    for (k, key) in ["tokens", "token_logprobs", "text_offset"]
        .iter()
        .enumerate()
    {
        assert_eq!(
            Value::Array(lists[k].clone()),
            want["logprobs"][key],
            "{key}"
        );
    }
    // vLLM's prompt_logprobs, streamed: on the first chunk; max_tokens 0 sends the echo only.
    let (_, events, _) = h
        .stream(
            "/v1/completions",
            json!({"prompt": prompt, "prompt_logprobs": 0, "echo": true, "max_tokens": 0, "stream": true}),
        )
        .await;
    let first: Value = serde_json::from_str(&events[0].1).unwrap();
    let plp = first["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(plp.len(), 5);
    assert_eq!(plp[0], Value::Null);
    assert!(
        plp[1].get((b'b' as u32 + 3).to_string()).is_some(),
        "{first}"
    );
    assert_eq!(first["choices"][0]["text"], prompt);
    let text: String = events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| {
            let v: Value = serde_json::from_str(d).unwrap();
            v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(text, prompt);
}
