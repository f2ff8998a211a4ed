//! `cachet bench`: measure cachet and its peers.
//!
//! - [`serve`]: a load generator for any OpenAI-compatible server (TTFT, inter-token latency,
//!   throughputs, the cached-token fraction the server reports), with deterministic
//!   [`workload`]s: `shared-prefix`, `few-shot`, `unique`.
//! - [`compare`]: starts cachet and llama.cpp's `llama-server` on the same GGUF and settings,
//!   runs the same workloads against each, and writes a side-by-side table to a run file under
//!   `docs/bench-runs/` ([`doc`]).
//! - [`kernel`]: cachet's model executor driven directly, beside `llama-bench`.
//!
//! The binary exposes them as `cachet bench {serve,compare,kernel}` through [`BenchArgs`] and
//! [`run`].

pub mod compare;
pub mod doc;
pub mod error;
pub mod fidelity;
pub mod kernel;
pub mod peer;
pub mod plot;
pub mod report;
pub mod rng;
pub mod serve;
pub mod spec;
pub mod sse;
pub mod stats;
pub mod tiers;
pub mod workload;

use clap::{Args, Subcommand};

/// A clap value parser for counts and sizes that must be at least 1 (a repetition count, a
/// thread count, a prompt length): 0 would measure nothing, or ask the executor for a token
/// of an empty prompt, so it is refused with the usage error rather than failing mid-run.
pub(crate) fn positive<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + From<u8>,
    T::Err: std::fmt::Display,
{
    let v: T = s.parse().map_err(|e: T::Err| e.to_string())?;
    if v < T::from(1) {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

pub use compare::CompareArgs;
pub use error::BenchError;
pub use kernel::KernelArgs;
pub use serve::{Api, LoadArgs, ServeBenchArgs, ServeReport};
pub use workload::{WorkloadKind, WorkloadParams};

/// `cachet bench ...`
#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub cmd: BenchCmd,
}

#[derive(Subcommand, Clone, Debug)]
pub enum BenchCmd {
    /// Load-test an OpenAI-compatible server (cachet, llama-server, vLLM, ...).
    Serve(ServeBenchArgs),
    /// Start cachet and llama-server on the same model, run the same workloads against both,
    /// and write the side-by-side table to a run file under docs/bench-runs/.
    Compare(CompareArgs),
    /// Prefill/decode tokens/s of cachet's model executor beside llama-bench.
    Kernel(KernelArgs),
    /// KL divergence, top-1 agreement and perplexity shift of the served path against exact
    /// f32 arithmetic on a fixed text.
    Fidelity(fidelity::FidelityArgs),
    /// External KV tiers on the real model: time to first token computed vs loaded from the
    /// host tier vs Redis, where a load's time goes, and a shared-prefix workload on two
    /// instances behind one Redis vs one instance; writes a run file under docs/bench-runs/.
    Tiers(tiers::TiersArgs),
    /// Prompt-lookup speculative decoding on the real model, batch 1, greedy: an edit-style
    /// workload and a free-form one, speculation off vs on, interleaved and repeated.
    Spec(spec::SpecArgs),
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Runs a `cachet bench` subcommand, printing its tables to stdout.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Serve(a) => {
            let rep = runtime()?.block_on(serve::bench_serve(&a))?;
            print!("{}", report::serve_table(&rep, false));
            if rep.completed == 0 {
                anyhow::bail!("no request succeeded");
            }
        }
        BenchCmd::Compare(a) => {
            let rep = runtime()?.block_on(compare::bench_compare(&a))?;
            for t in compare::targets(&rep) {
                println!("{t}");
            }
        }
        BenchCmd::Kernel(a) => {
            let rep = kernel::bench_kernel(&a)?;
            print!("{}", kernel::table(&rep, false));
        }
        BenchCmd::Fidelity(a) => {
            let rep = fidelity::bench_fidelity(&a)?;
            print!("{}", fidelity::table(&rep, false));
        }
        BenchCmd::Spec(a) => {
            let rep = spec::bench_spec(&a)?;
            print!("{}", spec::table(&rep));
        }
        BenchCmd::Tiers(a) => {
            let rep = runtime()?.block_on(tiers::bench_tiers(&a))?;
            print!("{}", tiers::markdown(&rep));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(subcommand)]
        cmd: super::BenchCmd,
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
    }

    #[test]
    fn zero_counts_are_usage_errors() {
        for args in [
            &["kernel", "--reps", "0"][..],
            &["kernel", "--ttft-prompt", "0"],
            &["kernel", "--depth", "0"],
            &["kernel", "--batches", "1,0,16"],
            &["spec", "--free-tokens", "0"],
            &["spec", "--num-speculative-tokens", "0"],
            &["fidelity", "--chunk", "0"],
        ] {
            let e = parse(args).expect_err(&format!("{args:?} must be refused"));
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{args:?}"
            );
            assert!(
                e.to_string().contains("must be at least 1"),
                "{args:?}: {e}"
            );
        }
    }

    #[test]
    fn positive_counts_parse() {
        let cli = parse(&["kernel", "--reps", "1", "--batches", "1,16"]).expect("valid");
        let super::BenchCmd::Kernel(k) = cli.cmd else {
            panic!("not the kernel subcommand: {cli:?}");
        };
        assert_eq!((k.reps, k.batches), (1, vec![1, 16]));
        assert_eq!(super::positive::<u32>("7"), Ok(7));
        assert!(super::positive::<usize>("-1").is_err());
    }
}
