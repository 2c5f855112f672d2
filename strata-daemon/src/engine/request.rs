//! A generation request: validation and preparation (chat template,
//! tokenization) before it is queued.

use super::sampler::SamplingParams;
use crate::model::chat::{self, Chat, Message};
use crate::model::tool_calls::{ToolFormat, ToolParse};
use crate::model::tools::{Tool, ToolChoice};
use crate::model::Tokenizer;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token was produced.
    Eos,
    /// A stop string was produced.
    StopString,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The KV cache (context) is full.
    Context,
    /// The client went away or the daemon is shutting down.
    Cancelled,
}

impl FinishReason {
    /// Lower-case name ("eos", "stop", "length", "context", "cancelled").
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::StopString => "stop",
            FinishReason::MaxTokens => "length",
            FinishReason::Context => "context",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// A request that failed validation; the message says which field and why.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{message}")]
pub struct RequestError {
    /// What is wrong.
    pub message: String,
    /// The request field at fault where one is named (`tools`, `tool_choice`, `messages`), as OpenAI's error
    /// object's `param`.
    pub param: Option<&'static str>,
}

impl RequestError {
    /// An error about no field in particular.
    pub fn new(message: impl Into<String>) -> Self {
        RequestError { message: message.into(), param: None }
    }

    /// An error about field `param`.
    pub fn field(param: &'static str, message: impl Into<String>) -> Self {
        RequestError { message: message.into(), param: Some(param) }
    }
}

/// Raw request fields as received (before validation).
#[derive(Debug, Clone, Default)]
pub struct RawRequest {
    /// Prompt text (used when `messages` is empty).
    pub prompt: String,
    /// Chat messages (role `system`, `user`, `assistant` or `tool`, content, and the tool fields).
    pub messages: Vec<Message>,
    /// Tools offered to the model (rendered by the chat template).
    pub tools: Vec<Tool>,
    /// Whether and how the model may call them.
    pub tool_choice: ToolChoice,
    /// Tokens to generate at most.
    pub max_tokens: u32,
    /// Temperature (0 = greedy).
    pub temperature: f32,
    /// Top-k (0 = off).
    pub top_k: u32,
    /// Top-p (None = 1).
    pub top_p: Option<f32>,
    /// Min-p.
    pub min_p: f32,
    /// Repetition penalty (None = 1).
    pub repeat_penalty: Option<f32>,
    /// Penalty window (None = 64).
    pub repeat_last_n: Option<u32>,
    /// Seed of the sampler (None = a fresh random seed per request; a given seed repeats the same draw).
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
}

/// A validated, tokenized request.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Prompt token ids (BOS included when the model wants it).
    pub prompt_ids: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// How to find tool calls in the reply (tools offered to a template whose format is known).
    pub tool_parse: Option<ToolParse>,
}

/// Most bytes of prompt text: the prompt, or every text the chat template is given (each message's role, content,
/// tool calls, `tool_call_id` and name, and the tools), counted by [`prompt_bytes`].
pub const MAX_PROMPT_BYTES: usize = 4 << 20;
/// Most chat messages.
pub const MAX_MESSAGES: usize = 4096;
/// Most stop strings, and bytes of each.
pub const MAX_STOPS: usize = 16;
/// See [`MAX_STOPS`].
pub const MAX_STOP_BYTES: usize = 256;

