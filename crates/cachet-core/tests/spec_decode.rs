//! Prompt-lookup speculative decoding in the scheduler, on hand-made workloads: the drafts
//! planned, what is accepted, and that block tables, per-request cache stats and the prefix
//! cache are exactly those of plain decoding.

use cachet_core::exec::{ExecBatch, ExecOutput, Sampled};
use cachet_core::scheduler::{ScheduledChunk, SchedulerOutput};
use cachet_core::spec_decode::{SpecConfig, SpecDecodeStats};
use cachet_core::stats::{PrefillStats, SpecDecodeCounts};
use cachet_core::{
    FinishReason, HashSeed, Recorder, RequestDraft, SamplingParams, Scheduler, SchedulerConfig,
};

/// A scripted "model": the i-th output token of every request is `script[i]`, whatever the
/// context. With drafts it verifies as a real executor does: position `j` is sampled while
/// the samples so far equal the drafts.
fn scripted(script: &[u32], batch: &ExecBatch<'_>) -> ExecOutput {
    let mut out = ExecOutput::default();
    for (i, seq) in batch.seqs.iter().enumerate() {
        let Some(spec) = &seq.sample else {
            out.sampled.push(None);
            continue;
        };
        let at = |j: usize| Sampled::token(script[spec.output.len() + j]);
        out.sampled.push(Some(at(0)));
        let mut extra = Vec::new();
        let mut prev = at(0).token;
        for (j, &d) in spec.drafts.iter().enumerate() {
            if prev != d {
                break;
            }
            let s = at(j + 1);
            prev = s.token;
            extra.push(s);
        }
        if !extra.is_empty() {
            out.spec.push((i, extra));
        }
    }
    out
}

fn config(spec: Option<SpecConfig>) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 32,
        max_model_len: 128,
        speculative: spec,
        ..Default::default()
    }
}

fn spec3() -> Option<SpecConfig> {
    Some(SpecConfig {
        num_speculative_tokens: 3,
        prompt_lookup_min: 1,
        prompt_lookup_max: 4,
        adaptive: true,
    })
}

const PROMPT: [u32; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1];

fn draft(id: &str, prompt: &[u32], max_tokens: u32) -> RequestDraft {
    RequestDraft::new(
        id,
        prompt.to_vec(),
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    )
}

struct Run {
    plans: Vec<SchedulerOutput>,
    /// (tokens, block table) after every step.
    states: Vec<(Vec<u32>, Vec<u32>)>,
    output: Vec<u32>,
    finish: Option<FinishReason>,
    stats: PrefillStats,
    /// Tokens delivered per step (one update each).
    per_step: Vec<usize>,
    s: Scheduler<Recorder>,
}

fn run(cfg: SchedulerConfig, d: RequestDraft, script: &[u32]) -> Run {
    let seed = HashSeed::new(&[9; 32], cfg.block_size, "test");
    let mut s = Scheduler::new(cfg, seed, Recorder::new(4));
    run_on(&mut s, d, script, 0.0)
        .map(|(plans, states, output, finish, stats, per_step)| Run {
            plans,
            states,
            output,
            finish,
            stats,
            per_step,
            s,
        })
        .expect("finished")
}

type Outcome = (
    Vec<SchedulerOutput>,
    Vec<(Vec<u32>, Vec<u32>)>,
    Vec<u32>,
    Option<FinishReason>,
    PrefillStats,
    Vec<usize>,
);

fn run_on(
    s: &mut Scheduler<Recorder>,
    d: RequestDraft,
    script: &[u32],
    t0: f64,
) -> Option<Outcome> {
    let v = s.config().limits().validate(d).ok()?;
    let slot = s.add_request(t0 as u64 + 1, t0, v).ok()?;
    let (mut plans, mut states, mut output, mut per_step) = (vec![], vec![], vec![], vec![]);
    let mut finish = None;
    let mut t = t0;
    while s.has_unfinished() {
        t += 1.0;
        let plan = s.schedule(t, None);
        let res = scripted(script, &s.exec_batch(&plan));
        let ups = s.update(&plan, res, t);
        s.check_invariants().ok()?;
        plans.push(plan);
        per_step.push(ups.iter().filter(|u| u.token.is_some()).count());
        for u in ups {
            if let Some(tok) = u.token {
                output.push(tok.token);
            }
            finish = finish.or(u.finish);
        }
        if let Some(st) = s.debug_request(slot) {
            states.push(st);
        }
    }
    let fin = s.observer_mut().take_finished();
    let stats = fin.last()?.prefill_stats?;
    Some((plans, states, output, finish, stats, per_step))
}

