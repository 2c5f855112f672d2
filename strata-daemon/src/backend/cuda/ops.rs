//! Typed launches of the kernels in `kernels/strata.cu` on one stream. Shapes are in elements, addresses are
//! device addresses; each helper mirrors its kernel's parameter list.

use super::driver::{Args, DevBuf, Func, Stream};
use super::kernels::Kernels;
use super::GpuError;
use crate::quant::GgmlType;

/// Bytes of one Q8 activation block on the device (`float d, s; int8 qs[32]`).
pub const Q8_BYTES: usize = 40;
/// Bytes of one expert group (`int slot, nt, tok[8], pair[8]`).
pub const GROUP_BYTES: usize = 72;
/// Tokens one group (or one product launch) handles at once.
pub const MAX_NT: usize = 8;
/// Threads per block of `rms_norm_q8` (NORM_THREADS in kernels/strata.cu).
pub const NORM_THREADS: u32 = 256;
/// Blocks per row and threads per block of `rms_norm_q8_cluster` (NORM_CLUSTER, NORM_CLUSTER_THREADS).
pub const NORM_CLUSTER: u32 = 8;
const NORM_CLUSTER_THREADS: u32 = 128;
/// Warps per block of the product kernels.
pub const WARPS: u32 = 4;
/// Rows one warp computes in the dense and expert-down products (gate/up: the gate and up row of one index).
pub const RPW: usize = 2;

/// Rows one warp computes in the narrow one-token down kernel (`NARROW_RPW` in kernels/strata.cu).
pub const NARROW_RPW: usize = 8;
/// Widest row, in 32-value blocks, that the narrow down kernel stages whole (`NARROW_CB`): ff ≤ 1024.
pub const NARROW_CB: usize = RPW * 128 / NARROW_RPW;

/// Widest row, in 32-value blocks, of the narrow one-token gate/up kernel (`NARROW_GU_CB`): e ≤ 2048.
pub const NARROW_GU_CB: usize = RPW * 128 / 4;

/// Widest expert (`ff`) whose one-token down kernel quantizes its input row itself (`DOWN_OWN_MAX` in
/// kernels/strata.cu).
pub const DOWN_OWN_MAX: usize = 2048;

/// Whether the one-token down kernel can quantize h itself for experts of width `ff` (no separate quantize).
pub fn down_quantizes(one: bool, ff: usize) -> bool {
    one && ff <= DOWN_OWN_MAX && ff.is_multiple_of(32)
}

