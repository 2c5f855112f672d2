//! Router: expert probabilities from router logits, top-k, renormalisation, the expert weight scale.

use crate::arch::config::ModelConfig;
use crate::arch::Gating;

/// Each token's routed experts: per token of `router_logits` (`t × n_expert` values, router biases already added),
/// `n_expert_used` pairs `(expert, weight)` in rank order. Probabilities are the softmax (or the element-wise sigmoid)
/// of the logits, as the architecture says, or (`SoftmaxTopK`) the top-k is taken on the logits and its weights are the
/// softmax of the chosen ones; ties rank the lower expert id first; the top-k weights are divided by their sum (clamped
/// at 2^-14, as llama.cpp does) when the architecture renormalises, then multiplied by its expert weight scale. Panics
/// when `router_logits` holds fewer than `t × n_expert` values.
pub fn top_k(cfg: &ModelConfig, router_logits: &[f32], t: usize) -> Vec<Vec<(usize, f32)>> {
    let ne = cfg.n_expert;
    let k = cfg.n_expert_used;
    let def = cfg.spec.def;
    (0..t)
        .map(|i| {
            let lg = &router_logits[i * ne..(i + 1) * ne];
            let mut p: Vec<(usize, f32)> = match def.gating {
                Gating::Softmax => {
                    let mx = lg.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let mut p: Vec<(usize, f32)> = lg.iter().enumerate().map(|(j, &v)| (j, (v - mx).exp())).collect();
                    let sum: f32 = p.iter().map(|x| x.1).sum();
                    for x in p.iter_mut() {
                        x.1 /= sum;
                    }
                    p
                }
                Gating::Sigmoid => lg.iter().enumerate().map(|(j, &v)| (j, sigmoid(v))).collect(),
                Gating::SoftmaxTopK => lg.iter().copied().enumerate().collect(),
            };
            p.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0)));
            p.truncate(k);
            if def.gating == Gating::SoftmaxTopK {
                // ggml_soft_max over the chosen logits: the largest first (rank order), the sum in f64
                let mx = p[0].1;
                let mut sum = 0f64;
                for x in p.iter_mut() {
                    x.1 = (x.1 - mx).exp();
                    sum += x.1 as f64;
                }
                let inv = (1.0 / sum) as f32;
                for x in p.iter_mut() {
                    x.1 *= inv;
                }
            }
            if def.norm_topk {
                // llama.cpp's clamp of the weight sum: 2^-14 (6.103515625e-5)
                let s: f32 = p.iter().map(|x| x.1).sum::<f32>().max(1.0 / 16384.0);
                for x in p.iter_mut() {
                    x.1 /= s;
                }
            }
            if def.expert_weights_scale != 1.0 {
                for x in p.iter_mut() {
                    x.1 *= def.expert_weights_scale;
                }
            }
            p
        })
        .collect()
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{ArchSpec, FfnKind};

    fn cfg(def: &'static crate::arch::ArchDef, n_expert: usize, k: usize) -> ModelConfig {
        ModelConfig {
            arch: def.name.into(),
            spec: ArchSpec { def, ffn: FfnKind::Moe },
            name: String::new(),
            n_layer: 1,
            n_embd: 32,
            n_ff: 32,
            n_head: 1,
            n_head_kv: 1,
            head_dim: 32,
            n_rot: 32,
            rope_freq_base: 1e4,
            rope_freq_scale: 1.0,
            rope_yarn: None,
            rms_eps: 1e-6,
            n_ctx_train: 64,
            n_vocab: 8,
            n_expert,
            n_expert_used: k,
            n_ff_exp: 32,
            n_ff_shexp: 0,
            sliding_window: 0,
            attn_scale: 1.0,
            rope_freq_base_swa: 1e4,
            rope_freq_scale_swa: 1.0,
        }
    }

    /// gpt-oss: the top-k of the raw logits, weighted by the softmax of the chosen logits alone; Qwen3-MoE: the
    /// softmax over all experts, renormalised over the top-k — the same weights for these logits, by another route.
    #[test]
    fn softmax_over_the_top_k_weights_the_chosen_logits() {
        let logits = [1.0f32, 3.0, 2.0, 0.0, 2.5, -1.0, 1.0, 3.0];
        let r = top_k(&cfg(&crate::arch::gpt_oss::GPT_OSS, 8, 3), &logits, 1);
        let ids: Vec<usize> = r[0].iter().map(|x| x.0).collect();
        assert_eq!(ids, [1, 7, 4]); // ties rank the lower id first
        let z = 2.0 * 3f64.exp() + 2.5f64.exp();
        for (&(_, w), want) in r[0].iter().zip([3f64.exp() / z, 3f64.exp() / z, 2.5f64.exp() / z]) {
            assert!((w as f64 - want).abs() < 1e-6, "{w} vs {want}");
        }
        let q = top_k(&cfg(&crate::arch::qwen3::QWEN3MOE, 8, 3), &logits, 1);
        for (a, b) in r[0].iter().zip(&q[0]) {
            assert_eq!(a.0, b.0);
            assert!((a.1 - b.1).abs() < 1e-6);
        }
    }
}
