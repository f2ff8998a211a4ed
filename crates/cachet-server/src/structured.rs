//! Structured outputs: `response_format` (OpenAI), `output_format` (Anthropic), vLLM's
//! `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and the grammar of a
//! forced tool call, compiled by `cachet-grammar` into the request's
//! [`Constraint`](cachet_core::request::Constraint).
//!
//! The grammar compiler (token trie + llguidance's parser factory) is built once, on the
//! first request that needs it, off the async runtime.

use std::sync::{Arc, OnceLock};

use cachet_core::request::Constraint;
use cachet_grammar::{Grammar, GrammarCompiler, GrammarError};
use cachet_text::TextTokenizer;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;

/// The lazily built compiler of one tokenizer.
#[derive(Default)]
pub struct GrammarCell(OnceLock<Result<Arc<GrammarCompiler>, String>>);

impl GrammarCell {
    pub fn get(&self, tok: &Arc<dyn TextTokenizer>) -> Result<Arc<GrammarCompiler>, ApiError> {
        self.0
            .get_or_init(|| {
                let t0 = std::time::Instant::now();
                let r = GrammarCompiler::new(Arc::clone(tok))
                    .map(Arc::new)
                    .map_err(|e| e.to_string());
                tracing::info!(
                    elapsed_ms = t0.elapsed().as_secs_f64() * 1000.0,
                    ok = r.is_ok(),
                    "grammar compiler built"
                );
                r
            })
            .clone()
            .map_err(|e| ApiError::Internal(format!("constrained decoding is unavailable: {e}")))
    }
}

/// OpenAI `response_format`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaSpec },
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaSpec {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub schema: Option<Value>,
    /// Accepted: the schema is always enforced (strict or not).
    #[serde(default)]
    pub strict: Option<bool>,
}

impl ResponseFormat {
    /// The JSON schema the answer must follow (`None`: free text).
    pub fn schema(&self) -> Option<Value> {
        match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(json!({"type": "object"})),
            ResponseFormat::JsonSchema { json_schema } => Some(
                json_schema
                    .schema
                    .clone()
                    .unwrap_or_else(|| json!({"type": "object"})),
            ),
        }
    }
}

/// `response_format` from its JSON (a 400 naming the field when malformed).
pub fn parse_response_format(v: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| {
            ApiError::bad_param(
                "response_format",
                format!(
                    "Invalid `response_format`: {}",
                    crate::error::clip_quoted(&e.to_string())
                ),
            )
        }),
    }
}

/// vLLM's guided-decoding fields (at most one).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Guided {
    #[serde(default)]
    pub guided_json: Option<Value>,
    #[serde(default)]
    pub guided_regex: Option<String>,
    #[serde(default)]
    pub guided_choice: Option<Vec<String>>,
    #[serde(default)]
    pub guided_grammar: Option<String>,
}

impl Guided {
    /// The grammar they ask for (a 400 when more than one is set).
    pub fn grammar(&self) -> Result<Option<(Grammar, &'static str)>, ApiError> {
        let mut out: Vec<(Grammar, &'static str)> = Vec::new();
        if let Some(s) = &self.guided_json {
            let schema = match s {
                Value::String(t) => serde_json::from_str(t).map_err(|e| {
                    ApiError::bad_param("guided_json", format!("`guided_json` is not JSON: {e}"))
                })?,
                v => v.clone(),
            };
            out.push((Grammar::JsonSchema(schema), "guided_json"));
        }
        if let Some(r) = &self.guided_regex {
            out.push((Grammar::Regex(r.clone()), "guided_regex"));
        }
        if let Some(c) = &self.guided_choice {
            if c.is_empty() {
                return Err(ApiError::bad_param(
                    "guided_choice",
                    "`guided_choice` needs at least one choice.",
                ));
            }
            let alts: Vec<String> = c
                .iter()
                .map(|s| serde_json::to_string(s).unwrap_or_default())
                .collect();
            out.push((
                Grammar::Lark(format!("start: {}\n", alts.join(" | "))),
                "guided_choice",
            ));
        }
        if let Some(g) = &self.guided_grammar {
            out.push((Grammar::Lark(g.clone()), "guided_grammar"));
        }
        match out.len() {
            0 => Ok(None),
            1 => Ok(out.pop()),
            _ => Err(ApiError::bad_param(
                out[1].1,
                "Send at most one of guided_json, guided_regex, guided_choice and guided_grammar.",
            )),
        }
    }
}

/// Compiles `grammar` for this request; an unsupported schema feature is a 400 naming it (and
/// `param`).
pub async fn compile(
    cell: &Arc<GrammarCell>,
    tok: &Arc<dyn TextTokenizer>,
    grammar: Grammar,
    param: &'static str,
) -> Result<Constraint, ApiError> {
    let cell = Arc::clone(cell);
    let tok = Arc::clone(tok);
    let res = tokio::task::spawn_blocking(move || {
        let g = cell.get(&tok)?;
        g.compile(&grammar).map_err(|e| grammar_error(param, e))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("grammar compilation failed: {e}")))??;
    Ok(Constraint::new(res))
}

fn grammar_error(param: &str, e: GrammarError) -> ApiError {
    match e {
        GrammarError::Unsupported { feature } => ApiError::bad_param(
            param,
            format!(
                "The JSON schema uses a feature cachet cannot enforce: {}",
                crate::error::clip_quoted(&feature)
            ),
        ),
        GrammarError::Invalid(m) => ApiError::bad_param(
            param,
            format!(
                "Invalid schema or grammar: {}",
                crate::error::clip_quoted(&m)
            ),
        ),
        GrammarError::Tokenizer(m) => {
            ApiError::Internal(format!("constrained decoding is unavailable: {m}"))
        }
    }
}
