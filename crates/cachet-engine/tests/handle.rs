//! The threaded engine through its async handle on the simulated executor: streams, aborts,
//! admission by round trip, engine-assigned handles, sessions, the lifecycle (drain with a
//! timeout, a panic on the core thread).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cachet_core::{FinishReason, RequestDraft, SamplingParams, SchedulerConfig, ValidRequest};
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::step::CoreOptions;
use cachet_engine::{
    start_engine, AddError, AddRequestError, CounterDeltas, EngineConfig, EngineFailure,
    EngineHandle, EngineState, FinishedRequestStats, ModelInfo, RequestOutput, RequestStream,
    StatLogger, StepStats,
};

#[derive(Clone, Default)]
struct Sum(Arc<Mutex<(CounterDeltas, Vec<FinishedRequestStats>)>>);
impl StatLogger for Sum {
    fn record(&mut self, s: &StepStats) {
        let mut g = self.0.lock().unwrap();
        g.0.accumulate(&s.deltas);
        g.1.extend(s.finished.iter().cloned());
    }
}

fn engine(sim: SimConfig, max_waiting: usize, sum: &Sum) -> EngineHandle {
    engine_with(sim, max_waiting, 128, sum)
}

fn engine_with(sim: SimConfig, max_waiting: usize, max_seqs: usize, sum: &Sum) -> EngineHandle {
    let cfg = EngineConfig {
        scheduler: SchedulerConfig {
            num_blocks: sim.num_blocks,
            block_size: sim.block_size,
            eos_token_ids: vec![2],
            max_waiting_requests: max_waiting,
            max_num_seqs: max_seqs,
            ..Default::default()
        },
    };
    let info = ModelInfo {
        name: "sim".into(),
        max_model_len: 8192,
        block_size: sim.block_size,
        num_kv_blocks: sim.num_blocks,
    };
    start_engine(
        cfg,
        SimExecutor::new(sim),
        info,
        CoreOptions {
            loggers: vec![Box::new(sum.clone())],
            ..Default::default()
        },
    )
    .unwrap()
}

/// 64 blocks of 16, 5 ms per decode step: slow enough to act on a request mid-flight.
fn slow_engine(sum: &Sum) -> EngineHandle {
    let sim = SimConfig {
        num_blocks: 64,
        block_size: 16,
        decode_cost_per_seq: Duration::from_millis(5),
        ..Default::default()
    };
    engine(sim, 100, sum)
}

/// Every output of a stream up to and including the final one.
async fn drain(s: &mut RequestStream) -> Vec<RequestOutput> {
    let mut outs = Vec::new();
    while let Some(o) = s.next().await {
        let done = o.finish_reason.is_some();
        outs.push(o);
        if done {
            break;
        }
    }
    outs
}

fn draft(label: &str, n: u32, max_tokens: u32) -> RequestDraft {
    RequestDraft::new(
        label,
        (0..n).map(|i| 40 + i % 50).collect(),
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    )
}

fn valid(h: &EngineHandle, d: RequestDraft) -> ValidRequest {
    h.limits().validate(d).expect("valid")
}

#[tokio::test]
async fn streams_tokens_then_final_output_with_stats() {
    let sum = Sum::default();
    let h = engine(
        SimConfig {
            num_blocks: 64,
            block_size: 16,
            ..Default::default()
        },
        100,
        &sum,
    );
    let mut s = h.add_request(valid(&h, draft("a", 100, 5))).await.unwrap();
    let outs = drain(&mut s).await;
    let tokens: usize = outs.iter().map(|o| o.tokens.len()).sum();
    assert_eq!(tokens, 5);
    assert!(outs[0].first_token);
    let first = outs[0]
        .report
        .as_ref()
        .and_then(|r| r.prefill_stats)
        .unwrap();
    assert_eq!(first.cache_creation_tokens, 96);
    let last = outs.last().unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Length));
    let fin = last.report.as_ref().unwrap().finished.as_ref().unwrap();
    assert_eq!((fin.generation_tokens, &*fin.request_id), (5, "a"));
    assert_eq!(fin.handle, s.handle().0);
    assert!(s.next().await.is_none());
    h.wait_idle().await;
    let g = sum.0.lock().unwrap();
    assert_eq!(g.0.prefix_cache_queries, 100);
    assert_eq!(g.0.generation_tokens, 5);
}

