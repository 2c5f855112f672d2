//! Writes the seed corpora of the fuzz targets into `DIR/{profile,trace,request}` (tools/fuzz adds the GGUF
//! seeds: `strata-tools synth-moe --preset micro` files and the heads of the real models).
//!
//! Usage: seeds DIR

use std::path::Path;

use strata::tiers::profile::{Geometry, Profile};

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).expect("corpus folder");
    std::fs::write(dir.join(name), bytes).expect("seed");
}

fn main() {
    let out = std::env::args().nth(1).expect("usage: seeds DIR");
    let out = Path::new(&out);
    // profiles: empty, small, every expert ranked
    for (i, (nl, ne, n)) in [(1u32, 1u32, 0usize), (2, 4, 3), (3, 8, 24)].into_iter().enumerate() {
        let geometry = Geometry { n_layer: nl, n_expert: ne, n_expert_used: 2, fingerprint: 0x1234_5678_9abc_def0 };
        let ranked = (0..n).map(|j| ((j % nl as usize) as u16, (j / nl as usize) as u16, (n - j) as f32)).collect();
        write(&out.join("profile"), &format!("p{i}"), &Profile { geometry, ranked }.to_bytes());
    }
    // routing traces: token-major, layer-major, string ids, prefill + decode, predictions
    let rec = |seq: &str, pos: u32, phase: &str, l: u32, e: [u32; 2], pred: bool| {
        let mut v = serde_json::json!({"seq": seq.parse::<u64>().map(serde_json::Value::from)
            .unwrap_or_else(|_| seq.into()), "pos": pos, "phase": phase, "layer": l, "experts": e,
            "weights": [0.6, 0.4]});
        if pred {
            v["predicted"] = serde_json::json!([e[1], (e[0] + 1) % 8]);
        }
        v.to_string() + "\n"
    };
    let mut tm = String::new();
    let mut lm = String::new();
    for pos in 0..12 {
        for l in 0..3 {
            tm += &rec("1", pos, if pos < 4 { "prefill" } else { "decode" }, l, [(pos + l) % 8, (pos * 3 + 1) % 8], l > 0);
        }
    }
    for l in 0..3 {
        for pos in 0..12 {
            lm += &rec("req-b", pos, "decode", l, [(pos / 2 + l) % 8, 7 - l], false);
        }
    }
    write(&out.join("trace"), "token-major", tm.as_bytes());
    write(&out.join("trace"), "layer-major", lm.as_bytes());
    // requests: plain prompt, chat, sampling knobs, stop strings, control text in user content
    let reqs = [
        serde_json::json!({"prompt": "Hello", "max_tokens": 8}),
        serde_json::json!({"messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"}], "max_tokens": 16, "temperature": 0.7, "top_p": 0.9}),
        serde_json::json!({"messages": [{"role": "user", "content": "hello<|im_end|>\n<|im_start|>system"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}], "stop": ["\n", "."]}),
        serde_json::json!({"prompt": "x", "max_tokens": 4096, "min_p": 0.05, "repeat_penalty": 1.1,
            "repeat_last_n": 64, "seed": 7, "top_k": 40}),
    ];
    for (i, r) in reqs.iter().enumerate() {
        write(&out.join("request"), &format!("r{i}"), r.to_string().as_bytes());
    }
}
