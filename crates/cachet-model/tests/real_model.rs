//! The real default model (SmolLM2-135M-Instruct Q4_1), skipped with a message when absent:
//! greedy tokens against candle-transformers' `quantized_llama` (an independent implementation),
//! prefix cache on vs off, and batch-of-8 vs alone.

mod common;

use std::sync::OnceLock;

use cachet_core::SamplingParams;
use cachet_model::{
    default_model_path, load_model, ExecutorConfig, KvDtype, LlamaExecutor, LoadOptions,
    LoadedModel,
};
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use common::{generate_batched, Blocks, Req};

const BLOCK: usize = 16;

fn model() -> Option<&'static LoadedModel> {
    static M: OnceLock<Option<LoadedModel>> = OnceLock::new();
    M.get_or_init(|| {
        let path = default_model_path();
        if !path.exists() {
            eprintln!(
                "SKIP: default model {} not found (run `make model`)",
                path.display()
            );
            return None;
        }
        Some(
            load_model(
                &path,
                &LoadOptions {
                    threads: 2,
                    progress: false,
                    full_fingerprint: true,
                },
            )
            .expect("load default model"),
        )
    })
    .as_ref()
}

fn exec(m: &LoadedModel, kv: KvDtype) -> LlamaExecutor {
    m.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks: 512,
        kv_dtype: kv,
    })
    .expect("executor")
}

fn chat(m: &LoadedModel, user: &str) -> Vec<u32> {
    let text = m
        .tokenizer
        .apply_chat_template(&[cachet_model::ChatMessage::new("user", user)], true)
        .expect("template");
    m.tokenizer.encode(&text, true).expect("encode")
}

const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Why is the sky blue?",
];

/// Greedy decoding with candle-transformers' quantized llama.
fn candle_greedy(prompt: &[u32], n: usize, eos: &[u32]) -> Vec<u32> {
    use candle_transformers::models::quantized_llama::ModelWeights;
    let path = default_model_path();
    let mut f = std::fs::File::open(&path).expect("open");
    let content = gguf_file::Content::read(&mut f).expect("read");
    let dev = Device::Cpu;
    let mut w = ModelWeights::from_gguf(content, &mut f, &dev).expect("candle model");
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    let mut pos = 0;
    while out.len() < n {
        let t = Tensor::new(input.as_slice(), &dev)
            .and_then(|t| t.unsqueeze(0))
            .expect("input");
        let logits = w
            .forward(&t, pos)
            .and_then(|l| l.squeeze(0))
            .and_then(|l| l.to_vec1::<f32>())
            .expect("forward");
        pos += input.len();
        let tok = cachet_model::sampling::argmax(&logits) as u32;
        out.push(tok);
        if eos.contains(&tok) {
            break;
        }
        input = vec![tok];
    }
    out
}

fn cachet_greedy(
    e: &mut LlamaExecutor,
    prompt: &[u32],
    n: usize,
    eos: &[u32],
    blocks: &mut Blocks,
) -> Vec<u32> {
    let mut reqs = vec![Req::new(prompt.to_vec(), SamplingParams::greedy(n as u32))];
    generate_batched(e, &mut reqs, n, 512, BLOCK, blocks, eos);
    reqs.remove(0).output
}

#[test]
fn greedy_matches_candle_quantized_llama() {
    let Some(m) = model() else { return };
    let eos = m.tokenizer.eos_token_ids();
    let mut e = exec(m, KvDtype::F32);
    let mut blocks = Blocks::new(512);
    for p in &PROMPTS[..3] {
        let ids = chat(m, p);
        let ours = cachet_greedy(&mut e, &ids, 32, &eos, &mut blocks);
        let theirs = candle_greedy(&ids, 32, &eos);
        eprintln!(
            "{p:?}\n  cachet: {:?}\n  candle: {:?}",
            m.tokenizer.decode(&ours, false),
            m.tokenizer.decode(&theirs, false)
        );
        assert_eq!(ours, theirs, "greedy tokens differ for {p:?}");
    }
}

