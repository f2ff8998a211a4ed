//! The Prometheus registry behind `/metrics`.
//!
//! Every engine counter follows the core's one table ([`COUNTERS`]) and moves only by the
//! engine's per-interval deltas; gauges are read off the engine when scraped (so they are true
//! whenever they are read); histograms observe the engine's per-request and per-step records
//! ([`HISTOGRAMS`]). vLLM's names, types, labels (`model_name`, `engine`) and buckets
//! throughout; `http_*` as prometheus-fastapi-instrumentator exports them for vLLM, and the
//! standard `process_*` metrics. The server derives no accounting number itself.

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use cachet_core::stats::{Gauges, COUNTERS};
use cachet_core::{FinishReason, FinishedRequestStats};
use cachet_engine::{EngineState, StatLogger, StepStats};
use prometheus_client::encoding::{prometheus_text, text};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::process::ProcessCollector;

mod summary;
pub use summary::{format_log_line, markdown_table, LogLineLogger};

type Labels = Vec<(&'static str, String)>;
type GaugeF64 = Gauge<f64, AtomicU64>;

/// vLLM's buckets for time to first token.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for inter-token latency and time per output token.
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's `request_latency_buckets` (e2e, queue, inference, prefill, decode).
pub const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's buckets for `iteration_tokens_total`.
pub const ITERATION_TOKEN_BUCKETS: [f64; 13] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// prometheus-fastapi-instrumentator's buckets for `http_request_duration_seconds`.
pub const HTTP_DURATION_BUCKETS: [f64; 3] = [0.1, 0.5, 1.0];
/// ... and for `http_request_duration_highr_seconds`.
pub const HTTP_DURATION_HIGHR_BUCKETS: [f64; 21] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0,
    7.5, 10.0, 30.0, 60.0,
];

/// vLLM's `build_1_2_5_buckets(max_value)`: 1, 2, 5, 10, 20, 50, ... up to `max_value`.
pub fn build_1_2_5_buckets(max_value: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale: u64 = 1;
    loop {
        for m in [1u64, 2, 5] {
            match m.checked_mul(scale) {
                Some(v) if v <= max_value => out.push(v as f64),
                _ => return out,
            }
        }
        scale = match scale.checked_mul(10) {
            Some(s) => s,
            None => return out,
        };
    }
}

/// Where a histogram's samples come from.
#[derive(Clone, Copy)]
pub enum HistSource {
    /// One value per finished request (`None`: not observed).
    Finished(fn(&FinishedRequestStats) -> Option<f64>),
    /// The step's TTFT samples.
    Ttft,
    /// The step's inter-token samples.
    Itl,
    /// Tokens scheduled in the step.
    IterationTokens,
}

