//! Injected faults (issue 21, docs/RELIABILITY.md "Injected faults"): the model file truncated under a running
//! daemon, the host refusing mlock and O_DIRECT, profile saves onto a full and a read-only file system, a client
//! that never reads its stream, and SIGTERM during a prefill and while RAM adapt promotes experts.
//!
//! The host faults run the daemon in a mount and user namespace of its own (`unshare -rm`, no privilege needed
//! where unprivileged user namespaces are allowed): a ramfs (which refuses `O_DIRECT`) holds a copy of the model,
//! a 64 KiB tmpfs is filled up, another is mounted read-only, and `ulimit -l 0` refuses locking memory. The test
//! looks into that namespace through `/proc/<pid>/root`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use strata_proto::v1 as pb;
use strata_tests::*;

const PROMPT: &str = "The capital of France is";
/// A prompt the model continues for hundreds of tokens (it keeps counting).
const LONG: &str = "Counting: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,";

/// Greedy text of `n` tokens through strata-ctl, or its error output.
fn generate(d: &Daemon, prompt: &str, n: u32) -> Result<String, String> {
    let o = d.ctl(&["generate", "--max-tokens", &n.to_string(), prompt]);
    if o.status.success() {
        Ok(stdout(&o))
    } else {
        Err(stderr(&o))
    }
}

