//! Tool calls in model output: the formats of the families cachet serves, and one streaming
//! parser for all of them.
//!
//! | [`ToolFormat`] | a call looks like | models |
//! |---|---|---|
//! | `Hermes` | `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` (one block per call) | Qwen2.5, Qwen3, Hermes 2/3 |
//! | `Llama3Json` | `{"name": "f", "parameters": {...}}` at the start of the answer (optionally after `<\|python_tag\|>`), several joined by `;` | Llama 3.1-3.3 |
//! | `Mistral` | `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` | Mistral, Mixtral |
//! | `Generic` | the Hermes block, described to the model by the server's own tool prompt | any model whose template renders no tools |
//!
//! [`ToolCallParser`] takes text deltas and returns [`ToolEvent`]s: content (text outside every
//! call, never a partial marker), a call's start once its `name` is known, then its arguments
//! as they arrive (the raw JSON text of the `arguments` / `parameters` value, so the pieces
//! concatenate to it exactly), then its end. A block that holds no call (no `name`) is given
//! back as content. [`parse_tool_calls`] runs the parser over a whole text.

mod json;

pub use json::CallScanner;

/// A family's tool-call syntax (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
    Generic,
}

impl ToolFormat {
    /// The name `--tool-call-parser` takes (vLLM's names where it has one).
    pub fn as_str(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Generic => "generic",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "hermes" => ToolFormat::Hermes,
            "llama3_json" | "llama3" => ToolFormat::Llama3Json,
            "mistral" => ToolFormat::Mistral,
            "generic" => ToolFormat::Generic,
            _ => return None,
        })
    }

    /// The format a template uses, from what it rendered for a conversation with a tool call
    /// (`None` when it rendered none: use [`ToolFormat::Generic`]).
    pub fn detect(rendered_call: &str) -> Option<Self> {
        if rendered_call.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if rendered_call.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if rendered_call.contains("<|python_tag|>")
            || rendered_call.contains("\"parameters\"")
            || rendered_call.contains("<|eom_id|>")
        {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The key a call's arguments are written under.
    pub fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        }
    }

    /// The text that opens a call (`None`: a call opens with its JSON object).
    pub fn start_marker(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Generic => Some("<tool_call>"),
            ToolFormat::Mistral => Some("[TOOL_CALLS]"),
            ToolFormat::Llama3Json => Some("<|python_tag|>"),
        }
    }

    fn end_marker(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Generic => Some("</tool_call>"),
            _ => None,
        }
    }

    /// One call written in this format (what a grammar forces and what a template without
    /// tool-call support is shown in the history).
    pub fn render_call(self, name: &str, arguments_json: &str) -> String {
        let name = serde_json::Value::String(name.to_string());
        let key = self.arguments_key();
        let obj = format!("{{\"name\": {name}, \"{key}\": {arguments_json}}}");
        match self {
            ToolFormat::Hermes | ToolFormat::Generic => format!("<tool_call>\n{obj}\n</tool_call>"),
            ToolFormat::Mistral => format!("[TOOL_CALLS][{obj}]"),
            ToolFormat::Llama3Json => obj,
        }
    }
}

/// What the parser found in a delta.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside every call.
    Content(String),
    /// Call `index` (0, 1, ...) named `name` begins.
    Start { index: usize, name: String },
    /// More of call `index`'s arguments JSON.
    Arguments { index: usize, text: String },
    /// Call `index` is complete.
    End { index: usize },
}

/// A whole parsed call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text (`{}` when the model wrote none).
    pub arguments: String,
}

#[derive(Debug)]
enum Mode {
    /// Outside calls; `pending` may be the start of a marker.
    Text,
    /// Inside a call block: scanning JSON objects.
    Call(CallScanner),
    /// After a call's JSON: waiting for the end marker, a separator or another call.
    Between,
}

/// The streaming parser (see the module documentation).
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    mode: Mode,
    /// Text not yet classified (a partial marker, or a call's JSON before its name).
    pending: String,
    /// Only whitespace has been seen so far (a Llama 3 call must open the answer).
    at_start: bool,
    /// Inside a Mistral `[...]` list.
    in_list: bool,
    next_index: usize,
    /// The raw text of the current block, given back as content if it holds no call.
    block_raw: String,
    /// Non-whitespace content emitted, or calls seen.
    calls: usize,
}

