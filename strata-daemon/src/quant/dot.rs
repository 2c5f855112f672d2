//! Activation quantization to 8-bit blocks and dot products of a weight row
//! with quantized activations: scalar reference, AVX2/FMA/F16C and AVX-512 VNNI (Q4_0 and Q4_1 rows through
//! [`super::q4_wide`]; the entry points [`k512`] and [`gemm512_of`] of [`super::dot512`] and [`super::gemm512`]),
//! chosen once at run time.
//!
//! As in ggml, activations multiplied by Q8_0/Q4_0 rows are quantized to Q8_0
//! (scale `d = amax/127` stored as f16) and by Q4_1 rows to Q8_1 (Q8_0 plus
//! `s = d * Σq` as f16); [`BlockQ8`] carries both so one quantization per
//! token serves every format.

use std::cell::RefCell;
use std::sync::OnceLock;

use super::dot512::X512;
use super::q4_wide::{self, Q8Quads};
use super::GgmlType;

/// 32 activations quantized to i8: `x[j] ≈ d * qs[j]`; `s = d * Σ qs` (both
/// rounded through f16 as ggml stores them).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct BlockQ8 {
    /// Scale.
    pub d: f32,
    /// `d` times the sum of `qs` (used by Q4_1's offset term).
    pub s: f32,
    /// Quantized values.
    pub qs: [i8; 32],
}

/// The SIMD level chosen at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdLevel {
    /// Portable scalar code (the reference path).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 as above, and the AVX-512 F/BW/VNNI/VBMI kernels: Q4_0 and Q4_1 rows through [`super::q4_wide`];
    /// Q5_0 and Q8_0 rows of products whose tasks hold 32+ rows through [`super::dot512`]; products of 8+ tokens
    /// of the formats with a [`super::gemm512`] (Q5_0, Q8_0, the K-quants, IQ4_XS, the lattice IQs) through it. The
    /// K- and IQ-quants' products of fewer tokens stay on the AVX2 kernels, but for IQ2_XS's and IQ2_S's AVX-512
    /// row kernels (`quant::dot_k`). On CPUs with AMX-INT8, `STRATA_AMX=1` sends prompt products of 8+ tokens of Q4_0,
    /// Q4_1, Q5_0 and Q8_0 through [`super::amx`] (not batch invariant: see there).
    Avx512,
}

impl SimdLevel {
    /// Whether the AVX2 kernels run (both SIMD levels).
    pub fn avx2(self) -> bool {
        self != SimdLevel::Scalar
    }
}

static LEVEL: OnceLock<SimdLevel> = OnceLock::new();

