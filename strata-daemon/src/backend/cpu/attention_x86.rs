//! The x86-64 kernels of [`super::attention`]'s f16 definition: one chunk of positions for the query heads that
//! share one K/V head, of one query row or of a block of them ([`rows_scores_f16`], [`rows_values_f16`]), each K
//! and V row converted to f32 once for all of them — the scores of eight positions at a
//! time (eight independent accumulation chains instead of one), the exponentials eight or sixteen lanes at a time,
//! the products with V accumulated in registers with fused multiply-adds. Every value has the bits of the portable
//! path (`chunk_scores`, `softmax_exps` and `chunk_values` in [`super::attention`]): a score is eight lanes of
//! products added in order and reduced as [`crate::quant::f16::reduce8`], an exponential [`super::exp`]'s, a
//! probability rounded to f16, an output value a fused multiply-add chain in position order; only which lanes
//! and registers carry them changes (AVX2 or AVX-512). The V products of a Q8_0 cache are here too.

use std::arch::x86_64::*;

use super::attention::{Span, CHUNK};

/// Positions per score block (one accumulator each).
const BLK: usize = 8;
/// The largest head handled (32 chunks of eight values).
pub(super) const MAX_HD: usize = 256;

/// Converted K rows of one block: `[chunk][position][8]` (a position pair's chunk is 16 consecutive floats).
#[repr(align(64))]
struct KTile([f32; MAX_HD * BLK]);

thread_local! {
    /// A task's K tile (kept: zeroing 8 KiB per chunk cost more than the scores of a short one).
    static KT: std::cell::RefCell<KTile> = const { std::cell::RefCell::new(KTile([0.0; MAX_HD * BLK])) };
}

/// Which vector width runs the products.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Width {
    /// AVX2 + FMA + F16C (8 lanes).
    Avx2,
    /// AVX-512 F + VL as well (16 lanes: two positions per score register, 16 output values per register).
    Avx512,
}

impl Width {
    /// The widest this CPU runs under the process's SIMD level (`None`: below AVX2).
    pub(super) fn detect() -> Option<Width> {
        let level = crate::quant::simd_level();
        if !level.avx2() {
            return None;
        }
        let wide = level == crate::quant::SimdLevel::Avx512
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl");
        Some(if wide { Width::Avx512 } else { Width::Avx2 })
    }
}

/// Pass one of a chunk of [`super::attention`]'s f16 definition for the `qv.len() / sp.hd` query heads sharing one
/// K/V head, over span positions `js` (indices from `sp.first`, at most [`CHUNK`]): head `g`'s scaled scores to
/// `sc[g · stride + j − js.start]` — the bits of the portable `chunk_scores`.
///
/// # Safety
/// The CPU must run `w` (AVX2 + FMA + F16C; AVX-512 F + VL for [`Width::Avx512`]); `js` inside
/// `0..sp.n - sp.first`, its rows inside `k`; `sc` valid for writes of those elements and no one else touching them
/// meanwhile.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn chunk_scores_f16(
    w: Width,
    qv: &[f32],
    k: &[u16],
    sp: Span,
    js: std::ops::Range<usize>,
    scale: f32,
    (sc, stride): (*mut f32, usize),
) {
    let hd = sp.hd;
    assert!(js.len() <= CHUNK && hd.is_multiple_of(8) && hd <= MAX_HD, "attention chunk of a head of {hd}");
    let row = ScoreRow { q: qv, end: js.end, sc };
    // SAFETY: the contract.
    unsafe { scores_f16(w, &[row], k, sp, scale, js, stride) };
}

/// One query row of [`rows_scores_f16`]: its heads' queries (`per · hd` values, rounded to f16), the end of its
/// positions (span index, exclusive) and where its scores go (head `g`'s score of span position `j` at
/// `sc + g · stride + j − js.start`).
#[derive(Clone, Copy)]
pub(super) struct ScoreRow<'a> {
    pub(super) q: &'a [f32],
    pub(super) end: usize,
    pub(super) sc: *mut f32,
}

