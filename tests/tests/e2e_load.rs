//! Load (issue 21): 16 concurrent clients, each sending its requests one after the other, first over gRPC and then
//! over HTTP (OpenAI's streamed completions), against one daemon with the default model. The workload comes from a
//! seeded RNG: plain prompts and chat messages, `max_tokens` from 1 to 48, greedy; a fifth of the requests are
//! cancelled mid-stream after a random number of received tokens (some before the first one) by dropping the gRPC
//! stream or closing the HTTP connection.
//!
//! Checked, per front end: every request that was not cancelled ends (eos or max_tokens; `stop` or `length`) with
//! exactly the text, token count and prompt length of a serial run of the same (prompt, max_tokens), made one at a
//! time before the load; a cancelled request's text so far agrees with the serial text of its prompt; no id comes
//! twice; the daemon's totals grew by exactly the requests sent and their prompt tokens (nothing lost or counted
//! twice), its cancellations and generated tokens within what the clients account for; the daemon is idle after the
//! run and answers the next request. At the end: the daemon exits cleanly on SIGTERM, its log has one "request done"
//! line per request it counted, no id twice, and no error. Timings and RSS are printed, never asserted.
//!
//! CI size: 16 clients × [`CI_REQUESTS`]; `STRATA_LOAD_REQUESTS` sets the requests per client (full size: 50,
//! `tools/load-test`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use strata_proto::v1 as pb;
use strata_proto::v1::strata_client::StrataClient;
use strata_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::Channel;

/// Concurrent clients.
const CLIENTS: usize = 16;
/// Requests per client in CI (the whole test, both front ends and the serial run, in about a minute on 2 cores).
const CI_REQUESTS: usize = 3;
/// The workload's seed.
const SEED: u64 = 0x5eed_0021;
/// The largest `max_tokens` drawn.
const MAX_TOKENS: u32 = 48;
/// One request in five is cancelled.
const CANCEL_ONE_IN: usize = 5;
/// Against hangs only: the longest wait for one request's whole stream (queue included).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// Against hangs only: the longest wait for the daemon to account for every request after a run.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);

/// xorshift64*: a small seeded generator (the workload repeats from run to run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What a request asks: a raw prompt (completions) or a system and a user message (chat).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Prompt {
    Plain(String),
    Chat { system: String, user: String },
}

impl Prompt {
    /// A short description for assertion messages.
    fn label(&self) -> String {
        let cut = |s: &str| s.chars().take(40).collect::<String>();
        match self {
            Prompt::Plain(t) => format!("prompt {:?}", cut(t)),
            Prompt::Chat { user, .. } => format!("chat {:?}", cut(user)),
        }
    }
}

/// The prompts the workload draws from: short fixed texts, the first two user turns of each fixed conversation as
/// chats, and one long prompt (two prefill chunks of the CPU's 256 tokens: a cancellation can land between them).
/// The long prompt is the last.
fn prompts() -> Vec<Prompt> {
    let mut p: Vec<Prompt> = [
        "The capital of France is",
        "Once upon a time",
        "The three primary colors are",
        "Counting: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
        "def fibonacci(n):",
        "Water boils at",
    ]
    .iter()
    .map(|t| Prompt::Plain(t.to_string()))
    .collect();
    let (system, chats) = conversations();
    for chat in &chats {
        for user in chat.iter().take(2) {
            p.push(Prompt::Chat { system: system.clone(), user: user.clone() });
        }
    }
    let all: Vec<&str> = chats.iter().flatten().map(String::as_str).collect();
    p.push(Prompt::Plain(format!("Questions people asked today:\n{}\nThe most common topic was", all.join("\n"))));
    p
}

/// One request of the workload.
#[derive(Debug, Clone)]
struct Job {
    /// Index into [`prompts`].
    prompt: usize,
    max_tokens: u32,
    /// Cancel after this many received tokens (0: before the first), if this request is cancelled.
    cancel_after: Option<u32>,
}

