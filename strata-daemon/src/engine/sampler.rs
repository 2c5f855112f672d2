//! Token sampling: repetition penalty, then greedy (temperature 0) or
//! temperature → top-k → top-p → min-p → weighted draw with a seeded RNG.
//! The penalty follows llama.cpp's rule (positive logits divided, negative
//! ones multiplied by the penalty).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling parameters (validated by [`crate::engine::request`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// In (0, 1]; 1 = off.
    pub top_p: f32,
    /// In [0, 1); 0 = off.
    pub min_p: f32,
    /// > 0; 1 = off.
    pub repeat_penalty: f32,
    /// Tokens the penalty looks back over.
    pub repeat_last_n: usize,
    /// RNG seed.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0x5eed,
        }
    }
}

/// A sampler with its RNG state for one request.
pub struct Sampler {
    p: SamplingParams,
    rng: StdRng,
    /// The candidates' [`rank_key`]s (reused between tokens).
    cand: Vec<u64>,
}

impl Sampler {
    /// New sampler seeded with `p.seed`.
    pub fn new(p: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(p.seed);
        Sampler { p, rng, cand: Vec::new() }
    }

    /// Picks the next token from `logits` (`n_vocab` values, modified in
    /// place by the penalty) given the tokens so far (`history`).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.p;
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &history[start..] {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 { *l / p.repeat_penalty } else { *l * p.repeat_penalty };
                    }
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let best = argmax(logits);
        if !(logits.get(best as usize).copied().unwrap_or(0.0) / p.temperature).is_finite() {
            // a temperature so small that the best logit over it overflows: its limit, the greedy pick (the draw
            // is still taken, as for every sample)
            let _ = self.rng.random::<f32>();
            return best;
        }
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().map(|(i, &l)| rank_key(i as u32, l / p.temperature)));
        let n = self.cand.len();
        if p.top_k > 0 && p.top_k < n {
            // the k best in order, then the few that are left as below
            order_prefix(&mut self.cand, 0, p.top_k);
            self.cand.truncate(p.top_k);
        }
        let (top_p, min_p) = (p.top_p, p.min_p);
        let u = || self.rng.random::<f32>();
        draw(&mut self.cand, top_p, min_p, u)
    }
}

/// The sampling-order key of token `id` with scaled logit `z`: ascending keys are the sampling order (the higher
/// `z` first, ties by the lower id). The high half is `z`'s bits made to sort as the value (descending), the low
/// half the id, so orderings are integer comparisons.
fn rank_key(id: u32, z: f32) -> u64 {
    let b = z.to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (((!ascending) as u64) << 32) | id as u64
}

/// The scaled logit of a [`rank_key`].
fn key_z(k: u64) -> f32 {
    let ascending = !((k >> 32) as u32);
    f32::from_bits(if ascending >> 31 == 1 { ascending & 0x7fff_ffff } else { !ascending })
}

/// Puts `c[done..want]` in sampling order, given `c[..done]` in order and no key after it ranked before
/// `c[done - 1]`: a selection of the next `want - done`, then a sort of those only. Returns the new ordered
/// length, `min(want, c.len())`.
fn order_prefix(c: &mut [u64], done: usize, want: usize) -> usize {
    let want = want.min(c.len());
    if want > done {
        if want < c.len() {
            c[done..].select_nth_unstable(want - done - 1);
        }
        c[done..want].sort_unstable();
    }
    want
}

