//! The labels of the requests that created the block index's entries, by a small id
//! ([`Creators`]), so that an entry (and a lifecycle record of its eviction) names its creator
//! without holding a reference count on a label that may have gone cold long ago.

use std::sync::Arc;

/// Labels of the requests that created entries (or that a kept lifecycle names as an evicted
/// entry's owner), by id. An id is in use while its request lives, a live entry names it (the
/// index's creator ids), or a lifecycle record the log keeps does. The step never counts these:
/// creating an entry, dropping one or recording its eviction touches no line of this table.
/// Ids no longer in use are found by a sweep over those three, when the table has doubled since
/// the last one ([`Creators::wants_sweep`], [`Creators::sweep`]), and reused.
#[derive(Debug, Default)]
pub(crate) struct Creators {
    slots: Vec<Creator>,
    free: Vec<u32>,
    /// Ids handed out since the last sweep, and ids in use after it.
    since_sweep: usize,
    in_use: usize,
    /// The sweep's mark.
    epoch: u32,
}

#[derive(Debug, Default)]
struct Creator {
    label: Option<Arc<str>>,
    /// Its request lives (or, for an id taken for one fill, that fill is not applied yet).
    live: bool,
    /// The last sweep that found it in use.
    mark: u32,
}

impl Creators {
    /// A new id for a request's `label`, live until [`Creators::finish`].
    pub(crate) fn acquire(&mut self, label: &Arc<str>) -> u32 {
        self.since_sweep += 1;
        let c = Creator {
            label: Some(label.clone()),
            live: true,
            mark: self.epoch,
        };
        if let Some(id) = self.free.pop() {
            self.slots[id as usize] = c;
            return id;
        }
        self.slots.push(c);
        (self.slots.len() - 1) as u32
    }

    /// The request holding `id` ended (its entries and records may still name it).
    pub(crate) fn finish(&mut self, id: u32) {
        if let Some(s) = self.slots.get_mut(id as usize) {
            s.live = false;
        }
    }

    /// Whether enough ids were handed out since the last sweep that one is due (the table
    /// has no free id, and grew by as many as were in use: sweeps cost a walk of what may
    /// name an id, so they come less often as more are in use).
    #[inline]
    pub(crate) fn wants_sweep(&self) -> bool {
        #[cfg(test)]
        if SWEEP_OFTEN.with(|c| c.get()) {
            return self.since_sweep > 0;
        }
        self.free.is_empty() && self.since_sweep > self.in_use.max(64)
    }

    /// Free every id that is not live and not in `in_use` (the ids live entries and kept
    /// lifecycle records name).
    pub(crate) fn sweep(&mut self, in_use: impl Iterator<Item = u32>) {
        self.epoch = self.epoch.wrapping_add(1);
        let epoch = self.epoch;
        for id in in_use {
            if let Some(s) = self.slots.get_mut(id as usize) {
                s.mark = epoch;
            }
        }
        self.free.clear();
        self.in_use = 0;
        for (id, s) in self.slots.iter_mut().enumerate() {
            if s.live || (s.label.is_some() && s.mark == epoch) {
                self.in_use += 1;
            } else {
                s.label = None;
                self.free.push(id as u32);
            }
        }
        // The lowest ids first (tests read them back in order).
        self.free.reverse();
        self.since_sweep = 0;
    }

    pub(crate) fn label(&self, id: u32) -> Option<Arc<str>> {
        self.slots.get(id as usize).and_then(|s| s.label.clone())
    }

    /// Ids with a label (in use, or not swept yet).
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.slots.iter().filter(|s| s.label.is_some()).count()
    }

    /// Whether `id` has a label (tests).
    #[cfg(test)]
    pub(crate) fn alive(&self, id: u32) -> bool {
        self.slots
            .get(id as usize)
            .is_some_and(|s| s.label.is_some())
    }

    /// Whether `id`'s request lives (tests).
    #[cfg(test)]
    pub(crate) fn is_live(&self, id: u32) -> bool {
        self.slots.get(id as usize).is_some_and(|s| s.live)
    }
}

#[cfg(test)]
thread_local! {
    /// Sweep the creator ids at every chance (tests: a sweep must change nothing shown).
    pub(crate) static SWEEP_OFTEN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
