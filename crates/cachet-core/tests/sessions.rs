//! Resumable sessions (spec §5), B = 16 unless stated. The test executor samples token 7.

mod common;
use common::*;

use cachet_core::recorder::SessionTotals;
use cachet_core::scheduler::{AddError, RequestUpdate};
use cachet_core::stats::PrefillStats;
use cachet_core::{RequestDraft, SessionInfo};

fn turn(id: &str, session: &str, prompt: Vec<u32>, max_tokens: u32) -> RequestDraft {
    let mut r = req(id, prompt, max_tokens);
    r.session_id = Some(session.into());
    r
}

/// Run to completion; return the final update of `id`: the chunk's stats, the session facts
/// and the session-cumulative numbers.
fn finish(s: &mut Core, id: &str) -> (PrefillStats, SessionInfo, SessionTotals) {
    let mut last: Option<RequestUpdate> = None;
    let slot = s.slot_of(id).expect("live");
    let mut t = s.now;
    while s.s.has_unfinished() {
        t += 1.0;
        let (_, ups) = s.step(t);
        for u in ups {
            if u.slot == slot && u.finish.is_some() {
                last = Some(u);
            }
        }
        s.s.check_invariants().unwrap();
    }
    s.take_finished();
    let u = last.expect("finished");
    let rep = u.report.expect("report");
    (
        rep.prefill_stats.expect("stats"),
        *u.session.expect("session info"),
        rep.session.expect("session totals"),
    )
}

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

#[test]
fn spec_two_chunk_example_creation_is_15() {
    let mut s = Core::new(cfg(64, 16));
    let p1 = toks(100, 16);
    s.add(turn("t1", "s", p1.clone(), 2)).unwrap();
    let (c1, r1, _) = finish(&mut s, "t1");
    // 16 prompt tokens fill block 0 (creation 16); the first generated token's KV is kept,
    // the second (never computed) is dropped: 17 valid tokens.
    assert_eq!(fields(&c1), [16, 0, 0, 0, 16, 16, 1, 1, 1, 0, 0]);
    assert_eq!((r1.continued(), r1.turn, r1.retained_tokens), (false, 1, 0));
    assert_eq!(s.s.sessions().parked_tokens("s").unwrap().len(), 17);
    // Chunk 2: 16 new tokens after the 17 valid ones. Block [16, 32) becomes full with 1 retained
    // and 15 new tokens → 15 creation tokens; 1 new block (33 tokens need 3).
    let p2 = [p1, vec![7], toks(500, 16)].concat();
    s.add(turn("t2", "s", p2, 1)).unwrap();
    let (c2, r2, cum2) = finish(&mut s, "t2");
    assert_eq!(fields(&c2), [16, 0, 0, 0, 16, 15, 1, 1, 1, 0, 0]);
    assert_eq!(
        (
            r2.continued(),
            r2.turn,
            r2.retained_tokens,
            r2.total_prompt_tokens
        ),
        (true, 2, 17, 33)
    );
    assert_eq!(fields(&cum2.stats), [32, 0, 0, 0, 32, 31, 2, 2, 2, 0, 0]);
    assert_eq!(r2.turn_cached_tokens(&c2), 17);
    // A continuation is not looked up: only turn 1's 16 tokens were queried.
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (16, 0));
    assert_eq!((t.prompt_tokens, t.prompt_tokens_local_compute), (32, 32));
    assert_eq!(t.cache_creation_tokens, 31);
}

#[test]
fn chunk_boundary_on_a_block_boundary() {
    let mut s = Core::new(cfg(64, 16));
    let p1 = toks(100, 15);
    s.add(turn("t1", "s", p1.clone(), 2)).unwrap();
    let (c1, _, _) = finish(&mut s, "t1");
    // 15 tokens fill nothing during prefill; the generated token completes block 0 after the
    // first output (not prefill work).
    assert_eq!(c1.cache_creation_tokens, 0);
    assert_eq!(s.s.sessions().parked_tokens("s").unwrap().len(), 16);
    let p2 = [p1, vec![7], toks(500, 16)].concat();
    s.add(turn("t2", "s", p2, 1)).unwrap();
    let (c2, r2, _) = finish(&mut s, "t2");
    // The new chunk starts exactly at position 16 and fills block 1 alone.
    assert_eq!(fields(&c2), [16, 0, 0, 0, 16, 16, 1, 1, 1, 0, 0]);
    assert_eq!(r2.retained_tokens, 16);
}

