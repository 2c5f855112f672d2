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
use crate::model::chat::Message;
use crate::model::tool_calls::{ParsedCall, Piece, ToolCallParser, ToolParse};
use crate::model::tools::{tool_calls_from_openai, tool_choice_from_openai, tools_from_openai, ToolShapeError};

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
    // the tool call ids' prefix is the time the front end starts, not of its first call
    let _ = call_id_prefix();
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
        ApiError::InvalidField { param, message } => bad(message, Some(param)),
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
    // a field of the wrong shape is named by its path (`messages[2].role`), also as the error's `param`
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let v = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        // a syntax error has no field to name (its path is `?`), nor a shape error of the whole body (`.`)
        let path = e.path().to_string();
        match path.as_str() {
            "." | "?" => bad(format!("malformed JSON body: {}", e.into_inner()), None),
            _ => bad(format!("malformed JSON body: {path}: {}", e.into_inner()), Some(&path)),
        }
    })?;
    de.end().map_err(|e| bad(format!("malformed JSON body: {e}"), None))?;
    Ok(v)
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
    /// An assistant message's calls (OpenAI's shape, read by [`tool_calls_from_openai`]).
    #[serde(default)]
    tool_calls: Option<Value>,
    /// The call a `tool` message answers.
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
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
    /// The sampler's seed; none or a negative one (llama.cpp's −1) = a fresh random seed.
    seed: Option<i128>,
    stop: Option<OneOrMany>,
    n: Option<u32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Functions offered (chat; OpenAI's shape, read by [`tools_from_openai`]).
    #[serde(default)]
    tools: Option<Value>,
    /// `"none"`, `"auto"`, `"required"` or a named function.
    #[serde(default)]
    tool_choice: Option<Value>,
    /// Sampler fields OpenAI's API lacks, named and read as llama.cpp's server reads them: top-k (0 or less = off),
    /// min-p, the repetition penalty and its window in tokens (−1 = the whole context).
    top_k: Option<i64>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
    repeat_last_n: Option<i64>,
    /// Every other field: those of [`UNSUPPORTED`] are refused unless neutral, the rest ignored.
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// OpenAI request fields this server does not implement, each with whether a value is its neutral one (the value
/// that asks for nothing, which clients often send): a request that sets one to anything else is refused (400
/// naming the field) instead of being answered as if it had not asked.
const UNSUPPORTED: &[(&str, fn(&Value) -> bool)] = &[
    ("logprobs", |v| v.is_null() || *v == Value::Bool(false)),
    ("top_logprobs", |v| v.is_null() || v.as_u64() == Some(0)),
    ("echo", |v| v.is_null() || *v == Value::Bool(false)),
    ("best_of", |v| v.is_null() || v.as_u64() == Some(1)),
    ("suffix", |v| v.is_null() || v.as_str() == Some("")),
    ("logit_bias", |v| v.is_null() || v.as_object().is_some_and(|m| m.is_empty())),
    ("frequency_penalty", |v| v.is_null() || v.as_f64() == Some(0.0)),
    ("presence_penalty", |v| v.is_null() || v.as_f64() == Some(0.0)),
    ("response_format", |v| v.is_null() || v.get("type").and_then(Value::as_str) == Some("text")),
    ("functions", |v| v.is_null() || v.as_array().is_some_and(|a| a.is_empty())),
    ("function_call", |v| v.is_null() || v.as_str() == Some("none")),
];

/// The first field of `other` that [`UNSUPPORTED`] names with a value that is not neutral, as a 400.
fn refuse_unsupported(other: &serde_json::Map<String, Value>) -> Result<(), Response> {
    for (name, neutral) in UNSUPPORTED {
        if let Some(v) = other.get(*name) {
            if !neutral(v) {
                let mut got = v.to_string();
                if got.len() > 100 {
                    let cut = (0..=100).rev().find(|&i| got.is_char_boundary(i)).unwrap_or(0);
                    got.truncate(cut);
                    got.push_str("...");
                }
                return Err(bad(format!("`{name}` is not supported by this server (got {got})"), Some(name)));
            }
        }
    }
    Ok(())
}

fn shape(e: ToolShapeError) -> Response {
    bad(e.to_string(), Some(e.param()))
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
        refuse_unsupported(&b.other)?;
        let temperature = b.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(bad(format!("temperature must be in [0, 2] (got {temperature})"), Some("temperature")));
        }
        let mut raw = RawRequest {
            max_tokens: b.max_completion_tokens.or(b.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS),
            temperature,
            top_p: b.top_p,
            top_k: b.top_k.map_or(0, |k| k.clamp(0, u32::MAX as i64) as u32),
            min_p: b.min_p.unwrap_or(0.0),
            repeat_penalty: b.repeat_penalty,
            repeat_last_n: match b.repeat_last_n {
                None => None,
                Some(-1) => Some(u32::MAX),
                Some(n) if (0..=u32::MAX as i64).contains(&n) => Some(n as u32),
                Some(n) => {
                    return Err(bad(
                        format!("repeat_last_n must be -1 (the whole context) or >= 0 (got {n})"),
                        Some("repeat_last_n"),
                    ))
                }
            },
            seed: match b.seed {
                Some(s) if s > u64::MAX as i128 => {
                    return Err(bad(format!("seed must be below 2^64 (got {s})"), Some("seed")))
                }
                Some(s) => u64::try_from(s).ok(),
                None => None,
            },
            stop: b.stop.map(OneOrMany::into_vec).unwrap_or_default(),
            ..Default::default()
        };
        if chat {
            let msgs = b.messages.ok_or_else(|| bad("`messages` is required", Some("messages")))?;
            if msgs.is_empty() {
                return Err(bad("`messages` is empty", Some("messages")));
            }
            if let Some(t) = &b.tools {
                raw.tools = tools_from_openai(t).map_err(shape)?;
            }
            if let Some(c) = &b.tool_choice {
                raw.tool_choice = tool_choice_from_openai(c).map_err(shape)?;
            }
            for (i, m) in msgs.into_iter().enumerate() {
                let tool_calls = match &m.tool_calls {
                    Some(v) if !v.is_null() => tool_calls_from_openai(i, v).map_err(shape)?,
                    _ => Vec::new(),
                };
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
                raw.messages.push(Message {
                    role: m.role,
                    content: text,
                    tool_calls,
                    tool_call_id: m.tool_call_id,
                    name: m.name,
                });
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

/// OpenAI's finish reason: `tool_calls` when the reply called a tool and ended on its own.
fn finish_reason(f: FinishReason, called: bool) -> &'static str {
    match f {
        FinishReason::MaxTokens | FinishReason::Context => "length",
        _ if called => "tool_calls",
        _ => "stop",
    }
}

/// Distinguishes this daemon's call ids from an earlier run's (request numbers restart with the daemon): the
/// time the HTTP front end started ([`router`]), in seconds, base 36.
fn call_id_prefix() -> &'static str {
    static P: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let mut n = now();
        let mut s = Vec::new();
        while n > 0 {
            s.push(char::from_digit((n % 36) as u32, 36).unwrap_or('0'));
            n /= 36;
        }
        s.iter().rev().collect()
    })
}

