//! Live knobs (DESIGN.md §7): values the control plane reads and changes while the daemon runs. Each knob has a
//! range; a bad value is refused and changes nothing. The engine reads them between windows, so a change takes
//! effect at the next window. Knobs whose tier this build lacks are accepted and reported as inactive.

use std::sync::atomic::{AtomicU64, Ordering};

use super::policy::{AdaptKnobs, PolicyKind, DEFAULT_ADAPT_EVERY, DEFAULT_ADAPT_SWAPS, DEFAULT_POLICY, POLICY_NAMES};

/// Errors setting a knob.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KnobError {
    /// No knob of that name.
    #[error("unknown knob {0:?} (known: {1})")]
    Unknown(String, String),
    /// The value does not parse or is out of range.
    #[error("{name}: {msg}")]
    Bad {
        /// Knob name.
        name: String,
        /// What is wrong, with the allowed range.
        msg: String,
    },
}

/// Value type and range of a knob.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Range {
    /// Integer in `min..=max`.
    Int(i64, i64),
    /// One of named choices, stored as its index (set by name or index).
    Choice(&'static [&'static str]),
    /// Real number in `(min, max]` when `open_min`, else `[min, max]`.
    Real {
        /// Lower bound.
        min: f64,
        /// Whether `min` itself is excluded.
        open_min: bool,
        /// Upper bound (included).
        max: f64,
    },
}

/// A knob's description.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KnobSpec {
    /// Name (snake_case; strata-ctl accepts dashes).
    pub name: &'static str,
    /// Default value.
    pub default: f64,
    /// Allowed values.
    pub range: Range,
    /// One line of documentation (units).
    pub doc: &'static str,
}

/// A live knob. The engine reads knobs by this type; names (snake_case, dashes accepted) are parsed only at the
/// edges (the control API, flags) by [`Knob::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Knob {
    /// `ram_adapt`: RAM promotions per decode window.
    RamAdapt,
    /// `adapt_every`: decode windows per adaptive round.
    AdaptEvery,
    /// `adapt_swaps`: VRAM swaps per adaptive round.
    AdaptSwaps,
    /// `adapt_decay`: usage decay per round.
    AdaptDecay,
    /// `adapt_async`: adaptive rounds on a helper thread.
    AdaptAsync,
    /// `adapt_policy`: the adaptive tier's placement policy ([`PolicyKind`]).
    AdaptPolicy,
    /// `vram_reserve_mib`: VRAM kept free on the first card.
    VramReserveMib,
    /// `vram_reserve_later_mib`: VRAM kept free on later cards of a split.
    VramReserveLaterMib,
    /// `pcie_frac`: share of a layer's misses computed on the GPU over PCIe.
    PcieFrac,
    /// `pcie_auto`: balance the PCIe share while decoding.
    PcieAuto,
    /// `pcie_prefill`: prefill chunks of at least this many tokens upload their missed experts over PCIe.
    PciePrefill,
    /// `route_tail_skip`: skip missed experts routed only at rank >= R.
    RouteTailSkip,
    /// `prefetch`: upload at most N of the next layer's predicted misses while a layer computes.
    Prefetch,
    /// `expert_profile_save_every`: minutes between profile saves.
    ExpertProfileSaveEvery,
}

impl Knob {
    /// Every knob, in display order (the order of [`SPECS`]).
    pub const ALL: [Knob; 14] = [
        Knob::RamAdapt,
        Knob::AdaptEvery,
        Knob::AdaptSwaps,
        Knob::AdaptDecay,
        Knob::AdaptAsync,
        Knob::AdaptPolicy,
        Knob::VramReserveMib,
        Knob::VramReserveLaterMib,
        Knob::PcieFrac,
        Knob::PcieAuto,
        Knob::PciePrefill,
        Knob::RouteTailSkip,
        Knob::Prefetch,
        Knob::ExpertProfileSaveEvery,
    ];

