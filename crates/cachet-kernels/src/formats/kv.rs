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
    /// Sliding window: query token `t` (at position `p = start_pos + t`) sees only the
    /// positions `max(0, p + 1 - window)..=p` (`window` of them, itself included); 0 is no
    /// window (the whole causal context).
    pub window: usize,
}

/// Append `src` to `out` with non-temporal (streaming) stores where the CPU has AVX2: for
/// copies of KV out of the arena into tier buffers (~46 MB for a 2,000-token prompt of the
/// default model) that nothing reads soon. Ordinary stores first read every destination line
/// (a write-allocate from DRAM, the buffers being cold); streaming stores skip that read and
/// leave the caches to the arena. The bytes are exactly `src`'s.
pub fn append_streaming(out: &mut Vec<u8>, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= 4096 && crate::isa::detected() >= crate::isa::Isa::Avx2 {
        out.reserve(src.len());
        let len = out.len();
        let dst = &mut out.spare_capacity_mut()[..src.len()];
        // SAFETY: AVX2 detected; `dst` has room for `src.len()` bytes, and the call writes
        // every one of them, so the first `len + src.len()` bytes are initialised.
        unsafe {
            stream_copy(src, dst.as_mut_ptr() as *mut u8);
            out.set_len(len + src.len());
        }
        return;
    }
    out.extend_from_slice(src);
}

/// `dst[..src.len()] = src`: unaligned head with ordinary stores up to a 32-byte boundary of
/// `dst`, then 32-byte streaming stores, then the tail; a store fence at the end orders the
/// streaming stores before whatever the caller does next.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_copy(src: &[u8], dst: *mut u8) {
    use std::arch::x86_64::*;
    let n = src.len();
    let s = src.as_ptr();
    let head = dst.align_offset(32).min(n);
    std::ptr::copy_nonoverlapping(s, dst, head);
    let mut i = head;
    while i + 128 <= n {
        for j in 0..4 {
            let v = _mm256_loadu_si256(s.add(i + 32 * j) as *const __m256i);
            _mm256_stream_si256(dst.add(i + 32 * j) as *mut __m256i, v);
        }
        i += 128;
    }
    while i + 32 <= n {
        let v = _mm256_loadu_si256(s.add(i) as *const __m256i);
        _mm256_stream_si256(dst.add(i) as *mut __m256i, v);
        i += 32;
    }
    std::ptr::copy_nonoverlapping(s.add(i), dst.add(i), n - i);
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length and misalignment around the streaming thresholds appends exactly the
    /// source bytes after what `out` held.
    #[test]
    fn append_streaming_appends_exactly_the_bytes() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 31 + 7) as u8).collect();
        for pre in [0usize, 1, 5, 31, 32, 33] {
            for n in [0usize, 1, 4095, 4096, 4097, 4096 + 31, 10_000, 19_999] {
                let mut out: Vec<u8> = (0..pre).map(|i| i as u8 ^ 0xA5).collect();
                append_streaming(&mut out, &src[3..3 + n.min(src.len() - 3)]);
                let mut want: Vec<u8> = (0..pre).map(|i| i as u8 ^ 0xA5).collect();
                want.extend_from_slice(&src[3..3 + n.min(src.len() - 3)]);
                assert_eq!(out, want, "pre {pre}, n {n}");
            }
        }
    }
}
