//! The tokenizer stored in a GGUF file, built with the `tokenizers` crate.
//!
//! Supported: byte-level BPE (`tokenizer.ggml.model = "gpt2"`) from `tokenizer.ggml.tokens` and
//! `tokenizer.ggml.merges`, with the pre-tokenizer chosen by `tokenizer.ggml.pre` (as in
//! llama.cpp's `LLAMA_VOCAB_PRE_TYPE`), a byte-level decoder, and control tokens (type 3) as
//! special added tokens. The chat template (`tokenizer.chat_template`, ChatML when absent) is a
//! [`cachet_text::ChatTemplate`]; [`GgufTokenizer`] implements [`cachet_text::TextTokenizer`].

use std::collections::HashMap;
use std::sync::Arc;

use cachet_text::{
    ChatMessage, ChatRequest, ChatTemplate, TemplateCaps, TextTokenizer, TokenizerError,
};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::NormalizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::gguf::{GgufFile, Value};
use crate::ModelError;

const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The chat format of a Gemma model whose file carries no template (llama.cpp's built-in
/// `gemma` template): `<start_of_turn>{user|model}\n{content}<end_of_turn>\n` turns, system
/// messages merged into the next user turn, contents trimmed; BOS first (the chat prompt is
/// encoded without added special tokens).
pub const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.sys = ns.sys + (m['content'] | trim) %}{% else %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}{{ '<start_of_turn>' + role + '\n' }}{% if ns.sys and role != 'model' %}{{ ns.sys + '\n\n' }}{% set ns.sys = '' %}{% endif %}{{ (m['content'] | trim) + '<end_of_turn>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// Token types of `tokenizer.ggml.token_type`.
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Names of end-of-generation tokens (as llama.cpp detects them).
const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
];

struct Inner {
    tk: Tokenizer,
    tokens: Vec<String>,
    bos: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    special: Vec<bool>,
    template: ChatTemplate,
    pre: String,
    kind: Kind,
}

/// Which tokenizer family a GGUF uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `gpt2`: byte-level BPE with merges.
    ByteLevel,
    /// `llama`: SentencePiece-style BPE over `▁`-joined text with `<0xNN>` byte fallback.
    Spm,
}

struct Spec<'a> {
    kind: Kind,
    tokens: Vec<String>,
    merges: Vec<(String, String)>,
    types: Vec<i64>,
    pre: &'a str,
    template: Option<&'a str>,
    bos: Option<u32>,
    eos: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_space_prefix: bool,
}

/// BPE merges equivalent to SentencePiece's score-driven merging: every split of a vocabulary
/// piece into two vocabulary pieces is a merge, ranked by the merged piece's score (higher
/// first), then by its id.
fn spm_merges(tokens: &[String], scores: &[f32], types: &[i64]) -> Vec<(String, String)> {
    let mergeable =
        |id: usize| matches!(types.get(id), Some(&t) if t == 1 || t == TOKEN_TYPE_USER_DEFINED);
    let vocab: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| mergeable(*i))
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut cands: Vec<(f32, usize, usize)> = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if !mergeable(id) {
            continue;
        }
        for (i, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(i);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                cands.push((scores.get(id).copied().unwrap_or(0.0), id, i));
            }
        }
    }
    cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    cands
        .into_iter()
        .map(|(_, id, i)| {
            let (l, r) = tokens[id].split_at(i);
            (l.to_string(), r.to_string())
        })
        .collect()
}

/// A GGUF model's tokenizer: cheap to clone (shared).
#[derive(Clone)]
pub struct GgufTokenizer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for GgufTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufTokenizer")
            .field("vocab_size", &self.inner.tokens.len())
            .field("pre", &self.inner.pre)
            .finish()
    }
}

fn tk_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

fn value_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => *x as i64,
        Value::I64(x) => *x,
        _ => return None,
    })
}

/// The pre-tokenizer for `tokenizer.ggml.pre`.
pub fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let split = |pat: &str| -> Result<PreTokenizerWrapper, ModelError> {
        let sp = Split::new(
            SplitPattern::Regex(pat.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tk_err)?;
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(sp),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ])))
    };
    match pre {
        "smollm" | "starcoder" | "refact" => {
            Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
            ])))
        }
        "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" => split(LLAMA3_PATTERN),
        "qwen2" | "deepseek-r1-qwen" => split(QWEN2_PATTERN),
        // "gpt2", "default" and anything unknown: GPT-2's byte-level regex (llama.cpp's default).
        _ => {
            let _ = GPT2_PATTERN;
            Ok(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
                false, true, true,
            )))
        }
    }
}

