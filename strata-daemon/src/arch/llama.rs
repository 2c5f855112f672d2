//! `llama`: dense, or with Mixtral-style routed experts (softmax over all experts, top-k, weights renormalised
//! to sum 1). Adjacent-pair RoPE (llama.cpp's converter permutes the q/k rows for it); q/k/v biases when the
//! file has them.

use super::{ArchDef, ExpertWidthDefault, FfnRule, Gating, QkNorm, RopeKind};

/// The `llama` row.
pub const LLAMA: ArchDef = ArchDef {
    name: "llama",
    rope: RopeKind::Normal,
    qk_norm: QkNorm::None,
    ffn: FfnRule::DenseOrMoe,
    gating: Gating::Softmax,
    norm_topk: true,
    expert_weights_scale: 1.0,
    expert_width: ExpertWidthDefault::FeedForward,
    ..super::PLAIN
};
