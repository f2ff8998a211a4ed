//! Prompt logprobs (spec §2 step 3: no cache read, full blocks still written), `max_tokens: 0`,
//! and `n > 1`: one prefill, n sequences forked on the shared prompt blocks with a copy of the
//! partial last block. B = 16. The fake executor draws 7 (fork draw i: 7 + i) and gives prompt
//! target t the logprob -t/100.

mod common;
use common::*;

use cachet_core::FinishReason;

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

#[test]
fn prompt_logprobs_cover_every_token_after_the_first_across_chunks() {
    let mut c = cfg(64, 16);
    c.max_num_batched_tokens = 16; // 40-token prompt: chunks of 16, 16, 8
    let mut s = Core::new(c);
    // Warm the cache with the same prompt: a prompt-logprobs request must not read it.
    s.add(req("warm", toks(100, 40), 1)).unwrap();
    s.run();
    let mut d = req("lp", toks(100, 40), 2);
    d.prompt_logprobs = Some(0);
    let slot = s.add(d).unwrap();
    let mut lps = None;
    let mut t = s.now;
    while s.s.has_unfinished() {
        t += 1.0;
        for u in s.step(t).1 {
            if u.slot == slot && u.prompt_logprobs.is_some() {
                lps = u.prompt_logprobs;
            }
        }
    }
    let lps = lps.expect("on the first-token update");
    let want: Vec<u32> = toks(101, 39);
    assert_eq!(lps.iter().map(|l| l.token).collect::<Vec<_>>(), want);
    assert_eq!(lps[0].logprob, -1.01);
    let st = stats_of(&s.take_finished(), "lp");
    // No lookup (no hit despite the warm cache), 40 computed; its 2 full blocks already exist.
    assert_eq!(fields(&st)[..7], [40, 0, 0, 0, 40, 0, 3]);
    let t = s.totals();
    assert_eq!((t.prefix_cache_queries, t.prefix_cache_hits), (40, 0));
}

#[test]
fn max_tokens_zero_runs_the_prompt_and_generates_nothing() {
    let mut s = Core::new(cfg(64, 16));
    let mut d = req("echo", toks(100, 20), 0);
    d.prompt_logprobs = Some(1);
    let slot = s.add(d).unwrap();
    let (out, ups) = s.step(1.0);
    assert!(!out.chunks[0].sample, "nothing is sampled");
    assert_eq!(ups.len(), 1);
    let u = &ups[0];
    assert_eq!(
        (u.slot, u.finish, u.token.is_none()),
        (slot, Some(FinishReason::Length), true)
    );
    assert_eq!(u.prompt_logprobs.as_ref().unwrap().len(), 19);
    let fin = s.take_finished();
    assert_eq!(fin[0].generation_tokens, 0);
    assert_eq!(fin[0].times.ttft_s(), None);
    assert_eq!(stats_of(&fin, "echo").computed_tokens, 20);
    assert_eq!(s.totals().generation_tokens, 0);
    assert!(!s.s.has_unfinished());
    s.s.check_invariants().unwrap();
}