/// A weight matrix in VRAM: `rows` rows of `cols` elements of `ty`.
pub struct DMat {
    /// The bytes.
    pub buf: DevBuf,
    /// Format.
    pub ty: GgmlType,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

impl DMat {
    /// Uploads `data` (`rows × ty.row_bytes(cols)` bytes).
    pub fn upload(data: &[u8], ty: GgmlType, rows: usize, cols: usize) -> Result<DMat, GpuError> {
        Ok(DMat { buf: DevBuf::from_slice(data)?, ty, rows, cols })
    }
}

/// A MoE layer's outputs still to be added into the residual stream, done by the next [`Ops::rms_norm_q8`]:
/// `x[i] += Σ_r (flag[i·k + r] ≠ 0 ? w[i·k + r] · y[i·k + r] : 0) + cpu[i]` over ranks r in order, where `y`
/// holds one row of `n` f32 per routing entry, `w`/`flag` one f32/i32 per entry, `cpu` (0 = none) one row per
/// token. Addresses are those of the first token the norm covers.
#[derive(Clone, Copy, Debug)]
pub struct Combine {
    /// Expert output rows.
    pub y: u64,
    /// Router weights.
    pub w: u64,
    /// 1 where the GPU wrote the entry's row of `y`.
    pub flag: u64,
    /// The CPU pool's summed rows (0: none).
    pub cpu: u64,
    /// Experts per token (top-k).
    pub k: usize,
}

impl Combine {
    /// The same combine from token `row0` on (`n`: values per row).
    pub fn from_row(self, row0: usize, n: usize) -> Combine {
        let off = |p: u64, bytes: usize| if p == 0 { 0 } else { p + bytes as u64 };
        Combine {
            y: off(self.y, row0 * self.k * n * 4),
            w: off(self.w, row0 * self.k * 4),
            flag: off(self.flag, row0 * self.k * 4),
            cpu: off(self.cpu, row0 * n * 4),
            k: self.k,
        }
    }
}

/// The arguments of the norm kernels (`rms_norm_q8*`: see [`Ops::rms_norm_q8`]).
fn norm_args(x: u64, w: u64, eps: f32, n: usize, out: u64, outq: u64, combine: Option<Combine>) -> Args {
    let c = combine.unwrap_or(Combine { y: 0, w: 0, flag: 0, cpu: 0, k: 0 });
    Args::new()
        .ptr(x)
        .ptr(w)
        .f32(eps)
        .i32(n as i32)
        .ptr(out)
        .ptr(outq)
        .ptr(c.y)
        .ptr(c.w)
        .ptr(c.flag)
        .ptr(c.cpu)
        .i32(c.k as i32)
}

/// One layer's KV cache on the device: the K and V rows' addresses (`n_ctx` positions of `kvd` values each) and
/// their type: f16 (`kvd` halves per position) or, `q8`, ggml Q8_0 (`kvd / 32` blocks of 34 bytes per position,
/// `--kv-type q8_0`; head sizes that are multiples of 32).
#[derive(Clone, Copy, Debug)]
pub struct KvPtrs {
    /// K rows.
    pub k: u64,
    /// V rows.
    pub v: u64,
    /// Q8_0 rows (else f16).
    pub q8: bool,
}

impl KvPtrs {
    /// Bytes of `n_ctx` positions of `kvd` values (one of K or V).
    pub fn bytes(q8: bool, n_ctx: usize, kvd: usize) -> usize {
        if q8 {
            n_ctx * (kvd / 32) * 34
        } else {
            n_ctx * kvd * 2
        }
    }
}

/// The arguments every attention kernel starts with: queries, K and V caches, head counts.
fn head_args(q: u64, kv: KvPtrs, nh: usize, nkv: usize) -> Args {
    Args::new().ptr(q).ptr(kv.k).ptr(kv.v).i32(nh as i32).i32(nkv as i32)
}

/// The arguments both attention kernels start with: queries, K and V caches, head counts and size, the device
/// address of pos0, the score scale.
fn attention_args(q: u64, kv: KvPtrs, (nh, nkv, hd): (usize, usize, usize), pos: u64, scale: f32) -> Args {
    head_args(q, kv, nh, nkv).i32(hd as i32).ptr(pos).f32(scale)
}

/// Positions per block of the split-K attention (`ATT_CHUNK` in strata.cu).
pub const ATT_CHUNK: usize = 256;
/// The split-K attention runs for attention size classes above this many positions (shorter contexts keep the
/// bit-exact one-block kernel, so their output bytes are those of earlier builds). From 1,024 to 256 in stop 21:
/// a decode token at positions 256-1,024 had one block per head (32 blocks on the H200's 132 SMs for Qwen3) and
/// decoded at half the rate of an empty context.
pub const ATT_SPLIT_MIN: usize = 256;
/// ... and for at most this many query rows (decode windows; a prefill chunk has enough blocks without it).
pub const ATT_SPLIT_ROWS: usize = 8;

/// Whether [`Ops::attention`] splits a pass of `t` rows in attention size class `cap` (head size `hd`).
pub fn split_applies(cap: usize, t: usize, hd: usize) -> bool {
    cap > ATT_SPLIT_MIN && t <= ATT_SPLIT_ROWS && hd <= 256
}

/// Query rows per block and warps per block of the tiled prefill attention (`FA_BQ`, `FA_WARPS` in strata.cu).
pub const FA_BQ: usize = 64;
const FA_WARPS: u32 = 4;

/// Whether [`Ops::attention`] runs a pass of `t` rows through the tiled kernel (when its head size has one):
/// more rows than a decode window, K/V rows of whole 16-byte chunks (`kvd` values per position).
pub fn tiled_applies(t: usize, kvd: usize) -> bool {
    t > ATT_SPLIT_ROWS && kvd.is_multiple_of(8)
}

/// Query heads per block of the grouped decode attention (`ATT_DG` in strata.cu: the 16 rows of its products).
const ATT_DG: usize = 16;
/// Warps per block of `qkv_rope_store` (QRS_WARPS in strata.cu), a warp per head.
const QRS_WARPS: usize = 4;
/// The largest head size `qkv_rope_store` takes (QRS_MAX_HD in strata.cu: its shared row per warp).
const QRS_MAX_HD: usize = 256;
/// Experts `route_topk` and `route_f32_t1` take at most (TOPK_MAX_EXPERTS in strata.cu).
const TOPK_MAX_EXPERTS: usize = 1024;
/// Positions per shared-memory tile of the grouped decode attention (`ATT_DTILE`: 16 per warp).
const ATT_DTILE: usize = 64;
/// Most chunks the grouped decode attention cuts a row's positions into.
const ATT_DEC_MAX_Z: usize = 128;
/// Blocks the grouped decode attention aims at per launch (its chunk count is chosen for about this many: a few
/// per SM on the cards it runs on, so that every block's K/V copies are in flight at once), unless
/// `STRATA_GPU_ATT_BLOCKS` says otherwise (for measurements; read once).
const ATT_DEC_BLOCKS: usize = 512;

/// Whether the grouped decode attention starts copying the K/V tiles of earlier passes' positions before it waits
/// for the kernels before it (`pre`; the same bits either way): unless `STRATA_GPU_ATT_PRE=0` (read once; for A/B
/// measurements).
fn att_pre() -> bool {
    static P: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *P.get_or_init(|| !std::env::var("STRATA_GPU_ATT_PRE").is_ok_and(|v| v == "0"))
}

/// [`ATT_DEC_BLOCKS`], or `STRATA_GPU_ATT_BLOCKS` where that is a positive number.
fn att_dec_blocks() -> usize {
    static B: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *B.get_or_init(|| {
        std::env::var("STRATA_GPU_ATT_BLOCKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&b| b > 0)
            .unwrap_or(ATT_DEC_BLOCKS)
    })
}

/// Dynamic shared memory (bytes) of `attention_decode[_q8]_<hd>`: its K/V tile stages (f16 rows of hd + 8
/// halves; two stages over an f16 cache, one over a Q8_0 cache) or, at the end, the 4 warps' partials (m, l and
/// hd values per row), whichever is larger.
pub fn att_decode_smem(hd: usize, q8: bool) -> usize {
    let stages = if q8 { 1 } else { 2 };
    (stages * 2 * ATT_DTILE * (hd + 8) * 2).max((2 * 4 * ATT_DG + 4 * ATT_DG * hd) * 4)
}

/// The grouped decode attention's cut of `cap` positions for `blocks` blocks per chunk (KV heads × head groups ×
/// rows): (chunk length, chunk count). About `target` blocks in all, at most [`ATT_DEC_MAX_Z`] chunks, chunks of
/// whole tiles.
fn att_decode_cut(cap: usize, blocks: usize, target: usize) -> (usize, usize) {
    let most = cap.div_ceil(ATT_DTILE).clamp(1, ATT_DEC_MAX_Z);
    let nz = target.div_ceil(blocks.max(1)).clamp(1, most);
    let chunk = cap.div_ceil(nz).next_multiple_of(ATT_DTILE);
    (chunk, cap.div_ceil(chunk))
}

/// f32 values of the split-K scratch for `rows` query rows of `n_head` heads of size `hd` over `n_ctx` positions:
/// room for either split kernel's chunks (`attention_split`: ⌈n_ctx / ATT_CHUNK⌉; `attention_decode`: at most
/// [`ATT_DEC_MAX_Z`] of at least one tile) of (hd + 2) values per row and head.
pub fn split_part_floats(rows: usize, n_head: usize, hd: usize, n_ctx: usize) -> usize {
    let nz = n_ctx.div_ceil(ATT_CHUNK).max(n_ctx.div_ceil(ATT_DTILE).min(ATT_DEC_MAX_Z));
    rows.min(ATT_SPLIT_ROWS) * n_head * nz * (hd + 2)
}

/// Threads of the one block of `group_by_expert` (GROUP_THREADS in strata.cu).
const GROUP_THREADS: u32 = 1024;

/// Groups [`Ops::group_by_expert`] may write for `n_pairs` routing entries over `n_expert` experts: Σ_e ⌈c_e /
/// MAX_NT⌉ over the experts' entry counts c_e, bounded without knowing them.
pub fn max_expert_groups(n_pairs: usize, n_expert: usize) -> usize {
    n_pairs.min(n_pairs.div_ceil(MAX_NT) + n_expert)
}

/// Tiles (of up to [`MQ_BN`] tokens of one expert) [`Ops::group_by_expert`] may write: Σ_e ⌈c_e / MQ_BN⌉.
pub fn max_expert_tiles(n_pairs: usize, n_expert: usize) -> usize {
    n_pairs.min(n_pairs.div_ceil(MQ_BN) + n_expert)
}

/// The gated unit of the expert kernels (`Glu` in strata.cu): `act` 0 = SwiGLU, 1 = gpt-oss's clamped SwiGLU
/// ([`crate::backend::cpu::swiglu_oai`]); `gub` ≠ 0: per-expert biases (`ff` gate then `ff` up values per expert)
/// added to routing entry p's products, its expert read from `ids[p]` (the router's device ids).
#[derive(Debug, Clone, Copy, Default)]
pub struct Glu {
    /// The routing's expert ids (device address; read only with biases).
    pub ids: u64,
    /// The layer's gate/up biases (device address, 0 = none).
    pub gub: u64,
    /// The activation.
    pub act: i32,
}

impl Glu {
    /// SwiGLU without biases.
    pub const SILU: Glu = Glu { ids: 0, gub: 0, act: 0 };
}

/// `route_topk`'s `norm` mode for an architecture: 1 = renormalised top-k, 0 = softmax probabilities, 2 = the
/// softmax of the chosen logits. `None` for a gating the kernel does not implement (sigmoid).
pub fn gating_mode(def: &crate::arch::ArchDef) -> Option<i32> {
    match def.gating {
        crate::arch::Gating::Softmax => Some(def.norm_topk as i32),
        crate::arch::Gating::SoftmaxTopK => Some(2),
        crate::arch::Gating::Sigmoid => None,
    }
}

/// Bytes of one tile (`int2`: first group, groups).
pub const TILE_BYTES: usize = 8;

/// Weight rows and tokens per block of the tensor-core prefill product (`MQ_BM`, `MQ_BN` in strata.cu; its
/// blocks have [`WARPS`] warps; the wide kernels `mmq_*_w` take 2 · MQ_BM rows).
pub const MQ_BM: usize = 64;
/// See [`MQ_BM`].
pub const MQ_BN: usize = 64;

/// Weight blocks per stage of the tensor-core products and ints per staged Q8 block (`MQ_KB`, `MQ_XS` in strata.cu).
const MQ_KB: usize = 8;
const MQ_XS: usize = 12;
/// Bytes of one stage of the tokens' Q8 blocks (`MQ_XBYTES`): the whole staging of the loop that is not pipelined.
const MQ_XBYTES: usize = MQ_KB * MQ_BN * MQ_XS * 4;
/// The largest dynamic shared memory of the pipelined loop (Q8_0 gate and up rows: 118,784 bytes).
pub const MQ_PIPE_MAX_SMEM: usize = 2 * (2 * MQ_BM * 272 + MQ_XBYTES);

/// Dynamic shared memory (bytes) of the tensor-core product kernels of `ty` (`gated`: an expert's gate and up rows,
/// or the wide dense kernels' two row ranges)
/// for the formats of the pipelined loop ([`mq_pipe_sa`]): with that loop (`pipe`, see
/// [`super::kernels::mmq_pipe_on`]) two stages of MQ_KB blocks — the weight rows (64, or 128 when `gated`, at the
/// format's shared row stride; a stage of the 256-value formats is one super-block) and the tokens' Q8 blocks
/// ([`MQ_XBYTES`]) — else one stage of the Q8 blocks; 0 for the other formats (their kernels' shared memory is
/// static).
pub fn mq_smem(ty: GgmlType, gated: bool, pipe: bool) -> u32 {
    let Some(sa) = mq_pipe_sa(ty) else { return 0 };
    if !pipe {
        return MQ_XBYTES as u32;
    }
    let rows = if gated { 2 * MQ_BM } else { MQ_BM };
    (2 * (rows * sa + MQ_XBYTES)) as u32
}

/// The most dynamic shared memory a wide dense prefill kernel (`mmq_*_w`) may take: two blocks of it per SM of an
/// H100/H200 (228 KiB per SM, less each block's ~1.3 KiB of static shared memory and the driver's 1 KiB).
const MQ_WIDE_MAX_SMEM: usize = 111 * 1024;

/// Whether a dense prefill product of `ty` runs the wide kernel (2 × MQ_BM rows per block; see
/// [`super::kernels::mmq_wide_wanted`]): with the pipelined loop (`pipe`; cards of ~100 KiB of shared memory per block
/// keep the narrow one) and a format whose wide stages leave two blocks per SM — every pipelined format but Q8_0, whose
/// 118,784 bytes leave one (the narrow kernel keeps two). Measured on Q4_0 (stop 53: prefill 512 and 4,096 tokens
/// 0.7–5% faster than the narrow kernel on an H100); the other formats share its loop and occupancy.
pub fn mq_wide_fits(ty: GgmlType, pipe: bool) -> bool {
    let smem = mq_smem(ty, true, true) as usize;
    pipe && smem > 0 && smem <= MQ_WIDE_MAX_SMEM
}

/// The shared row stride in bytes (`MQ_SA` in strata.cu) of a stage of the pipelined tensor-core loop for `ty`: at
/// least a stage's bytes of one row (8 blocks of 32 values, or one super-block; plus 2 where rows may start 2-byte
/// aligned), a multiple of 16 whose word count is 4 times an odd number. None: a format without that loop (MXFP4,
/// Q2_K, the lattice IQ formats — 8-10% slower with it on IQ2_XS, stop 50 — and the float formats).
pub fn mq_pipe_sa(ty: GgmlType) -> Option<usize> {
    use GgmlType as T;
    Some(match ty {
        T::Q8_0 => 272,
        T::Q6_K => 240,
        T::Q5_0 | T::Q5_1 => 208,
        T::Q4_1 | T::Q5_K | T::IQ4_NL => 176,
        T::Q4_0 | T::Q4_K | T::Q3_K | T::IQ4_XS => 144,
        _ => return None,
    })
}

/// Column ranges of a split-K dense tensor-core product at most (see [`mq_split_count`]; its scratch holds this many
/// partial outputs of the widest stacked matrix the split applies to).
pub const MQ_SPLIT_MAX: usize = 4;

/// Blocks of 32 columns per range when `nb` of them are split into `nz` ranges: whole stages of [`MQ_KB`] blocks
/// (`mq_kspan` in strata.cu, which the kernel computes from its grid).
pub fn mq_kspan(nb: usize, nz: usize) -> usize {
    nb.div_ceil(nz.max(1)).next_multiple_of(MQ_KB)
}

/// Column ranges for a dense tensor-core product of `tiles` blocks (row × token tiles) over `nb` blocks of 32
/// columns, on a card that runs `slots` such blocks at once, with scratch for `max` ranges: the count in 1..=max that
/// finishes first when each block's time is its range's blocks plus one stage (the pipeline's fill and the output),
/// in waves of `slots` blocks; the fewest ranges among equals, and only counts whose every range holds blocks. One
/// range where the grid fills the card evenly; more where a grid of few blocks leaves SMs idle (the attention output
/// of Qwen3-30B-A3B over 512 tokens: 128 wide blocks, 16 × 8 tiles over 4,096 columns, for 264 slots of an H100 →
/// 2 ranges). A split must save at least a tenth of the one-range time: adding the partials (`mmf_sum_split`, a
/// launch that reads them back) cost about that much of the product where it was measured (15 µs beside 106).
pub fn mq_split_count(tiles: usize, slots: usize, nb: usize, max: usize) -> usize {
    if tiles == 0 || slots == 0 || nb == 0 {
        return 1;
    }
    let cost = |nz: usize| (tiles * nz).div_ceil(slots) * (mq_kspan(nb, nz) + MQ_KB);
    let best = (1..=max.max(1))
        .filter(|&nz| nz == 1 || (nz - 1) * mq_kspan(nb, nz) < nb)
        .min_by_key(|&nz| (cost(nz), nz))
        .unwrap_or(1);
    if 10 * cost(best) <= 9 * cost(1) {
        best
    } else {
        1
    }
}

/// Rows and tokens per block of the tiled float-format prefill product (`MF_BM`, `MF_BN`; 256 threads).
pub const MF_BM: usize = 64;
/// See [`MF_BM`].
pub const MF_BN: usize = 64;
/// Column ranges of [`Ops::mmf_split`] at most (its scratch holds this many partial outputs).
pub const MF_SPLIT_MAX: usize = 16;

/// Column ranges for a split-K float product of `blocks` row × token blocks over `cols` columns: enough for about
/// 256 blocks in all (two per SM of an H200), at most [`MF_SPLIT_MAX`], each of at least 128 columns.
pub fn mf_split_count(blocks: usize, cols: usize) -> usize {
    (256 / blocks.max(1)).clamp(1, MF_SPLIT_MAX).min((cols / 128).max(1))
}

/// Float matrices of at most this many rows run the 16-rows-per-block variant (`mmf_*_r16`).
pub const MF_FEW_ROWS: usize = 1024;

/// The parameter list the dense product kernels (`mmv_*`, `mmq_*`) share.
fn mmv_args(mats: &[&DMat], xq: u64, xf: u64, t: usize, out: u64, out_stride: usize, accumulate: bool) -> Args {
    let ptr = |i: usize| mats.get(i).map(|m| m.buf.ptr).unwrap_or(0);
    let rows = |i: usize| mats.get(i).map(|m| m.rows).unwrap_or(0) as i32;
    let cols = mats[0].cols as i32;
    Args::new()
        .ptr(ptr(0))
        .ptr(ptr(1))
        .ptr(ptr(2))
        .i32(rows(0))
        .i32(rows(1))
        .i32(rows(2))
        .i32(cols)
        .ptr(xq)
        .ptr(xf)
        .i32(cols)
        .i32(t as i32)
        .ptr(out)
        .i32(out_stride as i32)
        .i32(accumulate as i32)
}

/// `a` followed by the arguments `route_topk` and `route_f32_t1` end with (see [`Ops::route_topk`]).
fn topk_args(
    a: Args,
    k: usize,
    (ids, w): (u64, u64),
    fast: Option<(u64, u64, u64)>,
    win: u64,
    (norm, bias): (i32, u64),
) -> Args {
    let (table, groups, flag) = fast.unwrap_or((0, 0, 0));
    a.i32(k as i32).ptr(ids).ptr(w).ptr(table).ptr(groups).ptr(flag).ptr(win).i32(norm).ptr(bias)
}

/// One RoPE + KV store of `t` rows: what [`Ops::rope_store`], [`Ops::qkv_rope_store`] and
/// [`Ops::prep_rope_store`] take (device addresses and the heads' shape).
#[derive(Clone, Copy, Debug)]
pub struct RopeStore {
    /// The Q/K/V product rows, `t × (n_head + 2·n_head_kv)·head_dim` f32 (read, not rewritten).
    pub qkv: u64,
    /// The rows' rotations, `t × n_rot/2` (cos, sin) f32 pairs.
    pub cs: u64,
    /// (q heads, K/V heads, head size).
    pub heads: (usize, usize, usize),
    /// Rotated dimensions of each head.
    pub n_rot: usize,
    /// Device address of the first row's position (an `int`: the KV cache row it is stored at).
    pub pos: u64,
    /// Rows.
    pub t: usize,
    /// The rotated q rows out, `t × n_head·head_dim` f32.
    pub q: u64,
    /// The layer's KV cache.
    pub kv: KvPtrs,
    /// NeoX pairs `(i, i + n_rot/2)` instead of adjacent ones.
    pub neox: bool,
}

/// `a` followed by the arguments the RoPE kernels (`rope_store`, `rope_store_q8`, `qkv_rope_store`) end with.
fn rope_args(a: Args, r: &RopeStore) -> Args {
    let (n_head, n_head_kv, hd) = r.heads;
    a.ptr(r.cs)
        .i32(n_head as i32)
        .i32(n_head_kv as i32)
        .i32(hd as i32)
        .i32(r.n_rot as i32)
        .ptr(r.pos)
        .ptr(r.q)
        .ptr(r.kv.k)
        .ptr(r.kv.v)
        .i32(r.neox as i32)
}

/// Kernel launches on one stream.
pub struct Ops<'a> {
    /// The kernels.
    pub k: &'a Kernels,
    /// The stream.
    pub s: &'a Stream,
}

impl Ops<'_> {
    /// `out[t*out_stride + r] (+)= Σ_c W[r, c] x[t, c]` for the stacked rows of up to three matrices of one
    /// width, `t` tokens (`xq`: Q8 blocks, `xf`: f32; the kernel reads the one its format uses). Matrices of one
    /// format share a launch; a stack of mixed formats (Q4_K_M's `attn_v` in Q6_K beside Q4_K `attn_q`/`attn_k`)
    /// takes one launch per run of a format. `part`: scratch for split-K partials (address and f32 count), or None
    /// (never split). With scratch, a prefill chunk's tensor-core product whose grid leaves the card's SMs idle runs
    /// over [`mq_split_count`] column ranges (as many as `part` holds `t × rows` partials of, unless
    /// `STRATA_GPU_MMQ_SPLIT=0`), added in range order by `mmf_sum_split`: deterministic for one card model and
    /// chunk length (the count follows the grid and the card's SMs), rounding otherwise as a one-range sum's.
    /// Errors: a launch failure.
    #[allow(clippy::too_many_arguments)]
    pub fn mmv(
        &self,
        mats: &[&DMat],
        xq: u64,
        xf: u64,
        t: usize,
        out: u64,
        out_stride: usize,
        accumulate: bool,
        part: Option<(u64, usize)>,
    ) -> Result<(), GpuError> {
        if let Some(at) = mats.iter().position(|m| m.ty != mats[0].ty) {
            self.mmv(&mats[..at], xq, xf, t, out, out_stride, accumulate, part)?;
            let r0: usize = mats[..at].iter().map(|m| m.rows).sum();
            return self.mmv(&mats[at..], xq, xf, t, out + 4 * r0 as u64, out_stride, accumulate, part);
        }
        let m0 = mats[0];
        let total: usize = mats.iter().map(|m| m.rows).sum();
        let block = m0.ty.block_size() > 1;
        if self.k.mmq(m0.ty).is_some() && t > MAX_NT && block && m0.cols.is_multiple_of(32) {
            // a prefill chunk of a block format: the tensor-core kernel, over column ranges where that helps
            let nz = match part {
                Some((_, floats)) if self.k.mmq_split => {
                    let wide = self.k.mmq_wide(m0.ty).is_some();
                    let tiles = total.div_ceil(if wide { 2 * MQ_BM } else { MQ_BM }) * t.div_ceil(MQ_BN);
                    let max = (floats / (t * total).max(1)).min(MQ_SPLIT_MAX);
                    mq_split_count(tiles, self.k.mmq_slots(m0.ty, wide) as usize, m0.cols / 32, max)
                }
                _ => 1,
            };
            return self.mmq_ranges(mats, xq, t, out, out_stride, accumulate, nz, part.map_or(0, |p| p.0));
        }
        if let Some(f) = self.k.mmq(m0.ty).filter(|_| t > MAX_NT && !block) {
            // a prefill chunk of a float format: the tiled kernel (MF_BM × MF_BN, 256 threads); few rows (a
            // router): 16 per block, so that the card has blocks enough
            let args = mmv_args(mats, xq, xf, t, out, out_stride, accumulate);
            let (f, bm) = match self.k.mmf_r16(m0.ty) {
                Some(f16) if total <= MF_FEW_ROWS => (f16, 16),
                _ => (f, MF_BM),
            };
            return f.launch(self.s, (total.div_ceil(bm) as u32, t.div_ceil(MF_BN) as u32, 1), 256, 0, args);
        }
        let f = self.k.mmv(m0.ty, t == 1)?;
        let args = mmv_args(mats, xq, xf, t, out, out_stride, accumulate);
        // block formats: each warp RPW rows; float formats: each block RPW rows, its warps splitting the columns
        let per_block = if m0.ty.block_size() > 1 { WARPS as usize * RPW } else { RPW };
        f.launch(self.s, (total.div_ceil(per_block) as u32, 1, 1), 32 * WARPS, 0, args)
    }

