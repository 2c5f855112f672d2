//! Helpers for the end-to-end tests: locate the built binaries and the model,
//! start a daemon on a temporary socket, run strata-ctl, connect a gRPC client.
//!
//! Environment: `STRATA_BIN_DIR` (default: the `target/<profile>` folder of
//! this build), `STRATA_MODEL` (default
//! `$STRATA_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf`, `STRATA_MODELS`
//! defaulting to `~/.cache/strata/models`; fetch it with `tools/fetch-model`),
//! `STRATA_TEST_START_S` (seconds a daemon may take to open its socket, default
//! 60; a first start on a GPU compiles the kernels).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use strata_proto::v1::strata_client::StrataClient;
use tonic::transport::{Channel, Endpoint, Uri};

/// Folder holding `strata-daemon` and `strata-ctl`.
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STRATA_BIN_DIR") {
        return PathBuf::from(d);
    }
    // target/<profile>/deps/<test-binary> -> target/<profile>
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("target dir").to_path_buf()
}

/// Path of a built binary; panics with a hint when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(p.exists(), "{} not found: build first with `cargo build --release` (or set STRATA_BIN_DIR)", p.display());
    p
}

/// The SmolLM2 model file; panics with the fetch command when it is missing.
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_MODEL") {
        return PathBuf::from(p);
    }
    let dir = std::env::var_os("STRATA_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/strata/models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} not found: run tools/fetch-model", p.display());
    p
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh temporary path (not created) with the given suffix.
pub fn temp_path(suffix: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    std::env::temp_dir().join(format!("strata-test-{}-{n}{suffix}", std::process::id()))
}

/// A running daemon; killed (SIGKILL) on drop if still running.
pub struct Daemon {
    /// The child process.
    pub child: Child,
    /// Its socket.
    pub socket: PathBuf,
}

impl Daemon {
    /// Starts `strata-daemon --model <model> --socket <tmp> --threads 2 <extra>`
    /// and waits (≤ 60 s) until the socket accepts connections.
    pub fn start(extra: &[&str]) -> Daemon {
        Self::start_with(&model_path(), &temp_path(".sock"), extra)
    }

    /// Same with an explicit model and socket.
    pub fn start_with(model: &Path, socket: &Path, extra: &[&str]) -> Daemon {
        Self::start_env(model, socket, extra, &[])
    }

    /// Same with extra environment variables for the daemon (e.g. `STRATA_SIMD`).
    pub fn start_env(model: &Path, socket: &Path, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let child = Command::new(bin("strata-daemon"))
            .arg("--model")
            .arg(model)
            .arg("--socket")
            .arg(socket)
            .args(["--threads", "2"])
            .args(extra)
            .env("STRATA_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn strata-daemon");
        Self::ready(child, socket)
    }

    /// Waits (≤ 60 s) until the daemon `child` accepts connections on `socket`; panics when it exits first, with
    /// its stderr when that was piped.
    pub fn ready(child: Child, socket: &Path) -> Daemon {
        let mut d = Daemon { child, socket: socket.to_path_buf() };
        let t0 = Instant::now();
        loop {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return d;
            }
            if let Ok(Some(st)) = d.child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = d.child.stderr.take() {
                    e.read_to_string(&mut err).ok();
                }
                panic!("daemon exited early ({st}): {err}");
            }
            let limit = std::env::var("STRATA_TEST_START_S").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
            assert!(t0.elapsed() < Duration::from_secs(limit), "daemon did not open {} in {limit} s", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs strata-ctl against this daemon.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(bin("strata-ctl")).arg("--socket").arg(&self.socket).args(args).output().expect("run strata-ctl")
    }

