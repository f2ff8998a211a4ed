//! The cache inspector (issue 15), behind the API key when one is set:
//! - `GET /v1/cache`: the pool's blocks by state and the hottest cached prefixes;
//! - `GET /v1/cache/requests/{id}`: a recent request's block lifecycle (hit, loaded, allocated,
//!   filled, evicted on its behalf and whose entry it was), for the last `--request-history`
//!   finished requests, by the id the client saw (`X-Request-Id` / the response's id);
//! - `POST /v1/cache/reset`: drop every prefix-cache entry (as `POST /reset_prefix_cache`);
//! - `GET /v1/cache/stats/stream`: server-sent events, one `snapshot` per second (or every
//!   `?interval_ms=`, at least 100; `?limit=N` ends the stream after N) with the recorder's monotonic totals, the pool, the miss
//!   reasons, the 2x/4x what-if, divergences, tenants and the last requests: what the dashboard
//!   draws. Rates are the client's to compute from successive totals.
//!
//! Everything is read off the recorder between engine steps; nothing here changes what the
//! engine does (apart from the reset, which is the operator's decision). Hashes are sent as hex
//! strings (64-bit integers do not survive JavaScript's numbers).

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Query, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_engine::inspect::{CacheSnapshot, InspectQuery, InspectReply};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::usage::prefix_cache_json;
use crate::AppState;

/// Hottest prefixes listed by `GET /v1/cache`.
const HOTTEST: usize = 20;
/// Recent requests in each snapshot.
const RECENT: usize = 20;

fn hex(h: u64) -> String {
    format!("{h:016x}")
}

fn unavailable() -> Response {
    ApiError::EngineDead.openai_response()
}

/// `GET /v1/cache`.
pub async fn overview(State(state): State<AppState>) -> Response {
    let Some(InspectReply::Overview(o)) = state
        .engine()
        .inspect(InspectQuery::Overview { hottest: HOTTEST })
        .await
    else {
        return unavailable();
    };
    let hottest: Vec<Value> = o
        .hottest
        .iter()
        .map(|p| {
            json!({
                "depth": p.depth,
                "tokens": p.tokens,
                "hits": p.hits,
                "age_s": p.age_s,
                "last_hit_s": p.last_hit_s,
                "created_by": p.created_by.as_deref(),
                "hash": hex(p.hash),
            })
        })
        .collect();
    Json(json!({"pool": o.pool, "hottest": hottest})).into_response()
}

/// `GET /v1/cache/requests/{id}`.
pub async fn request(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let Some(InspectReply::Request(found)) =
        state.engine().inspect(InspectQuery::Request(id)).await
    else {
        return unavailable();
    };
    let Some(l) = found else {
        return ApiError::NotFound.openai_response();
    };
    let blocks: Vec<Value> = l
        .blocks
        .iter()
        .map(|e| {
            json!({
                "index": e.index,
                "block": e.block,
                "hash": e.hash.map(hex),
                "event": e.event,
                "new_entry": e.new_entry,
                "owner": e.owner.as_deref(),
                "seq": e.seq,
            })
        })
        .collect();
    Json(json!({
        "request_id": &*l.request_id,
        "tenant": &*l.tenant,
        "finish_reason": l.finish_reason.as_str(),
        "prompt_tokens": l.prompt_tokens,
        "generation_tokens": l.generation_tokens,
        "blocks": blocks,
        "blocks_dropped": l.blocks_dropped,
        "prefix_cache": l.prefill_stats.as_ref().map(|p| prefix_cache_json(p, 0.0, 0.0)),
    }))
    .into_response()
}

/// `POST /v1/cache/reset`.
pub async fn reset(State(state): State<AppState>) -> Json<Value> {
    let reset = state.engine().reset_prefix_cache().await;
    Json(json!({ "reset": reset }))
}

/// One snapshot as the stream sends it.
pub fn snapshot_json(s: &CacheSnapshot, ts: f64) -> Value {
    let t = &s.totals;
    let rates = t.hit_rates();
    json!({
        "ts": ts,
        "counters": t,
        "gauges": {
            "num_requests_running": s.gauges.num_requests_running,
            "num_requests_waiting": s.gauges.num_requests_waiting,
            "kv_cache_usage_perc": s.gauges.kv_cache_usage_perc,
            "num_blocks": s.pool.num_blocks,
            "blocks_in_use": s.pool.blocks_in_use,
            "blocks_cached_idle": s.pool.blocks_cached_idle,
            "blocks_free": s.pool.blocks_free,
            "tokens_held": s.pool.tokens_held,
        },
        "miss_tokens": {
            "capped_for_logits": t.miss_capped_for_logits,
            "partial_block": t.miss_partial_block,
            "evicted": t.miss_evicted,
            "never_cached": t.miss_never_cached,
            "lookup_skipped": t.miss_lookup_skipped,
            "load_failed": t.miss_load_failed,
        },
        "whatif": {
            "hit_rate": rates.hit_rate,
            "hit_rate_2x": rates.hit_rate_2x,
            "hit_rate_4x": rates.hit_rate_4x,
        },
        "diverged": {
            "requests": t.diverged_requests,
            "within_64": t.diverged_requests_within_64,
        },
        "tenants": s.tenants.iter().map(|x| json!({
            "tenant": &*x.tenant,
            "queries": x.prefix_cache_queries,
            "hits": x.prefix_cache_hits,
            "prompt_tokens": x.prompt_tokens,
            "cached_tokens": x.cached_tokens,
        })).collect::<Vec<_>>(),
        "recent": s.recent.iter().take(RECENT).map(|r| json!({
            "request_id": &*r.request_id,
            "tenant": &*r.tenant,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "computed_tokens": r.computed_tokens,
            "cache_creation_tokens": r.cache_creation_tokens,
            "diverged_at": r.diverged_at,
            "finish_reason": r.finish_reason.as_str(),
        })).collect::<Vec<_>>(),
    })
}

#[derive(Debug, serde::Deserialize)]
pub struct StreamQuery {
    pub interval_ms: Option<u64>,
    /// End the stream after this many snapshots (scripts); none: until the client leaves.
    pub limit: Option<u64>,
}

/// `GET /v1/cache/stats/stream`.
pub async fn stats_stream(State(state): State<AppState>, Query(q): Query<StreamQuery>) -> Response {
    let every = Duration::from_millis(q.interval_ms.unwrap_or(1000).clamp(100, 60_000));
    let stream = async_stream::stream! {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut sent = 0u64;
        while q.limit.is_none_or(|l| sent < l) {
            sent += 1;
            tick.tick().await;
            let Some(InspectReply::Snapshot(snap)) =
                state.engine().inspect(InspectQuery::Snapshot).await
            else {
                break;
            };
            let Some(snap) = snap else {
                yield Ok::<Event, Infallible>(
                    Event::default().event("error").data(r#"{"error":"reporting is off"}"#),
                );
                break;
            };
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            yield Ok(Event::default()
                .event("snapshot")
                .data(snapshot_json(&snap, ts).to_string()));
        }
    };
    crate::generate::utf8_event_stream(
        Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response(),
    )
}
