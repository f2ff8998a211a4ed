//! The boundary between the core and a model.
//!
//! Each engine step the scheduler produces one [`ExecBatch`]: the blocks to fill with KV loaded
//! from an external tier, and for every scheduled request the tokens whose KV must be computed
//! this step, their starting position and the request's block table. The executor first writes
//! every load into its block, then writes each computed token's K/V into slot
//! `pos % block_size` of block `block_table[pos / block_size]` of its arena, attends over the
//! whole table (cached and loaded context included, causal within the chunk), and samples a
//! token for the chunks that ask for one.
//!
//! A block's KV leaves and enters the executor as opaque bytes ([`Executor::save_block`],
//! [`BlockLoad`]) in the executor's own layout, which [`Executor::kv_layout`] names; a tier keys
//! and checks values by that name, so bytes are only ever loaded into an executor of the same
//! layout.

use thiserror::Error;

use crate::request::SamplingParams;
use crate::{BlockId, TokenId};

/// What the executor must do for one request this step.
#[derive(Debug)]
pub struct SeqChunk<'a> {
    /// Index of this request's slot in the scheduler: stable while the request lives.
    pub slot: u32,
    /// Tokens whose KV is computed this step (positions `start_pos..start_pos + tokens.len()`).
    pub tokens: &'a [TokenId],
    pub start_pos: usize,
    /// Covers at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [BlockId],
    /// `Some` when this chunk completes the known tokens: sample the next one from the logits of
    /// the last position. Only these positions need the lm_head.
    pub sample: Option<SampleSpec<'a>>,
    /// `Some` for a prompt chunk of a request that asked for prompt logprobs: the logits of
    /// every position of the chunk are needed too.
    pub prompt_logprobs: Option<PromptLogprobsSpec<'a>>,
}

/// Prompt logprobs of one chunk: the log-probability, under the model's distribution at
/// position `start_pos + j`, of `targets[j]` (the prompt token at `start_pos + j + 1`), with the
/// `top` most likely alternatives.
#[derive(Debug)]
pub struct PromptLogprobsSpec<'a> {
    pub targets: &'a [TokenId],
    pub top: u32,
}

/// What a sampler needs for one request.
#[derive(Debug)]
pub struct SampleSpec<'a> {
    pub params: &'a SamplingParams,
    pub prompt: &'a [TokenId],
    /// Tokens generated so far (for penalties and for a seeded draw's position).
    pub output: &'a [TokenId],
    /// Further independent draws from these logits, one per entry, each with its own
    /// sampling (n > 1 forks a request into n sequences at its first token: draw `i` uses
    /// `forks[i - 1]`, with the seed `params.seed + i` and its own constraint). Empty almost
    /// always.
    pub forks: &'a [SamplingParams],
    /// Speculative decoding: draft tokens `d1..dk`, which are also the chunk's last `k` tokens
    /// (the chunk is `[last token, d1..dk]` at positions `p..=p+k`; empty without drafts, and
    /// always with `n > 1`). The executor computes the logits of all `k + 1` positions in the
    /// one forward and samples position 0 as usual; while the token sampled at position `j`
    /// equals `d(j+1)` it samples position `j + 1` too, with `d1..d(j+1)` counted as output
    /// (penalties, a seeded draw's position). The first token is [`ExecOutput::sampled`], the
    /// others [`ExecOutput::spec`]: each is a draw from the model given the committed prefix,
    /// so greedy output equals plain decoding and sampled output is distributed as it.
    pub drafts: &'a [TokenId],
}

/// KV bytes an executor must write into a block before it runs the step's chunks.
#[derive(Debug)]
pub struct BlockLoad<'a> {
    pub block: BlockId,
    /// Exactly [`Executor::block_bytes`] bytes, as [`Executor::save_block`] wrote them.
    pub data: &'a [u8],
}

/// One engine step's work.
#[derive(Debug, Default)]
pub struct ExecBatch<'a> {
    /// Block-to-block copies, done first (copy-on-write of a forked request's partial block):
    /// `(source, destination)`.
    pub copies: Vec<(BlockId, BlockId)>,
    /// Written next, in order.
    pub loads: Vec<BlockLoad<'a>>,
    pub seqs: Vec<SeqChunk<'a>>,
}

/// An emptied batch vector, to be filled again in a later step ([`Scheduler::exec_batch_in`]):
/// the same allocation, free of the borrows of the step it held (no element is kept, so none
/// outlives what it borrowed; the standard library collects an emptied vector into one of the
/// same layout in place).
///
/// [`Scheduler::exec_batch_in`]: crate::Scheduler::exec_batch_in
// (`filter_map`, not `filter`: the element type changes, its borrows' lifetime.)
#[allow(clippy::unnecessary_filter_map)]
pub fn recycle_seqs<'b>(mut seqs: Vec<SeqChunk<'_>>) -> Vec<SeqChunk<'b>> {
    seqs.clear();
    seqs.into_iter().filter_map(|_| None).collect()
}

