//! f16 rows: conversions and the attention scores over an f16 KV cache (f32 queries rounded to f16 against f16
//! keys; the V products are the attention's own, `backend::cpu::attention`). Each function has a portable body and an AVX2 + F16C one chosen at
//! run time ([`super::simd_level`]); the two give the same bits (conversions round to nearest even; products
//! multiply and add in the same order, without fused multiply-adds).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether the AVX2 + F16C bodies run.
#[cfg(target_arch = "x86_64")]
#[inline]
fn fast() -> bool {
    cfg!(target_arch = "x86_64") && super::simd_level().avx2()
}

/// `dst[i]` = the f16 bits nearest `src[i]` (ties to even; beyond ±65504, ±infinity). Lengths must match.
pub fn from_f32_slice(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "f16 conversion lengths");
    #[cfg(target_arch = "x86_64")]
    if fast() {
        // SAFETY: AVX2 and F16C were detected; the lengths are equal (asserted).
        unsafe { from_f32_avx2(src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(s).to_bits();
    }
}

/// Rounds every value of `x` to its nearest f16 (kept as f32), as llama.cpp's F16 attention does to queries and
/// probabilities.
pub fn round_slice(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if fast() {
        // SAFETY: AVX2 and F16C were detected.
        unsafe { round_avx2(x) };
        return;
    }
    for v in x.iter_mut() {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

/// `Σ a[i] · b[i]` for f32 `a` and f16 `b` (equal lengths), with eight partial sums as the CPU backend's
/// `dot_f32` keeps them (reduced by [`reduce8`]): the same bits as that product of `a` with `b` in f32.
#[inline]
pub fn dot(a: &[f32], b: &[u16]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot lengths");
    #[cfg(target_arch = "x86_64")]
    if fast() {
        // SAFETY: AVX2 and F16C were detected; equal lengths (asserted).
        return unsafe { dot_avx2(a, b) };
    }
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * half::f16::from_bits(cb[i]).to_f32();
        }
    }
    finish(&acc, &a[n8..], &b[n8..])
}

/// The sum of eight partial sums in the order every f32/f16 dot product of the attention uses (the CPU
/// backend's `dot_f32`, [`dot`], the grouped f16 attention): the products' bits depend on it.
#[inline(always)]
pub fn reduce8(acc: &[f32; 8]) -> f32 {
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7])
}

/// The partial sums' reduction and the tail, in `dot_f32`'s order.
#[inline]
fn finish(acc: &[f32; 8], a: &[f32], b: &[u16]) -> f32 {
    let tail: f32 = a.iter().zip(b).map(|(x, &y)| x * half::f16::from_bits(y).to_f32()).sum();
    reduce8(acc) + tail
}

/// # Safety
/// AVX2 and F16C must be available; `src.len() == dst.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn from_f32_avx2(src: &[f32], dst: &mut [u16]) {
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 ≤ n8 ≤ both lengths.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
    }
    for (d, &s) in dst[n8..].iter_mut().zip(&src[n8..]) {
        *d = half::f16::from_f32(s).to_bits();
    }
}

/// # Safety
/// AVX2 and F16C must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn round_avx2(x: &mut [f32]) {
    let n8 = x.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 ≤ n8 ≤ x.len().
        unsafe {
            let p = x.as_mut_ptr().add(i);
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(p));
            _mm256_storeu_ps(p, _mm256_cvtph_ps(h));
        }
    }
    for v in x[n8..].iter_mut() {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

/// # Safety
/// AVX2 and F16C must be available; `a.len() == b.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn dot_avx2(a: &[f32], b: &[u16]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 ≤ n8 ≤ both lengths.
        unsafe {
            let x = _mm256_loadu_ps(a.as_ptr().add(i));
            let y = _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(i) as *const __m128i));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: eight f32 lanes into an array of eight.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    finish(&lanes, &a[n8..], &b[n8..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                let v = (s >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0;
                // extremes: f16 overflow, subnormals, a tie
                match i % 37 {
                    5 => 70000.0,
                    11 => 3.0e-7,
                    17 => 1.0 + 1.0 / 2048.0,
                    _ => v,
                }
            })
            .collect()
    }

    /// The AVX2 + F16C bodies give the portable bodies' bits (and those of `half` and `dot_f32`), for lengths
    /// with and without an 8-value tail.
    #[test]
    fn fast_bodies_match_the_portable_ones() {
        for n in [1usize, 7, 8, 64, 67, 128] {
            let a = values(n, 1);
            let b32: Vec<f32> = values(n, 2).iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            let mut b = vec![0u16; n];
            from_f32_slice(&values(n, 2), &mut b);
            assert!(b.iter().zip(&b32).all(|(&h, &f)| half::f16::from_bits(h).to_f32().to_bits() == f.to_bits()));
            let d = dot(&a, &b);
            assert_eq!(d.to_bits(), crate::backend::cpu::math::dot_f32(&a, &b32).to_bits(), "n = {n}");
            let mut r = a.clone();
            round_slice(&mut r);
            assert!(r.iter().zip(&a).all(|(x, y)| x.to_bits() == half::f16::from_f32(*y).to_f32().to_bits()));
        }
    }
}
