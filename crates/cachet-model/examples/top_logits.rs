//! Prints the top logits of the first generated position for a chat prompt (diagnostic).
use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, SamplingParams, SeqChunk};
use cachet_model::{
    default_model_path, load_model, ChatMessage, ExecutorConfig, KvDtype, LoadOptions,
};

fn main() {
    let prompt = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "Write a haiku about the sea.".into());
    let m = load_model(default_model_path(), &LoadOptions::default()).expect("load");
    let text = m
        .tokenizer
        .apply_chat_template(&[ChatMessage::user(prompt)], true)
        .expect("tpl");
    let ids = m.tokenizer.encode(&text, true).expect("enc");
    let mut e = m
        .executor(ExecutorConfig {
            block_size: 16,
            num_blocks: 64,
            kv_dtype: KvDtype::F32,
        })
        .expect("exec");
    let table: Vec<u32> = (0..64).collect();
    let params = SamplingParams::default();
    let batch = ExecBatch {
        copies: Vec::new(),
        loads: Vec::new(),
        seqs: vec![SeqChunk {
            prompt_logprobs: None,
            slot: 0,
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
            sample: Some(SampleSpec {
                forks: &[],
                drafts: &[],
                params: &params,
                prompt: &ids,
                output: &[],
            }),
        }],
    };
    let l = e.execute_logits(&batch).expect("run").remove(0);
    let mut idx: Vec<usize> = (0..l.len()).collect();
    idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    for &i in &idx[..5] {
        println!(
            "{i:6} {:10.4} {:?}",
            l[i],
            m.tokenizer.token_to_piece(i as u32).unwrap_or_default()
        );
    }
}
