//! The control API, transport-neutral (DESIGN.md §7): generation, statistics, live knobs, expert residency,
//! profile save and the counter stream as plain Rust calls over the engine and the expert store. The gRPC
//! service (`crate::service::grpc`) is a thin adapter that maps messages and [`ApiError`] kinds to its own
//! types; an HTTP front end maps the same calls to its routes.
//!
//! Calls that do blocking work (tokenizing a prompt, writing a profile) say so: async front ends run them on a
//! blocking thread.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::mpsc::{Receiver, UnboundedReceiver};

use crate::engine::request::{prepare, RawRequest};
use crate::engine::stats::rss_bytes;
pub use crate::engine::TierCheck;
use crate::engine::{Counters, Engine, Event, GenerateParams, TierCheckError, Totals};
use crate::model::tool_calls::ToolParse;
use crate::model::{Model, Tokenizer};
use crate::tiers::arena::Lock;
use crate::tiers::knobs::{Knob, Knobs};
use crate::tiers::store::{ExpertResidency, ExpertStore, LayerResidency, TierTotals};

/// Why a call was refused, by kind (each front end maps the kind to its own status: gRPC codes, HTTP statuses).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The request itself is bad (a field out of range, an unknown knob, a layer the model lacks); nothing
    /// changed.
    #[error("{0}")]
    InvalidArgument(String),
    /// As [`ApiError::InvalidArgument`], about one named request field (`param`: `tools`, `tool_choice`,
    /// `messages`).
    #[error("{message}")]
    InvalidField {
        /// The field.
        param: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The request is fine but the daemon's state does not allow it (no experts in a dense model, no profile
    /// path configured, a profile that could not be written).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The daemon cannot serve it now (shutting down).
    #[error("{0}")]
    Unavailable(String),
}

/// What the daemon runs: the model's hyper-parameters and file, and the engine's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSummary {
    /// Path of the GGUF file.
    pub path: String,
    /// `general.name`.
    pub name: String,
    /// `general.architecture`.
    pub architecture: String,
    /// Transformer blocks.
    pub n_layers: u32,
    /// Hidden size.
    pub n_embd: u32,
    /// Query heads.
    pub n_head: u32,
    /// Key/value heads.
    pub n_head_kv: u32,
    /// Vocabulary size.
    pub n_vocab: u32,
    /// Training context length, tokens.
    pub n_ctx_train: u32,
    /// Context length the engine runs with, tokens.
    pub n_ctx: u32,
    /// Routed experts per layer (0 = dense).
    pub n_expert: u32,
    /// Experts per token (top-k).
    pub n_expert_used: u32,
    /// File size, bytes.
    pub file_bytes: u64,
    /// Parameters (elements of every tensor).
    pub n_params: u64,
    /// The most common matrix format (e.g. `Q4_1`).
    pub file_type: String,
    /// CPU worker threads.
    pub threads: u32,
    /// The backend that runs the forward passes (`cpu`, `cuda`).
    pub backend: String,
    /// The KV cache's row type (`--kv-type`: `f16`, `q8_0`).
    pub kv_type: String,
}

/// The daemon's statistics now.
#[derive(Debug, Clone)]
pub struct Stats {
    /// The model.
    pub model: ModelSummary,
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// Request totals since start.
    pub totals: Totals,
    /// Expert-tier totals since start (zeros for a dense model).
    pub tiers: TierTotals,
    /// The last finished request's counters.
    pub last_request: Option<Counters>,
    /// Requests waiting.
    pub queued: u32,
    /// A request is running.
    pub busy: bool,
    /// Daemon resident set size, bytes.
    pub rss_bytes: u64,
    /// Daemon version.
    pub version: &'static str,
}

/// One live knob.
#[derive(Debug, Clone, PartialEq)]
pub struct KnobInfo {
    /// The knob (its name, default, range and documentation: [`Knob::spec`]).
    pub knob: Knob,
    /// Current value.
    pub value: f64,
    /// Whether it acts on this model and build (its tier exists).
    pub active: bool,
    /// Why not, when inactive ([`Knobs::inactive_reason`]).
    pub inactive_reason: Option<String>,
}