/// The SIMD level in use: AVX-512 when the CPU has AVX2, FMA, F16C and
/// [`q4_wide::supported`]'s AVX-512 set, AVX2 with the first three only, else
/// scalar. `STRATA_SIMD=scalar` or `STRATA_SIMD=avx2` caps the level (A/B runs,
/// or results bit-identical to a machine without AVX-512).
pub fn simd_level() -> SimdLevel {
    *LEVEL.get_or_init(|| {
        let cap = std::env::var("STRATA_SIMD").unwrap_or_default();
        if cap == "scalar" {
            return SimdLevel::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                if cap != "avx2" && q4_wide::supported() {
                    return SimdLevel::Avx512;
                }
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Scalar
    })
}

thread_local! {
    /// Activations rearranged for the wide Q4_0/Q4_1 kernel by [`dot_q8`] / [`dot_q8_x4`] (one row at a time).
    static QUADS: RefCell<Q8Quads> = RefCell::new(Q8Quads::default());
}

/// A format's AVX-512 kernels on this CPU ([`k512`]): one row times one or four tokens' activations laid out by
/// [`X512::prepare`], or four rows times one token, each result the same bits whichever entry computes it (and
/// the AVX2 kernels').
#[derive(Clone, Copy)]
pub struct K512 {
    ty: GgmlType,
    k: super::dot512::Dot512,
}

impl K512 {
    /// `row` (`x.blocks() · 32` values of the format) times one token. Panics when the row's length disagrees.
    #[inline]
    pub fn one(&self, row: &[u8], x: &X512) -> f32 {
        assert!(row.len() == self.ty.row_bytes(x.blocks() * 32), "dot512: row length");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a K512 exists only where k512 found the AVX-512 level (F, BW, VNNI); the row holds x.blocks()
        // blocks of the format (asserted above).
        return unsafe { (self.k.one)(row, x) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AVX-512 kernels off x86-64")
    }

    /// Four rows times one token, each result [`K512::one`]'s bits (four independent chains). Panics as `one`.
    #[inline]
    pub fn rows4(&self, rows: [&[u8]; 4], x: &X512) -> [f32; 4] {
        let rb = self.ty.row_bytes(x.blocks() * 32);
        assert!(rows.iter().all(|r| r.len() == rb), "dot512: row lengths");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `one`, for each row.
        return unsafe { (self.k.rows4)(rows, x) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AVX-512 kernels off x86-64")
    }

    /// `row` times four tokens (each as long as `x[0]`), each result [`K512::one`]'s bits. Panics as `one`.
    #[inline]
    pub fn four(&self, row: &[u8], x: [&X512; 4]) -> [f32; 4] {
        let n = x[0].blocks();
        assert!(row.len() == self.ty.row_bytes(n * 32) && x.iter().all(|xt| xt.blocks() == n), "dot512: lengths");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `one`, for each token.
        return unsafe { (self.k.four)(row, x) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AVX-512 kernels off x86-64")
    }
}

/// The AVX-512 kernels of `ty` where the format has them and the CPU runs them ([`SimdLevel::Avx512`] and
/// [`super::dot512::supported`]); `None` otherwise.
pub fn k512(ty: GgmlType) -> Option<K512> {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 && super::dot512::supported() {
        return super::format::lookup(ty).and_then(|f| f.q8).and_then(|k| k.avx512).map(|k| K512 { ty, k });
    }
    let _ = ty;
    None
}

/// The AVX-512 prefill product of `ty` ([`super::gemm512`]) where the format has one and the CPU runs it (the level
/// and features of [`k512`]); `None` otherwise.
pub fn gemm512_of(ty: GgmlType) -> Option<super::gemm512::Gemm512> {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 && super::dot512::supported() {
        return super::format::lookup(ty).and_then(|f| f.q8).and_then(|k| k.gemm512);
    }
    let _ = ty;
    None
}

/// Whether prompt products of `ty` go through the AMX tiles ([`super::amx`]): Q4_0, Q4_1, Q5_0 and Q8_0 at
/// [`SimdLevel::Avx512`] on a CPU with AMX-INT8, when asked for (`STRATA_AMX=1`, [`super::amx::enabled`]).
pub fn amx_rows(ty: GgmlType) -> bool {
    super::amx::takes(ty) && simd_level() == SimdLevel::Avx512 && super::amx::enabled()
}

/// Whether rows of `ty` go through the AVX-512 kernel ([`super::q4_wide`]): Q4_0 and Q4_1 at
/// [`SimdLevel::Avx512`].
pub fn wide(ty: GgmlType) -> bool {
    super::format::lookup(ty).and_then(|f| f.q8).is_some_and(|k| k.wide) && simd_level() == SimdLevel::Avx512
}

/// The 8-bit-activation kernels of `ty`; panics for a format without them (a caller's bug: products check
/// [`GgmlType::uses_q8_activations`] first).
#[inline]
fn q8_kernels(ty: GgmlType) -> super::format::Q8Dot {
    match super::format::lookup(ty).and_then(|f| f.q8) {
        Some(k) => k,
        None => panic!("dot_q8: {ty:?} has no q8 kernel"),
    }
}

/// Runs `f` on `x` rearranged for the wide Q4_0/Q4_1 kernel (a per-thread buffer, filled by this call).
fn with_quads<R>(x: &[BlockQ8], f: impl FnOnce(&Q8Quads) -> R) -> R {
    QUADS.with(|q| {
        let mut q = q.borrow_mut();
        q.prepare(x);
        f(&q)
    })
}

#[inline]
fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Quantizes `x` (length a multiple of 32) into `out` (`x.len()/32` blocks).
pub fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * 32);
    #[cfg(target_arch = "x86_64")]
    if simd_level().avx2() {
        // SAFETY: AVX2/FMA/F16C detected; lengths asserted above.
        unsafe { avx2::quantize_q8(x, out) };
        return;
    }
    quantize_q8_scalar(x, out)
}

/// Quantizes `x` (length a multiple of 256) as ggml's Q8_K, the activations of the K-quants: one scale per 256
/// values, `d = max / −127` of the value of largest magnitude (not rounded to f16), codes rounded to nearest even
/// and capped at 127 (ggml `quantize_row_q8_K_ref`). Written as [`BlockQ8`] blocks of 32 that share their
/// super-block's `d`, so the K-quant kernels read them as they read Q8_0 activations.
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * 32);
    assert_eq!(x.len() % 256, 0, "Q8_K activations: whole super-blocks of 256");
    #[cfg(target_arch = "x86_64")]
    if simd_level().avx2() {
        // SAFETY: AVX2/FMA/F16C detected; lengths asserted above.
        unsafe { avx2::quantize_q8_k(x, out) };
        return;
    }
    quantize_q8_k_scalar(x, out)
}

/// Scalar reference of [`quantize_q8_k`].
pub fn quantize_q8_k_scalar(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * 32);
    assert_eq!(x.len() % 256, 0, "Q8_K activations: whole super-blocks of 256");
    for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(8)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            ob.iter_mut().for_each(|b| *b = BlockQ8::default());
            continue;
        }
        let iscale = -127.0 / max;
        let d = 1.0 / iscale;
        for (b, xs) in ob.iter_mut().zip(xb.chunks_exact(32)) {
            let mut sum = 0i32;
            for (q, &v) in b.qs.iter_mut().zip(xs) {
                let r = ((iscale * v).round_ties_even() as i32).min(127);
                *q = r as i8;
                sum += r;
            }
            b.d = d;
            b.s = f16_round(d * sum as f32);
        }
    }
}

/// Scalar reference of [`quantize_q8`].
pub fn quantize_q8_scalar(x: &[f32], out: &mut [BlockQ8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in ob.qs.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        ob.d = f16_round(d);
        ob.s = f16_round(d * sum as f32);
    }
}