/// [`chunk_scores_f16`] for several query rows of one K/V head over span positions `js` (`js.end` the largest
/// row end): each block of K rows converted once for every row, a row's scores only for its positions
/// (`j < row.end`); each score has the bits of the one-row kernel.
///
/// # Safety
/// As [`chunk_scores_f16`], for every row: its queries `per · hd` values (`per` equal for all), `row.end <=
/// js.end`, its scores valid for writes and no one else touching them meanwhile.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn rows_scores_f16(
    w: Width,
    rows: &[ScoreRow<'_>],
    k: &[u16],
    sp: Span,
    js: std::ops::Range<usize>,
    scale: f32,
    stride: usize,
) {
    let hd = sp.hd;
    assert!(js.len() <= CHUNK && hd.is_multiple_of(8) && hd <= MAX_HD, "attention chunk of a head of {hd}");
    assert!(rows.iter().all(|r| r.end <= js.end && r.q.len() == rows[0].q.len()), "attention rows");
    // SAFETY: the contract.
    unsafe { scores_f16(w, rows, k, sp, scale, js, stride) };
}

/// The softmax's exponentials of one head (the portable `softmax_exps`' bits): the largest of the scores of
/// `segs` (the head's span in position order) and `sink` is `M`; each score becomes `e^(s − M)` ([`super::exp`]'s
/// function, sixteen or eight at a time); returns `M`. The caller adds them in position order.
///
/// # Safety
/// AVX2 + FMA + F16C; AVX-512 F for [`Width::Avx512`].
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn exps_f16(w: Width, segs: &mut [&mut [f32]], sink: Option<f32>) -> f32 {
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut m = f32::NEG_INFINITY;
    for s in segs.iter() {
        let n8 = s.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= s.len(); (a NaN score leaves the lane as it was, as f32::max does)
            mv = _mm256_max_ps(unsafe { _mm256_loadu_ps(s.as_ptr().add(i)) }, mv);
        }
        m = s[n8..].iter().fold(m, |a, &b| a.max(b));
    }
    let mut lanes = [0f32; 8];
    // SAFETY: eight lanes into eight floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mv) };
    m = lanes.iter().fold(m, |a, &b| a.max(b));
    m = sink.map_or(m, |s| m.max(s));
    for s in segs.iter_mut() {
        match w {
            // SAFETY: AVX-512 F (w).
            Width::Avx512 => unsafe { exps_zmm(s, m) },
            Width::Avx2 => exps_ymm(s, m),
        }
    }
    m
}

/// `s[j]` = `e^(s[j] − m)`, eight at a time (the tail through a padded register).
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
fn exps_ymm(s: &mut [f32], m: f32) {
    let mv = _mm256_set1_ps(m);
    let mut i = 0;
    while i + 8 <= s.len() {
        // SAFETY: i + 8 <= s.len().
        unsafe {
            let e = super::exp::exp8(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(i)), mv));
            _mm256_storeu_ps(s.as_mut_ptr().add(i), e);
        }
        i += 8;
    }
    // the tail through a padded register
    while i < s.len() {
        let r = (s.len() - i).min(8);
        let mut x = [0f32; 8];
        x[..r].copy_from_slice(&s[i..i + r]);
        // SAFETY: eight values in x.
        let e = super::exp::exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(x.as_ptr()) }, mv));
        // SAFETY: eight values into x.
        unsafe { _mm256_storeu_ps(x.as_mut_ptr(), e) };
        s[i..i + r].copy_from_slice(&x[..r]);
        i += r;
    }
}

/// [`exps_ymm`] sixteen at a time in AVX-512 registers (the tail by [`exps_ymm`]).
///
/// # Safety
/// AVX-512 F + AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c,fma")]
unsafe fn exps_zmm(s: &mut [f32], m: f32) {
    let mv = _mm512_set1_ps(m);
    let n16 = s.len() / 16 * 16;
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 <= s.len().
        unsafe {
            let e = super::exp::exp16(_mm512_sub_ps(_mm512_loadu_ps(s.as_ptr().add(i)), mv));
            _mm512_storeu_ps(s.as_mut_ptr().add(i), e);
        }
    }
    exps_ymm(&mut s[n16..], m);
}

