//! A subscriber reads the publisher's ZMQ stream and checks every frame byte for byte against
//! bytes derived by hand from vLLM's format, for a small scripted workload: a request stores
//! two blocks, a second one shares that prefix and stores one more, an allocation evicts a block
//! and stores its own, then the cache is reset. Also: the replay socket after a gap, a replay
//! buffer that has let old batches go, and the older array encoding.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cachet_core::events::{CacheEvent, EventBatch, EventCause, Medium};
use cachet_core::hash::BlockHash;
use cachet_kv_events::{Encoding, KvEventsConfig, PublisherKind, ZmqPublisher};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const TOPIC: &str = "kv";

/// A block hash whose low 64 bits (its wire form) are `low`; the high bytes are noise that must
/// not reach the wire.
fn h(low: u64) -> BlockHash {
    let mut b = [0x5au8; 32];
    b[24..].copy_from_slice(&low.to_be_bytes());
    BlockHash(b)
}

fn cause(r: &str, s: Option<&str>) -> Option<EventCause> {
    Some(EventCause {
        handle: 1,
        request_id: Arc::from(r),
        session_id: s.map(Arc::from),
    })
}

/// Block size 2. Request "a" (session "s1") stores [1 2][3 4]; "b" has [1 2 3 4 5 6], hits the
/// first two blocks and stores [5 6] under parent 0x12; "c" evicts 0x13 and stores [9 9] (one
/// batch, two events); then a reset.
fn script() -> Vec<EventBatch> {
    vec![
        EventBatch {
            ts: 1.0,
            events: vec![CacheEvent::Stored {
                hashes: vec![h(0x11), h(0x12)],
                parent: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_name: None,
                cache_salt: None,
                medium: Medium::Gpu,
                cause: cause("a", Some("s1")),
            }],
        },
        EventBatch {
            ts: 2.0,
            events: vec![CacheEvent::Stored {
                hashes: vec![h(0x13)],
                parent: Some(h(0x12)),
                token_ids: vec![5, 6],
                block_size: 2,
                lora_name: None,
                cache_salt: None,
                medium: Medium::Gpu,
                cause: cause("b", None),
            }],
        },
        EventBatch {
            ts: 3.0,
            events: vec![
                CacheEvent::Removed {
                    hashes: vec![h(0x13)],
                    medium: Medium::Gpu,
                    cause: cause("c", None),
                },
                CacheEvent::Stored {
                    hashes: vec![h(0xfedc_ba98_7654_3210)],
                    parent: None,
                    token_ids: vec![9, 9],
                    block_size: 2,
                    lora_name: None,
                    cache_salt: None,
                    medium: Medium::Gpu,
                    cause: cause("c", None),
                },
            ],
        },
        EventBatch {
            ts: 4.0,
            events: vec![CacheEvent::AllCleared {
                medium: Medium::Gpu,
            }],
        },
    ]
}

