//! Formats: what the bytes mean. The ggml block layouts (bit-exact), their dequantization and
//! reference quantizers, the packed layout every matmul micro-kernel reads, the quantized
//! activations, and the KV arena's layout. Nothing here computes a matmul or knows an
//! instruction set; the layers above (`micro`, `drivers`) build on these definitions.
//!
//! # Packed layout
//! At load time quantized matrices are repacked into an interleaved layout: rows are taken
//! in groups of 16 and, for every `bk`-wide block of columns (32, or 16 for Q6_K, Q3_K and
//! Q2_K), the group's unsigned integer codes are stored so that one 64-byte vector holds 4
//! consecutive codes of each of the 16 rows (the operand layout of `vpdpbusd`), followed by
//! the 16 per-row scales (and mins). Every block value is `d * q + c` with `q` an unsigned
//! code and `c = m` (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) or `c = -off * d` (Q4_0: 8, Q5_0: 16,
//! Q8_0, IQ4_NL and IQ4_XS: 128 (their levels + 128), Q6_K and Q3_K: 32). 4-bit codes are
//! stored two per byte, all others one per byte (`packed::PFmt` lists the layouts and which
//! types share one). BF16 weights widen to f32 at load (exactly).
//!
//! # Quantized activations
//! Activations are quantized once per matmul to int8 in blocks of `bk` (ggml's Q8_0 scheme:
//! `d = amax / 127`), with per-block sums, and the kernels accumulate exact integer dot
//! products, so for a block: `sum_k w_k x_k ≈ d_w d_x Σ q_k a_k + c_w d_x Σ a_k`.

pub(crate) mod act;
pub mod blocks;
pub mod dequant;
pub mod kquants;
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
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
    BF16,
}

impl WeightType {
    /// Every supported type.
    pub const ALL: [WeightType; 15] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::BF16,
        WeightType::Q8_0,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q2K,
        WeightType::Q3K,
        WeightType::Q4K,
        WeightType::Q5K,
        WeightType::Q6K,
        WeightType::IQ4NL,
        WeightType::IQ4XS,
    ];

    /// Number of values in one block.
    pub const fn block_len(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => 1,
            WeightType::Q8_0
            | WeightType::Q4_0
            | WeightType::Q4_1
            | WeightType::Q5_0
            | WeightType::Q5_1
            | WeightType::IQ4NL => 32,
            WeightType::Q2K
            | WeightType::Q3K
            | WeightType::Q4K
            | WeightType::Q5K
            | WeightType::Q6K
            | WeightType::IQ4XS => 256,
        }
    }

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 | WeightType::BF16 => 2,
            WeightType::Q8_0 => 34,
            WeightType::Q4_0 => 18,
            WeightType::Q4_1 => 20,
            WeightType::Q5_0 => 22,
            WeightType::Q5_1 => 24,
            WeightType::Q2K => 84,
            WeightType::Q3K => 110,
            WeightType::Q4K => 144,
            WeightType::Q5K => 176,
            WeightType::Q6K => 210,
            WeightType::IQ4NL => 18,
            WeightType::IQ4XS => 136,
        }
    }

    /// The ggml type id (`enum ggml_type`).
    pub const fn ggml_type_id(self) -> u32 {
        match self {
            WeightType::F32 => 0,
            WeightType::F16 => 1,
            WeightType::Q4_0 => 2,
            WeightType::Q4_1 => 3,
            WeightType::Q5_0 => 6,
            WeightType::Q5_1 => 7,
            WeightType::Q8_0 => 8,
            WeightType::Q2K => 10,
            WeightType::Q3K => 11,
            WeightType::Q4K => 12,
            WeightType::Q5K => 13,
            WeightType::Q6K => 14,
            WeightType::IQ4NL => 20,
            WeightType::IQ4XS => 23,
            WeightType::BF16 => 30,
        }
    }

    /// Map a ggml type id to a supported type.
    pub fn from_ggml_type_id(id: u32) -> Result<WeightType, KernelError> {
        WeightType::ALL
            .into_iter()
            .find(|t| t.ggml_type_id() == id)
            .ok_or_else(|| {
                KernelError::UnsupportedType(format!(
                    "ggml type id {id} (supported: {})",
                    WeightType::supported_names()
                ))
            })
    }

    /// The name ggml and `llama-quantize` give the type (`ggml_type_name`).
    pub const fn ggml_name(self) -> &'static str {
        match self {
            WeightType::F32 => "F32",
            WeightType::F16 => "F16",
            WeightType::BF16 => "BF16",
            WeightType::Q8_0 => "Q8_0",
            WeightType::Q4_0 => "Q4_0",
            WeightType::Q4_1 => "Q4_1",
            WeightType::Q5_0 => "Q5_0",
            WeightType::Q5_1 => "Q5_1",
            WeightType::Q2K => "Q2_K",
            WeightType::Q3K => "Q3_K",
            WeightType::Q4K => "Q4_K",
            WeightType::Q5K => "Q5_K",
            WeightType::Q6K => "Q6_K",
            WeightType::IQ4NL => "IQ4_NL",
            WeightType::IQ4XS => "IQ4_XS",
        }
    }

    /// Every supported type's ggml name, comma-separated (for error messages).
    pub fn supported_names() -> String {
        WeightType::ALL.map(WeightType::ggml_name).join(", ")
    }

    /// Bytes of a row of `cols` values (`cols` must be a multiple of `block_len`).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_len() * self.block_bytes()
    }
}
