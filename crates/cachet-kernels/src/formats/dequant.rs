//! Integer decoding of blocks (sub-blocks of `bk` unsigned codes with affine `(d, c)`
//! parameters) and ggml-exact dequantization.

use half::f16;

use super::blocks::{arr, q4k_scale_min, rd_f16};
use super::kquants::decode_kquant;
use super::WeightType;
use crate::error::KernelError;

/// One decoded sub-block: values are `d * (q - off)` (when `m` is None) or `d * q + m`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SubBlock {
    pub(crate) q: [u8; 32],
    /// Scale, as f16 bits (legacy types) or f32 (K-quants).
    pub(crate) d: Scale,
    pub(crate) m: Option<Scale>,
    /// The code offset when `m` is None (a power of two, so `-off * d` is exact).
    pub(crate) off: i32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Scale {
    H(f16),
    S(f32),
}

impl Scale {
    pub(crate) fn f32(self) -> f32 {
        match self {
            Scale::H(h) => h.to_f32(),
            Scale::S(s) => s,
        }
    }
}

/// ggml's `kvalues_iq4nl`: the 16 signed levels of IQ4_NL and IQ4_XS codes.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The unsigned code stored for IQ4 level `k` (offset 128, as Q8_0's codes).
fn iq4_code(k: u8) -> u8 {
    (KVALUES_IQ4NL[(k & 0xF) as usize] as i32 + 128) as u8
}

