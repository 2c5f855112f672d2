//! Causal attention of a chunk of query rows over the KV cache (CPU).
//!
//! - f16 rows: llama.cpp's F16-cache roundings (the query and the normalised probabilities rounded to f16), with
//!   the positions in chunks of [`CHUNK`]. Per chunk, the scores of the heads that share a K/V head; per head, `M`
//!   the largest score (and sink), `e = e^(s − M)` with [`super::exp`]'s function (glibc's method), `L` their
//!   sum one at a time in position order (+ `e^(sink − M)`); per chunk, `p = f16(e · (1 / L))` and `o_c = Σ p · v`
//!   (fused multiply-adds in position order); the output is `Σ o_c` in chunk order. Where libm is glibc (whose
//!   `expf` gave the same bits on every f32 sampled from −104 to 0), everything but the V sum has the bits of the
//!   single-pass softmax this replaced. The definition fixes every bit whichever path computes
//!   it: a few rows (decode) run the chunk passes as one task per (row, chunk) — per (row, chunk, K/V head) when
//!   the pool would be short of tasks — each reading its chunk's K (then V) rows once for every head that shares
//!   them, the softmax as one task per (row, head), the sums on the calling thread; a prompt chunk runs one task
//!   per block of up to [`BLOCK_ROWS`] consecutive rows and K/V head, each K and V row converted once for the
//!   block's rows. The x86 kernels ([`super::attention_x86`]) give the bits of the portable
//!   `chunk_scores`, `softmax_exps` and `chunk_values`, whose scores ([`crate::quant::f16`]) give those of f32
//!   products over the same values. Neither the thread count nor the number of rows changes a bit.
//! - Q8_0 rows (`--kv-type q8_0`): as llama.cpp's flash attention over a Q8_0 cache (query quantized to Q8_0,
//!   V dequantized to f32, the softmax in f32 with libm's `exp`); a few rows in three passes over the pool
//!   ([`split_passes`]), a prompt chunk one task per row and K/V head.
//! - f32 rows: the exact reference precision (one softmax over the span).

use std::cell::RefCell;

use super::exp::exp;
use super::math::dot_f32;
use super::matmul::SyncPtr;
use crate::backend::kv::KvRows;
use crate::pool::WorkerPool;
use crate::quant::{self, f16, f16_to_f32, BlockQ8, GgmlType};

#[cfg(target_arch = "x86_64")]
use super::attention_x86 as x86;

/// The shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    /// Query heads.
    pub n_head: usize,
    /// K/V heads (`n_head` is a multiple).
    pub n_head_kv: usize,
    /// Values per head.
    pub head_dim: usize,
}

/// Positions per chunk of the f16 attention's V products (part of its definition: the results depend on it, not on
/// the thread count).
pub(super) const CHUNK: usize = 128;

