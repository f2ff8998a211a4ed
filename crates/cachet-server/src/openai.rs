//! `POST /v1/chat/completions` and `POST /v1/completions`.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_core::{RequestDraft, Sampled};
use cachet_text::{
    ChatMessage, ChatRequest as TemplateRequest, TextTokenizer, ToolEvent, ToolFormat,
};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::body::read_json;
use crate::error::{ApiError, OpenAiError};
use crate::fields::{check_rest, Route};
use crate::generate::{
    check_session_id, response_id, Delta, Final, GenEvent, Generation, REQUEST_ID_HEADER,
};
use crate::sampling::{build_sampling, check_cache_salt, Api, SamplingInput, StopField};
use crate::structured::{parse_response_format, Guided};
use crate::tools::{openai_tool_choice, openai_tools, OpenAiTool, ToolPlan};
use crate::usage::{openai_usage, request_metrics_json, session_json};
use crate::AppState;

/// One message of `messages`: cachet-text's [`ChatMessage`] (roles, text parts, `name`,
/// `tool_calls`, `tool_call_id`).
pub type ChatMessageIn = ChatMessage;

/// Checks the conversation: at least one message, each valid for its role.
pub fn convert_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must contain at least one message.",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        m.validate()
            .map_err(|e| ApiError::bad_param("messages", format!("Message {i}: {e}.")))?;
    }
    Ok(messages.to_vec())
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields shared by chat and text completions.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CommonParams {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub min_tokens: Option<u32>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub priority: Option<i32>,
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// vLLM's `skip_special_tokens` (default true).
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
    /// vLLM's guided decoding (see [`Guided`]; not flattened: a flattened struct inside a
    /// flattened struct would hide every field from the unknown-field check).
    #[serde(default)]
    pub guided_json: Option<Value>,
    #[serde(default)]
    pub guided_regex: Option<String>,
    #[serde(default)]
    pub guided_choice: Option<Vec<String>>,
    #[serde(default)]
    pub guided_grammar: Option<String>,
}

impl CommonParams {
    fn sampling_input(&self, max_tokens: Option<u32>, logprobs: Option<u32>) -> SamplingInput {
        SamplingInput {
            logit_bias: self.logit_bias.clone(),
            vocab_size: 0,
            max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_tokens: self.min_tokens,
            n: self.n,
            logprobs,
        }
    }

    /// The request as the engine will validate it: sampling checked against OpenAI's ranges,
    /// cache and session options.
    fn draft(
        &self,
        label: String,
        prompt: Vec<u32>,
        input: &SamplingInput,
        max_tokens_param: &str,
        session_id: Option<&str>,
    ) -> Result<RequestDraft, ApiError> {
        let (sampling, max_tokens) = build_sampling(input, Api::OpenAi, max_tokens_param)?;
        check_cache_salt(&self.cache_salt)?;
        check_session_id(session_id)?;
        let mut d = RequestDraft::new(label, prompt, sampling);
        d.max_tokens = max_tokens;
        d.cache_salt = self.cache_salt.clone();
        d.priority = self.priority.unwrap_or(0);
        d.session_id = session_id.map(std::sync::Arc::from);
        Ok(d)
    }

    fn guided(&self) -> Guided {
        Guided {
            guided_json: self.guided_json.clone(),
            guided_regex: self.guided_regex.clone(),
            guided_choice: self.guided_choice.clone(),
            guided_grammar: self.guided_grammar.clone(),
        }
    }

    fn stop_strings(&self) -> Vec<String> {
        self.stop
            .clone()
            .map(StopField::into_vec)
            .unwrap_or_default()
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Resumable session (cachet extension; the SDKs send it via `extra_body`).
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<OpenAiTool>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub response_format: Option<Value>,
    /// vLLM's extra template variables.
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Every other field: checked against the field table ([`crate::fields`]).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A completions prompt: one string or one token list (a batch of several is rejected).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Resumable session (cachet extension, as on chat completions): the next turn's prompt
    /// extends this one's prompt and completion.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Every other field: checked against the field table ([`crate::fields`]).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn token_text(tok: &dyn TextTokenizer, id: u32) -> String {
    tok.token_to_piece(id).unwrap_or_default()
}

fn chat_logprobs(tok: &dyn TextTokenizer, tokens: &[Sampled]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|s| {
            let text = token_text(tok, s.token);
            let top: Vec<Value> = s
                .top_logprobs
                .iter()
                .map(|(id, lp)| {
                    let t = token_text(tok, *id);
                    json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
                })
                .collect();
            json!({"token": text, "logprob": s.logprob, "bytes": text.as_bytes(), "top_logprobs": top})
        })
        .collect();
    json!({ "content": content })
}