/// A 40-token prompt, n = 3, 4 tokens each. Step 1 computes the prompt once (3 blocks: 0 and 1
/// full, 2 partial) and draws 7, 8, 9: sequences 1 and 2 share blocks 0 and 1 (ref count 3)
/// and get a block each for their copy of the partial block, copied in step 2's batch.
#[test]
fn n_sequences_share_the_prompt_computed_once() {
    let mut s = Core::new(cfg(64, 16));
    let mut d = req("n3", toks(100, 40), 4);
    d.n = 3;
    let slot = s.add(d).unwrap();
    let (_, ups) = s.step(1.0);
    let firsts: Vec<(u32, u32)> = ups
        .iter()
        .map(|u| (u.seq, u.token.as_ref().unwrap().token))
        .collect();
    assert_eq!(firsts, [(0, 7), (1, 8), (2, 9)]);
    assert!(ups
        .iter()
        .all(|u| u.first_token && u.handle == ups[0].handle));
    let (ptoks, pblocks) = s.s.debug_request(slot).unwrap();
    assert_eq!(ptoks.len(), 41);
    let child = ups[1].slot;
    let (ctoks, cblocks) = s.s.debug_request(child).unwrap();
    assert_eq!(ctoks[..40], ptoks[..40]);
    assert_eq!(cblocks[..2], pblocks[..2]);
    assert_ne!(cblocks[2], pblocks[2]);
    let pool = s.s.kv_manager().pool();
    assert_eq!(pool.ref_count(pblocks[0]), 3);
    // Step 2: the copies come first in the plan, the three sequences decode.
    let (out, _) = s.step(2.0);
    assert_eq!(out.copies.len(), 2);
    assert!(out.copies.contains(&(pblocks[2], cblocks[2])));
    assert_eq!(out.chunks.len(), 3);
    let fin = s.run();
    assert_eq!(fin.len(), 3);
    assert!(fin.iter().all(|f| f.generation_tokens == 4));
    // The prompt was computed once: one request's prefill stats, the others have none.
    let with_stats: Vec<_> = fin.iter().filter_map(|f| f.prefill_stats).collect();
    assert_eq!(with_stats.len(), 1);
    assert_eq!(fields(&with_stats[0])[..6], [40, 0, 0, 0, 40, 32]);
    let t = s.totals();
    assert_eq!((t.prompt_tokens, t.generation_tokens), (40, 12));
    // 3 blocks for the prompt, 1 copy block each for the two forks.
    assert_eq!(t.blocks_allocated, 5);
    s.s.check_invariants().unwrap();
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
}

#[test]
fn aborting_a_forked_request_ends_every_sequence() {
    let mut s = Core::new(cfg(64, 16));
    let mut d = req("n2", toks(100, 20), 50);
    d.n = 2;
    let slot = s.add(d).unwrap();
    let (_, ups) = s.step(1.0);
    let child = ups[1].slot;
    s.step(2.0);
    // What the engine does for an abort of the request's handle: finish every slot of it.
    assert!(s.s.finish(slot, FinishReason::Abort, 3.0).is_some());
    assert!(s.s.finish(child, FinishReason::Abort, 3.0).is_some());
    assert!(!s.s.has_unfinished());
    s.s.check_invariants().unwrap();
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
}

/// Each update's (sequence, token, finish).
fn firsts(ups: &[cachet_core::scheduler::RequestUpdate]) -> Vec<(u32, u32, Option<FinishReason>)> {
    ups.iter()
        .map(|u| (u.seq, u.token.as_ref().unwrap().token, u.finish))
        .collect()
}

/// n = 3 with max_tokens 1: every sequence ends with its first token (7, 8, 9), all three
/// counted; the forks' copies of the partial block are dropped with them (nothing is copied
/// in the next batch) and every block is free again.
#[test]
fn n_sequences_of_one_token_each_all_end_with_their_first() {
    let mut s = Core::new(cfg(64, 16));
    let mut d = req("n3", toks(100, 40), 1);
    d.n = 3;
    s.add(d).unwrap();
    let (_, ups) = s.step(1.0);
    let got = firsts(&ups);
    let l = Some(FinishReason::Length);
    assert_eq!(got, [(0, 7, l), (1, 8, l), (2, 9, l)]);
    assert!(!s.s.has_unfinished());
    let fin = s.take_finished();
    assert_eq!(fin.len(), 3);
    assert!(fin.iter().all(|f| f.generation_tokens == 1));
    let t = s.totals();
    assert_eq!(t.generation_tokens, 3);
    // 3 blocks for the prompt, 1 copy block each for the two forks.
    assert_eq!(t.blocks_allocated, 5);
    s.s.check_invariants().unwrap();
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
    s.add(req("next", toks(200, 8), 1)).unwrap();
    let (out, _) = s.step(2.0);
    assert!(out.copies.is_empty(), "{:?}", out.copies);
}

