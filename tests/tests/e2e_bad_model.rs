//! The daemon refuses bad model files with one clear error and no panic.

use strata::gguf::writer::{string_array, GgufWriter};
use strata::gguf::Value;
use strata::quant::GgmlType;
use strata_tests::*;

fn refuse(model: &std::path::Path, needle: &str) {
    let sock = temp_path(".sock");
    let o = run_daemon(&["--model", model.to_str().unwrap(), "--socket", sock.to_str().unwrap()]);
    let e = stderr(&o);
    assert!(!o.status.success(), "daemon must refuse {}", model.display());
    assert!(!e.contains("panicked"), "panic instead of an error: {e}");
    assert!(e.contains(needle), "expected {needle:?} in: {e}");
    assert!(!sock.exists());
}

fn tiny(arch: &str, ty: GgmlType) -> GgufWriter {
    let mut w = GgufWriter::default();
    w.set("general.architecture", Value::String(arch.into()));
    w.set(&format!("{arch}.block_count"), Value::U32(1));
    w.set(&format!("{arch}.embedding_length"), Value::U32(256));
    w.set(&format!("{arch}.feed_forward_length"), Value::U32(256));
    w.set(&format!("{arch}.attention.head_count"), Value::U32(4));
    w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.set("tokenizer.ggml.tokens", string_array(["a", "b"]));
    w.set("tokenizer.ggml.merges", string_array(["a b"]));
    w.add_tensor("token_embd.weight", vec![256, 2], ty, vec![0u8; ty.row_bytes(256) * 2]);
    w
}

#[test]
fn missing_truncated_garbage_unknown_arch_unsupported_type() {
    refuse(std::path::Path::new("/nonexistent/model.gguf"), "No such file");

    let real = std::fs::read(model_path()).unwrap();
    let t = temp_path(".gguf");
    std::fs::write(&t, &real[..1 << 20]).unwrap();
    refuse(&t, "truncated");
    std::fs::write(&t, &real[..1000]).unwrap();
    refuse(&t, "truncated");

    let mut x = 0x1234_5678u32;
    let garbage: Vec<u8> = (0..100_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    std::fs::write(&t, &garbage).unwrap();
    refuse(&t, "not a GGUF file");

    std::fs::write(&t, tiny("mamba", GgmlType::F32).to_bytes()).unwrap();
    refuse(&t, "unsupported architecture \"mamba\"");

    std::fs::write(&t, tiny("llama", GgmlType::IQ2_XS).to_bytes()).unwrap();
    refuse(&t, "unsupported tensor type IQ2_XS");

    std::fs::remove_file(&t).unwrap();
}