impl ToolCallParser {
    pub fn new(format: ToolFormat) -> Self {
        ToolCallParser {
            format,
            mode: Mode::Text,
            pending: String::new(),
            at_start: true,
            in_list: false,
            next_index: 0,
            block_raw: String::new(),
            calls: 0,
        }
    }

    /// Calls started so far.
    pub fn num_calls(&self) -> usize {
        self.next_index
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        self.pending.push_str(text);
        self.run(&mut out, false);
        out
    }

    /// The end of the output: whatever is held is resolved (a partial marker is content; an
    /// unfinished call ends with the arguments it has).
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        self.run(&mut out, true);
        match std::mem::replace(&mut self.mode, Mode::Text) {
            Mode::Call(sc) => self.close_call(sc, &mut out, true),
            Mode::Between | Mode::Text => {}
        }
        let rest = std::mem::take(&mut self.pending);
        if !rest.is_empty() {
            self.content(rest, &mut out);
        }
        out
    }

    fn content(&mut self, s: String, out: &mut Vec<ToolEvent>) {
        if s.is_empty() {
            return;
        }
        // Whitespace around calls is layout, not content.
        if self.next_index > 0 && s.trim().is_empty() {
            return;
        }
        if let Some(ToolEvent::Content(prev)) = out.last_mut() {
            prev.push_str(&s);
        } else {
            out.push(ToolEvent::Content(s));
        }
    }

    fn run(&mut self, out: &mut Vec<ToolEvent>, eof: bool) {
        loop {
            match &mut self.mode {
                Mode::Text => {
                    if !self.text_step(out, eof) {
                        return;
                    }
                }
                Mode::Call(_) => {
                    if !self.call_step(out) {
                        return;
                    }
                }
                Mode::Between => {
                    if !self.between_step(eof) {
                        return;
                    }
                }
            }
        }
    }

    /// Returns whether the mode changed (run again).
    fn text_step(&mut self, out: &mut Vec<ToolEvent>, eof: bool) -> bool {
        let marker = self.format.start_marker();
        if self.format == ToolFormat::Llama3Json && self.at_start {
            let trimmed = self.pending.trim_start();
            if trimmed.starts_with('{') {
                let skip = self.pending.len() - trimmed.len();
                self.pending.drain(..skip);
                self.open_block();
                return true;
            }
        }
        if let Some(m) = marker {
            if let Some(pos) = self.pending.find(m) {
                let before: String = self.pending.drain(..pos).collect();
                self.pending.drain(..m.len());
                self.emit_text(before, out);
                if self.format == ToolFormat::Mistral {
                    self.mode = Mode::Between;
                    self.in_list = false;
                } else if self.format == ToolFormat::Llama3Json {
                    let t = self.pending.trim_start().len();
                    let skip = self.pending.len() - t;
                    self.pending.drain(..skip);
                    self.mode = Mode::Between;
                } else {
                    self.open_block();
                }
                return true;
            }
            // Hold back the longest suffix that may begin the marker.
            let keep = if eof {
                0
            } else {
                partial_suffix(&self.pending, m)
            };
            let llama_hold = self.format == ToolFormat::Llama3Json
                && self.at_start
                && self.pending.trim().is_empty()
                && !eof;
            if llama_hold {
                return false;
            }
            let cut = self.pending.len() - keep;
            let emit: String = self.pending.drain(..cut).collect();
            self.emit_text(emit, out);
            return false;
        }
        let emit = std::mem::take(&mut self.pending);
        self.emit_text(emit, out);
        false
    }

    fn emit_text(&mut self, s: String, out: &mut Vec<ToolEvent>) {
        if !s.trim().is_empty() {
            self.at_start = false;
        }
        self.content(s, out);
    }

    fn open_block(&mut self) {
        self.at_start = false;
        self.block_raw.clear();
        self.mode = Mode::Call(CallScanner::new(self.format.arguments_key()));
    }

    fn call_step(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let Mode::Call(sc) = &mut self.mode else {
            return false;
        };
        let input = std::mem::take(&mut self.pending);
        let consumed = sc.feed(&input);
        self.block_raw.push_str(&input[..consumed]);
        let rest = input[consumed..].to_string();
        // Events: start once the name is known, then argument text.
        if sc.name().is_some() && !sc.started {
            sc.started = true;
            sc.index = self.next_index;
            self.next_index += 1;
            self.calls += 1;
            out.push(ToolEvent::Start {
                index: sc.index,
                name: sc.name().unwrap_or_default().to_string(),
            });
        }
        if sc.started {
            let args = sc.take_args();
            if !args.is_empty() {
                out.push(ToolEvent::Arguments {
                    index: sc.index,
                    text: args,
                });
            }
        }
        let done = sc.is_done();
        self.pending = rest;
        if done {
            if let Mode::Call(sc) = std::mem::replace(&mut self.mode, Mode::Between) {
                self.close_call(sc, out, false);
            }
            return true;
        }
        if sc.failed() {
            // Not JSON: the block is text.
            let raw = std::mem::take(&mut self.block_raw);
            let m = self.format.start_marker().unwrap_or_default();
            let text = if self.format == ToolFormat::Llama3Json {
                raw
            } else {
                format!("{m}{raw}")
            };
            self.mode = Mode::Text;
            self.content(text, out);
            return true;
        }
        false
    }

    fn close_call(&mut self, mut sc: CallScanner, out: &mut Vec<ToolEvent>, eof: bool) {
        if sc.started {
            let args = sc.finish_args();
            if !args.is_empty() {
                out.push(ToolEvent::Arguments {
                    index: sc.index,
                    text: args,
                });
            }
            out.push(ToolEvent::End { index: sc.index });
        } else {
            // No name: what was taken for a call is text.
            let raw = std::mem::take(&mut self.block_raw);
            let m = match self.format {
                ToolFormat::Hermes | ToolFormat::Generic => "<tool_call>",
                _ => "",
            };
            self.content(format!("{m}{raw}"), out);
        }
        if eof {
            self.mode = Mode::Text;
        }
    }

    /// After a call: skip layout, the end marker, `;`/`,` separators and list brackets; a new
    /// JSON object opens the next call; anything else goes back to text.
    fn between_step(&mut self, eof: bool) -> bool {
        let trimmed = self.pending.trim_start();
        let skip = self.pending.len() - trimmed.len();
        self.pending.drain(..skip);
        if self.pending.is_empty() {
            return false;
        }
        if let Some(end) = self.format.end_marker() {
            if self.pending.starts_with(end) {
                self.pending.drain(..end.len());
                self.mode = Mode::Text;
                return true;
            }
            if end.starts_with(self.pending.as_str()) {
                if eof {
                    // The output ended inside the call's end marker (`max_tokens`): the rest
                    // of the call's layout, not content.
                    self.pending.clear();
                }
                return false;
            }
        }
        let c = self.pending.chars().next().unwrap_or(' ');
        match (self.format, c) {
            (ToolFormat::Mistral, '[') if !self.in_list => {
                self.in_list = true;
                self.pending.drain(..1);
                true
            }
            (ToolFormat::Mistral, ']') if self.in_list => {
                self.in_list = false;
                self.pending.drain(..1);
                self.mode = Mode::Text;
                true
            }
            (ToolFormat::Mistral, ',') | (ToolFormat::Llama3Json, ';') => {
                self.pending.drain(..1);
                true
            }
            (ToolFormat::Mistral | ToolFormat::Llama3Json, '{') => {
                self.open_block();
                true
            }
            _ => {
                self.mode = Mode::Text;
                true
            }
        }
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    let max = marker.len().saturating_sub(1).min(s.len());
    (1..=max)
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && marker.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// Parses a whole output: (content, calls).
pub fn parse_tool_calls(format: ToolFormat, text: &str) -> (String, Vec<ParsedCall>) {
    let mut p = ToolCallParser::new(format);
    let mut events = p.push(text);
    events.extend(p.finish());
    collect(events)
}

/// Folds events into (content, calls).
pub fn collect(events: impl IntoIterator<Item = ToolEvent>) -> (String, Vec<ParsedCall>) {
    let mut content = String::new();
    let mut calls: Vec<ParsedCall> = Vec::new();
    for e in events {
        match e {
            ToolEvent::Content(s) => content.push_str(&s),
            ToolEvent::Start { name, .. } => calls.push(ParsedCall {
                name,
                arguments: String::new(),
            }),
            ToolEvent::Arguments { index, text } => {
                if let Some(c) = calls.get_mut(index) {
                    c.arguments.push_str(&text);
                }
            }
            ToolEvent::End { .. } => {}
        }
    }
    for c in &mut calls {
        if c.arguments.trim().is_empty() {
            c.arguments = "{}".into();
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests;