/// A knob change.
#[derive(Debug, Clone, PartialEq)]
pub struct KnobChange {
    /// The knob.
    pub knob: Knob,
    /// Value before.
    pub old: f64,
    /// Value now.
    pub new: f64,
    /// Whether it acts on this model and build.
    pub active: bool,
    /// Why not, when inactive.
    pub inactive_reason: Option<String>,
}

/// Where the experts are, per layer and per expert.
#[derive(Debug, Clone)]
pub struct Residency {
    /// Per layer (index, counts and bytes per tier).
    pub layers: Vec<(u32, LayerResidency)>,
    /// Per expert (all, one layer's, or the `top` most used).
    pub experts: Vec<ExpertResidency>,
    /// The RAM copy is page-locked.
    pub ram_locked: bool,
    /// RAM copy mode: `all`, `budget`, `mmap`, `resident` or `resident-budget`
    /// ([`crate::tiers::store::ResidentMode::name`]).
    pub mode: &'static str,
}

/// A saved expert profile.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedProfile {
    /// Where it was written.
    pub path: PathBuf,
    /// Experts ranked in it.
    pub ranked: usize,
}

/// One update of the counter stream.
#[derive(Debug, Clone)]
pub struct CounterUpdate {
    /// `true`: the running request's live counters; `false`: a request that just finished.
    pub running: bool,
    /// The counters.
    pub counters: Counters,
}

/// A request [`Control::prepare`] validated and tokenized (only it makes one: the engine trusts its prompt and
/// lengths).
#[derive(Debug)]
pub struct Prepared(GenerateParams);

impl Prepared {
    /// How to find tool calls in the reply: `Some` when tools were offered to a template whose call format is
    /// known (see [`crate::model::tool_calls`]).
    pub fn tool_parse(&self) -> Option<&ToolParse> {
        self.0.tool_parse.as_ref()
    }
}

/// The control API over a running engine and its model.
pub struct Control {
    engine: Arc<Engine>,
    tok: Arc<Tokenizer>,
    summary: ModelSummary,
    store: Option<Arc<ExpertStore>>,
    knobs: Arc<Knobs>,
    profile_save: Option<PathBuf>,
}

impl Control {
    /// The API for a loaded model and a running engine. `knobs` are the live knobs (the store's for an MoE
    /// model); `profile_save` is the `--expert-profile-save` path.
    pub fn new(
        engine: Arc<Engine>,
        model: &Model,
        tok: Arc<Tokenizer>,
        knobs: Arc<Knobs>,
        profile_save: Option<PathBuf>,
    ) -> Self {
        let c = &model.cfg;
        let summary = ModelSummary {
            path: model.file.path().display().to_string(),
            name: c.name.clone(),
            architecture: c.arch.clone(),
            n_layers: c.n_layer as u32,
            n_embd: c.n_embd as u32,
            n_head: c.n_head as u32,
            n_head_kv: c.n_head_kv as u32,
            n_vocab: c.n_vocab as u32,
            n_ctx_train: c.n_ctx_train as u32,
            n_ctx: engine.cfg.n_ctx as u32,
            n_expert: c.n_expert as u32,
            n_expert_used: c.n_expert_used as u32,
            file_bytes: model.file.file_len(),
            n_params: model.n_params(),
            file_type: format!("{:?}", model.file_type()),
            threads: engine.cfg.threads as u32,
            backend: model.backend.name().to_string(),
            kv_type: model.kv_type().name().to_string(),
        };
        Control { engine, tok, summary, store: model.experts.clone(), knobs, profile_save }
    }

    /// The model summary.
    pub fn model(&self) -> &ModelSummary {
        &self.summary
    }

