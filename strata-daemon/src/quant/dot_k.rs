//! AVX2 dot kernels of the formats added after the first six (Q5_0, Q5_1, the K-quants, IQ4_NL, IQ4_XS, MXFP4 and
//! the lattice IQ formats, [`super::format`]) with 8-bit activations ([`BlockQ8`], blocks of 32). Each format
//! unpacks its codes with SIMD shifts and masks into 32 bytes per activation block and multiplies them with
//! `maddubs`. The 32-value formats (Q5_0, Q5_1, IQ4_NL, MXFP4) apply their float block scale per block. The
//! super-block formats (the K-quants, IQ4_XS and the lattice IQ formats) pair with Q8_K activations, one scale per
//! 256 values, as ggml's `ggml_vec_dot_*_q8_K`: they apply their per-16 or per-32 integer scales with one `madd`,
//! their products stay exact integers over a whole super-block (8 i32 lanes of scale · code · x, and for Q2_K the
//! minimums times the activations' block sums) and become floats once per super-block (`finish`). Q4_K and Q5_K
//! sum a super-block to one exact integer per row (and its minimum term to another, a `madd` of the 8 minimums
//! with the activations' block sums), then take two fused float steps, four rows in one vector; they read four
//! rows at once with the activations loaded and summed once for them (the scales of a row unpacked in one SSE
//! step); the other four-row
//! variants are four single-row calls. The lattice IQ kernels (but IQ2_S's AVX-512 one, through its decoder) read each
//! sub-block's bytes directly: grid rows loaded by index (straight into the vector but in IQ2_S's kernels), signs as ±1
//! rows or bit masks on the activations, the scales broadcast (their vector pipes are the bound; the index arithmetic
//! runs in integer registers beside them). IQ2_XS and IQ2_S run an AVX-512 VNNI version where the CPU has it (two
//! sub-blocks per `vpdpbusd`, the signs as a mask; the same integer lanes, so the same bits). The four-token ones
//! (`*_t4`: Q5_0 and the Q4_K_M family's K-quants) unpack a row's codes once for four tokens' activations, and
//! `dot_q5_0_t8` once for eight. Every
//! variant gives the single-row kernel's bits per (row, token): the integer lanes are exact whatever the order they
//! were summed in, and the float steps are the same.
//!
//! The super-block kernels' results are right only for Q8_K activations (each super-block's 8 blocks sharing one
//! scale); `crate::quant::dot_q8` and the other dispatchers check that and send other activations to the scalar
//! reference. It is a condition of their results, not of memory safety.

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    use crate::quant::dot::avx2::{h2f, hsum, nibbles};
    use crate::quant::BlockQ8;

    /// The activation block's 32 codes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_x(xb: &BlockQ8) -> __m256i {
        _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i)
    }

    /// 16 pair sums `w[2k] x[2k] + w[2k+1] x[2k+1]` of signed bytes `w` (|w| ≤ 127) and `x`, as i16.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pairs_signed(w: __m256i, x: __m256i) -> __m256i {
        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
    }

    /// 32 bytes, byte i = 0xff when bit i of `bits` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bit_bytes(bits: u32) -> __m256i {
        let v = _mm256_set1_epi32(bits as i32);
        // byte i takes byte i / 8 of `bits` (each 128-bit lane holds all four), then tests bit i % 8
        let spread = _mm256_shuffle_epi8(
            v,
            _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
        );
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel)
    }

    /// 32 bytes, byte i = 0x10 when bit i of `bits` is set, else 0 (the fifth bit of Q5 codes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fifth_bits(bits: u32) -> __m256i {
        _mm256_and_si256(bit_bytes(bits), _mm256_set1_epi8(0x10))
    }

    /// The 32 signed codes of a lattice sub-block ([`crate::quant::format::iq::Sub::codes`]): the grid rows, negated
    /// where a sign bit is set, plus each 8 values' offset.
    #[cfg(test)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lattice_codes(s: &crate::quant::format::iq::Sub) -> __m256i {
        let g = _mm256_set_epi64x(s.grid[3] as i64, s.grid[2] as i64, s.grid[1] as i64, s.grid[0] as i64);
        let q = _mm256_sign_epi8(g, _mm256_or_si256(bit_bytes(s.signs), _mm256_set1_epi8(1)));
        let spread = |d: i8| (d as u8 as u64).wrapping_mul(0x0101_0101_0101_0101) as i64;
        let delta = _mm256_set_epi64x(spread(s.delta[3]), spread(s.delta[2]), spread(s.delta[1]), spread(s.delta[0]));
        _mm256_add_epi8(q, delta)
    }

    /// Bits `k ..` of every byte of `v` under `mask` (`(v >> k) & mask` per byte, `mask` keeping at most 8 − k bits).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bits_at(v: __m256i, k: i32, mask: __m256i) -> __m256i {
        _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(k)), mask)
    }

    /// The lane sums of `N` accumulators.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum_n<const N: usize>(acc: [__m256; N]) -> [f32; N] {
        let mut out = [0f32; N];
        for (o, a) in out.iter_mut().zip(acc) {
            *o = hsum(a);
        }
        out
    }

    /// A format's one-row kernel and its four-token kernel over the generic `N`-token one.
    macro_rules! one_and_four {
        ($($one:ident, $four:ident => $n:ident, $what:literal);* $(;)?) => {$(
            #[doc = concat!("One ", $what, ". SAFETY (callers): avx2, fma and f16c present; `row` holds the ",
                "blocks of `x`.")]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $one(row: &[u8], x: &[BlockQ8]) -> f32 {
                $n::<1>(row, [x])[0]
            }

            #[doc = concat!("One ", $what, " with four tokens' activations, each result bit for bit the one-row ",
                "kernel's (the row unpacked once). SAFETY (callers): as the one-row kernel, for every `x[t]`.")]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $four(row: &[u8], x: [&[BlockQ8]; 4]) -> [f32; 4] {
                $n::<4>(row, x)
            }
        )*};
    }

    one_and_four!(
        dot_q5_0, dot_q5_0_t4 => q5_0_n, "Q5_0 row (blocks of 22 bytes, one per `x` block)";
        dot_q6_k, dot_q6_k_t4 => q6_k_n, "Q6_K row (super-blocks of 210 bytes, one per 8 `x` blocks)";
    );

    /// One Q5_0 row with eight tokens' activations, each result bit for bit [`dot_q5_0`]'s (the row unpacked once
    /// for the eight: its fifth bits' expansion is the dearest part of a block). SAFETY (callers): as
    /// [`dot_q5_0`], for every `x[t]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_0_t8(row: &[u8], x: [&[BlockQ8]; 8]) -> [f32; 8] {
        q5_0_n::<8>(row, x)
    }

    /// A K-quant's one-row, four-row and four-token kernels: the rows over its `R`-row kernel (activations loaded
    /// once for the four rows), the tokens over its `N`-token one; every entry gives the same bits per (row, token).
    macro_rules! k_rows {
        ($($one:ident, $x4:ident, $t4:ident => $rows:ident::<$($p:literal),*>, $n:ident, $what:literal);* $(;)?) => {$(
            #[doc = concat!("One ", $what, ". SAFETY (callers): avx2, fma and f16c present; `row` holds the ",
                "super-blocks of `x`. Results: Q8_K activations only (the module's note).")]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $one(row: &[u8], x: &[BlockQ8]) -> f32 {
                $rows::<$($p,)* 1>([row], x)[0]
            }

            #[doc = concat!("Four ", $what, "s times one token (each row the one-row kernel's bits). SAFETY ",
                "(callers): as the one-row kernel, for every row.")]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $x4(rows: [&[u8]; 4], x: &[BlockQ8]) -> [f32; 4] {
                $rows::<$($p,)* 4>(rows, x)
            }

            #[doc = concat!("One ", $what, " with four tokens' activations, each result bit for bit the one-row ",
                "kernel's (the row unpacked once). SAFETY (callers): as the one-row kernel, for every `x[t]`.")]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $t4(row: &[u8], x: [&[BlockQ8]; 4]) -> [f32; 4] {
                $n::<4>(row, x)
            }
        )*};
    }

    k_rows!(
        dot_q4_k, dot_q4_k_x4, dot_q4_k_t4 => q45_k_rows::<false>, q4_k_n,
            "Q4_K row (super-blocks of 144 bytes, one per 8 `x` blocks)";
        dot_q5_k, dot_q5_k_x4, dot_q5_k_t4 => q45_k_rows::<true>, q5_k_n,
            "Q5_K row (super-blocks of 176 bytes, one per 8 `x` blocks)";
    );

    /// One Q5_0 row times `N` tokens' activations ([`dot_q5_0`]) (each `x[t]` as long as `x[0]`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_0_n<const N: usize>(row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let ones = _mm256_set1_epi16(1);
        let p = row.as_ptr();
        for i in 0..x[0].len() {
            let b = p.add(i * 22);
            crate::quant::prefetch::ahead(b, 0);
            let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
            let q = _mm256_sub_epi8(_mm256_or_si256(nibbles(b.add(6)), fifth_bits(qh)), _mm256_set1_epi8(16));
            let d = h2f(b);
            for (a, xt) in acc.iter_mut().zip(x) {
                let xb = &xt[i];
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs_signed(q, load_x(xb)), ones));
                *a = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), s, *a);
            }
        }
        hsum_n(acc)
    }

    /// One Q5_1 row. SAFETY (callers): as [`dot_q5_0`], blocks of 24 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_1(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        let ones = _mm256_set1_epi16(1);
        let p = row.as_ptr();
        for (i, xb) in x.iter().enumerate() {
            let b = p.add(i * 24);
            crate::quant::prefetch::ahead(b, 0);
            summs += h2f(b.add(2)) * xb.s;
            let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
            let q = _mm256_or_si256(nibbles(b.add(8)), fifth_bits(qh));
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, load_x(xb)), ones));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b) * xb.d), s, acc);
        }
        hsum(acc) + summs
    }

    /// Ends a super-block of a K-quant or IQ row for one token: `acc += d_x · (d · Σ sumi − dmin · Σ summ)`,
    /// lane-wise (`sumi`: Σ scale · code · x per lane, `summ`: Σ minimum · x; exact integers over the whole
    /// super-block, the activations' one Q8_K scale `d_x` applied once, as ggml's `vec_dot_*_q8_K` do).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish(acc: &mut __m256, sumi: __m256i, summ: Option<__m256i>, d: f32, dmin: f32, dx: f32) {
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), *acc);
        if let Some(m) = summ {
            *acc = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(m), *acc);
        }
    }

    /// Σ scale · code · x of a 32-value group as 8 i32 lanes: unsigned codes `q` (0..=127), the scale of the
    /// first and of the second 16 values in `scv` (i16 lanes, [`scale_pair`] or a broadcast).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prod_u(q: __m256i, xq: __m256i, scv: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), scv)
    }

    /// [`prod_u`] for signed codes (|q| ≤ 127).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prod_s(q: __m256i, xq: __m256i, scv: __m256i) -> __m256i {
        _mm256_madd_epi16(pairs_signed(q, xq), scv)
    }

    /// One Q4_K (or, with `FIFTH`, Q5_K) row times `N` tokens' activations ([`dot_q4_k`], [`dot_q5_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q45_k_n<const FIFTH: bool, const N: usize>(row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        let bytes = if FIFTH { 176 } else { 144 };
        let qs_at = bytes - 128;
        let mut acc = [0f32; N];
        let low = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        for (i, b) in row.chunks_exact(bytes).enumerate() {
            let p = b.as_ptr();
            crate::quant::prefetch::ahead_span(p, 0, bytes);
            let (d, dmin) = (h2f(p), h2f(p.add(2)));
            let sm = scales_mins_k4(p.add(4));
            let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
            let qh = if FIFTH { _mm256_loadu_si256(p.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
            let mut sumi = [_mm256_setzero_si256(); N];
            for c in 0..4 {
                let v = _mm256_loadu_si256(p.add(qs_at + 32 * c) as *const __m256i);
                let mut lo = _mm256_and_si256(v, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if FIFTH {
                    let (h0, h1) = (bits_at(qh, 2 * c as i32, one), bits_at(qh, 2 * c as i32 + 1, one));
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
                }
                let (v0, v1) = (scale_of(sc, 2 * c), scale_of(sc, 2 * c + 1));
                for t in 0..N {
                    let x0 = load_x(&x[t][8 * i + 2 * c]);
                    let x1 = load_x(&x[t][8 * i + 2 * c + 1]);
                    let s = _mm256_add_epi32(prod_u(lo, x0, v0), prod_u(hi, x1, v1));
                    sumi[t] = _mm256_add_epi32(sumi[t], s);
                }
            }
            // the float steps of q45_k_rows per token: the super-block's exact totals, then two fused steps
            for t in 0..N {
                let m = mins_dot(sm, group_sums16(&x[t][8 * i..8 * i + 8]));
                let h = _mm_hadd_epi32(m, m);
                let mtot = _mm_cvtsi128_si32(_mm_hadd_epi32(h, h));
                let dx = x[t][8 * i].d;
                acc[t] = (isum(sumi[t]) as f32).mul_add(d * dx, acc[t]);
                acc[t] = (-(mtot as f32)).mul_add(dmin * dx, acc[t]);
            }
        }
        acc
    }

    /// The 6-bit scales (bytes 0..8) and minimums (bytes 8..16) of a Q4_K / Q5_K super-block, unpacked from its 12
    /// packed bytes at `p` (the layout [`scale_min_k4`](crate::quant::format::kquant::scale_min_k4) reads one pair at a
    /// time) in one vector: with `w0, w1, w2`
    /// the three packed 32-bit words, scales 0..4 are `w0`'s low 6 bits per byte, scales 4..8 `w2`'s low nibbles with
    /// `w0`'s top 2 bits above them, the minimums the same from `w1` and `w2`'s high nibbles. SAFETY (callers): avx2
    /// present; 16 bytes readable at `p` (the 12, then the super-block's next 4, unused).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scales_mins_k4(p: *const u8) -> __m128i {
        let w = _mm_loadu_si128(p as *const __m128i);
        // [w0, w2, w1, w2]: the low parts (w2's high nibbles shifted down in the last lane)
        let low = _mm_srlv_epi32(_mm_shuffle_epi32::<0b10_01_10_00>(w), _mm_setr_epi32(0, 0, 0, 4));
        let low = _mm_and_si128(low, _mm_setr_epi32(0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f));
        // [w0, w0, w1, w1]: the top 2 bits of w0 (w1) above the scales (minimums) 4..8
        let top = _mm_srli_epi32::<6>(_mm_shuffle_epi32::<0b01_01_00_00>(w));
        let top = _mm_slli_epi32::<4>(_mm_and_si128(top, _mm_setr_epi32(0, 0x0303_0303, 0, 0x0303_0303)));
        _mm_or_si128(low, top)
    }

    /// The exact sum of `v`'s 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn isum(v: __m256i) -> i32 {
        let h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let h = _mm_hadd_epi32(h, h);
        _mm_cvtsi128_si32(_mm_hadd_epi32(h, h))
    }

    /// Lane `r` = the exact sum of `v[r]`'s 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn isum4(v: [__m256i; 4]) -> __m128i {
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
    }

    /// A Q4_K / Q5_K super-block's 8 block sums of `x` ([`group_sums`]) as i16 (exact: |Σ| ≤ 32 · 127), for
    /// `_mm_madd_epi16` with the 8 minimums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group_sums16(x: &[BlockQ8]) -> __m128i {
        let s = group_sums(x);
        _mm_packs_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1))
    }

    /// Σ minimum_g · Σ x_g over a super-block's 8 groups as 4 i32 lanes (exact), from [`scales_mins_k4`]'s
    /// vector and [`group_sums16`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mins_dot(sm: __m128i, sums16: __m128i) -> __m128i {
        _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128::<8>(sm)), sums16)
    }

    /// The 8 sums Σ x of a super-block's activation blocks `x` (8 blocks of 32), lane `g` for block `g` (exact
    /// integers: ggml's `bsums` per 32).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group_sums(x: &[BlockQ8]) -> __m256i {
        let (one8, one16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
        // 8 lanes per block: sums of 4 values, the first 16 values in the low 128 bits
        let p = |g: usize| _mm256_madd_epi16(_mm256_maddubs_epi16(one8, load_x(&x[g])), one16);
        // two rounds of pairwise sums within 128-bit lanes leave, for blocks a..a+4, their first halves' sums in
        // the low lane and their second halves' in the high one
        let four = |a: usize| {
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p(a), p(a + 1)), _mm256_hadd_epi32(p(a + 2), p(a + 3)));
            _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
        };
        _mm256_set_m128i(four(4), four(0))
    }

    /// The madd operand of a 32-value group whose scale is i16 lane `g` (0..8) of `sc` (both 128-bit lanes
    /// holding the 8 scales): that scale in all 16 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_of(sc: __m256i, g: usize) -> __m256i {
        let b = (2 * g as u64) | (2 * g as u64 + 1) << 8;
        let m = (b | b << 16 | b << 32 | b << 48) as i64;
        _mm256_shuffle_epi8(sc, _mm256_set1_epi64x(m))
    }

    /// `R` Q4_K (or, with `FIFTH`, Q5_K) rows times one token's Q8_K activations, each row's result the bits of
    /// [`q45_k_n`] for it (the same exact integer lanes and the same float steps): the activations are loaded and
    /// summed once for the `R` rows, the scales unpacked with [`scales_mins_k4`] and the minimum term taken from
    /// the block sums ([`group_sums16`], [`mins_dot`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q45_k_rows<const FIFTH: bool, const R: usize>(rows: [&[u8]; R], x: &[BlockQ8]) -> [f32; R] {
        const { assert!(R <= 4) };
        let bytes = if FIFTH { 176 } else { 144 };
        let qs_at = bytes - 128;
        // lane r: row r's sum so far
        let mut acc = _mm_setzero_ps();
        let low = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        for (i, xs) in x.chunks_exact(8).enumerate() {
            let sums16 = group_sums16(xs);
            let mut sc = [_mm256_setzero_si256(); R];
            let mut sumi = [_mm256_setzero_si256(); 4];
            let mut mins = [_mm_setzero_si128(); 4];
            // d | dmin of each row (f16 pairs), rows past R zero
            let mut dm = [0i32; 4];
            for r in 0..R {
                let p = rows[r].as_ptr().add(bytes * i);
                crate::quant::prefetch::ahead_span(p, 0, bytes);
                dm[r] = (p as *const i32).read_unaligned();
                let sm = scales_mins_k4(p.add(4));
                sc[r] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
                mins[r] = mins_dot(sm, sums16);
            }
            for c in 0..4 {
                let x0 = load_x(&xs[2 * c]);
                let x1 = load_x(&xs[2 * c + 1]);
                for r in 0..R {
                    let p = rows[r].as_ptr().add(bytes * i);
                    let v = _mm256_loadu_si256(p.add(qs_at + 32 * c) as *const __m256i);
                    let mut lo = _mm256_and_si256(v, low);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if FIFTH {
                        let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(bits_at(qh, 2 * c as i32, one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(bits_at(qh, 2 * c as i32 + 1, one), 4));
                    }
                    let s = _mm256_add_epi32(
                        prod_u(lo, x0, scale_of(sc[r], 2 * c)),
                        prod_u(hi, x1, scale_of(sc[r], 2 * c + 1)),
                    );
                    sumi[r] = _mm256_add_epi32(sumi[r], s);
                }
            }
            // the super-block's exact totals per row, then (d · dx) · Σ - (dmin · dx) · Σmin, fused, per lane
            let tot = isum4(sumi);
            let mtot = _mm_hadd_epi32(_mm_hadd_epi32(mins[0], mins[1]), _mm_hadd_epi32(mins[2], mins[3]));
            let f = _mm256_cvtph_ps(_mm_setr_epi32(dm[0], dm[1], dm[2], dm[3]));
            let f = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
            let dx = _mm_set1_ps(xs[0].d);
            let (dd, dmn) = (_mm_mul_ps(_mm256_castps256_ps128(f), dx), _mm_mul_ps(_mm256_extractf128_ps(f, 1), dx));
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(tot), dd, acc);
            acc = _mm_fnmadd_ps(_mm_cvtepi32_ps(mtot), dmn, acc);
        }
        let mut lanes = [0f32; 4];
        _mm_storeu_ps(lanes.as_mut_ptr(), acc);
        std::array::from_fn(|r| lanes[r])
    }

    /// One Q4_K row times `N` tokens' activations ([`dot_q4_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_n<const N: usize>(row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        q45_k_n::<false, N>(row, x)
    }

    /// One Q5_K row times `N` tokens' activations ([`dot_q5_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_k_n<const N: usize>(row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        q45_k_n::<true, N>(row, x)
    }

    /// The madd operand of 32-value group `g` from a super-block's 16 per-16 scales `sv` (i16 lanes in order):
    /// scale `2g` in the first 128-bit lane, `2g + 1` in the second.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_pair(sv: __m256i, g: usize) -> __m256i {
        // every dword = scales 2g | 2g + 1, then lane 0 repeats the low i16, lane 1 the high one
        let d = _mm256_permutevar8x32_epi32(sv, _mm256_set1_epi32(g as i32));
        _mm256_shuffle_epi8(
            d,
            _mm256_setr_epi64x(
                0x0100_0100_0100_0100,
                0x0100_0100_0100_0100,
                0x0302_0302_0302_0302,
                0x0302_0302_0302_0302,
            ),
        )
    }

    /// One Q6_K row times `N` tokens' activations ([`dot_q6_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k_n<const N: usize>(row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let low = _mm256_set1_epi8(0x0f);
        let three = _mm256_set1_epi8(3);
        for (i, b) in row.chunks_exact(210).enumerate() {
            let p = b.as_ptr();
            crate::quant::prefetch::ahead_span(p, 0, 210);
            let d = h2f(p.add(208));
            // the 16 signed scales as i16
            let sv = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
            let mut sumi = [_mm256_setzero_si256(); N];
            for h in 0..2 {
                let l0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
                let l1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                let nib = [
                    _mm256_and_si256(l0, low),
                    _mm256_and_si256(l1, low),
                    _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                    _mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                ];
                for (s, n) in nib.into_iter().enumerate() {
                    let hb = bits_at(qh, 2 * s as i32, three);
                    let q = _mm256_sub_epi8(_mm256_or_si256(n, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
                    let k = 4 * h + s; // the activation block of these 32 values (scales 2k, 2k + 1)
                    let scv = scale_pair(sv, k);
                    for t in 0..N {
                        sumi[t] = _mm256_add_epi32(sumi[t], prod_s(q, load_x(&x[t][8 * i + k]), scv));
                    }
                }
            }
            for t in 0..N {
                finish(&mut acc[t], sumi[t], None, d, 0.0, x[t][8 * i].d);
            }
        }
        hsum_n(acc)
    }

    /// One Q3_K row (integer sums over each super-block, [`finish`]). SAFETY (callers): as [`dot_q4_k`],
    /// super-blocks of 110 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q3_k(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let (one, three) = (_mm256_set1_epi8(1), _mm256_set1_epi8(3));
        for (b, xs) in row.chunks_exact(110).zip(x.chunks_exact(8)) {
            let p = b.as_ptr();
            crate::quant::prefetch::ahead_span(p, 0, 110);
            let d = h2f(p.add(108));
            let s = &b[96..108];
            let mut sc = [0i16; 16];
            for (i, v) in sc.iter_mut().enumerate() {
                let lo = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
                *v = ((lo | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) as i16) - 32;
            }
            let sv = _mm256_loadu_si256(sc.as_ptr() as *const __m256i);
            let hm = _mm256_loadu_si256(p as *const __m256i);
            let mut sumi = _mm256_setzero_si256();
            for h in 0..2 {
                let v = _mm256_loadu_si256(p.add(32 + 32 * h) as *const __m256i);
                for sh in 0..4 {
                    let q2 = bits_at(v, 2 * sh as i32, three);
                    let bit = bits_at(hm, (4 * h + sh) as i32, one);
                    // q − 4 where the high bit is clear: q2 + 4·bit − 4
                    let q = _mm256_sub_epi8(_mm256_or_si256(q2, _mm256_slli_epi16(bit, 2)), _mm256_set1_epi8(4));
                    let k = 4 * h + sh;
                    sumi = _mm256_add_epi32(sumi, prod_s(q, load_x(&xs[k]), scale_pair(sv, k)));
                }
            }
            finish(&mut acc, sumi, None, d, 0.0, xs[0].d);
        }
        hsum(acc)
    }

    /// One Q2_K row (integer sums over each super-block, [`finish`]). SAFETY (callers): as [`dot_q4_k`],
    /// super-blocks of 84 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q2_k(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let three = _mm256_set1_epi8(3);
        let low = _mm_set1_epi8(0x0f);
        for (b, xs) in row.chunks_exact(84).zip(x.chunks_exact(8)) {
            let p = b.as_ptr();
            crate::quant::prefetch::ahead_span(p, 0, 84);
            let (d, dmin) = (h2f(p.add(80)), h2f(p.add(82)));
            // the 16 scale bytes: per-16 scales in the low nibbles, minimums in the high ones
            let raw = _mm_loadu_si128(p as *const __m128i);
            let sv = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
            let mv = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
            let (mut sumi, mut summ) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for h in 0..2 {
                let v = _mm256_loadu_si256(p.add(16 + 32 * h) as *const __m256i);
                for sh in 0..4 {
                    let q = bits_at(v, 2 * sh as i32, three);
                    let k = 4 * h + sh;
                    let xq = load_x(&xs[k]);
                    sumi = _mm256_add_epi32(sumi, prod_u(q, xq, scale_pair(sv, k)));
                    // Σ m · x: the minimums per 16 against the activations' pair sums
                    let xs2 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), xq);
                    summ = _mm256_add_epi32(summ, _mm256_madd_epi16(xs2, scale_pair(mv, k)));
                }
            }
            finish(&mut acc, sumi, Some(summ), d, dmin, xs[0].d);
        }
        hsum(acc)
    }

    /// 16 bytes of 4-bit indices -> the 32 signed levels of `table` they pick (low nibbles first).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn table_levels(p: *const u8, table: &[i8; 16]) -> __m256i {
        let t = _mm_loadu_si128(table.as_ptr() as *const __m128i);
        _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles(p))
    }

    /// One row of a 32-value table format (IQ4_NL, MXFP4): `bytes` per block, the 16 index bytes at `qs_at`, the
    /// block's scale from `scale(block)`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_table32(
        row: &[u8],
        x: &[BlockQ8],
        bytes: usize,
        qs_at: usize,
        table: &[i8; 16],
        scale: impl Fn(*const u8) -> f32,
    ) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let ones = _mm256_set1_epi16(1);
        let p = row.as_ptr();
        for (i, xb) in x.iter().enumerate() {
            let b = p.add(i * bytes);
            crate::quant::prefetch::ahead(b, 0);
            let q = table_levels(b.add(qs_at), table);
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs_signed(q, load_x(xb)), ones));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(scale(b) * xb.d), s, acc);
        }
        hsum(acc)
    }

    /// One IQ4_NL row. SAFETY (callers): avx2, fma and f16c present; `row` holds `x.len()` blocks of 18 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq4_nl(row: &[u8], x: &[BlockQ8]) -> f32 {
        dot_table32(row, x, 18, 2, &crate::quant::format::iq4_nl::KVALUES, |b| h2f(b))
    }

    /// One MXFP4 row. SAFETY (callers): as [`dot_iq4_nl`], blocks of 17 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_mxfp4(row: &[u8], x: &[BlockQ8]) -> f32 {
        dot_table32(row, x, 17, 1, &crate::quant::format::mxfp4::KVALUES, |b| {
            crate::quant::format::mxfp4::e8m0_half(*b)
        })
    }

    /// One IQ4_XS row (integer sums over each super-block, [`finish`]). SAFETY (callers): as [`dot_q4_k`],
    /// super-blocks of 136 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq4_xs(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::{iq4_nl::KVALUES, iq4_xs::scale};
        let mut acc = _mm256_setzero_ps();
        for (b, xs) in row.chunks_exact(136).zip(x.chunks_exact(8)) {
            crate::quant::prefetch::ahead_span(b.as_ptr(), 0, 136);
            let mut sumi = _mm256_setzero_si256();
            for (i, xb) in xs.iter().enumerate() {
                let q = table_levels(b.as_ptr().add(8 + 16 * i), &KVALUES);
                let scv = _mm256_set1_epi16(scale(b, i));
                sumi = _mm256_add_epi32(sumi, prod_s(q, load_x(xb), scv));
            }
            finish(&mut acc, sumi, None, h2f(b.as_ptr()), 0.0, xs[0].d);
        }
        hsum(acc)
    }

    /// The madd operand of a sub-block's two per-16 scales: `sc[0]` in the first 128-bit lane, `sc[1]` in the
    /// second.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_halves(sc: [i16; 2]) -> __m256i {
        let v = _mm256_set1_epi32((sc[0] as u16 as u32 | (sc[1] as u16 as u32) << 16) as i32);
        _mm256_shuffle_epi8(
            v,
            _mm256_setr_epi64x(
                0x0100_0100_0100_0100,
                0x0100_0100_0100_0100,
                0x0302_0302_0302_0302,
                0x0302_0302_0302_0302,
            ),
        )
    }

    /// Any lattice format's row through its [`Sub`](crate::quant::format::iq::Sub) decoder, codes signed as
    /// [`lattice_codes`] builds them: the integers and float steps of the generic kernel the dedicated ones
    /// replaced, kept as the reference of their bits.
    /// SAFETY (callers): avx2, fma and f16c present; `row` holds `x.len() / 8` whole super-blocks of `l`.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn lattice_reference(l: &crate::quant::format::iq::Lattice, row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, xs) in row.chunks_exact(l.bytes).zip(x.chunks_exact(8)) {
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let s = (l.sub)(b, ib);
                let p = pairs_signed(lattice_codes(&s), load_x(xb));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scale_halves(s.sc)));
            }
            finish(&mut acc, sumi, None, (l.d)(b), 0.0, xs[0].d);
        }
        hsum(acc)
    }

    /// A lattice row over whole super-blocks of `bytes` bytes: `block(b, xs)` gives the i32 lanes of the super-block
    /// `b` times its 8 activation blocks `xs`, [`finish`]ed with the super-scale `d` and the activations' scale,
    /// the lanes summed at the end. SAFETY (callers): avx2, fma and f16c present; `row` holds `x.len() / 8` whole
    /// super-blocks.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lattice_row(
        row: &[u8],
        x: &[BlockQ8],
        bytes: usize,
        d: fn(&[u8]) -> f32,
        mut block: impl FnMut(&[u8], &[BlockQ8]) -> __m256i,
    ) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, xs) in row.chunks_exact(bytes).zip(x.chunks_exact(8)) {
            crate::quant::prefetch::ahead_span(b.as_ptr(), 0, bytes);
            finish(&mut acc, block(b, xs), None, d(b), 0.0, xs[0].d);
        }
        hsum(acc)
    }

    /// Activations `xb` with value `j` negated where byte `j % 8` of [`KSIGNS_PM1`](
    /// crate::quant::format::iq_grid::KSIGNS_PM1)`[(s >> 7 (j / 8)) & 127]` is −1 (the four 7-bit sign fields of
    /// IQ2_XXS and IQ3_XXS).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn ksigned_x(xb: &BlockQ8, s: u32) -> __m256i {
        use crate::quant::format::iq_grid::KSIGNS_PM1;
        let sg = |l: u32| &KSIGNS_PM1[(s >> (7 * l) & 127) as usize];
        _mm256_sign_epi8(load_x(xb), rows4([sg(0), sg(1), sg(2), sg(3)]))
    }

    /// One IQ3_XXS row ([`crate::quant::format::iq3_xxs`]: 98-byte super-blocks) read straight from its bytes:
    /// per 32-value sub-block its eight grid values by index ([`IQ3XXS_GRID`](
    /// crate::quant::format::iq_grid::IQ3XXS_GRID), four values each), its four sign bytes as ±1 multipliers
    /// ([`KSIGNS_PM1`](crate::quant::format::iq_grid::KSIGNS_PM1)) on the activations and its odd scale broadcast;
    /// the i32 lanes and float steps of the generic lattice kernel, so its bits. SAFETY (callers): avx2, fma and
    /// f16c present; `row` holds `x.len() / 8` whole super-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq3_xxs(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq3_xxs::{d, BYTES};
        use crate::quant::format::iq_grid::IQ3XXS_GRID;
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let q = p.add(2 + 8 * ib);
                let g = |k: usize| &IQ3XXS_GRID[*q.add(k) as usize];
                let grid = rows8([g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)]);
                let s = (p.add(66 + 4 * ib) as *const u32).read_unaligned();
                sumi = _mm256_add_epi32(
                    sumi,
                    prod_u(grid, ksigned_x(xb, s), _mm256_set1_epi16((2 * (s >> 28) + 1) as i16)),
                );
            }
            sumi
        })
    }

    /// One IQ3_S row ([`crate::quant::format::iq3_s`]: 110-byte super-blocks) read straight from its bytes: per
    /// sub-block its eight grid values by 9-bit index ([`IQ3S_GRID`](crate::quant::format::iq_grid::IQ3S_GRID)),
    /// its 32 sign bits broadcast from memory onto the activations, its odd scale broadcast; the generic lattice
    /// kernel's i32 lanes and float steps, so its bits. SAFETY (callers): as [`dot_iq3_xxs`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq3_s(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq3_s::{d, BYTES};
        use crate::quant::format::iq_grid::IQ3S_GRID;
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let (q, qh) = (p.add(2 + 8 * ib), *p.add(66 + ib) as usize);
                let g = |k: usize| &IQ3S_GRID[*q.add(k) as usize | (qh >> k & 1) << 8];
                let grid = rows8([g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)]);
                let bits = (p.add(74 + 4 * ib) as *const u32).read_unaligned();
                let xsg = _mm256_sign_epi8(load_x(xb), _mm256_or_si256(bit_bytes(bits), _mm256_set1_epi8(1)));
                let sc = 2 * (*p.add(106 + ib / 2) >> (4 * (ib % 2)) & 0xf) as u32 + 1;
                sumi = _mm256_add_epi32(sumi, prod_u(grid, xsg, _mm256_set1_epi16(sc as i16)));
            }
            sumi
        })
    }

    /// One IQ2_XXS row ([`crate::quant::format::iq2_xxs`]: 66-byte super-blocks) read straight from its bytes: per
    /// sub-block four grid rows by index ([`IQ2XXS_GRID`](crate::quant::format::iq_grid::IQ2XXS_GRID)), four sign
    /// bytes as ±1 multipliers on the activations, the odd scale broadcast; the generic lattice kernel's i32 lanes
    /// and float steps, so its bits. At every level: it measured faster than an AVX-512 kernel over the generic
    /// decoder (docs/BENCHMARKS.md, stop 48). SAFETY (callers): as [`dot_iq3_xxs`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq2_xxs(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq2_xxs::{d, BYTES};
        use crate::quant::format::iq_grid::IQ2XXS_GRID;
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let q = p.add(2 + 8 * ib);
                let g = |l: usize| &IQ2XXS_GRID[*q.add(l) as usize];
                let grid = rows4([g(0), g(1), g(2), g(3)]);
                let s = (q.add(4) as *const u32).read_unaligned();
                sumi = _mm256_add_epi32(
                    sumi,
                    prod_u(grid, ksigned_x(xb, s), _mm256_set1_epi16((2 * (s >> 28) + 1) as i16)),
                );
            }
            sumi
        })
    }

    /// Four table rows `r[0..4]` (row `l` in bytes `8l .. 8l + 8`) loaded straight from memory into one vector (the
    /// loads carry the rows: three vector operations besides the loads, where `_mm256_set_epi64x` of values in
    /// registers takes seven).
    /// SAFETY (callers): avx2 present.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows4(r: [&u64; 4]) -> __m256i {
        // references: each row readable for its 8 bytes
        let pair = |a: &u64, b: &u64| {
            let lo = _mm_loadl_epi64(a as *const u64 as *const __m128i);
            _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(lo), b as *const u64 as *const f64))
        };
        _mm256_inserti128_si256(_mm256_castsi128_si256(pair(r[0], r[1])), pair(r[2], r[3]), 1)
    }

    /// Eight 4-byte table rows `r[0..8]` (row `k` in bytes `4k .. 4k + 4`) loaded straight from memory into one
    /// vector (as [`rows4`]: the inserts take their rows from memory). SAFETY (callers): avx2 present.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows8(r: [&u32; 8]) -> __m256i {
        let quad = |a: &[&u32]| {
            let v = _mm_cvtsi32_si128(*a[0] as i32);
            let v = _mm_insert_epi32(v, *a[1] as i32, 1);
            let v = _mm_insert_epi32(v, *a[2] as i32, 2);
            _mm_insert_epi32(v, *a[3] as i32, 3)
        };
        _mm256_inserti128_si256(_mm256_castsi128_si256(quad(&r[..4])), quad(&r[4..]), 1)
    }

    /// One IQ1_S row ([`crate::quant::format::iq1_s`]: 50-byte super-blocks) read straight from its bytes: per
    /// sub-block four rows of [`IQ1S_GRID_X8`](crate::quant::format::iq_grid::IQ1S_GRID_X8) by 11-bit index plus
    /// the sub-block's ±1 offset as signed codes, its odd scale broadcast; the generic lattice kernel's i32 lanes
    /// and float steps, so its bits. SAFETY (callers): as [`dot_iq3_xxs`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq1_s(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq1_s::{d, BYTES};
        use crate::quant::format::iq_grid::IQ1S_GRID_X8;
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let q = p.add(2 + 4 * ib);
                let qh = (p.add(34 + 2 * ib) as *const u16).read_unaligned() as usize;
                let g = |l: usize| &IQ1S_GRID_X8[*q.add(l) as usize | (qh >> (3 * l) & 7) << 8];
                let delta = _mm256_set1_epi8(if qh & 0x8000 != 0 { -1 } else { 1 });
                let codes = _mm256_add_epi8(rows4([g(0), g(1), g(2), g(3)]), delta);
                let sc = _mm256_set1_epi16((2 * (qh >> 12 & 7) + 1) as i16);
                // spelled out rather than `prod_s`: the call measured 7% slower here (405 against 378 µs per expert)
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pairs_signed(codes, load_x(xb)), sc));
            }
            sumi
        })
    }

    /// One IQ1_M row ([`crate::quant::format::iq1_m`]: 56-byte super-blocks) read straight from its bytes: per
    /// sub-block four rows of [`IQ1S_GRID_X8`](crate::quant::format::iq_grid::IQ1S_GRID_X8) by 11-bit index plus
    /// each row's ±1 offset as signed codes, the two odd per-16 scales; the generic lattice kernel's i32 lanes and
    /// float steps, so its bits. SAFETY (callers): as [`dot_iq3_xxs`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq1_m(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq1_m::{d, BYTES};
        use crate::quant::format::iq_grid::IQ1S_GRID_X8;
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            // the 16 odd scales as i16 pairs, dword i = scales 2i | 2i + 1 (scale k: word k / 4, bits 3 (k % 4))
            let words = _mm256_permutevar8x32_epi32(
                _mm256_cvtepu16_epi32(_mm_loadl_epi64(p.add(48) as *const __m128i)),
                _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
            );
            let (seven, one32) = (_mm256_set1_epi32(7), _mm256_set1_epi32(1));
            let odd_at = |sh: __m256i| {
                let f = _mm256_and_si256(_mm256_srlv_epi32(words, sh), seven);
                _mm256_add_epi32(_mm256_slli_epi32(f, 1), one32)
            };
            let lo = odd_at(_mm256_setr_epi32(0, 6, 0, 6, 0, 6, 0, 6));
            let hi = odd_at(_mm256_setr_epi32(3, 9, 3, 9, 3, 9, 3, 9));
            let sv = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16));
            // bit 3 of row l's nibble (bit 4l + 3 of the sub-block's u16): the sign of the row's offset
            let sign_bits = _mm256_set_epi64x(
                0x8000_8000_8000_8000u64 as i64,
                0x0800_0800_0800_0800,
                0x0080_0080_0080_0080,
                0x0008_0008_0008_0008,
            );
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let q = p.add(4 * ib);
                // one nibble per row: bits 0..3 the row's high index bits, bit 3 its offset's sign
                let nib = (p.add(32 + 2 * ib) as *const u16).read_unaligned();
                let n = nib as usize;
                let g = |l: usize| &IQ1S_GRID_X8[*q.add(l) as usize | (n >> (4 * l) & 7) << 8];
                // each row's offset: −1 in every byte where its sign bit is set, else 1
                let set = _mm256_and_si256(_mm256_set1_epi16(nib as i16), sign_bits);
                let delta = _mm256_or_si256(_mm256_cmpeq_epi16(set, sign_bits), _mm256_set1_epi8(1));
                let codes = _mm256_add_epi8(rows4([g(0), g(1), g(2), g(3)]), delta);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pairs_signed(codes, load_x(xb)), scale_pair(sv, ib)));
            }
            sumi
        })
    }

    /// Decodes the signs of an IQ2_XS super-block at `p`: per half `h` (sub-blocks 4h .. 4h + 4) the sign bytes —
    /// the 7 stored bits, their parity as bit 7 ([`KSIGNS`](crate::quant::format::iq_grid::KSIGNS)) — packed within
    /// each 128-bit lane: bytes 0..8 of lane `k` are those of sub-blocks 4h + 2k and 4h + 2k + 1. SAFETY (callers):
    /// avx2 present; `p` readable for 74 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq2_xs_signs(p: *const u8) -> [__m256i; 2] {
        let one16 = _mm256_set1_epi16(1);
        std::array::from_fn(|h| {
            let v = _mm256_loadu_si256(p.add(2 + 32 * h) as *const __m256i);
            let s7 = _mm256_srli_epi16(v, 9);
            let mut t = _mm256_xor_si256(s7, _mm256_srli_epi16(s7, 4));
            t = _mm256_xor_si256(t, _mm256_srli_epi16(t, 2));
            t = _mm256_xor_si256(t, _mm256_srli_epi16(t, 1));
            let sb = _mm256_or_si256(s7, _mm256_slli_epi16(_mm256_and_si256(t, one16), 7));
            _mm256_packus_epi16(sb, sb)
        })
    }

    /// The 16 odd per-16 scales `2s + 1` of an IQ2_XS super-block whose 8 scale bytes are at `sc` (sub-block `ib` in
    /// byte `ib`: its low nibble, then its high one), in order, as i32. SAFETY (callers): AVX-512 F present; `sc`
    /// readable for 8 bytes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn iq2_xs_odd_scales(sc: *const u8) -> __m512i {
        let low = _mm_set1_epi8(0x0f);
        let sc = _mm_loadl_epi64(sc as *const __m128i);
        let nib = _mm_unpacklo_epi8(_mm_and_si128(sc, low), _mm_and_si128(_mm_srli_epi16(sc, 4), low));
        _mm512_add_epi32(_mm512_slli_epi32(_mm512_cvtepu8_epi32(nib), 1), _mm512_set1_epi32(1))
    }

    /// The i32 lane indices of [`iq2_xs_odd_scales`] for step `j` of the AVX-512 kernels (sub-blocks 2j and 2j + 1,
    /// 64 values): lane `m` takes the scale of 16-value group 4j + m / 4 (`j = 0`: of the four scales IQ2_S's kernel
    /// gathers per step).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn iq2_scale_index(j: usize) -> __m512i {
        let l = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        _mm512_add_epi32(l, _mm512_set1_epi32(4 * j as i32))
    }

    /// Unsigned grid rows of two sub-blocks (`grid`, 64 bytes) times their activations `x2` negated under the mask
    /// `neg`, each i32 lane's four products summed by `vpdpbusd` and times its scale in `scv`, added to `sumi` (lane
    /// `m`: the scale times the products of values `4m .. 4m + 4`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn iq2_step_512(sumi: __m512i, grid: __m512i, x2: __m512i, neg: u64, scv: __m512i) -> __m512i {
        let xsg = _mm512_mask_sub_epi8(x2, neg, _mm512_setzero_si512(), x2);
        let dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), grid, xsg);
        _mm512_add_epi32(sumi, _mm512_mullo_epi32(dp, scv))
    }

    /// One IQ2_XS row ([`crate::quant::format::iq2_xs`]: 74-byte super-blocks): [`dot_iq2_xs_512`] where the level
    /// allows, else [`dot_iq2_xs_avx2`] (the same bits). SAFETY (callers): as [`dot_iq3_xxs`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq2_xs(row: &[u8], x: &[BlockQ8]) -> f32 {
        if crate::quant::simd_level() == crate::quant::SimdLevel::Avx512 {
            // SAFETY: the AVX-512 level means F, BW and VNNI were detected (`q4_wide::supported`); same row.
            return unsafe { dot_iq2_xs_512(row, x) };
        }
        dot_iq2_xs_avx2(row, x)
    }

    /// [`dot_iq2_xs`] in AVX2, reading the bytes directly: per sub-block four u16 codes, each a grid row index
    /// (9 bits) and a sign field (7 bits, as ±1 multipliers from [`KSIGNS_PM1`](
    /// crate::quant::format::iq_grid::KSIGNS_PM1)). SAFETY (callers): as [`dot_iq2_xs`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_iq2_xs_avx2(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq2_xs::{d, BYTES};
        use crate::quant::format::iq_grid::{IQ2XS_GRID, KSIGNS_PM1};
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let w = (p.add(2 + 8 * ib) as *const u64).read_unaligned();
                let g = |l: u32| &IQ2XS_GRID[(w >> (16 * l) & 511) as usize];
                let sg = |l: u32| &KSIGNS_PM1[(w >> (16 * l + 9) & 127) as usize];
                let grid = rows4([g(0), g(1), g(2), g(3)]);
                let xsg = _mm256_sign_epi8(load_x(xb), rows4([sg(0), sg(1), sg(2), sg(3)]));
                let sc = *p.add(66 + ib) as i16;
                let scv = scale_halves([2 * (sc & 0xf) + 1, 2 * (sc >> 4) + 1]);
                sumi = _mm256_add_epi32(sumi, prod_u(grid, xsg, scv));
            }
            sumi
        })
    }

    /// [`dot_iq2_xs`] with AVX-512 F/BW/VNNI: two sub-blocks per step, their 8 grid rows loaded by index, the signs
    /// (decoded for the super-block in two vector steps) as the mask that negates the activations, one `vpdpbusd` and
    /// a multiply by the per-16 scales ([`iq2_step_512`]); the two halves folded once per super-block. The i32 lanes
    /// are [`dot_iq2_xs_avx2`]'s (lane `m` of the 8 sums over every sub-block: the scale times the products of values
    /// `4m .. 4m + 4`), so are the float steps: the same bits. SAFETY (callers): AVX-512 F/BW/VNNI present; `row`
    /// holds `x.len() / 8` whole super-blocks.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dot_iq2_xs_512(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq2_xs::{d, BYTES};
        use crate::quant::format::iq_grid::IQ2XS_GRID;
        let sidx: [__m512i; 4] = std::array::from_fn(|j| iq2_scale_index(j));
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            let mut sgn = [0u64; 4];
            for (h, packed) in iq2_xs_signs(p).into_iter().enumerate() {
                // bytes 0..8 of each 128-bit lane: the sign bytes of two sub-blocks, as one 64-bit mask
                sgn[2 * h] = _mm256_extract_epi64(packed, 0) as u64;
                sgn[2 * h + 1] = _mm256_extract_epi64(packed, 2) as u64;
            }
            let sv = iq2_xs_odd_scales(p.add(66));
            let mut sumi = _mm512_setzero_si512();
            for (j, &neg) in sgn.iter().enumerate() {
                let w = |k: usize| (p.add(2 + 16 * j + 8 * k) as *const u64).read_unaligned();
                let (w0, w1) = (w(0), w(1));
                let g = |w: u64, l: u32| &IQ2XS_GRID[(w >> (16 * l) & 511) as usize];
                let grid = _mm512_inserti64x4(
                    _mm512_castsi256_si512(rows4([g(w0, 0), g(w0, 1), g(w0, 2), g(w0, 3)])),
                    rows4([g(w1, 0), g(w1, 1), g(w1, 2), g(w1, 3)]),
                    1,
                );
                let x2 = _mm512_inserti64x4(_mm512_castsi256_si512(load_x(&xs[2 * j])), load_x(&xs[2 * j + 1]), 1);
                sumi = iq2_step_512(sumi, grid, x2, neg, _mm512_permutexvar_epi32(sidx[j], sv));
            }
            _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1))
        })
    }

    /// One IQ2_S row ([`crate::quant::format::iq2_s`]: 82-byte super-blocks) read straight from its bytes: per
    /// sub-block four rows of [`IQ2S_GRID`](crate::quant::format::iq_grid::IQ2S_GRID) by 10-bit index, its 32 sign
    /// bits onto the activations, the two odd per-16 scales; with AVX-512 where the level allows (the same bits).
    /// SAFETY (callers): avx2, fma and f16c present; `row` holds `x.len() / 8` whole super-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq2_s(row: &[u8], x: &[BlockQ8]) -> f32 {
        if crate::quant::simd_level() == crate::quant::SimdLevel::Avx512 {
            // SAFETY: the AVX-512 level means F, BW and VNNI were detected (`q4_wide::supported`); same row.
            return unsafe { dot_iq2_s_512(row, x) };
        }
        dot_iq2_s_avx2(row, x)
    }

    /// The grid row `l` of IQ2_S sub-block `ib` of the super-block at `p` (kept in a register: `rows4` measured slower
    /// in IQ2_S's AVX2 kernel, 467 against 411 µs per expert on a Zen 4). SAFETY (callers): `p` readable
    /// for 82 bytes, `ib < 8`, `l < 4`.
    #[inline(always)]
    unsafe fn iq2_s_row(p: *const u8, ib: usize, l: usize) -> i64 {
        use crate::quant::format::iq_grid::IQ2S_GRID;
        let qh = *p.add(66 + ib) as usize;
        IQ2S_GRID[*p.add(2 + 4 * ib + l) as usize | (qh >> (2 * l) & 3) << 8] as i64
    }

    /// [`dot_iq2_s`] in AVX2. SAFETY (callers): as [`dot_iq2_s`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_iq2_s_avx2(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq2_s::{d, BYTES};
        lattice_row(row, x, BYTES, d, |b, xs| {
            let p = b.as_ptr();
            let mut sumi = _mm256_setzero_si256();
            for (ib, xb) in xs.iter().enumerate() {
                let g = |l: usize| iq2_s_row(p, ib, l);
                let grid = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
                let bits = (p.add(34 + 4 * ib) as *const u32).read_unaligned();
                let xsg = _mm256_sign_epi8(load_x(xb), _mm256_or_si256(bit_bytes(bits), _mm256_set1_epi8(1)));
                let sc = *p.add(74 + ib) as i16;
                let scv = scale_halves([2 * (sc & 0xf) + 1, 2 * (sc >> 4) + 1]);
                sumi = _mm256_add_epi32(sumi, prod_u(grid, xsg, scv));
            }
            sumi
        })
    }

    /// [`dot_iq2_s`] with AVX-512 F/BW/VNNI: two sub-blocks per step through the format's decoder, their 64 sign
    /// bits as the mask that negates the activations ([`iq2_step_512`]); [`dot_iq2_s_avx2`]'s i32 lanes and float
    /// steps, so its bits. SAFETY (callers): AVX-512 F/BW/VNNI present; `row` holds `x.len() / 8` whole super-blocks.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dot_iq2_s_512(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::iq2_s::{d, sub, BYTES};
        // lanes of sub-blocks 2j (values 0..16, 16..32) and 2j + 1: their four scales, four lanes each
        let quads = iq2_scale_index(0);
        lattice_row(row, x, BYTES, d, |b, xs| {
            let mut sumi = _mm512_setzero_si512();
            for j in 0..4 {
                // the decoder's rows and scales: measured faster here than the grid rows loaded by hand (into
                // registers or by `rows4`) and the scales decoded once per super-block as IQ2_XS does
                // (docs/BENCHMARKS.md, stop 48)
                let (s0, s1) = (sub(b, 2 * j), sub(b, 2 * j + 1));
                let [a0, a1, a2, a3] = s0.grid.map(|g| g as i64);
                let [b0, b1, b2, b3] = s1.grid.map(|g| g as i64);
                let grid = _mm512_set_epi64(b3, b2, b1, b0, a3, a2, a1, a0);
                let neg = s0.signs as u64 | (s1.signs as u64) << 32;
                let x2 = _mm512_inserti64x4(_mm512_castsi256_si512(load_x(&xs[2 * j])), load_x(&xs[2 * j + 1]), 1);
                let sc = _mm_setr_epi32(s0.sc[0] as i32, s0.sc[1] as i32, s1.sc[0] as i32, s1.sc[1] as i32);
                sumi = iq2_step_512(sumi, grid, x2, neg, _mm512_permutexvar_epi32(quads, _mm512_castsi128_si512(sc)));
            }
            _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1))
        })
    }

    macro_rules! four_rows {
        ($($name:ident => $one:ident),* $(,)?) => {$(
            /// Four rows at once: four single-row calls (same contract as the single-row kernel).
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(rows: [&[u8]; 4], x: &[BlockQ8]) -> [f32; 4] {
                [$one(rows[0], x), $one(rows[1], x), $one(rows[2], x), $one(rows[3], x)]
            }
        )*};
    }

    four_rows!(
        dot_q5_0_x4 => dot_q5_0,
        dot_q5_1_x4 => dot_q5_1,
        dot_q2_k_x4 => dot_q2_k,
        dot_q3_k_x4 => dot_q3_k,
        dot_q6_k_x4 => dot_q6_k,
        dot_iq4_nl_x4 => dot_iq4_nl,
        dot_iq4_xs_x4 => dot_iq4_xs,
        dot_mxfp4_x4 => dot_mxfp4,
        dot_iq2_xxs_x4 => dot_iq2_xxs,
        dot_iq2_xs_x4 => dot_iq2_xs,
        dot_iq2_s_x4 => dot_iq2_s,
        dot_iq3_xxs_x4 => dot_iq3_xxs,
        dot_iq3_s_x4 => dot_iq3_s,
        dot_iq1_s_x4 => dot_iq1_s,
        dot_iq1_m_x4 => dot_iq1_m,
    );
}

