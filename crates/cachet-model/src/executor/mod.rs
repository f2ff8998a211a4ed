//! [`LlamaExecutor`]: one batched forward per engine step over a paged KV arena.
//!
//! All chunk tokens of a step are concatenated into one activation matrix `[T][hidden]`, so
//! every projection is a single `QMatrix::matmul` with `m = T` (prefill chunks and decodes
//! together). Each token's K/V is written to slot `pos % block_size` of block
//! `block_table[pos / block_size]`; attention runs per sequence over its block table
//! (parallel over (sequence, token range) tasks); the final norm and lm_head run only for the
//! rows whose chunk asks for a sample.
//!
//! The module splits in three: this file (the executor's state, batch validation, the
//! [`Executor`] impl), `arena` (the paged KV arena and a block's bytes for external tiers) and
//! `forward` (the layer loop and its row helpers).

mod arena;
mod forward;

use std::sync::Arc;

use cachet_core::{BlockId, ExecBatch, ExecError, ExecOutput, Executor, TokenId};
use cachet_kernels::ThreadPool;

use crate::gguf::LlamaWeights;
use crate::sampling::{self, SampleInput, SamplerScratch};
use crate::ModelError;

pub use arena::KvStore;
use arena::{new_layers, Arena};
use forward::forward_impl;

/// Element type of the KV arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    F32,
    #[default]
    F16,
}

impl KvDtype {
    pub fn elem_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(KvDtype::F32),
            "f16" | "float16" | "half" => Some(KvDtype::F16),
            _ => None,
        }
    }
}

/// KV arena geometry.
#[derive(Clone, Copy, Debug)]
pub struct ExecutorConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the arena (block ids `0..num_blocks`).
    pub num_blocks: usize,
    pub kv_dtype: KvDtype,
}

/// Names of the phases timed by [`LlamaExecutor::set_profiling`].
pub const PROFILE_PHASES: [&str; 8] = [
    "embed",
    "norms+swiglu",
    "qkv matmul",
    "rope+kv write",
    "attention",
    "o/ffn matmuls",
    "lm_head",
    "sampling",
];

/// Accumulated wall time per phase (only when enabled).
#[derive(Default)]
pub(crate) struct Prof {
    pub(crate) on: bool,
    pub(crate) last: Option<std::time::Instant>,
    pub(crate) acc: [f64; 8],
}

impl Prof {
    #[inline]
    pub(crate) fn start(&mut self) {
        if self.on {
            self.last = Some(std::time::Instant::now());
        }
    }
    #[inline]
    pub(crate) fn mark(&mut self, phase: usize) {
        if self.on {
            let now = std::time::Instant::now();
            if let Some(l) = self.last {
                self.acc[phase] += (now - l).as_secs_f64();
            }
            self.last = Some(now);
        }
    }
}

/// Scratch buffers reused across steps (grown, never shrunk).
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) prof: Prof,
    pub(crate) x: Vec<f32>,
    pub(crate) xn: Vec<f32>,
    pub(crate) qkv: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) att: Vec<f32>,
    pub(crate) tmp: Vec<f32>,
    pub(crate) part: Vec<f32>,
    pub(crate) gu: Vec<f32>,
    pub(crate) act: Vec<f32>,
    pub(crate) xs: Vec<f32>,
    pub(crate) logits: Vec<f32>,
    /// Absolute position of each token.
    pub(crate) pos: Vec<usize>,
    /// Slot (block * block_size + offset) of each token.
    pub(crate) slot: Vec<usize>,
    /// Offset of each sequence's first token in the activation matrix.
    pub(crate) seq_off: Vec<usize>,
    /// Activation row of each sampled chunk, in batch order.
    pub(crate) sample_rows: Vec<usize>,
    /// Attention tasks: (sequence, first token, end token) within the sequence.
    pub(crate) tasks: Vec<(usize, usize, usize)>,
}

