//! The layer split (DESIGN.md §4, REFERENCE.md §6): a pipeline of GPU stages, each holding the dense weights, KV
//! cache and expert cache of a contiguous range of layers. This module is the arithmetic of it — the flags, their
//! checks, the stages' devices and the `auto` choice of split points — so it is tested without a GPU; the stages
//! themselves are `backend::cuda::pipeline`.
//!
//! `auto` (REFERENCE.md §6): each candidate split is scored by a predicted window time, `miss_ms · (1 − held
//! mass) + Σ_stage layers · layer_ms`, where stage `i` holds the hottest experts of its own layers (by the whole
//! profile's placement order) that fit its capacity after its layers' dense weights and KV, and the expert of
//! rank `r` in that order carries routed mass `(r + 1)^−1.2`. Two stages try every split point, three every pair;
//! more stages split the layers in proportion to capacity.

use std::ops::Range;
use std::str::FromStr;

/// `--layer-split`: the first layer of each stage after the first, or `auto`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerSplit {
    /// Chosen at load from free VRAM and the profile ([`auto_split`]).
    Auto,
    /// First layer of each later stage, as given (checked by [`check_points`]).
    At(Vec<usize>),
}

impl FromStr for LayerSplit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(LayerSplit::Auto);
        }
        let points = s
            .split(',')
            .map(|p| p.trim().parse::<usize>().map_err(|_| format!("`{p}` is not a layer number")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LayerSplit::At(points))
    }
}

/// A layer split the model or the machine cannot take (said at start, one line).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// A split point outside `1 .. n_layer − 1`.
    #[error("--layer-split {point}: a split point must be a layer in 1..{last} (the model has {n_layer} layers)", last = n_layer - 1)]
    OutOfRange {
        /// The point.
        point: usize,
        /// Layers of the model.
        n_layer: usize,
    },
    /// Points not strictly increasing.
    #[error("--layer-split {0}: split points must be strictly increasing (no repeats)")]
    Unsorted(String),
    /// Fewer devices named (or, none named, visible) than stages.
    #[error("{stages} stages need {stages} devices but --split-device names (or the driver sees) {named}")]
    TooFewDevices {
        /// Stages of the split.
        stages: usize,
        /// Devices named.
        named: usize,
    },
    /// More devices named than stages.
    #[error("--split-device names {named} devices for {stages} stages")]
    TooManyDevices {
        /// Stages of the split.
        stages: usize,
        /// Devices named.
        named: usize,
    },
    /// A device ordinal that does not exist.
    #[error("--split-device {ordinal}: no such CUDA device ({visible} visible)")]
    NoDevice {
        /// The ordinal.
        ordinal: usize,
        /// Devices the driver sees.
        visible: usize,
    },
    /// A split of a model with one layer.
    #[error("{0}")]
    Unusable(String),
}

/// Checks explicit split points against the model: each in `1 ..= n_layer − 1`, strictly increasing. Returns the
/// first layer of every stage (`0` followed by the points).
pub fn check_points(points: &[usize], n_layer: usize) -> Result<Vec<usize>, SplitError> {
    if n_layer < 2 {
        return Err(SplitError::Unusable(format!("--layer-split: a model of {n_layer} layer cannot be split")));
    }
    if let Some(&point) = points.iter().find(|&&p| p == 0 || p >= n_layer) {
        return Err(SplitError::OutOfRange { point, n_layer });
    }
    if points.windows(2).any(|w| w[0] >= w[1]) {
        let list = points.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(",");
        return Err(SplitError::Unsorted(list));
    }
    Ok(std::iter::once(0).chain(points.iter().copied()).collect())
}

/// The checks of the split flags that need no GPU: explicit points against a model of `n_layer` layers
/// ([`check_points`]) and, when devices are named, one per stage. `auto` and unnamed devices pass (they are
/// resolved when the GPU is found, [`stage_devices`] then checks the ordinals). Errors: as those two.
pub fn check_flags(split: Option<&LayerSplit>, devices: &[usize], n_layer: usize) -> Result<(), SplitError> {
    if let Some(LayerSplit::At(points)) = split {
        let starts = check_points(points, n_layer)?;
        if !devices.is_empty() {
            stage_devices(starts.len(), devices, usize::MAX)?;
        }
    }
    Ok(())
}

