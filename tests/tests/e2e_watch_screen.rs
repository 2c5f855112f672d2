//! `strata-ctl watch` as a person sees it: the full-screen view in a detached tmux session (a private tmux server on
//! its own socket, `-S`), read back with `capture-pane` — a finished request's counters without VRAM columns on a CPU daemon, `q`
//! quitting, `--count`, and the daemon's SIGTERM ending the view with one line on the restored screen and exit code 2.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use strata_tests::*;

/// A private tmux server (`tmux -S SOCKET`, no config file) with one detached 120 x 40 session; killed on drop.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    /// Starts the server with a session whose first window, `name`, runs `shell` (a shell command line).
    fn start(name: &str, shell: &str) -> Tmux {
        let t = Tmux { socket: temp_path(".tmux") };
        let o = t.run(&["new-session", "-d", "-s", "w", "-n", name, "-x", "120", "-y", "40", shell]);
        assert!(o.status.success(), "tmux new-session: {}", stderr(&o));
        t
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(["-f", "/dev/null"])
            .args(args)
            .env_remove("TMUX")
            .output()
            .expect("run tmux")
    }

    /// Opens another window, `name`, running `shell`.
    fn window(&self, name: &str, shell: &str) {
        let o = self.run(&["new-window", "-d", "-t", "w:", "-n", name, shell]);
        assert!(o.status.success(), "tmux new-window: {}", stderr(&o));
    }

    /// The text of window `name`'s screen.
    fn capture(&self, name: &str) -> String {
        stdout(&self.run(&["capture-pane", "-p", "-t", &format!("w:{name}")]))
    }

    /// Whether window `name` shows the alternate screen (a full-screen program runs).
    fn alternate(&self, name: &str) -> bool {
        stdout(&self.run(&["display-message", "-p", "-t", &format!("w:{name}"), "#{alternate_on}"])).trim() == "1"
    }

    /// Polls window `name` (≤ 20 s) until its screen satisfies `ok`; returns that screen.
    fn wait_for(&self, name: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let screen = self.capture(name);
            if ok(&screen) {
                return screen;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "window {name} never showed {what}:\n{screen}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends keys to window `name`.
    fn keys(&self, name: &str, keys: &str) {
        let o = self.run(&["send-keys", "-t", &format!("w:{name}"), keys]);
        assert!(o.status.success(), "tmux send-keys: {}", stderr(&o));
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Whether tmux runs here.
fn tmux_installed() -> bool {
    Command::new("tmux").arg("-V").output().is_ok_and(|o| o.status.success())
}

#[test]
fn watch_screen_in_tmux() {
    if !tmux_installed() {
        eprintln!("skipped: tmux is not installed");
        return;
    }
    let d = Daemon::start_with(&fixture_path("split"), &temp_path(".sock"), &["--gpu", "off"]);
    // the shell says how strata-ctl exited, then keeps the window open to be read
    let watch = format!(
        "'{}' --socket '{}' watch; echo \"strata-ctl exited $?\"; sleep 600",
        bin("strata-ctl").display(),
        d.socket.display()
    );
    let tmux = Tmux::start("screen", &watch);
    tmux.window("quit", &watch);
    tmux.window("count", &watch.replace(" watch;", " watch --count 1;"));
    let screen = tmux.wait_for("screen", "the view", |s| s.contains("strata-daemon") && s.contains("recent requests"));
    assert!(screen.contains("waiting for a request") && screen.contains("backend cpu"), "{screen}");
    assert!(tmux.alternate("screen"), "the view runs on the alternate screen");

    // q quits, back to the normal screen
    tmux.wait_for("quit", "the view", |s| s.contains("recent requests"));
    tmux.keys("quit", "q");
    let quit = tmux.wait_for("quit", "strata-ctl's exit", |s| s.contains("strata-ctl exited"));
    assert!(quit.contains("strata-ctl exited 0") && !quit.contains("recent requests"), "{quit}");
    assert!(!tmux.alternate("quit"));

    // (the view shows once its counter stream is open)
    tmux.wait_for("count", "the view", |s| s.contains("recent requests"));
    // a request: the view shows its tokens when it finishes, and no VRAM column on a CPU daemon
    let o = d.ctl(&["--json", "generate", "--max-tokens", "24", "Once upon a time"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let c = &serde_json::from_str::<serde_json::Value>(stdout(&o).trim()).unwrap()["counters"];
    let (id, tokens) = (c["request_id"].as_u64().unwrap(), c["generated_tokens"].as_u64().unwrap());
    let done = format!("#{id}  done");
    let generated = format!("generated {tokens} tokens");
    let screen = tmux.wait_for("screen", "the finished request", |s| s.contains(&done) && s.contains(&generated));
    let row = screen.lines().find(|l| l.contains(&format!("│#{id} "))).unwrap_or_else(|| panic!("no row:\n{screen}"));
    assert!(row.contains("length") && row.contains(&format!(" {tokens} ")), "{row}");
    assert!(screen.contains("last request") && screen.contains("since start"), "{screen}");
    assert!(screen.contains("RAM reads") && screen.contains("blobs/tok"), "{screen}");
    // file reads split into decode and prefill, as strata-ctl stats shows them
    assert!(screen.contains("decode blobs") && screen.contains("decode MiB"), "{screen}");
    assert!(screen.contains("prefill blobs") && screen.contains("prefill MiB"), "{screen}");
    assert!(!screen.contains("VRAM") && !screen.contains("swaps"), "no VRAM columns on a CPU daemon:\n{screen}");
    // --count 1: the view ends after that request
    let count = tmux.wait_for("count", "strata-ctl's exit", |s| s.contains("strata-ctl exited"));
    assert!(count.contains("strata-ctl exited 0") && !tmux.alternate("count"), "{count}");

    // the daemon stops: the view ends with one line on the restored screen, exit code 2
    d.signal(nix::sys::signal::Signal::SIGTERM);
    let (st, _) = d.wait(Duration::from_secs(10));
    assert!(st.success());
    let end = tmux.wait_for("screen", "strata-ctl's exit", |s| s.contains("strata-ctl exited"));
    assert!(end.contains("strata-ctl: the daemon stopped\nstrata-ctl exited 2"), "{end}");
    assert!(!end.contains("recent requests"), "the view is gone:\n{end}");
    assert!(!tmux.alternate("screen"), "back on the normal screen");
}

/// Not on a terminal (here a pipe) `watch` prints today's lines; the daemon stopping ends it the same way.
#[test]
fn plain_watch_ends_when_the_daemon_stops() {
    let d = Daemon::start_with(&fixture_path("split"), &temp_path(".sock"), &["--gpu", "off"]);
    let mut watch = Command::new(bin("strata-ctl"))
        .arg("--socket")
        .arg(&d.socket)
        .arg("watch")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // the header line comes once the stream is open
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines().map(|l| l.unwrap());
    assert_eq!(lines.next().unwrap(), " request   state   tokens     tok/s   VRAM hit  swaps   blobs/tok  promoted");
    let o = d.ctl(&["generate", "--max-tokens", "8", "Once upon a time"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let done = lines.find(|l| !l.contains("running")).unwrap();
    let words: Vec<&str> = done.split_whitespace().collect();
    assert_eq!(words[1..3], ["done", "8"], "{done}");
    assert_eq!(words[5], "0", "no swaps on a CPU daemon: {done}");
    d.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(d.wait(Duration::from_secs(10)).0.success());
    assert_eq!(lines.count(), 0);
    let o = watch.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(stderr(&o), "strata-ctl: the daemon stopped\n");
}
