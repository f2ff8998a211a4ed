//! `POST /v1/messages`: the Anthropic Messages API.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_text::{ChatMessage, Role, ToolCall, ToolEvent, ToolFormat};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::body::read_json;
use crate::cache_header::{final_prefill, with_cache_header};
use crate::error::{AnthropicError, ApiError};
use crate::fields::{check_rest, Route};
use crate::generate::{
    response_id, Final, GenEvent, Generation, StopKind, TextOptions, REQUEST_ID_HEADER,
};
use crate::sampling::{request_draft, Api, DraftInput, SamplingInput};
use crate::tools::{anthropic_tool_choice, anthropic_tools, AnthropicTool, ToolPlan};
use crate::usage::{anthropic_start_usage, anthropic_usage, request_metrics_json, session_json};
use crate::AppState;

/// A content block: `text`, `tool_use` (assistant), `tool_result` (user); `cache_control` is
/// accepted and meaningless (prefix caching is automatic); `thinking` blocks in the history are
/// dropped (cachet never returns one); anything else is a 400 naming its type.
#[derive(Clone, Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub cache_control: Option<Value>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub input: Option<Value>,
    #[serde(default)]
    pub tool_use_id: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub is_error: Option<bool>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

impl Content {
    fn to_text(&self, param: &str) -> Result<String, ApiError> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Blocks(blocks) => {
                let mut out = String::new();
                for b in blocks {
                    if b.kind != "text" {
                        return Err(ApiError::bad_param(
                            param,
                            format!(
                                "Unsupported content block type `{}` here: only `text` is supported.",
                                crate::error::clip(&b.kind)
                            ),
                        ));
                    }
                    match &b.text {
                        Some(t) => out.push_str(t),
                        None => {
                            return Err(ApiError::bad_param(
                                param,
                                "A `text` block needs a `text` field.",
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct MessageIn {
    pub role: String,
    pub content: Content,
}

#[derive(Clone, Debug, Deserialize)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    #[serde(default)]
    pub system: Option<Content>,
    pub max_tokens: u32,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    /// An object (`{"user_id": ...}`); any other JSON type is a 400.
    #[serde(default)]
    pub metadata: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Resumable session (cachet extension; the SDK sends it via `extra_body`).
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<AnthropicTool>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema"}, "effort"}`.
    #[serde(default)]
    pub output_config: Option<Value>,
    /// The earlier name of `output_config.format`.
    #[serde(default)]
    pub output_format: Option<Value>,
    /// `{"type": "enabled" | "adaptive" | "disabled"}`: whether thinking blocks are returned
    /// (with `--reasoning-parser`) and `enable_thinking` for the chat template.
    #[serde(default)]
    pub thinking: Option<Value>,
    /// `{"edits": [...]}` ([`crate::context_edits`]).
    #[serde(default)]
    pub context_management: Option<Value>,
    /// Every other field: checked against the field table ([`crate::fields`]).
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// `/v1/messages/count_tokens`: the request without `max_tokens`.
#[derive(Clone, Debug, Deserialize)]
pub struct CountTokensRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    #[serde(default)]
    pub system: Option<Content>,
    #[serde(default)]
    pub tools: Option<Vec<AnthropicTool>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// The conversation as chat messages: the system prompt (less Claude Code's billing line
/// unless kept; returns whether it was removed), tool_use blocks as assistant tool calls,
/// tool_result blocks as tool messages.
fn to_chat(
    system: Option<&Content>,
    messages: &[MessageIn],
    keep_billing: bool,
    mid_system: bool,
) -> Result<(Vec<ChatMessage>, bool), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must contain at least one message.",
        ));
    }
    let mut chat = Vec::with_capacity(messages.len() + 1);
    let mut removed = false;
    if let Some(system) = system {
        // Checks the blocks are text blocks.
        system.to_text("system")?;
        let mut parts: Vec<String> = match system {
            Content::Text(s) => vec![s.clone()],
            Content::Blocks(bs) => bs.iter().filter_map(|b| b.text.clone()).collect(),
        };
        if !keep_billing {
            if let Some(first) = parts.first_mut() {
                if let Some(rest) = crate::nonce::strip(first) {
                    *first = rest;
                    removed = true;
                }
            }
            parts.retain(|p| !p.is_empty() || !removed);
        }
        let s = parts.concat();
        if !s.is_empty() {
            chat.push(ChatMessage::new(Role::System, s));
        }
    }
    // The ids of the tool uses the latest assistant turn made (tool results answer them).
    let mut open_uses: Vec<&str> = Vec::new();
    for (mi, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "system" if mid_system => {
                chat.push(ChatMessage::new(
                    Role::System,
                    m.content.to_text("messages")?,
                ));
                continue;
            }
            "system" => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!(
                        "Unexpected role `system`: a system message inside `messages` needs the `anthropic-beta: {MID_CONVERSATION_SYSTEM_BETA}` header; otherwise use the top-level `system` field."
                    ),
                ))
            }
            other => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!(
                        "Unexpected role `{}`: use `user` or `assistant`.",
                        crate::error::clip(other)
                    ),
                ))
            }
        };
        let answered = std::mem::take(&mut open_uses);
        let blocks = match &m.content {
            Content::Text(s) => {
                chat.push(ChatMessage::new(role, s.clone()));
                continue;
            }
            Content::Blocks(b) => b,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (bi, b) in blocks.iter().enumerate() {
            match (b.kind.as_str(), role) {
                ("text", _) => text.push_str(b.text.as_deref().unwrap_or_default()),
                ("tool_use", Role::Assistant) => {
                    let (Some(id), Some(name)) = (&b.id, &b.name) else {
                        return Err(ApiError::bad_param(
                            "messages",
                            "A `tool_use` block needs `id` and `name`.",
                        ));
                    };
                    open_uses.push(id);
                    let input = b.input.clone().unwrap_or_else(|| json!({}));
                    calls.push(ToolCall::function(
                        id.clone(),
                        name.clone(),
                        input.to_string(),
                    ));
                }
                ("tool_result", Role::User) => {
                    // Text before a result stays a user turn of its own.
                    if !text.is_empty() {
                        chat.push(ChatMessage::user(std::mem::take(&mut text)));
                    }
                    let Some(id) = &b.tool_use_id else {
                        return Err(ApiError::bad_param(
                            "messages",
                            "A `tool_result` block needs `tool_use_id`.",
                        ));
                    };
                    if !answered.contains(&id.as_str()) {
                        // Anthropic's words.
                        return Err(ApiError::bad_param(
                            "messages",
                            format!(
                                "messages.{mi}.content.{bi}: unexpected `tool_use_id` found in `tool_result` blocks: {}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
                                crate::error::clip(id)
                            ),
                        ));
                    }
                    let mut content = match &b.content {
                        Some(c) => c.to_text("messages")?,
                        None => String::new(),
                    };
                    if b.is_error == Some(true) {
                        content = format!("Error: {content}");
                    }
                    chat.push(ChatMessage::tool(id.clone(), content));
                }
                ("thinking" | "redacted_thinking", Role::Assistant) => {}
                (kind, _) => {
                    return Err(ApiError::bad_param(
                        "messages",
                        format!(
                            "Unsupported content block type `{}` in a {} message.",
                            crate::error::clip(kind),
                            m.role
                        ),
                    ))
                }
            }
        }
        if !calls.is_empty() {
            chat.push(ChatMessage::assistant_tool_calls(text, calls));
        } else if !text.is_empty() || !matches!(chat.last(), Some(l) if l.role == Role::Tool) {
            chat.push(ChatMessage::new(role, text));
        }
    }
    Ok((chat, removed))
}

