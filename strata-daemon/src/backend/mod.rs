//! The backend interface and its two implementations.
//!
//! The forward pass is written once (`crate::model::forward`) as a sequence of [`Ops`] calls per block: norm,
//! the q/k/v projections, RoPE with the KV-cache store, attention over the KV cache, the output projection,
//! and the FFN (dense, or router + top-k, the shared expert and the MoE layer over the expert tiers). A
//! [`Backend`] runs one pass: it lays out the embeddings and RoPE angles, hands the pass its [`Ops`], and
//! returns the logits. The ops read the architecture's choices (RoPE kind, q/k norm, biases, gating, top-k
//! renormalisation) from the [`crate::arch::ArchSpec`] in [`ModelRef::cfg`], never an architecture's name.
//!
//! - [`cpu`]: always built; the worker pool and the SIMD kernels of [`crate::quant`].
//! - `cuda` (cargo feature `cuda`, on by default; driver and NVRTC loaded at run time): dense weights and the KV
//!   cache in VRAM, the VRAM expert cache, hits on the GPU beside misses on the CPU pool, the PCIe share,
//!   CUDA graphs. [`select`] picks it when a driver and a device are found, and says why not otherwise.
//!
//! Dependencies point one way: the model calls the backend; the backend reads the architecture, the located
//! weights ([`crate::arch::weights`]) and the expert tiers ([`crate::tiers`]); nothing here names the model.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kv;
pub mod moe;
pub mod scratch;

use std::sync::Arc;

use crate::arch::config::ModelConfig;
use crate::arch::weights::Weights;
use crate::pool::WorkerPool;
use crate::tiers::policy::Swap;
use crate::tiers::store::ExpertStore;
use crate::tiers::vram::CacheSize;

pub use cpu::{CpuBackend, Precision};
pub use kv::{KvCache, KvType};
pub use scratch::{RouteRecord, Scratch};

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only for the last token of the chunk.
    Last,
    /// For every token of the chunk.
    All,
    /// For none: a prompt chunk before the last, whose K/V rows are all that count. The pass returns no
    /// logits, and a backend may return before the chunk's work is done (the CUDA backend does, every expert in
    /// VRAM); later passes run after it, and a fault in it surfaces at the next one that waits — the prompt's
    /// last chunk, or the next request's first pass when the prompt was cancelled in between.
    None,
}

impl Logits {
    /// The rows of a chunk of `t` tokens (`t` ≥ 1) whose logits are returned: `(first row, rows)`; `None` for
    /// [`Logits::None`].
    pub fn rows(self, t: usize) -> Option<(usize, usize)> {
        match self {
            Logits::Last => Some((t - 1, 1)),
            Logits::All => Some((0, t)),
            Logits::None => None,
        }
    }
}

/// Errors of a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A pass produced a non-finite value (NaN or infinity: corrupt weights, an overflow): the request fails, the
    /// daemon keeps serving. `layer` is where it first appeared (the CPU backend checks after every layer's ops;
    /// `None`: seen in the logits).
    #[error("non-finite values in {tensor}{}", layer.map(|l| format!(" of layer {l}")).unwrap_or_default())]
    NonFinite {
        /// The layer, when known.
        layer: Option<usize>,
        /// The tensor (GGUF name) whose output held them.
        tensor: &'static str,
    },
    /// An expert's blob could not be read from the model file (the file tier: truncated or replaced under the
    /// daemon, an I/O error): the request fails, the store is unchanged and the daemon keeps serving (a later
    /// request reads the blob again).
    #[error("reading expert {expert} of layer {layer} from the model file failed: {reason}")]
    BlobRead {
        /// The layer.
        layer: usize,
        /// The expert's id in the layer.
        expert: usize,
        /// The read's error.
        reason: String,
    },
    /// The CUDA backend failed (driver, NVRTC, VRAM, a setting it cannot run).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Gpu(#[from] cuda::GpuError),
}