fn completion_logprobs(tok: &dyn TextTokenizer, tokens: &[Sampled], offset: &mut usize) -> Value {
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for s in tokens {
        let t = token_text(tok, s.token);
        offsets.push(*offset);
        *offset += t.len();
        texts.push(t);
        lps.push(s.logprob);
        let top: serde_json::Map<String, Value> = s
            .top_logprobs
            .iter()
            .map(|(id, lp)| (token_text(tok, *id), json!(lp)))
            .collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    resp
}

/// Which OpenAI route a generation belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Runs a generation to its end, collecting text and logprob tokens.
async fn collect(gen: &mut Generation) -> (String, Vec<Sampled>, Option<Box<Final>>) {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut fin = None;
    while let Some(ev) = gen.next().await {
        match ev {
            GenEvent::Delta(Delta { text: t, tokens: s }) => {
                text.push_str(&t);
                tokens.extend(s);
            }
            GenEvent::Done(f) => fin = Some(f),
        }
    }
    (text, tokens, fin)
}

fn final_or_abort(gen: &Generation, fin: Option<Box<Final>>) -> Final {
    fin.map(|f| *f).unwrap_or_else(|| Final {
        stop: crate::generate::StopKind::Abort,
        report: gen.report().cloned(),
        session: gen.session().cloned(),
        prompt_len: gen.prompt_len(),
        tokens_received: 0,
        error: None,
    })
}

/// Tools, tool choice and response format of a chat request, checked.
struct ChatSetup {
    plan: ToolPlan,
    answer_schema: Option<Value>,
}

fn chat_setup(state: &AppState, req: &ChatRequest) -> Result<ChatSetup, ApiError> {
    check_rest(Route::Chat, &req.rest)?;
    let tools = openai_tools(req.tools.clone())?;
    let choice = openai_tool_choice(req.tool_choice.as_ref(), &tools)?;
    let plan = ToolPlan {
        tools,
        choice,
        parallel: req.parallel_tool_calls.unwrap_or(true),
        format: state.agent().format,
    };
    let answer_schema =
        parse_response_format(req.response_format.as_ref())?.and_then(|r| r.schema());
    Ok(ChatSetup {
        plan,
        answer_schema,
    })
}

/// The rendered chat template and its token ids: exactly what `/v1/chat/completions` runs.
fn chat_prompt(state: &AppState, req: &ChatRequest) -> Result<(String, Vec<u32>), ApiError> {
    let setup = chat_setup(state, req)?;
    render_chat(state, req, &setup.plan)
}

fn render_chat(
    state: &AppState,
    req: &ChatRequest,
    plan: &ToolPlan,
) -> Result<(String, Vec<u32>), ApiError> {
    let caps = state.agent().caps;
    let messages = plan.messages_for(caps, convert_messages(&req.messages)?);
    let tool_values = plan.tool_values();
    let mut tr = TemplateRequest::new(&messages, req.add_generation_prompt.unwrap_or(true));
    if plan.template_tools(caps) {
        tr = tr.with_tools(&tool_values);
    }
    if let Some(kw) = &req.chat_template_kwargs {
        tr = tr.with_kwargs(kw);
    }
    let tok = state.tokenizer();
    let rendered = tok.render_chat(&tr).map_err(|e| {
        ApiError::bad_param("messages", format!("Cannot apply the chat template: {e}"))
    })?;
    let prompt = tok
        .encode(&rendered, false)
        .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?;
    Ok((rendered, prompt))
}

/// The grammar of a request (a forced call, a response format, or vLLM's guided fields) as
/// its constraint.
async fn constraint_for(
    state: &AppState,
    plan: &ToolPlan,
    answer_schema: Option<&Value>,
    guided: &Guided,
) -> Result<Option<cachet_core::request::Constraint>, ApiError> {
    let tok = state.tokenizer();
    let guided = guided.grammar()?;
    let (grammar, param) = match (
        plan.grammar(tok.as_ref(), answer_schema),
        answer_schema,
        guided,
    ) {
        (_, Some(_), Some((_, p))) => {
            return Err(ApiError::bad_param(
                p,
                "Send either `response_format` or a guided-decoding field, not both.",
            ))
        }
        (Some(lark), _, _) => (cachet_grammar::Grammar::Lark(lark), "tools"),
        (None, Some(schema), None) => (
            cachet_grammar::Grammar::JsonSchema(schema.clone()),
            "response_format",
        ),
        (None, None, Some((g, p))) => (g, p),
        (None, None, None) => return Ok(None),
    };
    let c = crate::structured::compile(&state.agent().grammar, tok, grammar, param).await?;
    Ok(Some(c))
}

/// The token ids of each prompt of a completions request: exactly what `/v1/completions` runs.
fn completion_prompts(state: &AppState, prompt: &PromptField) -> Result<Vec<Vec<u32>>, ApiError> {
    let tok = state.tokenizer();
    let encode = |s: &str| {
        tok.encode(s, true)
            .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))
    };
    let check = |t: &[u32]| {
        if !t.is_empty() {
            tok.decode(t, false).map_err(|e| {
                ApiError::bad_param("prompt", format!("Invalid token ids in prompt: {e}"))
            })?;
        }
        Ok::<(), ApiError>(())
    };
    match prompt {
        PromptField::Text(s) => Ok(vec![encode(s)?]),
        PromptField::Tokens(t) => {
            check(t)?;
            Ok(vec![t.clone()])
        }
        PromptField::Texts(v) => v.iter().map(|s| encode(s)).collect(),
        PromptField::TokenLists(v) => v
            .iter()
            .map(|t| {
                check(t)?;
                Ok(t.clone())
            })
            .collect(),
    }
}

