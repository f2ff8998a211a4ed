//! GGUF/ggml weight formats, load-time repacking and quantized matrix multiplication.
//!
//! # Formats
//! The block layouts are exactly ggml's (see the `Block*` structs below). Dequantization
//! ([`dequantize_block`], [`QMatrix::dequantize_row`]) is bit-exact with ggml's reference
//! dequantizers.
//!
//! # Repacking
//! At load time quantized matrices are repacked into an interleaved layout: rows are taken
//! in groups of 16 and, for every `bk`-wide block of columns (32, or 16 for Q6_K), the
//! group's unsigned integer codes are stored so that one 64-byte vector holds 4 consecutive
//! codes of each of the 16 rows (the operand layout of `vpdpbusd`), followed by the 16
//! per-row scales (and mins). Every block value is `d * q + c` with `q` an unsigned code and
//! `c = m` (Q4_1, Q4_K) or `c = -off * d` (Q4_0: 8, Q8_0: 128, Q6_K: 32).
//!
//! # Matmul
//! Activations are quantized once per call to int8 in blocks of `bk` (ggml's Q8_0 scheme:
//! `d = amax / 127`), with per-block sums, and the kernels accumulate exact integer dot
//! products, so for a block: `sum_k w_k x_k ≈ d_w d_x Σ q_k a_k + c_w d_x Σ a_k`.

use half::f16;
use thiserror::Error;

use crate::isa::{self, Isa};
use crate::pool::ThreadPool;

/// Errors from constructing or using kernels.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    #[error("unsupported weight type {0}")]
    UnsupportedType(String),
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    #[error("size mismatch: {what}: expected {expected}, got {got}")]
    SizeMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
}

/// GGUF/ggml tensor element types supported by [`QMatrix`].
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

// ---------------------------------------------------------------------------------------
// ggml block structures (layout documentation + typed access; all little-endian)
// ---------------------------------------------------------------------------------------

/// ggml `block_q8_0`: 32 values, `x = d * qs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}

/// ggml `block_q4_0`: 32 values, `x[j] = d * ((qs[j] & 15) - 8)`, `x[j+16] = d * ((qs[j] >> 4) - 8)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

/// ggml `block_q4_1`: 32 values, `x[j] = d * (qs[j] & 15) + m`, `x[j+16] = d * (qs[j] >> 4) + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

/// ggml `block_q4_K`: 256 values in 8 sub-blocks of 32 with 6-bit scales/mins packed in
/// `scales` (see [`q4k_scale_min`]); value `64 j + l` is the low nibble of `qs[32 j + l]`,
/// value `64 j + 32 + l` the high nibble; `x = d * sc * q - dmin * m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// ggml `block_q6_K`: 256 values in 16 sub-blocks of 16, 6-bit codes split in low 4 bits
/// (`ql`) and high 2 bits (`qh`), `x = d * scales[i / 16] * (q - 32)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}

fn rd_f16(b: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

impl BlockQ8_0 {
    pub fn from_bytes(b: &[u8; 34]) -> Self {
        let mut qs = [0i8; 32];
        for (q, &v) in qs.iter_mut().zip(&b[2..34]) {
            *q = v as i8;
        }
        BlockQ8_0 {
            d: rd_f16(b, 0),
            qs,
        }
    }
    pub fn to_bytes(&self) -> [u8; 34] {
        let mut o = [0u8; 34];
        o[..2].copy_from_slice(&self.d.to_bits().to_le_bytes());
        for (o, &q) in o[2..].iter_mut().zip(&self.qs) {
            *o = q as u8;
        }
        o
    }
}

impl BlockQ4_0 {
    pub fn from_bytes(b: &[u8; 18]) -> Self {
        BlockQ4_0 {
            d: rd_f16(b, 0),
            qs: arr(&b[2..]),
        }
    }
    pub fn to_bytes(&self) -> [u8; 18] {
        let mut o = [0u8; 18];
        o[..2].copy_from_slice(&self.d.to_bits().to_le_bytes());
        o[2..].copy_from_slice(&self.qs);
        o
    }
}

impl BlockQ4_1 {
    pub fn from_bytes(b: &[u8; 20]) -> Self {
        BlockQ4_1 {
            d: rd_f16(b, 0),
            m: rd_f16(b, 2),
            qs: arr(&b[4..]),
        }
    }
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut o = [0u8; 20];
        o[..2].copy_from_slice(&self.d.to_bits().to_le_bytes());
        o[2..4].copy_from_slice(&self.m.to_bits().to_le_bytes());
        o[4..].copy_from_slice(&self.qs);
        o
    }
}