/// Everything a backend reads from a loaded model: hyper-parameters, the located weights and the mapped file
/// they point into, the CPU pool and arithmetic, and the expert store (RAM copy, file tier, VRAM residency) of
/// an MoE model.
#[derive(Clone, Copy)]
pub struct ModelRef<'a> {
    /// Hyper-parameters and the architecture's choices.
    pub cfg: &'a ModelConfig,
    /// Every weight, as byte ranges of [`ModelRef::bytes`].
    pub weights: &'a Weights,
    /// The mapped GGUF file.
    pub bytes: &'a [u8],
    /// The CPU worker pool.
    pub pool: &'a WorkerPool,
    /// Arithmetic of the CPU's matrix products.
    pub precision: Precision,
    /// How the KV cache stores rows (`--kv-type`; f32 rows regardless under [`Precision::F32`]).
    pub kv_type: KvType,
    /// The expert store of an MoE model; `None` computes experts from the mapping.
    pub experts: Option<&'a Arc<ExpertStore>>,
}

impl<'a> ModelRef<'a> {
    /// The bytes of `w` in the mapped file as a matrix view.
    pub fn mat(&self, w: &crate::arch::weights::Weight) -> cpu::MatRef<'a> {
        cpu::MatRef {
            data: &self.bytes[w.offset..w.offset + w.bytes()],
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            stride: 0,
        }
    }
}

/// An RMSNorm of the residual stream into the normalized input of the next products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// Block `l`'s `attn_norm`, before attention.
    Attn(usize),
    /// Block `l`'s `ffn_norm`, before the FFN.
    Ffn(usize),
}