/// `POST /v1/chat/completions/render`: the token ids the engine would run for this request,
/// with no generation (what cache-aware routers, e.g. llm-d's precise prefix-cache scorer, hash
/// to score instances). `{"request_id", "model", "prompt": the rendered template, "token_ids"}`.
pub async fn chat_completions_render(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: ChatRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    let (rendered, prompt) = chat_prompt(&state, &req)?;
    Ok(Json(json!({
        "request_id": response_id(&headers, "chatcmpl-"),
        "model": model,
        "prompt": rendered,
        "token_ids": prompt,
    }))
    .into_response())
}

/// `POST /v1/completions/render`: one `{"request_id", "model", "token_ids"}` per prompt (vLLM
/// answers a list: a completions request may carry several prompts).
pub async fn completions_render(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: CompletionRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    let id = response_id(&headers, "cmpl-");
    let out: Vec<Value> = completion_prompts(&state, &req.prompt)?
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let rid = if i == 0 {
                id.clone()
            } else {
                format!("{id}-{i}")
            };
            json!({"request_id": rid, "model": model, "token_ids": t})
        })
        .collect();
    Ok(Json(Value::Array(out)).into_response())
}

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: ChatRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    let setup = chat_setup(&state, &req)?;
    let (_, prompt) = render_chat(&state, &req, &setup.plan)?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), top) => Some(top.unwrap_or(0)),
        (_, Some(t)) if t > 0 => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "`top_logprobs` requires `logprobs` to be true.",
            )
            .into())
        }
        _ => None,
    };
    let (max_tokens, param) = match req.max_completion_tokens {
        Some(m) => (Some(m), "max_completion_tokens"),
        None => (req.common.max_tokens, "max_tokens"),
    };
    let mut input = req.common.sampling_input(max_tokens, logprobs);
    input.vocab_size = state.tokenizer().vocab_size();
    let mut draft = req.common.draft(
        response_id(&headers, "chatcmpl-"),
        prompt,
        &input,
        param,
        req.session_id.as_deref(),
    )?;
    draft.sampling.constraint = constraint_for(
        &state,
        &setup.plan,
        setup.answer_schema.as_ref(),
        &req.common.guided(),
    )
    .await?;
    let parse = setup.plan.parse_format();
    let skip_special = req.common.skip_special_tokens.unwrap_or(true)
        && !(parse.is_some() && state.agent().markers_special);
    let gen =
        Generation::start_with(&state, draft, req.common.stop_strings(), skip_special).await?;
    let tools = ChatTools {
        format: parse,
        parallel: setup.plan.parallel,
    };
    run(
        state,
        gen,
        model,
        Kind::Chat,
        tools,
        req.common.stream.unwrap_or(false),
        req.common.include_usage(),
    )
    .await
}

/// How a chat response reads tool calls out of the text.
#[derive(Clone, Copy, Debug)]
struct ChatTools {
    format: Option<ToolFormat>,
    parallel: bool,
}

impl ChatTools {
    const NONE: ChatTools = ChatTools {
        format: None,
        parallel: true,
    };
}

pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: CompletionRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    check_rest(Route::Completions, &req.rest)?;
    let mut prompts = completion_prompts(&state, &req.prompt)?;
    if prompts.len() != 1 {
        return Err(ApiError::bad_param(
            "prompt",
            "Only a single prompt is supported per request; send several requests instead.",
        )
        .into());
    }
    let prompt = prompts.pop().unwrap_or_default();
    let mut input = req
        .common
        .sampling_input(req.common.max_tokens.or(Some(16)), req.logprobs);
    input.vocab_size = state.tokenizer().vocab_size();
    let mut draft = req.common.draft(
        response_id(&headers, "cmpl-"),
        prompt,
        &input,
        "max_tokens",
        req.session_id.as_deref(),
    )?;
    draft.sampling.constraint = constraint_for(
        &state,
        &ToolPlan::none(state.agent().format),
        None,
        &req.common.guided(),
    )
    .await?;
    let gen = Generation::start_with(
        &state,
        draft,
        req.common.stop_strings(),
        req.common.skip_special_tokens.unwrap_or(true),
    )
    .await?;
    run(
        state,
        gen,
        model,
        Kind::Completion,
        ChatTools::NONE,
        req.common.stream.unwrap_or(false),
        req.common.include_usage(),
    )
    .await
}

async fn run(
    state: AppState,
    mut gen: Generation,
    model: String,
    kind: Kind,
    tools: ChatTools,
    stream: bool,
    include_usage: bool,
) -> Result<Response, OpenAiError> {
    let id = gen.request_id().to_string();
    if stream {
        let sse = Sse::new(stream_events(state, gen, model, kind, tools, include_usage));
        return Ok(with_request_id(sse.into_response(), &id));
    }
    let tok = state.tokenizer().clone();
    let (text, tokens, fin) = collect(&mut gen).await;
    let fin = final_or_abort(&gen, fin);
    if let Some(e) = &fin.error {
        let resp = ApiError::Internal(e.to_string()).openai_response();
        return Ok(with_request_id(resp, &id));
    }
    let want_lp = !tokens.is_empty();
    let choice = match kind {
        Kind::Chat => {
            let (content, calls) = match tools.format {
                Some(f) => {
                    let (c, mut calls) = cachet_text::parse_tool_calls(f, &text);
                    if !tools.parallel {
                        calls.truncate(1);
                    }
                    (c, calls)
                }
                None => (text, Vec::new()),
            };
            let mut message = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                let format = tools.format.unwrap_or(ToolFormat::Generic);
                let tc = crate::tools::to_tool_calls(&calls, format);
                if content.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = serde_json::to_value(&tc).unwrap_or_default();
            }
            json!({
                "index": 0,
                "message": message,
                "logprobs": if want_lp { chat_logprobs(tok.as_ref(), &tokens) } else { Value::Null },
                "finish_reason": finish_reason(&fin, !calls.is_empty()),
                "stop_reason": stop_reason(&fin),
            })
        }
        Kind::Completion => json!({
            "index": 0,
            "text": text,
            "logprobs": if want_lp { completion_logprobs(tok.as_ref(), &tokens, &mut 0) } else { Value::Null },
            "finish_reason": fin.stop.openai(),
            "stop_reason": stop_reason(&fin),
        }),
    };
    let mut body = json!({
        "id": id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": now_secs(),
        "model": model,
        "choices": [choice],
        "usage": openai_usage(&fin),
    });
    if let Some(s) = &fin.session {
        body["session"] = session_json(s);
    }
    if state.per_request_metrics() {
        body["metrics"] = request_metrics_json(&fin);
    }
    Ok(with_request_id(Json(body).into_response(), &id))
}

/// `tool_calls` when the answer called a tool and ended by itself, else the engine's reason.
fn finish_reason(fin: &Final, called: bool) -> &'static str {
    match fin.stop {
        crate::generate::StopKind::Eos | crate::generate::StopKind::StopString(_) if called => {
            "tool_calls"
        }
        _ => fin.stop.openai(),
    }
}

/// Streaming `delta.tool_calls` for parser events; content events become `content` deltas.
struct StreamTools {
    parser: Option<cachet_text::ToolCallParser>,
    format: ToolFormat,
    parallel: bool,
    called: bool,
}

impl StreamTools {
    fn new(t: ChatTools) -> Self {
        StreamTools {
            parser: t.format.map(cachet_text::ToolCallParser::new),
            format: t.format.unwrap_or(ToolFormat::Generic),
            parallel: t.parallel,
            called: false,
        }
    }

