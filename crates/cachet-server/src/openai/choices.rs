//! The choices of a collected (non-streamed) generation, and the logprob shapes of both APIs.

use cachet_core::Sampled;
use cachet_text::{ReasoningParser, TextTokenizer, ToolFormat};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::generate::{Delta, Final, GenEvent, Generation};

use super::{ChatTools, Echo, Kind, Shape};

pub(super) fn token_text(tok: &dyn TextTokenizer, id: u32) -> String {
    tok.token_to_piece(id).unwrap_or_default()
}

pub(super) fn chat_logprobs(tok: &dyn TextTokenizer, tokens: &[Sampled]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|s| {
            let text = token_text(tok, s.token);
            let top: Vec<Value> = s
                .top_logprobs
                .iter()
                .map(|(id, lp)| {
                    let t = token_text(tok, *id);
                    json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
                })
                .collect();
            json!({"token": text, "logprob": s.logprob, "bytes": text.as_bytes(), "top_logprobs": top})
        })
        .collect();
    json!({ "content": content })
}

pub(super) fn completion_logprobs(
    tok: &dyn TextTokenizer,
    tokens: &[Sampled],
    offset: &mut usize,
) -> Value {
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for s in tokens {
        let t = token_text(tok, s.token);
        offsets.push(*offset);
        *offset += t.len();
        texts.push(t);
        lps.push(s.logprob);
        tops.push(completion_top(tok, s));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// One position's completions `top_logprobs`: the `logprobs` most likely tokens and the token
/// itself (so up to `logprobs` + 1 entries, as OpenAI's legacy completions and vLLM return:
/// the chosen token's logprob is always there, whatever its rank).
fn completion_top(tok: &dyn TextTokenizer, s: &Sampled) -> Value {
    let mut top: Map<String, Value> = s
        .top_logprobs
        .iter()
        .map(|(id, lp)| (token_text(tok, *id), json!(lp)))
        .collect();
    top.entry(token_text(tok, s.token))
        .or_insert_with(|| json!(s.logprob));
    Value::Object(top)
}

/// One generation run to its end: one choice per sequence, and the request's last final.
pub(super) struct Collected {
    pub(super) choices: Vec<Value>,
    /// Each choice's mean logprob per generated token (0 without tokens).
    pub(super) scores: Vec<f64>,
    pub(super) last: Final,
    pub(super) prompt_logprobs: Option<Vec<Sampled>>,
    /// Generated tokens in reasoning over all choices (`None`: no reasoning parser).
    pub(super) reasoning_tokens: Option<u64>,
}

impl Collected {
    /// `best_of`: keeps the `n` choices with the highest mean token logprob (ties: the earlier
    /// sequence), numbered from `index_base`; their logprobs dropped unless the client asked.
    pub(super) fn keep_best(&mut self, n: usize, index_base: usize, keep_logprobs: bool) {
        let mut order: Vec<usize> = (0..self.choices.len()).collect();
        order.sort_by(|&a, &b| self.scores[b].total_cmp(&self.scores[a]));
        order.truncate(n);
        let mut kept = Vec::with_capacity(n);
        for (k, i) in order.into_iter().enumerate() {
            let mut c = std::mem::take(&mut self.choices[i]);
            c["index"] = json!(index_base + k);
            if !keep_logprobs {
                c["logprobs"] = Value::Null;
            }
            kept.push(c);
        }
        self.choices = kept;
    }
}

pub(super) async fn collect_choices(
    tok: &dyn TextTokenizer,
    gen: &mut Generation,
    kind: Kind,
    tools: ChatTools,
    shape: &Shape,
) -> Result<Collected, ApiError> {
    let n = gen.num_seqs();
    let mut texts = vec![String::new(); n];
    let mut tokens: Vec<Vec<Sampled>> = vec![Vec::new(); n];
    let mut finals: Vec<Option<Final>> = vec![None; n];
    let mut parsers: Vec<Option<ReasoningParser>> = vec![tools.reasoning.clone(); n];
    let mut reasonings: Vec<Option<String>> = vec![None; n];
    let mut reasoning_tokens = 0u64;
    let mut last = None;
    while let Some(ev) = gen.next().await {
        match ev {
            GenEvent::Delta(Delta {
                seq,
                text,
                generated,
                tokens: t,
            }) => {
                let i = seq as usize;
                match parsers.get_mut(i).and_then(Option::as_mut) {
                    Some(p) => {
                        let d = p.push_tokens(&text, generated);
                        reasoning_tokens += d.reasoning_tokens as u64;
                        if d.in_reasoning {
                            reasonings[i]
                                .get_or_insert_with(String::new)
                                .push_str(&d.reasoning);
                        }
                        if let Some(x) = texts.get_mut(i) {
                            x.push_str(&d.content);
                        }
                    }
                    None => {
                        if let Some(x) = texts.get_mut(i) {
                            x.push_str(&text);
                        }
                    }
                }
                if let Some(x) = tokens.get_mut(seq as usize) {
                    x.extend(t);
                }
            }
            GenEvent::Done(f) => {
                if f.last {
                    last = Some(f.clone());
                }
                if let Some(x) = finals.get_mut(f.seq as usize) {
                    *x = Some(*f);
                }
            }
        }
    }
    let last = gen.final_or_abort(last);
    if let Some(e) = &last.error {
        return Err(ApiError::Internal(e.to_string()));
    }
    for (i, p) in parsers.iter_mut().enumerate() {
        if let Some(p) = p {
            let d = p.finish();
            if d.in_reasoning {
                reasonings[i]
                    .get_or_insert_with(String::new)
                    .push_str(&d.reasoning);
            }
            texts[i].push_str(&d.content);
        }
    }
    let plp = gen.prompt_logprobs().map(<[Sampled]>::to_vec);
    let mut choices = Vec::with_capacity(n);
    let scores = tokens
        .iter()
        .map(|t| {
            if t.is_empty() {
                0.0
            } else {
                t.iter().map(|s| f64::from(s.logprob)).sum::<f64>() / t.len() as f64
            }
        })
        .collect();
    for (i, ((text, toks), reasoning)) in texts.into_iter().zip(tokens).zip(reasonings).enumerate()
    {
        let fin = finals[i].clone().unwrap_or_else(|| last.clone());
        let index = shape.index_base + i;
        let want_lp = !toks.is_empty();
        let choice = match kind {
            Kind::Chat => {
                let (content, calls) = match tools.format {
                    Some(f) => {
                        let (c, mut calls) = cachet_text::parse_tool_calls(f, &text);
                        if !tools.parallel {
                            calls.truncate(1);
                        }
                        (c, calls)
                    }
                    None => (text, Vec::new()),
                };
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    let format = tools.format.unwrap_or(ToolFormat::Generic);
                    let tc = crate::tools::to_tool_calls(&calls, format);
                    if content.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = serde_json::to_value(&tc).unwrap_or_default();
                }
                if tools.reasoning.is_some() {
                    // vLLM's `reasoning_content` and the newer `reasoning`, null without any;
                    // no answer after reasoning is a null content, as in vLLM.
                    if reasoning.is_some() && message["content"] == json!("") {
                        message["content"] = Value::Null;
                    }
                    message["reasoning_content"] = json!(reasoning);
                    message["reasoning"] = json!(reasoning);
                }
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": if want_lp { chat_logprobs(tok, &toks) } else { Value::Null },
                    "finish_reason": finish_reason(&fin, !calls.is_empty()),
                    "stop_reason": stop_reason(&fin),
                })
            }
            Kind::Completion => {
                let (full, logprobs) = match &shape.echo {
                    Some(e) => {
                        let lp = (want_lp || plp.is_some()).then(|| {
                            echo_logprobs(tok, e, plp.as_deref().unwrap_or_default(), &toks)
                        });
                        (format!("{}{text}", e.text), lp.unwrap_or(Value::Null))
                    }
                    None => {
                        let lp = if want_lp {
                            completion_logprobs(tok, &toks, &mut 0)
                        } else {
                            Value::Null
                        };
                        (text, lp)
                    }
                };
                let mut c = json!({
                    "index": index,
                    "text": full,
                    "logprobs": logprobs,
                    "finish_reason": fin.stop.openai(),
                    "stop_reason": stop_reason(&fin),
                });
                if shape.prompt_logprobs {
                    c["prompt_logprobs"] = vllm_prompt_logprobs(tok, plp.as_deref());
                }
                c
            }
        };
        choices.push(choice);
    }
    Ok(Collected {
        choices,
        scores,
        last,
        prompt_logprobs: plp,
        reasoning_tokens: tools.reasoning.is_some().then_some(reasoning_tokens),
    })
}