fn stats(d: &Daemon) -> serde_json::Value {
    let o = d.ctl(&["--json", "stats"]);
    assert!(o.status.success(), "stats: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("stats --json")
}

/// SIGTERM, then the exit status and the log; the exit must come within 20 s.
fn terminate(d: Daemon) -> (std::process::ExitStatus, String) {
    d.signal(Signal::SIGTERM);
    d.wait(Duration::from_secs(20))
}

fn assert_clean_log(log: &str) {
    assert!(!log.contains("panicked") && !log.contains("RUST_BACKTRACE"), "a panic: {log}");
    assert!(!log.contains(" ERROR "), "an error line: {log}");
}

/// The file tier's reads fail once the model file is truncated under the daemon: the request that needs them
/// fails with one line naming the expert and the layer, the daemon keeps serving, and when the file's bytes
/// come back (rewritten in place, as a copy over it does) the same request gives the same text again. The dense
/// weights left the mapping at the load, so no read of them faults.
#[test]
fn a_model_file_truncated_under_the_daemon_fails_requests_and_the_daemon_serves_on() {
    let orig = fixture_path("shared");
    let copy = temp_path(".gguf");
    std::fs::copy(&orig, &copy).unwrap();
    // no RAM copy: every routed expert is read from the file at each use
    let d = Daemon::start_with(&copy, &temp_path(".sock"), &["--resident-budget-gib", "0", "--gpu", "off"]);
    let before = generate(&d, PROMPT, 12).expect("the intact file serves");
    assert!(stats(&d)["totals"]["file_blob_reads"].as_u64().unwrap() > 0, "the experts come from the file");

    // cut the file after its first MiB (the header and some dense tensors): every expert blob lies past the end
    std::fs::OpenOptions::new().write(true).open(&copy).unwrap().set_len(1 << 20).unwrap();
    for prompt in [PROMPT, "Once upon a time"] {
        let e = generate(&d, prompt, 12).expect_err("a request on a truncated file must fail");
        assert!(e.contains("from the model file failed") && e.contains("of layer "), "{e}");
        assert_eq!(e.trim().lines().count(), 1, "one line: {e}");
    }
    // the daemon serves the requests that need no file read
    let s = stats(&d);
    assert_eq!(s["model"]["architecture"], "qwen2moe", "{s}");
    let o = d.ctl(&["--json", "residency"]);
    assert!(o.status.success(), "{}", stderr(&o));

    // the file's bytes back in the same inode (the daemon's descriptor reads them): the same answer as before
    std::fs::copy(&orig, &copy).unwrap();
    assert_eq!(generate(&d, PROMPT, 12).expect("the restored file serves"), before);
    let (st, log) = terminate(d);
    assert!(st.success(), "{st}: {log}");
    assert!(log.contains("of weights copied out of the file mapping"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    std::fs::remove_file(&copy).unwrap();
}

/// A daemon started in its own mount and user namespace after `setup` (a shell script; `$D` is a fresh
/// folder, the daemon's model is `$D/ram/model.gguf`, a copy of `model` on a ramfs).
fn namespaced_daemon(setup: &str, model: &Path, extra: &[&str]) -> (Daemon, PathBuf) {
    let dir = temp_path(".d");
    std::fs::create_dir(&dir).unwrap();
    let socket = temp_path(".sock");
    let script = format!(
        "set -e; D={d}; mkdir $D/ram; mount -t ramfs ramfs $D/ram; cp {m} $D/ram/model.gguf; {setup}; \
         exec \"$0\" --model $D/ram/model.gguf \"$@\"",
        d = dir.display(),
        m = model.display()
    );
    let child = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", &script])
        .arg(bin("strata-daemon"))
        .arg("--socket")
        .arg(&socket)
        .args(["--threads", "2"])
        .args(extra)
        .env("STRATA_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run unshare (util-linux) for the namespaced daemon");
    // the host must allow unprivileged user and mount namespaces (`unshare -rm true`)
    (Daemon::ready(child, &socket), dir)
}

/// `path` as the daemon (in its mount namespace) sees it.
fn inside(d: &Daemon, path: &Path) -> PathBuf {
    PathBuf::from(format!("/proc/{}/root{}", d.child.id(), path.display()))
}

/// The host refuses what the daemon asks of it, and the daemon serves on, saying so once:
/// - `ulimit -l 0`: the RAM copy stays pageable (one warning; residency says unlocked);
/// - `--file-io direct` on a ramfs, which refuses `O_DIRECT`: blob reads are buffered (one warning; the same text
///   as buffered reads give);
/// - a profile save onto a full file system (ENOSPC) and onto a read-only one (EROFS): FAILED_PRECONDITION naming
///   the cause, the profile saved there before intact, no temporary file left behind; a save elsewhere works.
#[test]
fn refused_mlock_o_direct_and_full_or_read_only_disks_leave_the_daemon_serving() {
    let probe = Command::new("unshare").args(["--user", "--map-root-user", "--mount", "true"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        // containers whose seccomp or AppArmor profile forbids user namespaces cannot run this test
        println!("SKIPPED: `unshare -rm true` failed here ({probe:?}): user and mount namespaces are not allowed");
        return;
    }
    let model = fixture_path("shared");
    // about half of the routed experts in RAM, the rest read from the file
    let budget = ["--resident-budget-gib", "0.03", "--gpu", "off"];
    let reference = {
        let d = Daemon::start_with(&model, &temp_path(".sock"), &budget);
        let t = generate(&d, PROMPT, 16).expect("reference");
        drop(d);
        t
    };
    let setup = "ulimit -l 0; mkdir $D/full $D/ro; mount -t tmpfs -o size=64k tmpfs $D/full; \
                 mount -t tmpfs -o size=64k tmpfs $D/ro; mount -o remount,ro $D/ro";
    let mut extra = budget.to_vec();
    extra.extend(["--file-io", "direct"]);
    let (d, dir) = namespaced_daemon(setup, &model, &extra);
    assert_eq!(generate(&d, PROMPT, 16).expect("serves"), reference, "buffered fallback, same bytes");
    let s = stats(&d);
    assert!(s["totals"]["file_blob_reads"].as_u64().unwrap() > 0, "{s}");
    let o = d.ctl(&["--json", "residency"]);
    let r: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("residency --json");
    assert_eq!(r["ram_locked"], false, "{r}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let (full, ro) = (dir.join("full/p.prof"), dir.join("ro/p.prof"));
    rt.block_on(async {
        let mut c = d.client().await;
        let save = |p: &Path| pb::SaveProfileRequest { path: p.display().to_string() };
        // a good profile on the small file system, then fill it to the last byte
        c.save_profile(save(&full)).await.expect("save before the disk is full");
        let good = std::fs::read(inside(&d, &full)).unwrap();
        let mut fill = std::fs::File::create(inside(&d, &dir.join("full/fill"))).unwrap();
        let chunk = vec![0u8; 4096];
        while fill.write_all(&chunk).is_ok() {}
        drop(fill);
        let e = c.save_profile(save(&full)).await.expect_err("ENOSPC");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("No space left on device"), "{}", e.message());
        assert_eq!(std::fs::read(inside(&d, &full)).unwrap(), good, "the earlier profile is intact");
        let mut names: Vec<String> = std::fs::read_dir(inside(&d, &dir.join("full")))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["fill", "p.prof"], "no temporary file left behind");

        let e = c.save_profile(save(&ro)).await.expect_err("EROFS");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("Read-only file system"), "{}", e.message());

        let ok = dir.join("ok.prof");
        c.save_profile(save(&ok)).await.expect("a save elsewhere works");
        assert!(std::fs::metadata(inside(&d, &ok)).unwrap().len() > 0);
    });
    assert_eq!(generate(&d, PROMPT, 16).expect("serves after the failed saves"), reference);
    let (st, log) = terminate(d);
    assert!(st.success(), "{st}: {log}");
    let warnings = |what: &str| log.lines().filter(|l| l.contains(" WARN ") && l.contains(what)).count();
    assert_eq!(warnings("stays pageable"), 1, "one mlock warning: {log}");
    assert!(log.contains("RLIMIT_MEMLOCK is 0 KiB"), "{log}");
    assert_eq!(warnings("refuses O_DIRECT"), 1, "one O_DIRECT warning: {log}");
    assert!(!log.contains("panicked"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client that opens a long stream and never reads it (its socket's receive buffer kept small) neither blocks
/// the engine nor makes the daemon's memory grow with it: the request runs to its end in the engine, the next
/// client's request is served right after, and the RSS stays within a few MiB.
#[test]
fn a_client_that_never_reads_does_not_block_the_engine() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = Daemon::start(&["--http-listen", &addr, "--gpu", "off"]);
    // a first request grows the engine's buffers to their working size
    generate(&d, PROMPT, 8).expect("serves");
    let s0 = stats(&d);
    let (rss0, requests0) = (s0["rss_bytes"].as_u64().unwrap(), s0["totals"]["requests"].as_u64().unwrap());

    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    {
        use std::os::fd::AsRawFd;
        let n: nix::libc::c_int = 2048;
        // SAFETY: a valid socket descriptor owned by `slow`, and a pointer to an int that lives across the call.
        let r = unsafe {
            nix::libc::setsockopt(
                slow.as_raw_fd(),
                nix::libc::SOL_SOCKET,
                nix::libc::SO_RCVBUF,
                (&n as *const nix::libc::c_int).cast(),
                std::mem::size_of::<nix::libc::c_int>() as nix::libc::socklen_t,
            )
        };
        assert_eq!(r, 0, "SO_RCVBUF: {}", std::io::Error::last_os_error());
    }
    let body = serde_json::json!({
        "model": model_path().file_stem().unwrap().to_str().unwrap(), "prompt": LONG, "max_tokens": 300, "temperature": 0, "stream": true
    })
    .to_string();
    write!(
        slow,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // wait until the slow request runs, then queue a second one behind it
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut w = d.client().await.watch_counters(pb::WatchRequest {}).await.unwrap().into_inner();
        let running = async { while !w.message().await.unwrap().expect("watch stream").running {} };
        tokio::time::timeout(Duration::from_secs(60), running).await.expect("the unread request never ran");
    });
    let t1 = Instant::now();
    let text = generate(&d, PROMPT, 8).expect("the next client is served");
    assert!(text.starts_with(" Paris"), "{text:?}");
    println!("second request done {:.1} s after it was sent", t1.elapsed().as_secs_f64());
    let s = stats(&d);
    // both requests finished in the engine: the unread one ran its 300 tokens
    assert_eq!(s["totals"]["requests"].as_u64().unwrap(), requests0 + 2, "{s}");
    assert!(s["totals"]["generated_tokens"].as_u64().unwrap() >= 308, "{s}");
    let rss1 = s["rss_bytes"].as_u64().unwrap();
    println!("RSS {:.1} → {:.1} MiB", rss0 as f64 / 1048576.0, rss1 as f64 / 1048576.0);
    assert!(rss1 < rss0 + (32 << 20), "RSS grew from {rss0} to {rss1} bytes");
    drop(slow);
    let (st, log) = terminate(d);
    assert!(st.success(), "{st}: {log}");
    assert_clean_log(&log);
}

/// Opens a counter watch on `d`, then starts a greedy request of `max_tokens` on a task of its own that reads the
/// stream to its end (its result: whether the stream ended cleanly).
async fn watch_and_generate(
    d: &Daemon,
    prompt: &str,
    max_tokens: u32,
) -> (tonic::Streaming<pb::CounterUpdate>, tokio::task::JoinHandle<Result<(), tonic::Status>>) {
    let w = d.client().await.watch_counters(pb::WatchRequest {}).await.unwrap().into_inner();
    let mut c = d.client().await;
    let req = greedy(prompt, max_tokens);
    let task = tokio::spawn(async move {
        let mut s = c.generate(req).await?.into_inner();
        while s.message().await?.is_some() {}
        Ok(())
    });
    (w, task)
}

/// SIGTERM while a long prompt's prefill runs (in 16-token chunks): the daemon stops after the chunk in flight,
/// the client's stream ends with "daemon is shutting down", and it exits 0 with a clean log.
#[test]
fn sigterm_during_a_prefill_stops_after_the_chunk_in_flight() {
    let d = Daemon::start(&["--batch", "16", "--gpu", "off"]);
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (err, at) = rt.block_on(async {
        let (mut w, task) = watch_and_generate(&d, &prompt, 4).await;
        // the prefill's progress: SIGTERM once some chunks are done and many remain
        let mid_prefill = async {
            loop {
                let u = w.message().await.unwrap().expect("watch stream");
                let k = u.counters.unwrap();
                if u.running && k.prompt_done > 32 && k.prompt_done + 64 < k.prompt_tokens {
                    break (k.prompt_done, k.prompt_tokens);
                }
            }
        };
        let at = tokio::time::timeout(Duration::from_secs(60), mid_prefill)
            .await
            .expect("no counter update showed the prefill half done");
        d.signal(Signal::SIGTERM);
        (task.await.unwrap().expect_err("the stream must end with an error"), at)
    });
    assert!(err.message().contains("daemon is shutting down"), "{err:?}");
    println!("SIGTERM at prompt token {} of {}", at.0, at.1);
    let t0 = Instant::now();
    let (st, log) = d.wait(Duration::from_secs(20));
    println!("exited {:.2} s after", t0.elapsed().as_secs_f64());
    assert!(st.success(), "{st}: {log}");
    assert!(log.contains("SIGTERM: shutting down") && log.contains("stopped"), "{log}");
    assert_clean_log(&log);
}

/// SIGTERM at random points of a decode in which RAM adapt promotes experts in most windows (64 promotions
/// allowed per window, half of the experts in RAM): the engine finishes the token and its promotions, the daemon
/// exits 0, and the profile it saves at shutdown loads in the next start.
#[test]
fn sigterm_while_ram_adapt_promotes_exits_cleanly_with_a_whole_profile() {
    let model = fixture_path("shared");
    let prof = temp_path(".prof");
    let mut seed = 0x9e37_79b9u32;
    for round in 0..3 {
        let p = prof.to_str().unwrap();
        let d = Daemon::start_with(
            &model,
            &temp_path(".sock"),
            &["--resident-budget-gib", "0.03", "--ram-adapt", "64", "--expert-profile-save", p, "--gpu", "off"],
        );
        let rt = tokio::runtime::Runtime::new().unwrap();
        let promos = rt.block_on(async {
            let (mut w, task) = watch_and_generate(&d, LONG, 400).await;
            let promoting = async {
                loop {
                    let u = w.message().await.unwrap().expect("watch stream");
                    let k = u.counters.unwrap();
                    if u.running && k.ram_promotions > 0 {
                        break k.ram_promotions;
                    }
                }
            };
            let promos = tokio::time::timeout(Duration::from_secs(60), promoting)
                .await
                .expect("no counter update showed a promotion while the request ran");
            // a random moment within the next ~200 ms
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            tokio::time::sleep(Duration::from_millis((seed % 200) as u64)).await;
            d.signal(Signal::SIGTERM);
            let r = task.await.unwrap();
            assert!(r.is_err(), "round {round}: the stream must end with an error");
            promos
        });
        let (st, log) = d.wait(Duration::from_secs(20));
        println!("round {round}: {promos}+ promotions before SIGTERM");
        assert!(st.success(), "round {round}: {st}: {log}");
        assert!(log.contains("expert profile saved"), "round {round}: {log}");
        assert_clean_log(&log);
        // the saved profile loads (a torn or partial one would be refused with a warning)
        let d = Daemon::start_with(
            &model,
            &temp_path(".sock"),
            &["--resident-budget-gib", "0.03", "--expert-profile", p, "--gpu", "off"],
        );
        let (st, log) = terminate(d);
        assert!(st.success(), "{st}: {log}");
        assert!(log.contains("expert profile loaded"), "round {round}: {log}");
    }
    std::fs::remove_file(&prof).unwrap();
}