/// The `anthropic-beta` value that allows `role: "system"` messages inside `messages`.
pub const MID_CONVERSATION_SYSTEM_BETA: &str = "mid-conversation-system-2026-04-07";

/// What the `signature` of a thinking block holds: cachet does not sign thinking (and drops
/// thinking blocks sent back in the history), so this marks the block as cachet's, nothing more.
pub const THINKING_SIGNATURE: &str = "cachet-unsigned";

/// Whether the request carries beta `name` in an `anthropic-beta` header (comma-separated).
fn has_beta(headers: &HeaderMap, name: &str) -> bool {
    headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|b| b.trim() == name)
}

/// `thinking`: whether thinking is on (`enabled`, `adaptive`) or off (`disabled`, absent).
fn thinking_on(thinking: Option<&Value>) -> Result<bool, ApiError> {
    match thinking {
        None | Some(Value::Null) => Ok(false),
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive") => Ok(true),
            Some("disabled") => Ok(false),
            _ => Err(ApiError::bad_param(
                "thinking",
                "`thinking.type` must be `enabled`, `adaptive` or `disabled`.",
            )),
        },
    }
}

/// How a Messages request's prompt is built beyond its messages.
#[derive(Default)]
struct PromptOptions<'a> {
    edits: &'a [crate::context_edits::Edit],
    /// `role: "system"` messages allowed inside `messages` (the beta).
    mid_system: bool,
    /// Extra chat-template variables (`enable_thinking`, `reasoning_effort`).
    kwargs: serde_json::Map<String, Value>,
}

