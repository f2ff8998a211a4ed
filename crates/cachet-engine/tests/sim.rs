//! The simulated executor really reads KV through the block table.

use cachet_core::exec::{ExecBatch, Executor, SampleSpec, SeqChunk};
use cachet_core::SamplingParams;
use cachet_engine::sim::{SimConfig, SimExecutor};

fn run_prompt(sim: &mut SimExecutor, tokens: &[u32], start: usize, table: &[u32]) -> u32 {
    let params = SamplingParams::greedy(1);
    let batch = ExecBatch {
        copies: Vec::new(),
        loads: Vec::new(),
        seqs: vec![SeqChunk {
            prompt_logprobs: None,
            slot: 0,
            tokens: &tokens[start..],
            start_pos: start,
            block_table: table,
            sample: Some(SampleSpec {
                forks: &[],
                drafts: &[],
                params: &params,
                prompt: tokens,
                output: &[],
            }),
        }],
    };
    sim.execute(&batch).unwrap().sampled[0]
        .as_ref()
        .unwrap()
        .token
}

#[test]
fn correct_cached_blocks_give_the_same_token_and_wrong_ones_do_not() {
    let mut sim = SimExecutor::new(SimConfig {
        num_blocks: 8,
        block_size: 4,
        ..Default::default()
    });
    let prompt: Vec<u32> = (10..20).collect(); // 10 tokens: blocks 0, 1 full, 2 partial
    let cold = run_prompt(&mut sim, &prompt, 0, &[0, 1, 2]);
    // A hit on blocks 0, 1 with the suffix computed into a fresh block: same token.
    let hit = run_prompt(&mut sim, &prompt, 8, &[0, 1, 3]);
    assert_eq!(cold, hit);
    // Other tokens in block 4, then served "from the cache" instead of block 1: the chain
    // differs, so does the output.
    let other: Vec<u32> = (50..60).collect();
    run_prompt(&mut sim, &other, 0, &[5, 4, 6]);
    let wrong = run_prompt(&mut sim, &prompt, 8, &[0, 4, 7]);
    assert_ne!(cold, wrong);
    // A shared block overwritten after the fact changes the output of its reader.
    run_prompt(&mut sim, &other, 0, &[1, 6, 7]);
    let stale = run_prompt(&mut sim, &prompt, 8, &[0, 1, 3]);
    assert_ne!(cold, stale);
}

#[test]
fn eos_at_output_is_deterministic() {
    let mut sim = SimExecutor::new(SimConfig {
        num_blocks: 8,
        block_size: 4,
        eos_at_output: Some(1),
        ..Default::default()
    });
    let prompt: Vec<u32> = (10..14).collect();
    assert_eq!(
        run_prompt(&mut sim, &prompt, 0, &[0]),
        cachet_engine::sim::SIM_EOS
    );
}
