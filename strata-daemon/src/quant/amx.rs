//! Prompt products of Q4_0, Q4_1, Q5_0 and Q8_0 weights on Intel AMX (AMX-TILE and AMX-INT8: Sapphire Rapids and later
//! Xeons): one tile product multiplies 16 weight rows by 16 tokens over one 32-value block.
//!
//! Layout (Intel's tile instructions, `TDPBSSD` / `TDPBSUD`: C[m][n] += Σ_k A[m][k] · B[k / 4][4n + k % 4]):
//! - A (tile 1, 16 rows × 32 bytes): 16 tokens' 8-bit activations of the block, read in place from their Q8
//!   blocks (a token's row of blocks after the previous token's: the stride is the row's bytes);
//! - B (tile 2, 8 rows × 64 bytes): the block's codes of 16 weight rows, 4-byte words interleaved by row
//!   ([`WTile`]: word `k` of row `n` at `16k + n`; Q4_0's nibble − 8, Q5_0's code − 16 and Q8_0's code signed,
//!   Q4_1's nibble
//!   unsigned), unpacked once per task and row group;
//! - C (tile 0, 16 × 16 int32): the exact integer sums Σ q_x · q_w of the block for each (token, row).
//!
//! Each block's sums go through memory into 16-lane vectors (one per token, the weight rows in the lanes) and are
//! scaled there in the scalar reference's order: `acc += (d_w · d_x) · Σ` (Q4_1: `+ m_w · s_x` before the add),
//! blocks in row order — so every result has the bits of the format's scalar dot product
//! (`quant::dot_q8_scalar`), whichever tile or task computed it.
//!
//! The results therefore depend on the number of tokens: a prompt's products of 8+ tokens (the CPU matmul's
//! threshold) give the scalar bits, while one-token decode keeps the SIMD row kernels' order (`quant::q4_wide`,
//! `quant::dot512`, the AVX2 kernels), which agrees with them to rounding. The CPU path is otherwise batch invariant (a token's
//! values do not depend on how many tokens shared its products), which prefix reuse relies on for identical
//! replies; so the tiles are used only when asked for ([`enabled`], `STRATA_AMX=1`).
//!
//! The tile registers are configured per task by [`Tiles::configure`] (`LDTILECFG`) and released when the last
//! guard of the thread drops (`TILERELEASE`). Linux hands the tile data state to a process only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), which [`available`] makes once.
//!
//! Source of the instruction semantics and the tile configuration layout: Intel 64 and IA-32 Architectures
//! Software Developer's Manual, Vol. 2 (`LDTILECFG`, `TILELOADD`, `TDPBSSD`/`TDPBSUD`, `TILESTORED`), and the Linux
//! kernel's `Documentation/arch/x86/xstate.rst` for the permission request.

use std::sync::OnceLock;

use super::{BlockQ8, GgmlType};

/// Tokens per tile and weight rows per tile.
pub const TILE: usize = 16;

/// Whether the AMX kernels can run here: the CPU reports AMX-TILE and AMX-INT8 (CPUID leaf 7), the OS enabled the
/// tile state (XCR0 bits 17 and 18), the AVX-512 F kernels that scale the sums run, and Linux granted the tile data
/// permission. Decided once per process.
pub fn available() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(detect)
}

