//! Hyper-parameters read from GGUF metadata (`{arch}.*` keys, as written by
//! llama.cpp's `convert_hf_to_gguf.py`). Nothing is hard-coded for one model.

use crate::arch::{ArchSpec, ExpertWidthDefault, FfnKind, FfnRule, SwaRope};
use crate::gguf::{GgufError, GgufFile};
use crate::quant::{GgmlType, QuantError};

/// Errors from loading a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The GGUF container is bad.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.architecture` names an architecture this build cannot run.
    #[error("unsupported architecture {0:?} (supported: {list})", list = crate::arch::supported_list())]
    UnsupportedArchitecture(String),
    /// A tensor the architecture does not use is in the file (e.g. a shared-expert tensor in an architecture
    /// without one), so the file and its `general.architecture` disagree.
    #[error("tensor {tensor:?}: architecture {arch} has no such tensor ({why})")]
    UnexpectedTensor {
        /// Tensor name.
        tensor: String,
        /// `general.architecture`.
        arch: String,
        /// What the architecture lacks.
        why: String,
    },
    /// A tensor has a format this build cannot compute with.
    #[error("tensor {tensor:?}: unsupported tensor type {ty:?} (supported: {list})", list = crate::quant::format::supported_list())]
    UnsupportedTensorType {
        /// Tensor name.
        tensor: String,
        /// Its format.
        ty: GgmlType,
    },
    /// A tensor's shape disagrees with the hyper-parameters.
    #[error("tensor {tensor:?}: shape {found:?}, expected {expected:?}")]
    BadShape {
        /// Tensor name.
        tensor: String,
        /// Shape in the file (GGML order).
        found: Vec<u64>,
        /// Shape expected from the metadata.
        expected: Vec<u64>,
    },
    /// A hyper-parameter is inconsistent.
    #[error("bad hyper-parameter: {0}")]
    BadHyperParameter(String),
    /// Tokenizer metadata is missing or inconsistent.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Quant kernel error.
    #[error(transparent)]
    Quant(#[from] QuantError),
}

/// Hyper-parameters of a model of one of the [`crate::arch::REGISTRY`] architectures.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// `general.architecture`.
    pub arch: String,
    /// The architecture's choices (RoPE kind, q/k norm, FFN kind, gating, renormalisation).
    pub spec: ArchSpec,
    /// `general.name` (empty if absent).
    pub name: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size (`embedding_length`).
    pub n_embd: usize,
    /// Dense FFN width (`feed_forward_length`).
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention; `n_head % n_head_kv == 0`).
    pub n_head_kv: usize,
    /// Per-head dimension (`attention.key_length`, default `n_embd / n_head`).
    pub head_dim: usize,
    /// Rotated dimensions per head (`rope.dimension_count`, default `head_dim`).
    pub n_rot: usize,
    /// RoPE base frequency (`rope.freq_base`, default 10000).
    pub rope_freq_base: f32,
    /// RoPE position scale (1 / `rope.scaling.factor` for linear or YaRN scaling, else 1).
    pub rope_freq_scale: f32,
    /// YaRN's corrections to the scaled RoPE (`rope.scaling.type = yarn`), `None` for none.
    pub rope_yarn: Option<Yarn>,
    /// RMSNorm epsilon (`attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Training context length in tokens (`context_length`).
    pub n_ctx_train: usize,
    /// Vocabulary size (length of `tokenizer.ggml.tokens`).
    pub n_vocab: usize,
    /// Routed experts per layer (`expert_count`; 0 = dense).
    pub n_expert: usize,
    /// Experts selected per token (`expert_used_count`, the top-k).
    pub n_expert_used: usize,
    /// Expert FFN width (`expert_feed_forward_length`; default `n_ff`, or `n_ff / n_expert_used` for the
    /// architectures whose llama.cpp builder says so).
    pub n_ff_exp: usize,
    /// Shared expert FFN width (`expert_shared_feed_forward_length`, default `n_ff`; 0 without one).
    pub n_ff_shexp: usize,
    /// Positions a sliding-window layer attends to, itself included (`attention.sliding_window`; 0 = no sliding
    /// window; which layers slide: the architecture's `swa_pattern`).
    pub sliding_window: usize,
    /// Attention score scale: `1/sqrt(head_dim)`, except Gemma 3 27B's `1/sqrt(n_embd/n_head)` (its
    /// `query_pre_attn_scalar`; llama.cpp's `f_attention_scale`, told by its 62 layers).
    pub attn_scale: f32,
    /// RoPE base of the sliding-window layers (llama.cpp's `rope_freq_base_train_swa`: the architecture's own, or
    /// the global base unless `rope.freq_base_swa` names one).
    pub rope_freq_base_swa: f32,
    /// RoPE position scale of the sliding-window layers (1 for an architecture whose sliding layers have a RoPE
    /// of their own, else [`ModelConfig::rope_freq_scale`]); [`ModelConfig::rope_yarn`] applies to them too.
    pub rope_freq_scale_swa: f32,
}

