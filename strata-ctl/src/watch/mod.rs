//! `strata-ctl watch`: the daemon's counter stream (`WatchCounters`) as a full-screen view refreshed in place when
//! stdout is a terminal ([`terminal`], drawn by [`view`]), else (or with `--json` / `--plain`) one line per update.
//!
//! Either way the daemon stopping (the stream ends, or fails with `UNAVAILABLE`) ends `watch` with
//! [`STOPPED`] and exit code 2, as when the daemon cannot be reached.

mod terminal;
pub mod view;

use std::io::IsTerminal;

use serde_json::json;
use strata_proto::v1 as pb;
use strata_proto::v1::strata_client::StrataClient;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use crate::{counters_json, outln, status_err};

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

/// The header of `--plain`'s table.
fn plain_header() -> String {
    format!(
        "{:>8} {:>7} {:>8} {:>9} {:>10} {:>6} {:>11} {:>9}",
        "request", "state", "tokens", "tok/s", "VRAM hit", "swaps", "blobs/tok", "promoted"
    )
}

/// One line of `--plain`'s table: a long prompt's prefill shows prompt tokens done of all and their rate so far; a
/// decoding or finished request its tokens, rate, VRAM hit rate and swaps, blob reads per token and promotions.
fn plain_line(running: bool, c: &pb::RequestCounters) -> String {
    if running && c.prompt_done < c.prompt_tokens {
        format!(
            "{:>8} {:>7} {:>8} {:>9.1}",
            c.request_id,
            "prefill",
            format!("{}/{}", c.prompt_done, c.prompt_tokens),
            prompt_rate(true, c)
        )
    } else {
        format!(
            "{:>8} {:>7} {:>8} {:>9.1} {:>9.1}% {:>6} {:>11.2} {:>9}",
            c.request_id,
            if running { "running" } else { "done" },
            c.generated_tokens,
            c.decode_tok_s,
            c.hit_rate * 100.0,
            c.swaps,
            c.blob_reads_per_token,
            c.ram_promotions
        )
    }
}

/// One line per update (a table, or JSON objects).
async fn lines(client: &mut StrataClient<Channel>, json: bool, count: u32) -> Result<(), (u8, String)> {
    let mut stream = client.watch_counters(pb::WatchRequest {}).await.map_err(status_err)?.into_inner();
    if !json {
        outln!("{}", plain_header());
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
            outln!("{}", json!({"running": u.running, "counters": counters_json(c)}));
        } else {
            outln!("{}", plain_line(u.running, c));
        }
        if !u.running {
            finished += 1;
            if count > 0 && finished >= count {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_show_swaps_beside_the_vram_hit_rate() {
        let header = plain_header();
        assert_eq!(header, " request   state   tokens     tok/s   VRAM hit  swaps   blobs/tok  promoted");
        let c = pb::RequestCounters {
            request_id: 5,
            prompt_tokens: 20,
            prompt_done: 20,
            generated_tokens: 42,
            decode_tok_s: 31.5,
            hit_rate: 0.9,
            swaps: 37,
            blob_reads_per_token: 0.25,
            ram_promotions: 3,
            ..Default::default()
        };
        let line = plain_line(false, &c);
        assert_eq!(line, "       5    done       42      31.5      90.0%     37        0.25         3");
        // each figure ends where its header does
        for (h, v) in [("VRAM hit", "90.0%"), ("swaps", "37"), ("blobs/tok", "0.25"), ("promoted", "3")] {
            assert_eq!(header.find(h).unwrap() + h.len(), line.rfind(v).unwrap() + v.len(), "{h}");
        }
        let prefill = pb::RequestCounters { prompt_done: 10, prompt_ms: 100.0, ..c };
        assert_eq!(plain_line(true, &prefill), "       5 prefill    10/20     100.0");
    }
}