    /// Its description.
    pub fn spec(self) -> &'static KnobSpec {
        &SPECS[self as usize]
    }

    /// Its name (snake_case).
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The knob called `name` (dashes allowed, surrounding blanks ignored). Errors: [`KnobError::Unknown`]
    /// listing every name.
    pub fn parse(name: &str) -> Result<Knob, KnobError> {
        let n = normalize(name);
        Knob::ALL.into_iter().find(|k| k.name() == n).ok_or_else(|| {
            KnobError::Unknown(name.to_string(), SPECS.iter().map(|s| s.name).collect::<Vec<_>>().join(", "))
        })
    }
}

/// Every knob's description, in [`Knob::ALL`] order.
pub const SPECS: &[KnobSpec] = &[
    KnobSpec {
        name: "ram_adapt",
        default: 0.0,
        range: Range::Int(0, 4096),
        doc: "RAM promotions per decode window (0 = off)",
    },
    KnobSpec {
        name: "adapt_every",
        default: DEFAULT_ADAPT_EVERY as f64,
        range: Range::Int(0, 1 << 20),
        doc: "decode windows per adaptive round (0 = static)",
    },
    KnobSpec {
        name: "adapt_swaps",
        default: DEFAULT_ADAPT_SWAPS as f64,
        range: Range::Int(0, 1 << 20),
        doc: "VRAM swaps per adaptive round",
    },
    KnobSpec {
        name: "adapt_decay",
        default: 0.7, // policy::DEFAULT_ADAPT_DECAY, written in f64 (the f32 widened would read 0.699999988)
        range: Range::Real { min: 0.0, open_min: true, max: 1.0 },
        doc: "usage decay per round, in (0, 1]",
    },
    KnobSpec {
        name: "adapt_async",
        default: 0.0,
        range: Range::Int(0, 1),
        doc: "adaptive rounds on a helper thread (0/1)",
    },
    KnobSpec {
        name: "adapt_policy",
        default: DEFAULT_POLICY as usize as f64,
        range: Range::Choice(&POLICY_NAMES),
        doc: "placement policy of the adaptive tier: lrfu (recency-weighted frequency) or seed (the reference rule)",
    },
    KnobSpec {
        name: "vram_reserve_mib",
        default: 700.0,
        range: Range::Int(0, 1 << 24),
        doc: "VRAM kept free on the first card (MiB)",
    },
    KnobSpec {
        name: "vram_reserve_later_mib",
        default: 700.0,
        range: Range::Int(0, 1 << 24),
        doc: "VRAM kept free on later cards of a split (MiB)",
    },
    KnobSpec {
        name: "pcie_frac",
        default: 0.0,
        range: Range::Real { min: 0.0, open_min: false, max: 1.0 },
        doc: "share of a layer's misses computed on the GPU over PCIe",
    },
    KnobSpec {
        name: "pcie_auto",
        default: 0.0,
        range: Range::Int(0, 1),
        doc: "balance the PCIe share between link and CPU pool while decoding, from pcie_frac (0/1)",
    },
    KnobSpec {
        name: "pcie_prefill",
        default: DEFAULT_PCIE_PREFILL as f64,
        range: Range::Int(0, 1 << 20),
        doc: "prefill chunks of at least N tokens compute their missed experts on the GPU, uploading them whole over \
              PCIe (as many as the staging slots hold; the rest on the CPU pool); 0 = off",
    },
    KnobSpec {
        name: "route_tail_skip",
        default: 0.0,
        range: Range::Int(0, 1024),
        doc: "skip missed experts routed only at rank >= R (0 = off; lossy)",
    },
    KnobSpec {
        name: "prefetch",
        default: 0.0,
        range: Range::Int(0, 64),
        doc: "upload at most N of the next layer's predicted misses over PCIe while a layer computes (0 = off)",
    },
    KnobSpec {
        name: "expert_profile_save_every",
        default: 10.0,
        range: Range::Int(0, 1 << 20),
        doc: "minutes between profile saves (0 = only at shutdown)",
    },
];