/// YaRN RoPE scaling (arXiv:2309.00071) as ggml's `rope_yarn` applies it: pair `i` of a head, at the unscaled
/// angle `θ = pos · base^(−2i/n_rot)`, turns by `θ·s·(1 − r) + θ·r` with `s` the position scale and `r =
/// ext_factor · ramp(i)` (`ramp` 1 below the correction dimension `lo`, 0 above `hi`, linear between), and its cos
/// and sin are multiplied by `mscale = attn_factor · (1 + 0.1·ln(1/s))` (the latter factor only when `ext_factor
/// ≠ 0`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Mix of extrapolation into the angles (1: llama.cpp's default for YaRN files of these architectures).
    pub ext_factor: f32,
    /// Factor on cos and sin before YaRN's own (llama.cpp's context `yarn_attn_factor`: `get_mscale(factor)`
    /// over YaRN's factor, times `rope.scaling.attn_factor`; 1 for gpt-oss).
    pub attn_factor: f32,
    /// Fast correction boundary in rotations (32, llama.cpp's default).
    pub beta_fast: f32,
    /// Slow correction boundary in rotations (1, llama.cpp's default).
    pub beta_slow: f32,
    /// The context the model was trained at before scaling (`rope.scaling.original_context_length`, default
    /// `context_length`).
    pub n_ctx_orig: usize,
}

impl Yarn {
    /// The correction dimensions `[lo, hi]` of a RoPE of `n_rot` dimensions at `base` (ggml's
    /// `ggml_rope_yarn_corr_dims`): the pair indices where a `beta_fast` / `beta_slow` rotation fits the original
    /// context, floored / ceiled, within `0 ..= n_rot − 1`.
    pub fn corr_dims(&self, n_rot: usize, base: f32) -> [f32; 2] {
        let dim = |beta: f32| {
            n_rot as f32 * (self.n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
        };
        [dim(self.beta_fast).floor().max(0.0), dim(self.beta_slow).ceil().min(n_rot as f32 - 1.0)]
    }
}

impl ModelConfig {
    /// Whether layer `l` attends through the sliding window (and uses the sliding layers' RoPE).
    pub fn is_swa(&self, l: usize) -> bool {
        let n = self.spec.def.swa_pattern;
        n > 0 && self.sliding_window > 0 && l % n != n - 1
    }

