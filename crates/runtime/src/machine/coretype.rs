//! Which OpenBLAS kernels fit this CPU. A distribution's OpenBLAS built with DYNAMIC_ARCH picks
//! its kernels from the CPU model it knows; one older than the CPU falls back to SSE3
//! ("Prescott") kernels. Debian's 0.3.21 does so on Sapphire Rapids: training ran at a third of
//! the speed of the SkylakeX (AVX-512) kernels the CPU can run. On aarch64 a core it does not
//! know (Debian's 0.3.21 on a Cortex-A76, a Neoverse V2 or an Apple core) gets its generic
//! `armv8` kernels, but these are NEON too: their sgemm kernel is the tuned cores' 16x4 one
//! (the same instructions as `neoversen1`'s, in Debian's arm64 build), so every aarch64 core
//! name fits. Here the CPU's features and the library's core name, as plain data, decide which
//! core type to ask for instead.

/// The instruction set a CPU or an OpenBLAS core name belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    X86_64,
    Aarch64,
}

/// The CPU features that decide a kernel family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    pub x86_64: bool,
    /// AMD (its AVX2 kernels are OpenBLAS's `Zen`).
    pub amd: bool,
    /// Intel (where MKL runs its own best kernels; see `blas_lib::rank_library`).
    pub intel: bool,
    pub avx: bool,
    /// AVX2 with FMA.
    pub avx2: bool,
    /// AVX-512 F, BW, VL and DQ (what OpenBLAS's SkylakeX kernels use).
    pub avx512: bool,
    /// aarch64 (whose every OpenBLAS kernel set is NEON).
    pub aarch64: bool,
}

impl CpuFeatures {
    /// This machine's.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            CpuFeatures {
                x86_64: true,
                amd: vendor() == *b"AuthenticAMD",
                intel: vendor() == *b"GenuineIntel",
                avx: has!("avx"),
                avx2: has!("avx2") && has!("fma"),
                avx512: has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq"),
                ..CpuFeatures::default()
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            use std::arch::is_aarch64_feature_detected as has;
            CpuFeatures {
                aarch64: has!("asimd"),
                ..CpuFeatures::default()
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        CpuFeatures::default()
    }

    /// Which OpenBLAS core names apply to this CPU.
    pub fn isa(&self) -> Option<Isa> {
        match *self {
            CpuFeatures { x86_64: true, .. } => Some(Isa::X86_64),
            CpuFeatures { aarch64: true, .. } => Some(Isa::Aarch64),
            _ => None,
        }
    }

    /// The best kernel level: on x86-64 the widest vectors, 3 AVX-512, 2 AVX2, 1 AVX, 0 SSE; on
    /// aarch64 1, NEON; 0 elsewhere.
    pub fn level(&self) -> u8 {
        match *self {
            CpuFeatures { aarch64: true, .. } => 1,
            CpuFeatures { x86_64: false, .. } => 0,
            CpuFeatures { avx512: true, .. } => 3,
            CpuFeatures { avx2: true, .. } => 2,
            CpuFeatures { avx: true, .. } => 1,
            _ => 0,
        }
    }

    /// The OpenBLAS core type whose kernels reach this CPU's level.
    pub fn best_coretype(&self) -> Option<&'static str> {
        match (self.isa()?, self.level()) {
            (Isa::X86_64, 3) => Some("SkylakeX"),
            (Isa::X86_64, 2) if self.amd => Some("Zen"),
            (Isa::X86_64, 2) => Some("Haswell"),
            (Isa::X86_64, 1) => Some("Sandybridge"),
            // Every aarch64 core's kernels are NEON: none to ask for.
            _ => None,
        }
    }

    /// An OpenBLAS core type with kernels below this CPU's (for tests of the warning).
    pub fn narrower_coretype(&self) -> Option<&'static str> {
        (self.isa()? == Isa::X86_64 && self.level() > 0).then_some("Prescott")
    }
}

