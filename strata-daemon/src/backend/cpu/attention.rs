//! Causal attention of a chunk of query rows over the KV cache (CPU): one task per row and K/V head (the query
//! heads sharing it; per query head for a decode row, so the pool has tasks enough), softmax in f32
//! with llama.cpp's F16-cache roundings (queries and probabilities to f16) unless the cache holds f32 rows (the
//! exact reference precision). f16 rows are read through [`crate::quant::f16`]'s products, which give the bits
//! of the f32 products over the same values.

use std::cell::RefCell;

use super::math::dot_f32;
use super::matmul::SyncPtr;
use crate::backend::kv::KvRows;
use crate::pool::WorkerPool;
use crate::quant::f16;

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
}

/// `out` (`t × n_head × head_dim`) = softmax(q·Kᵀ · scale) · V for the `t` rows of `q` (same shape) at positions
/// `pos0 ..`, each attending to positions `0 ..= its own` (the last `window` of them when `window > 0`). `sinks`
/// (`n_head` logits, when given): head h's softmax also counts `e^sinks[h]` in its denominator, a position
/// without a value (ggml's `soft_max` with sinks: the largest of the scores and the sink is subtracted). `keys`
/// and `values` hold at least `pos0 + t` positions of `n_head_kv × head_dim` values. f16 rows: `q` is rounded to
/// f16 first (in place) and the probabilities before the product with V, as llama.cpp does over its F16 cache.
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
    assert!(q.len() >= t * qd && out.len() >= t * qd, "attention buffers");
    if r16 {
        f16::round_slice(&mut q[..t * qd]);
    }
    let q = &*q;
    let group = nh / h.n_head_kv;
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
            if let (KvRows::F16(k), KvRows::F16(v)) = (keys, values) {
                if hd % 8 == 0 && hd <= 256 && per <= 64 && crate::quant::simd_level().avx2() {
                    // SAFETY: AVX2 and F16C were detected; the span's rows lie inside keys and values (they hold
                    // pos0 + t positions of kvd values, kh * hd + hd <= kvd), qv and o hold `per` heads.
                    unsafe { heads_f16_avx2(qv, k, v, span, scale, sinks.map(|s| &s[h0..h0 + per]), &mut sc, o) };
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

/// The positions a query row attends to and where its K/V head's values sit in a position's row.
#[derive(Debug, Clone, Copy)]
struct Span {
    /// First attended position.
    first: usize,
    /// One past the last.
    n: usize,
    /// Values per position.
    kvd: usize,
    /// The head's first value in a position's row.
    off: usize,
    /// Values per head.
    hd: usize,
}

impl Span {
    fn row(&self, p: usize) -> std::ops::Range<usize> {
        p * self.kvd + self.off..p * self.kvd + self.off + self.hd
    }
}

/// Softmax of `sc` in place: each score minus the largest (`mx`, or the sink when that is larger),
/// exponentiated, divided by their sum (plus the sink's exponential), rounded to f16 when `r16`.
fn softmax(sc: &mut [f32], mx: f32, r16: bool, sink: Option<f32>) {
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
        }
    }
}

/// `qv.len() / hd` heads sharing one K/V head over f16 rows (AVX2 + F16C; `sinks`: theirs, one per head): each
/// position's K and V rows are converted once for all of them. The same bits as [`head`]: each score is [`f16::dot`]'s sum (eight lanes of
/// products added in position order, reduced in `dot_f32`'s order), each output value the same sequence of
/// multiplies and adds.
///
/// # Safety
/// AVX2 and F16C must be available; `sp.hd % 8 == 0`, `sp.hd <= 256`, at most 64 heads; every row of the span lies inside `k` and
/// `v`; `o.len() == qv.len()`, a multiple of `sp.hd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn heads_f16_avx2(
    qv: &[f32],
    k: &[u16],
    v: &[u16],
    sp: Span,
    scale: f32,
    sinks: Option<&[f32]>,
    sc: &mut Vec<f32>,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (hd, per) = (sp.hd, qv.len() / sp.hd);
    let (c8, len) = (hd / 8, sp.n - sp.first);
    let mut row = [_mm256_setzero_ps(); 32];
    sc.clear();
    sc.resize(per * len, 0.0);
    let mut mx = [f32::NEG_INFINITY; 64];
    for (j, p) in (sp.first..sp.n).enumerate() {
        load_row(&k[sp.row(p)], &mut row[..c8]);
        for g in 0..per {
            let mut acc = _mm256_setzero_ps();
            for (c, r) in row.iter().enumerate().take(c8) {
                // SAFETY: (g * hd + 8c) + 8 <= per * hd = qv.len().
                let x = unsafe { _mm256_loadu_ps(qv.as_ptr().add(g * hd + 8 * c)) };
                acc = _mm256_add_ps(acc, _mm256_mul_ps(x, *r));
            }
            let mut l = [0f32; 8];
            // SAFETY: eight lanes into eight floats.
            unsafe { _mm256_storeu_ps(l.as_mut_ptr(), acc) };
            let d = f16::reduce8(&l) * scale;
            mx[g] = mx[g].max(d);
            sc[g * len + j] = d;
        }
    }
    for g in 0..per {
        softmax(&mut sc[g * len..(g + 1) * len], mx[g], true, sinks.map(|s| s[g]));
    }
    o.fill(0.0);
    for (j, p) in (sp.first..sp.n).enumerate() {
        load_row(&v[sp.row(p)], &mut row[..c8]);
        for g in 0..per {
            let w = _mm256_set1_ps(sc[g * len + j]);
            for (c, r) in row.iter().enumerate().take(c8) {
                // SAFETY: (g * hd + 8c) + 8 <= o.len().
                unsafe {
                    let ptr = o.as_mut_ptr().add(g * hd + 8 * c);
                    _mm256_storeu_ps(ptr, _mm256_add_ps(_mm256_loadu_ps(ptr), _mm256_mul_ps(w, *r)));
                }
            }
        }
    }
}

/// `out.len()` vectors of eight f32 from the f16 row `r` (`8 · out.len()` values).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn load_row(r: &[u16], out: &mut [std::arch::x86_64::__m256]) {
    use std::arch::x86_64::*;
    assert!(r.len() >= 8 * out.len(), "f16 row length");
    for (c, o) in out.iter_mut().enumerate() {
        // SAFETY: 8c + 8 <= r.len() (asserted).
        *o = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(r.as_ptr().add(8 * c) as *const __m128i)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 path (several heads per K/V head, rows converted once) gives the bits of the per-head path, with
    /// and without a sliding window.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn grouped_heads_match_one_head_at_a_time() {
        if !crate::quant::simd_level().avx2() {
            return;
        }
        let mut s = 7u32;
        let mut r = || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        };
        for (hd, per, nkv, n, first) in
            [(64usize, 3usize, 3usize, 300usize, 0usize), (128, 4, 2, 57, 20), (8, 1, 1, 9, 0)]
        {
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
            // SAFETY: AVX2 and F16C detected above; the span's rows lie inside k and v; shapes as documented.
            unsafe { heads_f16_avx2(&qv, k, v, sp, 0.125, sinks.as_deref(), &mut sc, &mut fast) };
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
            assert!(fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()), "hd {hd}, {per} heads");
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
