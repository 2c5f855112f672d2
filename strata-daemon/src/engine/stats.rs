//! Per-request counters and totals since start (DESIGN.md §6), with the expert tiers' counters, and the running
//! request's live counters (for `WatchCounters`).

use std::sync::Mutex;
use std::time::Instant;

use super::request::FinishReason;
use crate::tiers::store::TierTotals;

/// Counters of one request. Times in milliseconds.
#[derive(Debug, Clone)]
pub struct Counters {
    /// Request id (1, 2, ... since start).
    pub request_id: u64,
    /// Prompt tokens (read + reused).
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused from the previous request.
    pub prompt_reused: usize,
    /// Prompt tokens in the KV cache so far (reused ones included): below `prompt_tokens` while the prefill runs
    /// (live counters report it chunk by chunk), equal to it after.
    pub prompt_done: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Time waiting in the queue.
    pub queue_ms: f64,
    /// Prompt processing time (prefill).
    pub prompt_ms: f64,
    /// Decode time (after the prefill to the end).
    pub decode_ms: f64,
    /// Decode windows (forward passes after the prefill).
    pub windows: u64,
    /// Distinct (layer, expert) lookups in decode windows (0 for dense models).
    pub expert_lookups: u64,
    /// Tier counters of this request (decode lookups, RAM reads, file blob reads, promotions, ...).
    pub tiers: TierTotals,
    /// Engine resident set size at the last update, bytes.
    pub rss_bytes: u64,
    /// Why it ended (`Cancelled` while it runs).
    pub finish: FinishReason,
}

impl Counters {
    /// (prompt − reused) / prompt seconds.
    pub fn prompt_tok_s(&self) -> f64 {
        rate(self.prompt_tokens - self.prompt_reused, self.prompt_ms)
    }
    /// generated / decode seconds.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.generated_tokens, self.decode_ms)
    }
    /// Decode file blob reads per generated token.
    pub fn blob_reads_per_token(&self) -> f64 {
        per(self.tiers.file_blob_reads, self.generated_tokens as u64)
    }
    /// RAM promotions per generated token.
    pub fn promotions_per_token(&self) -> f64 {
        per(self.tiers.promotions, self.generated_tokens as u64)
    }
}

/// `a / b`, 0 when `b` is 0.
pub fn per(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// This process's resident set size in bytes (from /proc/self/statm), 0 when unreadable.
pub fn rss_bytes() -> u64 {
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(4096) as u64;
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map(|p| p * page)
        .unwrap_or(0)
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

/// Totals since start.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    /// Requests finished (any reason).
    pub requests: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generated_tokens: u64,
    /// Prefill time, ms.
    pub prompt_ms: f64,
    /// Decode time, ms.
    pub decode_ms: f64,
    /// Requests cancelled.
    pub cancelled: u64,
    /// Requests refused by validation.
    pub rejected: u64,
    /// Decode windows.
    pub windows: u64,
    /// Expert lookups.
    pub expert_lookups: u64,
}

/// Shared engine statistics (read by the service, written by the engine).
pub struct Stats {
    /// Start time of the daemon.
    pub started: Instant,
    inner: Mutex<(Totals, Option<Counters>)>,
    live: Mutex<Option<Counters>>,
    /// Bumped on every live update and every finished request (watchers wait on it).
    pub updates: tokio::sync::watch::Sender<u64>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            started: Instant::now(),
            inner: Mutex::new((Totals::default(), None)),
            live: Mutex::new(None),
            updates: tokio::sync::watch::channel(0).0,
        }
    }
}

impl Stats {
    /// Records a finished request.
    pub fn record(&self, c: &Counters) {
        let mut g = self.inner.lock().unwrap();
        let t = &mut g.0;
        t.requests += 1;
        t.prompt_tokens += c.prompt_tokens as u64;
        t.generated_tokens += c.generated_tokens as u64;
        t.prompt_ms += c.prompt_ms;
        t.decode_ms += c.decode_ms;
        t.windows += c.windows;
        t.expert_lookups += c.expert_lookups;
        if c.finish == FinishReason::Cancelled {
            t.cancelled += 1;
        }
        g.1 = Some(c.clone());
        drop(g);
        *self.live.lock().unwrap() = None;
        self.updates.send_modify(|v| *v += 1);
    }
    /// Publishes the running request's counters (the engine calls it while decoding).
    pub fn set_live(&self, c: &Counters) {
        *self.live.lock().unwrap() = Some(c.clone());
        self.updates.send_modify(|v| *v += 1);
    }
    /// The running request's counters, if one runs.
    pub fn live(&self) -> Option<Counters> {
        self.live.lock().unwrap().clone()
    }
    /// Counts a request refused by validation.
    pub fn record_rejected(&self) {
        self.inner.lock().unwrap().0.rejected += 1;
    }
    /// Totals and the last request's counters.
    pub fn snapshot(&self) -> (Totals, Option<Counters>) {
        self.inner.lock().unwrap().clone()
    }
}
