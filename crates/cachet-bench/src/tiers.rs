//! `cachet bench tiers`: what the external KV tiers buy, on the real model.
//!
//! 1. **Time to first token** of a prompt of `--prompt-tokens` (2,000) random token ids,
//!    through `cachet serve` over HTTP, three ways, in interleaved rounds (the order rotates each
//!    round): *computed* (a fresh prompt), *host* (the prompt's blocks were evicted from a pool
//!    that holds one prompt, into the host tier; loading it back evicts the filler prompt, whose
//!    blocks are copied to the host tier first), *Redis* (another instance computed the prompt
//!    and wrote it to a `redis-server` on loopback). Every loaded answer is checked: the same
//!    first token as computing, `floor((N-1)/16)*16` external tokens from the right tier.
//! 2. **Where the time goes** in a load, in-process (the same engine core, executor and tier
//!    client as the server, without HTTP): each engine step timed, the tier's own time, the
//!    copy of 124 blocks out of the arena, and the 16 tokens that are computed after a load.
//! 3. **Throughput of a shared-prefix workload** (`cachet bench serve`'s generator): one instance
//!    on every core; two instances of one thread each, behind one Redis (sessions split between
//!    them); and the same two without a shared tier.
//!
//! Writes section `cachet-bench-tiers` of `docs/benchmarks.md` unless `--no-doc`.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cachet_core::{Executor, RequestDraft, SamplingParams, SchedulerConfig};
use cachet_engine::core_loop::{CoreOptions, EngineCore};
use cachet_engine::tier::KvTier;
use cachet_model::executor::{ExecutorConfig, KvDtype, LlamaExecutor};
use cachet_model::{LoadOptions, LoadedModel};
use cachet_tiers::{EngineTier, RedisConfig, RedisTarget, TierClient, TierConfig, TierNamespace};
use clap::Args;
use serde::Serialize;
use serde_json::{json, Value};

use crate::compare::{free_port, ServerProc};
use crate::error::BenchError;
use crate::rng::Rng;
use crate::serve::{http_client, run_load, Api, LoadArgs, ServeReport};
use crate::stats::percentile_sorted;
use crate::workload::{Workload, WorkloadKind, WorkloadParams};

const BLOCK: usize = 16;

#[derive(Args, Clone, Debug)]
pub struct TiersArgs {
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Tokens of the prompt whose time to first token is measured.
    #[arg(long, default_value_t = 2000)]
    pub prompt_tokens: usize,
    /// Interleaved rounds of the TTFT measurement (and of the in-process breakdown).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Compute threads of each single instance (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The `cachet` binary to serve with (default: this executable).
    #[arg(long)]
    pub cachet_bin: Option<PathBuf>,
    /// `redis-server` to start on a loopback port.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: PathBuf,
    /// Shared-prefix workload: users (sessions), split between the two instances.
    #[arg(long, default_value_t = 8)]
    pub users: usize,
    /// Shared-prefix workload: turns per user.
    #[arg(long, default_value_t = 2)]
    pub turns: usize,
    /// Shared-prefix workload: tokens of the shared system prompt.
    #[arg(long, default_value_t = 1500)]
    pub system_tokens: usize,
    /// Shared-prefix workload: output tokens per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Skip the shared-prefix throughput part.
    #[arg(long)]
    pub no_throughput: bool,
    /// Skip the in-process breakdown.
    #[arg(long)]
    pub no_breakdown: bool,
    #[arg(long, default_value = "docs/benchmarks.md")]
    pub doc: PathBuf,
    /// Do not write docs/benchmarks.md.
    #[arg(long)]
    pub no_doc: bool,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    #[arg(long, default_value = "/tmp/cachet-bench-logs")]
    pub log_dir: PathBuf,
}

/// Milliseconds of one case over the rounds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Spread {
    pub samples: Vec<f64>,
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    fn of(samples: Vec<f64>) -> Spread {
        let mut v = samples.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let p = |q| percentile_sorted(&v, q).unwrap_or(f64::NAN);
        Spread {
            median: p(50.0),
            p10: p(10.0),
            p90: p(90.0),
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
            samples,
        }
    }
}

