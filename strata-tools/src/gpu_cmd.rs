//! `strata-tools gpu-check` (GPU kernels and forward pass against the CPU path) and `strata-tools
//! bench-gpu` (decode and prompt tok/s over expert-cache sizes and adaptive-tier modes, with the link
//! bandwidths and the DESIGN.md §10 bound). Both print a table and write JSON (`--json FILE`). `strata-tools
//! build-kernels` compiles a kernel module into the kernel cache without a GPU.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use strata::backend::cpu::{matmul_with, Act, MatRef, Precision};
use strata::backend::cuda::GpuModel;
use strata::backend::{GpuOptions, KvCache};
use strata::gguf::GgufFile;
use strata::model::forward::Scratch;
use strata::model::{Logits, Model, Tokenizer};
use strata::pool::WorkerPool;
use strata::quant::GgmlType;
use strata::tiers::knobs::Knobs;
use strata::tiers::store::{ExpertStore, StoreConfig};
use strata::tiers::vram::CacheSize;

#[derive(ClapArgs, Debug)]
pub struct CheckArgs {
    /// Model for the forward-pass parity (an MoE fixture); kernels are checked without one.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Teacher-forced positions per configuration.
    #[arg(long, default_value_t = 200)]
    positions: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only the forward pass of `--model` (no kernel checks, so only the model's formats are compiled): quick
    /// runs under compute-sanitizer.
    #[arg(long, requires = "model")]
    forward_only: bool,
}

#[derive(ClapArgs, Debug)]
pub struct BuildKernelsArgs {
    /// The GPU architecture, as NVRTC names it (`sm_80`, `sm_89`, `sm_90`, ...; `nvidia-smi
    /// --query-gpu=compute_cap` prints 9.0 for sm_90).
    #[arg(long)]
    arch: String,
    /// Build the module the daemon loads for this model (the base formats and the model's); without it, the
    /// base formats only.
    #[arg(long, conflicts_with = "all")]
    model: Option<PathBuf>,
    /// Every format (the module `gpu-check` loads).
    #[arg(long)]
    all: bool,
    /// Without the pipelined tensor-core loop: the module of a card with less than ~100 KiB of opt-in shared
    /// memory per block (sm_89 and older consumer cards), or of `STRATA_GPU_MMQ_PIPE=0`.
    #[arg(long)]
    no_mmq_pipe: bool,
}

#[derive(ClapArgs, Debug)]
pub struct BenchArgs {
    /// Model (e.g. from `strata-tools synth-moe`).
    #[arg(long)]
    model: PathBuf,
    /// Prompt tokens per arm.
    #[arg(long, default_value_t = 64)]
    prompt: usize,
    /// Generated tokens per arm.
    #[arg(long, default_value_t = 48)]
    gen: usize,
    /// Expert-cache sizes as shares of all experts.
    #[arg(long, value_delimiter = ',', default_value = "1,0.5,0.25")]
    fracs: Vec<f64>,
    /// PCIe shares to run for each partial cache (besides 0); `auto` runs the balanced share (`pcie_auto`,
    /// starting from 0.5).
    #[arg(long, value_delimiter = ',', default_value = "0.33,0.5,auto")]
    pcie: Vec<PcieArm>,
    /// Every this many generated tokens, the next input is a random token instead of the greedy pick (the same
    /// sequence in every arm): the routing's working set moves, as when a conversation changes topic, so the
    /// adaptive tier runs several rounds per arm instead of one. 0: greedy throughout.
    #[arg(long, default_value_t = 0)]
    shift: usize,
    /// The resident RAM mode (`--resident-experts`): the RAM copy holds exactly the experts the VRAM cache does
    /// not (rebuilt for every cache size); adaptive swaps copy the evicted experts back.
    #[arg(long)]
    resident: bool,
    /// Keep only this share of the experts' bytes in the RAM copy (`--resident-budget-gib`), the rest read from
    /// the file; with `--resident`, the hottest non-VRAM experts up to it.
    #[arg(long)]
    ram_share: Option<f64>,
    /// Layer split (`--layer-split`): every arm runs on these stages (each arm attaches a new backend, since a
    /// split's caches are sized at load).
    #[arg(long, value_name = "K1[,K2..]|auto")]
    layer_split: Option<strata::tiers::split::LayerSplit>,
    /// The device of each stage (`--split-device`; `0,0`: two stages on one card).
    #[arg(long, value_delimiter = ',')]
    split_device: Vec<usize>,
    /// `--vram-reserve-mib` of the arms (MiB).
    #[arg(long, default_value_t = 700)]
    vram_reserve_mib: u64,
    /// Live knob `prefetch` in every arm: at most N of the next layer's predicted misses are uploaded while a
    /// layer computes (0 = off).
    #[arg(long, default_value_t = 0)]
    prefetch: u32,
    /// Placement policies of the adaptive arms (`--adapt-policy`; each blocking and async arm runs once per
    /// policy).
    #[arg(long, value_delimiter = ',', default_value = "lrfu")]
    adapt_policy: Vec<String>,
    /// `--vram-reserve-later-mib` of the arms (MiB; default: `--vram-reserve-mib`).
    #[arg(long)]
    vram_reserve_later_mib: Option<u64>,
    /// Live knob `pcie_prefill` (`--pcie-prefill`): each arm runs once per value (prefill chunks of at least N
    /// tokens upload their missed experts over PCIe; 0 = off).
    #[arg(long, value_delimiter = ',', default_value = "16")]
    pcie_prefill: Vec<usize>,
    /// Adaptive modes of the partial-cache arms (`off`: static placement; `blocking`, `async`: adaptive rounds).
    #[arg(long, value_delimiter = ',', default_value = "off,blocking,async")]
    modes: Vec<String>,
    /// Prefill chunk (the daemon's `--batch`): the prompt runs through the model this many tokens at a time.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// The KV cache's type (the daemon's `--kv-type`: f16 or q8_0).
    #[arg(long, default_value = "f16")]
    kv_type: strata::backend::KvType,
    /// Before each arm's timed prompt, run the same prompt and two decode tokens once untimed on a KV cache of its
    /// own (as `llama-bench` warms up before its repetitions): the first use of each kernel, of the staging buffers
    /// and of the weights' pages, and the capture of the decode graph of the context's size class (once per class
    /// in a daemon's life), stay out of the rates. No adaptive round runs in it and the tiers' usage is forgotten
    /// after it, so the arm starts from the placement it set (a `--pcie auto` arm's balance has taken its first two
    /// steps). Only the size class of the prompt's next positions is captured: a decode that crosses into the next
    /// power of two of positions below the context still captures one graph while timed.
    #[arg(long)]
    warmup: bool,
    /// Timed prompt runs per arm, each on a fresh KV cache (`llama-bench -r`); the prompt rate printed is their
    /// mean in tok/s, the spread goes to stderr and the JSON (`prompt_tok_s_runs`), and decode continues after the
    /// last run's prompt.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    reps: u32,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One `bench-gpu --pcie` arm: a fixed share in [0, 1] or `auto` (the balanced share).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PcieArm {
    /// `pcie_frac` = this share.
    Share(f64),
    /// `pcie_auto` on, starting from 0.5.
    Auto,
}

impl std::str::FromStr for PcieArm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(PcieArm::Auto);
        }
        match s.parse::<f64>() {
            Ok(v) if (0.0..=1.0).contains(&v) => Ok(PcieArm::Share(v)),
            _ => Err(format!("{s:?}: a share in [0, 1] or \"auto\"")),
        }
    }
}

