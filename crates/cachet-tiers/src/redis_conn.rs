//! The few Redis operations the tier needs, over one server or a Redis Cluster.
//!
//! **Batching.** One server: a lookup is one pipeline of `EXISTS` (one round trip), a load one
//! `MGET`, a save batch one pipeline of `SET … PX`. A cluster: an `MGET` whose keys live in
//! several slots is refused by Redis (`CROSSSLOT`), so the `redis` crate splits it into one
//! `MGET` per slot and sends them at once over its one multiplexed connection per node; the
//! sub-commands bound for a node leave back to back, so the load costs one round trip per
//! node, all nodes in parallel, with `MOVED`/`ASK` handled per sub-command by the crate.
//! Lookups and saves are sent the same way, as concurrent single-key commands.
//!
//! **Why no hash tags.** A `{tag}` would put all keys sharing it in one slot, so one `MGET`
//! would do, but the tag must be computable from the block hash alone (blocks are shared
//! across prompts by hash), which leaves tagging by namespace or by the chain's first block:
//! either pins a model's (or a shared system prompt's) whole KV to one slot, one master — no
//! spreading of memory or bandwidth, a hot spot, and a failover takes all of it. Untagged keys
//! spread over all 16,384 slots like any Redis data, and the per-node multiplexing above keeps
//! the round trips per load at one per node anyway.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, RedisError, RedisResult, Value};

use crate::config::RedisTarget;

#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

fn install_tls_provider(target: &RedisTarget) {
    let tls = match target {
        RedisTarget::Single(u) => u.starts_with("rediss://"),
        RedisTarget::Cluster(us) => us.iter().any(|u| u.starts_with("rediss://")),
    };
    if tls {
        // Fails only when a provider is already installed, which is what we want anyway.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Opens a connection and checks it with a `PING` (every master, for a cluster).
pub(crate) async fn connect(
    target: &RedisTarget,
    timeout: Duration,
    ca_cert_pem: Option<&[u8]>,
) -> RedisResult<Conn> {
    install_tls_provider(target);
    let certs = || redis::TlsCertificates {
        client_tls: None,
        root_cert: ca_cert_pem.map(<[u8]>::to_vec),
    };
    let mut conn = match target {
        RedisTarget::Single(url) => {
            let client = if ca_cert_pem.is_some() && url.starts_with("rediss://") {
                redis::Client::build_with_tls(url.as_str(), certs())?
            } else {
                redis::Client::open(url.as_str())?
            };
            // Our own `tokio::time::timeout` bounds every call; the crate's response timeout
            // would turn a slow answer into an I/O error we could not tell from a lost link.
            let cfg = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(None);
            Conn::Single(
                client
                    .get_multiplexed_async_connection_with_config(&cfg)
                    .await?,
            )
        }
        RedisTarget::Cluster(urls) => {
            let mut builder = ClusterClient::builder(urls.iter().map(String::as_str));
            if ca_cert_pem.is_some() {
                builder = builder.certs(certs());
            }
            let client = builder
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(2)
                .min_retry_wait(10)
                .max_retry_wait(100)
                .build()?;
            Conn::Cluster(client.get_async_connection().await?)
        }
    };
    conn.ping().await?;
    Ok(conn)
}

/// Whether an error means Redis (or a cluster node) is unreachable or not serving — the tier
/// goes down and a fresh connection is made when a probe succeeds — as opposed to a server that
/// answered an ordinary error reply (out of memory, wrong type), which fails only its call.
/// `MOVED`/`ASK`/`TRYAGAIN`/`CLUSTERDOWN` that reach us are a topology in flux, and the crate's
/// client-side errors (such as a multi-slot `MGET` missing a node's part) mean a node is gone:
/// both are outages, so that the probe's fresh connection picks up the new slot map.
pub(crate) fn is_outage(e: &RedisError) -> bool {
    use redis::ErrorKind as K;
    use redis::ServerErrorKind as S;
    !matches!(
        e.kind(),
        K::Server(
            S::ResponseError
                | S::ExecAbort
                | S::NoScript
                | S::CrossSlot
                | S::NotBusy
                | S::NoSub
                | S::NoPerm
        ) | K::Extension
            | K::UnexpectedReturnType
    )
}

fn cluster_down(why: &'static str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
        why,
    ))
}

/// The distinct (host, port) of the masters in a `CLUSTER SLOTS` reply:
/// `[[start, end, [host, port, id, ...], replicas...], ...]`.
fn slot_masters(v: &Value) -> Vec<(String, u16)> {
    let mut out: Vec<(String, u16)> = Vec::new();
    let Value::Array(ranges) = v else {
        return out;
    };
    for r in ranges {
        let Value::Array(fields) = r else { continue };
        let Some(Value::Array(master)) = fields.get(2) else {
            continue;
        };
        let host = match master.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            _ => continue,
        };
        let Some(Value::Int(port)) = master.get(1) else {
            continue;
        };
        let Ok(port) = u16::try_from(*port) else {
            continue;
        };
        if !out.iter().any(|(h, p)| *h == host && *p == port) {
            out.push((host, port));
        }
    }
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

