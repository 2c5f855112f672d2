//! Parity with independent oracles, from reference numbers stored in
//! tests/data (recorded by tools/make-reference; see docs/REFERENCE-DATA.md):
//! the `gguf` Python package for dequantization, llama.cpp (llama-cpp-python)
//! for tokenization and logits.

mod common;

use common::*;
use strata::backend::KvType;
use strata::model::forward::Scratch;
use strata::model::{Logits, Model, Tokenizer};
use strata::quant::{dequantize_row, GgmlType};

/// A dequantization case's format, encoded bytes and expected values (checking the type name and the count the
/// manifest gives).
fn read_case(dir: &std::path::Path, c: &serde_json::Value) -> (GgmlType, Vec<u8>, Vec<f32>) {
    let ty = GgmlType::from_u32(c["ggml_type_id"].as_u64().unwrap() as u32).unwrap();
    assert_eq!(format!("{ty:?}"), c["ggml_type"].as_str().unwrap());
    let bytes = std::fs::read(dir.join(c["bytes_file"].as_str().unwrap())).unwrap();
    let expected: Vec<f32> = std::fs::read(dir.join(c["expected_file"].as_str().unwrap()))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(expected.len(), c["n_elements"].as_u64().unwrap() as usize, "{}", c["name"]);
    (ty, bytes, expected)
}

#[test]
fn dequantization_matches_gguf_python() {
    let m = json("dequant/manifest.json");
    let file = model_file();
    let dir = data_dir().join("dequant");
    let mut per_type = std::collections::BTreeMap::new();
    for c in m["cases"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let (ty, bytes, expected) = read_case(&dir, c);
        let n = expected.len();
        if c["from_model_bytes"].as_bool().unwrap() {
            let t = file.require_tensor(c["source_tensor"].as_str().unwrap()).unwrap();
            assert_eq!(t.ggml_type, ty, "{name}");
            let off = c["byte_offset"].as_u64().unwrap() as usize;
            assert_eq!(
                &file.tensor_data(t)[off..off + bytes.len()],
                &bytes[..],
                "{name}: bytes differ from the model file"
            );
        }
        let mut got = vec![0f32; n];
        dequantize_row(ty, &bytes, &mut got).unwrap();
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            // gguf computes d*q + m in float32 with separate rounding; allow 1 ulp.
            let ok = g == e || (g - e).abs() <= e.abs() * f32::EPSILON * 2.0;
            assert!(ok, "{name}[{i}]: strata {g} vs gguf {e}");
        }
        *per_type.entry(format!("{ty:?}")).or_insert(0) += 1;
    }
    for t in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"] {
        assert!(per_type.get(t).copied().unwrap_or(0) >= 2, "too few {t} cases: {per_type:?}");
    }
}

#[test]
fn k_quant_and_q5_dequantization_matches_gguf_python() {
    // Q5_0, Q5_1, the K-quants, IQ4_NL, IQ4_XS, MXFP4 and the lattice IQ formats: rows of Gemma 3 270M Q4_K_M and
    // random-byte blocks (tools/make-reference --only dequant-k); every value exact, or within 1 ulp where the package
    // rounds in another order
    let m = json("dequant_k/manifest.json");
    let dir = data_dir().join("dequant_k");
    let gemma = model_path().with_file_name("gemma-3-270m-q4_k_m.gguf");
    let file = gemma.exists().then(|| strata::gguf::GgufFile::open(&gemma).unwrap());
    let mut per_type = std::collections::BTreeMap::new();
    let mut exact = 0usize;
    let mut total = 0usize;
    for c in m["cases"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let (ty, bytes, expected) = read_case(&dir, c);
        let n = expected.len();
        let source = c["source"].as_str().unwrap();
        if let (Some(f), true) = (&file, source.starts_with("blk.")) {
            // the stored bytes are the model file's own
            let t = f.require_tensor(source).unwrap();
            let off = c["byte_offset"].as_u64().unwrap() as usize;
            assert_eq!(&f.tensor_data(t)[off..off + bytes.len()], &bytes[..], "{name}: bytes differ from the file");
        }
        let mut got = vec![0f32; n];
        dequantize_row(ty, &bytes, &mut got).unwrap();
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            let ok = g.to_bits() == e.to_bits() || (g - e).abs() <= e.abs() * f32::EPSILON;
            assert!(ok, "{name}[{i}]: strata {g} vs gguf {e}");
            exact += (g.to_bits() == e.to_bits()) as usize;
            total += 1;
        }
        *per_type.entry(format!("{ty:?}")).or_insert(0) += 1;
    }
    println!("{exact} of {total} values bit-identical, the rest within 1 ulp; cases {per_type:?}");
    for t in [
        "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS",
        "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
    ] {
        assert!(per_type.contains_key(t), "no {t} case: {per_type:?}");
    }
}