/// Pass two of a chunk: head `g`'s probabilities `p_j` = f16(`e_j · inv_g`) (exponentials from
/// `e[g · stride + j − js.start]`, `invs[g]`) into `p[g · CHUNK ..]`, then `o = Σ p_j · v_j` to
/// `part[g · hd ..]` — the bits of the portable `chunk_values`.
///
/// # Safety
/// AVX2 + FMA + F16C (AVX-512 F + VL for [`Width::Avx512`]); `js` inside the span, no longer than [`CHUNK`], its
/// rows inside `v`; `e` valid for reads of the heads' exponentials; `p.len() >= per · CHUNK`,
/// `part.len() >= per · hd` (`per = invs.len()`).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn chunk_values_f16(
    w: Width,
    (e, stride): (*const f32, usize),
    v: &[u16],
    sp: Span,
    js: std::ops::Range<usize>,
    invs: &[f32],
    p: &mut [f32],
    part: &mut [f32],
) {
    let (hd, per, n) = (sp.hd, invs.len(), js.len());
    assert!(n <= CHUNK && p.len() >= per * CHUNK && part.len() >= per * hd, "attention chunk shapes");
    assert!(hd.is_multiple_of(8) && hd <= MAX_HD, "attention head of {hd} values");
    for (g, &inv) in invs.iter().enumerate() {
        // SAFETY: head g's n exponentials (contract).
        let s = unsafe { std::slice::from_raw_parts(e.add(g * stride), n) };
        // SAFETY: the contract's CPU features.
        unsafe { probabilities(w, s, inv, &mut p[g * CHUNK..g * CHUNK + n]) };
    }
    let mut g0 = 0;
    while g0 < per {
        let heads = (per - g0).min(4);
        // SAFETY: head g0 + g's output at part[(g0 + g)·hd ..][..hd], inside part (asserted above).
        let o = unsafe { part.as_mut_ptr().add(g0 * hd) };
        let at = Pv { p: p[g0 * CHUNK..].as_ptr(), from: 0, n, v, sp, j0: js.start, o, stride: hd };
        // SAFETY: the contract's CPU features; `heads` heads of probabilities (CHUNK apart, n each) and outputs.
        unsafe {
            match heads {
                1 => pv::<1, 4>(w, at),
                2 => pv::<2, 4>(w, at),
                3 => pv::<3, 4>(w, at),
                _ => pv::<4, 4>(w, at),
            }
        }
        g0 += 4;
    }
}

/// One query row of [`rows_values_f16`]: its heads' exponentials of the chunk (head `g`'s at `e + g · CHUNK`),
/// how many positions of the chunk it attends to (`n`, 0 for none) and its heads' `1 / L`.
#[derive(Clone, Copy)]
pub(super) struct ValueRow<'a> {
    pub(super) e: *const f32,
    pub(super) n: usize,
    pub(super) invs: &'a [f32],
}

/// Pass two of a chunk (span positions from `j0`) for several query rows of one K/V head (`per` heads each, rows
/// in order of their `n`): row `r` head `g`'s probabilities into `p[(r · per + g) · CHUNK ..]`, its V product
/// (`o = Σ_j p_j · v_j` over its `n` positions) to `part + (r · per + g) · hd` — each value the fused multiply-add
/// chain in position order from 0 of [`chunk_values_f16`]. Each V row is converted once for every (row, head)
/// pair that reaches it (up to 12 pairs' accumulators in AVX-512 registers, 6 in AVX2 ones): the positions all
/// the rows reach first, then each longer row's further positions continuing its accumulators.
///
/// # Safety
/// AVX2 + FMA + F16C (AVX-512 F + VL for [`Width::Avx512`]); `sp.hd % 8 == 0`, `sp.hd <= MAX_HD`; every `n <=
/// CHUNK`, its positions `j0 .. j0 + n` inside the span and its rows inside `v`; each row's `per` heads'
/// exponentials valid for reads and `invs.len() == per`; `p.len() >= rows.len() · per · CHUNK`; `part` valid for
/// writes of `rows.len() · per · hd` values, no one else touching them meanwhile.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn rows_values_f16(
    w: Width,
    rows: &[ValueRow<'_>],
    per: usize,
    v: &[u16],
    sp: Span,
    j0: usize,
    p: &mut [f32],
    part: *mut f32,
) {
    let hd = sp.hd;
    assert!(hd.is_multiple_of(8) && hd <= MAX_HD && p.len() >= rows.len() * per * CHUNK, "attention rows shapes");
    assert!(rows.iter().all(|r| r.n <= CHUNK && r.invs.len() == per), "attention rows");
    assert!(rows.windows(2).all(|x| x[0].n <= x[1].n), "attention rows in order of their positions");
    for (r, row) in rows.iter().enumerate().filter(|(_, r)| r.n > 0) {
        for (g, &inv) in row.invs.iter().enumerate() {
            // SAFETY: head g's n exponentials (contract).
            let s = unsafe { std::slice::from_raw_parts(row.e.add(g * CHUNK), row.n) };
            let at = (r * per + g) * CHUNK;
            // SAFETY: the contract's CPU features.
            unsafe { probabilities(w, s, inv, &mut p[at..at + row.n]) };
        }
    }
    let most = if w == Width::Avx512 { 12 } else { 6 };
    let mut from = 0;
    for (r, row) in rows.iter().enumerate() {
        if row.n <= from {
            continue;
        }
        // positions from .. row.n for the pairs of rows r .. (all reach them), `most` pairs at a time
        let mut q = r * per;
        while q < rows.len() * per {
            let count = (rows.len() * per - q).min(most);
            // SAFETY: pair q's outputs at part + q·hd, inside the contract's rows.len()·per·hd values.
            let o = unsafe { part.add(q * hd) };
            let at = Pv { p: p[q * CHUNK..].as_ptr(), from, n: row.n, v, sp, j0, o, stride: hd };
            // SAFETY: the contract's CPU features; `count` pairs of probabilities (CHUNK apart, written above for
            // positions up to each row's n >= row.n) and outputs (hd apart).
            unsafe { pv_many(w, at, count) };
            q += count;
        }
        from = row.n;
    }
}