impl Conn {
    /// One server: `PING`. A cluster: every master that `CLUSTER SLOTS` names must answer a
    /// `PING` on this connection (the crate's fan-out to "all nodes" silently skips nodes it
    /// could not connect to, so each master is addressed by name), and every master must report
    /// `cluster_state:ok` — a probe does not declare the tier up while a master is gone or a
    /// failover is under way.
    pub(crate) async fn ping(&mut self) -> RedisResult<()> {
        match self {
            Conn::Single(c) => redis::cmd("PING").query_async::<()>(c).await,
            Conn::Cluster(c) => {
                use redis::cluster_routing::{
                    MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo,
                };
                let slots: Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(c).await?;
                let masters = slot_masters(&slots);
                if masters.is_empty() {
                    return Err(cluster_down("CLUSTER SLOTS named no master"));
                }
                for (host, port) in masters {
                    let routing =
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                    c.route_command(redis::cmd("PING"), routing).await?;
                }
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let v = c
                    .route_command(redis::cmd("CLUSTER").arg("INFO").clone(), routing)
                    .await?;
                let answers = match v {
                    Value::Map(kv) => kv.into_iter().map(|(_, v)| v).collect(),
                    other => vec![other],
                };
                let ok = !answers.is_empty()
                    && answers.iter().all(|a| match a {
                        Value::BulkString(b) => contains(b, b"cluster_state:ok"),
                        Value::VerbatimString { text, .. } => text.contains("cluster_state:ok"),
                        _ => false,
                    });
                if ok {
                    Ok(())
                } else {
                    Err(cluster_down("a master does not report cluster_state:ok"))
                }
            }
        }
    }

    /// Whether each key exists.
    pub(crate) async fn exists(&mut self, keys: &[Vec<u8>]) -> RedisResult<Vec<bool>> {
        match self {
            Conn::Single(c) => {
                let mut pipe = redis::pipe();
                for k in keys {
                    pipe.cmd("EXISTS").arg(k.as_slice());
                }
                let v: Vec<i64> = pipe.query_async(c).await?;
                Ok(v.into_iter().map(|n| n > 0).collect())
            }
            Conn::Cluster(c) => {
                let futs = keys.iter().map(|k| {
                    let mut c = c.clone();
                    async move {
                        redis::cmd("EXISTS")
                            .arg(k.as_slice())
                            .query_async::<i64>(&mut c)
                            .await
                    }
                });
                let v = futures_util::future::join_all(futs).await;
                v.into_iter().map(|r| r.map(|n| n > 0)).collect()
            }
        }
    }

    /// The values of `keys`, in order (`None` = absent).
    pub(crate) async fn mget(&mut self, keys: &[Vec<u8>]) -> RedisResult<Vec<Option<Vec<u8>>>> {
        let mut cmd = redis::cmd("MGET");
        for k in keys {
            cmd.arg(k.as_slice());
        }
        let v: Value = match self {
            Conn::Single(c) => cmd.query_async(c).await?,
            Conn::Cluster(c) => cmd.query_async(c).await?,
        };
        let items = match v {
            Value::Array(items) => items,
            other => {
                return Err(RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "MGET did not answer an array",
                    format!("{other:?}").chars().take(80).collect::<String>(),
                )))
            }
        };
        if items.len() != keys.len() {
            return Err(RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "MGET answered the wrong number of values",
            )));
        }
        Ok(items
            .into_iter()
            .map(|it| match it {
                Value::BulkString(b) => Some(b),
                // Nil = absent; any other type under our key is not a value of ours.
                _ => None,
            })
            .collect())
    }

    /// `SET key value [PX ttl]` for each item; per item whether it was stored.
    pub(crate) async fn set_many(
        &mut self,
        items: &[(Vec<u8>, Vec<u8>)],
        ttl: Option<Duration>,
    ) -> RedisResult<Vec<bool>> {
        let set = |k: &[u8], v: &[u8]| {
            let mut c = redis::cmd("SET");
            c.arg(k).arg(v);
            if let Some(t) = ttl {
                c.arg("PX").arg(t.as_millis().max(1) as u64);
            }
            c
        };
        match self {
            Conn::Single(c) => {
                let mut pipe = redis::pipe();
                for (k, v) in items {
                    pipe.add_command(set(k, v));
                }
                let v: Vec<RedisResult<()>> = pipe.ignore_errors().query_async(c).await?;
                Ok(v.iter().map(Result::is_ok).collect())
            }
            Conn::Cluster(c) => {
                let futs = items.iter().map(|(k, v)| {
                    let mut c = c.clone();
                    let cmd = set(k, v);
                    async move { cmd.query_async::<()>(&mut c).await }
                });
                let v = futures_util::future::join_all(futs).await;
                // A lost node fails the batch's items on it; report the first outage error so
                // the caller marks the tier down, the rest item by item.
                if let Some(e) = v
                    .iter()
                    .find_map(|r| r.as_ref().err().filter(|e| is_outage(e)))
                {
                    return Err(e.clone());
                }
                Ok(v.iter().map(Result::is_ok).collect())
            }
        }
    }
}
