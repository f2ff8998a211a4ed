//! The engine around the pure core.
//!
//! * [`start_engine`] spawns the core thread, which owns the scheduler and the executor and runs
//!   one step at a time; [`EngineHandle`] is the async-friendly handle the server uses.
//! * [`offline::OfflineEngine`] runs the same [`core_loop::EngineCore`] synchronously.
//! * [`sim`] is the deterministic simulated model; [`tokenizer`] the text side.
//! * Stat loggers ([`StatLogger`]) receive one [`StepStats`] per step with per-interval deltas.

pub mod core_loop;
pub mod offline;
pub mod sim;
pub mod tokenizer;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch};

pub use cachet_core::scheduler::AddRequestError as CoreAddError;
pub use cachet_core::scheduler::{SessionReport, SessionStatus};
pub use cachet_core::stats::{CounterDeltas, FinishedRequestStats, Gauges, PrefillStats};
pub use cachet_core::{
    Executor, FinishReason, NewRequest, Sampled, SamplingParams, SchedulerConfig,
};
pub use tokenizer::{ChatMessage, IncrementalDetokenizer, TextTokenizer, TokenizerError};

use cachet_core::scheduler::RequestUpdate;
use core_loop::EngineCore;

/// What a stat logger receives after each step that changed anything.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    pub deltas: CounterDeltas,
    pub gauges: Gauges,
    pub finished: Vec<FinishedRequestStats>,
    pub ttft_s: Vec<f64>,
    pub itl_s: Vec<f64>,
    /// Tokens scheduled in this step (absent in steps that only finished or aborted requests).
    pub iteration_tokens: Option<u64>,
}

/// Observes the engine. Called on the engine thread: keep it cheap, never block.
pub trait StatLogger: Send {
    fn record(&mut self, step: &StepStats);
}

/// Timing of a finished request (spec §7 per-request metrics).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestMetrics {
    pub queue_time_ms: f64,
    pub time_to_first_token_ms: Option<f64>,
    pub generation_time_ms: f64,
    pub mean_itl_ms: f64,
    pub tokens_per_second: f64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub e2e_ms: f64,
    pub num_preemptions: u64,
}

/// One message on a request's stream.
#[derive(Clone, Debug)]
pub struct RequestOutput {
    pub request_id: Arc<str>,
    /// Newly generated tokens (with logprobs when asked).
    pub tokens: Vec<Sampled>,
    pub finish_reason: Option<FinishReason>,
    /// On the output with the first token, and on the final one.
    pub prefill_stats: Option<PrefillStats>,
    /// On the final output only.
    pub metrics: Option<RequestMetrics>,
    /// Session turns: how the turn was served and the session-cumulative stats (with
    /// `prefill_stats`).
    pub session: Option<SessionReport>,
}

impl RequestOutput {
    fn from_update(request_id: Arc<str>, up: RequestUpdate) -> Self {
        RequestOutput {
            request_id,
            tokens: up.token.into_iter().collect(),
            finish_reason: up.finish,
            prefill_stats: up.prefill_stats.map(|b| *b),
            metrics: up.finished.as_deref().map(RequestMetrics::from_finished),
            session: up.session.map(|b| *b),
        }
    }
}

/// The engine thread's view of one live request: its id and where its outputs go.
struct Stream {
    id: Arc<str>,
    tx: mpsc::UnboundedSender<RequestOutput>,
}

/// Live streams indexed by the core's slot (a request's slot is its own until its final
/// update, so no per-token id lookup is needed).
#[derive(Default)]
struct Streams(Vec<Option<Stream>>);

impl Streams {
    fn insert(&mut self, slot: u32, stream: Stream) {
        let i = slot as usize;
        if self.0.len() <= i {
            self.0.resize_with(i + 1, || None);
        }
        self.0[i] = Some(stream);
    }

    fn ids(&self) -> Vec<Arc<str>> {
        self.0.iter().flatten().map(|s| s.id.clone()).collect()
    }
}

