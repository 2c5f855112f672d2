//! The engine thread: owns the model, the KV cache and the CPU worker pool,
//! and runs queued requests one at a time.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::request::{FinishReason, GenerateParams};
use super::routing_dump::{Phase, RoutingDump};
use super::sampler::Sampler;
use super::stats::{rss_bytes, Counters, Stats};
use super::stream_text::{Push, TextStream};
use crate::model::forward::Scratch;
use crate::model::{KvCache, Logits, Model, Tokenizer};

/// How often the running request's counters are published while it decodes.
const LIVE_EVERY: Duration = Duration::from_millis(100);

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Context length (KV cache positions), tokens.
    pub n_ctx: usize,
    /// CPU worker threads.
    pub threads: usize,
    /// Prefill chunk size, tokens.
    pub batch: usize,
}

/// What the engine sends back for a request.
#[derive(Debug, Clone)]
pub enum Event {
    /// One generated token and the text it completes (possibly empty).
    Token {
        /// Token id.
        id: u32,
        /// Text to show now.
        text: String,
    },
    /// The request finished; its counters and whole text.
    Done {
        /// Counters.
        counters: Counters,
        /// Generated text (up to a stop string).
        text: String,
        /// Text held back from the token events (a possible stop-string
        /// prefix or an incomplete character at the end), not sent before.
        tail: String,
    },
    /// The request was aborted (e.g. the daemon is shutting down).
    Error(String),
}

/// A queued request.
pub struct Job {
    /// Request id.
    pub id: u64,
    /// Validated parameters.
    pub params: GenerateParams,
    /// Where events go; a closed receiver cancels the request.
    pub events: UnboundedSender<Event>,
    /// When it was queued.
    pub enqueued: Instant,
}

/// The outcome of a tier check ([`Engine::verify_tiers`]), all taken on the engine thread in one go.
#[derive(Debug, Clone, PartialEq)]
pub struct TierCheck {
    /// Experts whose RAM place was compared with the file.
    pub ram_experts: u32,
    /// Occupied VRAM slots compared with the file, per stage of the layer split (one entry per stage on the CUDA
    /// backend, 0 where no slot is occupied; empty on the CPU backend).
    pub vram_slots_per_stage: Vec<u32>,
    /// One line per fault (a copy that differs from the file, a file read that failed, a place shared by two
    /// experts, an expert in VRAM and RAM in the resident mode); empty when every copy is right.
    pub faults: Vec<String>,
    /// How long the check itself took on the engine thread (an asynchronous round finished first included, the
    /// wait in the queue not), milliseconds.
    pub elapsed_ms: f64,
}

/// Why a tier check gave no [`TierCheck`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TierCheckError {
    /// The daemon is shutting down (the check was queued too late, or the engine has stopped).
    #[error("daemon is shutting down")]
    ShuttingDown,
    /// The check could not be carried out (a device error reading the VRAM slots back).
    #[error("tier check failed: {0}")]
    Failed(String),
    /// The check panicked (a bug); the engine serves on.
    #[error("internal error during the tier check")]
    Panicked,
}

/// The result of a tier check: `None` for a dense model.
pub type TierCheckResult = Result<Option<TierCheck>, TierCheckError>;

/// What the engine thread takes from its queue, in order.
enum Msg {
    /// A request to run.
    Generate(Job),
    /// A tier check between requests, answered on the sender.
    VerifyTiers(tokio::sync::oneshot::Sender<TierCheckResult>),
}

/// Handle to the engine thread.
pub struct Engine {
    tx: Mutex<Option<Sender<Msg>>>,
    /// Shared statistics.
    pub stats: Arc<Stats>,
    queued: Arc<AtomicUsize>,
    busy: Arc<AtomicBool>,
    shutdown: Arc<AtomicBool>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Settings in use.
    pub cfg: EngineConfig,
}

