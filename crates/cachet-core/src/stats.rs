//! Accounting types: per-request [`PrefillStats`] (spec §3), request timestamps
//! ([`RequestTimes`]), [`FinishedRequestStats`], and the one table of aggregate counters
//! ([`COUNTERS`]) from which the core's monotonic [`CounterTotals`], the per-interval
//! [`CounterDeltas`] (made only by [`DeltaTracker`], spec §6), the Prometheus registration and the
//! README's metric table all follow.
//!
//! Every value here is produced by the recorder ([`crate::recorder::Recorder`]); no decision of
//! the scheduler reads any of it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::request::FinishReason;

/// Where one request's prompt KV came from and what its prefill cost the cache (spec §3).
///
/// Logical fields (`prompt_tokens` … `cache_creation_tokens`) are fixed at first admission
/// (external ones when the request's loads resolve); physical fields (`prefill_chunks` …
/// `preemptions`) count the actual work until the first output token, re-prefill after
/// preemption included. The spec's two time fields (`queue_time_ms`, `prefill_time_ms`) are
/// derived from the request's [`RequestTimes`], their one home, and sit beside these fields in
/// the per-request JSON.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Why each of the `computed_tokens` was computed (logical, fixed with them).
    pub miss_tokens: MissTokens,
    /// Where the prompt first differs from the most recently used cached block under the same
    /// parent (and the same `cache_salt`), when its first uncached block has such a sibling.
    pub diverged_at: Option<u64>,
    /// The cached prefix a router predicted for this request
    /// (`x-prefix-cache-predicted-tokens`), capped at the prompt; `None` when none was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_tokens: Option<u64>,
    /// Router shortfall: the tokens of the predicted prefix that were computed, by the reason
    /// each was computed (the [`MissTokens`] of the prompt positions from `cached_tokens` to
    /// `predicted_tokens`); all zero without a prediction or when the prediction was met
    /// (left out of the JSON when zero).
    #[serde(default, skip_serializing_if = "MissTokens::is_zero")]
    pub shortfall_tokens: MissTokens,
}

/// Why prompt tokens were not served from cache: every computed prompt token has exactly one
/// reason, so the six sum to `computed_tokens`.
///
/// For each full prompt block after the cached ones, in order: `load_failed` when the external
/// tier held it but its load failed (or a failure before it broke the chain); `capped_for_logits`
/// when it is the last full block of a prompt of `k·B` tokens, every block before it was cached,
/// and the local cache holds it (the N-1 rule dropped it); `evicted` when the local cache holds it
/// only behind a missing ancestor, or its hash is in the shadow set of recently evicted blocks;
/// else `never_cached`. The tail of a prompt that does not fill its last block is
/// `partial_block`. A request with no lookup (cache disabled, prompt logprobs, a session
/// continuation) has every computed token `lookup_skipped`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissTokens {
    pub capped_for_logits: u64,
    pub partial_block: u64,
    pub evicted: u64,
    pub never_cached: u64,
    pub lookup_skipped: u64,
    pub load_failed: u64,
}

/// One of the reasons of [`MissTokens`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissReason {
    CappedForLogits,
    PartialBlock,
    Evicted,
    NeverCached,
    LookupSkipped,
    LoadFailed,
}

impl MissTokens {
    /// `n` more tokens of `reason`.
    pub fn add(&mut self, reason: MissReason, n: u64) {
        *match reason {
            MissReason::CappedForLogits => &mut self.capped_for_logits,
            MissReason::PartialBlock => &mut self.partial_block,
            MissReason::Evicted => &mut self.evicted,
            MissReason::NeverCached => &mut self.never_cached,
            MissReason::LookupSkipped => &mut self.lookup_skipped,
            MissReason::LoadFailed => &mut self.load_failed,
        } += n;
    }

    pub fn is_zero(&self) -> bool {
        self.total() == 0
    }

    pub fn total(&self) -> u64 {
        self.capped_for_logits
            + self.partial_block
            + self.evicted
            + self.never_cached
            + self.lookup_skipped
            + self.load_failed
    }

