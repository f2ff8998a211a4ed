//! The core thread: owns the [`EngineCore`] and runs one step at a time, between steps taking
//! the handle's commands. A panic anywhere on this thread is caught: the engine becomes
//! [`EngineState::Dead`], every live stream ends with an error, and the thread exits.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Duration;

use cachet_core::scheduler::RequestUpdate;
use cachet_core::{Executor, FinishReason};
use tokio::sync::mpsc;

use crate::handle::{Command, EngineFailure, EngineState, RequestHandle, RequestOutput, Shared};
use crate::step::EngineCore;

/// Where each live request's outputs go: by the core's slot (updates name slots), and the
/// handle → slots map for commands (clients name handles; a request forked into n sequences
/// has n slots).
#[derive(Default)]
struct Routes {
    by_slot: Vec<Option<Route>>,
    slots: HashMap<RequestHandle, Vec<u32>>,
    /// Streams whose last live sequence ended while this step's updates are delivered: a
    /// sequence forked in the same step (after its first sequence ended with its first token,
    /// or in a slot another sequence of its request just freed) still reaches its stream.
    /// Emptied after each turn of the engine loop.
    ended: HashMap<RequestHandle, mpsc::UnboundedSender<RequestOutput>>,
}

struct Route {
    handle: RequestHandle,
    seq: u32,
    tx: mpsc::UnboundedSender<RequestOutput>,
}

impl Routes {
    fn insert(
        &mut self,
        slot: u32,
        handle: RequestHandle,
        seq: u32,
        tx: mpsc::UnboundedSender<RequestOutput>,
    ) {
        let i = slot as usize;
        if self.by_slot.len() <= i {
            self.by_slot.resize_with(i + 1, || None);
        }
        self.by_slot[i] = Some(Route { handle, seq, tx });
        self.slots.entry(handle).or_default().push(slot);
    }

    fn len(&self) -> usize {
        self.slots.len()
    }

    fn live_slots(&self) -> Vec<u32> {
        self.slots.values().flatten().copied().collect()
    }

    /// The slots of a request's sequences (`seq`: only that one).
    fn slots_of(&self, handle: RequestHandle, seq: Option<u32>) -> Vec<u32> {
        let all = self.slots.get(&handle).cloned().unwrap_or_default();
        match seq {
            None => all,
            Some(q) => all
                .into_iter()
                .filter(|&s| {
                    self.by_slot
                        .get(s as usize)
                        .and_then(|r| r.as_ref())
                        .is_some_and(|r| r.seq == q)
                })
                .collect(),
        }
    }

    /// A sequence forked from a live request: it goes where its request's outputs go.
    fn adopt(&mut self, slot: u32, handle: RequestHandle, seq: u32) {
        let tx = self
            .slots
            .get(&handle)
            .and_then(|s| s.first())
            .and_then(|&p| self.by_slot.get(p as usize))
            .and_then(|r| r.as_ref())
            .map(|r| r.tx.clone())
            .or_else(|| self.ended.get(&handle).cloned());
        if let Some(tx) = tx {
            self.insert(slot, handle, seq, tx);
        }
    }

    /// Send one update to its stream. Returns the slot when the receiver is gone and the
    /// request is still live (the caller aborts it: the client disconnected).
    fn deliver(&mut self, up: RequestUpdate, error: Option<&EngineFailure>) -> Option<u32> {
        let slot = up.slot;
        let known = self
            .by_slot
            .get(slot as usize)
            .is_some_and(|r| r.as_ref().is_some_and(|r| r.handle.0 == up.handle));
        if !known && up.seq > 0 {
            self.adopt(slot, RequestHandle(up.handle), up.seq);
        }
        let entry = self.by_slot.get_mut(slot as usize)?;
        let out = RequestOutput {
            tokens: up.token.into_iter().collect(),
            first_token: up.first_token,
            finish_reason: up.finish,
            report: up.report,
            session: up.session.map(|s| *s),
            error: error.cloned(),
            seq: up.seq,
            prompt_logprobs: up.prompt_logprobs.map(|b| *b),
            spec_decode: up.spec_decode,
        };
        if out.finish_reason.is_some() {
            let route = entry.take()?;
            if let Some(s) = self.slots.get_mut(&route.handle) {
                s.retain(|&x| x != slot);
                if s.is_empty() {
                    self.slots.remove(&route.handle);
                    self.ended.insert(route.handle, route.tx.clone());
                }
            }
            let _ = route.tx.send(out);
            None
        } else {
            let route = entry.as_ref()?;
            route.tx.send(out).is_err().then_some(slot)
        }
    }

