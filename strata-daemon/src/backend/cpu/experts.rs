//! The CPU's share of an MoE layer: routed experts computed on the worker pool from wherever their bytes are
//! (the RAM copy, blobs read from the file, the mapping), weighted and summed per token.

use super::{experts_batch, Act, ExpertJob, GluAct, GluJob, GluUnit, MatRef};
use crate::arch::weights::ExpertWeights;
use crate::backend::{BackendError, ModelRef, Scratch};
use crate::tiers::arena::HostArena;
use crate::tiers::store::Source;

/// Computes on the CPU pool the experts in `by_expert` (skipping empty entries) from `src` into `s.moe_acc` (`t ×
/// n_embd`, zeroed first): `acc[i] = Σ_e w · expert_e(xn_i)`. `s.xn` must hold the normalized, quantized activations.
/// File-tier blobs of the layer are read together first. Experts are the architecture's gated unit ([`GluAct::of`])
/// with the layer's expert biases when it has them ([`ExpertWeights::bias`]). `from[x]` (when given): expert x's
/// intermediate rows `from[x] .. n_ff_exp` only (a multiple of 32; the rest is computed elsewhere and added to the same
/// output) — gate/up rows and the matching block range of every down row; the down bias is added here only when
/// `from[x]` is 0 (a caller that computes an expert's first rows elsewhere adds it there). `side` runs once on the
/// calling thread while the pool works on the first experts (or before the file reads; at once when there is nothing to
/// compute): work of the caller's that should not delay the CPU experts, such as a hybrid layer's GPU copies and
/// launches. It gets the RAM copy when this function holds its read lock (the lock is not re-entrant), `None` when it
/// does not.
///
/// Errors: [`BackendError::BlobRead`] when a file-tier blob could not be read (the file truncated or replaced
/// under the daemon, an I/O error). The other experts are still computed and `side` still runs, so the caller's
/// state stays as after a good pass; the pass's output is then to be discarded.
#[allow(clippy::too_many_arguments)]
pub fn experts(
    m: &ModelRef<'_>,
    layer: usize,
    ex: &ExpertWeights,
    by_expert: &[Vec<(usize, f32)>],
    src: Vec<Source>,
    from: Option<&[usize]>,
    s: &mut Scratch,
    side: impl FnOnce(Option<&HostArena>),
) -> Result<(), BackendError> {
    // a split expert's first rows computed elsewhere would need its biases there too: no caller splits biased experts
    debug_assert!(ex.bias.is_none() || from.is_none_or(|f| f.iter().all(|&x| x == 0)), "biased experts split");
    let mut side = Some(side);
    let cfg = &m.cfg;
    let (e, ne, ff) = (cfg.n_embd, cfg.n_expert, cfg.n_ff_exp);
    let t = s.xn.t;
    let act = GluAct::of(cfg.spec.def.act, m.precision);
    let (gate_all, up_all, down_all) = (m.mat(&ex.gate), m.mat(&ex.up), m.mat(&ex.down));
    let gb = ff * gate_all.row_bytes();
    let db = e * down_all.row_bytes();
    let mut blob_at = vec![0usize; ne];
    // experts whose blob read failed (left out; no allocation unless one did), and the first one's error
    let mut unread: Vec<usize> = Vec::new();
    let mut failed: Option<(usize, String)> = None;
    let arena = m.experts.as_ref().map(|st| {
        // this layer's file-tier blobs, read together over the worker pool before any expert is computed
        let files: Vec<usize> = (0..ne).filter(|&x| !by_expert[x].is_empty() && src[x] == Source::File).collect();
        if !files.is_empty() {
            if let Some(f) = side.take() {
                f(None);
            }
        }
        let blob = 2 * gb + db;
        let errs = st.read_blobs(layer, &files, &mut s.blobs, m.pool);
        for (j, (&x, err)) in files.iter().zip(errs).enumerate() {
            blob_at[x] = j * blob;
            // not computed from the mapping instead: a file that fails a read would fault there (SIGBUS)
            if let Some(e) = err {
                unread.push(x);
                failed.get_or_insert((x, e.to_string()));
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
    let list: Vec<usize> = (0..ne).filter(|&x| !by_expert[x].is_empty() && !unread.contains(&x)).collect();
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
            sub.qk.clear();
            for &(ti, _) in &by_expert[x] {
                sub.f.extend_from_slice(s.xn.row(ti));
                sub.q.extend_from_slice(s.xn.qrow(ti));
                sub.qk.extend_from_slice(s.xn.qkrow(ti));
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
            for (((v, x), h), &xid) in views.iter().zip(&subs).zip(hs.iter_mut()).zip(batch) {
                let n = x.t * v.0.rows;
                // the down product's activations as its format pairs them (Q8_K for the K- and IQ quants)
                h.with_q8k = crate::quant::format::lookup(v.2.ty)
                    .is_some_and(|f| f.activation == crate::quant::format::Activation::Q8K);
                let (g, gr) = std::mem::take(&mut g_rest).split_at_mut(n);
                let (u, ur) = std::mem::take(&mut u_rest).split_at_mut(n);
                let (out, or) = std::mem::take(&mut o_rest).split_at_mut(x.t * e);
                g_rest = gr;
                u_rest = ur;
                o_rest = or;
                // the expert's gate/up biases over the rows this call computes
                let (b0, b1) = (xid * ff + f0(xid), (xid + 1) * ff);
                let unit = GluUnit { act, bias: ex.bias.as_ref().map(|b| (&b.gate[b0..b1], &b.up[b0..b1])) };
                jobs.push(ExpertJob { glu: GluJob { gate: v.0, up: v.1, x, g, u, h, unit }, down: v.2, out });
            }
            let side = side.take();
            experts_batch(m.pool, &mut jobs, m.precision, || side.into_iter().for_each(|f| f(arena.as_deref())));
        }
        // weighted sum into the tokens' rows, expert by expert in id order (plus the expert's down bias, where it
        // has one and this call computes its first rows)
        let mut off = 0;
        for &x in batch {
            let down_bias = ex.bias.as_ref().filter(|_| f0(x) == 0).map(|b| &b.down[x * e..(x + 1) * e]);
            for (jj, &(ti, w)) in by_expert[x].iter().enumerate() {
                let y = &s.tmp[off + jj * e..off + (jj + 1) * e];
                match down_bias {
                    None => {
                        for (a, v) in acc[ti * e..(ti + 1) * e].iter_mut().zip(y) {
                            *a += w * v;
                        }
                    }
                    Some(b) => {
                        for ((a, v), b) in acc[ti * e..(ti + 1) * e].iter_mut().zip(y).zip(b) {
                            *a += w * (v + b);
                        }
                    }
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
    match failed {
        Some((expert, reason)) => Err(BackendError::BlobRead { layer, expert, reason }),
        None => Ok(()),
    }
}
