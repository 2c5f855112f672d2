//! `strata-tools replay`: replays a `--dump-routing` trace through the cache policies and prints hit rates,
//! one-token reuse and per-layer skew.

use std::io::BufReader;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use strata::tiers::policy::{
    validate_decay, AdaptKnobs, DEFAULT_ADAPT_DECAY, DEFAULT_ADAPT_EVERY, DEFAULT_ADAPT_SWAPS,
};
use strata::tiers::profile::Profile;
use strata::tiers::replay::{prediction_accuracy, replay_with, PhaseFilter, Policy, ReplayOpts, Trace};
use strata::tiers::stats::trace_stats;

/// Policies the replay can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyName {
    /// The seed rule, the reference engine's (--adapt-every/--adapt-swaps/--adapt-decay); `adaptive` is an alias.
    #[value(alias = "adaptive")]
    Seed,
    /// Recency-weighted frequency with its decay and admission chosen online (--adapt-every/--adapt-swaps).
    Lrfu,
    /// Least recently used, demand fetch.
    Lru,
    /// Belady's offline optimum (demand fetch with bypass): the upper bound for demand caches.
    Belady,
    /// A reference, not an engine policy: each request's expert counts known in advance, the most-used kept
    /// (with or without demand admission, whichever hits more); what learning the counts online could approach.
    FreqOracle,
}

/// Records to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PhaseArg {
    /// Decode records only (what the engine's hit rate counts).
    Decode,
    /// Prefill records too, one window per prompt token.
    All,
}

/// How the cache lives across requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CacheArg {
    /// One cache for the whole trace (a daemon serving request after request).
    Warm,
    /// Every request starts from the initial fill with fresh policy state.
    Cold,
}

/// `replay` arguments.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Routing trace written by `--dump-routing` (JSON Lines, docs/FORMATS.md).
    #[arg(long)]
    trace: PathBuf,
    /// Cache sizes to replay, in slots per layer (comma-separated).
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    slots_per_layer: Vec<usize>,
    /// Policies to replay (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "seed,lrfu,lru,belady")]
    policy: Vec<PolicyName>,
    /// Engine policies: decode windows per round (0 = static: the initial fill is kept).
    #[arg(long, default_value_t = DEFAULT_ADAPT_EVERY)]
    adapt_every: u32,
    /// Engine policies: most swaps per round, all layers together (0 = static).
    #[arg(long, default_value_t = DEFAULT_ADAPT_SWAPS)]
    adapt_swaps: u32,
    /// Seed rule: usage decay per round, in (0, 1].
    #[arg(long, default_value_t = DEFAULT_ADAPT_DECAY)]
    adapt_decay: f32,
    /// Expert profile whose ranks order the initial fill, as `--expert-profile` does in the engine (default:
    /// the engine's order without a profile).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Cache lifetimes to report (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "warm,cold")]
    cache: Vec<CacheArg>,
    /// Which records form windows.
    #[arg(long, value_enum, default_value_t = PhaseArg::Decode)]
    phase: PhaseArg,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