/// Static facts about the served model.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_kv_blocks: usize,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Requests waiting for admission (queued + not yet admitted) beyond which `add_request`
    /// answers [`AddRequestError::QueueFull`].
    pub max_waiting_requests: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            scheduler: SchedulerConfig::default(),
            max_waiting_requests: 1024,
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AddRequestError {
    #[error("the waiting queue is full ({0} requests)")]
    QueueFull(usize),
    #[error(transparent)]
    Invalid(#[from] CoreAddError),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("could not start the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
}

enum Command {
    Add(Box<NewRequest>, mpsc::UnboundedSender<RequestOutput>),
    Finish(String, FinishReason),
    ResetPrefixCache(oneshot::Sender<bool>),
    ReleaseSession(String),
    Shutdown,
}

struct Shared {
    cfg: EngineConfig,
    model: ModelInfo,
    tokenizer: Arc<dyn TextTokenizer>,
    /// Live request ids and the sessions they belong to.
    live: Mutex<Live>,
    queued: AtomicUsize,
    waiting: AtomicUsize,
    shutting_down: AtomicBool,
    gauges: watch::Sender<Gauges>,
    idle: watch::Sender<bool>,
    start: Instant,
}

#[derive(Default)]
struct Live {
    requests: std::collections::HashMap<Arc<str>, Option<Arc<str>>>,
    sessions: HashSet<Arc<str>>,
}

impl Live {
    fn remove(&mut self, id: &str) {
        if let Some(Some(sid)) = self.requests.remove(id) {
            self.sessions.remove(&sid);
        }
    }
}

/// The server's handle on the engine. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    tx: std_mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

/// Outputs of one request. Dropping it before the request finished aborts the request.
pub struct RequestStream {
    request_id: Arc<str>,
    rx: mpsc::UnboundedReceiver<RequestOutput>,
    tx: std_mpsc::Sender<Command>,
    finished: bool,
}

impl RequestStream {
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.finished {
            return None;
        }
        let out = self.rx.recv().await;
        match &out {
            Some(o) if o.finish_reason.is_some() => self.finished = true,
            None => self.finished = true,
            _ => {}
        }
        out
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.send(Command::Finish(
                self.request_id.to_string(),
                FinishReason::Abort,
            ));
        }
    }
}

impl EngineHandle {
    pub fn model(&self) -> &ModelInfo {
        &self.shared.model
    }