/// [`pv`] for `count` (1 to 12) heads with two registers of columns per head at a time (the accumulators of up to
/// 12 heads in AVX-512 registers, 6 in AVX2 ones).
///
/// # Safety
/// As [`pv`]'s.
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn pv_many(w: Width, at: Pv<'_>, count: usize) {
    macro_rules! by_count {
        ($($g:literal)*) => {
            match count {
                $($g => pv::<$g, 2>,)*
                _ => panic!("{count} heads of V products at once"),
            }
        };
    }
    let f: unsafe fn(Width, Pv<'_>) = by_count!(1 2 3 4 5 6 7 8 9 10 11 12);
    // SAFETY: as this function's contract.
    unsafe { f(w, at) }
}

/// `p[j]` = f16(`e[j] · inv`) (rounded to nearest even, kept as f32), eight or sixteen at a time.
///
/// # Safety
/// AVX2 + F16C; AVX-512 F for [`Width::Avx512`]. `p.len() == e.len()`.
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn probabilities(w: Width, e: &[f32], inv: f32, p: &mut [f32]) {
    assert_eq!(e.len(), p.len(), "probabilities");
    let iv = _mm256_set1_ps(inv);
    let mut i = 0;
    if w == Width::Avx512 {
        // SAFETY: AVX-512 F (w); equal lengths (asserted).
        i = unsafe { probabilities_zmm(e, inv, p) };
    }
    while i + 8 <= e.len() {
        // SAFETY: i + 8 <= both lengths (asserted equal).
        unsafe {
            let y = _mm256_mul_ps(_mm256_loadu_ps(e.as_ptr().add(i)), iv);
            let y = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y));
            _mm256_storeu_ps(p.as_mut_ptr().add(i), y);
        }
        i += 8;
    }
    // the tail through a padded register
    while i < e.len() {
        let r = (e.len() - i).min(8);
        let mut x = [0f32; 8];
        x[..r].copy_from_slice(&e[i..i + r]);
        // SAFETY: eight values in and out of x.
        unsafe {
            let y = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr()), iv);
            let y = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y));
            _mm256_storeu_ps(x.as_mut_ptr(), y);
        }
        p[i..i + r].copy_from_slice(&x[..r]);
        i += r;
    }
}

/// [`probabilities`] of the whole sixteens of `e` in AVX-512 registers; returns how many were done.
///
/// # Safety
/// AVX-512 F + AVX2 + F16C; `p.len() == e.len()`.
#[target_feature(enable = "avx512f,avx2,f16c,fma")]
unsafe fn probabilities_zmm(e: &[f32], inv: f32, p: &mut [f32]) -> usize {
    let iv = _mm512_set1_ps(inv);
    let n16 = e.len() / 16 * 16;
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 <= both lengths (contract).
        unsafe {
            let x = _mm512_mul_ps(_mm512_loadu_ps(e.as_ptr().add(i)), iv);
            let y = _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
            _mm512_storeu_ps(p.as_mut_ptr().add(i), y);
        }
    }
    n16
}

