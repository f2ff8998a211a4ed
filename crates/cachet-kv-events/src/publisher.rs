//! `ZmqPublisher`: vLLM's `ZmqEventPublisher`, off the engine thread.
//!
//! Every batch becomes one PUB message of three frames: the topic, the batch's sequence number
//! (8 bytes, big-endian, counting batches from 0) and the msgpack payload
//! ([`crate::wire::encode_batch`]). The last `buffer_steps` messages are kept for the ROUTER
//! replay socket: a client sends `[b"", start_seq]` (8 bytes big-endian; a REQ socket adds the
//! empty delimiter itself, a DEALER sends it) and receives `[b"", seq, payload]` for every
//! buffered batch with `seq >= start_seq`, then `[b"", -1, b""]` (the end marker: sequence -1 as
//! 8 bytes, empty payload). This is vLLM's framing, which Dynamo's replay client reads. A request
//! whose frame is a msgpack map is vLLM's current replay, answered with one msgpack map: the
//! batches, or a snapshot of every held block when the buffer no longer reaches back
//! ([`crate::replay`]); the publisher's epoch is new at every start.
//!
//! [`ZmqPublisher::publish`] never blocks and never waits for a subscriber: it gives the batch
//! its sequence number and puts it on a bounded queue (`max_queue_size`); when the queue is full
//! the batch is dropped and counted ([`ZmqPublisher::dropped`]). A dropped batch keeps its
//! number, so subscribers see a gap in the sequence (and a replay cannot fill it: their view is
//! known to be incomplete rather than silently wrong). A dedicated thread encodes and sends;
//! the PUB socket drops messages for a subscriber that does not keep up, and replays are served
//! by their own task, so neither a slow subscriber nor a slow replay client delays the stream.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use cachet_core::events::EventBatch;
use tokio::sync::{mpsc, watch};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::{bindable, binds, KvEventsConfig};
use crate::held::HeldBlocks;
use crate::replay::{self, Answer, ReplayRequest};
use crate::wire::{encode_batch, seq_frame, Encoding, END_OF_REPLAY_SEQ};
use crate::KvEventsError;

/// How long [`ZmqPublisher::shutdown`] waits for the thread to drain the queue.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(1);

struct Queued {
    seq: u64,
    batch: Arc<EventBatch>,
}

struct Sender {
    next_seq: u64,
    tx: Option<mpsc::Sender<Queued>>,
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    dropped: AtomicU64,
    replays: AtomicU64,
}

/// A running ZMQ publisher. Dropping it stops the thread (as [`ZmqPublisher::shutdown`]).
pub struct ZmqPublisher {
    sender: Mutex<Sender>,
    counters: Arc<Counters>,
    endpoint: String,
    bound_endpoint: Option<String>,
    replay_endpoint: Option<String>,
    epoch: Arc<str>,
    resume: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

/// What the replay socket answers from, updated by the publisher thread after each batch sent.
#[derive(Default)]
struct History {
    /// The last `buffer_steps` batches sent, encoded.
    buffer: VecDeque<(u64, Bytes)>,
    /// What the batches sent say is held.
    held: HeldBlocks,
    /// One past the last batch sent (a consumer's next live batch after a replay).
    next_seq: u64,
}

type Shared = Arc<Mutex<History>>;

fn lock(h: &Mutex<History>) -> std::sync::MutexGuard<'_, History> {
    match h.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// What the publisher thread needs, fixed at start.
struct Setup {
    endpoint: String,
    replay_endpoint: Option<String>,
    buffer_steps: usize,
    topic: Bytes,
    encoding: Encoding,
    data_parallel_rank: u32,
    epoch: Arc<str>,
}

impl ZmqPublisher {
    /// Starts the publisher described by `cfg` (its `enable_kv_cache_events`/`publisher` keys are
    /// the caller's business: see [`crate::start_publisher`]). Returns once the sockets are
    /// bound, so an unusable or taken address is an error here. A connecting PUB endpoint is
    /// connected in the background, retried until it succeeds.
    pub fn start(cfg: &KvEventsConfig) -> Result<Self, KvEventsError> {
        Self::start_inner(cfg, 0, false)
    }

