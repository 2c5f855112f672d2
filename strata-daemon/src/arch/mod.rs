//! Architectures as data: one small file per `general.architecture` value, each a [`ArchDef`] row of
//! [`REGISTRY`]. A row names the choices that make the architecture differ from the others (RoPE kind, q/k
//! norm, FFN kind, gating, top-k renormalisation, the default expert width); the tensor names are GGUF's and
//! shared by every architecture ([`tensor`]). The forward pass (`crate::model::forward`) reads only the
//! resolved [`ArchSpec`], never an architecture's name.
//!
//! The choices follow llama.cpp's model builders for the same architecture (`src/models/<arch>.cpp` and
//! `llama_model_rope_type` in `src/llama-model.cpp`), so that a file converted by llama.cpp's
//! `convert_hf_to_gguf.py` computes the same function here.

pub mod config;
pub mod gemma3;
pub mod gpt_oss;
pub mod llama;
pub mod olmoe;
pub mod qwen2;
pub mod qwen3;
pub mod weights;

/// How RoPE pairs the dimensions of a head (llama.cpp's `LLAMA_ROPE_TYPE_NORM` / `_NEOX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKind {
    /// Adjacent pairs `(x[2i], x[2i+1])` (`llama`; its converter permutes the q/k rows to match).
    Normal,
    /// Halves `(x[i], x[i + n_rot/2])` (GPT-NeoX style: Qwen2, Qwen3, OLMoE).
    Neox,
}

/// RMSNorm of the queries and keys after their projections, before RoPE (`attn_q_norm`, `attn_k_norm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// None.
    None,
    /// Over each head's `head_dim` values, one weight vector of `head_dim` shared by the heads (Qwen3).
    PerHead,
    /// Over the whole projection (`n_head·head_dim` for q, `n_head_kv·head_dim` for k), weights of that
    /// width (OLMoE).
    Full,
}

/// Which FFN a block has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    /// `ffn_gate`, `ffn_up`, `ffn_down`.
    Dense,
    /// Routed experts `ffn_{gate,up,down}_exps` with the router `ffn_gate_inp`.
    Moe,
    /// Routed experts plus one shared expert `ffn_{gate,up,down}_shexp`, whose output is scaled by
    /// `sigmoid(ffn_gate_inp_shexp · x)` (Qwen2-MoE).
    MoeShared,
}

/// Which FFN kinds an architecture allows; `expert_count` in the metadata picks among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnRule {
    /// Dense only (`expert_count` must be absent or 0).
    Dense,
    /// Routed experts only (`expert_count` > 0 required).
    Moe,
    /// Routed experts plus a shared expert (`expert_count` > 0 required).
    MoeShared,
    /// Dense without `expert_count`, routed experts with it (`llama`: dense or Mixtral-style).
    DenseOrMoe,
}

/// How router logits become expert probabilities before the top-k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts.
    Softmax,
    /// Element-wise sigmoid.
    Sigmoid,
    /// The top-k chosen on the raw logits, then a softmax over the `k` chosen logits only (llama.cpp's
    /// `LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT`: gpt-oss).
    SoftmaxTopK,
}

/// Default expert FFN width when `expert_feed_forward_length` is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertWidthDefault {
    /// `feed_forward_length` (llama.cpp's `llama`).
    FeedForward,
    /// `feed_forward_length / expert_used_count` (llama.cpp's Qwen MoE builders).
    FeedForwardOverTopK,
}

/// The FFN's gate activation (`act(gate · x) ⊙ (up · x)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnAct {
    /// SiLU (SwiGLU: llama, Qwen, OLMoE).
    Silu,
    /// GELU, tanh approximation (GeGLU: Gemma).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU (ggml's `swiglu_oai`, α = 1.702, limit 7): with `g = min(gate, 7)` and
    /// `u = clamp(up, −7, 7)`, `g·σ(1.702·g) · (u + 1)`.
    SwigluOai,
}

/// The RoPE of the sliding-window layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SwaRope {
    /// Their own base and no position scaling (Gemma 3: base 10000, llama.cpp's `rope_freq_base_train_swa`).
    Base(f32),
    /// The global layers' RoPE (base, scaling, YaRN), unless `rope.freq_base_swa` names a base of their own
    /// (gpt-oss).
    Global,
}

