//! Stored responses (`store: true`): each response as returned, the conversation it ends, its
//! owner (the API key that created it) and the engine session its KV is parked under. Bounded
//! by count (`--responses-store-max`) and age (`--responses-store-ttl-secs`): the oldest go
//! first. The record is a plain serde struct: what a later disk persistence serializes.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One stored response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// `resp_...`.
    pub id: String,
    /// The key that created it ([`crate::auth::key_id`]; `""` without keys): only that key
    /// reads, continues or deletes it.
    pub owner: String,
    /// Unix seconds when it was stored (its age is counted from here).
    pub stored_at: f64,
    /// The response object as `GET /v1/responses/{id}` returns it.
    pub response: Value,
    /// Every input item of the conversation up to this response's output (the earlier
    /// responses' inputs and outputs, then this request's input), each with an `id`.
    pub input_items: Vec<Value>,
    /// The engine session (spec §5) the conversation's KV is parked under: the first
    /// response's id of a `previous_response_id` chain.
    pub session_id: Option<String>,
    /// The cache salt the conversation ran under (a continuation keeps it).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// How long and how many responses are kept.
#[derive(Clone, Copy, Debug)]
pub struct StoreLimits {
    pub max_responses: usize,
    pub ttl_secs: f64,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, StoredResponse>,
    /// Ids in insertion order (stale ids of removed responses are skipped).
    order: VecDeque<String>,
}

