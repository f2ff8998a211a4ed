use thiserror::Error;

/// Errors of the benchmark library.
#[derive(Debug, Error)]
pub enum BenchError {
    #[error("HTTP error talking to {url}: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("stream error: {0}")]
    Stream(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("server {name} did not become healthy within {secs} s (log: {log})")]
    Unhealthy {
        name: String,
        secs: u64,
        log: String,
    },
    #[error("{0}")]
    Peer(String),
    #[error("model: {0}")]
    Model(#[from] cachet_model::ModelError),
    #[error("executor: {0}")]
    Exec(#[from] cachet_core::ExecError),
    #[error("plot: {0}")]
    Plot(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("setup: {0}")]
    Setup(String),
}

impl BenchError {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        BenchError::Io {
            what: what.into(),
            source,
        }
    }
}