/// Decode one ggml block of a quantized type into sub-blocks (pushed onto `out`). The codes
/// are those of the packed format the type is repacked into (`PFmt::of`): Q3_K's signed
/// 3-bit levels shifted by 32 (as Q6_K's), IQ4 levels and Q8_0 values shifted by 128.
pub(crate) fn decode_block(ty: WeightType, b: &[u8], out: &mut Vec<SubBlock>) {
    match ty {
        WeightType::Q4_0 | WeightType::Q4_1 => {
            let (d, m, qs) = if ty == WeightType::Q4_0 {
                (rd_f16(b, 0), None, &b[2..18])
            } else {
                (rd_f16(b, 0), Some(Scale::H(rd_f16(b, 2))), &b[4..20])
            };
            let mut q = [0u8; 32];
            for j in 0..16 {
                q[j] = qs[j] & 0xF;
                q[j + 16] = qs[j] >> 4;
            }
            out.push(SubBlock {
                q,
                d: Scale::H(d),
                m,
                off: 8,
            });
        }
        WeightType::Q5_0 | WeightType::Q5_1 => {
            // ggml `dequantize_row_q5_0/1`: bit j of the 32-bit `qh` is the fifth bit of
            // value j (low nibbles of `qs`), bit j + 16 that of value j + 16 (high nibbles).
            let (d, m, at) = if ty == WeightType::Q5_0 {
                (rd_f16(b, 0), None, 2)
            } else {
                (rd_f16(b, 0), Some(Scale::H(rd_f16(b, 2))), 4)
            };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            let mut q = [0u8; 32];
            for j in 0..16 {
                let h0 = ((qh >> j) & 1) as u8;
                let h1 = ((qh >> (j + 16)) & 1) as u8;
                q[j] = (qs[j] & 0xF) | (h0 << 4);
                q[j + 16] = (qs[j] >> 4) | (h1 << 4);
            }
            out.push(SubBlock {
                q,
                d: Scale::H(d),
                m,
                off: 16,
            });
        }
        WeightType::Q8_0 => {
            let mut q = [0u8; 32];
            for j in 0..32 {
                q[j] = (b[2 + j] as i8 as i32 + 128) as u8;
            }
            out.push(SubBlock {
                q,
                d: Scale::H(rd_f16(b, 0)),
                m: None,
                off: 128,
            });
        }
        WeightType::IQ4NL => {
            let mut q = [0u8; 32];
            for j in 0..16 {
                q[j] = iq4_code(b[2 + j]);
                q[j + 16] = iq4_code(b[2 + j] >> 4);
            }
            out.push(SubBlock {
                q,
                d: Scale::H(rd_f16(b, 0)),
                m: None,
                off: 128,
            });
        }
        WeightType::Q4K => {
            let d = rd_f16(b, 0).to_f32();
            let dmin = rd_f16(b, 2).to_f32();
            let scales: [u8; 12] = arr(&b[4..16]);
            let qs = &b[16..144];
            for j in 0..4 {
                for h in 0..2 {
                    let (sc, mn) = q4k_scale_min(2 * j + h, &scales);
                    let mut q = [0u8; 32];
                    for l in 0..32 {
                        let byte = qs[32 * j + l];
                        q[l] = if h == 0 { byte & 0xF } else { byte >> 4 };
                    }
                    out.push(SubBlock {
                        q,
                        d: Scale::S(d * sc as f32),
                        m: Some(Scale::S(-(dmin * mn as f32))),
                        off: 0,
                    });
                }
            }
        }
        WeightType::Q6K => {
            let ql = &b[..128];
            let qh = &b[128..192];
            let d = rd_f16(b, 208).to_f32();
            let mut codes = [0u8; 256];
            for n in 0..2 {
                let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                for l in 0..32 {
                    let y = &mut codes[128 * n..];
                    y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            for s in 0..16 {
                let sc = b[192 + s] as i8;
                let mut q = [0u8; 32];
                q[..16].copy_from_slice(&codes[16 * s..16 * s + 16]);
                out.push(SubBlock {
                    q,
                    d: Scale::S(d * sc as f32),
                    m: None,
                    off: 32,
                });
            }
        }
        WeightType::Q2K | WeightType::Q3K | WeightType::Q5K | WeightType::IQ4XS => {
            decode_kquant(ty, b, out)
        }
        WeightType::F32 | WeightType::F16 | WeightType::BF16 => {}
    }
}

/// Dequantize one ggml block (`bytes.len() >= ty.block_bytes()`) into `out[..ty.block_len()]`.
/// Bit-exact with ggml's `dequantize_row_*`.
pub fn dequantize_block(ty: WeightType, bytes: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let (bb, bl) = (ty.block_bytes(), ty.block_len());
    if bytes.len() < bb {
        return Err(KernelError::SizeMismatch {
            what: "block bytes",
            expected: bb,
            got: bytes.len(),
        });
    }
    if out.len() < bl {
        return Err(KernelError::SizeMismatch {
            what: "output values",
            expected: bl,
            got: out.len(),
        });
    }
    match ty {
        WeightType::F32 => out[0] = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
        WeightType::F16 => out[0] = rd_f16(bytes, 0).to_f32(),
        WeightType::BF16 => out[0] = bf16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
        _ => {
            let mut subs = Vec::with_capacity(16);
            decode_block(ty, bytes, &mut subs);
            let sbk = bl / subs.len();
            for (s, o) in subs.iter().zip(out.chunks_mut(sbk)) {
                dequant_sub(s, o);
            }
        }
    }
    Ok(())
}

/// Dequantize a whole row of raw ggml bytes (`cols` values).
pub fn dequantize_row_bytes(
    ty: WeightType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let bl = ty.block_len();
    if !out.len().is_multiple_of(bl) {
        return Err(KernelError::InvalidShape(format!(
            "{} values is not a multiple of {bl}",
            out.len()
        )));
    }
    let need = ty.row_bytes(out.len());
    if bytes.len() < need {
        return Err(KernelError::SizeMismatch {
            what: "row bytes",
            expected: need,
            got: bytes.len(),
        });
    }
    for (o, b) in out.chunks_mut(bl).zip(bytes.chunks(ty.block_bytes())) {
        dequantize_block(ty, b, o)?;
    }
    Ok(())
}

/// BF16 bits to f32: the top half of the f32's bits (exact).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

fn dequant_sub(s: &SubBlock, out: &mut [f32]) {
    let (d, off) = (s.d.f32(), s.off);
    match s.m {
        Some(m) => {
            let m = m.f32();
            for (o, &q) in out.iter_mut().zip(&s.q) {
                *o = d * q as f32 + m;
            }
        }
        None => {
            for (o, &q) in out.iter_mut().zip(&s.q) {
                *o = d * (q as i32 - off) as f32;
            }
        }
    }
}
