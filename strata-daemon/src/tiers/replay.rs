//! Replays a routing trace (the `--dump-routing` JSON Lines, docs/FORMATS.md) through cache policies: the
//! engine's policies ([`super::policy`]'s seed rule and [`super::lrfu`], the same code the engine runs), LRU,
//! Belady's optimum, and a frequency oracle ([`Policy::FreqOracle`], a reference no engine can run); also measures
//! the trace's one-token reuse and per-layer skew, and the accuracy of the next-layer prediction when the trace
//! carries one.
//!
//! Accounting (DESIGN.md §3): a window is one token's pass through all layers; a lookup is one distinct
//! (layer, expert) a window needs; a hit is a lookup whose expert is cached when the window starts. Misses
//! never stall: LRU and Belady may insert missed experts after the window (demand fetch), the engine's policies
//! change the cache only at their rounds. Belady here is the offline optimum among demand-fetch policies with
//! bypass: after each window a layer keeps the experts of (cache ∪ window) whose next use is nearest.
//!
//! The cache starts as the engine fills it ([`initial_fill`]: `slots × n_layer` slots in the engine's placement
//! order, a profile's ranks first), so `--adapt-every 0` replays the engine's static placement. A warm replay
//! runs the whole trace through one cache; a cold one starts every request (`seq`) from the initial fill with
//! fresh policy state.

use std::collections::HashMap;
use std::io::BufRead;

use serde::{Deserialize, Serialize};

use super::lrfu::Lrfu;
use super::policy::{plan_adaptive_round, AdaptKnobs, Swap, Usage};

/// Errors reading a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be read.
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a routing record; names the 1-based line.
    #[error("trace line {line}: {msg}")]
    Bad {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// No record of the selected phases.
    #[error("the trace has no {0} records")]
    Empty(&'static str),
}

/// One routing record of `--dump-routing` (docs/FORMATS.md): the experts one token chose at one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteEvent {
    /// Request id: an opaque number or string (the engine writes its sequence number).
    pub seq: serde_json::Value,
    /// Token position in the request's sequence.
    pub pos: u64,
    /// `"prefill"` or `"decode"`.
    pub phase: String,
    /// Layer index.
    pub layer: u32,
    /// Expert ids by rank (top-1 first).
    pub experts: Vec<u32>,
    /// Renormalised router weights by rank (sum 1).
    pub weights: Vec<f32>,
    /// Experts predicted for this layer before it ran (the layer's router applied to the previous layer's
    /// hidden state), by rank; absent when no prediction was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Vec<u32>>,
}

/// One window: the experts each layer's token routed to (index = layer; empty = no record).
#[derive(Debug, Clone)]
pub struct Window {
    /// Request id (a JSON number or string, as text).
    pub seq: String,
    /// Token position.
    pub pos: u64,
    /// Whether the token came from decode (false: prefill).
    pub decode: bool,
    /// Expert ids by rank, per layer.
    pub layers: Vec<Vec<u32>>,
    /// Predicted expert ids per layer (`None`: no prediction recorded).
    pub predicted: Vec<Option<Vec<u32>>>,
}

/// A trace as windows, in order of each window's first record.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Layers (highest layer index seen + 1).
    pub n_layer: usize,
    /// Experts per layer (highest expert id seen + 1).
    pub n_expert: usize,
    /// Experts per token (the longest record's length: top-k).
    pub top_k: usize,
    /// Windows in order.
    pub windows: Vec<Window>,
}

/// Which records a replay uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PhaseFilter {
    /// Decode records only (what the engine's usage counts and hit rate see).
    Decode,
    /// Prefill and decode records; every prompt token is a window of its own.
    All,
}

/// Expert ids in rank order with repeats dropped.
fn distinct(mut ids: Vec<u32>) -> Vec<u32> {
    let mut seen = Vec::with_capacity(ids.len());
    ids.retain(|e| {
        if seen.contains(e) {
            false
        } else {
            seen.push(*e);
            true
        }
    });
    ids
}

