//! The kernels of `kernels/strata.cu`: compiled by NVRTC for the card's architecture (a CUBIN) on first use
//! and cached on disk under `$STRATA_KERNEL_CACHE` (default `~/.cache/strata/kernels`) as
//! `<FNV-1a 64 of source and options>-<arch>.cubin`; loaded into the current context.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc;

use super::driver::{check, Func};
use super::GpuError;
use crate::quant::format::Prefill;
use crate::quant::GgmlType;

/// The kernel source (embedded at build time).
pub const SOURCE: &str = include_str!("../../../../kernels/strata.cu");

/// NVRTC options besides the architecture.
const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// The cache directory.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STRATA_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".cache/strata/kernels")
}

/// Compiles `src` with NVRTC for `arch` (e.g. `sm_90`) to a CUBIN, with the extra options `defines` (`-D...`) and
/// the in-memory `headers` (name, text) its `#include`s may name. Errors: NVRTC missing or the compile failed (the
/// log is in the error).
pub fn compile(src: &str, arch: &str, defines: &[String], headers: &[(String, String)]) -> Result<Vec<u8>, GpuError> {
    let csrc = CString::new(src).map_err(|_| GpuError::Nvrtc("source has a NUL byte".into()))?;
    let nul = |_| GpuError::Nvrtc("header has a NUL byte".into());
    let hnames: Vec<CString> =
        headers.iter().map(|(n, _)| CString::new(n.as_str())).collect::<Result<_, _>>().map_err(nul)?;
    let htexts: Vec<CString> =
        headers.iter().map(|(_, t)| CString::new(t.as_str())).collect::<Result<_, _>>().map_err(nul)?;
    let hnp: Vec<*const std::ffi::c_char> = hnames.iter().map(|s| s.as_ptr()).collect();
    let htp: Vec<*const std::ffi::c_char> = htexts.iter().map(|s| s.as_ptr()).collect();
    let opts: Vec<CString> = std::iter::once(format!("--gpu-architecture={arch}"))
        .chain(OPTIONS.iter().map(|s| s.to_string()))
        .chain(defines.iter().cloned())
        .map(|s| CString::new(s).expect("option"))
        .collect();
    let optp: Vec<*const std::ffi::c_char> = opts.iter().map(|s| s.as_ptr()).collect();
    let name = CString::new("strata.cu").expect("name");
    // SAFETY: NVRTC calls with valid C strings and out-pointers; the program is destroyed on every path.
    unsafe {
        let mut prog = std::ptr::null_mut();
        let r = nvrtc::nvrtcCreateProgram(
            &mut prog,
            csrc.as_ptr(),
            name.as_ptr(),
            hnp.len() as i32,
            if hnp.is_empty() { std::ptr::null() } else { htp.as_ptr() },
            if hnp.is_empty() { std::ptr::null() } else { hnp.as_ptr() },
        );
        if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            return Err(GpuError::Nvrtc(format!("nvrtcCreateProgram: {r:?}")));
        }
        let r = nvrtc::nvrtcCompileProgram(prog, optp.len() as i32, optp.as_ptr());
        let mut n = 0usize;
        nvrtc::nvrtcGetProgramLogSize(prog, &mut n);
        let mut log = vec![0 as std::ffi::c_char; n.max(1)];
        nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr());
        let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
        if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            nvrtc::nvrtcDestroyProgram(&mut prog);
            return Err(GpuError::Nvrtc(format!("compile for {arch} failed ({r:?}):\n{log}")));
        }
        let mut size = 0usize;
        let r = nvrtc::nvrtcGetCUBINSize(prog, &mut size);
        if r != nvrtc::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            nvrtc::nvrtcDestroyProgram(&mut prog);
            return Err(GpuError::Nvrtc(format!("no CUBIN for {arch} ({r:?})")));
        }
        let mut cubin = vec![0u8; size];
        nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut std::ffi::c_char);
        nvrtc::nvrtcDestroyProgram(&mut prog);
        Ok(cubin)
    }
}

/// The kernel source to compile: [`SOURCE`], or for kernel development the file named by
/// `STRATA_KERNEL_SOURCE` (it must define every kernel with the same parameters; errors if it cannot be read).
fn source() -> Result<std::borrow::Cow<'static, str>, GpuError> {
    match std::env::var_os("STRATA_KERNEL_SOURCE") {
        Some(p) => std::fs::read_to_string(&p)
            .map(|s| {
                tracing::warn!(
                    "kernel source from STRATA_KERNEL_SOURCE={} (not the embedded one)",
                    p.to_string_lossy()
                );
                s.into()
            })
            .map_err(|e| GpuError::Nvrtc(format!("STRATA_KERNEL_SOURCE={}: {e}", p.to_string_lossy()))),
        None => Ok(SOURCE.into()),
    }
}

