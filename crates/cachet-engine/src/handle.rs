//! [`EngineHandle`]: the async-friendly handle on the core thread, and [`RequestStream`], the
//! outputs of one request.
//!
//! The engine names every request by a handle it assigns (unique for the engine's lifetime);
//! streams, aborts and stat loggers use it, so no client can address another's request. A
//! client's `X-Request-Id` is only a label. Admission is one round trip to the core thread,
//! which is the single source of truth for everything that depends on the engine's state
//! (queue full, a session's turn in flight).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cachet_core::scheduler::AddError;
use cachet_core::stats::{Gauges, SpecDecodeCounts};
use cachet_core::{FinishReason, Report, RequestLimits, Sampled, SessionInfo, ValidRequest};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch};

use crate::{EngineConfig, ModelInfo};

/// The engine's name for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RequestHandle(pub u64);

/// Where the engine is in its life. `/health`, new requests and shutdown all read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineState {
    /// Accepting and serving requests.
    Running,
    /// Shutting down: no new requests; the live ones finish (up to the drain timeout).
    Draining,
    /// The core thread failed: nothing is served; the process should exit.
    Dead,
    /// Shut down cleanly.
    Stopped,
}

impl EngineState {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineState::Running => "running",
            EngineState::Draining => "draining",
            EngineState::Dead => "dead",
            EngineState::Stopped => "stopped",
        }
    }
}

/// Why the engine ended a request with an error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EngineFailure {
    /// The model failed on a step; the engine goes on serving.
    Model(String),
    /// The core thread died; the engine serves nothing more.
    Died(String),
}

impl std::fmt::Display for EngineFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineFailure::Model(m) => write!(f, "model execution failed: {m}"),
            EngineFailure::Died(m) => write!(f, "the engine failed: {m}"),
        }
    }
}

/// One message on a request's stream.
#[derive(Clone, Debug)]
pub struct RequestOutput {
    /// Newly generated tokens (with logprobs when asked).
    pub tokens: Vec<Sampled>,
    /// `tokens` holds the request's first output token.
    pub first_token: bool,
    pub finish_reason: Option<FinishReason>,
    /// On the first-token and final outputs: the recorder's numbers (stats, times, session
    /// totals, and on the final one the finished-request record). `None` with telemetry off.
    pub report: Option<Box<Report>>,
    /// Session turns: how the turn was served (first-token and final outputs).
    pub session: Option<SessionInfo>,
    /// The engine failed while the request was live (final output).
    pub error: Option<EngineFailure>,
    /// Which of the request's `n` sequences this output belongs to (0 for the first). Each
    /// sequence ends with its own final output (`finish_reason` set).
    pub seq: u32,
    /// Requests with prompt logprobs: one per prompt token after the first (on the first-token
    /// output, or the final one with `max_tokens: 0`).
    pub prompt_logprobs: Option<Vec<Sampled>>,
    /// Speculative decoding on: this sequence's draft counts (on its final output; `None` on
    /// every other output and when speculation is off).
    pub spec_decode: Option<SpecDecodeCounts>,
}

