//! KV cache: per layer, keys and values of every cached position.
//!
//! Rows are stored as f16 bits (llama.cpp's default KV type, F16: half the bytes that decode attention streams
//! at long contexts), as Q8_0 blocks (`--kv-type q8_0`: 34 bytes per 32 values, 53% of F16's bytes; llama.cpp's
//! `--cache-type-k/-v q8_0`), or as f32 for the exact f32 reference precision. A stored f16 value read back is the
//! f32 of its f16, the value llama.cpp's attention reads; a Q8_0 row is ggml's `block_q8_0` encoding of the row
//! (scale `max|x| / 127` rounded to f16, codes rounded to nearest even, as ggml's x86 `quantize_row_q8_0`).

use crate::quant::{BlockQ8, GgmlType};

/// How K/V rows are stored (`--kv-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    /// f16 values (llama.cpp's default, F16).
    #[default]
    F16,
    /// ggml Q8_0 blocks: 32 values per block with an f16 scale (ggml `block_q8_0`); the query is quantized to
    /// Q8_0 for the scores and V rows are dequantized to f32 for the weighted sum, as llama.cpp's flash attention
    /// over a Q8_0 cache does. Needs a head dimension that is a multiple of 32.
    Q8_0,
}

impl KvType {
    /// The flag's spelling (`f16`, `q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// Parses a flag value: `f16` or `q8_0` (case-insensitive). Errors: any other text, naming the accepted ones.
    pub fn parse(s: &str) -> Result<KvType, String> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvType::F16),
            "q8_0" => Ok(KvType::Q8_0),
            _ => Err(format!("unknown KV cache type {s:?} (f16 or q8_0)")),
        }
    }

    /// Whether rows of `head_dim` values per K/V head can be stored this way (Q8_0: whole blocks of 32 per head).
    pub fn fits(self, head_dim: usize) -> bool {
        self == KvType::F16 || head_dim.is_multiple_of(32)
    }

    /// Bytes of one position's row of `kv_dim` values (keys or values of one layer).
    pub fn row_bytes(self, kv_dim: usize) -> usize {
        match self {
            KvType::F16 => 2 * kv_dim,
            KvType::Q8_0 => GgmlType::Q8_0.row_bytes(kv_dim),
        }
    }

    /// Bytes of a KV cache of `n_layer` layers × `n_ctx` positions of keys and values (`kv_dim` each).
    pub fn cache_bytes(self, n_layer: usize, n_ctx: usize, kv_dim: usize) -> usize {
        kv_bytes(n_layer, n_ctx, self.row_bytes(kv_dim))
    }
}

/// Bytes of keys and values of `n_layer` layers × `n_ctx` positions in rows of `row` bytes.
fn kv_bytes(n_layer: usize, n_ctx: usize, row: usize) -> usize {
    2 * n_layer * n_ctx * row
}

impl std::str::FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        KvType::parse(s)
    }
}

/// One layer's keys or values: `n_ctx × kv_dim` values.
#[derive(Debug, Clone)]
enum Rows {
    /// f16 bits.
    F16(Vec<u16>),
    /// f32 values (the exact reference precision).
    F32(Vec<f32>),
    /// ggml `block_q8_0` bytes, `kv_dim / 32` blocks per position.
    Q8_0(Vec<u8>),
}

