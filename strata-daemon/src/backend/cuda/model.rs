//! The forward pass on the GPU: dense weights and the KV cache (f16) in VRAM, experts from the VRAM expert
//! cache, misses on the CPU pool (or uploaded over PCIe into staging slots, `--pcie-frac`).
//!
//! Per layer: RMSNorm+Q8 → stacked Q/K/V product → RoPE and KV store → attention → output product added to
//! the residual → RMSNorm+Q8 → FFN. MoE FFN: router product → softmax/top-k on the device. When every expert
//! is in VRAM the layer's groups are built on the device from the residency table (no host round trip);
//! otherwise the routing comes to the host, the store plans each routed expert (VRAM hit, RAM, file), the
//! hit experts run in one launch per stage while the CPU pool computes the misses, and the CPU's sum is
//! added with the GPU's in one combine kernel (fixed order, so a request gives the same bytes twice).

use std::sync::{Arc, Mutex};

use super::driver::{DevBuf, Device, Stream};
use super::kernels::{cubin, Kernels};
use super::ops::{Combine, DMat, Ops, GROUP_BYTES, MAX_NT, Q8_BYTES};
use super::pass::GpuPass;
use super::slots::SlotCache;
use super::GpuError;
use crate::arch::config::ModelConfig;
use crate::arch::weights::{ExpertWeights, Ffn, Weight};
use crate::backend::cpu::experts::experts as cpu_experts;
use crate::backend::moe::dispatch;
use crate::backend::{BackendError, Body, Logits, ModelRef, Scratch};
use crate::quant::{dequantize_row, GgmlType};
use crate::tiers::arena::HostArena;
use crate::tiers::knobs::Knob;
use crate::tiers::store::{ExpertStore, Source};
use crate::tiers::vram::{shrink_slots, CacheSize};

/// GPU settings (flags of DESIGN.md §4).
#[derive(Debug, Clone)]
pub struct GpuConfig {
    /// `--expert-cache`.
    pub cache: CacheSize,
    /// `--vram-reserve-mib` in bytes (the first stage's card).
    pub reserve: u64,
    /// `--vram-reserve-later-mib` in bytes (the cards of later stages of a layer split).
    pub reserve_later: u64,
    /// Largest prefill chunk a pass handles at once (tokens).
    pub max_chunk: usize,
    /// Context length (KV positions).
    pub n_ctx: usize,
    /// A prefill may upload ahead (`GpuOptions::prefill_ahead`; see [`super::pipeline::staging_sets`]).
    pub prefill_ahead: bool,
}

pub(super) struct GLayer {
    pub(super) attn_norm: DevBuf,
    pub(super) q: DMat,
    pub(super) k: DMat,
    pub(super) v: DMat,
    pub(super) o: DMat,
    /// The architecture's work between the QKV product and RoPE, when it has any.
    pub(super) prep: Option<QkvPrep>,
    pub(super) ffn_norm: DevBuf,
    pub(super) ffn: GFfn,
    /// The shared expert (`qwen2moe`), a dense FFN whose gated output is added to the residual.
    shared: Option<GShared>,
    /// `attn_output.bias` (`n_embd`), added with the output product.
    pub(super) o_bias: Option<DevBuf>,
    /// `attn_sinks` (`n_head` logits).
    pub(super) sinks: Option<DevBuf>,
    /// Positions a query attends to in this layer (0 = all: a global layer).
    pub(super) window: usize,
}

/// Biases (`qd + 2·kvd`, zeros where the file has none) and q/k norm weights of a layer (see `qkv_prep`).
pub(super) struct QkvPrep {
    pub(super) bias: Option<DevBuf>,
    pub(super) norm: Option<(DevBuf, DevBuf)>,
    pub(super) mode: i32,
}

struct GShared {
    gate_inp: DevBuf,
    gate: DMat,
    up: DMat,
    down: DMat,
}

pub(super) enum GFfn {
    Dense { gate: DMat, up: DMat, down: DMat },
    Moe { router: DMat, gate_ty: GgmlType, down_ty: GgmlType, down_off: usize, bias: Option<GMoeBias> },
}

/// A MoE layer's biases (gpt-oss), f32 in VRAM.
pub(super) struct GMoeBias {
    /// `ffn_gate_inp.bias` (`n_expert`).
    pub(super) router: DevBuf,
    /// Per expert, its `n_ff_exp` gate biases then its `n_ff_exp` up biases (`Glu::gub`).
    pub(super) gate_up: DevBuf,
    /// `ffn_down_exps.bias` (`n_expert × n_embd`).
    pub(super) down: DevBuf,
}

/// Device scratch for `max_t` tokens.
pub(super) struct Bufs<B = DevBuf> {
    pub(super) x: B,
    pub(super) xn: B,
    pub(super) xq: B,
    pub(super) qkv: B,
    pub(super) q: B,
    pub(super) attn: B,
    pub(super) attnq: B,
    pub(super) gu: B,
    pub(super) h: B,
    pub(super) hq: B,
    pub(super) rl: B,
    /// The split-K router product's partial outputs (`MF_SPLIT_MAX × t × n_expert` f32; see `Ops::mmf_split`).
    pub(super) rpart: B,
    /// The split-K dense products' partial outputs (`MQ_SPLIT_MAX × t × max(q + k + v rows, n_embd)` f32; see
    /// `Ops::mmv`); one float where chunks are decode windows only.
    pub(super) mpart: B,
    pub(super) ids: B,
    pub(super) w: B,
    /// The next layer's predicted top-k of a one-token hybrid decode window (ids, weights; `k` each; see
    /// [`Stage::predicts`]).
    pub(super) pids: B,
    pub(super) pw: B,
    pub(super) flag: B,
    pub(super) groups: B,
    /// Scratch of `group_by_expert` (one i32 per routing entry).
    pub(super) rank: B,
    /// `group_by_expert`'s tiles for the tensor-core expert kernels (at most one per routing entry).
    pub(super) tiles: B,
    /// A hybrid prefill layer's slot per expert (`n_expert` i32, −1 = computed by the CPU pool), as
    /// `group_by_expert` takes it.
    pub(super) htab: B,
    pub(super) y: B,
    pub(super) cpu: B,
    pub(super) cs: B,
    /// A shared expert's output (`t × n_embd`).
    pub(super) sh: B,
    pub(super) logits: B,
    /// Routed experts of every layer of a window (`n_layer × t × k`), read once after the window.
    pub(super) win_ids: B,
    /// Counters of the kernels whose last block finishes a launch's work ([`DONE_ROUTE`]): u32s,
    /// zero when a stage is loaded and after every launch (the kernels using one run on the stage's one stream,
    /// each after the one before it has finished).
    pub(super) done: B,
    /// Split-K attention partials of a long context's decode rows (`None`: contexts of at most
    /// [`super::ops::ATT_SPLIT_MIN`] positions, or `STRATA_ATTN_SPLIT=0`).
    pub(super) attn_part: Option<B>,
}

