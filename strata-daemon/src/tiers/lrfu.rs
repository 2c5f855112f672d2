//! The `lrfu` placement policy: recency-weighted frequency (LRFU, Lee et al., "LRFU: a spectrum of policies
//! that subsumes the least recently used and least frequently used policies", IEEE ToC 2001) with its decay and
//! its admission chosen online by shadow caches (the idea of ARC and LeCaR: keep the cheap metadata of a few
//! candidate policies and follow the one that would have hit most lately).
//!
//! Each expert's score is `Σ λ^age` over the windows that used it (`age` in decode windows, each use counting its
//! routing entries); λ = 0.5 leans to recency (one use now outweighs all older ones of one-entry windows), λ → 1
//! is LFU. Ties of score go to the more recently used expert. The last use orders a window's experts too: the
//! routing records them in order, a token's by rank, and the first recorded counts as the latest used (a token's top
//! expert is the one LRU keeps last, as `replay`'s LRU has it). A variant is a λ of [`LRFU_DECAYS`] with one of two
//! admissions:
//! - **demand**: the experts the last window used enter whatever their score and are not victims of the next
//!   round; the others are ranked by score (the frequency-ordered eviction of an LFU with demand fetch). With
//!   λ = 0.5 this variant ranks by the last use alone instead of the score, which makes it LRU exactly
//!   ([`LRU_VARIANT`]; λ = 0.5's scores would order a window's experts by their older uses, and tie once aged below
//!   f32's range after about 150 windows).
//! - **bypass**: an expert enters only when its score beats its victim's, so one-off experts do not push out hot
//!   ones (what wins when the cache holds no more than a token's experts and a few hot ones recur).
//!
//! Per layer, one shadow cache per variant keeps after each window the cache's size of experts it prefers among
//! those it held and those the window used; each variant's hits over all layers are counted with a decay of
//! [`MERIT_DECAY`] per window. At an adaptive round the real cache follows the variant whose shadows lead — LRU's
//! until another's exceed it by [`LEAD_MARGIN`] and by [`LEAD_Z`] standard deviations of that decayed lead, estimated
//! from the two shadows' per-window hit differences (with a prior, [`DEV_PRIOR`], for a fresh state), since LRU is the safe choice when the evidence
//! is thin and each change of leader costs misses while the cache moves:
//! candidates are uncached experts used before (a score above zero), victims are free slots first, then cached
//! experts (with demand admission the last window's come last), by lowest score, then oldest use (LRU: oldest use
//! alone); the i-th candidate (candidates best first: score, then latest use) replaces the i-th
//! victim while it ranks higher (free slots: any used expert enters, so short requests fill the cache, unlike the
//! seed rule's usage floor of 2). Pairs of every layer are taken demand-admitted first, then largest gain, at most
//! `adapt_swaps`. Rounds run every window (the engine and `replay` ignore `adapt_every` for this policy except 0,
//! static), so the cache is as current as a demand-fetch cache; rounds further apart lose the recency that LRU
//! lives on (every 4 windows fell up to 25 points below LRU on the traces below).
//!
//! The parameters were chosen by replaying the fixtures' routing and traces built from published routing counts
//! (docs/FIXTURES.md, tools/routing-synth): per-layer leaders, a horizon of 20 windows or starting from λ = 0.9
//! fell up to 1.5 points below LRU on some of them; the demand variants and λ = 0.999 (stop 43) took the share of
//! LRU's gap to Belady closed on the published-count traces from −1–7% to 1–29% (docs/BENCHMARKS.md, stop 43; a
//! frequency oracle that knows each request's counts in advance closes 12–57%). The lead test (stop 61) was chosen on
//! five seeds of those traces, since one seed's cells differ from LRU's by noise of a few tenths of a point: it took the cells
//! whose mean over the seeds is below LRU from 9 to 2 (worst −0.13 → −0.06 points) for 0–0.5 points less of the gap
//! closed; over ten seeds one cell's mean is below, by −0.01 ± 0.02 points (its standard error), none by more than
//! two standard errors.
//!
//! Pure: the engine ([`super::store::ExpertStore`]) and `replay` ([`super::replay`]) run this same code.