    pub fn accumulate(&mut self, o: &MissTokens) {
        self.capped_for_logits += o.capped_for_logits;
        self.partial_block += o.partial_block;
        self.evicted += o.evicted;
        self.never_cached += o.never_cached;
        self.lookup_skipped += o.lookup_skipped;
        self.load_failed += o.load_failed;
    }
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
        self.miss_tokens.accumulate(&o.miss_tokens);
        self.diverged_at = o.diverged_at.or(self.diverged_at);
        self.predicted_tokens = match (self.predicted_tokens, o.predicted_tokens) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.shortfall_tokens.accumulate(&o.shortfall_tokens);
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
        if self.miss_tokens.total() != self.computed_tokens {
            return Err(format!("miss reasons do not sum to computed: {self:?}"));
        }
        let shortfall = self.shortfall_tokens.total();
        if shortfall > self.computed_tokens || shortfall > self.predicted_tokens.unwrap_or(0) {
            return Err(format!("shortfall beyond computed or predicted: {self:?}"));
        }
        Ok(())
    }
}

/// A request's timestamps on the engine's clock (seconds): the one representation every
/// latency (queue, prefill, TTFT, decode, inference, end to end) is derived from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestTimes {
    pub arrival: f64,
    /// First scheduling (first admission).
    pub first_scheduled: Option<f64>,
    pub first_token: Option<f64>,
    /// When the request finished (or was aborted); `None` while it lives.
    pub finished: Option<f64>,
}

impl RequestTimes {
    fn end(&self) -> f64 {
        self.finished.unwrap_or(self.arrival)
    }

    /// Arrival → first scheduling (→ finish when never scheduled).
    pub fn queue_s(&self) -> f64 {
        (self.first_scheduled.unwrap_or_else(|| self.end()) - self.arrival).max(0.0)
    }

    /// First scheduling → first token (→ finish when none came), preemptions included.
    pub fn prefill_s(&self) -> f64 {
        match self.first_scheduled {
            Some(s) => (self.first_token.unwrap_or_else(|| self.end()) - s).max(0.0),
            None => 0.0,
        }
    }

    /// Arrival → first token.
    pub fn ttft_s(&self) -> Option<f64> {
        self.first_token.map(|t| (t - self.arrival).max(0.0))
    }

    /// First token → finish.
    pub fn decode_s(&self) -> f64 {
        self.first_token.map_or(0.0, |t| (self.end() - t).max(0.0))
    }

    /// First scheduling → finish.
    pub fn inference_s(&self) -> f64 {
        self.first_scheduled
            .map_or(0.0, |t| (self.end() - t).max(0.0))
    }

    /// Arrival → finish.
    pub fn e2e_s(&self) -> f64 {
        (self.end() - self.arrival).max(0.0)
    }
}

/// Delivered to every stat logger (and on the request's final output) for each finished or
/// aborted request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FinishedRequestStats {
    /// The engine's handle of the request (unique for the engine's lifetime).
    pub handle: u64,
    /// The request's label (the client's `X-Request-Id` or the generated response id).
    pub request_id: Arc<str>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// The request's `max_tokens` (vLLM's `request_max_num_generation_tokens`).
    pub max_tokens: u32,
    /// `None` when the request was never admitted (aborted while waiting): no lookup happened
    /// and none of its tokens was counted anywhere.
    pub prefill_stats: Option<PrefillStats>,
    pub times: RequestTimes,
    /// Every preemption of the request, before and after its first token.
    pub num_preemptions: u64,
}

impl FinishedRequestStats {
    /// Mean time per output token after the first (vLLM's `request_time_per_output_token`):
    /// decode time over `generation_tokens - 1`; `None` with fewer than two tokens.
    pub fn time_per_output_token_s(&self) -> Option<f64> {
        (self.generation_tokens > 1)
            .then(|| self.times.decode_s() / (self.generation_tokens - 1) as f64)
    }
}