#[tokio::test]
async fn dropping_a_stream_aborts_and_frees_everything() {
    let sum = Sum::default();
    let h = slow_engine(&sum);
    let mut s = h.add_request(valid(&h, draft("a", 40, 500))).await.unwrap();
    s.next().await.unwrap();
    drop(s);
    h.wait_idle().await;
    let g = h.gauges();
    assert_eq!(g.num_requests_running, 0);
    assert_eq!(g.kv_cache_usage_perc, 0.0);
    let st = sum.0.lock().unwrap();
    assert_eq!(st.1.len(), 1);
    assert_eq!(st.1[0].finish_reason, FinishReason::Abort);
    assert_eq!(
        st.0.prefix_cache_queries, 40,
        "the lookup is counted exactly once"
    );
}

/// The bug this guards against: the engine used to address requests by the client's id and
/// forget it before the final output reached the client, so a stream dropped at that moment
/// aborted a new request that reused the id. Handles are the engine's and never reused: a
/// late abort of a finished request is a no-op, whatever the labels.
#[tokio::test]
async fn a_late_abort_never_reaches_another_request_with_the_same_label() {
    let sum = Sum::default();
    let h = slow_engine(&sum);
    let mut a = h
        .add_request(valid(&h, draft("same", 20, 2)))
        .await
        .unwrap();
    let a_handle = a.handle();
    let outs = drain(&mut a).await;
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::Length)
    );
    let mut b = h
        .add_request(valid(&h, draft("same", 20, 6)))
        .await
        .unwrap();
    assert_ne!(b.handle(), a_handle);
    // A's late disconnect, after B (same label) was admitted.
    h.abort(a_handle);
    drop(a);
    let outs = drain(&mut b).await;
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::Length)
    );
    assert_eq!(outs.iter().map(|o| o.tokens.len()).sum::<usize>(), 6);
}

/// One running request (max_num_seqs 1), one waiting (the queue's capacity): the next is
/// refused by the core thread, which admitted `a` before `b` was even sent.
#[tokio::test]
async fn the_core_thread_refuses_a_full_queue() {
    let sum = Sum::default();
    let sim = SimConfig {
        num_blocks: 64,
        block_size: 16,
        decode_cost_per_seq: Duration::from_millis(2),
        ..Default::default()
    };
    let h = engine_with(sim, 1, 1, &sum);
    let _a = h
        .add_request(valid(&h, draft("a", 20, 1000)))
        .await
        .unwrap();
    let _b = h.add_request(valid(&h, draft("b", 20, 2))).await.unwrap();
    assert_eq!(
        h.add_request(valid(&h, draft("c", 20, 2))).await.err(),
        Some(AddRequestError::Refused(AddError::QueueFull { waiting: 1 }))
    );
}

#[tokio::test]
async fn session_turns_through_the_handle() {
    let sum = Sum::default();
    let h = slow_engine(&sum);
    // 40 output tokens at 5 ms a step: the turn is still in flight when the second one comes.
    let mut r1 = draft("t1", 16, 40);
    r1.session_id = Some("s".into());
    let mut s1 = h.add_request(valid(&h, r1.clone())).await.unwrap();
    let mut r2 = draft("t2", 16, 1);
    r2.session_id = Some("s".into());
    assert_eq!(
        h.add_request(valid(&h, r2)).await.err(),
        Some(AddRequestError::Refused(AddError::SessionBusy("s".into())))
    );
    let outs = drain(&mut s1).await;
    let out: Vec<u32> = outs
        .iter()
        .flat_map(|o| o.tokens.iter().map(|t| t.token))
        .collect();
    let last = outs.last().unwrap().clone();
    assert_eq!(last.session.unwrap().turn, 1);
    // Turn 2 sends turn 1's prompt and every output token but the last (never computed).
    let mut p2 = r1.prompt.clone();
    p2.extend(&out[..out.len() - 1]);
    p2.extend(60..76);
    let mut r2 = draft("t2", 1, 1);
    r2.prompt = p2;
    r2.session_id = Some("s".into());
    let mut s2 = h.add_request(valid(&h, r2)).await.unwrap();
    let last = drain(&mut s2).await.pop().unwrap();
    let info = last.session.unwrap();
    assert!(info.continued());
    // 16 prompt + 39 computed output tokens retained; the new 16 tokens fill [55, 71): block
    // [64, 80) is not full, block [48, 64) becomes full with 7 retained and 9 new tokens.
    assert_eq!(info.retained_tokens, 55);
    let rep = last.report.unwrap();
    assert_eq!(rep.prefill_stats.unwrap().cache_creation_tokens, 9);
    assert_eq!(rep.session.unwrap().stats.cache_creation_tokens, 16 + 9);
}