/// A Messages request's prompt.
struct Prompt {
    tokens: Vec<u32>,
    rendered: String,
    plan: ToolPlan,
    /// Claude Code's billing line was removed.
    billing_removed: bool,
    /// `context_management.applied_edits`.
    applied_edits: Vec<Value>,
}

/// The template variables of a Messages request: `enable_thinking` from `thinking` (with a
/// reasoning parser) and `reasoning_effort` from `output_config.effort`.
fn template_kwargs(
    state: &AppState,
    thinking: Option<&Value>,
    output_config: Option<&Value>,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut kw = serde_json::Map::new();
    let on = thinking_on(thinking)?;
    if state.agent().reasoning.is_some() {
        kw.insert("enable_thinking".into(), json!(on));
    }
    if let Some(e) = output_config
        .and_then(|c| c.get("effort"))
        .and_then(Value::as_str)
    {
        kw.insert("reasoning_effort".into(), json!(e));
    }
    Ok(kw)
}

/// The rendered prompt of a Messages request (after its context edits) and the tool plan.
fn prompt_of(
    state: &AppState,
    system: Option<&Content>,
    messages: &[MessageIn],
    tools: Option<Vec<AnthropicTool>>,
    tool_choice: Option<&Value>,
    opts: &PromptOptions<'_>,
) -> Result<Prompt, ApiError> {
    let agent = state.agent();
    let tools = anthropic_tools(tools)?;
    let (choice, parallel) = anthropic_tool_choice(tool_choice, &tools)?;
    let plan = ToolPlan {
        tools,
        choice,
        parallel,
        format: agent.format,
    };
    let values = plan.tool_values();
    let tok = state.tokenizer();
    let render = |messages: &[MessageIn]| -> Result<(String, Vec<u32>, bool), ApiError> {
        let (chat, removed) =
            to_chat(system, messages, agent.keep_billing_header, opts.mid_system)?;
        let chat = plan.messages_for(agent.caps, chat);
        let mut tr = cachet_text::ChatRequest::new(&chat, true);
        if plan.template_tools(agent.caps) {
            tr = tr.with_tools(&values);
        }
        if !opts.kwargs.is_empty() {
            tr = tr.with_kwargs(&opts.kwargs);
        }
        let rendered = tok.render_chat(&tr).map_err(|e| {
            ApiError::bad_param("messages", format!("Cannot apply the chat template: {e}"))
        })?;
        let prompt = tok
            .encode(&rendered, false)
            .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?;
        Ok((rendered, prompt, removed))
    };
    let (applied_edits, (rendered, tokens, billing_removed)) = if opts.edits.is_empty() {
        (Vec::new(), render(messages)?)
    } else {
        let mut edited = messages.to_vec();
        let applied = crate::context_edits::apply_all(opts.edits, &mut edited, |m| {
            render(m).map(|r| r.1.len() as u64)
        })?;
        (applied, render(&edited)?)
    };
    Ok(Prompt {
        tokens,
        rendered,
        plan,
        billing_removed,
        applied_edits,
    })
}

