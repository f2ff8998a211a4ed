//! The crate's one error type.

use thiserror::Error;

/// Errors from constructing or using kernels.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    #[error("unsupported weight type {0}")]
    UnsupportedType(String),
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    #[error("size mismatch: {what}: expected {expected}, got {got}")]
    SizeMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
}
