//! Qwen2 (`qwen2`, dense) and Qwen2-MoE (`qwen2moe`, Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, NeoX
//! RoPE, no q/k norm; MoE: softmax over the experts, top-k weights used without renormalisation, plus a shared
//! expert (`ffn_{gate,up,down}_shexp`, width `expert_shared_feed_forward_length`) whose output is scaled by
//! `sigmoid(ffn_gate_inp_shexp · x)` and added to the routed experts' sum. The shared expert is a dense
//! weight, not a tiered expert.

use super::{ArchDef, ExpertWidthDefault, FfnRule, Gating, QkNorm, RopeKind};

/// The `qwen2moe` row.
pub const QWEN2MOE: ArchDef = ArchDef {
    name: "qwen2moe",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::None,
    ffn: FfnRule::MoeShared,
    gating: Gating::Softmax,
    norm_topk: false,
    expert_weights_scale: 1.0,
    expert_width: ExpertWidthDefault::FeedForwardOverTopK,
    ..super::PLAIN
};

/// The `qwen2` row (dense).
pub const QWEN2: ArchDef = ArchDef { name: "qwen2", ffn: FfnRule::Dense, ..QWEN2MOE };
