//! GGUF/ggml weight formats and quantized matrix multiplication, under one path.
//!
//! The definitions live in layers: the block layouts, dequantization and reference
//! quantizers in [`crate::formats`], the matmul driver ([`QMatrix`]) in `crate::drivers`.
//! This module re-exports them as one public API (the path the crate has always had).
//!
//! # Formats
//! The block layouts are exactly ggml's (see the `Block*` structs). Dequantization
//! ([`dequantize_block`], [`QMatrix::dequantize_row`]) is bit-exact with ggml's reference
//! dequantizers.
//!
//! # Matmul
//! Quantized matrices are repacked at load time into groups of 16 rows (the layout is
//! described in [`crate::formats`]); activations are quantized once per call to int8
//! blocks, and the kernels accumulate exact integer dot products.

pub use crate::drivers::matmul::QMatrix;
pub use crate::error::KernelError;
pub use crate::formats::blocks::{
    q4k_pack_scales, q4k_scale_min, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ6K, BlockQ8_0,
};
pub use crate::formats::dequant::{
    bf16_to_f32, dequantize_block, dequantize_row_bytes, KVALUES_IQ4NL,
};
pub use crate::formats::kquants::q3k_scales;
pub use crate::formats::quantize::{
    f32_to_bf16, quantize_block_iq4nl, quantize_block_iq4xs, quantize_block_q2k,
    quantize_block_q3k, quantize_block_q4_0, quantize_block_q4_1, quantize_block_q4k,
    quantize_block_q5_0, quantize_block_q5_1, quantize_block_q5k, quantize_block_q6k,
    quantize_block_q8_0, quantize_row,
};
pub use crate::formats::WeightType;
