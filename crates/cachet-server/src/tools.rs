//! Tool calling for both APIs: the request's tools and `tool_choice`, how they reach the prompt
//! (the model's own template when it renders them, cachet's generic format otherwise), the
//! grammar that forces a call (`required`, a named function), and the parsed calls of the
//! output.
//!
//! **The generic format** (a template that renders no tools, e.g. SmolLM2's ChatML, and the
//! simulated model's): the tools are described in the system message, Hermes-style:
//!
//! ```text
//! # Tools
//!
//! You may call one or more functions to assist with the user query.
//!
//! You are provided with function signatures within <tools></tools> XML tags:
//! <tools>
//! {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
//! </tools>
//!
//! For each function call, return a json object with function name and arguments within
//! <tool_call></tool_call> XML tags:
//! <tool_call>
//! {"name": <function-name>, "arguments": <args-json-object>}
//! </tool_call>
//! ```
//!
//! and when the template renders no tool calls either, an assistant turn's calls are written
//! into its content in that block form and each `tool` message becomes a user turn
//! `<tool_response>\n...\n</tool_response>` (consecutive results in one turn).
//!
//! **Forcing a call.** `tool_choice: "required"` (OpenAI) / `{"type": "any"}` (Anthropic) and a
//! named function are enforced by a Lark grammar over the active format: the format's markers
//! around a JSON object whose `name` is one of the tools (or the named one) and whose
//! arguments follow that tool's `parameters` schema; one call, or several when parallel calls
//! are allowed. `auto` with a `response_format` allows either a call or the JSON answer.

use cachet_text::{
    ChatMessage, FunctionCall, ParsedCall, Role, TemplateCaps, TextTokenizer, ToolCall,
    ToolCallKind, ToolFormat,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;

/// `tool_choice`, in either API's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never parse calls (the tools are still shown to the model, as vLLM does).
    None,
    Auto,
    /// At least one call (OpenAI `required`, Anthropic `any`).
    Required,
    /// This function.
    Named(String),
}

/// One tool as OpenAI sends it: `{"type": "function", "function": {name, description,
/// parameters, strict}}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiTool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub parameters: Option<Value>,
    /// Accepted; the arguments always follow the schema when the call is forced.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// A checked tool: name, description, parameters schema.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Value,
}

impl Tool {
    /// The OpenAI shape templates and the generic prompt show.
    pub fn openai_value(&self) -> Value {
        let mut f = serde_json::Map::new();
        f.insert("name".into(), json!(self.name));
        if let Some(d) = &self.description {
            f.insert("description".into(), json!(d));
        }
        f.insert("parameters".into(), self.parameters.clone());
        json!({"type": "function", "function": Value::Object(f)})
    }
}

/// OpenAI's rule for function names: 1-64 of `[A-Za-z0-9_-]` (Anthropic's is the same).
pub fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn check_tools(tools: Vec<Tool>, param: &str) -> Result<Vec<Tool>, ApiError> {
    for (i, t) in tools.iter().enumerate() {
        if !valid_tool_name(&t.name) {
            return Err(ApiError::bad_param(
                param,
                format!("Tool {i}: a function name must be 1 to 64 characters from [A-Za-z0-9_-]."),
            ));
        }
        if tools[..i].iter().any(|o| o.name == t.name) {
            return Err(ApiError::bad_param(
                param,
                format!(
                    "Tool name `{}` is defined twice.",
                    crate::error::clip(&t.name)
                ),
            ));
        }
        if !t.parameters.is_object() {
            return Err(ApiError::bad_param(
                param,
                format!(
                    "Tool `{}`: the parameters must be a JSON schema object.",
                    t.name
                ),
            ));
        }
    }
    Ok(tools)
}