/// The workload: `clients` lists of `requests` jobs. Prompts are uniform except the long one (1 in 24);
/// `max_tokens` uniform in 1..=[`MAX_TOKENS`]; exactly one job in [`CANCEL_ONE_IN`] is cancelled, a quarter of those
/// before the first token, the rest after 1..max_tokens-1 tokens.
fn workload(seed: u64, clients: usize, requests: usize, n_prompts: usize) -> Vec<Vec<Job>> {
    let mut rng = Rng(seed);
    let mut jobs: Vec<Vec<Job>> = (0..clients)
        .map(|_| {
            (0..requests)
                .map(|_| {
                    let prompt =
                        if rng.below(24) == 0 { n_prompts - 1 } else { rng.below(n_prompts as u64 - 1) as usize };
                    Job { prompt, max_tokens: 1 + rng.below(MAX_TOKENS as u64) as u32, cancel_after: None }
                })
                .collect()
        })
        .collect();
    // a fifth of all jobs, chosen by a partial Fisher-Yates shuffle of their positions
    let mut pos: Vec<(usize, usize)> = (0..clients).flat_map(|c| (0..requests).map(move |i| (c, i))).collect();
    for k in 0..pos.len() / CANCEL_ONE_IN {
        let j = k + rng.below((pos.len() - k) as u64) as usize;
        pos.swap(k, j);
        let (c, i) = pos[k];
        let job = &mut jobs[c][i];
        job.cancel_after = Some(if job.max_tokens < 2 || rng.below(4) == 0 {
            0
        } else {
            1 + rng.below(job.max_tokens as u64 - 1) as u32
        });
    }
    jobs
}

/// A serial run's result for one (prompt, max_tokens).
#[derive(Debug, Clone)]
struct Reference {
    text: String,
    finish: pb::FinishReason,
    generated: u32,
    prompt_tokens: u32,
}

/// How a request of the load ended, as its client saw it.
#[derive(Debug)]
enum Outcome {
    /// The stream ended normally. `finish`: the front end's word (gRPC: `Eos`, `MaxTokens`; HTTP: `stop`, `length`);
    /// `id`: the daemon's request id (gRPC) or the response's `id` (HTTP).
    Completed { text: String, finish: String, generated: u32, prompt_tokens: u32, id: String },
    /// The client went away after `received` tokens (gRPC: token events; HTTP: chunks with text); `id`: the HTTP
    /// response's `id` when a chunk carried one.
    Cancelled { text: String, received: u32, id: Option<String> },
}

/// Where the clients send their requests.
#[derive(Debug, Clone)]
enum Front {
    /// gRPC on this Unix socket.
    Grpc(PathBuf),
    /// HTTP on this address, for this model id.
    Http(SocketAddr, String),
}

impl Front {
    fn name(&self) -> &'static str {
        match self {
            Front::Grpc(_) => "gRPC",
            Front::Http(..) => "HTTP",
        }
    }

    /// The finish reason this front end reports for a serial run's.
    fn finish_word(&self, f: pb::FinishReason) -> String {
        match (self, f) {
            (Front::Grpc(_), f) => format!("{f:?}"),
            (Front::Http(..), pb::FinishReason::MaxTokens | pb::FinishReason::Context) => "length".into(),
            (Front::Http(..), _) => "stop".into(),
        }
    }
}

/// A greedy gRPC request.
fn grpc_request(p: &Prompt, max_tokens: u32) -> pb::GenerateRequest {
    let mut r = pb::GenerateRequest { max_tokens, sampling: Some(pb::SamplingParams::default()), ..Default::default() };
    match p {
        Prompt::Plain(t) => r.prompt = t.clone(),
        Prompt::Chat { system, user } => {
            r.messages = vec![
                pb::ChatMessage { role: "system".into(), content: system.clone() },
                pb::ChatMessage { role: "user".into(), content: user.clone() },
            ]
        }
    }
    r
}

/// Runs one gRPC request: streams it, dropping the stream after `cancel_after` token events when set. Errors: a
/// failed call, a broken stream or events that do not add up (pieces vs. `Done.text`, token count vs. counters,
/// an event after `Done`).
async fn grpc_generate(c: &mut StrataClient<Channel>, p: &Prompt, job: &Job) -> Result<Outcome, String> {
    let mut s = c.generate(grpc_request(p, job.max_tokens)).await.map_err(|e| format!("Generate: {e}"))?.into_inner();
    let mut text = String::new();
    let mut received = 0u32;
    loop {
        if job.cancel_after == Some(received) {
            drop(s);
            return Ok(Outcome::Cancelled { text, received, id: None });
        }
        let ev = s.message().await.map_err(|e| format!("stream: {e}"))?.ok_or("stream ended without Done")?;
        match ev.event.ok_or("an empty event")? {
            pb::generate_event::Event::Token(t) => {
                text.push_str(&t.text);
                received += 1;
            }
            pb::generate_event::Event::Done(d) => {
                let c = d.counters.ok_or("Done without counters")?;
                if format!("{text}{}", d.tail) != d.text {
                    return Err(format!("streamed pieces {text:?} + tail {:?} != Done.text {:?}", d.tail, d.text));
                }
                if received != c.generated_tokens {
                    return Err(format!("{received} token events, counters say {}", c.generated_tokens));
                }
                if !matches!(s.message().await, Ok(None)) {
                    return Err("an event after Done".into());
                }
                let finish = pb::FinishReason::try_from(c.finish_reason).map_err(|e| e.to_string())?;
                return Ok(Outcome::Completed {
                    text: d.text,
                    finish: format!("{finish:?}"),
                    generated: c.generated_tokens,
                    prompt_tokens: c.prompt_tokens,
                    id: c.request_id.to_string(),
                });
            }
        }
    }
}

