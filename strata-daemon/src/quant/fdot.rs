//! Dot products of float-format rows (F32, F16, BF16: the little-endian element bytes of a GGUF tensor row) with
//! f32 activations: the products of the weights that stay in floats, such as every MoE router (`ffn_gate_inp`,
//! which llama.cpp's quantizer keeps in F32), the shared-expert gates and whole F16/BF16 files.
//!
//! A row's sum is `((-0 + w0·x0) + w1·x1) + …` in element order, each product rounded before its add (no fused
//! multiply-add): the order of a plain loop, kept so that outputs stay those of the scalar code they replace. One
//! row at a time that is a chain of dependent adds (one element per add latency); [`dot4_f32`] and the others therefore compute four
//! rows at once with one row per vector lane (four rows' elements loaded and transposed, the same adds in the
//! same order per lane), which gives each row's bits and reads memory at its rate; it prefetches its rows into L2
//! ahead of the reads ([`super::prefetch`]). A row shorter than the activations is a panic (a caller's bug: the
//! matmul planner checks shapes), not a silently shorter sum.

use super::{bf16_to_f32, f16_to_f32};

/// An element decoder: the f32 value of one element from its bytes.
type Elem = fn(&[u8]) -> f32;

fn f32_elem(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn f16_elem(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

fn bf16_elem(b: &[u8]) -> f32 {
    bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// The module's sum for one row of `size`-byte elements. Panics when `row` is shorter than `x` needs.
fn sum(row: &[u8], x: &[f32], size: usize, elem: Elem) -> f32 {
    assert!(row.len() >= size * x.len(), "float row of {} bytes for {} values", row.len(), x.len());
    row.chunks_exact(size).zip(x).map(|(b, v)| elem(b) * v).sum()
}

/// `Σ row[i] · x[i]` for an F32 row (`4 · x.len()` bytes, the module's order). Panics on a short row.
pub fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    sum(row, x, 4, f32_elem)
}

/// `Σ row[i] · x[i]` for an F16 row (IEEE half, `2 · x.len()` bytes). Panics on a short row.
pub fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    sum(row, x, 2, f16_elem)
}

/// `Σ row[i] · x[i]` for a BF16 row (the high half of an f32, `2 · x.len()` bytes). Panics on a short row.
pub fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    sum(row, x, 2, bf16_elem)
}

/// Four F32 rows times `x`: each result the bits of [`dot_f32`] for its row, one row per vector lane where the CPU
/// has AVX2. Panics when a row is shorter than `x` needs.
pub fn dot4_f32(rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    check4(rows, x, 4);
    #[cfg(target_arch = "x86_64")]
    if super::simd_level().avx2() {
        // SAFETY: AVX2/FMA/F16C detected (`simd_level`); every row holds `x.len()` elements (`check4`).
        return unsafe { avx2::dot4::<avx2::F32>(rows, x) };
    }
    rows.map(|r| dot_f32(r, x))
}

/// [`dot4_f32`] for F16 rows ([`dot_f16`]'s bits).
pub fn dot4_f16(rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    check4(rows, x, 2);
    #[cfg(target_arch = "x86_64")]
    if super::simd_level().avx2() {
        // SAFETY: as in `dot4_f32`, 2 bytes per element.
        return unsafe { avx2::dot4::<avx2::F16>(rows, x) };
    }
    rows.map(|r| dot_f16(r, x))
}

/// [`dot4_f32`] for BF16 rows ([`dot_bf16`]'s bits).
pub fn dot4_bf16(rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    check4(rows, x, 2);
    #[cfg(target_arch = "x86_64")]
    if super::simd_level().avx2() {
        // SAFETY: as in `dot4_f32`, 2 bytes per element.
        return unsafe { avx2::dot4::<avx2::Bf16>(rows, x) };
    }
    rows.map(|r| dot_bf16(r, x))
}

