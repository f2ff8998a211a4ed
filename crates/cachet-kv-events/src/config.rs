//! `--kv-events-config`: vLLM's `KVEventsConfig` JSON, with vLLM's defaults.

use serde::Deserialize;

use crate::wire::Encoding;
use crate::KvEventsError;

/// Which publisher runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublisherKind {
    /// Events are produced and discarded.
    Null,
    /// The ZMQ PUB (and optional ROUTER replay) publisher.
    Zmq,
}

/// vLLM's `KVEventsConfig` (same keys, same defaults), plus cachet's `cachet_encoding`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// Default `false`.
    pub enable_kv_cache_events: bool,
    /// Default: `zmq` when events are enabled, else `null` (vLLM's rule).
    pub publisher: PublisherKind,
    /// The PUB socket. Bound when it contains `*` (or `::`, or is `ipc://`), else connected.
    /// Default `tcp://*:5557`.
    pub endpoint: String,
    /// The ROUTER socket for replay requests, always bound. Default none.
    pub replay_endpoint: Option<String>,
    /// How many past batches the replay socket can resend. Default 10,000.
    pub buffer_steps: usize,
    /// ZMQ high-water mark of the PUB socket. Default 100,000. Accepted for compatibility: the
    /// `zeromq` crate's PUB socket queues at most 100,000 messages per subscriber and drops
    /// beyond that, whatever this says.
    pub hwm: usize,
    /// Batches waiting for the publisher thread; beyond this, batches are dropped (counted).
    /// Default 100,000.
    pub max_queue_size: usize,
    /// The first frame of every message. Default empty.
    pub topic: String,
    /// cachet's `cachet_encoding`: `"map"` (default, vLLM's current form) or `"array"` (the
    /// older positional form).
    pub encoding: Encoding,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: PublisherKind::Null,
            endpoint: DEFAULT_ENDPOINT.to_string(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
            encoding: Encoding::Map,
        }
    }
}

/// vLLM's default PUB endpoint.
pub const DEFAULT_ENDPOINT: &str = "tcp://*:5557";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    enable_kv_cache_events: Option<bool>,
    publisher: Option<PublisherKind>,
    endpoint: Option<String>,
    replay_endpoint: Option<String>,
    buffer_steps: Option<usize>,
    hwm: Option<usize>,
    max_queue_size: Option<usize>,
    topic: Option<String>,
    cachet_encoding: Option<Encoding>,
}

