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

    // Q8_1 is ggml's activation format: a valid type id, no weight kernel
    std::fs::write(&t, tiny("llama", GgmlType::Q8_1).to_bytes()).unwrap();
    refuse(&t, "unsupported tensor type Q8_1");

    // a block count far above the file's tensors (a fuzzing finding: it sized the layer table, an abort)
    let mut w = tiny("llama", GgmlType::F32);
    w.set("llama.block_count", Value::U32(u32::MAX));
    std::fs::write(&t, w.to_bytes()).unwrap();
    refuse(&t, "block_count 4294967295 but the file holds 1 tensors");

    std::fs::remove_file(&t).unwrap();
}

#[test]
fn bad_layer_split_flags_are_refused_at_start() {
    // SmolLM2 has 30 layers: split points are layers 1..29, strictly increasing, one device per stage named
    let model = model_path();
    let m = model.to_str().unwrap();
    for (args, needle) in [
        (&["--layer-split", "30"][..], "a split point must be a layer in 1..29"),
        (&["--layer-split", "0"], "a split point must be a layer in 1..29"),
        (&["--layer-split", "20,10"], "must be strictly increasing"),
        (&["--layer-split", "10,10"], "must be strictly increasing"),
        (
            &["--layer-split", "10", "--split-device", "0"],
            "2 stages need 2 devices but --split-device names (or the driver sees) 1",
        ),
        (&["--layer-split", "10", "--split-device", "0,0,0"], "--split-device names 3 devices for 2 stages"),
        (&["--layer-split", "ten"], "`ten` is not a layer number"),
    ] {
        let sock = temp_path(".sock");
        let mut all = vec!["--model", m, "--socket", sock.to_str().unwrap()];
        all.extend_from_slice(args);
        let o = run_daemon(&all);
        let e = stderr(&o);
        assert!(!o.status.success(), "daemon must refuse {args:?}");
        assert!(!e.contains("panicked"), "panic instead of an error: {e}");
        assert!(e.contains(needle), "{args:?}: expected {needle:?} in: {e}");
        assert!(!sock.exists());
    }
}

/// With `RUST_BACKTRACE=1` (as many shells set it) a refused start is still one line on stderr: no backtrace, the
/// causes joined on that line.
#[test]
fn errors_stay_one_line_with_rust_backtrace() {
    let sock = temp_path(".sock");
    let missing = temp_path(".gguf");
    let o = std::process::Command::new(bin("strata-daemon"))
        .args(["--model", missing.to_str().unwrap(), "--socket", sock.to_str().unwrap()])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(!o.status.success());
    let lines: Vec<&str> = e.lines().filter(|l| l.starts_with("strata-daemon: ")).collect();
    assert_eq!(lines.len(), 1, "one error line: {e}");
    assert!(lines[0].contains(missing.file_name().unwrap().to_str().unwrap()), "names the file: {e}");
    assert_eq!(lines[0].matches("os error 2").count(), 1, "the cause once: {e}");
    assert!(!e.contains("Stack backtrace") && !e.contains("Caused by"), "{e}");
}