#[test]
fn tokenization_matches_llama_cpp() {
    let d = json("tokenizer_cases.json");
    let tok = Tokenizer::from_gguf(&model_file()).unwrap();
    let cases = d["cases"].as_array().unwrap();
    assert!(cases.len() >= 40);
    let mut bad = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let special = c["parse_special"].as_bool().unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = tok.encode(text, special, false).unwrap();
        if got != want {
            bad.push(format!("{text:?} (special {special}): strata {got:?} llama.cpp {want:?}"));
        }
        // Detokenizing (special tokens rendered) gives back the text, as llama.cpp's does.
        if c["detok_special"].as_str().unwrap() == text {
            let back = tok.decode(&want, true);
            if back != text {
                bad.push(format!("detokenize {text:?}: strata {back:?}"));
            }
        }
    }
    assert!(bad.is_empty(), "{} of {} cases differ:\n{}", bad.len(), cases.len(), bad.join("\n"));
}

/// llama.cpp evaluated the prompts twice: one token at a time (its decode
/// path, `positions_decode`) and as one batch (`positions`). The two differ
/// by llama.cpp's own kernel rounding: mean KL `kl_batch_vs_decode` ≈ 2.3e-3
/// on this Q4_1 model, whose 8-bit activation rounding amplifies one-ulp
/// differences chaotically over 30 layers. Strata rounds like llama.cpp
/// (8-bit activations, f16 KV, f16 queries and attention probabilities) but
/// not bit for bit (e.g. ggml's vectorised exp), so it is held to llama.cpp's
/// own noise floor plus 1e-3, and to ≥ 98% argmax agreement, against both.
/// The figures are printed; docs/REFERENCE-DATA.md records them.
#[test]
fn logits_match_llama_cpp() {
    let d = json("parity_logits.json");
    let model = Model::load(model_file()).unwrap();
    let nv = model.cfg.n_vocab;
    let (mut kl_dec, mut kl_bat, mut self_kl, mut n, mut agree_dec, mut agree_bat) =
        (0f64, 0f64, 0f64, 0usize, 0usize, 0usize);
    let mut worst = 0f64;
    {
        for p in d["prompts"].as_array().unwrap() {
            let ids: Vec<u32> = p["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let mut kv = model.new_kv(512);
            let mut s = Scratch::default();
            // Prefill in chunks of 32 (exercises the chunked path and the KV cache).
            let mut all = Vec::new();
            for ch in ids.chunks(32) {
                all.extend(model.forward(ch, &mut kv, Logits::All, &mut s));
            }
            let (k, a, kls) = compare(&all, nv, p["positions_decode"].as_array().unwrap());
            kl_dec += k;
            agree_dec += a;
            worst = kls.iter().cloned().fold(worst, f64::max);
            let (k, a, _) = compare(&all, nv, p["positions"].as_array().unwrap());
            kl_bat += k;
            agree_bat += a;
            self_kl += p["kl_batch_vs_decode"].as_f64().unwrap() * ids.len() as f64;
            n += ids.len();
        }
    };
    let nf = n as f64;
    let (kl_dec, kl_bat, self_kl) = (kl_dec / nf, kl_bat / nf, self_kl / nf);
    let (ag_dec, ag_bat) = (agree_dec as f64 / nf, agree_bat as f64 / nf);
    println!(
        "positions {n}: vs llama.cpp decode: mean KL {kl_dec:.3e} (worst {worst:.3e}), argmax {:.2}%; \
         vs llama.cpp batch: mean KL {kl_bat:.3e}, argmax {:.2}%; llama.cpp's own spread (batch vs decode, or its F16 vs Q8_0 cache): KL {self_kl:.3e}",
        ag_dec * 100.0,
        ag_bat * 100.0
    );
    assert!(n >= 200, "need at least 200 positions, have {n}");
    let bound = self_kl + 1e-3;
    assert!(
        kl_dec <= bound,
        "mean KL vs llama.cpp decode {kl_dec:.3e} > llama.cpp's batch-vs-decode {self_kl:.3e} + 1e-3"
    );
    assert!(
        kl_bat <= bound,
        "mean KL vs llama.cpp batch {kl_bat:.3e} > llama.cpp's batch-vs-decode {self_kl:.3e} + 1e-3"
    );
    assert!(ag_dec >= 0.98 && ag_bat >= 0.98, "argmax agreement {ag_dec:.4} / {ag_bat:.4} < 0.98");
}

/// Long context (issue 18): after a prefill of the first 2,000 tokens of the fixtures' evaluation text (chunks of
/// 256), strata decodes the next 200 teacher-forced tokens one at a time; its logits at those positions are held to
/// llama.cpp's own batch-vs-decode KL at the same positions plus 1e-3 against both of llama.cpp's evaluations; its
/// argmax must match llama.cpp's wherever llama.cpp's top two logits are 0.5 or more apart, and agree overall within
/// 3 points of llama.cpp's own batch-vs-decode agreement (96%: flips at near-ties). (f16 KV cache, its attention
/// over 2,000+ positions.)
///
/// Then over a Q8_0 KV cache (`--kv-type q8_0`) against llama.cpp with a Q8_0 cache (type_k = type_v = Q8_0, flash
/// attention; its batch and decode logits are equal): llama.cpp's own KL between its Q8_0-cache and F16-cache logits
/// stands in for the batch-vs-decode KL in the bound (a code flipped by a last-bit difference upstream moves a
/// value by a whole step of 1/127 of its block's largest, so two engines' Q8_0 caches differ by about what the
/// quantization itself does), and strata's own F16-to-Q8_0 KL must be within a factor of 3 of llama.cpp's (the
/// cache is really quantized, and by the same rule).
#[test]
fn long_context_logits_match_llama_cpp() {
    let f16 = long_context_parity("parity_logits_long.json", KvType::F16);
    let q8 = long_context_parity("parity_logits_long_q8_0.json", KvType::Q8_0);
    let d = json("parity_logits_long_q8_0.json");
    let theirs = d["kl_vs_f16_cache"].as_f64().unwrap();
    let nv = f16.len() / 200;
    let ours: f64 = f16.chunks(nv).zip(q8.chunks(nv)).map(|(p, q)| kl_full(p, q)).sum::<f64>() / 200.0;
    println!("F16 -> Q8_0 cache: strata KL {ours:.3e}, llama.cpp KL {theirs:.3e}");
    assert!(
        ours > theirs / 3.0 && ours < theirs * 3.0,
        "strata's F16 -> Q8_0 KL {ours:.3e} vs llama.cpp's {theirs:.3e}"
    );
}

/// KL(softmax(p) || softmax(q)) over the whole vocabulary, in f64.
fn kl_full(p: &[f32], q: &[f32]) -> f64 {
    let lse = |x: &[f32]| {
        let m = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p), lse(q));
    p.iter().zip(q).map(|(&a, &b)| (a as f64 - lp).exp() * ((a as f64 - lp) - (b as f64 - lq))).sum()
}