/// Position of `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A minimal HTTP/1.1 client for one streamed response: reads the head, then the chunked body's server-sent events.
struct SseReader {
    conn: TcpStream,
    /// Bytes read and not yet decoded.
    raw: Vec<u8>,
    /// Decoded body bytes not yet split into events.
    body: Vec<u8>,
    /// The last (empty) chunk was read.
    ended: bool,
}

impl SseReader {
    /// Sends `POST path` with a JSON body on a new connection to `addr`.
    async fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Result<SseReader, String> {
        let mut conn = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
        let body = body.to_string();
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(req.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        Ok(SseReader { conn, raw: Vec::new(), body: Vec::new(), ended: false })
    }

    /// Reads more bytes; false at the end of the connection.
    async fn fill(&mut self) -> Result<bool, String> {
        let mut b = [0u8; 8192];
        let n = self.conn.read(&mut b).await.map_err(|e| format!("read: {e}"))?;
        self.raw.extend_from_slice(&b[..n]);
        Ok(n > 0)
    }

    /// Reads the response head: it must be `200` with a chunked `text/event-stream` body.
    async fn head(&mut self) -> Result<(), String> {
        loop {
            if let Some(i) = find(&self.raw, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.raw[..i]).to_ascii_lowercase();
                self.raw.drain(..i + 4);
                if !head.starts_with("http/1.1 200") {
                    let rest = String::from_utf8_lossy(&self.raw).into_owned();
                    return Err(format!("response head {head:?}, body starts {rest:?}"));
                }
                if !head.contains("transfer-encoding: chunked") || !head.contains("content-type: text/event-stream") {
                    return Err(format!("not a chunked event stream: {head:?}"));
                }
                return Ok(());
            }
            if !self.fill().await? {
                return Err("connection closed before the response head".into());
            }
        }
    }

    /// Moves whole chunks from `raw` to `body`; whether it moved any (or reached the last chunk).
    fn decode(&mut self) -> Result<bool, String> {
        let mut moved = false;
        while let Some(eol) = find(&self.raw, b"\r\n") {
            let line = String::from_utf8_lossy(&self.raw[..eol]).into_owned();
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|e| format!("bad chunk size line {line:?}: {e}"))?;
            if size == 0 {
                self.ended = true;
                return Ok(true);
            }
            if self.raw.len() < eol + 2 + size + 2 {
                break;
            }
            self.body.extend_from_slice(&self.raw[eol + 2..eol + 2 + size]);
            self.raw.drain(..eol + 2 + size + 2);
            moved = true;
        }
        Ok(moved)
    }

    /// The next event's data (its `data:` lines joined); `None` when the body ended.
    async fn next_data(&mut self) -> Result<Option<String>, String> {
        loop {
            if let Some(i) = find(&self.body, b"\n\n") {
                let ev: Vec<u8> = self.body.drain(..i + 2).collect();
                let ev = String::from_utf8(ev).map_err(|e| format!("event not UTF-8: {e}"))?;
                let data: Vec<&str> = ev.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim_start).collect();
                if data.is_empty() {
                    continue; // a comment or a keep-alive
                }
                return Ok(Some(data.join("\n")));
            }
            if self.ended {
                return Ok(None);
            }
            if !self.decode()? && !self.fill().await? {
                return Err("connection closed in the middle of the body".into());
            }
        }
    }
}

/// The JSON body of a streamed greedy HTTP request (usage included) and its route.
fn http_request(p: &Prompt, max_tokens: u32, model: &str) -> (&'static str, serde_json::Value) {
    // with the neutral values of fields the server does not implement, as OpenAI's clients send them
    let mut body = serde_json::json!({"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": true,
                                      "stream_options": {"include_usage": true}, "frequency_penalty": 0.0,
                                      "presence_penalty": 0, "logit_bias": {}, "logprobs": false, "user": "e2e-load"});
    match p {
        Prompt::Plain(t) => {
            body["prompt"] = t.as_str().into();
            ("/v1/completions", body)
        }
        Prompt::Chat { system, user } => {
            body["messages"] = serde_json::json!([{"role": "system", "content": system},
                                                  {"role": "user", "content": user}]);
            body["response_format"] = serde_json::json!({"type": "text"});
            ("/v1/chat/completions", body)
        }
    }
}

