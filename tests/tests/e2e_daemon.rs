//! End to end: the built daemon with the real SmolLM2 model on a temporary
//! Unix socket, driven by strata-ctl and by a Rust gRPC client.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use nix::sys::signal::Signal;
use strata_proto::v1 as pb;
use strata_tests::*;

/// A prompt the model continues for hundreds of tokens (it keeps counting).
const LONG: &str = "Counting: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,";

#[test]
fn ctl_generate_stats_and_bad_requests() {
    let d = Daemon::start(&[]);
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "socket mode {mode:o}");

    let o = d.ctl(&["generate", "--max-tokens", "8", "The capital of France is"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with(" Paris"), "got {:?}", stdout(&o));
    assert!(stderr(&o).contains("prompt 5 tokens"), "counters missing: {}", stderr(&o));

    let o = d.ctl(&[
        "generate",
        "--chat",
        "--system",
        "Answer in one short sentence.",
        "--max-tokens",
        "40",
        "What is the capital of France?",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Paris"), "got {:?}", stdout(&o));

    // JSON output of generate and stats.
    let o = d.ctl(&["--json", "generate", "--max-tokens", "4", "The capital of France is"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("generate --json");
    assert!(v["text"].as_str().unwrap().starts_with(" Paris"));
    assert_eq!(v["counters"]["generated_tokens"], 4);
    assert_eq!(v["counters"]["finish_reason"], "length");
    let o = d.ctl(&["--json", "stats"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("stats --json");
    assert_eq!(v["model"]["architecture"], "llama");
    assert_eq!(v["model"]["n_layers"], 30);
    assert!(v["totals"]["requests"].as_u64().unwrap() >= 3);
    assert!(v["rss_bytes"].as_u64().unwrap() > 0);
    let o = d.ctl(&["stats"]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("30 layers") && stdout(&o).contains("decode"), "{}", stdout(&o));

    // Bad requests: INVALID_ARGUMENT with a message, exit code 1, daemon keeps serving.
    for (args, needle) in [
        (vec!["generate", ""], "prompt is empty"),
        (vec!["generate", "--max-tokens", "0", "hi"], "max_tokens"),
        (vec!["generate", "--max-tokens", "1000000", "hi"], "max_tokens"),
        (vec!["generate", "--temperature", "-1", "hi"], "temperature"),
        (vec!["generate", "--top-p", "0", "hi"], "top_p"),
        (vec!["generate", "--top-p", "1.5", "hi"], "top_p"),
        (vec!["generate", "--min-p", "1", "hi"], "min_p"),
    ] {
        let o = d.ctl(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("InvalidArgument") && e.contains(needle), "{args:?}: {e}");
    }
    let o = d.ctl(&["generate", "--max-tokens", "3", "The capital of France is"]);
    assert!(stdout(&o).starts_with(" Paris"));
    let o = d.ctl(&["--json", "stats"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["totals"]["rejected"], 7);
}

#[test]
fn unreachable_socket_is_exit_2() {
    let o = std::process::Command::new(bin("strata-ctl"))
        .args(["--socket", "/nonexistent/strata.sock", "stats"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    assert!(e.contains("cannot reach strata-daemon"), "{e}");
}

#[test]
fn two_clients_at_once_and_finish_reasons() {
    let d = Daemon::start(&["--ctx", "64"]);
    let s = d.socket.clone();
    let run = move |p: &'static str| {
        let s = s.clone();
        std::thread::spawn(move || {
            std::process::Command::new(bin("strata-ctl"))
                .arg("--socket")
                .arg(&s)
                .args(["--json", "generate", "--max-tokens", "24", p])
                .output()
                .unwrap()
        })
    };
    let a = run("Once upon a time");
    let b = run("The three primary colors are");
    for h in [a, b] {
        let o = h.join().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        let c = &v["counters"];
        assert!(c["generated_tokens"].as_u64().unwrap() >= 1);
        assert!(matches!(c["finish_reason"].as_str().unwrap(), "length" | "eos"));
    }
    // One of the two waited in the queue.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        // Stop string: the text ends before it.
        let mut req = greedy("The capital of France is", 20);
        req.stop = vec![".".into()];
        let done = collect(&mut c, req).await;
        assert_eq!(done.text, " Paris");
        assert_eq!(done.counters.unwrap().finish_reason, pb::FinishReason::StopString as i32);
        // Context limit: 64 positions, the prompt takes 5.
        let done = collect(&mut c, greedy("The capital of France is", 64)).await;
        let cn = done.counters.unwrap();
        assert_eq!(cn.finish_reason, pb::FinishReason::Context as i32, "{cn:?}");
        // The last token is sampled from logits over all 64 positions; it needs no KV slot.
        assert_eq!(cn.prompt_tokens + cn.generated_tokens, 65);
    });
}

async fn collect(
    c: &mut pb::strata_client::StrataClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
) -> pb::Done {
    let mut s = c.generate(req).await.expect("generate").into_inner();
    let mut text = String::new();
    while let Some(ev) = s.message().await.expect("stream") {
        match ev.event.unwrap() {
            pb::generate_event::Event::Token(t) => text.push_str(&t.text),
            pb::generate_event::Event::Done(d) => {
                assert_eq!(format!("{text}{}", d.tail), d.text, "streamed pieces must add up to the text");
                assert!(s.message().await.unwrap().is_none(), "Done must be last");
                return d;
            }
        }
    }
    panic!("stream ended without Done");
}

#[test]
fn disconnect_cancels_and_next_request_works() {
    let d = Daemon::start(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        let mut s = c.generate(greedy(LONG, 400)).await.unwrap().into_inner();
        for _ in 0..3 {
            s.message().await.unwrap().unwrap();
        }
        drop(s);
        let t0 = std::time::Instant::now();
        loop {
            let st = c.get_stats(pb::StatsRequest {}).await.unwrap().into_inner();
            if st.totals.unwrap().cancelled >= 1 {
                let last = st.last_request.unwrap();
                assert!(last.generated_tokens < 400, "{last:?}");
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "cancellation not seen");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let done = collect(&mut c, greedy("The capital of France is", 4)).await;
        assert!(done.text.starts_with(" Paris"), "{:?}", done.text);
    });
}

#[test]
fn sigterm_ends_stream_with_error_and_exits_0() {
    let d = Daemon::start(&[]);
    let socket = d.socket.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt.block_on(async {
        let mut c = d.client().await;
        let mut s = c.generate(greedy(LONG, 400)).await.unwrap().into_inner();
        s.message().await.unwrap().unwrap();
        d.signal(Signal::SIGTERM);
        loop {
            match s.message().await {
                Ok(Some(ev)) => {
                    assert!(!matches!(ev.event, Some(pb::generate_event::Event::Done(_))), "request must not complete")
                }
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        }
    });
    let e = err.expect("stream must end with an error status");
    assert!(e.message().contains("shutting down"), "{e:?}");
    let (st, log) = d.wait(Duration::from_secs(20));
    assert_eq!(st.code(), Some(0), "{log}");
    assert!(!socket.exists(), "socket must be removed");
}

#[test]
fn stale_socket_replaced_live_socket_refused() {
    let sock = temp_path(".sock");
    // A socket file nobody listens on (bound, then the listener dropped).
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let d = Daemon::start_with(&model_path(), &sock, &[]);
    // A second daemon on the same (live) socket must refuse and leave it alone.
    let o = run_daemon(&["--model", model_path().to_str().unwrap(), "--socket", sock.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("another daemon is listening"), "{}", stderr(&o));
    let o = d.ctl(&["generate", "--max-tokens", "2", "The capital of France is"]);
    assert!(stdout(&o).starts_with(" Paris"), "first daemon must still serve: {}", stderr(&o));
    // A regular file at the socket path is never deleted.
    let f = temp_path(".sock");
    std::fs::write(&f, b"keep me").unwrap();
    let o = run_daemon(&["--model", model_path().to_str().unwrap(), "--socket", f.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a socket"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&f).unwrap(), b"keep me");
    std::fs::remove_file(&f).unwrap();
}

/// `--kv-type q8_0` serves (the answer of the f16 cache on a short greedy prompt, and a repeated prompt from the
/// cached prefix) and logs its cache type; an unknown type is refused before the model loads, in one line naming
/// the accepted ones.
#[test]
fn kv_type_q8_0_serves_and_an_unknown_type_is_refused() {
    // the CPU backend (the GPU's Q8_0 cache is checked by gpu-check on a GPU host)
    let d = Daemon::start(&["--kv-type", "q8_0", "--gpu", "off"]);
    let o = d.ctl(&["generate", "--max-tokens", "8", "The capital of France is"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with(" Paris"), "got {:?}", stdout(&o));
    // the same prompt again reuses the cached prefix; the line says how many tokens the prompt rate counts
    let o = d.ctl(&["generate", "--max-tokens", "2", "The capital of France is"]);
    assert!(stderr(&o).contains("prompt 5 tokens (4 reused; 1 computed in "), "{}", stderr(&o));
    // stats say the cache's type, as text and as JSON
    let o = d.ctl(&["stats"]);
    assert!(stdout(&o).contains("q8_0 KV cache"), "{}", stdout(&o));
    let o = d.ctl(&["--json", "stats"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("stats --json");
    assert_eq!(v["model"]["kv_type"], "q8_0", "{v}");
    d.signal(Signal::SIGTERM);
    let (_, log) = d.wait(Duration::from_secs(10));
    assert!(log.contains("kv_type=\"q8_0\""), "{log}");
    let sock = temp_path(".sock");
    let o = run_daemon(&[
        "--model",
        model_path().to_str().unwrap(),
        "--socket",
        sock.to_str().unwrap(),
        "--kv-type",
        "q4_0",
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("unknown KV cache type \"q4_0\" (f16 or q8_0)"), "{e}");
}

#[test]
fn config_file_sets_flags_and_the_command_line_wins() {
    // the file sets the context, the KV cache type and the thread count; the command line gives --threads 2
    let cfg = temp_path(".toml");
    std::fs::write(&cfg, "ctx = 320\nkv_type = \"q8_0\"\nthreads = 1\ngpu = \"off\"\n").unwrap();
    let d = Daemon::start(&["--config", cfg.to_str().unwrap()]);
    let o = d.ctl(&["--json", "stats"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("stats --json");
    assert_eq!(v["model"]["n_ctx"], 320, "{v}");
    assert_eq!(v["model"]["kv_type"], "q8_0", "{v}");
    assert_eq!(v["model"]["threads"], 2, "--threads on the command line wins: {v}");
    d.signal(Signal::SIGTERM);
    let (_, log) = d.wait(Duration::from_secs(10));
    assert!(log.contains("config file read") && log.contains("overridden=[\"threads\"]"), "{log}");
    // a bad file is refused before the model loads, in one line naming the file and key
    let sock = temp_path(".sock");
    for (text, needle) in [
        ("ctx = 320\nexpert-cach = 4\n", "unknown key \"expert-cach\""),
        ("ctx = \"long\"\n", ": ctx: invalid value 'long' for '--ctx"),
        ("ctx = 320\nctx = 321\n", "s.toml:2:"),
    ] {
        std::fs::write(&cfg, text).unwrap();
        let o = run_daemon(&["--config", cfg.to_str().unwrap(), "--socket", sock.to_str().unwrap()]);
        assert!(!o.status.success());
        let e = stderr(&o);
        let lines: Vec<&str> = e.lines().filter(|l| l.starts_with("strata-daemon: ")).collect();
        assert_eq!(lines.len(), 1, "{e}");
        assert!(lines[0].contains(&format!("config file {}", cfg.display())), "{e}");
        let needle = needle.replace("s.toml", cfg.file_name().unwrap().to_str().unwrap());
        assert!(lines[0].contains(&needle), "expected {needle:?} in {e}");
        assert!(!sock.exists());
    }
}