/// A call as OpenAI's response gives it (`index` in stream deltas only); ids are
/// `call_<daemon start>_<request>_<index>`, unique across restarts of the daemon.
fn tool_call_json(c: &ParsedCall, request: u64, index: usize, delta: bool) -> Value {
    let mut v = json!({"id": format!("call_{}_{request}_{index}", call_id_prefix()), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}});
    if delta {
        v["index"] = json!(index);
    }
    v
}

/// A non-streamed chat reply's `message`, and whether it called a tool: with `parse`, the calls become
/// `tool_calls` and the text outside them `content` (null when empty).
fn chat_message(text: &str, parse: Option<&ToolParse>, request: u64) -> (Value, bool) {
    let Some(p) = parse else { return (json!({"role": "assistant", "content": text}), false) };
    let (content, calls) = crate::model::tool_calls::parse_reply(p, text);
    let mut m = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        m["tool_calls"] = calls.iter().enumerate().map(|(i, c)| tool_call_json(c, request, i, false)).collect();
    }
    (m, !calls.is_empty())
}

/// The `choices` of a streamed reply's chunks. Completions: the text. Chat: `content` deltas, and with a tool
/// parser, calls as `tool_calls` deltas (a call whole in one delta: `index`, `id`, `type`, `function.name`,
/// `function.arguments`).
struct StreamChoices {
    chat: bool,
    parser: Option<ToolCallParser>,
    request: u64,
    calls: usize,
}