/// Runs a llama-family model over the core's paged KV blocks.
pub struct LlamaExecutor {
    w: Arc<LlamaWeights>,
    fingerprint: [u8; 32],
    cfg: ExecutorConfig,
    pool: ThreadPool,
    arena: Arena,
    s: Scratch,
    sampler: SamplerScratch,
    /// One rotary table per distinct (base, scale) of the layers.
    ropes: Vec<RopeTable>,
    /// Index into `ropes` of each layer.
    layer_rope: Vec<usize>,
    eos: Vec<TokenId>,
    rng: u64,
    /// Output so far plus the accepted drafts (speculative verification, reused).
    spec_out: Vec<TokenId>,
}

/// cos and sin of the rotary angles `p * scale * inv_freq[i]`, `[pos][rope_dim/2]`, grown
/// on demand.
pub(crate) struct RopeTable {
    inv_freq: Vec<f32>,
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
    len: usize,
}

impl RopeTable {
    fn new(base: f32, scale: f32, rope_dim: usize, freq_divisors: Option<&[f32]>) -> Self {
        let half = rope_dim / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1f32 / base.powf((2 * i) as f32 / rope_dim as f32))
            .collect();
        if let Some(ff) = freq_divisors {
            for (f, d) in inv_freq.iter_mut().zip(ff) {
                *f /= *d;
            }
        }
        RopeTable {
            inv_freq,
            cos: Vec::new(),
            sin: Vec::new(),
            len: 0,
        }
        .scaled(scale)
    }

    fn scaled(mut self, scale: f32) -> Self {
        if scale != 1.0 {
            for f in &mut self.inv_freq {
                *f *= scale;
            }
        }
        self
    }

    fn ensure(&mut self, max_pos: usize) {
        if max_pos < self.len {
            return;
        }
        let new_len = (max_pos + 1).next_power_of_two().max(256);
        let half = self.inv_freq.len();
        self.cos.resize(new_len * half, 0.0);
        self.sin.resize(new_len * half, 0.0);
        for p in self.len..new_len {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let a = p as f32 * f;
                self.cos[p * half + i] = a.cos();
                self.sin[p * half + i] = a.sin();
            }
        }
        self.len = new_len;
    }
}

/// Tokens per attention task when a sequence's chunk is split for parallelism.
const ATTN_TASK_TOKENS: usize = 16;

