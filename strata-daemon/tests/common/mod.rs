//! Shared helpers of the library's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use strata::gguf::GgufFile;

/// The SmolLM2 model (`$STRATA_MODEL`, or `$STRATA_MODELS`/~/.cache/strata/models);
/// panics with the fetch command when missing.
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_MODEL") {
        return PathBuf::from(p);
    }
    let dir = std::env::var_os("STRATA_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/strata/models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} not found: run tools/fetch-model", p.display());
    p
}

/// Opens the model file.
pub fn model_file() -> Arc<GgufFile> {
    Arc::new(GgufFile::open(model_path()).expect("open model"))
}

/// `tests/data` of the repository.
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data")
}

/// Reads a JSON test-data file.
pub fn json(name: &str) -> serde_json::Value {
    let p = data_dir().join(name);
    serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// Log-softmax of `logits` at `idx`, and the log-sum-exp (f64).
pub fn log_softmax_at(logits: &[f32], idx: &[usize]) -> (Vec<f64>, f64) {
    let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = mx + logits.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
    (idx.iter().map(|&i| logits[i] as f64 - lse).collect(), lse)
}

/// Mean KL(oracle || strata) and argmax agreement of `all` (our logits for
/// every position) against one list of oracle positions.
pub fn compare(all: &[f32], nv: usize, positions: &[serde_json::Value]) -> (f64, usize, Vec<f64>) {
    let mut kls = Vec::new();
    let mut agree = 0;
    for (i, pos) in positions.iter().enumerate() {
        let ours = &all[i * nv..(i + 1) * nv];
        let top: Vec<(usize, f64)> = pos["top"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap()))
            .collect();
        let lse = pos["lse"].as_f64().unwrap();
        let idx: Vec<usize> = top.iter().map(|t| t.0).collect();
        let (lq, _) = log_softmax_at(ours, &idx);
        // KL(p || q) over the oracle's top-k, plus the rest of the mass as one bucket.
        let mut kl = 0f64;
        let (mut pm, mut qm) = (0f64, 0f64);
        for (j, &(_, l)) in top.iter().enumerate() {
            let lp = l - lse;
            kl += lp.exp() * (lp - lq[j]);
            pm += lp.exp();
            qm += lq[j].exp();
        }
        let (pr, qr) = ((1.0 - pm).max(1e-12), (1.0 - qm).max(1e-12));
        kl += pr * (pr / qr).ln();
        kls.push(kl);
        if strata::engine::sampler::argmax(ours) as usize == top[0].0 {
            agree += 1;
        }
    }
    (kls.iter().sum::<f64>(), agree, kls)
}

/// The MoE fixture `smollm2-moe-{kind}.gguf` next to the SmolLM2 model (tools/fetch-model builds it); panics
/// with the command when missing.
pub fn fixture_path(kind: &str) -> PathBuf {
    let p = model_path().with_file_name(format!("smollm2-moe-{kind}.gguf"));
    assert!(p.exists(), "{} not found: run tools/fetch-model --model smollm2-moe-{kind}", p.display());
    p
}