/// The knobs whose tier this build has (the others are accepted and reported inactive).
pub const ACTIVE: &[Knob] = &[Knob::RamAdapt, Knob::AdaptEvery, Knob::AdaptDecay, Knob::ExpertProfileSaveEvery];

/// Knobs that act only when a GPU expert cache runs ([`GPU_TIER`]).
pub const GPU_ACTIVE: &[Knob] = &[
    Knob::AdaptSwaps,
    Knob::AdaptAsync,
    Knob::AdaptPolicy,
    Knob::PcieFrac,
    Knob::PcieAuto,
    Knob::PciePrefill,
    Knob::Prefetch,
];

/// Default of `pcie_prefill` (tokens): the smallest prefill chunk whose missed experts go over PCIe. Measured on
/// the H200 for the Qwen3-30B-A3B geometry (docs/BENCHMARKS.md, stop 20).
pub const DEFAULT_PCIE_PREFILL: usize = 16;

/// Why the daemon runs without a VRAM expert cache, when it does (the backend's one line, e.g. "no CUDA driver
/// (libcuda.so.1 not found): running on the CPU"); set once at start.
pub static GPU_STATUS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Set once a VRAM expert cache is attached (makes [`GPU_ACTIVE`] knobs active).
pub static GPU_TIER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn gpu_active(k: Knob) -> bool {
    GPU_ACTIVE.contains(&k) && GPU_TIER.load(Ordering::SeqCst)
}

/// Current knob values (f64 bits in atomics, one per [`SPECS`] entry).
#[derive(Debug)]
pub struct Knobs {
    values: Vec<AtomicU64>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs { values: SPECS.iter().map(|s| AtomicU64::new(s.default.to_bits())).collect() }
    }
}

/// Normalises a knob name: dashes to underscores.
pub fn normalize(name: &str) -> String {
    name.trim().replace('-', "_")
}

impl Knobs {
    /// Checks `v` for knob `k` without setting it. Errors: [`KnobError::Bad`] (not finite, not an integer for
    /// an integer knob, out of range), with the allowed range.
    pub fn check(k: Knob, v: f64) -> Result<f64, KnobError> {
        Self::check_shown(k, v, &v.to_string())
    }

    /// [`Knobs::check`], the value shown in errors as `shown` (what the client sent).
    fn check_shown(k: Knob, v: f64, shown: &str) -> Result<f64, KnobError> {
        let spec = k.spec();
        let bad = |msg: String| KnobError::Bad { name: spec.name.to_string(), msg };
        if !v.is_finite() {
            return Err(bad(format!("{shown:?} is not finite")));
        }
        match spec.range {
            Range::Int(lo, hi) => {
                if v.fract() != 0.0 || v < lo as f64 || v > hi as f64 {
                    return Err(bad(format!("must be an integer in {lo}..={hi}, got {shown}")));
                }
            }
            Range::Choice(names) => {
                if v.fract() != 0.0 || v < 0.0 || v >= names.len() as f64 {
                    return Err(bad(format!("must be one of {}, got {shown}", names.join(", "))));
                }
            }
            Range::Real { min, open_min, max } => {
                let low_ok = if open_min { v > min } else { v >= min };
                if !low_ok || v > max {
                    let l = if open_min { "(" } else { "[" };
                    return Err(bad(format!("must be in {l}{min}, {max}], got {shown}")));
                }
            }
        }
        Ok(v)
    }