/// The stored responses of every key.
pub struct ResponseStore {
    limits: StoreLimits,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    pub fn new(limits: StoreLimits) -> Self {
        ResponseStore {
            limits,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves whole records only: go on with them.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `rec` (replacing a record of the same id), then drops what is past the age or
    /// over the count, oldest first. Returns the records dropped (their sessions may go).
    pub fn put(&self, rec: StoredResponse, now: f64) -> Vec<StoredResponse> {
        let mut g = self.lock();
        if g.by_id.insert(rec.id.clone(), rec.clone()).is_none() {
            g.order.push_back(rec.id);
        }
        self.evict(&mut g, now)
    }

    fn evict(&self, g: &mut Inner, now: f64) -> Vec<StoredResponse> {
        let mut dropped = Vec::new();
        while let Some(id) = g.order.front().cloned() {
            let expired = match g.by_id.get(&id) {
                None => {
                    g.order.pop_front();
                    continue;
                }
                Some(r) => now - r.stored_at > self.limits.ttl_secs,
            };
            if !expired && g.by_id.len() <= self.limits.max_responses {
                break;
            }
            g.order.pop_front();
            dropped.extend(g.by_id.remove(&id));
        }
        dropped
    }

    /// The response `id` when `owner` stored it and it has not expired.
    pub fn get(&self, owner: &str, id: &str, now: f64) -> Option<StoredResponse> {
        let mut g = self.lock();
        self.evict(&mut g, now);
        g.by_id.get(id).filter(|r| r.owner == owner).cloned()
    }

    /// Changes the stored response object of `id` (a background run's progress), if kept.
    pub fn update(&self, id: &str, f: impl FnOnce(&mut StoredResponse)) -> bool {
        let mut g = self.lock();
        match g.by_id.get_mut(id) {
            Some(r) => {
                f(r);
                true
            }
            None => false,
        }
    }

    /// Removes `id` when `owner` stored it; returns it, and whether another kept response
    /// still names its session.
    pub fn remove(&self, owner: &str, id: &str) -> Option<(StoredResponse, bool)> {
        let mut g = self.lock();
        if g.by_id.get(id).is_none_or(|r| r.owner != owner) {
            return None;
        }
        let rec = g.by_id.remove(id)?;
        let shared = rec.session_id.as_ref().is_some_and(|s| {
            g.by_id
                .values()
                .any(|o| o.session_id.as_ref() == Some(s) && o.owner == rec.owner)
        });
        Some((rec, shared))
    }

    /// Every kept response that has finished (a background run still in progress would never
    /// finish after a restart), oldest first: what a restart keeps.
    pub fn finished_records(&self) -> Vec<StoredResponse> {
        let g = self.lock();
        g.order
            .iter()
            .filter_map(|id| g.by_id.get(id))
            .filter(|r| {
                !matches!(
                    r.response["status"].as_str(),
                    Some("in_progress" | "queued")
                )
            })
            .cloned()
            .collect()
    }

    /// Responses the last process kept, oldest first; those past the age or over the count are
    /// dropped as [`ResponseStore::put`] drops them. Returns how many are kept.
    pub fn restore(&self, records: Vec<StoredResponse>, now: f64) -> usize {
        for r in records {
            self.put(r, now);
        }
        self.len()
    }

    /// Responses kept now.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(id: &str, owner: &str, at: f64, session: Option<&str>) -> StoredResponse {
        StoredResponse {
            id: id.into(),
            owner: owner.into(),
            stored_at: at,
            response: json!({"id": id}),
            input_items: vec![json!({"id": "msg_1", "type": "message"})],
            session_id: session.map(Into::into),
            cache_salt: None,
        }
    }

    #[test]
    fn bounded_by_count_and_age_oldest_first() {
        let s = ResponseStore::new(StoreLimits {
            max_responses: 2,
            ttl_secs: 10.0,
        });
        assert!(s.put(rec("a", "k", 0.0, None), 0.0).is_empty());
        assert!(s.put(rec("b", "k", 1.0, None), 1.0).is_empty());
        // A third one drops the oldest.
        let dropped = s.put(rec("c", "k", 2.0, None), 2.0);
        assert_eq!(dropped.iter().map(|r| &r.id[..]).collect::<Vec<_>>(), ["a"]);
        assert_eq!(s.len(), 2);
        // b (stored at 1) is past 10 s at 11.5; c (at 2) is not.
        assert!(s.get("k", "b", 11.5).is_none());
        assert!(s.get("k", "c", 11.5).is_some());
        assert_eq!(s.len(), 1);
        assert!(s.get("k", "c", 12.5).is_none());
        assert!(s.is_empty());
    }

    #[test]
    fn a_response_is_its_owners_only() {
        let s = ResponseStore::new(StoreLimits {
            max_responses: 10,
            ttl_secs: 100.0,
        });
        s.put(rec("a", "alice", 0.0, Some("a")), 0.0);
        s.put(rec("b", "alice", 0.0, Some("a")), 0.0);
        assert!(s.get("bob", "a", 1.0).is_none());
        assert!(s.remove("bob", "a").is_none());
        assert!(s.get("alice", "a", 1.0).is_some());
        // b still names a's session; once b goes too, nothing does.
        let (r, shared) = s.remove("alice", "a").unwrap();
        assert_eq!((r.id.as_str(), shared), ("a", true));
        let (_, shared) = s.remove("alice", "b").unwrap();
        assert!(!shared);
        assert!(s.remove("alice", "b").is_none());
    }

    /// What a restart keeps: finished responses only, oldest first; restored into a store with
    /// a smaller count, the oldest go; past the age, none.
    #[test]
    fn finished_records_restore_within_the_limits() {
        let s = ResponseStore::new(StoreLimits {
            max_responses: 10,
            ttl_secs: 100.0,
        });
        s.put(rec("a", "k", 0.0, None), 0.0);
        let mut running = rec("b", "k", 1.0, None);
        running.response = json!({"id": "b", "status": "in_progress"});
        s.put(running, 1.0);
        s.put(rec("c", "k", 2.0, None), 2.0);
        let kept = s.finished_records();
        assert_eq!(
            kept.iter().map(|r| &r.id[..]).collect::<Vec<_>>(),
            ["a", "c"]
        );
        let small = ResponseStore::new(StoreLimits {
            max_responses: 1,
            ttl_secs: 100.0,
        });
        assert_eq!(small.restore(kept.clone(), 50.0), 1);
        assert!(small.get("k", "c", 50.0).is_some());
        let late = ResponseStore::new(StoreLimits {
            max_responses: 10,
            ttl_secs: 100.0,
        });
        assert_eq!(late.restore(kept, 150.0), 0);
    }

    #[test]
    fn the_record_round_trips_through_serde() {
        let r = rec("resp_1", "k", 3.5, Some("resp_0"));
        let back: StoredResponse =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
