//! `strata-tools bench-attention`: the CPU attention on its own — one query row (`n_head` heads) over `ctx`
//! positions of an f16 KV cache, as a decode token runs it per layer, or (`--rows N`) the last N rows of a prompt
//! of `ctx` tokens, each over the positions up to its own, as a prompt chunk runs it. `layers` separate caches are
//! walked in turn, as a token walks its layers, so the K/V rows come from RAM rather than the caches. Prints µs per
//! layer and the K/V read rate (GB/s) beside the host RAM read rate of the same run. Needs no model.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args as ClapArgs;
use strata::backend::cpu::attention::{attend, Heads};
use strata::backend::kv::KvRows;
use strata::pool::WorkerPool;
use strata::quant::f16;

use crate::synth_cmd::Rng;

/// Arguments of `strata-tools bench-attention`.
#[derive(ClapArgs, Debug)]
pub struct BenchAttentionArgs {
    /// Positions attended to (the context so far).
    #[arg(long, default_value_t = 3000)]
    ctx: usize,
    /// Query heads (SmolLM2-135M: 9).
    #[arg(long, default_value_t = 9)]
    heads: usize,
    /// K/V heads (SmolLM2-135M: 3).
    #[arg(long, default_value_t = 3)]
    kv_heads: usize,
    /// Values per head.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Layers, each with its own cache (SmolLM2-135M: 30).
    #[arg(long, default_value_t = 30)]
    layers: usize,
    /// Tokens timed (each runs every layer once), after one warm-up token.
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Pool threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Query rows per call: 1 is a decode token; more is a prompt chunk (rows `ctx − rows .. ctx`, causal).
    #[arg(long, default_value_t = 1)]
    rows: usize,
}

/// Runs the benchmark and prints its figures. Errors: shapes that do not fit (`heads` not a multiple of
/// `kv_heads`, no positions).
pub fn run(a: BenchAttentionArgs) -> Result<()> {
    if a.heads == 0 || a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) {
        bail!("--heads must be a positive multiple of --kv-heads");
    }
    if a.ctx == 0 || a.layers == 0 || a.head_dim == 0 || a.rows == 0 || a.rows > a.ctx {
        bail!("--ctx, --layers, --head-dim and --rows must be positive, --rows at most --ctx");
    }
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = WorkerPool::new(threads)?;
    let kvd = a.kv_heads * a.head_dim;
    let mut rng = Rng(7);
    let mut vals = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal()).collect() };
    let n = a.ctx * kvd;
    // per layer: the K rows, then the V rows (f16 bits)
    let caches: Vec<(Vec<u16>, Vec<u16>)> = (0..a.layers)
        .map(|_| {
            let mut k = vec![0u16; n];
            let mut v = vec![0u16; n];
            f16::from_f32_slice(&vals(n), &mut k);
            f16::from_f32_slice(&vals(n), &mut v);
            (k, v)
        })
        .collect();
    let h = Heads { n_head: a.heads, n_head_kv: a.kv_heads, head_dim: a.head_dim };
    let q0 = vals(a.rows * a.heads * a.head_dim);
    let mut q = q0.clone();
    let mut out = vec![0f32; a.rows * a.heads * a.head_dim];
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    let token = |q: &mut Vec<f32>, out: &mut Vec<f32>| {
        for (k, v) in &caches {
            // attend rounds the query to f16 in place: each layer starts from the same one
            q.copy_from_slice(&q0);
            attend(&pool, q, KvRows::F16(k), KvRows::F16(v), h, (a.ctx - a.rows, a.rows), scale, 0, None, out);
        }
    };
    token(&mut q, &mut out);
    let t = Instant::now();
    for _ in 0..a.tokens {
        token(&mut q, &mut out);
    }
    let s = t.elapsed().as_secs_f64();
    let per_layer_us = s * 1e6 / (a.tokens * a.layers) as f64;
    let kv_bytes = (2 * n * 2) as f64;
    let all: Vec<u8> = caches.iter().flat_map(|(k, _)| k.iter().flat_map(|x| x.to_le_bytes())).collect();
    let ram = crate::bench_experts_cmd::host_read_gbps(&all, threads);
    println!(
        "cpu {}; {threads} threads; {} heads over {} K/V heads of {}, f16 cache, {} positions, {} layers",
        cpu_name(),
        a.heads,
        a.kv_heads,
        a.head_dim,
        a.ctx,
        a.layers
    );
    if a.rows == 1 {
        println!(
            "decode attention: {per_layer_us:.1} µs per layer ({:.2} ms per token), K/V read at {:.1} GB/s; host RAM \
             read {ram:.1} GB/s",
            per_layer_us * a.layers as f64 / 1000.0,
            kv_bytes / (per_layer_us * 1e-6) / 1e9
        );
    } else {
        // (row, position) pairs of one head per second: the causal rows attend to ctx − rows + 1 .. ctx positions
        let pairs = (a.rows * (2 * a.ctx - a.rows + 1) / 2 * a.heads) as f64;
        println!(
            "prompt attention, {} rows: {per_layer_us:.1} µs per layer ({:.2} ms per chunk), {:.2} G head-position \
             pairs/s",
            a.rows,
            per_layer_us * a.layers as f64 / 1000.0,
            pairs / (per_layer_us * 1e-6) / 1e9
        );
    }
    // a digest of the output, so that builds whose arithmetic must agree can be compared
    let d = out.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, x| (h ^ x.to_bits() as u64).wrapping_mul(0x100_0000_01b3));
    println!("output digest {d:016x}");
    Ok(())
}

/// The CPU's model name (`/proc/cpuinfo`), or "unknown".
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|x| x.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
