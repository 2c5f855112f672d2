//! The forward pass, written once for every architecture of [`crate::arch::REGISTRY`] over the backend
//! interface ([`crate::backend::Ops`]); it reads the architecture's choices from [`crate::arch::ArchSpec`],
//! never its name, and the backend's ops read the rest.
//!
//! Per block (names as in GGUF): `attn_norm` (RMSNorm) → `attn_q/k/v` (+ `attn_{q,k,v}.bias` when present) →
//! q/k RMSNorm (`attn_q_norm`/`attn_k_norm`, per head or over the whole projection, when the architecture has
//! it) → RoPE (adjacent pairs or NeoX halves) → grouped-query causal attention over the KV cache →
//! `attn_output` (+ bias) → residual; `ffn_norm` → FFN → residual. Dense FFN: `down(silu(gate x) * up x)`.
//! MoE FFN: router `ffn_gate_inp` logits → softmax (or sigmoid) → top-k → weights renormalised to sum 1 when
//! the architecture says so, times its weight scale → Σ_k w_k · expert_k(x), expert e's matrices being slice
//! e of `ffn_{gate,up,down}_exps` (`[n_embd, n_ff_exp, n_expert]` for gate/up, `[n_ff_exp, n_embd, n_expert]`
//! for down); plus, with a shared expert, `sigmoid(ffn_gate_inp_shexp · x) · down_shexp(silu(gate_shexp x) ·
//! up_shexp x)`. Then `output_norm` and `output` (or `token_embd` when the output is tied).

use std::sync::Arc;

use crate::arch::config::{ModelConfig, ModelError};
use crate::arch::weights::Weights;
use crate::arch::FfnKind;
use crate::backend::{Backend, BackendError, CpuBackend, GpuOptions, KvCache, KvType, ModelRef, Norm, Ops, Precision};
use crate::gguf::GgufFile;
use crate::pool::WorkerPool;
use crate::quant::GgmlType;
use crate::tiers::store::ExpertStore;

pub use crate::backend::{Logits, RouteRecord, Scratch};

/// A loaded model of a registry architecture over a mapped GGUF file.
pub struct Model {
    /// The file (tensor data is read in place from the mapping).
    pub file: Arc<GgufFile>,
    /// Hyper-parameters.
    pub cfg: ModelConfig,
    /// Every weight, located in the file.
    pub weights: Weights,
    /// Arithmetic of the CPU's matrix products (default: 8-bit activations as llama.cpp).
    pub precision: Precision,
    /// How new KV caches store rows (default f16; set through [`Model::set_kv_type`]).
    kv_type: KvType,
    /// CPU worker pool of the forward pass (default: one thread per physical core).
    pub pool: Arc<WorkerPool>,
    /// The backend that runs the forward passes ([`CpuBackend`] until [`Model::attach_gpu`] finds a GPU).
    /// Declared before [`Model::experts`] so that it is dropped first: the CUDA backend unregisters the RAM copy
    /// from the driver and waits for its copies before the store unmaps it.
    pub backend: Box<dyn Backend>,
    /// Expert store (RAM copy and file tier) of an MoE model; `None` computes experts from the file mapping.
    pub experts: Option<Arc<ExpertStore>>,
}

