//! Per-request counters and totals since start (DESIGN.md §6; this build
//! has no expert tiers yet, so tier counters are not reported).

use std::sync::Mutex;
use std::time::Instant;

use super::request::FinishReason;

/// Counters of one request. Times in milliseconds.
#[derive(Debug, Clone)]
pub struct Counters {
    /// Request id (1, 2, ... since start).
    pub request_id: u64,
    /// Prompt tokens (read + reused).
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused from the previous request.
    pub prompt_reused: usize,
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
    /// Why it ended.
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
}

impl Default for Stats {
    fn default() -> Self {
        Stats { started: Instant::now(), inner: Mutex::new((Totals::default(), None)) }
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