impl LlamaExecutor {
    pub fn new(
        w: Arc<LlamaWeights>,
        fingerprint: [u8; 32],
        cfg: ExecutorConfig,
        pool: ThreadPool,
    ) -> Result<Self, ModelError> {
        let c = &w.config;
        if cfg.block_size == 0 || cfg.num_blocks == 0 {
            return Err(ModelError::Config(format!(
                "block_size {} and num_blocks {} must be positive",
                cfg.block_size, cfg.num_blocks
            )));
        }
        let elems = cfg
            .num_blocks
            .checked_mul(cfg.block_size)
            .and_then(|x| x.checked_mul(c.n_kv_heads * c.head_dim))
            .ok_or_else(|| ModelError::Config("KV arena size overflows".into()))?;
        let arena = match cfg.kv_dtype {
            KvDtype::F32 => Arena::F32(new_layers(c.n_layers, elems)),
            KvDtype::F16 => Arena::F16(new_layers(c.n_layers, elems)),
        };
        let mut ropes: Vec<RopeTable> = Vec::new();
        let mut keys: Vec<(u32, u32)> = Vec::new();
        let mut layer_rope = Vec::with_capacity(c.layers.len());
        for l in &c.layers {
            let key = (l.rope_base.to_bits(), l.rope_scale.to_bits());
            let i = match keys.iter().position(|&k| k == key) {
                Some(i) => i,
                None => {
                    keys.push(key);
                    ropes.push(RopeTable::new(
                        l.rope_base,
                        l.rope_scale,
                        c.rope_dim,
                        w.rope_freqs.as_deref(),
                    ));
                    keys.len() - 1
                }
            };
            layer_rope.push(i);
        }
        let rng = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0),
            );
            h.finish()
        };
        Ok(LlamaExecutor {
            w,
            fingerprint,
            cfg,
            pool,
            arena,
            s: Scratch::default(),
            sampler: SamplerScratch::default(),
            ropes,
            layer_rope,
            eos: Vec::new(),
            rng,
            spec_out: Vec::new(),
        })
    }

    /// Turns per-phase timing on or off (off by default; resets the totals).
    pub fn set_profiling(&mut self, on: bool) {
        self.s.prof = Prof {
            on,
            ..Prof::default()
        };
    }

    /// Seconds spent per phase since profiling was enabled, named by [`PROFILE_PHASES`].
    pub fn profile(&self) -> Vec<(&'static str, f64)> {
        PROFILE_PHASES
            .iter()
            .copied()
            .zip(self.s.prof.acc.iter().copied())
            .collect()
    }

    /// EOS tokens masked while a request has fewer than `min_tokens` outputs.
    pub fn set_eos_token_ids(&mut self, ids: Vec<TokenId>) {
        self.eos = ids;
    }

    pub fn config(&self) -> &ExecutorConfig {
        &self.cfg
    }

    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.w
    }

    /// Bytes held by the KV arena.
    /// Elements of one block in one layer's K (or V).
    fn block_elems(&self) -> usize {
        let c = &self.w.config;
        self.cfg.block_size * c.n_kv_heads * c.head_dim
    }

    pub fn kv_cache_bytes(&self) -> u64 {
        self.w.config.kv_bytes_per_token(self.cfg.kv_dtype)
            * (self.cfg.num_blocks * self.cfg.block_size) as u64
    }

    /// Runs the forward and returns the logits of the rows that would be sampled (chunks with
    /// `sample` set), in batch order. A test and debugging hook.
    pub fn execute_logits(&mut self, batch: &ExecBatch<'_>) -> Result<Vec<Vec<f32>>, ModelError> {
        let n = self.forward(batch)?;
        let v = self.w.config.vocab_size;
        Ok((0..n)
            .map(|i| self.s.logits[i * v..(i + 1) * v].to_vec())
            .collect())
    }

    fn validate(&self, batch: &ExecBatch<'_>) -> Result<(), ModelError> {
        let vocab = self.w.config.vocab_size;
        let bs = self.cfg.block_size;
        for (i, seq) in batch.seqs.iter().enumerate() {
            if seq.tokens.is_empty() {
                if seq.sample.is_some() {
                    return Err(ModelError::Batch(format!(
                        "seq {i}: sample requested for an empty chunk"
                    )));
                }
                continue;
            }
            if let Some(&t) = seq.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::Batch(format!(
                    "seq {i}: token {t} outside the vocabulary ({vocab})"
                )));
            }
            let end = seq.start_pos + seq.tokens.len();
            let need = end.div_ceil(bs);
            if seq.block_table.len() < need {
                return Err(ModelError::Batch(format!(
                    "seq {i}: block table has {} blocks, {need} needed for {end} positions",
                    seq.block_table.len()
                )));
            }
            if let Some(&b) = seq.block_table[..need]
                .iter()
                .find(|&&b| b as usize >= self.cfg.num_blocks)
            {
                return Err(ModelError::Batch(format!(
                    "seq {i}: block id {b} outside the arena ({})",
                    self.cfg.num_blocks
                )));
            }
        }
        Ok(())
    }

    /// The batched forward. Leaves `[S][vocab]` logits in `self.s.logits` for the S sampled
    /// chunks and returns S.
    fn forward(&mut self, batch: &ExecBatch<'_>) -> Result<usize, ModelError> {
        self.validate(batch)?;
        let block_elems = self.block_elems();
        for load in &batch.loads {
            if load.block as usize >= self.cfg.num_blocks {
                return Err(ModelError::Batch(format!(
                    "load into block {} outside the arena ({})",
                    load.block, self.cfg.num_blocks
                )));
            }
        }
        self.arena
            .load_blocks(&self.pool, block_elems, &batch.loads)
            .map_err(|e| ModelError::Batch(e.to_string()))?;
        let t_total = batch.num_tokens();
        let max_pos = batch
            .seqs
            .iter()
            .map(|s| (s.start_pos + s.tokens.len()).saturating_sub(1))
            .max()
            .unwrap_or(0);
        for r in &mut self.ropes {
            r.ensure(max_pos);
        }
        let bs = self.cfg.block_size;
        let s = &mut self.s;
        s.pos.clear();
        s.slot.clear();
        s.seq_off.clear();
        s.sample_rows.clear();
        s.tasks.clear();
        for (si, seq) in batch.seqs.iter().enumerate() {
            s.seq_off.push(s.pos.len());
            for i in 0..seq.tokens.len() {
                let p = seq.start_pos + i;
                s.pos.push(p);
                s.slot.push(seq.block_table[p / bs] as usize * bs + p % bs);
            }
            let drafts = seq.sample.as_ref().map_or(0, |sp| sp.drafts.len());
            if seq.prompt_logprobs.is_some() {
                // Prompt logprobs need every row's logits (the last doubles as the sample row).
                let end = s.pos.len();
                s.sample_rows.extend(end - seq.tokens.len()..end);
            } else if drafts > 0 {
                // Drafts: the logits of the last token and of every draft.
                let end = s.pos.len();
                s.sample_rows.extend(end - drafts - 1..end);
            } else if seq.sample.is_some() {
                s.sample_rows.push(s.pos.len() - 1);
            }
            let n = seq.tokens.len();
            // A chunk with drafts attends token by token, each exactly as a decode step at its
            // position would (same kernel, same split of the context), so the logits that
            // verify a draft are bit-identical to plain decoding's.
            let per_task = if drafts > 0 { 1 } else { ATTN_TASK_TOKENS };
            let mut a = 0;
            while a < n {
                let e = (a + per_task).min(n);
                s.tasks.push((si, a, e));
                a = e;
            }
        }
        if t_total == 0 {
            return Ok(0);
        }
        match &mut self.arena {
            Arena::F32(layers) => forward_impl(
                &self.w,
                &self.pool,
                layers,
                s,
                batch,
                (&self.ropes, &self.layer_rope),
                bs,
            ),
            Arena::F16(layers) => forward_impl(
                &self.w,
                &self.pool,
                layers,
                s,
                batch,
                (&self.ropes, &self.layer_rope),
                bs,
            ),
        }
        Ok(self.s.sample_rows.len())
    }
}

