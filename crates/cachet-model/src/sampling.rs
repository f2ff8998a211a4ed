//! Turning logits into tokens.
//!
//! Order of operations (as in vLLM): `logit_bias`, min-tokens masking, repetition / presence /
//! frequency penalties, then greedy argmax (temperature 0 or top-k 1) or temperature → top-k →
//! softmax → top-p → min-p → a draw. Logprobs are always the log-softmax of the raw logits.
//!
//! A request's [`Constraint`](cachet_core::request::Constraint) (structured outputs) is asked
//! about the chosen token only: when it refuses it, the full mask is computed, every refused
//! token's logit set to -inf, and the token chosen again the same way (the same seeded draw).
//! The constraint then accepts the final token.
//!
//! A seeded draw depends only on `(seed, number of tokens generated so far)`: the same seed gives
//! the same output whatever else runs in the batch.

use cachet_core::request::SamplingParams;
use cachet_core::{Sampled, TokenId};

use crate::math::exp_f32;

/// Reusable buffers for sampling (kept by the executor: no per-step large allocations).
#[derive(Default)]
pub struct SamplerScratch {
    work: Vec<f32>,
    counts: Vec<u32>,
    touched: Vec<u32>,
    cand: Vec<(u32, f32)>,
    mask: Vec<u32>,
}

/// What a sampler needs besides the logits.
pub struct SampleInput<'a> {
    pub params: &'a SamplingParams,
    pub prompt: &'a [TokenId],
    pub output: &'a [TokenId],
    /// The model's EOS tokens (masked until `min_tokens` are generated).
    pub eos_token_ids: &'a [TokenId],
    /// Used when `params.seed` is `None`.
    pub fallback_seed: u64,
}

/// SplitMix64 step.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `[0, 1)` that depends only on `seed` and `step`.
pub fn uniform(seed: u64, step: u64) -> f64 {
    let x = splitmix64(splitmix64(seed) ^ splitmix64(step.wrapping_add(0x5851_F42D_4C95_7F2D)));
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Index of the largest value, lowest index on ties; NaN never wins.
pub fn argmax(xs: &[f32]) -> usize {
    // 16 independent lanes (lane l sees elements l, l+16, ...; a strict `>` keeps each lane's
    // first maximum), so the loop vectorises; then the lanes are merged, lowest index on
    // ties. NaN never wins; with no value above -inf the answer is 0.
    const L: usize = 16;
    let mut bv = [f32::NEG_INFINITY; L];
    let mut bi = [0u32; L];
    let chunks = xs.chunks_exact(L);
    let rest = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        for l in 0..L {
            let better = chunk[l] > bv[l];
            bv[l] = if better { chunk[l] } else { bv[l] };
            bi[l] = if better { c as u32 } else { bi[l] };
        }
    }
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for l in 0..L {
        let i = bi[l] as usize * L + l;
        if bv[l] > best_v || (bv[l] == best_v && best_v > f32::NEG_INFINITY && i < best) {
            best_v = bv[l];
            best = i;
        }
    }
    let base = xs.len() - rest.len();
    for (j, &v) in rest.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = base + j;
        }
    }
    best
}

/// `log(sum(exp(x)))`, stable (8 independent lanes so the loops vectorise).
pub fn log_sum_exp(xs: &[f32]) -> f32 {
    let mut mx = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks.clone() {
        for i in 0..8 {
            mx[i] = if c[i] > mx[i] { c[i] } else { mx[i] };
        }
    }
    let m = rest
        .iter()
        .chain(mx.iter())
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    let mut acc = [0f32; 8];
    for c in chunks {
        for i in 0..8 {
            acc[i] += exp_f32(c[i] - m);
        }
    }
    let s: f64 = acc.iter().map(|&a| a as f64).sum::<f64>()
        + rest.iter().map(|&x| exp_f32(x - m) as f64).sum::<f64>();
    m + s.ln() as f32
}

/// The log-probability of `token` under `logits`' distribution (unpenalised, untempered, as
/// the model gives it), with the `top` most likely alternatives: a prompt token's logprob.
pub fn token_logprob(logits: &[f32], token: TokenId, top: u32, s: &mut SamplerScratch) -> Sampled {
    let lse = log_sum_exp(logits);
    Sampled {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| l - lse),
        top_logprobs: if top > 0 {
            top_logprobs(logits, lse, top as usize, &mut s.cand)
        } else {
            Vec::new()
        },
    }
}