/// Runs the replay and prints the report to stdout.
pub fn run(a: ReplayArgs) -> Result<()> {
    validate_decay(a.adapt_decay)?;
    if a.slots_per_layer.is_empty() || a.slots_per_layer.contains(&0) {
        bail!("--slots-per-layer needs one or more sizes of at least 1");
    }
    let f = std::fs::File::open(&a.trace).with_context(|| format!("--trace {}", a.trace.display()))?;
    let filter = if a.phase == PhaseArg::Decode { PhaseFilter::Decode } else { PhaseFilter::All };
    let mut trace = Trace::read(BufReader::new(f), filter).with_context(|| format!("--trace {}", a.trace.display()))?;
    let ranks = match &a.profile {
        Some(p) => {
            let bytes = std::fs::read(p).with_context(|| format!("--profile {}", p.display()))?;
            let prof = Profile::from_bytes(&bytes, p)?;
            let (nl, ne) = (prof.geometry.n_layer as usize, prof.geometry.n_expert as usize);
            if nl < trace.n_layer || ne < trace.n_expert {
                bail!(
                    "--profile {}: {nl} layers × {ne} experts, the trace routes to {} × {}",
                    p.display(),
                    trace.n_layer,
                    trace.n_expert
                );
            }
            // the model's geometry (the trace may never route to its last experts or layers)
            trace.n_layer = nl;
            trace.n_expert = ne;
            for w in &mut trace.windows {
                w.layers.resize(nl, Vec::new());
                w.predicted.resize(nl, None);
            }
            Some(prof.ranks())
        }
        None => None,
    };
    if let Some(&big) = a.slots_per_layer.iter().find(|&&n| n > trace.n_expert) {
        bail!(
            "--slots-per-layer {big}: the trace has {} experts per layer (a layer's cache holds at most all of them)",
            trace.n_expert
        );
    }
    let knobs = AdaptKnobs { every: a.adapt_every, swaps: a.adapt_swaps, decay: a.adapt_decay };
    let policies: Vec<Policy> = a
        .policy
        .iter()
        .map(|p| match p {
            PolicyName::Seed => Policy::Seed(knobs),
            PolicyName::Lrfu => Policy::Lrfu(knobs),
            PolicyName::Lru => Policy::Lru,
            PolicyName::Belady => Policy::Belady,
            PolicyName::FreqOracle => Policy::FreqOracle,
        })
        .collect();
    let stats = trace_stats(&trace);
    let accuracy = prediction_accuracy(&trace);
    let n_requests = trace.requests().len();
    let mut rows = Vec::new();
    for &cache in &a.cache {
        for &slots in &a.slots_per_layer {
            for p in &policies {
                let opts = ReplayOpts { slots, ranks: ranks.as_deref(), cold: cache == CacheArg::Cold };
                let o = replay_with(&trace, *p, &opts);
                let mut row = serde_json::json!({
                    "cache": if cache == CacheArg::Cold { "cold" } else { "warm" },
                    "slots_per_layer": slots, "policy": p.name(), "hit_rate": o.hit_rate(),
                    "hits": o.hits, "lookups": o.lookups, "loads": o.loads,
                });
                if accuracy.is_some() {
                    row["prefetch_hit_rate"] = o.prefetch_hit_rate().into();
                }
                rows.push(row);
            }
        }
    }
    if a.json {
        let out = serde_json::json!({
            "trace": a.trace, "windows": trace.windows.len(), "requests": n_requests, "layers": trace.n_layer,
            "experts": trace.n_expert, "top_k": trace.top_k,
            "adapt": {"every": knobs.every, "swaps": knobs.swaps, "decay": knobs.decay},
            "initial_fill": if a.profile.is_some() { "profile" } else { "engine default" },
            "prediction_accuracy": accuracy, "replay": rows, "stats": stats,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "trace {}: {} windows in {} requests, {} layers, {} experts, top-{}",
        a.trace.display(),
        trace.windows.len(),
        n_requests,
        trace.n_layer,
        trace.n_expert,
        trace.top_k
    );
    println!(
        "engine policies: every {} windows, {} swaps (seed rule decay {}); caches start as the engine fills them ({})",
        knobs.every,
        knobs.swaps,
        knobs.decay,
        if a.profile.is_some() { "profile order" } else { "default order" }
    );
    let per_table = a.slots_per_layer.len() * policies.len();
    for (t, cache) in a.cache.iter().enumerate() {
        let what = match cache {
            CacheArg::Warm => "one warm cache",
            CacheArg::Cold => "a cold cache per request",
        };
        print!("\nhit rate, {what}\nslots/layer");
        // a column as wide as its name (at least 9: "100.0%" and room)
        let width = |name: &str| name.len().max(9);
        for p in &policies {
            print!("  {:>w$}", p.name(), w = width(p.name()));
        }
        if accuracy.is_some() {
            for p in &policies {
                let name = format!("{}+pf", p.name());
                print!("  {:>w$}", name, w = width(&name));
            }
        }
        println!();
        for (i, &slots) in a.slots_per_layer.iter().enumerate() {
            print!("{slots:>11}");
            let row = |j: usize| &rows[t * per_table + i * policies.len() + j];
            for (j, p) in policies.iter().enumerate() {
                let v = row(j)["hit_rate"].as_f64().unwrap_or(0.0) * 100.0;
                print!("  {:>w$.1}%", v, w = width(p.name()) - 1);
            }
            if accuracy.is_some() {
                for (j, p) in policies.iter().enumerate() {
                    let v = row(j)["prefetch_hit_rate"].as_f64().unwrap_or(0.0) * 100.0;
                    print!("  {:>w$.1}%", v, w = width(&format!("{}+pf", p.name())) - 1);
                }
            }
            println!();
        }
    }
    if let Some(acc) = accuracy {
        println!(
            "\nnext-layer prediction: {:.1}% of routed experts named (+pf: hit rate when every predicted miss is \
             prefetched)",
            acc * 100.0
        );
    }
    println!(
        "\none-token reuse: {:.1}% (uniform routing: {:.1}%)",
        stats.reuse_next_token * 100.0,
        stats.reuse_uniform * 100.0
    );
    let n = stats.layers.len().max(1) as f64;
    let mean10 = stats.layers.iter().map(|l| l.top10).sum::<f64>() / n;
    let mean25 = stats.layers.iter().map(|l| l.top25).sum::<f64>() / n;
    println!(
        "routing mass of the hottest experts: 10% -> {:.1}%, 25% -> {:.1}% (mean over layers)",
        mean10 * 100.0,
        mean25 * 100.0
    );
    println!("\nlayer  entries  top10%  top25%");
    for l in &stats.layers {
        println!("{:>5} {:>8}  {:>5.1}%  {:>5.1}%", l.layer, l.entries, l.top10 * 100.0, l.top25 * 100.0);
    }
    Ok(())
}