    /// The tensor-core product of [`Ops::mmv`] for a prefill chunk of `t` > [`MAX_NT`] tokens of one block
    /// format (every matrix `ty`'s, 32-multiple widths) over `nz` column ranges: the wide kernel where it is loaded,
    /// else the narrow one (MQ_BM rows × MQ_BN tokens per block); `nz` > 1 writes `nz` partials to `part`
    /// (`nz × t × rows` f32) and adds them into `out` with `mmf_sum_split`. Errors: an `nz` that leaves a range
    /// without blocks ((nz − 1) · [`mq_kspan`] ≥ cols / 32; [`mq_split_count`]'s counts never do), no tensor-core
    /// kernel for the format, a launch failure.
    #[allow(clippy::too_many_arguments)]
    pub fn mmq_ranges(
        &self,
        mats: &[&DMat],
        xq: u64,
        t: usize,
        out: u64,
        out_stride: usize,
        accumulate: bool,
        nz: usize,
        part: u64,
    ) -> Result<(), GpuError> {
        let m0 = mats[0];
        let total: usize = mats.iter().map(|m| m.rows).sum();
        let nb = m0.cols / 32;
        if nz == 0 || (nz - 1) * mq_kspan(nb, nz) >= nb {
            return Err(GpuError::Unsupported(format!("{nz} column ranges of {nb} blocks: some would be empty")));
        }
        let Some(f) = self.k.mmq(m0.ty) else {
            return Err(GpuError::Unsupported(format!("no tensor-core prefill kernel for {:?}", m0.ty)));
        };
        // split: each range's partials to part (out_stride = rows, no accumulation), added below
        let (o, os, acc) = if nz > 1 { (part, total, false) } else { (out, out_stride, accumulate) };
        let args = mmv_args(mats, xq, 0, t, o, os, acc);
        if let Some(fw) = self.k.mmq_wide(m0.ty) {
            // 2 · MQ_BM rows per block (loaded only where mq_wide_fits): a gated expert kernel's shared memory
            let smem = mq_smem(m0.ty, true, self.k.mmq_pipe);
            let grid = (total.div_ceil(2 * MQ_BM) as u32, t.div_ceil(MQ_BN) as u32, nz as u32);
            fw.launch(self.s, grid, 32 * WARPS, smem, args)?;
        } else {
            let smem = mq_smem(m0.ty, false, self.k.mmq_pipe);
            let grid = (total.div_ceil(MQ_BM) as u32, t.div_ceil(MQ_BN) as u32, nz as u32);
            f.launch(self.s, grid, 32 * WARPS, smem, args)?;
        }
        if nz > 1 {
            let args = Args::new()
                .ptr(part)
                .i32(nz as i32)
                .i32(t as i32)
                .i32(total as i32)
                .ptr(out)
                .i32(out_stride as i32)
                .i32(accumulate as i32);
            self.k.mmf_sum_split.launch(self.s, ((t * total).div_ceil(256) as u32, 1, 1), 256, 0, args)?;
        }
        Ok(())
    }

