//! What a request's block boundary does to the insight: blocks allocated for it (the entries
//! they evicted dropped from the index, the larger pools' books, the lifecycle's records) and
//! blocks filled for it (new entries queued for the index, the lifecycle's records), each with
//! a path of its own for a decode step's single block.

use std::sync::Arc;

use super::super::blocks::NONE;
use super::super::hot::Ids;
use super::super::lifecycle::{BlockEventKind, Rec, MAX_BLOCK_EVENTS};
#[cfg(test)]
use super::tests;
use super::Insight;
use crate::block_pool::BlockPool;
use crate::events::wire_hash;
use crate::hash::BlockHash;
use crate::{BlockId, TokenId};

impl Insight {
    /// Blocks taken from the free pool for a request: the last `allocated` of `blocks`, some of
    /// whose entries (`evicted`) were dropped.
    pub(crate) fn allocated(
        &mut self,
        slot: Option<u32>,
        pool: &BlockPool,
        kv: &crate::kv_manager::KvEffects,
        blocks: &[BlockId],
    ) {
        // The request's line, last touched a block of decode steps ago: its misses overlap
        // with the index's below.
        if let Some(l) = slot.and_then(|s| self.live.get(s as usize)) {
            super::super::prefetch(l);
        }
        if let Some(ix) = self.index.as_ref() {
            for e in &kv.evicted {
                ix.prefetch_owner(e.block);
            }
        }
        self.ensure(pool);
        // The entries it evicted are dropped from the index now, after what is queued.
        if self.index.is_some() {
            self.flush();
        }
        let life = slot.filter(|&s| self.live.get(s as usize).is_some_and(|l| l.chain.on));
        if life.is_none() && self.index.is_none() && self.shadow.is_none() {
            // Nothing here keeps anything of an allocation (reporting without the insight).
            return;
        }
        let first_new = blocks.len().saturating_sub(kv.allocated as usize);
        let new = &blocks[first_new..];
        // A decode block's allocation: one block, which evicted at most the entry it held
        // (when both events fit the lifecycle).
        if let ([blk], ev @ ([] | [_])) = (new, &kv.evicted[..]) {
            let ev = ev.first();
            if ev.is_none_or(|e| e.block == *blk)
                && life.is_none_or(|s| self.live[s as usize].chain.count() + 2 <= MAX_BLOCK_EVENTS)
            {
                self.allocated_one(life, first_new as u32, *blk, ev);
                return;
            }
        }
        // The pool takes blocks in queue order and lists evictions as it goes: the evicted
        // blocks are a subsequence of the new ones, found with one walk (checked: otherwise by
        // search).
        let in_order = {
            let mut it = new.iter();
            kv.evicted.iter().all(|e| it.any(|&x| x == e.block))
        };
        let mut p = 0;
        for e in &kv.evicted {
            let owner = self.index.as_mut().and_then(|ix| ix.evicted(e.block));
            if let Some(s) = life {
                let at = if in_order {
                    while new.get(p).is_some_and(|&x| x != e.block) {
                        p += 1;
                    }
                    (p < new.len()).then_some(p)
                } else {
                    new.iter().position(|&x| x == e.block)
                };
                let at = at.map(|p| (first_new + p) as u32);
                let mut r = Rec::new(
                    BlockEventKind::Evicted,
                    at,
                    Some(e.block),
                    Some(wire_hash(&e.hash)),
                );
                r.owner = owner.unwrap_or(NONE);
                self.record(s, r);
            }
        }
        if let Some(sh) = self.shadow.as_mut() {
            // In the order the pool took them: where the hashless ones sit matters to the
            // larger pools' victim regions.
            if in_order {
                let mut q = 0;
                sh.take_blocks(new.iter().map(|&blk| {
                    let e = kv.evicted.get(q).filter(|e| e.block == blk)?;
                    q += 1;
                    Some(e.hash)
                }));
            } else {
                sh.take_blocks(
                    new.iter()
                        .map(|&blk| kv.evicted.iter().find(|e| e.block == blk).map(|e| e.hash)),
                );
            }
        }
        if let Some(s) = life {
            for (j, &blk) in blocks.iter().enumerate().skip(first_new) {
                self.record(
                    s,
                    Rec::new(BlockEventKind::Allocated, Some(j as u32), Some(blk), None),
                );
            }
        }
    }

