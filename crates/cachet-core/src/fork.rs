//! Forking a request into its `n` sequences at its first token (n > 1): the sequences share
//! the prompt's full blocks and copy the partial last one. A child module of the scheduler.

use super::{Request, RequestUpdate, Scheduler, Status};
use crate::exec::Sampled;
use crate::kv_manager::ReqKv;
use crate::observe::{Effect, Observer};
use crate::request::SamplingParams;

use super::spec_decode::SpecState;

/// The sampling of sequences `1..n` of a request (made at arrival, before any token is
/// accepted): sequence `i` draws with the seed + `i` and a constraint of its own.
pub(super) fn fork_sampling(p: &SamplingParams, n: u32) -> Vec<SamplingParams> {
    (1..n.max(1))
        .map(|i| {
            let mut s = p.clone();
            s.seed = s.seed.map(|x| x.wrapping_add(u64::from(i)));
            s.constraint = s.constraint.as_ref().map(|c| c.fork());
            s
        })
        .collect()
}

impl<O: Observer> Scheduler<O> {
    /// A request asked for `n` sequences and its first token was just drawn: sequences
    /// `1..n` start from the draws `draws` (one each, drawn with `params`, which become
    /// theirs), sharing the prompt's full blocks; the partial last block is copied (in the
    /// next step's batch, before anything writes to it).
    /// When the pool cannot give a sequence its block, that sequence waits and recomputes its
    /// prompt (hitting the prefix cache for the full blocks).
    pub(super) fn fork(
        &mut self,
        parent: u32,
        draws: Vec<Sampled>,
        params: Vec<SamplingParams>,
        now: f64,
        updates: &mut Vec<RequestUpdate>,
    ) {
        for (i, (draw, sampling)) in draws.into_iter().zip(params).enumerate() {
            let Some(p) = self.slots[parent as usize].as_ref() else {
                return;
            };
            self.fx.clear();
            let forked = self.kv.fork(&p.kv, p.prompt_len, &mut self.fx);
            let mut tokens = Vec::with_capacity(p.tokens.capacity());
            tokens.extend_from_slice(&p.tokens[..p.prompt_len]);
            tokens.push(draw.token);
            let (kv, num_computed, status, copy) = match forked {
                Ok((kv, copy)) => {
                    self.pending_copies.extend(copy);
                    (kv, p.prompt_len, Status::Running, copy)
                }
                Err(_) => (ReqKv::new((*p.kv.extra).clone()), 0, Status::Waiting, None),
            };
            let child = Request {
                kv,
                tokens,
                num_computed,
                prompt_len: p.prompt_len,
                status,
                admitted_once: true,
                skip_read: p.skip_read,
                priority: p.priority,
                handle: p.handle,
                admit_seq: self.next_admit_seq,
                arrival: p.arrival,
                sampling,
                session: None,
                forks: Vec::new(),
                seq: i as u32 + 1,
                prompt_lp: None,
                prompt_lps: Vec::new(),
                spec: SpecState::default(),
            };
            self.next_admit_seq += 1;
            let slot = self.free_slots.pop().unwrap_or_else(|| {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            });
            self.obs.observe(Effect::Forked {
                parent,
                child: slot,
                seq: child.seq,
                now,
                kv: &self.fx,
                blocks: &child.kv.blocks,
                pool: self.kv.pool(),
            });
            let seq = child.seq;
            let handle = child.handle;
            self.slots[slot as usize] = Some(child);
            match status {
                Status::Running => self.running.push(slot),
                _ => self.waiting.push_front(slot),
            }
            let mut u = RequestUpdate::new(slot, handle, seq);
            u.token = Some(draw);
            u.first_token = true;
            // A one-token request ends with its first token.
            if let Some(reason) = self.check_stop(slot, u.token.as_ref().map_or(0, |t| t.token)) {
                // Its copy of the partial block is not needed: the block is freed now.
                if let Some(c) = copy {
                    self.pending_copies.retain(|&x| x != c);
                }
                let mut f = self.finish_slot(slot, reason, now);
                f.token = u.token.take();
                f.first_token = true;
                updates.push(f);
            } else {
                updates.push(u);
            }
        }
    }
}