fn rng(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// Every format with CUDA kernels, in the registry's order.
fn cuda_types() -> Vec<GgmlType> {
    strata::quant::format::REGISTRY.iter().filter(|f| f.cuda.is_some()).map(|f| f.ty).collect()
}

fn random_rows(ty: GgmlType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let n = rows * ty.row_bytes(cols);
    let mut b = vec![0u8; n];
    match ty {
        GgmlType::F32 => {
            for c in b.chunks_exact_mut(4) {
                let v = (rng(seed) % 2001) as f32 / 1000.0 - 1.0;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for c in b.chunks_exact_mut(2) {
                let v = (rng(seed) % 2001) as f32 / 1000.0 - 1.0;
                let bits = if ty == GgmlType::F16 {
                    half::f16::from_f32(v).to_bits()
                } else {
                    half::bf16::from_f32(v).to_bits()
                };
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        _ => {
            let bs = ty.type_size();
            for blk in b.chunks_exact_mut(bs) {
                for x in blk.iter_mut() {
                    *x = rng(seed) as u8;
                }
                // random codes and sub-scales; the block's f16 scales (and minimums) in a sane range
                let mut put =
                    |at: usize, v: f32| blk[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                let d = 0.01 + (rng(seed) % 100) as f32 / 5000.0;
                match ty {
                    GgmlType::Q4_1 | GgmlType::Q5_1 => {
                        put(0, d);
                        put(2, -0.05);
                    }
                    // K-quants: the sub-scales are 4-8 bit integers that multiply d
                    GgmlType::Q4_K | GgmlType::Q5_K => {
                        put(0, d / 32.0);
                        put(2, d / 8.0);
                    }
                    GgmlType::Q2_K => {
                        put(80, d / 8.0);
                        put(82, d / 8.0);
                    }
                    GgmlType::Q3_K => put(108, d / 32.0),
                    GgmlType::Q6_K => put(208, d / 64.0),
                    GgmlType::IQ4_XS => put(0, d / 32.0),
                    // the lattice formats: d times an odd scale up to 31 (IQ1_M: d in the scale words' top
                    // nibbles)
                    GgmlType::IQ1_M => strata::quant::format::iq1_m::set_d(blk, half::f16::from_f32(d / 8.0).to_bits()),
                    t if strata::quant::format::iq::TYPES.contains(&t) => put(0, d / 8.0),
                    GgmlType::MXFP4 => blk[0] = 118 + (rng(seed) % 6) as u8,
                    _ => put(0, d),
                }
            }
        }
    }
    b
}

fn kl_argmax(p_logits: &[f32], q_logits: &[f32], n_vocab: usize) -> (Vec<f64>, usize) {
    let mut kls = Vec::new();
    let mut agree = 0;
    for (p, q) in p_logits.chunks(n_vocab).zip(q_logits.chunks(n_vocab)) {
        let lse = |v: &[f32]| {
            let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
        };
        let (lp, lq) = (lse(p), lse(q));
        let kl: f64 = p
            .iter()
            .zip(q)
            .map(|(&a, &b)| {
                let pa = a as f64 - lp;
                pa.exp() * (pa - (b as f64 - lq))
            })
            .sum();
        kls.push(kl.max(0.0));
        let am = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|x| x.0).unwrap_or(0);
        agree += (am(p) == am(q)) as usize;
    }
    (kls, agree)
}

fn load(path: &PathBuf, knobs: Arc<Knobs>, threads: usize) -> Result<Model> {
    load_with(path, knobs, threads, None)
}

/// [`load`] with the RAM copy holding only `ram_share` of the experts' bytes (the rest from the file).
fn load_with(path: &PathBuf, knobs: Arc<Knobs>, threads: usize, ram_share: Option<f64>) -> Result<Model> {
    load_mode(path, knobs, threads, false, ram_share)
}

/// [`load`] in a RAM-copy mode: all experts, or `ram_share` of their bytes (`--resident-budget-gib`); with
/// `resident`, the resident mode (`--resident-experts`: the copy disjoint from VRAM, built when the GPU attaches).
fn load_mode(
    path: &PathBuf,
    knobs: Arc<Knobs>,
    threads: usize,
    resident: bool,
    ram_share: Option<f64>,
) -> Result<Model> {
    use strata::tiers::store::ResidentMode;
    let file = Arc::new(GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?);
    let mut m = Model::load(file.clone())?;
    m.set_threads(threads)?;
    if let Some(layout) = m.expert_layout() {
        let g = m.geometry();
        let mut cfg = StoreConfig::default();
        let budget = ram_share.map(|f| (layout.total_bytes() as f64 * f) as u64);
        cfg.mode = match (resident, budget) {
            (true, b) => ResidentMode::Disjoint(b),
            (false, Some(b)) => ResidentMode::Budget(b),
            (false, None) => ResidentMode::All,
        };
        let st = ExpertStore::new(layout, file, path, g, None, &cfg, knobs)?;
        m.experts = Some(Arc::new(st));
    }
    Ok(m)
}

/// Decode-style teacher forcing: a prefill of the first 8 tokens, then one token per window (adaptive rounds
/// between windows as the engine does). Returns the logits of every position after the prefill.
fn teacher_force(m: &Model, toks: &[u32]) -> Vec<f32> {
    let mut kv = m.new_kv(toks.len() + 1);
    let mut s = Scratch::default();
    let mut out = m.forward(&toks[..8], &mut kv, Logits::Last, &mut s);
    for (w, &t) in toks[8..toks.len() - 1].iter().enumerate() {
        if let Some(st) = &m.experts {
            // RAM adapt before a decode window, never the first (as the engine does)
            st.ram_adapt(w == 0);
        }
        out.extend(decode_token(m, t, &mut kv, &mut s).expect("adaptive round"));
    }
    out
}

/// One decode window as the engine runs it: `token` through the model with the decode flag set (the tiers record
/// its routing), then the window's end (the adaptive round, if one is due). Returns the token's logits (`n_vocab`
/// f32). Errors: the adaptive round's.
fn decode_token(m: &Model, token: u32, kv: &mut KvCache, s: &mut Scratch) -> Result<Vec<f32>> {
    s.decode = true;
    let logits = m.forward(&[token], kv, Logits::Last, s);
    s.decode = false;
    m.end_decode_window()?;
    Ok(logits)
}

/// Q8 activation blocks as the device reads them (`float d, s; int8 qs[32]`, 40 bytes each).
fn q8_bytes(x: &Act) -> Vec<u8> {
    x.q.iter()
        .flat_map(|b| {
            let mut v = Vec::with_capacity(40);
            v.extend_from_slice(&b.d.to_le_bytes());
            v.extend_from_slice(&b.s.to_le_bytes());
            v.extend(b.qs.iter().map(|&q| q as u8));
            v
        })
        .collect()
}

/// Relative L2 error of `a` against `b` (infinite when `a` holds a NaN).
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    if num.is_nan() {
        f64::INFINITY
    } else {
        (num / den.max(1e-30)).sqrt()
    }
}

/// Random f16-rounded queries (as RoPE leaves them) and f16 K/V caches of `pos0 + t` positions on the device, with
/// two output buffers (NaN-filled) for two attention kernels to be compared. Built by [`AttentionCase::new_q8`],
/// it also holds Q8_0 caches (`kq`, `vq`: random values encoded as the CPU's `--kv-type q8_0` cache encodes
/// them), and the f16 caches hold their dequantized values rounded to f16.
struct AttentionCase {
    q: strata::backend::cuda::driver::DevBuf,
    k: strata::backend::cuda::driver::DevBuf,
    v: strata::backend::cuda::driver::DevBuf,
    kq: Option<(strata::backend::cuda::driver::DevBuf, strata::backend::cuda::driver::DevBuf)>,
    pos: strata::backend::cuda::driver::DevBuf,
    out: [strata::backend::cuda::driver::DevBuf; 2],
    outq: strata::backend::cuda::driver::DevBuf,
    len: usize,
}

impl AttentionCase {
    fn new((nh, nkv, hd): (usize, usize, usize), (pos0, t): (usize, usize), seed: &mut u64) -> Result<AttentionCase> {
        use strata::backend::cuda::driver::DevBuf;
        let n = pos0 + t;
        let mut r = |scale: f32| ((rng(seed) % 20001) as f32 / 10000.0 - 1.0) * scale;
        let q: Vec<f32> = (0..t * nh * hd).map(|_| half::f16::from_f32(r(2.0)).to_f32()).collect();
        let kc: Vec<u16> = (0..n * nkv * hd).map(|_| half::f16::from_f32(r(2.0)).to_bits()).collect();
        let vc: Vec<u16> = (0..n * nkv * hd).map(|_| half::f16::from_f32(r(1.0)).to_bits()).collect();
        let len = t * nh * hd;
        Ok(AttentionCase {
            q: DevBuf::from_slice(&q)?,
            k: DevBuf::from_slice(&kc)?,
            v: DevBuf::from_slice(&vc)?,
            kq: None,
            pos: DevBuf::from_slice(&[pos0 as i32, 0])?,
            out: [DevBuf::from_slice(&vec![f32::NAN; len])?, DevBuf::from_slice(&vec![f32::NAN; len])?],
            outq: DevBuf::alloc(t * nh * hd.div_ceil(32) * strata::backend::cuda::ops::Q8_BYTES)?,
            len,
        })
    }

    /// As [`AttentionCase::new`] with Q8_0 caches beside the f16 ones (head size a multiple of 32).
    fn new_q8(
        (nh, nkv, hd): (usize, usize, usize),
        (pos0, t): (usize, usize),
        seed: &mut u64,
    ) -> Result<AttentionCase> {
        use strata::backend::cuda::driver::DevBuf;
        let mut c = AttentionCase::new((nh, nkv, hd), (pos0, t), seed)?;
        let n = (pos0 + t) * nkv * hd;
        let mut caches = Vec::new();
        let mut halves = Vec::new();
        for scale in [2.0f32, 1.0] {
            let x: Vec<f32> = (0..n).map(|_| ((rng(seed) % 20001) as f32 / 10000.0 - 1.0) * scale).collect();
            let mut q8 = vec![0u8; n / 32 * 34];
            strata::backend::kv::encode_q8_0(&x, &mut q8);
            let h: Vec<u16> = q8
                .chunks_exact(34)
                .flat_map(|b| {
                    let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                    b[2..].iter().map(move |&v| half::f16::from_f32(d * v as i8 as f32).to_bits())
                })
                .collect();
            caches.push(DevBuf::from_slice(&q8)?);
            halves.push(DevBuf::from_slice(&h)?);
        }
        let (vq, kq) = (caches.pop().expect("v"), caches.pop().expect("k"));
        c.v = halves.pop().expect("v");
        c.k = halves.pop().expect("k");
        c.kq = Some((kq, vq));
        Ok(c)
    }

    /// The K/V caches as the kernels take them: the f16 ones, or (`q8`) the Q8_0 ones.
    fn kv(&self, q8: bool) -> strata::backend::cuda::ops::KvPtrs {
        match (&self.kq, q8) {
            (Some((k, v)), true) => strata::backend::cuda::ops::KvPtrs { k: k.ptr, v: v.ptr, q8: true },
            _ => strata::backend::cuda::ops::KvPtrs { k: self.k.ptr, v: self.v.ptr, q8: false },
        }
    }

    /// The relative error of the second output against the first, once the stream is done.
    fn diff(&self, ops: &strata::backend::cuda::ops::Ops) -> Result<f64> {
        ops.s.sync()?;
        let (mut a, mut b) = (vec![0f32; self.len], vec![0f32; self.len]);
        self.out[0].read_sync(0, &mut a)?;
        self.out[1].read_sync(0, &mut b)?;
        Ok(rel_err(&b, &a))
    }
}

/// The split-K attention against the one-block kernel ([`AttentionCase`]), the split one launched for attention
/// size class `cap` ≥ pos0 + t (chunks past the rows' positions, as a replayed decode graph has them): the relative
/// error of the output rows.
/// `q8`: over Q8_0 caches ([`AttentionCase::new_q8`]).
fn check_attention(
    ops: &strata::backend::cuda::ops::Ops,
    (nh, nkv, hd): (usize, usize, usize),
    (pos0, t, cap): (usize, usize, usize),
    (window, with_sinks): (usize, bool),
    q8: bool,
    seed: &mut u64,
) -> Result<f64> {
    anyhow::ensure!(cap >= pos0 + t, "split attention shape: size class {cap} below pos0 + t = {}", pos0 + t);
    let c = if q8 {
        AttentionCase::new_q8((nh, nkv, hd), (pos0, t), seed)?
    } else {
        AttentionCase::new((nh, nkv, hd), (pos0, t), seed)?
    };
    let part = strata::backend::cuda::driver::DevBuf::alloc(
        strata::backend::cuda::ops::split_part_floats(t, nh, hd, cap) * 4,
    )?;
    let (q, kv, p) = (c.q.ptr, c.kv(q8), c.pos.ptr);
    let sinks = Sinks::new(with_sinks, nh, seed)?;
    let ws = (window, sinks.ptr());
    ops.attention(q, kv, nh, nkv, hd, p, pos0 + t, t, c.out[0].ptr, c.outq.ptr, None, ws)?;
    ops.attention(q, kv, nh, nkv, hd, p, cap, t, c.out[1].ptr, c.outq.ptr, Some(part.ptr), ws)?;
    c.diff(ops)
}

/// One split-attention row of gpu-check: [`check_attention`] for heads `(nh, nkv, hd)`, rows `(pos0, t)` in size
/// class `cap`, window `win` (sinks with a window or 64 heads; `q8`: over Q8_0 caches); prints the line, adds its
/// JSON entry to `kern`, and returns the relative error.
#[allow(clippy::type_complexity)]
fn split_row(
    ops: &strata::backend::cuda::ops::Ops,
    (nh, nkv, hd, pos0, t, cap, win): (usize, usize, usize, usize, usize, usize, usize),
    q8: bool,
    seed: &mut u64,
    kern: &mut Vec<serde_json::Value>,
) -> Result<f64> {
    let r = check_attention(ops, (nh, nkv, hd), (pos0, t, cap), (win, win > 0 || nh == 64), q8, seed)?;
    let kernel = split_kernel(ops, hd, q8);
    let what = if q8 { format!("Q8_0 cache, {kernel}") } else { kernel.to_string() };
    println!("{:<6} {nh:>6} {hd:>6} {pos0:>6} {t:>3} {cap:>6} {win:>5} {r:>12.2e}  ({what})", "split");
    kern.push(serde_json::json!({"kernel": kernel, "n_head": nh, "n_head_kv": nkv, "hd": hd,
        "pos0": pos0, "t": t, "cap": cap, "window": win, "rel_err_vs_one_block": r}));
    Ok(r)
}

/// NaN propagation of the split decode attention (heads `(nh, nkv, hd)`, `nkv` ≥ 3) against the one-block kernel
/// at position 4,000 of size class 4,168 (`q8`: over Q8_0 caches): K of KV head 1 is NaN at positions 64..256
/// (whole tiles and chunks, so the grouped kernel's warps see nothing but NaN scores there) and V of KV head 2 at
/// position 1,000. Returns whether both kernels give NaN in every value of the query heads of KV heads 1 and 2
/// and finite values elsewhere, and the relative error of the split kernel's finite heads.
fn check_attention_nan(
    ops: &strata::backend::cuda::ops::Ops,
    (nh, nkv, hd): (usize, usize, usize),
    q8: bool,
    seed: &mut u64,
) -> Result<(bool, f64)> {
    let (pos0, cap) = (4000usize, 4168usize);
    let c = if q8 {
        AttentionCase::new_q8((nh, nkv, hd), (pos0, 1), seed)?
    } else {
        AttentionCase::new((nh, nkv, hd), (pos0, 1), seed)?
    };
    // one head's row at position p, poisoned: f16 NaNs, or Q8_0 blocks whose scale is an f16 NaN
    let nan_h = 0x7e00u16;
    let poison = |buf: &strata::backend::cuda::driver::DevBuf, p: usize, kh: usize| -> Result<()> {
        if q8 {
            let blk: Vec<u8> = (0..hd / 32).flat_map(|_| nan_h.to_le_bytes().into_iter().chain([1u8; 32])).collect();
            buf.write_sync(p * (nkv * hd / 32 * 34) + kh * blk.len(), &blk)?;
        } else {
            buf.write_sync(2 * (p * nkv * hd + kh * hd), &vec![nan_h; hd])?;
        }
        Ok(())
    };
    let (kb, vb) = match &c.kq {
        Some((k, v)) if q8 => (k, v),
        _ => (&c.k, &c.v),
    };
    for p in 64..256 {
        poison(kb, p, 1)?;
    }
    poison(vb, 1000, 2)?;
    for o in &c.out {
        o.write_sync(0, &vec![0f32; c.len])?;
    }
    let part = strata::backend::cuda::driver::DevBuf::alloc(
        strata::backend::cuda::ops::split_part_floats(1, nh, hd, cap) * 4,
    )?;
    let (q, kv, p) = (c.q.ptr, c.kv(q8), c.pos.ptr);
    ops.attention(q, kv, nh, nkv, hd, p, pos0 + 1, 1, c.out[0].ptr, c.outq.ptr, None, (0, 0))?;
    ops.attention(q, kv, nh, nkv, hd, p, cap, 1, c.out[1].ptr, c.outq.ptr, Some(part.ptr), (0, 0))?;
    ops.s.sync()?;
    let (mut a, mut b) = (vec![0f32; c.len], vec![0f32; c.len]);
    c.out[0].read_sync(0, &mut a)?;
    c.out[1].read_sync(0, &mut b)?;
    let poisoned = |h: usize| matches!(h / (nh / nkv), 1 | 2);
    let mut ok = true;
    let (mut fa, mut fb) = (Vec::new(), Vec::new());
    for h in 0..nh {
        let (ra, rb) = (&a[h * hd..(h + 1) * hd], &b[h * hd..(h + 1) * hd]);
        if poisoned(h) {
            ok &= ra.iter().chain(rb).all(|x| x.is_nan());
        } else {
            ok &= ra.iter().chain(rb).all(|x| x.is_finite());
            fa.extend_from_slice(ra);
            fb.extend_from_slice(rb);
        }
    }
    Ok((ok, rel_err(&fb, &fa)))
}

/// The kernel [`strata::backend::cuda::ops::Ops::attention`] runs for a split decode window of head size `hd`
/// (`q8`: over a Q8_0 cache): the grouped tensor-core kernel where the module has it, else the per-head one.
fn split_kernel(ops: &strata::backend::cuda::ops::Ops, hd: usize, q8: bool) -> &'static str {
    match (ops.k.attention_decode(hd, q8).is_some(), q8) {
        (true, false) => "attention_decode",
        (true, true) => "attention_decode_q8",
        (false, false) => "attention_split",
        (false, true) => "attention_split_q8",
    }
}

/// The one-block kernel over Q8_0 caches against the same kernel over f16 caches holding their dequantized values
/// rounded to f16 ([`AttentionCase::new_q8`]): the relative error of the output rows (the Q8_0 kernel also
/// quantizes the query for the scores, as the CPU path does: about 4e-3 on random data, against 4e-4 for the
/// rounding of d·q to f16 alone, when the Q8_0 rows are read right).
fn check_attention_q8(
    ops: &strata::backend::cuda::ops::Ops,
    (nh, nkv, hd): (usize, usize, usize),
    (pos0, t): (usize, usize),
    seed: &mut u64,
) -> Result<f64> {
    let c = AttentionCase::new_q8((nh, nkv, hd), (pos0, t), seed)?;
    let (q, p) = (c.q.ptr, c.pos.ptr);
    let scale = 1.0 / (hd as f32).sqrt();
    ops.attention_exact(q, c.kv(false), (nh, nkv, hd), p, scale, pos0 + t, t, c.out[0].ptr, c.outq.ptr, (0, 0))?;
    ops.attention_exact(q, c.kv(true), (nh, nkv, hd), p, scale, pos0 + t, t, c.out[1].ptr, c.outq.ptr, (0, 0))?;
    c.diff(ops)
}

/// Attention-sink logits for the attention checks (gpt-oss's layers have them, sliding or global): one per head
/// around the scores' size, or none.
struct Sinks(Option<strata::backend::cuda::driver::DevBuf>);

impl Sinks {
    fn new(with: bool, nh: usize, seed: &mut u64) -> Result<Sinks> {
        if !with {
            return Ok(Sinks(None));
        }
        let v: Vec<f32> = (0..nh).map(|_| (rng(seed) % 4001) as f32 / 1000.0 - 1.0).collect();
        Ok(Sinks(Some(strata::backend::cuda::driver::DevBuf::from_slice(&v)?)))
    }

    fn ptr(&self) -> u64 {
        self.0.as_ref().map_or(0, |d| d.ptr)
    }
}

/// The tiled prefill attention (what [`strata::backend::cuda::ops::Ops::attention`] runs for more than a decode
/// window's rows) against the one-block kernel ([`AttentionCase`]): the relative error of the output rows.
/// `q8`: over Q8_0 caches ([`AttentionCase::new_q8`]).
fn check_attention_tiled(
    ops: &strata::backend::cuda::ops::Ops,
    (nh, nkv, hd): (usize, usize, usize),
    (pos0, t): (usize, usize),
    (window, with_sinks): (usize, bool),
    q8: bool,
    seed: &mut u64,
) -> Result<f64> {
    let c = if q8 {
        AttentionCase::new_q8((nh, nkv, hd), (pos0, t), seed)?
    } else {
        AttentionCase::new((nh, nkv, hd), (pos0, t), seed)?
    };
    let (q, kv, p) = (c.q.ptr, c.kv(q8), c.pos.ptr);
    let scale = 1.0 / (hd as f32).sqrt();
    let sinks = Sinks::new(with_sinks, nh, seed)?;
    let ws = (window, sinks.ptr());
    ops.attention_exact(q, kv, (nh, nkv, hd), p, scale, pos0 + t, t, c.out[0].ptr, c.outq.ptr, ws)?;
    ops.attention(q, kv, nh, nkv, hd, p, pos0 + t, t, c.out[1].ptr, c.outq.ptr, None, ws)?;
    c.diff(ops)
}

/// RMSNorm + Q8 of `t` random rows of `n` values after a combine of `k` random expert rows per token (random
/// flags and weights, plus a CPU sum): the kernel `Ops::rms_norm_q8` chooses (on sm_90+ the cluster one, or
/// `rms_norm_q8_warps` for more than `MAX_NT` rows) against the CPU's arithmetic (combine in rank order, `rms_norm`,
/// Q8). Returns the relative error of the normalized rows and of the written-back residual, whether the Q8 bytes
/// match, and where `rms_norm_q8_warps` ran whether the cluster kernel gives the same bytes (normalized rows,
/// residual, Q8) on the same inputs (None where it did not run).
fn check_norm(
    ops: &strata::backend::cuda::ops::Ops,
    n: usize,
    t: usize,
    k: usize,
    seed: &mut u64,
) -> Result<(f64, f64, bool, Option<bool>)> {
    use strata::backend::cuda::driver::DevBuf;
    let mut r = |scale: f32| (rng(seed) % 20001) as f32 / 10000.0 * scale - scale / 2.0;
    let x: Vec<f32> = (0..t * n).map(|_| r(4.0)).collect();
    let w: Vec<f32> = (0..n).map(|_| 1.0 + r(0.5)).collect();
    let y: Vec<f32> = (0..t * k * n).map(|_| r(2.0)).collect();
    let cw: Vec<f32> = (0..t * k).map(|_| r(1.0) + 0.5).collect();
    let flag: Vec<i32> = (0..t * k).map(|i| (i % 3 != 1) as i32).collect();
    let cpu: Vec<f32> = (0..t * n).map(|_| r(1.0)).collect();
    // CPU: the combine as the kernel orders it, then the norm and Q8
    let mut xr = x.clone();
    for i in 0..t {
        for c in 0..n {
            let mut acc = 0f32;
            for j in 0..k {
                let p = i * k + j;
                if flag[p] != 0 {
                    acc += cw[p] * y[p * n + c];
                }
            }
            acc += cpu[i * n + c];
            xr[i * n + c] += acc;
        }
    }
    let mut act = Act::default();
    act.resize(t, n);
    for i in 0..t {
        strata::backend::cpu::math::rms_norm(&xr[i * n..(i + 1) * n], &w, 1e-6, &mut act.f[i * n..(i + 1) * n]);
    }
    act.quantize();
    let (dx, dw, dy) = (DevBuf::from_slice(&x)?, DevBuf::from_slice(&w)?, DevBuf::from_slice(&y)?);
    let (dcw, dfl, dcpu) = (DevBuf::from_slice(&cw)?, DevBuf::from_slice(&flag)?, DevBuf::from_slice(&cpu)?);
    let out = DevBuf::from_slice(&vec![f32::NAN; t * n])?;
    let q = q8_bytes(&act);
    let outq = DevBuf::from_slice(&vec![0xFFu8; q.len()])?;
    let comb = strata::backend::cuda::ops::Combine { y: dy.ptr, w: dcw.ptr, flag: dfl.ptr, cpu: dcpu.ptr, k };
    ops.rms_norm_q8(dx.ptr, dw.ptr, 1e-6, n, t, out.ptr, outq.ptr, Some(comb))?;
    ops.s.sync()?;
    let (mut go, mut gx, mut gq) = (vec![0f32; t * n], vec![0f32; t * n], vec![0u8; q.len()]);
    out.read_sync(0, &mut go)?;
    dx.read_sync(0, &mut gx)?;
    outq.read_sync(0, &mut gq)?;
    // where the warps kernel ran: the cluster kernel on the same inputs (x again from the start: the combine writes it
    // back)
    let warps_ran = t > strata::backend::cuda::ops::MAX_NT && ops.k.rms_norm_q8_warps.is_some();
    let dx2 = DevBuf::from_slice(&x)?;
    let out2 = DevBuf::from_slice(&vec![f32::NAN; t * n])?;
    let outq2 = DevBuf::from_slice(&vec![0xFFu8; q.len()])?;
    let same = if warps_ran && ops.rms_norm_q8_cluster(dx2.ptr, dw.ptr, 1e-6, n, t, out2.ptr, outq2.ptr, Some(comb))? {
        ops.s.sync()?;
        let (mut go2, mut gx2, mut gq2) = (vec![0f32; t * n], vec![0f32; t * n], vec![0u8; q.len()]);
        out2.read_sync(0, &mut go2)?;
        dx2.read_sync(0, &mut gx2)?;
        outq2.read_sync(0, &mut gq2)?;
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        Some(bits(&go2) == bits(&go) && bits(&gx2) == bits(&gx) && gq2 == gq)
    } else {
        None
    };
    Ok((rel_err(&go, &act.f), rel_err(&gx, &xr), gq == q, same))
}

/// One random expert (gate | up | down blob of `ty`, width `e`, hidden `ff`) in slot 1 of a two-slot arena, `t`
/// tokens routed to it in one group: the device's gate/up + down against the CPU's products, through each of
/// `ops` (kernel sets) on the same data. `pad`: the down rows lie 16-byte padded apart, as in a PCIe split's
/// packed sub-blob. Returns the relative error of the expert's output rows per kernel set, and whether all sets
/// gave the same bits.
#[allow(clippy::too_many_arguments)]
fn check_expert(
    ops: &[&strata::backend::cuda::ops::Ops],
    pool: &WorkerPool,
    ty: GgmlType,
    e: usize,
    ff: usize,
    t: usize,
    pad: bool,
    oai: bool,
    seed: &mut u64,
) -> Result<(Vec<f64>, bool)> {
    use strata::backend::cuda::driver::DevBuf;
    let gate = random_rows(ty, ff, e, seed);
    let up = random_rows(ty, ff, e, seed);
    let down = random_rows(ty, e, ff, seed);
    let x = random_act(t, e, seed);
    // `oai`: gpt-oss's gated unit with gate/up biases of a few units (the clamps at 7 reached), the routing entries'
    // expert id 0 read from a device ids buffer as the pass reads it
    let gub: Vec<f32> = (0..2 * ff).map(|_| ((rng(seed) % 20001) as f32 / 10000.0 - 1.0) * 8.0).collect();
    let unit = if oai {
        strata::backend::cpu::GluUnit {
            act: strata::backend::cpu::GluAct::SwigluOai,
            bias: Some((&gub[..ff], &gub[ff..])),
        }
    } else {
        strata::backend::cpu::GluUnit::SILU
    };
    let cpu = cpu_expert(pool, ty, (&gate, &up, &down), (e, ff), &x, unit);
    let ids = DevBuf::from_slice(&vec![0i32; t])?;
    let gub_dev = DevBuf::from_slice(&gub)?;
    // device: the blob in slot 1 (slot 0 zeros), one group of t tokens
    let drb = ty.row_bytes(ff);
    let pitch = if pad { drb.next_multiple_of(16) } else { drb };
    let mut down_padded = vec![0xA5u8; e * pitch]; // padding bytes that must not count
    for (r, row) in down.chunks(drb).enumerate() {
        down_padded[r * pitch..r * pitch + drb].copy_from_slice(row);
    }
    let blob: Vec<u8> = [gate, up, down_padded].concat();
    let sb = blob.len();
    let slots = DevBuf::from_slice(&[vec![0u8; sb], blob].concat())?;
    let mut group = vec![1i32, t as i32];
    group.extend((0..8).map(|i| i.min(t as i32 - 1)));
    group.extend((0..8).map(|i| i.min(t as i32 - 1)));
    let groups = DevBuf::from_slice(&group)?;
    let xf = DevBuf::from_slice(&x.f)?;
    let xq = DevBuf::from_slice(&q8_bytes(&x))?;
    let hf = DevBuf::from_slice(&vec![f32::NAN; t * ff])?;
    let hq = DevBuf::alloc(t * ff / 32 * strata::backend::cuda::ops::Q8_BYTES)?;
    let y = DevBuf::alloc(t * e * 4)?;
    let down_off = 2 * ff * ty.row_bytes(e);
    let down = (down_off, pitch);
    let (mut errs, mut outs) = (Vec::new(), Vec::<Vec<f32>>::new());
    for o in ops {
        hf.write_sync(0, &vec![f32::NAN; t * ff])?;
        y.write_sync(0, &vec![f32::NAN; t * e])?;
        let glu = match oai {
            true => strata::backend::cuda::ops::Glu { ids: ids.ptr, gub: gub_dev.ptr, act: 1 },
            false => strata::backend::cuda::ops::Glu::SILU,
        };
        o.expert_gate_up(ty, t == 1, groups.ptr, 1, slots.ptr, sb, ff, e, xq.ptr, xf.ptr, hf.ptr, glu)?;
        // narrow one-token experts: the down kernel quantizes h itself (as in decode); else a quantize launch
        o.expert_down(ty, t == 1, groups.ptr, 1, slots.ptr, sb, down, ff, e, (hq.ptr, hf.ptr, t), y.ptr)?;
        o.s.sync()?;
        let mut gpu = vec![0f32; t * e];
        y.read_sync(0, &mut gpu)?;
        errs.push(rel_err(&gpu, &cpu));
        outs.push(gpu);
    }
    let same = outs.windows(2).all(|w| w[0].iter().zip(&w[1]).all(|(a, b)| a.to_bits() == b.to_bits()));
    Ok((errs, same))
}

/// `t` random activation rows of `e` values in [−1, 1], with their Q8 blocks.
fn random_act(t: usize, e: usize, seed: &mut u64) -> Act {
    let mut x = Act::default();
    x.resize(t, e);
    for v in x.f.iter_mut() {
        *v = (rng(seed) % 20001) as f32 / 10000.0 - 1.0;
    }
    x.quantize();
    x
}

/// The CPU's expert for `x`'s rows (width `e`, hidden `ff`, weights of `ty`): SwiGLU of the gate and up products,
/// quantized to Q8, through down; `rows × e` values.
fn cpu_expert(
    pool: &WorkerPool,
    ty: GgmlType,
    (gate, up, down): (&[u8], &[u8], &[u8]),
    (e, ff): (usize, usize),
    x: &Act,
    unit: strata::backend::cpu::GluUnit<'_>,
) -> Vec<f32> {
    let t = x.f.len() / e;
    let (mut g, mut u) = (vec![0f32; t * ff], vec![0f32; t * ff]);
    matmul_with(pool, MatRef { data: gate, ty, rows: ff, cols: e, stride: 0 }, x, &mut g, Precision::Q8Activations);
    matmul_with(pool, MatRef { data: up, ty, rows: ff, cols: e, stride: 0 }, x, &mut u, Precision::Q8Activations);
    let mut h = Act::default();
    h.resize(t, ff);
    for ((hr, gr), ur) in h.f.chunks_exact_mut(ff).zip(g.chunks_exact(ff)).zip(u.chunks_exact(ff)) {
        unit.act.apply(gr, ur, unit.bias, hr);
    }
    h.quantize();
    let mut out = vec![0f32; t * e];
    matmul_with(pool, MatRef { data: down, ty, rows: e, cols: ff, stride: 0 }, &h, &mut out, Precision::Q8Activations);
    out
}

/// The experts of an all-VRAM prefill chunk as the pass runs them: `n_expert` random experts of `ty` (expert i in
/// slot i + 1, the last one not in VRAM), `t` random tokens each routed to `k` distinct random experts, grouped on
/// the device (`group_by_expert`) and computed by the tensor-core expert kernels, against the CPU's products per
/// entry. Returns the relative error over the entries computed on the device and whether exactly the entries of
/// experts in VRAM were flagged.
fn check_expert_mmq(
    ops: &strata::backend::cuda::ops::Ops,
    pool: &WorkerPool,
    ty: GgmlType,
    (e, ff): (usize, usize),
    (t, k, n_expert): (usize, usize, usize),
    seed: &mut u64,
) -> Result<(f64, bool)> {
    use strata::backend::cuda::driver::DevBuf;
    use strata::backend::cuda::ops::{max_expert_tiles, GROUP_BYTES, Q8_BYTES, TILE_BYTES};
    let x = random_act(t, e, seed);
    let mut blobs = Vec::new();
    let mut cpu = Vec::with_capacity(n_expert); // each expert's output for every token
    let mut sb = 0;
    for _ in 0..n_expert {
        let gate = random_rows(ty, ff, e, seed);
        let up = random_rows(ty, ff, e, seed);
        let down = random_rows(ty, e, ff, seed);
        cpu.push(cpu_expert(pool, ty, (&gate, &up, &down), (e, ff), &x, strata::backend::cpu::GluUnit::SILU));
        let blob = [gate, up, down].concat();
        sb = blob.len();
        if blobs.is_empty() {
            blobs.resize(sb, 0u8); // slot 0: zeros
        }
        blobs.extend(blob);
    }
    let table: Vec<i32> = (0..n_expert as i32).map(|i| if i + 1 == n_expert as i32 { -1 } else { i + 1 }).collect();
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut pick: Vec<i32> = Vec::new();
        while pick.len() < k {
            let v = (rng(seed) % n_expert as u64) as i32;
            if !pick.contains(&v) {
                pick.push(v);
            }
        }
        ids.extend(pick);
    }
    let n_pairs = t * k;
    let slots = DevBuf::from_slice(&blobs)?;
    let (d_ids, d_table) = (DevBuf::from_slice(&ids)?, DevBuf::from_slice(&table)?);
    let groups = DevBuf::alloc(n_pairs * GROUP_BYTES)?;
    let tiles = DevBuf::alloc(n_pairs * TILE_BYTES)?;
    let (flag, rank) = (DevBuf::from_slice(&vec![7i32; n_pairs])?, DevBuf::alloc(n_pairs * 4)?);
    let xq = DevBuf::from_slice(&q8_bytes(&x))?;
    let h = DevBuf::alloc(n_pairs * ff * 4)?;
    let hq = DevBuf::alloc(n_pairs * ff / 32 * Q8_BYTES)?;
    let y = DevBuf::from_slice(&vec![f32::NAN; n_pairs * e])?;
    ops.group_by_expert(d_ids.ptr, n_pairs, k, n_expert, d_table.ptr, groups.ptr, flag.ptr, rank.ptr, tiles.ptr)?;
    let down = (2 * ff * ty.row_bytes(e), ty.row_bytes(ff));
    ops.experts_mmq(
        (ty, ty),
        groups.ptr,
        tiles.ptr,
        max_expert_tiles(n_pairs, n_expert),
        (slots.ptr, sb),
        down,
        (ff, e),
        (xq.ptr, h.ptr, hq.ptr, n_pairs),
        y.ptr,
        strata::backend::cuda::ops::Glu::SILU,
    )
    .ok_or_else(|| anyhow::anyhow!("no tensor-core expert kernels for {ty:?}"))??;
    ops.s.sync()?;
    let (mut gy, mut gf) = (vec![0f32; n_pairs * e], vec![0i32; n_pairs]);
    y.read_sync(0, &mut gy)?;
    flag.read_sync(0, &mut gf)?;
    let (mut got, mut want) = (Vec::new(), Vec::new());
    let mut flags_ok = true;
    for p in 0..n_pairs {
        let ex = ids[p] as usize;
        let in_vram = table[ex] >= 0;
        flags_ok &= gf[p] == in_vram as i32;
        if in_vram {
            got.extend_from_slice(&gy[p * e..(p + 1) * e]);
            let tok = p / k;
            want.extend_from_slice(&cpu[ex][tok * e..(tok + 1) * e]);
        }
    }
    Ok((rel_err(&got, &want), flags_ok))
}

/// gpu-check's GPU options: device 0, `cache`, 700 MiB reserved, a layer split at `split` on that one card when
/// not empty, `n_ctx` positions, prefill chunks of 64 tokens.
fn check_gpu_options(cache: CacheSize, split: &[usize], n_ctx: usize) -> GpuOptions {
    GpuOptions {
        enabled: true,
        device: 0,
        cache,
        reserve_mib: 700,
        reserve_later_mib: None,
        layer_split: (!split.is_empty()).then(|| strata::tiers::split::LayerSplit::At(split.to_vec())),
        split_devices: vec![0; if split.is_empty() { 0 } else { split.len() + 1 }],
        n_ctx,
        max_chunk: 64,
        // (the checks' models have a RAM copy; `pcie_prefill` is set per configuration)
        prefill_ahead: true,
    }
}

pub fn check(a: CheckArgs) -> Result<()> {
    let mut report = serde_json::Map::new();
    let dev = match strata::backend::cuda::probe(0) {
        Ok(p) => p.device,
        Err(e) => bail!("no GPU: {e}"),
    };
    dev.bind()?;
    if !a.forward_only {
        check_kernels(&dev, &mut report)?;
        check_staging(&dev, &mut report)?;
    }
    forward_checks(&a, &mut report)
}

/// The prefill's staging copies (`SlotCache::stage`): runs of adjacent RAM places as one copy (plain where a slot
/// is exactly a blob, pitched where it is larger), a gap, another layer's blobs, a place before the previous
/// one, from the third staging slot on; each staging slot must then hold its item's bytes exactly, and every
/// other byte of the slots (other slots, a slot's padding past its blob) its sentinel. Fails on the first slot
/// that differs. (From a RAM copy the driver has not registered: the copies' addresses and sizes are what is
/// checked.)
fn check_staging(
    dev: &Arc<strata::backend::cuda::Device>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    use strata::backend::cuda::driver::Stream;
    use strata::backend::cuda::slots::SlotCache;
    let mut seed = 0x005e_ed57_u64;
    let mut runs = Vec::new();
    // layer blobs: 1,000 bytes in 2,304-byte slots (a pitched copy) beside 2,304 (plain); then both whole slots
    for blobs in [vec![1000usize, 2304], vec![2304, 2304]] {
        let sb = strata::tiers::vram::slot_bytes(*blobs.iter().max().unwrap());
        let mut arena = strata::tiers::arena::HostArena::new(64 * 1024, false)?;
        for b in arena.slice_mut(0, 64 * 1024) {
            *b = rng(&mut seed) as u8;
        }
        let (b0, b1) = (blobs[0], blobs[1]);
        // layer 0: three adjacent, a gap, one; layer 1: two adjacent, then one before them
        let items = vec![
            (0, 3, 1000),
            (0, 4, 1000 + b0),
            (0, 5, 1000 + 2 * b0),
            (0, 7, 1000 + 4 * b0),
            (1, 0, 20000),
            (1, 1, 20000 + b1),
            (1, 2, 20000 - b1),
        ];
        // staging slots from the third on (as a prefill's second set starts past the first)
        let n_all = 2 + items.len() + 2;
        let cache = SlotCache::new(dev.clone(), 2, items.len() + 2, sb, Arc::new(blobs.clone()), 16, false)?;
        let s = Stream::new()?;
        let sentinel = vec![0xa5u8; n_all * sb];
        // SAFETY: `sentinel` lives until the sync below; the slots hold n_all × sb bytes from slot 0.
        unsafe { s.htod_raw(cache.slot_addr(0), sentinel.as_ptr(), sentinel.len())? };
        let slots = cache.stage(&arena, &items, 2, &s)?;
        if slots.len() != items.len() || slots[0] != cache.staging_slot(2) {
            bail!("staging copies: {} slots from {:?} for {} items", slots.len(), slots.first(), items.len());
        }
        s.sync()?;
        let mut all = vec![0u8; n_all * sb];
        // SAFETY: `all` holds the slots' n_all × sb bytes and lives until the sync below.
        unsafe { s.dtoh_raw(all.as_mut_ptr(), cache.slot_addr(0), all.len())? };
        s.sync()?;
        let mut bad = None;
        let mut want = sentinel.clone();
        for (&(l, _, off), &slot) in items.iter().zip(&slots) {
            let at = slot as usize * sb;
            want[at..at + blobs[l]].copy_from_slice(arena.slice(off, blobs[l]));
        }
        for slot in 0..n_all {
            if all[slot * sb..(slot + 1) * sb] != want[slot * sb..(slot + 1) * sb] {
                bad.get_or_insert(slot);
            }
        }
        let copies = strata::backend::cuda::slots::copy_runs(&items, |l| blobs[l]).len();
        println!(
            "staging copies: blobs {blobs:?} in {sb}-byte slots, {} items in {copies} copies: {}",
            items.len(),
            bad.map_or("every slot as expected".to_string(), |j| format!("SLOT {j} DIFFERS"))
        );
        runs.push(serde_json::json!({"blobs": blobs, "slot_bytes": sb, "items": items.len(), "copies": copies,
            "equal": bad.is_none()}));
        if let Some(j) = bad {
            bail!("staging copies: slot {j} differs from its RAM place or its sentinel (blobs {blobs:?})");
        }
    }
    report.insert("staging_copies".into(), runs.into());
    Ok(())
}

/// `build-kernels`: compiles a kernel module with NVRTC into the kernel cache (`$STRATA_KERNEL_CACHE`, default
/// `~/.cache/strata/kernels`) under the name the daemon looks for, so that its first start on a card of that
/// architecture loads it instead of compiling (1-3 minutes). Needs NVRTC, not a GPU. Errors: an architecture not
/// named `sm_<digits>` (the daemon looks the file up by that name), the model cannot be read, NVRTC missing or
/// failing.
pub fn build_kernels(a: BuildKernelsArgs) -> Result<()> {
    use strata::backend::cuda::kernels::{cubin, FormatSet};
    let digits = a.arch.strip_prefix("sm_").unwrap_or("");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        bail!("--arch {}: expected sm_ and the compute capability's digits, e.g. sm_90", a.arch);
    }
    let formats = if a.all {
        FormatSet::all()
    } else if let Some(path) = &a.model {
        let file = Arc::new(GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?);
        let m = Model::load(file)?;
        FormatSet::of_model(&m.weights)
    } else {
        FormatSet::base()
    };
    let t = Instant::now();
    let (img, cached) = cubin(&a.arch, formats, !a.no_mmq_pipe)?;
    let how = if cached {
        "already in the cache".to_string()
    } else {
        format!("compiled in {:.1} s", t.elapsed().as_secs_f64())
    };
    let which = match (a.all, &a.model) {
        (true, _) => "all-format",
        (false, Some(_)) => "the model's",
        (false, None) => "base-format",
    };
    let dir = strata::backend::cuda::kernels::cache_dir();
    println!("{which} kernels for {}: {} bytes, {how} ({})", a.arch, img.len(), dir.display());
    Ok(())
}

