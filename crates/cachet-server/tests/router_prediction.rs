//! A router's predicted cached prefix (`x-prefix-cache-predicted-tokens`) reported beside what
//! happened, with the shortfall by reason, in the per-request metrics and on `/metrics`; on the
//! simulated engine (B = 16, one byte = one token).

mod common;
use common::*;

use axum::http::StatusCode;
use serde_json::{json, Value};

const HEADER: &str = "x-prefix-cache-predicted-tokens";

/// `n` token ids of the byte tokenizer, led by `lead`.
fn ids(n: usize, lead: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (lead + i * 7) % 200).collect()
}

async fn prefix_cache(h: &Harness, prompt: &[u32], predicted: Option<&str>) -> Value {
    let headers: Vec<(&str, &str)> = predicted.map(|p| (HEADER, p)).into_iter().collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    let (s, v, _) = h.post_with("/v1/completions", body, &headers).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["metrics"]["prefix_cache"].clone()
}

/// - cold 100 tokens, 64 predicted: the 4 predicted blocks were never cached here (64);
/// - the same again, 100 predicted: 96 hit, the 4 tokens of the partial block fall short;
/// - the same without the header: neither field.
#[tokio::test]
async fn the_prediction_and_its_shortfall_by_reason() {
    let h = start(Opts::default());
    let p = ids(100, 0);
    let pc = prefix_cache(&h, &p, Some("64")).await;
    assert_eq!(pc["predicted_tokens"], 64);
    assert_eq!(
        pc["shortfall_tokens"],
        json!({"capped_for_logits": 0, "partial_block": 0, "evicted": 0, "never_cached": 64,
               "lookup_skipped": 0, "load_failed": 0})
    );
    let pc = prefix_cache(&h, &p, Some("100")).await;
    assert_eq!(pc["local_cached_tokens"], 96);
    assert_eq!(pc["predicted_tokens"], 100);
    assert_eq!(pc["shortfall_tokens"]["partial_block"], 4);
    assert_eq!(pc["shortfall_tokens"]["never_cached"], 0);
    let pc = prefix_cache(&h, &p, None).await;
    assert!(pc.get("predicted_tokens").is_none(), "{pc}");
    assert!(pc.get("shortfall_tokens").is_none(), "{pc}");
    let s = h
        .wait_metrics("router counters", |s| {
            s.val("cachet:router_predicted_tokens_total") == 164
        })
        .await;
    let short = |r: &str| s.get("cachet:router_shortfall_tokens_total", &[("reason", r)]);
    assert_eq!((short("never_cached"), short("partial_block")), (64.0, 4.0));
    assert_eq!(short("evicted") + short("capped_for_logits"), 0.0);
}

/// A malformed prediction is a 400 naming the header, in each API's error shape.
#[tokio::test]
async fn a_malformed_prediction_is_a_400_naming_the_header() {
    let h = start(Opts::default());
    let body = json!({"model": MODEL, "prompt": ids(20, 1), "max_tokens": 1});
    let (s, v, _) = h
        .post_with("/v1/completions", body, &[(HEADER, "-3")])
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"].as_str().unwrap().contains(HEADER),
        "{v}"
    );
    let body = json!({"model": MODEL, "max_tokens": 1,
                      "messages": [{"role": "user", "content": "hi"}]});
    let (s, v, _) = h.post_with("/v1/messages", body, &[(HEADER, "lots")]).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["type"], "error", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains(HEADER),
        "{v}"
    );
}