use super::policy::Swap;

/// The decays (λ per decode window) the shadow caches try; with demand admission the first is LRU ([`LRU_VARIANT`]).
pub const LRFU_DECAYS: [f32; 6] = [0.5, 0.8, 0.9, 0.97, 0.99, 0.999];
/// Shadow variants: every decay of [`LRFU_DECAYS`] once with bypass (index `j`) and once with demand admission
/// (index `LRFU_DECAYS.len() + j`); see [`Lrfu::variant`].
pub const LRFU_VARIANTS: usize = 2 * LRFU_DECAYS.len();
/// The variant that is LRU (λ = 0.5 with demand admission, ranked by the last use alone; a window's experts ordered
/// as recorded, the first latest): the leader unless another beats it.
pub const LRU_VARIANT: usize = LRFU_DECAYS.len();
/// Decay per window of a shadow cache's hit count (a horizon of about 100 windows).
pub const MERIT_DECAY: f32 = 0.99;
/// How far another variant's decayed hits must exceed LRU's ([`LRU_VARIANT`]) for the cache to follow it
/// (relative).
pub const LEAD_MARGIN: f32 = 0.01;
/// How many standard deviations of a variant's decayed lead over LRU (estimated from the per-window hit differences,
/// `dev`) that lead must also reach for the cache to follow it (a one-sided test that the lead is not noise).
pub const LEAD_Z: f32 = 1.0;
/// The squared hit difference each variant's deviation starts with (decayed like the measured ones): a prior
/// of noise, so that the first windows of a fresh state (a request on a cold cache) need a lead of about
/// `LEAD_Z · √DEV_PRIOR` hits before leaving LRU.
pub const DEV_PRIOR: f32 = 16.0;