impl Executor for LlamaExecutor {
    fn model_fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    fn kv_layout(&self) -> String {
        let c = &self.w.config;
        format!(
            "{}:L{}:KV{}:D{}",
            self.cfg.kv_dtype.as_str(),
            c.n_layers,
            c.n_kv_heads,
            c.head_dim
        )
    }

    fn block_bytes(&self) -> usize {
        self.arena.block_bytes(self.block_elems())
    }

    fn save_block(&self, block: BlockId, out: &mut Vec<u8>) -> Result<(), ExecError> {
        if block as usize >= self.cfg.num_blocks {
            return Err(ExecError::Failed(format!(
                "block {block} outside the arena ({})",
                self.cfg.num_blocks
            )));
        }
        self.arena.save_block(block, self.block_elems(), out);
        Ok(())
    }

    fn save_blocks(&self, blocks: &[BlockId], outs: &mut [Vec<u8>]) -> Vec<Result<(), ExecError>> {
        if blocks.len() == outs.len() && blocks.iter().all(|&b| (b as usize) < self.cfg.num_blocks)
        {
            self.arena
                .save_blocks(&self.pool, self.block_elems(), blocks, outs);
            return blocks.iter().map(|_| Ok(())).collect();
        }
        // Some block is outside the arena: each on its own, for its own error.
        blocks
            .iter()
            .zip(outs.iter_mut())
            .map(|(&b, o)| self.save_block(b, o))
            .collect()
    }

