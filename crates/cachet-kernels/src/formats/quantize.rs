//! Reference quantizers: ggml's `quantize_row_*_ref` for the legacy types (Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0); simple but layout-exact quantizers for the K-quants and the IQ4 types (for
//! tests and tools: they are not ggml's search-based quantizers).

use half::f16;

use super::blocks::{arr, q4k_pack_scales, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ6K, BlockQ8_0};
use super::dequant::KVALUES_IQ4NL;
use super::WeightType;
use crate::error::KernelError;

/// Quantize `x` (multiple of `ty.block_len()` values) into raw ggml bytes.
pub fn quantize_row(ty: WeightType, x: &[f32]) -> Result<Vec<u8>, KernelError> {
    let bl = ty.block_len();
    if !x.len().is_multiple_of(bl) {
        return Err(KernelError::InvalidShape(format!(
            "{} values is not a multiple of {bl}",
            x.len()
        )));
    }
    let mut out = Vec::with_capacity(ty.row_bytes(x.len()));
    for xb in x.chunks(bl) {
        match ty {
            WeightType::F32 => out.extend_from_slice(&xb[0].to_le_bytes()),
            WeightType::F16 => out.extend_from_slice(&f16::from_f32(xb[0]).to_bits().to_le_bytes()),
            WeightType::Q8_0 => out.extend_from_slice(&quantize_block_q8_0(xb).to_bytes()),
            WeightType::Q4_0 => out.extend_from_slice(&quantize_block_q4_0(xb).to_bytes()),
            WeightType::Q4_1 => out.extend_from_slice(&quantize_block_q4_1(xb).to_bytes()),
            WeightType::Q4K => out.extend_from_slice(&quantize_block_q4k(xb).to_bytes()),
            WeightType::Q6K => out.extend_from_slice(&quantize_block_q6k(xb).to_bytes()),
            WeightType::Q5_0 => out.extend_from_slice(&quantize_block_q5_0(xb)),
            WeightType::Q5_1 => out.extend_from_slice(&quantize_block_q5_1(xb)),
            WeightType::Q2K => out.extend_from_slice(&quantize_block_q2k(xb)),
            WeightType::Q3K => out.extend_from_slice(&quantize_block_q3k(xb)),
            WeightType::Q5K => out.extend_from_slice(&quantize_block_q5k(xb)),
            WeightType::IQ4NL => out.extend_from_slice(&quantize_block_iq4nl(xb)),
            WeightType::IQ4XS => out.extend_from_slice(&quantize_block_iq4xs(xb)),
            WeightType::BF16 => out.extend_from_slice(&f32_to_bf16(xb[0]).to_le_bytes()),
        }
    }
    Ok(out)
}

/// ggml `quantize_row_q8_0_ref` for one block of 32.
pub fn quantize_block_q8_0(x: &[f32]) -> BlockQ8_0 {
    let amax = x[..32].iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; 32];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// ggml `quantize_row_q4_0_ref` for one block of 32.
pub fn quantize_block_q4_0(x: &[f32]) -> BlockQ4_0 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in &x[..32] {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[16 + j] * id;
        let a = ((x0 + 8.5) as i8).min(15) as u8;
        let b = ((x1 + 8.5) as i8).min(15) as u8;
        qs[j] = a | (b << 4);
    }
    BlockQ4_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// ggml `quantize_row_q4_1_ref` for one block of 32.
pub fn quantize_block_q4_1(x: &[f32]) -> BlockQ4_1 {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in &x[..32] {
        min = min.min(v);
        max = max.max(v);
    }
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let x0 = (x[j] - min) * id;
        let x1 = (x[16 + j] - min) * id;
        let a = ((x0 + 0.5) as i8).min(15) as u8;
        let b = ((x1 + 0.5) as i8).min(15) as u8;
        qs[j] = a | (b << 4);
    }
    BlockQ4_1 {
        d: f16::from_f32(d),
        m: f16::from_f32(min),
        qs,
    }
}

