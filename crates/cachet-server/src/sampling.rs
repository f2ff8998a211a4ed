//! Validation of sampling options shared by the three generation routes.

use cachet_core::{RequestDraft, SamplingParams};
use serde::Deserialize;

use crate::error::ApiError;

/// `stop` may be a single string or a list of strings.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// The sampling knobs as they arrive, before validation.
#[derive(Clone, Debug, Default)]
pub struct SamplingInput {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub min_tokens: Option<u32>,
    pub n: Option<u32>,
    /// Alternatives per token; `Some(0)` means only the sampled token's log-probability.
    pub logprobs: Option<u32>,
    /// OpenAI `logit_bias`: token id (as a string key) → bias in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// The vocabulary size token ids are checked against (0: unchecked).
    pub vocab_size: usize,
    /// `max_tokens: 0` is allowed (the request wants only prompt logprobs).
    pub zero_max_tokens: bool,
}

/// Most entries in `logit_bias` (OpenAI's limit is 300 too).
pub const MAX_LOGIT_BIAS: usize = 300;

/// `logit_bias` as (token, bias) pairs: keys are token ids below `vocab_size`, values finite
/// and in [-100, 100].
pub fn parse_logit_bias(
    m: &std::collections::BTreeMap<String, f32>,
    vocab_size: usize,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |msg: String| ApiError::bad_param("logit_bias", msg);
    if m.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!(
            "`logit_bias` may hold at most {MAX_LOGIT_BIAS} tokens, got {}.",
            m.len()
        )));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, &v) in m {
        let id: u32 = k.trim().parse().map_err(|_| {
            bad(format!(
                "`logit_bias` keys must be token ids, got `{}`.",
                crate::error::clip(k)
            ))
        })?;
        if vocab_size > 0 && id as usize >= vocab_size {
            return Err(bad(format!(
                "Token id {id} in `logit_bias` is outside the vocabulary ({vocab_size})."
            )));
        }
        if !v.is_finite() || !(-100.0..=100.0).contains(&v) {
            return Err(bad(format!(
                "`logit_bias` values must be in [-100, 100], got {v} for token {id}."
            )));
        }
        out.push((id, v));
    }
    Ok(out)
}

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: u32 = 20;

fn finite(param: &str, v: f32) -> Result<f32, ApiError> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(ApiError::bad_param(
            param,
            format!("`{param}` must be a finite number."),
        ))
    }
}

/// Which API's ranges apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// OpenAI: `temperature` in [0, 2].
    OpenAi,
    /// Anthropic: `temperature` in [0, 1].
    Anthropic,
}

impl Api {
    fn max_temperature(self) -> f32 {
        match self {
            Api::OpenAi => 2.0,
            Api::Anthropic => 1.0,
        }
    }
}

/// Agents size their output limit for 200k-token models: on the Messages and Responses APIs
/// what the context leaves after the prompt is the most a request can write (a prompt that
/// fills the context stays the engine's 400; chat and text completions keep vLLM's 400).
pub fn clamp_to_context(max_tokens: u32, max_model_len: usize, prompt_len: usize) -> u32 {
    let room = max_model_len.saturating_sub(prompt_len);
    match u32::try_from(room) {
        _ if room == 0 => max_tokens,
        Ok(r) => max_tokens.min(r),
        Err(_) => max_tokens,
    }
}

