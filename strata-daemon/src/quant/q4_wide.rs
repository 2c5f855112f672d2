//! Q4_0 rows against 8-bit activations with AVX-512 (F, BW, VNNI, VBMI): four blocks per 512-bit step.
//!
//! The AVX2 kernels spend most of their instructions per block and row on the block's scale (a scalar f16
//! load, conversion and broadcast) and on widening the nibble products (`maddubs`, `madd`, offset). Here one
//! 64-byte load plus an 8-byte load hold four whole Q4_0 blocks (4 × 18 bytes); one two-source byte permute
//! (`vpermi2b`) gathers their 64 quant bytes, one one-source permute (`vpermb`) lines up their four f16 scales for
//! a single 16-lane conversion, and two `vpdpbusd` multiply the unsigned nibbles (low halves, then high halves)
//! with the activations, starting from `-8 × Σx` so the sums are those of `(w - 8) · x`, Q4_0's values. The
//! activations are rearranged once per row set ([`Q8Quads`]) to match: per group of four blocks, the four low
//! halves, the four high halves, the offsets and the scales, 256 bytes.
//!
//! The integers are exactly ggml's (`ggml_vec_dot_q4_0_q8_0`: Σ (nibble − 8) · q per block, times
//! `d_w · d_x`); only the order of the float additions differs from the AVX2 kernel (16 lanes of four-element
//! partial sums, summed by `_mm512_reduce_add_ps`), so results agree with it to rounding, and the one-row and the
//! four-row entry points give the same bits.

use super::BlockQ8;

/// 8-bit activations of four consecutive Q8 blocks rearranged for the wide Q4_0 kernel (256 bytes, 64-aligned).
/// A short last group is padded with zero blocks (scale 0, values 0), which add nothing.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Quad {
    /// Bytes 0..16 of each block's 32 values: `[b0[0..16] | b1[0..16] | b2[0..16] | b3[0..16]]`.
    lo: [i8; 64],
    /// Bytes 16..32 of each block, in the same order.
    hi: [i8; 64],
    /// Lane `4b + k`: −8 × (the sum of `b`'s values `4k..4k+4` and `16+4k..16+4k+4`), the offset of Q4_0's `−8`.
    neg8: [i32; 16],
    /// Lane `4b + k`: block `b`'s activation scale `d`.
    scale: [f32; 16],
}

impl Default for Quad {
    fn default() -> Self {
        Quad { lo: [0; 64], hi: [0; 64], neg8: [0; 16], scale: [0.0; 16] }
    }
}

/// Whether this CPU runs the wide kernel: AVX-512 F, BW, VNNI and VBMI (Ice Lake, Sapphire Rapids, Zen 4 and
/// later) besides the AVX2 set the other kernels need.
#[cfg(target_arch = "x86_64")]
pub fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vbmi")
}

/// Whether this CPU runs the wide kernel (never off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn supported() -> bool {
    false
}

/// One activation row (`n` Q8 blocks) in the wide kernel's layout: `n.div_ceil(4)` [`Quad`]s. Reused across rows
/// (the buffer grows once).
#[derive(Default)]
pub struct Q8Quads {
    quads: Vec<Quad>,
    blocks: usize,
    /// Set by `prepare` once it checked the CPU's features (the kernels run only then).
    checked: bool,
}

impl Q8Quads {
    /// Rearranges `x` (one row of Q8 blocks). Panics when the CPU lacks [`supported`]'s features.
    pub fn prepare(&mut self, x: &[BlockQ8]) {
        assert!(supported(), "Q8Quads: the CPU lacks AVX-512 F/BW/VNNI/VBMI");
        self.checked = true;
        self.blocks = x.len();
        self.quads.clear();
        self.quads.resize(x.len().div_ceil(4), Quad::default());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were checked above; `quads` holds x.len().div_ceil(4) groups.
        unsafe {
            imp::prepare(x, &mut self.quads)
        };
    }

