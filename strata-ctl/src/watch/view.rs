//! The `watch` screen: what it shows ([`ViewState`]) and how it is drawn ([`draw`], a pure function of the state,
//! so a test can render it into ratatui's `TestBackend`).
//!
//! Columns about VRAM appear only when the daemon has a VRAM tier ([`ViewState::gpu`]).

use std::collections::VecDeque;

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, LineGauge, Paragraph, Row, Table};
use ratatui::Frame;
use strata_proto::v1 as pb;

use super::prompt_rate;
use crate::{count, finish_name};

/// Finished requests the history table keeps.
pub const HISTORY: usize = 10;

/// Everything the screen shows.
#[derive(Debug, Default, Clone)]
pub struct ViewState {
    /// The daemon's stats as last fetched: version, model, uptime, totals.
    pub stats: pb::StatsReply,
    /// Experts held in VRAM and their bytes (from the residency), when the daemon has a VRAM tier.
    pub vram: Option<(u64, u64)>,
    /// The running request's counters so far, or the last finished request's.
    pub current: Option<pb::CounterUpdate>,
    /// Finished requests, newest first (at most [`HISTORY`]).
    pub history: VecDeque<pb::RequestCounters>,
}

impl ViewState {
    /// The state at start: the stats, with their last request as the current and only finished one.
    pub fn new(stats: pb::StatsReply) -> Self {
        let mut s = ViewState { stats, ..Default::default() };
        if let Some(c) = s.stats.last_request {
            s.apply(pb::CounterUpdate { running: false, counters: Some(c) });
        }
        s
    }

    /// Takes one update of the counter stream; true when it is a finished request's.
    pub fn apply(&mut self, u: pb::CounterUpdate) -> bool {
        let finished = !u.running;
        if let (true, Some(c)) = (finished, &u.counters) {
            self.history.push_front(*c);
            self.history.truncate(HISTORY);
        }
        self.current = Some(u);
        finished
    }

    /// Whether the daemon has a VRAM tier: it runs on the GPU (`cuda` backend), or its counters saw VRAM.
    pub fn gpu(&self) -> bool {
        let model_gpu = self.stats.model.as_ref().is_some_and(|m| m.backend == "cuda");
        let totals_hits = self.stats.totals.as_ref().is_some_and(|t| t.vram_hits > 0);
        let current_hits = self.current.as_ref().and_then(|u| u.counters.as_ref()).is_some_and(|c| c.vram_hits > 0);
        model_gpu || totals_hits || current_hits || self.vram.is_some_and(|(n, _)| n > 0)
    }
}

/// Draws the whole screen: header, current request, expert tiers, recent requests, keys.
pub fn draw(f: &mut Frame, s: &ViewState) {
    let [header, request, tiers, history, keys] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Length(5),
        Constraint::Length(5),
        Constraint::Min(4),
        Constraint::Length(1),
    ])
    .areas(f.area());
    draw_header(f, header, s);
    draw_request(f, request, s);
    draw_tiers(f, tiers, s);
    draw_history(f, history, s);
    f.render_widget(
        Paragraph::new("q / Esc / Ctrl-C: quit    (strata-ctl watch --plain: one line per update)")
            .style(Style::new().fg(Color::DarkGray)),
        keys,
    );
}

const MIB: f64 = 1048576.0;

/// A duration in seconds as `1h 02m 03s`, `2m 03s` or `12s`.
fn uptime_text(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m {sec:02}s"),
        (h, m, sec) => format!("{h}h {m:02}m {sec:02}s"),
    }
}

fn titled(title: &str) -> Block<'_> {
    Block::bordered().title(Line::from(format!(" {title} ")).style(Style::new().add_modifier(Modifier::BOLD)))
}

