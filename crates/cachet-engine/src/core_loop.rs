//! [`EngineCore`]: one step of the engine (schedule → execute → update → stats), shared by the
//! threaded engine and the offline API.

use cachet_core::exec::Executor;
use cachet_core::scheduler::{AddRequestError, RequestUpdate, SchedulerOutput};
use cachet_core::stats::{DeltaTracker, FinishedRequestStats};
use cachet_core::{FinishReason, HashSeed, NewRequest, Scheduler, SchedulerConfig};

use crate::{RequestMetrics, StatLogger, StepStats};

pub struct EngineCore<E: Executor> {
    scheduler: Scheduler,
    executor: E,
    deltas: DeltaTracker,
    loggers: Vec<Box<dyn StatLogger>>,
    /// Every schedule made, when recording is on (for determinism tests).
    schedule_log: Option<Vec<SchedulerOutput>>,
}

impl<E: Executor> EngineCore<E> {
    pub fn new(cfg: SchedulerConfig, executor: E, loggers: Vec<Box<dyn StatLogger>>) -> Self {
        let seed = HashSeed::new(
            &executor.model_fingerprint(),
            cfg.block_size,
            &executor.kv_layout(),
        );
        EngineCore {
            scheduler: Scheduler::new(cfg, seed),
            executor,
            deltas: DeltaTracker::default(),
            loggers,
            schedule_log: None,
        }
    }

    pub fn record_schedules(&mut self) {
        self.schedule_log = Some(Vec::new());
    }

    pub fn take_schedules(&mut self) -> Vec<SchedulerOutput> {
        self.schedule_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn scheduler_mut(&mut self) -> &mut Scheduler {
        &mut self.scheduler
    }

    pub fn add_request(&mut self, req: NewRequest) -> Result<u32, AddRequestError> {
        self.scheduler.add_request(req)
    }

    pub fn add_logger(&mut self, logger: Box<dyn StatLogger>) {
        self.loggers.push(logger);
    }

    /// End a live request (abort or frontend stop); its stats reach the loggers.
    pub fn finish_request(
        &mut self,
        request_id: &str,
        reason: FinishReason,
        now: f64,
    ) -> Option<RequestUpdate> {
        let update = self.scheduler.finish_request(request_id, reason, now)?;
        let finished = self.scheduler.take_finished();
        self.emit_stats(finished, None);
        Some(update)
    }

    /// Run one step. Returns the updates of the requests that produced a token or finished.
    pub fn step(
        &mut self,
        now: impl Fn() -> f64,
    ) -> Result<Vec<RequestUpdate>, cachet_core::ExecError> {
        let plan = self.scheduler.schedule(now());
        if let Some(log) = self.schedule_log.as_mut() {
            log.push(plan.clone());
        }
        if plan.is_empty() {
            self.emit_stats(Vec::new(), None);
            return Ok(Vec::new());
        }
        let results = {
            let batch = self.scheduler.exec_batch(&plan);
            self.executor.execute(&batch)?
        };
        let updates = self.scheduler.update(&plan, results, now());
        let finished = self.scheduler.take_finished();
        self.emit_stats(finished, Some(plan.num_tokens() as u64));
        Ok(updates)
    }

    fn emit_stats(&mut self, finished: Vec<FinishedRequestStats>, iteration_tokens: Option<u64>) {
        let deltas = self.deltas.advance(&self.scheduler.totals());
        let samples = self.scheduler.take_latency_samples();
        let stats = StepStats {
            deltas,
            gauges: self.scheduler.gauges(),
            finished,
            ttft_s: samples.ttft_s,
            itl_s: samples.itl_s,
            iteration_tokens,
        };
        // A stats message whenever any delta is non-zero (or something finished), even in a step
        // without tokens.
        if !stats.deltas.is_zero() || !stats.finished.is_empty() || stats.iteration_tokens.is_some()
        {
            for l in &mut self.loggers {
                l.record(&stats);
            }
        }
    }
}

impl RequestMetrics {
    pub fn from_finished(f: &FinishedRequestStats) -> Self {
        let gen = f.generation_tokens;
        RequestMetrics {
            queue_time_ms: f.queue_time_s * 1000.0,
            time_to_first_token_ms: f.ttft_s.map(|t| t * 1000.0),
            generation_time_ms: f.decode_time_s * 1000.0,
            mean_itl_ms: if gen > 1 {
                f.decode_time_s * 1000.0 / (gen - 1) as f64
            } else {
                0.0
            },
            tokens_per_second: if f.e2e_s > 0.0 {
                gen as f64 / f.e2e_s
            } else {
                0.0
            },
            prompt_tokens: f.prompt_tokens,
            generation_tokens: gen,
            e2e_ms: f.e2e_s * 1000.0,
            num_preemptions: f.num_preemptions,
        }
    }
}
