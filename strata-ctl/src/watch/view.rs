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
        Constraint::Length(tiers_height(s)),
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

/// The expert-tier figures of a request or of the totals, as table cells: file reads split into decode and prefill
/// (as `strata-ctl stats` does), and the VRAM tier's figures apart.
struct TierFigures {
    lookups: u64,
    vram_hits: u64,
    swaps: u64,
    pcie_entries: u64,
    prefetched: u64,
    prefetch_hits: u64,
    prefetch_wasted_bytes: u64,
    ram_reads: u64,
    file_blob_reads: u64,
    tokens: u64,
    /// Bytes read from the file by decode and prefill.
    file_bytes: u64,
    prefill_blob_reads: u64,
    /// Of `file_bytes`, the prefill's.
    prefill_bytes: u64,
    promotions: u64,
    promotion_bytes: u64,
}

impl TierFigures {
    fn of_request(c: &pb::RequestCounters) -> Self {
        TierFigures {
            lookups: c.expert_lookups,
            vram_hits: c.vram_hits,
            swaps: c.swaps,
            pcie_entries: c.pcie_entries,
            prefetched: c.prefetched,
            prefetch_hits: c.prefetch_hits,
            prefetch_wasted_bytes: c.prefetch_wasted_bytes,
            ram_reads: c.ram_reads,
            file_blob_reads: c.file_blob_reads,
            tokens: c.generated_tokens as u64,
            file_bytes: c.file_bytes_read,
            prefill_blob_reads: c.prefill_file_blob_reads,
            prefill_bytes: c.prefill_file_bytes_read,
            promotions: c.ram_promotions,
            promotion_bytes: c.promotion_bytes,
        }
    }

    fn of_totals(t: &pb::Totals) -> Self {
        TierFigures {
            lookups: t.expert_lookups,
            vram_hits: t.vram_hits,
            swaps: t.swaps,
            pcie_entries: t.pcie_entries,
            prefetched: t.prefetched,
            prefetch_hits: t.prefetch_hits,
            prefetch_wasted_bytes: t.prefetch_wasted_bytes,
            ram_reads: t.ram_reads,
            file_blob_reads: t.file_blob_reads,
            tokens: t.generated_tokens,
            file_bytes: t.file_bytes_read,
            prefill_blob_reads: t.prefill_file_blob_reads,
            prefill_bytes: t.prefill_file_bytes_read,
            promotions: t.ram_promotions,
            promotion_bytes: t.promotion_bytes,
        }
    }

    /// Header cells of the lookups, RAM and file figures (a CPU daemon has these only).
    const HEADER: [&'static str; 10] = [
        "",
        "lookups",
        "RAM reads",
        "decode blobs",
        "blobs/tok",
        "decode MiB",
        "prefill blobs",
        "prefill MiB",
        "promoted",
        "promo MiB",
    ];

    /// Header cells of the VRAM tier's figures (shown only when the daemon has one).
    const VRAM_HEADER: [&'static str; 8] =
        ["", "VRAM hit", "VRAM hits", "swaps", "PCIe entries", "prefetched", "prefetch used", "unused MiB"];

    fn cells(&self, label: &str) -> Vec<String> {
        vec![
            label.to_string(),
            self.lookups.to_string(),
            self.ram_reads.to_string(),
            self.file_blob_reads.to_string(),
            format!("{:.2}", per(self.file_blob_reads, self.tokens)),
            mib(self.file_bytes.saturating_sub(self.prefill_bytes)),
            self.prefill_blob_reads.to_string(),
            mib(self.prefill_bytes),
            self.promotions.to_string(),
            mib(self.promotion_bytes),
        ]
    }

    fn vram_cells(&self, label: &str) -> Vec<String> {
        vec![
            label.to_string(),
            format!("{:.1}%", per(self.vram_hits, self.lookups) * 100.0),
            self.vram_hits.to_string(),
            self.swaps.to_string(),
            self.pcie_entries.to_string(),
            self.prefetched.to_string(),
            self.prefetch_hits.to_string(),
            mib(self.prefetch_wasted_bytes),
        ]
    }
}

/// `n / d`, 0 when `d` is 0.
fn per(n: u64, d: u64) -> f64 {
    if d > 0 {
        n as f64 / d as f64
    } else {
        0.0
    }
}

/// Bytes as MiB with one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB)
}

