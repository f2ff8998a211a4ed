//! Command-line arguments of the HTTP server (flattened into `cachet serve` by the binary).

use clap::Args;

/// Default request body limit: 16 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// Default `--header-read-timeout`, seconds.
pub const DEFAULT_HEADER_READ_TIMEOUT_S: f64 = 10.0;
/// Default `--body-read-timeout`, seconds (16 MiB in 60 s is 280 KB/s).
pub const DEFAULT_BODY_READ_TIMEOUT_S: f64 = 60.0;
/// Default `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default `--max-large-requests` (with 16 MiB bodies at most 1 GiB of them in memory).
pub const DEFAULT_MAX_LARGE_REQUESTS: usize = 64;

/// Default `--responses-store-max`.
pub const DEFAULT_RESPONSES_STORE_MAX: usize = 10_000;
/// Default `--responses-store-ttl-secs` (one hour).
pub const DEFAULT_RESPONSES_STORE_TTL_S: f64 = 3600.0;

/// The server's own flags. Engine flags (`--max-waiting-requests`, `--block-size`, ...) belong to
/// the engine's configuration, not here.
#[derive(Args, Clone, Debug)]
pub struct ServerArgs {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name(s) clients must use in `model`; defaults to the engine's model name.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Require this key on every `/v1` route (`Authorization: Bearer` or `x-api-key`); a
    /// comma-separated list accepts any of them, and `NAME:KEY` names the tenant its requests
    /// are counted under (`cachet:tenant_*` metrics). A named key is a tenant's: it is refused
    /// (403) on `/v1/cache/*` and `/reset_prefix_cache`, which show or drop every tenant's
    /// cache; an unnamed key is the operator's.
    #[arg(long, env = "CACHET_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Add a top-level `metrics` object (timings and prefix-cache stats) to every response.
    #[arg(long)]
    pub enable_per_request_metrics: bool,
    /// Largest accepted request body in bytes (413 above it).
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Seconds between periodic stats log lines; 0 disables them.
    #[arg(long, default_value_t = 10.0)]
    pub log_stats_interval: f64,
    /// On SIGTERM, seconds to let live requests finish before aborting them.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Seconds a client has to send a request's headers, and that an idle keep-alive
    /// connection stays open; the connection is closed after. 0: no limit.
    #[arg(long, default_value_t = DEFAULT_HEADER_READ_TIMEOUT_S)]
    pub header_read_timeout: f64,
    /// Seconds a client has to send a request body, counted from the end of its headers; 408
    /// after. 0: no limit.
    #[arg(long, default_value_t = DEFAULT_BODY_READ_TIMEOUT_S)]
    pub body_read_timeout: f64,
    /// Most client connections open at once; further ones wait in the listen backlog until one
    /// closes. Lowered at startup to fit the process's file descriptor limit.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Web origins (`scheme://host[:port]`, comma-separated or repeated; `*` for any) whose
    /// pages may call the API from a browser (CORS). None by default: no CORS headers are sent,
    /// preflights are refused, and a cross-origin POST or DELETE gets 403.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub allowed_origins: Vec<String>,
    /// Most requests with a body over 32 KiB in flight at once (their bodies in memory, their
    /// tokenization on its own thread); further ones wait, unread, for one to finish.
    #[arg(long, default_value_t = DEFAULT_MAX_LARGE_REQUESTS)]
    pub max_large_requests: usize,
    /// How tool calls are written in model output: hermes, llama3_json, mistral, generic, or
    /// auto (from what the chat template renders; generic when it renders no tool calls).
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Keep Claude Code's per-request billing line (`x-anthropic-billing-header: ...; cch=...`)
    /// in the prompt. By default it is removed: its nonce defeats prefix caching.
    #[arg(long)]
    pub keep_billing_header: bool,
    /// Separate the model's `<think>` reasoning from its answer (vLLM's flag): `qwen3` or
    /// `deepseek_r1`. Off by default: the reasoning stays in the answer text.
    #[arg(long, value_parser = parse_reasoning_parser)]
    pub reasoning_parser: Option<cachet_text::ReasoningFormat>,
    /// Most responses `/v1/responses` keeps (`store: true`, the default); the oldest go first.
    #[arg(long, default_value_t = DEFAULT_RESPONSES_STORE_MAX)]
    pub responses_store_max: usize,
    /// Seconds a stored response is kept (and can be continued with `previous_response_id`).
    #[arg(long, default_value_t = DEFAULT_RESPONSES_STORE_TTL_S, value_parser = parse_ttl_secs)]
    pub responses_store_ttl_secs: f64,
    /// The engine's KV cache events, for `GET /v1/cache/events` (set by the binary when the
    /// engine publishes to it; not a flag).
    #[arg(skip)]
    pub event_log: Option<crate::cache_routes::EventLogHandle>,
    /// Where stored responses are kept across a restart (set by the binary with a disk KV
    /// tier: `responses.json` in its directory; not a flag).
    #[arg(skip)]
    pub responses_file: Option<std::path::PathBuf>,
}

impl Default for ServerArgs {
    fn default() -> Self {
        ServerArgs {
            host: "127.0.0.1".to_string(),
            port: 8000,
            served_model_name: Vec::new(),
            api_key: None,
            enable_per_request_metrics: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            log_stats_interval: 10.0,
            shutdown_timeout: 30.0,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT_S,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT_S,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            allowed_origins: Vec::new(),
            max_large_requests: DEFAULT_MAX_LARGE_REQUESTS,
            tool_call_parser: None,
            keep_billing_header: false,
            reasoning_parser: None,
            responses_store_max: DEFAULT_RESPONSES_STORE_MAX,
            responses_store_ttl_secs: DEFAULT_RESPONSES_STORE_TTL_S,
            event_log: None,
            responses_file: None,
        }
    }
}

fn parse_reasoning_parser(name: &str) -> Result<cachet_text::ReasoningFormat, String> {
    cachet_text::ReasoningFormat::parse(name)
        .ok_or_else(|| format!("unknown reasoning parser {name:?} (expected qwen3 or deepseek_r1)"))
}

/// A number of seconds: finite and not negative.
fn parse_ttl_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds (finite, 0 or more)"
        )),
    }
}

impl ServerArgs {
    /// The name reported in responses and metric labels: the first served name, or `fallback`
    /// (the engine's model name).
    pub fn primary_model_name(&self, fallback: &str) -> String {
        self.served_model_name
            .first()
            .cloned()
            .unwrap_or_else(|| fallback.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::parse_ttl_secs;

    #[test]
    fn a_store_ttl_is_finite_and_not_negative() {
        assert_eq!(parse_ttl_secs("0"), Ok(0.0));
        assert_eq!(parse_ttl_secs("90.5"), Ok(90.5));
        for bad in ["-1", "NaN", "inf", "soon"] {
            assert!(parse_ttl_secs(bad).is_err(), "{bad}");
        }
    }
}