/// State of the `lrfu` policy for `n_layer × n_expert` experts (index `layer × n_expert + expert`).
#[derive(Debug, Clone)]
pub struct Lrfu {
    n_layer: usize,
    n_expert: usize,
    /// Routing entries of the current window per expert.
    window: Vec<u32>,
    /// Scores per decay: `score[j][i]`.
    score: Vec<Vec<f32>>,
    /// Shadow cache per variant: `shadow[v][i]` = held.
    shadow: Vec<Vec<bool>>,
    /// Shadow capacity per layer (the real cache's size for that layer; `None` until first seen).
    cap: Vec<Option<usize>>,
    /// Decayed shadow hits over all layers, per variant.
    merit: [f32; LRFU_VARIANTS],
    /// Per variant, the squared differences of its shadow's hits and LRU's per window, summed over the windows
    /// with weights `MERIT_DECAY²` per window of age (the variance of its decayed lead when the two differ by
    /// noise), plus the decayed [`DEV_PRIOR`].
    dev: [f32; LRFU_VARIANTS],
    /// Routing entries of the last ended window per expert (the experts a demand-admission round protects).
    last: Vec<u32>,
    /// Per expert, when it was last used (0: never): the number of the last ended window that used it, times
    /// 2^16, plus 2^16 − 1 − its place among that window's experts of its layer as recorded (the first recorded
    /// the latest). Orders LRU ([`LRU_VARIANT`]) and breaks the others' ties of score (which include scores aged
    /// below f32's range).
    used_at: Vec<u64>,
    /// Per expert, 1 + its place among the current window's distinct experts of its layer as recorded (0: not
    /// recorded in this window).
    win_order: Vec<u16>,
    /// Distinct experts recorded in the current window, per layer.
    win_count: Vec<u16>,
    /// Windows ended so far.
    now: u64,
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
            shadow: vec![vec![false; n]; LRFU_VARIANTS],
            cap: vec![None; n_layer],
            merit: [0.0; LRFU_VARIANTS],
            dev: [DEV_PRIOR; LRFU_VARIANTS],
            last: vec![0; n],
            used_at: vec![0; n],
            win_order: vec![0; n],
            win_count: vec![0; n_layer],
            now: 0,
        }
    }

    /// Counts `entries` routing entries of the current decode window for `(layer, expert)` (0: nothing). A window's
    /// experts are recorded in the routing's order (token by token, each token's by rank): the first recorded counts
    /// as the latest used. Panics on an index out of range.
    pub fn record(&mut self, layer: usize, expert: usize, entries: u32) {
        assert!(layer < self.n_layer && expert < self.n_expert, "expert ({layer}, {expert}) out of range");
        let i = layer * self.n_expert + expert;
        if entries == 0 {
            return;
        }
        if self.win_order[i] == 0 {
            self.win_count[layer] = self.win_count[layer].saturating_add(1);
            self.win_order[i] = self.win_count[layer];
        }
        self.window[i] += entries;
    }

    /// Replaces this state's current window with `other`'s (same shape), leaving `other`'s empty. A fresh state
    /// takes the window being ended from the state it replaces. Panics when the two have different shapes.
    pub fn take_window(&mut self, other: &mut Lrfu) {
        assert_eq!(self.window.len(), other.window.len(), "lrfu states of different shapes");
        std::mem::swap(&mut self.window, &mut other.window);
        std::mem::swap(&mut self.win_order, &mut other.win_order);
        std::mem::swap(&mut self.win_count, &mut other.win_count);
        other.window.iter_mut().for_each(|w| *w = 0);
        other.win_order.iter_mut().for_each(|w| *w = 0);
        other.win_count.iter_mut().for_each(|w| *w = 0);
    }

    /// Forgets the current window's entries and the last window's (the ones a demand round would protect)
    /// without ageing anything (a window with no round to plan).
    pub fn clear_window(&mut self) {
        self.window.iter_mut().for_each(|w| *w = 0);
        self.win_order.iter_mut().for_each(|w| *w = 0);
        self.win_count.iter_mut().for_each(|w| *w = 0);
        self.last.iter_mut().for_each(|w| *w = 0);
    }

    /// The variant the real cache follows now (index below [`LRFU_VARIANTS`]): LRU's ([`LRU_VARIANT`]), unless
    /// other variants' decayed hits exceed its by [`LEAD_MARGIN`] and by [`LEAD_Z`] standard deviations of that
    /// decayed lead; then the one of those with the most.
    pub fn leader(&self) -> usize {
        self.leader_with(LEAD_Z)
    }

    /// [`Lrfu::leader`] with `z` standard deviations for the lead test (0: the relative margin alone).
    fn leader_with(&self, z: f32) -> usize {
        let m = &self.merit;
        let base = m[LRU_VARIANT];
        let mut best = LRU_VARIANT;
        for (j, &v) in m.iter().enumerate() {
            if v > m[best] && v > base * (1.0 + LEAD_MARGIN) && v - base > z * self.dev[j].sqrt() {
                best = j;
            }
        }
        best
    }

    /// Whether variant `v` ranks experts by their last use alone rather than by score: LRU ([`LRU_VARIANT`]).
    fn recency(v: usize) -> bool {
        v == LRU_VARIANT
    }

    /// A variant's decay and admission: `(λ, demand)`. With demand admission the experts the last window used
    /// enter whatever their score (as in LRU) and are not victims of the round after it; with bypass an expert
    /// enters only when its score beats its victim's.
    pub fn variant(v: usize) -> (f32, bool) {
        let d = LRFU_DECAYS.len();
        (LRFU_DECAYS[v % d], v >= d)
    }

    /// Score of `(layer, expert)` under the leading variant's decay.
    pub fn score(&self, layer: usize, expert: usize) -> f32 {
        self.score[self.leader() % LRFU_DECAYS.len()][layer * self.n_expert + expert]
    }

    /// Ends a decode window: counts each shadow's hits on the window's experts, ages every score by its λ and
    /// adds the window's entries, lets each shadow keep its best, keeps the window as the last one (what the
    /// next round's demand admission protects) and clears it. `cached(layer)` lists
    /// the experts the real cache holds (the shadows of a layer start as its copy the first time); `size(layer)`
    /// is the number of experts the layer's cache may hold (held + free for it).
    pub fn end_window(&mut self, cached: impl Fn(usize) -> Vec<usize>, size: impl Fn(usize) -> usize) {
        self.end_window_with(cached, size, keep_best);
    }

    /// [`Lrfu::end_window`] with the step that leaves a layer's shadow holding its `cap` best experts given as
    /// `keep(shadow, scores, window, cap, demand, scratch)` (the tests pass a sorting one as the reference).
    fn end_window_with(&mut self, cached: impl Fn(usize) -> Vec<usize>, size: impl Fn(usize) -> usize, keep: KeepStep) {
        let ne = self.n_expert;
        let mut order: Vec<u128> = Vec::with_capacity(ne);
        self.now = self.now.saturating_add(1);
        for (u, &o) in self.used_at.iter_mut().zip(&self.win_order) {
            if o > 0 {
                // 2^48 windows: far past any daemon's life
                *u = (self.now << 16) | u64::from(u16::MAX - o);
            }
        }
        self.merit.iter_mut().for_each(|m| *m *= MERIT_DECAY);
        self.dev.iter_mut().for_each(|d| *d *= MERIT_DECAY * MERIT_DECAY);
        let mut hits_now = [0u32; LRFU_VARIANTS];
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
                let sc = &mut self.score[j][r.clone()];
                for (s, &w) in sc.iter_mut().zip(win) {
                    *s = *s * lambda + w as f32;
                }
            }
            for (v, hits_v) in hits_now.iter_mut().enumerate() {
                let (_, demand) = Lrfu::variant(v);
                let sh = &mut self.shadow[v][r.clone()];
                let hits = win.iter().zip(sh.iter()).filter(|(&w, &h)| w > 0 && h).count();
                self.merit[v] += hits as f32;
                *hits_v += hits as u32;
                let sc = Scores {
                    score: &self.score[v % LRFU_DECAYS.len()][r.clone()],
                    used_at: &self.used_at[r.clone()],
                    recency: Lrfu::recency(v),
                };
                keep(sh, sc, win, cap, demand, &mut order);
            }
        }
        for (d, &h) in self.dev.iter_mut().zip(&hits_now) {
            let diff = h as f32 - hits_now[LRU_VARIANT] as f32;
            *d += diff * diff;
        }
        std::mem::swap(&mut self.last, &mut self.window);
        self.window.iter_mut().for_each(|w| *w = 0);
        self.win_order.iter_mut().for_each(|w| *w = 0);
        self.win_count.iter_mut().for_each(|w| *w = 0);
    }

    /// Plans an adaptive round under the leading variant (module doc). `cached(layer)` lists the experts
    /// the cache holds for `layer`; `free(layer)` is the number of empty slots that layer may fill. Returns at
    /// most `max_swaps` swaps: with demand admission the last window's experts replacing others first, then by
    /// largest score gain (ties: lower layer, then higher-ranked pair first). [`Swap::gain`] is the score
    /// difference (negative for a demand-admitted expert that enters over a higher-scored one).
    pub fn plan(
        &self,
        cached: impl Fn(usize) -> Vec<usize>,
        free: impl Fn(usize) -> usize,
        max_swaps: usize,
    ) -> Vec<Swap> {
        self.plan_ranked(self.leader(), cached, free, max_swaps, true)
    }

    /// [`Lrfu::plan`]; `cut`: rank only the pairs that can be among the round's `max_swaps` (off: every pair, the
    /// tests' reference).
    fn plan_ranked(
        &self,
        lead: usize,
        cached: impl Fn(usize) -> Vec<usize>,
        free: impl Fn(usize) -> usize,
        max_swaps: usize,
        cut: bool,
    ) -> Vec<Swap> {
        let ne = self.n_expert;
        let mut pairs: Vec<(Swap, bool, usize)> = Vec::new();
        let (_, demand) = Lrfu::variant(lead);
        let rec = Lrfu::recency(lead);
        for l in 0..self.n_layer {
            let sc = &self.score[lead % LRFU_DECAYS.len()][l * ne..(l + 1) * ne];
            let ua = &self.used_at[l * ne..(l + 1) * ne];
            // preference: score (not for LRU, which ranks by the use alone), then the more recent use (scores aged
            // to 0 are ties); a free slot (`None`): never used, score 0
            let key = |e: Option<usize>| e.map_or((0.0f32, 0u64), |e| (if rec { 0.0 } else { sc[e] }, ua[e]));
            let order = |a: (f32, u64), b: (f32, u64)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
            let pref = |a: usize, b: usize| order(key(Some(a)), key(Some(b)));
            let prot = |e: usize| demand && self.last[l * ne + e] > 0;
            let held = cached(l);
            let mut in_cache = vec![false; ne];
            for &e in &held {
                in_cache[e] = true;
            }
            // with demand admission only the last window's experts may enter (as its shadows do: a demand cache
            // loads what a token used); with bypass any used expert that ranks above its victim
            let mut cand: Vec<usize> =
                (0..ne).filter(|&e| !in_cache[e] && sc[e] > 0.0 && (!demand || prot(e))).collect();
            if cand.is_empty() {
                continue;
            }
            // a layer's gains fall with the rank (best candidate against the emptiest place), so at most its
            // first `n` pairs can be among the round's `max_swaps`: only the `n` best candidates and the `n`
            // cheapest places are ranked (this runs at every decode token while the tier is active)
            let nf = free(l);
            let n = cand.len().min(nf + held.len()).min(if cut { max_swaps } else { usize::MAX });
            smallest_sorted(&mut cand, n, |&a, &b| prot(b).cmp(&prot(a)).then(pref(b, a)).then(a.cmp(&b)));
            let mut vict: Vec<(Option<usize>, bool)> = vec![(None, false); nf.min(n)];
            let mut held_sorted = held;
            smallest_sorted(&mut held_sorted, n - vict.len(), |&a, &b| {
                // ties: the higher id leaves first, so a round keeps what a shadow keeps (lower ids)
                prot(a).cmp(&prot(b)).then(pref(a, b)).then(b.cmp(&a))
            });
            vict.extend(held_sorted.into_iter().map(|e| (Some(e), prot(e))));
            for (rank, (&c, &(v, vp))) in cand.iter().zip(vict.iter()).enumerate() {
                let cp = prot(c);
                // protected before unprotected, then the preference
                if cp.cmp(&vp).then(order(key(Some(c)), key(v))).is_le() {
                    break;
                }
                // LRU ranks by use, not score: its gains are kept falling with the rank (as the cut above and the
                // round's order across layers assume), so a layer's latest-used expert is never left for a later one
                let mut gain = sc[c] - v.map_or(0.0, |v| sc[v]);
                if rec {
                    gain = pairs.last().filter(|p| p.0.layer == l).map_or(gain, |p| gain.min(p.0.gain));
                }
                pairs.push((Swap { layer: l, outgoing: v, incoming: c, gain }, cp && !vp, rank));
            }
        }
        pairs.sort_by(|(a, pa, ra), (b, pb, rb)| {
            pb.cmp(pa).then(b.gain.total_cmp(&a.gain)).then(a.layer.cmp(&b.layer)).then(ra.cmp(rb))
        });
        pairs.truncate(max_swaps);
        pairs.into_iter().map(|(s, _, _)| s).collect()
    }
}

