//! Formats: what the bytes mean. The ggml block layouts (bit-exact), their dequantization and
//! reference quantizers, the packed layout every matmul micro-kernel reads, the quantized
//! activations, and the KV arena's layout. Nothing here computes a matmul or knows an
//! instruction set; the layers above (`micro`, `drivers`) build on these definitions.
//!
//! # Packed layout
//! At load time quantized matrices are repacked into an interleaved layout: rows are taken
//! in groups of 16 and, for every `bk`-wide block of columns (32, or 16 for Q6_K), the
//! group's unsigned integer codes are stored so that one 64-byte vector holds 4 consecutive
//! codes of each of the 16 rows (the operand layout of `vpdpbusd`), followed by the 16
//! per-row scales (and mins). Every block value is `d * q + c` with `q` an unsigned code and
//! `c = m` (Q4_1, Q4_K) or `c = -off * d` (Q4_0: 8, Q8_0: 128, Q6_K: 32).
//!
//! # Quantized activations
//! Activations are quantized once per matmul to int8 in blocks of `bk` (ggml's Q8_0 scheme:
//! `d = amax / 127`), with per-block sums, and the kernels accumulate exact integer dot
//! products, so for a block: `sum_k w_k x_k ≈ d_w d_x Σ q_k a_k + c_w d_x Σ a_k`.

pub(crate) mod act;
pub mod blocks;
pub mod dequant;
pub mod kv;
pub(crate) mod packed;
pub mod quantize;

use crate::error::KernelError;

/// GGUF/ggml tensor element types supported by `QMatrix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q6K,
}

impl WeightType {
    /// Number of values in one block.
    pub const fn block_len(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 => 1,
            WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1 => 32,
            WeightType::Q4K | WeightType::Q6K => 256,
        }
    }

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 => 2,
            WeightType::Q8_0 => 34,
            WeightType::Q4_0 => 18,
            WeightType::Q4_1 => 20,
            WeightType::Q4K => 144,
            WeightType::Q6K => 210,
        }
    }

    /// The ggml type id (`enum ggml_type`).
    pub const fn ggml_type_id(self) -> u32 {
        match self {
            WeightType::F32 => 0,
            WeightType::F16 => 1,
            WeightType::Q4_0 => 2,
            WeightType::Q4_1 => 3,
            WeightType::Q8_0 => 8,
            WeightType::Q4K => 12,
            WeightType::Q6K => 14,
        }
    }

    /// Map a ggml type id to a supported type.
    pub fn from_ggml_type_id(id: u32) -> Result<WeightType, KernelError> {
        Ok(match id {
            0 => WeightType::F32,
            1 => WeightType::F16,
            2 => WeightType::Q4_0,
            3 => WeightType::Q4_1,
            8 => WeightType::Q8_0,
            12 => WeightType::Q4K,
            14 => WeightType::Q6K,
            other => {
                return Err(KernelError::UnsupportedType(format!(
                    "ggml type id {other}"
                )))
            }
        })
    }

    /// Bytes of a row of `cols` values (`cols` must be a multiple of `block_len`).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_len() * self.block_bytes()
    }
}
