//! The text side of a model: tokenizer and chat template behind one trait, and incremental
//! detokenization that never emits a broken UTF-8 sequence.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TokenizerError {
    #[error("tokenization failed: {0}")]
    Encode(String),
    #[error("detokenization failed: {0}")]
    Decode(String),
    #[error("chat template failed: {0}")]
    Template(String),
}

pub trait TextTokenizer: Send + Sync {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError>;
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError>;
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError>;
    fn eos_token_ids(&self) -> Vec<u32>;
}

/// Turns a stream of token ids into text deltas. Text is held back while the tail decodes to
/// U+FFFD (an incomplete UTF-8 sequence split across tokens).
pub struct IncrementalDetokenizer {
    tok: Arc<dyn TextTokenizer>,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDetokenizer {
    pub fn new(tok: Arc<dyn TextTokenizer>) -> Self {
        IncrementalDetokenizer {
            tok,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Add tokens; returns the newly completed text.
    pub fn push(&mut self, new_ids: &[u32]) -> String {
        self.ids.extend_from_slice(new_ids);
        let prefix = self
            .tok
            .decode(&self.ids[self.prefix_offset..self.read_offset], true)
            .unwrap_or_default();
        let full = self
            .tok
            .decode(&self.ids[self.prefix_offset..], true)
            .unwrap_or_default();
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            delta
        } else {
            String::new()
        }
    }

    /// Whatever is still held back (decoded lossily), at the end of a stream.
    pub fn flush(&mut self) -> String {
        let prefix = self
            .tok
            .decode(&self.ids[self.prefix_offset..self.read_offset], true)
            .unwrap_or_default();
        let full = self
            .tok
            .decode(&self.ids[self.prefix_offset..], true)
            .unwrap_or_default();
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            full[prefix.len()..].to_string()
        } else {
            String::new()
        }
    }
}