/// Closing a session aborts its turn in flight: the turn's stream ends with `Abort`, nothing
/// is parked, every block is free, and the next turn with that id starts a new session.
#[tokio::test]
async fn closing_a_session_aborts_its_turn_in_flight() {
    let sum = Sum::default();
    let h = slow_engine(&sum);
    let mut r1 = draft("t1", 20, 500);
    r1.session_id = Some("s".into());
    let mut s1 = h.add_request(valid(&h, r1)).await.unwrap();
    assert!(s1.next().await.unwrap().finish_reason.is_none());
    h.release_session("s").await;
    let last = drain(&mut s1).await.pop().unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    h.wait_idle().await;
    let g = h.gauges();
    assert_eq!(g.parked_sessions, 0);
    assert_eq!(g.kv_cache_usage_perc, 0.0);
    let mut r2 = draft("t2", 20, 1);
    r2.session_id = Some("s".into());
    let last = drain(&mut h.add_request(valid(&h, r2)).await.unwrap())
        .await
        .pop()
        .unwrap();
    assert_eq!(
        last.session.unwrap().status,
        cachet_engine::SessionStatus::New
    );
}

/// Shutdown drains for at most its timeout, then aborts what is left and counts it.
#[tokio::test]
async fn shutdown_drains_then_aborts_what_is_left() {
    let sum = Sum::default();
    let h = slow_engine(&sum);
    let mut quick = h
        .add_request(valid(&h, draft("quick", 20, 2)))
        .await
        .unwrap();
    let mut slow = h
        .add_request(valid(&h, draft("slow", 20, 900)))
        .await
        .unwrap();
    let aborted = h.shutdown(Duration::from_millis(300)).await;
    assert_eq!(aborted, 1);
    assert_eq!(h.state(), EngineState::Stopped);
    let q = drain(&mut quick).await.pop().unwrap();
    assert_eq!(q.finish_reason, Some(FinishReason::Length));
    let s = drain(&mut slow).await.pop().unwrap();
    assert_eq!(s.finish_reason, Some(FinishReason::Abort));
    let aborts = {
        let st = sum.0.lock().unwrap();
        st.1.iter()
            .filter(|f| f.finish_reason == FinishReason::Abort)
            .count()
    };
    assert_eq!(aborts, 1, "the shutdown abort is counted like any abort");
    assert_eq!(
        h.add_request(valid(&h, draft("late", 4, 1))).await.err(),
        Some(AddRequestError::NotRunning(EngineState::Stopped))
    );
}

/// A panic on the core thread: every live stream ends with an error, the engine is dead and
/// refuses new requests, and shutdown returns at once.
#[tokio::test]
async fn a_panic_on_the_core_thread_fails_every_live_request() {
    let sum = Sum::default();
    let trigger: Vec<u32> = vec![7, 7, 7, 7];
    let h = engine(
        SimConfig {
            num_blocks: 64,
            block_size: 16,
            decode_cost_per_seq: Duration::from_millis(2),
            panic_on: Some(trigger.clone()),
            ..Default::default()
        },
        100,
        &sum,
    );
    let mut live = h
        .add_request(valid(&h, draft("live", 20, 900)))
        .await
        .unwrap();
    assert!(live.next().await.unwrap().finish_reason.is_none());
    let mut bad = draft("bad", 4, 1);
    bad.prompt = trigger;
    let mut bad = h.add_request(valid(&h, bad)).await.unwrap();
    for s in [&mut live, &mut bad] {
        let last = drain(s).await.pop().unwrap();
        assert_eq!(last.finish_reason, Some(FinishReason::Error));
        assert!(
            matches!(&last.error, Some(EngineFailure::Died(m)) if m.contains("injected panic")),
            "{:?}",
            last.error
        );
    }
    let mut st = h.watch_state();
    let _ = st.wait_for(|s| *s == EngineState::Dead).await;
    assert_eq!(
        h.add_request(valid(&h, draft("after", 4, 1))).await.err(),
        Some(AddRequestError::NotRunning(EngineState::Dead))
    );
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), h.shutdown(Duration::from_secs(30)))
            .await
            .ok(),
        Some(0)
    );
    assert_eq!(h.state(), EngineState::Dead);
}
