//! `strata-tools synth-moe`: writes a GGUF of a real model's geometry with random weights — as the `llama`
//! architecture with Mixtral-style experts (`--arch llama`, the default), or as the preset's own architecture
//! (`--arch native`: `qwen3moe` with per-head q/k norms, `olmoe` with full-width q/k norms, `qwen2moe` with
//! q/k/v biases and a shared expert; Mixtral is `llama` either way) — streamed to disk (tens of GB), for scale benchmarks. Block formats
//! Q4_0, Q8_0, Q4_K, Q6_K or llama.cpp's Q4_K_M mix for the matrices (random codes or quantized normal values,
//! scales set so activations keep their size), F32 norms and
//! router. `--skew S` gives expert `e` of each layer a router bias of `−S·ln(rank+1)` (a Zipf law of
//! exponent S over a per-layer random ranking) through a constant channel of the embeddings, so a chosen
//! share of routing goes to the hottest experts; 0 = uniform routing.

use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args as ClapArgs;
use strata::gguf::writer::{string_array, GgufWriter};
use strata::gguf::Value;
use strata::quant::GgmlType;

#[derive(ClapArgs, Debug)]
pub struct SynthArgs {
    /// Output GGUF path.
    #[arg(long)]
    out: PathBuf,
    /// Geometry: mixtral-8x7b (32 layers, 4096, 8 experts × 14336, top-2), olmoe-1b-7b (16 layers, 2048, 64
    /// experts × 1024, top-8), qwen3-30b-a3b (48 layers, 2048, 128 experts × 768, top-8, head size 128),
    /// qwen2-57b-a14b (28 layers, 3584, 64 experts × 2560, top-8, shared expert 20480), tiny, micro (2 layers,
    /// 32, 4 experts × 32, top-2, a shared expert: a few KiB, for fuzzing seeds).
    #[arg(long, default_value = "mixtral-8x7b")]
    preset: String,
    /// Override the layer count.
    #[arg(long)]
    layers: Option<usize>,
    /// Matrix format: q4_0, q8_0, q4_k, q6_k, a lattice IQ format (iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s,
    /// iq1_m: random codes, for speed), or q4_k_m (llama.cpp's mix of Q4_K and Q6_K, see [`Plan::Q4KM`]).
    #[arg(long, default_value = "q4_0")]
    r#type: String,
    /// Router skew (Zipf exponent of the per-layer expert popularity); 0 = uniform.
    #[arg(long, default_value_t = 1.0)]
    skew: f32,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// `llama` (Mixtral-style experts whatever the preset) or `native` (the preset's own architecture).
    #[arg(long, default_value = "llama")]
    arch: String,
}

/// A preset's geometry (counts; `embd` and `ff_exp` in elements).
pub(crate) struct Geo {
    pub(crate) layers: usize,
    pub(crate) embd: usize,
    pub(crate) ff_exp: usize,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    /// The preset's own architecture (`--arch native`).
    native: &'static str,
    /// Shared expert width (`qwen2moe`; 0 = none).
    ff_shexp: usize,
}