    /// End every live stream with `error` (the engine died).
    fn fail_all(&mut self, error: &EngineFailure) {
        for route in self.by_slot.iter_mut().filter_map(Option::take) {
            let _ = route.tx.send(RequestOutput::failed(error.clone()));
        }
        self.slots.clear();
    }
}

pub(crate) fn run<E: Executor>(
    core: EngineCore<E>,
    rx: std_mpsc::Receiver<Command>,
    sh: Arc<Shared>,
) {
    let mut routes = Routes::default();
    let mut core = core;
    let restored = core.restore_sessions(sh.now());
    if restored > 0 {
        tracing::info!(
            sessions = restored,
            "sessions parked before the restart are restorable"
        );
    }
    let result = catch_unwind(AssertUnwindSafe(|| serve(&mut core, &rx, &sh, &mut routes)));
    match result {
        Ok(()) => sh.advance_state(EngineState::Stopped),
        Err(panic) => {
            let msg = panic_message(&*panic);
            tracing::error!(error = %msg, live = routes.len(), "the engine's core thread panicked; failing every live request");
            sh.advance_state(EngineState::Dead);
            routes.fail_all(&EngineFailure::Died(msg));
            // Refuse whatever is still queued: acks dropped, streams closed.
            drop(rx);
        }
    }
    sh.live.send_replace(0);
    sh.exited.send_replace(true);
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}

