//! Run-time instruction-set dispatch.
//!
//! [`detected`] reports the best level this CPU supports, [`active`] the level the kernels
//! actually use: the minimum of the detected level and `CACHET_ISA` (if set), or of the
//! level forced with [`set_override`] (used by tests to exercise every code path).
//!
//! Levels:
//! * `Scalar`: portable Rust, any CPU.
//! * `Avx2`: AVX2 + FMA + F16C (x86-64-v3): int8 products with `vpmaddubsw` (AMD Zen 2/3).
//! * `Avx2Vnni`: `Avx2` plus AVX-VNNI (`vpdpbusd` on 256-bit registers; Intel Alder Lake and
//!   later, AMD Zen 5). Not implied by `Avx512`: a CPU can have AVX-512 VNNI without it
//!   (Zen 4, Ice Lake), so the levels below the detected one are not always all usable;
//!   [`supported`](Isa::supported) lists the usable ones.
//! * `Avx512`: AVX-512 F/BW/VL + AVX512-VNNI (int8 dot products with `vpdpbusd`).
//! * `Amx`: AMX-TILE + AMX-INT8 on top of `Avx512`, tile state enabled by the OS, this
//!   process granted it (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and a tile product that matched
//!   the software model ([`amx_status`] says which step failed). Quantized matmuls with 32 or
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
    Avx2Vnni,
    Avx512,
    Amx,
}

impl Isa {
    /// All levels, lowest first.
    pub const ALL: [Isa; 5] = [Isa::Scalar, Isa::Avx2, Isa::Avx2Vnni, Isa::Avx512, Isa::Amx];

    /// Parse `scalar|avx2|avx2vnni|avx512|amx` (case-insensitive).
    pub fn parse(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" | "generic" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx2vnni" | "avx2-vnni" | "avxvnni" | "avx-vnni" => Some(Isa::Avx2Vnni),
            "avx512" | "avx-512" => Some(Isa::Avx512),
            "amx" => Some(Isa::Amx),
            _ => None,
        }
    }

    /// Every level this CPU can run (all of them at most [`detected`]), lowest first.
    pub fn supported() -> Vec<Isa> {
        let mask = usable_mask();
        Isa::ALL
            .iter()
            .copied()
            .filter(|&l| mask & (1 << l as u8) != 0)
            .collect()
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
            Isa::Avx2Vnni => "avx2vnni",
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

/// Whether the CPU is Intel's (CPUID vendor "GenuineIntel"): tile shapes measured faster on
/// one vendor's cores are chosen by it (`micro::tile_rows`).
pub(crate) fn intel() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let r = std::arch::x86_64::__cpuid_count(0, 0);
            // "Genu" "ineI" "ntel" in EBX, EDX, ECX.
            [r.ebx, r.edx, r.ecx] == [0x756e_6547, 0x4965_6e69, 0x6c65_746e]
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
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
    } else if avx2 && has_avx_vnni() {
        Isa::Avx2Vnni
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

/// AVX-VNNI (`vpdpbusd` on ymm) with the AVX2 level's features.
#[cfg(target_arch = "x86_64")]
fn has_avx_vnni() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma") && has!("f16c") && has!("avxvnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx_vnni() -> bool {
    false
}

/// Bit `l` set when level `l` can run here (cached).
fn usable_mask() -> u8 {
    static M: OnceLock<u8> = OnceLock::new();
    *M.get_or_init(|| {
        let d = detected();
        Isa::ALL
            .iter()
            .filter(|&&l| l <= d && (l != Isa::Avx2Vnni || has_avx_vnni()))
            .fold(0u8, |m, &l| m | (1 << l as u8))
    })
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

/// Level the kernels use: the best usable level at most `min(detected(), override or
/// CACHET_ISA)` (`CACHET_ISA=avx2vnni` on a CPU without AVX-VNNI runs `avx2`).
#[inline]
pub fn active() -> Isa {
    let d = detected();
    let cap = match Isa::from_u8(OVERRIDE.load(Ordering::Relaxed)) {
        Some(l) => Some(l),
        None => env_level(),
    };
    match cap {
        Some(c) if c < d => {
            let mask = usable_mask();
            (0..=c as u8)
                .rev()
                .find(|&l| mask & (1 << l) != 0)
                .and_then(Isa::from_u8)
                .unwrap_or(Isa::Scalar)
        }
        _ => d,
    }
}

/// Force a level at run time (`None` restores the default). Levels above [`detected`] are
/// clamped to it, levels this CPU lacks below it to the next usable one. Thread-safe; affects every subsequent kernel call in the process.
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
        assert_eq!(Isa::parse("avx2-vnni"), Some(Isa::Avx2Vnni));
        assert!(Isa::Scalar < Isa::Avx2 && Isa::Avx2 < Isa::Avx2Vnni);
        assert!(Isa::Avx2Vnni < Isa::Avx512 && Isa::Avx512 < Isa::Amx);
        for l in Isa::ALL {
            assert_eq!(Isa::parse(&l.to_string()), Some(l));
            assert_eq!(Isa::from_u8(l.to_u8()), Some(l));
        }
        let sup = Isa::supported();
        assert!(sup.contains(&Isa::Scalar) && sup.contains(&detected()));
        assert!(sup.iter().all(|&l| l <= detected()));
    }

    /// A cap the CPU cannot run falls to the next usable level below it.
    #[test]
    fn active_is_always_a_usable_level() {
        let sup = Isa::supported();
        for cap in Isa::ALL {
            set_override(Some(cap));
            let a = active();
            set_override(None);
            assert!(sup.contains(&a), "cap {cap}: active {a} not usable");
            assert!(a <= cap, "cap {cap}: active {a}");
            let best = sup.iter().copied().filter(|&l| l <= cap).max();
            assert_eq!(Some(a), best, "cap {cap}");
        }
    }
}
