//! The CPU backend: the operations of a forward pass over the worker pool ([`crate::pool`]), on the quantized
//! kernels of [`crate::quant`]. K/V live in a host [`KvCache`] (f16 rows as llama.cpp's F16 cache, f32 rows for
//! the f32 reference arithmetic; attention in [`attention`]); activations are quantized once per product input to 8-bit
//! blocks for the integer dot products ([`Precision`]).

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_x86;
mod exp;
pub mod experts;
pub mod math;
pub mod matmul;

pub use matmul::*;

use math::{add_rows, dot_f32, rms_norm, rms_norm_in_place, rope, rope_neox};

use super::moe::{dispatch, router};
use super::{Backend, BackendError, Body, KvCache, Logits, ModelRef, Norm, Ops, Scratch};
use crate::arch::weights::{Ffn, Weight};
use crate::arch::RopeKind;
use crate::quant::dequantize_row;

/// The CPU backend. It keeps nothing between passes: the weights are read in place from the mapped file, the
/// KV cache and scratch are the caller's.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn new_kv(&self, m: &ModelRef<'_>, n_ctx: usize) -> KvCache {
        // the --kv-type's rows (f16 by default, llama.cpp's F16 cache); f32 rows when the exact f32 reference runs
        let kv_dim = m.cfg.n_head_kv * m.cfg.head_dim;
        if m.precision == Precision::F32 {
            return KvCache::with_f16(m.cfg.n_layer, n_ctx, kv_dim, false);
        }
        KvCache::with_type(m.cfg.n_layer, n_ctx, kv_dim, m.kv_type)
    }

    fn forward(
        &self,
        m: &ModelRef<'_>,
        tokens: &[u32],
        kv: &mut KvCache,
        which: Logits,
        s: &mut Scratch,
        body: &mut Body<'_>,
    ) -> Result<Vec<f32>, BackendError> {
        let cfg = m.cfg;
        let t = tokens.len();
        let pos0 = kv.len;
        assert!(pos0 + t <= kv.n_ctx, "KV cache overflow");
        let e = cfg.n_embd;
        s.x.resize(t * e, 0.0);
        let emb = m.mat(&m.weights.tok_embd);
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = (tok as usize).min(cfg.n_vocab - 1);
            dequantize_row(emb.ty, emb.row(tok), &mut s.x[i * e..(i + 1) * e]).expect("embedding row");
        }
        if cfg.spec.def.embd_scale {
            let k = (e as f32).sqrt();
            s.x.iter_mut().for_each(|v| *v *= k);
        }
        // the activations the K-quant products read, only for a model that has them
        let k = m.weights.q8k_activations;
        (s.xn.with_q8k, s.attn.with_q8k, s.h.with_q8k) = (k, k, k);
        super::rope_angles(cfg, pos0, t, &mut s.rope);
        if (0..cfg.n_layer).any(|l| cfg.is_swa(l)) {
            super::rope_angles_swa(cfg, pos0, t, &mut s.rope_swa);
        }
        let rows = which.rows(t);
        let mut pass = CpuPass { m, kv, s, t, pos0, logits: Vec::new() };
        body(&mut pass, rows)?;
        let logits = std::mem::take(&mut pass.logits);
        kv.len = pos0 + t;
        Ok(logits)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// One CPU pass over `t` tokens at `pos0`.
struct CpuPass<'p, 'm> {
    m: &'p ModelRef<'m>,
    kv: &'p mut KvCache,
    s: &'p mut Scratch,
    t: usize,
    pos0: usize,
    logits: Vec<f32>,
}

/// `f` over rows `0 .. t`: split over the pool for a prompt's rows, on the calling thread for a few (decode).
fn rows_on(pool: &crate::pool::WorkerPool, t: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if t >= 2 * pool.threads() {
        par_rows(pool, t, f);
    } else {
        f(0..t);
    }
}

/// `out = w · x` on the pool in the model's arithmetic.
fn mm(m: &ModelRef<'_>, w: &Weight, x: &Act, out: &mut [f32]) {
    matmul_with(m.pool, m.mat(w), x, out, m.precision)
}