/// Validates `raw` and tokenizes its prompt (rendering chat messages with
/// the model's template). `n_ctx` is the context length in tokens.
///
/// Tools (`raw.tools`, unless `tool_choice` is none) are rendered by the template, which must read `tools`; a
/// `tool_choice` of required or a named function is enforced by starting the reply with a call in the template's
/// format ([`ToolFormat::forced_prefix`]) where the format is known.
///
/// Errors ([`RequestError`]): sizes over [`MAX_PROMPT_BYTES`], [`MAX_MESSAGES`], [`MAX_STOPS`] or
/// [`MAX_STOP_BYTES`], empty prompt, unknown role, no chat template, tools for a template without tools (param
/// `tools`), a `tool_choice` naming a function not offered or requiring tools when none are (param
/// `tool_choice`), special-token text in tools or tool calls,
/// an empty stop string, `max_tokens` 0 or larger than the context, a prompt that leaves no room
/// in the context, temperature < 0, top_p outside (0, 1], min_p outside
/// [0, 1), repeat_penalty ≤ 0, non-finite numbers.
pub fn prepare(raw: &RawRequest, tok: &Tokenizer, n_ctx: usize) -> Result<GenerateParams, RequestError> {
    let err = |m: String| Err(RequestError::new(m));
    // sizes bounded before any work (the front ends bound the bytes of a request too)
    let (text_bytes, tool_bytes) = prompt_bytes(raw);
    if text_bytes > MAX_PROMPT_BYTES {
        let tools = if tool_bytes > 0 { format!(" ({tool_bytes} of them the tools)") } else { String::new() };
        return err(format!("prompt of {text_bytes} bytes{tools} is over the limit of {MAX_PROMPT_BYTES}"));
    }
    if raw.messages.len() > MAX_MESSAGES {
        return err(format!("{} messages are over the limit of {MAX_MESSAGES}", raw.messages.len()));
    }
    if raw.stop.len() > MAX_STOPS || raw.stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return err(format!("at most {MAX_STOPS} stop strings of at most {MAX_STOP_BYTES} bytes each"));
    }
    if raw.stop.iter().any(String::is_empty) {
        return err("a stop string is empty".into());
    }
    if raw.max_tokens == 0 {
        return err("max_tokens must be at least 1".into());
    }
    if raw.max_tokens as usize > n_ctx {
        return err(format!("max_tokens {} is larger than the context of {n_ctx} tokens", raw.max_tokens));
    }
    if !raw.temperature.is_finite() || raw.temperature < 0.0 {
        return err(format!("temperature must be a finite number >= 0 (got {})", raw.temperature));
    }
    let top_p = raw.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return err(format!("top_p must be in (0, 1] (got {top_p})"));
    }
    if !(raw.min_p >= 0.0 && raw.min_p < 1.0) {
        return err(format!("min_p must be in [0, 1) (got {})", raw.min_p));
    }
    let rp = raw.repeat_penalty.unwrap_or(1.0);
    if !(rp.is_finite() && rp > 0.0) {
        return err(format!("repeat_penalty must be a finite number > 0 (got {rp})"));
    }
    let mut segments = None;
    let mut tool_parse_out = None;
    let text = if raw.messages.is_empty() {
        if raw.prompt.is_empty() {
            return err("prompt is empty (give a prompt or chat messages)".into());
        }
        raw.prompt.clone()
    } else {
        for m in &raw.messages {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
                return err(format!("unknown chat role {:?} (system, user, assistant, tool)", m.role));
            }
        }
        let tpl =
            tok.chat_template.as_deref().ok_or_else(|| RequestError::new(chat::ChatError::NoTemplate.to_string()))?;
        let (tools, tool_parse, prefix) = plan_tools(raw, tpl, tok)?;
        let bos = tok.bos.map(|b| tok.token_str(b).to_string()).unwrap_or_default();
        let eos = tok.eos.map(|b| tok.token_str(b).to_string()).unwrap_or_default();
        let c = Chat { messages: &raw.messages, tools, add_generation_prompt: true, bos_token: &bos, eos_token: &eos };
        let (mut text, mut segs) = chat::render_segments(tpl, &c).map_err(|e| RequestError::new(e.to_string()))?;
        if segs.is_none() {
            // the contents cannot be told from the markup: refuse any content that holds a special token's text
            // (it would become that token); the rest tokenizes safely with the markup
            for (i, m) in raw.messages.iter().enumerate() {
                if let Some(t) = tok.control_text_in(&m.content) {
                    return err(format!(
                        "message {i} holds the special-token text {t:?}, and this chat template rewrites message \
                         contents, so it cannot be kept as plain text"
                    ));
                }
            }
        }
        // the start of a forced tool call is markup of the reply's opening
        text.push_str(&prefix);
        if let Some(s) = segs.as_mut() {
            s.push(chat::Segment { text: prefix, markup: true });
            s.retain(|s| !s.text.is_empty());
        }
        segments = segs;
        tool_parse_out = tool_parse;
        text
    };
    // A template that prints BOS itself must not get a second one.
    let add_bos = !(tok.bos.is_some() && !raw.messages.is_empty() && text.starts_with(tok.token_str(tok.bos.unwrap())));
    // chat: the template's markup parses special tokens, message contents never do (a user's "<|im_end|>" is text)
    let prompt_ids = match &segments {
        Some(segs) => {
            // the contents' byte ranges in the rendered text
            let mut at = 0;
            let mut plain = Vec::new();
            for sg in segs {
                if !sg.markup {
                    plain.push(at..at + sg.text.len());
                }
                at += sg.text.len();
            }
            tok.encode_chat(&text, add_bos, &plain).map_err(|e| RequestError::new(e.to_string()))?
        }
        None => tok.encode(&text, true, add_bos).map_err(|e| RequestError::new(e.to_string()))?,
    };
    if prompt_ids.is_empty() {
        return err("prompt tokenizes to nothing".into());
    }
    if prompt_ids.len() >= n_ctx {
        return err(format!("prompt of {} tokens leaves no room in the context of {n_ctx} tokens", prompt_ids.len()));
    }
    Ok(GenerateParams {
        prompt_ids,
        max_tokens: raw.max_tokens as usize,
        sampling: SamplingParams {
            temperature: raw.temperature,
            top_k: raw.top_k as usize,
            top_p,
            min_p: raw.min_p,
            repeat_penalty: rp,
            repeat_last_n: raw.repeat_last_n.unwrap_or(64) as usize,
            // no seed: a fresh one per request (llama.cpp's and OpenAI's behaviour), so a sampled request asked
            // twice gives two draws; a seed repeats its draw
            seed: raw.seed.unwrap_or_else(rand::random),
        },
        stop: raw.stop.clone(),
        tool_parse: tool_parse_out,
    })
}