fn chunk(plan: &SchedulerOutput) -> ScheduledChunk {
    plan.chunks[0].clone()
}

/// The output repeats the prompt from its second token (2, 3, 4, 5, 6, 7), then goes its own
/// way (50, 51, ...).
const COPY: [u32; 12] = [2, 3, 4, 5, 6, 7, 50, 51, 52, 53, 54, 55];

#[test]
fn a_copying_request_gets_drafts_capped_at_the_block_end_and_accepts_them() {
    let mut on = run(config(spec3()), draft("a", &PROMPT, 10), &COPY);
    // Step 1: the prompt (10 tokens, blocks 0..2), sampling 2.
    assert_eq!(
        chunk(&on.plans[0]),
        ScheduledChunk {
            slot: 0,
            start_pos: 0,
            num_tokens: 10,
            sample: true,
            drafts: 0
        }
    );
    // Step 2: p = 10, the context ends [.., 9, 1, 2]; [1, 2] recurs at 0 (then 3, 4, 5), but
    // the block of p (positions 8..11) has one slot after p: one draft, [3], accepted; the
    // token after it is 4.
    assert_eq!(
        chunk(&on.plans[1]),
        ScheduledChunk {
            slot: 0,
            start_pos: 10,
            num_tokens: 2,
            sample: true,
            drafts: 1
        }
    );
    // Step 3: p = 12 (token 4) in a new block (12..15): three slots after p, the 4-gram
    // [1, 2, 3, 4] recurs at 0 → drafts [5, 6, 7], all accepted, then 50.
    assert_eq!(
        chunk(&on.plans[2]),
        ScheduledChunk {
            slot: 0,
            start_pos: 12,
            num_tokens: 4,
            sample: true,
            drafts: 3
        }
    );
    // Step 4: p = 16 (token 50), no earlier 50: a plain decode (51). Then 52, 53 plainly
    // (nothing recurs): the request ends at 10 tokens, in 6 steps instead of 10.
    assert_eq!(chunk(&on.plans[3]).drafts, 0);
    assert_eq!(on.per_step, vec![1, 2, 4, 1, 1, 1]);
    assert_eq!(on.output, COPY[..10].to_vec());
    assert_eq!(on.finish, Some(FinishReason::Length));
    assert_eq!(on.s.spec_counts(0), None); // finished: the slot is empty

    // The same request without speculation: the same tokens, and after every step of the
    // speculative run the same token list and block table as the plain run at that length.
    let off = run(config(None), draft("a", &PROMPT, 10), &COPY);
    assert_eq!(off.output, on.output);
    assert_eq!(off.plans.len(), 10);
    for st in &on.states {
        assert!(
            off.states.contains(st),
            "state {st:?} never occurs in plain decoding"
        );
    }
    assert_eq!(on.stats, off.stats);
    assert_eq!(on.s.observer().totals(), off.s.observer().totals());

    // Inter-token latency is one interval per step and request, as vLLM observes it: steps
    // are 1.0 apart, so the speculative run's 5 steps after the first token give five 1.0 s
    // intervals (tokens committed after an accepted draft add none), the plain run's 9 nine.
    assert_eq!(
        on.s.observer_mut().take_latency_samples().itl_s,
        vec![1.0; 5]
    );
    let mut off = off;
    assert_eq!(
        off.s.observer_mut().take_latency_samples().itl_s,
        vec![1.0; 9]
    );
}

