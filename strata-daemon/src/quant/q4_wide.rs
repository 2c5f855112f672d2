//! Q4_0 and Q4_1 rows against 8-bit activations with AVX-512 (F, BW, VNNI, VBMI): four blocks per 512-bit step.
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
//! Q4_1 (20-byte blocks: scale `d`, minimum `m`, 16 bytes of nibbles) takes a 64-byte and a 16-byte load per
//! four blocks, no offset (its values are `d · nibble + m`), and adds `m_w · s_x` per block (`s_x = d_x · Σq`, the
//! Q8_1 sum [`BlockQ8::s`]) from a second `vpermb` of the four minimums.
//!
//! The integers are exactly ggml's (`ggml_vec_dot_q4_0_q8_0`: Σ (nibble − 8) · q per block, times
//! `d_w · d_x`; `ggml_vec_dot_q4_1_q8_1`: Σ nibble · q times `d_w · d_x`, plus `m_w · s_x`); only the order of the
//! float additions differs from the AVX2 kernels (16 lanes of four-element partial sums, summed by
//! `_mm512_reduce_add_ps`), so results agree with them to rounding, and the one-row and the four-row entry
//! points give the same bits.

use super::{BlockQ8, GgmlType};

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
    /// Lane `4b`: block `b`'s `s = d · Σq` (Q4_1's minimum term); the other lanes 0.
    sum: [f32; 16],
}

