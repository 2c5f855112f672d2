//! The full-screen `watch`: raw mode on the alternate screen while it runs, redrawn on every counter update, key
//! and second; the terminal restored on every way out (return, error, panic, SIGTERM/SIGHUP/SIGINT).

use std::time::Duration;

use crossterm::event::{Event, EventStream, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use strata_proto::v1 as pb;
use strata_proto::v1::strata_client::StrataClient;
use tokio::signal::unix::{signal, SignalKind};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::view::{self, ViewState};
use super::{stopped, stream_err};
use crate::status_err;

/// Leaves raw mode and the alternate screen when dropped (ratatui's panic hook does the same on a panic).
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = ratatui::try_restore();
    }
}

/// Whether a key quits: `q`, Esc or Ctrl-C (raw mode delivers Ctrl-C as a key, not SIGINT).
fn quits(k: &KeyEvent) -> bool {
    k.kind == KeyEventKind::Press
        && match k.code {
            KeyCode::Char('q') | KeyCode::Esc => true,
            KeyCode::Char('c') => k.modifiers.contains(KeyModifiers::CONTROL),
            _ => false,
        }
}

/// Longest wait for one refresh call.
const REFRESH_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Refreshes the stats and the experts in VRAM; a failure keeps the old figures (the counter stream tells
/// whether the daemon stopped).
/// Each call waits at most [`REFRESH_WAIT`], so a stalled daemon cannot keep the keys from being read.
async fn refresh(client: &mut StrataClient<Channel>, s: &mut ViewState) {
    if let Ok(Ok(r)) = tokio::time::timeout(REFRESH_WAIT, client.get_stats(pb::StatsRequest {})).await {
        s.stats = r.into_inner();
    }
    if s.gpu() && s.stats.model.as_ref().is_some_and(|m| m.n_expert > 0) {
        let call = client.get_residency(pb::ResidencyRequest { layer: None, top: 1 });
        if let Ok(Ok(r)) = tokio::time::timeout(REFRESH_WAIT, call).await {
            let layers = r.into_inner().layers;
            s.vram =
                Some((layers.iter().map(|l| l.vram_experts as u64).sum(), layers.iter().map(|l| l.vram_bytes).sum()));
        }
    }
}

/// Runs the screen until the user quits, `count` requests finished (0 = no limit) or the daemon stops.
pub async fn run(client: &mut StrataClient<Channel>, count: u32) -> Result<(), (u8, String)> {
    let stats = client.get_stats(pb::StatsRequest {}).await.map_err(status_err)?.into_inner();
    let mut state = ViewState::new(stats);
    refresh(client, &mut state).await;
    let mut stream = client.watch_counters(pb::WatchRequest {}).await.map_err(status_err)?.into_inner();
    let signal_err = |e: std::io::Error| (1, format!("signal handler: {e}"));
    let mut term_sig = signal(SignalKind::terminate()).map_err(signal_err)?;
    let mut hup_sig = signal(SignalKind::hangup()).map_err(signal_err)?;
    let mut int_sig = signal(SignalKind::interrupt()).map_err(signal_err)?;
    let terminal_err = |e: std::io::Error| (1, format!("terminal: {e}"));
    // declared before the terminal, so dropped after it (the terminal shows the cursor again when dropped)
    let _restore = Restore;
    let mut terminal = ratatui::try_init().map_err(terminal_err)?;
    let mut keys = EventStream::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut finished = 0u32;
    loop {
        terminal.draw(|f| view::draw(f, &state)).map_err(terminal_err)?;
        tokio::select! {
            u = stream.next() => match u {
                Some(Ok(u)) => {
                    if state.apply(u) {
                        finished += 1;
                        if count > 0 && finished >= count {
                            return Ok(());
                        }
                        refresh(client, &mut state).await;
                    }
                }
                Some(Err(e)) => return Err(stream_err(e)),
                None => return Err(stopped()),
            },
            ev = keys.next() => match ev {
                Some(Ok(Event::Key(k))) if quits(&k) => return Ok(()),
                Some(Ok(_)) => {} // a resize or another key: redraw
                Some(Err(e)) => return Err(terminal_err(e)),
                None => return Ok(()),
            },
            _ = tick.tick() => refresh(client, &mut state).await,
            _ = term_sig.recv() => return Ok(()),
            _ = hup_sig.recv() => return Ok(()),
            _ = int_sig.recv() => return Ok(()),
        }
    }
}
