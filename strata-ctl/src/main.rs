//! `strata-ctl`: command-line client of strata-daemon's control plane
//! (`strata.v1.Strata` over a Unix socket).
//!
//! Exit codes: 0 success, 1 the daemon refused or failed the request,
//! 2 the daemon cannot be reached.

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
        /// Prompt text (with --chat: the user's message).
        prompt: String,
        /// Wrap the prompt as a user message in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// System message (with --chat).
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
    /// Model summary, uptime, totals and the last request's counters.
    Stats,
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
    /// RNG seed.
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

fn counters_json(c: &pb::RequestCounters) -> serde_json::Value {
    json!({
        "request_id": c.request_id,
        "prompt_tokens": c.prompt_tokens,
        "prompt_reused": c.prompt_reused,
        "generated_tokens": c.generated_tokens,
        "queue_ms": c.queue_ms,
        "prompt_ms": c.prompt_ms,
        "decode_ms": c.decode_ms,
        "prompt_tok_s": c.prompt_tok_s,
        "decode_tok_s": c.decode_tok_s,
        "windows": c.windows,
        "expert_lookups": c.expert_lookups,
        "finish_reason": finish_name(c.finish_reason),
    })
}

fn counters_line(c: &pb::RequestCounters) -> String {
    format!(
        "prompt {} tokens ({} reused) in {:.1} ms ({:.1} tok/s), generated {} tokens in {:.1} ms ({:.1} tok/s), finish: {}",
        c.prompt_tokens,
        c.prompt_reused,
        c.prompt_ms,
        c.prompt_tok_s,
        c.generated_tokens,
        c.decode_ms,
        c.decode_tok_s,
        finish_name(c.finish_reason)
    )
}

fn status_err(s: tonic::Status) -> (u8, String) {
    let code = if s.code() == tonic::Code::Unavailable && s.message().contains("connect") { 2 } else { 1 };
    (code, format!("{:?}: {}", s.code(), s.message()))
}

async fn run(cli: Cli) -> Result<(), (u8, String)> {
    let socket = cli.socket.clone().unwrap_or_else(strata_proto::default_socket_path);
    let mut client = connect(socket).await.map_err(|m| (2, m))?;
    match cli.cmd {
        Cmd::Generate { prompt, chat, system, max_tokens, sampling, stop } => {
            let mut messages = Vec::new();
            if chat {
                if let Some(s) = system {
                    messages.push(pb::ChatMessage { role: "system".into(), content: s });
                }
                messages.push(pb::ChatMessage { role: "user".into(), content: prompt.clone() });
            }
            let req = pb::GenerateRequest {
                prompt: if chat { String::new() } else { prompt },
                messages,
                max_tokens,
                sampling: Some(sampling.into()),
                stop,
            };
            let mut stream = client.generate(req).await.map_err(status_err)?.into_inner();
            let mut out = std::io::stdout();
            let mut printed = false;
            loop {
                let ev = match stream.message().await {
                    Ok(Some(ev)) => ev,
                    Ok(None) => break,
                    Err(e) => {
                        if printed {
                            println!(); // keep the error off the streamed text's line
                        }
                        return Err(status_err(e));
                    }
                };
                match ev.event {
                    Some(pb::generate_event::Event::Token(t)) => {
                        if !cli.json {
                            let _ = out.write_all(t.text.as_bytes());
                            let _ = out.flush();
                            printed |= !t.text.is_empty();
                        }
                    }
                    Some(pb::generate_event::Event::Done(d)) => {
                        let c = d.counters.unwrap_or_default();
                        if cli.json {
                            println!("{}", json!({ "text": d.text, "counters": counters_json(&c) }));
                        } else {
                            let _ = out.write_all(d.tail.as_bytes());
                            println!();
                            eprintln!("{}", counters_line(&c));
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
                println!(
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
                            "file_bytes": m.file_bytes, "n_params": m.n_params, "file_type": m.file_type, "threads": m.threads,
                        },
                        "totals": {
                            "requests": t.requests, "prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens,
                            "prompt_ms": t.prompt_ms, "decode_ms": t.decode_ms, "cancelled": t.cancelled,
                            "rejected": t.rejected, "windows": t.windows, "expert_lookups": t.expert_lookups,
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
                println!(
                    "strata-daemon {}   up {:.0} s   {}   queued {}   RSS {:.1} MiB",
                    s.version,
                    s.uptime_s,
                    if s.busy { "busy" } else { "idle" },
                    s.queued,
                    s.rss_bytes as f64 / 1048576.0
                );
                println!("model        {} ({})", m.name, m.path);
                println!("             {} {}, {} layers, n_embd {}, heads {}/{} kv, vocab {}, {:.1} M params, {} ({:.1} MiB)", m.architecture, experts, m.n_layers, m.n_embd, m.n_head, m.n_head_kv, m.n_vocab, m.n_params as f64 / 1e6, m.file_type, m.file_bytes as f64 / 1048576.0);
                println!("context      {} tokens (trained {}), {} CPU threads", m.n_ctx, m.n_ctx_train, m.threads);
                println!(
                    "requests     {} finished (of which {} cancelled), {} rejected",
                    t.requests, t.cancelled, t.rejected
                );
                println!(
                    "prompt       {} tokens in {:.1} ms ({:.1} tok/s)",
                    t.prompt_tokens,
                    t.prompt_ms,
                    rate(t.prompt_tokens, t.prompt_ms)
                );
                println!(
                    "decode       {} tokens in {:.1} ms ({:.1} tok/s), {} windows",
                    t.generated_tokens,
                    t.decode_ms,
                    rate(t.generated_tokens, t.decode_ms),
                    t.windows
                );
                if let Some(c) = &s.last_request {
                    println!("last request #{}: {}", c.request_id, counters_line(c));
                }
            }
            Ok(())
        }
    }
}

fn main() -> ExitCode {
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
