//! The packed (repacked) weight layout shared by every matmul micro-kernel (see the module
//! docs of [`crate::formats`]).

use super::blocks::rd_f16;
use super::dequant::{decode_block, Scale};
use super::WeightType;
use crate::util::A64;

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
    pub(crate) fn of(ty: WeightType) -> Option<PFmt> {
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

/// Rows repacked into groups of 16 (see module docs).
pub(crate) struct Packed {
    pub(crate) fmt: PFmt,
    /// Blocks of `bk` per row.
    pub(crate) nb: usize,
    pub(crate) n_groups: usize,
    buf: Vec<A64>,
    pub(crate) len: usize,
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

    pub(crate) fn build(
        ty: WeightType,
        fmt: PFmt,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Packed {
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
    pub(crate) fn code(&self, r: usize, k: usize) -> u8 {
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
    pub(crate) fn scales(&self, r: usize, b: usize) -> (f32, f32) {
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

    pub(crate) fn dequantize_row(&self, r: usize, out: &mut [f32]) {
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
