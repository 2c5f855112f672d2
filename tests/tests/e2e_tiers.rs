//! Expert tiers end to end on the MoE fixtures: knobs through strata-ctl while a request decodes, refused values,
//! the watch stream, residency and profile save; a replayed multi-turn conversation with a RAM budget of about
//! half the experts, with and without RAM adapt.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use strata_proto::v1 as pb;
use strata_tests::*;

/// Half of the split fixture's experts: 480 blobs of 127,872 bytes = 58.5 MiB.
const SPLIT_HALF_GIB: &str = "0.0286";

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "strata-ctl failed: {}", stderr(o));
    serde_json::from_str(stdout(o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

#[test]
fn knobs_watch_residency_and_profile_through_strata_ctl() {
    let d = Daemon::start_with(
        &fixture_path("split"),
        &temp_path(".sock"),
        &["--resident-budget-gib", SPLIT_HALF_GIB, "--adapt-every", "1"],
    );
    // a watcher, started before the request
    let mut watch = Command::new(bin("strata-ctl"))
        .arg("--socket")
        .arg(&d.socket)
        .args(["--json", "watch", "--count", "1"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let sock = d.socket.clone();
    let gen = std::thread::spawn(move || {
        Command::new(bin("strata-ctl"))
            .arg("--socket")
            .arg(&sock)
            .args(["--json", "generate", "--max-tokens", "200", "--chat", "Write a long story about a dragon."])
            .output()
            .unwrap()
    });
    // wait until the request decodes (the watch shows it running), then turn RAM adapt on
    let mut updates: Vec<serde_json::Value> = Vec::new();
    let mut set_at = None;
    let t0 = Instant::now();
    for line in lines {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        let running = v["running"].as_bool().unwrap();
        let gen_tokens = v["counters"]["generated_tokens"].as_u64().unwrap();
        if running && gen_tokens >= 8 && set_at.is_none() {
            assert_eq!(v["counters"]["ram_promotions"], 0, "RAM adapt is off at start");
            let o = d.ctl(&["set", "ram-adapt", "8"]);
            assert!(o.status.success(), "{}", stderr(&o));
            assert!(stdout(&o).contains("ram_adapt: 0 -> 8"), "{}", stdout(&o));
            set_at = Some(gen_tokens);
            // a knob of named choices reads and writes by name
            let o = d.ctl(&["set", "adapt-policy", "seed"]);
            assert!(stdout(&o).contains("adapt_policy: lrfu -> seed"), "{}", stdout(&o));
            let o = d.ctl(&["get", "adapt-policy"]);
            assert!(stdout(&o).split_whitespace().nth(1) == Some("seed"), "{}", stdout(&o));
            // bad values are refused and change nothing
            for (k, v) in [("ram-adapt", "-1"), ("adapt-decay", "2"), ("ram-adapt", "x"), ("no-such-knob", "1")] {
                let o = d.ctl(&["set", k, v]);
                assert_eq!(o.status.code(), Some(1), "set {k} {v}: {}", stdout(&o));
                assert!(stderr(&o).contains("InvalidArgument"), "{}", stderr(&o));
            }
        }
        updates.push(v);
        if !running {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(300));
    }
    let out = gen.join().unwrap();
    let done = json(&out);
    assert!(watch.wait().unwrap().success());
    let set_at = set_at.expect("the watch never showed the request decoding");
    let c = &done["counters"];
    assert!(c["generated_tokens"].as_u64().unwrap() > set_at, "the request ended before the knob was set");
    assert!(c["ram_promotions"].as_u64().unwrap() > 0, "ram-adapt 8 set mid-request took no effect: {c}");
    // the watch showed the counters moving while the request ran, then the final counters
    let running: Vec<u64> = updates
        .iter()
        .filter(|u| u["running"] == true)
        .map(|u| u["counters"]["generated_tokens"].as_u64().unwrap())
        .collect();
    assert!(running.len() >= 3 && running.windows(2).all(|w| w[0] <= w[1]) && running.last() > running.first());
    let last = updates.last().unwrap();
    assert_eq!(last["running"], false);
    assert_eq!(last["counters"]["generated_tokens"], c["generated_tokens"]);
    // knobs keep their values
    let k = json(&d.ctl(&["--json", "get"]));
    let val = |n: &str| k.as_array().unwrap().iter().find(|x| x["name"] == n).unwrap()["value"].as_f64().unwrap();
    assert_eq!((val("ram_adapt"), val("adapt_decay")), (8.0, 0.7));
    assert!(k.as_array().unwrap().iter().any(|x| x["name"] == "adapt_swaps" && x["active"] == false));
    // residency: 30 layers, every expert in exactly one tier, about half in RAM
    let r = json(&d.ctl(&["--json", "residency", "--top", "5"]));
    assert_eq!(r["mode"], "budget");
    let layers = r["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 30);
    let ram: u64 = layers.iter().map(|l| l["ram_experts"].as_u64().unwrap()).sum();
    assert!(layers.iter().all(|l| l["ram_experts"].as_u64().unwrap() + l["file_experts"].as_u64().unwrap() == 16));
    assert!((200..=280).contains(&ram), "{ram} experts in RAM");
    assert_eq!(r["experts"].as_array().unwrap().len(), 5);
    let o = d.ctl(&["residency", "--layer", "99"]);
    assert_eq!(o.status.code(), Some(1));
    // stats show the tier totals
    let s = json(&d.ctl(&["--json", "stats"]));
    assert_eq!(s["totals"]["ram_promotions"], c["ram_promotions"]);
    assert!(s["totals"]["file_blob_reads"].as_u64().unwrap() > 0);
    // profile save to a given path; without a path and no --expert-profile-save it is refused
    let p = temp_path(".prof");
    let o = json(&d.ctl(&["--json", "profile", "save", p.to_str().unwrap()]));
    assert_eq!(o["ranked"], 480);
    assert!(std::fs::metadata(&p).unwrap().len() > 480 * 8);
    assert_eq!(d.ctl(&["profile", "save"]).status.code(), Some(1));
    // the daemon restarted with that profile starts with the same RAM copy as the profile's top ranks
    drop(d);
    let d2 = Daemon::start_with(
        &fixture_path("split"),
        &temp_path(".sock"),
        &["--resident-budget-gib", SPLIT_HALF_GIB, "--expert-profile", p.to_str().unwrap()],
    );
    let r2 = json(&d2.ctl(&["--json", "residency", "--top", "0"]));
    let ram2: u64 = r2["layers"].as_array().unwrap().iter().map(|l| l["ram_experts"].as_u64().unwrap()).sum();
    assert_eq!(ram2, ram);
    drop(d2);
    // a torn profile: warning, default placement, the daemon starts
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let d3 =
        Daemon::start_with(&fixture_path("split"), &temp_path(".sock"), &["--expert-profile", p.to_str().unwrap()]);
    assert!(d3.ctl(&["stats"]).status.success());
    d3.signal(nix::sys::signal::Signal::SIGTERM);
    let (st, err) = d3.wait(Duration::from_secs(30));
    assert!(st.success());
    assert!(err.contains("not a valid expert profile") && err.contains("default placement"), "{err}");
    std::fs::remove_file(&p).unwrap();
}

/// [`replay_chats`] on a fresh client of `d`.
async fn replay(d: &Daemon, turns: usize, max_tokens: u32) -> (Vec<String>, Vec<pb::RequestCounters>) {
    replay_chats(&mut d.client().await, turns, max_tokens).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ram_adapt_halves_blob_reads_on_a_replayed_conversation() {
    let mut arms = Vec::new();
    for ram_adapt in ["0", "8"] {
        let d = Daemon::start_with(
            &fixture_path("exact"),
            &temp_path(".sock"),
            &["--resident-budget-gib", "0.37", "--ram-adapt", ram_adapt],
        );
        let (answers, counters) = replay(&d, 22, 12).await;
        let sum = |f: fn(&pb::RequestCounters) -> u64| counters.iter().map(f).sum::<u64>();
        let generated = sum(|c| c.generated_tokens as u64);
        let reads = sum(|c| c.file_blob_reads);
        let promos = sum(|c| c.ram_promotions);
        let bytes = sum(|c| c.promotion_bytes);
        println!(
            "ram-adapt {ram_adapt}: {} requests, {generated} tokens, {reads} blob reads ({:.2} per token), {promos} promotions",
            counters.len(),
            reads as f64 / generated as f64
        );
        arms.push((answers, generated, reads, promos, bytes));
    }
    let (off, on) = (&arms[0], &arms[1]);
    assert!(off.0.len() >= 20);
    // RAM adapt never changes the output: the CPU computes from the same bytes
    assert_eq!(off.0, on.0);
    assert_eq!(off.3, 0);
    assert!(on.3 > 0);
    // every promotion read one blob (1,658,880 bytes in the exact fixture)
    assert_eq!(on.4, on.3 * 1_658_880);
    let (per_off, per_on) = (off.2 as f64 / off.1 as f64, on.2 as f64 / on.1 as f64);
    assert!(per_on <= per_off / 2.0, "blob reads per token {per_on:.2} with RAM adapt vs {per_off:.2} without");
}

/// Off = baseline: the greedy answers have the SHA-256 they had before the expert store existed
/// (tests/data/greedy_baseline_moe_exact.json, recorded with the binaries of commit 3945f69), with RAM adapt off,
/// and also with RAM adapt on, a RAM budget, direct file reads, or no RAM copy at all. 3945f69 had only the AVX2
/// kernels, so that comparison runs with `STRATA_SIMD=avx2` (the AVX-512 ones sum the same integers in another
/// order, which can flip a greedy pick); with the machine's own kernels every mode must then give the answers of
/// the first.
#[test]
fn greedy_answers_match_the_pre_store_baseline_in_every_mode() {
    use sha2::Digest;
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/greedy_baseline_moe_exact.json");
    let base: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    let sys = base["system"].as_str().unwrap();
    let max = base["max_tokens"].to_string();
    let modes: [&[&str]; 3] = [
        &["--ram-adapt", "0"],
        &["--resident-budget-gib", "0.37", "--ram-adapt", "8", "--file-io", "direct"],
        &["--mmap-experts"],
    ];
    let answers = |extra: &[&str], env: &[(&str, &str)]| {
        let d = Daemon::start_env(&fixture_path("exact"), &temp_path(".sock"), extra, env);
        base["answers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let prompt = a["prompt"].as_str().unwrap();
                let o = json(&d.ctl(&["--json", "generate", "--chat", "--system", sys, "--max-tokens", &max, prompt]));
                o["text"].as_str().unwrap().to_string()
            })
            .collect::<Vec<String>>()
    };
    for extra in modes {
        for (a, text) in base["answers"].as_array().unwrap().iter().zip(answers(extra, &[("STRATA_SIMD", "avx2")])) {
            let sha = format!("{:x}", sha2::Sha256::digest(text.as_bytes()));
            assert_eq!(sha, a["sha256"].as_str().unwrap(), "{extra:?} {:?}: {text:?}", a["prompt"]);
        }
    }
    let own = answers(modes[0], &[]);
    for extra in &modes[1..] {
        assert_eq!(answers(extra, &[]), own, "{extra:?} with this machine's kernels");
    }
}

/// SIGTERM ends an open `watch` stream (UNAVAILABLE) instead of waiting for it: the daemon exits promptly and the
/// watcher exits with an error.
#[test]
fn sigterm_ends_an_open_watch_stream() {
    let d = Daemon::start(&[]);
    let mut watch = Command::new(bin("strata-ctl"))
        .arg("--socket")
        .arg(&d.socket)
        .arg("watch")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    d.signal(nix::sys::signal::Signal::SIGTERM);
    let (st, _) = d.wait(Duration::from_secs(10));
    assert!(st.success());
    let t0 = Instant::now();
    while watch.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(10), "watch did not end");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!watch.wait().unwrap().success());
}

/// The number before `label` on the plan's line that starts with `line` (e.g. "480 experts").
fn plan_figure(plan: &str, line: &str, label: &str) -> u64 {
    let l = plan.lines().find(|l| l.starts_with(line)).unwrap_or_else(|| panic!("no {line:?} line in {plan}"));
    let at = l.find(label).unwrap_or_else(|| panic!("no {label:?} in {l}"));
    l[..at].trim_end().rsplit(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

#[test]
fn plan_matches_what_the_daemon_allocates() {
    let model = fixture_path("split");
    for extra in [&["--resident-budget-gib", SPLIT_HALF_GIB][..], &[][..], &["--mmap-experts"][..]] {
        let mut args = vec!["--plan", "--gpu", "off", "--model", model.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = run_daemon(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let plan = stdout(&o);
        assert!(plan.starts_with("placement plan for ") && plan.contains("16 experts per layer, top-"), "{plan}");
        let (in_ram, in_file) =
            (plan_figure(&plan, "RAM copy", " experts"), plan_figure(&plan, "file tier", " experts"));
        assert_eq!(in_ram + in_file, 480, "{plan}");
        // the daemon with the same flags places exactly that, and says so
        let mut flags = vec!["--gpu", "off"];
        flags.extend_from_slice(extra);
        let d = Daemon::start_with(&model, &temp_path(".sock"), &flags);
        let r = json(&d.ctl(&["--json", "residency"]));
        let layers = r["layers"].as_array().unwrap();
        let sum = |k: &str| layers.iter().map(|l| l[k].as_u64().unwrap()).sum::<u64>();
        assert_eq!((sum("ram_experts"), sum("file_experts")), (in_ram, in_file), "{plan}");
        d.signal(nix::sys::signal::Signal::SIGTERM);
        let (_, log) = d.wait(Duration::from_secs(10));
        assert!(log.contains("placement as planned: 0 VRAM slots"), "{log}");
        assert!(log.contains("  per decode token at a full context (expected)"), "the plan block is logged: {log}");
    }
    // the plan opens no socket and loads nothing: it runs beside a live daemon on the same socket
    let d = Daemon::start_with(&model, &temp_path(".sock"), &["--gpu", "off", "--mmap-experts"]);
    let o = run_daemon(&["--plan", "--model", model.to_str().unwrap(), "--socket", d.socket.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn counters_split_file_reads_knobs_say_why_and_top_limits_layers() {
    let d = Daemon::start_with(
        &fixture_path("split"),
        &temp_path(".sock"),
        &["--gpu", "off", "--resident-budget-gib", SPLIT_HALF_GIB],
    );
    let o = d.ctl(&["generate", "--max-tokens", "1", "The capital of France is"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = stderr(&o);
    assert!(line.contains("generated 1 token in ") && line.contains("finish: length"), "{line}");
    // one generated token: no decode window, so every file read of this request was the prefill's
    let v = json(&d.ctl(&["--json", "stats"]));
    let t = &v["totals"];
    let (all, prefill) = (t["file_bytes_read"].as_u64().unwrap(), t["prefill_file_bytes_read"].as_u64().unwrap());
    assert!(prefill > 0 && prefill == all, "{t}");
    assert_eq!(prefill, t["prefill_file_blob_reads"].as_u64().unwrap() * 127_872, "{t}");
    // the GPU tiers' counters (/metrics' strata_swaps_total, ...) reach the client too: 0 on a CPU daemon, since
    // start and per request
    for k in ["swaps", "pcie_entries", "prefetched", "prefetch_hits", "prefetch_wasted_bytes"] {
        assert_eq!(t[k].as_u64(), Some(0), "totals.{k}: {t}");
        assert_eq!(v["last_request"][k].as_u64(), Some(0), "last_request.{k}: {v}");
    }
    assert!(line.contains(" VRAM hits (0.0%), 0 swaps into VRAM, ") && !line.contains("GPU:"), "{line}");
    let s = stdout(&d.ctl(&["stats"]));
    assert!(s.contains("decode       1 token in ") && s.contains(", 0 windows"), "{s}");
    assert!(s.contains(&format!("prefill: {} file blob reads (", t["prefill_file_blob_reads"])), "{s}");
    assert!(s.contains(" 0 VRAM hits, 0 swaps into VRAM, ") && !s.contains("GPU:"), "{s}");
    // a GPU knob on a CPU daemon says why it does not act
    let o = d.ctl(&["set", "adapt-swaps", "5"]);
    assert!(
        stdout(&o).contains("(inactive: no VRAM expert cache (GPU off (--gpu off): running on the CPU))"),
        "{}",
        stdout(&o)
    );
    let k = json(&d.ctl(&["--json", "get", "vram_reserve_mib"]));
    assert!(k[0]["inactive_reason"].as_str().unwrap().contains("read once"), "{k}");
    // --top N: N layer rows (most bytes outside VRAM) and the totals row
    let r = stdout(&d.ctl(&["residency", "--top", "3"]));
    let rows: Vec<&str> =
        r.lines().skip_while(|l| !l.starts_with("layer")).skip(1).take_while(|l| !l.is_empty()).collect();
    assert_eq!(rows.len(), 4, "{r}");
    assert!(rows[3].trim_start().starts_with("all") && rows[3].contains("(3 of 30 layers shown"), "{r}");
    let r = stdout(&d.ctl(&["residency"]));
    assert!(
        r.lines().filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit())).count() >= 30,
        "{r}"
    );
}
