//! The CPU kernel sets, chosen at run time: one portable binary (baseline x86-64) that uses
//! AVX-512 VNNI or AVX2 + FMA where the CPU has them. The choice is made once, logged once, and
//! can be narrowed with `LOCKSTEP_CPU_KERNELS=portable|avx2|avx512vnni` (a set the CPU lacks is
//! refused with a log line and the best available one is used).

use std::sync::OnceLock;

/// A kernel set this CPU can run. Values exist only for sets the CPU supports (see
/// [`Kernels::available`]), which is what makes dispatching on them sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels(Level);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Portable,
    Avx2,
    Avx512Vnni,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512Vnni => "avx512vnni",
        }
    }

    fn supported(self) -> bool {
        match self {
            Level::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Level::Avx512Vnni => {
                Level::Avx2.supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

impl Kernels {
    /// Every set this CPU can run, best last.
    pub fn available() -> Vec<Kernels> {
        [Level::Portable, Level::Avx2, Level::Avx512Vnni]
            .into_iter()
            .filter(|l| l.supported())
            .map(Kernels)
            .collect()
    }

    /// The portable set (every CPU).
    pub fn portable() -> Kernels {
        Kernels(Level::Portable)
    }

    /// Its name: `portable`, `avx2` or `avx512vnni`.
    pub fn name(self) -> &'static str {
        self.0.name()
    }

    pub(crate) fn level(self) -> Level {
        self.0
    }

    /// The set the engine uses: the best the CPU has, or `LOCKSTEP_CPU_KERNELS` when the CPU
    /// has that one. Chosen once; the first call logs the choice.
    pub fn chosen() -> Kernels {
        static CHOSEN: OnceLock<Kernels> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let all = Kernels::available();
            let best = *all.last().unwrap_or(&Kernels::portable());
            let names: Vec<&str> = all.iter().map(|k| k.name()).collect();
            let pick = match std::env::var("LOCKSTEP_CPU_KERNELS") {
                Ok(want) => match all.iter().find(|k| k.name() == want) {
                    Some(k) => *k,
                    None => {
                        tracing::warn!(requested = %want, available = ?names, "LOCKSTEP_CPU_KERNELS names a kernel set this CPU lacks; using the best available");
                        best
                    }
                },
                Err(_) => best,
            };
            tracing::info!(kernels = pick.name(), available = ?names, "CPU kernels chosen at run time");
            pick
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_is_always_available_and_sets_are_ordered() {
        let all = Kernels::available();
        assert_eq!(all.first(), Some(&Kernels::portable()));
        assert!(all.windows(2).all(|w| w[0].level() < w[1].level()));
        assert!(all.contains(&Kernels::chosen()));
    }
}