impl KvEventsConfig {
    /// Parses the JSON object vLLM's `--kv-events-config` takes. Unknown keys, wrong types and
    /// unusable values are errors that name the key.
    pub fn from_json(s: &str) -> Result<Self, KvEventsError> {
        let raw: Raw = serde_json::from_str(s).map_err(|e| KvEventsError::Config(e.to_string()))?;
        let d = KvEventsConfig::default();
        let enable = raw
            .enable_kv_cache_events
            .unwrap_or(d.enable_kv_cache_events);
        let cfg = KvEventsConfig {
            enable_kv_cache_events: enable,
            publisher: raw.publisher.unwrap_or(if enable {
                PublisherKind::Zmq
            } else {
                PublisherKind::Null
            }),
            endpoint: raw.endpoint.unwrap_or(d.endpoint),
            replay_endpoint: raw.replay_endpoint,
            buffer_steps: raw.buffer_steps.unwrap_or(d.buffer_steps),
            hwm: raw.hwm.unwrap_or(d.hwm),
            max_queue_size: raw.max_queue_size.unwrap_or(d.max_queue_size),
            topic: raw.topic.unwrap_or(d.topic),
            encoding: raw.cachet_encoding.unwrap_or(d.encoding),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether a ZMQ publisher should run.
    pub fn publishes_zmq(&self) -> bool {
        self.enable_kv_cache_events && self.publisher == PublisherKind::Zmq
    }

    /// Checks values the types allow but the publisher cannot use.
    pub fn validate(&self) -> Result<(), KvEventsError> {
        if self.max_queue_size == 0 {
            return Err(KvEventsError::Config(
                "max_queue_size: must be at least 1 (the queue is bounded)".into(),
            ));
        }
        check_endpoint("endpoint", &self.endpoint)?;
        if let Some(r) = &self.replay_endpoint {
            check_endpoint("replay_endpoint", r)?;
            // Port 0 asks for any free port: two such endpoints do not clash.
            if r == &self.endpoint && !r.ends_with(":0") {
                return Err(KvEventsError::Config(
                    "replay_endpoint: must differ from endpoint".into(),
                ));
            }
        }
        Ok(())
    }
}

fn check_endpoint(key: &str, ep: &str) -> Result<(), KvEventsError> {
    let ok = if let Some(rest) = ep.strip_prefix("tcp://") {
        match rest.rsplit_once(':') {
            Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok(),
            None => false,
        }
    } else if let Some(path) = ep.strip_prefix("ipc://") {
        !path.is_empty()
    } else {
        false
    };
    if ok {
        Ok(())
    } else {
        Err(KvEventsError::Config(format!(
            "{key}: {ep:?} is not a tcp://HOST:PORT or ipc://PATH endpoint"
        )))
    }
}

/// vLLM's rule for the PUB socket: bind a wildcard, `::` or local endpoint, connect anything
/// else ("bind stable, connect volatile").
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The address the `zeromq` crate can bind for `endpoint`: libzmq's `*` host (every
/// interface) is `0.0.0.0`; the crate would try to resolve `*` as a host name.
pub fn bindable(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_vllms() {
        let c = KvEventsConfig::from_json("{}").unwrap();
        assert_eq!(c, KvEventsConfig::default());
        assert!(!c.enable_kv_cache_events);
        assert_eq!(c.publisher, PublisherKind::Null);
        assert_eq!(c.endpoint, "tcp://*:5557");
        assert_eq!(c.replay_endpoint, None);
        assert_eq!(
            (c.buffer_steps, c.hwm, c.max_queue_size),
            (10_000, 100_000, 100_000)
        );
        assert_eq!(c.topic, "");
        assert_eq!(c.encoding, Encoding::Map);
        assert!(!c.publishes_zmq());
    }

    #[test]
    fn enabling_picks_zmq_unless_told_otherwise() {
        let c = KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true}"#).unwrap();
        assert_eq!(c.publisher, PublisherKind::Zmq);
        assert!(c.publishes_zmq());
        let c =
            KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#)
                .unwrap();
        assert_eq!(c.publisher, PublisherKind::Null);
        assert!(!c.publishes_zmq());
    }

    #[test]
    fn every_key_is_read() {
        let c = KvEventsConfig::from_json(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": "tcp://127.0.0.1:6000", "replay_endpoint": "tcp://*:6001",
                "buffer_steps": 7, "hwm": 8, "max_queue_size": 9, "topic": "kv",
                "cachet_encoding": "array"}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            KvEventsConfig {
                enable_kv_cache_events: true,
                publisher: PublisherKind::Zmq,
                endpoint: "tcp://127.0.0.1:6000".into(),
                replay_endpoint: Some("tcp://*:6001".into()),
                buffer_steps: 7,
                hwm: 8,
                max_queue_size: 9,
                topic: "kv".into(),
                encoding: Encoding::Array,
            }
        );
    }

    #[test]
    fn errors_name_the_key() {
        let e = KvEventsConfig::from_json(r#"{"enable_kv_cache_event": true}"#).unwrap_err();
        assert!(e.to_string().contains("enable_kv_cache_event"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"publisher": "nats"}"#).unwrap_err();
        assert!(e.to_string().contains("nats"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"buffer_steps": -1}"#).unwrap_err();
        assert!(e.to_string().contains("invalid value"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"max_queue_size": 0}"#).unwrap_err();
        assert!(e.to_string().contains("max_queue_size"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"endpoint": "udp://x:1"}"#).unwrap_err();
        assert!(e.to_string().contains("endpoint"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"replay_endpoint": "tcp://*:x"}"#).unwrap_err();
        assert!(e.to_string().contains("replay_endpoint"), "{e}");
        let e = KvEventsConfig::from_json(r#"{"cachet_encoding": "cbor"}"#).unwrap_err();
        assert!(e.to_string().contains("cbor"), "{e}");
        assert!(KvEventsConfig::from_json("[1]").is_err());
    }

    #[test]
    fn bind_or_connect() {
        assert!(binds("tcp://*:5557"));
        assert!(binds("tcp://[::]:5557"));
        assert!(binds("ipc:///tmp/kv"));
        assert!(!binds("tcp://127.0.0.1:5557"));
        assert!(!binds("tcp://router.local:5557"));
        assert_eq!(bindable("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(bindable("tcp://127.0.0.1:0"), "tcp://127.0.0.1:0");
    }
}
