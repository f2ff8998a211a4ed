//! The processes the bench talks to: `redis-server` on a loopback port, `cachet serve`
//! instances, and the HTTP calls made to them (one `max_tokens: 1` completion, a `/metrics`
//! sample, waiting for Redis saves to settle).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{err, TiersArgs};
use crate::compare::{free_port, ServerProc};
use crate::error::BenchError;

/// A `redis-server` child on a loopback port, killed on drop.
pub(super) struct RedisProc {
    port: u16,
    child: Child,
    dir: PathBuf,
}

impl RedisProc {
    pub(super) fn start(program: &Path, log_dir: &Path) -> Result<RedisProc, BenchError> {
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

    pub(super) fn url(&self) -> String {
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

pub(super) struct Http {
    pub(super) client: reqwest::Client,
}

/// What one `max_tokens: 1` completion reported.
pub(super) struct Answer {
    pub(super) token_text: String,
    pub(super) server_ms: f64,
    pub(super) client_ms: f64,
    pub(super) prefix: Value,
}

impl Http {
    pub(super) async fn complete(&self, base: &str, ids: &[u32]) -> Result<Answer, BenchError> {
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

    pub(super) async fn metric(&self, base: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
        let url = format!("{base}/metrics");
        let Ok(r) = self.client.get(&url).send().await else {
            return f64::NAN;
        };
        let text = r.text().await.unwrap_or_default();
        scrape(&text, name, labels)
    }

    /// Waits until the instance has no Redis save pending and at least `blocks` stored.
    pub(super) async fn settled(&self, base: &str, blocks: f64) -> Result<(), BenchError> {
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

pub(super) async fn spawn(
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

pub(super) fn redis_flags(url: &str) -> Vec<String> {
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
