//! Decoding of the 256-value super-blocks added after Q4_K/Q6_K: Q2_K, Q3_K, Q5_K and IQ4_XS
//! (ggml's `block_q2_K`, `block_q3_K`, `block_q5_K`, `block_iq4_xs`, all little-endian), into
//! the sub-blocks of [`SubBlock`] that the packed layout stores. Each follows ggml's
//! `dequantize_row_*` value for value: the sub-block scale is computed with the same float
//! operations, and the integer level is kept as a code with an offset (or a minimum).

use super::blocks::{q4k_scale_min, rd_f16};
use super::dequant::{Scale, SubBlock, KVALUES_IQ4NL};
use super::WeightType;

/// Decode one super-block of `ty` (one of Q2_K, Q3_K, Q5_K, IQ4_XS; `b` holds its bytes).
pub(crate) fn decode_kquant(ty: WeightType, b: &[u8], out: &mut Vec<SubBlock>) {
    match ty {
        WeightType::Q2K => decode_q2k(b, out),
        WeightType::Q3K => decode_q3k(b, out),
        WeightType::Q5K => decode_q5k(b, out),
        WeightType::IQ4XS => decode_iq4xs(b, out),
        _ => debug_assert!(false, "{ty:?} is not decoded here"),
    }
}

/// Q2_K (84 bytes: `scales[16]`, `qs[64]`, `d`, `dmin`): 16 sub-blocks of 16 two-bit codes,
/// `x = d·(sc & 15)·q − dmin·(sc >> 4)`. Sub-block `s` = 8n + 2j + h reads bits `2j..2j+2` of
/// `qs[32n + 16h + l]`.
fn decode_q2k(b: &[u8], out: &mut Vec<SubBlock>) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let d = rd_f16(b, 80).to_f32();
    let dmin = rd_f16(b, 82).to_f32();
    for (s, &sc) in scales.iter().enumerate() {
        let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
        let mut q = [0u8; 32];
        for (l, q) in q[..16].iter_mut().enumerate() {
            *q = (qs[32 * n + 16 * h + l] >> (2 * j)) & 3;
        }
        out.push(SubBlock {
            q,
            d: Scale::S(d * (sc & 0xF) as f32),
            m: Some(Scale::S(-(dmin * (sc >> 4) as f32))),
            off: 0,
        });
    }
}

/// The 16 six-bit scales of a Q3_K block (ggml's `kmask1`/`kmask2` shuffle of `scales[12]`):
/// scale `s` has its low 4 bits in the low nibble of byte `s` (s < 8) or the high nibble of
/// byte `s − 8`, and its high 2 bits in bits `2·(s / 4)` and up of byte `8 + s % 4`.
pub fn q3k_scales(packed: &[u8; 12]) -> [u8; 16] {
    let rd = |i: usize| {
        u32::from_le_bytes([
            packed[4 * i],
            packed[4 * i + 1],
            packed[4 * i + 2],
            packed[4 * i + 3],
        ])
    };
    let (a0, a1, tmp) = (rd(0), rd(1), rd(2));
    let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let aux = [
        (a0 & kmask2) | ((tmp & kmask1) << 4),
        (a1 & kmask2) | (((tmp >> 2) & kmask1) << 4),
        ((a0 >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4),
        ((a1 >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4),
    ];
    let mut s = [0u8; 16];
    for (i, w) in aux.iter().enumerate() {
        s[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    s
}

/// Q3_K (110 bytes: `hmask[32]`, `qs[64]`, `scales[12]`, `d`): 16 sub-blocks of 16 signed
/// 3-bit levels, `x = d·(sc − 32)·(low2 − (hbit ? 0 : 4))`. Stored as Q6_K's codes
/// (`level + 32`, offset 32).
fn decode_q3k(b: &[u8], out: &mut Vec<SubBlock>) {
    let (hmask, qs) = (&b[..32], &b[32..96]);
    let mut packed = [0u8; 12];
    packed.copy_from_slice(&b[96..108]);
    let scales = q3k_scales(&packed);
    let d_all = rd_f16(b, 108).to_f32();
    for (s, &sc) in scales.iter().enumerate() {
        let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
        let bit = 1u8 << (4 * n + j);
        let mut q = [0u8; 32];
        for (l, q) in q[..16].iter_mut().enumerate() {
            let low = (qs[32 * n + 16 * h + l] >> (2 * j)) & 3;
            let level = low as i32 - if hmask[16 * h + l] & bit != 0 { 0 } else { 4 };
            *q = (level + 32) as u8;
        }
        out.push(SubBlock {
            q,
            d: Scale::S(d_all * (sc as i32 - 32) as f32),
            m: None,
            off: 32,
        });
    }
}

/// Q5_K (176 bytes: `d`, `dmin`, `scales[12]` as Q4_K's, `qh[32]`, `qs[128]`): 8 sub-blocks of
/// 32 five-bit codes, `x = d·sc·q − dmin·m`; sub-block `2j` takes the low nibbles of
/// `qs[32j..32j+32]` and bit `2j` of `qh`, sub-block `2j + 1` the high nibbles and bit `2j + 1`.
fn decode_q5k(b: &[u8], out: &mut Vec<SubBlock>) {
    let d = rd_f16(b, 0).to_f32();
    let dmin = rd_f16(b, 2).to_f32();
    let mut scales = [0u8; 12];
    scales.copy_from_slice(&b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for s in 0..8 {
        let (j, h) = (s / 2, s % 2);
        let (sc, mn) = q4k_scale_min(s, &scales);
        let mut q = [0u8; 32];
        for (l, q) in q.iter_mut().enumerate() {
            let byte = qs[32 * j + l];
            let nib = if h == 0 { byte & 0xF } else { byte >> 4 };
            *q = nib | (((qh[l] >> s) & 1) << 4);
        }
        out.push(SubBlock {
            q,
            d: Scale::S(d * sc as f32),
            m: Some(Scale::S(-(dmin * mn as f32))),
            off: 0,
        });
    }
}

/// IQ4_XS (136 bytes: `d`, `scales_h` (u16), `scales_l[4]`, `qs[128]`): 8 sub-blocks of 32
/// non-linear levels `KVALUES_IQ4NL[code]`, `x = d·(ls − 32)·level` with the 6-bit `ls` from a
/// nibble of `scales_l` and two bits of `scales_h`; values `l` and `l + 16` of a sub-block are
/// the low and high nibbles of its byte `l`. Stored as Q8_0's codes (`level + 128`).
fn decode_iq4xs(b: &[u8], out: &mut Vec<SubBlock>) {
    let d = rd_f16(b, 0).to_f32();
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for ib in 0..8 {
        let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF)
            | (((scales_h >> (2 * ib)) & 3) << 4) as u8;
        let code = |k: u8| (KVALUES_IQ4NL[(k & 0xF) as usize] as i32 + 128) as u8;
        let mut q = [0u8; 32];
        for l in 0..16 {
            let byte = qs[16 * ib + l];
            q[l] = code(byte);
            q[l + 16] = code(byte >> 4);
        }
        out.push(SubBlock {
            q,
            d: Scale::S(d * (ls as i32 - 32) as f32),
            m: None,
            off: 128,
        });
    }
}
