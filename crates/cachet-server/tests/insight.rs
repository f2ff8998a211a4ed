//! Cache insight over HTTP on the simulated engine (B = 16, one byte = one token): miss reasons
//! and the divergence point in the per-request metrics and `/metrics`, tenants from named API
//! keys and salts, the inspector routes and the stats stream.

mod common;
use common::*;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};

fn text(n: usize, seed: u8) -> String {
    (0..n)
        .map(|i| (b'a' + ((i as u8).wrapping_mul(7).wrapping_add(seed)) % 26) as char)
        .collect()
}

async fn complete(h: &Harness, id: &str, prompt: &str, headers: &[(&str, &str)]) -> Value {
    let mut hs = vec![("x-request-id", id)];
    hs.extend_from_slice(headers);
    let (s, v, _) = h
        .post_with(
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
            &hs,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

/// A per-request nonce at token 37: the second request hits 2 blocks, and its first uncached
/// block has the first request's block 2 as cached sibling, first differing at 37.
#[tokio::test]
async fn a_nonce_at_37_is_named_in_the_response_and_the_counters() {
    let h = start(Opts::default());
    let p = text(100, 0);
    let n = h.tokenize_prompt(&p).await;
    // Tokens before the text (a BOS, if the tokenizer adds one).
    let lead = n - p.len();
    complete(&h, "a", &p, &[]).await;
    let mut q = p.clone().into_bytes();
    q[37 - lead] = b'#';
    let q = String::from_utf8(q).unwrap();
    let v = complete(&h, "nonce", &q, &[]).await;
    let pc = &v["metrics"]["prefix_cache"];
    assert_eq!(pc["local_cached_tokens"], 32, "{pc}");
    assert_eq!(pc["diverged_at"], 37);
    assert_eq!(pc["divergence"]["at"], 37);
    assert_eq!(pc["divergence"]["cached_by"], "a");
    // Token ids are byte values plus a fixed offset: the difference is the bytes'.
    let d = &pc["divergence"];
    let (ours, theirs) = (
        d["ours"][0].as_i64().unwrap(),
        d["theirs"][0].as_i64().unwrap(),
    );
    assert_eq!(
        theirs - ours,
        i64::from(p.as_bytes()[37 - lead]) - i64::from(b'#')
    );
    assert_eq!(d["before"].as_array().unwrap().len(), 8);
    // The text around it, detokenized: 8 tokens before, then ours and theirs from the point.
    let at = 37 - lead;
    assert_eq!(d["text"]["before"], &p[at - 8..at]);
    assert_eq!(d["text"]["ours"], &q[at..at + 8]);
    assert_eq!(d["text"]["theirs"], &p[at..at + 8]);
    // Blocks 2.. of n tokens computed: never cached, and the tail of the last block.
    let full = n / BLOCK;
    assert_eq!(
        pc["miss_tokens"]["never_cached"],
        ((full - 2) * BLOCK) as u64
    );
    assert_eq!(pc["miss_tokens"]["partial_block"], (n % BLOCK) as u64);
    let s = h
        .wait_metrics("divergence counted", |s| {
            s.val("cachet:prefix_cache_diverged_requests_total") == 1
        })
        .await;
    assert_eq!(
        s.val("cachet:prefix_cache_diverged_early_requests_total"),
        1
    );
    let miss = |r: &str| s.get("cachet:prefix_cache_miss_tokens_total", &[("reason", r)]);
    // The first request computed everything (never cached + partial), the second its blocks 2..
    assert_eq!(
        miss("never_cached"),
        (full * BLOCK + (full - 2) * BLOCK) as f64
    );
    assert_eq!(miss("partial_block"), (2 * (n % BLOCK)) as f64);
    assert_eq!(
        miss("evicted") + miss("capped_for_logits") + miss("load_failed"),
        0.0
    );
    assert_eq!(
        miss("never_cached") + miss("partial_block"),
        s.get(
            "vllm:prompt_tokens_by_source_total",
            &[("source", "local_compute")]
        )
    );
}

/// Named keys are tenants; a plain key's salted request is `salt-` and a digest, never the salt.
#[tokio::test]
async fn tenants_come_from_key_names_and_salt_digests() {
    let h = start(Opts {
        api_key: Some("alice:ka,bob:kb,plain".into()),
        ..Opts::default()
    });
    let p = text(40, 3);
    let n = h.tokenize_prompt(&p).await;
    let hits = (n - 1) / BLOCK * BLOCK;
    complete(&h, "a1", &p, &[("authorization", "Bearer ka")]).await;
    complete(&h, "a2", &p, &[("authorization", "Bearer ka")]).await;
    complete(&h, "b1", &p, &[("x-api-key", "kb")]).await;
    let (s, v, _) = h
        .post_with(
            "/v1/completions",
            json!({"model": MODEL, "prompt": p, "max_tokens": 1, "cache_salt": "s3cr3t-salt"}),
            &[("authorization", "Bearer plain")],
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let salted = cachet_core::tenant_label(None, Some("s3cr3t-salt"));
    assert!(salted.starts_with("salt-") && !salted.contains("s3cr3t"));
    let s = h
        .wait_metrics("tenants", |s| {
            s.get("cachet:tenant_prompt_tokens_total", &[("tenant", &salted)]) > 0.0
        })
        .await;
    let q = |t: &str| s.get("cachet:tenant_prefix_cache_queries_total", &[("tenant", t)]);
    let hit = |t: &str| s.get("cachet:tenant_prefix_cache_hits_total", &[("tenant", t)]);
    assert_eq!((q("alice"), hit("alice")), ((2 * n) as f64, hits as f64));
    // bob's prompt is alice's: same cache (no salt), so it hits.
    assert_eq!((q("bob"), hit("bob")), (n as f64, hits as f64));
    // The salted request shares nothing.
    assert_eq!((q(&salted), hit(&salted)), (n as f64, 0.0));
    let (_, body) = h.get("/metrics").await;
    assert!(!body.contains("s3cr3t"), "the salt leaked into /metrics");
    // The inspector is behind the key too.
    let (code, _) = h.get("/v1/cache").await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
}

/// Named keys share the cache (no salt) but not their prompts: bob's nonce prompt hits the two
/// blocks alice cached and is shown no divergence point (her text and request id would be in
/// it); alice's own nonce prompt is.
#[tokio::test]
async fn a_divergence_never_shows_another_tenants_prompt() {
    let h = start(Opts {
        api_key: Some("alice:ka,bob:kb".into()),
        ..Opts::default()
    });
    let p = text(100, 0);
    let lead = h.tokenize_prompt(&p).await - p.len();
    complete(&h, "a", &p, &[("authorization", "Bearer ka")]).await;
    let nonce = |c: u8| {
        let mut q = p.clone().into_bytes();
        q[37 - lead] = c;
        String::from_utf8(q).unwrap()
    };
    let v = complete(&h, "b", &nonce(b'#'), &[("authorization", "Bearer kb")]).await;
    let pc = &v["metrics"]["prefix_cache"];
    assert_eq!(pc["local_cached_tokens"], 32, "{pc}");
    assert_eq!(pc["diverged_at"], Value::Null, "{pc}");
    assert!(pc.get("divergence").is_none(), "{pc}");
    let v = complete(&h, "a2", &nonce(b'%'), &[("authorization", "Bearer ka")]).await;
    let pc = &v["metrics"]["prefix_cache"];
    assert_eq!(pc["diverged_at"], 37, "{pc}");
    assert_eq!(pc["divergence"]["cached_by"], "a");
}

/// Named keys are tenants, unnamed keys the operator's: a tenant key gets 403 (a
/// `permission_error` body) on every route that shows or drops every tenant's cache — the
/// inspector, the event stream (every stored block's token ids), the stats stream, both resets
/// — and the operator's key gets them; a tenant key still completes.
#[tokio::test]
async fn tenant_keys_cannot_read_or_drop_the_whole_cache() {
    let h = start(Opts {
        api_key: Some("alice:ka,bob:kb,op-key".into()),
        ..Opts::default()
    });
    complete(&h, "a", &text(40, 1), &[("authorization", "Bearer ka")]).await;
    let call = |method: &str, path: &str, key: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {key}"))
            .body(Body::empty())
            .unwrap()
    };
    for (method, path) in [
        ("GET", "/v1/cache"),
        ("GET", "/v1/cache/events"),
        ("GET", "/v1/cache/stats/stream"),
        ("GET", "/v1/cache/requests/a"),
        ("POST", "/v1/cache/reset"),
        ("POST", "/v1/cache/isolation-check"),
        ("POST", "/reset_prefix_cache"),
    ] {
        let resp = h.send(call(method, path, "kb")).await;
        assert_eq!(resp.status(), StatusCode::FORBIDDEN, "{path}");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "permission_error", "{path}: {v}");
        assert_eq!(v["error"]["code"], "operator_key_required", "{path}: {v}");
    }
    let resp = h.send(call("GET", "/v1/cache/requests/a", "op-key")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = h.send(call("POST", "/v1/cache/reset", "op-key")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["reset"],
        true
    );
}

async fn get_json(h: &Harness, path: &str) -> (StatusCode, Value) {
    let (s, t) = h.get(path).await;
    (s, serde_json::from_str(&t).unwrap_or(Value::Null))
}

/// After one request computed a 100-token prompt and two more hit it: the pool holds its 6
/// full blocks as idle entries, the hottest prefix is its 6-block run found twice, created by
/// "a"; "b"'s lifecycle is 6 hits and one allocation; a reset empties the cache.
#[tokio::test]
async fn the_inspector_after_a_known_workload() {
    let h = start(Opts::default());
    let p = text(100, 5);
    let n = h.tokenize_prompt(&p).await;
    let full = n / BLOCK;
    let cap = (n - 1) / BLOCK;
    for id in ["a", "b", "c"] {
        complete(&h, id, &p, &[]).await;
    }
    h.wait_metrics("idle", |s| s.val("vllm:num_requests_running") == 0)
        .await;
    let (s, v) = get_json(&h, "/v1/cache").await;
    assert_eq!(s, StatusCode::OK);
    let pool = &v["pool"];
    assert_eq!(pool["num_blocks"], 256);
    assert_eq!(pool["blocks_in_use"], 0);
    assert_eq!(pool["cached_blocks"], full as u64);
    assert_eq!(pool["blocks_cached_idle"], full as u64);
    assert_eq!(pool["blocks_free"], (256 - full) as u64);
    assert_eq!(pool["tokens_held"], (full * BLOCK) as u64);
    let hot = &v["hottest"][0];
    assert_eq!(hot["depth"], (cap - 1) as u64, "{v}");
    assert_eq!(hot["hits"], 2);
    assert_eq!(hot["created_by"], "a");

    let (s, b) = get_json(&h, "/v1/cache/requests/b").await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let events: Vec<(String, u64)> = b["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_string(),
                e["index"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut want: Vec<(String, u64)> = (0..cap as u64).map(|i| ("hit".into(), i)).collect();
    // The blocks after the hit: the capped one (if the prompt is block-aligned) and the tail.
    for i in cap..n.div_ceil(BLOCK) {
        want.push(("allocated".into(), i as u64));
    }
    if cap < full {
        want.push(("filled".into(), cap as u64));
    }
    assert_eq!(events, want);
    assert_eq!(b["prefix_cache"]["cached_tokens"], (cap * BLOCK) as u64);
    let (s, _) = get_json(&h, "/v1/cache/requests/nobody").await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let (s, r, _) = h.post("/v1/cache/reset", json!({})).await;
    assert_eq!((s, r), (StatusCode::OK, json!({"reset": true})));
    let (_, v) = get_json(&h, "/v1/cache").await;
    assert_eq!(v["pool"]["cached_blocks"], 0);
    assert_eq!(v["hottest"], json!([]));
}

/// The stream's first snapshot: the totals, miss reasons, what-if and last requests.
/// n = 2 with a prompt that ends inside a block: sequence 0 computes the prompt, sequence 1
/// gets a block for its copy of the partial last block at the fork; the lifecycle names each
/// event's sequence.
#[tokio::test]
async fn a_lifecycle_names_each_events_sequence() {
    let h = start(Opts::default());
    let p = text(40, 9);
    let n = h.tokenize_prompt(&p).await;
    assert!(n % BLOCK != 0 && n % BLOCK < BLOCK - 2, "{n}");
    let (s, v, _) = h
        .post_with(
            "/v1/completions",
            json!({"model": MODEL, "prompt": p, "max_tokens": 2, "n": 2}),
            &[("x-request-id", "pair")],
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(2));
    h.wait_metrics("idle", |s| s.val("vllm:num_requests_running") == 0)
        .await;
    let (s, l) = get_json(&h, "/v1/cache/requests/pair").await;
    assert_eq!(s, StatusCode::OK, "{l}");
    let events: Vec<(u64, String, u64)> = l["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["seq"].as_u64().unwrap(),
                e["event"].as_str().unwrap().to_string(),
                e["index"].as_u64().unwrap(),
            )
        })
        .collect();
    let (full, blocks) = ((n / BLOCK) as u64, n.div_ceil(BLOCK) as u64);
    let mut want: Vec<(u64, String, u64)> =
        (0..blocks).map(|i| (0, "allocated".into(), i)).collect();
    want.extend((0..full).map(|i| (0, "filled".into(), i)));
    want.push((1, "allocated".into(), full));
    assert_eq!(events, want);
    assert_eq!(l["generation_tokens"], 4);
}

#[tokio::test]
async fn the_stats_stream_sends_snapshots() {
    let h = start(Opts::default());
    let p = text(64, 9);
    complete(&h, "s1", &p, &[]).await;
    complete(&h, "s2", &p, &[]).await;
    h.wait_metrics("finished", |s| {
        s.get("vllm:request_success_total", &[]) >= 2.0
    })
    .await;
    let resp = h
        .send(
            Request::get("/v1/cache/stats/stream?interval_ms=100&limit=2")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    // Request ids, tenants and a divergence point's tokens are any text: declared UTF-8.
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let mut body = resp.into_body();
    let mut buf = String::new();
    while !buf.contains("\n\n") {
        let frame = body.frame().await.expect("a frame").expect("ok");
        if let Ok(d) = frame.into_data() {
            buf.push_str(&String::from_utf8_lossy(&d));
        }
    }
    let events = parse_sse(&buf);
    assert_eq!(events[0].0.as_deref(), Some("snapshot"));
    // `limit=2`: a second snapshot, then the stream ends.
    let mut all = buf.clone();
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.expect("ok").into_data() {
            all.push_str(&String::from_utf8_lossy(&d));
        }
    }
    let snapshots = parse_sse(&all)
        .iter()
        .filter(|(e, _)| e.as_deref() == Some("snapshot"))
        .count();
    assert_eq!(snapshots, 2);
    let v: Value = serde_json::from_str(&events[0].1).unwrap();
    let n = h.tokenize_prompt(&p).await as u64;
    assert_eq!(v["counters"]["prompt_tokens"], 2 * n);
    assert_eq!(v["counters"]["prefix_cache_queries"], 2 * n);
    let hits = (n - 1) / 16 * 16;
    assert_eq!(v["counters"]["prefix_cache_hits"], hits);
    let m = &v["miss_tokens"];
    let miss: u64 = [
        "capped_for_logits",
        "partial_block",
        "evicted",
        "never_cached",
        "lookup_skipped",
        "load_failed",
    ]
    .iter()
    .map(|k| m[*k].as_u64().unwrap())
    .sum();
    assert_eq!(miss, 2 * n - hits);
    assert_eq!(v["whatif"]["hit_rate"], hits as f64 / (2 * n) as f64);
    // Nothing was evicted: a larger pool would have hit exactly as much.
    assert_eq!(v["whatif"]["hit_rate_2x"], v["whatif"]["hit_rate"]);
    assert_eq!(v["recent"][0]["request_id"], "s2");
    assert_eq!(v["recent"][0]["cached_tokens"], hits);
    assert_eq!(v["recent"][1]["request_id"], "s1");
    assert_eq!(v["gauges"]["num_blocks"], 256);
    assert_eq!(v["tenants"][0]["tenant"], "default");
}

/// The operator's isolation self-test (B = 16): a 65-token probe under salt A creates 4 entries;
/// under salt B it finds nothing and creates 4 entries of its own, none shared; under salt A
/// again it hits A's 4 entries (64 tokens). The salt cost B the 64 tokens A's entries held.
#[tokio::test]
async fn the_isolation_check_proves_salts_share_nothing_and_prices_it() {
    let h = start(Opts::default());
    let (s, v, _) = h.post("/v1/cache/isolation-check", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v,
        json!({
            "isolated": true,
            "probe_tokens": 65,
            "block_size": 16,
            "entries_created_under_salt_a": 4,
            "entries_created_under_salt_b": 4,
            "entries_shared": 0,
            "salt_b_cached_tokens": 0,
            "salt_a_again_cached_tokens": 64,
            "salt_a_again_hit_entries_of_salt_a": 4,
            "forgone_tokens": 64,
        })
    );
    // A second run uses a fresh probe and fresh salts: the same answer.
    let (_, again, _) = h.post("/v1/cache/isolation-check", json!({})).await;
    assert_eq!(again, v);
}