#[test]
fn three_turns_cumulative_is_the_sum_of_turns() {
    let mut s = Core::new(cfg(64, 16));
    let mut prompt = toks(100, 20);
    let mut sum = PrefillStats::default();
    for (i, extra) in [0u32, 9, 30].iter().enumerate() {
        if i > 0 {
            prompt.push(7); // the previous turn's last kept output token
            prompt.extend(toks(1000 * i as u32, *extra));
        }
        let id = format!("t{i}");
        s.add(turn(&id, "s", prompt.clone(), 3)).unwrap();
        let (c, r, cum) = finish(&mut s, &id);
        c.check().unwrap();
        sum.accumulate(&c);
        assert_eq!(cum.stats, sum);
        assert_eq!(r.turn, i as u32 + 1);
        assert_eq!(r.continued(), i > 0);
        prompt = s.s.sessions().parked_tokens("s").unwrap().to_vec();
    }
    assert_eq!(sum.prompt_tokens, s.totals().prompt_tokens);
}

#[test]
fn idle_timeout_releases_and_the_next_turn_hits_the_cache() {
    let mut c = cfg(64, 16);
    c.session_idle_timeout_s = 10.0;
    let mut s = Core::new(c);
    let p1 = toks(100, 40);
    s.add(turn("t1", "s", p1.clone(), 2)).unwrap();
    finish(&mut s, "t1");
    assert!(s.s.sessions().is_parked("s"));
    assert_eq!(s.s.expire_sessions(5.0), 0);
    assert_eq!(s.s.expire_sessions(100.0), 1);
    assert!(!s.s.sessions().is_parked("s"));
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
    // Next turn: a new session, admitted as a normal request; the 2 full blocks are still cached.
    let p2 = [p1, vec![7], toks(500, 10)].concat();
    s.add(turn("t2", "s", p2, 1)).unwrap();
    let (c2, r2, _) = finish(&mut s, "t2");
    assert!(!r2.continued());
    assert_eq!(r2.status, cachet_core::SessionStatus::New);
    assert_eq!(c2.local_cached_tokens, 32);
    assert_eq!(c2.prompt_tokens, 51);
}

#[test]
fn kv_budget_releases_least_recently_parked_first() {
    let mut c = cfg(64, 16);
    c.session_kv_budget_blocks = 5;
    let mut s = Core::new(c);
    s.add(turn("a", "sa", toks(100, 40), 2)).unwrap(); // 41 valid tokens: 3 blocks
    finish(&mut s, "a");
    s.add(turn("b", "sb", toks(900, 40), 2)).unwrap(); // 3 blocks, parked later
    finish(&mut s, "b");
    assert_eq!(s.s.gauges().parked_session_blocks, 6);
    assert_eq!(s.s.expire_sessions(0.0), 1);
    assert!(!s.s.sessions().is_parked("sa"));
    assert!(s.s.sessions().is_parked("sb"));
}

#[test]
fn edited_history_falls_back_to_a_normal_request() {
    let mut s = Core::new(cfg(64, 16));
    let p1 = toks(100, 40);
    s.add(turn("t1", "s", p1.clone(), 2)).unwrap();
    finish(&mut s, "t1");
    // Token 35 edited: not an extension of the retained 41 tokens.
    let mut p2 = [p1, vec![7], toks(500, 10)].concat();
    p2[35] = 9999;
    s.add(turn("t2", "s", p2, 1)).unwrap();
    let (c2, r2, _) = finish(&mut s, "t2");
    assert!(!r2.continued());
    assert_eq!(r2.status, cachet_core::SessionStatus::HistoryMismatch);
    assert_eq!(r2.turn, 1);
    // Looked up like any request: the first 2 blocks (32 tokens) are unchanged and cached.
    assert_eq!(fields(&c2)[..6], [51, 32, 0, 32, 19, 16]);
    s.s.check_invariants().unwrap();
}

#[test]
fn other_salt_never_continues_the_session() {
    let mut s = Core::new(cfg(64, 16));
    let p1 = toks(100, 40);
    let mut a = turn("t1", "s", p1.clone(), 2);
    a.cache_salt = Some("x".into());
    s.add(a).unwrap();
    finish(&mut s, "t1");
    let mut b = turn("t2", "s", [p1, vec![7], toks(500, 4)].concat(), 1);
    b.cache_salt = Some("y".into());
    s.add(b).unwrap();
    let (c2, r2, _) = finish(&mut s, "t2");
    assert!(!r2.continued());
    assert_eq!(c2.cached_tokens, 0);
}

