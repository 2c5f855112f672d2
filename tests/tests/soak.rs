//! Soak (issue 21, docs/RELIABILITY.md "Soak"): the fixed multi-turn conversations replayed back to back against
//! one daemon on the real-weights MoE fixture, with 251 of its 360 routed experts in RAM, the rest read
//! from the file, and RAM adapt moving experts between them, for `STRATA_SOAK_MINUTES` (default 1: the CI run;
//! `tools/soak` runs 60). Checked: every cycle gives the first cycle's answers byte for byte (greedy on the CPU: the
//! same input must give the same text however the tiers moved; see `STRATA_SOAK_EXACT` for a GPU), the daemon's RSS (sampled every minute, every 10 s
//! in runs under 10 minutes) drifts under 1% after the warm-up (the first cycle, and at least the first fifth of
//! the run), its VRAM (on a GPU, as `nvidia-smi` reports the process's) grows under 1% after the warm-up, its log
//! holds no error line and no panic, and at the end every tier copy equals the file's bytes (`VerifyTiers`).
//!
//! Environment: `STRATA_SOAK_MINUTES`; `STRATA_SOAK_MODEL` (default the `smollm2-moe-shared` fixture) and
//! `STRATA_SOAK_ARGS` (the daemon's tier flags, whitespace-separated; default `--resident-budget-gib 0.03
//! --ram-adapt 8 --gpu off`) to soak another model or configuration, e.g. a GPU's adaptive tier; `STRATA_SOAK_TURNS`
//! (user turns per cycle, default all), `STRATA_SOAK_TOKENS` (tokens per answer, default 32) and
//! `STRATA_SOAK_THREADS` (the daemon's `--threads`, default 2); `STRATA_SOAK_EXACT=0` counts changed answers
//! instead of failing on the first (a GPU's adaptive tier moves an expert between the GPU's and the CPU's
//! arithmetic, whose roundings differ, so a near-tie between two tokens may fall the other way).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use strata_proto::v1 as pb;
use strata_tests::*;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
        Err(_) => default,
    }
}

/// The process's VRAM in MiB as `nvidia-smi` lists it, or `None` (no nvidia-smi, or the process not listed).
fn vram_mib(pid: u32) -> Option<u64> {
    let o = Command::new("nvidia-smi")
        .args(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
        let (p, m) = l.split_once(',')?;
        (p.trim().parse::<u32>().ok()? == pid).then(|| m.trim().parse().ok()).flatten()
    })
}

/// The daemon's resident set (VmRSS of /proc/PID/status), bytes.
fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the daemon's /proc status");
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib * 1024
}

