//! The located weights of a model: every tensor the forward pass reads, as a byte range of the mapped GGUF file
//! with its format and 2-D shape, checked against the hyper-parameters ([`ModelConfig`]) at load. Names are GGUF's
//! (`blk.N.attn_q.weight`, ...; [`crate::arch::tensor`]). Backends turn these into their own buffers; the tiers
//! read the experts' byte ranges from them.

use super::config::{ModelConfig, ModelError};
use crate::arch::{tensor, FfnKind, QkNorm};
use crate::gguf::{GgufFile, TensorInfo};
use crate::quant::{dequantize_row, GgmlType};

/// A weight tensor located in the mapped file: byte range, format and 2-D shape.
#[derive(Debug, Clone)]
pub struct Weight {
    /// GGUF tensor name.
    pub name: String,
    /// Format.
    pub ty: GgmlType,
    /// Byte offset in the file.
    pub offset: usize,
    /// Rows (`dims[1] * dims[2]...`).
    pub rows: usize,
    /// Columns (`dims[0]`).
    pub cols: usize,
}

impl Weight {
    /// Size of the tensor's data in bytes.
    pub fn bytes(&self) -> usize {
        self.rows * self.ty.row_bytes(self.cols)
    }
}

/// Experts of one MoE layer.
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    /// Router `ffn_gate_inp`: `n_expert` rows of `n_embd`.
    pub router: Weight,
    /// `ffn_gate_exps`: `n_expert * n_ff_exp` rows of `n_embd`.
    pub gate: Weight,
    /// `ffn_up_exps`: `n_expert * n_ff_exp` rows of `n_embd`.
    pub up: Weight,
    /// `ffn_down_exps`: `n_expert * n_embd` rows of `n_ff_exp`.
    pub down: Weight,
    /// The shared expert (`qwen2moe`), computed densely beside the routed ones.
    pub shared: Option<SharedExpert>,
    /// `ffn_gate_inp.bias` (`n_expert` values), added to the router logits (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// The experts' biases (gpt-oss).
    pub bias: Option<ExpertBias>,
}

/// Per-expert biases of the expert products, f32, expert-major: expert `x`'s values are the `x`-th run of each.
/// They are small (`n_expert × (2·n_ff_exp + n_embd)` values a layer) and live beside the dense weights, not in the
/// expert tiers.
#[derive(Debug, Clone)]
pub struct ExpertBias {
    /// `ffn_gate_exps.bias` (`[n_ff_exp, n_expert]`): added to the gate product before the activation.
    pub gate: Vec<f32>,
    /// `ffn_up_exps.bias` (`[n_ff_exp, n_expert]`): added to the up product.
    pub up: Vec<f32>,
    /// `ffn_down_exps.bias` (`[n_embd, n_expert]`): added to the expert's output before its routing weight.
    pub down: Vec<f32>,
}

/// A shared expert: a dense SwiGLU FFN every token goes through, scaled by a sigmoid gate.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    /// `ffn_gate_inp_shexp` (`n_embd` values): the gate's logit is its dot product with the normalized input.
    pub gate_inp: Vec<f32>,
    /// `ffn_gate_shexp` (`n_ff_shexp` rows of `n_embd`).
    pub gate: Weight,
    /// `ffn_up_shexp` (`n_ff_shexp` rows of `n_embd`).
    pub up: Weight,
    /// `ffn_down_shexp` (`n_embd` rows of `n_ff_shexp`).
    pub down: Weight,
}

/// The FFN of a block.
#[derive(Debug, Clone)]
pub enum Ffn {
    /// `ffn_gate`, `ffn_up` (`n_ff` rows of `n_embd`), `ffn_down` (`n_embd` rows of `n_ff`).
    Dense {
        /// gate
        gate: Weight,
        /// up
        up: Weight,
        /// down
        down: Weight,
    },
    /// Routed experts.
    Moe(ExpertWeights),
}