#[test]
fn second_turn_while_one_is_in_flight_is_refused() {
    let mut s = Core::new(cfg(64, 16));
    s.add(turn("t1", "s", toks(100, 20), 4)).unwrap();
    assert_eq!(
        s.add(turn("t2", "s", toks(100, 25), 1)),
        Err(Refused::Add(AddError::SessionBusy("s".into())))
    );
    finish(&mut s, "t1");
    s.add(turn(
        "t3",
        "s",
        [toks(100, 20), vec![7, 7, 7], toks(1, 2)].concat(),
        1,
    ))
    .unwrap();
    let (_, r, _) = finish(&mut s, "t3");
    assert!(r.continued());
}

#[test]
fn aborted_turn_releases_the_session() {
    let mut s = Core::new(cfg(64, 16));
    s.add(turn("t1", "s", toks(100, 20), 4)).unwrap();
    s.step(1.0);
    s.finish("t1", cachet_core::FinishReason::Abort, 2.0)
        .unwrap();
    assert!(!s.s.sessions().is_parked("s"));
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
}

/// Across a restart: the parked session's record (its tokens, turns and keys) read into a new
/// scheduler makes it restorable. Its next turn that extends the tokens is `restored`: turn 2,
/// nothing retained, looked up like any request (the new pool holds nothing, so all computed);
/// it parks again. A turn that does not extend them is a history mismatch; an unknown session
/// is new; a record idle past the timeout is dropped.
#[test]
fn a_parked_session_is_restored_after_a_restart() {
    let mut s = Core::new(cfg(64, 16));
    let p1 = toks(100, 40);
    let mut t1 = turn("t1", "s", p1.clone(), 2);
    t1.cache_salt = Some("salt".into());
    s.add(t1).unwrap();
    finish(&mut s, "t1");
    let now = s.now + 100.0;
    let records = s.s.session_records(now);
    assert_eq!(records.len(), 1);
    let r = &records[0];
    // 40 prompt tokens and the first generated one (7); the second was never computed.
    assert_eq!(r.tokens, [p1.clone(), vec![7]].concat());
    assert_eq!((r.turns, r.cache_salt.as_deref()), (1, Some("salt")));

    let mut n = Core::new(cfg(64, 16));
    let mut stale = r.clone();
    stale.key = "old".into();
    stale.idle_s = 1e9;
    n.s.restore_sessions(vec![r.clone(), stale], 0.0);
    let p2 = [p1.clone(), vec![7], toks(500, 10)].concat();
    let mut t2 = turn("t2", "s", p2.clone(), 1);
    t2.cache_salt = Some("salt".into());
    n.add(t2).unwrap();
    let (c2, r2, _) = finish(&mut n, "t2");
    assert_eq!(r2.status, cachet_core::sessions::SessionStatus::Restored);
    assert_eq!(
        (r2.turn, r2.retained_tokens, r2.total_prompt_tokens),
        (2, 0, 51)
    );
    assert_eq!((c2.prompt_tokens, c2.computed_tokens), (51, 51));
    assert_eq!(
        n.totals().prefix_cache_queries,
        51,
        "a restored turn is looked up"
    );
    assert!(n.s.sessions().is_parked("s"), "parked again");
    let mut old = turn("t3", "old", p2, 1);
    old.cache_salt = Some("salt".into());
    n.add(old).unwrap();
    let (_, r3, _) = finish(&mut n, "t3");
    assert_eq!(r3.status, cachet_core::sessions::SessionStatus::New);

    // Edited history: the record is dropped and the turn starts afresh.
    let mut m = Core::new(cfg(64, 16));
    m.s.restore_sessions(vec![r.clone()], 0.0);
    let mut t4 = turn("t4", "s", toks(900, 60), 1);
    t4.cache_salt = Some("salt".into());
    m.add(t4).unwrap();
    let (_, r4, _) = finish(&mut m, "t4");
    assert_eq!(
        (r4.status, r4.turn),
        (cachet_core::sessions::SessionStatus::HistoryMismatch, 1)
    );
}