/// One sequence's prompt-lookup speculation (`--speculative ngram`), on its final update: the
/// scheduler's own counts of the drafts it verified for it. Summed over every sequence, they
/// are the increments of `vllm:spec_decode_num_drafts_total`, `_num_draft_tokens_total` and
/// `_num_accepted_tokens_total`. `None` on the update when speculation is off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecDecodeCounts {
    /// Decode chunks that carried at least one draft.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Of those, tokens accepted (each a token generated without a step of its own).
    pub num_accepted_tokens: u64,
}

impl SpecDecodeCounts {
    /// Field-wise sum.
    pub fn accumulate(&mut self, o: &SpecDecodeCounts) {
        self.num_drafts += o.num_drafts;
        self.num_draft_tokens += o.num_draft_tokens;
        self.num_accepted_tokens += o.num_accepted_tokens;
    }
}

/// One aggregate counter: its field in [`CounterTotals`] / [`CounterDeltas`] and how it is
/// exported. Several fields may share one metric name with different label values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterSpec {
    /// Field name in [`CounterTotals`].
    pub field: &'static str,
    /// Exported metric name, without the `_total` suffix the encoder appends.
    pub metric: &'static str,
    /// The one label that tells this field apart from the others of the same metric.
    pub label: Option<(&'static str, &'static str)>,
    /// Prometheus help text (shared by every field of one metric: the first one's is used).
    pub help: &'static str,
    /// One line for the README's metric table.
    pub meaning: &'static str,
}

macro_rules! counters {
    ($(
        $field:ident => $metric:literal $([$lk:literal = $lv:literal])?,
            help $help:literal, meaning $meaning:literal;
    )*) => {
        /// Monotonic totals kept by the recorder. Never exported directly: see [`DeltaTracker`].
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct CounterTotals { $(pub $field: u64,)* }

        /// Per-interval increments of [`CounterTotals`]. Only [`DeltaTracker`] makes them.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct CounterDeltas { $(pub $field: u64,)* }

        /// Every aggregate counter, in declaration order (the order of
        /// [`CounterDeltas::values`]).
        pub const COUNTERS: &[CounterSpec] = &[$(CounterSpec {
            field: stringify!($field),
            metric: $metric,
            label: counters!(@label $($lk, $lv)?),
            help: $help,
            meaning: $meaning,
        },)*];

        impl CounterDeltas {
            pub fn is_zero(&self) -> bool {
                true $(&& self.$field == 0)*
            }
            /// Add another interval's deltas (e.g. to sum a run's increments in a test).
            pub fn accumulate(&mut self, other: &CounterDeltas) {
                $(self.$field += other.$field;)*
            }
            /// Values in [`COUNTERS`] order.
            pub fn values(&self) -> Vec<u64> {
                vec![$(self.$field,)*]
            }
        }

        impl CounterTotals {
            fn delta_since(&self, prev: &CounterTotals) -> CounterDeltas {
                CounterDeltas { $($field: {
                    debug_assert!(self.$field >= prev.$field, concat!("counter ", stringify!($field), " decreased"));
                    self.$field.saturating_sub(prev.$field)
                },)* }
            }
            /// Values in [`COUNTERS`] order.
            pub fn values(&self) -> Vec<u64> {
                vec![$(self.$field,)*]
            }
        }
    };
    (@label $lk:literal, $lv:literal) => { Some(($lk, $lv)) };
    (@label) => { None };
}