/// Whether `x` is Q8_K ([`quantize_q8_k`]): whole super-blocks of 8 blocks, each super-block's blocks sharing one
/// scale. The SIMD kernels of the formats whose products pair with Q8_K (the K-quants and the lattice IQ
/// formats) apply that scale once per super-block; other activations go through the scalar reference.
#[inline]
pub fn is_q8_k(x: &[BlockQ8]) -> bool {
    x.len().is_multiple_of(8) && x.chunks_exact(8).all(|s| s[1..].iter().all(|b| b.d.to_bits() == s[0].d.to_bits()))
}

/// Whether the SIMD kernels of `ty` take `x`: any activations for the 32-value formats, Q8_K ones ([`is_q8_k`])
/// for the formats that pair with Q8_K.
#[inline]
fn simd_takes(k: &super::format::Q8Dot, ty: GgmlType, x: &[BlockQ8]) -> bool {
    k.wide || super::format::lookup(ty).is_none_or(|f| f.activation != super::format::Activation::Q8K) || is_q8_k(x)
}

/// Dot product of one weight row (`ty` blocks, `x.len()*32` elements) with quantized activations: Q8_0 blocks
/// ([`quantize_q8`]) for the 32-value formats, Q8_K ([`quantize_q8_k`]) for the K-quants and the lattice IQ
/// formats (other activations there take the scalar reference, [`is_q8_k`]). Panics for a format without 8-bit
/// kernels or a row of the wrong length.
#[inline]
pub fn dot_q8(ty: GgmlType, row: &[u8], x: &[BlockQ8]) -> f32 {
    assert_eq!(row.len(), ty.row_bytes(x.len() * 32), "dot_q8: row length");
    let k = q8_kernels(ty);
    if !simd_takes(&k, ty, x) {
        return dot_q8_scalar(ty, row, x);
    }
    if k.wide && simd_level() == SimdLevel::Avx512 {
        return with_quads(x, |q| q.dot(ty, row));
    }
    #[cfg(target_arch = "x86_64")]
    if simd_level().avx2() {
        // SAFETY: simd_level() returned Avx2 or Avx512 only after detecting avx2, fma and f16c;
        // the kernels read `x.len()` whole blocks from `row`, whose length was asserted above.
        return unsafe { (k.avx2)(row, x) };
    }
    dot_q8_scalar(ty, row, x)
}

/// Dot products of four weight rows with the same quantized activations
/// (`out[j] = dot_q8(ty, rows[j], x)`, bit-identical to four single calls;
/// the SIMD path shares the activation loads and runs four accumulation
/// chains side by side).
#[inline]
pub fn dot_q8_x4(ty: GgmlType, rows: [&[u8]; 4], x: &[BlockQ8]) -> [f32; 4] {
    let k = q8_kernels(ty);
    if !simd_takes(&k, ty, x) {
        return rows.map(|r| dot_q8(ty, r, x));
    }
    if k.wide && simd_level() == SimdLevel::Avx512 {
        return with_quads(x, |q| q.dot_x4(ty, rows));
    }
    #[cfg(target_arch = "x86_64")]
    if simd_level().avx2() {
        let rb = ty.row_bytes(x.len() * 32);
        assert!(rows.iter().all(|r| r.len() == rb), "dot_q8_x4: row length");
        // SAFETY: AVX2/FMA/F16C detected; each row holds x.len() blocks (asserted above).
        return unsafe { (k.avx2_x4)(rows, x) };
    }
    [dot_q8(ty, rows[0], x), dot_q8(ty, rows[1], x), dot_q8(ty, rows[2], x), dot_q8(ty, rows[3], x)]
}

/// One token's activations checked once for a format's kernels ([`q8_rows`]): the products of many rows with the
/// same `x` take [`dot_q8`]'s and [`dot_q8_x4`]'s paths (and bits) without checking `x` per call.
#[derive(Clone, Copy)]
pub struct Q8Rows<'a> {
    ty: GgmlType,
    x: &'a [BlockQ8],
    k: super::format::Q8Dot,
    simd: bool,
}

/// [`Q8Rows`] of `ty` over `x` (panics for a format without 8-bit kernels, as [`dot_q8`]).
#[inline]
pub fn q8_rows(ty: GgmlType, x: &[BlockQ8]) -> Q8Rows<'_> {
    let k = q8_kernels(ty);
    let simd = simd_takes(&k, ty, x);
    Q8Rows { ty, x, k, simd }
}

impl Q8Rows<'_> {
    /// [`dot_q8`] of `row`.
    #[inline]
    pub fn one(&self, row: &[u8]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if self.simd && !self.k.wide && simd_level().avx2() {
            assert_eq!(row.len(), self.ty.row_bytes(self.x.len() * 32), "dot_q8: row length");
            // SAFETY: AVX2/FMA/F16C detected (simd_level); the row holds x.len() blocks (asserted); `x` was checked
            // for the format's activations when this handle was made.
            return unsafe { (self.k.avx2)(row, self.x) };
        }
        dot_q8(self.ty, row, self.x)
    }

    /// [`dot_q8_x4`] of `rows`.
    #[inline]
    pub fn x4(&self, rows: [&[u8]; 4]) -> [f32; 4] {
        #[cfg(target_arch = "x86_64")]
        if self.simd && !self.k.wide && simd_level().avx2() {
            let rb = self.ty.row_bytes(self.x.len() * 32);
            assert!(rows.iter().all(|r| r.len() == rb), "dot_q8_x4: row length");
            // SAFETY: as in `one`, for each row.
            return unsafe { (self.k.avx2_x4)(rows, self.x) };
        }
        dot_q8_x4(self.ty, rows, self.x)
    }
}

