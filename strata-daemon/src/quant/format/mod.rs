//! The format registry: one module per block format this build computes with, each a [`Format`] row of
//! [`REGISTRY`] — its GGML type (id, block, bytes per block: [`GgmlType`]), name, dequantization, CPU dot kernels,
//! the activation format its products pair with, and the index and suffix of its CUDA kernels. The rest reads the
//! table: which formats load (and the list named in errors), dequantization and the dot dispatch, the tools'
//! `--type` parsers, the CUDA kernel ids and names. Adding a format = one module here and one row in
//! [`REGISTRY`], plus its kernels where they live: the AVX2 ones in `quant::dot` / `quant::dot_k`, the AVX-512
//! ones in [`super::q4_wide`] (which knows Q4_0 and Q4_1 only: [`Q8Dot::wide`] must stay false for others),
//! [`super::dot512`] ([`Q8Dot::avx512`]) and the prefill GEMM's unpacking ([`Q8Dot::gemm512`]: a
//! [`super::gemm512::Unpack`] — a super-block format with a scalar `unpack` to `kquant::Unpacked` needs only that), the CUDA ones
//! in `kernels/strata.cu` (a block format: its `FMT_*` index, `row_bytes`, `SUB_QK`/`SUB_BYTES`/`SUB_HALVES`/
//! `SUB_MIN`, its cases of `sub_word` and `sub_scales`, and its `#ifdef STRATA_FMT_<suffix>` instantiation; then
//! [`CudaFormat`] with `on_demand` and its [`Prefill`], and [`N_CUDA_FORMATS`]), and `synth-moe`'s random filler if
//! synthetic files should use it.
//!
//! Block layouts follow ggml (`ggml-common.h` and `type_traits` in ggml; llama.cpp's `ggml_type_name` for the
//! names).

pub mod bf16;
pub mod f16;
pub mod f32;
pub mod iq;
pub mod iq1_m;
pub mod iq1_s;
pub mod iq2_s;
pub mod iq2_xs;
pub mod iq2_xxs;
pub mod iq3_s;
pub mod iq3_xxs;
pub mod iq4_nl;
pub mod iq4_xs;
pub mod iq_grid;
pub mod kquant;
pub mod mxfp4;
pub mod q2_k;
pub mod q3_k;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;

use super::{BlockQ8, GgmlType};

/// What a format's matrix products multiply its rows with (ggml's `vec_dot_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// f32 values (the float formats).
    F32,
    /// 8-bit blocks of 32 with an f16 scale (ggml's Q8_0: Q8_0 and Q4_0 rows).
    Q8_0,
    /// Q8_0 plus `s = d·Σq` (ggml's Q8_1: Q4_1 rows, whose minimum multiplies the block sum). [`BlockQ8`] carries
    /// both, so one quantization per token serves every format.
    Q8_1,
    /// ggml's Q8_K: one f32 scale per 256 values (the K-quants, IQ4_XS, the lattice IQ formats), held as
    /// [`BlockQ8`] blocks that share it (`crate::quant::quantize_q8_k`). Their SIMD kernels take only these; other
    /// activations go through the scalar reference (`crate::quant::is_q8_k`).
    Q8K,
}

/// Dot products of one format's rows with 8-bit activations ([`BlockQ8`], `x.len()` blocks of 32): `fn(row, x)`
/// for a row of `x.len() · 32` elements, and four rows at once (bit-identical to four single calls). The SIMD
/// kernels of the formats whose [`Activation`] is Q8K take Q8_K activations only (each super-block's 8 blocks
/// sharing one scale, which they apply once per super-block); the dispatch (`crate::quant::dot_q8`) sends other
/// activations to the scalar reference, which takes any.
#[derive(Debug, Clone, Copy)]
pub struct Q8Dot {
    /// The scalar reference.
    pub scalar: fn(&[u8], &[BlockQ8]) -> f32,
    /// AVX2 + FMA + F16C, one row. Safety: callable only where those features were detected; `row` holds
    /// `x.len()` whole blocks.
    #[cfg(target_arch = "x86_64")]
    pub avx2: unsafe fn(&[u8], &[BlockQ8]) -> f32,
    /// AVX2 + FMA + F16C, four rows (same contract).
    #[cfg(target_arch = "x86_64")]
    pub avx2_x4: unsafe fn([&[u8]; 4], &[BlockQ8]) -> [f32; 4],
    /// AVX2 + FMA + F16C, one row with four tokens' activations (`fn(row, [x0, x1, x2, x3])`, each result bit for
    /// bit the single-row kernel's; same contract for every `x[t]`): the row's codes are unpacked once for the four.
    /// `None`: the format has none (prefill products unpack a row per token).
    #[cfg(target_arch = "x86_64")]
    pub avx2_t4: Option<unsafe fn(&[u8], [&[BlockQ8]; 4]) -> [f32; 4]>,
    /// The same with eight tokens (the unpacking shared by eight): Q5_0, whose expansion of the fifth bits made its
    /// prompt products half of Gemma 3 270M's prompt time with AVX2 (+18–21% prompt rate with it, stop 55; the same for
    /// Q4_K, Q5_K and Q6_K measured no gain). `None`: the four-token kernel (or the row kernel) serves.
    #[cfg(target_arch = "x86_64")]
    pub avx2_t8: Option<unsafe fn(&[u8], [&[BlockQ8]; 8]) -> [f32; 8]>,
    /// Rows also go through the AVX-512 VNNI kernel ([`super::q4_wide`], Q4_0 and Q4_1 only) where the CPU has it.
    pub wide: bool,
    /// AVX-512 F/BW/VNNI row kernels over activations laid out once per token and task ([`super::dot512`],
    /// bit-identical to the AVX2 ones): where the CPU has them ([`crate::quant::SimdLevel::Avx512`]) tasks of 32+
    /// rows go through them (Q5_0, Q8_0). `None`: the AVX2 kernels serve at that level too.
    #[cfg(target_arch = "x86_64")]
    pub avx512: Option<super::dot512::Dot512>,
    /// The AVX-512 prefill product ([`super::gemm512`]: tokens in the vector lanes) — how the format's rows unpack
    /// into integer codes and per-group scales. `None`: prefill products use the row kernels.
    #[cfg(target_arch = "x86_64")]
    pub gemm512: Option<super::gemm512::Gemm512>,
}

