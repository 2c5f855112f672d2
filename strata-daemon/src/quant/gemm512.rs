//! Prefill products on AVX-512 (F, BW, VNNI) with the tokens in the vector lanes: a few weight rows' codes are
//! unpacked once per task ([`WRows`]) and multiplied with tiles of 16 tokens' activations ([`XTile`]), so each
//! 512-bit `vpdpbusd` computes 4 values of one row against 16 tokens, and a scale is applied to 16 tokens' sums at
//! once.
//!
//! Layout: the activations of a tile are interleaved by 4-value words ([`XTile::prepare`]: for word `k` of a row,
//! token `j`'s four codes plus 128, as unsigned bytes, at `16k + j`). A row's codes stay in value order as signed
//! bytes; each word of them is broadcast to the 16 lanes, and the sums start from `−128 · Σ codes` (the offset of
//! the unsigned activations), so every integer is exact.
//!
//! The float order follows ggml's AVX2 dot products, so the results are those of the one-token kernels or close to
//! them:
//! - **32-value blocks with one scale** (Q5_0, Q8_0; [`Unpack::Blocks32`]): the four-value sums of each block go to
//!   8 accumulators per token (word `k` of every block into accumulator `k`), each block's `d_w · d_x` applied by
//!   one `fma`, and the 8 are summed as the AVX2 lane sum sums them — the AVX2 and one-token AVX-512 kernels' bits
//!   exactly (ggml's `ggml_vec_dot_q8_0_q8_0` order).
//! - **super-blocks of 256** (the K-quants, IQ4_XS and the lattice IQs): per super-block and token, the groups' sums
//!   times their integer scales are added as integers (and the minimums times the activations' per-group sums), then
//!   one `fma` applies `d · d_x` (and one `dmin · d_x`), as ggml's `ggml_vec_dot_q*_K_q8_K` do per lane. These need
//!   Q8_K activations (one `d_x` per super-block, [`XTile::uniform`]); the CPU matmul checks and otherwise leaves
//!   the product to the row kernels.
//!
//! The kernels run only where [`super::dot512::supported`] holds: [`WRows::unpack`] and [`WRows::times`] check it
//! (and panic otherwise), whoever built the [`Gemm512`].
//!
//! Each lane (token) adds its blocks in row order, so a token's result does not depend on the other tokens of its
//! tile or on how rows are split among threads.

use super::format::kquant::{Unpacked, QK_K};
use super::BlockQ8;

/// Tokens per tile: the 32-bit lanes of a 512-bit vector.
pub const LANES: usize = 16;

/// Up to [`LANES`] tokens' 8-bit activations interleaved for the kernels (the lanes past `t` hold zero
/// activations, which add nothing).
#[derive(Debug, Default, Clone)]
pub struct XTile {
    /// Values per row.
    n: usize,
    /// Tokens in the tile.
    t: usize,
    /// `n / 4 × 16` words: word `k` of token `j` (its 4 codes + 128, unsigned bytes) at `16k + j`.
    xu: Vec<u32>,
    /// `n / 32 × 16`: block `b`'s scale of token `j` at `16b + j`.
    d: Vec<f32>,
    /// `n / 16 × 16`: the sum of each 16 codes (the minimums' term, ggml's Q8_K `bsums`).
    sums: Vec<i32>,
    /// Every token's whole super-blocks share one scale (Q8_K activations).
    uniform: bool,
}

