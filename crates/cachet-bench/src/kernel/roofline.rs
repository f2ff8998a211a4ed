//! The roofline of `cachet bench kernel`: this machine's limits, measured here with the
//! bench's thread count (`cachet_kernels::probe`: int8 multiply-add peak per ISA level, f32
//! FMA peak, streaming read bandwidth), and per phase of an executor step — qkv, attention,
//! o/ffn, lm_head, the rest — the time, the achieved rate and its fraction of the limit, for
//! prefill, batch-1 decode, batch-16 decode and a 16-token chunk after 1,984 cached
//! positions. The phase times come from the executor's own
//! profiling (`LlamaExecutor::set_profiling`).
//!
//! Work model of a step with `T` computed tokens, `S` sampled rows and, per sequence, a
//! context of `ctx` positions (all counted from the weights actually loaded):
//! * matmuls: `2 · T · rows · cols` int8 operations against the active level's int8 peak;
//!   their bytes are the repacked weights, streamed once per step;
//! * attention: `4 · n_heads · head_dim` f32 operations per (query token, context position)
//!   against the f32 FMA peak; its bytes are each sequence's K and V, read once per step;
//! * a phase's roofline time is `max(ops / peak, bytes / bandwidth)`, and "of roofline" is
//!   that time over the measured one (1.0 = at the machine's limit).

use cachet_core::SamplingParams;
use cachet_kernels::isa;
use cachet_kernels::probe::{self, Limits};
use cachet_kernels::{QMatrix, ThreadPool};
use cachet_model::gguf::Fused;
use cachet_model::{ExecutorConfig, KvDtype, LlamaExecutor, LoadedModel};
use serde::Serialize;

use super::cachet::{decode, step, tokens, Blocks, Seq};
use super::{KernelArgs, BLOCK};
use crate::error::BenchError;

/// This machine's limits at the bench's thread count.
#[derive(Clone, Debug, Serialize)]
pub struct MachineLimits {
    /// The level the kernels run (`isa::active()`).
    pub isa: String,
    pub threads: usize,
    /// Int8 peak (GOP/s) of every usable level.
    pub int8_gops: Vec<(String, Option<f64>)>,
    /// f32 FMA peak (GFLOP/s) of every usable level.
    pub f32_gflops: Vec<(String, Option<f64>)>,
    /// Streaming read bandwidth over a buffer several times the last-level cache (DRAM).
    pub read_gbs: f64,
    /// Streaming read bandwidth over a buffer the size of the weights a decode step reads,
    /// read again and again as decode does: where the last-level cache holds the weights
    /// (a 480 MiB L3 against 96 MB of weights, say) this is the cache's bandwidth, the
    /// limit batch-1 decode actually has; elsewhere it is about `read_gbs`.
    pub read_weights_gbs: f64,
}

impl MachineLimits {
    fn of(l: &Limits, read_weights_gbs: f64) -> MachineLimits {
        let name = |v: &[(isa::Isa, Option<f64>)]| {
            v.iter()
                .map(|(i, g)| (i.to_string(), *g))
                .collect::<Vec<_>>()
        };
        MachineLimits {
            isa: isa::active().to_string(),
            threads: l.threads,
            int8_gops: name(&l.int8_gops),
            f32_gflops: name(&l.f32_gflops),
            read_gbs: l.read_gbs,
            read_weights_gbs,
        }
    }

    fn active(v: &[(String, Option<f64>)], isa: &str) -> Option<f64> {
        v.iter().find(|p| p.0 == isa).and_then(|p| p.1)
    }

    pub fn int8(&self) -> Option<f64> {
        Self::active(&self.int8_gops, &self.isa)
    }

    pub fn f32(&self) -> Option<f64> {
        Self::active(&self.f32_gflops, &self.isa)
    }
}

/// One phase of a step.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseRow {
    pub phase: String,
    /// Milliseconds per step.
    pub ms: f64,
    /// Fraction of the step.
    pub share: f64,
    /// Achieved compute rate (GOP/s for int8 matmuls, GFLOP/s for attention).
    pub gops: Option<f64>,
    /// `gops` over the matching peak.
    pub of_peak: Option<f64>,
    /// Achieved bytes per second of the phase's minimum traffic, GB/s.
    pub gbs: Option<f64>,
    pub of_bw: Option<f64>,
    /// Roofline time over measured time.
    pub of_roofline: Option<f64>,
}

