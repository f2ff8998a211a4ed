//! Throughput probes: the instruction mixes the kernels are built from, run on data in
//! registers, so that a driver can measure this machine's limits (`crate::probe`).
//!
//! Each loop runs `iters` rounds of `ACC` independent accumulator chains (enough to cover
//! the latency of one instruction on current cores) and returns a value derived from every
//! accumulator, so that nothing is optimised away.

use std::arch::x86_64::*;

use crate::util::A64;

/// Independent accumulators per loop.
const ACC: usize = 12;

/// Fold the accumulators into one number (keeps them alive).
#[target_feature(enable = "avx2")]
unsafe fn fold256(acc: &[__m256i; ACC]) -> i64 {
    let mut s = _mm256_setzero_si256();
    for a in acc {
        s = _mm256_add_epi32(s, *a);
    }
    let mut o = [0i32; 8];
    _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, s);
    o.iter().map(|&v| v as i64).sum()
}

/// `vpmaddubsw` + `vpaddw` (the 4-bit AVX2 kernel's inner pair): 32 multiply-adds per pair.
/// Returns the number of multiply-adds done and a checksum (opaque to the optimiser, so the
/// loop cannot be removed even where the caller drops it).
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn avx2_maddubs(iters: usize, seed: i8) -> (u64, i64) {
    let mut b = _mm256_set1_epi8(seed);
    let mut acc = [_mm256_set1_epi8(3); ACC];
    for _ in 0..iters {
        for acc in acc.iter_mut() {
            // The accumulator is also the unsigned operand: no two products are the same
            // expression, so none is computed once for several chains.
            *acc = _mm256_add_epi16(*acc, _mm256_maddubs_epi16(*acc, b));
        }
        // Keep `b` opaque to the compiler across rounds.
        std::arch::asm!("/* {0} */", inout(ymm_reg) b, options(nomem, nostack, preserves_flags));
    }
    (
        (iters * ACC * 32) as u64,
        std::hint::black_box(fold256(&acc)),
    )
}

/// `vpdpbusd` on 256-bit registers (AVX-VNNI): 32 multiply-adds each.
#[target_feature(enable = "avx2,avxvnni")]
pub(crate) unsafe fn avx_vnni_dpbusd(iters: usize, seed: i8) -> (u64, i64) {
    let a = _mm256_set1_epi8(3);
    let mut b = _mm256_set1_epi8(seed);
    let mut acc = [_mm256_setzero_si256(); ACC];
    for _ in 0..iters {
        for acc in acc.iter_mut() {
            *acc = _mm256_dpbusd_avx_epi32(*acc, a, b);
        }
        std::arch::asm!("/* {0} */", inout(ymm_reg) b, options(nomem, nostack, preserves_flags));
    }
    (
        (iters * ACC * 32) as u64,
        std::hint::black_box(fold256(&acc)),
    )
}

/// `vpdpbusd` on 512-bit registers (AVX-512 VNNI): 64 multiply-adds each.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(crate) unsafe fn avx512_dpbusd(iters: usize, seed: i8) -> (u64, i64) {
    let a = _mm512_set1_epi8(3);
    let mut b = _mm512_set1_epi8(seed);
    let mut acc = [_mm512_setzero_si512(); ACC];
    for _ in 0..iters {
        for acc in acc.iter_mut() {
            *acc = _mm512_dpbusd_epi32(*acc, a, b);
        }
        std::arch::asm!("/* {0} */", inout(zmm_reg) b, options(nomem, nostack, preserves_flags));
    }
    let mut s = _mm512_setzero_si512();
    for a in &acc {
        s = _mm512_add_epi32(s, *a);
    }
    (
        (iters * ACC * 64) as u64,
        std::hint::black_box(_mm512_reduce_add_epi32(s) as i64),
    )
}

