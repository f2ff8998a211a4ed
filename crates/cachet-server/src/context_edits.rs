//! Anthropic's `context_management` edits, applied to a Messages request's conversation before
//! it is rendered (as Anthropic applies them server-side), and reported back as
//! `context_management.applied_edits`.
//!
//! * `clear_thinking_20251015` (`keep`: `{"type": "thinking_turns", "value": N}`, default 1,
//!   or `"all"`): thinking blocks of all but the last N assistant turns that have any are
//!   removed. cachet never renders thinking from the history, so these edits free no prompt
//!   tokens (`cleared_input_tokens` 0).
//! * `clear_tool_uses_20250919`: once the prompt exceeds `trigger` (`{"type": "input_tokens"}`,
//!   default 100,000, or `{"type": "tool_uses"}`), the results of all but the last `keep` tool
//!   uses (`{"type": "tool_uses", "value"}`, default 3) become a placeholder, tools named in
//!   `exclude_tools` aside; `clear_tool_inputs` (`true` or tool names) empties those calls'
//!   inputs too. With `clear_at_least` (`{"type": "input_tokens"}`) the edit is applied only if
//!   it frees that many prompt tokens.
//!
//! `cleared_input_tokens` is exact: the rendered prompt's length before the edit less its
//! length after. An edit that clears nothing is not reported.

use serde_json::{json, Value};

use crate::anthropic::{Block, Content, MessageIn};
use crate::error::ApiError;

/// What a cleared tool result reads instead.
pub const CLEARED_TOOL_RESULT: &str = "[Tool result cleared to save context]";

const PARAM: &str = "context_management";

