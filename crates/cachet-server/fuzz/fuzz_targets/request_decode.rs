//! Each route's request body type, decoded from arbitrary bytes and validated as the routes do
//! it (messages, sampling ranges per API, stop strings): never a panic; every failure a bounded
//! 4xx (`cachet_server_fuzz::check_error`).
#![no_main]

use cachet_server::anthropic::MessagesRequest;
use cachet_server::body::decode_json;
use cachet_server::openai::{convert_messages, ChatRequest, CommonParams, CompletionRequest};
use cachet_server::sampling::{build_sampling, check_cache_salt, Api, SamplingInput, StopField};
use cachet_server_fuzz::check_error;
use cachet_text::StopMatcher;
use libfuzzer_sys::fuzz_target;

fn sampling(c: &CommonParams, max_tokens: Option<u32>) -> SamplingInput {
    SamplingInput {
        max_tokens,
        temperature: c.temperature,
        top_p: c.top_p,
        top_k: c.top_k,
        min_p: c.min_p,
        seed: c.seed,
        presence_penalty: c.presence_penalty,
        frequency_penalty: c.frequency_penalty,
        repetition_penalty: c.repetition_penalty,
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        min_tokens: c.min_tokens,
        n: c.n,
        logprobs: None,
        logit_bias: c.logit_bias.clone(),
        // The byte tokenizer's vocabulary: bias keys are checked against it.
        vocab_size: 256,
        ..Default::default()
    }
}

fn stops(s: &Option<StopField>) {
    if let Some(s) = s.clone() {
        let _ = StopMatcher::new(s.into_vec());
    }
}

fn common(c: &CommonParams, max_tokens: Option<u32>) {
    match build_sampling(&sampling(c, max_tokens), Api::OpenAi, "max_tokens") {
        Ok((p, m)) => {
            assert!((0.0..=2.0).contains(&p.temperature));
            assert!(p.top_p > 0.0 && p.top_p <= 1.0);
            assert_eq!(m, max_tokens);
        }
        Err(e) => check_error(&e),
    }
    if let Err(e) = check_cache_salt(&c.cache_salt) {
        check_error(&e);
    }
    stops(&c.stop);
}

fuzz_target!(|data: &[u8]| {
    match decode_json::<ChatRequest>(data) {
        Ok(r) => {
            if let Err(e) = convert_messages(&r.messages) {
                check_error(&e);
            }
            common(&r.common, r.max_completion_tokens.or(r.common.max_tokens));
        }
        Err(e) => check_error(&e),
    }
    match decode_json::<CompletionRequest>(data) {
        Ok(r) => common(&r.common, r.common.max_tokens.or(Some(16))),
        Err(e) => check_error(&e),
    }
    match decode_json::<MessagesRequest>(data) {
        Ok(r) => {
            let input = SamplingInput {
                max_tokens: Some(r.max_tokens),
                temperature: r.temperature,
                top_p: r.top_p,
                top_k: r.top_k,
                ..Default::default()
            };
            match build_sampling(&input, Api::Anthropic, "max_tokens") {
                Ok((p, _)) => assert!((0.0..=1.0).contains(&p.temperature)),
                Err(e) => check_error(&e),
            }
            if let Some(s) = r.stop_sequences {
                let _ = StopMatcher::new(s);
            }
        }
        Err(e) => check_error(&e),
    }
});
