//! The MoE path reproduces the dense model: SmolLM2 turned into an MoE whose
//! experts are all copies of the dense FFN (model::moe_copy) gives the same
//! logits as the dense file (max abs difference ≤ 1e-3), while the router
//! really picks different experts for different tokens.
//!
//! The comparison runs with exact f32 activations (`Precision::F32`): with
//! llama.cpp-style 8-bit activations, Σ w_k · y = y only up to one f32 ulp
//! (w₁ + w₂ = 1 ± ε), and a one-ulp change that crosses an 8-bit rounding
//! boundary is amplified chaotically through 30 layers, so two mathematically
//! equal models differ by up to ~1 logit there. A second check uses the fast
//! path with a router whose weights are exactly 1/k, where the sum is exact.

mod common;

use std::sync::Arc;

use common::*;
use strata::arch::weights::Ffn;
use strata::backend::cpu::Precision;
use strata::gguf::GgufFile;
use strata::model::forward::Scratch;
use strata::model::{Logits, Model};

#[test]
fn moe_copy_matches_dense_logits() {
    let dense_file = model_file();
    let moe_bytes = strata::model::moe_copy::moe_copy(&dense_file, 4, 2, 7).unwrap().to_bytes();
    let path = std::env::temp_dir().join(format!("strata-moe-copy-{}.gguf", std::process::id()));
    std::fs::write(&path, &moe_bytes).unwrap();
    drop(moe_bytes);
    let moe = Model::load(Arc::new(GgufFile::open(&path).unwrap())).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!((moe.cfg.n_expert, moe.cfg.n_expert_used), (4, 2));
    assert!(matches!(moe.weights.blocks[0].ffn, Ffn::Moe(_)));
    let mut moe = moe;
    moe.precision = Precision::F32;
    let mut dense = Model::load(dense_file.clone()).unwrap();
    dense.precision = Precision::F32;
    let ids: Vec<u32> = json("parity_logits.json")["prompts"][0]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .take(40)
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let nv = dense.cfg.n_vocab;
    let (a, b) = {
        let run = |m: &Model| {
            let mut kv = m.new_kv(128);
            let mut s = Scratch::default();
            // a prefill chunk, then single-token decode windows
            let mut out = m.forward(&ids[..32], &mut kv, Logits::All, &mut s);
            for &t in &ids[32..] {
                out.extend(m.forward(&[t], &mut kv, Logits::All, &mut s));
            }
            out
        };
        (run(&dense), run(&moe))
    };
    assert_eq!(a.len(), ids.len() * nv);
    let max_diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    println!("max |dense - moe| over {} logits: {max_diff:.2e}", a.len());
    assert!(max_diff <= 1e-3, "max abs difference {max_diff}");

    // Fast path: a zero router gives every expert the same probability, top-2 takes
    // experts 0 and 1 with weights exactly 0.5, and y*0.5 + y*0.5 == y in f32.
    let mut w = strata::model::moe_copy::moe_copy(&dense_file, 4, 2, 7).unwrap();
    for t in w.tensors.iter_mut().filter(|t| t.name.ends_with("ffn_gate_inp.weight")) {
        t.data.iter_mut().for_each(|b| *b = 0);
    }
    std::fs::write(&path, w.to_bytes()).unwrap();
    drop(w);
    let moe0 = Model::load(Arc::new(GgufFile::open(&path).unwrap())).unwrap();
    std::fs::remove_file(&path).unwrap();
    dense.precision = Precision::Q8Activations;
    let (a, b) = {
        let run = |m: &Model| {
            let mut kv = m.new_kv(128);
            m.forward(&ids, &mut kv, Logits::All, &mut Scratch::default())
        };
        (run(&dense), run(&moe0))
    };
    let max_diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    println!("fast path, uniform router: max |dense - moe| {max_diff:.2e}");
    assert!(max_diff <= 1e-3, "fast path max abs difference {max_diff}");

    // The router is not degenerate: tokens pick different expert sets.
    let routes = {
        let mut rl = vec![0f32; 3 * 4];
        for (i, lg) in rl.chunks_mut(4).enumerate() {
            lg.copy_from_slice(&[i as f32, 0.5, -(i as f32), 0.1]);
        }
        strata::backend::moe::router::top_k(&moe.cfg, &rl, 3)
    };
    assert_ne!(routes[0].iter().map(|r| r.0).collect::<Vec<_>>(), routes[2].iter().map(|r| r.0).collect::<Vec<_>>());
    for r in &routes {
        let s: f32 = r.iter().map(|x| x.1).sum();
        assert!((s - 1.0).abs() < 1e-6, "weights renormalised: {r:?}");
    }
}