impl XTile {
    /// Interleaves `x` (1..=16 tokens' blocks, all as long as `x[0]`). Panics otherwise.
    pub fn prepare(&mut self, x: &[&[BlockQ8]]) {
        let t = x.len();
        assert!((1..=LANES).contains(&t), "XTile: 1..=16 tokens");
        let nb = x[0].len();
        self.n = nb * 32;
        self.t = t;
        self.xu.clear();
        self.xu.resize(nb * 8 * LANES, 0x8080_8080);
        self.d.clear();
        self.d.resize(nb * LANES, 0.0);
        self.sums.clear();
        self.sums.resize(nb * 2 * LANES, 0);
        self.uniform = nb.is_multiple_of(8);
        for (j, xt) in x.iter().enumerate() {
            assert_eq!(xt.len(), nb, "XTile: every token as long as the first");
            self.uniform &= xt.chunks_exact(8).all(|s| s.iter().all(|b| b.d.to_bits() == s[0].d.to_bits()));
            for (b, blk) in xt.iter().enumerate() {
                self.d[b * LANES + j] = blk.d;
                for (w, q) in blk.qs.chunks_exact(4).enumerate() {
                    let v = u32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]) ^ 0x8080_8080;
                    self.xu[(8 * b + w) * LANES + j] = v;
                }
                for (h, q) in blk.qs.chunks_exact(16).enumerate() {
                    self.sums[(2 * b + h) * LANES + j] = q.iter().map(|&v| v as i32).sum();
                }
            }
        }
    }

    /// Tokens in the tile.
    pub fn tokens(&self) -> usize {
        self.t
    }

    /// Whether every token's super-blocks of 256 share one scale (the super-block kernels need it).
    pub fn uniform(&self) -> bool {
        self.uniform
    }
}

/// An AVX-512 unpacker of 32-value blocks: `f(row, codes, d)` — the signed codes in value order, each block's
/// scale.
pub type Blocks32Unpack = unsafe fn(&[u8], &mut [i8], &mut [f32]);

/// An AVX-512 unpacker of super-blocks: `f(row, codes, sc, mn, d, dmin)` — the codes, each group's integer scale and
/// minimum, each super-block's `d` and `dmin` (value `d · sc · q − dmin · mn`).
pub type SuperUnpack = unsafe fn(&[u8], &mut [i8], &mut [i32], &mut [i32], &mut [f32], &mut [f32]);

/// How a format's rows unpack into integer codes and scales. The AVX-512 ones are callable only where
/// [`super::dot512::supported`] holds; the registry hands them out for rows of their format.
#[derive(Debug, Clone, Copy)]
pub enum Unpack {
    /// 32-value blocks with one scale (ggml's 8-lane order).
    Blocks32(Blocks32Unpack),
    /// Super-blocks of 256, unpacked with AVX-512.
    SuperSimd(SuperUnpack),
    /// Super-blocks of 256 through the format's scalar unpacker (groups of 16), and its bytes per super-block.
    Super(fn(&[u8], &mut Unpacked), usize),
}

/// A format's GEMM: its unpacker, its group size (values per integer scale: 16 or 32; 32 for
/// [`Unpack::Blocks32`]) and whether it has minimums.
#[derive(Debug, Clone, Copy)]
pub struct Gemm512 {
    /// The unpacker.
    pub unpack: Unpack,
    /// Values per group sharing an integer scale.
    pub group: usize,
    /// The values carry minimums.
    pub min: bool,
}

impl Gemm512 {
    /// A super-block format's GEMM through its scalar unpacker (`unpack`, `bytes` per super-block of 256): groups
    /// of 16 values, minimums when `min` (Q2_K).
    pub const fn scalar(unpack: fn(&[u8], &mut Unpacked), bytes: usize, min: bool) -> Gemm512 {
        Gemm512 { unpack: Unpack::Super(unpack, bytes), group: 16, min }
    }

    /// Whether the format's kernels need Q8_K activations ([`XTile::uniform`]): the super-block ones.
    pub fn needs_uniform(&self) -> bool {
        !matches!(self.unpack, Unpack::Blocks32(_))
    }
}

/// Rows of one format unpacked for the kernels (a thread's buffer: [`WRows::unpack`] refills it).
#[derive(Debug, Default, Clone)]
pub struct WRows {
    n: usize,
    rows: usize,
    group: usize,
    min: bool,
    blocks32: bool,
    /// `rows × n` codes.
    codes: Vec<i8>,
    /// `−128 · Σ codes` per group (super-blocks: `rows × n / group`) or per 4-value word (32-value blocks:
    /// `rows × n / 4`).
    neg: Vec<i32>,
    /// `rows × n / 32`: each block's scale (32-value blocks).
    a: Vec<f32>,
    /// `rows × n / group`: integer scale and minimum per group (super-blocks).
    sc: Vec<i32>,
    mn: Vec<i32>,
    /// `rows × n / 256`: `d` and `dmin` per super-block.
    d: Vec<f32>,
    dmin: Vec<f32>,
}