    /// `out[t*out_stride + r] (+)= Σ_c W[r, c] x[t, c]` for a float-format matrix of few rows and a prefill chunk
    /// (a router: 128 rows × 2,048 columns), split over its columns into `nz` ranges computed by parallel blocks
    /// and added in range order by a second launch (deterministic; rounding differs from [`Ops::mmv`]'s kernels).
    /// `part`: scratch of [`MF_SPLIT_MAX`] × `t` × rows f32. Returns false (nothing launched) where the split
    /// does not apply: no split kernel for the format (block formats, or `STRATA_GPU_ROUTER_SPLIT=0`), more than
    /// [`MF_FEW_ROWS`] rows, or `t` ≤ [`MAX_NT`] (decode windows keep the row kernels). Errors: a launch failure.
    #[allow(clippy::too_many_arguments)]
    pub fn mmf_split(
        &self,
        m: &DMat,
        xf: u64,
        t: usize,
        out: u64,
        out_stride: usize,
        accumulate: bool,
        part: u64,
    ) -> Result<bool, GpuError> {
        let Some(f) = self.k.mmf_split(m.ty).filter(|_| t > MAX_NT && m.rows <= MF_FEW_ROWS) else {
            return Ok(false);
        };
        let blocks = m.rows.div_ceil(MF_BM) * t.div_ceil(MF_BN);
        let nz = mf_split_count(blocks, m.cols);
        let kspan = m.cols.div_ceil(nz).next_multiple_of(32);
        let nz = m.cols.div_ceil(kspan);
        let args = Args::new()
            .ptr(m.buf.ptr)
            .i32(m.rows as i32)
            .i32(m.cols as i32)
            .ptr(xf)
            .i32(m.cols as i32)
            .i32(t as i32)
            .i32(kspan as i32)
            .ptr(part);
        f.launch(self.s, (m.rows.div_ceil(MF_BM) as u32, t.div_ceil(MF_BN) as u32, nz as u32), 256, 0, args)?;
        let args = Args::new()
            .ptr(part)
            .i32(nz as i32)
            .i32(t as i32)
            .i32(m.rows as i32)
            .ptr(out)
            .i32(out_stride as i32)
            .i32(accumulate as i32);
        self.k.mmf_sum_split.launch(self.s, ((t * m.rows).div_ceil(256) as u32, 1, 1), 256, 0, args)?;
        Ok(true)
    }

    /// Q8 blocks of `n_blocks × 32` f32 values.
    pub fn quantize(&self, x: u64, out: u64, n_blocks: usize) -> Result<(), GpuError> {
        if n_blocks == 0 {
            return Ok(());
        }
        let args = Args::new().ptr(x).ptr(out).i32(n_blocks as i32);
        // 8 threads per block (`quantize_q8`): 32 blocks per 256-thread launch block
        self.k.quantize_q8.launch(self.s, (n_blocks.div_ceil(32) as u32, 1, 1), 256, 0, args)
    }

