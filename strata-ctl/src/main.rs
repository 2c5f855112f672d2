//! `strata-ctl`: command-line client of strata-daemon's control plane
//! (`strata.v1.Strata` over a Unix socket).
//!
//! Exit codes: 0 success, 1 the daemon refused or failed the request,
//! 2 the daemon cannot be reached (or stopped during `watch`) or the command line is invalid.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use hyper_util::rt::TokioIo;
use serde_json::json;
use strata_proto::v1 as pb;
use strata_proto::v1::strata_client::StrataClient;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

mod watch;

/// Writes one line to standard output, as `println!` does, but ends the process quietly with status 0 when the
/// reader has gone (`strata-ctl generate ... | head`) instead of panicking.
macro_rules! outln {
    () => {
        $crate::out_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::out_line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

/// The body of [`outln!`]: the formatted line and a newline under one lock of standard output.
///
/// A closed pipe ends the process with status 0 (the reader asked for no more); any other write error ends it
/// with status 1 and one line on standard error.
pub(crate) fn out_line(args: std::fmt::Arguments<'_>) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_fmt(args).and_then(|()| o.write_all(b"\n")) {
        stdout_failed(e);
    }
}

/// Writes streamed text to standard output and flushes it; ends the process as [`out_line`] does on error.
pub(crate) fn out_text(text: &[u8]) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_all(text).and_then(|()| o.flush()) {
        stdout_failed(e);
    }
}

/// Ends the process after a failed write to standard output: quietly for a reader that has gone, with one line
/// on standard error otherwise.
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("strata-ctl: writing to standard output: {e}");
    std::process::exit(1);
}

#[derive(Parser, Debug)]
#[command(
    name = "strata-ctl",
    version,
    about = "Control strata-daemon over its Unix socket",
    allow_negative_numbers = true
)]
struct Cli {
    /// Daemon socket [default: $XDG_RUNTIME_DIR/strata.sock, else /tmp/strata-<uid>.sock]
    #[arg(long, global = true, env = "STRATA_SOCKET")]
    socket: Option<PathBuf>,
    /// Print JSON instead of human-readable output.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Generate text; prints it as it streams, then the request's counters.
    #[command(allow_negative_numbers = true)]
    Generate {
        /// Prompt text (with --chat or --messages: the user's message, added after the history).
        #[arg(required_unless_present = "messages")]
        prompt: Option<String>,
        /// Wrap the prompt as a user message in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// A conversation so far: JSON array of {"role": ..., "content": ...} ("-" reads stdin); rendered with
        /// the model's chat template (implies --chat).
        #[arg(long, value_name = "FILE")]
        messages: Option<std::path::PathBuf>,
        /// System message (implies --chat).
        #[arg(long)]
        system: Option<String>,
        /// Maximum tokens to generate.
        #[arg(long, default_value_t = 128)]
        max_tokens: u32,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Stop string (repeatable).
        #[arg(long)]
        stop: Vec<String>,
    },
    /// Model summary, uptime, totals (with the expert tiers) and the last request's counters.
    Stats,
    /// Set a live knob (dashes or underscores): `strata-ctl set ram-adapt 8`. Takes effect at the next window.
    #[command(allow_negative_numbers = true)]
    Set {
        /// Knob name (see `strata-ctl get`).
        knob: String,
        /// New value.
        value: String,
    },
    /// Show every knob, or one.
    Get {
        /// Knob name.
        knob: Option<String>,
    },
    /// Where the experts are: per layer experts and bytes per tier, and the hottest experts.
    Residency {
        /// Only this layer.
        #[arg(long)]
        layer: Option<u32>,
        /// Show the N experts with the highest usage and the N layers holding the most bytes outside VRAM
        /// [default: 10 experts, every layer].
        #[arg(long, value_name = "N")]
        top: Option<u32>,
    },
    /// Check that every tier copy of the experts equals the model file's bytes (every RAM place and VRAM slot;
    /// in the resident mode, that no expert is in both). Runs on the daemon between requests and reads every
    /// copy once. Exit code 3 and one line per fault when a copy differs (1 when the check could not run).
    Verify,
    /// Expert profile commands.
    Profile {
        #[command(subcommand)]
        cmd: ProfileCmd,
    },
    /// Live view of the running request's counters (tok/s, blob reads per token, promotions, hit rate; a long
    /// prompt's prefill as `prefill` with prompt tokens done / total) and each finished request's: a screen
    /// refreshed in place on a terminal (q, Esc or Ctrl-C quits), else one line per update. Runs until interrupted
    /// (`--count N` stops after N finished requests); the daemon stopping ends it with exit code 2.
    Watch {
        /// Stop after this many finished requests (0 = never).
        #[arg(long, default_value_t = 0)]
        count: u32,
        /// One line per update even on a terminal (as when stdout is a pipe or a file).
        #[arg(long)]
        plain: bool,
    },
}

