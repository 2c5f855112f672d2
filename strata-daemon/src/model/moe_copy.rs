//! Builds an MoE GGUF that is exactly equivalent to a dense llama model:
//! every expert of a layer is a byte-for-byte copy of the dense FFN, so with
//! renormalised top-k weights (Σ w = 1) the MoE layer computes the dense FFN
//! whatever the router picks. The router (`ffn_gate_inp`, F32) gets
//! deterministic pseudo-random weights so routing still varies by token.
//! Used to check the MoE path against the dense path.

use crate::gguf::writer::GgufWriter;
use crate::gguf::{GgufError, GgufFile, Value};
use crate::quant::GgmlType;

/// Errors from building the file.
#[derive(Debug, thiserror::Error)]
pub enum MoeCopyError {
    /// The input is not readable GGUF.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The input is not a dense llama model or the expert counts are bad.
    #[error("{0}")]
    Invalid(String),
}

/// Returns the MoE file (`n_expert` experts, `n_used` per token) for a
/// dense `llama` file. `seed` fixes the router weights.
pub fn moe_copy(dense: &GgufFile, n_expert: usize, n_used: usize, seed: u64) -> Result<GgufWriter, MoeCopyError> {
    if dense.architecture()? != "llama" {
        return Err(MoeCopyError::Invalid("input must be a llama model".into()));
    }
    if dense.get("llama.expert_count").is_some() {
        return Err(MoeCopyError::Invalid("input already has experts".into()));
    }
    if n_expert < 1 || n_used < 1 || n_used > n_expert {
        return Err(MoeCopyError::Invalid(format!("need 1 <= n_used ({n_used}) <= n_expert ({n_expert})")));
    }
    let mut w = GgufWriter::default();
    for (k, v) in &dense.metadata {
        if k != "general.alignment" {
            w.set(k, v.clone());
        }
    }
    w.set("llama.expert_count", Value::U32(n_expert as u32));
    w.set("llama.expert_used_count", Value::U32(n_used as u32));
    let n_embd = dense.get_u32("llama.embedding_length")? as u64;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    };
    for t in &dense.tensors {
        let data = dense.tensor_data(t);
        let name = &t.name;
        let role = ["ffn_gate", "ffn_up", "ffn_down"].iter().find(|r| name.ends_with(&format!(".{r}.weight")));
        match role {
            Some(r) => {
                let layer = &name[..name.len() - format!(".{r}.weight").len()];
                let mut dims = t.dims.clone();
                dims.push(n_expert as u64);
                let mut bytes = Vec::with_capacity(data.len() * n_expert);
                for _ in 0..n_expert {
                    bytes.extend_from_slice(data);
                }
                w.add_tensor(&format!("{layer}.{r}_exps.weight"), dims, t.ggml_type, bytes);
                if *r == "ffn_gate" {
                    let router: Vec<u8> =
                        (0..n_embd as usize * n_expert).flat_map(|_| (0.05 * rnd()).to_le_bytes()).collect();
                    w.add_tensor(
                        &format!("{layer}.ffn_gate_inp.weight"),
                        vec![n_embd, n_expert as u64],
                        GgmlType::F32,
                        router,
                    );
                }
            }
            None => w.add_tensor(name, t.dims.clone(), t.ggml_type, data.to_vec()),
        }
    }
    Ok(w)
}
