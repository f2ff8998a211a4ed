//! The metric table as text: vLLM's periodic stats log line, and the README's metric table
//! generated from the same declarations.

use cachet_core::stats::{Gauges, COUNTERS};
use cachet_engine::{StatLogger, StepStats};

use super::{GAUGES, HISTOGRAMS, HIT_RATE_HELP, SPEC_COUNTERS, SPEC_PER_POS, TENANT_COUNTERS};

/// The periodic stats line, vLLM's format, as a stat logger: it sums the deltas it is handed
/// and, at most once per interval, logs throughput over the interval, the latest queue and KV
/// gauges, and the prefix-cache hit rate over the interval.
pub struct LogLineLogger {
    interval: std::time::Duration,
    since: std::time::Instant,
    sum: cachet_core::stats::CounterDeltas,
}

impl LogLineLogger {
    pub fn new(interval: std::time::Duration) -> Self {
        LogLineLogger {
            interval,
            since: std::time::Instant::now(),
            sum: Default::default(),
        }
    }
}

impl StatLogger for LogLineLogger {
    fn record(&mut self, step: &StepStats) {
        self.sum.accumulate(&step.deltas);
        let dt = self.since.elapsed();
        if dt < self.interval {
            return;
        }
        let line = format_log_line(&self.sum, &step.gauges, dt.as_secs_f64());
        tracing::info!("{line}");
        self.sum = Default::default();
        self.since = std::time::Instant::now();
    }
}

/// vLLM's "Engine 000: ..." line from one interval's summed deltas and the latest gauges.
pub fn format_log_line(d: &cachet_core::stats::CounterDeltas, g: &Gauges, dt: f64) -> String {
    let dt = dt.max(1e-9);
    let hit_rate = if d.prefix_cache_queries == 0 {
        0.0
    } else {
        d.prefix_cache_hits as f64 / d.prefix_cache_queries as f64
    };
    format!(
        "Engine 000: Avg prompt throughput: {:.1} tokens/s, Avg generation throughput: {:.1} \
         tokens/s, Running: {} reqs, Waiting: {} reqs, KV cache usage: {:.1}%, Prefix cache hit \
         rate: {:.1}%",
        d.prompt_tokens as f64 / dt,
        d.generation_tokens as f64 / dt,
        g.num_requests_running,
        g.num_requests_waiting,
        g.kv_cache_usage_perc * 100.0,
        hit_rate * 100.0,
    )
}

/// The README's metric table, generated from the declarations above and the core's counter
/// table (a test keeps README.md equal to it).
pub fn markdown_table() -> String {
    let mut out = String::from("| metric | type | meaning |\n|---|---|---|\n");
    for g in GAUGES {
        out.push_str(&format!("| `{}` | gauge | {} |\n", g.name, g.help));
    }
    out.push_str("| `vllm:num_requests_waiting_by_reason{reason}` | gauge | `capacity`: waiting for scheduling capacity; `deferred`: waiting for external KV loads |\n");
    out.push_str("| `vllm:engine_sleep_state{sleep_state}` | gauge | `awake` 1 while the engine serves; 0 once it died or stopped |\n");
    out.push_str(
        "| `vllm:cache_config_info` | gauge | 1, with the KV cache configuration as labels |\n",
    );
    out.push_str(&format!(
        "| `cachet:prefix_cache_hit_rate{{pool_scale}}` | gauge | {HIT_RATE_HELP} |\n"
    ));
    for (name, help, _) in TENANT_COUNTERS {
        out.push_str(&format!(
            "| `{name}_total{{tenant}}` | counter | {help} |\n"
        ));
    }
    for (name, help, _) in SPEC_COUNTERS {
        out.push_str(&format!("| `{name}_total` | counter | {help} |\n"));
    }
    out.push_str(&format!(
        "| `{}_total{{position}}` | counter | {} |\n",
        SPEC_PER_POS.0, SPEC_PER_POS.1
    ));
    let mut seen: Vec<&str> = Vec::new();
    for c in COUNTERS {
        match c.label {
            None => out.push_str(&format!(
                "| `{}_total` | counter | {} |\n",
                c.metric, c.meaning
            )),
            Some((k, v)) => {
                if !seen.contains(&c.metric) {
                    seen.push(c.metric);
                    let values: Vec<String> = COUNTERS
                        .iter()
                        .filter(|o| o.metric == c.metric)
                        .filter_map(|o| o.label.map(|(_, v)| format!("`{v}`: {}", o.meaning)))
                        .collect();
                    out.push_str(&format!(
                        "| `{}_total{{{k}}}` | counter | {} |\n",
                        c.metric,
                        values.join("; ")
                    ));
                }
                let _ = v;
            }
        }
    }
    out.push_str("| `vllm:request_success_total{finished_reason}` | counter | finished requests: `stop`, `length`, `abort` (client gone and shutdown included), `error` |\n");
    for h in HISTOGRAMS {
        out.push_str(&format!("| `{}` | histogram | {} |\n", h.name, h.help));
    }
    out.push_str(&crate::tier_metrics::markdown_rows());
    out.push_str("| `http_requests_total{method,status,handler}` | counter | HTTP requests by route template (`none` when unmatched) and status class (`2xx`, ...) |\n");
    out.push_str(
        "| `http_request_duration_seconds{method,handler}` | histogram | HTTP latency by route |\n",
    );
    out.push_str(
        "| `http_request_duration_highr_seconds` | histogram | HTTP latency, finer buckets |\n",
    );
    out.push_str("| `process_*` | | CPU seconds, resident and virtual memory, open and max fds, start time |\n");
    out
}