impl CpuPass<'_, '_> {
    /// Next-layer prediction (recorded in the routing dump): layer `l + 1`'s router applied to the hidden state
    /// after layer `l`'s attention, normalised with layer `l + 1`'s `ffn_norm` — what a prefetcher could know
    /// while layer `l`'s experts run. One small product (`n_expert × n_embd` per token); nothing when the next
    /// layer is not an MoE layer or this is the last.
    fn predict_next(&mut self, l: usize) {
        let m = self.m;
        let Some(next) = m.weights.blocks.get(l + 1) else { return };
        let Ffn::Moe(ex) = &next.ffn else { return };
        let e = m.cfg.n_embd;
        let s = &mut *self.s;
        s.xp.resize(self.t, e);
        for i in 0..self.t {
            rms_norm(&s.x[i * e..(i + 1) * e], &next.ffn_norm, m.cfg.rms_eps, &mut s.xp.f[i * e..(i + 1) * e]);
        }
        s.xp.with_q8k = s.xn.with_q8k;
        s.xp.quantize();
        let mut logits = vec![0f32; self.t * m.cfg.n_expert];
        mm(m, &ex.router, &s.xp, &mut logits);
        if let Some(b) = &ex.router_bias {
            add_rows(&mut logits, b);
        }
        let pred = router::top_k(m.cfg, &logits, self.t);
        s.predict_next(l + 1, pred.into_iter().map(|r| r.into_iter().map(|(e, _)| e).collect()).collect());
    }

    /// Fails the pass when the hidden state holds a non-finite value after `tensor`'s op of layer `l` (one pass
    /// over `t × n_embd` values: cheap beside the op's own products).
    fn check_x(&self, l: usize, tensor: &'static str) -> Result<(), BackendError> {
        if self.s.x.iter().all(|v| v.is_finite()) {
            Ok(())
        } else {
            Err(BackendError::NonFinite { layer: Some(l), tensor })
        }
    }

    /// `xn = rms_norm(x rows row0 .. row0 + rows) · w`, quantized.
    fn norm_rows(&mut self, w: &[f32], row0: usize, rows: usize) {
        let e = self.m.cfg.n_embd;
        let (pool, eps) = (self.m.pool, self.m.cfg.rms_eps);
        let s = &mut *self.s;
        s.xn.resize(rows, e);
        let (x, out) = (&s.x, SyncPtr(s.xn.f.as_mut_ptr()));
        rows_on(pool, rows, |js| {
            for j in js {
                let i = row0 + j;
                // SAFETY: row j of xn (rows · e values, sized above), written by this task alone (the tasks' row
                // ranges are disjoint).
                let o = unsafe { std::slice::from_raw_parts_mut({ out }.0.add(j * e), e) };
                rms_norm(&x[i * e..(i + 1) * e], w, eps, o);
            }
        });
        s.xn.quantize_on(pool);
    }

    /// A dense gated FFN of the normalized, quantized activations `s.xn` into `s.tmp` (`t × n_embd`):
    /// `down(act(gate x) · up x)`, `act` the architecture's (SiLU or tanh GELU).
    fn dense_ffn(&mut self, gate: &Weight, up: &Weight, down: &Weight) {
        let (t, e) = (self.s.xn.t, self.m.cfg.n_embd);
        let ff = gate.rows;
        let (m, s) = (self.m, &mut *self.s);
        s.gate.resize(t * ff, 0.0);
        s.up.resize(t * ff, 0.0);
        mm(m, gate, &s.xn, &mut s.gate);
        mm(m, up, &s.xn, &mut s.up);
        s.h.resize(t, ff);
        let act = GluAct::of(m.cfg.spec.def.act, m.precision);
        let (g, u, h) = (&s.gate, &s.up, SyncPtr(s.h.f.as_mut_ptr()));
        rows_on(m.pool, t, |rs| {
            let at = rs.start * ff..rs.end * ff;
            // SAFETY: rows rs of h (t · ff values, sized above), written by this task alone (disjoint ranges).
            let o = unsafe { std::slice::from_raw_parts_mut({ h }.0.add(at.start), at.len()) };
            act.apply(&g[at.clone()], &u[at], None, o);
        });
        s.h.quantize_on(m.pool);
        s.tmp.resize(t * e, 0.0);
        mm(m, down, &s.h, &mut s.tmp);
    }
}

