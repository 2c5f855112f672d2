//! KV cache: per layer, keys and values of every cached position.
//!
//! Values are stored as f32 rounded to f16 precision (llama.cpp's default KV
//! type is F16; rounding the same way keeps logits close to it without paying
//! for conversions in the attention loop).

/// KV cache for `n_layer` layers, `n_ctx` positions, `kv_dim` values per
/// position (`n_head_kv * head_dim`). Memory: `2 * n_layer * n_ctx * kv_dim * 4` bytes.
pub struct KvCache {
    /// Positions the cache can hold (the context length).
    pub n_ctx: usize,
    /// Values per position and layer for K (and for V).
    pub kv_dim: usize,
    /// Positions filled so far (`0..len` are valid).
    pub len: usize,
    /// Round stored values to f16 precision (true unless the model runs in
    /// the exact f32 reference precision).
    pub round_f16: bool,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// Allocates an empty cache.
    pub fn new(n_layer: usize, n_ctx: usize, kv_dim: usize) -> Self {
        KvCache {
            n_ctx,
            kv_dim,
            len: 0,
            round_f16: true,
            k: (0..n_layer).map(|_| vec![0.0; n_ctx * kv_dim]).collect(),
            v: (0..n_layer).map(|_| vec![0.0; n_ctx * kv_dim]).collect(),
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.n_ctx * self.kv_dim * 4
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Drops positions from `n` on (keeps a common prefix).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Stores K and V of position `pos` in `layer` (each `kv_dim` values).
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        let r16 = self.round_f16;
        let round = |x: f32| if r16 { half::f16::from_f32(x).to_f32() } else { x };
        for (dst, s) in self.k[layer][pos * d..(pos + 1) * d].iter_mut().zip(k) {
            *dst = round(*s);
        }
        for (dst, s) in self.v[layer][pos * d..(pos + 1) * d].iter_mut().zip(v) {
            *dst = round(*s);
        }
    }

    /// Keys of `layer` for positions `0..n` (`n * kv_dim` values).
    pub fn keys(&self, layer: usize, n: usize) -> &[f32] {
        &self.k[layer][..n * self.kv_dim]
    }

    /// Values of `layer` for positions `0..n`.
    pub fn values(&self, layer: usize, n: usize) -> &[f32] {
        &self.v[layer][..n * self.kv_dim]
    }
}