/// The weighted draw over the candidates' [`rank_key`]s `c`: softmax, top-p (the shortest prefix in sampling
/// order whose probabilities reach `top_p`), min-p (those at least `min_p` × the best's probability), then a
/// draw `u() · total` walked down the kept ones in order; returns the token id. The same as sorting every
/// candidate first — the probabilities are computed alike (f32 `exp(z − max)`, their sum in f64, each divided by
/// it) — but only the prefix the cuts and the walk reach is put in order (a vocabulary of 151,936 took 14 ms per
/// token to sort on a 2-core VM), and a walk past [`WALK_ORDERED`] candidates halves the rest by their mass
/// instead of ordering it. Where the walk stays in the ordered prefix (a peaked distribution, the usual case) the
/// token is the full sort's but for the order of the tail's sums (the f64 sum of all, the f32 total when nothing
/// is cut): another token only when the draw falls within a few f32 rounding steps of a boundary. Past it (a flat
/// distribution) the full sort's own f32 walk drifts with its ~10^5 roundings: the two can pick different tokens
/// of near-equal probability, both where the draw falls (the exact mass before the token within 1e-4 of it,
/// tested).
fn draw(c: &mut [u64], top_p: f32, min_p: f32, mut u: impl FnMut() -> f32) -> u32 {
    let n = c.len();
    let mx = c.iter().min().map_or(0.0, |&k| key_z(k));
    // each key now carries its weight exp(z − max) instead of z: the same order (exp is monotonic; weights that
    // round equal keep the lower id first, as equal logits do), and no exp per look-up
    let mut sum = 0f64;
    for k in c.iter_mut() {
        let w = (key_z(*k) - mx).exp();
        sum += w as f64;
        *k = rank_key(*k as u32, w);
    }
    let prob = |k: u64| (key_z(k) as f64 / sum) as f32;
    // c[..done] is in sampling order; `at(i)` extends it (eight times as far each time) to reach i
    let mut done = 0;
    let at = |c: &mut [u64], done: &mut usize, i: usize| -> u64 {
        if i >= *done {
            *done = order_prefix(c, *done, (i + 1).max(8 * *done).max(64));
        }
        c[i]
    };
    let mut keep = n;
    if top_p < 1.0 {
        let mut cum = 0f32;
        for i in 0..n {
            cum += prob(at(c, &mut done, i));
            if cum >= top_p {
                keep = i + 1;
                break;
            }
        }
    }
    if min_p > 0.0 {
        let thr = prob(at(c, &mut done, 0)) * min_p;
        let mut i = 0;
        while i < keep && prob(at(c, &mut done, i)) >= thr {
            i += 1;
        }
        keep = i.max(1);
    }
    // the total over the kept ones: in order where they are ordered, the rest in any order
    let total: f32 = if keep <= done {
        c[..keep].iter().map(|&k| prob(k)).sum()
    } else {
        let head: f32 = c[..done].iter().map(|&k| prob(k)).sum();
        c[done..keep].iter().fold(head, |t, &k| t + prob(k))
    };
    let mut r = u() * total;
    // the walk: down the ordered prefix, grown as far as WALK_ORDERED; a draw that goes further (a flat
    // distribution) finds its token by halving instead: the upper half's mass either covers the rest of the draw
    // (go into it) or is taken off (go into the lower half)
    let mut i = 0;
    while i < keep && (i < done || done < WALK_ORDERED) {
        let k = at(c, &mut done, i);
        r -= prob(k);
        if r <= 0.0 {
            return k as u32;
        }
        i += 1;
    }
    if i == keep {
        return at(c, &mut done, keep - 1) as u32;
    }
    // c[lo..hi] holds the token the draw ends on, ranked after c[..lo], unordered (the cuts, when they cut, left
    // every kept candidate in order, so only an uncut list gets here)
    debug_assert!(keep == n && i == done);
    let (mut lo, mut hi) = (i, keep);
    while hi - lo > 64 {
        let m = (hi - lo) / 2;
        c[lo..hi].select_nth_unstable(m);
        let mass: f32 = c[lo..=lo + m].iter().map(|&k| prob(k)).sum();
        if r - mass <= 0.0 {
            hi = lo + m + 1;
        } else {
            r -= mass;
            lo += m + 1;
        }
    }
    c[lo..hi].sort_unstable();
    for &k in &c[lo..hi] {
        r -= prob(k);
        if r <= 0.0 {
            return k as u32;
        }
    }
    c[hi - 1] as u32
}

/// How far the draw's walk puts the candidates in order before it halves instead (see [`draw`]).
const WALK_ORDERED: usize = 512;

