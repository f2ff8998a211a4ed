//! How close can an AVX-512 VNNI tile of the 4-bit formats come to the `vpdpbusd` peak?
//! `cargo run --release -p cachet-kernels --example tile_bound` (one thread, AVX-512 VNNI).
//!
//! The layer matmuls of the AVX-512 level run at a third of the measured int8 peak in a
//! prefill (`cachet bench kernel`, roofline). This example measures what bounds that: the
//! instruction mix of one block (32 codes × 16 weight rows × `MR` activation rows) with every
//! operand in L1/L2, built up in steps, beside the library's own matmul on the same shape.
//!
//! * `dpbusd`: only the `vpdpbusd` (activation quads broadcast from memory, as the kernel
//!   does): what the loop structure and the accumulator chains allow.
//! * `+ unpack`: the two nibble halves of each 64-byte weight vector (`and`, `srl`, `and`).
//! * `+ fold`: the per-block scale epilogue that the Q4_x formats' block scales on both sides
//!   need (int32 → f32, `d · dx`, two FMAs: 4 vector ops per 8 `vpdpbusd`) with f16 scales:
//!   the kernel's whole mix, `micro::avx512::tile_512`.
//! * other tile shapes (`MR` rows × `NG` groups of 16 weight rows) and the high nibble taken
//!   with one GFNI affine op instead of two.
//!
//! Every variant walks the same data the way the matmul driver does (row slices of 60, each
//! weight unit over the slice's tiles; 480 × 576 activations, 576 × 576 weights, runtime row
//! stride) and reports int8 GOP/s and its fraction of the one-thread peak measured in the run.

#[cfg(target_arch = "x86_64")]
mod bound {
    use std::arch::x86_64::*;
    use std::time::Instant;

    /// Bytes of one packed Q4_1 block of 16 rows: 256 code bytes, 16 f16 `d`, 16 f16 `m`.
    const STRIDE: usize = 320;
    const COLS: usize = 576;
    const ROWS: usize = 576;
    const M: usize = 480;
    const SPLIT: usize = 60;

    /// What a variant computes per block (a const parameter, so that no variant branches).
    const DPBUSD: u8 = 0;
    const UNPACK: u8 = 1;
    const FOLD: u8 = 2;

    struct Data {
        act: Vec<u8>,
        w: Vec<u8>,
        xs: Vec<f32>,
        cols: usize,
    }