#[cfg(test)]
pub(super) mod tests {
    use crate::quant::format::lookup;
    use crate::quant::{quantize_q8, BlockQ8, GgmlType};

    const NEW: [GgmlType; 10] = [
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::MXFP4,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// `n_blocks` blocks of `ty`: random bytes (every code and scale pattern), f16 fields set to finite values, or
    /// (`extreme`) every byte 0xff with the largest f16 scales a product can take without overflowing.
    pub(in crate::quant) fn row(ty: GgmlType, n_blocks: usize, extreme: bool, seed: &mut u64) -> Vec<u8> {
        let bs = ty.type_size();
        let fields: &[usize] = match ty {
            GgmlType::MXFP4 | GgmlType::IQ1_M => &[],
            GgmlType::Q5_0 | GgmlType::Q3_K | GgmlType::Q6_K | GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
            GgmlType::IQ2_XXS | GgmlType::IQ2_XS | GgmlType::IQ2_S | GgmlType::IQ3_XXS | GgmlType::IQ3_S => &[0],
            GgmlType::IQ1_S => &[0],
            _ => &[0, 1],
        };
        let at = |f: usize| match ty {
            GgmlType::Q2_K => 80 + 2 * f,
            GgmlType::Q3_K => 108,
            GgmlType::Q6_K => 208,
            _ => 2 * f,
        };
        let mut b = vec![0u8; n_blocks * bs];
        for blk in b.chunks_exact_mut(bs) {
            for x in blk.iter_mut() {
                *x = if extreme { 0xff } else { next(seed) as u8 };
            }
            if ty == GgmlType::MXFP4 {
                // an exponent byte that keeps the products finite (2^-20 .. 2^4), 133 = 2^5 for the extremes
                blk[0] = if extreme { 133 } else { 107 + (next(seed) % 25) as u8 };
            }
            let scale = |seed: &mut u64| {
                let v = if extreme { 0.5 } else { (next(seed) % 2000) as f32 / 1e5 - 0.01 };
                half::f16::from_f32(v).to_bits()
            };
            for &f in fields {
                let v = scale(seed);
                blk[at(f)..at(f) + 2].copy_from_slice(&v.to_le_bytes());
            }
            if ty == GgmlType::IQ1_M {
                // the f16 `d` is the four scale words' top nibbles
                crate::quant::format::iq1_m::set_d(blk, scale(seed));
            }
        }
        b
    }

    /// `v` quantized as products of `ty` rows quantize their activations: Q8_K (one scale per 256, the kernels'
    /// contract) for the K-quants and the lattice IQ formats, Q8_0 blocks for the others.
    pub(in crate::quant) fn quantize_for(ty: GgmlType, v: &[f32]) -> Vec<BlockQ8> {
        let mut x = vec![BlockQ8::default(); v.len() / 32];
        if lookup(ty).is_some_and(|f| f.activation == crate::quant::format::Activation::Q8K) {
            crate::quant::quantize_q8_k(v, &mut x);
        } else {
            quantize_q8(v, &mut x);
        }
        x
    }

    /// `n` activations: random in [-2, 2], or saturating (±3 alternating by block of 32, so every code is ±127).
    pub(in crate::quant) fn values(n: usize, extreme: bool, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|i| match (extreme, (i / 32) % 2) {
                (true, 0) => 3.0,
                (true, _) => -3.0,
                _ => (next(seed) % 2001) as f32 / 500.0 - 2.0,
            })
            .collect()
    }

