//! ggml block structures (layout documentation + typed access; all little-endian).

use half::f16;

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

pub(crate) fn rd_f16(b: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))
}

pub(crate) fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
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