/// Where [`pv`] reads and writes: `G` heads' probabilities from `p` (head `g`'s `n` at `p + g · CHUNK`), V rows of
/// span positions `j0 ..`, outputs from `o` (head `g`'s `hd` values at `o + g · stride`). Positions `from .. n`
/// of the chunk: from 0 the accumulators start at zero, else from the outputs (a chain continued).
#[derive(Clone, Copy)]
struct Pv<'a> {
    p: *const f32,
    from: usize,
    n: usize,
    v: &'a [u16],
    sp: Span,
    j0: usize,
    o: *mut f32,
    stride: usize,
}

/// `o_g[x]` = `Σ_j p_g[j] · V[first + j0 + j][x]` for `G` heads, each value a fused multiply-add chain in position
/// order from 0 (the portable `chunk_values`'), the V row converted once for the `G` heads: `16N` columns at a
/// time in AVX-512 registers (`8N` in AVX2 ones), then 16 and 8.
///
/// # Safety
/// As [`chunk_values_f16`]'s; `at` inside the buffers as [`Pv`] says, `G` heads.
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn pv<const G: usize, const N: usize>(w: Width, at: Pv<'_>) {
    let hd = at.sp.hd;
    let mut x = 0;
    if w == Width::Avx512 {
        while x + 16 * N <= hd {
            // SAFETY: columns x .. x + 16N of the heads (contract).
            unsafe { pv_zmm::<G, N>(at, x) };
            x += 16 * N;
        }
        while x + 16 <= hd {
            // SAFETY: as above, 16 columns.
            unsafe { pv_zmm::<G, 1>(at, x) };
            x += 16;
        }
    }
    // (after the AVX-512 passes fewer than 16 columns are left)
    while x + 8 * N <= hd {
        // SAFETY: as above, 8N columns.
        unsafe { pv_ymm::<G, N>(at, x) };
        x += 8 * N;
    }
    while x + 8 <= hd {
        // SAFETY: as above, 8 columns.
        unsafe { pv_ymm::<G, 1>(at, x) };
        x += 8;
    }
}

/// Columns `x .. x + 16N` of [`pv`] in AVX-512 registers.
///
/// # Safety
/// AVX-512 F + AVX2 + FMA + F16C; as [`pv`]'s, `x + 16N <= hd`.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c,fma")]
unsafe fn pv_zmm<const G: usize, const N: usize>(at: Pv<'_>, x: usize) {
    let mut acc = [[_mm512_setzero_ps(); N]; G];
    if at.from > 0 {
        for (g, a) in acc.iter_mut().enumerate() {
            for (u, r) in a.iter_mut().enumerate() {
                // SAFETY: head g's output columns x + 16u .. + 16 (contract), holding the chain so far.
                *r = unsafe { _mm512_loadu_ps(at.o.add(g * at.stride + x + 16 * u)) };
            }
        }
    }
    for j in at.from..at.n {
        let row = at.sp.row(at.sp.first + at.j0 + j);
        prefetch_ahead(at.v, at.sp, at.sp.first + at.j0 + j + PREFETCH, x..x + 16 * N);
        let r = &at.v[row.start + x..row.start + x + 16 * N];
        // SAFETY: 16N f16 values of the row (sliced above).
        let vv: [__m512; N] = std::array::from_fn(|u| unsafe {
            _mm512_cvtph_ps(_mm256_loadu_si256(r.as_ptr().add(16 * u) as *const __m256i))
        });
        for (g, a) in acc.iter_mut().enumerate() {
            // SAFETY: head g's probability j (contract).
            let b = _mm512_set1_ps(unsafe { *at.p.add(g * CHUNK + j) });
            for u in 0..N {
                a[u] = _mm512_fmadd_ps(b, vv[u], a[u]);
            }
        }
    }
    for (g, a) in acc.iter().enumerate() {
        for (u, &r) in a.iter().enumerate() {
            // SAFETY: head g's output columns x + 16u .. + 16 (contract).
            unsafe { _mm512_storeu_ps(at.o.add(g * at.stride + x + 16 * u), r) };
        }
    }
}