/// A format's N-token kernel on this CPU ([`q8_t4`], [`q8_t8`]): one row of `ty` times N tokens' activations, each
/// result bit for bit [`dot_q8`]'s, the row unpacked once.
#[derive(Clone, Copy)]
pub struct Q8Tn<const N: usize> {
    ty: GgmlType,
    /// Made by [`Q8Tn::takes`] for the activations `dot` is then called with.
    checked: bool,
    #[cfg(target_arch = "x86_64")]
    f: unsafe fn(&[u8], [&[BlockQ8]; N]) -> [f32; N],
}

/// The four-token kernel ([`q8_t4`]).
pub type Q8T4 = Q8Tn<4>;

impl<const N: usize> Q8Tn<N> {
    /// This kernel for the N tokens `x` checked once ([`is_q8_k`] for the formats that pair with Q8_K): `dot` on
    /// these activations then skips the check per row. `None` where the SIMD kernel does not take them (the
    /// caller computes those tokens otherwise, [`dot_q8`]).
    #[inline]
    pub fn takes(self, x: [&[BlockQ8]; N]) -> Option<Self> {
        let k = q8_kernels(self.ty);
        x.iter().all(|xt| simd_takes(&k, self.ty, xt)).then_some(Q8Tn { checked: true, ..self })
    }

    /// `row` (`x[t].len() · 32` values of the format) times the N activation rows `x` (each as long as `x[0]`;
    /// Q8_K for the formats that pair with it, as [`dot_q8`]: otherwise each token takes [`dot_q8`]). Panics when a
    /// length disagrees.
    #[inline]
    pub fn dot(&self, row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        let rb = self.ty.row_bytes(x[0].len() * 32);
        assert!(row.len() == rb && x.iter().all(|xt| xt.len() == x[0].len()), "dot_q8_tn: lengths");
        if !self.checked {
            let k = q8_kernels(self.ty);
            if !x.iter().all(|xt| simd_takes(&k, self.ty, xt)) {
                return x.map(|xt| dot_q8(self.ty, row, xt));
            }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a Q8Tn exists only where q8_t4 / q8_t8 found AVX2/FMA/F16C; the row holds x[t].len() blocks for
        // every t (asserted above).
        return unsafe { (self.f)(row, x) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no N-token kernels off x86-64")
    }
}

/// The four-token kernel of `ty` where the format has one and the CPU runs it (looked up once per product, not per
/// row); `None` otherwise (prefill products then unpack a row per token). Where the CPU runs the AVX-512 VNNI kernel
/// of a wide format (Q4_0, Q4_1: [`super::q4_wide`], whose sums run in another order than the AVX2 kernels'),
/// `None` too: [`dot_q8`] gives that kernel's bits there, and so must every token of a product.
pub fn q8_t4(ty: GgmlType) -> Option<Q8T4> {
    #[cfg(target_arch = "x86_64")]
    return q8_tn_kernels(ty).and_then(|k| k.avx2_t4).map(|f| Q8Tn { ty, checked: false, f });
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        None
    }
}

/// The eight-token kernel of `ty` (see [`q8_t4`]: the same conditions), where the format has one.
pub fn q8_t8(ty: GgmlType) -> Option<Q8Tn<8>> {
    #[cfg(target_arch = "x86_64")]
    return q8_tn_kernels(ty).and_then(|k| k.avx2_t8).map(|f| Q8Tn { ty, checked: false, f });
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        None
    }
}

/// The format's Q8 kernels where its N-token kernels may serve on this CPU ([`q8_t4`], [`q8_t8`]): AVX2 present,
/// and not a wide format at the AVX-512 level.
#[cfg(target_arch = "x86_64")]
fn q8_tn_kernels(ty: GgmlType) -> Option<super::format::Q8Dot> {
    if !simd_level().avx2() {
        return None;
    }
    let k = super::format::lookup(ty).and_then(|f| f.q8)?;
    (!(k.wide && simd_level() == SimdLevel::Avx512)).then_some(k)
}

/// Scalar reference of [`dot_q8`] (each format's own, [`super::format`]).
pub fn dot_q8_scalar(ty: GgmlType, row: &[u8], x: &[BlockQ8]) -> f32 {
    (q8_kernels(ty).scalar)(row, x)
}