    /// Parses and checks `value` for the knob called `name` without setting it: the edge's entry (text from a
    /// client or a flag). Returns the knob and the value. Errors: unknown knob, a value that is not a number or
    /// is out of range ([`KnobError`]).
    pub fn validate(name: &str, value: &str) -> Result<(Knob, f64), KnobError> {
        let k = Knob::parse(name)?;
        let by_name = match k.spec().range {
            Range::Choice(names) => names.iter().position(|n| *n == value.trim()).map(|i| i as f64),
            _ => None,
        };
        let v: f64 = match by_name {
            Some(v) => v,
            None => value.trim().parse().map_err(|_| KnobError::Bad {
                name: k.name().to_string(),
                msg: match k.spec().range {
                    Range::Choice(names) => format!("{value:?} is not one of {}", names.join(", ")),
                    _ => format!("{value:?} is not a number"),
                },
            })?,
        };
        Ok((k, Self::check_shown(k, v, value)?))
    }

    /// Sets the knob called `name` (dashes allowed) from text; returns `(knob, old, new)`. Errors: unknown knob
    /// or bad value ([`KnobError`]); nothing changes then.
    pub fn set(&self, name: &str, value: &str) -> Result<(Knob, f64, f64), KnobError> {
        let (k, v) = Self::validate(name, value)?;
        Ok((k, self.store(k, v), v))
    }

    /// Sets knob `k` to `v`; returns the old value. Errors: [`KnobError::Bad`] (see [`Knobs::check`]); nothing
    /// changes then.
    pub fn set_value(&self, k: Knob, v: f64) -> Result<f64, KnobError> {
        Ok(self.store(k, Self::check(k, v)?))
    }

    /// Stores a checked value; returns the old one.
    fn store(&self, k: Knob, v: f64) -> f64 {
        f64::from_bits(self.values[k as usize].swap(v.to_bits(), Ordering::SeqCst))
    }

    /// The value of knob `k`.
    pub fn value(&self, k: Knob) -> f64 {
        f64::from_bits(self.values[k as usize].load(Ordering::SeqCst))
    }

    /// Whether knob `k` acts in this build (its tier exists; the expert knobs also need an MoE model).
    pub fn is_active(k: Knob, has_experts: bool) -> bool {
        (ACTIVE.contains(&k) && (has_experts || k == Knob::ExpertProfileSaveEvery)) || gpu_active(k)
    }

    /// Why knob `k` does not act in this daemon (`None` when [`Knobs::is_active`]): a dense model, no VRAM expert
    /// cache (and why: the backend's line, [`GPU_STATUS`]), a knob read only at start, or one this engine
    /// accepts without implementing.
    pub fn inactive_reason(k: Knob, has_experts: bool) -> Option<String> {
        if Self::is_active(k, has_experts) {
            return None;
        }
        Some(match k {
            Knob::VramReserveMib | Knob::VramReserveLaterMib => {
                "read once, when the VRAM expert cache is sized at start (use the flag)".into()
            }
            Knob::RouteTailSkip => {
                "accepted for the reference engine's clients; this engine does not skip experts".into()
            }
            _ if !has_experts => "the model is dense (no experts)".into(),
            _ if !cfg!(feature = "cuda") => "this build has no GPU backend (built without the `cuda` feature)".into(),
            _ => match GPU_STATUS.get() {
                Some(why) => format!("no VRAM expert cache ({why})"),
                None => "no VRAM expert cache".into(),
            },
        })
    }

    /// Every knob with its value, in display order.
    pub fn all(&self) -> Vec<(Knob, f64)> {
        Knob::ALL.into_iter().map(|k| (k, self.value(k))).collect()
    }

    /// `ram_adapt` as a count.
    pub fn ram_adapt(&self) -> usize {
        self.value(Knob::RamAdapt) as usize
    }

    /// The adaptive tier's knobs.
    pub fn adapt(&self) -> AdaptKnobs {
        AdaptKnobs {
            every: self.value(Knob::AdaptEvery) as u32,
            swaps: self.value(Knob::AdaptSwaps) as u32,
            decay: self.value(Knob::AdaptDecay) as f32,
        }
    }

