//! The `lrfu` placement policy: recency-weighted frequency (LRFU, Lee et al., "LRFU: a spectrum of policies
//! that subsumes the least recently used and least frequently used policies", IEEE ToC 2001) with its decay
//! chosen online per layer by shadow caches (the idea of ARC and LeCaR: keep the cheap metadata of a few
//! candidate policies and follow the one that would have hit most lately).
//!
//! Each expert's score is `Σ λ^age` over the windows that used it (`age` in decode windows, each use
//! counting its routing entries). λ = 0.5 orders experts nearly as LRU does (one use now outweighs the older ones
//! of one-entry windows, ties aside); λ → 1 is LFU. Per layer, one shadow cache per λ of [`LRFU_DECAYS`] runs demand fetch with bypass on its
//! own scores (after each window it keeps the cache's size of experts with the highest scores among those it
//! held and those the window used); each λ's hits over all layers are counted with a decay of [`MERIT_DECAY`]
//! per window. At an adaptive round the real cache follows the λ whose shadows lead — LRU's until another's
//! exceed it by [`LEAD_MARGIN`], since LRU is the safe choice when the evidence is thin: candidates are uncached experts with a score
//! above zero, victims are free slots first, then cached experts by lowest score; the i-th candidate replaces
//! the i-th victim while its score is higher (free slots: any used expert enters, so short requests fill the
//! cache, unlike the seed rule's usage floor of 2). Pairs of every layer are taken largest gain first, at most
//! `adapt_swaps`. Rounds run every window (the engine and `replay` ignore `adapt_every` for this policy except
//! 0, static), so the cache is as current as a demand-fetch cache; rounds further apart lose the recency that LRU
//! lives on (every 4 windows fell up to 25 points below LRU on the traces below).
//!
//! The parameters were chosen by replaying the fixtures' routing and traces built from published routing counts
//! (docs/FIXTURES.md, tools/routing-synth): per-layer leaders, a horizon of 20 windows or starting from λ = 0.9
//! fell up to 1.5 points below LRU on some of them.
//!
//! Pure: the engine ([`super::store::ExpertStore`]) and `replay` ([`super::replay`]) run this same code.

use super::policy::Swap;

/// The decays (λ per decode window) the shadow caches try; the first behaves nearly as LRU.
pub const LRFU_DECAYS: [f32; 5] = [0.5, 0.8, 0.9, 0.95, 0.99];
/// Decay per window of a shadow cache's hit count (a horizon of about 100 windows).
pub const MERIT_DECAY: f32 = 0.99;
/// How far another λ's decayed hits must exceed LRU's (λ = 0.5) for the cache to follow it (relative).
pub const LEAD_MARGIN: f32 = 0.01;

/// State of the `lrfu` policy for `n_layer × n_expert` experts (index `layer × n_expert + expert`).
#[derive(Debug, Clone)]
pub struct Lrfu {
    n_layer: usize,
    n_expert: usize,
    /// Routing entries of the current window per expert.
    window: Vec<u32>,
    /// Scores per decay: `score[j][i]`.
    score: Vec<Vec<f32>>,
    /// Shadow cache per decay: `shadow[j][i]` = held.
    shadow: Vec<Vec<bool>>,
    /// Shadow capacity per layer (the real cache's size for that layer; `None` until first seen).
    cap: Vec<Option<usize>>,
    /// Decayed shadow hits over all layers, per decay.
    merit: [f32; LRFU_DECAYS.len()],
}

impl Lrfu {
    /// All scores zero, shadows empty until the first window tells their size.
    pub fn new(n_layer: usize, n_expert: usize) -> Self {
        let n = n_layer * n_expert;
        let d = LRFU_DECAYS.len();
        Lrfu {
            n_layer,
            n_expert,
            window: vec![0; n],
            score: vec![vec![0.0; n]; d],
            shadow: vec![vec![false; n]; d],
            cap: vec![None; n_layer],
            merit: [0.0; LRFU_DECAYS.len()],
        }
    }

