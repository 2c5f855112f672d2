//! CPU backend: matrix products over a worker pool.
//!
//! A weight matrix is `rows` rows of `cols` elements in one GGML format (GGML
//! order: each row contiguous). Activations ([`Act`]) are `t` token rows of
//! `cols` f32 values, quantized once to [`BlockQ8`] for the 8-bit-dot formats.
//! Work is split over output rows; each task walks its rows for all tokens so
//! a block of weights stays in cache across the tokens of a prefill chunk.

use crate::pool::WorkerPool;

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::quant::amx::WTile;
use crate::quant::dot512::X512;
use crate::quant::gemm512::{Gemm512, WRows, XTile};
use crate::quant::q4_wide::Q8Quads;
use crate::quant::{dot_q8_scalar, quantize_q8, vec_dot_f32_row, wide, BlockQ8, GgmlType, K512};

/// A weight matrix view: `rows` × `cols` elements of `ty` in `data` (`rows * ty.row_bytes(cols)` bytes when the
/// rows are packed; with a `stride`, row r starts at `r * stride`).
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    /// Raw bytes.
    pub data: &'a [u8],
    /// Format.
    pub ty: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Input columns (elements per row).
    pub cols: usize,
    /// Bytes from one row's start to the next; 0 = [`MatRef::row_bytes`] (rows packed). A larger stride views a
    /// range of whole blocks of each row of a wider matrix (`data` then starts at the range's first block).
    pub stride: usize,
}

impl<'a> MatRef<'a> {
    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }
    /// Row `r`'s bytes.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        let at = r * if self.stride == 0 { rb } else { self.stride };
        &self.data[at..at + rb]
    }
}

/// Activations: `t` rows of `n` f32 values and their 8-bit quantization.
#[derive(Default, Clone)]
pub struct Act {
    /// Tokens (rows).
    pub t: usize,
    /// Values per row.
    pub n: usize,
    /// `t * n` values, row-major.
    pub f: Vec<f32>,
    /// `t * n / 32` blocks (valid after [`Act::quantize`]).
    pub q: Vec<BlockQ8>,
    /// The same values quantized as ggml's Q8_K (one scale per 256: [`crate::quant::quantize_q8_k`]) for weights
    /// whose format pairs with them (the K-quants, IQ4_XS and the lattice IQ formats), when [`Act::with_q8k`] is
    /// set and `n` is a multiple of 256 (else empty: they read `q`, which their SIMD kernels do not take, so such
    /// products run the scalar reference: set `with_q8k` wherever those formats are multiplied).
    pub qk: Vec<BlockQ8>,
    /// Whether [`Act::quantize`] also fills `qk` (a model with K-quant or lattice IQ weights; off, the work is
    /// skipped).
    pub with_q8k: bool,
}

impl Act {
    /// Sets the shape (contents unspecified until written).
    pub fn resize(&mut self, t: usize, n: usize) {
        self.t = t;
        self.n = n;
        self.f.resize(t * n, 0.0);
    }
    /// Row `i` of the f32 values.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.f[i * self.n..(i + 1) * self.n]
    }
    /// Sizes the blocks for `t` rows: `q` always, `qk` where Q8_K blocks are wanted ([`Act::with_q8k`] and whole
    /// super-blocks; else emptied). Returns (fill `q`: `n` is a multiple of 32, fill `qk`); with a width that is not
    /// whole blocks `qk` is left as it was.
    fn size_blocks(&mut self) -> (bool, bool) {
        let nb = self.n / 32;
        self.q.resize(self.t * nb, BlockQ8::default());
        if !self.n.is_multiple_of(32) {
            return (false, false);
        }
        let q8k = self.with_q8k && self.n.is_multiple_of(256);
        if q8k {
            self.qk.resize(self.t * nb, BlockQ8::default());
        } else {
            self.qk.clear();
        }
        (true, q8k)
    }
    /// Quantizes every row to 8-bit blocks (`n` must be a multiple of 32).
    pub fn quantize(&mut self) {
        let (fill, q8k) = self.size_blocks();
        if fill {
            quantize_q8(&self.f, &mut self.q);
            if q8k {
                crate::quant::quantize_q8_k(&self.f, &mut self.qk);
            }
        }
    }
    /// [`Act::quantize`] with the rows split over `pool` (a prompt's rows; few rows run on the calling thread).
    /// Each block is quantized on its own, so the blocks are the same whichever way the rows are split.
    pub fn quantize_on(&mut self, pool: &WorkerPool) {
        let (t, n, nb) = (self.t, self.n, self.n / 32);
        if !n.is_multiple_of(32) || t < 2 * pool.threads() {
            self.quantize();
            return;
        }
        let (_, q8k) = self.size_blocks();
        let (q, qk) = (SyncBlocks(self.q.as_mut_ptr()), SyncBlocks(self.qk.as_mut_ptr()));
        let f = &self.f;
        par_rows(pool, t, |rows| {
            let (b0, nbs) = (rows.start * nb, rows.len() * nb);
            let x = &f[rows.start * n..rows.end * n];
            // SAFETY: this task's rows' blocks b0 .. b0 + nbs of the t·nb just sized; tasks' row ranges are
            // disjoint and the buffers outlive `par_rows`.
            quantize_q8(x, unsafe { std::slice::from_raw_parts_mut({ q }.0.add(b0), nbs) });
            if q8k {
                // SAFETY: as above, in `qk` (sized t·nb when q8k).
                crate::quant::quantize_q8_k(x, unsafe { std::slice::from_raw_parts_mut({ qk }.0.add(b0), nbs) });
            }
        });
    }
    /// Row `i` of the quantized blocks.
    pub fn qrow(&self, i: usize) -> &[BlockQ8] {
        let nb = self.n / 32;
        &self.q[i * nb..(i + 1) * nb]
    }
    /// Row `i` of the Q8_K-style blocks (empty when `n` is not a multiple of 256).
    pub fn qkrow(&self, i: usize) -> &[BlockQ8] {
        let nb = self.n / 32;
        self.qk.get(i * nb..(i + 1) * nb).unwrap_or(&[])
    }
}

/// A borrowed view of [`Act`]: `t` rows of `n` values and, where quantized, their `t * n / 32` blocks.
#[derive(Clone, Copy)]
pub struct ActRef<'a> {
    /// Tokens (rows).
    pub t: usize,
    /// Values per row.
    pub n: usize,
    /// `t * n` values, row-major.
    pub f: &'a [f32],
    /// `t * n / 32` blocks (empty when not quantized).
    pub q: &'a [BlockQ8],
    /// Their Q8_K-style quantization ([`Act::qk`]; empty when absent).
    pub qk: &'a [BlockQ8],
}

impl<'a> ActRef<'a> {
    /// Row `i` of the f32 values.
    pub fn row(&self, i: usize) -> &'a [f32] {
        &self.f[i * self.n..(i + 1) * self.n]
    }
    /// Row `i` of the quantized blocks.
    pub fn qrow(&self, i: usize) -> &'a [BlockQ8] {
        let nb = self.n / 32;
        &self.q[i * nb..(i + 1) * nb]
    }
    /// Row `i` of the blocks weights of `ty` multiply: the Q8_K-style ones for the K- and IQ quants when present
    /// (`Activation::Q8K`), else [`ActRef::qrow`].
    pub fn qrow_for(&self, ty: crate::quant::GgmlType, i: usize) -> &'a [BlockQ8] {
        let nb = self.n / 32;
        let k = crate::quant::format::lookup(ty).is_some_and(|f| f.activation == crate::quant::format::Activation::Q8K);
        match self.qk.get(i * nb..(i + 1) * nb) {
            Some(r) if k => r,
            _ => self.qrow(i),
        }
    }
}

impl Act {
    /// This activation set as an [`ActRef`].
    pub fn view(&self) -> ActRef<'_> {
        ActRef { t: self.t, n: self.n, f: &self.f, q: &self.q, qk: &self.qk }
    }
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);

/// [`SyncPtr`] for quantized blocks: tasks write disjoint blocks through it.
#[derive(Clone, Copy)]
struct SyncBlocks(*mut BlockQ8);
// SAFETY: users write disjoint blocks through this pointer (each block by one task).
unsafe impl Send for SyncBlocks {}
// SAFETY: as above.
unsafe impl Sync for SyncBlocks {}

