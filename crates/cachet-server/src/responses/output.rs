//! A response's output items as the text arrives (a `reasoning` item with one `reasoning_text`
//! part when `--reasoning-parser` finds the model's reasoning, an assistant `message` with one
//! `output_text` part, `function_call` items), the stream events that open, grow and close
//! them, and the response object around them. The streamed and the collected answer are built
//! by the same [`Items`], so they cannot differ.

use cachet_text::{ReasoningParser, ToolCallParser, ToolEvent, ToolFormat};
use serde_json::{json, Value};

use crate::generate::{Final, StopKind};

use super::request::{function_call_id, message_id, reasoning_id};

/// An event of the stream before its `sequence_number`: (type, body without `type`).
pub type Ev = (&'static str, Value);

/// Which text item is open: the answer (`message`) or the model's reasoning.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TextKind {
    Message,
    Reasoning,
}

impl TextKind {
    /// (content part type, delta event, done event).
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            TextKind::Message => (
                "output_text",
                "response.output_text.delta",
                "response.output_text.done",
            ),
            TextKind::Reasoning => (
                "reasoning_text",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
            ),
        }
    }

    fn part(self, text: &str) -> Value {
        match self {
            TextKind::Message => {
                json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
            }
            TextKind::Reasoning => json!({"type": "reasoning_text", "text": text}),
        }
    }

    fn item(self, id: &str, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([self.part(text)])
        };
        match self {
            TextKind::Message => {
                json!({"id": id, "type": "message", "role": "assistant", "status": status, "content": content})
            }
            TextKind::Reasoning => {
                json!({"id": id, "type": "reasoning", "summary": [], "status": status, "content": content})
            }
        }
    }
}

enum Open {
    Text {
        kind: TextKind,
        id: String,
        index: usize,
        text: String,
    },
    Call {
        id: String,
        index: usize,
        call_id: String,
        name: String,
        args: String,
    },
}

/// The output items of one generation, built from its text deltas.
pub struct Items {
    /// `--reasoning-parser`, set up for the request's prompt.
    reasoning: Option<ReasoningParser>,
    /// Generated tokens whose text lay in the reasoning block (its tags included).
    pub reasoning_tokens: u64,
    /// `reasoning.summary` was asked for: the reasoning text is its own summary too (cachet
    /// writes no separate summary).
    summary: bool,
    parser: Option<ToolCallParser>,
    parallel: bool,
    open: Option<Open>,
    /// Whitespace outside calls not yet shown (it opens no message on its own).
    pending_space: String,
    /// The closed items, in order.
    pub output: Vec<Value>,
    /// Calls skipped because parallel calls are off.
    skipping: bool,
}

fn call_item(id: &str, call_id: &str, name: &str, args: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "call_id": call_id, "name": name, "arguments": args, "status": status})
}

impl Items {
    /// `parse`: the tool-call format when calls may appear; `parallel`: more than one call;
    /// `reasoning`: the reasoning parser, when one runs.
    pub fn new(
        parse: Option<ToolFormat>,
        parallel: bool,
        reasoning: Option<ReasoningParser>,
    ) -> Self {
        Items {
            reasoning,
            reasoning_tokens: 0,
            summary: false,
            parser: parse.map(ToolCallParser::new),
            parallel,
            open: None,
            pending_space: String::new(),
            output: Vec::new(),
            skipping: false,
        }
    }

    /// With a reasoning summary (`reasoning.summary` set): a reasoning item's text is also its
    /// one `summary_text` part, with the `response.reasoning_summary_*` events.
    pub fn with_summary(mut self, summary: bool) -> Self {
        self.summary = summary;
        self
    }

    /// Whether an open reasoning item also streams its summary.
    fn summarized(&self, kind: TextKind) -> bool {
        self.summary && kind == TextKind::Reasoning
    }

