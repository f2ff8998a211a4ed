//! cachet-kernels: the hot CPU kernels of the cachet serving engine.
//!
//! * [`quant`]: GGUF/ggml block formats (bit-exact), load-time repacking and quantized
//!   matrix multiplication ([`QMatrix::matmul`]): activations are quantized to int8 blocks
//!   once per call, weights are repacked into 16-row interleaved groups, and the kernels
//!   accumulate exact int32 dot products (`vpdpbusd` with AVX-512 VNNI, `vpmaddubsw` with
//!   AVX2, plain Rust otherwise). The same micro-kernel serves decode (m = 1..4) and
//!   batched prefill (tiles of 4 activation rows × 32 weight rows).
//! * `amx` (x86-64): with AMX tiles, matmuls of 8 or more activation rows compute each
//!   weight block as a `tdpbsud` tile product on the same packed layout, bit-identical to
//!   the AVX-512 VNNI kernel. The tile instructions sit behind a small trait with a
//!   software model, so the kernel is tested on CPUs without AMX as well.
//! * [`attention`]: paged attention over a KV block arena, reading K/V in place through the
//!   block table, chunked online softmax, one K/V read per GQA group, f16 or f32 KV.
//!   [`attention::paged_attention_parallel`] splits (token, kv head) items, and long
//!   contexts into merged segments (flash-decoding), over a pool.
//! * [`act`]: element-wise activations (SwiGLU) with the same ISA dispatch.
//! * [`pool`]: a persistent thread pool (spawned once; the caller participates).
//! * [`isa`]: run-time CPU feature dispatch (`CACHET_ISA=scalar|avx2|avx512|amx` caps it).
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

pub mod act;
#[cfg(target_arch = "x86_64")]
mod amx;
pub mod attention;
pub mod isa;
pub mod pool;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use pool::ThreadPool;
pub use quant::{KernelError, QMatrix, WeightType};
