//! AVX-512 (F, BW, VNNI) kernels for the formats of llama.cpp's `Q4_K_M` mix: the one-token, four-token and
//! four-row dot products of Q5_0 and Q8_0 (the fallbacks of rows whose width is not a multiple of 256), and the
//! super-block unpackers of Q4_K, Q5_K and Q6_K that the prefill GEMM ([`super::gemm512`]) runs on.
//!
//! Q5_0 and Q8_0 (one f16 scale per 32 values): two blocks per 512-bit step; `vpdpbusd` multiplies the activations
//! moved to unsigned (`x + 128`, laid out once per token by [`X512::prepare`]) with the signed codes, starting from
//! `−128 · Σw` (computed once per row step for all tokens); the block scales are gathered 16 at a time. Each block's
//! 8 lanes of four-product sums are then added into 8 accumulators by one `fma` with `d_w · d_x`, blocks in row
//! order, and summed as the AVX2 lane sum sums them: the AVX2 kernels' (and ggml's `ggml_vec_dot_q8_0_q8_0`) order,
//! so every entry point gives their bits exactly.
//!
//! The K-quants' one-token products stay on the AVX2 kernels (`quant::dot_k`): an AVX-512 version over activations
//! laid out per task (stop 24) was faster on a 2-core VM's large tasks but slower in the GPU host's hybrid path,
//! whose many small tasks paid the layout more often than they gained from it; one over the plain Q8_K blocks (stop
//! 44: two groups per `vpdpbusd`, the AVX2 kernels' integer lanes) ran no faster than them on a Zen 4.

use super::BlockQ8;

/// One token's 8-bit activations laid out for the AVX-512 kernels (`n` blocks of 32, rounded up to an even count
/// with zero blocks).
#[derive(Debug, Default, Clone)]
pub struct X512 {
    /// Blocks of 32 (before padding).
    n: usize,
    /// The codes plus 128 as unsigned bytes (`vpdpbusd`'s unsigned operand); padding 128.
    xu: Vec<u8>,
    /// Each block's scale `d` eight times (one 256-bit half of a lane vector per block); padding 0.
    dpair: Vec<f32>,
}

impl X512 {
    /// Lays out `x` (any number of blocks).
    pub fn prepare(&mut self, x: &[BlockQ8]) {
        let n = x.len();
        let np = n.div_ceil(2) * 2;
        self.n = n;
        self.xu.resize(np * 32, 0x80);
        self.dpair.resize(np * 8, 0.0);
        for ((b, xu), dp) in x.iter().zip(self.xu.chunks_exact_mut(32)).zip(self.dpair.chunks_exact_mut(8)) {
            for (u, &q) in xu.iter_mut().zip(&b.qs) {
                *u = (q as u8) ^ 0x80;
            }
            dp.fill(b.d);
        }
        self.xu[n * 32..].fill(0x80);
        self.dpair[n * 8..].fill(0.0);
    }

    /// Blocks of 32.
    pub fn blocks(&self) -> usize {
        self.n
    }
}

/// A format's AVX-512 kernels (`one` and `four` give each token the same bits).
#[derive(Debug, Clone, Copy)]
pub struct Dot512 {
    /// One row (`x.blocks() · 32` values) times one token. SAFETY (callers): [`supported`] is true; `row` holds
    /// `x.blocks()` blocks of 32 of the format.
    #[cfg(target_arch = "x86_64")]
    pub one: unsafe fn(&[u8], &X512) -> f32,
    /// One row times four tokens (same contract for each; all as long as `x[0]`).
    #[cfg(target_arch = "x86_64")]
    pub four: unsafe fn(&[u8], [&X512; 4]) -> [f32; 4],
    /// Four rows times one token, each row [`Dot512::one`]'s bits (decode: four independent chains). Same contract
    /// as `one` for each row.
    #[cfg(target_arch = "x86_64")]
    pub rows4: unsafe fn([&[u8]; 4], &X512) -> [f32; 4],
}

