//! Perplexity over a token sequence, measured as llama.cpp's `llama-perplexity` does: the tokens are cut into
//! chunks of `ctx`, each chunk runs from an empty KV cache, and the second half of each chunk is scored (the
//! first half is context). Source of the convention: llama.cpp `tools/perplexity` (`first = n_ctx / 2`).

use super::forward::{Logits, Model, Scratch};

/// Result of [`perplexity`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    /// exp(mean negative log-likelihood) over the scored tokens.
    pub ppl: f64,
    /// Mean negative log-likelihood (nats per token).
    pub nll: f64,
    /// Chunks run.
    pub chunks: usize,
    /// Tokens scored: `ctx − 1 − ctx/2` per chunk.
    pub scored: usize,
}

/// Perplexity of `model` over `ids` in chunks of `ctx` tokens (at most `max_chunks`, 0 = all whole chunks).
/// Returns `None` when `ids` holds less than one chunk or `ctx < 4`.
pub fn perplexity(model: &Model, ids: &[u32], ctx: usize, max_chunks: usize) -> Option<Perplexity> {
    if ctx < 4 {
        return None;
    }
    let mut chunks = ids.len() / ctx;
    if max_chunks > 0 {
        chunks = chunks.min(max_chunks);
    }
    if chunks == 0 {
        return None;
    }
    let nv = model.cfg.n_vocab;
    let first = ctx / 2;
    let (mut nll, mut scored) = (0f64, 0usize);
    let mut kv = model.new_kv(ctx);
    let mut s = Scratch::default();
    for c in 0..chunks {
        let chunk = &ids[c * ctx..(c + 1) * ctx];
        kv.clear();
        let logits = model.forward(chunk, &mut kv, Logits::All, &mut s);
        for i in first..ctx - 1 {
            let row = &logits[i * nv..(i + 1) * nv];
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
            nll += lse - row[chunk[i + 1] as usize] as f64;
            scored += 1;
        }
    }
    let nll = nll / scored as f64;
    Some(Perplexity { ppl: nll.exp(), nll, chunks, scored })
}
