//! gpt-oss (`gpt-oss`, OpenAI's gpt-oss-20b and -120b; llama.cpp's `LLM_ARCH_OPENAI_MOE`, builder
//! `src/models/openai-moe.cpp`): routed experts only (experts in MXFP4 in the published files), every layer MoE.
//! Attention: q/k/v/output biases, NeoX RoPE with YaRN scaling (`rope.scaling.type = yarn`, factor 32 over an
//! original context of 4096), learned attention sinks (`attn_sinks`: one logit per query head joining its softmax
//! without a value), and sliding-window attention (`attention.sliding_window`, 128) on the even layers, the odd
//! ones global, both with the same RoPE. The FFN input norm is stored as `post_attention_norm`. Router: logits plus
//! a bias, the top-k chosen on them, then a softmax over the chosen `k` (no renormalisation, no scale). Experts:
//! gate and up products plus per-expert biases, the clamped SwiGLU (`min(g, 7)·σ(1.702·min(g, 7))·(clamp(u, ±7) +
//! 1)`), down product plus its bias.

use super::{ArchDef, ExpertWidthDefault, FfnAct, FfnRule, Gating, QkNorm, RopeKind, SwaRope};

/// The `gpt-oss` row.
pub const GPT_OSS: ArchDef = ArchDef {
    name: "gpt-oss",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::None,
    ffn: FfnRule::Moe,
    gating: Gating::SoftmaxTopK,
    norm_topk: false,
    expert_weights_scale: 1.0,
    expert_width: ExpertWidthDefault::FeedForward,
    act: FfnAct::SwigluOai,
    swa_pattern: 2,
    swa_rope: SwaRope::Global,
    ffn_norm: "post_attention_norm",
    attn_sinks: true,
    moe_bias: true,
    ..super::PLAIN
};