/// One architecture of the registry: its GGUF name and its choices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArchDef {
    /// `general.architecture` value, also the prefix of its hyper-parameter keys (`qwen3moe.expert_count`).
    pub name: &'static str,
    /// RoPE pairing.
    pub rope: RopeKind,
    /// q/k RMSNorm.
    pub qk_norm: QkNorm,
    /// FFN kinds allowed.
    pub ffn: FfnRule,
    /// Router probabilities.
    pub gating: Gating,
    /// The top-k weights are divided by their sum (Mixtral, Qwen3-MoE) or used as they are (Qwen2-MoE, OLMoE).
    pub norm_topk: bool,
    /// Factor on the routed experts' weights after the top-k (1 = none).
    pub expert_weights_scale: f32,
    /// `expert_feed_forward_length` default.
    pub expert_width: ExpertWidthDefault,
    /// The FFN's gate activation.
    pub act: FfnAct,
    /// RMSNorms of the attention output and of the FFN output before their residual adds
    /// (`post_attention_norm`, `post_ffw_norm`: Gemma 2/3).
    pub post_norms: bool,
    /// The token embeddings are multiplied by `sqrt(n_embd)` (Gemma).
    pub embd_scale: bool,
    /// Sliding-window attention pattern: 0 = every layer attends to the whole context; n > 0 = layer l attends to the
    /// last `attention.sliding_window` positions unless `l % n == n − 1` (a global layer) (llama.cpp's
    /// `set_swa_pattern`); the sliding layers' RoPE is [`ArchDef::swa_rope`].
    pub swa_pattern: usize,
    /// RoPE of the sliding-window layers.
    pub swa_rope: SwaRope,
    /// The GGUF role of the RMSNorm before the FFN: `ffn_norm`, or `post_attention_norm` (gpt-oss, whose
    /// converter names its FFN input norm so).
    pub ffn_norm: &'static str,
    /// Learned attention sinks (`attn_sinks`, one logit per query head that joins every softmax of that head's
    /// scores without a value: gpt-oss).
    pub attn_sinks: bool,
    /// Biases on the router (`ffn_gate_inp.bias`, per expert) and on every expert's gate, up and down products
    /// (`ffn_{gate,up,down}_exps.bias`, `[n_ff_exp, n_expert]` / `[n_embd, n_expert]`): gpt-oss.
    pub moe_bias: bool,
}

/// The choices every architecture shared before Gemma (SwiGLU, no post-norms, no embedding scale, no sliding
/// window): the rows spread it.
pub const PLAIN: ArchDef = ArchDef {
    name: "",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::None,
    ffn: FfnRule::Dense,
    gating: Gating::Softmax,
    norm_topk: true,
    expert_weights_scale: 1.0,
    expert_width: ExpertWidthDefault::FeedForward,
    act: FfnAct::Silu,
    post_norms: false,
    embd_scale: false,
    swa_pattern: 0,
    swa_rope: SwaRope::Global,
    ffn_norm: "ffn_norm",
    attn_sinks: false,
    moe_bias: false,
};

/// The architecture of one loaded file: its registry row and the FFN kind its metadata chose.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArchSpec {
    /// The registry row.
    pub def: &'static ArchDef,
    /// The FFN kind of every block.
    pub ffn: FfnKind,
}

impl ArchSpec {
    /// `general.architecture`.
    pub fn name(&self) -> &'static str {
        self.def.name
    }

    /// Blocks route tokens to experts.
    pub fn is_moe(&self) -> bool {
        self.ffn != FfnKind::Dense
    }
}

/// Every architecture this build runs, in the order of DESIGN.md §9.
pub const REGISTRY: &[&ArchDef] = &[
    &llama::LLAMA,
    &qwen3::QWEN3MOE,
    &qwen3::QWEN3,
    &qwen2::QWEN2MOE,
    &qwen2::QWEN2,
    &olmoe::OLMOE,
    &gemma3::GEMMA3,
    &gpt_oss::GPT_OSS,
];

/// The registry row of `name`, if this build runs it.
pub fn lookup(name: &str) -> Option<&'static ArchDef> {
    REGISTRY.iter().copied().find(|d| d.name == name)
}

/// The supported architectures' names, comma-separated (for error messages).
pub fn supported_list() -> String {
    REGISTRY.iter().map(|d| d.name).collect::<Vec<_>>().join(", ")
}

/// GGUF tensor names (as llama.cpp's `LLM_TENSOR_*` names them), shared by every architecture.
pub mod tensor {
    /// `blk.{layer}.{role}.weight`.
    pub fn weight(layer: usize, role: &str) -> String {
        format!("blk.{layer}.{role}.weight")
    }
    /// `blk.{layer}.{role}.bias`.
    pub fn bias(layer: usize, role: &str) -> String {
        format!("blk.{layer}.{role}.bias")
    }
    /// Token embeddings `[n_embd, n_vocab]`.
    pub const TOKEN_EMBD: &str = "token_embd.weight";
    /// Output projection `[n_embd, n_vocab]` (absent when tied to the embeddings).
    pub const OUTPUT: &str = "output.weight";
    /// Final RMSNorm `[n_embd]`.
    pub const OUTPUT_NORM: &str = "output_norm.weight";
    /// Roles of a block's shared expert (Qwen2-MoE); a file whose architecture has none must not hold them.
    pub const SHARED_EXPERT_ROLES: &[&str] =
        &["ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"];
    /// Roles whose `.bias` an architecture with MoE biases has (gpt-oss); a file whose architecture has none
    /// must not hold them.
    pub const MOE_BIAS_ROLES: &[&str] = &["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];
    /// Attention sinks `[n_head]` (gpt-oss).
    pub const ATTN_SINKS: &str = "attn_sinks";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_names_are_unique_and_found() {
        for d in REGISTRY {
            assert_eq!(lookup(d.name), Some(*d));
            assert_eq!(REGISTRY.iter().filter(|e| e.name == d.name).count(), 1);
        }
        assert!(lookup("gpt2").is_none());
        assert_eq!(supported_list(), "llama, qwen3moe, qwen3, qwen2moe, qwen2, olmoe, gemma3, gpt-oss");
    }
}