impl WRows {
    /// Unpacks `rows` (each `n` values of the format of `g`, `row_bytes` bytes). Panics when a length disagrees, the
    /// group size is not 16 or 32, or the CPU lacks AVX-512 F/BW/VNNI.
    pub fn unpack(&mut self, g: &Gemm512, rows: &[&[u8]], n: usize, row_bytes: usize) {
        assert!(super::dot512::supported(), "WRows: AVX-512 F/BW/VNNI kernels on a CPU without them");
        assert!(g.group == 16 || g.group == 32, "WRows: groups of 16 or 32 values");
        let blocks32 = matches!(g.unpack, Unpack::Blocks32(_));
        assert!(n.is_multiple_of(if blocks32 { 32 } else { QK_K }), "WRows: whole blocks");
        assert!(!blocks32 || (g.group == 32 && !g.min), "WRows: 32-value blocks have one scale, no minimum");
        let nr = rows.len();
        let (ng, nsb) = (n / g.group, n / QK_K);
        self.n = n;
        self.rows = nr;
        self.group = g.group;
        self.min = g.min;
        self.blocks32 = blocks32;
        self.codes.resize(nr * n, 0);
        if blocks32 {
            self.a.resize(nr * n / 32, 0.0);
            self.neg.resize(nr * n / 4, 0);
        } else {
            self.neg.resize(nr * ng, 0);
            self.sc.resize(nr * ng, 0);
            self.mn.resize(nr * ng, 0);
            self.d.resize(nr * nsb, 0.0);
            self.dmin.resize(nr * nsb, 0.0);
        }
        let mut u = Unpacked::default();
        for (r, row) in rows.iter().enumerate() {
            assert_eq!(row.len(), row_bytes, "WRows: row length");
            let codes = &mut self.codes[r * n..(r + 1) * n];
            match g.unpack {
                // SAFETY (the two arms): the CPU has AVX-512 F/BW/VNNI (asserted above); the registry gives these
                // unpackers to formats whose rows hold `n` values in `row_bytes` bytes (the row length is asserted,
                // and each unpacker asserts its row against its slices); the slices have the lengths the unpackers
                // take (one entry per block, group, super-block).
                Unpack::Blocks32(f) => unsafe { f(row, codes, &mut self.a[r * n / 32..(r + 1) * n / 32]) },
                Unpack::SuperSimd(f) => unsafe {
                    f(
                        row,
                        codes,
                        &mut self.sc[r * ng..(r + 1) * ng],
                        &mut self.mn[r * ng..(r + 1) * ng],
                        &mut self.d[r * nsb..(r + 1) * nsb],
                        &mut self.dmin[r * nsb..(r + 1) * nsb],
                    )
                },
                Unpack::Super(f, bytes) => {
                    assert_eq!(g.group, 16, "scalar super-block unpackers give groups of 16");
                    for (i, b) in row.chunks_exact(bytes).enumerate() {
                        f(b, &mut u);
                        codes[QK_K * i..QK_K * (i + 1)].copy_from_slice(&u.q);
                        for k in 0..16 {
                            self.sc[r * ng + 16 * i + k] = u.sc[k] as i32;
                            self.mn[r * ng + 16 * i + k] = u.mn[k] as i32;
                        }
                        self.d[r * nsb + i] = u.d;
                        self.dmin[r * nsb + i] = u.dmin;
                    }
                }
            }
            let per = if blocks32 { 4 } else { g.group };
            let neg = &mut self.neg[r * n / per..(r + 1) * n / per];
            for (o, c) in neg.iter_mut().zip(codes.chunks_exact(per)) {
                *o = -128 * c.iter().map(|&q| q as i32).sum::<i32>();
            }
        }
    }

