//! gpt-oss on a tiny random-weight file that llama.cpp quantized (tests/data/gpt-oss/, tools/make-reference --only
//! parity-gpt-oss): MXFP4 experts with router and expert biases, attention sinks, sliding-window layers, YaRN RoPE,
//! the clamped SwiGLU, the top-k softmax; its logits, its `gpt-4o` tokenizer and end-of-generation tokens against
//! llama.cpp, and its chat template (gpt-oss's own) against jinja2 as transformers renders it.

mod common;

use std::sync::Arc;

use common::*;
use strata::arch::{FfnAct, Gating, SwaRope};
use strata::gguf::GgufFile;
use strata::model::chat::{render, Message};
use strata::model::tokenizer::Tokenizer;
use strata::model::Model;
use strata::quant::GgmlType;

fn path() -> std::path::PathBuf {
    data_dir().join("gpt-oss/tiny-gpt-oss-mxfp4.gguf")
}

fn file() -> Arc<GgufFile> {
    let path = path();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    let d = json("gpt-oss/parity_logits_gpt_oss.json");
    assert_eq!(d["model_sha256"].as_str().unwrap(), sha256_hex(&std::fs::read(&path).unwrap()));
    f
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The file's choices as the registry row and the metadata give them.
#[test]
fn gpt_oss_reads_its_choices_from_the_file() {
    let f = file();
    assert!(f.tensors.iter().any(|t| t.ggml_type == GgmlType::MXFP4), "no MXFP4 experts");
    let m = Model::load(f).unwrap();
    let (c, def) = (&m.cfg, m.cfg.spec.def);
    assert_eq!(
        (def.name, def.gating, def.act, def.swa_rope),
        ("gpt-oss", Gating::SoftmaxTopK, FfnAct::SwigluOai, SwaRope::Global)
    );
    assert_eq!((c.n_expert, c.n_expert_used, c.n_ff_exp, c.sliding_window), (8, 4, 128, 16));
    assert_eq!((0..3).map(|l| c.is_swa(l)).collect::<Vec<_>>(), [true, false, true]);
    let y = c.rope_yarn.expect("YaRN");
    assert_eq!((c.rope_freq_scale, y.n_ctx_orig, y.ext_factor), (1.0 / 32.0, 4096, 1.0));
    assert!((y.attn_factor - 1.0).abs() < 1e-6, "{}", y.attn_factor);
    // the correction dimensions of gpt-oss's RoPE (64 rotated dimensions at base 150000): 8 and 18
    assert_eq!(y.corr_dims(64, 150000.0), [8.0, 18.0]);
    assert_eq!((c.rope_freq_base_swa, c.rope_freq_scale_swa), (c.rope_freq_base, c.rope_freq_scale));
    let b = &m.weights.blocks[1];
    assert_eq!(b.attn_sinks.as_ref().map(Vec::len), Some(4));
    assert!(b.bias.q.is_some() && b.bias.o.is_some());
    let strata::arch::weights::Ffn::Moe(ex) = &b.ffn else { panic!("dense block") };
    let bias = ex.bias.as_ref().unwrap();
    assert_eq!((bias.gate.len(), bias.up.len(), bias.down.len()), (8 * 128, 8 * 128, 8 * 128));
    assert_eq!(ex.router_bias.as_ref().map(Vec::len), Some(8));
}

/// KL(llama.cpp ‖ strata) within llama.cpp's own batch-vs-decode KL + 1e-3 and ≥ 98% argmax agreement with both of
/// its paths (near ties counting: `assert_parity`), over a chat rendered with gpt-oss's template and a paragraph (401 positions; the sliding window of
/// 16 covers a fraction of each).
#[test]
fn gpt_oss_matches_llama_cpp() {
    let mut m = Model::load(file()).unwrap();
    m.set_threads(2).unwrap();
    let d = json("gpt-oss/parity_logits_gpt_oss.json");
    assert_parity("gpt-oss", &m, &d);
    // each of gpt-oss's own parts matters on this file: without it the logits leave llama.cpp's tolerance
    type Ablation = fn(&mut Model);
    let ablations: [(&str, Ablation); 4] = [
        ("no attention sinks", |m| m.weights.blocks.iter_mut().for_each(|b| b.attn_sinks = None)),
        ("no YaRN", |m| m.cfg.rope_yarn = None),
        ("no sliding window", |m| m.cfg.sliding_window = 0),
        ("no expert biases", |m| {
            for b in &mut m.weights.blocks {
                if let strata::arch::weights::Ffn::Moe(ex) = &mut b.ffn {
                    ex.bias = None;
                }
            }
        }),
    ];
    for (what, f) in ablations {
        let mut m = Model::load(file()).unwrap();
        m.set_threads(2).unwrap();
        f(&mut m);
        let p = parity_stats(what, &m, &d);
        assert!(p.kl_dec > p.self_kl + 1e-3, "{what}: KL {:.3e} is within the tolerance", p.kl_dec);
        // and the argmax rule, near ties counting as agreement, still tells the difference (6-81% here)
        assert!(p.tie_dec < 0.98, "{what}: argmax with near ties {:.4} passes", p.tie_dec);
    }
}

/// The `gpt-4o` pre-tokenizer and the harmony control tokens tokenize as llama.cpp does, and the end-of-generation
/// set is llama.cpp's: `<|return|>` and `<|call|>`, not `<|end|>` (which closes the analysis message inside a turn).
/// One deliberate difference: llama.cpp makes the harmony markers user-defined, so it also finds them in text whose
/// specials are not parsed (message content); Strata keeps them special there (content cannot open a turn) and, as
/// llama.cpp, prints them in generated text.
#[test]
fn gpt_oss_tokenizer_matches_llama_cpp() {
    let tok = Tokenizer::from_gguf(&file()).unwrap();
    let d = json("gpt-oss/tokenizer_cases_gpt_oss.json");
    let markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"];
    let (mut bad, mut plain_markers) = (Vec::new(), 0);
    for c in d["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let special = c["parse_special"].as_bool().unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = tok.encode(text, special, false).unwrap();
        if !special && markers.iter().any(|m| text.contains(m)) {
            // the markers are text here: the same ids as the text with them parsed as plain words
            plain_markers += 1;
            assert!(markers.iter().all(|m| got.iter().all(|&id| tok.token_str(id) != *m)), "{text:?}: {got:?}");
            continue;
        }
        if got != want {
            bad.push(format!("{text:?} (special {special}): strata {got:?} llama.cpp {want:?}"));
        }
        // generated text prints the harmony markers (decode without special rendering), as llama.cpp's
        if special && c["detok"].as_str().unwrap() == text {
            assert_eq!(tok.decode(&want, false), text);
        }
    }
    assert!(bad.is_empty(), "{} cases differ:\n{}", bad.len(), bad.join("\n"));
    assert_eq!(plain_markers, 1);
    let chat = json("gpt-oss/chat_gpt_oss.json");
    let mut want: Vec<u32> = chat["eog"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let mut got = tok.eog.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "end-of-generation tokens");
    let end = tok.encode("<|end|>", true, false).unwrap();
    assert!(end.len() == 1 && !tok.is_eog(end[0]));
}

/// gpt-oss's own chat template (harmony: system preamble with today's date, developer message, `<|start|>role
/// <|message|>…<|end|>`, the final channel on assistant turns) renders as jinja2 renders it for transformers, and the
/// rendering tokenizes as llama.cpp tokenizes it.
#[test]
fn gpt_oss_chat_template_renders_as_transformers_does() {
    let f = file();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let template = tok.chat_template.clone().expect("chat template");
    let d = json("gpt-oss/chat_gpt_oss.json");
    let date = d["date"].as_str().unwrap();
    for c in d["chats"].as_array().unwrap() {
        let msgs: Vec<Message> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let gen = c["add_generation_prompt"].as_bool().unwrap();
        let today = chrono_today();
        let got = render(&template, &msgs, gen, "", "").unwrap().replacen(
            &format!("Current date: {today}"),
            &format!("Current date: {date}"),
            1,
        );
        let want = c["text"].as_str().unwrap();
        assert_eq!(got, want, "{msgs:?}");
        let ids: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tok.encode(want, true, false).unwrap(), ids);
    }
}

