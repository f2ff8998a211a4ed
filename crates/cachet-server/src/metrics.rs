//! The Prometheus registry behind `/metrics`, fed only by the engine's [`StepStats`].
//!
//! Every counter here is incremented by an engine delta and nothing else; gauges are set from the
//! engine's gauges; histograms observe the engine's per-request and per-step timings. The server
//! never derives an accounting number itself.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use cachet_core::FinishReason;
use cachet_engine::{StatLogger, StepStats};
use prometheus_client::encoding::{prometheus_text, text};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Every exported metric name, in one place.
///
/// Counter names carry no `_total`: the encoder appends it, so `PREFIX_CACHE_QUERIES` is exposed
/// as `vllm:prefix_cache_queries_total`, exactly as vLLM exposes it.
pub mod metric_names {
    pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
    pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
    pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
    pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries";
    pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits";
    pub const EXTERNAL_PREFIX_CACHE_QUERIES: &str = "vllm:external_prefix_cache_queries";
    pub const EXTERNAL_PREFIX_CACHE_HITS: &str = "vllm:external_prefix_cache_hits";
    pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions";
    pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens";
    pub const PROMPT_TOKENS_BY_SOURCE: &str = "vllm:prompt_tokens_by_source";
    pub const PROMPT_TOKENS_CACHED: &str = "vllm:prompt_tokens_cached";
    pub const GENERATION_TOKENS: &str = "vllm:generation_tokens";
    pub const REQUEST_SUCCESS: &str = "vllm:request_success";
    pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "vllm:time_to_first_token_seconds";
    pub const INTER_TOKEN_LATENCY_SECONDS: &str = "vllm:inter_token_latency_seconds";
    pub const E2E_REQUEST_LATENCY_SECONDS: &str = "vllm:e2e_request_latency_seconds";
    pub const REQUEST_QUEUE_TIME_SECONDS: &str = "vllm:request_queue_time_seconds";
    pub const REQUEST_INFERENCE_TIME_SECONDS: &str = "vllm:request_inference_time_seconds";
    pub const REQUEST_PREFILL_TIME_SECONDS: &str = "vllm:request_prefill_time_seconds";
    pub const REQUEST_DECODE_TIME_SECONDS: &str = "vllm:request_decode_time_seconds";
    pub const REQUEST_PROMPT_TOKENS: &str = "vllm:request_prompt_tokens";
    pub const REQUEST_GENERATION_TOKENS: &str = "vllm:request_generation_tokens";
    pub const REQUEST_PREFILL_KV_COMPUTED_TOKENS: &str = "vllm:request_prefill_kv_computed_tokens";
    pub const ITERATION_TOKENS_TOTAL: &str = "vllm:iteration_tokens_total";

    pub const PREEMPTED_PREFIX_CACHE_QUERIES: &str = "cachet:preempted_prefix_cache_queries";
    pub const PREEMPTED_PREFIX_CACHE_HITS: &str = "cachet:preempted_prefix_cache_hits";
    pub const CACHE_CREATION_TOKENS: &str = "cachet:cache_creation_tokens";
    pub const KV_BLOCKS_ALLOCATED: &str = "cachet:kv_blocks_allocated";
    pub const KV_BLOCKS_FILLED: &str = "cachet:kv_blocks_filled";
    pub const KV_BLOCKS_EVICTED: &str = "cachet:kv_blocks_evicted";
    pub const KV_CACHE_ONLY_BLOCKS: &str = "cachet:kv_cache_only_blocks";
    pub const KV_TOKEN_OCCUPANCY_PERC: &str = "cachet:kv_token_occupancy_perc";

    /// Label values of `prompt_tokens_by_source{source}`.
    pub const SOURCE_LOCAL_COMPUTE: &str = "local_compute";
    pub const SOURCE_LOCAL_CACHE_HIT: &str = "local_cache_hit";
    pub const SOURCE_EXTERNAL_KV_TRANSFER: &str = "external_kv_transfer";

    /// The names as they appear in the exposition (counters with `_total`).
    pub fn exposed(name: &str, is_counter: bool) -> String {
        if is_counter {
            format!("{name}_total")
        } else {
            name.to_string()
        }
    }
}

use metric_names as n;

/// vLLM's buckets for time to first token.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for inter-token latency (and time per output token).
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's `request_latency_buckets` (e2e, queue, inference, prefill, decode).
const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's buckets for `iteration_tokens_total`.
const ITERATION_TOKEN_BUCKETS: [f64; 13] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
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

