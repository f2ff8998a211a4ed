//! Engine flags shared by `serve`, `generate` and `bench`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExecutorKind {
    /// A real GGUF model (`--model`, default SmolLM2-135M-Instruct Q4_1).
    Model,
    /// The deterministic simulated model (tests, scheduler benchmarks).
    Sim,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    Fcfs,
    Priority,
}

/// Speculative decoding methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Speculative {
    /// Prompt lookup: drafts are the tokens that followed the last n-gram's most recent
    /// earlier occurrence in the prompt and output (vLLM's `ngram`).
    Ngram,
}

#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Which executor runs the model.
    #[arg(long, value_enum, default_value = "model")]
    pub executor: ExecutorKind,
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks in the pool (default: sized from --kv-cache-memory).
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// Bytes of KV cache when --num-kv-blocks is not given.
    #[arg(long, default_value_t = 1 << 30)]
    pub kv_cache_memory: u64,
    /// KV element type: f16 or f32.
    #[arg(long, default_value = "f16")]
    pub kv_cache_dtype: String,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 128)]
    pub max_num_seqs: usize,
    /// Cap on one prefill chunk per step (0: none).
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// Context length (default: the model's, 8192 for the simulator).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Disable the prefix cache.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    #[arg(long, value_enum, default_value = "fcfs")]
    pub scheduling_policy: Policy,
    /// Requests waiting for admission beyond which new ones get 503.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting_requests: usize,
    /// Seconds a parked session (kept KV between turns) may stay idle before it is released.
    #[arg(long, default_value_t = 300.0)]
    pub session_idle_timeout: f64,
    /// Most KV blocks all parked sessions may hold (least recently used released first).
    #[arg(long, default_value_t = 1024)]
    pub session_kv_budget: usize,
    /// Simulator: wall time per prefill token, microseconds.
    #[arg(long, default_value_t = 0)]
    pub sim_prefill_us_per_token: u64,
    /// Simulator: wall time per decoding sequence per step, microseconds.
    #[arg(long, default_value_t = 0)]
    pub sim_decode_us_per_seq: u64,
    /// Simulator: make the n-th generated token EOS.
    #[arg(long)]
    pub sim_eos_at_output: Option<usize>,
    /// Simulator: reply with this text (byte tokens) then EOS, to every request.
    #[arg(long, conflicts_with_all = ["sim_eos_at_output", "sim_reply_file"])]
    pub sim_reply: Option<String>,
    /// Simulator: reply with this file's text (UTF-8) then EOS, to every request.
    #[arg(long, conflicts_with = "sim_eos_at_output")]
    pub sim_reply_file: Option<std::path::PathBuf>,
    /// KV cache events for cache-aware routers, vLLM's JSON (`enable_kv_cache_events`,
    /// `publisher`, `endpoint`, `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`,
    /// `topic`; cachet's `cachet_encoding`: `map` or `array`).
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Event batches `GET /v1/cache/events` keeps for `Last-Event-ID` replay (0: no endpoint).
    #[arg(long, default_value_t = 1024)]
    pub kv_events_sse_buffer: usize,
    /// Recently evicted block hashes remembered for the `evicted` miss reason and the 2x/4x
    /// hit-rate estimates (default: six times the pool; 0: none, evictions then read as
    /// `never_cached` and no estimate is made).
    #[arg(long)]
    pub eviction_shadow_blocks: Option<usize>,
    /// Tenants with their own label in `cachet:tenant_*` (the rest are `other`).
    #[arg(long, default_value_t = 64)]
    pub max_tenant_labels: usize,
    /// Finished requests whose block lifecycle `GET /v1/cache/requests/{id}` keeps.
    #[arg(long, default_value_t = 256)]
    pub request_history: usize,
    /// Simulator, fault injection: panic the core thread on the step that computes this text
    /// (tests of the engine-death path).
    #[arg(long, hide = true)]
    pub sim_panic_on: Option<String>,
    /// Speculative decoding (off by default): `ngram` drafts by prompt lookup, verified in
    /// one forward; greedy output is identical, sampled output distributed as without it.
    #[arg(long, value_enum)]
    pub speculative: Option<Speculative>,
    /// Most draft tokens per request and step.
    #[arg(long, default_value_t = 5)]
    pub num_speculative_tokens: usize,
    /// Shortest n-gram the prompt lookup matches.
    #[arg(long, default_value_t = 2)]
    pub spec_ngram_min: usize,
    /// Longest n-gram the prompt lookup matches (tried first).
    #[arg(long, default_value_t = 4)]
    pub spec_ngram_max: usize,
}

impl EngineArgs {
    /// The speculative decoding settings (`None`: off).
    pub fn spec_config(&self) -> Option<cachet_core::spec_decode::SpecConfig> {
        self.speculative
            .map(|Speculative::Ngram| cachet_core::spec_decode::SpecConfig {
                num_speculative_tokens: self.num_speculative_tokens,
                // (`wiring::build` refuses a range that matches nothing.)
                prompt_lookup_min: self.spec_ngram_min,
                prompt_lookup_max: self.spec_ngram_max,
                ..Default::default()
            })
    }

    /// What the recorder keeps for cache insight.
    pub fn insight(&self) -> cachet_engine::InsightConfig {
        cachet_engine::InsightConfig {
            shadow_blocks: self.eviction_shadow_blocks,
            max_tenant_labels: Some(self.max_tenant_labels),
            request_history: self.request_history,
            block_index: true,
        }
    }
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs {
            executor: ExecutorKind::Sim,
            model: None,
            threads: 0,
            block_size: 16,
            num_kv_blocks: None,
            kv_cache_memory: 1 << 30,
            kv_cache_dtype: "f16".into(),
            max_num_batched_tokens: 2048,
            max_num_seqs: 128,
            long_prefill_token_threshold: 0,
            max_model_len: None,
            no_enable_prefix_caching: false,
            scheduling_policy: Policy::Fcfs,
            max_waiting_requests: 1024,
            session_idle_timeout: 300.0,
            session_kv_budget: 1024,
            sim_prefill_us_per_token: 0,
            sim_decode_us_per_seq: 0,
            sim_eos_at_output: None,
            sim_reply: None,
            sim_reply_file: None,
            sim_panic_on: None,
            kv_events_config: None,
            kv_events_sse_buffer: 1024,
            eviction_shadow_blocks: None,
            max_tenant_labels: 64,
            request_history: 256,
            speculative: None,
            num_speculative_tokens: 5,
            spec_ngram_min: 2,
            spec_ngram_max: 4,
        }
    }
}