/// CPUID leaf 0's vendor string ("GenuineIntel", "AuthenticAMD"), on every x86-64 CPU.
#[cfg(target_arch = "x86_64")]
fn vendor() -> [u8; 12] {
    let r = std::arch::x86_64::__cpuid(0);
    let mut v = [0u8; 12];
    for (i, x) in [r.ebx, r.edx, r.ecx].iter().enumerate() {
        v[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
    }
    v
}

/// The instruction set and kernel level (as [`CpuFeatures::level`]) of an OpenBLAS core name
/// (as `openblas_get_corename` or its config string gives it); `None` if unknown.
pub fn core_level(core: &str) -> Option<(Isa, u8)> {
    const SSE: &[&str] = &[
        "katmai",
        "coppermine",
        "northwood",
        "prescott",
        "banias",
        "core2",
        "penryn",
        "dunnington",
        "nehalem",
        "atom",
        "athlon",
        "opteron",
        "opteron_sse3",
        "barcelona",
        "nano",
        "bobcat",
    ];
    const AVX: &[&str] = &[
        "sandybridge",
        "bulldozer",
        "piledriver",
        "steamroller",
        "excavator",
    ];
    const AVX2: &[&str] = &["haswell", "zen"];
    const AVX512: &[&str] = &["skylakex", "cooperlake", "sapphirerapids"];
    const NEON: &[&str] = &[
        "armv8",
        "cortexa53",
        "cortexa55",
        "cortexa57",
        "cortexa72",
        "cortexa73",
        "cortexa76",
        "cortexa510",
        "cortexa710",
        "cortexx1",
        "cortexx2",
        "falkor",
        "thunderx",
        "thunderx2t99",
        "thunderx3t110",
        "tsv110",
        "emag8180",
        "neoversen1",
        "neoversen2",
        "neoversev1",
        "neoversev2",
        "armv8sve",
        "armv9sme",
        "a64fx",
        "vortex",
        "ampere1",
    ];
    let c = core.to_ascii_lowercase();
    use Isa::{Aarch64, X86_64};
    [
        (SSE, X86_64, 0),
        (AVX, X86_64, 1),
        (AVX2, X86_64, 2),
        (AVX512, X86_64, 3),
        (NEON, Aarch64, 1),
    ]
    .iter()
    .find(|(names, ..)| names.contains(&c.as_str()))
    .map(|&(_, isa, l)| (isa, l))
}

/// The core type to ask the library for, when the kernels it chose (`core`) are below the CPU's
/// level; `None` when they fit (or the name is unknown, or another instruction set's).
pub fn better_coretype(core: &str, cpu: &CpuFeatures) -> Option<&'static str> {
    let (isa, have) = core_level(core)?;
    (Some(isa) == cpu.isa() && have < cpu.level())
        .then(|| cpu.best_coretype())
        .flatten()
}

