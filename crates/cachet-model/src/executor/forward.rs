//! The batched forward: every layer over all of a step's tokens, attention per sequence over
//! its block table, the final norm and lm_head only for sampled rows.

use cachet_core::ExecBatch;
use cachet_kernels::attention::{
    paged_attention, paged_attention_parallel, prefetch_context, PagedAttnArgs,
};
use cachet_kernels::{QMatrix, ThreadPool};

use super::arena::{KvStore, LayerKv};
use super::{RopeTable, Scratch};
use crate::gguf::{FfnAct, Fused, LlamaWeights, RopeStyle};

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

/// `x[t] = rms_norm(x[t]) * w` for `n` rows of width `h`, rows in parallel.
fn norm_rows_inplace(pool: &ThreadPool, x: &mut [f32], n: usize, h: usize, w: &[f32], eps: f32) {
    assert!(x.len() >= n * h);
    let xp = SendPtr(x.as_mut_ptr());
    par_rows(pool, n, &|r| {
        // SAFETY: disjoint row ranges of `x`, which holds at least n rows (asserted).
        let xs = unsafe { rows_mut(xp, h, &r) };
        for row in xs.chunks_exact_mut(h) {
            rms_norm_inplace(row, w, eps);
        }
    });
}

/// ggml's GELU (tanh form) as its CPU backend computes it: the input rounded to f16 looks up
/// `f16(gelu(x))` in a table, 0 at or below -10 and `x` at or above 10.
fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        const GELU_COEF_A: f32 = 0.044715;
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        (0..=u16::MAX)
            .map(|bits| {
                let x = half::f16::from_bits(bits).to_f32();
                let g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh());
                half::f16::from_f32(g).to_f32()
            })
            .collect()
    })
}

/// `out[i] = gelu(gate[i]) * up[i]` (ggml's `geglu`).
fn geglu(table: &[f32], gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = if g <= -10.0 {
            0.0
        } else if g >= 10.0 {
            g * u
        } else {
            table[half::f16::from_f32(g).to_bits() as usize] * u
        };
    }
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

/// Positions of the next attention task's context prefetched before a task runs (one kernel
/// chunk; `cachet-kernels/examples/perf` XPF=32 against 0: ~5 % less decode attention time at
/// batch 16).
const ATTN_PREFETCH_POSITIONS: usize = 32;

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
pub(super) fn forward_impl<T: KvStore>(
    w: &LlamaWeights,
    pool: &ThreadPool,
    layers: &mut [LayerKv<T>],
    s: &mut Scratch,
    batch: &ExecBatch<'_>,
    (ropes, layer_rope): (&[RopeTable], &[usize]),
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
            let x = &mut s.x[row * h..(row + 1) * h];
            w.tok_embd.dequantize_row(tok as usize, x);
            if let Some(e) = c.embed_scale {
                for v in x.iter_mut() {
                    *v *= e;
                }
            }
            row += 1;
        }
    }

    s.prof.mark(0);
    let scale = c.attn_scale;
    // The attention norm of layer 0 here; later ones are fused with the residual add.
    if let Some(l0) = w.layers.first() {
        norm_rows(pool, &s.x, &mut s.xn, t_n, h, &l0.attn_norm, eps);
    }
    let n_layers = w.layers.len();
    for (li, (lw, kv)) in w.layers.iter().zip(layers.iter_mut()).enumerate() {
        // Attention block (s.xn holds attn_norm(x)).
        let table = &ropes[layer_rope[li]];
        let (rope_cos, rope_sin) = (&table.cos[..], &table.sin[..]);
        let window = c.layers[li].kind.window();
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
            // One sequence (e.g. batch-1 decode): one call, which spreads the context's
            // segments (a decode token, or one with its drafts) or the (token tile, kv group)
            // items (a longer chunk) over the pool. A chunk with drafts gets the bits of
            // decoding its tokens one by one (fixed context segments; kernels'
            // `attention_invariance.rs`).
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
                window,
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
            let task_args = |ti: usize| {
                let (si, a, e) = tasks[ti];
                let seq = &batch.seqs[si];
                PagedAttnArgs {
                    block_table: seq.block_table,
                    block_size,
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    start_pos: seq.start_pos + a,
                    n_tokens: e - a,
                    scale,
                    window,
                }
            };
            pool.parallel_for(tasks.len(), &|ti| {
                let (si, a, e) = tasks[ti];
                let base = seq_off[si];
                let args = task_args(ti);
                // The next task's first K/V chunk, fetched while this one computes (the kernel
                // prefetches each further chunk itself).
                if ti + 1 < tasks.len() {
                    prefetch_context::<T>(&task_args(ti + 1), kk, vv, ATTN_PREFETCH_POSITIONS);
                }
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
        if let Some(pn) = &lw.post_attn_norm {
            norm_rows_inplace(pool, &mut s.tmp, t_n, h, pn, eps);
        }
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
                    let o = &mut out[i * f..(i + 1) * f];
                    match c.ffn_act {
                        FfnAct::SwiGlu => cachet_kernels::act::swiglu(g, u, o),
                        FfnAct::GeGlu => geglu(gelu_table(), g, u, o),
                    }
                }
            });
        }
        s.prof.mark(1);
        matmul(&lw.down, pool, &s.act[..t_n * f], t_n, &mut s.tmp);
        s.prof.mark(5);
        if let Some(pn) = &lw.post_ffn_norm {
            norm_rows_inplace(pool, &mut s.tmp, t_n, h, pn, eps);
        }
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
    if let Some(cap) = c.logit_softcap {
        for x in &mut s.logits[..n_s * v] {
            *x = cap * (*x / cap).tanh();
        }
    }
    s.prof.mark(6);
}
