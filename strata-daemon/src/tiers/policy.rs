//! Placement policy, pure and shared by the engine and `strata-tools replay`: per-expert usage with decay and
//! heat, RAM adapt's rule, the choice of the adaptive tier's policy ([`PolicyKind`]: the seed rule below or
//! [`super::lrfu`]), and the seed rule.
//!
//! Seed rule (DESIGN.md §5; REFERENCE.md §4, the C++ engine's serve loop): every
//! `adapt_every` decode windows, per layer, candidates = experts outside the
//! cache with usage ≥ [`CANDIDATE_MIN_USAGE`], hottest first; victims = cached
//! experts, coldest first (an empty slot is the coldest victim, usage 0);
//! the i-th candidate pairs with the i-th victim while
//! `cand ≥ vict + SWAP_MARGIN`; all layers' pairs are sorted by gain
//! (`cand − vict`, largest first) and cut to `adapt_swaps`; then every usage
//! is multiplied by `adapt_decay` (heat first accumulates the usage).

/// Smallest usage an expert needs to be swapped in (REFERENCE.md §4).
pub const CANDIDATE_MIN_USAGE: f32 = 2.0;
/// A candidate replaces a victim only when its usage exceeds the victim's by this much (REFERENCE.md §4).
pub const SWAP_MARGIN: f32 = 1.5;

/// Default decode windows per adaptive round of the seed rule and per usage decay (`--adapt-every`; REFERENCE.md
/// §4). [`PolicyKind::Lrfu`] plans every window whatever its value (its scores age per window; rounds further
/// apart lose the recency it lives on); 0 stops both (static placement).
pub const DEFAULT_ADAPT_EVERY: u32 = 4;

/// The adaptive tier's placement policy (`--adapt-policy`, live knob `adapt_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Recency-weighted frequency with its decay and admission chosen online ([`super::lrfu`]); the default.
    Lrfu = 0,
    /// The seed rule of this module (the reference engine's), every `adapt_every` windows.
    Seed = 1,
}

/// Policy names by [`PolicyKind`] index.
pub const POLICY_NAMES: [&str; 2] = ["lrfu", "seed"];

/// The default policy: chosen by replaying the fixtures' routing and traces built from published counts
/// (docs/FIXTURES.md).
pub const DEFAULT_POLICY: PolicyKind = PolicyKind::Lrfu;

impl PolicyKind {
    /// The policy of index `i` in [`POLICY_NAMES`] (an index out of range gives the default).
    pub fn from_index(i: usize) -> PolicyKind {
        match i {
            1 => PolicyKind::Seed,
            0 => PolicyKind::Lrfu,
            _ => DEFAULT_POLICY,
        }
    }

    /// Its name (`lrfu`, `seed`).
    pub fn name(self) -> &'static str {
        POLICY_NAMES[self as usize]
    }
}
/// Default swaps per adaptive round (`--adapt-swaps`; REFERENCE.md §4).
pub const DEFAULT_ADAPT_SWAPS: u32 = 96;
/// Default usage decay per round (`--adapt-decay`; REFERENCE.md §4).
pub const DEFAULT_ADAPT_DECAY: f32 = 0.7;

/// Errors from knob validation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// A knob value outside its range; the message names the knob and the range.
    #[error("{0}")]
    BadKnob(String),
}

/// The adaptive tier's knobs (DESIGN.md §4 flags `--adapt-every`, `--adapt-swaps`, `--adapt-decay`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptKnobs {
    /// Decode windows per round; 0 = static placement (no rounds). Default 4.
    pub every: u32,
    /// Most swaps per round, all layers together; 0 = static. Default 96.
    pub swaps: u32,
    /// Factor applied to every usage after a round, in (0, 1]. Default 0.7.
    pub decay: f32,
}

impl Default for AdaptKnobs {
    fn default() -> Self {
        AdaptKnobs { every: DEFAULT_ADAPT_EVERY, swaps: DEFAULT_ADAPT_SWAPS, decay: DEFAULT_ADAPT_DECAY }
    }
}

impl AdaptKnobs {
    /// Checks the ranges: `decay` in (0, 1] and finite. Errors: [`PolicyError::BadKnob`].
    pub fn validate(&self) -> Result<(), PolicyError> {
        validate_decay(self.decay)
    }

