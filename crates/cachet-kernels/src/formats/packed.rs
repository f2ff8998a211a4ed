//! The packed (repacked) weight layout shared by every matmul micro-kernel (see the module
//! docs of [`crate::formats`]).

use half::f16;

use super::blocks::rd_f16;
use super::dequant::decode_block;
use super::WeightType;
use crate::util::A64;

/// Rows per interleaved group.
pub(crate) const GROUP: usize = 16;

/// Packed format descriptor: the packed layout of each quantized [`WeightType`] (several types
/// share one where their values have the same form).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PFmt {
    /// Q4_0: 4-bit, bk 32, f16 d, off 8.
    Q4_0,
    /// Q4_1: 4-bit, bk 32, f16 d, f16 m.
    Q4_1,
    /// Q8_0 and IQ4_NL: 8-bit (code = level + 128), bk 32, f16 d, off 128.
    Q8_0,
    /// Q4_K: 4-bit, bk 32, f32 d, f32 m.
    Q4K,
    /// Q6_K and Q3_K: 8-bit (6-bit codes: level + 32), bk 16, f32 d, off 32.
    Q6K,
    /// Q5_0: 8-bit (5-bit codes), bk 32, f16 d, off 16.
    Q5_0,
    /// Q5_1 and Q5_K: 8-bit (5-bit codes), bk 32, f32 d, f32 m (Q5_1's f16 widened exactly).
    Q5K,
    /// Q2_K: 8-bit (2-bit codes), bk 16, f32 d, f32 m.
    Q2K,
    /// IQ4_XS: 8-bit (code = level + 128), bk 32, f32 d, off 128.
    IQ4XS,
}

/// Compile-time description of a packed format (used to monomorphise the kernels).
pub(crate) trait Fmt {
    /// Two 4-bit codes per byte (else one code per byte).
    const NIB: bool;
    /// Values per block (32 or 16).
    const BK: usize;
    /// Scales stored as f32 (else f16).
    const F32S: bool;
    /// A stored minimum per row and block (else `c = -OFF · d`).
    const HASM: bool;
    const OFF: i32;
    /// 8-bit codes below 64: two `vpmaddubsw` products summed in int16 cannot saturate.
    const NARROW: bool;
    const QBYTES: usize = GROUP * Self::BK / if Self::NIB { 2 } else { 1 };
    const SBYTES: usize = if Self::F32S { 4 } else { 2 };
    const STRIDE: usize = Self::QBYTES + GROUP * Self::SBYTES * if Self::HASM { 2 } else { 1 };
}

/// Defines a zero-sized [`Fmt`] per packed format from the runtime descriptor.
macro_rules! fmts {
    ($($name:ident = $pf:ident;)*) => {
        $(
            pub(crate) struct $name;
            impl Fmt for $name {
                const NIB: bool = PFmt::$pf.nib();
                const BK: usize = PFmt::$pf.bk();
                const F32S: bool = PFmt::$pf.f32s();
                const HASM: bool = PFmt::$pf.hasm();
                const OFF: i32 = PFmt::$pf.off();
                const NARROW: bool = PFmt::$pf.narrow();
            }
        )*
    };
}
fmts! {
    FQ4_0 = Q4_0;
    FQ4_1 = Q4_1;
    FQ8_0 = Q8_0;
    FQ4K = Q4K;
    FQ6K = Q6K;
    FQ5_0 = Q5_0;
    FQ5K = Q5K;
    FQ2K = Q2K;
    FIQ4XS = IQ4XS;
}

impl PFmt {
    pub(crate) fn of(ty: WeightType) -> Option<PFmt> {
        match ty {
            WeightType::Q4_0 => Some(PFmt::Q4_0),
            WeightType::Q4_1 => Some(PFmt::Q4_1),
            WeightType::Q8_0 | WeightType::IQ4NL => Some(PFmt::Q8_0),
            WeightType::Q4K => Some(PFmt::Q4K),
            WeightType::Q6K | WeightType::Q3K => Some(PFmt::Q6K),
            WeightType::Q5_0 => Some(PFmt::Q5_0),
            WeightType::Q5_1 | WeightType::Q5K => Some(PFmt::Q5K),
            WeightType::Q2K => Some(PFmt::Q2K),
            WeightType::IQ4XS => Some(PFmt::IQ4XS),
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => None,
        }
    }
    pub(crate) const fn nib(self) -> bool {
        matches!(self, PFmt::Q4_0 | PFmt::Q4_1 | PFmt::Q4K)
    }
    pub(crate) const fn bk(self) -> usize {
        match self {
            PFmt::Q6K | PFmt::Q2K => 16,
            _ => 32,
        }
    }
    pub(crate) const fn f32s(self) -> bool {
        matches!(
            self,
            PFmt::Q4K | PFmt::Q6K | PFmt::Q5K | PFmt::Q2K | PFmt::IQ4XS
        )
    }
    pub(crate) const fn hasm(self) -> bool {
        matches!(self, PFmt::Q4_1 | PFmt::Q4K | PFmt::Q5K | PFmt::Q2K)
    }
    pub(crate) const fn off(self) -> i32 {
        match self {
            PFmt::Q4_0 => 8,
            PFmt::Q8_0 | PFmt::IQ4XS => 128,
            PFmt::Q6K => 32,
            PFmt::Q5_0 => 16,
            _ => 0,
        }
    }
    /// 8-bit codes that stay below 64 (see [`Fmt::NARROW`]).
    pub(crate) const fn narrow(self) -> bool {
        matches!(self, PFmt::Q6K | PFmt::Q5_0 | PFmt::Q5K | PFmt::Q2K)
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
                debug_assert!(fmt.hasm() || s.off == fmt.off(), "{ty:?} in {fmt:?}");
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
                // Scales in the format's width (an f16 widens to f32 exactly); a stored minimum
                // for an offset code is `-off · d` (exact: the offsets are powers of two).
                let f32s = fmt.f32s();
                let put = |dst: &mut [u8], v: f32| {
                    if f32s {
                        dst[..4].copy_from_slice(&v.to_le_bytes())
                    } else {
                        dst[..2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
                    }
                };
                put(&mut out[base + qb + lane * sb..], s.d.f32());
                if fmt.hasm() {
                    let c = match s.m {
                        Some(m) => m.f32(),
                        None => -(s.off as f32) * s.d.f32(),
                    };
                    put(&mut out[base + qb + GROUP * sb + lane * sb..], c);
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
