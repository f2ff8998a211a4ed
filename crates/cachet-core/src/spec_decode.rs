//! Prompt-lookup speculative decoding (vLLM's `ngram` method, llama.cpp's lookup decoding).
//!
//! For a decoding request the proposer finds the most recent earlier occurrence of the
//! request's last `n` tokens (`n` from `prompt_lookup_max` down to `prompt_lookup_min`) in its
//! prompt and output so far, and proposes the up-to-`K` tokens that followed it. The scheduler
//! turns the decode chunk `[last]` into `[last, d1..dk]` at positions `p..=p+k`; the executor
//! verifies the drafts in the one forward ([`crate::exec::SampleSpec::drafts`]) and returns the
//! accepted drafts plus one token sampled after them.
//!
//! What keeps the accounting exact (spec: drafts move no counter):
//! * drafts only use slots of the block already allocated for position `p` (`k` is capped by
//!   that block's free slots, by `max_tokens - 1` still to generate, by the context and by the
//!   step's token budget, which counts drafts), so no block is allocated, evicted or filled
//!   because of a draft;
//! * the request's computed length advances by one committed token at a time, exactly as if
//!   the tokens had come one step each, so a block becomes full (hashed, cached, evented,
//!   saved to a tier) only when committed tokens fill it; KV written at rejected positions
//!   lies beyond the request's length, is never read (attention covers positions
//!   `< start_pos + j + 1` for the `j`-th sample) and is overwritten later;
//! * no drafts for a request in prefill, with a constraint (structured output) or with
//!   `n > 1` before its fork.
//!
//! Rejected drafts cost verification work (at batch 1 each draft token is one more row through
//! every layer and the lm_head, and one more attention pass over the whole context), so with
//! [`SpecConfig::adaptive`] a request whose drafts are rejected drafts less:
//! * **shorter drafts**: after a draft of which `a` tokens were accepted and one rejected, the
//!   request's next drafts carry at most `a + 1` tokens while none of its draft tokens has
//!   ever been accepted; once one has, the limit drops by one instead, or to `a + 1` if that
//!   is more. Each fully accepted draft raises it by one again (up to `K`). A copying
//!   request's rejections are single mismatches (the model changes one constant) after which
//!   the copy resumes: cutting its limit to `a + 1` at once took 2.60 tokens per step on
//!   `cachet bench spec`'s edit workload, this rule 3.06, while a request that has
//!   never had a draft taken keeps its one-token probes (docs/bench-runs/2026-12-05-xeon-amx-spec-*.md);
//! * **fewer drafts**: after `m >= 2` consecutive drafts with nothing accepted it passes over its
//!   next `2^(m-1) - 1` proposals (at most [`MAX_SKIP`]); its first accepted token ends the
//!   streak.
//!
//! Both read only the request's own past acceptances (never telemetry), so they are
//! deterministic; drafts never change what is sampled, so greedy output stays identical to
//! plain decoding whatever is drafted.
//!
//! This module is a child of the scheduler (it reads the scheduler's request state) and is
//! re-exported as `crate::spec`.

use super::{Request, RequestUpdate, Scheduler, SchedulerConfig};
use crate::exec::Sampled;
use crate::observe::{Effect, Observer};
use crate::stats::SpecDecodeCounts;
use crate::TokenId;

/// Speculative decoding settings (`--speculative ngram`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    /// Most draft tokens per request and step (`K`).
    pub num_speculative_tokens: usize,
    /// Shortest n-gram matched.
    pub prompt_lookup_min: usize,
    /// Longest n-gram matched (tried first).
    pub prompt_lookup_max: usize,
    /// Draft less for a request whose drafts keep being rejected (see the module docs).
    pub adaptive: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            num_speculative_tokens: 5,
            prompt_lookup_min: 2,
            prompt_lookup_max: 4,
            adaptive: true,
        }
    }
}