impl RequestOutput {
    pub(crate) fn failed(error: EngineFailure) -> Self {
        RequestOutput {
            tokens: Vec::new(),
            first_token: false,
            finish_reason: Some(FinishReason::Error),
            report: None,
            session: None,
            error: Some(error),
            seq: 0,
            prompt_logprobs: None,
            spec_decode: None,
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AddRequestError {
    #[error(transparent)]
    Refused(#[from] AddError),
    /// Draining, dead or stopped.
    #[error("the engine is not accepting requests ({})", .0.as_str())]
    NotRunning(EngineState),
}

pub(crate) enum Command {
    Add {
        handle: RequestHandle,
        req: Box<ValidRequest>,
        out: mpsc::UnboundedSender<RequestOutput>,
        ack: oneshot::Sender<Result<(), AddError>>,
    },
    Finish {
        handle: RequestHandle,
        /// One sequence of the request; `None`: all of them.
        seq: Option<u32>,
        reason: FinishReason,
    },
    ReleaseSession(String, oneshot::Sender<()>),
    ResetPrefixCache(oneshot::Sender<bool>),
    Inspect(
        crate::inspect::InspectQuery,
        oneshot::Sender<crate::inspect::InspectReply>,
    ),
    /// Abort every live request; replies how many.
    AbortAll(oneshot::Sender<usize>),
    /// A tier finished a load: step soon.
    Wake,
    Shutdown,
}

pub(crate) struct Shared {
    pub(crate) cfg: EngineConfig,
    pub(crate) model: ModelInfo,
    pub(crate) state: watch::Sender<EngineState>,
    /// Live requests in the core thread (published after each loop iteration).
    pub(crate) live: watch::Sender<usize>,
    pub(crate) gauges: watch::Sender<Gauges>,
    /// The core thread has exited.
    pub(crate) exited: watch::Sender<bool>,
    next_handle: AtomicU64,
    pub(crate) start: Instant,
}

impl Shared {
    pub(crate) fn new(cfg: EngineConfig, model: ModelInfo) -> Self {
        Shared {
            cfg,
            model,
            state: watch::channel(EngineState::Running).0,
            live: watch::channel(0).0,
            gauges: watch::channel(Gauges::default()).0,
            exited: watch::channel(false).0,
            next_handle: AtomicU64::new(1),
            start: Instant::now(),
        }
    }

    pub(crate) fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub(crate) fn state(&self) -> EngineState {
        *self.state.borrow()
    }

    /// Move to `next` unless the engine is already further along (dead or stopped stay so).
    pub(crate) fn advance_state(&self, next: EngineState) {
        self.state.send_if_modified(|s| {
            let rank = |s: EngineState| match s {
                EngineState::Running => 0,
                EngineState::Draining => 1,
                EngineState::Stopped => 2,
                EngineState::Dead => 3,
            };
            if rank(next) > rank(*s) {
                *s = next;
                true
            } else {
                false
            }
        });
    }
}

/// The server's handle on the engine. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) tx: std_mpsc::Sender<Command>,
    pub(crate) shared: Arc<Shared>,
}

/// Outputs of one request (all its sequences). Dropping it before every sequence's final
/// output aborts the request.
pub struct RequestStream {
    handle: RequestHandle,
    rx: mpsc::UnboundedReceiver<RequestOutput>,
    tx: std_mpsc::Sender<Command>,
    /// Sequences that have not ended yet.
    remaining: u32,
    finished: bool,
}

impl RequestStream {
    pub fn handle(&self) -> RequestHandle {
        self.handle
    }

    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.finished {
            return None;
        }
        let out = self.rx.recv().await;
        match &out {
            // The engine failed: every sequence ends with this one output.
            Some(o) if o.error.is_some() => self.finished = true,
            Some(o) if o.finish_reason.is_some() => {
                self.remaining = self.remaining.saturating_sub(1);
                self.finished = self.remaining == 0;
            }
            None => self.finished = true,
            _ => {}
        }
        out
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            // A no-op if the request already ended: handles are never reused.
            let _ = self.tx.send(Command::Finish {
                handle: self.handle,
                seq: None,
                reason: FinishReason::Abort,
            });
        }
    }
}

impl EngineHandle {
    pub fn model(&self) -> &ModelInfo {
        &self.shared.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    /// The static limits every request is validated against (once, by the server).
    pub fn limits(&self) -> RequestLimits {
        self.shared.cfg.scheduler.limits()
    }

    /// Seconds on the engine's clock.
    pub fn now(&self) -> f64 {
        self.shared.now()
    }

    pub fn state(&self) -> EngineState {
        self.shared.state()
    }

    /// Follows the engine's state (e.g. to exit when it dies).
    pub fn watch_state(&self) -> watch::Receiver<EngineState> {
        self.shared.state.subscribe()
    }

    /// The gauges as of the core thread's latest loop iteration (after every step and every
    /// command, a prefix-cache reset included).
    pub fn gauges(&self) -> Gauges {
        *self.shared.gauges.borrow()
    }

    /// Queue a validated request. Resolves once the core thread has accepted or refused it.
    pub async fn add_request(&self, req: ValidRequest) -> Result<RequestStream, AddRequestError> {
        let state = self.state();
        if state != EngineState::Running {
            return Err(AddRequestError::NotRunning(state));
        }
        let handle = RequestHandle(self.shared.next_handle.fetch_add(1, Ordering::Relaxed));
        let n = req.draft().n.max(1);
        let (out, rx) = mpsc::unbounded_channel();
        let (ack, ack_rx) = oneshot::channel();
        let cmd = Command::Add {
            handle,
            req: Box::new(req),
            out,
            ack,
        };
        if self.tx.send(cmd).is_err() {
            return Err(AddRequestError::NotRunning(self.state()));
        }
        // From here a dropped stream aborts the request, even before the ack arrives.
        let mut stream = RequestStream {
            handle,
            rx,
            tx: self.tx.clone(),
            remaining: n,
            finished: false,
        };
        match ack_rx.await {
            Ok(Ok(())) => Ok(stream),
            Ok(Err(e)) => {
                stream.finished = true;
                Err(e.into())
            }
            Err(_) => {
                stream.finished = true;
                Err(AddRequestError::NotRunning(self.state()))
            }
        }
    }

    /// Abort a live request (no-op once it ended).
    pub fn abort(&self, handle: RequestHandle) {
        self.finish(handle, FinishReason::Abort);
    }

    /// End every sequence of a live request with `reason`.
    pub fn finish(&self, handle: RequestHandle, reason: FinishReason) {
        let _ = self.tx.send(Command::Finish {
            handle,
            seq: None,
            reason,
        });
    }

    /// End one sequence of a live request (e.g. a stop string matched in its text).
    pub fn finish_seq(&self, handle: RequestHandle, seq: u32, reason: FinishReason) {
        let _ = self.tx.send(Command::Finish {
            handle,
            seq: Some(seq),
            reason,
        });
    }

    /// Close a session: a turn in flight is aborted, and the parked KV is released (full blocks
    /// stay in the prefix cache). Resolves once done.
    pub async fn release_session(&self, session_id: &str) {
        let (tx, rx) = oneshot::channel();
        if self
            .tx
            .send(Command::ReleaseSession(session_id.to_string(), tx))
            .is_ok()
        {
            let _ = rx.await;
        }
    }

    /// Drop every prefix-cache entry; only succeeds while no request holds a block.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::ResetPrefixCache(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Ask the core thread about its cache (between steps); `None` when it is gone.
    pub async fn inspect(
        &self,
        q: crate::inspect::InspectQuery,
    ) -> Option<crate::inspect::InspectReply> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Inspect(q, tx)).ok()?;
        rx.await.ok()
    }