    /// The events for more text, the text of `tokens` generated tokens (`None`: the end of
    /// the text): the reasoning's first, then the answer's.
    pub fn push(&mut self, text: Option<&str>, tokens: usize) -> Vec<Ev> {
        let Some(r) = &mut self.reasoning else {
            return self.push_answer(text);
        };
        let d = match text {
            Some(t) => r.push_tokens(t, tokens),
            None => r.finish(),
        };
        self.reasoning_tokens += d.reasoning_tokens as u64;
        let mut out = Vec::new();
        if !d.reasoning.is_empty() {
            if !matches!(
                self.open,
                Some(Open::Text {
                    kind: TextKind::Reasoning,
                    ..
                })
            ) {
                self.close(&mut out);
                self.open_text(TextKind::Reasoning, &mut out);
            }
            self.append(&d.reasoning, &mut out);
        }
        if !d.content.is_empty() {
            out.extend(self.push_answer(Some(&d.content)));
        }
        if text.is_none() {
            out.extend(self.push_answer(None));
        }
        out
    }

    /// The events for more of the answer (`None`: its end).
    fn push_answer(&mut self, text: Option<&str>) -> Vec<Ev> {
        let evs = match (&mut self.parser, text) {
            (Some(p), Some(t)) => p.push(t),
            (Some(p), None) => p.finish(),
            (None, Some(t)) => vec![ToolEvent::Content(t.to_string())],
            (None, None) => Vec::new(),
        };
        let mut out = Vec::new();
        for e in evs {
            match e {
                ToolEvent::Content(t) => self.content(&t, &mut out),
                ToolEvent::Start { index, name } => {
                    self.skipping = index > 0 && !self.parallel;
                    if self.skipping {
                        continue;
                    }
                    self.pending_space.clear();
                    self.close(&mut out);
                    let (id, call_id) = (
                        function_call_id(),
                        crate::tools::new_call_id(ToolFormat::Generic),
                    );
                    let index = self.output.len();
                    out.push((
                        "response.output_item.added",
                        json!({"output_index": index, "item": call_item(&id, &call_id, &name, "", "in_progress")}),
                    ));
                    self.open = Some(Open::Call {
                        id,
                        index,
                        call_id,
                        name,
                        args: String::new(),
                    });
                }
                ToolEvent::Arguments { text, .. } => {
                    if self.skipping {
                        continue;
                    }
                    if let Some(Open::Call {
                        id, index, args, ..
                    }) = &mut self.open
                    {
                        args.push_str(&text);
                        out.push((
                            "response.function_call_arguments.delta",
                            json!({"item_id": id, "output_index": index, "delta": text}),
                        ));
                    }
                }
                ToolEvent::End { .. } => {
                    if !self.skipping {
                        self.close(&mut out);
                    }
                    self.skipping = false;
                }
            }
        }
        if text.is_none() {
            self.close(&mut out);
            if !self
                .output
                .iter()
                .any(|i| i["type"] == "message" || i["type"] == "function_call")
            {
                // No answer at all: one empty message (with the whitespace, if that was all).
                let t = std::mem::take(&mut self.pending_space);
                self.open_text(TextKind::Message, &mut out);
                self.append(&t, &mut out);
                self.close(&mut out);
            }
        }
        out
    }

    fn content(&mut self, t: &str, out: &mut Vec<Ev>) {
        if t.is_empty() {
            return;
        }
        if !matches!(
            self.open,
            Some(Open::Text {
                kind: TextKind::Message,
                ..
            })
        ) {
            if t.trim().is_empty() {
                self.pending_space.push_str(t);
                return;
            }
            self.close(out);
            self.open_text(TextKind::Message, out);
        }
        let t = format!("{}{t}", std::mem::take(&mut self.pending_space));
        self.append(&t, out);
    }