impl Trace {
    /// Reads JSON Lines records; records with the same (seq, pos, phase) form one window wherever they are in
    /// the file (a layer-major file reads as the same windows as a token-major one); windows are ordered by
    /// their first record. Errors: unreadable input, a malformed line or a layer given twice for one token
    /// ([`TraceError::Bad`] with its number), no selected record.
    pub fn read(r: impl BufRead, filter: PhaseFilter) -> Result<Trace, TraceError> {
        let mut windows: Vec<Window> = Vec::new();
        let mut index: HashMap<(String, u64, bool), usize> = HashMap::new();
        let (mut n_layer, mut n_expert, mut top_k) = (0usize, 0usize, 0usize);
        for (i, line) in r.lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |msg: String| TraceError::Bad { line: i + 1, msg };
            let ev: RouteEvent = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
            let decode = match ev.phase.as_str() {
                "decode" => true,
                "prefill" => false,
                p => return Err(bad(format!("unknown phase {p:?}"))),
            };
            let seq = match &ev.seq {
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::String(s) => s.clone(),
                v => return Err(bad(format!("seq must be a number or a string, got {v}"))),
            };
            if ev.experts.is_empty() || ev.experts.len() != ev.weights.len() {
                return Err(bad("experts and weights must be non-empty and equal in length".into()));
            }
            if !decode && filter == PhaseFilter::Decode {
                continue;
            }
            let l = ev.layer as usize;
            if l >= 4096 {
                return Err(bad(format!("layer {l} is out of range (at most 4095)")));
            }
            if let Some(e) = ev.experts.iter().chain(ev.predicted.iter().flatten()).find(|&&e| e >= 1 << 16) {
                return Err(bad(format!("expert id {e} is out of range (at most 65535)")));
            }
            n_layer = n_layer.max(l + 1);
            n_expert = n_expert.max(ev.experts.iter().map(|&e| e as usize + 1).max().unwrap_or(0));
            if let Some(p) = &ev.predicted {
                n_expert = n_expert.max(p.iter().map(|&e| e as usize + 1).max().unwrap_or(0));
            }
            top_k = top_k.max(ev.experts.len());
            let key = (seq, ev.pos, decode);
            let wi = match index.get(&key) {
                Some(&wi) => wi,
                None => {
                    index.insert(key.clone(), windows.len());
                    windows.push(Window { seq: key.0, pos: ev.pos, decode, layers: Vec::new(), predicted: Vec::new() });
                    windows.len() - 1
                }
            };
            let w = &mut windows[wi];
            if w.layers.len() <= l {
                w.layers.resize(l + 1, Vec::new());
                w.predicted.resize(l + 1, None);
            }
            if !w.layers[l].is_empty() {
                return Err(bad(format!("layer {l} of request {:?} position {} given twice", w.seq, w.pos)));
            }
            w.layers[l] = distinct(ev.experts);
            w.predicted[l] = ev.predicted.map(distinct);
        }
        if windows.is_empty() {
            return Err(TraceError::Empty(if filter == PhaseFilter::Decode { "decode" } else { "routing" }));
        }
        for w in &mut windows {
            w.layers.resize(n_layer, Vec::new());
            w.predicted.resize(n_layer, None);
        }
        Ok(Trace { n_layer, n_expert, top_k, windows })
    }

    /// The windows of each request (`seq`), requests in order of their first window.
    pub fn requests(&self) -> Vec<Trace> {
        let mut order: Vec<&str> = Vec::new();
        let mut by: HashMap<&str, Vec<Window>> = HashMap::new();
        for w in &self.windows {
            by.entry(&w.seq)
                .or_insert_with(|| {
                    order.push(&w.seq);
                    Vec::new()
                })
                .push(w.clone());
        }
        order.into_iter().map(|s| Trace { windows: by.remove(s).unwrap_or_default(), ..*self }).collect()
    }
}