    /// Wake the core thread (a tier's load finished).
    pub fn waker(&self) -> impl Fn() + Send + Sync + 'static {
        let tx = std::sync::Mutex::new(self.tx.clone());
        move || {
            if let Ok(tx) = tx.lock() {
                let _ = tx.send(Command::Wake);
            }
        }
    }

    /// Stop accepting requests, let the live ones finish for at most `timeout`, abort what is
    /// left, stop the core thread and wait for it. Returns how many requests were aborted.
    pub async fn shutdown(&self, timeout: Duration) -> usize {
        self.shared.advance_state(EngineState::Draining);
        let mut live = self.shared.live.subscribe();
        let drained = tokio::time::timeout(timeout, async move {
            let _ = live.wait_for(|&n| n == 0).await;
        })
        .await
        .is_ok();
        let mut aborted = 0;
        if !drained {
            let (tx, rx) = oneshot::channel();
            if self.tx.send(Command::AbortAll(tx)).is_ok() {
                aborted = rx.await.unwrap_or(0);
            }
            tracing::warn!(
                aborted,
                timeout_s = timeout.as_secs_f64(),
                "shutdown: drain timeout reached; aborted the remaining requests"
            );
        }
        let _ = self.tx.send(Command::Shutdown);
        let mut exited = self.shared.exited.subscribe();
        let _ = exited.wait_for(|&e| e).await;
        aborted
    }

    /// Wait until no request is live in the core.
    pub async fn wait_idle(&self) {
        let mut live = self.shared.live.subscribe();
        let _ = live.wait_for(|&n| n == 0).await;
    }
}