counters! {
    prefix_cache_queries => "vllm:prefix_cache_queries",
        help "Prefix cache queries, in terms of number of queried tokens",
        meaning "prompt tokens of first-admission lookups (token-granular)";
    prefix_cache_hits => "vllm:prefix_cache_hits",
        help "Prefix cache hits, in terms of number of cached tokens",
        meaning "of those, tokens found in the local cache (≤ queries)";
    external_prefix_cache_queries => "vllm:external_prefix_cache_queries",
        help "External prefix cache queries from the KV connector, in terms of number of queried tokens",
        meaning "tokens asked of the external KV tier (`N - local_hit` per lookup that consulted it)";
    external_prefix_cache_hits => "vllm:external_prefix_cache_hits",
        help "External prefix cache hits from the KV connector, in terms of number of cached tokens",
        meaning "tokens the external tier supplied and that loaded successfully";
    preempted_prefix_cache_queries => "cachet:preempted_prefix_cache_queries",
        help "Prefix cache queries on re-admission after a preemption, in tokens",
        meaning "lookup tokens on re-admission after preemption (kept out of the hit rate)";
    preempted_prefix_cache_hits => "cachet:preempted_prefix_cache_hits",
        help "Prefix cache hits on re-admission after a preemption, in tokens",
        meaning "of those, tokens found";
    num_preemptions => "vllm:num_preemptions",
        help "Cumulative number of preemption from the engine",
        meaning "preemptions (recompute)";
    prompt_tokens => "vllm:prompt_tokens",
        help "Number of prefill tokens processed",
        meaning "prompt tokens of admitted requests";
    prompt_tokens_local_compute => "vllm:prompt_tokens_by_source" ["source" = "local_compute"],
        help "Number of prompt tokens by source",
        meaning "prompt tokens computed here";
    prompt_tokens_local_cache_hit => "vllm:prompt_tokens_by_source" ["source" = "local_cache_hit"],
        help "Number of prompt tokens by source",
        meaning "prompt tokens found in the local prefix cache";
    prompt_tokens_external_kv_transfer => "vllm:prompt_tokens_by_source" ["source" = "external_kv_transfer"],
        help "Number of prompt tokens by source",
        meaning "prompt tokens loaded from the external KV tier";
    prompt_tokens_cached => "vllm:prompt_tokens_cached",
        help "Number of cached prompt tokens (local + external)",
        meaning "local + external cached prompt tokens";
    prompt_tokens_cached_device => "vllm:prompt_tokens_cached_by_source" ["source" = "device"],
        help "Prefix-cache hit tokens by the cache tier that supplied them: device (the local block pool), host (the host-memory tier), redis (a shared Redis tier), disk (the local disk tier)",
        meaning "cached prompt tokens from the local block pool";
    prompt_tokens_cached_host => "vllm:prompt_tokens_cached_by_source" ["source" = "host"],
        help "Prefix-cache hit tokens by the cache tier that supplied them",
        meaning "cached prompt tokens loaded from the host-memory tier";
    prompt_tokens_cached_redis => "vllm:prompt_tokens_cached_by_source" ["source" = "redis"],
        help "Prefix-cache hit tokens by the cache tier that supplied them",
        meaning "cached prompt tokens loaded from a shared Redis tier";
    prompt_tokens_cached_disk => "vllm:prompt_tokens_cached_by_source" ["source" = "disk"],
        help "Prefix-cache hit tokens by the cache tier that supplied them",
        meaning "cached prompt tokens loaded from the local disk tier";
    generation_tokens => "vllm:generation_tokens",
        help "Number of generation tokens processed",
        meaning "generated tokens";
    cache_creation_tokens => "cachet:cache_creation_tokens",
        help "Computed prompt tokens written into blocks that became new prefix-cache entries",
        meaning "computed prompt tokens written into new cache entries (exact)";
    blocks_allocated => "cachet:kv_blocks_allocated",
        help "KV blocks taken from the free pool",
        meaning "blocks taken from the free pool";
    blocks_filled => "cachet:kv_blocks_filled",
        help "KV blocks that became full with computed or loaded KV",
        meaning "blocks that became full with computed or loaded KV";
    blocks_evicted => "cachet:kv_blocks_evicted",
        help "Cached KV blocks whose prefix-cache entry was evicted",
        meaning "cached blocks whose entry was dropped to satisfy an allocation";
    miss_capped_for_logits => "cachet:prefix_cache_miss_tokens" ["reason" = "capped_for_logits"],
        help "Computed prompt tokens by why they were not served from cache (the reasons sum to the computed tokens)",
        meaning "computed because the N-1 rule dropped a cached last full block";
    miss_partial_block => "cachet:prefix_cache_miss_tokens" ["reason" = "partial_block"],
        help "Computed prompt tokens by why they were not served from cache",
        meaning "tail tokens of a prompt block that is not full";
    miss_evicted => "cachet:prefix_cache_miss_tokens" ["reason" = "evicted"],
        help "Computed prompt tokens by why they were not served from cache",
        meaning "their block was cached and evicted (shadow set, `--eviction-shadow-blocks`)";
    miss_never_cached => "cachet:prefix_cache_miss_tokens" ["reason" = "never_cached"],
        help "Computed prompt tokens by why they were not served from cache",
        meaning "their block was not cached (or evicted longer ago than the shadow set remembers)";
    miss_lookup_skipped => "cachet:prefix_cache_miss_tokens" ["reason" = "lookup_skipped"],
        help "Computed prompt tokens by why they were not served from cache",
        meaning "no lookup: cache disabled, prompt logprobs, or a session continuation";
    miss_load_failed => "cachet:prefix_cache_miss_tokens" ["reason" = "load_failed"],
        help "Computed prompt tokens by why they were not served from cache",
        meaning "the external tier held them but the load failed";
    router_predicted => "cachet:router_predicted_tokens",
        help "Prompt tokens a router predicted this instance held (x-prefix-cache-predicted-tokens, capped at the prompt)",
        meaning "the predicted cached prefix of requests that carried a prediction";
    shortfall_capped_for_logits => "cachet:router_shortfall_tokens" ["reason" = "capped_for_logits"],
        help "Predicted prompt tokens that were computed, by why (the miss reason of each; the reasons sum to the shortfall)",
        meaning "predicted, computed because the N-1 rule dropped a cached last full block";
    shortfall_partial_block => "cachet:router_shortfall_tokens" ["reason" = "partial_block"],
        help "Predicted prompt tokens that were computed, by why",
        meaning "predicted, but in a prompt block that is not full (never cached)";
    shortfall_evicted => "cachet:router_shortfall_tokens" ["reason" = "evicted"],
        help "Predicted prompt tokens that were computed, by why",
        meaning "predicted, but evicted here since (shadow set)";
    shortfall_never_cached => "cachet:router_shortfall_tokens" ["reason" = "never_cached"],
        help "Predicted prompt tokens that were computed, by why",
        meaning "predicted, but never held here (or evicted longer ago than the shadow set remembers, or held under another salt)";
    shortfall_lookup_skipped => "cachet:router_shortfall_tokens" ["reason" = "lookup_skipped"],
        help "Predicted prompt tokens that were computed, by why",
        meaning "predicted, but the request did no lookup";
    shortfall_load_failed => "cachet:router_shortfall_tokens" ["reason" = "load_failed"],
        help "Predicted prompt tokens that were computed, by why",
        meaning "predicted, held by the external tier, but the load failed";
    estimated_hits_2x => "cachet:prefix_cache_hits_estimated" ["pool_scale" = "2x"],
        help "Prefix cache hits (tokens) the local cache would have had with 2x / 4x as many blocks, estimated from the shadow set of evicted blocks (compare with vllm:prefix_cache_queries)",
        meaning "estimated hit tokens with twice the blocks (divide by `vllm:prefix_cache_queries`)";
    estimated_hits_4x => "cachet:prefix_cache_hits_estimated" ["pool_scale" = "4x"],
        help "Prefix cache hits (tokens) the local cache would have had with more blocks",
        meaning "estimated hit tokens with four times the blocks";
    diverged_requests => "cachet:prefix_cache_diverged_requests",
        help "Requests whose first uncached block has a cached sibling under the same parent (their prompt differs from a cached one)",
        meaning "requests whose prompt differs from a cached one (`diverged_at` set)";
    diverged_requests_within_64 => "cachet:prefix_cache_diverged_early_requests",
        help "Requests whose prompt differs from a cached one within its first 64 tokens (a per-request nonce near the start defeats the cache)",
        meaning "of those, the ones that differ within the first 64 tokens";
}

