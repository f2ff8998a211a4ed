//! cachet's HTTP front end.
//!
//! The server parses and validates requests, renders chat templates, tokenizes, hands token ids
//! to the engine through [`EngineHandle`], and formats what the engine reports: OpenAI and
//! Anthropic responses (with SSE streaming), `usage` with prefix-cache details, optional
//! per-request metrics, and the Prometheus registry behind `/metrics`.
//!
//! **Boundary:** the server never computes an accounting number. Cached, created and computed
//! token counts come from the engine's `PrefillStats`; counters move only by the engine's
//! per-interval deltas (see [`metrics::PrometheusLogger`]).
//!
//! **Sessions** (spec §5): a `session_id` on `/v1/chat/completions`, `/v1/completions` or
//! `/v1/messages` makes the request a turn of a resumable session (the engine keeps its KV
//! between turns). Its usage counts the whole prompt sent, with retained + hit tokens as cached
//! (built in `usage.rs` from the engine's `SessionInfo`), and the response carries a
//! `session` object saying whether the turn continued (`continued` / `new` /
//! `history_mismatch`). A second turn in flight is a 409; `DELETE /v1/sessions/{id}` releases a
//! session, `POST /reset_prefix_cache` empties the prefix cache.
//!
//! Entry points: [`ServerArgs`] (flags), [`router`] (the routes, for tests), [`serve`] (bind,
//! serve, graceful shutdown, exit when the engine dies), [`MetricsHandle`] (registry + stat
//! logger for the engine).

pub mod agent;
pub mod anthropic;
mod args;
mod auth;
mod blocking;
pub mod body;
pub mod cache_header;
pub mod cache_routes;
pub mod context_edits;
mod cors;
mod dashboard;
pub mod error;
pub mod fields;
pub mod generate;
mod http_metrics;
pub mod inspect;
mod isolation;
mod limits;
mod listener;
pub mod metrics;
pub mod nonce;
pub mod openai;
mod process;
pub mod responses;
pub mod router_prediction;
pub mod sampling;
mod service_routes;
pub mod structured;
pub mod tier_metrics;
pub mod tools;
mod usage;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::Router;
use cachet_engine::{EngineHandle, EngineState};
use cachet_text::TextTokenizer;
use thiserror::Error;

pub use args::{ServerArgs, DEFAULT_MAX_BODY_BYTES};
pub use error::ApiError;
pub use metrics::{CacheConfigInfo, LogLineLogger, MetricsHandle, PrometheusLogger};

use generate::REQUEST_ID_HEADER;

struct StateInner {
    engine: EngineHandle,
    tokenizer: Arc<dyn TextTokenizer>,
    /// Every token's bytes, for the engine's stop-string checks.
    token_bytes: Arc<cachet_text::TokenBytes>,
    event_log: Option<cache_routes::EventLogHandle>,
    agent: agent::Agent,
    metrics: MetricsHandle,
    model_names: Vec<String>,
    api_keys: auth::ApiKeys,
    per_request_metrics: bool,
    max_body_bytes: usize,
    http: limits::HttpPolicy,
    responses: responses::Responses,
}