impl StreamChoices {
    fn new(chat: bool, parse: Option<&ToolParse>, request: u64) -> Self {
        StreamChoices { chat, parser: parse.map(ToolParse::parser), request, calls: 0 }
    }

    fn delta(d: Value, fin: Option<&str>) -> Value {
        json!([{"index": 0, "delta": d, "finish_reason": fin}])
    }

    fn piece(text: &str, fin: Option<&str>) -> Value {
        json!([{"index": 0, "text": text, "logprobs": Value::Null, "finish_reason": fin}])
    }

    /// The chunks' choices for more text of the reply (`end`: the reply is over; none for empty text).
    fn text(&mut self, text: &str, end: bool) -> Vec<Value> {
        let Some(p) = self.parser.as_mut() else {
            return match (text.is_empty(), self.chat) {
                (true, _) => vec![],
                (false, true) => vec![Self::delta(json!({"content": text}), None)],
                (false, false) => vec![Self::piece(text, None)],
            };
        };
        let mut pieces = p.push(text);
        if end {
            pieces.extend(p.finish());
        }
        let mut out = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let d = match piece {
                Piece::Content(c) => json!({"content": c}),
                Piece::Call(c) => {
                    self.calls += 1;
                    json!({"tool_calls": [tool_call_json(&c, self.request, self.calls - 1, true)]})
                }
            };
            out.push(Self::delta(d, None));
        }
        out
    }

    /// The last chunk's choices: the finish reason (`tool_calls` when a call was given out).
    fn last(&self, f: FinishReason) -> Value {
        let fin = Some(finish_reason(f, self.calls > 0));
        if self.chat {
            Self::delta(json!({}), fin)
        } else {
            Self::piece("", fin)
        }
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
    let parse = prepared.tool_parse().cloned();
    let rx = st.api.submit(prepared);
    let n = st.ids.fetch_add(1, Ordering::Relaxed);
    let id = if chat { format!("chatcmpl-{n}") } else { format!("cmpl-{n}") };
    let created = now();
    let reply = Reply { id, n, created, chat, parse };
    if stream {
        sse(st, rx, reply, include_usage)
    } else {
        whole(st, rx, reply).await
    }
}

/// What a response says about its request.
struct Reply {
    /// `chatcmpl-<n>` or `cmpl-<n>`.
    id: String,
    /// The request's number.
    n: u64,
    created: u64,
    chat: bool,
    /// How to find tool calls in the reply.
    parse: Option<ToolParse>,
}

