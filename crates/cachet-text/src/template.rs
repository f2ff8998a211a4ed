//! Chat templates: the Jinja template a GGUF carries in `tokenizer.chat_template` (an HF
//! `tokenizer_config.json` template), rendered with `minijinja` the way transformers renders it.
//!
//! What a template sees, as transformers' `apply_chat_template` hands it:
//! * `messages`: one map per [`ChatMessage`] (see [`crate::message`] for each field);
//! * `tools`: the OpenAI tool list (`[{"type": "function", "function": {name, description,
//!   parameters}}]`) or `none`; `documents`: `none`;
//! * `add_generation_prompt`, `bos_token`, `eos_token`;
//! * any `chat_template_kwargs` the request adds (e.g. `enable_thinking`); they never replace the
//!   variables above.
//!
//! The environment matches transformers': `trim_blocks`, `lstrip_blocks`, `{% break %}` /
//! `{% continue %}`, Python string/dict methods (`minijinja-contrib` pycompat),
//! `raise_exception(msg)` (a [`TemplateError::Raised`]: the template rejects the conversation),
//! `strftime_now(fmt)` (UTC), and a `tojson` that writes what Python's `json.dumps` writes
//! (`", "` and `": "` separators, non-ASCII kept, no HTML escaping; `indent`, `separators`,
//! `ensure_ascii` and `sort_keys` honoured).
//!
//! Maps keep insertion order; JSON handed in as `serde_json::Value` arrives with its object keys
//! in alphabetical order (serde_json's map), except that the keys of each tool and its
//! `function` come first in OpenAI's order (`type`, `function`; `name`, `description`,
//! `parameters`).
//!
//! Bounds: a template source of at most [`MAX_TEMPLATE_BYTES`], [`TEMPLATE_FUEL`] instructions
//! and [`TEMPLATE_RECURSION_LIMIT`] nested calls per render, and at most [`MAX_RENDERED_BYTES`]
//! of output. Every failure, including a panic inside the template engine, is a
//! [`TemplateError`].

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind, State};
use thiserror::Error;

use crate::message::{ChatMessage, Role, ToolCall};

/// ChatML, used when a model has no chat template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Largest template source accepted (real templates are 1-20 KiB).
pub const MAX_TEMPLATE_BYTES: usize = 256 * 1024;

/// Instructions one render may execute. A Qwen2.5-style template spends about 30 per plain
/// message and 160 per tool-calling turn (call, result, answer; measured by the
/// `fuel_per_message_is_small` test), so this admits some 30,000 such turns while bounding a
/// render's time (about 0.2 s for a template that only spins, on the 2-core dev VM).
pub const TEMPLATE_FUEL: u64 = 5_000_000;

/// Nested macro calls and includes one render may make (minijinja's own cap is 500).
pub const TEMPLATE_RECURSION_LIMIT: usize = 100;

/// Largest rendered prompt (the server's default body limit is 16 MiB).
pub const MAX_RENDERED_BYTES: usize = 64 * 1024 * 1024;

/// The template variable that carries the render's clock to `strftime_now`.
const NOW_VAR: &str = "__cachet_now_unix";

/// Names a request's `chat_template_kwargs` may not replace.
const RESERVED: &[&str] = &[
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    NOW_VAR,
];

