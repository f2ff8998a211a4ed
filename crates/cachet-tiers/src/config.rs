//! Tier configuration: the `--kv-tier*` flags ([`TierArgs`]) and what they become
//! ([`TierConfig`]).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use hmac::Mac;

use crate::format::{HmacSha256, TierNamespace};
use crate::TierError;

/// Which tiers `--kv-tier` enables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierSpec {
    pub host: bool,
    pub redis: bool,
    pub disk: bool,
}

impl FromStr for TierSpec {
    type Err = String;

    /// `host`, `disk`, `redis`, or a comma-separated stack of them (always consulted host,
    /// disk, Redis). Order and case do not matter.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut spec = TierSpec {
            host: false,
            redis: false,
            disk: false,
        };
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.to_ascii_lowercase().as_str() {
                "host" => spec.host = true,
                "redis" => spec.redis = true,
                "disk" => spec.disk = true,
                other => {
                    return Err(format!(
                        "unknown KV tier `{other}` (expected host, disk, redis or a list such \
                         as host,disk,redis)"
                    ))
                }
            }
        }
        if !spec.host && !spec.redis && !spec.disk {
            return Err("no KV tier named (expected host, disk, redis or a list)".into());
        }
        Ok(spec)
    }
}

/// The HMAC key of `--kv-tier-secret`. Its `Debug` never shows the bytes.
#[derive(Clone)]
pub struct Secret {
    key: Arc<HmacSha256>,
}

impl Secret {
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        // HMAC takes keys of any length; this cannot fail.
        let key = <HmacSha256 as Mac>::new_from_slice(bytes.as_ref())
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
        Secret { key: Arc::new(key) }
    }

    pub(crate) fn hmac(&self) -> HmacSha256 {
        (*self.key).clone()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Where Redis is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server: `redis://[user:pass@]host:port[/db]` or `rediss://…` (TLS).
    Single(String),
    /// Seed nodes of a Redis Cluster; the client discovers the rest.
    Cluster(Vec<String>),
}

impl RedisTarget {
    /// A single URL is one server; a comma-separated list is a cluster's seed nodes.
    /// `force_cluster` makes a single URL a one-seed cluster.
    pub fn parse(urls: &str, force_cluster: bool) -> Result<Self, TierError> {
        let mut list: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(String::from)
            .collect();
        if list.is_empty() {
            return Err(TierError::Config("--kv-tier-redis-url is empty".into()));
        }
        for u in &list {
            if !(u.starts_with("redis://") || u.starts_with("rediss://")) {
                return Err(TierError::Config(format!(
                    "Redis URL `{}` must start with redis:// or rediss://",
                    redact_url(u)
                )));
            }
            redis::parse_redis_url(u).ok_or_else(|| {
                TierError::Config(format!("cannot parse Redis URL `{}`", redact_url(u)))
            })?;
        }
        if list.len() == 1 && !force_cluster {
            Ok(RedisTarget::Single(list.swap_remove(0)))
        } else {
            Ok(RedisTarget::Cluster(list))
        }
    }