    /// RMSNorm of `t` rows of `n` values (`n % 32 == 0`, `n ≤ 8192`) with weights `w`, into f32 `out` and Q8
    /// `outq`; with `combine`, the previous MoE layer's outputs are first added into `x` (see [`Combine`]).
    /// On sm_90+ a cluster of [`NORM_CLUSTER`] blocks per row (`rms_norm_q8_warps` for more than [`MAX_NT`] rows:
    /// the same bits from one block of [`NORM_CLUSTER`] warps per row), else one block per row.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_q8(
        &self,
        x: u64,
        w: u64,
        eps: f32,
        n: usize,
        t: usize,
        out: u64,
        outq: u64,
        combine: Option<Combine>,
    ) -> Result<(), GpuError> {
        // (the warps kernel is loaded only where the cluster kernel is)
        if let Some(f) = self.k.rms_norm_q8_warps.as_ref().filter(|_| t > MAX_NT) {
            // a warp per slice, the row in dynamic shared memory
            let args = norm_args(x, w, eps, n, out, outq, combine);
            return f.launch(self.s, (t as u32, 1, 1), NORM_CLUSTER * 32, 4 * n as u32, args);
        }
        if self.rms_norm_q8_cluster(x, w, eps, n, t, out, outq, combine)? {
            return Ok(());
        }
        let args = norm_args(x, w, eps, n, out, outq, combine);
        self.k.rms_norm_q8.launch(self.s, (t as u32, 1, 1), NORM_THREADS, 0, args)
    }

    /// [`Ops::rms_norm_q8`] through the cluster kernel whatever `t` (its path for decode windows; gpu-check also
    /// compares `rms_norm_q8_warps` with it). Returns false (nothing launched) where the cluster kernel is not loaded.
    /// Errors: a launch failure.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_q8_cluster(
        &self,
        x: u64,
        w: u64,
        eps: f32,
        n: usize,
        t: usize,
        out: u64,
        outq: u64,
        combine: Option<Combine>,
    ) -> Result<bool, GpuError> {
        let Some(f) = &self.k.rms_norm_q8_cluster else { return Ok(false) };
        let args = norm_args(x, w, eps, n, out, outq, combine);
        f.launch(self.s, (NORM_CLUSTER, t as u32, 1), NORM_CLUSTER_THREADS, 0, args)?;
        Ok(true)
    }

    /// Biases and q/k RMSNorm of `t` rows of `qkv` in place before RoPE (see the kernel): `bias` (0 = none) is
    /// `qd + 2·kvd` f32 laid out as a row; `mode` 0 = no norm, 1 = per head (`qn`/`kn`: `hd` each), 2 = the
    /// whole q and k parts (`qd` / `kvd` weights).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_prep(
        &self,
        qkv: u64,
        bias: u64,
        qn: u64,
        kn: u64,
        mode: i32,
        (n_head, n_head_kv, hd): (usize, usize, usize),
        eps: f32,
        t: usize,
    ) -> Result<(), GpuError> {
        let args = Args::new()
            .ptr(qkv)
            .ptr(bias)
            .ptr(qn)
            .ptr(kn)
            .i32(mode)
            .i32(n_head as i32)
            .i32(n_head_kv as i32)
            .i32(hd as i32)
            .f32(eps);
        self.k.qkv_prep.launch(self.s, (t as u32, 1, 1), 256, 0, args)
    }

    /// `x[i] += sigmoid(gw · xn[i]) · y[i]` for `t` rows of `e` f32 (a shared expert's gated output).
    pub fn gated_add(&self, x: u64, y: u64, gw: u64, xn: u64, e: usize, t: usize) -> Result<(), GpuError> {
        let args = Args::new().ptr(x).ptr(y).ptr(gw).ptr(xn).i32(e as i32);
        self.k.gated_add.launch(self.s, (t as u32, 1, 1), 256, 0, args)
    }

    /// RoPE + KV store of `r` (see the kernels `rope_store`, `rope_store_q8`). Errors: a launch failure.
    pub fn rope_store(&self, r: &RopeStore) -> Result<(), GpuError> {
        let ((n_head, n_head_kv, hd), t) = (r.heads, r.t);
        let args = rope_args(Args::new().ptr(r.qkv), r);
        if r.kv.q8 {
            // one thread per q value, one warp per 32-value K or V block
            let work = (n_head * hd).max(2 * n_head_kv * hd / 32 * 32);
            return self.k.rope_store_q8.launch(self.s, (t as u32, work.div_ceil(128).min(64) as u32, 1), 128, 0, args);
        }
        let pairs = (n_head * hd / 2).max(n_head_kv * hd);
        self.k.rope_store.launch(self.s, (t as u32, pairs.div_ceil(128).min(64) as u32, 1), 128, 0, args)
    }

    /// A layer's work between its Q/K/V product and attention: the biases and q/k norms (`prep`: (`bias`, `qn`,
    /// `kn`, `mode`, `eps`) as [`Ops::qkv_prep`] takes them; `None` = none), then RoPE and the KV store of `r`, in
    /// one launch where [`Ops::qkv_rope_store`] applies, else as [`Ops::qkv_prep`] then [`Ops::rope_store`] (the
    /// same bits). Errors: a launch failure.
    pub fn prep_rope_store(&self, r: &RopeStore, prep: Option<(u64, u64, u64, i32, f32)>) -> Result<(), GpuError> {
        if self.qkv_rope_store(r, prep)? {
            return Ok(());
        }
        if let Some((bias, qn, kn, mode, eps)) = prep {
            self.qkv_prep(r.qkv, bias, qn, kn, mode, r.heads, eps, r.t)?;
        }
        self.rope_store(r)
    }

    /// [`Ops::qkv_prep`] (modes 0 and 1) and [`Ops::rope_store`] over an f16 cache in one launch with their bits
    /// (the kernel `qkv_rope_store`: one warp per q, k or v head of each of `r`'s rows). `prep`: (`bias`, `qn`,
    /// `kn`, `mode`, `eps`) as `qkv_prep` takes them; `None` = no prep (RoPE and store only). Returns false,
    /// launching nothing, where it does not apply: the kernel not loaded ([`super::kernels::fuse_wanted`]), a Q8_0
    /// cache, mode 2 (a norm across heads), a head size above 256. Errors: a launch failure.
    pub fn qkv_rope_store(&self, r: &RopeStore, prep: Option<(u64, u64, u64, i32, f32)>) -> Result<bool, GpuError> {
        let (bias, qn, kn, mode, eps) = prep.unwrap_or((0, 0, 0, 0, 0.0));
        let (n_head, n_head_kv, hd) = r.heads;
        let Some(f) = self.k.qkv_rope_store.as_ref().filter(|_| !r.kv.q8 && mode != 2 && hd <= QRS_MAX_HD) else {
            return Ok(false);
        };
        let args = rope_args(Args::new().ptr(r.qkv).ptr(bias).ptr(qn).ptr(kn).i32(mode).f32(eps), r);
        let heads = n_head + 2 * n_head_kv;
        f.launch(self.s, (r.t as u32, heads.div_ceil(QRS_WARPS) as u32, 1), 32 * QRS_WARPS as u32, 0, args)?;
        Ok(true)
    }

    /// Causal attention of `t` rows at positions `pos0..` over the cache; `pos` is the device address of pos0,
    /// `cap` ≥ pos0 + t the positions the shared memory is sized for (an attention size class: the same kernel
    /// for every position of a class). The output rows go to `out` (f32) and to `outq` as Q8 blocks (written by
    /// the kernel when the head size is a multiple of 32, else by a separate quantize launch).
    ///
    /// `split`: scratch for split-K partials ([`split_part_floats`] for `t` rows over `cap` positions): where
    /// [`split_applies`] (a long context, a few rows), the positions are cut into chunks computed by parallel
    /// blocks and merged — not bit-exact with the one-block kernel, which every shorter context keeps (the
    /// chunks' softmax is rescaled in f32; the grouped kernel also scores on f16 tensor cores and rounds the
    /// unnormalised probabilities to f16). Head sizes 64, 80, 96 and 128 take the KV-head-grouped
    /// `attention_decode_<hd>` on tensor cores (the query heads sharing a KV head are the rows of one product, so
    /// each K/V row is read once for them; tiles copied to shared memory ahead of their use;
    /// `STRATA_GPU_ATT_DECODE=0` turns it off), others `attention_split` (one block per query head and chunk of
    /// ATT_CHUNK positions).
    ///
    /// `(window, sinks)`: a sliding window of `window` positions per row (0 = none) and the device address of
    /// `n_head` attention-sink logits (0 = none), as [`crate::backend::cpu::attention::attend`] takes them.
    ///
    /// `kv.q8` (a Q8_0 cache, `hd` a multiple of 32): the same paths over Q8_0 rows (`attention_q8`,
    /// `attention_decode_q8_<hd>` and `attention_tiled_q8_<hd>`, which convert each K/V tile to f16 as they load
    /// it, `attention_split_q8`); the one-block and `attention_split_q8` kernels quantize the query for the scores
    /// as the CPU path does (the tensor-core ones round it to f16); no path is bit-exact with the CPU's. Errors: a
    /// launch failure.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: u64,
        kv: KvPtrs,
        n_head: usize,
        n_head_kv: usize,
        hd: usize,
        pos: u64,
        cap: usize,
        t: usize,
        out: u64,
        outq: u64,
        split: Option<u64>,
        (window, sinks): (usize, u64),
    ) -> Result<(), GpuError> {
        let scale = 1.0 / (hd as f32).sqrt();
        if let Some(part) = split.filter(|_| split_applies(cap, t, hd)) {
            let nz = if let Some(f) = self.k.attention_decode(hd, kv.q8) {
                // grouped by KV head: chunks sized for about ATT_DEC_BLOCKS blocks
                let ngrp = (n_head / n_head_kv).div_ceil(ATT_DG);
                let (chunk, nz) = att_decode_cut(cap, n_head_kv * ngrp * t, att_dec_blocks());
                let args = head_args(q, kv, n_head, n_head_kv)
                    .ptr(pos)
                    .f32(scale)
                    .ptr(part)
                    .i32(window as i32)
                    .i32(chunk as i32)
                    .i32(ngrp as i32)
                    .i32(att_pre() as i32);
                let grid = ((n_head_kv * ngrp) as u32, t as u32, nz as u32);
                f.launch(self.s, grid, 128, att_decode_smem(hd, kv.q8) as u32, args)?;
                nz as u32
            } else {
                // one block per query head: chunks of ATT_CHUNK positions
                let nz = cap.div_ceil(ATT_CHUNK) as u32;
                let args = attention_args(q, kv, (n_head, n_head_kv, hd), pos, scale).ptr(part).i32(window as i32);
                let f = if kv.q8 { &self.k.attention_split_q8 } else { &self.k.attention_split };
                f.launch(self.s, (n_head as u32, t as u32, nz), 128, 0, args)?;
                nz
            };
            // the merge (with the Q8 rows)
            let args = Args::new()
                .ptr(part)
                .i32(n_head as i32)
                .i32(hd as i32)
                .i32(nz as i32)
                .ptr(out)
                .ptr(if hd.is_multiple_of(32) { outq } else { 0 })
                .ptr(sinks);
            // a block per 32 values of a head (⌈hd / 32⌉ × the blocks of one per head), for the few rows of a
            // decode step
            let grid = (n_head as u32, t as u32, hd.div_ceil(32) as u32);
            self.k.attention_combine.launch(self.s, grid, 128, 0, args)?;
        } else if let Some(f) = self.k.attention_tiled(hd, kv.q8).filter(|_| tiled_applies(t, n_head_kv * hd)) {
            // a prefill chunk: the tiled tensor-core kernel, then the Q8 rows
            let args = head_args(q, kv, n_head, n_head_kv)
                .i32(t as i32)
                .ptr(pos)
                .f32(scale)
                .ptr(out)
                .i32(window as i32)
                .ptr(sinks);
            f.launch(self.s, (t.div_ceil(FA_BQ) as u32, n_head as u32, 1), 32 * FA_WARPS, 0, args)?;
            return self.quantize(out, outq, t * n_head * hd / 32);
        } else {
            self.attention_exact(q, kv, (n_head, n_head_kv, hd), pos, scale, cap, t, out, outq, (window, sinks))?;
        }
        if !hd.is_multiple_of(32) {
            self.quantize(out, outq, t * n_head * hd / 32)?;
        }
        Ok(())
    }

    /// The one-block-per-row attention kernel (the CPU's scores bit for bit over an f16 cache; the CPU adds its V
    /// products by chunks of positions, so outputs agree to rounding; see `attention`),
    /// whatever `t`: the reference the other attention kernels are checked against. `cap` ≥ pos0 + t sizes its
    /// shared memory.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_exact(
        &self,
        q: u64,
        kv: KvPtrs,
        (n_head, n_head_kv, hd): (usize, usize, usize),
        pos: u64,
        scale: f32,
        cap: usize,
        t: usize,
        out: u64,
        outq: u64,
        (window, sinks): (usize, u64),
    ) -> Result<(), GpuError> {
        let smem = ((hd + cap) * 4) as u32;
        let args = attention_args(q, kv, (n_head, n_head_kv, hd), pos, scale)
            .ptr(out)
            .ptr(if hd.is_multiple_of(32) { outq } else { 0 })
            .i32(window as i32)
            .ptr(sinks);
        let f = if kv.q8 { &self.k.attention_q8 } else { &self.k.attention };
        f.launch(self.s, (n_head as u32, t as u32, 1), 128, smem, args)
    }

    /// Softmax + top-k of `t` rows of router logits into `ids`/`w` (`t × k`). With `fast = Some((table,
    /// groups, flag))` (decode windows, every expert looked up on the device) also one group per routing entry
    /// from the layer's residency table (`table` already offset to the layer) and the flags; `win` ≠ 0: the ids
    /// are copied there too (the window's routing record). `norm`: 1 = the top-k weights renormalised to sum 1,
    /// 0 = the softmax probabilities, 2 = the softmax of the chosen logits ([`gating_mode`]); `bias` (0 = none):
    /// the router's per-expert bias added to the logits first.
    #[allow(clippy::too_many_arguments)]
    pub fn route_topk(
        &self,
        logits: u64,
        n_expert: usize,
        k: usize,
        t: usize,
        ids: u64,
        w: u64,
        fast: Option<(u64, u64, u64)>,
        win: u64,
        (norm, bias): (i32, u64),
    ) -> Result<(), GpuError> {
        let args = topk_args(Args::new().ptr(logits).i32(n_expert as i32), k, (ids, w), fast, win, (norm, bias));
        self.k.route_topk.launch(self.s, (t as u32, 1, 1), 32, 0, args)
    }

    /// One token's router product over an f32 `router` (`x`: the token's normalized activations, f32) into `logits`
    /// and [`Ops::route_topk`] of it (`t` = 1; the other arguments as that takes them) in one launch with the two
    /// launches' bits (the kernel `route_f32_t1`). `done`: the device address of a u32 that is 0 before the first
    /// launch (each launch leaves it 0). Returns false, launching nothing, where it does not apply: the kernel not
    /// loaded ([`super::kernels::fuse_wanted`]), a router that is not f32, more than 1,024 experts or a top-k above
    /// 32. Errors: a launch failure.
    #[allow(clippy::too_many_arguments)]
    pub fn route_f32_t1(
        &self,
        router: &DMat,
        x: u64,
        logits: u64,
        done: u64,
        k: usize,
        ids: u64,
        w: u64,
        fast: Option<(u64, u64, u64)>,
        win: u64,
        (norm, bias): (i32, u64),
    ) -> Result<bool, GpuError> {
        let ok = router.ty == GgmlType::F32 && router.rows <= TOPK_MAX_EXPERTS && k <= 32;
        let Some(f) = self.k.route_f32_t1.as_ref().filter(|_| ok) else { return Ok(false) };
        let head = Args::new().ptr(router.buf.ptr).i32(router.rows as i32).i32(router.cols as i32);
        let args = topk_args(head.ptr(x).ptr(logits).ptr(done), k, (ids, w), fast, win, (norm, bias));
        f.launch(self.s, (router.rows.div_ceil(RPW) as u32, 1, 1), 32 * WARPS, 0, args)?;
        Ok(true)
    }

    /// Expert gate/up (the gated unit and biases of `glu`) over `n_groups` groups (`one`: no group has more than one
    /// token) into `h` (f32, one row of `ff` per routing entry); one-token groups of experts of width e ≤ 32 ×
    /// [`NARROW_GU_CB`] in a block format run the narrow kernel (two indices per warp).
    #[allow(clippy::too_many_arguments)]
    pub fn expert_gate_up(
        &self,
        ty: GgmlType,
        one: bool,
        groups: u64,
        n_groups: usize,
        slots: u64,
        slot_bytes: usize,
        ff: usize,
        e: usize,
        xq: u64,
        xf: u64,
        h: u64,
        glu: Glu,
    ) -> Result<(), GpuError> {
        let args = Args::new()
            .ptr(groups)
            .ptr(slots)
            .usize(slot_bytes)
            .i32(ff as i32)
            .i32(e as i32)
            .ptr(xq)
            .ptr(xf)
            .ptr(h)
            .ptr(glu.ids)
            .ptr(glu.gub)
            .i32(glu.act);
        let narrow =
            if one && e.is_multiple_of(32) && e / 32 <= NARROW_GU_CB { self.k.gate_up_narrow(ty) } else { None };
        let (f, per_warp) = match narrow {
            Some(f) => (f, 2),
            None => (self.k.gate_up(ty, one)?, 1),
        };
        f.launch(self.s, (ff.div_ceil(WARPS as usize * per_warp) as u32, n_groups as u32, 1), 32 * WARPS, 0, args)
    }

    /// Groups of up to [`MAX_NT`] tokens per expert from the `n_pairs` routing entries at `ids` (`k` per token;
    /// `table`: the layer's slot per expert, −1 = not in VRAM): [`max_expert_groups`] groups written at `groups`
    /// (the empty ones last, `nt` = 0), `flag[p]` = 1 where entry p's expert has a slot; `rank` is scratch of
    /// `n_pairs` i32; `tiles` ≠ 0: also [`max_expert_tiles`] tiles there (each expert's groups by up to
    /// [`MQ_BN`] tokens, for [`Ops::experts_mmq`]). Within an expert the order of tokens may differ between runs
    /// (results do not).
    #[allow(clippy::too_many_arguments)]
    pub fn group_by_expert(
        &self,
        ids: u64,
        n_pairs: usize,
        k: usize,
        n_expert: usize,
        table: u64,
        groups: u64,
        flag: u64,
        rank: u64,
        tiles: u64,
    ) -> Result<(), GpuError> {
        let max_groups = max_expert_groups(n_pairs, n_expert);
        let args = Args::new()
            .ptr(ids)
            .i32(n_pairs as i32)
            .i32(k as i32)
            .i32(n_expert as i32)
            .ptr(table)
            .ptr(groups)
            .i32(max_groups as i32)
            .ptr(flag)
            .ptr(rank)
            .ptr(tiles)
            .i32(max_expert_tiles(n_pairs, n_expert) as i32);
        self.k.group_by_expert.launch(self.s, (1, 1, 1), GROUP_THREADS, 0, args)
    }

    /// The experts of a prefill chunk on the tensor-core kernels, over `n_tiles` tiles at `tiles` of the groups at
    /// `groups` ([`Ops::group_by_expert`]): h = glu(gate·x, up·x) for each entry ([`Glu`]) (`xq`: the tokens' Q8 rows
    /// of `e`), its Q8 rows into `hq` (`n_pairs` rows of `ff`), then `out[pair]` = down·h (`e` values per entry; down
    /// rows `down_off` bytes into each slot, `down_rb` apart). `None` when the formats have no such kernels.
    #[allow(clippy::too_many_arguments)]
    pub fn experts_mmq(
        &self,
        (gate_ty, down_ty): (GgmlType, GgmlType),
        groups: u64,
        tiles: u64,
        n_tiles: usize,
        (slots, slot_bytes): (u64, usize),
        (down_off, down_rb): (usize, usize),
        (ff, e): (usize, usize),
        (xq, h, hq, n_pairs): (u64, u64, u64, usize),
        out: u64,
        glu: Glu,
    ) -> Option<Result<(), GpuError>> {
        let (gu, dn) = self.k.expert_mmq(gate_ty, down_ty)?;
        if !(e.is_multiple_of(32) && ff.is_multiple_of(32)) {
            return None;
        }
        // one launch of a tensor-core expert kernel: `rows` output rows per group in tiles of MQ_BM, every tile
        let launch = |f: Func, rows: usize, ty: GgmlType, gated: bool, args: Args| {
            let grid = (rows.div_ceil(MQ_BM) as u32, n_tiles as u32, 1);
            f.launch(self.s, grid, 32 * WARPS, mq_smem(ty, gated, self.k.mmq_pipe), args)
        };
        let run = || -> Result<(), GpuError> {
            let args = Args::new()
                .ptr(groups)
                .ptr(tiles)
                .ptr(slots)
                .usize(slot_bytes)
                .i32(ff as i32)
                .i32(e as i32)
                .ptr(xq)
                .ptr(h)
                .ptr(glu.ids)
                .ptr(glu.gub)
                .i32(glu.act);
            launch(gu, ff, gate_ty, true, args)?;
            self.quantize(h, hq, n_pairs * ff / 32)?;
            let args = Args::new()
                .ptr(groups)
                .ptr(tiles)
                .ptr(slots)
                .usize(slot_bytes)
                .usize(down_off)
                .usize(down_rb)
                .i32(ff as i32)
                .i32(e as i32)
                .ptr(hq)
                .ptr(out);
            launch(dn, e, down_ty, false, args)
        };
        Some(run())
    }

    /// Expert down over `n_groups` groups (`one`: no group has more than one token) from h (`hf`: `h_rows`
    /// f32 rows of `ff`); one-token groups of narrow experts (ff / 32 ≤ [`NARROW_CB`]) in a block format run the
    /// narrow kernel (eight rows per warp, staged while the gate/up kernel still runs). Invariant: the launch
    /// before a one-token down launch on this stream is [`Ops::expert_gate_up`]'s (the narrow kernel reads its
    /// groups and weights before it waits, relying on the gate/up kernel having waited before it let this one
    /// launch); `experts_gpu` and gpu-check issue them back to back. The `e` down rows start `down_off` bytes into each slot, `down_rb` bytes apart
    /// (`ty.row_bytes(ff)` in a whole blob; a PCIe split's packed parts are padded to 16 bytes). Its Q8 rows come
    /// from the kernel itself where [`down_quantizes`], else from a quantize launch into `hq` (scratch of
    /// `h_rows × ff / 32` Q8 blocks).
    #[allow(clippy::too_many_arguments)]
    pub fn expert_down(
        &self,
        ty: GgmlType,
        one: bool,
        groups: u64,
        n_groups: usize,
        slots: u64,
        slot_bytes: usize,
        (down_off, down_rb): (usize, usize),
        ff: usize,
        e: usize,
        (hq, hf, h_rows): (u64, u64, usize),
        out: u64,
    ) -> Result<(), GpuError> {
        let narrow = if down_quantizes(one, ff) && ff / 32 <= NARROW_CB { self.k.down_narrow(ty) } else { None };
        let hq = if down_quantizes(one, ff) {
            0 // the kernel quantizes its row of h itself
        } else {
            self.quantize(hf, hq, h_rows * ff / 32)?;
            hq
        };
        let args = Args::new()
            .ptr(groups)
            .ptr(slots)
            .usize(slot_bytes)
            .usize(down_off)
            .usize(down_rb)
            .i32(ff as i32)
            .i32(e as i32)
            .ptr(hq)
            .ptr(hf)
            .ptr(out);
        let (f, rows_per_warp) = match narrow {
            Some(f) => (f, NARROW_RPW),
            None => (self.k.down(ty, one)?, RPW),
        };
        f.launch(self.s, (e.div_ceil(WARPS as usize * rows_per_warp) as u32, n_groups as u32, 1), 32 * WARPS, 0, args)
    }

    /// The experts' down biases into their output rows: `y[p] += db[ids[p]]` (`e` values) for each routing entry
    /// p of the `n_groups` groups at `groups` (the entries the GPU computed).
    pub fn expert_down_bias(
        &self,
        groups: u64,
        n_groups: usize,
        y: u64,
        ids: u64,
        db: u64,
        e: usize,
    ) -> Result<(), GpuError> {
        let args = Args::new().ptr(groups).ptr(y).ptr(ids).ptr(db).i32(e as i32);
        self.k.expert_down_bias.launch(self.s, (n_groups as u32, 1, 1), 128, 0, args)
    }

    /// `x[i] += b` for `t` rows of `n` f32 (a projection's bias).
    pub fn add_bias(&self, x: u64, b: u64, n: usize, t: usize) -> Result<(), GpuError> {
        let args = Args::new().ptr(x).ptr(b).i32(n as i32);
        self.k.add_bias.launch(self.s, (t as u32, 1, 1), 256, 0, args)
    }

    /// Dense SwiGLU: `h = silu(g) * u` from t rows of `[g | u]`.
    pub fn swiglu(&self, gu: u64, ff: usize, t: usize, h: u64) -> Result<(), GpuError> {
        let n = ff * t;
        let args = Args::new().ptr(gu).i32(ff as i32).i32(t as i32).ptr(h);
        self.k.swiglu.launch(self.s, (n.div_ceil(256).min(65535) as u32, 1, 1), 256, 0, args)
    }
}