/// The `n` largest logits as `(id, logprob)`, best first, lowest id on ties.
pub fn top_logprobs(
    logits: &[f32],
    lse: f32,
    n: usize,
    cand: &mut Vec<(u32, f32)>,
) -> Vec<(TokenId, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    cand.clear();
    cand.extend(logits.iter().enumerate().map(|(i, &v)| (i as u32, v)));
    let cmp = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if n < cand.len() {
        cand.select_nth_unstable_by(n - 1, cmp);
        cand.truncate(n);
    }
    cand.sort_by(cmp);
    cand.iter().map(|&(i, v)| (i, v - lse)).collect()
}

/// Whether [`apply_penalties`] would change anything for this request now.
fn changes_logits(inp: &SampleInput<'_>) -> bool {
    let p = inp.params;
    let rep = p.repetition_penalty;
    (inp.output.len() as u64) < p.min_tokens as u64
        || !p.logit_bias.is_empty()
        || (rep != 1.0 && rep > 0.0)
        || p.presence_penalty != 0.0
        || p.frequency_penalty != 0.0
}

/// Applies min-tokens masking and the penalties to `work` (a copy of the logits).
fn apply_penalties(work: &mut [f32], inp: &SampleInput<'_>, s: &mut SamplerScratch) {
    let p = inp.params;
    let vocab = work.len();
    for &(t, b) in &p.logit_bias {
        if let Some(w) = work.get_mut(t as usize) {
            *w += b;
        }
    }
    if (inp.output.len() as u64) < p.min_tokens as u64 {
        let eos = if p.ignore_eos {
            &[][..]
        } else {
            inp.eos_token_ids
        };
        for &t in eos.iter().chain(p.stop_token_ids.iter()) {
            if let Some(w) = work.get_mut(t as usize) {
                *w = f32::NEG_INFINITY;
            }
        }
    }
    let rep = p.repetition_penalty;
    if rep != 1.0 && rep > 0.0 {
        // Over prompt and output (each distinct token once).
        if s.counts.len() < vocab {
            s.counts.resize(vocab, 0);
        }
        s.touched.clear();
        for &t in inp.prompt.iter().chain(inp.output.iter()) {
            let t = t as usize;
            if t < vocab && s.counts[t] == 0 {
                s.counts[t] = 1;
                s.touched.push(t as u32);
                let w = &mut work[t];
                *w = if *w > 0.0 { *w / rep } else { *w * rep };
            }
        }
        for &t in &s.touched {
            s.counts[t as usize] = 0;
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        if s.counts.len() < vocab {
            s.counts.resize(vocab, 0);
        }
        s.touched.clear();
        for &t in inp.output {
            let t = t as usize;
            if t < vocab {
                if s.counts[t] == 0 {
                    s.touched.push(t as u32);
                }
                s.counts[t] += 1;
            }
        }
        for &t in &s.touched {
            let c = s.counts[t as usize];
            work[t as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
            s.counts[t as usize] = 0;
        }
    }
}

/// Samples one token from `logits` (one row, vocab-sized).
pub fn sample(logits: &[f32], inp: &SampleInput<'_>, s: &mut SamplerScratch) -> Sampled {
    let p = inp.params;
    let vocab = logits.len();
    if vocab == 0 {
        return Sampled::token(0);
    }
    let greedy = p.temperature <= 0.0 || p.top_k == 1 || !p.temperature.is_finite();
    let mut token = if greedy && !changes_logits(inp) {
        // The common case needs no copy of the logits.
        argmax(logits) as u32
    } else {
        let mut work = std::mem::take(&mut s.work);
        work.clear();
        work.extend_from_slice(logits);
        apply_penalties(&mut work, inp, s);
        let token = if greedy {
            argmax(&work) as u32
        } else {
            draw(&work, inp, s)
        };
        s.work = work;
        token
    };
    if let Some(c) = &p.constraint {
        if !c.allows(token) {
            token = constrained(logits, inp, s, greedy, c);
        }
        c.accept(token);
    }

    // The log-softmax over the whole vocabulary costs more than a greedy pick: only when asked.
    let (logprob, top) = match p.logprobs {
        Some(n) => {
            let lse = log_sum_exp(logits);
            let top = if n > 0 {
                top_logprobs(logits, lse, n as usize, &mut s.cand)
            } else {
                Vec::new()
            };
            (logits[token as usize] - lse, top)
        }
        None => (0.0, Vec::new()),
    };
    Sampled {
        token,
        logprob,
        top_logprobs: top,
    }
}

/// The token chosen again from `logits` with every token the constraint refuses at -inf (the
/// same bias, penalties and draw as the first choice). With nothing left (the constraint allows
/// only tokens that min-tokens masks), its first allowed token.
#[cold]
fn constrained(
    logits: &[f32],
    inp: &SampleInput<'_>,
    s: &mut SamplerScratch,
    greedy: bool,
    c: &cachet_core::request::Constraint,
) -> u32 {
    let mut mask = std::mem::take(&mut s.mask);
    c.fill_mask(&mut mask);
    let mut work = std::mem::take(&mut s.work);
    work.clear();
    work.extend_from_slice(logits);
    apply_penalties(&mut work, inp, s);
    let mut any = false;
    for (i, w) in work.iter_mut().enumerate() {
        let allowed = mask.get(i / 32).is_some_and(|m| m & (1 << (i % 32)) != 0);
        if !allowed {
            *w = f32::NEG_INFINITY;
        } else if *w > f32::NEG_INFINITY {
            any = true;
        }
    }
    let token = if !any {
        let first = mask
            .iter()
            .enumerate()
            .find(|(_, &m)| m != 0)
            .map(|(i, &m)| i as u32 * 32 + m.trailing_zeros());
        first.unwrap_or(0)
    } else if greedy {
        argmax(&work) as u32
    } else {
        draw(&work, inp, s)
    };
    s.work = work;
    s.mask = mask;
    token
}

/// Temperature → top-k → softmax → top-p → min-p → draw.
fn draw(work: &[f32], inp: &SampleInput<'_>, s: &mut SamplerScratch) -> u32 {
    let p = inp.params;
    let t = p.temperature;
    let cand = &mut s.cand;
    cand.clear();
    cand.extend(
        work.iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite() || **v == f32::INFINITY)
            .map(|(i, &v)| (i as u32, v / t)),
    );
    if cand.is_empty() {
        return argmax(work) as u32;
    }
    let cmp = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = p.top_k as usize;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, cmp);
        cand.truncate(k);
    }
    cand.sort_by(cmp);
    // Softmax over the candidates (sorted best first).
    let m = cand[0].1;
    let mut z = 0.0f64;
    for c in cand.iter_mut() {
        c.1 = exp_f32(c.1 - m);
        z += c.1 as f64;
    }
    for c in cand.iter_mut() {
        c.1 = (c.1 as f64 / z) as f32;
    }
    if p.top_p < 1.0 && p.top_p > 0.0 {
        let mut cum = 0.0f64;
        let mut keep = cand.len();
        for (i, c) in cand.iter().enumerate() {
            cum += c.1 as f64;
            if cum >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
    }
    if p.min_p > 0.0 {
        let thr = cand[0].1 * p.min_p;
        let keep = cand.iter().take_while(|c| c.1 >= thr).count();
        cand.truncate(keep.max(1));
    }
    let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
    let seed = p.seed.unwrap_or(inp.fallback_seed);
    let u = uniform(seed, inp.output.len() as u64) * total;
    let mut acc = 0.0f64;
    for c in cand.iter() {
        acc += c.1 as f64;
        if u < acc {
            return c.0;
        }
    }
    cand[cand.len() - 1].0
}

