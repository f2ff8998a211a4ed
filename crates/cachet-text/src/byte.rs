//! The simulated model's tokenizer: one token per byte.

use crate::message::ChatMessage;
use crate::template::{ChatRequest, TemplateCaps};
use crate::tokenizer::{TextTokenizer, TokenizerError};

/// Byte `b` is token `b + 3`; 0 is padding, 1 BOS, 2 EOS.
///
/// Its chat format is one `<|role|>\ncontent\n` block per message (`developer` written as
/// `system`) and `<|assistant|>\n` for the generation prompt. It renders neither tools nor tool
/// calls ([`TemplateCaps`] all false), so a server uses its generic tool format with it.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const PAD: u32 = 0;
    pub const BOS: u32 = 1;
    pub const EOS: u32 = 2;
    /// Token of byte 0.
    pub const OFFSET: u32 = 3;
    pub const VOCAB_SIZE: usize = Self::OFFSET as usize + 256;

    const SPECIAL: [&'static str; 3] = ["<pad>", "<s>", "</s>"];
}

impl TextTokenizer for ByteTokenizer {
    /// The bytes of `text`; `add_special_tokens` adds nothing (the simulator wants no BOS).
    fn encode(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        Ok(text.bytes().map(|b| b as u32 + Self::OFFSET).collect())
    }

    /// The bytes of `ids` as UTF-8 (lossy); special tokens as `<pad>`, `<s>`, `</s>` unless
    /// skipped.
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match id {
                Self::PAD | Self::BOS | Self::EOS => {
                    if !skip_special_tokens {
                        bytes.extend_from_slice(Self::SPECIAL[id as usize].as_bytes());
                    }
                }
                _ if (id as usize) < Self::VOCAB_SIZE => bytes.push((id - Self::OFFSET) as u8),
                _ => {
                    return Err(TokenizerError::UnknownToken {
                        id,
                        vocab_size: Self::VOCAB_SIZE,
                    })
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn eos_token_ids(&self) -> &[u32] {
        &[Self::EOS]
    }

    fn bos_token_id(&self) -> Option<u32> {
        Some(Self::BOS)
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        match id {
            Self::PAD | Self::BOS | Self::EOS => {
                Some(Self::SPECIAL[id as usize].as_bytes().to_vec())
            }
            _ if (id as usize) < Self::VOCAB_SIZE => Some(vec![(id - Self::OFFSET) as u8]),
            _ => None,
        }
    }

    fn is_special(&self, id: u32) -> bool {
        id < Self::OFFSET
    }

    fn render_chat(&self, chat: &ChatRequest<'_>) -> Result<String, TokenizerError> {
        Ok(render(chat.messages, chat.add_generation_prompt))
    }

    fn chat_caps(&self) -> TemplateCaps {
        TemplateCaps::default()
    }
}

fn render(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str("<|");
        s.push_str(m.role.template_name());
        s.push_str("|>\n");
        s.push_str(&m.content);
        s.push('\n');
    }
    if add_generation_prompt {
        s.push_str("<|assistant|>\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;

    #[test]
    fn bytes_are_tokens_plus_three() {
        let t = ByteTokenizer;
        assert_eq!(
            t.encode("Hé", true).unwrap(),
            vec![72 + 3, 0xC3 + 3, 0xA9 + 3]
        );
        assert_eq!(t.decode(&[75, 198, 172], true).unwrap(), "Hé");
        assert_eq!(t.decode(&[1, 75, 2], true).unwrap(), "H");
        assert_eq!(t.decode(&[0, 1, 75, 2], false).unwrap(), "<pad><s>H</s>");
        assert_eq!(t.decode(&[198], true).unwrap(), "\u{FFFD}");
        assert_eq!(
            t.decode(&[75, 259], true),
            Err(TokenizerError::UnknownToken {
                id: 259,
                vocab_size: 259
            })
        );
        assert_eq!(t.eos_token_ids(), &[2]);
        assert_eq!(t.bos_token_id(), Some(1));
        assert_eq!(t.vocab_size(), 259);
        assert_eq!(t.token_bytes(3), Some(vec![0]));
        assert_eq!(t.token_bytes(258), Some(vec![255]));
        assert_eq!(t.token_bytes(2), Some(b"</s>".to_vec()));
        assert_eq!(t.token_bytes(259), None);
        assert_eq!(t.token_to_piece(198).as_deref(), Some("\u{FFFD}"));
        assert!(t.is_special(0) && t.is_special(2) && !t.is_special(3));
    }

    #[test]
    fn chat_format_is_exact() {
        let t = ByteTokenizer;
        let msgs = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("Hi!"),
            ChatMessage::assistant("Hello."),
            ChatMessage::new(Role::Developer, "dev"),
        ];
        assert_eq!(
            t.apply_chat_template(&msgs, true).unwrap(),
            "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\nHello.\n<|system|>\ndev\n<|assistant|>\n"
        );
        assert_eq!(
            t.apply_chat_template(&msgs[1..2], false).unwrap(),
            "<|user|>\nHi!\n"
        );
        assert_eq!(t.chat_caps(), TemplateCaps::default());
    }
}