/// Whether prompt products use the AMX kernels: asked for with `STRATA_AMX=1` and [`available`]. Off by default
/// because it gives up batch invariance: prompt products of 8+ tokens then have the scalar kernels' bits while
/// fewer tokens (decode, the rest of a prompt whose prefix was reused) keep the SIMD row kernels' order, so the
/// same tokens can differ in their last bits, and a greedy reply in a token, with how they were batched. Decided
/// once per process.
pub fn enabled() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| match std::env::var("STRATA_AMX").as_deref() {
        Ok("1") if available() => true,
        Ok("1") => {
            tracing::warn!("STRATA_AMX=1: this CPU or kernel gives no AMX tiles (STRATA_LOG=debug says why); not used");
            false
        }
        Ok("0") | Ok("") | Err(_) => false,
        Ok(v) => {
            tracing::warn!("STRATA_AMX={v}: only 1 turns the AMX tiles on; not used");
            false
        }
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if !is_x86_feature_detected!("avx512f") {
        return false;
    }
    // CPUID exists on every x86-64 CPU; leaf 7 is read only where leaf 0 reports it
    let (max, l1) = (__cpuid(0).eax, __cpuid(1));
    if max < 7 {
        return false;
    }
    let l7 = __cpuid_count(7, 0);
    let (tile, int8, osxsave) = ((l7.edx >> 24) & 1 == 1, (l7.edx >> 25) & 1 == 1, (l1.ecx >> 27) & 1 == 1);
    if !(tile && int8 && osxsave) {
        tracing::debug!(tile, int8, osxsave, "AMX tiles not used: the CPU lacks AMX-TILE/AMX-INT8 or XSAVE");
        return false;
    }
    let (lo, _hi): (u32, u32);
    // SAFETY: XGETBV with ECX = 0 reads XCR0; it exists where CPUID.1:ECX.OSXSAVE is set (checked above).
    unsafe { std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi, options(nomem, nostack)) };
    if (lo >> 17) & 3 != 3 {
        tracing::debug!(xcr0 = lo, "AMX tiles not used: the OS has not enabled the tile state (XCR0 bits 17-18)");
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, feature) takes two integers and touches no memory of ours; a kernel
    // without the request (before Linux 5.16) returns an error, and then AMX is not used.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        tracing::debug!(error = %e, "AMX tiles not used: Linux refused the tile data permission");
        return false;
    }
    true
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Whether `ty` has AMX kernels: Q4_0, Q4_1, Q5_0 and Q8_0 (32-value blocks with one f16 scale, Q4_1 with a
/// minimum).
pub fn takes(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0)
}

/// Up to [`TILE`] weight rows unpacked for the kernel (the B operand): per block, 8 rows of 16 four-byte words
/// (rows past the unpacked ones are zero), then the rows' scales and (Q4_1) minimums. A thread's buffer:
/// [`WTile::unpack`] refills it.
#[derive(Debug, Default, Clone)]
pub struct WTile {
    ty: Option<GgmlType>,
    nb: usize,
    /// `nb × 8 × 16` words: word `k` of block `b` of row `n` at `(b·8 + k)·16 + n`.
    words: Vec<u32>,
    /// `nb × TILE`: block `b`'s scale of row `n` at `b·TILE + n`.
    d: Vec<f32>,
    /// `nb × TILE`: Q4_1's minimums (zero for the other formats).
    m: Vec<f32>,
}

