//! The `POST /v1/responses` body: its fields, its input items as chat messages, its tools as
//! the chat route's tool plan, and `text.format` as the structured-output schema.

use cachet_text::{ChatMessage, Role, ToolCall};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{clip, ApiError};
use crate::tools::{openai_tool_choice, Tool, ToolChoice};

/// `input`: a string (one user message) or a list of items.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub input: Option<Input>,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {...}, "verbosity"}`.
    #[serde(default)]
    pub text: Option<Value>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// `{"effort", "summary"}`: echoed.
    #[serde(default)]
    pub reasoning: Option<Value>,
    #[serde(default)]
    pub include: Option<Vec<String>>,
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub prompt_cache_key: Option<String>,
    /// `disabled` (default) or `auto`.
    #[serde(default)]
    pub truncation: Option<String>,
    /// Default true, as OpenAI's.
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub background: Option<bool>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub stream_options: Option<Value>,
    /// Every other field: checked against the field table ([`crate::fields::RESPONSES`]).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl ResponsesRequest {
    pub fn store(&self) -> bool {
        self.store.unwrap_or(true)
    }

    /// `reasoning.summary` asks for one (`auto`, `concise` or `detailed`).
    pub fn reasoning_summary(&self) -> bool {
        self.reasoning
            .as_ref()
            .and_then(|r| r.get("summary"))
            .is_some_and(Value::is_string)
    }

    /// `reasoning.effort`, for the chat template's `reasoning_effort`.
    pub fn reasoning_effort(&self) -> Option<&str> {
        self.reasoning.as_ref()?.get("effort")?.as_str()
    }

    /// `truncation: "auto"`: the oldest items are dropped until the prompt fits.
    pub fn truncate_auto(&self) -> Result<bool, ApiError> {
        match self.truncation.as_deref() {
            None | Some("disabled") => Ok(false),
            Some("auto") => Ok(true),
            Some(o) => Err(ApiError::bad_param(
                "truncation",
                format!(
                    "`truncation` must be `auto` or `disabled`, got `{}`.",
                    clip(o)
                ),
            )),
        }
    }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// A fresh output-message id.
pub fn message_id() -> String {
    new_id("msg")
}

/// A fresh reasoning-item id.
pub fn reasoning_id() -> String {
    new_id("rs")
}

/// A fresh function-call item id.
pub fn function_call_id() -> String {
    new_id("fc")
}

/// The request's input as stored items: a string is one user message; an item without `type`
/// is a message; every item gets an `id`, and a message's string content becomes one text
/// part.
pub fn input_items(input: Option<&Input>) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        None => Vec::new(),
        Some(Input::Text(s)) => {
            vec![json!({"type": "message", "role": "user", "content": s})]
        }
        Some(Input::Items(items)) => items.clone(),
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, mut item) in items.into_iter().enumerate() {
        let Some(o) = item.as_object_mut() else {
            return Err(ApiError::bad_param(
                "input",
                format!("Input item {i} must be an object."),
            ));
        };
        if !o.contains_key("type") {
            o.insert("type".into(), json!("message"));
        }
        if o.get("type").and_then(Value::as_str) == Some("message") {
            let part = match o.get("role").and_then(Value::as_str) {
                Some("assistant") => "output_text",
                _ => "input_text",
            };
            if let Some(Value::String(s)) = o.get("content") {
                let s = s.clone();
                o.insert("content".into(), json!([{"type": part, "text": s}]));
            }
        }
        if !o.get("id").is_some_and(Value::is_string) {
            let prefix = match o.get("type").and_then(Value::as_str) {
                Some("function_call") => "fc",
                Some("function_call_output") => "fco",
                Some("reasoning") => "rs",
                _ => "msg",
            };
            o.insert("id".into(), json!(new_id(prefix)));
        }
        out.push(item);
    }
    Ok(out)
}

/// Item types of tools cachet does not run (their calls and results in the history are left
/// out of the prompt, as their tools are).
const HOSTED_ITEMS: &[&str] = &[
    "web_search_call",
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "tool_search_call",
    "tool_search_output",
    "compaction",
];

fn text_of(content: &Value, i: usize) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (
                        Some("input_text" | "output_text" | "text" | "summary_text"),
                        Some(Value::String(t)),
                    ) => out.push_str(t),
                    (Some("refusal"), _) => {
                        out.push_str(p.get("refusal").and_then(Value::as_str).unwrap_or(""))
                    }
                    (Some(t), _) => {
                        return Err(ApiError::bad_param(
                            "input",
                            format!(
                            "Input item {i}: content part type `{}` is not supported: text only.",
                            clip(t)
                        ),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::bad_param(
                            "input",
                            format!("Input item {i}: a content part needs a `type`."),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::bad_param(
            "input",
            format!("Input item {i}: `content` must be a string or a list of parts."),
        )),
    }
}

fn str_field<'a>(item: &'a Value, key: &str, i: usize, kind: &str) -> Result<&'a str, ApiError> {
    item.get(key).and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad_param(
            "input",
            format!("Input item {i}: a `{kind}` item needs a string `{key}`."),
        )
    })
}