/// `output_config.format` / `output_format`: `{"type": "json_schema", "schema"}`.
fn output_schema(req: &MessagesRequest) -> Result<Option<Value>, ApiError> {
    let (param, f) = match (
        req.output_config.as_ref().and_then(|c| c.get("format")),
        req.output_format.as_ref(),
    ) {
        (Some(f), _) if !f.is_null() => ("output_config", f),
        (_, Some(f)) if !f.is_null() => ("output_format", f),
        _ => return Ok(None),
    };
    match (f.get("type").and_then(Value::as_str), f.get("schema")) {
        (Some("json_schema"), Some(s)) if s.is_object() => Ok(Some(s.clone())),
        _ => Err(ApiError::bad_param(
            param,
            "The output format must be {\"type\": \"json_schema\", \"schema\": {...}}.",
        )),
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens"}`, the prompt `/v1/messages` would run
/// for the same body (tools and all).
pub async fn count_tokens(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AnthropicError> {
    let req: CountTokensRequest = read_json(body, state.max_body_bytes()).await?;
    state.check_model(req.model.as_deref())?;
    // Fields of /v1/messages that do not change the prompt are accepted here too.
    let mut rest = req.rest.clone();
    rest.retain(|k, _| {
        !crate::fields::MESSAGES
            .iter()
            .any(|f| f.name == k && matches!(f.use_, crate::fields::Use::Yes(_)))
    });
    check_rest(Route::Messages, &rest)?;
    let edits = match req.rest.get("context_management") {
        Some(v) if !v.is_null() => crate::context_edits::parse(v)?,
        _ => Vec::new(),
    };
    let opts = PromptOptions {
        edits: &edits,
        mid_system: has_beta(&headers, MID_CONVERSATION_SYSTEM_BETA),
        kwargs: template_kwargs(
            &state,
            req.rest.get("thinking"),
            req.rest.get("output_config"),
        )?,
    };
    let prompt = prompt_of(
        &state,
        req.system.as_ref(),
        &req.messages,
        req.tools.clone(),
        req.tool_choice.as_ref(),
        &opts,
    )?;
    Ok(Json(json!({"input_tokens": prompt.tokens.len()})).into_response())
}

fn stop_reason(f: &Final, called: bool) -> (&'static str, Value) {
    match &f.stop {
        StopKind::Eos | StopKind::StopToken(_) if called => ("tool_use", Value::Null),
        StopKind::Eos | StopKind::StopToken(_) | StopKind::Abort | StopKind::Error => {
            ("end_turn", Value::Null)
        }
        StopKind::Length => ("max_tokens", Value::Null),
        StopKind::StopString(s) => ("stop_sequence", json!(s)),
    }
}

fn event(name: &str, v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(v.to_string()))
}

pub async fn messages(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AnthropicError> {
    let req: MessagesRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.model.as_deref())?;
    check_rest(Route::Messages, &req.rest)?;
    let edits = match &req.context_management {
        Some(v) if !v.is_null() => crate::context_edits::parse(v)?,
        _ => Vec::new(),
    };
    let opts = PromptOptions {
        edits: &edits,
        mid_system: has_beta(&headers, MID_CONVERSATION_SYSTEM_BETA),
        kwargs: template_kwargs(&state, req.thinking.as_ref(), req.output_config.as_ref())?,
    };
    let Prompt {
        tokens: prompt,
        rendered,
        plan,
        billing_removed,
        applied_edits,
    } = prompt_of(
        &state,
        req.system.as_ref(),
        &req.messages,
        req.tools.clone(),
        req.tool_choice.as_ref(),
        &opts,
    )?;
    let context_management = req
        .context_management
        .as_ref()
        .filter(|v| !v.is_null())
        .map(|_| json!({"applied_edits": applied_edits}));
    let max_tokens =
        crate::sampling::clamp_to_context(req.max_tokens, state.max_model_len(), prompt.len());
    // Reasoning is parsed out with `--reasoning-parser`; shown as thinking blocks when the
    // request turned thinking on, and dropped otherwise.
    let reasoning = state.agent().reasoning.map(|f| Reasoning {
        parser: cachet_text::ReasoningParser::new(f, &rendered),
        shown: opts.kwargs.get("enable_thinking") == Some(&json!(true)),
        omitted: req
            .thinking
            .as_ref()
            .and_then(|t| t.get("display"))
            .and_then(Value::as_str)
            == Some("omitted"),
    });
    let answer_schema = output_schema(&req)?;
    let input = SamplingInput {
        max_tokens: Some(max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        ..Default::default()
    };
    let mut draft = request_draft(DraftInput {
        label: response_id(&headers, "msg_"),
        prompt,
        sampling: &input,
        api: Api::Anthropic,
        max_tokens_param: "max_tokens",
        cache_salt: &req.cache_salt,
        session_id: req.session_id.as_deref(),
    })?;
    let tok = state.tokenizer();
    let grammar = match plan.grammar(tok.as_ref(), answer_schema.as_ref()) {
        Some(lark) => Some((cachet_grammar::Grammar::Lark(lark), "tools")),
        None => answer_schema
            .clone()
            .map(|s| (cachet_grammar::Grammar::JsonSchema(s), "output_config")),
    };
    if let Some((g, param)) = grammar {
        draft.sampling.constraint =
            Some(crate::structured::compile(&state.agent().grammar, tok, g, param).await?);
    }
    let parse = plan.parse_format();
    let skip_special = !(parse.is_some() && state.agent().markers_special);
    let text = TextOptions {
        stop: req.stop_sequences.clone().unwrap_or_default(),
        skip_special_tokens: skip_special,
        include_stop_str_in_output: false,
    };
    let mut gen = Generation::start_with(&state, draft, text).await?;
    let id = gen.request_id().to_string();
    let tools = (parse, plan.parallel);
    let mut resp = if req.stream.unwrap_or(false) {
        let extras = StreamExtras {
            billing_removed,
            context_management,
        };
        crate::generate::utf8_event_stream(
            Sse::new(stream_events(state, gen, model, tools, reasoning, extras)).into_response(),
        )
    } else {
        let mut text = String::new();
        let mut thinking: Option<String> = None;
        let mut reasoning = reasoning;
        let mut fin = None;
        while let Some(ev) = gen.next().await {
            match ev {
                GenEvent::Delta(d) => match &mut reasoning {
                    Some(r) => {
                        let d = r.parser.push(&d.text);
                        if d.in_reasoning {
                            thinking
                                .get_or_insert_with(String::new)
                                .push_str(&d.reasoning);
                        }
                        text.push_str(&d.content);
                    }
                    None => text.push_str(&d.text),
                },
                GenEvent::Done(f) => fin = Some(f),
            }
        }
        if let Some(r) = &mut reasoning {
            let d = r.parser.finish();
            if d.in_reasoning {
                thinking
                    .get_or_insert_with(String::new)
                    .push_str(&d.reasoning);
            }
            text.push_str(&d.content);
        }
        let fin = gen.final_or_abort(fin);
        if let Some(e) = &fin.error {
            let mut resp = ApiError::Internal(e.to_string()).anthropic_response();
            if let Ok(v) = HeaderValue::from_str(&id) {
                resp.headers_mut().insert(REQUEST_ID_HEADER, v);
            }
            return Ok(resp);
        }
        let (content_text, mut calls) = match parse {
            Some(f) => cachet_text::parse_tool_calls(f, &text),
            None => (text, Vec::new()),
        };
        if !plan.parallel {
            calls.truncate(1);
        }
        let mut content = Vec::new();
        if let (Some(t), Some(r)) = (&thinking, &reasoning) {
            if r.shown {
                let t = if r.omitted { "" } else { t.as_str() };
                content.push(
                    json!({"type": "thinking", "thinking": t, "signature": THINKING_SIGNATURE}),
                );
            }
        }
        if !content_text.is_empty() || calls.is_empty() {
            content.push(json!({"type": "text", "text": content_text}));
        }
        for c in &calls {
            content.push(json!({
                "type": "tool_use", "id": crate::tools::new_tool_use_id(), "name": c.name,
                "input": tool_input(&c.arguments),
            }));
        }
        let (reason, seq) = stop_reason(&fin, !calls.is_empty());
        let mut body = json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": anthropic_usage(&fin),
        });
        if let Some(c) = context_management {
            body["context_management"] = c;
        }
        if let Some(s) = &fin.session {
            body["session"] = session_json(s);
        }
        if state.per_request_metrics() {
            body["metrics"] = metrics_json(&fin, billing_removed);
        }
        with_cache_header(Json(body).into_response(), final_prefill(&fin))
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    Ok(resp)
}

/// The per-request metrics, saying when Claude Code's billing line was removed.
fn metrics_json(fin: &Final, billing_removed: bool) -> Value {
    let mut m = request_metrics_json(fin);
    m["billing_header_removed"] = json!(billing_removed);
    m
}

/// A call's arguments as a `tool_use` input object (`{}` when they are not a JSON object).
fn tool_input(args: &str) -> Value {
    match serde_json::from_str::<Value>(args) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

/// The reasoning of a Messages answer: its parser, whether it is shown (thinking on), and
/// whether its text is left out of the thinking blocks (`thinking.display: "omitted"`).
struct Reasoning {
    parser: cachet_text::ReasoningParser,
    shown: bool,
    omitted: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    ToolUse,
}

/// Content blocks of a streamed answer, opened as they come: thinking, text, then tool_use
/// blocks.
struct Blocks {
    reasoning: Option<Reasoning>,
    parser: Option<cachet_text::ToolCallParser>,
    parallel: bool,
    /// Index and kind of the open block.
    open: Option<(usize, BlockKind)>,
    next: usize,
    called: bool,
    /// A text block was opened.
    texted: bool,
}

impl Blocks {
    fn events(&mut self, text: Option<&str>) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        let answer = match &mut self.reasoning {
            Some(r) => {
                let d = match text {
                    Some(t) => r.parser.push(t),
                    None => r.parser.finish(),
                };
                if r.shown && d.in_reasoning {
                    let omitted = r.omitted;
                    let i = self.open_block(BlockKind::Thinking, &mut out);
                    if !omitted && !d.reasoning.is_empty() {
                        out.push(("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "thinking_delta", "thinking": d.reasoning}})));
                    }
                }
                match text {
                    Some(_) => Some(d.content),
                    None => {
                        self.answer_events(Some(&d.content), &mut out);
                        None
                    }
                }
            }
            None => text.map(str::to_string),
        };
        self.answer_events(answer.as_deref(), &mut out);
        out
    }

    /// Open a block of `kind` unless one is open (closing another kind first); its index.
    fn open_block(&mut self, kind: BlockKind, out: &mut Vec<(&'static str, Value)>) -> usize {
        if let Some((i, k)) = self.open {
            if k == kind {
                return i;
            }
        }
        self.close(out);
        let i = self.next;
        self.next += 1;
        self.open = Some((i, kind));
        self.texted |= kind == BlockKind::Text;
        let block = match kind {
            BlockKind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            _ => json!({"type": "text", "text": ""}),
        };
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": block}),
        ));
        i
    }

    fn answer_events(&mut self, text: Option<&str>, out: &mut Vec<(&'static str, Value)>) {
        let evs = match (&mut self.parser, text) {
            (Some(p), Some(t)) => p.push(t),
            (Some(p), None) => p.finish(),
            (None, Some(t)) if !t.is_empty() => vec![ToolEvent::Content(t.to_string())],
            (None, _) => Vec::new(),
        };
        for e in evs {
            match e {
                ToolEvent::Content(t) => {
                    let i = self.open_block(BlockKind::Text, out);
                    out.push(("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": t}})));
                }
                ToolEvent::Start { index, name } => {
                    if index > 0 && !self.parallel {
                        continue;
                    }
                    self.close(out);
                    self.called = true;
                    let i = self.next;
                    self.next += 1;
                    self.open = Some((i, BlockKind::ToolUse));
                    out.push(("content_block_start", json!({"type": "content_block_start", "index": i,
                        "content_block": {"type": "tool_use", "id": crate::tools::new_tool_use_id(), "name": name, "input": {}}})));
                }
                ToolEvent::Arguments { index, text } => {
                    if index > 0 && !self.parallel {
                        continue;
                    }
                    let i = self.open.map_or(0, |o| o.0);
                    out.push(("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": text}})));
                }
                ToolEvent::End { .. } => self.close(out),
            }
        }
    }

    /// Close the open block; a thinking block gets its `signature_delta` first.
    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if let Some((i, kind)) = self.open.take() {
            if kind == BlockKind::Thinking {
                out.push(("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta", "signature": THINKING_SIGNATURE}})));
            }
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ));
        }
    }
}

