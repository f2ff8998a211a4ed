//! The AMX tile instructions the kernels use, behind a small trait: [`Hw`] issues them, [`Emu`]
//! models them in plain Rust (Intel SDM semantics), including the shape rules the hardware
//! enforces with `#UD`, so the tile kernel (`crate::micro::amx`) is tested on CPUs without
//! AMX too. At detection, [`self_test`] compares one hardware tile product with the model
//! before [`crate::isa`] offers the AMX level.

use std::arch::asm;

use crate::util::A64;

/// A 64-byte `ldtilecfg` operand (palette 1).
#[repr(C, align(64))]
pub(crate) struct TileCfg([u8; 64]);

impl TileCfg {
    /// Two sets of the same three tiles: set `s` has C = tmm`3s` (`mr` × 16 i32), A =
    /// tmm`3s+1` (`mr` × `k` i8), B = tmm`3s+2` (`k / 4` × 64 u8).
    pub(crate) fn new(mr: usize, k: usize) -> TileCfg {
        debug_assert!((1..=16).contains(&mr) && k.is_multiple_of(4) && (4..=64).contains(&k));
        let mut c = [0u8; 64];
        c[0] = 1;
        for set in 0..SETS {
            for (t, rows, colsb) in [(0, mr, 64), (1, mr, k), (2, k / 4, 64)] {
                let t = 3 * set + t;
                c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(colsb as u16).to_le_bytes());
                c[48 + t] = rows as u8;
            }
        }
        TileCfg(c)
    }

    fn rows(&self, t: usize) -> usize {
        self.0[48 + t] as usize
    }

    fn colsb(&self, t: usize) -> usize {
        u16::from_le_bytes([self.0[16 + 2 * t], self.0[17 + 2 * t]]) as usize
    }
}

/// Tile sets: the kernel runs block `b + 1`'s product on one set while it folds block `b`'s
/// sums, stored from the other (one set would make each product wait for the previous
/// block's store).
pub(crate) const SETS: usize = 2;

/// The tile operations the kernel uses, with fixed roles in each of the [`SETS`] sets `s`:
/// tmm`3s` = C, tmm`3s+1` = A, tmm`3s+2` = B. A set index of 1 or more means set 1.
///
/// # Safety
/// Implementations read and write raw pointers: `load_*` reads `rows` rows of `colsb` bytes
/// at `p + r * stride`, `store_c` writes them; the caller guarantees those ranges are valid.
pub(crate) unsafe trait Tiles {
    unsafe fn config(&mut self, cfg: &TileCfg);
    unsafe fn zero_c(&mut self, s: usize);
    unsafe fn load_a(&mut self, s: usize, p: *const u8, stride: usize);
    unsafe fn load_b(&mut self, s: usize, p: *const u8, stride: usize);
    /// `C += A · B` (signed bytes of A × unsigned bytes of B, int32 sums).
    unsafe fn dp(&mut self, s: usize);
    unsafe fn store_c(&mut self, s: usize, p: *mut u8, stride: usize);
    unsafe fn release(&mut self);
}

/// One instruction on tile set `s`: the first template for set 0, the second for set 1 (tile
/// registers are named in the instruction, so each set needs its own template).
macro_rules! per_set {
    ($s:expr, $set0:literal, $set1:literal, $($args:tt)*) => {
        if $s == 0 {
            asm!($set0, $($args)*)
        } else {
            asm!($set1, $($args)*)
        }
    };
}

/// The AMX hardware. Only used after [`crate::isa`] detected AMX-TILE + AMX-INT8, the OS
/// enabled tile state and granted this process permission (`arch_prctl`).
#[derive(Default)]
pub(crate) struct Hw;

