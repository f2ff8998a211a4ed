//! The offline API: run requests to completion on the calling thread.

use cachet_core::exec::Executor;
use cachet_core::request::InvalidRequest;
use cachet_core::scheduler::AddError;
use cachet_core::stats::{CounterDeltas, PrefillStats};
use cachet_core::{ExecError, FinishReason, RequestDraft, SchedulerConfig, TokenId};
use serde::Serialize;

use crate::step::{CoreOptions, EngineCore};
use crate::{StatLogger, StepStats};

/// The result of one request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CompletedRequest {
    pub request_id: String,
    pub output_token_ids: Vec<TokenId>,
    pub finish_reason: FinishReason,
    /// `None` only for a request that was never admitted.
    pub prefill_stats: Option<PrefillStats>,
}

#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error("request {id:?} is invalid: {err}")]
    Invalid { id: String, err: InvalidRequest },
    #[error("request {id:?} refused: {err}")]
    Refused { id: String, err: AddError },
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// Sums every delta it receives: the run's aggregate counters.
#[derive(Clone, Default)]
pub struct TotalsLogger(pub std::sync::Arc<std::sync::Mutex<CounterDeltas>>);

impl StatLogger for TotalsLogger {
    fn record(&mut self, step: &StepStats) {
        if let Ok(mut t) = self.0.lock() {
            t.accumulate(&step.deltas);
        }
    }
}

pub struct OfflineEngine<E: Executor> {
    core: EngineCore<E>,
    totals: TotalsLogger,
    start: std::time::Instant,
    /// `Some(dt)`: a logical clock advancing `dt` seconds per step (deterministic timings for
    /// tests); `None`: wall-clock time.
    pub logical_step_seconds: Option<f64>,
    clock: f64,
    next_handle: u64,
}

impl<E: Executor> OfflineEngine<E> {
    pub fn new(cfg: SchedulerConfig, executor: E) -> Self {
        let totals = TotalsLogger::default();
        let core = EngineCore::new(
            cfg,
            executor,
            CoreOptions {
                loggers: vec![Box::new(totals.clone())],
                ..CoreOptions::default()
            },
        );
        OfflineEngine {
            core,
            totals,
            start: std::time::Instant::now(),
            logical_step_seconds: None,
            clock: 0.0,
            next_handle: 0,
        }
    }

    pub fn core(&mut self) -> &mut EngineCore<E> {
        &mut self.core
    }

    /// The aggregate counters of everything run so far (sum of all step deltas).
    pub fn totals(&self) -> CounterDeltas {
        self.totals.0.lock().map(|t| *t).unwrap_or_default()
    }

    fn tick(&mut self) -> f64 {
        self.clock = match self.logical_step_seconds {
            Some(dt) => self.clock + dt,
            None => self.start.elapsed().as_secs_f64(),
        };
        self.clock
    }

    /// Submit all requests at once and run until every one has finished. Outputs are in
    /// submission order; each request's label is its id.
    pub fn generate(
        &mut self,
        reqs: Vec<RequestDraft>,
    ) -> Result<Vec<CompletedRequest>, OfflineError> {
        let mut results: Vec<CompletedRequest> = Vec::with_capacity(reqs.len());
        // Slot → index in `results`, for the requests still running.
        let mut by_slot: Vec<Option<usize>> = Vec::new();
        self.tick();
        let limits = self.core.scheduler().config().limits();
        for r in reqs {
            let id = r.label.to_string();
            let valid = limits.validate(r).map_err(|err| OfflineError::Invalid {
                id: id.clone(),
                err,
            })?;
            self.next_handle += 1;
            let slot = self
                .core
                .add_request(self.next_handle, self.clock, valid)
                .map_err(|err| OfflineError::Refused {
                    id: id.clone(),
                    err,
                })? as usize;
            if by_slot.len() <= slot {
                by_slot.resize(slot + 1, None);
            }
            by_slot[slot] = Some(results.len());
            results.push(CompletedRequest {
                request_id: id,
                output_token_ids: Vec::new(),
                finish_reason: FinishReason::Abort,
                prefill_stats: None,
            });
        }
        while self.core.scheduler().has_unfinished() {
            let t = self.tick();
            let logical = self.logical_step_seconds.is_some();
            let start = self.start;
            let now = move || {
                if logical {
                    t
                } else {
                    start.elapsed().as_secs_f64()
                }
            };
            for up in self.core.step(now)? {
                let Some(i) = by_slot.get(up.slot as usize).copied().flatten() else {
                    continue;
                };
                let c = &mut results[i];
                if let Some(tok) = &up.token {
                    c.output_token_ids.push(tok.token);
                }
                if let Some(p) = up.report.as_ref().and_then(|r| r.prefill_stats) {
                    c.prefill_stats = Some(p);
                }
                if let Some(f) = up.finish {
                    c.finish_reason = f;
                    by_slot[up.slot as usize] = None;
                }
            }
        }
        Ok(results)
    }
}