/// The kernel checks of [`check`] (section 1) into `report`.
fn check_kernels(
    dev: &strata::backend::cuda::driver::Device,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    // 1. dense products against the CPU path on random inputs
    let every = strata::backend::cuda::kernels::FormatSet::all();
    let mmq_pipe = strata::backend::cuda::kernels::mmq_pipe_on(dev.max_smem_optin);
    let (img, _) = strata::backend::cuda::kernels::cubin(&dev.arch(), every, mmq_pipe)?;
    let load_kernels = |narrow_down: bool, mmq_wide: bool| {
        strata::backend::cuda::kernels::Kernels::load(
            &img,
            every,
            mmq_pipe,
            dev.max_smem_optin,
            strata::backend::cuda::kernels::pdl_wanted(dev.cc),
            strata::backend::cuda::kernels::cluster_norm_wanted(dev.cc),
            narrow_down,
            strata::backend::cuda::kernels::tensor_cores_ok(dev.cc),
            mmq_wide,
        )
    };
    // `k`: the narrow one-token down kernel of narrow experts and the wide dense prefill kernels where the card takes
    // them; `k_alt`: the general (wide) one-token down kernel and the narrow dense prefill kernels. The one-token
    // expert checks run through both down kernels, the dense prefill checks through both dense kernels.
    let k = load_kernels(true, strata::backend::cuda::kernels::mmq_wide_wanted(dev.cc))?;
    let k_alt = load_kernels(false, false)?;
    let stream = strata::backend::cuda::driver::Stream::new()?;
    let ops = strata::backend::cuda::ops::Ops { k: &k, s: &stream };
    let ops_alt = strata::backend::cuda::ops::Ops { k: &k_alt, s: &stream };
    let pool = WorkerPool::new(4)?;
    let mut seed = 0x1234_5678_9abc_def1u64;
    let mut kern = Vec::new();
    let mut worst: f64 = 0.0;
    println!("{:<6} {:>6} {:>6} {:>3} {:>12} {:>12}", "format", "rows", "cols", "t", "rel_err_cpu", "rel_err_f64");
    for ty in cuda_types() {
        for &(rows, cols, t) in &[
            (64usize, 256usize, 1usize),
            // super-block formats: an odd number of 256-value super-blocks
            (131, 768, 100),
            (70, 1280, 9),
            (300, 1024, 3),
            (129, 2048, 8),
            (77, 4096, 11),
            (65, 14336, 1),
            (33, 96, 2),
            // prefill chunks (the tensor-core kernel for block formats): rows and tokens not multiples of its
            // 64 × 64 tile, a last shared-memory chunk of one block (800 = 25 blocks)
            (131, 800, 100),
            (64, 2048, 512),
            (1100, 256, 70),
            // 26 blocks per row: the pipelined loop's 4-byte copies for Q8_0 / Q4_0 (a tail stage of 2 blocks)
            (131, 832, 100),
        ] {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let w = random_rows(ty, rows, cols, &mut seed);
            let mut x = Act::default();
            x.resize(t, cols);
            for v in x.f.iter_mut() {
                *v = (rng(&mut seed) % 20001) as f32 / 10000.0 - 1.0;
            }
            x.quantize();
            let mr = MatRef { data: &w, ty, rows, cols, stride: 0 };
            let mut cpu = vec![0f32; t * rows];
            matmul_with(&pool, mr, &x, &mut cpu, Precision::Q8Activations);
            let mut exact = vec![0f32; t * rows];
            matmul_with(&pool, mr, &x, &mut exact, Precision::F32);
            let dm = strata::backend::cuda::ops::DMat::upload(&w, ty, rows, cols)?;
            let xf = strata::backend::cuda::driver::DevBuf::from_slice(&x.f)?;
            let xq_host = q8_bytes(&x);
            let xq = strata::backend::cuda::driver::DevBuf::from_slice(&xq_host)?;
            // poison the output first: every element must be written
            let out = strata::backend::cuda::driver::DevBuf::from_slice(&vec![f32::NAN; t * rows])?;
            ops.mmv(&[&dm], xq.ptr, xf.ptr, t, out.ptr, rows, false, None)?;
            // the device's own Q8 quantization must match the CPU's
            let xq2 = strata::backend::cuda::driver::DevBuf::alloc(xq_host.len())?;
            ops.quantize(xf.ptr, xq2.ptr, t * cols / 32)?;
            stream.sync()?;
            let mut gpu = vec![0f32; t * rows];
            out.read_sync(0, &mut gpu)?;
            let mut q2 = vec![0u8; xq_host.len()];
            xq2.read_sync(0, &mut q2)?;
            let qmatch = q2 == xq_host;
            // a prefill chunk of a format with a wide kernel: the narrow one's bytes must be the same
            let narrow_same = if t > strata::backend::cuda::ops::MAX_NT && k.mmq_wide(ty).is_some() {
                out.write_sync(0, &vec![f32::NAN; t * rows])?;
                ops_alt.mmv(&[&dm], xq.ptr, xf.ptr, t, out.ptr, rows, false, None)?;
                stream.sync()?;
                let mut narrow = vec![0f32; t * rows];
                out.read_sync(0, &mut narrow)?;
                Some(narrow.iter().zip(&gpu).all(|(a, b)| a.to_bits() == b.to_bits()))
            } else {
                None
            };
            // a prefill chunk of a tensor-core format: the split-K product over 2 and 3 column ranges (where each
            // range holds blocks), against the CPU as the one-range kernel
            let mut split = Vec::new();
            if t > strata::backend::cuda::ops::MAX_NT && ty.block_size() > 1 && k.mmq(ty).is_some() {
                let nb = cols / 32;
                let part = strata::backend::cuda::driver::DevBuf::alloc(4 * 3 * t * rows)?;
                for nz in [2usize, 3] {
                    if (nz - 1) * strata::backend::cuda::ops::mq_kspan(nb, nz) >= nb {
                        continue;
                    }
                    out.write_sync(0, &vec![f32::NAN; t * rows])?;
                    ops.mmq_ranges(&[&dm], xq.ptr, t, out.ptr, rows, false, nz, part.ptr)?;
                    stream.sync()?;
                    let mut got = vec![0f32; t * rows];
                    out.read_sync(0, &mut got)?;
                    split.push((nz, rel_err(&got, &cpu)));
                }
            }
            let (rc, rf) = (rel_err(&gpu, &cpu), rel_err(&gpu, &exact));
            worst = worst.max(rc);
            for &(_, e) in &split {
                worst = worst.max(e);
            }
            if narrow_same == Some(false) {
                worst = worst.max(1.0);
            }
            println!(
                "{:<6} {rows:>6} {cols:>6} {t:>3} {rc:>12.2e} {rf:>12.2e}{}{}{}",
                format!("{ty:?}"),
                if qmatch { "" } else { "  (Q8 quantization differs)" },
                match narrow_same {
                    Some(false) => "  (NARROW KERNEL DIFFERS)",
                    Some(true) => "  (wide = narrow)",
                    None => "",
                },
                split.iter().map(|(nz, e)| format!("  (split {nz}: {e:.2e})")).collect::<String>()
            );
            kern.push(serde_json::json!({"format": format!("{ty:?}"), "rows": rows, "cols": cols, "t": t,
                "rel_err_vs_cpu": rc, "rel_err_vs_f64": rf, "q8_bytes_match": qmatch,
                "narrow_bytes_match": narrow_same,
                "split_rel_err_vs_cpu": split.iter().map(|(nz, e)| serde_json::json!({"ranges": nz, "rel_err": e}))
                    .collect::<Vec<_>>()}));
        }
    }
    // 1. (cont.) a stack of mixed formats (Q4_K_M's q, k in Q4_K and v in Q6_K): one launch per run of a format
    println!("{:<6} {:>6} {:>6} {:>3} {:>12}", "stack", "rows", "cols", "t", "rel_err_cpu");
    for t in [1usize, 5, 40, 100] {
        let cols = 1024;
        let parts = [(GgmlType::Q4_K, 96usize), (GgmlType::Q4_K, 32), (GgmlType::Q6_K, 32)];
        let mut x = Act::default();
        x.resize(t, cols);
        for v in x.f.iter_mut() {
            *v = (rng(&mut seed) % 20001) as f32 / 10000.0 - 1.0;
        }
        x.quantize();
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let (mut cpu, mut mats, mut r0) = (vec![0f32; t * rows], Vec::new(), 0);
        for &(ty, n) in &parts {
            let w = random_rows(ty, n, cols, &mut seed);
            let mut part = vec![0f32; t * n];
            matmul_with(
                &pool,
                MatRef { data: &w, ty, rows: n, cols, stride: 0 },
                &x,
                &mut part,
                Precision::Q8Activations,
            );
            for tok in 0..t {
                cpu[tok * rows + r0..tok * rows + r0 + n].copy_from_slice(&part[tok * n..(tok + 1) * n]);
            }
            mats.push(strata::backend::cuda::ops::DMat::upload(&w, ty, n, cols)?);
            r0 += n;
        }
        let xf = strata::backend::cuda::driver::DevBuf::from_slice(&x.f)?;
        let xq = strata::backend::cuda::driver::DevBuf::from_slice(&q8_bytes(&x))?;
        let out = strata::backend::cuda::driver::DevBuf::from_slice(&vec![f32::NAN; t * rows])?;
        let refs: Vec<&strata::backend::cuda::ops::DMat> = mats.iter().collect();
        ops.mmv(&refs, xq.ptr, xf.ptr, t, out.ptr, rows, false, None)?;
        stream.sync()?;
        let mut gpu = vec![0f32; t * rows];
        out.read_sync(0, &mut gpu)?;
        let rc = rel_err(&gpu, &cpu);
        worst = worst.max(rc);
        // a prefill chunk: the stack again through the split products as the forward pass runs them (Ops::mmv with
        // scratch: each run of a format over the column ranges its grid asks for, here 4 for these few blocks),
        // accumulating into an output of ones, with the wide and the narrow kernels
        let mut split = Vec::new();
        if t > strata::backend::cuda::ops::MAX_NT {
            let floats = strata::backend::cuda::ops::MQ_SPLIT_MAX * t * rows;
            let part = strata::backend::cuda::driver::DevBuf::alloc(4 * floats)?;
            for (o, name) in [(&ops, "wide"), (&ops_alt, "narrow")] {
                out.write_sync(0, &vec![1f32; t * rows])?;
                o.mmv(&refs, xq.ptr, xf.ptr, t, out.ptr, rows, true, Some((part.ptr, floats)))?;
                stream.sync()?;
                let mut got = vec![0f32; t * rows];
                out.read_sync(0, &mut got)?;
                got.iter_mut().for_each(|v| *v -= 1.0);
                let e = rel_err(&got, &cpu);
                worst = worst.max(e);
                split.push((name, e));
            }
        }
        println!(
            "{:<6} {rows:>6} {cols:>6} {t:>3} {rc:>12.2e}  (Q4_K 96 | Q4_K 32 | Q6_K 32){}",
            "stack",
            split.iter().map(|(n, e)| format!("  (split, accumulating, {n}: {e:.2e})")).collect::<String>()
        );
        kern.push(serde_json::json!({"kernel": "mmv_mixed_stack", "rows": rows, "cols": cols, "t": t,
            "rel_err_vs_cpu": rc, "split_accumulate_rel_err_vs_cpu":
                split.iter().map(|(n, e)| serde_json::json!({"kernels": n, "rel_err": e})).collect::<Vec<_>>()}));
    }
    // 1. (cont.) a router over a prefill chunk: float formats split over the columns (partials added in order)
    println!("{:<6} {:>6} {:>6} {:>3} {:>12}", "split", "rows", "cols", "t", "rel_err_cpu");
    let rpart = strata::backend::cuda::driver::DevBuf::alloc(strata::backend::cuda::ops::MF_SPLIT_MAX * 512 * 128 * 4)?;
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for &(rows, cols, t) in &[(128usize, 2048usize, 512usize), (128, 2048, 9), (60, 1056, 100), (64, 4096, 33)] {
            let w = random_rows(ty, rows, cols, &mut seed);
            let mut x = Act::default();
            x.resize(t, cols);
            for v in x.f.iter_mut() {
                *v = (rng(&mut seed) % 20001) as f32 / 10000.0 - 1.0;
            }
            x.quantize();
            let mut cpu = vec![0f32; t * rows];
            matmul_with(&pool, MatRef { data: &w, ty, rows, cols, stride: 0 }, &x, &mut cpu, Precision::F32);
            let dm = strata::backend::cuda::ops::DMat::upload(&w, ty, rows, cols)?;
            let xf = strata::backend::cuda::driver::DevBuf::from_slice(&x.f)?;
            let out = strata::backend::cuda::driver::DevBuf::from_slice(&vec![f32::NAN; t * rows])?;
            if !ops.mmf_split(&dm, xf.ptr, t, out.ptr, rows, false, rpart.ptr)? {
                println!("{:<6} {rows:>6} {cols:>6} {t:>3}  (no split kernel)", format!("{ty:?}"));
                continue;
            }
            stream.sync()?;
            let mut gpu = vec![0f32; t * rows];
            out.read_sync(0, &mut gpu)?;
            let rc = rel_err(&gpu, &cpu);
            worst = worst.max(rc);
            println!("{:<6} {rows:>6} {cols:>6} {t:>3} {rc:>12.2e}  ({ty:?}, split-K)", "split");
            kern.push(serde_json::json!({"kernel": "mmf_split", "format": format!("{ty:?}"), "rows": rows,
                "cols": cols, "t": t, "rel_err_vs_cpu": rc}));
        }
    }
    // 1a. RMSNorm + Q8 after the MoE combine (more than MAX_NT rows: the prefill chunks' kernel on sm_90+, which must
    // give the cluster kernel's bytes; those shapes draw from a seed of their own, so that the later checks' inputs
    // are those of the builds before them)
    println!("{:<6} {:>6} {:>6} {:>3} {:>12} {:>12}", "norm", "n", "k", "t", "rel_err_out", "rel_err_x");
    let mut rows_seed = 0x5EED_0054u64;
    for &(n, k, t) in &[
        (576usize, 4usize, 1usize),
        (2048, 8, 1),
        (4096, 2, 3),
        (2048, 8, 5),
        (8192, 8, 1),
        (64, 4, 2),
        (2048, 8, 512),
        (576, 4, 33),
        (8192, 8, 9),
        (4096, 2, 130),
        (64, 4, 17),
        (2880, 4, 100),
    ] {
        let s = if t > strata::backend::cuda::ops::MAX_NT { &mut rows_seed } else { &mut seed };
        let (ro, rx, qm, same) = check_norm(&ops, n, t, k, s)?;
        worst = worst.max(ro).max(rx);
        if same == Some(false) {
            worst = worst.max(1.0);
        }
        println!(
            "{:<6} {n:>6} {k:>6} {t:>3} {ro:>12.2e} {rx:>12.2e}{}{}",
            "norm",
            if qm { "" } else { "  (Q8 differs)" },
            if same == Some(false) { "  (DIFFERS from the cluster kernel)" } else { "" }
        );
        kern.push(serde_json::json!({"kernel": "rms_norm_q8", "n": n, "k": k, "t": t, "rel_err_vs_cpu": ro,
            "residual_rel_err_vs_cpu": rx, "q8_bytes_match": qm, "same_bytes_as_cluster": same}));
    }
    // 1a'. split-K attention over a long context against the one-block kernel (same scores; the one-block kernel
    // rounds the probabilities to f16, the split one rescales in f32)
    // (with a sliding window, `win` > 0, and attention sinks: gpt-oss's 128 and windows crossing chunk borders; its
    // 64 heads carry sinks whether they slide or not)
    println!(
        "{:<6} {:>6} {:>6} {:>6} {:>3} {:>6} {:>5} {:>12}",
        "attn", "heads", "hd", "pos0", "t", "cap", "win", "rel_err_1blk"
    );
    for &(nh, nkv, hd, pos0, t, cap, win) in &[
        (32usize, 4usize, 128usize, 4095usize, 1usize, 4096usize, 0usize),
        (16, 16, 64, 3000, 3, 3003, 0),
        (8, 2, 128, 1100, 8, 1108, 0),
        (12, 4, 80, 2047, 2, 2049, 0),
        (32, 4, 128, 20000, 1, 20001, 0),
        // a decode graph's size class: cap the next power of two, many chunks past the row
        (32, 4, 128, 2049, 1, 4096, 0),
        (8, 2, 64, 1500, 4, 2048, 0),
        (64, 8, 64, 4095, 1, 4096, 128),
        (64, 8, 64, 3000, 2, 4096, 0),
        (16, 4, 64, 3000, 5, 4096, 300),
        (8, 2, 128, 1100, 8, 1108, 1000),
        // the grouped decode kernel's head groups (up to 16 query heads per block): 16 and 12 per KV head (one
        // block each), 17 (blocks of 9 and 8) and 32 (two blocks of 16) per KV head, 1:1
        (64, 4, 128, 5000, 1, 8192, 0),
        (24, 2, 128, 3000, 2, 4096, 0),
        (34, 2, 128, 3000, 1, 4096, 0),
        (64, 2, 64, 4094, 2, 4096, 0),
        (16, 16, 128, 700, 1, 1024, 0),
        // its head size 96; head size 256 keeps attention_split (a window across chunks)
        (12, 4, 96, 2047, 2, 2049, 0),
        (8, 1, 256, 3000, 1, 4096, 512),
        (8, 2, 256, 300, 3, 512, 0),
    ] {
        worst = worst.max(split_row(&ops, (nh, nkv, hd, pos0, t, cap, win), false, &mut seed, &mut kern)?);
    }
    // 1a'n. NaN in K or V reaches the same heads' outputs in the split kernels as in the one-block kernel (head
    // size 128: the grouped kernel; 256: attention_split), then the merge
    for (nh, nkv, hd, q8) in
        [(32usize, 4usize, 128usize, false), (32, 4, 128, true), (12, 4, 256, false), (12, 4, 256, true)]
    {
        let (ok, r) = check_attention_nan(&ops, (nh, nkv, hd), q8, &mut seed)?;
        worst = worst.max(if ok { r } else { f64::INFINITY });
        let kernel = split_kernel(&ops, hd, q8);
        let verdict = if ok { "NaN heads agree" } else { "NaN heads DIFFER" };
        println!(
            "{:<6} {nh:>6} {hd:>6} {:>6} {:>3} {:>6} {:>5} {r:>12.2e}  ({kernel}: {verdict})",
            "nan", 4000, 1, 4168, 0
        );
        kern.push(serde_json::json!({"kernel": kernel, "check": "nan_propagation", "n_head": nh, "n_head_kv": nkv,
            "hd": hd, "pos0": 4000, "t": 1, "cap": 4168, "nan_heads_agree": ok, "rel_err_finite_heads": r}));
    }
    // 1a'q. the Q8_0 KV cache (`--kv-type q8_0`): the one-block kernel over Q8_0 rows against the f16 kernel over
    // their dequantized values; the split kernels over Q8_0 rows against the one-block one (the grouped decode
    // kernel converts K to f16 and rounds the query to f16 where the one-block one quantizes the query: about
    // 5e-3; attention_split_q8, for head size 256, quantizes it too: about 2e-4)
    for &(nh, nkv, hd, pos0, t) in
        &[(32usize, 4usize, 128usize, 300usize, 1usize), (16, 16, 64, 37, 3), (8, 1, 96, 700, 2)]
    {
        let r = check_attention_q8(&ops, (nh, nkv, hd), (pos0, t), &mut seed)?;
        worst = worst.max(r);
        println!(
            "{:<6} {nh:>6} {hd:>6} {pos0:>6} {t:>3} {:>6} {:>5} {r:>12.2e}  (Q8_0 vs f16 of its values)",
            "q8kv", "", ""
        );
        kern.push(serde_json::json!({"kernel": "attention_q8", "n_head": nh, "n_head_kv": nkv, "hd": hd,
            "pos0": pos0, "t": t, "rel_err_vs_f16_of_dequantized": r}));
    }
    for &(nh, nkv, hd, pos0, t, cap, win) in &[
        (32usize, 4usize, 128usize, 4095usize, 1usize, 4096usize, 0usize),
        (8, 2, 64, 1500, 4, 2048, 0),
        (64, 8, 64, 4095, 1, 4096, 128),
        // Q8_0 rows of 102 bytes (head size 96: 2-byte aligned), 272 (256: attention_split_q8), 16 and 32
        // query heads per KV head (one and two blocks of the grouped kernel)
        (12, 4, 96, 2000, 1, 2048, 0),
        (8, 1, 256, 3000, 1, 4096, 0),
        (64, 4, 128, 5000, 2, 8192, 0),
        (64, 2, 64, 3000, 1, 4096, 0),
    ] {
        worst = worst.max(split_row(&ops, (nh, nkv, hd, pos0, t, cap, win), true, &mut seed, &mut kern)?);
    }
    // 1a''. tiled prefill attention (tensor cores, online softmax) against the one-block kernel: odd row counts,
    // rows not a multiple of the 64-row tile, GQA 1:1 to 8:1, every head size it has
    if ops.k.attention_tiled(128, false).is_some() {
        println!("{:<6} {:>6} {:>6} {:>6} {:>6} {:>12}", "attn", "heads", "kv", "hd", "pos0", "t  rel_err_1blk");
        for &(nh, nkv, hd, pos0, t, win) in &[
            (32usize, 4usize, 128usize, 0usize, 64usize, 0usize),
            (32, 4, 128, 3000, 512, 0),
            (16, 16, 64, 0, 37, 0),
            (12, 4, 80, 100, 129, 0),
            (8, 1, 96, 7, 9, 0),
            (9, 3, 64, 1000, 200, 0),
            (16, 2, 128, 4000, 77, 0),
            // sliding windows with sinks: inside the first tile, across tiles, rows whose window starts tiles later
            (64, 8, 64, 0, 512, 128),
            (64, 8, 64, 700, 300, 0),
            (16, 4, 64, 1000, 300, 128),
            (8, 2, 128, 50, 200, 16),
            (12, 4, 80, 3000, 129, 700),
        ] {
            let r =
                check_attention_tiled(&ops, (nh, nkv, hd), (pos0, t), (win, win > 0 || nh == 64), false, &mut seed)?;
            worst = worst.max(r);
            println!("{:<6} {nh:>6} {nkv:>6} {hd:>6} {pos0:>6} {t:>4} {win:>5} {r:>12.2e}", "tiled");
            kern.push(serde_json::json!({"kernel": "attention_tiled", "n_head": nh, "n_head_kv": nkv, "hd": hd,
                "pos0": pos0, "t": t, "window": win, "rel_err_vs_one_block": r}));
        }
        // over Q8_0 caches (tiles converted to f16 as they are loaded)
        for &(nh, nkv, hd, pos0, t, win) in &[
            (32usize, 4usize, 128usize, 3000usize, 512usize, 0usize),
            (16, 16, 64, 0, 37, 0),
            (9, 3, 64, 1000, 200, 0),
            (16, 4, 64, 1000, 300, 128),
            (8, 2, 96, 7, 9, 0),
        ] {
            let r = check_attention_tiled(&ops, (nh, nkv, hd), (pos0, t), (win, win > 0 || nh == 64), true, &mut seed)?;
            worst = worst.max(r);
            println!("{:<6} {nh:>6} {nkv:>6} {hd:>6} {pos0:>6} {t:>4} {win:>5} {r:>12.2e}  (Q8_0 cache)", "tiled");
            kern.push(serde_json::json!({"kernel": "attention_tiled_q8", "n_head": nh, "n_head_kv": nkv, "hd": hd,
                "pos0": pos0, "t": t, "window": win, "rel_err_vs_one_block": r}));
        }
    }
    // 1c. a prefill chunk's experts: grouped on the device, tensor-core kernels (several tiles per expert, partial
    // tiles, an expert not in VRAM)
    if ops.k.expert_mmq(GgmlType::Q4_0, GgmlType::Q4_0).is_some() {
        println!("{:<6} {:>6} {:>6} {:>4} {:>3} {:>4} {:>12}", "mmq", "e", "ff", "t", "k", "ne", "rel_err_cpu");
        for ty in cuda_types().into_iter().filter(|&ty| ops.k.expert_mmq(ty, ty).is_some()) {
            for &(e, ff, t, k, ne) in
                &[(256usize, 512usize, 100usize, 4usize, 6usize), (2048, 768, 130, 8, 16), (96, 160, 9, 2, 3)]
            {
                if e % ty.block_size() != 0 || ff % ty.block_size() != 0 {
                    continue;
                }
                let (r, flags) = check_expert_mmq(&ops, &pool, ty, (e, ff), (t, k, ne), &mut seed)?;
                worst = worst.max(r);
                println!(
                    "{:<6} {e:>6} {ff:>6} {t:>4} {k:>3} {ne:>4} {r:>12.2e}{}",
                    format!("{ty:?}"),
                    if flags { "" } else { "  (flags differ)" }
                );
                kern.push(serde_json::json!({"kernel": "experts_mmq", "format": format!("{ty:?}"), "e": e, "ff": ff,
                    "t": t, "k": k, "n_expert": ne, "rel_err_vs_cpu": r, "flags_ok": flags}));
            }
        }
    }
    // 1b. expert gate/up + down from a VRAM slot (staged and row-by-row shapes, one and several tokens)
    println!("{:<6} {:>6} {:>6} {:>3} {:>12}", "expert", "e", "ff", "t", "rel_err_cpu");
    for ty in cuda_types().into_iter().filter(|&ty| ty.block_size() > 1 || ty == GgmlType::F16) {
        // the last three: PCIe split parts (k = 384 or 512 of a Qwen3-like expert; 64 rows) with 16-byte padded
        // down rows
        let shapes = [
            (256usize, 512usize, 1usize, false),
            (512, 4608, 3, false),
            (96, 160, 1, false),
            (256, 768, 8, false),
            (2048, 768, 1, false),
            (2048, 384, 1, true),
            (256, 64, 3, true),
            (2048, 512, 1, true),
        ];
        for &(e, ff, t, pad) in &shapes {
            if e % ty.block_size() != 0 || ff % ty.block_size() != 0 {
                continue;
            }
            // one token, block formats: the narrow kernels where they apply (gate/up: e ≤ 2048, down: ff ≤ 1024)
            // and the others on the same data (same sums in the same order: the same bits)
            let (arms, names): (Vec<&strata::backend::cuda::ops::Ops>, &[&str]) = if t == 1 && ty != GgmlType::F16 {
                (vec![&ops, &ops_alt], &["narrow", "wide"])
            } else {
                (vec![&ops], &[""])
            };
            let (errs, same) = check_expert(&arms, &pool, ty, e, ff, t, pad, false, &mut seed)?;
            for (&rc, &kernel) in errs.iter().zip(names) {
                worst = worst.max(rc);
                println!(
                    "{:<6} {e:>6} {ff:>6} {t:>3} {rc:>12.2e}{}{}",
                    format!("{ty:?}"),
                    if pad { " padded" } else { "" },
                    if kernel.is_empty() {
                        String::new()
                    } else {
                        format!(" {kernel} kernels{}", if same { " (bits equal)" } else { " (BITS DIFFER)" })
                    }
                );
                kern.push(serde_json::json!({"format": format!("{ty:?}"), "expert_e": e, "expert_ff": ff, "t": t,
                    "down_padded": pad, "kernels": kernel, "rel_err_vs_cpu": rc,
                    "same_bits_across_kernels": same}));
            }
        }
    }
    // 1b''. gpt-oss's router: logits plus a bias, the top-k of them, the softmax of the chosen (route_topk mode 2)
    {
        use strata::backend::cuda::driver::DevBuf;
        let (t, ne, k) = (37usize, 32usize, 4usize);
        let logits: Vec<f32> = (0..t * ne).map(|_| (rng(&mut seed) % 20001) as f32 / 2000.0 - 5.0).collect();
        let bias: Vec<f32> = (0..ne).map(|_| (rng(&mut seed) % 20001) as f32 / 10000.0 - 1.0).collect();
        let (dl, db) = (DevBuf::from_slice(&logits)?, DevBuf::from_slice(&bias)?);
        let (ids, w) = (DevBuf::alloc(t * k * 4)?, DevBuf::alloc(t * k * 4)?);
        ops.route_topk(dl.ptr, ne, k, t, ids.ptr, w.ptr, None, 0, (2, db.ptr))?;
        ops.s.sync()?;
        let (mut gi, mut gw) = (vec![0i32; t * k], vec![0f32; t * k]);
        ids.read_sync(0, &mut gi)?;
        w.read_sync(0, &mut gw)?;
        let (mut ids_equal, mut werr) = (true, 0f64);
        for i in 0..t {
            let mut l: Vec<(usize, f32)> = (0..ne).map(|e| (e, logits[i * ne + e] + bias[e])).collect();
            l.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
            let z: f64 = l[..k].iter().map(|x| ((x.1 - l[0].1) as f64).exp()).sum();
            for (r, x) in l[..k].iter().enumerate() {
                ids_equal &= gi[i * k + r] as usize == x.0;
                werr = werr.max((gw[i * k + r] as f64 - ((x.1 - l[0].1) as f64).exp() / z).abs());
            }
        }
        println!(
            "route  top-k softmax with bias: ids {}, weights max abs err {werr:.2e}",
            if ids_equal { "equal" } else { "DIFFER" }
        );
        worst = worst.max(if ids_equal { werr } else { 1.0 });
        kern.push(serde_json::json!({"kernel": "route_topk", "mode": 2, "ids_equal": ids_equal, "w_abs_err": werr}));
    }
    // 1d. the fused launches against the two each replaces, bit for bit: q/k norms and biases with RoPE and the KV
    // store (qkv_rope_store against qkv_prep + rope_store), a decode token's f32 router product with its top-k
    // (route_f32_t1 against the product + route_topk, launched twice: its counter starts the next launch at 0)
    for (kernel, same) in check_fused(&ops, &mut seed)? {
        if same == Some(false) {
            worst = 1.0;
        }
        kern.push(serde_json::json!({"kernel": kernel, "same_bits": same}));
    }
    // 1b'. gpt-oss's gated unit: gate/up biases by the routing entry's expert and the clamped SwiGLU, in the
    // one-token (narrow and wide) and several-token kernels
    println!("{:<6} {:>6} {:>6} {:>3} {:>12}", "oai", "e", "ff", "t", "rel_err_cpu");
    for ty in [GgmlType::MXFP4, GgmlType::Q8_0] {
        for &(e, ff, t) in &[(256usize, 512usize, 1usize), (2880, 2880, 1), (256, 512, 5)] {
            let (arms, names): (Vec<&strata::backend::cuda::ops::Ops>, &[&str]) =
                if t == 1 { (vec![&ops, &ops_alt], &["narrow", "wide"]) } else { (vec![&ops], &[""]) };
            let (errs, same) = check_expert(&arms, &pool, ty, e, ff, t, false, true, &mut seed)?;
            for (&rc, &kernel) in errs.iter().zip(names) {
                worst = worst.max(rc);
                println!("{:<6} {e:>6} {ff:>6} {t:>3} {rc:>12.2e} {kernel} {}", format!("{ty:?}"), same);
                kern.push(serde_json::json!({"format": format!("{ty:?}"), "expert_e": e, "expert_ff": ff, "t": t,
                    "glu": "swiglu_oai+bias", "kernels": kernel, "rel_err_vs_cpu": rc,
                    "same_bits_across_kernels": same}));
            }
        }
    }
    report.insert("kernels".into(), kern.into());
    report.insert("kernels_worst_rel_err_vs_cpu".into(), worst.into());
    Ok(())
}