/// Host scratch of the hybrid path.
#[derive(Default)]
pub(super) struct Host {
    ids: Vec<i32>,
    w: Vec<f32>,
    xn: Vec<f32>,
    groups: Vec<u8>,
    flag: Vec<i32>,
    /// Routed experts of every layer of a window computed without a host round trip (usage accounting).
    deferred: Vec<i32>,
    /// Fractional PCIe share carried from layer to layer (a layer has few misses; rounding each layer alone
    /// would send all or none).
    pcie_carry: f32,
    /// The PCIe share balanced while decoding (live knob `pcie_auto`), and the `pcie_frac` it started from
    /// (a change of that knob, or of the cache, starts it again).
    balance: super::balance::PcieBalance,
    balance_from: f32,
    /// Records the end of a split layer's GPU share (queried when the CPU's share ends; `pcie_auto`).
    split_done: Option<super::driver::Event>,
    /// Page-locked staging of a hybrid layer's small copies (copies from pageable memory are staged by the
    /// driver, and the device → host ones return only when done): `down` receives the routing (ids | weights |
    /// normalized activations), `up` sends groups | flags | the CPU experts' sum (a prefill chunk grouped on the
    /// device: its slot table in place of the groups, no flags). Grown on demand.
    pin_down: Option<super::driver::PinnedBuf>,
    pin_up: Option<super::driver::PinnedBuf>,
    /// Page-locked staging of a pass's outputs: the decode window's expert ids (all-VRAM decode) | the logits
    /// rows, copied with one wait at the end of the pass. Grown on demand.
    pin_out: Option<super::driver::PinnedBuf>,
    /// Page-locked staging of a pass's inputs: embeddings | RoPE table (`cs`). Grown on demand.
    pin_in: Option<super::driver::PinnedBuf>,
    /// Recorded after a prompt pass's input copies: the next pass waits on it before it rewrites or moves
    /// `pin_in` (a prompt chunk without outputs returns before its work is done; see [`Stage::chunk`]).
    inputs_read: Option<super::driver::Event>,
    /// A pass enqueued work and has not reached its final wait (it failed on the way): the next pass waits for
    /// the stream before it rewrites or moves any staging a copy may still read.
    pass_open: bool,
    cs: Vec<f32>,
    /// RoPE (cos, sin) pairs of the pass.
    rope: Vec<(f32, f32)>,
    /// Embeddings of the pass (`t × n_embd`).
    x: Vec<f32>,
    /// Where the pass's hybrid layers spent their host time (`STRATA_GPU_TIMING` only).
    prof: HybridProf,
    /// A prompt pass's timed events, one after each backend call's launches, named by the call
    /// (`STRATA_GPU_TIMING=ops` only; see [`op_times`]).
    pub(super) marks: Vec<(&'static str, super::driver::Event)>,
    /// Experts uploaded ahead for the next hybrid layer (a decode window's predicted ones, live knob `prefetch`; or
    /// a prefill chunk's next layer's RAM-resident ones, `pcie_prefill` with two staging sets): (layer, expert,
    /// staging slot); their copies run on [`Stage::pf_s`] and end at [`Stage::pf_ready`]. Cleared at every pass's
    /// start.
    prefetched: Vec<(usize, usize, u32)>,
    /// Experts the prediction named for that layer (prefetched or not).
    predicted: Vec<(usize, usize)>,
    /// Recent RAM misses per decode token of each layer (by layer; an exponential average, weight
    /// [`MISS_AVG`] for the newest token; layers not seen yet count as [`PREDICT_MIN_MISSES`]): the prefetch
    /// predicts only the layers that miss ([`Stage::predicts`]).
    misses: Vec<f32>,
}

/// Where a hybrid layer's PCIe-served misses go in the staging slots: (first staging slot, at most how many). A
/// prefill layer of a cache with two staging sets (`parity`; see `Stage::hybrid_moe`) stages into set `l % 2` of
/// `set` slots, after the `pf_here` experts uploaded ahead for it there; any other layer from the first staging
/// slot, `n_stage_max` at most.
fn staging_span(parity: bool, l: usize, set: usize, pf_here: usize, n_stage_max: usize) -> (usize, usize) {
    if parity {
        let here = pf_here.min(set);
        ((l % 2) * set + here, set - here)
    } else {
        (0, n_stage_max)
    }
}

/// Weight of a decode token's RAM misses in a layer's average ([`Host::misses`]).
const MISS_AVG: f32 = 0.2;

/// The prefetch predicts a layer's experts only while its average RAM misses per token ([`Host::misses`]) are at
/// least this: with the adaptive tier holding most of what a layer routes to, most layers miss nothing for many
/// tokens, and their prediction (three launches between the routing and the experts) would cost more than the
/// rare miss it could turn into a hit (measured on the H200: docs/BENCHMARKS.md, stop 46).
const PREDICT_MIN_MISSES: f32 = 0.25;

/// The GPU time between consecutive `marks` (each recorded after the named call's launches, the first at the
/// pass's start), summed by name in the order the names first appear: `"qkv 3.210 ms, attention 1.100 ms, ..."`.
/// Errors: the driver's, when an event is not complete or not timed.
fn op_times(marks: &[(&'static str, super::driver::Event)]) -> Result<String, GpuError> {
    let mut sums: Vec<(&'static str, f64, usize)> = Vec::new();
    for w in marks.windows(2) {
        let ms = w[1].1.since_ms(&w[0].1)? as f64;
        match sums.iter_mut().find(|(n, ..)| *n == w[1].0) {
            Some(e) => {
                e.1 += ms;
                e.2 += 1;
            }
            None => sums.push((w[1].0, ms, 1)),
        }
    }
    let total: f64 = sums.iter().map(|e| e.1).sum();
    let mut out = format!("{total:.3} ms in all");
    for (n, ms, k) in sums {
        out.push_str(&format!(", {n} {ms:.3} ms ({k}×)"));
    }
    Ok(out)
}

/// Host time of a pass's hybrid MoE layers, in seconds, summed over the layers (`STRATA_GPU_TIMING`).
#[derive(Default, Debug, Clone, Copy)]
struct HybridProf {
    /// Hybrid layers.
    layers: usize,
    /// Waiting for the GPU's routing (the layer's attention and router, plus the copy back).
    wait: f64,
    /// Planning: routing read, sources chosen, PCIe share, groups built.
    plan: f64,
    /// Issuing the GPU's share (staging copies, expert launches), on the caller beside the CPU pool's work.
    issue: f64,
    /// The CPU pool's experts (issuing included) and the copy of their sum.
    cpu: f64,
    /// CPU-computed experts.
    cpu_experts: usize,
}

/// One stage of the model on a GPU: the dense weights, KV cache, scratch and VRAM expert cache of a contiguous
/// range of layers (every layer without a layer split; see [`super::pipeline::GpuModel`]), the output head when
/// it holds the last layer.
pub struct Stage {
    pub(super) k: Kernels,
    pub(super) s: Stream,
    /// The stage's layers (`layers[i]` is layer `l0 + i`).
    pub(super) layers: Vec<GLayer>,
    /// First layer of the stage.
    pub(super) l0: usize,
    /// `output_norm` and `output` (the last stage only).
    head: Option<(DevBuf, DMat)>,
    /// KV cache of the stage's layers (`kc[i]` for layer `l0 + i`).
    pub(super) kc: Vec<DevBuf>,
    pub(super) vc: Vec<DevBuf>,
    /// The KV cache's rows are ggml Q8_0 blocks (`--kv-type q8_0`), else f16.
    pub(super) kv_q8: bool,
    n_ctx: usize,
    max_t: usize,
    pub(super) b: Bufs,
    /// The VRAM expert cache (MoE models).
    pub cache: Option<SlotCache>,
    host: Mutex<Host>,
    /// The fallback from asynchronous to blocking rounds was reported.
    said_fallback: std::sync::atomic::AtomicBool,
    /// The RAM copy's start when it was registered with the driver (unregistered on drop).
    registered: std::sync::atomic::AtomicUsize,
    /// The expert store whose RAM copy the cache reads (held so that the copy outlives its registration and the
    /// copies from it, whatever the owner does with its own handle).
    _store: Option<Arc<ExpertStore>>,
    /// Captured decode-token graphs by attention size class (positions the shared memory holds).
    graphs: Mutex<Vec<(usize, super::driver::GraphExec)>>,
    /// Captured attention segments of hybrid decode layers by (layer, attention size class, with the next
    /// layer's prediction): the layer's norm (with the previous layer's combine), attention, router and top-k,
    /// the prediction when asked ([`Stage::predicts`]), and the routing's copy to the host — one launch instead
    /// of ~9 between a layer's host round trips.
    layer_graphs: Mutex<std::collections::HashMap<(usize, usize, bool), super::driver::GraphExec>>,
    /// The prefetch's copies (live knob `prefetch`) run on their own stream, so that the next layer's attention
    /// segment does not wait behind them: `pf_ready` is recorded after a layer's copies and waited on by the
    /// model's stream before the next layer's expert launches; `pf_free[i]` is recorded on the model's stream
    /// after the expert launches of each layer of parity `i`, and waited on by the copy stream before it rewrites
    /// that parity's prefetch slots (see [`Stage::pf_slot`]).
    pf_s: Stream,
    pf_ready: super::driver::Event,
    /// Recorded (as an external node of the captured segment) after a predicting layer's routing copy, before
    /// the prediction's launches: the host waits for it instead of the whole stream, so the prediction runs
    /// while the host reads the routing and starts the CPU experts.
    routed_ev: super::driver::Event,
    /// Recorded (likewise) after the copy of the prediction's ids: the host waits for it before it reads them.
    pred_ev: super::driver::Event,
    pf_free: [super::driver::Event; 2],
    /// No CUDA graphs: `STRATA_GPU_GRAPHS=0` at load, or a capture failed (plain launches from then on).
    graphs_off: std::sync::atomic::AtomicBool,
    /// `STRATA_GPU_TIMING` was set at load: log host and GPU time per pass.
    timing: bool,
    /// `STRATA_GPU_TIMING=ops` at load: a prompt pass (several tokens, plain launches) also logs the GPU time of
    /// each kind of backend call, summed over its layers.
    pub(super) op_timing: bool,
    /// `STRATA_GPU_CHUNK_SYNC=1` at load: every prompt chunk waits for its kernels before the next is prepared
    /// (as before chunks overlapped; for A/B measurements).
    sync_chunks: bool,
    /// Passes of several tokens group each expert's tokens on the device (`group_by_expert`) and run the tensor-core
    /// expert kernels: all-VRAM passes of more than one token, and hybrid prefill chunks of more than
    /// [`super::ops::MAX_NT`] tokens (over a slot table of their GPU experts); off with `STRATA_GPU_GROUP=0` at load
    /// (all-VRAM passes: one group per routing entry, as decode windows; hybrid chunks: groups of up to `MAX_NT`
    /// tokens built on the host; for A/B measurements).
    pub(super) group_prefill: bool,
    /// MoE layers of the model (a token's worth of `pcie_auto` votes).
    n_moe_layers: usize,
    /// Slots of one staging set ([`super::pipeline::staging_slots`] of the model's top-k and experts).
    staging_set: usize,
    /// The settings the stage was loaded with (a rebuilt cache sizes its staging by them).
    cfg: GpuConfig,
    /// `route_topk`'s mode for the architecture's gating ([`super::ops::gating_mode`]).
    gating: i32,
    /// The experts' gated unit (`Glu::act`: 1 = gpt-oss's clamped SwiGLU).
    act: i32,
    /// The card (its primary context). Declared last, so dropped last: every buffer, stream, event and module
    /// above is freed while the context lives (a stage may hold the last reference; freeing into a released
    /// context crashed the daemon at exit).
    dev: Arc<Device>,
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        let _ = self.s.sync();
        let _ = self.pf_s.sync();
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.layer_graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
        // the stream is idle, so no copy from the RAM copy is in flight (the cache's drop waited for its own)
        self.cache = None;
        self.unregister_arena();
    }
}

fn up(m: &ModelRef<'_>, w: &Weight) -> Result<DMat, GpuError> {
    let bytes = &m.bytes[w.offset..w.offset + w.bytes()];
    DMat::upload(bytes, w.ty, w.rows, w.cols)
}

fn check_ty(w: &Weight) -> Result<(), GpuError> {
    super::kernels::fmt_index(w.ty).map(|_| ()).map_err(|_| GpuError::Format { tensor: w.name.clone(), ty: w.ty })
}

/// Refuses the architecture choices these kernels do not implement (checked before anything is allocated).
fn check_arch(model: &ModelRef<'_>) -> Result<(), GpuError> {
    let arch = || model.cfg.arch.clone();
    let (c, def) = (model.cfg, model.cfg.spec.def);
    use crate::arch::FfnAct;
    // the sliding-window layers read the global layers' RoPE table
    let swa_rope_own = (0..c.n_layer).any(|l| c.is_swa(l))
        && (c.rope_freq_base_swa != c.rope_freq_base || c.rope_freq_scale_swa != c.rope_freq_scale);
    let what = if super::ops::gating_mode(def).is_none() || def.expert_weights_scale != 1.0 {
        Some("sigmoid gating or an expert weight scale")
    } else if def.act == FfnAct::GeluTanh || (def.act == FfnAct::SwigluOai && !c.spec.is_moe()) {
        Some("a GELU FFN, or a clamped SwiGLU outside routed experts")
    } else if def.post_norms || def.embd_scale || swa_rope_own {
        Some("post-norms, an embedding scale or sliding-window layers with a RoPE of their own")
    } else if c.spec.ffn == crate::arch::FfnKind::MoeShared && def.moe_bias {
        Some("expert biases beside a shared expert")
    } else {
        None
    };
    match what {
        Some(what) => Err(GpuError::Architecture { arch: arch(), what }),
        None => Ok(()),
    }
}

/// Most logits bytes a pass returns through page-locked staging (one decode row of a 152k vocabulary is 0.6 MB; a
/// prompt's every row would pin hundreds of MiB for good).
const PIN_OUT_MAX: usize = 16 << 20;

pub(super) use crate::tiers::store::EXCHANGE_PLACES;

/// `buf`, grown to at least `bytes` (a power of two) when smaller or absent. No copy may be in flight from or
/// to the old buffer (callers grow after a stream sync). Errors: the driver refused the allocation.
fn grow_pinned(
    buf: &mut Option<super::driver::PinnedBuf>,
    bytes: usize,
) -> Result<&mut super::driver::PinnedBuf, GpuError> {
    if buf.as_ref().is_none_or(|p| p.bytes < bytes) {
        *buf = Some(super::driver::PinnedBuf::alloc(bytes.next_power_of_two().max(4096))?);
    }
    Ok(buf.as_mut().expect("just set"))
}

/// What a stage's pass takes in: the chunk's tokens (the first stage embeds them) or the hidden state `x` the
/// previous stage handed on (`t × n_embd`).
#[derive(Clone, Copy)]
pub(super) enum StageIn<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
}

impl Bufs {
    /// The split-K dense products' scratch as [`super::ops::Ops::mmv`] takes it (address, f32 count).
    pub(super) fn part(&self) -> Option<(u64, usize)> {
        Some((self.mpart.ptr, self.mpart.bytes / 4))
    }
}

/// The stage's scratch buffers for chunks of up to `cfg.max_chunk` tokens, each made by `alloc(bytes)`:
/// [`DevBuf::alloc`] for the stage, or the size recorder of [`stage_sizes`]. `last`: the stage computes the logits;
/// `float_router`: some router is a float matrix (the split product's partials). Errors: `alloc`'s.
pub(super) fn make_bufs<B>(
    c: &crate::arch::config::ModelConfig,
    cfg: &GpuConfig,
    last: bool,
    float_router: bool,
    mut alloc: impl FnMut(usize) -> Result<B, GpuError>,
) -> Result<Bufs<B>, GpuError> {
    let t = cfg.max_chunk.max(1);
    let kvd = c.n_head_kv * c.head_dim;
    let e = c.n_embd;
    let qd = c.n_head * c.head_dim;
    let kk = c.n_expert_used.max(1);
    let ffm = c.n_ff.max(kk * c.n_ff_exp).max(c.n_ff_shexp).max(1);
    let ffd = c.n_ff.max(c.n_ff_shexp).max(1);
    Ok(Bufs {
        x: alloc(4 * t * e)?,
        xn: alloc(4 * t * e)?,
        xq: alloc(t * e / 32 * Q8_BYTES)?,
        qkv: alloc(4 * t * (qd + 2 * kvd))?,
        q: alloc(4 * t * qd)?,
        attn: alloc(4 * t * qd)?,
        attnq: alloc(t * qd / 32 * Q8_BYTES)?,
        gu: alloc(4 * t * 2 * ffd)?,
        h: alloc(4 * t * ffm)?,
        hq: alloc(t * ffm / 32 * Q8_BYTES + Q8_BYTES)?,
        rl: alloc(4 * t * c.n_expert.max(1))?,
        // (only where a router is a float matrix: the split product's formats)
        rpart: alloc(
            4 * if float_router && t > super::ops::MAX_NT { super::ops::MF_SPLIT_MAX * t * c.n_expert } else { 1 },
        )?,
        mpart: alloc(
            4 * if t > super::ops::MAX_NT && super::kernels::mmq_split_wanted() {
                super::ops::MQ_SPLIT_MAX * t * (qd + 2 * kvd).max(e)
            } else {
                1
            },
        )?,
        ids: alloc(4 * t * kk)?,
        w: alloc(4 * t * kk)?,
        pids: alloc(4 * kk)?,
        pw: alloc(4 * kk)?,
        flag: alloc(4 * t * kk)?,
        groups: alloc(t * kk * GROUP_BYTES)?,
        rank: alloc(4 * t * kk)?,
        tiles: alloc(t * kk * super::ops::TILE_BYTES)?,
        htab: alloc(4 * c.n_expert.max(1))?,
        y: alloc(4 * t * kk * e)?,
        cpu: alloc(4 * t * e)?,
        cs: alloc(4 * (t * c.n_rot + 2))?,
        sh: alloc(4 * if c.n_ff_shexp > 0 { t * e } else { 1 })?,
        logits: alloc(4 * if last { t * c.n_vocab } else { 1 })?,
        win_ids: alloc(4 * c.n_layer * t * kk)?,
        done: alloc(4 * DONE_COUNTERS)?,
        attn_part: if cfg.n_ctx > super::ops::ATT_SPLIT_MIN
            && super::ops::split_applies(cfg.n_ctx, 1, c.head_dim)
            && std::env::var("STRATA_ATTN_SPLIT").map_or(true, |v| v != "0")
        {
            Some(alloc(4 * super::ops::split_part_floats(t, c.n_head, c.head_dim, cfg.n_ctx))?)
        } else {
            None
        },
    })
}

/// u32 counters in [`Bufs::done`] (one per fused kernel with a last block: [`DONE_ROUTE`]).
const DONE_COUNTERS: usize = 1;
/// Byte offset in [`Bufs::done`] of `route_f32_t1`'s counter.
pub(super) const DONE_ROUTE: usize = 0;

/// The device allocations [`Stage::load`] makes for `layers` of `model` (with the output head when `last`), in
/// bytes as asked of the driver, by kind. The placement plan's trial allocates these
/// ([`super::pipeline::trial_load`]) and the load checks against them that the two agree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageSizes {
    /// Dense weights as uploaded: attention, dense FFN or router, shared expert, norms and biases, the output
    /// head.
    pub dense: Vec<usize>,
    /// The KV cache at `cfg.n_ctx` positions (keys and values of each layer).
    pub kv: Vec<usize>,
    /// The scratch buffers of [`make_bufs`].
    pub scratch: Vec<usize>,
}

impl StageSizes {
    /// Every allocation's size.
    pub fn all(&self) -> impl Iterator<Item = usize> + '_ {
        self.dense.iter().chain(&self.kv).chain(&self.scratch).copied()
    }
}