/// One TTFT case: the server's `time_to_first_token_ms` and the client's wall time.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TtftCase {
    pub name: String,
    pub server_ms: Spread,
    pub client_ms: Spread,
    /// External tokens of each loaded answer (0 for computing).
    pub external_tokens: Vec<u64>,
}

/// One phase of the in-process breakdown.
#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub name: String,
    pub ms: Spread,
}

#[derive(Clone, Debug, Serialize)]
pub struct ThroughputRow {
    pub name: String,
    pub requests: usize,
    pub duration_s: f64,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
    pub cached_fraction: f64,
    /// Prompt tokens loaded from Redis (from the instances' `/metrics`).
    pub redis_tokens: u64,
    pub ttft_p50_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TiersReport {
    pub model: String,
    pub prompt_tokens: usize,
    pub loaded_tokens: usize,
    pub rounds: usize,
    pub threads: usize,
    pub cpus: usize,
    pub block_bytes: u64,
    pub ttft: Vec<TtftCase>,
    pub breakdown: Vec<Phase>,
    pub throughput: Vec<ThroughputRow>,
    /// Why the shared-prefix workload has no rows, when it failed.
    pub throughput_error: Option<String>,
    pub load_average: String,
}

/// A `redis-server` child on a loopback port, killed on drop.
struct RedisProc {
    port: u16,
    child: Child,
    dir: PathBuf,
}

impl RedisProc {
    fn start(program: &Path, log_dir: &Path) -> Result<RedisProc, BenchError> {
        let port = free_port()?;
        let dir = log_dir.join(format!("redis-{port}"));
        std::fs::create_dir_all(&dir)
            .map_err(|e| BenchError::io(format!("creating {}", dir.display()), e))?;
        let child = Command::new(program)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                BenchError::io(
                    format!(
                        "starting {} (install redis-server: scripts/test-deps-redis.sh)",
                        program.display()
                    ),
                    e,
                )
            })?;
        let r = RedisProc { port, child, dir };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(r);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(BenchError::Peer(
            "redis-server did not accept connections".into(),
        ))
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn err(msg: impl Into<String>) -> BenchError {
    BenchError::Peer(msg.into())
}

/// `n` random token ids of a prompt that shares nothing with another seed's.
fn prompt_ids(seed: u64, n: usize) -> Vec<u32> {
    let mut r = Rng::derive(seed, &[0x71e5]);
    (0..n).map(|_| 1000 + r.below(39_000) as u32).collect()
}

/// The host case's pool: the prompt's blocks and one more, so that a filler prompt of
/// [`filler_tokens`] takes every block (the prompt is evicted whole, into the host tier) and
/// loading the prompt back evicts the filler in turn.
fn host_pool_blocks(n: usize) -> usize {
    n.div_ceil(BLOCK) + 1
}

/// The longest prompt the host pool holds (its KV fills every block; one token left for the
/// generated one).
fn filler_tokens(n: usize) -> usize {
    host_pool_blocks(n) * BLOCK - 1
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

// --- 1. TTFT through the binary -------------------------------------------------------------

struct Http {
    client: reqwest::Client,
}

/// What one `max_tokens: 1` completion reported.
struct Answer {
    token_text: String,
    server_ms: f64,
    client_ms: f64,
    prefix: Value,
}

impl Http {
    async fn complete(&self, base: &str, ids: &[u32]) -> Result<Answer, BenchError> {
        let url = format!("{base}/v1/completions");
        let t0 = Instant::now();
        let resp = self
            .client
            .post(&url)
            .json(&json!({"prompt": ids, "max_tokens": 1, "temperature": 0}))
            .send()
            .await
            .map_err(|source| BenchError::Http {
                url: url.clone(),
                source,
            })?;
        let status = resp.status();
        let v: Value = resp.json().await.map_err(|source| BenchError::Http {
            url: url.clone(),
            source,
        })?;
        let client_ms = t0.elapsed().as_secs_f64() * 1e3;
        if !status.is_success() {
            return Err(BenchError::Status {
                url,
                status: status.as_u16(),
                body: v.to_string(),
            });
        }
        Ok(Answer {
            token_text: v["choices"][0]["text"].as_str().unwrap_or("").to_string(),
            server_ms: v["metrics"]["time_to_first_token_ms"]
                .as_f64()
                .unwrap_or(f64::NAN),
            client_ms,
            prefix: v["metrics"]["prefix_cache"].clone(),
        })
    }

    async fn metric(&self, base: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
        let url = format!("{base}/metrics");
        let Ok(r) = self.client.get(&url).send().await else {
            return f64::NAN;
        };
        let text = r.text().await.unwrap_or_default();
        scrape(&text, name, labels)
    }

    /// Waits until the instance has no Redis save pending and at least `blocks` stored.
    async fn settled(&self, base: &str, blocks: f64) -> Result<(), BenchError> {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(60) {
            let saved = self
                .metric(
                    base,
                    "cachet:kv_tier_blocks_saved_total",
                    &[("tier", "redis")],
                )
                .await;
            let pending = self.metric(base, "cachet:kv_tier_saves_pending", &[]).await;
            if saved >= blocks && pending == 0.0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(err(format!("{base}: saves to Redis did not settle")))
    }
}

/// The sum of the samples of `name` whose labels include `labels`.
pub fn scrape(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut total = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((head, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, rest) = head.split_once('{').unwrap_or((head, ""));
        if n != name {
            continue;
        }
        if labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}

fn check_loaded(a: &Answer, want: &Answer, tier: &str, loaded: usize) -> Result<u64, BenchError> {
    let ext = a.prefix["external_cached_tokens"].as_u64().unwrap_or(0);
    let from = a.prefix["external_sources"][tier].as_u64().unwrap_or(0);
    if ext != loaded as u64 || from != ext {
        return Err(err(format!(
            "{tier}: expected {loaded} external tokens from {tier}, got {}",
            a.prefix
        )));
    }
    if a.token_text != want.token_text {
        return Err(err(format!(
            "{tier}: first token {:?} differs from computing ({:?})",
            a.token_text, want.token_text
        )));
    }
    Ok(ext)
}

struct Servers {
    compute: ServerProc,
    host: ServerProc,
    writer: ServerProc,
    reader: ServerProc,
}

fn serve_args(model: &Path, threads: usize, port: u16, extra: &[String]) -> Vec<String> {
    let mut v: Vec<String> = [
        "serve",
        "--model",
        &model.display().to_string(),
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--threads",
        &threads.to_string(),
        "--enable-per-request-metrics",
        "--log-stats-interval",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().cloned());
    v
}

async fn spawn(
    a: &TiersArgs,
    bin: &Path,
    model: &Path,
    name: &str,
    threads: usize,
    extra: &[String],
    http: &Http,
) -> Result<ServerProc, BenchError> {
    let port = free_port()?;
    let mut s = ServerProc::spawn(
        name,
        bin,
        &serve_args(model, threads, port, extra),
        port,
        &a.log_dir,
    )?;
    s.wait_healthy(&http.client, Duration::from_secs(180))
        .await?;
    Ok(s)
}

fn redis_flags(url: &str) -> Vec<String> {
    [
        "--kv-tier",
        "redis",
        "--kv-tier-redis-url",
        url,
        "--kv-tier-timeout-ms",
        "2000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

async fn ttft_part(
    a: &TiersArgs,
    bin: &Path,
    model: &Path,
    redis: &RedisProc,
    http: &Http,
) -> Result<Vec<TtftCase>, BenchError> {
    let n = a.prompt_tokens;
    let loaded = (n - 1) / BLOCK * BLOCK;
    let blocks = host_pool_blocks(n);
    let s = Servers {
        compute: spawn(a, bin, model, "compute", a.threads, &[], http).await?,
        host: spawn(
            a,
            bin,
            model,
            "host",
            a.threads,
            &[
                "--kv-tier".into(),
                "host".into(),
                "--num-kv-blocks".into(),
                blocks.to_string(),
            ],
            http,
        )
        .await?,
        writer: spawn(
            a,
            bin,
            model,
            "writer",
            a.threads,
            &redis_flags(&redis.url()),
            http,
        )
        .await?,
        reader: spawn(
            a,
            bin,
            model,
            "reader",
            a.threads,
            &redis_flags(&redis.url()),
            http,
        )
        .await?,
    };
    let mut cases: Vec<TtftCase> = ["computed", "host tier", "Redis (loopback)"]
        .iter()
        .map(|n| TtftCase {
            name: n.to_string(),
            ..Default::default()
        })
        .collect();
    let mut server = vec![Vec::new(); 3];
    let mut client = vec![Vec::new(); 3];
    let mut saved = 0.0;
    for round in 0..a.rounds {
        let p = prompt_ids(round as u64 * 2 + 1, n);
        let filler = prompt_ids(round as u64 * 2 + 2, filler_tokens(n));
        // The computed answer first (every loaded one is checked against it); the order of the
        // measured cases rotates.
        let want = http.complete(&s.compute.base_url, &p).await?;
        let mut order = [0usize, 1, 2];
        order.rotate_left(round % 3);
        for case in order {
            let got = match case {
                0 => {
                    let q = prompt_ids(1000 + round as u64, n);
                    http.complete(&s.compute.base_url, &q).await?
                }
                1 => {
                    http.complete(&s.host.base_url, &p).await?;
                    http.complete(&s.host.base_url, &filler).await?;
                    let got = http.complete(&s.host.base_url, &p).await?;
                    cases[1]
                        .external_tokens
                        .push(check_loaded(&got, &want, "host", loaded)?);
                    got
                }
                _ => {
                    http.complete(&s.writer.base_url, &p).await?;
                    saved += (loaded / BLOCK) as f64;
                    http.settled(&s.writer.base_url, saved).await?;
                    let got = http.complete(&s.reader.base_url, &p).await?;
                    cases[2]
                        .external_tokens
                        .push(check_loaded(&got, &want, "redis", loaded)?);
                    got
                }
            };
            server[case].push(got.server_ms);
            client[case].push(got.client_ms);
        }
        eprintln!(
            "[tiers] round {}/{}: computed {:.0} ms, host {:.1} ms, Redis {:.1} ms",
            round + 1,
            a.rounds,
            server[0].last().copied().unwrap_or(f64::NAN),
            server[1].last().copied().unwrap_or(f64::NAN),
            server[2].last().copied().unwrap_or(f64::NAN)
        );
    }
    for (i, c) in cases.iter_mut().enumerate() {
        c.server_ms = Spread::of(std::mem::take(&mut server[i]));
        c.client_ms = Spread::of(std::mem::take(&mut client[i]));
    }
    drop(s);
    Ok(cases)
}

// --- 2. Where the time goes (in-process) ----------------------------------------------------

struct Core {
    core: EngineCore<LlamaExecutor>,
    tier: Option<TierClient>,
    wake: std::sync::mpsc::Receiver<()>,
    next_handle: u64,
    cfg: SchedulerConfig,
}

/// The steps of one request up to its first token: (ms of each step, idle wait in between).
struct Steps {
    /// Every step, in order, with whether it executed anything.
    steps: Vec<(f64, bool)>,
    /// Time spent waiting for the tier between steps.
    waited_ms: f64,
    first: u32,
    report: Option<Box<cachet_core::Report>>,
}

impl Core {
    fn new(
        loaded: &LoadedModel,
        num_blocks: usize,
        tiers: Option<(bool, Option<String>)>,
    ) -> Result<Core, BenchError> {
        let exec = loaded.executor(ExecutorConfig {
            block_size: BLOCK,
            num_blocks,
            kv_dtype: KvDtype::F16,
        })?;
        let (tx, wake) = std::sync::mpsc::channel();
        let tier = match tiers {
            None => None,
            Some((host, redis)) => {
                let cfg = TierConfig {
                    namespace: TierNamespace {
                        model_fingerprint: exec.model_fingerprint(),
                        kv_layout: exec.kv_layout(),
                        block_size: BLOCK as u32,
                    },
                    spare_bytes: cachet_tiers::DEFAULT_SPARE_BYTES,
                    host: host.then_some(cachet_tiers::HostConfig {
                        capacity_bytes: 4 << 30,
                    }),
                    redis: redis.map(|url| RedisConfig {
                        target: RedisTarget::Single(url),
                        secret: None,
                        ttl: Some(Duration::from_secs(3600)),
                        budget_bytes: None,
                        timeout: Duration::from_secs(2),
                        save_queue: 1024,
                        probe_interval: Duration::from_secs(1),
                        key_prefix: "cachet-bench".into(),
                        ca_cert_pem: None,
                    }),
                };
                let c = TierClient::open(cfg).map_err(|e| err(e.to_string()))?;
                let tx = std::sync::Mutex::new(tx);
                c.set_load_notify(move || {
                    if let Ok(tx) = tx.lock() {
                        let _ = tx.send(());
                    }
                });
                Some(c)
            }
        };
        let cfg = SchedulerConfig {
            block_size: BLOCK,
            num_blocks,
            max_num_batched_tokens: 2048,
            max_model_len: num_blocks * BLOCK,
            eos_token_ids: Vec::new(),
            ..SchedulerConfig::default()
        };
        let core = EngineCore::new(
            cfg.clone(),
            exec,
            CoreOptions {
                tier: tier
                    .clone()
                    .map(|c| Box::new(EngineTier::new(c)) as Box<dyn KvTier>),
                ..Default::default()
            },
        );
        Ok(Core {
            core,
            tier,
            wake,
            next_handle: 1,
            cfg,
        })
    }

    /// Runs `prompt` to its first token (max_tokens 1).
    fn first_token(&mut self, prompt: &[u32], t0: Instant) -> Result<Steps, BenchError> {
        let h = self.next_handle;
        self.next_handle += 1;
        let d = RequestDraft::new(format!("b{h}"), prompt.to_vec(), SamplingParams::greedy(1));
        let v = self
            .cfg
            .limits()
            .validate(d)
            .map_err(|e| err(format!("{e:?}")))?;
        let now = move || t0.elapsed().as_secs_f64();
        self.core
            .add_request(h, now(), v)
            .map_err(|e| err(format!("{e:?}")))?;
        let mut out = Steps {
            steps: Vec::new(),
            waited_ms: 0.0,
            first: 0,
            report: None,
        };
        while self.wake.try_recv().is_ok() {}
        for _ in 0..10_000 {
            let s0 = Instant::now();
            let ups = self.core.step(now).map_err(|e| err(format!("step: {e}")))?;
            out.steps.push((
                s0.elapsed().as_secs_f64() * 1e3,
                !self.core.last_step_idle(),
            ));
            for u in ups {
                if u.first_token {
                    out.first = u.token.as_ref().map_or(0, |t| t.token);
                }
                if u.finish.is_some() {
                    out.report = u.report;
                    // Finished (max_tokens 1): drain until idle is not needed.
                    return Ok(out);
                }
            }
            if self.core.last_step_idle() {
                // As the core thread does: sleep until a load finishes (2 ms at most).
                let w0 = Instant::now();
                let _ = self.wake.recv_timeout(Duration::from_millis(2));
                out.waited_ms += w0.elapsed().as_secs_f64() * 1e3;
            }
        }
        Err(err("the request did not finish"))
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn breakdown_part(
    a: &TiersArgs,
    loaded: &LoadedModel,
    redis: &RedisProc,
) -> Result<Vec<Phase>, BenchError> {
    let n = a.prompt_tokens;
    let blocks = n.div_ceil(BLOCK) + 2;
    let t0 = Instant::now();
    let mut c = Core::new(loaded, 2 * blocks + 8, None)?;
    let mut h = Core::new(loaded, host_pool_blocks(n), Some((true, None)))?;
    let mut w = Core::new(loaded, 2 * blocks + 8, Some((false, Some(redis.url()))))?;
    let mut r = Core::new(loaded, 2 * blocks + 8, Some((false, Some(redis.url()))))?;
    let names = [
        "compute: the whole prompt (one step)",
        "compute: the last 16 tokens, 1984 cached locally (one step)",
        "copy 124 blocks out of the arena (save_block, fresh buffers)",
        "host: step 1 (lookup, allocate, offload the evicted filler, start the load)",
        "host: tier load (the client's own time)",
        "host: step 2 (write 124 blocks into the arena, compute 16 tokens)",
        "host: first token, in-process total",
        "Redis: step 1 (lookup: one EXISTS pipeline; allocate; start the load)",
        "Redis: tier load (MGET + verify, the client's own time)",
        "Redis: engine waiting for the load",
        "Redis: step 2 (write 124 blocks into the arena, compute 16 tokens)",
        "Redis: first token, in-process total",
    ];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for round in 0..a.rounds {
        let p = prompt_ids(5000 + round as u64 * 3, n);
        let filler = prompt_ids(5001 + round as u64 * 3, filler_tokens(n));
        // Computing, then the same prompt again (a local hit: only the last 16 tokens).
        let s = c.first_token(&p, t0)?;
        samples[0].push(s.steps.iter().map(|x| x.0).sum());
        let s = c.first_token(&p, t0)?;
        samples[1].push(s.steps.iter().map(|x| x.0).sum());
        // The copy of 124 blocks, as an offload does it.
        let bytes = c.core.executor().block_bytes();
        let k0 = Instant::now();
        let mut kept = Vec::with_capacity(n / BLOCK);
        for b in 0..(n - 1) / BLOCK {
            let mut buf = Vec::with_capacity(bytes);
            c.core
                .executor()
                .save_block(b as u32, &mut buf)
                .map_err(|e| err(e.to_string()))?;
            kept.push(buf);
        }
        samples[2].push(ms_since(k0));
        drop(kept);

        // Host: p computed, evicted by the filler, loaded back.
        h.first_token(&p, t0)?;
        h.first_token(&filler, t0)?;
        let before = h.tier.as_ref().map(|t| t.stats().host.load_seconds);
        let l0 = Instant::now();
        let s = h.first_token(&p, t0)?;
        let total = ms_since(l0);
        let after = h.tier.as_ref().map(|t| t.stats().host.load_seconds);
        check_report(&s, "host", (n - 1) / BLOCK * BLOCK)?;
        samples[3].push(s.steps.first().map_or(f64::NAN, |x| x.0));
        samples[4].push((after.unwrap_or(0.0) - before.unwrap_or(0.0)) * 1e3);
        samples[5].push(s.steps.last().map_or(f64::NAN, |x| x.0));
        samples[6].push(total);

        // Redis: w computes p and writes it; r loads it.
        w.first_token(&p, t0)?;
        if let Some(t) = &w.tier {
            t.flush(Duration::from_secs(30));
        }
        let before = r.tier.as_ref().map(|t| t.stats().redis.load_seconds);
        let l0 = Instant::now();
        let s = r.first_token(&p, t0)?;
        let total = ms_since(l0);
        let after = r.tier.as_ref().map(|t| t.stats().redis.load_seconds);
        check_report(&s, "redis", (n - 1) / BLOCK * BLOCK)?;
        samples[7].push(s.steps.first().map_or(f64::NAN, |x| x.0));
        samples[8].push((after.unwrap_or(0.0) - before.unwrap_or(0.0)) * 1e3);
        samples[9].push(s.waited_ms);
        samples[10].push(s.steps.last().map_or(f64::NAN, |x| x.0));
        samples[11].push(total);
        eprintln!(
            "[tiers] breakdown round {}/{}: host {:.1} ms, Redis {:.1} ms",
            round + 1,
            a.rounds,
            samples[6].last().copied().unwrap_or(f64::NAN),
            samples[11].last().copied().unwrap_or(f64::NAN)
        );
    }
    Ok(names
        .iter()
        .zip(samples)
        .map(|(n, s)| Phase {
            name: n.to_string(),
            ms: Spread::of(s),
        })
        .collect())
}

fn check_report(s: &Steps, tier: &str, want: usize) -> Result<(), BenchError> {
    let Some(rep) = &s.report else {
        return Err(err("no report"));
    };
    let ext = rep
        .prefill_stats
        .as_ref()
        .map_or(0, |p| p.external_cached_tokens);
    let by_tier = match tier {
        "host" => rep.external.host,
        _ => rep.external.redis,
    };
    if ext as usize != want || by_tier != ext {
        return Err(err(format!(
            "in-process {tier} load: {ext} external tokens ({by_tier} from {tier}), expected {want}"
        )));
    }
    let _ = s.first;
    Ok(())
}

// --- 3. Shared-prefix throughput ------------------------------------------------------------

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

async fn throughput_part(
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

// --- the run and its report -----------------------------------------------------------------

pub async fn bench_tiers(a: &TiersArgs) -> Result<TiersReport, BenchError> {
    let model = a
        .model
        .clone()
        .unwrap_or_else(cachet_model::default_model_path);
    if !model.exists() {
        return Err(err(format!(
            "model {} not found (make model)",
            model.display()
        )));
    }
    let bin = match &a.cachet_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe().map_err(|e| BenchError::io("finding this binary", e))?,
    };
    let http = Http {
        client: http_client(Duration::from_secs(600))?,
    };
    let redis = RedisProc::start(&a.redis_server, &a.log_dir)?;
    let ttft = ttft_part(a, &bin, &model, &redis, &http).await?;

    let loaded = cachet_model::load_model(
        &model,
        &LoadOptions {
            threads: a.threads,
            full_fingerprint: true,
            ..LoadOptions::default()
        },
    )?;
    let block_bytes = loaded
        .executor(ExecutorConfig {
            block_size: BLOCK,
            num_blocks: 1,
            kv_dtype: KvDtype::F16,
        })?
        .block_bytes() as u64;
    let breakdown = if a.no_breakdown {
        Vec::new()
    } else {
        let redis2 = RedisProc::start(&a.redis_server, &a.log_dir)?;
        tokio::task::block_in_place(|| breakdown_part(a, &loaded, &redis2))?
    };
    drop(redis);
    let mut throughput_error = None;
    let throughput = if a.no_throughput {
        Vec::new()
    } else {
        // A failed workload does not lose the TTFT figures: it is reported beside them.
        match throughput_part(a, &bin, &model, &a.redis_server, &http).await {
            Ok(rows) => rows,
            Err(e) => {
                eprintln!("[tiers] shared-prefix workload failed: {e}");
                throughput_error = Some(e.to_string());
                Vec::new()
            }
        }
    };
    let report = TiersReport {
        model: loaded.info.name.clone(),
        prompt_tokens: a.prompt_tokens,
        loaded_tokens: (a.prompt_tokens - 1) / BLOCK * BLOCK,
        rounds: a.rounds,
        threads: loaded.threads,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        block_bytes,
        ttft,
        breakdown,
        throughput,
        throughput_error,
        load_average: load_average(),
    };
    crate::doc::publish(
        &report,
        a.output_json.as_deref(),
        &a.doc,
        a.no_doc,
        "cachet-bench-tiers",
        markdown,
        "tiers",
    )?;
    Ok(report)
}

fn f1(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// The TTFT table, the breakdown and the throughput table, as markdown.
pub fn markdown(r: &TiersReport) -> String {
    let mut out = String::new();
    let loaded_mb = (r.loaded_tokens / BLOCK) as f64 * r.block_bytes as f64 / 1e6;
    out.push_str(&format!(
        "Time to first token of a {}-token prompt ({}, {} threads on {} CPUs, f16 KV, \
         `max_tokens` 1), {} interleaved rounds; a load brings {} tokens ({} blocks, {:.1} MB) and \
         computes the last {}. Server-side TTFT (`metrics.time_to_first_token_ms`); the client's \
         wall time beside it. Load average at the end: {}.\n\n",
        r.prompt_tokens,
        r.model,
        r.threads,
        r.cpus,
        r.rounds,
        r.loaded_tokens,
        r.loaded_tokens / BLOCK,
        loaded_mb,
        r.prompt_tokens - r.loaded_tokens,
        r.load_average,
    ));
    out.push_str(
        "| | TTFT median (ms) | p10–p90 | min–max | client median (ms) | computed / this |\n",
    );
    out.push_str("|---|---|---|---|---|---|\n");
    let base = r.ttft.first().map_or(f64::NAN, |c| c.server_ms.median);
    for c in &r.ttft {
        out.push_str(&format!(
            "| {} | {} | {}–{} | {}–{} | {} | {:.1}× |\n",
            c.name,
            f1(c.server_ms.median),
            f1(c.server_ms.p10),
            f1(c.server_ms.p90),
            f1(c.server_ms.min),
            f1(c.server_ms.max),
            f1(c.client_ms.median),
            base / c.server_ms.median,
        ));
    }
    if !r.breakdown.is_empty() {
        out.push_str(
            "\nWhere the time goes (in-process: the server's engine core, executor and tier \
             client, no HTTP; medians over the rounds, ms):\n\n| phase | median | p10–p90 |\n|---|---|---|\n",
        );
        for p in &r.breakdown {
            out.push_str(&format!(
                "| {} | {} | {}–{} |\n",
                p.name,
                f1(p.ms.median),
                f1(p.ms.p10),
                f1(p.ms.p90)
            ));
        }
    }
    if let Some(e) = &r.throughput_error {
        out.push_str(&format!("\nThe shared-prefix workload failed: {e}\n"));
    }
    if !r.throughput.is_empty() {
        out.push_str(
            "\nShared-prefix workload (`cachet bench serve`'s generator, streamed chat), the same \
             sessions on one instance or split between two; the system prompt was computed once \
             before the run, on the first instance:\n\n| setup | requests | s | output tok/s | total tok/s | cached | loaded from Redis (tokens) | TTFT p50 (ms) |\n|---|---|---|---|---|---|---|---|\n",
        );
        for t in &r.throughput {
            out.push_str(&format!(
                "| {} | {} | {:.1} | {:.1} | {:.0} | {:.1} % | {} | {} |\n",
                t.name,
                t.requests,
                t.duration_s,
                t.output_tok_s,
                t.total_tok_s,
                t.cached_fraction * 100.0,
                t.redis_tokens,
                f1(t.ttft_p50_ms)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrape_sums_matching_series() {
        let text = "# HELP x y\nvllm:a_total{model_name=\"m\",tier=\"redis\"} 3\nvllm:a_total{model_name=\"m\",tier=\"host\"} 4\nvllm:ab_total 100\n";
        assert_eq!(scrape(text, "vllm:a_total", &[]), 7.0);
        assert_eq!(scrape(text, "vllm:a_total", &[("tier", "host")]), 4.0);
        assert_eq!(scrape(text, "vllm:missing", &[]), 0.0);
    }

    #[test]
    fn prompts_are_distinct_and_in_range() {
        let a = prompt_ids(1, 2000);
        let b = prompt_ids(2, 2000);
        assert_eq!(a.len(), 2000);
        assert_ne!(a[..16], b[..16]);
        assert!(a.iter().all(|t| (1000..40_000).contains(t)));
        assert_eq!(a, prompt_ids(1, 2000));
    }

    #[test]
    fn spread_of_five() {
        let s = Spread::of(vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 5.0));
        assert!((s.p10 - 1.4).abs() < 1e-12 && (s.p90 - 4.6).abs() < 1e-12);
    }
}