#[derive(Subcommand, Debug)]
enum ProfileCmd {
    /// Save the learned expert profile (to PATH, or the daemon's --expert-profile-save path).
    Save {
        /// Where to write it (a path on the daemon's machine).
        path: Option<String>,
    },
}

/// Sampling options of `generate` (the `SamplingParams` of the request).
#[derive(clap::Args, Debug)]
struct SamplingArgs {
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Top-p in (0, 1].
    #[arg(long)]
    top_p: Option<f32>,
    /// Min-p in [0, 1).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Tokens the repetition penalty looks back over (default 64).
    #[arg(long)]
    repeat_last_n: Option<u32>,
    /// RNG seed (without one, the daemon draws a fresh seed per request).
    #[arg(long)]
    seed: Option<u64>,
}

impl From<SamplingArgs> for pb::SamplingParams {
    fn from(a: SamplingArgs) -> Self {
        pb::SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repeat_penalty: a.repeat_penalty,
            repeat_last_n: a.repeat_last_n,
            seed: a.seed,
        }
    }
}

async fn connect(path: PathBuf) -> Result<StrataClient<Channel>, String> {
    let p = path.clone();
    let channel = Endpoint::try_from("http://strata.sock")
        .map_err(|e| e.to_string())?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
        }))
        .await
        .map_err(|e| {
            let cause = std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_else(|| e.to_string());
            format!("cannot reach strata-daemon at {}: {cause}", path.display())
        })?;
    Ok(StrataClient::new(channel))
}

/// Why a request ended, by the daemon's names for it (its log and the HTTP API's `finish_reason`).
fn finish_name(f: i32) -> &'static str {
    match pb::FinishReason::try_from(f).unwrap_or(pb::FinishReason::Unspecified) {
        pb::FinishReason::Eos => "eos",
        pb::FinishReason::StopString => "stop",
        pb::FinishReason::MaxTokens => "length",
        pb::FinishReason::Context => "context",
        pb::FinishReason::Cancelled => "cancelled",
        pb::FinishReason::Unspecified => "unspecified",
    }
}

/// A knob's value as text: the name for a knob of named choices (its range `a|b|..`, the value an index), else the
/// number.
fn knob_value_text(range: &str, v: f64) -> String {
    let names: Vec<&str> = range.split('|').collect();
    let named = names.len() > 1 && names.iter().all(|n| n.starts_with(|c: char| c.is_ascii_alphabetic()));
    match names.get(v as usize) {
        Some(n) if named && v >= 0.0 && v.fract() == 0.0 => n.to_string(),
        _ => v.to_string(),
    }
}

fn counters_json(c: &pb::RequestCounters) -> serde_json::Value {
    json!({
        "request_id": c.request_id,
        "prompt_tokens": c.prompt_tokens,
        "prompt_reused": c.prompt_reused,
        "prompt_done": c.prompt_done,
        "generated_tokens": c.generated_tokens,
        "queue_ms": c.queue_ms,
        "prompt_ms": c.prompt_ms,
        "decode_ms": c.decode_ms,
        "prompt_tok_s": c.prompt_tok_s,
        "decode_tok_s": c.decode_tok_s,
        "windows": c.windows,
        "expert_lookups": c.expert_lookups,
        "vram_hits": c.vram_hits,
        "hit_rate": c.hit_rate,
        "ram_reads": c.ram_reads,
        "file_blob_reads": c.file_blob_reads,
        "blob_reads_per_token": c.blob_reads_per_token,
        "file_bytes_read": c.file_bytes_read,
        "prefill_file_blob_reads": c.prefill_file_blob_reads,
        "prefill_file_bytes_read": c.prefill_file_bytes_read,
        "ram_promotions": c.ram_promotions,
        "promotion_bytes": c.promotion_bytes,
        "promotions_per_token": c.promotions_per_token,
        "rss_bytes": c.rss_bytes,
        "swaps": c.swaps,
        "pcie_entries": c.pcie_entries,
        "prefetched": c.prefetched,
        "prefetch_hits": c.prefetch_hits,
        "prefetch_wasted_bytes": c.prefetch_wasted_bytes,
        "finish_reason": finish_name(c.finish_reason),
    })
}