    /// Σ w·x in f64 over the dequantized row and the activations' own values (`d · q` per block).
    pub(in crate::quant) fn exact(ty: GgmlType, row: &[u8], x: &[BlockQ8]) -> (f64, f64) {
        let mut w = vec![0f32; x.len() * 32];
        crate::quant::dequantize_row(ty, row, &mut w).unwrap();
        let (mut s, mut mag) = (0f64, 0f64);
        for (i, &wv) in w.iter().enumerate() {
            let xv = x[i / 32].d as f64 * x[i / 32].qs[i % 32] as f64;
            s += wv as f64 * xv;
            mag += (wv as f64 * xv).abs();
        }
        (s, mag)
    }

    #[test]
    fn every_kernel_matches_the_exact_product_for_every_tail_and_extreme() {
        let mut seed = 0x5EEDu64;
        for ty in NEW.into_iter().chain(crate::quant::format::iq::TYPES) {
            let f = lookup(ty).expect("registered");
            let k = f.q8.expect("block format");
            let per = ty.block_size() / 32;
            for n_blocks in [1usize, 2, 3, 5] {
                for extreme in [false, true] {
                    let n = n_blocks * ty.block_size();
                    let r = row(ty, n_blocks, extreme, &mut seed);
                    let xs = values(n, extreme, &mut seed);
                    let x = quantize_for(ty, &xs);
                    assert_eq!(x.len(), n_blocks * per);
                    let (want, mag) = exact(ty, &r, &x);
                    // Q5_1's minimum multiplies the activations' block sum `s`, which is rounded to f16 (ggml's Q8_1
                    // does the same): allow that rounding on top
                    let s_err: f64 = if ty == GgmlType::Q5_1 {
                        r.chunks_exact(24)
                            .zip(&x)
                            .map(|(b, xb)| {
                                let m = half::f16::from_bits(u16::from_le_bytes([b[2], b[3]])).to_f32() as f64;
                                (m * xb.s as f64).abs() * 1e-3
                            })
                            .sum()
                    } else {
                        0.0
                    };
                    let tol = 2e-6 * mag.max(1e-6) + s_err;
                    let s = (k.scalar)(&r, &x) as f64;
                    assert!((s - want).abs() <= tol, "{ty:?} x{n_blocks} extreme {extreme}: scalar {s} exact {want}");
                    #[cfg(target_arch = "x86_64")]
                    if crate::quant::simd_level().avx2() {
                        // SAFETY: AVX2/FMA/F16C detected; the row holds x.len() / per whole blocks.
                        let (v, v4) = unsafe { ((k.avx2)(&r, &x), (k.avx2_x4)([&r, &r, &r, &r], &x)) };
                        assert!((v as f64 - want).abs() <= tol, "{ty:?} x{n_blocks} {extreme}: avx2 {v} exact {want}");
                        assert!(v4.iter().all(|&y| y.to_bits() == v.to_bits()), "{ty:?}: x4 {v4:?} vs {v}");
                    }
                    // and the dispatch every caller uses
                    let d = crate::quant::dot_q8(ty, &r, &x) as f64;
                    assert!((d - want).abs() <= tol, "{ty:?}: dot_q8 {d} exact {want}");
                    // Q8_0 activations (a scale per 32) where the format pairs with Q8_K: the dispatch takes the
                    // scalar reference, still the exact product
                    let mut x0 = vec![BlockQ8::default(); n / 32];
                    quantize_q8(&xs, &mut x0);
                    if !crate::quant::is_q8_k(&x0) {
                        let (want0, mag0) = exact(ty, &r, &x0);
                        let d0 = crate::quant::dot_q8(ty, &r, &x0) as f64;
                        let d4 = crate::quant::dot_q8_x4(ty, [&r, &r, &r, &r], &x0);
                        assert!((d0 - want0).abs() <= 2e-6 * mag0.max(1e-6) + s_err, "{ty:?}: Q8_0 x {d0} vs {want0}");
                        assert!(d4.iter().all(|v| v.to_bits() == (d0 as f32).to_bits()), "{ty:?}: Q8_0 x4");
                    }
                }
            }
        }
    }