/// A layer's scores under one decay and when each expert was last used ([`Lrfu`]'s `used_at`), the ranking
/// [`keep_best`] and [`rank_key`] use; `recency`: rank by the last use alone (scores ignored).
#[derive(Clone, Copy)]
struct Scores<'a> {
    score: &'a [f32],
    used_at: &'a [u64],
    recency: bool,
}

/// A shadow's keep step ([`keep_best`]): (shadow, scores, window, cap, demand admission, scratch).
type KeepStep = fn(&mut [bool], Scores<'_>, &[u32], usize, bool, &mut Vec<u128>);

/// Leaves `sh` (a layer's shadow: held or not, per expert) holding the `cap` best of (held ∪ used in the window
/// `win`): with `protect` (demand admission) the window's experts first, then by score (not for LRU),
/// then by the more recent use; ties: held first, then lower id. Only the set counts, so it is selected (linear time; the order is total,
/// so the set is the one a sort would give), and skipped when the window brought nothing new and the held set
/// fits: this runs per layer and variant at every decode token. `order`: scratch.
fn keep_best(sh: &mut [bool], sc: Scores<'_>, win: &[u32], cap: usize, protect: bool, order: &mut Vec<u128>) {
    let (mut held, mut new) = (0usize, 0usize);
    for (&w, &h) in win.iter().zip(sh.iter()) {
        held += usize::from(h);
        new += usize::from(w > 0 && !h);
    }
    if new == 0 && held <= cap {
        // every used expert is held and the held set fits (the size may have shrunk since): nothing changes
        return;
    }
    order.clear();
    order.extend(
        (0..sh.len()).filter(|&e| sh[e] || win[e] > 0).map(|e| {
            rank_key(if sc.recency { 0.0 } else { sc.score[e] }, sc.used_at[e], sh[e], protect && win[e] > 0, e)
        }),
    );
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
const KEY_ID: u128 = (1 << 30) - 1;

/// A key whose ascending order is a shadow's order of preference: forced in (a demand variant's window) first,
/// then score descending (as `f32::total_cmp` orders scores), then the later last use (`used_at` descending),
/// then held before not held, then lower expert id (`e` < 2^30): 1 + 32 + 64 + 1 + 30 bits.
fn rank_key(score: f32, used_at: u64, held: bool, forced: bool, e: usize) -> u128 {
    debug_assert!(e as u128 <= KEY_ID, "expert id {e} past the key's 30 bits");
    let b = score.to_bits();
    // the bits reordered so that unsigned order is total_cmp's order
    let up = if b >> 31 == 1 { !b } else { b | 1 << 31 };
    (u128::from(!forced) << 127)
        | (u128::from(!up) << 95)
        | (u128::from(!used_at) << 31)
        | (u128::from(!held) << 30)
        | (e as u128 & KEY_ID)
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
        // cache holding 0 and 1 (both score 0): 2 replaces the highest-id of the coldest (a shadow keeps lower ids)
        let s = p.plan(|_| vec![1, 0], |_| 0, 8);
        assert_eq!(s, vec![Swap { layer: 0, outgoing: Some(1), incoming: 2, gain: 1.0 }]);
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
        assert_eq!(p.merit[LRU_VARIANT], 0.0, "LRU's shadow never hits here");
        assert_eq!(p.merit[0], 0.0, "nor λ = 0.5 with bypass");
        // with one slot and one expert per window, demand admission is LRU whatever λ: a bypass variant leads
        assert!(!Lrfu::variant(p.leader()).1, "leader {}", p.leader());
        // the real cache follows: the hot expert replaces a one-off
        let s = p.plan(|_| vec![100], |_| 0, 8);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].outgoing, s[0].incoming), (Some(100), 0));
    }

    #[test]
    fn lru_loads_a_tokens_top_expert_first() {
        // expert 1 used in window 1; window 2 routes 0 (top) then 1: LRU's latest is 0, though 1's λ = 0.5 score
        // (1.5) is above 0's (1.0); a round of one swap loads 0, ranked or not
        let mut p = Lrfu::new(1, 4);
        p.record(0, 1, 1);
        p.end_window(|_| vec![2, 3], |_| 2);
        p.record(0, 0, 1);
        p.record(0, 1, 1);
        p.end_window(|_| vec![2, 3], |_| 2);
        for cut in [true, false] {
            let s = p.plan_ranked(LRU_VARIANT, |_| vec![2, 3], |_| 0, 1, cut);
            assert_eq!((s.len(), s[0].incoming), (1, 0), "cut {cut}: {s:?}");
        }
        let s = p.plan_ranked(LRU_VARIANT, |_| vec![2, 3], |_| 0, 8, false);
        assert_eq!(s.iter().map(|s| s.incoming).collect::<Vec<_>>(), vec![0, 1]);
    }

    /// A small deterministic generator for the property tests below.
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// The shadow step as written before it selected: the candidates fully sorted, the first `cap` kept.
    fn keep_by_sort(sh: &mut [bool], sc: Scores<'_>, win: &[u32], cap: usize, demand: bool, _: &mut Vec<u128>) {
        let mut order: Vec<usize> = (0..sh.len()).filter(|&e| sh[e] || win[e] > 0).collect();
        let used = |e: usize| demand && win[e] > 0;
        let (s, u) = (sc.score, sc.used_at);
        let by_score = |a: usize, b: usize| if sc.recency { std::cmp::Ordering::Equal } else { s[b].total_cmp(&s[a]) };
        order.sort_by(|&a, &b| {
            used(b).cmp(&used(a)).then(by_score(a, b)).then(u[b].cmp(&u[a])).then(sh[b].cmp(&sh[a])).then(a.cmp(&b))
        });
        sh.iter_mut().for_each(|h| *h = false);
        for &e in order.iter().take(cap) {
            sh[e] = true;
        }
    }

    #[test]
    fn end_window_keeps_the_sets_a_full_sort_keeps() {
        // layers of every cache size from none to all experts, skewed random routing with repeats (ties); layer 5's
        // size moves every window (slots in flight in the engine shrink a layer's size for a while)
        let (nl, ne) = (6usize, 24usize);
        let mut seed = 0x0dd_ba11_cafe_f00d;
        let (mut a, mut b) = (Lrfu::new(nl, ne), Lrfu::new(nl, ne));
        for w in 0..300 {
            let size = |l: usize| [0, 3, 12, 23, 24, [8, 2, 5, 2, 11, 1][w % 6]][l];
            let cached = |l: usize| (0..size(l)).collect::<Vec<_>>();
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
            assert_eq!((&a.shadow, &a.merit, &a.dev), (&b.shadow, &b.merit, &b.dev), "window {w}");
            assert_eq!((&a.score, &a.used_at), (&b.score, &b.used_at), "window {w}");
        }
    }

    #[test]
    fn rank_keys_order_as_the_shadow_comparator() {
        let scores = [0.0f32, -0.0, 1.0, 1.0, 0.5, -2.0, 3.25, f32::MIN_POSITIVE, 1e30, -1e-30, 0.5];
        let uses = [0u64, 1, 7 << 16 | 3, u64::MAX];
        // (score, used_at, held, forced, id)
        let items: Vec<(f32, u64, bool, bool, usize)> = scores
            .iter()
            .enumerate()
            .flat_map(|(i, &s)| {
                let u = uses[i % uses.len()];
                [(s, u, false, false, i), (s, uses[(i + 1) % 4], true, false, 40 - i), (s, u, i % 2 == 0, true, 80 + i)]
            })
            .collect();
        for a in &items {
            for b in &items {
                let want =
                    b.3.cmp(&a.3).then(b.0.total_cmp(&a.0)).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)).then(a.4.cmp(&b.4));
                let got = rank_key(a.0, a.1, a.2, a.3, a.4).cmp(&rank_key(b.0, b.1, b.2, b.3, b.4));
                assert_eq!(got, want, "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn a_lead_must_pass_the_margin_and_the_noise() {
        let mut p = Lrfu::new(1, 4);
        // LRU's decayed hits 100; variant 3 leads by 3 (past the 1% margin)
        p.merit[LRU_VARIANT] = 100.0;
        p.merit[3] = 103.0;
        // its per-window differences with LRU have varied: the decayed lead's standard deviation is 5 hits, 3 is noise
        p.dev[3] = 25.0;
        assert_eq!(p.leader(), LRU_VARIANT);
        assert_eq!(p.leader_with(0.0), 3, "the margin alone would follow it");
        // steady differences (deviation 2): a lead of 3 passes at z = 1
        p.dev[3] = 4.0;
        assert_eq!(p.leader(), 3);
        // a lead within the margin never does, however steady
        p.merit[3] = 100.5;
        p.dev[3] = 0.0;
        assert_eq!(p.leader(), LRU_VARIANT);
        // of two variants past both tests, the one with more hits
        p.merit[3] = 110.0;
        p.merit[8] = 112.0;
        p.dev[8] = 9.0;
        assert_eq!(p.leader(), 8);
        // a fresh state: one window in which a bypass variant hit twice where LRU missed is within the prior
        let mut p = Lrfu::new(2, 4);
        p.merit[1] = 2.0;
        p.dev[1] += 4.0;
        assert_eq!(p.leader(), LRU_VARIANT);
        assert_eq!(p.leader_with(0.0), 1);
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
        // under every variant, LRU's (ranked by use, its gains kept falling with the rank) included
        for lead in 0..LRFU_VARIANTS {
            let all = p.plan_ranked(lead, |l| caches[l].clone(), |l| l % 2, usize::MAX, true);
            assert!(all.len() > 8, "the case has swaps to rank ({}, variant {lead})", all.len());
            for k in [0usize, 1, 2, 5, 8, usize::MAX] {
                let got = p.plan_ranked(lead, |l| caches[l].clone(), |l| l % 2, k, true);
                assert_eq!(got, all[..k.min(all.len())], "k = {k}, variant {lead}");
                assert_eq!(got, p.plan_ranked(lead, |l| caches[l].clone(), |l| l % 2, k, false), "k = {k}");
            }
        }
        let all = p.plan(|l| caches[l].clone(), |l| l % 2, usize::MAX);
        assert_eq!(all, p.plan_ranked(p.leader(), |l| caches[l].clone(), |l| l % 2, usize::MAX, false));
    }

    #[test]
    fn the_lru_variant_is_lru() {
        // random skewed routing, several cache sizes and top-k: a cache that follows the LRU variant's rounds after every window holds what LRU (demand fetch, evict least recently used; a window's
        // experts used in rank order, the top one last, as replay's LRU) holds, and its shadow too; caches smaller
        // than a token's experts keep its top-ranked ones
        // (128, 1, 96, uniform): reuse distances of hundreds of windows, past where λ = 0.5's scores reach 0 in f32
        for (ne, k, slots, uniform) in [
            (8usize, 1usize, 2usize, false),
            (8, 1, 3, false),
            (16, 1, 6, false),
            (32, 1, 5, false),
            (32, 1, 1, false),
            (128, 1, 96, true),
            (8, 2, 1, false),
            (8, 2, 3, false),
            (16, 4, 3, false),
            (64, 8, 20, false),
        ] {
            let mut seed = 0xabad_1dea_0000_0001 ^ (ne * 31 + k * 7 + slots) as u64;
            let mut p = Lrfu::new(1, ne);
            let mut cache: Vec<usize> = (0..slots).collect();
            // LRU order, least recent first; the initial fill counts as never used (highest id oldest, as
            // replay's LRU keeps the fill's first experts)
            let mut lru: Vec<usize> = (0..slots).rev().collect();
            let (mut hits, mut lru_hits) = (0, 0);
            for w in 0..if uniform { 1500 } else { 400 } {
                let mut win: Vec<usize> = Vec::new();
                while win.len() < k {
                    let r = next(&mut seed);
                    // a hot half and a cold half, and one-token reuse
                    let e = if uniform || r.is_multiple_of(3) {
                        (r >> 8) as usize % ne
                    } else {
                        (r >> 8) as usize % (ne / 2)
                    };
                    if !win.contains(&e) {
                        win.push(e);
                    }
                }
                for &e in &win {
                    hits += cache.contains(&e) as u32;
                    lru_hits += lru.contains(&e) as u32;
                    p.record(0, e, 1);
                }
                for &e in win.iter().rev() {
                    lru.retain(|&x| x != e);
                    lru.push(e);
                }
                while lru.len() > slots {
                    lru.remove(0);
                }
                p.end_window(|_| cache.clone(), |_| slots);
                let c = cache.clone();
                for s in p.plan_ranked(LRU_VARIANT, |_| c.clone(), |_| 0, usize::MAX, true) {
                    let o = s.outgoing.expect("a full cache");
                    cache.retain(|&x| x != o);
                    cache.push(s.incoming);
                }
                let (mut a, mut b) = (cache.clone(), lru.clone());
                a.sort();
                b.sort();
                assert_eq!(a, b, "ne {ne} k {k} slots {slots} window {w}");
                let shadow: Vec<usize> = (0..ne).filter(|&e| p.shadow[LRU_VARIANT][e]).collect();
                assert_eq!(shadow, b, "shadow, window {w}");
            }
            assert_eq!(hits, lru_hits);
            assert!(hits > 0);
        }
    }
}
