//! One forward pass on the GPU: the backend interface's [`Ops`] as kernel launches on the model's stream.
//!
//! A MoE layer's combine (`Σ w·y` of the GPU's expert rows plus the CPU's sum) is not launched by itself: it is left
//! pending and done by the next RMSNorm (the next block's, or the output norm), one launch less per layer. In a hybrid
//! decode token each MoE block's [`Ops::segment`] (norm, attention, FFN norm, router, top-k, the next layer's
//! prediction when asked, and the routing's copy to the host) is recorded once per (layer, attention size class,
//! prediction) as a CUDA graph and replayed; [`super::model::Stage`] records a whole decode token the same way when no
//! layer needs the host.

use super::model::{GFfn, Host, Stage};
use super::ops::{Combine, KvPtrs, Ops as Launch, RopeStore};
use super::GpuError;
use crate::backend::{BackendError, ModelRef, Norm, Ops, Scratch};

/// The state of one chunk's pass.
pub(super) struct GpuPass<'p, 'm> {
    g: &'p Stage,
    m: &'p ModelRef<'m>,
    s: &'p mut Scratch,
    host: &'p mut Host,
    /// Tokens of the chunk and the position of the first.
    t: usize,
    pos0: usize,
    /// Positions attention's shared memory is sized for (≥ pos0 + t; a size class when graphs are recorded).
    cap: usize,
    /// Every MoE layer's experts are in VRAM: top-k builds the groups on the device, no host round trip.
    fast: bool,
    /// Hybrid decode token: MoE blocks' segments are recorded and replayed as graphs.
    segments: bool,
    /// The last MoE layer's combine, done by the next norm.
    pend: Option<Combine>,
    /// Inside a recorded segment: the routing's copy to the host goes into `staging`.
    in_segment: bool,
    /// The page-locked staging of the routing's copy to the host (set before a segment is recorded).
    staging: *mut u8,
    /// The current MoE layer's routing copy to the host is already enqueued (by its segment).
    routed: bool,
    /// The layer whose experts the current layer's routing also predicts ([`Stage::predicts`]); its ids follow
    /// the routing in the copy to the host.
    predict: Option<usize>,
}

impl<'p, 'm> GpuPass<'p, 'm> {
    /// A pass of `t` tokens at `pos0` with attention sized for `cap` positions (see the fields).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        g: &'p Stage,
        m: &'p ModelRef<'m>,
        s: &'p mut Scratch,
        host: &'p mut Host,
        (t, pos0, cap): (usize, usize, usize),
        fast: bool,
        segments: bool,
    ) -> Self {
        GpuPass {
            g,
            m,
            s,
            host,
            t,
            pos0,
            cap,
            fast,
            segments,
            pend: None,
            in_segment: false,
            staging: std::ptr::null_mut(),
            routed: false,
            predict: None,
        }
    }

    /// An all-VRAM pass of several tokens whose experts' tokens are grouped on the device (see
    /// [`Stage::group_prefill`]).
    fn grouped(&self) -> bool {
        self.fast && self.t > 1 && self.g.group_prefill
    }

    /// The kernels on the model's stream.
    fn launch(&self) -> Launch<'_> {
        Launch { k: &self.g.k, s: &self.g.s }
    }

    /// Records a timed event after `call`'s launches when the pass times its calls (`STRATA_GPU_TIMING=ops`: the
    /// pass's first mark is recorded at its start; a decode token, whose launches may be captured, has none).
    fn mark(&mut self, call: &'static str) -> Result<(), GpuError> {
        if !self.host.marks.is_empty() {
            let e = super::driver::Event::timed()?;
            e.record(&self.g.s)?;
            self.host.marks.push((call, e));
        }
        Ok(())
    }

    /// `r`, then a mark after `call` (see [`Self::mark`]).
    fn marked(&mut self, call: &'static str, r: Result<(), BackendError>) -> Result<(), BackendError> {
        r?;
        Ok(self.mark(call)?)
    }
}

/// The launches of each backend call (the [`Ops`] impl below marks the end of each when timing calls).
impl GpuPass<'_, '_> {
    fn enqueue_norm(&mut self, which: Norm) -> Result<(), BackendError> {
        let (g, c, t) = (self.g, self.m.cfg, self.t);
        let (b, e) = (&g.b, c.n_embd);
        let w = match which {
            Norm::Attn(l) => g.layer(l).attn_norm.ptr,
            Norm::Ffn(l) => g.layer(l).ffn_norm.ptr,
        };
        let pend = self.pend.take();
        Ok(self.launch().rms_norm_q8(b.x.ptr, w, c.rms_eps, e, t, b.xn.ptr, b.xq.ptr, pend)?)
    }