/// What one step produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExecOutput {
    /// In `batch.seqs` order: `Some(token)` for every chunk with `sample` set (its first draw),
    /// `None` for the others.
    pub sampled: Vec<Option<Sampled>>,
    /// Chunks with `n > 1`: (index in `batch.seqs`, draws `1..n`).
    pub forks: Vec<(usize, Vec<Sampled>)>,
    /// Chunks with prompt logprobs: (index in `batch.seqs`, one entry per target, in order).
    pub prompt_logprobs: Vec<(usize, Vec<Sampled>)>,
    /// Chunks with drafts whose first sampled token equalled `d1`: (index in `batch.seqs`, the
    /// tokens sampled at positions `1..`, in order). Entry `j` was sampled after `d(j+1)`, and
    /// every entry but the last equals the next draft: `len()` drafts were accepted.
    pub spec: Vec<(usize, Vec<Sampled>)>,
}

impl From<Vec<Option<Sampled>>> for ExecOutput {
    fn from(sampled: Vec<Option<Sampled>>) -> Self {
        ExecOutput {
            sampled,
            ..Default::default()
        }
    }
}

impl ExecBatch<'_> {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: TokenId,
    /// Log-probability of `token` under the (unpenalised, untempered) model distribution, when
    /// the request asked for logprobs (0.0 otherwise).
    pub logprob: f32,
    /// The most likely alternatives when logprobs were requested, best first.
    pub top_logprobs: Vec<(TokenId, f32)>,
}

impl Sampled {
    pub fn token(token: TokenId) -> Self {
        Sampled {
            token,
            logprob: 0.0,
            top_logprobs: Vec::new(),
        }
    }
}

#[derive(Debug, Error)]
pub enum ExecError {
    #[error("model execution failed: {0}")]
    Failed(String),
    #[error("a KV load for block {block} has {got} bytes; this executor's blocks have {want}")]
    BadLoad {
        block: BlockId,
        got: usize,
        want: usize,
    },
}

/// A model that runs over the core's paged KV blocks.
pub trait Executor: Send {
    /// Identity of the model for the prefix cache's hash seed: a fingerprint of the weights.
    fn model_fingerprint(&self) -> [u8; 32];
    /// Names the KV layout (dtype, layers, heads, head size): part of the hash seed.
    fn kv_layout(&self) -> String;
    /// Bytes of one block's KV as [`Executor::save_block`] writes it.
    fn block_bytes(&self) -> usize;
    /// Append block `block`'s KV (every layer, K and V) to `out`: [`Executor::block_bytes`]
    /// bytes that a [`BlockLoad`] of the same layout restores exactly.
    fn save_block(&self, block: BlockId, out: &mut Vec<u8>) -> Result<(), ExecError>;
    /// [`Executor::save_block`] of `blocks[i]` into `outs[i]`, one result per block; an
    /// executor with threads copies them in parallel (a tier offload of a long prompt's
    /// blocks is tens of MB). Same bytes as one call per block.
    fn save_blocks(&self, blocks: &[BlockId], outs: &mut [Vec<u8>]) -> Vec<Result<(), ExecError>> {
        blocks
            .iter()
            .zip(outs.iter_mut())
            .map(|(&b, out)| self.save_block(b, out))
            .collect()
    }
    /// Run one step: do `batch.copies`, write `batch.loads`, then compute the chunks.
    fn execute(&mut self, batch: &ExecBatch<'_>) -> Result<ExecOutput, ExecError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine keeps one batch vector for all steps: emptied and released from a step's
    /// borrows, it keeps its allocation (the same memory, its whole capacity).
    #[test]
    fn a_recycled_batch_vector_keeps_its_allocation() {
        let tokens = vec![7, 8, 9];
        let blocks = vec![3];
        let mut seqs = Vec::with_capacity(1000);
        seqs.push(SeqChunk {
            slot: 0,
            tokens: &tokens,
            start_pos: 0,
            block_table: &blocks,
            sample: None,
            prompt_logprobs: None,
        });
        let at = seqs.as_ptr() as usize;
        let kept: Vec<SeqChunk<'static>> = recycle_seqs(seqs);
        drop(tokens);
        assert!(kept.is_empty());
        assert_eq!(kept.capacity(), 1000);
        assert_eq!(kept.as_ptr() as usize, at);
    }
}