/// Today's date as the template prints it (`%Y-%m-%d`, local time), through the renderer's own `strftime_now`.
fn chrono_today() -> String {
    render("{{ strftime_now('%Y-%m-%d') }}", &[], false, "", "").unwrap()
}

/// The MXFP4 experts give the same greedy tokens from the mapping, from the RAM copy, with half of them read from
/// the file (buffered and O_DIRECT) and with RAM adapt on: the biases and activation ride with every tier.
#[test]
fn gpt_oss_experts_give_the_same_tokens_from_every_tier() {
    use strata::tiers::fileio::FileIo;
    use strata::tiers::store::ResidentMode;
    let mut m = Model::load(file()).unwrap();
    m.set_threads(2).unwrap();
    let chat = json("gpt-oss/chat_gpt_oss.json");
    let ids = |i: usize| -> Vec<u32> {
        chat["chats"][i]["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
    };
    let (a, b) = (ids(0), ids(2));
    let prompts: [&[u32]; 2] = [&a, &b];
    let base = greedy(&m, &prompts, 16);
    let total = m.expert_layout().unwrap().total_bytes();
    for (mode, io, ram_adapt) in [
        (ResidentMode::All, FileIo::Buffered, 0),
        (ResidentMode::Budget(total / 2), FileIo::Buffered, 0),
        (ResidentMode::Budget(total / 2), FileIo::Direct, 0),
        (ResidentMode::Budget(total / 2), FileIo::Buffered, 8),
    ] {
        let st = store_for(&m, &path(), mode, io, None);
        st.knobs.set("ram_adapt", &ram_adapt.to_string()).unwrap();
        st.knobs.set("adapt_every", "1").unwrap();
        m.experts = Some(Arc::new(st));
        assert_eq!(greedy(&m, &prompts, 16), base, "{mode:?} {io:?} ram_adapt {ram_adapt}");
        let t = m.experts.as_ref().unwrap().counters.totals();
        if matches!(mode, ResidentMode::Budget(_)) {
            assert!(t.file_blob_reads > 0, "{mode:?}: no blob read");
        }
    }
}

/// A gpt-oss file without one of the parts its architecture needs is refused with the tensor's name.
#[test]
fn a_gpt_oss_file_missing_its_sinks_or_biases_is_refused_with_the_name() {
    use strata::gguf::writer::GgufWriter;
    let f = GgufFile::open(path()).unwrap();
    for missing in ["blk.1.attn_sinks.weight", "blk.2.ffn_down_exps.bias", "blk.0.ffn_gate_inp.bias"] {
        let mut w = GgufWriter::default();
        for (k, v) in &f.metadata {
            w.set(k, v.clone());
        }
        for t in f.tensors.iter().filter(|t| t.name != missing) {
            w.add_tensor(&t.name, t.dims.clone(), t.ggml_type, f.tensor_data(t).to_vec());
        }
        let p = std::env::temp_dir().join(format!("strata-gpt-oss-{}-{missing}.gguf", std::process::id()));
        std::fs::write(&p, w.to_bytes()).unwrap();
        let e = Model::load(Arc::new(GgufFile::open(&p).unwrap())).err().map(|e| e.to_string());
        std::fs::remove_file(&p).unwrap();
        let e = e.unwrap_or_else(|| panic!("loaded without {missing}"));
        assert!(e.contains(&format!("\"{missing}\" is missing")), "{e}");
    }
    // and without its sliding window (every layer would silently turn global)
    let mut w = GgufWriter::default();
    for (k, v) in f.metadata.iter().filter(|(k, _)| k != "gpt-oss.attention.sliding_window") {
        w.set(k, v.clone());
    }
    for t in &f.tensors {
        w.add_tensor(&t.name, t.dims.clone(), t.ggml_type, f.tensor_data(t).to_vec());
    }
    let p = std::env::temp_dir().join(format!("strata-gpt-oss-{}-no-window.gguf", std::process::id()));
    std::fs::write(&p, w.to_bytes()).unwrap();
    let e = Model::load(Arc::new(GgufFile::open(&p).unwrap())).err().map(|e| e.to_string());
    std::fs::remove_file(&p).unwrap();
    let e = e.expect("loaded without attention.sliding_window");
    assert!(e.contains("gpt-oss.attention.sliding_window"), "{e}");
}