impl Engine {
    /// Starts the engine thread; the model's worker pool does the compute
    /// (size it with `Model::set_threads`). Errors: the thread could not be created.
    pub fn start(
        model: Arc<Model>,
        tok: Arc<Tokenizer>,
        cfg: EngineConfig,
        dump: Option<RoutingDump>,
    ) -> std::io::Result<Engine> {
        let (tx, rx) = crossbeam_channel::unbounded::<Msg>();
        let stats = Arc::new(Stats::default());
        let queued = Arc::new(AtomicUsize::new(0));
        let busy = Arc::new(AtomicBool::new(false));
        let shutdown = Arc::new(AtomicBool::new(false));
        let mut w = Worker {
            kv: model.new_kv(cfg.n_ctx),
            model,
            tok,
            cached: Vec::new(),
            scratch: {
                let mut s = Scratch::default();
                s.routes = dump.as_ref().map(|_| Vec::new());
                s
            },
            dump,
            stats: stats.clone(),
            queued: queued.clone(),
            busy: busy.clone(),
            shutdown: shutdown.clone(),
            batch: cfg.batch.max(1),
        };
        let thread = std::thread::Builder::new().name("strata-engine".into()).spawn(move || w.run(rx))?;
        Ok(Engine {
            tx: Mutex::new(Some(tx)),
            stats,
            queued,
            busy,
            shutdown,
            next_id: AtomicU64::new(1),
            thread: Mutex::new(Some(thread)),
            cfg,
        })
    }

    /// Whether the engine is shutting down (or has stopped).
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// Queues a request; events arrive on the returned receiver. Dropping
    /// the receiver cancels the request.
    pub fn submit(&self, params: GenerateParams) -> UnboundedReceiver<Event> {
        let (etx, erx) = unbounded_channel();
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let job = Job { id, params, events: etx, enqueued: Instant::now() };
        let guard = self.tx.lock().unwrap();
        match guard.as_ref() {
            Some(tx) if !self.shutdown.load(Ordering::SeqCst) => {
                self.queued.fetch_add(1, Ordering::SeqCst);
                if let Err(e) = tx.send(Msg::Generate(job)) {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    if let Msg::Generate(job) = e.0 {
                        let _ = job.events.send(Event::Error("engine stopped".into()));
                    }
                }
            }
            _ => {
                let _ = job.events.send(Event::Error("daemon is shutting down".into()));
            }
        }
        erx
    }

    /// Queues a tier check ([`Model::verify_tiers`]: every RAM place and VRAM slot against the file's bytes): it
    /// runs on the engine thread after the requests queued before it, so no pass runs during it. The answer
    /// arrives on the receiver ([`TierCheckError`] when the daemon is shutting down or the check failed).
    pub fn verify_tiers(&self) -> tokio::sync::oneshot::Receiver<TierCheckResult> {
        let (otx, orx) = tokio::sync::oneshot::channel();
        let guard = self.tx.lock().unwrap();
        match guard.as_ref() {
            Some(tx) if !self.shutdown.load(Ordering::SeqCst) => {
                if let Err(e) = tx.send(Msg::VerifyTiers(otx)) {
                    if let Msg::VerifyTiers(otx) = e.0 {
                        let _ = otx.send(Err(TierCheckError::ShuttingDown));
                    }
                }
            }
            _ => {
                let _ = otx.send(Err(TierCheckError::ShuttingDown));
            }
        }
        orx
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Whether a request is running.
    pub fn busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst)
    }

    /// Stops the engine: the running request ends after its current token
    /// with an error event, queued ones get an error, the thread is joined.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        self.tx.lock().unwrap().take();
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

struct Worker {
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    kv: KvCache,
    /// Tokens whose K/V are in `kv` (for prefix reuse across requests).
    cached: Vec<u32>,
    scratch: Scratch,
    dump: Option<RoutingDump>,
    stats: Arc<Stats>,
    queued: Arc<AtomicUsize>,
    busy: Arc<AtomicBool>,
    shutdown: Arc<AtomicBool>,
    batch: usize,
}