type Labels = Vec<(&'static str, &'static str)>;
type GaugeF64 = Gauge<f64, AtomicU64>;

/// Handles to every metric (each is a cheap `Arc` inside).
#[derive(Debug)]
struct Metrics {
    running: Gauge,
    waiting: Gauge,
    kv_cache_usage: GaugeF64,
    cache_only_blocks: Gauge,
    token_occupancy: GaugeF64,
    prefix_queries: Counter,
    prefix_hits: Counter,
    external_queries: Counter,
    external_hits: Counter,
    preempted_queries: Counter,
    preempted_hits: Counter,
    num_preemptions: Counter,
    prompt_tokens: Counter,
    prompt_by_source: Family<Labels, Counter>,
    prompt_cached: Counter,
    generation_tokens: Counter,
    request_success: Family<Labels, Counter>,
    cache_creation: Counter,
    blocks_allocated: Counter,
    blocks_filled: Counter,
    blocks_evicted: Counter,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    inference: Histogram,
    prefill: Histogram,
    decode: Histogram,
    req_prompt: Histogram,
    req_generation: Histogram,
    req_prefill_computed: Histogram,
    iteration_tokens: Histogram,
}

fn reason_labels(reason: FinishReason) -> Labels {
    vec![("finished_reason", reason.as_str())]
}

fn source_labels(source: &'static str) -> Labels {
    vec![("source", source)]
}

/// The registry shared by the engine's [`PrometheusLogger`] and the `/metrics` route.
#[derive(Clone, Debug)]
pub struct MetricsHandle {
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
}

/// Current totals and gauges, read back from the registry (for the log line and tests).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    pub num_requests_running: i64,
    pub num_requests_waiting: i64,
    pub kv_cache_usage_perc: f64,
    pub kv_cache_only_blocks: i64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub request_success_stop: u64,
    pub request_success_length: u64,
    pub request_success_abort: u64,
}