    pub fn tokenizer(&self) -> &Arc<dyn TextTokenizer> {
        &self.shared.tokenizer
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    /// Seconds on the engine's clock.
    pub fn now(&self) -> f64 {
        self.shared.start.elapsed().as_secs_f64()
    }

    /// The latest gauges (after the last step).
    pub fn gauges(&self) -> Gauges {
        *self.shared.gauges.borrow()
    }

    /// Validate and queue a request. `arrival_time` is overwritten with the engine clock.
    pub fn add_request(&self, mut req: NewRequest) -> Result<RequestStream, AddRequestError> {
        let sh = &self.shared;
        if sh.shutting_down.load(Ordering::SeqCst) {
            return Err(AddRequestError::ShuttingDown);
        }
        let sc = &sh.cfg.scheduler;
        let n = req.prompt.len();
        if n == 0 {
            return Err(CoreAddError::EmptyPrompt.into());
        }
        if n >= sc.max_model_len {
            return Err(CoreAddError::PromptTooLong {
                prompt_tokens: n,
                max_model_len: sc.max_model_len,
            }
            .into());
        }
        if req.sampling.max_tokens == 0 {
            return Err(CoreAddError::ZeroMaxTokens.into());
        }
        let needed = (n + req.sampling.max_tokens as usize)
            .min(sc.max_model_len)
            .div_ceil(sc.block_size);
        if needed > sc.num_blocks {
            return Err(CoreAddError::CannotFit {
                needed,
                available: sc.num_blocks,
            }
            .into());
        }
        let id: Arc<str> = Arc::from(req.request_id.as_str());
        {
            let mut live = sh.live.lock().unwrap_or_else(|e| e.into_inner());
            if live.requests.contains_key(&id) {
                return Err(CoreAddError::DuplicateId(req.request_id).into());
            }
            let pending = sh.queued.load(Ordering::SeqCst) + sh.waiting.load(Ordering::SeqCst);
            if pending >= sh.cfg.max_waiting_requests {
                return Err(AddRequestError::QueueFull(pending));
            }
            let sid: Option<Arc<str>> = req.session_id.as_deref().map(Arc::from);
            if let Some(sid) = &sid {
                if !live.sessions.insert(sid.clone()) {
                    return Err(CoreAddError::SessionBusy(sid.to_string()).into());
                }
            }
            live.requests.insert(id.clone(), sid);
        }
        req.arrival_time = self.now();
        let (otx, orx) = mpsc::unbounded_channel();
        sh.queued.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(Command::Add(Box::new(req), otx)).is_err() {
            sh.queued.fetch_sub(1, Ordering::SeqCst);
            sh.live
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            return Err(AddRequestError::ShuttingDown);
        }
        Ok(RequestStream {
            request_id: id,
            rx: orx,
            tx: self.tx.clone(),
            finished: false,
        })
    }

    /// Abort a live request (no-op for an unknown id).
    pub fn abort(&self, request_id: &str) {
        let _ = self
            .tx
            .send(Command::Finish(request_id.to_string(), FinishReason::Abort));
    }

    /// End a live request with `reason` (e.g. a stop string matched in the frontend).
    pub fn finish(&self, request_id: &str, reason: FinishReason) {
        let _ = self
            .tx
            .send(Command::Finish(request_id.to_string(), reason));
    }

    /// Close a session: a turn in flight is aborted, and the parked KV is released (full blocks
    /// stay in the prefix cache).
    pub fn release_session(&self, session_id: &str) {
        let _ = self
            .tx
            .send(Command::ReleaseSession(session_id.to_string()));
    }

    /// Drop every prefix-cache entry; only succeeds while no request holds a block.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::ResetPrefixCache(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Stop accepting requests, let running and waiting ones finish, stop the core thread.
    pub async fn shutdown(&self) {
        let sh = &self.shared;
        sh.shutting_down.store(true, Ordering::SeqCst);
        let mut idle = sh.idle.subscribe();
        loop {
            let _ = idle.wait_for(|&i| i).await;
            // Idle can still be reported for a request that was accepted but not yet picked
            // up by the core thread: it is live (and queued) until its final output.
            let pending = sh.queued.load(Ordering::SeqCst) > 0
                || !sh
                    .live
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .requests
                    .is_empty();
            if !pending {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _ = self.tx.send(Command::Shutdown);
    }

    /// Wait until no request is running or waiting.
    pub async fn wait_idle(&self) {
        let mut idle = self.shared.idle.subscribe();
        let _ = idle.wait_for(|&i| i).await;
    }
}

/// Spawn the core thread.
pub fn start_engine<E: Executor + 'static>(
    cfg: EngineConfig,
    executor: E,
    model: ModelInfo,
    tokenizer: Arc<dyn TextTokenizer>,
    loggers: Vec<Box<dyn StatLogger>>,
) -> Result<EngineHandle, EngineError> {
    let (tx, rx) = std_mpsc::channel();
    let (gauges, _) = watch::channel(Gauges::default());
    let (idle, _) = watch::channel(true);
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        model,
        tokenizer,
        live: Mutex::new(Live::default()),
        queued: AtomicUsize::new(0),
        waiting: AtomicUsize::new(0),
        shutting_down: AtomicBool::new(false),
        gauges,
        idle,
        start: Instant::now(),
    });
    let core = EngineCore::new(cfg.scheduler.clone(), executor, loggers);
    let sh = shared.clone();
    std::thread::Builder::new()
        .name("cachet-core".into())
        .spawn(move || run_core(core, rx, sh))?;
    Ok(EngineHandle { tx, shared })
}