    fn execute(&mut self, batch: &ExecBatch<'_>) -> Result<ExecOutput, ExecError> {
        let block_elems = self.block_elems();
        for &(src, dst) in &batch.copies {
            if src as usize >= self.cfg.num_blocks || dst as usize >= self.cfg.num_blocks {
                return Err(ExecError::Failed(format!(
                    "block copy {src} -> {dst} outside the arena ({})",
                    self.cfg.num_blocks
                )));
            }
            self.arena.copy_block(src, dst, block_elems);
        }
        self.forward(batch)?;
        self.s.prof.start();
        let v = self.w.config.vocab_size;
        let mut out = ExecOutput::default();
        out.sampled.reserve(batch.seqs.len());
        // The lm_head rows: a prompt-logprobs chunk has one per token, a sampled chunk one.
        let mut row = 0;
        for (si, seq) in batch.seqs.iter().enumerate() {
            if let Some(lp) = &seq.prompt_logprobs {
                let rows = seq.tokens.len();
                let mut v_out = Vec::with_capacity(lp.targets.len());
                for (j, &t) in lp.targets.iter().enumerate().take(rows) {
                    let logits = &self.s.logits[(row + j) * v..(row + j + 1) * v];
                    v_out.push(sampling::token_logprob(
                        logits,
                        t,
                        lp.top,
                        &mut self.sampler,
                    ));
                }
                out.prompt_logprobs.push((si, v_out));
                row += rows;
            } else if let Some(sp) = &seq.sample {
                row += 1 + sp.drafts.len();
            }
            let Some(spec) = &seq.sample else {
                out.sampled.push(None);
                continue;
            };
            if !spec.drafts.is_empty() && seq.prompt_logprobs.is_none() {
                self.verify_drafts(si, row - 1 - spec.drafts.len(), spec, &mut out);
                continue;
            }
            let logits_row = row - 1;
            let logits = &self.s.logits[logits_row * v..(logits_row + 1) * v];
            self.rng = sampling::splitmix64(self.rng);
            let inp = SampleInput {
                params: spec.params,
                prompt: spec.prompt,
                output: spec.output,
                eos_token_ids: &self.eos,
                fallback_seed: self.rng,
            };
            out.sampled
                .push(Some(sampling::sample(logits, &inp, &mut self.sampler)));
            if !spec.forks.is_empty() {
                // Further draws for the request's other sequences, each with its own sampling
                // (seed, constraint).
                let mut draws = Vec::with_capacity(spec.forks.len());
                for params in spec.forks {
                    self.rng = sampling::splitmix64(self.rng);
                    let inp = SampleInput {
                        params,
                        prompt: spec.prompt,
                        output: spec.output,
                        eos_token_ids: &self.eos,
                        fallback_seed: self.rng,
                    };
                    draws.push(sampling::sample(logits, &inp, &mut self.sampler));
                }
                out.forks.push((si, draws));
            }
        }
        self.s.prof.mark(7);
        Ok(out)
    }
}

impl LlamaExecutor {
    /// Speculative verification of chunk `si` whose `k + 1` logits rows start at `row0`:
    /// sample row 0 as usual; while the token sampled at row `j` equals draft `j + 1`, sample
    /// row `j + 1` with that draft counted as output (penalties, a seeded draw's position).
    /// Each token is a draw from the model given the committed prefix, as in plain decoding.
    fn verify_drafts(
        &mut self,
        si: usize,
        row0: usize,
        spec: &cachet_core::exec::SampleSpec<'_>,
        out: &mut ExecOutput,
    ) {
        let v = self.w.config.vocab_size;
        let mut buf = std::mem::take(&mut self.spec_out);
        buf.clear();
        buf.extend_from_slice(spec.output);
        let mut extra = Vec::new();
        for j in 0..=spec.drafts.len() {
            let logits = &self.s.logits[(row0 + j) * v..(row0 + j + 1) * v];
            self.rng = sampling::splitmix64(self.rng);
            let inp = SampleInput {
                params: spec.params,
                prompt: spec.prompt,
                output: &buf,
                eos_token_ids: &self.eos,
                fallback_seed: self.rng,
            };
            let tok = sampling::sample(logits, &inp, &mut self.sampler);
            let t = tok.token;
            if j == 0 {
                out.sampled.push(Some(tok));
            } else {
                extra.push(tok);
            }
            match spec.drafts.get(j) {
                Some(&d) if d == t => buf.push(d),
                _ => break,
            }
        }
        if !extra.is_empty() {
            out.spec.push((si, extra));
        }
        self.spec_out = buf;
    }
}
