//! Test harness: a router over the simulated engine, request helpers, SSE and Prometheus text
//! parsers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::Router;
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::step::CoreOptions;
use cachet_engine::{start_engine, EngineConfig, EngineHandle, ModelInfo, SchedulerConfig};
use cachet_server::{router, AppState, CacheConfigInfo, MetricsHandle, ServerArgs};
use cachet_text::{ByteTokenizer, TextTokenizer};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

pub const MODEL: &str = "sim-model";
pub const BLOCK: usize = 16;

#[derive(Clone)]
pub struct Opts {
    pub max_model_len: usize,
    pub num_kv_blocks: usize,
    pub per_request_metrics: bool,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub max_waiting_requests: usize,
    pub max_num_seqs: usize,
    /// Simulated time per engine step.
    pub step_ms: u64,
    /// `--served-model-name` values.
    pub served_model_names: Vec<String>,
    /// Fault injection: the simulator panics on a step computing these tokens.
    pub panic_on: Option<Vec<u32>>,
    /// KV cache events into a log of this many batches (`GET /v1/cache/events`); 0: none.
    pub event_log: usize,
    /// What the recorder keeps for cache insight (default: everything, as `cachet serve`).
    pub insight: cachet_engine::InsightConfig,
    /// The simulator's scripted reply (`--sim-reply`), as text.
    pub reply: Option<String>,
    /// `--reasoning-parser`.
    pub reasoning_parser: Option<cachet_text::ReasoningFormat>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            max_model_len: 1024,
            num_kv_blocks: 256,
            per_request_metrics: true,
            api_key: None,
            max_body_bytes: cachet_server::DEFAULT_MAX_BODY_BYTES,
            max_waiting_requests: 256,
            max_num_seqs: 32,
            step_ms: 0,
            served_model_names: Vec::new(),
            panic_on: None,
            insight: cachet_engine::InsightConfig::full(),
            event_log: 0,
            reply: None,
            reasoning_parser: None,
        }
    }
}

pub struct Harness {
    pub app: Router,
    pub engine: EngineHandle,
    pub tokenizer: Arc<dyn TextTokenizer>,
    pub metrics: MetricsHandle,
}

pub fn start(opts: Opts) -> Harness {
    let tokenizer: Arc<dyn TextTokenizer> = Arc::new(ByteTokenizer);
    let model = ModelInfo {
        name: MODEL.to_string(),
        max_model_len: opts.max_model_len,
        block_size: BLOCK,
        num_kv_blocks: opts.num_kv_blocks,
    };
    let executor = SimExecutor::new(SimConfig {
        num_blocks: opts.num_kv_blocks,
        block_size: BLOCK,
        decode_cost_per_seq: Duration::from_millis(opts.step_ms),
        panic_on: opts.panic_on.clone(),
        reply: opts
            .reply
            .as_deref()
            .map(|t| ByteTokenizer.encode(t, false).expect("byte tokens")),
        ..SimConfig::default()
    });
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            block_size: BLOCK,
            num_blocks: opts.num_kv_blocks,
            max_num_seqs: opts.max_num_seqs,
            max_model_len: opts.max_model_len,
            eos_token_ids: tokenizer.eos_token_ids().to_vec(),
            max_waiting_requests: opts.max_waiting_requests,
            ..SchedulerConfig::default()
        },
    };
    let cache = CacheConfigInfo {
        block_size: BLOCK,
        num_gpu_blocks: opts.num_kv_blocks,
        cache_dtype: "u64".into(),
        enable_prefix_caching: true,
        ..Default::default()
    };
    let metrics = MetricsHandle::new(MODEL, opts.max_model_len, cache);
    let mut event_sinks: Vec<Box<dyn cachet_engine::step::EventSink>> = Vec::new();
    let event_log = (opts.event_log > 0).then(|| {
        let log = Arc::new(cachet_kv_events::EventLog::new(opts.event_log));
        let sink = Arc::clone(&log);
        event_sinks.push(Box::new(move |b| {
            sink.push(b);
        }));
        cachet_server::cache_routes::EventLogHandle(log)
    });
    let engine = start_engine(
        config,
        executor,
        model,
        CoreOptions {
            loggers: vec![Box::new(metrics.logger())],
            event_sinks,
            insight: opts.insight,
            ..Default::default()
        },
    )
    .expect("engine starts");
    let args = ServerArgs {
        api_key: opts.api_key.clone(),
        enable_per_request_metrics: opts.per_request_metrics,
        max_body_bytes: opts.max_body_bytes,
        log_stats_interval: 0.0,
        served_model_name: opts.served_model_names.clone(),
        event_log,
        reasoning_parser: opts.reasoning_parser,
        ..ServerArgs::default()
    };
    let app = router(AppState::new(
        engine.clone(),
        Arc::clone(&tokenizer),
        metrics.clone(),
        &args,
    ));
    Harness {
        app,
        engine,
        tokenizer,
        metrics,
    }
}