impl SpecConfig {
    /// Whether the prompt lookup's n-gram range can match anything: the shortest at least 1,
    /// the longest at least the shortest. (The command lines refuse a range that cannot,
    /// rather than widen it silently, with this message.)
    pub fn check_ngram_range(&self) -> Result<(), String> {
        if self.prompt_lookup_min >= 1 && self.prompt_lookup_max >= self.prompt_lookup_min {
            return Ok(());
        }
        Err(format!(
            "--spec-ngram-min must be at least 1 and --spec-ngram-max at least --spec-ngram-min \
             (got {} and {})",
            self.prompt_lookup_min, self.prompt_lookup_max
        ))
    }
}

/// Most proposals a request passes over after a streak of rejected drafts.
pub const MAX_SKIP: u32 = 15;

/// Proposals to pass over after `misses` consecutive drafts with nothing accepted: none after
/// one, then 1, 3, 7, 15, 15, ...
pub fn backoff_skips(misses: u32) -> u32 {
    match misses {
        0 | 1 => 0,
        m => ((1u32 << (m - 1).min(5)) - 1).min(MAX_SKIP),
    }
}

/// Speculation counters (vLLM's `spec_decode_*`): totals since the start, or one step's
/// increments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecDecodeStats {
    /// Decode chunks that carried at least one draft.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Draft tokens accepted (each one a token generated without a step of its own).
    pub num_accepted_tokens: u64,
    /// `accepted_per_pos[i]`: drafts whose token at position `i` was accepted (length `K`).
    pub accepted_per_pos: Vec<u64>,
}

impl SpecDecodeStats {
    /// Count one verified draft of `drafted` tokens of which the first `accepted` were taken.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.num_drafts += 1;
        self.num_draft_tokens += drafted as u64;
        self.num_accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < drafted {
            self.accepted_per_pos.resize(drafted, 0);
        }
        for c in &mut self.accepted_per_pos[..accepted] {
            *c += 1;
        }
    }

    pub fn is_zero(&self) -> bool {
        self.num_drafts == 0
    }
}

/// A request's speculation state: the chunk of the step in flight and its counts.
#[derive(Debug, Default)]
pub(crate) struct SpecState {
    /// `[last token, d1..dk]` of the planned chunk (reused: no allocation per step).
    pub(crate) buf: Vec<TokenId>,
    /// This request's (this sequence's) drafts, draft tokens and accepted tokens so far.
    pub(crate) counts: SpecDecodeCounts,
    /// Consecutive verified drafts of which nothing was accepted (the backoff's streak).
    pub(crate) misses: u32,
    /// Proposals still to pass over.
    pub(crate) skip: u32,
    /// Most tokens of the next draft (0: not set yet, `K`).
    pub(crate) limit: usize,
}

impl SpecState {
    /// Count one verified draft of `drafted` tokens of which `accepted` were taken, and, when
    /// `spec.adaptive`, move the draft limit and the backoff.
    pub(crate) fn record(&mut self, spec: &SpecConfig, drafted: usize, accepted: usize) {
        self.counts.accumulate(&SpecDecodeCounts {
            num_drafts: 1,
            num_draft_tokens: drafted as u64,
            num_accepted_tokens: accepted as u64,
        });
        if accepted > 0 {
            self.misses = 0;
        } else {
            self.misses = self.misses.saturating_add(1);
        }
        if spec.adaptive {
            self.skip = backoff_skips(self.misses);
            let k = spec.num_speculative_tokens;
            let limit = self.draft_limit(k);
            self.limit = if accepted >= drafted {
                (limit + 1).min(k)
            } else if self.counts.num_accepted_tokens == 0 {
                // Nothing of this request's drafts taken yet: not (yet) a copy.
                accepted + 1
            } else {
                (accepted + 1).max(limit.saturating_sub(1))
            };
        }
    }

    /// Most tokens of the next draft (`k`: [`SpecConfig::num_speculative_tokens`]).
    pub(crate) fn draft_limit(&self, k: usize) -> usize {
        if self.limit == 0 {
            k
        } else {
            self.limit.min(k)
        }
    }
}