fn run_core<E: Executor>(
    mut core: EngineCore<E>,
    rx: std_mpsc::Receiver<Command>,
    sh: Arc<Shared>,
) {
    let mut streams = Streams::default();
    let now = || sh.start.elapsed().as_secs_f64();
    let mut running = true;
    while running {
        // Wait for work when idle; otherwise just drain what arrived.
        let first = if core.scheduler().has_unfinished() {
            rx.try_recv().ok()
        } else {
            sh.idle.send_replace(true);
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(c) => Some(c),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
            }
        };
        let mut cmds: Vec<Command> = first.into_iter().collect();
        cmds.extend(rx.try_iter());
        for cmd in cmds {
            match cmd {
                Command::Add(req, otx) => {
                    let id: Arc<str> = Arc::from(req.request_id.as_str());
                    let added = core.add_request(*req);
                    // Publish the waiting count before the request leaves `queued`, so the
                    // handle's queue check never sees it in neither.
                    sh.waiting
                        .store(core.scheduler().num_waiting(), Ordering::SeqCst);
                    sh.queued.fetch_sub(1, Ordering::SeqCst);
                    match added {
                        Ok(slot) => streams.insert(slot, Stream { id, tx: otx }),
                        Err(e) => {
                            tracing::warn!(request_id = %id, error = %e, "request rejected by the scheduler");
                            sh.live
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .remove(&id);
                            let _ = otx.send(RequestOutput {
                                request_id: id,
                                tokens: Vec::new(),
                                finish_reason: Some(FinishReason::Abort),
                                prefill_stats: None,
                                metrics: None,
                                session: None,
                            });
                        }
                    }
                }
                Command::Finish(id, reason) => {
                    if let Some(out) = core.finish_request(&id, reason, now()) {
                        deliver(&mut streams, &sh, out);
                    }
                }
                Command::ResetPrefixCache(reply) => {
                    let _ = reply.send(core.scheduler_mut().reset_prefix_cache());
                }
                Command::ReleaseSession(sid) => {
                    // A turn in flight is aborted (an aborted turn does not park), then any
                    // parked KV is released.
                    let turn = core.scheduler().session_turn(&sid).map(str::to_owned);
                    if let Some(id) = turn {
                        if let Some(out) = core.finish_request(&id, FinishReason::Abort, now()) {
                            deliver(&mut streams, &sh, out);
                        }
                    }
                    core.scheduler_mut().release_session(&sid);
                }
                Command::Shutdown => running = false,
            }
        }
        core.scheduler_mut().expire_sessions(now());
        if core.scheduler().has_unfinished() {
            sh.idle.send_replace(false);
            match core.step(now) {
                Ok(outs) => {
                    let mut gone = Vec::new();
                    for out in outs {
                        if let Some(id) = deliver(&mut streams, &sh, out) {
                            gone.push(id);
                        }
                    }
                    // Receivers that went away: the client disconnected.
                    for id in gone {
                        if let Some(out) = core.finish_request(&id, FinishReason::Abort, now()) {
                            deliver(&mut streams, &sh, out);
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "model execution failed; aborting running requests");
                    for id in streams.ids() {
                        if let Some(out) = core.finish_request(&id, FinishReason::Abort, now()) {
                            deliver(&mut streams, &sh, out);
                        }
                    }
                }
            }
        }
        sh.waiting
            .store(core.scheduler().num_waiting(), Ordering::SeqCst);
        sh.gauges.send_replace(core.scheduler().gauges());
        if !core.scheduler().has_unfinished() {
            sh.idle.send_replace(true);
        }
    }
}

/// Send one update to its stream. Returns the id when the receiver is gone and the request is
/// still live (so the caller aborts it).
fn deliver(streams: &mut Streams, sh: &Shared, up: RequestUpdate) -> Option<Arc<str>> {
    let entry = streams.0.get_mut(up.slot as usize)?;
    if up.finish.is_some() {
        let s = entry.take()?;
        // Forget the id (and free its session) before the client can see the final output, so
        // that a next turn sent right after it is accepted.
        sh.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&s.id);
        let _ = s.tx.send(RequestOutput::from_update(s.id, up));
        None
    } else {
        let s = entry.as_ref()?;
        let failed =
            s.tx.send(RequestOutput::from_update(s.id.clone(), up))
                .is_err();
        failed.then(|| s.id.clone())
    }
}
