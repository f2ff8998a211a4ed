//! Accounting types: per-request [`PrefillStats`] (spec §3), [`FinishedRequestStats`], the
//! core's monotonic [`CounterTotals`] and the one place where totals become per-interval
//! [`CounterDeltas`] ([`DeltaTracker`], spec §6).

use serde::{Deserialize, Serialize};

use crate::request::FinishReason;

/// Where one request's prompt KV came from and what its prefill cost the cache (spec §3).
///
/// Logical fields (`prompt_tokens` … `cache_creation_tokens`) are fixed at first admission;
/// physical fields (`prefill_chunks` … `preemptions`) count the actual work until the first
/// output token, re-prefill after preemption included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillStats {
    pub prompt_tokens: u64,
    pub local_cached_tokens: u64,
    pub external_cached_tokens: u64,
    pub cached_tokens: u64,
    pub computed_tokens: u64,
    pub cache_creation_tokens: u64,
    pub prefill_chunks: u64,
    pub blocks_allocated: u64,
    pub blocks_filled: u64,
    pub blocks_evicted: u64,
    pub preemptions: u64,
    pub prefill_time_ms: f64,
    pub queue_time_ms: f64,
}

impl PrefillStats {
    /// Field-wise sum (session-cumulative stats are the sum of the chunk snapshots).
    pub fn accumulate(&mut self, o: &PrefillStats) {
        self.prompt_tokens += o.prompt_tokens;
        self.local_cached_tokens += o.local_cached_tokens;
        self.external_cached_tokens += o.external_cached_tokens;
        self.cached_tokens += o.cached_tokens;
        self.computed_tokens += o.computed_tokens;
        self.cache_creation_tokens += o.cache_creation_tokens;
        self.prefill_chunks += o.prefill_chunks;
        self.blocks_allocated += o.blocks_allocated;
        self.blocks_filled += o.blocks_filled;
        self.blocks_evicted += o.blocks_evicted;
        self.preemptions += o.preemptions;
        self.prefill_time_ms += o.prefill_time_ms;
        self.queue_time_ms += o.queue_time_ms;
    }

    /// Spec §3 invariants; `Err` names the first violation.
    pub fn check(&self) -> Result<(), String> {
        if self.cached_tokens + self.computed_tokens != self.prompt_tokens {
            return Err(format!("cached + computed != prompt: {self:?}"));
        }
        if self.local_cached_tokens + self.external_cached_tokens != self.cached_tokens {
            return Err(format!("local + external != cached: {self:?}"));
        }
        if self.cache_creation_tokens > self.computed_tokens {
            return Err(format!("cache_creation > computed: {self:?}"));
        }
        if !(self.prefill_time_ms >= 0.0 && self.queue_time_ms >= 0.0) {
            return Err(format!("negative time: {self:?}"));
        }
        Ok(())
    }
}

/// Delivered to every stat logger for each finished or aborted request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FinishedRequestStats {
    pub request_id: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// `None` when the request was never admitted (aborted while waiting): no lookup happened
    /// and none of its tokens was counted anywhere.
    pub prefill_stats: Option<PrefillStats>,
    /// Arrival → first scheduling (or → finish when never scheduled).
    pub queue_time_s: f64,
    /// Arrival → first output token.
    pub ttft_s: Option<f64>,
    /// Arrival → finish.
    pub e2e_s: f64,
    /// First scheduling → first token.
    pub prefill_time_s: f64,
    /// First token → finish.
    pub decode_time_s: f64,
    /// First scheduling → finish.
    pub inference_time_s: f64,
    /// Every preemption of the request, before and after its first token.
    pub num_preemptions: u64,
}

