//! OpenAI-compatible HTTP front end (`--http-listen`): `POST /v1/chat/completions` and `POST /v1/completions`
//! (streamed as server-sent events or not), `GET /v1/models`, `GET /health` and `GET /metrics` (Prometheus text).
//! A thin adapter over [`crate::api::Control`], beside the gRPC service on the same engine queue; request and
//! response shapes follow OpenAI's API reference, errors are its error object with the matching HTTP status. A client
//! that goes away drops the request's event stream, which cancels it in the engine.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::api::{ApiError, Control};
use crate::engine::request::RawRequest;
use crate::engine::{Counters, Event, FinishReason};

/// Largest request body accepted (bytes); larger ones get 413.
pub const MAX_BODY: usize = 4 << 20;

/// What the handlers share.
pub struct HttpState {
    api: Arc<Control>,
    /// The model's id in requests and `/v1/models` (the file name without `.gguf`).
    model_id: String,
    /// Bearer token every `/v1` request must carry (`--api-key`), if set.
    api_key: Option<String>,
    ids: AtomicU64,
    created: u64,
}

impl HttpState {
    /// The state for `api` serving `model_id`, with an optional API key.
    pub fn new(api: Arc<Control>, model_id: String, api_key: Option<String>) -> Arc<HttpState> {
        Arc::new(HttpState { api, model_id, api_key, ids: AtomicU64::new(1), created: now() })
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The routes.
pub fn router(state: Arc<HttpState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "invalid_request_error", "no such route", None) })
        .with_state(state)
}

/// An OpenAI error object with `status`.
fn error(status: StatusCode, kind: &str, message: &str, param: Option<&str>) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": Value::Null}});
    (status, axum::Json(body)).into_response()
}

fn bad(message: impl AsRef<str>, param: Option<&str>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message.as_ref(), param)
}

fn api_error(e: ApiError) -> Response {
    match e {
        ApiError::InvalidArgument(m) | ApiError::FailedPrecondition(m) => bad(m, None),
        ApiError::Unavailable(m) => error(StatusCode::SERVICE_UNAVAILABLE, "server_error", &m, None),
    }
}

/// Checks the bearer token when an API key is set.
fn authorized(st: &HttpState, headers: &HeaderMap) -> Result<(), Response> {
    let Some(key) = &st.api_key else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
    });
    if given.is_some_and(|g| same_bytes(g.as_bytes(), key.as_bytes())) {
        Ok(())
    } else {
        Err(error(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid or missing API key", None))
    }
}

/// Compares in time that depends only on the lengths (the key is not guessed byte by byte from response times).
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads the body (at most [`MAX_BODY`] bytes) as JSON of `T`.
async fn body_json<T: for<'de> Deserialize<'de>>(req: Request) -> Result<T, Response> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            &format!("request body over {MAX_BODY} bytes"),
            None,
        )
    };
    let bytes: Bytes = axum::body::to_bytes(req.into_body(), MAX_BODY).await.map_err(|e| {
        // a body over the limit (read up to it: answering before the client finished sending breaks its pipe),
        // else a body that stopped (the client went away)
        let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        let mut limit = false;
        while let Some(x) = src {
            limit |= x.to_string().contains("length limit");
            src = x.source();
        }
        if limit {
            too_large()
        } else {
            bad(format!("reading the request body: {e}"), None)
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| bad(format!("malformed JSON body: {e}"), None))
}

/// A string or a list of strings (`stop`, `prompt`).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// A message's `content`: a string, or a list of parts whose text parts are joined.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: String,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The fields of both completion requests this server reads.
#[derive(Deserialize)]
struct CompletionBody {
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<OneOrMany>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    n: Option<u32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

/// Tokens generated when the request names no limit.
const DEFAULT_MAX_TOKENS: u32 = 256;

impl HttpState {
    /// The engine request of a completion body (chat when `chat`). Errors: a 4xx response.
    fn raw(&self, b: CompletionBody, chat: bool) -> Result<RawRequest, Response> {
        match b.model.as_deref() {
            None => return Err(bad("`model` is required", Some("model"))),
            Some(m) if m != self.model_id => {
                return Err(error(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    &format!("model {m:?} does not exist; this server runs {:?}", self.model_id),
                    Some("model"),
                ))
            }
            _ => {}
        }
        if b.n.is_some_and(|n| n != 1) {
            return Err(bad("only n = 1 is supported", Some("n")));
        }
        let temperature = b.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(bad(format!("temperature must be in [0, 2] (got {temperature})"), Some("temperature")));
        }
        let mut raw = RawRequest {
            max_tokens: b.max_completion_tokens.or(b.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS),
            temperature,
            top_p: b.top_p,
            seed: b.seed,
            stop: b.stop.map(OneOrMany::into_vec).unwrap_or_default(),
            ..Default::default()
        };
        if chat {
            let msgs = b.messages.ok_or_else(|| bad("`messages` is required", Some("messages")))?;
            if msgs.is_empty() {
                return Err(bad("`messages` is empty", Some("messages")));
            }
            for m in msgs {
                let text = match m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t,
                    Some(Content::Parts(ps)) => {
                        if ps.iter().any(|p| p.kind != "text") {
                            return Err(bad("only text content parts are supported", Some("messages")));
                        }
                        ps.into_iter().map(|p| p.text).collect()
                    }
                };
                raw.messages.push((m.role, text));
            }
        } else {
            let prompt = b.prompt.ok_or_else(|| bad("`prompt` is required", Some("prompt")))?.into_vec();
            if prompt.len() != 1 {
                return Err(bad("give one prompt string", Some("prompt")));
            }
            raw.prompt = prompt.into_iter().next().unwrap_or_default();
        }
        Ok(raw)
    }
}

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::MaxTokens | FinishReason::Context => "length",
        _ => "stop",
    }
}