impl BlockQ4K {
    pub fn from_bytes(b: &[u8; 144]) -> Self {
        BlockQ4K {
            d: rd_f16(b, 0),
            dmin: rd_f16(b, 2),
            scales: arr(&b[4..16]),
            qs: arr(&b[16..]),
        }
    }
    pub fn to_bytes(&self) -> [u8; 144] {
        let mut o = [0u8; 144];
        o[..2].copy_from_slice(&self.d.to_bits().to_le_bytes());
        o[2..4].copy_from_slice(&self.dmin.to_bits().to_le_bytes());
        o[4..16].copy_from_slice(&self.scales);
        o[16..].copy_from_slice(&self.qs);
        o
    }
}

impl BlockQ6K {
    pub fn from_bytes(b: &[u8; 210]) -> Self {
        let mut scales = [0i8; 16];
        for (s, &v) in scales.iter_mut().zip(&b[192..208]) {
            *s = v as i8;
        }
        BlockQ6K {
            ql: arr(&b[..128]),
            qh: arr(&b[128..192]),
            scales,
            d: rd_f16(b, 208),
        }
    }
    pub fn to_bytes(&self) -> [u8; 210] {
        let mut o = [0u8; 210];
        o[..128].copy_from_slice(&self.ql);
        o[128..192].copy_from_slice(&self.qh);
        for (o, &s) in o[192..208].iter_mut().zip(&self.scales) {
            *o = s as u8;
        }
        o[208..].copy_from_slice(&self.d.to_bits().to_le_bytes());
        o
    }
}

/// ggml `get_scale_min_k4`: 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block.
pub fn q4k_scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Inverse of [`q4k_scale_min`]: pack 8 six-bit scales and mins.
pub fn q4k_pack_scales(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        let (l, m) = (ls[j] & 63, lm[j] & 63);
        if j < 4 {
            s[j] |= l;
            s[j + 4] |= m;
        } else {
            s[j + 4] = (l & 0xF) | ((m & 0xF) << 4);
            s[j - 4] |= (l >> 4) << 6;
            s[j] |= (m >> 4) << 6;
        }
    }
    s
}

// ---------------------------------------------------------------------------------------
// Integer decoding of blocks: sub-blocks of `bk` unsigned codes with (d, c) affine params
// ---------------------------------------------------------------------------------------