fn serve<E: Executor>(
    core: &mut EngineCore<E>,
    rx: &std_mpsc::Receiver<Command>,
    sh: &Shared,
    routes: &mut Routes,
) {
    let now = || sh.now();
    let mut idle_step = false;
    loop {
        // Wait for work when idle (or when the last step had nothing to do: loads in flight);
        // otherwise just drain what arrived.
        let first = if core.scheduler().has_unfinished() && !idle_step {
            rx.try_recv().ok()
        } else {
            let wait = if core.scheduler().has_unfinished() {
                Duration::from_millis(2)
            } else {
                Duration::from_millis(500)
            };
            match rx.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        let mut cmds: Vec<Command> = first.into_iter().collect();
        cmds.extend(rx.try_iter());
        // Answered once the gauges reflect the command (a scrape right after sees it).
        let mut replies: Vec<Box<dyn FnOnce()>> = Vec::new();
        let had_cmds = !cmds.is_empty();
        for cmd in cmds {
            match cmd {
                Command::Add {
                    handle,
                    req,
                    out,
                    ack,
                } => {
                    if sh.state() != EngineState::Running {
                        // Dropping the ack refuses it: the handle reports the state.
                        continue;
                    }
                    match core.add_request(handle.0, now(), *req) {
                        Ok(slot) => {
                            routes.insert(slot, handle, 0, out);
                            // Live before the client hears of it, so that a waiter for idle
                            // never sees a stale zero; the zero comes only after the gauges
                            // of the iteration that ended the last request.
                            sh.live.send_replace(routes.len());
                            let _ = ack.send(Ok(()));
                        }
                        Err(e) => {
                            let _ = ack.send(Err(e));
                        }
                    }
                }
                Command::Finish {
                    handle,
                    seq,
                    reason,
                } => {
                    for slot in routes.slots_of(handle, seq) {
                        if let Some(up) = core.finish(slot, reason, now()) {
                            routes.deliver(up, None);
                        }
                    }
                }
                Command::ResetPrefixCache(reply) => {
                    let done = core.reset_prefix_cache();
                    replies.push(Box::new(move || {
                        let _ = reply.send(done);
                    }));
                }
                Command::ReleaseSession(sid, reply) => {
                    // A turn in flight is aborted (an aborted turn does not park), then any
                    // parked KV is released.
                    if let Some(slot) = core.scheduler().session_turn(&sid) {
                        if let Some(up) = core.finish(slot, FinishReason::Abort, now()) {
                            routes.deliver(up, None);
                        }
                    }
                    core.scheduler_mut().release_session(&sid);
                    replies.push(Box::new(move || {
                        let _ = reply.send(());
                    }));
                }
                Command::AbortAll(reply) => {
                    let slots = routes.live_slots();
                    let mut n = 0;
                    for slot in slots {
                        if let Some(up) = core.finish(slot, FinishReason::Abort, now()) {
                            routes.deliver(up, None);
                            n += 1;
                        }
                    }
                    let _ = reply.send(n);
                }
                Command::Inspect(q, reply) => {
                    let _ = reply.send(core.inspect(q, now()));
                }
                Command::Wake => {}
                Command::Shutdown => {
                    let kept = core.save_sessions_for_shutdown(now());
                    if kept > 0 {
                        tracing::info!(sessions = kept, "shutdown: parked sessions kept");
                    }
                    let n = core.save_cached_for_shutdown();
                    if n > 0 {
                        tracing::info!(
                            blocks = n,
                            "shutdown: cached blocks handed to the disk KV tier"
                        );
                    }
                    return;
                }
            }
        }
        if had_cmds {
            sh.gauges.send_replace(core.scheduler().gauges());
        }
        for reply in replies {
            reply();
        }
        core.scheduler_mut().expire_sessions(now());
        idle_step = false;
        if core.scheduler().has_unfinished() {
            match core.step(now) {
                Ok(outs) => {
                    idle_step = core.last_step_idle();
                    let mut gone = Vec::new();
                    for out in outs {
                        if let Some(slot) = routes.deliver(out, None) {
                            gone.push(slot);
                        }
                    }
                    // Receivers that went away: the client disconnected.
                    for slot in gone {
                        if let Some(up) = core.finish(slot, FinishReason::Abort, now()) {
                            routes.deliver(up, None);
                        }
                    }
                }
                Err(e) => {
                    let failure = EngineFailure::Model(e.to_string());
                    tracing::error!(error = %e, live = routes.len(), "model execution failed; ending the live requests with an error");
                    for slot in routes.live_slots() {
                        if let Some(up) = core.finish(slot, FinishReason::Error, now()) {
                            routes.deliver(up, Some(&failure));
                        }
                    }
                }
            }
        }
        // (A handle is never reused; nothing of this iteration's is delivered later.)
        routes.ended.clear();
        sh.gauges.send_replace(core.scheduler().gauges());
        sh.live.send_replace(routes.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_core::Sampled;

    fn up(slot: u32, seq: u32, token: u32, finish: Option<FinishReason>) -> RequestUpdate {
        RequestUpdate {
            slot,
            handle: 7,
            token: Some(Sampled::token(token)),
            first_token: true,
            finish,
            session: None,
            report: None,
            seq,
            prompt_logprobs: None,
            spec_decode: None,
        }
    }

    /// One step of a request with n = 3 and max_tokens 1, as the scheduler reports it: the
    /// first sequence ends with its first token, the second is forked into slot 5 and ends,
    /// the third is forked into slot 5 again (just freed) and ends. Every update reaches the
    /// request's stream, in order.
    #[test]
    fn sequences_forked_in_the_step_their_request_ended_reach_its_stream() {
        let mut r = Routes::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        r.insert(3, RequestHandle(7), 0, tx);
        let len = Some(FinishReason::Length);
        for u in [up(3, 0, 10, len), up(5, 1, 11, len), up(5, 2, 12, len)] {
            assert_eq!(r.deliver(u, None), None);
        }
        r.ended.clear();
        let mut got = Vec::new();
        while let Ok(o) = rx.try_recv() {
            got.push((o.seq, o.tokens[0].token, o.finish_reason));
        }
        assert_eq!(got, [(0, 10, len), (1, 11, len), (2, 12, len)]);
        assert_eq!(r.len(), 0);
        // A live third sequence keeps its route.
        let (tx, mut rx) = mpsc::unbounded_channel();
        r.insert(3, RequestHandle(7), 0, tx);
        for u in [up(3, 0, 10, len), up(5, 1, 11, len), up(5, 2, 12, None)] {
            assert_eq!(r.deliver(u, None), None);
        }
        r.ended.clear();
        assert_eq!(r.slots_of(RequestHandle(7), None), [5]);
        assert_eq!(std::iter::from_fn(|| rx.try_recv().ok()).count(), 3);
    }
}