impl WTile {
    /// Unpacks `rows` (1..=16 rows of `nb` blocks of `ty`). Panics on another format, more rows, or a row of another
    /// length.
    pub fn unpack(&mut self, ty: GgmlType, rows: &[&[u8]], nb: usize) {
        use super::dequant::{f16_to_f32, rd16};
        assert!(takes(ty), "WTile: no AMX kernel for {ty:?}");
        assert!((1..=TILE).contains(&rows.len()), "WTile: 1..=16 rows");
        self.ty = Some(ty);
        self.nb = nb;
        // every entry of the unpacked rows is written below; only the rows past them are zeroed here (a full group
        // of 16 rows, the common case, writes nothing twice)
        self.words.resize(nb * 8 * TILE, 0);
        self.d.resize(nb * TILE, 0.0);
        self.m.resize(nb * TILE, 0.0);
        for n in rows.len()..TILE {
            for b in 0..nb {
                for k in 0..8 {
                    self.words[(b * 8 + k) * TILE + n] = 0;
                }
                self.d[b * TILE + n] = 0.0;
                self.m[b * TILE + n] = 0.0;
            }
        }
        let bb = ty.row_bytes(32);
        let word = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        for (n, row) in rows.iter().enumerate() {
            assert_eq!(row.len(), nb * bb, "WTile: row length");
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                self.d[b * TILE + n] = f16_to_f32(rd16(blk, 0));
                self.m[b * TILE + n] = 0.0; // Q4_1's minimum below
                let w = &mut self.words[b * 8 * TILE..(b + 1) * 8 * TILE];
                match ty {
                    GgmlType::Q4_0 => {
                        for k in 0..4 {
                            let q = word(blk, 2 + 4 * k);
                            // each byte's nibble − 8 (the bytes kept at 128 + nibble so that no borrow crosses them)
                            let s = |v: u32| ((v | 0x8080_8080) - 0x0808_0808) ^ 0x8080_8080;
                            w[k * TILE + n] = s(q & 0x0f0f_0f0f);
                            w[(k + 4) * TILE + n] = s((q >> 4) & 0x0f0f_0f0f);
                        }
                    }
                    GgmlType::Q4_1 => {
                        self.m[b * TILE + n] = f16_to_f32(rd16(blk, 2));
                        for k in 0..4 {
                            let q = word(blk, 4 + 4 * k);
                            w[k * TILE + n] = q & 0x0f0f_0f0f;
                            w[(k + 4) * TILE + n] = (q >> 4) & 0x0f0f_0f0f;
                        }
                    }
                    GgmlType::Q5_0 => {
                        let q = super::format::q5_0::codes(blk, 2, 6);
                        for k in 0..8 {
                            // each byte's code − 16, as Q4_0's nibble − 8 above
                            let v = u32::from_le_bytes([q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]]);
                            w[k * TILE + n] = ((v | 0x8080_8080) - 0x1010_1010) ^ 0x8080_8080;
                        }
                    }
                    _ => {
                        for k in 0..8 {
                            w[k * TILE + n] = word(blk, 2 + 4 * k);
                        }
                    }
                }
            }
        }
    }
}

