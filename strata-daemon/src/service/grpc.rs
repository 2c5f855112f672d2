//! `strata.v1.Strata` over tonic: `Generate` (server stream), `GetStats`, the knobs (`GetKnobs`, `SetKnob`),
//! `GetResidency`, `SaveProfile`, `WatchCounters` (server stream) and `VerifyTiers` — a thin adapter over the transport-neutral
//! control API ([`crate::api::Control`]): it converts messages and maps [`ApiError`] kinds to gRPC codes.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use strata_proto::v1 as pb;
use strata_proto::v1::strata_server::Strata;
use tokio_stream::{wrappers::UnboundedReceiverStream, Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::api::{ApiError, Control, ModelSummary};
use crate::engine::request::RawRequest;
use crate::engine::{Counters, Event, FinishReason, Totals};
use crate::model::chat::Message;
use crate::tiers::knobs::Range;
use crate::tiers::store::{Tier, TierTotals};

/// The gRPC service over the control API.
pub struct StrataService {
    api: Arc<Control>,
}

impl StrataService {
    /// The service for `api`.
    pub fn new(api: Arc<Control>) -> Self {
        StrataService { api }
    }
}

/// The gRPC status of a refused call: `INVALID_ARGUMENT`, `FAILED_PRECONDITION` or `UNAVAILABLE`.
fn status(e: ApiError) -> Status {
    match e {
        ApiError::InvalidArgument(m) => Status::invalid_argument(m),
        ApiError::InvalidField { param, message } => Status::invalid_argument(format!("{param}: {message}")),
        ApiError::FailedPrecondition(m) => Status::failed_precondition(m),
        ApiError::Unavailable(m) => Status::unavailable(m),
    }
}

fn range_text(r: Range) -> String {
    match r {
        Range::Int(lo, hi) => format!("{lo}..={hi}"),
        Range::Choice(names) => names.join("|"),
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
        prompt_done: c.prompt_done as u32,
        vram_hits: c.tiers.vram_hits,
        hit_rate: crate::engine::stats::per(c.tiers.vram_hits, c.tiers.lookups),
        ram_reads: c.tiers.ram_reads,
        file_blob_reads: c.tiers.file_blob_reads,
        blob_reads_per_token: c.blob_reads_per_token(),
        file_bytes_read: c.tiers.file_bytes_read,
        prefill_file_blob_reads: c.tiers.prefill_file_blob_reads,
        prefill_file_bytes_read: c.tiers.prefill_file_bytes_read,
        ram_promotions: c.tiers.promotions,
        promotion_bytes: c.tiers.promotion_bytes,
        promotions_per_token: c.promotions_per_token(),
        rss_bytes: c.rss_bytes,
        swaps: c.tiers.swaps,
        pcie_entries: c.tiers.pcie_entries,
        prefetched: c.tiers.prefetched,
        prefetch_hits: c.tiers.prefetch_hits,
        prefetch_wasted_bytes: c.tiers.prefetch_wasted_bytes,
    }
}

/// Converts the totals since start (requests, and the expert tiers as `/metrics` exports them) to their protobuf
/// form.
pub fn totals_pb(t: &Totals, tt: &TierTotals) -> pb::Totals {
    pb::Totals {
        requests: t.requests,
        prompt_tokens: t.prompt_tokens,
        generated_tokens: t.generated_tokens,
        prompt_ms: t.prompt_ms,
        decode_ms: t.decode_ms,
        cancelled: t.cancelled,
        rejected: t.rejected,
        windows: t.windows,
        expert_lookups: t.expert_lookups,
        vram_hits: tt.vram_hits,
        ram_reads: tt.ram_reads,
        file_blob_reads: tt.file_blob_reads,
        file_bytes_read: tt.file_bytes_read,
        prefill_file_blob_reads: tt.prefill_file_blob_reads,
        prefill_file_bytes_read: tt.prefill_file_bytes_read,
        ram_promotions: tt.promotions,
        promotion_bytes: tt.promotion_bytes,
        promotions_refused: tt.promotions_refused,
        swaps: tt.swaps,
        pcie_entries: tt.pcie_entries,
        prefetched: tt.prefetched,
        prefetch_hits: tt.prefetch_hits,
        prefetch_wasted_bytes: tt.prefetch_wasted_bytes,
    }
}

fn summary_pb(m: &ModelSummary) -> pb::ModelSummary {
    pb::ModelSummary {
        path: m.path.clone(),
        name: m.name.clone(),
        architecture: m.architecture.clone(),
        n_layers: m.n_layers,
        n_embd: m.n_embd,
        n_head: m.n_head,
        n_head_kv: m.n_head_kv,
        n_vocab: m.n_vocab,
        n_ctx_train: m.n_ctx_train,
        n_ctx: m.n_ctx,
        n_expert: m.n_expert,
        n_expert_used: m.n_expert_used,
        file_bytes: m.file_bytes,
        n_params: m.n_params,
        file_type: m.file_type.clone(),
        threads: m.threads,
        backend: m.backend.clone(),
        kv_type: m.kv_type.clone(),
    }
}

fn raw_request(r: pb::GenerateRequest) -> RawRequest {
    let s = r.sampling.unwrap_or_default();
    RawRequest {
        prompt: r.prompt,
        messages: r.messages.into_iter().map(|m| Message::new(m.role, m.content)).collect(),
        max_tokens: r.max_tokens,
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repeat_penalty: s.repeat_penalty,
        repeat_last_n: s.repeat_last_n,
        seed: s.seed,
        stop: r.stop,
        ..Default::default()
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;
type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::CounterUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl Strata for StrataService {
    type GenerateStream = EventStream;
    type WatchCountersStream = WatchStream;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<EventStream>, Status> {
        let raw = raw_request(req.into_inner());
        let api = self.api.clone();
        // tokenizing is blocking work; a call cancelled meanwhile never reaches the engine
        let params = tokio::task::spawn_blocking(move || api.prepare(&raw))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(status)?;
        let rx = self.api.submit(params);
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
        let s = self.api.stats();
        Ok(Response::new(pb::StatsReply {
            model: Some(summary_pb(&s.model)),
            uptime_s: s.uptime_s,
            totals: Some(totals_pb(&s.totals, &s.tiers)),
            last_request: s.last_request.as_ref().map(counters_pb),
            queued: s.queued,
            busy: s.busy,
            rss_bytes: s.rss_bytes,
            version: s.version.to_string(),
        }))
    }

    async fn get_knobs(&self, _req: Request<pb::GetKnobsRequest>) -> Result<Response<pb::KnobList>, Status> {
        let knobs = self
            .api
            .knobs()
            .into_iter()
            .map(|k| {
                let spec = k.knob.spec();
                pb::Knob {
                    name: spec.name.to_string(),
                    value: k.value,
                    default_value: spec.default,
                    range: range_text(spec.range),
                    active: k.active,
                    doc: spec.doc.to_string(),
                    inactive_reason: k.inactive_reason.unwrap_or_default(),
                }
            })
            .collect();
        Ok(Response::new(pb::KnobList { knobs }))
    }

    async fn set_knob(&self, req: Request<pb::SetKnobRequest>) -> Result<Response<pb::SetKnobReply>, Status> {
        let r = req.into_inner();
        let c = self.api.set_knob(&r.name, &r.value).map_err(status)?;
        Ok(Response::new(pb::SetKnobReply {
            name: c.knob.name().to_string(),
            old_value: c.old,
            new_value: c.new,
            active: c.active,
            inactive_reason: c.inactive_reason.unwrap_or_default(),
        }))
    }

    async fn get_residency(&self, req: Request<pb::ResidencyRequest>) -> Result<Response<pb::Residency>, Status> {
        let r = req.into_inner();
        let res = self.api.residency(r.layer, r.top).map_err(status)?;
        let tier = |t: Tier| match t {
            Tier::Vram => pb::Tier::Vram,
            Tier::Ram => pb::Tier::Ram,
            Tier::File => pb::Tier::File,
        } as i32;
        Ok(Response::new(pb::Residency {
            layers: res
                .layers
                .into_iter()
                .map(|(i, l)| pb::LayerResidency {
                    layer: i,
                    vram_experts: l.experts[0],
                    ram_experts: l.experts[1],
                    file_experts: l.experts[2],
                    vram_bytes: l.bytes[0],
                    ram_bytes: l.bytes[1],
                    file_bytes: l.bytes[2],
                    stage: l.stage,
                })
                .collect(),
            experts: res
                .experts
                .into_iter()
                .map(|e| pb::ExpertResidency {
                    layer: e.layer,
                    expert: e.expert,
                    tier: tier(e.tier),
                    usage: e.usage,
                    heat: e.heat,
                })
                .collect(),
            ram_locked: res.ram_locked,
            mode: res.mode.into(),
        }))
    }

    async fn save_profile(
        &self,
        req: Request<pb::SaveProfileRequest>,
    ) -> Result<Response<pb::SaveProfileReply>, Status> {
        let r = req.into_inner();
        let path = (!r.path.is_empty()).then(|| PathBuf::from(r.path));
        let api = self.api.clone();
        let saved = tokio::task::spawn_blocking(move || api.save_profile(path))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(status)?;
        Ok(Response::new(pb::SaveProfileReply { path: saved.path.display().to_string(), ranked: saved.ranked as u32 }))
    }

    async fn verify_tiers(
        &self,
        _req: Request<pb::VerifyTiersRequest>,
    ) -> Result<Response<pb::VerifyTiersReply>, Status> {
        let c = self.api.verify_tiers().await.map_err(status)?;
        Ok(Response::new(pb::VerifyTiersReply {
            ram_experts: c.ram_experts,
            vram_slots_per_stage: c.vram_slots_per_stage,
            faults: c.faults,
            elapsed_ms: c.elapsed_ms,
        }))
    }

    async fn watch_counters(&self, _req: Request<pb::WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let rx = self.api.watch();
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(|u| {
            u.map(|u| pb::CounterUpdate { running: u.running, counters: Some(counters_pb(&u.counters)) })
                .map_err(status)
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tier totals whose every field differs (1, 2, 3, ... in declaration order), so a field mapped from the
    /// wrong source shows.
    fn distinct_tiers() -> TierTotals {
        TierTotals {
            windows: 1,
            lookups: 2,
            vram_hits: 3,
            ram_reads: 4,
            file_blob_reads: 5,
            prefill_file_blob_reads: 6,
            file_bytes_read: 7,
            prefill_file_bytes_read: 8,
            promotions: 9,
            promotion_bytes: 10,
            promotions_refused: 11,
            swaps: 12,
            swap_bytes: 13,
            pcie_entries: 14,
            prefetched: 15,
            prefetch_hits: 16,
            prefetch_wasted_bytes: 17,
            predicted_routed: 18,
            predicted_named: 19,
        }
    }

    /// The GPU tier counters of a message, in one order: swaps, PCIe entries, prefetched, prefetch hits, bytes.
    fn gpu_of_request(c: &pb::RequestCounters) -> [u64; 5] {
        [c.swaps, c.pcie_entries, c.prefetched, c.prefetch_hits, c.prefetch_wasted_bytes]
    }

    #[test]
    fn request_counters_carry_the_gpu_tier_counters() {
        let c = Counters {
            request_id: 7,
            prompt_tokens: 20,
            prompt_reused: 0,
            prompt_done: 20,
            generated_tokens: 4,
            queue_ms: 0.0,
            prompt_ms: 10.0,
            decode_ms: 20.0,
            windows: 3,
            expert_lookups: 2,
            tiers: distinct_tiers(),
            rss_bytes: 1 << 20,
            finish: FinishReason::MaxTokens,
        };
        let p = counters_pb(&c);
        assert_eq!(gpu_of_request(&p), [12, 14, 15, 16, 17]);
        assert_eq!((p.vram_hits, p.file_bytes_read, p.prefill_file_bytes_read), (3, 7, 8));
        // nothing on the GPU: zeros, as a CPU daemon reports them
        let p = counters_pb(&Counters { tiers: TierTotals::default(), ..c });
        assert_eq!(gpu_of_request(&p), [0; 5]);
    }

    #[test]
    fn totals_carry_every_tier_counter_of_the_metrics() {
        let t = Totals { requests: 2, generated_tokens: 8, windows: 6, expert_lookups: 2, ..Default::default() };
        let p = totals_pb(&t, &distinct_tiers());
        // the names /metrics exports them under: strata_swaps_total, strata_pcie_entries_total, ...
        let gpu = [p.swaps, p.pcie_entries, p.prefetched, p.prefetch_hits, p.prefetch_wasted_bytes];
        assert_eq!(gpu, [12, 14, 15, 16, 17]);
        assert_eq!((p.vram_hits, p.ram_reads, p.file_blob_reads), (3, 4, 5));
        assert_eq!((p.file_bytes_read, p.prefill_file_blob_reads, p.prefill_file_bytes_read), (7, 6, 8));
        assert_eq!((p.ram_promotions, p.promotion_bytes, p.promotions_refused), (9, 10, 11));
        assert_eq!((p.requests, p.generated_tokens, p.windows, p.expert_lookups), (2, 8, 6, 2));
    }
}
