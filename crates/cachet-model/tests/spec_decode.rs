//! Speculative decoding on the real default model (SmolLM2-135M-Instruct Q4_1, skipped with a
//! message when absent), driven by the core's scheduler: greedy text identical with and
//! without prompt-lookup drafts, seeded sampled text identical, and drafts really accepted on
//! a copying prompt.

use cachet_core::spec_decode::{SpecConfig, SpecDecodeStats};
use cachet_core::{
    Executor, HashSeed, RequestDraft, SamplingParams, Scheduler, SchedulerConfig, TokenId,
};
use cachet_model::{default_model_path, load_model, ExecutorConfig, KvDtype, LoadOptions};

const BLOCK: usize = 16;

/// Runs one request to the end; returns its output tokens and the speculation totals.
fn generate(
    m: &cachet_model::LoadedModel,
    prompt: &[TokenId],
    sampling: SamplingParams,
    spec: Option<SpecConfig>,
) -> (Vec<TokenId>, SpecDecodeStats, usize) {
    let mut exec = m
        .executor(ExecutorConfig {
            block_size: BLOCK,
            num_blocks: 128,
            kv_dtype: KvDtype::F16,
        })
        .expect("executor");
    let cfg = SchedulerConfig {
        block_size: BLOCK,
        num_blocks: 128,
        max_model_len: 2048,
        eos_token_ids: m.tokenizer.eos_token_ids(),
        speculative: spec,
        ..Default::default()
    };
    let seed = HashSeed::new(&exec.model_fingerprint(), BLOCK, &exec.kv_layout());
    let mut s = Scheduler::new(cfg, seed, ());
    let v = s
        .config()
        .limits()
        .validate(RequestDraft::new("r", prompt.to_vec(), sampling))
        .expect("valid");
    s.add_request(1, 0.0, v).expect("added");
    let mut out = Vec::new();
    let mut stats = SpecDecodeStats::default();
    let mut steps = 0;
    while s.has_unfinished() {
        let plan = s.schedule(0.0, None);
        let res = exec.execute(&s.exec_batch(&plan)).expect("execute");
        for u in s.update(&plan, res, 0.0) {
            out.extend(u.token.map(|t| t.token));
        }
        let st = s.take_spec_stats();
        stats.num_drafts += st.num_drafts;
        stats.num_draft_tokens += st.num_draft_tokens;
        stats.num_accepted_tokens += st.num_accepted_tokens;
        steps += 1;
    }
    (out, stats, steps)
}

const TEXT: &str = "fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n\nfn sub(a: u32, b: u32) -> u32 {\n    a - b\n}\n\nfn mul(a: u32, b: u32) -> u32 {\n    a * b\n}\n";

#[test]
fn greedy_and_seeded_output_is_identical_with_drafts() {
    let path = default_model_path();
    if !path.exists() {
        eprintln!("SKIP: default model {} not found", path.display());
        return;
    }
    let m = load_model(
        &path,
        &LoadOptions {
            threads: 2,
            progress: false,
            ..Default::default()
        },
    )
    .expect("load");
    let user = format!("Repeat this code exactly, renaming `mul` to `times`:\n\n{TEXT}");
    let text = m
        .tokenizer
        .apply_chat_template(&[cachet_model::ChatMessage::user(&user)], true)
        .expect("template");
    let prompt = m.tokenizer.encode(&text, true).expect("encode");
    let spec = Some(SpecConfig {
        num_speculative_tokens: 5,
        prompt_lookup_min: 1,
        prompt_lookup_max: 4,
        ..Default::default()
    });

    let greedy = SamplingParams::greedy(80);
    let (off, none, off_steps) = generate(&m, &prompt, greedy.clone(), None);
    let (on, st, on_steps) = generate(&m, &prompt, greedy, spec);
    assert!(none.is_zero());
    assert_eq!(on, off);
    // The answer copies the prompt's code: drafts are made and accepted, and the request
    // takes fewer steps (one per token without drafts; each accepted draft saves one, unless
    // it came after the stop).
    assert!(st.num_drafts > 0 && st.num_accepted_tokens > 0, "{st:?}");
    assert_eq!(off_steps, off.len());
    assert!(on_steps < off_steps);
    assert!(on_steps as u64 + st.num_accepted_tokens >= off_steps as u64);

    // Seeded sampling: the draw of output token i depends on (seed, i) only, and a chunk with
    // drafts attends token by token exactly as the decode steps it stands for, so its rows'
    // logits are bit-identical to plain decoding's and no seeded draw moves, at K = 1 and K = 5.
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(1234),
        ..SamplingParams::greedy(60)
    };
    let (off, ..) = generate(&m, &prompt, sampled.clone(), None);
    for k in [1, 5] {
        let cfg = Some(SpecConfig {
            num_speculative_tokens: k,
            prompt_lookup_min: 1,
            prompt_lookup_max: 4,
            ..Default::default()
        });
        let (on, st, _) = generate(&m, &prompt, sampled.clone(), cfg);
        assert_eq!(on, off, "K = {k}");
        assert!(st.num_accepted_tokens > 0, "K = {k}: {st:?}");
    }
}