/// The core name inside an OpenBLAS config string (`OpenBLAS 0.3.21 ... DYNAMIC_ARCH
/// NO_AFFINITY Prescott MAX_THREADS=64`): the word that names a known core.
pub fn core_in_config(config: &str) -> Option<&str> {
    config.split_whitespace().find(|w| core_level(w).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPR: CpuFeatures = CpuFeatures {
        x86_64: true,
        amd: false,
        intel: true,
        avx: true,
        avx2: true,
        avx512: true,
        aarch64: false,
    };
    /// Neoverse V2 (Graviton 4, Grace), which Debian's 0.3.21 does not know.
    const NEOVERSE: CpuFeatures = CpuFeatures {
        aarch64: true,
        x86_64: false,
        amd: false,
        intel: false,
        avx: false,
        avx2: false,
        avx512: false,
    };

    #[test]
    fn generic_kernels_on_a_wide_cpu_are_replaced() {
        // Debian's 0.3.21 on Sapphire Rapids.
        assert_eq!(better_coretype("Prescott", &SPR), Some("SkylakeX"));
        // AVX2 kernels on an AVX-512 CPU: still narrower than it can run.
        assert_eq!(better_coretype("Haswell", &SPR), Some("SkylakeX"));
        let zen3 = CpuFeatures {
            avx512: false,
            amd: true,
            intel: false,
            ..SPR
        };
        assert_eq!(better_coretype("Nehalem", &zen3), Some("Zen"));
        let haswell = CpuFeatures {
            avx512: false,
            ..SPR
        };
        assert_eq!(better_coretype("core2", &haswell), Some("Haswell"));
        let sandy = CpuFeatures {
            avx2: false,
            avx512: false,
            ..SPR
        };
        assert_eq!(better_coretype("Prescott", &sandy), Some("Sandybridge"));
    }

    #[test]
    fn every_aarch64_core_runs_neon_kernels_so_none_is_replaced() {
        // OpenBLAS names its aarch64 cores in lower case; `armv8` is its fallback.
        for core in [
            "armv8",
            "neoversen1",
            "neoversev1",
            "cortexa53",
            "NEOVERSEN2",
        ] {
            assert_eq!(core_level(core), Some((Isa::Aarch64, 1)), "{core}");
            assert_eq!(better_coretype(core, &NEOVERSE), None, "{core}");
        }
        assert_eq!(NEOVERSE.best_coretype(), None);
        assert_eq!(NEOVERSE.narrower_coretype(), None);
        assert_eq!(SPR.narrower_coretype(), Some("Prescott"));
        assert_eq!(
            core_in_config(
                "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY armv8 MAX_THREADS=64"
            ),
            Some("armv8")
        );
    }

    #[test]
    fn fitting_or_unknown_kernels_are_kept() {
        assert_eq!(better_coretype("SkylakeX", &SPR), None);
        assert_eq!(better_coretype("SapphireRapids", &SPR), None);
        let haswell = CpuFeatures {
            avx512: false,
            ..SPR
        };
        assert_eq!(better_coretype("Haswell", &haswell), None);
        assert_eq!(
            better_coretype("SkylakeX", &haswell),
            None,
            "never narrower"
        );
        assert_eq!(better_coretype("NEOVERSEN1", &SPR), None, "not an x86 core");
        assert_eq!(better_coretype("armv8", &SPR), None, "not an x86 core");
        assert_eq!(
            better_coretype("Prescott", &NEOVERSE),
            None,
            "not an arm core"
        );
        assert_eq!(better_coretype("Prescott", &CpuFeatures::default()), None);
    }

    #[test]
    fn the_core_is_found_in_the_config_string() {
        let cfg = "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64";
        assert_eq!(core_in_config(cfg), Some("Prescott"));
        assert_eq!(
            core_in_config("OpenBLAS 0.3.26 DYNAMIC_ARCH SkylakeX"),
            Some("SkylakeX")
        );
        assert_eq!(core_in_config("Intel MKL"), None);
    }

    #[test]
    fn mkl_goes_only_to_one_core_ranks_of_an_intel_cpu_that_has_it() {
        use crate::machine::blas_lib::rank_library;
        let mkl = || Some(std::path::PathBuf::from("/x/libmkl_rt.so.2"));
        assert_eq!(rank_library(&SPR, false, 1, mkl()), mkl());
        // An AVX2-only Intel too: MKL knows its own CPUs.
        let haswell = CpuFeatures {
            avx512: false,
            ..SPR
        };
        assert_eq!(rank_library(&haswell, false, 1, mkl()), mkl());
        let zen4 = CpuFeatures {
            amd: true,
            intel: false,
            ..SPR
        };
        assert_eq!(rank_library(&zen4, false, 1, mkl()), None, "AMD: level");
        assert_eq!(
            rank_library(&SPR, true, 1, mkl()),
            None,
            "the user's library"
        );
        assert_eq!(rank_library(&SPR, false, 2, mkl()), None, "threads compete");
        assert_eq!(rank_library(&SPR, false, 1, None), None, "no MKL here");
        let arm = CpuFeatures::default();
        assert_eq!(rank_library(&arm, false, 1, mkl()), None);
    }
}
