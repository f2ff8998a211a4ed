//! Real `redis-server` processes on free loopback ports, started and stopped by the tests.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cachet_tiers::{
    BlockHash, LoadDone, Payload, RedisConfig, RedisTarget, Secret, TierClient, TierConfig,
    TierNamespace,
};

/// Whether `redis-server` and `redis-cli` can be run; installs them (as root, via
/// scripts/test-deps-redis.sh) when missing. Prints why when not.
pub fn redis_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let have = || {
            ["redis-server", "redis-cli"].iter().all(|b| {
                Command::new(b)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
        };
        if have() {
            return true;
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test-deps-redis.sh");
        let _ = Command::new("bash").arg(&script).status();
        if have() {
            return true;
        }
        eprintln!(
            "SKIPPED: redis-server/redis-cli are not installed and {} could not install them \
             (needs root and apt-get); the Redis tier tests did not run",
            script.display()
        );
        false
    })
}

pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    /// A fresh server (no persistence, DEBUG enabled), or `None` when Redis is unavailable.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Option<Self> {
        if !redis_available() {
            return None;
        }
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        for _ in 0..5 {
            let mut s = RedisServer {
                port: free_port(),
                child: None,
                dir: tempfile::tempdir().expect("tempdir"),
                extra: extra.clone(),
            };
            if s.spawn() {
                return Some(s);
            }
        }
        panic!("redis-server would not start on a free port (5 tries)");
    }

    /// A server that will listen on `port` once [`RedisServer::restart`] is called.
    pub fn not_started(port: u16) -> Option<Self> {
        if !redis_available() {
            return None;
        }
        Some(RedisServer {
            port,
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
            extra: Vec::new(),
        })
    }

    fn spawn(&mut self) -> bool {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--protected-mode", "no"])
            .args(["--enable-debug-command", "yes"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().expect("spawn redis-server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return false; // port taken between probe and bind
            }
            if self.try_ping() {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    fn try_ping(&self) -> bool {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("client")
            .get_connection()
            .expect("admin connection")
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.spawn() {
            assert!(Instant::now() < deadline, "redis-server would not restart");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `INFO <section>` field as an integer (0 when absent).
pub fn info_u64(c: &mut redis::Connection, section: &str, field: &str) -> u64 {
    let s: String = redis::cmd("INFO").arg(section).query(c).expect("INFO");
    info_field(&s, field)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// `calls` of one command in `INFO commandstats` (0 when never called).
pub fn command_calls(c: &mut redis::Connection, command: &str) -> u64 {
    let s: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(c)
        .expect("INFO");
    let prefix = format!("cmdstat_{command}:");
    s.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').find_map(|kv| kv.strip_prefix("calls=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub fn reset_stats(c: &mut redis::Connection) {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(c)
        .expect("CONFIG RESETSTAT");
}

pub fn ns() -> TierNamespace {
    TierNamespace {
        model_fingerprint: *blake3::hash(b"test model").as_bytes(),
        kv_layout: "f16:L30:H3:D64".into(),
        block_size: 16,
    }
}

pub fn hash(i: u32) -> BlockHash {
    BlockHash(*blake3::hash(&i.to_le_bytes()).as_bytes())
}

/// A distinct payload per block.
pub fn payload(i: u32, len: usize) -> Payload {
    let mut v = vec![0u8; len];
    for (j, b) in v.iter_mut().enumerate() {
        *b = (i as usize * 31 + j * 7) as u8;
    }
    Payload::from(v)
}

pub fn redis_cfg(target: RedisTarget) -> RedisConfig {
    RedisConfig {
        target,
        secret: None,
        ttl: Some(Duration::from_secs(60)),
        budget_bytes: None,
        timeout: Duration::from_millis(1000),
        save_queue: 256,
        probe_interval: Duration::from_millis(100),
        key_prefix: "cachet".into(),
        ca_cert_pem: None,
    }
}

pub fn redis_client(url: &str, f: impl FnOnce(&mut RedisConfig)) -> TierClient {
    let mut rc = redis_cfg(RedisTarget::parse(url, false).expect("url"));
    f(&mut rc);
    TierClient::open(TierConfig {
        disk: None,
        namespace: ns(),
        spare_bytes: cachet_tiers::DEFAULT_SPARE_BYTES,
        host: None,
        redis: Some(rc),
    })
    .expect("open")
}

/// Polls until the ticket's load is done.
pub fn wait_load(c: &TierClient, ticket: u64, within: Duration) -> LoadDone {
    let deadline = Instant::now() + within;
    loop {
        if let Some(d) = c.poll().into_iter().find(|d| d.ticket == ticket) {
            return d;
        }
        assert!(Instant::now() < deadline, "load {ticket} did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn secret(s: &str) -> Option<Secret> {
    Some(Secret::new(s.as_bytes()))
}

/// A Redis Cluster of `masters` masters with `replicas` replicas each, on loopback.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(masters: usize, replicas: usize) -> Option<Self> {
        if !redis_available() {
            return None;
        }
        let n = masters * (1 + replicas);
        let mut nodes = Vec::with_capacity(n);
        for _ in 0..n {
            let bus = free_port().to_string();
            let node = RedisServer::start_with(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-port",
                &bus,
            ])?;
            nodes.push(node);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        wait_until(
            "cluster_state:ok on every node",
            Duration::from_secs(20),
            || {
                cluster.nodes.iter().all(|s| {
                    let mut c = s.conn();
                    let info: String = redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query(&mut c)
                        .unwrap_or_default();
                    info_field(&info, "cluster_state").as_deref() == Some("ok")
                        && info_field(&info, "cluster_known_nodes").as_deref()
                            == Some(&n.to_string())
                })
            },
        );
        if replicas > 0 {
            wait_until("replicas in sync", Duration::from_secs(20), || {
                cluster.replicas().iter().all(|(i, _)| {
                    let s: String = redis::cmd("INFO")
                        .arg("replication")
                        .query(&mut cluster.nodes[*i].conn())
                        .unwrap_or_default();
                    info_field(&s, "master_link_status").as_deref() == Some("up")
                })
            });
        }
        Some(cluster)
    }

    /// Indices of the nodes that are masters now (and alive).
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|i| self.role(*i).as_deref() == Some("master"))
            .collect()
    }

    /// (replica index, its master's port).
    pub fn replicas(&self) -> Vec<(usize, u16)> {
        (0..self.nodes.len())
            .filter_map(|i| {
                let mut c = redis::Client::open(self.nodes[i].url())
                    .ok()?
                    .get_connection_with_timeout(Duration::from_millis(500))
                    .ok()?;
                let s: String = redis::cmd("INFO").arg("replication").query(&mut c).ok()?;
                if info_field(&s, "role").as_deref() != Some("slave") {
                    return None;
                }
                Some((i, info_field(&s, "master_port")?.parse().ok()?))
            })
            .collect()
    }

    fn role(&self, i: usize) -> Option<String> {
        let mut c = redis::Client::open(self.nodes[i].url())
            .ok()?
            .get_connection_with_timeout(Duration::from_millis(500))
            .ok()?;
        let s: String = redis::cmd("INFO").arg("replication").query(&mut c).ok()?;
        info_field(&s, "role")
    }

    /// The seed list for the tier: every master's URL, comma-separated.
    pub fn seeds(&self) -> String {
        self.masters()
            .iter()
            .map(|i| self.nodes[*i].url())
            .collect::<Vec<_>>()
            .join(",")
    }
}
