//! `strata-tools replay` as a user runs it: a cache larger than the trace's layers is refused in one line, errors
//! stay one line with `RUST_BACKTRACE` set, and a reader that goes away early (`| head`) ends it quietly.

use std::io::Read;
use std::process::{Command, Stdio};

/// A decode trace of 40 windows over 8 experts of one layer (top-2), written to a temporary file named for `test`.
fn trace(test: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("strata-replay-cli-{test}-{}.jsonl", std::process::id()));
    let mut s = String::new();
    for pos in 0..40 {
        let (a, b) = (pos % 8, (pos * 3 + 1) % 8);
        let b = if a == b { (b + 1) % 8 } else { b };
        s += &format!(r#"{{"seq":1,"pos":{pos},"phase":"decode","layer":0,"experts":[{a},{b}],"weights":[0.5,0.5]}}"#);
        s.push('\n');
    }
    std::fs::write(&p, s).unwrap();
    p
}

fn replay(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata-tools"));
    c.arg("replay").args(args).env("RUST_BACKTRACE", "1");
    c
}

#[test]
fn more_slots_than_experts_is_one_line_error() {
    let t = trace("slots");
    let o = replay(&["--trace", t.to_str().unwrap(), "--slots-per-layer", "2,9"]).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(e.contains("--slots-per-layer 9: the trace has 8 experts per layer"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
    assert!(!e.contains("backtrace") && !e.contains("panicked"), "{e}");
    // every expert fits: allowed (the upper bound)
    let o = replay(&["--trace", t.to_str().unwrap(), "--slots-per-layer", "8"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_file(t).ok();
}

#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    let t = trace("pipe");
    let mut child = replay(&["--trace", t.to_str().unwrap(), "--slots-per-layer", "1,2,3,4,5,6,7,8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // read one byte, then close the pipe as `head -c 1` does
    let mut out = child.stdout.take().unwrap();
    let mut one = [0u8; 1];
    out.read_exact(&mut one).unwrap();
    drop(out);
    let o = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!e.contains("panicked"), "no panic on a closed pipe: {e}");
    std::fs::remove_file(t).ok();
}