/// Propose up to `k` draft tokens for `tokens` (prompt and output so far): the tokens that
/// followed the most recent earlier occurrence of its last `n` tokens, for the largest `n` in
/// `min_n..=max_n` that has one. Writes them to `out` (cleared first) and returns how many.
pub fn propose_ngram(
    tokens: &[TokenId],
    min_n: usize,
    max_n: usize,
    k: usize,
    out: &mut Vec<TokenId>,
) -> usize {
    out.clear();
    let len = tokens.len();
    if k == 0 || len < 2 {
        return 0;
    }
    let min_n = min_n.max(1);
    // The suffix and an earlier occurrence with at least one token after it.
    let max_n = max_n.min(len - 1);
    for n in (min_n..=max_n).rev() {
        let suffix = &tokens[len - n..];
        let last = suffix[n - 1];
        // Start `i` of an occurrence: `i + n <= len - 1`, most recent first.
        let mut i = len - n;
        while i > 0 {
            i -= 1;
            if tokens[i + n - 1] == last && tokens[i..i + n] == *suffix {
                let from = i + n;
                let to = (from + k).min(len);
                out.extend_from_slice(&tokens[from..to]);
                return out.len();
            }
        }
    }
    0
}

/// Most drafts a decode chunk at position `p` (`num_computed`) may carry.
pub(super) fn draft_cap(
    spec: &SpecConfig,
    cfg: &SchedulerConfig,
    r: &Request,
    allocated_slots: usize,
    budget_left: usize,
) -> usize {
    let p = r.num_computed;
    let out_len = r.tokens.len() - r.prompt_len;
    // Slots after p in the blocks the request already holds (the block of p: the allocation
    // for one token never goes further).
    let block_room = allocated_slots.saturating_sub(p + 1);
    // One step commits at most k + 1 tokens: never past max_tokens or the context.
    let out_room = (r.sampling.max_tokens as usize).saturating_sub(out_len + 1);
    let ctx_room = cfg.max_model_len.saturating_sub(r.tokens.len() + 1);
    spec.num_speculative_tokens
        .min(block_room)
        .min(out_room)
        .min(ctx_room)
        .min(budget_left)
}

/// Whether drafts may be planned for `r` now: decoding (exactly one token without KV, an
/// output already), one sequence (forked or never to fork), no constraint.
pub(super) fn eligible(r: &Request) -> bool {
    r.has_output()
        && r.num_computed + 1 == r.tokens.len()
        && r.forks.is_empty()
        && r.sampling.constraint.is_none()
}

/// Plan the drafts of a decode chunk of `r` (eligible, its one token already allocated):
/// fills `r.spec.buf` with `[last, d1..dk]` and returns `k`.
pub(super) fn plan(
    spec: &SpecConfig,
    cfg: &SchedulerConfig,
    r: &mut Request,
    allocated_slots: usize,
    budget_left: usize,
) -> usize {
    let mut cap = draft_cap(spec, cfg, r, allocated_slots, budget_left);
    if spec.adaptive {
        cap = cap.min(r.spec.draft_limit(spec.num_speculative_tokens));
    }
    if cap == 0 {
        return 0;
    }
    let st = &mut r.spec;
    let k = propose_ngram(
        &r.tokens,
        spec.prompt_lookup_min,
        spec.prompt_lookup_max,
        cap,
        &mut st.buf,
    );
    if k == 0 {
        return 0;
    }
    if st.skip > 0 {
        // Backing off: this proposal is passed over.
        st.skip -= 1;
        st.buf.clear();
        return 0;
    }
    st.buf.insert(0, r.tokens[r.num_computed]);
    k
}

/// How many of `drafts` the executor's answer accepts: `first` is the token sampled at
/// position 0 and `rest` those sampled after each accepted draft. Draft `j` is accepted when
/// the token sampled before it equals it; an answer that does not follow that rule is cut at
/// its first inconsistency (the KV of a position is only valid for the draft written there).
pub(crate) fn accepted(drafts: &[TokenId], first: &Sampled, rest: &[Sampled]) -> usize {
    let mut prev = first.token;
    let mut a = 0;
    while a < drafts.len() && a < rest.len() && prev == drafts[a] {
        prev = rest[a].token;
        a += 1;
    }
    a
}

