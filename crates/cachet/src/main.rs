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

#[derive(Subcommand)]
enum Cmd {
    /// Serve the OpenAI- and Anthropic-compatible HTTP API.
    Serve {
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        server: cachet_server::ServerArgs,
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

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
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
        Cmd::Serve { engine, server } => serve(engine, server),
        Cmd::Bench(b) => cachet_bench::run(b.cmd),
    }
}

fn serve(engine: EngineArgs, server: cachet_server::ServerArgs) -> anyhow::Result<()> {
    let built = cachet::wiring::build(&engine)?;
    let name = server.primary_model_name(&built.model.name);
    let sc = &built.engine.scheduler;
    let cache = cachet_server::CacheConfigInfo {
        block_size: sc.block_size,
        num_gpu_blocks: sc.num_blocks,
        cache_dtype: built.kv_cache_dtype.clone(),
        enable_prefix_caching: sc.enable_prefix_caching,
        num_cpu_blocks: None,
        kv_cache_memory_bytes: built.loaded.as_ref().map_or(0, |_| engine.kv_cache_memory),
    };
    let metrics = cachet_server::MetricsHandle::new(&name, built.model.max_model_len, cache);
    let mut loggers: Vec<Box<dyn cachet_engine::StatLogger>> = vec![Box::new(metrics.logger())];
    if let Ok(interval) = std::time::Duration::try_from_secs_f64(server.log_stats_interval) {
        if !interval.is_zero() {
            loggers.push(Box::new(cachet_server::LogLineLogger::new(interval)));
        }
    }
    let handle = cachet_engine::start_engine(
        built.engine,
        built.executor,
        built.model,
        cachet_engine::core_loop::CoreOptions {
            loggers,
            ..Default::default()
        },
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(cachet_server::serve(
        server,
        handle,
        built.tokenizer,
        metrics,
    ))?;
    Ok(())
}