/// One decoded sub-block: values are `d * (q - off)` (when `m` is None) or `d * q + m`.
#[derive(Clone, Copy, Debug)]
struct SubBlock {
    q: [u8; 32],
    /// Scale, as f16 bits (legacy types) or f32 (K-quants).
    d: Scale,
    m: Option<Scale>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Scale {
    H(f16),
    S(f32),
}

impl Scale {
    fn f32(self) -> f32 {
        match self {
            Scale::H(h) => h.to_f32(),
            Scale::S(s) => s,
        }
    }
}

/// Decode one ggml block of a quantized type into sub-blocks (pushed onto `out`).
fn decode_block(ty: WeightType, b: &[u8], out: &mut Vec<SubBlock>) {
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
                    let d1 = d * sc as f32;
                    let m1 = dmin * mn as f32;
                    out.push(SubBlock {
                        q,
                        d: Scale::S(d1),
                        m: Some(Scale::S(-m1)),
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
                });
            }
        }
        WeightType::F32 | WeightType::F16 => {}
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
        _ => {
            let mut subs = Vec::with_capacity(16);
            decode_block(ty, bytes, &mut subs);
            let sbk = bl / subs.len();
            for (s, o) in subs.iter().zip(out.chunks_mut(sbk)) {
                dequant_sub(s, off_of(ty), o);
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

fn off_of(ty: WeightType) -> i32 {
    match ty {
        WeightType::Q4_0 => 8,
        WeightType::Q8_0 => 128,
        WeightType::Q6K => 32,
        _ => 0,
    }
}

fn dequant_sub(s: &SubBlock, off: i32, out: &mut [f32]) {
    let d = s.d.f32();
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

// ---------------------------------------------------------------------------------------
// Reference quantizers (ggml's `quantize_row_*_ref` for the legacy types; simple but
// layout-exact quantizers for the K-quants)
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Packed (repacked) layout
// ---------------------------------------------------------------------------------------

/// Rows per interleaved group.
pub(crate) const GROUP: usize = 16;

/// Packed format descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PFmt {
    /// Q4_0: 4-bit, bk 32, f16 d, off 8.
    Q4_0,
    /// Q4_1: 4-bit, bk 32, f16 d, f16 m.
    Q4_1,
    /// Q8_0: 8-bit (code = q + 128), bk 32, f16 d, off 128.
    Q8_0,
    /// Q4_K: 4-bit, bk 32, f32 d, f32 m.
    Q4K,
    /// Q6_K: 8-bit (6-bit codes), bk 16, f32 d, off 32.
    Q6K,
}

/// Compile-time description of a packed format (used to monomorphise the kernels).
pub(crate) trait Fmt {
    const NIB: bool;
    const BK: usize;
    const F32S: bool;
    const HASM: bool;
    const OFF: i32;
    const QBYTES: usize = GROUP * Self::BK / if Self::NIB { 2 } else { 1 };
    const SBYTES: usize = if Self::F32S { 4 } else { 2 };
    const STRIDE: usize = Self::QBYTES + GROUP * Self::SBYTES * if Self::HASM { 2 } else { 1 };
}

pub(crate) struct FQ4_0;
pub(crate) struct FQ4_1;
pub(crate) struct FQ8_0;
pub(crate) struct FQ4K;
pub(crate) struct FQ6K;

impl Fmt for FQ4_0 {
    const NIB: bool = true;
    const BK: usize = 32;
    const F32S: bool = false;
    const HASM: bool = false;
    const OFF: i32 = 8;
}
impl Fmt for FQ4_1 {
    const NIB: bool = true;
    const BK: usize = 32;
    const F32S: bool = false;
    const HASM: bool = true;
    const OFF: i32 = 0;
}
impl Fmt for FQ8_0 {
    const NIB: bool = false;
    const BK: usize = 32;
    const F32S: bool = false;
    const HASM: bool = false;
    const OFF: i32 = 128;
}
impl Fmt for FQ4K {
    const NIB: bool = true;
    const BK: usize = 32;
    const F32S: bool = true;
    const HASM: bool = true;
    const OFF: i32 = 0;
}
impl Fmt for FQ6K {
    const NIB: bool = false;
    const BK: usize = 16;
    const F32S: bool = true;
    const HASM: bool = false;
    const OFF: i32 = 32;
}

impl PFmt {
    fn of(ty: WeightType) -> Option<PFmt> {
        match ty {
            WeightType::Q4_0 => Some(PFmt::Q4_0),
            WeightType::Q4_1 => Some(PFmt::Q4_1),
            WeightType::Q8_0 => Some(PFmt::Q8_0),
            WeightType::Q4K => Some(PFmt::Q4K),
            WeightType::Q6K => Some(PFmt::Q6K),
            _ => None,
        }
    }
    pub(crate) fn nib(self) -> bool {
        matches!(self, PFmt::Q4_0 | PFmt::Q4_1 | PFmt::Q4K)
    }
    pub(crate) fn bk(self) -> usize {
        if self == PFmt::Q6K {
            16
        } else {
            32
        }
    }
    pub(crate) fn f32s(self) -> bool {
        matches!(self, PFmt::Q4K | PFmt::Q6K)
    }
    pub(crate) fn hasm(self) -> bool {
        matches!(self, PFmt::Q4_1 | PFmt::Q4K)
    }
    pub(crate) fn off(self) -> i32 {
        match self {
            PFmt::Q4_0 => 8,
            PFmt::Q8_0 => 128,
            PFmt::Q6K => 32,
            _ => 0,
        }
    }
    pub(crate) fn qbytes(self) -> usize {
        GROUP * self.bk() / if self.nib() { 2 } else { 1 }
    }
    pub(crate) fn sbytes(self) -> usize {
        if self.f32s() {
            4
        } else {
            2
        }
    }
    pub(crate) fn stride(self) -> usize {
        self.qbytes() + GROUP * self.sbytes() * if self.hasm() { 2 } else { 1 }
    }
}

/// 64 bytes aligned to a cache line (packed weights, tile buffers).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct A64(pub(crate) [u8; 64]);

/// Rows repacked into groups of 16 (see module docs).
pub(crate) struct Packed {
    pub(crate) fmt: PFmt,
    /// Blocks of `bk` per row.
    pub(crate) nb: usize,
    pub(crate) n_groups: usize,
    buf: Vec<A64>,
    len: usize,
}

impl Packed {
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `buf` holds `buf.len() * 64 >= len` initialised bytes; A64 is plain bytes.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr() as *const u8, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, with unique access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr() as *mut u8, self.len) }
    }
    /// Bytes of one group (all its blocks).
    pub(crate) fn group_bytes(&self) -> usize {
        self.nb * self.fmt.stride()
    }

    fn build(ty: WeightType, fmt: PFmt, rows: usize, cols: usize, data: &[u8]) -> Packed {
        let bk = fmt.bk();
        let nb = cols / bk;
        let n_groups = rows.div_ceil(GROUP);
        let stride = fmt.stride();
        let len = n_groups * nb * stride;
        let mut p = Packed {
            fmt,
            nb,
            n_groups,
            buf: vec![A64([0; 64]); len.div_ceil(64)],
            len,
        };
        let row_bytes = ty.row_bytes(cols);
        let (qb, sb) = (fmt.qbytes(), fmt.sbytes());
        let mut subs = Vec::with_capacity(nb);
        let out = p.bytes_mut();
        for r in 0..rows {
            subs.clear();
            for blk in data[r * row_bytes..(r + 1) * row_bytes].chunks(ty.block_bytes()) {
                decode_block(ty, blk, &mut subs);
            }
            let (g, lane) = (r / GROUP, r % GROUP);
            for (b, s) in subs.iter().enumerate() {
                let base = (g * nb + b) * stride;
                let qdst = &mut out[base..base + qb];
                if fmt.nib() {
                    for sidx in 0..4 {
                        for j in 0..4 {
                            qdst[64 * sidx + 4 * lane + j] =
                                s.q[4 * sidx + j] | (s.q[16 + 4 * sidx + j] << 4);
                        }
                    }
                } else {
                    for t in 0..bk / 4 {
                        for j in 0..4 {
                            qdst[64 * t + 4 * lane + j] = s.q[4 * t + j];
                        }
                    }
                }
                let put = |dst: &mut [u8], v: Scale| match v {
                    Scale::H(h) => dst[..2].copy_from_slice(&h.to_bits().to_le_bytes()),
                    Scale::S(f) => dst[..4].copy_from_slice(&f.to_le_bytes()),
                };
                put(&mut out[base + qb + lane * sb..], s.d);
                if let Some(m) = s.m {
                    put(&mut out[base + qb + GROUP * sb + lane * sb..], m);
                }
            }
        }
        p
    }

    /// Unsigned code of (row, col).
    fn code(&self, r: usize, k: usize) -> u8 {
        let (g, lane) = (r / GROUP, r % GROUP);
        let bk = self.fmt.bk();
        let (b, kk) = (k / bk, k % bk);
        let base = (g * self.nb + b) * self.fmt.stride();
        let q = &self.bytes()[base..];
        if self.fmt.nib() {
            let (hi, idx) = (kk >= 16, kk % 16);
            let byte = q[64 * (idx / 4) + 4 * lane + idx % 4];
            if hi {
                byte >> 4
            } else {
                byte & 0xF
            }
        } else {
            q[64 * (kk / 4) + 4 * lane + kk % 4]
        }
    }

    /// (d, c) of (row, block) where value = d * q + c.
    fn scales(&self, r: usize, b: usize) -> (f32, f32) {
        let (g, lane) = (r / GROUP, r % GROUP);
        let f = self.fmt;
        let base = (g * self.nb + b) * f.stride() + f.qbytes();
        let bytes = self.bytes();
        let rd = |at: usize| -> f32 {
            if f.f32s() {
                f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
            } else {
                rd_f16(bytes, at).to_f32()
            }
        };
        let d = rd(base + lane * f.sbytes());
        if f.hasm() {
            (d, rd(base + GROUP * f.sbytes() + lane * f.sbytes()))
        } else {
            (d, -(f.off() as f32) * d)
        }
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bk = self.fmt.bk();
        let off = self.fmt.off();
        for b in 0..self.nb {
            let (d, c) = self.scales(r, b);
            for kk in 0..bk {
                let k = b * bk + kk;
                let q = self.code(r, k);
                out[k] = if self.fmt.hasm() {
                    d * q as f32 + c
                } else {
                    d * (q as i32 - off) as f32
                };
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Quantized activations
// ---------------------------------------------------------------------------------------

/// Activations quantized to int8 blocks of `bk`: `x ≈ d * q`, with `s = d * Σ q` per block.
#[derive(Default)]
pub(crate) struct QAct {
    pub(crate) q: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<f32>,
    pub(crate) cols: usize,
    pub(crate) nb: usize,
}

impl QAct {
    fn prepare(&mut self, m: usize, cols: usize, bk: usize) {
        self.cols = cols;
        self.nb = cols / bk;
        // +64 so SIMD loads past the end of the last row stay in bounds.
        self.q.resize(m * cols + 64, 0);
        self.d.resize(m * self.nb + 16, 0.0);
        self.s.resize(m * self.nb + 16, 0.0);
    }
}

/// Quantize one row of activations (portable).
pub(crate) fn quantize_act_row_scalar(
    x: &[f32],
    bk: usize,
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
    for (b, xb) in x.chunks(bk).enumerate() {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let mut sum = 0i32;
        for (j, &v) in xb.iter().enumerate() {
            let qv = (v * id).round() as i32;
            q[b * bk + j] = qv as i8;
            sum += qv;
        }
        d[b] = db;
        s[b] = db * sum as f32;
    }
}

pub(crate) fn quantize_act(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    cols: usize,
    bk: usize,
    a: &mut QAct,
) {
    a.prepare(m, cols, bk);
    let nb = a.nb;
    let qp = SendPtr(a.q.as_mut_ptr());
    let dp = SendPtr(a.d.as_mut_ptr());
    let sp = SendPtr(a.s.as_mut_ptr());
    let run = |i: usize| {
        // SAFETY: each task writes a disjoint row `i` of the three buffers, which were sized
        // for `m` rows by `prepare`.
        let (q, d, s) = unsafe {
            (
                std::slice::from_raw_parts_mut(qp.get().add(i * cols), cols),
                std::slice::from_raw_parts_mut(dp.get().add(i * nb), nb),
                std::slice::from_raw_parts_mut(sp.get().add(i * nb), nb),
            )
        };
        let xr = &x[i * cols..(i + 1) * cols];
        #[cfg(target_arch = "x86_64")]
        if isa >= Isa::Avx2 {
            crate::x86::quantize_act_row(isa, xr, bk, q, d, s);
            return;
        }
        let _ = isa;
        quantize_act_row_scalar(xr, bk, q, d, s);
    };
    if m >= 8 && pool.n_threads() > 1 {
        pool.parallel_for(m, &run);
    } else {
        for i in 0..m {
            run(i);
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
// SAFETY: used only to hand disjoint output regions to pool tasks.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

thread_local! {
    static ACT: std::cell::RefCell<QAct> = std::cell::RefCell::new(QAct::default());
}

// ---------------------------------------------------------------------------------------
// QMatrix
// ---------------------------------------------------------------------------------------

enum Repr {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Packed(Packed),
}

/// A weight matrix of `rows` output features × `cols` input features, repacked at load time.
pub struct QMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    repr: Repr,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// Activation-row tile (rows of `x` per micro-kernel call).
pub(crate) const MR: usize = 4;

impl QMatrix {
    /// `data` = the raw GGUF tensor bytes; GGUF dims are `[cols, rows]` (ne0 = cols).
    pub fn from_gguf_bytes(
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<QMatrix, KernelError> {
        if rows == 0 || cols == 0 {
            return Err(KernelError::InvalidShape(format!(
                "empty matrix {rows}x{cols}"
            )));
        }
        let bl = ty.block_len();
        if !cols.is_multiple_of(bl) {
            return Err(KernelError::InvalidShape(format!(
                "cols {cols} is not a multiple of the {ty:?} block length {bl}"
            )));
        }
        let expected = rows
            .checked_mul(ty.row_bytes(cols))
            .ok_or_else(|| KernelError::InvalidShape(format!("{rows}x{cols} overflows")))?;
        if data.len() != expected {
            return Err(KernelError::SizeMismatch {
                what: "tensor bytes",
                expected,
                got: data.len(),
            });
        }
        let repr = match ty {
            WeightType::F32 => Repr::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            WeightType::F16 => Repr::F16(
                data.chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            _ => {
                let fmt =
                    PFmt::of(ty).ok_or_else(|| KernelError::UnsupportedType(format!("{ty:?}")))?;
                Repr::Packed(Packed::build(ty, fmt, rows, cols, data))
            }
        };
        Ok(QMatrix {
            ty,
            rows,
            cols,
            repr,
        })
    }

    /// Quantize a row-major f32 matrix (`rows x cols`) with the reference quantizers.
    pub fn quantize_f32(
        ty: WeightType,
        rows: usize,
        cols: usize,
        w: &[f32],
    ) -> Result<QMatrix, KernelError> {
        if w.len() != rows * cols {
            return Err(KernelError::SizeMismatch {
                what: "f32 weights",
                expected: rows * cols,
                got: w.len(),
            });
        }
        if !cols.is_multiple_of(ty.block_len()) || cols == 0 {
            return Err(KernelError::InvalidShape(format!("cols {cols} for {ty:?}")));
        }
        let mut bytes = Vec::with_capacity(rows * ty.row_bytes(cols));
        for r in w.chunks(cols) {
            bytes.extend_from_slice(&quantize_row(ty, r)?);
        }
        QMatrix::from_gguf_bytes(ty, rows, cols, &bytes)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn weight_type(&self) -> WeightType {
        self.ty
    }

    /// The repacked weights, for quantized types.
    #[cfg(test)]
    pub(crate) fn packed(&self) -> Option<&Packed> {
        match &self.repr {
            Repr::Packed(p) => Some(p),
            _ => None,
        }
    }

    /// Bytes of weight data the kernels stream per full pass (after repacking).
    pub fn storage_bytes(&self) -> usize {
        match &self.repr {
            Repr::F32(v) => v.len() * 4,
            Repr::F16(v) => v.len() * 2,
            Repr::Packed(p) => p.len,
        }
    }

    /// Dequantize one row (for embedding lookup) into `out[..cols]`.
    /// Panics if `row >= rows` or `out.len() < cols`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "row {row} out of range ({} rows)",
            self.rows
        );
        let out = &mut out[..self.cols];
        match &self.repr {
            Repr::F32(v) => out.copy_from_slice(&v[row * self.cols..(row + 1) * self.cols]),
            Repr::F16(v) => {
                for (o, h) in out
                    .iter_mut()
                    .zip(&v[row * self.cols..(row + 1) * self.cols])
                {
                    *o = h.to_f32();
                }
            }
            Repr::Packed(p) => p.dequantize_row(row, out),
        }
    }

    /// `y[m][rows] = x[m][cols] · Wᵀ` (row-major f32), parallel over `pool`.
    /// Panics if `x.len() < m * cols` or `y.len() < m * rows`; see [`QMatrix::try_matmul`].
    pub fn matmul(&self, pool: &ThreadPool, x: &[f32], m: usize, y: &mut [f32]) {
        if let Err(e) = self.try_matmul(pool, x, m, y) {
            panic!("QMatrix::matmul: {e}");
        }
    }

    /// Like [`QMatrix::matmul`] but reports bad sizes as errors.
    pub fn try_matmul(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        if x.len() < m * self.cols {
            return Err(KernelError::SizeMismatch {
                what: "x",
                expected: m * self.cols,
                got: x.len(),
            });
        }
        if y.len() < m * self.rows {
            return Err(KernelError::SizeMismatch {
                what: "y",
                expected: m * self.rows,
                got: y.len(),
            });
        }
        if m == 0 {
            return Ok(());
        }
        let isa = isa::active();
        match &self.repr {
            Repr::F32(w) => self.matmul_float(pool, isa, x, m, y, |r, buf| {
                buf.copy_from_slice(&w[r * self.cols..(r + 1) * self.cols])
            }),
            Repr::F16(w) => self.matmul_float(pool, isa, x, m, y, |r, buf| {
                for (o, h) in buf.iter_mut().zip(&w[r * self.cols..(r + 1) * self.cols]) {
                    *o = h.to_f32();
                }
            }),
            Repr::Packed(p) => ACT.with(|a| {
                let mut a = a.borrow_mut();
                quantize_act(isa, pool, x, m, self.cols, p.fmt.bk(), &mut a);
                matmul_packed(isa, pool, p, self.rows, &a, m, y);
            }),
        }
        Ok(())
    }

    fn matmul_float(
        &self,
        pool: &ThreadPool,
        isa: Isa,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        load_row: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        let (rows, cols) = (self.rows, self.cols);
        let chunk = 16usize;
        let n_tasks = rows.div_ceil(chunk);
        let yp = SendPtr(y.as_mut_ptr());
        pool.parallel_for(n_tasks, &|t| {
            let mut buf = vec![0f32; cols];
            for r in t * chunk..((t + 1) * chunk).min(rows) {
                load_row(r, &mut buf);
                for i in 0..m {
                    let v = dot_f32(isa, &x[i * cols..(i + 1) * cols], &buf);
                    // SAFETY: element (i, r) is written by exactly one task (the one owning r).
                    unsafe { *yp.get().add(i * rows + r) = v };
                }
            }
        });
    }
}

fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        return crate::x86::dot_f32(isa, a, b);
    }
    let _ = isa;
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Tile driver: splits (group pairs × row tiles) into pool tasks and calls the ISA kernel.
pub(crate) fn matmul_packed(
    isa: Isa,
    pool: &ThreadPool,
    p: &Packed,
    rows: usize,
    a: &QAct,
    m: usize,
    y: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && m >= crate::amx::MIN_M {
        crate::amx::matmul(pool, p, rows, a, m, y);
        return;
    }
    let n_pairs = p.n_groups.div_ceil(2);
    let grid = TaskGrid::new(n_pairs, m.div_ceil(MR), pool.n_threads());
    let yp = SendPtr(y.as_mut_ptr());
    let run = |task: usize| {
        let (pairs, tiles) = grid.ranges(task);
        for pair in pairs {
            let g0 = pair * 2;
            let ng = (p.n_groups - g0).min(2);
            let r0 = g0 * GROUP;
            let nvalid = (rows - r0).min(ng * GROUP);
            for tile in tiles.clone() {
                let i0 = tile * MR;
                let mr = (m - i0).min(MR);
                let job = TileJob {
                    p,
                    g0,
                    ng,
                    a,
                    i0,
                    mr,
                    y: yp,
                    ystride: rows,
                    r0,
                    nvalid,
                };
                run_tile(isa, &job);
            }
        }
    };
    pool.parallel_for(grid.tasks(), &run);
}

/// How a matmul is cut into pool tasks: chunks of weight units (16-row groups or pairs of
/// them) × splits of the activation-row tiles.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TaskGrid {
    units: usize,
    m_tiles: usize,
    units_per_task: usize,
    m_split: usize,
    tiles_per_split: usize,
}

impl TaskGrid {
    pub(crate) fn new(units: usize, m_tiles: usize, threads: usize) -> TaskGrid {
        // Weight chunks: enough tasks for load balance, few enough to keep overhead low.
        let units_per_task = (units / (threads * 4)).max(1);
        let unit_tasks = units.div_ceil(units_per_task);
        // Split over m too when there are few weight tasks (small matrices in prefill).
        let m_split = if unit_tasks >= threads * 2 || m_tiles == 1 {
            1
        } else {
            (threads * 2).div_ceil(unit_tasks).min(m_tiles)
        };
        TaskGrid {
            units,
            m_tiles,
            units_per_task,
            m_split,
            tiles_per_split: m_tiles.div_ceil(m_split),
        }
    }

    pub(crate) fn tasks(&self) -> usize {
        self.units.div_ceil(self.units_per_task) * self.m_split
    }

    /// Task `task`'s weight units and activation-row tiles (either may be empty).
    pub(crate) fn ranges(&self, task: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (ut, ms) = (task / self.m_split, task % self.m_split);
        let u0 = ut * self.units_per_task;
        let t0 = (ms * self.tiles_per_split).min(self.m_tiles);
        (
            u0..(u0 + self.units_per_task).min(self.units),
            t0..(t0 + self.tiles_per_split).min(self.m_tiles),
        )
    }
}

/// One micro-kernel invocation: rows `r0..r0+nvalid` (groups g0..g0+ng) × x rows i0..i0+mr.
pub(crate) struct TileJob<'a> {
    pub(crate) p: &'a Packed,
    pub(crate) g0: usize,
    pub(crate) ng: usize,
    pub(crate) a: &'a QAct,
    pub(crate) i0: usize,
    pub(crate) mr: usize,
    pub(crate) y: SendPtr<f32>,
    pub(crate) ystride: usize,
    pub(crate) r0: usize,
    pub(crate) nvalid: usize,
}

fn run_tile(isa: Isa, job: &TileJob) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        crate::x86::run_tile(isa, job);
        return;
    }
    let _ = isa;
    tile_scalar(job);
}

/// Portable micro-kernel (same integer math as the SIMD kernels).
fn tile_scalar(job: &TileJob) {
    let p = job.p;
    let f = p.fmt;
    let bk = f.bk();
    let a = job.a;
    for lr in 0..job.nvalid {
        let r = job.r0 + lr;
        for i in job.i0..job.i0 + job.mr {
            let mut acc = 0f32;
            for b in 0..p.nb {
                let (d, c) = p.scales(r, b);
                let xq = &a.q[i * a.cols + b * bk..i * a.cols + (b + 1) * bk];
                let mut isum = 0i32;
                for (kk, &xv) in xq.iter().enumerate() {
                    isum += p.code(r, b * bk + kk) as i32 * xv as i32;
                }
                acc += isum as f32 * (d * a.d[i * a.nb + b]) + c * a.s[i * a.nb + b];
            }
            // SAFETY: (i, r) lies inside y (checked by try_matmul) and is owned by this tile.
            unsafe { *job.y.get().add(i * job.ystride + r) = acc };
        }
    }
}
