//! The tier check (`VerifyTiers`, `strata-ctl verify`): after many sampled requests with the tiers moving, every
//! RAM place (and every VRAM slot, per stage, on a GPU) still holds exactly its expert's file bytes; a copy that
//! differs is reported by expert and layer, and exit code 3 from `strata-ctl verify`.
//!
//! The CPU test runs in CI: RAM adapt moving experts between the RAM copy and the file tier. The GPU test runs
//! where `STRATA_GPU_VERIFY_MODEL` names a model: each configuration of `STRATA_GPU_VERIFY_ARGS` (daemon flags,
//! configurations separated by `;`, `{quarter}` standing for a quarter of the routed experts and `{half}` for half
//! the layers; default: a quarter of the experts in VRAM, all in RAM with blocking swaps, the resident mode with
//! blocking and async swaps, the same on a layer split of one card, and all experts in RAM with async swaps) serves `STRATA_VERIFY_REQUESTS` (default 32)
//! varied chat requests at temperature 0.6, then the check must find no fault; it prints the counters and the
//! VRAM slots per stage, and how many answers equal the same seed's answer of the first configuration.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use strata::gguf::GgufFile;
use strata_proto::v1 as pb;
use strata_tests::*;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// `n` varied chat requests at temperature 0.6, request `i` with seed `i`: the fixed conversations' user turns
/// (with their system message), cycled, each asked alone.
fn sampled_requests(n: usize, max_tokens: u32) -> Vec<pb::GenerateRequest> {
    let (system, chats) = conversations();
    let turns: Vec<String> = chats.into_iter().flatten().collect();
    (0..n)
        .map(|i| pb::GenerateRequest {
            messages: vec![
                pb::ChatMessage { role: "system".into(), content: system.clone() },
                pb::ChatMessage { role: "user".into(), content: turns[i % turns.len()].clone() },
            ],
            max_tokens,
            sampling: Some(pb::SamplingParams {
                temperature: 0.6,
                top_p: Some(0.95),
                seed: Some(i as u64),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect()
}

/// Runs the requests one after another; returns the answers. Panics when one fails or is empty.
async fn run_all(
    c: &mut strata_proto::v1::strata_client::StrataClient<tonic::transport::Channel>,
    reqs: &[pb::GenerateRequest],
) -> Vec<String> {
    let mut out = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let mut s = c.generate(r.clone()).await.unwrap_or_else(|e| panic!("request {i}: {e}")).into_inner();
        let mut text = None;
        while let Some(ev) = s.message().await.unwrap_or_else(|e| panic!("request {i}: {e}")) {
            if let Some(pb::generate_event::Event::Done(d)) = ev.event {
                let k = d.counters.unwrap_or_default();
                assert!(k.generated_tokens > 0, "request {i} generated nothing");
                text = Some(d.text);
            }
        }
        out.push(text.unwrap_or_else(|| panic!("request {i}: no Done event")));
    }
    out
}

async fn verify(
    c: &mut strata_proto::v1::strata_client::StrataClient<tonic::transport::Channel>,
) -> pb::VerifyTiersReply {
    c.verify_tiers(pb::VerifyTiersRequest {}).await.expect("VerifyTiers").into_inner()
}

/// The file range of one of `(layer, expert)`'s three matrices (the gate's rows of that expert).
fn expert_gate_range(model: &Path, layer: u32, expert: u32) -> (u64, usize) {
    let f = GgufFile::open(model).expect("open the model");
    let t = f.tensor(&format!("blk.{layer}.ffn_gate_exps.weight")).expect("the gate tensor of the experts");
    let n_expert = t.dims[2];
    let per = t.size_bytes / n_expert;
    (t.file_offset + expert as u64 * per, per as usize)
}

/// RAM adapt moves experts between the RAM copy and the file tier over sampled requests; then every RAM place
/// equals the file. A byte of one RAM-held expert changed in the file (the copy is now stale) is reported as that
/// expert's fault, by the RPC and by `strata-ctl verify` (exit code 3); with the byte back the check is clean. The
/// file truncated under the daemon makes every RAM place a fault (its read fails) without harming the daemon.
#[test]
fn ram_adapt_keeps_every_ram_place_equal_to_the_file_and_a_stale_copy_is_named() {
    let copy = temp_path(".gguf");
    std::fs::copy(fixture_path("shared"), &copy).unwrap();
    let d = Daemon::start_with(
        &copy,
        &temp_path(".sock"),
        &["--resident-budget-gib", "0.03", "--ram-adapt", "4", "--gpu", "off", "--no-mlock"],
    );
    let n = env_or("STRATA_VERIFY_REQUESTS", 12usize);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        let answers = run_all(&mut c, &sampled_requests(n, 16)).await;
        assert!(answers.iter().any(|a| !a.trim().is_empty()), "every answer empty");
        let st = c.get_stats(pb::StatsRequest {}).await.unwrap().into_inner().totals.unwrap_or_default();
        assert!(st.ram_promotions > 0, "RAM adapt moved nothing in {n} requests: {st:?}");

        let r = verify(&mut c).await;
        assert!(r.faults.is_empty(), "faults after {} promotions: {:?}", st.ram_promotions, r.faults);
        assert!(r.ram_experts > 0, "no RAM place checked");
        assert!(r.vram_slots_per_stage.is_empty(), "VRAM slots on the CPU backend: {r:?}");
        println!(
            "{n} sampled requests, {} promotions: {} RAM places equal to the file ({:.0} ms)",
            st.ram_promotions, r.ram_experts, r.elapsed_ms
        );

        // an expert with a RAM place, and a byte of it changed in the file
        let res = c.get_residency(pb::ResidencyRequest { layer: None, top: 0 }).await.unwrap().into_inner();
        let e = res.experts.iter().find(|e| e.tier == pb::Tier::Ram as i32).expect("an expert in RAM");
        let (off, len) = expert_gate_range(&copy, e.layer, e.expert);
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&copy).unwrap();
        let at = off + len as u64 / 2;
        let mut b = [0u8; 1];
        file.read_exact_at(&mut b, at).unwrap();
        file.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
        let r = verify(&mut c).await;
        let name = format!("expert ({}, {})", e.layer, e.expert);
        assert_eq!(r.faults.len(), 1, "one stale copy, faults: {:?}", r.faults);
        assert!(r.faults[0].contains(&name), "the fault names {name}: {:?}", r.faults);
        let o = d.ctl(&["verify"]);
        assert_eq!(o.status.code(), Some(3), "strata-ctl verify with a fault: {}", stderr(&o));
        assert!(stdout(&o).contains(&name) && stderr(&o).contains("1 tier fault"), "{}{}", stdout(&o), stderr(&o));

        file.write_all_at(&b, at).unwrap();
        let r = verify(&mut c).await;
        assert!(r.faults.is_empty(), "the byte is back, faults: {:?}", r.faults);
        let o = d.ctl(&["--json", "verify"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("verify --json");
        assert_eq!(v["faults"].as_array().map(|a| a.len()), Some(0), "{v}");
        // the file truncated under the daemon: every RAM-held expert's read fails, each a fault line (the check
        // reads the file with pread, so no mapped page faults), and the daemon serves on
        let bytes = std::fs::read(&copy).unwrap();
        file.set_len(1 << 20).unwrap();
        let r = verify(&mut c).await;
        assert_eq!(
            r.faults.len() as u32,
            r.ram_experts,
            "a fault per RAM place: {:?}",
            &r.faults[..3.min(r.faults.len())]
        );
        assert!(r.faults[0].contains("reading its bytes from the model file failed"), "{:?}", r.faults[0]);
        file.write_all_at(&bytes[1 << 20..], 1 << 20).unwrap();
        let r = verify(&mut c).await;
        assert!(r.faults.is_empty(), "the file is whole again, faults: {:?}", &r.faults[..3.min(r.faults.len())]);
        // the daemon still serves
        run_all(&mut c, &sampled_requests(1, 4)).await;
    });
    std::fs::remove_file(&copy).ok();
}

/// A dense model has no tiers: FAILED_PRECONDITION, and the daemon serves on.
#[test]
fn a_dense_model_has_no_tiers_to_check() {
    let d = Daemon::start(&["--gpu", "off"]);
    let o = d.ctl(&["verify"]);
    assert!(!o.status.success(), "verify on a dense model succeeded: {}", stdout(&o));
    assert!(stderr(&o).contains("no experts"), "{}", stderr(&o));
    let o = d.ctl(&["generate", "--max-tokens", "2", "Hello"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// On a GPU (`STRATA_GPU_VERIFY_MODEL`): each configuration serves the sampled requests with the adaptive tier
/// moving experts, then every VRAM slot of every stage and every RAM place must equal the file.
#[test]
fn gpu_tiers_equal_the_file_after_sampled_requests_with_swaps() {
    let Some(model) = std::env::var_os("STRATA_GPU_VERIFY_MODEL").map(PathBuf::from) else {
        println!("skipped: STRATA_GPU_VERIFY_MODEL is not set (a GPU run: docs/BENCHMARKS.md)");
        return;
    };
    let configs: Vec<Vec<String>> = std::env::var("STRATA_GPU_VERIFY_ARGS")
        .unwrap_or_else(|_| {
            [
                "--expert-cache {quarter} --adapt-every 2 --adapt-async 0",
                "--expert-cache {quarter} --resident-experts --adapt-every 2 --adapt-async 0",
                "--expert-cache {quarter} --resident-experts --adapt-every 2 --adapt-async 1",
                "--expert-cache {quarter} --resident-experts --adapt-every 2 --adapt-async 1 --layer-split {half} --split-device 0,0",
                "--expert-cache {quarter} --adapt-every 2 --adapt-async 1 --layer-split {half} --split-device 0,0",
            ]
            .join(";")
        })
        .split(';')
        .map(|c| c.split_whitespace().map(String::from).collect())
        .collect();
    // a quarter of the routed experts in VRAM, so that the adaptive tier swaps; the split at half the layers
    let (quarter, half) = {
        let f = GgufFile::open(&model).expect("open the model");
        let gates: Vec<u64> =
            f.tensors.iter().filter(|t| t.name.ends_with("ffn_gate_exps.weight")).map(|t| t.dims[2]).collect();
        ((gates.iter().sum::<u64>() / 4).max(1).to_string(), (gates.len() / 2).max(1).to_string())
    };
    let configs: Vec<Vec<String>> = configs
        .into_iter()
        .map(|c| c.into_iter().map(|a| a.replace("{quarter}", &quarter).replace("{half}", &half)).collect())
        .collect();
    let n = env_or("STRATA_VERIFY_REQUESTS", 32usize);
    let tokens = env_or("STRATA_VERIFY_TOKENS", 48u32);
    let reqs = sampled_requests(n, tokens);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut first: Option<Vec<String>> = None;
    for args in &configs {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let d = Daemon::start_with(&model, &temp_path(".sock"), &a);
        let t0 = Instant::now();
        rt.block_on(async {
            let mut c = d.client().await;
            let s = c.get_stats(pb::StatsRequest {}).await.unwrap().into_inner();
            let backend = s.model.map(|m| m.backend).unwrap_or_default();
            assert!(backend.contains("cuda"), "{}: the daemon runs on {backend}, not a GPU", args.join(" "));
            let answers = run_all(&mut c, &reqs).await;
            let secs = t0.elapsed().as_secs_f64();
            let st = c.get_stats(pb::StatsRequest {}).await.unwrap().into_inner().totals.unwrap_or_default();
            let r = verify(&mut c).await;
            let res = c.get_residency(pb::ResidencyRequest { layer: None, top: 1 }).await.unwrap().into_inner();
            let stages = res.layers.iter().map(|l| l.stage).max().unwrap_or(0) as usize + 1;
            let mut vram = vec![0u32; stages];
            for l in &res.layers {
                vram[l.stage as usize] += l.vram_experts;
            }
            let same = first.as_ref().map(|f| f.iter().zip(&answers).filter(|(a, b)| a == b).count());
            println!(
                "[{}] mode {}: {n} requests in {secs:.1} s, {} tokens, hits {}/{} ({:.1}%), swaps {}, promotions {}, \
                 file reads {}; VRAM experts per stage {vram:?}; check: {} RAM places, VRAM slots per stage {:?}, \
                 {} faults in {:.0} ms; answers equal to the first configuration's: {}",
                args.join(" "),
                res.mode,
                st.generated_tokens,
                st.vram_hits,
                st.expert_lookups,
                100.0 * st.vram_hits as f64 / st.expert_lookups.max(1) as f64,
                st.swaps,
                st.ram_promotions,
                st.file_blob_reads,
                r.ram_experts,
                r.vram_slots_per_stage,
                r.faults.len(),
                r.elapsed_ms,
                same.map(|s| format!("{s}/{n}")).unwrap_or_else(|| "(the first)".into())
            );
            for f in r.faults.iter().take(10) {
                println!("  fault: {f}");
            }
            assert!(r.faults.is_empty(), "{}: {} tier faults", args.join(" "), r.faults.len());
            assert_eq!(r.vram_slots_per_stage.len(), stages, "slots checked per stage: {r:?}");
            assert!(answers.iter().all(|a| !a.is_empty()), "an empty answer: {answers:?}");
            if first.is_none() {
                first = Some(answers);
            }
        });
    }
}

/// A check queued behind a running request when SIGTERM comes is answered UNAVAILABLE, not run: the shutdown is not
/// held up by reading every copy.
#[test]
fn a_check_queued_at_shutdown_is_refused() {
    let d = Daemon::start_with(&fixture_path("shared"), &temp_path(".sock"), &["--gpu", "off", "--batch", "16"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt.block_on(async {
        let mut c = d.client().await;
        let mut g = c.clone();
        // a long request: its prompt alone takes seconds in chunks of 16 on this fixture
        let long = greedy(&"The quick brown fox jumps over the lazy dog. ".repeat(40), 200);
        let running = tokio::spawn(async move {
            let mut s = g.generate(long).await?.into_inner();
            while s.message().await?.is_some() {}
            Ok::<(), tonic::Status>(())
        });
        let t0 = Instant::now();
        while !c.get_stats(pb::StatsRequest {}).await.unwrap().into_inner().busy {
            assert!(t0.elapsed().as_secs() < 30, "the request never started");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let mut v = c.clone();
        let check = tokio::spawn(async move { v.verify_tiers(pb::VerifyTiersRequest {}).await });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        d.signal(nix::sys::signal::Signal::SIGTERM);
        // the request was still running at SIGTERM (so the check was still queued behind it)
        let r = running.await.unwrap();
        assert!(
            r.as_ref().is_err_and(|e| e.message().contains("shutting down")),
            "the request ended before SIGTERM: {r:?}"
        );
        check.await.unwrap().expect_err("a check queued at shutdown must not run")
    });
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    let (st, log) = d.wait(std::time::Duration::from_secs(20));
    assert!(st.success(), "{st}: {log}");
    assert!(!log.contains("tier check"), "the check ran: {log}");
}
