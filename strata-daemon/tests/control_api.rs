//! The transport-neutral control API (`strata::api::Control`) used directly, without any RPC: generation with
//! its counters, statistics, knobs, residency, profile save and the counter stream on the split MoE fixture,
//! and each refusal's kind.

mod common;

use std::sync::Arc;

use strata::api::{ApiError, Control};
use strata::engine::request::RawRequest;
use strata::engine::{Engine, EngineConfig, Event, FinishReason};
use strata::gguf::GgufFile;
use strata::model::{Model, Tokenizer};
use strata::tiers::fileio::FileIo;
use strata::tiers::knobs::Knob;
use strata::tiers::store::ResidentMode;

fn control(moe: bool) -> (Arc<Engine>, Control) {
    control_with(moe, EngineConfig { n_ctx: 256, threads: 2, batch: 64 })
}

/// [`control`] with another engine configuration.
fn control_with(moe: bool, cfg: EngineConfig) -> (Arc<Engine>, Control) {
    let path = if moe { common::fixture_path("split") } else { common::model_path() };
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let mut m = Model::load(file.clone()).unwrap();
    m.set_threads(2).unwrap();
    if moe {
        let half = m.expert_layout().unwrap().total_bytes() / 2;
        m.experts = Some(Arc::new(common::store_for(&m, &path, ResidentMode::Budget(half), FileIo::Buffered, None)));
    }
    let knobs = m.experts.as_ref().map(|st| st.knobs.clone()).unwrap_or_default();
    let tok = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(m);
    let engine = Arc::new(Engine::start(model.clone(), tok.clone(), cfg, None).unwrap());
    let profile = std::env::temp_dir().join(format!("strata-control-api-{}.prof", std::process::id()));
    let api = Control::new(engine.clone(), &model, tok, knobs, Some(profile));
    (engine, api)
}

fn run(api: &Control, prompt: &str, max_tokens: u32) -> (Vec<u32>, strata::engine::Counters) {
    let raw = RawRequest { prompt: prompt.into(), max_tokens, ..Default::default() };
    let mut rx = api.generate(&raw).unwrap();
    let mut ids = Vec::new();
    loop {
        match rx.blocking_recv().expect("the engine ends every request with Done or Error") {
            Event::Token { id, .. } => ids.push(id),
            Event::Done { counters, .. } => return (ids, counters),
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
}

#[test]
fn moe_model_through_the_api() {
    let (engine, api) = control(true);
    assert_eq!(api.model().architecture, "llama");
    assert_eq!(api.model().backend, "cpu");
    assert!(api.model().n_expert > 0);

    // a live knob: set, read back, refused values change nothing
    let c = api.set_knob("ram-adapt", "8").unwrap();
    assert_eq!((c.knob, c.old, c.new, c.active), (Knob::RamAdapt, 0.0, 8.0, true));
    assert!(matches!(api.set_knob("ram_adapt", "-1"), Err(ApiError::InvalidArgument(_))));
    assert!(matches!(api.set_knob("no_such_knob", "1"), Err(ApiError::InvalidArgument(_))));
    assert_eq!(api.knobs().iter().find(|k| k.knob == Knob::RamAdapt).unwrap().value, 8.0);

    // generation: greedy tokens and the request's counters, then the totals
    let (ids, c) = run(&api, "The capital of France is", 12);
    assert_eq!(ids.len(), 12);
    assert_eq!(c.generated_tokens, 12);
    assert_eq!(c.finish, FinishReason::MaxTokens);
    assert!(c.tiers.lookups > 0, "decode windows look experts up");
    assert!(c.tiers.file_blob_reads > 0, "half the experts are on the file tier");
    let (again, c2) = run(&api, "The capital of France is", 12);
    assert_eq!(again, ids, "greedy answers repeat");
    let s = api.stats();
    assert_eq!(s.totals.requests, 2);
    assert_eq!(s.totals.generated_tokens, 24);
    assert_eq!(s.last_request.unwrap().request_id, 2);
    // the totals are the two requests' tier counters added up
    assert_eq!(s.tiers.lookups, c.tiers.lookups + c2.tiers.lookups);
    assert_eq!(s.tiers.file_blob_reads, c.tiers.file_blob_reads + c2.tiers.file_blob_reads);

    // a request that fails validation is refused by kind and counted
    let bad = RawRequest { prompt: "x".into(), max_tokens: 0, ..Default::default() };
    assert!(matches!(api.generate(&bad), Err(ApiError::InvalidArgument(_))));
    assert_eq!(api.stats().totals.rejected, 1);

    // residency: every layer, one layer, the top experts; a layer the model lacks is refused
    let n_layers = api.model().n_layers;
    let all = api.residency(None, 0).unwrap();
    assert_eq!(all.layers.len(), n_layers as usize);
    assert_eq!(all.mode, "budget");
    assert_eq!(all.experts.len(), (n_layers * api.model().n_expert) as usize);
    let ram: u32 = all.layers.iter().map(|(_, l)| l.experts[1]).sum();
    let file: u32 = all.layers.iter().map(|(_, l)| l.experts[2]).sum();
    assert!(ram > 0 && file > 0, "a half budget splits the experts between RAM and file: {ram} / {file}");
    let one = api.residency(Some(1), 0).unwrap();
    assert_eq!(one.layers.len(), 1);
    assert!(one.experts.iter().all(|e| e.layer == 1));
    let top = api.residency(None, 5).unwrap();
    assert_eq!(top.experts.len(), 5);
    assert!(top.experts.windows(2).all(|w| w[0].usage >= w[1].usage));
    assert!(matches!(api.residency(Some(n_layers), 0), Err(ApiError::InvalidArgument(_))));

    // profile save to the configured path, and to a given one; a path that cannot be written is refused
    let saved = api.save_profile(None).unwrap();
    assert_eq!(saved.ranked, (n_layers * api.model().n_expert) as usize);
    assert!(saved.path.exists());
    std::fs::remove_file(&saved.path).unwrap();
    let given = std::env::temp_dir().join(format!("strata-control-api-given-{}.prof", std::process::id()));
    assert_eq!(api.save_profile(Some(given.clone())).unwrap().path, given);
    assert!(given.exists());
    std::fs::remove_file(&given).unwrap();
    let nowhere = std::path::PathBuf::from("/nonexistent-dir/strata.prof");
    assert!(matches!(api.save_profile(Some(nowhere)), Err(ApiError::FailedPrecondition(_))));

    // the counter stream: a request's live or final counters arrive, and it ends at shutdown
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut watch = api.watch();
        let raw = RawRequest { prompt: "Once upon a time".into(), max_tokens: 8, ..Default::default() };
        let mut rx = api.generate(&raw).unwrap();
        while let Some(ev) = rx.recv().await {
            if matches!(ev, Event::Done { .. }) {
                break;
            }
        }
        let u = tokio::time::timeout(std::time::Duration::from_secs(10), watch.recv()).await.unwrap().unwrap().unwrap();
        assert!(u.counters.request_id == 3, "the third request's counters: {:?}", u.counters.request_id);
        engine.shutdown();
        let mut ended = false;
        while let Ok(Some(u)) = tokio::time::timeout(std::time::Duration::from_secs(10), watch.recv()).await {
            if let Err(e) = u {
                assert!(matches!(e, ApiError::Unavailable(_)));
                ended = true;
                break;
            }
        }
        assert!(ended, "the stream ends with Unavailable at shutdown");
    });
}