/// The geometry of preset `name` (mixtral-8x7b, olmoe-1b-7b, qwen3-30b-a3b, qwen2-57b-a14b, tiny, micro); errors on
/// other names.
pub(crate) fn preset(name: &str) -> Result<Geo> {
    Ok(match name {
        "mixtral-8x7b" => Geo {
            layers: 32,
            embd: 4096,
            ff_exp: 14336,
            experts: 8,
            top_k: 2,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 32000,
            native: "llama",
            ff_shexp: 0,
        },
        "olmoe-1b-7b" => Geo {
            layers: 16,
            embd: 2048,
            ff_exp: 1024,
            experts: 64,
            top_k: 8,
            heads: 16,
            kv_heads: 16,
            head_dim: 128,
            vocab: 50304,
            native: "olmoe",
            ff_shexp: 0,
        },
        "qwen3-30b-a3b" => Geo {
            layers: 48,
            embd: 2048,
            ff_exp: 768,
            experts: 128,
            top_k: 8,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            vocab: 151936,
            native: "qwen3moe",
            ff_shexp: 0,
        },
        "tiny" => Geo {
            layers: 4,
            embd: 256,
            ff_exp: 512,
            experts: 16,
            top_k: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            vocab: 512,
            native: "qwen3moe",
            ff_shexp: 0,
        },
        // the smallest file every architecture path accepts (a few KiB: fuzzing seeds)
        "micro" => Geo {
            layers: 2,
            embd: 32,
            ff_exp: 32,
            experts: 4,
            top_k: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
            vocab: 32,
            native: "qwen2moe",
            ff_shexp: 32,
        },
        "qwen2-57b-a14b" => Geo {
            layers: 28,
            embd: 3584,
            ff_exp: 2560,
            experts: 64,
            top_k: 8,
            heads: 28,
            kv_heads: 4,
            head_dim: 128,
            vocab: 151936,
            native: "qwen2moe",
            ff_shexp: 20480,
        },
        other => {
            bail!("unknown preset {other:?} (mixtral-8x7b, olmoe-1b-7b, qwen3-30b-a3b, qwen2-57b-a14b, tiny, micro)")
        }
    })
}

