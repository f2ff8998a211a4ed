//! `cargo run --release -p cachet-bench --example cachet_bench -- <serve|compare|kernel> ...`: the
//! same as `cachet bench ...`, for use before (or without) the `cachet` binary's subcommand.
//! `compare` then needs `--cachet-bin target/release/cachet`.

use clap::Parser;

#[derive(Parser)]
#[command(name = "cachet-bench")]
struct Cli {
    #[command(subcommand)]
    cmd: cachet_bench::BenchCmd,
}

fn main() -> anyhow::Result<()> {
    cachet_bench::run(Cli::parse().cmd)
}