/// A table whose columns are as wide as their header or widest cell, two spaces apart (one where two would not fit
/// in `width`); the first column left, the others right.
fn table<'a>(header: &[&'a str], rows: Vec<Vec<String>>, width: u16) -> Table<'a> {
    let widths: Vec<u16> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0) as u16)
        .collect();
    let gaps = widths.len().saturating_sub(1) as u16;
    let spacing = if widths.iter().sum::<u16>() + 2 * gaps <= width { 2 } else { 1 };
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
    Table::new(body, widths.into_iter().map(Constraint::Length)).header(head).column_spacing(spacing)
}

/// Rows the expert-tier box takes: a table of the current request and the totals, and with a VRAM tier a second.
fn tiers_height(s: &ViewState) -> u16 {
    let has_experts = s.stats.model.as_ref().is_some_and(|m| m.n_expert > 0);
    if has_experts && s.gpu() {
        8
    } else {
        5
    }
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
    let mut figures = Vec::new();
    if let Some((running, c)) = s.current.as_ref().and_then(|u| u.counters.as_ref().map(|c| (u.running, c))) {
        figures.push((if running { "this request" } else { "last request" }, TierFigures::of_request(c)));
    }
    figures.push(("since start", TierFigures::of_totals(&s.stats.totals.unwrap_or_default())));
    let block = titled(&title);
    let inner = block.inner(area);
    f.render_widget(block, area);
    let rows = figures.iter().map(|(label, t)| t.cells(label)).collect();
    let main = table(&TierFigures::HEADER, rows, inner.width);
    if gpu {
        // the VRAM tier's figures in a second table under the first (tiers_height made room)
        let [top, bottom] = Layout::vertical([Constraint::Length(3); 2]).areas(inner);
        f.render_widget(main, top);
        let rows = figures.iter().map(|(label, t)| t.vram_cells(label)).collect();
        f.render_widget(table(&TierFigures::VRAM_HEADER, rows, inner.width), bottom);
    } else {
        f.render_widget(main, inner);
    }
}