/// The conversation as chat messages: `instructions` first (a system message), then the items
/// in order; consecutive calls join one assistant turn; reasoning items and hosted tools'
/// items are left out.
pub fn to_chat(instructions: Option<&str>, items: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut chat: Vec<ChatMessage> = Vec::with_capacity(items.len() + 1);
    if let Some(s) = instructions.filter(|s| !s.is_empty()) {
        chat.push(ChatMessage::system(s));
    }
    for (i, item) in items.iter().enumerate() {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("user") => Role::User,
                    Some("assistant") => Role::Assistant,
                    Some("system") => Role::System,
                    Some("developer") => Role::Developer,
                    other => {
                        return Err(ApiError::bad_param(
                            "input",
                            format!(
                                "Input item {i}: role must be user, assistant, system or developer, got `{}`.",
                                clip(other.unwrap_or("none"))
                            ),
                        ))
                    }
                };
                let text = text_of(item.get("content").unwrap_or(&Value::Null), i)?;
                chat.push(ChatMessage::new(role, text));
            }
            "function_call" | "custom_tool_call" => {
                let name = str_field(item, "name", i, kind)?;
                let call_id = str_field(item, "call_id", i, kind)?;
                let args = match kind {
                    "function_call" => str_field(item, "arguments", i, kind)?.to_string(),
                    _ => json!({"input": item.get("input").and_then(Value::as_str).unwrap_or("")})
                        .to_string(),
                };
                let call = ToolCall::function(call_id, name, args);
                match chat.last_mut() {
                    // A call after the assistant's text (or its other calls) joins that turn.
                    Some(m) if m.role == Role::Assistant => m.tool_calls.push(call),
                    _ => chat.push(ChatMessage::assistant_tool_calls("", vec![call])),
                }
            }
            "function_call_output" | "custom_tool_call_output" => {
                let call_id = str_field(item, "call_id", i, kind)?;
                let output = text_of(item.get("output").unwrap_or(&Value::Null), i)?;
                chat.push(ChatMessage::tool(call_id, output));
            }
            "reasoning" => {}
            "item_reference" => {
                return Err(ApiError::bad_param(
                    "input",
                    format!("Input item {i}: `item_reference` is not supported: send the item itself, or continue with `previous_response_id`."),
                ))
            }
            k if HOSTED_ITEMS.contains(&k) => {
                tracing::warn!(item_type = k, "responses: a hosted tool's item left out of the prompt");
            }
            k => {
                return Err(ApiError::bad_param(
                    "input",
                    format!("Input item {i}: unsupported item type `{}`.", clip(k)),
                ))
            }
        }
    }
    if chat.is_empty() {
        return Err(ApiError::bad_param(
            "input",
            "`input` must contain at least one message.",
        ));
    }
    Ok(chat)
}

/// The function tools of `tools`; any other type (hosted tools, `namespace`, `custom`, ...) is
/// accepted, left out of the prompt and logged.
pub fn function_tools(tools: Option<&[Value]>) -> Result<Vec<Tool>, ApiError> {
    let mut out: Vec<Tool> = Vec::new();
    for (i, t) in tools.unwrap_or_default().iter().enumerate() {
        let kind = t.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "function" {
            tracing::warn!(
                tool_type = %clip(kind),
                "responses: a tool type cachet cannot run, left out of the prompt"
            );
            continue;
        }
        let name = t.get("name").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_param(
                "tools",
                format!("Tool {i}: a function tool needs a `name`."),
            )
        })?;
        let parameters = match t.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p) => p.clone(),
        };
        out.push(Tool {
            name: name.to_string(),
            description: t
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
        });
    }
    // The chat route's checks (names, duplicates, schemas), through its own entry point.
    let as_chat: Vec<crate::tools::OpenAiTool> = out
        .iter()
        .map(|t| crate::tools::OpenAiTool {
            kind: "function".into(),
            function: crate::tools::FunctionDef {
                name: t.name.clone(),
                description: t.description.clone(),
                parameters: Some(t.parameters.clone()),
                strict: None,
            },
        })
        .collect();
    crate::tools::openai_tools(Some(as_chat))
}

/// `tool_choice`: `none | auto | required`, `{"type": "function", "name"}`, or
/// `{"type": "allowed_tools", "mode", "tools"}` (the mode over the listed functions). A hosted
/// tool's type is `auto` (its tool is not in the prompt).
pub fn tool_choice(v: Option<&Value>, tools: &mut Vec<Tool>) -> Result<ToolChoice, ApiError> {
    let as_chat = match v {
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("function") => {
                let name = o.get("name").and_then(Value::as_str).unwrap_or("");
                json!({"type": "function", "function": {"name": name}})
            }
            Some("allowed_tools") => {
                let names: Vec<&str> = o
                    .get("tools")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|t| t.get("name").and_then(Value::as_str))
                            .collect()
                    })
                    .unwrap_or_default();
                tools.retain(|t| names.contains(&t.name.as_str()));
                json!(o.get("mode").and_then(Value::as_str).unwrap_or("auto"))
            }
            Some(other) => {
                tracing::warn!(
                    tool_choice = %clip(other),
                    "responses: tool_choice names a tool cachet cannot run; treated as auto"
                );
                json!("auto")
            }
            None => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "A `tool_choice` object needs a `type`.",
                ))
            }
        },
        other => other.cloned().unwrap_or(Value::Null),
    };
    openai_tool_choice(Some(&as_chat), tools)
}