    fn enqueue_qkv(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, c, t) = (self.g, self.m.cfg, self.t);
        let (b, gl) = (&g.b, &g.layer(l));
        let (hd, nh, nkv) = (c.head_dim, c.n_head, c.n_head_kv);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let k = self.launch();
        // (the layer's biases and q/k norms run with RoPE: `enqueue_rope_store`)
        Ok(k.mmv(&[&gl.q, &gl.k, &gl.v], b.xq.ptr, b.xn.ptr, t, b.qkv.ptr, qd + 2 * kvd, false, b.part())?)
    }

    fn enqueue_rope_store(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, c, t) = (self.g, self.m.cfg, self.t);
        let b = &g.b;
        let kv = KvPtrs { k: g.kc[l - g.l0].ptr, v: g.vc[l - g.l0].ptr, q8: g.kv_q8 };
        let neox = c.spec.def.rope == crate::arch::RopeKind::Neox;
        let prep = g.layer(l).prep.as_ref().map(|pr| {
            let bias = pr.bias.as_ref().map_or(0, |d| d.ptr);
            let (qn, kn) = pr.norm.as_ref().map_or((0, 0), |(q, k)| (q.ptr, k.ptr));
            (bias, qn, kn, pr.mode, c.rms_eps)
        });
        let heads = (c.n_head, c.n_head_kv, c.head_dim);
        let r =
            RopeStore { qkv: b.qkv.ptr, cs: b.cs.at(8), heads, n_rot: c.n_rot, pos: b.cs.ptr, t, q: b.q.ptr, kv, neox };
        Ok(self.launch().prep_rope_store(&r, prep)?)
    }

    fn enqueue_attention(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, c, t, cap) = (self.g, self.m.cfg, self.t, self.cap);
        let b = &g.b;
        let kv = KvPtrs { k: g.kc[l - g.l0].ptr, v: g.vc[l - g.l0].ptr, q8: g.kv_q8 };
        let (hd, nh, nkv) = (c.head_dim, c.n_head, c.n_head_kv);
        let part = b.attn_part.as_ref().map(|p| p.ptr);
        let gl = g.layer(l);
        let ws = (gl.window, gl.sinks.as_ref().map_or(0, |d| d.ptr));
        Ok(self.launch().attention(b.q.ptr, kv, nh, nkv, hd, b.cs.ptr, cap, t, b.attn.ptr, b.attnq.ptr, part, ws)?)
    }

    fn enqueue_attn_output(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, t, e) = (self.g, self.t, self.m.cfg.n_embd);
        let b = &g.b;
        let k = self.launch();
        k.mmv(&[&g.layer(l).o], b.attnq.ptr, b.attn.ptr, t, b.x.ptr, e, true, b.part())?;
        if let Some(bias) = &g.layer(l).o_bias {
            k.add_bias(b.x.ptr, bias.ptr, e, t)?;
        }
        Ok(())
    }

    fn enqueue_ffn(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, t, e) = (self.g, self.t, self.m.cfg.n_embd);
        let b = &g.b;
        let GFfn::Dense { gate, up, down } = &g.layer(l).ffn else { unreachable!("ffn() on an MoE block") };
        let ff = gate.rows;
        let k = self.launch();
        k.mmv(&[gate, up], b.xq.ptr, b.xn.ptr, t, b.gu.ptr, 2 * ff, false, b.part())?;
        k.swiglu(b.gu.ptr, ff, t, b.h.ptr)?;
        k.quantize(b.h.ptr, b.hq.ptr, t * ff / 32)?;
        Ok(k.mmv(&[down], b.hq.ptr, b.h.ptr, t, b.x.ptr, e, true, b.part())?)
    }

    fn enqueue_route(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, c, t) = (self.g, self.m.cfg, self.t);
        let b = &g.b;
        let GFfn::Moe { router, bias, .. } = &g.layer(l).ffn else { unreachable!("route() on a dense block") };
        let bias = bias.as_ref();
        let (kk, ne) = (c.n_expert_used, c.n_expert);
        let n_pairs = t * kk;
        if self.fast {
            let cache = g.cache.as_ref().expect("all-VRAM passes have a cache");
            let table = cache.table.at(l * ne * 4);
            let win = if self.s.decode { b.win_ids.at(l * n_pairs * 4) } else { 0 };
            if self.grouped() {
                // several tokens: top-k, then each expert's tokens in groups of up to MAX_NT (on the device)
                let k = self.launch();
                g.route(&k, router, t, kk, None, win, bias)?;
                let tiles = b.tiles.ptr;
                return Ok(k.group_by_expert(
                    b.ids.ptr,
                    n_pairs,
                    kk,
                    ne,
                    table,
                    b.groups.ptr,
                    b.flag.ptr,
                    b.rank.ptr,
                    tiles,
                )?);
            }
            // top-k, groups from the residency table and (decode) the window's record, kept on the device and
            // read once after the window (no per-layer round trip)
            let fast_groups = (table, b.groups.ptr, b.flag.ptr);
            return Ok(g.route(&self.launch(), router, t, kk, Some(fast_groups), win, bias)?);
        }
        g.route(&self.launch(), router, t, kk, None, 0, bias)?;
        // the next layer's prediction reads the hidden state after this layer's attention: in the segment after
        // the routing's copy (a segment decided it when it began); else right after the router, before a shared
        // expert adds its output, with the copies in `hybrid_moe`
        if self.in_segment {
            g.segment_routing(&self.launch(), c, self.staging, t, self.predict)?;
            self.routed = true;
        } else {
            self.predict = g.predicts(self.m, l, t, self.s, self.host);
            if let Some(next) = self.predict {
                g.enqueue_prediction(&self.launch(), c, next)?;
            }
        }
        Ok(())
    }

    fn enqueue_shared_expert(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, t, e) = (self.g, self.t, self.m.cfg.n_embd);
        Ok(g.shared_expert(&self.launch(), g.layer(l), t, e)?)
    }

    fn enqueue_experts(&mut self, l: usize) -> Result<(), BackendError> {
        let (g, c, t) = (self.g, self.m.cfg, self.t);
        let b = &g.b;
        let GFfn::Moe { gate_ty, down_ty, down_off, ref bias, .. } = g.layer(l).ffn else {
            unreachable!("experts() on a dense block")
        };
        let bias = bias.as_ref();
        let (kk, ff, e) = (c.n_expert_used, c.n_ff_exp, c.n_embd);
        let n_pairs = t * kk;
        if self.fast {
            let down = (down_off, down_ty.row_bytes(ff));
            if self.grouped() {
                g.experts_grouped((gate_ty, down_ty), n_pairs, c.n_expert, ff, e, down, bias)?;
            } else {
                // decode windows: one entry per group, so at most one token per group
                g.experts_gpu((gate_ty, down_ty), true, b.groups.ptr, n_pairs, n_pairs, ff, down, e, bias)?;
            }
            self.pend = Some(Combine { y: b.y.ptr, w: b.w.ptr, flag: b.flag.ptr, cpu: 0, k: kk });
            return Ok(());
        }
        let routed = (std::mem::take(&mut self.routed), self.predict.take());
        let comb = g.hybrid_moe(self.m, l, t, self.pos0, self.s, self.host, (gate_ty, down_ty, down_off), routed)?;
        self.pend = Some(comb);
        Ok(())
    }

    fn enqueue_output(&mut self, row0: usize, rows: usize) -> Result<(), BackendError> {
        let (g, c) = (self.g, self.m.cfg);
        let pend = self.pend.take();
        Ok(g.enqueue_output(c, (row0, rows), pend)?)
    }

    fn enqueue_hand_off(&mut self) -> Result<(), BackendError> {
        let pend = self.pend.take();
        Ok(self.g.enqueue_hand_off(self.m.cfg, self.t, pend)?)
    }
}