    /// Counts `entries` routing entries of the current decode window for `(layer, expert)`. Panics on an index
    /// out of range.
    pub fn record(&mut self, layer: usize, expert: usize, entries: u32) {
        assert!(layer < self.n_layer && expert < self.n_expert, "expert ({layer}, {expert}) out of range");
        self.window[layer * self.n_expert + expert] += entries;
    }

    /// Forgets the current window's entries without ageing anything (a window with no VRAM cache to plan for).
    pub fn clear_window(&mut self) {
        self.window.iter_mut().for_each(|w| *w = 0);
    }

    /// The decay the real cache follows now (index into [`LRFU_DECAYS`]): the shadows with the most decayed
    /// hits, LRU's (0) unless another's exceed its by [`LEAD_MARGIN`].
    pub fn leader(&self) -> usize {
        let m = &self.merit;
        let mut best = 0;
        for (j, &v) in m.iter().enumerate() {
            if v > m[best] && v > m[0] * (1.0 + LEAD_MARGIN) {
                best = j;
            }
        }
        best
    }

    /// Score of `(layer, expert)` under the leading decay.
    pub fn score(&self, layer: usize, expert: usize) -> f32 {
        self.score[self.leader()][layer * self.n_expert + expert]
    }

    /// Ends a decode window: counts each shadow's hits on the window's experts, ages every score by its λ and
    /// adds the window's entries, lets each shadow keep its best, and clears the window. `cached(layer)` lists
    /// the experts the real cache holds (the shadows of a layer start as its copy the first time); `size(layer)`
    /// is the number of experts the layer's cache may hold (held + free for it).
    pub fn end_window(&mut self, cached: impl Fn(usize) -> Vec<usize>, size: impl Fn(usize) -> usize) {
        self.end_window_with(cached, size, keep_best);
    }

    /// [`Lrfu::end_window`] with the step that leaves a layer's shadow holding its `cap` best experts given as
    /// `keep(shadow, scores, window, cap, scratch)` (the tests pass a sorting one as the reference).
    fn end_window_with(&mut self, cached: impl Fn(usize) -> Vec<usize>, size: impl Fn(usize) -> usize, keep: KeepStep) {
        let ne = self.n_expert;
        let mut order: Vec<u64> = Vec::with_capacity(ne);
        self.merit.iter_mut().for_each(|m| *m *= MERIT_DECAY);
        for l in 0..self.n_layer {
            let r = l * ne..(l + 1) * ne;
            let cap = size(l).min(ne);
            if self.cap[l].is_none() {
                for sh in &mut self.shadow {
                    for e in cached(l) {
                        sh[l * ne + e] = true;
                    }
                }
            }
            self.cap[l] = Some(cap);
            let win = &self.window[r.clone()];
            if win.iter().all(|&w| w == 0) {
                // nothing routed at this layer (a layer without records): age only
                for (j, sc) in self.score.iter_mut().enumerate() {
                    sc[r.clone()].iter_mut().for_each(|s| *s *= LRFU_DECAYS[j]);
                }
                continue;
            }
            for (j, &lambda) in LRFU_DECAYS.iter().enumerate() {
                let sh = &mut self.shadow[j][r.clone()];
                let sc = &mut self.score[j][r.clone()];
                let hits = win.iter().zip(sh.iter()).filter(|(&w, &h)| w > 0 && h).count();
                self.merit[j] += hits as f32;
                for (s, &w) in sc.iter_mut().zip(win) {
                    *s = *s * lambda + w as f32;
                }
                keep(sh, sc, win, cap, &mut order);
            }
        }
        self.window.iter_mut().for_each(|w| *w = 0);
    }

    /// Plans an adaptive round under the leading decay (module doc). `cached(layer)` lists the experts
    /// the cache holds for `layer`; `free(layer)` is the number of empty slots that layer may fill. Returns at
    /// most `max_swaps` swaps, largest gain first (ties: lower layer, then higher-ranked pair first).
    pub fn plan(
        &self,
        cached: impl Fn(usize) -> Vec<usize>,
        free: impl Fn(usize) -> usize,
        max_swaps: usize,
    ) -> Vec<Swap> {
        self.plan_ranked(cached, free, max_swaps, true)
    }