/// Runs `f` over rows `0 .. t` split into contiguous ranges, up to two per pool thread (`t` at least 1).
pub fn par_rows(pool: &WorkerPool, t: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let tasks = (2 * pool.threads()).min(t).max(1);
    let per = t.div_ceil(tasks);
    pool.run(t.div_ceil(per), |k| f(k * per..((k + 1) * per).min(t)));
}
// SAFETY: users write disjoint index sets through this pointer (each element by one task).
unsafe impl Send for SyncPtr {}
// SAFETY: as above; no two tasks touch the same element.
unsafe impl Sync for SyncPtr {}

/// Arithmetic of the matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Activations quantized to 8-bit blocks for Q8_0/Q4_0/Q4_1 weights, as
    /// llama.cpp's CPU backend does (fast; the default).
    #[default]
    Q8Activations,
    /// The same 8-bit activations through the scalar reference kernels
    /// (checks the SIMD kernels over a whole model; slow).
    Q8Scalar,
    /// f32 activations against dequantized weights (the exact reference; slow).
    F32,
}

/// `out[t * w.rows + r] = Σ_c w[r, c] * x[t, c]` for every token `t` and row `r`.
///
/// `x` must have `x.n == w.cols` and, for Q8_0/Q4_0/Q4_1 weights with
/// [`Precision::Q8Activations`], be quantized. Runs on `pool`.
pub fn matmul(pool: &WorkerPool, w: MatRef<'_>, x: &Act, out: &mut [f32]) {
    matmul_with(pool, w, x, out, Precision::Q8Activations)
}

/// [`matmul`] with an explicit [`Precision`].
pub fn matmul_with(pool: &WorkerPool, w: MatRef<'_>, x: &Act, out: &mut [f32], precision: Precision) {
    matmul_batch(pool, &mut [MatJob { w, x, out }], precision);
}

/// One product of a [`matmul_batch`]: `out[t * w.rows + r] = Σ_c w[r, c] * x[t, c]`.
pub struct MatJob<'a> {
    /// The weights.
    pub w: MatRef<'a>,
    /// The activations (`x.n == w.cols`; quantized for block formats).
    pub x: &'a Act,
    /// At least `x.t × w.rows` outputs.
    pub out: &'a mut [f32],
}

/// Row chunking of one product for `threads` threads: (rows per chunk, chunks). Enough chunks to balance, each
/// big enough to amortize task overhead.
/// `amx`: the product runs on the AMX tiles ([`tiled`]), so chunks are whole groups of 16 rows where the matrix
/// has them (the same values either way: each row is computed on its own).
fn chunking(threads: usize, w: &MatRef<'_>, amx: bool) -> (usize, usize) {
    let rows = w.rows;
    let min_rows = (4096 / w.cols.max(1)).clamp(4, 256);
    let mut chunk = rows.div_ceil(threads * 4).max(min_rows).min(rows.max(1));
    if amx {
        chunk = chunk.next_multiple_of(crate::quant::amx::TILE).min(rows.max(1));
    }
    (chunk, rows.div_ceil(chunk))
}

/// Whether a product of `ty` weights with `t` tokens runs on the AMX tiles ([`rows_amx`]).
fn tiled(ty: GgmlType, t: usize, precision: Precision) -> bool {
    precision == Precision::Q8Activations && t >= AMX_TOKENS && crate::quant::amx_rows(ty)
}

/// Several independent products in one fork-join of `pool` (one task per row chunk of each product, chunked
/// as [`matmul_with`] chunks a single product, so every output has the same bits as there). For many small
/// products — the experts of a layer — this saves a pool dispatch per product. Panics on shape mismatches.
pub fn matmul_batch(pool: &WorkerPool, jobs: &mut [MatJob<'_>], precision: Precision) {
    let threads = pool.threads();
    // (first task, chunk, out pointer, weights, activations) per job
    let mut plan = Vec::with_capacity(jobs.len());
    let mut tasks = 0;
    for j in jobs.iter_mut() {
        let (w, x) = (&j.w, j.x);
        assert_eq!(x.n, w.cols, "matmul: activation width {} != matrix cols {}", x.n, w.cols);
        assert!(j.out.len() >= x.t * w.rows);
        let q8 = w.ty.uses_q8_activations() && precision != Precision::F32;
        if q8 {
            assert_eq!(x.q.len(), x.t * x.n / 32, "matmul: activations not quantized");
        }
        let (chunk, n) = chunking(threads, w, tiled(w.ty, x.t, precision));
        plan.push((tasks, chunk, SyncPtr(j.out.as_mut_ptr()), j.w, j.x));
        tasks += n;
    }
    let plan = &plan;
    let body = |task: usize| {
        // the job whose task range holds `task`
        let ji = plan.partition_point(|&(first, ..)| first <= task) - 1;
        let (first, chunk, p, w, x) = plan[ji];
        let r0 = (task - first) * chunk;
        rows_into_each(&[(&w, p)], &x.view(), r0, (r0 + chunk).min(w.rows), precision);
    };
    pool.run(tasks, body);
}

/// SiLU, `x · σ(x)`, as the CPU path computes it (`x / (1 + e^-x)`).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (`0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`, ggml's `gelu` and Gemma's `gelu_pytorch_tanh`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// [`gelu_tanh`] as llama.cpp's CPU backend computes it (`GGML_GELU_FP16`): the input rounded to f16 and looked
/// up in a table of f16 results, 0 at or below −10 and the identity at or above 10.
/// The table is built once (65,536 f16 results, 128 KiB), as llama.cpp builds its own, from the direct
/// computation (`gelu_tanh_f16_direct`).
#[inline]
pub fn gelu_tanh_f16(x: f32) -> f32 {
    static TABLE: std::sync::OnceLock<Box<[u16]>> = std::sync::OnceLock::new();
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let t = TABLE.get_or_init(|| {
            (0..=u16::MAX)
                .map(|b| half::f16::from_f32(gelu_tanh_f16_direct(half::f16::from_bits(b).to_f32())).to_bits())
                .collect()
        });
        half::f16::from_bits(t[half::f16::from_f32(x).to_bits() as usize]).to_f32()
    }
}

/// [`gelu_tanh_f16`] computed without the table (the table's entries, and its test's reference).
fn gelu_tanh_f16_direct(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        half::f16::from_f32(gelu_tanh(half::f16::from_f32(x).to_f32())).to_f32()
    }
}

/// swiglu_oai (gpt-oss's clamped SwiGLU, ggml's `ggml_swiglu_oai` with α = 1.702 and limit 7, in its order of
/// operations): `x = min(g, 7)`, `y = clamp(u, −7, 7)`, `x / (1 + e^(−1.702·x)) · (y + 1)`.
#[inline]
pub fn swiglu_oai(g: f32, u: f32) -> f32 {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    let x = g.min(LIMIT);
    let y = u.clamp(-LIMIT, LIMIT);
    x / (1.0 + (ALPHA * -x).exp()) * (y + 1.0)
}

/// The gated unit `h = act(g, u)` of a gated FFN, from its gate product `g` and up product `u`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GluAct {
    /// `silu(g) · u` (SwiGLU).
    Silu,
    /// `gelu_tanh(g) · u` (GeGLU, f32 arithmetic).
    GeluTanh,
    /// `gelu_tanh_f16(g) · u` (GeGLU through llama.cpp's f16 table).
    GeluTanhF16,
    /// [`swiglu_oai`].
    SwigluOai,
}

impl GluAct {
    /// The unit of an architecture's FFN activation in the arithmetic of `precision` (the f16 GELU table unless
    /// the exact f32 reference runs).
    pub fn of(act: crate::arch::FfnAct, precision: Precision) -> GluAct {
        match (act, precision) {
            (crate::arch::FfnAct::Silu, _) => GluAct::Silu,
            (crate::arch::FfnAct::GeluTanh, Precision::F32) => GluAct::GeluTanh,
            (crate::arch::FfnAct::GeluTanh, _) => GluAct::GeluTanhF16,
            (crate::arch::FfnAct::SwigluOai, _) => GluAct::SwigluOai,
        }
    }

