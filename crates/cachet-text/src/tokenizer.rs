//! The one trait a model's text side implements.

use thiserror::Error;

use crate::message::ChatMessage;
use crate::template::{ChatRequest, TemplateCaps, TemplateError};

/// What the text side can fail with.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TokenizerError {
    #[error("tokenization failed: {0}")]
    Encode(String),
    #[error("detokenization failed: {0}")]
    Decode(String),
    #[error("token id {id} is outside the vocabulary ({vocab_size})")]
    UnknownToken { id: u32, vocab_size: usize },
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// A model's tokenizer and chat template, shared by every request (`Arc<dyn TextTokenizer>`).
///
/// Object safe; implementations are immutable after construction, so `&self` methods may be
/// called from any thread at once.
pub trait TextTokenizer: Send + Sync {
    /// Token ids of `text`. Special tokens written in the text are recognised;
    /// `add_special_tokens` adds what the model puts around a text (e.g. BOS).
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError>;

    /// Text of `ids`; bytes that are not valid UTF-8 become U+FFFD. An id outside the vocabulary
    /// is an error.
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError>;

    /// Tokens that end generation.
    fn eos_token_ids(&self) -> &[u32];

    /// The beginning-of-sequence token, if the model has one.
    fn bos_token_id(&self) -> Option<u32>;

    /// Number of token ids (valid ids are `0..vocab_size()`).
    fn vocab_size(&self) -> usize;

    /// The raw bytes token `id` stands for, before any UTF-8 decoding (a control token: its
    /// text); `None` outside the vocabulary. For logprob `bytes` fields and token tries.
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>>;

    /// Whether `id` is a control (special) token, the kind `skip_special_tokens` drops.
    fn is_special(&self, id: u32) -> bool;

    /// Renders a chat into the prompt text (tools, generation prompt and all).
    fn render_chat(&self, chat: &ChatRequest<'_>) -> Result<String, TokenizerError>;

    /// What the chat template renders by itself (tools, tool calls).
    fn chat_caps(&self) -> TemplateCaps;

    /// The text of one token for logprob output (lossy when it is part of a multi-byte
    /// character); `None` outside the vocabulary.
    fn token_to_piece(&self, id: u32) -> Option<String> {
        self.token_bytes(id)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    }

    /// Renders plain messages without tools.
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_chat(&ChatRequest::new(messages, add_generation_prompt))
    }
}
