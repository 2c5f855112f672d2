//! SentencePiece tokenizer parity with llama.cpp on a real SPM vocabulary:
//! Gemma 3 270M's (`tokenizer.ggml.model = "llama"`, 262144 tokens, byte
//! fallback, user-defined whitespace runs, no space prefix). The cases in
//! tests/data/tokenizer_cases_gemma3.json were recorded by
//! `tools/make-reference --only tokenizer-spm`. Only the vocabulary is used
//! here; the gemma3 architecture itself is checked in tests/architectures.rs.

mod common;

use std::path::PathBuf;

use common::json;
use strata::gguf::GgufFile;
use strata::model::tokenizer::VocabKind;
use strata::model::Tokenizer;

const GEMMA_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// `$STRATA_MODELS/gemma-3-270m-q4_k_m.gguf` (default folder
/// ~/.cache/strata/models); panics with the fetch command when missing.
fn gemma_path() -> PathBuf {
    let dir = std::env::var_os("STRATA_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/strata/models"));
    let p = dir.join(GEMMA_FILE);
    assert!(p.exists(), "{} not found: run tools/fetch-model --model gemma3-270m", p.display());
    p
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn spm_tokenization_matches_llama_cpp() {
    let d = json("tokenizer_cases_gemma3.json");
    let file = GgufFile::open(gemma_path()).expect("open Gemma GGUF");
    let tok = Tokenizer::from_gguf(&file).unwrap();
    assert_eq!(tok.kind(), VocabKind::SentencePiece);
    assert_eq!(tok.n_vocab(), 262144);
    assert!(!d["add_bos"].as_bool().unwrap());
    let cases = d["cases"].as_array().unwrap();
    assert!(cases.len() >= 40, "only {} cases", cases.len());
    let mut bad = Vec::new();
    let mut n_decoded = 0;
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let special = c["parse_special"].as_bool().unwrap();
        let want = ids_of(&c["ids"]);
        let got = tok.encode(text, special, false).unwrap();
        if got != want {
            let show =
                |ids: &[u32]| ids.iter().map(|&i| format!("{i}:{:?}", tok.token_str(i))).collect::<Vec<_>>().join(" ");
            bad.push(format!(
                "encode {text:?} (special {special}):\n    strata    {}\n    llama.cpp {}",
                show(&got),
                show(&want)
            ));
        }
        // Detokenizing llama.cpp's ids (special tokens rendered) gives back the
        // text wherever llama.cpp's own detokenization does.
        if c["detok_special"].as_str().unwrap() == text {
            n_decoded += 1;
            let back = tok.decode(&want, true);
            if back != text {
                bad.push(format!("decode {text:?}: strata {back:?}"));
            }
        }
    }
    assert!(n_decoded >= 40, "only {n_decoded} round-trip cases");
    assert!(bad.is_empty(), "{} mismatches over {} cases:\n{}", bad.len(), cases.len(), bad.join("\n"));
}