impl Harness {
    pub async fn send(&self, req: Request<Body>) -> Response {
        self.app.clone().oneshot(req).await.expect("infallible")
    }

    pub async fn post(&self, path: &str, body: Value) -> (StatusCode, Value, Response) {
        self.post_with(path, body, &[]).await
    }

    pub async fn post_with(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Value, Response) {
        let mut b = Request::post(path).header("content-type", "application/json");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self
            .send(b.body(Body::from(body.to_string())).unwrap())
            .await;
        let status = resp.status();
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&bytes)
            .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
        (status, json, Response::from_parts(parts, Body::empty()))
    }

    pub async fn post_raw(&self, path: &str, body: &'static str) -> (StatusCode, Value) {
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let resp = self.send(req).await;
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// A streaming POST read to the end: the SSE events as (event name, data).
    pub async fn stream(
        &self,
        path: &str,
        body: Value,
    ) -> (StatusCode, Vec<(Option<String>, String)>, Response) {
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = self.send(req).await;
        let status = resp.status();
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        (
            status,
            parse_sse(&text),
            Response::from_parts(parts, Body::empty()),
        )
    }

    pub async fn get(&self, path: &str) -> (StatusCode, String) {
        let resp = self
            .send(Request::get(path).body(Body::empty()).unwrap())
            .await;
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    pub async fn scrape(&self) -> Scrape {
        let (status, text) = self.get("/metrics").await;
        assert_eq!(status, StatusCode::OK);
        Scrape::parse(&text)
    }

    pub async fn tokenize_prompt(&self, prompt: &str) -> usize {
        let (s, v, _) = self
            .post("/tokenize", serde_json::json!({"prompt": prompt}))
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v["count"].as_u64().unwrap() as usize
    }

    /// Polls `/metrics` until `pred` holds (the engine reports asynchronously).
    pub async fn wait_metrics(&self, what: &str, pred: impl Fn(&Scrape) -> bool) -> Scrape {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let s = self.scrape().await;
            if pred(&s) {
                return s;
            }
            if tokio::time::Instant::now() > deadline {
                panic!("timed out waiting for {what}; metrics:\n{:#?}", s.samples);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Splits an SSE body into (event, data) pairs.
pub fn parse_sse(text: &str) -> Vec<(Option<String>, String)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut event = None;
            let mut data = Vec::new();
            for line in e.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = Some(v.trim().to_string());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                }
            }
            (event, data.join("\n"))
        })
        .collect()
}

/// Prometheus text, as (name, labels) → value.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    pub samples: Vec<(String, HashMap<String, String>, f64)>,
}

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        let mut samples = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (head, value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = match head.split_once('{') {
                Some((n, rest)) => {
                    let mut map = HashMap::new();
                    for kv in rest
                        .trim_end_matches('}')
                        .split(',')
                        .filter(|s| !s.is_empty())
                    {
                        let (k, v) = kv.split_once('=').unwrap();
                        map.insert(k.to_string(), v.trim_matches('"').to_string());
                    }
                    (n.to_string(), map)
                }
                None => (head.to_string(), HashMap::new()),
            };
            let value = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap(),
            };
            samples.push((name, labels, value));
        }
        Scrape { samples }
    }

    /// Sum of all samples of `name` whose labels include `filter`.
    pub fn get(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && filter
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| *v)
            .sum()
    }

    pub fn val(&self, name: &str) -> u64 {
        self.get(name, &[]) as u64
    }

    /// Every `_total` counter (and histogram `_count`/`_sum`), for monotonicity checks.
    pub fn monotonic(&self) -> HashMap<String, f64> {
        self.samples
            .iter()
            .filter(|(n, _, _)| {
                n.ends_with("_total") || n.ends_with("_count") || n.ends_with("_bucket")
            })
            .map(|(n, l, v)| {
                let mut keys: Vec<_> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
                keys.sort();
                (format!("{n}{{{}}}", keys.join(",")), *v)
            })
            .collect()
    }
}