/// The formats a kernel module holds, a bit per `FMT_*` index: the base formats always, the on-demand ones
/// ([`crate::quant::format::CudaFormat::on_demand`]: the sub-block formats) only where named, so that a module
/// built for a model compiles no kernels its file does not use (NVRTC for sm_90 on a 2-core VM: the base module
/// with Q4_K and Q6_K, a Q4_K_M file's, 69 s; with all ten on-demand formats, as `gpu-check` builds, 102 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormatSet(u32);

impl FormatSet {
    /// The base formats only.
    pub fn base() -> FormatSet {
        FormatSet(cuda_formats().iter().filter(|f| !f.on_demand).fold(0, |m, f| m | 1 << f.index))
    }
    /// Every format with CUDA kernels.
    pub fn all() -> FormatSet {
        FormatSet(cuda_formats().iter().fold(0, |m, f| m | 1 << f.index))
    }
    /// The module a model's stage loads: the base formats and those of the model's matrices that have CUDA kernels
    /// (a matrix of a format without them is refused where its weights are uploaded). The kernel cache's file
    /// name depends on this set, so `strata-tools build-kernels --model` calls it too.
    pub fn of_model(weights: &crate::arch::weights::Weights) -> FormatSet {
        let types = weights.matrices().into_iter().map(|w| w.ty).filter(|&ty| fmt_index(ty).is_ok());
        types.fold(FormatSet::base(), |s, ty| FormatSet(s.0 | fmt_index(ty).map_or(0, |i| 1 << i)))
    }
    /// Whether the module holds the kernels of format index `i`.
    pub fn has(self, i: usize) -> bool {
        self.0 >> i & 1 == 1
    }
    /// The NVRTC options that compile the on-demand formats of the set (`-DSTRATA_FMT_<suffix>`).
    fn defines(self) -> Vec<String> {
        cuda_formats()
            .iter()
            .filter(|f| f.on_demand && self.has(f.index))
            .map(|f| format!("-DSTRATA_FMT_{}", f.suffix))
            .collect()
    }
    /// The generated headers the set's kernels include: the lattice formats' grids (`strata_iq_grids.h`).
    fn headers(self) -> Vec<(String, String)> {
        let lattice = crate::quant::format::iq::TYPES.iter().any(|&t| fmt_index(t).is_ok_and(|i| self.has(i)));
        if lattice {
            vec![("strata_iq_grids.h".to_string(), crate::quant::format::iq_grid::cuda_header())]
        } else {
            Vec::new()
        }
    }
}

/// The CUBIN for `arch` holding the kernels of `formats`, from the disk cache or compiled (and then cached; a
/// cache that cannot be written is only a warning); `mmq_pipe`: with the pipelined tensor-core loop (see
/// [`mmq_pipe_on`]). Returns the image and whether it came from the cache. Errors: NVRTC's.
pub fn cubin(arch: &str, formats: FormatSet, mmq_pipe: bool) -> Result<(Vec<u8>, bool), GpuError> {
    let (key, img) = cache_lookup(arch, formats, mmq_pipe)?;
    if let Some(img) = img {
        return Ok((img, true));
    }
    let t = std::time::Instant::now();
    let img = compile(&key.src, arch, &key.defines, &key.headers)?;
    tracing::info!("kernels compiled by NVRTC for {arch} in {:.2} s", t.elapsed().as_secs_f64());
    let tmp = key.path.with_extension("tmp");
    let write = std::fs::create_dir_all(cache_dir())
        .and_then(|_| std::fs::write(&tmp, &img))
        .and_then(|_| std::fs::rename(&tmp, &key.path));
    if let Err(e) = write {
        tracing::warn!("kernel cache {} not written: {e}", key.path.display());
    }
    Ok((img, false))
}

/// The CUBIN [`cubin`] would return, when the disk cache holds it (`None`: it would be compiled). Errors: the
/// kernel source cannot be read.
pub fn cached_cubin(arch: &str, formats: FormatSet, mmq_pipe: bool) -> Result<Option<Vec<u8>>, GpuError> {
    Ok(cache_lookup(arch, formats, mmq_pipe)?.1)
}

/// What a module is compiled from, and where the disk cache keeps it.
struct CacheKey {
    src: std::borrow::Cow<'static, str>,
    defines: Vec<String>,
    headers: Vec<(String, String)>,
    path: std::path::PathBuf,
}

/// The cache entry of (`arch`, `formats`, `mmq_pipe`) and its image when the cache holds a valid one.
fn cache_lookup(arch: &str, formats: FormatSet, mmq_pipe: bool) -> Result<(CacheKey, Option<Vec<u8>>), GpuError> {
    let src = source()?;
    let mut defines = formats.defines();
    if !mmq_pipe {
        defines.push("-DSTRATA_MMQ_PIPE=0".into());
    }
    let headers = formats.headers();
    let htext: String = headers.iter().map(|(n, t)| format!("{n}\n{t}")).collect();
    let (opts, defs) = (OPTIONS.join(" "), defines.join(" "));
    let mut parts = vec![src.as_bytes(), opts.as_bytes(), arch.as_bytes(), defs.as_bytes()];
    if !htext.is_empty() {
        parts.push(htext.as_bytes()); // (modules without headers keep their earlier keys)
    }
    let key = fnv1a(&parts);
    let path = cache_dir().join(format!("{key:016x}-{arch}.cubin"));
    let img = std::fs::read(&path).ok().filter(|b| b.len() > 4 && &b[..4] == b"\x7fELF");
    Ok((CacheKey { src, defines, headers, path }, img))
}