impl Ops for GpuPass<'_, '_> {
    fn segment(
        &mut self,
        layer: usize,
        ops: &mut dyn FnMut(&mut dyn Ops) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        if !(self.segments && matches!(self.g.layer(layer).ffn, GFfn::Moe { .. })) {
            return ops(self);
        }
        let g = self.g;
        let (kk, e) = (self.m.cfg.n_expert_used, self.m.cfg.n_embd);
        // sized before recording: the graph names its address
        self.staging = g.routing_staging(self.host, kk, e)?;
        let pend = self.pend;
        self.in_segment = true;
        self.routed = false;
        // decided once for the segment: a graph recorded with the prediction is replayed only while it is asked
        self.predict = g.predicts(self.m, layer, self.t, self.s, self.host);
        let mut ran = false;
        let r = g.replay_segment((layer, self.cap, self.predict.is_some()), || {
            // a recording that failed is enqueued again with plain launches: the same combine each time
            self.pend = pend;
            ran = true;
            ops(self).map_err(GpuError::from)
        });
        self.in_segment = false;
        // the pending combine is done by the segment's first norm, recorded or replayed; the routing's copy to the
        // host is in the segment (route() enqueued it when recorded; a replay has it)
        self.pend = None;
        debug_assert!(!ran || r.is_err() || self.routed, "an MoE block's segment contains its route()");
        self.routed = true;
        Ok(r?)
    }

    fn norm(&mut self, which: Norm) -> Result<(), BackendError> {
        let r = self.enqueue_norm(which);
        self.marked("norm", r)
    }

    fn qkv(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_qkv(l);
        self.marked("qkv", r)
    }

    fn rope_store(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_rope_store(l);
        self.marked("rope_store", r)
    }

    fn attention(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_attention(l);
        self.marked("attention", r)
    }

    fn attn_output(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_attn_output(l);
        self.marked("attn_output", r)
    }

    fn ffn(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_ffn(l);
        self.marked("ffn", r)
    }

    fn route(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_route(l);
        self.marked("route", r)
    }

    fn shared_expert(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_shared_expert(l);
        self.marked("shared_expert", r)
    }

    fn experts(&mut self, l: usize) -> Result<(), BackendError> {
        let r = self.enqueue_experts(l);
        self.marked("experts", r)
    }

    fn output(&mut self, row0: usize, rows: usize) -> Result<(), BackendError> {
        let r = self.enqueue_output(row0, rows);
        self.marked("output", r)
    }

    fn layers(&self, _n_layer: usize) -> std::ops::Range<usize> {
        self.g.layer_range()
    }

    fn hand_off(&mut self) -> Result<(), BackendError> {
        let r = self.enqueue_hand_off();
        self.marked("hand_off", r)
    }
}