/// A simple min/max Q4_K quantizer (ggml's uses an iterative search; the layout is the same).
pub fn quantize_block_q4k(x: &[f32]) -> BlockQ4K {
    let mut scale = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let s = &x[32 * j..32 * j + 32];
        let mn = s.iter().fold(0f32, |a, &v| a.min(v)); // min <= 0
        let mx = s.iter().fold(f32::MIN, |a, &v| a.max(v));
        scale[j] = (mx - mn) / 15.0;
        mins[j] = -mn;
    }
    let max_scale = scale.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = if df > 0.0 {
            (scale[j] / df).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
        lm[j] = if dminf > 0.0 {
            (mins[j] / dminf).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
    }
    let mut codes = [0u8; 256];
    for j in 0..8 {
        let sd = df * ls[j] as f32;
        let sm = dminf * lm[j] as f32;
        for l in 0..32 {
            let v = x[32 * j + l];
            codes[32 * j + l] = if sd > 0.0 {
                ((v + sm) / sd).round().clamp(0.0, 15.0) as u8
            } else {
                0
            };
        }
    }
    let mut qs = [0u8; 128];
    for j in 0..4 {
        for l in 0..32 {
            qs[32 * j + l] = codes[64 * j + l] | (codes[64 * j + 32 + l] << 4);
        }
    }
    BlockQ4K {
        d,
        dmin,
        scales: q4k_pack_scales(&ls, &lm),
        qs,
    }
}

