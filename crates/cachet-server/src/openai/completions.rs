//! `POST /v1/completions` and its `/render`.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::body::read_json;
use crate::cache_header::{final_prefill, with_cache_header};
use crate::error::{ApiError, OpenAiError};
use crate::fields::{check_rest, Route};
use crate::generate::{response_id, Generation};
use crate::tools::ToolPlan;
use crate::usage::{openai_usage, request_metrics_json};
use crate::AppState;

use super::choices::collect_choices;
use super::{
    constraint_for, now_secs, run, with_request_id, ChatTools, CompletionRequest, Echo, Kind,
    PromptField, Shape,
};

/// The token ids of each prompt of a completions request: exactly what `/v1/completions` runs.
fn completion_prompts(state: &AppState, prompt: &PromptField) -> Result<Vec<Vec<u32>>, ApiError> {
    let tok = state.tokenizer();
    let encode = |s: &str| {
        tok.encode(s, true)
            .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))
    };
    let check = |t: &[u32]| {
        if !t.is_empty() {
            tok.decode(t, false).map_err(|e| {
                ApiError::bad_param("prompt", format!("Invalid token ids in prompt: {e}"))
            })?;
        }
        Ok::<(), ApiError>(())
    };
    match prompt {
        PromptField::Text(s) => Ok(vec![encode(s)?]),
        PromptField::Tokens(t) => {
            check(t)?;
            Ok(vec![t.clone()])
        }
        PromptField::Texts(v) => v.iter().map(|s| encode(s)).collect(),
        PromptField::TokenLists(v) => v
            .iter()
            .map(|t| {
                check(t)?;
                Ok(t.clone())
            })
            .collect(),
    }
}

/// `POST /v1/completions/render`: one `{"request_id", "model", "token_ids"}` per prompt (vLLM
/// answers a list: a completions request may carry several prompts).
pub async fn completions_render(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: CompletionRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    let id = response_id(&headers, "cmpl-");
    let out: Vec<Value> = completion_prompts(&state, &req.prompt)?
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let rid = if i == 0 {
                id.clone()
            } else {
                format!("{id}-{i}")
            };
            json!({"request_id": rid, "model": model, "token_ids": t})
        })
        .collect();
    Ok(Json(Value::Array(out)).into_response())
}

pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let req: CompletionRequest = read_json(body, state.max_body_bytes()).await?;
    let model = state.check_model(req.common.model.as_deref())?;
    check_rest(Route::Completions, &req.rest)?;
    let prompts = completion_prompts(&state, &req.prompt)?;
    if prompts.is_empty() {
        return Err(
            ApiError::bad_param("prompt", "`prompt` must hold at least one prompt.").into(),
        );
    }
    let stream = req.common.stream.unwrap_or(false);
    if stream && prompts.len() > 1 {
        return Err(ApiError::bad_param(
            "prompt",
            "Several prompts are answered without streaming only; send `stream: false`.",
        )
        .into());
    }
    let echo = req.echo.unwrap_or(false);
    let max_tokens = req.common.max_tokens.or(Some(16));
    // Echoed logprobs, and `max_tokens: 0`, need the prompt's own logprobs.
    let mut common = req.common.clone();
    if echo && (req.logprobs.is_some() || max_tokens == Some(0)) && common.prompt_logprobs.is_none()
    {
        common.prompt_logprobs = Some(req.logprobs.unwrap_or(0));
    }
    if max_tokens == Some(0) && common.prompt_logprobs.is_none() {
        return Err(ApiError::bad_param(
            "max_tokens",
            "`max_tokens` 0 needs `echo` or `prompt_logprobs` (there is nothing else to return).",
        )
        .into());
    }
    // best_of: that many sequences from one prefill, the best `n` returned (never streamed).
    let n_wanted = req.common.n.unwrap_or(1).max(1) as usize;
    let mut best_of = None;
    if let Some(b) = req.best_of {
        if b == 0 || b > cachet_core::request::MAX_N || (b as usize) < n_wanted {
            return Err(ApiError::bad_param(
                "best_of",
                format!(
                    "`best_of` must be between `n` ({n_wanted}) and {} (got {b}).",
                    cachet_core::request::MAX_N
                ),
            )
            .into());
        }
        if b as usize > n_wanted {
            if stream {
                return Err(ApiError::bad_param(
                    "best_of",
                    "`best_of` > `n` cannot be streamed (the best are known at the end).",
                )
                .into());
            }
            common.n = Some(b);
            best_of = Some(b as usize);
        }
    }
    // Ranking needs every generated token's logprob, asked for when the client did not.
    let logprobs = match best_of {
        Some(_) => Some(req.logprobs.unwrap_or(0)),
        None => req.logprobs,
    };
    let id = response_id(&headers, "cmpl-");
    let tok = state.tokenizer().clone();
    let mut gens = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.into_iter().enumerate() {
        let mut input = common.sampling_input(max_tokens, logprobs);
        input.vocab_size = tok.vocab_size();
        input.zero_max_tokens = common.prompt_logprobs.is_some();
        let label = if i == 0 {
            id.clone()
        } else {
            format!("{id}-{i}")
        };
        let echo_of = echo.then(|| Echo {
            text: tok.decode(&prompt, false).unwrap_or_default(),
            ids: prompt.clone(),
        });
        let mut draft = common.draft(
            label,
            prompt,
            &input,
            "max_tokens",
            req.session_id.as_deref(),
        )?;
        draft.sampling.constraint = constraint_for(
            &state,
            &ToolPlan::none(state.agent().format),
            None,
            &common.guided(),
        )
        .await?;
        let gen = Generation::start_with(
            &state,
            draft,
            common.text_options(common.skip_special_tokens.unwrap_or(true)),
        )
        .await
        .map_err(ApiError::for_prompt)?;
        let shape = Shape {
            index_base: i * n_wanted,
            echo: echo_of,
            prompt_logprobs: req.common.prompt_logprobs.is_some(),
        };
        gens.push((gen, shape));
    }
    if gens.len() == 1 && best_of.is_none() {
        let Some((gen, shape)) = gens.pop() else {
            return Err(ApiError::Internal("no generation".into()).into());
        };
        return run(
            state,
            gen,
            model,
            Kind::Completion,
            ChatTools::NONE,
            shape,
            stream,
            common.include_usage(),
        )
        .await;
    }
    // Several prompts (or best_of): every request runs at once; one response with all the
    // choices.
    let single = gens.len() == 1;
    let keep_logprobs = req.logprobs.is_some();
    let runs = gens.into_iter().map(|(mut gen, shape)| {
        let tok = tok.clone();
        async move {
            let mut c = collect_choices(
                tok.as_ref(),
                &mut gen,
                Kind::Completion,
                ChatTools::NONE,
                &shape,
            )
            .await?;
            if best_of.is_some() {
                c.keep_best(n_wanted, shape.index_base, keep_logprobs);
            }
            Ok::<_, ApiError>(c)
        }
    });
    let results = futures_util::future::join_all(runs).await;
    let mut choices = Vec::new();
    let mut usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "created_cache_tokens": 0}});
    let mut metrics = Vec::new();
    let mut prefills = Vec::new();
    for r in results {
        let c = match r {
            Ok(c) => c,
            Err(e) => return Ok(with_request_id(e.openai_response(), &id)),
        };
        choices.extend(c.choices);
        let u = openai_usage(&c.last);
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            usage[k] = json!(usage[k].as_u64().unwrap_or(0) + u[k].as_u64().unwrap_or(0));
        }
        for k in [
            "cached_tokens",
            "cache_write_tokens",
            "created_cache_tokens",
        ] {
            let d = &u["prompt_tokens_details"][k];
            usage["prompt_tokens_details"][k] = json!(
                usage["prompt_tokens_details"][k].as_u64().unwrap_or(0) + d.as_u64().unwrap_or(0)
            );
        }
        metrics.push(request_metrics_json(&c.last));
        prefills.extend(final_prefill(&c.last).copied());
    }
    let mut body = json!({
        "id": id, "object": "text_completion", "created": now_secs(), "model": model,
        "choices": choices, "usage": usage,
    });
    if state.per_request_metrics() {
        // One prompt: one request's metrics; several: one object per prompt, in order.
        body["metrics"] = match (single, metrics.pop()) {
            (true, Some(m)) => m,
            (_, last) => {
                metrics.extend(last);
                Value::Array(metrics)
            }
        };
    }
    let resp = with_cache_header(Json(body).into_response(), &prefills);
    Ok(with_request_id(resp, &id))
}
