//! `cachet generate`: run a JSONL file of requests through the offline engine.

use std::io::{BufRead, Write};

use cachet_core::stats::COUNTERS;
use cachet_core::{RequestDraft, SamplingParams, TokenId};
use cachet_engine::offline::OfflineEngine;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::args::EngineArgs;
use crate::wiring::{build, WiringError};

/// One input line.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputLine {
    #[serde(default)]
    pub request_id: Option<String>,
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<TokenId>>,
    /// Text prompt (tokenized with the model's tokenizer) when no token ids are given.
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default)]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub priority: Option<i32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

fn default_max_tokens() -> u32 {
    16
}

#[derive(Debug, Error)]
pub enum GenerateError {
    #[error("line {line}: {msg}")]
    Input { line: usize, msg: String },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Wiring(#[from] WiringError),
    #[error(transparent)]
    Run(#[from] cachet_engine::offline::OfflineError),
}

#[derive(Serialize)]
struct OutputLine<'a> {
    request_id: &'a str,
    output_token_ids: &'a [TokenId],
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    finish_reason: &'a str,
    prefill_stats: Option<cachet_core::PrefillStats>,
}

pub fn parse_input(reader: impl BufRead) -> Result<Vec<InputLine>, GenerateError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: InputLine = serde_json::from_str(&line).map_err(|e| GenerateError::Input {
            line: i + 1,
            msg: e.to_string(),
        })?;
        if parsed.prompt_token_ids.is_none() && parsed.prompt.is_none() {
            return Err(GenerateError::Input {
                line: i + 1,
                msg: "needs prompt_token_ids or prompt".into(),
            });
        }
        out.push(parsed);
    }
    Ok(out)
}

/// Run the lines and write one JSON object per request, then the aggregate counters.
pub fn run(
    args: &EngineArgs,
    lines: Vec<InputLine>,
    sequential: bool,
    json: bool,
    mut w: impl Write,
) -> Result<(), GenerateError> {
    let built = build(args)?;
    let tokenizer = built.tokenizer.clone();
    let mut engine = OfflineEngine::new(built.engine.scheduler.clone(), built.executor);
    let mut reqs = Vec::new();
    for (i, l) in lines.into_iter().enumerate() {
        let prompt = match (l.prompt_token_ids, &l.prompt) {
            (Some(ids), _) => ids,
            (None, Some(text)) => {
                tokenizer
                    .encode(text, true)
                    .map_err(|e| GenerateError::Input {
                        line: i + 1,
                        msg: e.to_string(),
                    })?
            }
            (None, None) => Vec::new(),
        };
        let mut r = RequestDraft::new(
            l.request_id.unwrap_or_else(|| format!("req-{i}")),
            prompt,
            SamplingParams {
                max_tokens: l.max_tokens,
                temperature: l.temperature.unwrap_or(0.0),
                seed: l.seed,
                ignore_eos: l.ignore_eos.unwrap_or(false),
                ..Default::default()
            },
        );
        r.cache_salt = l.cache_salt;
        r.priority = l.priority.unwrap_or(0);
        reqs.push(r);
    }
    let results = if sequential {
        let mut all = Vec::new();
        for r in reqs {
            all.extend(engine.generate(vec![r])?);
        }
        all
    } else {
        engine.generate(reqs)?
    };
    for r in &results {
        let text = tokenizer.decode(&r.output_token_ids, true).ok();
        if json {
            let line = OutputLine {
                request_id: &r.request_id,
                output_token_ids: &r.output_token_ids,
                text,
                finish_reason: r.finish_reason.as_str(),
                prefill_stats: r.prefill_stats,
            };
            writeln!(w, "{}", serde_json::to_string(&line).unwrap_or_default())?;
        } else {
            writeln!(
                w,
                "[{}] ({}) {}",
                r.request_id,
                r.finish_reason.as_str(),
                text.unwrap_or_default()
            )?;
            if let Some(p) = r.prefill_stats {
                writeln!(w, "    prefill: {p:?}")?;
            }
        }
    }
    let totals = engine.totals();
    if json {
        let map: serde_json::Map<String, serde_json::Value> = COUNTERS
            .iter()
            .zip(totals.values())
            .map(|(c, v)| (c.field.to_string(), v.into()))
            .collect();
        writeln!(w, "{}", serde_json::json!({ "aggregate": map }))?;
    } else {
        writeln!(w, "aggregate: {totals:?}")?;
    }
    Ok(())
}