/// Whether this CPU runs the kernels: AVX-512 F, BW and VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later). The
/// dispatch ([`crate::quant::k512`], [`crate::quant::gemm512_of`]) also needs [`crate::quant::SimdLevel::Avx512`],
/// which adds VBMI (the Q4_0/Q4_1 kernel's): Cascade Lake, with VNNI but no VBMI, stays on AVX2.
#[cfg(target_arch = "x86_64")]
pub fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// Whether this CPU runs the kernels (never off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! The kernels (see the module above).
    use std::arch::x86_64::*;

    use super::{Dot512, X512};
    use crate::quant::format::kquant::scale_min_k4;
    use crate::quant::gemm512::{Gemm512, Unpack};

    /// The little-endian f16 at `p` as f32. SAFETY (callers): `p` readable for 2 bytes; AVX-512 F (so F16C).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn h2f(p: *const u8) -> f32 {
        crate::quant::dot::avx2::h2f(p)
    }

    /// The upper 256 bits of a float vector (AVX-512 F only: `_mm512_extractf32x8_ps` needs DQ, which these
    /// functions do not enable, and would not inline).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn upper(v: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
    }

    /// Two 256-bit halves as one vector.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }

    /// `R` rows of 32-value blocks times `N` tokens. SAFETY (callers): AVX-512 F/BW/VNNI present; every row holds
    /// `x[0].blocks()` blocks of `bytes` bytes, every token as many; `codes(p, two)` reads only the block at `p`
    /// (and the next one when `two`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn blocks32_n<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        x: [&X512; N],
        bytes: usize,
        codes: impl Fn(*const u8, bool) -> __m512i,
    ) -> [[f32; N]; R] {
        let n = x[0].n;
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let k80 = _mm512_set1_epi8(-128);
        // the scales of 16 blocks at a time: one gather of each block's first 4 bytes (its f16 `d` and 2 more of the
        // block), then lanes [d_i × 8 | d_i+1 × 8] for each pair by one permute
        let offsets = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(bytes as i32),
        );
        let pair_idx = join(_mm256_set1_epi32(0), _mm256_set1_epi32(1));
        let mut dw = [_mm512_setzero_ps(); R];
        let mut i = 0;
        while i < n {
            let two = i + 1 < n;
            let mut q = [_mm512_setzero_si512(); R];
            let mut neg = [_mm512_setzero_si512(); R];
            let mut w2 = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let b0 = rows[r].as_ptr().add(bytes * i);
                crate::quant::prefetch::ahead_span(b0, 0, 2 * bytes);
                if i % 16 == 0 {
                    let live = (n - i).min(16);
                    let mask = if live == 16 { 0xffff } else { (1u16 << live) - 1 };
                    let g = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, offsets, b0 as *const i32);
                    dw[r] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
                }
                q[r] = codes(b0, two);
                // −128 · Σw per four-byte lane: the offset of the activations moved to unsigned
                neg[r] =
                    _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k80, q[r]));
                w2[r] = _mm512_permutexvar_ps(_mm512_add_epi32(pair_idx, _mm512_set1_epi32((i % 16) as i32)), dw[r]);
            }
            let pi = i / 2;
            for (t, xt) in x.iter().enumerate() {
                let xu = _mm512_loadu_si512(xt.xu.as_ptr().add(64 * pi) as *const __m512i);
                let dx = _mm512_loadu_ps(xt.dpair.as_ptr().add(16 * pi));
                for r in 0..R {
                    let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(neg[r], xu, q[r]));
                    let sc = _mm512_mul_ps(w2[r], dx);
                    let a = &mut acc[r][t];
                    *a = _mm256_fmadd_ps(_mm512_castps512_ps256(sc), _mm512_castps512_ps256(s), *a);
                    if two {
                        *a = _mm256_fmadd_ps(upper(sc), upper(s), *a);
                    }
                }
            }
            i += 2;
        }
        let mut out = [[0f32; N]; R];
        for (o, a) in out.iter_mut().zip(acc) {
            for (o, a) in o.iter_mut().zip(a) {
                *o = crate::quant::dot::avx2::hsum(a);
            }
        }
        out
    }

    /// Two Q5_0 blocks' 64 signed codes (`code − 16`; the second block zero when absent). Q5_0: 22-byte blocks,
    /// f16 `d`, 4 bytes of fifth bits, 16 bytes of nibbles; value `d · (code − 16)`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q5_0_pair(b: *const u8, two: bool) -> __m512i {
        let m4 = _mm512_set1_epi8(0x0f);
        let sixteen = _mm512_set1_epi8(16);
        // lanes of 128 bits: block 0's nibbles, the same shifted by 4, block 1's, shifted
        let shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
        let qh = |c: *const u8| u32::from_le_bytes([*c.add(2), *c.add(3), *c.add(4), *c.add(5)]) as u64;
        let q0 = _mm_loadu_si128(b.add(6) as *const __m128i);
        let (q1, h1) =
            if two { (_mm_loadu_si128(b.add(28) as *const __m128i), qh(b.add(22))) } else { (_mm_setzero_si128(), 0) };
        let z = join(_mm256_broadcastsi128_si256(q0), _mm256_broadcastsi128_si256(q1));
        let nib = _mm512_and_si512(_mm512_srlv_epi64(z, shift), m4);
        // byte k is value k % 32 of block k / 32, whose fifth bit is bit k of (h0 | h1 << 32): subtract 16 where it
        // is clear (and nowhere in an absent second block)
        let live = if two { u64::MAX } else { 0xffff_ffff };
        _mm512_mask_sub_epi8(nib, !(qh(b) | h1 << 32) & live, nib, sixteen)
    }

    /// Two Q8_0 blocks' 64 signed codes (34-byte blocks: f16 `d`, 32 codes; the second zero when absent).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q8_0_pair(b: *const u8, two: bool) -> __m512i {
        let w0 = _mm256_loadu_si256(b.add(2) as *const __m256i);
        let w1 = if two { _mm256_loadu_si256(b.add(36) as *const __m256i) } else { _mm256_setzero_si256() };
        join(w0, w1)
    }

    /// `R` Q5_0 rows times `N` tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q5_0_rn<const R: usize, const N: usize>(rows: [&[u8]; R], x: [&X512; N]) -> [[f32; N]; R] {
        blocks32_n(rows, x, 22, |b, two| q5_0_pair(b, two))
    }

    /// `R` Q8_0 rows times `N` tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q8_0_rn<const R: usize, const N: usize>(rows: [&[u8]; R], x: [&X512; N]) -> [[f32; N]; R] {
        blocks32_n(rows, x, 34, |b, two| q8_0_pair(b, two))
    }

    /// One Q5_0 row times `N` tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q5_0_n<const N: usize>(row: &[u8], x: [&X512; N]) -> [f32; N] {
        q5_0_rn::<1, N>([row], x)[0]
    }

    /// One Q8_0 row times `N` tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q8_0_n<const N: usize>(row: &[u8], x: [&X512; N]) -> [f32; N] {
        q8_0_rn::<1, N>([row], x)[0]
    }

    /// Four Q5_0 rows times one token (each row the one-token kernel's bits; four independent accumulation chains).
    ///
    /// # Safety
    /// As [`Dot512::one`], for each row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dot_q5_0_x4(rows: [&[u8]; 4], x: &X512) -> [f32; 4] {
        q5_0_rn::<4, 1>(rows, [x]).map(|v| v[0])
    }

    /// Four Q8_0 rows times one token (as [`dot_q5_0_x4`]).
    ///
    /// # Safety
    /// As [`Dot512::one`], for each row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dot_q8_0_x4(rows: [&[u8]; 4], x: &X512) -> [f32; 4] {
        q8_0_rn::<4, 1>(rows, [x]).map(|v| v[0])
    }

    /// A Q4_K / Q5_K super-block unpacked: the unsigned codes of values `64c .. 64c + 64` in `q[c]`, the 8
    /// sub-blocks' 6-bit scales and minimums, the super-scales.
    struct KSuper {
        q: [__m512i; 4],
        sc: [u8; 8],
        mn: [u8; 8],
        d: f32,
        dmin: f32,
    }

    /// Unpacks a Q4_K (or, with `FIFTH`, Q5_K) super-block: 6-bit scales and minimums per 32 ([`scale_min_k4`]);
    /// 4-bit codes of sub-blocks 2c (low nibbles) and 2c + 1 (high) in bytes `32c ..`, Q5_K's fifth bits in 32 bytes
    /// before them. SAFETY (callers): AVX-512 F/BW/VNNI; `blk` is a whole super-block (144 or 176 bytes).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q45_super<const FIFTH: bool>(blk: &[u8]) -> KSuper {
        let qs_at = if FIFTH { 48 } else { 16 };
        debug_assert_eq!(blk.len(), qs_at + 128);
        let m4 = _mm512_set1_epi8(0x0f);
        let sixteen = _mm512_set1_epi8(16);
        let p = blk.as_ptr();
        let mut k = KSuper { q: [_mm512_setzero_si512(); 4], sc: [0; 8], mn: [0; 8], d: h2f(p), dmin: h2f(p.add(2)) };
        for j in 0..8 {
            (k.sc[j], k.mn[j]) = scale_min_k4(j, &blk[4..16]);
        }
        let qh = if FIFTH { _mm256_loadu_si256(p.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
        let qh = join(qh, qh);
        for c in 0..4 {
            let v = _mm256_loadu_si256(p.add(qs_at + 32 * c) as *const __m256i);
            let mut w = _mm512_and_si512(join(v, _mm256_srli_epi16(v, 4)), m4);
            if FIFTH {
                let sel = join(_mm256_set1_epi8(1 << (2 * c)), _mm256_set1_epi8(1 << (2 * c + 1)));
                w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh, sel), w, sixteen);
            }
            k.q[c] = w;
        }
        k
    }

    /// Unpacks a Q6_K super-block (210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales per
    /// 16, f16 `d`; value `d · sc · (code − 32)`): the unsigned codes of values `64c .. 64c + 64` in `q[c]`, and
    /// `d`. SAFETY (callers): AVX-512 F/BW/VNNI; `blk` holds 210 bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q6_super(blk: &[u8]) -> ([__m512i; 4], f32) {
        debug_assert_eq!(blk.len(), 210);
        let m4 = _mm512_set1_epi8(0x0f);
        let three = _mm512_set1_epi8(3);
        // the high bit pairs of values 0..32 and 32..64 of a half (bits 0-1, 2-3), then of 64..96 and 96..128
        let shift_a = join(_mm256_set1_epi16(0), _mm256_set1_epi16(2));
        let shift_b = join(_mm256_set1_epi16(4), _mm256_set1_epi16(6));
        let p = blk.as_ptr();
        let mut q = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let ql = _mm512_loadu_si512(p.add(64 * h) as *const __m512i);
            let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
            let qh = join(qh, qh);
            let lo = _mm512_and_si512(ql, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
            for (s, (nib, sh)) in [(lo, shift_a), (hi, shift_b)].into_iter().enumerate() {
                let hb = _mm512_and_si512(_mm512_srlv_epi16(qh, sh), three);
                q[2 * h + s] = _mm512_or_si512(nib, _mm512_slli_epi16(hb, 4));
            }
        }
        (q, h2f(p.add(208)))
    }

    /// Unpacks a row of 32-value blocks (`bytes` each, f16 `d` first) for the GEMM ([`crate::quant::gemm512`]):
    /// the codes of each pair of blocks from `pair`, each block's `d`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn unpack_blocks32(
        row: &[u8],
        codes: &mut [i8],
        d: &mut [f32],
        bytes: usize,
        pair: impl Fn(*const u8, bool) -> __m512i,
    ) {
        let n = codes.len() / 32;
        assert!(row.len() == n * bytes && d.len() == n, "unpack: lengths");
        let p = row.as_ptr();
        let c = codes.as_mut_ptr();
        let mut i = 0;
        while i < n {
            let two = i + 1 < n;
            let q = pair(p.add(bytes * i), two);
            if two {
                _mm512_storeu_si512(c.add(32 * i) as *mut __m512i, q);
            } else {
                _mm256_storeu_si256(c.add(32 * i) as *mut __m256i, _mm512_castsi512_si256(q));
            }
            i += 2;
        }
        for (i, d) in d.iter_mut().enumerate() {
            *d = h2f(p.add(bytes * i));
        }
    }

    /// Unpacks a Q5_0 row for the GEMM (signed codes `code − 16`, each block's `d`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn unpack_q5_0(row: &[u8], codes: &mut [i8], d: &mut [f32]) {
        unpack_blocks32(row, codes, d, 22, |b, two| q5_0_pair(b, two))
    }

    /// Unpacks a Q8_0 row for the GEMM (the codes, each block's `d`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn unpack_q8_0(row: &[u8], codes: &mut [i8], d: &mut [f32]) {
        unpack_blocks32(row, codes, d, 34, |b, two| q8_0_pair(b, two))
    }

    /// Unpacks a Q4_K or Q5_K (`FIFTH`) row for the GEMM: codes 0..15 (0..31), per 32 values the 6-bit scale and
    /// minimum, per super-block `d` and `dmin`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn unpack_q45_k<const FIFTH: bool>(
        row: &[u8],
        codes: &mut [i8],
        sc: &mut [i32],
        mn: &mut [i32],
        d: &mut [f32],
        dmin: &mut [f32],
    ) {
        let bytes = if FIFTH { 176 } else { 144 };
        let nsb = codes.len() / 256;
        assert!(
            row.len() == nsb * bytes
                && sc.len() == 8 * nsb
                && mn.len() == 8 * nsb
                && d.len() == nsb
                && dmin.len() == nsb,
            "unpack: lengths"
        );
        for (i, blk) in row.chunks_exact(bytes).enumerate() {
            let k = q45_super::<FIFTH>(blk);
            for (c, q) in k.q.iter().enumerate() {
                _mm512_storeu_si512(codes.as_mut_ptr().add(256 * i + 64 * c) as *mut __m512i, *q);
            }
            for j in 0..8 {
                sc[8 * i + j] = k.sc[j] as i32;
                mn[8 * i + j] = k.mn[j] as i32;
            }
            d[i] = k.d;
            dmin[i] = k.dmin;
        }
    }

    /// Unpacks a Q4_K row for the GEMM (as `unpack_q45_k` describes).
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn unpack_q4_k(row: &[u8], c: &mut [i8], sc: &mut [i32], mn: &mut [i32], d: &mut [f32], dm: &mut [f32]) {
        unpack_q45_k::<false>(row, c, sc, mn, d, dm)
    }

    /// Unpacks a Q5_K row for the GEMM (as `unpack_q45_k` describes).
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn unpack_q5_k(row: &[u8], c: &mut [i8], sc: &mut [i32], mn: &mut [i32], d: &mut [f32], dm: &mut [f32]) {
        unpack_q45_k::<true>(row, c, sc, mn, d, dm)
    }

    /// Unpacks a Q6_K row for the GEMM: signed codes `code − 32`, per 16 values the signed scale, per super-block
    /// `d` (no minimums).
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn unpack_q6_k(
        row: &[u8],
        codes: &mut [i8],
        sc: &mut [i32],
        mn: &mut [i32],
        d: &mut [f32],
        dm: &mut [f32],
    ) {
        let nsb = codes.len() / 256;
        assert!(
            row.len() == nsb * 210 && sc.len() == 16 * nsb && mn.len() == 16 * nsb && d.len() == nsb && dm.len() == nsb,
            "unpack: lengths"
        );
        let k32 = _mm512_set1_epi8(32);
        for (i, blk) in row.chunks_exact(210).enumerate() {
            let (q, dd) = q6_super(blk);
            for (c, q) in q.iter().enumerate() {
                let v = _mm512_sub_epi8(*q, k32);
                _mm512_storeu_si512(codes.as_mut_ptr().add(256 * i + 64 * c) as *mut __m512i, v);
            }
            for g in 0..16 {
                sc[16 * i + g] = blk[192 + g] as i8 as i32;
                mn[16 * i + g] = 0;
            }
            d[i] = dd;
            dm[i] = 0.0;
        }
    }

    /// A format's one-token and four-token entry points over its generic kernel.
    macro_rules! entry {
        ($($one:ident, $four:ident => $n:ident, $what:literal);* $(;)?) => {$(
            #[doc = concat!("One ", $what, " row times one token.\n\n# Safety\nAs [`Dot512::one`].")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
            pub unsafe fn $one(row: &[u8], x: &X512) -> f32 {
                $n::<1>(row, [x])[0]
            }

            #[doc = concat!("One ", $what, " row times four tokens (each the one-token kernel's bits).\n\n# Safety\n",
                "As [`Dot512::four`].")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
            pub unsafe fn $four(row: &[u8], x: [&X512; 4]) -> [f32; 4] {
                $n::<4>(row, x)
            }
        )*};
    }

    entry!(
        dot_q5_0, dot_q5_0_t4 => q5_0_n, "Q5_0";
        dot_q8_0, dot_q8_0_t4 => q8_0_n, "Q8_0";
    );

    /// Q5_0's GEMM unpacking (ggml's 8-lane order).
    pub const Q5_0_GEMM: Gemm512 = Gemm512 { unpack: Unpack::Blocks32(unpack_q5_0), group: 32, min: false };
    /// Q8_0's GEMM unpacking (ggml's 8-lane order).
    pub const Q8_0_GEMM: Gemm512 = Gemm512 { unpack: Unpack::Blocks32(unpack_q8_0), group: 32, min: false };
    /// Q4_K's GEMM unpacking.
    pub const Q4_K_GEMM: Gemm512 = Gemm512 { unpack: Unpack::SuperSimd(unpack_q4_k), group: 32, min: true };
    /// Q5_K's GEMM unpacking.
    pub const Q5_K_GEMM: Gemm512 = Gemm512 { unpack: Unpack::SuperSimd(unpack_q5_k), group: 32, min: true };
    /// Q6_K's GEMM unpacking.
    pub const Q6_K_GEMM: Gemm512 = Gemm512 { unpack: Unpack::SuperSimd(unpack_q6_k), group: 16, min: false };

    /// Q5_0's kernels.
    pub const Q5_0: Dot512 = Dot512 { one: dot_q5_0, four: dot_q5_0_t4, rows4: dot_q5_0_x4 };
    /// Q8_0's kernels.
    pub const Q8_0: Dot512 = Dot512 { one: dot_q8_0, four: dot_q8_0_t4, rows4: dot_q8_0_x4 };
}

