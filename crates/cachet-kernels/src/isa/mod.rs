//! Run-time instruction-set dispatch.
//!
//! [`detected`] reports the best level this CPU supports, [`active`] the level the kernels
//! actually use: the minimum of the detected level and `CACHET_ISA` (if set), or of the
//! level forced with [`set_override`] (used by tests to exercise every code path).
//!
//! Levels:
//! * `Scalar`: portable Rust, any CPU.
//! * `Avx2`: AVX2 + FMA + F16C (x86-64-v3).
//! * `Avx512`: AVX-512 F/BW/VL + AVX512-VNNI (int8 dot products with `vpdpbusd`).
//! * `Amx`: AMX-TILE + AMX-INT8 on top of `Avx512`, tile state enabled by the OS, this
//!   process granted it (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and a tile product that matched
//!   the software model ([`amx_status`] says which step failed). Quantized matmuls with 8 or
//!   more activation rows use tiles; everything else runs the `Avx512` kernels.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;

/// Instruction-set level, ordered from least to most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Amx,
}

impl Isa {
    /// All levels, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx];

    /// Parse `scalar|avx2|avx512|amx` (case-insensitive).
    pub fn parse(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" | "generic" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" | "avx-512" => Some(Isa::Avx512),
            "amx" => Some(Isa::Amx),
            _ => None,
        }
    }

    /// Every level up to and including [`detected`], lowest first.
    pub fn supported() -> Vec<Isa> {
        let d = detected();
        Isa::ALL.iter().copied().filter(|&l| l <= d).collect()
    }

    fn to_u8(self) -> u8 {
        self as u8
    }

    fn from_u8(v: u8) -> Option<Isa> {
        Isa::ALL.get(v as usize).copied()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        };
        f.write_str(s)
    }
}

/// Why the AMX level is or is not available, as found by detection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxStatus {
    /// The CPU does not report AMX-TILE and AMX-INT8.
    NotReported,
    /// The OS did not enable tile state in XCR0.
    NotEnabledByOs,
    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)` failed with this errno.
    PermissionDenied(i32),
    /// The hardware tile product disagreed with the software model (kernels stay on AVX-512).
    SelfTestFailed,
    /// Tiles are usable and the self-test passed.
    Usable,
}

impl std::fmt::Display for AmxStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmxStatus::NotReported => f.write_str("not reported by the CPU"),
            AmxStatus::NotEnabledByOs => f.write_str("tile state not enabled by the OS"),
            AmxStatus::PermissionDenied(e) => write!(f, "arch_prctl permission denied (errno {e})"),
            AmxStatus::SelfTestFailed => f.write_str("self-test failed, using AVX-512"),
            AmxStatus::Usable => f.write_str("in use"),
        }
    }
}

/// AMX availability on this CPU and OS (cached; detection runs the self-test once).
pub fn amx_status() -> AmxStatus {
    static S: OnceLock<AmxStatus> = OnceLock::new();
    *S.get_or_init(detect_amx)
}

#[cfg(target_arch = "x86_64")]
fn detect_amx() -> AmxStatus {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    let max_leaf = __cpuid_count(0, 0).eax;
    if max_leaf < 7 {
        return AmxStatus::NotReported;
    }
    let l7 = __cpuid_count(7, 0);
    let amx_tile = l7.edx & (1 << 24) != 0;
    let amx_int8 = l7.edx & (1 << 25) != 0;
    if !(amx_tile && amx_int8 && std::arch::is_x86_feature_detected!("xsave")) {
        return AmxStatus::NotReported;
    }
    // SAFETY: xgetbv is available when OSXSAVE/xsave is reported (checked above).
    let xcr0 = unsafe { _xgetbv(0) };
    // XTILECFG (bit 17) and XTILEDATA (bit 18) state must be enabled by the OS.
    if xcr0 & (3 << 17) != (3 << 17) {
        return AmxStatus::NotEnabledByOs;
    }
    // Linux hands out the 8 KiB tile data state per process on request.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain syscall with integer arguments.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if rc != 0 {
        return AmxStatus::PermissionDenied(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        );
    }
    if amx::self_test() {
        AmxStatus::Usable
    } else {
        AmxStatus::SelfTestFailed
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_amx() -> AmxStatus {
    AmxStatus::NotReported
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512vl")
        && has!("avx512dq")
        && has!("avx512vnni");
    if avx512 && amx_status() == AmxStatus::Usable {
        Isa::Amx
    } else if avx512 {
        Isa::Avx512
    } else if avx2 {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Scalar
}

/// Best level available on this CPU (cached).
pub fn detected() -> Isa {
    static D: OnceLock<Isa> = OnceLock::new();
    *D.get_or_init(detect)
}

fn env_level() -> Option<Isa> {
    static E: OnceLock<Option<Isa>> = OnceLock::new();
    *E.get_or_init(|| {
        std::env::var("CACHET_ISA")
            .ok()
            .and_then(|s| Isa::parse(&s))
    })
}

const NO_OVERRIDE: u8 = u8::MAX;
static OVERRIDE: AtomicU8 = AtomicU8::new(NO_OVERRIDE);

/// Level the kernels use: `min(detected(), override or CACHET_ISA)`.
#[inline]
pub fn active() -> Isa {
    let d = detected();
    let cap = match Isa::from_u8(OVERRIDE.load(Ordering::Relaxed)) {
        Some(l) => Some(l),
        None => env_level(),
    };
    match cap {
        Some(c) if c < d => c,
        _ => d,
    }
}

/// Force a level at run time (`None` restores the default). Levels above [`detected`] are
/// clamped to it. Thread-safe; affects every subsequent kernel call in the process.
pub fn set_override(level: Option<Isa>) {
    OVERRIDE.store(level.map_or(NO_OVERRIDE, Isa::to_u8), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_order() {
        assert_eq!(Isa::parse("AVX512"), Some(Isa::Avx512));
        assert_eq!(Isa::parse("bogus"), None);
        assert!(Isa::Scalar < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Amx);
        assert!(Isa::supported().contains(&Isa::Scalar));
    }
}
