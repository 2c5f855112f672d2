//! OLMoE (`olmoe`, OLMoE-1B-7B): RMSNorm of the whole query and key projections before they are split into
//! heads (`attn_q_norm` `n_head·head_dim` wide, `attn_k_norm` `n_head_kv·head_dim`), NeoX RoPE; MoE: softmax,
//! top-k weights without renormalisation, no shared expert.

use super::{ArchDef, ExpertWidthDefault, FfnRule, Gating, QkNorm, RopeKind};

/// The `olmoe` row.
pub const OLMOE: ArchDef = ArchDef {
    name: "olmoe",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::Full,
    ffn: FfnRule::Moe,
    gating: Gating::Softmax,
    norm_topk: false,
    expert_weights_scale: 1.0,
    expert_width: ExpertWidthDefault::FeedForward,
    ..super::PLAIN
};