    /// [`Insight::allocated`] of one block at `index` of the request's table, which evicted
    /// the entry `ev` it held, if any (its lifecycle, if kept, has room for two events).
    #[inline]
    fn allocated_one(
        &mut self,
        life: Option<u32>,
        index: u32,
        blk: BlockId,
        ev: Option<&crate::block_pool::Evicted>,
    ) {
        let owner = match (ev, self.index.as_mut()) {
            (Some(e), Some(ix)) => ix.evicted(e.block),
            _ => None,
        };
        if let Some(s) = life {
            let r = match ev {
                Some(e) => Rec::evicted_for(index, blk, wire_hash(&e.hash), owner.unwrap_or(NONE)),
                None => Rec::new(BlockEventKind::Allocated, Some(index), Some(blk), None),
            };
            self.record(s, r);
        }
        if let Some(sh) = self.shadow.as_mut() {
            sh.take_one(ev.map(|e| &e.hash));
        }
    }

    /// Blocks filled for a request (`t`: its table); the `created` ones are new cache entries.
    pub(crate) fn filled(
        &mut self,
        slot: Option<u32>,
        label: &Arc<str>,
        t: Table<'_>,
        kv: &crate::kv_manager::KvEffects,
        now: f64,
    ) {
        // A decode step's fill: one block, the request's newest, a new entry or not.
        let one = match (slot, kv.filled, &kv.created[..]) {
            (Some(s), 1, created @ ([] | [_])) if (s as usize) < self.live.len() => {
                let j = (kv.committed_until / self.block_size).wrapping_sub(1);
                let fits = j < t.blocks.len() && j < t.hashes.len();
                (fits && created.iter().all(|&c| c as usize == j)).then_some((
                    s,
                    j,
                    !created.is_empty(),
                ))
            }
            _ => None,
        };
        match one {
            Some((s, j, created)) => self.filled_one(s, label, t, j, created, now),
            None => self.filled_any(slot, label, t, kv, now),
        }
        #[cfg(test)]
        if tests::IMMEDIATE.with(|c| c.get()) {
            self.flush();
        }
    }

    /// [`Insight::filled`] of the block at `j` of the table alone (in it and hashed), for the
    /// live request in `slot` (`created`: it became a new entry).
    #[inline]
    fn filled_one(
        &mut self,
        slot: u32,
        label: &Arc<str>,
        t: Table<'_>,
        j: usize,
        created: bool,
        now: f64,
    ) {
        let (Some(&blk), Some(h)) = (t.blocks.get(j), t.hashes.get(j)) else {
            return;
        };
        let b = self.block_size;
        let wire = wire_hash(h);
        if let (true, Some(ix), Some(toks)) = (
            created,
            self.index.as_mut(),
            t.tokens.get(j * b..(j + 1) * b),
        ) {
            let r = &mut self.live[slot as usize].ids;
            if r.creator == NONE {
                r.creator = ix.creators.acquire(label);
            }
            let parent = parent_of(Some(r), t, j);
            if ix.takes(blk, b) {
                self.pending.push_create(
                    blk, wire, j as u32, parent, toks, r.root_key, r.creator, now,
                );
            }
            r.own = Some((j as u32, blk));
        }
        if self.cfg.request_history > 0 {
            self.record(slot, Rec::filled(j as u32, Some(blk), Some(wire), created));
        }
    }

