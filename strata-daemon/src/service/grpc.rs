//! `strata.v1.Strata` over tonic: `Generate` (server stream) and `GetStats`.

use std::pin::Pin;
use std::sync::Arc;

use strata_proto::v1 as pb;
use strata_proto::v1::strata_server::Strata;
use tokio_stream::{wrappers::UnboundedReceiverStream, Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::engine::request::{prepare, RawRequest};
use crate::engine::{Counters, Engine, Event, FinishReason};
use crate::model::{LlamaModel, Tokenizer};

/// The gRPC service: validates requests, queues them on the engine and
/// streams the events back.
pub struct StrataService {
    engine: Arc<Engine>,
    tok: Arc<Tokenizer>,
    summary: pb::ModelSummary,
}

impl StrataService {
    /// Creates the service for a loaded model and a running engine.
    pub fn new(engine: Arc<Engine>, model: &LlamaModel, tok: Arc<Tokenizer>) -> Self {
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
        StrataService { engine, tok, summary }
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

/// Resident set size of this process in bytes (from /proc/self/statm), 0 if unknown.
pub fn rss_bytes() -> u64 {
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(4096) as u64;
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map(|p| p * page)
        .unwrap_or(0)
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Strata for StrataService {
    type GenerateStream = EventStream;

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
            }),
            last_request: last.as_ref().map(counters_pb),
            queued: self.engine.queued() as u32,
            busy: self.engine.busy(),
            rss_bytes: rss_bytes(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }))
    }
}