    /// As [`ZmqPublisher::start`], with the data-parallel rank written into every batch.
    pub fn start_with_rank(
        cfg: &KvEventsConfig,
        data_parallel_rank: u32,
    ) -> Result<Self, KvEventsError> {
        Self::start_inner(cfg, data_parallel_rank, false)
    }

    /// `paused`: the thread binds but does not take batches off the queue until
    /// [`ZmqPublisher::resume`] (tests use it to fill the queue deterministically).
    fn start_inner(
        cfg: &KvEventsConfig,
        data_parallel_rank: u32,
        paused: bool,
    ) -> Result<Self, KvEventsError> {
        cfg.validate()?;
        if cfg.hwm != KvEventsConfig::default().hwm {
            tracing::warn!(
                hwm = cfg.hwm,
                "kv-events hwm is not configurable here: the PUB socket queues up to 100000 \
                 messages per subscriber"
            );
        }
        let (tx, rx) = mpsc::channel(cfg.max_queue_size);
        let counters = Arc::new(Counters::default());
        let epoch: Arc<str> = replay::new_epoch().into();
        let setup = Setup {
            endpoint: cfg.endpoint.clone(),
            replay_endpoint: cfg.replay_endpoint.clone(),
            buffer_steps: cfg.buffer_steps,
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            encoding: cfg.encoding,
            data_parallel_rank,
            epoch: epoch.clone(),
        };
        let (resume_tx, resume_rx) = watch::channel(!paused);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let thread_counters = counters.clone();
        let thread = std::thread::Builder::new()
            .name("kv-events-zmq".into())
            .spawn(move || run_thread(setup, rx, resume_rx, thread_counters, ready_tx))
            .map_err(|e| KvEventsError::Thread(e.to_string()))?;
        let bound = match ready_rx.recv() {
            Ok(Ok(bound)) => bound,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(KvEventsError::Thread(
                    "the publisher thread exited before binding".into(),
                ));
            }
        };
        tracing::info!(
            endpoint = %cfg.endpoint,
            bound = ?bound.0,
            replay = ?bound.1,
            encoding = ?cfg.encoding,
            "KV events publisher started"
        );
        Ok(ZmqPublisher {
            sender: Mutex::new(Sender {
                next_seq: 0,
                tx: Some(tx),
            }),
            counters,
            endpoint: cfg.endpoint.clone(),
            bound_endpoint: bound.0,
            replay_endpoint: bound.1,
            epoch,
            resume: Some(resume_tx),
            thread: Some(thread),
        })
    }

    /// Queues one batch; never blocks. Empty batches are not published (vLLM publishes only
    /// steps that had events) and take no sequence number.
    pub fn publish(&self, batch: impl Into<Arc<EventBatch>>) {
        let batch = batch.into();
        if batch.is_empty() {
            return;
        }
        let mut s = match self.sender.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        let seq = s.next_seq;
        s.next_seq += 1;
        let Some(tx) = s.tx.as_ref() else {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if tx.try_send(Queued { seq, batch }).is_err() {
            let n = self.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(dropped = n, seq, "KV events queue full: batch dropped");
            }
        }
    }

    /// Batches dropped because the queue was full (or the publisher was shut down).
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Batches handed to the PUB socket.
    pub fn sent(&self) -> u64 {
        self.counters.sent.load(Ordering::Relaxed)
    }

    /// Replay requests served.
    pub fn replays(&self) -> u64 {
        self.counters.replays.load(Ordering::Relaxed)
    }

    /// The configured PUB endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The address the PUB socket is bound to (with the real port when the configured one was
    /// 0), or `None` when it connects.
    pub fn bound_endpoint(&self) -> Option<&str> {
        self.bound_endpoint.as_deref()
    }

    /// The address the replay socket is bound to, if there is one.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// This start's publisher epoch (32 hex digits): replay consumers that knew another one get
    /// a snapshot.
    pub fn publisher_epoch(&self) -> &str {
        &self.epoch
    }

    fn resume(&self) {
        if let Some(r) = &self.resume {
            let _ = r.send(true);
        }
    }

