//! Reference quantizers: ggml's `quantize_row_*_ref` for the legacy types; simple but
//! layout-exact quantizers for the K-quants.

use half::f16;

use super::blocks::{q4k_pack_scales, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ6K, BlockQ8_0};
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
