//! [`EngineCore`]: one step of the engine — resolve finished KV loads, plan, offload evicted
//! blocks, start new loads, execute (loads first), update, save new cache entries, report —
//! shared by the threaded engine and the offline API.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use cachet_core::events::EventBatch;
use cachet_core::exec::{recycle_seqs, BlockLoad, Executor, SeqChunk};
use cachet_core::recorder::InsightConfig;
use cachet_core::scheduler::{AddError, RequestUpdate, SchedulerOutput};
use cachet_core::stats::{DeltaTracker, FinishedRequestStats};
use cachet_core::tier::{KvLookup, TierTag};
use cachet_core::{
    BlockHash, BlockId, ExecError, FinishReason, HashSeed, Recorder, Scheduler, SchedulerConfig,
    ValidRequest,
};

use crate::tier::{KvTier, LoadTicket, Payload, SaveReason};
use crate::{StatLogger, StepStats};

/// Receives the KV cache events of each step (what entered and left the local cache), off the
/// critical path: implementations queue and return.
pub trait EventSink: Send {
    fn publish(&mut self, batch: Arc<EventBatch>);
}

impl<F: FnMut(Arc<EventBatch>) + Send> EventSink for F {
    fn publish(&mut self, batch: Arc<EventBatch>) {
        self(batch)
    }
}

/// How an [`EngineCore`] is put together.
pub struct CoreOptions {
    /// Reporting on or off. Off: no recorder, every number stays zero (and no event is
    /// published); decisions are identical.
    pub telemetry: bool,
    pub loggers: Vec<Box<dyn StatLogger>>,
    pub tier: Option<Box<dyn KvTier>>,
    /// Where KV cache events go (ZMQ publisher, SSE log); none: events are not collected.
    pub event_sinks: Vec<Box<dyn EventSink>>,
    /// What the recorder keeps for cache insight (miss reasons always).
    pub insight: InsightConfig,
}

impl Default for CoreOptions {
    fn default() -> Self {
        CoreOptions {
            telemetry: true,
            loggers: Vec::new(),
            tier: None,
            event_sinks: Vec::new(),
            insight: InsightConfig::off(),
        }
    }
}

pub struct EngineCore<E: Executor> {
    scheduler: Scheduler<Option<Recorder>>,
    executor: E,
    tier: Option<Box<dyn KvTier>>,
    deltas: DeltaTracker,
    loggers: Vec<Box<dyn StatLogger>>,
    event_sinks: Vec<Box<dyn EventSink>>,
    /// Loads in flight: handle → the blocks they fill, in order.
    inflight: HashMap<u64, Vec<BlockId>>,
    /// Resolved loads to write in the next executed batch: (slot, block, bytes).
    ready_loads: Vec<(u32, BlockId, Payload)>,
    /// Every schedule made, when recording is on (for determinism tests).
    schedule_log: Option<Vec<SchedulerOutput>>,
    /// The last step had nothing to execute (every live request waits for its loads).
    idle: bool,
    /// The executor's batch vector, empty between steps ([`cachet_core::exec::recycle_seqs`]).
    seqs: Vec<SeqChunk<'static>>,
}

/// Copies the `wanted` blocks out of the executor into the tier's payload buffers in one call
/// (in parallel where the executor has threads) and hands each copied one to the tier.
fn save_blocks<E: Executor>(
    executor: &E,
    tier: &mut dyn KvTier,
    wanted: Vec<(BlockId, BlockHash)>,
    why: SaveReason,
) {
    if wanted.is_empty() {
        return;
    }
    let bytes = executor.block_bytes();
    let blocks: Vec<BlockId> = wanted.iter().map(|w| w.0).collect();
    let mut bufs: Vec<Vec<u8>> = wanted.iter().map(|_| tier.take_buffer(bytes)).collect();
    let done = executor.save_blocks(&blocks, &mut bufs);
    for (((_, hash), buf), r) in wanted.into_iter().zip(bufs).zip(done) {
        if r.is_ok() {
            tier.save(hash, Payload::from(buf), why);
        }
    }
}

impl<E: Executor> EngineCore<E> {
    pub fn new(mut cfg: SchedulerConfig, executor: E, opts: CoreOptions) -> Self {
        let seed = HashSeed::new(
            &executor.model_fingerprint(),
            cfg.block_size,
            &executor.kv_layout(),
        );
        if let Some(t) = &opts.tier {
            let on = t.saves_on();
            cfg.report_evictions |= on.evicted;
            cfg.report_new_entries |= on.filled;
        }
        let events = !opts.event_sinks.is_empty();
        let recorder = opts.telemetry.then(|| {
            let r = Recorder::new(cfg.block_size).with_insight(opts.insight);
            if events {
                r.with_events()
            } else {
                r
            }
        });
        EngineCore {
            scheduler: Scheduler::new(cfg, seed, recorder),
            executor,
            tier: opts.tier,
            deltas: DeltaTracker::default(),
            loggers: opts.loggers,
            event_sinks: opts.event_sinks,
            inflight: HashMap::new(),
            ready_loads: Vec::new(),
            schedule_log: None,
            idle: false,
            seqs: Vec::new(),
        }
    }

