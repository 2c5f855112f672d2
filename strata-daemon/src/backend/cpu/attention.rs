//! Causal attention of a chunk of query rows over the KV cache (CPU), softmax in f32.
//!
//! - f16 rows: llama.cpp's F16-cache roundings (queries and probabilities to f16). A prompt chunk runs one task
//!   per row and K/V head (the query heads sharing it); a few rows (decode) run three passes over the pool
//!   (scores by block of positions, softmax by head, V by block of columns), so each row is read once and the
//!   pool still has tasks enough. The x86 kernels ([`super::attention_x86`]) give the bits of the portable
//!   per-head path, whose products ([`crate::quant::f16`]) give those of f32 products over the same values.
//! - Q8_0 rows (`--kv-type q8_0`): as llama.cpp's flash attention over a Q8_0 cache (query quantized to Q8_0,
//!   V dequantized to f32); one task per row and query head.
//! - f32 rows: the exact reference precision.

use std::cell::RefCell;

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

thread_local! {
    /// A task's scores, then probabilities (one per attended position).
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// [`split_passes`]' scores of every row and head, kept by the calling thread between calls (a decode token
    /// would otherwise allocate and zero one per layer).
    static SPLIT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out` (`t × n_head × head_dim`) = softmax(q·Kᵀ · scale) · V for the `t` rows of `q` (same shape) at positions
/// `pos0 ..`, each attending to positions `0 ..= its own` (the last `window` of them when `window > 0`). `sinks`
/// (`n_head` logits, when given): head h's softmax also counts `e^sinks[h]` in its denominator, a position
/// without a value (ggml's `soft_max` with sinks: the largest of the scores and the sink is subtracted). `keys`
/// and `values` hold at least `pos0 + t` positions of `n_head_kv × head_dim` values, both of one kind. f16 rows:
/// `q` is rounded to f16 first (in place) and the probabilities before the product with V, as llama.cpp does over
/// its F16 cache. Q8_0 rows: `q` is quantized to Q8_0 for the scores (left as it is), the probabilities stay f32.
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
    let r16 = matches!(keys, KvRows::F16(_));
    assert!(h.n_head_kv > 0 && nh % h.n_head_kv == 0, "attention: {nh} query heads over {} K/V heads", h.n_head_kv);
    assert!(q.len() >= t * qd && out.len() >= t * qd, "attention buffers");
    let n = pos0 + t;
    let held = |r: KvRows<'_>| match r {
        KvRows::F16(x) => x.len() >= n * kvd,
        KvRows::F32(x) => x.len() >= n * kvd,
        KvRows::Q8_0(x) => kvd % 32 == 0 && x.len() >= n * GgmlType::Q8_0.row_bytes(kvd),
    };
    assert!(held(keys) && held(values), "attention: the K/V rows hold fewer than {n} positions");
    if let (KvRows::Q8_0(k), KvRows::Q8_0(v)) = (keys, values) {
        let call = Call { h, pos0, t, scale, window, sinks };
        attend_q8_0(pool, &q[..t * qd], k, v, &call, &mut out[..t * qd]);
        return;
    }
    if r16 {
        f16::round_slice(&mut q[..t * qd]);
    }
    let q = &*q;
    let group = nh / h.n_head_kv;
    #[cfg(target_arch = "x86_64")]
    let width = x86::Width::detect();
    #[cfg(target_arch = "x86_64")]
    if let (KvRows::F16(k), KvRows::F16(v), Some(w)) = (keys, values, width) {
        if t * h.n_head_kv < 4 * pool.threads() && hd % 8 == 0 && hd <= x86::MAX_HD {
            let call = Call { h, pos0, t, scale, window, sinks };
            let kern = F16Kernels { w, q, k, v, h, scale };
            // SAFETY: `w` is what this CPU runs, hd % 8 == 0 and hd <= MAX_HD; keys and values are f16 rows holding
            // pos0 + t positions of kvd values, n_head_kv divides n_head, out holds t · qd values (asserted above).
            unsafe { split_passes(pool, &call, &kern, out) };
            return;
        }
    }
    // a task: one row's heads that share a K/V head (their K and V rows converted once), or one head where that
    // would leave the pool short of tasks (a decode row)
    let per = if t * h.n_head_kv >= 4 * pool.threads() { group } else { 1 };
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let task = |idx: usize| {
        let (i, h0) = (idx / (nh / per), idx % (nh / per) * per);
        // SAFETY: task `idx` writes only out[(i*nh + h0)*hd .. (i*nh + h0 + per)*hd], inside the t*qd buffer
        // (asserted above); tasks are disjoint and the buffer outlives `run`.
        let o = unsafe { std::slice::from_raw_parts_mut({ out_ptr }.0.add((i * nh + h0) * hd), per * hd) };
        let kh = h0 / group;
        let qv = &q[i * qd + h0 * hd..i * qd + (h0 + per) * hd];
        let n = pos0 + i + 1; // causal: positions 0..=pos0+i
        let first = if window > 0 { n.saturating_sub(window) } else { 0 };
        let span = Span { first, n, kvd, off: kh * hd, hd };
        SCORES.with(|cell| {
            let mut sc = cell.borrow_mut();
            #[cfg(target_arch = "x86_64")]
            if let (KvRows::F16(k), KvRows::F16(v), Some(w)) = (keys, values, width) {
                if hd % 8 == 0 && hd <= x86::MAX_HD {
                    // SAFETY: `width` is what this CPU runs; the span's rows lie inside keys and values (they hold
                    // pos0 + t positions of kvd values and kh * hd + hd <= kvd, asserted above), qv and o hold
                    // `per` heads.
                    unsafe { x86::heads_f16(w, qv, k, v, span, scale, sinks.map(|s| &s[h0..h0 + per]), &mut sc, o) };
                    return;
                }
            }
            for g in 0..per {
                let (qh, oh) = (&qv[g * hd..(g + 1) * hd], &mut o[g * hd..(g + 1) * hd]);
                head(qh, keys, values, span, scale, r16, sinks.map(|s| s[h0 + g]), &mut sc, oh);
            }
        });
    };
    pool.run(t * nh / per, task);
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

/// The kernels of one kind of K/V rows for [`split_passes`] and the per-(row, K/V head) tasks: each works on the
/// query heads of one row that share a K/V head (`group` of them), reading each K and V row once for all.
trait GroupKernels: Sync {
    /// Whether the probabilities are rounded to f16 before the product with V.
    const R16: bool;

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
    /// As `scores`; `cols` inside `0..hd` with bounds on multiples of 8 (of 32 for Q8_0 rows); `o` (the row's
    /// first head of the group) valid for writes of those columns of the `group` heads and no one else touching
    /// them meanwhile.
    unsafe fn values(&self, i: usize, kh: usize, sp: Span, sc: &[f32], cols: std::ops::Range<usize>, o: *mut f32);
}

/// f16 rows on x86 ([`x86::scores_f16`], [`x86::values_f16`]) for queries `q` already rounded to f16.
#[cfg(target_arch = "x86_64")]
struct F16Kernels<'a> {
    w: x86::Width,
    q: &'a [f32],
    k: &'a [u16],
    v: &'a [u16],
    h: Heads,
    scale: f32,
}

#[cfg(target_arch = "x86_64")]
impl GroupKernels for F16Kernels<'_> {
    const R16: bool = true;

    unsafe fn scores(&self, i: usize, kh: usize, sp: Span, js: std::ops::Range<usize>, sc: *mut f32) {
        let (hd, group) = (self.h.head_dim, self.h.n_head / self.h.n_head_kv);
        let q0 = (i * self.h.n_head + kh * group) * hd;
        // SAFETY: the CPU runs w and hd % 8 == 0, hd <= MAX_HD (the constructor's contract); js and sc as this
        // function's contract; the span's rows lie inside k.
        unsafe { x86::scores_f16(self.w, &self.q[q0..q0 + group * hd], self.k, sp, self.scale, js, sc) };
    }

    unsafe fn values(&self, _i: usize, _kh: usize, sp: Span, sc: &[f32], cols: std::ops::Range<usize>, o: *mut f32) {
        // SAFETY: as in `scores`; cols on multiples of 8 inside 0..hd; o as this function's contract.
        unsafe { x86::values_f16(self.w, sc, self.v, sp, cols, o) };
    }
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
    const R16: bool = false;

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
        softmax(s, mx, K::R16, r.sinks.map(|s| s[hq]));
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
                softmax(s, mx, false, r.sinks.map(|s| s[kh * group + g]));
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

/// Softmax of `sc` in place: each score minus the largest (`mx`, or the sink when that is larger),
/// exponentiated, divided by their sum (plus the sink's exponential), rounded to f16 when `r16`.
pub(super) fn softmax(sc: &mut [f32], mx: f32, r16: bool, sink: Option<f32>) {
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
    if r16 {
        f16::round_slice(sc);
    }
}

/// One head (the portable path and f32 rows): `o` = softmax(qv·Kᵀ · scale) · V over the span.
#[allow(clippy::too_many_arguments)]
fn head(
    qv: &[f32],
    keys: KvRows<'_>,
    values: KvRows<'_>,
    sp: Span,
    scale: f32,
    r16: bool,
    sink: Option<f32>,
    sc: &mut Vec<f32>,
    o: &mut [f32],
) {
    sc.clear();
    let mut mx = f32::NEG_INFINITY;
    for p in sp.first..sp.n {
        let d = match keys {
            KvRows::F16(k) => f16::dot(qv, &k[sp.row(p)]),
            KvRows::F32(k) => dot_f32(qv, &k[sp.row(p)]),
            KvRows::Q8_0(_) => unreachable!("Q8_0 rows run through attend_q8_0"),
        } * scale;
        mx = mx.max(d);
        sc.push(d);
    }
    softmax(sc, mx, r16, sink);
    o.fill(0.0);
    for (j, &w) in sc.iter().enumerate() {
        match values {
            KvRows::F16(v) => f16::axpy(o, w, &v[sp.row(sp.first + j)]),
            KvRows::F32(v) => {
                for (x, y) in o.iter_mut().zip(&v[sp.row(sp.first + j)]) {
                    *x += w * y;
                }
            }
            KvRows::Q8_0(_) => unreachable!("Q8_0 rows run through attend_q8_0"),
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

    /// The x86 kernels (several heads per K/V head, rows converted once, eight positions per score block; AVX2
    /// and, where the CPU has it, AVX-512) give the bits of the per-head path, with and without a sliding window,
    /// for spans not a multiple of the blocks and heads not a multiple of the widest registers.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn grouped_heads_match_one_head_at_a_time() {
        let Some(best) = x86::Width::detect() else { return };
        let widths = if best == x86::Width::Avx512 { vec![x86::Width::Avx2, best] } else { vec![best] };
        let mut r = uniform(7);
        let shapes = [
            (64usize, 3usize, 3usize, 300usize, 0usize),
            (128, 4, 2, 57, 20),
            (8, 1, 1, 9, 0),
            (80, 2, 1, 150, 3),
            (256, 2, 1, 40, 0),
            (64, 1, 1, 1, 0),
        ];
        for (w, (hd, per, nkv, n, first)) in widths.iter().flat_map(|&w| shapes.iter().map(move |&s| (w, s))) {
            let kvd = nkv * hd;
            let raw: Vec<f32> = (0..2 * n * kvd).map(|_| r()).collect();
            let mut kv = vec![0u16; 2 * n * kvd];
            f16::from_f32_slice(&raw, &mut kv);
            let (k, v) = kv.split_at(n * kvd);
            let mut qv: Vec<f32> = (0..per * hd).map(|_| r()).collect();
            f16::round_slice(&mut qv);
            let sp = Span { first, n, kvd, off: (nkv - 1) * hd, hd };
            // sinks on two of the three shapes, one of them larger than every score
            let sinks = (first > 0 || hd == 8).then(|| (0..per).map(|g| g as f32 * 3.0 - 1.0).collect::<Vec<f32>>());
            let (mut fast, mut slow) = (vec![f32::NAN; per * hd], vec![f32::NAN; per * hd]);
            let mut sc = Vec::new();
            // SAFETY: the width was detected on this CPU; the span's rows lie inside k and v; shapes as documented.
            unsafe { x86::heads_f16(w, &qv, k, v, sp, 0.125, sinks.as_deref(), &mut sc, &mut fast) };
            for g in 0..per {
                let q = &qv[g * hd..(g + 1) * hd];
                let sink = sinks.as_ref().map(|s| s[g]);
                head(
                    q,
                    KvRows::F16(k),
                    KvRows::F16(v),
                    sp,
                    0.125,
                    true,
                    sink,
                    &mut sc,
                    &mut slow[g * hd..(g + 1) * hd],
                );
            }
            let wide = w == x86::Width::Avx512;
            assert!(fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()), "hd {hd}, {per} heads, {wide}");
        }
    }

    /// A few rows (decode: the three-pass split over the pool, on AVX2 and, where the CPU has it, AVX-512) give
    /// the bits of the per-head path, with and without a sliding window and sinks, for grouped and ungrouped
    /// heads, several rows of different span lengths, and spans not a multiple of a block; `attend` takes the
    /// split for these shapes and gives the same.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn decode_rows_match_one_head_at_a_time() {
        let Some(best) = x86::Width::detect() else { return };
        let pool = WorkerPool::new(2).expect("pool");
        let mut r = uniform(11);
        for (nh, nkv, hd, pos0, t, window, sinks) in [
            (9usize, 3usize, 64usize, 700usize, 1usize, 0usize, false),
            (4, 1, 256, 133, 2, 50, true),
            (4, 4, 40, 5, 1, 0, true),
            (6, 2, 72, 0, 1, 0, false),
            (8, 2, 64, 100, 3, 0, true),
            (8, 2, 64, 300, 3, 120, false),
        ] {
            assert!(t * nkv < 4 * pool.threads(), "a shape attend splits");
            let (qd, kvd, n) = (nh * hd, nkv * hd, pos0 + t);
            let raw: Vec<f32> = (0..2 * n * kvd).map(|_| r()).collect();
            let mut kv = vec![0u16; 2 * n * kvd];
            f16::from_f32_slice(&raw, &mut kv);
            let (k, v) = kv.split_at(n * kvd);
            let mut q: Vec<f32> = (0..t * qd).map(|_| r()).collect();
            let sink: Option<Vec<f32>> = sinks.then(|| (0..nh).map(|_| r() * 4.0).collect());
            let h = Heads { n_head: nh, n_head_kv: nkv, head_dim: hd };
            let mut via_attend = vec![f32::NAN; t * qd];
            let (kr, vr) = (KvRows::F16(k), KvRows::F16(v));
            attend(&pool, &mut q.clone(), kr, vr, h, (pos0, t), 0.125, window, sink.as_deref(), &mut via_attend);
            f16::round_slice(&mut q);
            let mut want = vec![f32::NAN; t * qd];
            let mut sc = Vec::new();
            for i in 0..t {
                for hq in 0..nh {
                    let nn = pos0 + i + 1;
                    let first = if window > 0 { nn.saturating_sub(window) } else { 0 };
                    let sp = Span { first, n: nn, kvd, off: hq / (nh / nkv) * hd, hd };
                    let (lo, hi) = (i * qd + hq * hd, i * qd + (hq + 1) * hd);
                    let sk = sink.as_ref().map(|s| s[hq]);
                    head(&q[lo..hi], kr, vr, sp, 0.125, true, sk, &mut sc, &mut want[lo..hi]);
                }
            }
            let same = |got: &[f32]| got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same(&via_attend), "attend: {nh} heads / {nkv}, hd {hd}, t {t}, window {window}");
            for w in [x86::Width::Avx2, best] {
                let call = Call { h, pos0, t, scale: 0.125, window, sinks: sink.as_deref() };
                let mut got = vec![f32::NAN; t * qd];
                // SAFETY: the width was detected on this CPU; nkv divides nh; k and v hold n positions of kvd
                // values; hd % 8 == 0 and hd <= MAX_HD; q and got hold t · qd values.
                unsafe { split_passes(&pool, &call, &F16Kernels { w, q: &q, k, v, h, scale: 0.125 }, &mut got) };
                let wide = w == x86::Width::Avx512;
                assert!(same(&got), "split: {nh} heads / {nkv}, hd {hd}, t {t}, window {window}, AVX-512 {wide}");
            }
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
            softmax(&mut sc, mx, false, Some(sink));
            let all: Vec<f64> = scores.iter().chain([&sink]).map(|&v| (v as f64).exp()).collect();
            let z: f64 = all.iter().sum();
            for (p, e) in sc.iter().zip(&all) {
                assert!((*p as f64 - e / z).abs() < 1e-6, "sink {sink}: {p} vs {}", e / z);
            }
            let share = all[4] / z;
            assert!((sc.iter().sum::<f32>() as f64 - (1.0 - share)).abs() < 1e-6);
        }
        let mut sc = scores.to_vec();
        softmax(&mut sc, 2.0, false, None);
        assert!((sc.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
