//! What the K-quant formats share (ggml's `block_q*_K`, super-blocks of 256 values, `QK_K`): each block unpacks into
//! signed codes, one integer scale (and minimum) per 16 values, and the f16 super-scales `d` and `dmin`:
//! value `e` = `(d · sc[e/16]) · q[e] − (dmin · mn[e/16])`, the order of ggml's `dequantize_row_q*_K` (and of the
//! `gguf` package's numpy code). Products pair the rows with ggml's Q8_K activations (one f32 scale per 256), held as
//! [`BlockQ8`] blocks of 32 that share their super-block's scale (`Activation::Q8K`), so the kernels read any 8-bit
//! blocks alike: per 32 activations, `d_x · (d · Σ sc q q_x − dmin · Σ mn q_x)`.

use crate::quant::BlockQ8;

/// Values per super-block.
pub const QK_K: usize = 256;

/// One super-block unpacked.
pub struct Unpacked {
    /// Super-scale of the codes.
    pub d: f32,
    /// Super-scale of the minimums (0 for the formats without).
    pub dmin: f32,
    /// Signed codes, offsets applied.
    pub q: [i8; QK_K],
    /// Integer scale per 16 values.
    pub sc: [i16; 16],
    /// Integer minimum per 16 values (0 for the formats without).
    pub mn: [i16; 16],
}

impl Default for Unpacked {
    fn default() -> Self {
        Unpacked { d: 0.0, dmin: 0.0, q: [0; QK_K], sc: [0; 16], mn: [0; 16] }
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and minimum of sub-block `j` (0..8, 32 values each) from the 12 packed
/// bytes of Q4_K and Q5_K.
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Sets `u`'s per-16 scales and minimums from the 12 packed bytes of Q4_K and Q5_K (each 32-value sub-block's pair
/// serves both of its 16-value halves).
pub fn scales_k4(scales: &[u8], u: &mut Unpacked) {
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, scales);
        u.sc[2 * j] = s as i16;
        u.sc[2 * j + 1] = s as i16;
        u.mn[2 * j] = m as i16;
        u.mn[2 * j + 1] = m as i16;
    }
}

/// Dequantizes whole super-blocks of `bytes` bytes each with `unpack`.
pub fn dequantize_with(src: &[u8], dst: &mut [f32], bytes: usize, unpack: fn(&[u8], &mut Unpacked)) {
    let mut u = Unpacked::default();
    for (b, out) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(QK_K)) {
        unpack(b, &mut u);
        for (e, o) in out.iter_mut().enumerate() {
            let (s, m) = (u.sc[e / 16] as f32, u.mn[e / 16] as f32);
            *o = (u.d * s) * u.q[e] as f32 - u.dmin * m;
        }
    }
}

/// The scalar dot product of one unpacked super-block with its 8 activation blocks.
#[inline]
pub fn dot_unpacked(u: &Unpacked, x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (k, xb) in x.iter().enumerate().take(8) {
        let (mut s, mut m) = (0i32, 0i32);
        for h in 0..2 {
            let g = 2 * k + h;
            let (mut qq, mut qs) = (0i32, 0i32);
            for l in 0..16 {
                let xq = xb.qs[16 * h + l] as i32;
                qq += u.q[16 * g + l] as i32 * xq;
                qs += xq;
            }
            s += u.sc[g] as i32 * qq;
            m += u.mn[g] as i32 * qs;
        }
        acc += xb.d * (u.d * s as f32 - u.dmin * m as f32);
    }
    acc
}

/// Scalar reference dot product of a row of super-blocks (`bytes` each) with `x` (8 blocks per super-block).
pub fn dot_with(row: &[u8], x: &[BlockQ8], bytes: usize, unpack: fn(&[u8], &mut Unpacked)) -> f32 {
    let mut u = Unpacked::default();
    let mut acc = 0f32;
    for (b, xs) in row.chunks_exact(bytes).zip(x.chunks_exact(8)) {
        unpack(b, &mut u);
        acc += dot_unpacked(&u, xs);
    }
    acc
}