/// Local prefix-cache hit rates since the start: measured, and estimated for a pool with 2x and
/// 4x as many blocks (hits over queries; 0 before the first query).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HitRates {
    pub hit_rate: f64,
    pub hit_rate_2x: f64,
    pub hit_rate_4x: f64,
}

impl CounterTotals {
    /// A request's miss reasons into their counters.
    pub fn add_miss(&mut self, m: &MissTokens) {
        self.miss_capped_for_logits += m.capped_for_logits;
        self.miss_partial_block += m.partial_block;
        self.miss_evicted += m.evicted;
        self.miss_never_cached += m.never_cached;
        self.miss_lookup_skipped += m.lookup_skipped;
        self.miss_load_failed += m.load_failed;
    }

    /// A request's router prediction and its shortfall into their counters.
    pub fn add_shortfall(&mut self, predicted: u64, m: &MissTokens) {
        self.router_predicted += predicted;
        self.shortfall_capped_for_logits += m.capped_for_logits;
        self.shortfall_partial_block += m.partial_block;
        self.shortfall_evicted += m.evicted;
        self.shortfall_never_cached += m.never_cached;
        self.shortfall_lookup_skipped += m.lookup_skipped;
        self.shortfall_load_failed += m.load_failed;
    }

    pub fn hit_rates(&self) -> HitRates {
        let q = self.prefix_cache_queries;
        let r = |h: u64| if q == 0 { 0.0 } else { h as f64 / q as f64 };
        HitRates {
            hit_rate: r(self.prefix_cache_hits),
            hit_rate_2x: r(self.estimated_hits_2x),
            hit_rate_4x: r(self.estimated_hits_4x),
        }
    }
}