/// Columns `x .. x + 8N` of [`pv`] in AVX2 registers.
///
/// # Safety
/// AVX2 + FMA + F16C; as [`pv`]'s, `x + 8N <= hd`.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn pv_ymm<const G: usize, const N: usize>(at: Pv<'_>, x: usize) {
    let mut acc = [[_mm256_setzero_ps(); N]; G];
    if at.from > 0 {
        for (g, a) in acc.iter_mut().enumerate() {
            for (u, r) in a.iter_mut().enumerate() {
                // SAFETY: head g's output columns x + 8u .. + 8 (contract), holding the chain so far.
                *r = unsafe { _mm256_loadu_ps(at.o.add(g * at.stride + x + 8 * u)) };
            }
        }
    }
    for j in at.from..at.n {
        let row = at.sp.row(at.sp.first + at.j0 + j);
        prefetch_ahead(at.v, at.sp, at.sp.first + at.j0 + j + PREFETCH, x..x + 8 * N);
        let r = &at.v[row.start + x..row.start + x + 8 * N];
        // SAFETY: 8N f16 values of the row (sliced above).
        let vv: [__m256; N] = std::array::from_fn(|u| unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(r.as_ptr().add(8 * u) as *const __m128i))
        });
        for (g, a) in acc.iter_mut().enumerate() {
            // SAFETY: head g's probability j (contract).
            let b = _mm256_set1_ps(unsafe { *at.p.add(g * CHUNK + j) });
            for u in 0..N {
                a[u] = _mm256_fmadd_ps(b, vv[u], a[u]);
            }
        }
    }
    for (g, a) in acc.iter().enumerate() {
        for (u, &r) in a.iter().enumerate() {
            // SAFETY: head g's output columns x + 8u .. + 8 (contract).
            unsafe { _mm256_storeu_ps(at.o.add(g * at.stride + x + 8 * u), r) };
        }
    }
}

/// The scores of span positions `js` (indices from `sp.first`) for each row of `rows` (`row.q.len() / sp.hd`
/// query heads): head `g`'s score of span position `j < row.end` to `row.sc + g · stride + j − js.start`, scaled
/// by `scale`; each block of K rows converted once for all rows.
///
/// # Safety
/// The CPU must run `w`; `sp.hd % 8 == 0`, `sp.hd <= MAX_HD`; `js` inside `0..sp.n - sp.first`, its rows inside
/// `k`; every `row.end <= js.end`; the scores valid for writes and no one else touching them meanwhile.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scores_f16(
    w: Width,
    rows: &[ScoreRow<'_>],
    k: &[u16],
    sp: Span,
    scale: f32,
    js: std::ops::Range<usize>,
    stride: usize,
) {
    let hd = sp.hd;
    KT.with_borrow_mut(|kt| {
        for j0 in js.clone().step_by(BLK) {
            let nb = BLK.min(js.end - j0);
            // SAFETY: the CPU runs AVX2 + F16C (contract); rows j0..j0+nb of the span lie inside k.
            unsafe { k_tile(k, sp, j0, nb, kt) };
            for row in rows.iter().filter(|r| r.end > j0) {
                let nr = nb.min(row.end - j0);
                for (g, q) in row.q.chunks_exact(hd).enumerate() {
                    let s = match w {
                        // SAFETY: the contract's CPU features; q holds hd values, the tile hd / 8 chunks.
                        Width::Avx2 => unsafe { scores8_avx2(q, kt, scale) },
                        // SAFETY: as above, with AVX-512 F + VL (the contract for this width).
                        Width::Avx512 => unsafe { scores8_avx512(q, kt, scale) },
                    };
                    // SAFETY: g · stride + j0 − js.start + nr is inside the elements this call owns (contract).
                    unsafe {
                        let dst = row.sc.add(g * stride + j0 - js.start);
                        if nr == BLK {
                            _mm256_storeu_ps(dst, s);
                        } else {
                            let mut x = [0f32; BLK];
                            _mm256_storeu_ps(x.as_mut_ptr(), s);
                            std::ptr::copy_nonoverlapping(x.as_ptr(), dst, nr);
                        }
                    }
                }
            }
        }
    });
}

/// Converts the K rows of span positions `j0 .. j0 + nb` into `kt` (`[chunk][position][8]`; positions past `nb`
/// zero).
///
/// # Safety
/// AVX2 + F16C; the rows lie inside `k`; `sp.hd <= MAX_HD`, a multiple of 8.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn k_tile(k: &[u16], sp: Span, j0: usize, nb: usize, kt: &mut KTile) {
    let c8 = sp.hd / 8;
    for p in 0..BLK {
        if p >= nb {
            for c in 0..c8 {
                kt.0[(c * BLK + p) * 8..(c * BLK + p + 1) * 8].fill(0.0);
            }
            continue;
        }
        let row = &k[sp.row(sp.first + j0 + p)];
        prefetch_ahead(k, sp, sp.first + j0 + p + PREFETCH, 0..sp.hd);
        for c in 0..c8 {
            // SAFETY: 8c + 8 <= hd = row.len(); the tile index (c·BLK + p)·8 + 8 <= MAX_HD·BLK.
            unsafe {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(8 * c) as *const __m128i));
                _mm256_store_ps(kt.0.as_mut_ptr().add((c * BLK + p) * 8), x);
            }
        }
    }
}