    /// Sends a signal.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).expect("kill");
    }

    /// Waits (≤ `timeout`) for exit; returns the status and stderr.
    pub fn wait(mut self, timeout: Duration) -> (std::process::ExitStatus, String) {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    e.read_to_string(&mut err).ok();
                }
                return (st, err);
            }
            assert!(t0.elapsed() < timeout, "daemon did not exit within {timeout:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Connects a gRPC client over the socket.
    pub async fn client(&self) -> StrataClient<Channel> {
        connect(&self.socket).await
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Connects a gRPC client to a Unix socket.
pub async fn connect(socket: &Path) -> StrataClient<Channel> {
    let p = socket.to_path_buf();
    let ch = Endpoint::try_from("http://strata.sock")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
        }))
        .await
        .expect("connect");
    StrataClient::new(ch)
}

/// Runs a model-less daemon invocation (e.g. with a bad model) to completion.
pub fn run_daemon(args: &[&str]) -> Output {
    Command::new(bin("strata-daemon")).args(args).output().expect("run strata-daemon")
}

/// stdout as UTF-8.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as UTF-8.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// An MoE fixture built by `tools/fetch-model --model smollm2-moe-{kind}` (docs/FIXTURES.md), next to the
/// SmolLM2 model; panics with the command when missing.
pub fn fixture_path(kind: &str) -> PathBuf {
    let p = model_path().with_file_name(format!("smollm2-moe-{kind}.gguf"));
    assert!(p.exists(), "{} not found: run tools/fetch-model --model smollm2-moe-{kind}", p.display());
    p
}

/// The fixed multi-turn chats of tools/data/conversations.json: (system message, chats of user turns).
pub fn conversations() -> (String, Vec<Vec<String>>) {
    // the source tree this was built in, else the working directory's (a test binary copied to another machine
    // and run from a checkout there)
    let mut p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/data/conversations.json");
    if !p.exists() {
        p = PathBuf::from("tools/data/conversations.json");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).expect("conversations.json")).unwrap();
    let sys = v["system"].as_str().unwrap().to_string();
    let chats = v["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["turns"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect())
        .collect();
    (sys, chats)
}

/// A greedy (temperature 0) generate request of `max_tokens` on `prompt`.
pub fn greedy(prompt: &str, max_tokens: u32) -> strata_proto::v1::GenerateRequest {
    strata_proto::v1::GenerateRequest {
        prompt: prompt.into(),
        max_tokens,
        sampling: Some(strata_proto::v1::SamplingParams::default()),
        ..Default::default()
    }
}

/// Runs the fixed chats of [`conversations`] over `client` (the first `turns` user turns, each with the
/// conversation so far and the model's greedy answers) and returns the answers and each request's counters.
/// Panics when a request fails.
pub async fn replay_chats(
    client: &mut StrataClient<Channel>,
    turns: usize,
    max_tokens: u32,
) -> (Vec<String>, Vec<strata_proto::v1::RequestCounters>) {
    use strata_proto::v1 as pb;
    let (system, chats) = conversations();
    let (mut answers, mut counters) = (Vec::new(), Vec::new());
    'outer: for chat in chats {
        let mut history = vec![pb::ChatMessage { role: "system".into(), content: system.clone() }];
        for user in chat {
            if answers.len() == turns {
                break 'outer;
            }
            history.push(pb::ChatMessage { role: "user".into(), content: user });
            let req = pb::GenerateRequest { messages: history.clone(), max_tokens, ..Default::default() };
            let mut s = client.generate(req).await.expect("a chat request failed").into_inner();
            let mut text = None;
            while let Some(ev) = s.message().await.expect("a chat stream failed") {
                if let Some(pb::generate_event::Event::Done(done)) = ev.event {
                    counters.push(done.counters.unwrap_or_default());
                    text = Some(done.text);
                }
            }
            let text = text.expect("a stream without its Done event");
            history.push(pb::ChatMessage { role: "assistant".into(), content: text.clone() });
            answers.push(text);
        }
    }
    (answers, counters)
}

/// A loopback TCP port that was free a moment ago (for `--http-listen 127.0.0.1:PORT`).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local address").port()
}