/// One tenant's monotonic totals. The recorder's tenant list only grows (bounded by
/// `--max-tenant-labels`, the rest under "other"), so an index names one tenant for good.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantTotals {
    pub tenant: Arc<str>,
    /// Prompt tokens of first-admission lookups (as `prefix_cache_queries`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found in the local cache.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of admitted requests (as `prompt_tokens`).
    pub prompt_tokens: u64,
    /// Local + external cached prompt tokens (as `prompt_tokens_cached`).
    pub cached_tokens: u64,
}

impl TenantTotals {
    fn values(&self) -> [u64; 4] {
        [
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.prompt_tokens,
            self.cached_tokens,
        ]
    }
}

/// One tenant's increments in one interval.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantDelta {
    pub tenant: Arc<str>,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// The single place where monotonic totals become per-interval deltas.
#[derive(Clone, Debug, Default)]
pub struct DeltaTracker {
    last: CounterTotals,
    last_tenants: Vec<[u64; 4]>,
}

impl DeltaTracker {
    /// Deltas since the previous call, and remember `now` as the new baseline.
    pub fn advance(&mut self, now: &CounterTotals) -> CounterDeltas {
        let d = now.delta_since(&self.last);
        self.last = *now;
        d
    }

    /// The tenants whose totals moved since the previous call, with their increments.
    pub fn advance_tenants(&mut self, now: &[TenantTotals]) -> Vec<TenantDelta> {
        if self.last_tenants.len() < now.len() {
            self.last_tenants.resize(now.len(), [0; 4]);
        }
        let mut out = Vec::new();
        for (t, last) in now.iter().zip(self.last_tenants.iter_mut()) {
            let v = t.values();
            if v == *last {
                continue;
            }
            let d: [u64; 4] = std::array::from_fn(|i| v[i].saturating_sub(last[i]));
            *last = v;
            out.push(TenantDelta {
                tenant: t.tenant.clone(),
                prefix_cache_queries: d[0],
                prefix_cache_hits: d[1],
                prompt_tokens: d[2],
                cached_tokens: d[3],
            });
        }
        out
    }
}