#[derive(Clone, Copy)]
pub enum Buckets {
    Fixed(&'static [f64]),
    /// vLLM's 1-2-5 series up to the context length.
    Tokens,
}

/// One histogram: name, help, buckets and what it observes.
pub struct HistSpec {
    pub name: &'static str,
    pub help: &'static str,
    pub buckets: Buckets,
    pub source: HistSource,
}

/// Every histogram, declared once.
pub const HISTOGRAMS: &[HistSpec] = &[
    HistSpec {
        name: "vllm:time_to_first_token_seconds",
        help: "Histogram of time to first token in seconds",
        buckets: Buckets::Fixed(&TTFT_BUCKETS),
        source: HistSource::Ttft,
    },
    HistSpec {
        name: "vllm:inter_token_latency_seconds",
        help: "Histogram of inter-token latency in seconds",
        buckets: Buckets::Fixed(&ITL_BUCKETS),
        source: HistSource::Itl,
    },
    HistSpec {
        name: "vllm:request_time_per_output_token_seconds",
        help: "Histogram of time_per_output_token_seconds per request",
        buckets: Buckets::Fixed(&ITL_BUCKETS),
        source: HistSource::Finished(|f| Some(f.time_per_output_token_s().unwrap_or(0.0))),
    },
    HistSpec {
        name: "vllm:e2e_request_latency_seconds",
        help: "Histogram of e2e request latency in seconds",
        buckets: Buckets::Fixed(&REQUEST_LATENCY_BUCKETS),
        source: HistSource::Finished(|f| Some(f.times.e2e_s())),
    },
    HistSpec {
        name: "vllm:request_queue_time_seconds",
        help: "Histogram of time spent in WAITING phase for request",
        buckets: Buckets::Fixed(&REQUEST_LATENCY_BUCKETS),
        source: HistSource::Finished(|f| Some(f.times.queue_s())),
    },
    HistSpec {
        name: "vllm:request_inference_time_seconds",
        help: "Histogram of time spent in RUNNING phase for request",
        buckets: Buckets::Fixed(&REQUEST_LATENCY_BUCKETS),
        source: HistSource::Finished(|f| Some(f.times.inference_s())),
    },
    HistSpec {
        name: "vllm:request_prefill_time_seconds",
        help: "Histogram of time spent in PREFILL phase for request",
        buckets: Buckets::Fixed(&REQUEST_LATENCY_BUCKETS),
        source: HistSource::Finished(|f| Some(f.times.prefill_s())),
    },
    HistSpec {
        name: "vllm:request_decode_time_seconds",
        help: "Histogram of time spent in DECODE phase for request",
        buckets: Buckets::Fixed(&REQUEST_LATENCY_BUCKETS),
        source: HistSource::Finished(|f| Some(f.times.decode_s())),
    },
    HistSpec {
        name: "vllm:request_prompt_tokens",
        help: "Number of prefill tokens processed",
        buckets: Buckets::Tokens,
        source: HistSource::Finished(|f| Some(f.prompt_tokens as f64)),
    },
    HistSpec {
        name: "vllm:request_generation_tokens",
        help: "Number of generation tokens processed",
        buckets: Buckets::Tokens,
        source: HistSource::Finished(|f| Some(f.generation_tokens as f64)),
    },
    HistSpec {
        name: "vllm:request_max_num_generation_tokens",
        help: "Histogram of maximum number of requested generation tokens",
        buckets: Buckets::Tokens,
        // vLLM observes the most tokens generated among a request's n samples (n = 1 here).
        source: HistSource::Finished(|f| Some(f.generation_tokens as f64)),
    },
    HistSpec {
        name: "vllm:request_params_max_tokens",
        help: "Histogram of the max_tokens request parameter",
        buckets: Buckets::Tokens,
        source: HistSource::Finished(|f| Some(f.max_tokens as f64)),
    },
    HistSpec {
        name: "vllm:request_prefill_kv_computed_tokens",
        help: "Histogram of new KV tokens computed during prefill (excluding cached tokens)",
        buckets: Buckets::Tokens,
        source: HistSource::Finished(|f| f.prefill_stats.map(|p| p.computed_tokens as f64)),
    },
    HistSpec {
        name: "vllm:iteration_tokens_total",
        help: "Histogram of number of tokens per engine_step",
        buckets: Buckets::Fixed(&ITERATION_TOKEN_BUCKETS),
        source: HistSource::IterationTokens,
    },
];

/// One gauge read off the engine at scrape time.
pub struct GaugeSpec {
    pub name: &'static str,
    pub help: &'static str,
    pub value: fn(&Gauges) -> f64,
}

/// Every plain engine gauge, declared once (the labeled ones — waiting by reason, sleep state,
/// cache config — are below, in [`MetricsHandle::new`]).
pub const GAUGES: &[GaugeSpec] = &[
    GaugeSpec {
        name: "vllm:num_requests_running",
        help: "Number of requests in model execution batches",
        value: |g| g.num_requests_running as f64,
    },
    GaugeSpec {
        name: "vllm:num_requests_waiting",
        help: "Number of requests waiting to be processed",
        value: |g| g.num_requests_waiting as f64,
    },
    GaugeSpec {
        name: "vllm:kv_cache_usage_perc",
        help: "KV-cache usage. 1 means 100 percent usage",
        value: |g| g.kv_cache_usage_perc,
    },
    GaugeSpec {
        name: "cachet:kv_cache_only_blocks",
        help: "KV blocks held only by the prefix cache (no live request)",
        value: |g| g.cache_only_blocks as f64,
    },
    GaugeSpec {
        name: "cachet:kv_token_occupancy_perc",
        help: "Fraction of KV token slots holding valid KV of live requests. 1 means 100 percent",
        value: |g| g.kv_token_occupancy_perc,
    },
    GaugeSpec {
        name: "cachet:parked_sessions",
        help: "Resumable sessions whose KV is parked between turns",
        value: |g| g.parked_sessions as f64,
    },
    GaugeSpec {
        name: "cachet:parked_session_blocks",
        help: "KV blocks held by parked sessions",
        value: |g| g.parked_session_blocks as f64,
    },
];

/// Static facts for `vllm:cache_config_info`.
#[derive(Clone, Debug, Default)]
pub struct CacheConfigInfo {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub cache_dtype: String,
    pub enable_prefix_caching: bool,
    /// Host-tier capacity in blocks, when a host tier is configured.
    pub num_cpu_blocks: Option<usize>,
    pub kv_cache_memory_bytes: u64,
}

impl CacheConfigInfo {
    /// vLLM formats every value with Python's `str()`.
    fn labels(&self) -> Labels {
        let py_bool = |b: bool| if b { "True" } else { "False" }.to_string();
        vec![
            ("block_size", self.block_size.to_string()),
            ("cache_dtype", self.cache_dtype.clone()),
            ("enable_prefix_caching", py_bool(self.enable_prefix_caching)),
            ("num_gpu_blocks", self.num_gpu_blocks.to_string()),
            (
                "num_cpu_blocks",
                self.num_cpu_blocks
                    .map_or("None".to_string(), |n| n.to_string()),
            ),
            ("prefix_caching_hash_algo", "blake3".to_string()),
            (
                "kv_cache_memory_bytes",
                self.kv_cache_memory_bytes.to_string(),
            ),
        ]
    }
}

/// Handles to every engine metric (each a cheap `Arc` inside).
#[derive(Debug)]
struct EngineMetrics {
    /// One per [`COUNTERS`] entry, same order.
    counters: Vec<Counter>,
    request_success: Family<Labels, Counter>,
    /// One per [`HISTOGRAMS`] entry, same order.
    histograms: Vec<Histogram>,
    /// One per [`GAUGES`] entry, same order.
    gauges: Vec<GaugeF64>,
    waiting_by_reason: Family<Labels, Gauge>,
    sleep_state: Family<Labels, Gauge>,
    /// One per [`TENANT_COUNTERS`] entry, by `tenant`.
    tenants: Vec<Family<Labels, Counter>>,
    /// `cachet:prefix_cache_hit_rate{pool_scale}`.
    hit_rate: Family<Labels, GaugeF64>,
    /// One per [`SPEC_COUNTERS`] entry, same order.
    spec: Vec<Counter>,
    /// `vllm:spec_decode_num_accepted_tokens_per_pos{position}`.
    spec_per_pos: Family<Labels, Counter>,
}

/// A speculative-decoding counter: (metric, help, the step's field).
type SpecCounter = (
    &'static str,
    &'static str,
    fn(&cachet_core::spec_decode::SpecDecodeStats) -> u64,
);

/// Speculative decoding (`--speculative ngram`), vLLM's names; zero without speculation.
pub const SPEC_COUNTERS: &[SpecCounter] = &[
    (
        "vllm:spec_decode_num_drafts",
        "Number of spec decoding drafts.",
        |s| s.num_drafts,
    ),
    (
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        |s| s.num_draft_tokens,
    ),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        |s| s.num_accepted_tokens,
    ),
];