fn draw_header(f: &mut Frame, area: Rect, s: &ViewState) {
    let m = s.stats.model.clone().unwrap_or_default();
    let experts =
        if m.n_expert > 0 { format!("{} experts, top-{}", m.n_expert, m.n_expert_used) } else { "dense".into() };
    let busy = s.current.as_ref().is_some_and(|u| u.running);
    let lines = vec![
        Line::from(format!("model {} ({}), {experts}, backend {}", m.name, m.architecture, m.backend)),
        Line::from(format!(
            "up {}   {}   queued {}   RSS {:.1} MiB",
            uptime_text(s.stats.uptime_s),
            if busy { "busy" } else { "idle" },
            s.stats.queued,
            s.stats.rss_bytes as f64 / MIB
        )),
    ];
    f.render_widget(Paragraph::new(lines).block(titled(&format!("strata-daemon {}", s.stats.version))), area);
}

/// A request's state: `prefill` while its prompt runs in chunks, `running` while it decodes, `done`.
fn state_name(running: bool, c: &pb::RequestCounters) -> &'static str {
    match (running, c.prompt_done < c.prompt_tokens) {
        (true, true) => "prefill",
        (true, false) => "running",
        (false, _) => "done",
    }
}

fn draw_request(f: &mut Frame, area: Rect, s: &ViewState) {
    let block = titled(if s.current.as_ref().is_some_and(|u| u.running) { "request" } else { "last request" });
    let Some((running, c)) = s.current.as_ref().and_then(|u| u.counters.as_ref().map(|c| (u.running, c))) else {
        f.render_widget(Paragraph::new("waiting for a request").block(block), area);
        return;
    };
    let inner = block.inner(area);
    f.render_widget(block, area);
    let [l1, l2, gauge] = Layout::vertical([Constraint::Length(1); 3]).areas(inner);
    let state = state_name(running, c);
    let finish = if running { String::new() } else { format!("   finish {}", finish_name(c.finish_reason)) };
    f.render_widget(
        Line::from(format!(
            "#{}  {state}   prompt {} ({} reused)   generated {}{finish}",
            c.request_id,
            count(c.prompt_tokens, "token"),
            c.prompt_reused,
            count(c.generated_tokens, "token")
        )),
        l1,
    );
    f.render_widget(
        Line::from(format!(
            "decode {:.1} tok/s   prompt {:.1} tok/s   queued {:.1} ms   RSS {:.1} MiB",
            c.decode_tok_s,
            prompt_rate(running, c),
            c.queue_ms,
            c.rss_bytes as f64 / MIB
        )),
        l2,
    );
    let done = if state == "done" { c.prompt_tokens } else { c.prompt_done };
    let ratio = if c.prompt_tokens > 0 { (done as f64 / c.prompt_tokens as f64).clamp(0.0, 1.0) } else { 1.0 };
    let label = if state == "prefill" { "prefill" } else { "prompt" };
    f.render_widget(
        LineGauge::default()
            .ratio(ratio)
            .label(format!("{label} {done}/{}", c.prompt_tokens))
            .filled_style(Style::new().fg(Color::Cyan)),
        gauge,
    );
}

/// The expert-tier figures of a request or of the totals, as table cells.
struct TierFigures {
    lookups: u64,
    vram_hits: u64,
    ram_reads: u64,
    file_blob_reads: u64,
    tokens: u64,
    file_bytes: u64,
    prefill_blob_reads: u64,
    promotions: u64,
    promotion_bytes: u64,
}

impl TierFigures {
    fn of_request(c: &pb::RequestCounters) -> Self {
        TierFigures {
            lookups: c.expert_lookups,
            vram_hits: c.vram_hits,
            ram_reads: c.ram_reads,
            file_blob_reads: c.file_blob_reads,
            tokens: c.generated_tokens as u64,
            file_bytes: c.file_bytes_read,
            prefill_blob_reads: c.prefill_file_blob_reads,
            promotions: c.ram_promotions,
            promotion_bytes: c.promotion_bytes,
        }
    }

    fn of_totals(t: &pb::Totals) -> Self {
        TierFigures {
            lookups: t.expert_lookups,
            vram_hits: t.vram_hits,
            ram_reads: t.ram_reads,
            file_blob_reads: t.file_blob_reads,
            tokens: t.generated_tokens,
            file_bytes: t.file_bytes_read,
            prefill_blob_reads: t.prefill_file_blob_reads,
            promotions: t.ram_promotions,
            promotion_bytes: t.promotion_bytes,
        }
    }

