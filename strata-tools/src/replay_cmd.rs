//! `strata-tools replay`: replays a `--dump-routing` trace through the cache policies and prints hit rates,
//! one-token reuse and per-layer skew.

use std::io::BufReader;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use strata::tiers::policy::{
    validate_decay, AdaptKnobs, DEFAULT_ADAPT_DECAY, DEFAULT_ADAPT_EVERY, DEFAULT_ADAPT_SWAPS,
};
use strata::tiers::replay::{replay, PhaseFilter, Policy, Trace};
use strata::tiers::stats::trace_stats;

/// Policies the replay can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyName {
    /// The adaptive tier's rule (the engine's code; --adapt-every/--adapt-swaps/--adapt-decay).
    Adaptive,
    /// Least recently used, demand fetch.
    Lru,
    /// Belady's offline optimum (demand fetch with bypass): the upper bound for demand caches.
    Belady,
}

/// Records to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PhaseArg {
    /// Decode records only (what the engine's hit rate counts).
    Decode,
    /// Prefill records too, one window per prompt token.
    All,
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
    #[arg(long, value_delimiter = ',', default_value = "adaptive,lru,belady")]
    policy: Vec<PolicyName>,
    /// Adaptive tier: decode windows per round (0 = static).
    #[arg(long, default_value_t = DEFAULT_ADAPT_EVERY)]
    adapt_every: u32,
    /// Adaptive tier: most swaps per round, all layers together (0 = static).
    #[arg(long, default_value_t = DEFAULT_ADAPT_SWAPS)]
    adapt_swaps: u32,
    /// Adaptive tier: usage decay per round, in (0, 1].
    #[arg(long, default_value_t = DEFAULT_ADAPT_DECAY)]
    adapt_decay: f32,
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
    let trace = Trace::read(BufReader::new(f), filter).with_context(|| format!("--trace {}", a.trace.display()))?;
    let knobs = AdaptKnobs { every: a.adapt_every, swaps: a.adapt_swaps, decay: a.adapt_decay };
    let policies: Vec<Policy> = a
        .policy
        .iter()
        .map(|p| match p {
            PolicyName::Adaptive => Policy::Adaptive(knobs),
            PolicyName::Lru => Policy::Lru,
            PolicyName::Belady => Policy::Belady,
        })
        .collect();
    let stats = trace_stats(&trace);
    let mut rows = Vec::new();
    for &slots in &a.slots_per_layer {
        for p in &policies {
            let o = replay(&trace, *p, slots);
            rows.push(serde_json::json!({
                "slots_per_layer": slots, "policy": p.name(), "hit_rate": o.hit_rate(),
                "hits": o.hits, "lookups": o.lookups, "loads": o.loads,
            }));
        }
    }
    if a.json {
        let out = serde_json::json!({
            "trace": a.trace, "windows": trace.windows.len(), "layers": trace.n_layer, "experts": trace.n_expert,
            "top_k": trace.top_k, "adapt": {"every": knobs.every, "swaps": knobs.swaps, "decay": knobs.decay},
            "replay": rows, "stats": stats,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "trace {}: {} windows, {} layers, {} experts, top-{}",
        a.trace.display(),
        trace.windows.len(),
        trace.n_layer,
        trace.n_expert,
        trace.top_k
    );
    println!("adaptive knobs: every {} windows, {} swaps, decay {}", knobs.every, knobs.swaps, knobs.decay);
    print!("\nhit rate\nslots/layer");
    for p in &policies {
        print!("  {:>9}", p.name());
    }
    println!();
    for (i, &slots) in a.slots_per_layer.iter().enumerate() {
        print!("{slots:>11}");
        for j in 0..policies.len() {
            print!("  {:>8.1}%", rows[i * policies.len() + j]["hit_rate"].as_f64().unwrap_or(0.0) * 100.0);
        }
        println!();
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