/// `vllm:spec_decode_num_accepted_tokens_per_pos`'s name and help.
const SPEC_PER_POS: (&str, &str) = (
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Accepted tokens per draft position.",
);

/// A per-tenant counter: (metric, help, the delta's field).
type TenantCounter = (
    &'static str,
    &'static str,
    fn(&cachet_engine::TenantDelta) -> u64,
);

/// Per-tenant counters (`tenant`: the API key's name, else `salt-` and a digest of the
/// `cache_salt`, else `default`; at most `--max-tenant-labels` values, the rest `other`).
pub const TENANT_COUNTERS: &[TenantCounter] = &[
    (
        "cachet:tenant_prefix_cache_queries",
        "Prefix cache queries (prompt tokens looked up) by tenant",
        |d| d.prefix_cache_queries,
    ),
    (
        "cachet:tenant_prefix_cache_hits",
        "Prefix cache hits (tokens found in the local cache) by tenant",
        |d| d.prefix_cache_hits,
    ),
    (
        "cachet:tenant_prompt_tokens",
        "Prompt tokens by tenant",
        |d| d.prompt_tokens,
    ),
    (
        "cachet:tenant_cached_tokens",
        "Prompt tokens served from cache (local and external) by tenant",
        |d| d.cached_tokens,
    ),
];