/// A simple abs-max Q6_K quantizer (layout-exact with ggml's `block_q6_K`).
pub fn quantize_block_q6k(x: &[f32]) -> BlockQ6K {
    let mut sub = [0f32; 16];
    for (s, c) in sub.iter_mut().zip(x[..256].chunks(16)) {
        // signed abs-max like ggml: the largest magnitude maps to -32
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in c {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        *s = max / -32.0;
    }
    let amax_s = sub.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = f16::from_f32(amax_s / 127.0);
    let df = d.to_f32();
    let mut scales = [0i8; 16];
    let mut codes = [0u8; 256];
    for j in 0..16 {
        scales[j] = if df > 0.0 {
            (sub[j] / df).round().clamp(-127.0, 127.0) as i8
        } else {
            0
        };
        let sd = df * scales[j] as f32;
        for l in 0..16 {
            let v = x[16 * j + l];
            let q = if sd != 0.0 {
                (v / sd).round().clamp(-32.0, 31.0) as i32
            } else {
                0
            };
            codes[16 * j + l] = (q + 32) as u8;
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for n in 0..2 {
        let c = &codes[128 * n..];
        for l in 0..32 {
            ql[64 * n + l] = (c[l] & 0xF) | ((c[l + 64] & 0xF) << 4);
            ql[64 * n + l + 32] = (c[l + 32] & 0xF) | ((c[l + 96] & 0xF) << 4);
            qh[32 * n + l] = (c[l] >> 4)
                | ((c[l + 32] >> 4) << 2)
                | ((c[l + 64] >> 4) << 4)
                | ((c[l + 96] >> 4) << 6);
        }
    }
    BlockQ6K { ql, qh, scales, d }
}

/// ggml `quantize_row_q5_0_ref` for one block of 32 (22 bytes: `d`, `qh`, `qs`).
pub fn quantize_block_q5_0(x: &[f32]) -> [u8; 22] {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in &x[..32] {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let code = |v: f32| ((v * id + 16.5) as i8).min(31) as u8;
    let mut o = [0u8; 22];
    o[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    o[2..].copy_from_slice(&pack_q5(x, code));
    o
}

/// ggml `quantize_row_q5_1_ref` for one block of 32 (24 bytes: `d`, `m`, `qh`, `qs`).
pub fn quantize_block_q5_1(x: &[f32]) -> [u8; 24] {
    let mn = x[..32].iter().fold(f32::MAX, |a, &v| a.min(v));
    let mx = x[..32].iter().fold(f32::MIN, |a, &v| a.max(v));
    let d = (mx - mn) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let code = |v: f32| ((v - mn) * id + 0.5) as u8;
    let mut o = [0u8; 24];
    o[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    o[2..4].copy_from_slice(&f16::from_f32(mn).to_bits().to_le_bytes());
    o[4..].copy_from_slice(&pack_q5(x, code));
    o
}

/// Q5_0/Q5_1's `qh` (the fifth bits, as a little-endian u32) then `qs[16]` (the low nibbles:
/// value j in the low half of byte j, value j + 16 in the high half) of `code(x[..32])`.
fn pack_q5(x: &[f32], code: impl Fn(f32) -> u8) -> [u8; 20] {
    let mut qh = 0u32;
    let mut o = [0u8; 20];
    for j in 0..16 {
        let (c0, c1) = (code(x[j]), code(x[j + 16]));
        o[4 + j] = (c0 & 0xF) | ((c1 & 0xF) << 4);
        qh |= (((c0 & 0x10) >> 4) as u32) << j;
        qh |= (((c1 & 0x10) >> 4) as u32) << (j + 16);
    }
    o[..4].copy_from_slice(&qh.to_le_bytes());
    o
}

/// A nearest-level IQ4 code of `v / d` (`d != 0`), ggml's `best_index_int8` by brute force.
fn iq4_index(v: f32, d: f32) -> u8 {
    let t = v / d;
    let mut best = 0;
    for (i, &k) in KVALUES_IQ4NL.iter().enumerate() {
        if (t - k as f32).abs() < (t - KVALUES_IQ4NL[best] as f32).abs() {
            best = i;
        }
    }
    best as u8
}

/// A simple IQ4_NL quantizer (layout-exact with ggml's `block_iq4_nl`: `d`, `qs[16]`): the
/// signed abs-max maps to level -127.
pub fn quantize_block_iq4nl(x: &[f32]) -> [u8; 18] {
    let d = f16::from_f32(signed_absmax(&x[..32]) / -127.0);
    let df = d.to_f32();
    let mut o = [0u8; 18];
    o[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    for j in 0..16 {
        let idx = |v: f32| if df != 0.0 { iq4_index(v, df) } else { 8 };
        o[2 + j] = idx(x[j]) | (idx(x[j + 16]) << 4);
    }
    o
}

/// The value of largest magnitude (ggml's `max` of the legacy quantizers).
fn signed_absmax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// A simple IQ4_XS quantizer (layout-exact with ggml's `block_iq4_xs`): each sub-block of 32
/// takes the scale mapping its signed abs-max to level -127, stored as `d · (ls − 32)`.
pub fn quantize_block_iq4xs(x: &[f32]) -> [u8; 136] {
    let sub: Vec<f32> = x[..256]
        .chunks(32)
        .map(|c| signed_absmax(c) / -127.0)
        .collect();
    let amax = sub.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = f16::from_f32(amax / 31.0);
    let df = d.to_f32();
    let mut o = [0u8; 136];
    o[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    let mut scales_h = 0u16;
    for (ib, &s) in sub.iter().enumerate() {
        let l = if df > 0.0 {
            (s / df).round().clamp(-32.0, 31.0) as i32
        } else {
            0
        };
        let ls = (l + 32) as u8;
        o[4 + ib / 2] |= (ls & 0xF) << (4 * (ib % 2));
        scales_h |= ((ls >> 4) as u16) << (2 * ib);
        let dl = df * l as f32;
        let c = &x[32 * ib..32 * ib + 32];
        for j in 0..16 {
            let idx = |v: f32| if dl != 0.0 { iq4_index(v, dl) } else { 8 };
            o[8 + 16 * ib + j] = idx(c[j]) | (idx(c[j + 16]) << 4);
        }
    }
    o[2..4].copy_from_slice(&scales_h.to_le_bytes());
    o
}

/// Per-sub-block affine parameters `(scale, -min)` with `levels` steps, as the K-quants'
/// min/max quantizers (the minimum clamped to at most 0).
fn affine_subs(x: &[f32], sub: usize, levels: f32) -> (Vec<f32>, Vec<f32>) {
    x.chunks(sub)
        .map(|s| {
            let mn = s.iter().fold(0f32, |a, &v| a.min(v));
            let mx = s.iter().fold(f32::MIN, |a, &v| a.max(v));
            ((mx - mn) / levels, -mn)
        })
        .unzip()
}

/// Codes of `x` for the affine sub-block `x ≈ sd · q − sm`, clamped to `0..=max`.
fn affine_code(v: f32, sd: f32, sm: f32, max: f32) -> u8 {
    if sd > 0.0 {
        ((v + sm) / sd).round().clamp(0.0, max) as u8
    } else {
        0
    }
}

/// A simple min/max Q5_K quantizer (layout-exact with ggml's `block_q5_K`).
pub fn quantize_block_q5k(x: &[f32]) -> [u8; 176] {
    let (scale, mins) = affine_subs(&x[..256], 32, 31.0);
    let (d, dmin, ls, lm) = super_scales(&scale, &mins, 63.0);
    let mut o = [0u8; 176];
    o[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    o[2..4].copy_from_slice(&dmin.to_bits().to_le_bytes());
    let (ls8, lm8): ([u8; 8], [u8; 8]) = (arr(&ls), arr(&lm));
    o[4..16].copy_from_slice(&q4k_pack_scales(&ls8, &lm8));
    for s in 0..8 {
        let sd = d.to_f32() * ls[s] as f32;
        let sm = dmin.to_f32() * lm[s] as f32;
        for l in 0..32 {
            let c = affine_code(x[32 * s + l], sd, sm, 31.0);
            o[48 + 32 * (s / 2) + l] |= (c & 0xF) << (4 * (s % 2));
            o[16 + l] |= (c >> 4) << s;
        }
    }
    o
}

/// A simple min/max Q2_K quantizer (layout-exact with ggml's `block_q2_K`).
pub fn quantize_block_q2k(x: &[f32]) -> [u8; 84] {
    let (scale, mins) = affine_subs(&x[..256], 16, 3.0);
    let (d, dmin, ls, lm) = super_scales(&scale, &mins, 15.0);
    let mut o = [0u8; 84];
    for s in 0..16 {
        o[s] = ls[s] | (lm[s] << 4);
        let sd = d.to_f32() * ls[s] as f32;
        let sm = dmin.to_f32() * lm[s] as f32;
        let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
        for l in 0..16 {
            let c = affine_code(x[16 * s + l], sd, sm, 3.0);
            o[16 + 32 * n + 16 * h + l] |= c << (2 * j);
        }
    }
    o[80..82].copy_from_slice(&d.to_bits().to_le_bytes());
    o[82..84].copy_from_slice(&dmin.to_bits().to_le_bytes());
    o
}

/// The f16 super-block scales `d`, `dmin` and the integer sub-block scales and mins
/// (`0..=max`) of the K-quants' two-level scheme.
fn super_scales(scale: &[f32], mins: &[f32], max: f32) -> (f16, f16, Vec<u8>, Vec<u8>) {
    let top = |v: &[f32]| v.iter().fold(0f32, |a, &b| a.max(b));
    let d = f16::from_f32(top(scale) / max);
    let dmin = f16::from_f32(top(mins) / max);
    let ints = |v: &[f32], by: f32| -> Vec<u8> {
        v.iter()
            .map(|&s| {
                if by > 0.0 {
                    (s / by).round().clamp(0.0, max) as u8
                } else {
                    0
                }
            })
            .collect()
    };
    (d, dmin, ints(scale, d.to_f32()), ints(mins, dmin.to_f32()))
}

/// A simple abs-max Q3_K quantizer (layout-exact with ggml's `block_q3_K`): each sub-block of
/// 16 maps its signed abs-max to level -4.
pub fn quantize_block_q3k(x: &[f32]) -> [u8; 110] {
    let sub: Vec<f32> = x[..256]
        .chunks(16)
        .map(|c| signed_absmax(c) / -4.0)
        .collect();
    let amax = sub.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = f16::from_f32(amax / 31.0);
    let df = d.to_f32();
    let mut o = [0u8; 110];
    let mut scales = [0u8; 16];
    for (s, &sv) in sub.iter().enumerate() {
        let l = if df > 0.0 {
            (sv / df).round().clamp(-32.0, 31.0) as i32
        } else {
            0
        };
        scales[s] = (l + 32) as u8;
        let dl = df * l as f32;
        let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
        for li in 0..16 {
            let v = x[16 * s + li];
            let q = if dl != 0.0 {
                (v / dl).round().clamp(-4.0, 3.0) as i32
            } else {
                0
            } + 4;
            o[32 + 32 * n + 16 * h + li] |= ((q & 3) as u8) << (2 * j);
            if q >= 4 {
                o[16 * h + li] |= 1 << (4 * n + j);
            }
        }
    }
    for s in 0..16 {
        let (lo, hi) = (scales[s] & 0xF, scales[s] >> 4);
        o[96 + s % 8] |= lo << (4 * (s / 8));
        o[96 + 8 + s % 4] |= hi << (2 * (s / 4));
    }
    o[108..110].copy_from_slice(&d.to_bits().to_le_bytes());
    o
}

/// BF16 of `v`, rounded to nearest even (ggml's `GGML_FP32_TO_BF16`, NaN kept quiet).
pub fn f32_to_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) | 64) as u16;
    }
    ((b + (0x7FFF + ((b >> 16) & 1))) >> 16) as u16
}