/// Checks every sampling value against the API's ranges; returns the engine's parameters and
/// the requested `max_tokens` (`None`: fill the context). Whether the prompt and `max_tokens`
/// fit the model is the engine's one validation (`RequestLimits::validate`).
pub fn build_sampling(
    input: &SamplingInput,
    api: Api,
    max_tokens_param: &str,
) -> Result<(SamplingParams, Option<u32>), ApiError> {
    if let Some(n) = input.n {
        if n == 0 || n > cachet_core::request::MAX_N {
            return Err(ApiError::bad_param(
                "n",
                format!(
                    "`n` must be between 1 and {} (got {n}).",
                    cachet_core::request::MAX_N
                ),
            ));
        }
    }
    if input.max_tokens == Some(0) && !input.zero_max_tokens {
        return Err(ApiError::bad_param(
            max_tokens_param,
            format!("`{max_tokens_param}` must be at least 1."),
        ));
    }
    let temperature = finite("temperature", input.temperature.unwrap_or(1.0))?;
    let max_t = api.max_temperature();
    if !(0.0..=max_t).contains(&temperature) {
        return Err(ApiError::bad_param(
            "temperature",
            format!("`temperature` must be in [0, {max_t}]."),
        ));
    }
    let top_p = finite("top_p", input.top_p.unwrap_or(1.0))?;
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_param("top_p", "`top_p` must be in (0, 1]."));
    }
    let top_k = match input.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(ApiError::bad_param(
                "top_k",
                format!("`top_k` must be -1 (disabled) or positive, got {k}."),
            ))
        }
    };
    let min_p = finite("min_p", input.min_p.unwrap_or(0.0))?;
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad_param("min_p", "`min_p` must be in [0, 1]."));
    }
    let presence_penalty = finite("presence_penalty", input.presence_penalty.unwrap_or(0.0))?;
    if !(-2.0..=2.0).contains(&presence_penalty) {
        return Err(ApiError::bad_param(
            "presence_penalty",
            "`presence_penalty` must be in [-2, 2].",
        ));
    }
    let frequency_penalty = finite("frequency_penalty", input.frequency_penalty.unwrap_or(0.0))?;
    if !(-2.0..=2.0).contains(&frequency_penalty) {
        return Err(ApiError::bad_param(
            "frequency_penalty",
            "`frequency_penalty` must be in [-2, 2].",
        ));
    }
    let repetition_penalty = finite(
        "repetition_penalty",
        input.repetition_penalty.unwrap_or(1.0),
    )?;
    if repetition_penalty <= 0.0 {
        return Err(ApiError::bad_param(
            "repetition_penalty",
            "`repetition_penalty` must be positive.",
        ));
    }
    let min_tokens = input.min_tokens.unwrap_or(0);
    if let Some(lp) = input.logprobs {
        if lp > MAX_TOP_LOGPROBS {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("At most {MAX_TOP_LOGPROBS} log-probabilities per token can be requested, got {lp}."),
            ));
        }
    }
    let logit_bias = match &input.logit_bias {
        Some(m) => parse_logit_bias(m, input.vocab_size)?,
        None => Vec::new(),
    };
    let params = SamplingParams {
        max_tokens: input.max_tokens.unwrap_or(0),
        min_tokens,
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed: input.seed,
        stop_token_ids: input.stop_token_ids.clone(),
        ignore_eos: input.ignore_eos,
        logprobs: input.logprobs,
        logit_bias,
        constraint: None,
        // Set where the stop strings and the text options meet (`Generation::start_with`).
        stop_strings: None,
    };
    Ok((params, input.max_tokens))
}

/// `cache_salt` may be absent but never empty.
pub fn check_cache_salt(salt: &Option<String>) -> Result<(), ApiError> {
    match salt {
        Some(s) if s.is_empty() => Err(ApiError::bad_param(
            "cache_salt",
            "`cache_salt` must be a non-empty string.",
        )),
        _ => Ok(()),
    }
}

/// What every generation route checks before it builds an engine request, in one place.
pub struct DraftInput<'a> {
    pub label: String,
    pub prompt: Vec<u32>,
    pub sampling: &'a SamplingInput,
    pub api: Api,
    /// The field `max_tokens` came from (`max_tokens`, `max_completion_tokens`), for errors.
    pub max_tokens_param: &'a str,
    pub cache_salt: &'a Option<String>,
    pub session_id: Option<&'a str>,
}