/// One long-context run over a `kv_type` cache against the llama.cpp record `data` (the bounds above); returns
/// strata's logits at the scored positions.
fn long_context_parity(data: &str, kv_type: KvType) -> Vec<f32> {
    let d = json(data);
    let mut model = Model::load(model_file()).unwrap();
    model.set_kv_type(kv_type).unwrap();
    let nv = model.cfg.n_vocab;
    let ids: Vec<u32> = d["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let first = d["first_scored"].as_u64().unwrap() as usize;
    assert!(first >= 2000 && ids.len() - first >= 200, "positions past 2,000: {first}..{}", ids.len());
    let mut kv = model.new_kv(ids.len() + 8);
    let mut s = Scratch::default();
    for ch in ids[..first].chunks(256) {
        model.forward(ch, &mut kv, Logits::Last, &mut s);
    }
    let mut all = Vec::with_capacity((ids.len() - first) * nv);
    s.decode = true;
    for &t in &ids[first..] {
        all.extend(model.forward(&[t], &mut kv, Logits::Last, &mut s));
    }
    let n = ids.len() - first;
    let (kl_dec, agree_dec, kls) = compare(&all, nv, d["positions_decode"].as_array().unwrap());
    let (kl_bat, agree_bat, _) = compare(&all, nv, d["positions"].as_array().unwrap());
    // the Q8_0 record's batch and decode agree exactly: its F16-vs-Q8_0 figures give the engines' spread
    let self_kl = d["kl_batch_vs_decode"].as_f64().unwrap().max(d["kl_vs_f16_cache"].as_f64().unwrap_or(0.0));
    let (kl_dec, kl_bat) = (kl_dec / n as f64, kl_bat / n as f64);
    let (ag_dec, ag_bat) = (agree_dec as f64 / n as f64, agree_bat as f64 / n as f64);
    let worst = kls.iter().cloned().fold(0f64, f64::max);
    println!(
        "{} KV cache, positions {first}..{}: vs llama.cpp decode: mean KL {kl_dec:.3e} (worst {worst:.3e}), argmax {:.2}%; vs \
         llama.cpp batch: mean KL {kl_bat:.3e}, argmax {:.2}%; llama.cpp's own spread (batch vs decode, or its F16 vs Q8_0 cache): KL {self_kl:.3e}",
        kv_type.name(),
        ids.len() - 1,
        ag_dec * 100.0,
        ag_bat * 100.0
    );
    let bound = self_kl + 1e-3;
    assert!(kl_dec <= bound, "mean KL vs llama.cpp decode {kl_dec:.3e} > {self_kl:.3e} + 1e-3");
    assert!(kl_bat <= bound, "mean KL vs llama.cpp batch {kl_bat:.3e} > {self_kl:.3e} + 1e-3");
    // argmax: llama.cpp's two evaluations agree on 96% of these positions (their flips sit at near-ties); strata
    // must agree with llama.cpp's batch wherever its top two logits are at least 0.5 apart
    let self_agree =
        d["argmax_batch_vs_decode"].as_f64().unwrap().min(d["argmax_vs_f16_cache"].as_f64().unwrap_or(1.0));
    let mut clear_flips = Vec::new();
    for (i, pos) in d["positions"].as_array().unwrap().iter().enumerate() {
        let top = pos["top"].as_array().unwrap();
        let (t0, l0, l1) =
            (top[0][0].as_u64().unwrap() as usize, top[0][1].as_f64().unwrap(), top[1][1].as_f64().unwrap());
        let ours = &all[i * nv..(i + 1) * nv];
        let am = (0..nv).fold(0, |b, j| if ours[j] > ours[b] { j } else { b });
        if l0 - l1 >= 0.5 && am != t0 {
            clear_flips.push((first + i, l0 - l1));
        }
    }
    println!("llama.cpp's own batch-vs-decode argmax agreement {:.1}%", self_agree * 100.0);
    assert!(clear_flips.is_empty(), "argmax differs where llama.cpp's margin is at least 0.5: {clear_flips:?}");
    assert!(ag_dec.min(ag_bat) >= self_agree - 0.03, "argmax agreement {ag_dec:.4} / {ag_bat:.4} vs {self_agree:.4}");
    all
}

#[test]
fn greedy_continuation_matches_llama_cpp() {
    let d = json("parity_logits.json");
    let g = &d["greedy"][0];
    let model = Model::load(model_file()).unwrap();
    let tok = Tokenizer::from_gguf(&model.file).unwrap();
    let prompt_ids: Vec<u32> = g["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(tok.encode(g["prompt"].as_str().unwrap(), true, true).unwrap(), prompt_ids);
    let want: Vec<u32> = g["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let margins: Vec<f64> = g["top2_margin"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let got = {
        let mut kv = model.new_kv(128);
        let mut s = Scratch::default();
        let mut lg = model.forward(&prompt_ids, &mut kv, Logits::Last, &mut s);
        let mut out = Vec::new();
        for _ in 0..want.len() {
            let t = strata::engine::sampler::argmax(&lg);
            out.push(t);
            lg = model.forward(&[t], &mut kv, Logits::Last, &mut s);
        }
        out
    };
    // Tokens must agree up to the first step where llama.cpp's top two are within 0.3 logits
    // (a near-tie that rounding differences may flip).
    for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
        if margins[i] < 0.3 {
            break;
        }
        assert_eq!(a, b, "step {i}: strata {got:?} llama.cpp {want:?}");
    }
    assert!(tok.decode(&got, false).starts_with(" Paris"));
}

/// The SIMD and scalar kernels compute the same model: over the parity
/// prompts their logits agree as closely as two correct implementations can
/// (they differ only in f32 summation order, which the model's 8-bit
/// activation rounding amplifies: this is the noise floor that bounds any
/// comparison with llama.cpp as well).
#[test]
fn simd_and_scalar_paths_agree() {
    use strata::backend::cpu::Precision;
    let d = json("parity_logits.json");
    let mut model = Model::load(model_file()).unwrap();
    let nv = model.cfg.n_vocab;
    let mut runs = Vec::new();
    for prec in [Precision::Q8Activations, Precision::Q8Scalar] {
        model.precision = prec;
        let mut all = Vec::new();
        for p in d["prompts"].as_array().unwrap() {
            let ids: Vec<u32> = p["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let mut kv = model.new_kv(512);
            all.extend(model.forward(&ids, &mut kv, Logits::All, &mut Scratch::default()));
        }
        runs.push(all);
    }
    let n = runs[0].len() / nv;
    let (mut kl, mut agree) = (0f64, 0usize);
    for i in 0..n {
        let (a, b) = (&runs[0][i * nv..(i + 1) * nv], &runs[1][i * nv..(i + 1) * nv]);
        let idx: Vec<usize> = (0..nv).collect();
        let (la, _) = log_softmax_at(a, &idx);
        let (lb, _) = log_softmax_at(b, &idx);
        kl += la.iter().zip(&lb).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
        if strata::engine::sampler::argmax(a) == strata::engine::sampler::argmax(b) {
            agree += 1;
        }
    }
    let (kl, agree) = (kl / n as f64, agree as f64 / n as f64);
    println!("positions {n}: KL(simd || scalar) {kl:.3e}, argmax agreement {:.2}%", agree * 100.0);
    // Within a margin of the noise floor measured on this model (~3e-3, 98.5 %).
    assert!(kl <= 1e-2 && agree >= 0.97, "SIMD and scalar paths disagree: KL {kl:.3e}, argmax {agree:.4}");
}
