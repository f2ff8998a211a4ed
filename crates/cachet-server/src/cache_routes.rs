//! `GET /v1/cache/events`: the engine's KV cache events for people, as server-sent events.
//!
//! The same batches the ZMQ publisher sends in vLLM's wire format, as JSON: one SSE event
//! (`event: batch`) per engine step that changed the cache, with `id` = the batch's sequence
//! number, so a client reconnecting with `Last-Event-ID` gets every buffered batch after it. When
//! batches after that id have left the bounded buffer (or the id is from an earlier process), the
//! stream starts with `event: reset` and the client should rebuild its view; a client too slow
//! for the live stream gets `event: lagged` with the number of batches it lost. `?from=N`
//! starts at batch N (`?from=0`: everything still buffered). Hashes are hex
//! (all 32 bytes); a request's `cache_salt` is never sent (a tenant's salt is its secret).

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use cachet_core::events::{CacheEvent, EventBatch};
use cachet_kv_events::{EventLog, Next};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::AppState;

/// The SSE log handed to the server (Debug for `ServerArgs`).
#[derive(Clone)]
pub struct EventLogHandle(pub Arc<EventLog>);

impl std::fmt::Debug for EventLogHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventLog")
    }
}

/// One event as people read it.
pub fn event_json(ev: &CacheEvent) -> Value {
    let hex = |hs: &[cachet_core::BlockHash]| hs.iter().map(|h| h.to_hex()).collect::<Vec<_>>();
    match ev {
        CacheEvent::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            cache_salt,
            medium,
            cause,
        } => json!({
            "type": "BlockStored",
            "block_hashes": hex(hashes),
            "parent_block_hash": parent.map(|p| p.to_hex()),
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_name": lora_name,
            "salted": cache_salt.is_some(),
            "medium": medium.as_str(),
            "request_id": cause.as_ref().map(|c| &*c.request_id),
            "session_id": cause.as_ref().and_then(|c| c.session_id.as_deref()),
        }),
        CacheEvent::Removed {
            hashes,
            medium,
            cause,
        } => json!({
            "type": "BlockRemoved",
            "block_hashes": hex(hashes),
            "medium": medium.as_str(),
            "request_id": cause.as_ref().map(|c| &*c.request_id),
            "session_id": cause.as_ref().and_then(|c| c.session_id.as_deref()),
        }),
        CacheEvent::AllCleared { medium } => {
            json!({"type": "AllBlocksCleared", "medium": medium.as_str()})
        }
    }
}

pub fn batch_json(b: &EventBatch) -> Value {
    json!({"ts": b.ts, "events": b.events.iter().map(event_json).collect::<Vec<_>>()})
}

#[derive(Debug, serde::Deserialize)]
pub struct EventsQuery {
    /// Start at this batch id (e.g. 0: everything still buffered); `Last-Event-ID` wins.
    pub from: Option<u64>,
}

pub async fn cache_events(
    State(state): State<AppState>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Response {
    let Some(log) = state.event_log() else {
        return ApiError::bad_request("KV cache events are not enabled on this server.")
            .openai_response();
    };
    let last = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let mut sub = match (last, q.from) {
        (Some(last), _) => log.subscribe(Some(last)),
        (None, Some(from)) => log.subscribe_from(from),
        (None, None) => log.subscribe(None),
    };
    let stream = async_stream::stream! {
        if !sub.complete {
            yield Ok::<Event, Infallible>(Event::default().event("reset").data(json!({"complete": false}).to_string()));
        }
        loop {
            match sub.next().await {
                Next::Batch(b) => {
                    yield Ok(Event::default()
                        .id(b.id.to_string())
                        .event("batch")
                        .data(batch_json(&b.batch).to_string()));
                }
                Next::Lagged(n) => {
                    yield Ok(Event::default().event("lagged").data(json!({"lost": n}).to_string()));
                }
                Next::Closed => break,
            }
        }
    };
    crate::generate::utf8_event_stream(
        Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response(),
    )
}
