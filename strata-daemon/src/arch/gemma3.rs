//! Gemma 3 (`gemma3`, dense; e.g. Gemma 3 270M): GeGLU FFN (tanh GELU of the gate), RMSNorms of the attention and
//! FFN outputs before their residual adds (`post_attention_norm`, `post_ffw_norm`), per-head q/k RMSNorm, NeoX RoPE,
//! token embeddings scaled by `sqrt(n_embd)`, output tied to the embeddings, and sliding-window attention on five
//! layers of every six (`attention.sliding_window` positions, RoPE base 10000) with every sixth layer global
//! (`rope.freq_base`). The norm weights in GGUF already hold Gemma's `1 + w` (llama.cpp's converter adds the 1), so
//! they are plain RMSNorm weights here. As llama.cpp's `gemma3` builder (`src/models/gemma3.cpp`).

use super::{ArchDef, FfnAct, FfnRule, QkNorm, RopeKind, SwaRope};

/// The `gemma3` row.
pub const GEMMA3: ArchDef = ArchDef {
    name: "gemma3",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::PerHead,
    ffn: FfnRule::Dense,
    act: FfnAct::GeluTanh,
    post_norms: true,
    embd_scale: true,
    swa_pattern: 6,
    swa_rope: SwaRope::Base(10000.0),
    ..super::PLAIN
};
