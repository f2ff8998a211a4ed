//! `POST /v1/chat/completions` and `POST /v1/completions`: the request types and what both
//! routes share (the run of one generation, streamed or collected).

mod chat;
mod choices;
mod completions;
mod stream;

pub(crate) use chat::render_messages;
pub use chat::{chat_completions, chat_completions_render};
pub use completions::{completions, completions_render};

use choices::{collect_choices, vllm_prompt_logprobs};
use stream::stream_events;

use axum::http::HeaderValue;
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cachet_core::RequestDraft;
use cachet_text::{ChatMessage, ToolFormat};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::cache_header::{final_prefill, with_cache_header};
use crate::error::{ApiError, OpenAiError};
use crate::generate::{Generation, TextOptions, REQUEST_ID_HEADER};
use crate::sampling::{request_draft, Api, DraftInput, SamplingInput, StopField};
use crate::structured::Guided;
use crate::tools::{OpenAiTool, ToolPlan};
use crate::usage::{openai_usage, request_metrics_json, session_json, with_reasoning_tokens};
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
    /// vLLM's `include_stop_str_in_output` (default false).
    #[serde(default)]
    pub include_stop_str_in_output: Option<bool>,
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
        let mut d = request_draft(DraftInput {
            label,
            prompt,
            sampling: input,
            api: Api::OpenAi,
            max_tokens_param,
            cache_salt: &self.cache_salt,
            session_id,
        })?;
        d.priority = self.priority.unwrap_or(0);
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

    /// Stop strings, `include_stop_str_in_output`, and special tokens skipped or not.
    fn text_options(&self, skip_special_tokens: bool) -> TextOptions {
        TextOptions {
            stop: self.stop_strings(),
            skip_special_tokens,
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
        }
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
    /// Passed to the chat template as `reasoning_effort` (unless `chat_template_kwargs` sets
    /// it), for templates that use it.
    #[serde(default)]
    pub reasoning_effort: Option<String>,
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

pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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

/// The grammar of a request (a forced call, a response format, or vLLM's guided fields) as
/// its constraint.
pub(crate) async fn constraint_for(
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

/// How a chat response reads reasoning and tool calls out of the text.
#[derive(Clone, Debug)]
struct ChatTools {
    format: Option<ToolFormat>,
    parallel: bool,
    /// `--reasoning-parser`, set up for the request's prompt (each choice parses a clone).
    reasoning: Option<cachet_text::ReasoningParser>,
}

impl ChatTools {
    const NONE: ChatTools = ChatTools {
        format: None,
        parallel: true,
        reasoning: None,
    };
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
        return Ok(with_request_id(
            crate::generate::utf8_event_stream(sse.into_response()),
            &id,
        ));
    }
    let tok = state.tokenizer().clone();
    let collected = match collect_choices(tok.as_ref(), &mut gen, kind, tools, &shape).await {
        Ok(c) => c,
        Err(e) => return Ok(with_request_id(e.openai_response(), &id)),
    };
    let fin = &collected.last;
    let mut usage = openai_usage(fin);
    if let Some(n) = collected.reasoning_tokens {
        with_reasoning_tokens(&mut usage, n);
    }
    let mut body = json!({
        "id": id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": now_secs(),
        "model": model,
        "choices": collected.choices,
        "usage": usage,
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
    let resp = with_cache_header(Json(body).into_response(), final_prefill(fin));
    Ok(with_request_id(resp, &id))
}