#[test]
fn soak_replays_conversations_with_stable_answers_and_memory() {
    let minutes: f64 = env_or("STRATA_SOAK_MINUTES", 1.0);
    let turns: usize = env_or("STRATA_SOAK_TURNS", usize::MAX);
    let max_tokens: u32 = env_or("STRATA_SOAK_TOKENS", 32);
    let exact = env_or("STRATA_SOAK_EXACT", 1u8) != 0;
    let model = std::env::var_os("STRATA_SOAK_MODEL").map(PathBuf::from).unwrap_or_else(|| fixture_path("shared"));
    let args: Vec<String> = std::env::var("STRATA_SOAK_ARGS")
        .unwrap_or_else(|_| "--resident-budget-gib 0.03 --ram-adapt 8 --gpu off".into())
        .split_whitespace()
        .map(String::from)
        .collect();
    let run = Duration::from_secs_f64(minutes * 60.0);
    let every = Duration::from_secs(if minutes >= 10.0 { 60 } else { 10 });
    let warm_up = run / 5;

    // the log goes to a file: a pipe nobody reads for an hour would fill and block the daemon
    let log_path = temp_path(".log");
    let socket = temp_path(".sock");
    let child = Command::new(bin("strata-daemon"))
        .arg("--model")
        .arg(&model)
        .arg("--socket")
        .arg(&socket)
        .args(["--threads", &env_or("STRATA_SOAK_THREADS", 2usize).to_string()])
        .args(&args)
        .env("STRATA_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .expect("spawn strata-daemon");
    let d = Daemon::ready(child, &socket);
    let pid = d.child.id();
    println!(
        "soak: {} with {}, {minutes} min, RSS every {} s, warm-up {} s; CPU {}",
        model.display(),
        args.join(" "),
        every.as_secs(),
        warm_up.as_secs(),
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| c.lines().find_map(|l| l.strip_prefix("model name\t: ").map(String::from)))
            .unwrap_or_default()
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    let t0 = Instant::now();
    // (seconds since the start, RSS bytes)
    let mut samples: Vec<(f64, u64)> = vec![(0.0, rss(pid))];
    // (seconds since the start, VRAM MiB) where nvidia-smi lists the daemon
    let mut vram: Vec<(f64, u64)> = Vec::new();
    let (mut first, mut cycles, mut tokens, mut changed, mut compared) = (None, 0u64, 0u64, 0u64, 0u64);
    rt.block_on(async {
        let mut c = d.client().await;
        // at least two cycles, so that answers are compared however slow the host
        while t0.elapsed() < run || cycles < 2 {
            let (answers, counters) = replay_chats(&mut c, turns, max_tokens).await;
            cycles += 1;
            tokens += counters.iter().map(|k| k.generated_tokens as u64).sum::<u64>();
            match &first {
                None => {
                    assert!(answers.iter().any(|a| !a.trim().is_empty()), "every answer empty: {answers:?}");
                    first = Some(answers);
                }
                Some(f) => {
                    for (i, (a, b)) in f.iter().zip(&answers).enumerate() {
                        if exact {
                            assert_eq!(a, b, "cycle {cycles}, turn {i}: the answer changed");
                        }
                        compared += 1;
                        changed += (a != b) as u64;
                    }
                    assert!(answers.iter().any(|a| !a.trim().is_empty()), "cycle {cycles}: every answer empty");
                }
            }
            // a sample after the first cycle (the warm-up ends no earlier), then every `every`
            if cycles == 1 || t0.elapsed().as_secs_f64() >= samples.last().unwrap().0 + every.as_secs_f64() {
                let s = c.get_stats(pb::StatsRequest {}).await.unwrap().into_inner();
                let tot = s.totals.unwrap_or_default();
                let r = rss(pid);
                samples.push((t0.elapsed().as_secs_f64(), r));
                let v = vram_mib(pid);
                if let Some(v) = v {
                    vram.push((t0.elapsed().as_secs_f64(), v));
                }
                println!(
                    "{:7.1} s: RSS {:8.1} MiB{}, {cycles} cycles, {} requests, {tokens} tokens, {} promotions, {} blob \
                     reads, {} swaps, {}/{} VRAM hits{}",
                    t0.elapsed().as_secs_f64(),
                    r as f64 / 1048576.0,
                    v.map(|v| format!(", VRAM {v} MiB")).unwrap_or_default(),
                    tot.requests,
                    tot.ram_promotions,
                    tot.file_blob_reads,
                    tot.swaps,
                    tot.vram_hits,
                    tot.expert_lookups,
                    if exact { String::new() } else { format!(", {changed} of {compared} answers changed") }
                );
            }
        }
    });
    let elapsed = t0.elapsed().as_secs_f64();
    samples.push((elapsed, rss(pid)));
    // after the last RSS sample: the check reads every mapped expert page, which then counts in the RSS
    let check = rt.block_on(async {
        let mut c = d.client().await;
        c.verify_tiers(pb::VerifyTiersRequest {}).await.expect("VerifyTiers").into_inner()
    });
    println!(
        "soak: tier check at the end: {} RAM places, VRAM slots per stage {:?}, {} faults",
        check.ram_experts,
        check.vram_slots_per_stage,
        check.faults.len()
    );
    assert!(check.faults.is_empty(), "tier faults after the soak: {:?}", check.faults);
    d.signal(Signal::SIGTERM);
    let (st, _) = d.wait(Duration::from_secs(30));
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(st.success(), "{st}: {log}");
    let bad: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ") || l.contains("panicked")).collect();
    assert!(bad.is_empty(), "error lines in the log: {bad:?}");

    // the RSS after the warm-up against the sample that ends it: the first taken after the first cycle and at
    // least `warm_up` into the run
    let base = samples[1..].iter().find(|s| s.0 >= warm_up.as_secs_f64()).copied().unwrap_or(samples[1]);
    let after: Vec<u64> = samples.iter().filter(|s| s.0 > base.0).map(|s| s.1).collect();
    let top = after.iter().copied().max().unwrap_or(base.1);
    let drift = (top as f64 - base.1 as f64) / base.1 as f64;
    let end = samples.last().unwrap().1;
    println!(
        "soak: {elapsed:.0} s, {cycles} cycles, {tokens} tokens ({:.1} tok/s); RSS {:.1} MiB after the warm-up, at most \
         {:.1} after it (drift {:+.2}%), {:.1} at the end; {} log lines, none an error",
        tokens as f64 / elapsed,
        base.1 as f64 / 1048576.0,
        top as f64 / 1048576.0,
        drift * 100.0,
        end as f64 / 1048576.0,
        log.lines().count()
    );
    assert!(drift < 0.01, "RSS drifted {:.2}% after the warm-up: {samples:?}", drift * 100.0);
    if let Some(vbase) = vram.iter().find(|s| s.0 >= base.0).or(vram.first()) {
        let vtop = vram.iter().filter(|s| s.0 >= vbase.0).map(|s| s.1).max().unwrap_or(vbase.1);
        println!("soak: VRAM {} MiB after the warm-up, at most {vtop} after it", vbase.1);
        assert!((vtop as f64) <= vbase.1 as f64 * 1.01, "VRAM grew after the warm-up: {vram:?}");
    }
    if !exact {
        println!("soak: {changed} of {compared} answers differed from the first cycle's");
    }
    std::fs::remove_file(&log_path).ok();
}