    /// [`Lrfu::plan`]; `cut`: rank only the pairs that can be among the round's `max_swaps` (off: every pair, the
    /// tests' reference).
    fn plan_ranked(
        &self,
        cached: impl Fn(usize) -> Vec<usize>,
        free: impl Fn(usize) -> usize,
        max_swaps: usize,
        cut: bool,
    ) -> Vec<Swap> {
        let ne = self.n_expert;
        let mut pairs: Vec<(Swap, usize)> = Vec::new();
        let lead = self.leader();
        for l in 0..self.n_layer {
            let sc = &self.score[lead][l * ne..(l + 1) * ne];
            let held = cached(l);
            let mut in_cache = vec![false; ne];
            for &e in &held {
                in_cache[e] = true;
            }
            let mut cand: Vec<usize> = (0..ne).filter(|&e| !in_cache[e] && sc[e] > 0.0).collect();
            if cand.is_empty() {
                continue;
            }
            // a layer's gains fall with the rank (best candidate against the emptiest place), so at most its
            // first `n` pairs can be among the round's `max_swaps`: only the `n` best candidates and the `n`
            // cheapest places are ranked (this runs at every decode token while the tier is active)
            let nf = free(l);
            let n = cand.len().min(nf + held.len()).min(if cut { max_swaps } else { usize::MAX });
            smallest_sorted(&mut cand, n, |&a, &b| sc[b].total_cmp(&sc[a]).then(a.cmp(&b)));
            let mut vict: Vec<(Option<usize>, f32)> = vec![(None, 0.0); nf.min(n)];
            let mut held_sorted = held;
            smallest_sorted(&mut held_sorted, n - vict.len(), |&a, &b| sc[a].total_cmp(&sc[b]).then(a.cmp(&b)));
            vict.extend(held_sorted.into_iter().map(|e| (Some(e), sc[e])));
            for (rank, (&c, &(v, vs))) in cand.iter().zip(vict.iter()).enumerate() {
                if sc[c] <= vs {
                    break;
                }
                pairs.push((Swap { layer: l, outgoing: v, incoming: c, gain: sc[c] - vs }, rank));
            }
        }
        pairs.sort_by(|(a, ra), (b, rb)| b.gain.total_cmp(&a.gain).then(a.layer.cmp(&b.layer)).then(ra.cmp(rb)));
        pairs.truncate(max_swaps);
        pairs.into_iter().map(|(s, _)| s).collect()
    }
}

/// A shadow's keep step ([`keep_best`]): (shadow, scores, window, cap, scratch).
type KeepStep = fn(&mut [bool], &[f32], &[u32], usize, &mut Vec<u64>);

/// Leaves `sh` (a layer's shadow: held or not, per expert) holding the `cap` best of (held ∪ used in the window
/// `win`) by score `sc`; ties: held first, then lower id. Only the set counts, so it is selected (linear time; the
/// order is total, so the set is the one a sort would give), and not at all when every candidate fits: this runs per
/// layer and decay at every decode token. `order`: scratch.
fn keep_best(sh: &mut [bool], sc: &[f32], win: &[u32], cap: usize, order: &mut Vec<u64>) {
    order.clear();
    order.extend((0..sh.len()).filter(|&e| sh[e] || win[e] > 0).map(|e| rank_key(sc[e], sh[e], e)));
    if order.len() > cap {
        order.select_nth_unstable(cap);
        order.truncate(cap);
    }
    sh.iter_mut().for_each(|h| *h = false);
    for &k in order.iter() {
        sh[(k & KEY_ID) as usize] = true;
    }
}

/// The id bits of a [`rank_key`].
const KEY_ID: u64 = (1 << 31) - 1;