impl MetricsHandle {
    /// Registers every metric with the labels `model_name` and `engine="0"`. Token-count
    /// histograms get buckets up to `max_model_len`, as vLLM's do.
    pub fn new(model_name: &str, max_model_len: usize) -> Self {
        let mut registry = Registry::with_labels(
            [
                ("model_name".into(), model_name.to_string().into()),
                ("engine".into(), "0".into()),
            ]
            .into_iter(),
        );
        let token_buckets = build_1_2_5_buckets(max_model_len as u64);
        let hist = |b: &[f64]| Histogram::new(b.iter().copied());
        let m = Metrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_cache_usage: GaugeF64::default(),
            cache_only_blocks: Gauge::default(),
            token_occupancy: GaugeF64::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            external_queries: Counter::default(),
            external_hits: Counter::default(),
            preempted_queries: Counter::default(),
            preempted_hits: Counter::default(),
            num_preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            prompt_by_source: Family::default(),
            prompt_cached: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            cache_creation: Counter::default(),
            blocks_allocated: Counter::default(),
            blocks_filled: Counter::default(),
            blocks_evicted: Counter::default(),
            ttft: hist(&TTFT_BUCKETS),
            itl: hist(&ITL_BUCKETS),
            e2e: hist(&REQUEST_LATENCY_BUCKETS),
            queue: hist(&REQUEST_LATENCY_BUCKETS),
            inference: hist(&REQUEST_LATENCY_BUCKETS),
            prefill: hist(&REQUEST_LATENCY_BUCKETS),
            decode: hist(&REQUEST_LATENCY_BUCKETS),
            req_prompt: hist(&token_buckets),
            req_generation: hist(&token_buckets),
            req_prefill_computed: hist(&token_buckets),
            iteration_tokens: hist(&ITERATION_TOKEN_BUCKETS),
        };
        // Every label value exists from the start, at zero, as in vLLM.
        for r in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Abort,
        ] {
            let _ = m.request_success.get_or_create(&reason_labels(r));
        }
        for s in [
            n::SOURCE_LOCAL_COMPUTE,
            n::SOURCE_LOCAL_CACHE_HIT,
            n::SOURCE_EXTERNAL_KV_TRANSFER,
        ] {
            let _ = m.prompt_by_source.get_or_create(&source_labels(s));
        }

        let r = &mut registry;
        r.register(
            n::NUM_REQUESTS_RUNNING,
            "Number of requests in model execution batches",
            m.running.clone(),
        );
        r.register(
            n::NUM_REQUESTS_WAITING,
            "Number of requests waiting to be processed",
            m.waiting.clone(),
        );
        r.register(
            n::KV_CACHE_USAGE_PERC,
            "KV-cache usage: fraction of blocks held by live requests. 1 means 100 percent usage",
            m.kv_cache_usage.clone(),
        );
        r.register(
            n::PREFIX_CACHE_QUERIES,
            "Prefix cache queries, in terms of number of queried tokens",
            m.prefix_queries.clone(),
        );
        r.register(
            n::PREFIX_CACHE_HITS,
            "Prefix cache hits, in terms of number of cached tokens",
            m.prefix_hits.clone(),
        );
        r.register(
            n::EXTERNAL_PREFIX_CACHE_QUERIES,
            "External prefix cache queries from the KV connector, in terms of number of queried tokens",
            m.external_queries.clone(),
        );
        r.register(
            n::EXTERNAL_PREFIX_CACHE_HITS,
            "External prefix cache hits from the KV connector, in terms of number of cached tokens",
            m.external_hits.clone(),
        );
        r.register(
            n::NUM_PREEMPTIONS,
            "Cumulative number of preemption from the engine",
            m.num_preemptions.clone(),
        );
        r.register(
            n::PROMPT_TOKENS,
            "Number of prefill tokens processed",
            m.prompt_tokens.clone(),
        );
        r.register(
            n::PROMPT_TOKENS_BY_SOURCE,
            "Number of prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer)",
            m.prompt_by_source.clone(),
        );
        r.register(
            n::PROMPT_TOKENS_CACHED,
            "Number of cached prompt tokens (local and external)",
            m.prompt_cached.clone(),
        );
        r.register(
            n::GENERATION_TOKENS,
            "Number of generation tokens processed",
            m.generation_tokens.clone(),
        );
        r.register(
            n::REQUEST_SUCCESS,
            "Count of finished requests by finish reason (aborts included)",
            m.request_success.clone(),
        );
        r.register(
            n::TIME_TO_FIRST_TOKEN_SECONDS,
            "Histogram of time to first token in seconds",
            m.ttft.clone(),
        );
        r.register(
            n::INTER_TOKEN_LATENCY_SECONDS,
            "Histogram of inter-token latency in seconds",
            m.itl.clone(),
        );
        r.register(
            n::E2E_REQUEST_LATENCY_SECONDS,
            "Histogram of e2e request latency in seconds",
            m.e2e.clone(),
        );
        r.register(
            n::REQUEST_QUEUE_TIME_SECONDS,
            "Histogram of time spent in WAITING phase for request",
            m.queue.clone(),
        );
        r.register(
            n::REQUEST_INFERENCE_TIME_SECONDS,
            "Histogram of time spent in RUNNING phase for request",
            m.inference.clone(),
        );
        r.register(
            n::REQUEST_PREFILL_TIME_SECONDS,
            "Histogram of time spent in PREFILL phase for request",
            m.prefill.clone(),
        );
        r.register(
            n::REQUEST_DECODE_TIME_SECONDS,
            "Histogram of time spent in DECODE phase for request",
            m.decode.clone(),
        );
        r.register(
            n::REQUEST_PROMPT_TOKENS,
            "Number of prefill tokens processed",
            m.req_prompt.clone(),
        );
        r.register(
            n::REQUEST_GENERATION_TOKENS,
            "Number of generation tokens processed",
            m.req_generation.clone(),
        );
        r.register(
            n::REQUEST_PREFILL_KV_COMPUTED_TOKENS,
            "Histogram of new KV tokens computed during prefill (excluding cached tokens)",
            m.req_prefill_computed.clone(),
        );
        r.register(
            n::ITERATION_TOKENS_TOTAL,
            "Histogram of number of tokens per engine_step",
            m.iteration_tokens.clone(),
        );
        r.register(
            n::PREEMPTED_PREFIX_CACHE_QUERIES,
            "Prefix cache queries on re-admission after a preemption, in tokens",
            m.preempted_queries.clone(),
        );
        r.register(
            n::PREEMPTED_PREFIX_CACHE_HITS,
            "Prefix cache hits on re-admission after a preemption, in tokens",
            m.preempted_hits.clone(),
        );
        r.register(
            n::CACHE_CREATION_TOKENS,
            "Computed prompt tokens written into blocks that became new prefix-cache entries",
            m.cache_creation.clone(),
        );
        r.register(
            n::KV_BLOCKS_ALLOCATED,
            "KV blocks taken from the free pool",
            m.blocks_allocated.clone(),
        );
        r.register(
            n::KV_BLOCKS_FILLED,
            "KV blocks that became full with computed or loaded KV",
            m.blocks_filled.clone(),
        );
        r.register(
            n::KV_BLOCKS_EVICTED,
            "Cached KV blocks whose prefix-cache entry was evicted",
            m.blocks_evicted.clone(),
        );
        r.register(
            n::KV_CACHE_ONLY_BLOCKS,
            "KV blocks held only by the prefix cache (no live request)",
            m.cache_only_blocks.clone(),
        );
        r.register(
            n::KV_TOKEN_OCCUPANCY_PERC,
            "Fraction of KV token slots holding valid KV of live requests. 1 means 100 percent",
            m.token_occupancy.clone(),
        );
        MetricsHandle {
            registry: Arc::new(registry),
            metrics: Arc::new(m),
        }
    }

    /// A stat logger to hand to the engine; it writes into this registry.
    pub fn logger(&self) -> PrometheusLogger {
        PrometheusLogger {
            metrics: Arc::clone(&self.metrics),
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

    pub fn snapshot(&self) -> MetricsSnapshot {
        let m = &self.metrics;
        let reason = |r| m.request_success.get_or_create(&reason_labels(r)).get();
        MetricsSnapshot {
            num_requests_running: m.running.get(),
            num_requests_waiting: m.waiting.get(),
            kv_cache_usage_perc: m.kv_cache_usage.get(),
            kv_cache_only_blocks: m.cache_only_blocks.get(),
            prefix_cache_queries: m.prefix_queries.get(),
            prefix_cache_hits: m.prefix_hits.get(),
            prompt_tokens: m.prompt_tokens.get(),
            generation_tokens: m.generation_tokens.get(),
            request_success_stop: reason(FinishReason::Stop),
            request_success_length: reason(FinishReason::Length),
            request_success_abort: reason(FinishReason::Abort),
        }
    }
}

/// Writes each engine step's stats into the registry. Runs on the engine thread: atomics only.
#[derive(Debug)]
pub struct PrometheusLogger {
    metrics: Arc<Metrics>,
}

fn to_i64(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

impl StatLogger for PrometheusLogger {
    fn record(&mut self, step: &StepStats) {
        let m = &self.metrics;
        let d = &step.deltas;
        m.prefix_queries.inc_by(d.prefix_cache_queries);
        m.prefix_hits.inc_by(d.prefix_cache_hits);
        m.preempted_queries.inc_by(d.preempted_prefix_cache_queries);
        m.preempted_hits.inc_by(d.preempted_prefix_cache_hits);
        m.external_queries.inc_by(d.external_prefix_cache_queries);
        m.external_hits.inc_by(d.external_prefix_cache_hits);
        m.num_preemptions.inc_by(d.num_preemptions);
        m.prompt_tokens.inc_by(d.prompt_tokens);
        for (source, v) in [
            (n::SOURCE_LOCAL_COMPUTE, d.prompt_tokens_local_compute),
            (n::SOURCE_LOCAL_CACHE_HIT, d.prompt_tokens_local_cache_hit),
            (
                n::SOURCE_EXTERNAL_KV_TRANSFER,
                d.prompt_tokens_external_kv_transfer,
            ),
        ] {
            m.prompt_by_source
                .get_or_create(&source_labels(source))
                .inc_by(v);
        }
        m.prompt_cached.inc_by(d.prompt_tokens_cached);
        m.generation_tokens.inc_by(d.generation_tokens);
        m.cache_creation.inc_by(d.cache_creation_tokens);
        m.blocks_allocated.inc_by(d.blocks_allocated);
        m.blocks_filled.inc_by(d.blocks_filled);
        m.blocks_evicted.inc_by(d.blocks_evicted);

        let g = &step.gauges;
        m.running.set(to_i64(g.num_requests_running));
        m.waiting.set(to_i64(g.num_requests_waiting));
        m.kv_cache_usage.set(g.kv_cache_usage_perc);
        m.cache_only_blocks.set(to_i64(g.cache_only_blocks));
        m.token_occupancy.set(g.kv_token_occupancy_perc);

        for f in &step.finished {
            m.request_success
                .get_or_create(&reason_labels(f.finish_reason))
                .inc();
            m.e2e.observe(f.e2e_s);
            m.queue.observe(f.queue_time_s);
            m.inference.observe(f.inference_time_s);
            m.prefill.observe(f.prefill_time_s);
            m.decode.observe(f.decode_time_s);
            m.req_prompt.observe(f.prompt_tokens as f64);
            m.req_generation.observe(f.generation_tokens as f64);
            if let Some(p) = &f.prefill_stats {
                m.req_prefill_computed.observe(p.computed_tokens as f64);
            }
        }
        for &t in &step.ttft_s {
            m.ttft.observe(t);
        }
        for &t in &step.itl_s {
            m.itl.observe(t);
        }
        if let Some(t) = step.iteration_tokens {
            m.iteration_tokens.observe(t as f64);
        }
    }
}

/// The periodic stats line, vLLM's format: throughput over the interval `dt` seconds between
/// two snapshots, the current queue and KV gauges, and the cumulative prefix cache hit rate.
/// Returns whether the engine did anything in the interval.
pub fn format_log_line(prev: &MetricsSnapshot, cur: &MetricsSnapshot, dt: f64) -> (bool, String) {
    let dt = dt.max(1e-9);
    let prompt_tp = cur.prompt_tokens.saturating_sub(prev.prompt_tokens) as f64 / dt;
    let gen_tp = cur.generation_tokens.saturating_sub(prev.generation_tokens) as f64 / dt;
    let hit_rate = if cur.prefix_cache_queries == 0 {
        0.0
    } else {
        cur.prefix_cache_hits as f64 / cur.prefix_cache_queries as f64
    };
    let active = prompt_tp > 0.0 || gen_tp > 0.0 || cur.num_requests_running > 0;
    let line = format!(
        "Engine 000: Avg prompt throughput: {prompt_tp:.1} tokens/s, Avg generation throughput: \
         {gen_tp:.1} tokens/s, Running: {} reqs, Waiting: {} reqs, KV cache usage: {:.1}%, \
         Prefix cache hit rate: {:.1}%",
        cur.num_requests_running,
        cur.num_requests_waiting,
        cur.kv_cache_usage_perc * 100.0,
        hit_rate * 100.0,
    );
    (active, line)
}

/// Logs [`format_log_line`] every `interval` (at debug level while idle). Runs until aborted.
pub async fn log_stats_loop(metrics: MetricsHandle, interval: Duration) {
    let mut last = metrics.snapshot();
    let mut last_time = tokio::time::Instant::now();
    let mut last_active = false;
    let mut ticker = tokio::time::interval(interval);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        let now = tokio::time::Instant::now();
        let snap = metrics.snapshot();
        let (active, line) =
            format_log_line(&last, &snap, now.duration_since(last_time).as_secs_f64());
        if active || last_active {
            tracing::info!("{line}");
        } else {
            tracing::debug!("{line}");
        }
        last_active = active;
        last = snap;
        last_time = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_line_like_vllm() {
        let prev = MetricsSnapshot {
            prompt_tokens: 100,
            generation_tokens: 10,
            ..Default::default()
        };
        let cur = MetricsSnapshot {
            prompt_tokens: 300,
            generation_tokens: 60,
            num_requests_running: 2,
            num_requests_waiting: 1,
            kv_cache_usage_perc: 0.25,
            prefix_cache_queries: 200,
            prefix_cache_hits: 50,
            ..Default::default()
        };
        let (active, line) = format_log_line(&prev, &cur, 10.0);
        assert!(active);
        assert_eq!(
            line,
            "Engine 000: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 \
             tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit \
             rate: 25.0%"
        );
        let idle = MetricsSnapshot {
            num_requests_running: 0,
            ..cur.clone()
        };
        assert!(!format_log_line(&idle, &idle, 1.0).0);
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
    fn exposition_uses_vllm_names() {
        let h = MetricsHandle::new("m", 128);
        let text = h.encode_prometheus().unwrap();
        for name in [
            "# TYPE vllm:prefix_cache_queries_total counter",
            "vllm:prefix_cache_queries_total{model_name=\"m\",engine=\"0\"} 0",
            "# TYPE vllm:num_requests_running gauge",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            "# TYPE vllm:iteration_tokens_total histogram",
            "vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"abort\"} 0",
            "vllm:prompt_tokens_by_source_total{model_name=\"m\",engine=\"0\",source=\"local_cache_hit\"} 0",
            "# TYPE cachet:kv_blocks_evicted_total counter",
            "# TYPE cachet:kv_token_occupancy_perc gauge",
        ] {
            assert!(text.contains(name), "missing {name:?} in\n{text}");
        }
        assert!(!text.contains("_total_total"));
        let om = h.encode_openmetrics().unwrap();
        assert!(om.contains("# TYPE vllm:prefix_cache_queries counter"));
        assert!(om.ends_with("# EOF\n"));
    }
}
