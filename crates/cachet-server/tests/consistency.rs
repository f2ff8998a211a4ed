//! Mixed workload (shared prefixes, aborts, preemption under a small KV pool): every scraped
//! counter equals the sum of what the responses reported per request; hits never exceed
//! queries; repeated scrapes never decrease.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

/// What one request's responses told the client.
#[derive(Debug, Default, Clone)]
struct Reported {
    aborted: bool,
    prompt: u64,
    local_cached: u64,
    external_cached: u64,
    cached: u64,
    computed: u64,
    creation: u64,
    generated: u64,
    blocks_allocated: u64,
    blocks_filled: u64,
    blocks_evicted: u64,
}

fn from_prefix(p: &Value, generated: u64) -> Reported {
    let g = |k: &str| {
        p[k].as_u64()
            .unwrap_or_else(|| panic!("{k} missing in {p}"))
    };
    let r = Reported {
        aborted: false,
        prompt: g("prompt_tokens"),
        local_cached: g("local_cached_tokens"),
        external_cached: g("external_cached_tokens"),
        cached: g("cached_tokens"),
        computed: g("computed_tokens"),
        creation: g("cache_creation_tokens"),
        generated,
        blocks_allocated: g("blocks_allocated"),
        blocks_filled: g("blocks_filled"),
        blocks_evicted: g("blocks_evicted"),
    };
    assert_eq!(r.cached + r.computed, r.prompt, "{p}");
    assert_eq!(r.local_cached + r.external_cached, r.cached, "{p}");
    assert!(r.creation <= r.computed, "{p}");
    r
}

async fn post(app: &Router, path: &str, body: Value) -> axum::response::Response {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    app.clone().oneshot(req).await.unwrap()
}

async fn json_of(resp: axum::response::Response) -> Value {
    assert_eq!(resp.status(), StatusCode::OK);
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

async fn chat(app: Router, prompt: String, max_tokens: u32) -> Reported {
    let v = json_of(post(&app, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "ignore_eos": true})).await).await;
    let r = from_prefix(
        &v["metrics"]["prefix_cache"],
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    );
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(r.cached)
    );
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["created_cache_tokens"].as_u64(),
        Some(r.creation)
    );
    r
}