/// Every kernel of the module.
pub struct Kernels {
    module: sys::CUmodule,
    /// Dense products per weight format.
    mmv: [Option<Func>; N],
    /// Expert gate/up per format.
    gate_up: [Option<Func>; N],
    /// Expert down per format.
    down: [Option<Func>; N],
    /// One-token variants (`_t1`) of the three above: fewer registers, so more warps per SM in decode.
    mmv1: [Option<Func>; N],
    gate_up1: [Option<Func>; N],
    down1: [Option<Func>; N],
    /// The prefill products: tensor-core `mmq_*` for formats of [`Prefill::Mmq`], the tiled f32 `mmf_*` for the
    /// float formats (None: off, see [`mmq_wanted`], or a format of [`Prefill::Rows`]).
    mmq: [Option<Func>; N],
    /// The wide tensor-core prefill products (`mmq_*_w`: 2 × MQ_BM rows per block; None: off, see
    /// [`mmq_wide_wanted`]).
    mmq_w: [Option<Func>; N],
    /// Blocks the whole card runs at once of `mmq` (the SMs times the driver's blocks per SM at the launches'
    /// shared memory; 0 where there is no kernel): the split-K choice of [`super::ops::mq_split_count`].
    mmq_slots: [u32; N],
    /// The same for `mmq_w`.
    mmq_w_slots: [u32; N],
    /// The float formats' prefill products for matrices of few rows (`mmf_*_r16`: 16 rows per block).
    mmf16: [Option<Func>; N],
    /// The float formats' split-K prefill products (`mmf_split_*`: a router over a prefill chunk).
    mmf_split: [Option<Func>; N],
    /// `mmf_sum_split` (adds the split-K partials).
    pub mmf_sum_split: Func,
    /// The tensor-core expert gate/up and down kernels over `group_by_expert`'s tiles (as `mmq`).
    gate_up_mmq: [Option<Func>; N],
    down_mmq: [Option<Func>; N],
    /// The narrow one-token gate/up and down kernels (`_t1n`, block formats; see [`narrow_wanted`]).
    gate_up1n: [Option<Func>; N],
    down1n: [Option<Func>; N],
    /// `quantize_q8`.
    pub quantize_q8: Func,
    /// `rms_norm_q8`.
    pub rms_norm_q8: Func,
    /// `rms_norm_q8_cluster` where it applies (see [`cluster_norm_wanted`]).
    pub rms_norm_q8_cluster: Option<Func>,
    /// `rms_norm_q8_warps` (the cluster kernel's bits from one warp per slice of a row, for prefill chunks) where
    /// the cluster kernel applies, unless `STRATA_GPU_NORM_ROWS=0` (see [`norm_rows_wanted`]).
    pub rms_norm_q8_warps: Option<Func>,
    /// `qkv_prep` (biases and q/k norms before RoPE).
    pub qkv_prep: Func,
    /// `rope_store`.
    pub rope_store: Func,
    /// `rope_store_q8` (RoPE and the store into a Q8_0 KV cache).
    pub rope_store_q8: Func,
    /// `qkv_rope_store` (`qkv_prep` modes 0 and 1 with `rope_store`, one warp per head) unless [`fuse_wanted`]
    /// says no (None then, or where an older `STRATA_KERNEL_SOURCE` lacks it).
    pub qkv_rope_store: Option<Func>,
    /// `route_f32_t1` (a decode token's f32 router product and top-k in one launch), as `qkv_rope_store`.
    pub route_f32_t1: Option<Func>,
    /// `gated_add` (a shared expert's output into the residual).
    pub gated_add: Func,
    /// `attention`.
    pub attention: Func,
    /// `attention_q8` (the one-block kernel over a Q8_0 KV cache).
    pub attention_q8: Func,
    /// `attention_split` (split-K partials of a long context's few query rows).
    pub attention_split: Func,
    /// `attention_split_q8` (the same over a Q8_0 KV cache).
    pub attention_split_q8: Func,
    /// `attention_combine` (merges `attention_split`'s partials).
    pub attention_combine: Func,
    /// `attention_decode_<hd>` for the head sizes of [`DECODE_HEAD_SIZES`] (None: off, see
    /// [`decode_attention_wanted`], or the card cannot give a block its shared memory).
    attention_decode: [Option<Func>; DECODE_HEAD_SIZES.len()],
    /// `attention_decode_q8_<hd>` (over a Q8_0 KV cache).
    attention_decode_q8: [Option<Func>; DECODE_HEAD_SIZES.len()],
    /// `attention_tiled_<hd>` for the head sizes of [`TILED_HEAD_SIZES`] (None: off, see [`tiled_attention_wanted`]).
    attention_tiled: [Option<Func>; TILED_HEAD_SIZES.len()],
    /// `attention_tiled_q8_<hd>` (over a Q8_0 KV cache; head sizes that are multiples of 32).
    attention_tiled_q8: [Option<Func>; TILED_HEAD_SIZES.len()],
    /// `route_topk`.
    pub route_topk: Func,
    /// The module holds the pipelined tensor-core loop (see [`mmq_pipe_on`]; [`super::ops::mq_smem`] sizes the
    /// launches by it).
    pub mmq_pipe: bool,
    /// Dense prefill products may split over their columns ([`mmq_split_wanted`] at load).
    pub mmq_split: bool,
    /// `group_by_expert` (a prefill chunk's groups, per expert, on the device).
    pub group_by_expert: Func,
    /// `swiglu`.
    pub swiglu: Func,
    /// `expert_down_bias` (the experts' down biases into their output rows).
    pub expert_down_bias: Func,
    /// `add_bias` (a projection's bias into its output rows).
    pub add_bias: Func,
}