impl GgufTokenizer {
    /// Builds the tokenizer from GGUF metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let model = f.meta_str("tokenizer.ggml.model").unwrap_or("gpt2");
        let kind = match model {
            "gpt2" => Kind::ByteLevel,
            "llama" => Kind::Spm,
            other => {
                return Err(ModelError::Tokenizer(format!(
                    "tokenizer model '{other}' is not supported (supported: 'gpt2' byte-level BPE, \
                     'llama' SentencePiece-style BPE)"
                )))
            }
        };
        let tokens: Vec<String> = f
            .meta_array("tokenizer.ggml.tokens")
            .ok_or_else(|| ModelError::MissingMetadata("tokenizer.ggml.tokens".into()))?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(ModelError::Tokenizer("non-string token".into())),
            })
            .collect::<Result<_, _>>()?;
        let merges: Vec<(String, String)> = f
            .meta_array("tokenizer.ggml.merges")
            .unwrap_or(&[])
            .iter()
            .filter_map(|v| match v {
                Value::String(s) => s
                    .split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string())),
                _ => None,
            })
            .collect();
        let types: Vec<i64> = f
            .meta_array("tokenizer.ggml.token_type")
            .map(|a| a.iter().map(|v| value_i64(v).unwrap_or(1)).collect())
            .unwrap_or_else(|| vec![1; tokens.len()]);
        let merges = match kind {
            Kind::ByteLevel => merges,
            Kind::Spm => {
                let scores: Vec<f32> = f
                    .meta_array("tokenizer.ggml.scores")
                    .map(|a| {
                        a.iter()
                            .map(|v| match v {
                                Value::F32(x) => *x,
                                Value::F64(x) => *x as f32,
                                _ => 0.0,
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                spm_merges(&tokens, &scores, &types)
            }
        };
        let add_space_prefix = f
            .meta_bool("tokenizer.ggml.add_space_prefix")
            .unwrap_or(true);
        let pre = f
            .meta_str("tokenizer.ggml.pre")
            .unwrap_or("default")
            .to_string();
        // No template in the file: Gemma's turn format for Gemma models (as llama.cpp falls
        // back to), ChatML otherwise.
        let template = f.meta_str("tokenizer.chat_template").or_else(|| {
            f.meta_str("general.architecture")
                .filter(|a| a.starts_with("gemma"))
                .map(|_| GEMMA_TEMPLATE)
        });
        let id = |k: &str| {
            f.meta_u64(k)
                .map(|v| v as u32)
                .filter(|&v| (v as usize) < tokens.len())
        };
        let bos = id("tokenizer.ggml.bos_token_id");
        let eos = id("tokenizer.ggml.eos_token_id");
        let add_bos = f
            .meta_bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(kind == Kind::Spm);
        let mut eos_ids: Vec<u32> = Vec::new();
        for k in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(t) = id(k) {
                if !eos_ids.contains(&t) {
                    eos_ids.push(t);
                }
            }
        }
        for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
            if ty == TOKEN_TYPE_CONTROL
                && EOG_NAMES.contains(&t.as_str())
                && !eos_ids.contains(&(i as u32))
            {
                eos_ids.push(i as u32);
            }
        }
        Self::build(Spec {
            kind,
            tokens,
            merges,
            types,
            pre: &pre,
            template,
            bos,
            eos,
            eos_ids,
            add_bos,
            add_space_prefix,
        })
    }

    fn build(spec: Spec<'_>) -> Result<Self, ModelError> {
        let Spec {
            kind,
            tokens,
            merges,
            types,
            pre,
            template,
            bos,
            eos,
            eos_ids,
            add_bos,
            add_space_prefix,
        } = spec;
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut tk = match kind {
            Kind::ByteLevel => {
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .build()
                    .map_err(tk_err)?;
                let mut tk = Tokenizer::new(bpe);
                tk.with_pre_tokenizer(Some(pre_tokenizer_for(pre)?));
                tk.with_decoder(Some(ByteLevelDecoder::default()));
                tk
            }
            Kind::Spm => {
                let mut b = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .byte_fallback(true)
                    .fuse_unk(true);
                if let Some(unk) = types.iter().position(|&t| t == TOKEN_TYPE_UNKNOWN) {
                    b = b.unk_token(tokens[unk].clone());
                }
                let mut tk = Tokenizer::new(b.build().map_err(tk_err)?);
                let mut norms = Vec::new();
                if add_space_prefix {
                    norms.push(NormalizerWrapper::Prepend(Prepend::new("\u{2581}".into())));
                }
                norms.push(NormalizerWrapper::Replace(
                    Replace::new(" ", "\u{2581}").map_err(tk_err)?,
                ));
                tk.with_normalizer(Some(NormalizerWrapper::Sequence(NormSequence::new(norms))))
                    .map_err(tk_err)?;
                let mut decs = vec![
                    DecoderWrapper::Replace(Replace::new("\u{2581}", " ").map_err(tk_err)?),
                    DecoderWrapper::ByteFallback(ByteFallback::new()),
                    DecoderWrapper::Fuse(Fuse::new()),
                ];
                if add_space_prefix {
                    decs.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
                }
                tk.with_decoder(Some(DecoderSequence::new(decs)));
                tk
            }
        };
        let mut special = vec![false; tokens.len()];
        let mut specials = Vec::new();
        let mut user = Vec::new();
        for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
            if ty == TOKEN_TYPE_CONTROL {
                special[i] = true;
                specials.push(AddedToken::from(t.clone(), true));
            } else if ty == TOKEN_TYPE_USER_DEFINED {
                user.push(AddedToken::from(t.clone(), false).normalized(false));
            }
        }
        tk.add_special_tokens(specials).map_err(tk_err)?;
        if !user.is_empty() {
            tk.add_tokens(user).map_err(tk_err)?;
        }
        let text = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };
        let template = ChatTemplate::new(template, text(bos), text(eos))
            .map_err(|e| ModelError::Template(e.to_string()))?;
        Ok(GgufTokenizer {
            inner: Arc::new(Inner {
                tk,
                tokens,
                bos,
                eos_ids,
                add_bos,
                special,
                template,
                pre: pre.to_string(),
                kind,
            }),
        })
    }

    /// Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) are always
    /// recognised; `add_special_tokens` adds BOS when the model wants it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self.inner.tk.encode_fast(text, false).map_err(tk_err)?;
        let ids = enc.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 1);
        if add_special_tokens && self.inner.add_bos {
            if let Some(b) = self.inner.bos {
                out.push(b);
            }
        }
        out.extend_from_slice(ids);
        Ok(out)
    }

    /// Text of `ids` (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        let n = self.inner.tokens.len();
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= n) {
            return Err(ModelError::Tokenizer(format!(
                "token id {bad} outside the vocabulary ({n})"
            )));
        }
        self.inner
            .tk
            .decode(ids, skip_special_tokens)
            .map_err(tk_err)
    }

    /// Renders plain messages with the chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.render_chat(&ChatRequest::new(messages, add_generation_prompt))
    }

    /// Renders a chat (tools and all) with the chat template.
    pub fn render_chat(&self, chat: &ChatRequest<'_>) -> Result<String, ModelError> {
        self.inner
            .template
            .render(chat)
            .map_err(|e| ModelError::Template(e.to_string()))
    }

    /// The compiled chat template.
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.inner.template
    }

    /// Tokens that end generation (EOS, EOT and known end-of-turn control tokens).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_ids.clone()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos
    }

    /// Whether `encode(.., true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.inner.add_bos
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.tokens.len()
    }

    /// The `tokenizer.ggml.pre` value used.
    pub fn pre_tokenizer_name(&self) -> &str {
        &self.inner.pre
    }

    /// Whether `id` is a control (special) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .special
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// The vocabulary entry of `id` as stored (byte-level encoded, e.g. `Ġworld`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.inner.tokens.get(id as usize).map(String::as_str)
    }

    /// The raw bytes `id` stands for (control tokens: their text).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let t = self.token_text(id)?;
        if self.is_special(id) {
            return Some(t.as_bytes().to_vec());
        }
        if self.inner.kind == Kind::Spm {
            if let Some(b) = t
                .strip_prefix("<0x")
                .and_then(|r| r.strip_suffix('>'))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                return Some(vec![b]);
            }
            return Some(t.replace('\u{2581}', " ").into_bytes());
        }
        let map = byte_level_decoder_map();
        let mut out = Vec::with_capacity(t.len());
        for ch in t.chars() {
            match map.get(&ch) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(ch.encode_utf8(&mut [0u8; 4]).as_bytes()),
            }
        }
        Some(out)
    }

    /// The text of one token (lossy when it is part of a multi-byte character).
    pub fn token_to_piece(&self, id: u32) -> Result<String, ModelError> {
        let b = self.token_bytes(id).ok_or_else(|| {
            ModelError::Tokenizer(format!("token id {id} outside the vocabulary"))
        })?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// The underlying `tokenizers::Tokenizer`.
    pub fn hf_tokenizer(&self) -> &Tokenizer {
        &self.inner.tk
    }
}

