//! The x86-64 kernels of [`super::attention`] over f16 K/V rows: the query heads that share one K/V head, each
//! K and V row converted to f32 once for all of them, the scores of eight positions at a time (eight independent
//! accumulation chains instead of one), the output accumulated in registers. Every score and output value has the
//! bits of the portable per-head path ([`super::attention`]'s `head`): a score is eight lanes of products added
//! in chunk order and reduced as [`crate::quant::f16::reduce8`], an output value the positions' `w · v` added in
//! position order; only which lanes and registers carry them changes (AVX2 or AVX-512).

use std::arch::x86_64::*;

use super::attention::{softmax, Span};

/// Positions per score block (one accumulator each).
const BLK: usize = 8;
/// f32 values of the V tile (16 KiB: `TILE / columns` positions per pass).
const TILE: usize = 4096;
/// The largest head handled (32 chunks of eight values).
pub(super) const MAX_HD: usize = 256;

/// Converted K rows of one block: `[chunk][position][8]` (a position pair's chunk is 16 consecutive floats).
#[repr(align(64))]
struct KTile([f32; MAX_HD * BLK]);

/// Converted V rows: `[position][column]` (the task's columns of the head).
#[repr(align(64))]
struct VTile([f32; TILE]);

/// Which vector width runs the products.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Width {
    /// AVX2 + F16C (8 lanes).
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

/// `qv.len() / sp.hd` query heads sharing one K/V head (`sinks`: theirs, one per head): their scores into `sc`
/// (head-major, `span` positions each), softmax (probabilities rounded to f16, as llama.cpp over an F16 cache),
/// and `o` = probabilities · V.
///
/// # Safety
/// The CPU must run `w` (AVX2 + F16C; AVX-512 F + VL for [`Width::Avx512`]); `sp.hd % 8 == 0`,
/// `sp.hd <= MAX_HD`; every row of the span lies inside `k` and `v`;
/// `o.len() == qv.len()`, a multiple of `sp.hd`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn heads_f16(
    w: Width,
    qv: &[f32],
    k: &[u16],
    v: &[u16],
    sp: Span,
    scale: f32,
    sinks: Option<&[f32]>,
    sc: &mut Vec<f32>,
    o: &mut [f32],
) {
    let (hd, per, len) = (sp.hd, qv.len() / sp.hd, sp.n - sp.first);
    sc.clear();
    sc.resize(per * len, 0.0);
    // SAFETY: the contract; sc holds per · len scores.
    unsafe { scores_f16(w, qv, k, sp, scale, 0..len, sc.as_mut_ptr()) };
    for g in 0..per {
        let s = &mut sc[g * len..(g + 1) * len];
        let mx = s.iter().fold(f32::NEG_INFINITY, |m, &d| m.max(d));
        softmax(s, mx, true, sinks.map(|s| s[g]));
    }
    // SAFETY: the contract; o holds per · hd values.
    unsafe { values_f16(w, sc, v, sp, 0..hd, o.as_mut_ptr()) };
}

