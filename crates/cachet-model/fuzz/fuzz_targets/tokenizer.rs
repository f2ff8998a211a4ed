//! The GGUF tokenizer built from crafted metadata (vocabulary, merges, token types, scores,
//! model, pre-tokenizer, special ids, chat template), then encode / decode / chat rendering:
//! an error or a value, never a panic.
//!
//! Input: `flags bos eos 0xFE token 0xFF token ... 0xFE merge 0xFF merge ... 0xFE text`.
//! Flags: bit 0 `llama` (SentencePiece) model, else `gpt2`; bit 1 add_space_prefix; bits 2-3
//! the pre-tokenizer (default, smollm, llama-bpe, qwen2); bit 4 tokens in `<...>` are control
//! tokens; bit 5 scores; bit 6 a chat template from the text.
#![no_main]

use cachet_model::gguf::GgufFile;
use cachet_model::GgufTokenizer;
use cachet_model_fuzz::{exercise_tokenizer, gguf_bytes, scratch_file, Val};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [flags, bos, eos, rest @ ..] = data else {
        return;
    };
    let mut parts = rest.split(|&b| b == 0xFE);
    let _ = parts.next();
    let tokens: Vec<Vec<u8>> = parts
        .next()
        .unwrap_or_default()
        .split(|&b| b == 0xFF)
        .map(<[u8]>::to_vec)
        .collect();
    let merges: Vec<Vec<u8>> = parts
        .next()
        .unwrap_or_default()
        .split(|&b| b == 0xFF)
        .filter(|m| !m.is_empty())
        .map(<[u8]>::to_vec)
        .collect();
    let text = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let pre = ["default", "smollm", "llama-bpe", "qwen2"][((flags >> 2) & 3) as usize];
    let types: Vec<i32> = tokens
        .iter()
        .map(|t| {
            if flags & 16 != 0 && t.first() == Some(&b'<') && t.last() == Some(&b'>') {
                3
            } else {
                1
            }
        })
        .collect();
    let mut meta = vec![
        (
            "tokenizer.ggml.model",
            Val::Str(if flags & 1 != 0 {
                b"llama".to_vec()
            } else {
                b"gpt2".to_vec()
            }),
        ),
        ("tokenizer.ggml.pre", Val::Str(pre.as_bytes().to_vec())),
        ("tokenizer.ggml.tokens", Val::Strs(tokens.clone())),
        ("tokenizer.ggml.merges", Val::Strs(merges)),
        ("tokenizer.ggml.token_type", Val::I32s(types)),
        ("tokenizer.ggml.bos_token_id", Val::U32(*bos as u32)),
        ("tokenizer.ggml.eos_token_id", Val::U32(*eos as u32)),
        ("tokenizer.ggml.add_space_prefix", Val::Bool(flags & 2 != 0)),
    ];
    if flags & 32 != 0 {
        let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
        meta.push(("tokenizer.ggml.scores", Val::F32s(scores)));
    }
    if flags & 64 != 0 {
        meta.push((
            "tokenizer.chat_template",
            Val::Str(text.as_bytes().to_vec()),
        ));
    }
    let path = scratch_file(&gguf_bytes(&meta));
    let Ok(f) = GgufFile::open(&path) else {
        return;
    };
    if let Ok(t) = GgufTokenizer::from_gguf(&f) {
        exercise_tokenizer(&t, &text);
    }
});
