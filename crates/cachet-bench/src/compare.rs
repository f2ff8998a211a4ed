//! `cachet bench compare`: cachet vs llama.cpp's llama-server on the same GGUF, same threads,
//! same workloads, one run; writes the side-by-side table to a run file under `docs/bench-runs/`.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use serde_json::json;

use crate::error::BenchError;
use crate::report;
use crate::serve::{self, Api, LoadArgs, ServeReport};
use crate::workload::{self, WorkloadKind};

pub const DOC_SECTION: &str = "cachet-bench-compare";

#[derive(Args, Clone, Debug)]
pub struct CompareArgs {
    /// GGUF file (default: ~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads of both servers.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// cachet's --max-num-seqs = llama-server's -np (slots).
    #[arg(long, default_value_t = 8)]
    pub max_num_seqs: usize,
    /// Context per slot: llama-server -c = slots × this; cachet gets as many KV blocks.
    #[arg(long, default_value_t = 4096)]
    pub ctx_per_slot: usize,
    /// Workloads to run, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "shared-prefix,unique"
    )]
    pub workloads: Vec<WorkloadKind>,
    #[command(flatten)]
    pub load: LoadArgs,
    /// llama-server binary (default: ~/.cache/cachet/peer/bin/llama-server).
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// cachet binary (default: this executable).
    #[arg(long)]
    pub cachet_bin: Option<PathBuf>,
    /// Extra argument for llama-server (repeatable), e.g. --llama-arg=-fa --llama-arg=off
    #[arg(long, allow_hyphen_values = true)]
    pub llama_arg: Vec<String>,
    /// Extra argument for `cachet serve` (repeatable).
    #[arg(long, allow_hyphen_values = true)]
    pub cachet_arg: Vec<String>,
    /// Markdown file whose marked section gets the results (default: a run file of its own,
    /// docs/bench-runs/<date>-<cpu>-<topic>.md).
    #[arg(long)]
    pub doc: Option<PathBuf>,
    /// Do not touch the doc.
    #[arg(long)]
    pub no_doc: bool,
    /// Write all reports as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Write one PNG per workload (TTFT/ITL CDFs of both servers) into this folder.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
    /// Server logs go here.
    #[arg(long, default_value = "/tmp/cachet-bench-logs")]
    pub log_dir: PathBuf,
    /// Seconds to wait for a server's /health.
    #[arg(long, default_value_t = 180)]
    pub health_timeout: u64,
}

/// A server child process, killed on drop.
pub struct ServerProc {
    pub name: String,
    pub base_url: String,
    pub log: PathBuf,
    child: Child,
}

impl ServerProc {
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        port: u16,
        log_dir: &Path,
    ) -> Result<ServerProc, BenchError> {
        std::fs::create_dir_all(log_dir)
            .map_err(|e| BenchError::io(format!("creating {}", log_dir.display()), e))?;
        let log = log_dir.join(format!("{name}-{port}.log"));
        let f = File::create(&log)
            .map_err(|e| BenchError::io(format!("creating {}", log.display()), e))?;
        let f2 = f
            .try_clone()
            .map_err(|e| BenchError::io("cloning log handle", e))?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            .spawn()
            .map_err(|e| BenchError::io(format!("starting {}", program.display()), e))?;
        Ok(ServerProc {
            name: name.to_string(),
            base_url: format!("http://127.0.0.1:{port}"),
            log,
            child,
        })
    }

    /// Polls `GET /health` until 200, the process exits, or the timeout.
    pub async fn wait_healthy(
        &mut self,
        client: &reqwest::Client,
        timeout: Duration,
    ) -> Result<Duration, BenchError> {
        let t0 = Instant::now();
        let url = format!("{}/health", self.base_url);
        while t0.elapsed() < timeout {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(BenchError::Peer(format!(
                    "{} exited with {status} before becoming healthy; log {}:\n{}",
                    self.name,
                    self.log.display(),
                    log_tail(&self.log, 2000)
                )));
            }
            if let Ok(r) = client
                .get(&url)
                .timeout(Duration::from_secs(2))
                .send()
                .await
            {
                if r.status().is_success() {
                    return Ok(t0.elapsed());
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(BenchError::Unhealthy {
            name: self.name.clone(),
            secs: timeout.as_secs(),
            log: self.log.display().to_string(),
        })
    }

    pub fn stop(mut self) {
        self.kill();
    }

    fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SIGTERM first so servers can shut down cleanly, then SIGKILL.
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `n` bytes of a log file.
pub fn log_tail(path: &Path, n: u64) -> String {
    let mut s = String::new();
    if let Ok(mut f) = File::open(path) {
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(n)));
        let _ = f.read_to_string(&mut s);
    }
    s
}

