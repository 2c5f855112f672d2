//! `strata-tools bench-experts`: the CPU pool's expert throughput on its own — the share of a hybrid MoE layer
//! that the CPU computes (one token through `per_layer` experts: gate, up and SwiGLU in one fork-join, down in a
//! second, as `backend::cpu::experts` runs them). Random expert blobs of a preset's geometry sit in a RAM copy
//! mapped like the real one (`HostArena`, huge-page advice); each arm streams `work_mib` of weights and prints
//! µs per layer, µs per expert and GB/s, beside the host RAM read rate measured in the same run (one scalar pass
//! over the set by every thread: the figure `bench-gpu` uses for its bound). Needs no model and no GPU.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args as ClapArgs;
use strata::backend::cpu::{
    experts_batch, glu_batch, matmul_batch, Act, ExpertJob, GluJob, GluUnit, MatJob, MatRef, Precision,
};
use strata::pool::WorkerPool;
use strata::quant::GgmlType;
use strata::tiers::arena::HostArena;

use crate::synth_cmd::{fill_blocks, preset, Rng};

/// Arguments of `strata-tools bench-experts`.
#[derive(ClapArgs, Debug)]
pub struct BenchExpertsArgs {
    /// Geometry, as for synth-moe: mixtral-8x7b, olmoe-1b-7b, qwen3-30b-a3b, tiny.
    #[arg(long, default_value = "qwen3-30b-a3b")]
    preset: String,
    /// Expert format: q4_0 or q8_0.
    #[arg(long, default_value = "q4_0")]
    r#type: String,
    /// Pool threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Experts per layer, one token each (default: half the preset's top-k, at least 1 — a half-cached layer).
    #[arg(long)]
    per_layer: Option<usize>,
    /// RAM of the cold set (MiB; at least two layers' experts): far beyond the caches, like a RAM copy.
    #[arg(long, default_value_t = 2048)]
    set_mib: usize,
    /// Weight bytes streamed per arm (MiB).
    #[arg(long, default_value_t = 4096)]
    work_mib: usize,
    /// Run the SwiGLU and the down products as two regions of the pool with a barrier between them (as the
    /// engine did before `experts_batch`), for an A/B in one run.
    #[arg(long)]
    two_regions: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Host RAM read rate (GB/s): every one of `threads` threads folds its share of `bytes` 8 bytes at a time.
pub fn host_read_gbps(bytes: &[u8], threads: usize) -> f64 {
    let t = Instant::now();
    let chunk = bytes.len().div_ceil(threads.max(1)).max(8);
    let sum: u64 = std::thread::scope(|sc| {
        let hs: Vec<_> = bytes
            .chunks(chunk)
            .map(|sl| {
                sc.spawn(move || {
                    sl.chunks_exact(8).fold(0u64, |acc, c| acc ^ u64::from_le_bytes(c.try_into().expect("8 bytes")))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("reader thread")).fold(0, |a, b| a ^ b)
    });
    std::hint::black_box(sum);
    bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Scratch of one layer: per expert its gate/up products, h, and its down output.
struct Layer {
    g: Vec<f32>,
    u: Vec<f32>,
    hs: Vec<Act>,
    out: Vec<f32>,
}

/// One layer: the experts whose blobs are `blobs` (gate | up | down, `e` × `ff` each) on the token `x` — in one
/// region of the pool as the engine runs them ([`experts_batch`]), or with `two_regions` as a [`glu_batch`] then a
/// [`matmul_batch`] (a barrier between the SwiGLU and the down products; the same bits).
fn layer(
    pool: &WorkerPool,
    ty: GgmlType,
    (e, ff): (usize, usize),
    blobs: &[&[u8]],
    x: &Act,
    s: &mut Layer,
    two_regions: bool,
) {
    let gb = ff * ty.row_bytes(e);
    let n = blobs.len();
    s.g.resize(n * ff, 0.0);
    s.u.resize(n * ff, 0.0);
    s.out.resize(n * e, 0.0);
    s.hs.resize_with(n, Act::default);
    // the down products' activations as the engine quantizes them (Q8_K where the format pairs with it)
    let q8k = strata::quant::format::lookup(ty).is_some_and(|f| f.activation == strata::quant::format::Activation::Q8K);
    s.hs.iter_mut().for_each(|h| h.with_q8k = q8k);
    // gate, up and down of expert i
    let mats = |i: usize| {
        let b: &[u8] = blobs[i];
        (
            MatRef { data: &b[..gb], ty, rows: ff, cols: e, stride: 0 },
            MatRef { data: &b[gb..2 * gb], ty, rows: ff, cols: e, stride: 0 },
            MatRef { data: &b[2 * gb..], ty, rows: e, cols: ff, stride: 0 },
        )
    };
    if !two_regions {
        let mut jobs: Vec<ExpertJob> =
            s.g.chunks_mut(ff)
                .zip(s.u.chunks_mut(ff))
                .zip(s.hs.iter_mut())
                .zip(s.out.chunks_mut(e))
                .enumerate()
                .map(|(i, (((g, u), h), out))| {
                    let (gate, up, down) = mats(i);
                    ExpertJob { glu: GluJob { gate, up, x, g, u, h, unit: GluUnit::SILU }, down, out }
                })
                .collect();
        experts_batch(pool, &mut jobs, Precision::Q8Activations, || {});
        return;
    }
    let mut jobs: Vec<GluJob> =
        s.g.chunks_mut(ff)
            .zip(s.u.chunks_mut(ff))
            .zip(s.hs.iter_mut())
            .enumerate()
            .map(|(i, ((g, u), h))| {
                let (gate, up, _) = mats(i);
                GluJob { gate, up, x, g, u, h, unit: GluUnit::SILU }
            })
            .collect();
    glu_batch(pool, &mut jobs, Precision::Q8Activations, || {});
    drop(jobs);
    let mut jobs: Vec<MatJob> =
        s.out.chunks_mut(e).zip(&s.hs).enumerate().map(|(i, (out, h))| MatJob { w: mats(i).2, x: h, out }).collect();
    matmul_batch(pool, &mut jobs, Precision::Q8Activations);
}

/// Runs the benchmark and prints its table (and the JSON file when asked). Errors: an unknown preset or format,
/// zero threads or experts per layer, the RAM copy not mapped (out of memory), the JSON not written.
pub fn run(a: BenchExpertsArgs) -> Result<()> {
    let g = preset(&a.preset)?;
    let ty = crate::synth_cmd::synth_type(&a.r#type)?;
    let (e, ff) = (g.embd, g.ff_exp);
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4));
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    let per = a.per_layer.unwrap_or((g.top_k / 2).max(1));
    if per == 0 {
        bail!("--per-layer must be at least 1");
    }
    let blob = 2 * ff * ty.row_bytes(e) + e * ty.row_bytes(ff);
    let set = ((a.set_mib << 20) / blob).max(2 * per);
    let mut arena = HostArena::new(set * blob, false)?;
    let mut rng = Rng(0x5eed);
    let t0 = Instant::now();
    fill_blocks(ty, arena.slice_mut(0, set * blob), 0.02, &mut rng);
    let ram = host_read_gbps(arena.slice(0, set * blob), threads);
    println!(
        "{}: {set} experts of {:.2} MiB ({:.0} MiB, filled in {:.1} s), {per} per layer; host RAM read {ram:.1} GB/s \
         ({threads} threads); CPU kernels {:?}",
        a.preset,
        blob as f64 / 1048576.0,
        (set * blob) as f64 / 1048576.0,
        t0.elapsed().as_secs_f64(),
        strata::quant::simd_level()
    );
    // the activations the format's products pair with (Q8_K for the K-quants and the lattice IQ formats), as the
    // engine quantizes them
    let q8k = strata::quant::format::lookup(ty).is_some_and(|f| f.activation == strata::quant::format::Activation::Q8K);
    let mut x = Act { with_q8k: q8k, ..Act::default() };
    x.resize(1, e);
    for v in x.f.iter_mut() {
        *v = rng.normal();
    }
    x.quantize();
    println!("{:<24} {:>10} {:>11} {:>8} {:>10}", "arm", "us/layer", "us/expert", "GB/s", "% of RAM");
    let mut arms = Vec::new();
    let mut plan = vec![("cold, all threads", threads, true), ("hot, all threads", threads, false)];
    if threads > 1 {
        plan.push(("cold, 1 thread", 1, true));
    }
    for (name, t, cold) in plan {
        let pool = WorkerPool::new(t)?;
        // a single thread streams a share of the work, so every arm takes about as long
        let work = (a.work_mib << 20) / if t == 1 { threads } else { 1 };
        let layers = (work / (per * blob)).max(8);
        let mut s = Layer { g: Vec::new(), u: Vec::new(), hs: Vec::new(), out: Vec::new() };
        let mut next = 0usize;
        let pick = |next: &mut usize| -> Vec<&[u8]> {
            (0..per)
                .map(|j| {
                    let i = if cold {
                        *next = (*next + 7) % set; // stride 7: no two neighbours in a row
                        *next
                    } else {
                        j
                    };
                    arena.slice(i * blob, blob)
                })
                .collect()
        };
        // one warm-up layer (page tables, pool threads)
        layer(&pool, ty, (e, ff), &pick(&mut next), &x, &mut s, a.two_regions);
        let t = Instant::now();
        for _ in 0..layers {
            layer(&pool, ty, (e, ff), &pick(&mut next), &x, &mut s, a.two_regions);
        }
        let secs = t.elapsed().as_secs_f64();
        let us = secs / layers as f64 * 1e6;
        let gbps = (layers * per * blob) as f64 / secs / 1e9;
        println!("{name:<24} {us:>10.1} {:>11.1} {gbps:>8.2} {:>9.0}%", us / per as f64, 100.0 * gbps / ram);
        arms.push(serde_json::json!({"arm": name, "threads": pool.threads(), "layers": layers,
            "us_per_layer": us, "us_per_expert": us / per as f64, "gbps": gbps}));
    }
    if let Some(p) = &a.json {
        let doc = serde_json::json!({"preset": a.preset, "type": a.r#type, "blob_bytes": blob, "set": set,
            "per_layer": per, "threads": threads, "host_ram_read_gbps": ram,
            "simd": format!("{:?}", strata::quant::simd_level()), "arms": arms});
        std::fs::write(p, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
