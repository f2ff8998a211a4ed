//! One step's batch and results: the executor's view of a plan, and applying what it
//! produced (advance computed tokens, commit full blocks, append sampled tokens, fork, stop).
//! A child module of the scheduler.

use super::spec_decode;
use super::spec_decode::SpecDecodeStats;
use super::{RequestUpdate, Scheduler, SchedulerOutput, Status};
use crate::exec::{ExecBatch, ExecOutput, PromptLogprobsSpec, SampleSpec, SeqChunk};
use crate::hash::BlockHash;
use crate::observe::{Effect, Observer};
use crate::request::FinishReason;
use crate::stats::SpecDecodeCounts;
use crate::{BlockId, TokenId};

impl<O: Observer> Scheduler<O> {
    /// Borrowed views of a plan's chunks for the executor (the engine adds the loads).
    pub fn exec_batch<'a>(&'a self, out: &SchedulerOutput) -> ExecBatch<'a> {
        self.exec_batch_in(out, Vec::new())
    }

    /// [`Scheduler::exec_batch`] written into `seqs` (cleared first): a buffer kept from step
    /// to step ([`crate::exec::recycle_seqs`]) is written where the last step's was, in lines
    /// the cache still holds, not in fresh memory the allocator hands out.
    pub fn exec_batch_in<'a>(
        &'a self,
        out: &SchedulerOutput,
        mut seqs: Vec<SeqChunk<'a>>,
    ) -> ExecBatch<'a> {
        // Sized up front: grown by doubling, a batch of a thousand chunks was copied about once
        // over per step, more often the more the heap around it was taken (no room to grow in
        // place).
        seqs.clear();
        seqs.reserve(out.chunks.len());
        seqs.extend(out.chunks.iter().filter_map(|c| {
            let r = self.slot(c.slot)?;
            let end = c.start_pos + c.num_tokens;
            // A chunk with drafts is `[last, d1..dk]`, kept apart from the committed tokens.
            let (tokens, drafts) = match r.spec.buf.get(..=c.drafts) {
                Some(buf) if c.drafts > 0 => (buf, &buf[1..]),
                _ => (&r.tokens[c.start_pos..end - c.drafts], &[][..]),
            };
            let prompt_logprobs = match r.prompt_lp {
                Some(top) if c.start_pos < r.prompt_len => Some(PromptLogprobsSpec {
                    targets: &r.tokens[c.start_pos + 1..(end + 1).min(r.prompt_len)],
                    top,
                }),
                _ => None,
            };
            Some(SeqChunk {
                slot: c.slot,
                tokens,
                start_pos: c.start_pos,
                block_table: &r.kv.blocks,
                sample: c.sample.then(|| SampleSpec {
                    params: &r.sampling,
                    prompt: &r.tokens[..r.prompt_len],
                    output: &r.tokens[r.prompt_len..],
                    forks: if r.has_output() { &[] } else { &r.forks },
                    drafts,
                }),
                prompt_logprobs,
            })
        }));
        ExecBatch {
            copies: out.copies.clone(),
            loads: Vec::new(),
            seqs,
        }
    }

    /// Apply a step's results: advance computed tokens, commit full blocks, append sampled
    /// tokens, fork sequences, finish requests. `results.sampled[i]` belongs to `out.chunks[i]`.
    pub fn update(
        &mut self,
        out: &SchedulerOutput,
        results: ExecOutput,
        now: f64,
    ) -> Vec<RequestUpdate> {
        let ExecOutput {
            sampled,
            mut forks,
            mut prompt_logprobs,
            mut spec,
        } = results;
        let mut updates = Vec::with_capacity(out.chunks.len());
        for (ci, (chunk, res)) in out
            .chunks
            .iter()
            .zip(sampled.into_iter().chain(std::iter::repeat_with(|| None)))
            .enumerate()
        {
            let slot = chunk.slot;
            let Some(r) = self.slots[slot as usize].as_mut() else {
                continue;
            };
            if r.status != Status::Running || r.num_computed != chunk.start_pos {
                continue; // stale plan entry (request gone or re-planned)
            }
            // Drafts' KV counts only once their tokens are committed (below).
            r.num_computed += chunk.num_tokens - chunk.drafts;
            let prefill = !r.has_output();
            if r.prompt_lp.is_some() {
                if let Some(k) = prompt_logprobs.iter().position(|(i, _)| *i == ci) {
                    let lps = prompt_logprobs.swap_remove(k).1;
                    // Entry j is the logprob of the token at start + 1 + j; a re-prefill after a
                    // preemption recomputes ones already kept.
                    let have = r.prompt_lps.len() + 1;
                    let skip = have.saturating_sub(chunk.start_pos + 1);
                    r.prompt_lps.extend(lps.into_iter().skip(skip));
                }
            }
            self.commit_computed(slot, prefill, now);
            let Some(r) = self.slots[slot as usize].as_mut() else {
                continue;
            };
            if r.sampling.max_tokens == 0 && r.num_computed >= r.prompt_len {
                // Only prompt logprobs were wanted: the prompt ran, nothing is generated.
                let lps = std::mem::take(&mut r.prompt_lps);
                let mut u = self.finish_slot(slot, FinishReason::Length, now);
                u.prompt_logprobs = Some(Box::new(lps));
                updates.push(u);
                continue;
            }
            if !chunk.sample {
                continue;
            }
            let Some(sampled) = res else {
                // The executor owed a token and gave none: end the request rather than loop.
                updates.push(self.finish_slot(slot, FinishReason::Error, now));
                continue;
            };
            // Speculative decoding: the tokens sampled after accepted drafts, checked.
            let mut extra = Vec::new();
            if chunk.drafts > 0 {
                if let Some(k) = spec.iter().position(|(i, _)| *i == ci) {
                    extra = spec.swap_remove(k).1;
                }
                let drafts = r.spec.buf.get(1..=chunk.drafts).unwrap_or(&[]);
                let a = spec_decode::accepted(drafts, &sampled, &extra);
                extra.truncate(a);
                if let Some(sc) = &self.cfg.speculative {
                    r.spec.record(sc, chunk.drafts, a);
                }
                self.spec_stats.record(chunk.drafts, a);
            }
            r.tokens.push(sampled.token);
            let lps = (prefill && r.prompt_lp.is_some())
                .then(|| Box::new(std::mem::take(&mut r.prompt_lps)));
            let draws = if prefill && !r.forks.is_empty() {
                let params = std::mem::take(&mut r.forks);
                forks
                    .iter()
                    .position(|(i, _)| *i == ci)
                    .map(|k| (forks.swap_remove(k).1, params))
            } else {
                None
            };
            self.obs.observe(Effect::Sampled {
                slot,
                now,
                same_step: false,
                first: prefill,
            });
            // Sequences 1..n start from the prompt and their own draws, whether or not this
            // one ends with its first token (forked before it can finish and free its blocks:
            // a partial block's copy reads it in the next batch, before anything is written).
            let mut forked = Vec::new();
            if let Some((draws, params)) = draws {
                self.fork(slot, draws, params, now, &mut forked);
            }
            let mut u = match self.check_stop(slot, sampled.token) {
                Some(reason) => self.finish_slot(slot, reason, now),
                None => {
                    let r = self.slot(slot);
                    let mut u =
                        RequestUpdate::new(slot, r.map_or(0, |r| r.handle), r.map_or(0, |r| r.seq));
                    if prefill {
                        u.session = r.and_then(|r| r.session.clone());
                    }
                    u
                }
            };
            u.token = Some(sampled);
            u.first_token = prefill;
            u.prompt_logprobs = lps;
            let live = u.finish.is_none();
            updates.push(u);
            updates.append(&mut forked);
            if live && !extra.is_empty() {
                self.commit_accepted(slot, extra, now, &mut updates);
            }
        }
        self.compact_running();
        updates
    }

    /// Commit every block that `num_computed` now fills, reporting it (every prefill chunk is
    /// reported; a decode chunk only when a block became full) and listing new entries.
    pub(super) fn commit_computed(&mut self, slot: u32, prefill: bool, now: f64) {
        let Some(r) = self.slots[slot as usize].as_mut() else {
            return;
        };
        self.fx.filled = 0;
        self.fx.created.clear();
        self.fx.committed_until = 0;
        let filled = self
            .kv
            .commit(&mut r.kv, &r.tokens, r.num_computed, &mut self.fx);
        if prefill || filled {
            self.obs.observe(Effect::Computed {
                slot,
                now,
                prefill,
                kv: &self.fx,
                hashes: r.kv.hashes(),
                tokens: &r.tokens,
                blocks: &r.kv.blocks,
                pool: self.kv.pool(),
            });
            if self.cfg.report_new_entries {
                for &i in &self.fx.created {
                    self.new_entries
                        .push((r.kv.blocks[i as usize], r.kv.hashes()[i as usize]));
                }
            }
        }
    }

    /// Speculation counts since the last call (the engine's per-step deltas).
    pub fn take_spec_stats(&mut self) -> SpecDecodeStats {
        std::mem::take(&mut self.spec_stats)
    }

    /// The live request's speculation counts so far (its final update carries them).
    pub fn spec_counts(&self, slot: u32) -> Option<SpecDecodeCounts> {
        self.slot(slot).map(|r| r.spec.counts)
    }

    /// Blocks that became new cache entries since the last call (with `report_new_entries`).
    pub fn take_new_entries(&mut self) -> Vec<(BlockId, BlockHash)> {
        std::mem::take(&mut self.new_entries)
    }

    pub(super) fn check_stop(&self, slot: u32, token: TokenId) -> Option<FinishReason> {
        let r = self.slot(slot)?;
        let out_len = r.tokens.len() - r.prompt_len;
        let p = &r.sampling;
        let past_min = out_len >= p.min_tokens as usize;
        if past_min && !p.ignore_eos && self.cfg.eos_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if past_min && p.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        // A stop string ends the request only at a token after the first `min_tokens` (as
        // vLLM's detokenizer checks them, and as the server's text side cuts them); one that
        // ends earlier never does, though one that began there may end later.
        if let Some(s) = p
            .stop_strings
            .as_ref()
            .filter(|_| out_len > p.min_tokens as usize)
        {
            if s.ends_in_stop(&r.tokens[r.prompt_len.min(r.tokens.len())..]) {
                return Some(FinishReason::Stop);
            }
        }
        if out_len >= p.max_tokens as usize || r.tokens.len() >= self.cfg.max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}
