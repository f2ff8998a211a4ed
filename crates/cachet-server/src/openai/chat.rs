//! `POST /v1/chat/completions` and its `/render`.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_text::{ChatMessage, ChatRequest as TemplateRequest};
use serde_json::{json, Map, Value};

use crate::body::read_json;
use crate::error::{ApiError, OpenAiError};
use crate::fields::{check_rest, Route};
use crate::generate::{response_id, Generation};
use crate::structured::parse_response_format;
use crate::tools::{openai_tool_choice, openai_tools, ToolPlan};
use crate::AppState;

use super::convert_messages;
use super::run;
use super::{constraint_for, ChatRequest, ChatTools, Kind, Shape};

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
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(e) = &req.reasoning_effort {
        kwargs
            .entry("reasoning_effort")
            .or_insert_with(|| Value::String(e.clone()));
    }
    render_messages(
        state,
        plan,
        convert_messages(&req.messages)?,
        req.add_generation_prompt.unwrap_or(true),
        &kwargs,
        "messages",
    )
}

/// A conversation through the chat template with the tool plan's tools (and the generic tool
/// prompt and history where the template renders neither), and its token ids: the one way the
/// chat and Responses routes build a prompt. `param` names the request field a template error
/// is blamed on.
pub(crate) fn render_messages(
    state: &AppState,
    plan: &ToolPlan,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Value>,
    param: &'static str,
) -> Result<(String, Vec<u32>), ApiError> {
    let caps = state.agent().caps;
    let messages = plan.messages_for(caps, messages);
    let tool_values = plan.tool_values();
    let mut tr = TemplateRequest::new(&messages, add_generation_prompt);
    if plan.template_tools(caps) {
        tr = tr.with_tools(&tool_values);
    }
    if !kwargs.is_empty() {
        tr = tr.with_kwargs(kwargs);
    }
    let tok = state.tokenizer();
    let rendered = tok
        .render_chat(&tr)
        .map_err(|e| ApiError::bad_param(param, format!("Cannot apply the chat template: {e}")))?;
    let prompt = tok
        .encode(&rendered, false)
        .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?;
    Ok((rendered, prompt))
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

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: ChatRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    let setup = chat_setup(&state, &req)?;
    let (rendered, prompt) = render_chat(&state, &req, &setup.plan)?;
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
    let gen = Generation::start_with(&state, draft, req.common.text_options(skip_special)).await?;
    let tools = ChatTools {
        format: parse,
        parallel: setup.plan.parallel,
        reasoning: state
            .agent()
            .reasoning
            .map(|f| cachet_text::ReasoningParser::new(f, &rendered)),
    };
    run(
        state,
        gen,
        model,
        Kind::Chat,
        tools,
        Shape {
            prompt_logprobs: req.common.prompt_logprobs.is_some(),
            ..Shape::default()
        },
        req.common.stream.unwrap_or(false),
        req.common.include_usage(),
    )
    .await
}