/// Dot product of a weight row with f32 activations: float formats directly,
/// block formats by dequantizing the row first (the exact reference path, in
/// f64 accumulation; slow).
pub fn vec_dot_f32_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let Some(f) = super::format::lookup(ty) else { panic!("vec_dot_f32_row: {ty:?} is not supported") };
    match f.f32_dot {
        Some(dot) => dot(row, x),
        None => {
            let mut w = vec![0f32; x.len()];
            super::dequantize_row(ty, row, &mut w).expect("row length");
            w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::BlockQ8;
    use std::arch::x86_64::*;

    /// The sum of the 8 lanes. SAFETY (callers): avx2, fma and f16c present.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The little-endian f16 at `p` as f32. SAFETY (callers): the features above; `p` readable for 2 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn h2f(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([*p, *p.add(1)]) as i32)))
    }

    /// Prefetches row `p`'s bytes ahead of offset `off` ([`crate::quant::prefetch`]).
    #[inline(always)]
    fn prefetch(p: *const u8, off: usize) {
        crate::quant::prefetch::ahead(p, off);
    }

    /// 16 bytes of nibbles -> 32 bytes (low nibbles first, then high), values 0..15. SAFETY (callers): the
    /// features above; `p` readable for 16 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn nibbles(p: *const u8) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        let v = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
        _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
    }

    /// Σ w[j]*x[j] of signed bytes via the sign trick, as 8 f32 partial sums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mul_sum_i8(w: __m256i, x: __m256i) -> __m256 {
        let ax = _mm256_sign_epi8(w, w);
        let sy = _mm256_sign_epi8(x, w);
        let d16 = _mm256_maddubs_epi16(ax, sy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(d16, _mm256_set1_epi16(1)))
    }

    /// SAFETY (callers): the CPU has avx2, fma and f16c; `row` holds `x.len()` Q4_1 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        let ones = _mm256_set1_epi16(1);
        let p = row.as_ptr();
        for (i, xb) in x.iter().enumerate() {
            let b = p.add(i * 20);
            let d = h2f(b);
            let m = h2f(b.add(2));
            summs += m * xb.s;
            let qw = nibbles(b.add(4));
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), ones));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), s, acc);
        }
        hsum(acc) + summs
    }

    /// Four Q4_1 rows at once; same per-row operation order as [`dot_q4_1`].
    /// SAFETY (callers): the CPU has avx2, fma and f16c; each row holds `x.len()` Q4_1 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_x4(rows: [&[u8]; 4], x: &[BlockQ8]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summs = [0f32; 4];
        let ones = _mm256_set1_epi16(1);
        let p = [rows[0].as_ptr(), rows[1].as_ptr(), rows[2].as_ptr(), rows[3].as_ptr()];
        for (i, xb) in x.iter().enumerate() {
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            if i % 2 == 0 {
                for &r in &p {
                    prefetch(r, i * 20);
                }
            }
            for j in 0..4 {
                let b = p[j].add(i * 20);
                let d = h2f(b);
                let m = h2f(b.add(2));
                summs[j] += m * xb.s;
                let qw = nibbles(b.add(4));
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), ones));
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), s, acc[j]);
            }
        }
        [hsum(acc[0]) + summs[0], hsum(acc[1]) + summs[1], hsum(acc[2]) + summs[2], hsum(acc[3]) + summs[3]]
    }

    /// Four Q8_0 rows at once; same per-row operation order as [`dot_q8_0`].
    /// SAFETY (callers): the CPU has avx2, fma and f16c; each row holds `x.len()` Q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_x4(rows: [&[u8]; 4], x: &[BlockQ8]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let p = [rows[0].as_ptr(), rows[1].as_ptr(), rows[2].as_ptr(), rows[3].as_ptr()];
        for (i, xb) in x.iter().enumerate() {
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            for &r in &p {
                prefetch(r, i * 34);
            }
            for j in 0..4 {
                let b = p[j].add(i * 34);
                let d = h2f(b);
                let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), mul_sum_i8(qw, qx), acc[j]);
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    /// Eight i32 partial sums of `(w[j] - 8) * x[j]` for unsigned nibbles `w` (0..15) and signed `x`, given
    /// `x8` = 8 × the same partial sums of `x` ([`sum_x8`]): `maddubs` takes the nibbles as they are (pairs reach
    /// at most 2 × 15 × 128, no saturation), so the integers equal [`mul_sum_i8`]'s of `w - 8` (for `x` in −127..=127,
    /// all the quantizer makes; the sign trick itself is off at −128) — the same floats —
    /// with three byte operations less per block and row than the sign trick.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mul_sum_q4(w: __m256i, x: __m256i, x8: __m256i) -> __m256 {
        let d = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
        _mm256_cvtepi32_ps(_mm256_sub_epi32(d, x8))
    }

    /// 8 × the eight partial sums of four signed bytes each of `x` (the offset term of [`mul_sum_q4`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn sum_x8(x: __m256i) -> __m256i {
        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), _mm256_set1_epi16(1));
        _mm256_slli_epi32(s, 3)
    }

    /// Four Q4_0 rows at once; same per-row operation order (and integers) as [`dot_q4_0`].
    /// SAFETY (callers): the CPU has avx2, fma and f16c; each row holds `x.len()` Q4_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_x4(rows: [&[u8]; 4], x: &[BlockQ8]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let p = [rows[0].as_ptr(), rows[1].as_ptr(), rows[2].as_ptr(), rows[3].as_ptr()];
        for (i, xb) in x.iter().enumerate() {
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            let x8 = sum_x8(qx);
            if i % 2 == 0 {
                for &r in &p {
                    prefetch(r, i * 18);
                }
            }
            for j in 0..4 {
                let b = p[j].add(i * 18);
                let qw = nibbles(b.add(2));
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b) * xb.d), mul_sum_q4(qw, qx, x8), acc[j]);
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    /// One Q4_1 row times four tokens' activations (prefill products: the row's nibbles unpacked once and its
    /// bytes read once for the four); each result bit for bit [`dot_q4_1`]'s for that token.
    /// SAFETY (callers): the CPU has avx2, fma and f16c; the row holds `x[t].len()` Q4_1 blocks for every `t`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_t4(row: &[u8], x: [&[BlockQ8]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summs = [0f32; 4];
        let ones = _mm256_set1_epi16(1);
        let p = row.as_ptr();
        for i in 0..x[0].len() {
            let b = p.add(i * 20);
            let d = h2f(b);
            let m = h2f(b.add(2));
            let qw = nibbles(b.add(4));
            for t in 0..4 {
                let xb = &x[t][i];
                summs[t] += m * xb.s;
                let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), ones));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), s, acc[t]);
            }
        }
        [hsum(acc[0]) + summs[0], hsum(acc[1]) + summs[1], hsum(acc[2]) + summs[2], hsum(acc[3]) + summs[3]]
    }

    /// One Q4_0 row times four tokens' activations (the row's codes unpacked once, as signed `q − 8`); each result
    /// bit for bit [`dot_q4_0`]'s: the sign trick gives the same eight integer sums Σ(q − 8)·x as its
    /// [`mul_sum_q4`] (pairs of at most 2 × 8 × 127, for `x` in −127..=127 as the quantizer makes them).
    /// SAFETY (callers): the CPU has avx2, fma and f16c; the row holds `x[t].len()` Q4_0 blocks for every `t`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_t4(row: &[u8], x: [&[BlockQ8]; 4]) -> [f32; 4] {
        signed_t4(row, x, 18, |b| _mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)))
    }

    /// One Q8_0 row times four tokens' activations (the row's bytes read once for the four); each result bit for
    /// bit [`dot_q8_0`]'s ([`mul_sum_i8`] with the row's absolute values taken once).
    /// SAFETY (callers): the CPU has avx2, fma and f16c; the row holds `x[t].len()` Q8_0 blocks for every `t`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_t4(row: &[u8], x: [&[BlockQ8]; 4]) -> [f32; 4] {
        signed_t4(row, x, 34, |b| _mm256_loadu_si256(b.add(2) as *const __m256i))
    }

    /// The four-token product of a format of `bs`-byte blocks, each an f16 scale then codes that `codes` gives as
    /// 32 signed bytes (from the block's address): per block and token, [`mul_sum_i8`]'s integers with the row's
    /// absolute values taken once, scaled by `d · dx` into one fused multiply-add chain per token.
    /// SAFETY (callers): the CPU has avx2, fma and f16c; the row holds `x[t].len()` blocks for every `t`; `codes`
    /// reads inside the block it is given.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn signed_t4(row: &[u8], x: [&[BlockQ8]; 4], bs: usize, codes: impl Fn(*const u8) -> __m256i) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let ones = _mm256_set1_epi16(1);
        let p = row.as_ptr();
        for i in 0..x[0].len() {
            let b = p.add(i * bs);
            let d = h2f(b);
            let w = codes(b);
            let aw = _mm256_sign_epi8(w, w);
            for t in 0..4 {
                let xb = &x[t][i];
                let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(qx, w)), ones));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), s, acc[t]);
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    /// Quantizes 32-value blocks like [`super::quantize_q8`] (same rounding: ties to even).
    /// SAFETY (callers): the CPU has avx2, fma and f16c; `x.len() == out.len() * 32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
        let sign = _mm256_set1_ps(-0.0);
        for (bi, ob) in out.iter_mut().enumerate() {
            let p = x.as_ptr().add(bi * 32);
            let v =
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for vv in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vv));
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mul = _mm256_set1_ps(id);
            let mut sum = _mm256_setzero_si256();
            let mut q = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                let r = _mm256_round_ps(_mm256_mul_ps(v[k], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[k] = _mm256_cvtps_epi32(r);
                sum = _mm256_add_epi32(sum, q[k]);
            }
            // pack i32 -> i16 -> i8 and fix the lane order of the packs
            let a = _mm256_packs_epi32(q[0], q[1]);
            let b = _mm256_packs_epi32(q[2], q[3]);
            let c = _mm256_packs_epi16(a, b);
            let c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(ob.qs.as_mut_ptr() as *mut __m256i, c);
            let s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
            let s4 = _mm_hadd_epi32(s4, s4);
            let s4 = _mm_hadd_epi32(s4, s4);
            let isum = _mm_cvtsi128_si32(s4);
            ob.d = super::f16_round(d);
            ob.s = super::f16_round(d * isum as f32);
        }
    }

    /// [`super::quantize_q8_k`] with the same bits. SAFETY (callers): the CPU has avx2, fma and f16c; `x` holds
    /// `out.len() · 32` values, a multiple of 256.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8]) {
        let sign = _mm256_set1_ps(-0.0);
        for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(8)) {
            let p = xb.as_ptr();
            let mut m = _mm256_setzero_ps();
            for k in 0..32 {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(8 * k))));
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            if amax == 0.0 {
                ob.iter_mut().for_each(|b| *b = BlockQ8::default());
                continue;
            }
            // the first value of largest magnitude, as the scalar loop's strict `>` picks it
            let max = *xb.iter().find(|v| v.abs() == amax).unwrap_or(&amax);
            let iscale = -127.0 / max;
            let d = 1.0 / iscale;
            let mul = _mm256_set1_ps(iscale);
            let cap = _mm256_set1_epi32(127);
            for (bi, b) in ob.iter_mut().enumerate() {
                let mut sum = _mm256_setzero_si256();
                let mut q = [_mm256_setzero_si256(); 4];
                for (k, qk) in q.iter_mut().enumerate() {
                    let v = _mm256_loadu_ps(p.add(32 * bi + 8 * k));
                    let r = _mm256_round_ps(_mm256_mul_ps(v, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    *qk = _mm256_min_epi32(_mm256_cvtps_epi32(r), cap);
                    sum = _mm256_add_epi32(sum, *qk);
                }
                let a = _mm256_packs_epi32(q[0], q[1]);
                let c = _mm256_packs_epi16(a, _mm256_packs_epi32(q[2], q[3]));
                let c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, c);
                let s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
                let s4 = _mm_hadd_epi32(s4, s4);
                let s4 = _mm_hadd_epi32(s4, s4);
                b.d = d;
                b.s = super::f16_round(d * _mm_cvtsi128_si32(s4) as f32);
            }
        }
    }

    /// SAFETY (callers): the CPU has avx2, fma and f16c; `row` holds `x.len()` Q4_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let p = row.as_ptr();
        for (i, xb) in x.iter().enumerate() {
            let b = p.add(i * 18);
            let d = h2f(b);
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), mul_sum_q4(nibbles(b.add(2)), qx, sum_x8(qx)), acc);
        }
        hsum(acc)
    }

    /// SAFETY (callers): the CPU has avx2, fma and f16c; `row` holds `x.len()` Q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let p = row.as_ptr();
        for (i, xb) in x.iter().enumerate() {
            let b = p.add(i * 34);
            let d = h2f(b);
            let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), mul_sum_i8(qw, qx), acc);
        }
        hsum(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn simd_quantize_matches_scalar() {
        let mut seed = 3u64;
        let mut x: Vec<f32> = (0..32 * 40).map(|_| lcg(&mut seed) * 10.0).collect();
        x[0..32].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5; // ties at .5 steps
        }
        let mut a = vec![BlockQ8::default(); 40];
        let mut b = vec![BlockQ8::default(); 40];
        quantize_q8(&x, &mut a);
        quantize_q8_scalar(&x, &mut b);
        for (p, q) in a.iter().zip(&b) {
            assert_eq!((p.d, p.s, p.qs), (q.d, q.s, q.qs));
        }
    }

    /// The AVX2 Q8_K quantization gives the scalar one's bits: random super-blocks, an all-zero one, ties of
    /// rounding, and a largest magnitude held by both signs (the first one sets the scale's sign).
    #[test]
    fn simd_quantize_q8_k_matches_scalar() {
        let mut seed = 5u64;
        let mut x: Vec<f32> = (0..256 * 6).map(|_| lcg(&mut seed) * 10.0).collect();
        x[0..256].iter_mut().for_each(|v| *v = 0.0);
        for (i, v) in x[256..512].iter_mut().enumerate() {
            *v = (i as f32 - 128.0) * 0.5;
        }
        x[600] = -40.0;
        x[700] = 40.0;
        x[900] = 40.0;
        x[1000] = -40.0;
        let mut a = vec![BlockQ8::default(); 48];
        let mut b = vec![BlockQ8::default(); 48];
        quantize_q8_k(&x, &mut a);
        quantize_q8_k_scalar(&x, &mut b);
        for (p, q) in a.iter().zip(&b) {
            assert_eq!((p.d.to_bits(), p.s.to_bits(), p.qs), (q.d.to_bits(), q.s.to_bits(), q.qs));
        }
        assert!(a[16].d > 0.0 && a[24].d < 0.0, "the first ±40 sets the sign");
    }

    /// The unsigned-nibble Q4_0 form gives the sign trick's partial sums of `w - 8` exactly (so the same floats):
    /// random nibbles and activations, and the extremes (nibbles 0 and 15 against ±127).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q4_nibble_sums_equal_the_sign_trick() {
        use std::arch::x86_64::*;
        if !simd_level().avx2() {
            return;
        }
        let mut seed = 11u64;
        let mut cases: Vec<([u8; 32], [i8; 32])> = (0..200)
            .map(|_| {
                let mut w = [0u8; 32];
                let mut x = [0i8; 32];
                for j in 0..32 {
                    w[j] = ((lcg(&mut seed) + 1.0) * 8.0) as u8 & 0x0f;
                    x[j] = (lcg(&mut seed) * 127.0) as i8;
                }
                (w, x)
            })
            .collect();
        cases.push(([0; 32], [127; 32]));
        cases.push(([0; 32], [-127; 32]));
        cases.push(([15; 32], [127; 32]));
        cases.push(([15; 32], [-127; 32]));
        for (w, x) in cases {
            // SAFETY: AVX2 detected above; the arrays are 32 bytes.
            let (a, b) = unsafe {
                let wv = _mm256_loadu_si256(w.as_ptr() as *const __m256i);
                let xv = _mm256_loadu_si256(x.as_ptr() as *const __m256i);
                let old = avx2::mul_sum_i8(_mm256_sub_epi8(wv, _mm256_set1_epi8(8)), xv);
                let new = avx2::mul_sum_q4(wv, xv, avx2::sum_x8(xv));
                let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
                _mm256_storeu_ps(a.as_mut_ptr(), old);
                _mm256_storeu_ps(b.as_mut_ptr(), new);
                (a, b)
            };
            assert_eq!(a, b, "w {w:?} x {x:?}");
        }
    }

    /// The four-token kernels of Q4_0, Q4_1 and Q8_0 give each token the one-row kernel's bits: random rows and
    /// rows of extreme codes (nibbles 0 and 15; Q8_0 bytes −1 and −127), four different activation rows with blocks
    /// at ±127, rows of 1, 2 and 18 blocks. And a product's tokens all get [`dot_q8`]'s bits through
    /// [`q8_t4`] at this CPU's level (none for the wide formats where the AVX-512 kernel serves them).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn four_token_kernels_give_each_token_the_one_row_bits() {
        if !simd_level().avx2() {
            return;
        }
        let mut seed = 13u64;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let k = q8_kernels(ty);
            let t4 = k.avx2_t4.expect("a four-token kernel");
            let bs = ty.type_size();
            // the extreme low codes: Q8_0 bytes −127, nibbles 0
            let low = if ty == GgmlType::Q8_0 { 0x81 } else { 0x00 };
            for nb in [1usize, 2, 18] {
                for extreme in [0u8, 1, 2] {
                    let mut row = vec![0u8; nb * bs];
                    for b in row.iter_mut() {
                        *b = match extreme {
                            0 => (lcg(&mut seed) * 127.0) as i8 as u8,
                            1 => 0xff, // nibbles 15, Q8_0 codes −1
                            _ => low,
                        };
                    }
                    for blk in row.chunks_exact_mut(bs) {
                        let d = half::f16::from_f32(0.01 * (1.5 + lcg(&mut seed))).to_bits().to_le_bytes();
                        blk[0..2].copy_from_slice(&d);
                        if ty == GgmlType::Q4_1 {
                            blk[2..4]
                                .copy_from_slice(&half::f16::from_f32(-0.05 * lcg(&mut seed)).to_bits().to_le_bytes());
                        }
                    }
                    let xs: Vec<Vec<BlockQ8>> = (0..4)
                        .map(|t| {
                            let mut v: Vec<f32> = (0..nb * 32).map(|_| lcg(&mut seed) * 4.0).collect();
                            if t == 3 {
                                v.iter_mut().enumerate().for_each(|(i, a)| *a = if i % 3 == 0 { -4.0 } else { 4.0 });
                            }
                            let mut q = vec![BlockQ8::default(); nb];
                            quantize_q8(&v, &mut q);
                            q
                        })
                        .collect();
                    let x4 = [&xs[0][..], &xs[1][..], &xs[2][..], &xs[3][..]];
                    // SAFETY: AVX2/FMA/F16C detected above; the row holds nb whole blocks of each x.
                    let got = unsafe { t4(&row, x4) };
                    for (t, g) in got.iter().enumerate() {
                        // SAFETY: as above.
                        let one = unsafe { (k.avx2)(&row, &xs[t]) };
                        assert_eq!(g.to_bits(), one.to_bits(), "{ty:?} x{nb} extreme {extreme} token {t}");
                    }
                    if let Some(k4) = q8_t4(ty) {
                        for (t, g) in k4.dot(&row, x4).iter().enumerate() {
                            let want = dot_q8(ty, &row, &xs[t]);
                            assert_eq!(g.to_bits(), want.to_bits(), "{ty:?} x{nb} q8_t4 token {t}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn simd_matches_scalar() {
        let mut seed = 7u64;
        let n = 576;
        let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 3.0).collect();
        let mut xq = vec![BlockQ8::default(); n / 32];
        quantize_q8(&x, &mut xq);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let mut row = vec![0u8; ty.row_bytes(n)];
            for b in row.iter_mut() {
                *b = (lcg(&mut seed) * 127.0) as i8 as u8;
            }
            // keep the f16 scales finite and small
            let bs = ty.type_size();
            for blk in row.chunks_exact_mut(bs) {
                blk[0..2].copy_from_slice(&half::f16::from_f32(0.01 * (1.0 + lcg(&mut seed))).to_bits().to_le_bytes());
                if ty == GgmlType::Q4_1 {
                    blk[2..4].copy_from_slice(&half::f16::from_f32(-0.05 * lcg(&mut seed)).to_bits().to_le_bytes());
                }
            }
            let s = dot_q8_scalar(ty, &row, &xq);
            let v = dot_q8(ty, &row, &xq);
            let v4 = dot_q8_x4(ty, [&row, &row, &row, &row], &xq);
            assert!(v4.iter().all(|&y| y == v), "{ty:?}: x4 {v4:?} vs single {v}");
            assert!((s - v).abs() <= 1e-4 * s.abs().max(1.0), "{ty:?}: scalar {s} simd {v}");
            // and both close to the float dot product of the dequantized row
            let mut w = vec![0f32; n];
            super::super::dequantize_row(ty, &row, &mut w).unwrap();
            let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
            assert!((exact - s).abs() < 0.02 * exact.abs().max(1.0), "{ty:?}: exact {exact} q8 {s}");
        }
    }
}