// SAFETY: each method is one instruction whose memory accesses are exactly the ones the trait
// documents; the tile registers are not visible to the compiler, and every `asm!` block is
// volatile, so their order is kept.
unsafe impl Tiles for Hw {
    #[inline(always)]
    unsafe fn config(&mut self, cfg: &TileCfg) {
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    }
    #[inline(always)]
    unsafe fn zero_c(&mut self, s: usize) {
        per_set!(s, "tilezero tmm0", "tilezero tmm3", options(nostack, nomem));
    }
    #[inline(always)]
    unsafe fn load_a(&mut self, s: usize, p: *const u8, stride: usize) {
        per_set!(s, "tileloadd tmm1, [{p} + {s} * 1]", "tileloadd tmm4, [{p} + {s} * 1]",
            p = in(reg) p, s = in(reg) stride, options(nostack, readonly));
    }
    #[inline(always)]
    unsafe fn load_b(&mut self, s: usize, p: *const u8, stride: usize) {
        per_set!(s, "tileloadd tmm2, [{p} + {s} * 1]", "tileloadd tmm5, [{p} + {s} * 1]",
            p = in(reg) p, s = in(reg) stride, options(nostack, readonly));
    }
    #[inline(always)]
    unsafe fn dp(&mut self, s: usize) {
        per_set!(
            s,
            "tdpbsud tmm0, tmm1, tmm2",
            "tdpbsud tmm3, tmm4, tmm5",
            options(nostack, nomem)
        );
    }
    #[inline(always)]
    unsafe fn store_c(&mut self, s: usize, p: *mut u8, stride: usize) {
        per_set!(s, "tilestored [{p} + {s} * 1], tmm0", "tilestored [{p} + {s} * 1], tmm3",
            p = in(reg) p, s = in(reg) stride, options(nostack));
    }
    #[inline(always)]
    unsafe fn release(&mut self) {
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// A software model of the three tiles (Intel SDM semantics of the instructions above).
/// Panics where the hardware raises `#UD`: unconfigured tiles and mismatched shapes.
pub(crate) struct Emu {
    cfg: Option<TileCfg>,
    t: [[u8; 1024]; 3 * SETS],
}

impl Default for Emu {
    fn default() -> Self {
        Emu {
            cfg: None,
            t: [[0; 1024]; 3 * SETS],
        }
    }
}

impl Emu {
    /// The C tile of set `s` (as the hardware: any `s` past 0 is set 1).
    fn base(s: usize) -> usize {
        3 * s.min(SETS - 1)
    }

    fn shape(&self, t: usize) -> (usize, usize) {
        let c = self
            .cfg
            .as_ref()
            .expect("tile instruction before ldtilecfg (#UD)");
        let (rows, colsb) = (c.rows(t), c.colsb(t));
        assert!(
            rows > 0 && rows <= 16 && colsb > 0 && colsb <= 64,
            "tile {t} unconfigured"
        );
        (rows, colsb)
    }

    unsafe fn load(&mut self, t: usize, p: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(t);
        self.t[t] = [0; 1024];
        for r in 0..rows {
            std::ptr::copy_nonoverlapping(
                p.add(r * stride),
                self.t[t][64 * r..].as_mut_ptr(),
                colsb,
            );
        }
    }
}

// SAFETY: memory is touched only through the documented row ranges.
unsafe impl Tiles for Emu {
    unsafe fn config(&mut self, cfg: &TileCfg) {
        assert_eq!(cfg.0[0], 1, "palette");
        self.cfg = Some(TileCfg(cfg.0));
        self.t = [[0; 1024]; 3 * SETS];
    }
    unsafe fn zero_c(&mut self, s: usize) {
        let c = Emu::base(s);
        self.shape(c);
        self.t[c] = [0; 1024];
    }
    unsafe fn load_a(&mut self, s: usize, p: *const u8, stride: usize) {
        self.load(Emu::base(s) + 1, p, stride)
    }
    unsafe fn load_b(&mut self, s: usize, p: *const u8, stride: usize) {
        self.load(Emu::base(s) + 2, p, stride)
    }
    unsafe fn dp(&mut self, s: usize) {
        let (c, a, b) = (Emu::base(s), Emu::base(s) + 1, Emu::base(s) + 2);
        let ((cr, cc), (ar, ac), (br, bc)) = (self.shape(c), self.shape(a), self.shape(b));
        assert!(cr == ar && cc == bc && ac == 4 * br, "tdpbsud shapes (#UD)");
        for m in 0..cr {
            for n in 0..cc / 4 {
                let mut sum = i32::from_le_bytes(
                    self.t[c][64 * m + 4 * n..64 * m + 4 * n + 4]
                        .try_into()
                        .expect("4 bytes"),
                );
                for k in 0..br {
                    for i in 0..4 {
                        let a = self.t[a][64 * m + 4 * k + i] as i8 as i32;
                        let b = self.t[b][64 * k + 4 * n + i] as i32;
                        sum = sum.wrapping_add(a * b);
                    }
                }
                self.t[c][64 * m + 4 * n..64 * m + 4 * n + 4].copy_from_slice(&sum.to_le_bytes());
            }
        }
    }
    unsafe fn store_c(&mut self, s: usize, p: *mut u8, stride: usize) {
        let c = Emu::base(s);
        let (rows, colsb) = self.shape(c);
        for r in 0..rows {
            std::ptr::copy_nonoverlapping(self.t[c][64 * r..].as_ptr(), p.add(r * stride), colsb);
        }
    }
    unsafe fn release(&mut self) {
        self.cfg = None;
        self.t = [[0; 1024]; 3 * SETS];
    }
}

/// Run one 16 × 64 × 16 tile product on the hardware and compare it with the model, over
/// values that reach every byte of both signednesses. Call only on a CPU that reports
/// AMX-TILE/AMX-INT8 after permission was granted.
pub(crate) fn self_test() -> bool {
    let a: Vec<u8> = (0..16 * 64).map(|i| (i * 37 + 11) as u8).collect();
    let b: Vec<u8> = (0..16 * 64).map(|i| (i * 101 + 7) as u8).collect();
    let cfg = TileCfg::new(16, 64);
    (0..SETS).all(|set| {
        let (mut hw, mut model) = ([A64([0; 64]); 16], [A64([0; 64]); 16]);
        // SAFETY: the caller checked AMX support and permission; buffers are 16 rows of 64
        // bytes.
        unsafe {
            product(&mut Hw, set, &cfg, &a, &b, &mut hw);
            product(&mut Emu::default(), set, &cfg, &a, &b, &mut model);
        }
        hw.iter().zip(&model).all(|(h, m)| h.0 == m.0)
    })
}

/// One product on tile set `set`; the other set is loaded with different data first, so a
/// set that read or wrote the other's tiles would give a wrong product.
unsafe fn product<T: Tiles>(
    t: &mut T,
    set: usize,
    cfg: &TileCfg,
    a: &[u8],
    b: &[u8],
    c: &mut [A64; 16],
) {
    let other = 1 - set.min(1);
    let junk = [0x5Au8; 1024];
    t.config(cfg);
    t.zero_c(other);
    t.load_a(other, junk.as_ptr(), 64);
    t.load_b(other, junk.as_ptr(), 64);
    t.zero_c(set);
    t.load_a(set, a.as_ptr(), 64);
    t.load_b(set, b.as_ptr(), 64);
    t.dp(other);
    t.dp(set);
    t.store_c(set, c.as_mut_ptr() as *mut u8, 64);
    t.release();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model against a hand-computed product: row m of A is all `m - 8` (signed), row k
    /// of B holds `n` in every byte of column n, so C[m][n] = Σ_k 4 · (m - 8) · n over K/4
    /// rows = 16 · 4 · (m - 8) · n for K = 64.
    #[test]
    fn emulator_matches_hand_computed_product() {
        let a: Vec<u8> = (0..16 * 64).map(|i| ((i / 64) as i8 - 8) as u8).collect();
        let b: Vec<u8> = (0..16 * 64).map(|i| ((i % 64) / 4) as u8).collect();
        for set in 0..SETS {
            let mut c = [A64([0; 64]); 16];
            let cfg = TileCfg::new(16, 64);
            // SAFETY: 16 rows of 64 bytes each.
            unsafe { product(&mut Emu::default(), set, &cfg, &a, &b, &mut c) };
            for (m, row) in c.iter().enumerate() {
                for n in 0..16 {
                    let got = i32::from_le_bytes(row.0[4 * n..4 * n + 4].try_into().unwrap());
                    assert_eq!(
                        got,
                        64 * (m as i32 - 8) * n as i32,
                        "set {set}: C[{m}][{n}]"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "tdpbsud shapes")]
    fn emulator_rejects_mismatched_shapes() {
        let mut cfg = TileCfg::new(16, 32);
        cfg.0[48 + 2] = 4; // B with 4 rows while A has 32 bytes per row
        let (a, b) = ([0u8; 1024], [0u8; 1024]);
        let mut t = Emu::default();
        // SAFETY: buffers hold 16 rows of 64 bytes.
        unsafe {
            t.config(&cfg);
            t.zero_c(0);
            t.load_a(0, a.as_ptr(), 64);
            t.load_b(0, b.as_ptr(), 64);
            t.dp(0);
        }
    }
}
