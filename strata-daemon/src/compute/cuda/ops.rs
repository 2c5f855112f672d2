//! Typed launches of the kernels in `kernels/strata.cu` on one stream. Shapes are in elements, addresses are
//! device addresses; each helper mirrors its kernel's parameter list.

use super::driver::{Args, DevBuf, Stream};
use super::kernels::Kernels;
use super::GpuError;
use crate::quant::GgmlType;

/// Bytes of one Q8 activation block on the device (`float d, s; int8 qs[32]`).
pub const Q8_BYTES: usize = 40;
/// Bytes of one expert group (`int slot, nt, tok[8], pair[8]`).
pub const GROUP_BYTES: usize = 72;
/// Tokens one group (or one product launch) handles at once.
pub const MAX_NT: usize = 8;
/// Warps per block of the product kernels.
pub const WARPS: u32 = 4;
/// Rows one warp computes in the dense and expert-down products (gate/up: the gate and up row of one index).
pub const RPW: usize = 2;

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

/// Kernel launches on one stream.
pub struct Ops<'a> {
    /// The kernels.
    pub k: &'a Kernels,
    /// The stream.
    pub s: &'a Stream,
}

impl Ops<'_> {
    /// `out[t*out_stride + r] (+)= Σ_c W[r, c] x[t, c]` for the stacked rows of up to three matrices of one
    /// format and width, `t` tokens (`xq`: Q8 blocks, `xf`: f32; the kernel reads the one its format uses).
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
    ) -> Result<(), GpuError> {
        let m0 = mats[0];
        let f = self.k.mmv(m0.ty, t == 1)?;
        let ptr = |i: usize| mats.get(i).map(|m| m.buf.ptr).unwrap_or(0);
        let rows = |i: usize| mats.get(i).map(|m| m.rows).unwrap_or(0) as i32;
        let total: usize = mats.iter().map(|m| m.rows).sum();
        let args = Args::new()
            .ptr(ptr(0))
            .ptr(ptr(1))
            .ptr(ptr(2))
            .i32(rows(0))
            .i32(rows(1))
            .i32(rows(2))
            .i32(m0.cols as i32)
            .ptr(xq)
            .ptr(xf)
            .i32(m0.cols as i32)
            .i32(t as i32)
            .ptr(out)
            .i32(out_stride as i32)
            .i32(accumulate as i32);
        f.launch(self.s, (total.div_ceil(WARPS as usize * RPW) as u32, 1, 1), 32 * WARPS, 0, args)
    }

    /// Q8 blocks of `n_blocks × 32` f32 values.
    pub fn quantize(&self, x: u64, out: u64, n_blocks: usize) -> Result<(), GpuError> {
        if n_blocks == 0 {
            return Ok(());
        }
        let args = Args::new().ptr(x).ptr(out).i32(n_blocks as i32);
        self.k.quantize_q8.launch(self.s, (n_blocks.div_ceil(WARPS as usize) as u32, 1, 1), 32 * WARPS, 0, args)
    }

    /// RMSNorm of `t` rows of `n` values with weights `w`, into f32 `out` and Q8 `outq`.
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
    ) -> Result<(), GpuError> {
        let args = Args::new().ptr(x).ptr(w).f32(eps).i32(n as i32).ptr(out).ptr(outq);
        self.k.rms_norm_q8.launch(self.s, (t as u32, 1, 1), 1024, 0, args)
    }

    /// RoPE + KV store (see the kernel); `pos` is the device address of pos0 (an `int`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_store(
        &self,
        qkv: u64,
        cs: u64,
        n_head: usize,
        n_head_kv: usize,
        hd: usize,
        n_rot: usize,
        pos: u64,
        t: usize,
        q: u64,
        kc: u64,
        vc: u64,
    ) -> Result<(), GpuError> {
        let args = Args::new()
            .ptr(qkv)
            .ptr(cs)
            .i32(n_head as i32)
            .i32(n_head_kv as i32)
            .i32(hd as i32)
            .i32(n_rot as i32)
            .ptr(pos)
            .ptr(q)
            .ptr(kc)
            .ptr(vc);
        let pairs = (n_head * hd / 2).max(n_head_kv * hd);
        self.k.rope_store.launch(self.s, (t as u32, pairs.div_ceil(128).min(64) as u32, 1), 128, 0, args)
    }

    /// Causal attention of `t` rows at positions `pos0..` over the cache; `pos` is the device address of pos0,
    /// `cap` ≥ pos0 + t the positions the shared memory is sized for.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        n_head: usize,
        n_head_kv: usize,
        hd: usize,
        pos: u64,
        cap: usize,
        t: usize,
        out: u64,
    ) -> Result<(), GpuError> {
        let smem = ((hd + cap) * 4) as u32;
        let scale = 1.0 / (hd as f32).sqrt();
        let args = Args::new()
            .ptr(q)
            .ptr(kc)
            .ptr(vc)
            .i32(n_head as i32)
            .i32(n_head_kv as i32)
            .i32(hd as i32)
            .ptr(pos)
            .f32(scale)
            .ptr(out);
        self.k.attention.launch(self.s, (n_head as u32, t as u32, 1), 128, smem, args)
    }

    /// Softmax + top-k of `t` rows of router logits.
    pub fn route_topk(
        &self,
        logits: u64,
        n_expert: usize,
        k: usize,
        t: usize,
        ids: u64,
        w: u64,
    ) -> Result<(), GpuError> {
        let args = Args::new().ptr(logits).i32(n_expert as i32).i32(k as i32).ptr(ids).ptr(w);
        self.k.route_topk.launch(self.s, (t as u32, 1, 1), 32, 0, args)
    }

    /// One group per routing entry from the device residency table (`table` already offset to the layer).
    pub fn build_groups(
        &self,
        ids: u64,
        n_pairs: usize,
        k: usize,
        table: u64,
        groups: u64,
        flag: u64,
    ) -> Result<(), GpuError> {
        let args = Args::new().ptr(ids).i32(n_pairs as i32).i32(k as i32).ptr(table).ptr(groups).ptr(flag);
        self.k.build_groups.launch(self.s, (n_pairs.div_ceil(128) as u32, 1, 1), 128, 0, args)
    }

    /// Expert gate/up (SwiGLU) over `n_groups` groups (`one`: no group has more than one token).
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
    ) -> Result<(), GpuError> {
        let args =
            Args::new().ptr(groups).ptr(slots).usize(slot_bytes).i32(ff as i32).i32(e as i32).ptr(xq).ptr(xf).ptr(h);
        self.k.gate_up(ty, one)?.launch(
            self.s,
            (ff.div_ceil(WARPS as usize) as u32, n_groups as u32, 1),
            32 * WARPS,
            0,
            args,
        )
    }

    /// Expert down over `n_groups` groups (`one`: no group has more than one token).
    #[allow(clippy::too_many_arguments)]
    pub fn expert_down(
        &self,
        ty: GgmlType,
        one: bool,
        groups: u64,
        n_groups: usize,
        slots: u64,
        slot_bytes: usize,
        down_off: usize,
        ff: usize,
        e: usize,
        hq: u64,
        hf: u64,
        out: u64,
    ) -> Result<(), GpuError> {
        let args = Args::new()
            .ptr(groups)
            .ptr(slots)
            .usize(slot_bytes)
            .usize(down_off)
            .i32(ff as i32)
            .i32(e as i32)
            .ptr(hq)
            .ptr(hf)
            .ptr(out);
        self.k.down(ty, one)?.launch(
            self.s,
            (e.div_ceil(WARPS as usize * RPW) as u32, n_groups as u32, 1),
            32 * WARPS,
            0,
            args,
        )
    }

    /// `x[i] += Σ_r flag·w·y + cpu[i]` (cpu = 0 for none).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        x: u64,
        y: u64,
        w: u64,
        flag: u64,
        cpu: u64,
        k: usize,
        e: usize,
        t: usize,
    ) -> Result<(), GpuError> {
        let args = Args::new().ptr(x).ptr(y).ptr(w).ptr(flag).ptr(cpu).i32(k as i32).i32(e as i32);
        self.k.moe_combine.launch(self.s, (e.div_ceil(256) as u32, t as u32, 1), 256, 0, args)
    }

    /// Dense SwiGLU: `h = silu(g) * u` from t rows of `[g | u]`.
    pub fn swiglu(&self, gu: u64, ff: usize, t: usize, h: u64) -> Result<(), GpuError> {
        let n = ff * t;
        let args = Args::new().ptr(gu).i32(ff as i32).i32(t as i32).ptr(h);
        self.k.swiglu.launch(self.s, (n.div_ceil(256).min(65535) as u32, 1, 1), 256, 0, args)
    }
}
