//! Redis' state as the client sees it, and logging that happens once per change, not once per
//! request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Up or down. While down, lookups and loads skip Redis at once (no call, no timeout to wait
/// out) and a prober tries to reconnect; the first success brings it back up.
pub(crate) struct Health {
    up: AtomicBool,
    target: String,
}

impl Health {
    /// Starts down: nothing is connected yet.
    pub(crate) fn new(target: String) -> Self {
        Health {
            up: AtomicBool::new(false),
            target,
        }
    }

    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Returns true when this call changed the state (and logged it).
    pub(crate) fn mark_down(&self, why: &str) -> bool {
        let was_up = self.up.swap(false, Ordering::AcqRel);
        if was_up {
            tracing::warn!(
                target: "cachet_tiers",
                redis = %self.target,
                "Redis KV tier down ({why}); serving without it until it answers again"
            );
        }
        was_up
    }

    /// Returns true when this call changed the state (and logged it).
    pub(crate) fn mark_up(&self) -> bool {
        let was_up = self.up.swap(true, Ordering::AcqRel);
        if !was_up {
            tracing::info!(target: "cachet_tiers", redis = %self.target, "Redis KV tier up");
        }
        !was_up
    }

    /// Logs the state at start (down) once.
    pub(crate) fn log_unreachable_at_start(&self, why: &str) {
        tracing::warn!(
            target: "cachet_tiers",
            redis = %self.target,
            "Redis KV tier unreachable at start ({why}); serving without it until it answers"
        );
    }
}

/// Warnings about refused values and failed saves: the first of each kind at once, then at
/// most one per `every` with the number suppressed in between, so a poisoned key or a full
/// Redis cannot flood the log.
pub(crate) struct RateLog {
    every: Duration,
    last: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl RateLog {
    pub(crate) fn new(every: Duration) -> Self {
        RateLog {
            every,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Returns whether this occurrence was logged.
    pub(crate) fn warn(&self, kind: &'static str, detail: &dyn std::fmt::Display) -> bool {
        let now = Instant::now();
        let mut map = match self.last.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        match map.get_mut(kind) {
            None => {
                map.insert(kind, (now, 0));
                tracing::warn!(target: "cachet_tiers", "KV tier: {kind}: {detail}");
                true
            }
            Some((at, suppressed)) if now.duration_since(*at) >= self.every => {
                tracing::warn!(
                    target: "cachet_tiers",
                    "KV tier: {kind}: {detail} ({} more since the last report)",
                    *suppressed
                );
                *at = now;
                *suppressed = 0;
                true
            }
            Some((_, suppressed)) => {
                *suppressed += 1;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_changes_are_reported_once() {
        let h = Health::new("redis://x".into());
        assert!(!h.is_up());
        assert!(h.mark_up());
        assert!(!h.mark_up());
        assert!(h.mark_down("timeout"));
        assert!(!h.mark_down("timeout"));
        assert!(!h.is_up());
    }

    #[test]
    fn rate_log_reports_the_first_then_waits() {
        let r = RateLog::new(Duration::from_secs(3600));
        assert!(r.warn("bad signature", &"k1"));
        assert!(!r.warn("bad signature", &"k2"));
        assert!(r.warn("truncated", &"k3"));
        let r = RateLog::new(Duration::ZERO);
        assert!(r.warn("x", &1));
        assert!(r.warn("x", &2));
    }
}