/// The first `n` positions of one layer's keys or values (see [`KvCache::keys`]): `n × kv_dim` values, or
/// `n × kv_dim / 32` Q8_0 blocks of 34 bytes.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    /// f16 bits.
    F16(&'a [u16]),
    /// f32 values.
    F32(&'a [f32]),
    /// ggml `block_q8_0` bytes (34 per 32 values; a position's row is `kv_dim / 32` blocks).
    Q8_0(&'a [u8]),
}

/// KV cache for `n_layer` layers, `n_ctx` positions, `kv_dim` values per
/// position (`n_head_kv * head_dim`). Memory: `2 * n_layer * n_ctx * kv_dim` values of 2 bytes (f16), 4 (f32) or
/// 34/32 (Q8_0).
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
        Self::alloc(n_layer, n_ctx, kv_dim, if f16 { Some(KvType::F16) } else { None })
    }

    /// Allocates an empty cache of `ty` rows. Panics when `kv_dim` is not whole Q8_0 blocks for [`KvType::Q8_0`]
    /// (callers check [`KvType::fits`]).
    pub fn with_type(n_layer: usize, n_ctx: usize, kv_dim: usize, ty: KvType) -> Self {
        Self::alloc(n_layer, n_ctx, kv_dim, Some(ty))
    }

    /// `None`: f32 rows.
    fn alloc(n_layer: usize, n_ctx: usize, kv_dim: usize, ty: Option<KvType>) -> Self {
        assert!(ty != Some(KvType::Q8_0) || kv_dim.is_multiple_of(32), "Q8_0 KV rows need whole blocks of 32");
        let rows = || match ty {
            Some(KvType::F16) => Rows::F16(vec![0; n_ctx * kv_dim]),
            Some(KvType::Q8_0) => Rows::Q8_0(vec![0; n_ctx * GgmlType::Q8_0.row_bytes(kv_dim)]),
            None => Rows::F32(vec![0.0; n_ctx * kv_dim]),
        };
        KvCache {
            n_ctx,
            kv_dim,
            len: 0,
            k: (0..n_layer).map(|_| rows()).collect(),
            v: (0..n_layer).map(|_| rows()).collect(),
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        let row = match self.k.first() {
            Some(Rows::F32(_)) => 4 * self.kv_dim,
            Some(Rows::Q8_0(_)) => GgmlType::Q8_0.row_bytes(self.kv_dim),
            _ => 2 * self.kv_dim,
        };
        kv_bytes(self.k.len(), self.n_ctx, row)
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
    /// f16, ties to even; Q8_0 rows the module's encoding).
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        for (rows, src) in [(&mut self.k[layer], k), (&mut self.v[layer], v)] {
            match rows {
                Rows::F16(r) => crate::quant::f16::from_f32_slice(&src[..d], &mut r[pos * d..(pos + 1) * d]),
                Rows::F32(r) => r[pos * d..(pos + 1) * d].copy_from_slice(&src[..d]),
                Rows::Q8_0(r) => {
                    let rb = GgmlType::Q8_0.row_bytes(d);
                    encode_q8_0(&src[..d], &mut r[pos * rb..(pos + 1) * rb]);
                }
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
            Rows::Q8_0(r) => KvRows::Q8_0(&r[..n / 32 * 34]),
        }
    }
}

/// `dst` (`src.len() / 32` ggml `block_q8_0`s) = `src` quantized as the module says.
///
/// # Panics
/// When `src.len()` is not a multiple of 32 or `dst` is not 34 bytes per 32 values.
pub fn encode_q8_0(src: &[f32], dst: &mut [u8]) {
    assert!(src.len().is_multiple_of(32) && dst.len() == src.len() / 32 * 34, "Q8_0 row: 34 bytes per 32 values");
    let mut blocks = [BlockQ8::default(); 32];
    for (xs, out) in src.chunks(32 * 32).zip(dst.chunks_mut(34 * 32)) {
        let b = &mut blocks[..xs.len() / 32];
        crate::quant::quantize_q8(xs, b);
        for (blk, o) in b.iter().zip(out.chunks_exact_mut(34)) {
            // d is rounded to f16 by the quantizer: its f16 bits hold it exactly
            o[..2].copy_from_slice(&half::f16::from_f32(blk.d).to_bits().to_le_bytes());
            for (c, &q) in o[2..].iter_mut().zip(&blk.qs) {
                *c = q as u8;
            }
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
        assert!(matches!(kv32.keys(0, 1), KvRows::F32(_)) && kv32.bytes() == 2 * 4 * 3 * 4);
    }

    /// Q8_0 rows are ggml's encoding: an f16 scale of max|x| / 127 per block of 32, the values read back by the
    /// Q8_0 dequantizer (checked against the `gguf` package elsewhere) within half a step of the originals, and a
    /// decoded row encodes to the same bytes again.
    #[test]
    fn q8_0_rows_are_ggml_blocks() {
        let mut s = 3u32;
        let x: Vec<f32> = (0..96)
            .map(|i| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * if i < 32 { 0.1 } else { 40.0 }
            })
            .collect();
        let mut kv = KvCache::with_type(1, 3, 96, KvType::Q8_0);
        assert_eq!(kv.bytes(), 2 * 3 * 3 * 34);
        kv.store(0, 2, &x, &x);
        let KvRows::Q8_0(k) = kv.keys(0, 3) else { panic!("q8_0 rows") };
        let row = &k[2 * 102..3 * 102];
        let mut back = vec![0f32; 96];
        crate::quant::dequantize_row(GgmlType::Q8_0, row, &mut back).unwrap();
        for (blk, (xs, bs)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = half::f16::from_bits(u16::from_le_bytes([row[blk * 34], row[blk * 34 + 1]])).to_f32();
            assert_eq!(d, half::f16::from_f32(amax / 127.0).to_f32(), "block {blk}: scale");
            // half a step, and the f16 rounding of the scale carried over up to 127 steps
            let tol = 0.5 * d + amax * f32::powi(2.0, -11);
            assert!(xs.iter().zip(bs).all(|(a, b)| (a - b).abs() <= tol), "block {blk}: values");
        }
        let mut again = vec![0u8; 102];
        encode_q8_0(&back, &mut again);
        assert_eq!(&again[..], row);
        assert_eq!(KvType::parse("Q8_0"), Ok(KvType::Q8_0));
        assert!(KvType::parse("q4_0").is_err() && !KvType::Q8_0.fits(40) && KvType::Q8_0.fits(64));
    }
}
