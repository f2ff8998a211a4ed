//! Test helpers: a tiny request driver over the executor (block allocation, chunked prefill,
//! greedy decoding) standing in for the core's scheduler.
#![allow(dead_code)]

use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, Executor, SamplingParams, SeqChunk};
use cachet_model::LlamaExecutor;

/// Hands out block ids.
pub struct Blocks {
    next: u32,
    limit: u32,
}

impl Blocks {
    pub fn new(limit: u32) -> Self {
        Blocks { next: 0, limit }
    }
    pub fn alloc(&mut self, n: usize) -> Vec<u32> {
        let v: Vec<u32> = (self.next..self.next + n as u32).collect();
        self.next += n as u32;
        assert!(self.next <= self.limit, "test ran out of KV blocks");
        v
    }
}

/// One request as the driver sees it.
pub struct Req {
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    /// Positions whose KV is in the arena.
    pub computed: usize,
    pub blocks: Vec<u32>,
    pub params: SamplingParams,
}

impl Req {
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        Req {
            prompt,
            output: Vec::new(),
            computed: 0,
            blocks: Vec::new(),
            params,
        }
    }
    pub fn all_tokens(&self) -> Vec<u32> {
        let mut v = self.prompt.clone();
        v.extend_from_slice(&self.output);
        v
    }
    /// Makes sure the block table covers `n` positions.
    pub fn reserve(&mut self, n: usize, block_size: usize, blocks: &mut Blocks) {
        let need = n.div_ceil(block_size);
        if self.blocks.len() < need {
            let extra = blocks.alloc(need - self.blocks.len());
            self.blocks.extend(extra);
        }
    }
}

/// Runs one step for all `reqs`: each computes all its not-yet-computed tokens (at most
/// `max_chunk` of them) and samples when that completes its known tokens. Returns the tokens
/// sampled, per request (None when it only advanced its prefill).
pub fn step(
    exec: &mut LlamaExecutor,
    reqs: &mut [&mut Req],
    max_chunk: usize,
    block_size: usize,
    blocks: &mut Blocks,
) -> Vec<Option<u32>> {
    let mut toks: Vec<Vec<u32>> = Vec::new();
    let mut starts = Vec::new();
    for r in reqs.iter_mut() {
        let all = r.all_tokens();
        let n = (all.len() - r.computed).min(max_chunk);
        r.reserve(r.computed + n, block_size, blocks);
        toks.push(all[r.computed..r.computed + n].to_vec());
        starts.push(r.computed);
    }
    let out = {
        let mut batch = ExecBatch::default();
        for (i, r) in reqs.iter().enumerate() {
            let done = starts[i] + toks[i].len() == r.prompt.len() + r.output.len();
            batch.seqs.push(SeqChunk {
                prompt_logprobs: None,
                slot: i as u32,
                tokens: &toks[i],
                start_pos: starts[i],
                block_table: &r.blocks,
                sample: done.then_some(SampleSpec {
                    forks: &[],
                    drafts: &[],
                    params: &r.params,
                    prompt: &r.prompt,
                    output: &r.output,
                }),
            });
        }
        exec.execute(&batch).expect("execute")
    };
    let mut res = Vec::new();
    for (i, r) in reqs.iter_mut().enumerate() {
        r.computed += toks[i].len();
        match &out.sampled[i] {
            Some(s) => {
                r.output.push(s.token);
                res.push(Some(s.token));
            }
            None => res.push(None),
        }
    }
    res
}

/// Greedy-decodes `n` tokens for each request, all batched together, stopping a request at
/// any of `eos`.
pub fn generate_batched(
    exec: &mut LlamaExecutor,
    reqs: &mut [Req],
    n: usize,
    max_chunk: usize,
    block_size: usize,
    blocks: &mut Blocks,
    eos: &[u32],
) {
    loop {
        let mut active: Vec<&mut Req> = reqs
            .iter_mut()
            .filter(|r| r.output.len() < n && !r.output.last().is_some_and(|t| eos.contains(t)))
            .collect();
        if active.is_empty() {
            break;
        }
        step(exec, &mut active, max_chunk, block_size, blocks);
    }
}