    /// Validates and tokenizes a request (blocking: tokenization and the chat template, tools included, run
    /// here). Errors: [`ApiError::InvalidField`] or [`ApiError::InvalidArgument`] for a request that fails
    /// validation (counted as rejected).
    pub fn prepare(&self, raw: &RawRequest) -> Result<Prepared, ApiError> {
        prepare(raw, &self.tok, self.engine.cfg.n_ctx).map(Prepared).map_err(|e| {
            self.engine.stats.record_rejected();
            match e.param {
                Some(param) => ApiError::InvalidField { param, message: e.message },
                None => ApiError::InvalidArgument(e.message),
            }
        })
    }

    /// Queues a request [`Control::prepare`] validated; its token events and final counters arrive on the
    /// receiver, and dropping the receiver cancels it.
    pub fn submit(&self, p: Prepared) -> UnboundedReceiver<Event> {
        self.engine.submit(p.0)
    }

    /// [`Control::prepare`] then [`Control::submit`] (blocking). Errors: as [`Control::prepare`].
    pub fn generate(&self, raw: &RawRequest) -> Result<UnboundedReceiver<Event>, ApiError> {
        Ok(self.submit(self.prepare(raw)?))
    }

    /// The statistics now.
    pub fn stats(&self) -> Stats {
        let (totals, last_request) = self.engine.stats.snapshot();
        Stats {
            model: self.summary.clone(),
            uptime_s: self.engine.stats.started.elapsed().as_secs_f64(),
            totals,
            tiers: self.store.as_ref().map(|st| st.counters.totals()).unwrap_or_default(),
            last_request,
            queued: self.engine.queued() as u32,
            busy: self.engine.busy(),
            rss_bytes: rss_bytes(),
            version: env!("CARGO_PKG_VERSION"),
        }
    }

    /// Every live knob.
    pub fn knobs(&self) -> Vec<KnobInfo> {
        self.knobs
            .all()
            .into_iter()
            .map(|(knob, value)| KnobInfo {
                knob,
                value,
                active: Knobs::is_active(knob, self.store.is_some()),
                inactive_reason: Knobs::inactive_reason(knob, self.store.is_some()),
            })
            .collect()
    }

    /// Sets knob `name` (dashes allowed) from text; it takes effect at the next window. Errors:
    /// [`ApiError::InvalidArgument`] for an unknown knob or a bad value (nothing changes).
    pub fn set_knob(&self, name: &str, value: &str) -> Result<KnobChange, ApiError> {
        let (knob, old, new) = self.knobs.set(name, value).map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        let active = Knobs::is_active(knob, self.store.is_some());
        let inactive_reason = Knobs::inactive_reason(knob, self.store.is_some());
        tracing::info!(knob = knob.name(), old, new, active, "knob set; takes effect at the next window");
        Ok(KnobChange { knob, old, new, active, inactive_reason })
    }