    /// Whether rounds run at all (`every > 0` and `swaps > 0`).
    pub fn active(&self) -> bool {
        self.every > 0 && self.swaps > 0
    }
}

/// Checks an `adapt_decay` value: finite and in (0, 1]. Errors: [`PolicyError::BadKnob`].
pub fn validate_decay(decay: f32) -> Result<(), PolicyError> {
    if decay.is_finite() && decay > 0.0 && decay <= 1.0 {
        Ok(())
    } else {
        Err(PolicyError::BadKnob(format!("adapt_decay must be in (0, 1], got {decay}")))
    }
}

/// Decayed routing counts per expert (`usage`) and their running sum before each decay (`heat`), for
/// `n_layer × n_expert` experts indexed `layer * n_expert + expert`.
#[derive(Debug, Clone)]
pub struct Usage {
    n_layer: usize,
    n_expert: usize,
    usage: Vec<f32>,
    heat: Vec<f64>,
}

impl Usage {
    /// All zero.
    pub fn new(n_layer: usize, n_expert: usize) -> Self {
        Usage { n_layer, n_expert, usage: vec![0.0; n_layer * n_expert], heat: vec![0.0; n_layer * n_expert] }
    }

    /// Layers.
    pub fn n_layer(&self) -> usize {
        self.n_layer
    }

    /// Experts per layer.
    pub fn n_expert(&self) -> usize {
        self.n_expert
    }

    /// Counts one routing entry (one token routed to `expert` at `layer`). Panics on an index out of range.
    pub fn record(&mut self, layer: usize, expert: usize) {
        assert!(layer < self.n_layer && expert < self.n_expert, "expert ({layer}, {expert}) out of range");
        self.usage[layer * self.n_expert + expert] += 1.0;
    }

    /// Current decayed usage of `(layer, expert)`.
    pub fn usage(&self, layer: usize, expert: usize) -> f32 {
        self.usage[layer * self.n_expert + expert]
    }

    /// Heat of `(layer, expert)`: the sum of its usage before each decay, plus its current usage.
    pub fn heat(&self, layer: usize, expert: usize) -> f64 {
        let i = layer * self.n_expert + expert;
        self.heat[i] + self.usage[i] as f64
    }

    /// One layer's usage, indexed by expert.
    pub fn layer(&self, layer: usize) -> &[f32] {
        &self.usage[layer * self.n_expert..(layer + 1) * self.n_expert]
    }

    /// Adds every usage to its heat, then multiplies every usage by `decay`.
    pub fn decay(&mut self, decay: f32) {
        for (u, h) in self.usage.iter_mut().zip(self.heat.iter_mut()) {
            *h += *u as f64;
            *u *= decay;
        }
    }
}

/// One planned move of the adaptive tier: `incoming` takes the place of `outgoing` (or of a free slot) in
/// `layer`'s cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Swap {
    /// Layer of both experts.
    pub layer: usize,
    /// Expert leaving the cache; `None` = an empty slot is filled.
    pub outgoing: Option<usize>,
    /// Expert entering the cache.
    pub incoming: usize,
    /// `usage(incoming) − usage(outgoing)` for the seed rule, the score difference for `lrfu` (outgoing 0 for an
    /// empty slot; negative where `lrfu`'s demand admission brings in an expert over a higher-scored one).
    pub gain: f32,
}

