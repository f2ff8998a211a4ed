//! The simulated executor really reads KV through the block table.

use cachet_core::exec::{ExecBatch, Executor, SampleSpec, SeqChunk};
use cachet_core::SamplingParams;
use cachet_engine::sim::{SimConfig, SimExecutor};

fn run_prompt(sim: &mut SimExecutor, tokens: &[u32], start: usize, table: &[u32]) -> u32 {
    step(sim, tokens, tokens.len(), start, table).unwrap()
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

/// One step of a request whose committed tokens are `tokens` (the first `prompt_len` its
/// prompt), computing positions `start..` and sampling the next token.
fn step(
    sim: &mut SimExecutor,
    tokens: &[u32],
    prompt_len: usize,
    start: usize,
    table: &[u32],
) -> Result<u32, cachet_core::exec::ExecError> {
    let params = SamplingParams::greedy(16);
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
                prompt: &tokens[..prompt_len],
                output: &tokens[prompt_len..],
            }),
        }],
    };
    Ok(sim.execute(&batch)?.sampled[0].as_ref().unwrap().token)
}

fn scripted(reply: &[u32]) -> SimExecutor {
    SimExecutor::new(SimConfig {
        num_blocks: 8,
        block_size: 4,
        reply: Some(reply.to_vec()),
        ..Default::default()
    })
}

/// A scripted reply is the output, token by token, then EOS; past it (under `ignore_eos`) the
/// usual draws resume.
#[test]
fn a_scripted_reply_is_emitted_then_eos() {
    // "hi" in the byte tokenizer (byte + 3).
    let reply = [b'h' as u32 + 3, b'i' as u32 + 3];
    let mut sim = scripted(&reply);
    let mut tokens: Vec<u32> = (40..46).collect(); // 6 prompt tokens
    let table = [0, 1, 2];
    let mut out = Vec::new();
    for _ in 0..4 {
        let start = if out.is_empty() { 0 } else { tokens.len() - 1 };
        let t = step(&mut sim, &tokens, 6, start, &table).unwrap();
        out.push(t);
        tokens.push(t);
    }
    assert_eq!(&out[..3], &[107, 108, cachet_engine::sim::SIM_EOS]);
    // The fourth is a draw from the printable range, not part of the script.
    assert!((35..130).contains(&out[3]), "{out:?}");
    // Deterministic: a fresh simulator over a cached prefix gives the same reply.
    let mut again = scripted(&reply);
    let p: Vec<u32> = (40..46).collect();
    assert_eq!(step(&mut again, &p, 6, 0, &[3, 4]).unwrap(), 107);
}

/// With a script the output no longer depends on the KV, so the simulator checks the
/// fingerprints instead: a wrong cached block or one overwritten while shared fails the step.
#[test]
fn a_scripted_simulator_refuses_wrong_and_stale_blocks() {
    let reply = [b'o' as u32 + 3, b'k' as u32 + 3];
    let mut sim = scripted(&reply);
    let prompt: Vec<u32> = (10..20).collect(); // blocks 0, 1 full, 2 partial
    assert_eq!(step(&mut sim, &prompt, 10, 0, &[0, 1, 2]).unwrap(), 114);
    // A correct hit on blocks 0 and 1.
    assert_eq!(step(&mut sim, &prompt, 10, 8, &[0, 1, 3]).unwrap(), 114);
    // Block 4 holds other tokens: served in place of block 1, the step fails at position 4.
    let other: Vec<u32> = (50..60).collect();
    step(&mut sim, &other, 10, 0, &[5, 4, 6]).unwrap();
    let err = step(&mut sim, &prompt, 10, 8, &[0, 4, 7]).unwrap_err();
    assert!(err.to_string().contains("position 4"), "{err}");
    // Block 0 overwritten after the fact: the reader fails at position 0.
    step(&mut sim, &other, 10, 0, &[0, 6, 7]).unwrap();
    let err = step(&mut sim, &prompt, 10, 8, &[0, 1, 3]).unwrap_err();
    assert!(err.to_string().contains("position 0"), "{err}");
}