#[test]
fn dense_model_refuses_expert_calls() {
    let (engine, api) = control(false);
    assert_eq!(api.model().n_expert, 0);
    assert!(matches!(api.residency(None, 0), Err(ApiError::FailedPrecondition(_))));
    assert!(matches!(api.save_profile(None), Err(ApiError::FailedPrecondition(_))));
    // expert knobs are accepted but say they do not act on a dense model
    let c = api.set_knob("adapt_every", "2").unwrap();
    assert!(!c.active);
    engine.shutdown();
}

/// A copy of the tiny qwen3moe file with a NaN in row 0 of layer 1's router (`blk.1.ffn_gate_inp.weight`, F32).
fn nan_router_file() -> std::path::PathBuf {
    use strata::gguf::writer::GgufWriter;
    let f = GgufFile::open(common::arch_fixture_path("qwen3moe")).unwrap();
    let mut w = GgufWriter::default();
    for (k, v) in &f.metadata {
        w.set(k, v.clone());
    }
    for t in &f.tensors {
        let mut data = f.tensor_data(t).to_vec();
        if t.name == "blk.1.ffn_gate_inp.weight" {
            data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
        w.add_tensor(&t.name, t.dims.clone(), t.ggml_type, data);
    }
    let p = std::env::temp_dir().join(format!("strata-nan-router-{}.gguf", std::process::id()));
    std::fs::write(&p, w.to_bytes()).unwrap();
    p
}

#[test]
fn a_non_finite_value_fails_the_request_naming_the_layer_and_the_daemon_keeps_serving() {
    let path = nan_router_file();
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let mut m = Model::load(file.clone()).unwrap();
    m.set_threads(2).unwrap();
    let tok = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(m);
    let engine = Arc::new(
        Engine::start(model.clone(), tok.clone(), EngineConfig { n_ctx: 128, threads: 2, batch: 64 }, None).unwrap(),
    );
    let api = Control::new(engine.clone(), &model, tok, Default::default(), None);
    for attempt in 0..2 {
        let raw = RawRequest { prompt: "hello there".into(), max_tokens: 4, ..Default::default() };
        let mut rx = api.generate(&raw).unwrap();
        let err = loop {
            match rx.blocking_recv().expect("the engine ends every request") {
                Event::Error(e) => break e,
                Event::Done { counters, .. } => {
                    panic!("attempt {attempt}: finished ({:?}) on NaN weights", counters.finish)
                }
                Event::Token { .. } => {}
            }
        };
        assert!(err.contains("non-finite") && err.contains("ffn_gate_inp") && err.contains("layer 1"), "{err}");
        // still serving: the statistics answer
        assert_eq!(api.stats().queued, 0);
    }
    engine.shutdown();
    std::fs::remove_file(&path).unwrap();
}

/// A prompt of many prefill chunks reports its progress in the live counters: some update of the running request
/// has fewer prompt tokens done than the prompt has, and the final counters have them all.
#[test]
fn watch_reports_prefill_progress() {
    // 8-token chunks: a prompt of ~400 tokens runs 50 of them
    let (engine, api) = control_with(false, EngineConfig { n_ctx: 512, threads: 2, batch: 8 });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut watch = api.watch();
        let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(40);
        let raw = RawRequest { prompt, max_tokens: 2, ..Default::default() };
        let _rx = api.generate(&raw).unwrap();
        let (mut partial, mut last) = (None, None);
        while let Ok(Some(Ok(u))) = tokio::time::timeout(std::time::Duration::from_secs(60), watch.recv()).await {
            let c = u.counters;
            if u.running && c.prompt_done < c.prompt_tokens {
                partial.get_or_insert((c.prompt_done, c.prompt_tokens));
            }
            if !u.running {
                last = Some(c);
                break;
            }
        }
        let (done, total) = partial.expect("a live update during the prefill");
        assert!(total > 300 && done > 0 && done < total, "{done} of {total}");
        let last = last.expect("the finished request's counters");
        assert_eq!(last.prompt_done, last.prompt_tokens);
    });
    engine.shutdown();
}