    /// Q4_K and Q5_K: four distinct rows at once give each row the one-row bits, each within the exact product's
    /// tolerance (random and saturating rows, 1..5 super-blocks).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn k_rows_give_each_of_four_distinct_rows_the_one_row_bits() {
        use super::avx2::q45_k_rows;
        if !crate::quant::simd_level().avx2() {
            return;
        }
        let mut seed = 0x4B5u64;
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K] {
            for n_blocks in [1usize, 2, 5] {
                for extreme in [false, true] {
                    let n = n_blocks * 256;
                    let rows: Vec<Vec<u8>> = (0..4).map(|_| row(ty, n_blocks, extreme, &mut seed)).collect();
                    let x = quantize_for(ty, &values(n, extreme, &mut seed));
                    let r4 = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
                    // SAFETY: AVX2/FMA/F16C detected above; each row holds n_blocks super-blocks of x.
                    let (four, ones) = unsafe {
                        if ty == GgmlType::Q4_K {
                            (q45_k_rows::<false, 4>(r4, &x), r4.map(|r| q45_k_rows::<false, 1>([r], &x)[0]))
                        } else {
                            (q45_k_rows::<true, 4>(r4, &x), r4.map(|r| q45_k_rows::<true, 1>([r], &x)[0]))
                        }
                    };
                    assert_eq!(four.map(f32::to_bits), ones.map(f32::to_bits), "{ty:?} x{n_blocks} {extreme}: rows");
                    for (r, v) in rows.iter().zip(four) {
                        let (want, mag) = exact(ty, r, &x);
                        assert!((v as f64 - want).abs() <= 2e-6 * mag.max(1e-6), "{ty:?}: {v} vs {want}");
                    }
                }
            }
        }
    }

    /// The one-step SSE unpack of Q4_K / Q5_K scales and minimums gives what the scalar layout reads, on random
    /// packed bytes (every bit pattern of the 12 bytes many times over).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_scale_unpack_matches_the_scalar_layout() {
        use crate::quant::format::kquant::scale_min_k4;
        if !crate::quant::simd_level().avx2() {
            return;
        }
        let mut seed = 0x5CA1Eu64;
        for _ in 0..4096 {
            let b: [u8; 16] = std::array::from_fn(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 24) as u8
            });
            let mut got = [0u8; 16];
            // SAFETY: AVX2 detected above; 16 bytes at b.
            unsafe {
                let v = super::avx2::scales_mins_k4(b.as_ptr());
                std::arch::x86_64::_mm_storeu_si128(got.as_mut_ptr() as *mut _, v);
            }
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, &b[..12]);
                assert_eq!((got[j], got[8 + j]), (sc, mn), "group {j} of {b:?}");
            }
        }
    }

    /// The IQ2 lattice formats with AVX-512 kernels (IQ2_XS, IQ2_S): they give the AVX2 kernels' bits, and
    /// those the exact product (random and saturating rows, 1..5 super-blocks).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn lattice_avx512_kernels_give_the_avx2_bits() {
        use super::avx2::*;
        if !crate::quant::simd_level().avx2() {
            return;
        }
        let wide = crate::quant::dot512::supported();
        type K = unsafe fn(&[u8], &[BlockQ8]) -> f32;
        let kernels: [(GgmlType, K, K); 2] =
            [(GgmlType::IQ2_XS, dot_iq2_xs_avx2, dot_iq2_xs_512), (GgmlType::IQ2_S, dot_iq2_s_avx2, dot_iq2_s_512)];
        let mut seed = 0x1A2u64;
        for (ty, k2, k512) in kernels {
            for n_blocks in [1usize, 2, 3, 5] {
                for extreme in [false, true] {
                    let r = row(ty, n_blocks, extreme, &mut seed);
                    let x = quantize_for(ty, &values(n_blocks * 256, extreme, &mut seed));
                    // SAFETY: AVX2/FMA/F16C detected above (AVX-512 F/BW/VNNI where `wide`); the row holds n_blocks
                    // super-blocks of x.
                    let (a, b) = unsafe {
                        let a = k2(&r, &x);
                        (a, if wide { k512(&r, &x) } else { a })
                    };
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} x{n_blocks} {extreme}: avx2 {a} avx512 {b}");
                    let (want, mag) = exact(ty, &r, &x);
                    assert!((a as f64 - want).abs() <= 2e-6 * mag.max(1e-6), "{ty:?} x{n_blocks}: {a} vs {want}");
                }
            }
        }
    }

    /// Every lattice format's kernels — the AVX2 ones, the AVX-512 ones where the CPU has them, and the entry the
    /// format table gives callers — give the bits of the generic kernel over the format's
    /// [`Sub`](crate::quant::format::iq::Sub) decoder (random and saturating rows, 1..5 super-blocks).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn lattice_kernels_give_the_generic_decoders_bits() {
        use super::avx2::*;
        use crate::quant::format::{iq1_m, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs};
        if !crate::quant::simd_level().avx2() {
            return;
        }
        type K = unsafe fn(&[u8], &[BlockQ8]) -> f32;
        // (format, decoder, AVX2 kernel, AVX-512 kernel)
        let kernels: [(GgmlType, &crate::quant::format::iq::Lattice, K, Option<K>); 7] = [
            (GgmlType::IQ2_XXS, &iq2_xxs::LATTICE, dot_iq2_xxs, None),
            (GgmlType::IQ2_XS, &iq2_xs::LATTICE, dot_iq2_xs_avx2, Some(dot_iq2_xs_512)),
            (GgmlType::IQ2_S, &iq2_s::LATTICE, dot_iq2_s_avx2, Some(dot_iq2_s_512)),
            (GgmlType::IQ3_XXS, &iq3_xxs::LATTICE, dot_iq3_xxs, None),
            (GgmlType::IQ3_S, &iq3_s::LATTICE, dot_iq3_s, None),
            (GgmlType::IQ1_S, &iq1_s::LATTICE, dot_iq1_s, None),
            (GgmlType::IQ1_M, &iq1_m::LATTICE, dot_iq1_m, None),
        ];
        let wide = crate::quant::dot512::supported();
        let mut seed = 0x1A7u64;
        for (ty, lat, k2, k512) in kernels {
            let entry = lookup(ty).and_then(|f| f.q8).expect("a lattice format has 8-bit kernels").avx2;
            for n_blocks in [1usize, 2, 3, 5] {
                for extreme in [false, true] {
                    for _ in 0..4 {
                        let r = row(ty, n_blocks, extreme, &mut seed);
                        let x = quantize_for(ty, &values(n_blocks * 256, extreme, &mut seed));
                        // SAFETY: AVX2/FMA/F16C detected above (AVX-512 F/BW/VNNI where `wide`); the row holds
                        // n_blocks super-blocks of x.
                        let (want, got, via, got512) = unsafe {
                            let w = lattice_reference(lat, &r, &x);
                            (w, k2(&r, &x), entry(&r, &x), k512.filter(|_| wide).map_or(w, |k| k(&r, &x)))
                        };
                        let what = format!("{ty:?} x{n_blocks} {extreme}");
                        assert_eq!(want.to_bits(), got.to_bits(), "{what}: avx2 {got} vs {want}");
                        assert_eq!(want.to_bits(), via.to_bits(), "{what}: table entry {via} vs {want}");
                        assert_eq!(want.to_bits(), got512.to_bits(), "{what}: avx512 {got512} vs {want}");
                    }
                }
            }
        }
    }

    /// The lattice kernels that put the signs on the activations and pass the grid levels to `maddubs` as unsigned
    /// bytes rely on every level being in 0..=127 with no offset: checked on every grid row each format can decode
    /// (random super-blocks hit all indices many times over).
    #[test]
    fn unsigned_lattice_grids_have_levels_below_128_and_no_offset() {
        use crate::quant::format::{iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs};
        let mut seed = 0x6D1Du64;
        let subs: [(usize, fn(&[u8], usize) -> crate::quant::format::iq::Sub); 5] = [
            (iq2_xxs::BYTES, iq2_xxs::sub),
            (iq2_xs::BYTES, iq2_xs::sub),
            (iq2_s::BYTES, iq2_s::sub),
            (iq3_xxs::BYTES, iq3_xxs::sub),
            (iq3_s::BYTES, iq3_s::sub),
        ];
        for (bytes, sub) in subs {
            for _ in 0..2000 {
                let b: Vec<u8> = (0..bytes).map(|_| next(&mut seed) as u8).collect();
                for ib in 0..8 {
                    let s = sub(&b, ib);
                    assert_eq!(s.delta, [0; 4]);
                    assert!(s.grid.iter().all(|g| g & 0x8080_8080_8080_8080 == 0), "{:x?}", s.grid);
                }
            }
        }
    }

    /// An N-token kernel `tn` of `ty` against its single-row kernel `one` on rows of 1, 2 and 5 blocks, random and
    /// saturating, each with N different random activation rows: every token's result has `one`'s bits, and where
    /// `via` (the lookup the matrix product uses) gives results, they have [`crate::quant::dot_q8`]'s bits.
    /// The caller checks that the CPU has AVX2/FMA/F16C.
    #[cfg(target_arch = "x86_64")]
    fn check_token_kernel<const N: usize>(
        ty: GgmlType,
        tn: unsafe fn(&[u8], [&[BlockQ8]; N]) -> [f32; N],
        one: unsafe fn(&[u8], &[BlockQ8]) -> f32,
        seed: &mut u64,
        via: impl Fn(&[u8], [&[BlockQ8]; N]) -> Option<[f32; N]>,
    ) {
        for n_blocks in [1usize, 2, 5] {
            for extreme in [false, true] {
                let n = n_blocks * ty.block_size();
                let r = row(ty, n_blocks, extreme, seed);
                let xs: Vec<Vec<BlockQ8>> = (0..N)
                    .map(|_| {
                        let v: Vec<f32> = (0..n).map(|_| (next(seed) % 2001) as f32 / 500.0 - 2.0).collect();
                        quantize_for(ty, &v)
                    })
                    .collect();
                let xn: [&[BlockQ8]; N] = std::array::from_fn(|t| &xs[t][..]);
                // SAFETY: AVX2/FMA/F16C present (the caller's check); the row holds n_blocks whole blocks of each x.
                let got = unsafe { tn(&r, xn) };
                let by_lookup = via(&r, xn);
                for (t, g) in got.iter().enumerate() {
                    // SAFETY: as above.
                    let single = unsafe { one(&r, &xs[t]) };
                    assert_eq!(g.to_bits(), single.to_bits(), "{ty:?} x{n_blocks} extreme {extreme} token {t}");
                    if let Some(v) = by_lookup {
                        let d = crate::quant::dot_q8(ty, &r, &xs[t]);
                        assert_eq!(
                            v[t].to_bits(),
                            d.to_bits(),
                            "{ty:?} x{n_blocks} extreme {extreme} lookup token {t}"
                        );
                    }
                }
            }
        }
    }

    /// The four-token kernels give each token the single-row kernel's bits (random and saturating rows, four
    /// different activation rows, whole super-blocks of 1..5).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn four_token_kernels_give_each_token_the_single_row_bits() {
        if !crate::quant::simd_level().avx2() {
            return;
        }
        let mut seed = 0x7E4u64;
        let mut seen = 0;
        for ty in NEW.into_iter().chain(crate::quant::format::iq::TYPES) {
            let k = lookup(ty).and_then(|f| f.q8).expect("block format");
            let Some(t4) = k.avx2_t4 else { continue };
            seen += 1;
            check_token_kernel(ty, t4, k.avx2, &mut seed, |_, _| None);
        }
        assert_eq!(seen, 4, "Q5_0, Q4_K, Q5_K and Q6_K have four-token kernels");
    }

    /// The eight-token kernels give each token the single-row kernel's bits (random and saturating rows, eight
    /// different activation rows, 1..5 blocks).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn eight_token_kernels_give_each_token_the_single_row_bits() {
        if !crate::quant::simd_level().avx2() {
            return;
        }
        let mut seed = 0x7E8u64;
        let mut seen = 0;
        for f in crate::quant::format::REGISTRY {
            let Some(k) = f.q8 else { continue };
            let Some(t8) = k.avx2_t8 else { continue };
            let ty = f.ty;
            seen += 1;
            // and through the lookup the matrix product uses, against dot_q8
            check_token_kernel(ty, t8, k.avx2, &mut seed, |r, x8| {
                crate::quant::q8_t8(ty).and_then(|k8| k8.takes(x8)).map(|k8| k8.dot(r, x8))
            });
        }
        assert_eq!(seen, 1, "Q5_0 has an eight-token kernel");
    }
}