/// One measured situation (prefill, batch-1 decode, batch-16 decode).
#[derive(Clone, Debug, Serialize)]
pub struct Scenario {
    pub name: String,
    pub steps: usize,
    pub tokens_per_step: usize,
    pub step_ms: f64,
    pub tok_s: f64,
    pub rows: Vec<PhaseRow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RooflineReport {
    pub limits: MachineLimits,
    /// Bytes of weights a decode step streams (every layer matrix and the lm_head).
    pub weight_bytes: u64,
    pub scenarios: Vec<Scenario>,
    /// Batch-1 decode: weight bytes per token × tokens/s over the read bandwidth.
    pub decode_bw_fraction: Option<f64>,
    /// The same over the read bandwidth at the weights' size.
    pub decode_ws_fraction: Option<f64>,
}

/// What one token costs, from the loaded weights.
struct Work {
    qkv_macs: f64,
    qkv_bytes: f64,
    ofn_macs: f64,
    ofn_bytes: f64,
    head_macs: f64,
    head_bytes: f64,
    /// K and V bytes of one position over all layers (f16 KV).
    kv_bytes_per_pos: f64,
    /// f32 operations per (query token, context position) over all layers.
    attn_flops_per_pos: f64,
}

fn mat(q: &QMatrix) -> (f64, f64) {
    ((q.rows() * q.cols()) as f64, q.storage_bytes() as f64)
}

fn fused(f: &Fused) -> (f64, f64) {
    match f {
        Fused::One(q) => mat(q),
        Fused::Many(v) => v
            .iter()
            .map(mat)
            .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1)),
    }
}

impl Work {
    fn of(model: &LoadedModel) -> Work {
        let w = &model.weights;
        let c = &w.config;
        let mut k = Work {
            qkv_macs: 0.0,
            qkv_bytes: 0.0,
            ofn_macs: 0.0,
            ofn_bytes: 0.0,
            head_macs: 0.0,
            head_bytes: 0.0,
            kv_bytes_per_pos: (c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2) as f64,
            attn_flops_per_pos: (c.n_layers * 4 * c.n_heads * c.head_dim) as f64,
        };
        for l in &w.layers {
            let (m, b) = fused(&l.qkv);
            k.qkv_macs += m;
            k.qkv_bytes += b;
            for (m, b) in [mat(&l.wo), fused(&l.gate_up), mat(&l.down)] {
                k.ofn_macs += m;
                k.ofn_bytes += b;
            }
        }
        (k.head_macs, k.head_bytes) = mat(w.lm_head());
        k
    }
}

/// Phase totals of a run: profile seconds (by the executor's phase index), steps, computed
/// tokens, sampled rows, Σ context positions attended by query tokens, Σ context of each
/// sequence per step (its KV read), and wall seconds.
#[derive(Default)]
struct Totals {
    prof: [f64; 8],
    steps: usize,
    tokens: usize,
    sampled: usize,
    attended: f64,
    kv_positions: f64,
    wall: f64,
}

impl Totals {
    fn add_profile(&mut self, exec: &LlamaExecutor) {
        for (acc, (_, s)) in self.prof.iter_mut().zip(exec.profile()) {
            *acc += s;
        }
    }
}

/// The short-chunk scenario: `CHUNK` tokens computed after `CHUNK_CTX` positions of KV (the
/// last block of a 2,000-token prompt after a KV load of the 124 full blocks before it).
const CHUNK: usize = 16;
const CHUNK_CTX: usize = 1984;