/// Index of the largest value (first one on ties; NaNs are skipped; 0 for an empty slice or all NaN). Two
/// passes over 16-wide chunks (the maximum, then the first chunk that holds it) that the compiler vectorizes:
/// on a 152k-entry vocabulary ~35 µs per token against ~140 µs for an element-by-element scan.
pub fn argmax(v: &[f32]) -> u32 {
    const W: usize = 16;
    let mut m = [f32::NEG_INFINITY; W];
    let chunks = v.chunks_exact(W);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..W {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    let best = m.iter().chain(rest).fold(f32::NEG_INFINITY, |b, &x| if x > b { x } else { b });
    for (k, c) in v.chunks(W).enumerate() {
        if c.iter().fold(false, |hit, &x| hit | (x == best)) {
            return (k * W + c.iter().position(|&x| x == best).unwrap_or(0)) as u32;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams { temperature: t, ..Default::default() }
    }

    #[test]
    fn argmax_takes_the_first_of_ties_and_skips_nans() {
        // the element-by-element definition, on lengths around the chunk width
        let naive = |v: &[f32]| {
            let mut best = 0;
            for (i, &x) in v.iter().enumerate() {
                if x > v[best] || v[best].is_nan() && !x.is_nan() {
                    best = i;
                }
            }
            best as u32
        };
        let mut seed = 7u64;
        for n in [1usize, 5, 15, 16, 17, 31, 32, 33, 100, 1000, 151_936] {
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 33) % 1000) as f32 - 500.0
                })
                .collect();
            assert_eq!(argmax(&v), naive(&v), "n = {n}");
        }
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, 2.0, f32::NAN, 2.0]), 2);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 20]), 0);
        assert_eq!(argmax(&[]), 0);
        let mut late = vec![0.0f32; 40];
        late[37] = 1.0;
        assert_eq!(argmax(&late), 37);
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0], &[]), 1);
    }

    #[test]
    fn seed_repeats_and_top_k_1_is_greedy() {
        let logits = vec![1.0, 1.1, 0.9, 1.05, 0.2];
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params(1.0) });
            (0..20).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert!(run(1) != run(2) || run(1) != run(3));
        let mut s = Sampler::new(SamplingParams { top_k: 1, ..params(1.0) });
        for _ in 0..10 {
            assert_eq!(s.sample(&mut logits.clone(), &[]), 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probabilities ~ [0.88, 0.12, ~0]: top_p 0.5 keeps only token 0.
        let logits = vec![4.0, 2.0, -10.0];
        let mut s = Sampler::new(SamplingParams { top_p: 0.5, ..params(1.0) });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone(), &[]), 0);
        }
        let mut s = Sampler::new(SamplingParams { min_p: 0.5, ..params(1.0) });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone(), &[]), 0);
        }
    }

    /// Sampling order by its definition: the higher scaled logit first, ties by the lower id.
    fn by_rank(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
        b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0))
    }

    /// The draw by its definition: every candidate sorted first (the sampler's code before the partial order).
    fn draw_sorted(c: &mut Vec<(u32, f32)>, top_p: f32, min_p: f32, u: f32) -> u32 {
        c.sort_unstable_by(by_rank);
        let mx = c[0].1;
        let mut sum = 0f64;
        for x in c.iter_mut() {
            x.1 = (x.1 - mx).exp();
            sum += x.1 as f64;
        }
        for x in c.iter_mut() {
            x.1 = (x.1 as f64 / sum) as f32;
        }
        if top_p < 1.0 {
            let mut cum = 0f32;
            let keep = c.iter().position(|x| {
                cum += x.1;
                cum >= top_p
            });
            c.truncate(keep.map_or(c.len(), |i| i + 1));
        }
        if min_p > 0.0 {
            let thr = c[0].1 * min_p;
            let keep = c.iter().take_while(|x| x.1 >= thr).count().max(1);
            c.truncate(keep);
        }
        let total: f32 = c.iter().map(|x| x.1).sum();
        let mut r = u * total;
        for x in c.iter() {
            r -= x.1;
            if r <= 0.0 {
                return x.0;
            }
        }
        c.last().unwrap().0
    }

    #[test]
    fn rank_keys_sort_as_the_logits_and_give_them_back() {
        let zs = [-1e30f32, -3.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.25, 1.0, 7.0, 1e30, f32::INFINITY];
        for (i, &z) in zs.iter().enumerate() {
            assert_eq!(key_z(rank_key(i as u32, z)).to_bits(), z.to_bits(), "{z}");
        }
        let mut keys: Vec<u64> = zs.iter().enumerate().map(|(i, &z)| rank_key(i as u32, z)).collect();
        keys.sort_unstable();
        // the highest logit first (+0 before -0: the bits' order; equal logits by id)
        let order: Vec<u32> = keys.iter().map(|&k| k as u32).collect();
        assert_eq!(order, vec![11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]);
        assert!(rank_key(3, 1.0) < rank_key(4, 1.0) && rank_key(9, 2.0) < rank_key(1, 1.0));
    }

    #[test]
    fn the_partial_order_draws_what_a_full_sort_draws() {
        // logits of real shapes: a few strong tokens over a long tail, ties included, vocabularies from tiny to
        // Qwen3's; every cut and draws spread over [0, 1)
        let mut seed = 11u64;
        let mut rnd = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut drawn = std::collections::HashSet::new();
        for n in [3usize, 50, 200, 5_000, 151_936] {
            let logits: Vec<f32> = (0..n)
                .map(|i| {
                    let x = rnd();
                    // every 7th token ties with its neighbour; a handful stand out
                    let base = if i % 7 == 1 { 0.0 } else { x * 12.0 - 6.0 };
                    if i % 997 == 3 {
                        base + 14.0
                    } else {
                        (base * 8.0).round() / 8.0
                    }
                })
                .collect();
            for (t, top_p, min_p) in
                [(1.0, 1.0, 0.0), (0.7, 1.0, 0.0), (0.8, 0.95, 0.0), (1.2, 0.5, 0.05), (2.0, 1.0, 0.1)]
            {
                for _ in 0..12 {
                    let u = rnd();
                    let mut c: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / t)).collect();
                    let mut keys: Vec<u64> = c.iter().map(|&(i, z)| rank_key(i, z)).collect();
                    let want = draw_sorted(&mut c, top_p, min_p, u);
                    assert_eq!(draw(&mut keys, top_p, min_p, || u), want, "n {n}, T {t}, top_p {top_p}, min_p {min_p}");
                    drawn.insert(want);
                }
            }
        }
        // a flat distribution over Qwen3's vocabulary: the walk goes past the ordered prefix and halves. There
        // the full sort's own f32 walk drifts (each of ~10^5 subtractions rounds at the draw's scale), so the check
        // is the token's place: the exact (f64) mass ranked before it is within 1e-4 of the draw
        let flat: Vec<f32> = (0..151_936).map(|_| rnd() * 0.05).collect();
        let mut order: Vec<(u32, f32)> = flat.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        order.sort_unstable_by(by_rank);
        let mx = order[0].1;
        let w: Vec<f64> = order.iter().map(|x| (x.1 - mx).exp() as f64).collect();
        let sum: f64 = w.iter().sum();
        let mut before = vec![0f64; flat.len()];
        let mut cum = 0f64;
        for (x, wx) in order.iter().zip(&w) {
            before[x.0 as usize] = cum / sum;
            cum += wx;
        }
        for _ in 0..24 {
            let u = rnd();
            let mut keys: Vec<u64> = flat.iter().enumerate().map(|(i, &l)| rank_key(i as u32, l)).collect();
            let got = draw(&mut keys, 1.0, 0.0, || u);
            assert!((before[got as usize] - u as f64).abs() < 1e-4, "flat, u {u}: token at {}", before[got as usize]);
            drawn.insert(got);
        }
        // the draws did not all land on one token
        assert!(drawn.len() > 40, "{} tokens drawn", drawn.len());
    }

    #[test]
    fn a_temperature_that_overflows_the_logits_picks_greedily() {
        // 1e-38: the scaled logits stay finite (3e38); 1e-40: the best ones overflow to infinity
        for t in [1e-38, 1e-40] {
            let mut s = Sampler::new(params(t));
            for _ in 0..5 {
                assert_eq!(s.sample(&mut [1.0, 3.0, 2.0, -1.0], &[]), 1, "temperature {t}");
            }
        }
    }

    #[test]
    fn repeat_penalty_moves_greedy_choice() {
        let mut s = Sampler::new(SamplingParams { repeat_penalty: 2.0, ..params(0.0) });
        assert_eq!(s.sample(&mut [2.0, 1.5], &[0]), 1);
        assert_eq!(s.sample(&mut [-1.0, -1.5], &[1]), 0);
    }
}