#[cfg(test)]
mod tests {
    use super::{
        att_decode_cut, att_decode_smem, down_quantizes, mf_split_count, mq_kspan, mq_pipe_sa, mq_smem, mq_split_count,
        mq_wide_fits, split_part_floats, Combine, GgmlType, ATT_CHUNK, MQ_PIPE_MAX_SMEM,
    };

    #[test]
    fn dense_products_split_their_columns_only_where_the_grid_leaves_sms_idle() {
        // whole stages of 8 blocks per range, every range holding blocks
        assert_eq!((mq_kspan(128, 2), mq_kspan(64, 3), mq_kspan(72, 4), mq_kspan(8, 2)), (64, 24, 24, 8));
        // Qwen3-30B-A3B over a 512-token chunk on an H100 (2 wide blocks per SM: 264 slots): the attention output
        // (2,048 rows × 4,096 columns, 16 × 8 tiles) half the blocks' work each, on every SM; q/k/v (5,120 × 2,048:
        // 320 tiles, 1.2 waves) three waves of half the work in place of two whole ones
        assert_eq!(mq_split_count(128, 264, 128, 4), 2);
        assert_eq!(mq_split_count(320, 264, 64, 4), 2);
        // a saving under a tenth is left whole (the partials' sum costs about that): 265 tiles on 132 slots in 2
        // ranges, 5 waves of 32 + 8 blocks, against 3 waves of 64 + 8 is 200 / 216
        assert_eq!(mq_split_count(265, 132, 64, 4), 1);
        // a grid of many waves (the experts' scale) and a grid that fills the card stay whole
        assert_eq!(mq_split_count(2304, 264, 64, 4), 1);
        assert_eq!(mq_split_count(264, 264, 64, 4), 1);
        // no room for partials, one stage of columns, nothing to do
        assert_eq!(mq_split_count(128, 264, 128, 1), 1);
        assert_eq!(mq_split_count(16, 264, 8, 4), 1);
        assert_eq!((mq_split_count(0, 264, 128, 4), mq_split_count(16, 0, 128, 4)), (1, 1));
        // every count returned leaves each range blocks, whatever the shape
        for tiles in [1, 7, 64, 130, 300] {
            for nb in [8, 9, 16, 24, 40, 72, 200] {
                let nz = mq_split_count(tiles, 132, nb, 4);
                assert!((nz - 1) * mq_kspan(nb, nz) < nb, "{tiles} tiles, {nb} blocks: {nz}");
            }
        }
    }