macro_rules! counters {
    ($(#[$m:meta])* $($field:ident),* $(,)?) => {
        /// Monotonic totals kept by the core. Never exported directly: see [`DeltaTracker`].
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct CounterTotals { $(pub $field: u64,)* }

        /// Per-interval increments of [`CounterTotals`]. Only [`DeltaTracker`] makes them.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct CounterDeltas { $(pub $field: u64,)* }

        impl CounterDeltas {
            pub fn is_zero(&self) -> bool {
                true $(&& self.$field == 0)*
            }
            /// Add another interval's deltas (e.g. to sum a run's increments in a test).
            pub fn accumulate(&mut self, other: &CounterDeltas) {
                $(self.$field += other.$field;)*
            }
            /// `(name, value)` pairs, for reporting.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field),)*]
            }
        }

        impl CounterTotals {
            fn delta_since(&self, prev: &CounterTotals) -> CounterDeltas {
                CounterDeltas { $($field: {
                    debug_assert!(self.$field >= prev.$field, concat!("counter ", stringify!($field), " decreased"));
                    self.$field.saturating_sub(prev.$field)
                },)* }
            }
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field),)*]
            }
        }
    };
}

counters!(
    prefix_cache_queries,
    prefix_cache_hits,
    preempted_prefix_cache_queries,
    preempted_prefix_cache_hits,
    external_prefix_cache_queries,
    external_prefix_cache_hits,
    num_preemptions,
    prompt_tokens,
    prompt_tokens_local_compute,
    prompt_tokens_local_cache_hit,
    prompt_tokens_external_kv_transfer,
    prompt_tokens_cached,
    generation_tokens,
    cache_creation_tokens,
    blocks_allocated,
    blocks_filled,
    blocks_evicted,
);

/// The single place where monotonic totals become per-interval deltas.
#[derive(Clone, Debug, Default)]
pub struct DeltaTracker {
    last: CounterTotals,
}

impl DeltaTracker {
    /// Deltas since the previous call, and remember `now` as the new baseline.
    pub fn advance(&mut self, now: &CounterTotals) -> CounterDeltas {
        let d = now.delta_since(&self.last);
        self.last = *now;
        d
    }
}

/// Instantaneous state, sampled after each step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gauges {
    pub num_requests_running: u64,
    pub num_requests_waiting: u64,
    /// Fraction of blocks held by live requests (vLLM's meaning).
    pub kv_cache_usage_perc: f64,
    /// Free blocks that still hold a cache entry.
    pub cache_only_blocks: u64,
    /// Token slots holding live requests' KV / all token slots.
    pub kv_token_occupancy_perc: f64,
    pub num_blocks: u64,
    /// Parked resumable sessions and the blocks they hold.
    pub parked_sessions: u64,
    pub parked_session_blocks: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_are_per_interval_and_never_re_add_history() {
        let mut t = DeltaTracker::default();
        let mut totals = CounterTotals {
            prefix_cache_queries: 100,
            prefix_cache_hits: 96,
            ..Default::default()
        };
        let d1 = t.advance(&totals);
        assert_eq!((d1.prefix_cache_queries, d1.prefix_cache_hits), (100, 96));
        let d2 = t.advance(&totals);
        assert!(d2.is_zero());
        totals.prefix_cache_queries += 7;
        let d3 = t.advance(&totals);
        assert_eq!(d3.prefix_cache_queries, 7);
        assert_eq!(d3.prefix_cache_hits, 0);
    }

    #[test]
    fn prefill_stats_check_catches_each_invariant() {
        let ok = PrefillStats {
            prompt_tokens: 10,
            local_cached_tokens: 4,
            cached_tokens: 4,
            computed_tokens: 6,
            cache_creation_tokens: 6,
            ..Default::default()
        };
        ok.check().unwrap();
        assert!(PrefillStats {
            computed_tokens: 5,
            ..ok
        }
        .check()
        .is_err());
        assert!(PrefillStats {
            external_cached_tokens: 1,
            ..ok
        }
        .check()
        .is_err());
        assert!(PrefillStats {
            cache_creation_tokens: 7,
            ..ok
        }
        .check()
        .is_err());
    }
}