#[derive(Clone, Debug, PartialEq)]
pub enum Edit {
    ClearThinking {
        /// Thinking turns kept (`None`: all).
        keep: Option<usize>,
    },
    ClearToolUses {
        trigger: Trigger,
        keep: usize,
        clear_at_least: Option<u64>,
        exclude_tools: Vec<String>,
        clear_inputs: ClearInputs,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum Trigger {
    InputTokens(u64),
    ToolUses(usize),
}

#[derive(Clone, Debug, PartialEq)]
pub enum ClearInputs {
    None,
    All,
    Tools(Vec<String>),
}

impl ClearInputs {
    fn covers(&self, name: &str) -> bool {
        match self {
            ClearInputs::None => false,
            ClearInputs::All => true,
            ClearInputs::Tools(t) => t.iter().any(|n| n == name),
        }
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_param(PARAM, msg.into())
}

/// `{"type": <kind>, "value": <non-negative integer>}`.
fn counted(v: &Value, field: &str, kinds: &[&str]) -> Result<(String, u64), ApiError> {
    let kind = v.get("type").and_then(Value::as_str);
    let value = v.get("value").and_then(Value::as_u64);
    match (kind, value) {
        (Some(k), Some(n)) if kinds.contains(&k) => Ok((k.to_string(), n)),
        _ => Err(bad(format!(
            "`{field}` must be {{\"type\": {}, \"value\": <non-negative integer>}}.",
            kinds
                .iter()
                .map(|k| format!("\"{k}\""))
                .collect::<Vec<_>>()
                .join(" or ")
        ))),
    }
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The request's `context_management`: `{"edits": [...]}`.
pub fn parse(v: &Value) -> Result<Vec<Edit>, ApiError> {
    let Some(obj) = v.as_object() else {
        return Err(bad("`context_management` must be an object."));
    };
    if let Some(k) = obj.keys().find(|k| *k != "edits") {
        return Err(bad(format!(
            "Unknown field `context_management.{}`.",
            crate::error::clip(k)
        )));
    }
    let edits = match obj.get("edits") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("`context_management.edits` must be an array.")),
    };
    let mut out = Vec::with_capacity(edits.len());
    for e in edits {
        let kind = e.get("type").and_then(Value::as_str).unwrap_or_default();
        let edit = match kind {
            "clear_thinking_20251015" => {
                let keep = match e.get("keep") {
                    None | Some(Value::Null) => Some(1),
                    Some(Value::String(s)) if s == "all" => None,
                    Some(k) => Some(to_usize(counted(k, "keep", &["thinking_turns"])?.1)),
                };
                Edit::ClearThinking { keep }
            }
            "clear_tool_uses_20250919" => {
                let trigger = match e.get("trigger") {
                    None | Some(Value::Null) => Trigger::InputTokens(100_000),
                    Some(t) => match counted(t, "trigger", &["input_tokens", "tool_uses"])? {
                        (k, n) if k == "tool_uses" => Trigger::ToolUses(to_usize(n)),
                        (_, n) => Trigger::InputTokens(n),
                    },
                };
                let keep = match e.get("keep") {
                    None | Some(Value::Null) => 3,
                    Some(k) => to_usize(counted(k, "keep", &["tool_uses"])?.1),
                };
                let clear_at_least = match e.get("clear_at_least") {
                    None | Some(Value::Null) => None,
                    Some(c) => Some(counted(c, "clear_at_least", &["input_tokens"])?.1),
                };
                let names = |field: &str, v: &Value| -> Result<Vec<String>, ApiError> {
                    v.as_array()
                        .and_then(|a| {
                            a.iter()
                                .map(|n| n.as_str().map(str::to_string))
                                .collect::<Option<Vec<_>>>()
                        })
                        .ok_or_else(|| bad(format!("`{field}` must be an array of tool names.")))
                };
                let exclude_tools = match e.get("exclude_tools") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(v) => names("exclude_tools", v)?,
                };
                let clear_inputs = match e.get("clear_tool_inputs") {
                    None | Some(Value::Null) | Some(Value::Bool(false)) => ClearInputs::None,
                    Some(Value::Bool(true)) => ClearInputs::All,
                    Some(v) => ClearInputs::Tools(names("clear_tool_inputs", v)?),
                };
                Edit::ClearToolUses {
                    trigger,
                    keep,
                    clear_at_least,
                    exclude_tools,
                    clear_inputs,
                }
            }
            other => {
                return Err(bad(format!(
                    "Unknown context management edit type `{}`: expected `clear_thinking_20251015` or `clear_tool_uses_20250919`.",
                    crate::error::clip(other)
                )))
            }
        };
        out.push(edit);
    }
    Ok(out)
}

/// What one edit did, before its token count is known.
#[derive(Clone, Debug, PartialEq)]
pub struct Cleared {
    /// `applied_edits`' entry without `cleared_input_tokens`.
    pub report: Value,
    /// `clear_at_least`, for the caller to check against the tokens freed.
    pub at_least: Option<u64>,
}

impl Edit {
    /// Apply the edit to `messages` (whose rendered prompt is `input_tokens` long); `None`
    /// when it does not trigger or clears nothing (then `messages` is unchanged).
    pub fn apply(&self, messages: &mut [MessageIn], input_tokens: u64) -> Option<Cleared> {
        match self {
            Edit::ClearThinking { keep } => {
                let keep = (*keep)?;
                let turns: Vec<usize> = messages
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.role == "assistant" && has_thinking(m))
                    .map(|(i, _)| i)
                    .collect();
                let n = turns.len().saturating_sub(keep);
                for &i in &turns[..n] {
                    if let Content::Blocks(b) = &mut messages[i].content {
                        b.retain(|b| !is_thinking(b));
                    }
                }
                (n > 0).then(|| Cleared {
                    report: json!({"type": "clear_thinking_20251015", "cleared_thinking_turns": n}),
                    at_least: None,
                })
            }
            Edit::ClearToolUses {
                trigger,
                keep,
                clear_at_least,
                exclude_tools,
                clear_inputs,
            } => {
                // Every tool use, in order: (message, block, id, name).
                let uses: Vec<(usize, usize, String, String)> = messages
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.role == "assistant")
                    .flat_map(|(i, m)| blocks(m).enumerate().map(move |(j, b)| (i, j, b)))
                    .filter(|(_, _, b)| b.kind == "tool_use")
                    .filter_map(|(i, j, b)| Some((i, j, b.id.clone()?, b.name.clone()?)))
                    .collect();
                let fired = match trigger {
                    Trigger::InputTokens(t) => input_tokens > *t,
                    Trigger::ToolUses(t) => uses.len() > *t,
                };
                if !fired {
                    return None;
                }
                let old = uses.len().saturating_sub(*keep);
                let mut cleared = 0usize;
                for (i, j, id, name) in &uses[..old] {
                    if exclude_tools.contains(name) {
                        continue;
                    }
                    let mut hit = false;
                    for m in messages.iter_mut().skip(i + 1).filter(|m| m.role == "user") {
                        if let Content::Blocks(bs) = &mut m.content {
                            for b in bs.iter_mut().filter(|b| {
                                b.kind == "tool_result"
                                    && b.tool_use_id.as_deref() == Some(id.as_str())
                            }) {
                                b.content = Some(Content::Text(CLEARED_TOOL_RESULT.into()));
                                hit = true;
                            }
                        }
                    }
                    if clear_inputs.covers(name) {
                        if let Content::Blocks(bs) = &mut messages[*i].content {
                            if let Some(b) = bs.get_mut(*j) {
                                b.input = Some(json!({}));
                                hit = true;
                            }
                        }
                    }
                    cleared += usize::from(hit);
                }
                (cleared > 0).then(|| Cleared {
                    report: json!({"type": "clear_tool_uses_20250919", "cleared_tool_uses": cleared}),
                    at_least: *clear_at_least,
                })
            }
        }
    }
}

