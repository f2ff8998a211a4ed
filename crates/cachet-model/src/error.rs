//! The crate's error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid GGUF file: {0}")]
    Gguf(String),
    #[error("unsupported architecture '{0}' (supported: llama, qwen2, qwen3, gemma3)")]
    UnsupportedArchitecture(String),
    #[error("tensor '{name}' has unsupported type {dtype} (supported: {supported})", supported = cachet_kernels::WeightType::supported_names())]
    UnsupportedTensorType { name: String, dtype: String },
    #[error("missing GGUF metadata key '{0}'")]
    MissingMetadata(String),
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    #[error("tensor '{name}' has shape {got:?}, expected {expected:?}")]
    BadShape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("kernel: {0}")]
    Kernel(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("invalid batch: {0}")]
    Batch(String),
}

impl From<ModelError> for cachet_core::ExecError {
    fn from(e: ModelError) -> Self {
        cachet_core::ExecError::Failed(e.to_string())
    }
}
