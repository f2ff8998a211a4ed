//! The real Gemma 3 270M (Q4_K_M, `scripts/fetch-gemma3.sh`) against llama.cpp's greedy
//! continuations of the same file (`tests/fixtures/gemma3-270m-greedy.json`, recorded by
//! `scripts/peer/record-gemma3-fixture.py`; see `tests/fixtures/README.md`): the tokenizer
//! gives llama.cpp's prompt ids, and greedy decoding gives its tokens, for three short prompts
//! (32 tokens) and one of about 3,000 tokens (six sliding windows of 512).
//!
//! Skipped with a message when the model file is absent, except under CI (`CI` set), where
//! its absence fails the test. Ignored until the Q5_0 kernels (branch `formats`) are merged:
//! the file's Q/K/gate/up matrices are Q5_0; `cargo test -p cachet-model --test real_gemma3
//! -- --ignored` runs them.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use cachet_core::SamplingParams;
use cachet_model::{load_model, ExecutorConfig, KvDtype, LlamaExecutor, LoadOptions, LoadedModel};
use common::{generate_batched, Blocks, Req};

const BLOCK: usize = 16;
const FILE: &str = "gemma-3-270m-q4_k_m.gguf";

fn model_path() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("cachet").join(FILE)
}

fn model() -> Option<&'static LoadedModel> {
    static M: OnceLock<Option<LoadedModel>> = OnceLock::new();
    M.get_or_init(|| {
        let path = model_path();
        if !path.exists() {
            assert!(
                std::env::var_os("CI").is_none(),
                "{} not found under CI (scripts/fetch-gemma3.sh fetches it)",
                path.display()
            );
            eprintln!(
                "SKIP: {} not found (run scripts/fetch-gemma3.sh)",
                path.display()
            );
            return None;
        }
        let opts = LoadOptions {
            threads: 2,
            progress: false,
            ..Default::default()
        };
        Some(load_model(&path, &opts).expect("load gemma3"))
    })
    .as_ref()
}

struct Case {
    name: String,
    prompt: String,
    prompt_tokens: Vec<u32>,
    tokens: Vec<u32>,
}

fn fixture() -> Vec<Case> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3-270m-greedy.json");
    let text = std::fs::read_to_string(&path).expect("fixture");
    let v: serde_json::Value = serde_json::from_str(&text).expect("fixture json");
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .expect("array")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_string(),
            prompt: c["prompt"].as_str().expect("prompt").to_string(),
            prompt_tokens: ids(&c["prompt_tokens"]),
            tokens: ids(&c["tokens"]),
        })
        .collect()
}

fn exec(m: &LoadedModel) -> LlamaExecutor {
    m.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks: 512,
        kv_dtype: KvDtype::F16,
    })
    .expect("executor")
}

#[test]
#[ignore = "the file holds Q5_0 tensors: needs the Q5_0 kernels of branch `formats`"]
fn gemma3_config_matches_the_file() {
    let Some(m) = model() else { return };
    let c = &m.weights.config;
    assert_eq!(
        (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim),
        (18, 640, 4, 1, 256)
    );
    assert_eq!(c.context_length, 32_768);
    assert_eq!(c.vocab_size, 262_144);
    let global: Vec<usize> = (0..18)
        .filter(|&l| c.layers[l].kind == cachet_model::gguf::AttnKind::Full)
        .collect();
    assert_eq!(global, vec![5, 11, 17]);
    assert!(c.layers.iter().all(|l| match l.kind {
        cachet_model::gguf::AttnKind::Full => l.rope_base == 1_000_000.0,
        cachet_model::gguf::AttnKind::Sliding(w) => w == 512 && l.rope_base == 10_000.0,
    }));
    assert_eq!(c.attn_scale, 1.0 / 16.0);
    assert!(m.tokenizer.add_bos());
    assert_eq!(m.tokenizer.bos_token_id(), Some(2));
    let eos = m.tokenizer.eos_token_ids();
    assert!(
        eos.contains(&1) && eos.contains(&106),
        "<eos> and <end_of_turn>: {eos:?}"
    );
}

/// The chat prompt of a file without a template is Gemma's turn format.
#[test]
#[ignore = "the file holds Q5_0 tensors: needs the Q5_0 kernels of branch `formats`"]
fn gemma3_chat_uses_the_turn_format() {
    let Some(m) = model() else { return };
    let text = m
        .tokenizer
        .apply_chat_template(
            &[
                cachet_model::ChatMessage::system("Be brief."),
                cachet_model::ChatMessage::user("Hi"),
            ],
            true,
        )
        .expect("template");
    assert_eq!(
        text,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = m.tokenizer.encode(&text, false).expect("encode");
    assert_eq!(&ids[..3], &[2, 105, 2364], "{ids:?}");
    assert_eq!(&ids[ids.len() - 5..], &[106, 107, 105, 4368, 107]);
}

/// llama.cpp's prompt ids, then its greedy tokens, for every recorded prompt.
#[test]
#[ignore = "the file holds Q5_0 tensors: needs the Q5_0 kernels of branch `formats`"]
fn gemma3_greedy_matches_llama_cpp() {
    let Some(m) = model() else { return };
    let mut e = exec(m);
    let mut blocks = Blocks::new(512);
    for case in fixture() {
        let ids = m.tokenizer.encode(&case.prompt, true).expect("encode");
        assert_eq!(ids, case.prompt_tokens, "{}: prompt tokens", case.name);
        let mut reqs = vec![Req::new(ids, SamplingParams::greedy(64))];
        generate_batched(
            &mut e,
            &mut reqs,
            case.tokens.len(),
            512,
            BLOCK,
            &mut blocks,
            &[],
        );
        let ours = &reqs[0].output;
        eprintln!(
            "{}: {} prompt tokens -> {:?}",
            case.name,
            case.prompt_tokens.len(),
            m.tokenizer.decode(ours, false).unwrap_or_default()
        );
        assert_eq!(ours, &case.tokens, "{}: greedy tokens", case.name);
    }
}
