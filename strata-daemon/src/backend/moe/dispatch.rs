//! Dispatch: a layer's routing entries grouped by expert, and where each routed expert's bytes are.

use crate::tiers::store::{ExpertStore, Source};

/// Groups routing entries by expert: `out[e]` = `(token, weight)` of every entry of `routes` (per token,
/// `(expert, weight)` pairs) routed to `e`, in token order. `n_expert` sizes the result; an expert id at or
/// above it panics.
pub fn by_expert(routes: &[Vec<(usize, f32)>], n_expert: usize) -> Vec<Vec<(usize, f32)>> {
    let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n_expert];
    for (i, r) in routes.iter().enumerate() {
        for &(x, w) in r {
            by_expert[x].push((i, w));
        }
    }
    by_expert
}

/// Where each routed expert of `layer` is (per expert of `by_expert`; unrouted ones and every expert without a
/// store `Mapped`): a VRAM slot, the RAM copy, a blob read from the file, or the mapping. The store counts the
/// lookups (and, in a decode window, the usage) in its counters. `routes` is the routing `by_expert` was grouped
/// from (per token, `(expert, weight)` by rank): the store is given the routed experts in the order it names them
/// (token by token, each token's by rank), the order of use within a window that the `lrfu` policy's recency
/// keeps (a token's higher-ranked expert counts as used later, as `replay`'s LRU has it).
pub fn plan_sources(
    store: Option<&ExpertStore>,
    layer: usize,
    routes: &[Vec<(usize, f32)>],
    by_expert: &[Vec<(usize, f32)>],
    decode: bool,
) -> Vec<Source> {
    let ne = by_expert.len();
    let mut src = vec![Source::Mapped; ne];
    if let Some(st) = store {
        let mut seen = vec![false; ne];
        let distinct: Vec<usize> =
            routes.iter().flatten().map(|&(x, _)| x).filter(|&x| !std::mem::replace(&mut seen[x], true)).collect();
        let entries: Vec<u32> = distinct.iter().map(|&x| by_expert[x].len() as u32).collect();
        for (&x, so) in distinct.iter().zip(st.plan_layer(layer, &distinct, &entries, decode)) {
            src[x] = so;
        }
    }
    src
}