/// The bytes of text in `raw` that reach the prompt, the quantity [`MAX_PROMPT_BYTES`] bounds, and the tools' part
/// of them: the prompt, each message's role, content, `tool_call_id` and name, and its tool calls and the tools
/// (unless `tool_choice` is none, which leaves them out) as JSON the way the template's `tojson` prints them
/// ([`chat::tojson_len`]; ids, names and arguments included).
pub fn prompt_bytes(raw: &RawRequest) -> (usize, usize) {
    let message = |m: &Message| {
        let calls = if m.tool_calls.is_empty() { 0 } else { chat::tojson_len(&m.tool_calls) };
        let opt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        m.role.len() + m.content.len() + calls + opt(&m.tool_call_id) + opt(&m.name)
    };
    let offered = !raw.tools.is_empty() && raw.tool_choice != ToolChoice::None;
    let tools = if offered { chat::tojson_len(&raw.tools) } else { 0 };
    (raw.prompt.len() + raw.messages.iter().map(message).sum::<usize>() + tools, tools)
}

/// The tools a chat request offers the template, how to read its reply, and the reply's forced start: see
/// [`prepare`] (its tool errors are this function's). Tools and tool calls are template markup, so any
/// special-token text in them is refused.
fn plan_tools<'a>(
    raw: &'a RawRequest,
    tpl: &str,
    tok: &Tokenizer,
) -> Result<(&'a [Tool], Option<ToolParse>, String), RequestError> {
    for (i, m) in raw.messages.iter().enumerate() {
        if m.tool_calls.is_empty() && m.tool_call_id.is_none() && m.name.is_none() {
            continue;
        }
        let fields = (&m.tool_calls, &m.tool_call_id, &m.name);
        if let Some(t) = tok.control_text_in(&serde_json::to_string(&fields).unwrap_or_default()) {
            return Err(RequestError::field(
                "messages",
                format!("message {i}'s tool fields hold the special-token text {t:?}"),
            ));
        }
    }
    let choice = &raw.tool_choice;
    if raw.tools.is_empty() {
        return match choice {
            ToolChoice::Required | ToolChoice::Function(_) => {
                Err(RequestError::field("tool_choice", "tool_choice requires `tools`"))
            }
            _ => Ok((&[], None, String::new())),
        };
    }
    if *choice == ToolChoice::None {
        return Ok((&[], None, String::new()));
    }
    if !chat::takes_tools(tpl).map_err(|e| RequestError::new(e.to_string()))? {
        return Err(RequestError::field("tools", "this model's chat template does not support tools"));
    }
    let names: Vec<String> = raw.tools.iter().map(|t| t.function.name.clone()).collect();
    let forced = match choice {
        ToolChoice::Function(f) if !names.contains(f) => {
            return Err(RequestError::field("tool_choice", format!("function {f:?} is not among the `tools`")));
        }
        ToolChoice::Function(f) => Some(Some(f.as_str())),
        ToolChoice::Required => Some(None),
        _ => None,
    };
    if let Some(t) = tok.control_text_in(&serde_json::to_string(&raw.tools).unwrap_or_default()) {
        return Err(RequestError::field("tools", format!("the tools hold the special-token text {t:?}")));
    }
    let Some(format) = ToolFormat::detect(tpl) else {
        // offered, but the reply's calls are not parsed
        return Ok((&raw.tools, None, String::new()));
    };
    let prefix = forced.map(|f| format.forced_prefix(f)).unwrap_or_default();
    Ok((&raw.tools, Some(ToolParse { format, names, prefix: prefix.clone() }), prefix))
}