/// Shared by every route: the engine handle, the tokenizer (the text side is the server's: the
/// engine sees token ids only), the metrics registry and the server options.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<StateInner>,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<dyn TextTokenizer>,
        metrics: MetricsHandle,
        args: &ServerArgs,
    ) -> Self {
        let mut agent = agent::Agent::new(
            tokenizer.as_ref(),
            args.tool_call_parser.as_deref(),
            args.keep_billing_header,
        );
        agent.reasoning = args.reasoning_parser;
        let model_names = if args.served_model_name.is_empty() {
            vec![engine.model().name.clone()]
        } else {
            args.served_model_name.clone()
        };
        AppState {
            inner: Arc::new(StateInner {
                engine,
                token_bytes: Arc::new(cachet_text::TokenBytes::new(tokenizer.as_ref())),
                tokenizer,
                event_log: args.event_log.clone(),
                agent,
                metrics,
                model_names,
                api_keys: auth::ApiKeys::parse(args.api_key.as_deref()),
                per_request_metrics: args.enable_per_request_metrics,
                max_body_bytes: args.max_body_bytes,
                http: limits::HttpPolicy::from_args(args),
                responses: responses::Responses::new(responses::StoreLimits {
                    max_responses: args.responses_store_max,
                    ttl_secs: args.responses_store_ttl_secs,
                }),
            }),
        }
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.inner.engine
    }

    pub fn metrics(&self) -> &MetricsHandle {
        &self.inner.metrics
    }

    pub fn tokenizer(&self) -> &Arc<dyn TextTokenizer> {
        &self.inner.tokenizer
    }

    /// Every token's bytes (built once), for the engine's stop-string checks.
    pub fn token_bytes(&self) -> &Arc<cachet_text::TokenBytes> {
        &self.inner.token_bytes
    }

    /// The KV cache events log behind `GET /v1/cache/events`, when the engine publishes to it.
    pub fn event_log(&self) -> Option<&Arc<cachet_kv_events::EventLog>> {
        self.inner.event_log.as_ref().map(|h| &h.0)
    }

    /// Tool-call format, template capabilities, grammar compiler.
    pub fn agent(&self) -> &agent::Agent {
        &self.inner.agent
    }

    pub fn model_names(&self) -> &[String] {
        &self.inner.model_names
    }

    pub fn max_model_len(&self) -> usize {
        self.inner.engine.model().max_model_len
    }

    /// The stored responses (`/v1/responses`) and their background runs.
    pub fn responses(&self) -> &responses::Responses {
        &self.inner.responses
    }

    fn api_keys(&self) -> &auth::ApiKeys {
        &self.inner.api_keys
    }

    fn per_request_metrics(&self) -> bool {
        self.inner.per_request_metrics
    }

    fn max_body_bytes(&self) -> usize {
        self.inner.max_body_bytes
    }

    fn http_policy(&self) -> &limits::HttpPolicy {
        &self.inner.http
    }

    /// The name to report for a request's `model` (absent means the first served name).
    fn check_model(&self, requested: Option<&str>) -> Result<String, ApiError> {
        match requested {
            None | Some("") => Ok(self.inner.model_names.first().cloned().unwrap_or_default()),
            Some(m) if self.inner.model_names.iter().any(|n| n == m) => Ok(m.to_string()),
            Some(m) => Err(ApiError::ModelNotFound(m.to_string())),
        }
    }
}

/// Echoes the caller's `X-Request-Id` on responses that did not set one (errors).
async fn echo_request_id(req: Request, next: Next) -> Response {
    let incoming: Option<HeaderValue> = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .filter(|v| v.len() <= generate::MAX_REQUEST_ID_LEN)
        .cloned();
    let mut resp = next.run(req).await;
    if let Some(v) = incoming {
        if !resp.headers().contains_key(REQUEST_ID_HEADER) {
            resp.headers_mut().insert(REQUEST_ID_HEADER, v);
        }
    }
    resp
}

/// Every route. `/v1/*` and `/reset_prefix_cache` require the API key when one is configured;
/// `/health`, `/metrics`, `/tokenize`, `/detokenize` and `/dashboard` (a page with no data) are
/// always open.
pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route(
            "/v1/chat/completions/render",
            post(openai::chat_completions_render),
        )
        .route("/v1/completions/render", post(openai::completions_render))
        .route("/v1/cache/events", get(cache_routes::cache_events))
        .route("/v1/cache", get(inspect::overview))
        .route("/v1/cache/requests/{id}", get(inspect::request))
        .route("/v1/cache/reset", post(inspect::reset))
        .route(
            "/v1/cache/isolation-check",
            post(isolation::isolation_check),
        )
        .route("/v1/cache/stats/stream", get(inspect::stats_stream))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/models", get(service_routes::models))
        .route("/v1/sessions/{id}", delete(service_routes::delete_session))
        .route(
            "/reset_prefix_cache",
            post(service_routes::reset_prefix_cache),
        )
        .route_layer(middleware::from_fn(router_prediction::scope))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ));
    Router::new()
        .merge(v1)
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/assets/{name}", get(dashboard::asset))
        .route("/health", get(service_routes::health))
        .route("/metrics", get(service_routes::metrics))
        .route("/tokenize", post(service_routes::tokenize))
        .route("/detokenize", post(service_routes::detokenize))
        .fallback(service_routes::not_found)
        .method_not_allowed_fallback(service_routes::method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), limits::guard))
        .layer(middleware::from_fn(echo_request_id))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            http_metrics::track,
        ))
        .with_state(state)
}

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("server error: {0}")]
    Serve(#[source] std::io::Error),
    /// The engine's core thread failed; the process should exit non-zero (a supervisor
    /// restarts it).
    #[error("the engine failed; stopped serving")]
    EngineDead,
}