    /// The URLs with any password replaced, for logs.
    pub fn display(&self) -> String {
        match self {
            RedisTarget::Single(u) => redact_url(u),
            RedisTarget::Cluster(us) => format!(
                "cluster[{}]",
                us.iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
}

/// `redis://user:pw@host` → `redis://user:***@host`.
fn redact_url(u: &str) -> String {
    let Some(scheme_end) = u.find("://") else {
        return u.to_string();
    };
    let rest = &u[scheme_end + 3..];
    let auth_end = rest.find('/').unwrap_or(rest.len());
    match rest[..auth_end].rfind('@') {
        Some(at) => {
            let creds = &rest[..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{}:***{}", &u[..scheme_end + 3], user, &rest[at..])
        }
        None => u.to_string(),
    }
}

/// The host-memory tier.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Upper bound on the payload bytes held (`--kv-tier-host-bytes`).
    pub capacity_bytes: u64,
    /// When blocks enter the host tier (`--kv-tier-host-save`).
    pub save: HostSave,
}

/// When the engine copies a block into the host tier (`--kv-tier-host-save`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HostSave {
    /// When the local pool evicts it: no copy while the pool holds the block, but the copies
    /// fall on the step whose allocations evict (a 2,000-token prompt arriving at a full pool
    /// copies ~46 MB before its first token).
    #[default]
    Evicted,
    /// When it is filled, as a new cache entry (write-through, as vLLM's CPU offloading
    /// stores blocks as they are computed): a prompt's copies fall on the step that computed
    /// it, ~0.4 % of computing it, and an eviction of a block the tier still holds copies
    /// nothing (it only becomes the tier's most recently used). The tier's capacity then
    /// holds the pool's blocks too.
    Filled,
}

/// The Redis tier.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    pub target: RedisTarget,
    /// With a secret, values are signed and only signed values are accepted.
    pub secret: Option<Secret>,
    /// Expiry of every value written (`--kv-tier-ttl-s`); `None` = no expiry.
    pub ttl: Option<Duration>,
    /// This instance's byte budget in Redis (`--kv-tier-redis-bytes`): the value bytes it has
    /// written within the last TTL may not exceed it, so (every value expiring TTL after its
    /// write) it never holds more than this in Redis. `None` = no budget. Needs a TTL.
    pub budget_bytes: Option<u64>,
    /// Bound on every Redis call: lookup, load, save batch, probe (`--kv-tier-timeout-ms`).
    pub timeout: Duration,
    /// Blocks the write-behind queue holds (`--kv-tier-save-queue`); a save beyond is dropped.
    pub save_queue: usize,
    /// How often a down Redis is probed for its return.
    pub probe_interval: Duration,
    /// First component of every key (default `cachet`).
    pub key_prefix: String,
    /// PEM root certificate(s) to trust for `rediss://` instead of the system's
    /// (`--kv-tier-redis-ca-file`).
    pub ca_cert_pem: Option<Vec<u8>>,
}

/// The disk tier ([`crate::disk`]).
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// The directory (`--kv-tier-disk-path`); created when missing, locked while in use.
    pub dir: std::path::PathBuf,
    /// Upper bound on the value bytes of the block files (`--kv-tier-disk-bytes`).
    pub capacity_bytes: u64,
    /// With a secret, files are signed and only signed files are accepted (`--kv-tier-secret`).
    pub secret: Option<Secret>,
    /// Blocks the disk writer's queue holds (`--kv-tier-save-queue`); a save beyond is dropped.
    pub save_queue: usize,
    /// At shutdown, write the local pool's cached blocks that are not on disk yet
    /// (`--kv-tier-disk-save-on-shutdown`).
    pub save_on_shutdown: bool,
}

/// Everything [`crate::TierClient::open`] needs.
#[derive(Clone, Debug)]
pub struct TierConfig {
    pub namespace: TierNamespace,
    pub host: Option<HostConfig>,
    pub redis: Option<RedisConfig>,
    pub disk: Option<DiskConfig>,
    /// Bound on the warm payload buffers kept for the engine's saves (`--kv-tier-spare-bytes`;
    /// [`crate::buffers`]): memory on top of the host capacity. 0: none kept.
    pub spare_bytes: u64,
}

/// The default of `--kv-tier-spare-bytes`: 64 MiB (182 blocks of the default model, more
/// than a 2,000-token prompt's 126).
pub const DEFAULT_SPARE_BYTES: u64 = 64 << 20;

impl TierConfig {
    pub(crate) fn validate(&self) -> Result<(), TierError> {
        if self.host.is_none() && self.redis.is_none() && self.disk.is_none() {
            return Err(TierError::Config("no KV tier configured".into()));
        }
        if let Some(d) = &self.disk {
            if d.capacity_bytes == 0 {
                return Err(TierError::Config(
                    "--kv-tier-disk-bytes must be greater than 0".into(),
                ));
            }
            if d.save_queue == 0 {
                return Err(TierError::Config(
                    "--kv-tier-save-queue must be greater than 0".into(),
                ));
            }
        }
        if let Some(h) = &self.host {
            if h.capacity_bytes == 0 {
                return Err(TierError::Config(
                    "--kv-tier-host-bytes must be greater than 0".into(),
                ));
            }
        }
        if let Some(r) = &self.redis {
            if r.timeout.is_zero() {
                return Err(TierError::Config(
                    "--kv-tier-timeout-ms must be greater than 0".into(),
                ));
            }
            if r.save_queue == 0 {
                return Err(TierError::Config(
                    "--kv-tier-save-queue must be greater than 0".into(),
                ));
            }
            if r.budget_bytes.is_some() && r.ttl.is_none() {
                return Err(TierError::Config(
                    "--kv-tier-redis-bytes needs a TTL (--kv-tier-ttl-s > 0): without expiry \
                     written bytes are never released"
                        .into(),
                ));
            }
            if r.key_prefix.is_empty() || r.key_prefix.contains(['{', '}']) {
                return Err(TierError::Config(
                    "the Redis key prefix must be non-empty and free of `{` `}`".into(),
                ));
            }
        }
        Ok(())
    }
}