/// Section 1d of [`check_kernels`], each result printed as it comes: whether `qkv_rope_store` gives the bits of
/// `qkv_prep` + `rope_store` and `route_f32_t1` those of the router product + `route_topk`, over several shapes
/// (kernel name, `None` where the kernel is not loaded: `STRATA_GPU_FUSE=0`). Errors: the driver's.
fn check_fused(ops: &strata::backend::cuda::ops::Ops, seed: &mut u64) -> Result<Vec<(&'static str, Option<bool>)>> {
    let said = |kernel: &str, same: Option<bool>| {
        let word = match same {
            Some(true) => "same bits",
            Some(false) => "BITS DIFFER",
            None => "not loaded",
        };
        println!("fused  {kernel}: {word} as the launches it replaces");
    };
    let mut out = Vec::new();
    use strata::backend::cuda::driver::DevBuf;
    use strata::backend::cuda::ops::{DMat, KvPtrs, RopeStore, GROUP_BYTES};
    let unit = |seed: &mut u64| (rng(seed) % 20001) as f32 / 10000.0 - 1.0;
    let mut same_rope = Some(true);
    // (n_head, n_head_kv, hd, n_rot, neox, mode, bias, t): Qwen3's per-head norms, biases alone (Qwen2), partial
    // rotation of an 80-wide head, 256-wide heads, RoPE alone
    for &(nh, nkv, hd, n_rot, neox, mode, with_bias, t) in &[
        (32usize, 4usize, 128usize, 128usize, true, 1i32, false, 1usize),
        (8, 2, 64, 64, false, 0, true, 3),
        (4, 4, 80, 32, true, 1, true, 2),
        (5, 1, 80, 48, false, 1, false, 1),
        (8, 4, 256, 256, true, 1, true, 1),
        (6, 2, 96, 64, false, 0, false, 5),
    ] {
        let (qd, kvd) = (nh * hd, nkv * hd);
        let (pos0, n_ctx) = (7usize, 7 + t + 3);
        let qkv: Vec<f32> = (0..t * (qd + 2 * kvd)).map(|_| unit(seed) * 3.0).collect();
        let bias: Vec<f32> = (0..qd + 2 * kvd).map(|_| unit(seed)).collect();
        let (qn, kn): (Vec<f32>, Vec<f32>) =
            ((0..hd).map(|_| unit(seed) + 1.5).collect(), (0..hd).map(|_| unit(seed) + 1.5).collect());
        let cs: Vec<f32> = (0..t * n_rot / 2)
            .flat_map(|j| {
                let a = (pos0 * 31 + j * 7) as f32 * 0.013;
                [a.cos(), a.sin()]
            })
            .collect();
        let (dbias, dqn, dkn, dcs) =
            (DevBuf::from_slice(&bias)?, DevBuf::from_slice(&qn)?, DevBuf::from_slice(&kn)?, DevBuf::from_slice(&cs)?);
        let pos = DevBuf::from_slice(&[pos0 as i32])?;
        let prep = (mode == 1 || with_bias).then_some((
            if with_bias { dbias.ptr } else { 0 },
            dqn.ptr,
            dkn.ptr,
            mode,
            1e-6f32,
        ));
        let mut outs = Vec::new();
        for fused in [false, true] {
            let dqkv = DevBuf::from_slice(&qkv)?;
            let q = DevBuf::from_slice(&vec![f32::NAN; t * qd])?;
            let (kc, vc) = (
                DevBuf::from_slice(&vec![0xabcdu16; n_ctx * kvd])?,
                DevBuf::from_slice(&vec![0xabcdu16; n_ctx * kvd])?,
            );
            let kv = KvPtrs { k: kc.ptr, v: vc.ptr, q8: false };
            let r = RopeStore {
                qkv: dqkv.ptr,
                cs: dcs.ptr,
                heads: (nh, nkv, hd),
                n_rot,
                pos: pos.ptr,
                t,
                q: q.ptr,
                kv,
                neox,
            };
            if fused {
                if !ops.qkv_rope_store(&r, prep)? {
                    same_rope = None;
                    break;
                }
            } else {
                if let Some((b, qn, kn, mode, eps)) = prep {
                    ops.qkv_prep(dqkv.ptr, b, qn, kn, mode, (nh, nkv, hd), eps, t)?;
                }
                ops.rope_store(&r)?;
            }
            ops.s.sync()?;
            let (mut hq, mut hk, mut hv) = (vec![0f32; t * qd], vec![0u16; n_ctx * kvd], vec![0u16; n_ctx * kvd]);
            q.read_sync(0, &mut hq)?;
            kc.read_sync(0, &mut hk)?;
            vc.read_sync(0, &mut hv)?;
            outs.push((hq.iter().map(|v| v.to_bits()).collect::<Vec<u32>>(), hk, hv));
        }
        if same_rope.is_none() {
            break;
        }
        same_rope = Some(same_rope == Some(true) && outs[0] == outs[1]);
    }
    said("qkv_rope_store", same_rope);
    out.push(("qkv_rope_store", same_rope));
    let mut same_route = Some(true);
    // (experts, width, top-k, norm mode, bias, device groups and window record)
    for &(ne, cols, k, norm, with_bias, fast) in &[
        (128usize, 2048usize, 8usize, 1i32, false, true),
        (60, 256, 4, 0, false, false),
        (32, 2880, 4, 2, true, true),
        (1000, 512, 32, 1, false, true),
    ] {
        let w: Vec<f32> = (0..ne * cols).map(|_| unit(seed) * 0.1).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let router = DMat::upload(&bytes, GgmlType::F32, ne, cols)?;
        let x = DevBuf::from_slice(&(0..cols).map(|_| unit(seed)).collect::<Vec<f32>>())?;
        let bias = DevBuf::from_slice(&(0..ne).map(|_| unit(seed)).collect::<Vec<f32>>())?;
        let table: Vec<i32> = (0..ne as i32).map(|e| if e % 3 == 1 { -1 } else { e * 2 }).collect();
        let table = DevBuf::from_slice(&table)?;
        let done = DevBuf::from_slice(&[0u32])?;
        let mode = (norm, if with_bias { bias.ptr } else { 0 });
        let mut outs = Vec::new();
        for launch in 0..3 {
            let logits = DevBuf::from_slice(&vec![f32::NAN; ne])?;
            let (ids, wt, win) = (
                DevBuf::from_slice(&vec![-1i32; k])?,
                DevBuf::from_slice(&vec![f32::NAN; k])?,
                DevBuf::from_slice(&vec![-1i32; k])?,
            );
            let (groups, flag) =
                (DevBuf::from_slice(&vec![0xeeu8; k * GROUP_BYTES])?, DevBuf::from_slice(&vec![-1i32; k])?);
            let f = fast.then_some((table.ptr, groups.ptr, flag.ptr));
            let winp = if fast { win.ptr } else { 0 };
            if launch == 0 {
                ops.mmv(&[&router], 0, x.ptr, 1, logits.ptr, ne, false, None)?;
                ops.route_topk(logits.ptr, ne, k, 1, ids.ptr, wt.ptr, f, winp, mode)?;
            } else if !ops.route_f32_t1(&router, x.ptr, logits.ptr, done.ptr, k, ids.ptr, wt.ptr, f, winp, mode)? {
                same_route = None;
                break;
            }
            ops.s.sync()?;
            let (mut hl, mut hi, mut hw, mut hwin, mut hg, mut hf) = (
                vec![0f32; ne],
                vec![0i32; k],
                vec![0f32; k],
                vec![0i32; k],
                vec![0u8; k * GROUP_BYTES],
                vec![0i32; k],
            );
            logits.read_sync(0, &mut hl)?;
            ids.read_sync(0, &mut hi)?;
            wt.read_sync(0, &mut hw)?;
            win.read_sync(0, &mut hwin)?;
            groups.read_sync(0, &mut hg)?;
            flag.read_sync(0, &mut hf)?;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            outs.push((bits(&hl), hi, bits(&hw), hwin, hg, hf));
        }
        let mut d = [0u32];
        done.read_sync(0, &mut d)?;
        if same_route.is_none() {
            break;
        }
        same_route = Some(same_route == Some(true) && outs[0] == outs[1] && outs[1] == outs[2] && d[0] == 0);
    }
    said("route_f32_t1", same_route);
    out.push(("route_f32_t1", same_route));
    Ok(out)
}

