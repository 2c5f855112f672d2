//! `strata.v1.Strata` over tonic: `Generate` (server stream), `GetStats`, the knobs (`GetKnobs`, `SetKnob`),
//! `GetResidency`, `SaveProfile` and `WatchCounters` (server stream).

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use strata_proto::v1 as pb;
use strata_proto::v1::strata_server::Strata;
use tokio_stream::{wrappers::UnboundedReceiverStream, Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::engine::request::{prepare, RawRequest};
use crate::engine::{Counters, Engine, Event, FinishReason};
use crate::model::{Model, Tokenizer};
use crate::tiers::arena::Lock;
use crate::tiers::knobs::{Knobs, Range};
use crate::tiers::store::{ExpertStore, ResidentMode, Tier};

/// The gRPC service: validates requests, queues them on the engine and
/// streams the events back; reads and sets knobs; reports residency.
pub struct StrataService {
    engine: Arc<Engine>,
    tok: Arc<Tokenizer>,
    summary: pb::ModelSummary,
    store: Option<Arc<ExpertStore>>,
    knobs: Arc<Knobs>,
    profile_save: Option<PathBuf>,
}

impl StrataService {
    /// Creates the service for a loaded model and a running engine. `knobs` are the live knobs (the store's
    /// for an MoE model); `profile_save` is the `--expert-profile-save` path.
    pub fn new(
        engine: Arc<Engine>,
        model: &Model,
        tok: Arc<Tokenizer>,
        knobs: Arc<Knobs>,
        profile_save: Option<PathBuf>,
    ) -> Self {
        let c = &model.cfg;
        let summary = pb::ModelSummary {
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
        };
        StrataService { engine, tok, summary, store: model.experts.clone(), knobs, profile_save }
    }
}

fn range_text(r: Range) -> String {
    match r {
        Range::Int(lo, hi) => format!("{lo}..={hi}"),
        Range::Real { min, open_min, max } => format!("{}{min}, {max}]", if open_min { "(" } else { "[" }),
    }
}

fn finish_pb(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Eos => pb::FinishReason::Eos,
        FinishReason::StopString => pb::FinishReason::StopString,
        FinishReason::MaxTokens => pb::FinishReason::MaxTokens,
        FinishReason::Context => pb::FinishReason::Context,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    }
}

/// Converts engine counters to their protobuf form.
pub fn counters_pb(c: &Counters) -> pb::RequestCounters {
    pb::RequestCounters {
        request_id: c.request_id,
        prompt_tokens: c.prompt_tokens as u32,
        generated_tokens: c.generated_tokens as u32,
        prompt_ms: c.prompt_ms,
        decode_ms: c.decode_ms,
        prompt_tok_s: c.prompt_tok_s(),
        decode_tok_s: c.decode_tok_s(),
        finish_reason: finish_pb(c.finish) as i32,
        windows: c.windows,
        expert_lookups: c.expert_lookups,
        queue_ms: c.queue_ms,
        prompt_reused: c.prompt_reused as u32,
        vram_hits: c.tiers.vram_hits,
        hit_rate: crate::engine::stats::per(c.tiers.vram_hits, c.tiers.lookups),
        ram_reads: c.tiers.ram_reads,
        file_blob_reads: c.tiers.file_blob_reads,
        blob_reads_per_token: c.blob_reads_per_token(),
        file_bytes_read: c.tiers.file_bytes_read,
        prefill_file_blob_reads: c.tiers.prefill_file_blob_reads,
        ram_promotions: c.tiers.promotions,
        promotion_bytes: c.tiers.promotion_bytes,
        promotions_per_token: c.promotions_per_token(),
        rss_bytes: c.rss_bytes,
    }
}

fn raw_request(r: pb::GenerateRequest) -> RawRequest {
    let s = r.sampling.unwrap_or_default();
    RawRequest {
        prompt: r.prompt,
        messages: r.messages.into_iter().map(|m| (m.role, m.content)).collect(),
        max_tokens: r.max_tokens,
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repeat_penalty: s.repeat_penalty,
        repeat_last_n: s.repeat_last_n,
        seed: s.seed,
        stop: r.stop,
    }
}

