//! A minimal GGUF (v3) writer for the fuzz targets and their seeds, and the checks every
//! target runs on an opened file.

use std::io::Write;
use std::path::PathBuf;

use cachet_model::gguf::GgufFile;
use cachet_model::text::{ChatMessage, Role, TextTokenizer};
use cachet_model::{GgufTokenizer, KvDtype, LlamaConfig, LlamaWeights};

/// One metadata value.
pub enum Val {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(Vec<u8>),
    Strs(Vec<Vec<u8>>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

/// The bytes of a GGUF v3 file with `meta` and no tensors.
pub fn gguf_bytes(meta: &[(&str, Val)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut out, k.as_bytes());
        match v {
            Val::U32(x) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&x.to_le_bytes());
            }
            Val::I32(x) => {
                out.extend_from_slice(&5u32.to_le_bytes());
                out.extend_from_slice(&x.to_le_bytes());
            }
            Val::F32(x) => {
                out.extend_from_slice(&6u32.to_le_bytes());
                out.extend_from_slice(&x.to_le_bytes());
            }
            Val::Bool(x) => {
                out.extend_from_slice(&7u32.to_le_bytes());
                out.push(*x as u8);
            }
            Val::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                string(&mut out, s);
            }
            Val::Strs(a) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                for s in a {
                    string(&mut out, s);
                }
            }
            Val::I32s(a) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&5u32.to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                for x in a {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            Val::F32s(a) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&6u32.to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                for x in a {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
    }
    out
}

/// A file in the temporary directory the process reuses for every input.
pub fn scratch_file(bytes: &[u8]) -> PathBuf {
    let dir = std::env::var_os("CACHET_FUZZ_TMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let shm = PathBuf::from("/dev/shm");
            if shm.is_dir() {
                shm
            } else {
                std::env::temp_dir()
            }
        });
    let path = dir.join(format!("cachet-model-fuzz-{}.gguf", std::process::id()));
    let mut f = std::fs::File::create(&path).expect("scratch file");
    f.write_all(bytes).expect("write scratch file");
    path
}

/// Everything cachet does with a GGUF it opens, none of which may panic: the config, the KV
/// sizing, every tensor's bytes, the weights, the tokenizer.
pub fn exercise(f: &GgufFile) {
    let _ = f.fingerprint_header();
    let _ = f.tensor_bytes_total();
    if let Ok(c) = LlamaConfig::from_gguf(f) {
        let _ = c.kv_bytes_per_token(KvDtype::F16);
        let _ = c.num_blocks_for_memory(1 << 30, 16, KvDtype::F16);
    }
    let names: Vec<String> = f.tensor_names().map(str::to_string).collect();
    for n in &names {
        if let Ok((dims, _, bytes)) = f.tensor_raw(n) {
            assert!(!bytes.is_empty() || dims.iter().any(|&d| d == 0));
        }
    }
    let _ = LlamaWeights::load(f, false);
    if let Ok(t) = GgufTokenizer::from_gguf(f) {
        exercise_tokenizer(&t, "Hello world! 123 <|im_start|>user\n  é😀\u{0}");
    }
}

/// Encodes and decodes `text`, renders a chat: ids stay inside the vocabulary, nothing panics.
pub fn exercise_tokenizer(t: &GgufTokenizer, text: &str) {
    let n = t.vocab_size();
    if let Ok(ids) = t.encode(text, true) {
        assert!(
            ids.iter().all(|&i| (i as usize) < n),
            "an id outside the vocabulary"
        );
        let _ = t.decode(&ids, false);
        let _ = t.decode(&ids, true);
        for &i in &ids {
            assert!(t.token_bytes(i).is_some());
            let _ = TextTokenizer::token_to_piece(t, i);
        }
    }
    let _ = t.decode(&[0, u32::MAX], false);
    let chat = [
        ChatMessage::new(Role::System, "s"),
        ChatMessage::new(Role::User, text),
    ];
    let _ = t.apply_chat_template(&chat, true);
}
