//! Row arithmetic of the CPU's forward pass: RMSNorm, biases, RoPE rotations, f32 dot products.

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) * w` (sum of squares in f64).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let scale = rms_scale(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// `1 / sqrt(mean(x²) + eps)`, the sum of squares in f64 (llama.cpp's `ggml_float` sum).
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()
}

/// RMSNorm of `x` in place (the arithmetic of [`rms_norm`]).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = rms_scale(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// Adds `bias` (one row) to every row of `y` (`rows × bias.len()`).
pub fn add_rows(y: &mut [f32], bias: &[f32]) {
    for row in y.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// Rotates adjacent pairs `(x[2i], x[2i+1])` by the angles in `cs` (cos, sin) (`RopeKind::Normal`).
pub fn rope(x: &mut [f32], cs: &[(f32, f32)]) {
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

/// Rotates the pairs `(x[i], x[i + n])`, `n = cs.len()`, by the angles in `cs` (`RopeKind::Neox`: the first
/// `2n` dimensions of the head split in halves; the rest unrotated).
pub fn rope_neox(x: &mut [f32], cs: &[(f32, f32)]) {
    let n = cs.len();
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = (x[i], x[i + n]);
        x[i] = a * c - b * s;
        x[i + n] = a * s + b * c;
    }
}

/// Dot product with eight independent partial sums (vectorizes; the head
/// dimension is a multiple of 8 for every supported model, a tail is handled).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let tail: f32 = a[n8..].iter().zip(&b[n8..]).map(|(x, y)| x * y).sum();
    crate::quant::f16::reduce8(&acc) + tail
}