#[cfg(test)]
mod tests {
    use super::{supported, X512};
    use crate::quant::dot_k::tests::{exact, row, values};
    use crate::quant::format::lookup;
    use crate::quant::{quantize_q8, BlockQ8, GgmlType};

    const TYPES: [GgmlType; 2] = [GgmlType::Q5_0, GgmlType::Q8_0];

    /// `n` activations ([`values`]) quantized to Q8_0, as the 32-value formats' products quantize them.
    fn acts(n: usize, extreme: bool, seed: &mut u64) -> Vec<BlockQ8> {
        let xs = values(n, extreme, seed);
        let mut x = vec![BlockQ8::default(); n / 32];
        quantize_q8(&xs, &mut x);
        x
    }

    /// Every kernel against the exact product (f64 over the dequantized row and the activations' own values) for
    /// 1, 2, 3 and 5 blocks (odd counts leave half a step for the 32-value formats), random and saturating rows
    /// and activations; the four-token entry gives each token the one-token bits.
    #[test]
    fn kernels_match_the_exact_product_and_four_tokens_give_one_token_bits() {
        if !supported() {
            eprintln!("no AVX-512 F/BW/VNNI here: nothing to check");
            return;
        }
        let mut seed = 0x512u64;
        for ty in TYPES {
            let k = lookup(ty).and_then(|f| f.q8).and_then(|k| k.avx512).expect("AVX-512 kernels");
            for n_blocks in [1usize, 2, 3, 5] {
                for extreme in [false, true] {
                    let n = n_blocks * ty.block_size();
                    let r = row(ty, n_blocks, extreme, &mut seed);
                    let xs: Vec<Vec<BlockQ8>> = (0..4).map(|_| acts(n, extreme, &mut seed)).collect();
                    let mut lay: Vec<X512> = vec![X512::default(); 4];
                    for (l, x) in lay.iter_mut().zip(&xs) {
                        l.prepare(x);
                    }
                    // SAFETY: AVX-512 F/BW/VNNI detected above; the row holds n_blocks blocks of the format for
                    // every token's activations.
                    let four = unsafe { (k.four)(&r, [&lay[0], &lay[1], &lay[2], &lay[3]]) };
                    for t in 0..4 {
                        let (want, mag) = exact(ty, &r, &xs[t]);
                        // SAFETY: as above.
                        let one = unsafe { (k.one)(&r, &lay[t]) };
                        let tol = 2e-6 * mag.max(1e-6);
                        assert!((one as f64 - want).abs() <= tol, "{ty:?} x{n_blocks} {extreme}: {one} vs {want}");
                        assert_eq!(four[t].to_bits(), one.to_bits(), "{ty:?} x{n_blocks} {extreme} token {t}");
                    }
                }
            }
        }
    }

