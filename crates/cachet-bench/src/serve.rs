//! `cachet bench serve`: a load generator for any OpenAI- (or Anthropic-) compatible server.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::error::BenchError;
use crate::rng::Rng;
use crate::sse::{parse_anthropic, parse_openai, SseParser, StreamEvent, Usage};
use crate::stats::Summary;
use crate::workload::{self, Message, Workload, WorkloadKind, WorkloadParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `POST /v1/chat/completions`, streamed, with `stream_options.include_usage`.
    Openai,
    /// `POST /v1/messages`, streamed.
    Anthropic,
}

/// What load to generate (shared by `bench serve` and `bench compare`).
#[derive(Args, Clone, Debug)]
pub struct LoadArgs {
    #[command(flatten)]
    pub params: WorkloadParams,
    /// Poisson arrivals of sessions at this many per second (default: all at once).
    /// A session's later turns follow its previous answer immediately.
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Most requests in flight (default: --users for shared-prefix, 8 otherwise; unlimited
    /// with --request-rate).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Ask the server to ignore EOS so every request generates --max-tokens tokens.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub ignore_eos: bool,
    /// Tokens per word of the generated text (default: measured with the server's /tokenize,
    /// else 1.3).
    #[arg(long)]
    pub tokens_per_word: Option<f64>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

impl Default for LoadArgs {
    fn default() -> Self {
        LoadArgs {
            params: WorkloadParams::default(),
            request_rate: None,
            concurrency: None,
            max_tokens: 64,
            ignore_eos: true,
            tokens_per_word: None,
            request_timeout: 600.0,
            no_progress: false,
        }
    }
}

impl LoadArgs {
    pub fn effective_concurrency(&self, kind: WorkloadKind) -> Option<usize> {
        match (self.concurrency, self.request_rate) {
            (Some(c), _) => Some(c.max(1)),
            (None, Some(_)) => None,
            (None, None) if kind == WorkloadKind::SharedPrefix => Some(self.params.users.max(1)),
            (None, None) => Some(8),
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct ServeBenchArgs {
    /// Server root, e.g. http://127.0.0.1:8000
    #[arg(long)]
    pub base_url: String,
    #[arg(long, value_enum, default_value = "openai")]
    pub api: Api,
    #[arg(long, value_enum, default_value = "shared-prefix")]
    pub workload: WorkloadKind,
    #[command(flatten)]
    pub load: LoadArgs,
    /// Model name to send (default: the first of GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Name of the server in the report.
    #[arg(long)]
    pub label: Option<String>,
    /// Write the report (with every request's timings) as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Write a PNG chart (TTFT and inter-token latency distributions) here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// One request's measurements. Times in seconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestRecord {
    pub session: usize,
    pub turn: usize,
    /// Send time, from the start of the run.
    pub start_s: f64,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    /// Gaps between successive streamed token events.
    pub itl_s: Vec<f64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// Whether the server reported usage (prompt and cached tokens).
    pub usage_reported: bool,
    pub error: Option<String>,
    #[serde(skip)]
    pub text: String,
}

/// The result of one load run against one server.
#[derive(Clone, Debug, Serialize)]
pub struct ServeReport {
    pub label: String,
    pub base_url: String,
    pub api: Api,
    pub model: String,
    pub workload: WorkloadKind,
    pub params: WorkloadParams,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    pub concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub tokens_per_word: f64,
    pub num_requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub first_errors: Vec<String>,
    pub duration_s: f64,
    pub ttft_ms: Summary,
    pub itl_ms: Summary,
    /// Time per output token after the first: (e2e − ttft) / (output − 1), per request.
    pub tpot_ms: Summary,
    pub e2e_ms: Summary,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// cached_tokens / prompt_tokens over the requests that reported usage.
    pub cached_fraction: Option<f64>,
    /// Output tokens per second of wall time.
    pub output_throughput: f64,
    /// (prompt + output) tokens per second of wall time; prompt includes cached tokens.
    pub total_throughput: f64,
    pub request_throughput: f64,
    pub requests: Vec<RequestRecord>,
}

/// The HTTP client used for everything (no proxy: benchmarks talk to loopback servers).
pub fn http_client(timeout: Duration) -> Result<reqwest::Client, BenchError> {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        // A fresh connection per request: llama-server (cpp-httplib) closes idle keep-alive
        // connections, and reusing one it has just closed fails the request.
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|source| BenchError::Http {
            url: "client".into(),
            source,
        })
}

fn join(base: &str, path: &str) -> String {
    format!("{}{}", base.trim_end_matches('/'), path)
}

/// Counts tokens of `text` with the server's `POST /tokenize` (llama.cpp reads `content`,
/// cachet reads `prompt`; both fields are sent). `None` when unavailable.
pub async fn count_tokens(client: &reqwest::Client, base_url: &str, text: &str) -> Option<usize> {
    let body = json!({
        "content": text,
        "prompt": text,
        "add_special": false,
        "add_special_tokens": false,
    });
    let r = client
        .post(join(base_url, "/tokenize"))
        .json(&body)
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    let v: Value = r.json().await.ok()?;
    v.get("tokens")
        .and_then(Value::as_array)
        .map(Vec::len)
        .or_else(|| v.get("count").and_then(Value::as_u64).map(|c| c as usize))
}

/// Tokens per word of this crate's generated text, measured on 2,000 words.
pub async fn calibrate_tokens_per_word(
    client: &reqwest::Client,
    base_url: &str,
    seed: u64,
) -> Option<f64> {
    let n = 2000;
    let text = workload::words(&mut Rng::derive(seed, &[99]), n);
    let t = count_tokens(client, base_url, &text).await?;
    (t > 0).then(|| t as f64 / n as f64)
}

/// The first model id of `GET /v1/models`.
pub async fn fetch_model_name(client: &reqwest::Client, base_url: &str) -> Option<String> {
    let v: Value = client
        .get(join(base_url, "/v1/models"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    v["data"][0]["id"].as_str().map(str::to_string)
}

struct Target<'a> {
    client: &'a reqwest::Client,
    base_url: &'a str,
    api: Api,
    model: &'a str,
    max_tokens: u32,
    ignore_eos: bool,
    seed: u64,
}

fn request_body(t: &Target<'_>, messages: &[Message]) -> (String, Value) {
    match t.api {
        Api::Openai => {
            let mut b = json!({
                "model": t.model,
                "messages": messages,
                "max_tokens": t.max_tokens,
                "temperature": 0.0,
                "seed": t.seed,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
            if t.ignore_eos {
                b["ignore_eos"] = json!(true);
            }
            (join(t.base_url, "/v1/chat/completions"), b)
        }
        Api::Anthropic => {
            let system = messages
                .iter()
                .filter(|m| m.role == "system")
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n");
            let rest: Vec<&Message> = messages.iter().filter(|m| m.role != "system").collect();
            let mut b = json!({
                "model": t.model,
                "system": system,
                "messages": rest,
                "max_tokens": t.max_tokens,
                "temperature": 0.0,
                "stream": true,
            });
            if t.ignore_eos {
                b["ignore_eos"] = json!(true);
            }
            (join(t.base_url, "/v1/messages"), b)
        }
    }
}

async fn one_request(
    t: &Target<'_>,
    messages: &[Message],
    run_start: Instant,
) -> Result<RequestRecord, (RequestRecord, BenchError)> {
    let (url, body) = request_body(t, messages);
    let t0 = Instant::now();
    let mut rec = RequestRecord {
        start_s: (t0 - run_start).as_secs_f64(),
        ..Default::default()
    };
    let mut req = t.client.post(&url).json(&body);
    if t.api == Api::Anthropic {
        req = req.header("anthropic-version", "2023-06-01");
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(source) => return Err((rec, BenchError::Http { url, source })),
    };
    if !resp.status().is_success() {
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap_or_default();
        return Err((
            rec,
            BenchError::Status {
                url,
                status,
                body: body.chars().take(500).collect(),
            },
        ));
    }
    let mut stream = resp.bytes_stream();
    let mut parser = SseParser::new();
    let mut last_token: Option<Instant> = None;
    let mut token_events = 0u64;
    let mut usage = Usage::default();
    let mut saw_usage = false;
    let mut handle = |ev: StreamEvent, now: Instant, rec: &mut RequestRecord| {
        if let Some(e) = ev.error {
            return Err(BenchError::Stream(e));
        }
        if ev.is_token {
            token_events += 1;
            match last_token {
                None => rec.ttft_s = Some((now - t0).as_secs_f64()),
                Some(prev) => rec.itl_s.push((now - prev).as_secs_f64()),
            }
            last_token = Some(now);
            rec.text.push_str(&ev.text);
        }
        if let Some(u) = ev.usage {
            saw_usage = true;
            // Anthropic splits usage over two events; OpenAI sends it once.
            if u.prompt_tokens > 0 {
                usage.prompt_tokens = u.prompt_tokens;
                usage.cached_tokens = u.cached_tokens;
            }
            if u.completion_tokens > 0 {
                usage.completion_tokens = u.completion_tokens;
            }
        }
        Ok(())
    };
    let parse = |p: &str| match t.api {
        Api::Openai => parse_openai(p),
        Api::Anthropic => parse_anthropic(p),
    };
    while let Some(chunk) = stream.next().await {
        let now = Instant::now();
        let chunk = match chunk {
            Ok(c) => c,
            Err(source) => return Err((rec, BenchError::Http { url, source })),
        };
        for payload in parser.push(&chunk) {
            if let Err(e) = handle(parse(&payload), now, &mut rec) {
                return Err((rec, e));
            }
        }
    }
    if let Some(payload) = parser.finish() {
        if let Err(e) = handle(parse(&payload), Instant::now(), &mut rec) {
            return Err((rec, e));
        }
    }
    rec.e2e_s = t0.elapsed().as_secs_f64();
    rec.usage_reported = saw_usage && usage.prompt_tokens > 0;
    rec.prompt_tokens = usage.prompt_tokens;
    rec.cached_tokens = usage.cached_tokens;
    rec.output_tokens = if usage.completion_tokens > 0 {
        usage.completion_tokens
    } else {
        token_events
    };
    Ok(rec)
}

/// Runs `workload` against the server at `base_url` and summarises.
#[allow(clippy::too_many_arguments)]
pub async fn run_load(
    client: &reqwest::Client,
    base_url: &str,
    api: Api,
    model: &str,
    label: &str,
    workload: &Workload,
    load: &LoadArgs,
    tokens_per_word: f64,
) -> Result<ServeReport, BenchError> {
    let concurrency = load.effective_concurrency(workload.kind);
    let sem = Arc::new(Semaphore::new(
        concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let total = workload.num_requests();
    let pb = if load.no_progress {
        ProgressBar::hidden()
    } else {
        let pb = ProgressBar::new(total as u64);
        pb.set_style(
            ProgressStyle::with_template(
                "{prefix:>12} [{elapsed_precise}] {wide_bar} {pos}/{len} requests {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb.set_prefix(label.to_string());
        pb
    };
    // Session arrival times: all at 0, or a Poisson process.
    let mut arrivals = vec![0.0f64; workload.sessions.len()];
    if let Some(rate) = load.request_rate.filter(|r| *r > 0.0 && r.is_finite()) {
        let mut r = Rng::derive(load.params.seed, &[77]);
        let mut t = 0.0;
        for a in arrivals.iter_mut() {
            *a = t;
            t += r.exponential(rate);
        }
    }
    let records: Arc<Mutex<Vec<RequestRecord>>> = Arc::new(Mutex::new(Vec::new()));
    let errors: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let run_start = Instant::now();
    let mut tasks = Vec::new();
    for (session, arrival) in workload.sessions.iter().cloned().zip(arrivals) {
        let client = client.clone();
        let base_url = base_url.to_string();
        let model = model.to_string();
        let sem = sem.clone();
        let records = records.clone();
        let errors = errors.clone();
        let pb = pb.clone();
        let max_tokens = load.max_tokens;
        let ignore_eos = load.ignore_eos;
        let seed = load.params.seed;
        tasks.push(tokio::spawn(async move {
            let wait = Duration::from_secs_f64(arrival).saturating_sub(run_start.elapsed());
            tokio::time::sleep(wait).await;
            let target = Target {
                client: &client,
                base_url: &base_url,
                api,
                model: &model,
                max_tokens,
                ignore_eos,
                seed,
            };
            let mut answers = Vec::new();
            for turn in 0..session.user_turns.len() {
                let messages = session.messages(turn, &answers);
                let permit = sem.acquire().await.expect("semaphore closed");
                let res = one_request(&target, &messages, run_start).await;
                drop(permit);
                let mut rec = match res {
                    Ok(r) => r,
                    Err((mut r, e)) => {
                        let msg = error_chain(&e);
                        r.error = Some(msg.clone());
                        errors.lock().unwrap().push(msg);
                        r
                    }
                };
                rec.session = session.id;
                rec.turn = turn;
                answers.push(rec.text.clone());
                records.lock().unwrap().push(rec);
                pb.inc(1);
            }
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| BenchError::Stream(format!("task failed: {e}")))?;
    }
    let duration = run_start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let mut requests = std::mem::take(&mut *records.lock().unwrap());
    requests.sort_by_key(|r| (r.session, r.turn));
    let first_errors: Vec<String> = errors.lock().unwrap().iter().take(5).cloned().collect();
    Ok(summarise(
        SummaryInputs {
            label: label.to_string(),
            base_url: base_url.to_string(),
            api,
            model: model.to_string(),
            workload: workload.kind,
            load,
            concurrency,
            tokens_per_word,
            duration_s: duration,
            first_errors,
        },
        requests,
    ))
}

/// An error with its causes, `a: b: c`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

struct SummaryInputs<'a> {
    label: String,
    base_url: String,
    api: Api,
    model: String,
    workload: WorkloadKind,
    load: &'a LoadArgs,
    concurrency: Option<usize>,
    tokens_per_word: f64,
    duration_s: f64,
    first_errors: Vec<String>,
}

fn summarise(i: SummaryInputs<'_>, requests: Vec<RequestRecord>) -> ServeReport {
    let ok: Vec<&RequestRecord> = requests.iter().filter(|r| r.error.is_none()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
    let tpot: Vec<f64> = ok
        .iter()
        .filter(|r| r.output_tokens > 1)
        .filter_map(|r| {
            r.ttft_s
                .map(|t| (r.e2e_s - t) / (r.output_tokens - 1) as f64)
        })
        .collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s).collect();
    let prompt_tokens: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let with_usage: Vec<&&RequestRecord> = ok.iter().filter(|r| r.usage_reported).collect();
    let usage_prompt: u64 = with_usage.iter().map(|r| r.prompt_tokens).sum();
    let cached_tokens: u64 = with_usage.iter().map(|r| r.cached_tokens).sum();
    let d = i.duration_s.max(1e-9);
    ServeReport {
        label: i.label,
        base_url: i.base_url,
        api: i.api,
        model: i.model,
        workload: i.workload,
        params: i.load.params.clone(),
        max_tokens: i.load.max_tokens,
        ignore_eos: i.load.ignore_eos,
        concurrency: i.concurrency,
        request_rate: i.load.request_rate,
        tokens_per_word: i.tokens_per_word,
        num_requests: requests.len(),
        completed: ok.len(),
        failed: requests.len() - ok.len(),
        first_errors: i.first_errors,
        duration_s: i.duration_s,
        ttft_ms: Summary::of(&ttft).scaled(1e3),
        itl_ms: Summary::of(&itl).scaled(1e3),
        tpot_ms: Summary::of(&tpot).scaled(1e3),
        e2e_ms: Summary::of(&e2e).scaled(1e3),
        prompt_tokens,
        cached_tokens,
        output_tokens,
        cached_fraction: (usage_prompt > 0).then(|| cached_tokens as f64 / usage_prompt as f64),
        output_throughput: output_tokens as f64 / d,
        total_throughput: (prompt_tokens + output_tokens) as f64 / d,
        request_throughput: ok.len() as f64 / d,
        requests,
    }
}

/// Measures tokens/word (unless given) and builds the workload.
pub async fn prepare_workload(
    client: &reqwest::Client,
    base_url: &str,
    kind: WorkloadKind,
    load: &LoadArgs,
) -> (Workload, f64) {
    let tpw = match load.tokens_per_word {
        Some(t) => t,
        None => calibrate_tokens_per_word(client, base_url, load.params.seed)
            .await
            .unwrap_or(workload::DEFAULT_TOKENS_PER_WORD),
    };
    (workload::generate(kind, &load.params, tpw), tpw)
}

/// `cachet bench serve`, as an async function (the caller owns the runtime).
pub async fn bench_serve(args: &ServeBenchArgs) -> Result<ServeReport, BenchError> {
    let client = http_client(Duration::from_secs_f64(args.load.request_timeout))?;
    let (workload, tpw) =
        prepare_workload(&client, &args.base_url, args.workload, &args.load).await;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => fetch_model_name(&client, &args.base_url)
            .await
            .unwrap_or_else(|| "default".to_string()),
    };
    let label = args.label.clone().unwrap_or_else(|| args.base_url.clone());
    let report = run_load(
        &client,
        &args.base_url,
        args.api,
        &model,
        &label,
        &workload,
        &args.load,
        tpw,
    )
    .await?;
    if let Some(p) = &args.output_json {
        let s = serde_json::to_string_pretty(&report)?;
        std::fs::write(p, s).map_err(|e| BenchError::io(format!("writing {}", p.display()), e))?;
    }
    if let Some(p) = &args.plot {
        crate::plot::write_png(p, &[&report])?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_concurrency() {
        let mut l = LoadArgs::default();
        assert_eq!(l.effective_concurrency(WorkloadKind::SharedPrefix), Some(8));
        assert_eq!(l.effective_concurrency(WorkloadKind::Unique), Some(8));
        l.request_rate = Some(2.0);
        assert_eq!(l.effective_concurrency(WorkloadKind::Unique), None);
        l.concurrency = Some(3);
        assert_eq!(l.effective_concurrency(WorkloadKind::Unique), Some(3));
    }
}