// SAFETY: module and function handles are immutable and usable from any thread with the context current.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// Whether kernels are launched with programmatic dependent launch: compute capability 9.0 or newer (the
/// `griddepcontrol` instructions) unless `STRATA_GPU_PDL=0`.
pub fn pdl_wanted(cc: (i32, i32)) -> bool {
    cc.0 >= 9 && !std::env::var("STRATA_GPU_PDL").is_ok_and(|v| v == "0")
}

/// Whether the norms run as thread-block clusters of `NORM_CLUSTER` blocks per row (`rms_norm_q8_cluster`; prefill
/// chunks take `rms_norm_q8_warps`, its bits from one block per row, see [`norm_rows_wanted`]): compute capability 9.0
/// or newer unless `STRATA_GPU_NORM_CLUSTER=0` (then one block per row).
pub fn cluster_norm_wanted(cc: (i32, i32)) -> bool {
    cc.0 >= 9 && !std::env::var("STRATA_GPU_NORM_CLUSTER").is_ok_and(|v| v == "0")
}

/// Whether prefill chunks' norms (more than [`super::ops::MAX_NT`] rows) run `rms_norm_q8_warps` where the cluster
/// norm runs (the same bits; one block of `NORM_CLUSTER` warps per row, each doing a cluster block's slice, in place
/// of a cluster of `NORM_CLUSTER` blocks): unless `STRATA_GPU_NORM_ROWS=0` (A/B measurements).
pub fn norm_rows_wanted() -> bool {
    !std::env::var("STRATA_GPU_NORM_ROWS").is_ok_and(|v| v == "0")
}

/// Whether the fused kernels that save a launch per layer run where they apply: `qkv_rope_store` (a layer's
/// biases and q/k norms with RoPE and the KV store) and `route_f32_t1` (a decode token's f32 router product with
/// its top-k); unless `STRATA_GPU_FUSE=0` (then the launches each replaces, with the same bits; for A/B
/// measurements).
pub fn fuse_wanted() -> bool {
    !std::env::var("STRATA_GPU_FUSE").is_ok_and(|v| v == "0")
}

/// Whether dense products of more than [`super::ops::MAX_NT`] tokens, and the experts of all-VRAM prefill chunks,
/// run the tensor-core kernels (`mmq_*`, `expert_*_mmq_*`) in the formats that have them: unless
/// `STRATA_GPU_MMQ=0` (then the row kernels over groups of up to MAX_NT tokens; for A/B measurements).
pub fn mmq_wanted() -> bool {
    !std::env::var("STRATA_GPU_MMQ").is_ok_and(|v| v == "0")
}

/// Whether dense prefill products may run the wide tensor-core kernels (`mmq_*_w`: each warp's 16 rows and 16 more
/// against the same token fragments, 128 rows per block) in the formats that suit them
/// ([`super::ops::mq_wide_fits`]): on cards of compute capability 9.0 or newer (228 KiB of shared memory per SM: two
/// wide blocks fit, where an A100's 164 KiB holds one; measured on the H100) unless `STRATA_GPU_MMQ_WIDE=0` (A/B
/// measurements; the same bits either way).
pub fn mmq_wide_wanted(cc: (i32, i32)) -> bool {
    cc.0 >= 9 && !std::env::var("STRATA_GPU_MMQ_WIDE").is_ok_and(|v| v == "0")
}

/// Whether the tensor-core products of the pipelined formats ([`super::ops::mq_pipe_sa`]: Q8_0, Q4_0, Q4_1, Q5_0,
/// Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) copy their operands into shared memory while they multiply the
/// previous ones (`mq_core_pipe`, cp.async): on a card whose blocks may opt into
/// `max_smem_optin` bytes of shared memory, when the largest pipeline ([`super::ops::MQ_PIPE_MAX_SMEM`], plus the
/// kernels' static shared memory) fits — the H100/H200 and A100 (227 / 163 KiB) yes, cards of 99 KiB (RTX 30-50,
/// L4, L40S) no — and unless `STRATA_GPU_MMQ_PIPE=0` (for A/B measurements). Otherwise `mq_core`, which reads the
/// weights straight from global memory; the same bits either way.
pub fn mmq_pipe_on(max_smem_optin: i32) -> bool {
    max_smem_optin.max(0) as usize >= super::ops::MQ_PIPE_MAX_SMEM + 4096
        && !std::env::var("STRATA_GPU_MMQ_PIPE").is_ok_and(|v| v == "0")
}