impl Worker {
    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            let job = match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Msg::Generate(j)) => j,
                Ok(Msg::VerifyTiers(reply)) => {
                    if self.shutdown.load(Ordering::SeqCst) {
                        let _ = reply.send(Err(TierCheckError::ShuttingDown));
                    } else if !reply.is_closed() {
                        // (a check whose caller went away is skipped: it would only delay the next request)
                        let _ = reply.send(self.verify_tiers());
                    }
                    continue;
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if self.shutdown.load(Ordering::SeqCst) {
                        break;
                    }
                    continue;
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            };
            self.queued.fetch_sub(1, Ordering::SeqCst);
            if self.shutdown.load(Ordering::SeqCst) {
                let _ = job.events.send(Event::Error("daemon is shutting down".into()));
                continue;
            }
            self.busy.store(true, Ordering::SeqCst);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.generate(&job)));
            if r.is_err() {
                tracing::error!(request = job.id, "request panicked; KV cache reset");
                self.kv.clear();
                self.cached.clear();
                let _ = job.events.send(Event::Error("internal error while generating".into()));
            }
            self.busy.store(false, Ordering::SeqCst);
        }
        // Answer whatever is still queued.
        while let Ok(msg) = rx.try_recv() {
            match msg {
                Msg::Generate(job) => {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    let _ = job.events.send(Event::Error("daemon is shutting down".into()));
                }
                Msg::VerifyTiers(reply) => {
                    let _ = reply.send(Err(TierCheckError::ShuttingDown));
                }
            }
        }
    }

    /// Runs a tier check now (between requests), logging its outcome.
    fn verify_tiers(&mut self) -> TierCheckResult {
        let t0 = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.model.verify_tiers()));
        let faults = match r {
            Ok(Ok(Some(f))) => f,
            Ok(Ok(None)) => return Ok(None),
            Ok(Err(e)) => {
                let e = TierCheckError::Failed(e.to_string());
                tracing::error!("{e}");
                return Err(e);
            }
            Err(_) => {
                tracing::error!("the tier check panicked");
                return Err(TierCheckError::Panicked);
            }
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let (ram, per_stage) = self.model.experts.as_ref().map(|st| st.copies()).unwrap_or_default();
        let has_vram = self.model.backend.name() != "cpu";
        if faults.is_empty() {
            tracing::info!(ms, ram_experts = ram, "tier check: every copy equals the file's bytes");
        } else {
            tracing::error!(ms, faults = faults.len(), first = %faults[0], "tier check found faults");
        }
        Ok(Some(TierCheck {
            ram_experts: ram as u32,
            vram_slots_per_stage: if has_vram { per_stage.into_iter().map(|n| n as u32).collect() } else { Vec::new() },
            faults,
            elapsed_ms: ms,
        }))
    }

    fn dump_routes(&mut self, seq: u64, phase: Phase) {
        if let (Some(d), Some(recs)) = (self.dump.as_mut(), self.scratch.routes.as_mut()) {
            if let Err(e) = d.write(seq, phase, recs) {
                tracing::error!("routing dump: {e}; dumping stops");
                self.dump = None;
                self.scratch.routes = None;
            }
        }
    }

    /// Fails `job` with the pass's error (one line to the client and the log); the KV cache, whose positions from
    /// the failed pass are not valid, starts over. The daemon keeps serving.
    fn fail(&mut self, job: &Job, e: crate::backend::BackendError) {
        tracing::error!(request = job.id, "forward pass failed: {e}; request failed, KV cache reset");
        self.kv.clear();
        self.cached.clear();
        self.scratch.decode = false;
        let _ = job.events.send(Event::Error(format!("forward pass failed: {e}")));
    }

    fn stopped(&self, job: &Job) -> Option<bool> {
        if self.shutdown.load(Ordering::SeqCst) {
            Some(true)
        } else if job.events.is_closed() {
            Some(false)
        } else {
            None
        }
    }

    fn generate(&mut self, job: &Job) {
        let start = Instant::now();
        let p = &job.params;
        let ids = &p.prompt_ids;
        let mut c = Counters {
            request_id: job.id,
            prompt_tokens: ids.len(),
            prompt_reused: 0,
            prompt_done: 0,
            generated_tokens: 0,
            queue_ms: ms(start - job.enqueued),
            prompt_ms: 0.0,
            decode_ms: 0.0,
            windows: 0,
            expert_lookups: 0,
            tiers: Default::default(),
            rss_bytes: 0,
            finish: FinishReason::Cancelled,
        };
        let store = self.model.experts.clone();
        let tier0 = store.as_ref().map(|s| s.counters.totals()).unwrap_or_default();
        let tiers_now = |c: &mut Counters| {
            if let Some(s) = &store {
                c.tiers = s.counters.totals().since(&tier0);
                c.expert_lookups = c.tiers.lookups;
            }
            c.rss_bytes = rss_bytes();
        };
        let mut text = TextStream::new(&p.stop);
        let finish = |w: &mut Worker, c: &mut Counters, text: &mut TextStream, reason: FinishReason, shutting: bool| {
            c.finish = reason;
            tiers_now(c);
            let tail = text.finish();
            w.stats.record(c);
            if shutting {
                let _ = job.events.send(Event::Error("daemon is shutting down".into()));
            } else {
                let _ = job.events.send(Event::Done { counters: c.clone(), text: text.text().to_string(), tail });
            }
            tracing::info!(
                request = c.request_id,
                prompt = c.prompt_tokens,
                reused = c.prompt_reused,
                generated = c.generated_tokens,
                prompt_tok_s = format!("{:.1}", c.prompt_tok_s()),
                decode_tok_s = format!("{:.1}", c.decode_tok_s()),
                finish = reason.as_str(),
                blob_reads_per_token = format!("{:.2}", c.blob_reads_per_token()),
                promotions = c.tiers.promotions,
                "request done"
            );
        };
        if let Some(sh) = self.stopped(job) {
            return finish(self, &mut c, &mut text, FinishReason::Cancelled, sh);
        }
        // Reuse the KV of the longest common prefix with the previous request.
        let mut common = self.cached.iter().zip(ids).take_while(|(a, b)| a == b).count();
        if common == ids.len() {
            common -= 1; // at least one token must run to get logits
        }
        self.kv.truncate(common);
        self.cached.truncate(common);
        c.prompt_reused = common;
        c.prompt_done = common;
        let mut logits = Vec::new();
        let mut pos = common;
        self.scratch.decode = false;
        // a request starts with the asynchronous adaptive round drained
        if let Err(e) = self.model.drain() {
            tracing::error!("adaptive tier: {e}");
        }
        // a prompt of several chunks reports its progress in the live counters (the first chunk, then at most every
        // LIVE_EVERY)
        let mut last_live: Option<Instant> = None;
        while pos < ids.len() {
            let end = (pos + self.batch).min(ids.len());
            // only the prompt's last chunk needs logits (the others may return before their work is done)
            let which = if end < ids.len() { Logits::None } else { Logits::Last };
            logits = match self.model.try_forward(&ids[pos..end], &mut self.kv, which, &mut self.scratch) {
                Ok(l) => l,
                Err(e) => return self.fail(job, e),
            };
            self.dump_routes(job.id, Phase::Prefill);
            self.cached.extend_from_slice(&ids[pos..end]);
            pos = end;
            c.prompt_done = pos;
            if pos < ids.len() && last_live.is_none_or(|t| t.elapsed() >= LIVE_EVERY) {
                c.prompt_ms = ms(start.elapsed());
                self.stats.set_live(&c);
                last_live = Some(Instant::now());
            }
            if let Some(sh) = self.stopped(job) {
                c.prompt_ms = ms(start.elapsed());
                return finish(self, &mut c, &mut text, FinishReason::Cancelled, sh);
            }
        }
        let t_dec = Instant::now();
        c.prompt_ms = ms(t_dec - start);
        let mut sampler = Sampler::new(p.sampling.clone());
        let mut history: Vec<u32> = ids.clone();
        let n_ctx = self.kv.n_ctx;
        let mut last_live = Instant::now();
        tiers_now(&mut c);
        self.stats.set_live(&c);
        let reason = loop {
            let next = sampler.sample(&mut logits, &history);
            if self.tok.is_eog(next) {
                break FinishReason::Eos;
            }
            c.generated_tokens += 1;
            history.push(next);
            let push = text.push(self.tok.piece(next));
            let (piece, stop) = match push {
                Push::Text(s) => (s, false),
                Push::Stopped(s) => (s, true),
            };
            if job.events.send(Event::Token { id: next, text: piece }).is_err() {
                break FinishReason::Cancelled;
            }
            if stop {
                break FinishReason::StopString;
            }
            if c.generated_tokens >= p.max_tokens {
                break FinishReason::MaxTokens;
            }
            if self.kv.len >= n_ctx {
                break FinishReason::Context;
            }
            if self.stopped(job).is_some() {
                break FinishReason::Cancelled;
            }
            if let Some(st) = &store {
                // RAM adapt moves experts between windows, never in a request's first window
                st.ram_adapt(c.windows == 0);
            }
            self.scratch.decode = true;
            logits = match self.model.try_forward(&[next], &mut self.kv, Logits::Last, &mut self.scratch) {
                Ok(l) => l,
                Err(e) => return self.fail(job, e),
            };
            self.scratch.decode = false;
            if let Err(e) = self.model.end_decode_window() {
                tracing::error!("adaptive tier: {e}");
            }
            self.dump_routes(job.id, Phase::Decode);
            self.cached.push(next);
            c.windows += 1;
            if last_live.elapsed() >= LIVE_EVERY {
                c.decode_ms = ms(t_dec.elapsed());
                tiers_now(&mut c);
                self.stats.set_live(&c);
                last_live = Instant::now();
            }
        };
        c.decode_ms = ms(t_dec.elapsed());
        if let Some(d) = self.dump.as_mut() {
            let _ = d.flush();
        }
        let sh = self.shutdown.load(Ordering::SeqCst) && reason == FinishReason::Cancelled;
        finish(self, &mut c, &mut text, reason, sh)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