/// The forward-pass checks of [`check`] (section 2) into `report`, and the report written where `a.json` says.
fn forward_checks(a: &CheckArgs, report: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    // 2. forward pass: GPU vs CPU, teacher-forced, in several tier configurations
    if let Some(path) = &a.model {
        let knobs_cpu = Arc::new(Knobs::default());
        let cpu = load(path, knobs_cpu, 8)?;
        let tok = Tokenizer::from_gguf(&cpu.file)?;
        let text = "The history of computing is a story of layers: transistors become gates, gates become \
                    processors, processors run operating systems, and programs written in high-level languages \
                    describe what people want done. Each layer hides the details of the one below it. ";
        let mut toks = tok.encode(&text.repeat(40), false, true)?;
        toks.truncate(a.positions + 9);
        let n_vocab = cpu.cfg.n_vocab;
        let reference = teacher_force(&cpu, &toks);
        let total = cpu.experts.as_ref().map(|s| s.layout().n_layer() * s.layout().n_expert).unwrap_or(0);
        let mut configs = Vec::new();
        // the fixture's own noise floor: the CPU path's batch (one prefill of every position) against its
        // decode windows
        let cpu_all = {
            let mut kv = cpu.new_kv(toks.len() + 1);
            let mut s = Scratch::default();
            cpu.forward(&toks[..toks.len() - 1], &mut kv, Logits::All, &mut s)
        };
        {
            let batch = &cpu_all[7 * n_vocab..];
            let (kls, agree) = kl_argmax(&reference, batch, n_vocab);
            let mean = kls.iter().sum::<f64>() / kls.len() as f64;
            println!(
                "{:<32} positions {}  mean KL {mean:.2e}  argmax {:.2}%  (CPU batch vs CPU decode: the fixture's floor)",
                "cpu batch vs cpu decode",
                kls.len(),
                100.0 * agree as f64 / kls.len() as f64
            );
            configs.push(serde_json::json!({"config": "cpu batch vs cpu decode", "positions": kls.len(),
                "mean_kl": mean, "argmax_agreement": agree as f64 / kls.len() as f64}));
        }
        let q = CacheSize::Slots(total / 4);
        // prefill on the GPU (chunks of 64: tensor-core and tiled float products, tiled attention, all-VRAM experts
        // grouped on the device) against the CPU's batch over the same positions
        // (cache 25%: its misses on the CPU pool, and uploaded over PCIe by `pcie_prefill`)
        for (name, cache, pcie_prefill) in [
            ("prefill 64: all experts in VRAM", CacheSize::Auto, "0"),
            ("prefill 64: cache 25%, static", q, "0"),
            ("prefill 64: cache 25%, pcie-prefill", q, "16"),
        ] {
            let knobs = Arc::new(Knobs::default());
            knobs.set("adapt_every", "0").map_err(|e| anyhow::anyhow!("{e}"))?;
            knobs.set("pcie_prefill", pcie_prefill).map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut m = load_mode(path, knobs, 8, false, None)?;
            let opts = check_gpu_options(cache, &[], toks.len() + 8);
            let line = m.attach_gpu(&opts).map_err(|e| anyhow::anyhow!(e))?;
            eprintln!("{line}");
            let mut kv = m.new_kv(toks.len() + 1);
            let mut s = Scratch::default();
            let gl = m.forward(&toks[..toks.len() - 1], &mut kv, Logits::All, &mut s);
            let (kls, agree) = kl_argmax(&cpu_all[7 * n_vocab..], &gl[7 * n_vocab..], n_vocab);
            let n = kls.len();
            let mean = kls.iter().sum::<f64>() / n as f64;
            let worst_kl = kls.iter().cloned().fold(0f64, f64::max);
            let bytes_digest =
                gl.iter().fold(0xcbf29ce484222325u64, |h, v| (h ^ v.to_bits() as u64).wrapping_mul(0x100000001b3));
            println!(
                "{name:<32} positions {n}  mean KL {mean:.2e} (max {worst_kl:.2e}) vs the CPU batch  argmax {:.2}%  digest {bytes_digest:016x}",
                100.0 * agree as f64 / n as f64
            );
            configs.push(serde_json::json!({"config": name, "positions": n, "mean_kl_vs_cpu_batch": mean,
                "max_kl": worst_kl, "argmax_agreement": agree as f64 / n as f64,
                "digest": format!("{bytes_digest:016x}")}));
        }
        // the Q8_0 KV cache (`--kv-type q8_0`) on the GPU against the CPU's Q8_0 cache: prefill chunks of 64 (the
        // tiled kernel over Q8_0 tiles) against the CPU's batch, decode windows (the one-block kernel) against
        // the CPU's decode; and the CPU's Q8_0 cache against its f16 one (what the cache type itself costs)
        if cpu.cfg.head_dim % 32 == 0 {
            let mut cpu8 = load(path, Arc::new(Knobs::default()), 8)?;
            cpu8.set_kv_type(strata::backend::KvType::Q8_0)?;
            let cpu8_all = {
                let mut kv = cpu8.new_kv(toks.len() + 1);
                cpu8.forward(&toks[..toks.len() - 1], &mut kv, Logits::All, &mut Scratch::default())
            };
            let cpu8_dec = teacher_force(&cpu8, &toks);
            let knobs = Arc::new(Knobs::default());
            knobs.set("adapt_every", "0").map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut m = load_mode(path, knobs, 8, false, None)?;
            m.set_kv_type(strata::backend::KvType::Q8_0)?;
            let line = m
                .attach_gpu(&check_gpu_options(CacheSize::Auto, &[], toks.len() + 8))
                .map_err(|e| anyhow::anyhow!(e))?;
            eprintln!("{line}");
            let gl = {
                let mut kv = m.new_kv(toks.len() + 1);
                m.forward(&toks[..toks.len() - 1], &mut kv, Logits::All, &mut Scratch::default())
            };
            let gd = teacher_force(&m, &toks);
            for (name, a, b) in [
                ("kv q8_0: prefill 64 vs cpu q8_0", &cpu8_all[7 * n_vocab..], &gl[7 * n_vocab..]),
                ("kv q8_0: decode vs cpu q8_0", &cpu8_dec[..], &gd[..]),
                ("kv q8_0: cpu q8_0 vs cpu f16", &reference[..], &cpu8_dec[..]),
            ] {
                let (kls, agree) = kl_argmax(a, b, n_vocab);
                let n = kls.len();
                let mean = kls.iter().sum::<f64>() / n as f64;
                let worst_kl = kls.iter().cloned().fold(0f64, f64::max);
                println!(
                    "{name:<32} positions {n}  mean KL {mean:.2e} (max {worst_kl:.2e})  argmax {:.2}%",
                    100.0 * agree as f64 / n as f64
                );
                configs.push(serde_json::json!({"config": name, "positions": n, "mean_kl": mean, "max_kl": worst_kl,
                    "argmax_agreement": agree as f64 / n as f64}));
            }
        }
        let nl = cpu.cfg.n_layer;
        let half = vec![nl / 2];
        let thirds = if nl >= 3 { vec![nl / 3, 2 * nl / 3] } else { half.clone() };
        let none: Vec<usize> = Vec::new();
        let s = PcieArm::Share(0.0);
        for (name, cache, every, asyn, pcie, ram, resident, split) in [
            ("all experts in VRAM", CacheSize::Auto, 0u32, 0u8, s, None, false, &none),
            ("cache 25%, static", q, 0, 0, s, None, false, &none),
            ("cache 25%, static, repeat", q, 0, 0, s, None, false, &none),
            ("cache 25%, adaptive blocking", q, 1, 0, s, None, false, &none),
            ("cache 25%, adaptive async", q, 1, 1, s, None, false, &none),
            // the lrfu policy (the default; the configurations above pin the seed rule so that their digests
            // stay comparable across stops)
            ("cache 25%, lrfu blocking", q, 1, 0, s, None, false, &none),
            ("cache 25%, lrfu async", q, 1, 1, s, None, false, &none),
            ("cache 25%, resident, lrfu blocking", q, 1, 0, s, None, true, &none),
            ("cache 25%, resident, lrfu async", q, 1, 1, s, None, true, &none),
            // the prefetch (live knob `prefetch`): predicted misses of the next layer computed on the GPU
            ("cache 25%, static, prefetch", q, 0, 0, s, None, false, &none),
            ("cache 25%, lrfu blocking, prefetch", q, 1, 0, s, None, false, &none),
            ("cache 25%, resident, lrfu async, prefetch", q, 1, 1, s, None, true, &none),
            ("cache 25%, pcie-frac 0.5, prefetch", q, 0, 0, PcieArm::Share(0.5), None, false, &none),
            ("split 0,0: cache 25%, lrfu blocking, prefetch", q, 1, 0, s, None, false, &half),
            ("cache 25%, pcie-frac 0.5", q, 0, 0, PcieArm::Share(0.5), None, false, &none),
            ("cache 25%, pcie auto", q, 0, 0, PcieArm::Auto, None, false, &none),
            ("cache 25%, RAM 50%, ram-adapt 8", q, 1, 0, s, Some(0.5), false, &none),
            // the resident mode (VRAM and RAM disjoint): static and blocking give the same bytes as above
            ("cache 25%, resident, static", q, 0, 0, s, None, true, &none),
            ("cache 25%, resident, blocking", q, 1, 0, s, None, true, &none),
            ("cache 25%, resident, async", q, 1, 1, s, None, true, &none),
            ("cache 25%, resident, async, pcie 0.5", q, 1, 1, PcieArm::Share(0.5), None, true, &none),
            ("cache 25%, resident RAM 50%, ram-adapt 8", q, 1, 1, s, Some(0.5), true, &none),
            // the layer split on one card (--split-device 0,0[,0]): static and blocking give the same bytes as
            // one stage; the byte check covers every stage's slots
            ("split 0,0: all experts in VRAM", CacheSize::Auto, 0, 0, s, None, false, &half),
            ("split 0,0: cache 25%, static", q, 0, 0, s, None, false, &half),
            ("split 0,0,0: cache 25%, static", q, 0, 0, s, None, false, &thirds),
            ("split 0,0: cache 25%, adaptive blocking", q, 1, 0, s, None, false, &half),
            ("split 0,0: cache 25%, resident, blocking", q, 1, 0, s, None, true, &half),
            ("split 0,0,0: cache 25%, resident, async", q, 1, 1, s, None, true, &thirds),
            ("split 0,0: cache 25%, resident, async, pcie 0.5", q, 1, 1, PcieArm::Share(0.5), None, true, &half),
            ("split 0,0: cache 25%, resident, lrfu async", q, 1, 1, s, None, true, &half),
        ] {
            let (pcie, auto) = match pcie {
                PcieArm::Share(p) => (p, "0"),
                PcieArm::Auto => (0.5, "1"),
            };
            let knobs = Arc::new(Knobs::default());
            if ram.is_some() {
                knobs.set("ram_adapt", "8").map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            knobs.set("adapt_every", &every.to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
            knobs.set("adapt_async", &asyn.to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
            let policy = if name.contains("lrfu") { "lrfu" } else { "seed" };
            knobs.set("adapt_policy", policy).map_err(|e| anyhow::anyhow!("{e}"))?;
            knobs
                .set("prefetch", if name.contains("prefetch") { "64" } else { "0" })
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            knobs.set("pcie_frac", &pcie.to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
            knobs.set("pcie_auto", auto).map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut m = load_mode(path, knobs, 8, resident, ram)?;
            let opts = check_gpu_options(cache, split, toks.len() + 8);
            let line = m.attach_gpu(&opts).map_err(|e| anyhow::anyhow!(e))?;
            eprintln!("{line}");
            let gl = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| teacher_force(&m, &toks))) {
                Ok(v) => v,
                Err(_) => {
                    println!("{name:<32} FAILED (see the log)");
                    configs.push(serde_json::json!({"config": name, "failed": true}));
                    continue;
                }
            };
            let (kls, agree) = kl_argmax(&reference, &gl, n_vocab);
            let n = kls.len();
            let mean = kls.iter().sum::<f64>() / n as f64;
            let tt = m.experts.as_ref().map(|s| s.counters.totals()).unwrap_or_default();
            let bytes_digest =
                gl.iter().fold(0xcbf29ce484222325u64, |h, v| (h ^ v.to_bits() as u64).wrapping_mul(0x100000001b3));
            // every slot and RAM place against the file after the run (drains an asynchronous round first)
            let faults = gpu(&m).verify_tiers(m.experts.as_ref().expect("MoE"))?;
            for f in faults.iter().take(5) {
                println!("  TIER FAULT: {f}");
            }
            println!(
                "{name:<32} positions {n}  mean KL {mean:.2e}  argmax {:.2}%  hits {}/{}  swaps {}  pcie entries {}  promotions {}  file reads {}  tier faults {}  digest {bytes_digest:016x}",
                100.0 * agree as f64 / n as f64, tt.vram_hits, tt.lookups, tt.swaps, tt.pcie_entries, tt.promotions, tt.file_blob_reads, faults.len()
            );
            if name.contains("prefetch") {
                println!(
                    "{:<32} prefetched {}  used {}  wasted {:.1} MiB  prediction names {:.1}% of routed experts",
                    "",
                    tt.prefetched,
                    tt.prefetch_hits,
                    tt.prefetch_wasted_bytes as f64 / 1048576.0,
                    100.0 * tt.predicted_named as f64 / tt.predicted_routed.max(1) as f64
                );
            }
            configs.push(serde_json::json!({"config": name, "positions": n, "mean_kl": mean,
                "argmax_agreement": agree as f64 / n as f64, "vram_hits": tt.vram_hits, "lookups": tt.lookups,
                "swaps": tt.swaps, "pcie_entries": tt.pcie_entries, "promotions": tt.promotions,
                "prefetched": tt.prefetched, "prefetch_hits": tt.prefetch_hits,
                "file_blob_reads": tt.file_blob_reads, "tier_faults": faults.len(), "digest": format!("{bytes_digest:016x}")}));
        }
        report.insert("model".into(), path.display().to_string().into());
        report.insert("forward".into(), configs.into());
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&serde_json::Value::Object(std::mem::take(report)))?)?;
    }
    Ok(())
}

