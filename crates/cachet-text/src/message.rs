//! Chat messages as the OpenAI chat API sends them, and how each field reaches a chat template.
//!
//! A [`ChatMessage`] deserializes from one element of an OpenAI `messages` array:
//!
//! | JSON field | Rust field | reaches the template as |
//! |---|---|---|
//! | `role` (`system`, `developer`, `user`, `assistant`, `tool`; anything else is an error) | [`ChatMessage::role`] | `message.role`, a string; `developer` is rendered as `"system"` (OpenAI's successor of the system role; HF templates know only `system`) |
//! | `content`: a string, `null`, or a list of `{"type": "text", "text"}` parts (joined with no separator) | [`ChatMessage::content`] | `message.content`, always a string (`""` when absent or `null`) |
//! | `name` | [`ChatMessage::name`] | `message.name`, only when set |
//! | `tool_calls` (assistant): `[{id, type: "function", function: {name, arguments}}]` | [`ChatMessage::tool_calls`] | `message.tool_calls`, only when non-empty (Llama 3.x templates test `'tool_calls' in message`); each `function.arguments` is the *parsed* JSON object when the string holds one (Qwen2.5, Llama 3.x, Hermes and Mistral templates print it with `tojson`, as transformers and vLLM hand it to them), otherwise the string as sent |
//! | `tool_call_id` (tool) | [`ChatMessage::tool_call_id`] | `message.tool_call_id`, only when set |
//!
//! [`ChatMessage::validate`] checks what serde cannot: `tool_calls` only on assistant messages,
//! `tool_call_id` only (and always) on tool messages.

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role's name on the wire (`"developer"` stays `"developer"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// The role a chat template sees: `developer` becomes `system`, the others are unchanged.
    pub fn template_name(self) -> &'static str {
        match self {
            Role::Developer => "system",
            r => r.as_str(),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = MessageError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "system" => Role::System,
            "developer" => Role::Developer,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => {
                return Err(MessageError::UnknownRole(
                    other.chars().take(64).collect::<String>(),
                ))
            }
        })
    }
}

/// The only kind of tool call OpenAI defines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolCallKind {
    #[default]
    Function,
}

/// A function the assistant called.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI sends a string). A JSON object sent in its place is
    /// accepted and kept as its compact JSON text.
    #[serde(deserialize_with = "de_arguments")]
    pub arguments: String,
}

/// One tool call of an assistant message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    /// Always `"function"`; may be omitted on input.
    #[serde(rename = "type", default)]
    pub kind: ToolCallKind,
    pub function: FunctionCall,
}

impl ToolCall {
    /// A function call with the given id, name and JSON arguments text.
    pub fn function(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        ToolCall {
            id: id.into(),
            kind: ToolCallKind::Function,
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

/// One chat message (see the module documentation for the template mapping).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    #[serde(default, deserialize_with = "de_content")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(
        default,
        deserialize_with = "de_null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A message that is well-formed JSON but not a valid chat message.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MessageError {
    #[error("unknown role `{0}` (expected system, developer, user, assistant or tool)")]
    UnknownRole(String),
    #[error("only assistant messages may carry `tool_calls` (this one is `{0}`)")]
    ToolCallsOnNonAssistant(Role),
    #[error("only tool messages may carry `tool_call_id` (this one is `{0}`)")]
    ToolCallIdOnNonTool(Role),
    #[error("a tool message needs a `tool_call_id`")]
    MissingToolCallId,
}

impl ChatMessage {
    /// A message with text content and nothing else.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// An assistant turn that calls tools (content may be empty).
    pub fn assistant_tool_calls(content: impl Into<String>, calls: Vec<ToolCall>) -> Self {
        ChatMessage {
            tool_calls: calls,
            ..Self::new(Role::Assistant, content)
        }
    }

    /// The result of the tool call `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            tool_call_id: Some(tool_call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }

    /// Checks the fields that depend on the role.
    pub fn validate(&self) -> Result<(), MessageError> {
        if !self.tool_calls.is_empty() && self.role != Role::Assistant {
            return Err(MessageError::ToolCallsOnNonAssistant(self.role));
        }
        match (self.role, &self.tool_call_id) {
            (Role::Tool, None) => Err(MessageError::MissingToolCallId),
            (Role::Tool, Some(_)) | (_, None) => Ok(()),
            (r, Some(_)) => Err(MessageError::ToolCallIdOnNonTool(r)),
        }
    }
}

/// `content`: a string, `null`, or a list of text parts.
fn de_content<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: String,
        #[serde(default)]
        text: Option<String>,
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Parts(Vec<Part>),
    }
    match Option::<Content>::deserialize(d)? {
        None => Ok(String::new()),
        Some(Content::Text(s)) => Ok(s),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(de::Error::custom(format_args!(
                        "unsupported content part type `{}`: only `text` is supported",
                        p.kind.chars().take(64).collect::<String>()
                    )));
                }
                match p.text {
                    Some(t) => out.push_str(&t),
                    None => return Err(de::Error::custom("a `text` content part needs `text`")),
                }
            }
            Ok(out)
        }
    }
}