/// The device of each of `stages` stages: the ordinals named by `--split-device` (one per stage; the same one may
/// repeat — two stages on one card), or the first `stages` visible devices when none are named. Errors: a count
/// that does not match, an ordinal past the `visible` devices.
pub fn stage_devices(stages: usize, named: &[usize], visible: usize) -> Result<Vec<usize>, SplitError> {
    let devices: Vec<usize> = if named.is_empty() {
        if stages > visible {
            return Err(SplitError::TooFewDevices { stages, named: visible });
        }
        (0..stages).collect()
    } else if named.len() < stages {
        return Err(SplitError::TooFewDevices { stages, named: named.len() });
    } else if named.len() > stages {
        return Err(SplitError::TooManyDevices { stages, named: named.len() });
    } else {
        named.to_vec()
    };
    if let Some(&ordinal) = devices.iter().find(|&&d| d >= visible) {
        return Err(SplitError::NoDevice { ordinal, visible });
    }
    Ok(devices)
}

/// What [`auto_split`] knows of one stage's card.
#[derive(Debug, Clone, Copy)]
pub struct StageBudget {
    /// Bytes the stage may use on its card: free VRAM − reserve − the stage's fixed buffers (its share when
    /// several stages share the card).
    pub capacity: u64,
    /// Predicted milliseconds per layer of a decode token on the card ([`layer_ms`]).
    pub layer_ms: f64,
}

/// Predicted decode milliseconds per layer on a card of `sms` multiprocessors at `ghz`: REFERENCE.md §6's
/// `0.33 × (84 × 2.617) / (SMs × GHz)`.
pub fn layer_ms(sms: u32, ghz: f64) -> f64 {
    0.33 * (84.0 * 2.617) / (sms.max(1) as f64 * ghz.max(0.1))
}

/// Milliseconds a window loses per unit of routed mass that misses the VRAM caches (REFERENCE.md §6; override
/// with `STRATA_SPLIT_MISS_MS`).
pub const MISS_MS: f64 = 190.0;

/// The model as [`auto_split`] sees it.
#[derive(Debug, Clone)]
pub struct SplitModel<'a> {
    /// VRAM bytes of each layer's dense weights and KV cache.
    pub layer_bytes: &'a [u64],
    /// Bytes of one expert's slot.
    pub slot_bytes: u64,
    /// Experts per layer (0 for a dense model).
    pub n_expert: usize,
    /// Every expert, hottest first (the store's placement order: profile rank, then expert-major).
    pub hot: &'a [(usize, usize)],
}

/// A chosen split: the first layer of each stage, and the predicted window milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoSplit {
    /// First layer of each stage (`starts[0] == 0`).
    pub starts: Vec<usize>,
    /// Predicted decode milliseconds per token.
    pub predicted_ms: f64,
    /// Experts each stage's cache would hold.
    pub slots: Vec<usize>,
}

/// Chooses split points for `stages.len()` stages (see the module doc). `miss_ms`: [`MISS_MS`] unless overridden.
/// Returns `None` when there are fewer layers than stages.
pub fn auto_split(m: &SplitModel<'_>, stages: &[StageBudget], miss_ms: f64) -> Option<AutoSplit> {
    let n_layer = m.layer_bytes.len();
    let n = stages.len();
    if n == 0 || n_layer < n {
        return None;
    }
    let mut best: Option<AutoSplit> = None;
    let mut consider = |starts: Vec<usize>| {
        let (ms, slots) = predict(m, stages, &starts, miss_ms);
        if best.as_ref().is_none_or(|b| ms < b.predicted_ms - 1e-9) {
            best = Some(AutoSplit { starts, predicted_ms: ms, slots });
        }
    };
    match n {
        1 => consider(vec![0]),
        2 => (1..n_layer).for_each(|k| consider(vec![0, k])),
        3 => {
            for a in 1..n_layer {
                for b in a + 1..n_layer {
                    consider(vec![0, a, b]);
                }
            }
        }
        _ => {
            // in proportion to capacity
            let total: f64 = stages.iter().map(|s| s.capacity.max(1) as f64).sum();
            let mut starts = vec![0];
            let mut acc = 0.0;
            for s in &stages[..n - 1] {
                acc += s.capacity.max(1) as f64 / total;
                let prev = *starts.last().expect("nonempty");
                let k = ((acc * n_layer as f64).round() as usize).max(prev + 1);
                starts.push(k.min(n_layer - (n - starts.len())));
            }
            consider(starts)
        }
    }
    best
}