/// The CUDA kernels of a format (`strata.cu`): its `FMT_*` index, the suffix of its kernels' names
/// (`mmv_<suffix>`, ...) and which kernel families it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaFormat {
    /// `FMT_*` index in the kernels (0 .. [`N_CUDA_FORMATS`]).
    pub index: usize,
    /// Kernel name suffix.
    pub suffix: &'static str,
    /// The format has the narrow one-token expert kernels (`*_t1n`: the block formats).
    pub narrow: bool,
    /// Its prefill product (chunks of more than 8 tokens).
    pub prefill: Prefill,
    /// Its kernels are compiled only into modules for models that use it (the sub-block formats; see
    /// `backend::cuda::kernels::FormatSet`), which keeps the base module's compile time.
    pub on_demand: bool,
}

/// The CUDA prefill product of a format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefill {
    /// Int8 tensor-core MMA over the Q8 activations (`mmq_*`, and the grouped expert kernels `expert_*_mmq_*`).
    Mmq,
    /// Tiled f32 on CUDA cores (`mmf_*`: the float formats).
    Float,
    /// None: the small-batch row kernels, 8 tokens per pass (Q2_K, whose per-16 minimums the MMA kernels lack).
    Rows,
}

/// One block format.
#[derive(Debug, Clone, Copy)]
pub struct Format {
    /// The GGML type (id, elements per block, bytes per block).
    pub ty: GgmlType,
    /// Name as llama.cpp's `ggml_type_name`, lower case (`q4_0`); the tools' `--type` values.
    pub name: &'static str,
    /// What its products multiply rows with.
    pub activation: Activation,
    /// Dequantizes whole blocks: `src` holds `dst.len() / block` blocks (callers check the lengths).
    pub dequantize: fn(&[u8], &mut [f32]),
    /// Dot products with 8-bit activations (block formats).
    pub q8: Option<Q8Dot>,
    /// Dot product of a row with f32 activations (float formats; `row` holds `x.len()` elements).
    pub f32_dot: Option<fn(&[u8], &[f32]) -> f32>,
    /// Four rows of `x.len()` elements each times `x` (float formats): each result the bits of `f32_dot` for its
    /// row, computed together where the CPU allows ([`crate::quant::fdot`]).
    pub f32_dot4: Option<fn([&[u8]; 4], &[f32]) -> [f32; 4]>,
    /// Its CUDA kernels.
    pub cuda: Option<CudaFormat>,
}

/// Every format this build computes with: those with CUDA kernels first, in `FMT_*` order, then the CPU-only ones.
pub const REGISTRY: &[&Format] = &[
    &f32::FORMAT,
    &f16::FORMAT,
    &bf16::FORMAT,
    &q8_0::FORMAT,
    &q4_0::FORMAT,
    &q4_1::FORMAT,
    &q5_0::FORMAT,
    &q5_1::FORMAT,
    &q2_k::FORMAT,
    &q3_k::FORMAT,
    &q4_k::FORMAT,
    &q5_k::FORMAT,
    &q6_k::FORMAT,
    &iq4_nl::FORMAT,
    &iq4_xs::FORMAT,
    &mxfp4::FORMAT,
    &iq2_xxs::FORMAT,
    &iq2_xs::FORMAT,
    &iq2_s::FORMAT,
    &iq3_xxs::FORMAT,
    &iq3_s::FORMAT,
    &iq1_s::FORMAT,
    &iq1_m::FORMAT,
];