/// The candidate set after temperature/top-k/top-p/min-p, as `(id, probability)` best first
/// (renormalised). For tests and debugging.
pub fn filtered_distribution(logits: &[f32], params: &SamplingParams) -> Vec<(TokenId, f32)> {
    let mut s = SamplerScratch::default();
    let inp = SampleInput {
        params,
        prompt: &[],
        output: &[],
        eos_token_ids: &[],
        fallback_seed: 0,
    };
    let mut work = logits.to_vec();
    apply_penalties(&mut work, &inp, &mut s);
    let _ = draw(&work, &inp, &mut s);
    let total: f32 = s.cand.iter().map(|c| c.1).sum();
    s.cand.iter().map(|&(i, p)| (i, p / total)).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use cachet_core::request::{Shared, TokenConstraint};

    use super::*;

    /// Allows a fixed set of tokens; counts the calls the sampler makes.
    #[derive(Debug, Default)]
    struct Only {
        allowed: Vec<u32>,
        masks: AtomicUsize,
        accepted: Mutex<Vec<u32>>,
    }

    impl TokenConstraint for Only {
        fn allows(&self, t: u32) -> bool {
            self.allowed.contains(&t)
        }
        fn fill_mask(&self, mask: &mut Vec<u32>) {
            self.masks.fetch_add(1, Ordering::SeqCst);
            mask.clear();
            mask.resize(1, 0);
            for &t in &self.allowed {
                mask[0] |= 1 << t;
            }
        }
        fn accept(&self, t: u32) {
            self.accepted.lock().unwrap().push(t);
        }
        fn fork(&self) -> cachet_core::request::Constraint {
            cachet_core::request::Constraint::new(Only {
                allowed: self.allowed.clone(),
                ..Only::default()
            })
        }
    }

    fn run(logits: &[f32], p: &SamplingParams, output: &[u32], eos: &[u32]) -> u32 {
        let inp = SampleInput {
            params: p,
            prompt: &[],
            output,
            eos_token_ids: eos,
            fallback_seed: 7,
        };
        sample(logits, &inp, &mut SamplerScratch::default()).token
    }

    fn constrained_params(allowed: Vec<u32>) -> (SamplingParams, Arc<Only>) {
        let only = Arc::new(Only {
            allowed,
            ..Default::default()
        });
        let p = SamplingParams {
            constraint: Some(Shared(only.clone())),
            ..SamplingParams::greedy(4)
        };
        (p, only)
    }

    #[test]
    fn an_allowed_token_needs_no_mask_and_a_refused_one_moves_to_the_best_allowed() {
        let logits = [0.0, 3.0, 1.0, 2.0, -1.0];
        // Argmax 1 is allowed: no mask computed.
        let (p, only) = constrained_params(vec![1, 3]);
        assert_eq!(run(&logits, &p, &[], &[]), 1);
        assert_eq!(only.masks.load(Ordering::SeqCst), 0);
        assert_eq!(*only.accepted.lock().unwrap(), vec![1]);
        // Argmax 1 refused: the best of {2, 4} is 2, after one mask.
        let (p, only) = constrained_params(vec![2, 4]);
        assert_eq!(run(&logits, &p, &[], &[]), 2);
        assert_eq!(only.masks.load(Ordering::SeqCst), 1);
        assert_eq!(*only.accepted.lock().unwrap(), vec![2]);
    }

    #[test]
    fn a_seeded_draw_under_a_constraint_stays_inside_it() {
        let logits: Vec<f32> = (0..32).map(|i| (i as f32 * 0.7).sin()).collect();
        for seed in 0..50 {
            let (mut p, _) = constrained_params(vec![5, 9, 30]);
            p.temperature = 1.0;
            p.seed = Some(seed);
            let t = run(&logits, &p, &[], &[]);
            assert!([5, 9, 30].contains(&t), "seed {seed}: {t}");
        }
    }

    #[test]
    fn min_tokens_masking_everything_allowed_falls_back_to_the_constraints_first_token() {
        // The constraint allows only EOS (3), min_tokens masks it: EOS all the same.
        let (mut p, _) = constrained_params(vec![3]);
        p.min_tokens = 2;
        assert_eq!(run(&[0.0, 1.0, 0.5, 0.2], &p, &[], &[3]), 3);
    }

    #[test]
    fn logit_bias_moves_the_choice_and_leaves_logprobs_raw() {
        let logits = [0.0, 2.0, 1.0];
        let p = SamplingParams {
            logit_bias: vec![(2, 1.5)],
            logprobs: Some(0),
            ..SamplingParams::greedy(1)
        };
        let inp = SampleInput {
            params: &p,
            prompt: &[],
            output: &[],
            eos_token_ids: &[],
            fallback_seed: 0,
        };
        let s = sample(&logits, &inp, &mut SamplerScratch::default());
        // 1.0 + 1.5 = 2.5 > 2.0.
        assert_eq!(s.token, 2);
        let lse = (0f32.exp() + 2f32.exp() + 1f32.exp()).ln();
        assert!((s.logprob - (1.0 - lse)).abs() < 1e-5, "{}", s.logprob);
        // -100 bans the argmax; an out-of-vocabulary id is ignored.
        let p = SamplingParams {
            logit_bias: vec![(1, -100.0), (99, 100.0)],
            ..SamplingParams::greedy(1)
        };
        assert_eq!(run(&logits, &p, &[], &[]), 2);
    }
}
