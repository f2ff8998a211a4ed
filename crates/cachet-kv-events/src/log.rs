//! `EventLog`: the same batches for the server's SSE endpoint (`GET /v1/cache/events`).
//!
//! A bounded ring of the last `capacity` batches, each with its id (counting from 0), and a
//! broadcast of new ones. [`EventLog::subscribe`] with the client's `Last-Event-ID` returns the
//! buffered batches after that id and a live receiver, taken under one lock so that nothing is
//! missed or seen twice between the two.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use cachet_core::events::EventBatch;
use tokio::sync::broadcast;

/// One batch with its id.
#[derive(Clone, Debug, PartialEq)]
pub struct LoggedBatch {
    pub id: u64,
    pub batch: Arc<EventBatch>,
}

struct Ring {
    next_id: u64,
    batches: VecDeque<LoggedBatch>,
}

/// A bounded, replayable log of event batches with live subscribers.
pub struct EventLog {
    capacity: usize,
    ring: Mutex<Ring>,
    live: broadcast::Sender<LoggedBatch>,
}

/// A subscriber's view: what to replay, then what comes.
pub struct EventSubscription {
    backlog: VecDeque<LoggedBatch>,
    /// False when batches after the client's `Last-Event-ID` have left the ring (or the id was
    /// never given out by this log, e.g. one from before a restart): the replay is incomplete
    /// and the client should rebuild its view.
    pub complete: bool,
    live: broadcast::Receiver<LoggedBatch>,
}

/// What [`EventSubscription::next`] returns.
#[derive(Debug, PartialEq)]
pub enum Next {
    Batch(LoggedBatch),
    /// The subscriber fell this many batches behind the live stream; they are lost to it.
    Lagged(u64),
    /// The log was dropped.
    Closed,
}

impl EventLog {
    /// Keeps the last `capacity` batches (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let (live, _) = broadcast::channel(capacity);
        EventLog {
            capacity,
            ring: Mutex::new(Ring {
                next_id: 0,
                batches: VecDeque::with_capacity(capacity.min(1024)),
            }),
            live,
        }
    }

    /// Appends a batch and sends it to live subscribers; returns its id. Never blocks on a
    /// subscriber (a slow one lags instead).
    pub fn push(&self, batch: Arc<EventBatch>) -> u64 {
        let mut ring = self.lock();
        let id = ring.next_id;
        ring.next_id += 1;
        let item = LoggedBatch { id, batch };
        if ring.batches.len() == self.capacity {
            ring.batches.pop_front();
        }
        ring.batches.push_back(item.clone());
        // No receivers is not an error here.
        let _ = self.live.send(item);
        id
    }

    /// The id the next batch will get.
    pub fn next_id(&self) -> u64 {
        self.lock().next_id
    }

    /// Subscribes. `last_event_id`: the last id the client saw (SSE `Last-Event-ID`); the
    /// buffered batches after it come first. `None`: live batches only.
    pub fn subscribe(&self, last_event_id: Option<u64>) -> EventSubscription {
        let ring = self.lock();
        let live = self.live.subscribe();
        let (backlog, complete) = match last_event_id {
            None => (VecDeque::new(), true),
            Some(last) if last >= ring.next_id => (ring.batches.clone(), false),
            Some(last) => {
                let want = last + 1;
                let oldest = ring.batches.front().map_or(ring.next_id, |b| b.id);
                let backlog = ring
                    .batches
                    .iter()
                    .filter(|b| b.id >= want)
                    .cloned()
                    .collect();
                (backlog, want >= oldest)
            }
        };
        EventSubscription {
            backlog,
            complete,
            live,
        }
    }

    /// Subscribes from batch `first` on (the buffered ones first, then live); `complete` is
    /// false when batches from `first` on have already left the ring.
    pub fn subscribe_from(&self, first: u64) -> EventSubscription {
        match first.checked_sub(1) {
            Some(last) => self.subscribe(Some(last)),
            None => {
                let ring = self.lock();
                let live = self.live.subscribe();
                let complete = ring.batches.front().is_none_or(|b| b.id == 0);
                EventSubscription {
                    backlog: ring.batches.clone(),
                    complete,
                    live,
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        match self.ring.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

impl EventSubscription {
    /// The next batch: the backlog first, then live ones.
    pub async fn next(&mut self) -> Next {
        if let Some(b) = self.backlog.pop_front() {
            return Next::Batch(b);
        }
        match self.live.recv().await {
            Ok(b) => Next::Batch(b),
            Err(broadcast::error::RecvError::Lagged(n)) => Next::Lagged(n),
            Err(broadcast::error::RecvError::Closed) => Next::Closed,
        }
    }

    /// How many backlog batches are still to come.
    pub fn backlog_len(&self) -> usize {
        self.backlog.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_core::events::{CacheEvent, Medium};

    fn b(ts: f64) -> Arc<EventBatch> {
        Arc::new(EventBatch {
            ts,
            events: vec![CacheEvent::AllCleared {
                medium: Medium::Gpu,
            }],
        })
    }

    fn ids(s: &EventSubscription) -> Vec<u64> {
        s.backlog.iter().map(|b| b.id).collect()
    }

    #[test]
    fn ids_count_from_zero_and_the_ring_keeps_the_last() {
        let log = EventLog::new(3);
        for i in 0u32..5 {
            assert_eq!(log.push(b(f64::from(i))), u64::from(i));
        }
        assert_eq!(log.next_id(), 5);
        // Ring holds 2, 3, 4.
        let s = log.subscribe(Some(2));
        assert_eq!(ids(&s), vec![3, 4]);
        assert!(s.complete);
        let s = log.subscribe(Some(1));
        assert_eq!(ids(&s), vec![2, 3, 4]);
        assert!(s.complete);
        // After 0, batch 1 is gone: incomplete.
        let s = log.subscribe(Some(0));
        assert_eq!(ids(&s), vec![2, 3, 4]);
        assert!(!s.complete);
        let s = log.subscribe(Some(4));
        assert_eq!(ids(&s), Vec::<u64>::new());
        assert!(s.complete);
        // An id this log never gave out: everything buffered, incomplete.
        let s = log.subscribe(Some(99));
        assert_eq!(ids(&s), vec![2, 3, 4]);
        assert!(!s.complete);
        let s = log.subscribe(None);
        assert_eq!(ids(&s), Vec::<u64>::new());
        assert!(s.complete);
    }

    #[tokio::test]
    async fn backlog_then_live_without_gap_or_repeat() {
        let log = EventLog::new(8);
        log.push(b(0.0));
        log.push(b(1.0));
        let mut s = log.subscribe(Some(0));
        log.push(b(2.0));
        let mut got = Vec::new();
        for _ in 0..2 {
            match s.next().await {
                Next::Batch(x) => got.push((x.id, x.batch.ts)),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, vec![(1, 1.0), (2, 2.0)]);
        assert_eq!(s.backlog_len(), 0);
    }

    #[tokio::test]
    async fn a_slow_subscriber_lags_and_is_told() {
        let log = EventLog::new(2);
        let mut s = log.subscribe(None);
        for i in 0..5 {
            log.push(b(f64::from(i)));
        }
        // The broadcast keeps 2: ids 0..2 are lost to this subscriber.
        assert_eq!(s.next().await, Next::Lagged(3));
        match s.next().await {
            Next::Batch(x) => assert_eq!(x.id, 3),
            other => panic!("{other:?}"),
        }
        drop(log);
        match s.next().await {
            Next::Batch(x) => assert_eq!(x.id, 4),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.next().await, Next::Closed);
    }
}
