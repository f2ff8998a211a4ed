//! The OpenAI Responses API: `POST /v1/responses` (collected, streamed, or in the background),
//! `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`,
//! `POST /v1/responses/{id}/cancel`.
//!
//! A request becomes the chat route's machinery: its items are chat messages (`request.rs`),
//! rendered by the chat template, its function tools and `text.format` go through the same
//! tool plan and grammar, and the output text becomes output items (`output.rs`), streamed as
//! the Responses API's events (`stream.rs`).
//!
//! **Stored responses on retained KV.** `store: true` (the default) keeps the response
//! (`store.rs`) and runs the turn as a turn of an engine session (spec §5) named after the
//! first response of its `previous_response_id` chain, so its KV stays parked. A request with
//! `previous_response_id` renders the whole conversation (the stored one, then the new input)
//! and is the next turn of that session: when the parked KV is still there and the prompt
//! extends it, only the new input is computed (usage: the whole conversation as input, every
//! token not computed for this turn as cached); when it was dropped (idle timeout, budget, a
//! fork from an older response), the turn is looked up in the prefix cache like any request.
//! `metrics.previous_response.kv` says which (`retained` or `prefix_cache`). Responses are per
//! API key: another key's id is a 404.

mod background;
mod output;
mod persist;
mod request;
mod store;
mod stream;

pub use request::ResponsesRequest;
pub use store::{ResponseStore, StoreLimits, StoredResponse};

use std::collections::HashMap;
use std::sync::Mutex;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_text::{ChatMessage, Role, ToolFormat};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::body::read_json;
use crate::cache_header::{final_prefill, with_cache_header};
use crate::error::{ApiError, OpenAiError};
use crate::fields::{check_rest, Route};
use crate::generate::{Final, GenEvent, Generation, TextOptions, REQUEST_ID_HEADER};
use crate::openai::{constraint_for, now_secs, render_messages};
use crate::sampling::{clamp_to_context, request_draft, Api, DraftInput, SamplingInput};
use crate::structured::{parse_response_format, Guided};
use crate::tools::ToolPlan;
use crate::usage::{request_metrics_json, responses_usage};
use crate::AppState;

use output::Items;

/// The stored responses and the background runs.
pub struct Responses {
    pub store: ResponseStore,
    /// Background runs in flight, by response id: aborting one drops its generation (the
    /// engine aborts the request).
    running: Mutex<HashMap<String, tokio::task::AbortHandle>>,
}

impl Responses {
    pub fn new(limits: StoreLimits) -> Self {
        Responses {
            store: ResponseStore::new(limits),
            running: Mutex::new(HashMap::new()),
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, tokio::task::AbortHandle>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The responses kept in `file` by the last process become readable and continuable again
    /// (their conversations' KV comes back through the engine's kept sessions and the disk
    /// tier). Returns how many are kept.
    pub fn restore_from(&self, file: &std::path::Path) -> usize {
        self.store.restore(persist::read(file), now_f64())
    }

    /// Keeps the finished stored responses in `file` for the next start.
    pub fn save_to(&self, file: &std::path::Path) {
        let records = self.store.finished_records();
        let n = records.len();
        match persist::write(file, &records) {
            Ok(()) => {
                tracing::info!(responses = n, path = %file.display(), "stored responses kept")
            }
            Err(e) => {
                tracing::warn!(path = %file.display(), error = %e, "cannot keep the stored responses")
            }
        }
    }
}

fn now_f64() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFoundId {
        message: format!("No response found with id '{}'.", crate::error::clip(id)),
        param: None,
    }
}

/// One turn being answered: what finishing it needs.
#[derive(Clone)]
struct Turn {
    state: AppState,
    id: String,
    owner: String,
    /// The response object with the request's fields echoed (no output, no usage yet).
    skeleton: Value,
    /// The conversation's input items (history first).
    items: Vec<Value>,
    session_id: Option<String>,
    cache_salt: Option<String>,
    store: bool,
    previous: Option<String>,
    parse: Option<ToolFormat>,
    parallel: bool,
    /// `--reasoning-parser`, set up for the prompt.
    reasoning: Option<cachet_text::ReasoningParser>,
    /// `reasoning.summary` was asked for.
    summary: bool,
}

impl Turn {
    /// The whole response object of a finished generation.
    fn items(&self) -> Items {
        Items::new(self.parse, self.parallel, self.reasoning.clone()).with_summary(self.summary)
    }

