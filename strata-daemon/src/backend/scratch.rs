//! Host scratch of forward passes, reused across calls, and the pass's flags that the engine sets (a decode
//! window or not, routing capture).

use super::cpu::Act;

/// Scratch buffers of forward passes (the CPU's activations and products, the routing, the CPU experts' work
/// areas), reused across calls so a pass allocates nothing once warm, plus two settings of the caller's.
#[derive(Default)]
pub struct Scratch {
    /// Residual stream (`t × n_embd`).
    pub(crate) x: Vec<f32>,
    /// Normalized input of the next products and its 8-bit quantization (`t × n_embd`).
    pub(crate) xn: Act,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) attn: Act,
    pub(crate) tmp: Vec<f32>,
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) h: Act,
    /// RoPE (cos, sin) pairs of the pass (`t × n_rot/2`).
    pub(crate) rope: Vec<(f32, f32)>,
    /// The same for the sliding-window layers (their own base; empty without them).
    pub(crate) rope_swa: Vec<(f32, f32)>,
    /// Router logits (`t × n_expert`).
    pub(crate) router: Vec<f32>,
    /// The routing of the current MoE layer: per token, `(expert, weight)` by rank.
    pub(crate) routing: Vec<Vec<(usize, f32)>>,
    /// The shared expert's output of the current layer (`t × n_embd`).
    pub(crate) sh: Vec<f32>,
    /// The shared expert's gate per token; empty when the current layer computed none.
    pub(crate) sh_gate: Vec<f32>,
    /// The routed experts' weighted sum (`t × n_embd`).
    pub(crate) moe_acc: Vec<f32>,
    /// Per expert of a layer's batch: its tokens' activations.
    pub(crate) subs: Vec<Act>,
    /// Per expert of a layer's batch: its SwiGLU output (`tokens × rows`, quantized).
    pub(crate) hs: Vec<Act>,
    /// Blobs of one layer's file-tier experts, back to back.
    pub(crate) blobs: Vec<u8>,
    /// When `Some`, every routing decision of the forward passes is appended
    /// here (the caller drains it, e.g. for `--dump-routing`).
    pub routes: Option<Vec<RouteRecord>>,
    /// The next-layer prediction waiting for its layer: `(layer, experts per token by rank)`.
    pub(crate) predicted: Option<(usize, Vec<Vec<usize>>)>,
    /// Hidden state normalised for a prediction (`t × n_embd`).
    pub(crate) xp: Act,
    /// The pass is a decode window: expert lookups count in the tier counters and usage.
    pub decode: bool,
}

impl Scratch {
    /// Appends the routing of a chunk whose first token is at `pos0` to [`Scratch::routes`] (when recording).
    /// A prediction made for `layer` ([`Scratch::predict_next`]) is attached to the records of that layer.
    pub fn record_routes(&mut self, layer: usize, pos0: usize, routes: &[Vec<(usize, f32)>]) {
        let predicted = match self.predicted.take() {
            Some((l, p)) if l == layer && p.len() == routes.len() => Some(p),
            _ => None,
        };
        if let Some(rec) = self.routes.as_mut() {
            for (i, r) in routes.iter().enumerate() {
                let predicted = predicted.as_ref().map(|p| p[i].clone());
                rec.push(RouteRecord { pos: pos0 + i, layer, experts: r.clone(), predicted });
            }
        }
    }

    /// Keeps the experts predicted for `layer`, per token of the chunk, until that layer's routing is recorded.
    pub fn predict_next(&mut self, layer: usize, per_token: Vec<Vec<usize>>) {
        self.predicted = Some((layer, per_token));
    }
}

/// One routing decision: token position, layer, and the selected experts
/// with their renormalised weights in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRecord {
    /// Token position in the sequence (KV cache index).
    pub pos: usize,
    /// Layer index.
    pub layer: usize,
    /// `(expert, weight)` by rank (the weights sum to 1 when the architecture renormalises the top-k).
    pub experts: Vec<(usize, f32)>,
    /// Experts predicted for this layer before it ran (its router applied to the hidden state the previous
    /// layer's attention left, normalised with this layer's `ffn_norm`), by rank; `None` when no prediction was
    /// made (the first MoE layer, a backend that does not predict).
    pub predicted: Option<Vec<usize>>,
}