    #[test]
    fn a_combine_from_a_later_row_skips_whole_rows_and_keeps_no_cpu_as_none() {
        let c = Combine { y: 1 << 20, w: 2 << 20, flag: 3 << 20, cpu: 0, k: 8 };
        let r = c.from_row(3, 2048);
        assert_eq!(r.y, (1 << 20) + 3 * 8 * 2048 * 4); // 8 f32 rows of 2048 per token
        assert_eq!(r.w, (2 << 20) + 3 * 8 * 4);
        assert_eq!(r.flag, (3 << 20) + 3 * 8 * 4);
        assert_eq!(r.cpu, 0, "no CPU rows stays no CPU rows");
        let with_cpu = Combine { cpu: 4 << 20, ..c }.from_row(3, 2048);
        assert_eq!(with_cpu.cpu, (4 << 20) + 3 * 2048 * 4);
        let same = c.from_row(0, 2048);
        assert_eq!((same.y, same.w, same.flag, same.k), (c.y, c.w, c.flag, 8));
    }

    #[test]
    fn the_decode_attention_cut_covers_the_positions_and_fits_its_scratch() {
        // Qwen3-30B-A3B after a 4,096-token prompt (size class 8,192): 4 KV heads, one group of 8 heads each
        assert_eq!(att_decode_cut(8192, 4, 512), (64, 128));
        // 512 positions: every tile its own chunk (32 blocks)
        assert_eq!(att_decode_cut(512, 4, 512), (64, 8));
        // many blocks per chunk already: one chunk
        assert_eq!(att_decode_cut(300, 600, 512), (320, 1));
        // a smaller target: longer chunks
        assert_eq!(att_decode_cut(4168, 4, 256), (128, 33));
        for hd in [64, 80, 96, 128] {
            for cap in [257, 300, 1000, 4096, 4097, 20001, 65536, 131072] {
                for (n_head, n_kv, t) in [(32usize, 4usize, 1usize), (64, 2, 1), (16, 16, 3), (8, 1, 8), (24, 2, 2)] {
                    let ngrp = (n_head / n_kv).div_ceil(16);
                    let (chunk, nz) = att_decode_cut(cap, n_kv * ngrp * t, 512);
                    assert!(chunk * nz >= cap && chunk * (nz - 1) < cap, "{cap} {hd}: {chunk} × {nz}");
                    assert_eq!(chunk % 64, 0);
                    // the scratch (sized for the context, which is at least the size class) holds every chunk,
                    // as it holds attention_split's
                    let floats = split_part_floats(t, n_head, hd, cap);
                    assert!(t * n_head * nz * (hd + 2) <= floats);
                    assert!(t * n_head * cap.div_ceil(ATT_CHUNK) * (hd + 2) <= floats);
                }
            }
        }
        // two stages of K and V tiles (64 rows of hd + 8 halves) over an f16 cache, one over a Q8_0 cache
        assert_eq!(att_decode_smem(128, false), 2 * 2 * 64 * 136 * 2);
        assert_eq!(att_decode_smem(128, true), 2 * 64 * 136 * 2);
        for hd in [64, 80, 96, 128] {
            for q8 in [false, true] {
                // the warps' partials fit where the tiles were
                assert!(att_decode_smem(hd, q8) >= (2 * 4 * 16 + 4 * 16 * hd) * 4);
                assert!(att_decode_smem(hd, q8) <= 68 * 1024);
            }
        }
    }