    /// `h[i] = act(g[i] + bg[i], u[i] + bu[i])` (`bias` = `(bg, bu)`, none without one) over the shortest of the
    /// slices.
    pub fn apply(self, g: &[f32], u: &[f32], bias: Option<(&[f32], &[f32])>, h: &mut [f32]) {
        fn each(f: impl Fn(f32, f32) -> f32, g: &[f32], u: &[f32], bias: Option<(&[f32], &[f32])>, h: &mut [f32]) {
            match bias {
                None => h.iter_mut().zip(g).zip(u).for_each(|((h, &g), &u)| *h = f(g, u)),
                Some((bg, bu)) => {
                    for ((((h, &g), &u), &bg), &bu) in h.iter_mut().zip(g).zip(u).zip(bg).zip(bu) {
                        *h = f(g + bg, u + bu);
                    }
                }
            }
        }
        match self {
            GluAct::Silu => each(|g, u| silu(g) * u, g, u, bias, h),
            GluAct::GeluTanh => each(|g, u| gelu_tanh(g) * u, g, u, bias, h),
            GluAct::GeluTanhF16 => each(|g, u| gelu_tanh_f16(g) * u, g, u, bias, h),
            GluAct::SwigluOai => each(swiglu_oai, g, u, bias, h),
        }
    }
}

/// The gated unit of a [`GluJob`]: its activation and the biases of its gate and up rows.
#[derive(Debug, Clone, Copy)]
pub struct GluUnit<'a> {
    /// `h = act(g, u)`.
    pub act: GluAct,
    /// Biases of the job's `gate.rows` gate and up rows (`(gate, up)`, each `gate.rows` values), added to the
    /// products before the activation; `None` for none.
    pub bias: Option<(&'a [f32], &'a [f32])>,
}

impl GluUnit<'static> {
    /// SwiGLU without biases (llama, Qwen, OLMoE experts).
    pub const SILU: GluUnit<'static> = GluUnit { act: GluAct::Silu, bias: None };
}

/// One expert's gated unit of a [`glu_batch`]: `h[t, r] = act(gate_r · x_t, up_r · x_t)` ([`GluUnit`]: SwiGLU,
/// optionally with biases or another activation) for the `x.t` tokens and the `gate.rows` (= `up.rows`)
/// intermediate rows; `h` is then quantized to Q8 blocks when its width is a multiple of 32.
pub struct GluJob<'a> {
    /// Gate weights (`rows × x.n`).
    pub gate: MatRef<'a>,
    /// Up weights (same shape and format as `gate`).
    pub up: MatRef<'a>,
    /// The activations (quantized for block formats).
    pub x: &'a Act,
    /// Scratch for the gate products: at least `x.t × gate.rows` values.
    pub g: &'a mut [f32],
    /// Scratch for the up products: at least `x.t × gate.rows` values.
    pub u: &'a mut [f32],
    /// Output, resized here to `x.t × gate.rows`.
    pub h: &'a mut Act,
    /// The activation and biases.
    pub unit: GluUnit<'a>,
}

/// The gated hidden layer ([`GluUnit`]) of several experts in one fork-join of `pool`: each task computes a range of
/// rows of one expert's gate and up products for its tokens (a multiple of 32 rows when h is quantized, of 256 when
/// `h.with_q8k` asks for its Q8_K blocks too), then the gated unit and the Q8 blocks of that range — the same bits as
/// two [`matmul_with`] calls, the element-wise product and [`Act::quantize`], with no serial SwiGLU between the
/// products. `side` runs on the caller as in [`WorkerPool::run_with`]. Panics on shape mismatches.
pub fn glu_batch(pool: &WorkerPool, jobs: &mut [GluJob<'_>], precision: Precision, side: impl FnOnce()) {
    let plan = GluPlan::new(pool.threads(), jobs, precision);
    let body = |task: usize| {
        plan.task(task, precision);
    };
    pool.run_with(plan.tasks, body, side);
}

/// One expert of an [`experts_batch`]: its SwiGLU ([`GluJob`]; `glu.h` is the hidden layer, `x.t × ff`) and
/// then its down product `out[t * down.rows + r] = Σ_c down[r, c] * h[t, c]` (`down.cols == glu.gate.rows`).
pub struct ExpertJob<'a> {
    /// Gate, up and SwiGLU.
    pub glu: GluJob<'a>,
    /// The down weights (`rows × ff`).
    pub down: MatRef<'a>,
    /// At least `x.t × down.rows` outputs.
    pub out: &'a mut [f32],
}

/// Several experts' SwiGLU and down products in one fork-join of `pool` (instead of a [`glu_batch`] and a
/// [`matmul_batch`], with a barrier between them): the gate/up tasks of every expert come first, then the
/// down tasks, each of which starts as soon as its own expert's gate/up tasks are done (tasks are taken in
/// order, so every gate/up task is running or done when a down task waits for it). The same bits as the two
/// batches. `side` runs on the caller as in [`WorkerPool::run_with`]. Panics on shape mismatches.
pub fn experts_batch(pool: &WorkerPool, jobs: &mut [ExpertJob<'_>], precision: Precision, side: impl FnOnce()) {
    let threads = pool.threads();
    // (first down task, chunk, down weights, outputs) per expert, checked before the glu plan borrows the jobs
    let mut downs = Vec::with_capacity(jobs.len());
    for j in jobs.iter_mut() {
        let (w, t) = (&j.down, j.glu.x.t);
        assert_eq!(w.cols, j.glu.gate.rows, "experts: down cols {} != ff {}", w.cols, j.glu.gate.rows);
        assert!(j.out.len() >= t * w.rows, "experts: down output too small");
        if w.ty.uses_q8_activations() && precision != Precision::F32 {
            assert_eq!(w.cols % 32, 0, "experts: h ({} wide) cannot be quantized for {:?} down weights", w.cols, w.ty);
        }
        downs.push((chunking(threads, w, tiled(w.ty, t, precision)), j.down, SyncPtr(j.out.as_mut_ptr())));
    }
    let mut glu: Vec<GluJob<'_>> = jobs
        .iter_mut()
        .map(|j| GluJob {
            gate: j.glu.gate,
            up: j.glu.up,
            x: j.glu.x,
            g: &mut *j.glu.g,
            u: &mut *j.glu.u,
            h: &mut *j.glu.h,
            unit: j.glu.unit,
        })
        .collect();
    let plan = GluPlan::new(threads, &mut glu, precision);
    let mut first = Vec::with_capacity(downs.len());
    let mut n_down = 0;
    for &((_, n), ..) in &downs {
        first.push(plan.tasks + n_down);
        n_down += n;
    }
    let done: Vec<AtomicUsize> = (0..downs.len()).map(|_| AtomicUsize::new(0)).collect();
    let failed = AtomicBool::new(false);
    let body = |task: usize| {
        if task < plan.tasks {
            // a gate/up task panicking on the caller's thread must not leave the down tasks on the workers waiting
            // for it (the caller then stops handing out tasks and waits for the running ones)
            struct Poison<'a>(&'a AtomicBool);
            impl Drop for Poison<'_> {
                fn drop(&mut self) {
                    if std::thread::panicking() {
                        self.0.store(true, Ordering::Release);
                    }
                }
            }
            let _p = Poison(&failed);
            let ji = plan.task(task, precision);
            done[ji].fetch_add(1, Ordering::Release);
            return;
        }
        let ji = first.partition_point(|&f| f <= task) - 1;
        let ((chunk, _), w, out) = downs[ji];
        let e = &plan.jobs[ji];
        let mut spins = 0u32;
        while done[ji].load(Ordering::Acquire) < e.n {
            if failed.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: every task of this expert's SwiGLU is done (the Acquire load above pairs with their Release
        // increments), so nothing writes its h any more; the buffers were sized by GluPlan::new and are not
        // reallocated while the region runs.
        let h = unsafe {
            let (t, n) = (e.t, e.rows);
            let q = if n % 32 == 0 { std::slice::from_raw_parts(e.hq.0, t * n / 32) } else { &[][..] };
            // the Q8_K blocks where the glu wrote them (h.with_q8k: K-quant and IQ down weights)
            let qk = e.hqk.map_or(&[][..], |p| std::slice::from_raw_parts(p.0, t * n / 32));
            ActRef { t, n, f: std::slice::from_raw_parts(e.hp.0, t * n), q, qk }
        };
        let r0 = (task - first[ji]) * chunk;
        rows_into_each(&[(&w, out)], &h, r0, (r0 + chunk).min(w.rows), precision);
    };
    pool.run_with(plan.tasks + n_down, body, side);
}