/// The `--kv-tier*` flags, for `#[command(flatten)]` into `cachet serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct TierArgs {
    /// External KV tiers: `host`, `disk`, `redis`, or a stack such as `host,disk,redis`
    /// (consulted in that order). Unset: none.
    #[arg(long = "kv-tier", value_name = "TIERS")]
    pub kv_tier: Option<TierSpec>,

    /// Capacity of the host-memory tier, in bytes of KV (suffixes K, M, G, KiB, MiB, GiB).
    #[arg(long, value_name = "BYTES", default_value = "4GiB", value_parser = parse_bytes)]
    pub kv_tier_host_bytes: u64,

    /// When blocks enter the host tier: `evicted` (when the local pool evicts them) or
    /// `filled` (write-through, when they are computed: no copy on the step that evicts).
    #[arg(long, value_name = "WHEN", value_enum, default_value_t = HostSave::Evicted)]
    pub kv_tier_host_save: HostSave,

    /// The disk tier's directory (one file per block; survives a restart). One instance per
    /// directory: a second one is refused at start.
    #[arg(long, value_name = "DIR")]
    pub kv_tier_disk_path: Option<std::path::PathBuf>,

    /// Capacity of the disk tier, in bytes of block files (least recently used evicted first).
    #[arg(long, value_name = "BYTES", default_value = "16GiB", value_parser = parse_bytes)]
    pub kv_tier_disk_bytes: u64,

    /// At shutdown (SIGTERM), write the local pool's cached blocks that are not on the disk
    /// tier yet, within the drain deadline (`--shutdown-timeout`).
    #[arg(long)]
    pub kv_tier_disk_save_on_shutdown: bool,

    /// Redis: `redis://host:port`, `rediss://…` (TLS), or a comma-separated list of Redis
    /// Cluster nodes.
    #[arg(long, value_name = "URL", env = "CACHET_KV_TIER_REDIS_URL")]
    pub kv_tier_redis_url: Option<String>,

    /// Treat a single `--kv-tier-redis-url` as a Redis Cluster seed node.
    #[arg(long)]
    pub kv_tier_redis_cluster: bool,

    /// Sign values written to Redis and to the disk tier (HMAC-SHA256) and accept only values
    /// signed with this secret. Prefer the environment variable to the command line.
    #[arg(
        long,
        value_name = "SECRET",
        env = "CACHET_KV_TIER_SECRET",
        hide_env_values = true
    )]
    pub kv_tier_secret: Option<String>,

    /// Expiry of values written to Redis, in seconds (0 = never expire).
    #[arg(long, value_name = "SECONDS", default_value_t = 3600)]
    pub kv_tier_ttl_s: u64,

    /// This instance's byte budget in Redis: value bytes written within the last TTL
    /// (0 = unlimited; a shared server's total is Redis' own `maxmemory`).
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_bytes)]
    pub kv_tier_redis_bytes: u64,

    /// Bound on every Redis call (lookup, load, save batch), in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 500)]
    pub kv_tier_timeout_ms: u64,

    /// Blocks the write-behind save queue holds; a save beyond is dropped and counted.
    #[arg(long, value_name = "BLOCKS", default_value_t = 256)]
    pub kv_tier_save_queue: usize,

    /// Warm block buffers kept for saves (recycled from the host tier's evictions and from
    /// values written to Redis, topped up by a low-priority thread), so that copying a block
    /// out of the pool does not page-fault on the engine thread; memory on top of
    /// `--kv-tier-host-bytes` (0 = none).
    #[arg(long, value_name = "BYTES", default_value = "64MiB", value_parser = parse_bytes)]
    pub kv_tier_spare_bytes: u64,

    /// PEM file of the CA that signed the Redis servers' certificates (`rediss://`), when it is
    /// not in the system's trust store.
    #[arg(long, value_name = "PATH")]
    pub kv_tier_redis_ca_file: Option<std::path::PathBuf>,
}

