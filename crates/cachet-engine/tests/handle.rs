//! The threaded engine through its async handle on the simulated executor.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cachet_core::{FinishReason, NewRequest, SamplingParams, SchedulerConfig};
use cachet_engine::sim::{ByteTokenizer, SimConfig, SimExecutor};
use cachet_engine::{
    start_engine, AddRequestError, CounterDeltas, EngineConfig, EngineHandle, ModelInfo,
    StatLogger, StepStats,
};

#[derive(Clone, Default)]
struct Sum(Arc<Mutex<(CounterDeltas, Vec<cachet_engine::FinishedRequestStats>)>>);
impl StatLogger for Sum {
    fn record(&mut self, s: &StepStats) {
        let mut g = self.0.lock().unwrap();
        g.0.accumulate(&s.deltas);
        g.1.extend(s.finished.iter().cloned());
    }
}

fn engine(sim: SimConfig, max_waiting: usize, sum: &Sum) -> EngineHandle {
    let cfg = EngineConfig {
        scheduler: SchedulerConfig {
            num_blocks: sim.num_blocks,
            block_size: sim.block_size,
            eos_token_ids: vec![2],
            ..Default::default()
        },
        max_waiting_requests: max_waiting,
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
        Arc::new(ByteTokenizer),
        vec![Box::new(sum.clone())],
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
async fn drain(s: &mut cachet_engine::RequestStream) -> Vec<cachet_engine::RequestOutput> {
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

fn req(id: &str, n: u32, max_tokens: u32) -> NewRequest {
    NewRequest::new(
        id,
        (0..n).map(|i| 40 + i % 50).collect(),
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    )
}

#[tokio::test]
async fn streams_tokens_then_final_output_with_stats_and_metrics() {
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
    let mut s = h.add_request(req("a", 100, 5)).unwrap();
    let mut tokens = 0;
    let mut first_stats = None;
    let outs = drain(&mut s).await;
    for o in &outs {
        tokens += o.tokens.len();
        if first_stats.is_none() {
            first_stats = o.prefill_stats;
        }
    }
    let last = outs.last().unwrap().clone();
    assert_eq!(tokens, 5);
    assert_eq!(last.finish_reason, Some(FinishReason::Length));
    assert_eq!(first_stats.unwrap().cache_creation_tokens, 96);
    assert_eq!(last.metrics.unwrap().generation_tokens, 5);
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
    let mut s = h.add_request(req("a", 40, 500)).unwrap();
    s.next().await.unwrap();
    drop(s);
    h.wait_idle().await;
    // Give the core thread a moment to publish the gauges after the abort.
    tokio::time::sleep(Duration::from_millis(50)).await;
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
    // The id is free again.
    drop(st);
    assert!(h.add_request(req("a", 10, 1)).is_ok());
}

#[tokio::test]
async fn full_queue_and_invalid_requests_are_refused_synchronously() {
    let sum = Sum::default();
    let sim = SimConfig {
        num_blocks: 8,
        block_size: 16,
        prefill_cost_per_token: Duration::from_millis(10),
        ..Default::default()
    };
    let h = engine(sim, 1, &sum);
    assert!(matches!(
        h.add_request(req("big", 200, 1)),
        Err(AddRequestError::Invalid(_))
    ));
    assert!(matches!(
        h.add_request(req("empty", 0, 1)),
        Err(AddRequestError::Invalid(_))
    ));
    let _a = h.add_request(req("a", 100, 2)).unwrap();
    let r = h.add_request(req("b", 100, 2));
    assert!(
        matches!(r, Err(AddRequestError::QueueFull(_))),
        "{:?}",
        r.err()
    );
    assert!(
        matches!(
            h.add_request(req("a", 10, 1)),
            Err(AddRequestError::Invalid(_))
        ),
        "duplicate id"
    );
}

#[tokio::test]
async fn session_turns_through_the_handle() {
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
    let mut r1 = req("t1", 16, 2);
    r1.session_id = Some("s".into());
    let mut s1 = h.add_request(r1.clone()).unwrap();
    let mut r2 = req("t2", 16, 1);
    r2.session_id = Some("s".into());
    assert!(matches!(
        h.add_request(r2),
        Err(AddRequestError::Invalid(
            cachet_engine::CoreAddError::SessionBusy(_)
        ))
    ));
    let mut out = Vec::new();
    let outs = drain(&mut s1).await;
    out.extend(outs.iter().flat_map(|o| o.tokens.iter().map(|t| t.token)));
    let last = outs.last().unwrap().clone();
    assert_eq!(last.session.unwrap().turn, 1);
    let mut p2 = r1.prompt.clone();
    p2.push(out[0]);
    p2.extend(60..76);
    let mut r2 = req("t2", 1, 1);
    r2.prompt = p2;
    r2.session_id = Some("s".into());
    let mut s2 = h.add_request(r2).unwrap();
    let last = drain(&mut s2).await.pop().unwrap();
    let rep = last.session.unwrap();
    assert!(rep.continued);
    assert_eq!(rep.retained_tokens, 17);
    assert_eq!(last.prefill_stats.unwrap().cache_creation_tokens, 15);
}

/// Closing a session aborts its turn in flight: the turn's stream ends with `Abort`, nothing
/// is parked, every block is free, and the next turn with that id starts a new session.
#[tokio::test]
async fn closing_a_session_aborts_its_turn_in_flight() {
    let sum = Sum::default();
    let h = slow_engine(&sum);
    let mut r1 = req("t1", 20, 500);
    r1.session_id = Some("s".into());
    let mut s1 = h.add_request(r1).unwrap();
    assert!(s1.next().await.unwrap().finish_reason.is_none());
    h.release_session("s");
    let last = drain(&mut s1).await.pop().unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    h.wait_idle().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let g = h.gauges();
    assert_eq!(g.parked_sessions, 0);
    assert_eq!(g.kv_cache_usage_perc, 0.0);
    let mut r2 = req("t2", 20, 1);
    r2.session_id = Some("s".into());
    let last = drain(&mut h.add_request(r2).unwrap()).await.pop().unwrap();
    assert_eq!(
        last.session.unwrap().status,
        cachet_engine::SessionStatus::New
    );
}
