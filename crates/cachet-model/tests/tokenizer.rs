//! Tokenizer of the default GGUF against ids recorded by an independent implementation
//! (`tests/data/tokenizer/gen_smollm2.py`: a pure-Python BPE cross-checked with HF `tokenizers`).

use std::sync::OnceLock;

use cachet_model::{
    default_model_path, gguf::GgufFile, ChatMessage, GgufTokenizer, IncrementalDetokenizer,
};

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
        .apply_chat_template(&[ChatMessage::new("user", "Hi!")], true)
        .expect("render");
    assert_eq!(
        s,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    );
    let s = t
        .apply_chat_template(
            &[
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi!"),
            ],
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
    let mut d = IncrementalDetokenizer::new(false);
    let mut out = String::new();
    for &id in &ids {
        let piece = d.push(t, &[id]).expect("push");
        assert!(!piece.contains('\u{FFFD}'), "broken piece {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&d.finish(t).expect("finish"));
    assert_eq!(out, text);
    // Held back: the first byte token of a 4-byte emoji alone yields nothing.
    let emoji = t.encode("😀", false).expect("enc");
    if emoji.len() > 1 {
        let mut d = IncrementalDetokenizer::new(false);
        assert_eq!(d.push(t, &emoji[..1]).expect("push"), "");
        assert_eq!(d.push(t, &emoji[1..]).expect("push"), "😀");
    }
}