/// Whether dense tensor-core prefill products of few blocks run split over their columns (`mmq_*` with a grid of
/// several column ranges + `mmf_sum_split`; see [`super::ops::mq_split_count`]): unless `STRATA_GPU_MMQ_SPLIT=0`
/// (then one range per block, for A/B measurements).
pub fn mmq_split_wanted() -> bool {
    !std::env::var("STRATA_GPU_MMQ_SPLIT").is_ok_and(|v| v == "0")
}

/// Whether a router's prefill product runs split over its columns (`mmf_split_*` + `mmf_sum_split`): unless
/// `STRATA_GPU_ROUTER_SPLIT=0` (then the 16-rows-per-block kernel; for A/B measurements).
pub fn mmf_split_wanted() -> bool {
    !std::env::var("STRATA_GPU_ROUTER_SPLIT").is_ok_and(|v| v == "0")
}

/// Whether the card runs the tensor-core kernels (`mma.sync` int8 and f16 tiles: compute capability 8.0 or newer);
/// older cards keep the row kernels and the one-block attention.
pub fn tensor_cores_ok(cc: (i32, i32)) -> bool {
    cc.0 >= 8
}

/// Head sizes with a tiled prefill attention kernel (`attention_tiled_<hd>` in strata.cu).
pub const TILED_HEAD_SIZES: [usize; 4] = [64, 80, 96, 128];

/// The kernel of `funcs` (one per entry of `sizes`) for head size `hd`: None where `sizes` lacks it or the slot
/// is empty.
fn by_head_size(sizes: &[usize], funcs: &[Option<Func>], hd: usize) -> Option<Func> {
    sizes.iter().position(|&h| h == hd).and_then(|i| funcs[i])
}

/// Head sizes with a KV-head-grouped decode attention kernel (`attention_decode_<hd>` in strata.cu).
pub const DECODE_HEAD_SIZES: [usize; 4] = [64, 80, 96, 128];

/// Whether long-context decode windows use the KV-head-grouped split attention (`attention_decode_*`, see
/// [`super::ops::Ops::attention`]): unless `STRATA_GPU_ATT_DECODE=0` (then `attention_split`, one block per query
/// head; for A/B measurements).
pub fn decode_attention_wanted() -> bool {
    !std::env::var("STRATA_GPU_ATT_DECODE").is_ok_and(|v| v == "0")
}

/// Whether prefill chunks use the tiled tensor-core attention (`attention_tiled_*`): unless
/// `STRATA_ATTN_TILED=0` (then the one-block kernel, the CPU's scores bit for bit; for A/B measurements).
pub fn tiled_attention_wanted() -> bool {
    !std::env::var("STRATA_ATTN_TILED").is_ok_and(|v| v == "0")
}

/// Whether one-token expert products of narrow experts use the `_t1n` kernels (gate/up: two indices per warp;
/// down: NARROW_RPW rows per warp, staged before the wait on the gate/up kernel): unless `STRATA_GPU_NARROW=0`
/// (for A/B measurements).
pub fn narrow_wanted() -> bool {
    !std::env::var("STRATA_GPU_NARROW").is_ok_and(|v| v == "0")
}

/// Format index used by the kernels (FMT_* in strata.cu), from the format registry. Errors: a format without GPU
/// kernels.
pub fn fmt_index(ty: GgmlType) -> Result<usize, GpuError> {
    crate::quant::format::lookup(ty)
        .and_then(|f| f.cuda)
        .map(|c| c.index)
        .ok_or_else(|| GpuError::Unsupported(format!("no GPU kernel for {ty:?}")))
}

/// A kernel of `ty` the module was looked up for. Errors: the module was built without that format's kernels
/// (see [`FormatSet`]).
fn held(ty: GgmlType, f: Option<Func>) -> Result<Func, GpuError> {
    f.ok_or_else(|| GpuError::Unsupported(format!("the kernel module was built without the {ty:?} kernels")))
}

/// The registry's formats with CUDA kernels, by `FMT_*` index.
fn cuda_formats() -> [crate::quant::format::CudaFormat; N] {
    let mut v: Vec<_> = crate::quant::format::REGISTRY.iter().filter_map(|f| f.cuda).collect();
    v.sort_by_key(|c| c.index);
    v.try_into().expect("the registry's CUDA indices are 0..N_CUDA_FORMATS")
}

const N: usize = crate::quant::format::N_CUDA_FORMATS;

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