fn draw_history(f: &mut Frame, area: Rect, s: &ViewState) {
    let gpu = s.gpu();
    let mut header = vec!["request", "finish", "prompt", "reused", "tokens", "prompt tok/s", "decode tok/s"];
    if gpu {
        header.push("VRAM hit");
    }
    // decode only, as blobs/tok: the prefill's reads are in the expert tiers above
    header.extend(["RAM reads", "blobs/tok", "decode MiB", "promoted"]);
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
                mib(c.file_bytes_read.saturating_sub(c.prefill_file_bytes_read)),
                c.ram_promotions.to_string(),
            ]);
            r
        })
        .collect();
    let block = titled("recent requests");
    let width = block.inner(area).width;
    f.render_widget(table(&header, rows, width).block(block), area);
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
            file_blob_reads: 84,
            blob_reads_per_token: 2.0,
            // 6 MiB read by decode windows, 2 MiB by the prefill
            file_bytes_read: 8 << 20,
            prefill_file_blob_reads: 16,
            prefill_file_bytes_read: 2 << 20,
            swaps: if gpu { 37 } else { 0 },
            pcie_entries: if gpu { 11 } else { 0 },
            prefetched: if gpu { 24 } else { 0 },
            prefetch_hits: if gpu { 18 } else { 0 },
            prefetch_wasted_bytes: if gpu { 3 << 19 } else { 0 },
            finish_reason: pb::FinishReason::MaxTokens as i32,
            ..Default::default()
        };
        let totals = pb::Totals {
            generated_tokens: 100,
            expert_lookups: 5000,
            vram_hits: if gpu { 4000 } else { 0 },
            file_blob_reads: 300,
            file_bytes_read: 40 << 20,
            prefill_file_blob_reads: 64,
            prefill_file_bytes_read: 8 << 20,
            swaps: if gpu { 250 } else { 0 },
            ..Default::default()
        };
        let stats = pb::StatsReply {
            model: Some(model),
            uptime_s: 3725.0,
            version: "0.1.0".into(),
            totals: Some(totals),
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
            assert!(s.contains("#3  done") && s.contains("generated 42 tokens") && s.contains("finish length"), "{s}");
            assert!(s.contains("RAM reads") && s.contains("since start"), "{s}");
        }
    }

    /// The cell of column `header` in the row that starts with `label`, from the first table having both (the
    /// header's line, then its rows): numbers are right-aligned, so the cell ends where its header does.
    fn cell(screen: &str, header: &str, label: &str) -> String {
        let lines: Vec<Vec<char>> = screen.lines().map(|l| l.chars().collect()).collect();
        let find = |l: &[char], t: &str| {
            let t: Vec<char> = t.chars().collect();
            l.windows(t.len()).position(|w| w == t.as_slice())
        };
        for (i, head) in lines.iter().enumerate() {
            let Some(x) = find(head, header) else { continue };
            let end = x + header.chars().count();
            for row in lines.iter().skip(i + 1).take(2) {
                if find(row, label) == Some(1) {
                    let text: String = row[..end].iter().collect();
                    return text.rsplit(' ').next().unwrap().to_string();
                }
            }
        }
        panic!("no column {header:?} with a row {label:?}:\n{screen}");
    }

    #[test]
    fn file_reads_split_into_decode_and_prefill() {
        for backend in ["cpu", "cuda"] {
            let text = screen(&state(backend));
            // the last request: 84 decode blob reads (6 MiB), 16 in prefill (2 MiB)
            assert_eq!(cell(&text, "decode blobs", "last request"), "84");
            assert_eq!(cell(&text, "blobs/tok", "last request"), "2.00");
            assert_eq!(cell(&text, "decode MiB", "last request"), "6.0");
            assert_eq!(cell(&text, "prefill blobs", "last request"), "16");
            assert_eq!(cell(&text, "prefill MiB", "last request"), "2.0");
            // since start: 300 decode blob reads for 100 tokens, 32 MiB; 64 in prefill, 8 MiB
            assert_eq!(cell(&text, "decode blobs", "since start"), "300");
            assert_eq!(cell(&text, "blobs/tok", "since start"), "3.00");
            assert_eq!(cell(&text, "decode MiB", "since start"), "32.0");
            assert_eq!(cell(&text, "prefill MiB", "since start"), "8.0");
            // the history reads as blobs/tok does: decode only
            assert_eq!(cell(&text, "decode MiB", "#3"), "6.0");
            assert!(!text.contains("file MiB") && !text.contains("file blobs"), "{text}");
        }
    }

    #[test]
    fn swaps_are_with_the_vram_columns() {
        let gpu = screen(&state("cuda"));
        assert_eq!(cell(&gpu, "VRAM hit", "last request"), "90.0%");
        assert_eq!(cell(&gpu, "VRAM hits", "last request"), "900");
        assert_eq!(cell(&gpu, "swaps", "last request"), "37");
        assert_eq!(cell(&gpu, "PCIe entries", "last request"), "11");
        assert_eq!(cell(&gpu, "prefetched", "last request"), "24");
        assert_eq!(cell(&gpu, "prefetch used", "last request"), "18");
        assert_eq!(cell(&gpu, "unused MiB", "last request"), "1.5");
        assert_eq!(cell(&gpu, "VRAM hit", "since start"), "80.0%");
        assert_eq!(cell(&gpu, "swaps", "since start"), "250");
        // every column fits at 120 columns, the history's VRAM hit rate included
        assert_eq!(cell(&gpu, "VRAM hit", "#3"), "90.0%");
        assert_eq!(cell(&gpu, "promoted", "#3"), "0");
        let cpu = screen(&state("cpu"));
        for h in ["swaps", "PCIe", "prefetch"] {
            assert!(!cpu.contains(h), "no {h} column on a CPU daemon:\n{cpu}");
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
        let row = text.lines().find(|l| l.contains("#3 ")).unwrap_or_else(|| panic!("no #3 row:\n{text}"));
        assert!(row.contains("length"), "{text}");
    }

    #[test]
    fn waits_for_a_first_request() {
        let text = screen(&ViewState::new(pb::StatsReply::default()));
        assert!(text.contains("waiting for a request") && text.contains("dense model"), "{text}");
    }
}
