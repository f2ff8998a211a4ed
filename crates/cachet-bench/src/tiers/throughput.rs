//! Part 3: throughput of a shared-prefix workload (`cachet bench serve`'s generator) on one
//! instance using every core, on two one-thread instances behind one Redis (sessions split
//! between them), and on the same two without a shared tier.

use std::path::Path;
use std::time::Instant;

use serde_json::json;

use super::servers::{redis_flags, spawn, Http, RedisProc};
use super::{err, ThroughputRow, TiersArgs};
use crate::error::BenchError;
use crate::serve::{run_load, Api, LoadArgs, ServeReport};
use crate::stats::percentile_sorted;
use crate::workload::{Workload, WorkloadKind, WorkloadParams};

fn split(w: &Workload) -> (Workload, Workload) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for (i, s) in w.sessions.iter().enumerate() {
        if i % 2 == 0 {
            a.push(s.clone());
        } else {
            b.push(s.clone());
        }
    }
    (
        Workload {
            kind: w.kind,
            sessions: a,
        },
        Workload {
            kind: w.kind,
            sessions: b,
        },
    )
}

pub(super) async fn throughput_part(
    a: &TiersArgs,
    bin: &Path,
    model: &Path,
    redis_program: &Path,
    http: &Http,
) -> Result<Vec<ThroughputRow>, BenchError> {
    let params = WorkloadParams {
        users: a.users,
        turns: a.turns,
        system_tokens: a.system_tokens,
        ..WorkloadParams::default()
    };
    let load = LoadArgs {
        params: params.clone(),
        max_tokens: a.max_tokens,
        no_progress: true,
        ..LoadArgs::default()
    };
    let mut rows = Vec::new();
    let configs: [(&str, bool, bool); 3] = [
        ("one instance, every core", false, false),
        ("two instances (1 thread each), one Redis", true, true),
        ("two instances (1 thread each), no shared tier", true, false),
    ];
    for (name, two, shared) in configs {
        // A fresh Redis per configuration: nothing carried over.
        let redis = RedisProc::start(redis_program, &a.log_dir)?;
        let extra = if shared {
            redis_flags(&redis.url())
        } else {
            Vec::new()
        };
        let threads = if two { 1 } else { a.threads };
        let s1 = spawn(a, bin, model, "tp-a", threads, &extra, http).await?;
        let s2 = if two {
            Some(spawn(a, bin, model, "tp-b", threads, &extra, http).await?)
        } else {
            None
        };
        let (wl, tpw) = crate::serve::prepare_workload(
            &http.client,
            &s1.base_url,
            WorkloadKind::SharedPrefix,
            &load,
        )
        .await;
        let model_name = crate::serve::fetch_model_name(&http.client, &s1.base_url)
            .await
            .unwrap_or_else(|| "default".into());
        let model_name = model_name.as_str();
        // The shared system prompt was computed once before, on the first instance (and, with
        // the shared tier, written to Redis): the second instance finds it there or computes it.
        if let Some(sess) = wl.sessions.first() {
            let url = format!("{}/v1/chat/completions", s1.base_url);
            let body = json!({
                "model": model_name,
                "messages": [
                    {"role": "system", "content": sess.system},
                    {"role": "user", "content": "Hello."}
                ],
                "max_tokens": 1,
                "temperature": 0
            });
            let r = http
                .client
                .post(&url)
                .json(&body)
                .send()
                .await
                .map_err(|source| BenchError::Http {
                    url: url.clone(),
                    source,
                })?;
            if !r.status().is_success() {
                return Err(err(format!("{name}: warm-up request: {}", r.status())));
            }
            if shared {
                http.settled(&s1.base_url, 1.0).await?;
            }
        }
        let t0 = Instant::now();
        let reports: Vec<ServeReport> = match &s2 {
            None => vec![
                run_load(
                    &http.client,
                    &s1.base_url,
                    Api::Openai,
                    model_name,
                    name,
                    &wl,
                    &load,
                    tpw,
                )
                .await?,
            ],
            Some(s2) => {
                let (w1, w2) = split(&wl);
                let l1 = LoadArgs {
                    concurrency: Some(w1.sessions.len().max(1)),
                    ..load.clone()
                };
                let l2 = LoadArgs {
                    concurrency: Some(w2.sessions.len().max(1)),
                    ..load.clone()
                };
                let (r1, r2) = tokio::join!(
                    run_load(
                        &http.client,
                        &s1.base_url,
                        Api::Openai,
                        model_name,
                        name,
                        &w1,
                        &l1,
                        tpw
                    ),
                    run_load(
                        &http.client,
                        &s2.base_url,
                        Api::Openai,
                        model_name,
                        name,
                        &w2,
                        &l2,
                        tpw
                    )
                );
                vec![r1?, r2?]
            }
        };
        let dur = t0.elapsed().as_secs_f64();
        let mut redis_tokens = 0.0;
        for s in std::iter::once(&s1).chain(s2.as_ref()) {
            redis_tokens += http
                .metric(
                    &s.base_url,
                    "vllm:prompt_tokens_cached_by_source_total",
                    &[("source", "redis")],
                )
                .await;
        }
        let out: u64 = reports.iter().map(|r| r.output_tokens).sum();
        let prompt: u64 = reports.iter().map(|r| r.prompt_tokens).sum();
        let cached: u64 = reports.iter().map(|r| r.cached_tokens).sum();
        let completed: usize = reports.iter().map(|r| r.completed).sum();
        let failed: usize = reports.iter().map(|r| r.failed).sum();
        if failed > 0 {
            let first: Vec<&String> = reports.iter().flat_map(|r| &r.first_errors).collect();
            return Err(err(format!(
                "{name}: {failed} requests failed (first: {first:?})"
            )));
        }
        let mut ttfts: Vec<f64> = reports
            .iter()
            .flat_map(|r| r.requests.iter().filter_map(|q| q.ttft_s))
            .map(|t| t * 1e3)
            .collect();
        ttfts.sort_by(|a, b| a.total_cmp(b));
        rows.push(ThroughputRow {
            name: name.to_string(),
            requests: completed,
            duration_s: dur,
            output_tok_s: out as f64 / dur,
            total_tok_s: (out + prompt) as f64 / dur,
            cached_fraction: if prompt > 0 {
                cached as f64 / prompt as f64
            } else {
                0.0
            },
            redis_tokens: redis_tokens as u64,
            ttft_p50_ms: percentile_sorted(&ttfts, 50.0).unwrap_or(f64::NAN),
        });
        eprintln!(
            "[tiers] {name}: {:.1} output tok/s, {:.0} total tok/s",
            rows.last().map_or(0.0, |r| r.output_tok_s),
            rows.last().map_or(0.0, |r| r.total_tok_s)
        );
        drop(s2);
        drop(s1);
        drop(redis);
    }
    Ok(rows)
}
