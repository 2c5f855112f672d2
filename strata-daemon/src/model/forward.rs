//! The forward pass, written once for every architecture of [`crate::arch::REGISTRY`]; it reads the
//! architecture's choices from [`crate::arch::ArchSpec`], never its name.
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
use crate::arch::weights::{Block, ExpertWeights, Ffn, SharedExpert, Weight, Weights};
use crate::arch::{Gating, RopeKind};
use crate::backend::cpu::{experts_batch, matmul_with, silu, Act, ExpertJob, GluJob, MatRef, Precision, SyncPtr};
use crate::backend::kv::KvCache;
use crate::gguf::GgufFile;
use crate::pool::WorkerPool;
use crate::quant::{dequantize_row, GgmlType};
use crate::tiers::arena::HostArena;
use crate::tiers::store::{ExpertStore, Source};

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only for the last token of the chunk.
    Last,
    /// For every token of the chunk.
    All,
}

/// A loaded model of a registry architecture over a mapped GGUF file.
pub struct Model {
    /// The file (tensor data is read in place from the mapping).
    pub file: Arc<GgufFile>,
    /// Hyper-parameters.
    pub cfg: ModelConfig,
    /// Every weight, located in the file.
    pub weights: Weights,
    /// Arithmetic of the matrix products (default: 8-bit activations as llama.cpp).
    pub precision: Precision,
    /// CPU worker pool of the forward pass (default: one thread per physical core).
    pub pool: Arc<WorkerPool>,
    /// Expert store (RAM copy and file tier) of an MoE model; `None` computes experts from the file mapping.
    pub experts: Option<Arc<ExpertStore>>,
    /// The GPU backend (dense weights, KV cache and VRAM expert cache on the card); `None` = CPU only.
    #[cfg(feature = "cuda")]
    pub gpu: Option<Box<crate::backend::cuda::GpuModel>>,
}

/// Scratch buffers of one forward pass, reused across calls.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    pub(crate) xn: Act,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Act,
    tmp: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    h: Act,
    rope: Vec<(f32, f32)>,
    router: Vec<f32>,
    pub(crate) moe_acc: Vec<f32>,
    /// Per expert of a layer's batch: its tokens' activations.
    subs: Vec<Act>,
    /// Per expert of a layer's batch: its SwiGLU output (`tokens × rows`, quantized).
    hs: Vec<Act>,
    /// When `Some`, every routing decision of the forward passes is appended
    /// here (the caller drains it, e.g. for `--dump-routing`).
    pub routes: Option<Vec<RouteRecord>>,
    /// The pass is a decode window: expert lookups count in the tier counters and usage.
    pub decode: bool,
    /// Blobs of one layer's file-tier experts, back to back.
    blobs: Vec<u8>,
}