    /// Stops taking batches, lets the thread send what is queued (up to one second), and joins
    /// it. Later `publish` calls count as dropped.
    pub fn shutdown(&mut self) {
        let tx = match self.sender.lock() {
            Ok(mut s) => s.tx.take(),
            Err(poisoned) => poisoned.into_inner().tx.take(),
        };
        drop(tx);
        self.resume();
        self.resume = None;
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + SHUTDOWN_TIMEOUT;
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                tracing::warn!("KV events publisher thread still busy after shutdown timeout");
            }
        }
    }
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

type Bound = (Option<String>, Option<String>);

fn run_thread(
    setup: Setup,
    rx: mpsc::Receiver<Queued>,
    resume: watch::Receiver<bool>,
    counters: Arc<Counters>,
    ready: std::sync::mpsc::SyncSender<Result<Bound, KvEventsError>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(KvEventsError::Thread(e.to_string())));
            return;
        }
    };
    rt.block_on(async move {
        let mut pub_socket = zeromq::PubSocket::new();
        let bound_pub = if binds(&setup.endpoint) {
            match pub_socket.bind(&bindable(&setup.endpoint)).await {
                Ok(ep) => Some(ep.to_string()),
                Err(e) => {
                    let _ = ready.send(Err(KvEventsError::Bind {
                        endpoint: setup.endpoint.clone(),
                        reason: e.to_string(),
                    }));
                    return;
                }
            }
        } else {
            None
        };
        let history: Shared = Arc::new(Mutex::new(History::default()));
        let mut replay_task = None;
        let mut bound_replay = None;
        if let Some(rep) = &setup.replay_endpoint {
            let mut router = zeromq::RouterSocket::new();
            match router.bind(&bindable(rep)).await {
                Ok(ep) => bound_replay = Some(ep.to_string()),
                Err(e) => {
                    let _ = ready.send(Err(KvEventsError::Bind {
                        endpoint: rep.clone(),
                        reason: e.to_string(),
                    }));
                    return;
                }
            }
            replay_task = Some(tokio::spawn(serve_replays(
                router,
                history.clone(),
                counters.clone(),
                ReplayFormat {
                    encoding: setup.encoding,
                    data_parallel_rank: setup.data_parallel_rank,
                    epoch: setup.epoch.clone(),
                },
            )));
        }
        let _ = ready.send(Ok((bound_pub.clone(), bound_replay)));
        let connect_to = bound_pub.is_none().then_some(setup.endpoint.as_str());
        publish_loop(
            &setup,
            &mut pub_socket,
            connect_to,
            rx,
            resume,
            &history,
            &counters,
        )
        .await;
        if let Some(t) = replay_task {
            t.abort();
        }
        let _ = pub_socket.close().await;
    });
}

