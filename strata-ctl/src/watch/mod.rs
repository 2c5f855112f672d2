//! `strata-ctl watch`: the daemon's counter stream (`WatchCounters`) as a full-screen view refreshed in place when
//! stdout is a terminal ([`terminal`], drawn by [`view`]), else (or with `--json` / `--plain`) one line per update.
//!
//! Either way the daemon stopping (the stream ends, or fails with `UNAVAILABLE`) ends `watch` with
//! [`STOPPED`] and exit code 2, as when the daemon cannot be reached.

mod terminal;
pub mod view;

use std::io::{IsTerminal, Write};

use serde_json::json;
use strata_proto::v1 as pb;
use strata_proto::v1::strata_client::StrataClient;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use crate::{counters_json, status_err};

/// The one line `watch` ends with when the daemon stops (after `strata-ctl: `).
pub const STOPPED: &str = "the daemon stopped";

/// How `watch` shows the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The full-screen view.
    Screen,
    /// One table line per update.
    Lines,
    /// One JSON object per update.
    Json,
}

impl Mode {
    /// The mode for the command line's flags: the screen only when stdout is a terminal.
    pub fn choose(json: bool, plain: bool) -> Mode {
        if json {
            Mode::Json
        } else if plain || !std::io::stdout().is_terminal() {
            Mode::Lines
        } else {
            Mode::Screen
        }
    }
}

/// Runs `watch` until the daemon stops, the user quits (screen) or `count` requests finished (0 = no limit).
pub async fn run(client: &mut StrataClient<Channel>, mode: Mode, count: u32) -> Result<(), (u8, String)> {
    match mode {
        Mode::Screen => terminal::run(client, count).await,
        Mode::Lines | Mode::Json => lines(client, mode == Mode::Json, count).await,
    }
}

/// The error `watch` ends with when the counter stream fails: [`STOPPED`] (code 2) for `UNAVAILABLE` (the daemon
/// shuts down) or a broken connection (the daemon was killed: `UNKNOWN` from the transport, a status with a
/// source error, which a status sent by the daemon never has), else the status (code 1).
fn stream_err(s: tonic::Status) -> (u8, String) {
    let broken = s.code() == tonic::Code::Unknown && std::error::Error::source(&s).is_some();
    if s.code() == tonic::Code::Unavailable || broken {
        stopped()
    } else {
        status_err(s)
    }
}

/// The daemon stopped: exit code 2 and the one line.
fn stopped() -> (u8, String) {
    (2, STOPPED.into())
}

/// Prompt tokens per second: while a long prompt's prefill runs, of the tokens computed so far; after it, the
/// request's own figure.
pub fn prompt_rate(running: bool, c: &pb::RequestCounters) -> f64 {
    if running && c.prompt_done < c.prompt_tokens {
        let done = c.prompt_done.saturating_sub(c.prompt_reused) as f64;
        if c.prompt_ms > 0.0 {
            done * 1000.0 / c.prompt_ms
        } else {
            0.0
        }
    } else {
        c.prompt_tok_s
    }
}

/// One line per update (a table, or JSON objects).
async fn lines(client: &mut StrataClient<Channel>, json: bool, count: u32) -> Result<(), (u8, String)> {
    let mut stream = client.watch_counters(pb::WatchRequest {}).await.map_err(status_err)?.into_inner();
    if !json {
        println!(
            "{:>8} {:>7} {:>8} {:>9} {:>10} {:>11} {:>9}",
            "request", "state", "tokens", "tok/s", "VRAM hit", "blobs/tok", "promoted"
        );
    }
    let mut finished = 0u32;
    loop {
        let u = match stream.next().await {
            Some(Ok(u)) => u,
            Some(Err(e)) => return Err(stream_err(e)),
            None => return Err(stopped()),
        };
        let Some(c) = &u.counters else { continue };
        if json {
            println!("{}", json!({"running": u.running, "counters": counters_json(c)}));
        } else if u.running && c.prompt_done < c.prompt_tokens {
            // a long prompt's prefill: prompt tokens done of all, and their rate so far
            println!(
                "{:>8} {:>7} {:>8} {:>9.1}",
                c.request_id,
                "prefill",
                format!("{}/{}", c.prompt_done, c.prompt_tokens),
                prompt_rate(true, c)
            );
        } else {
            println!(
                "{:>8} {:>7} {:>8} {:>9.1} {:>9.1}% {:>11.2} {:>9}",
                c.request_id,
                if u.running { "running" } else { "done" },
                c.generated_tokens,
                c.decode_tok_s,
                c.hit_rate * 100.0,
                c.blob_reads_per_token,
                c.ram_promotions
            );
        }
        let _ = std::io::stdout().flush();
        if !u.running {
            finished += 1;
            if count > 0 && finished >= count {
                return Ok(());
            }
        }
    }
}