/// The scores of span positions `js` (indices from `sp.first`) for `qv.len() / sp.hd` query heads: head `g`'s
/// score of span position `j` to `sc[g · len + j]` (`len = sp.n - sp.first`), scaled by `scale`.
///
/// # Safety
/// The CPU must run `w`; `sp.hd % 8 == 0`, `sp.hd <= MAX_HD`; `js` inside `0..len`, its rows inside `k`; `sc`
/// valid for writes of those elements and no one else touching them meanwhile.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn scores_f16(
    w: Width,
    qv: &[f32],
    k: &[u16],
    sp: Span,
    scale: f32,
    js: std::ops::Range<usize>,
    sc: *mut f32,
) {
    let (hd, per, len) = (sp.hd, qv.len() / sp.hd, sp.n - sp.first);
    let mut kt = KTile([0.0; MAX_HD * BLK]);
    for j0 in js.clone().step_by(BLK) {
        let nb = BLK.min(js.end - j0);
        // SAFETY: the CPU runs AVX2 + F16C (contract); rows j0..j0+nb of the span lie inside k.
        unsafe { k_tile(k, sp, j0, nb, &mut kt) };
        for g in 0..per {
            let q = &qv[g * hd..(g + 1) * hd];
            let s = match w {
                // SAFETY: the contract's CPU features; q holds hd values, the tile hd / 8 chunks.
                Width::Avx2 => unsafe { scores8_avx2(q, &kt, scale) },
                // SAFETY: as above, with AVX-512 F + VL (the contract for this width).
                Width::Avx512 => unsafe { scores8_avx512(q, &kt, scale) },
            };
            // SAFETY: g · len + j0 + nb <= per · len, elements this call owns (contract).
            unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), sc.add(g * len + j0), nb) };
        }
    }
}

/// `o[g · hd + x]` = `Σ_j sc[g · len + j] · V[first + j][x]` for the columns `x` in `cols` of every head `g` of
/// `sc.len() / len` (positions in order; `len = sp.n - sp.first`, `hd = sp.hd`).
///
/// # Safety
/// The CPU must run `w`; `cols` inside `0..hd`, its bounds multiples of 8; the span's rows inside `v`; `o` valid
/// for writes of those columns of every head and no one else touching them meanwhile.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn values_f16(w: Width, sc: &[f32], v: &[u16], sp: Span, cols: std::ops::Range<usize>, o: *mut f32) {
    let (hd, len, nc) = (sp.hd, sp.n - sp.first, cols.len());
    let per = sc.len() / len.max(1);
    for g in 0..per {
        // SAFETY: head g's columns, owned by this call (contract).
        unsafe { std::slice::from_raw_parts_mut(o.add(g * hd + cols.start), nc) }.fill(0.0);
    }
    let step = TILE / nc;
    let mut vt = VTile([0.0; TILE]);
    for j0 in (0..len).step_by(step) {
        let nb = step.min(len - j0);
        for p in 0..nb {
            let row = sp.row(sp.first + j0 + p);
            prefetch_ahead(v, sp, sp.first + j0 + p + PREFETCH, cols.clone());
            // SAFETY: AVX2 + F16C (contract); the row lies inside v, the tile holds nb <= TILE / nc rows.
            unsafe { widen(&v[row.start + cols.start..row.start + cols.end], &mut vt.0[p * nc..(p + 1) * nc]) };
        }
        if w == Width::Avx512 && nc == 32 {
            // up to four heads at a time, two registers each: eight independent sums in flight instead of one
            let mut g0 = 0;
            while g0 < per {
                let at = (g0, j0, nb, len, hd, cols.start);
                // SAFETY: AVX-512 F (w); heads g0 .. g0 + G of `per`, their weights sc[g·len + j0 ..][..nb]; the
                // tile holds nb rows of 32; o as this function's contract.
                unsafe {
                    match per - g0 {
                        1 => acc_heads_zmm::<1>(sc, &vt.0[..nb * 32], at, o),
                        2 => acc_heads_zmm::<2>(sc, &vt.0[..nb * 32], at, o),
                        3 => acc_heads_zmm::<3>(sc, &vt.0[..nb * 32], at, o),
                        _ => acc_heads_zmm::<4>(sc, &vt.0[..nb * 32], at, o),
                    }
                }
                g0 += 4;
            }
            continue;
        }
        for g in 0..per {
            let wts = &sc[g * len + j0..g * len + j0 + nb];
            // SAFETY: head g's columns, owned by this call (contract).
            let out = unsafe { std::slice::from_raw_parts_mut(o.add(g * hd + cols.start), nc) };
            // SAFETY: the contract's CPU features; the tile holds nb rows of nc values, nc % 8 == 0.
            unsafe { accumulate(w, wts, &vt.0[..nb * nc], out) };
        }
    }
}