/// One transformer block's weights.
#[derive(Debug, Clone)]
pub struct Block {
    /// `attn_norm` (n_embd).
    pub attn_norm: Vec<f32>,
    /// `attn_q` (n_head·head_dim rows of n_embd).
    pub q: Weight,
    /// `attn_k` (n_head_kv·head_dim rows).
    pub k: Weight,
    /// `attn_v` (n_head_kv·head_dim rows).
    pub v: Weight,
    /// `attn_output` (n_embd rows of n_head·head_dim).
    pub o: Weight,
    /// `attn_q.bias`, `attn_k.bias`, `attn_v.bias`, `attn_output.bias` (each as wide as its projection's
    /// output), when the file has them.
    pub bias: AttnBias,
    /// `attn_q_norm` (`head_dim` for a per-head norm, `n_head·head_dim` for a full-width one).
    pub q_norm: Option<Vec<f32>>,
    /// `attn_k_norm` (`head_dim`, or `n_head_kv·head_dim`).
    pub k_norm: Option<Vec<f32>>,
    /// The RMSNorm before the FFN (n_embd): `ffn_norm`, or the role the architecture names for it
    /// ([`crate::arch::ArchDef::ffn_norm`]).
    pub ffn_norm: Vec<f32>,
    /// `attn_sinks` (`n_head` logits, one per query head), for an architecture with attention sinks.
    pub attn_sinks: Option<Vec<f32>>,
    /// The block's FFN.
    pub ffn: Ffn,
    /// `post_attention_norm` (n_embd): RMSNorm of the attention output before its residual add (architectures
    /// with `post_norms`).
    pub post_attn_norm: Option<Vec<f32>>,
    /// `post_ffw_norm` (n_embd): RMSNorm of the FFN output before its residual add.
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// Attention projection biases (f32), each absent when the file has none.
#[derive(Debug, Clone, Default)]
pub struct AttnBias {
    /// Queries (`n_head·head_dim`).
    pub q: Option<Vec<f32>>,
    /// Keys (`n_head_kv·head_dim`).
    pub k: Option<Vec<f32>>,
    /// Values (`n_head_kv·head_dim`).
    pub v: Option<Vec<f32>>,
    /// Output (`n_embd`).
    pub o: Option<Vec<f32>>,
}

impl AttnBias {
    /// No bias at all.
    pub fn is_empty(&self) -> bool {
        self.q.is_none() && self.k.is_none() && self.v.is_none() && self.o.is_none()
    }
}

/// Every weight of a model, located in its file.
#[derive(Debug, Clone)]
pub struct Weights {
    /// `token_embd` (n_vocab rows of n_embd).
    pub tok_embd: Weight,
    /// Transformer blocks.
    pub blocks: Vec<Block>,
    /// `output_norm` weights (n_embd).
    pub out_norm: Vec<f32>,
    /// `output` (n_vocab rows of n_embd; `token_embd` when tied).
    pub output: Weight,
    /// Some matrix pairs with ggml's Q8_K activations (a K-quant, IQ4_XS or a lattice IQ format): the CPU backend then also
    /// quantizes its activations that way ([`crate::quant::format::Activation::Q8K`]).
    pub q8k_activations: bool,
}

impl Weights {
    /// Every matrix product weight (attention, FFN, experts, shared experts, output).
    pub fn matrices(&self) -> Vec<&Weight> {
        let mut v = vec![&self.output];
        for b in &self.blocks {
            v.extend([&b.q, &b.k, &b.v, &b.o]);
            match &b.ffn {
                Ffn::Dense { gate, up, down } => v.extend([gate, up, down]),
                Ffn::Moe(ex) => {
                    v.extend([&ex.router, &ex.gate, &ex.up, &ex.down]);
                    if let Some(sh) = &ex.shared {
                        v.extend([&sh.gate, &sh.up, &sh.down]);
                    }
                }
            }
        }
        v
    }

