//! `cachet`: serve, generate, bench.

use std::io::BufReader;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use cachet::args::EngineArgs;

#[derive(Parser)]
#[command(
    name = "cachet",
    version,
    about = "An LLM serving engine that knows where every prompt token's KV came from"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum OutputFormat {
    Text,
    Json,
}

// Parsed once at startup: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Serve the OpenAI- and Anthropic-compatible HTTP API.
    Serve {
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        server: cachet_server::ServerArgs,
        #[command(flatten)]
        tiers: cachet_tiers::TierArgs,
    },
    /// Run requests from a JSONL file offline and print outputs with prefill stats.
    Generate {
        #[command(flatten)]
        engine: EngineArgs,
        /// One request per line: {"prompt_token_ids": [...], "max_tokens": N, "cache_salt": .., "priority": ..}
        #[arg(long)]
        input: PathBuf,
        /// Run the lines one at a time, in order (default: all submitted at once).
        #[arg(long)]
        sequential: bool,
        #[arg(long, value_enum, default_value = "text")]
        output: OutputFormat,
    },
    /// Benchmarks: load-test a server, compare with llama.cpp, time the model executor.
    Bench(cachet_bench::BenchArgs),
}

/// Exit status of a model the engine cannot run (unknown architecture or tensor type).
const EXIT_UNSUPPORTED_MODEL: u8 = 2;

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => match unsupported_model(&e) {
            // A model cachet cannot run is one line naming what it is and what is supported.
            Some(m) => {
                eprintln!("cachet: {m}");
                std::process::ExitCode::from(EXIT_UNSUPPORTED_MODEL)
            }
            None => {
                eprintln!("Error: {e:?}");
                std::process::ExitCode::FAILURE
            }
        },
    }
}

/// The unknown architecture or tensor type in `e`'s chain, if that is what failed (the
/// wiring's error wraps the model's transparently, so its chain does not list it apart).
fn unsupported_model(e: &anyhow::Error) -> Option<&cachet_model::ModelError> {
    use cachet::wiring::WiringError;
    use cachet_model::ModelError;
    e.chain()
        .find_map(|c| {
            c.downcast_ref::<ModelError>()
                .or(match c.downcast_ref::<WiringError>() {
                    Some(WiringError::Model(m)) => Some(m),
                    _ => None,
                })
        })
        .filter(|m| {
            matches!(
                m,
                ModelError::UnsupportedArchitecture(_) | ModelError::UnsupportedTensorType { .. }
            )
        })
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            // The `redis` crate logs every reconnect attempt at WARN; the tier logs each state
            // change once itself, so an outage stays one line.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,redis=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Generate {
            engine,
            input,
            sequential,
            output,
        } => {
            let f = std::fs::File::open(&input)
                .with_context(|| format!("opening {}", input.display()))?;
            let lines = cachet::generate::parse_input(BufReader::new(f))?;
            let stdout = std::io::stdout();
            cachet::generate::run(
                &engine,
                lines,
                sequential,
                output == OutputFormat::Json,
                stdout.lock(),
            )?;
            Ok(())
        }
        Cmd::Serve {
            engine,
            server,
            tiers,
        } => serve(engine, server, tiers),
        Cmd::Bench(b) => cachet_bench::run(b.cmd),
    }
}

type Sinks = Vec<Box<dyn cachet_engine::step::EventSink>>;

/// Where the engine's KV cache events go: the ZMQ publisher of `--kv-events-config` (vLLM's
/// wire format), and the bounded log behind `GET /v1/cache/events`.
fn kv_event_sinks(
    engine: &EngineArgs,
) -> anyhow::Result<(Sinks, Option<cachet_server::cache_routes::EventLogHandle>)> {
    use std::sync::Arc;
    let mut sinks: Sinks = Vec::new();
    if let Some(json) = engine.kv_events_config.as_deref() {
        let cfg =
            cachet_kv_events::KvEventsConfig::from_json(json).context("--kv-events-config")?;
        if let Some(publisher) = cachet_kv_events::start_publisher(&cfg)? {
            tracing::info!(
                endpoint = publisher.bound_endpoint().unwrap_or(publisher.endpoint()),
                replay = publisher.replay_endpoint().unwrap_or("none"),
                "publishing KV cache events"
            );
            let publisher = Arc::new(publisher);
            sinks.push(Box::new(move |b| publisher.publish(b)));
        }
    }
    let log = (engine.kv_events_sse_buffer > 0).then(|| {
        let log = Arc::new(cachet_kv_events::EventLog::new(engine.kv_events_sse_buffer));
        let sink = Arc::clone(&log);
        sinks.push(Box::new(move |b| {
            sink.push(b);
        }));
        cachet_server::cache_routes::EventLogHandle(log)
    });
    Ok((sinks, log))
}

