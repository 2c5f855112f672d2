//! Greedy completion of a prompt with timing: `cargo run --release --example greedy -- MODEL "PROMPT" [N]`.
use std::sync::Arc;
use std::time::Instant;
use strata::gguf::GgufFile;
use strata::model::{forward::Scratch, Logits, Model, Tokenizer};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let f = Arc::new(GgufFile::open(&args[1])?);
    let tok = Tokenizer::from_gguf(&f)?;
    let m = Model::load(f)?;
    let n: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(32);
    let ids = tok.encode(&args[2], true, true)?;
    println!("prompt ids {:?}", ids);
    {
        let mut kv = m.new_kv(2048);
        let mut s = Scratch::default();
        let t0 = Instant::now();
        let lg = m.forward(&ids, &mut kv, Logits::Last, &mut s);
        let pt = t0.elapsed();
        let mut next = argmax(&lg);
        let mut out = vec![next];
        let t1 = Instant::now();
        for _ in 1..n {
            let lg = m.forward(&[next], &mut kv, Logits::Last, &mut s);
            next = argmax(&lg);
            out.push(next);
        }
        let dt = t1.elapsed();
        println!("{:?}\n{}", out, tok.decode(&out, true));
        println!(
            "prompt {} tok in {:?} ({:.1} tok/s); decode {} tok in {:?} ({:.1} tok/s)",
            ids.len(),
            pt,
            ids.len() as f64 / pt.as_secs_f64(),
            n - 1,
            dt,
            (n - 1) as f64 / dt.as_secs_f64()
        );
    };
    Ok(())
}
fn argmax(v: &[f32]) -> u32 {
    let mut b = 0;
    for i in 0..v.len() {
        if v[i] > v[b] {
            b = i;
        }
    }
    b as u32
}