/// The allocations of [`Stage::load`] for `layers` (see [`StageSizes`]).
pub fn stage_sizes(model: &ModelRef<'_>, cfg: &GpuConfig, layers: std::ops::Range<usize>, last: bool) -> StageSizes {
    let c = model.cfg;
    let f = |v: &[f32]| 4 * v.len();
    let (qd0, kvd0) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
    let mut d = Vec::new();
    let blocks = &model.weights.blocks[layers];
    for b in blocks {
        if b.bias.q.is_some() || b.bias.k.is_some() || b.bias.v.is_some() {
            d.push(4 * (qd0 + 2 * kvd0));
        }
        if let (Some(q), Some(k)) = (&b.q_norm, &b.k_norm) {
            if c.spec.def.qk_norm != crate::arch::QkNorm::None {
                d.extend([f(q), f(k)]);
            }
        }
        match &b.ffn {
            Ffn::Dense { gate, up, down } => d.extend([gate.bytes(), up.bytes(), down.bytes()]),
            Ffn::Moe(ex) => {
                if let Some(sh) = &ex.shared {
                    d.extend([f(&sh.gate_inp), sh.gate.bytes(), sh.up.bytes(), sh.down.bytes()]);
                }
                if let (Some(rb), Some(xb)) = (&ex.router_bias, &ex.bias) {
                    d.extend([f(rb), 4 * c.n_expert * 2 * c.n_ff_exp, f(&xb.down)]);
                }
                d.push(ex.router.bytes());
            }
        }
        d.extend([f(&b.attn_norm), b.q.bytes(), b.k.bytes(), b.v.bytes(), b.o.bytes(), f(&b.ffn_norm)]);
        d.extend(b.bias.o.as_deref().map(f));
        d.extend(b.attn_sinks.as_deref().map(f));
    }
    if last {
        d.extend([model.weights.output.bytes(), f(&model.weights.out_norm)]);
    }
    let kv_q8 = model.kv_type == crate::backend::KvType::Q8_0;
    let row = super::ops::KvPtrs::bytes(kv_q8, cfg.n_ctx, kvd0);
    let kv = vec![row; 2 * blocks.len()];
    let float_router = super::kernels::mmf_split_wanted()
        && blocks.iter().any(|b| matches!(&b.ffn, Ffn::Moe(ex) if ex.router.ty.block_size() == 1));
    let mut scratch = Vec::new();
    let _ = make_bufs(c, cfg, last, float_router, |n| {
        scratch.push(n);
        Ok(())
    });
    StageSizes { dense: d, kv, scratch }
}

/// VRAM a one-stage load of `model` takes before its expert cache, as `(dense, kv, scratch)` bytes asked of the
/// driver ([`stage_sizes`] over every layer; without the kernel module and the driver's rounding, which the
/// placement plan's trial measures).
pub fn load_bytes(model: &ModelRef<'_>, cfg: &GpuConfig) -> (u64, u64, u64) {
    let s = stage_sizes(model, cfg, 0..model.cfg.n_layer, true);
    let sum = |v: &[usize]| v.iter().sum::<usize>() as u64;
    (sum(&s.dense), sum(&s.kv), sum(&s.scratch))
}

/// Loads the module of `model`'s kernels for `dev` from image `img` (the switches as [`Stage::load`] sets them).
/// Errors: the driver refused the image or a kernel is missing from it.
pub(super) fn load_kernels(model: &ModelRef<'_>, dev: &Device, img: &[u8]) -> Result<Kernels, GpuError> {
    let formats = super::kernels::FormatSet::of_model(model.weights);
    Kernels::load(
        img,
        formats,
        super::kernels::mmq_pipe_on(dev.max_smem_optin),
        dev.max_smem_optin,
        super::kernels::pdl_wanted(dev.cc),
        super::kernels::cluster_norm_wanted(dev.cc),
        super::kernels::narrow_wanted(),
        super::kernels::tensor_cores_ok(dev.cc),
        super::kernels::mmq_wide_wanted(dev.cc),
    )
}

/// Allocates an expert cache on `dev` (empty): `n` slots and `n_staging` staging slots of `sb` bytes for blobs
/// of `blob[l]` bytes (layer l), a table of `entries` experts. With `reserve` (an `auto` cache), slots are given
/// back while less than the reserve stays free on the card (at most 6 rounds). Errors: the driver's.
pub(super) fn alloc_cache_on(
    dev: &Arc<Device>,
    (n, n_staging, sb, blob, entries): (usize, usize, usize, Arc<Vec<usize>>, usize),
    reserve: Option<u64>,
) -> Result<SlotCache, GpuError> {
    dev.bind()?;
    let mut n = n;
    let mut rounds = 0;
    loop {
        let cache = SlotCache::new(dev.clone(), n, n_staging, sb, blob.clone(), entries, false)?;
        let (free_after, _) = dev.mem_info()?;
        let give = reserve.map_or(0, |r| shrink_slots(free_after as u64, r, sb as u64));
        if give == 0 || n == 0 || rounds == 6 {
            return Ok(cache);
        }
        drop(cache);
        n = n.saturating_sub(give);
        rounds += 1;
    }
}

impl Stage {
    /// Loads layers `layers` of `model` onto `dev` (with the output head when `last`): compiles (or loads from
    /// the cache) the kernels, uploads dense weights, allocates the KV cache and scratch. The VRAM expert cache
    /// comes after every stage is loaded ([`Stage::alloc_cache`]). Errors: a tensor format without kernels, out
    /// of VRAM, driver/NVRTC failures.
    pub(super) fn load(
        model: &ModelRef<'_>,
        dev: Arc<Device>,
        cfg: &GpuConfig,
        layers: std::ops::Range<usize>,
        last: bool,
    ) -> Result<Stage, GpuError> {
        dev.bind()?;
        let live0 = super::driver::live_bytes();
        let sizes = stage_sizes(model, cfg, layers.clone(), last);
        // the kernels of the formats the model uses (a format without kernels is refused below, by tensor)
        let formats = super::kernels::FormatSet::of_model(model.weights);
        let (img, cached) = cubin(&dev.arch(), formats, super::kernels::mmq_pipe_on(dev.max_smem_optin))?;
        let pdl = super::kernels::pdl_wanted(dev.cc);
        let k = load_kernels(model, &dev, &img)?;
        tracing::info!(
            "kernels for {} {} ({} bytes){}",
            dev.arch(),
            if cached { "from the disk cache" } else { "compiled" },
            img.len(),
            if pdl { "; programmatic dependent launch" } else { "" }
        );
        let c = model.cfg;
        check_arch(model)?;
        if c.n_expert_used > 32 || c.n_expert > 1024 || !c.head_dim.is_multiple_of(2) || c.n_embd > 8192 {
            return Err(GpuError::Unsupported(
                "top-k > 32, more than 1024 experts, an odd head size or n_embd > 8192".into(),
            ));
        }
        let max_smem = (dev.max_smem_optin - 1024).max(48 << 10) as usize;
        if (c.head_dim + cfg.n_ctx) * 4 > max_smem {
            return Err(GpuError::Unsupported(format!(
                "context {} needs more shared memory for attention scores than the card offers ({} KiB): use a \
                 smaller --ctx",
                cfg.n_ctx,
                max_smem >> 10
            )));
        }
        let l0 = layers.start;
        let n_stage = layers.len();
        let blocks = &model.weights.blocks[layers];
        let mut layers = Vec::with_capacity(n_stage);
        let (qd0, kvd0) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        for b in blocks {
            let bias = if b.bias.q.is_some() || b.bias.k.is_some() || b.bias.v.is_some() {
                let mut all = Vec::with_capacity(qd0 + 2 * kvd0);
                for (v, n) in [(&b.bias.q, qd0), (&b.bias.k, kvd0), (&b.bias.v, kvd0)] {
                    match v {
                        Some(v) => all.extend_from_slice(v),
                        None => all.resize(all.len() + n, 0.0),
                    }
                }
                Some(DevBuf::from_slice(&all)?)
            } else {
                None
            };
            let (norm, mode) = match (&b.q_norm, &b.k_norm, c.spec.def.qk_norm) {
                (Some(q), Some(k), m) if m != crate::arch::QkNorm::None => (
                    Some((DevBuf::from_slice(q)?, DevBuf::from_slice(k)?)),
                    if m == crate::arch::QkNorm::PerHead { 1 } else { 2 },
                ),
                _ => (None, 0),
            };
            let prep = (bias.is_some() || norm.is_some()).then_some(QkvPrep { bias, norm, mode });
            let shared = match &b.ffn {
                Ffn::Moe(ExpertWeights { shared: Some(sh), .. }) => {
                    for w in [&sh.gate, &sh.up, &sh.down] {
                        check_ty(w)?;
                    }
                    Some(GShared {
                        gate_inp: DevBuf::from_slice(&sh.gate_inp)?,
                        gate: up(model, &sh.gate)?,
                        up: up(model, &sh.up)?,
                        down: up(model, &sh.down)?,
                    })
                }
                _ => None,
            };
            for w in [&b.q, &b.k, &b.v, &b.o] {
                check_ty(w)?;
            }
            let ffn = match &b.ffn {
                Ffn::Dense { gate, up: u, down } => {
                    for w in [gate, u, down] {
                        check_ty(w)?;
                    }
                    GFfn::Dense { gate: up(model, gate)?, up: up(model, u)?, down: up(model, down)? }
                }
                Ffn::Moe(ex) => {
                    for w in [&ex.router, &ex.gate, &ex.up, &ex.down] {
                        check_ty(w)?;
                    }
                    if ex.gate.ty != ex.up.ty {
                        return Err(GpuError::Unsupported("gate and up experts in different formats".into()));
                    }
                    let gb = c.n_ff_exp * ex.gate.ty.row_bytes(c.n_embd);
                    let bias = match (&ex.router_bias, &ex.bias) {
                        (Some(rb), Some(xb)) => {
                            let ff = c.n_ff_exp;
                            let gu: Vec<f32> = (0..c.n_expert)
                                .flat_map(|x| xb.gate[x * ff..(x + 1) * ff].iter().chain(&xb.up[x * ff..(x + 1) * ff]))
                                .copied()
                                .collect();
                            Some(GMoeBias {
                                router: DevBuf::from_slice(rb)?,
                                gate_up: DevBuf::from_slice(&gu)?,
                                down: DevBuf::from_slice(&xb.down)?,
                            })
                        }
                        (None, None) => None,
                        _ => {
                            return Err(GpuError::Unsupported(
                                "a router bias without expert biases, or the reverse".into(),
                            ))
                        }
                    };
                    GFfn::Moe {
                        router: up(model, &ex.router)?,
                        gate_ty: ex.gate.ty,
                        down_ty: ex.down.ty,
                        down_off: 2 * gb,
                        bias,
                    }
                }
            };
            layers.push(GLayer {
                attn_norm: DevBuf::from_slice(&b.attn_norm)?,
                q: up(model, &b.q)?,
                k: up(model, &b.k)?,
                v: up(model, &b.v)?,
                o: up(model, &b.o)?,
                prep,
                ffn_norm: DevBuf::from_slice(&b.ffn_norm)?,
                ffn,
                shared,
                o_bias: b.bias.o.as_deref().map(DevBuf::from_slice).transpose()?,
                sinks: b.attn_sinks.as_deref().map(DevBuf::from_slice).transpose()?,
                window: if c.is_swa(l0 + layers.len()) { c.sliding_window } else { 0 },
            });
        }
        let head = if last {
            check_ty(&model.weights.output)?;
            let output = up(model, &model.weights.output)?;
            Some((DevBuf::from_slice(&model.weights.out_norm)?, output))
        } else {
            None
        };
        let kvd = c.n_head_kv * c.head_dim;
        let kv_q8 = model.kv_type == crate::backend::KvType::Q8_0;
        let float_router = super::kernels::mmf_split_wanted()
            && layers.iter().any(|g| matches!(&g.ffn, GFfn::Moe { router, .. } if router.ty.block_size() == 1));
        let mut kc = Vec::new();
        let mut vc = Vec::new();
        for _ in 0..n_stage {
            kc.push(DevBuf::alloc(super::ops::KvPtrs::bytes(kv_q8, cfg.n_ctx, kvd))?);
            vc.push(DevBuf::alloc(super::ops::KvPtrs::bytes(kv_q8, cfg.n_ctx, kvd))?);
        }
        let b = make_bufs(c, cfg, last, float_router, DevBuf::alloc)?;
        b.done.write_sync(0, &[0u32; DONE_COUNTERS])?;
        let t = cfg.max_chunk.max(1);
        let s = Stream::new()?;
        let (pf_s, pf_ready, routed_ev) = (Stream::new()?, super::driver::Event::new()?, super::driver::Event::new()?);
        let pred_ev = super::driver::Event::new()?;
        let pf_free = [super::driver::Event::new()?, super::driver::Event::new()?];
        // the plan's trial allocates `sizes`: a load that allocates otherwise would make the plan wrong
        let (asked, planned) = (super::driver::live_bytes() - live0, sizes.all().sum::<usize>() as u64);
        if asked != planned {
            tracing::warn!("the GPU load allocated {asked} bytes where the placement plan counts {planned}");
        }
        let n_moe_layers = layers.iter().filter(|g| matches!(g.ffn, GFfn::Moe { .. })).count();
        let gating = super::ops::gating_mode(c.spec.def).expect("checked by check_arch");
        let act = (c.spec.def.act == crate::arch::FfnAct::SwigluOai) as i32;
        Ok(Stage {
            dev,
            k,
            s,
            layers,
            l0,
            head,
            kc,
            vc,
            kv_q8,
            n_ctx: cfg.n_ctx,
            max_t: t,
            b,
            cache: None,
            host: Mutex::new(Host::default()),
            said_fallback: std::sync::atomic::AtomicBool::new(false),
            registered: std::sync::atomic::AtomicUsize::new(0),
            _store: model.experts.cloned(),
            graphs: Mutex::new(Vec::new()),
            layer_graphs: Mutex::new(std::collections::HashMap::new()),
            pf_s,
            pf_ready,
            routed_ev,
            pred_ev,
            pf_free,
            graphs_off: std::sync::atomic::AtomicBool::new(std::env::var("STRATA_GPU_GRAPHS").is_ok_and(|v| v == "0")),
            timing: std::env::var_os("STRATA_GPU_TIMING").is_some(),
            op_timing: std::env::var("STRATA_GPU_TIMING").is_ok_and(|v| v == "ops"),
            sync_chunks: std::env::var("STRATA_GPU_CHUNK_SYNC").is_ok_and(|v| v == "1"),
            group_prefill: std::env::var("STRATA_GPU_GROUP").map_or(true, |v| v != "0"),
            n_moe_layers,
            staging_set: super::pipeline::staging_slots(model.cfg.n_expert_used, model.cfg.n_expert),
            cfg: cfg.clone(),
            gating,
            act,
        })
    }