/// Measure the limits, then run the four scenarios (prefill, batch-1 and batch-16 decode, a
/// short chunk over a long context) with the executor's profiling on.
pub(super) fn roofline_side(
    a: &KernelArgs,
    model: &LoadedModel,
) -> Result<RooflineReport, BenchError> {
    let work = Work::of(model);
    let weight_bytes = (work.qkv_bytes + work.ofn_bytes + work.head_bytes) as u64;
    let limits = {
        let pool = ThreadPool::new(a.threads);
        let l = probe::measure(&pool, 512 << 20);
        MachineLimits::of(&l, probe::read_bandwidth(&pool, weight_bytes as usize))
    };
    eprintln!(
        "[kernel] limits at {} threads: int8 {:?} GOP/s, f32 {:?} GFLOP/s ({}), read {:.1} GB/s (at the weights' size {:.1})",
        limits.threads,
        limits.int8().map(|v| v.round()),
        limits.f32().map(|v| v.round()),
        limits.isa,
        limits.read_gbs,
        limits.read_weights_gbs
    );
    let reps = a.reps.max(1);
    let batch = 16usize;
    let per_seq = a.batch_ctx + reps * a.batch_steps + 2;
    let need = (batch * per_seq.div_ceil(BLOCK))
        .max((a.prompt + 1).div_ceil(BLOCK))
        .max((CHUNK_CTX + CHUNK + 1).div_ceil(BLOCK));
    let mut exec = model.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks: need,
        kv_dtype: KvDtype::F16,
    })?;
    let params = SamplingParams::greedy(u32::MAX);
    let mut blocks = Blocks {
        next: 0,
        total: need as u32,
    };
    let mut scenarios = Vec::new();

    // Prefill: one chunk of `prompt` tokens; the first run warms up.
    let ptoks = tokens(model, 1, a.prompt)?;
    let mut t = Totals::default();
    for r in 0..=reps {
        blocks.reset();
        let mut s = [Seq {
            slot: 0,
            table: blocks.table(a.prompt + 1)?,
            prompt: ptoks.clone(),
            output: Vec::new(),
            len: 0,
        }];
        exec.set_profiling(r > 0);
        let dt = step(&mut exec, &params, &mut s, std::slice::from_ref(&ptoks))?;
        if r > 0 {
            t.add_profile(&exec);
            t.steps += 1;
            t.tokens += a.prompt;
            t.sampled += 1;
            t.attended += (a.prompt * (a.prompt + 1) / 2) as f64;
            t.kv_positions += a.prompt as f64;
            t.wall += dt;
        }
    }
    exec.set_profiling(false);
    scenarios.push(scenario(
        format!("prefill pp{}", a.prompt),
        &t,
        &work,
        &limits,
    ));

    // Decode at batch 1 and batch 16, each sequence with `batch_ctx` tokens of context.
    for b in [1usize, batch] {
        blocks.reset();
        let mut seqs = Vec::with_capacity(b);
        for i in 0..b {
            seqs.push(Seq {
                slot: i as u32,
                table: blocks.table(per_seq)?,
                prompt: tokens(model, 200 + i as u64, a.batch_ctx)?,
                output: Vec::new(),
                len: 0,
            });
        }
        for lo in (0..b).step_by(8) {
            let hi = (lo + 8).min(b);
            let chunks: Vec<Vec<u32>> = seqs[lo..hi].iter().map(|s| s.prompt.clone()).collect();
            step(&mut exec, &params, &mut seqs[lo..hi], &chunks)?;
        }
        let mut t = Totals::default();
        for _ in 0..reps {
            let ctx: usize = seqs.iter().map(|s| s.len).sum();
            exec.set_profiling(true);
            let dt = decode(&mut exec, &params, &mut seqs, a.batch_steps)?;
            t.add_profile(&exec);
            exec.set_profiling(false);
            let n = a.batch_steps;
            t.steps += n;
            t.tokens += b * n;
            t.sampled += b * n;
            // Step k of the run: every sequence attends over its len + k + 1 positions.
            let pos = (ctx * n + b * n * (n + 1) / 2) as f64;
            t.attended += pos;
            t.kv_positions += pos;
            t.wall += dt;
        }
        scenarios.push(scenario(
            format!("decode batch {b} at ctx {}", a.batch_ctx),
            &t,
            &work,
            &limits,
        ));
    }
    // A short chunk over a long context: the last CHUNK tokens of a prompt after CHUNK_CTX
    // positions of KV are in place (a cached prefix, or a KV load from a tier).
    blocks.reset();
    let ctoks = tokens(model, 3, CHUNK_CTX + CHUNK)?;
    let mut s = [Seq {
        slot: 0,
        table: blocks.table(CHUNK_CTX + CHUNK + 1)?,
        prompt: ctoks.clone(),
        output: Vec::new(),
        len: 0,
    }];
    step(&mut exec, &params, &mut s, &[ctoks[..CHUNK_CTX].to_vec()])?;
    let mut t = Totals::default();
    let tail = ctoks[CHUNK_CTX..].to_vec();
    for r in 0..=reps {
        s[0].len = CHUNK_CTX;
        s[0].output.clear();
        exec.set_profiling(r > 0);
        let dt = step(&mut exec, &params, &mut s, std::slice::from_ref(&tail))?;
        if r > 0 {
            t.add_profile(&exec);
            t.steps += 1;
            t.tokens += CHUNK;
            t.sampled += 1;
            t.attended += (CHUNK * CHUNK_CTX + CHUNK * (CHUNK + 1) / 2) as f64;
            t.kv_positions += (CHUNK_CTX + CHUNK) as f64;
            t.wall += dt;
        }
    }
    exec.set_profiling(false);
    scenarios.push(scenario(
        format!("chunk of {CHUNK} after {CHUNK_CTX} cached"),
        &t,
        &work,
        &limits,
    ));

    let fraction = |gbs: f64| {
        scenarios
            .get(1)
            .map(|s| weight_bytes as f64 * s.tok_s / (gbs * 1e9))
    };
    let (decode_bw_fraction, decode_ws_fraction) =
        (fraction(limits.read_gbs), fraction(limits.read_weights_gbs));
    Ok(RooflineReport {
        limits,
        weight_bytes,
        scenarios,
        decode_bw_fraction,
        decode_ws_fraction,
    })
}