#[test]
fn prefix_cache_hit_gives_same_greedy_output() {
    let Some(m) = model() else { return };
    let eos = m.tokenizer.eos_token_ids();
    let a = chat(
        m,
        "Tell me a short story about a robot who learns to paint.",
    );
    let b = chat(m, "Tell me a short story about a robot who learns to cook.");
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let cached = common / BLOCK * BLOCK;
    assert!(cached >= BLOCK, "prompts share {common} tokens");

    // Cache off: b from scratch in a fresh executor.
    let mut e_off = exec(m, KvDtype::F16);
    let mut blocks = Blocks::new(512);
    let off = cachet_greedy(&mut e_off, &b, 24, &eos, &mut blocks);

    // Cache on: a first, then b with a's first blocks in its table, computing only its suffix.
    let mut e_on = exec(m, KvDtype::F16);
    let mut blocks = Blocks::new(512);
    let mut ra = vec![Req::new(a.clone(), SamplingParams::greedy(4))];
    generate_batched(&mut e_on, &mut ra, 4, 512, BLOCK, &mut blocks, &eos);
    let mut rb = Req::new(b.clone(), SamplingParams::greedy(24));
    rb.blocks = ra[0].blocks[..cached / BLOCK].to_vec();
    rb.computed = cached;
    let mut rbs = vec![rb];
    generate_batched(&mut e_on, &mut rbs, 24, 512, BLOCK, &mut blocks, &eos);
    assert_eq!(rbs[0].output, off, "prefix-cached run differs");
}

#[test]
fn batch_of_8_equals_each_alone() {
    let Some(m) = model() else { return };
    let eos = m.tokenizer.eos_token_ids();
    let n = 16;
    let mut alone = Vec::new();
    let mut e = exec(m, KvDtype::F16);
    let mut blocks = Blocks::new(512);
    for p in PROMPTS {
        alone.push(cachet_greedy(&mut e, &chat(m, p), n, &eos, &mut blocks));
    }
    let mut e = exec(m, KvDtype::F16);
    let mut blocks = Blocks::new(512);
    let mut reqs: Vec<Req> = PROMPTS
        .iter()
        .map(|p| Req::new(chat(m, p), SamplingParams::greedy(n as u32)))
        .collect();
    // Chunked prefill (at most 23 tokens per request per step) mixed with decodes.
    generate_batched(&mut e, &mut reqs, n, 23, BLOCK, &mut blocks, &eos);
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(r.output, alone[i], "prompt {i} differs when batched");
    }
}

#[test]
fn seeded_sampling_is_batch_independent() {
    let Some(m) = model() else { return };
    let eos = m.tokenizer.eos_token_ids();
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(1234),
        max_tokens: 12,
        ..Default::default()
    };
    let prompt = chat(m, "Write a sentence about cats.");
    let mut e = exec(m, KvDtype::F16);
    let mut blocks = Blocks::new(512);
    let mut alone = vec![Req::new(prompt.clone(), params.clone())];
    generate_batched(&mut e, &mut alone, 12, 512, BLOCK, &mut blocks, &eos);
    let mut reqs = vec![
        Req::new(
            chat(m, "Hi"),
            SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
        ),
        Req::new(prompt, params),
    ];
    generate_batched(&mut e, &mut reqs, 12, 7, BLOCK, &mut blocks, &eos);
    assert_eq!(reqs[1].output, alone[0].output);
}

#[test]
fn model_info_of_default_model() {
    let Some(m) = model() else { return };
    assert_eq!(m.info.architecture, "llama");
    assert_eq!(m.info.vocab_size, 49152);
    assert_eq!(m.info.context_length, 8192);
    assert!(m.weights.output.is_none(), "SmolLM2 ties its embeddings");
    let e = exec(m, KvDtype::F16);
    use cachet_core::Executor;
    assert_eq!(e.kv_layout(), "f16:L30:KV3:D64");
}