impl Model {
    /// Loads the model from an opened GGUF file. Errors: unsupported
    /// architecture or tensor type, missing tensors, shapes that disagree
    /// with the metadata.
    pub fn load(file: Arc<GgufFile>) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_gguf(&file)?;
        let weights = Weights::load(&file, &cfg)?;
        let pool = Arc::new(
            WorkerPool::new(num_cpus::get_physical())
                .map_err(|e| ModelError::BadHyperParameter(format!("worker pool: {e}")))?,
        );
        Ok(Model {
            file,
            cfg,
            weights,
            precision: Precision::default(),
            kv_type: KvType::default(),
            pool,
            backend: Box::new(CpuBackend),
            experts: None,
        })
    }

    /// Chooses how new KV caches store rows (`--kv-type`); set it before [`Model::attach_gpu`] (the GPU backend
    /// sizes and types its VRAM cache when it attaches). Errors: Q8_0 rows for a head dimension that is not a
    /// multiple of 32 (a block would span two heads); a change of type once a GPU backend runs the model.
    pub fn set_kv_type(&mut self, ty: KvType) -> Result<(), ModelError> {
        if ty != self.kv_type && self.backend.name() != "cpu" {
            return Err(ModelError::BadHyperParameter(format!(
                "--kv-type {}: the {} backend already keeps a {} KV cache (set the type before it attaches)",
                ty.name(),
                self.backend.name(),
                self.kv_type.name()
            )));
        }
        if !ty.fits(self.cfg.head_dim) {
            return Err(ModelError::BadHyperParameter(format!(
                "--kv-type {}: the head dimension {} is not a multiple of 32",
                ty.name(),
                self.cfg.head_dim
            )));
        }
        self.kv_type = ty;
        Ok(())
    }

    /// How new KV caches store rows.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Replaces the worker pool with one of `threads` threads (≥ 1).
    /// Errors: a thread could not be spawned.
    pub fn set_threads(&mut self, threads: usize) -> std::io::Result<()> {
        self.pool = Arc::new(WorkerPool::new(threads)?);
        Ok(())
    }

    /// Where each expert's bytes are in the file (the tiers' view of the experts); `None` for a dense model.
    pub fn expert_layout(&self) -> Option<crate::tiers::layout::ExpertLayout> {
        crate::tiers::layout::ExpertLayout::of(&self.weights, self.cfg.n_expert)
    }

    /// The expert-profile geometry of the model ([`crate::tiers::profile::geometry_of`]).
    pub fn geometry(&self) -> crate::tiers::profile::Geometry {
        crate::tiers::profile::geometry_of(&self.file, &self.cfg)
    }

    /// Number of parameters (elements of every tensor).
    pub fn n_params(&self) -> u64 {
        self.file.tensors.iter().map(|t| t.n_elements()).sum()
    }

    /// The most common tensor format among matrices (e.g. Q4_1).
    pub fn file_type(&self) -> GgmlType {
        let mut counts = std::collections::HashMap::new();
        for t in &self.file.tensors {
            if t.dims.len() >= 2 {
                *counts.entry(t.ggml_type).or_insert(0u64) += t.size_bytes;
            }
        }
        counts.into_iter().max_by_key(|(_, n)| *n).map(|(t, _)| t).unwrap_or(GgmlType::F32)
    }

    /// What the backend reads of this model.
    pub fn model_ref(&self) -> ModelRef<'_> {
        ModelRef {
            cfg: &self.cfg,
            weights: &self.weights,
            bytes: self.file.bytes(),
            pool: &self.pool,
            precision: self.precision,
            kv_type: self.kv_type,
            experts: self.experts.as_ref(),
        }
    }

    /// Moves the model onto the GPU when GPU use is on and a driver, NVRTC and a device are found (dense weights
    /// and the KV cache in VRAM, the VRAM expert cache filled from [`Model::experts`], so attach the store
    /// first); otherwise it stays on the CPU. In the resident RAM mode the RAM copy is built here, after the VRAM
    /// cache (every expert without one, as in the default mode). Returns the one line to log (what runs where, or why the CPU).
    /// Errors: a GPU was found but loading onto it failed (out of VRAM, a format without kernels).
    pub fn attach_gpu(&mut self, o: &GpuOptions) -> Result<String, String> {
        let (backend, line) = crate::backend::select(&self.model_ref(), o)?;
        if let Some(b) = backend {
            self.backend = b;
        }
        // the resident mode's RAM copy waits for the VRAM cache (a GPU backend builds it after its fill)
        if let Some(st) = &self.experts {
            if !st.ram_copy_built() {
                st.build_ram_copy(0).map_err(|e| format!("building the resident RAM copy: {e}"))?;
            }
        }
        Ok(line)
    }

    /// Moves the tensors that passes read from the file mapping into the process's own memory
    /// ([`GgufFile::detach`]), so that a model file truncated or rewritten under a running daemon fails the
    /// requests that read experts from it ([`BackendError::BlobRead`]) instead of faulting (SIGBUS) in a dense
    /// weight: every tensor but the routed experts (`*_exps.*`) on the CPU backend, the token embeddings on a
    /// GPU backend. Nothing moves when the bytes would not fit in
    /// the memory available now (less 1 GiB): a dense model larger than RAM keeps running from the page cache.
    /// Experts are read from the RAM copy or with `pread` (the file tier), except with `--mmap-experts`, whose
    /// experts stay in the mapping (a truncation there faults, as for any mmap reader). Call it after
    /// [`Model::attach_gpu`]. Returns the bytes moved. Errors: the move failed (the rest stays mapped).
    pub fn detach_from_file(&self) -> std::io::Result<usize> {
        let all = self.backend.reads_dense_on_host();
        let ranges: Vec<std::ops::Range<usize>> = self
            .file
            .tensors
            .iter()
            .filter(|t| {
                if all {
                    !t.name.contains("_exps.")
                } else {
                    // the GPU passes read embedding rows on the host
                    t.name == "token_embd.weight"
                }
            })
            .map(|t| t.file_offset as usize..(t.file_offset + t.size_bytes) as usize)
            .collect();
        let want: u64 = ranges.iter().map(|r| r.len() as u64).sum();
        let avail = crate::tiers::plan::Memory::probe().ram_available;
        if avail.is_some_and(|a| want.saturating_add(1 << 30) > a) {
            return Err(std::io::Error::other(format!(
                "{} of weights would not fit in the {} of memory available",
                crate::tiers::plan::size(want),
                crate::tiers::plan::size(avail.unwrap_or(0))
            )));
        }
        self.file.detach(&ranges)
    }

    /// A new KV cache for `n_ctx` positions.
    pub fn new_kv(&self, n_ctx: usize) -> KvCache {
        self.backend.new_kv(&self.model_ref(), n_ctx)
    }

    /// Runs `tokens` (a prefill chunk or one decode token) at positions `kv.len ..`, appending their K/V to
    /// `kv`, and returns logits (`n_vocab` per returned token, row-major). Panics if the chunk overflows the
    /// cache (callers check `kv.len + tokens.len() <= kv.n_ctx`) or the pass fails ([`Model::try_forward`]).
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, which: Logits, s: &mut Scratch) -> Vec<f32> {
        self.try_forward(tokens, kv, which, s)
            .unwrap_or_else(|e| panic!("{} forward pass failed: {e}", self.backend.name()))
    }

    /// [`Model::forward`] that returns the pass's failure: a GPU error, or a non-finite value (the CPU backend
    /// names the layer and tensor where it first appeared; any backend's logits are checked). After an error the
    /// positions written into `kv` by this call are not valid.
    pub fn try_forward(
        &self,
        tokens: &[u32],
        kv: &mut KvCache,
        which: Logits,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, BackendError> {
        let cfg = &self.cfg;
        let mut body = |ops: &mut dyn Ops, rows: Option<(usize, usize)>| blocks(cfg, ops, rows);
        let logits = self.backend.forward(&self.model_ref(), tokens, kv, which, s, &mut body)?;
        if !all_finite(&logits) {
            return Err(BackendError::NonFinite { layer: None, tensor: "output" });
        }
        Ok(logits)
    }

    /// After a decode window: the expert store's adaptive round (when one is due) carried out by the backend
    /// (swaps into the VRAM expert cache). Nothing without an expert store. Errors: the backend's.
    pub fn end_decode_window(&self) -> Result<(), BackendError> {
        match &self.experts {
            Some(st) => self.backend.end_window(st, st.end_decode_window()),
            None => Ok(()),
        }
    }

    /// At a request's start: an asynchronous adaptive round in flight is waited for and admitted. Errors: the
    /// backend's.
    pub fn drain(&self) -> Result<(), BackendError> {
        match &self.experts {
            Some(st) => self.backend.drain(st),
            None => Ok(()),
        }
    }

    /// Compares every tier copy of the experts with the file ([`Backend::verify_tiers`]); one line per fault.
    /// `None` for a dense model. Errors: the backend's.
    pub fn verify_tiers(&self) -> Result<Option<Vec<String>>, BackendError> {
        self.experts.as_ref().map(|st| self.backend.verify_tiers(st)).transpose()
    }
}