/// The GPU tiers' counters beside VRAM hits and swaps, as text: decode routing entries computed after a PCIe upload,
/// and the next-layer prefetch's uploads, the ones used and the bytes not used (all 0 on a CPU daemon, or while
/// neither `--pcie-frac` nor `--prefetch` acts).
fn gpu_clause(pcie_entries: u64, prefetched: u64, prefetch_hits: u64, prefetch_wasted_bytes: u64) -> String {
    format!(
        "{pcie_entries} PCIe entries, {prefetched} prefetched ({prefetch_hits} used, {:.1} MiB unused)",
        prefetch_wasted_bytes as f64 / 1048576.0
    )
}

fn tiers_line(c: &pb::RequestCounters) -> String {
    let mib = |b: u64| b as f64 / 1048576.0;
    // a request knows no backend: the GPU clause when it has something to say
    let gpu = if c.pcie_entries > 0 || c.prefetched > 0 {
        format!("; GPU: {}", gpu_clause(c.pcie_entries, c.prefetched, c.prefetch_hits, c.prefetch_wasted_bytes))
    } else {
        String::new()
    };
    format!(
        "experts: {} lookups, {} VRAM hits ({:.1}%), {} swaps into VRAM, {} RAM reads, {} file blob reads in decode ({:.2} per token, {:.1} MiB), {} in prefill ({:.1} MiB), {} RAM promotions ({:.2} per token){gpu}",
        c.expert_lookups,
        c.vram_hits,
        c.hit_rate * 100.0,
        c.swaps,
        c.ram_reads,
        c.file_blob_reads,
        c.blob_reads_per_token,
        mib(c.file_bytes_read.saturating_sub(c.prefill_file_bytes_read)),
        c.prefill_file_blob_reads,
        mib(c.prefill_file_bytes_read),
        c.ram_promotions,
        c.promotions_per_token
    )
}

/// `1 token`, `n tokens` (`what` in the singular).
fn count(n: impl Into<u64>, what: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

fn counters_line(c: &pb::RequestCounters) -> String {
    // the prompt rate counts the tokens computed: with a reused prefix, say how many those were
    let prompt = if c.prompt_reused > 0 {
        format!(
            "({} reused; {} computed in {:.1} ms, {:.1} tok/s)",
            c.prompt_reused,
            c.prompt_tokens.saturating_sub(c.prompt_reused),
            c.prompt_ms,
            c.prompt_tok_s
        )
    } else {
        format!("(0 reused) in {:.1} ms ({:.1} tok/s)", c.prompt_ms, c.prompt_tok_s)
    };
    format!(
        "prompt {} {prompt}, generated {} in {:.1} ms ({:.1} tok/s), finish: {}",
        count(c.prompt_tokens, "token"),
        count(c.generated_tokens, "token"),
        c.decode_ms,
        c.decode_tok_s,
        finish_name(c.finish_reason)
    )
}

fn status_err(s: tonic::Status) -> (u8, String) {
    let code = if s.code() == tonic::Code::Unavailable && s.message().contains("connect") { 2 } else { 1 };
    (code, format!("{:?}: {}", s.code(), s.message()))
}

/// Reads a conversation: a JSON array of `{"role": ..., "content": ...}` objects from `path` (`-` = stdin).
fn read_messages(path: &std::path::Path) -> Result<Vec<pb::ChatMessage>, String> {
    #[derive(serde::Deserialize)]
    struct Msg {
        role: String,
        content: String,
    }
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).map_err(|e| format!("--messages -: {e}"))?
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("--messages {}: {e}", path.display()))?
    };
    let msgs: Vec<Msg> = serde_json::from_str(&text)
        .map_err(|e| format!("--messages {}: expected a JSON array of {{role, content}}: {e}", path.display()))?;
    Ok(msgs.into_iter().map(|m| pb::ChatMessage { role: m.role, content: m.content }).collect())
}

