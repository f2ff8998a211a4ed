//! Every request field of `/v1/chat/completions`, `/v1/completions` and `/v1/messages`, and
//! what cachet does with it: implemented, accepted and meaningless here (documented why), or
//! rejected with a 400 naming it (when set to anything but its no-op value). A field in none of
//! the tables is a 400 too (`Unrecognized request argument supplied: <name>`, as OpenAI
//! answers): nothing that changes the answer is silently ignored.
//!
//! The README's field tables are generated from [`CHAT`], [`COMPLETIONS`] and [`MESSAGES`]
//! (a test keeps them equal), and the e2e test walks the official SDKs' request schemas
//! against them.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// What cachet does with a field.
#[derive(Clone, Copy, Debug)]
pub enum Use {
    /// Implemented (read by the request's struct).
    Yes(&'static str),
    /// Accepted and meaningless here; the reason.
    Ignored(&'static str),
    /// Rejected with a 400 naming it unless it holds its no-op value (`null`, `false`, and
    /// what `noop` accepts); the reason.
    Rejected {
        why: &'static str,
        noop: fn(&Value) -> bool,
    },
}

/// One field.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub use_: Use,
}

const fn yes(name: &'static str, note: &'static str) -> Field {
    Field {
        name,
        use_: Use::Yes(note),
    }
}

const fn ignored(name: &'static str, why: &'static str) -> Field {
    Field {
        name,
        use_: Use::Ignored(why),
    }
}

const fn rejected(name: &'static str, why: &'static str, noop: fn(&Value) -> bool) -> Field {
    Field {
        name,
        use_: Use::Rejected { why, noop },
    }
}

fn never(_: &Value) -> bool {
    false
}

fn zero(v: &Value) -> bool {
    v.as_u64() == Some(0)
}

fn empty_string(v: &Value) -> bool {
    v.as_str() == Some("")
}

fn text_only(v: &Value) -> bool {
    v.as_array()
        .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text")))
}

fn medium(v: &Value) -> bool {
    v.as_str() == Some("medium")
}

/// Fields shared by chat and text completions (vLLM's names for the extensions).
macro_rules! common {
    () => {
        [
            yes(
                "model",
                "must be a served name (`/v1/models`); absent: the first",
            ),
            yes("stream", "SSE"),
            yes(
                "stream_options",
                "`include_usage`; `include_obfuscation` accepted and meaningless",
            ),
            yes(
                "max_tokens",
                "absent: fill the context (chat) / 16 (completions)",
            ),
            yes("temperature", "[0, 2]"),
            yes("top_p", "(0, 1]"),
            yes("frequency_penalty", "[-2, 2]"),
            yes("presence_penalty", "[-2, 2]"),
            yes("logit_bias", "token-id keys, values in [-100, 100]"),
            yes("seed", "same seed, same output, whatever the batch"),
            yes(
                "stop",
                "up to 64 strings; the request ends at the token that completes one (usage counts it, not what follows)",
            ),
            yes(
                "n",
                "up to 64 choices from one prefill, each under its own grammar copy (not with a session)",
            ),
            yes(
                "prompt_logprobs",
                "vLLM extension: logprobs of the prompt's tokens (no cache read)",
            ),
            yes("top_k", "vLLM extension"),
            yes("min_p", "vLLM extension"),
            yes("repetition_penalty", "vLLM extension"),
            yes("stop_token_ids", "vLLM extension"),
            yes("ignore_eos", "vLLM extension"),
            yes("min_tokens", "vLLM extension; holds back EOS, stop tokens and stop strings"),
            yes("cache_salt", "tenant isolation of the prefix cache"),
            yes("priority", "lower is more important"),
            yes("session_id", "resumable session (cachet)"),
            yes("skip_special_tokens", "vLLM extension (default true)"),
            yes("guided_json", "vLLM extension: JSON schema grammar"),
            yes("guided_regex", "vLLM extension: regex grammar"),
            yes("guided_choice", "vLLM extension: one of the strings"),
            yes(
                "guided_grammar",
                "vLLM extension: Lark grammar (llguidance)",
            ),
            yes(
                "include_stop_str_in_output",
                "vLLM extension: the stop string (or stop token's text) that ended the text stays in it",
            ),
            ignored("user", "an end-user label; cachet keeps no per-user state"),
        ]
    };
}

const COMMON: [Field; 29] = common!();

const CHAT_ONLY: [Field; 28] = [
    yes(
        "messages",
        "roles system/developer/user/assistant/tool, text parts, tool calls",
    ),
    yes("max_completion_tokens", "as max_tokens"),
    yes("logprobs", "sampled token's logprob"),
    yes("top_logprobs", "up to 20"),
    yes("tools", "function tools"),
    yes(
        "tool_choice",
        "none/auto/required/named (required and named by grammar)",
    ),
    yes("parallel_tool_calls", "false: at most one call"),
    yes(
        "response_format",
        "text, json_object, json_schema (grammar; strict or not)",
    ),
    yes(
        "chat_template_kwargs",
        "vLLM extension: extra template variables",
    ),
    yes("add_generation_prompt", "vLLM extension (default true)"),
    ignored("metadata", "stored nowhere (no stored completions)"),
    ignored("store", "cachet stores no completion"),
    ignored("service_tier", "one tier"),
    ignored("safety_identifier", "no abuse monitoring here"),
    ignored(
        "prompt_cache_key",
        "prefix caching is automatic and content-addressed",
    ),
    ignored(
        "prompt_cache_retention",
        "cache lifetime is the pool's (LRU)",
    ),
    ignored("prompt_cache_options", "prefix caching is automatic"),
    ignored(
        "prediction",
        "predicted outputs change latency only, never the answer",
    ),
    ignored("moderation", "no moderation here"),
    rejected("audio", "no audio output", never),
    rejected("modalities", "text only", text_only),
    rejected("functions", "deprecated by OpenAI: send `tools`", never),
    rejected(
        "function_call",
        "deprecated by OpenAI: send `tool_choice`",
        never,
    ),
    yes(
        "reasoning_effort",
        "passed to the chat template as `reasoning_effort` (templates that use it)",
    ),
    rejected("verbosity", "not adjustable", medium),
    rejected("web_search_options", "no web search", never),
    rejected("echo", "chat echo is not supported", never),
    rejected(
        "continue_final_message",
        "not supported: end the conversation with a user turn",
        never,
    ),
];

const COMPLETIONS_ONLY: [Field; 5] = [
    yes(
        "prompt",
        "a string, token ids, or a list of either (one request each; not streamed)",
    ),
    yes("logprobs", "up to 20 alternatives, and the chosen token itself (up to `logprobs` + 1 entries, as OpenAI and vLLM)"),
    yes(
        "echo",
        "the prompt first; with logprobs, its tokens' logprobs (max_tokens may be 0)",
    ),
    rejected("suffix", "no fill-in-the-middle", empty_string),
    yes(
        "best_of",
        "up to 64 sequences from one prefill, the `n` of highest mean token logprob returned (usage counts all; not streamed)",
    ),
];

/// `/v1/messages`.
pub const MESSAGES: &[Field] = &[
    yes("model", "must be a served name (`/v1/models`)"),
    yes(
        "messages",
        "text, tool_use and tool_result blocks (a result must answer a tool_use of the previous turn); `role: \"system\"` with the `mid-conversation-system-2026-04-07` beta",
    ),
    yes(
        "max_tokens",
        "required; clamped to what the context leaves after the prompt",
    ),
    yes("system", "a string or text blocks"),
    yes(
        "stop_sequences",
        "up to 64; the request ends at the token that completes one",
    ),
    yes("stream", "SSE, Anthropic's events"),
    yes("temperature", "[0, 1]"),
    yes("top_p", "(0, 1]"),
    yes("top_k", ""),
    yes("tools", "client tools (name, description, input_schema)"),
    yes(
        "tool_choice",
        "auto/any/tool/none (any and tool by grammar)",
    ),
    yes(
        "output_config",
        "`format` (json_schema by grammar); `effort` passed to the chat template as `reasoning_effort`",
    ),
    yes("output_format", "as output_config.format"),
    yes("metadata", "an object; stored nowhere"),
    yes(
        "cache_salt",
        "tenant isolation of the prefix cache (cachet)",
    ),
    yes("session_id", "resumable session (cachet)"),
    ignored(
        "cache_control",
        "prefix caching is automatic (every block boundary)",
    ),
    yes(
        "thinking",
        "enabled/adaptive/disabled: `enable_thinking` for the template; with `--reasoning-parser`, thinking blocks (`signature` is not a real signature)",
    ),
    ignored("service_tier", "one tier"),
    ignored("inference_geo", "one place"),
    ignored("speed", "one speed"),
    ignored("diagnostics", "no diagnostics here"),
    ignored("user_profile_id", "no per-user state"),
    ignored("workspace_id", "no workspaces"),
    rejected("container", "no code execution", never),
    rejected("mcp_servers", "no MCP connector", never),
    yes(
        "context_management",
        "`clear_thinking_20251015`, `clear_tool_uses_20250919` applied to the prompt; `applied_edits` reported",
    ),
];

/// `/v1/responses` (the OpenAI Responses API).
pub const RESPONSES: &[Field] = &[
    yes("model", "must be a served name (`/v1/models`); absent: the first"),
    yes(
        "input",
        "a string or items: messages (input_text/output_text parts), function_call, function_call_output, reasoning (dropped)",
    ),
    yes("instructions", "a system message before the input (not carried over by previous_response_id)"),
    yes("tools", "function tools; hosted and namespace tools accepted and left out of the prompt"),
    yes("tool_choice", "none/auto/required/a function (required and a function by grammar)"),
    yes("parallel_tool_calls", "false: at most one call"),
    yes("text", "`format`: text, json_object, json_schema (grammar); `verbosity` accepted"),
    yes(
        "max_output_tokens",
        "clamped to what the context leaves after the input; absent: fill the context",
    ),
    yes("temperature", "[0, 2]"),
    yes("top_p", "(0, 1]"),
    yes(
        "reasoning",
        "`effort` reaches the chat template as `reasoning_effort`; `summary`: the reasoning text as its summary",
    ),
    yes("include", "accepted; nothing encrypted is ever returned"),
    yes("metadata", "stored with the response"),
    yes("user", "stored with the response"),
    yes("prompt_cache_key", "echoed; prefix caching is automatic"),
    yes(
        "truncation",
        "`disabled` or `auto` (oldest items dropped until the input fits the context)",
    ),
    yes("store", "default true: kept (bounded) with its KV parked as a session"),
    yes("stream", "SSE, the Responses API's events"),
    yes("previous_response_id", "continues a stored response on its retained KV"),
    yes("background", "runs detached; GET polls it, cancel aborts it"),
    yes("cache_salt", "tenant isolation of the prefix cache (cachet)"),
    yes("stream_options", "`include_obfuscation` accepted and meaningless"),
    ignored("service_tier", "one tier"),
    ignored("safety_identifier", "no abuse monitoring here"),
    ignored("prompt_cache_retention", "cache lifetime is the pool's (LRU)"),
    ignored("prompt_cache_options", "prefix caching is automatic"),
    ignored("moderation", "no moderation here"),
    ignored("client_metadata", "Codex's session and turn ids: nothing here reads them"),
    rejected("top_logprobs", "no logprobs on this route", zero),
    rejected("max_tool_calls", "not enforced", never),
    rejected("conversation", "no conversations API: use previous_response_id", never),
    rejected("prompt", "no stored prompts", never),
    rejected("context_management", "the prompt is never edited", never),
];

/// Fields of `/v1/messages/count_tokens` beyond the ones it shares with `/v1/messages`.
pub const COUNT_TOKENS_EXTRA: &[&str] = &[];

fn concat(parts: &[&[Field]]) -> Vec<Field> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

/// `/v1/chat/completions`.
pub fn chat() -> Vec<Field> {
    concat(&[&COMMON, &CHAT_ONLY])
}

/// `/v1/completions`.
pub fn completions() -> Vec<Field> {
    concat(&[&COMMON, &COMPLETIONS_ONLY])
}

/// Which table a route reads.
#[derive(Clone, Copy, Debug)]
pub enum Route {
    Chat,
    Completions,
    Messages,
    Responses,
}

impl Route {
    pub fn fields(self) -> Vec<Field> {
        match self {
            Route::Chat => chat(),
            Route::Completions => completions(),
            Route::Messages => MESSAGES.to_vec(),
            Route::Responses => RESPONSES.to_vec(),
        }
    }
}

/// Checks the fields the request's struct did not read: meaningless ones pass, rejected ones
/// are a 400 naming them unless they hold their no-op value, unknown ones are a 400.
pub fn check_rest(route: Route, rest: &Map<String, Value>) -> Result<(), ApiError> {
    if rest.is_empty() {
        return Ok(());
    }
    let table = route.fields();
    for (k, v) in rest {
        match table.iter().find(|f| f.name == k) {
            Some(Field {
                use_: Use::Ignored(_),
                ..
            }) => {}
            Some(Field {
                use_: Use::Rejected { why, noop },
                ..
            }) => {
                if !(v.is_null() || v == &Value::Bool(false) || noop(v)) {
                    return Err(ApiError::bad_param(
                        k,
                        format!("`{k}` is not supported: {why}."),
                    ));
                }
            }
            // An implemented field the struct did not take is a bug; say so rather than
            // ignore it.
            Some(Field {
                use_: Use::Yes(_), ..
            }) => {
                return Err(ApiError::bad_param(
                    k,
                    format!("`{}` could not be read.", crate::error::clip(k)),
                ))
            }
            None => {
                let name = crate::error::clip(k);
                return Err(match route {
                    Route::Messages => {
                        ApiError::bad_param(k, format!("{name}: Extra inputs are not permitted"))
                    }
                    _ => ApiError::bad_param(
                        k,
                        format!("Unrecognized request argument supplied: {name}"),
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The README table of a route (markdown rows: field, what cachet does).
pub fn markdown_table(route: Route) -> String {
    let mut rows = route.fields();
    rows.sort_by_key(|f| f.name);
    let mut s = String::from("| field | cachet |\n|---|---|\n");
    for f in rows {
        let what = match f.use_ {
            Use::Yes("") => "implemented".to_string(),
            Use::Yes(n) => format!("implemented: {n}"),
            Use::Ignored(why) => format!("accepted, meaningless here: {why}"),
            Use::Rejected { why, .. } => format!("400 when set: {why}"),
        };
        s.push_str(&format!("| `{}` | {what} |\n", f.name));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn no_field_is_listed_twice() {
        for r in [
            Route::Chat,
            Route::Completions,
            Route::Messages,
            Route::Responses,
        ] {
            let f = r.fields();
            for (i, a) in f.iter().enumerate() {
                assert!(
                    !f[..i].iter().any(|b| b.name == a.name),
                    "{r:?}: {} twice",
                    a.name
                );
            }
        }
    }

    #[test]
    fn rest_fields_by_use() {
        let m = |v: Value| v.as_object().cloned().unwrap();
        assert!(check_rest(Route::Chat, &m(json!({"user": "u", "store": true}))).is_ok());
        assert!(check_rest(
            Route::Chat,
            &m(json!({"modalities": ["text"], "audio": null}))
        )
        .is_ok());
        let e = check_rest(Route::Chat, &m(json!({"modalities": ["text", "audio"]}))).unwrap_err();
        assert_eq!(e.to_string(), "`modalities` is not supported: text only.");
        let e = check_rest(Route::Chat, &m(json!({"frobnicate": 1}))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Unrecognized request argument supplied: frobnicate"
        );
        let e = check_rest(Route::Messages, &m(json!({"frobnicate": 1}))).unwrap_err();
        assert_eq!(e.to_string(), "frobnicate: Extra inputs are not permitted");
        assert!(check_rest(Route::Completions, &m(json!({"suffix": ""}))).is_ok());
        assert!(check_rest(Route::Completions, &m(json!({"suffix": "x"}))).is_err());
        // An ignored field passes (`thinking` was one before it was implemented).
        assert!(check_rest(Route::Messages, &m(json!({"service_tier": "auto"}))).is_ok());
        assert!(check_rest(Route::Messages, &m(json!({"mcp_servers": [{}]}))).is_err());
    }
}
