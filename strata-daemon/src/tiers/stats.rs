//! Statistics of a routing trace: one-token reuse and per-layer skew.

use serde::Serialize;

use super::replay::Trace;

/// Skew of one layer: the share of routing entries taken by its hottest experts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerSkew {
    /// Layer index.
    pub layer: usize,
    /// Routing entries (token, expert) counted at this layer.
    pub entries: u64,
    /// Share held by the hottest ⌊0.10·E⌋ experts (at least one), in [0, 1].
    pub top10: f64,
    /// Share held by the hottest ⌊0.25·E⌋ experts (at least one), in [0, 1].
    pub top25: f64,
}

/// Trace statistics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceStats {
    /// Windows (tokens) in the trace.
    pub windows: usize,
    /// Probability that an expert a token uses at a layer is used by the next token of the same request at
    /// that layer (pairs of consecutive positions only); uniform routing gives top_k / n_expert.
    pub reuse_next_token: f64,
    /// top_k / n_expert: the reuse probability of uniform random routing.
    pub reuse_uniform: f64,
    /// Per-layer skew.
    pub layers: Vec<LayerSkew>,
}

/// Share of the sum of `counts` held by its largest `frac · len` values (floor, at least one).
/// The convention of the OLMoE routing analysis (64 experts: top 10% = 6 experts, top 25% = 16).
pub fn top_share(counts: &[u64], frac: f64) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 || counts.is_empty() {
        return 0.0;
    }
    let mut c = counts.to_vec();
    c.sort_unstable_by(|a, b| b.cmp(a));
    let n = ((frac * c.len() as f64).floor() as usize).max(1);
    c[..n].iter().sum::<u64>() as f64 / total as f64
}

/// Computes reuse and skew over the trace's windows.
pub fn trace_stats(t: &Trace) -> TraceStats {
    let mut counts = vec![vec![0u64; t.n_expert]; t.n_layer];
    let (mut reused, mut pairs) = (0u64, 0u64);
    for (i, w) in t.windows.iter().enumerate() {
        for (l, ids) in w.layers.iter().enumerate() {
            for &e in ids {
                counts[l][e as usize] += 1;
            }
        }
        if let Some(next) = t.windows.get(i + 1) {
            if next.seq == w.seq && next.pos == w.pos + 1 {
                for (a, b) in w.layers.iter().zip(&next.layers) {
                    if b.is_empty() {
                        continue;
                    }
                    pairs += a.len() as u64;
                    reused += a.iter().filter(|e| b.contains(e)).count() as u64;
                }
            }
        }
    }
    let layers = counts
        .iter()
        .enumerate()
        .map(|(layer, c)| LayerSkew {
            layer,
            entries: c.iter().sum(),
            top10: top_share(c, 0.10),
            top25: top_share(c, 0.25),
        })
        .collect();
    TraceStats {
        windows: t.windows.len(),
        reuse_next_token: if pairs == 0 { 0.0 } else { reused as f64 / pairs as f64 },
        reuse_uniform: if t.n_expert == 0 { 0.0 } else { t.top_k as f64 / t.n_expert as f64 },
        layers,
    }
}