/// A key whose ascending order is a shadow's order of preference: score descending (as `f32::total_cmp` orders
/// scores), then held before not held, then lower expert id (`e` < 2^31).
fn rank_key(score: f32, held: bool, e: usize) -> u64 {
    debug_assert!(e as u64 <= KEY_ID, "expert id {e} past the key's 31 bits");
    let b = score.to_bits();
    // the bits reordered so that unsigned order is total_cmp's order
    let up = if b >> 31 == 1 { !b } else { b | 1 << 31 };
    (u64::from(!up) << 32) | (u64::from(!held) << 31) | (e as u64 & KEY_ID)
}

/// Leaves in `v` its `n` smallest elements under `cmp` (a total order), sorted: what sorting `v` and keeping its
/// first `n` gives, in time linear in `v.len()` plus the sort of the `n`.
fn smallest_sorted<T>(v: &mut Vec<T>, n: usize, mut cmp: impl FnMut(&T, &T) -> std::cmp::Ordering) {
    if v.len() > n {
        if n > 0 {
            v.select_nth_unstable_by(n - 1, &mut cmp);
        }
        v.truncate(n);
    }
    v.sort_by(cmp);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lambda_half_orders_as_lru() {
        // one layer, 3 experts, 1 slot: after uses 0, 0, 0, 1 the LRU-like score prefers 1 (used last)
        let mut p = Lrfu::new(1, 3);
        for e in [0, 0, 0, 1] {
            p.record(0, e, 1);
            p.end_window(|_| vec![], |_| 1);
        }
        let sc = &p.score[0];
        assert!(sc[1] > sc[0], "{sc:?}");
        // while λ = 0.99 still prefers the frequent one
        let sc = &p.score[4];
        assert!(sc[0] > sc[1], "{sc:?}");
    }

    #[test]
    fn free_slots_take_any_used_expert_and_victims_need_a_lower_score() {
        let mut p = Lrfu::new(1, 4);
        p.record(0, 2, 1);
        p.end_window(|_| vec![], |_| 2);
        // one free slot: expert 2 (score 1) enters; nothing else was used
        let s = p.plan(|_| vec![], |_| 1, 8);
        assert_eq!(s, vec![Swap { layer: 0, outgoing: None, incoming: 2, gain: 1.0 }]);
        // full cache holding 0 and 2: 2's score is not above itself, 0 (score 0) is not a candidate
        assert!(p.plan(|_| vec![0, 2], |_| 0, 8).is_empty());
        // cache holding 0 and 1 (both score 0): 2 replaces the lowest-id of the coldest
        let s = p.plan(|_| vec![1, 0], |_| 0, 8);
        assert_eq!(s, vec![Swap { layer: 0, outgoing: Some(0), incoming: 2, gain: 1.0 }]);
    }

    #[test]
    fn the_leading_shadow_is_followed() {
        // one hot expert every other window, one-off experts between: with one slot LRU always holds the one-off
        // (0 never hits), a frequency-leaning λ keeps 0 (every use of 0 after the first hits)
        let mut p = Lrfu::new(1, 101);
        for i in 0..200 {
            p.record(0, if i % 2 == 0 { 0 } else { 1 + i / 2 }, 1);
            p.end_window(|_| vec![], |_| 1);
        }
        assert_eq!(p.merit[0], 0.0, "LRU's shadow never hits here");
        assert_ne!(p.leader(), 0);
        // the real cache follows: the hot expert replaces a one-off
        let s = p.plan(|_| vec![100], |_| 0, 8);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].outgoing, s[0].incoming), (Some(100), 0));
    }

    /// A small deterministic generator for the property tests below.
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// The shadow step as written before it selected: the candidates fully sorted, the first `cap` kept.
    fn keep_by_sort(sh: &mut [bool], sc: &[f32], win: &[u32], cap: usize, _: &mut Vec<u64>) {
        let mut order: Vec<usize> = (0..sh.len()).filter(|&e| sh[e] || win[e] > 0).collect();
        order.sort_by(|&a, &b| sc[b].total_cmp(&sc[a]).then(sh[b].cmp(&sh[a])).then(a.cmp(&b)));
        sh.iter_mut().for_each(|h| *h = false);
        for &e in order.iter().take(cap) {
            sh[e] = true;
        }
    }

    #[test]
    fn end_window_keeps_the_sets_a_full_sort_keeps() {
        // layers of every cache size from none to all experts, skewed random routing with repeats (ties)
        let (nl, ne) = (5usize, 24usize);
        let mut seed = 0x0dd_ba11_cafe_f00d;
        let (mut a, mut b) = (Lrfu::new(nl, ne), Lrfu::new(nl, ne));
        let size = |l: usize| [0, 3, 12, 23, 24][l];
        let cached = |l: usize| (0..size(l)).collect::<Vec<_>>();
        for w in 0..300 {
            for l in 0..nl {
                for _ in 0..3 {
                    let r = next(&mut seed);
                    let e = ((r % ne as u64) * (r >> 40 & 1) + (r >> 20) % 4) as usize % ne;
                    a.record(l, e, 1);
                    b.record(l, e, 1);
                }
            }
            a.end_window(cached, size);
            b.end_window_with(cached, size, keep_by_sort);
            assert_eq!((&a.shadow, &a.merit), (&b.shadow, &b.merit), "window {w}");
            assert_eq!(a.score, b.score, "window {w}");
        }
    }

    #[test]
    fn rank_keys_order_as_the_shadow_comparator() {
        let scores = [0.0f32, -0.0, 1.0, 1.0, 0.5, -2.0, 3.25, f32::MIN_POSITIVE, 1e30, -1e-30, 0.5];
        let items: Vec<(f32, bool, usize)> =
            scores.iter().enumerate().flat_map(|(i, &s)| [(s, false, i), (s, true, 40 - i)]).collect();
        for a in &items {
            for b in &items {
                let want = b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2));
                assert_eq!(rank_key(a.0, a.1, a.2).cmp(&rank_key(b.0, b.1, b.2)), want, "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn smallest_sorted_is_the_sorted_prefix() {
        let mut seed = 0x1234_5678_9abc_def1;
        for len in [0usize, 1, 2, 7, 64, 129] {
            for n in [0usize, 1, 3, 64, 200] {
                // few distinct keys, so ties are broken by the second field
                let v: Vec<(u64, usize)> = (0..len).map(|i| (next(&mut seed) % 5, i)).collect();
                let mut want = v.clone();
                want.sort();
                want.truncate(n);
                let mut got = v;
                smallest_sorted(&mut got, n, |a, b| a.cmp(b));
                assert_eq!(got, want, "len {len} n {n}");
            }
        }
    }

    #[test]
    fn a_round_of_k_swaps_is_the_first_k_of_a_larger_round() {
        // many layers and experts, random routing and caches: the ranked shortcuts (selection instead of sorts,
        // a layer's pairs cut at the round's size) give the prefix of the uncut plan
        let (nl, ne) = (6usize, 40usize);
        let mut seed = 0xfeed_beef_1234_5678;
        let mut p = Lrfu::new(nl, ne);
        let caches: Vec<Vec<usize>> =
            (0..nl).map(|l| (0..ne).filter(|&e| (e * 7 + l) % 3 == 0).collect::<Vec<_>>()).collect();
        for _ in 0..60 {
            for l in 0..nl {
                for _ in 0..4 {
                    p.record(l, (next(&mut seed) % ne as u64) as usize, 1);
                }
            }
            p.end_window(|l| caches[l].clone(), |l| caches[l].len() + l % 2);
        }
        let all = p.plan(|l| caches[l].clone(), |l| l % 2, usize::MAX);
        assert!(all.len() > 8, "the case has swaps to rank ({})", all.len());
        for k in [0usize, 1, 2, 5, 8, usize::MAX] {
            let got = p.plan(|l| caches[l].clone(), |l| l % 2, k);
            assert_eq!(got, all[..k.min(all.len())], "k = {k}");
            assert_eq!(got, p.plan_ranked(|l| caches[l].clone(), |l| l % 2, k, false), "k = {k}");
        }
    }
}