/// Rows ahead of the one converted whose lines are asked for early (the rows of one K/V head are `kvd` values
/// apart: a strided stream).
const PREFETCH: usize = 16;

/// Asks for the lines of columns `cols` of span position `p`'s row (when it exists) ahead of their use.
#[inline(always)]
fn prefetch_ahead(rows: &[u16], sp: Span, p: usize, cols: std::ops::Range<usize>) {
    let r = sp.row(p);
    if p < sp.n && r.start + cols.end <= rows.len() {
        for off in (r.start + cols.start..r.start + cols.end).step_by(32) {
            // SAFETY: `off` < r.start + cols.end <= rows.len() (checked): inside the slice; a prefetch reads
            // nothing.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(rows.as_ptr().add(off) as *const i8) };
        }
    }
}

/// The eight positions' scores from their per-lane sums `acc[p]`: each reduced as
/// [`crate::quant::f16::reduce8`] ((l0 + l4) + (l1 + l5) + (l2 + l6) + (l3 + l7), left to right), then times
/// `scale`; the eight reductions run side by side after a transpose.
#[target_feature(enable = "avx2")]
fn reduce8x8(acc: [__m256; 8], scale: f32) -> __m256 {
    // halves: h[p] = (l0 + l4, l1 + l5, l2 + l6, l3 + l7); y[i] pairs h[i] (low) with h[i + 4] (high)
    let h = |p: usize| _mm_add_ps(_mm256_castps256_ps128(acc[p]), _mm256_extractf128_ps::<1>(acc[p]));
    let y = |i: usize| _mm256_set_m128(h(i + 4), h(i));
    let (y0, y1, y2, y3) = (y(0), y(1), y(2), y(3));
    // 4 × 4 transposes in each 128-bit half: a(i) holds term i of positions (0, 1, 2, 3 | 4, 5, 6, 7)
    let (lo01, hi01) = (_mm256_unpacklo_ps(y0, y1), _mm256_unpackhi_ps(y0, y1));
    let (lo23, hi23) = (_mm256_unpacklo_ps(y2, y3), _mm256_unpackhi_ps(y2, y3));
    let a0 = _mm256_shuffle_ps::<0x44>(lo01, lo23);
    let a1 = _mm256_shuffle_ps::<0xEE>(lo01, lo23);
    let a2 = _mm256_shuffle_ps::<0x44>(hi01, hi23);
    let a3 = _mm256_shuffle_ps::<0xEE>(hi01, hi23);
    _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3), _mm256_set1_ps(scale))
}

/// The scores of the tile's eight positions for one query head `q` (`hd` values, AVX2).
///
/// # Safety
/// AVX2 + F16C; `q.len() == hd`, the tile holding `hd / 8` chunks.
#[target_feature(enable = "avx2,f16c")]
unsafe fn scores8_avx2(q: &[f32], kt: &KTile, scale: f32) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); BLK];
    for c in 0..q.len() / 8 {
        // SAFETY: 8c + 8 <= q.len(); the tile index (c·BLK + p)·8 + 8 <= MAX_HD·BLK (q.len() <= MAX_HD).
        unsafe {
            let x = _mm256_loadu_ps(q.as_ptr().add(8 * c));
            let t = kt.0.as_ptr().add(c * BLK * 8);
            for (p, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(x, _mm256_load_ps(t.add(8 * p))));
            }
        }
    }
    reduce8x8(acc, scale)
}

