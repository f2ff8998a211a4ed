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
    /// vLLM's `prompt_logprobs`: the logprob of every prompt token after the first, with this
    /// many alternatives (the request does not read the prefix cache).
    #[serde(default)]
    pub prompt_logprobs: Option<u32>,
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
            zero_max_tokens: false,
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
        d.n = self.n.unwrap_or(1);
        d.prompt_logprobs = self.prompt_logprobs;
        if let Some(k) = self.prompt_logprobs {
            if k > crate::sampling::MAX_TOP_LOGPROBS {
                return Err(ApiError::bad_param(
                    "prompt_logprobs",
                    format!(
                        "At most {} alternatives per prompt token, got {k}.",
                        crate::sampling::MAX_TOP_LOGPROBS
                    ),
                ));
            }
        }
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
    /// Return the prompt before the completion (with its logprobs when `logprobs` is set).
    #[serde(default)]
    pub echo: Option<bool>,
    /// Sample this many completions and return the `n` with the highest mean token logprob.
    #[serde(default)]
    pub best_of: Option<u32>,
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

/// What a completions request echoes: the prompt's text and ids (its logprobs come from the
/// engine when asked).
#[derive(Clone, Debug, Default)]
struct Echo {
    text: String,
    ids: Vec<u32>,
}

/// How the choices of one generation are written.
#[derive(Clone, Debug, Default)]
struct Shape {
    /// The first choice's `index` (several prompts: prompt i starts at i * n).
    index_base: usize,
    echo: Option<Echo>,
    /// vLLM's `prompt_logprobs` were asked for.
    prompt_logprobs: bool,
}

/// One generation run to its end: one choice per sequence, and the request's last final.
struct Collected {
    choices: Vec<Value>,
    /// Each choice's mean logprob per generated token (0 without tokens).
    scores: Vec<f64>,
    last: Final,
    prompt_logprobs: Option<Vec<Sampled>>,
}

impl Collected {
    /// `best_of`: keeps the `n` choices with the highest mean token logprob (ties: the earlier
    /// sequence), numbered from `index_base`; their logprobs dropped unless the client asked.
    fn keep_best(&mut self, n: usize, index_base: usize, keep_logprobs: bool) {
        let mut order: Vec<usize> = (0..self.choices.len()).collect();
        order.sort_by(|&a, &b| self.scores[b].total_cmp(&self.scores[a]));
        order.truncate(n);
        let mut kept = Vec::with_capacity(n);
        for (k, i) in order.into_iter().enumerate() {
            let mut c = std::mem::take(&mut self.choices[i]);
            c["index"] = json!(index_base + k);
            if !keep_logprobs {
                c["logprobs"] = Value::Null;
            }
            kept.push(c);
        }
        self.choices = kept;
    }
}

async fn collect_choices(
    tok: &dyn TextTokenizer,
    gen: &mut Generation,
    kind: Kind,
    tools: ChatTools,
    shape: &Shape,
) -> Result<Collected, ApiError> {
    let n = gen.num_seqs();
    let mut texts = vec![String::new(); n];
    let mut tokens: Vec<Vec<Sampled>> = vec![Vec::new(); n];
    let mut finals: Vec<Option<Final>> = vec![None; n];
    let mut last = None;
    while let Some(ev) = gen.next().await {
        match ev {
            GenEvent::Delta(Delta {
                seq,
                text,
                tokens: t,
            }) => {
                if let Some(x) = texts.get_mut(seq as usize) {
                    x.push_str(&text);
                }
                if let Some(x) = tokens.get_mut(seq as usize) {
                    x.extend(t);
                }
            }
            GenEvent::Done(f) => {
                if f.last {
                    last = Some(f.clone());
                }
                if let Some(x) = finals.get_mut(f.seq as usize) {
                    *x = Some(*f);
                }
            }
        }
    }
    let last = final_or_abort(gen, last);
    if let Some(e) = &last.error {
        return Err(ApiError::Internal(e.to_string()));
    }
    let plp = gen.prompt_logprobs().map(<[Sampled]>::to_vec);
    let mut choices = Vec::with_capacity(n);
    let scores = tokens
        .iter()
        .map(|t| {
            if t.is_empty() {
                0.0
            } else {
                t.iter().map(|s| f64::from(s.logprob)).sum::<f64>() / t.len() as f64
            }
        })
        .collect();
    for (i, (text, toks)) in texts.into_iter().zip(tokens).enumerate() {
        let fin = finals[i].clone().unwrap_or_else(|| last.clone());
        let index = shape.index_base + i;
        let want_lp = !toks.is_empty();
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
                    "index": index,
                    "message": message,
                    "logprobs": if want_lp { chat_logprobs(tok, &toks) } else { Value::Null },
                    "finish_reason": finish_reason(&fin, !calls.is_empty()),
                    "stop_reason": stop_reason(&fin),
                })
            }
            Kind::Completion => {
                let (full, logprobs) = match &shape.echo {
                    Some(e) => {
                        let lp = (want_lp || plp.is_some()).then(|| {
                            echo_logprobs(tok, e, plp.as_deref().unwrap_or_default(), &toks)
                        });
                        (format!("{}{text}", e.text), lp.unwrap_or(Value::Null))
                    }
                    None => {
                        let lp = if want_lp {
                            completion_logprobs(tok, &toks, &mut 0)
                        } else {
                            Value::Null
                        };
                        (text, lp)
                    }
                };
                let mut c = json!({
                    "index": index,
                    "text": full,
                    "logprobs": logprobs,
                    "finish_reason": fin.stop.openai(),
                    "stop_reason": stop_reason(&fin),
                });
                if shape.prompt_logprobs {
                    c["prompt_logprobs"] = vllm_prompt_logprobs(tok, plp.as_deref());
                }
                c
            }
        };
        choices.push(choice);
    }
    Ok(Collected {
        choices,
        scores,
        last,
        prompt_logprobs: plp,
    })
}