    /// [`Insight::filled`], any blocks.
    fn filled_any(
        &mut self,
        slot: Option<u32>,
        label: &Arc<str>,
        t: Table<'_>,
        kv: &crate::kv_manager::KvEffects,
        now: f64,
    ) {
        let b = self.block_size;
        // What the new entries need of the request is in its dense `Ids`.
        let ids = slot.and_then(|s| self.live.get_mut(s as usize).map(|l| &mut l.ids));
        if let (Some(ix), false) = (self.index.as_mut(), kv.created.is_empty()) {
            let root_key = ids.as_ref().map_or(0, |r| r.root_key);
            // The creator's id: the request's own (taken at its first entry), or one taken for
            // these entries alone (finished once they are applied).
            let (creator, mut ids) = match ids {
                Some(r) => {
                    if r.creator == NONE {
                        r.creator = ix.creators.acquire(label);
                    }
                    (r.creator, Some(r))
                }
                None => (ix.creators.acquire(label), None),
            };
            let temporary = ids.is_none();
            for &i in &kv.created {
                let i = i as usize;
                let (Some(&blk), Some(h), Some(toks)) = (
                    t.blocks.get(i),
                    t.hashes.get(i),
                    t.tokens.get(i * b..(i + 1) * b),
                ) else {
                    continue;
                };
                let parent = parent_of(ids.as_deref(), t, i);
                if ix.takes(blk, toks.len()) {
                    self.pending.push_create(
                        blk,
                        wire_hash(h),
                        i as u32,
                        parent,
                        toks,
                        root_key,
                        creator,
                        now,
                    );
                }
                if let Some(r) = ids.as_deref_mut() {
                    r.own = Some((i as u32, blk));
                }
            }
            if temporary {
                self.pending.push_finish(creator);
            }
        }
        // The lifecycle's events.
        if let Some(slot) = slot.filter(|_| self.cfg.request_history > 0 && kv.filled > 0) {
            let end = kv.committed_until / b;
            let start = end.saturating_sub(kv.filled as usize);
            for j in start..end {
                self.record(
                    slot,
                    Rec::filled(
                        j as u32,
                        t.blocks.get(j).copied(),
                        t.hashes.get(j).map(wire_hash),
                        kv.created.contains(&(j as u32)),
                    ),
                );
            }
        }
    }
}

/// A request's side of a fill: its block table, the hashes and tokens of its prompt and output
/// so far, and the pool its blocks are in.
#[derive(Clone, Copy)]
pub(crate) struct Table<'a> {
    pub(crate) pool: &'a BlockPool,
    pub(crate) blocks: &'a [BlockId],
    pub(crate) hashes: &'a [BlockHash],
    pub(crate) tokens: &'a [TokenId],
}

/// The parent entry of a new entry at `i` of a request's table `t` (`ids`: the request's,
/// when it lives): usually the request's own block before it; a block the request recomputed
/// while the entry lived elsewhere is found by hash. `NONE` at depth 0; without one found, the
/// new entry is an orphan (`NONE` too: a sentinel id no block has). (The pool's view: the
/// index, once what is queued is applied, agrees.)
#[inline]
fn parent_of(ids: Option<&Ids>, t: Table<'_>, i: usize) -> BlockId {
    let Some(p) = i.checked_sub(1) else {
        return NONE;
    };
    let pool = t.pool;
    match (t.blocks.get(p), t.hashes.get(p)) {
        (Some(&pb), Some(_ph)) if ids.is_some_and(|r| r.own == Some((p as u32, pb))) => {
            #[cfg(test)]
            {
                assert_eq!(pool.block_hash(pb).as_ref(), Some(_ph), "own entry");
                tests::OWN_PARENTS.with(|n| n.set(n.get() + 1));
            }
            pb
        }
        (Some(&pb), Some(ph)) if pool.block_hash(pb).as_ref() == Some(ph) => pb,
        (_, Some(ph)) => pool.lookup(ph).unwrap_or(NONE),
        _ => NONE,
    }
}