/// Why a template could not be compiled or rendered.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TemplateError {
    #[error("chat template is {len} bytes; the limit is {max}")]
    TooLarge { len: usize, max: usize },
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception`: it rejects this conversation (e.g. roles that do
    /// not alternate). A client error.
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    #[error("chat template exceeded its budget of {max} instructions")]
    OutOfFuel { max: u64 },
    #[error("rendered chat is larger than {max} bytes")]
    OutputTooLarge { max: usize },
    #[error("chat template failed: {0}")]
    Render(String),
    #[error("chat template engine panicked: {0}")]
    Panicked(String),
}

/// What a chat template renders by itself, found by rendering probe conversations once at
/// compile time. Where a capability is missing the server renders that part in its generic
/// tool format instead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TemplateCaps {
    /// The `tools` list reaches the prompt (a probe tool's name appears in the output).
    pub renders_tools: bool,
    /// Assistant `tool_calls` in the history reach the prompt.
    pub renders_tool_calls: bool,
}

/// One render: the conversation and everything else the template may read.
#[derive(Clone, Copy, Debug)]
pub struct ChatRequest<'a> {
    pub messages: &'a [ChatMessage],
    /// OpenAI tool definitions; `None` or empty renders as `tools = none`.
    pub tools: Option<&'a [serde_json::Value]>,
    pub add_generation_prompt: bool,
    /// Extra template variables (vLLM's `chat_template_kwargs`).
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
    /// The time `strftime_now` reports; `None` is now.
    pub now: Option<SystemTime>,
}

impl<'a> ChatRequest<'a> {
    pub fn new(messages: &'a [ChatMessage], add_generation_prompt: bool) -> Self {
        ChatRequest {
            messages,
            tools: None,
            add_generation_prompt,
            kwargs: None,
            now: None,
        }
    }

    pub fn with_tools(mut self, tools: &'a [serde_json::Value]) -> Self {
        self.tools = Some(tools);
        self
    }

    pub fn with_kwargs(mut self, kwargs: &'a serde_json::Map<String, serde_json::Value>) -> Self {
        self.kwargs = Some(kwargs);
        self
    }

    pub fn at(mut self, now: SystemTime) -> Self {
        self.now = Some(now);
        self
    }
}

/// A compiled chat template with its special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    caps: TemplateCaps,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";
const PROBE_TOOL: &str = "cachet_probe_tool_7f3a";
const PROBE_CALL: &str = "cachet_probe_call_51c9";
const PROBE_CALL_ID: &str = "c4ch3tpr0";

/// Marks an error raised by the template's own `raise_exception`.
#[derive(Debug, Error)]
#[error("raised by the template")]
struct RaisedByTemplate;

impl ChatTemplate {
    /// Compiles `source` (`None`: [`CHATML_TEMPLATE`]) and probes what it renders.
    pub fn new(
        source: Option<&str>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TemplateError> {
        let source = source.unwrap_or(CHATML_TEMPLATE);
        if source.len() > MAX_TEMPLATE_BYTES {
            return Err(TemplateError::TooLarge {
                len: source.len(),
                max: MAX_TEMPLATE_BYTES,
            });
        }
        let env = guard(|| build_env(source))?;
        let mut t = ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            caps: TemplateCaps::default(),
        };
        t.caps = t.probe();
        Ok(t)
    }

    /// ChatML with no special tokens.
    pub fn chatml() -> Self {
        // ChatML compiles: a failure here is a bug in the constant, caught by the tests.
        Self::new(None, "", "").unwrap_or_else(|_| ChatTemplate {
            env: Environment::new(),
            bos_token: String::new(),
            eos_token: String::new(),
            caps: TemplateCaps::default(),
        })
    }

    pub fn caps(&self) -> TemplateCaps {
        self.caps
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders one chat.
    pub fn render(&self, req: &ChatRequest<'_>) -> Result<String, TemplateError> {
        self.render_counted(req).map(|(s, _)| s)
    }

    /// Renders one chat and reports the fuel (instructions) it used.
    pub fn render_counted(&self, req: &ChatRequest<'_>) -> Result<(String, u64), TemplateError> {
        let ctx = self.context(req);
        guard(|| {
            let tpl = self
                .env
                .get_template(TEMPLATE_NAME)
                .map_err(|e| TemplateError::Render(format!("{e:#}")))?;
            let mut out = CappedWriter {
                buf: Vec::new(),
                max: MAX_RENDERED_BYTES,
                overflowed: false,
            };
            let used = match tpl.render_captured_to(ctx, &mut out) {
                Ok(captured) => captured
                    .state()
                    .fuel_levels()
                    .map(|(used, _)| used)
                    .unwrap_or(0),
                Err(e) => return Err(classify(&e, out.overflowed)),
            };
            let text = String::from_utf8(out.buf)
                .map_err(|_| TemplateError::Render("output is not UTF-8".into()))?;
            Ok((text, used))
        })
    }

    fn context(&self, req: &ChatRequest<'_>) -> Value {
        let messages: Vec<Value> = req.messages.iter().map(message_value).collect();
        let tools = match req.tools {
            Some(t) if !t.is_empty() => Value::from(t.iter().map(tool_value).collect::<Vec<_>>()),
            _ => Value::from(()),
        };
        let now = match req
            .now
            .unwrap_or_else(SystemTime::now)
            .duration_since(UNIX_EPOCH)
        {
            Ok(d) => d.as_secs() as i64,
            Err(before) => -(before.duration().as_secs_f64().ceil() as i64),
        };
        let mut vars: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(messages)),
            ("tools".into(), tools),
            ("documents".into(), Value::from(())),
            (
                "add_generation_prompt".into(),
                Value::from(req.add_generation_prompt),
            ),
            ("bos_token".into(), Value::from(self.bos_token.as_str())),
            ("eos_token".into(), Value::from(self.eos_token.as_str())),
            (NOW_VAR.into(), Value::from(now)),
        ];
        if let Some(kw) = req.kwargs {
            for (k, v) in kw {
                if !RESERVED.contains(&k.as_str()) {
                    vars.push((k.clone(), Value::from_serialize(v)));
                }
            }
        }
        Value::from_iter(vars)
    }

    /// Renders probe conversations to learn what the template renders itself.
    fn probe(&self) -> TemplateCaps {
        let tools = [serde_json::json!({
            "type": "function",
            "function": {
                "name": PROBE_TOOL,
                "description": "probe",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}
            }
        })];
        let user = [ChatMessage::user("probe")];
        let renders_tools = self
            .render(&ChatRequest::new(&user, true).with_tools(&tools))
            .map(|s| s.contains(PROBE_TOOL))
            .unwrap_or(false);
        // Nine alphanumerics: Mistral's templates reject any other tool call id.
        let call = ToolCall::function(PROBE_CALL_ID, PROBE_CALL, r#"{"x": "y"}"#);
        let with_result = [
            ChatMessage::user("probe"),
            ChatMessage::assistant_tool_calls("", vec![call.clone()]),
            ChatMessage::tool(PROBE_CALL_ID, "done"),
        ];
        let call_only = [
            ChatMessage::user("probe"),
            ChatMessage::assistant_tool_calls("", vec![call]),
        ];
        let renders_tool_calls = [&with_result[..], &call_only[..]].iter().any(|msgs| {
            self.render(&ChatRequest::new(msgs, false).with_tools(&tools))
                .map(|s| s.contains(PROBE_CALL))
                .unwrap_or(false)
        });
        TemplateCaps {
            renders_tools,
            renders_tool_calls,
        }
    }
}

/// Runs `f`, turning a panic inside the template engine into an error.
fn guard<T>(f: impl FnOnce() -> Result<T, TemplateError>) -> Result<T, TemplateError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(TemplateError::Panicked(msg))
    })
}

fn classify(e: &minijinja::Error, overflowed: bool) -> TemplateError {
    if overflowed {
        return TemplateError::OutputTooLarge {
            max: MAX_RENDERED_BYTES,
        };
    }
    if e.kind() == ErrorKind::OutOfFuel {
        return TemplateError::OutOfFuel { max: TEMPLATE_FUEL };
    }
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if s.is::<RaisedByTemplate>() {
            return TemplateError::Raised(e.detail().unwrap_or("").to_string());
        }
        if let Some(m) = s.downcast_ref::<minijinja::Error>() {
            if m.kind() == ErrorKind::OutOfFuel {
                return TemplateError::OutOfFuel { max: TEMPLATE_FUEL };
            }
        }
        src = s.source();
    }
    TemplateError::Render(format!("{e:#}"))
}

struct CappedWriter {
    buf: Vec<u8>,
    max: usize,
    overflowed: bool,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > self.max {
            self.overflowed = true;
            return Err(io::Error::other("rendered chat too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn build_env(source: &str) -> Result<Environment<'static>, TemplateError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function(
        "raise_exception",
        |msg: Option<String>| -> Result<Value, minijinja::Error> {
            Err(
                minijinja::Error::new(ErrorKind::InvalidOperation, msg.unwrap_or_default())
                    .with_source(RaisedByTemplate),
            )
        },
    );
    env.add_function("strftime_now", |state: &State, fmt: String| -> String {
        let now = state
            .lookup(NOW_VAR)
            .and_then(|v| i64::try_from(v).ok())
            .unwrap_or(0);
        strftime(&fmt, now)
    });
    env.add_template_owned(TEMPLATE_NAME, source.to_string())
        .map_err(|e| TemplateError::Syntax(format!("{e:#}")))?;
    Ok(env)
}

/// A message as the map HF templates read.
fn message_value(m: &ChatMessage) -> Value {
    let mut fields: Vec<(&str, Value)> = vec![
        ("role", Value::from(m.role.template_name())),
        ("content", Value::from(m.content.as_str())),
    ];
    if let Some(n) = &m.name {
        fields.push(("name", Value::from(n.as_str())));
    }
    if m.role == Role::Assistant && !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m.tool_calls.iter().map(tool_call_value).collect();
        fields.push(("tool_calls", Value::from(calls)));
    }
    if let Some(id) = &m.tool_call_id {
        fields.push(("tool_call_id", Value::from(id.as_str())));
    }
    Value::from_iter(fields)
}

/// `{id, type, function: {name, arguments}}` with `arguments` parsed when it holds a JSON
/// object (what transformers' templates expect), else the string as sent.
fn tool_call_value(c: &ToolCall) -> Value {
    let args = match serde_json::from_str::<serde_json::Value>(&c.function.arguments) {
        Ok(v @ serde_json::Value::Object(_)) => Value::from_serialize(&v),
        _ => Value::from(c.function.arguments.as_str()),
    };
    let function = Value::from_iter([
        ("name", Value::from(c.function.name.as_str())),
        ("arguments", args),
    ]);
    Value::from_iter([
        ("id", Value::from(c.id.as_str())),
        ("type", Value::from("function")),
        ("function", function),
    ])
}

/// A tool definition with its wrapper keys in OpenAI's order.
fn tool_value(t: &serde_json::Value) -> Value {
    fn ordered(
        map: &serde_json::Map<String, serde_json::Value>,
        first: &[&str],
    ) -> Vec<(String, Value)> {
        let mut out: Vec<(String, Value)> = Vec::with_capacity(map.len());
        for k in first {
            if let Some(v) = map.get(*k) {
                out.push((k.to_string(), Value::from_serialize(v)));
            }
        }
        for (k, v) in map {
            if !first.contains(&k.as_str()) {
                out.push((k.clone(), Value::from_serialize(v)));
            }
        }
        out
    }
    let Some(obj) = t.as_object() else {
        return Value::from_serialize(t);
    };
    let mut top = ordered(obj, &["type", "function"]);
    if let Some(serde_json::Value::Object(f)) = obj.get("function") {
        let f = Value::from_iter(ordered(f, &["name", "description", "parameters"]));
        for (k, v) in top.iter_mut() {
            if k == "function" {
                *v = f.clone();
            }
        }
    }
    Value::from_iter(top)
}

/// Python's `json.dumps` (as transformers' `tojson` calls it).
fn tojson(value: &Value, pos: Option<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let bad = |msg: &str| minijinja::Error::new(ErrorKind::InvalidOperation, msg.to_string());
    let mut ensure_ascii = false;
    let mut indent: Option<Vec<u8>> = None;
    let indent_of = |v: &Value| -> Result<Option<Vec<u8>>, minijinja::Error> {
        if v.is_none() || v.is_undefined() {
            Ok(None)
        } else if let Some(s) = v.as_str() {
            Ok(Some(s.as_bytes().to_vec()))
        } else if let Ok(n) = i64::try_from(v.clone()) {
            Ok(Some(vec![b' '; n.clamp(0, 64) as usize]))
        } else {
            Err(bad("tojson: indent must be an integer or a string"))
        }
    };
    // transformers' tojson takes `ensure_ascii` first, Jinja's takes `indent`: tell by type.
    if let Some(p) = &pos {
        if p.kind() == minijinja::value::ValueKind::Bool {
            ensure_ascii = p.is_true();
        } else {
            indent = indent_of(p)?;
        }
    }
    if let Some(v) = kwargs.get::<Option<Value>>("indent")? {
        indent = indent_of(&v)?;
    }
    if let Some(b) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        ensure_ascii = b;
    }
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (mut item_sep, key_sep) = if indent.is_some() {
        (b",".to_vec(), b": ".to_vec())
    } else {
        (b", ".to_vec(), b": ".to_vec())
    };
    let mut key_sep = key_sep;
    if let Some(seps) = separators.filter(|s| !s.is_none() && !s.is_undefined()) {
        let items: Vec<Value> = seps
            .try_iter()
            .map_err(|_| bad("tojson: separators must be a pair of strings"))?
            .collect();
        match items.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                item_sep = a.as_str().unwrap_or_default().as_bytes().to_vec();
                key_sep = b.as_str().unwrap_or_default().as_bytes().to_vec();
            }
            _ => return Err(bad("tojson: separators must be a pair of strings")),
        }
    }
    let fmt = PyFormatter {
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        level: 0,
        has_value: false,
    };
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    let res = if sort_keys {
        let mut v = serde_json::to_value(value).map_err(|e| bad(&format!("tojson: {e}")))?;
        sort_json(&mut v);
        serde::Serialize::serialize(&v, &mut ser)
    } else {
        serde::Serialize::serialize(value, &mut ser)
    };
    res.map_err(|e| bad(&format!("tojson: {e}")))?;
    let s = String::from_utf8(out).map_err(|_| bad("tojson: output is not UTF-8"))?;
    Ok(Value::from_safe_string(s))
}

fn sort_json(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            let mut entries: Vec<(String, serde_json::Value)> =
                std::mem::take(m).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut v) in entries {
                sort_json(&mut v);
                m.insert(k, v);
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(sort_json),
        _ => {}
    }
}

/// serde_json formatting that matches Python's `json.dumps`.
struct PyFormatter {
    indent: Option<Vec<u8>>,
    item_sep: Vec<u8>,
    key_sep: Vec<u8>,
    ensure_ascii: bool,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn newline<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(ind) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(ind)?;
            }
        }
        Ok(())
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b"]")
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if !first {
            w.write_all(&self.item_sep)?;
        }
        self.newline(w)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b"}")
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if !first {
            w.write_all(&self.item_sep)?;
        }
        self.newline(w)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(&self.key_sep)
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if !self.ensure_ascii {
            return w.write_all(fragment.as_bytes());
        }
        for ch in fragment.chars() {
            if (' '..='~').contains(&ch) {
                w.write_all(&[ch as u8])?;
            } else {
                let mut units = [0u16; 2];
                for u in ch.encode_utf16(&mut units) {
                    write!(w, "\\u{:04x}", u)?;
                }
            }
        }
        Ok(())
    }
}

/// Python's `strftime` for the specifiers chat templates use, in UTC (`%d %b %Y` and the like;
/// `%-d` without padding). Unknown specifiers are kept as written.
pub fn strftime(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let wd = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let (hh, mm, ss) = (secs / 3600, secs % 3600 / 60, secs % 60);
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut it = fmt.chars().peekable();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = it.peek() == Some(&'-');
        if unpadded {
            it.next();
        }
        let num = |n: i64, w: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0w$}")
            }
        };
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(m as i64, 2)),
            Some('d') => out.push_str(&num(d as i64, 2)),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('H') => out.push_str(&num(hh, 2)),
            Some('M') => out.push_str(&num(mm, 2)),
            Some('S') => out.push_str(&num(ss, 2)),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[wd]),
            Some('a') => out.push_str(&DAYS[wd][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month, day) to days since 1970-01-01.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