    /// Header cells; the VRAM ones only with `gpu`.
    fn header(gpu: bool) -> Vec<&'static str> {
        let mut h = vec!["", "lookups"];
        if gpu {
            h.extend(["VRAM hit", "VRAM hits"]);
        }
        h.extend(["RAM reads", "file blobs", "blobs/tok", "file MiB", "prefill blobs", "promoted", "promo MiB"]);
        h
    }

    fn cells(&self, label: &str, gpu: bool) -> Vec<String> {
        let per = |n: u64, d: u64| if d > 0 { n as f64 / d as f64 } else { 0.0 };
        let mut r = vec![label.to_string(), self.lookups.to_string()];
        if gpu {
            r.push(format!("{:.1}%", per(self.vram_hits, self.lookups) * 100.0));
            r.push(self.vram_hits.to_string());
        }
        r.extend([
            self.ram_reads.to_string(),
            self.file_blob_reads.to_string(),
            format!("{:.2}", per(self.file_blob_reads, self.tokens)),
            format!("{:.1}", self.file_bytes as f64 / MIB),
            self.prefill_blob_reads.to_string(),
            self.promotions.to_string(),
            format!("{:.1}", self.promotion_bytes as f64 / MIB),
        ]);
        r
    }
}

/// A table whose columns are as wide as their header or widest cell; the first column left, the others right.
fn table<'a>(header: &[&'a str], rows: Vec<Vec<String>>, block: Block<'a>) -> Table<'a> {
    let widths: Vec<Constraint> = (0..header.len())
        .map(|i| {
            let w = rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0);
            Constraint::Length(w as u16)
        })
        .collect();
    let align = |i: usize, t: String| {
        let l = Line::from(t);
        if i == 0 {
            l
        } else {
            l.right_aligned()
        }
    };
    let head = Row::new(header.iter().enumerate().map(|(i, h)| align(i, h.to_string())))
        .style(Style::new().add_modifier(Modifier::BOLD));
    let body = rows.into_iter().map(|r| Row::new(r.into_iter().enumerate().map(|(i, t)| align(i, t))));
    Table::new(body, widths).header(head).column_spacing(2).block(block)
}

fn draw_tiers(f: &mut Frame, area: Rect, s: &ViewState) {
    let gpu = s.gpu();
    let n_expert = s.stats.model.as_ref().map_or(0, |m| m.n_expert);
    let title = match s.vram {
        Some((n, bytes)) if gpu => {
            format!("expert tiers   VRAM slots hold {n} experts ({:.1} MiB)", bytes as f64 / MIB)
        }
        _ => "expert tiers".to_string(),
    };
    if n_expert == 0 {
        f.render_widget(Paragraph::new("dense model: no expert tiers").block(titled(&title)), area);
        return;
    }
    let mut rows = Vec::new();
    if let Some((running, c)) = s.current.as_ref().and_then(|u| u.counters.as_ref().map(|c| (u.running, c))) {
        let label = if running { "this request" } else { "last request" };
        rows.push(TierFigures::of_request(c).cells(label, gpu));
    }
    rows.push(TierFigures::of_totals(&s.stats.totals.unwrap_or_default()).cells("since start", gpu));
    f.render_widget(table(&TierFigures::header(gpu), rows, titled(&title)), area);
}