/// The phase rows of one scenario from its totals.
fn scenario(name: String, t: &Totals, w: &Work, lim: &MachineLimits) -> Scenario {
    let steps = t.steps.max(1) as f64;
    let step_s = t.wall / steps;
    let bw = lim.read_gbs * 1e9;
    let tok = t.tokens as f64;
    let int8 = lim.int8().map(|g| g * 1e9);
    let f32p = lim.f32().map(|g| g * 1e9);
    let p = &t.prof;
    // Per phase: seconds and, where the work model covers it, (ops, peak ops/s, bytes).
    type Model = Option<(f64, Option<f64>, f64)>;
    let phases: [(&str, f64, Model); 5] = [
        (
            "qkv",
            p[2],
            Some((2.0 * tok * w.qkv_macs, int8, w.qkv_bytes * steps)),
        ),
        (
            "attention",
            p[4],
            Some((
                w.attn_flops_per_pos * t.attended,
                f32p,
                w.kv_bytes_per_pos * t.kv_positions,
            )),
        ),
        (
            "o/ffn",
            p[5],
            Some((2.0 * tok * w.ofn_macs, int8, w.ofn_bytes * steps)),
        ),
        (
            "lm_head",
            p[6],
            Some((
                2.0 * t.sampled as f64 * w.head_macs,
                int8,
                w.head_bytes * steps,
            )),
        ),
        ("rest", p[0] + p[1] + p[3] + p[7], None),
    ];
    let rows = phases
        .iter()
        .map(|&(phase, secs, model)| {
            let mut row = PhaseRow {
                phase: phase.to_string(),
                ms: secs / steps * 1e3,
                share: if t.wall > 0.0 { secs / t.wall } else { 0.0 },
                gops: None,
                of_peak: None,
                gbs: None,
                of_bw: None,
                of_roofline: None,
            };
            if let Some((ops, peak, bytes)) = model {
                if secs > 0.0 {
                    row.gops = Some(ops / secs / 1e9);
                    row.of_peak = peak.map(|pk| ops / secs / pk);
                    row.gbs = Some(bytes / secs / 1e9);
                    row.of_bw = Some(bytes / secs / bw);
                    let roof = peak.map_or(bytes / bw, |pk| (ops / pk).max(bytes / bw));
                    row.of_roofline = Some(roof / secs);
                }
            }
            row
        })
        .collect();
    Scenario {
        name,
        steps: t.steps,
        tokens_per_step: t.tokens / t.steps.max(1),
        step_ms: step_s * 1e3,
        tok_s: if t.wall > 0.0 { tok / t.wall } else { 0.0 },
        rows,
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or(String::new(), |v| format!("{:.0} %", v * 100.0))
}

fn num(v: Option<f64>) -> String {
    v.map_or(String::new(), |v| {
        if v >= 100.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    })
}

/// The limits line and one table per scenario.
pub fn render(r: &RooflineReport, markdown: bool) -> String {
    let l = &r.limits;
    let peaks = |v: &[(String, Option<f64>)]| {
        v.iter()
            .filter_map(|(i, g)| g.map(|g| format!("{i} {g:.0}")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut s = format!(
        "Machine limits at {} threads (measured): int8 GOP/s: {}; f32 FMA GFLOP/s: {}; read {:.1} GB/s (DRAM), {:.1} GB/s at the weights' size. Kernels run `{}`; weights streamed per decode step: {:.1} MB.\n",
        l.threads,
        peaks(&l.int8_gops),
        peaks(&l.f32_gflops),
        l.read_gbs,
        l.read_weights_gbs,
        l.isa,
        r.weight_bytes as f64 / 1e6
    );
    if let (Some(f), Some(w)) = (r.decode_bw_fraction, r.decode_ws_fraction) {
        s.push_str(&format!(
            "Batch-1 decode streams weights at {:.0} % of the measured read bandwidth, {:.0} % of the read bandwidth at the weights' size (the limit where the last-level cache holds them).\n",
            f * 100.0,
            w * 100.0
        ));
    }
    let header: Vec<String> = [
        "phase",
        "ms / step",
        "share",
        "GOP/s",
        "of peak",
        "GB/s",
        "of bandwidth",
        "of roofline",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for sc in &r.scenarios {
        s.push_str(&format!(
            "\n{} — {} steps of {} tokens, {:.2} ms / step, {:.1} tok/s (matmul GOP/s are int8 against the int8 peak; attention is f32 against the f32 peak)\n\n",
            sc.name, sc.steps, sc.tokens_per_step, sc.step_ms, sc.tok_s
        ));
        let rows: Vec<Vec<String>> = sc
            .rows
            .iter()
            .map(|p| {
                vec![
                    p.phase.clone(),
                    format!("{:.3}", p.ms),
                    format!("{:.0} %", p.share * 100.0),
                    num(p.gops),
                    pct(p.of_peak),
                    num(p.gbs),
                    pct(p.of_bw),
                    pct(p.of_roofline),
                ]
            })
            .collect();
        s.push_str(&crate::report::render(&header, &rows, markdown));
    }
    s
}