async fn completion_stream(app: Router, prompt: String, max_tokens: u32) -> Reported {
    let resp = post(&app, "/v1/completions", json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let text = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    let events = parse_sse(&text);
    let usage: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    from_prefix(
        &usage["metrics"]["prefix_cache"],
        usage["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

async fn messages(app: Router, prompt: String, max_tokens: u32) -> Reported {
    let v = json_of(
        post(
            &app,
            "/v1/messages",
            json!({"max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}),
        )
        .await,
    )
    .await;
    let r = from_prefix(
        &v["metrics"]["prefix_cache"],
        v["usage"]["output_tokens"].as_u64().unwrap(),
    );
    let u = &v["usage"];
    assert_eq!(u["cache_read_input_tokens"].as_u64(), Some(r.cached));
    assert_eq!(u["cache_creation_input_tokens"].as_u64(), Some(r.creation));
    assert_eq!(
        u["input_tokens"].as_u64(),
        Some(r.prompt - r.cached - r.creation)
    );
    r
}

/// A streaming Anthropic request dropped right after `message_start` (which carries the prefill
/// stats): the engine aborts it.
async fn aborted_messages(app: Router, prompt: String) -> Reported {
    let resp = post(&app, "/v1/messages", json!({"max_tokens": 300, "stream": true, "messages": [{"role": "user", "content": prompt}]})).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut buf = String::new();
    while !buf.contains("\n\n") {
        let f = body.frame().await.expect("message_start").unwrap();
        if let Ok(d) = f.into_data() {
            buf.push_str(std::str::from_utf8(&d).unwrap());
        }
    }
    drop(body);
    let first = &parse_sse(&buf)[0];
    assert_eq!(first.0.as_deref(), Some("message_start"));
    let v: Value = serde_json::from_str(&first.1).unwrap();
    let u = &v["message"]["usage"];
    let read = u["cache_read_input_tokens"].as_u64().unwrap();
    let creation = u["cache_creation_input_tokens"].as_u64().unwrap();
    let prompt = u["input_tokens"].as_u64().unwrap() + read + creation;
    Reported {
        aborted: true,
        prompt,
        cached: read,
        local_cached: read,
        computed: prompt - read,
        creation,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_equal_the_sum_of_reported_numbers() {
    let h = start(Opts {
        num_kv_blocks: 48,
        max_num_seqs: 8,
        step_ms: 1,
        max_model_len: 512,
        ..Opts::default()
    });
    let prefix_a =
        "Shared system prefix A: the quick brown fox jumps over the lazy dog. ".repeat(2);
    let prefix_b = "Another shared prefix, B, for the second tenant of this test. ";

    // Scrape continuously: no counter ever decreases, hits never exceed queries.
    let stop = Arc::new(AtomicBool::new(false));
    let scraper = {
        let app = h.app.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut last = std::collections::HashMap::new();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let resp = app
                    .clone()
                    .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
                    .await
                    .unwrap();
                let text = String::from_utf8(
                    resp.into_body()
                        .collect()
                        .await
                        .unwrap()
                        .to_bytes()
                        .to_vec(),
                )
                .unwrap();
                let s = Scrape::parse(&text);
                assert!(
                    s.val("vllm:prefix_cache_hits_total")
                        <= s.val("vllm:prefix_cache_queries_total")
                );
                let cur = s.monotonic();
                for (k, v) in &cur {
                    if let Some(prev) = last.get(k) {
                        assert!(v >= prev, "{k} decreased: {prev} -> {v}");
                    }
                }
                last = cur;
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            n
        })
    };

    let mut tasks = Vec::new();
    for i in 0..30u32 {
        let app = h.app.clone();
        let prefix = if i % 2 == 0 {
            prefix_a.clone()
        } else {
            prefix_b.to_string()
        };
        let prompt = format!(
            "{prefix}request {i}: {}",
            "detail ".repeat((i % 5) as usize * 3)
        );
        let max_tokens = 20 + (i % 4) * 15;
        tasks.push(tokio::spawn(async move {
            match i % 6 {
                0 | 3 => chat(app, prompt, max_tokens).await,
                1 => completion_stream(app, prompt, max_tokens).await,
                2 | 4 => messages(app, prompt, max_tokens).await,
                _ => aborted_messages(app, prompt).await,
            }
        }));
        if i % 3 == 0 {
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }
    let mut reported = Vec::new();
    for t in tasks {
        reported.push(t.await.unwrap());
    }
    let total = reported.len() as f64;
    let m = h
        .wait_metrics("every request finished", |m| {
            m.get("vllm:request_success_total", &[]) == total
                && m.val("vllm:num_requests_running") == 0
                && m.val("vllm:num_requests_waiting") == 0
        })
        .await;
    stop.store(true, Ordering::Relaxed);
    assert!(scraper.await.unwrap() > 0);

    let sum = |f: fn(&Reported) -> u64| reported.iter().map(f).sum::<u64>();
    let sum_done =
        |f: fn(&Reported) -> u64| reported.iter().filter(|r| !r.aborted).map(f).sum::<u64>();
    let aborted = reported.iter().filter(|r| r.aborted).count() as f64;

    assert_eq!(
        m.get(
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        aborted
    );
    assert_eq!(
        m.get("vllm:request_success_total", &[("finished_reason", "stop")])
            + m.get(
                "vllm:request_success_total",
                &[("finished_reason", "length")]
            ),
        total - aborted
    );
    assert_eq!(m.val("vllm:prefix_cache_queries_total"), sum(|r| r.prompt));
    assert_eq!(
        m.val("vllm:prefix_cache_hits_total"),
        sum(|r| r.local_cached)
    );
    assert_eq!(
        m.val("vllm:external_prefix_cache_hits_total"),
        sum(|r| r.external_cached)
    );
    assert_eq!(m.val("vllm:prompt_tokens_total"), sum(|r| r.prompt));
    assert_eq!(m.val("vllm:prompt_tokens_cached_total"), sum(|r| r.cached));
    assert_eq!(
        m.get(
            "vllm:prompt_tokens_by_source_total",
            &[("source", "local_compute")]
        ) as u64,
        sum(|r| r.computed)
    );
    assert_eq!(
        m.get(
            "vllm:prompt_tokens_by_source_total",
            &[("source", "local_cache_hit")]
        ) as u64,
        sum(|r| r.local_cached)
    );
    assert_eq!(
        m.get(
            "vllm:prompt_tokens_by_source_total",
            &[("source", "external_kv_transfer")]
        ) as u64,
        sum(|r| r.external_cached)
    );
    assert_eq!(
        m.val("cachet:cache_creation_tokens_total"),
        sum(|r| r.creation)
    );
    // Aborted requests' generated tokens were never all reported to their (gone) clients.
    assert!(m.val("vllm:generation_tokens_total") >= sum_done(|r| r.generated));
    // Physical counters also count decode-time allocations of every request.
    assert!(m.val("cachet:kv_blocks_allocated_total") >= sum_done(|r| r.blocks_allocated));
    assert!(m.val("cachet:kv_blocks_filled_total") >= sum_done(|r| r.blocks_filled));
    assert!(m.val("cachet:kv_blocks_evicted_total") >= sum_done(|r| r.blocks_evicted));
    assert!(
        m.val("vllm:prefix_cache_hits_total") > 0,
        "shared prefixes must hit"
    );
    assert!(m.val("vllm:prefix_cache_hits_total") <= m.val("vllm:prefix_cache_queries_total"));
    assert!(
        m.val("vllm:num_preemptions_total") > 0,
        "the small KV pool must force preemptions"
    );
    assert_eq!(m.get("vllm:kv_cache_usage_perc", &[]), 0.0);
    assert_eq!(
        m.val("vllm:e2e_request_latency_seconds_count"),
        total as u64
    );
}
