//! [`LlamaExecutor`]: one batched forward per engine step over a paged KV arena.
//!
//! All chunk tokens of a step are concatenated into one activation matrix `[T][hidden]`, so
//! every projection is a single `QMatrix::matmul` with `m = T` (prefill chunks and decodes
//! together). Each token's K/V is written to slot `pos % block_size` of block
//! `block_table[pos / block_size]`; attention runs per sequence over its block table
//! (parallel over (sequence, token range) tasks); the final norm and lm_head run only for the
//! rows whose chunk asks for a sample.

use std::sync::Arc;

use cachet_core::{ExecBatch, ExecError, Executor, Sampled, TokenId};
use cachet_kernels::attention::{paged_attention, paged_attention_parallel, KvElem, PagedAttnArgs};
use cachet_kernels::{QMatrix, ThreadPool};

use crate::gguf::{Fused, LlamaWeights, RopeStyle};
use crate::sampling::{self, SampleInput, SamplerScratch};
use crate::ModelError;

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

/// A KV element the executor can write.
pub trait KvStore: KvElem + Copy + Send + Sync + 'static {
    const ZERO: Self;
    /// `dst[i] = src[i]` converted (same lengths).
    fn store_slice(src: &[f32], dst: &mut [Self]);
}

impl KvStore for f32 {
    const ZERO: Self = 0.0;
    fn store_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl KvStore for half::f16 {
    const ZERO: Self = half::f16::ZERO;
    fn store_slice(src: &[f32], dst: &mut [Self]) {
        // Vectorised (F16C when the CPU has it, detected once per call).
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

/// Per-layer K and V, each `[num_blocks][block_size][n_kv_heads][head_dim]`.
struct LayerKv<T> {
    k: Vec<T>,
    v: Vec<T>,
}

enum Arena {
    F32(Vec<LayerKv<f32>>),
    F16(Vec<LayerKv<half::f16>>),
}

fn new_layers<T: KvStore>(n_layers: usize, elems: usize) -> Vec<LayerKv<T>> {
    (0..n_layers)
        .map(|_| LayerKv {
            k: vec![T::ZERO; elems],
            v: vec![T::ZERO; elems],
        })
        .collect()
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
struct Prof {
    on: bool,
    last: Option<std::time::Instant>,
    acc: [f64; 8],
}

impl Prof {
    #[inline]
    fn start(&mut self) {
        if self.on {
            self.last = Some(std::time::Instant::now());
        }
    }
    #[inline]
    fn mark(&mut self, phase: usize) {
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
struct Scratch {
    prof: Prof,
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    part: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    xs: Vec<f32>,
    logits: Vec<f32>,
    /// Absolute position of each token.
    pos: Vec<usize>,
    /// Slot (block * block_size + offset) of each token.
    slot: Vec<usize>,
    /// Offset of each sequence's first token in the activation matrix.
    seq_off: Vec<usize>,
    /// Activation row of each sampled chunk, in batch order.
    sample_rows: Vec<usize>,
    /// Attention tasks: (sequence, first token, end token) within the sequence.
    tasks: Vec<(usize, usize, usize)>,
}

/// A raw pointer that may be shared with pool workers writing disjoint ranges.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to let tasks write disjoint ranges of one buffer while the owner waits.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// Taking `self` makes closures capture the whole (Sync) wrapper, not the raw pointer.
    fn get(self) -> *mut f32 {
        self.0
    }
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
    /// `inv_freq[i]` for the rotary pairs.
    inv_freq: Vec<f32>,
    /// `[pos][rope_dim/2]` cos and sin, grown on demand.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    rope_len: usize,
    eos: Vec<TokenId>,
    rng: u64,
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
        let half = c.rope_dim / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1f32 / c.rope_theta.powf((2 * i) as f32 / c.rope_dim as f32))
            .collect();
        if let Some(ff) = &w.rope_freqs {
            for (f, d) in inv_freq.iter_mut().zip(ff) {
                *f /= *d;
            }
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
            inv_freq,
            rope_cos: Vec::new(),
            rope_sin: Vec::new(),
            rope_len: 0,
            eos: Vec::new(),
            rng,
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

    fn ensure_rope(&mut self, max_pos: usize) {
        if max_pos < self.rope_len {
            return;
        }
        let new_len = (max_pos + 1).next_power_of_two().max(256);
        let half = self.inv_freq.len();
        self.rope_cos.resize(new_len * half, 0.0);
        self.rope_sin.resize(new_len * half, 0.0);
        for p in self.rope_len..new_len {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let a = p as f32 * f;
                self.rope_cos[p * half + i] = a.cos();
                self.rope_sin[p * half + i] = a.sin();
            }
        }
        self.rope_len = new_len;
    }

    /// The batched forward. Leaves `[S][vocab]` logits in `self.s.logits` for the S sampled
    /// chunks and returns S.
    fn forward(&mut self, batch: &ExecBatch<'_>) -> Result<usize, ModelError> {
        self.validate(batch)?;
        let t_total = batch.num_tokens();
        let max_pos = batch
            .seqs
            .iter()
            .map(|s| (s.start_pos + s.tokens.len()).saturating_sub(1))
            .max()
            .unwrap_or(0);
        self.ensure_rope(max_pos);
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
            if seq.sample.is_some() {
                s.sample_rows.push(s.pos.len() - 1);
            }
            let n = seq.tokens.len();
            let mut a = 0;
            while a < n {
                let e = (a + ATTN_TASK_TOKENS).min(n);
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
                &self.rope_cos,
                &self.rope_sin,
                bs,
            ),
            Arena::F16(layers) => forward_impl(
                &self.w,
                &self.pool,
                layers,
                s,
                batch,
                &self.rope_cos,
                &self.rope_sin,
                bs,
            ),
        }
        Ok(self.s.sample_rows.len())
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = sum_squares(x) / x.len() as f32;
    let r = 1.0 / (ss + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
}

/// `out[t] = rms_norm(x[t]) * w` for `n` rows of width `h`, rows in parallel.
fn norm_rows(
    pool: &ThreadPool,
    x: &[f32],
    out: &mut [f32],
    n: usize,
    h: usize,
    w: &[f32],
    eps: f32,
) {
    let op = SendPtr(out.as_mut_ptr());
    assert!(out.len() >= n * h && x.len() >= n * h);
    par_rows(pool, n, &|r| {
        // SAFETY: disjoint row ranges of `out`, which holds at least n rows (asserted).
        let o = unsafe { rows_mut(op, h, &r) };
        for (i, t) in r.enumerate() {
            rms_norm(&x[t * h..(t + 1) * h], w, eps, &mut o[i * h..(i + 1) * h]);
        }
    });
}

/// `x[t] += d[t]`, then (when `w` is given) `out[t] = rms_norm(x[t]) * w`, for `n` rows of
/// width `h`, rows in parallel (one pass over the pool instead of two).
#[allow(clippy::too_many_arguments)]
fn add_norm_rows(
    pool: &ThreadPool,
    x: &mut [f32],
    d: &[f32],
    out: &mut [f32],
    n: usize,
    h: usize,
    w: Option<&[f32]>,
    eps: f32,
) {
    assert!(x.len() >= n * h && d.len() >= n * h && out.len() >= n * h);
    let xp = SendPtr(x.as_mut_ptr());
    let op = SendPtr(out.as_mut_ptr());
    par_rows(pool, n, &|r| {
        // SAFETY: disjoint row ranges of `x` and `out`, which hold at least n rows (asserted).
        let (xs, os) = unsafe { (rows_mut(xp, h, &r), rows_mut(op, h, &r)) };
        for (a, &b) in xs.iter_mut().zip(&d[r.start * h..r.end * h]) {
            *a += b;
        }
        if let Some(w) = w {
            for (xr, orow) in xs.chunks_exact(h).zip(os.chunks_exact_mut(h)) {
                rms_norm(xr, w, eps, orow);
            }
        }
    });
}

/// `Σ x²` over 8 independent lanes (vectorises; a plain `sum` is a serial chain).
#[inline]
fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i] * c[i];
        }
    }
    acc.iter().sum::<f32>() + rest
}

fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let ss: f32 = sum_squares(x) / x.len() as f32;
    let r = 1.0 / (ss + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * r * g;
    }
}

fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = cos.len();
    match style {
        RopeStyle::Normal => {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
        RopeStyle::Neox => {
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = a * sin[i] + b * cos[i];
            }
        }
    }
}

/// Rows per task for the element-wise work spread over the pool.
const ROWS_PER_TASK: usize = 8;

/// Runs `f` over `0..n` split into row ranges, on the pool when there is more than one range.
fn par_rows(pool: &ThreadPool, n: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    if n <= ROWS_PER_TASK {
        f(0..n);
        return;
    }
    pool.parallel_for(n.div_ceil(ROWS_PER_TASK), &|i| {
        f(i * ROWS_PER_TASK..((i + 1) * ROWS_PER_TASK).min(n))
    });
}

/// Rows `r` of a `[..][width]` buffer behind `p`.
///
/// # Safety
/// The buffer must hold at least `r.end * width` elements and no other live reference may
/// touch these rows (tasks of one `par_rows` call get disjoint ranges).
unsafe fn rows_mut<'a>(p: SendPtr, width: usize, r: &std::ops::Range<usize>) -> &'a mut [f32] {
    std::slice::from_raw_parts_mut(p.get().add(r.start * width), (r.end - r.start) * width)
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// `out[m][sum(rows)] = x[m][cols] · Wᵀ` for a possibly split stacked matrix.
fn fused_matmul(
    f: &Fused,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    part: &mut Vec<f32>,
) {
    match f {
        Fused::One(q) => q.matmul(pool, x, m, &mut out[..m * q.rows()]),
        Fused::Many(parts) => {
            let width: usize = parts.iter().map(|p| p.rows()).sum();
            let mut col = 0;
            for p in parts {
                let r = p.rows();
                grow(part, m * r);
                p.matmul(pool, x, m, &mut part[..m * r]);
                for t in 0..m {
                    out[t * width + col..t * width + col + r]
                        .copy_from_slice(&part[t * r..(t + 1) * r]);
                }
                col += r;
            }
        }
    }
}

fn matmul(q: &QMatrix, pool: &ThreadPool, x: &[f32], m: usize, out: &mut [f32]) {
    q.matmul(pool, x, m, &mut out[..m * q.rows()]);
}

#[allow(clippy::too_many_arguments)]
fn forward_impl<T: KvStore>(
    w: &LlamaWeights,
    pool: &ThreadPool,
    layers: &mut [LayerKv<T>],
    s: &mut Scratch,
    batch: &ExecBatch<'_>,
    rope_cos: &[f32],
    rope_sin: &[f32],
    block_size: usize,
) {
    let c = &w.config;
    let t_n = s.pos.len();
    let (h, hd, nh, nkv) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads);
    let qd = nh * hd;
    let kvd = nkv * hd;
    let qkv_w = qd + 2 * kvd;
    let half = c.rope_dim / 2;
    let eps = c.rms_eps;
    grow(&mut s.x, t_n * h);
    grow(&mut s.xn, t_n * h);
    grow(&mut s.tmp, t_n * h);
    grow(&mut s.qkv, t_n * qkv_w);
    grow(&mut s.q, t_n * qd);
    grow(&mut s.att, t_n * qd);
    grow(&mut s.gu, t_n * 2 * c.ffn);
    grow(&mut s.act, t_n * c.ffn);

    s.prof.start();
    // Embeddings.
    let mut row = 0;
    for seq in &batch.seqs {
        for &tok in seq.tokens {
            w.tok_embd
                .dequantize_row(tok as usize, &mut s.x[row * h..(row + 1) * h]);
            row += 1;
        }
    }

    s.prof.mark(0);
    let scale = 1.0 / (hd as f32).sqrt();
    // The attention norm of layer 0 here; later ones are fused with the residual add.
    if let Some(l0) = w.layers.first() {
        norm_rows(pool, &s.x, &mut s.xn, t_n, h, &l0.attn_norm, eps);
    }
    let n_layers = w.layers.len();
    for (li, (lw, kv)) in w.layers.iter().zip(layers.iter_mut()).enumerate() {
        // Attention block (s.xn holds attn_norm(x)).
        s.prof.mark(1);
        fused_matmul(
            &lw.qkv,
            pool,
            &s.xn[..t_n * h],
            t_n,
            &mut s.qkv[..t_n * qkv_w],
            &mut s.part,
        );
        s.prof.mark(2);
        {
            // Bias, Q/K norms and rotary embeddings, token rows in parallel.
            let qkv_p = SendPtr(s.qkv.as_mut_ptr());
            let q_p = SendPtr(s.q.as_mut_ptr());
            let pos = &s.pos;
            par_rows(pool, t_n, &|r| {
                // SAFETY: disjoint row ranges of `qkv` and `q`, both sized for t_n rows above.
                let (rows, qrows) = unsafe { (rows_mut(qkv_p, qkv_w, &r), rows_mut(q_p, qd, &r)) };
                for (i, t) in r.enumerate() {
                    let row = &mut rows[i * qkv_w..(i + 1) * qkv_w];
                    if let Some(b) = &lw.qkv_bias {
                        for (v, &bb) in row.iter_mut().zip(b) {
                            *v += bb;
                        }
                    }
                    let p = pos[t];
                    let cos = &rope_cos[p * half..(p + 1) * half];
                    let sin = &rope_sin[p * half..(p + 1) * half];
                    let (q, kvpart) = row.split_at_mut(qd);
                    let k = &mut kvpart[..kvd];
                    for qh in q.chunks_exact_mut(hd) {
                        if let Some(n) = &lw.q_norm {
                            rms_norm_inplace(qh, n, eps);
                        }
                        rope(&mut qh[..c.rope_dim], cos, sin, c.rope_style);
                    }
                    for kh in k.chunks_exact_mut(hd) {
                        if let Some(n) = &lw.k_norm {
                            rms_norm_inplace(kh, n, eps);
                        }
                        rope(&mut kh[..c.rope_dim], cos, sin, c.rope_style);
                    }
                    qrows[i * qd..(i + 1) * qd].copy_from_slice(q);
                }
            });
        }
        // K/V of each token into its slot.
        for t in 0..t_n {
            let row = &s.qkv[t * qkv_w..(t + 1) * qkv_w];
            let (k, v) = row[qd..].split_at(kvd);
            let off = s.slot[t] * kvd;
            T::store_slice(k, &mut kv.k[off..off + kvd]);
            T::store_slice(v, &mut kv.v[off..off + kvd]);
        }
        s.prof.mark(3);
        if batch.seqs.len() == 1 {
            // One sequence (e.g. batch-1 decode): spread (token, kv head) items over the pool.
            let seq = &batch.seqs[0];
            let args = PagedAttnArgs {
                block_table: seq.block_table,
                block_size,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                start_pos: seq.start_pos,
                n_tokens: t_n,
                scale,
            };
            paged_attention_parallel::<T>(
                pool,
                &args,
                &s.q[..t_n * qd],
                &kv.k,
                &kv.v,
                &mut s.att[..t_n * qd],
            );
        } else {
            let att = SendPtr(s.att.as_mut_ptr());
            let tasks = &s.tasks;
            let seq_off = &s.seq_off;
            let qbuf = &s.q;
            let (kk, vv) = (&kv.k[..], &kv.v[..]);
            pool.parallel_for(tasks.len(), &|ti| {
                let (si, a, e) = tasks[ti];
                let seq = &batch.seqs[si];
                let base = seq_off[si];
                let args = PagedAttnArgs {
                    block_table: seq.block_table,
                    block_size,
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    start_pos: seq.start_pos + a,
                    n_tokens: e - a,
                    scale,
                };
                let q = &qbuf[(base + a) * qd..(base + e) * qd];
                // SAFETY: every task writes its own token rows [(base+a)..(base+e)) of `att`,
                // which is at least t_n * qd long; the tasks are disjoint.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(att.get().add((base + a) * qd), (e - a) * qd)
                };
                paged_attention::<T>(&args, q, kk, vv, out);
            });
        }
        s.prof.mark(4);
        matmul(&lw.wo, pool, &s.att[..t_n * qd], t_n, &mut s.tmp);
        s.prof.mark(5);
        // Residual add fused with the feed-forward norm.
        add_norm_rows(
            pool,
            &mut s.x,
            &s.tmp,
            &mut s.xn,
            t_n,
            h,
            Some(&lw.ffn_norm),
            eps,
        );
        s.prof.mark(1);
        let f = c.ffn;
        fused_matmul(
            &lw.gate_up,
            pool,
            &s.xn[..t_n * h],
            t_n,
            &mut s.gu[..t_n * 2 * f],
            &mut s.part,
        );
        s.prof.mark(5);
        {
            let act = SendPtr(s.act.as_mut_ptr());
            let gu_all = &s.gu;
            par_rows(pool, t_n, &|r| {
                // SAFETY: disjoint row ranges of `act`, sized for t_n rows above.
                let out = unsafe { rows_mut(act, f, &r) };
                for (i, t) in r.enumerate() {
                    let (g, u) = gu_all[t * 2 * f..(t + 1) * 2 * f].split_at(f);
                    cachet_kernels::act::swiglu(g, u, &mut out[i * f..(i + 1) * f]);
                }
            });
        }
        s.prof.mark(1);
        matmul(&lw.down, pool, &s.act[..t_n * f], t_n, &mut s.tmp);
        s.prof.mark(5);
        // Residual add fused with the next layer's attention norm.
        let next = w.layers.get(li + 1).map(|l| l.attn_norm.as_slice());
        debug_assert_eq!(next.is_none(), li + 1 == n_layers);
        add_norm_rows(pool, &mut s.x, &s.tmp, &mut s.xn, t_n, h, next, eps);
    }

    // Final norm + lm_head only for sampled rows.
    let n_s = s.sample_rows.len();
    if n_s == 0 {
        return;
    }
    grow(&mut s.xs, n_s * h);
    for (i, &r) in s.sample_rows.iter().enumerate() {
        rms_norm(
            &s.x[r * h..(r + 1) * h],
            &w.output_norm,
            eps,
            &mut s.xs[i * h..(i + 1) * h],
        );
    }
    let v = c.vocab_size;
    grow(&mut s.logits, n_s * v);
    w.lm_head()
        .matmul(pool, &s.xs[..n_s * h], n_s, &mut s.logits[..n_s * v]);
    s.prof.mark(6);
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

    fn execute(&mut self, batch: &ExecBatch<'_>) -> Result<Vec<Option<Sampled>>, ExecError> {
        self.forward(batch)?;
        self.s.prof.start();
        let v = self.w.config.vocab_size;
        let mut out = Vec::with_capacity(batch.seqs.len());
        let mut row = 0;
        for seq in &batch.seqs {
            match &seq.sample {
                Some(spec) => {
                    self.rng = sampling::splitmix64(self.rng);
                    let inp = SampleInput {
                        params: spec.params,
                        prompt: spec.prompt,
                        output: spec.output,
                        eos_token_ids: &self.eos,
                        fallback_seed: self.rng,
                    };
                    let logits = &self.s.logits[row * v..(row + 1) * v];
                    out.push(Some(sampling::sample(logits, &inp, &mut self.sampler)));
                    row += 1;
                }
                None => out.push(None),
            }
        }
        self.s.prof.mark(7);
        Ok(out)
    }
}