impl Default for Quad {
    fn default() -> Self {
        Quad { lo: [0; 64], hi: [0; 64], neg8: [0; 16], scale: [0.0; 16], sum: [0.0; 16] }
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
        // every field of every group is written by imp::prepare: only new groups need a value first
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

    /// Dot product of one Q4_0 or Q4_1 row (`ty`; `self.blocks()` blocks of 18 or 20 bytes) with the prepared
    /// activations. Panics on another format, a row of another length, or before any [`Q8Quads::prepare`].
    pub fn dot(&self, ty: GgmlType, row: &[u8]) -> f32 {
        assert!(self.checked, "Q8Quads::dot before prepare");
        assert_eq!(row.len(), self.blocks * block_bytes(ty), "Q8Quads::dot: row length");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `prepare` checked the features; the row holds `blocks` blocks of `ty` (asserted).
        return unsafe {
            match ty {
                GgmlType::Q4_1 => imp::dot::<true>(row.as_ptr(), self.blocks, &self.quads),
                _ => imp::dot::<false>(row.as_ptr(), self.blocks, &self.quads),
            }
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("Q8Quads exists only on x86-64")
    }

    /// Four rows at once (shared activation loads); `out[j]` has the bits of `self.dot(ty, rows[j])`.
    pub fn dot_x4(&self, ty: GgmlType, rows: [&[u8]; 4]) -> [f32; 4] {
        assert!(self.checked, "Q8Quads::dot_x4 before prepare");
        let bb = block_bytes(ty);
        assert!(rows.iter().all(|r| r.len() == self.blocks * bb), "Q8Quads::dot_x4: row length");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot`, for each of the four rows.
        return unsafe {
            let p = [rows[0].as_ptr(), rows[1].as_ptr(), rows[2].as_ptr(), rows[3].as_ptr()];
            match ty {
                GgmlType::Q4_1 => imp::dot_x4::<true>(p, self.blocks, &self.quads),
                _ => imp::dot_x4::<false>(p, self.blocks, &self.quads),
            }
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("Q8Quads exists only on x86-64")
    }
}

/// Bytes per block of the formats the wide kernel takes. Panics on any other format.
fn block_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 => 18,
        GgmlType::Q4_1 => 20,
        _ => panic!("Q8Quads: {ty:?} rows have no wide kernel (Q4_0 and Q4_1 only)"),
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::{BlockQ8, Quad};
    use std::arch::x86_64::*;

    /// Bytes per block: Q4_1 (`Q41`) 20, Q4_0 18.
    const fn bb(q41: bool) -> usize {
        if q41 {
            20
        } else {
            18
        }
    }

    /// `vpermi2b` indices: the 16 quant bytes of block `b` (bytes `bb·b + off .. bb·b + off + 16` of the group,
    /// `off` = 2 or 4; bit 6 picks the second source, which holds the group's bytes 64..).
    const fn idx_qs(q41: bool) -> [u8; 64] {
        let (bb, off) = if q41 { (20, 4) } else { (18, 2) };
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let src = bb * (i / 16) + off + i % 16;
            t[i] = if src < 64 { src as u8 } else { (src - 64) as u8 | 64 };
            i += 1;
        }
        t
    }

    /// `vpermb` indices: f16 lane `l` (bytes 2l, 2l+1) takes the f16 at byte `at` of block `l / 4`.
    const fn idx_f16(q41: bool, at: usize) -> [u8; 64] {
        let bb = bb(q41);
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 32 {
            t[i] = (bb * (i / 8) + at + i % 2) as u8;
            i += 1;
        }
        t
    }

    const IDX_QS: [[u8; 64]; 2] = [idx_qs(false), idx_qs(true)];
    const IDX_D: [[u8; 64]; 2] = [idx_f16(false, 0), idx_f16(true, 0)];
    const IDX_M: [u8; 64] = idx_f16(true, 2);
    /// The bytes of f16 lanes 0, 4, 8 and 12 (Q4_1's minimum goes to lane `4b` only).
    const M_LANES: u64 = 0x0303_0303;

    /// The permute indices of one format, loaded once per call.
    #[derive(Clone, Copy)]
    struct Idx {
        qs: __m512i,
        d: __m512i,
        m: __m512i,
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    unsafe fn idx<const Q41: bool>() -> Idx {
        let k = Q41 as usize;
        Idx {
            qs: _mm512_loadu_si512(IDX_QS[k].as_ptr() as *const __m512i),
            d: _mm512_loadu_si512(IDX_D[k].as_ptr() as *const __m512i),
            m: _mm512_loadu_si512(IDX_M.as_ptr() as *const __m512i),
        }
    }

    /// SAFETY (callers): AVX-512 F/BW/VNNI/VBMI present; `out.len() == x.len().div_ceil(4)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn prepare(x: &[BlockQ8], out: &mut [Quad]) {
        let eight = _mm512_set1_epi8(8);
        for (g, q) in out.iter_mut().enumerate() {
            let b0 = 4 * g;
            let n = (x.len() - b0).min(4);
            let mut v = [_mm256_setzero_si256(); 4];
            let (mut d, mut sum) = ([0f32; 4], [0f32; 4]);
            for k in 0..n {
                v[k] = _mm256_loadu_si256(x[b0 + k].qs.as_ptr() as *const __m256i);
                d[k] = x[b0 + k].d;
                sum[k] = x[b0 + k].s;
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
            q.sum = [0.0; 16];
            for (k, &sk) in sum.iter().enumerate() {
                q.sum[4 * k] = sk;
            }
        }
    }

    /// One group of `nb` (1..=4) blocks of a row at `p` into the 16 lanes of `acc`. Reads exactly the group's
    /// `bb · nb` bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    unsafe fn group<const Q41: bool>(p: *const u8, nb: usize, x: &Quad, ix: Idx, acc: __m512) -> __m512 {
        let (z0, z1) = if nb == 4 {
            let tail = if Q41 {
                _mm_loadu_si128(p.add(64) as *const __m128i)
            } else {
                _mm_loadl_epi64(p.add(64) as *const __m128i)
            };
            (_mm512_loadu_si512(p as *const __m512i), _mm512_castsi128_si512(tail))
        } else {
            // a short last group (at most 60 bytes): bytes past the row are masked off (not read), come in as 0
            (_mm512_maskz_loadu_epi8((1u64 << (bb(Q41) * nb)) - 1, p as *const i8), _mm512_setzero_si512())
        };
        let q = _mm512_permutex2var_epi8(z0, ix.qs, z1);
        let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(ix.d, z0)));
        let m = _mm512_set1_epi8(0x0f);
        let lo = _mm512_and_si512(q, m);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m);
        let i = if Q41 { _mm512_setzero_si512() } else { _mm512_load_si512(x.neg8.as_ptr() as *const __m512i) };
        let i = _mm512_dpbusd_epi32(i, lo, _mm512_load_si512(x.lo.as_ptr() as *const __m512i));
        let i = _mm512_dpbusd_epi32(i, hi, _mm512_load_si512(x.hi.as_ptr() as *const __m512i));
        let s = _mm512_mul_ps(dw, _mm512_load_ps(x.scale.as_ptr()));
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), s, acc);
        if !Q41 {
            return acc;
        }
        // m_w · s_x in lane 4b (the other lanes' f16 bytes are zeroed: 0 · 0)
        let mw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_permutexvar_epi8(M_LANES, ix.m, z0)));
        _mm512_fmadd_ps(mw, _mm512_load_ps(x.sum.as_ptr()), acc)
    }

    /// SAFETY (callers): AVX-512 F/BW/VNNI/VBMI present; `row` points at `blocks` Q4_1 (`Q41`) or Q4_0 blocks;
    /// `x` holds `blocks.div_ceil(4)` groups.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn dot<const Q41: bool>(row: *const u8, blocks: usize, x: &[Quad]) -> f32 {
        let ix = idx::<Q41>();
        let mut acc = _mm512_setzero_ps();
        for (g, xg) in x.iter().enumerate() {
            let nb = (blocks - 4 * g).min(4);
            acc = group::<Q41>(row.add(g * 4 * bb(Q41)), nb, xg, ix, acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    /// Four rows; each row's operations exactly as in [`dot`].
    /// SAFETY (callers): as [`dot`], for each row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn dot_x4<const Q41: bool>(rows: [*const u8; 4], blocks: usize, x: &[Quad]) -> [f32; 4] {
        let ix = idx::<Q41>();
        let gb = 4 * bb(Q41);
        let mut acc = [_mm512_setzero_ps(); 4];
        for (g, xg) in x.iter().enumerate() {
            let nb = (blocks - 4 * g).min(4);
            let off = g * gb;
            for &r in &rows {
                // the group's bytes may straddle two lines
                crate::quant::prefetch::ahead(r, off);
                crate::quant::prefetch::ahead(r, off + gb - 1);
            }
            for j in 0..4 {
                acc[j] = group::<Q41>(rows[j].add(off), nb, xg, ix, acc[j]);
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
    use crate::quant::{dot_q8_scalar, quantize_q8};

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    fn f16(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    fn rd(b: &[u8], at: usize) -> f64 {
        half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32() as f64
    }

    /// A row of `nb` blocks of `ty`: random nibbles, scales (and Q4_1 minimums) of both signs, one zero scale.
    fn row(ty: GgmlType, nb: usize, seed: &mut u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(nb * block_bytes(ty));
        for b in 0..nb {
            let d = if b % 7 == 3 { 0.0 } else { (lcg(seed) % 2000) as f32 / 1000.0 - 1.0 };
            v.extend_from_slice(&f16(d * 0.02));
            if ty == GgmlType::Q4_1 {
                v.extend_from_slice(&f16(((lcg(seed) % 2000) as f32 / 1000.0 - 1.0) * 0.1));
            }
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

    /// Exact value (f64) of what the kernel must compute, and a bound on the size of its terms: per block
    /// Q4_0 `d_w d_x Σ (nibble − 8) q`, Q4_1 `d_w d_x Σ nibble · q + m_w s_x` (ggml's formulas).
    fn exact(ty: GgmlType, row: &[u8], x: &[BlockQ8]) -> (f64, f64) {
        let (bb, off, bias) = if ty == GgmlType::Q4_1 { (20, 4, 0) } else { (18, 2, 8) };
        let (mut sum, mut mag) = (0f64, 0f64);
        for (b, xb) in row.chunks_exact(bb).zip(x) {
            let d = rd(b, 0);
            let s: i32 = (0..16)
                .map(|j| {
                    ((b[off + j] & 15) as i32 - bias) * xb.qs[j] as i32
                        + ((b[off + j] >> 4) as i32 - bias) * xb.qs[16 + j] as i32
                })
                .sum();
            sum += d * xb.d as f64 * s as f64;
            mag += (d * xb.d as f64).abs() * 15.0 * 127.0 * 32.0;
            if ty == GgmlType::Q4_1 {
                sum += rd(b, 2) * xb.s as f64;
                mag += (rd(b, 2) * xb.s as f64).abs();
            }
        }
        (sum, mag)
    }

    #[test]
    fn wide_kernels_match_the_reference_for_every_group_tail() {
        if !supported() {
            eprintln!("no AVX-512 VNNI/VBMI here: skipped");
            return;
        }
        let mut seed = 17u64;
        let mut q = Q8Quads::default();
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1] {
            // 1..=3 blocks (a short group only), whole groups, whole groups plus 1, 2 and 3 blocks, Qwen3's 24
            // and 64, SmolLM2's 18 (576 wide) and 48 (1536)
            for nb in [1usize, 2, 3, 4, 5, 6, 7, 8, 18, 24, 48, 64, 129] {
                let x = act(nb, &mut seed);
                q.prepare(&x);
                assert_eq!(q.blocks(), nb);
                let rows: Vec<Vec<u8>> = (0..4).map(|_| row(ty, nb, &mut seed)).collect();
                let v4 = q.dot_x4(ty, [&rows[0], &rows[1], &rows[2], &rows[3]]);
                for (r, v) in rows.iter().zip(v4) {
                    let one = q.dot(ty, r);
                    assert_eq!(one.to_bits(), v.to_bits(), "{ty:?} nb {nb}: x4 {v} vs one {one}");
                    let (e, mag) = exact(ty, r, &x);
                    let tol = 1e-6 * mag.max(1e-30);
                    assert!((v as f64 - e).abs() <= tol, "{ty:?} nb {nb}: {v} vs exact {e} (scale {mag})");
                    let s = dot_q8_scalar(ty, r, &x);
                    assert!((v as f64 - s as f64).abs() <= tol, "{ty:?} nb {nb}: {v} vs scalar {s}");
                }
            }
        }
    }

    #[test]
    fn wide_kernels_extremes_do_not_saturate() {
        if !supported() {
            return;
        }
        // nibbles 0 and 15 against ±127 in every position: sums far beyond i16
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1] {
            for (nib, xv) in [(0u8, 127i8), (0, -127), (0xff, 127), (0xff, -127), (0x0f, 127), (0xf0, -127)] {
                let nb = 9;
                let mut r = Vec::new();
                for _ in 0..nb {
                    r.extend_from_slice(&f16(1.0));
                    if ty == GgmlType::Q4_1 {
                        r.extend_from_slice(&f16(-2.0));
                    }
                    r.extend_from_slice(&[nib; 16]);
                }
                let x = vec![BlockQ8 { d: 1.0, s: 32.0 * xv as f32, qs: [xv; 32] }; nb];
                let mut q = Q8Quads::default();
                q.prepare(&x);
                let e = exact(ty, &r, &x).0;
                assert_eq!(q.dot(ty, &r) as f64, e, "{ty:?} nibbles {nib:#x} x {xv}");
                assert_eq!(q.dot_x4(ty, [&r, &r, &r, &r]), [e as f32; 4]);
            }
        }
    }

    #[test]
    #[should_panic(expected = "before prepare")]
    fn a_dot_before_prepare_panics_instead_of_running_unchecked_instructions() {
        Q8Quads::default().dot(GgmlType::Q4_0, &[]);
    }
}