#[test]
fn a_rejected_draft_is_never_cached_and_the_stats_match_plain_decoding() {
    // The output leaves the prompt after 5: drafts [5, 6, 7] at step 3 accept 5 only (the
    // model says 9, not 6); positions 14 and 15 hold the rejected 6 and 7.
    let script = [2, 3, 4, 5, 9, 40, 41, 42, 43, 44];
    let mut on = run(config(spec3()), draft("a", &PROMPT, 8), &script);
    assert_eq!(chunk(&on.plans[2]).drafts, 3);
    assert_eq!(on.per_step[2], 2); // 5 accepted, then 9
                                   // p = 14 next: the token 9 written over the rejected 6.
    assert_eq!(chunk(&on.plans[3]).start_pos, 14);
    assert_eq!(on.output, script[..8].to_vec());
    let off = run(config(None), draft("a", &PROMPT, 8), &script);
    assert_eq!(on.output, off.output);
    assert_eq!(on.stats, off.stats);
    assert_eq!(on.s.observer().totals(), off.s.observer().totals());
    for st in &on.states {
        assert!(off.states.contains(st), "{st:?}");
    }
    // The prefix cache holds [1..4], [5..8], [9, 1, 2, 3], [4, 5, 9, 40]: a prompt that
    // follows the rejected drafts ([4, 5, 6, 7] as block 3) hits three blocks, not four; one
    // that follows the committed tokens hits all four.
    let mut drafted = PROMPT.to_vec();
    drafted.extend([2, 3, 4, 5, 6, 7, 8]);
    let (.., stats, _) = run_on(&mut on.s, draft("b", &drafted, 1), &[0], 100.0).unwrap();
    assert_eq!(stats.local_cached_tokens, 12);
    let mut committed = PROMPT.to_vec();
    committed.extend([2, 3, 4, 5, 9, 40, 8]);
    let (.., stats, _) = run_on(&mut on.s, draft("c", &committed, 1), &[0], 200.0).unwrap();
    assert_eq!(stats.local_cached_tokens, 16);
}

#[test]
fn drafts_stop_at_max_tokens_and_at_the_step_budget() {
    // max_tokens 4: after step 2 the output is [2, 3, 4]; one token remains, so no draft
    // (k <= max_tokens - 1 - generated = 0) and a plain decode ends the request.
    let on = run(config(spec3()), draft("a", &PROMPT, 4), &COPY);
    assert_eq!(chunk(&on.plans[1]).drafts, 1);
    assert_eq!(chunk(&on.plans[2]).drafts, 0);
    assert_eq!(on.output, vec![2, 3, 4, 5]);
    assert_eq!(on.plans.len(), 3);
    // max_tokens 5: two remain at step 3: one draft ([5]), then the token after it.
    let on = run(config(spec3()), draft("a", &PROMPT, 5), &COPY);
    assert_eq!(chunk(&on.plans[2]).drafts, 1);
    assert_eq!(on.output, vec![2, 3, 4, 5, 6]);
    // A step budget of 3 tokens: the prompt takes 4 steps (3 + 3 + 3 + 1), then the drafts
    // fit in budget - 1 = 2.
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 3,
        ..config(spec3())
    };
    let on = run(cfg, draft("a", &PROMPT, 10), &COPY);
    assert_eq!(chunk(&on.plans[3]).num_tokens, 1);
    assert_eq!(chunk(&on.plans[4]).drafts, 1); // block end (one slot after p = 10)
    assert_eq!(chunk(&on.plans[5]).drafts, 2); // budget: [5, 6]
    assert_eq!(chunk(&on.plans[5]).num_tokens, 3);
    assert_eq!(on.output, COPY[..10].to_vec());
}

#[test]
fn a_stop_token_among_accepted_drafts_ends_the_request_there() {
    // Stop at 6: drafts [5, 6, 7] at step 3 are all accepted by the model, but 6 ends the
    // request: 7 and the token after it are dropped, exactly as plain decoding would.
    let mut d = draft("a", &PROMPT, 10);
    d.sampling.stop_token_ids = vec![6];
    let on = run(config(spec3()), d.clone(), &COPY);
    assert_eq!(on.output, vec![2, 3, 4, 5, 6]);
    assert_eq!(on.finish, Some(FinishReason::Stop));
    let off = run(config(None), d, &COPY);
    assert_eq!(off.output, on.output);
    assert_eq!(on.stats, off.stats);
    assert_eq!(on.s.observer().totals(), off.s.observer().totals());
}