/// One expert of a [`GluPlan`]: its first task, rows per task, task count and raw views of its buffers.
struct GluEntry<'a> {
    first: usize,
    chunk: usize,
    n: usize,
    t: usize,
    rows: usize,
    gate: MatRef<'a>,
    up: MatRef<'a>,
    x: ActRef<'a>,
    gp: SyncPtr,
    up_p: SyncPtr,
    hp: SyncPtr,
    hq: SyncQ8,
    /// h's Q8_K blocks, where [`Act::with_q8k`] asked for them.
    hqk: Option<SyncQ8>,
    unit: GluUnit<'a>,
}

/// The tasks of a batch of SwiGLU jobs (h resized; shapes checked).
struct GluPlan<'a> {
    jobs: Vec<GluEntry<'a>>,
    tasks: usize,
}

impl<'a> GluPlan<'a> {
    fn new(threads: usize, jobs: &mut [GluJob<'a>], precision: Precision) -> GluPlan<'a> {
        let mut plan = Vec::with_capacity(jobs.len());
        let mut tasks = 0;
        for j in jobs.iter_mut() {
            let (g, u, x) = (&j.gate, &j.up, j.x);
            let rows = g.rows;
            assert!(u.rows == rows && u.cols == g.cols && u.ty == g.ty, "glu: gate and up differ");
            assert_eq!(x.n, g.cols, "glu: activation width {} != matrix cols {}", x.n, g.cols);
            assert!(j.g.len() >= x.t * rows && j.u.len() >= x.t * rows, "glu: scratch too small");
            if g.ty.uses_q8_activations() && precision != Precision::F32 {
                assert_eq!(x.q.len(), x.t * x.n / 32, "glu: activations not quantized");
            }
            if let Some((bg, bu)) = j.unit.bias {
                assert!(bg.len() >= rows && bu.len() >= rows, "glu: {} gate/up biases for {rows} rows", bg.len());
            }
            j.h.resize(x.t, rows);
            // as Act::quantize sizes it: Q8_0 blocks, and the Q8_K ones where h.with_q8k asks for them (K-quant or IQ
            // down weights) and the width is whole super-blocks
            j.h.q.resize(x.t * (rows / 32), BlockQ8::default());
            let q8k = j.h.with_q8k && rows % 256 == 0 && rows > 0;
            if q8k {
                j.h.qk.resize(x.t * (rows / 32), BlockQ8::default());
            } else {
                j.h.qk.clear();
            }
            // whole Q8 blocks (Q8_K super-blocks) per task when h is quantized
            let chunk = chunking(threads, g, tiled(g.ty, x.t, precision)).0;
            let unit = if q8k { 256 } else { 32 };
            let chunk = if rows % 32 == 0 { chunk.next_multiple_of(unit).min(rows) } else { chunk }.max(1);
            let n = rows.div_ceil(chunk);
            plan.push(GluEntry {
                first: tasks,
                chunk,
                n,
                t: x.t,
                rows,
                gate: *g,
                up: *u,
                x: x.view(),
                gp: SyncPtr(j.g.as_mut_ptr()),
                up_p: SyncPtr(j.u.as_mut_ptr()),
                hp: SyncPtr(j.h.f.as_mut_ptr()),
                hq: SyncQ8(j.h.q.as_mut_ptr()),
                hqk: q8k.then_some(SyncQ8(j.h.qk.as_mut_ptr())),
                unit: j.unit,
            });
            tasks += n;
        }
        GluPlan { jobs: plan, tasks }
    }

    /// Runs task `task` (< `self.tasks`); returns its job's index.
    fn task(&self, task: usize, precision: Precision) -> usize {
        let ji = self.jobs.partition_point(|e| e.first <= task) - 1;
        let e = &self.jobs[ji];
        let (rows, x) = (e.rows, &e.x);
        let r0 = (task - e.first) * e.chunk;
        let r1 = (r0 + e.chunk).min(rows);
        rows_into_each(&[(&e.gate, e.gp), (&e.up, e.up_p)], x, r0, r1, precision);
        for ti in 0..x.t {
            let (a, b) = (ti * rows + r0, ti * rows + r1);
            // SAFETY: [a, b) lies inside this job's `x.t × rows` g, u and h values (asserted / resized in
            // GluPlan::new), and only this task touches rows r0..r1 of token ti; the products above wrote them.
            let (gv, uv, hv) = unsafe {
                (
                    std::slice::from_raw_parts(e.gp.0.add(a), b - a),
                    std::slice::from_raw_parts(e.up_p.0.add(a), b - a),
                    std::slice::from_raw_parts_mut(e.hp.0.add(a), b - a),
                )
            };
            e.unit.act.apply(gv, uv, e.unit.bias.map(|(bg, bu)| (&bg[r0..r1], &bu[r0..r1])), hv);
            if rows % 32 == 0 {
                // SAFETY: rows, r0 and r1 are multiples of 32 here, so blocks a/32 .. b/32 are this task's alone
                // and lie inside h's `x.t × rows / 32` blocks.
                let q = unsafe { std::slice::from_raw_parts_mut(e.hq.0.add(a / 32), (b - a) / 32) };
                quantize_q8(hv, q);
                if let Some(qk) = e.hqk {
                    // SAFETY: with Q8_K blocks r0 and r1 are multiples of 256 (GluPlan::new), so these blocks are
                    // this task's whole super-blocks, inside h's `x.t × rows / 32` Q8_K blocks.
                    let qk = unsafe { std::slice::from_raw_parts_mut(qk.0.add(a / 32), (b - a) / 32) };
                    crate::quant::quantize_q8_k(hv, qk);
                }
            }
        }
        ji
    }
}

/// A shareable raw pointer to Q8 blocks (tasks write disjoint ranges).
#[derive(Clone, Copy)]
struct SyncQ8(*mut BlockQ8);
// SAFETY: only used for disjoint writes from pool tasks while the owner waits in `WorkerPool::run_with`.
unsafe impl Send for SyncQ8 {}
// SAFETY: as above.
unsafe impl Sync for SyncQ8 {}

thread_local! {
    /// A pool thread's activations rearranged for the wide Q4_0/Q4_1 kernel (one token row at a time).
    static QUADS: RefCell<Q8Quads> = RefCell::new(Q8Quads::default());
    /// A pool thread's activations laid out for the AVX-512 kernels, one per token of the product in hand.
    static X512S: RefCell<Vec<X512>> = const { RefCell::new(Vec::new()) };
    /// A pool thread's activation tiles and unpacked rows for the AVX-512 GEMM.
    static GEMM: RefCell<(Vec<XTile>, WRows)> = RefCell::new((Vec::new(), WRows::default()));
    /// A pool thread's zero-padded last 16 tokens and unpacked rows for the AMX kernels.
    static AMX: RefCell<(Vec<BlockQ8>, WTile)> = RefCell::new((Vec::new(), WTile::default()));
}

/// Tokens from which products of the AMX formats go through the tiles ([`rows_amx`]) where the CPU has them.
const AMX_TOKENS: usize = 8;

/// Rows `r0..r1` of several products of the same activations (each output `x.t × w.rows`, written through its
/// pointer) (gate and up) into their outputs: each token's
/// activations are rearranged once for all of them where the wide Q4_0/Q4_1 kernel runs. Every output has the bits
/// of a lone product's rows.
fn rows_into_each(mats: &[(&MatRef<'_>, SyncPtr)], x: &ActRef<'_>, r0: usize, r1: usize, precision: Precision) {
    let simd = precision == Precision::Q8Activations;
    if simd && x.t >= AMX_TOKENS && mats.iter().any(|(w, _)| crate::quant::amx_rows(w.ty)) {
        if mats.iter().all(|(w, _)| crate::quant::amx_rows(w.ty)) {
            rows_amx(mats, x, r0, r1);
        } else {
            // formats that differ (defensive: GluPlan asserts that a gate and its up agree): each product on its own
            // path, with the bits it has alone
            for m in mats {
                rows_into_each(std::slice::from_ref(m), x, r0, r1, precision);
            }
        }
        return;
    }
    if simd && mats.iter().all(|(w, _)| wide(w.ty)) {
        // the same bits as dot_q8 / dot_q8_x4 there, with the activations rearranged once per token, not per call
        QUADS.with(|q| {
            let mut q = q.borrow_mut();
            for ti in 0..x.t {
                q.prepare(x.qrow(ti));
                for &(w, p) in mats {
                    let x4 = |r: usize| q.dot_x4(w.ty, [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)]);
                    put_rows(p, ti * w.rows, r0, r1, Some(x4), |r| q.dot(w.ty, w.row(r)));
                }
            }
        });
        return;
    }
    for &(w, p) in mats {
        rows_general(w, x, p, r0, r1, precision);
    }
}

/// Rows `r0..r1` of products of the same activations through the AMX tiles ([`crate::quant::amx`]): per product,
/// each group of 16 rows unpacked once and multiplied with every 16 tokens (read in place; a short last group through
/// a zero-padded copy). Every output has the bits of the scalar dot product.
fn rows_amx(mats: &[(&MatRef<'_>, SyncPtr)], x: &ActRef<'_>, r0: usize, r1: usize) {
    use crate::quant::amx::{Tiles, TILE};
    AMX.with(|b| {
        let (tail, wt) = &mut *b.borrow_mut();
        let nb = x.n / 32;
        let full = x.t / TILE;
        if !x.t.is_multiple_of(TILE) {
            tail.clear();
            tail.extend_from_slice(&x.q[full * TILE * nb..x.t * nb]);
            tail.resize(TILE * nb, BlockQ8::default());
        }
        let tiles = Tiles::configure();
        let mut out = [[0f32; TILE]; TILE];
        for &(w, p) in mats {
            let mut r = r0;
            while r < r1 {
                let re = (r + TILE).min(r1);
                let mut rows: [&[u8]; TILE] = [&[]; TILE];
                for (k, row) in rows.iter_mut().enumerate().take(re - r) {
                    *row = w.row(r + k);
                }
                wt.unpack(w.ty, &rows[..re - r], nb);
                for i in 0..x.t.div_ceil(TILE) {
                    let xs = if i < full { &x.q[i * TILE * nb..(i + 1) * TILE * nb] } else { &tail[..] };
                    tiles.times(wt, xs, &mut out);
                    for (j, o) in out.iter().enumerate().take((x.t - i * TILE).min(TILE)) {
                        // SAFETY: token i·16 + j < t and rows r..re inside the matrix, so the range lies inside `out`
                        // (`t × rows`, asserted where the job was planned); each (token, row) is written by exactly
                        // one task (row ranges are disjoint).
                        unsafe {
                            std::ptr::copy_nonoverlapping(o.as_ptr(), p.0.add((i * TILE + j) * w.rows + r), re - r)
                        };
                    }
                }
                r = re;
            }
        }
    })
}

/// Rows `r0..r1` of the product for tokens `t0..`, N at a time through the N-token kernel `k` while whole groups of
/// N remain and the kernel takes their activations; returns the first token not done (the caller does the rest).
fn rows_tokens<const N: usize>(
    k: crate::quant::Q8Tn<N>,
    w: &MatRef<'_>,
    x: &ActRef<'_>,
    p: SyncPtr,
    r0: usize,
    r1: usize,
    mut t0: usize,
) -> usize {
    while t0 + N <= x.t {
        let xs: [&[crate::quant::BlockQ8]; N] = std::array::from_fn(|j| x.qrow_for(w.ty, t0 + j));
        // the activations checked once for the whole product, not per row
        let Some(k) = k.takes(xs) else { break };
        for r in r0..r1 {
            let v = k.dot(w.row(r), xs);
            for (j, v) in v.into_iter().enumerate() {
                // SAFETY: token t0 + j < t and row r in r0..r1 inside the matrix, so (t0 + j) * rows + r lies inside
                // `out` (`t × rows`, asserted where the job was planned); each (token, row) is written by exactly one
                // task (row ranges are disjoint).
                unsafe { *p.0.add((t0 + j) * w.rows + r) = v };
            }
        }
        t0 += N;
    }
    t0
}

/// One product's rows through the AVX-512 GEMM or row kernels where they apply, else eight and then four tokens at
/// a time through [`crate::quant::q8_t8`] / [`crate::quant::q8_t4`] where the format has those kernels, and the rest
/// through [`crate::quant::dot_q8_x4`] / [`crate::quant::dot_q8`] (or the scalar and f32 references).
fn rows_general(w: &MatRef<'_>, x: &ActRef<'_>, p: SyncPtr, r0: usize, r1: usize, precision: Precision) {
    let q8 = w.ty.uses_q8_activations() && precision != Precision::F32;
    let simd = precision == Precision::Q8Activations;
    if let Some(g) = crate::quant::gemm512_of(w.ty).filter(|_| q8 && simd && x.t >= GEMM_TOKENS) {
        if rows_gemm(w, x, p, r0, r1, &g) {
            return;
        }
    }
    if let Some(k) = crate::quant::k512(w.ty).filter(|_| q8 && simd && r1 - r0 >= ROWS_512) {
        rows_512(w, x, p, r0, r1, k);
        return;
    }
    // eight, then four tokens at a time where the format unpacks a row once for them (the same bits per token)
    let mut t0 = 0;
    if q8 && simd {
        if let Some(k) = crate::quant::q8_t8(w.ty) {
            t0 = rows_tokens(k, w, x, p, r0, r1, t0);
        }
        if let Some(k) = crate::quant::q8_t4(w.ty) {
            t0 = rows_tokens(k, w, x, p, r0, r1, t0);
        }
    }
    for ti in t0..x.t {
        let xq = x.qrow_for(w.ty, ti);
        // the activations checked once for the format's kernels, not per call
        let k = (q8 && simd).then(|| crate::quant::q8_rows(w.ty, xq));
        let rows4 = |r: usize| [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)];
        // float formats: four rows per lane-parallel call (each row the one-row function's bits)
        let float4 = if q8 { None } else { crate::quant::format::lookup(w.ty).and_then(|f| f.f32_dot4) };
        let x4 = (k.is_some() || float4.is_some()).then_some({
            move |r: usize| match (k, float4) {
                (Some(k), _) => k.x4(rows4(r)),
                (None, Some(f)) => f(rows4(r), x.row(ti)),
                (None, None) => unreachable!("x4 is made only with a kernel"),
            }
        });
        let one = |r: usize| {
            let row = w.row(r);
            match (q8, simd) {
                (true, true) => k.expect("made for q8 && simd").one(row),
                (true, false) => dot_q8_scalar(w.ty, row, xq),
                _ => vec_dot_f32_row(w.ty, row, x.row(ti)),
            }
        };
        put_rows(p, ti * w.rows, r0, r1, x4, one);
    }
}

/// Tokens from which prefill products go through the AVX-512 GEMM ([`crate::quant::gemm512`], 16 tokens per
/// vector) rather than the row kernels.
const GEMM_TOKENS: usize = 8;

/// One product's rows through the AVX-512 GEMM ([`crate::quant::gemm512`]): the activations interleaved in tiles of
/// 16 tokens, then per 4 rows: unpacked once, multiplied with every tile. Returns false (nothing written) where the
/// format needs Q8_K activations and the product's are not, for the row kernels to serve.
fn rows_gemm(w: &MatRef<'_>, x: &ActRef<'_>, p: SyncPtr, r0: usize, r1: usize, g: &Gemm512) -> bool {
    use crate::quant::gemm512::LANES;
    GEMM.with(|b| {
        let (tiles, wr) = &mut *b.borrow_mut();
        let nt = x.t.div_ceil(LANES);
        if tiles.len() < nt {
            tiles.resize_with(nt, XTile::default);
        }
        for (i, tile) in tiles.iter_mut().enumerate().take(nt) {
            let mut xs: [&[BlockQ8]; LANES] = [&[]; LANES];
            let t0 = i * LANES;
            let tn = (x.t - t0).min(LANES);
            for (j, xj) in xs.iter_mut().enumerate().take(tn) {
                *xj = x.qrow_for(w.ty, t0 + j);
            }
            tile.prepare(&xs[..tn]);
            if g.needs_uniform() && !tile.uniform() {
                return false;
            }
        }
        let (n, rb) = (w.cols, w.row_bytes());
        let mut out = [[0f32; LANES]; 4];
        let mut r = r0;
        while r < r1 {
            let re = (r + 4).min(r1);
            let mut rows: [&[u8]; 4] = [&[]; 4];
            for (k, row) in rows.iter_mut().enumerate().take(re - r) {
                *row = w.row(r + k);
            }
            wr.unpack(g, &rows[..re - r], n, rb);
            for (i, tile) in tiles.iter().enumerate().take(nt) {
                wr.times(tile, &mut out);
                for (k, o) in out.iter().enumerate().take(re - r) {
                    for (j, v) in o.iter().enumerate().take(tile.tokens()) {
                        // SAFETY: token i·16 + j < t and row r + k < r1 inside the matrix, so the index lies inside
                        // `out` (`t × rows`, asserted where the job was planned); each (token, row) is written by
                        // exactly one task (row ranges are disjoint).
                        unsafe { *p.0.add((i * LANES + j) * w.rows + r + k) = *v };
                    }
                }
            }
            r = re;
        }
        true
    })
}

/// Rows from which a task lays its activations out for the AVX-512 row kernels ([`rows_512`]); smaller tasks (the
/// hybrid GPU path's expert slices) take the AVX2 kernels, whose bits these kernels share (and
/// [`crate::quant::dot_q8`] / [`crate::quant::dot_q8_x4`], which other callers use, are the AVX2 kernels too).
const ROWS_512: usize = 32;

/// One product's rows through the AVX-512 kernels ([`crate::quant::dot512`]): each token's activations laid out once,
/// four tokens per row pass while four remain, then one token four rows at a time.
fn rows_512(w: &MatRef<'_>, x: &ActRef<'_>, p: SyncPtr, r0: usize, r1: usize, k: K512) {
    X512S.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < x.t {
            b.resize_with(x.t, X512::default);
        }
        for (ti, bt) in b.iter_mut().enumerate().take(x.t) {
            bt.prepare(x.qrow_for(w.ty, ti));
        }
        let put = |ti: usize, r: usize, v: f32| {
            // SAFETY: token ti < t and row r in r0..r1 inside the matrix, so ti * rows + r lies inside `out`
            // (`t × rows`, asserted where the job was planned); each (token, row) is written by exactly one task
            // (row ranges are disjoint).
            unsafe { *p.0.add(ti * w.rows + r) = v };
        };
        // rows in tiles that stay in the core's cache while every token passes over them
        const TILE: usize = 16;
        let mut rt = r0;
        while rt < r1 {
            let re = (rt + TILE).min(r1);
            let mut t0 = 0;
            while t0 + 4 <= x.t {
                let xs = [&b[t0], &b[t0 + 1], &b[t0 + 2], &b[t0 + 3]];
                for r in rt..re {
                    for (j, v) in k.four(w.row(r), xs).into_iter().enumerate() {
                        put(t0 + j, r, v);
                    }
                }
                t0 += 4;
            }
            for ti in t0..x.t {
                let mut r = rt;
                while r + 4 <= re {
                    let v = k.rows4([w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)], &b[ti]);
                    for (j, v) in v.into_iter().enumerate() {
                        put(ti, r + j, v);
                    }
                    r += 4;
                }
                for r in r..re {
                    put(ti, r, k.one(w.row(r), &b[ti]));
                }
            }
            rt = re;
        }
    })
}

/// Writes rows `r0..r1` of one token's output at `p[base + r]`: four at a time through `x4` (rows r..r+4) while
/// it is given and four remain, the rest through `one`.
fn put_rows(
    p: SyncPtr,
    base: usize,
    r0: usize,
    r1: usize,
    x4: Option<impl Fn(usize) -> [f32; 4]>,
    one: impl Fn(usize) -> f32,
) {
    let mut r = r0;
    if let Some(x4) = x4 {
        while r + 4 <= r1 {
            for (j, v) in x4(r).into_iter().enumerate() {
                // SAFETY: the callers pass base = ti * rows with ti < t and rows r0..r1 within the matrix, so
                // base + r + j lies inside `out` (`t × rows`, asserted where the job was planned); each (ti, row)
                // is written by exactly one task (row ranges are disjoint).
                unsafe { *p.0.add(base + r + j) = v };
            }
            r += 4;
        }
    }
    for r in r..r1 {
        // SAFETY: as above.
        unsafe { *p.0.add(base + r) = one(r) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f16 GELU table gives the direct computation's bits for every f16 input (and a few f32 ones between).
    #[test]
    fn gelu_table_matches_the_direct_f16_gelu() {
        for b in 0..=u16::MAX {
            let x = half::f16::from_bits(b).to_f32();
            if x.is_nan() {
                continue;
            }
            assert_eq!(gelu_tanh_f16(x).to_bits(), gelu_tanh_f16_direct(x).to_bits(), "{x}");
        }
        for x in [0.1234f32, -3.33, 9.99, -9.99, 1e-9] {
            assert_eq!(gelu_tanh_f16(x).to_bits(), gelu_tanh_f16_direct(x).to_bits(), "{x}");
        }
    }

    /// Random block-format rows: each block a small f16 scale (0.0625) and random quant bytes.
    fn random_blocks(ty: GgmlType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let (bb, qb) = match ty {
            GgmlType::Q4_0 => (18, 16),
            _ => (34, 32),
        };
        let mut v = Vec::new();
        for _ in 0..rows * cols / 32 {
            v.extend_from_slice(&0x2c00u16.to_le_bytes());
            for _ in 0..qb {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                v.push((*seed >> 33) as u8);
            }
        }
        assert_eq!(v.len(), rows * cols / 32 * bb);
        v
    }

    /// Quantizing a prompt's rows on the pool gives the blocks of the one-thread pass (Q8_0 and Q8_K), for row
    /// counts that split evenly and not, and a row width that has no Q8_K blocks.
    #[test]
    fn quantizing_rows_on_the_pool_gives_the_same_blocks() {
        let pool = WorkerPool::new(2).expect("pool");
        for (t, n) in [(4usize, 512usize), (7, 256), (13, 1024), (9, 96)] {
            let mut a = Act { with_q8k: true, ..Act::default() };
            a.resize(t, n);
            for (i, v) in a.f.iter_mut().enumerate() {
                *v = ((i * 7919 % 1000) as f32 - 500.0) / 37.0;
            }
            let mut b = a.clone();
            a.quantize();
            b.quantize_on(&pool);
            let same = |x: &[BlockQ8], y: &[BlockQ8]| {
                x.len() == y.len()
                    && x.iter()
                        .zip(y)
                        .all(|(x, y)| x.d.to_bits() == y.d.to_bits() && x.qs == y.qs && x.s.to_bits() == y.s.to_bits())
            };
            assert!(same(&a.q, &b.q) && same(&a.qk, &b.qk), "{t} rows of {n}");
            assert_eq!(b.qk.is_empty(), n % 256 != 0, "{t} rows of {n}");
        }
    }

    #[test]
    fn strided_column_ranges_add_up_to_the_whole_product() {
        let pool = WorkerPool::new(2).expect("pool");
        let (rows, cols, k, t) = (12, 512, 256, 3);
        let mut seed = 7u64;
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
            let w = random_blocks(ty, rows, cols, &mut seed);
            let rb = ty.row_bytes(cols);
            let mut x = Act::default();
            x.resize(t, cols);
            for (i, v) in x.f.iter_mut().enumerate() {
                *v = ((i * 37 % 101) as f32 - 50.0) / 25.0;
            }
            x.quantize();
            let part = |c0: usize, c1: usize| {
                let mut a = Act::default();
                a.resize(t, c1 - c0);
                for i in 0..t {
                    a.f[i * (c1 - c0)..(i + 1) * (c1 - c0)].copy_from_slice(&x.row(i)[c0..c1]);
                }
                a.quantize();
                let m = MatRef { data: &w[ty.row_bytes(c0)..], ty, rows, cols: c1 - c0, stride: rb };
                let mut out = vec![0f32; t * rows];
                matmul_with(&pool, m, &a, &mut out, Precision::Q8Activations);
                out
            };
            let mut full = vec![0f32; t * rows];
            matmul_with(&pool, MatRef { data: &w, ty, rows, cols, stride: 0 }, &x, &mut full, Precision::Q8Activations);
            let (head, tail) = (part(0, k), part(k, cols));
            let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.0);
            for i in 0..t * rows {
                let d = (full[i] - head[i] - tail[i]).abs();
                assert!(d <= 1e-5 * scale, "{ty:?} [{i}]: {} vs {} + {}", full[i], head[i], tail[i]);
            }
        }
    }

    fn mat(data: &[u8], ty: GgmlType, rows: usize, cols: usize) -> MatRef<'_> {
        MatRef { data, ty, rows, cols, stride: 0 }
    }

