//! Tokenizer of the default GGUF against ids recorded by an independent implementation
//! (`tests/data/tokenizer/gen_smollm2.py`: a pure-Python BPE cross-checked with HF `tokenizers`).

use std::sync::OnceLock;

use std::sync::Arc;

use cachet_model::text::{IncrementalDetokenizer, TemplateCaps, TextTokenizer, TokenizerError};
use cachet_model::{default_model_path, gguf::GgufFile, ChatMessage, GgufTokenizer};

fn tok() -> Option<&'static GgufTokenizer> {
    static T: OnceLock<Option<GgufTokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let path = default_model_path();
        if !path.exists() {
            eprintln!("SKIP: default model {} not found", path.display());
            return None;
        }
        let f = GgufFile::open(&path).expect("open gguf");
        Some(GgufTokenizer::from_gguf(&f).expect("tokenizer"))
    })
    .as_ref()
}

fn cases() -> Vec<(String, Vec<u32>)> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/tokenizer/smollm2.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).expect("read smollm2.json"))
            .expect("json");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let text = c["text"].as_str().expect("text").to_string();
            let ids = c["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect();
            (text, ids)
        })
        .collect()
}

#[test]
fn encodes_like_the_reference() {
    let Some(t) = tok() else { return };
    let cases = cases();
    assert!(cases.len() >= 10);
    for (text, ids) in &cases {
        assert_eq!(
            &t.encode(text, false).expect("encode"),
            ids,
            "ids of {text:?}"
        );
        assert_eq!(
            &t.decode(ids, false).expect("decode"),
            text,
            "round trip of {text:?}"
        );
    }
    assert_eq!(t.encode("Hello world", true).expect("encode")[0], 19556);
}

#[test]
fn special_tokens_and_metadata() {
    let Some(t) = tok() else { return };
    assert_eq!(t.vocab_size(), 49152);
    assert!(!t.add_bos());
    assert_eq!(t.bos_token_id(), Some(1));
    assert!(t.eos_token_ids().contains(&2), "<|im_end|> ends generation");
    assert_eq!(t.encode("<|im_start|>", false).expect("enc"), vec![1]);
    assert_eq!(t.decode(&[1, 19556, 2], true).expect("dec"), "Hello");
    assert_eq!(
        t.decode(&[1, 19556, 2], false).expect("dec"),
        "<|im_start|>Hello<|im_end|>"
    );
    assert_eq!(t.token_to_piece(905).expect("piece"), " world");
    assert_eq!(t.token_text(905), Some("Ġworld"));
    assert!(t.decode(&[1_000_000], false).is_err());
}

#[test]
fn chat_template_renders() {
    let Some(t) = tok() else { return };
    let s = t
        .apply_chat_template(&[ChatMessage::user("Hi!")], true)
        .expect("render");
    assert_eq!(
        s,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    );
    let s = t
        .apply_chat_template(
            &[ChatMessage::system("Be brief."), ChatMessage::user("Hi!")],
            false,
        )
        .expect("render");
    assert_eq!(
        s,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    );
}