/// Collects a request's events into one response.
async fn whole(st: Arc<HttpState>, mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>, reply: Reply) -> Response {
    let Reply { id, n, created, chat, parse } = reply;
    loop {
        match rx.recv().await {
            Some(Event::Token { .. }) => {}
            Some(Event::Done { counters, text, .. }) => {
                let choice = if chat {
                    let (message, called) = chat_message(&text, parse.as_ref(), n);
                    json!({"index": 0, "message": message, "finish_reason": finish_reason(counters.finish, called)})
                } else {
                    let fin = finish_reason(counters.finish, false);
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

/// Streams a request's events as server-sent events: a role chunk (chat), one chunk per text piece (chat: per
/// [`ChatDeltas`] delta), a final chunk with the finish reason, the usage chunk (`stream_options.include_usage`:
/// `choices` empty), then `[DONE]`.
fn sse(
    st: Arc<HttpState>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    reply: Reply,
    include_usage: bool,
) -> Response {
    let Reply { id, n, created, chat, parse } = reply;
    let mut choices = StreamChoices::new(chat, parse.as_ref(), n);
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let model = st.model_id.clone();
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Bytes::from(format!("data: {v}\n\n"))
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
            Event::Token { text, .. } => {
                Bytes::from(choices.text(&text, false).into_iter().flat_map(|c| chunk(c, None)).collect::<Vec<u8>>())
            }
            Event::Done { counters, tail, .. } => {
                done = true;
                let mut out = Vec::new();
                for c in choices.text(&tail, true) {
                    out.extend_from_slice(&chunk(c, None));
                }
                out.extend_from_slice(&chunk(choices.last(counters.finish), None));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tool_calls::ToolFormat;

    fn hermes() -> ToolParse {
        ToolParse { format: ToolFormat::Hermes, names: vec!["get_weather".into()], prefix: String::new() }
    }

    const REPLY: &str = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";

    #[test]
    fn a_whole_reply_gives_tool_calls_and_content() {
        let (m, called) = chat_message(REPLY, Some(&hermes()), 7);
        assert!(called);
        assert_eq!(m["content"], "Checking.");
        assert_eq!(
            m["tool_calls"],
            json!([
                {"id": format!("call_{}_7_0", call_id_prefix()), "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": format!("call_{}_7_1", call_id_prefix()), "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
            ])
        );
        assert_eq!(finish_reason(FinishReason::Eos, called), "tool_calls");
        assert_eq!(finish_reason(FinishReason::MaxTokens, called), "length");
        // only calls: content is null; no parser: the text as it is
        let only = &REPLY["Checking.\n".len()..];
        assert_eq!(chat_message(only, Some(&hermes()), 7).0["content"], Value::Null);
        assert_eq!(chat_message(REPLY, None, 7), (json!({"role": "assistant", "content": REPLY}), false));
    }

    #[test]
    fn streamed_chunks_carry_calls_as_openai_deltas() {
        // the reply arrives in token-sized pieces that split the tags and the JSON
        let mut s = StreamChoices::new(true, Some(&hermes()), 3);
        let mut chunks = Vec::new();
        let bytes: Vec<usize> = (0..=REPLY.len()).step_by(4).chain([REPLY.len()]).collect();
        for w in bytes.windows(2) {
            chunks.extend(s.text(&REPLY[w[0]..w[1]], false));
        }
        chunks.extend(s.text("", true));
        chunks.push(s.last(FinishReason::Eos));
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c[0]["delta"]).collect();
        let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
        assert_eq!(content, "Checking.");
        let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
        assert_eq!(calls.len(), 2);
        assert_eq!(
            calls[1],
            &json!([{"index": 1, "id": format!("call_{}_3_1", call_id_prefix()), "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}])
        );
        assert_eq!(chunks.last().unwrap()[0]["finish_reason"], "tool_calls");
        assert!(chunks[..chunks.len() - 1].iter().all(|c| c[0]["finish_reason"].is_null()));
        // without tools: content deltas as the text comes, finish `stop`
        let mut plain = StreamChoices::new(true, None, 3);
        assert_eq!(
            plain.text("<tool_call>", false),
            [json!([{"index": 0, "delta": {"content": "<tool_call>"}, "finish_reason": null}])]
        );
        assert!(plain.text("", false).is_empty());
        assert_eq!(plain.last(FinishReason::Eos)[0]["finish_reason"], "stop");
    }
}
