//! Diagnostic: per-position KL against tests/data/parity_logits.json.
use std::sync::Arc;
use strata::gguf::GgufFile;
use strata::model::{forward::Scratch, Logits, Model};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let d: serde_json::Value =
        serde_json::from_slice(&std::fs::read("tests/data/parity_logits.json").unwrap()).unwrap();
    let mut m = Model::load(Arc::new(GgufFile::open(&args[1]).unwrap())).unwrap();
    if std::env::var("KL_F32").is_ok() {
        m.precision = strata::backend::cpu::Precision::F32;
    }
    let chunk: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(512);
    let nv = m.cfg.n_vocab;
    for p in d["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = p["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let mut kv = m.new_kv(512);
        let mut s = Scratch::default();
        let mut all = Vec::new();
        for ch in ids.chunks(chunk) {
            all.extend(m.forward(ch, &mut kv, Logits::All, &mut s));
        }
        if let Ok(path) = std::env::var("KL_DUMP") {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
            for v in &all {
                f.write_all(&v.to_le_bytes()).unwrap();
            }
        }
        let mut line = String::new();
        let mut tot = 0.0;
        for (i, pos) in p["positions"].as_array().unwrap().iter().enumerate() {
            let ours = &all[i * nv..(i + 1) * nv];
            let mx = ours.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse_q = mx + ours.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
            let lse = pos["lse"].as_f64().unwrap();
            let mut kl = 0.0;
            let mut maxd: f64 = 0.0;
            for e in pos["top"].as_array().unwrap() {
                let (id, l) = (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap());
                let lp = l - lse;
                let lq = ours[id] as f64 - lse_q;
                kl += lp.exp() * (lp - lq);
                maxd = maxd.max((l - ours[id] as f64).abs());
            }
            tot += kl;
            if i < 12 || i % 10 == 0 {
                line += &format!("{i}:{:.1e}/{:.2} ", kl, maxd);
            }
        }
        println!("mean {:.2e} | {}", tot / ids.len() as f64, line);
    }
}