    /// `out[r][j]` = row `r` times token `j` of `x` for every unpacked row (at most 4) and the tile's tokens (the
    /// other lanes are 0). Panics when the lengths disagree, more than 4 rows are unpacked, or a super-block
    /// format meets activations without one scale per super-block.
    pub fn times(&self, x: &XTile, out: &mut [[f32; LANES]; 4]) {
        assert!(self.rows <= 4 && x.n == self.n, "WRows::times: at most 4 rows of the tile's length");
        assert!(self.blocks32 || x.uniform, "WRows::times: super-block formats need Q8_K activations");
        assert!(super::dot512::supported(), "WRows: AVX-512 F/BW/VNNI kernels on a CPU without them");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512 F/BW/VNNI (asserted above); the rows were unpacked by `unpack` (group 16 or
        // 32, lengths set for `n`), and the lengths and activations agree (asserted above and in `prepare`).
        unsafe {
            let mut r = 0;
            while r < self.rows {
                let o = &mut out[r..];
                let step = match (self.blocks32, self.rows - r >= 2, self.group, self.min) {
                    (true, true, _, _) => avx512::blocks32::<2>(self, r, x, o),
                    (true, false, _, _) => avx512::blocks32::<1>(self, r, x, o),
                    (false, true, 16, false) => avx512::supers::<2, 16, false>(self, r, x, o),
                    (false, true, 16, true) => avx512::supers::<2, 16, true>(self, r, x, o),
                    (false, true, _, false) => avx512::supers::<2, 32, false>(self, r, x, o),
                    (false, true, _, true) => avx512::supers::<2, 32, true>(self, r, x, o),
                    (false, false, 16, false) => avx512::supers::<1, 16, false>(self, r, x, o),
                    (false, false, 16, true) => avx512::supers::<1, 16, true>(self, r, x, o),
                    (false, false, _, false) => avx512::supers::<1, 32, false>(self, r, x, o),
                    (false, false, _, true) => avx512::supers::<1, 32, true>(self, r, x, o),
                };
                r += step;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AVX-512 kernels off x86-64")
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{WRows, XTile, LANES};

    /// Rows `r0 .. r0 + R` of 32-value blocks times the tile in ggml's order (module docs): per block, word `k`'s
    /// sums of each token into accumulator `k` by `fma` with `d_w · d_x`; at the end the AVX2 lane sum of the 8.
    /// Returns `R`. SAFETY (callers): AVX-512 F/BW/VNNI present; `w.blocks32`, rows `r0 .. r0 + R` unpacked,
    /// `w.n == x.n`, `out.len() ≥ R`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn blocks32<const R: usize>(w: &WRows, r0: usize, x: &XTile, out: &mut [[f32; LANES]]) -> usize {
        let n = w.n;
        let nb = n / 32;
        let mut acc = [[_mm512_setzero_ps(); 8]; R];
        let xu = x.xu.as_ptr();
        for b in 0..nb {
            let xv: [__m512i; 8] =
                std::array::from_fn(|k| _mm512_loadu_si512(xu.add((8 * b + k) * LANES) as *const __m512i));
            let dx = _mm512_loadu_ps(x.d.as_ptr().add(b * LANES));
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = r0 + r;
                let s = _mm512_mul_ps(_mm512_set1_ps(*w.a.get_unchecked(row * nb + b)), dx);
                let codes = w.codes.as_ptr().add(row * n + 32 * b);
                let neg = w.neg.as_ptr().add(row * n / 4 + 8 * b);
                for (k, a) in acc.iter_mut().enumerate() {
                    let wv = std::ptr::read_unaligned(codes.add(4 * k) as *const i32);
                    let ia = _mm512_dpbusd_epi32(_mm512_set1_epi32(*neg.add(k)), xv[k], _mm512_set1_epi32(wv));
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, *a);
                }
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            // the AVX2 lane sum: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
            let (h0, h1) = (_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[1], a[5]));
            let (h2, h3) = (_mm512_add_ps(a[2], a[6]), _mm512_add_ps(a[3], a[7]));
            let t = _mm512_add_ps(_mm512_add_ps(h0, h2), _mm512_add_ps(h1, h3));
            _mm512_storeu_ps(o.as_mut_ptr(), t);
        }
        R
    }

    /// Rows `r0 .. r0 + R` of super-blocks (groups of `G` values, minimums with `MIN`) times the tile: per
    /// super-block and token, Σ sc · (group sum) and Σ mn · (the activations' group sums) as integers, then
    /// `acc += (d · d_x) · Σ` and `accm += (dmin · d_x) · Σ'`; the result `acc − accm`. Returns `R`. SAFETY
    /// (callers): AVX-512 F/BW/VNNI present; `!w.blocks32`, `w.group == G`, `w.min == MIN`, rows `r0 .. r0 + R`
    /// unpacked, `w.n == x.n`, `x.uniform`, `out.len() ≥ R`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn supers<const R: usize, const G: usize, const MIN: bool>(
        w: &WRows,
        r0: usize,
        x: &XTile,
        out: &mut [[f32; LANES]],
    ) -> usize {
        let n = w.n;
        let (ng, nsb) = (n / G, n / 256);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut accm = [_mm512_setzero_ps(); R];
        let xu = x.xu.as_ptr();
        for sb in 0..nsb {
            let mut is = [_mm512_setzero_si512(); R];
            let mut im = [_mm512_setzero_si512(); R];
            for g in sb * (256 / G)..(sb + 1) * (256 / G) {
                let mut gs: [__m512i; R] =
                    std::array::from_fn(|r| _mm512_set1_epi32(*w.neg.get_unchecked((r0 + r) * ng + g)));
                for k in 0..G / 4 {
                    let xv = _mm512_loadu_si512(xu.add((g * G / 4 + k) * LANES) as *const __m512i);
                    for (r, s) in gs.iter_mut().enumerate() {
                        let wv =
                            std::ptr::read_unaligned(w.codes.as_ptr().add((r0 + r) * n + g * G + 4 * k) as *const i32);
                        *s = _mm512_dpbusd_epi32(*s, xv, _mm512_set1_epi32(wv));
                    }
                }
                for (r, s) in gs.iter().enumerate() {
                    let sc = _mm512_set1_epi32(*w.sc.get_unchecked((r0 + r) * ng + g));
                    is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(*s, sc));
                }
                if MIN {
                    let sums = x.sums.as_ptr();
                    let xs = if G == 32 {
                        _mm512_add_epi32(
                            _mm512_loadu_si512(sums.add(2 * g * LANES) as *const __m512i),
                            _mm512_loadu_si512(sums.add((2 * g + 1) * LANES) as *const __m512i),
                        )
                    } else {
                        _mm512_loadu_si512(sums.add(g * LANES) as *const __m512i)
                    };
                    for (r, m) in im.iter_mut().enumerate() {
                        let mn = _mm512_set1_epi32(*w.mn.get_unchecked((r0 + r) * ng + g));
                        *m = _mm512_add_epi32(*m, _mm512_mullo_epi32(xs, mn));
                    }
                }
            }
            // one activation scale per super-block (x.uniform)
            let dx = _mm512_loadu_ps(x.d.as_ptr().add(8 * sb * LANES));
            for r in 0..R {
                let d = _mm512_mul_ps(_mm512_set1_ps(*w.d.get_unchecked((r0 + r) * nsb + sb)), dx);
                acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(is[r]), acc[r]);
                if MIN {
                    let dm = _mm512_mul_ps(_mm512_set1_ps(*w.dmin.get_unchecked((r0 + r) * nsb + sb)), dx);
                    accm[r] = _mm512_fmadd_ps(dm, _mm512_cvtepi32_ps(im[r]), accm[r]);
                }
            }
        }
        for ((o, a), m) in out.iter_mut().zip(acc).zip(accm) {
            _mm512_storeu_ps(o.as_mut_ptr(), if MIN { _mm512_sub_ps(a, m) } else { a });
        }
        R
    }
}

