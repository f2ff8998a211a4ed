//! Server-sent events, parsed by hand: `data: ` lines, one JSON payload each.

use serde_json::Value;

/// Splits a byte stream into `data:` payloads. Handles lines split across chunks, `\r\n`, and
/// multi-line events (their `data:` lines are joined with `\n`, as the SSE spec says).
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the payloads of the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.buf.drain(..=nl).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8_lossy(&line);
            if line.is_empty() {
                if let Some(d) = self.data.take() {
                    out.push(d);
                }
            } else if let Some(rest) = line.strip_prefix("data:") {
                let rest = rest.strip_prefix(' ').unwrap_or(rest);
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(rest);
                    }
                    None => self.data = Some(rest.to_string()),
                }
            }
            // `event:`, `id:`, `retry:` and `:` comments carry nothing we need.
        }
        out
    }

    /// Ends the stream: a last event without its blank line still counts.
    pub fn finish(&mut self) -> Option<String> {
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            let mut ev = self.push(&rest);
            ev.extend(self.push(b"\n"));
            if let Some(e) = ev.pop() {
                return Some(e);
            }
        }
        self.data.take()
    }
}

/// Token usage as reported by a server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

/// What one streamed event means for the benchmark.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamEvent {
    /// Generated text in this event (may be empty).
    pub text: String,
    /// Whether the event carries generated tokens (a delta, even one decoding to "").
    pub is_token: bool,
    pub usage: Option<Usage>,
    pub done: bool,
    pub error: Option<String>,
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Parses one OpenAI chat/completions stream payload.
pub fn parse_openai(payload: &str) -> StreamEvent {
    let payload = payload.trim();
    if payload == "[DONE]" {
        return StreamEvent {
            done: true,
            ..Default::default()
        };
    }
    let v: Value = match serde_json::from_str(payload) {
        Ok(v) => v,
        Err(e) => {
            return StreamEvent {
                error: Some(format!("bad JSON in stream: {e}")),
                ..Default::default()
            }
        }
    };
    if let Some(err) = v.get("error") {
        return StreamEvent {
            error: Some(err.to_string()),
            ..Default::default()
        };
    }
    let mut ev = StreamEvent::default();
    if let Some(c) = v.get("choices").and_then(|c| c.get(0)) {
        let text = c
            .get("delta")
            .and_then(|d| d.get("content"))
            .or_else(|| c.get("text"));
        if let Some(t) = text.and_then(Value::as_str) {
            ev.text = t.to_string();
            ev.is_token = !t.is_empty();
        }
    }
    if let Some(us) = v.get("usage").filter(|x| x.is_object()) {
        ev.usage = Some(Usage {
            prompt_tokens: u(&us["prompt_tokens"]),
            completion_tokens: u(&us["completion_tokens"]),
            cached_tokens: u(&us["prompt_tokens_details"]["cached_tokens"]),
        });
    }
    ev
}

/// Parses one Anthropic Messages stream payload. `input_tokens` excludes cache reads and
/// writes, so the prompt is their sum.
pub fn parse_anthropic(payload: &str) -> StreamEvent {
    let v: Value = match serde_json::from_str(payload.trim()) {
        Ok(v) => v,
        Err(e) => {
            return StreamEvent {
                error: Some(format!("bad JSON in stream: {e}")),
                ..Default::default()
            }
        }
    };
    let usage_of = |us: &Value| Usage {
        prompt_tokens: u(&us["input_tokens"])
            + u(&us["cache_read_input_tokens"])
            + u(&us["cache_creation_input_tokens"]),
        completion_tokens: u(&us["output_tokens"]),
        cached_tokens: u(&us["cache_read_input_tokens"]),
    };
    let mut ev = StreamEvent::default();
    match v["type"].as_str().unwrap_or("") {
        "message_start" => ev.usage = Some(usage_of(&v["message"]["usage"])),
        "content_block_delta" => {
            if let Some(t) = v["delta"]["text"].as_str() {
                ev.text = t.to_string();
                ev.is_token = !t.is_empty();
            }
        }
        "message_delta" => {
            let us = &v["usage"];
            ev.usage = Some(Usage {
                prompt_tokens: 0,
                completion_tokens: u(&us["output_tokens"]),
                cached_tokens: 0,
            });
        }
        "message_stop" => ev.done = true,
        "error" => ev.error = Some(v["error"].to_string()),
        _ => {}
    }
    ev
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A captured `/v1/chat/completions` stream with `stream_options.include_usage` (ids
    /// shortened), split at awkward places.
    const OPENAI_STREAM: &str = concat!(
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"finish_reason\":null}],\"usage\":null}\r\n\r\n",
        ": keep-alive comment\n\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":1534,\"completion_tokens\":2,\"total_tokens\":1536,\"prompt_tokens_details\":{\"cached_tokens\":1520}}}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn parses_openai_stream_with_usage_chunk() {
        let bytes = OPENAI_STREAM.as_bytes();
        let mut p = SseParser::new();
        let mut payloads = Vec::new();
        // Feed in 7-byte pieces so lines and events straddle chunk boundaries.
        for piece in bytes.chunks(7) {
            payloads.extend(p.push(piece));
        }
        assert_eq!(p.finish(), None);
        assert_eq!(payloads.len(), 6);
        let events: Vec<StreamEvent> = payloads.iter().map(|s| parse_openai(s)).collect();
        let text: String = events.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(text, "Hello world");
        assert_eq!(events.iter().filter(|e| e.is_token).count(), 2);
        assert!(!events[0].is_token, "role-only chunk is not a token");
        assert_eq!(
            events[4].usage,
            Some(Usage {
                prompt_tokens: 1534,
                completion_tokens: 2,
                cached_tokens: 1520
            })
        );
        assert!(events[..4].iter().all(|e| e.usage.is_none()));
        assert!(events[5].done);
    }

    #[test]
    fn multiline_data_and_unterminated_last_event() {
        let mut p = SseParser::new();
        assert_eq!(
            p.push(b"event: x\ndata: a\ndata:b\n\n"),
            vec!["a\nb".to_string()]
        );
        assert!(p.push(b"data: tail").is_empty());
        assert_eq!(p.finish(), Some("tail".to_string()));
    }

    #[test]
    fn parses_completions_text_and_errors() {
        let e = parse_openai(r#"{"choices":[{"index":0,"text":"hi"}]}"#);
        assert_eq!(e.text, "hi");
        assert!(e.is_token);
        assert!(parse_openai(r#"{"error":{"message":"boom"}}"#)
            .error
            .is_some());
        assert!(parse_openai("not json").error.is_some());
    }

    #[test]
    fn parses_anthropic_events() {
        let s = parse_anthropic(
            r#"{"type":"message_start","message":{"usage":{"input_tokens":10,"cache_read_input_tokens":96,"cache_creation_input_tokens":4,"output_tokens":0}}}"#,
        );
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 110,
                completion_tokens: 0,
                cached_tokens: 96
            })
        );
        let d = parse_anthropic(
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
        );
        assert!(d.is_token);
        assert_eq!(d.text, "Hi");
        assert!(parse_anthropic(r#"{"type":"message_stop"}"#).done);
    }
}
