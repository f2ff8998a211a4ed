//! Server-sent events of a streamed chat or text completion.

use std::convert::Infallible;

use axum::response::sse::Event;
use cachet_text::{ToolEvent, ToolFormat};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::generate::{GenEvent, Generation};
use crate::usage::{openai_usage, request_metrics_json, session_json, with_reasoning_tokens};
use crate::AppState;

use super::choices::{
    chat_logprobs, completion_logprobs, echo_logprobs, finish_reason, stop_reason, token_text,
    vllm_prompt_logprobs,
};
use super::{now_secs, ChatTools, Kind, Shape};

/// Streaming `delta.reasoning_content` / `delta.reasoning` for reasoning, `delta.tool_calls`
/// for parser events; content events become `content` deltas.
struct StreamTools {
    reasoning: Option<cachet_text::ReasoningParser>,
    /// Generated tokens whose text lay in reasoning.
    reasoning_tokens: u64,
    parser: Option<cachet_text::ToolCallParser>,
    format: ToolFormat,
    parallel: bool,
    called: bool,
}

impl StreamTools {
    fn new(t: &ChatTools) -> Self {
        StreamTools {
            reasoning: t.reasoning.clone(),
            reasoning_tokens: 0,
            parser: t.format.map(cachet_text::ToolCallParser::new),
            format: t.format.unwrap_or(ToolFormat::Generic),
            parallel: t.parallel,
            called: false,
        }
    }

    /// Deltas for a piece of text of `tokens` tokens (`None`: the end): reasoning first, then
    /// the answer's.
    fn deltas(&mut self, text: Option<&str>, tokens: usize) -> Vec<Value> {
        let Some(r) = &mut self.reasoning else {
            return self.answer_deltas(text);
        };
        let d = match text {
            Some(t) => r.push_tokens(t, tokens),
            None => r.finish(),
        };
        let mut out = Vec::new();
        self.reasoning_tokens += d.reasoning_tokens as u64;
        if !d.reasoning.is_empty() {
            out.push(json!({"reasoning_content": d.reasoning, "reasoning": d.reasoning}));
        }
        match text {
            Some(_) if d.content.is_empty() => {}
            Some(_) => out.extend(self.answer_deltas(Some(&d.content))),
            None => {
                out.extend(self.answer_deltas(Some(&d.content)));
                out.extend(self.answer_deltas(None));
            }
        }
        out
    }