    fn open_text(&mut self, kind: TextKind, out: &mut Vec<Ev>) {
        let id = match kind {
            TextKind::Message => message_id(),
            TextKind::Reasoning => reasoning_id(),
        };
        let index = self.output.len();
        out.push((
            "response.output_item.added",
            json!({"output_index": index, "item": kind.item(&id, "", "in_progress")}),
        ));
        out.push((
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": kind.part("")}),
        ));
        if self.summarized(kind) {
            out.push((
                "response.reasoning_summary_part.added",
                json!({"item_id": id, "output_index": index, "summary_index": 0,
                       "part": {"type": "summary_text", "text": ""}}),
            ));
        }
        self.open = Some(Open::Text {
            kind,
            id,
            index,
            text: String::new(),
        });
    }

    fn append(&mut self, t: &str, out: &mut Vec<Ev>) {
        let summary = self.summary;
        if let (
            Some(Open::Text {
                kind,
                id,
                index,
                text,
            }),
            false,
        ) = (&mut self.open, t.is_empty())
        {
            text.push_str(t);
            let mut ev =
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t});
            if *kind == TextKind::Message {
                ev["logprobs"] = json!([]);
            }
            out.push((kind.names().1, ev));
            if summary && *kind == TextKind::Reasoning {
                out.push((
                    "response.reasoning_summary_text.delta",
                    json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": t}),
                ));
            }
        }
    }

    fn close(&mut self, out: &mut Vec<Ev>) {
        match self.open.take() {
            None => {}
            Some(Open::Text {
                kind,
                id,
                index,
                text,
            }) => {
                let mut done =
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
                if kind == TextKind::Message {
                    done["logprobs"] = json!([]);
                }
                out.push((kind.names().2, done));
                out.push((
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": kind.part(&text)}),
                ));
                let mut item = kind.item(&id, &text, "completed");
                if self.summarized(kind) {
                    let part = json!({"type": "summary_text", "text": text});
                    out.push((
                        "response.reasoning_summary_text.done",
                        json!({"item_id": id, "output_index": index, "summary_index": 0, "text": text}),
                    ));
                    out.push((
                        "response.reasoning_summary_part.done",
                        json!({"item_id": id, "output_index": index, "summary_index": 0, "part": part}),
                    ));
                    item["summary"] = json!([part]);
                }
                out.push((
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.output.push(item);
            }
            Some(Open::Call {
                id,
                index,
                call_id,
                name,
                args,
            }) => {
                out.push((
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "name": name, "arguments": args}),
                ));
                let item = call_item(&id, &call_id, &name, &args, "completed");
                out.push((
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.output.push(item);
            }
        }
    }
}

/// The response's `status` and what goes with it (`incomplete_details`, `error`), and the
/// event that ends its stream.
pub fn status(f: &Final) -> (&'static str, Value, Value, &'static str) {
    match (&f.error, &f.stop) {
        (Some(e), _) => (
            "failed",
            Value::Null,
            json!({"code": "server_error", "message": e.to_string()}),
            "response.failed",
        ),
        (None, StopKind::Length) => (
            "incomplete",
            json!({"reason": "max_output_tokens"}),
            Value::Null,
            "response.incomplete",
        ),
        (None, StopKind::Abort) => ("cancelled", Value::Null, Value::Null, "response.failed"),
        (None, StopKind::Error) => (
            "failed",
            Value::Null,
            json!({"code": "server_error", "message": "the request failed"}),
            "response.failed",
        ),
        (None, _) => ("completed", Value::Null, Value::Null, "response.completed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(evs: &[Ev]) -> Vec<&'static str> {
        evs.iter().map(|e| e.0).collect()
    }

    #[test]
    fn text_opens_one_message_and_closes_it_at_the_end() {
        let mut it = Items::new(None, true, None);
        let mut evs = it.push(Some("Hel"), 3);
        evs.extend(it.push(Some("lo"), 2));
        evs.extend(it.push(None, 0));
        assert_eq!(
            kinds(&evs),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(it.output.len(), 1);
        assert_eq!(it.output[0]["content"][0]["text"], "Hello");
        assert_eq!(evs[4].1["text"], "Hello");
    }

    #[test]
    fn calls_become_function_call_items() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
        for parallel in [true, false] {
            let mut it = Items::new(Some(ToolFormat::Generic), parallel, None);
            let mut evs = Vec::new();
            // Byte by byte: the stream's worst case.
            for c in text.chars() {
                evs.extend(it.push(Some(&c.to_string()), 1));
            }
            evs.extend(it.push(None, 0));
            let names: Vec<&str> = it
                .output
                .iter()
                .map(|i| i["name"].as_str().unwrap())
                .collect();
            assert_eq!(names, if parallel { vec!["f", "g"] } else { vec!["f"] });
            assert!(it.output.iter().all(|i| i["type"] == "function_call"));
            assert_eq!(it.output[0]["arguments"], "{\"x\": 1}");
            assert!(it.output[0]["call_id"]
                .as_str()
                .unwrap()
                .starts_with("call_"));
            let done: Vec<&Value> = evs
                .iter()
                .filter(|e| e.0 == "response.function_call_arguments.done")
                .map(|e| &e.1)
                .collect();
            assert_eq!(done.len(), names.len());
            assert_eq!(done[0]["arguments"], "{\"x\": 1}");
            // The deltas add up to the arguments.
            let deltas: String = evs
                .iter()
                .filter(|e| {
                    e.0 == "response.function_call_arguments.delta" && e.1["output_index"] == 0
                })
                .map(|e| e.1["delta"].as_str().unwrap())
                .collect();
            assert_eq!(deltas, "{\"x\": 1}");
        }
    }

    #[test]
    fn reasoning_is_its_own_item_before_the_answer() {
        let parser = ReasoningParser::new(cachet_text::ReasoningFormat::Qwen3, "<|assistant|>\n");
        let mut it = Items::new(None, true, Some(parser));
        let mut evs = Vec::new();
        // "<think>" and "</think>" split across deltas; one token per piece.
        for piece in ["<thi", "nk>ab", "c</th", "ink>\n\n", "Hi"] {
            evs.extend(it.push(Some(piece), 1));
        }
        evs.extend(it.push(None, 0));
        assert_eq!(
            kinds(&evs),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(
            it.output[0],
            json!({"id": it.output[0]["id"], "type": "reasoning", "summary": [], "status": "completed",
                   "content": [{"type": "reasoning_text", "text": "abc"}]})
        );
        assert!(it.output[0]["id"].as_str().unwrap().starts_with("rs_"));
        // As in chat completions, the answer keeps what follows the closing tag.
        assert_eq!(it.output[1]["content"][0]["text"], "\n\nHi");
        assert_eq!(
            evs[1].1["part"],
            json!({"type": "reasoning_text", "text": ""})
        );
        // The four pieces up to the closing tag are reasoning; "Hi" is not.
        assert_eq!(it.reasoning_tokens, 4);

        // Asked for a summary: the same text is its summary, with the summary events.
        let parser = ReasoningParser::new(cachet_text::ReasoningFormat::DeepSeekR1, "");
        let mut it = Items::new(None, true, Some(parser)).with_summary(true);
        let mut evs = it.push(Some("ab</think>Hi"), 3);
        evs.extend(it.push(None, 0));
        assert_eq!(
            kinds(&evs)[..8],
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_summary_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_summary_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.reasoning_summary_text.done",
            ]
        );
        assert_eq!(evs[8].0, "response.reasoning_summary_part.done");
        assert_eq!(
            evs[8].1["part"],
            json!({"type": "summary_text", "text": "ab"})
        );
        assert_eq!(
            it.output[0]["summary"],
            json!([{"type": "summary_text", "text": "ab"}])
        );
        assert_eq!(it.output[0]["content"][0]["text"], "ab");
        assert_eq!(it.output[1]["content"][0]["text"], "Hi");
    }

    #[test]
    fn nothing_is_one_empty_message() {
        let mut it = Items::new(Some(ToolFormat::Generic), true, None);
        let evs = it.push(None, 0);
        assert_eq!(evs.len(), 5);
        assert_eq!(it.output[0]["content"][0]["text"], "");
    }
}