    /// The stage's layers.
    pub(super) fn layer_range(&self) -> std::ops::Range<usize> {
        self.l0..self.l0 + self.layers.len()
    }

    /// Layer `l` of the model (one of the stage's).
    pub(super) fn layer(&self, l: usize) -> &GLayer {
        &self.layers[l - self.l0]
    }

    /// Whether the stage holds the model's last layer (and the output head).
    pub(super) fn is_last(&self) -> bool {
        self.head.is_some()
    }

    /// Allocates the stage's VRAM expert cache (empty) on its card: see [`alloc_cache_on`].
    pub(super) fn alloc_cache(
        &self,
        geometry: (usize, usize, usize, Arc<Vec<usize>>, usize),
        reserve: Option<u64>,
    ) -> Result<SlotCache, GpuError> {
        alloc_cache_on(&self.dev, geometry, reserve)
    }

    /// Registers the store's RAM copy with the driver (page-locked: copies from and into it run at full link
    /// speed and asynchronously), replacing an earlier registration. Returns whether it is registered.
    pub(super) fn register_arena(&self, store: &ExpertStore) -> bool {
        self.unregister_arena();
        let (ptr, len) = store.arena_range();
        if len == 0 {
            return false;
        }
        // SAFETY: the arena is a mapping owned by the store, which this GPU model holds (`self._store`) until its
        // drop has waited for the stream and unregistered the range (a rebuilt copy is unregistered first).
        match unsafe { super::driver::host_register(ptr, len) } {
            Ok(()) => {
                self.registered.store(ptr as usize, std::sync::atomic::Ordering::SeqCst);
                true
            }
            Err(e) => {
                tracing::warn!("resident RAM copy not page-locked for the GPU ({e}); copies from it run slower");
                false
            }
        }
    }

    /// Undoes [`Stage::register_arena`] (the streams must be idle).
    pub(super) fn unregister_arena(&self) {
        let p = self.registered.swap(0, std::sync::atomic::Ordering::SeqCst);
        if p != 0 {
            // SAFETY: registered by register_arena; the caller has no copy from it in flight.
            unsafe { super::driver::host_unregister(p as *mut u8) };
        }
    }

    /// Replaces the VRAM expert cache with one of `size` (benchmarks; the store's usage is kept; a model of one
    /// stage).
    pub(super) fn rebuild_cache(&mut self, store: &Arc<ExpertStore>, size: CacheSize) -> Result<(), GpuError> {
        self.dev.bind()?;
        if let Some(c) = &self.cache {
            c.poll(store, &self.s, true)?;
        }
        self.s.sync()?;
        // a failed pass's prefetch copies into the slots freed below
        self.pf_s.sync()?;
        // captured graphs name the old slots
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.layer_graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.host.lock().unwrap_or_else(|e| e.into_inner()).balance = Default::default();
        let old = self.cache.take().expect("cache");
        let (sb, blob, entries, pinned) =
            (old.slot_bytes, old.layer_blob.clone(), store.slot_table().len(), old.async_ok);
        drop(old);
        let n = match size {
            CacheSize::Slots(n) => n.min(entries),
            CacheSize::Auto => entries,
        };
        // the staging sets as a load with this size would choose them
        let (free, card) = self.dev.mem_info()?;
        let cfg = GpuConfig { cache: size, ..self.cfg.clone() };
        let n_staging = super::pipeline::staging_total(&cfg, self.staging_set, sb, entries, free as u64, card as u64);
        let mut cache = SlotCache::new(self.dev.clone(), n, n_staging, sb, blob, entries, pinned)?;
        store.init_slots(cache.n_slots);
        cache.fill(store, &self.s, self.layer_range())?;
        if store.ram_copy_built() && matches!(store.mode(), crate::tiers::store::ResidentMode::Disjoint(_)) {
            // resident mode: the copy is the complement of the new cache
            self.unregister_arena();
            store.build_ram_copy(EXCHANGE_PLACES).map_err(|e| GpuError::Unsupported(e.to_string()))?;
            cache.async_ok = self.register_arena(store);
        }
        self.cache = Some(cache);
        Ok(())
    }

    /// Bytes of the stage's dense weights in VRAM (read once per token).
    pub(super) fn dense_bytes(&self) -> usize {
        let mut n = self.head.as_ref().map_or(0, |(_, o)| o.buf.bytes);
        for l in &self.layers {
            n += l.q.buf.bytes + l.k.buf.bytes + l.v.buf.bytes + l.o.buf.bytes;
            match &l.ffn {
                GFfn::Dense { gate, up, down } => n += gate.buf.bytes + up.buf.bytes + down.buf.bytes,
                GFfn::Moe { router, .. } => n += router.buf.bytes,
            }
        }
        n
    }