/// The predicted window milliseconds of `starts` and the slots each stage would fill.
fn predict(m: &SplitModel<'_>, stages: &[StageBudget], starts: &[usize], miss_ms: f64) -> (f64, Vec<usize>) {
    let n_layer = m.layer_bytes.len();
    let range = |i: usize| starts[i]..starts.get(i + 1).copied().unwrap_or(n_layer);
    let mut cap: Vec<usize> = (0..starts.len())
        .map(|i| {
            let session: u64 = m.layer_bytes[range(i)].iter().sum();
            let left = stages[i].capacity.saturating_sub(session);
            if m.slot_bytes == 0 {
                0
            } else {
                ((left / m.slot_bytes) as usize).min(range(i).len() * m.n_expert)
            }
        })
        .collect();
    let stage_of = |l: usize| starts.partition_point(|&s| s <= l) - 1;
    let (mut held, mut total) = (0.0, 0.0);
    let mut slots = vec![0; starts.len()];
    for (r, &(l, _)) in m.hot.iter().enumerate() {
        let mass = ((r + 1) as f64).powf(-1.2);
        total += mass;
        let i = stage_of(l);
        if cap[i] > 0 {
            cap[i] -= 1;
            slots[i] += 1;
            held += mass;
        }
    }
    let miss = if total > 0.0 { 1.0 - held / total } else { 0.0 };
    let compute: f64 = (0..starts.len()).map(|i| range(i).len() as f64 * stages[i].layer_ms).sum();
    // a stage whose dense weights do not fit is no candidate
    let over = (0..starts.len()).any(|i| m.layer_bytes[range(i)].iter().sum::<u64>() > stages[i].capacity);
    (if over { f64::INFINITY } else { miss_ms * miss + compute }, slots)
}

/// The layers of each stage given their first layers.
pub fn stage_ranges(starts: &[usize], n_layer: usize) -> Vec<Range<usize>> {
    (0..starts.len()).map(|i| starts[i]..starts.get(i + 1).copied().unwrap_or(n_layer)).collect()
}

