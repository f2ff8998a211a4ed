//! KV cache events publisher (skeleton).