/// Whether every value of `v` is finite: in chunks whose test the compiler vectorizes (no early exit inside a
/// chunk), since it runs over a whole vocabulary of logits per decode token (152 µs → 21 µs for 151,936 values on
/// a 2-core VM).
fn all_finite(v: &[f32]) -> bool {
    v.chunks(64).all(|c| c.iter().fold(true, |ok, x| ok & x.is_finite()))
}

/// The forward pass of one chunk: every block through the backend's `ops`, then the output rows `rows` (`(row0,
/// n)`; `None`: no logits for this chunk). The architecture decides only the FFN's shape here; the ops read its
/// other choices.
fn blocks(cfg: &ModelConfig, ops: &mut dyn Ops, rows: Option<(usize, usize)>) -> Result<(), BackendError> {
    let ffn = cfg.spec.ffn;
    let layers = ops.layers(cfg.n_layer);
    for l in layers.clone() {
        // attention, and (MoE) the routing: no host round trip inside
        ops.segment(l, &mut |ops| {
            ops.norm(Norm::Attn(l))?;
            ops.qkv(l)?;
            ops.rope_store(l)?;
            ops.attention(l)?;
            ops.attn_output(l)?;
            ops.norm(Norm::Ffn(l))?;
            if ffn != FfnKind::Dense {
                ops.route(l)?;
            }
            Ok(())
        })?;
        match ffn {
            FfnKind::Dense => ops.ffn(l)?,
            FfnKind::Moe => ops.experts(l)?,
            FfnKind::MoeShared => {
                ops.shared_expert(l)?;
                ops.experts(l)?;
            }
        }
    }
    if layers.end < cfg.n_layer {
        return ops.hand_off(); // a stage of a layer split: the next stage takes x
    }
    match rows {
        Some((row0, n)) => ops.output(row0, n),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{qwen2, ArchSpec};

    #[test]
    fn all_finite_finds_any_non_finite_value() {
        let mut v: Vec<f32> = (0..1000).map(|i| i as f32 - 500.0).collect();
        assert!(all_finite(&v) && all_finite(&[]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 63, 64, 999] {
                let keep = v[at];
                v[at] = bad;
                assert!(!all_finite(&v), "{bad} at {at}");
                v[at] = keep;
            }
        }
        assert!(all_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE, -0.0]));
    }

    /// An [`Ops`] that records the calls of a pass (what the backends see of the forward pass).
    #[derive(Default)]
    struct Record(Vec<String>, Option<std::ops::Range<usize>>);

    impl Ops for Record {
        fn segment(
            &mut self,
            layer: usize,
            ops: &mut dyn FnMut(&mut dyn Ops) -> Result<(), BackendError>,
        ) -> Result<(), BackendError> {
            self.0.push(format!("segment {layer} {{"));
            ops(self)?;
            self.0.push("}".into());
            Ok(())
        }
        fn norm(&mut self, which: Norm) -> Result<(), BackendError> {
            self.0.push(format!("{which:?}"));
            Ok(())
        }
        fn qkv(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("qkv {l}"));
            Ok(())
        }
        fn rope_store(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("rope_store {l}"));
            Ok(())
        }
        fn attention(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("attention {l}"));
            Ok(())
        }
        fn attn_output(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("attn_output {l}"));
            Ok(())
        }
        fn ffn(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("ffn {l}"));
            Ok(())
        }
        fn route(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("route {l}"));
            Ok(())
        }
        fn shared_expert(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("shared_expert {l}"));
            Ok(())
        }
        fn experts(&mut self, l: usize) -> Result<(), BackendError> {
            self.0.push(format!("experts {l}"));
            Ok(())
        }
        fn output(&mut self, row0: usize, rows: usize) -> Result<(), BackendError> {
            self.0.push(format!("output {row0}+{rows}"));
            Ok(())
        }
        fn layers(&self, n_layer: usize) -> std::ops::Range<usize> {
            self.1.clone().unwrap_or(0..n_layer)
        }
        fn hand_off(&mut self) -> Result<(), BackendError> {
            self.0.push("hand_off".into());
            Ok(())
        }
    }

    fn cfg(ffn: FfnKind) -> ModelConfig {
        ModelConfig {
            arch: "qwen2moe".into(),
            spec: ArchSpec { def: &qwen2::QWEN2MOE, ffn },
            name: String::new(),
            n_layer: 2,
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            n_rot: 16,
            rope_freq_base: 1e4,
            rope_freq_scale: 1.0,
            rms_eps: 1e-6,
            n_ctx_train: 128,
            n_vocab: 32,
            n_expert: 4,
            n_expert_used: 2,
            n_ff_exp: 32,
            n_ff_shexp: 64,
            sliding_window: 0,
            rope_freq_base_swa: 1e4,
            rope_freq_scale_swa: 1.0,
            rope_yarn: None,
            attn_scale: 0.25,
        }
    }

    fn pass(ffn: FfnKind, rows: Option<(usize, usize)>) -> String {
        let mut r = Record::default();
        blocks(&cfg(ffn), &mut r, rows).unwrap();
        r.0.join(", ")
    }

    #[test]
    fn a_stage_of_a_layer_split_runs_its_layers_and_hands_off() {
        // the first of two stages: layer 0, then x handed on (no logits even when rows are asked for)
        let mut r = Record(Vec::new(), Some(0..1));
        blocks(&cfg(FfnKind::Moe), &mut r, Some((0, 1))).unwrap();
        assert_eq!(r.0.first().map(String::as_str), Some("segment 0 {"));
        assert_eq!(r.0[r.0.len() - 2..], ["experts 0".to_string(), "hand_off".to_string()]);
        assert!(!r.0.iter().any(|c| c.contains(" 1") || c.starts_with("output")), "{:?}", r.0);
        // the last stage: layer 1 and the logits
        let mut r = Record(Vec::new(), Some(1..2));
        blocks(&cfg(FfnKind::Moe), &mut r, Some((0, 1))).unwrap();
        assert_eq!(r.0.first().map(String::as_str), Some("segment 1 {"));
        assert_eq!(r.0.last().map(String::as_str), Some("output 0+1"));
        assert!(!r.0.iter().any(|c| c == "hand_off" || c.contains(" 0 ")), "{:?}", r.0);
    }

    #[test]
    fn one_pass_per_ffn_kind() {
        let attn = |l: usize| {
            format!("segment {l} {{, Attn({l}), qkv {l}, rope_store {l}, attention {l}, attn_output {l}, Ffn({l})")
        };
        let dense = (0..2).map(|l| format!("{}, }}, ffn {l}", attn(l))).collect::<Vec<_>>().join(", ");
        assert_eq!(pass(FfnKind::Dense, Some((3, 1))), format!("{dense}, output 3+1"));
        // the routing is inside the segment (no host round trip before it); the experts come after it
        let moe = (0..2).map(|l| format!("{}, route {l}, }}, experts {l}", attn(l))).collect::<Vec<_>>().join(", ");
        assert_eq!(pass(FfnKind::Moe, None), moe);
        let shared = (0..2)
            .map(|l| format!("{}, route {l}, }}, shared_expert {l}, experts {l}", attn(l)))
            .collect::<Vec<_>>()
            .join(", ");
        assert_eq!(pass(FfnKind::MoeShared, Some((0, 4))), format!("{shared}, output 0+4"));
    }
}