    /// One tile: `MR` activation rows × `NG` weight groups over every block of the row.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, VNNI, F16C (and GFNI when `GF`) must be present; `act` holds `MR` rows
    /// of `cols` bytes, `w` `NG` groups of `cols / 32` blocks, `xs` two planes of scales.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,f16c")]
    #[inline(never)]
    unsafe fn tile<const MIX: u8, const MR: usize, const NG: usize, const GF: bool>(
        act: *const u8,
        cols: usize,
        w: *const u8,
        xs: *const f32,
        out: &mut [[__m512; NG]; MR],
    ) {
        let nb = cols / 32;
        let m4 = _mm512_set1_epi8(0x0f);
        // The GF(2) matrix of a logical right shift by 4 within each byte.
        let shr4 = _mm512_set1_epi64(0x1020_4080_0000_0000);
        let mut keep = [[_mm512_setzero_si512(); NG]; MR];
        for b in 0..nb {
            let mut acc = [[_mm512_setzero_si512(); NG]; MR];
            for g in 0..NG {
                let base = w.add((g * nb + b) * STRIDE);
                for s in 0..4 {
                    let pv = _mm512_loadu_si512(base.add(64 * s) as *const _);
                    let (lo, hi) = match (MIX, GF) {
                        (DPBUSD, _) => (pv, pv),
                        (_, true) => (
                            _mm512_and_si512(pv, m4),
                            _mm512_gf2p8affine_epi64_epi8::<0>(pv, shr4),
                        ),
                        (_, false) => (
                            _mm512_and_si512(pv, m4),
                            _mm512_and_si512(_mm512_srli_epi16::<4>(pv), m4),
                        ),
                    };
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let xp = act.add(i * cols + b * 32);
                        let al = _mm512_set1_epi32((xp.add(4 * s) as *const i32).read_unaligned());
                        let ah =
                            _mm512_set1_epi32((xp.add(16 + 4 * s) as *const i32).read_unaligned());
                        acc[g] = _mm512_dpbusd_epi32(acc[g], lo, al);
                        acc[g] = _mm512_dpbusd_epi32(acc[g], hi, ah);
                    }
                }
            }
            if MIX != FOLD {
                for (k, a) in keep.iter_mut().zip(&acc) {
                    for (k, a) in k.iter_mut().zip(a) {
                        *k = _mm512_add_epi32(*k, *a);
                    }
                }
                continue;
            }
            for g in 0..NG {
                let p = w.add((g * nb + b) * STRIDE + 256);
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
                let c = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i));
                for (i, o) in out.iter_mut().enumerate() {
                    let (dx, sx) = (*xs.add(i * nb + b), *xs.add(M * nb + i * nb + b));
                    let t = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(acc[i][g]),
                        _mm512_mul_ps(d, _mm512_set1_ps(dx)),
                        o[g],
                    );
                    o[g] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx), t);
                }
            }
        }
        if MIX != FOLD {
            for (o, k) in out.iter_mut().zip(&keep) {
                for (o, k) in o.iter_mut().zip(k) {
                    *o = _mm512_add_ps(*o, _mm512_cvtepi32_ps(*k));
                }
            }
        }
    }

    /// GOP/s of one variant over the whole shape (best of 3 passes of 10).
    fn drive<const MIX: u8, const MR: usize, const NG: usize, const GF: bool>(d: &Data) -> f64 {
        let nb = d.cols / 32;
        let mut sink = 0f32;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            for _ in 0..10 {
                for r0 in (0..M).step_by(SPLIT) {
                    for u in 0..ROWS / 16 / NG {
                        let mut i0 = r0;
                        while i0 + MR <= r0 + SPLIT {
                            // SAFETY: `main` checked the features; the offsets stay inside the
                            // buffers (M rows of activations, ROWS / 16 groups of weights).
                            unsafe {
                                let mut out = [[_mm512_setzero_ps(); NG]; MR];
                                tile::<MIX, MR, NG, GF>(
                                    d.act.as_ptr().add(i0 * d.cols),
                                    d.cols,
                                    d.w.as_ptr().add(u * NG * nb * STRIDE),
                                    d.xs.as_ptr().add(i0 * nb),
                                    &mut out,
                                );
                                sink += reduce(&out);
                            }
                            i0 += MR;
                        }
                    }
                }
            }
            best = best.min(t.elapsed().as_secs_f64() / 10.0);
        }
        std::hint::black_box(sink);
        // Rows per slice actually covered (a slice of 60 holds whole tiles of MR rows only).
        let covered = M / SPLIT * (SPLIT / MR * MR);
        2.0 * (covered * d.cols * ROWS) as f64 / best / 1e9
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn reduce<const MR: usize, const NG: usize>(out: &[[__m512; NG]; MR]) -> f32 {
        let mut s = _mm512_setzero_ps();
        for o in out {
            for o in o {
                s = _mm512_add_ps(s, *o);
            }
        }
        _mm512_reduce_add_ps(s)
    }

    pub fn main() {
        use cachet_kernels::isa::{self, Isa};
        use cachet_kernels::{probe, QMatrix, ThreadPool, WeightType};
        // The AVX-512 level implies F/BW/VL/DQ, VNNI and F16C; GFNI is the one extra.
        if isa::detected() < Isa::Avx512 || !std::arch::is_x86_feature_detected!("gfni") {
            println!("needs AVX-512 VNNI and GFNI, which this CPU lacks: nothing to measure");
            return;
        }
        let pool = ThreadPool::new(1);
        let peak = probe::int8_peak(&pool, Isa::Avx512).unwrap_or(f64::NAN);
        let cols = std::hint::black_box(COLS);
        let d = Data {
            act: (0..M * cols).map(|i| (i * 7 % 251) as u8 & 0x7f).collect(),
            w: (0..ROWS / 16 * (cols / 32) * STRIDE)
                .map(|i| {
                    if i % STRIDE < 256 {
                        (i * 13 % 256) as u8
                    } else {
                        0x20
                    }
                })
                .collect(),
            xs: (0..2 * M * (cols / 32))
                .map(|i| (i % 13) as f32 * 0.01)
                .collect(),
            cols,
        };
        // The library's matmul on the same shape (Q4_1, includes quantizing the activations).
        let bytes: Vec<u8> = (0..ROWS * cols / 32 * 20)
            .map(|i| match i % 20 {
                0 | 2 => 0x00,
                1 => 0x20,
                3 => 0xa0,
                _ => (i * 13 % 256) as u8,
            })
            .collect();
        let q = QMatrix::from_gguf_bytes(WeightType::Q4_1, ROWS, cols, &bytes).expect("matrix");
        let x: Vec<f32> = (0..M * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut y = vec![0f32; M * ROWS];
        let mut lib = || {
            let mut best = f64::INFINITY;
            for _ in 0..30 {
                let t = Instant::now();
                q.matmul(&pool, &x, M, &mut y);
                best = best.min(t.elapsed().as_secs_f64());
            }
            2.0 * (M * cols * ROWS) as f64 / best / 1e9
        };
        println!(
            "one thread, AVX-512 VNNI int8 peak {peak:.0} GOP/s (vpdpbusd on registers); \
             {M} x {cols} activations, {ROWS} x {cols} Q4_1 weights; best of 3"
        );
        println!("{:34} {:>7} {:>8}", "variant", "GOP/s", "of peak");
        let row = |name: &str, g: f64| println!("{name:34} {g:7.0} {:7.0} %", 100.0 * g / peak);
        // Three rounds, interleaved, so that the machine's drift falls on every variant.
        for round in 0..3 {
            println!("round {round}");
            row("4x2 dpbusd only", drive::<DPBUSD, 4, 2, false>(&d));
            row("4x2 + unpack", drive::<UNPACK, 4, 2, false>(&d));
            row(
                "4x2 + unpack + fold (the kernel)",
                drive::<FOLD, 4, 2, false>(&d),
            );
            row("4x2, GFNI unpack", drive::<FOLD, 4, 2, true>(&d));
            row("6x2, GFNI unpack", drive::<FOLD, 6, 2, true>(&d));
            row("8x1", drive::<FOLD, 8, 1, false>(&d));
            row("8x1, GFNI unpack", drive::<FOLD, 8, 1, true>(&d));
            row("12x1, GFNI unpack", drive::<FOLD, 12, 1, true>(&d));
            row("library matmul (CACHET_ISA level)", lib());
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    bound::main();
    #[cfg(not(target_arch = "x86_64"))]
    println!("x86-64 only");
}