impl Ops for CpuPass<'_, '_> {
    fn segment(
        &mut self,
        _layer: usize,
        ops: &mut dyn FnMut(&mut dyn Ops) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        ops(self)
    }

    fn norm(&mut self, which: Norm) -> Result<(), BackendError> {
        let m = self.m;
        let w = match which {
            Norm::Attn(l) => &m.weights.blocks[l].attn_norm,
            Norm::Ffn(l) => &m.weights.blocks[l].ffn_norm,
        };
        self.norm_rows(w, 0, self.t);
        Ok(())
    }

    fn qkv(&mut self, l: usize) -> Result<(), BackendError> {
        let (m, t) = (self.m, self.t);
        let cfg = m.cfg;
        let b = &m.weights.blocks[l];
        let (qd, kvd) = (cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim);
        let s = &mut *self.s;
        s.q.resize(t * qd, 0.0);
        s.k.resize(t * kvd, 0.0);
        s.v.resize(t * kvd, 0.0);
        mm(m, &b.q, &s.xn, &mut s.q);
        mm(m, &b.k, &s.xn, &mut s.k);
        mm(m, &b.v, &s.xn, &mut s.v);
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
        Ok(())
    }

    fn rope_store(&mut self, l: usize) -> Result<(), BackendError> {
        let cfg = self.m.cfg;
        let hd = cfg.head_dim;
        let (nh, nkv) = (cfg.n_head, cfg.n_head_kv);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let half = cfg.n_rot / 2;
        let rot: fn(&mut [f32], &[(f32, f32)]) = match cfg.spec.def.rope {
            RopeKind::Normal => rope,
            RopeKind::Neox => rope_neox,
        };
        let s = &mut *self.s;
        let table = if cfg.is_swa(l) { &s.rope_swa } else { &s.rope };
        for i in 0..self.t {
            let cs = &table[i * half..(i + 1) * half];
            for h in 0..nh {
                rot(&mut s.q[i * qd + h * hd..i * qd + (h + 1) * hd], cs);
            }
            for h in 0..nkv {
                rot(&mut s.k[i * kvd + h * hd..i * kvd + (h + 1) * hd], cs);
            }
            self.kv.store(l, self.pos0 + i, &s.k[i * kvd..(i + 1) * kvd], &s.v[i * kvd..(i + 1) * kvd]);
        }
        Ok(())
    }

    fn attention(&mut self, l: usize) -> Result<(), BackendError> {
        let cfg = self.m.cfg;
        let (t, pos0) = (self.t, self.pos0);
        let n_all = pos0 + t;
        let s = &mut *self.s;
        s.attn.resize(t, cfg.n_head * cfg.head_dim);
        let heads = attention::Heads { n_head: cfg.n_head, n_head_kv: cfg.n_head_kv, head_dim: cfg.head_dim };
        let window = if cfg.is_swa(l) { cfg.sliding_window } else { 0 };
        let (keys, values) = (self.kv.keys(l, n_all), self.kv.values(l, n_all));
        let sinks = self.m.weights.blocks[l].attn_sinks.as_deref();
        let (span, scale) = ((pos0, t), cfg.attn_scale);
        attention::attend(self.m.pool, &mut s.q, keys, values, heads, span, scale, window, sinks, &mut s.attn.f);
        s.attn.quantize_on(self.m.pool);
        Ok(())
    }

    fn attn_output(&mut self, l: usize) -> Result<(), BackendError> {
        let m = self.m;
        let b = &m.weights.blocks[l];
        let s = &mut *self.s;
        s.tmp.resize(self.t * m.cfg.n_embd, 0.0);
        mm(m, &b.o, &s.attn, &mut s.tmp);
        if let Some(bias) = &b.bias.o {
            add_rows(&mut s.tmp, bias);
        }
        if let Some(w) = &b.post_attn_norm {
            for row in s.tmp.chunks_exact_mut(m.cfg.n_embd) {
                rms_norm_in_place(row, w, m.cfg.rms_eps);
            }
        }
        for (x, d) in s.x.iter_mut().zip(&s.tmp) {
            *x += d;
        }
        self.check_x(l, "attn_output")
    }