/// fixstr: 0xa0 | len, then the bytes.
fn s(x: &str) -> Vec<u8> {
    assert!(x.len() < 32);
    let mut v = vec![0xa0 | x.len() as u8];
    v.extend(x.as_bytes());
    v
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// The four payloads in the map encoding, written out by hand.
fn expected_map() -> Vec<Vec<u8>> {
    let stored_keys_head = |hashes: &[u8], parent: &[u8], tokens: &[u8]| -> Vec<u8> {
        cat(&[
            &[0x8c], // map of 12
            &s("type"),
            &s("BlockStored"),
            &s("block_hashes"),
            hashes,
            &s("parent_block_hash"),
            parent,
            &s("token_ids"),
            tokens,
            &s("block_size"),
            &[0x02],
            &s("lora_id"),
            &[0xc0],
            &s("medium"),
            &s("GPU"),
            &s("lora_name"),
            &[0xc0],
        ])
    };
    let b0 = cat(&[
        &[0x93, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91], // [1.0, [ ...
        &stored_keys_head(&[0x92, 0x11, 0x12], &[0xc0], &[0x94, 1, 2, 3, 4]),
        &s("extra_keys"),
        &[0x92, 0xc0, 0xc0],
        &s("group_idx"),
        &[0x00],
        &s("request_id"),
        &s("a"),
        &s("session_id"),
        &s("s1"),
        &[0x00], // ], 0]
    ]);
    let b1 = cat(&[
        &[0x93, 0xcb, 0x40, 0x00, 0, 0, 0, 0, 0, 0, 0x91],
        &stored_keys_head(&[0x91, 0x13], &[0x12], &[0x92, 5, 6]),
        &s("extra_keys"),
        &[0x91, 0xc0],
        &s("group_idx"),
        &[0x00],
        &s("request_id"),
        &s("b"),
        &s("session_id"),
        &[0xc0],
        &[0x00],
    ]);
    let b2 = cat(&[
        &[0x93, 0xcb, 0x40, 0x08, 0, 0, 0, 0, 0, 0, 0x92],
        &[0x86],
        &s("type"),
        &s("BlockRemoved"),
        &s("block_hashes"),
        &[0x91, 0x13],
        &s("medium"),
        &s("GPU"),
        &s("group_idx"),
        &[0x00],
        &s("request_id"),
        &s("c"),
        &s("session_id"),
        &[0xc0],
        // 0xfedcba9876543210 needs uint64: 0xcf + 8 bytes.
        &stored_keys_head(
            &[0x91, 0xcf, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10],
            &[0xc0],
            &[0x92, 9, 9],
        ),
        &s("extra_keys"),
        &[0x91, 0xc0],
        &s("group_idx"),
        &[0x00],
        &s("request_id"),
        &s("c"),
        &s("session_id"),
        &[0xc0],
        &[0x00],
    ]);
    let b3 = cat(&[
        &[0x93, 0xcb, 0x40, 0x10, 0, 0, 0, 0, 0, 0, 0x91],
        &[0x81],
        &s("type"),
        &s("AllBlocksCleared"),
        &[0x00],
    ]);
    vec![b0, b1, b2, b3]
}

/// The same four payloads in the older tagged-array encoding.
fn expected_array() -> Vec<Vec<u8>> {
    let stored = |hashes: &[u8], parent: &[u8], tokens: &[u8]| -> Vec<u8> {
        cat(&[
            &[0x98], // array of 8
            &s("BlockStored"),
            hashes,
            parent,
            tokens,
            &[0x02, 0xc0],
            &s("GPU"),
            &[0xc0],
        ])
    };
    vec![
        cat(&[
            &[0x93, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91],
            &stored(&[0x92, 0x11, 0x12], &[0xc0], &[0x94, 1, 2, 3, 4]),
            &[0x00],
        ]),
        cat(&[
            &[0x93, 0xcb, 0x40, 0x00, 0, 0, 0, 0, 0, 0, 0x91],
            &stored(&[0x91, 0x13], &[0x12], &[0x92, 5, 6]),
            &[0x00],
        ]),
        cat(&[
            &[0x93, 0xcb, 0x40, 0x08, 0, 0, 0, 0, 0, 0, 0x92],
            &[0x93],
            &s("BlockRemoved"),
            &[0x91, 0x13],
            &s("GPU"),
            &stored(
                &[0x91, 0xcf, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10],
                &[0xc0],
                &[0x92, 9, 9],
            ),
            &[0x00],
        ]),
        cat(&[
            &[0x93, 0xcb, 0x40, 0x10, 0, 0, 0, 0, 0, 0, 0x91],
            &[0x91],
            &s("AllBlocksCleared"),
            &[0x00],
        ]),
    ]
}

fn start(encoding: Encoding, buffer_steps: usize) -> ZmqPublisher {
    let cfg = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: PublisherKind::Zmq,
        endpoint: "tcp://*:0".into(),
        replay_endpoint: Some("tcp://*:0".into()),
        buffer_steps,
        topic: TOPIC.into(),
        encoding,
        ..KvEventsConfig::default()
    };
    ZmqPublisher::start(&cfg).expect("publisher starts")
}

