//! `n > 1` and prompt logprobs through the engine on the simulated executor, whose output is a
//! function of every KV fingerprint of the context read back through the block table: a forked
//! sequence whose copy of the shared partial block were wrong (or not copied before the parent
//! wrote into its own) would continue differently from a fresh request with the same tokens.

use cachet_core::{FinishReason, RequestDraft, SamplingParams, SchedulerConfig};
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::step::{CoreOptions, EngineCore};

const B: usize = 16;

fn core() -> EngineCore<SimExecutor> {
    let cfg = SchedulerConfig {
        block_size: B,
        num_blocks: 64,
        ..Default::default()
    };
    let sim = SimExecutor::new(SimConfig {
        num_blocks: 64,
        block_size: B,
        ..Default::default()
    });
    EngineCore::new(cfg, sim, CoreOptions::default())
}

fn draft(prompt: Vec<u32>, max_tokens: u32) -> RequestDraft {
    RequestDraft::new(
        "r",
        prompt,
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    )
}

/// Runs everything to the end; returns each sequence's tokens, by `seq`.
fn run(core: &mut EngineCore<SimExecutor>, d: RequestDraft, handle: u64) -> Vec<Vec<u32>> {
    let n = d.n as usize;
    let v = core.scheduler().config().limits().validate(d).unwrap();
    core.add_request(handle, 0.0, v).unwrap();
    let mut out = vec![Vec::new(); n];
    let mut t = 0.0;
    while core.scheduler().has_unfinished() {
        t += 1.0;
        let tt = t;
        for u in core.step(|| tt).unwrap() {
            if let Some(tok) = &u.token {
                out[u.seq as usize].push(tok.token);
            }
            if u.finish.is_some() {
                assert_eq!(u.finish, Some(FinishReason::Length));
            }
        }
    }
    out
}

#[test]
fn forked_sequences_continue_exactly_as_fresh_requests_with_their_tokens() {
    // 40 tokens: the partial block [32, 40) is shared until the fork copies it.
    let prompt: Vec<u32> = (0..40).map(|i| 40 + i % 60).collect();
    let mut d = draft(prompt.clone(), 6);
    d.n = 3;
    let mut c = core();
    let seqs = run(&mut c, d, 1);
    assert_eq!(seqs.len(), 3);
    assert!(seqs.iter().all(|s| s.len() == 6));
    // The three first draws differ (independent draws), so the sequences differ.
    assert!(seqs[0][0] != seqs[1][0] || seqs[1][0] != seqs[2][0]);
    for (i, s) in seqs.iter().enumerate() {
        // A fresh engine, prompt + this sequence's first token: the same continuation.
        let mut fresh = core();
        let mut p = prompt.clone();
        p.push(s[0]);
        let f = run(&mut fresh, draft(p, 5), 9);
        assert_eq!(f[0], s[1..], "sequence {i}");
    }
    c.scheduler().check_invariants().unwrap();
    assert_eq!(c.scheduler().kv_manager().pool().num_free(), 64);
}

#[test]
fn prompt_logprobs_arrive_with_the_first_token_and_the_cache_is_still_written() {
    let prompt: Vec<u32> = (0..40).map(|i| 40 + i % 60).collect();
    let mut c = core();
    let mut d = draft(prompt.clone(), 2);
    d.prompt_logprobs = Some(2);
    let v = c.scheduler().config().limits().validate(d).unwrap();
    c.add_request(1, 0.0, v).unwrap();
    let mut lps = None;
    for step in 1..10 {
        for u in c.step(|| step as f64).unwrap() {
            if let Some(l) = u.prompt_logprobs {
                assert!(u.first_token);
                lps = Some(*l);
            }
        }
    }
    let lps = lps.unwrap();
    assert_eq!(lps.len(), 39);
    assert_eq!(
        lps.iter().map(|l| l.token).collect::<Vec<_>>(),
        prompt[1..].to_vec()
    );
    assert!(lps
        .iter()
        .all(|l| l.logprob < 0.0 && l.top_logprobs.len() == 2));
    // Not read, but written: a plain request now hits the 2 full blocks.
    let v = c
        .scheduler()
        .config()
        .limits()
        .validate(draft(prompt, 1))
        .unwrap();
    c.add_request(2, 0.0, v).unwrap();
    let mut hit = None;
    for step in 10..20 {
        for u in c.step(|| step as f64).unwrap() {
            if let Some(r) = &u.report {
                hit = r.prefill_stats.map(|p| p.local_cached_tokens);
            }
        }
    }
    assert_eq!(hit, Some(32));
}