/// Formats with CUDA kernels (the length of the kernels' per-format tables).
pub const N_CUDA_FORMATS: usize = 23;

/// The registry indexed by GGML type id (ids up to 39, MXFP4).
const BY_ID: [Option<&Format>; 40] = {
    let mut t: [Option<&Format>; 40] = [None; 40];
    let mut i = 0;
    while i < REGISTRY.len() {
        t[REGISTRY[i].ty as usize] = Some(REGISTRY[i]);
        i += 1;
    }
    t
};

/// The row of `ty`; `None` when this build cannot compute with it.
#[inline]
pub fn lookup(ty: GgmlType) -> Option<&'static Format> {
    BY_ID.get(ty as usize).copied().flatten()
}

/// The row named `name` (case-insensitive: `q4_0`, `Q4_0`); `None` for a format this build lacks.
pub fn by_name(name: &str) -> Option<&'static Format> {
    REGISTRY.iter().copied().find(|f| f.name.eq_ignore_ascii_case(name.trim()))
}

/// The names of every format, for error messages (`F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, ...`).
pub fn supported_list() -> String {
    REGISTRY.iter().map(|f| f.name.to_ascii_uppercase()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_consistent() {
        let mut cuda = Vec::new();
        for f in REGISTRY {
            assert_eq!(lookup(f.ty).map(|g| g.name), Some(f.name));
            assert_eq!(by_name(&f.name.to_ascii_uppercase()).map(|g| g.ty), Some(f.ty));
            assert_eq!(f.q8.is_some(), f.activation != Activation::F32, "{}", f.name);
            assert_eq!(f.f32_dot.is_some(), f.activation == Activation::F32, "{}", f.name);
            if let Some(c) = f.cuda {
                assert_eq!(cuda.len(), REGISTRY.iter().position(|g| g.ty == f.ty).unwrap(), "CUDA formats first");
                cuda.push(c.index);
                assert_eq!(c.suffix, f.name, "kernel names use the format's name");
                // the staged and narrow kernels: the base block formats; the sub-block ones compile on demand
                assert_eq!(c.narrow, f.q8.is_some() && !c.on_demand, "{}: narrow kernels", f.name);
                assert_eq!(c.on_demand, c.index >= 6, "{}: the base formats are FMT_* 0..6", f.name);
                assert_eq!(c.prefill == Prefill::Float, f.activation == Activation::F32, "{}", f.name);
            }
        }
        assert_eq!(cuda, (0..N_CUDA_FORMATS).collect::<Vec<_>>(), "CUDA indices in registry order");
        assert!(lookup(GgmlType::Q8_1).is_none() && by_name("q8_1").is_none() && by_name("q4_2").is_none());
        assert_eq!(
            supported_list(),
            "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, IQ2_XXS, \
             IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M"
        );
    }

    #[test]
    fn every_format_dequantizes_a_known_block() {
        // one block of each format whose values are known from its layout (ggml-common.h)
        let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
        let half_ = half::f16::from_f32(0.5).to_bits().to_le_bytes();
        let mut out = [0f32; 32];
        // Q8_0: d = 0.5, qs = -16..16
        let mut b = vec![half_[0], half_[1]];
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        (q8_0::FORMAT.dequantize)(&b, &mut out);
        assert!(out.iter().enumerate().all(|(j, &v)| v == (j as f32 - 16.0) * 0.5));
        // Q4_0: d = 1, low nibbles j, high nibbles 15 - j (value = code - 8)
        let mut b = vec![one[0], one[1]];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        (q4_0::FORMAT.dequantize)(&b, &mut out);
        assert!((0..16).all(|j| out[j] == j as f32 - 8.0 && out[j + 16] == (15 - j) as f32 - 8.0));
        // Q4_1: d = 0.5, m = 1, value = code · d + m
        let mut b = vec![half_[0], half_[1], one[0], one[1]];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        (q4_1::FORMAT.dequantize)(&b, &mut out);
        assert!((0..16).all(|j| out[j] == j as f32 * 0.5 + 1.0 && out[j + 16] == (15 - j) as f32 * 0.5 + 1.0));
        // the float formats, element by element
        let mut o = [0f32; 2];
        (f32::FORMAT.dequantize)(&[0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0], &mut o);
        assert_eq!(o, [1.0, -2.0]);
        (f16::FORMAT.dequantize)(&[one[0], one[1], half_[0], half_[1]], &mut o);
        assert_eq!(o, [1.0, 0.5]);
        (bf16::FORMAT.dequantize)(&[0x80, 0x3f, 0x00, 0xc0], &mut o);
        assert_eq!(o, [1.0, -2.0]);
    }
}