fn loopback(bound: &str) -> String {
    bound.replace("0.0.0.0", "127.0.0.1")
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

fn seq_of(frame: &[u8]) -> i64 {
    i64::from_be_bytes(frame.try_into().expect("8-byte sequence frame"))
}

/// Asks the replay socket for every buffered batch from `start`; returns `(seq, payload)` up
/// to (not including) the end marker, after checking the marker's exact frames.
async fn replay(endpoint: &str, start: u64) -> Vec<(u64, Vec<u8>)> {
    let mut d = zeromq::DealerSocket::new();
    d.connect(endpoint).await.expect("dealer connects");
    let req = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
    d.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), d.recv())
            .await
            .expect("replay answers")
            .expect("replay recv")
            .into_vec();
        assert_eq!(m.len(), 3, "replay frames are [empty, seq, payload]");
        assert!(m[0].is_empty());
        let seq = seq_of(&m[1]);
        if seq == -1 {
            assert_eq!(&m[1][..], &[0xff; 8]);
            assert!(m[2].is_empty(), "the end marker's payload is empty");
            return out;
        }
        out.push((seq as u64, m[2].to_vec()));
    }
}

/// Reads the live stream until batch `n - 1`, checking each message's frames; batches the
/// subscriber missed before its subscription took (ZMQ's slow joiner) are fetched from the
/// replay socket, as a real consumer does. Returns the payloads in sequence order and whether
/// a replay was needed.
async fn collect(sub: &mut zeromq::SubSocket, replay_ep: &str, n: u64) -> (Vec<Vec<u8>>, bool) {
    let mut got: Vec<Option<Vec<u8>>> = vec![None; n as usize];
    let mut first_live = None;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("live batch arrives")
            .expect("sub recv")
            .into_vec();
        assert_eq!(m.len(), 3, "live frames are [topic, seq, payload]");
        assert_eq!(&m[0][..], TOPIC.as_bytes());
        assert_eq!(m[1].len(), 8);
        let seq = seq_of(&m[1]) as u64;
        first_live.get_or_insert(seq);
        got[seq as usize] = Some(m[2].to_vec());
        if seq == n - 1 {
            break;
        }
    }
    let first_live = first_live.unwrap_or(0);
    let replayed = first_live > 0;
    if replayed {
        for (seq, payload) in replay(replay_ep, 0).await {
            if seq < first_live {
                got[seq as usize] = Some(payload);
            } else {
                // Replay and live carry the same bytes.
                assert_eq!(got[seq as usize].as_deref(), Some(&payload[..]));
            }
        }
    }
    (
        got.into_iter()
            .map(|p| p.expect("every batch seen live or replayed"))
            .collect(),
        replayed,
    )
}

async fn subscriber(p: &ZmqPublisher) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    sub.subscribe(TOPIC).await.unwrap();
    sub.connect(&loopback(p.bound_endpoint().unwrap()))
        .await
        .unwrap();
    sub
}