/// H2D rate (GB/s of payload) of pitched copies from pinned memory: `rows` pieces of `width` bytes taken every
/// `width * 3 / 2` bytes (a split expert's down columns), best of 5.
/// The best of `reps` timings of the copies `issue` enqueues on a stream of its own, as GB/s of `bytes` each
/// (the stream synchronized after each). Errors: the driver's, or `issue`'s.
fn copy_gbps(
    bytes: usize,
    reps: usize,
    mut issue: impl FnMut(&strata::backend::cuda::driver::Stream) -> Result<(), strata::backend::cuda::GpuError>,
) -> Result<f64> {
    use strata::backend::cuda::driver::{Event, Stream};
    let s = Stream::new()?;
    let (a, b) = (Event::timed()?, Event::timed()?);
    let mut best = 0f64;
    for _ in 0..reps {
        a.record(&s)?;
        issue(&s)?;
        b.record(&s)?;
        s.sync()?;
        best = best.max(bytes as f64 / (b.since_ms(&a)? as f64 / 1000.0) / 1e9);
    }
    Ok(best)
}

fn h2d_pitched_gbps(width: usize, rows: usize) -> Result<f64> {
    use strata::backend::cuda::driver::{DevBuf, PinnedBuf};
    let pitch = width * 3 / 2;
    let d = DevBuf::alloc(width * rows)?;
    let src = PinnedBuf::alloc(pitch * rows)?;
    copy_gbps(width * rows, 5, |s| {
        // SAFETY: both buffers hold the ranges (rows × pitch source bytes, rows × width destination bytes) and
        // live until copy_gbps has synchronized the stream.
        unsafe { s.htod_2d_raw(d.ptr, width, src.ptr(), pitch, width, rows) }
    })
}