/// A free loopback port (bound and released; another process could take it in between).
pub fn free_port() -> Result<u16, BenchError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| BenchError::io("binding a free port", e))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| BenchError::io("reading the bound port", e))
}

fn cachet_args(a: &CompareArgs, model: &Path, port: u16) -> Vec<String> {
    let mut v: Vec<String> = [
        "serve",
        "--executor",
        "model",
        "--model",
        &model.display().to_string(),
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--threads",
        &a.threads.to_string(),
        "--max-num-seqs",
        &a.max_num_seqs.to_string(),
        "--num-kv-blocks",
        &(a.max_num_seqs * a.ctx_per_slot).div_ceil(16).to_string(),
        "--max-model-len",
        &a.ctx_per_slot.to_string(),
        "--log-stats-interval",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(a.cachet_arg.iter().cloned());
    v
}

fn llama_args(a: &CompareArgs, model: &Path, port: u16) -> Vec<String> {
    let mut v: Vec<String> = [
        "-m",
        &model.display().to_string(),
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "-np",
        &a.max_num_seqs.to_string(),
        "-t",
        &a.threads.to_string(),
        "-tb",
        &a.threads.to_string(),
        "-c",
        &(a.max_num_seqs * a.ctx_per_slot).to_string(),
        "--cache-prompt",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(a.llama_arg.iter().cloned());
    v
}

/// Results of one workload on both servers.
#[derive(Clone, Debug, Serialize)]
pub struct ComparePair {
    pub workload: WorkloadKind,
    pub cachet: ServeReport,
    pub llama: ServeReport,
}

#[derive(Clone, Debug, Serialize)]
pub struct CompareReport {
    pub date: String,
    pub machine: String,
    pub command: String,
    pub cachet_rev: Option<String>,
    pub peer: Option<String>,
    pub cachet_cmdline: String,
    pub llama_cmdline: String,
    pub pairs: Vec<ComparePair>,
}

async fn run_one(
    name: &str,
    program: &Path,
    mk_args: &dyn Fn(u16) -> Vec<String>,
    a: &CompareArgs,
    kind: WorkloadKind,
    tpw: &mut Option<f64>,
) -> Result<(ServeReport, String), BenchError> {
    let port = free_port()?;
    let args = mk_args(port);
    let cmdline = format!("{} {}", program.display(), args.join(" "));
    eprintln!("[compare] starting {name}: {cmdline}");
    let mut proc = ServerProc::spawn(name, program, &args, port, &a.log_dir)?;
    let client = serve::http_client(Duration::from_secs_f64(a.load.request_timeout))?;
    let up = proc
        .wait_healthy(&client, Duration::from_secs(a.health_timeout))
        .await?;
    eprintln!("[compare] {name} healthy after {:.1} s", up.as_secs_f64());
    let base = proc.base_url.clone();
    let model = serve::fetch_model_name(&client, &base)
        .await
        .unwrap_or_else(|| "default".into());
    if tpw.is_none() {
        *tpw = Some(match a.load.tokens_per_word {
            Some(t) => t,
            None => serve::calibrate_tokens_per_word(&client, &base, a.load.params.seed)
                .await
                .unwrap_or(workload::DEFAULT_TOKENS_PER_WORD),
        });
    }
    let tpw = tpw.unwrap_or(workload::DEFAULT_TOKENS_PER_WORD);
    // Warm-up: one tiny request that shares no prefix with the workload.
    let _ = client
        .post(format!("{base}/v1/chat/completions"))
        .json(
            &json!({"model": model, "messages": [{"role": "user", "content": "Warm up."}],
                      "max_tokens": 4, "temperature": 0.0}),
        )
        .send()
        .await
        .and_then(|r| r.error_for_status());
    let wl = workload::generate(kind, &a.load.params, tpw);
    // Ctrl-C stops the server before exiting (a plain exit would skip `Drop` and orphan it).
    let report = tokio::select! {
        r = serve::run_load(&client, &base, Api::Openai, &model, name, &wl, &a.load, tpw) => r,
        _ = tokio::signal::ctrl_c() => Err(BenchError::Peer("interrupted".into())),
    };
    proc.stop();
    Ok((report?, cmdline))
}

/// Runs every workload on cachet then llama-server (fresh servers each time, one at a time).
pub async fn bench_compare(a: &CompareArgs) -> Result<CompareReport, BenchError> {
    let model = a
        .model
        .clone()
        .unwrap_or_else(cachet_model::default_model_path);
    if !model.is_file() {
        return Err(BenchError::Peer(format!(
            "model {} not found",
            model.display()
        )));
    }
    let llama = crate::peer::find("llama-server", a.llama_server.as_ref())?;
    let cachet = match &a.cachet_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| BenchError::io("current_exe", e))?,
    };
    // Sampled before the servers start: the load average describes the machine, not us.
    let (date, machine, rev) = (
        crate::peer::utc_now(),
        crate::peer::machine_description(),
        crate::peer::git_rev(),
    );
    let mut tpw = None;
    let mut pairs = Vec::new();
    let (mut c_cmd, mut l_cmd) = (String::new(), String::new());
    for &kind in &a.workloads {
        eprintln!("[compare] workload {}", kind.as_str());
        let (c, cc) = run_one(
            "cachet",
            &cachet,
            &|p| cachet_args(a, &model, p),
            a,
            kind,
            &mut tpw,
        )
        .await?;
        println!("{}", report::serve_table(&c, false));
        let (l, lc) = run_one(
            "llama-server",
            &llama,
            &|p| llama_args(a, &model, p),
            a,
            kind,
            &mut tpw,
        )
        .await?;
        println!("{}", report::serve_table(&l, false));
        (c_cmd, l_cmd) = (cc, lc);
        println!(
            "== {}: cachet vs llama-server ==\n{}",
            kind.as_str(),
            report::compare_table(&c, &l, false)
        );
        if let Some(dir) = &a.plot_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| BenchError::io(format!("creating {}", dir.display()), e))?;
            crate::plot::write_png(
                &dir.join(format!("compare-{}.png", kind.as_str())),
                &[&c, &l],
            )?;
        }
        pairs.push(ComparePair {
            workload: kind,
            cachet: c,
            llama: l,
        });
    }
    let rep = CompareReport {
        date,
        machine,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        cachet_rev: rev,
        peer: crate::peer::peer_version(),
        cachet_cmdline: c_cmd,
        llama_cmdline: l_cmd,
        pairs,
    };
    crate::doc::publish(
        &rep,
        a.output_json.as_deref(),
        a.doc.as_deref(),
        a.no_doc,
        DOC_SECTION,
        markdown,
        "compare",
    )?;
    Ok(rep)
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "**met**"
    } else {
        "**missed**"
    }
}