    /// Where the experts are: every layer (or `layer` only) and its experts; `top` > 0 keeps the `top` most used
    /// experts (by usage, then heat). Errors: [`ApiError::FailedPrecondition`] for a dense model,
    /// [`ApiError::InvalidArgument`] for a layer the model lacks.
    pub fn residency(&self, layer: Option<u32>, top: u32) -> Result<Residency, ApiError> {
        let store = self.store()?;
        let (layers, experts) = store.residency();
        if let Some(l) = layer {
            if l as usize >= layers.len() {
                return Err(ApiError::InvalidArgument(format!("layer {l}: the model has {} layers", layers.len())));
            }
        }
        let mut experts: Vec<ExpertResidency> =
            experts.into_iter().filter(|e| layer.is_none_or(|l| e.layer == l)).collect();
        if top > 0 {
            experts.sort_by(|a, b| b.usage.total_cmp(&a.usage).then(b.heat.total_cmp(&a.heat)));
            experts.truncate(top as usize);
        }
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| (i as u32, l))
            .filter(|(i, _)| layer.is_none_or(|l| *i == l))
            .collect();
        let mode = store.mode().name();
        Ok(Residency { layers, experts, ram_locked: store.ram_lock() == Lock::Locked, mode })
    }

    /// Saves the expert profile now (blocking: writes the file) to `path`, or to the `--expert-profile-save`
    /// path when `None`. Errors: [`ApiError::FailedPrecondition`] for a dense model or a write that failed,
    /// [`ApiError::InvalidArgument`] when no path is given and none is configured.
    pub fn save_profile(&self, path: Option<PathBuf>) -> Result<SavedProfile, ApiError> {
        let store = self.store()?;
        let path = match path {
            Some(p) => p,
            None => self.profile_save.clone().ok_or_else(|| {
                ApiError::InvalidArgument("no path given and the daemon runs without --expert-profile-save".into())
            })?,
        };
        let prof = store.profile_now();
        prof.save(&path).map_err(|e| ApiError::FailedPrecondition(e.to_string()))?;
        tracing::info!(path = %path.display(), ranked = prof.ranked.len(), "expert profile saved");
        Ok(SavedProfile { path, ranked: prof.ranked.len() })
    }

    /// Compares every tier copy of the experts with the model file's bytes (every RAM place and VRAM slot; see
    /// [`crate::backend::Backend::verify_tiers`]). It waits in the engine's queue behind the requests queued before
    /// it and runs between requests; it reads every copy, so it takes about as long as reading the experts' bytes
    /// once. Errors: [`ApiError::FailedPrecondition`] for a dense model or a check that failed (a device error),
    /// [`ApiError::Unavailable`] when the daemon is shutting down.
    pub async fn verify_tiers(&self) -> Result<TierCheck, ApiError> {
        self.store()?;
        match self.engine.verify_tiers().await {
            Ok(Ok(Some(c))) => Ok(c),
            Ok(Ok(None)) => Err(ApiError::FailedPrecondition("the model has no experts".into())),
            Ok(Err(e @ TierCheckError::ShuttingDown)) => Err(ApiError::Unavailable(e.to_string())),
            Ok(Err(e)) => Err(ApiError::FailedPrecondition(e.to_string())),
            // the engine thread dropped the reply: it has stopped
            Err(_) => Err(ApiError::Unavailable(TierCheckError::ShuttingDown.to_string())),
        }
    }

    /// The counter stream: a finished request's counters once, and the running request's live counters at
    /// least every 250 ms while it runs. Ends with [`ApiError::Unavailable`] when the daemon shuts down, and when
    /// the receiver is dropped. Spawns a task on the current tokio runtime (panics outside one).
    pub fn watch(&self) -> Receiver<Result<CounterUpdate, ApiError>> {
        let stats = self.engine.stats.clone();
        let engine = self.engine.clone();
        let mut rx = stats.updates.subscribe();
        let (tx, out) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut last_done = stats.snapshot().1.map(|c| c.request_id);
            loop {
                // wake on an update, and at least every 250 ms while a request runs
                let _ = tokio::time::timeout(std::time::Duration::from_millis(250), rx.changed()).await;
                if engine.is_shutting_down() {
                    // end the stream so the server can stop (graceful shutdown waits for open streams)
                    let _ = tx.send(Err(ApiError::Unavailable("daemon is shutting down".into()))).await;
                    return;
                }
                let (_, done) = stats.snapshot();
                let mut msgs = Vec::new();
                if let Some(c) = done {
                    if Some(c.request_id) != last_done {
                        last_done = Some(c.request_id);
                        msgs.push(CounterUpdate { running: false, counters: c });
                    }
                }
                if let Some(c) = stats.live() {
                    msgs.push(CounterUpdate { running: true, counters: c });
                }
                for m in msgs {
                    if tx.send(Ok(m)).await.is_err() {
                        return; // the client went away
                    }
                }
                if tx.is_closed() {
                    return;
                }
            }
        });
        out
    }

    fn store(&self) -> Result<&Arc<ExpertStore>, ApiError> {
        self.store.as_ref().ok_or_else(|| ApiError::FailedPrecondition("the model has no experts".into()))
    }
}
