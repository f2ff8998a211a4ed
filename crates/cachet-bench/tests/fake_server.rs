//! `bench serve` against an in-process fake OpenAI server: every streamed request gets a fixed
//! number of tokens and a usage chunk whose cached_tokens depends on the turn, so the reported
//! cached fraction is known exactly.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use cachet_bench::serve::{bench_serve, Api, LoadArgs, ServeBenchArgs};
use cachet_bench::workload::{WorkloadKind, WorkloadParams};

const OUT_TOKENS: usize = 5;

#[derive(Clone, Default)]
struct Fake {
    requests: Arc<AtomicUsize>,
    seen: Arc<std::sync::Mutex<Vec<Value>>>,
}

/// prompt_tokens = 100 × number of messages; cached = 100 × (messages − 2) (everything but
/// the system prompt's first request and the new user message), so per turn t (2t + 2
/// messages): prompt 200t + 200, cached 200t.
async fn chat(State(f): State<Fake>, Json(body): Json<Value>) -> Response {
    f.requests.fetch_add(1, Ordering::SeqCst);
    f.seen.lock().unwrap().push(body.clone());
    let n = body["messages"].as_array().map_or(0, Vec::len) as u64;
    let prompt = 100 * n;
    let cached = 100 * n.saturating_sub(2);
    let mut s = String::new();
    let chunk = |delta: Value| {
        format!(
            "data: {}\n\n",
            json!({"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
        )
    };
    s.push_str(&chunk(json!({"role": "assistant", "content": ""})));
    for i in 0..OUT_TOKENS {
        s.push_str(&chunk(json!({"content": format!(" t{i}")})));
    }
    s.push_str(&format!(
        "data: {}\n\n",
        json!({"id": "x", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": prompt, "completion_tokens": OUT_TOKENS,
                         "total_tokens": prompt + OUT_TOKENS as u64,
                         "prompt_tokens_details": {"cached_tokens": cached}}})
    ));
    s.push_str("data: [DONE]\n\n");
    // Send in several body chunks so the client's SSE reassembly is exercised.
    let parts: Vec<Result<String, std::io::Error>> = s
        .as_bytes()
        .chunks(37)
        .map(|c| Ok(String::from_utf8_lossy(c).into_owned()))
        .collect();
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(futures_util::stream::iter(parts)),
    )
        .into_response()
}

async fn tokenize(Json(body): Json<Value>) -> Json<Value> {
    // Two tokens per word, whichever field the client filled.
    let text = body["content"]
        .as_str()
        .or(body["prompt"].as_str())
        .unwrap_or("");
    let n = text.split_whitespace().count() * 2;
    Json(json!({"tokens": vec![7; n]}))
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
}

async fn start() -> (String, Fake) {
    let f = Fake::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .with_state(f.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (format!("http://{addr}"), f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_bench_reports_exact_cached_fraction() {
    let (base, fake) = start().await;
    let dir = std::env::temp_dir().join(format!("cachet-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json_path = dir.join("report.json");
    let args = ServeBenchArgs {
        base_url: base,
        api: Api::Openai,
        workload: WorkloadKind::SharedPrefix,
        load: LoadArgs {
            params: WorkloadParams {
                users: 3,
                turns: 4,
                system_tokens: 200,
                ..Default::default()
            },
            max_tokens: OUT_TOKENS as u32,
            no_progress: true,
            ..Default::default()
        },
        model: None,
        label: Some("fake".into()),
        output_json: Some(json_path.clone()),
        plot: Some(dir.join("plot.png")),
    };
    let rep = bench_serve(&args).await.unwrap();
    assert_eq!(fake.requests.load(Ordering::SeqCst), 12);
    assert_eq!(rep.num_requests, 12);
    assert_eq!(rep.completed, 12);
    assert_eq!(rep.failed, 0);
    assert_eq!(rep.model, "fake-model");
    // Calibrated from /tokenize: exactly 2 tokens per word.
    assert_eq!(rep.tokens_per_word, 2.0);
    // Per user: turns t = 0..4 → prompt Σ(200t + 200) = 2000, cached Σ 200t = 1200.
    assert_eq!(rep.prompt_tokens, 3 * 2000);
    assert_eq!(rep.cached_tokens, 3 * 1200);
    assert_eq!(rep.cached_fraction, Some(0.6));
    assert_eq!(rep.output_tokens, 12 * OUT_TOKENS as u64);
    assert_eq!(rep.ttft_ms.count, 12);
    assert_eq!(rep.itl_ms.count, 12 * (OUT_TOKENS - 1));
    // Histories grow and carry the previous answers.
    let seen = fake.seen.lock().unwrap();
    let last = seen
        .iter()
        .filter(|b| b["messages"].as_array().unwrap().len() == 8)
        .count();
    assert_eq!(last, 3);
    let b = seen
        .iter()
        .find(|b| b["messages"].as_array().unwrap().len() == 4)
        .unwrap();
    assert_eq!(b["messages"][2]["role"], "assistant");
    assert_eq!(b["messages"][2]["content"], " t0 t1 t2 t3 t4");
    assert_eq!(b["stream_options"]["include_usage"], true);
    assert_eq!(b["ignore_eos"], true);
    let first_system = &seen[0]["messages"][0]["content"];
    assert!(seen
        .iter()
        .all(|b| &b["messages"][0]["content"] == first_system));
    // The JSON report and the PNG were written.
    let j: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(j["cached_fraction"], 0.6);
    assert_eq!(j["requests"].as_array().unwrap().len(), 12);
    let png = std::fs::read(dir.join("plot.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let _ = std::fs::remove_dir_all(&dir);
}