/// `cachet:prefix_cache_hit_rate{pool_scale}`'s help.
const HIT_RATE_HELP: &str = "Local prefix-cache hit rate since the start (hits / queries): measured (1x), and estimated for a pool with 2x and 4x the blocks from the shadow set of evicted blocks";

/// The server's own metrics: `http_requests_total` and the duration histograms.
#[derive(Debug)]
pub(crate) struct HttpMetrics {
    pub(crate) requests: Family<Labels, Counter>,
    pub(crate) duration: Family<Labels, Histogram>,
    pub(crate) duration_highr: Histogram,
}

/// The registry shared by the engine's [`PrometheusLogger`] and the `/metrics` route.
#[derive(Clone, Debug)]
pub struct MetricsHandle {
    registry: Arc<Registry>,
    engine: Arc<EngineMetrics>,
    pub(crate) http: Arc<HttpMetrics>,
}

fn label(k: &'static str, v: &str) -> Labels {
    vec![(k, v.to_string())]
}

impl MetricsHandle {
    /// Registers every metric; engine metrics carry `model_name` and `engine="0"`. Token-count
    /// histograms get buckets up to `max_model_len`, as vLLM's do.
    pub fn new(model_name: &str, max_model_len: usize, cache: CacheConfigInfo) -> Self {
        let mut root = Registry::default();
        let token_buckets = build_1_2_5_buckets(max_model_len as u64);
        let r = root.sub_registry_with_labels(
            [
                (
                    Cow::Borrowed("model_name"),
                    Cow::Owned(model_name.to_string()),
                ),
                (Cow::Borrowed("engine"), Cow::Borrowed("0")),
            ]
            .into_iter(),
        );

        // Counters, from the core's table: a labeled metric is one family, registered once.
        let mut counters = Vec::with_capacity(COUNTERS.len());
        let mut families: Vec<(&'static str, Family<Labels, Counter>)> = Vec::new();
        for spec in COUNTERS {
            match spec.label {
                None => {
                    let c = Counter::default();
                    r.register(spec.metric, spec.help, c.clone());
                    counters.push(c);
                }
                Some((k, v)) => {
                    let fam = match families.iter().find(|(m, _)| *m == spec.metric) {
                        Some((_, f)) => f.clone(),
                        None => {
                            let f = Family::<Labels, Counter>::default();
                            r.register(spec.metric, spec.help, f.clone());
                            families.push((spec.metric, f.clone()));
                            f
                        }
                    };
                    // Every label value exists from the start, at zero, as in vLLM.
                    let c = fam.get_or_create(&label(k, v)).clone();
                    counters.push(c);
                }
            }
        }
        let request_success = Family::<Labels, Counter>::default();
        for reason in FinishReason::ALL {
            let _ = request_success.get_or_create(&label("finished_reason", reason.as_str()));
        }
        r.register(
            "vllm:request_success",
            "Count of finished requests by finish reason (aborts and errors included)",
            request_success.clone(),
        );

        let histograms = HISTOGRAMS
            .iter()
            .map(|h| {
                let hist = match h.buckets {
                    Buckets::Fixed(b) => Histogram::new(b.iter().copied()),
                    Buckets::Tokens => Histogram::new(token_buckets.iter().copied()),
                };
                r.register(h.name, h.help, hist.clone());
                hist
            })
            .collect();

        let gauges = GAUGES
            .iter()
            .map(|g| {
                let gauge = GaugeF64::default();
                r.register(g.name, g.help, gauge.clone());
                gauge
            })
            .collect();
        let waiting_by_reason = Family::<Labels, Gauge>::default();
        for reason in ["capacity", "deferred"] {
            let _ = waiting_by_reason.get_or_create(&label("reason", reason));
        }
        r.register(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = waiting for external KV loads. Sum of all reasons equals vllm:num_requests_waiting",
            waiting_by_reason.clone(),
        );
        let sleep_state = Family::<Labels, Gauge>::default();
        for s in ["awake", "weights_offloaded", "discard_all"] {
            let _ = sleep_state.get_or_create(&label("sleep_state", s));
        }
        r.register(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2",
            sleep_state.clone(),
        );
        let tenants = TENANT_COUNTERS
            .iter()
            .map(|(name, help, _)| {
                let f = Family::<Labels, Counter>::default();
                r.register(*name, *help, f.clone());
                f
            })
            .collect();
        let hit_rate = Family::<Labels, GaugeF64>::default();
        for scale in ["1x", "2x", "4x"] {
            let _ = hit_rate.get_or_create(&label("pool_scale", scale));
        }
        r.register(
            "cachet:prefix_cache_hit_rate",
            HIT_RATE_HELP,
            hit_rate.clone(),
        );
        let spec = SPEC_COUNTERS
            .iter()
            .map(|(name, help, _)| {
                let c = Counter::default();
                r.register(*name, *help, c.clone());
                c
            })
            .collect();
        let spec_per_pos = Family::<Labels, Counter>::default();
        r.register(SPEC_PER_POS.0, SPEC_PER_POS.1, spec_per_pos.clone());
        let cache_info = Family::<Labels, Gauge>::default();
        cache_info.get_or_create(&cache.labels()).set(1);
        r.register(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            cache_info,
        );

        // The server's own metrics: no engine labels, as prometheus-fastapi-instrumentator's.
        let http = HttpMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new(HTTP_DURATION_BUCKETS.iter().copied())
            }),
            duration_highr: Histogram::new(HTTP_DURATION_HIGHR_BUCKETS.iter().copied()),
        };
        root.register(
            "http_requests",
            "Total number of requests by method, status and handler",
            http.requests.clone(),
        );
        root.register(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important",
            http.duration.clone(),
        );
        root.register(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations",
            http.duration_highr.clone(),
        );
        root.register_collector(Box::new(ProcessCollector::new()));

        let handle = MetricsHandle {
            registry: Arc::new(root),
            engine: Arc::new(EngineMetrics {
                counters,
                request_success,
                histograms,
                gauges,
                waiting_by_reason,
                sleep_state,
                tenants,
                hit_rate,
                spec,
                spec_per_pos,
            }),
            http: Arc::new(http),
        };
        handle.set_engine_state(EngineState::Running);
        handle
    }

    /// Registers a collector read at every scrape (the KV tiers':
    /// [`crate::tier_metrics::TierCollector`]). Only before the handle is first cloned;
    /// returns whether it was registered.
    pub fn add_collector(&mut self, c: Box<dyn prometheus_client::collector::Collector>) -> bool {
        match Arc::get_mut(&mut self.registry) {
            Some(r) => {
                r.register_collector(c);
                true
            }
            None => false,
        }
    }

    /// A stat logger to hand to the engine; it writes into this registry.
    pub fn logger(&self) -> PrometheusLogger {
        PrometheusLogger {
            m: Arc::clone(&self.engine),
        }
    }

    /// Set the gauges from the engine's current state (called on every scrape).
    pub fn set_gauges(&self, g: &Gauges) {
        let m = &self.engine;
        for (spec, gauge) in GAUGES.iter().zip(&m.gauges) {
            gauge.set((spec.value)(g));
        }
        let deferred = g.num_requests_waiting_for_kv;
        let capacity = g.num_requests_waiting.saturating_sub(deferred);
        m.waiting_by_reason
            .get_or_create(&label("reason", "capacity"))
            .set(to_i64(capacity));
        m.waiting_by_reason
            .get_or_create(&label("reason", "deferred"))
            .set(to_i64(deferred));
    }

    /// `vllm:engine_sleep_state`: awake while the engine serves (or drains); every state 0
    /// once it is dead or stopped.
    pub fn set_engine_state(&self, s: EngineState) {
        let awake = matches!(s, EngineState::Running | EngineState::Draining);
        let m = &self.engine;
        m.sleep_state
            .get_or_create(&label("sleep_state", "awake"))
            .set(awake as i64);
        for other in ["weights_offloaded", "discard_all"] {
            m.sleep_state
                .get_or_create(&label("sleep_state", other))
                .set(0);
        }
    }

    /// Prometheus text exposition format 0.0.4 (what vLLM serves).
    pub fn encode_prometheus(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// OpenMetrics text format 1.0.0.
    pub fn encode_openmetrics(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Writes each engine step's stats into the registry. Runs on the engine thread: atomics only.
#[derive(Debug)]
pub struct PrometheusLogger {
    m: Arc<EngineMetrics>,
}

fn to_i64(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

impl StatLogger for PrometheusLogger {
    fn record(&mut self, step: &StepStats) {
        let m = &self.m;
        for (c, v) in m.counters.iter().zip(step.deltas.values()) {
            if v > 0 {
                c.inc_by(v);
            }
        }
        for t in &step.tenants {
            let l = label("tenant", &t.tenant);
            for ((_, _, value), fam) in TENANT_COUNTERS.iter().zip(&m.tenants) {
                let v = value(t);
                if v > 0 {
                    fam.get_or_create(&l).inc_by(v);
                }
            }
        }
        let h = &step.hit_rates;
        for (scale, v) in [
            ("1x", h.hit_rate),
            ("2x", h.hit_rate_2x),
            ("4x", h.hit_rate_4x),
        ] {
            m.hit_rate.get_or_create(&label("pool_scale", scale)).set(v);
        }
        if !step.spec.is_zero() {
            for ((_, _, value), c) in SPEC_COUNTERS.iter().zip(&m.spec) {
                c.inc_by(value(&step.spec));
            }
            for (pos, &v) in step.spec.accepted_per_pos.iter().enumerate() {
                m.spec_per_pos
                    .get_or_create(&label("position", &pos.to_string()))
                    .inc_by(v);
            }
        }
        for f in &step.finished {
            m.request_success
                .get_or_create(&label("finished_reason", f.finish_reason.as_str()))
                .inc();
        }
        for (spec, h) in HISTOGRAMS.iter().zip(&m.histograms) {
            match spec.source {
                HistSource::Finished(value) => {
                    for v in step.finished.iter().filter_map(value) {
                        h.observe(v);
                    }
                }
                HistSource::Ttft => step.ttft_s.iter().for_each(|&t| h.observe(t)),
                HistSource::Itl => step.itl_s.iter().for_each(|&t| h.observe(t)),
                HistSource::IterationTokens => {
                    if let Some(t) = step.iteration_tokens {
                        h.observe(t as f64);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_core::stats::CounterDeltas;

    fn handle() -> MetricsHandle {
        MetricsHandle::new("m", 128, CacheConfigInfo::default())
    }

    #[test]
    fn log_line_like_vllm() {
        let d = CounterDeltas {
            prompt_tokens: 200,
            generation_tokens: 50,
            prefix_cache_queries: 200,
            prefix_cache_hits: 50,
            ..Default::default()
        };
        let g = Gauges {
            num_requests_running: 2,
            num_requests_waiting: 1,
            kv_cache_usage_perc: 0.25,
            ..Default::default()
        };
        assert_eq!(
            format_log_line(&d, &g, 10.0),
            "Engine 000: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 \
             tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit \
             rate: 25.0%"
        );
    }

    #[test]
    fn buckets_like_vllm() {
        assert_eq!(
            build_1_2_5_buckets(100),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        assert_eq!(build_1_2_5_buckets(1), vec![1.0]);
    }

    #[test]
    fn every_counter_of_the_table_is_exposed() {
        let text = handle().encode_prometheus().unwrap();
        for c in COUNTERS {
            let name = format!("{}_total", c.metric);
            let line = match c.label {
                None => format!("{name}{{model_name=\"m\",engine=\"0\"}} 0"),
                Some((k, v)) => format!("{name}{{model_name=\"m\",engine=\"0\",{k}=\"{v}\"}} 0"),
            };
            assert!(text.contains(&line), "missing {line:?} in\n{text}");
            assert_eq!(
                text.matches(&format!("# TYPE {name} counter\n")).count(),
                1,
                "{name} declared once"
            );
        }
        assert!(!text.contains("_total_total"));
    }

    #[test]
    fn exposition_uses_vllm_names_types_and_zero_series() {
        let h = handle();
        h.set_gauges(&Gauges {
            num_requests_waiting: 3,
            num_requests_waiting_for_kv: 1,
            ..Default::default()
        });
        let text = h.encode_prometheus().unwrap();
        for want in [
            "# TYPE vllm:num_requests_running gauge",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            "# TYPE vllm:iteration_tokens_total histogram",
            "# TYPE vllm:request_time_per_output_token_seconds histogram",
            "vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"error\"} 0",
            "vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"abort\"} 0",
            "vllm:num_requests_waiting_by_reason{model_name=\"m\",engine=\"0\",reason=\"capacity\"} 2",
            "vllm:num_requests_waiting_by_reason{model_name=\"m\",engine=\"0\",reason=\"deferred\"} 1",
            "vllm:engine_sleep_state{model_name=\"m\",engine=\"0\",sleep_state=\"awake\"} 1",
            "vllm:engine_sleep_state{model_name=\"m\",engine=\"0\",sleep_state=\"discard_all\"} 0",
            "enable_prefix_caching=\"False\"",
            "# TYPE http_request_duration_highr_seconds histogram",
            "# TYPE process_cpu_seconds_total counter",
            "# TYPE process_resident_memory_bytes gauge",
            "# TYPE process_open_fds gauge",
            "# TYPE process_max_fds gauge",
            "# TYPE process_start_time_seconds gauge",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        h.set_engine_state(EngineState::Dead);
        let text = h.encode_prometheus().unwrap();
        assert!(text.contains(
            "vllm:engine_sleep_state{model_name=\"m\",engine=\"0\",sleep_state=\"awake\"} 0"
        ));
        let om = h.encode_openmetrics().unwrap();
        assert!(om.contains("# TYPE vllm:prefix_cache_queries counter"));
        assert!(om.ends_with("# EOF\n"));
    }
}