    /// Deltas (`{"content"}` or `{"tool_calls": [...]}`) for a piece of text (`None`: the end).
    fn deltas(&mut self, text: Option<&str>) -> Vec<Value> {
        let Some(p) = &mut self.parser else {
            return match text {
                Some(t) if !t.is_empty() => vec![json!({"content": t})],
                _ => Vec::new(),
            };
        };
        let events = match text {
            Some(t) => p.push(t),
            None => p.finish(),
        };
        let mut out = Vec::new();
        for e in events {
            match e {
                ToolEvent::Content(c) => out.push(json!({"content": c})),
                ToolEvent::Start { index, name } => {
                    if index > 0 && !self.parallel {
                        continue;
                    }
                    self.called = true;
                    out.push(json!({"tool_calls": [{
                        "index": index, "id": crate::tools::new_call_id(self.format), "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }]}));
                }
                ToolEvent::Arguments { index, text } => {
                    if index > 0 && !self.parallel {
                        continue;
                    }
                    out.push(
                        json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]}),
                    );
                }
                ToolEvent::End { .. } => {}
            }
        }
        out
    }
}

/// vLLM's `stop_reason`: the matched stop string, else null.
fn stop_reason(fin: &Final) -> Value {
    match &fin.stop {
        crate::generate::StopKind::StopString(s) => json!(s),
        _ => Value::Null,
    }
}

fn data(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

fn stream_events(
    state: AppState,
    mut gen: Generation,
    model: String,
    kind: Kind,
    tools: ChatTools,
    include_usage: bool,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let tok = state.tokenizer().clone();
        let id = gen.request_id().to_string();
        let created = now_secs();
        let object = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let usage_field = |v: &mut Value| {
            if include_usage {
                v["usage"] = Value::Null;
            }
        };
        let mut text_offset = 0usize;
        let mut st = StreamTools::new(tools);
        if kind == Kind::Chat {
            let mut first = json!({
                "id": id, "object": object, "created": created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
            });
            usage_field(&mut first);
            yield data(&first);
        }
        let mut fin = None;
        while let Some(ev) = gen.next().await {
            match ev {
                GenEvent::Delta(d) => {
                    let lp = if d.tokens.is_empty() {
                        Value::Null
                    } else if kind == Kind::Chat {
                        chat_logprobs(tok.as_ref(), &d.tokens)
                    } else {
                        completion_logprobs(tok.as_ref(), &d.tokens, &mut text_offset)
                    };
                    if kind == Kind::Chat {
                        let mut deltas = st.deltas(Some(&d.text));
                        if deltas.is_empty() && !lp.is_null() {
                            deltas.push(json!({"content": ""}));
                        }
                        let n = deltas.len();
                        for (i, delta) in deltas.into_iter().enumerate() {
                            // Logprobs ride on the last chunk of the tokens' text.
                            let lpi = if i + 1 == n { lp.clone() } else { Value::Null };
                            let choice = json!({"index": 0, "delta": delta, "logprobs": lpi, "finish_reason": null});
                            let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                            usage_field(&mut chunk);
                            yield data(&chunk);
                        }
                    } else {
                        let choice = json!({"index": 0, "text": d.text, "logprobs": lp, "finish_reason": null});
                        let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                        usage_field(&mut chunk);
                        yield data(&chunk);
                    }
                }
                GenEvent::Done(f) => fin = Some(f),
            }
        }
        let fin = final_or_abort(&gen, fin);
        if let Some(e) = &fin.error {
            // The engine failed mid-stream: an error event in OpenAI's shape, then [DONE].
            yield data(&ApiError::Internal(e.to_string()).openai_body());
            yield Ok(Event::default().data("[DONE]"));
            return;
        }
        if kind == Kind::Chat {
            for delta in st.deltas(None) {
                let mut chunk = json!({"id": id, "object": object, "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]});
                usage_field(&mut chunk);
                yield data(&chunk);
            }
        }
        let choice = if kind == Kind::Chat {
            json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason(&fin, st.called), "stop_reason": stop_reason(&fin)})
        } else {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": fin.stop.openai(), "stop_reason": stop_reason(&fin)})
        };
        let mut last = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
        usage_field(&mut last);
        let metrics = state.per_request_metrics().then(|| request_metrics_json(&fin));
        let session = fin.session.as_ref().map(session_json);
        // `session` and `metrics` ride on the usage chunk, or on the finish chunk without one.
        let extras = |v: &mut Value| {
            if let Some(s) = &session {
                v["session"] = s.clone();
            }
            if let Some(m) = &metrics {
                v["metrics"] = m.clone();
            }
        };
        if include_usage {
            yield data(&last);
            let mut usage = json!({
                "id": id, "object": object, "created": created, "model": model,
                "choices": [], "usage": openai_usage(&fin),
            });
            extras(&mut usage);
            yield data(&usage);
        } else {
            extras(&mut last);
            yield data(&last);
        }
        yield Ok(Event::default().data("[DONE]"));
    }
}