/// One routing decision: token position, layer, and the selected experts
/// with their renormalised weights in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRecord {
    /// Token position in the sequence (KV cache index).
    pub pos: usize,
    /// Layer index.
    pub layer: usize,
    /// `(expert, weight)` by rank (the weights sum to 1 when the architecture renormalises the top-k).
    pub experts: Vec<(usize, f32)>,
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
            pool,
            experts: None,
            #[cfg(feature = "cuda")]
            gpu: None,
        })
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

    /// A new KV cache for `n_ctx` positions.
    pub fn new_kv(&self, n_ctx: usize) -> KvCache {
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            // K/V live in VRAM; the host cache only tracks the length
            return KvCache::new(0, n_ctx, self.cfg.n_head_kv * self.cfg.head_dim);
        }
        let mut kv = KvCache::new(self.cfg.n_layer, n_ctx, self.cfg.n_head_kv * self.cfg.head_dim);
        kv.round_f16 = self.precision != Precision::F32;
        kv
    }

    /// The bytes of `w` in the mapped file as a matrix view.
    pub fn mat(&self, w: &Weight) -> MatRef<'_> {
        MatRef {
            data: &self.file.bytes()[w.offset..w.offset + w.bytes()],
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            stride: 0,
        }
    }

    /// Runs `tokens` (a prefill chunk or one decode token) at positions
    /// `kv.len ..`, appending their K/V to `kv`, and returns logits
    /// (`n_vocab` per returned token, row-major), computed on the model's
    /// worker pool. Panics if the chunk overflows the cache
    /// (callers check `kv.len + tokens.len() <= kv.n_ctx`).
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, which: Logits, s: &mut Scratch) -> Vec<f32> {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.forward(self, tokens, kv, which, s).unwrap_or_else(|e| panic!("GPU forward pass failed: {e}"));
        }
        let cfg = &self.cfg;
        let t = tokens.len();
        let pos0 = kv.len;
        assert!(pos0 + t <= kv.n_ctx, "KV cache overflow");
        let e = cfg.n_embd;
        // Embeddings.
        s.x.resize(t * e, 0.0);
        let emb = self.mat(&self.weights.tok_embd);
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = (tok as usize).min(cfg.n_vocab - 1);
            dequantize_row(emb.ty, emb.row(tok), &mut s.x[i * e..(i + 1) * e]).expect("embedding row");
        }
        self.rope_table(pos0, t, &mut s.rope);
        for (l, b) in self.weights.blocks.iter().enumerate() {
            self.attention(l, b, t, pos0, kv, s);
            self.ffn(l, b, t, pos0, s);
        }
        kv.len = pos0 + t;
        // Output.
        let rows: Vec<usize> = match which {
            Logits::Last => vec![t - 1],
            Logits::All => (0..t).collect(),
        };
        s.xn.resize(rows.len(), e);
        for (j, &i) in rows.iter().enumerate() {
            rms_norm(&s.x[i * e..(i + 1) * e], &self.weights.out_norm, cfg.rms_eps, &mut s.xn.f[j * e..(j + 1) * e]);
        }
        s.xn.quantize();
        let mut logits = vec![0f32; rows.len() * cfg.n_vocab];
        self.mm(self.mat(&self.weights.output), &s.xn, &mut logits);
        logits
    }

    fn mm(&self, w: MatRef<'_>, x: &Act, out: &mut [f32]) {
        matmul_with(&self.pool, w, x, out, self.precision)
    }

    /// RoPE angles of positions `pos0 .. pos0 + t`: `t × n_rot/2` (cos, sin) pairs.
    pub fn rope_table(&self, pos0: usize, t: usize, out: &mut Vec<(f32, f32)>) {
        let half = self.cfg.n_rot / 2;
        out.clear();
        let theta_scale = self.cfg.rope_freq_base.powf(-2.0 / self.cfg.n_rot as f32);
        for p in pos0..pos0 + t {
            let mut theta = p as f32 * self.cfg.rope_freq_scale;
            for _ in 0..half {
                out.push((theta.cos(), theta.sin()));
                theta *= theta_scale;
            }
        }
    }

    fn attention(&self, l: usize, b: &Block, t: usize, pos0: usize, kv: &mut KvCache, s: &mut Scratch) {
        let cfg = &self.cfg;
        let (e, hd) = (cfg.n_embd, cfg.head_dim);
        let (nh, nkv) = (cfg.n_head, cfg.n_head_kv);
        let (qd, kvd) = (nh * hd, nkv * hd);
        s.xn.resize(t, e);
        for i in 0..t {
            rms_norm(&s.x[i * e..(i + 1) * e], &b.attn_norm, cfg.rms_eps, &mut s.xn.f[i * e..(i + 1) * e]);
        }
        s.xn.quantize();
        s.q.resize(t * qd, 0.0);
        s.k.resize(t * kvd, 0.0);
        s.v.resize(t * kvd, 0.0);
        self.mm(self.mat(&b.q), &s.xn, &mut s.q);
        self.mm(self.mat(&b.k), &s.xn, &mut s.k);
        self.mm(self.mat(&b.v), &s.xn, &mut s.v);
        for (y, bias) in [(&mut s.q, &b.bias.q), (&mut s.k, &b.bias.k), (&mut s.v, &b.bias.v)] {
            if let Some(bias) = bias {
                add_rows(y, bias);
            }
        }
        // q/k RMSNorm: per head (`head_dim` weights) or over the whole projection of a token
        for (y, w) in [(&mut s.q, &b.q_norm), (&mut s.k, &b.k_norm)] {
            if let Some(w) = w {
                for row in y.chunks_exact_mut(w.len()) {
                    rms_norm_in_place(row, w, cfg.rms_eps);
                }
            }
        }
        let half = cfg.n_rot / 2;
        let rot: fn(&mut [f32], &[(f32, f32)]) = match cfg.spec.def.rope {
            RopeKind::Normal => rope,
            RopeKind::Neox => rope_neox,
        };
        for i in 0..t {
            let cs = &s.rope[i * half..(i + 1) * half];
            for h in 0..nh {
                rot(&mut s.q[i * qd + h * hd..i * qd + (h + 1) * hd], cs);
            }
            for h in 0..nkv {
                rot(&mut s.k[i * kvd + h * hd..i * kvd + (h + 1) * hd], cs);
            }
            kv.store(l, pos0 + i, &s.k[i * kvd..(i + 1) * kvd], &s.v[i * kvd..(i + 1) * kvd]);
        }
        // Queries (and below, attention probabilities) are rounded to f16 as
        // llama.cpp does for its F16 KV cache; the F32 reference skips it.
        let r16 = self.precision != Precision::F32;
        if r16 {
            for v in s.q.iter_mut() {
                *v = half::f16::from_f32(*v).to_f32();
            }
        }
        let n_all = pos0 + t;
        let keys = kv.keys(l, n_all);
        let vals = kv.values(l, n_all);
        s.attn.resize(t, qd);
        let scale = 1.0 / (hd as f32).sqrt();
        let group = nh / nkv;
        let q = &s.q;
        let out_ptr = SyncPtr(s.attn.f.as_mut_ptr());
        let r16_ = r16;
        let head = |idx: usize| {
            let (i, h) = (idx / nh, idx % nh);
            // SAFETY: task `idx` writes only attn[idx*hd .. (idx+1)*hd], inside the t*qd buffer
            // (idx < t*nh); tasks are disjoint and the buffer outlives `run`.
            let out = unsafe { std::slice::from_raw_parts_mut({ out_ptr }.0.add(idx * hd), hd) };
            let kh = h / group;
            let qv = &q[i * qd + h * hd..i * qd + (h + 1) * hd];
            let n = pos0 + i + 1; // causal: positions 0..=pos0+i
            let mut scores = Vec::with_capacity(n);
            let mut mx = f32::NEG_INFINITY;
            for p in 0..n {
                let kvec = &keys[p * kvd + kh * hd..p * kvd + (kh + 1) * hd];
                let d = dot_f32(qv, kvec) * scale;
                mx = mx.max(d);
                scores.push(d);
            }
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - mx).exp();
                sum += *sc;
            }
            let inv = 1.0 / sum;
            out.fill(0.0);
            for (p, &w) in scores.iter().enumerate() {
                let vv = &vals[p * kvd + kh * hd..p * kvd + (kh + 1) * hd];
                // Probabilities are rounded to f16 as llama.cpp does before its KQ·V product
                // over the F16 cache.
                let w = if r16_ { half::f16::from_f32(w * inv).to_f32() } else { w * inv };
                for (o, x) in out.iter_mut().zip(vv) {
                    *o += w * x;
                }
            }
        };
        self.pool.run(t * nh, head);
        s.attn.quantize();
        s.tmp.resize(t * e, 0.0);
        self.mm(self.mat(&b.o), &s.attn, &mut s.tmp);
        if let Some(bias) = &b.bias.o {
            add_rows(&mut s.tmp, bias);
        }
        for (x, d) in s.x.iter_mut().zip(&s.tmp) {
            *x += d;
        }
    }

    fn ffn(&self, l: usize, b: &Block, t: usize, pos0: usize, s: &mut Scratch) {
        let cfg = &self.cfg;
        let e = cfg.n_embd;
        s.xn.resize(t, e);
        for i in 0..t {
            rms_norm(&s.x[i * e..(i + 1) * e], &b.ffn_norm, cfg.rms_eps, &mut s.xn.f[i * e..(i + 1) * e]);
        }
        s.xn.quantize();
        match &b.ffn {
            Ffn::Dense { gate, up, down } => {
                self.dense_ffn(gate, up, down, s);
                for (x, d) in s.x.iter_mut().zip(&s.tmp) {
                    *x += d;
                }
            }
            Ffn::Moe(ex) => self.moe(l, ex, t, pos0, s),
        }
    }

    /// A dense SwiGLU FFN of the normalized, quantized activations `s.xn` into `s.tmp` (`t × n_embd`):
    /// `down(silu(gate x) · up x)`.
    fn dense_ffn(&self, gate: &Weight, up: &Weight, down: &Weight, s: &mut Scratch) {
        let (t, e) = (s.xn.t, self.cfg.n_embd);
        let ff = gate.rows;
        s.gate.resize(t * ff, 0.0);
        s.up.resize(t * ff, 0.0);
        self.mm(self.mat(gate), &s.xn, &mut s.gate);
        self.mm(self.mat(up), &s.xn, &mut s.up);
        s.h.resize(t, ff);
        for ((h, g), u) in s.h.f.iter_mut().zip(&s.gate).zip(&s.up) {
            *h = silu(*g) * u;
        }
        s.h.quantize();
        s.tmp.resize(t * e, 0.0);
        self.mm(self.mat(down), &s.h, &mut s.tmp);
    }

    /// Adds the shared expert's gated output to `s.moe_acc` (`t × n_embd`): per token,
    /// `acc += sigmoid(gate_inp · xn) · ffn_shexp(xn)`.
    fn shared_expert(&self, sh: &SharedExpert, s: &mut Scratch) {
        let e = self.cfg.n_embd;
        self.dense_ffn(&sh.gate, &sh.up, &sh.down, s);
        for i in 0..s.xn.t {
            let g = sigmoid(dot_f32(&sh.gate_inp, s.xn.row(i)));
            for (a, y) in s.moe_acc[i * e..(i + 1) * e].iter_mut().zip(&s.tmp[i * e..(i + 1) * e]) {
                *a += y * g;
            }
        }
    }

    /// Router: probabilities over the experts (softmax or sigmoid, as the architecture says), top-k, the
    /// top-k weights renormalised to sum 1 when the architecture does so (their sum clamped at 2^-14, as
    /// llama.cpp does), times its expert weight scale. `router_logits` is `t × n_expert`. Returns per token `k`
    /// pairs `(expert, weight)` in rank order (ties: lower expert id first).
    pub fn route(&self, router_logits: &[f32], t: usize) -> Vec<Vec<(usize, f32)>> {
        let ne = self.cfg.n_expert;
        let k = self.cfg.n_expert_used;
        let def = self.cfg.spec.def;
        (0..t)
            .map(|i| {
                let lg = &router_logits[i * ne..(i + 1) * ne];
                let mut p: Vec<(usize, f32)> = match def.gating {
                    Gating::Softmax => {
                        let mx = lg.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        let mut p: Vec<(usize, f32)> =
                            lg.iter().enumerate().map(|(j, &v)| (j, (v - mx).exp())).collect();
                        let sum: f32 = p.iter().map(|x| x.1).sum();
                        for x in p.iter_mut() {
                            x.1 /= sum;
                        }
                        p
                    }
                    Gating::Sigmoid => lg.iter().enumerate().map(|(j, &v)| (j, sigmoid(v))).collect(),
                };
                p.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0)));
                p.truncate(k);
                if def.norm_topk {
                    let s: f32 = p.iter().map(|x| x.1).sum::<f32>().max(6.103515625e-5);
                    for x in p.iter_mut() {
                        x.1 /= s;
                    }
                }
                if def.expert_weights_scale != 1.0 {
                    for x in p.iter_mut() {
                        x.1 *= def.expert_weights_scale;
                    }
                }
                p
            })
            .collect()
    }

    fn moe(&self, layer: usize, ex: &ExpertWeights, t: usize, pos0: usize, s: &mut Scratch) {
        let ne = self.cfg.n_expert;
        let mut rl = std::mem::take(&mut s.router);
        rl.resize(t * ne, 0.0);
        self.mm(self.mat(&ex.router), &s.xn, &mut rl);
        let routes = self.route(&rl, t);
        s.router = rl;
        self.record_routes(layer, pos0, &routes, s);
        let by_expert = self.by_expert(&routes);
        let src = self.plan_sources(layer, &by_expert, s.decode);
        self.experts_cpu(layer, ex, &by_expert, src, None, s, |_| {});
        if let Some(sh) = &ex.shared {
            self.shared_expert(sh, s);
        }
        for (xv, a) in s.x.iter_mut().zip(&s.moe_acc) {
            *xv += a;
        }
    }

    /// Appends the routing of a chunk to the scratch's record (when recording).
    pub(crate) fn record_routes(&self, layer: usize, pos0: usize, routes: &[Vec<(usize, f32)>], s: &mut Scratch) {
        if let Some(rec) = s.routes.as_mut() {
            for (i, r) in routes.iter().enumerate() {
                rec.push(RouteRecord { pos: pos0 + i, layer, experts: r.clone() });
            }
        }
    }

    /// Groups routing entries by expert: `out[e]` = `(token, weight)` of every entry routed to `e`.
    pub(crate) fn by_expert(&self, routes: &[Vec<(usize, f32)>]) -> Vec<Vec<(usize, f32)>> {
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.cfg.n_expert];
        for (i, r) in routes.iter().enumerate() {
            for &(x, w) in r {
                by_expert[x].push((i, w));
            }
        }
        by_expert
    }

    /// Where each routed expert's bytes are (per expert; unrouted ones `Mapped`): a VRAM slot, the RAM copy, a
    /// blob read from the file, or the mapping. Counts the lookups in the store's counters.
    pub(crate) fn plan_sources(&self, layer: usize, by_expert: &[Vec<(usize, f32)>], decode: bool) -> Vec<Source> {
        let ne = self.cfg.n_expert;
        let mut src = vec![Source::Mapped; ne];
        if let Some(st) = self.experts.as_ref() {
            let distinct: Vec<usize> = (0..ne).filter(|&x| !by_expert[x].is_empty()).collect();
            let entries: Vec<u32> = distinct.iter().map(|&x| by_expert[x].len() as u32).collect();
            for (&x, so) in distinct.iter().zip(st.plan_layer(layer, &distinct, &entries, decode)) {
                src[x] = so;
            }
        }
        src
    }

    /// Computes on the CPU pool the experts in `by_expert` (skipping empty entries) from `src` into
    /// `s.moe_acc` (`t × n_embd`, zeroed first): `acc[i] = Σ_e w · expert_e(xn_i)`. `s.xn` must hold the
    /// normalized, quantized activations. File-tier blobs of the layer are read together first.
    /// `from[x]` (when given): expert x's intermediate rows `from[x] .. n_ff_exp` only (a multiple of 32; the
    /// rest is computed elsewhere and added to the same output) — gate/up rows and the matching block range of
    /// every down row. `side` runs once on the calling thread while the pool works on the first experts (or
    /// before the file reads; at once when there is nothing to compute): work of the caller's that should not
    /// delay the CPU experts, such as a hybrid layer's GPU copies and launches. It gets the RAM copy when this
    /// function holds its read lock (the lock is not re-entrant), `None` when it does not.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn experts_cpu(
        &self,
        layer: usize,
        ex: &ExpertWeights,
        by_expert: &[Vec<(usize, f32)>],
        mut src: Vec<Source>,
        from: Option<&[usize]>,
        s: &mut Scratch,
        side: impl FnOnce(Option<&HostArena>),
    ) {
        let mut side = Some(side);
        let cfg = &self.cfg;
        let (e, ne, ff) = (cfg.n_embd, cfg.n_expert, cfg.n_ff_exp);
        let t = s.xn.t;
        let (gate_all, up_all, down_all) = (self.mat(&ex.gate), self.mat(&ex.up), self.mat(&ex.down));
        let gb = ff * gate_all.row_bytes();
        let db = e * down_all.row_bytes();
        let mut blob_at = vec![0usize; ne];
        let arena = self.experts.as_ref().map(|st| {
            // this layer's file-tier blobs, read together over the worker pool before any expert is computed
            let files: Vec<usize> = (0..ne).filter(|&x| !by_expert[x].is_empty() && src[x] == Source::File).collect();
            if !files.is_empty() {
                if let Some(f) = side.take() {
                    f(None);
                }
            }
            let blob = 2 * gb + db;
            let ok = st.read_blobs(layer, &files, &mut s.blobs, &self.pool);
            for (j, (&x, ok)) in files.iter().zip(ok).enumerate() {
                blob_at[x] = j * blob;
                if !ok {
                    src[x] = Source::Mapped; // the mapping still has the bytes
                }
            }
            st.arena()
        });
        let mut acc = std::mem::take(&mut s.moe_acc);
        acc.clear();
        acc.resize(t * e, 0.0);
        let mut subs = std::mem::take(&mut s.subs);
        let mut hs = std::mem::take(&mut s.hs);
        let blobs = std::mem::take(&mut s.blobs);
        // the layer's experts with tokens, in batches whose scratch (gate, up and h rows, the tokens' activations
        // and down outputs) stays under BATCH_FLOATS values: each batch is one pool fork-join for gate, up,
        // SwiGLU and down (not three per expert)
        const BATCH_FLOATS: usize = 1 << 22;
        let list: Vec<usize> = (0..ne).filter(|&x| !by_expert[x].is_empty()).collect();
        let f0 = |x: usize| from.map_or(0, |f| f[x]);
        let (grb, drb) = (gate_all.row_bytes(), down_all.row_bytes());
        let mut i = 0;
        while i < list.len() {
            let mut j = i;
            let (mut floats, mut gu) = (0, 0);
            while j < list.len() {
                let x = list[j];
                let add = by_expert[x].len() * (3 * (ff - f0(x)) + 2 * e);
                if j > i && floats + add > BATCH_FLOATS {
                    break;
                }
                floats += add;
                gu += by_expert[x].len() * (ff - f0(x));
                j += 1;
            }
            let batch = &list[i..j];
            i = j;
            // each expert's tokens
            subs.resize_with(batch.len(), Act::default);
            for (sub, &x) in subs.iter_mut().zip(batch) {
                sub.t = by_expert[x].len();
                sub.n = e;
                sub.f.clear();
                sub.q.clear();
                for &(ti, _) in &by_expert[x] {
                    sub.f.extend_from_slice(s.xn.row(ti));
                    sub.q.extend_from_slice(s.xn.qrow(ti));
                }
            }
            // each expert's bytes: intermediate rows f0..ff (all of them unless split with the GPU)
            let views: Vec<(MatRef, MatRef, MatRef)> = batch
                .iter()
                .map(|&x| {
                    let (gd, ud, dd): (&[u8], &[u8], &[u8]) = match (src[x], &arena) {
                        (Source::Ram(off), Some(a)) => {
                            let b = a.slice(off, 2 * gb + db);
                            (&b[..gb], &b[gb..2 * gb], &b[2 * gb..])
                        }
                        (Source::File, _) => {
                            let b = &blobs[blob_at[x]..blob_at[x] + 2 * gb + db];
                            (&b[..gb], &b[gb..2 * gb], &b[2 * gb..])
                        }
                        _ => (
                            &gate_all.data[x * gb..(x + 1) * gb],
                            &up_all.data[x * gb..(x + 1) * gb],
                            &down_all.data[x * db..(x + 1) * db],
                        ),
                    };
                    let (f0, fr) = (f0(x), ff - f0(x));
                    let d0 = down_all.ty.row_bytes(f0);
                    (
                        MatRef { data: &gd[f0 * grb..], ty: gate_all.ty, rows: fr, cols: e, stride: 0 },
                        MatRef { data: &ud[f0 * grb..], ty: up_all.ty, rows: fr, cols: e, stride: 0 },
                        MatRef { data: &dd[d0..], ty: down_all.ty, rows: e, cols: fr, stride: drb },
                    )
                })
                .collect();
            // gate, up, SwiGLU (quantized) and down of the whole batch in one fork-join (each expert's down tasks
            // start when its own gate/up tasks are done); the caller's side work (e.g. the GPU's launches of a
            // hybrid layer) runs beside it
            s.gate.resize(gu, 0.0);
            s.up.resize(gu, 0.0);
            hs.resize_with(batch.len(), Act::default);
            let outs: usize = subs[..batch.len()].iter().map(|a| a.t * e).sum();
            s.tmp.resize(outs, 0.0);
            {
                let mut jobs = Vec::with_capacity(batch.len());
                let (mut g_rest, mut u_rest) = (&mut s.gate[..], &mut s.up[..]);
                let mut o_rest = &mut s.tmp[..];
                for ((v, x), h) in views.iter().zip(&subs).zip(hs.iter_mut()) {
                    let n = x.t * v.0.rows;
                    let (g, gr) = std::mem::take(&mut g_rest).split_at_mut(n);
                    let (u, ur) = std::mem::take(&mut u_rest).split_at_mut(n);
                    let (out, or) = std::mem::take(&mut o_rest).split_at_mut(x.t * e);
                    g_rest = gr;
                    u_rest = ur;
                    o_rest = or;
                    jobs.push(ExpertJob { glu: GluJob { gate: v.0, up: v.1, x, g, u, h }, down: v.2, out });
                }
                let side = side.take();
                experts_batch(&self.pool, &mut jobs, self.precision, || {
                    side.into_iter().for_each(|f| f(arena.as_deref()))
                });
            }
            // weighted sum into the tokens' rows, expert by expert in id order
            let mut off = 0;
            for &x in batch {
                for (jj, &(ti, w)) in by_expert[x].iter().enumerate() {
                    let y = &s.tmp[off + jj * e..off + (jj + 1) * e];
                    for (a, v) in acc[ti * e..(ti + 1) * e].iter_mut().zip(y) {
                        *a += w * v;
                    }
                }
                off += by_expert[x].len() * e;
            }
        }
        if let Some(f) = side.take() {
            f(arena.as_deref()); // no expert for the CPU
        }
        drop(arena);
        s.blobs = blobs;
        s.moe_acc = acc;
        s.subs = subs;
        s.hs = hs;
    }
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) * w` (sum of squares in f64).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let scale = rms_scale(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// `1 / sqrt(mean(x²) + eps)`, the sum of squares in f64 (llama.cpp's `ggml_float` sum).
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()
}

/// RMSNorm of `x` in place (the arithmetic of [`rms_norm`]).
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = rms_scale(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// Adds `bias` (one row) to every row of `y` (`rows × bias.len()`).
fn add_rows(y: &mut [f32], bias: &[f32]) {
    for row in y.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Rotates adjacent pairs `(x[2i], x[2i+1])` by the angles in `cs` (cos, sin) (`RopeKind::Normal`).
fn rope(x: &mut [f32], cs: &[(f32, f32)]) {
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

/// Rotates the pairs `(x[i], x[i + n])`, `n = cs.len()`, by the angles in `cs` (`RopeKind::Neox`: the first
/// `2n` dimensions of the head split in halves; the rest unrotated).
fn rope_neox(x: &mut [f32], cs: &[(f32, f32)]) {
    let n = cs.len();
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = (x[i], x[i + n]);
        x[i] = a * c - b * s;
        x[i + n] = a * s + b * c;
    }
}

/// Dot product with eight independent partial sums (vectorizes; the head
/// dimension is a multiple of 8 for every supported model, a tail is handled).
#[inline]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let tail: f32 = a[n8..].iter().zip(&b[n8..]).map(|(x, y)| x * y).sum();
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]) + tail
}