    /// Reads the hyper-parameters. Errors: unsupported architecture, missing
    /// keys, inconsistent values.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let arch = f.architecture()?.to_string();
        let Some(def) = crate::arch::lookup(&arch) else {
            return Err(ModelError::UnsupportedArchitecture(arch));
        };
        let k = |s: &str| format!("{arch}.{s}");
        let opt_u = |s: &str| -> Result<Option<usize>, GgufError> {
            match f.get(&k(s)) {
                None => Ok(None),
                Some(_) => Ok(Some(f.get_u32(&k(s))? as usize)),
            }
        };
        let opt_f = |s: &str| -> Result<Option<f32>, GgufError> {
            match f.get(&k(s)) {
                None => Ok(None),
                Some(_) => Ok(Some(f.get_f64(&k(s))? as f32)),
            }
        };
        let n_layer = f.get_u32(&k("block_count"))? as usize;
        let n_embd = f.get_u32(&k("embedding_length"))? as usize;
        let n_head = f.get_u32(&k("attention.head_count"))? as usize;
        let n_head_kv = opt_u("attention.head_count_kv")?.unwrap_or(n_head);
        let n_ff = opt_u("feed_forward_length")?.unwrap_or(0);
        let n_expert = opt_u("expert_count")?.unwrap_or(0);
        let n_expert_used = opt_u("expert_used_count")?.unwrap_or(0);
        let bad = |m: String| Err(ModelError::BadHyperParameter(m));
        let ffn = match (def.ffn, n_expert > 0) {
            (FfnRule::Dense, false) | (FfnRule::DenseOrMoe, false) => FfnKind::Dense,
            (FfnRule::Moe, true) | (FfnRule::DenseOrMoe, true) => FfnKind::Moe,
            (FfnRule::MoeShared, true) => FfnKind::MoeShared,
            (FfnRule::Dense, true) => {
                return bad(format!("{arch}.expert_count is {n_expert}, but {arch} is a dense architecture"))
            }
            (FfnRule::Moe | FfnRule::MoeShared, false) => {
                return bad(format!("{arch}.expert_count is missing or 0, but {arch} needs routed experts"))
            }
        };
        let n_ff_exp = match (opt_u("expert_feed_forward_length")?, def.expert_width) {
            (Some(v), _) => v,
            (None, ExpertWidthDefault::FeedForward) => n_ff,
            (None, ExpertWidthDefault::FeedForwardOverTopK) => n_ff / n_expert_used.max(1),
        };
        let n_ff_shexp = match ffn {
            FfnKind::MoeShared => opt_u("expert_shared_feed_forward_length")?.unwrap_or(n_ff),
            _ => 0,
        };
        if ffn == FfnKind::MoeShared && n_ff_shexp == 0 {
            return bad(format!("{arch}.expert_shared_feed_forward_length (or feed_forward_length) is missing"));
        }
        if ffn != FfnKind::Dense && n_ff_exp == 0 {
            return bad(format!("{arch}.expert_feed_forward_length is missing or 0"));
        }
        if n_layer == 0 || n_embd == 0 || n_head == 0 || n_head_kv == 0 {
            return bad(format!("block_count {n_layer}, embedding_length {n_embd}, head_count {n_head}, head_count_kv {n_head_kv} must be > 0"));
        }
        // every layer has tensors of its own: a block count above the file's tensors is not this file's (it would
        // size the layer tables before any tensor is looked up)
        if n_layer > f.tensors.len() {
            return bad(format!("block_count {n_layer} but the file holds {} tensors", f.tensors.len()));
        }
        if !n_head.is_multiple_of(n_head_kv) {
            return bad(format!("head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"));
        }
        let head_dim = opt_u("attention.key_length")?.unwrap_or(n_embd / n_head);
        if head_dim == 0 || head_dim % 2 != 0 {
            return bad(format!("head dimension {head_dim} must be even and > 0"));
        }
        let n_rot = opt_u("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return bad(format!("rope.dimension_count {n_rot} must be even and <= head dimension {head_dim}"));
        }
        if n_expert > 0 && (n_expert_used == 0 || n_expert_used > n_expert) {
            return bad(format!("expert_used_count {n_expert_used} must be in 1..={n_expert}"));
        }
        if n_expert == 0 && n_ff == 0 {
            return bad("feed_forward_length is missing for a dense model".into());
        }
        let scaling = f.get(&k("rope.scaling.type")).and_then(|v| v.as_str());
        let rope_freq_scale = match (scaling, opt_f("rope.scaling.factor")?) {
            (Some("linear" | "yarn"), Some(fac)) if fac > 0.0 => 1.0 / fac,
            (Some("none" | "linear" | "yarn") | None, _) => 1.0,
            (Some(t), _) => {
                return bad(format!("rope.scaling.type {t:?} is not supported (supported: none, linear, yarn)"))
            }
        };
        let n_ctx_train = opt_u("context_length")?.unwrap_or(2048);
        let rope_yarn = match scaling {
            Some("yarn") => {
                // llama.cpp's context parameters (llama-context.cpp) for these architectures: ext_factor 1, betas 32
                // and 1 (it reads their keys, and a log multiplier, only for architectures outside this registry:
                // grok, mistral3, deepseek2), and the attention factor get_mscale(factor) divided by the
                // 1 + 0.1·ln(factor) that ggml's rope_yarn multiplies in again, times rope.scaling.attn_factor
                let (ext_factor, factor) = (1.0, 1.0 / rope_freq_scale);
                let mscale = if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 };
                let attn_factor =
                    mscale * (1.0 / (1.0 + 0.1 * factor.ln())) * opt_f("rope.scaling.attn_factor")?.unwrap_or(1.0);
                Some(Yarn {
                    ext_factor,
                    attn_factor,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    n_ctx_orig: opt_u("rope.scaling.original_context_length")?.unwrap_or(n_ctx_train).max(1),
                })
            }
            _ => None,
        };
        let rope_freq_base = opt_f("rope.freq_base")?.unwrap_or(10000.0);
        let (rope_freq_base_swa, rope_freq_scale_swa) = match def.swa_rope {
            SwaRope::Base(b) => (b, 1.0),
            SwaRope::Global => (opt_f("rope.freq_base_swa")?.unwrap_or(rope_freq_base), rope_freq_scale),
        };
        let n_vocab = f.get_array("tokenizer.ggml.tokens")?.len();
        // required where the architecture has sliding-window layers (llama.cpp refuses such a file without it)
        let sliding_window = if def.swa_pattern > 0 { f.get_u32(&k("attention.sliding_window"))? as usize } else { 0 };
        let attn_scale = if def.name == "gemma3" && n_layer == 62 {
            1.0 / ((n_embd / n_head) as f32).sqrt()
        } else {
            1.0 / (head_dim as f32).sqrt()
        };
        Ok(ModelConfig {
            attn_scale,
            sliding_window,
            rope_freq_base_swa,
            rope_freq_scale_swa,
            rope_yarn,
            spec: ArchSpec { def, ffn },
            n_ff_shexp,
            name: f.get("general.name").and_then(|v| v.as_str()).unwrap_or("").to_string(),
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_freq_base,
            rope_freq_scale,
            rms_eps: opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            n_ctx_train,
            n_vocab,
            n_expert,
            n_expert_used,
            n_ff_exp,
            arch,
        })
    }
}