/// [`accumulate`] of 32 columns for heads `g0 .. g0 + G` at once (`at` = (g0, j0, nb, len, hd, col0)): head g's
/// output columns `col0 .. col0 + 32` (at `o + g·hd + col0`) += `Σ_p sc[g·len + j0 + p] · tile[p·32 ..]`, positions
/// in order — each value's sum as [`acc_zmm`] adds it, with 2·G independent registers in flight.
///
/// # Safety
/// AVX-512 F; `tile.len() == nb · 32`; `sc` holds `(g0 + G)·len` weights and `j0 + nb <= len`; `o + g·hd + col0`
/// valid for reads and writes of 32 values for each of the G heads.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn acc_heads_zmm<const G: usize>(
    sc: &[f32],
    tile: &[f32],
    (g0, j0, nb, len, hd, col0): (usize, usize, usize, usize, usize, usize),
    o: *mut f32,
) {
    assert!(tile.len() == nb * 32 && (g0 + G) * len <= sc.len() && j0 + nb <= len, "attention tile shapes");
    // SAFETY: head g's 32 output values (contract).
    let out = |g: usize| unsafe { o.add((g0 + g) * hd + col0) };
    // SAFETY: as above.
    let mut acc: [[__m512; 2]; G] =
        std::array::from_fn(|g| unsafe { [_mm512_loadu_ps(out(g)), _mm512_loadu_ps(out(g).add(16))] });
    for p in 0..nb {
        // SAFETY: row p of the tile: p·32 + 32 <= tile.len() (asserted).
        let (t0, t1) =
            unsafe { (_mm512_loadu_ps(tile.as_ptr().add(p * 32)), _mm512_loadu_ps(tile.as_ptr().add(p * 32 + 16))) };
        for (g, a) in acc.iter_mut().enumerate() {
            let wv = _mm512_set1_ps(sc[(g0 + g) * len + j0 + p]);
            a[0] = _mm512_add_ps(a[0], _mm512_mul_ps(wv, t0));
            a[1] = _mm512_add_ps(a[1], _mm512_mul_ps(wv, t1));
        }
    }
    for (g, a) in acc.iter().enumerate() {
        // SAFETY: as the loads above.
        unsafe {
            _mm512_storeu_ps(out(g), a[0]);
            _mm512_storeu_ps(out(g).add(16), a[1]);
        }
    }
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

/// `dst` = the f32 values of the f16 bits `src` (equal lengths, a multiple of 8).
///
/// # Safety
/// AVX2 + F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen(src: &[u16], dst: &mut [f32]) {
    assert!(src.len() == dst.len() && src.len() % 8 == 0, "f16 row length");
    for c in 0..src.len() / 8 {
        // SAFETY: 8c + 8 <= both lengths (asserted).
        unsafe {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(8 * c) as *const __m128i));
            _mm256_storeu_ps(dst.as_mut_ptr().add(8 * c), x);
        }
    }
}

/// The eight positions' scores from their per-lane sums `acc[p]`: each reduced as
/// [`crate::quant::f16::reduce8`] ((l0 + l4) + (l1 + l5) + (l2 + l6) + (l3 + l7), left to right), then times
/// `scale`; the eight reductions run side by side after a transpose.
#[target_feature(enable = "avx2")]
fn reduce8x8(acc: [__m256; 8], scale: f32) -> [f32; 8] {
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
    let s = _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3), _mm256_set1_ps(scale));
    let mut out = [0f32; 8];
    // SAFETY: eight lanes into eight floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// The scores of the tile's eight positions for one query head `q` (`hd` values, AVX2).
