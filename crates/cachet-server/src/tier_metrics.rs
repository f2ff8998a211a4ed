//! The external KV tiers' metrics, read off [`TierClient::stats`] at scrape time.
//!
//! Where vLLM has a metric (its OffloadingConnector's `vllm:kv_offload_*`: load/store bytes,
//! time and transfer-size histograms, lookup delay), cachet uses its name, type and buckets,
//! with a `tier` label (`host`, `redis`) added beside `model_name` and `engine`: `sum()` over
//! it gives vLLM's series. Everything vLLM lacks is `cachet:kv_tier_*`. Every series of a
//! configured tier exists from the start (at 0). The per-tier cached-token counters
//! (`vllm:prompt_tokens_cached_by_source_total{source="host"|"redis"}`) are the engine's
//! (they follow the requests' accounting), not these.
//!
//! All families are declared once, in [`FAMILIES`]; the README's metric table is generated
//! from it ([`markdown_rows`]).

use cachet_tiers::{Histogram, TierClient, TierKind, TierStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

type Labels = Vec<(&'static str, String)>;

/// How a family's series are split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// One series.
    None,
    /// One series per configured tier, label `tier`.
    Tier,
    /// One series per value of a fixed label.
    Values(&'static str, &'static [&'static str]),
}

/// What one series reads.
#[derive(Clone, Copy)]
pub enum Value {
    /// A count (blocks, bytes, events).
    Counter(fn(&TierStats, TierKind, &str) -> u64),
    /// A counter of seconds.
    Seconds(fn(&TierStats, TierKind) -> f64),
    Gauge(fn(&TierStats, TierKind) -> i64),
    Histogram(fn(&TierStats, TierKind) -> &Histogram),
}

/// One metric family.
pub struct FamilySpec {
    /// Without `_total` for counters (the encoder adds it).
    pub name: &'static str,
    pub help: &'static str,
    pub split: Split,
    pub value: Value,
    /// Only when this tier is configured (`None`: whenever any tier is).
    pub only: Option<TierKind>,
}

const LOAD_FAILURE_CAUSES: &[&str] = &[
    "missing",
    "timeout",
    "unavailable",
    "failed",
    "corrupt",
    "bad_signature",
    "foreign_layout",
    "unsupported_version",
];

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn load_failures(s: &TierStats, cause: &str) -> u64 {
    let f = &s.load_failures;
    match cause {
        "missing" => f.missing,
        "timeout" => f.timeout,
        "unavailable" => f.unavailable,
        "failed" => f.failed,
        "corrupt" => f.corrupt,
        "bad_signature" => f.bad_signature,
        "foreign_layout" => f.foreign_layout,
        "unsupported_version" => f.unsupported_version,
        _ => 0,
    }
}

/// Every tier family, declared once.
pub const FAMILIES: &[FamilySpec] = &[
    FamilySpec {
        name: "vllm:kv_offload_load_bytes",
        help: "Total bytes loaded from offload storage (the KV tier) into the local block pool",
        split: Split::Tier,
        value: Value::Counter(|s, t, _| s.tier(t).bytes_loaded),
        only: None,
    },
    FamilySpec {
        name: "vllm:kv_offload_load_time",
        help: "Total load time from offload storage (the KV tier), in seconds: fetch and verification, per load call",
        split: Split::Tier,
        value: Value::Seconds(|s, t| s.tier(t).load_seconds),
        only: None,
    },
    FamilySpec {
        name: "vllm:kv_offload_load_size",
        help: "Histogram of KV offload load operation size, in bytes",
        split: Split::Tier,
        value: Value::Histogram(|s, t| &s.tier(t).load_size),
        only: None,
    },
    FamilySpec {
        name: "vllm:kv_offload_store_bytes",
        help: "Total bytes stored from the local block pool to offload storage (the KV tier)",
        split: Split::Tier,
        value: Value::Counter(|s, t, _| s.tier(t).bytes_saved),
        only: None,
    },
    FamilySpec {
        name: "vllm:kv_offload_store_time",
        help: "Total store time to offload storage (the KV tier), in seconds (Redis: per written batch, encoding included)",
        split: Split::Tier,
        value: Value::Seconds(|s, t| s.tier(t).save_seconds),
        only: None,
    },
    FamilySpec {
        name: "vllm:kv_offload_store_size",
        help: "Histogram of KV offload store operation size, in bytes (host: one block; Redis: one batch)",
        split: Split::Tier,
        value: Value::Histogram(|s, t| &s.tier(t).save_size),
        only: None,
    },
    FamilySpec {
        name: "vllm:kv_offload_lookup_sync_delay_seconds",
        help: "Histogram of the time spent in a single offload lookup call, in seconds (the engine waits for it)",
        split: Split::None,
        value: Value::Histogram(|s, _| &s.lookup_delay),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_lookups",
        help: "first-admission lookups that consulted the tier",
        split: Split::Tier,
        value: Value::Counter(|s, t, _| s.tier(t).lookups),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_lookup_blocks",
        help: "blocks those lookups found in the tier (leading run after the local hit)",
        split: Split::Tier,
        value: Value::Counter(|s, t, _| s.tier(t).lookup_blocks),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_lookup_failures",
        help: "Redis lookups answered without Redis: `error` (error reply or lost connection), `timeout` (past --kv-tier-timeout-ms), `skipped` (Redis known down, no call made)",
        split: Split::Values("reason", &["error", "timeout", "skipped"]),
        value: Value::Counter(|s, _, reason| match reason {
            "error" => s.lookup_failures.saturating_sub(s.lookup_timeouts),
            "timeout" => s.lookup_timeouts,
            _ => s.lookup_skips,
        }),
        only: Some(TierKind::Redis),
    },
    FamilySpec {
        name: "cachet:kv_tier_blocks_loaded",
        help: "blocks loaded from the tier and handed to the engine (intact, verified)",
        split: Split::Tier,
        value: Value::Counter(|s, t, _| s.tier(t).blocks_loaded),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_load_failures",
        help: "blocks of loads that did not load, by cause (those blocks are computed instead)",
        split: Split::Values("cause", LOAD_FAILURE_CAUSES),
        value: Value::Counter(|s, _, cause| load_failures(s, cause)),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_load_latency_seconds",
        help: "Histogram of the latency of one load call to the tier, in seconds",
        split: Split::Tier,
        value: Value::Histogram(|s, t| &s.tier(t).load_latency),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_blocks_saved",
        help: "blocks stored in the tier (host: evicted from the local pool; Redis: new cache entries)",
        split: Split::Tier,
        value: Value::Counter(|s, t, _| s.tier(t).blocks_saved),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_save_drops",
        help: "saves not attempted: `queue_full` (write-behind queue full), `budget` (over --kv-tier-redis-bytes), `too_large` (a block over the whole host or disk capacity)",
        split: Split::Values("reason", &["queue_full", "budget", "too_large"]),
        value: Value::Counter(|s, _, reason| match reason {
            "queue_full" => s.save_queue_drops,
            "budget" => s.save_budget_drops,
            _ => s.host_too_large + s.disk_too_large,
        }),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_save_failures",
        help: "Redis saves that were attempted and not stored (down, error, timeout)",
        split: Split::None,
        value: Value::Counter(|s, _, _| s.save_failures),
        only: Some(TierKind::Redis),
    },
    FamilySpec {
        name: "cachet:kv_tier_save_dedup_skips",
        help: "saves skipped, the block not even copied out, because the tier already holds it (host: in the LRU; Redis: this instance loaded or stored it recently)",
        split: Split::None,
        value: Value::Counter(|s, _, _| s.save_dedup_skips),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_host_evictions",
        help: "blocks the host tier evicted to stay within --kv-tier-host-bytes",
        split: Split::None,
        value: Value::Counter(|s, _, _| s.host_evictions),
        only: Some(TierKind::Host),
    },
    FamilySpec {
        name: "cachet:kv_tier_redis_outages",
        help: "times the Redis tier went down (a call failed or timed out while it was up)",
        split: Split::None,
        value: Value::Counter(|s, _, _| s.redis_outages),
        only: Some(TierKind::Redis),
    },
    FamilySpec {
        name: "cachet:kv_tier_up",
        help: "1 while the tier serves (host: always; Redis: connected and answering), else 0",
        split: Split::Tier,
        value: Value::Gauge(|s, t| match t {
            TierKind::Host | TierKind::Disk => 1,
            TierKind::Redis => i64::from(s.redis_up),
        }),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_host_bytes",
        help: "payload bytes the host tier holds",
        split: Split::None,
        value: Value::Gauge(|s, _| to_i64(s.host_resident_bytes)),
        only: Some(TierKind::Host),
    },
    FamilySpec {
        name: "cachet:kv_tier_host_blocks",
        help: "blocks the host tier holds",
        split: Split::None,
        value: Value::Gauge(|s, _| to_i64(s.host_resident_blocks)),
        only: Some(TierKind::Host),
    },
    FamilySpec {
        name: "cachet:kv_tier_disk_write_failures",
        help: "disk saves that were attempted and not stored (a full disk, an I/O error): dropped, serving goes on",
        split: Split::None,
        value: Value::Counter(|s, _, _| s.disk_write_failures),
        only: Some(TierKind::Disk),
    },
    FamilySpec {
        name: "cachet:kv_tier_disk_evictions",
        help: "block files the disk tier removed to stay within --kv-tier-disk-bytes",
        split: Split::None,
        value: Value::Counter(|s, _, _| s.disk_evictions),
        only: Some(TierKind::Disk),
    },
    FamilySpec {
        name: "cachet:kv_tier_disk_bytes",
        help: "bytes of the block files the disk tier holds (values: header, payload, checksum)",
        split: Split::None,
        value: Value::Gauge(|s, _| to_i64(s.disk_resident_bytes)),
        only: Some(TierKind::Disk),
    },
    FamilySpec {
        name: "cachet:kv_tier_disk_blocks",
        help: "blocks the disk tier holds",
        split: Split::None,
        value: Value::Gauge(|s, _| to_i64(s.disk_resident_blocks)),
        only: Some(TierKind::Disk),
    },
    FamilySpec {
        name: "cachet:kv_tier_save_buffers",
        help: "payload buffers the engine's saves copied blocks into: `warm` (recycled or pre-touched memory), `fresh` (allocated on the engine thread: the free list was empty)",
        split: Split::Values("source", &["warm", "fresh"]),
        value: Value::Counter(|s, _, source| match source {
            "warm" => s.buffers.warm,
            _ => s.buffers.fresh,
        }),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_save_buffers_returned",
        help: "payload buffers given back to the free list: `recycled` (a host eviction or an encoded Redis value freed them), `pretouched` (allocated and touched by the background filler)",
        split: Split::Values("source", &["recycled", "pretouched"]),
        value: Value::Counter(|s, _, source| match source {
            "recycled" => s.buffers.recycled,
            _ => s.buffers.pretouched,
        }),
        only: None,
    },
    FamilySpec {
        name: "cachet:kv_tier_saves_pending",
        help: "Redis saves accepted and not yet written (queue plus the batch in flight)",
        split: Split::None,
        value: Value::Gauge(|s, _| to_i64(s.saves_pending)),
        only: Some(TierKind::Redis),
    },
];

/// Reads the tiers' totals at each scrape.
pub struct TierCollector {
    model_name: String,
    client: TierClient,
}

impl TierCollector {
    pub fn new(model_name: &str, client: TierClient) -> Self {
        TierCollector {
            model_name: model_name.to_string(),
            client,
        }
    }
}

impl std::fmt::Debug for TierCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierCollector")
            .field("model_name", &self.model_name)
            .finish_non_exhaustive()
    }
}

fn metric_type(v: &Value) -> MetricType {
    match v {
        Value::Counter(_) | Value::Seconds(_) => MetricType::Counter,
        Value::Gauge(_) => MetricType::Gauge,
        Value::Histogram(_) => MetricType::Histogram,
    }
}

/// The tiers a family has series for, given the configured ones.
fn tiers_of(spec: &FamilySpec, configured: &[TierKind]) -> Vec<TierKind> {
    match spec.only {
        Some(k) if !configured.contains(&k) => Vec::new(),
        Some(k) => vec![k],
        None => configured.to_vec(),
    }
}

/// Encodes every family for `stats` of the `configured` tiers (in that order).
pub fn encode_families(
    encoder: &mut DescriptorEncoder,
    model_name: &str,
    configured: &[TierKind],
    stats: &TierStats,
) -> Result<(), std::fmt::Error> {
    for spec in FAMILIES {
        let tiers = tiers_of(spec, configured);
        let Some(&first) = tiers.first() else {
            continue;
        };
        let base: Labels = vec![
            ("model_name", model_name.to_string()),
            ("engine", "0".to_string()),
        ];
        // (labels, tier, label value) per series.
        let series: Vec<(Labels, TierKind, &str)> = match spec.split {
            Split::None => vec![(base, first, "")],
            Split::Tier => tiers
                .iter()
                .map(|t| {
                    let mut l = base.clone();
                    l.push(("tier", t.as_str().to_string()));
                    (l, *t, "")
                })
                .collect(),
            Split::Values(key, values) => values
                .iter()
                .map(|v| {
                    let mut l = base.clone();
                    l.push((key, v.to_string()));
                    (l, first, *v)
                })
                .collect(),
        };
        let mut family =
            encoder.encode_descriptor(spec.name, spec.help, None, metric_type(&spec.value))?;
        for (labels, tier, label) in &series {
            let mut m = family.encode_family(labels)?;
            match spec.value {
                Value::Counter(f) => ConstCounter::new(f(stats, *tier, label)).encode(m)?,
                Value::Seconds(f) => ConstCounter::new(f(stats, *tier)).encode(m)?,
                Value::Gauge(f) => ConstGauge::new(f(stats, *tier)).encode(m)?,
                Value::Histogram(f) => {
                    let h = f(stats, *tier);
                    m.encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets(), None)?
                }
            }
        }
    }
    Ok(())
}

