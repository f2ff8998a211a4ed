//! cachet-kernels: the hot CPU kernels of the cachet serving engine.
//!
//! * [`quant`]: GGUF/ggml block formats (bit-exact), load-time repacking and quantized
//!   matrix multiplication (int8 activations, VNNI / AVX2 / scalar kernels).
//! * [`attention`]: paged attention over a KV block arena with online softmax.
//! * [`pool`]: a persistent thread pool the kernels parallelise over.
//! * [`isa`]: run-time CPU feature dispatch.

pub mod attention;
pub mod isa;
pub mod pool;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use pool::ThreadPool;
pub use quant::{KernelError, QMatrix, WeightType};