fn blocks(m: &MessageIn) -> impl Iterator<Item = &Block> {
    match &m.content {
        Content::Blocks(b) => b.iter(),
        Content::Text(_) => [].iter(),
    }
}

fn is_thinking(b: &Block) -> bool {
    matches!(b.kind.as_str(), "thinking" | "redacted_thinking")
}

fn has_thinking(m: &MessageIn) -> bool {
    blocks(m).any(is_thinking)
}

/// Apply `edits` in order to `messages`, measuring each with `render` (the prompt's token
/// count); returns the `applied_edits` entries.
pub fn apply_all(
    edits: &[Edit],
    messages: &mut Vec<MessageIn>,
    mut render: impl FnMut(&[MessageIn]) -> Result<u64, ApiError>,
) -> Result<Vec<Value>, ApiError> {
    let mut applied = Vec::new();
    if edits.is_empty() {
        return Ok(applied);
    }
    let mut tokens = render(messages)?;
    for edit in edits {
        let mut edited = messages.clone();
        let Some(c) = edit.apply(&mut edited, tokens) else {
            continue;
        };
        let after = render(&edited)?;
        let freed = tokens.saturating_sub(after);
        if c.at_least.is_some_and(|min| freed < min) {
            continue;
        }
        let mut report = c.report;
        report["cleared_input_tokens"] = json!(freed);
        applied.push(report);
        *messages = edited;
        tokens = after;
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: Value) -> Vec<MessageIn> {
        serde_json::from_value(v).unwrap()
    }

    /// A conversation of three tool uses (`read` a, `bash` b, `read` c), each answered.
    fn three_uses() -> Vec<MessageIn> {
        msgs(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t1", "signature": "s"},
                {"type": "tool_use", "id": "a", "name": "read", "input": {"p": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "AAAA"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t2", "signature": "s"},
                {"type": "tool_use", "id": "b", "name": "bash", "input": {"c": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "BBBB"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "c", "name": "read", "input": {"p": "y"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "CCCC"}]},
        ]))
    }

    fn result_text(m: &MessageIn) -> String {
        match &m.content {
            Content::Blocks(b) => match &b[0].content {
                Some(Content::Text(t)) => t.clone(),
                _ => String::new(),
            },
            Content::Text(t) => t.clone(),
        }
    }

    /// The prompt "length" of the tests: the bytes of every text, result and input.
    fn size(ms: &[MessageIn]) -> Result<u64, ApiError> {
        Ok(ms
            .iter()
            .flat_map(|m| blocks(m).cloned().collect::<Vec<_>>())
            .map(|b| {
                let c = match &b.content {
                    Some(Content::Text(t)) => t.len(),
                    _ => 0,
                };
                c + b.input.map_or(0, |i| i.to_string().len())
            })
            .sum::<usize>() as u64)
    }

    #[test]
    fn claude_codes_edit_parses_and_keeps_all_thinking() {
        let edits =
            parse(&json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})).unwrap();
        assert_eq!(edits, vec![Edit::ClearThinking { keep: None }]);
        let mut m = three_uses();
        assert_eq!(
            apply_all(&edits, &mut m, size).unwrap(),
            Vec::<Value>::new()
        );
        assert_eq!(m.len(), 7);
    }

    #[test]
    fn clear_thinking_keeps_the_last_turns() {
        let edits = parse(&json!({"edits": [{"type": "clear_thinking_20251015"}]})).unwrap();
        let mut m = three_uses();
        let applied = apply_all(&edits, &mut m, size).unwrap();
        // Two assistant turns think; the default keeps the last one.
        assert_eq!(
            applied,
            vec![
                json!({"type": "clear_thinking_20251015", "cleared_thinking_turns": 1, "cleared_input_tokens": 0})
            ]
        );
        assert_eq!(blocks(&m[1]).count(), 1);
        assert_eq!(blocks(&m[3]).count(), 2);
    }

    #[test]
    fn clear_tool_uses_clears_old_results_past_the_trigger() {
        let edit = |extra: Value| {
            let mut e = json!({"type": "clear_tool_uses_20250919",
                "trigger": {"type": "input_tokens", "value": 30},
                "keep": {"type": "tool_uses", "value": 1}});
            for (k, v) in extra.as_object().unwrap() {
                e[k] = v.clone();
            }
            parse(&json!({"edits": [e]})).unwrap()
        };
        // Size: results 3 x 4 bytes + inputs {"p":"x"} 9 + {"c":"ls"} 10 + {"p":"y"} 9 = 40.
        assert_eq!(size(&three_uses()).unwrap(), 40);
        let mut m = three_uses();
        let applied = apply_all(&edit(json!({})), &mut m, size).unwrap();
        // a and b cleared: each result grows from 4 to 37 bytes, so "freed" saturates at 0.
        assert_eq!(
            applied,
            vec![
                json!({"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2, "cleared_input_tokens": 0})
            ]
        );
        assert_eq!(result_text(&m[2]), CLEARED_TOOL_RESULT);
        assert_eq!(result_text(&m[4]), CLEARED_TOOL_RESULT);
        assert_eq!(result_text(&m[6]), "CCCC");
        // Excluding bash and clearing inputs: only a, its input emptied too.
        let mut m = three_uses();
        let e = edit(json!({"exclude_tools": ["bash"], "clear_tool_inputs": true}));
        let applied = apply_all(&e, &mut m, size).unwrap();
        assert_eq!(applied[0]["cleared_tool_uses"], 1);
        assert_eq!(result_text(&m[4]), "BBBB");
        let input = blocks(&m[1]).nth(1).and_then(|b| b.input.clone());
        assert_eq!(input, Some(json!({})));
        // clear_at_least more than the edit frees: not applied, nothing changed.
        let mut m = three_uses();
        let e = edit(json!({"clear_at_least": {"type": "input_tokens", "value": 1}}));
        assert!(apply_all(&e, &mut m, size).unwrap().is_empty());
        assert_eq!(result_text(&m[2]), "AAAA");
        // Under the trigger: nothing.
        let mut m = three_uses();
        let e = parse(&json!({"edits": [{"type": "clear_tool_uses_20250919"}]})).unwrap();
        assert!(apply_all(&e, &mut m, size).unwrap().is_empty());
        // A tool-use trigger: 3 uses > 2, the default keep of 3 leaves nothing to clear.
        let e = parse(&json!({"edits": [{"type": "clear_tool_uses_20250919",
            "trigger": {"type": "tool_uses", "value": 2}}]}))
        .unwrap();
        assert!(apply_all(&e, &mut m, size).unwrap().is_empty());
    }

    #[test]
    fn freed_tokens_are_the_prompt_difference() {
        // Long results: clearing frees what the placeholder does not take back.
        let mut m = three_uses();
        for i in [2, 4, 6] {
            if let Content::Blocks(b) = &mut m[i].content {
                b[0].content = Some(Content::Text("x".repeat(100)));
            }
        }
        let e = parse(&json!({"edits": [{"type": "clear_tool_uses_20250919",
            "trigger": {"type": "input_tokens", "value": 0},
            "keep": {"type": "tool_uses", "value": 0},
            "clear_at_least": {"type": "input_tokens", "value": 189}}]}))
        .unwrap();
        let applied = apply_all(&e, &mut m, size).unwrap();
        // 3 x (100 - 37) = 189 freed.
        assert_eq!(applied[0]["cleared_input_tokens"], 189);
        assert_eq!(applied[0]["cleared_tool_uses"], 3);
    }

    #[test]
    fn malformed_edits_are_400s() {
        for bad in [
            json!([]),
            json!({"edits": {}}),
            json!({"edits": [{"type": "clear_everything"}]}),
            json!({"edits": [{"type": "clear_tool_uses_20250919", "keep": 3}]}),
            json!({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "turns", "value": 1}}]}),
            json!({"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "bash"}]}),
            json!({"edits": [{"type": "clear_thinking_20251015", "keep": "some"}]}),
            json!({"edits": [], "other": 1}),
        ] {
            let e = parse(&bad).unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