/// A stop "string" as the text side's check sees it: the output ends in `tail`.
#[derive(Debug)]
struct EndsWith(Vec<u32>);

impl cachet_core::request::StopStrings for EndsWith {
    fn ends_in_stop(&self, output: &[u32]) -> bool {
        output.ends_with(&self.0)
    }
}

#[test]
fn a_stop_string_completed_among_accepted_drafts_ends_the_request_there() {
    // The stop string is the text of [5, 6]: drafts [5, 6, 7] at step 3 are all accepted, 6
    // completes it, and 7 and the token after it are dropped, as plain decoding ends: same
    // output, generation tokens and cache stats, whatever the speculation.
    let mut d = draft("a", &PROMPT, 10);
    d.sampling.stop_strings = Some(cachet_core::request::StopCheck::new(EndsWith(vec![5, 6])));
    let on = run(config(spec3()), d.clone(), &COPY);
    assert_eq!(on.output, vec![2, 3, 4, 5, 6]);
    assert_eq!(on.finish, Some(FinishReason::Stop));
    assert_eq!(chunk(&on.plans[2]).drafts, 3);
    let off = run(config(None), d, &COPY);
    assert_eq!(off.output, on.output);
    assert_eq!(off.finish, on.finish);
    assert_eq!(on.stats, off.stats);
    assert_eq!(on.s.observer().totals(), off.s.observer().totals());
    assert_eq!(on.s.observer().totals().generation_tokens, 5);
}

/// A stop check that fires at every token from `0` up (a stop "string" that occurs often).
#[derive(Debug)]
struct AtLeast(u32);

impl cachet_core::request::StopStrings for AtLeast {
    fn ends_in_stop(&self, output: &[u32]) -> bool {
        output.last().is_some_and(|&t| t >= self.0)
    }
}

#[test]
fn min_tokens_holds_back_stop_strings_as_it_holds_back_stop_tokens() {
    // COPY's outputs are 2, 3, 4, 5, 6, 7, 50, ...: a stop string may end the request only at
    // a token after the first `min_tokens` (the output counting that token is longer than
    // `min_tokens`), and a match that ended earlier never counts later.
    let cases: [(cachet_core::request::StopCheck, u32, &[u32], FinishReason); 5] = [
        // Fires at 5 (the 4th token) without a minimum.
        (
            cachet_core::request::StopCheck::new(AtLeast(5)),
            0,
            &[2, 3, 4, 5],
            FinishReason::Stop,
        ),
        // The 4th token may not end it with min_tokens 4: the 5th (6) does.
        (
            cachet_core::request::StopCheck::new(AtLeast(5)),
            4,
            &[2, 3, 4, 5, 6],
            FinishReason::Stop,
        ),
        (
            cachet_core::request::StopCheck::new(AtLeast(5)),
            5,
            &[2, 3, 4, 5, 6, 7],
            FinishReason::Stop,
        ),
        // [5, 6] begins within the minimum and ends at the 5th token: it counts.
        (
            cachet_core::request::StopCheck::new(EndsWith(vec![5, 6])),
            4,
            &[2, 3, 4, 5, 6],
            FinishReason::Stop,
        ),
        // It ends at the 5th token, within min_tokens 5, and never again: max_tokens (10).
        (
            cachet_core::request::StopCheck::new(EndsWith(vec![5, 6])),
            5,
            &COPY[..10],
            FinishReason::Length,
        ),
    ];
    for (stop, min_tokens, want, why) in cases {
        let mut d = draft("a", &PROMPT, 10);
        d.sampling.min_tokens = min_tokens;
        d.sampling.stop_strings = Some(stop);
        for spec in [None, spec3()] {
            let r = run(config(spec), d.clone(), &COPY);
            assert_eq!(r.output, want, "min_tokens {min_tokens}");
            assert_eq!(r.finish, Some(why), "min_tokens {min_tokens}");
            assert_eq!(r.s.observer().totals().generation_tokens, want.len() as u64);
        }
    }
}