/// First and longest wait between connection attempts of a connecting PUB.
const RECONNECT_MIN: Duration = Duration::from_millis(10);
const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// Sends each batch, then records it (the replay buffer, the held set).
///
/// A connecting PUB (`connect_to`) keeps its connection: the `zeromq` crate's PUB never
/// reconnects by itself (only its SUB does), so when the peer goes away (a subscriber bound at
/// that address restarted) the socket would publish to nobody for the rest of the process. Its
/// monitor says when the peer is gone, and this loop connects again, with backoff; batches that
/// arrive meanwhile are recorded (a replay serves them) but sent to nobody, as a PUB without
/// subscribers does.
async fn publish_loop(
    setup: &Setup,
    pub_socket: &mut zeromq::PubSocket,
    connect_to: Option<&str>,
    mut rx: mpsc::Receiver<Queued>,
    mut resume: watch::Receiver<bool>,
    history: &Mutex<History>,
    counters: &Counters,
) {
    if resume.wait_for(|&r| r).await.is_err() {
        return;
    }
    let mut monitor = connect_to.map(|_| pub_socket.monitor());
    let mut connected = connect_to.is_none();
    let mut backoff = RECONNECT_MIN;
    loop {
        if let (false, Some(endpoint)) = (connected, connect_to) {
            let outcome = {
                let connect = pub_socket.connect(endpoint);
                tokio::pin!(connect);
                loop {
                    tokio::select! {
                        r = &mut connect => break Some(r),
                        q = rx.recv() => match q {
                            Some(q) => record(setup, history, q, None),
                            None => break None,
                        },
                    }
                }
            };
            match outcome {
                None => return,
                Some(Ok(())) => {
                    tracing::info!(endpoint, "KV events PUB socket connected");
                    connected = true;
                    backoff = RECONNECT_MIN;
                }
                Some(Err(e)) => {
                    tracing::debug!(endpoint, error = %e, "KV events PUB connect failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RECONNECT_MAX);
                }
            }
            continue;
        }
        tokio::select! {
            q = rx.recv() => match q {
                Some(q) => {
                    let payload = send(setup, pub_socket, &q).await;
                    counters.sent.fetch_add(1, Ordering::Relaxed);
                    record(setup, history, q, Some(payload));
                }
                None => return,
            },
            Some(event) = next_event(&mut monitor) => {
                if let zeromq::SocketEvent::Disconnected(_) = event {
                    tracing::warn!(
                        endpoint = connect_to.unwrap_or_default(),
                        "KV events PUB peer disconnected; reconnecting"
                    );
                    connected = false;
                }
            }
        }
    }
}

/// The next monitor event; never ready without a monitor (a bound PUB).
async fn next_event<S>(monitor: &mut Option<S>) -> Option<zeromq::SocketEvent>
where
    S: futures_util::Stream<Item = zeromq::SocketEvent> + Unpin,
{
    use futures_util::StreamExt;
    match monitor {
        Some(m) => m.next().await,
        None => std::future::pending().await,
    }
}

/// Encodes and sends one batch; returns the payload.
async fn send(setup: &Setup, pub_socket: &mut zeromq::PubSocket, q: &Queued) -> Bytes {
    let payload = Bytes::from(encode_batch(
        &q.batch,
        setup.encoding,
        setup.data_parallel_rank,
    ));
    let frames = vec![
        setup.topic.clone(),
        Bytes::copy_from_slice(&seq_frame(q.seq)),
        payload.clone(),
    ];
    if let Ok(msg) = ZmqMessage::try_from(frames) {
        // A PUB send only queues for each subscriber (dropping for one that is full).
        if let Err(e) = pub_socket.send(msg).await {
            tracing::warn!(seq = q.seq, error = %e, "KV events PUB send failed");
        }
    }
    payload
}

/// Records a batch for the replay socket (`payload`: its encoding when it was sent).
fn record(setup: &Setup, history: &Mutex<History>, q: Queued, payload: Option<Bytes>) {
    let Queued { seq, batch } = q;
    let payload = payload.unwrap_or_else(|| {
        Bytes::from(encode_batch(
            &batch,
            setup.encoding,
            setup.data_parallel_rank,
        ))
    });
    let mut h = lock(history);
    if seq != h.next_seq {
        // Batches before this one were dropped: what is held is no longer known exactly.
        h.held.mark_incomplete();
    }
    h.next_seq = seq + 1;
    h.held.apply(&batch);
    if setup.buffer_steps > 0 {
        if h.buffer.len() == setup.buffer_steps {
            h.buffer.pop_front();
        }
        h.buffer.push_back((seq, payload));
    }
}

/// How the replay socket encodes a snapshot batch, and the epoch it names.
struct ReplayFormat {
    encoding: Encoding,
    data_parallel_rank: u32,
    epoch: Arc<str>,
}

async fn serve_replays(
    mut router: zeromq::RouterSocket,
    history: Shared,
    counters: Arc<Counters>,
    format: ReplayFormat,
) {
    loop {
        let msg = match router.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "KV events replay recv failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // [identity, empty delimiter, request]
        let frames = msg.into_vec();
        if frames.len() != 3 || !frames[1].is_empty() {
            tracing::warn!(frames = frames.len(), "invalid KV events replay request");
            continue;
        }
        let identity = frames[0].clone();
        let served = match replay::parse_request(&frames[2]) {
            Ok(ReplayRequest::Legacy { start_seq }) => {
                serve_legacy(&mut router, identity, start_seq, &history).await
            }
            Ok(ReplayRequest::Current {
                start_seq,
                publisher_epoch,
                force_snapshot,
            }) => {
                let reply = current_reply(
                    &history,
                    &format,
                    start_seq,
                    publisher_epoch.as_deref(),
                    force_snapshot,
                );
                send_frames(&mut router, vec![identity, Bytes::new(), reply.into()]).await
            }
            Err(reason) => {
                tracing::warn!(%reason, "invalid KV events replay request");
                let next = lock(&history).next_seq;
                let reply = replay::encode_error(&format.epoch, next, &reason);
                send_frames(&mut router, vec![identity, Bytes::new(), reply.into()]).await;
                false
            }
        };
        if served {
            counters.replays.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The legacy answer: one message per buffered batch from `start`, then the end marker.
async fn serve_legacy(
    router: &mut zeromq::RouterSocket,
    identity: Bytes,
    start: u64,
    history: &Mutex<History>,
) -> bool {
    let batches: Vec<(u64, Bytes)> = lock(history)
        .buffer
        .iter()
        .filter(|(s, _)| *s >= start)
        .cloned()
        .collect();
    tracing::debug!(start, batches = batches.len(), "serving KV events replay");
    for (seq, payload) in batches {
        let reply = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::copy_from_slice(&seq_frame(seq)),
            payload,
        ];
        if !send_frames(router, reply).await {
            return false;
        }
    }
    let end = vec![
        identity,
        Bytes::new(),
        Bytes::copy_from_slice(&END_OF_REPLAY_SEQ),
        Bytes::new(),
    ];
    send_frames(router, end).await
}

/// The current protocol's one answer, built under the history's lock (so the batches or the
/// snapshot and `next_seq` describe the same moment).
fn current_reply(
    history: &Mutex<History>,
    format: &ReplayFormat,
    start_seq: u64,
    request_epoch: Option<&str>,
    force_snapshot: bool,
) -> Vec<u8> {
    let h = lock(history);
    let epoch = &*format.epoch;
    let answer = replay::answer_for(
        request_epoch,
        force_snapshot,
        start_seq,
        epoch,
        h.next_seq,
        &h.buffer,
    );
    tracing::debug!(
        start_seq,
        next_seq = h.next_seq,
        ?answer,
        "serving KV events replay"
    );
    match answer {
        Answer::Replay => replay::encode_replayed(epoch, h.next_seq, start_seq, &h.buffer),
        Answer::Snapshot if h.held.is_exact() => {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let batch = encode_batch(
                &h.held.snapshot(ts),
                format.encoding,
                format.data_parallel_rank,
            );
            replay::encode_snapshot(epoch, h.next_seq, &batch)
        }
        Answer::Snapshot => replay::encode_error(
            epoch,
            h.next_seq,
            "snapshot unavailable: batches were dropped since the cache was last cleared",
        ),
    }
}

async fn send_frames(router: &mut zeromq::RouterSocket, frames: Vec<Bytes>) -> bool {
    match ZmqMessage::try_from(frames) {
        Ok(m) => match router.send(m).await {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, "KV events replay send failed");
                false
            }
        },
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_core::events::{CacheEvent, Medium};

    fn batch(n: u32) -> Arc<EventBatch> {
        Arc::new(EventBatch {
            ts: f64::from(n),
            events: vec![CacheEvent::AllCleared {
                medium: Medium::Gpu,
            }],
        })
    }

    fn cfg(queue: usize, buffer: usize) -> KvEventsConfig {
        KvEventsConfig {
            enable_kv_cache_events: true,
            publisher: crate::PublisherKind::Zmq,
            endpoint: "tcp://*:0".into(),
            replay_endpoint: Some("tcp://*:0".into()),
            buffer_steps: buffer,
            max_queue_size: queue,
            ..KvEventsConfig::default()
        }
    }

    fn wait_sent(p: &ZmqPublisher, n: u64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while p.sent() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "sent {} of {n}",
                p.sent()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let p = ZmqPublisher::start_inner(&cfg(2, 100), 0, true).unwrap();
        for i in 0..5 {
            p.publish(batch(i));
        }
        // Seqs 0 and 1 are queued; 2, 3, 4 found the queue full.
        assert_eq!(p.dropped(), 3);
        assert_eq!(p.sent(), 0);
        p.resume();
        wait_sent(&p, 2);
        p.publish(batch(5));
        wait_sent(&p, 3);
        assert_eq!(p.dropped(), 3);
        // What was sent keeps the numbers given at publish: 0, 1, 5 (a gap where 2-4 were).
        let replay = p.replay_endpoint().unwrap().replace("0.0.0.0", "127.0.0.1");
        let seqs = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let mut d = zeromq::DealerSocket::new();
                d.connect(&replay).await.unwrap();
                let req = vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())];
                d.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
                let mut seqs = Vec::new();
                loop {
                    let m = d.recv().await.unwrap().into_vec();
                    assert_eq!(m.len(), 3);
                    let seq = i64::from_be_bytes(m[1][..].try_into().unwrap());
                    if seq == -1 {
                        assert!(m[2].is_empty());
                        break;
                    }
                    seqs.push(seq);
                }
                seqs
            });
        assert_eq!(seqs, vec![0, 1, 5]);
    }

    #[test]
    fn the_publisher_can_be_shared_between_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<ZmqPublisher>();
    }

    #[test]
    fn empty_batches_are_not_published() {
        let p = ZmqPublisher::start_inner(&cfg(4, 4), 0, false).unwrap();
        p.publish(EventBatch::default());
        p.publish(batch(1));
        wait_sent(&p, 1);
        assert_eq!(p.dropped(), 0);
        assert_eq!(p.sender.lock().unwrap().next_seq, 1);
    }

    #[test]
    fn publishing_after_shutdown_counts_as_dropped() {
        let mut p = ZmqPublisher::start(&cfg(4, 4)).unwrap();
        p.publish(batch(0));
        p.shutdown();
        assert_eq!(p.sent(), 1);
        p.publish(batch(1));
        assert_eq!(p.dropped(), 1);
    }

    #[test]
    fn a_taken_address_is_an_error_at_start() {
        let p = ZmqPublisher::start(&cfg(4, 4)).unwrap();
        let port = p
            .bound_endpoint()
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap()
            .to_string();
        let mut c = cfg(4, 4);
        c.endpoint = format!("tcp://*:{port}");
        c.replay_endpoint = None;
        match ZmqPublisher::start(&c) {
            Err(KvEventsError::Bind { endpoint, .. }) => assert_eq!(endpoint, c.endpoint),
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("bound a taken port"),
        }
    }

    async fn bound_sub(port: &str) -> (zeromq::SubSocket, String) {
        let mut s = zeromq::SubSocket::new();
        let ep = s.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
        s.subscribe("").await.unwrap();
        let port = ep.to_string().rsplit(':').next().unwrap().to_string();
        (s, port)
    }

    /// Publishes until `sub` receives a batch (a PUB drops what it sends before the
    /// subscription is in force); returns its sequence number.
    async fn first_received(p: &ZmqPublisher, sub: &mut zeromq::SubSocket, n: &mut u32) -> u64 {
        for _ in 0..200 {
            p.publish(batch(*n));
            *n += 1;
            let got = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await;
            if let Ok(Ok(m)) = got {
                let f = m.into_vec();
                assert_eq!(f.len(), 3);
                return u64::from_be_bytes(f[1][..].try_into().unwrap());
            }
        }
        panic!("no batch reached the bound SUB");
    }

    /// An endpoint without `*` connects, as vLLM's does, to a SUB bound there; when that SUB
    /// goes away and another binds the address, the stream reaches the new one (the `zeromq`
    /// crate's PUB does not reconnect by itself).
    #[test]
    fn a_connecting_publisher_reaches_a_restarted_bound_subscriber() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (mut sub, port) = rt.block_on(bound_sub("0"));
        let mut c = cfg(1024, 0);
        c.endpoint = format!("tcp://127.0.0.1:{port}");
        c.replay_endpoint = None;
        let p = ZmqPublisher::start(&c).unwrap();
        assert_eq!(p.bound_endpoint(), None);
        let mut n = 0;
        let first = rt.block_on(first_received(&p, &mut sub, &mut n));
        // Later batches follow in order.
        let next = rt.block_on(async {
            p.publish(batch(n));
            let m = sub.recv().await.unwrap().into_vec();
            u64::from_be_bytes(m[1][..].try_into().unwrap())
        });
        n += 1;
        assert_eq!(next, first + 1);
        rt.block_on(async {
            sub.close().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        let (mut sub2, _) = rt.block_on(bound_sub(&port));
        let again = rt.block_on(first_received(&p, &mut sub2, &mut n));
        assert!(again > next, "{again} after {next}");
        assert_eq!(p.dropped(), 0);
    }

    fn stored(n: u8) -> Arc<EventBatch> {
        Arc::new(EventBatch {
            ts: 0.0,
            events: vec![CacheEvent::Stored {
                hashes: vec![cachet_core::hash::BlockHash([n; 32])],
                parent: None,
                token_ids: vec![u32::from(n); 4],
                block_size: 4,
                lora_name: None,
                cache_salt: None,
                medium: Medium::Gpu,
                cause: None,
            }],
        })
    }

    fn ask(endpoint: &str, request: &rmpv::Value) -> rmpv::Value {
        let endpoint = endpoint.replace("0.0.0.0", "127.0.0.1");
        let mut req = Vec::new();
        rmpv::encode::write_value(&mut req, request).unwrap();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let mut d = zeromq::DealerSocket::new();
                d.connect(&endpoint).await.unwrap();
                let frames = vec![Bytes::new(), Bytes::from(req)];
                d.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
                let m = d.recv().await.unwrap().into_vec();
                assert_eq!(m.len(), 2);
                assert!(m[0].is_empty());
                rmpv::decode::read_value(&mut &m[1][..]).unwrap()
            })
    }

    fn map(entries: Vec<(&str, rmpv::Value)>) -> rmpv::Value {
        rmpv::Value::Map(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// Three stores with a buffer of 2: from 0 a snapshot of the three blocks, from 1 the two
    /// buffered batches, and another epoch a snapshot again.
    #[test]
    fn the_msgpack_replay_answers_with_batches_or_a_snapshot() {
        let p = ZmqPublisher::start(&cfg(16, 2)).unwrap();
        for n in 1..=3 {
            p.publish(stored(n));
        }
        wait_sent(&p, 3);
        let ep = p.replay_endpoint().unwrap().to_string();
        let epoch = p.publisher_epoch().to_string();
        let a = ask(&ep, &map(vec![("start_seq", 0.into())]));
        assert_eq!(a["publisher_epoch"], rmpv::Value::from(epoch.as_str()));
        assert_eq!(a["next_seq"], rmpv::Value::from(3));
        let events = a["snapshot"][1].as_array().unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0]["type"], rmpv::Value::from("AllBlocksCleared"));
        assert_eq!(events[1]["type"], rmpv::Value::from("BlockStored"));
        // Wire hashes: the low 8 bytes, big-endian, of [n; 32].
        let hashes: Vec<u64> = events[1]["block_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(
            hashes,
            vec![
                0x0101_0101_0101_0101,
                0x0202_0202_0202_0202,
                0x0303_0303_0303_0303
            ]
        );
        let b = ask(
            &ep,
            &map(vec![
                ("start_seq", 1.into()),
                ("publisher_epoch", epoch.as_str().into()),
                ("force_snapshot", false.into()),
            ]),
        );
        let seqs: Vec<u64> = b["replayed_batches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x[0].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, vec![1, 2]);
        assert_eq!(b["next_seq"], rmpv::Value::from(3));
        let c = ask(
            &ep,
            &map(vec![
                ("start_seq", 1.into()),
                ("publisher_epoch", "x".into()),
            ]),
        );
        assert!(c["snapshot"].is_array());
        assert_eq!(p.replays(), 3);
        // Another start, another epoch.
        let q = ZmqPublisher::start(&cfg(16, 2)).unwrap();
        assert_ne!(q.publisher_epoch(), p.publisher_epoch());
    }
}