/// [`scores8_avx2`] with two positions per AVX-512 register (the same lanes' sums).
///
/// # Safety
/// As [`scores8_avx2`], and AVX-512 F + VL.
#[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
unsafe fn scores8_avx512(q: &[f32], kt: &KTile, scale: f32) -> __m256 {
    let mut acc = [_mm512_setzero_ps(); BLK / 2];
    for c in 0..q.len() / 8 {
        // SAFETY: as in scores8_avx2; a pair's chunk is 16 consecutive floats of the tile.
        unsafe {
            let x8 = _mm512_castps256_ps512(_mm256_loadu_ps(q.as_ptr().add(8 * c)));
            let x = _mm512_shuffle_f32x4::<0x44>(x8, x8);
            let t = kt.0.as_ptr().add(c * BLK * 8);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_add_ps(*a, _mm512_mul_ps(x, _mm512_load_ps(t.add(16 * i))));
            }
        }
    }
    let half = |a: __m512, hi: bool| {
        if hi {
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)))
        } else {
            _mm512_castps512_ps256(a)
        }
    };
    let per = [
        half(acc[0], false),
        half(acc[0], true),
        half(acc[1], false),
        half(acc[1], true),
        half(acc[2], false),
        half(acc[2], true),
        half(acc[3], false),
        half(acc[3], true),
    ];
    reduce8x8(per, scale)
}

/// `o[x] += Σ_j wts[j] · V_j[x]` for one head over Q8_0 rows: row `j`'s `o.len() / 32` blocks start at byte
/// `row(j)` of `v`; each value is `q · d` (its code times its block's f16 scale, as the Q8_0 dequantizer), added
/// in position order (the bits of the scalar loop of [`super::attention`]'s Q8_0 path).
///
/// # Safety
/// The CPU must run `w`; `o.len() % 32 == 0`; every `row(j) + 34 · o.len() / 32 <= v.len()`.
pub(super) unsafe fn values_q8_0(w: Width, wts: &[f32], v: &[u8], row: impl Fn(usize) -> usize, o: &mut [f32]) {
    for c in 0..o.len() / 32 {
        let out = &mut o[32 * c..32 * c + 32];
        match w {
            // SAFETY: AVX2 (contract); every row's block c lies inside v (contract).
            Width::Avx2 => unsafe { values_q8_0_avx2(wts, v, |j| row(j) + 34 * c, out) },
            // SAFETY: as above, with AVX-512 F.
            Width::Avx512 => unsafe { values_q8_0_avx512(wts, v, |j| row(j) + 34 * c, out) },
        }
    }
}

/// One block's 32 columns of [`values_q8_0`] (AVX2): `blk(j)` is position j's block.
///
/// # Safety
/// AVX2 + F16C; every `blk(j) + 34 <= v.len()`; `out.len() == 32`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn values_q8_0_avx2(wts: &[f32], v: &[u8], blk: impl Fn(usize) -> usize, out: &mut [f32]) {
    // SAFETY: out holds 32 values.
    let mut acc: [__m256; 4] = std::array::from_fn(|u| unsafe { _mm256_loadu_ps(out.as_ptr().add(8 * u)) });
    for (j, &wt) in wts.iter().enumerate() {
        let b = &v[blk(j)..blk(j) + 34];
        let d = _mm256_set1_ps(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
        let wv = _mm256_set1_ps(wt);
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: 2 + 8u + 8 <= 34 bytes of the block.
            let q = unsafe { _mm_loadl_epi64(b.as_ptr().add(2 + 8 * u) as *const __m128i) };
            let x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
            *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, x));
        }
    }
    for (u, a) in acc.iter().enumerate() {
        // SAFETY: as the loads above.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * u), *a) };
    }
}

/// [`values_q8_0_avx2`] in two AVX-512 registers (the same per-value arithmetic).
///
/// # Safety
/// AVX-512 F; as [`values_q8_0_avx2`].
#[target_feature(enable = "avx512f,avx2,f16c")]
unsafe fn values_q8_0_avx512(wts: &[f32], v: &[u8], blk: impl Fn(usize) -> usize, out: &mut [f32]) {
    // SAFETY: out holds 32 values.
    let mut acc: [__m512; 2] = std::array::from_fn(|u| unsafe { _mm512_loadu_ps(out.as_ptr().add(16 * u)) });
    for (j, &wt) in wts.iter().enumerate() {
        let b = &v[blk(j)..blk(j) + 34];
        let d = _mm512_set1_ps(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
        let wv = _mm512_set1_ps(wt);
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: 2 + 16u + 16 <= 34 bytes of the block.
            let q = unsafe { _mm_loadu_si128(b.as_ptr().add(2 + 16 * u) as *const __m128i) };
            let x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
            *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, x));
        }
    }
    for (u, a) in acc.iter().enumerate() {
        // SAFETY: as the loads above.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * u), *a) };
    }
}