fn de_null_as_empty<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

/// `arguments`: a JSON text, or (leniently) a JSON object that is kept as its compact text.
fn de_arguments<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Ok(s),
        v @ serde_json::Value::Object(_) => Ok(v.to_string()),
        _ => Err(de::Error::custom(
            "`function.arguments` must be a JSON string (or an object)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ChatMessage, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn roles_are_lowercase_and_closed() {
        for (s, r) in [
            ("system", Role::System),
            ("developer", Role::Developer),
            ("user", Role::User),
            ("assistant", Role::Assistant),
            ("tool", Role::Tool),
        ] {
            let m = parse(&format!(r#"{{"role":"{s}","content":"x"}}"#)).unwrap();
            assert_eq!(m.role, r);
            assert_eq!(r.as_str(), s);
            assert_eq!(s.parse::<Role>().unwrap(), r);
        }
        let e = parse(r#"{"role":"wizard","content":"x"}"#).unwrap_err();
        assert!(e.to_string().contains("unknown variant `wizard`"), "{e}");
        assert!(parse(r#"{"role":"User","content":"x"}"#).is_err());
        assert_eq!(
            "wizard".parse::<Role>(),
            Err(MessageError::UnknownRole("wizard".into()))
        );
        assert_eq!(Role::Developer.template_name(), "system");
        assert_eq!(Role::Tool.template_name(), "tool");
    }

    #[test]
    fn content_forms() {
        assert_eq!(parse(r#"{"role":"user"}"#).unwrap().content, "");
        assert_eq!(
            parse(r#"{"role":"user","content":null}"#).unwrap().content,
            ""
        );
        assert_eq!(
            parse(r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#)
                .unwrap()
                .content,
            "ab"
        );
        let e = parse(r#"{"role":"user","content":[{"type":"image_url","image_url":{}}]}"#)
            .unwrap_err();
        assert!(e.to_string().contains("image_url"), "{e}");
        assert!(parse(r#"{"role":"user","content":[{"type":"text"}]}"#).is_err());
        assert!(parse(r#"{"role":"user","content":5}"#).is_err());
    }

    #[test]
    fn assistant_tool_calls_and_tool_results() {
        let m = parse(
            r#"{"role":"assistant","content":null,"tool_calls":[
                {"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}},
                {"id":"call_2","function":{"name":"now","arguments":{"tz":"UTC"}}}]}"#,
        )
        .unwrap();
        assert_eq!(m.content, "");
        assert_eq!(
            m.tool_calls,
            vec![
                ToolCall::function("call_1", "get_weather", r#"{"city":"Paris"}"#),
                ToolCall::function("call_2", "now", r#"{"tz":"UTC"}"#),
            ]
        );
        assert_eq!(m.validate(), Ok(()));
        assert!(parse(
            r#"{"role":"assistant","tool_calls":[{"id":"c","type":"retrieval","function":{"name":"f","arguments":"{}"}}]}"#
        )
        .is_err());
        assert!(parse(
            r#"{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":3}}]}"#
        )
        .is_err());
        assert!(parse(r#"{"role":"assistant","tool_calls":null}"#)
            .unwrap()
            .tool_calls
            .is_empty());

        let t = parse(r#"{"role":"tool","tool_call_id":"call_1","content":"18 C"}"#).unwrap();
        assert_eq!(t, ChatMessage::tool("call_1", "18 C"));
        assert_eq!(t.validate(), Ok(()));
        let n = parse(r#"{"role":"user","name":"alice","content":"hi"}"#).unwrap();
        assert_eq!(n.name.as_deref(), Some("alice"));
    }

    #[test]
    fn validation_by_role() {
        let mut m = ChatMessage::user("x");
        m.tool_calls.push(ToolCall::function("c", "f", "{}"));
        assert_eq!(
            m.validate(),
            Err(MessageError::ToolCallsOnNonAssistant(Role::User))
        );
        let mut m = ChatMessage::user("x");
        m.tool_call_id = Some("c".into());
        assert_eq!(
            m.validate(),
            Err(MessageError::ToolCallIdOnNonTool(Role::User))
        );
        assert_eq!(
            ChatMessage::new(Role::Tool, "r").validate(),
            Err(MessageError::MissingToolCallId)
        );
    }

    #[test]
    fn serializes_without_absent_fields() {
        assert_eq!(
            serde_json::to_string(&ChatMessage::user("hi")).unwrap(),
            r#"{"role":"user","content":"hi"}"#
        );
        let m = ChatMessage::assistant_tool_calls("", vec![ToolCall::function("c", "f", "{}")]);
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}"#
        );
        let back: ChatMessage = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
    }
}