/// Runs one HTTP request on a connection of its own: reads its events, closing the connection after
/// `cancel_after` chunks with text when set (0: right after the response head, when the daemon has queued it).
/// Errors: a refused request, an error event, chunks of different ids, a stream without finish reason or usage.
async fn http_generate(addr: SocketAddr, model: &str, p: &Prompt, job: &Job) -> Result<Outcome, String> {
    let chat = matches!(p, Prompt::Chat { .. });
    let (path, body) = http_request(p, job.max_tokens, model);
    let mut r = SseReader::post(addr, path, &body).await?;
    r.head().await?;
    let mut text = String::new();
    let mut received = 0u32;
    let mut id: Option<String> = None;
    let mut finish: Option<String> = None;
    let mut usage: Option<(u32, u32)> = None;
    loop {
        if job.cancel_after == Some(received) {
            drop(r);
            return Ok(Outcome::Cancelled { text, received, id });
        }
        let data = r.next_data().await?.ok_or("the body ended before [DONE]")?;
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&data).map_err(|e| format!("event {data:?}: {e}"))?;
        if v.get("error").is_some() {
            return Err(format!("error event {data}"));
        }
        let this = v["id"].as_str().ok_or_else(|| format!("chunk without id: {data}"))?;
        match &id {
            None => id = Some(this.to_string()),
            Some(i) if i != this => return Err(format!("chunk ids differ: {i} then {this}")),
            _ => {}
        }
        if let Some(u) = v.get("usage") {
            let n = |k: &str| u[k].as_u64().map(|x| x as u32).ok_or_else(|| format!("usage without {k}: {data}"));
            usage = Some((n("prompt_tokens")?, n("completion_tokens")?));
        }
        for choice in v["choices"].as_array().ok_or_else(|| format!("chunk without choices: {data}"))? {
            let piece = if chat { choice["delta"]["content"].as_str() } else { choice["text"].as_str() };
            if let Some(piece) = piece.filter(|s| !s.is_empty()) {
                if finish.is_some() {
                    return Err(format!("text after the finish reason: {data}"));
                }
                text.push_str(piece);
                received += 1;
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    let finish = finish.ok_or("no finish reason before [DONE]")?;
    let (prompt_tokens, generated) = usage.ok_or("no usage chunk before [DONE]")?;
    Ok(Outcome::Completed { text, finish, generated, prompt_tokens, id: id.ok_or("no chunk before [DONE]")? })
}

/// `GET path` on a connection of its own; the status line and the body.
async fn http_get(addr: SocketAddr, path: &str) -> Result<(String, String), String> {
    let mut conn = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(req.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
    let mut all = Vec::new();
    conn.read_to_end(&mut all).await.map_err(|e| format!("read: {e}"))?;
    let all = String::from_utf8_lossy(&all).into_owned();
    let (head, body) = all.split_once("\r\n\r\n").ok_or_else(|| format!("no response head: {all:?}"))?;
    Ok((head.lines().next().unwrap_or("").to_string(), body.to_string()))
}

/// Waits (≤ 60 s) until the HTTP front end answers; the id of the model it serves.
async fn http_model_id(addr: SocketAddr) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok((status, body)) = http_get(addr, "/v1/models").await {
            assert!(status.contains(" 200 "), "GET /v1/models: {status} {body}");
            let v: serde_json::Value = serde_json::from_str(&body).expect("/v1/models JSON");
            return v["data"][0]["id"].as_str().expect("model id").to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the HTTP front end on {addr} did not answer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads the daemon's log (its stderr) on a thread from now on, so that a long run never blocks the daemon on a full
/// pipe (`Daemon::start` pipes stderr and reads it only at exit; a request writes a line); the lines, once the
/// daemon has exited.
fn drain_log(d: &mut Daemon) -> std::thread::JoinHandle<Vec<String>> {
    let err = d.child.stderr.take().expect("the daemon's stderr");
    std::thread::spawn(move || BufReader::new(err).lines().map_while(Result::ok).collect())
}

/// CPU time used so far, in seconds.
#[derive(Debug, Clone, Copy, Default)]
struct CpuTimes {
    /// The daemon's engine thread and compute pool (`strata-engine`, `strata-cpu-*`).
    engine: f64,
    /// The rest of the daemon: the front ends' tokio threads, tokenizing (threads that ended included).
    front: f64,
    /// This process: the clients.
    clients: f64,
    /// The whole machine (every process; `/proc/stat`).
    machine: f64,
}

impl CpuTimes {
    /// Now, for the daemon `pid`.
    fn now(pid: u32) -> CpuTimes {
        let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
        // utime + stime of a /proc stat line (the fields after the parenthesized name)
        let stat = |path: &str| -> f64 {
            let t = std::fs::read_to_string(path).unwrap_or_default();
            let rest: Vec<&str> = t.rsplit_once(')').map_or("", |x| x.1).split_whitespace().collect();
            let field = |i: usize| rest.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            (field(11) + field(12)) / tick
        };
        let mut engine = 0.0;
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.starts_with("strata-engine") || comm.starts_with("strata-cpu") {
                engine += stat(&task.path().join("stat").to_string_lossy());
            }
        }
        let cpu = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let jiffies: Vec<f64> =
            cpu.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        let busy =
            jiffies.iter().take(8).sum::<f64>() - jiffies.get(3).unwrap_or(&0.0) - jiffies.get(4).unwrap_or(&0.0);
        CpuTimes {
            engine,
            front: stat(&format!("/proc/{pid}/stat")) - engine,
            clients: stat("/proc/self/stat"),
            machine: busy / tick,
        }
    }

    /// The time used since `before`.
    fn since(self, before: CpuTimes) -> CpuTimes {
        CpuTimes {
            engine: self.engine - before.engine,
            front: self.front - before.front,
            clients: self.clients - before.clients,
            machine: self.machine - before.machine,
        }
    }
}

/// The daemon's statistics.
async fn stats(c: &mut StrataClient<Channel>) -> pb::StatsReply {
    c.get_stats(pb::StatsRequest {}).await.expect("GetStats").into_inner()
}

/// The serial runs: every distinct (prompt, max_tokens) of a request that is not cancelled, one at a time, and for
/// a prompt that only cancelled requests use, a 1-token run (for its prompt length), and the request the test sends
/// after each load run.
async fn serial_runs(
    c: &mut StrataClient<Channel>,
    prompts: &[Prompt],
    work: &[Vec<Job>],
    after: (usize, u32),
) -> BTreeMap<(usize, u32), Reference> {
    let mut keys: Vec<(usize, u32)> =
        work.iter().flatten().filter(|j| j.cancel_after.is_none()).map(|j| (j.prompt, j.max_tokens)).collect();
    keys.push(after);
    for p in work.iter().flatten().map(|j| j.prompt) {
        if !keys.iter().any(|k| k.0 == p) {
            keys.push((p, 1));
        }
    }
    keys.sort();
    keys.dedup();
    let mut refs = BTreeMap::new();
    for (p, m) in keys {
        let job = Job { prompt: p, max_tokens: m, cancel_after: None };
        let out = tokio::time::timeout(REQUEST_TIMEOUT, grpc_generate(c, &prompts[p], &job))
            .await
            .unwrap_or_else(|_| panic!("serial run of {} max_tokens {m}: no answer (hang)", prompts[p].label()))
            .unwrap_or_else(|e| panic!("serial run of {} max_tokens {m}: {e}", prompts[p].label()));
        let Outcome::Completed { text, finish, generated, prompt_tokens, .. } = out else { unreachable!() };
        let finish = match finish.as_str() {
            "Eos" => pb::FinishReason::Eos,
            "MaxTokens" => pb::FinishReason::MaxTokens,
            f => panic!("serial run of {} max_tokens {m}: finish reason {f}", prompts[p].label()),
        };
        refs.insert((p, m), Reference { text, finish, generated, prompt_tokens });
    }
    refs
}

/// One text agrees with another of the same prompt (greedy): one is the start of the other.
fn agree(a: &str, b: &str) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// What a load run did, for the summary.
struct RunSummary {
    front: &'static str,
    requests: usize,
    completed: usize,
    cancelled: usize,
    /// Cancelled requests the daemon finished anyway (the client left after the last token it waited for).
    finished_anyway: u64,
    /// Tokens of the completed requests.
    completed_tokens: u64,
    /// Tokens the cancelled requests' clients received.
    received_cancelled: u64,
    /// Tokens the daemon generated during the run (the cancelled requests' included).
    generated: u64,
    /// Prompt tokens the daemon counted (every request's whole prompt, reused prefixes included).
    prompt_tokens: u64,
    /// The engine's prefill and decode time during the run.
    engine: Duration,
    /// CPU time used during the run.
    cpu: CpuTimes,
    wall: Duration,
    rss_before: u64,
    rss_after: u64,
}

/// Runs the workload over `front` (a task per client, each client's requests one after the other), then checks
/// every outcome against the serial runs and the daemon's totals against the clients' accounts, and sends one more
/// request (`after`) that must be served at once.
async fn load_run(
    front: Front,
    pid: u32,
    c: &mut StrataClient<Channel>,
    prompts: &Arc<Vec<Prompt>>,
    work: &[Vec<Job>],
    refs: &BTreeMap<(usize, u32), Reference>,
    after: (usize, u32),
) -> RunSummary {
    let fe = front.name();
    let before = stats(c).await;
    let tot0 = before.totals.expect("totals");
    assert!(before.queued == 0 && !before.busy, "{fe}: the daemon is not idle before the run");
    let last_id = before.last_request.as_ref().map_or(0, |r| r.request_id);
    let n: usize = work.iter().map(Vec::len).sum();

    let t0 = Instant::now();
    let cpu0 = CpuTimes::now(pid);
    let mut tasks = Vec::new();
    for (client, jobs) in work.iter().enumerate() {
        let (front, prompts, jobs) = (front.clone(), prompts.clone(), jobs.clone());
        tasks.push(tokio::spawn(async move {
            let mut grpc = match &front {
                Front::Grpc(socket) => Some(connect(socket).await),
                Front::Http(..) => None,
            };
            let mut outs = Vec::new();
            for (i, job) in jobs.iter().enumerate() {
                let p = &prompts[job.prompt];
                let what = format!(
                    "{} client {client} request {i} ({}, max_tokens {})",
                    front.name(),
                    p.label(),
                    job.max_tokens
                );
                let run = async {
                    match &front {
                        Front::Grpc(_) => grpc_generate(grpc.as_mut().unwrap(), p, job).await,
                        Front::Http(addr, model) => http_generate(*addr, model, p, job).await,
                    }
                };
                let out = tokio::time::timeout(REQUEST_TIMEOUT, run)
                    .await
                    .unwrap_or_else(|_| panic!("{what}: not finished after {REQUEST_TIMEOUT:?} (hang)"))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                outs.push(out);
            }
            outs
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())));
    }
    let wall = t0.elapsed();
    let cpu = CpuTimes::now(pid).since(cpu0);

    // every outcome against the serial runs
    let prompt_len = |p: usize| refs.iter().find(|(k, _)| k.0 == p).map(|(_, r)| r.prompt_tokens).unwrap();
    let longest = |p: usize| refs.iter().filter(|(k, _)| k.0 == p).map(|(_, r)| r).max_by_key(|r| r.generated);
    let mut ids = HashSet::new();
    let (mut completed, mut cancelled, mut completed_tokens) = (0usize, 0usize, 0u64);
    let (mut received_cancelled, mut max_cancelled, mut prompt_tokens) = (0u64, 0u64, 0u64);
    for (client, (jobs, outs)) in work.iter().zip(&outcomes).enumerate() {
        for (i, (job, out)) in jobs.iter().zip(outs).enumerate() {
            let what = format!(
                "{fe} client {client} request {i} ({}, max_tokens {})",
                prompts[job.prompt].label(),
                job.max_tokens
            );
            prompt_tokens += prompt_len(job.prompt) as u64;
            match out {
                Outcome::Completed { text, finish, generated, prompt_tokens: pt, id } => {
                    completed += 1;
                    completed_tokens += *generated as u64;
                    assert_eq!(*pt, prompt_len(job.prompt), "{what}: prompt tokens (another request's answer?)");
                    if let Some(r) = refs.get(&(job.prompt, job.max_tokens)) {
                        assert_eq!(text, &r.text, "{what}: the text differs from the serial run's");
                        assert_eq!(finish, &front.finish_word(r.finish), "{what}: finish reason");
                        assert_eq!(*generated, r.generated, "{what}: generated tokens");
                    } else {
                        // a cancellation point the request did not reach: it ended first
                        let at = job.cancel_after.expect("every request not cancelled has a serial run");
                        let by_length = *finish == front.finish_word(pb::FinishReason::MaxTokens);
                        assert!(
                            *generated <= job.max_tokens && (by_length == (*generated == job.max_tokens)),
                            "{what}: {generated} tokens, finish {finish}"
                        );
                        if let Front::Grpc(_) = front {
                            assert!(*generated < at, "{what}: {generated} token events, cancelled after {at}");
                        }
                        let r = longest(job.prompt).unwrap();
                        assert!(agree(text, &r.text), "{what}: {text:?} disagrees with the serial {:?}", r.text);
                    }
                    if let Front::Grpc(_) = front {
                        let n_id: u64 = id.parse().unwrap();
                        assert!(
                            n_id > last_id && n_id <= last_id + n as u64,
                            "{what}: request id {n_id} outside the run"
                        );
                    }
                    assert!(ids.insert(id.clone()), "{what}: id {id} seen twice");
                }
                Outcome::Cancelled { text, received, id } => {
                    cancelled += 1;
                    received_cancelled += *received as u64;
                    max_cancelled += job.max_tokens as u64;
                    assert_eq!(job.cancel_after, Some(*received), "{what}: cancelled at the wrong point");
                    if let Some(r) = longest(job.prompt) {
                        assert!(
                            agree(text, &r.text),
                            "{what}: partial {text:?} disagrees with the serial {:?}",
                            r.text
                        );
                    }
                    if let Some(id) = id {
                        assert!(ids.insert(id.clone()), "{what}: id {id} seen twice");
                    }
                }
            }
        }
    }
    assert_eq!(completed + cancelled, n);

    // the daemon accounts for every request once
    let t_settle = Instant::now();
    let after_stats = loop {
        let s = stats(c).await;
        let t = s.totals.as_ref().unwrap();
        if t.requests >= tot0.requests + n as u64 && s.queued == 0 && !s.busy {
            break s;
        }
        assert!(
            t_settle.elapsed() < SETTLE_TIMEOUT,
            "{fe}: after {SETTLE_TIMEOUT:?} the daemon has finished {} of the run's {n} requests (queued {}, busy {})",
            t.requests - tot0.requests,
            s.queued,
            s.busy
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let t1 = after_stats.totals.unwrap();
    let d_requests = t1.requests - tot0.requests;
    let d_cancelled = t1.cancelled - tot0.cancelled;
    let d_generated = t1.generated_tokens - tot0.generated_tokens;
    assert_eq!(d_requests, n as u64, "{fe}: the daemon counted {d_requests} requests, the clients sent {n}");
    assert_eq!(t1.rejected, tot0.rejected, "{fe}: requests refused");
    assert_eq!(
        t1.prompt_tokens - tot0.prompt_tokens,
        prompt_tokens,
        "{fe}: prompt tokens counted vs. the prompts of the requests sent"
    );
    assert!(d_cancelled <= cancelled as u64, "{fe}: the daemon cancelled {d_cancelled}, the clients {cancelled}");
    let (lo, hi) = (completed_tokens + received_cancelled, completed_tokens + max_cancelled);
    assert!(
        (lo..=hi).contains(&d_generated),
        "{fe}: {d_generated} tokens generated; the clients account for {completed_tokens} completed + {received_cancelled}..={max_cancelled} cancelled"
    );

    // the daemon serves the next request at once, with the serial run's text
    let r = &refs[&after];
    let job = Job { prompt: after.0, max_tokens: after.1, cancel_after: None };
    let t_next = Instant::now();
    let out = tokio::time::timeout(REQUEST_TIMEOUT, grpc_generate(c, &prompts[after.0], &job))
        .await
        .unwrap_or_else(|_| panic!("{fe}: the request after the run hangs"))
        .unwrap_or_else(|e| panic!("{fe}: the request after the run: {e}"));
    let Outcome::Completed { text, .. } = out else { unreachable!() };
    assert_eq!(text, r.text, "{fe}: the request after the run");
    let next_ms = t_next.elapsed().as_secs_f64() * 1000.0;
    let queue_ms = stats(c).await.last_request.map_or(f64::NAN, |l| l.queue_ms);
    println!("{fe}: the request after the run took {next_ms:.0} ms (queued {queue_ms:.1} ms)");

    RunSummary {
        front: fe,
        requests: n,
        completed,
        cancelled,
        finished_anyway: cancelled as u64 - d_cancelled,
        completed_tokens,
        received_cancelled,
        generated: d_generated,
        prompt_tokens,
        engine: Duration::from_secs_f64(
            (t1.prompt_ms - tot0.prompt_ms + t1.decode_ms - tot0.decode_ms).max(0.0) / 1000.0,
        ),
        wall,
        cpu,
        rss_before: before.rss_bytes,
        rss_after: after_stats.rss_bytes,
    }
}

#[test]
fn concurrent_clients_over_grpc_and_http_with_cancellations() {
    let per_client: usize = match std::env::var("STRATA_LOAD_REQUESTS") {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("STRATA_LOAD_REQUESTS={v:?}: not a number")),
        Err(_) => CI_REQUESTS,
    };
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut d = Daemon::start(&["--http-listen", &addr.to_string()]);
    let log = drain_log(&mut d);
    let pid = d.child.id();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let requests = rt.block_on(async {
        let model = http_model_id(addr).await;
        let prompts = Arc::new(prompts());
        let work = workload(SEED, CLIENTS, per_client, prompts.len());
        let after = (0, 8);
        let mut c = d.client().await;
        let t0 = Instant::now();
        let refs = serial_runs(&mut c, &prompts, &work, after).await;
        let serial = t0.elapsed();
        println!("serial runs: {} (prompt, max_tokens) in {:.1} s", refs.len(), serial.as_secs_f64());
        let mut runs = Vec::new();
        for front in [Front::Grpc(d.socket.clone()), Front::Http(addr, model.clone())] {
            runs.push(load_run(front, pid, &mut c, &prompts, &work, &refs, after).await);
        }
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "load: {CLIENTS} clients x {per_client} requests, seed {SEED:#x}, {} prompts, max_tokens 1..={MAX_TOKENS}, \
             1 in {CANCEL_ONE_IN} cancelled; serial runs {:.1} s",
            prompts.len(),
            serial.as_secs_f64()
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for r in &runs {
            let s = r.wall.as_secs_f64();
            println!(
                "{fe}: {} requests: {} completed, {} cancelled ({} of them finished by the daemon first)\n\
                 {fe}: tokens: {} completed, {} generated ({} for cancelled requests, whose clients received {}); \
                 {} prompt tokens\n\
                 {fe}: wall {s:.1} s (engine busy {:.1} s): {:.2} requests/s, {:.1} completed tokens/s, \
                 {:.1} generated tokens/s\n\
                 {fe}: CPU {:.0} s of {:.0} s ({cores} cores): daemon engine {:.0} s, daemon front ends {:.1} s, \
                 clients {:.1} s, other processes {:.0} s\n\
                 {fe}: RSS {:.1} MiB before, {:.1} MiB after",
                r.requests,
                r.completed,
                r.cancelled,
                r.finished_anyway,
                r.completed_tokens,
                r.generated,
                r.generated - r.completed_tokens,
                r.received_cancelled,
                r.prompt_tokens,
                r.engine.as_secs_f64(),
                r.requests as f64 / s,
                r.completed_tokens as f64 / s,
                r.generated as f64 / s,
                r.cpu.machine,
                cores as f64 * s,
                r.cpu.engine,
                r.cpu.front,
                r.cpu.clients,
                r.cpu.machine - r.cpu.engine - r.cpu.front - r.cpu.clients,
                mib(r.rss_before),
                mib(r.rss_after),
                fe = r.front,
            );
        }
        stats(&mut c).await.totals.unwrap().requests
    });
    // the log: one "request done" line per request the daemon counted, no request twice, no error; a clean exit
    d.signal(Signal::SIGTERM);
    let (st, _) = d.wait(Duration::from_secs(60));
    let log = log.join().unwrap();
    assert_eq!(
        st.code(),
        Some(0),
        "the daemon's exit after the load; its log ends {:?}",
        &log[log.len().saturating_sub(20)..]
    );
    let errors: Vec<&String> = log.iter().filter(|l| l.contains(" ERROR ") || l.contains("panicked")).collect();
    assert!(errors.is_empty(), "errors in the daemon's log: {errors:?}");
    let done: Vec<&str> = log
        .iter()
        .filter(|l| l.contains("request done"))
        .map(|l| l.split_whitespace().find(|w| w.starts_with("request=")).expect("request= in a request done line"))
        .collect();
    assert_eq!(done.len() as u64, requests, "\"request done\" lines vs. the requests the daemon counted");
    assert_eq!(done.iter().collect::<HashSet<_>>().len(), done.len(), "a request id logged twice");
}

#[test]
fn the_workload_is_seeded_and_cancels_a_fifth() {
    let n_prompts = prompts().len();
    let a = workload(SEED, CLIENTS, 50, n_prompts);
    let b = workload(SEED, CLIENTS, 50, n_prompts);
    let flat: Vec<&Job> = a.iter().flatten().collect();
    assert_eq!(flat.len(), 800);
    assert_eq!(flat.iter().filter(|j| j.cancel_after.is_some()).count(), 160);
    assert!(flat.iter().any(|j| j.cancel_after == Some(0)) && flat.iter().any(|j| j.cancel_after > Some(0)));
    assert!(flat.iter().all(|j| (1..=MAX_TOKENS).contains(&j.max_tokens) && j.prompt < n_prompts));
    assert!(flat.iter().all(|j| j.cancel_after.is_none_or(|k| k < j.max_tokens.max(1))));
    let same = a.iter().flatten().zip(b.iter().flatten());
    assert!(same
        .into_iter()
        .all(|(x, y)| (x.prompt, x.max_tokens, x.cancel_after) == (y.prompt, y.max_tokens, y.cancel_after)));
    let used: HashMap<usize, usize> = flat.iter().fold(HashMap::new(), |mut m, j| {
        *m.entry(j.prompt).or_default() += 1;
        m
    });
    assert_eq!(used.len(), n_prompts, "every prompt is used at full size");
}
