//! `background: true`: the response is stored `in_progress` and answered at once; a task runs
//! the generation and stores the finished response. `cancel` aborts the task, which drops the
//! generation (the engine aborts the request).

use serde_json::Value;

use crate::generate::Generation;

use super::Turn;

/// Stores the response as in progress, starts its run, and returns the object to answer with.
pub fn start(turn: Turn, gen: Generation) -> Value {
    let mut r = turn.skeleton.clone();
    r["status"] = "in_progress".into();
    turn.keep(&r);
    let id = turn.id.clone();
    let state = turn.state.clone();
    // The task is registered before it can finish (it unregisters itself at the end).
    let mut running = state.responses().running();
    let task = tokio::spawn(async move {
        let (r, _) = super::collect(&turn, gen).await;
        let still_running = turn.state.responses().running().remove(&turn.id).is_some();
        if still_running {
            let updated = turn.state.responses().store.update(&turn.id, |rec| {
                rec.response = r.clone();
            });
            if !updated {
                tracing::debug!(id = %turn.id, "responses: a background response ended after it was dropped");
            }
        }
    });
    running.insert(id, task.abort_handle());
    r
}