/// n = 2 whose first sequence stops on its first token (7, a stop token): the second still
/// forks from the prompt, copies the partial block the first has freed (in the next batch,
/// before anything is written), and runs on: 8, then 7 ends it.
#[test]
fn a_sequence_ending_with_its_first_token_still_forks_the_others() {
    let mut s = Core::new(cfg(64, 16));
    let mut d = req("n2", toks(100, 40), 4);
    d.n = 2;
    d.sampling.stop_token_ids = vec![7];
    s.add(d).unwrap();
    let (_, ups) = s.step(1.0);
    let got = firsts(&ups);
    assert_eq!(got, [(0, 7, Some(FinishReason::Stop)), (1, 8, None)]);
    let child = ups[1].slot;
    let (_, cblocks) = s.s.debug_request(child).unwrap();
    let (out, ups) = s.step(2.0);
    assert_eq!(out.copies.len(), 1);
    assert_eq!(out.copies[0].1, cblocks[2]);
    assert_eq!(ups[0].finish, Some(FinishReason::Stop));
    let fin = s.take_finished();
    let mut gen: Vec<u64> = fin.iter().map(|f| f.generation_tokens).collect();
    gen.sort();
    assert_eq!(gen, [1, 2]);
    assert!(!s.s.has_unfinished());
    s.s.check_invariants().unwrap();
    assert_eq!(s.s.kv_manager().pool().num_free(), 64);
}

/// A constraint that allows everything; its forks are new values (told apart by pointer).
#[derive(Debug)]
struct Free;

impl cachet_core::request::TokenConstraint for Free {
    fn allows(&self, _: u32) -> bool {
        true
    }
    fn fill_mask(&self, m: &mut Vec<u32>) {
        m.clear();
    }
    fn accept(&self, _: u32) {}
    fn fork(&self) -> cachet_core::request::Constraint {
        cachet_core::request::Constraint::new(Free)
    }
}

/// n = 3 with a seed and a constraint: the first step's draws 1 and 2 use sampling of their
/// own (seeds 41 and 42, a constraint each, not the first sequence's), and those become the
/// forked sequences' own in every later step.
#[test]
fn each_forked_sequence_samples_with_its_own_seed_and_constraint() {
    let mut s = Core::new(cfg(64, 16));
    let mut d = req("n3", toks(100, 40), 3);
    d.n = 3;
    d.sampling.seed = Some(40);
    let c0 = cachet_core::request::Constraint::new(Free);
    d.sampling.constraint = Some(c0.clone());
    s.add(d).unwrap();
    let plan = s.s.schedule(1.0, None);
    let batch = s.s.exec_batch(&plan);
    let spec = batch.seqs[0].sample.as_ref().unwrap();
    assert_eq!(spec.params.seed, Some(40));
    assert_eq!(spec.params.constraint.as_ref(), Some(&c0));
    let forks: Vec<(Option<u64>, cachet_core::request::Constraint)> = spec
        .forks
        .iter()
        .map(|p| (p.seed, p.constraint.clone().unwrap()))
        .collect();
    assert_eq!(
        forks.iter().map(|f| f.0).collect::<Vec<_>>(),
        [Some(41), Some(42)]
    );
    assert!(forks[0].1 != c0 && forks[1].1 != c0 && forks[0].1 != forks[1].1);
    let res = fake_execute(&batch);
    drop(batch);
    s.s.update(&plan, res, 1.0);
    let plan = s.s.schedule(2.0, None);
    let batch = s.s.exec_batch(&plan);
    // Sequence 0 keeps its own; sequence i has draw i's (seed 40 + i, that constraint).
    let mut got: Vec<(Option<u64>, cachet_core::request::Constraint)> = batch
        .seqs
        .iter()
        .map(|q| {
            let p = q.sample.as_ref().unwrap();
            assert!(p.forks.is_empty());
            (p.params.seed, p.params.constraint.clone().unwrap())
        })
        .collect();
    got.sort_by_key(|g| g.0);
    let mut want = vec![(Some(40), c0)];
    want.extend(forks);
    assert_eq!(got, want);
}
