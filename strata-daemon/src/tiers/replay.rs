//! Replays a routing trace (the `--dump-routing` JSON Lines, docs/FORMATS.md) through cache policies:
//! the adaptive tier's rule ([`super::policy`], the same code the engine runs), LRU, and Belady's optimum,
//! each with `slots` VRAM slots per layer; also measures the trace's one-token reuse and per-layer skew.
//!
//! Accounting (DESIGN.md §3): a window is one token's pass through all layers; a lookup is one distinct
//! (layer, expert) a window needs; a hit is a lookup whose expert is cached when the window starts. Misses
//! never stall: LRU and Belady may insert missed experts after the window (demand fetch), the adaptive tier
//! changes the cache only at its rounds. Belady here is the offline optimum among demand-fetch policies with
//! bypass: after each window a layer keeps the `slots` experts of (cache ∪ window) whose next use is nearest.

use std::collections::HashMap;
use std::io::BufRead;

use serde::{Deserialize, Serialize};

use super::policy::{plan_adaptive_round, AdaptKnobs, Usage};

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
    /// Request id (the engine's sequence number).
    pub seq: u64,
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
}

/// One window: the experts each layer's token routed to (index = layer; empty = no record).
#[derive(Debug, Clone)]
pub struct Window {
    /// Request id.
    pub seq: u64,
    /// Token position.
    pub pos: u64,
    /// Whether the token came from decode (false: prefill).
    pub decode: bool,
    /// Expert ids by rank, per layer.
    pub layers: Vec<Vec<u32>>,
}

/// A trace as windows, in file order.
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

impl Trace {
    /// Reads JSON Lines records; consecutive records with the same (seq, pos, phase) form one window.
    /// Errors: unreadable input, a malformed line ([`TraceError::Bad`] with its number), no selected record.
    pub fn read(r: impl BufRead, filter: PhaseFilter) -> Result<Trace, TraceError> {
        let mut windows: Vec<Window> = Vec::new();
        let (mut n_layer, mut n_expert, mut top_k) = (0usize, 0usize, 0usize);
        for (i, line) in r.lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let ev: RouteEvent =
                serde_json::from_str(&line).map_err(|e| TraceError::Bad { line: i + 1, msg: e.to_string() })?;
            let decode = match ev.phase.as_str() {
                "decode" => true,
                "prefill" => false,
                p => return Err(TraceError::Bad { line: i + 1, msg: format!("unknown phase {p:?}") }),
            };
            if ev.experts.is_empty() || ev.experts.len() != ev.weights.len() {
                return Err(TraceError::Bad {
                    line: i + 1,
                    msg: "experts and weights must be non-empty and equal in length".into(),
                });
            }
            if !decode && filter == PhaseFilter::Decode {
                continue;
            }
            let l = ev.layer as usize;
            if l >= 4096 || ev.experts.iter().any(|&e| e >= 1 << 16) {
                return Err(TraceError::Bad { line: i + 1, msg: "layer or expert id out of range".into() });
            }
            n_layer = n_layer.max(l + 1);
            n_expert = n_expert.max(ev.experts.iter().map(|&e| e as usize + 1).max().unwrap_or(0));
            top_k = top_k.max(ev.experts.len());
            let same = windows.last().is_some_and(|w| w.seq == ev.seq && w.pos == ev.pos && w.decode == decode);
            if !same {
                windows.push(Window { seq: ev.seq, pos: ev.pos, decode, layers: Vec::new() });
            }
            let w = windows.last_mut().expect("pushed");
            if w.layers.len() <= l {
                w.layers.resize(l + 1, Vec::new());
            }
            let mut ids = ev.experts;
            let mut seen = Vec::with_capacity(ids.len());
            ids.retain(|e| {
                if seen.contains(e) {
                    false
                } else {
                    seen.push(*e);
                    true
                }
            });
            w.layers[l] = ids;
        }
        if windows.is_empty() {
            return Err(TraceError::Empty(if filter == PhaseFilter::Decode { "decode" } else { "routing" }));
        }
        for w in &mut windows {
            w.layers.resize(n_layer, Vec::new());
        }
        Ok(Trace { n_layer, n_expert, top_k, windows })
    }
}