#[test]
fn no_drafts_for_constrained_forked_or_prompt_logprob_requests_in_prefill() {
    // n = 2: the first step forks; afterwards both sequences may speculate (one sequence
    // each). In the prefill step no chunk carries drafts.
    let mut d = draft("a", &PROMPT, 6);
    d.n = 2;
    let seed = HashSeed::new(&[9; 32], 4, "test");
    let mut s = Scheduler::new(config(spec3()), seed, Recorder::new(4));
    let v = s.config().limits().validate(d).unwrap();
    s.add_request(1, 0.0, v).unwrap();
    let plan = s.schedule(1.0, None);
    assert_eq!(plan.chunks[0].drafts, 0);
    let batch = s.exec_batch(&plan);
    assert!(batch.seqs[0].sample.as_ref().unwrap().drafts.is_empty());
    drop(batch);
    let mut res = scripted(&COPY, &s.exec_batch(&plan));
    res.forks.push((0, vec![Sampled::token(2)]));
    s.update(&plan, res, 1.0);
    let plan = s.schedule(2.0, None);
    assert_eq!(plan.chunks.len(), 2);
    assert!(plan.chunks.iter().all(|c| c.drafts == 1));
    // A constrained request never gets drafts.
    #[derive(Debug)]
    struct Any;
    impl cachet_core::request::TokenConstraint for Any {
        fn allows(&self, _: u32) -> bool {
            true
        }
        fn fill_mask(&self, m: &mut Vec<u32>) {
            m.clear();
        }
        fn accept(&self, _: u32) {}
        fn fork(&self) -> cachet_core::request::Constraint {
            cachet_core::request::Constraint::new(Any)
        }
    }
    let mut d = draft("c", &PROMPT, 10);
    d.sampling.constraint = Some(cachet_core::request::Constraint::new(Any));
    let on = run(config(spec3()), d, &COPY);
    assert!(on.plans.iter().all(|p| p.chunks[0].drafts == 0));
    assert_eq!(on.output, COPY[..10].to_vec());
}

#[test]
fn spec_counters_are_per_request_and_per_step() {
    let seed = HashSeed::new(&[9; 32], 4, "test");
    let mut s = Scheduler::new(config(spec3()), seed, Recorder::new(4));
    let v = s
        .config()
        .limits()
        .validate(draft("a", &PROMPT, 10))
        .unwrap();
    let slot = s.add_request(1, 0.0, v).unwrap();
    let mut per_step = Vec::new();
    for t in 1..=3 {
        let plan = s.schedule(t as f64, None);
        let res = scripted(&COPY, &s.exec_batch(&plan));
        s.update(&plan, res, t as f64);
        per_step.push(s.take_spec_stats());
    }
    // Step 1 prefill: nothing; step 2: one draft of 1, accepted; step 3: 3 of 3.
    assert!(per_step[0].is_zero());
    assert_eq!(
        (per_step[1].num_drafts, per_step[1].num_draft_tokens),
        (1, 1)
    );
    assert_eq!(per_step[1].accepted_per_pos, vec![1]);
    assert_eq!(per_step[2].num_accepted_tokens, 3);
    assert_eq!(per_step[2].accepted_per_pos, vec![1, 1, 1]);
    assert_eq!(
        s.spec_counts(slot),
        Some(SpecDecodeCounts {
            num_drafts: 2,
            num_draft_tokens: 4,
            num_accepted_tokens: 4
        })
    );
}

fn counts(num_drafts: u64, num_draft_tokens: u64, num_accepted_tokens: u64) -> SpecDecodeCounts {
    SpecDecodeCounts {
        num_drafts,
        num_draft_tokens,
        num_accepted_tokens,
    }
}

/// One final update: (handle, seq) and its `spec_decode`.
type Final = ((u64, u32), Option<SpecDecodeCounts>);