impl TierArgs {
    /// The configuration these flags describe for a model's namespace; `None` without
    /// `--kv-tier`.
    pub fn to_config(&self, namespace: TierNamespace) -> Result<Option<TierConfig>, TierError> {
        let Some(spec) = self.kv_tier else {
            return Ok(None);
        };
        let host = spec.host.then_some(HostConfig {
            capacity_bytes: self.kv_tier_host_bytes,
            save: self.kv_tier_host_save,
        });
        let redis = if spec.redis {
            let url = self.kv_tier_redis_url.as_deref().ok_or_else(|| {
                TierError::Config("--kv-tier redis needs --kv-tier-redis-url".into())
            })?;
            Some(RedisConfig {
                target: RedisTarget::parse(url, self.kv_tier_redis_cluster)?,
                secret: self
                    .kv_tier_secret
                    .as_deref()
                    .filter(|s| !s.is_empty())
                    .map(Secret::new),
                ttl: (self.kv_tier_ttl_s > 0).then(|| Duration::from_secs(self.kv_tier_ttl_s)),
                budget_bytes: (self.kv_tier_redis_bytes > 0).then_some(self.kv_tier_redis_bytes),
                timeout: Duration::from_millis(self.kv_tier_timeout_ms),
                save_queue: self.kv_tier_save_queue,
                probe_interval: Duration::from_secs(1),
                key_prefix: "cachet".into(),
                ca_cert_pem: match &self.kv_tier_redis_ca_file {
                    Some(p) => Some(std::fs::read(p).map_err(|e| {
                        TierError::Config(format!(
                            "cannot read --kv-tier-redis-ca-file {}: {e}",
                            p.display()
                        ))
                    })?),
                    None => None,
                },
            })
        } else {
            None
        };
        let disk = if spec.disk {
            let dir = self.kv_tier_disk_path.clone().ok_or_else(|| {
                TierError::Config("--kv-tier disk needs --kv-tier-disk-path".into())
            })?;
            Some(DiskConfig {
                dir,
                capacity_bytes: self.kv_tier_disk_bytes,
                secret: self
                    .kv_tier_secret
                    .as_deref()
                    .filter(|s| !s.is_empty())
                    .map(Secret::new),
                save_queue: self.kv_tier_save_queue,
                save_on_shutdown: self.kv_tier_disk_save_on_shutdown,
            })
        } else {
            None
        };
        let cfg = TierConfig {
            namespace,
            host,
            redis,
            disk,
            spare_bytes: self.kv_tier_spare_bytes,
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}

/// `1048576`, `512K`, `64M`, `4G`, `4GiB`, `1.5G` (K = KiB = 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown byte unit `{other}` in `{s}`")),
    };
    if num.contains('.') {
        let x: f64 = num.parse().map_err(|_| format!("not a size: `{s}`"))?;
        let v = x * mult as f64;
        if !(0.0..1.8e19).contains(&v) {
            return Err(format!("size out of range: `{s}`"));
        }
        Ok(v as u64)
    } else {
        let n: u64 = num.parse().map_err(|_| format!("not a size: `{s}`"))?;
        n.checked_mul(mult)
            .ok_or_else(|| format!("size out of range: `{s}`"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        tiers: TierArgs,
    }

    fn ns() -> TierNamespace {
        TierNamespace {
            model_fingerprint: [0; 32],
            kv_layout: "f16".into(),
            block_size: 16,
        }
    }

    #[test]
    fn tier_spec_parses() {
        let both = TierSpec {
            host: true,
            redis: true,
            disk: false,
        };
        assert_eq!("host,redis".parse::<TierSpec>(), Ok(both));
        assert_eq!("Redis , host".parse::<TierSpec>(), Ok(both));
        assert_eq!(
            "host".parse::<TierSpec>(),
            Ok(TierSpec {
                host: true,
                redis: false,
                disk: false
            })
        );
        assert_eq!(
            "host,disk,redis".parse::<TierSpec>(),
            Ok(TierSpec {
                host: true,
                redis: true,
                disk: true
            })
        );
        assert!("ssd".parse::<TierSpec>().is_err());
        assert!("".parse::<TierSpec>().is_err());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("1048576"), Ok(1_048_576));
        assert_eq!(parse_bytes("512K"), Ok(524_288));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("1.5M"), Ok(1_572_864));
        assert!(parse_bytes("4Q").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }

    #[test]
    fn redis_targets() {
        assert_eq!(
            RedisTarget::parse("redis://127.0.0.1:6379", false).unwrap(),
            RedisTarget::Single("redis://127.0.0.1:6379".into())
        );
        assert_eq!(
            RedisTarget::parse("redis://a:1, redis://b:2", false).unwrap(),
            RedisTarget::Cluster(vec!["redis://a:1".into(), "redis://b:2".into()])
        );
        assert_eq!(
            RedisTarget::parse("rediss://a:1", true).unwrap(),
            RedisTarget::Cluster(vec!["rediss://a:1".into()])
        );
        assert!(RedisTarget::parse("http://a:1", false).is_err());
        assert!(RedisTarget::parse(" , ", false).is_err());
        let t = RedisTarget::Single("redis://user:hunter2@h:1/0".into());
        assert_eq!(t.display(), "redis://user:***@h:1/0");
    }

    #[test]
    fn flags_become_config() {
        let cli = Cli::parse_from([
            "x",
            "--kv-tier",
            "host,redis",
            "--kv-tier-host-bytes",
            "1G",
            "--kv-tier-redis-url",
            "redis://127.0.0.1:7000",
            "--kv-tier-secret",
            "s3cret",
            "--kv-tier-ttl-s",
            "60",
            "--kv-tier-redis-bytes",
            "2G",
            "--kv-tier-timeout-ms",
            "250",
            "--kv-tier-save-queue",
            "8",
        ]);
        let cfg = cli.tiers.to_config(ns()).unwrap().unwrap();
        assert_eq!(cfg.host.unwrap().capacity_bytes, 1 << 30);
        let r = cfg.redis.unwrap();
        assert_eq!(
            r.target,
            RedisTarget::Single("redis://127.0.0.1:7000".into())
        );
        assert!(r.secret.is_some());
        assert!(!format!("{:?}", r.secret).contains("s3cret"));
        assert_eq!(r.ttl, Some(Duration::from_secs(60)));
        assert_eq!(r.budget_bytes, Some(2 << 30));
        assert_eq!(r.timeout, Duration::from_millis(250));
        assert_eq!(r.save_queue, 8);

        let none = Cli::parse_from(["x"]);
        assert!(none.tiers.to_config(ns()).unwrap().is_none());

        let missing_url = Cli::parse_from(["x", "--kv-tier", "redis"]);
        assert!(missing_url.tiers.to_config(ns()).is_err());

        let budget_without_ttl = Cli::parse_from([
            "x",
            "--kv-tier",
            "redis",
            "--kv-tier-redis-url",
            "redis://h:1",
            "--kv-tier-ttl-s",
            "0",
            "--kv-tier-redis-bytes",
            "1M",
        ]);
        assert!(budget_without_ttl.tiers.to_config(ns()).is_err());

        let disk = Cli::parse_from([
            "x",
            "--kv-tier",
            "host,disk",
            "--kv-tier-disk-path",
            "/tmp/kv",
            "--kv-tier-disk-bytes",
            "3M",
            "--kv-tier-disk-save-on-shutdown",
            "--kv-tier-secret",
            "k",
        ]);
        let d = disk.tiers.to_config(ns()).unwrap().unwrap().disk.unwrap();
        assert_eq!(d.dir, std::path::PathBuf::from("/tmp/kv"));
        assert_eq!(d.capacity_bytes, 3 << 20);
        assert!(d.save_on_shutdown && d.secret.is_some());
        assert_eq!(d.save_queue, 256);
        let no_path = Cli::parse_from(["x", "--kv-tier", "disk"]);
        assert!(no_path.tiers.to_config(ns()).is_err());
    }
}
