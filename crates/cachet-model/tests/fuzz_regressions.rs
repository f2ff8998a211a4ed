//! One test per failure the fuzz targets (`fuzz/`, run by `scripts/fuzz-smoke.sh`) found, and
//! the neighbouring cases the fixes cover: a crafted GGUF file is an error, never a panic.
//! The inputs the fuzzer found are kept in `fuzz/seeds/gguf/`.

use std::path::PathBuf;

use cachet_model::gguf::GgufFile;
use cachet_model::{GgufTokenizer, KvDtype, LlamaConfig, LlamaWeights, ModelError};
use candle_core::quantized::gguf_file::{self, Value};

fn temp(name: &str, bytes: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cachet-fuzz-regr-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

fn seed(name: &str) -> Vec<u8> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds/gguf")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A GGUF with `meta` and no tensors, written by candle.
fn gguf(meta: &[(&str, Value)]) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    let refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut out, &refs, &[]).unwrap();
    out.into_inner()
}

fn open(name: &str, bytes: &[u8]) -> Result<GgufFile, ModelError> {
    let p = temp(name, bytes);
    let r = GgufFile::open(&p);
    let _ = std::fs::remove_file(&p);
    r
}

/// fuzz/seeds/gguf/regression-elem-count-overflow.gguf: a tensor whose dimensions multiply
/// past 2^64. candle's `Shape::elem_count` overflowed (a panic with debug assertions, a wrong
/// size without) in `tensor_bytes_total`; the file is now refused when it is opened.
#[test]
fn tensor_dimensions_that_overflow_are_refused_at_open() {
    let e = open("overflow", &seed("regression-elem-count-overflow.gguf"))
        .err()
        .expect("an error");
    let msg = e.to_string();
    assert!(matches!(e, ModelError::Gguf(_)), "{msg}");
    assert!(
        msg.contains("overflows") || msg.contains("beyond the file end"),
        "{msg}"
    );
}

/// `general.alignment = 0`: the data offset is rounded up to it. Refused; 3 (not a power of
/// two) and a negative value (ggml requires a u32 power of two) too; 64 is fine.
#[test]
fn alignment_zero_or_not_a_power_of_two_is_an_error() {
    for a in [0u32, 3] {
        let e = open("align", &gguf(&[("general.alignment", Value::U32(a))]))
            .err()
            .expect("an error");
        assert!(
            e.to_string().contains(&format!("general.alignment {a}")),
            "{e}"
        );
    }
    for v in [Value::U8(0), Value::I32(0), Value::U16(0)] {
        assert!(open("align", &gguf(&[("general.alignment", v)])).is_err());
    }
    assert!(open("align", &gguf(&[("general.alignment", Value::U32(64))])).is_ok());
    assert!(open("align", &gguf(&[("general.alignment", Value::I32(-8))])).is_err());
}

/// A tensor declared past the end of the file is refused at open, not at first use.
#[test]
fn a_tensor_beyond_the_end_is_refused_at_open() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(b"GGUF");
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes()); // one tensor
    bytes.extend_from_slice(&0u64.to_le_bytes()); // no metadata
    bytes.extend_from_slice(&1u64.to_le_bytes());
    bytes.extend_from_slice(b"t");
    bytes.extend_from_slice(&1u32.to_le_bytes()); // one dimension
    bytes.extend_from_slice(&1024u64.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes()); // F32
    bytes.extend_from_slice(&0u64.to_le_bytes()); // offset 0
    let e = open("beyond", &bytes).err().expect("an error");
    assert!(e.to_string().contains("beyond the file end"), "{e}");
}

/// Dimensions no model has (here 2^40 layers) are a config error, not a huge allocation or an
/// overflow in the KV sizing.
#[test]
fn implausible_dimensions_are_a_config_error() {
    let base = |layers: u64| {
        gguf(&[
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", Value::U64(layers)),
            ("llama.embedding_length", Value::U32(64)),
            ("llama.attention.head_count", Value::U32(4)),
            ("llama.feed_forward_length", Value::U32(128)),
            ("llama.vocab_size", Value::U32(32)),
        ])
    };
    let f = open("layers", &base(1 << 40)).unwrap();
    let e = LlamaConfig::from_gguf(&f).expect_err("an error");
    assert!(e.to_string().contains("block_count"), "{e}");
    assert!(LlamaWeights::load(&f, false).is_err());
    let f = open("layers", &base(2)).unwrap();
    let c = LlamaConfig::from_gguf(&f).unwrap();
    // 2 (K and V) x 2 layers x 4 kv heads x 16 dims x 2 bytes.
    assert_eq!(c.kv_bytes_per_token(KvDtype::F16), 2 * 2 * 4 * 16 * 2);
    // Loading fails on the first missing tensor.
    assert!(matches!(
        LlamaWeights::load(&f, false),
        Err(ModelError::MissingTensor(_))
    ));
}

/// Garbage and truncations of a valid header are errors.
#[test]
fn truncated_headers_are_errors() {
    let good = gguf(&[
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
        ),
    ]);
    let f = open("good", &good).unwrap();
    assert!(GgufTokenizer::from_gguf(&f).is_ok());
    // The last byte of the header (the token "b"; candle pads the file after it).
    let last = good.iter().rposition(|&b| b == b'b').unwrap();
    for cut in [0, 3, 8, 20, good.len() / 2, last] {
        assert!(open("cut", &good[..cut]).is_err(), "cut at {cut}");
    }
}