/// xorshift64* stream.
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub(crate) fn normal(&mut self) -> f32 {
        let (u, v) = (self.unit().max(1e-7), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// The block formats [`fill_blocks`] writes.
/// The formats a synthetic file's matrices may take: these and the lattice IQ formats
/// (`strata::quant::format::iq::TYPES`, random codes).
const SYNTH_TYPES: [GgmlType; 4] = [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];

fn synth_types() -> impl Iterator<Item = GgmlType> {
    SYNTH_TYPES.into_iter().chain(strata::quant::format::iq::TYPES)
}

/// The formats of a synthetic file's matrices: one format, or llama.cpp's Q4_K_M mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Every matrix in this format.
    One(GgmlType),
    /// Q4_K, with Q6_K for `output` and, on the layers where llama.cpp's `use_more_bits` holds (the first and
    /// last eighth of the layers and every third between), `attn_v` and `ffn_down` (experts included) — the rule
    /// of llama.cpp's `llama_tensor_get_type` for `LLAMA_FTYPE_MOSTLY_Q4_K_M`.
    Q4KM,
}

impl Plan {
    /// `--type`: a format [`synth_type`] accepts, or `q4_k_m`.
    pub(crate) fn parse(name: &str) -> Result<Plan> {
        if name.eq_ignore_ascii_case("q4_k_m") {
            return Ok(Plan::Q4KM);
        }
        synth_type(name).map(Plan::One)
    }

    /// The format of matrix `role` (`attn_v`, `ffn_down_exps`, `output`, ...) of layer `l` of `n` (`None`: no layer).
    pub(crate) fn ty(self, role: &str, l: Option<usize>, n: usize) -> GgmlType {
        match self {
            Plan::One(t) => t,
            Plan::Q4KM => {
                let more_bits = l.is_some_and(|i| i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2);
                let wants = role == "output" || (more_bits && (role == "attn_v" || role.starts_with("ffn_down")));
                if wants {
                    GgmlType::Q6_K
                } else {
                    GgmlType::Q4_K
                }
            }
        }
    }
}

/// The format named by `--type`, read from the format registry. Errors: a name the registry lacks, or a format
/// the synthesizer cannot fill (the message lists the ones it can).
pub(crate) fn synth_type(name: &str) -> Result<GgmlType> {
    let ok = || synth_types().filter_map(strata::quant::format::lookup).map(|f| f.name).collect::<Vec<_>>();
    match strata::quant::format::by_name(name) {
        Some(f) if synth_types().any(|t| t == f.ty) => Ok(f.ty),
        Some(f) => bail!("--type {}: random weights are written in {} only", f.name, ok().join(" or ")),
        None => bail!(
            "--type {name}: not a format this build computes with ({}); random weights: {}",
            strata::quant::format::supported_list(),
            ok().join(" or ")
        ),
    }
}

/// Random rows of a block format: Q4_0 and Q8_0 codes uniform, each block's scale so that an element's standard
/// deviation is `std`; the K-quants picks from a pool of normal values of that deviation, quantized
/// ([`quantize_q4_k`], [`quantize_q6_k`]); the lattice IQ formats picks from a pool of random blocks (every grid
/// row, sign and sub-scale pattern) whose `d` gives them that deviation ([`random_lattice_block`]).
pub(crate) fn fill_blocks(ty: GgmlType, buf: &mut [u8], std: f32, rng: &mut Rng) {
    if strata::quant::format::iq::TYPES.contains(&ty) {
        let bs = ty.type_size();
        let mut pool = vec![0u8; 256 * bs];
        for blk in pool.chunks_exact_mut(bs) {
            random_lattice_block(ty, blk, std, rng);
        }
        for blk in buf.chunks_exact_mut(bs) {
            let i = (rng.next() % 256) as usize;
            blk.copy_from_slice(&pool[i * bs..(i + 1) * bs]);
        }
        return;
    }
    if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
        // a pool of quantized super-blocks, then each block a random pick from it (quantizing tens of GB of
        // normal values would take minutes; the bytes' statistics are the same)
        let bs = ty.type_size();
        let mut pool = vec![0u8; 256 * bs];
        let mut v = [0f32; 256];
        for blk in pool.chunks_exact_mut(bs) {
            for x in v.iter_mut() {
                *x = rng.normal() * std;
            }
            if ty == GgmlType::Q4_K {
                quantize_q4_k(&v, blk);
            } else {
                quantize_q6_k(&v, blk);
            }
        }
        for blk in buf.chunks_exact_mut(bs) {
            let i = (rng.next() % 256) as usize;
            blk.copy_from_slice(&pool[i * bs..(i + 1) * bs]);
        }
        return;
    }
    let (bs, code_std) = match ty {
        GgmlType::Q4_0 => (18, 4.61f32), // uniform 0..15 minus 8
        _ => (34, 73.6f32),              // uniform −127..127
    };
    let d = half::f16::from_f32(std / code_std).to_bits().to_le_bytes();
    for blk in buf.chunks_exact_mut(bs) {
        blk[0] = d[0];
        blk[1] = d[1];
        for c in blk[2..].chunks_mut(8) {
            let r = rng.next().to_le_bytes();
            c.copy_from_slice(&r[..c.len()]);
        }
        if ty == GgmlType::Q8_0 {
            for b in &mut blk[2..] {
                if *b == 0x80 {
                    *b = 0x81; // keep codes in −127..127
                }
            }
        }
    }
}

/// One super-block of a lattice IQ format (`ty`, in `out`): random bytes, then the f16 `d` (IQ1_M: the top nibbles
/// of its scale words) set so that the block's values have standard deviation `std`.
pub(crate) fn random_lattice_block(ty: GgmlType, out: &mut [u8], std: f32, rng: &mut Rng) {
    for c in out.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        c.copy_from_slice(&r[..c.len()]);
    }
    let set_d = |out: &mut [u8], d: f32| {
        let bits = half::f16::from_f32(d).to_bits();
        if ty == GgmlType::IQ1_M {
            strata::quant::format::iq1_m::set_d(out, bits);
        } else {
            out[..2].copy_from_slice(&bits.to_le_bytes());
        }
    };
    set_d(out, 1.0);
    let mut v = [0f32; 256];
    strata::quant::dequantize_row(ty, out, &mut v).expect("a lattice format dequantizes");
    let rms = (v.iter().map(|x| x * x).sum::<f32>() / 256.0).sqrt();
    set_d(out, if rms > 0.0 { std / rms } else { 0.0 });
}