/// H2D bandwidth from the RAM copy (GB/s): from its start (best of 5 copies of up to 1 GiB), and over all of it
/// once in 160 MiB copies back to back (as a prefill's uploads read it); `None` without a copy of at least 64 MiB.
fn h2d_arena_gbps(st: &strata::tiers::store::ExpertStore) -> Result<Option<(f64, f64)>> {
    use strata::backend::cuda::driver::DevBuf;
    let arena = st.arena();
    let n = arena.len().min(1 << 30);
    if n < 64 << 20 {
        return Ok(None);
    }
    let src = arena.slice(0, n);
    // a card the cache filled may lack the room: then no figure
    let Ok(d) = DevBuf::alloc(n) else {
        return Ok(None);
    };
    let best = copy_gbps(n, 5, |s| {
        // SAFETY: the source is borrowed from the read-locked RAM copy until copy_gbps has synchronized the
        // stream; `d` holds n bytes.
        unsafe { s.htod_raw(d.ptr, src.as_ptr(), n) }
    })?;
    let piece = n.min(160 << 20);
    let pieces = arena.len() / piece;
    let swept = copy_gbps(pieces * piece, 1, |s| {
        for off in (0..pieces).map(|i| i * piece) {
            // SAFETY: as above; each piece lies in the RAM copy and fits `d`.
            unsafe { s.htod_raw(d.ptr, arena.slice(off, piece).as_ptr(), piece)? };
        }
        Ok(())
    })?;
    Ok(Some((best, swept)))
}