thread_local! {
    /// A task's scores (one per attended position and head, of each of its rows).
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// [`split_passes`]' (or a decode split of f16 rows') scores of every row and head, kept by the calling thread
    /// between calls (a decode token would otherwise allocate and zero one per layer).
    static SPLIT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The f16 chunks' partial results (the calling thread's for a decode split, a prompt task's own).
    static PARTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A task's f16 probabilities of one chunk ([`CHUNK`] per head).
    static PROBS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out` (`t × n_head × head_dim`) = softmax(q·Kᵀ · scale) · V for the `t` rows of `q` (same shape) at positions
/// `pos0 ..`, each attending to positions `0 ..= its own` (the last `window` of them when `window > 0`). `sinks`
/// (`n_head` logits, when given): head h's softmax also counts `e^sinks[h]` in its denominator, a position
/// without a value (ggml's `soft_max` with sinks: the largest of the scores and the sink is subtracted). `keys`
/// and `values` hold at least `pos0 + t` positions of `n_head_kv × head_dim` values, both of one kind. f16 rows:
/// `q` is rounded to f16 first (in place), as llama.cpp does over its F16 cache, and the positions run in chunks
/// (module doc). Q8_0 rows: `q` is quantized to Q8_0 for the scores (left as it is).
///
/// # Panics
/// When `n_head_kv` does not divide `n_head`, a buffer is shorter than the shapes say, `keys` and `values` are of
/// different kinds, or Q8_0 rows come with a `head_dim` that is not a multiple of 32.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    pool: &WorkerPool,
    q: &mut [f32],
    keys: KvRows<'_>,
    values: KvRows<'_>,
    h: Heads,
    (pos0, t): (usize, usize),
    scale: f32,
    window: usize,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let (nh, hd) = (h.n_head, h.head_dim);
    assert!(sinks.is_none_or(|s| s.len() >= nh), "attention sinks: one per query head");
    let (qd, kvd) = (nh * hd, h.n_head_kv * hd);
    assert!(h.n_head_kv > 0 && nh % h.n_head_kv == 0, "attention: {nh} query heads over {} K/V heads", h.n_head_kv);
    assert!(q.len() >= t * qd && out.len() >= t * qd, "attention buffers");
    let n = pos0 + t;
    let held = |r: KvRows<'_>| match r {
        KvRows::F16(x) => x.len() >= n * kvd,
        KvRows::F32(x) => x.len() >= n * kvd,
        KvRows::Q8_0(x) => kvd % 32 == 0 && x.len() >= n * GgmlType::Q8_0.row_bytes(kvd),
    };
    assert!(held(keys) && held(values), "attention: the K/V rows hold fewer than {n} positions");
    let call = Call { h, pos0, t, scale, window, sinks };
    match (keys, values) {
        (KvRows::Q8_0(k), KvRows::Q8_0(v)) => attend_q8_0(pool, &q[..t * qd], k, v, &call, &mut out[..t * qd]),
        (KvRows::F16(k), KvRows::F16(v)) => {
            f16::round_slice(&mut q[..t * qd]);
            attend_f16(pool, &q[..t * qd], k, v, &call, &mut out[..t * qd]);
        }
        (KvRows::F32(k), KvRows::F32(v)) => attend_f32(pool, &q[..t * qd], k, v, &call, &mut out[..t * qd]),
        _ => panic!("attention: keys and values of different kinds"),
    }
}

/// [`attend`] over f32 rows: one task per row and head (the K/V head's heads together when the pool has tasks
/// enough), one softmax over the span.
fn attend_f32(pool: &WorkerPool, q: &[f32], k: &[f32], v: &[f32], r: &Call<'_>, out: &mut [f32]) {
    let (nh, nkv, hd, t) = (r.h.n_head, r.h.n_head_kv, r.h.head_dim, r.t);
    let (qd, group) = (nh * hd, nh / nkv);
    let per = if t * nkv >= 4 * pool.threads() { group } else { 1 };
    let out_ptr = SyncPtr(out.as_mut_ptr());
    pool.run(t * nh / per, |idx| {
        let (i, h0) = (idx / (nh / per), idx % (nh / per) * per);
        // SAFETY: task `idx` writes only out[(i*nh + h0)*hd .. (i*nh + h0 + per)*hd], inside the t*qd buffer
        // (asserted by `attend`); tasks are disjoint and the buffer outlives `run`.
        let o = unsafe { std::slice::from_raw_parts_mut({ out_ptr }.0.add((i * nh + h0) * hd), per * hd) };
        let span = r.span(i, h0 / group);
        SCORES.with(|cell| {
            let mut sc = cell.borrow_mut();
            for g in 0..per {
                let qh = &q[i * qd + (h0 + g) * hd..i * qd + (h0 + g + 1) * hd];
                let sink = r.sinks.map(|s| s[h0 + g]);
                head_f32(qh, k, v, span, r.scale, sink, &mut sc, &mut o[g * hd..(g + 1) * hd]);
            }
        });
    });
}

/// The chunk kernels of the f16 definition this CPU runs: the x86 ones ([`x86::chunk_scores_f16`],
/// [`x86::exps_f16`], [`x86::chunk_values_f16`]; for a block of rows [`x86::rows_scores_f16`] and
/// [`x86::rows_values_f16`]) where the head fits them, else the portable ones (with fused multiply-adds in hardware
/// where the CPU has them).
#[derive(Clone, Copy)]
enum ChunkKernel {
    #[cfg(target_arch = "x86_64")]
    X86(x86::Width),
    /// `true`: the CPU has FMA (the portable bodies run with it enabled).
    Portable(bool),
}

impl ChunkKernel {
    fn for_head(hd: usize) -> ChunkKernel {
        #[cfg(target_arch = "x86_64")]
        if let Some(w) = x86::Width::detect() {
            if hd.is_multiple_of(8) && hd <= x86::MAX_HD {
                return ChunkKernel::X86(w);
            }
            return ChunkKernel::Portable(true);
        }
        let _ = hd;
        ChunkKernel::Portable(false)
    }

    /// Pass one over span positions `js` for the heads of `qv` (see [`chunk_scores`]): head `g`'s scores to
    /// `sc[g · stride ..]`.
    #[allow(clippy::too_many_arguments)]
    fn scores(
        self,
        qv: &[f32],
        k: &[u16],
        sp: Span,
        js: std::ops::Range<usize>,
        scale: f32,
        sc: &mut [f32],
        stride: usize,
    ) {
        let per = qv.len() / sp.hd;
        assert!(
            sp.first + js.end <= sp.n && sp.n * sp.kvd <= k.len() && sp.off + sp.hd <= sp.kvd,
            "attention chunk rows"
        );
        assert!(per > 0 && (per - 1) * stride + js.len() <= sc.len() && js.len() <= CHUNK, "attention chunk scores");
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the width was detected on this CPU (`for_head`); the span's rows lie inside k and the heads'
            // scores inside sc (asserted).
            ChunkKernel::X86(w) => unsafe { x86::chunk_scores_f16(w, qv, k, sp, js, scale, (sc.as_mut_ptr(), stride)) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: FMA was detected (`for_head` gives `true` only where the SIMD level includes it).
            ChunkKernel::Portable(true) => unsafe { chunk_scores_fma(qv, k, sp, js, scale, (sc, stride)) },
            _ => chunk_scores(qv, k, sp, js, scale, (sc, stride)),
        }
    }

    /// One head's softmax over its scores `segs` (its span in position order): each score becomes
    /// `e^(s − M)` ([`softmax_exps`]); returns `1 / L` ([`softmax_inv`]).
    fn softmax(self, segs: &mut [&mut [f32]], sink: Option<f32>) -> f32 {
        let m = self.exps(segs, sink);
        softmax_inv(segs, m, sink)
    }

    /// One head's exponentials: each score of `segs` becomes `e^(s − M)` ([`softmax_exps`]); returns `M`.
    fn exps(self, segs: &mut [&mut [f32]], sink: Option<f32>) -> f32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the width was detected on this CPU (`for_head`).
            ChunkKernel::X86(w) => unsafe { x86::exps_f16(w, segs, sink) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: FMA was detected (`for_head` gives `true` only where the SIMD level includes it).
            ChunkKernel::Portable(true) => unsafe { softmax_exps_fma(segs, sink) },
            _ => softmax_exps(segs, sink),
        }
    }

    /// Pass two for the heads of `invs` (see [`chunk_values`]); `p` holds `invs.len() · CHUNK` values.
    #[allow(clippy::too_many_arguments)]
    fn values(
        self,
        e: &[f32],
        stride: usize,
        v: &[u16],
        sp: Span,
        js: std::ops::Range<usize>,
        invs: &[f32],
        p: &mut [f32],
        part: &mut [f32],
    ) {
        let per = invs.len();
        assert!(
            sp.first + js.end <= sp.n && sp.n * sp.kvd <= v.len() && sp.off + sp.hd <= sp.kvd,
            "attention chunk rows"
        );
        assert!(
            per > 0 && (per - 1) * stride + js.len() <= e.len() && js.len() <= CHUNK,
            "attention chunk exponentials"
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `scores`; the heads' exponentials lie inside e (asserted).
            ChunkKernel::X86(w) => unsafe { x86::chunk_values_f16(w, (e.as_ptr(), stride), v, sp, js, invs, p, part) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `scores`.
            ChunkKernel::Portable(true) => unsafe { chunk_values_fma((e, stride), v, sp, js, invs, p, part) },
            _ => chunk_values((e, stride), v, sp, js, invs, p, part),
        }
    }
}

impl ChunkKernel {
    /// Pass one of chunk `c` for several rows sharing `sp.first` (`qs[x]` row x's heads, `ends[x]` the end of its
    /// positions in the chunk, span index; rows that end at or before the chunk's start skipped): row x's head
    /// `g`'s scores to `sc[x · rstride + (c · heads + g) · CHUNK ..]` (see [`chunk_scores`]). `sp` is the longest
    /// row's span.
    #[allow(clippy::too_many_arguments)]
    fn scores_rows(
        self,
        qs: &[&[f32]],
        k: &[u16],
        sp: Span,
        (c, ends): (usize, &[usize]),
        scale: f32,
        sc: &mut [f32],
        rstride: usize,
    ) {
        let per = qs[0].len() / sp.hd;
        let j0 = c * CHUNK;
        let jend = ends.iter().copied().max().unwrap_or(j0).max(j0);
        assert!(
            sp.first + jend <= sp.n && sp.n * sp.kvd <= k.len() && sp.off + sp.hd <= sp.kvd && jend - j0 <= CHUNK,
            "attention chunk rows"
        );
        assert!(
            qs.len() == ends.len()
                && qs.iter().all(|q| q.len() == per * sp.hd)
                && (qs.len() == 1 || rstride >= (c + 1) * per * CHUNK)
                && (qs.len() - 1) * rstride + (c + 1) * per * CHUNK <= sc.len(),
            "attention chunk scores"
        );
        let at = |x: usize| x * rstride + c * per * CHUNK;
        match self {
            #[cfg(target_arch = "x86_64")]
            ChunkKernel::X86(w) => {
                let base = sc.as_mut_ptr();
                let rows: Vec<x86::ScoreRow<'_>> = (0..qs.len())
                    .filter(|&x| ends[x] > j0)
                    // SAFETY: row x's scores of this chunk lie inside sc (asserted).
                    .map(|x| x86::ScoreRow { q: qs[x], end: ends[x], sc: unsafe { base.add(at(x)) } })
                    .collect();
                // SAFETY: the width was detected on this CPU (`for_head`); the rows' positions lie inside k and
                // their scores inside sc (asserted), one row's apart from another's (rstride >= the chunk's).
                unsafe { x86::rows_scores_f16(w, &rows, k, sp, j0..jend, scale, CHUNK) }
            }
            _ => {
                for (x, q) in qs.iter().enumerate().filter(|&(x, _)| ends[x] > j0) {
                    let dst = &mut sc[at(x)..at(x) + per * CHUNK];
                    self.scores(q, k, sp, j0..ends[x], scale, dst, CHUNK);
                }
            }
        }
    }

    /// Pass two of chunk `c` for the rows of [`ChunkKernel::scores_rows`] (`ns[x]` row x's positions in the chunk,
    /// nondecreasing; `invs[x · heads + g]` its heads' `1 / L`): row x's head `g`'s V product to
    /// `part[(x · heads + g) · hd ..]` (see [`chunk_values`]); `p` holds `ns.len() · heads · CHUNK` values.
    #[allow(clippy::too_many_arguments)]
    fn values_rows(
        self,
        (e, rstride): (&[f32], usize),
        v: &[u16],
        sp: Span,
        (c, ns): (usize, &[usize]),
        invs: &[f32],
        p: &mut [f32],
        part: &mut [f32],
    ) {
        let (nr, hd) = (ns.len(), sp.hd);
        let per = invs.len() / nr;
        let j0 = c * CHUNK;
        assert!(
            ns.iter().all(|&n| n <= CHUNK && (n == 0 || sp.first + j0 + n <= sp.n))
                && ns.windows(2).all(|x| x[0] <= x[1])
                && sp.n * sp.kvd <= v.len()
                && sp.off + hd <= sp.kvd,
            "attention chunk rows"
        );
        assert!(
            invs.len() == nr * per
                && (nr - 1) * rstride + (c + 1) * per * CHUNK <= e.len()
                && p.len() >= nr * per * CHUNK
                && part.len() >= nr * per * hd,
            "attention chunk exponentials"
        );
        let at = |x: usize| x * rstride + c * per * CHUNK;
        match self {
            #[cfg(target_arch = "x86_64")]
            ChunkKernel::X86(w) => {
                let rows: Vec<x86::ValueRow<'_>> = (0..nr)
                    .map(|x| x86::ValueRow { e: e[at(x)..].as_ptr(), n: ns[x], invs: &invs[x * per..(x + 1) * per] })
                    .collect();
                // SAFETY: the width was detected on this CPU (`for_head`); the rows' positions lie inside v, their
                // exponentials inside e and their outputs inside part (asserted).
                unsafe { x86::rows_values_f16(w, &rows, per, v, sp, j0, p, part.as_mut_ptr()) }
            }
            _ => {
                for (x, &n) in ns.iter().enumerate().filter(|&(_, &n)| n > 0) {
                    let nm = &invs[x * per..(x + 1) * per];
                    let o = &mut part[x * per * hd..(x + 1) * per * hd];
                    self.values(&e[at(x)..], CHUNK, v, sp, j0..j0 + n, nm, p, o);
                }
            }
        }
    }
}

/// [`attend`] over f16 rows (`q` already rounded), over chunks of [`CHUNK`] positions (module doc). A few rows
/// (decode): the scores and the V products as one task per (row, chunk) — per (row, chunk, K/V head) when that
/// leaves the pool short of tasks — each reading the chunk's K (then V) rows once for all heads; the softmax as
/// one task per (row, head); the chunks' sums on the calling thread. More rows: one task per block of up to
/// [`BLOCK_ROWS`] rows and K/V head ([`prompt_f16`]).
fn attend_f16(pool: &WorkerPool, q: &[f32], k: &[u16], v: &[u16], r: &Call<'_>, out: &mut [f32]) {
    let (nh, nkv, hd, t) = (r.h.n_head, r.h.n_head_kv, r.h.head_dim, r.t);
    let (qd, group) = (nh * hd, nh / nkv);
    let kern = ChunkKernel::for_head(hd);
    if t * nkv >= 4 * pool.threads() {
        prompt_f16(pool, q, k, v, r, kern, out);
        return;
    }
    let len = |i: usize| {
        let sp = r.span(i, 0);
        sp.n - sp.first
    };
    let chunks = |i: usize| len(i).div_ceil(CHUNK);
    let cmax = (0..t).map(chunks).max().unwrap_or(0);
    // row i, chunk c, head h: its scores (then exponentials) at sc[((i·cmax + c)·nh + h)·CHUNK ..], its V product
    // at parts[((i·cmax + c)·nh + h)·hd ..]; a task's heads are consecutive
    let mut sc = SPLIT.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let mut parts = PARTS.with(|c| std::mem::take(&mut *c.borrow_mut()));
    sc.resize(sc.len().max(t * cmax * nh * CHUNK), 0.0);
    parts.resize(parts.len().max(t * cmax * nh * hd), 0.0);
    let mut invs = vec![0f32; t * nh];
    let kvs = if t * cmax < 2 * pool.threads() { nkv } else { 1 };
    let (sc_ptr, parts_ptr, inv_ptr) =
        (SyncPtr(sc.as_mut_ptr()), SyncPtr(parts.as_mut_ptr()), SyncPtr(invs.as_mut_ptr()));
    // task idx of the chunk passes: (row i, chunk c, its K/V heads) when chunk c exists for row i
    let task = |idx: usize| {
        let (i, c, ks) = (idx / (cmax * kvs), idx / kvs % cmax, idx % kvs);
        let khs = if kvs == 1 { 0..nkv } else { ks..ks + 1 };
        (c < chunks(i)).then_some((i, c, khs))
    };
    let js = |i: usize, c: usize| c * CHUNK..((c + 1) * CHUNK).min(len(i));
    let at = |i: usize, c: usize, h: usize| (i * cmax + c) * nh + h;
    pool.run(t * cmax * kvs, |idx| {
        let Some((i, c, khs)) = task(idx) else { return };
        for kh in khs {
            // SAFETY: (row i, chunk c, heads kh·group .. (kh + 1)·group)'s scores: group·CHUNK values no other task
            // writes (tasks differ in row, chunk or K/V head), inside the buffer sized above.
            let s = unsafe {
                std::slice::from_raw_parts_mut({ sc_ptr }.0.add(at(i, c, kh * group) * CHUNK), group * CHUNK)
            };
            let qv = &q[i * qd + kh * group * hd..i * qd + (kh + 1) * group * hd];
            kern.scores(qv, k, r.span(i, kh), js(i, c), r.scale, s, CHUNK);
        }
    });
    pool.run(t * nh, |ih| {
        let (i, h) = (ih / nh, ih % nh);
        let mut segs: Vec<&mut [f32]> = (0..chunks(i))
            // SAFETY: (row i, head h)'s scores of chunk c: CHUNK values from this offset, which no other task of
            // this pass touches (tasks differ in row or head), inside the buffer.
            .map(|c| unsafe { std::slice::from_raw_parts_mut({ sc_ptr }.0.add(at(i, c, h) * CHUNK), js(i, c).len()) })
            .collect();
        let inv = kern.softmax(&mut segs, r.sinks.map(|s| s[h]));
        // SAFETY: element ih of the t·nh normalizers, this task's alone.
        unsafe { *{ inv_ptr }.0.add(ih) = inv };
    });
    let invs = &invs;
    pool.run(t * cmax * kvs, |idx| {
        let Some((i, c, khs)) = task(idx) else { return };
        PROBS.with_borrow_mut(|p| {
            p.resize(p.len().max(group * CHUNK), 0.0);
            for kh in khs {
                let a = at(i, c, kh * group);
                // SAFETY: the regions of the first pass (disjoint between tasks): the exponentials only read now,
                // the V products written by this task alone.
                let (e, part) = unsafe {
                    let e = std::slice::from_raw_parts({ sc_ptr }.0.add(a * CHUNK), group * CHUNK);
                    (e, std::slice::from_raw_parts_mut({ parts_ptr }.0.add(a * hd), group * hd))
                };
                let nm = &invs[i * nh + kh * group..i * nh + (kh + 1) * group];
                kern.values(e, CHUNK, v, r.span(i, kh), js(i, c), nm, p, part);
            }
        });
    });
    for i in 0..t {
        for h in 0..nh {
            let o = &mut out[(i * nh + h) * hd..(i * nh + h + 1) * hd];
            sum_chunks(&parts[at(i, 0, h) * hd..], nh * hd, chunks(i), o);
        }
    }
    SPLIT.with(|c| *c.borrow_mut() = sc);
    PARTS.with(|c| *c.borrow_mut() = parts);
}

/// Most consecutive query rows of a prompt one task takes per K/V head ([`prompt_f16`]).
const BLOCK_ROWS: usize = 4;

/// [`attend_f16`] for many rows: one task per block of up to [`BLOCK_ROWS`] consecutive rows and K/V head (fewer
/// rows per block where the pool would be short of tasks); the block's rows that share a span start (all of them
/// unless a sliding window moves it) run their chunks together ([`prompt_rows`]).
fn prompt_f16(pool: &WorkerPool, q: &[f32], k: &[u16], v: &[u16], r: &Call<'_>, kern: ChunkKernel, out: &mut [f32]) {
    let (nkv, t) = (r.h.n_head_kv, r.t);
    let rows = (t * nkv / (4 * pool.threads())).clamp(1, BLOCK_ROWS);
    let blocks = t.div_ceil(rows);
    let out = SyncPtr(out.as_mut_ptr());
    pool.run(blocks * nkv, |idx| {
        let (b, kh) = (idx / nkv, idx % nkv);
        let (mut a, end) = (b * rows, ((b + 1) * rows).min(t));
        while a < end {
            let first = r.span(a, kh).first;
            let e = (a + 1..end).find(|&i| r.span(i, kh).first != first).unwrap_or(end);
            // SAFETY: rows a .. e of K/V head kh: this task's alone (tasks differ in block or K/V head), inside the
            // t rows `out` holds.
            unsafe { prompt_rows(q, k, v, r, kern, (a..e, kh), out) };
            a = e;
        }
    });
}

/// Rows `rows` (sharing one span start) of K/V head `kh` of [`attend_f16`]: per chunk the scores of every row
/// (each K row converted once for all where the kernels allow), per row and head the softmax, per chunk the V
/// products (each V row converted once for all), per row and head the chunks' sum into `out`.
///
/// # Safety
/// `out` points at `t · n_head · hd` values; rows `rows`' heads of K/V head `kh` are this call's alone.
unsafe fn prompt_rows(
    q: &[f32],
    k: &[u16],
    v: &[u16],
    r: &Call<'_>,
    kern: ChunkKernel,
    (rows, kh): (std::ops::Range<usize>, usize),
    out: SyncPtr,
) {
    let (nh, nkv, hd) = (r.h.n_head, r.h.n_head_kv, r.h.head_dim);
    let (qd, group, nr) = (nh * hd, nh / nkv, rows.len());
    let h0 = kh * group;
    // the rows' spans grow by one position per row: the last is the longest
    let sp = r.span(rows.end - 1, kh);
    let lens: Vec<usize> = rows.clone().map(|i| r.span(i, kh).n - sp.first).collect();
    let ncs: Vec<usize> = lens.iter().map(|l| l.div_ceil(CHUNK)).collect();
    let nc = ncs[nr - 1];
    let qs: Vec<&[f32]> = rows.clone().map(|i| &q[i * qd + h0 * hd..i * qd + (h0 + group) * hd]).collect();
    let js = |c: usize, len: usize| (c * CHUNK).min(len)..((c + 1) * CHUNK).min(len);
    let sink = |g: usize| r.sinks.map(|s| s[h0 + g]);
    // row x, chunk c, head g: scores at sc[((x·nc + c)·group + g)·CHUNK ..]; V products of chunk c at
    // parts[((c·nr + x)·group + g)·hd ..]
    let rstride = nc * group * CHUNK;
    SCORES.with_borrow_mut(|sc| {
        PARTS.with_borrow_mut(|parts| {
            PROBS.with_borrow_mut(|p| {
                sc.resize(sc.len().max(nr * rstride), 0.0);
                parts.resize(parts.len().max(nc * nr * group * hd), 0.0);
                p.resize(p.len().max(nr * group * CHUNK), 0.0);
                for c in 0..nc {
                    let ends: Vec<usize> = lens.iter().map(|&l| js(c, l).end).collect();
                    kern.scores_rows(&qs, k, sp, (c, &ends), r.scale, &mut sc[..nr * rstride], rstride);
                }
                let mut invs = vec![0f32; nr * group];
                for x in 0..nr {
                    let scx = &mut sc[x * rstride..x * rstride + ncs[x] * group * CHUNK];
                    let ms: Vec<f32> = (0..group)
                        .map(|g| {
                            let mut segs: Vec<&mut [f32]> = scx
                                .chunks_mut(CHUNK)
                                .skip(g)
                                .step_by(group)
                                .enumerate()
                                .map(|(c, s)| &mut s[..js(c, lens[x]).len()])
                                .collect();
                            kern.exps(&mut segs, sink(g))
                        })
                        .collect();
                    let iv = softmax_invs(scx, (ncs[x], lens[x]), &ms, sink);
                    invs[x * group..(x + 1) * group].copy_from_slice(&iv);
                }
                for c in 0..nc {
                    let ns: Vec<usize> = lens.iter().map(|&l| js(c, l).len()).collect();
                    let part = &mut parts[c * nr * group * hd..(c + 1) * nr * group * hd];
                    kern.values_rows((&sc[..nr * rstride], rstride), v, sp, (c, &ns), &invs, p, part);
                }
                for (x, i) in rows.clone().enumerate() {
                    for g in 0..group {
                        // SAFETY: row i's head h0 + g, this call's alone (contract), inside `out`.
                        let o = unsafe { std::slice::from_raw_parts_mut({ out }.0.add((i * nh + h0 + g) * hd), hd) };
                        sum_chunks(&parts[(x * group + g) * hd..], nr * group * hd, ncs[x], o);
                    }
                }
            });
        });
    });
}

/// Pass one of a chunk of the f16 definition (module doc) for the `qv.len() / sp.hd` query heads of one K/V head
/// over span positions `js` (indices from `sp.first`, at most [`CHUNK`]): head `g`'s scores ([`f16::dot`] times
/// `scale`) to `sc[g · stride + j − js.start]`. Panics when `sc` is short.
#[inline(always)]
fn chunk_scores(
    qv: &[f32],
    k: &[u16],
    sp: Span,
    js: std::ops::Range<usize>,
    scale: f32,
    (sc, stride): (&mut [f32], usize),
) {
    let n = js.len();
    for (g, q) in qv.chunks_exact(sp.hd).enumerate() {
        for (x, j) in sc[g * stride..g * stride + n].iter_mut().zip(js.clone()) {
            *x = f16::dot(q, &k[sp.row(sp.first + j)]) * scale;
        }
    }
}

/// One head's exponentials: `M` the largest of the scores in `segs` (its span in position order) and the sink,
/// each score replaced by `e^(s − M)` ([`exp`]); returns `M`.
#[inline(always)]
fn softmax_exps(segs: &mut [&mut [f32]], sink: Option<f32>) -> f32 {
    let m = segs.iter().flat_map(|s| s.iter()).fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let m = sink.map_or(m, |s| m.max(s));
    for x in segs.iter_mut().flat_map(|s| s.iter_mut()) {
        *x = exp(*x - m);
    }
    m
}

/// `1 / L` with `L` the exponentials of `segs` added one at a time in position order (as the single-pass softmax
/// before it added them), plus `e^(sink − m)`.
fn softmax_inv(segs: &[&mut [f32]], m: f32, sink: Option<f32>) -> f32 {
    let mut l = 0f32;
    for &e in segs.iter().flat_map(|s| s.iter()) {
        l += e;
    }
    if let Some(s) = sink {
        l += exp(s - m);
    }
    1.0 / l
}

/// [`softmax_inv`] of each of the `ms.len()` heads whose exponentials lie chunk after chunk at
/// `e[(c · heads + g) · CHUNK ..]` (`nc = ⌈len / CHUNK⌉` chunks of [`CHUNK`] positions, `len` in all; `ms[g]` the
/// head's `M`, `sink(g)` its sink): the same sums in the same order, so the same bits, the heads' sums running side
/// by side (up to four independent chains instead of one after another).
fn softmax_invs(e: &[f32], (nc, len): (usize, usize), ms: &[f32], sink: impl Fn(usize) -> Option<f32>) -> Vec<f32> {
    let heads = ms.len();
    assert!(e.len() >= nc * heads * CHUNK && nc == len.div_ceil(CHUNK), "softmax sums");
    let mut invs = vec![0f32; heads];
    for g0 in (0..heads).step_by(4) {
        let at = HeadSums { e, heads, g0, len };
        match heads - g0 {
            1 => at.invs::<1>(ms, &sink, &mut invs),
            2 => at.invs::<2>(ms, &sink, &mut invs),
            3 => at.invs::<3>(ms, &sink, &mut invs),
            _ => at.invs::<4>(ms, &sink, &mut invs),
        }
    }
    invs
}

/// Up to four heads `g0 ..` of [`softmax_invs`]'s exponentials `e` (`heads` heads, `len` positions).
#[derive(Clone, Copy)]
struct HeadSums<'a> {
    e: &'a [f32],
    heads: usize,
    g0: usize,
    len: usize,
}

impl HeadSums<'_> {
    /// Heads `g0 .. g0 + H`'s `1 / L` into `invs[g0 ..]`: each `L` one add at a time in position order, the `H`
    /// sums side by side, then the sink's `e^(sink − M)`.
    #[inline(always)]
    fn invs<const H: usize>(self, ms: &[f32], sink: &impl Fn(usize) -> Option<f32>, invs: &mut [f32]) {
        let mut l = [0f32; H];
        for c in 0..self.len.div_ceil(CHUNK) {
            let n = (self.len - c * CHUNK).min(CHUNK);
            let rows: [&[f32]; H] = std::array::from_fn(|h| &self.e[(c * self.heads + self.g0 + h) * CHUNK..][..n]);
            for j in 0..n {
                for h in 0..H {
                    l[h] += rows[h][j];
                }
            }
        }
        for (h, mut l) in l.into_iter().enumerate() {
            let g = self.g0 + h;
            if let Some(s) = sink(g) {
                l += exp(s - ms[g]);
            }
            invs[g] = 1.0 / l;
        }
    }
}

/// Pass two of a chunk for the heads of `invs` (`1 / L` each, from [`softmax_inv`]): head `g`'s probabilities
/// `p_j` = f16(`e_j · inv`) (rounded to nearest even, as llama.cpp rounds them before the product with its F16 V;
/// exponentials from `e[g · stride ..]`) into `p[g · CHUNK ..]`, then `o = Σ p_j · v_j` to `part[g · hd ..]`, one
/// fused multiply-add chain per value in position order from 0. Panics when a buffer is short.
#[inline(always)]
fn chunk_values(
    (e, stride): (&[f32], usize),
    v: &[u16],
    sp: Span,
    js: std::ops::Range<usize>,
    invs: &[f32],
    p: &mut [f32],
    part: &mut [f32],
) {
    let (hd, n) = (sp.hd, js.len());
    for (g, &inv) in invs.iter().enumerate() {
        let pg = &mut p[g * CHUNK..g * CHUNK + n];
        for (x, &ej) in pg.iter_mut().zip(&e[g * stride..g * stride + n]) {
            *x = half::f16::from_f32(ej * inv).to_f32();
        }
        let o = &mut part[g * hd..(g + 1) * hd];
        o.fill(0.0);
        for (&w, j) in pg.iter().zip(js.clone()) {
            for (y, &b) in o.iter_mut().zip(&v[sp.row(sp.first + j)]) {
                *y = w.mul_add(f16_to_f32(b), *y);
            }
        }
    }
}

/// [`chunk_scores`] with FMA enabled.
///
/// # Safety
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn chunk_scores_fma(
    qv: &[f32],
    k: &[u16],
    sp: Span,
    js: std::ops::Range<usize>,
    scale: f32,
    sc: (&mut [f32], usize),
) {
    chunk_scores(qv, k, sp, js, scale, sc)
}

/// [`softmax_exps`] with FMA enabled (the exponential's fused multiply-adds one instruction each).
///
/// # Safety
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn softmax_exps_fma(segs: &mut [&mut [f32]], sink: Option<f32>) -> f32 {
    softmax_exps(segs, sink)
}

/// [`chunk_values`] with FMA enabled (its `mul_add`s one instruction each).
///
/// # Safety
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn chunk_values_fma(
    e: (&[f32], usize),
    v: &[u16],
    sp: Span,
    js: std::ops::Range<usize>,
    invs: &[f32],
    p: &mut [f32],
    part: &mut [f32],
) {
    chunk_values(e, v, sp, js, invs, p, part)
}

/// One head's output: the V products of its `nc` chunks (chunk `c`'s at `part[c · cstride ..]`, `o.len()` values)
/// added in chunk order from 0.
fn sum_chunks(part: &[f32], cstride: usize, nc: usize, o: &mut [f32]) {
    let hd = o.len();
    o.fill(0.0);
    for c in 0..nc {
        for (y, &x) in o.iter_mut().zip(&part[c * cstride..c * cstride + hd]) {
            *y += x;
        }
    }
}

/// One attention call's shapes and parameters (see [`attend`]).
struct Call<'a> {
    h: Heads,
    pos0: usize,
    t: usize,
    scale: f32,
    window: usize,
    sinks: Option<&'a [f32]>,
}

impl Call<'_> {
    /// Row `i`'s span over K/V head `kh`.
    fn span(&self, i: usize, kh: usize) -> Span {
        let hd = self.h.head_dim;
        let n = self.pos0 + i + 1;
        let first = if self.window > 0 { n.saturating_sub(self.window) } else { 0 };
        Span { first, n, kvd: self.h.n_head_kv * hd, off: kh * hd, hd }
    }
}

/// The kernels of Q8_0 K/V rows for [`split_passes`] and the per-(row, K/V head) tasks: each works on the query
/// heads of one row that share a K/V head (`group` of them), reading each K and V row once for all.
trait GroupKernels: Sync {
    /// The scores of span positions `js` (indices from `sp.first`) of row `i`'s heads over K/V head `kh`: head
    /// `g`'s score of position `j` to `sc[g · len + j]` (`len = sp.n - sp.first`), scaled.
    ///
    /// # Safety
    /// `sp` is row `i`'s span over `kh` within the rows; `js` inside `0..len`; `sc` valid for writes of those
    /// elements and no one else touching them meanwhile.
    unsafe fn scores(&self, i: usize, kh: usize, sp: Span, js: std::ops::Range<usize>, sc: *mut f32);

    /// `o[g · hd + x]` = `Σ_j sc[g · len + j] · V[first + j][x]` for the columns `x` in `cols` of row `i`'s heads
    /// over K/V head `kh` (positions in order).
    ///
    /// # Safety
    /// As `scores`; `cols` inside `0..hd` with bounds on multiples of 32; `o` (the row's
    /// first head of the group) valid for writes of those columns of the `group` heads and no one else touching
    /// them meanwhile.
    unsafe fn values(&self, i: usize, kh: usize, sp: Span, sc: &[f32], cols: std::ops::Range<usize>, o: *mut f32);
}

/// Q8_0 rows: the queries quantized to Q8_0 (`qb`, `t · n_head · hd / 32` blocks), K rows through the Q8_0 row
/// kernels, V rows dequantized to f32 ([`values_q8_0`] or its x86 kernels).
struct Q8Kernels<'a> {
    #[cfg(target_arch = "x86_64")]
    w: Option<x86::Width>,
    qb: &'a [BlockQ8],
    k: &'a [u8],
    v: &'a [u8],
    h: Heads,
    scale: f32,
    /// Bytes of a position's row (`n_head_kv · head_dim / 32` blocks) and of one K/V head's part of it.
    rb: usize,
    hb: usize,
}

impl Q8Kernels<'_> {
    /// Bytes of K/V head `kh` in position `p`'s row.
    fn row(&self, p: usize, kh: usize) -> std::ops::Range<usize> {
        p * self.rb + kh * self.hb..p * self.rb + (kh + 1) * self.hb
    }
}

impl GroupKernels for Q8Kernels<'_> {
    unsafe fn scores(&self, i: usize, kh: usize, sp: Span, js: std::ops::Range<usize>, sc: *mut f32) {
        let (nb, group, len) = (self.h.head_dim / 32, self.h.n_head / self.h.n_head_kv, sp.n - sp.first);
        let h0 = i * self.h.n_head + kh * group;
        let xq = |g: usize| &self.qb[(h0 + g) * nb..(h0 + g + 1) * nb];
        let mut j = js.start;
        while j + 4 <= js.end {
            let p = sp.first + j;
            let rows = [0, 1, 2, 3].map(|u| &self.k[self.row(p + u, kh)]);
            for g in 0..group {
                let d = quant::dot_q8_x4(GgmlType::Q8_0, rows, xq(g));
                for (u, d) in d.iter().enumerate() {
                    // SAFETY: g·len + j + u < group·len, an element this call owns (contract).
                    unsafe { *sc.add(g * len + j + u) = d * self.scale };
                }
            }
            j += 4;
        }
        for j in j..js.end {
            let row = &self.k[self.row(sp.first + j, kh)];
            for g in 0..group {
                // SAFETY: as above.
                unsafe { *sc.add(g * len + j) = quant::dot_q8(GgmlType::Q8_0, row, xq(g)) * self.scale };
            }
        }
    }

    unsafe fn values(&self, _i: usize, kh: usize, sp: Span, sc: &[f32], cols: std::ops::Range<usize>, o: *mut f32) {
        let (hd, len) = (self.h.head_dim, sp.n - sp.first);
        let at = |j: usize| self.row(sp.first + j, kh).start + cols.start / 32 * 34;
        for (g, wts) in sc.chunks_exact(len).enumerate() {
            // SAFETY: head g's columns `cols`, owned by this call (contract).
            let out = unsafe { std::slice::from_raw_parts_mut(o.add(g * hd + cols.start), cols.len()) };
            out.fill(0.0);
            #[cfg(target_arch = "x86_64")]
            if let Some(w) = self.w {
                // SAFETY: `w` is what this CPU runs; cols.len() % 32 == 0; every span row's blocks lie inside v.
                unsafe { x86::values_q8_0(w, wts, self.v, at, out) };
                continue;
            }
            values_q8_0(wts, self.v, at, out);
        }
    }
}

/// [`attend`] for few rows (decode): three passes over the pool, so that every K and V row is read once for the
/// heads that share it while the pool still has tasks enough: the scores by (row, K/V head, block of
/// positions), the softmax by (row, head), the products with V by (row, K/V head, block of 32 columns). The bits
/// of one task per row and K/V head: each score and each output value is computed whole by one task.
///
/// # Safety
/// `kern` is valid for `r`'s shapes (rows holding `pos0 + t` positions, the CPU features it needs); `n_head_kv`
/// divides `n_head`; `hd` a multiple of 32 for Q8_0 rows; `out` holds `t · n_head · hd` values.
unsafe fn split_passes<K: GroupKernels>(pool: &WorkerPool, r: &Call<'_>, kern: &K, out: &mut [f32]) {
    let (nh, nkv, hd) = (r.h.n_head, r.h.n_head_kv, r.h.head_dim);
    let (group, t) = (nh / nkv, r.t);
    let lmax = r.pos0 + t;
    // the longest span: a sliding window's rows attend to `window` positions at most
    let lspan = if r.window > 0 { lmax.min(r.window) } else { lmax };
    let want = 4 * pool.threads();
    // scores: row i, head h, span position j at sc[(i·nh + h)·lmax + j]
    // every score the later passes read is written by the first (the rest of each region is never read)
    let mut sc = SPLIT.with(|c| std::mem::take(&mut *c.borrow_mut()));
    if sc.len() < t * nh * lmax {
        sc.resize(t * nh * lmax, 0.0);
    }
    let sc_ptr = SyncPtr(sc.as_mut_ptr());
    let chunks = want.div_ceil(t * nkv);
    let pc = lspan.div_ceil(chunks).next_multiple_of(64);
    let chunks = lspan.div_ceil(pc);
    pool.run(t * nkv * chunks, |idx| {
        let (i, kh, c) = (idx / (nkv * chunks), idx / chunks % nkv, idx % chunks);
        let sp = r.span(i, kh);
        let len = sp.n - sp.first;
        let js = (c * pc).min(len)..((c + 1) * pc).min(len);
        // row i's K/V head kh: heads kh·group .., their scores `len` apart from this offset
        let base = (i * nh + kh * group) * lmax;
        // SAFETY: js inside 0..len; the heads' scores g·len + j (j in js) lie inside their rows' lmax-long regions
        // ((group - 1)·len + len <= group·lmax), written by this task only; kern as this function's contract.
        unsafe { kern.scores(i, kh, sp, js, { sc_ptr }.0.add(base)) };
    });
    pool.run(t * nh, |idx| {
        let (i, hq) = (idx / nh, idx % nh);
        let sp = r.span(i, hq / group);
        let len = sp.n - sp.first;
        let g = hq % group;
        // SAFETY: (row i, head hq)'s len scores, at offset g·len of its K/V head's region (as written above);
        // this task alone touches them.
        let s = unsafe { std::slice::from_raw_parts_mut({ sc_ptr }.0.add((i * nh + hq - g) * lmax + g * len), len) };
        let mx = s.iter().fold(f32::NEG_INFINITY, |m, &d| m.max(d));
        softmax(s, mx, r.sinks.map(|s| s[hq]));
    });
    let blocks = hd.div_ceil(32);
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let scores = &sc;
    pool.run(t * nkv * blocks, |idx| {
        let (i, kh, b) = (idx / (nkv * blocks), idx / blocks % nkv, idx % blocks);
        let sp = r.span(i, kh);
        let len = sp.n - sp.first;
        let base = (i * nh + kh * group) * lmax;
        let cols = 32 * b..(32 * b + 32).min(hd);
        // SAFETY: cols inside 0..hd on multiples of 8 (whole blocks of 32 for Q8_0 rows); this task alone writes
        // columns `cols` of row i's heads kh·group .. (kh + 1)·group.
        let o = unsafe { { out_ptr }.0.add((i * nh + kh * group) * hd) };
        // SAFETY: as above; kern as this function's contract.
        unsafe { kern.values(i, kh, sp, &scores[base..base + group * len], cols, o) };
    });
    SPLIT.with(|c| *c.borrow_mut() = sc);
}

/// [`attend`] over Q8_0 K/V rows, as llama.cpp's flash attention over a Q8_0 cache computes it: the query
/// quantized to Q8_0 (per 32 values), each score the Q8_0 × Q8_0 product of a K row and the query times `scale`,
/// the softmax in f32 (probabilities not rounded), the V rows dequantized to f32 for the weighted sum. A few rows
/// run [`split_passes`]; a prompt chunk one task per row and K/V head (its heads share each row read).
fn attend_q8_0(pool: &WorkerPool, q: &[f32], k: &[u8], v: &[u8], r: &Call<'_>, out: &mut [f32]) {
    let (nh, nkv, hd) = (r.h.n_head, r.h.n_head_kv, r.h.head_dim);
    assert!(hd % 32 == 0, "Q8_0 KV rows: a head dimension that is a multiple of 32");
    let group = nh / nkv;
    let mut qb = vec![BlockQ8::default(); q.len() / 32];
    quant::quantize_q8(q, &mut qb);
    let kern = Q8Kernels {
        #[cfg(target_arch = "x86_64")]
        w: x86::Width::detect(),
        qb: &qb,
        k,
        v,
        h: r.h,
        scale: r.scale,
        rb: GgmlType::Q8_0.row_bytes(nkv * hd),
        hb: GgmlType::Q8_0.row_bytes(hd),
    };
    if r.t * nkv < 4 * pool.threads() {
        // SAFETY: the kernels read the rows `attend` checked (pos0 + t positions), nkv divides nh, hd % 32 == 0,
        // out holds t · nh · hd values.
        unsafe { split_passes(pool, r, &kern, out) };
        return;
    }
    let out_ptr = SyncPtr(out.as_mut_ptr());
    pool.run(r.t * nkv, |idx| {
        let (i, kh) = (idx / nkv, idx % nkv);
        let sp = r.span(i, kh);
        let len = sp.n - sp.first;
        SCORES.with(|cell| {
            let mut sc = cell.borrow_mut();
            sc.clear();
            sc.resize(group * len, 0.0);
            // SAFETY: sc holds group · len scores, this task's own.
            unsafe { kern.scores(i, kh, sp, 0..len, sc.as_mut_ptr()) };
            for (g, s) in sc.chunks_exact_mut(len).enumerate() {
                let mx = s.iter().fold(f32::NEG_INFINITY, |m, &d| m.max(d));
                softmax(s, mx, r.sinks.map(|s| s[kh * group + g]));
            }
            // SAFETY: task idx writes only row i's heads kh·group .. (kh + 1)·group, inside `out` (t · nh · hd
            // values); tasks are disjoint and `out` outlives `run`.
            let o = unsafe { { out_ptr }.0.add((i * nh + kh * group) * hd) };
            for b in 0..hd / 32 {
                // SAFETY: block b's columns of those heads, this task's own.
                unsafe { kern.values(i, kh, sp, &sc, 32 * b..32 * b + 32, o) };
            }
        });
    });
}

/// `o[x] += Σ_j wts[j] · V_j[x]` over Q8_0 rows (row `j`'s `o.len() / 32` blocks from byte `row(j)` of `v`), each
/// value `q · d` as the Q8_0 dequantizer gives it, added in position order (the portable path; the x86 kernels
/// give its bits).
fn values_q8_0(wts: &[f32], v: &[u8], row: impl Fn(usize) -> usize, o: &mut [f32]) {
    let mut vrow = [0f32; 32];
    for (j, &w) in wts.iter().enumerate() {
        for (c, blk) in v[row(j)..row(j) + o.len() / 32 * 34].chunks_exact(34).enumerate() {
            let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
            for (x, &b) in vrow.iter_mut().zip(&blk[2..]) {
                *x = (b as i8) as f32 * d;
            }
            for (y, x) in o[c * 32..(c + 1) * 32].iter_mut().zip(&vrow) {
                *y += w * x;
            }
        }
    }
}

/// The positions a query row attends to and where its K/V head's values sit in a position's row.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    /// First attended position.
    pub(super) first: usize,
    /// One past the last.
    pub(super) n: usize,
    /// Values per position.
    pub(super) kvd: usize,
    /// The head's first value in a position's row.
    pub(super) off: usize,
    /// Values per head.
    pub(super) hd: usize,
}

impl Span {
    /// The indices of position `p`'s values of this head in the K or V rows.
    pub(super) fn row(&self, p: usize) -> std::ops::Range<usize> {
        p * self.kvd + self.off..p * self.kvd + self.off + self.hd
    }
}

/// Softmax of `sc` in place (Q8_0 and f32 rows): each score minus the largest (`mx`, or the sink when that is
/// larger), exponentiated (libm's `exp`), divided by their sum (plus the sink's exponential).
fn softmax(sc: &mut [f32], mx: f32, sink: Option<f32>) {
    let mx = sink.map_or(mx, |s| mx.max(s));
    let mut sum = 0f32;
    for s in sc.iter_mut() {
        *s = (*s - mx).exp();
        sum += *s;
    }
    if let Some(s) = sink {
        sum += (s - mx).exp();
    }
    let inv = 1.0 / sum;
    for s in sc.iter_mut() {
        *s *= inv;
    }
}

/// One head over f32 rows: `o` = softmax(qv·Kᵀ · scale) · V over the span (one softmax, libm's `exp`).
#[allow(clippy::too_many_arguments)]
fn head_f32(
    qv: &[f32],
    k: &[f32],
    v: &[f32],
    sp: Span,
    scale: f32,
    sink: Option<f32>,
    sc: &mut Vec<f32>,
    o: &mut [f32],
) {
    sc.clear();
    let mut mx = f32::NEG_INFINITY;
    for p in sp.first..sp.n {
        let d = dot_f32(qv, &k[sp.row(p)]) * scale;
        mx = mx.max(d);
        sc.push(d);
    }
    softmax(sc, mx, sink);
    o.fill(0.0);
    for (j, &w) in sc.iter().enumerate() {
        for (x, y) in o.iter_mut().zip(&v[sp.row(sp.first + j)]) {
            *x += w * y;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values uniform in [-1, 1) from a linear congruential sequence seeded with `seed`.
    fn uniform(mut s: u32) -> impl FnMut() -> f32 {
        move || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// `n` positions of `kvd` random f16 keys and values (`(k, v)`, f16 bits).
    fn kv_rows(r: &mut impl FnMut() -> f32, n: usize, kvd: usize) -> (Vec<u16>, Vec<u16>) {
        let raw: Vec<f32> = (0..2 * n * kvd).map(|_| r() * 2.0).collect();
        let mut kv = vec![0u16; 2 * n * kvd];
        f16::from_f32_slice(&raw, &mut kv);
        let v = kv.split_off(n * kvd);
        (kv, v)
    }

    /// The f16 definition computed one row and head at a time by the portable passes (library fused
    /// multiply-adds): `out` for `t` rows of `q` (already rounded to f16).
    #[allow(clippy::too_many_arguments)]
    fn reference_f16(
        q: &[f32],
        k: &[u16],
        v: &[u16],
        h: Heads,
        (pos0, t): (usize, usize),
        window: usize,
        sinks: Option<&[f32]>,
        scale: f32,
    ) -> Vec<f32> {
        let (nh, hd) = (h.n_head, h.head_dim);
        let call = Call { h, pos0, t, scale, window, sinks };
        let mut out = vec![f32::NAN; t * nh * hd];
        let mut p = vec![0f32; CHUNK];
        for i in 0..t {
            for hq in 0..nh {
                let sp = call.span(i, hq / (nh / h.n_head_kv));
                let len = sp.n - sp.first;
                let nc = len.div_ceil(CHUNK);
                let (mut parts, mut sc) = (vec![0f32; nc * hd], vec![0f32; len]);
                let qh = &q[(i * nh + hq) * hd..(i * nh + hq + 1) * hd];
                let js = |c: usize| c * CHUNK..((c + 1) * CHUNK).min(len);
                for c in 0..nc {
                    chunk_scores(qh, k, sp, js(c), scale, (&mut sc[c * CHUNK..], len));
                }
                let m = softmax_exps(&mut [&mut sc[..]], sinks.map(|s| s[hq]));
                let inv = [softmax_inv(&[&mut sc[..]], m, sinks.map(|s| s[hq]))];
                for c in 0..nc {
                    chunk_values((&sc[c * CHUNK..], len), v, sp, js(c), &inv, &mut p, &mut parts[c * hd..(c + 1) * hd]);
                }
                sum_chunks(&parts, hd, nc, &mut out[(i * nh + hq) * hd..(i * nh + hq + 1) * hd]);
            }
        }
        out
    }

    /// The x86 passes (several heads per K/V head, rows converted once; AVX2 and, where the CPU has it, AVX-512)
    /// give the portable passes' bits — every score, largest score, exponential, probability and V product — for
    /// chunks of 1 to 128 positions not a multiple of the blocks, heads not a multiple of the widest registers,
    /// and 1 to 5 heads (one in five with a sink).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_x86_chunks_give_the_portable_bits() {
        let Some(best) = x86::Width::detect() else { return };
        let widths = if best == x86::Width::Avx512 { vec![x86::Width::Avx2, best] } else { vec![best] };
        let mut r = uniform(7);
        // (head dim, heads, K/V heads, positions, span start, chunk start, chunk length)
        let shapes = [
            (64usize, 3usize, 3usize, 300usize, 0usize, 128usize, 128usize),
            (128, 4, 2, 57, 20, 0, 37),
            (8, 1, 1, 9, 0, 0, 9),
            (80, 2, 1, 150, 3, 5, 100),
            (256, 2, 1, 40, 0, 17, 23),
            (64, 1, 1, 1, 0, 0, 1),
            (72, 5, 1, 200, 0, 64, 16),
            (24, 3, 2, 30, 0, 3, 17),
        ];
        for (w, (hd, per, nkv, n, first, j0, nj)) in widths.iter().flat_map(|&w| shapes.iter().map(move |&s| (w, s))) {
            let kvd = nkv * hd;
            let (k, v) = kv_rows(&mut r, n, kvd);
            let mut qv: Vec<f32> = (0..per * hd).map(|_| r()).collect();
            f16::round_slice(&mut qv);
            let sp = Span { first, n, kvd, off: (nkv - 1) * hd, hd };
            let js = j0..j0 + nj;
            let (mut sf, mut ss) = (vec![f32::NAN; per * CHUNK], vec![f32::NAN; per * CHUNK]);
            // SAFETY: the width was detected on this CPU; the span's rows lie inside k and v; hd % 8 == 0, hd <=
            // MAX_HD; js inside the span, at most CHUNK; the scores CHUNK apart.
            unsafe { x86::chunk_scores_f16(w, &qv, &k, sp, js.clone(), 0.125, (sf.as_mut_ptr(), CHUNK)) };
            chunk_scores(&qv, &k, sp, js.clone(), 0.125, (&mut ss, CHUNK));
            let heads = |x: &[f32]| (0..per).flat_map(|g| x[g * CHUNK..g * CHUNK + nj].to_vec()).collect::<Vec<f32>>();
            let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
            let wide = w == x86::Width::Avx512;
            let what = format!("hd {hd}, {per} heads, {nj} positions, AVX-512 {wide}");
            assert!(same(&heads(&sf), &heads(&ss)), "scores: {what}");
            // each head's exponentials (as two segments when there are two or more positions) and normalizer
            let mut invs = Vec::new();
            for g in 0..per {
                let cut = nj / 2;
                let (fa, fb) = sf[g * CHUNK..g * CHUNK + nj].split_at_mut(cut);
                let (sa, sb) = ss[g * CHUNK..g * CHUNK + nj].split_at_mut(cut);
                // one head in five with a sink above every score (it sets M)
                let sink = (g % 5 == 4).then(|| sa.iter().chain(sb.iter()).fold(0f32, |a, &b| a.max(b)) + 3.0);
                // SAFETY: as above.
                let mf = unsafe { x86::exps_f16(w, &mut [fa, fb], sink) };
                let ms = softmax_exps(&mut [sa, sb], sink);
                assert_eq!(mf.to_bits(), ms.to_bits(), "largest score: {what}");
                invs.push(softmax_inv(&[&mut ss[g * CHUNK..g * CHUNK + nj]], ms, sink));
            }
            assert!(same(&heads(&sf), &heads(&ss)), "exponentials: {what}");
            let (mut fast, mut slow) = (vec![f32::NAN; per * hd], vec![f32::NAN; per * hd]);
            let (mut pf, mut ps) = (vec![0f32; per * CHUNK], vec![0f32; per * CHUNK]);
            // SAFETY: as above; the exponentials written above.
            unsafe { x86::chunk_values_f16(w, (sf.as_ptr(), CHUNK), &v, sp, js.clone(), &invs, &mut pf, &mut fast) };
            chunk_values((&ss, CHUNK), &v, sp, js, &invs, &mut ps, &mut slow);
            assert!(same(&pf, &ps), "probabilities: {what}");
            assert!(same(&fast, &slow), "V products: {what}");
        }
    }

    /// `attend` over f16 rows gives the definition's bits (the per-row, per-head portable reference) whichever
    /// path runs it: one or two pool threads, a decode split over chunks (with and without a split over K/V
    /// heads; rows with different numbers of chunks) or the per-row tasks of a prompt, with this CPU's kernels;
    /// several rows give each row's bits of one row at a time; with and without sliding windows (one longer than
    /// a chunk) and sinks, and for head dimensions the x86 kernels do not take.
    #[test]
    fn f16_attention_gives_the_same_bits_every_way() {
        let pools = [WorkerPool::new(1).expect("pool"), WorkerPool::new(2).expect("pool")];
        let mut r = uniform(11);
        for (nh, nkv, hd, pos0, t, window, sinks) in [
            (9usize, 3usize, 64usize, 700usize, 1usize, 0usize, false),
            (4, 1, 256, 133, 2, 50, true),
            (4, 4, 40, 5, 1, 0, true),
            (6, 2, 72, 0, 1, 0, false),
            (8, 2, 64, 100, 3, 0, true),
            (8, 2, 64, 300, 3, 120, false),
            (6, 3, 64, 260, 9, 0, true),
            (4, 2, 20, 150, 5, 0, false),
            (2, 1, 64, 40, 20, 33, false),
            (8, 2, 64, 126, 3, 0, true),
            (6, 2, 64, 300, 1, 200, false),
            // six heads per K/V head in a prompt chunk: the softmax sums four heads side by side, then two
            (12, 2, 32, 290, 10, 0, true),
            // prompt blocks of rows whose last chunks differ (rows of 123 .. 135 positions: the block of 127 ..
            // 130 crosses a chunk's end with one thread and with two; 13 rows: a last block of one row), with eight
            // heads per K/V head (more V products than one pass holds)
            (9, 3, 64, 122, 13, 0, false),
            (16, 2, 128, 250, 11, 0, true),
            (8, 1, 40, 127, 9, 0, false),
            // a window that moves the span start inside a block (rows with and without a full window)
            (6, 2, 64, 95, 12, 100, true),
        ] {
            let (qd, kvd, n) = (nh * hd, nkv * hd, pos0 + t);
            let (k, v) = kv_rows(&mut r, n, kvd);
            let q: Vec<f32> = (0..t * qd).map(|_| r()).collect();
            let sink: Option<Vec<f32>> = sinks.then(|| (0..nh).map(|_| r() * 4.0).collect());
            let h = Heads { n_head: nh, n_head_kv: nkv, head_dim: hd };
            let mut qr = q.clone();
            f16::round_slice(&mut qr);
            let want = reference_f16(&qr, &k, &v, h, (pos0, t), window, sink.as_deref(), 0.125);
            let same = |got: &[f32]| got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            let (kr, vr) = (KvRows::F16(&k), KvRows::F16(&v));
            for pool in &pools {
                let mut got = vec![f32::NAN; t * qd];
                attend(pool, &mut q.clone(), kr, vr, h, (pos0, t), 0.125, window, sink.as_deref(), &mut got);
                let th = pool.threads();
                assert!(same(&got), "{nh} heads / {nkv}, hd {hd}, t {t}, window {window}, {th} threads");
                // each row alone (a decode step at its position) gives its bits in the batch
                for i in 0..t {
                    let mut one = vec![f32::NAN; qd];
                    let mut qi = q[i * qd..(i + 1) * qd].to_vec();
                    attend(pool, &mut qi, kr, vr, h, (pos0 + i, 1), 0.125, window, sink.as_deref(), &mut one);
                    let row = &want[i * qd..(i + 1) * qd];
                    assert!(one.iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits()), "row {i} alone, t {t}");
                }
            }
        }
    }

    /// The f16 definition is attention with llama.cpp's roundings: within 2e-5 (outputs of about ±2) of softmax
    /// attention computed in f64 over the same f16 values (the query rounded to f16) with each probability rounded
    /// to f16, and within 2e-3 without that rounding; with sinks, windows and contexts of one to several chunks.
    #[test]
    fn f16_attention_is_softmax_attention() {
        let pool = WorkerPool::new(2).expect("pool");
        let mut r = uniform(3);
        for (nh, nkv, hd, pos0, t, window, sinks) in [
            (6usize, 2usize, 64usize, 1000usize, 1usize, 0usize, true),
            (4, 4, 32, 20, 4, 0, false),
            (8, 2, 64, 400, 2, 300, true),
            (3, 1, 128, 129, 1, 0, false),
        ] {
            let (qd, kvd, n) = (nh * hd, nkv * hd, pos0 + t);
            let (k, v) = kv_rows(&mut r, n, kvd);
            let mut q: Vec<f32> = (0..t * qd).map(|_| r()).collect();
            let sink: Option<Vec<f32>> = sinks.then(|| (0..nh).map(|_| r() * 4.0).collect());
            let h = Heads { n_head: nh, n_head_kv: nkv, head_dim: hd };
            let mut got = vec![f32::NAN; t * qd];
            let (kr, vr) = (KvRows::F16(&k), KvRows::F16(&v));
            attend(&pool, &mut q, kr, vr, h, (pos0, t), 0.125, window, sink.as_deref(), &mut got);
            let f = |x: u16| f16_to_f32(x) as f64;
            let (mut worst, mut worst_unrounded) = (0f64, 0f64);
            for i in 0..t {
                for hq in 0..nh {
                    let (nn, kh) = (pos0 + i + 1, hq / (nh / nkv));
                    let first = if window > 0 { nn.saturating_sub(window) } else { 0 };
                    let qh = &q[i * qd + hq * hd..i * qd + (hq + 1) * hd];
                    let sc: Vec<f64> = (first..nn)
                        .map(|p| (0..hd).map(|x| qh[x] as f64 * f(k[p * kvd + kh * hd + x])).sum::<f64>() * 0.125)
                        .collect();
                    let sk = sink.as_ref().map(|s| s[hq] as f64);
                    let mx = sc.iter().cloned().chain(sk).fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().chain(sk.as_ref()).map(|&x| (x - mx).exp()).sum();
                    let pr = |p: usize| (sc[p - first] - mx).exp() / z;
                    let p16 = |p: usize| half::f16::from_f64(pr(p)).to_f64();
                    for x in 0..hd {
                        let g = got[i * qd + hq * hd + x] as f64;
                        let want: f64 = (first..nn).map(|p| p16(p) * f(v[p * kvd + kh * hd + x])).sum();
                        worst = worst.max((g - want).abs());
                        let exact: f64 = (first..nn).map(|p| pr(p) * f(v[p * kvd + kh * hd + x])).sum();
                        worst_unrounded = worst_unrounded.max((g - exact).abs());
                    }
                }
            }
            assert!(worst < 2e-5, "{nh} heads, hd {hd}, {n} positions: off by {worst}");
            assert!(worst_unrounded < 2e-3, "{nh} heads, hd {hd}, {n} positions: off by {worst_unrounded}");
        }
    }

    /// Attention over a Q8_0 cache is its definition: the query quantized to Q8_0, scores from the dequantized
    /// K rows, an f32 softmax (with a sink), the dequantized V rows weighted (checked in f64 on random rows, for
    /// the three-pass split of few rows and the per-(row, K/V head) tasks of a chunk, with and without windows);
    /// and the x86 V kernels give the portable loop's bits.
    #[test]
    fn q8_0_cache_attention_is_its_definition() {
        use crate::backend::kv::{KvCache, KvType};
        let pool = WorkerPool::new(2).expect("pool");
        let mut r = uniform(5);
        for (nh, nkv, hd, pos0, t, window, sinks) in [
            (6usize, 2usize, 64usize, 300usize, 1usize, 0usize, false),
            (4, 1, 96, 40, 3, 17, true),
            (8, 2, 64, 50, 5, 0, true),
            (6, 3, 32, 20, 4, 9, false),
        ] {
            let (qd, kvd, n) = (nh * hd, nkv * hd, pos0 + t);
            let mut kv = KvCache::with_type(1, n, kvd, KvType::Q8_0);
            for p in 0..n {
                let (k, v): (Vec<f32>, Vec<f32>) = (0..kvd).map(|_| (r() * 3.0, r())).unzip();
                kv.store(0, p, &k, &v);
            }
            let (KvRows::Q8_0(kb), KvRows::Q8_0(vb)) = (kv.keys(0, n), kv.values(0, n)) else { panic!("q8_0") };
            let deq = |b: &[u8]| {
                let mut x = vec![0f32; b.len() / 34 * 32];
                quant::dequantize_row(GgmlType::Q8_0, b, &mut x).unwrap();
                x
            };
            let (kf, vf) = (deq(kb), deq(vb));
            let q: Vec<f32> = (0..t * qd).map(|_| r()).collect();
            let sink: Option<Vec<f32>> = sinks.then(|| (0..nh).map(|_| r()).collect());
            let mut qb = vec![BlockQ8::default(); t * qd / 32];
            quant::quantize_q8(&q, &mut qb);
            let qf: Vec<f32> = qb.iter().flat_map(|b| b.qs.map(|c| c as f32 * b.d)).collect();
            let h = Heads { n_head: nh, n_head_kv: nkv, head_dim: hd };
            let mut got = vec![f32::NAN; t * qd];
            let kvr = (kv.keys(0, n), kv.values(0, n));
            attend(&pool, &mut q.clone(), kvr.0, kvr.1, h, (pos0, t), 0.125, window, sink.as_deref(), &mut got);
            for i in 0..t {
                for hq in 0..nh {
                    let (nn, kh) = (pos0 + i + 1, hq / (nh / nkv));
                    let first = if window > 0 { nn.saturating_sub(window) } else { 0 };
                    let qh = &qf[i * qd + hq * hd..i * qd + (hq + 1) * hd];
                    let sc: Vec<f64> = (first..nn)
                        .map(|p| {
                            let kr = &kf[p * kvd + kh * hd..p * kvd + (kh + 1) * hd];
                            qh.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * 0.125
                        })
                        .collect();
                    let sk = sink.as_ref().map(|s| s[hq] as f64);
                    let mx = sc.iter().cloned().chain(sk).fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().chain(sk.as_ref()).map(|&x| (x - mx).exp()).sum();
                    for x in 0..hd {
                        let want: f64 = (first..nn)
                            .map(|p| (sc[p - first] - mx).exp() / z * vf[p * kvd + kh * hd + x] as f64)
                            .sum();
                        let g = got[i * qd + hq * hd + x] as f64;
                        assert!((g - want).abs() < 2e-5, "row {i} head {hq} [{x}]: {g} vs {want}");
                    }
                }
            }
            // the x86 V kernels against the portable loop, bit for bit
            #[cfg(target_arch = "x86_64")]
            if let Some(best) = x86::Width::detect() {
                let wts: Vec<f32> = (0..n).map(|_| r().abs()).collect();
                let rb = GgmlType::Q8_0.row_bytes(kvd);
                let mut want = vec![0f32; hd];
                values_q8_0(&wts, vb, |j| j * rb, &mut want);
                for w in [x86::Width::Avx2, best] {
                    let mut fast = vec![0f32; hd];
                    // SAFETY: the width was detected on this CPU; hd % 32 == 0; every row lies inside vb.
                    unsafe { x86::values_q8_0(w, &wts, vb, |j| j * rb, &mut fast) };
                    assert!(fast.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "x86 Q8_0 values");
                }
            }
        }
    }

    /// A sink is a softmax position without a value: the probabilities are those of a softmax over the scores and
    /// the sink, the sink's own dropped (so they sum to 1 − its share); without one they sum to 1.
    #[test]
    fn a_sink_takes_its_share_of_the_softmax() {
        let scores = [0.5f32, -1.0, 2.0, 0.25];
        for sink in [-3.0f32, 1.0, 9.0] {
            let mut sc = scores.to_vec();
            let mx = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            softmax(&mut sc, mx, Some(sink));
            let all: Vec<f64> = scores.iter().chain([&sink]).map(|&v| (v as f64).exp()).collect();
            let z: f64 = all.iter().sum();
            for (p, e) in sc.iter().zip(&all) {
                assert!((*p as f64 - e / z).abs() < 1e-6, "sink {sink}: {p} vs {}", e / z);
            }
            let share = all[4] / z;
            assert!((sc.iter().sum::<f32>() as f64 - (1.0 - share)).abs() < 1e-6);
        }
        let mut sc = scores.to_vec();
        softmax(&mut sc, 2.0, None);
        assert!((sc.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