/// The engine's initial fill of a VRAM cache of `slots_per_layer × n_layer` slots (the store's placement order:
/// profile rank first — `ranks[layer × n_expert + expert]`, lower is hotter, `None` unranked — then expert-major
/// across layers), as the experts each layer holds. Without ranks every layer holds experts `0 ..
/// slots_per_layer`.
pub fn initial_fill(
    n_layer: usize,
    n_expert: usize,
    slots_per_layer: usize,
    ranks: Option<&[Option<u32>]>,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..n_layer * n_expert).collect();
    order.sort_by_key(|&i| {
        (ranks.and_then(|r| r.get(i).copied().flatten()).unwrap_or(u32::MAX), i % n_expert, i / n_expert)
    });
    let mut fill = vec![Vec::new(); n_layer];
    for i in order.into_iter().take(slots_per_layer * n_layer) {
        fill[i / n_expert].push(i % n_expert);
    }
    fill
}

/// A cache policy to replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// The seed rule ([`super::policy::plan_adaptive_round`], the reference engine's) with these knobs.
    Seed(AdaptKnobs),
    /// The `lrfu` policy ([`super::lrfu`]) with these knobs (`swaps`; `every` 0 = static, else a round every
    /// window; its decay is its own).
    Lrfu(AdaptKnobs),
    /// Least recently used, demand fetch.
    Lru,
    /// Belady's offline optimum (demand fetch with bypass).
    Belady,
    /// A reference for online frequency and recency policies, not one the engine can run: it knows in advance
    /// how often each request will route to each expert (its counts over the whole request) and after each
    /// window keeps the cache's size of the request's most-used experts among those cached and those the window
    /// used, either with the window's experts forced in (demand admission) or not (bypass), whichever hits more.
    /// A policy that learns the counts as it goes can at best approach it; Belady also knows the order.
    FreqOracle,
}

impl Policy {
    /// Short name: `seed`, `lrfu`, `lru`, `belady`, `freq-oracle`.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Seed(_) => "seed",
            Policy::Lrfu(_) => "lrfu",
            Policy::Lru => "lru",
            Policy::Belady => "belady",
            Policy::FreqOracle => "freq-oracle",
        }
    }
}

/// Result of one replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Outcome {
    /// Distinct (layer, expert) lookups over all windows.
    pub lookups: u64,
    /// Lookups whose expert was cached when the window started.
    pub hits: u64,
    /// Experts moved into the cache (swaps for the engine's policies, inserts for LRU/Belady).
    pub loads: u64,
    /// Missed lookups the trace's prediction named (a prefetcher would have started them early).
    pub predicted_misses: u64,
}

impl Outcome {
    /// hits / lookups (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.lookups)
    }

    /// (hits + predicted misses) / lookups: the hit rate with a prefetcher that loads every predicted expert
    /// while the layer before runs.
    pub fn prefetch_hit_rate(&self) -> f64 {
        ratio(self.hits + self.predicted_misses, self.lookups)
    }

    fn add(&mut self, o: Outcome) {
        self.lookups += o.lookups;
        self.hits += o.hits;
        self.loads += o.loads;
        self.predicted_misses += o.predicted_misses;
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// How a replay's cache starts and lives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayOpts<'a> {
    /// VRAM slots per layer (the engine's cache holds `slots × n_layer`).
    pub slots: usize,
    /// Profile ranks for the initial fill ([`initial_fill`]); `None`: the engine's default order.
    pub ranks: Option<&'a [Option<u32>]>,
    /// Every request starts from the initial fill with fresh policy state (false: one warm cache).
    pub cold: bool,
}

impl ReplayOpts<'_> {
    /// A warm cache of `slots` per layer in the default fill.
    pub fn warm(slots: usize) -> ReplayOpts<'static> {
        ReplayOpts { slots, ranks: None, cold: false }
    }
}

/// Replays `trace` through `policy` with `slots` slots per layer, one warm cache in the engine's default fill.
pub fn replay(trace: &Trace, policy: Policy, slots: usize) -> Outcome {
    replay_with(trace, policy, &ReplayOpts::warm(slots))
}

