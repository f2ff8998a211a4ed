//! KV cache events in vLLM's wire format, so that cache-aware routers (NVIDIA Dynamo's KV
//! router and standalone indexer, llm-d's precise prefix-cache scorer, SGLang's router) can learn
//! what each cachet instance holds.
//!
//! - [`KvEventsConfig`]: vLLM's `--kv-events-config` JSON, same keys and defaults.
//! - [`wire`]: the msgpack encoding of a [`cachet_core::events::EventBatch`] (tagged maps, or
//!   the older tagged arrays).
//! - [`ZmqPublisher`]: PUB socket `[topic, seq, payload]`, ROUTER replay socket, a bounded queue
//!   and a thread of its own; `publish` never blocks.
//! - [`EventLog`]: a bounded replayable ring with live subscribers, for the server's SSE
//!   endpoint.
//!
//! Routers treat only `medium: "GPU"` blocks as held by the engine; cachet names its local block
//! pool so (see [`cachet_core::events::Medium`]).

pub mod config;
pub mod held;
pub mod log;
pub mod publisher;
pub mod replay;
pub mod wire;

pub use config::{KvEventsConfig, PublisherKind};
pub use log::{EventLog, EventSubscription, LoggedBatch, Next};
pub use publisher::ZmqPublisher;
pub use wire::{encode_batch, Encoding};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    /// `--kv-events-config` could not be used; the message names the key.
    #[error("--kv-events-config: {0}")]
    Config(String),
    #[error("cannot bind KV events socket {endpoint}: {reason}")]
    Bind { endpoint: String, reason: String },
    #[error("KV events publisher thread: {0}")]
    Thread(String),
}

/// Starts the publisher `cfg` asks for: `None` when events are disabled or the publisher is
/// `null`.
pub fn start_publisher(cfg: &KvEventsConfig) -> Result<Option<ZmqPublisher>, KvEventsError> {
    if cfg.publishes_zmq() {
        ZmqPublisher::start(cfg).map(Some)
    } else {
        Ok(None)
    }
}