fn h2d_gbps(pinned: bool) -> Result<f64> {
    use strata::backend::cuda::driver::{DevBuf, PinnedBuf};
    let n = 1usize << 30;
    let d = DevBuf::alloc(n)?;
    let pb;
    let vb;
    let src: *const u8 = if pinned {
        pb = PinnedBuf::alloc(n)?;
        pb.ptr()
    } else {
        vb = vec![1u8; n];
        vb.as_ptr()
    };
    copy_gbps(n, 5, |s| {
        // SAFETY: the source lives until copy_gbps has synchronized the stream; `d` holds n bytes.
        unsafe { s.htod_raw(d.ptr, src, n) }
    })
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let dev = strata::backend::cuda::probe(0).map_err(|e| anyhow::anyhow!("no GPU: {e}"))?.device;
    dev.bind()?;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    let t0 = Instant::now();
    let knobs = Arc::new(Knobs::default());
    let mut m = load_mode(&a.model, knobs.clone(), threads, a.resident, a.ram_share)?;
    m.set_kv_type(a.kv_type)?;
    eprintln!(
        "loaded {} in {:.1} s ({threads} CPU threads; RAM copy: {})",
        a.model.display(),
        t0.elapsed().as_secs_f64(),
        m.experts.as_ref().map_or("none", |st| st.mode().name())
    );
    let st = m.experts.clone().context("bench-gpu needs an MoE model")?;
    let total = st.layout().n_layer() * st.layout().n_expert;
    let blob = st.layout().layers[0].blob_bytes();
    let pinned = h2d_gbps(true)?;
    let pageable = h2d_gbps(false)?;
    // pitched copies of split experts' down columns: pieces of 288 B (Qwen3-30B-A3B at k = 512) and 4032 B
    // (Mixtral-8x7B at k = 7168), 64 MiB of payload each
    for w in [288usize, 4032] {
        println!("H2D pitched, {w}-byte pieces: {:.1} GB/s", h2d_pitched_gbps(w, (64 << 20) / w)?);
    }
    // host RAM read bandwidth over the RAM copy (all threads)
    let ram_bw = {
        let arena = st.arena();
        if arena.len() >= 1 << 30 {
            crate::bench_experts_cmd::host_read_gbps(arena.slice(0, arena.len().min(8 << 30)), threads)
        } else {
            // the resident mode's copy is built when the GPU attaches: measure over a buffer of its own
            drop(arena);
            crate::bench_experts_cmd::host_read_gbps(&vec![1u8; 4 << 30], threads)
        }
    };
    println!(
        "H2D pinned {pinned:.1} GB/s, pageable {pageable:.1} GB/s; host RAM read {ram_bw:.1} GB/s; blob {:.2} MiB; {total} experts; CPU kernels {:?}",
        blob as f64 / 1048576.0,
        strata::quant::simd_level()
    );
    let mut arms = Vec::new();
    let mut seed = 42u64;
    let prompt: Vec<u32> = (0..a.prompt).map(|_| (rng(&mut seed) % m.cfg.n_vocab as u64) as u32).collect();
    println!(
        "{:<34} {:>8} {:>8} {:>7} {:>7} {:>9} {:>8} {:>9}",
        "arm", "prompt/s", "decode/s", "hit%", "swaps", "pcie/tok", "blob/tok", "bound/s"
    );
    for p in &a.adapt_policy {
        Knobs::validate("adapt_policy", p).map_err(|e| anyhow::anyhow!("--adapt-policy: {e}"))?;
    }
    let first_policy = a.adapt_policy.first().map(String::as_str).unwrap_or("lrfu");
    if let Some(m) = a.modes.iter().find(|m| !["off", "blocking", "async"].contains(&m.as_str())) {
        bail!("--modes: {m:?} is none of off, blocking, async");
    }
    let want = |mode: &str| a.modes.iter().any(|m| m == mode);
    let mut plan: Vec<(f64, &str, PcieArm, &str)> = Vec::new();
    for &f in &a.fracs {
        if f >= 1.0 {
            plan.push((f, "off", PcieArm::Share(0.0), first_policy));
        } else {
            if want("off") {
                plan.push((f, "off", PcieArm::Share(0.0), first_policy));
            }
            for mode in ["blocking", "async"].into_iter().filter(|m| want(m)) {
                for p in &a.adapt_policy {
                    plan.push((f, mode, PcieArm::Share(0.0), p));
                }
            }
            for &p in &a.pcie {
                for mode in ["off", "async"].into_iter().filter(|m| want(m)) {
                    plan.push((f, mode, p, first_policy));
                }
            }
        }
    }
    let plan: Vec<_> =
        a.pcie_prefill.iter().flat_map(|&pp| plan.iter().map(move |&(f, m, p, pol)| (f, m, p, pol, pp))).collect();
    let mut first = true;
    for (f, mode, pcie, policy, pcie_prefill) in plan {
        knobs.set("pcie_prefill", &pcie_prefill.to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let n = ((total as f64 * f).round() as usize).min(total);
        let every = if mode == "off" { "0" } else { "4" };
        knobs.set("adapt_every", every).map_err(|e| anyhow::anyhow!("{e}"))?;
        knobs.set("adapt_async", if mode == "async" { "1" } else { "0" }).map_err(|e| anyhow::anyhow!("{e}"))?;
        knobs.set("adapt_policy", policy).map_err(|e| anyhow::anyhow!("{e}"))?;
        knobs.set("prefetch", &a.prefetch.to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (pcie, auto) = match pcie {
            PcieArm::Share(p) => (p, false),
            PcieArm::Auto => (0.5, true),
        };
        knobs.set("pcie_frac", &pcie.to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
        knobs.set("pcie_auto", if auto { "1" } else { "0" }).map_err(|e| anyhow::anyhow!("{e}"))?;
        st.reset_usage();
        if first || a.layer_split.is_some() {
            // a split's caches are sized at load: a new backend per arm (the old one gone first, so that its
            // VRAM and the RAM copy's registration are released)
            m.backend = Box::new(strata::backend::CpuBackend);
            let opts = GpuOptions {
                enabled: true,
                device: 0,
                // with a split, the full-cache arm sizes from free VRAM and the reserves (the reserve flags' effect)
                cache: if f >= 1.0 && a.layer_split.is_some() { CacheSize::Auto } else { CacheSize::Slots(n) },
                reserve_mib: a.vram_reserve_mib,
                reserve_later_mib: a.vram_reserve_later_mib,
                layer_split: a.layer_split.clone(),
                split_devices: a.split_device.clone(),
                n_ctx: a.prompt + a.gen + 8,
                max_chunk: a.batch.max(1),
                // a RAM copy always; every arm's `--pcie-prefill` value is set live, so the cache is sized for any
                prefill_ahead: true,
            };
            let line = m.attach_gpu(&opts).map_err(|e| anyhow::anyhow!(e))?;
            eprintln!("{line}");
            // the link from the RAM copy itself (registered with the driver at attach, when it is), which is where
            // the prefill's uploads and the swaps read
            if let Some((hot, all)) = h2d_arena_gbps(&st)? {
                println!(
                    "H2D from the RAM copy: {hot:.1} GB/s (its first GiB, best of 5), {all:.1} GB/s (all of it once, \
                     160 MiB copies)"
                );
            }
            let stages = gpu(&m).stages();
            if stages.len() > 1 {
                let each: Vec<String> = stages
                    .iter()
                    .map(|s| {
                        format!("layers {}..{} on CUDA {}: {} slots", s.layers.start, s.layers.end, s.device, s.slots)
                    })
                    .collect();
                println!("layer split: {}", each.join("; "));
            }
            first = false;
        } else {
            gpu_mut(&mut m).rebuild_cache(&st, CacheSize::Slots(n))?;
        }
        let mut s = Scratch::default();
        if a.warmup {
            // the prompt, then two decode tokens (the first decode token of a context's size class captures its
            // graph, once in a daemon's life; llama-bench's warm-up runs a generation too), with no adaptive round:
            // the arm starts from the placement it set, its usage forgotten
            knobs.set("adapt_every", "0").map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut kv = m.new_kv(a.prompt + 8);
            let mut logits = m.forward(&prompt, &mut kv, Logits::Last, &mut s);
            for _ in 0..2 {
                logits = decode_token(&m, strata::engine::sampler::argmax(&logits), &mut kv, &mut s)?;
            }
            m.drain()?;
            st.reset_usage();
            knobs.set("adapt_every", every).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let before = st.counters.totals();
        // each timed run on a fresh KV cache; decode continues from the last one
        let mut runs = Vec::with_capacity(a.reps as usize);
        let (mut kv, mut logits) = (m.new_kv(a.prompt + a.gen + 8), Vec::new());
        for r in 0..a.reps {
            if r > 0 {
                kv = m.new_kv(a.prompt + a.gen + 8);
            }
            m.drain()?;
            let tp = Instant::now();
            logits = m.forward(&prompt, &mut kv, Logits::Last, &mut s);
            runs.push(a.prompt as f64 / tp.elapsed().as_secs_f64());
        }
        let mean_rate = runs.iter().sum::<f64>() / runs.len() as f64;
        if runs.len() > 1 {
            let (lo, hi) = runs.iter().fold((f64::MAX, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            eprintln!("prompt runs: {:.1} tok/s mean of {} ({lo:.1} .. {hi:.1})", mean_rate, runs.len());
        }
        let prompt_s = a.prompt as f64 / mean_rate;
        let td = Instant::now();
        let mut first_s = 0.0;
        let mut shift_seed = 0x5EED_u64;
        // FNV-1a over the decoded token ids: arms whose arithmetic is the same must print the same digest
        let mut digest = 0xcbf2_9ce4_8422_2325_u64;
        for i in 0..a.gen {
            // greedy, as the daemon's sampler picks at temperature 0 (or, with --shift, a random token now and
            // then)
            let next = if a.shift > 0 && i > 0 && i % a.shift == 0 {
                (rng(&mut shift_seed) % m.cfg.n_vocab as u64) as u32
            } else {
                strata::engine::sampler::argmax(&logits)
            };
            digest = (digest ^ next as u64).wrapping_mul(0x100_0000_01b3);
            logits = decode_token(&m, next, &mut kv, &mut s)?;
            if i == 0 {
                first_s = td.elapsed().as_secs_f64();
            }
        }
        let decode_s = td.elapsed().as_secs_f64();
        let d = st.counters.totals().since(&before);
        let hit = if d.lookups > 0 { d.vram_hits as f64 / d.lookups as f64 } else { 1.0 };
        let misses_per_tok = (d.lookups - d.vram_hits) as f64 / a.gen as f64;
        let pcie_per_tok = d.pcie_entries as f64 / a.gen as f64;
        let blob_per_tok = d.file_blob_reads as f64 / a.gen as f64;
        // §10 bound: the GPU's bytes over HBM plus the missed experts' bytes over RAM (CPU) — PCIe-served ones
        // over the pinned link, in parallel with the CPU's share; both read host RAM, so together they cannot
        // beat its bandwidth. A split miss leaves rows k.. to the CPU and puts its packed sub-blob (SplitGeom:
        // rows 0..k) on the link.
        // the balanced arm: the bound at the share it settled on
        let share = if auto { gpu(&m).pcie_share() } else { None };
        let pcie = share.map_or(pcie, |s| s as f64);
        let ff = m.cfg.n_ff_exp;
        let moe = m.weights.blocks.iter().find_map(|b| match &b.ffn {
            strata::arch::weights::Ffn::Moe(ex) => Some(ex),
            _ => None,
        });
        let block = moe.map_or(32, |ex| ex.gate.ty.block_size().max(ex.down.ty.block_size()));
        let k = strata::backend::cuda::model::split_rows(pcie as f32, ff, block);
        let (cpu_share, link_share) = match moe {
            Some(ex) if k > 0 && k < ff => {
                let (e, gt, dt) = (m.cfg.n_embd, ex.gate.ty, ex.down.ty);
                let g = strata::backend::cuda::slots::SplitGeom::new(k, gt.row_bytes(e), ff, dt, e);
                (1.0 - k as f64 / ff as f64, g.bytes() as f64 / blob as f64)
            }
            _ => (0.0, 1.0),
        };
        let dense = gpu(&m).dense_bytes() as f64;
        let hits_per_tok = d.vram_hits as f64 / a.gen as f64;
        let gpu_s = (dense + hits_per_tok * blob as f64) / 4.3e12;
        let cpu_bytes = ((misses_per_tok - pcie_per_tok).max(0.0) + pcie_per_tok * cpu_share) * blob as f64;
        let pcie_bytes = pcie_per_tok * link_share * blob as f64;
        let host_s = (cpu_bytes / (ram_bw * 1e9))
            .max(pcie_bytes / (pinned * 1e9))
            .max((cpu_bytes + pcie_bytes) / (ram_bw * 1e9));
        let bound = 1.0 / (gpu_s + host_s);
        let name = format!(
            "cache {:>3.0}%, adaptive {mode}{}{}{}",
            f * 100.0,
            if mode != "off" && a.adapt_policy.len() > 1 { format!(" {policy}") } else { String::new() },
            match share {
                Some(s) => format!(", pcie auto {s:.3}"),
                None if auto => ", pcie auto (no split)".to_string(),
                None if pcie > 0.0 => format!(", pcie {pcie}"),
                None => String::new(),
            },
            if a.pcie_prefill.len() > 1 { format!(", pcie-prefill {pcie_prefill}") } else { String::new() }
        );
        let (pt, dt) = (a.prompt as f64 / prompt_s, a.gen as f64 / decode_s);
        println!(
            "{name:<34} {pt:>8.1} {dt:>8.2} {:>7.1} {:>7} {pcie_per_tok:>9.2} {blob_per_tok:>8.2} {bound:>9.1}",
            100.0 * hit,
            d.swaps
        );
        if a.gen > 1 {
            // the first decode token of a context size class captures its graph (once per class in a daemon's
            // life); llama-bench times after a warm-up run
            println!(
                "{:<34} decode after the first token {:.2} tok/s (first token {:.1} ms); tokens {digest:016x}",
                "",
                (a.gen - 1) as f64 / (decode_s - first_s),
                first_s * 1e3
            );
        }
        if a.prefetch > 0 {
            println!(
                "{:<34} prefetched {:.2}/tok, used {:.1}%, wasted {:.1} MiB/tok; prediction names {:.1}% of routed experts",
                "",
                d.prefetched as f64 / a.gen as f64,
                100.0 * d.prefetch_hits as f64 / d.prefetched.max(1) as f64,
                d.prefetch_wasted_bytes as f64 / a.gen as f64 / 1048576.0,
                100.0 * d.predicted_named as f64 / d.predicted_routed.max(1) as f64
            );
        }
        let stage_slots: Vec<usize> = gpu(&m).stages().iter().map(|s| s.slots).collect();
        arms.push(serde_json::json!({"arm": name, "cache_frac": f, "slots": n, "stage_slots": stage_slots,
            "pcie_prefill": pcie_prefill, "batch": a.batch, "kv_type": a.kv_type.name(),
            "adaptive": mode, "policy": policy, "pcie_frac": pcie,
            "pcie_auto": auto,
            "prompt_tok_s": pt, "prompt_tok_s_runs": runs, "reps": a.reps, "warmup": a.warmup,
            "decode_tok_s": dt, "hit_rate": hit, "swaps": d.swaps, "swap_bytes": d.swap_bytes,
            "prefetched": d.prefetched, "prefetch_hits": d.prefetch_hits,
            "prefetch_wasted_bytes": d.prefetch_wasted_bytes,
            "prediction_accuracy": d.predicted_named as f64 / (d.predicted_routed.max(1)) as f64,
            "pcie_entries_per_token": pcie_per_tok, "blob_reads_per_token": blob_per_tok, "bound_tok_s": bound}));
    }
    let report = serde_json::json!({"model": a.model.display().to_string(), "shift": a.shift,
        "simd": format!("{:?}", strata::quant::simd_level()), "h2d_pinned_gbps": pinned,
        "h2d_pageable_gbps": pageable, "host_ram_read_gbps": ram_bw, "blob_bytes": blob, "experts": total, "arms": arms});
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// The model's CUDA backend (these commands attach one first). Panics when it runs on the CPU.
fn gpu(m: &Model) -> &GpuModel {
    m.backend.as_any().downcast_ref::<GpuModel>().expect("the model runs on the CUDA backend")
}

/// [`gpu`], mutable.
fn gpu_mut(m: &mut Model) -> &mut GpuModel {
    m.backend.as_any_mut().downcast_mut::<GpuModel>().expect("the model runs on the CUDA backend")
}

#[cfg(test)]
mod tests {
    use super::PcieArm;

    #[test]
    fn pcie_arms_parse_shares_and_auto_and_refuse_the_rest() {
        assert_eq!("0.5".parse::<PcieArm>(), Ok(PcieArm::Share(0.5)));
        assert_eq!("0".parse::<PcieArm>(), Ok(PcieArm::Share(0.0)));
        assert_eq!("auto".parse::<PcieArm>(), Ok(PcieArm::Auto));
        assert!("1.5".parse::<PcieArm>().is_err());
        assert!("-0.1".parse::<PcieArm>().is_err());
        assert!("half".parse::<PcieArm>().is_err());
    }
}