    #[test]
    fn the_mmq_pipeline_fits_the_h200_and_not_cards_of_99_kib() {
        // the largest stage pair: Q8_0 gate and up rows, two stages of 128 × 272 bytes + 24 KiB of Q8 blocks
        assert_eq!(mq_smem(GgmlType::Q8_0, true, true) as usize, MQ_PIPE_MAX_SMEM);
        assert_eq!(MQ_PIPE_MAX_SMEM, 118_784);
        let mut pipelined = 0;
        for f in crate::quant::format::REGISTRY {
            let Some(sa) = mq_pipe_sa(f.ty) else { continue };
            pipelined += 1;
            // a stage of one row (8 blocks or a super-block), with room for a start 2 bytes into its first word
            let span = f.ty.type_size() * (256 / f.ty.block_size()).min(8);
            assert!(span <= sa && sa % 16 == 0 && (sa / 4) % 8 == 4, "{}: stride {sa} for {span} bytes", f.name);
            if span % 4 != 0 {
                assert!((span + 2).div_ceil(4) * 4 <= sa, "{}", f.name);
            }
            for gated in [false, true] {
                assert!(mq_smem(f.ty, gated, true) as usize <= MQ_PIPE_MAX_SMEM);
                // without the pipeline the loop stages one set of Q8 blocks (as stop 25's static array)
                assert_eq!(mq_smem(f.ty, gated, false), 8 * 64 * 12 * 4);
            }
        }
        assert_eq!(pipelined, 11, "the tensor-core formats but MXFP4 and the lattice IQ formats");
        assert_eq!(mq_smem(GgmlType::MXFP4, true, true), 0, "static shared memory");
        assert_eq!(mq_smem(GgmlType::IQ2_XS, true, true), 0, "static shared memory");
        assert_eq!(mq_smem(GgmlType::Q6_K, false, true), 2 * (64 * 240 + 8 * 64 * 12 * 4));
        // the wide dense kernels: the pipelined formats whose two stages of 128 rows leave two blocks per SM
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_NL,
            GgmlType::IQ4_XS,
        ] {
            assert!(mq_wide_fits(ty, true), "{ty:?}");
            assert!(!mq_wide_fits(ty, false), "{ty:?} without the pipelined loop");
        }
        for ty in [GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::IQ2_XS, GgmlType::F32] {
            assert!(!mq_wide_fits(ty, true), "{ty:?}");
        }
        if std::env::var_os("STRATA_GPU_MMQ_PIPE").is_none() {
            assert!(crate::backend::cuda::kernels::mmq_pipe_on(232_448)); // H100/H200 opt-in
            assert!(crate::backend::cuda::kernels::mmq_pipe_on(166_912)); // A100
            assert!(!crate::backend::cuda::kernels::mmq_pipe_on(101_376)); // sm_86/89/120
        }
    }

    #[test]
    fn a_router_split_keeps_whole_ranges_and_enough_blocks() {
        // Qwen3-30B-A3B's router over a 512-token chunk: 2 × 8 blocks, 16 ranges of 128 columns
        assert_eq!(mf_split_count(16, 2048), 16);
        assert_eq!(mf_split_count(512, 2048), 1, "enough blocks without a split");
        assert_eq!(mf_split_count(2, 200), 1, "ranges of at least 128 columns");
        assert_eq!(mf_split_count(1, 100_000), 16, "at most MF_SPLIT_MAX");
    }

    #[test]
    fn only_narrow_one_token_experts_quantize_h_in_the_down_kernel() {
        assert!(down_quantizes(true, 768)); // Qwen3-30B-A3B
        assert!(down_quantizes(true, 2048));
        assert!(!down_quantizes(true, 14336)); // Mixtral: the quantize kernel
        assert!(!down_quantizes(false, 768)); // groups of several tokens
        assert!(!down_quantizes(true, 100)); // not whole Q8 blocks
    }
}
