//! `POST /v1/cache/isolation-check` (operator key only): proves, on the running server, that
//! `cache_salt` keeps tenants apart, and prices it.
//!
//! A fresh random probe prompt of four full blocks and one token runs three times: under salt A,
//! under salt B, and under salt A again. The answer comes from the pool itself, through each
//! run's block lifecycle (`GET /v1/cache/requests/{id}`'s): B found nothing in the cache, and
//! none of the cache entries B created holds a hash A created (no block and no entry shared);
//! the second A run hit every probe block A created (the probe is cacheable, so B's miss is the
//! salt's doing). The price is what B computed that an unsalted cache would have served: the
//! probe tokens A's entries covered. The salts are random and never returned; the probe's
//! blocks stay in the cache like any request's (four blocks a run).

use std::collections::HashSet;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_core::recorder::{BlockEventKind, RequestLifecycle};
use cachet_core::{RequestDraft, SamplingParams};
use cachet_engine::inspect::{InspectQuery, InspectReply};
use serde_json::json;

use crate::error::ApiError;
use crate::generate::Generation;
use crate::AppState;

/// Full blocks in the probe (plus one token, so the lookup cap reaches all of them).
const PROBE_BLOCKS: usize = 4;

/// One probe run's facts from its lifecycle.
struct Run {
    local_cached_tokens: u64,
    /// Hashes of the cache entries the run created.
    created: HashSet<u64>,
    /// Hashes of the blocks its lookup found.
    hit: HashSet<u64>,
}

pub async fn isolation_check(State(state): State<AppState>) -> Response {
    match check(&state).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.openai_response(),
    }
}

async fn check(state: &AppState) -> Result<serde_json::Value, ApiError> {
    let limits = state.engine().limits();
    let b = limits.block_size;
    let n = PROBE_BLOCKS * b + 1;
    if n + 1 > limits.max_model_len || PROBE_BLOCKS * 3 + 2 > limits.num_blocks {
        return Err(ApiError::bad_request(
            "the isolation check needs room for a probe of 4 blocks and one token",
        ));
    }
    let vocab = state.tokenizer().vocab_size().max(2) as u64;
    let seed = uuid::Uuid::new_v4().as_u128();
    // A prompt no client sent: ids drawn from the seed (an LCG is plenty for uniqueness).
    let mut x = seed as u64 | 1;
    let probe: Vec<u32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 33) % vocab) as u32
        })
        .collect();
    let salt_a = format!("isolation-check-{:032x}", seed);
    let salt_b = format!("isolation-check-{:032x}", seed.rotate_left(64) ^ 1);
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let a = run(state, &probe, &salt_a, &format!("isolation-{tag}-a")).await?;
    let b_run = run(state, &probe, &salt_b, &format!("isolation-{tag}-b")).await?;
    let again = run(state, &probe, &salt_a, &format!("isolation-{tag}-a2")).await?;
    let shared_entries = b_run.created.intersection(&a.created).count();
    let cross_salt_hits = b_run.hit.len() as u64 + b_run.local_cached_tokens;
    let same_salt_hits = again.hit.intersection(&a.created).count();
    let isolated = shared_entries == 0 && cross_salt_hits == 0;
    Ok(json!({
        "isolated": isolated,
        "probe_tokens": n,
        "block_size": b,
        // What the pool says.
        "entries_created_under_salt_a": a.created.len(),
        "entries_created_under_salt_b": b_run.created.len(),
        "entries_shared": shared_entries,
        "salt_b_cached_tokens": b_run.local_cached_tokens,
        "salt_a_again_cached_tokens": again.local_cached_tokens,
        "salt_a_again_hit_entries_of_salt_a": same_salt_hits,
        // The price: what B computed that A's entries held.
        "forgone_tokens": ((a.created.len() * b) as u64).saturating_sub(b_run.local_cached_tokens),
    }))
}

async fn run(state: &AppState, probe: &[u32], salt: &str, label: &str) -> Result<Run, ApiError> {
    let mut d = RequestDraft::new(label, probe.to_vec(), SamplingParams::greedy(1));
    d.cache_salt = Some(salt.to_string());
    let mut gen = Generation::start(state, d, Vec::new()).await?;
    while gen.next().await.is_some() {}
    let lifecycle =
        match state
            .engine()
            .inspect(InspectQuery::Request(label.to_string()))
            .await
        {
            Some(InspectReply::Request(Some(l))) => l,
            Some(InspectReply::Request(None)) => return Err(ApiError::bad_request(
                "the isolation check reads request lifecycles: it needs --request-history above 0",
            )),
            _ => return Err(ApiError::EngineDead),
        };
    Ok(facts(&lifecycle))
}

fn facts(l: &RequestLifecycle) -> Run {
    let mut created = HashSet::new();
    let mut hit = HashSet::new();
    for e in &l.blocks {
        match (e.event, e.hash) {
            (BlockEventKind::Filled, Some(h)) if e.new_entry => {
                created.insert(h);
            }
            (BlockEventKind::Hit | BlockEventKind::Loaded, Some(h)) => {
                hit.insert(h);
            }
            _ => {}
        }
    }
    Run {
        local_cached_tokens: l.prefill_stats.map_or(0, |p| p.local_cached_tokens),
        created,
        hit,
    }
}
