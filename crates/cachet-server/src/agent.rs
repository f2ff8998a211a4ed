//! The server's agent-API settings, fixed at startup: the tool-call format, what the chat
//! template renders by itself, the grammar compiler (built on first use), billing-line
//! normalization.

use std::sync::Arc;

use cachet_text::{ChatMessage, ChatRequest, TemplateCaps, TextTokenizer, ToolCall, ToolFormat};
use serde_json::json;

use crate::structured::GrammarCell;

pub struct Agent {
    pub grammar: Arc<GrammarCell>,
    pub format: ToolFormat,
    pub caps: TemplateCaps,
    /// The format's markers are control tokens: the detokenizer keeps special tokens when
    /// calls are parsed.
    pub markers_special: bool,
    pub keep_billing_header: bool,
    /// `--reasoning-parser`: how the model's reasoning is told from its answer (`None`: it is
    /// not, the reasoning stays in the answer text).
    pub reasoning: Option<cachet_text::ReasoningFormat>,
}

impl Agent {
    /// `parser`: `--tool-call-parser` (`None` or `auto`: from what the template renders).
    pub fn new(tok: &dyn TextTokenizer, parser: Option<&str>, keep_billing_header: bool) -> Self {
        let caps = tok.chat_caps();
        let format = parser
            .filter(|p| *p != "auto")
            .and_then(ToolFormat::parse)
            .unwrap_or_else(|| detect(tok, caps));
        tracing::info!(
            tool_call_format = format.as_str(),
            renders_tools = caps.renders_tools,
            renders_tool_calls = caps.renders_tool_calls,
            "tool calling"
        );
        Agent {
            grammar: Arc::new(GrammarCell::default()),
            format,
            caps,
            markers_special: crate::tools::markers_are_special(tok, format),
            keep_billing_header,
            reasoning: None,
        }
    }
}

/// The format the template writes a call in (rendered once), or the generic one.
fn detect(tok: &dyn TextTokenizer, caps: TemplateCaps) -> ToolFormat {
    if !caps.renders_tool_calls {
        return ToolFormat::Generic;
    }
    let tools = [
        json!({"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {"type": "object", "properties": {}}}}),
    ];
    let msgs = [
        ChatMessage::user("probe"),
        ChatMessage::assistant_tool_calls("", vec![ToolCall::function("c4ch3tpr0", "probe", "{}")]),
    ];
    tok.render_chat(&ChatRequest::new(&msgs, false).with_tools(&tools))
        .ok()
        .and_then(|s| ToolFormat::detect(&s))
        .unwrap_or(ToolFormat::Generic)
}