/// Plans one adaptive round. `cached(layer)` lists the experts the cache holds for `layer`;
/// `free(layer)` is the number of empty slots that layer may fill. Returns at most `max_swaps` swaps,
/// largest gain first (ties: lower layer, then higher-ranked pair first). Does not decay: call
/// [`Usage::decay`] after applying.
pub fn plan_adaptive_round(
    usage: &Usage,
    cached: impl Fn(usize) -> Vec<usize>,
    free: impl Fn(usize) -> usize,
    max_swaps: usize,
) -> Vec<Swap> {
    let mut pairs: Vec<(Swap, usize)> = Vec::new();
    for layer in 0..usage.n_layer() {
        let u = usage.layer(layer);
        let held = cached(layer);
        let mut in_cache = vec![false; u.len()];
        for &e in &held {
            in_cache[e] = true;
        }
        let mut cand: Vec<usize> = (0..u.len()).filter(|&e| !in_cache[e] && u[e] >= CANDIDATE_MIN_USAGE).collect();
        if cand.is_empty() {
            continue;
        }
        // hottest first; ties: lower expert id first (deterministic)
        cand.sort_by(|&a, &b| u[b].total_cmp(&u[a]).then(a.cmp(&b)));
        let mut vict: Vec<(Option<usize>, f32)> = vec![(None, 0.0); free(layer)];
        let mut held_sorted = held.clone();
        held_sorted.sort_by(|&a, &b| u[a].total_cmp(&u[b]).then(a.cmp(&b)));
        vict.extend(held_sorted.into_iter().map(|e| (Some(e), u[e])));
        for (rank, (&c, &(v, vu))) in cand.iter().zip(vict.iter()).enumerate() {
            if u[c] < vu + SWAP_MARGIN {
                break;
            }
            pairs.push((Swap { layer, outgoing: v, incoming: c, gain: u[c] - vu }, rank));
        }
    }
    pairs.sort_by(|(a, ra), (b, rb)| b.gain.total_cmp(&a.gain).then(a.layer.cmp(&b.layer)).then(ra.cmp(rb)));
    pairs.truncate(max_swaps);
    pairs.into_iter().map(|(s, _)| s).collect()
}

/// Usage a RAM expert must stay under to be moved out by RAM adapt (seed 000: "below 0.5").
pub const RAM_ADAPT_OUT_MAX_USAGE: f32 = 0.5;

/// One planned RAM promotion: file-tier expert `incoming` is read into the RAM place of `outgoing`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Promotion {
    /// Layer of both experts.
    pub layer: usize,
    /// File-tier expert moving into RAM.
    pub incoming: usize,
    /// RAM expert giving its place back (it returns to the file tier).
    pub outgoing: usize,
    /// `usage(incoming) − usage(outgoing)`.
    pub gain: f32,
}

