//! Request validation and chat rendering with a real model's tokenizer and template (SmolLM2's: `STRATA_MODELS`
//! or ~/.cache/strata/models): any request built from the input gives parameters or a `RequestError`, never a
//! panic; an accepted request fits the context and user text never becomes control tokens.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use strata::engine::request::{prepare, RawRequest};
use strata::gguf::GgufFile;
use strata::model::chat::Message;
use strata::model::tokenizer::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::env::var_os("STRATA_MODELS").map(std::path::PathBuf::from).unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/strata/models")
        });
        let f = GgufFile::open(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")).expect("tools/fetch-model first");
        Tokenizer::from_gguf(&f).expect("tokenizer")
    })
}

/// Reads the request from the input: a JSON object with the fields of an OpenAI request where they parse,
/// defaults elsewhere (so that mutations reach every check).
fn raw_of(data: &[u8]) -> Option<RawRequest> {
    let v: serde_json::Value = serde_json::from_slice(data).ok()?;
    let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
    let f = |k: &str| v.get(k).and_then(|x| x.as_f64()).map(|x| x as f32);
    let u = |k: &str| v.get(k).and_then(|x| x.as_u64());
    let messages = v
        .get("messages")
        .and_then(|m| m.as_array())
        .map(|a| {
            a.iter()
                .map(|m| {
                    let g = |k: &str| m.get(k).and_then(|x| x.as_str()).unwrap_or_default().to_string();
                    Message::new(g("role"), g("content"))
                })
                .collect()
        })
        .unwrap_or_default();
    let stop = match v.get("stop") {
        Some(serde_json::Value::String(x)) => vec![x.clone()],
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect(),
        _ => Vec::new(),
    };
    Some(RawRequest {
        prompt: s("prompt").unwrap_or_default(),
        messages,
        max_tokens: u("max_tokens").unwrap_or(16).min(u32::MAX as u64) as u32,
        temperature: f("temperature").unwrap_or(0.0),
        top_k: u("top_k").unwrap_or(0).min(u32::MAX as u64) as u32,
        top_p: f("top_p"),
        min_p: f("min_p").unwrap_or(0.0),
        repeat_penalty: f("repeat_penalty"),
        repeat_last_n: u("repeat_last_n").map(|x| x.min(u32::MAX as u64) as u32),
        seed: u("seed"),
        stop,
        ..Default::default()
    })
}

fuzz_target!(|data: &[u8]| {
    let Some(raw) = raw_of(data) else { return };
    let n_ctx = 2048;
    let tok = tokenizer();
    if let Ok(p) = prepare(&raw, tok, n_ctx) {
        assert!(!p.prompt_ids.is_empty() && p.prompt_ids.len() < n_ctx);
        // max_tokens is capped by the context, not by the room the prompt leaves (generation stops at the end)
        assert!(p.max_tokens >= 1 && p.max_tokens <= n_ctx);
        // the control tokens of a chat come from the template alone: the same roles with plain contents give as
        // many
        if !raw.messages.is_empty() {
            let plain = RawRequest {
                messages: raw.messages.iter().map(|m| Message::new(m.role.clone(), "x")).collect(),
                ..raw.clone()
            };
            if let Ok(q) = prepare(&plain, tok, n_ctx) {
                let controls = |ids: &[u32]| ids.iter().filter(|&&i| tok.is_control(i)).count();
                assert_eq!(controls(&p.prompt_ids), controls(&q.prompt_ids), "user text became control tokens");
            }
        }
    }
});