    fn finish(&self, items: Items, fin: &Final) -> Value {
        let (status, incomplete, error, _) = output::status(fin);
        let mut r = self.skeleton.clone();
        r["status"] = json!(status);
        r["incomplete_details"] = incomplete;
        r["error"] = error;
        r["output"] = Value::Array(items.output);
        r["usage"] = responses_usage(fin, items.reasoning_tokens);
        if status == "completed" {
            r["completed_at"] = json!(now_secs());
        }
        if self.state.per_request_metrics() {
            let mut m = request_metrics_json(fin);
            if let Some(p) = &self.previous {
                let kv = match &fin.session {
                    Some(s) if s.continued() => "retained",
                    _ => "prefix_cache",
                };
                m["previous_response"] = json!({"id": p, "kv": kv});
            }
            r["metrics"] = m;
        }
        r
    }

    /// Keeps the response when the request asked to (`store`).
    fn keep(&self, response: &Value) {
        if !self.store {
            return;
        }
        let dropped = self.state.responses().store.put(
            StoredResponse {
                id: self.id.clone(),
                owner: self.owner.clone(),
                stored_at: now_f64(),
                response: response.clone(),
                input_items: self.items.clone(),
                session_id: self.session_id.clone(),
                cache_salt: self.cache_salt.clone(),
            },
            now_f64(),
        );
        if !dropped.is_empty() {
            tracing::debug!(
                dropped = dropped.len(),
                "responses: the store dropped its oldest"
            );
        }
    }
}

/// The chat messages, tool plan and prompt of a request, and `truncation: "auto"` applied.
struct Prompt {
    /// The rendered template (the reasoning parser reads how it ends).
    rendered: String,
    tokens: Vec<u32>,
    plan: ToolPlan,
    answer_schema: Option<Value>,
}

/// The chat route's rendering; `reasoning.effort` reaches the template as `reasoning_effort`.
fn render(
    state: &AppState,
    req: &ResponsesRequest,
    plan: &ToolPlan,
    chat: Vec<ChatMessage>,
) -> Result<(String, Vec<u32>), ApiError> {
    let mut kwargs = Map::new();
    if let Some(e) = req.reasoning_effort() {
        kwargs.insert("reasoning_effort".into(), Value::String(e.to_string()));
    }
    render_messages(state, plan, chat, true, &kwargs, "input")
}

/// Drops the oldest turn that is not a system message (a call's results with it).
fn drop_oldest(chat: &mut Vec<ChatMessage>) -> bool {
    let Some(i) = chat
        .iter()
        .position(|m| !matches!(m.role, Role::System | Role::Developer))
    else {
        return false;
    };
    // Keep at least one turn.
    if chat[i..].len() <= 1 {
        return false;
    }
    chat.remove(i);
    while chat.get(i).is_some_and(|m| m.role == Role::Tool) && chat[i..].len() > 1 {
        chat.remove(i);
    }
    true
}

fn prompt_of(
    state: &AppState,
    req: &ResponsesRequest,
    items: &[Value],
) -> Result<Prompt, ApiError> {
    let mut chat = request::to_chat(req.instructions.as_deref(), items)?;
    let mut tools = request::function_tools(req.tools.as_deref())?;
    let choice = request::tool_choice(req.tool_choice.as_ref(), &mut tools)?;
    let plan = ToolPlan {
        tools,
        choice,
        parallel: req.parallel_tool_calls.unwrap_or(true),
        format: state.agent().format,
    };
    let format = request::response_format(req.text.as_ref())?;
    let answer_schema = parse_response_format(format.as_ref())
        .map_err(|e| ApiError::bad_param("text", format!("`text.format`: {e}")))?
        .and_then(|r| r.schema());
    let auto = req.truncate_auto()?;
    let (mut rendered, mut tokens) = render(state, req, &plan, chat.clone())?;
    if auto {
        // The input must fit the context with one token to write; `max_output_tokens` is then
        // clamped to what is left, as it is without truncation.
        let room = state.max_model_len().saturating_sub(1);
        while tokens.len() > room && drop_oldest(&mut chat) {
            (rendered, tokens) = render(state, req, &plan, chat.clone())?;
        }
    }
    Ok(Prompt {
        rendered,
        tokens,
        plan,
        answer_schema,
    })
}

/// The response object before any output: the request's fields echoed.
fn skeleton(id: &str, model: &str, req: &ResponsesRequest, plan: &ToolPlan) -> Value {
    let tool_choice = match &req.tool_choice {
        Some(v) if !v.is_null() => v.clone(),
        _ => json!("auto"),
    };
    let text = match &req.text {
        Some(t) if t.get("format").is_some_and(|f| !f.is_null()) => t.clone(),
        _ => json!({"format": {"type": "text"}}),
    };
    let reasoning = match &req.reasoning {
        Some(r) if r.is_object() => json!({
            "effort": r.get("effort").cloned().unwrap_or(Value::Null),
            "summary": r.get("summary").cloned().unwrap_or(Value::Null),
        }),
        _ => json!({"effort": null, "summary": null}),
    };
    json!({
        "id": id,
        "object": "response",
        "created_at": now_secs(),
        "status": "in_progress",
        "background": req.background.unwrap_or(false),
        "error": null,
        "incomplete_details": null,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata.clone().unwrap_or_default(),
        "model": model,
        "output": [],
        "parallel_tool_calls": plan.parallel,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": reasoning,
        "store": req.store(),
        "temperature": req.temperature.unwrap_or(1.0),
        "text": text,
        "tool_choice": tool_choice,
        "tools": req.tools.clone().unwrap_or_default(),
        "top_p": req.top_p.unwrap_or(1.0),
        "truncation": req.truncation.clone().unwrap_or_else(|| "disabled".into()),
        "usage": null,
        "user": req.user,
    })
}

/// `POST /v1/responses`.
pub async fn create(State(state): State<AppState>, body: Body) -> Result<Response, OpenAiError> {
    let req: ResponsesRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.model.as_deref())?;
    check_rest(Route::Responses, &req.rest)?;
    let owner = crate::auth::current_key_id().to_string();
    let stream = req.stream.unwrap_or(false);
    let background = req.background.unwrap_or(false);
    if background && !req.store() {
        return Err(ApiError::bad_param(
            "background",
            "A background response must be stored: `background` needs `store` true.",
        )
        .into());
    }
    if background && stream {
        return Err(ApiError::bad_param(
            "background",
            "`background` with `stream` is not supported: poll `GET /v1/responses/{id}` instead.",
        )
        .into());
    }
    let previous = match req.previous_response_id.as_deref() {
        None => None,
        Some(p) => Some(
            state
                .responses()
                .store
                .get(&owner, p, now_f64())
                .ok_or_else(|| ApiError::NotFoundId {
                    message: format!(
                        "Previous response with id '{}' not found.",
                        crate::error::clip(p)
                    ),
                    param: Some("previous_response_id"),
                })?,
        ),
    };
    // The conversation: the stored one (its input, then its output), then this input.
    let mut items = match &previous {
        Some(p) => {
            let mut v = p.input_items.clone();
            if let Some(out) = p.response["output"].as_array() {
                v.extend(out.iter().cloned());
            }
            v
        }
        None => Vec::new(),
    };
    items.extend(request::input_items(req.input.as_ref())?);
    let prompt = prompt_of(&state, &req, &items)?;
    let id = format!("resp_{}", uuid::Uuid::new_v4().simple());
    let session_id = match &previous {
        Some(p) => p.session_id.clone(),
        None => req.store().then(|| id.clone()),
    };
    let cache_salt = req
        .cache_salt
        .clone()
        .or_else(|| previous.as_ref().and_then(|p| p.cache_salt.clone()));
    let input = SamplingInput {
        max_tokens: req
            .max_output_tokens
            .map(|m| clamp_to_context(m, state.max_model_len(), prompt.tokens.len())),
        temperature: req.temperature,
        top_p: req.top_p,
        vocab_size: state.tokenizer().vocab_size(),
        ..Default::default()
    };
    let draft_of = |session: Option<&str>| {
        request_draft(DraftInput {
            label: id.clone(),
            prompt: prompt.tokens.clone(),
            sampling: &input,
            api: Api::OpenAi,
            max_tokens_param: "max_output_tokens",
            cache_salt: &cache_salt,
            session_id: session,
        })
    };
    let constraint = constraint_for(
        &state,
        &prompt.plan,
        prompt.answer_schema.as_ref(),
        &Guided::default(),
    )
    .await?;
    let parse = prompt.plan.parse_format();
    let skip_special = !(parse.is_some() && state.agent().markers_special);
    let text = TextOptions {
        stop: Vec::new(),
        skip_special_tokens: skip_special,
        include_stop_str_in_output: false,
    };
    let mut draft = draft_of(session_id.as_deref())?;
    draft.sampling.constraint = constraint.clone();
    let (gen, session_id) = match Generation::start_with(&state, draft, text.clone()).await {
        Ok(g) => (g, session_id),
        // Another turn of the conversation is in flight: this one runs on its own, on the
        // prefix cache.
        Err(ApiError::SessionBusy(_)) => {
            let mut draft = draft_of(None)?;
            draft.sampling.constraint = constraint;
            (Generation::start_with(&state, draft, text).await?, None)
        }
        Err(e) => return Err(e.into()),
    };
    let turn = Turn {
        skeleton: skeleton(&id, &model, &req, &prompt.plan),
        state: state.clone(),
        id,
        owner,
        items,
        session_id,
        cache_salt,
        store: req.store(),
        previous: req.previous_response_id.clone(),
        parse,
        parallel: prompt.plan.parallel,
        reasoning: state
            .agent()
            .reasoning
            .map(|f| cachet_text::ReasoningParser::new(f, &prompt.rendered)),
        summary: req.reasoning_summary(),
    };
    let request_id = gen.request_id().to_string();
    if background {
        let r = Json(background::start(turn, gen)).into_response();
        return Ok(with_request_id(r, &request_id));
    }
    if stream {
        let sse = Sse::new(stream::events(turn, gen));
        let r = crate::generate::utf8_event_stream(sse.into_response());
        return Ok(with_request_id(r, &request_id));
    }
    let (r, fin) = collect(&turn, gen).await;
    turn.keep(&r);
    let resp = with_cache_header(Json(r).into_response(), final_prefill(&fin));
    Ok(with_request_id(resp, &request_id))
}

fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = axum::http::HeaderValue::from_str(id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    resp
}

/// Runs a generation to its end; returns the response object and the generation's end.
async fn collect(turn: &Turn, mut gen: Generation) -> (Value, Final) {
    let mut items = turn.items();
    let mut fin = None;
    while let Some(ev) = gen.next().await {
        match ev {
            GenEvent::Delta(d) => {
                items.push(Some(&d.text), d.generated);
            }
            GenEvent::Done(f) => fin = Some(f),
        }
    }
    items.push(None, 0);
    let fin = gen.final_or_abort(fin);
    (turn.finish(items, &fin), fin)
}

fn path_id(id: Result<Path<String>, axum::extract::rejection::PathRejection>) -> String {
    id.map(|Path(id)| id).unwrap_or_default()
}

/// The stored response `id` of the caller's API key (404 otherwise).
fn stored(state: &AppState, id: &str) -> Result<StoredResponse, ApiError> {
    let owner = crate::auth::current_key_id();
    state
        .responses()
        .store
        .get(&owner, id, now_f64())
        .ok_or_else(|| not_found(id))
}

/// `GET /v1/responses/{id}`.
pub async fn get(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let rec = stored(&state, &path_id(id))?;
    Ok(Json(rec.response).into_response())
}

/// `DELETE /v1/responses/{id}`: forgets it, and releases its conversation's parked KV when no
/// other stored response continues that conversation.
pub async fn delete(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let id = path_id(id);
    let owner = crate::auth::current_key_id();
    let (rec, shared) = state
        .responses()
        .store
        .remove(&owner, &id)
        .ok_or_else(|| not_found(&id))?;
    if let Some(h) = state.responses().running().remove(&id) {
        h.abort();
    }
    if let (Some(s), false) = (&rec.session_id, shared) {
        let key = cachet_core::request::session_key(crate::auth::current_tenant().as_deref(), s);
        state.engine().release_session(&key).await;
    }
    Ok(Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response())
}