    /// Locates every tensor of `cfg`'s architecture in `f` and checks its shape and format. Errors: a missing
    /// tensor ([`ModelError::Gguf`]), a format without kernels, a shape that disagrees with the metadata, a
    /// tensor the architecture does not have, widths that are not multiples of 32.
    pub fn load(f: &GgufFile, cfg: &ModelConfig) -> Result<Weights, ModelError> {
        let (e, kvd) = (cfg.n_embd as u64, (cfg.n_head_kv * cfg.head_dim) as u64);
        let qd = (cfg.n_head * cfg.head_dim) as u64;
        let nv = cfg.n_vocab as u64;
        let tok_embd = weight(f, tensor::TOKEN_EMBD, Some(&[e, nv]))?;
        let output = match f.tensor(tensor::OUTPUT) {
            Some(_) => weight(f, tensor::OUTPUT, Some(&[e, nv]))?,
            None => tok_embd.clone(),
        };
        let spec = cfg.spec;
        // grown as the layers are found (not sized from the metadata's block count)
        let mut blocks = Vec::new();
        for l in 0..cfg.n_layer {
            let n = |s: &str| tensor::weight(l, s);
            // the post-norms: required where the architecture has them, refused where it does not (unless the
            // architecture's FFN input norm goes by that name)
            let post = |name: &str| match (spec.def.post_norms, f.tensor(name)) {
                (true, _) => vector(f, name, cfg.n_embd).map(Some),
                (false, None) => Ok(None),
                (false, Some(_)) if name == n(spec.def.ffn_norm) => Ok(None),
                (false, Some(_)) => Err(ModelError::UnexpectedTensor {
                    tensor: name.to_string(),
                    arch: spec.def.name.to_string(),
                    why: "no post-attention or post-FFN norms".into(),
                }),
            };
            if spec.ffn != FfnKind::MoeShared {
                if let Some(t) = tensor::SHARED_EXPERT_ROLES.iter().map(|r| n(r)).find(|t| f.tensor(t).is_some()) {
                    return Err(ModelError::UnexpectedTensor {
                        tensor: t,
                        arch: cfg.arch.clone(),
                        why: format!("{} has no shared expert", cfg.arch),
                    });
                }
            }
            // MoE biases: required where the architecture has them, refused where it does not
            if !spec.def.moe_bias {
                if let Some(t) =
                    tensor::MOE_BIAS_ROLES.iter().map(|r| tensor::bias(l, r)).find(|t| f.tensor(t).is_some())
                {
                    return Err(ModelError::UnexpectedTensor {
                        tensor: t,
                        arch: cfg.arch.clone(),
                        why: format!("{} has no router or expert biases", cfg.arch),
                    });
                }
            }
            let ffn = if spec.is_moe() {
                let (ne, ff) = (cfg.n_expert as u64, cfg.n_ff_exp as u64);
                let shared = match spec.ffn {
                    FfnKind::MoeShared => {
                        let fs = cfg.n_ff_shexp as u64;
                        Some(SharedExpert {
                            gate_inp: vector(f, &n("ffn_gate_inp_shexp"), cfg.n_embd)?,
                            gate: weight(f, &n("ffn_gate_shexp"), Some(&[e, fs]))?,
                            up: weight(f, &n("ffn_up_shexp"), Some(&[e, fs]))?,
                            down: weight(f, &n("ffn_down_shexp"), Some(&[fs, e]))?,
                        })
                    }
                    _ => None,
                };
                Ffn::Moe(ExpertWeights {
                    router: weight(f, &n("ffn_gate_inp"), Some(&[e, ne]))?,
                    gate: weight(f, &n("ffn_gate_exps"), Some(&[e, ff, ne]))?,
                    up: weight(f, &n("ffn_up_exps"), Some(&[e, ff, ne]))?,
                    down: weight(f, &n("ffn_down_exps"), Some(&[ff, e, ne]))?,
                    shared,
                    router_bias: match spec.def.moe_bias {
                        true => Some(vector(f, &tensor::bias(l, "ffn_gate_inp"), cfg.n_expert)?),
                        false => None,
                    },
                    bias: match spec.def.moe_bias {
                        true => Some(ExpertBias {
                            gate: dense_f32(f, &tensor::bias(l, "ffn_gate_exps"), &[ff, ne])?,
                            up: dense_f32(f, &tensor::bias(l, "ffn_up_exps"), &[ff, ne])?,
                            down: dense_f32(f, &tensor::bias(l, "ffn_down_exps"), &[e, ne])?,
                        }),
                        false => None,
                    },
                })
            } else {
                let ff = cfg.n_ff as u64;
                Ffn::Dense {
                    gate: weight(f, &n("ffn_gate"), Some(&[e, ff]))?,
                    up: weight(f, &n("ffn_up"), Some(&[e, ff]))?,
                    down: weight(f, &n("ffn_down"), Some(&[ff, e]))?,
                }
            };
            let b = |s: &str| tensor::bias(l, s);
            let (q_norm, k_norm) = match spec.def.qk_norm {
                QkNorm::None => (None, None),
                QkNorm::PerHead => (
                    Some(vector(f, &n("attn_q_norm"), cfg.head_dim)?),
                    Some(vector(f, &n("attn_k_norm"), cfg.head_dim)?),
                ),
                QkNorm::Full => (
                    Some(vector(f, &n("attn_q_norm"), qd as usize)?),
                    Some(vector(f, &n("attn_k_norm"), kvd as usize)?),
                ),
            };
            blocks.push(Block {
                attn_norm: vector(f, &n("attn_norm"), cfg.n_embd)?,
                q: weight(f, &n("attn_q"), Some(&[e, qd]))?,
                k: weight(f, &n("attn_k"), Some(&[e, kvd]))?,
                v: weight(f, &n("attn_v"), Some(&[e, kvd]))?,
                o: weight(f, &n("attn_output"), Some(&[qd, e]))?,
                bias: AttnBias {
                    q: opt_vector(f, &b("attn_q"), qd as usize)?,
                    k: opt_vector(f, &b("attn_k"), kvd as usize)?,
                    v: opt_vector(f, &b("attn_v"), kvd as usize)?,
                    o: opt_vector(f, &b("attn_output"), cfg.n_embd)?,
                },
                q_norm,
                k_norm,
                ffn_norm: vector(f, &n(spec.def.ffn_norm), cfg.n_embd)?,
                attn_sinks: match (spec.def.attn_sinks, f.tensor(&n(tensor::ATTN_SINKS))) {
                    (true, _) => Some(vector(f, &n(tensor::ATTN_SINKS), cfg.n_head)?),
                    (false, None) => None,
                    (false, Some(_)) => {
                        return Err(ModelError::UnexpectedTensor {
                            tensor: n(tensor::ATTN_SINKS),
                            arch: cfg.arch.clone(),
                            why: format!("{} has no attention sinks", cfg.arch),
                        })
                    }
                },
                ffn,
                post_attn_norm: post(&n("post_attention_norm"))?,
                post_ffn_norm: post(&n("post_ffw_norm"))?,
            });
        }
        let out_norm = vector(f, tensor::OUTPUT_NORM, cfg.n_embd)?;
        if !cfg.n_embd.is_multiple_of(32)
            || !cfg.n_ff.is_multiple_of(32)
            || !cfg.n_ff_exp.is_multiple_of(32)
            || !cfg.n_ff_shexp.is_multiple_of(32)
            || !qd.is_multiple_of(32)
        {
            return Err(ModelError::BadHyperParameter("embedding and FFN widths must be multiples of 32".into()));
        }
        let mut w = Weights { tok_embd, blocks, out_norm, output, q8k_activations: false };
        w.q8k_activations = w.matrices().iter().any(|m| {
            crate::quant::format::lookup(m.ty).is_some_and(|f| f.activation == crate::quant::format::Activation::Q8K)
        });
        Ok(w)
    }
}

fn weight(f: &GgufFile, name: &str, cfg_check: Option<&[u64]>) -> Result<Weight, ModelError> {
    let t: &TensorInfo = f.require_tensor(name)?;
    if !t.ggml_type.is_supported() {
        return Err(ModelError::UnsupportedTensorType { tensor: name.to_string(), ty: t.ggml_type });
    }
    if let Some(exp) = cfg_check {
        if t.dims != exp {
            return Err(ModelError::BadShape {
                tensor: name.to_string(),
                found: t.dims.clone(),
                expected: exp.to_vec(),
            });
        }
    }
    Ok(Weight {
        name: name.to_string(),
        ty: t.ggml_type,
        offset: t.file_offset as usize,
        rows: t.n_rows(),
        cols: t.row_len(),
    })
}

/// A 1-D tensor of `n` values as f32 ([`dense_f32`]).
fn vector(f: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
    dense_f32(f, name, &[n as u64])
}

/// A small tensor of shape `dims` (GGML order) read whole into f32 values (row-major: `dims[0]` values a row).
fn dense_f32(f: &GgufFile, name: &str, dims: &[u64]) -> Result<Vec<f32>, ModelError> {
    let w = weight(f, name, Some(dims))?;
    let mut out = vec![0f32; w.rows * w.cols];
    let rb = w.ty.row_bytes(w.cols);
    let bytes = &f.bytes()[w.offset..w.offset + w.bytes()];
    for (r, o) in out.chunks_exact_mut(w.cols).enumerate() {
        dequantize_row(w.ty, &bytes[r * rb..(r + 1) * rb], o)?;
    }
    Ok(out)
}

/// [`vector`] when the tensor is in the file, `None` when it is not.
fn opt_vector(f: &GgufFile, name: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
    match f.tensor(name) {
        Some(_) => vector(f, name, n).map(Some),
        None => Ok(None),
    }
}
