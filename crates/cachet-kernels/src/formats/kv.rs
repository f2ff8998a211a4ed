//! The KV arena of one layer (contract with `cachet-model`): K and V are separate slices, each
//! `[num_blocks][block_size][n_kv_heads][head_dim]` of `f32` or `half::f16`. Position `p` of a
//! sequence lives in block `block_table[p / block_size]`, slot `p % block_size`.

use half::f16;

/// Element type of the KV arena. The SIMD kernels recognise `f32` and `half::f16` (by type
/// id); other implementations run the portable path.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// Arguments of the paged attention kernels (`crate::attention::paged_attention`).
#[derive(Clone, Copy, Debug)]
pub struct PagedAttnArgs<'a> {
    pub block_table: &'a [u32],
    pub block_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub start_pos: usize,
    pub n_tokens: usize,
    pub scale: f32,
}