/// Binds `--host:--port`, serves until SIGTERM or ctrl-c, then stops accepting connections,
/// drains the live requests (at most `--shutdown-timeout` seconds) and returns.
pub async fn serve(
    args: ServerArgs,
    handle: EngineHandle,
    tokenizer: Arc<dyn TextTokenizer>,
    registry: MetricsHandle,
) -> Result<(), ServeError> {
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.clone(),
            source,
        })?;
    serve_on(
        listener,
        args,
        handle,
        tokenizer,
        registry,
        shutdown_signal(),
    )
    .await
}

/// [`serve`] on an already-bound listener, ending when `shutdown` resolves or the engine dies.
///
/// Connections are served by [`listener::run`]: headers must arrive within
/// `--header-read-timeout`, at most `--max-connections` are open at once. Large tokenizer calls
/// run off the runtime's worker threads ([`blocking::OffRuntime`]).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    args: ServerArgs,
    handle: EngineHandle,
    tokenizer: Arc<dyn TextTokenizer>,
    registry: MetricsHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let limits = listener::ConnLimits {
        header_read_timeout: limits::positive_secs(args.header_read_timeout),
        max_connections: listener::fit_to_fd_limit(args.max_connections),
    };
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(
            %addr,
            model = %handle.model().name,
            max_connections = limits.max_connections,
            "cachet server listening"
        );
    }
    let tokenizer: Arc<dyn TextTokenizer> = Arc::new(blocking::OffRuntime::new(
        tokenizer,
        blocking::heavy_permits(),
    ));
    let state = AppState::new(handle.clone(), tokenizer, registry.clone(), &args);
    if let Some(file) = &args.responses_file {
        let kept = state.responses().restore_from(file);
        if kept > 0 {
            tracing::info!(
                responses = kept,
                "stored responses from before the restart are kept"
            );
        }
    }
    let drain_timeout =
        Duration::try_from_secs_f64(args.shutdown_timeout).unwrap_or(Duration::from_secs(30));
    // Stop serving on a signal, or when the engine dies (after a moment for the error
    // responses of the requests it failed to reach their clients).
    let mut engine_state = handle.watch_state();
    let died = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = {
        let died = Arc::clone(&died);
        async move {
            tokio::select! {
                _ = shutdown => {}
                _ = async { let _ = engine_state.wait_for(|s| *s == EngineState::Dead).await; } => {
                    died.store(true, std::sync::atomic::Ordering::SeqCst);
                    tracing::error!("the engine died: failing health checks, refusing requests, exiting");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    };
    let signalled = Arc::new(tokio::sync::Notify::new());
    let drain = {
        let signalled = Arc::clone(&signalled);
        let engine = handle.clone();
        tokio::spawn(async move {
            signalled.notified().await;
            tracing::info!(
                timeout_s = drain_timeout.as_secs_f64(),
                "shutting down: no new requests; draining the live ones"
            );
            engine.shutdown(drain_timeout).await
        })
    };
    let trigger = Arc::clone(&signalled);
    listener::run(listener, router(state.clone()), limits, async move {
        stop.await;
        trigger.notify_one();
    })
    .await;
    signalled.notify_one();
    let _ = drain.await;
    if let Some(file) = &args.responses_file {
        state.responses().save_to(file);
    }
    tracing::info!("cachet server stopped");
    if died.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(ServeError::EngineDead);
    }
    Ok(())
}

/// Resolves on ctrl-c or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
