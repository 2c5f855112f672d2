//! `strata-tools`: Strata's development and benchmark commands, kept out of the service binary
//! (`strata-daemon` only serves). `replay` is also meant for users: it replays a `--dump-routing` trace through
//! the cache policies (docs/FLAGS.md).

use anyhow::Result;
use clap::Parser;

mod bench_attention_cmd;
mod bench_experts_cmd;
#[cfg(feature = "cuda")]
mod gpu_cmd;
mod perplexity_cmd;
mod replay_cmd;
mod synth_cmd;

#[derive(Parser, Debug)]
#[command(name = "strata-tools", version, about = "Strata's development, benchmark and trace-replay commands")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Replay a --dump-routing trace through the cache policies (seed, lrfu, LRU, Belady) and print hit rates,
    /// one-token reuse and per-layer skew.
    Replay(replay_cmd::ReplayArgs),
    /// Perplexity of a model over a text file (chunks of --ctx tokens, second half of each scored, as
    /// llama.cpp's llama-perplexity).
    Perplexity(perplexity_cmd::PerplexityArgs),
    /// Write a GGUF of a real MoE geometry with random weights (Mixtral-8x7B, OLMoE, Qwen3-30B-A3B,
    /// Qwen2-57B-A14B, tiny) for scale benchmarks, as `llama` or as the preset's own architecture.
    SynthMoe(synth_cmd::SynthArgs),
    /// CPU expert throughput: one token through a half-cached layer's experts, from random blobs of a preset's
    /// geometry in RAM (µs per layer, GB/s, share of the host RAM read rate); no model or GPU needed.
    BenchExperts(bench_experts_cmd::BenchExpertsArgs),
    /// CPU decode attention: one query row over an f16 KV cache of --ctx positions, layer after layer (µs per
    /// layer, K/V read GB/s beside the host RAM read rate); no model needed.
    BenchAttention(bench_attention_cmd::BenchAttentionArgs),
    /// Check the GPU kernels and forward pass against the CPU path (needs a GPU).
    #[cfg(feature = "cuda")]
    GpuCheck(gpu_cmd::CheckArgs),
    /// Benchmark decode and prompt speed over expert-cache sizes and adaptive-tier modes (needs a GPU).
    #[cfg(feature = "cuda")]
    BenchGpu(gpu_cmd::BenchArgs),
    /// Compile the CUDA kernels for a GPU architecture into the kernel cache ahead of the daemon's first start
    /// (needs NVRTC, not a GPU).
    #[cfg(feature = "cuda")]
    BuildKernels(gpu_cmd::BuildKernelsArgs),
}

/// Runs one command; an error ends it with one line on stderr (its causes joined by ": ", no backtrace even with
/// `RUST_BACKTRACE` set) and exit status 1.
fn main() -> std::process::ExitCode {
    // Output piped into `head` and the like ends the process quietly when the reader goes away, as other
    // command-line tools do, instead of a panic in the next println!.
    // SAFETY: restoring the default disposition of SIGPIPE at start, before any thread exists.
    unsafe {
        let _ = nix::sys::signal::signal(nix::sys::signal::Signal::SIGPIPE, nix::sys::signal::SigHandler::SigDfl);
    }
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strata-tools: {}", strata::service::errors::one_line(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match Args::parse().command {
        Command::Replay(r) => replay_cmd::run(r),
        Command::Perplexity(p) => perplexity_cmd::run(p),
        Command::SynthMoe(a) => synth_cmd::run(a),
        Command::BenchExperts(a) => bench_experts_cmd::run(a),
        Command::BenchAttention(a) => bench_attention_cmd::run(a),
        #[cfg(feature = "cuda")]
        Command::GpuCheck(a) => gpu_cmd::check(a),
        #[cfg(feature = "cuda")]
        Command::BenchGpu(a) => gpu_cmd::bench(a),
        #[cfg(feature = "cuda")]
        Command::BuildKernels(a) => gpu_cmd::build_kernels(a),
    }
}
