//! A deterministic simulated model for tests and scheduler benchmarks.
//!
//! It is a real consumer of the paged KV layout: for every computed token it writes a KV
//! fingerprint `fp(pos) = mix(fp(pos-1), token, pos)` into the block arena at
//! `block_table[pos / B] * B + pos % B`, reading `fp(pos-1)` back through the block table. A
//! sampled token is derived from every fingerprint of the context, read back through the table.
//! So a wrong block served from the cache, a stale block or a block overwritten while shared
//! changes its output. Costs per prefill token and per decode sequence make it useful for timing.

use std::time::Duration;

use cachet_core::exec::{ExecBatch, ExecError, ExecOutput, Executor, Sampled};
use cachet_core::BlockId;

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Sampled tokens are drawn from `first_token..first_token + vocab_size`.
    pub first_token: u32,
    pub vocab_size: u32,
    /// The model's EOS token.
    pub eos_token_id: u32,
    /// When set, the n-th generated token of every request is EOS (n counted from 1).
    pub eos_at_output: Option<usize>,
    /// Wall time per computed prompt token (prefill chunks).
    pub prefill_cost_per_token: Duration,
    /// Wall time per decoding sequence in a step.
    pub decode_cost_per_seq: Duration,
    /// Part of the model identity (and so of the hash seed).
    pub model_name: String,
    /// Derive sampled tokens from every fingerprint of the context (O(context) per token, so
    /// any wrong, stale or overwritten block anywhere changes the output). Off: only the last
    /// position's fingerprint is read (its chain still covers every earlier token as it was
    /// when written) — for scheduler benchmarks at zero model cost.
    pub full_context_check: bool,
    /// Fault injection: panic on the step that computes this token sequence (tests of the
    /// engine's failure path).
    pub panic_on: Option<Vec<u32>>,
    /// A scripted reply: when set, every request's n-th generated token is `reply[n - 1]` and
    /// the token after the last is EOS (later ones, under `ignore_eos`, are the usual draws).
    /// The output then no longer depends on the KV, so with `full_context_check` each sample
    /// instead verifies every fingerprint of its context against the chain recomputed from the
    /// context's tokens, and fails the step on a wrong, stale or overwritten block.
    pub reply: Option<Vec<u32>>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            num_blocks: 1024,
            block_size: 16,
            // The byte tokenizer's printable ASCII (`cachet_text::ByteTokenizer`: byte b is
            // id b + 3): bytes 32..=126 are ids 35..=129.
            first_token: SIM_FIRST_PRINTABLE,
            vocab_size: 95,
            eos_token_id: SIM_EOS,
            eos_at_output: None,
            prefill_cost_per_token: Duration::ZERO,
            decode_cost_per_seq: Duration::ZERO,
            model_name: "cachet-sim".into(),
            full_context_check: true,
            panic_on: None,
            reply: None,
        }
    }
}

/// The id of the first printable ASCII byte (space) in the byte tokenizer the simulator pairs
/// with (`cachet_text::ByteTokenizer`).
pub const SIM_FIRST_PRINTABLE: u32 = 35;
/// That tokenizer's EOS id.
pub const SIM_EOS: u32 = 2;

pub struct SimExecutor {
    cfg: SimConfig,
    arena: Vec<u64>,
}