async fn stream_matches(encoding: Encoding, expected: Vec<Vec<u8>>) {
    let p = start(encoding, 100);
    let mut sub = subscriber(&p).await;
    // Give the subscription time to reach the PUB socket; `collect` replays what it missed if
    // that was not enough.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for b in script() {
        p.publish(Arc::new(b));
    }
    let (payloads, _) = collect(&mut sub, &loopback(p.replay_endpoint().unwrap()), 4).await;
    for (i, (got, want)) in payloads.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "batch {i}");
    }
    assert_eq!(p.dropped(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_vllms_bytes_in_the_map_encoding() {
    stream_matches(Encoding::Map, expected_map()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_vllms_bytes_in_the_array_encoding() {
    stream_matches(Encoding::Array, expected_array()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_fills_its_gap_from_the_replay_socket() {
    let p = start(Encoding::Map, 100);
    let batches = script();
    p.publish(Arc::new(batches[0].clone()));
    p.publish(Arc::new(batches[1].clone()));
    wait_sent(&p, 2);
    // Batches 0 and 1 went out before this subscriber existed: it can only get them by replay.
    let mut sub = subscriber(&p).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.publish(Arc::new(batches[2].clone()));
    p.publish(Arc::new(batches[3].clone()));
    let (payloads, replayed) = collect(&mut sub, &loopback(p.replay_endpoint().unwrap()), 4).await;
    assert!(replayed);
    assert_eq!(payloads, expected_map());
    assert!(p.replays() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_starts_at_the_requested_sequence_and_ends_with_minus_one() {
    let p = start(Encoding::Map, 100);
    for b in script() {
        p.publish(Arc::new(b));
    }
    wait_sent(&p, 4);
    let ep = loopback(p.replay_endpoint().unwrap());
    let want = expected_map();
    assert_eq!(
        replay(&ep, 2).await,
        vec![(2, want[2].clone()), (3, want[3].clone())]
    );
    // Past the newest batch: only the end marker.
    assert_eq!(replay(&ep, 9).await, vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_buffer_keeps_the_last_buffer_steps_batches() {
    let p = start(Encoding::Map, 2);
    for b in script() {
        p.publish(Arc::new(b));
    }
    wait_sent(&p, 4);
    let want = expected_map();
    // Asked from 0, it can only give 2 and 3: 0 and 1 have left the buffer.
    assert_eq!(
        replay(&loopback(p.replay_endpoint().unwrap()), 0).await,
        vec![(2, want[2].clone()), (3, want[3].clone())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_never_reads_does_not_slow_publishing() {
    let p = start(Encoding::Map, 10);
    // Connected, subscribed, never reading.
    let _sub = subscriber(&p).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let big = EventBatch {
        ts: 0.0,
        events: vec![CacheEvent::Stored {
            hashes: (0..64).map(h).collect(),
            parent: None,
            token_ids: vec![7; 64 * 16],
            block_size: 16,
            lora_name: None,
            cache_salt: None,
            medium: Medium::Gpu,
            cause: None,
        }],
    };
    let big = Arc::new(big);
    for _ in 0..2000 {
        p.publish(big.clone());
    }
    // The thread hands all of them to the PUB socket (about 5 MB of payload) although nobody
    // reads: the subscriber's queue absorbs or drops them, it never holds the thread up.
    wait_sent(&p, 2000);
    assert_eq!(p.dropped(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_without_a_wildcard_connects_to_a_bound_subscriber() {
    // vLLM's rule: no `*` in the endpoint means connect ("bind stable, connect volatile"), e.g.
    // to a router that binds its SUB socket.
    let mut sub = zeromq::SubSocket::new();
    sub.subscribe("").await.unwrap();
    let bound = sub.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let cfg = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: PublisherKind::Zmq,
        endpoint: bound,
        ..KvEventsConfig::default()
    };
    let p = ZmqPublisher::start(&cfg).unwrap();
    assert_eq!(p.bound_endpoint(), None);
    assert_eq!(p.replay_endpoint(), None);
    let batch = Arc::new(script().remove(3));
    let want = expected_map().remove(3);
    // Batches published before the connection and subscription are up are lost (PUB
    // semantics); keep publishing until one arrives.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let m = loop {
        p.publish(batch.clone());
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            break m.unwrap().into_vec();
        }
        assert!(std::time::Instant::now() < deadline, "nothing arrived");
    };
    assert_eq!(m.len(), 3);
    assert!(m[0].is_empty(), "default topic is empty");
    assert!(seq_of(&m[1]) >= 0);
    assert_eq!(&m[2][..], &want[..]);
}