/// `tdpbsud` on full tiles (AMX-INT8): 16 × 16 × 64 = 16,384 multiply-adds each. Four
/// accumulator tiles (tmm0-3) are fed by two A tiles (tmm4-5) and two B tiles (tmm6-7), the
/// 2 × 2 blocking a GEMM kernel uses, all in tile registers (no loads in the loop), so this is
/// the tile unit's throughput, not the memory system's.
///
/// # Safety
/// AMX-TILE and AMX-INT8 must be present, tile state enabled by the OS and granted to this
/// process (what [`crate::isa`] checks before it offers the AMX level).
pub(crate) unsafe fn amx_dpbsud(iters: usize, seed: i8) -> (u64, i64) {
    use std::arch::asm;
    // Palette 1, every one of the 8 tiles 16 rows × 64 bytes.
    let mut cfg = A64([0; 64]);
    cfg.0[0] = 1;
    for t in 0..8 {
        cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        cfg.0[48 + t] = 16;
    }
    let src = A64([seed as u8; 64]);
    let mut out = [A64([0; 64]); 64];
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    // Stride 0: every row of A and B is the same 64 seed bytes.
    asm!(
        "tileloadd tmm4, [{p} + {z} * 1]",
        "tileloadd tmm5, [{p} + {z} * 1]",
        "tileloadd tmm6, [{p} + {z} * 1]",
        "tileloadd tmm7, [{p} + {z} * 1]",
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        p = in(reg) src.0.as_ptr(),
        z = in(reg) 0usize,
        options(nostack, readonly)
    );
    for _ in 0..iters {
        asm!(
            "tdpbsud tmm0, tmm4, tmm6",
            "tdpbsud tmm1, tmm4, tmm7",
            "tdpbsud tmm2, tmm5, tmm6",
            "tdpbsud tmm3, tmm5, tmm7",
            options(nostack, nomem)
        );
    }
    // The four accumulators, 16 rows of 64 bytes each, one after the other.
    let base = out.as_mut_ptr() as *mut u8;
    asm!(
        "tilestored [{p} + {s} * 1], tmm0",
        "tilestored [{p} + {s} * 1 + 1024], tmm1",
        "tilestored [{p} + {s} * 1 + 2048], tmm2",
        "tilestored [{p} + {s} * 1 + 3072], tmm3",
        p = in(reg) base,
        s = in(reg) 64usize,
        options(nostack)
    );
    let sum: i64 = out
        .iter()
        .map(|row| i32::from_le_bytes([row.0[0], row.0[1], row.0[2], row.0[3]]) as i64)
        .sum();
    asm!("tilerelease", options(nostack, nomem));
    ((iters * 4 * 16 * 16 * 64) as u64, std::hint::black_box(sum))
}

/// `vfmadd` on 256-bit registers: 8 f32 multiply-adds each.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn avx2_fma(iters: usize, seed: f32) -> (u64, f64) {
    let a = _mm256_set1_ps(0.999);
    let mut b = _mm256_set1_ps(seed);
    let mut acc = [_mm256_setzero_ps(); ACC];
    for _ in 0..iters {
        for acc in acc.iter_mut() {
            *acc = _mm256_fmadd_ps(a, b, *acc);
        }
        std::arch::asm!("/* {0} */", inout(ymm_reg) b, options(nomem, nostack, preserves_flags));
    }
    let mut s = _mm256_setzero_ps();
    for a in &acc {
        s = _mm256_add_ps(s, *a);
    }
    let mut o = [0f32; 8];
    _mm256_storeu_ps(o.as_mut_ptr(), s);
    (
        (iters * ACC * 8) as u64,
        std::hint::black_box(o.iter().map(|&v| v as f64).sum()),
    )
}

/// `vfmadd` on 512-bit registers: 16 f32 multiply-adds each.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn avx512_fma(iters: usize, seed: f32) -> (u64, f64) {
    let a = _mm512_set1_ps(0.999);
    let mut b = _mm512_set1_ps(seed);
    let mut acc = [_mm512_setzero_ps(); ACC];
    for _ in 0..iters {
        for acc in acc.iter_mut() {
            *acc = _mm512_fmadd_ps(a, b, *acc);
        }
        std::arch::asm!("/* {0} */", inout(zmm_reg) b, options(nomem, nostack, preserves_flags));
    }
    let mut s = _mm512_setzero_ps();
    for a in &acc {
        s = _mm512_add_ps(s, *a);
    }
    (
        (iters * ACC * 16) as u64,
        std::hint::black_box(_mm512_reduce_add_ps(s) as f64),
    )
}

/// Streams `data` once with 256-bit loads (4 independent chains); returns a checksum.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn avx2_read(data: &[u8]) -> i64 {
    let n = data.len() / 128 * 128;
    let p = data.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i < n {
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_xor_si256(
                *acc,
                _mm256_loadu_si256(p.add(i + 32 * j) as *const __m256i),
            );
        }
        i += 128;
    }
    let mut a = [_mm256_setzero_si256(); ACC];
    a[..4].copy_from_slice(&acc);
    std::hint::black_box(fold256(&a))
}