/// Shares `total` slots among stages in proportion to `weights` (each stage's experts), largest remainders
/// first, never more than a stage's weight.
pub fn share_slots(total: usize, weights: &[usize]) -> Vec<usize> {
    let sum: usize = weights.iter().sum();
    if sum == 0 {
        return vec![0; weights.len()];
    }
    let total = total.min(sum);
    let mut out: Vec<usize> = weights.iter().map(|&w| total * w / sum).collect();
    let mut rest = total - out.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse((total * weights[i]) % sum));
    for i in order.into_iter().cycle().take(weights.len() * 2) {
        if rest == 0 {
            break;
        }
        if out[i] < weights[i] {
            out[i] += 1;
            rest -= 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_checks_points() {
        assert_eq!("auto".parse::<LayerSplit>(), Ok(LayerSplit::Auto));
        assert_eq!("12, 24".parse::<LayerSplit>(), Ok(LayerSplit::At(vec![12, 24])));
        assert!("12,x".parse::<LayerSplit>().is_err());
        assert!("-1".parse::<LayerSplit>().is_err());
        assert_eq!(check_points(&[12, 24], 48), Ok(vec![0, 12, 24]));
        assert_eq!(check_points(&[47], 48), Ok(vec![0, 47]));
        assert_eq!(check_points(&[0], 48), Err(SplitError::OutOfRange { point: 0, n_layer: 48 }));
        assert_eq!(check_points(&[48], 48), Err(SplitError::OutOfRange { point: 48, n_layer: 48 }));
        assert!(matches!(check_points(&[24, 12], 48), Err(SplitError::Unsorted(_))));
        assert!(matches!(check_points(&[12, 12], 48), Err(SplitError::Unsorted(_))));
        assert!(matches!(check_points(&[1], 1), Err(SplitError::Unusable(_))));
        let e = check_points(&[48], 48).unwrap_err().to_string();
        assert!(e.contains("1..47") && e.contains("48 layers"), "{e}");
    }

    #[test]
    fn devices_per_stage() {
        assert_eq!(stage_devices(2, &[], 2), Ok(vec![0, 1]));
        assert_eq!(stage_devices(2, &[0, 0], 1), Ok(vec![0, 0]));
        assert_eq!(stage_devices(2, &[], 1), Err(SplitError::TooFewDevices { stages: 2, named: 1 }));
        assert_eq!(stage_devices(3, &[0, 1], 4), Err(SplitError::TooFewDevices { stages: 3, named: 2 }));
        assert_eq!(stage_devices(2, &[0, 1, 2], 4), Err(SplitError::TooManyDevices { stages: 2, named: 3 }));
        assert_eq!(stage_devices(2, &[0, 3], 2), Err(SplitError::NoDevice { ordinal: 3, visible: 2 }));
    }

    fn hot(n_layer: usize, ne: usize) -> Vec<(usize, usize)> {
        // expert-major across layers, as the store orders experts without a profile
        (0..ne).flat_map(|e| (0..n_layer).map(move |l| (l, e))).collect()
    }

    #[test]
    fn auto_balances_two_equal_cards() {
        let (nl, ne) = (8, 16);
        let layer_bytes = vec![100u64; nl];
        let hot = hot(nl, ne);
        let m = SplitModel { layer_bytes: &layer_bytes, slot_bytes: 10, n_expert: ne, hot: &hot };
        // each card: 400 bytes of dense (up to 4 layers) and 400 of experts only when balanced
        let cards = [StageBudget { capacity: 800, layer_ms: 1.0 }; 2];
        let a = auto_split(&m, &cards, MISS_MS).unwrap();
        assert_eq!(a.starts, vec![0, 4]);
        assert_eq!(a.slots, vec![40, 40]);
        // a card with more room takes more layers' dense weights and still holds experts
        let cards = [StageBudget { capacity: 1600, layer_ms: 1.0 }, StageBudget { capacity: 400, layer_ms: 1.0 }];
        let a = auto_split(&m, &cards, MISS_MS).unwrap();
        assert!(a.starts[1] >= 4, "{a:?}");
        assert!(a.predicted_ms.is_finite());
        // dense weights that fit on no split: no finite candidate is better than infinite
        let cards = [StageBudget { capacity: 100, layer_ms: 1.0 }; 2];
        assert!(auto_split(&m, &cards, MISS_MS).unwrap().predicted_ms.is_infinite());
    }

    #[test]
    fn auto_with_three_and_five_stages() {
        let (nl, ne) = (12, 4);
        let layer_bytes = vec![10u64; nl];
        let hot = hot(nl, ne);
        let m = SplitModel { layer_bytes: &layer_bytes, slot_bytes: 10, n_expert: ne, hot: &hot };
        let a = auto_split(&m, &[StageBudget { capacity: 1000, layer_ms: 1.0 }; 3], MISS_MS).unwrap();
        assert_eq!(a.starts.len(), 3);
        assert_eq!(a.slots.iter().sum::<usize>(), nl * ne, "everything fits");
        let a = auto_split(&m, &[StageBudget { capacity: 1000, layer_ms: 1.0 }; 5], MISS_MS).unwrap();
        assert_eq!(a.starts.len(), 5);
        assert!(a.starts.windows(2).all(|w| w[0] < w[1]) && *a.starts.last().unwrap() < nl, "{a:?}");
        assert!(auto_split(&m, &[StageBudget { capacity: 1, layer_ms: 1.0 }; 13], MISS_MS).is_none());
    }

    #[test]
    fn shares_slots_by_weight() {
        assert_eq!(share_slots(8, &[6, 2]), vec![6, 2]);
        assert_eq!(share_slots(4, &[6, 2]), vec![3, 1]);
        assert_eq!(share_slots(10, &[3, 1]), vec![3, 1]);
        assert_eq!(share_slots(7, &[1, 1]).iter().sum::<usize>(), 2);
        assert_eq!(share_slots(5, &[4, 4]).iter().sum::<usize>(), 5);
        assert_eq!(share_slots(0, &[4, 4]), vec![0, 0]);
        assert_eq!(share_slots(3, &[0, 0]), vec![0, 0]);
    }
}