    /// Blocks of the prepared row.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Dot product of one Q4_0 row (`self.blocks()` blocks, 18 bytes each) with the prepared activations.
    /// Panics on a row of another length, or before any [`Q8Quads::prepare`].
    pub fn dot(&self, row: &[u8]) -> f32 {
        assert!(self.checked, "Q8Quads::dot before prepare");
        assert_eq!(row.len(), self.blocks * 18, "Q8Quads::dot: row length");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `prepare` checked the features; the row holds `blocks` Q4_0 blocks (asserted).
        return unsafe { imp::dot(row.as_ptr(), self.blocks, &self.quads) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("Q8Quads exists only on x86-64")
    }

    /// Four rows at once (shared activation loads); `out[j]` has the bits of `self.dot(rows[j])`.
    pub fn dot_x4(&self, rows: [&[u8]; 4]) -> [f32; 4] {
        assert!(self.checked, "Q8Quads::dot_x4 before prepare");
        assert!(rows.iter().all(|r| r.len() == self.blocks * 18), "Q8Quads::dot_x4: row length");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot`, for each of the four rows.
        return unsafe {
            imp::dot_x4(
                [rows[0].as_ptr(), rows[1].as_ptr(), rows[2].as_ptr(), rows[3].as_ptr()],
                self.blocks,
                &self.quads,
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("Q8Quads exists only on x86-64")
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::{BlockQ8, Quad};
    use std::arch::x86_64::*;

    /// Bytes of a group: four Q4_0 blocks.
    const GROUP: usize = 72;

    /// How far ahead (bytes) each row is prefetched (as the AVX2 kernels do).
    const PREFETCH: usize = 512;

    /// `vpermi2b` indices: the 16 quant bytes of block `b` (bytes `18b + 2 .. 18b + 18` of the group; bit 6
    /// picks the second source, which holds the group's bytes 64..72).
    const IDX_QS: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let src = 18 * (i / 16) + 2 + i % 16;
            t[i] = if src < 64 { src as u8 } else { (src - 64) as u8 | 64 };
            i += 1;
        }
        t
    };

    /// `vpermb` indices: f16 lane `l` (bytes 2l, 2l+1) takes block `l / 4`'s scale (bytes `18b`, `18b + 1`).
    const IDX_D: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 32 {
            t[i] = (18 * (i / 8) + i % 2) as u8;
            i += 1;
        }
        t
    };

    /// SAFETY (callers): AVX-512 F/BW/VNNI/VBMI present; `out.len() == x.len().div_ceil(4)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn prepare(x: &[BlockQ8], out: &mut [Quad]) {
        let eight = _mm512_set1_epi8(8);
        for (g, q) in out.iter_mut().enumerate() {
            let b0 = 4 * g;
            let n = (x.len() - b0).min(4);
            let mut v = [_mm256_setzero_si256(); 4];
            let mut d = [0f32; 4];
            for k in 0..n {
                v[k] = _mm256_loadu_si256(x[b0 + k].qs.as_ptr() as *const __m256i);
                d[k] = x[b0 + k].d;
            }
            let z01 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v[0]), v[1]);
            let z23 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v[2]), v[3]);
            // 128-bit lanes (b0 lo, b1 lo, b2 lo, b3 lo) and (b0 hi, b1 hi, b2 hi, b3 hi)
            let lo = _mm512_shuffle_i64x2::<0b10_00_10_00>(z01, z23);
            let hi = _mm512_shuffle_i64x2::<0b11_01_11_01>(z01, z23);
            let s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, lo), eight, hi);
            _mm512_store_si512(q.lo.as_mut_ptr() as *mut __m512i, lo);
            _mm512_store_si512(q.hi.as_mut_ptr() as *mut __m512i, hi);
            _mm512_store_si512(q.neg8.as_mut_ptr() as *mut __m512i, _mm512_sub_epi32(_mm512_setzero_si512(), s));
            for (l, sc) in q.scale.iter_mut().enumerate() {
                *sc = d[l / 4];
            }
        }
    }

    /// One group of `nb` (1..=4) blocks of a row at `p` into the 16 lanes of `acc`. Reads exactly the group's
    /// `18 nb` bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    unsafe fn group(p: *const u8, nb: usize, x: &Quad, idx_qs: __m512i, idx_d: __m512i, acc: __m512) -> __m512 {
        let (z0, z1) = if nb == 4 {
            (
                _mm512_loadu_si512(p as *const __m512i),
                _mm512_castsi128_si512(_mm_loadl_epi64(p.add(64) as *const __m128i)),
            )
        } else {
            // a short last group: bytes past the row are masked off (not read) and come in as zeros
            (_mm512_maskz_loadu_epi8((1u64 << (18 * nb)) - 1, p as *const i8), _mm512_setzero_si512())
        };
        let q = _mm512_permutex2var_epi8(z0, idx_qs, z1);
        let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(idx_d, z0)));
        let m = _mm512_set1_epi8(0x0f);
        let lo = _mm512_and_si512(q, m);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m);
        let i = _mm512_load_si512(x.neg8.as_ptr() as *const __m512i);
        let i = _mm512_dpbusd_epi32(i, lo, _mm512_load_si512(x.lo.as_ptr() as *const __m512i));
        let i = _mm512_dpbusd_epi32(i, hi, _mm512_load_si512(x.hi.as_ptr() as *const __m512i));
        let s = _mm512_mul_ps(dw, _mm512_load_ps(x.scale.as_ptr()));
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), s, acc)
    }

    /// SAFETY (callers): AVX-512 F/BW/VNNI/VBMI present; `row` points at `blocks` Q4_0 blocks; `x` holds
    /// `blocks.div_ceil(4)` groups.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn dot(row: *const u8, blocks: usize, x: &[Quad]) -> f32 {
        let idx_qs = _mm512_loadu_si512(IDX_QS.as_ptr() as *const __m512i);
        let idx_d = _mm512_loadu_si512(IDX_D.as_ptr() as *const __m512i);
        let mut acc = _mm512_setzero_ps();
        for (g, xg) in x.iter().enumerate() {
            let nb = (blocks - 4 * g).min(4);
            acc = group(row.add(g * GROUP), nb, xg, idx_qs, idx_d, acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    /// Four rows; each row's operations exactly as in [`dot`].
    /// SAFETY (callers): as [`dot`], for each row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn dot_x4(rows: [*const u8; 4], blocks: usize, x: &[Quad]) -> [f32; 4] {
        let idx_qs = _mm512_loadu_si512(IDX_QS.as_ptr() as *const __m512i);
        let idx_d = _mm512_loadu_si512(IDX_D.as_ptr() as *const __m512i);
        let mut acc = [_mm512_setzero_ps(); 4];
        for (g, xg) in x.iter().enumerate() {
            let nb = (blocks - 4 * g).min(4);
            let off = g * GROUP;
            for &r in &rows {
                // a hint: never faults, so the address may lie past the row
                _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(off + PREFETCH) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(off + PREFETCH + GROUP - 1) as *const i8);
            }
            for j in 0..4 {
                acc[j] = group(rows[j].add(off), nb, xg, idx_qs, idx_d, acc[j]);
            }
        }
        [
            _mm512_reduce_add_ps(acc[0]),
            _mm512_reduce_add_ps(acc[1]),
            _mm512_reduce_add_ps(acc[2]),
            _mm512_reduce_add_ps(acc[3]),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dot_q8_scalar, quantize_q8, GgmlType};

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    /// A Q4_0 row of `nb` blocks: random nibbles, scales of both signs (and one zero) of varied size.
    fn row(nb: usize, seed: &mut u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(nb * 18);
        for b in 0..nb {
            let d = if b % 7 == 3 { 0.0 } else { (lcg(seed) % 2000) as f32 / 1000.0 - 1.0 };
            v.extend_from_slice(&half::f16::from_f32(d * 0.02).to_bits().to_le_bytes());
            for _ in 0..16 {
                v.push(lcg(seed) as u8);
            }
        }
        v
    }

    fn act(nb: usize, seed: &mut u64) -> Vec<BlockQ8> {
        let x: Vec<f32> = (0..nb * 32).map(|_| (lcg(seed) % 20001) as f32 / 1000.0 - 10.0).collect();
        let mut q = vec![BlockQ8::default(); nb];
        quantize_q8(&x, &mut q);
        q
    }

    /// Exact value of the integers the kernel must reproduce: Σ_b d_w d_x Σ (nibble − 8) q, in f64.
    fn exact(row: &[u8], x: &[BlockQ8]) -> f64 {
        row.chunks_exact(18)
            .zip(x)
            .map(|(b, xb)| {
                let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() as f64;
                let s: i32 = (0..16)
                    .map(|j| {
                        ((b[2 + j] & 15) as i32 - 8) * xb.qs[j] as i32
                            + ((b[2 + j] >> 4) as i32 - 8) * xb.qs[16 + j] as i32
                    })
                    .sum();
                d * xb.d as f64 * s as f64
            })
            .sum()
    }

    #[test]
    fn wide_q4_0_matches_the_reference_for_every_group_tail() {
        if !supported() {
            eprintln!("no AVX-512 VNNI/VBMI here: skipped");
            return;
        }
        let mut seed = 17u64;
        let mut q = Q8Quads::default();
        // 1..=3 blocks (a short group only), whole groups, whole groups plus 1, 2 and 3 blocks, Qwen3's 24 and 64
        for nb in [1usize, 2, 3, 4, 5, 6, 7, 8, 18, 24, 64, 129] {
            let x = act(nb, &mut seed);
            q.prepare(&x);
            assert_eq!(q.blocks(), nb);
            let rows: Vec<Vec<u8>> = (0..4).map(|_| row(nb, &mut seed)).collect();
            let v4 = q.dot_x4([&rows[0], &rows[1], &rows[2], &rows[3]]);
            for (r, v) in rows.iter().zip(v4) {
                let one = q.dot(r);
                assert_eq!(one.to_bits(), v.to_bits(), "nb {nb}: x4 {v} vs one {one}");
                let e = exact(r, &x);
                let mag: f64 = r
                    .chunks_exact(18)
                    .zip(&x)
                    .map(|(b, xb)| {
                        let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32().abs() as f64;
                        d * xb.d as f64 * 8.0 * 127.0 * 32.0
                    })
                    .sum();
                assert!((v as f64 - e).abs() <= 1e-6 * mag.max(1e-30), "nb {nb}: {v} vs exact {e} (scale {mag})");
                let s = dot_q8_scalar(GgmlType::Q4_0, r, &x);
                assert!((v as f64 - s as f64).abs() <= 1e-6 * mag.max(1e-30), "nb {nb}: {v} vs scalar {s}");
            }
        }
    }

    #[test]
    fn wide_q4_0_extremes_do_not_saturate() {
        if !supported() {
            return;
        }
        // nibbles 0 and 15 (values −8 and 7) against ±127 in every position: sums far beyond i16
        for (nib, xv) in [(0u8, 127i8), (0, -127), (0xff, 127), (0xff, -127), (0x0f, 127), (0xf0, -127)] {
            let nb = 9;
            let mut r = Vec::new();
            for _ in 0..nb {
                r.extend_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
                r.extend_from_slice(&[nib; 16]);
            }
            let x = vec![BlockQ8 { d: 1.0, s: 0.0, qs: [xv; 32] }; nb];
            let mut q = Q8Quads::default();
            q.prepare(&x);
            let e = exact(&r, &x);
            assert_eq!(q.dot(&r) as f64, e, "nibbles {nib:#x} x {xv}");
            assert_eq!(q.dot_x4([&r, &r, &r, &r]), [e as f32; 4]);
        }
    }

    #[test]
    #[should_panic(expected = "before prepare")]
    fn a_dot_before_prepare_panics_instead_of_running_unchecked_instructions() {
        Q8Quads::default().dot(&[]);
    }
}
