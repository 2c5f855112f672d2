//! The GGUF reader and what reads its metadata at load (hyper-parameters, weights, tokenizer): any bytes as a
//! model file must give a model or an error, never a panic, a hang or an allocation beyond the input's size class.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::arch::config::ModelConfig;
use strata::arch::weights::Weights;
use strata::gguf::GgufFile;
use strata::model::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    // the reader's checks are the same for a mapped file and bytes in memory (GgufFile::from_bytes)
    if let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) {
        if let Ok(cfg) = ModelConfig::from_gguf(&f) {
            let _ = Weights::load(&f, &cfg);
        }
        // building a tokenizer compiles its pre-tokenizer's regular expressions (~1 ms): a quarter of the inputs
        // (by length, so the same input always takes the same path) keep the rate near the reader's own
        if data.len() % 4 == 0 {
            let _ = Tokenizer::from_gguf(&f);
        }
    }
});