#[test]
fn incremental_detokenizer_never_splits_characters() {
    let Some(t) = tok() else { return };
    let text = "Café 😀👍🏽 日本語 ok";
    let ids = t.encode(text, false).expect("encode");
    let shared: Arc<dyn TextTokenizer> = Arc::new(t.clone());
    let mut d = IncrementalDetokenizer::new(Arc::clone(&shared), false);
    let mut out = String::new();
    for &id in &ids {
        let piece = d.push(&[id]).expect("push");
        assert!(!piece.contains('\u{FFFD}'), "broken piece {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&d.flush().expect("flush"));
    assert_eq!(out, text);
    // Held back: the first byte token of a 4-byte emoji alone yields nothing.
    let emoji = t.encode("😀", false).expect("enc");
    assert_eq!(emoji, vec![10813, 242, 218]);
    let bytes: Vec<u8> = emoji
        .iter()
        .flat_map(|&i| t.token_bytes(i).expect("bytes"))
        .collect();
    assert_eq!(bytes, "😀".as_bytes());
    let mut d = IncrementalDetokenizer::new(t as &dyn TextTokenizer, true);
    assert_eq!(d.push(&emoji[..1]).expect("push"), "");
    assert_eq!(d.push(&emoji[1..2]).expect("push"), "");
    assert_eq!(d.push(&emoji[2..]).expect("push"), "😀");
}

/// A SentencePiece-style (`tokenizer.ggml.model = "llama"`) vocabulary written to a GGUF here,
/// with merges derived by hand from SentencePiece's rule (repeatedly merge the adjacent pair
/// whose merged piece has the highest score).
#[test]
fn spm_llama_vocab_from_gguf() {
    use candle_core::quantized::gguf_file::{self, Value};
    let mut pieces: Vec<(String, f32, i32)> = vec![
        ("<unk>".into(), 0.0, 2),
        ("<s>".into(), 0.0, 3),
        ("</s>".into(), 0.0, 3),
    ];
    for b in 0..=255u8 {
        pieces.push((format!("<0x{b:02X}>"), 0.0, 6));
    }
    for (p, sc) in [
        ("▁", -1.0),
        ("h", -3.0),
        ("e", -3.0),
        ("l", -3.0),
        ("o", -3.0),
        ("w", -3.0),
        ("r", -3.0),
        ("d", -3.0),
        ("ll", -2.0),
        ("▁h", -2.1),
        ("▁he", -1.5),
        ("▁hell", -1.2),
        ("▁hello", -1.0),
        ("▁w", -2.5),
        ("or", -2.6),
        ("▁wor", -2.0),
        ("ld", -2.7),
        ("▁world", -0.5),
    ] {
        pieces.push((p.into(), sc, 1));
    }
    let id = |p: &str| pieces.iter().position(|x| x.0 == p).expect("piece") as u32;
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(pieces.iter().map(|p| Value::String(p.0.clone())).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(pieces.iter().map(|p| Value::F32(p.1)).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(pieces.iter().map(|p| Value::I32(p.2)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
    ];
    let path = std::env::temp_dir().join(format!("cachet-spm-{}.gguf", std::process::id()));
    let mut f = std::fs::File::create(&path).expect("create");
    let refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut f, &refs, &[]).expect("write");
    drop(f);
    let t = GgufTokenizer::from_gguf(&GgufFile::open(&path).expect("open")).expect("tokenizer");

    assert_eq!(
        t.encode("hello world", false).expect("enc"),
        vec![id("▁hello"), id("▁world")]
    );
    assert!(t.add_bos());
    assert_eq!(t.encode("hello", true).expect("enc"), vec![1, id("▁hello")]);
    // Unknown characters fall back to their UTF-8 bytes.
    let hi = t.encode("hi é", false).expect("enc");
    assert_eq!(
        hi,
        vec![id("▁h"), id("<0x69>"), id("▁"), id("<0xC3>"), id("<0xA9>")]
    );
    assert_eq!(t.decode(&hi, false).expect("dec"), "hi é");
    assert_eq!(
        t.decode(&[id("▁hello"), id("▁world")], false).expect("dec"),
        "hello world"
    );
    assert_eq!(t.token_to_piece(id("▁world")).expect("piece"), " world");
    assert_eq!(t.token_bytes(id("<0xC3>")), Some(vec![0xC3]));
    assert_eq!(t.eos_token_ids(), vec![2]);
    // Streaming holds back the first byte of "é".
    let mut d = IncrementalDetokenizer::new(&t as &dyn TextTokenizer, false);
    let mut out = String::new();
    for &i in &hi {
        let piece = d.push(&[i]).expect("push");
        assert!(!piece.contains('\u{FFFD}'));
        out.push_str(&piece);
    }
    out.push_str(&d.flush().expect("flush"));
    assert_eq!(out, "hi é");
    // The leading space SentencePiece strips at the start is kept between words.
    let words = t.encode("hello world", false).expect("enc");
    let mut d = IncrementalDetokenizer::new(&t as &dyn TextTokenizer, false);
    assert_eq!(d.push(&words[..1]).expect("push"), "hello");
    assert_eq!(d.push(&words[1..]).expect("push"), " world");
    // The engine's stop strings see the text the detokenizer gives: no leading space.
    let vocab = std::sync::Arc::new(cachet_text::TokenBytes::new(&t));
    let stops = |list: &[&str]| {
        let list: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        cachet_text::TokenStops::new(&list, vocab.clone(), true, &[])
            .expect("stops")
            .expect("some")
    };
    assert!(stops(&["hello"]).ends_in_stop(&words[..1]));
    assert!(!stops(&[" hello"]).ends_in_stop(&words[..1]));
    assert!(stops(&["o w"]).ends_in_stop(&words));
    assert!(stops(&[" world"]).ends_in_stop(&words));
    let _ = std::fs::remove_file(&path);
}

/// The GGUF tokenizer through the shared trait, as the server holds it.
#[test]
fn gguf_tokenizer_through_the_text_trait() {
    let Some(t) = tok() else { return };
    let d: &dyn TextTokenizer = t;
    assert_eq!(d.vocab_size(), 49152);
    assert_eq!(d.bos_token_id(), Some(1));
    assert!(d.eos_token_ids().contains(&2));
    assert_eq!(
        d.encode("Hello world", false).expect("enc"),
        vec![19556, 905]
    );
    assert_eq!(d.decode(&[1, 19556, 2], true).expect("dec"), "Hello");
    assert_eq!(
        d.decode(&[19556, 1_000_000], false),
        Err(TokenizerError::UnknownToken {
            id: 1_000_000,
            vocab_size: 49152
        })
    );
    assert_eq!(d.token_bytes(905), Some(b" world".to_vec()));
    assert_eq!(d.token_to_piece(905).as_deref(), Some(" world"));
    assert!(d.is_special(1) && !d.is_special(905));
    // SmolLM2's template renders neither tools nor tool calls: the server's generic format
    // applies.
    assert_eq!(d.chat_caps(), TemplateCaps::default());
    let msgs = [ChatMessage::user("Hi!")];
    assert_eq!(
        d.apply_chat_template(&msgs, true).expect("render"),
        t.apply_chat_template(&msgs, true).expect("render")
    );
}