fn usage(c: &Counters) -> Value {
    json!({"prompt_tokens": c.prompt_tokens, "completion_tokens": c.generated_tokens,
           "total_tokens": c.prompt_tokens + c.generated_tokens})
}

async fn chat(State(st): State<Arc<HttpState>>, headers: HeaderMap, req: Request) -> Response {
    complete(st, headers, req, true).await
}

async fn completions(State(st): State<Arc<HttpState>>, headers: HeaderMap, req: Request) -> Response {
    complete(st, headers, req, false).await
}

async fn complete(st: Arc<HttpState>, headers: HeaderMap, req: Request, chat: bool) -> Response {
    if let Err(r) = authorized(&st, &headers) {
        return r;
    }
    let body: CompletionBody = match body_json(req).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let stream = body.stream;
    let include_usage = body.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let raw = match st.raw(body, chat) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let prepared = match st.api.prepare(&raw) {
        Ok(p) => p,
        Err(e) => return api_error(e),
    };
    let rx = st.api.submit(prepared);
    let n = st.ids.fetch_add(1, Ordering::Relaxed);
    let id = if chat { format!("chatcmpl-{n}") } else { format!("cmpl-{n}") };
    let created = now();
    if stream {
        sse(st, rx, id, created, chat, include_usage)
    } else {
        whole(st, rx, id, created, chat).await
    }
}

/// Collects a request's events into one response.
async fn whole(
    st: Arc<HttpState>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    id: String,
    created: u64,
    chat: bool,
) -> Response {
    loop {
        match rx.recv().await {
            Some(Event::Token { .. }) => {}
            Some(Event::Done { counters, text, .. }) => {
                let fin = finish_reason(counters.finish);
                let choice = if chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin})
                } else {
                    json!({"index": 0, "text": text, "logprobs": Value::Null, "finish_reason": fin})
                };
                let object = if chat { "chat.completion" } else { "text_completion" };
                return axum::Json(json!({"id": id, "object": object, "created": created, "model": st.model_id,
                    "choices": [choice], "usage": usage(&counters)}))
                .into_response();
            }
            Some(Event::Error(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", &e, None),
            None => return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine stopped", None),
        }
    }
}

