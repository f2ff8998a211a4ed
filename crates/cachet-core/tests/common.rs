//! Shared test driver: a scheduler with a recorder, run with a trivial executor (every sampled
//! token is 7), requests named by test ids.
#![allow(dead_code)]

use std::collections::HashMap;

use cachet_core::scheduler::{AddError, RequestUpdate, SchedulerOutput};
use cachet_core::stats::{CounterTotals, FinishedRequestStats, PrefillStats};
use cachet_core::tier::KvLookup;
use cachet_core::{
    ExecBatch, ExecOutput, FinishReason, HashSeed, Recorder, RequestDraft, Sampled, SamplingParams,
    Scheduler, SchedulerConfig,
};

pub fn cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        ..Default::default()
    }
}

pub fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> RequestDraft {
    RequestDraft::new(
        id,
        prompt,
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    )
}

/// A tier that holds the first `held` blocks of any prompt.
pub struct FakeTier {
    pub held: usize,
}
impl KvLookup for FakeTier {
    fn lookup(&mut self, hashes: &[cachet_core::hash::BlockHash]) -> usize {
        self.held.min(hashes.len())
    }
}

/// Why `Core::add` refused a draft.
#[derive(Debug, PartialEq)]
pub enum Refused {
    Invalid(cachet_core::request::InvalidRequest),
    Add(AddError),
}

pub struct Core {
    pub s: Scheduler<Recorder>,
    slots: HashMap<String, u32>,
    ids: HashMap<u32, String>,
    next_handle: u64,
    pub now: f64,
}

impl Core {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self::with_insight(cfg, cachet_core::recorder::InsightConfig::off())
    }

    /// A core whose recorder keeps `insight`.
    pub fn with_insight(
        cfg: SchedulerConfig,
        insight: cachet_core::recorder::InsightConfig,
    ) -> Self {
        let seed = HashSeed::new(&[9; 32], cfg.block_size, "test");
        let rec = Recorder::new(cfg.block_size).with_insight(insight);
        Core {
            s: Scheduler::new(cfg, seed, rec),
            slots: HashMap::new(),
            ids: HashMap::new(),
            next_handle: 1,
            now: 0.0,
        }
    }

    /// Validate against the scheduler's limits and queue it.
    pub fn add(&mut self, d: RequestDraft) -> Result<u32, Refused> {
        let id = d.label.to_string();
        let v = self
            .s
            .config()
            .limits()
            .validate(d)
            .map_err(Refused::Invalid)?;
        let handle = self.next_handle;
        self.next_handle += 1;
        let slot = self
            .s
            .add_request(handle, self.now, v)
            .map_err(Refused::Add)?;
        self.slots.insert(id.clone(), slot);
        self.ids.insert(slot, id);
        Ok(slot)
    }

    pub fn slot_of(&self, id: &str) -> Option<u32> {
        self.slots.get(id).copied()
    }

    pub fn id_of(&self, slot: u32) -> Option<&str> {
        self.ids.get(&slot).map(String::as_str)
    }

    pub fn finish(&mut self, id: &str, reason: FinishReason, now: f64) -> Option<RequestUpdate> {
        let slot = self.slots.remove(id)?;
        self.ids.remove(&slot);
        self.s.finish(slot, reason, now)
    }

    /// One step: schedule, "execute" (token 7 for every sampled chunk), update.
    pub fn step(&mut self, now: f64) -> (SchedulerOutput, Vec<RequestUpdate>) {
        self.step_with(now, None)
    }

    pub fn step_with(
        &mut self,
        now: f64,
        tier: Option<&mut dyn KvLookup>,
    ) -> (SchedulerOutput, Vec<RequestUpdate>) {
        self.now = now;
        let out = self.s.schedule(now, tier);
        let results = fake_execute(&self.s.exec_batch(&out));
        let mut ups = self.s.update(&out, results, now);
        let reports: Vec<_> = self.s.observer_mut().drain_reports().collect();
        for (slot, rep) in reports {
            if let Some(u) = ups
                .iter_mut()
                .find(|u| u.slot == slot && u.report.is_none())
            {
                u.report = Some(Box::new(rep));
            }
        }
        for u in &ups {
            if u.finish.is_some() {
                if let Some(id) = self.ids.remove(&u.slot) {
                    self.slots.remove(&id);
                }
            }
        }
        (out, ups)
    }

    /// Run until nothing is left; returns every finished request's stats.
    pub fn run(&mut self) -> Vec<FinishedRequestStats> {
        let mut fin = Vec::new();
        let mut t = self.now;
        while self.s.has_unfinished() {
            t += 1.0;
            self.step(t);
            self.s.check_invariants().unwrap();
            fin.extend(self.take_finished());
            assert!(t < 10_000.0, "no progress");
        }
        fin
    }

    pub fn take_finished(&mut self) -> Vec<FinishedRequestStats> {
        self.s.observer_mut().take_finished()
    }

    pub fn totals(&self) -> CounterTotals {
        self.s.observer().totals()
    }
}

/// The trivial executor: every first draw is token 7, fork draw `i` is `7 + i`, and the
/// logprob of a prompt target `t` is `-t / 100`.
pub fn fake_execute(batch: &ExecBatch<'_>) -> ExecOutput {
    let mut out = ExecOutput::default();
    for (i, seq) in batch.seqs.iter().enumerate() {
        out.sampled
            .push(seq.sample.as_ref().map(|_| Sampled::token(7)));
        if let Some(spec) = &seq.sample {
            if !spec.forks.is_empty() {
                let n = spec.forks.len() as u32;
                out.forks
                    .push((i, (1..=n).map(|k| Sampled::token(7 + k)).collect()));
            }
        }
        if let Some(lp) = &seq.prompt_logprobs {
            let v = lp
                .targets
                .iter()
                .map(|&t| Sampled {
                    token: t,
                    logprob: -(t as f32) / 100.0,
                    top_logprobs: Vec::new(),
                })
                .collect();
            out.prompt_logprobs.push((i, v));
        }
    }
    out
}

pub fn stats_of(fin: &[FinishedRequestStats], id: &str) -> PrefillStats {
    fin.iter()
        .find(|f| &*f.request_id == id)
        .and_then(|f| f.prefill_stats)
        .expect("stats")
}

/// Logical + physical fields.
pub fn fields(p: &PrefillStats) -> [u64; 11] {
    [
        p.prompt_tokens,
        p.local_cached_tokens,
        p.external_cached_tokens,
        p.cached_tokens,
        p.computed_tokens,
        p.cache_creation_tokens,
        p.prefill_chunks,
        p.blocks_allocated,
        p.blocks_filled,
        p.blocks_evicted,
        p.preemptions,
    ]
}