/// The operations of one forward pass over a chunk of `t` tokens at positions `pos0 ..` (fixed when the backend
/// creates the pass). Each works on the pass's own buffers: the residual stream `x` (`t × n_embd`), the
/// normalized input `xn`, the projections, the routing. Layer arguments index `ModelRef::weights.blocks`.
/// Errors are the backend's (a failed driver call); the CPU's ops do not fail.
///
/// Contracts of a block, as [`crate::model::forward`] calls them:
/// - after [`Ops::experts`], `x` is complete only for the next [`Ops::norm`] or [`Ops::output`] (the CUDA
///   backend folds the MoE combine into that norm); nothing else reads `x` in between;
/// - [`Ops::shared_expert`] of a layer comes right before its [`Ops::experts`], which adds it;
/// - an MoE block's [`Ops::segment`] ends with its [`Ops::route`], and the ops inside a segment have no effect
///   on the host that a replay could skip (the CPU records routes there, but never replays).
pub trait Ops {
    /// Runs `ops` — a stretch of operations with no host round trip inside — as this backend sees fit: the CPU
    /// runs it; the CUDA backend may record it once per (`layer`, attention size) as a graph and replay it.
    fn segment(
        &mut self,
        layer: usize,
        ops: &mut dyn FnMut(&mut dyn Ops) -> Result<(), BackendError>,
    ) -> Result<(), BackendError>;
    /// `xn = rms_norm(x) · w` (per token, the weights of `which`), and its 8-bit quantization for the products.
    fn norm(&mut self, which: Norm) -> Result<(), BackendError>;
    /// The q/k/v projections of `xn` (`attn_q`, `attn_k`, `attn_v`), with their biases and the q/k RMSNorm
    /// (per head or full width) when the block has them — here or in [`Ops::rope_store`], which always comes next
    /// and is the only reader of the projections (the CUDA backend does them there, in one launch with RoPE).
    fn qkv(&mut self, layer: usize) -> Result<(), BackendError>;
    /// RoPE on the queries and keys (adjacent pairs or NeoX halves, `n_rot` dimensions per head) and the keys
    /// and values stored in the KV cache at positions `pos0 .. pos0 + t`.
    fn rope_store(&mut self, layer: usize) -> Result<(), BackendError>;
    /// Causal grouped-query attention of the queries over the KV cache (positions `0 ..= pos0 + i` for token
    /// i), scaled by `1/sqrt(head_dim)`.
    fn attention(&mut self, layer: usize) -> Result<(), BackendError>;
    /// `x += attn_output · attention (+ attn_output.bias)`.
    fn attn_output(&mut self, layer: usize) -> Result<(), BackendError>;
    /// A dense block's SwiGLU FFN of `xn` added to `x`: `x += down(silu(gate xn) · up xn)`.
    fn ffn(&mut self, layer: usize) -> Result<(), BackendError>;
    /// The router product (`ffn_gate_inp`) of `xn`, softmax or sigmoid, top-k, renormalised when the
    /// architecture says so, times its expert weight scale ([`moe::router::top_k`]).
    fn route(&mut self, layer: usize) -> Result<(), BackendError>;
    /// The shared expert of an MoE block with one: `sigmoid(ffn_gate_inp_shexp · xn) · ffn_shexp(xn)`, added to
    /// the residual stream with the routed experts' output (by [`Ops::experts`] or before it).
    fn shared_expert(&mut self, layer: usize) -> Result<(), BackendError>;
    /// The MoE layer over the tiers: each routed expert computed where its bytes are (VRAM slot, RAM copy, file
    /// blob) and the weighted sum `Σ_k w_k · expert_k(xn)` combined into `x`.
    fn experts(&mut self, layer: usize) -> Result<(), BackendError>;
    /// `output_norm` and the `output` product of rows `row0 .. row0 + rows` of `x` into the pass's logits.
    fn output(&mut self, row0: usize, rows: usize) -> Result<(), BackendError>;
    /// The blocks this pass runs, of the model's `n_layer`: all of them, unless the pass is one stage of a layer
    /// split (the CUDA backend's pipeline), which runs its own range and hands `x` on.
    fn layers(&self, n_layer: usize) -> std::ops::Range<usize> {
        0..n_layer
    }
    /// After the last block of a stage that is not the model's last: `x` completed (a pending MoE combine done)
    /// for the next stage to take. Only called when [`Ops::layers`] ends before the last block.
    fn hand_off(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
}

/// The body of a pass: the forward pass over the blocks, called with the pass's [`Ops`] and the logits rows
/// wanted of this chunk (`(row0, rows)`, `None` for none). A backend may call it more than once for one chunk
/// (to record it) or not at all (replaying a recording), so it must do nothing but call ops.
pub type Body<'b> = dyn FnMut(&mut dyn Ops, Option<(usize, usize)>) -> Result<(), BackendError> + 'b;

/// A compute backend: runs forward passes of a model and owns what it keeps between them (device weights, the
/// VRAM expert cache).
pub trait Backend: Send + Sync {
    /// A short name for logs (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Whether passes read the dense weights from the host's file mapping (the CPU does; a GPU backend holds
    /// them in VRAM and reads only token embedding rows on the host). [`crate::model::Model::detach_from_file`]
    /// moves what is read there out of the mapping.
    fn reads_dense_on_host(&self) -> bool {
        true
    }
    /// A new KV cache for `n_ctx` positions (on the host, or only its length when the backend keeps K/V on a
    /// device).
    fn new_kv(&self, m: &ModelRef<'_>, n_ctx: usize) -> KvCache;
    /// Runs `tokens` at positions `kv.len ..`, appending their K/V, and returns the logits (`n_vocab` per
    /// returned token, row-major): the backend lays out the embeddings and RoPE angles and calls `body` for each
    /// chunk it runs. Panics if the chunk overflows the cache (callers check `kv.len + tokens.len() <=
    /// kv.n_ctx`). Errors: the backend's (a failed driver call).
    fn forward(
        &self,
        m: &ModelRef<'_>,
        tokens: &[u32],
        kv: &mut KvCache,
        which: Logits,
        s: &mut Scratch,
        body: &mut Body<'_>,
    ) -> Result<Vec<f32>, BackendError>;
    /// After a decode window: carries out an adaptive round's swaps (`plan`, from
    /// [`ExpertStore::end_decode_window`]) into the VRAM expert cache. Backends without one drop the plan.
    fn end_window(&self, store: &Arc<ExpertStore>, plan: Vec<Swap>) -> Result<(), BackendError> {
        let _ = (store, plan);
        Ok(())
    }
    /// At a request's start: waits for an asynchronous adaptive round in flight and admits it.
    fn drain(&self, store: &Arc<ExpertStore>) -> Result<(), BackendError> {
        let _ = store;
        Ok(())
    }
    /// Compares every tier copy of the experts with the model file's bytes: every RAM place (and, where the backend
    /// has one, every VRAM slot) holds exactly the expert the residency table says, no two experts share a place,
    /// and in the resident mode no expert is in both. Waits for an asynchronous adaptive round in flight first.
    /// Returns one line per fault (empty = consistent). Reads every copy: seconds on a large model, for checks
    /// between requests, never during one. Errors: a device error while reading the slots back.
    fn verify_tiers(&self, store: &Arc<ExpertStore>) -> Result<Vec<String>, BackendError> {
        Ok(store.verify_ram_copy())
    }
    /// The backend as [`std::any::Any`], for tools that reach a backend's own API (benchmarks rebuilding the
    /// VRAM cache).
    fn as_any(&self) -> &dyn std::any::Any;
    /// As [`Backend::as_any`], mutable.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// RoPE angles of positions `pos0 .. pos0 + t`: `t × n_rot/2` (cos, sin) pairs, pair i of a position at angle
/// `pos · rope_freq_scale · rope_freq_base^(-2i/n_rot)` (llama.cpp's `rope_yarn` without YaRN), or with YaRN's
/// corrections ([`crate::arch::config::Yarn`]) when the model has them.
pub fn rope_angles(cfg: &ModelConfig, pos0: usize, t: usize, out: &mut Vec<(f32, f32)>) {
    rope_angles_at(cfg.n_rot, cfg.rope_freq_base, cfg.rope_freq_scale, cfg.rope_yarn.as_ref(), pos0, t, out)
}

/// [`rope_angles`] of the sliding-window layers ([`ModelConfig::is_swa`]): their base and position scale.
pub fn rope_angles_swa(cfg: &ModelConfig, pos0: usize, t: usize, out: &mut Vec<(f32, f32)>) {
    let yarn = cfg.rope_yarn.as_ref();
    rope_angles_at(cfg.n_rot, cfg.rope_freq_base_swa, cfg.rope_freq_scale_swa, yarn, pos0, t, out)
}

fn rope_angles_at(
    n_rot: usize,
    base: f32,
    scale: f32,
    yarn: Option<&crate::arch::config::Yarn>,
    pos0: usize,
    t: usize,
    out: &mut Vec<(f32, f32)>,
) {
    let half = n_rot / 2;
    out.clear();
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    let Some(y) = yarn else {
        for p in pos0..pos0 + t {
            let mut theta = p as f32 * scale;
            for _ in 0..half {
                out.push((theta.cos(), theta.sin()));
                theta *= theta_scale;
            }
        }
        return;
    };
    // ggml's rope_yarn over ggml_rope_cache_init's angles (ops.cpp), in its order of operations
    let [lo, hi] = y.corr_dims(n_rot, base);
    let mut mscale = y.attn_factor;
    if y.ext_factor != 0.0 {
        mscale *= 1.0 + 0.1 * (1.0 / scale).ln();
    }
    for p in pos0..pos0 + t {
        let mut extrap = p as f32;
        for i in 0..half {
            let interp = scale * extrap;
            let theta = if y.ext_factor != 0.0 {
                let ramp = 1.0 - ((i as f32 - lo) / (hi - lo).max(0.001)).clamp(0.0, 1.0);
                let mix = ramp * y.ext_factor;
                interp * (1.0 - mix) + extrap * mix
            } else {
                interp
            };
            out.push((theta.cos() * mscale, theta.sin() * mscale));
            extrap *= theta_scale;
        }
    }
}

/// How the daemon uses a GPU (flags of DESIGN.md §4).
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// Try the GPU (`--gpu auto`); false = CPU only (`--gpu off`).
    pub enabled: bool,
    /// CUDA device ordinal.
    pub device: usize,
    /// `--expert-cache N|auto`.
    pub cache: CacheSize,
    /// `--vram-reserve-mib` (MiB): kept free on the first stage's card.
    pub reserve_mib: u64,
    /// `--vram-reserve-later-mib` (MiB; `None` = `reserve_mib`): kept free on the cards of later stages.
    pub reserve_later_mib: Option<u64>,
    /// `--layer-split` (`None`: one stage, unless `split_devices` names several).
    pub layer_split: Option<crate::tiers::split::LayerSplit>,
    /// `--split-device`: the device of each stage (empty: the first visible ones).
    pub split_devices: Vec<usize>,
    /// Context length (KV positions in VRAM).
    pub n_ctx: usize,
    /// Prefill chunk (tokens per pass).
    pub max_chunk: usize,
    /// A prefill may upload the next layer's missed experts ahead (a RAM copy to upload from, not
    /// `--mmap-experts`; `--pcie-prefill` on and at most `max_chunk`; a chunk of `max_chunk` tokens routing to
    /// nearly every expert, `max_chunk × top-k ≥ 4 × experts`): the expert cache then takes a second staging set
    /// where some experts stay off VRAM ([`cuda::pipeline::staging_sets`]).
    pub prefill_ahead: bool,
}

/// Whether a prefill chunk of `t` tokens with top-`k` routing over `n_expert` experts routes to nearly every expert
/// (`t × k ≥ 4 × n_expert`: an expert goes unrouted with probability about e^-4), so that a layer's RAM-resident
/// experts are worth uploading before its routing is known (the GPU's uploads ahead; [`GpuOptions::prefill_ahead`]).
pub fn chunk_reaches_all(t: usize, k: usize, n_expert: usize) -> bool {
    t * k >= 4 * n_expert
}

/// Whether the CUDA backend holds a KV cache of `kv_type` for heads of `head_dim` values: a Q8_0 cache needs whole
/// Q8_0 blocks per head (a multiple of 32) and at most 256 values (the Q8_0 attention kernels keep one head's
/// quantized query in fixed shared memory). Errors: the one-line reason, naming the way out.
pub fn gpu_kv_type_ok(kv_type: KvType, head_dim: usize) -> Result<(), String> {
    if kv_type != KvType::Q8_0 {
        return Ok(());
    }
    if !head_dim.is_multiple_of(32) {
        return Err(format!(
            "--kv-type q8_0: head size {head_dim} is not a multiple of 32 (Q8_0 blocks); use --kv-type f16"
        ));
    }
    if head_dim > 256 {
        return Err(format!(
            "--kv-type q8_0 on the GPU: head size {head_dim} is above 256, the largest its kernels take; use --kv-type f16"
        ));
    }
    Ok(())
}

/// The backend to run `m` on: the CUDA backend when GPU use is on and a driver, NVRTC and a device are found
/// (it uploads the dense weights and fills the VRAM expert cache), otherwise `None` (stay on the CPU). Returns
/// it with the one line to log (what runs where, or why the CPU). Errors: a GPU was found but loading onto it
/// failed (out of VRAM, a format without kernels), or a Q8_0 KV cache (`--kv-type q8_0`) with a head size the GPU
/// cannot hold in Q8_0 ([`gpu_kv_type_ok`]): the caller decides whether that is fatal.
pub fn select(m: &ModelRef<'_>, o: &GpuOptions) -> Result<(Option<Box<dyn Backend>>, String), String> {
    // a layer split's points and device count are checked against the model before any GPU is looked for
    crate::tiers::split::check_flags(o.layer_split.as_ref(), &o.split_devices, m.cfg.n_layer)
        .map_err(|e| e.to_string())?;
    if !o.enabled {
        return Ok((None, "GPU off (--gpu off): running on the CPU".into()));
    }
    #[cfg(feature = "cuda")]
    {
        let probe = match cuda::probe(o.device) {
            Ok(p) => p,
            Err(e) => return Ok((None, format!("{e}: running on the CPU"))),
        };
        let d = probe.device.clone();
        gpu_kv_type_ok(m.kv_type, m.cfg.head_dim)?;
        let (free, total) = d.mem_info().map_err(|e| e.to_string())?;
        let cfg = gpu_config(o);
        let (starts, devices) = cuda::pipeline::plan_stages(m, o, &probe, &cfg)?;
        let g = match cuda::GpuModel::load(m, &devices, &cfg, &starts) {
            Ok(g) => g,
            Err(e @ (cuda::GpuError::Architecture { .. } | cuda::GpuError::Format { .. })) => {
                return Ok((None, format!("GPU {}: {e}: running on the CPU", d.name)))
            }
            Err(e) => return Err(format!("loading onto {}: {e}", d.name)),
        };
        let slots = g.slots();
        if g.has_cache() {
            crate::tiers::knobs::GPU_TIER.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let line = format!(
            "GPU: {} ({}, {} SMs, {:.1} of {:.1} GiB free at start; {} and {}): dense weights and KV cache in VRAM{}",
            d.name,
            d.arch(),
            d.sms,
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64,
            probe.libcuda,
            probe.libnvrtc,
            if slots > 0 { format!(", {slots} expert slots") } else { String::new() }
        );
        let line = match g.stages().as_slice() {
            [_] => line,
            stages => {
                let each: Vec<String> = stages
                    .iter()
                    .map(|s| {
                        format!("layers {}..{} on CUDA {} ({} slots)", s.layers.start, s.layers.end, s.device, s.slots)
                    })
                    .collect();
                format!("{line}; layer split: {}", each.join(", "))
            }
        };
        Ok((Some(Box::new(g)), line))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = m;
        Ok((None, "built without the `cuda` feature: running on the CPU".into()))
    }
}

/// The CUDA backend's settings from the daemon's GPU options.
#[cfg(feature = "cuda")]
fn gpu_config(o: &GpuOptions) -> cuda::GpuConfig {
    cuda::GpuConfig {
        cache: o.cache,
        reserve: o.reserve_mib << 20,
        reserve_later: o.reserve_later_mib.unwrap_or(o.reserve_mib) << 20,
        max_chunk: o.max_chunk,
        n_ctx: o.n_ctx,
        prefill_ahead: o.prefill_ahead,
    }
}

/// The GPU a one-stage load of `m` would use, as the placement plan sees it before the load
/// ([`crate::tiers::plan::GpuView`]: free VRAM now, the load's allocations, and what a trial of them measured on
/// the card, `layout`'s expert cache included; see [`cuda::pipeline::trial_load`]). `Ok(None)`: no GPU (off, or no
/// driver, NVRTC or device) or a layer split (each stage's figures come at load). Errors: the driver failed while
/// asked for its free memory (a failed trial is not an error: the view then holds the estimate and the reason).
pub fn gpu_view(
    m: &ModelRef<'_>,
    o: &GpuOptions,
    layout: Option<&crate::tiers::layout::ExpertLayout>,
) -> Result<Option<crate::tiers::plan::GpuView>, String> {
    if !o.enabled || o.layer_split.is_some() || o.split_devices.len() > 1 {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        // a model the GPU would refuse is planned on the CPU, as the load then runs it
        if gpu_kv_type_ok(m.kv_type, m.cfg.head_dim).is_err() {
            return Ok(None);
        }
        let Ok(probe) = cuda::probe(o.device) else { return Ok(None) };
        let d = std::sync::Arc::new(probe.device);
        let (free, total) = d.mem_info().map_err(|e| e.to_string())?;
        let cfg = gpu_config(o);
        let (dense, kv, scratch) = cuda::model::load_bytes(m, &cfg);
        let (trial, trial_error) = match cuda::pipeline::trial_load(m, &d, &cfg, layout) {
            Ok(t) => (Some(t), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let measured = trial.map(|t| crate::tiers::plan::Measured {
            free_after_load: t.free_after_load,
            module: t.module,
            slots: t.slots,
            free_after: t.free_after,
        });
        Ok(Some(crate::tiers::plan::GpuView {
            name: d.name.clone(),
            free: free as u64,
            total: total as u64,
            dense,
            kv,
            scratch,
            staging_slots: match (trial, layout) {
                (Some(t), _) => t.staging,
                (None, Some(lay)) if m.cfg.n_expert > 0 => {
                    cuda::pipeline::staging_count(m.cfg.n_expert_used, lay, &cfg, free as u64, total as u64)
                }
                _ => 0,
            },
            reserve: cfg.reserve,
            measured,
            trial_error,
        }))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (m, layout);
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::{gpu_kv_type_ok, KvType};

    #[test]
    fn the_gpu_takes_q8_0_caches_of_whole_blocks_up_to_256_values_per_head() {
        for hd in [64, 96, 128, 256] {
            assert_eq!(gpu_kv_type_ok(KvType::Q8_0, hd), Ok(()));
        }
        let e = gpu_kv_type_ok(KvType::Q8_0, 80).unwrap_err();
        assert!(e.contains("multiple of 32") && e.contains("--kv-type f16"), "{e}");
        let e = gpu_kv_type_ok(KvType::Q8_0, 512).unwrap_err();
        assert!(e.contains("above 256") && e.contains("--kv-type f16"), "{e}");
        // an f16 cache: any head size
        for hd in [64, 80, 256, 512] {
            assert_eq!(gpu_kv_type_ok(KvType::F16, hd), Ok(()));
        }
    }
}