/// `text.format` as the chat route's `response_format` (`None` for plain text).
pub fn response_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(f) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let bad = || {
        ApiError::bad_param(
            "text",
            "`text.format` must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"name\", \"schema\"}.",
        )
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut spec = Map::new();
            for k in ["name", "description", "schema", "strict"] {
                if let Some(v) = f.get(k).filter(|v| !v.is_null()) {
                    spec.insert(k.into(), v.clone());
                }
            }
            if !spec.contains_key("name") {
                spec.insert("name".into(), json!("response"));
            }
            Ok(Some(
                json!({"type": "json_schema", "json_schema": Value::Object(spec)}),
            ))
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_chat_turns() {
        let items = input_items(Some(&Input::Items(vec![
            json!({"role": "developer", "content": "be brief"}),
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}),
            json!({"type": "reasoning", "summary": []}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look", "annotations": []}]}),
            json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"}),
            json!({"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "c1", "output": "one"}),
            json!({"type": "web_search_call", "status": "completed"}),
        ])))
        .unwrap();
        assert!(items.iter().all(|i| i["id"].is_string()));
        assert_eq!(items[0]["type"], "message");
        assert_eq!(
            items[0]["content"],
            json!([{"type": "input_text", "text": "be brief"}])
        );
        let chat = to_chat(Some("sys"), &items).unwrap();
        let roles: Vec<Role> = chat.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                Role::System,
                Role::Developer,
                Role::User,
                Role::Assistant,
                Role::Tool
            ]
        );
        assert_eq!(chat[2].content, "ab");
        assert_eq!(chat[3].content, "let me look");
        let calls: Vec<(&str, &str)> = chat[3]
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.function.name.as_str()))
            .collect();
        assert_eq!(calls, [("c1", "f"), ("c2", "g")]);
        assert_eq!(chat[4].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(chat[4].content, "one");
    }

    #[test]
    fn bad_items_name_input() {
        for (item, msg) in [
            (json!({"role": "robot", "content": "x"}), "role must be"),
            (
                json!({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}),
                "text only",
            ),
            (
                json!({"type": "function_call", "name": "f", "arguments": "{}"}),
                "`call_id`",
            ),
            (json!({"type": "frobnicate"}), "unsupported item type"),
            (
                json!({"type": "item_reference", "id": "x"}),
                "item_reference",
            ),
        ] {
            let items = input_items(Some(&Input::Items(vec![item]))).unwrap();
            let e = to_chat(None, &items).unwrap_err();
            assert!(e.to_string().contains(msg), "{e}");
            assert!(matches!(e, ApiError::BadRequest { param: Some(ref p), .. } if p == "input"));
        }
        let e = to_chat(None, &[]).unwrap_err();
        assert!(e.to_string().contains("at least one"), "{e}");
    }

    #[test]
    fn hosted_tools_are_left_out_and_functions_kept() {
        let tools = [
            json!({"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}),
            json!({"type": "web_search"}),
            json!({"type": "namespace", "name": "ns", "description": "d", "tools": []}),
            json!({"type": "custom", "name": "apply_patch"}),
        ];
        let mut t = function_tools(Some(&tools[..])).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].name, "shell");
        assert_eq!(
            tool_choice(Some(&json!({"type": "function", "name": "shell"})), &mut t).unwrap(),
            ToolChoice::Named("shell".into())
        );
        assert_eq!(
            tool_choice(Some(&json!({"type": "web_search"})), &mut t).unwrap(),
            ToolChoice::Auto
        );
        assert!(tool_choice(Some(&json!({"type": "function", "name": "nope"})), &mut t).is_err());
        assert_eq!(
            tool_choice(None, &mut Vec::new()).unwrap(),
            ToolChoice::None
        );
        let bad = [json!({"type": "function", "name": "bad name"})];
        let e = function_tools(Some(&bad[..])).unwrap_err();
        assert!(e.to_string().contains("function name"), "{e}");
    }

    #[test]
    fn text_format_maps_to_response_format() {
        assert_eq!(response_format(None).unwrap(), None);
        assert_eq!(
            response_format(Some(&json!({"format": {"type": "text"}}))).unwrap(),
            None
        );
        assert_eq!(
            response_format(Some(&json!({"format": {"type": "json_object"}}))).unwrap(),
            Some(json!({"type": "json_object"}))
        );
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            response_format(Some(&json!({"format": {"type": "json_schema", "name": "X", "schema": s.clone(), "strict": true}}))).unwrap(),
            Some(json!({"type": "json_schema", "json_schema": {"name": "X", "schema": s, "strict": true}}))
        );
        assert!(response_format(Some(&json!({"format": {"type": "yaml"}}))).is_err());
    }
}