/// Completions logprobs of an echoed prompt and its completion: the prompt's tokens first (the
/// first with `null`: nothing predicts it), then the generated ones.
fn echo_logprobs(
    tok: &dyn TextTokenizer,
    echo: &Echo,
    prompt: &[Sampled],
    gen: &[Sampled],
) -> Value {
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    let mut offset = 0usize;
    for (i, &id) in echo.ids.iter().enumerate() {
        let t = token_text(tok, id);
        offsets.push(offset);
        offset += t.len();
        texts.push(t);
        match i.checked_sub(1).and_then(|j| prompt.get(j)) {
            Some(s) => {
                lps.push(json!(s.logprob));
                let top: Map<String, Value> = s
                    .top_logprobs
                    .iter()
                    .map(|(id, lp)| (token_text(tok, *id), json!(lp)))
                    .collect();
                tops.push(Value::Object(top));
            }
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
    }
    let g = completion_logprobs(tok, gen, &mut offset);
    let extend = |dst: &mut Vec<Value>, key: &str| {
        if let Some(a) = g[key].as_array() {
            dst.extend(a.iter().cloned());
        }
    };
    let mut texts: Vec<Value> = texts.into_iter().map(Value::String).collect();
    extend(&mut texts, "tokens");
    extend(&mut lps, "token_logprobs");
    extend(&mut tops, "top_logprobs");
    let mut offsets: Vec<Value> = offsets.into_iter().map(|o| json!(o)).collect();
    extend(&mut offsets, "text_offset");
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then for each one
/// `{"<id>": {"logprob", "rank", "decoded_token"}}` with the token and its alternatives (`rank`
/// is known when the token is among them).
fn vllm_prompt_logprobs(tok: &dyn TextTokenizer, plp: Option<&[Sampled]>) -> Value {
    let Some(plp) = plp else {
        return Value::Null;
    };
    let mut out = vec![Value::Null];
    for s in plp {
        let mut m = Map::new();
        let rank = s
            .top_logprobs
            .iter()
            .position(|(id, _)| *id == s.token)
            .map(|r| r + 1);
        m.insert(
            s.token.to_string(),
            json!({"logprob": s.logprob, "rank": rank, "decoded_token": token_text(tok, s.token)}),
        );
        for (r, (id, lp)) in s.top_logprobs.iter().enumerate() {
            m.entry(id.to_string()).or_insert_with(
                || json!({"logprob": lp, "rank": r + 1, "decoded_token": token_text(tok, *id)}),
            );
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

fn final_or_abort(gen: &Generation, fin: Option<Box<Final>>) -> Final {
    fin.map(|f| *f).unwrap_or_else(|| Final {
        stop: crate::generate::StopKind::Abort,
        report: gen.report().cloned(),
        session: gen.session().cloned(),
        prompt_len: gen.prompt_len(),
        tokens_received: 0,
        error: None,
        seq: 0,
        last: true,
        divergence_text: None,
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
    if draft.sampling.constraint.is_some() && draft.n > 1 {
        return Err(ApiError::bad_param(
            "n",
            "`n` > 1 cannot be combined with a grammar (tools forced, response_format, guided_*).",
        )
        .into());
    }
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
        Shape {
            prompt_logprobs: req.common.prompt_logprobs.is_some(),
            ..Shape::default()
        },
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
    let prompts = completion_prompts(&state, &req.prompt)?;
    if prompts.is_empty() {
        return Err(
            ApiError::bad_param("prompt", "`prompt` must hold at least one prompt.").into(),
        );
    }
    let stream = req.common.stream.unwrap_or(false);
    if stream && prompts.len() > 1 {
        return Err(ApiError::bad_param(
            "prompt",
            "Several prompts are answered without streaming only; send `stream: false`.",
        )
        .into());
    }
    let echo = req.echo.unwrap_or(false);
    let max_tokens = req.common.max_tokens.or(Some(16));
    // Echoed logprobs, and `max_tokens: 0`, need the prompt's own logprobs.
    let mut common = req.common.clone();
    if echo && (req.logprobs.is_some() || max_tokens == Some(0)) && common.prompt_logprobs.is_none()
    {
        common.prompt_logprobs = Some(req.logprobs.unwrap_or(0));
    }
    if max_tokens == Some(0) && common.prompt_logprobs.is_none() {
        return Err(ApiError::bad_param(
            "max_tokens",
            "`max_tokens` 0 needs `echo` or `prompt_logprobs` (there is nothing else to return).",
        )
        .into());
    }
    // best_of: that many sequences from one prefill, the best `n` returned (never streamed).
    let n_wanted = req.common.n.unwrap_or(1).max(1) as usize;
    let mut best_of = None;
    if let Some(b) = req.best_of {
        if b == 0 || b > cachet_core::request::MAX_N || (b as usize) < n_wanted {
            return Err(ApiError::bad_param(
                "best_of",
                format!(
                    "`best_of` must be between `n` ({n_wanted}) and {} (got {b}).",
                    cachet_core::request::MAX_N
                ),
            )
            .into());
        }
        if b as usize > n_wanted {
            if stream {
                return Err(ApiError::bad_param(
                    "best_of",
                    "`best_of` > `n` cannot be streamed (the best are known at the end).",
                )
                .into());
            }
            common.n = Some(b);
            best_of = Some(b as usize);
        }
    }
    // Ranking needs every generated token's logprob, asked for when the client did not.
    let logprobs = match best_of {
        Some(_) => Some(req.logprobs.unwrap_or(0)),
        None => req.logprobs,
    };
    let id = response_id(&headers, "cmpl-");
    let tok = state.tokenizer().clone();
    let mut gens = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.into_iter().enumerate() {
        let mut input = common.sampling_input(max_tokens, logprobs);
        input.vocab_size = tok.vocab_size();
        input.zero_max_tokens = common.prompt_logprobs.is_some();
        let label = if i == 0 {
            id.clone()
        } else {
            format!("{id}-{i}")
        };
        let echo_of = echo.then(|| Echo {
            text: tok.decode(&prompt, false).unwrap_or_default(),
            ids: prompt.clone(),
        });
        let mut draft = common.draft(
            label,
            prompt,
            &input,
            "max_tokens",
            req.session_id.as_deref(),
        )?;
        draft.sampling.constraint = constraint_for(
            &state,
            &ToolPlan::none(state.agent().format),
            None,
            &common.guided(),
        )
        .await?;
        if draft.sampling.constraint.is_some() && draft.n > 1 {
            return Err(ApiError::bad_param(
                "n",
                "`n` > 1 cannot be combined with a guided-decoding grammar.",
            )
            .into());
        }
        let gen = Generation::start_with(
            &state,
            draft,
            common.stop_strings(),
            common.skip_special_tokens.unwrap_or(true),
        )
        .await?;
        let shape = Shape {
            index_base: i * n_wanted,
            echo: echo_of,
            prompt_logprobs: req.common.prompt_logprobs.is_some(),
        };
        gens.push((gen, shape));
    }
    if gens.len() == 1 && best_of.is_none() {
        let Some((gen, shape)) = gens.pop() else {
            return Err(ApiError::Internal("no generation".into()).into());
        };
        return run(
            state,
            gen,
            model,
            Kind::Completion,
            ChatTools::NONE,
            shape,
            stream,
            common.include_usage(),
        )
        .await;
    }
    // Several prompts (or best_of): every request runs at once; one response with all the
    // choices.
    let single = gens.len() == 1;
    let keep_logprobs = req.logprobs.is_some();
    let runs = gens.into_iter().map(|(mut gen, shape)| {
        let tok = tok.clone();
        async move {
            let mut c = collect_choices(
                tok.as_ref(),
                &mut gen,
                Kind::Completion,
                ChatTools::NONE,
                &shape,
            )
            .await?;
            if best_of.is_some() {
                c.keep_best(n_wanted, shape.index_base, keep_logprobs);
            }
            Ok::<_, ApiError>(c)
        }
    });
    let results = futures_util::future::join_all(runs).await;
    let mut choices = Vec::new();
    let mut usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0}});
    let mut metrics = Vec::new();
    for r in results {
        let c = match r {
            Ok(c) => c,
            Err(e) => return Ok(with_request_id(e.openai_response(), &id)),
        };
        choices.extend(c.choices);
        let u = openai_usage(&c.last);
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            usage[k] = json!(usage[k].as_u64().unwrap_or(0) + u[k].as_u64().unwrap_or(0));
        }
        for k in ["cached_tokens", "created_cache_tokens"] {
            let d = &u["prompt_tokens_details"][k];
            usage["prompt_tokens_details"][k] = json!(
                usage["prompt_tokens_details"][k].as_u64().unwrap_or(0) + d.as_u64().unwrap_or(0)
            );
        }
        metrics.push(request_metrics_json(&c.last));
    }
    let mut body = json!({
        "id": id, "object": "text_completion", "created": now_secs(), "model": model,
        "choices": choices, "usage": usage,
    });
    if state.per_request_metrics() {
        // One prompt: one request's metrics; several: one object per prompt, in order.
        body["metrics"] = match (single, metrics.pop()) {
            (true, Some(m)) => m,
            (_, last) => {
                metrics.extend(last);
                Value::Array(metrics)
            }
        };
    }
    Ok(with_request_id(Json(body).into_response(), &id))
}

// The request's parts, each used once: a struct for them would only rename them.
#[allow(clippy::too_many_arguments)]
async fn run(
    state: AppState,
    mut gen: Generation,
    model: String,
    kind: Kind,
    tools: ChatTools,
    shape: Shape,
    stream: bool,
    include_usage: bool,
) -> Result<Response, OpenAiError> {
    let id = gen.request_id().to_string();
    if stream {
        let sse = Sse::new(stream_events(
            state,
            gen,
            model,
            kind,
            tools,
            shape,
            include_usage,
        ));
        return Ok(with_request_id(sse.into_response(), &id));
    }
    let tok = state.tokenizer().clone();
    let collected = match collect_choices(tok.as_ref(), &mut gen, kind, tools, &shape).await {
        Ok(c) => c,
        Err(e) => return Ok(with_request_id(e.openai_response(), &id)),
    };
    let fin = &collected.last;
    let mut body = json!({
        "id": id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": now_secs(),
        "model": model,
        "choices": collected.choices,
        "usage": openai_usage(fin),
    });
    if kind == Kind::Chat && shape.prompt_logprobs {
        body["prompt_logprobs"] =
            vllm_prompt_logprobs(tok.as_ref(), collected.prompt_logprobs.as_deref());
    }
    if let Some(s) = &fin.session {
        body["session"] = session_json(s);
    }
    if state.per_request_metrics() {
        body["metrics"] = request_metrics_json(fin);
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
    shape: Shape,
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
        let mut finish_chunk: Option<Value> = None;
        let n = gen.num_seqs();
        let mut text_offset = vec![0usize; n];
        let mut st: Vec<StreamTools> = (0..n).map(|_| StreamTools::new(tools)).collect();
        if kind == Kind::Chat {
            let choices: Vec<Value> = (0..n)
                .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                .collect();
            let mut first = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
            usage_field(&mut first);
            yield data(&first);
        }
        let mut last_fin = None;
        // The echoed prompt and vLLM's prompt_logprobs go first, once the engine's first output
        // (which carries the prompt logprobs) has arrived.
        let mut head_pending = shape.echo.is_some() || shape.prompt_logprobs;
        while let Some(ev) = gen.next().await {
            if head_pending {
                head_pending = false;
                let plp = gen.prompt_logprobs();
                let vllm = shape.prompt_logprobs.then(|| vllm_prompt_logprobs(tok.as_ref(), plp));
                if kind == Kind::Chat {
                    let mut chunk = json!({"id": id, "object": object, "created": created, "model": model,
                        "choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": null}]});
                    chunk["prompt_logprobs"] = vllm.unwrap_or(Value::Null);
                    usage_field(&mut chunk);
                    yield data(&chunk);
                } else {
                    for (i, offset) in text_offset.iter_mut().enumerate() {
                        let mut choice = json!({"index": shape.index_base + i, "text": "", "logprobs": null, "finish_reason": null});
                        if let Some(e) = &shape.echo {
                            choice["text"] = json!(e.text);
                            if plp.is_some() {
                                choice["logprobs"] = echo_logprobs(tok.as_ref(), e, plp.unwrap_or_default(), &[]);
                            }
                            *offset = e.ids.iter().map(|&t| token_text(tok.as_ref(), t).len()).sum();
                        }
                        if let Some(v) = &vllm {
                            choice["prompt_logprobs"] = v.clone();
                        }
                        let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                        usage_field(&mut chunk);
                        yield data(&chunk);
                    }
                }
            }
            match ev {
                GenEvent::Delta(d) => {
                    let i = (d.seq as usize).min(n - 1);
                    let lp = if d.tokens.is_empty() {
                        Value::Null
                    } else if kind == Kind::Chat {
                        chat_logprobs(tok.as_ref(), &d.tokens)
                    } else {
                        completion_logprobs(tok.as_ref(), &d.tokens, &mut text_offset[i])
                    };
                    if kind == Kind::Chat {
                        let mut deltas = st[i].deltas(Some(&d.text));
                        if deltas.is_empty() && !lp.is_null() {
                            deltas.push(json!({"content": ""}));
                        }
                        let k = deltas.len();
                        for (j, delta) in deltas.into_iter().enumerate() {
                            // Logprobs ride on the last chunk of the tokens' text.
                            let lpi = if j + 1 == k { lp.clone() } else { Value::Null };
                            let choice = json!({"index": i, "delta": delta, "logprobs": lpi, "finish_reason": null});
                            let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                            usage_field(&mut chunk);
                            yield data(&chunk);
                        }
                    } else {
                        let choice = json!({"index": i, "text": d.text, "logprobs": lp, "finish_reason": null});
                        let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                        usage_field(&mut chunk);
                        yield data(&chunk);
                    }
                }
                GenEvent::Done(f) => {
                    if f.error.is_some() {
                        last_fin = Some(f);
                        continue;
                    }
                    let i = (f.seq as usize).min(n - 1);
                    if kind == Kind::Chat {
                        for delta in st[i].deltas(None) {
                            let mut chunk = json!({"id": id, "object": object, "created": created, "model": model,
                                "choices": [{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}]});
                            usage_field(&mut chunk);
                            yield data(&chunk);
                        }
                    }
                    let choice = if kind == Kind::Chat {
                        json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": finish_reason(&f, st[i].called), "stop_reason": stop_reason(&f)})
                    } else {
                        json!({"index": i, "text": "", "logprobs": null, "finish_reason": f.stop.openai(), "stop_reason": stop_reason(&f)})
                    };
                    let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                    usage_field(&mut chunk);
                    if f.last {
                        last_fin = Some(f);
                        // The last finish chunk may carry `session` and `metrics` (below).
                        finish_chunk = Some(chunk);
                    } else {
                        yield data(&chunk);
                    }
                }
            }
        }
        let fin = final_or_abort(&gen, last_fin);
        if let Some(e) = &fin.error {
            // The engine failed mid-stream: an error event in OpenAI's shape, then [DONE].
            yield data(&ApiError::Internal(e.to_string()).openai_body());
            yield Ok(Event::default().data("[DONE]"));
            return;
        }
        let mut last = finish_chunk.take().unwrap_or_else(|| {
            let choice = if kind == Kind::Chat {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": fin.stop.openai(), "stop_reason": stop_reason(&fin)})
            } else {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": fin.stop.openai(), "stop_reason": stop_reason(&fin)})
            };
            let mut c = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            usage_field(&mut c);
            c
        });
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