/// Replays `trace` through `policy` as `opts` says (a cold replay: each request on its own, outcomes summed).
pub fn replay_with(trace: &Trace, policy: Policy, opts: &ReplayOpts<'_>) -> Outcome {
    let fill = initial_fill(trace.n_layer, trace.n_expert, opts.slots, opts.ranks);
    if !opts.cold {
        return replay_one(trace, policy, &fill);
    }
    let mut out = Outcome::default();
    for r in trace.requests() {
        out.add(replay_one(&r, policy, &fill));
    }
    out
}

fn replay_one(trace: &Trace, policy: Policy, fill: &[Vec<usize>]) -> Outcome {
    match policy {
        Policy::Seed(k) | Policy::Lrfu(k) => replay_rounds(trace, policy, k, fill),
        Policy::Lru => replay_demand(trace, fill, false),
        Policy::Belady => replay_demand(trace, fill, true),
        Policy::FreqOracle => {
            let (a, b) = (replay_freq_oracle(trace, fill, true), replay_freq_oracle(trace, fill, false));
            if a.hits >= b.hits {
                a
            } else {
                b
            }
        }
    }
}

/// [`Policy::FreqOracle`] with demand admission (`demand`) or bypass.
fn replay_freq_oracle(trace: &Trace, fill: &[Vec<usize>], demand: bool) -> Outcome {
    let mut out = Outcome::default();
    // each request's routing entries per (layer, expert), over the whole request
    let mut counts: HashMap<&str, Vec<u32>> = HashMap::new();
    for w in &trace.windows {
        let c = counts.entry(w.seq.as_str()).or_insert_with(|| vec![0; trace.n_layer * trace.n_expert]);
        for (l, ids) in w.layers.iter().enumerate() {
            for &e in ids {
                c[l * trace.n_expert + e as usize] += 1;
            }
        }
    }
    let mut cache: Vec<Vec<usize>> = fill.to_vec();
    for w in &trace.windows {
        let c = &counts[w.seq.as_str()];
        for (l, ids) in w.layers.iter().enumerate() {
            if ids.is_empty() {
                continue;
            }
            let held = &mut cache[l];
            let slots = fill[l].len();
            for &e in ids {
                look(&mut out, w, l, e, held.contains(&(e as usize)));
            }
            let mut cand: Vec<usize> = held.clone();
            cand.extend(ids.iter().map(|&e| e as usize).filter(|e| !held.contains(e)));
            // forced-in first, then the request's count, then held, then lower id (each key computed once)
            let n_held = held.len();
            let mut keyed: Vec<(bool, std::cmp::Reverse<u32>, bool, usize)> = cand
                .iter()
                .enumerate()
                .map(|(i, &e)| {
                    let used = demand && ids.contains(&(e as u32));
                    (!used, std::cmp::Reverse(c[l * trace.n_expert + e]), i >= n_held, e)
                })
                .collect();
            keyed.sort_unstable();
            cand = keyed.into_iter().take(slots).map(|k| k.3).collect();
            out.loads += cand.iter().filter(|e| !held.contains(e)).count() as u64;
            *held = cand;
        }
    }
    out
}

/// Counts a window's lookup of `e` at layer `l` against `cached`.
fn look(out: &mut Outcome, w: &Window, l: usize, e: u32, cached: bool) {
    out.lookups += 1;
    if cached {
        out.hits += 1;
    } else if w.predicted[l].as_ref().is_some_and(|p| p.contains(&e)) {
        out.predicted_misses += 1;
    }
}