/// One Q4_K super-block (ggml's `block_q4_K`, 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit scales and
/// minimums, 128 bytes of 4-bit codes; value = d·sc·q − dmin·m per 32-value sub-block) of 256 values, by each
/// sub-block's range (not llama.cpp's search: these are random weights for benchmarks).
pub(crate) fn quantize_q4_k(v: &[f32; 256], out: &mut [u8]) {
    let (mut scale, mut min) = ([0f32; 8], [0f32; 8]);
    for (j, sub) in v.chunks_exact(32).enumerate() {
        let lo = sub.iter().copied().fold(0f32, f32::min);
        let hi = sub.iter().copied().fold(f32::MIN, f32::max);
        scale[j] = (hi - lo) / 15.0;
        min[j] = -lo;
    }
    let top = |a: &[f32; 8]| a.iter().copied().fold(0f32, f32::max);
    let d = half::f16::from_f32(top(&scale) / 63.0);
    let dmin = half::f16::from_f32(top(&min) / 63.0);
    let six = |x: f32, unit: f32| if unit > 0.0 { (x / unit).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: Vec<u8> = scale.iter().map(|&x| six(x, d.to_f32())).collect();
    let m: Vec<u8> = min.iter().map(|&x| six(x, dmin.to_f32())).collect();
    out[..144].fill(0);
    out[0..2].copy_from_slice(&d.to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_le_bytes());
    // scales 0-3 and minimums 0-3 in the low six bits of bytes 0-7, the top two bits of 4-7 above them; the
    // low four bits of scales and minimums 4-7 in bytes 8-11
    for j in 0..4 {
        out[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
        out[8 + j] = m[j] | (m[j + 4] >> 4) << 6;
        out[12 + j] = (sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4;
    }
    for (j, sub) in v.chunks_exact(32).enumerate() {
        let step = d.to_f32() * sc[j] as f32;
        let off = dmin.to_f32() * m[j] as f32;
        for (l, &x) in sub.iter().enumerate() {
            let q = if step > 0.0 { ((x + off) / step).round().clamp(0.0, 15.0) as u8 } else { 0 };
            out[16 + 32 * (j / 2) + l] |= q << (4 * (j % 2));
        }
    }
}

/// One Q6_K super-block (ggml's `block_q6_K`, 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8
/// scales, f16 d; value = d·sc·(q − 32) per 16 values) of 256 values, by each 16's largest magnitude.
pub(crate) fn quantize_q6_k(v: &[f32; 256], out: &mut [u8]) {
    let scale: Vec<f32> = v.chunks_exact(16).map(|g| g.iter().fold(0f32, |a, x| a.max(x.abs())) / 31.0).collect();
    let d = half::f16::from_f32(scale.iter().copied().fold(0f32, f32::max) / 127.0);
    out.fill(0);
    for (k, &s) in scale.iter().enumerate() {
        out[192 + k] = if d.to_f32() > 0.0 { (s / d.to_f32()).round().clamp(0.0, 127.0) as i8 as u8 } else { 0 };
    }
    out[208..210].copy_from_slice(&d.to_le_bytes());
    for (i, &x) in v.iter().enumerate() {
        let step = d.to_f32() * out[192 + i / 16] as i8 as f32;
        let q = if step > 0.0 { ((x / step).round().clamp(-32.0, 31.0) + 32.0) as u8 } else { 32 };
        // value i = 128·n + 32·s + l: low bits in ql[64n + 32(s & 1) + l] (nibble s >> 1), high bits in
        // qh[32n + l] (bits 2s, 2s + 1)
        let (n, s, l) = (i / 128, i % 128 / 32, i % 32);
        out[64 * n + 32 * (s & 1) + l] |= (q & 0xF) << (4 * (s >> 1));
        out[128 + 32 * n + l] |= (q >> 4) << (2 * s);
    }
}

pub fn run(a: SynthArgs) -> Result<()> {
    let mut g = preset(&a.preset)?;
    if let Some(l) = a.layers {
        g.layers = l;
    }
    let plan = Plan::parse(&a.r#type)?;
    let nl = g.layers;
    let mt = |role: &str, l: usize| plan.ty(role, Some(l), nl);
    let (e, ff, ne) = (g.embd, g.ff_exp, g.experts);
    let (qd, kvd) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
    let mut w = GgufWriter::default();
    let arch = match a.arch.as_str() {
        "llama" => "llama",
        "native" => g.native,
        o => bail!("--arch {o}: llama or native"),
    };
    let def = strata::arch::lookup(arch).expect("presets name registry architectures");
    w.set("general.architecture", Value::String(arch.into()));
    w.set("general.name", Value::String(format!("synthetic {} ({}, random weights)", a.preset, a.r#type)));
    let u = |v: usize| Value::U32(v as u32);
    w.set(&format!("{arch}.block_count"), u(g.layers));
    w.set(&format!("{arch}.embedding_length"), u(e));
    w.set(&format!("{arch}.feed_forward_length"), u(ff));
    w.set(&format!("{arch}.expert_feed_forward_length"), u(ff));
    w.set(&format!("{arch}.attention.head_count"), u(g.heads));
    w.set(&format!("{arch}.attention.head_count_kv"), u(g.kv_heads));
    w.set(&format!("{arch}.attention.key_length"), u(g.head_dim));
    w.set(&format!("{arch}.attention.value_length"), u(g.head_dim));
    w.set(&format!("{arch}.rope.dimension_count"), u(g.head_dim));
    w.set(&format!("{arch}.expert_count"), u(ne));
    w.set(&format!("{arch}.expert_used_count"), u(g.top_k));
    w.set(&format!("{arch}.context_length"), u(32768));
    w.set(&format!("{arch}.rope.freq_base"), Value::F32(1e6));
    w.set(&format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    if def.ffn == strata::arch::FfnRule::MoeShared {
        w.set(&format!("{arch}.expert_shared_feed_forward_length"), u(g.ff_shexp));
    }
    w.set("tokenizer.ggml.model", Value::String("llama".into()));
    w.set("tokenizer.ggml.tokens", string_array((0..g.vocab).map(|i| format!("<t{i}>"))));
    w.set(
        "tokenizer.ggml.scores",
        Value::Array(strata::gguf::ValueType::F32, (0..g.vocab).map(|_| Value::F32(0.0)).collect()),
    );
    w.set(
        "tokenizer.ggml.token_type",
        Value::Array(strata::gguf::ValueType::I32, (0..g.vocab).map(|_| Value::I32(1)).collect()),
    );
    w.set("tokenizer.ggml.bos_token_id", u(1));
    w.set("tokenizer.ggml.eos_token_id", u(2));
    // tensors: (name, dims, type, bytes, std)
    enum Kind {
        Mat(f32),
        Ones,
        Embd,
        Router,
        /// F32 values of this standard deviation (biases, the shared expert's gate).
        Small(f32),
    }
    let mut list: Vec<(String, Vec<u64>, GgmlType, Kind)> = Vec::new();
    let std_in = |cols: usize| 1.0 / (cols as f32).sqrt();
    list.push(("token_embd.weight".into(), vec![e as u64, g.vocab as u64], GgmlType::F32, Kind::Embd));
    for l in 0..g.layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        list.push((n("attn_norm"), vec![e as u64], GgmlType::F32, Kind::Ones));
        list.push((n("attn_q"), vec![e as u64, qd as u64], mt("attn_q", l), Kind::Mat(std_in(e))));
        list.push((n("attn_k"), vec![e as u64, kvd as u64], mt("attn_k", l), Kind::Mat(std_in(e))));
        list.push((n("attn_v"), vec![e as u64, kvd as u64], mt("attn_v", l), Kind::Mat(std_in(e))));
        list.push((n("attn_output"), vec![qd as u64, e as u64], mt("attn_output", l), Kind::Mat(0.5 * std_in(qd))));
        let v = |d: usize| vec![d as u64];
        match def.qk_norm {
            strata::arch::QkNorm::None => {}
            strata::arch::QkNorm::PerHead => {
                list.push((n("attn_q_norm"), v(g.head_dim), GgmlType::F32, Kind::Ones));
                list.push((n("attn_k_norm"), v(g.head_dim), GgmlType::F32, Kind::Ones));
            }
            strata::arch::QkNorm::Full => {
                list.push((n("attn_q_norm"), v(qd), GgmlType::F32, Kind::Ones));
                list.push((n("attn_k_norm"), v(kvd), GgmlType::F32, Kind::Ones));
            }
        }
        if arch == "qwen2moe" {
            for (role, d) in [("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)] {
                list.push((format!("blk.{l}.{role}.bias"), v(d), GgmlType::F32, Kind::Small(0.1)));
            }
        }
        if def.ffn == strata::arch::FfnRule::MoeShared {
            let fs = g.ff_shexp as u64;
            list.push((n("ffn_gate_inp_shexp"), v(e), GgmlType::F32, Kind::Small(std_in(e))));
            list.push((n("ffn_gate_shexp"), vec![e as u64, fs], mt("ffn_gate_shexp", l), Kind::Mat(std_in(e))));
            list.push((n("ffn_up_shexp"), vec![e as u64, fs], mt("ffn_up_shexp", l), Kind::Mat(std_in(e))));
            list.push((
                n("ffn_down_shexp"),
                vec![fs, e as u64],
                mt("ffn_down_shexp", l),
                Kind::Mat(0.5 * std_in(g.ff_shexp)),
            ));
        }
        list.push((n("ffn_norm"), vec![e as u64], GgmlType::F32, Kind::Ones));
        list.push((n("ffn_gate_inp"), vec![e as u64, ne as u64], GgmlType::F32, Kind::Router));
        list.push((
            n("ffn_gate_exps"),
            vec![e as u64, ff as u64, ne as u64],
            mt("ffn_gate_exps", l),
            Kind::Mat(std_in(e)),
        ));
        list.push((n("ffn_up_exps"), vec![e as u64, ff as u64, ne as u64], mt("ffn_up_exps", l), Kind::Mat(std_in(e))));
        list.push((
            n("ffn_down_exps"),
            vec![ff as u64, e as u64, ne as u64],
            mt("ffn_down_exps", l),
            Kind::Mat(0.5 * std_in(ff)),
        ));
    }
    list.push(("output_norm.weight".into(), vec![e as u64], GgmlType::F32, Kind::Ones));
    list.push((
        "output.weight".into(),
        vec![e as u64, g.vocab as u64],
        plan.ty("output", None, nl),
        Kind::Mat(std_in(e)),
    ));
    let sizes: Vec<u64> = list
        .iter()
        .map(|(_, d, t, _)| {
            let n: u64 = d.iter().product();
            n / t.block_size() as u64 * t.type_size() as u64
        })
        .collect();
    for (name, dims, t, _) in &list {
        w.add_tensor(name, dims.clone(), *t, Vec::new());
    }
    let (header, offsets) = w.header_for(&sizes);
    let total = header.len() as u64 + offsets.last().unwrap() + sizes.last().unwrap();
    let t0 = std::time::Instant::now();
    let f = std::fs::File::create(&a.out)?;
    f.set_len(total)?;
    let mut out = BufWriter::with_capacity(8 << 20, f);
    out.write_all(&header)?;
    // the constant channel 0 of every embedding carries the router bias (see the module doc)
    const BIAS_CH: f32 = 8.0;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    for (i, (_, dims, t, kind)) in list.iter().enumerate() {
        out.seek(SeekFrom::Start(header.len() as u64 + offsets[i]))?;
        let size = sizes[i] as usize;
        let mut buf = vec![0u8; size];
        let seed = a.seed.wrapping_mul(0x9E3779B97F4A7C15) ^ (i as u64 + 1).wrapping_mul(0xD1B54A32D192ED03);
        match kind {
            Kind::Mat(std) => {
                let bs = t.type_size();
                let per = (size / bs).div_ceil(threads) * bs;
                std::thread::scope(|sc| {
                    for (j, chunk) in buf.chunks_mut(per.max(bs)).enumerate() {
                        let std = *std;
                        let t = *t;
                        sc.spawn(move || fill_blocks(t, chunk, std, &mut Rng(seed ^ (j as u64 + 1) << 32 | 1)));
                    }
                });
            }
            Kind::Small(std) => {
                let mut r = Rng(seed | 1);
                for c in buf.chunks_exact_mut(4) {
                    c.copy_from_slice(&(r.normal() * std).to_le_bytes());
                }
            }
            Kind::Ones => {
                for c in buf.chunks_exact_mut(4) {
                    c.copy_from_slice(&1f32.to_le_bytes());
                }
            }
            Kind::Embd => {
                let mut r = Rng(seed | 1);
                for row in buf.chunks_exact_mut(4 * dims[0] as usize) {
                    for (c, v) in row.chunks_exact_mut(4).enumerate() {
                        let x = if c == 0 { BIAS_CH } else { r.normal() };
                        v.copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
            Kind::Router => {
                let mut r = Rng(seed | 1);
                // per-layer popularity ranking
                let mut rank: Vec<usize> = (0..ne).collect();
                for k in (1..ne).rev() {
                    let j = (r.next() % (k as u64 + 1)) as usize;
                    rank.swap(k, j);
                }
                // xn[0] ≈ BIAS_CH / rms(x) ≈ BIAS_CH / sqrt((BIAS_CH² + e) / e)
                let xn0 = BIAS_CH / ((BIAS_CH * BIAS_CH + e as f32) / e as f32).sqrt();
                for (ex, row) in buf.chunks_exact_mut(4 * e).enumerate() {
                    let bias = -a.skew * ((rank[ex] + 1) as f32).ln();
                    for (c, v) in row.chunks_exact_mut(4).enumerate() {
                        let x = if c == 0 { bias / xn0 } else { r.normal() * std_in(e) };
                        v.copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        out.write_all(&buf)?;
    }
    out.flush()?;
    eprintln!(
        "wrote {} ({:.2} GiB, {} layers × {} experts of {:.2} MiB, {}) in {:.1} s",
        a.out.display(),
        total as f64 / (1u64 << 30) as f64,
        g.layers,
        ne,
        (0..nl)
            .map(|l| ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
                .map(|r| mt(r, l).row_bytes(e) * ff)
                .iter()
                .sum::<usize>())
            .sum::<usize>() as f64
            / nl as f64
            / (1u64 << 20) as f64,
        a.r#type,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The synthesizer's K-quant blocks read back through the format registry's dequantization (checked
    /// against the `gguf` package in the daemon's tests) within the error their code widths allow.
    #[test]
    fn k_quant_blocks_read_back() {
        let mut r = Rng(7);
        for (ty, tol) in [(GgmlType::Q4_K, 0.12), (GgmlType::Q6_K, 0.03)] {
            let f = strata::quant::format::lookup(ty).expect("registry");
            let mut blocks = vec![0u8; 16 * ty.type_size()];
            let mut v = [0f32; 256];
            let (mut err, mut norm) = (0f64, 0f64);
            for blk in blocks.chunks_exact_mut(ty.type_size()) {
                for x in v.iter_mut() {
                    *x = r.normal() * 0.02;
                }
                if ty == GgmlType::Q4_K {
                    quantize_q4_k(&v, blk);
                } else {
                    quantize_q6_k(&v, blk);
                }
                let mut back = [0f32; 256];
                (f.dequantize)(blk, &mut back);
                for (a, b) in v.iter().zip(&back) {
                    err += ((a - b) as f64).powi(2);
                    norm += (*a as f64).powi(2);
                }
            }
            let rel = (err / norm).sqrt();
            assert!(rel < tol, "{ty:?}: relative error {rel}");
            assert!(rel > 0.0, "{ty:?}: lossless quantization of random values is not plausible");
        }
    }

    /// A synthetic Q4_K_M `qwen3moe` file (Q6_K expert down matrices on some layers: blobs of two sizes) loads
    /// with its expert store and gives finite logits for a prompt and a decode step on the CPU.
    #[test]
    fn q4_k_m_file_runs_on_the_cpu() {
        use strata::model::forward::Scratch;
        use strata::model::{Logits, Model};
        let dir = std::env::temp_dir().join(format!("strata-synth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("tiny-q4_k_m.gguf");
        let args = SynthArgs {
            out: out.clone(),
            preset: "tiny".into(),
            layers: None,
            r#type: "q4_k_m".into(),
            skew: 1.0,
            seed: 3,
            arch: "native".into(),
        };
        run(args).unwrap();
        let file = std::sync::Arc::new(strata::gguf::GgufFile::open(&out).unwrap());
        let mut m = Model::load(file.clone()).unwrap();
        let layout = m.expert_layout().expect("an MoE file");
        let sizes: std::collections::BTreeSet<usize> = layout.layers.iter().map(|l| l.blob_bytes()).collect();
        assert_eq!(sizes.len(), 2, "Q4_K and Q6_K down matrices give two blob sizes");
        let g = m.geometry();
        let knobs = std::sync::Arc::new(strata::tiers::knobs::Knobs::default());
        let cfg = strata::tiers::store::StoreConfig::default();
        let st = strata::tiers::store::ExpertStore::new(layout, file, &out, g, None, &cfg, knobs).unwrap();
        m.experts = Some(std::sync::Arc::new(st));
        let mut kv = m.new_kv(16);
        let mut s = Scratch::default();
        let prompt = m.forward(&[1, 5, 9, 77, 300, 4], &mut kv, Logits::Last, &mut s);
        s.decode = true;
        let step = m.forward(&[12], &mut kv, Logits::Last, &mut s);
        assert!(!prompt.is_empty() && prompt.iter().chain(&step).all(|v| v.is_finite()));
        assert!(prompt.iter().any(|&v| v != prompt[0]), "logits vary");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The Q4_K_M plan follows llama.cpp's rule: Q6_K for `output` and for `attn_v` / `ffn_down*` on the first
    /// and last eighth of the layers and every third layer between.
    #[test]
    fn q4_k_m_plan() {
        let p = Plan::parse("Q4_K_M").unwrap();
        assert_eq!(p.ty("output", None, 48), GgmlType::Q6_K);
        assert_eq!(p.ty("attn_q", Some(0), 48), GgmlType::Q4_K);
        let six: Vec<usize> = (0..48).filter(|&l| p.ty("ffn_down_exps", Some(l), 48) == GgmlType::Q6_K).collect();
        let want: Vec<usize> = (0..6).chain((8..42).filter(|l| (l - 6) % 3 == 2)).chain(42..48).collect();
        assert_eq!(six, want);
        assert_eq!(p.ty("ffn_gate_exps", Some(0), 48), GgmlType::Q4_K);
        assert_eq!(Plan::parse("q8_0").unwrap(), Plan::One(GgmlType::Q8_0));
        assert!(Plan::parse("q5_k").is_err());
        assert_eq!(Plan::parse("IQ2_XS").unwrap(), Plan::One(GgmlType::IQ2_XS));
    }
}