    /// The device.
    pub(super) fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// One chunk of `input` at `pos0` through the stage's layers. Returns the logits rows `which` asks for (the
    /// last stage) or the hidden state `x` for the next stage (`t × n_embd`). A prompt chunk of the last stage
    /// that returns nothing (`which` `None`, every expert in VRAM) returns once its kernels are enqueued: the next
    /// chunk's host work overlaps them, and the host runs at most about two chunks ahead (each chunk first waits
    /// for the previous one's input copies, which follow the kernels before them on the stream).
    pub(super) fn chunk(
        &self,
        m: &ModelRef<'_>,
        input: StageIn<'_>,
        pos0: usize,
        which: Option<Logits>,
        s: &mut Scratch,
        body: &mut Body<'_>,
    ) -> Result<Vec<f32>, BackendError> {
        let c = m.cfg;
        let t = match input {
            StageIn::Tokens(tokens) => tokens.len(),
            StageIn::Hidden(x) => x.len() / c.n_embd,
        };
        let e = c.n_embd;
        let b = &self.b;
        let t_entry = std::time::Instant::now();
        self.dev.bind()?;
        let last = self.is_last();
        let which = which.filter(|_| last);
        let mut host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let host = &mut *host;
        if host.pass_open {
            // the previous pass failed between enqueueing and its final wait: let its copies finish first
            let _ = self.s.sync();
            let _ = self.pf_s.sync();
        }
        host.pass_open = true;
        host.prefetched.clear();
        host.predicted.clear();
        // embeddings (host dequantization of the rows) or the previous stage's x, and RoPE angles
        match input {
            StageIn::Tokens(tokens) => {
                let emb = m.mat(&m.weights.tok_embd);
                host.x.resize(t * e, 0.0);
                for (i, &tok) in tokens.iter().enumerate() {
                    let tok = (tok as usize).min(c.n_vocab - 1);
                    dequantize_row(emb.ty, emb.row(tok), &mut host.x[i * e..(i + 1) * e]).expect("embedding row");
                }
            }
            StageIn::Hidden(x) => {
                host.x.clear();
                host.x.extend_from_slice(x);
            }
        }
        crate::backend::rope_angles(c, pos0, t, &mut host.rope);
        // [pos0 (int bits), pad, (cos, sin) pairs]: the kernels read pos0 from the device (graph replays)
        host.cs.clear();
        host.cs.extend([f32::from_bits(pos0 as u32), 0.0]);
        host.cs.extend(host.rope.iter().flat_map(|&(cv, sv)| [cv, sv]));
        // both through page-locked staging, stream-ordered before the pass's kernels (no wait here); the previous
        // pass's copies out of it are done first (it may have returned before its work was). These copies also
        // wait for every earlier kernel on the stream: the decode attention reads pos0 and the K/V rows of earlier
        // passes before its programmatic-launch wait (attention_decode_body), so every pass must start with them.
        if let Some(e) = &host.inputs_read {
            e.sync()?;
        }
        let cs_off = (host.x.len() * 4).next_multiple_of(16);
        let inp = grow_pinned(&mut host.pin_in, cs_off + host.cs.len() * 4)?;
        inp.write(0, &host.x);
        inp.write(cs_off, &host.cs);
        // SAFETY: the staging holds both (grown above); it is rewritten only by the next pass, after this pass's
        // final wait or (a pass that returned early) after `inputs_read`, recorded behind these copies.
        unsafe {
            self.s.htod_raw(b.x.ptr, inp.ptr(), host.x.len() * 4)?;
            self.s.htod_raw(b.cs.ptr, inp.ptr().add(cs_off), host.cs.len() * 4)?;
        }
        if t > 1 {
            if host.inputs_read.is_none() {
                host.inputs_read = Some(super::driver::Event::new()?);
            }
            host.inputs_read.as_ref().expect("just set").record(&self.s)?;
        }
        let timing = self.timing;
        let t_start = std::time::Instant::now();
        let ev0 = if timing { Some(super::driver::Event::timed()?) } else { None };
        if let Some(e) = &ev0 {
            e.record(&self.s)?;
        }
        let fast = self.cache.is_some() && m.experts.as_ref().is_some_and(|st| st.all_in_vram()) && s.routes.is_none();
        if let (true, Some(cache), Some(st)) = (fast, &self.cache, &m.experts) {
            // this pass's top-k builds the groups from the device's residency table: bring it up to date
            cache.sync_table(st, &self.s)?;
        }
        let any_moe = self.layers.iter().any(|g| matches!(g.ffn, GFfn::Moe { .. }));
        host.deferred.clear();
        host.prof = HybridProf::default();
        host.marks.clear();
        if self.op_timing && t > 1 {
            let e = super::driver::Event::timed()?;
            e.record(&self.s)?;
            host.marks.push(("start", e));
        }
        let rows = which.and_then(|w| w.rows(t));
        // a decode token with no host round trip inside: replay a CUDA graph (one launch instead of ~15 per
        // layer), captured once per attention size class (a stage before the last hands x on instead of logits)
        let graph = s.decode
            && t == 1
            && (rows.is_some() || !last)
            && (fast || !any_moe)
            && s.routes.is_none()
            && self.graphs_on();
        if graph {
            let cap = (pos0 + t).next_power_of_two().max(256).min(self.n_ctx.max(pos0 + t));
            let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            if !graphs.iter().any(|(c, _)| *c == cap) {
                let mut p = GpuPass::new(self, m, s, host, (t, pos0, cap), fast, false);
                let captured = self.s.capture(|| body(&mut p, rows).map_err(GpuError::from));
                match captured {
                    Ok(g) => graphs.push((cap, g)),
                    Err(err) => {
                        tracing::warn!("CUDA graph capture failed ({err}); decoding with plain launches");
                        self.graphs_off.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            if let Some((_, g)) = graphs.iter().find(|(c, _)| *c == cap) {
                g.launch(&self.s)?;
            } else {
                body(&mut GpuPass::new(self, m, s, host, (t, pos0, pos0 + t), fast, false), rows)?;
            }
        } else {
            // hybrid decode tokens replay captured attention segments: their size class, as above
            let segments = s.decode && t == 1 && !fast && self.graphs_on();
            let cap =
                if segments { (pos0 + t).next_power_of_two().max(256).min(self.n_ctx.max(pos0 + t)) } else { pos0 + t };
            body(&mut GpuPass::new(self, m, s, host, (t, pos0, cap), fast, segments), rows)?;
        }
        let enqueued = t_start.elapsed().as_secs_f64() * 1000.0;
        // the outputs into page-locked staging, one wait: the window's expert ids (all-VRAM decode keeps the
        // routing on the device; the store counts it from here) and the logits rows
        // (many rows of logits — a perplexity pass — go straight into the pageable result instead, so the
        // staging stays small)
        let n_pairs = t * c.n_expert_used;
        let ids_n = if fast && s.decode && m.experts.is_some() { self.layers.len() * n_pairs } else { 0 };
        let ids_bytes = (ids_n * 4).next_multiple_of(16);
        // the logits rows, or (a stage before the last) x for the next stage
        let (logits_n, out_src) =
            if last { (rows.map_or(0, |(_, r)| r * c.n_vocab), b.logits.ptr) } else { (t * e, b.x.ptr) };
        if logits_n == 0 && ids_n == 0 && fast && t > 1 && ev0.is_none() && !self.sync_chunks {
            // a prompt chunk before the last, every expert in VRAM: nothing to read back, so no wait — the next
            // chunk's host work (embeddings, RoPE table) overlaps this one's kernels, and the last chunk's wait
            // (its logits) covers them all; a fault surfaces there
            host.pass_open = false;
            return Ok(Vec::new());
        }
        let staged = logits_n * 4 <= PIN_OUT_MAX;
        let mut logits = vec![0f32; logits_n];
        let out = grow_pinned(&mut host.pin_out, ids_bytes + if staged { logits_n * 4 } else { 0 })?;
        // SAFETY: the staging holds ids_bytes (+ 4 * logits_n when staged) bytes (grown above, after the previous
        // pass's wait, so no copy into the old buffer is in flight) and `logits` holds logits_n values; both are
        // read only after the sync below.
        unsafe {
            if ids_n > 0 {
                self.s.dtoh_raw(out.ptr(), b.win_ids.at(self.l0 * n_pairs * 4), ids_n * 4)?;
            }
            if logits_n > 0 {
                let dst = if staged { out.ptr().add(ids_bytes) } else { logits.as_mut_ptr() as *mut u8 };
                self.s.dtoh_raw(dst, out_src, logits_n * 4)?;
            }
        }
        self.s.sync()?;
        host.pass_open = false;
        if ids_n > 0 {
            host.deferred.resize(ids_n, 0);
            out.read(0, &mut host.deferred);
            let st = m.experts.as_ref().expect("experts");
            for (i, ids) in host.deferred.chunks_exact(n_pairs).enumerate() {
                st.record_vram_window(self.l0 + i, ids.iter().map(|&v| v as usize));
            }
        }
        if staged {
            out.read(ids_bytes, &mut logits);
        }
        if let Some(e0) = &ev0 {
            let e1 = super::driver::Event::timed()?;
            e1.record(&self.s)?;
            e1.sync()?;
            let p = host.prof;
            tracing::info!(
                "GPU timing: {t} tokens at {pos0}: inputs in {:.3} ms, layers enqueued in {enqueued:.3} ms (host), \
                 {:.3} ms on the GPU, \
                 {:.3} ms wall; {} hybrid layers: {:.3} ms waiting for routing, {:.3} ms planning, {:.3} ms CPU \
                 experts ({}) with {:.3} ms of GPU calls beside them",
                (t_start - t_entry).as_secs_f64() * 1000.0,
                e1.since_ms(e0)?,
                t_start.elapsed().as_secs_f64() * 1000.0,
                p.layers,
                p.wait * 1000.0,
                p.plan * 1000.0,
                p.cpu * 1000.0,
                p.cpu_experts,
                p.issue * 1000.0
            );
        }
        if host.marks.len() > 1 {
            // a diagnostic: its failure is logged, the pass's results stand
            match op_times(&host.marks) {
                Ok(line) => tracing::info!("GPU time by call: {t} tokens at {pos0}: {line}"),
                Err(e) => tracing::warn!("GPU time by call: {e}"),
            }
            host.marks.clear();
        }
        Ok(logits)
    }

    /// Expert gate/up (SwiGLU) → Q8 → down for `n_groups` groups at `groups` (device address) over the VRAM
    /// slots, experts of width `ff` whose down rows start `down.0` bytes into their slot, `down.1` bytes apart
    /// (see [`super::ops::Ops::expert_down`]), into `b.y` (rows by
    /// routing entry; `n_pairs` entries bound the hidden buffer). `one`: no group holds more than one token.
    /// `bias`: the layer's expert biases (gate/up into the gated unit, down into the groups' rows of `b.y`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn experts_gpu(
        &self,
        (gate_ty, down_ty): (GgmlType, GgmlType),
        one: bool,
        groups: u64,
        n_groups: usize,
        n_pairs: usize,
        ff: usize,
        down: (usize, usize),
        e: usize,
        bias: Option<&GMoeBias>,
    ) -> Result<(), GpuError> {
        let ops = Ops { k: &self.k, s: &self.s };
        let b = &self.b;
        let cache = self.cache.as_ref().expect("expert kernels need the VRAM cache");
        let (slots, sb) = (cache.slots.ptr, cache.slot_bytes);
        let glu = self.glu(bias);
        ops.expert_gate_up(gate_ty, one, groups, n_groups, slots, sb, ff, e, b.xq.ptr, b.xn.ptr, b.h.ptr, glu)?;
        let h = (b.hq.ptr, b.h.ptr, n_pairs);
        ops.expert_down(down_ty, one, groups, n_groups, slots, sb, down, ff, e, h, b.y.ptr)?;
        match bias {
            Some(bias) => ops.expert_down_bias(groups, n_groups, b.y.ptr, b.ids.ptr, bias.down.ptr, e),
            None => Ok(()),
        }
    }

    /// A prefill chunk's experts over `group_by_expert`'s groups and tiles (`b.groups`, `b.tiles`; `n_pairs` routing
    /// entries over `ne` experts): the tensor-core kernels where the formats have them, else the several-token
    /// kernels over the groups; then the down biases. Writes y for the entries whose expert had a slot.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn experts_grouped(
        &self,
        (gate_ty, down_ty): (GgmlType, GgmlType),
        n_pairs: usize,
        ne: usize,
        ff: usize,
        e: usize,
        down: (usize, usize),
        bias: Option<&GMoeBias>,
    ) -> Result<(), GpuError> {
        let ops = Ops { k: &self.k, s: &self.s };
        let b = &self.b;
        let cache = self.cache.as_ref().expect("expert kernels need the VRAM cache");
        let n_tiles = super::ops::max_expert_tiles(n_pairs, ne);
        let mmq = ops.experts_mmq(
            (gate_ty, down_ty),
            b.groups.ptr,
            b.tiles.ptr,
            n_tiles,
            (cache.slots.ptr, cache.slot_bytes),
            down,
            (ff, e),
            (b.xq.ptr, b.h.ptr, b.hq.ptr, n_pairs),
            b.y.ptr,
            self.glu(bias),
        );
        let n_groups = super::ops::max_expert_groups(n_pairs, ne);
        match mmq {
            Some(r) => {
                r?;
                match bias {
                    Some(bias) => ops.expert_down_bias(b.groups.ptr, n_groups, b.y.ptr, b.ids.ptr, bias.down.ptr, e),
                    None => Ok(()),
                }
            }
            None => self.experts_gpu((gate_ty, down_ty), false, b.groups.ptr, n_groups, n_pairs, ff, down, e, bias),
        }
    }

    /// The expert kernels' gated unit for a layer with `bias` (or none).
    pub(super) fn glu(&self, bias: Option<&GMoeBias>) -> super::ops::Glu {
        super::ops::Glu { ids: self.b.ids.ptr, gub: bias.map_or(0, |b| b.gate_up.ptr), act: self.act }
    }

    /// Whether decode tokens may replay CUDA graphs (`STRATA_GPU_GRAPHS=0` at load turns them off; a failed
    /// capture too).
    fn graphs_on(&self) -> bool {
        !self.graphs_off.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Final norm and output product of rows `row0 .. row0 + rows` into `b.logits`; `pend`: the last MoE
    /// layer's combine, done by the norm.
    pub(super) fn enqueue_output(
        &self,
        c: &ModelConfig,
        (row0, rows): (usize, usize),
        pend: Option<Combine>,
    ) -> Result<(), GpuError> {
        let ops = Ops { k: &self.k, s: &self.s };
        let (b, e) = (&self.b, c.n_embd);
        let (out_norm, output) = self.head.as_ref().expect("the output of the last stage");
        let pend = pend.map(|p| p.from_row(row0, e));
        ops.rms_norm_q8(b.x.at(row0 * e * 4), out_norm.ptr, c.rms_eps, e, rows, b.xn.ptr, b.xq.ptr, pend)?;
        ops.mmv(&[output], b.xq.ptr, b.xn.ptr, rows, b.logits.ptr, c.n_vocab, false, None)
    }

    /// A stage's hand-off: the last MoE layer's pending combine added into `x` (rows `0 .. t`), by a norm whose
    /// outputs are scratch (the combine is the same kernel code the next stage's first norm would run, so the
    /// split stays bit-exact).
    pub(super) fn enqueue_hand_off(&self, c: &ModelConfig, t: usize, pend: Option<Combine>) -> Result<(), GpuError> {
        let Some(pend) = pend else { return Ok(()) };
        let ops = Ops { k: &self.k, s: &self.s };
        let b = &self.b;
        let w = self.layers.last().expect("a stage has layers").ffn_norm.ptr;
        ops.rms_norm_q8(b.x.ptr, w, c.rms_eps, c.n_embd, t, b.xn.ptr, b.xq.ptr, Some(pend))
    }

    /// The layer's shared expert, when it has one, from the FFN input (`b.xq` / `b.xn`) into the residual:
    /// `x += sigmoid(gate_inp · xn) · down(silu(gate xn) · up xn)`.
    pub(super) fn shared_expert(&self, ops: &Ops, g: &GLayer, t: usize, e: usize) -> Result<(), GpuError> {
        let Some(sh) = &g.shared else { return Ok(()) };
        let b = &self.b;
        let ff = sh.gate.rows;
        ops.mmv(&[&sh.gate, &sh.up], b.xq.ptr, b.xn.ptr, t, b.gu.ptr, 2 * ff, false, b.part())?;
        ops.swiglu(b.gu.ptr, ff, t, b.h.ptr)?;
        ops.quantize(b.h.ptr, b.hq.ptr, t * ff / 32)?;
        ops.mmv(&[&sh.down], b.hq.ptr, b.h.ptr, t, b.sh.ptr, e, false, b.part())?;
        ops.gated_add(b.x.ptr, b.sh.ptr, sh.gate_inp.ptr, b.xn.ptr, e, t)
    }

    /// The router product (plus the layer's router bias, when `bias`) and top-k of `t` tokens into `b.ids` / `b.w`
    /// (arguments as [`Ops::route_topk`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn route(
        &self,
        ops: &Ops,
        router: &DMat,
        t: usize,
        kk: usize,
        fast: Option<(u64, u64, u64)>,
        win: u64,
        bias: Option<&GMoeBias>,
    ) -> Result<(), GpuError> {
        let b = &self.b;
        let ne = router.rows;
        let mode = (self.gating, bias.map_or(0, |b| b.router.ptr));
        if t == 1
            && ops.route_f32_t1(
                router,
                b.xn.ptr,
                b.rl.ptr,
                b.done.at(DONE_ROUTE),
                kk,
                b.ids.ptr,
                b.w.ptr,
                fast,
                win,
                mode,
            )?
        {
            return Ok(());
        }
        if !ops.mmf_split(router, b.xn.ptr, t, b.rl.ptr, ne, false, b.rpart.ptr)? {
            ops.mmv(&[router], b.xq.ptr, b.xn.ptr, t, b.rl.ptr, ne, false, None)?;
        }
        ops.route_topk(b.rl.ptr, ne, kk, t, b.ids.ptr, b.w.ptr, fast, win, mode)
    }

    /// The page-locked staging of the routing's copy to the host (ids | weights | normalized activations |
    /// the next layer's predicted ids), sized for `max_t` tokens once, so that its address stays fixed for
    /// captured segments. It grows only before a pass's first use (its size is fixed by `max_t`), so no copy into
    /// it is in flight when it moves; the captured segments naming the old address are dropped first.
    pub(super) fn routing_staging(&self, host: &mut Host, kk: usize, e: usize) -> Result<*mut u8, GpuError> {
        let bytes = self.max_t * (2 * kk + e) * 4 + kk * 4;
        if host.pin_down.as_ref().is_some_and(|p| p.bytes < bytes) {
            self.layer_graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
        Ok(grow_pinned(&mut host.pin_down, bytes)?.ptr())
    }

    /// Enqueues the copy of `n_pairs` routing entries (ids, weights) and `n_x` normalized activations into the
    /// routing staging at `dst` (see [`Stage::routing_staging`]).
    pub(super) fn routing_dtoh(&self, dst: *mut u8, n_pairs: usize, n_x: usize) -> Result<(), GpuError> {
        let b = &self.b;
        let ni = n_pairs * 4;
        // SAFETY: `dst` holds 2 * ni + 4 * n_x bytes (routing_staging sizes it for max_t tokens); the host reads
        // it only after a wait for this copy, and nothing else writes it.
        unsafe {
            self.s.dtoh_raw(dst, b.ids.ptr, ni)?;
            self.s.dtoh_raw(dst.add(ni), b.w.ptr, ni)?;
            self.s.dtoh_raw(dst.add(2 * ni), b.xn.ptr, n_x * 4)
        }
    }

    /// Enqueues the copy of the `k` ids of the next layer's prediction ([`Stage::enqueue_prediction`]) into the
    /// routing staging at `dst`, after the routing of `n_pairs` entries and `n_x` activations.
    pub(super) fn prediction_dtoh(&self, dst: *mut u8, n_pairs: usize, n_x: usize, k: usize) -> Result<(), GpuError> {
        // SAFETY: `dst` holds 8 * n_pairs + 4 * n_x + 4 * k bytes (routing_staging sizes it for max_t tokens and
        // one prediction); the host reads it only after a wait for this copy (`pred_ev`, or the stream when the copy
        // is enqueued outside a segment), and nothing else writes it.
        unsafe { self.s.dtoh_raw(dst.add(8 * n_pairs + n_x * 4), self.b.pids.ptr, k * 4) }
    }

    /// A segment's copy of its routing to the host, and with `predict` (the next MoE layer) the prediction
    /// after it: the routing copy, [`Stage::routed_ev`], the prediction's launches, the copy of its ids,
    /// [`Stage::pred_ev`]. The host waits for each event alone before it reads what it follows
    /// ([`Stage::hybrid_moe`]).
    pub(super) fn segment_routing(
        &self,
        ops: &Ops,
        c: &ModelConfig,
        dst: *mut u8,
        t: usize,
        predict: Option<usize>,
    ) -> Result<(), GpuError> {
        let n_pairs = t * c.n_expert_used;
        self.routing_dtoh(dst, n_pairs, t * c.n_embd)?;
        if let Some(next) = predict {
            self.routed_ev.record_external(&self.s)?;
            self.enqueue_prediction(ops, c, next)?;
            self.prediction_dtoh(dst, n_pairs, t * c.n_embd, c.n_expert_used)?;
            self.pred_ev.record_external(&self.s)?;
        }
        Ok(())
    }

    /// The MoE layer whose experts layer `l`'s routing also predicts, when it does: live knob `prefetch` above 0 with
    /// staging room for the prefetch (2 × top-k slots, the RAM copy page-locked) and layer `l + 1` missing experts of
    /// late ([`PREDICT_MIN_MISSES`]), or the routing recorded (`s.routes`, `--dump-routing`: the prediction goes with
    /// it), a one-token decode window (`s.decode`, `t`) on the hybrid path, and layer `l + 1` an MoE layer of this
    /// stage (the prediction needs the scratch `h` to hold one token's hidden state).
    pub(super) fn predicts(&self, m: &ModelRef<'_>, l: usize, t: usize, s: &Scratch, host: &Host) -> Option<usize> {
        let next = l + 1;
        let decode = s.decode;
        let kk = m.cfg.n_expert_used;
        // staging room for the uploads, from the page-locked RAM copy (from pageable memory a copy would block)
        let staging = self.cache.as_ref().is_some_and(|c| c.n_staging >= 2 * kk && c.async_ok);
        let missing = host.misses.get(next).is_none_or(|&v| v >= PREDICT_MIN_MISSES);
        let on = s.routes.is_some()
            || staging && missing && m.experts.as_ref().is_some_and(|st| st.knobs.value(Knob::Prefetch) >= 1.0);
        let c = m.cfg;
        let scratch = c.n_ff.max(c.n_expert_used * c.n_ff_exp).max(c.n_ff_shexp) >= c.n_embd;
        (on && decode && t == 1 && scratch && next < self.layer_range().end)
            .then_some(next)
            .filter(|&n| matches!(self.layer(n).ffn, GFfn::Moe { .. }))
    }

    /// Enqueues the next-layer prediction of a one-token window (after layer `next - 1`'s routing): the hidden
    /// state after layer `next - 1`'s attention (`b.x`), RMS-normalised with layer `next`'s `ffn_norm` (into
    /// the scratch `h` / `hq`, free until the experts' launches), layer `next`'s router and bias, and its top-k
    /// into `b.pids` / `b.pw` — the prediction the CPU backend records in the routing dump, here three small
    /// launches on the device instead of host work on the critical path.
    pub(super) fn enqueue_prediction(&self, ops: &Ops, c: &ModelConfig, next: usize) -> Result<(), GpuError> {
        let b = &self.b;
        let g = self.layer(next);
        let GFfn::Moe { router, bias, .. } = &g.ffn else { unreachable!("predicts() names MoE layers") };
        let (e, ne, kk) = (c.n_embd, c.n_expert, c.n_expert_used);
        ops.rms_norm_q8(b.x.ptr, g.ffn_norm.ptr, c.rms_eps, e, 1, b.h.ptr, b.hq.ptr, None)?;
        ops.mmv(&[router], b.hq.ptr, b.h.ptr, 1, b.rl.ptr, ne, false, None)?;
        let mode = (self.gating, bias.as_ref().map_or(0, |b| b.router.ptr));
        ops.route_topk(b.rl.ptr, ne, kk, 1, b.pids.ptr, b.pw.ptr, None, 0, mode)
    }

    /// The set of prefetch slots that layer `l`'s prefetched experts use, of the `room` last staging slots (`k`
    /// or `2k`; `kk` = `k`): one set, or one per layer parity, so that a layer's copies need not wait for the
    /// previous layer's launches to have read the set they rewrite.
    fn pf_set(room: usize, kk: usize, l: usize) -> usize {
        if room >= 2 * kk {
            l % 2
        } else {
            0
        }
    }

    /// The staging slot of the `j`-th prefetched expert for layer `l` (`j < k`; see [`Stage::pf_set`]).
    fn pf_slot(cache: &SlotCache, room: usize, kk: usize, l: usize, j: usize) -> u32 {
        cache.staging_slot(cache.n_staging - kk * (Self::pf_set(room, kk, l) + 1) + j)
    }

    /// Runs a hybrid decode layer's attention segment (`enqueue`) from its captured graph for `key` (layer, attention
    /// size class, with the next layer's prediction), capturing it first; plain launches when a capture fails (graphs
    /// then off).
    pub(super) fn replay_segment(
        &self,
        key: (usize, usize, bool),
        mut enqueue: impl FnMut() -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        if !self.graphs_on() {
            return enqueue(); // a capture failed earlier in this pass
        }
        let mut graphs = self.layer_graphs.lock().unwrap_or_else(|e| e.into_inner());
        let g = match graphs.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => match self.s.capture(&mut enqueue) {
                Ok(g) => v.insert(g),
                Err(err) => {
                    tracing::warn!("CUDA graph capture failed ({err}); decoding with plain launches");
                    self.graphs_off.store(true, std::sync::atomic::Ordering::Relaxed);
                    return enqueue();
                }
            },
        };
        g.launch(&self.s)
    }

    /// One MoE layer with the routing on the host: VRAM hits (and PCIe-staged misses) on the GPU, the other misses on
    /// the CPU pool, overlapped. `routed`: the routing's copy to the host is already enqueued (a replayed segment);
    /// else it is enqueued here. `pred_layer`: the routing's launches also predicted that layer's experts
    /// ([`Stage::enqueue_prediction`]), whose ids the copy carries. Returns the combine of the results (done on the GPU
    /// by the next norm; a decode window's CPU rows are always uploaded, zeros when the CPU computed nothing, so that
    /// the next segment's combine is the same every token; a prefill layer whose experts all ran on the GPU uploads
    /// none and its combine takes no CPU rows).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hybrid_moe(
        &self,
        m: &ModelRef<'_>,
        l: usize,
        t: usize,
        pos0: usize,
        s: &mut Scratch,
        host: &mut Host,
        (gate_ty, down_ty, down_off): (GgmlType, GgmlType, usize),
        (routed, pred_layer): (bool, Option<usize>),
    ) -> Result<Combine, GpuError> {
        let c = m.cfg;
        let (e, kk, ff) = (c.n_embd, c.n_expert_used, c.n_ff_exp);
        let b = &self.b;
        let n_pairs = t * kk;
        host.ids.resize(n_pairs, 0);
        host.w.resize(n_pairs, 0.0);
        host.xn.resize(t * e, 0.0);
        let t0 = self.timing.then(std::time::Instant::now);
        let ni = n_pairs * 4;
        let staging = self.routing_staging(host, kk, e)?;
        if !routed {
            self.routing_dtoh(staging, n_pairs, t * e)?;
            if pred_layer.is_some() {
                self.prediction_dtoh(staging, n_pairs, t * e, kk)?;
            }
        }
        // a segment that predicts recorded `routed_ev` after its routing copy: the prediction's launches and the
        // copy of its ids run on while the host reads the routing; `issue` waits for them
        let early = routed && pred_layer.is_some();
        if early {
            self.routed_ev.sync()?;
        } else {
            self.s.sync()?;
        }
        {
            let down = host.pin_down.as_ref().expect("sized by routing_staging");
            down.read(0, &mut host.ids);
            down.read(ni, &mut host.w);
            down.read(2 * ni, &mut host.xn);
        }
        let t1 = self.timing.then(std::time::Instant::now);
        if let Some(bad) = host.ids.iter().position(|&v| v < 0 || v as usize >= c.n_expert) {
            let nan = host.xn.iter().filter(|v| !v.is_finite()).count();
            return Err(GpuError::Unsupported(format!(
                "layer {l}: router top-k gave expert id {} (entry {bad}); {nan} non-finite values in the normalized \
                 activations",
                host.ids[bad]
            )));
        }
        // an asynchronous adaptive round's experts that landed meanwhile are used from this layer on
        if let (Some(cache), Some(st)) = (&self.cache, &m.experts) {
            if cache.round_in_flight() {
                cache.poll(st, &self.s, false)?;
            }
        }
        let routes: Vec<Vec<(usize, f32)>> =
            (0..t).map(|i| (0..kk).map(|r| (host.ids[i * kk + r] as usize, host.w[i * kk + r])).collect()).collect();
        s.record_routes(l, pos0, &routes);
        let mut by_expert = dispatch::by_expert(&routes, c.n_expert);
        let src = dispatch::plan_sources(m.experts.map(|st| &**st), l, &routes, &by_expert, s.decode);
        let Ffn::Moe(ex) = &m.weights.blocks[l].ffn else { unreachable!("MoE layer") };
        // experts the previous layer prefetched for this one: their bytes are in staging slots (copied on the
        // prefetch stream; this layer's launches wait for `pf_ready` first)
        let prefetched = std::mem::take(&mut host.prefetched);
        let predicted = std::mem::take(&mut host.predicted);
        let pf_slot = |x: usize| prefetched.iter().find(|p| p.0 == l && p.1 == x).map(|p| p.2);
        // GPU work: hits and prefetched misses, then (pcie_frac) a share of the RAM-resident misses, most entries
        // first
        let mut gpu: Vec<(usize, u32)> = Vec::new();
        let mut ram_miss: Vec<(usize, usize)> = Vec::new();
        let (mut pf_used, mut routed_n, mut named_n) = (0u64, 0u64, 0u64);
        for (x, toks) in by_expert.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            routed_n += 1;
            if predicted.contains(&(l, x)) {
                named_n += 1;
            }
            match (src[x], pf_slot(x)) {
                (Source::Vram(slot), _) => gpu.push((x, slot)),
                (Source::Ram(_), Some(slot)) => {
                    gpu.push((x, slot));
                    pf_used += 1;
                }
                (Source::Ram(off), None) => ram_miss.push((x, off)),
                _ => {}
            }
        }
        if s.decode && t == 1 {
            // this layer's RAM misses of the token (those prefetched included), for the prefetch's choice of layers
            if host.misses.len() <= l {
                host.misses.resize(l + 1, PREDICT_MIN_MISSES);
            }
            let now = (ram_miss.len() as u64 + pf_used) as f32;
            host.misses[l] = (1.0 - MISS_AVG) * host.misses[l] + MISS_AVG * now;
        }
        if let (Some(st), true) = (&m.experts, s.decode) {
            use std::sync::atomic::Ordering::Relaxed;
            let c = &st.counters;
            let pf_here = prefetched.iter().filter(|p| p.0 == l).count() as u64;
            c.prefetch_hits.fetch_add(pf_used, Relaxed);
            c.prefetch_wasted_bytes.fetch_add((pf_here - pf_used) * st.layout().layers[l].blob_bytes() as u64, Relaxed);
            if predicted.iter().any(|p| p.0 == l) {
                c.predicted_routed.fetch_add(routed_n, Relaxed);
                c.predicted_named.fetch_add(named_n, Relaxed);
            }
        }
        let cache = self.cache.as_ref();
        // live knob `prefetch` (N): at most N of the predicted layer's misses (highest router probability first)
        // are uploaded on the prefetch stream into prefetch slots (the last `kk` staging slots, or `2 kk` by layer
        // parity: `pf_slot`) while this layer computes and the next layer's attention runs; not while an adaptive
        // round is in flight, whose exchanges may move RAM places. PCIe staging keeps to the other slots.
        let pf_max = m.experts.as_ref().map_or(0, |st| st.knobs.value(Knob::Prefetch) as usize).min(kk);
        let pf_room = cache.map_or(0, |c| match (t == 1 && pf_max > 0 && c.async_ok, c.n_staging) {
            (true, n) if n >= 3 * kk => 2 * kk,
            (true, n) if n >= 2 * kk => kk,
            _ => 0,
        });
        // (whether to upload is decided in `issue`, once the predicted ids are read)
        let pf_on = pf_room > 0 && cache.is_some_and(|c| !c.round_in_flight()) && s.decode;
        let n_stage_max = cache.map_or(0, |c| c.n_staging - pf_room);
        // live knob `pcie_frac` (--pcie-frac): that share of the RAM-resident misses' bytes goes over PCIe. Each miss
        // is split at intermediate row k (steps of 64 rows, `split_rows`): rows 0..k are uploaded (packed) and computed
        // on the GPU, rows k.. on the CPU, both adding into the expert's output — so PCIe and the CPU pool share every
        // miss, even a layer's single one. Widths that do not split send whole experts (error diffusion). Only the plan
        // is made here; the copies are issued below, beside the CPU pool's work.
        let knob = |k: Knob| m.experts.as_ref().map_or(0.0, |st| st.knobs.value(k));
        let block = gate_ty.block_size().max(down_ty.block_size());
        // pcie_auto: the balanced share (starting from pcie_frac, or 0.5 when that is 0), moved by decode tokens
        // a layer with expert biases sends whole experts (the split's partial experts would add theirs twice)
        let bias = match &self.layer(l).ffn {
            GFfn::Moe { bias, .. } => bias.as_ref(),
            GFfn::Dense { .. } => None,
        };
        let whole = bias.is_some();
        let auto = knob(Knob::PcieAuto) >= 1.0 && split_rows(0.5, ff, block) > 0 && !whole;
        let min_step = split_step(block) as f32 / ff as f32;
        let frac = if auto {
            let start = knob(Knob::PcieFrac) as f32;
            let start = if start > 0.0 { start } else { 0.5 };
            if host.balance_from != start {
                host.balance = Default::default();
                host.balance_from = start;
            }
            host.balance.share(start, min_step)
        } else {
            knob(Knob::PcieFrac) as f32
        };
        // live knob `pcie_prefill` (N): a prefill chunk of at least N tokens uploads its RAM-resident misses whole
        // (as many as the staging slots hold, those with the most tokens first) and computes them on the GPU; the
        // CPU pool takes the rest. Its `pcie_frac` share does not apply, nor does it move the decode carry.
        // It needs the page-locked RAM copy (`async_ok`: the copy is registered with the driver); from pageable memory
        // the link is several times slower and the CPU pool keeps the misses.
        let prefill_min = knob(Knob::PciePrefill) as usize;
        let prefill_pcie = !s.decode && prefill_min > 0 && t >= prefill_min && cache.is_some_and(|c| c.async_ok);
        // prefill ahead: with two staging sets (`pipeline::staging_sets`), a prefill layer l stages into set
        // l % 2: first the experts the previous layer uploaded for it there (`prefetched`, on the prefetch
        // stream), then its other PCIe-served misses; and it uploads the next layer's RAM-resident experts into
        // the other set, so that the link works while this layer and the next one's attention compute. Only for a
        // chunk that routes to nearly every expert (`backend::chunk_reaches_all`), and not while an adaptive round
        // is in flight (its exchanges may move RAM places).
        // (a prefill layer that holds experts uploaded ahead for it stages after them even when the live knob
        // turned `pcie_prefill` off meanwhile; only the uploads ahead follow the knob)
        let set = self.staging_set;
        let pf_here = prefetched.iter().filter(|p| p.0 == l).count();
        let parity = !s.decode && (prefill_pcie || pf_here > 0) && cache.is_some_and(|c| c.n_staging >= 2 * set);
        let (stage_first, n_stage_max) = staging_span(parity, l, set, pf_here, n_stage_max);
        let ahead: Vec<(usize, usize, usize)> = match (&m.experts, cache) {
            (Some(st), Some(cc))
                if parity
                    && prefill_pcie
                    && crate::backend::chunk_reaches_all(t, kk, c.n_expert)
                    && !cc.round_in_flight() =>
            {
                let nx = l + 1;
                let moe_next = nx < self.layer_range().end && matches!(self.layer(nx).ffn, GFfn::Moe { .. });
                let mut items: Vec<(usize, usize, usize)> = if moe_next {
                    st.ram_tier(nx).into_iter().map(|(x, off)| (nx, x, off)).collect()
                } else {
                    Vec::new()
                };
                // in place order (one copy per run of adjacent places); a set's worth when more are in RAM
                items.sort_unstable_by_key(|p| p.2);
                items.truncate(set);
                items
            }
            _ => Vec::new(),
        };
        let mut split: Vec<(usize, u32)> = Vec::new();
        let mut from = vec![0usize; c.n_expert];
        let mut geom = None;
        // (layer, expert, RAM offset) of the staged misses (split ones when `geom` is set)
        let mut staged: Vec<(usize, usize, usize)> = Vec::new();
        if let (Some(cache), true) = (cache, frac > 0.0 || prefill_pcie) {
            ram_miss.sort_by(|a, b| by_expert[b.0].len().cmp(&by_expert[a.0].len()).then(a.0.cmp(&b.0)));
            // (whole experts while this layer stages into its set: the split's staging keeps to the first slots)
            let k = if prefill_pcie || whole || parity { ff } else { split_rows(frac, ff, block) };
            let mut entries = 0u64;
            let n = if prefill_pcie {
                ram_miss.len().min(n_stage_max)
            } else if k > 0 && k < ff {
                geom = Some(super::slots::SplitGeom::new(k, gate_ty.row_bytes(e), ff, down_ty, e));
                ram_miss.len().min(n_stage_max)
            } else {
                // error diffusion across layers: over a window, `frac` of the RAM misses go over PCIe
                host.pcie_carry += ram_miss.len() as f32 * frac.min(1.0);
                let n = (host.pcie_carry.floor() as usize).min(ram_miss.len()).min(n_stage_max);
                host.pcie_carry -= n as f32;
                n
            };
            // a prefill's chosen ones in place order: adjacent places go as one copy (`SlotCache::stage`)
            if !s.decode {
                ram_miss[..n].sort_unstable_by_key(|&(_, off)| off);
            }
            for (j, &(x, off)) in ram_miss[..n].iter().enumerate() {
                let slot = cache.staging_slot(stage_first + j);
                entries += by_expert[x].len() as u64;
                staged.push((l, x, off));
                if geom.is_some() {
                    split.push((x, slot));
                    from[x] = k;
                } else {
                    gpu.push((x, slot));
                }
            }
            if s.decode {
                if let Some(st) = &m.experts {
                    st.counters.pcie_entries.fetch_add(entries, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        // groups of up to MAX_NT tokens per expert (whole experts first, then split ones); flags per routing
        // entry (1 = the GPU wrote this entry's row of y). A prefill chunk groups its GPU experts' tokens on the
        // device instead (`group_by_expert` over this layer's slot per expert: a VRAM or staging slot, −1 for the
        // CPU pool's) and runs them on the tensor-core expert kernels, as a chunk with every expert in VRAM does;
        // the host sends the table only (and no flags: the grouping writes them)
        let device_groups = !s.decode && t > MAX_NT && self.group_prefill && split.is_empty();
        host.groups.clear();
        host.flag.clear();
        if !device_groups {
            host.flag.resize(n_pairs, 0);
        }
        let add_groups = |list: &[(usize, u32)], host: &mut Host| {
            let mut n = 0;
            for &(x, slot) in list {
                for chunk in by_expert[x].chunks(MAX_NT) {
                    let mut g = [0i32; 18];
                    g[0] = slot as i32;
                    g[1] = chunk.len() as i32;
                    for (j, &(i, _)) in chunk.iter().enumerate() {
                        let rank = routes[i].iter().position(|&(ex_, _)| ex_ == x).expect("routed");
                        g[2 + j] = i as i32;
                        g[10 + j] = (i * kk + rank) as i32;
                        host.flag[i * kk + rank] = 1;
                    }
                    host.groups.extend(g.iter().flat_map(|v| v.to_le_bytes()));
                    n += 1;
                }
            }
            n
        };
        let (n_groups, n_split) = if device_groups {
            let mut tab = vec![-1i32; c.n_expert];
            for &(x, slot) in &gpu {
                tab[x] = slot as i32;
            }
            host.groups.extend(tab.iter().flat_map(|v| v.to_le_bytes()));
            (gpu.len(), 0)
        } else {
            (add_groups(&gpu, host), add_groups(&split, host))
        };
        for &(x, _) in &gpu {
            by_expert[x].clear(); // not for the CPU (split experts keep their tokens: the CPU does rows k..)
        }
        // groups and flags into the page-locked upload staging (the CPU experts' sum follows, 16-byte aligned)
        let (glen, flen) = (host.groups.len(), host.flag.len() * 4);
        let (f_off, acc_off) = (glen.next_multiple_of(16), (glen.next_multiple_of(16) + flen).next_multiple_of(16));
        let up = grow_pinned(&mut host.pin_up, acc_off + t * e * 4)?;
        up.write(0, &host.groups);
        up.write(f_off, &host.flag);
        let up_ptr = up.ptr();
        let t2 = self.timing.then(std::time::Instant::now);
        // pcie_auto: an event at the end of the GPU's share, asked about when the CPU's share is done
        let measure = auto && s.decode && n_split > 0;
        if measure && host.split_done.is_none() {
            host.split_done = Some(super::driver::Event::new()?);
        }
        // the GPU's share: staging copies, groups, expert launches, flags — issued on this thread while the
        // CPU pool starts on the misses (the copies and launches are asynchronous; issuing them takes tens of
        // microseconds per layer that would otherwise delay the CPU experts)
        let any_cpu = by_expert.iter().any(|v| !v.is_empty());
        // a prefill layer whose experts all run on the GPU uploads no CPU sum (the combine takes none); then the
        // next layer's upload ahead is issued with the GPU's share, else after the CPU sum's upload, so that the
        // model stream's small copies never queue behind it on the link
        let no_cpu_sum = !s.decode && !any_cpu;
        let mut issued: Option<Result<f64, GpuError>> = None;
        let mut pf_new = Vec::new();
        // the next layer's predicted experts, by rank (empty: no prediction, or ids out of range)
        let mut named: Vec<usize> = Vec::new();
        let pf_wait = !prefetched.is_empty();
        let pin_down = host.pin_down.as_ref().expect("sized by routing_staging");
        let mut issue = |held: Option<&HostArena>| {
            issued = Some((|| {
                let ti = std::time::Instant::now();
                if pred_layer.is_some() {
                    if early {
                        self.pred_ev.sync()?; // the copy of the prediction's ids
                    }
                    let mut p = vec![0i32; kk];
                    pin_down.read(2 * ni + t * e * 4, &mut p);
                    if p.iter().all(|&v| v >= 0 && (v as usize) < c.n_expert) {
                        named = p.into_iter().map(|v| v as usize).collect();
                    }
                }
                let prefetch = pred_layer.filter(|_| pf_on && !named.is_empty());
                // the RAM copy's read lock for the staging and prefetch copies: the one the CPU experts hold, else
                // our own
                let guard;
                let arena = match (held, m.experts.as_ref()) {
                    (Some(a), _) => Some(a),
                    (None, Some(st)) if !staged.is_empty() || prefetch.is_some() || !ahead.is_empty() => {
                        guard = st.arena();
                        Some(&*guard)
                    }
                    _ => None,
                };
                if pf_wait {
                    // this layer's prefetched experts (and any copy the previous layer issued) are in place
                    // before its launches
                    self.s.wait(&self.pf_ready)?;
                }
                if !staged.is_empty() {
                    let (Some(cache), Some(arena)) = (cache, arena) else {
                        unreachable!("staged misses come from the cache and the store")
                    };
                    let slots = match &geom {
                        Some(g) => cache.stage_split(arena, &staged, g, &self.s)?,
                        None => cache.stage(arena, &staged, stage_first, &self.s)?,
                    };
                    debug_assert_eq!(slots.len(), staged.len());
                    debug_assert!(slots.iter().enumerate().all(|(j, &sl)| sl == cache.staging_slot(stage_first + j)));
                }
                if device_groups {
                    // SAFETY: as for the groups below.
                    unsafe { self.s.htod_raw(b.htab.ptr, up_ptr, glen)? };
                    let ops = Ops { k: &self.k, s: &self.s };
                    let (groups, flag, rank, tiles) = (b.groups.ptr, b.flag.ptr, b.rank.ptr, b.tiles.ptr);
                    ops.group_by_expert(b.ids.ptr, n_pairs, kk, c.n_expert, b.htab.ptr, groups, flag, rank, tiles)?;
                    if n_groups > 0 {
                        let down = (down_off, down_ty.row_bytes(ff));
                        self.experts_grouped((gate_ty, down_ty), n_pairs, c.n_expert, ff, e, down, bias)?;
                    }
                } else if n_groups + n_split > 0 {
                    // SAFETY: the upload staging is next written in the next MoE layer, after that layer's stream
                    // sync (or in the next pass, after its final sync), so it outlives the copy.
                    unsafe { self.s.htod_raw(b.groups.ptr, up_ptr, glen)? };
                    let one = t == 1;
                    if n_groups > 0 {
                        let down = (down_off, down_ty.row_bytes(ff));
                        self.experts_gpu((gate_ty, down_ty), one, b.groups.ptr, n_groups, n_pairs, ff, down, e, bias)?;
                    }
                    if let Some(g) = geom.filter(|_| n_split > 0) {
                        // the split experts' rows 0..k, as experts of width k (h and hq reused after the
                        // launches above)
                        let gp = b.groups.at(n_groups * GROUP_BYTES);
                        let down = (g.down_off(), g.down_pitch);
                        self.experts_gpu((gate_ty, down_ty), one, gp, n_split, n_pairs, g.k, down, e, None)?;
                    }
                }
                if !device_groups {
                    // SAFETY: as for the groups above.
                    unsafe { self.s.htod_raw(b.flag.ptr, up_ptr.add(f_off), flen)? };
                }
                if let (true, Some(ev)) = (measure, &host.split_done) {
                    ev.record(&self.s)?;
                }
                if pf_room > 0 {
                    // this layer's launches are enqueued: the prefetch slots of its parity may be rewritten after
                    // them
                    self.pf_free[Self::pf_set(pf_room, kk, l)].record(&self.s)?;
                }
                if parity {
                    // the same for the prefill's staging set of this layer
                    self.pf_free[l % 2].record(&self.s)?;
                }
                if let (false, true, Some(arena)) = (ahead.is_empty(), no_cpu_sum, arena) {
                    pf_new.extend(self.upload_ahead(arena, &ahead, set)?);
                }
                if let Some(next) = prefetch {
                    let (Some(cache), Some(st), Some(arena)) = (cache, m.experts.as_ref(), arena) else {
                        unreachable!("checked")
                    };
                    // the named experts neither in VRAM nor without a RAM place: upload each into a prefetch slot
                    let items: Vec<(usize, usize, usize)> = named
                        .iter()
                        .filter(|&&x| st.tier(next, x) == crate::tiers::store::Tier::Ram)
                        .filter_map(|&x| st.place_of(next, x).map(|off| (next, x, off)))
                        .take(pf_max)
                        .collect();
                    if !items.is_empty() {
                        // after the launches that last read these slots (layer next - 2's with two sets, this
                        // layer's with one)
                        self.pf_s.wait(&self.pf_free[Self::pf_set(pf_room, kk, next)])?;
                        for (j, &(_, x, off)) in items.iter().enumerate() {
                            let slot = Self::pf_slot(cache, pf_room, kk, next, j);
                            let src = arena.slice(off, cache.blob(next));
                            // SAFETY: as in `SlotCache::stage`: a RAM place is not rewritten while a window runs
                            // (promotions between windows; no adaptive round in flight here); the slot's earlier
                            // readers are done (the wait above), and its next reader, layer `next`'s launches,
                            // waits for `pf_ready`, recorded after this copy; the pass ends with the model's
                            // stream, which has waited for it.
                            unsafe { self.pf_s.htod_raw(cache.slot_addr(slot), src.as_ptr(), src.len())? };
                            pf_new.push((next, x, slot));
                        }
                        self.pf_ready.record(&self.pf_s)?;
                    }
                    st.counters.prefetched.fetch_add(items.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(ti.elapsed().as_secs_f64())
            })());
        };
        // a failed file-tier read fails the pass once the GPU's share is issued (its side work ran)
        let cpu_done = if any_cpu {
            s.xn.resize(t, e);
            s.xn.f.copy_from_slice(&host.xn);
            // the activations the K-quant and IQ products pair with (Q8_K), as the CPU backend quantizes them
            s.xn.with_q8k = m.weights.q8k_activations;
            s.xn.quantize();
            cpu_experts(m, l, ex, &by_expert, src, Some(&from), s, issue)
        } else {
            issue(None);
            Ok(())
        };
        host.prefetched = pf_new;
        host.predicted = pred_layer.map_or(Vec::new(), |n| named.iter().map(|&x| (n, x)).collect());
        if let (Some(next), true) = (pred_layer, s.routes.is_some() && !named.is_empty()) {
            s.predict_next(next, vec![named]); // recorded with that layer's routing (--dump-routing)
        }
        let issue_s = issued.expect("the CPU experts run their side work exactly once")?;
        cpu_done?;
        if let (true, Some(ev)) = (measure && any_cpu, &host.split_done) {
            let gpu_done = ev.done()?;
            // a token's worth of votes: one per MoE layer
            host.balance.vote(gpu_done, self.n_moe_layers as u32, min_step);
        }
        if !no_cpu_sum {
            // the CPU experts' sum (zeros when there were none: a decode window's graphs take the same combine
            // every token)
            let up = host.pin_up.as_mut().expect("grown above");
            if any_cpu {
                up.write(acc_off, &s.moe_acc[..t * e]);
            } else {
                up.as_mut_slice()[acc_off..acc_off + t * e * 4].fill(0);
            }
            // SAFETY: as for the groups above (the sum's part of the staging is written once per layer, here).
            unsafe { self.s.htod_raw(b.cpu.ptr, up.ptr().add(acc_off), t * e * 4)? };
            if let (false, Some(st)) = (ahead.is_empty(), &m.experts) {
                host.prefetched.extend(self.upload_ahead(&st.arena(), &ahead, set)?);
            }
        }
        if let (Some(t0), Some(t1), Some(t2)) = (t0, t1, t2) {
            let p = &mut host.prof;
            p.layers += 1;
            p.wait += (t1 - t0).as_secs_f64();
            p.plan += (t2 - t1).as_secs_f64();
            p.issue += issue_s;
            p.cpu += t2.elapsed().as_secs_f64();
            p.cpu_experts += by_expert.iter().filter(|v| !v.is_empty()).count();
        }
        Ok(Combine { y: b.y.ptr, w: b.w.ptr, flag: b.flag.ptr, cpu: if no_cpu_sum { 0 } else { b.cpu.ptr }, k: kk })
    }

    /// Prefill ahead (see `hybrid_moe`): uploads `items` (the next layer's RAM-resident experts: layer, expert,
    /// place in `arena`, the RAM copy read-locked by the caller) on the prefetch stream into that layer's staging
    /// set (of `set` slots; set `layer % 2`), after the launches that last read it (two layers back:
    /// `pf_free`), and records `pf_ready` after them, which that layer's launches wait for. Returns
    /// (layer, expert, slot) of each, for `Host::prefetched`.
    fn upload_ahead(
        &self,
        arena: &HostArena,
        items: &[(usize, usize, usize)],
        set: usize,
    ) -> Result<Vec<(usize, usize, u32)>, GpuError> {
        let (Some(cache), Some(&(nx, _, _))) = (self.cache.as_ref(), items.first()) else {
            return Ok(Vec::new());
        };
        self.pf_s.wait(&self.pf_free[nx % 2])?;
        let slots = cache.stage(arena, items, (nx % 2) * set, &self.pf_s)?;
        self.pf_ready.record(&self.pf_s)?;
        Ok(items.iter().zip(slots).map(|(&(l, x, _), slot)| (l, x, slot)).collect())
    }

    /// Between decode windows: carries out this stage's share of an adaptive round's swaps (blocking, or started
    /// asynchronously) and, asynchronously, admits a landed round. `plan`: the swaps of the stage's layers.
    pub(super) fn adapt(
        &self,
        store: &Arc<ExpertStore>,
        plan: Vec<crate::tiers::policy::Swap>,
    ) -> Result<(), GpuError> {
        let Some(cache) = &self.cache else { return Ok(()) };
        self.dev.bind()?;
        // a pass waits for its prefetch copies unless it failed between a layer's copies and the next layer: none
        // may still read a RAM place or write a slot that this round moves
        self.pf_s.sync()?;
        let want = store.knobs.value(Knob::AdaptAsync) >= 1.0;
        if want && !cache.async_ok && !self.said_fallback.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "--adapt-async 1 needs the page-locked resident RAM copy (not with --mmap-experts or when the \
                 copy could not be registered): the adaptive tier runs blocking rounds"
            );
        }
        let asynchronous = want && cache.async_ok;
        if asynchronous {
            cache.poll(store, &self.s, false)?;
        }
        cache.run_round(store, plan, &self.s, asynchronous)?;
        Ok(())
    }

    /// The PCIe share that `pcie_auto` has settled on so far (a fraction of a miss's intermediate rows; `None`
    /// before a split layer ran with it on).
    pub(super) fn pcie_share(&self) -> Option<f32> {
        self.host.lock().unwrap_or_else(|e| e.into_inner()).balance.current()
    }

    /// Checks the stage's VRAM slots against the file after draining any round (one line per fault).
    pub(super) fn verify_slots(&self, store: &Arc<ExpertStore>) -> Result<Vec<String>, GpuError> {
        self.drain(store)?;
        self.s.sync()?;
        self.pf_s.sync()?;
        match &self.cache {
            Some(c) => c.verify(store, &self.s, self.layer_range()),
            None => Ok(Vec::new()),
        }
    }

    /// At a request's start: waits for an asynchronous round in flight and admits it.
    pub(super) fn drain(&self, store: &Arc<ExpertStore>) -> Result<(), GpuError> {
        if let Some(cache) = &self.cache {
            self.dev.bind()?;
            cache.poll(store, &self.s, true)?;
        }
        Ok(())
    }

    /// Waits for the stage's streams (and binds its card).
    pub(super) fn sync(&self) -> Result<(), GpuError> {
        self.dev.bind()?;
        self.s.sync()?;
        self.pf_s.sync()
    }

    /// Tokens per pass at most (the scratch's size).
    pub(super) fn max_t(&self) -> usize {
        self.max_t
    }

    /// Positions of the KV cache.
    pub(super) fn n_ctx(&self) -> usize {
        self.n_ctx
    }
}

/// Rows per step of a PCIe split for formats of `block`-wide blocks: `max(64, block)` (see [`split_rows`]).
pub fn split_step(block: usize) -> usize {
    block.max(64)
}

/// Intermediate rows of a RAM-resident miss that go over PCIe for the share `frac`, rounded to the nearest
/// step of `max(64, block)` rows (`block`: the larger block size of the gate and down formats, 32 or 256 for the
/// quantized ones). 64 rows keep a down part an even number of 32-wide blocks, as the staged kernels and h's Q8
/// rows need (the parts are padded to 16 bytes, [`super::slots::SplitGeom`]). 0 (send whole experts) when `ff`
/// is not a multiple of the step or the share rounds to nothing.
pub fn split_rows(frac: f32, ff: usize, block: usize) -> usize {
    let step = split_step(block);
    if !step.is_multiple_of(64) || !ff.is_multiple_of(step) || frac <= 0.0 {
        return 0;
    }
    ((frac.min(1.0) * (ff / step) as f32).round() as usize * step).min(ff)
}

#[cfg(test)]
mod tests {
    use super::{split_rows, staging_span};

    #[test]
    fn a_prefill_layer_stages_into_its_set_after_what_came_ahead() {
        // two sets of 64: layer 4 uses set 0, layer 5 set 1; after 10 experts uploaded ahead, 54 more fit
        assert_eq!(staging_span(true, 4, 64, 10, 128), (10, 54));
        assert_eq!(staging_span(true, 5, 64, 10, 128), (74, 54));
        // a full set uploaded ahead leaves no room (the rest go to the CPU pool)
        assert_eq!(staging_span(true, 5, 64, 64, 128), (128, 0));
        assert_eq!(staging_span(true, 0, 64, 0, 128), (0, 64));
        // decode, one set, or no prefill uploads: from the first staging slot
        assert_eq!(staging_span(false, 5, 64, 0, 120), (0, 120));
    }

    #[test]
    fn split_rows_are_whole_steps_of_the_share() {
        // 32-wide blocks (Q4_0, Q8_0): steps of 64 rows
        assert_eq!(split_rows(0.5, 14336, 32), 7168);
        assert_eq!(split_rows(0.3, 14336, 32), 67 * 64); // 67.2 steps → 67
        assert_eq!(split_rows(0.5, 768, 32), 384); // Qwen3-30B-A3B: half of 768 (was 512 in 256-row steps)
        assert_eq!(split_rows(0.45, 768, 32), 320); // 5.4 steps → 5
        assert_eq!(split_rows(1.0, 1536, 32), 1536);
        assert_eq!(split_rows(2.0, 1536, 32), 1536);
        assert_eq!(split_rows(0.01, 1536, 32), 0);
        assert_eq!(split_rows(0.0, 1536, 32), 0);
        // not a multiple of 64: whole experts instead
        assert_eq!(split_rows(0.5, 1000, 32), 0);
        // 256-wide blocks (K-quants): steps of 256 rows
        assert_eq!(split_rows(0.5, 768, 256), 512); // 1.5 steps → 2
        assert_eq!(split_rows(0.3, 768, 256), 256);
        // float formats: 64
        assert_eq!(split_rows(0.25, 512, 1), 128);
    }
}
