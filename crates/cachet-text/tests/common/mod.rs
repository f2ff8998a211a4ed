//! Test tokenizers shared by the integration tests.

#![allow(dead_code)]

use cachet_text::{ChatRequest, TemplateCaps, TextTokenizer, TokenizerError};

/// A tokenizer whose tokens are arbitrary byte strings (so they split characters anywhere),
/// optionally with SentencePiece's leading-space strip in decode.
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
