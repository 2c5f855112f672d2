//! `e^x` for the f16 attention's softmax, defined here so that a scalar loop and the AVX2 / AVX-512 registers give
//! the same bits (a C library's `expf` differs between libraries and between their CPU variants, and has no vector
//! form to match), as accurate as glibc's.
//!
//! The method is the one of ARM's optimized-routines `expf` (also glibc's since 2.27), evaluated in f64:
//! `x·32/ln 2 = k + r` with `k` the nearest integer (ties to even, by adding and subtracting 1.5·2⁵²) and
//! `|r| ≤ 1/2`; `2^(k/32)` from a 32-entry table of `2^(i/32)` (f64, correctly rounded; `k mod 32` picks the entry,
//! `k div 32` is added to its exponent bits); `2^(r/32) ≈ 1 + C₂r + C₁r² + C₀r³` (that library's coefficients,
//! relative error below 1e-10), as fused multiply-adds: `(C₀r + C₁)·r² + (C₂r + 1)`; the product in f64, then
//! rounded to f32 (glibc's `expf` gave the same bits on every 7th f32 from −104 to 0 on an x86-64 glibc build
//! with FMA). Error within about half a unit in the last place (checked below against f64). `x` below −150 is taken as
//! −150 (the result, 0, is the same), so −∞ gives 0; NaN gives NaN. The domain used is `x ≤ 0` (a score minus the
//! largest); above 0 the result is right up to `x ≈ 88`, beyond it meaningless.

/// Inputs below this are taken as it (`e^-150` rounds to 0 in f32).
const EXP_FLOOR: f32 = -150.0;
/// 32 / ln 2.
const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// 1.5 · 2⁵²: added and subtracted, it rounds an f64 below 2⁵¹ in size to an integer (ties to even), which its
/// low bits then hold.
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// `2^(r/32) − 1 ≈ C₀r³ + C₁r² + C₂r`.
const C: [f64; 3] = [
    f64::from_bits(0x3ebc_6af8_4b91_2394),
    f64::from_bits(0x3f2e_bfce_50fa_c4f3),
    f64::from_bits(0x3f96_2e42_ff0c_52d6),
];
/// The bits of `2^(i/32)` (f64, correctly rounded) less `i << 47`, so that adding `k << 47` (`k ≡ i mod 32`) gives
/// the bits of `2^(k/32)`.
const T: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];