/// A cache policy to replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// The adaptive tier's rule with these knobs ([`super::policy`]); the cache starts empty.
    Adaptive(AdaptKnobs),
    /// Least recently used, demand fetch.
    Lru,
    /// Belady's offline optimum (demand fetch with bypass).
    Belady,
}

impl Policy {
    /// Short name: `adaptive`, `lru`, `belady`.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Adaptive(_) => "adaptive",
            Policy::Lru => "lru",
            Policy::Belady => "belady",
        }
    }
}

/// Result of one replay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Outcome {
    /// Distinct (layer, expert) lookups over all windows.
    pub lookups: u64,
    /// Lookups whose expert was cached when the window started.
    pub hits: u64,
    /// Experts moved into the cache (swaps for adaptive, inserts for LRU/Belady).
    pub loads: u64,
}

impl Outcome {
    /// hits / lookups (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
}

/// Replays `trace` through `policy` with `slots` slots per layer.
pub fn replay(trace: &Trace, policy: Policy, slots: usize) -> Outcome {
    match policy {
        Policy::Adaptive(k) => replay_adaptive(trace, k, slots),
        Policy::Lru => replay_demand(trace, slots, false),
        Policy::Belady => replay_demand(trace, slots, true),
    }
}

fn replay_adaptive(trace: &Trace, knobs: AdaptKnobs, slots: usize) -> Outcome {
    let mut usage = Usage::new(trace.n_layer, trace.n_expert);
    let mut cache: Vec<Vec<usize>> = vec![Vec::new(); trace.n_layer];
    let mut out = Outcome { lookups: 0, hits: 0, loads: 0 };
    let mut windows = 0u64;
    for w in &trace.windows {
        for (l, ids) in w.layers.iter().enumerate() {
            for &e in ids {
                out.lookups += 1;
                if cache[l].contains(&(e as usize)) {
                    out.hits += 1;
                }
                usage.record(l, e as usize);
            }
        }
        windows += 1;
        if knobs.active() && windows.is_multiple_of(knobs.every as u64) {
            let plan = plan_adaptive_round(
                &usage,
                |l| cache[l].clone(),
                |l| slots.saturating_sub(cache[l].len()),
                knobs.swaps as usize,
            );
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

fn replay_demand(trace: &Trace, slots: usize, belady: bool) -> Outcome {
    let mut out = Outcome { lookups: 0, hits: 0, loads: 0 };
    let n_w = trace.windows.len();
    for l in 0..trace.n_layer {
        // next_use[w][j]: the next window after w that needs the j-th expert of window w (n_w = never)
        let next_use: Vec<Vec<usize>> = if belady {
            let mut nxt: HashMap<u32, usize> = HashMap::new();
            let mut v = vec![Vec::new(); n_w];
            for w in (0..n_w).rev() {
                let ids = &trace.windows[w].layers[l];
                v[w] = ids.iter().map(|e| *nxt.get(e).unwrap_or(&n_w)).collect();
                for &e in ids {
                    nxt.insert(e, w);
                }
            }
            v
        } else {
            Vec::new()
        };
        // cache entries: (expert, key, fresh) with key = last use (LRU) or next use (Belady)
        let mut cache: Vec<(u32, usize, bool)> = Vec::with_capacity(slots + trace.top_k);
        for (w, win) in trace.windows.iter().enumerate() {
            let ids = &win.layers[l];
            for (j, &e) in ids.iter().enumerate() {
                out.lookups += 1;
                // within a window, a higher rank counts as more recently used (LRU)
                let key = if belady { next_use[w][j] } else { w * 64 + (63 - j.min(63)) };
                match cache.iter_mut().find(|c| c.0 == e) {
                    Some(c) => {
                        out.hits += 1;
                        c.1 = key;
                    }
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
