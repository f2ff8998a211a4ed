//! `ZmqPublisher`: vLLM's `ZmqEventPublisher`, off the engine thread.
//!
//! Every batch becomes one PUB message of three frames: the topic, the batch's sequence number
//! (8 bytes, big-endian, counting batches from 0) and the msgpack payload
//! ([`crate::wire::encode_batch`]). The last `buffer_steps` messages are kept for the ROUTER
//! replay socket: a client sends `[b"", start_seq]` (8 bytes big-endian; a REQ socket adds the
//! empty delimiter itself, a DEALER sends it) and receives `[b"", seq, payload]` for every
//! buffered batch with `seq >= start_seq`, then `[b"", -1, b""]` (the end marker: sequence -1 as
//! 8 bytes, empty payload). This is vLLM's framing, which Dynamo's replay client reads.
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
    resume: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

/// What the publisher thread needs, fixed at start.
struct Setup {
    endpoint: String,
    replay_endpoint: Option<String>,
    buffer_steps: usize,
    topic: Bytes,
    encoding: Encoding,
    data_parallel_rank: u32,
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
        let setup = Setup {
            endpoint: cfg.endpoint.clone(),
            replay_endpoint: cfg.replay_endpoint.clone(),
            buffer_steps: cfg.buffer_steps,
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            encoding: cfg.encoding,
            data_parallel_rank,
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
        let buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>> = Arc::new(Mutex::new(VecDeque::new()));
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
                buffer.clone(),
                counters.clone(),
            )));
        }
        let _ = ready.send(Ok((bound_pub.clone(), bound_replay)));
        if bound_pub.is_none() {
            connect_with_retry(&mut pub_socket, &setup.endpoint).await;
        }
        publish_loop(&setup, &mut pub_socket, rx, resume, &buffer, &counters).await;
        if let Some(t) = replay_task {
            t.abort();
        }
        let _ = pub_socket.close().await;
    });
}

async fn connect_with_retry(socket: &mut zeromq::PubSocket, endpoint: &str) {
    let mut backoff = Duration::from_millis(10);
    loop {
        match socket.connect(endpoint).await {
            Ok(()) => {
                tracing::info!(endpoint, "KV events PUB socket connected");
                return;
            }
            Err(e) => {
                tracing::debug!(endpoint, error = %e, "KV events PUB connect failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

async fn publish_loop(
    setup: &Setup,
    pub_socket: &mut zeromq::PubSocket,
    mut rx: mpsc::Receiver<Queued>,
    mut resume: watch::Receiver<bool>,
    buffer: &Mutex<VecDeque<(u64, Bytes)>>,
    counters: &Counters,
) {
    if resume.wait_for(|&r| r).await.is_err() {
        return;
    }
    while let Some(Queued { seq, batch }) = rx.recv().await {
        let payload = Bytes::from(encode_batch(
            &batch,
            setup.encoding,
            setup.data_parallel_rank,
        ));
        let frames = vec![
            setup.topic.clone(),
            Bytes::copy_from_slice(&seq_frame(seq)),
            payload.clone(),
        ];
        if let Ok(msg) = ZmqMessage::try_from(frames) {
            // A PUB send only queues for each subscriber (dropping for one that is full).
            if let Err(e) = pub_socket.send(msg).await {
                tracing::warn!(seq, error = %e, "KV events PUB send failed");
            }
        }
        counters.sent.fetch_add(1, Ordering::Relaxed);
        if setup.buffer_steps > 0 {
            let mut b = match buffer.lock() {
                Ok(b) => b,
                Err(poisoned) => poisoned.into_inner(),
            };
            if b.len() == setup.buffer_steps {
                b.pop_front();
            }
            b.push_back((seq, payload));
        }
    }
}

async fn serve_replays(
    mut router: zeromq::RouterSocket,
    buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    counters: Arc<Counters>,
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
        // [identity, empty delimiter, start seq]
        let frames = msg.into_vec();
        if frames.len() != 3 || !frames[1].is_empty() || frames[2].len() != 8 {
            tracing::warn!(frames = frames.len(), "invalid KV events replay request");
            continue;
        }
        let identity = frames[0].clone();
        let mut start = [0u8; 8];
        start.copy_from_slice(&frames[2]);
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = {
            let b = match buffer.lock() {
                Ok(b) => b,
                Err(poisoned) => poisoned.into_inner(),
            };
            b.iter().filter(|(s, _)| *s >= start).cloned().collect()
        };
        tracing::debug!(start, batches = batches.len(), "serving KV events replay");
        let mut ok = true;
        for (seq, payload) in batches {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&seq_frame(seq)),
                payload,
            ];
            if !send_frames(&mut router, reply).await {
                ok = false;
                break;
            }
        }
        if ok {
            let end = vec![
                identity,
                Bytes::new(),
                Bytes::copy_from_slice(&END_OF_REPLAY_SEQ),
                Bytes::new(),
            ];
            send_frames(&mut router, end).await;
            counters.replays.fetch_add(1, Ordering::Relaxed);
        }
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
}