/// The engine's policies: the cache changes only at rounds, by the planned swaps.
fn replay_rounds(trace: &Trace, policy: Policy, knobs: AdaptKnobs, fill: &[Vec<usize>]) -> Outcome {
    let mut usage = Usage::new(trace.n_layer, trace.n_expert);
    let mut lrfu = Lrfu::new(trace.n_layer, trace.n_expert);
    let mut cache: Vec<Vec<usize>> = fill.to_vec();
    let size: Vec<usize> = fill.iter().map(Vec::len).collect();
    let mut out = Outcome::default();
    let mut windows = 0u64;
    for w in &trace.windows {
        for (l, ids) in w.layers.iter().enumerate() {
            for &e in ids {
                look(&mut out, w, l, e, cache[l].contains(&(e as usize)));
                usage.record(l, e as usize);
                lrfu.record(l, e as usize, 1);
            }
        }
        windows += 1;
        lrfu.end_window(|l| cache[l].clone(), |l| size[l]);
        let every = if matches!(policy, Policy::Lrfu(_)) { 1 } else { knobs.every as u64 };
        if knobs.active() && windows.is_multiple_of(every) {
            let cached = |l: usize| cache[l].clone();
            let free = |l: usize| size[l].saturating_sub(cache[l].len());
            let plan: Vec<Swap> = match policy {
                Policy::Lrfu(_) => lrfu.plan(cached, free, knobs.swaps as usize),
                _ => plan_adaptive_round(&usage, cached, free, knobs.swaps as usize),
            };
            for s in plan {
                let c = &mut cache[s.layer];
                match s.outgoing {
                    Some(o) => {
                        let i = c.iter().position(|&x| x == o).expect("victim is cached");
                        c[i] = s.incoming;
                    }
                    None => c.push(s.incoming),
                }
                out.loads += 1;
            }
            usage.decay(knobs.decay);
        }
    }
    out
}

fn replay_demand(trace: &Trace, fill: &[Vec<usize>], belady: bool) -> Outcome {
    let mut out = Outcome::default();
    let n_w = trace.windows.len();
    for (l, init) in fill.iter().enumerate().take(trace.n_layer) {
        let slots = init.len();
        // next_use[w][j]: the next window after w that needs the j-th expert of window w (n_w = never)
        let mut first_use: HashMap<u32, usize> = HashMap::new();
        let next_use: Vec<Vec<usize>> = if belady {
            let mut v = vec![Vec::new(); n_w];
            for w in (0..n_w).rev() {
                let ids = &trace.windows[w].layers[l];
                v[w] = ids.iter().map(|e| *first_use.get(e).unwrap_or(&n_w)).collect();
                for &e in ids {
                    first_use.insert(e, w);
                }
            }
            v
        } else {
            Vec::new()
        };
        // cache entries: (expert, key, fresh) with key = last use (LRU, the fill older than any window) or next
        // use (Belady)
        let mut cache: Vec<(u32, usize, bool)> = init
            .iter()
            .map(|&e| {
                let e = e as u32;
                (e, if belady { *first_use.get(&e).unwrap_or(&n_w) } else { 0 }, false)
            })
            .collect();
        for (w, win) in trace.windows.iter().enumerate() {
            let ids = &win.layers[l];
            for (j, &e) in ids.iter().enumerate() {
                // within a window, a higher rank counts as more recently used (LRU)
                let key = if belady { next_use[w][j] } else { (w + 1) * 64 + (63 - j.min(63)) };
                let hit = cache.iter().position(|c| c.0 == e);
                look(&mut out, win, l, e, hit.is_some());
                match hit {
                    Some(i) => cache[i].1 = key,
                    None => cache.push((e, key, true)),
                }
            }
            if belady {
                // never needed again: nothing to keep it for
                cache.retain(|c| c.1 < n_w);
                cache.sort_by_key(|c| c.1);
            } else {
                cache.sort_by_key(|c| std::cmp::Reverse(c.1));
            }
            cache.truncate(slots);
            for c in cache.iter_mut().filter(|c| c.2) {
                out.loads += 1;
                c.2 = false;
            }
        }
    }
    out
}

/// Accuracy of a trace's next-layer prediction: over every (window, layer) with a prediction, the share of the
/// routed experts the prediction named. `None` when the trace holds no prediction.
pub fn prediction_accuracy(trace: &Trace) -> Option<f64> {
    let (mut named, mut total) = (0u64, 0u64);
    for w in &trace.windows {
        for (ids, p) in w.layers.iter().zip(&w.predicted) {
            if let Some(p) = p {
                total += ids.len() as u64;
                named += ids.iter().filter(|e| p.contains(e)).count() as u64;
            }
        }
    }
    (total > 0).then(|| named as f64 / total as f64)
}