    /// Answer a question of the cache inspector at time `now`.
    pub fn inspect(
        &mut self,
        q: crate::inspect::InspectQuery,
        now: f64,
    ) -> crate::inspect::InspectReply {
        let s = &mut self.scheduler;
        let (block_size, gauges) = (s.config().block_size, s.gauges());
        let (rec, kv) = s.observer_mut_and_kv();
        crate::inspect::answer(q, rec.as_mut(), kv.pool(), block_size, gauges, now)
    }

    /// The last step had nothing to execute: every live request waits for external loads.
    pub fn last_step_idle(&self) -> bool {
        self.idle
    }

    /// Drop every prefix-cache entry; only while no request holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let done = self.scheduler.reset_prefix_cache();
        self.emit_stats(None);
        done
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

    pub fn scheduler(&self) -> &Scheduler<Option<Recorder>> {
        &self.scheduler
    }

    pub fn scheduler_mut(&mut self) -> &mut Scheduler<Option<Recorder>> {
        &mut self.scheduler
    }

    pub fn executor(&self) -> &E {
        &self.executor
    }

    /// The recorder (`None` with telemetry off).
    pub fn recorder(&self) -> Option<&Recorder> {
        self.scheduler.observer().as_ref()
    }

    pub fn add_logger(&mut self, logger: Box<dyn StatLogger>) {
        self.loggers.push(logger);
    }

    pub fn add_request(
        &mut self,
        handle: u64,
        now: f64,
        req: ValidRequest,
    ) -> Result<u32, AddError> {
        self.scheduler.add_request(handle, now, req)
    }

    /// End the live request in `slot` (abort, frontend stop, engine error); its stats reach
    /// the loggers.
    pub fn finish(&mut self, slot: u32, reason: FinishReason, now: f64) -> Option<RequestUpdate> {
        let update = self.scheduler.finish(slot, reason, now)?;
        let mut updates = vec![update];
        self.attach_reports(&mut updates);
        self.emit_stats(None);
        updates.pop()
    }

    /// Run one step. Returns the updates of the requests that produced a token or finished.
    pub fn step(&mut self, now: impl Fn() -> f64) -> Result<Vec<RequestUpdate>, ExecError> {
        self.resolve_loads();
        let t0 = now();
        let plan = {
            let tier = self.tier.as_deref_mut().map(|t| t as &mut dyn KvLookup);
            self.scheduler.schedule(t0, tier)
        };
        if let Some(log) = self.schedule_log.as_mut() {
            log.push(plan.clone());
        }
        self.offload_evicted(&plan);
        self.start_loads(&plan);
        // Loads of requests preempted while planning are dropped: their blocks are gone.
        self.ready_loads
            .retain(|(slot, _, _)| !plan.preempted.contains(slot));
        self.idle = plan.is_empty() && self.ready_loads.is_empty();
        if self.idle {
            self.emit_stats(None);
            return Ok(Vec::new());
        }
        let results = {
            let seqs = recycle_seqs(std::mem::take(&mut self.seqs));
            let mut batch = self.scheduler.exec_batch_in(&plan, seqs);
            batch.loads = self
                .ready_loads
                .iter()
                .map(|(_, block, data)| BlockLoad {
                    block: *block,
                    data,
                })
                .collect();
            let results = self.executor.execute(&batch);
            self.seqs = recycle_seqs(batch.seqs);
            results?
        };
        self.ready_loads.clear();
        let mut updates = self.scheduler.update(&plan, results, now());
        self.save_new_entries();
        self.attach_reports(&mut updates);
        self.emit_stats((!plan.is_empty()).then_some(plan.num_tokens() as u64));
        Ok(updates)
    }