#[cfg(test)]
mod tests {
    use super::{Gemm512, WRows, XTile, LANES};
    use crate::quant::dot_k::tests::{exact, row, values};
    use crate::quant::format::{lookup, REGISTRY};
    use crate::quant::{quantize_q8, quantize_q8_k, BlockQ8};

    /// Every format with a GEMM: 1..=4 rows of random and saturating codes times tiles of 1, 5 and 16 tokens (the
    /// activations its products get: Q8_K for the super-block formats, Q8_0 and Q8_K for the 32-value ones),
    /// against the exact product; the 32-value formats give the AVX2 kernels' bits; a token's result does not
    /// depend on its tile's other tokens.
    #[test]
    fn gemm_matches_the_exact_product_for_every_format() {
        if !crate::quant::dot512::supported() {
            eprintln!("no AVX-512 F/BW/VNNI here: nothing to check");
            return;
        }
        let mut seed = 0x6e33u64;
        let mut seen = 0;
        for f in REGISTRY.iter() {
            let Some(g): Option<Gemm512> = f.q8.and_then(|k| k.gemm512) else { continue };
            seen += 1;
            let ty = f.ty;
            for n_blocks in [1usize, 3] {
                let n = n_blocks * ty.block_size();
                for extreme in [false, true] {
                    let rows: Vec<Vec<u8>> = (0..4).map(|_| row(ty, n_blocks, extreme, &mut seed)).collect();
                    for q8k in [false, true] {
                        if (q8k && !n.is_multiple_of(256)) || (!q8k && g.needs_uniform()) {
                            continue;
                        }
                        let xs: Vec<Vec<BlockQ8>> = (0..16)
                            .map(|_| {
                                let v = values(n, extreme, &mut seed);
                                let mut x = vec![BlockQ8::default(); n / 32];
                                if q8k {
                                    quantize_q8_k(&v, &mut x)
                                } else {
                                    quantize_q8(&v, &mut x)
                                }
                                x
                            })
                            .collect();
                        for nr in 1..=4 {
                            let mut w = WRows::default();
                            let rr: Vec<&[u8]> = rows[..nr].iter().map(|r| &r[..]).collect();
                            w.unpack(&g, &rr, n, ty.row_bytes(n));
                            let mut full = [[0f32; LANES]; 4];
                            for tokens in [16usize, 5, 1] {
                                let xr: Vec<&[BlockQ8]> = xs[..tokens].iter().map(|x| &x[..]).collect();
                                let mut t = XTile::default();
                                t.prepare(&xr);
                                let mut out = [[0f32; LANES]; 4];
                                w.times(&t, &mut out);
                                if tokens == 16 {
                                    full = out;
                                }
                                for r in 0..nr {
                                    for j in 0..tokens {
                                        let (want, mag) = exact(ty, &rows[r], &xs[j]);
                                        let got = out[r][j];
                                        let tol = 2e-6 * mag.max(1e-6);
                                        assert!(
                                            (got as f64 - want).abs() <= tol,
                                            "{ty:?} x{n_blocks} {extreme} q8k {q8k}: row {r} token {j}: {got} vs {want}"
                                        );
                                        assert_eq!(got.to_bits(), full[r][j].to_bits(), "{ty:?}: tile-independent");
                                        if !g.needs_uniform() {
                                            let k = lookup(ty).and_then(|f| f.q8).unwrap();
                                            // SAFETY: AVX-512 F (so AVX2/FMA/F16C) detected; the row holds n values.
                                            let a = unsafe { (k.avx2)(&rows[r], &xs[j]) };
                                            assert_eq!(got.to_bits(), a.to_bits(), "{ty:?}: the AVX2 bits");
                                        }
                                    }
                                    assert!(
                                        out[r][tokens..].iter().all(|&v| v == 0.0),
                                        "{ty:?}: lanes past the tokens"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(seen >= 15, "the K-, IQ- and 32-value formats with a GEMM: {seen}");
    }
}
