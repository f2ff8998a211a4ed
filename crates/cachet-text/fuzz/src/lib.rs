//! Input decoding and reference models shared by the fuzz targets.
//!
//! Inputs are plain bytes with 0xFF / 0xFE / 0x1D as separators (bytes that never occur in
//! UTF-8 text, so seeds stay readable and mutations stay meaningful).

use cachet_text::{
    ChatMessage, ChatRequest, Role, StopOutcome, TemplateCaps, TextTokenizer, TokenizerError,
    ToolCall,
};

pub const SEP: u8 = 0xFF;
pub const SUB: u8 = 0xFE;
pub const FIELD: u8 = 0x1D;

pub fn split(data: &[u8], sep: u8) -> Vec<&[u8]> {
    data.split(|&b| b == sep).collect()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The stop matcher cachet had before the automaton (the reference the fast one must equal).
pub struct NaiveStops {
    stops: Vec<String>,
    pending: String,
    done: bool,
}

impl NaiveStops {
    pub fn new(stops: &[String]) -> Self {
        NaiveStops {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            done: false,
        }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.done {
            return StopOutcome::default();
        }
        if self.stops.is_empty() {
            return StopOutcome {
                emit: text.to_string(),
                matched: None,
            };
        }
        self.pending.push_str(text);
        let mut best: Option<(usize, usize)> = None;
        for (i, stop) in self.stops.iter().enumerate() {
            if let Some(pos) = self.pending.find(stop.as_str()) {
                let better = match best {
                    None => true,
                    Some((bpos, bi)) => {
                        pos < bpos || (pos == bpos && stop.len() > self.stops[bi].len())
                    }
                };
                if better {
                    best = Some((pos, i));
                }
            }
        }
        if let Some((pos, i)) = best {
            let emit = self.pending[..pos].to_string();
            self.pending.clear();
            self.done = true;
            return StopOutcome {
                emit,
                matched: Some(i),
            };
        }
        let mut hold = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(self.pending.len());
            for k in (hold + 1..=max).rev() {
                if stop.is_char_boundary(k)
                    && self.pending.as_bytes().ends_with(&stop.as_bytes()[..k])
                {
                    hold = k;
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome {
            emit,
            matched: None,
        }
    }

    pub fn flush(&mut self) -> String {
        if self.done {
            return String::new();
        }
        self.done = true;
        std::mem::take(&mut self.pending)
    }
}

/// Tokens that are arbitrary byte strings, optionally with SentencePiece's leading-space
/// strip in decode.
pub struct ChunkTokenizer {
    pub vocab: Vec<Vec<u8>>,
    pub strip_leading_space: bool,
}

impl TextTokenizer for ChunkTokenizer {
    fn encode(&self, _text: &str, _add: bool) -> Result<Vec<u32>, TokenizerError> {
        Err(TokenizerError::Encode("not used".into()))
    }
    fn decode(&self, ids: &[u32], _skip: bool) -> Result<String, TokenizerError> {
        let mut b = Vec::new();
        for &id in ids {
            b.extend_from_slice(self.vocab.get(id as usize).ok_or(
                TokenizerError::UnknownToken {
                    id,
                    vocab_size: self.vocab.len(),
                },
            )?);
        }
        let s = String::from_utf8_lossy(&b).into_owned();
        Ok(match (self.strip_leading_space, s.strip_prefix(' ')) {
            (true, Some(rest)) => rest.to_string(),
            _ => s,
        })
    }
    fn eos_token_ids(&self) -> &[u32] {
        &[]
    }
    fn bos_token_id(&self) -> Option<u32> {
        None
    }
    fn vocab_size(&self) -> usize {
        self.vocab.len()
    }
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.vocab.get(id as usize).cloned()
    }
    fn is_special(&self, _id: u32) -> bool {
        false
    }
    fn render_chat(&self, _chat: &ChatRequest<'_>) -> Result<String, TokenizerError> {
        Ok(String::new())
    }
    fn chat_caps(&self) -> TemplateCaps {
        TemplateCaps::default()
    }
}

/// One message from `role-byte content [0xFE name] [0xFE tool_call_id] [0xFE id 0x1D name 0x1D
/// args]...`.
pub fn message(seg: &[u8]) -> Option<ChatMessage> {
    let (&r, rest) = seg.split_first()?;
    let role = [
        Role::System,
        Role::Developer,
        Role::User,
        Role::Assistant,
        Role::Tool,
    ][r as usize % 5];
    let fields = split(rest, SUB);
    let mut m = ChatMessage::new(role, text(fields[0]));
    if let Some(n) = fields.get(1).filter(|n| !n.is_empty()) {
        m.name = Some(text(n));
    }
    if let Some(id) = fields.get(2).filter(|n| !n.is_empty()) {
        m.tool_call_id = Some(text(id));
    }
    for call in fields.iter().skip(3) {
        let parts = split(call, FIELD);
        let get = |i: usize| parts.get(i).map(|p| text(p)).unwrap_or_default();
        m.tool_calls
            .push(ToolCall::function(get(0), get(1), get(2)));
    }
    Some(m)
}