/// Target checks from the issue, as Markdown bullet lines.
pub fn targets(rep: &CompareReport) -> Vec<String> {
    let mut v = Vec::new();
    for p in &rep.pairs {
        let (c, l) = (&p.cachet, &p.llama);
        let ttft = c.ttft_ms.mean / l.ttft_ms.mean;
        let thr = c.total_throughput / l.total_throughput;
        match p.workload {
            WorkloadKind::SharedPrefix => {
                v.push(format!(
                    "- shared-prefix mean TTFT ratio cachet/llama-server = {ttft:.2} (target ≤ 0.33): {}",
                    verdict(ttft <= 1.0 / 3.0)
                ));
                v.push(format!(
                    "- shared-prefix total throughput ratio = {thr:.2}× (target ≥ 2×): {}",
                    verdict(thr >= 2.0)
                ));
            }
            WorkloadKind::Unique => v.push(format!(
                "- unique total throughput ratio = {thr:.2}× (target ≥ 0.8×): {}",
                verdict(thr >= 0.8)
            )),
            WorkloadKind::FewShot => v.push(format!(
                "- few-shot: mean TTFT ratio {ttft:.2}, total throughput ratio {thr:.2}× (no target)"
            )),
        }
    }
    v
}

/// The doc section.
pub fn markdown(rep: &CompareReport) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "_Generated by `cachet bench compare` on {} — do not edit by hand; rerun to refresh._\n\n",
        rep.date
    ));
    s.push_str(&format!("- Machine: {}\n", rep.machine));
    s.push_str(&format!("- Command: `{}`\n", rep.command));
    if let Some(r) = &rep.cachet_rev {
        s.push_str(&format!("- cachet commit: `{r}`\n"));
    }
    if let Some(p) = &rep.peer {
        s.push_str(&format!("- Peer: {p}\n"));
    }
    s.push_str(&format!("- cachet server: `{}`\n", rep.cachet_cmdline));
    s.push_str(&format!("- llama-server: `{}`\n", rep.llama_cmdline));
    s.push_str("- Ratios are cachet / llama-server (for latencies lower is better, for throughputs higher is better). Each workload ran on freshly started servers, cachet first, back to back.\n\n");
    s.push_str("Targets:\n\n");
    for t in targets(rep) {
        s.push_str(&t);
        s.push('\n');
    }
    for p in &rep.pairs {
        let c = &p.cachet;
        s.push_str(&format!(
            "\n#### {} — {} requests, {} output tokens each (ignore_eos {}), concurrency {}\n\n",
            p.workload.as_str(),
            c.num_requests,
            c.max_tokens,
            c.ignore_eos,
            c.concurrency.map_or("unlimited".into(), |x| x.to_string()),
        ));
        let pp = &c.params;
        let shape = match p.workload {
            WorkloadKind::SharedPrefix => format!(
                "S = {} system tokens shared by U = {} users, T = {} turns, {} tokens per user message",
                pp.system_tokens, pp.users, pp.turns, pp.user_tokens
            ),
            WorkloadKind::FewShot => format!(
                "{}-token few-shot prefix, {} requests, {}-token questions",
                pp.prefix_tokens, pp.num_requests, pp.user_tokens
            ),
            WorkloadKind::Unique => format!(
                "{} requests of ≈{} unshared tokens + a {}-token question",
                pp.num_requests, pp.prompt_tokens, pp.user_tokens
            ),
        };
        s.push_str(&format!("{shape}; seed {}.\n\n", pp.seed));
        s.push_str(&report::compare_table(&p.cachet, &p.llama, true));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparable_server_flags() {
        let a = CompareArgs {
            model: None,
            threads: 2,
            max_num_seqs: 8,
            ctx_per_slot: 4096,
            workloads: vec![],
            load: LoadArgs::default(),
            llama_server: None,
            cachet_bin: None,
            llama_arg: vec![],
            cachet_arg: vec![],
            doc: None,
            no_doc: true,
            output_json: None,
            plot_dir: None,
            log_dir: "/tmp".into(),
            health_timeout: 1,
        };
        let m = Path::new("/m.gguf");
        let c = cachet_args(&a, m, 1234).join(" ");
        assert!(
            c.contains("--threads 2 --max-num-seqs 8 --num-kv-blocks 2048"),
            "{c}"
        );
        let l = llama_args(&a, m, 1234).join(" ");
        assert!(l.contains("-np 8 -t 2 -tb 2 -c 32768"), "{l}");
    }
}