fn draw_history(f: &mut Frame, area: Rect, s: &ViewState) {
    let gpu = s.gpu();
    let mut header = vec!["request", "finish", "prompt", "reused", "tokens", "prompt tok/s", "decode tok/s"];
    if gpu {
        header.push("VRAM hit");
    }
    header.extend(["RAM reads", "blobs/tok", "file MiB", "promoted"]);
    let rows = s
        .history
        .iter()
        .map(|c| {
            let mut r = vec![
                format!("#{}", c.request_id),
                finish_name(c.finish_reason).to_string(),
                c.prompt_tokens.to_string(),
                c.prompt_reused.to_string(),
                c.generated_tokens.to_string(),
                format!("{:.1}", c.prompt_tok_s),
                format!("{:.1}", c.decode_tok_s),
            ];
            if gpu {
                r.push(format!("{:.1}%", c.hit_rate * 100.0));
            }
            r.extend([
                c.ram_reads.to_string(),
                format!("{:.2}", c.blob_reads_per_token),
                format!("{:.1}", c.file_bytes_read as f64 / MIB),
                c.ram_promotions.to_string(),
            ]);
            r
        })
        .collect();
    f.render_widget(table(&header, rows, titled("recent requests")), area);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    /// The screen drawn from `s` at 120 x 40, as text lines.
    fn screen(s: &ViewState) -> String {
        let mut t = Terminal::new(TestBackend::new(120, 40)).unwrap();
        t.draw(|f| draw(f, s)).unwrap();
        let b = t.backend().buffer();
        (0..b.area.height)
            .map(|y| (0..b.area.width).map(|x| b[(x, y)].symbol()).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn state(backend: &str) -> ViewState {
        let model = pb::ModelSummary {
            name: "smollm2-moe-split".into(),
            architecture: "llama".into(),
            backend: backend.into(),
            n_expert: 16,
            n_expert_used: 4,
            ..Default::default()
        };
        let gpu = backend == "cuda";
        let done = pb::RequestCounters {
            request_id: 3,
            prompt_tokens: 20,
            prompt_done: 20,
            generated_tokens: 42,
            decode_tok_s: 31.5,
            expert_lookups: 1000,
            vram_hits: if gpu { 900 } else { 0 },
            hit_rate: if gpu { 0.9 } else { 0.0 },
            ram_reads: if gpu { 100 } else { 1000 },
            finish_reason: pb::FinishReason::MaxTokens as i32,
            ..Default::default()
        };
        let stats = pb::StatsReply {
            model: Some(model),
            uptime_s: 3725.0,
            version: "0.1.0".into(),
            last_request: Some(done),
            ..Default::default()
        };
        let mut s = ViewState::new(stats);
        if gpu {
            s.vram = Some((120, 120 * 127872));
        }
        s
    }

    #[test]
    fn vram_columns_only_with_a_gpu() {
        let gpu = screen(&state("cuda"));
        assert!(gpu.contains("VRAM hit") && gpu.contains("90.0%"), "{gpu}");
        assert!(gpu.contains("VRAM slots hold 120 experts"), "{gpu}");
        let cpu = screen(&state("cpu"));
        assert!(!cpu.contains("VRAM"), "{cpu}");
        for s in [&gpu, &cpu] {
            assert!(s.contains("strata-daemon 0.1.0") && s.contains("backend"), "{s}");
            assert!(s.contains("smollm2-moe-split (llama), 16 experts, top-4"), "{s}");
            assert!(s.contains("up 1h 02m 05s"), "{s}");
            assert!(
                s.contains("#3  done") && s.contains("generated 42 tokens") && s.contains("finish max_tokens"),
                "{s}"
            );
            assert!(s.contains("RAM reads") && s.contains("since start"), "{s}");
        }
    }

    #[test]
    fn prefill_shows_its_progress() {
        let mut s = state("cpu");
        let c = pb::RequestCounters {
            request_id: 4,
            prompt_tokens: 512,
            prompt_done: 128,
            prompt_ms: 1000.0,
            ..Default::default()
        };
        assert!(!s.apply(pb::CounterUpdate { running: true, counters: Some(c) }));
        let text = screen(&s);
        assert!(text.contains("#4  prefill") && text.contains("prefill 128/512"), "{text}");
        assert!(text.contains("prompt 128.0 tok/s") && text.contains("busy"), "{text}");
        // the finished request before it stays in the history
        assert!(text.contains("#3 ") && text.contains("max_tokens"), "{text}");
    }

    #[test]
    fn waits_for_a_first_request() {
        let text = screen(&ViewState::new(pb::StatsReply::default()));
        assert!(text.contains("waiting for a request") && text.contains("dense model"), "{text}");
    }
}