/// `e^x` as the module defines it. Fast where the caller's code runs with FMA enabled (`mul_add` is one
/// instruction there; elsewhere a correctly rounded library call, with the same result).
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let z = INV_LN2_N * x.max(EXP_FLOOR) as f64;
    let kd = z + SHIFT;
    let ki = kd.to_bits();
    let r = z - (kd - SHIFT);
    let s = f64::from_bits(T[(ki % 32) as usize].wrapping_add(ki << 47));
    let y = C[0].mul_add(r, C[1]).mul_add(r * r, C[2].mul_add(r, 1.0));
    (y * s) as f32
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{C, EXP_FLOOR, INV_LN2_N, SHIFT, T};

    /// [`super::exp`] of four f64 lanes (the inputs' f32 values, already raised to the floor).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp4d(xd: __m256d) -> __m256d {
        let z = _mm256_mul_pd(_mm256_set1_pd(INV_LN2_N), xd);
        let kd = _mm256_add_pd(z, _mm256_set1_pd(SHIFT));
        let ki = _mm256_castpd_si256(kd);
        let r = _mm256_sub_pd(z, _mm256_sub_pd(kd, _mm256_set1_pd(SHIFT)));
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: every index is below 32, inside T.
        let t = unsafe { _mm256_i64gather_epi64::<8>(T.as_ptr() as *const i64, idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let hi = _mm256_fmadd_pd(_mm256_set1_pd(C[0]), r, _mm256_set1_pd(C[1]));
        let lo = _mm256_fmadd_pd(_mm256_set1_pd(C[2]), r, _mm256_set1_pd(1.0));
        _mm256_mul_pd(_mm256_fmadd_pd(hi, _mm256_mul_pd(r, r), lo), s)
    }

    /// [`super::exp`] of eight lanes (the same bits per lane).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::backend::cpu) fn exp8(x: __m256) -> __m256 {
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        // (a NaN lane is replaced by the floor here and by x below)
        let xc = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
        let lo = _mm256_cvtpd_ps(exp4d(_mm256_cvtps_pd(_mm256_castps256_ps128(xc))));
        let hi = _mm256_cvtpd_ps(exp4d(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(xc))));
        _mm256_blendv_ps(_mm256_set_m128(hi, lo), x, nan)
    }

    /// [`super::exp`] of eight f64 lanes (the inputs' f32 values, already raised to the floor).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp8d(xd: __m512d) -> __m512d {
        let z = _mm512_mul_pd(_mm512_set1_pd(INV_LN2_N), xd);
        let kd = _mm512_add_pd(z, _mm512_set1_pd(SHIFT));
        let ki = _mm512_castpd_si512(kd);
        let r = _mm512_sub_pd(z, _mm512_sub_pd(kd, _mm512_set1_pd(SHIFT)));
        // SAFETY: T holds 32 u64 (four registers of eight).
        let tab: [__m512i; 4] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_si512(T.as_ptr().add(8 * i) as *const _) });
        // entries 0..16 and 16..32 by the index's low four bits, then bit 4 picks between them
        let low = _mm512_permutex2var_epi64(tab[0], ki, tab[1]);
        let high = _mm512_permutex2var_epi64(tab[2], ki, tab[3]);
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, low, high);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let hi = _mm512_fmadd_pd(_mm512_set1_pd(C[0]), r, _mm512_set1_pd(C[1]));
        let lo = _mm512_fmadd_pd(_mm512_set1_pd(C[2]), r, _mm512_set1_pd(1.0));
        _mm512_mul_pd(_mm512_fmadd_pd(hi, _mm512_mul_pd(r, r), lo), s)
    }

    /// [`super::exp`] of sixteen lanes (the same bits per lane).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::backend::cpu) fn exp16(x: __m512) -> __m512 {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let xc = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
        let lo = _mm512_cvtpd_ps(exp8d(_mm512_cvtps_pd(_mm512_castps512_ps256(xc))));
        let hi = _mm512_cvtpd_ps(exp8d(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(xc),
        )))));
        let v = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(lo)),
            _mm256_castps_pd(hi),
        ));
        _mm512_mask_mov_ps(v, nan, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `got` and the f64 value `want` (at `want`'s f32 spacing; subnormal results
    /// at the smallest spacing).
    fn ulps(got: f32, want: f64) -> f64 {
        let w = (want as f32).max(f32::MIN_POSITIVE);
        let spacing = (f32::from_bits(w.to_bits() + 1) - w) as f64;
        let spacing = if (want as f32) < f32::MIN_POSITIVE { f32::from_bits(1) as f64 } else { spacing };
        (got as f64 - want).abs() / spacing
    }

    /// Within 0.51 ulp of f64's `exp` across the domain used (every 97th f32 from −104 to 0, and the ends); 0 for
    /// −∞ and far below; NaN stays NaN.
    #[test]
    fn exp_is_within_half_an_ulp_on_the_softmax_domain() {
        let (lo, hi) = ((-104.0f32).to_bits(), 0x8000_0000u32);
        let mut worst = 0f64;
        let mut x = hi;
        while x < lo {
            let v = f32::from_bits(x);
            worst = worst.max(ulps(exp(v), (v as f64).exp()));
            x += 97;
        }
        for v in [-87.0f32, -86.99, -1e-30, 0.0, -0.0, -0.5 * std::f32::consts::LN_2, -10.0, -103.0] {
            worst = worst.max(ulps(exp(v), (v as f64).exp()));
        }
        assert!(worst <= 0.51, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-104.0), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    /// The AVX2 and AVX-512 lanes give the scalar bits (every 613th f32 from −160 to 0, −∞, NaN).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_registers_give_the_scalar_bits() {
        use std::arch::x86_64::*;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        let wide = is_x86_feature_detected!("avx512f");
        let mut xs: Vec<f32> = ((0x8000_0000u32..(-160.0f32).to_bits()).step_by(613)).map(f32::from_bits).collect();
        xs.extend([f32::NEG_INFINITY, f32::NAN, 0.0, -87.0, -103.5, -150.0, -150.5]);
        while !xs.len().is_multiple_of(16) {
            xs.push(-1.5);
        }
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for c in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: AVX2 and FMA were detected; 16 values in and out (two registers of eight).
            unsafe {
                for h in 0..2 {
                    let y = exp8(_mm256_loadu_ps(c.as_ptr().add(8 * h)));
                    _mm256_storeu_ps(got.as_mut_ptr().add(8 * h), y);
                }
            }
            assert!(c.iter().zip(&got).all(|(&x, &g)| same(exp(x), g)), "AVX2 lanes of {c:?}");
            if wide {
                // SAFETY: AVX-512 F was detected; 16 values in and out.
                unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp16(_mm512_loadu_ps(c.as_ptr()))) };
                assert!(c.iter().zip(&got).all(|(&x, &g)| same(exp(x), g)), "AVX-512 lanes of {c:?}");
            }
        }
    }
}