    /// Hand resolved loads to the scheduler; keep the intact leading blocks for the batch.
    fn resolve_loads(&mut self) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        for done in tier.poll_loads() {
            let Some(blocks) = self.inflight.remove(&done.ticket.handle) else {
                continue;
            };
            let outcome: Vec<Option<TierTag>> = done
                .blocks
                .iter()
                .map(|r| r.as_ref().ok().map(|(_, t)| *t))
                .collect();
            let LoadTicket { slot, handle } = done.ticket;
            let Some(n) = self.scheduler.resolve_loads(slot, handle, &outcome) else {
                continue;
            };
            for (block, res) in blocks.into_iter().zip(done.blocks).take(n) {
                if let Ok((payload, _)) = res {
                    self.ready_loads.push((slot, block, payload));
                }
            }
        }
    }

    fn start_loads(&mut self, plan: &SchedulerOutput) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        for lr in &plan.kv_loads {
            let (blocks, hashes): (Vec<BlockId>, Vec<_>) = lr.blocks.iter().copied().unzip();
            self.inflight.insert(lr.handle, blocks);
            tier.start_load(
                LoadTicket {
                    slot: lr.slot,
                    handle: lr.handle,
                },
                hashes,
            );
        }
    }

    /// Copy the KV of cache entries this plan evicted to the tier before the step overwrites
    /// their blocks.
    fn offload_evicted(&mut self, plan: &SchedulerOutput) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        if !tier.saves_on().evicted {
            return;
        }
        let wanted: Vec<(BlockId, BlockHash)> = plan
            .evicted
            .iter()
            .filter(|ev| tier.wants_save(&ev.hash, SaveReason::Evicted))
            .map(|ev| (ev.block, ev.hash))
            .collect();
        save_blocks(&self.executor, tier.as_mut(), wanted, SaveReason::Evicted);
    }

    /// At start: the sessions the tier kept from the last process become restorable.
    pub fn restore_sessions(&mut self, now: f64) -> usize {
        let Some(tier) = self.tier.as_mut() else {
            return 0;
        };
        let records = tier.saved_sessions();
        let n = records.len();
        self.scheduler.restore_sessions(records, now);
        n
    }

    /// At shutdown: the parked sessions handed to the tier for the next start.
    pub fn save_sessions_for_shutdown(&mut self, now: f64) -> usize {
        let records = self.scheduler.session_records(now);
        let n = records.len();
        if let Some(tier) = self.tier.as_mut() {
            tier.save_sessions(records);
        }
        n
    }

    /// At shutdown, when the tier asks for it: the pool's cached blocks the tier lacks, copied
    /// out and saved ([`SaveReason::Shutdown`]), least likely to be evicted first. Returns how
    /// many were handed over.
    pub fn save_cached_for_shutdown(&mut self) -> usize {
        let Some(tier) = self.tier.as_mut() else {
            return 0;
        };
        if !tier.saves_on_shutdown() {
            return 0;
        }
        let pool = self.scheduler.kv_manager().pool();
        let mut cached: Vec<(BlockId, BlockHash)> = pool
            .cached_blocks()
            .into_iter()
            .filter(|(_, hash)| tier.wants_save(hash, SaveReason::Shutdown))
            .collect();
        cached.reverse();
        let n = cached.len();
        for chunk in cached.chunks(64) {
            save_blocks(
                &self.executor,
                tier.as_mut(),
                chunk.to_vec(),
                SaveReason::Shutdown,
            );
        }
        n
    }

    fn save_new_entries(&mut self) {
        let entries = self.scheduler.take_new_entries();
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        let wanted: Vec<(BlockId, BlockHash)> = entries
            .into_iter()
            .filter(|(_, hash)| tier.wants_save(hash, SaveReason::Filled))
            .collect();
        save_blocks(&self.executor, tier.as_mut(), wanted, SaveReason::Filled);
    }

    /// Attach the recorder's reports to the updates they belong to (same order, same slots).
    fn attach_reports(&mut self, updates: &mut [RequestUpdate]) {
        let Some(rec) = self.scheduler.observer_mut().as_mut() else {
            return;
        };
        if !rec.has_reports() {
            return;
        }
        let mut i = 0;
        for (slot, report) in rec.drain_reports() {
            let wanted = |u: &RequestUpdate| {
                u.slot == slot && u.report.is_none() && (u.first_token || u.finish.is_some())
            };
            let found = updates[i..].iter().position(wanted).map(|p| p + i);
            let found = found.or_else(|| updates.iter().position(wanted));
            if let Some(j) = found {
                updates[j].report = Some(Box::new(report));
                i = j;
            }
        }
    }

    fn emit_stats(&mut self, iteration_tokens: Option<u64>) {
        let gauges = self.scheduler.gauges();
        let spec = self.scheduler.take_spec_stats();
        let Some(rec) = self.scheduler.observer_mut().as_mut() else {
            return;
        };
        rec.end_step();
        if !self.event_sinks.is_empty() {
            let events = rec.take_events();
            if !events.is_empty() {
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let batch = Arc::new(EventBatch { ts, events });
                for sink in &mut self.event_sinks {
                    sink.publish(Arc::clone(&batch));
                }
            }
        }
        let totals = rec.totals();
        let deltas = self.deltas.advance(&totals);
        let tenants = self.deltas.advance_tenants(rec.tenant_totals());
        let samples = rec.take_latency_samples();
        let finished: Vec<FinishedRequestStats> = rec.take_finished();
        let stats = StepStats {
            deltas,
            gauges,
            finished,
            ttft_s: samples.ttft_s,
            itl_s: samples.itl_s,
            iteration_tokens,
            tenants,
            hit_rates: totals.hit_rates(),
            spec,
        };
        // A stats message whenever any delta is non-zero (or something finished), even in a
        // step without tokens.
        if !stats.deltas.is_zero() || !stats.finished.is_empty() || stats.iteration_tokens.is_some()
        {
            for l in &mut self.loggers {
                l.record(&stats);
            }
        }
    }
}