/// Instantaneous state of the scheduler and the pool (not accounting: read off the state when
/// asked, so it is true whenever it is read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gauges {
    pub num_requests_running: u64,
    /// Every request not running: waiting for admission or for its KV loads.
    pub num_requests_waiting: u64,
    /// Of the waiting ones, those whose external KV loads are in flight.
    pub num_requests_waiting_for_kv: u64,
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
    fn tenant_deltas_name_only_tenants_that_moved() {
        let mut t = DeltaTracker::default();
        let mut now = vec![TenantTotals {
            tenant: "a".into(),
            prefix_cache_queries: 10,
            prefix_cache_hits: 4,
            prompt_tokens: 10,
            cached_tokens: 4,
        }];
        let d = t.advance_tenants(&now);
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].prefix_cache_queries, d[0].prefix_cache_hits), (10, 4));
        assert!(t.advance_tenants(&now).is_empty());
        now.push(TenantTotals {
            tenant: "b".into(),
            prefix_cache_queries: 3,
            ..Default::default()
        });
        now[0].prefix_cache_queries = 12;
        let d = t.advance_tenants(&now);
        assert_eq!(d.len(), 2);
        assert_eq!(
            (
                &*d[0].tenant,
                d[0].prefix_cache_queries,
                d[0].prefix_cache_hits
            ),
            ("a", 2, 0)
        );
        assert_eq!((&*d[1].tenant, d[1].prefix_cache_queries), ("b", 3));
    }

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
    fn counter_table_lists_every_field_once_in_order() {
        let d = CounterDeltas {
            prefix_cache_queries: 1,
            blocks_evicted: 2,
            ..Default::default()
        };
        let v = d.values();
        assert_eq!(v.len(), COUNTERS.len());
        assert_eq!(COUNTERS[0].field, "prefix_cache_queries");
        assert_eq!(v[0], 1);
        let ev = COUNTERS
            .iter()
            .position(|c| c.field == "blocks_evicted")
            .expect("blocks_evicted");
        assert_eq!(v[ev], 2);
        let mut fields: Vec<&str> = COUNTERS.iter().map(|c| c.field).collect();
        fields.sort_unstable();
        fields.dedup();
        assert_eq!(fields.len(), COUNTERS.len());
        let by_source: Vec<_> = COUNTERS
            .iter()
            .filter(|c| c.metric == "vllm:prompt_tokens_by_source")
            .filter_map(|c| c.label)
            .collect();
        assert_eq!(
            by_source,
            vec![
                ("source", "local_compute"),
                ("source", "local_cache_hit"),
                ("source", "external_kv_transfer")
            ]
        );
    }

    #[test]
    fn times_derive_every_latency() {
        let t = RequestTimes {
            arrival: 1.0,
            first_scheduled: Some(1.5),
            first_token: Some(3.0),
            finished: Some(7.0),
        };
        assert_eq!(t.queue_s(), 0.5);
        assert_eq!(t.prefill_s(), 1.5);
        assert_eq!(t.ttft_s(), Some(2.0));
        assert_eq!(t.decode_s(), 4.0);
        assert_eq!(t.inference_s(), 5.5);
        assert_eq!(t.e2e_s(), 6.0);
        // Aborted while waiting: all queue.
        let w = RequestTimes {
            arrival: 1.0,
            finished: Some(4.0),
            ..Default::default()
        };
        assert_eq!((w.queue_s(), w.prefill_s(), w.ttft_s()), (3.0, 0.0, None));
    }

    #[test]
    fn prefill_stats_check_catches_each_invariant() {
        let ok = PrefillStats {
            prompt_tokens: 10,
            local_cached_tokens: 4,
            cached_tokens: 4,
            computed_tokens: 6,
            cache_creation_tokens: 6,
            miss_tokens: MissTokens {
                never_cached: 4,
                partial_block: 2,
                ..Default::default()
            },
            ..Default::default()
        };
        ok.check().unwrap();
        assert!(PrefillStats {
            miss_tokens: MissTokens::default(),
            ..ok
        }
        .check()
        .is_err());
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