    /// Test activations: `t` rows of `n` values in [-2, 2).
    fn act(t: usize, n: usize, salt: usize) -> Act {
        let mut x = Act::default();
        x.resize(t, n);
        for (i, v) in x.f.iter_mut().enumerate() {
            *v = (((i + salt) * 37 % 101) as f32 - 50.0) / 25.0;
        }
        x.quantize();
        x
    }

    /// The AMX rows of a task (the tiles, a short last group of tokens and of rows, two products of one activation
    /// set, row ranges that start inside a group) give every (token, row) the bits of the scalar dot product, on a CPU
    /// with AMX whether or not `STRATA_AMX=1` asks the matmul for them; the matmul routes products there only when
    /// asked. Elsewhere the tiles cannot run, which the test states and checks.
    #[test]
    fn amx_rows_give_the_scalar_bits() {
        if !crate::quant::amx::available() {
            assert!(!crate::quant::amx_rows(GgmlType::Q4_0), "tiles asked for without the hardware");
            eprintln!("no AMX on this CPU: the tile rows are not run here");
            return;
        }
        let mut seed = 7u64;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
            let (rows, cols) = (37, 96);
            let src = if ty == GgmlType::Q4_0 { ty } else { GgmlType::Q8_0 };
            let mut data = random_blocks(src, rows, cols, &mut seed);
            if ty == GgmlType::Q4_1 {
                // 34-byte blocks cut to Q4_1's 20: their scale, the minimum −1/32 (f16 0xa800), 16 bytes of nibbles
                data = data.chunks_exact(34).flat_map(|b| [&b[..2], &[0x00, 0xa8][..], &b[2..18]].concat()).collect();
            }
            if ty == GgmlType::Q5_0 {
                // 34-byte blocks cut to Q5_0's 22: scale, 32 fifth bits, 16 bytes of nibbles
                data = data.chunks_exact(34).flat_map(|b| b[..22].to_vec()).collect();
            }
            let w = mat(&data, ty, rows, cols);
            for t in [8, 20, 33] {
                let x = act(t, cols, t);
                let (mut a, mut b) = (vec![0f32; t * rows], vec![0f32; t * rows]);
                let (pa, pb) = (SyncPtr(a.as_mut_ptr()), SyncPtr(b.as_mut_ptr()));
                // rows 0..21 of two products at once, then rows 21..37 of the first alone
                rows_amx(&[(&w, pa), (&w, pb)], &x.view(), 0, 21);
                rows_amx(&[(&w, pa)], &x.view(), 21, rows);
                for ti in 0..t {
                    for r in 0..rows {
                        let want = dot_q8_scalar(ty, w.row(r), x.qrow(ti)).to_bits();
                        assert_eq!(a[ti * rows + r].to_bits(), want, "{ty:?} t {t} token {ti} row {r}");
                        if r < 21 {
                            assert_eq!(b[ti * rows + r].to_bits(), want, "{ty:?} t {t} token {ti} row {r}, second");
                        }
                    }
                }
            }
        }
    }

    /// Products go to the AMX tiles only when `STRATA_AMX=1` asked for them on a CPU that has them, only with 8+
    /// tokens, only for their formats and the default precision (the test suite runs without the variable: there
    /// no product goes there, whatever the CPU).
    #[test]
    fn products_take_the_amx_tiles_only_when_asked() {
        let asked = std::env::var("STRATA_AMX").is_ok_and(|v| v == "1");
        assert_eq!(crate::quant::amx::enabled(), asked && crate::quant::amx::available());
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K] {
            let on = crate::quant::amx::enabled()
                && ty != GgmlType::Q4_K
                && crate::quant::simd_level() == crate::quant::SimdLevel::Avx512;
            assert_eq!(tiled(ty, 16, Precision::Q8Activations), on, "{ty:?}");
            assert_eq!(tiled(ty, 8, Precision::Q8Activations), on, "{ty:?}");
            assert!(!tiled(ty, 7, Precision::Q8Activations), "{ty:?}: 7 tokens");
            assert!(!tiled(ty, 16, Precision::Q8Scalar) && !tiled(ty, 16, Precision::F32), "{ty:?}: references");
        }
    }

    #[test]
    fn glu_batch_takes_an_expert_with_no_rows_and_unquantized_widths() {
        let pool = WorkerPool::new(3).expect("pool");
        let mut seed = 5u64;
        let x = act(2, 64, 0);
        for rows in [0usize, 48] {
            let (wg, wu) = (
                random_blocks(GgmlType::Q8_0, rows, 64, &mut seed),
                random_blocks(GgmlType::Q8_0, rows, 64, &mut seed),
            );
            let (mut g, mut u, mut h) = (vec![0f32; 2 * rows], vec![0f32; 2 * rows], Act::default());
            let gate = mat(&wg, GgmlType::Q8_0, rows, 64);
            let up = mat(&wu, GgmlType::Q8_0, rows, 64);
            glu_batch(
                &pool,
                &mut [GluJob { gate, up, x: &x, g: &mut g, u: &mut u, h: &mut h, unit: GluUnit::SILU }],
                Precision::Q8Activations,
                || {},
            );
            assert_eq!((h.t, h.n, h.f.len(), h.q.len()), (2, rows, 2 * rows, 2 * (rows / 32)));
            let mut want = vec![0f32; 2 * rows];
            matmul_with(&pool, gate, &x, &mut want, Precision::Q8Activations);
            assert!(want.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn glu_batch_gives_the_bits_of_separate_products_silu_and_quantization() {
        let mut seed = 11u64;
        for threads in [1, 3] {
            let pool = WorkerPool::new(threads).expect("pool");
            for precision in [Precision::Q8Activations, Precision::Q8Scalar, Precision::F32] {
                for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
                    // experts of different widths and token counts in one batch (96 rows: three Q8 blocks of h;
                    // 512: two Q8_K super-blocks, which h.with_q8k asks for)
                    let shapes = [(96usize, 256usize, 1usize), (64, 256, 3), (288, 256, 2), (512, 256, 2)];
                    let ws: Vec<(Vec<u8>, Vec<u8>)> = shapes
                        .iter()
                        .map(|&(r, c, _)| (random_blocks(ty, r, c, &mut seed), random_blocks(ty, r, c, &mut seed)))
                        .collect();
                    let xs: Vec<Act> = shapes.iter().enumerate().map(|(i, &(_, c, t))| act(t, c, i)).collect();
                    let mut bufs: Vec<(Vec<f32>, Vec<f32>, Act)> = shapes
                        .iter()
                        .map(|&(r, _, t)| {
                            (vec![0f32; r * t], vec![0f32; r * t], Act { with_q8k: true, ..Act::default() })
                        })
                        .collect();
                    {
                        let mut jobs: Vec<GluJob> = bufs
                            .iter_mut()
                            .zip(&ws)
                            .zip(&xs)
                            .zip(&shapes)
                            .map(|((((g, u, h), (wg, wu)), x), &(r, c, _))| GluJob {
                                gate: mat(wg, ty, r, c),
                                up: mat(wu, ty, r, c),
                                x,
                                g,
                                u,
                                h,
                                unit: GluUnit::SILU,
                            })
                            .collect();
                        let mut ran = 0;
                        glu_batch(&pool, &mut jobs, precision, || ran += 1);
                        assert_eq!(ran, 1);
                    }
                    for (((_, _, h), (wg, wu)), (x, &(r, c, t))) in bufs.iter().zip(&ws).zip(xs.iter().zip(&shapes)) {
                        let (mut g, mut u) = (vec![0f32; r * t], vec![0f32; r * t]);
                        matmul_with(&pool, mat(wg, ty, r, c), x, &mut g, precision);
                        matmul_with(&pool, mat(wu, ty, r, c), x, &mut u, precision);
                        let mut want = Act { with_q8k: true, ..Act::default() };
                        want.resize(t, r);
                        for ((w, gv), uv) in want.f.iter_mut().zip(&g).zip(&u) {
                            *w = silu(*gv) * uv;
                        }
                        want.quantize();
                        assert_eq!(h.qk.len(), want.qk.len(), "{r} rows");
                        assert_eq!(h.qk.is_empty(), r % 256 != 0);
                        for (a, b) in h.qk.iter().zip(&want.qk) {
                            assert_eq!((a.d.to_bits(), a.qs), (b.d.to_bits(), b.qs));
                        }
                        assert_eq!((h.t, h.n), (t, r));
                        assert!(
                            h.f.iter().zip(&want.f).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{ty:?} {precision:?}"
                        );
                        assert_eq!(h.q.len(), want.q.len());
                        for (a, b) in h.q.iter().zip(&want.q) {
                            assert_eq!((a.d.to_bits(), a.s.to_bits(), a.qs), (b.d.to_bits(), b.s.to_bits(), b.qs));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn experts_batch_gives_the_bits_of_a_glu_batch_then_a_matmul_batch() {
        let mut seed = 23u64;
        for threads in [1, 2, 5] {
            let pool = WorkerPool::new(threads).expect("pool");
            for precision in [Precision::Q8Activations, Precision::Q8Scalar, Precision::F32] {
                for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
                    // (ff, e, tokens): experts of different widths and token counts, one with a single task
                    let shapes = [(96usize, 256usize, 1usize), (64, 256, 3), (288, 256, 2), (32, 256, 1)];
                    let ws: Vec<[Vec<u8>; 3]> = shapes
                        .iter()
                        .map(|&(f, e, _)| {
                            [
                                random_blocks(ty, f, e, &mut seed),
                                random_blocks(ty, f, e, &mut seed),
                                random_blocks(ty, e, f, &mut seed),
                            ]
                        })
                        .collect();
                    let xs: Vec<Act> = shapes.iter().enumerate().map(|(i, &(_, e, t))| act(t, e, i)).collect();
                    let scratch = |&(f, e, t): &(usize, usize, usize)| {
                        (vec![0f32; f * t], vec![0f32; f * t], Act::default(), vec![0f32; e * t])
                    };
                    let mut fused: Vec<_> = shapes.iter().map(scratch).collect();
                    let mut apart: Vec<_> = shapes.iter().map(scratch).collect();
                    {
                        let mut jobs: Vec<ExpertJob> = fused
                            .iter_mut()
                            .zip(&ws)
                            .zip(&xs)
                            .zip(&shapes)
                            .map(|((((g, u, h, out), w), x), &(f, e, _))| ExpertJob {
                                glu: GluJob {
                                    gate: mat(&w[0], ty, f, e),
                                    up: mat(&w[1], ty, f, e),
                                    x,
                                    g,
                                    u,
                                    h,
                                    unit: GluUnit::SILU,
                                },
                                down: mat(&w[2], ty, e, f),
                                out,
                            })
                            .collect();
                        let mut ran = 0;
                        experts_batch(&pool, &mut jobs, precision, || ran += 1);
                        assert_eq!(ran, 1);
                    }
                    {
                        let mut jobs: Vec<GluJob> = apart
                            .iter_mut()
                            .zip(&ws)
                            .zip(&xs)
                            .zip(&shapes)
                            .map(|((((g, u, h, _), w), x), &(f, e, _))| GluJob {
                                gate: mat(&w[0], ty, f, e),
                                up: mat(&w[1], ty, f, e),
                                x,
                                g,
                                u,
                                h,
                                unit: GluUnit::SILU,
                            })
                            .collect();
                        glu_batch(&pool, &mut jobs, precision, || {});
                    }
                    for (i, (_, _, h, out)) in apart.iter_mut().enumerate() {
                        let (f, e, _) = shapes[i];
                        matmul_batch(&pool, &mut [MatJob { w: mat(&ws[i][2], ty, e, f), x: h, out }], precision);
                    }
                    for ((a, b), sh) in fused.iter().zip(&apart).zip(&shapes) {
                        assert!(a.2.f.iter().zip(&b.2.f).all(|(p, q)| p.to_bits() == q.to_bits()), "h {sh:?}");
                        assert!(
                            a.3.iter().zip(&b.3).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{ty:?} {precision:?} {sh:?}"
                        );
                        assert!(a.3.iter().any(|v| *v != 0.0), "{sh:?}: no output");
                    }
                }
            }
        }
    }

    /// K-quant down weights multiply the hidden layer's Q8_K blocks (as llama.cpp's CPU backend, and as a separate
    /// matmul of the same `Act`), not its Q8_0 ones.
    #[test]
    fn k_quant_down_weights_read_the_hidden_layer_as_q8_k() {
        let pool = WorkerPool::new(3).expect("pool");
        let mut seed = 31u64;
        let (f, e, t) = (512usize, 256usize, 2usize);
        let (wg, wu) = (random_blocks(GgmlType::Q8_0, f, e, &mut seed), random_blocks(GgmlType::Q8_0, f, e, &mut seed));
        // Q6_K down rows: random codes and scales, a small f16 super-scale
        let mut wd = vec![0u8; e * GgmlType::Q6_K.row_bytes(f)];
        for blk in wd.chunks_exact_mut(210) {
            for b in blk.iter_mut() {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                *b = (seed >> 33) as u8;
            }
            blk[208..210].copy_from_slice(&half::f16::from_f32(1e-3).to_le_bytes());
        }
        let x = act(t, e, 3);
        let (mut g, mut u, mut out) = (vec![0f32; f * t], vec![0f32; f * t], vec![0f32; e * t]);
        let mut h = Act { with_q8k: true, ..Act::default() };
        let down = MatRef { data: &wd, ty: GgmlType::Q6_K, rows: e, cols: f, stride: 0 };
        experts_batch(
            &pool,
            &mut [ExpertJob {
                glu: GluJob {
                    gate: mat(&wg, GgmlType::Q8_0, f, e),
                    up: mat(&wu, GgmlType::Q8_0, f, e),
                    x: &x,
                    g: &mut g,
                    u: &mut u,
                    h: &mut h,
                    unit: GluUnit::SILU,
                },
                down,
                out: &mut out,
            }],
            Precision::Q8Activations,
            || {},
        );
        assert_eq!(h.qk.len(), t * f / 32);
        let mut want = vec![0f32; e * t];
        matmul_with(&pool, down, &h, &mut want, Precision::Q8Activations);
        assert!(out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        // and that differs from the Q8_0 reading (the blocks are not the same)
        let mut q8_0 = h.clone();
        q8_0.qk.clear();
        let mut other = vec![0f32; e * t];
        matmul_with(&pool, down, &q8_0, &mut other, Precision::Q8Activations);
        assert!(other.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()));
    }

    /// swiglu_oai clamps the gate from above at 7 and the up product to ±7 (ggml's order of operations), and without
    /// the clamps is x·σ(1.702x)·(u + 1); the biases are added before it.
    #[test]
    fn swiglu_oai_clamps_and_adds_one_to_up() {
        let s = |x: f32| 1.0 / (1.0 + (-1.702 * x).exp());
        for (g, u) in [(0.5f32, -0.25f32), (-3.0, 2.0), (10.0, -10.0), (7.5, 9.0), (-20.0, 0.0)] {
            let (x, y) = (g.min(7.0), u.clamp(-7.0, 7.0));
            let want = x * s(x) * (y + 1.0);
            assert!((swiglu_oai(g, u) - want).abs() <= 1e-6 * want.abs().max(1.0), "{g} {u}");
        }
        assert_eq!(swiglu_oai(100.0, 100.0), swiglu_oai(7.0, 7.0));
        let (g, u, (bg, bu)) = ([1.0f32, 9.0], [0.5f32, -9.0], ([0.5f32, -3.0], [0.25f32, 1.0]));
        let mut h = [0f32; 2];
        GluAct::SwigluOai.apply(&g, &u, Some((&bg, &bu)), &mut h);
        assert_eq!(h, [swiglu_oai(1.5, 0.75), swiglu_oai(6.0, -8.0)]);
        GluAct::Silu.apply(&g, &u, None, &mut h);
        assert_eq!(h, [silu(1.0) * 0.5, silu(9.0) * -9.0]);
    }
}