/// Runs every request added to `s` to its end with `script`; returns each final update's
/// `spec_decode` by (handle, seq) and the sum of the per-step counters.
fn finals(
    s: &mut Scheduler<Recorder>,
    script: &[u32],
    forks: Option<Vec<u32>>,
) -> (Vec<Final>, SpecDecodeStats) {
    let mut out = Vec::new();
    let mut sum = SpecDecodeStats::default();
    let mut t = 0.0;
    let mut forks = forks;
    while s.has_unfinished() {
        t += 1.0;
        let plan = s.schedule(t, None);
        let mut res = scripted(script, &s.exec_batch(&plan));
        if let Some(f) = forks.take() {
            res.forks
                .push((0, f.into_iter().map(Sampled::token).collect()));
        }
        for u in s.update(&plan, res, t) {
            if u.finish.is_some() {
                out.push(((u.handle, u.seq), u.spec_decode));
            } else {
                assert_eq!(u.spec_decode, None, "counts only on the final update");
            }
        }
        let d = s.take_spec_stats();
        sum.num_drafts += d.num_drafts;
        sum.num_draft_tokens += d.num_draft_tokens;
        sum.num_accepted_tokens += d.num_accepted_tokens;
    }
    out.sort_by_key(|x| x.0);
    (out, sum)
}

fn scheduler(spec: Option<SpecConfig>) -> Scheduler<Recorder> {
    let seed = HashSeed::new(&[9; 32], 4, "test");
    Scheduler::new(config(spec), seed, Recorder::new(4))
}

fn add(s: &mut Scheduler<Recorder>, handle: u64, d: RequestDraft) -> u32 {
    let v = s.config().limits().validate(d).unwrap();
    s.add_request(handle, 0.0, v).unwrap()
}

#[test]
fn the_final_update_carries_the_requests_own_counts() {
    // COPY, 10 tokens: step 2 drafts [3] (accepted), step 3 [5, 6, 7] (all accepted), then
    // nothing recurs: 2 drafts, 4 draft tokens, 4 accepted.
    let mut s = scheduler(spec3());
    add(&mut s, 1, draft("a", &PROMPT, 10));
    let (f, sum) = finals(&mut s, &COPY, None);
    assert_eq!(f, vec![((1, 0), Some(counts(2, 4, 4)))]);
    assert_eq!(
        (
            sum.num_drafts,
            sum.num_draft_tokens,
            sum.num_accepted_tokens
        ),
        (2, 4, 4)
    );

    // The rejecting script, 8 tokens: [3] accepted at p = 10; [5, 6, 7] at p = 12 accepts 5
    // (then 9); at p = 14 (token 9, one slot left in block 12..15) the 1-gram [9] recurs at 8
    // and drafts [1], which the model rejects (40); then 40, 41, 42 recur nowhere.
    // 3 drafts, 1 + 3 + 1 = 5 draft tokens, 1 + 1 + 0 = 2 accepted.
    let script = [2, 3, 4, 5, 9, 40, 41, 42, 43, 44];
    let mut s = scheduler(spec3());
    add(&mut s, 1, draft("a", &PROMPT, 8));
    let (f, _) = finals(&mut s, &script, None);
    assert_eq!(f, vec![((1, 0), Some(counts(3, 5, 2)))]);

    // Speculation off: no counts at all.
    let mut s = scheduler(None);
    add(&mut s, 1, draft("a", &PROMPT, 10));
    let (f, sum) = finals(&mut s, &COPY, None);
    assert_eq!(f, vec![((1, 0), None)]);
    assert!(sum.is_zero());
}

#[test]
fn concurrent_and_forked_sequences_each_count_their_own_drafts_and_sum_to_the_counters() {
    let mut s = scheduler(spec3());
    // Two requests in one batch with the same script: each gets the single-request counts.
    // A third with max_tokens 3 ends after [2, 3, 4]: one draft [3], accepted (its p = 10
    // block has one slot), and after 3 one token remains: no draft.
    add(&mut s, 1, draft("a", &PROMPT, 10));
    add(&mut s, 2, draft("b", &PROMPT, 10));
    add(&mut s, 3, draft("c", &PROMPT, 3));
    let (f, sum) = finals(&mut s, &COPY, None);
    assert_eq!(
        f,
        vec![
            ((1, 0), Some(counts(2, 4, 4))),
            ((2, 0), Some(counts(2, 4, 4))),
            ((3, 0), Some(counts(1, 1, 1))),
        ]
    );
    let total = f
        .iter()
        .filter_map(|x| x.1)
        .fold(counts(0, 0, 0), |mut a, c| {
            a.accumulate(&c);
            a
        });
    assert_eq!(
        (
            sum.num_drafts,
            sum.num_draft_tokens,
            sum.num_accepted_tokens
        ),
        (
            total.num_drafts,
            total.num_draft_tokens,
            total.num_accepted_tokens
        )
    );
    assert_eq!(total, counts(5, 9, 9));

    // n = 2, the fork's draw is 2 as well: both sequences then follow COPY on their own
    // (the script indexes by output length) and count the same drafts, each its own.
    let mut s = scheduler(spec3());
    let mut d = draft("a", &PROMPT, 10);
    d.n = 2;
    add(&mut s, 7, d);
    let (f, sum) = finals(&mut s, &COPY, Some(vec![2]));
    assert_eq!(
        f,
        vec![
            ((7, 0), Some(counts(2, 4, 4))),
            ((7, 1), Some(counts(2, 4, 4)))
        ]
    );
    assert_eq!(sum.num_draft_tokens, 8);
}