    /// Q5_0 and Q8_0 give the AVX2 kernels' bits (the same float order), random and saturating, odd block counts
    /// (more than 16 blocks: a second gather of scales); the four-row kernel gives each row the one-row bits.
    #[test]
    fn blocks_of_32_give_the_avx2_bits() {
        if !supported() {
            return;
        }
        let mut seed = 0x32u64;
        for ty in [GgmlType::Q5_0, GgmlType::Q8_0] {
            let f = lookup(ty).and_then(|f| f.q8).expect("registered");
            let k = f.avx512.expect("AVX-512 kernels");
            for n_blocks in [1usize, 2, 3, 7, 20, 37] {
                for extreme in [false, true] {
                    let r = row(ty, n_blocks, extreme, &mut seed);
                    let x = acts(n_blocks * 32, extreme, &mut seed);
                    let mut l = X512::default();
                    l.prepare(&x);
                    // SAFETY: AVX-512 F/BW/VNNI (and so AVX2/FMA/F16C) detected; the row holds n_blocks blocks.
                    let (a, b) = unsafe { ((k.one)(&r, &l), (f.avx2)(&r, &x)) };
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} x{n_blocks} {extreme}: {a} vs avx2 {b}");
                    // four rows at once: each row the one-row bits
                    let others: Vec<Vec<u8>> = (0..3).map(|_| row(ty, n_blocks, extreme, &mut seed)).collect();
                    let rows4 = [&r[..], &others[0][..], &others[1][..], &others[2][..]];
                    // SAFETY: as above, for each row.
                    let (four, ones) = unsafe { ((k.rows4)(rows4, &l), rows4.map(|rr| (k.one)(rr, &l))) };
                    assert_eq!(four.map(f32::to_bits), ones.map(f32::to_bits), "{ty:?} x{n_blocks}: rows4");
                }
            }
        }
    }
}