pub use crate::engine::stats::rss_bytes;

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;
type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::CounterUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl Strata for StrataService {
    type GenerateStream = EventStream;
    type WatchCountersStream = WatchStream;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<EventStream>, Status> {
        let raw = raw_request(req.into_inner());
        let tok = self.tok.clone();
        let n_ctx = self.engine.cfg.n_ctx;
        let params = tokio::task::spawn_blocking(move || prepare(&raw, &tok, n_ctx))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let params = match params {
            Ok(p) => p,
            Err(e) => {
                self.engine.stats.record_rejected();
                return Err(Status::invalid_argument(e.0));
            }
        };
        let rx = self.engine.submit(params);
        let stream = UnboundedReceiverStream::new(rx).map(|ev| match ev {
            Event::Token { id, text } => Ok(pb::GenerateEvent {
                event: Some(pb::generate_event::Event::Token(pb::TokenEvent { token_id: id, text })),
            }),
            Event::Done { counters, text, tail } => Ok(pb::GenerateEvent {
                event: Some(pb::generate_event::Event::Done(pb::Done {
                    counters: Some(counters_pb(&counters)),
                    text,
                    tail,
                })),
            }),
            Event::Error(m) => Err(Status::unavailable(m)),
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_stats(&self, _req: Request<pb::StatsRequest>) -> Result<Response<pb::StatsReply>, Status> {
        let (t, last) = self.engine.stats.snapshot();
        Ok(Response::new(pb::StatsReply {
            model: Some(self.summary.clone()),
            uptime_s: self.engine.stats.started.elapsed().as_secs_f64(),
            totals: Some(pb::Totals {
                requests: t.requests,
                prompt_tokens: t.prompt_tokens,
                generated_tokens: t.generated_tokens,
                prompt_ms: t.prompt_ms,
                decode_ms: t.decode_ms,
                cancelled: t.cancelled,
                rejected: t.rejected,
                windows: t.windows,
                expert_lookups: t.expert_lookups,
                ..self.tier_totals()
            }),
            last_request: last.as_ref().map(counters_pb),
            queued: self.engine.queued() as u32,
            busy: self.engine.busy(),
            rss_bytes: rss_bytes(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }))
    }

    async fn get_knobs(&self, _req: Request<pb::GetKnobsRequest>) -> Result<Response<pb::KnobList>, Status> {
        let knobs = self
            .knobs
            .all()
            .into_iter()
            .map(|(spec, value, _)| pb::Knob {
                name: spec.name.to_string(),
                value,
                default_value: spec.default,
                range: range_text(spec.range),
                active: Knobs::is_active(spec.name, self.store.is_some()),
                doc: spec.doc.to_string(),
            })
            .collect();
        Ok(Response::new(pb::KnobList { knobs }))
    }

    async fn set_knob(&self, req: Request<pb::SetKnobRequest>) -> Result<Response<pb::SetKnobReply>, Status> {
        let r = req.into_inner();
        let (name, old, new) =
            self.knobs.set(&r.name, &r.value).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let active = Knobs::is_active(name, self.store.is_some());
        tracing::info!(knob = name, old, new, active, "knob set; takes effect at the next window");
        Ok(Response::new(pb::SetKnobReply { name: name.to_string(), old_value: old, new_value: new, active }))
    }

    async fn get_residency(&self, req: Request<pb::ResidencyRequest>) -> Result<Response<pb::Residency>, Status> {
        let store = self.store.as_ref().ok_or_else(|| Status::failed_precondition("the model has no experts"))?;
        let r = req.into_inner();
        let (layers, experts) = store.residency();
        if let Some(l) = r.layer {
            if l as usize >= layers.len() {
                return Err(Status::invalid_argument(format!("layer {l}: the model has {} layers", layers.len())));
            }
        }
        let tier = |t: Tier| match t {
            Tier::Vram => pb::Tier::Vram,
            Tier::Ram => pb::Tier::Ram,
            Tier::File => pb::Tier::File,
        } as i32;
        let mut ex: Vec<pb::ExpertResidency> = experts
            .into_iter()
            .filter(|e| r.layer.is_none_or(|l| e.layer == l))
            .map(|e| pb::ExpertResidency {
                layer: e.layer,
                expert: e.expert,
                tier: tier(e.tier),
                usage: e.usage,
                heat: e.heat,
            })
            .collect();
        if r.top > 0 {
            ex.sort_by(|a, b| b.usage.total_cmp(&a.usage).then(b.heat.total_cmp(&a.heat)));
            ex.truncate(r.top as usize);
        }
        let layers = layers
            .into_iter()
            .enumerate()
            .filter(|(i, _)| r.layer.is_none_or(|l| *i as u32 == l))
            .map(|(i, l)| pb::LayerResidency {
                layer: i as u32,
                vram_experts: l.experts[0],
                ram_experts: l.experts[1],
                file_experts: l.experts[2],
                vram_bytes: l.bytes[0],
                ram_bytes: l.bytes[1],
                file_bytes: l.bytes[2],
            })
            .collect();
        let mode = match store.mode() {
            ResidentMode::All => "all",
            ResidentMode::Budget(_) => "budget",
            ResidentMode::Mmap => "mmap",
        };
        Ok(Response::new(pb::Residency {
            layers,
            experts: ex,
            ram_locked: store.ram_lock() == Lock::Locked,
            mode: mode.into(),
        }))
    }

    async fn save_profile(
        &self,
        req: Request<pb::SaveProfileRequest>,
    ) -> Result<Response<pb::SaveProfileReply>, Status> {
        let store = self.store.clone().ok_or_else(|| Status::failed_precondition("the model has no experts"))?;
        let r = req.into_inner();
        let path = if r.path.is_empty() {
            self.profile_save.clone().ok_or_else(|| {
                Status::invalid_argument("no path given and the daemon runs without --expert-profile-save")
            })?
        } else {
            PathBuf::from(r.path)
        };
        let p2 = path.clone();
        let ranked = tokio::task::spawn_blocking(move || {
            let prof = store.profile_now();
            prof.save(&p2).map(|_| prof.ranked.len())
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(|e| Status::failed_precondition(e.to_string()))?;
        tracing::info!(path = %path.display(), ranked, "expert profile saved");
        Ok(Response::new(pb::SaveProfileReply { path: path.display().to_string(), ranked: ranked as u32 }))
    }

    async fn watch_counters(&self, _req: Request<pb::WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let stats = self.engine.stats.clone();
        let engine = self.engine.clone();
        let mut rx = stats.updates.subscribe();
        let (tx, out) = tokio::sync::mpsc::channel::<Result<pb::CounterUpdate, Status>>(16);
        tokio::spawn(async move {
            let mut last_done = stats.snapshot().1.map(|c| c.request_id);
            loop {
                // wake on an update, and at least every 250 ms while a request runs
                let _ = tokio::time::timeout(std::time::Duration::from_millis(250), rx.changed()).await;
                if engine.is_shutting_down() {
                    // end the stream so the server can stop (graceful shutdown waits for open streams)
                    let _ = tx.send(Err(Status::unavailable("daemon is shutting down"))).await;
                    return;
                }
                let (_, done) = stats.snapshot();
                let mut msgs = Vec::new();
                if let Some(c) = done {
                    if Some(c.request_id) != last_done {
                        last_done = Some(c.request_id);
                        msgs.push(pb::CounterUpdate { running: false, counters: Some(counters_pb(&c)) });
                    }
                }
                if let Some(c) = stats.live() {
                    msgs.push(pb::CounterUpdate { running: true, counters: Some(counters_pb(&c)) });
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
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out))))
    }
}

impl StrataService {
    fn tier_totals(&self) -> pb::Totals {
        let Some(st) = &self.store else { return pb::Totals::default() };
        let t = st.counters.totals();
        pb::Totals {
            vram_hits: t.vram_hits,
            ram_reads: t.ram_reads,
            file_blob_reads: t.file_blob_reads,
            file_bytes_read: t.file_bytes_read,
            prefill_file_blob_reads: t.prefill_file_blob_reads,
            ram_promotions: t.promotions,
            promotion_bytes: t.promotion_bytes,
            promotions_refused: t.promotions_refused,
            ..Default::default()
        }
    }
}