/// Completions logprobs of an echoed prompt and its completion: the prompt's tokens first (the
/// first with `null`: nothing predicts it), then the generated ones.
pub(super) fn echo_logprobs(
    tok: &dyn TextTokenizer,
    echo: &Echo,
    prompt: &[Sampled],
    gen: &[Sampled],
) -> Value {
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    let mut offset = 0usize;
    for (i, &id) in echo.ids.iter().enumerate() {
        let t = token_text(tok, id);
        offsets.push(offset);
        offset += t.len();
        texts.push(t);
        match i.checked_sub(1).and_then(|j| prompt.get(j)) {
            Some(s) => {
                lps.push(json!(s.logprob));
                tops.push(completion_top(tok, s));
            }
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
    }
    let g = completion_logprobs(tok, gen, &mut offset);
    let extend = |dst: &mut Vec<Value>, key: &str| {
        if let Some(a) = g[key].as_array() {
            dst.extend(a.iter().cloned());
        }
    };
    let mut texts: Vec<Value> = texts.into_iter().map(Value::String).collect();
    extend(&mut texts, "tokens");
    extend(&mut lps, "token_logprobs");
    extend(&mut tops, "top_logprobs");
    let mut offsets: Vec<Value> = offsets.into_iter().map(|o| json!(o)).collect();
    extend(&mut offsets, "text_offset");
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then for each one
/// `{"<id>": {"logprob", "rank", "decoded_token"}}` with the token and its alternatives (`rank`
/// is known when the token is among them).
pub(super) fn vllm_prompt_logprobs(tok: &dyn TextTokenizer, plp: Option<&[Sampled]>) -> Value {
    let Some(plp) = plp else {
        return Value::Null;
    };
    let mut out = vec![Value::Null];
    for s in plp {
        let mut m = Map::new();
        let rank = s
            .top_logprobs
            .iter()
            .position(|(id, _)| *id == s.token)
            .map(|r| r + 1);
        m.insert(
            s.token.to_string(),
            json!({"logprob": s.logprob, "rank": rank, "decoded_token": token_text(tok, s.token)}),
        );
        for (r, (id, lp)) in s.top_logprobs.iter().enumerate() {
            m.entry(id.to_string()).or_insert_with(
                || json!({"logprob": lp, "rank": r + 1, "decoded_token": token_text(tok, *id)}),
            );
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

/// `tool_calls` when the answer called a tool and ended by itself, else the engine's reason.
pub(super) fn finish_reason(fin: &Final, called: bool) -> &'static str {
    match fin.stop.openai() {
        "stop" if called => "tool_calls",
        reason => reason,
    }
}

/// vLLM's `stop_reason`: the matched stop string or stop token id, else null (EOS too).
pub(super) fn stop_reason(fin: &Final) -> Value {
    match &fin.stop {
        crate::generate::StopKind::StopString(s) => json!(s),
        crate::generate::StopKind::StopToken(id) => json!(id),
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use cachet_text::ByteTokenizer;

    use super::*;

    fn b(c: char) -> u32 {
        c as u32 + ByteTokenizer::OFFSET
    }

    fn sampled(token: char, logprob: f32, top: &[(char, f32)]) -> Sampled {
        Sampled {
            token: b(token),
            logprob,
            top_logprobs: top.iter().map(|&(c, lp)| (b(c), lp)).collect(),
        }
    }

    #[test]
    fn completion_top_logprobs_always_hold_the_chosen_token() {
        // "x" chosen outside the top 2, then "y" chosen as the top token.
        let toks = [
            sampled('x', -3.0, &[('a', -0.5), ('b', -1.0)]),
            sampled('y', -0.25, &[('y', -0.25), ('c', -2.0)]),
        ];
        let mut offset = 4;
        let v = completion_logprobs(&ByteTokenizer, &toks, &mut offset);
        assert_eq!(
            v,
            json!({
                "tokens": ["x", "y"],
                "token_logprobs": [-3.0, -0.25],
                "top_logprobs": [{"a": -0.5, "b": -1.0, "x": -3.0}, {"y": -0.25, "c": -2.0}],
                "text_offset": [4, 5],
            })
        );
        assert_eq!(offset, 6);
    }

    #[test]
    fn echoed_prompt_positions_hold_the_prompt_token_too() {
        let echo = Echo {
            text: "pq".into(),
            ids: vec![b('p'), b('q')],
        };
        // The prompt's second token "q" (logprob -4), outside the top 1.
        let prompt = [sampled('q', -4.0, &[('r', -0.125)])];
        let gen = [sampled('s', -0.5, &[('s', -0.5)])];
        let v = echo_logprobs(&ByteTokenizer, &echo, &prompt, &gen);
        assert_eq!(v["tokens"], json!(["p", "q", "s"]));
        assert_eq!(v["token_logprobs"], json!([null, -4.0, -0.5]));
        assert_eq!(
            v["top_logprobs"],
            json!([null, {"r": -0.125, "q": -4.0}, {"s": -0.5}])
        );
        assert_eq!(v["text_offset"], json!([0, 1, 2]));
    }
}