/// OpenAI `tools`.
pub fn openai_tools(v: Option<Vec<OpenAiTool>>) -> Result<Vec<Tool>, ApiError> {
    let tools = v
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            if t.kind != "function" {
                return Err(ApiError::bad_param(
                    "tools",
                    format!(
                        "Unsupported tool type `{}`: only `function` tools are supported.",
                        crate::error::clip(&t.kind)
                    ),
                ));
            }
            Ok(Tool {
                name: t.function.name,
                description: t.function.description,
                parameters: t
                    .function
                    .parameters
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_tools(tools, "tools")
}

/// OpenAI `tool_choice`: `"none" | "auto" | "required" | {"type": "function", "function":
/// {"name"}}`. Absent: `auto` with tools, `none` without.
pub fn openai_tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::bad_param("tool_choice", m);
    let choice = match v {
        None | Some(Value::Null) => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "`tool_choice` must be none, auto, required or a function, got `{}`.",
                    crate::error::clip(other)
                )))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"));
            match name {
                Some(n) => ToolChoice::Named(n.to_string()),
                None => {
                    return Err(bad(
                        "A `tool_choice` object must be {\"type\": \"function\", \"function\": {\"name\": ...}}.".into(),
                    ))
                }
            }
        }
        Some(_) => return Err(bad("`tool_choice` must be a string or an object.".into())),
    };
    check_choice(choice, tools, "tool_choice")
}

