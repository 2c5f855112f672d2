//! Router: expert probabilities from router logits, top-k, renormalisation, the expert weight scale.

use crate::arch::config::ModelConfig;
use crate::arch::Gating;

/// Each token's routed experts: per token of `router_logits` (`t × n_expert` values), `n_expert_used` pairs
/// `(expert, weight)` in rank order. Probabilities are the softmax (or the element-wise sigmoid) of the logits,
/// as the architecture says; ties rank the lower expert id first; the top-k weights are divided by their sum
/// (clamped at 2^-14, as llama.cpp does) when the architecture renormalises, then multiplied by its expert
/// weight scale. Panics when `router_logits` holds fewer than `t × n_expert` values.
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
            };
            p.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0)));
            p.truncate(k);
            if def.norm_topk {
                let s: f32 = p.iter().map(|x| x.1).sum::<f32>().max(6.103515625e-5);
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