/// GPT-2's byte ↔ unicode table, inverted: char → byte.
fn byte_level_decoder_map() -> &'static HashMap<char, u8> {
    static MAP: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    MAP.get_or_init(|| {
        let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .collect();
        let mut cs = bs.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !bs.contains(&b) {
                bs.push(b);
                cs.push(256 + n);
                n += 1;
            }
        }
        bs.iter()
            .zip(&cs)
            .filter_map(|(&b, &c)| char::from_u32(c).map(|c| (c, b as u8)))
            .collect()
    })
}

impl TextTokenizer for GgufTokenizer {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        GgufTokenizer::encode(self, text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        let vocab_size = self.inner.tokens.len();
        if let Some(&id) = ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(TokenizerError::UnknownToken { id, vocab_size });
        }
        GgufTokenizer::decode(self, ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos
    }

    fn vocab_size(&self) -> usize {
        self.inner.tokens.len()
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        GgufTokenizer::token_bytes(self, id)
    }

    fn is_special(&self, id: u32) -> bool {
        GgufTokenizer::is_special(self, id)
    }

    fn render_chat(&self, chat: &ChatRequest<'_>) -> Result<String, TokenizerError> {
        Ok(self.inner.template.render(chat)?)
    }

    fn chat_caps(&self) -> TemplateCaps {
        self.inner.template.caps()
    }
}