async fn run(cli: Cli) -> Result<(), (u8, String)> {
    let socket = cli.socket.clone().unwrap_or_else(strata_proto::default_socket_path);
    let mut client = connect(socket).await.map_err(|m| (2, m))?;
    match cli.cmd {
        Cmd::Generate { prompt, chat, messages: history, system, max_tokens, sampling, stop } => {
            let chat = chat || history.is_some() || system.is_some();
            let mut messages = Vec::new();
            if chat {
                if let Some(s) = system {
                    messages.push(pb::ChatMessage { role: "system".into(), content: s });
                }
                if let Some(path) = &history {
                    messages.extend(read_messages(path).map_err(|m| (1, m))?);
                }
                if let Some(p) = &prompt {
                    messages.push(pb::ChatMessage { role: "user".into(), content: p.clone() });
                }
            }
            let req = pb::GenerateRequest {
                prompt: if chat { String::new() } else { prompt.unwrap_or_default() },
                messages,
                max_tokens,
                sampling: Some(sampling.into()),
                stop,
            };
            let mut stream = client.generate(req).await.map_err(status_err)?.into_inner();
            let mut printed = false;
            loop {
                let ev = match stream.message().await {
                    Ok(Some(ev)) => ev,
                    Ok(None) => break,
                    Err(e) => {
                        if printed {
                            outln!(); // keep the error off the streamed text's line
                        }
                        return Err(status_err(e));
                    }
                };
                match ev.event {
                    Some(pb::generate_event::Event::Token(t)) => {
                        if !cli.json {
                            out_text(t.text.as_bytes());
                            printed |= !t.text.is_empty();
                        }
                    }
                    Some(pb::generate_event::Event::Done(d)) => {
                        let c = d.counters.unwrap_or_default();
                        if cli.json {
                            outln!("{}", json!({ "text": d.text, "counters": counters_json(&c) }));
                        } else {
                            out_text(d.tail.as_bytes());
                            outln!();
                            eprintln!("{}", counters_line(&c));
                            if c.expert_lookups > 0 || c.prefill_file_blob_reads > 0 {
                                eprintln!("{}", tiers_line(&c));
                            }
                        }
                        return Ok(());
                    }
                    None => {}
                }
            }
            Err((1, "the daemon closed the stream before the request finished".into()))
        }
        Cmd::Stats => {
            let s = client.get_stats(pb::StatsRequest {}).await.map_err(status_err)?.into_inner();
            let m = s.model.clone().unwrap_or_default();
            let t = s.totals.clone().unwrap_or_default();
            if cli.json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "version": s.version,
                        "uptime_s": s.uptime_s,
                        "busy": s.busy,
                        "queued": s.queued,
                        "rss_bytes": s.rss_bytes,
                        "model": {
                            "path": m.path, "name": m.name, "architecture": m.architecture,
                            "n_layers": m.n_layers, "n_embd": m.n_embd, "n_head": m.n_head, "n_head_kv": m.n_head_kv,
                            "n_vocab": m.n_vocab, "n_ctx_train": m.n_ctx_train, "n_ctx": m.n_ctx,
                            "n_expert": m.n_expert, "n_expert_used": m.n_expert_used,
                            "file_bytes": m.file_bytes, "n_params": m.n_params, "file_type": m.file_type, "threads": m.threads, "backend": m.backend, "kv_type": m.kv_type,
                        },
                        "totals": {
                            "requests": t.requests, "prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens,
                            "prompt_ms": t.prompt_ms, "decode_ms": t.decode_ms, "cancelled": t.cancelled,
                            "rejected": t.rejected, "windows": t.windows, "expert_lookups": t.expert_lookups,
                            "vram_hits": t.vram_hits, "ram_reads": t.ram_reads, "file_blob_reads": t.file_blob_reads,
                            "file_bytes_read": t.file_bytes_read, "prefill_file_blob_reads": t.prefill_file_blob_reads, "prefill_file_bytes_read": t.prefill_file_bytes_read,
                            "ram_promotions": t.ram_promotions, "promotion_bytes": t.promotion_bytes,
                            "promotions_refused": t.promotions_refused, "swaps": t.swaps,
                            "pcie_entries": t.pcie_entries, "prefetched": t.prefetched,
                            "prefetch_hits": t.prefetch_hits, "prefetch_wasted_bytes": t.prefetch_wasted_bytes,
                        },
                        "last_request": s.last_request.as_ref().map(counters_json),
                    }))
                    .unwrap()
                );
            } else {
                let rate = |n: u64, ms: f64| if ms > 0.0 { n as f64 * 1000.0 / ms } else { 0.0 };
                let experts = if m.n_expert > 0 {
                    format!("{} experts, top-{}", m.n_expert, m.n_expert_used)
                } else {
                    "dense".into()
                };
                outln!(
                    "strata-daemon {}   up {:.0} s   {}   queued {}   RSS {:.1} MiB",
                    s.version,
                    s.uptime_s,
                    if s.busy { "busy" } else { "idle" },
                    s.queued,
                    s.rss_bytes as f64 / 1048576.0
                );
                outln!("model        {} ({})", m.name, m.path);
                outln!("             {} {}, {} layers, n_embd {}, heads {}/{} kv, vocab {}, {:.1} M params, {} ({:.1} MiB)", m.architecture, experts, m.n_layers, m.n_embd, m.n_head, m.n_head_kv, m.n_vocab, m.n_params as f64 / 1e6, m.file_type, m.file_bytes as f64 / 1048576.0);
                outln!(
                    "context      {} tokens (trained {}), {} KV cache, {} CPU threads, {} backend",
                    m.n_ctx,
                    m.n_ctx_train,
                    if m.kv_type.is_empty() { "f16" } else { &m.kv_type },
                    m.threads,
                    m.backend
                );
                outln!(
                    "requests     {} finished (of which {} cancelled), {} rejected",
                    t.requests,
                    t.cancelled,
                    t.rejected
                );
                outln!(
                    "prompt       {} in {:.1} ms ({:.1} tok/s)",
                    count(t.prompt_tokens, "token"),
                    t.prompt_ms,
                    rate(t.prompt_tokens, t.prompt_ms)
                );
                outln!(
                    "decode       {} in {:.1} ms ({:.1} tok/s), {}",
                    count(t.generated_tokens, "token"),
                    t.decode_ms,
                    rate(t.generated_tokens, t.decode_ms),
                    count(t.windows, "window")
                );
                if m.n_expert > 0 {
                    let per = |a: u64| if t.generated_tokens > 0 { a as f64 / t.generated_tokens as f64 } else { 0.0 };
                    let decode_mib = t.file_bytes_read.saturating_sub(t.prefill_file_bytes_read) as f64 / 1048576.0;
                    outln!(
                        "experts      {} lookups, {} VRAM hits, {} swaps into VRAM, {} RAM reads, {} file blob reads ({:.2} per token, {:.1} MiB)",
                        t.expert_lookups, t.vram_hits, t.swaps, t.ram_reads, t.file_blob_reads, per(t.file_blob_reads),
                        decode_mib
                    );
                    outln!(
                        "             prefill: {} file blob reads ({:.1} MiB)",
                        t.prefill_file_blob_reads,
                        t.prefill_file_bytes_read as f64 / 1048576.0
                    );
                    outln!(
                        "             RAM adapt: {} promotions into the RAM copy ({:.1} MiB, {} refused)",
                        t.ram_promotions,
                        t.promotion_bytes as f64 / 1048576.0,
                        t.promotions_refused
                    );
                    if m.backend == "cuda" || t.pcie_entries > 0 || t.prefetched > 0 {
                        outln!(
                            "             GPU: {}",
                            gpu_clause(t.pcie_entries, t.prefetched, t.prefetch_hits, t.prefetch_wasted_bytes)
                        );
                    }
                }
                if let Some(c) = &s.last_request {
                    outln!("last request #{}: {}", c.request_id, counters_line(c));
                    if m.n_expert > 0 {
                        outln!("             {}", tiers_line(c));
                    }
                }
            }
            Ok(())
        }
        Cmd::Set { knob, value } => {
            let r = client.set_knob(pb::SetKnobRequest { name: knob, value }).await.map_err(status_err)?.into_inner();
            if cli.json {
                outln!(
                    "{}",
                    json!({"name": r.name, "old_value": r.old_value, "new_value": r.new_value, "active": r.active, "inactive_reason": r.inactive_reason})
                );
            } else {
                let note = if r.active { String::new() } else { format!(" (inactive: {})", r.inactive_reason) };
                // a knob of named choices shows names (its range, from the knob list)
                let knobs = client.get_knobs(pb::GetKnobsRequest {}).await.map_err(status_err)?.into_inner().knobs;
                let range = knobs.iter().find(|k| k.name == r.name).map_or("", |k| k.range.as_str());
                let (old, new) = (knob_value_text(range, r.old_value), knob_value_text(range, r.new_value));
                outln!("{}: {old} -> {new}{note}", r.name);
            }
            Ok(())
        }
        Cmd::Get { knob } => {
            let all = client.get_knobs(pb::GetKnobsRequest {}).await.map_err(status_err)?.into_inner().knobs;
            let want = knob.map(|k| k.trim().replace('-', "_"));
            let list: Vec<&pb::Knob> = all.iter().filter(|k| want.as_ref().is_none_or(|w| &k.name == w)).collect();
            if list.is_empty() {
                let names: Vec<&str> = all.iter().map(|k| k.name.as_str()).collect();
                return Err((1, format!("unknown knob (known: {})", names.join(", "))));
            }
            if cli.json {
                let v: Vec<_> = list
                    .iter()
                    .map(|k| json!({"name": k.name, "value": k.value, "default": k.default_value, "range": k.range, "active": k.active, "inactive_reason": k.inactive_reason, "doc": k.doc}))
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&v).unwrap());
            } else {
                for k in list {
                    let act = if k.active { String::new() } else { format!("  (inactive: {})", k.inactive_reason) };
                    outln!("{:<26} {:>8}   {:<16} {}{act}", k.name, knob_value_text(&k.range, k.value), k.range, k.doc);
                }
            }
            Ok(())
        }
        Cmd::Residency { layer, top } => {
            let r = client
                .get_residency(pb::ResidencyRequest { layer, top: top.unwrap_or(10) })
                .await
                .map_err(status_err)?
                .into_inner();
            let top = top.unwrap_or(0);
            let tier = |t: i32| match pb::Tier::try_from(t).unwrap_or(pb::Tier::Unspecified) {
                pb::Tier::Vram => "vram",
                pb::Tier::Ram => "ram",
                pb::Tier::File => "file",
                pb::Tier::Unspecified => "?",
            };
            if cli.json {
                let layers: Vec<_> = r.layers.iter().map(|l| json!({"layer": l.layer, "vram_experts": l.vram_experts, "ram_experts": l.ram_experts, "file_experts": l.file_experts, "vram_bytes": l.vram_bytes, "ram_bytes": l.ram_bytes, "file_bytes": l.file_bytes, "stage": l.stage})).collect();
                let experts: Vec<_> = r.experts.iter().map(|e| json!({"layer": e.layer, "expert": e.expert, "tier": tier(e.tier), "usage": e.usage, "heat": e.heat})).collect();
                outln!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"mode": r.mode, "ram_locked": r.ram_locked, "layers": layers, "experts": experts})
                    )
                    .unwrap()
                );
                return Ok(());
            }
            let mib = |b: u64| b as f64 / 1048576.0;
            outln!("RAM copy: mode {}, {}", r.mode, if r.ram_locked { "locked (mlock)" } else { "pageable" });
            // a layer split: which stage (card) holds each layer's VRAM experts, and each stage's totals
            let split = r.layers.iter().any(|l| l.stage > 0);
            if split {
                let n = r.layers.iter().map(|l| l.stage).max().unwrap_or(0) + 1;
                for s in 0..n {
                    let of: Vec<_> = r.layers.iter().filter(|l| l.stage == s).collect();
                    let (first, last) = (of.first().map_or(0, |l| l.layer), of.last().map_or(0, |l| l.layer));
                    let (v, vb): (u32, u64) =
                        (of.iter().map(|l| l.vram_experts).sum(), of.iter().map(|l| l.vram_bytes).sum());
                    outln!("stage {s}: layers {first}..={last}, {v} experts in VRAM ({:.1} MiB)", mib(vb));
                }
            }
            outln!("layer {}  vram    ram   file   vram MiB    ram MiB   file MiB", if split { "stage" } else { "" });
            // --top N: the N layers holding the most bytes outside VRAM (file first), in layer order
            let mut shown: Vec<&pb::LayerResidency> = r.layers.iter().collect();
            if top > 0 && shown.len() > top as usize {
                shown.sort_by_key(|l| std::cmp::Reverse((l.file_bytes, l.ram_bytes)));
                shown.truncate(top as usize);
                shown.sort_by_key(|l| l.layer);
            }
            for l in &shown {
                let stage = if split { format!("{:>5} ", l.stage) } else { String::new() };
                outln!(
                    "{:>5} {stage}{:>6} {:>6} {:>6} {:>10.1} {:>10.1} {:>10.1}",
                    l.layer,
                    l.vram_experts,
                    l.ram_experts,
                    l.file_experts,
                    mib(l.vram_bytes),
                    mib(l.ram_bytes),
                    mib(l.file_bytes)
                );
            }
            let sum = |f: fn(&pb::LayerResidency) -> u64| r.layers.iter().map(f).sum::<u64>();
            outln!(
                "{:>5} {}{:>6} {:>6} {:>6} {:>10.1} {:>10.1} {:>10.1}{}",
                "all",
                if split { "      " } else { "" },
                sum(|l| l.vram_experts as u64),
                sum(|l| l.ram_experts as u64),
                sum(|l| l.file_experts as u64),
                mib(sum(|l| l.vram_bytes)),
                mib(sum(|l| l.ram_bytes)),
                mib(sum(|l| l.file_bytes)),
                if shown.len() < r.layers.len() {
                    format!("  ({} of {} layers shown: most bytes outside VRAM)", shown.len(), r.layers.len())
                } else {
                    String::new()
                }
            );
            if !r.experts.is_empty() {
                outln!("\nhottest experts\nlayer expert  tier     usage       heat");
                for e in &r.experts {
                    outln!("{:>5} {:>6}  {:<5} {:>8.2} {:>10.1}", e.layer, e.expert, tier(e.tier), e.usage, e.heat);
                }
            }
            Ok(())
        }
        Cmd::Profile { cmd: ProfileCmd::Save { path } } => {
            let r = client
                .save_profile(pb::SaveProfileRequest { path: path.unwrap_or_default() })
                .await
                .map_err(status_err)?
                .into_inner();
            if cli.json {
                outln!("{}", json!({"path": r.path, "ranked": r.ranked}));
            } else {
                outln!("saved {} ranked experts to {}", r.ranked, r.path);
            }
            Ok(())
        }
        Cmd::Verify => {
            let r = client.verify_tiers(pb::VerifyTiersRequest {}).await.map_err(status_err)?.into_inner();
            if cli.json {
                outln!(
                    "{}",
                    json!({"ram_experts": r.ram_experts, "vram_slots_per_stage": r.vram_slots_per_stage,
                        "faults": r.faults, "elapsed_ms": r.elapsed_ms})
                );
            } else {
                let slots = match r.vram_slots_per_stage.len() {
                    0 => String::new(),
                    1 => format!(", {} VRAM slots", r.vram_slots_per_stage[0]),
                    _ => {
                        let per: Vec<String> = r.vram_slots_per_stage.iter().map(|n| n.to_string()).collect();
                        format!(", VRAM slots per stage {}", per.join(" / "))
                    }
                };
                for f in &r.faults {
                    outln!("fault: {f}");
                }
                outln!(
                    "checked {} RAM places{slots} against the file in {:.0} ms: {}",
                    r.ram_experts,
                    r.elapsed_ms,
                    if r.faults.is_empty() { "all equal".to_string() } else { format!("{} faults", r.faults.len()) }
                );
            }
            match r.faults.len() {
                0 => Ok(()),
                1 => Err((3, "1 tier fault".into())),
                n => Err((3, format!("{n} tier faults"))),
            }
        }
        Cmd::Watch { count, plain } => watch::run(&mut client, watch::Mode::choose(cli.json, plain), count).await,
    }
}

fn main() -> ExitCode {
    // SIGPIPE stays ignored (Rust's default): a write to the daemon's socket after the daemon stopped is then an
    // error that says so, and a closed standard output is handled by `outln!`/`out_text`.
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("strata-ctl: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, msg)) => {
            eprintln!("strata-ctl: {msg}");
            ExitCode::from(code)
        }
    }
}