const SEED: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(a: u64, b: u64) -> u64 {
    // splitmix64 over a ^ rotated b
    let mut z = a ^ b.rotate_left(29) ^ 0xbf58_476d_1ce4_e5b9;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SimExecutor {
    pub fn new(cfg: SimConfig) -> Self {
        let arena = vec![0; cfg.num_blocks * cfg.block_size];
        SimExecutor { cfg, arena }
    }

    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// Arena index of position `pos` through the block table.
    #[inline]
    fn slot(&self, table: &[u32], pos: usize) -> Result<usize, ExecError> {
        let b = self.cfg.block_size;
        match table.get(pos / b) {
            Some(&block) if (block as usize + 1) * b <= self.arena.len() => {
                Ok(block as usize * b + pos % b)
            }
            other => Err(Self::bad_slot(pos, other.copied())),
        }
    }

    /// `token` with a logprob drawn from `h` and up to 5 alternatives (the first tokens of the
    /// vocabulary, -1, -2, ...); a token among them has its alternative's logprob, as under a
    /// real distribution.
    fn sim_logprobs(&self, h: u64, token: u32, k: u32) -> Sampled {
        let top: Vec<(u32, f32)> = (0..k.min(5))
            .map(|j| (self.cfg.first_token + j, -1.0 - j as f32))
            .collect();
        let logprob = match top.iter().find(|(t, _)| *t == token) {
            Some(&(_, lp)) => lp,
            None => -((h >> 40) as f32 / (1u64 << 24) as f32) - 0.01,
        };
        Sampled {
            token,
            logprob,
            top_logprobs: top,
        }
    }

    #[cold]
    fn bad_slot(pos: usize, block: Option<u32>) -> ExecError {
        ExecError::Failed(match block {
            None => format!("position {pos} is outside the block table"),
            Some(b) => format!("block {b} is outside the arena"),
        })
    }
}

impl Executor for SimExecutor {
    fn model_fingerprint(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(b"cachet-sim/v1\0");
        h.update(self.cfg.model_name.as_bytes());
        h.update(&self.cfg.first_token.to_le_bytes());
        h.update(&self.cfg.vocab_size.to_le_bytes());
        *h.finalize().as_bytes()
    }

    fn kv_layout(&self) -> String {
        "sim:u64".into()
    }

    /// A block's fingerprints, little-endian: exactly what a tier would have held.
    fn block_bytes(&self) -> usize {
        self.cfg.block_size * 8
    }

    fn save_block(&self, block: BlockId, out: &mut Vec<u8>) -> Result<(), ExecError> {
        let b = self.cfg.block_size;
        let start = block as usize * b;
        let cells = self
            .arena
            .get(start..start + b)
            .ok_or_else(|| Self::bad_slot(start, Some(block)))?;
        out.extend(cells.iter().flat_map(|v| v.to_le_bytes()));
        Ok(())
    }

    fn execute(&mut self, batch: &ExecBatch<'_>) -> Result<ExecOutput, ExecError> {
        if let Some(seq) = &self.cfg.panic_on {
            let hit = batch.seqs.iter().any(|s| {
                !seq.is_empty() && s.tokens.windows(seq.len()).any(|w| w == seq.as_slice())
            });
            if hit {
                panic!("simulated executor: injected panic");
            }
        }
        let b = self.cfg.block_size;
        for &(src, dst) in &batch.copies {
            let (s0, d0) = (src as usize * b, dst as usize * b);
            if s0 + b > self.arena.len() || d0 + b > self.arena.len() {
                return Err(Self::bad_slot(s0.max(d0), Some(src.max(dst))));
            }
            self.arena.copy_within(s0..s0 + b, d0);
        }
        let mut out = ExecOutput::default();
        for load in &batch.loads {
            let want = self.block_bytes();
            if load.data.len() != want {
                return Err(ExecError::BadLoad {
                    block: load.block,
                    got: load.data.len(),
                    want,
                });
            }
            let start = load.block as usize * b;
            let cells = self
                .arena
                .get_mut(start..start + b)
                .ok_or_else(|| Self::bad_slot(start, Some(load.block)))?;
            for (c, bytes) in cells.iter_mut().zip(load.data.chunks_exact(8)) {
                let mut w = [0u8; 8];
                w.copy_from_slice(bytes);
                *c = u64::from_le_bytes(w);
            }
        }
        let timed =
            !self.cfg.prefill_cost_per_token.is_zero() || !self.cfg.decode_cost_per_seq.is_zero();
        let (mut prefill_tokens, mut decode_seqs) = (0u32, 0u32);
        let vocab = self.cfg.vocab_size.max(1) as u64;
        out.sampled.reserve(batch.seqs.len());
        // Each sequence's KV lives in its own blocks: request those lines first, so that the
        // misses of a thousand decodes overlap instead of queueing one by one.
        for seq in &batch.seqs {
            let pos = seq.start_pos.saturating_sub(1);
            if let Ok(idx) = self.slot(seq.block_table, pos) {
                prefetch(&self.arena[idx]);
            }
        }
        for seq in &batch.seqs {
            let mut prev = match seq.start_pos {
                0 => SEED,
                p => self.arena[self.slot(seq.block_table, p - 1)?],
            };
            for (i, &tok) in seq.tokens.iter().enumerate() {
                let pos = seq.start_pos + i;
                let idx = self.slot(seq.block_table, pos)?;
                prev = mix(prev, (tok as u64) << 32 | pos as u64);
                self.arena[idx] = prev;
            }
            if timed {
                let prompt_len = seq.sample.as_ref().map_or(0, |s| s.prompt.len());
                let drafts = seq.sample.as_ref().map_or(0, |s| s.drafts.len());
                let known = seq.tokens.len() - drafts;
                if known > 1 || seq.start_pos + known <= prompt_len {
                    prefill_tokens += seq.tokens.len() as u32;
                } else {
                    decode_seqs += 1;
                }
            }
            if let Some(lp) = &seq.prompt_logprobs {
                // The "logprob" of the next prompt token, a function of the context's KV.
                let mut v = Vec::with_capacity(lp.targets.len());
                for (j, &t) in lp.targets.iter().enumerate() {
                    let fp = self.arena[self.slot(seq.block_table, seq.start_pos + j)?];
                    let h = mix(fp, t as u64);
                    v.push(self.sim_logprobs(h, t, lp.top));
                }
                out.prompt_logprobs.push((out.sampled.len(), v));
            }
            let Some(spec) = &seq.sample else {
                out.sampled.push(None);
                continue;
            };
            // Position j of a chunk with drafts is sampled while the draws so far equal the
            // drafts; each sample reads the context up to its own position only.
            let k = spec.drafts.len();
            let base_end = seq.start_pos + seq.tokens.len() - k;
            let mut extra = Vec::new();
            for j in 0..=k {
                let end = base_end + j;
                let mut h = SEED;
                if self.cfg.full_context_check {
                    for pos in 0..end {
                        h = mix(h, self.arena[self.slot(seq.block_table, pos)?]);
                    }
                    if self.cfg.reply.is_some() {
                        self.verify_chain(seq.block_table, spec, end)?;
                    }
                } else {
                    // The last position, read back through the table like every other.
                    h = mix(h, self.arena[self.slot(seq.block_table, end - 1)?]);
                }
                let n_out = spec.output.len() + 1 + j;
                let token = match self.scripted(n_out) {
                    Some(t) => t,
                    None if self.cfg.eos_at_output == Some(n_out) => self.cfg.eos_token_id,
                    None => self.cfg.first_token + (h % vocab) as u32,
                };
                let token = self.steer(h, token, spec.params);
                let draw = |h: u64, token: u32| match spec.params.logprobs {
                    Some(k) => self.sim_logprobs(h, token, k),
                    None => Sampled::token(token),
                };
                if j == 0 && !spec.forks.is_empty() {
                    // Further independent draws from the same context (a forked request), each
                    // under its own sampling (bias, constraint).
                    let extra = (1..)
                        .zip(spec.forks)
                        .map(|(i, params)| {
                            let hi = mix(h, 0x5eed_0000 + i as u64);
                            let t = self
                                .scripted(n_out)
                                .unwrap_or(self.cfg.first_token + (hi % vocab) as u32);
                            draw(hi, self.steer(hi, t, params))
                        })
                        .collect();
                    out.forks.push((out.sampled.len(), extra));
                }
                if j == 0 {
                    out.sampled.push(Some(draw(h, token)));
                } else {
                    extra.push(draw(h, token));
                }
                if j == k || spec.drafts[j] != token {
                    break;
                }
            }
            if !extra.is_empty() {
                out.spec.push((out.sampled.len() - 1, extra));
            }
        }
        if timed {
            let cost = self.cfg.prefill_cost_per_token * prefill_tokens
                + self.cfg.decode_cost_per_seq * decode_seqs;
            std::thread::sleep(cost);
        }
        Ok(out)
    }
}

impl SimExecutor {
    /// The scripted reply's `n_out`-th token (counted from 1): the reply's token, EOS just
    /// after it, `None` past that or without a script.
    fn scripted(&self, n_out: usize) -> Option<u32> {
        let reply = self.cfg.reply.as_ref()?;
        match n_out.checked_sub(1).and_then(|i| reply.get(i)) {
            Some(&t) => Some(t),
            None if n_out == reply.len() + 1 => Some(self.cfg.eos_token_id),
            None => None,
        }
    }

    /// Check that positions `0..end` hold the fingerprint chain of the context's tokens (the
    /// committed tokens, then the drafts): a wrong, stale or overwritten block fails the step.
    fn verify_chain(
        &self,
        table: &[u32],
        spec: &cachet_core::exec::SampleSpec<'_>,
        end: usize,
    ) -> Result<(), ExecError> {
        let context = spec
            .prompt
            .iter()
            .chain(spec.output)
            .chain(spec.drafts)
            .take(end);
        let mut prev = SEED;
        for (pos, &tok) in context.enumerate() {
            prev = mix(prev, (tok as u64) << 32 | pos as u64);
            if self.arena[self.slot(table, pos)?] != prev {
                return Err(ExecError::Failed(format!(
                    "simulated executor: the KV at position {pos} does not hold its context's \
                     fingerprint (a wrong, stale or overwritten block)"
                )));
            }
        }
        Ok(())
    }

    /// The simulator's answer to `logit_bias` and a constraint (its "logits" are flat over
    /// `first_token..first_token + vocab_size`): a bias of +50 or more forces the token (the
    /// largest such bias, lowest id on ties), -50 or less bans it (the choice moves to another
    /// token of the range, derived from `h`); smaller biases change nothing. A constraint that
    /// refuses the token moves the choice to an allowed token of the range (any allowed token
    /// when none of the range is), derived from `h`; then it accepts the token.
    fn steer(&self, h: u64, mut token: u32, params: &cachet_core::SamplingParams) -> u32 {
        let (first, n) = (self.cfg.first_token, self.cfg.vocab_size.max(1));
        if !params.logit_bias.is_empty() {
            let banned = |t: u32| params.logit_bias.iter().any(|&(b, v)| b == t && v <= -50.0);
            let forced = params
                .logit_bias
                .iter()
                .filter(|&&(_, v)| v >= 50.0)
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
            if let Some(&(t, _)) = forced {
                token = t;
            } else if banned(token) {
                let rest: Vec<u32> = (first..first + n).filter(|&t| !banned(t)).collect();
                if !rest.is_empty() {
                    token = rest[(mix(h, 1) % rest.len() as u64) as usize];
                }
            }
        }
        if let Some(c) = &params.constraint {
            if !c.allows(token) {
                let mut mask = Vec::new();
                c.fill_mask(&mut mask);
                let on = |t: u32| {
                    mask.get(t as usize / 32)
                        .is_some_and(|w| w & (1 << (t % 32)) != 0)
                };
                let mut cand: Vec<u32> = (first..first + n).filter(|&t| on(t)).collect();
                if cand.is_empty() {
                    cand = (0..mask.len() as u32 * 32).filter(|&t| on(t)).collect();
                }
                if !cand.is_empty() {
                    token = cand[(mix(h, 2) % cand.len() as u64) as usize];
                }
            }
            c.accept(token);
        }
        token
    }
}

/// The steady decode workload of the step benchmark (`benches/engine.rs`,
/// `examples/steptime.rs`): request `i` has an 8-token prompt and generates `64 + i % 128`
/// tokens ignoring EOS, so a few requests finish (and are replaced) in every step.
pub fn decode_workload_request(i: u64) -> cachet_core::RequestDraft {
    let prompt: Vec<u32> = (0..8).map(|j| ((i * 8 + j) % 40_000) as u32).collect();
    cachet_core::RequestDraft::new(
        format!("r{i}"),
        prompt,
        cachet_core::SamplingParams {
            ignore_eos: true,
            ..cachet_core::SamplingParams::greedy(64 + (i % 128) as u32)
        },
    )
}

/// The full cache insight without the pieces `ablate` names (comma-separated: `history`,
/// `index`, `shadow`, `tenants`; others are ignored): the step benchmark's `CACHET_ABLATE`.
pub fn insight_without(ablate: &str) -> cachet_core::recorder::InsightConfig {
    let mut cfg = cachet_core::recorder::InsightConfig::full();
    for part in ablate.split(',') {
        match part {
            "history" => cfg.request_history = 0,
            "index" => cfg.block_index = false,
            "shadow" => cfg.shadow_blocks = Some(0),
            "tenants" => cfg.max_tenant_labels = None,
            _ => {}
        }
    }
    cfg
}

/// Validate and add request `i` of the decode workload under handle `i`.
pub fn add_decode_workload_request(
    core: &mut crate::step::EngineCore<SimExecutor>,
    i: u64,
) -> Option<u32> {
    let limits = core.scheduler().config().limits();
    let v = limits.validate(decode_workload_request(i)).ok()?;
    core.add_request(i, 0.0, v).ok()
}

/// An engine core for that workload with `n` requests running (one prefill step taken):
/// `16 n` blocks, `n` sequences, zero model cost, the last-position read of the simulator.
pub fn decode_workload_core(n: u64, telemetry: bool) -> crate::step::EngineCore<SimExecutor> {
    decode_workload_core_with(n, telemetry, cachet_core::recorder::InsightConfig::off())
}

/// [`decode_workload_core`] with the recorder keeping `insight`.
pub fn decode_workload_core_with(
    n: u64,
    telemetry: bool,
    insight: cachet_core::recorder::InsightConfig,
) -> crate::step::EngineCore<SimExecutor> {
    let cfg = cachet_core::SchedulerConfig {
        num_blocks: 16 * n as usize,
        max_num_seqs: n as usize,
        max_num_batched_tokens: 8192.max(8 * n as usize),
        max_waiting_requests: usize::MAX,
        ..Default::default()
    };
    let sim = SimExecutor::new(SimConfig {
        num_blocks: cfg.num_blocks,
        full_context_check: false,
        ..Default::default()
    });
    let mut core = crate::step::EngineCore::new(
        cfg,
        sim,
        crate::step::CoreOptions {
            telemetry,
            insight,
            ..Default::default()
        },
    );
    for i in 0..n {
        if add_decode_workload_request(&mut core, i).is_none() {
            break;
        }
    }
    let _ = core.step(|| 0.0);
    core
}

/// Hint the CPU to load the cache line holding `v` (no effect on results).
#[inline(always)]
fn prefetch<T>(v: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, and `v` is a valid reference anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (v as *const T).cast::<i8>(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_core::recorder::InsightConfig;

    /// The benches' ablation takes out exactly the pieces named.
    #[test]
    fn insight_without_takes_out_the_named_pieces() {
        assert_eq!(insight_without(""), InsightConfig::full());
        let cfg = insight_without("index,shadow");
        assert_eq!(
            cfg,
            InsightConfig {
                block_index: false,
                shadow_blocks: Some(0),
                ..InsightConfig::full()
            }
        );
        let all = insight_without("history,index,shadow,tenants");
        assert_eq!(
            (
                all.request_history,
                all.block_index,
                all.shadow_blocks,
                all.max_tenant_labels
            ),
            (0, false, Some(0), None)
        );
    }
}