std::thread_local! {
    /// [`Tiles`] guards alive on this thread: the tiles are configured when the first is made and released when
    /// the last drops.
    static GUARDS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The tile registers of this thread configured for the kernel (tiles 0 and 3: 16 × 16 int32 sums; tiles 1 and 4:
/// 16 tokens × 32 bytes of activations; tiles 2 and 5: 8 × 64 bytes of weight codes — two blocks in flight);
/// released when dropped. Not `Send`: the configuration
/// belongs to the thread that made it.
pub struct Tiles {
    _thread: std::marker::PhantomData<*const ()>,
}

/// The 64-byte operand of `LDTILECFG` (palette 1): bytes 16..48 each tile's bytes per row, 48..64 its rows.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl Tiles {
    /// Configures the tile registers. Panics where [`available`] does not hold.
    pub fn configure() -> Tiles {
        assert!(available(), "Tiles: AMX is not available here");
        let depth = GUARDS.with(|g| {
            g.set(g.get() + 1);
            g.get()
        });
        if depth > 1 {
            // an outer guard of this thread configured them (the same configuration)
            return Tiles { _thread: std::marker::PhantomData };
        }
        let mut c = TileConfig([0; 64]);
        c.0[0] = 1;
        for (t, rows, colsb) in [(0usize, 16u8, 64u16), (1, 16, 32), (2, 8, 64), (3, 16, 64), (4, 16, 32), (5, 8, 64)] {
            c.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c.0[48 + t] = rows;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available` established AMX-TILE and the OS's tile state; the operand is a valid palette-1
        // configuration (64 bytes, reserved bytes zero) that outlives the instruction.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) c.0.as_ptr(), options(nostack, readonly));
        }
        Tiles { _thread: std::marker::PhantomData }
    }

    /// `out[j][n]` = token `j` of `x` times weight row `n` of `w`, for 16 tokens and 16 rows: `x` holds the 16
    /// tokens' rows of `w`'s block count back to back (zero blocks for missing tokens). Rows past `w.rows()` come
    /// out 0 (for finite activation scales). Panics when `x` has another length.
    pub fn times(&self, w: &WTile, x: &[BlockQ8], out: &mut [[f32; TILE]; TILE]) {
        assert_eq!(x.len(), TILE * w.nb, "Tiles::times: 16 tokens of {} blocks", w.nb);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: this thread's tiles are configured (a `Tiles` of this thread exists, it is not Send, and the
        // tiles are released only when the thread's last guard drops); AVX-512 F is present
        // (`available`); `w` was unpacked for `nb` blocks and `x` holds 16 rows of `nb` blocks (asserted).
        unsafe {
            match w.ty {
                Some(GgmlType::Q4_1) => imp::times::<true>(w, x, out),
                _ => imp::times::<false>(w, x, out),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AMX off x86-64")
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        let last = GUARDS.with(|g| {
            g.set(g.get() - 1);
            g.get() == 0
        });
        if !last {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tiles were configured by the first `configure` of this thread, and this is its last guard;
        // TILERELEASE returns them to their initial state and touches no memory.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{BlockQ8, WTile, TILE};

    /// One block's tile product (`$op`: `tdpbssd` or `tdpbsud`) of the activations at `$a` (rows `$sa` bytes apart)
    /// and the weight words at `$b`, its sums stored at `$c` (64-byte rows). Callers: inside `unsafe`, with the
    /// tiles configured and the operands as `times` describes.
    macro_rules! one_block {
        ($op:literal, $a:expr, $sa:expr, $b:expr, $c:expr) => {
            asm!(
                "tilezero tmm0",
                "tileloadd tmm1, [{a} + {sa}*1]",
                "tileloadd tmm2, [{b} + {sb}*1]",
                concat!($op, " tmm0, tmm1, tmm2"),
                "tilestored [{c} + {sb}*1], tmm0",
                a = in(reg) $a, sa = in(reg) $sa, b = in(reg) $b, sb = in(reg) 64usize, c = in(reg) $c,
                options(nostack),
            )
        };
    }

    /// Two blocks' tile products as [`one_block`] (tiles 0-2 and 3-5), both stores after both products.
    macro_rules! two_blocks {
        ($op:literal, $a:expr, $a2:expr, $sa:expr, $b:expr, $b2:expr, $c:expr, $c2:expr) => {
            asm!(
                "tilezero tmm0",
                "tilezero tmm3",
                "tileloadd tmm1, [{a} + {sa}*1]",
                "tileloadd tmm2, [{b} + {sb}*1]",
                concat!($op, " tmm0, tmm1, tmm2"),
                "tileloadd tmm4, [{a2} + {sa}*1]",
                "tileloadd tmm5, [{b2} + {sb}*1]",
                concat!($op, " tmm3, tmm4, tmm5"),
                "tilestored [{c} + {sb}*1], tmm0",
                "tilestored [{c2} + {sb}*1], tmm3",
                a = in(reg) $a, a2 = in(reg) $a2, sa = in(reg) $sa, b = in(reg) $b, b2 = in(reg) $b2,
                sb = in(reg) 64usize, c = in(reg) $c, c2 = in(reg) $c2, options(nostack),
            )
        };
    }

    /// The sums of one block, 16 tokens × 16 rows, 64-byte aligned for the vector loads.
    #[repr(C, align(64))]
    struct Sums([i32; TILE * TILE]);

    /// See [`super::Tiles::times`]; `Q41`: unsigned weight codes (`TDPBSUD`) and the minimum term. SAFETY
    /// (callers): tiles configured on this thread as `Tiles::configure` does, AVX-512 F present, `x.len() == 16 ·
    /// w.nb`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn times<const Q41: bool>(w: &WTile, x: &[BlockQ8], out: &mut [[f32; TILE]; TILE]) {
        let nb = w.nb;
        let stride_a = nb * std::mem::size_of::<BlockQ8>();
        let qs = std::mem::offset_of!(BlockQ8, qs);
        let mut acc = [_mm512_setzero_ps(); TILE];
        let mut c = [Sums([0; TILE * TILE]), Sums([0; TILE * TILE])];
        let mut b = 0;
        while b < nb {
            let a = (x.as_ptr().add(b) as *const u8).add(qs);
            let bt = w.words.as_ptr().add(b * 8 * TILE);
            let c0 = c[0].0.as_mut_ptr();
            // two blocks in flight where two remain (tiles 0-2 and 3-5), so that one block's product runs while
            // the other's sums are scaled
            let two = b + 1 < nb;
            // SAFETY (all arms): tiles 1/4 read 16 rows of 32 bytes `stride_a` apart from `a` (block b's codes of the
            // 16 tokens' rows in `x`; block b + 1's 40 bytes further), tiles 2/5 8 rows of 64 bytes from `bt` (block
            // b's 128 words; block b + 1's next), tiles 0/3 write 16 rows of 64 bytes into `c[0]` / `c[1]`; the tiles
            // are configured with these shapes, and block b + 1 is read only when it exists.
            // (wrapping: formed for the last block too, where only `two` blocks read them)
            let (a2, b2) = (a.wrapping_add(std::mem::size_of::<BlockQ8>()), bt.wrapping_add(8 * TILE));
            let c2 = c[1].0.as_mut_ptr();
            match (Q41, two) {
                (true, true) => two_blocks!("tdpbsud", a, a2, stride_a, bt, b2, c0, c2),
                (false, true) => two_blocks!("tdpbssd", a, a2, stride_a, bt, b2, c0, c2),
                (true, false) => one_block!("tdpbsud", a, stride_a, bt, c0),
                (false, false) => one_block!("tdpbssd", a, stride_a, bt, c0),
            }
            for (k, ck) in c.iter().enumerate().take(if two { 2 } else { 1 }) {
                let bk = b + k;
                let dw = _mm512_loadu_ps(w.d.as_ptr().add(bk * TILE));
                let mw = _mm512_loadu_ps(w.m.as_ptr().add(bk * TILE));
                for (j, a) in acc.iter_mut().enumerate() {
                    let xb = x.get_unchecked(j * nb + bk);
                    let s = _mm512_cvtepi32_ps(_mm512_load_si512(ck.0.as_ptr().add(j * TILE) as *const __m512i));
                    // the scalar reference's order: (d_w · d_x) · Σ (+ m_w · s_x), then added to the sum of the blocks
                    let mut v = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xb.d)), s);
                    if Q41 {
                        v = _mm512_add_ps(v, _mm512_mul_ps(mw, _mm512_set1_ps(xb.s)));
                    }
                    *a = _mm512_add_ps(*a, v);
                }
            }
            b += if two { 2 } else { 1 };
        }
        for (o, a) in out.iter_mut().zip(acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// Random rows of `ty` whose scales are ordinary f16 values.
    fn rows(ty: GgmlType, n: usize, nb: usize, seed: &mut u64) -> Vec<Vec<u8>> {
        let bb = ty.row_bytes(32);
        (0..n)
            .map(|_| {
                let mut row: Vec<u8> = (0..nb * bb).map(|_| rng(seed) as u8).collect();
                for blk in row.chunks_exact_mut(bb) {
                    // f16 scale in [2^-10, 2^-9), minimum of either sign and the same range, codes anywhere
                    let d = 0x1400u16 | (rng(seed) as u16 & 0x13ff);
                    blk[0..2].copy_from_slice(&d.to_le_bytes());
                    if ty == GgmlType::Q4_1 {
                        let m = 0x1400u16 | (rng(seed) as u16 & 0x93ff);
                        blk[2..4].copy_from_slice(&m.to_le_bytes());
                    }
                }
                row
            })
            .collect()
    }

    fn acts(t: usize, nb: usize, seed: &mut u64) -> Vec<BlockQ8> {
        (0..t * nb)
            .map(|i| {
                let mut b = BlockQ8 { d: 0.0, s: 0.0, qs: [0; 32] };
                for q in b.qs.iter_mut() {
                    *q = rng(seed) as i8;
                }
                // saturating extremes in some blocks
                if i % 5 == 0 {
                    b.qs = [if i % 2 == 0 { 127 } else { -128 }; 32];
                }
                b.d = (rng(seed) % 1000) as f32 * 1e-5 + 1e-6;
                b.s = b.d * b.qs.iter().map(|&q| q as i32).sum::<i32>() as f32;
                b
            })
            .collect()
    }

    /// The unpacked words multiplied as Intel's manual defines `TDPBSSD` / `TDPBSUD` (signed activations times
    /// signed, or for Q4_1 unsigned, weight bytes; word `k` of row `n` at `16k + n`) and scaled in the kernel's order
    /// give every (row, token) the scalar bits, and the padding rows 0: the layout and the nibble arithmetic checked
    /// on any CPU, AMX or not.
    #[test]
    fn emulated_tile_products_give_the_scalar_bits() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        // one buffer for every case, as a pool thread reuses it: fewer rows after more, another format after Q4_1
        let mut wt = WTile::default();
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
            for (nb, nrows, t) in [(3usize, 16usize, 5usize), (3, 5, 17), (18, 16, 9), (3, 2, 8)] {
                let w = rows(ty, nrows, nb, &mut seed);
                let x = acts(t, nb, &mut seed);
                wt.unpack(ty, &w.iter().map(|r| r.as_slice()).collect::<Vec<_>>(), nb);
                for tok in 0..t {
                    for r in 0..TILE {
                        let mut acc = 0f32;
                        for b in 0..nb {
                            let xb = &x[tok * nb + b];
                            let mut s = 0i32;
                            for k in 0..8 {
                                let word = wt.words[(b * 8 + k) * TILE + r].to_le_bytes();
                                for (i, &wb) in word.iter().enumerate() {
                                    let wv = if ty == GgmlType::Q4_1 { wb as i32 } else { wb as i8 as i32 };
                                    s += xb.qs[4 * k + i] as i32 * wv;
                                }
                            }
                            let mut v = wt.d[b * TILE + r] * xb.d * s as f32;
                            if ty == GgmlType::Q4_1 {
                                v += wt.m[b * TILE + r] * xb.s;
                            }
                            acc += v;
                        }
                        let want = match w.get(r) {
                            Some(row) => crate::quant::dot_q8_scalar(ty, row, &x[tok * nb..(tok + 1) * nb]),
                            None => 0.0,
                        };
                        assert_eq!(acc.to_bits(), want.to_bits(), "{ty:?} nb {nb} row {r} token {tok}");
                    }
                }
            }
        }
    }

    /// Every (row, token) of every tile has the bits of the scalar dot product, for tiles with fewer rows and
    /// tokens than 16, on CPUs with AMX; elsewhere the kernels cannot run (the emulated test covers the layout).
    #[test]
    fn tile_products_give_the_scalar_bits() {
        if !available() {
            assert!(!enabled(), "enabled without the hardware");
            eprintln!("no AMX on this CPU: the tile kernels are not run (the emulated test checks their layout)");
            return;
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let tiles = Tiles::configure();
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
            for (nb, nrows, t) in [(1usize, 16usize, 16usize), (3, 5, 17), (18, 16, 40), (64, 13, 3)] {
                let w = rows(ty, nrows, nb, &mut seed);
                let x = acts(t, nb, &mut seed);
                let mut wt = WTile::default();
                wt.unpack(ty, &w.iter().map(|r| r.as_slice()).collect::<Vec<_>>(), nb);
                let mut out = [[0f32; TILE]; TILE];
                for t0 in (0..t).step_by(TILE) {
                    let tn = (t - t0).min(TILE);
                    let mut xs = vec![BlockQ8::default(); TILE * nb];
                    xs[..tn * nb].copy_from_slice(&x[t0 * nb..(t0 + tn) * nb]);
                    tiles.times(&wt, &xs, &mut out);
                    for (r, row) in w.iter().enumerate() {
                        for j in 0..tn {
                            let tok = t0 + j;
                            let want = crate::quant::dot_q8_scalar(ty, row, &x[tok * nb..(tok + 1) * nb]);
                            assert_eq!(out[j][r].to_bits(), want.to_bits(), "{ty:?} nb {nb} row {r} token {tok}");
                        }
                    }
                    assert!(out.iter().all(|o| o[nrows..].iter().all(|&v| v == 0.0)), "rows past the unpacked ones");
                }
            }
        }
    }
}