/// Streams a request's events as server-sent events: a role chunk (chat), one chunk per text piece, a final chunk
/// with the finish reason, the usage chunk (`stream_options.include_usage`: `choices` empty), then `[DONE]`.
fn sse(
    st: Arc<HttpState>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    id: String,
    created: u64,
    chat: bool,
    include_usage: bool,
) -> Response {
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let model = st.model_id.clone();
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Bytes::from(format!("data: {v}\n\n"))
    };
    let piece = move |text: &str, fin: Option<&str>| {
        if chat {
            json!([{"index": 0, "delta": if fin.is_some() { json!({}) } else { json!({"content": text}) },
                    "finish_reason": fin}])
        } else {
            json!([{"index": 0, "text": text, "logprobs": Value::Null, "finish_reason": fin}])
        }
    };
    let first = chat.then(|| {
        chunk(json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": Value::Null}]), None)
    });
    let events = UnboundedReceiverStream::new(rx);
    let mut done = false;
    let body = tokio_stream::iter(first).chain(events.map_while(move |ev| {
        if done {
            return None;
        }
        Some(match ev {
            Event::Token { text, .. } if text.is_empty() => Bytes::new(),
            Event::Token { text, .. } => chunk(piece(&text, None), None),
            Event::Done { counters, tail, .. } => {
                done = true;
                let mut out = Vec::new();
                if !tail.is_empty() {
                    out.extend_from_slice(&chunk(piece(&tail, None), None));
                }
                out.extend_from_slice(&chunk(piece("", Some(finish_reason(counters.finish))), None));
                if include_usage {
                    out.extend_from_slice(&chunk(json!([]), Some(usage(&counters))));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                Bytes::from(out)
            }
            Event::Error(e) => {
                done = true;
                let err =
                    json!({"error": {"message": e, "type": "server_error", "param": Value::Null, "code": Value::Null}});
                Bytes::from(format!("data: {err}\n\ndata: [DONE]\n\n"))
            }
        })
    }));
    let body = Body::from_stream(body.map(Ok::<_, Infallible>));
    let mut r = Response::new(body);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

async fn models(State(st): State<Arc<HttpState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorized(&st, &headers) {
        return r;
    }
    axum::Json(json!({"object": "list", "data": [{"id": st.model_id, "object": "model", "created": st.created,
        "owned_by": "strata"}]}))
    .into_response()
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

/// Prometheus text exposition: vLLM's names where one exists, `strata_*` for the rest and the tier counters.
async fn metrics(State(st): State<Arc<HttpState>>) -> Response {
    let s = st.api.stats();
    let t = &s.totals;
    let tiers = &s.tiers;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"));
    };
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.", t.prompt_tokens as f64);
    metric("vllm:generation_tokens_total", "counter", "Tokens generated.", t.generated_tokens as f64);
    metric("vllm:num_requests_running", "gauge", "Requests running.", s.busy as u8 as f64);
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting.", s.queued as f64);
    metric("strata_requests_total", "counter", "Requests finished.", t.requests as f64);
    metric("strata_requests_cancelled_total", "counter", "Requests cancelled.", t.cancelled as f64);
    metric("strata_requests_rejected_total", "counter", "Requests refused by validation.", t.rejected as f64);
    metric("strata_prompt_seconds_total", "counter", "Time in prefill.", t.prompt_ms / 1000.0);
    metric("strata_decode_seconds_total", "counter", "Time in decode.", t.decode_ms / 1000.0);
    metric("strata_expert_lookups_total", "counter", "Expert lookups of decode windows.", tiers.lookups as f64);
    metric("strata_vram_hits_total", "counter", "Lookups served from VRAM slots.", tiers.vram_hits as f64);
    metric("strata_ram_reads_total", "counter", "Lookups served from the RAM copy.", tiers.ram_reads as f64);
    metric("strata_blob_reads_total", "counter", "Decode lookups read from the file.", tiers.file_blob_reads as f64);
    let per_tok = if t.generated_tokens > 0 { tiers.file_blob_reads as f64 / t.generated_tokens as f64 } else { 0.0 };
    metric("strata_blob_reads_per_token", "gauge", "File blob reads per generated token since start.", per_tok);
    metric("strata_promotions_total", "counter", "RAM adapt promotions.", tiers.promotions as f64);
    metric("strata_swaps_total", "counter", "Adaptive-tier swaps into VRAM.", tiers.swaps as f64);
    metric(
        "strata_pcie_entries_total",
        "counter",
        "Routing entries computed after a PCIe upload.",
        tiers.pcie_entries as f64,
    );
    metric("strata_prefetched_total", "counter", "Experts uploaded ahead by the prefetch.", tiers.prefetched as f64);
    metric(
        "strata_prefetch_hits_total",
        "counter",
        "Prefetched experts the next layer used.",
        tiers.prefetch_hits as f64,
    );
    metric(
        "strata_prefetch_wasted_bytes_total",
        "counter",
        "Bytes prefetched and not used.",
        tiers.prefetch_wasted_bytes as f64,
    );
    metric("strata_resident_memory_bytes", "gauge", "Resident set size.", s.rss_bytes as f64);
    let mut r = out.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}