///
/// # Safety
/// AVX2 + F16C; `q.len() == hd`, the tile holding `hd / 8` chunks.
#[target_feature(enable = "avx2,f16c")]
unsafe fn scores8_avx2(q: &[f32], kt: &KTile, scale: f32) -> [f32; 8] {
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
unsafe fn scores8_avx512(q: &[f32], kt: &KTile, scale: f32) -> [f32; 8] {
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

/// `out[x] += Σ_p wts[p] · tile[p · hd + x]`, positions in order (`hd = out.len()`).
///
/// # Safety
/// The CPU runs `w`; `tile.len() == wts.len() · hd`, `hd % 8 == 0`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn accumulate(w: Width, wts: &[f32], tile: &[f32], out: &mut [f32]) {
    let hd = out.len();
    let mut x = 0;
    if w == Width::Avx512 {
        while x + 64 <= hd {
            // SAFETY: AVX-512 F (w); columns x .. x + 64 inside every row and out.
            unsafe { acc_zmm::<4>(wts, tile, hd, x, out) };
            x += 64;
        }
        while x + 16 <= hd {
            // SAFETY: as above, columns x .. x + 16.
            unsafe { acc_zmm::<1>(wts, tile, hd, x, out) };
            x += 16;
        }
    }
    while x + 32 <= hd {
        // SAFETY: AVX2; columns x .. x + 32 inside every row and out.
        unsafe { acc_ymm::<4>(wts, tile, hd, x, out) };
        x += 32;
    }
    while x + 8 <= hd {
        // SAFETY: as above, columns x .. x + 8.
        unsafe { acc_ymm::<1>(wts, tile, hd, x, out) };
        x += 8;
    }
}

/// Columns `x .. x + 8N` of [`accumulate`] in `N` AVX2 registers.
///
/// # Safety
/// AVX2; `x + 8N <= hd`, `tile.len() >= wts.len() · hd`, `out.len() >= x + 8N`.
#[target_feature(enable = "avx2")]
unsafe fn acc_ymm<const N: usize>(wts: &[f32], tile: &[f32], hd: usize, x: usize, out: &mut [f32]) {
    // SAFETY: out holds x + 8N values.
    let mut acc: [__m256; N] = std::array::from_fn(|u| unsafe { _mm256_loadu_ps(out.as_ptr().add(x + 8 * u)) });
    for (p, &wt) in wts.iter().enumerate() {
        let wv = _mm256_set1_ps(wt);
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: p·hd + x + 8u + 8 <= (p + 1)·hd <= tile.len().
            *a =
                _mm256_add_ps(*a, _mm256_mul_ps(wv, unsafe { _mm256_loadu_ps(tile.as_ptr().add(p * hd + x + 8 * u)) }));
        }
    }
    for (u, a) in acc.iter().enumerate() {
        // SAFETY: as the loads above.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(x + 8 * u), *a) };
    }
}

/// Columns `x .. x + 16N` of [`accumulate`] in `N` AVX-512 registers.
///
/// # Safety
/// AVX-512 F; `x + 16N <= hd`, `tile.len() >= wts.len() · hd`, `out.len() >= x + 16N`.
#[target_feature(enable = "avx512f")]
unsafe fn acc_zmm<const N: usize>(wts: &[f32], tile: &[f32], hd: usize, x: usize, out: &mut [f32]) {
    // SAFETY: out holds x + 16N values.
    let mut acc: [__m512; N] = std::array::from_fn(|u| unsafe { _mm512_loadu_ps(out.as_ptr().add(x + 16 * u)) });
    for (p, &wt) in wts.iter().enumerate() {
        let wv = _mm512_set1_ps(wt);
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: p·hd + x + 16u + 16 <= (p + 1)·hd <= tile.len().
            *a = _mm512_add_ps(
                *a,
                _mm512_mul_ps(wv, unsafe { _mm512_loadu_ps(tile.as_ptr().add(p * hd + x + 16 * u)) }),
            );
        }
    }
    for (u, a) in acc.iter().enumerate() {
        // SAFETY: as the loads above.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(x + 16 * u), *a) };
    }
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