/// What the last events of a stream carry besides usage.
struct StreamExtras {
    billing_removed: bool,
    context_management: Option<Value>,
}

fn stream_events(
    state: AppState,
    mut gen: Generation,
    model: String,
    tools: (Option<ToolFormat>, bool),
    reasoning: Option<Reasoning>,
    extras: StreamExtras,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let id = gen.request_id().to_string();
        // message_start carries the prefill stats, so it waits for the first output.
        let first = gen.next().await;
        let mut start = json!({
            "type": "message_start",
            "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": anthropic_start_usage(gen.report(), gen.session(), gen.prompt_len()),
            }
        });
        if let Some(s) = gen.session() {
            start["message"]["session"] = session_json(s);
        }
        yield event("message_start", &start);
        let thinking_shown = reasoning.as_ref().is_some_and(|r| r.shown);
        let mut blocks = Blocks {
            reasoning,
            parser: tools.0.map(cachet_text::ToolCallParser::new),
            parallel: tools.1,
            open: None,
            next: 0,
            called: false,
            texted: false,
        };
        if blocks.parser.is_none() && !thinking_shown {
            // Plain text: the one text block opens at once, as before.
            let mut out = Vec::new();
            blocks.open_block(BlockKind::Text, &mut out);
            for (name, v) in out {
                yield event(name, &v);
            }
        }
        yield event("ping", &json!({"type": "ping"}));
        let mut fin = None;
        let mut next = first;
        while let Some(ev) = next {
            match ev {
                GenEvent::Delta(d) => {
                    for (name, v) in blocks.events(Some(&d.text)) {
                        yield event(name, &v);
                    }
                }
                GenEvent::Done(f) => fin = Some(f),
            }
            next = gen.next().await;
        }
        let fin = gen.final_or_abort(fin);
        if let Some(e) = &fin.error {
            // The engine failed mid-stream: Anthropic's error event ends the stream.
            yield event("error", &ApiError::Internal(e.to_string()).anthropic_body());
            return;
        }
        let mut tail = blocks.events(None);
        if !blocks.called && !blocks.texted {
            // No answer was written (thinking at most): one empty text block, as the
            // collected answer has.
            blocks.open_block(BlockKind::Text, &mut tail);
        }
        blocks.close(&mut tail);
        for (name, v) in tail {
            yield event(name, &v);
        }
        let (reason, seq) = stop_reason(&fin, blocks.called);
        let mut delta = json!({
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": anthropic_usage(&fin),
        });
        if let Some(c) = &extras.context_management {
            delta["context_management"] = c.clone();
        }
        if let Some(s) = &fin.session {
            delta["session"] = session_json(s);
        }
        if state.per_request_metrics() {
            delta["metrics"] = metrics_json(&fin, extras.billing_removed);
        }
        yield event("message_delta", &delta);
        yield event("message_stop", &json!({"type": "message_stop"}));
    }
}