    fn ffn(&mut self, l: usize) -> Result<(), BackendError> {
        let m = self.m;
        let b = &m.weights.blocks[l];
        let Ffn::Dense { gate, up, down } = &b.ffn else { unreachable!("ffn() on an MoE block") };
        self.dense_ffn(gate, up, down);
        let s = &mut *self.s;
        if let Some(w) = &b.post_ffn_norm {
            for row in s.tmp.chunks_exact_mut(m.cfg.n_embd) {
                rms_norm_in_place(row, w, m.cfg.rms_eps);
            }
        }
        for (x, d) in s.x.iter_mut().zip(&s.tmp) {
            *x += d;
        }
        self.check_x(l, "ffn_down")
    }

    fn route(&mut self, l: usize) -> Result<(), BackendError> {
        let m = self.m;
        let Ffn::Moe(ex) = &m.weights.blocks[l].ffn else { unreachable!("route() on a dense block") };
        let s = &mut *self.s;
        s.router.resize(self.t * m.cfg.n_expert, 0.0);
        mm(m, &ex.router, &s.xn, &mut s.router);
        if let Some(b) = &ex.router_bias {
            add_rows(&mut s.router, b);
        }
        if !s.router.iter().all(|v| v.is_finite()) {
            return Err(BackendError::NonFinite { layer: Some(l), tensor: "ffn_gate_inp" });
        }
        let routing = router::top_k(m.cfg, &s.router, self.t);
        s.record_routes(l, self.pos0, &routing);
        s.routing = routing;
        if s.routes.is_some() {
            self.predict_next(l);
        }
        Ok(())
    }

    fn shared_expert(&mut self, l: usize) -> Result<(), BackendError> {
        let Ffn::Moe(ex) = &self.m.weights.blocks[l].ffn else { unreachable!("shared_expert() on a dense block") };
        let Some(sh) = &ex.shared else { return Ok(()) };
        self.dense_ffn(&sh.gate, &sh.up, &sh.down);
        let s = &mut *self.s;
        std::mem::swap(&mut s.sh, &mut s.tmp);
        s.sh_gate.clear();
        s.sh_gate.extend((0..s.xn.t).map(|i| router::sigmoid(dot_f32(&sh.gate_inp, s.xn.row(i)))));
        Ok(())
    }

    fn experts(&mut self, l: usize) -> Result<(), BackendError> {
        let m = self.m;
        let e = m.cfg.n_embd;
        let Ffn::Moe(ex) = &m.weights.blocks[l].ffn else { unreachable!("experts() on a dense block") };
        let by_expert = dispatch::by_expert(&self.s.routing, m.cfg.n_expert);
        let src = dispatch::plan_sources(m.experts.map(|st| &**st), l, &self.s.routing, &by_expert, self.s.decode);
        if let Err(e) = experts::experts(m, l, ex, &by_expert, src, None, self.s, |_| {}) {
            self.s.sh_gate.clear(); // the shared expert's gates of this failed layer
            return Err(e);
        }
        let s = &mut *self.s;
        // the shared expert's gated output (when this layer computed one), after the routed experts' sum
        for (i, g) in s.sh_gate.drain(..).enumerate() {
            for (a, y) in s.moe_acc[i * e..(i + 1) * e].iter_mut().zip(&s.sh[i * e..(i + 1) * e]) {
                *a += y * g;
            }
        }
        for (xv, a) in s.x.iter_mut().zip(&s.moe_acc) {
            *xv += a;
        }
        self.check_x(l, "ffn_down_exps")
    }

    fn output(&mut self, row0: usize, rows: usize) -> Result<(), BackendError> {
        let m = self.m;
        self.norm_rows(&m.weights.out_norm, row0, rows);
        let mut logits = vec![0f32; rows * m.cfg.n_vocab];
        mm(m, &m.weights.output, &self.s.xn, &mut logits);
        self.logits = logits;
        Ok(())
    }
}
