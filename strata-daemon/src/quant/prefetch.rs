//! Software prefetch of weight rows for the one-token (decode) kernels.
//!
//! A decode product reads every weight byte once, so it runs at the rate memory delivers them. The hardware
//! prefetchers alone leave a core far under its share: the row kernels read four rows at once (four short streams
//! of a few hundred bytes to a few KiB that restart at every row group) and the streamers need a few lines of each
//! to train. The kernels therefore ask for the line [`AHEAD`] bytes past the one they read, into L2: as the rows of
//! a matrix lie one after the other, that is a later row group's bytes, far enough ahead to cover DRAM latency at a
//! core's share of the bandwidth. Measured on a 2-core AMD EPYC (Zen 4, 2026-12-04; a Q4_0 `output.weight` of
//! 151,936 × 2,048, 167 MiB): 15.5 GB/s with 512 bytes ahead into L1 (the distance used before), 30–39 GB/s with
//! 4–32 KiB ahead into L2 (the host's read rate is about 36 GB/s); one thread 10 → 28 GB/s.

/// Bytes ahead of the current read position that the kernels prefetch (into L2, which holds that many per
/// stream many times over).
pub const AHEAD: usize = 16 << 10;

/// Hints that the line at `p + off + AHEAD` will be read soon (into L2). Never faults: the address may lie past the
/// row or the matrix (it is computed with `wrapping_add` and never dereferenced).
#[inline(always)]
pub fn ahead(p: *const u8, off: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // SAFETY: a prefetch is a hint that never faults and reads nothing architecturally, whatever the address;
        // SSE (which has it) is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off + AHEAD) as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, off);
}

/// [`ahead`] for every line of the `len` bytes at `p + off` (a block of a row), one hint per 64 bytes.
#[inline(always)]
pub fn ahead_span(p: *const u8, off: usize, len: usize) {
    let mut k = 0;
    while k < len {
        ahead(p, off + k);
        k += 64;
    }
}
