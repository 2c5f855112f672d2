//! Live knobs (DESIGN.md §7): values the control plane reads and changes while the daemon runs. Each knob has a
//! range; a bad value is refused and changes nothing. The engine reads them between windows, so a change takes
//! effect at the next window. Knobs whose tier this build lacks are accepted and reported as inactive.

use std::sync::atomic::{AtomicU64, Ordering};

use super::policy::{AdaptKnobs, DEFAULT_ADAPT_EVERY, DEFAULT_ADAPT_SWAPS};

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

/// Every knob, in display order.
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
        name: "route_tail_skip",
        default: 0.0,
        range: Range::Int(0, 1024),
        doc: "skip missed experts routed only at rank >= R (0 = off; lossy)",
    },
    KnobSpec {
        name: "expert_profile_save_every",
        default: 10.0,
        range: Range::Int(0, 1 << 20),
        doc: "minutes between profile saves (0 = only at shutdown)",
    },
];

/// Names of the knobs whose tier this build has (the others are accepted and reported inactive).
pub const ACTIVE: &[&str] = &["ram_adapt", "adapt_every", "adapt_decay", "expert_profile_save_every"];

/// Knobs that act only when a GPU expert cache runs ([`GPU_TIER`]).
pub const GPU_ACTIVE: &[&str] = &["adapt_swaps", "adapt_async", "pcie_frac", "pcie_auto"];

/// Set once a VRAM expert cache is attached (makes [`GPU_ACTIVE`] knobs active).
pub static GPU_TIER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn gpu_active(name: &str) -> bool {
    GPU_ACTIVE.contains(&name) && GPU_TIER.load(Ordering::SeqCst)
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
    fn index(&self, name: &str) -> Result<usize, KnobError> {
        let n = normalize(name);
        SPECS.iter().position(|s| s.name == n).ok_or_else(|| {
            KnobError::Unknown(name.to_string(), SPECS.iter().map(|s| s.name).collect::<Vec<_>>().join(", "))
        })
    }

    /// Checks `value` for knob `name` without setting it; returns the parsed value.
    pub fn validate(&self, name: &str, value: &str) -> Result<f64, KnobError> {
        let spec = &SPECS[self.index(name)?];
        let bad = |msg: String| KnobError::Bad { name: spec.name.to_string(), msg };
        let v: f64 = value.trim().parse().map_err(|_| bad(format!("{value:?} is not a number")))?;
        if !v.is_finite() {
            return Err(bad(format!("{value:?} is not finite")));
        }
        match spec.range {
            Range::Int(lo, hi) => {
                if v.fract() != 0.0 || v < lo as f64 || v > hi as f64 {
                    return Err(bad(format!("must be an integer in {lo}..={hi}, got {value}")));
                }
            }
            Range::Real { min, open_min, max } => {
                let low_ok = if open_min { v > min } else { v >= min };
                if !low_ok || v > max {
                    let l = if open_min { "(" } else { "[" };
                    return Err(bad(format!("must be in {l}{min}, {max}], got {value}")));
                }
            }
        }
        Ok(v)
    }

    /// Sets knob `name` (dashes allowed) from text; returns `(name, old, new)`. Errors: unknown knob or bad
    /// value ([`KnobError`]); nothing changes then.
    pub fn set(&self, name: &str, value: &str) -> Result<(&'static str, f64, f64), KnobError> {
        let v = self.validate(name, value)?;
        let i = self.index(name)?;
        let old = f64::from_bits(self.values[i].swap(v.to_bits(), Ordering::SeqCst));
        Ok((SPECS[i].name, old, v))
    }

    /// Value of knob `name`. Errors: unknown knob.
    pub fn get(&self, name: &str) -> Result<f64, KnobError> {
        Ok(f64::from_bits(self.values[self.index(name)?].load(Ordering::SeqCst)))
    }

    /// Whether knob `name` acts in this build (its tier exists; the expert knobs also need an MoE model).
    pub fn is_active(name: &str, has_experts: bool) -> bool {
        (ACTIVE.contains(&name) && (has_experts || name == "expert_profile_save_every")) || gpu_active(name)
    }

    /// Every knob: spec, value, and whether its tier exists in this build.
    pub fn all(&self) -> Vec<(KnobSpec, f64, bool)> {
        SPECS
            .iter()
            .zip(&self.values)
            .map(|(s, v)| {
                (*s, f64::from_bits(v.load(Ordering::SeqCst)), ACTIVE.contains(&s.name) || gpu_active(s.name))
            })
            .collect()
    }

    fn value(&self, name: &str) -> f64 {
        self.get(name).expect("known knob")
    }

    /// `ram_adapt` as a count.
    pub fn ram_adapt(&self) -> usize {
        self.value("ram_adapt") as usize
    }

    /// The adaptive tier's knobs.
    pub fn adapt(&self) -> AdaptKnobs {
        AdaptKnobs {
            every: self.value("adapt_every") as u32,
            swaps: self.value("adapt_swaps") as u32,
            decay: self.value("adapt_decay") as f32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_ranges_and_changes_nothing_on_error() {
        let k = Knobs::default();
        assert_eq!(k.set("ram-adapt", "8").unwrap(), ("ram_adapt", 0.0, 8.0));
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
        assert!(k.all().iter().any(|(s, _, active)| s.name == "adapt_swaps" && !active));
    }
}