#[test]
fn an_aborted_request_reports_the_drafts_verified_before_the_abort() {
    let mut s = scheduler(spec3());
    let slot = add(&mut s, 1, draft("a", &PROMPT, 10));
    for t in 1..=3 {
        let plan = s.schedule(t as f64, None);
        let res = scripted(&COPY, &s.exec_batch(&plan));
        s.update(&plan, res, t as f64);
    }
    // After three steps: [3] then [5, 6, 7], all accepted.
    let u = s.finish(slot, FinishReason::Abort, 4.0).unwrap();
    assert_eq!(u.finish, Some(FinishReason::Abort));
    assert_eq!(u.spec_decode, Some(counts(2, 4, 4)));
}

/// A prompt with one 10 (followed by 4), and an output that says 10 every other token and a
/// fresh token (100, 101, ...) in between: after each 10 the lookup finds the previous 10 and
/// proposes what followed it, which the model never says again. Every draft is rejected.
const LONE: [u32; 6] = [1, 2, 3, 10, 4, 5];

fn rejecting_script(len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| if i % 2 == 0 { 10 } else { 100 + i / 2 })
        .collect()
}

/// Steps (1-based, the prefill is step 1) whose chunk carried drafts.
fn drafting_steps(r: &Run) -> Vec<usize> {
    r.plans
        .iter()
        .enumerate()
        .filter(|(_, p)| p.chunks[0].drafts > 0)
        .map(|(i, _)| i + 1)
        .collect()
}

#[test]
fn a_request_whose_drafts_keep_failing_drafts_exponentially_less_often() {
    let script = rejecting_script(48);
    let spec = |b| {
        Some(SpecConfig {
            adaptive: b,
            ..spec3().unwrap()
        })
    };
    // 40 tokens, one per step: step 1 samples 10, and every even step has a 10 last, so a
    // proposal. Without the backoff each is drafted: steps 2, 4, ..., 38, 19 drafts (at step
    // 40 one token remains: no room for a draft).
    let plain = run(config(spec(false)), draft("a", &LONE, 40), &script);
    assert_eq!(
        drafting_steps(&plain),
        (2..=38).step_by(2).collect::<Vec<_>>()
    );
    // With it: step 2 drafts (miss 1, no skip), step 4 (miss 2: skip 1 proposal, step 6),
    // step 8 (miss 3: skip 3: 10, 12, 14), step 16 (miss 4: skip 7: 18..=30), step 32 (miss
    // 5: skip 15, past the end).
    let on = run(config(spec(true)), draft("a", &LONE, 40), &script);
    assert_eq!(drafting_steps(&on), vec![2, 4, 8, 16, 32]);
    // Nothing else changes: the same 40 tokens in 40 steps, as plain decoding.
    let off = run(config(None), draft("a", &LONE, 40), &script);
    assert_eq!(on.output, script[..40].to_vec());
    assert_eq!(plain.output, on.output);
    assert_eq!(off.output, on.output);
    assert_eq!((on.plans.len(), plain.plans.len()), (40, 40));
    assert_eq!(on.stats, off.stats);
    // Draft lengths: the proposal is `[4, 5, 10]` at step 2 and `[previous fresh token, 10]`
    // after (it runs to the end of the context), capped by the room left in p's block of 4:
    // at step 2j, p = 2j + 4, so 1 slot left when j is odd (p = 6, 10, ...) and 3 when it is
    // even (p = 8, 12, ...). Fixed drafts: 1, 2, 1, 2, ... Adaptive: the step-2 draft's
    // rejection (0 of 1 accepted, nothing ever accepted) limits the next ones to 0 + 1 = 1
    // token, and nothing is ever accepted to raise it.
    let sizes = |r: &Run| -> Vec<usize> {
        r.plans
            .iter()
            .map(|p| p.chunks[0].drafts)
            .filter(|&d| d > 0)
            .collect()
    };
    let fixed_sizes: Vec<usize> = (1..=19).map(|j| if j % 2 == 1 { 1 } else { 2 }).collect();
    assert_eq!(sizes(&plain), fixed_sizes);
    assert_eq!(sizes(&on), vec![1; 5]);
    // The final update's counts: 5 drafts, 5 draft tokens, none accepted (fixed: 19 drafts,
    // 10 x 1 + 9 x 2 = 28 tokens).
    let mut s = scheduler(spec(true));
    add(&mut s, 1, draft("a", &LONE, 40));
    let (f, _) = finals(&mut s, &script, None);
    assert_eq!(f, vec![((1, 0), Some(counts(5, 5, 0)))]);
    let mut s = scheduler(spec(false));
    add(&mut s, 1, draft("a", &LONE, 40));
    let (f, _) = finals(&mut s, &script, None);
    assert_eq!(f, vec![((1, 0), Some(counts(19, 28, 0)))]);
}

