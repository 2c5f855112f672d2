//! KV cache: per layer, keys and values of every cached position.
//!
//! Rows are stored as f16 bits (llama.cpp's default KV type, F16: half the bytes that decode attention streams
//! at long contexts), or as f32 for the exact f32 reference precision. A stored value read back is the f32 of its
//! f16, the value llama.cpp's attention reads.

/// One layer's keys or values: `n_ctx × kv_dim` values.
#[derive(Debug, Clone)]
enum Rows {
    /// f16 bits.
    F16(Vec<u16>),
    /// f32 values (the exact reference precision).
    F32(Vec<f32>),
}

/// The first `n × kv_dim` values of one layer's keys or values (see [`KvCache::keys`]).
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    /// f16 bits.
    F16(&'a [u16]),
    /// f32 values.
    F32(&'a [f32]),
}

/// KV cache for `n_layer` layers, `n_ctx` positions, `kv_dim` values per
/// position (`n_head_kv * head_dim`). Memory: `2 * n_layer * n_ctx * kv_dim` values of 2 bytes (f16) or 4 (f32).
pub struct KvCache {
    /// Positions the cache can hold (the context length).
    pub n_ctx: usize,
    /// Values per position and layer for K (and for V).
    pub kv_dim: usize,
    /// Positions filled so far (`0..len` are valid).
    pub len: usize,
    k: Vec<Rows>,
    v: Vec<Rows>,
}

impl KvCache {
    /// Allocates an empty cache of f16 rows.
    pub fn new(n_layer: usize, n_ctx: usize, kv_dim: usize) -> Self {
        Self::with_f16(n_layer, n_ctx, kv_dim, true)
    }

    /// Allocates an empty cache of f16 rows (`f16`) or f32 rows (the exact reference precision).
    pub fn with_f16(n_layer: usize, n_ctx: usize, kv_dim: usize, f16: bool) -> Self {
        let rows = || if f16 { Rows::F16(vec![0; n_ctx * kv_dim]) } else { Rows::F32(vec![0.0; n_ctx * kv_dim]) };
        KvCache {
            n_ctx,
            kv_dim,
            len: 0,
            k: (0..n_layer).map(|_| rows()).collect(),
            v: (0..n_layer).map(|_| rows()).collect(),
        }
    }

    /// Whether rows are stored as f16.
    pub fn is_f16(&self) -> bool {
        !matches!(self.k.first(), Some(Rows::F32(_)))
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        let per = if self.is_f16() { 2 } else { 4 };
        2 * self.k.len() * self.n_ctx * self.kv_dim * per
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Drops positions from `n` on (keeps a common prefix).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Stores K and V of position `pos` in `layer` (each `kv_dim` values; f16 rows keep each value's nearest
    /// f16, ties to even).
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        for (rows, src) in [(&mut self.k[layer], k), (&mut self.v[layer], v)] {
            match rows {
                Rows::F16(r) => crate::quant::f16::from_f32_slice(&src[..d], &mut r[pos * d..(pos + 1) * d]),
                Rows::F32(r) => r[pos * d..(pos + 1) * d].copy_from_slice(&src[..d]),
            }
        }
    }

    /// Keys of `layer` for positions `0..n` (`n * kv_dim` values).
    pub fn keys(&self, layer: usize, n: usize) -> KvRows<'_> {
        Self::view(&self.k[layer], n * self.kv_dim)
    }

    /// Values of `layer` for positions `0..n`.
    pub fn values(&self, layer: usize, n: usize) -> KvRows<'_> {
        Self::view(&self.v[layer], n * self.kv_dim)
    }

    fn view(rows: &Rows, n: usize) -> KvRows<'_> {
        match rows {
            Rows::F16(r) => KvRows::F16(&r[..n]),
            Rows::F32(r) => KvRows::F32(&r[..n]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rows_hold_the_nearest_f16() {
        let mut kv = KvCache::new(2, 4, 3);
        kv.store(1, 2, &[1.0 / 3.0, -70000.0, 1e-8], &[0.1, 65504.0, -0.0]);
        let KvRows::F16(k) = kv.keys(1, 3) else { panic!("f16 rows") };
        let got: Vec<f32> = k[6..9].iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
        assert_eq!(got, [half::f16::from_f32(1.0 / 3.0).to_f32(), f32::NEG_INFINITY, 0.0]);
        assert_eq!(kv.bytes(), 2 * 2 * 4 * 3 * 2);
        let kv32 = KvCache::with_f16(1, 4, 3, false);
        assert!(!kv32.is_f16() && kv32.bytes() == 2 * 4 * 3 * 4);
    }
}