impl Kernels {
    /// Loads `image` (a CUBIN holding the kernels of `formats`, see [`cubin`]) into the current context
    /// and looks every kernel up; `pdl`: launch them with
    /// programmatic dependent launch (see [`pdl_wanted`]); `cluster_norm`: use the cluster norm (see
    /// [`cluster_norm_wanted`]); `narrow`: use the narrow expert kernels (see [`narrow_wanted`]); `tensor_cores`:
    /// the card has them (see [`tensor_cores_ok`]; without, the prefill keeps the row kernels); `mmq_pipe`: the
    /// image was compiled with the pipelined tensor-core loop (the `mmq_pipe` given to [`cubin`]); `mmq_wide`: look
    /// up the wide dense prefill kernels of the formats that suit them (see [`mmq_wide_wanted`]; a format whose
    /// module lacks them, as a `STRATA_KERNEL_SOURCE` of an earlier build, keeps the narrow ones).
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        image: &[u8],
        formats: FormatSet,
        mmq_pipe: bool,
        max_smem_optin: i32,
        pdl: bool,
        cluster_norm: bool,
        narrow: bool,
        tensor_cores: bool,
        mmq_wide: bool,
    ) -> Result<Kernels, GpuError> {
        let mut module = std::ptr::null_mut();
        // SAFETY: image is a complete CUBIN produced by NVRTC (checked ELF magic or just compiled).
        unsafe { check("cuModuleLoadData", sys::cuModuleLoadData(&mut module, image.as_ptr() as *const _))? };
        let get = |name: &'static str| -> Result<Func, GpuError> {
            let c = CString::new(name).expect("name");
            let mut f = std::ptr::null_mut();
            // SAFETY: live module, valid name and out-pointer.
            unsafe { check("cuModuleGetFunction", sys::cuModuleGetFunction(&mut f, module, c.as_ptr()))? };
            Ok(Func { f, name, pdl })
        };
        // the formats this module holds
        let formats: Vec<_> = cuda_formats().into_iter().filter(|f| formats.has(f.index)).collect();
        let per = |prefix: &str, tail: &str| -> Result<[Option<Func>; N], GpuError> {
            let mut v = [None; N];
            for f in &formats {
                v[f.index] = Some(get(leak(format!("{prefix}{}{tail}", f.suffix)))?);
            }
            Ok(v)
        };
        // the block formats' narrow kernels, when on
        let narrow_per = |prefix: &str| -> Result<[Option<Func>; N], GpuError> {
            let mut v = [None; N];
            if narrow {
                for f in formats.iter().filter(|f| f.narrow) {
                    v[f.index] = Some(get(leak(format!("{prefix}{}_t1n", f.suffix)))?);
                }
            }
            Ok(v)
        };
        // the prefill kernels, when on: `name(format)` for the formats `which` picks (None: that format has none);
        // the tensor-core ones only on cards that have them
        let prefill_per = |which: &dyn Fn(&crate::quant::format::CudaFormat) -> Option<String>| {
            let mut v = [None; N];
            if mmq_wanted() {
                for f in &formats {
                    if let Some(name) = which(f) {
                        v[f.index] = Some(get(leak(name))?);
                    }
                }
            }
            Ok::<_, GpuError>(v)
        };
        let tc = |prefix: &'static str| {
            move |f: &crate::quant::format::CudaFormat| {
                (tensor_cores && f.prefill == Prefill::Mmq).then(|| format!("{prefix}{}", f.suffix))
            }
        };
        // the grouped decode attention per head size, when on
        // (on tensor cores; over a Q8_0 cache for head sizes of whole Q8_0 blocks)
        let decode_per = |prefix: &str, q8: bool| -> Result<[Option<Func>; DECODE_HEAD_SIZES.len()], GpuError> {
            let mut v = [None; DECODE_HEAD_SIZES.len()];
            if tensor_cores && decode_attention_wanted() {
                for (f, hd) in v.iter_mut().zip(DECODE_HEAD_SIZES).filter(|(_, hd)| !q8 || hd % 32 == 0) {
                    *f = Some(get(leak(format!("{prefix}{hd}")))?);
                }
            }
            Ok(v)
        };
        let mut k = Kernels {
            module,
            mmv: per("mmv_", "")?,
            gate_up: per("expert_gate_up_", "")?,
            down: per("expert_down_", "")?,
            mmv1: per("mmv_", "_t1")?,
            gate_up1: per("expert_gate_up_", "_t1")?,
            down1: per("expert_down_", "_t1")?,
            // block formats: the int8 MMA kernel; float formats: the tiled f32 ones (CUDA cores, any card)
            mmq: prefill_per(&|f| match f.prefill {
                Prefill::Mmq => tc("mmq_")(f),
                Prefill::Float => Some(format!("mmf_{}", f.suffix)),
                Prefill::Rows => None,
            })?,
            mmq_slots: [0; N],
            mmq_w_slots: [0; N],
            mmq_w: {
                let mut v = [None; N];
                if mmq_wide && mmq_wanted() && tensor_cores {
                    for f in formats.iter().filter(|f| f.prefill == Prefill::Mmq) {
                        let fits = crate::quant::format::by_name(f.suffix)
                            .is_some_and(|g| super::ops::mq_wide_fits(g.ty, mmq_pipe));
                        if fits {
                            v[f.index] = get(leak(format!("mmq_{}_w", f.suffix))).ok();
                        }
                    }
                }
                v
            },
            mmf16: prefill_per(&|f| (f.prefill == Prefill::Float).then(|| format!("mmf_{}_r16", f.suffix)))?,
            mmf_split: prefill_per(&|f| {
                (f.prefill == Prefill::Float && mmf_split_wanted()).then(|| format!("mmf_split_{}", f.suffix))
            })?,
            mmf_sum_split: get("mmf_sum_split")?,
            gate_up_mmq: prefill_per(&tc("expert_gate_up_mmq_"))?,
            down_mmq: prefill_per(&tc("expert_down_mmq_"))?,
            gate_up1n: narrow_per("expert_gate_up_")?,
            down1n: narrow_per("expert_down_")?,
            quantize_q8: get("quantize_q8")?,
            rms_norm_q8: get("rms_norm_q8")?,
            rms_norm_q8_cluster: if cluster_norm { Some(get("rms_norm_q8_cluster")?) } else { None },
            // (None where an older STRATA_KERNEL_SOURCE lacks it: the clusters then take every norm)
            rms_norm_q8_warps: if cluster_norm && norm_rows_wanted() { get("rms_norm_q8_warps").ok() } else { None },
            qkv_prep: get("qkv_prep")?,
            rope_store: get("rope_store")?,
            rope_store_q8: get("rope_store_q8")?,
            qkv_rope_store: if fuse_wanted() { get("qkv_rope_store").ok() } else { None },
            route_f32_t1: if fuse_wanted() { get("route_f32_t1").ok() } else { None },
            gated_add: get("gated_add")?,
            attention: get("attention")?,
            attention_q8: get("attention_q8")?,
            attention_split: get("attention_split")?,
            attention_split_q8: get("attention_split_q8")?,
            attention_combine: get("attention_combine")?,
            attention_decode: decode_per("attention_decode_", false)?,
            attention_decode_q8: decode_per("attention_decode_q8_", true)?,
            attention_tiled: {
                let mut v = [None; TILED_HEAD_SIZES.len()];
                if tensor_cores && tiled_attention_wanted() {
                    for (f, hd) in v.iter_mut().zip(TILED_HEAD_SIZES) {
                        *f = Some(get(leak(format!("attention_tiled_{hd}")))?);
                    }
                }
                v
            },
            attention_tiled_q8: {
                let mut v = [None; TILED_HEAD_SIZES.len()];
                if tensor_cores && tiled_attention_wanted() {
                    for (f, hd) in v.iter_mut().zip(TILED_HEAD_SIZES) {
                        if hd % 32 == 0 {
                            *f = Some(get(leak(format!("attention_tiled_q8_{hd}")))?);
                        }
                    }
                }
                v
            },
            route_topk: get("route_topk")?,
            mmq_pipe,
            mmq_split: mmq_split_wanted(),
            group_by_expert: get("group_by_expert")?,
            swiglu: get("swiglu")?,
            expert_down_bias: get("expert_down_bias")?,
            add_bias: get("add_bias")?,
        };
        // the grouped decode attention's two K/V tiles: up to 68 KiB (f16, head size 128)
        for (i, hd) in DECODE_HEAD_SIZES.iter().enumerate() {
            for (f, q8) in [(&mut k.attention_decode[i], false), (&mut k.attention_decode_q8[i], true)] {
                let bytes = super::ops::att_decode_smem(*hd, q8);
                if f.is_some_and(|g| {
                    bytes + 1024 > max_smem_optin.max(0) as usize || g.set_max_smem(bytes as i32).is_err()
                }) {
                    *f = None;
                }
            }
        }
        // the opt-in limit covers static shared memory too (a few hundred bytes in `attention`)
        k.attention.set_max_smem(max_smem_optin - 1024)?;
        k.attention_q8.set_max_smem(max_smem_optin - 1024)?;
        // the tensor-core products' dynamic shared memory (pipeline stages: up to 116 KiB, Q8_0 gate and up rows)
        for ty in crate::quant::format::REGISTRY.iter().map(|f| f.ty).filter(|&t| super::ops::mq_pipe_sa(t).is_some()) {
            let i = fmt_index(ty)?;
            for (f, gated) in [(k.mmq[i], false), (k.mmq_w[i], true), (k.gate_up_mmq[i], true), (k.down_mmq[i], false)]
            {
                if let Some(f) = f {
                    f.set_max_smem(super::ops::mq_smem(ty, gated, mmq_pipe) as i32)?;
                }
            }
        }
        // the dense tensor-core products' blocks at once on the card (their split-K choice)
        let sms = super::driver::current_sms()?;
        for ty in crate::quant::format::REGISTRY.iter().map(|f| f.ty) {
            let Ok(i) = fmt_index(ty) else { continue };
            for (f, gated, slots) in [(k.mmq[i], false, &mut k.mmq_slots[i]), (k.mmq_w[i], true, &mut k.mmq_w_slots[i])]
            {
                if let (Some(f), true) = (f, ty.block_size() > 1) {
                    *slots = sms * f.blocks_per_sm(32 * super::ops::WARPS, super::ops::mq_smem(ty, gated, mmq_pipe))?;
                }
            }
        }
        Ok(k)
    }

    /// Blocks of the dense tensor-core prefill product for `ty` (`wide`: `mmq_*_w`) that the card runs at once (0:
    /// no such kernel).
    pub fn mmq_slots(&self, ty: GgmlType, wide: bool) -> u32 {
        fmt_index(ty).map_or(0, |i| if wide { self.mmq_w_slots[i] } else { self.mmq_slots[i] })
    }

    /// The dense product kernel for `ty` (`one`: the one-token variant).
    pub fn mmv(&self, ty: GgmlType, one: bool) -> Result<Func, GpuError> {
        let i = fmt_index(ty)?;
        held(ty, if one { self.mmv1[i] } else { self.mmv[i] })
    }
    /// The expert gate/up kernel for `ty` (`one`: every group has at most one token).
    pub fn gate_up(&self, ty: GgmlType, one: bool) -> Result<Func, GpuError> {
        let i = fmt_index(ty)?;
        held(ty, if one { self.gate_up1[i] } else { self.gate_up[i] })
    }
    /// The expert down kernel for `ty` (`one`: every group has at most one token).
    pub fn down(&self, ty: GgmlType, one: bool) -> Result<Func, GpuError> {
        let i = fmt_index(ty)?;
        held(ty, if one { self.down1[i] } else { self.down[i] })
    }
    /// The prefill product for `ty` (tensor-core for block formats, tiled f32 for float ones), if it is on and
    /// the format has one (Q2_K has none: [`Prefill::Rows`]).
    pub fn mmq(&self, ty: GgmlType) -> Option<Func> {
        fmt_index(ty).ok().and_then(|i| self.mmq[i])
    }
    /// The wide tensor-core prefill product for `ty` (2 × MQ_BM rows per block, the dynamic shared memory of a gated
    /// expert kernel), if it is on ([`mmq_wide_wanted`]) and the format has one (whether it suits the format:
    /// [`super::ops::mq_wide_fits`]).
    pub fn mmq_wide(&self, ty: GgmlType) -> Option<Func> {
        fmt_index(ty).ok().and_then(|i| self.mmq_w[i])
    }
    /// The float formats' prefill product of 16 rows per block (for matrices of few rows), if it is on.
    pub fn mmf_r16(&self, ty: GgmlType) -> Option<Func> {
        fmt_index(ty).ok().and_then(|i| self.mmf16[i])
    }
    /// The float formats' split-K prefill product (see [`super::ops::Ops::mmf_split`]), if it is on.
    pub fn mmf_split(&self, ty: GgmlType) -> Option<Func> {
        fmt_index(ty).ok().and_then(|i| self.mmf_split[i])
    }
    /// The tensor-core expert kernels (gate/up for `gate`, down for `down`) if both formats have them and they are
    /// on.
    pub fn expert_mmq(&self, gate: GgmlType, down: GgmlType) -> Option<(Func, Func)> {
        let g = fmt_index(gate).ok().and_then(|i| self.gate_up_mmq[i])?;
        let d = fmt_index(down).ok().and_then(|i| self.down_mmq[i])?;
        Some((g, d))
    }
    /// The grouped decode attention kernel for head size `hd` (`q8`: over a Q8_0 KV cache), if there is one and it
    /// is on.
    pub fn attention_decode(&self, hd: usize, q8: bool) -> Option<Func> {
        by_head_size(&DECODE_HEAD_SIZES, if q8 { &self.attention_decode_q8 } else { &self.attention_decode }, hd)
    }
    /// The tiled prefill attention kernel for head size `hd` (`q8`: over a Q8_0 KV cache), if there is one and it
    /// is on.
    pub fn attention_tiled(&self, hd: usize, q8: bool) -> Option<Func> {
        by_head_size(&TILED_HEAD_SIZES, if q8 { &self.attention_tiled_q8 } else { &self.attention_tiled }, hd)
    }
    /// The narrow one-token gate/up kernel for `ty`, if it has one (block formats) and it is on.
    pub fn gate_up_narrow(&self, ty: GgmlType) -> Option<Func> {
        fmt_index(ty).ok().and_then(|i| self.gate_up1n[i])
    }
    /// The narrow one-token down kernel for `ty`, if it has one (block formats) and it is on.
    pub fn down_narrow(&self, ty: GgmlType) -> Option<Func> {
        fmt_index(ty).ok().and_then(|i| self.down1n[i])
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: unloaded once; no launch uses it after the owner drops it.
        unsafe {
            sys::cuModuleUnload(self.module);
        }
    }
}