#[test]
fn after_a_partial_acceptance_drafts_are_shorter_until_one_is_taken_whole() {
    // Blocks of 8, K = 5, PROMPT [1..9, 1]. The output copies the prompt twice, each time
    // leaving it after two or three tokens: 2, 3, 4, 50, 60, 61, 1, 2, 3, 4, 70, 71, ...
    let script = [
        2, 3, 4, 50, 60, 61, 1, 2, 3, 4, 70, 71, 72, 73, 74, 75, 76, 77,
    ];
    let run_with = |adaptive| {
        let cfg = SchedulerConfig {
            block_size: 8,
            speculative: Some(SpecConfig {
                num_speculative_tokens: 5,
                prompt_lookup_min: 1,
                prompt_lookup_max: 4,
                adaptive,
            }),
            ..config(None)
        };
        run(cfg, draft("a", &PROMPT, 14), &script)
    };
    let per_step = |r: &Run| -> Vec<(usize, usize)> {
        r.plans
            .iter()
            .map(|p| (p.chunks[0].start_pos, p.chunks[0].drafts))
            .collect()
    };
    // Step 2, p = 10 (5 slots left in block 8..15): [1, 2] recurs at 0, drafts [3, 4, 5, 6, 7];
    // 3 and 4 are accepted, then 50. Steps 3 to 5 (p = 13, 14, 15: tokens 50, 60, 61) find
    // nothing. Step 6, p = 16 (token 1, a new block: 7 slots): the most recent earlier 1 is
    // the prompt's last, followed by [2, 3, 4, 50, 60]: fixed drafts take all five and accept
    // 2, 3, 4 (then 70, not 50); adaptive ones, limited by step 2's partial acceptance to
    // 5 - 1 = 4 (more than 2 + 1), draft [2, 3, 4, 50] and accept the same three. The same four
    // tokens either way; then 71, 72, 73.
    let fixed = run_with(false);
    let adaptive = run_with(true);
    let expect = |d6| {
        vec![
            (0, 0),
            (10, 5),
            (13, 0),
            (14, 0),
            (15, 0),
            (16, d6),
            (20, 0),
            (21, 0),
            (22, 0),
        ]
    };
    assert_eq!(per_step(&fixed), expect(5));
    assert_eq!(per_step(&adaptive), expect(4));
    assert_eq!(fixed.output, script[..14].to_vec());
    assert_eq!(adaptive.output, fixed.output);
    assert_eq!(adaptive.per_step, fixed.per_step);
    assert_eq!(adaptive.stats, fixed.stats);
}