/// The engine request of a route: sampling checked against the API's ranges, the cache salt
/// and the session id checked. The route sets what only it has (`n`, priority, prompt
/// logprobs, a grammar) on the result.
pub fn request_draft(input: DraftInput<'_>) -> Result<RequestDraft, ApiError> {
    let (sampling, max_tokens) = build_sampling(input.sampling, input.api, input.max_tokens_param)?;
    check_cache_salt(input.cache_salt)?;
    crate::generate::check_session_id(input.session_id)?;
    let mut d = RequestDraft::new(input.label, input.prompt, sampling);
    d.max_tokens = max_tokens;
    d.cache_salt = input.cache_salt.clone();
    d.session_id = input.session_id.map(std::sync::Arc::from);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(input: SamplingInput) -> (SamplingParams, Option<u32>) {
        build_sampling(&input, Api::OpenAi, "max_tokens").unwrap()
    }

    #[test]
    fn defaults() {
        let (p, m) = ok(SamplingInput::default());
        assert_eq!(m, None, "the engine fills the context");
        assert_eq!(p.temperature, 1.0);
        assert_eq!(p.top_k, 0);
    }

    #[test]
    fn rejects_bad_values() {
        let cases = [
            SamplingInput {
                max_tokens: Some(0),
                ..Default::default()
            },
            SamplingInput {
                temperature: Some(-0.1),
                ..Default::default()
            },
            SamplingInput {
                temperature: Some(2.5),
                ..Default::default()
            },
            SamplingInput {
                temperature: Some(f32::NAN),
                ..Default::default()
            },
            SamplingInput {
                top_p: Some(0.0),
                ..Default::default()
            },
            SamplingInput {
                top_p: Some(1.5),
                ..Default::default()
            },
            SamplingInput {
                top_k: Some(-2),
                ..Default::default()
            },
            SamplingInput {
                min_p: Some(1.5),
                ..Default::default()
            },
            SamplingInput {
                presence_penalty: Some(3.0),
                ..Default::default()
            },
            SamplingInput {
                frequency_penalty: Some(-3.0),
                ..Default::default()
            },
            SamplingInput {
                repetition_penalty: Some(0.0),
                ..Default::default()
            },
            SamplingInput {
                n: Some(0),
                ..Default::default()
            },
            SamplingInput {
                n: Some(65),
                ..Default::default()
            },
            SamplingInput {
                logprobs: Some(21),
                ..Default::default()
            },
        ];
        for c in cases {
            let e = build_sampling(&c, Api::OpenAi, "max_tokens").unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST, "{c:?}");
        }
    }

    #[test]
    fn temperature_range_is_the_apis() {
        let t = |v, api| {
            build_sampling(
                &SamplingInput {
                    temperature: Some(v),
                    ..Default::default()
                },
                api,
                "max_tokens",
            )
            .is_ok()
        };
        assert!(t(2.0, Api::OpenAi));
        assert!(!t(2.01, Api::OpenAi));
        assert!(t(1.0, Api::Anthropic));
        assert!(!t(1.5, Api::Anthropic));
        assert_eq!(
            ok(SamplingInput {
                top_k: Some(-1),
                n: Some(1),
                ..Default::default()
            })
            .0
            .top_k,
            0
        );
    }

    #[test]
    fn logit_bias_keys_and_range() {
        let m = |pairs: &[(&str, f32)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        assert_eq!(
            parse_logit_bias(&m(&[("50", -100.0), ("7", 2.5)]), 100).unwrap(),
            vec![(50, -100.0), (7, 2.5)]
        );
        for bad in [
            m(&[("x", 1.0)]),
            m(&[("100", 1.0)]),
            m(&[("5", 100.5)]),
            m(&[("5", -101.0)]),
            m(&[("5", f32::NAN)]),
        ] {
            let e = parse_logit_bias(&bad, 100).unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn cache_salt() {
        assert!(check_cache_salt(&Some(String::new())).is_err());
        assert!(check_cache_salt(&Some("t".into())).is_ok());
        assert!(check_cache_salt(&None).is_ok());
    }
}