/// Panics unless every row holds `x.len()` elements of `size` bytes.
fn check4(rows: [&[u8]; 4], x: &[f32], size: usize) {
    for r in rows {
        assert!(r.len() >= size * x.len(), "float row of {} bytes for {} values", r.len(), x.len());
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// An element format the kernel reads 4 at a time.
    pub(super) trait Elem {
        /// Bytes per element.
        const SIZE: usize;
        /// 4 elements at `p` as f32 lanes. SAFETY (callers): avx2, f16c present; `4 · SIZE` bytes at `p`.
        unsafe fn load4(p: *const u8) -> __m128;
        /// One element at `p` as f32 (the same conversion). SAFETY (callers): as `load4`, `SIZE` bytes at `p`.
        #[inline(always)]
        unsafe fn load1(p: *const u8) -> f32 {
            let mut b = [0u8; 16];
            std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), Self::SIZE);
            _mm_cvtss_f32(Self::load4(b.as_ptr()))
        }
    }

    /// F32 elements.
    pub(super) struct F32;
    /// F16 elements.
    pub(super) struct F16;
    /// BF16 elements.
    pub(super) struct Bf16;

    impl Elem for F32 {
        const SIZE: usize = 4;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load4(p: *const u8) -> __m128 {
            _mm_loadu_ps(p as *const f32)
        }
    }

    impl Elem for F16 {
        const SIZE: usize = 2;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load4(p: *const u8) -> __m128 {
            _mm_cvtph_ps(_mm_loadl_epi64(p as *const __m128i))
        }
    }

    impl Elem for Bf16 {
        const SIZE: usize = 2;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load4(p: *const u8) -> __m128 {
            _mm_castsi128_ps(_mm_slli_epi32::<16>(_mm_cvtepu16_epi32(_mm_loadl_epi64(p as *const __m128i))))
        }
    }

    /// Four rows, lane `r` = row `r`, the module's order per lane (the exact f32 conversions of F16/BF16 elements
    /// are the scalar ones). SAFETY (callers): avx2, fma and f16c present; every row holds `E::SIZE · x.len()`
    /// bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot4<E: Elem>(rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
        let p = rows.map(|r| r.as_ptr());
        let mut acc = _mm_set1_ps(-0.0);
        let whole = x.len() / 4 * 4;
        let mut k = 0;
        while k < whole {
            let at = k * E::SIZE;
            if at % 64 == 0 {
                for q in p {
                    crate::quant::prefetch::ahead(q, at);
                }
            }
            // rows' elements k..k+4 transposed: v[j] lane r = row r's element k + j
            let (a, b, c, d) =
                (E::load4(p[0].add(at)), E::load4(p[1].add(at)), E::load4(p[2].add(at)), E::load4(p[3].add(at)));
            let (ab_lo, ab_hi) = (_mm_unpacklo_ps(a, b), _mm_unpackhi_ps(a, b));
            let (cd_lo, cd_hi) = (_mm_unpacklo_ps(c, d), _mm_unpackhi_ps(c, d));
            let v = [
                _mm_movelh_ps(ab_lo, cd_lo),
                _mm_movehl_ps(cd_lo, ab_lo),
                _mm_movelh_ps(ab_hi, cd_hi),
                _mm_movehl_ps(cd_hi, ab_hi),
            ];
            for (j, vj) in v.into_iter().enumerate() {
                acc = _mm_add_ps(acc, _mm_mul_ps(vj, _mm_set1_ps(*x.get_unchecked(k + j))));
            }
            k += 4;
        }
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), acc);
        for j in whole..x.len() {
            for (r, o) in out.iter_mut().enumerate() {
                let e = p[r].add(j * E::SIZE);
                *o += E::load1(e) * *x.get_unchecked(j);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// The plain loop the module's order is defined by.
    fn plain(row: &[u8], x: &[f32], size: usize, elem: Elem) -> f32 {
        let mut s = -0.0f32;
        for (i, v) in x.iter().enumerate() {
            s += elem(&row[i * size..(i + 1) * size]) * v;
        }
        s
    }

    /// Every float format at lengths around the 4-element step (tails included), zero and negative-zero rows: the
    /// one-row functions give the plain loop's bits, the four-row kernel the one-row bits per row, and both are
    /// within rounding of the exact (f64) product.
    #[test]
    fn four_rows_give_the_one_row_bits_for_every_tail() {
        let mut seed = 0xF00Du64;
        for n in [1usize, 3, 4, 5, 8, 31, 33, 64, 100, 2048, 2051] {
            let x: Vec<f32> = (0..n).map(|_| rng(&mut seed)).collect();
            let w: Vec<Vec<f32>> = (0..4)
                .map(|r| match r {
                    0 => vec![0.0; n],
                    1 => vec![-0.0; n],
                    _ => (0..n).map(|_| rng(&mut seed) * 3.0).collect(),
                })
                .collect();
            let enc: [(GgmlType, usize, Elem, fn(f32) -> Vec<u8>); 3] = [
                (GgmlType::F32, 4, f32_elem, |v| v.to_le_bytes().to_vec()),
                (GgmlType::F16, 2, f16_elem, |v| half::f16::from_f32(v).to_bits().to_le_bytes().to_vec()),
                (GgmlType::BF16, 2, bf16_elem, |v| half::bf16::from_f32(v).to_bits().to_le_bytes().to_vec()),
            ];
            for (ty, size, elem, put) in enc {
                let rows: Vec<Vec<u8>> = w.iter().map(|r| r.iter().flat_map(|v| put(*v)).collect()).collect();
                let dot4 = crate::quant::format::lookup(ty).and_then(|f| f.f32_dot4).expect("a float format");
                let four = dot4([&rows[0], &rows[1], &rows[2], &rows[3]], &x);
                for (r, row) in rows.iter().enumerate() {
                    let one = vec_dot(ty, row, &x);
                    assert_eq!(one.to_bits(), plain(row, &x, size, elem).to_bits(), "{ty:?} n {n} row {r}");
                    assert_eq!(four[r].to_bits(), one.to_bits(), "{ty:?} n {n} row {r}: {} vs {one}", four[r]);
                    let (mut want, mut mag) = (0f64, 0f64);
                    for (i, v) in x.iter().enumerate() {
                        let p = elem(&row[i * size..(i + 1) * size]) as f64 * *v as f64;
                        want += p;
                        mag += p.abs();
                    }
                    assert!((one as f64 - want).abs() <= 1e-5 * mag + 1e-30, "{ty:?} n {n}: {one} vs {want}");
                }
            }
        }
        assert!(crate::quant::format::lookup(GgmlType::Q8_0).is_some_and(|f| f.f32_dot4.is_none()));
    }

    fn vec_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        match ty {
            GgmlType::F32 => dot_f32(row, x),
            GgmlType::F16 => dot_f16(row, x),
            _ => dot_bf16(row, x),
        }
    }

    /// A short row (fewer bytes than the activations need) is refused rather than read past its end.
    #[test]
    #[should_panic(expected = "bytes for")]
    fn a_short_row_panics() {
        let _ = dot4_f32([&[0u8; 16], &[0u8; 16], &[0u8; 8], &[0u8; 16]], &[1.0; 4]);
    }
}