    /// The adaptive tier's placement policy.
    pub fn policy(&self) -> PolicyKind {
        PolicyKind::from_index(self.value(Knob::AdaptPolicy) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_ranges_and_changes_nothing_on_error() {
        let k = Knobs::default();
        assert_eq!(k.set("ram-adapt", "8").unwrap(), (Knob::RamAdapt, 0.0, 8.0));
        assert_eq!(k.ram_adapt(), 8);
        assert!(k.set("ram-adapt", "-1").is_err());
        assert!(k.set("ram_adapt", "1.5").is_err());
        assert!(k.set("adapt-decay", "2").is_err());
        assert!(k.set("adapt-decay", "0").is_err());
        assert!(k.set("adapt-decay", "nan").is_err());
        assert!(k.set("pcie-frac", "1.01").is_err());
        assert!(matches!(k.set("no-such", "1"), Err(KnobError::Unknown(..))));
        assert_eq!(k.ram_adapt(), 8);
        assert_eq!(k.adapt().decay, 0.7);
        k.set("adapt_decay", "1").unwrap();
        k.set("pcie_frac", "0").unwrap();
        assert_eq!(k.adapt().decay, 1.0);
        assert!(!Knobs::is_active(Knob::AdaptSwaps, true), "no GPU tier in a unit test");
        assert!(Knobs::is_active(Knob::RamAdapt, true) && !Knobs::is_active(Knob::RamAdapt, false));
        assert!(Knobs::is_active(Knob::ExpertProfileSaveEvery, false));
        assert_eq!(k.all().len(), SPECS.len());
        assert!(k.set_value(Knob::PcieFrac, 2.0).is_err());
        assert_eq!(k.value(Knob::PcieFrac), 0.0);
        // each variant names its own spec (the names the flags, strata-ctl and docs/KNOBS.md use)
        let names = [
            (Knob::RamAdapt, "ram_adapt"),
            (Knob::AdaptEvery, "adapt_every"),
            (Knob::AdaptSwaps, "adapt_swaps"),
            (Knob::AdaptDecay, "adapt_decay"),
            (Knob::AdaptAsync, "adapt_async"),
            (Knob::AdaptPolicy, "adapt_policy"),
            (Knob::VramReserveMib, "vram_reserve_mib"),
            (Knob::VramReserveLaterMib, "vram_reserve_later_mib"),
            (Knob::PcieFrac, "pcie_frac"),
            (Knob::PcieAuto, "pcie_auto"),
            (Knob::PciePrefill, "pcie_prefill"),
            (Knob::RouteTailSkip, "route_tail_skip"),
            (Knob::Prefetch, "prefetch"),
            (Knob::ExpertProfileSaveEvery, "expert_profile_save_every"),
        ];
        assert_eq!(names.len(), Knob::ALL.len());
        for (kn, name) in names {
            assert_eq!(kn.name(), name);
            assert_eq!(Knob::parse(&name.replace('_', "-")).unwrap(), kn);
        }
        assert_eq!(
            k.set("ram_adapt", "1e5").unwrap_err().to_string(),
            "ram_adapt: must be an integer in 0..=4096, got 1e5"
        );
        assert_eq!(Knob::ALL.len(), SPECS.len());
        // a knob of named choices: set by name or index, shown in errors with its names
        assert_eq!(k.policy(), PolicyKind::Lrfu);
        assert_eq!(k.set("adapt-policy", "seed").unwrap(), (Knob::AdaptPolicy, 0.0, 1.0));
        assert_eq!(k.policy(), PolicyKind::Seed);
        assert_eq!(k.set("adapt_policy", "0").unwrap().2, 0.0);
        assert_eq!(
            k.set("adapt_policy", "lru").unwrap_err().to_string(),
            "adapt_policy: \"lru\" is not one of lrfu, seed"
        );
        assert_eq!(
            k.set("adapt_policy", "2").unwrap_err().to_string(),
            "adapt_policy: must be one of lrfu, seed, got 2"
        );
        assert_eq!(k.policy(), PolicyKind::Lrfu);
    }
}