#[derive(Debug, Default, Deserialize)]
pub struct ListParams {
    #[serde(default)]
    pub limit: Option<usize>,
    /// `asc` or `desc` (default: newest first, as OpenAI lists).
    #[serde(default)]
    pub order: Option<String>,
    #[serde(default)]
    pub after: Option<String>,
}

/// `GET /v1/responses/{id}/input_items`: the conversation's input items, paginated as OpenAI
/// lists (`limit` 1 to 100, default 20; `order`; `after` an item id).
pub async fn input_items(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, OpenAiError> {
    let id = path_id(id);
    let Query(params) = params.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let rec = stored(&state, &id)?;
    let limit = params.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_param("limit", "`limit` must be between 1 and 100.").into());
    }
    let mut items = rec.input_items;
    match params.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(_) => {
            return Err(ApiError::bad_param("order", "`order` must be `asc` or `desc`.").into())
        }
    }
    if let Some(after) = &params.after {
        match items.iter().position(|i| i["id"].as_str() == Some(after)) {
            Some(p) => {
                items.drain(..=p);
            }
            None => return Err(ApiError::bad_param("after", "No input item has that id.").into()),
        }
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    let first = items
        .first()
        .map(|i| i["id"].clone())
        .unwrap_or(Value::Null);
    let last = items.last().map(|i| i["id"].clone()).unwrap_or(Value::Null);
    Ok(Json(json!({
        "object": "list", "data": items, "first_id": first, "last_id": last, "has_more": has_more,
    }))
    .into_response())
}

/// `POST /v1/responses/{id}/cancel`: ends a background response's run (`status:
/// "cancelled"`); a finished one is returned as it is.
pub async fn cancel(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let id = path_id(id);
    let rec = stored(&state, &id)?;
    if rec.response["background"] != json!(true) {
        return Err(ApiError::bad_request("Only a background response can be cancelled.").into());
    }
    if let Some(h) = state.responses().running().remove(&id) {
        h.abort();
        state.responses().store.update(&id, |r| {
            if matches!(
                r.response["status"].as_str(),
                Some("queued" | "in_progress")
            ) {
                r.response["status"] = json!("cancelled");
            }
        });
    }
    Ok(Json(stored(&state, &id)?.response).into_response())
}