impl<O: Observer> Scheduler<O> {
    /// Commit the tokens sampled after accepted drafts, one at a time, exactly as plain
    /// decoding would have (the request's first token of the step is already appended and
    /// did not end it): each one first makes the draft before it count as computed (its KV was
    /// written by this step's forward), commits what that fills, then appends the token and
    /// checks the stop conditions; tokens after a stop are dropped.
    pub(super) fn commit_accepted(
        &mut self,
        slot: u32,
        extra: Vec<Sampled>,
        now: f64,
        updates: &mut Vec<RequestUpdate>,
    ) {
        for tok in extra {
            let Some(r) = self.slots[slot as usize].as_mut() else {
                return;
            };
            r.num_computed += 1;
            self.commit_computed(slot, false, now);
            let Some(r) = self.slots[slot as usize].as_mut() else {
                return;
            };
            r.tokens.push(tok.token);
            let (handle, seq) = (r.handle, r.seq);
            self.obs.observe(Effect::Sampled {
                slot,
                now,
                first: false,
                same_step: true,
            });
            let stop = self.check_stop(slot, tok.token);
            let mut u = match stop {
                Some(reason) => self.finish_slot(slot, reason, now),
                None => RequestUpdate::new(slot, handle, seq),
            };
            u.token = Some(tok);
            updates.push(u);
            if stop.is_some() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let mut out = vec![99; 3]; // cleared by the proposer
        let n = propose_ngram(tokens, min, max, k, &mut out);
        assert_eq!(n, out.len());
        out
    }

    #[test]
    fn an_ngram_range_matches_something_from_one_token_up() {
        let range = |min, max| SpecConfig {
            prompt_lookup_min: min,
            prompt_lookup_max: max,
            ..SpecConfig::default()
        };
        assert_eq!(SpecConfig::default().check_ngram_range(), Ok(()));
        assert_eq!(range(1, 1).check_ngram_range(), Ok(()));
        assert_eq!(range(3, 3).check_ngram_range(), Ok(()));
        for (min, max) in [(0, 4), (0, 0), (3, 2)] {
            let e = range(min, max).check_ngram_range().unwrap_err();
            assert!(e.ends_with(&format!("(got {min} and {max})")), "{e}");
        }
    }

    #[test]
    fn the_longest_suffix_match_wins_then_the_most_recent_occurrence() {
        // Suffix [2, 3] (n = 2) occurs at 1..3 (followed by 4, 5, 6) and at 6..8 (followed by
        // 9, 2, 3): the most recent wins, and its proposal runs to the end of the context.
        let t = [1, 2, 3, 4, 5, 6, 2, 3, 9, 2, 3];
        assert_eq!(propose(&t, 1, 4, 5), vec![9, 2, 3]);
        // n = 3: [9, 2, 3] has no earlier occurrence, n = 2 is the longest with one.
        // With k = 2 the proposal is cut at 2.
        assert_eq!(propose(&t, 1, 4, 2), vec![9, 2]);
        // min_n = 3: no 3- or 4-gram suffix recurs, so nothing.
        assert!(propose(&t, 3, 4, 5).is_empty());
        // A longer match beats a more recent shorter one: suffix [7, 8, 1] occurs at 0..3
        // (then 2), while [8, 1] alone also occurs at 4..6 (then 5).
        let t = [7, 8, 1, 2, 8, 1, 5, 7, 8, 1];
        assert_eq!(propose(&t, 1, 3, 4), vec![2, 8, 1, 5]);
        assert_eq!(propose(&t, 1, 2, 4), vec![5, 7, 8, 1]);
    }

    #[test]
    fn edge_cases_propose_nothing_or_respect_the_bounds() {
        assert!(propose(&[], 1, 4, 5).is_empty());
        assert!(propose(&[5], 1, 4, 5).is_empty());
        assert!(propose(&[1, 2, 3], 1, 4, 5).is_empty());
        assert!(propose(&[1, 2, 1], 1, 4, 0).is_empty());
        // [1, 1]: the suffix [1] occurs at 0, followed by the last token.
        assert_eq!(propose(&[1, 1], 1, 4, 5), vec![1]);
        // A run: [4, 4, 4, 4]: n = 3 matches at 0 (then 4).
        assert_eq!(propose(&[4, 4, 4, 4], 1, 4, 5), vec![4]);
        // min_n = 0 is treated as 1.
        assert_eq!(propose(&[3, 9, 3], 0, 2, 5), vec![9, 3]);
    }

    #[test]
    fn acceptance_follows_the_draft_chain() {
        let s = |t: u32| Sampled::token(t);
        // Drafts [5, 6, 7]; sampled 5 (= d1), then 6 (= d2), then 8 (≠ d3): 2 accepted, the
        // third token is the one sampled after d2.
        assert_eq!(accepted(&[5, 6, 7], &s(5), &[s(6), s(8)]), 2);
        // All three accepted and the extra token after d3.
        assert_eq!(accepted(&[5, 6, 7], &s(5), &[s(6), s(7), s(1)]), 3);
        // First sample differs: none.
        assert_eq!(accepted(&[5, 6, 7], &s(4), &[]), 0);
        // An executor answer with a token after a mismatch is cut there.
        assert_eq!(accepted(&[5, 6, 7], &s(5), &[s(9), s(7)]), 1);
        assert_eq!(accepted(&[5, 6, 7], &s(4), &[s(6)]), 0);
    }

    #[test]
    fn the_backoff_doubles_with_each_rejected_draft_and_an_acceptance_ends_it() {
        assert_eq!(
            (0..9).map(backoff_skips).collect::<Vec<_>>(),
            vec![0, 0, 1, 3, 7, 15, 15, 15, 15]
        );
        let on = SpecConfig::default(); // K = 5
        let mut st = SpecState::default();
        assert_eq!(st.draft_limit(5), 5);
        // Nothing ever accepted: a rejection cuts the limit to 0 + 1.
        st.record(&on, 3, 0);
        assert_eq!((st.misses, st.skip, st.draft_limit(5)), (1, 0, 1));
        st.record(&on, 1, 0);
        assert_eq!((st.misses, st.skip, st.draft_limit(5)), (2, 1, 1));
        st.skip = 0; // the one proposal passed over
        st.record(&on, 1, 0);
        assert_eq!((st.misses, st.skip), (3, 3));
        // An accepted token ends the streak (the skip was spent before drafting again), and a
        // fully accepted draft raises the limit by one.
        st.skip = 0;
        st.record(&on, 1, 1);
        assert_eq!((st.misses, st.skip, st.draft_limit(5)), (0, 0, 2));
        st.record(&on, 2, 2);
        assert_eq!(st.draft_limit(5), 3);
        // Tokens accepted before: 2 of 3 gives max(2 + 1, 3 - 1) = 3.
        st.record(&on, 3, 2);
        assert_eq!((st.misses, st.draft_limit(5)), (0, 3));
        for _ in 0..4 {
            st.record(&on, 3, 3);
        }
        assert_eq!(st.draft_limit(5), 5); // capped at K

        // 1 of 5: max(1 + 1, 5 - 1) = 4; then none of 4: max(0 + 1, 4 - 1) = 3.
        st.record(&on, 5, 1);
        assert_eq!((st.misses, st.draft_limit(5)), (0, 4));
        st.record(&on, 4, 0);
        assert_eq!((st.misses, st.skip, st.draft_limit(5)), (1, 0, 3));
        assert_eq!(
            st.counts,
            SpecDecodeCounts {
                num_drafts: 12,
                num_draft_tokens: 3 + 1 + 1 + 1 + 2 + 3 + 4 * 3 + 5 + 4,
                num_accepted_tokens: 1 + 2 + 2 + 4 * 3 + 1
            }
        );
        // Off: the streak is counted, nothing is skipped or shortened.
        let off = SpecConfig {
            adaptive: false,
            ..on
        };
        let mut st = SpecState::default();
        for _ in 0..4 {
            st.record(&off, 2, 0);
        }
        assert_eq!((st.misses, st.skip, st.draft_limit(5)), (4, 0, 5));
    }

    #[test]
    fn stats_count_drafts_tokens_and_positions() {
        let mut st = SpecDecodeStats::default();
        st.record(3, 2);
        st.record(5, 0);
        st.record(0, 0);
        st.record(2, 2);
        assert_eq!(st.num_drafts, 3);
        assert_eq!(st.num_draft_tokens, 10);
        assert_eq!(st.num_accepted_tokens, 4);
        assert_eq!(st.accepted_per_pos, vec![2, 2, 0, 0, 0]);
    }
}