    /// Deltas (`{"content"}` or `{"tool_calls": [...]}`) for a piece of the answer (`None`: the
    /// end).
    fn answer_deltas(&mut self, text: Option<&str>) -> Vec<Value> {
        let Some(p) = &mut self.parser else {
            return match text {
                Some(t) if !t.is_empty() => vec![json!({"content": t})],
                _ => Vec::new(),
            };
        };
        let events = match text {
            Some(t) => p.push(t),
            None => p.finish(),
        };
        let mut out = Vec::new();
        for e in events {
            match e {
                ToolEvent::Content(c) => out.push(json!({"content": c})),
                ToolEvent::Start { index, name } => {
                    if index > 0 && !self.parallel {
                        continue;
                    }
                    self.called = true;
                    out.push(json!({"tool_calls": [{
                        "index": index, "id": crate::tools::new_call_id(self.format), "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }]}));
                }
                ToolEvent::Arguments { index, text } => {
                    if index > 0 && !self.parallel {
                        continue;
                    }
                    out.push(
                        json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]}),
                    );
                }
                ToolEvent::End { .. } => {}
            }
        }
        out
    }
}

fn data(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

pub(super) fn stream_events(
    state: AppState,
    mut gen: Generation,
    model: String,
    kind: Kind,
    tools: ChatTools,
    shape: Shape,
    include_usage: bool,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let tok = state.tokenizer().clone();
        let id = gen.request_id().to_string();
        let created = now_secs();
        let object = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let usage_field = |v: &mut Value| {
            if include_usage {
                v["usage"] = Value::Null;
            }
        };
        let mut finish_chunk: Option<Value> = None;
        let n = gen.num_seqs();
        let mut text_offset = vec![0usize; n];
        let mut st: Vec<StreamTools> = (0..n).map(|_| StreamTools::new(&tools)).collect();
        if kind == Kind::Chat {
            let choices: Vec<Value> = (0..n)
                .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                .collect();
            let mut first = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
            usage_field(&mut first);
            yield data(&first);
        }
        let mut last_fin = None;
        // The echoed prompt and vLLM's prompt_logprobs go first, once the engine's first output
        // (which carries the prompt logprobs) has arrived.
        let mut head_pending = shape.echo.is_some() || shape.prompt_logprobs;
        while let Some(ev) = gen.next().await {
            if head_pending {
                head_pending = false;
                let plp = gen.prompt_logprobs();
                let vllm = shape.prompt_logprobs.then(|| vllm_prompt_logprobs(tok.as_ref(), plp));
                if kind == Kind::Chat {
                    let mut chunk = json!({"id": id, "object": object, "created": created, "model": model,
                        "choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": null}]});
                    chunk["prompt_logprobs"] = vllm.unwrap_or(Value::Null);
                    usage_field(&mut chunk);
                    yield data(&chunk);
                } else {
                    for (i, offset) in text_offset.iter_mut().enumerate() {
                        let mut choice = json!({"index": shape.index_base + i, "text": "", "logprobs": null, "finish_reason": null});
                        if let Some(e) = &shape.echo {
                            choice["text"] = json!(e.text);
                            if plp.is_some() {
                                choice["logprobs"] = echo_logprobs(tok.as_ref(), e, plp.unwrap_or_default(), &[]);
                            }
                            *offset = e.ids.iter().map(|&t| token_text(tok.as_ref(), t).len()).sum();
                        }
                        if let Some(v) = &vllm {
                            choice["prompt_logprobs"] = v.clone();
                        }
                        let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                        usage_field(&mut chunk);
                        yield data(&chunk);
                    }
                }
            }
            match ev {
                GenEvent::Delta(d) => {
                    let i = (d.seq as usize).min(n - 1);
                    let lp = if d.tokens.is_empty() {
                        Value::Null
                    } else if kind == Kind::Chat {
                        chat_logprobs(tok.as_ref(), &d.tokens)
                    } else {
                        completion_logprobs(tok.as_ref(), &d.tokens, &mut text_offset[i])
                    };
                    if kind == Kind::Chat {
                        let mut deltas = st[i].deltas(Some(&d.text), d.generated);
                        if deltas.is_empty() && !lp.is_null() {
                            deltas.push(json!({"content": ""}));
                        }
                        let k = deltas.len();
                        for (j, delta) in deltas.into_iter().enumerate() {
                            // Logprobs ride on the last chunk of the tokens' text.
                            let lpi = if j + 1 == k { lp.clone() } else { Value::Null };
                            let choice = json!({"index": i, "delta": delta, "logprobs": lpi, "finish_reason": null});
                            let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                            usage_field(&mut chunk);
                            yield data(&chunk);
                        }
                    } else {
                        let choice = json!({"index": i, "text": d.text, "logprobs": lp, "finish_reason": null});
                        let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                        usage_field(&mut chunk);
                        yield data(&chunk);
                    }
                }
                GenEvent::Done(f) => {
                    if f.error.is_some() {
                        last_fin = Some(f);
                        continue;
                    }
                    let i = (f.seq as usize).min(n - 1);
                    if kind == Kind::Chat {
                        for delta in st[i].deltas(None, 0) {
                            let mut chunk = json!({"id": id, "object": object, "created": created, "model": model,
                                "choices": [{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}]});
                            usage_field(&mut chunk);
                            yield data(&chunk);
                        }
                    }
                    let choice = if kind == Kind::Chat {
                        json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": finish_reason(&f, st[i].called), "stop_reason": stop_reason(&f)})
                    } else {
                        json!({"index": i, "text": "", "logprobs": null, "finish_reason": f.stop.openai(), "stop_reason": stop_reason(&f)})
                    };
                    let mut chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
                    usage_field(&mut chunk);
                    if f.last {
                        last_fin = Some(f);
                        // The last finish chunk may carry `session` and `metrics` (below).
                        finish_chunk = Some(chunk);
                    } else {
                        yield data(&chunk);
                    }
                }
            }
        }
        let fin = gen.final_or_abort(last_fin);
        if let Some(e) = &fin.error {
            // The engine failed mid-stream: an error event in OpenAI's shape, then [DONE].
            yield data(&ApiError::Internal(e.to_string()).openai_body());
            yield Ok(Event::default().data("[DONE]"));
            return;
        }
        let mut last = finish_chunk.take().unwrap_or_else(|| {
            let choice = if kind == Kind::Chat {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": fin.stop.openai(), "stop_reason": stop_reason(&fin)})
            } else {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": fin.stop.openai(), "stop_reason": stop_reason(&fin)})
            };
            let mut c = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            usage_field(&mut c);
            c
        });
        let metrics = state.per_request_metrics().then(|| request_metrics_json(&fin));
        let session = fin.session.as_ref().map(session_json);
        // `session` and `metrics` ride on the usage chunk, or on the finish chunk without one.
        let extras = |v: &mut Value| {
            if let Some(s) = &session {
                v["session"] = s.clone();
            }
            if let Some(m) = &metrics {
                v["metrics"] = m.clone();
            }
        };
        if include_usage {
            yield data(&last);
            let mut usage = json!({
                "id": id, "object": object, "created": created, "model": model,
                "choices": [], "usage": openai_usage(&fin),
            });
            if tools.reasoning.is_some() {
                let n = st.iter().map(|s| s.reasoning_tokens).sum();
                with_reasoning_tokens(&mut usage["usage"], n);
            }
            extras(&mut usage);
            yield data(&usage);
        } else {
            extras(&mut last);
            yield data(&last);
        }
        yield Ok(Event::default().data("[DONE]"));
    }
}