fn serve(
    engine: EngineArgs,
    server: cachet_server::ServerArgs,
    tiers: cachet_tiers::TierArgs,
) -> anyhow::Result<()> {
    let built = cachet::wiring::build(&engine)?;
    let tier =
        match cachet::wiring::open_tier(&tiers, &built.executor, built.engine.scheduler.block_size)
        {
            Ok(t) => t,
            // Another instance holds the directory, or it is not writable: one line, exit 2.
            Err(cachet::wiring::WiringError::Tier(
                e @ cachet_tiers::TierError::DiskUnusable(_),
            )) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
            Err(e) => return Err(e.into()),
        };
    let name = server.primary_model_name(&built.model.name);
    let sc = &built.engine.scheduler;
    let cache = cachet_server::CacheConfigInfo {
        block_size: sc.block_size,
        num_gpu_blocks: sc.num_blocks,
        cache_dtype: built.kv_cache_dtype.clone(),
        enable_prefix_caching: sc.enable_prefix_caching,
        num_cpu_blocks: cachet::wiring::host_tier_blocks(&tiers, &built.executor),
        kv_cache_memory_bytes: built.loaded.as_ref().map_or(0, |_| engine.kv_cache_memory),
    };
    let mut metrics = cachet_server::MetricsHandle::new(&name, built.model.max_model_len, cache);
    if let Some(t) = &tier {
        let c = cachet_server::tier_metrics::TierCollector::new(&name, t.clone());
        if !metrics.add_collector(Box::new(c)) {
            anyhow::bail!("the KV tier metrics could not be registered");
        }
    }
    let mut loggers: Vec<Box<dyn cachet_engine::StatLogger>> = vec![Box::new(metrics.logger())];
    if let Ok(interval) = std::time::Duration::try_from_secs_f64(server.log_stats_interval) {
        if !interval.is_zero() {
            loggers.push(Box::new(cachet_server::LogLineLogger::new(interval)));
        }
    }
    let (event_sinks, event_log) = kv_event_sinks(&engine)?;
    let mut server = server;
    server.event_log = event_log;
    // With a disk tier, stored responses are kept beside its blocks and kept sessions.
    server.responses_file = tier
        .as_ref()
        .and_then(|t| t.disk_dir())
        .map(|d| d.join("responses.json"));
    let handle = cachet_engine::start_engine(
        built.engine,
        built.executor,
        built.model,
        cachet_engine::step::CoreOptions {
            loggers,
            event_sinks,
            insight: engine.insight(),
            tier: tier.clone().map(|c| {
                Box::new(cachet_tiers::EngineTier::new(c)) as Box<dyn cachet_engine::tier::KvTier>
            }),
            ..Default::default()
        },
    )?;
    if let Some(t) = &tier {
        // A finished load wakes the core thread (it sleeps while every request waits for KV).
        t.set_load_notify(handle.waker());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = rt.block_on(cachet_server::serve(
        server,
        handle,
        built.tokenizer,
        metrics,
    ));
    if let Some(t) = &tier {
        // Let the write-behind queues reach Redis and the disk before the process goes (the
        // shutdown's disk saves get as long as they had to be queued).
        let wait = if t.disk_saves_on_shutdown() {
            cachet_tiers::engine::SHUTDOWN_SAVE_LIMIT
        } else {
            std::time::Duration::from_secs(2)
        };
        if !t.flush(wait) {
            tracing::warn!("KV tier: some saves were still queued at shutdown and are lost");
        }
    }
    served?;
    Ok(())
}