/// Plans RAM adapt for one decode window (DESIGN.md §5, seed 000): per layer, the file-tier expert with the
/// highest usage (≥ [`CANDIDATE_MIN_USAGE`]) and the RAM expert with the lowest (< [`RAM_ADAPT_OUT_MAX_USAGE`])
/// form a pair; pairs are taken largest difference first, at most `n`. `in_ram(layer, expert)` says whether an
/// expert has a RAM place; `eligible(layer, expert)` excludes experts another tier holds (e.g. a VRAM slot) from
/// both roles. Ties: lower expert id, then lower layer.
pub fn plan_ram_adapt(
    usage: &Usage,
    in_ram: impl Fn(usize, usize) -> bool,
    eligible: impl Fn(usize, usize) -> bool,
    n: usize,
) -> Vec<Promotion> {
    if n == 0 {
        return Vec::new();
    }
    let mut pairs = Vec::new();
    for layer in 0..usage.n_layer() {
        let u = usage.layer(layer);
        let (mut best_in, mut best_out): (Option<usize>, Option<usize>) = (None, None);
        for (e, &v) in u.iter().enumerate() {
            if !eligible(layer, e) {
                continue;
            }
            if in_ram(layer, e) {
                if v < RAM_ADAPT_OUT_MAX_USAGE && best_out.is_none_or(|o| v < u[o]) {
                    best_out = Some(e);
                }
            } else if v >= CANDIDATE_MIN_USAGE && best_in.is_none_or(|i| v > u[i]) {
                best_in = Some(e);
            }
        }
        if let (Some(i), Some(o)) = (best_in, best_out) {
            pairs.push(Promotion { layer, incoming: i, outgoing: o, gain: u[i] - u[o] });
        }
    }
    pairs.sort_by(|a, b| b.gain.total_cmp(&a.gain).then(a.layer.cmp(&b.layer)));
    pairs.truncate(n);
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage_of(rows: &[&[f32]]) -> Usage {
        let mut u = Usage::new(rows.len(), rows[0].len());
        for (l, r) in rows.iter().enumerate() {
            for (e, &v) in r.iter().enumerate() {
                u.usage[l * u.n_expert + e] = v;
            }
        }
        u
    }

    #[test]
    fn pairs_hottest_candidate_with_coldest_victim_and_stops_at_margin() {
        // layer 0: cached {0, 1} with usage 0.5, 3.0; candidates 2 (5.0), 3 (4.0), 4 (2.5)
        let u = usage_of(&[&[0.5, 3.0, 5.0, 4.0, 2.5]]);
        let s = plan_adaptive_round(&u, |_| vec![0, 1], |_| 0, 10);
        // 5.0 vs 0.5 -> swap (gain 4.5); 4.0 vs 3.0 -> 4.0 < 4.5 -> stop
        assert_eq!(s, vec![Swap { layer: 0, outgoing: Some(0), incoming: 2, gain: 4.5 }]);
    }

    #[test]
    fn candidates_need_usage_two() {
        let u = usage_of(&[&[0.0, 1.99, 0.0]]);
        assert!(plan_adaptive_round(&u, |_| vec![0], |_| 0, 10).is_empty());
        let u = usage_of(&[&[0.0, 2.0, 0.0]]);
        assert_eq!(plan_adaptive_round(&u, |_| vec![0], |_| 0, 10).len(), 1);
    }

    #[test]
    fn empty_slots_are_filled_first_and_swaps_are_capped_by_gain() {
        let u = usage_of(&[&[9.0, 3.0, 0.0, 0.0], &[0.0, 0.0, 7.0, 4.0]]);
        // layer 0: one free slot, nothing cached; layer 1: expert 0 cached (usage 0), no free slot
        let cached = |l: usize| if l == 1 { vec![0] } else { vec![] };
        let free = |l: usize| if l == 0 { 1 } else { 0 };
        let s = plan_adaptive_round(&u, cached, free, 2);
        assert_eq!(
            s,
            vec![
                Swap { layer: 0, outgoing: None, incoming: 0, gain: 9.0 },
                Swap { layer: 1, outgoing: Some(0), incoming: 2, gain: 7.0 },
            ]
        );
        assert_eq!(plan_adaptive_round(&u, cached, free, 1).len(), 1);
    }

    #[test]
    fn ram_adapt_pairs_hottest_file_expert_with_coldest_ram_expert() {
        // layer 0: RAM {0, 1} usage 0.4, 0.1; file {2: 5.0, 3: 2.5}
        // layer 1: RAM {0: 0.6 (not cold enough), 1: 3.0}; file {2: 9.0}
        // layer 2: RAM {0: 0.0}; file {1: 1.9 (under the floor)}
        let u = usage_of(&[&[0.4, 0.1, 5.0, 2.5], &[0.6, 3.0, 9.0, 0.0], &[0.0, 1.9, 0.0, 0.0]]);
        let ram = |l: usize, e: usize| if l == 2 { e == 0 } else { e < 2 };
        let key = |p: &[Promotion]| p.iter().map(|p| (p.layer, p.incoming, p.outgoing)).collect::<Vec<_>>();
        let p = plan_ram_adapt(&u, ram, |_, _| true, 8);
        assert_eq!(key(&p), vec![(0, 2, 1)]);
        assert!((p[0].gain - 4.9).abs() < 1e-6);
        // n = 0: nothing
        assert!(plan_ram_adapt(&u, ram, |_, _| true, 0).is_empty());
        // excluded experts take no part
        let p = plan_ram_adapt(&u, ram, |l, e| !(l == 0 && e == 2), 8);
        assert_eq!(key(&p), vec![(0, 3, 1)]);
    }

    #[test]
    fn ram_adapt_takes_largest_differences_first_up_to_n() {
        let u = usage_of(&[&[0.0, 3.0], &[0.0, 7.0], &[0.2, 5.0]]);
        let ram = |_: usize, e: usize| e == 0;
        let p = plan_ram_adapt(&u, ram, |_, _| true, 2);
        assert_eq!(p.iter().map(|p| p.layer).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn decay_accumulates_heat() {
        let mut u = Usage::new(1, 2);
        u.record(0, 1);
        u.record(0, 1);
        u.decay(0.5);
        assert_eq!(u.usage(0, 1), 1.0);
        assert_eq!(u.heat(0, 1), 3.0);
        assert!(validate_decay(2.0).is_err() && validate_decay(0.0).is_err() && validate_decay(1.0).is_ok());
    }
}
