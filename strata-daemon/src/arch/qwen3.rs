//! Qwen3 (`qwen3`, dense) and Qwen3-MoE (`qwen3moe`, e.g. Qwen3-30B-A3B): per-head RMSNorm of the queries and
//! keys before RoPE (`attn_q_norm`, `attn_k_norm`, `head_dim` wide), NeoX RoPE, a head size from
//! `attention.key_length` (so `n_head·head_dim` may differ from `n_embd`); MoE: softmax, top-k, renormalised,
//! no shared expert.

use super::{ArchDef, ExpertWidthDefault, FfnRule, Gating, QkNorm, RopeKind};

/// The `qwen3moe` row.
pub const QWEN3MOE: ArchDef = ArchDef {
    name: "qwen3moe",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::PerHead,
    ffn: FfnRule::Moe,
    gating: Gating::Softmax,
    norm_topk: true,
    expert_weights_scale: 1.0,
    expert_width: ExpertWidthDefault::FeedForwardOverTopK,
    ..super::PLAIN
};

/// The `qwen3` row (dense).
pub const QWEN3: ArchDef = ArchDef { name: "qwen3", ffn: FfnRule::Dense, ..QWEN3MOE };
