//! AVX2 dot kernels of the formats added after the first six (Q5_0, Q5_1, the K-quants, IQ4_NL, IQ4_XS and MXFP4,
//! [`super::format`]) with
//! 8-bit activations ([`BlockQ8`], blocks of 32). Each format unpacks its codes with SIMD shifts and masks into 32
//! bytes per activation block and multiplies them with `maddubs`; the K-quants apply their per-16 integer scales
//! (and minimums) with one `madd` each, so a 32-block costs the same whatever the format. The four-row variants are
//! four single-row calls (bit-identical to them by construction); the four-token ones (`*_t4`: Q5_0 and the Q4_K_M
//! family's K-quants) unpack a row's codes once for four tokens' activations, each token's sums in the single-row
//! kernel's order (bit-identical to it).

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    use crate::quant::dot::avx2::{h2f, hsum, nibbles};
    use crate::quant::format::kquant::scale_min_k4;
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
        dot_q4_k, dot_q4_k_t4 => q4_k_n, "Q4_K row (super-blocks of 144 bytes, one per 8 `x` blocks)";
        dot_q5_k, dot_q5_k_t4 => q5_k_n, "Q5_K row (super-blocks of 176 bytes, one per 8 `x` blocks)";
        dot_q6_k, dot_q6_k_t4 => q6_k_n, "Q6_K row (super-blocks of 210 bytes, one per 8 `x` blocks)";
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
            summs += h2f(b.add(2)) * xb.s;
            let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
            let q = _mm256_or_si256(nibbles(b.add(8)), fifth_bits(qh));
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, load_x(xb)), ones));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b) * xb.d), s, acc);
        }
        hsum(acc) + summs
    }

    /// Adds one 32-value group to `acc`: signed codes `q` (|q| ≤ 127), per-16 scales `sc` and minimums `mn` (i16,
    /// the first 16 values then the next 16), super-scales `d`, `dmin`: `acc += d_x · (d · Σ sc q q_x − dmin · Σ mn
    /// q_x)`, lane-wise.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group(acc: &mut __m256, q: __m256i, xb: &BlockQ8, sc: [i16; 2], mn: [i16; 2], d: f32, dmin: f32) {
        let xq = load_x(xb);
        let scv = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
        let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs_signed(q, xq), scv));
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), s, *acc);
        if mn != [0, 0] {
            let mnv = _mm256_set_m128i(_mm_set1_epi16(mn[1]), _mm_set1_epi16(mn[0]));
            let xs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), xq);
            let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(xs, mnv));
            *acc = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * xb.d), m, *acc);
        }
    }

    /// One Q4_K row times `N` tokens' activations ([`dot_q4_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_n<const N: usize>(row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let low = _mm256_set1_epi8(0x0f);
        for (i, b) in row.chunks_exact(144).enumerate() {
            let (d, dmin) = (h2f(b.as_ptr()), h2f(b.as_ptr().add(2)));
            let scales = &b[4..16];
            for c in 0..4 {
                let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * c) as *const __m256i);
                for (h, q) in
                    [_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)].into_iter().enumerate()
                {
                    let (s, m) = scale_min_k4(2 * c + h, scales);
                    for (a, xt) in acc.iter_mut().zip(x) {
                        group(a, q, &xt[8 * i + 2 * c + h], [s as i16; 2], [m as i16; 2], d, dmin);
                    }
                }
            }
        }
        hsum_n(acc)
    }

    /// One Q5_K row times `N` tokens' activations ([`dot_q5_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_k_n<const N: usize>(row: &[u8], x: [&[BlockQ8]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let low = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        for (i, b) in row.chunks_exact(176).enumerate() {
            let (d, dmin) = (h2f(b.as_ptr()), h2f(b.as_ptr().add(2)));
            let scales = &b[4..16];
            let qh = _mm256_loadu_si256(b.as_ptr().add(16) as *const __m256i);
            for c in 0..4 {
                let v = _mm256_loadu_si256(b.as_ptr().add(48 + 32 * c) as *const __m256i);
                let (h0, h1) = (bits_at(qh, 2 * c as i32, one), bits_at(qh, 2 * c as i32 + 1, one));
                let lo = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_slli_epi16(h0, 4));
                let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_slli_epi16(h1, 4));
                for (h, q) in [lo, hi].into_iter().enumerate() {
                    let (s, m) = scale_min_k4(2 * c + h, scales);
                    for (a, xt) in acc.iter_mut().zip(x) {
                        group(a, q, &xt[8 * i + 2 * c + h], [s as i16; 2], [m as i16; 2], d, dmin);
                    }
                }
            }
        }
        hsum_n(acc)
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
            let d = h2f(p.add(208));
            let sc = &b[192..208];
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
                    let g = 8 * h + 2 * s; // first 16-value group of these 32 values
                    let k = 4 * h + s; // their activation block
                    let scs = [sc[g] as i8 as i16, sc[g + 1] as i8 as i16];
                    for (a, xt) in acc.iter_mut().zip(x) {
                        group(a, q, &xt[8 * i + k], scs, [0, 0], d, 0.0);
                    }
                }
            }
        }
        hsum_n(acc)
    }

    /// One Q3_K row. SAFETY (callers): as [`dot_q4_k`], super-blocks of 110 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q3_k(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let (one, three) = (_mm256_set1_epi8(1), _mm256_set1_epi8(3));
        for (b, xs) in row.chunks_exact(110).zip(x.chunks_exact(8)) {
            let p = b.as_ptr();
            let d = h2f(p.add(108));
            let s = &b[96..108];
            let sc = |i: usize| {
                let lo = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
                ((lo | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) as i16) - 32
            };
            let hm = _mm256_loadu_si256(p as *const __m256i);
            for h in 0..2 {
                let v = _mm256_loadu_si256(p.add(32 + 32 * h) as *const __m256i);
                for sh in 0..4 {
                    let q2 = bits_at(v, 2 * sh as i32, three);
                    let bit = bits_at(hm, (4 * h + sh) as i32, one);
                    // q − 4 where the high bit is clear: q2 + 4·bit − 4
                    let q = _mm256_sub_epi8(_mm256_or_si256(q2, _mm256_slli_epi16(bit, 2)), _mm256_set1_epi8(4));
                    let k = 4 * h + sh;
                    group(&mut acc, q, &xs[k], [sc(2 * k), sc(2 * k + 1)], [0, 0], d, 0.0);
                }
            }
        }
        hsum(acc)
    }

    /// One Q2_K row. SAFETY (callers): as [`dot_q4_k`], super-blocks of 84 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q2_k(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let three = _mm256_set1_epi8(3);
        for (b, xs) in row.chunks_exact(84).zip(x.chunks_exact(8)) {
            let p = b.as_ptr();
            let (d, dmin) = (h2f(p.add(80)), h2f(p.add(82)));
            for h in 0..2 {
                let v = _mm256_loadu_si256(p.add(16 + 32 * h) as *const __m256i);
                for sh in 0..4 {
                    let q = bits_at(v, 2 * sh as i32, three);
                    let k = 4 * h + sh;
                    let (a, c) = (b[2 * k], b[2 * k + 1]);
                    let sc = [(a & 0x0f) as i16, (c & 0x0f) as i16];
                    let mn = [(a >> 4) as i16, (c >> 4) as i16];
                    group(&mut acc, q, &xs[k], sc, mn, d, dmin);
                }
            }
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

    /// One IQ4_XS row. SAFETY (callers): as [`dot_q4_k`], super-blocks of 136 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq4_xs(row: &[u8], x: &[BlockQ8]) -> f32 {
        use crate::quant::format::{iq4_nl::KVALUES, iq4_xs::scale};
        let mut acc = _mm256_setzero_ps();
        for (b, xs) in row.chunks_exact(136).zip(x.chunks_exact(8)) {
            let d = h2f(b.as_ptr());
            for (i, xb) in xs.iter().enumerate() {
                let q = table_levels(b.as_ptr().add(8 + 16 * i), &KVALUES);
                let s = scale(b, i);
                group(&mut acc, q, xb, [s, s], [0, 0], d, 0.0);
            }
        }
        hsum(acc)
    }

    macro_rules! lattice_rows {
        ($($name:ident => $m:ident),* $(,)?) => {$(
            /// One row of a lattice IQ format. SAFETY (callers): avx2, fma and f16c present; `row` holds
            /// `x.len() / 8` whole super-blocks.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(row: &[u8], x: &[BlockQ8]) -> f32 {
                use crate::quant::format::$m as f;
                let mut acc = _mm256_setzero_ps();
                for (b, xs) in row.chunks_exact(f::BYTES).zip(x.chunks_exact(8)) {
                    let d = f::d(b);
                    for (ib, xb) in xs.iter().enumerate() {
                        let s = f::sub(b, ib);
                        group(&mut acc, lattice_codes(&s), xb, s.sc, [0, 0], d, 0.0);
                    }
                }
                hsum(acc)
            }
        )*};
    }

    lattice_rows!(
        dot_iq2_xxs => iq2_xxs,
        dot_iq2_xs => iq2_xs,
        dot_iq2_s => iq2_s,
        dot_iq3_xxs => iq3_xxs,
        dot_iq3_s => iq3_s,
        dot_iq1_s => iq1_s,
        dot_iq1_m => iq1_m,
    );

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
        dot_q4_k_x4 => dot_q4_k,
        dot_q5_k_x4 => dot_q5_k,
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
                    let mut x = vec![BlockQ8::default(); n / 32];
                    quantize_q8(&xs, &mut x);
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
            for n_blocks in [1usize, 2, 5] {
                for extreme in [false, true] {
                    let n = n_blocks * ty.block_size();
                    let r = row(ty, n_blocks, extreme, &mut seed);
                    let xs: Vec<Vec<BlockQ8>> = (0..4)
                        .map(|_| {
                            let v: Vec<f32> = (0..n).map(|_| (next(&mut seed) % 2001) as f32 / 500.0 - 2.0).collect();
                            let mut x = vec![BlockQ8::default(); n / 32];
                            quantize_q8(&v, &mut x);
                            x
                        })
                        .collect();
                    let x4 = [&xs[0][..], &xs[1][..], &xs[2][..], &xs[3][..]];
                    // SAFETY: AVX2/FMA/F16C detected above; the row holds n_blocks whole blocks of each x.
                    let got = unsafe { t4(&r, x4) };
                    for (t, g) in got.iter().enumerate() {
                        // SAFETY: as above.
                        let one = unsafe { (k.avx2)(&r, &xs[t]) };
                        assert_eq!(g.to_bits(), one.to_bits(), "{ty:?} x{n_blocks} extreme {extreme} token {t}");
                    }
                }
            }
        }
        assert_eq!(seen, 4, "Q5_0, Q4_K, Q5_K and Q6_K have four-token kernels");
    }
}