impl Collector for TierCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let configured: Vec<TierKind> = [TierKind::Host, TierKind::Disk, TierKind::Redis]
            .into_iter()
            .filter(|k| self.client.has(*k))
            .collect();
        encode_families(
            &mut encoder,
            &self.model_name,
            &configured,
            &self.client.stats(),
        )
    }
}

/// The README metric table's rows for the tier families.
pub fn markdown_rows() -> String {
    let mut out = String::new();
    for spec in FAMILIES {
        let (ty, suffix) = match spec.value {
            Value::Counter(_) | Value::Seconds(_) => ("counter", "_total"),
            Value::Gauge(_) => ("gauge", ""),
            Value::Histogram(_) => ("histogram", ""),
        };
        let labels = match spec.split {
            Split::None => String::new(),
            Split::Tier => "{tier}".to_string(),
            Split::Values(k, _) => format!("{{{k}}}"),
        };
        let only = match spec.only {
            Some(k) => format!(" ({} tier)", k.as_str()),
            None => String::new(),
        };
        out.push_str(&format!(
            "| `{}{suffix}{labels}` | {ty} | {}{only} |\n",
            spec.name, spec.help
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[derive(Debug)]
    struct Fixed(TierStats, Vec<TierKind>);

    impl Collector for Fixed {
        fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_families(&mut encoder, "m", &self.1, &self.0)
        }
    }

    fn render(stats: TierStats, tiers: Vec<TierKind>) -> String {
        let mut r = Registry::default();
        r.register_collector(Box::new(Fixed(stats, tiers)));
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &r).unwrap();
        out
    }

    fn hist(bounds: &'static [f64], counts: Vec<u64>, sum: f64) -> Histogram {
        let count = counts.iter().sum();
        Histogram {
            bounds,
            counts,
            sum,
            count,
        }
    }

    #[test]
    fn vllm_names_types_buckets_and_tier_labels() {
        let mut s = TierStats::default();
        s.redis.bytes_loaded = 45_711_360;
        s.redis.blocks_loaded = 124;
        s.redis.load_seconds = 0.25;
        s.redis.load_size = hist(
            cachet_tiers::stats::TRANSFER_SIZE_BUCKETS,
            vec![0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
            45_711_360.0,
        );
        s.host.blocks_saved = 3;
        s.load_failures.bad_signature = 2;
        s.buffers = cachet_tiers::BufferStats {
            warm: 120,
            fresh: 4,
            recycled: 100,
            pretouched: 24,
        };
        s.redis_up = true;
        s.lookup_delay = hist(cachet_tiers::stats::LOOKUP_DELAY_BUCKETS, vec![0; 12], 0.0);
        let text = render(s, vec![TierKind::Host, TierKind::Redis]);
        for want in [
            "# TYPE vllm:kv_offload_load_bytes_total counter",
            "vllm:kv_offload_load_bytes_total{model_name=\"m\",engine=\"0\",tier=\"redis\"} 45711360",
            "vllm:kv_offload_load_bytes_total{model_name=\"m\",engine=\"0\",tier=\"host\"} 0",
            "vllm:kv_offload_load_time_total{model_name=\"m\",engine=\"0\",tier=\"redis\"} 0.25",
            "# TYPE vllm:kv_offload_load_size histogram",
            // Cumulative: the one 45.7 MB load sits in (40e6, 60e6].
            "vllm:kv_offload_load_size_bucket{model_name=\"m\",engine=\"0\",tier=\"redis\",le=\"4e+07\"} 0",
            "vllm:kv_offload_load_size_bucket{model_name=\"m\",engine=\"0\",tier=\"redis\",le=\"6e+07\"} 1",
            "vllm:kv_offload_load_size_bucket{model_name=\"m\",engine=\"0\",tier=\"redis\",le=\"+Inf\"} 1",
            "vllm:kv_offload_load_size_count{model_name=\"m\",engine=\"0\",tier=\"redis\"} 1",
            "vllm:kv_offload_lookup_sync_delay_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"1e-05\"} 0",
            "cachet:kv_tier_blocks_loaded_total{model_name=\"m\",engine=\"0\",tier=\"redis\"} 124",
            "cachet:kv_tier_blocks_saved_total{model_name=\"m\",engine=\"0\",tier=\"host\"} 3",
            "cachet:kv_tier_load_failures_total{model_name=\"m\",engine=\"0\",cause=\"bad_signature\"} 2",
            "cachet:kv_tier_load_failures_total{model_name=\"m\",engine=\"0\",cause=\"missing\"} 0",
            "cachet:kv_tier_save_buffers_total{model_name=\"m\",engine=\"0\",source=\"warm\"} 120",
            "cachet:kv_tier_save_buffers_total{model_name=\"m\",engine=\"0\",source=\"fresh\"} 4",
            "cachet:kv_tier_save_buffers_returned_total{model_name=\"m\",engine=\"0\",source=\"recycled\"} 100",
            "cachet:kv_tier_save_buffers_returned_total{model_name=\"m\",engine=\"0\",source=\"pretouched\"} 24",
            "cachet:kv_tier_up{model_name=\"m\",engine=\"0\",tier=\"redis\"} 1",
            "cachet:kv_tier_up{model_name=\"m\",engine=\"0\",tier=\"host\"} 1",
            "cachet:kv_tier_host_bytes{model_name=\"m\",engine=\"0\"} 0",
            "cachet:kv_tier_saves_pending{model_name=\"m\",engine=\"0\"} 0",
            "cachet:kv_tier_lookup_failures_total{model_name=\"m\",engine=\"0\",reason=\"skipped\"} 0",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        assert!(!text.contains("_total_total"));
    }

    #[test]
    fn only_configured_tiers_have_series() {
        let text = render(TierStats::default(), vec![TierKind::Host]);
        assert!(text.contains("cachet:kv_tier_up{model_name=\"m\",engine=\"0\",tier=\"host\"} 1"));
        assert!(!text.contains("tier=\"redis\""));
        assert!(!text.contains("cachet:kv_tier_redis_outages"));
        assert!(!text.contains("cachet:kv_tier_saves_pending"));
        assert!(text.contains("cachet:kv_tier_host_evictions_total"));
        let text = render(
            TierStats {
                redis_up: false,
                ..Default::default()
            },
            vec![TierKind::Redis],
        );
        assert!(text.contains("cachet:kv_tier_up{model_name=\"m\",engine=\"0\",tier=\"redis\"} 0"));
        assert!(!text.contains("tier=\"host\""));
        assert!(!text.contains("cachet:kv_tier_host_bytes"));
    }

    #[test]
    fn markdown_has_a_row_per_family() {
        let rows = markdown_rows();
        assert_eq!(rows.lines().count(), FAMILIES.len());
        assert!(rows.contains("| `vllm:kv_offload_load_bytes_total{tier}` | counter |"));
        assert!(rows.contains("| `cachet:kv_tier_load_failures_total{cause}` | counter |"));
        assert!(rows.contains("| `cachet:kv_tier_load_latency_seconds{tier}` | histogram |"));
    }
}
