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