fn check_choice(choice: ToolChoice, tools: &[Tool], param: &str) -> Result<ToolChoice, ApiError> {
    match &choice {
        ToolChoice::Required if tools.is_empty() => Err(ApiError::bad_param(
            param,
            "A tool call is required but no tools were given.",
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(ApiError::bad_param(
            param,
            format!(
                "`tool_choice` names `{}`, which is not among the tools.",
                crate::error::clip(n)
            ),
        )),
        _ => Ok(choice),
    }
}

/// Anthropic `tools`: `[{name, description, input_schema}]` (server tools are rejected).
#[derive(Clone, Debug, Deserialize)]
pub struct AnthropicTool {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub input_schema: Option<Value>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// Accepted and meaningless (prefix caching is automatic).
    #[serde(default)]
    pub cache_control: Option<Value>,
}

pub fn anthropic_tools(v: Option<Vec<AnthropicTool>>) -> Result<Vec<Tool>, ApiError> {
    let tools = v
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            match t.kind.as_deref() {
                None | Some("custom") => {}
                Some(other) => {
                    return Err(ApiError::bad_param(
                        "tools",
                        format!(
                            "Unsupported tool type `{}`: only client tools (with an input_schema) are supported.",
                            crate::error::clip(other)
                        ),
                    ))
                }
            }
            let Some(schema) = t.input_schema else {
                return Err(ApiError::bad_param(
                    "tools",
                    format!("Tool `{}` needs an `input_schema`.", crate::error::clip(&t.name)),
                ));
            };
            Ok(Tool {
                name: t.name,
                description: t.description,
                parameters: schema,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_tools(tools, "tools")
}

/// Anthropic `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name",
/// "disable_parallel_tool_use"}`; returns the choice and whether parallel calls are allowed.
pub fn anthropic_tool_choice(
    v: Option<&Value>,
    tools: &[Tool],
) -> Result<(ToolChoice, bool), ApiError> {
    let bad = |m: &str| ApiError::bad_param("tool_choice", m.to_string());
    let Some(v) = v.filter(|v| !v.is_null()) else {
        let c = if tools.is_empty() {
            ToolChoice::None
        } else {
            ToolChoice::Auto
        };
        return Ok((c, true));
    };
    let o = v
        .as_object()
        .ok_or_else(|| bad("`tool_choice` must be an object."))?;
    let parallel = !o
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => match o.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err(bad("`tool_choice` of type `tool` needs a `name`.")),
        },
        _ => return Err(bad("`tool_choice.type` must be auto, any, tool or none.")),
    };
    Ok((check_choice(choice, tools, "tool_choice")?, parallel))
}

/// Everything the server does about tools for one request.
#[derive(Clone, Debug)]
pub struct ToolPlan {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
    pub format: ToolFormat,
}

impl ToolPlan {
    pub fn none(format: ToolFormat) -> Self {
        ToolPlan {
            tools: Vec::new(),
            choice: ToolChoice::None,
            parallel: true,
            format,
        }
    }

    /// The format the output is parsed in, when calls may appear.
    pub fn parse_format(&self) -> Option<ToolFormat> {
        (!self.tools.is_empty() && self.choice != ToolChoice::None).then_some(self.format)
    }

    /// Whether a grammar must force a call.
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// The tools as templates see them.
    pub fn tool_values(&self) -> Vec<Value> {
        self.tools.iter().map(Tool::openai_value).collect()
    }

    /// The conversation as the template will render it: the generic tool prompt and history
    /// where the template renders neither (see the module documentation).
    pub fn messages_for(&self, caps: TemplateCaps, messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
        let mut out = if caps.renders_tool_calls {
            messages
        } else {
            history_as_text(messages)
        };
        if !self.tools.is_empty() && !caps.renders_tools {
            let prompt = generic_tool_prompt(&self.tool_values());
            match out.first_mut() {
                Some(m) if matches!(m.role, Role::System | Role::Developer) => {
                    if m.content.is_empty() {
                        m.content = prompt;
                    } else {
                        m.content = format!("{}\n\n{prompt}", m.content);
                    }
                }
                _ => out.insert(0, ChatMessage::system(prompt)),
            }
        }
        out
    }

    /// Whether the template gets the `tools` variable.
    pub fn template_tools(&self, caps: TemplateCaps) -> bool {
        !self.tools.is_empty() && caps.renders_tools
    }

    /// The Lark grammar for this plan: a forced call, or (with `answer_schema`, under `auto`)
    /// a call or the JSON answer. `None` when nothing is constrained by tools.
    pub fn grammar(
        &self,
        tok: &dyn TextTokenizer,
        answer_schema: Option<&Value>,
    ) -> Option<String> {
        let names: Vec<&Tool> = match &self.choice {
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Auto if answer_schema.is_some() && !self.tools.is_empty() => {
                self.tools.iter().collect()
            }
            _ => return None,
        };
        let key = self.format.arguments_key();
        let variants: Vec<Value> = names
            .iter()
            .map(|t| {
                // The arguments have only the keys the function declares.
                let mut params = t.parameters.clone();
                cachet_grammar::close_objects(&mut params);
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, key: params},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = if variants.len() == 1 {
            variants.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": variants})
        };
        if let Value::Object(m) = &mut schema {
            m.insert("x-guidance".into(), cachet_grammar::compact_json_options());
        }
        let body = format!("%json {}", schema);
        let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
        let many = self.parallel && !matches!(self.choice, ToolChoice::Named(_));
        let calls = match self.format {
            ToolFormat::Hermes | ToolFormat::Generic => {
                let call = format!("{} body {}", lit("<tool_call>\n"), lit("\n</tool_call>"));
                if many {
                    format!("calls: call ({} call)*\ncall: {call}\n", lit("\n"))
                } else {
                    format!("calls: call\ncall: {call}\n")
                }
            }
            ToolFormat::Llama3Json => {
                if many {
                    format!("calls: body ({} body)*\n", lit("; "))
                } else {
                    "calls: body\n".to_string()
                }
            }
            ToolFormat::Mistral => {
                let marker = match special_id(tok, "[TOOL_CALLS]") {
                    Some(id) => format!("<[{id}]>"),
                    None => lit("[TOOL_CALLS]"),
                };
                if many {
                    format!(
                        "calls: {marker} {} body ({} body)* {}\n",
                        lit("["),
                        lit(", "),
                        lit("]")
                    )
                } else {
                    format!("calls: {marker} {} body {}\n", lit("["), lit("]"))
                }
            }
        };
        let start = match (&self.choice, answer_schema) {
            (ToolChoice::Auto, Some(s)) => {
                let s = cachet_grammar::with_compact_layout(s);
                format!("start: calls | answer\nanswer: %json {s}\n")
            }
            _ => "start: calls\n".to_string(),
        };
        Some(format!("{start}{calls}body: {body}\n"))
    }
}

/// The id of `text` when the tokenizer has it as one control token.
fn special_id(tok: &dyn TextTokenizer, text: &str) -> Option<u32> {
    match tok.encode(text, false).ok()?.as_slice() {
        [id] if tok.is_special(*id) => Some(*id),
        _ => None,
    }
}

/// Whether the format's markers are control tokens (the detokenizer must keep them).
pub fn markers_are_special(tok: &dyn TextTokenizer, format: ToolFormat) -> bool {
    format
        .start_marker()
        .is_some_and(|m| special_id(tok, m).is_some())
}

/// The generic tool prompt (see the module documentation).
pub fn generic_tool_prompt(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    s
}

/// Tool calls written into assistant content, tool results as user turns (generic format).
fn history_as_text(messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    let mut last_was_tool = false;
    for m in messages {
        match m.role {
            Role::Assistant if !m.tool_calls.is_empty() => {
                let mut parts: Vec<String> = Vec::new();
                if !m.content.is_empty() {
                    parts.push(m.content.clone());
                }
                for c in &m.tool_calls {
                    let args = canonical_args(&c.function.arguments);
                    parts.push(ToolFormat::Generic.render_call(&c.function.name, &args));
                }
                out.push(ChatMessage {
                    tool_calls: Vec::new(),
                    ..ChatMessage::assistant(parts.join("\n"))
                });
                last_was_tool = false;
            }
            Role::Tool => {
                let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
                match out.last_mut() {
                    Some(prev) if last_was_tool => {
                        prev.content.push('\n');
                        prev.content.push_str(&block);
                    }
                    _ => out.push(ChatMessage::user(block)),
                }
                last_was_tool = true;
            }
            _ => {
                out.push(m);
                last_was_tool = false;
            }
        }
    }
    out
}

/// Arguments as compact JSON when they parse (as the model wrote them), else as sent.
fn canonical_args(args: &str) -> String {
    match serde_json::from_str::<Value>(args) {
        Ok(v) => python_json(&v),
        Err(_) => args.to_string(),
    }
}

/// JSON with `", "` and `": "` separators (how the generic format writes arguments, the layout
/// the grammar forces).
pub fn python_json(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let items: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), python_json(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(python_json).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

/// A fresh tool-call id: `call_` and 24 hex digits, or 9 alphanumerics for Mistral (its
/// templates reject any other).
pub fn new_call_id(format: ToolFormat) -> String {
    let u = uuid::Uuid::new_v4().simple().to_string();
    match format {
        ToolFormat::Mistral => u[..9].to_string(),
        _ => format!("call_{}", &u[..24]),
    }
}

/// A fresh Anthropic tool-use id.
pub fn new_tool_use_id() -> String {
    format!("toolu_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// Parsed calls as an assistant message's `tool_calls` (kept for the history of the next turn
/// too).
pub fn to_tool_calls(calls: &[ParsedCall], format: ToolFormat) -> Vec<ToolCall> {
    calls
        .iter()
        .map(|c| ToolCall {
            id: new_call_id(format),
            kind: ToolCallKind::Function,
            function: FunctionCall {
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_text::ByteTokenizer;

    fn weather() -> Tool {
        Tool {
            name: "get_weather".into(),
            description: Some("Weather".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        }
    }

    #[test]
    fn choices_are_checked_against_the_tools() {
        let tools = vec![weather()];
        assert_eq!(openai_tool_choice(None, &tools).unwrap(), ToolChoice::Auto);
        assert_eq!(openai_tool_choice(None, &[]).unwrap(), ToolChoice::None);
        assert_eq!(
            openai_tool_choice(Some(&json!("required")), &tools).unwrap(),
            ToolChoice::Required
        );
        assert_eq!(
            openai_tool_choice(
                Some(&json!({"type": "function", "function": {"name": "get_weather"}})),
                &tools
            )
            .unwrap(),
            ToolChoice::Named("get_weather".into())
        );
        for bad in [
            json!("sometimes"),
            json!({"type": "function", "function": {"name": "nope"}}),
            json!(3),
        ] {
            assert!(openai_tool_choice(Some(&bad), &tools).is_err(), "{bad}");
        }
        assert!(openai_tool_choice(Some(&json!("required")), &[]).is_err());
        assert_eq!(
            anthropic_tool_choice(
                Some(&json!({"type": "any", "disable_parallel_tool_use": true})),
                &tools
            )
            .unwrap(),
            (ToolChoice::Required, false)
        );
        assert!(anthropic_tool_choice(Some(&json!({"type": "tool"})), &tools).is_err());
        assert!(check_tools(vec![weather(), weather()], "tools").is_err());
        let mut bad = weather();
        bad.name = "has space".into();
        assert!(check_tools(vec![bad], "tools").is_err());
    }

    #[test]
    fn generic_history_and_prompt() {
        let plan = ToolPlan {
            tools: vec![weather()],
            choice: ToolChoice::Auto,
            parallel: true,
            format: ToolFormat::Generic,
        };
        let msgs = vec![
            ChatMessage::system("Be brief."),
            ChatMessage::user("Weather in Paris?"),
            ChatMessage::assistant_tool_calls(
                "",
                vec![ToolCall::function(
                    "call_1",
                    "get_weather",
                    r#"{"city":"Paris"}"#,
                )],
            ),
            ChatMessage::tool("call_1", "18 C"),
            ChatMessage::tool("call_2", "sunny"),
        ];
        let out = plan.messages_for(TemplateCaps::default(), msgs);
        assert_eq!(out.len(), 4);
        assert!(out[0].content.starts_with("Be brief.\n\n# Tools\n"));
        assert!(
            out[0].content.contains(r#"{"type":"function","function":{"name":"get_weather","description":"Weather","parameters""#),
            "{}",
            out[0].content
        );
        assert_eq!(
            out[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert_eq!(out[2].role, Role::Assistant);
        assert!(out[2].tool_calls.is_empty());
        assert_eq!(out[3].role, Role::User);
        assert_eq!(
            out[3].content,
            "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
        );
        // A template that renders tools and calls gets them as they are.
        let caps = TemplateCaps {
            renders_tools: true,
            renders_tool_calls: true,
        };
        let msgs = vec![ChatMessage::user("x")];
        assert_eq!(plan.messages_for(caps, msgs.clone()), msgs);
    }

    #[test]
    fn forced_grammars_admit_the_formats_calls() {
        let g = cachet_grammar::GrammarCompiler::new(std::sync::Arc::new(ByteTokenizer)).unwrap();
        let feed = |lark: &str, text: &str| -> bool {
            use cachet_core::request::TokenConstraint;
            let c = g
                .compile(&cachet_grammar::Grammar::Lark(lark.to_string()))
                .unwrap();
            for b in text.bytes() {
                let t = b as u32 + ByteTokenizer::OFFSET;
                if !c.allows(t) {
                    return false;
                }
                c.accept(t);
            }
            c.is_accepting()
        };
        let mut second = weather();
        second.name = "now".into();
        second.parameters = json!({"type": "object", "properties": {}});
        for format in [
            ToolFormat::Generic,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
        ] {
            let plan = ToolPlan {
                tools: vec![weather(), second.clone()],
                choice: ToolChoice::Required,
                parallel: true,
                format,
            };
            let lark = plan.grammar(&ByteTokenizer, None).unwrap();
            let one = format.render_call("get_weather", r#"{"city": "Oslo"}"#);
            assert!(feed(&lark, &one), "{format:?}: {one}");
            // Only the keys the function declares (its schema says nothing of others).
            assert!(!feed(
                &lark,
                &format.render_call("get_weather", r#"{"city": "Oslo", "metres": 97}"#)
            ));
            assert!(!feed(&lark, &format.render_call("now", r#"{"x": 1}"#)));
            assert!(!feed(
                &lark,
                &format.render_call("get_weather", r#"{"town": "Oslo"}"#)
            ));
            assert!(!feed(&lark, &format.render_call("other", "{}")));
            let named = ToolPlan {
                choice: ToolChoice::Named("now".into()),
                ..plan.clone()
            };
            let lark = named.grammar(&ByteTokenizer, None).unwrap();
            assert!(feed(&lark, &format.render_call("now", "{}")));
            assert!(!feed(&lark, &one), "only the named tool");
        }
        let two = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let mut plan = ToolPlan {
            tools: vec![second],
            choice: ToolChoice::Required,
            parallel: true,
            format: ToolFormat::Hermes,
        };
        assert!(feed(&plan.grammar(&ByteTokenizer, None).unwrap(), two));
        plan.parallel = false;
        assert!(!feed(&plan.grammar(&ByteTokenizer, None).unwrap(), two));
        // auto + a response schema: a call or the answer.
        plan.choice = ToolChoice::Auto;
        let lark = plan
            .grammar(&ByteTokenizer, Some(&json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})))
            .unwrap();
        assert!(feed(&lark, "{\"a\": 3}"));
        assert!(feed(
            &lark,
            "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"
        ));
        assert!(!feed(&lark, "hello"));
    }
}
