//! cachet-kernels: the hot CPU kernels of the cachet serving engine.
//!
//! The crate is built in layers; a module imports only from the layers below it (a test,
//! `tests/layers.rs`, checks it):
//!
//! 1. **Bottom** — [`isa`] (run-time CPU feature dispatch, `CACHET_ISA=scalar|avx2|avx512|amx`
//!    caps it; the AMX tile primitives and their software model), [`pool`] (a persistent
//!    thread pool, spawned once; the caller participates), the error type and small utilities.
//! 2. **Formats** — [`formats`]: the ggml block layouts (bit-exact), dequantization and
//!    reference quantizers, the packed layout every matmul kernel reads (16-row interleaved
//!    groups, 4 consecutive codes of 16 rows per 64 bytes), quantized activations, and the
//!    KV arena layout.
//! 3. **Micro-kernels** — `micro`: one module per level (scalar reference, AVX2, AVX-512
//!    VNNI, AMX tiles), each depending only on the formats and the ISA primitives.
//! 4. **Drivers** — [`QMatrix::matmul`] (activations quantized to int8 once per call, the
//!    matmul cut into (weight groups × activation-row tiles) pool tasks; the same
//!    micro-kernel serves decode and batched prefill; AMX tiles for 32+ activation rows,
//!    bit-identical to VNNI), [`attention`] (paged attention over the block arena, chunked
//!    online softmax, one K/V read per GQA group, f16 or f32 KV; [`attention::paged_attention_parallel`]
//!    splits (token, kv head) items, and long contexts into merged segments, over a pool),
//!    and [`act`] (SwiGLU).
//!
//! [`quant`] re-exports the formats and [`QMatrix`] under the crate's historical path.
//!
//! Typical use:
//! ```
//! use cachet_kernels::{QMatrix, ThreadPool, WeightType};
//! let pool = ThreadPool::new(2);
//! // 32 output features × 64 inputs, quantized here; normally `from_gguf_bytes(ty, rows, cols, bytes)`.
//! let w: Vec<f32> = (0..32 * 64).map(|i| (i % 7) as f32 - 3.0).collect();
//! let m = QMatrix::quantize_f32(WeightType::Q4_1, 32, 64, &w).unwrap();
//! let x = vec![0.5f32; 2 * 64]; // 2 activation rows
//! let mut y = vec![0f32; 2 * 32];
//! m.matmul(&pool, &x, 2, &mut y);
//! ```
//!
//! Several projections that read the same input (q/k/v, gate/up) can be fused into one
//! matrix by concatenating their raw GGUF bytes along rows before `from_gguf_bytes`: one
//! activation quantization and one pool dispatch instead of several.

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

// Bottom layer.
mod error;
pub mod isa;
pub mod pool;
mod util;
// Formats.
pub mod formats;
// Micro-kernels.
mod micro;
// Drivers (public entry points).
mod drivers;
pub use drivers::{act, attention, probe};
pub mod quant;

pub use error::KernelError;
pub use pool::ThreadPool;
pub use quant::{QMatrix, WeightType};
