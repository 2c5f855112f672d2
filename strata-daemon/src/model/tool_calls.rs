//! Tool calls in a model's reply: which format a chat template teaches (found in the template's text, as
//! llama.cpp's `common/chat.cpp` does by looking for the format's markers), and a streaming parser that splits
//! the generated text into plain content and calls.
//!
//! Formats:
//! - [`ToolFormat::Hermes`] (Hermes 2 Pro, Qwen2.5, Qwen3 and templates like them): each call is
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several allowed, text around them is content.
//! - [`ToolFormat::Llama3Json`] (Llama 3.1, 3.2 and 3.3 with custom tools): the whole reply is one JSON object
//!   `{"name": ..., "parameters": {...}}`.
//!
//! A call is taken only when its JSON parses, names one of the offered functions and has object arguments;
//! anything else stays content, as the model wrote it. A Hermes call ends at the first `</tool_call>` outside the
//! JSON's strings, so an argument whose text holds the marker (`{"code": "print('</tool_call>')"}`) does not cut
//! the call short; a call whose JSON never closes its string runs to the end of the reply.

use serde_json::Value;

/// How a template's model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{json}</tool_call>` blocks (Hermes 2 Pro, Qwen2.5, Qwen3).
    Hermes,
    /// The whole reply is `{"name": ..., "parameters": ...}` (Llama 3.1/3.2/3.3).
    Llama3Json,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl ToolFormat {
    /// The format `template` teaches, from its markers: `<tool_call>` (Hermes), or Llama 3's header tokens with
    /// its `ipython` role (Llama3Json). `None` for a template with neither.
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains(OPEN) {
            Some(ToolFormat::Hermes)
        } else if template.contains("<|start_header_id|>") && template.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The start of the reply that makes the model call a tool (appended to the prompt to enforce
    /// `tool_choice`): `function` names the function to call, `None` lets the model pick one.
    pub fn forced_prefix(self, function: Option<&str>) -> String {
        let name = |n: &str| serde_json::to_string(n).unwrap_or_default();
        match (self, function) {
            (ToolFormat::Hermes, None) => format!("{OPEN}\n"),
            (ToolFormat::Hermes, Some(f)) => format!("{OPEN}\n{{\"name\": {}, \"arguments\": ", name(f)),
            (ToolFormat::Llama3Json, None) => "{\"name\": \"".into(),
            (ToolFormat::Llama3Json, Some(f)) => format!("{{\"name\": {}, \"parameters\": ", name(f)),
        }
    }
}

/// How to read a request's reply: the format, the functions offered, and the text already put at the start of
/// the reply by the prompt ([`ToolFormat::forced_prefix`]; empty when nothing is forced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolParse {
    /// The format.
    pub format: ToolFormat,
    /// Names of the functions offered.
    pub names: Vec<String>,
    /// Reply text the prompt already holds.
    pub prefix: String,
}

impl ToolParse {
    /// A parser for one reply, with the prefix already read.
    pub fn parser(&self) -> ToolCallParser {
        ToolCallParser {
            format: self.format,
            names: self.names.clone(),
            buf: self.prefix.clone(),
            state: State::Start,
            scan: CloseScan::default(),
            ws: String::new(),
            after_call: false,
            calls: 0,
        }
    }
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// Function name (one of those offered).
    pub name: String,
    /// Arguments, a JSON object as text.
    pub arguments: String,
}

/// A piece of the reply, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Plain text.
    Content(String),
    /// A tool call.
    Call(ParsedCall),
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace read yet (Llama3Json decides here).
    #[default]
    Start,
    /// Plain text.
    Text,
    /// Inside `<tool_call>` (Hermes) or a reply that opened with `{` (Llama3Json).
    Call,
}

/// Splits a reply into [`Piece`]s as its text arrives: text that cannot be part of a call is given out at once,
/// the rest is held until the call closes (or the reply ends). Whitespace-only text between or around calls is
/// dropped once a call is found (it is kept in a reply without calls).
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    names: Vec<String>,
    buf: String,
    state: State,
    /// Where the open Hermes call's closing marker is looked for (in `buf`, which starts with the call's text).
    scan: CloseScan,
    /// Whitespace held at the end of the content given out so far.
    ws: String,
    /// No content since the last call.
    after_call: bool,
    calls: usize,
}

/// Finds a Hermes call's closing marker outside the JSON's strings: reads the call's text (what follows
/// `<tool_call>`) once, in order, keeping whether it is inside a string and after a backslash there, so that text
/// arriving in pieces is not read again.
#[derive(Debug, Default, Clone, Copy)]
struct CloseScan {
    /// Bytes of the call's text read.
    at: usize,
    /// Inside a JSON string.
    in_string: bool,
    /// Inside a string, right after a backslash (the next byte is escaped).
    escaped: bool,
}

impl CloseScan {
    /// Where [`CLOSE`] begins in `text` (the call's text so far; it only grows between calls) outside every
    /// string; `None` while it has not arrived. A marker's beginning at the end of `text` is read again with more.
    fn find(&mut self, text: &str) -> Option<usize> {
        let bytes = text.as_bytes();
        while let Some(&b) = bytes.get(self.at) {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
            } else if b == b'"' {
                self.in_string = true;
            } else if b == b'<' {
                // `<` is ASCII, so `at` is a character boundary
                let rest = &text[self.at..];
                if rest.starts_with(CLOSE) {
                    return Some(self.at);
                }
                if CLOSE.starts_with(rest) {
                    return None;
                }
            }
            self.at += 1;
        }
        None
    }
}

/// The length of the longest end of `s` that begins `tag` (text to hold: the tag may be arriving).
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&n| s.ends_with(&tag[..n])).unwrap_or(0)
}

impl ToolCallParser {
    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads more of the reply; returns what is settled.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(&mut out, false);
        out
    }

    /// The reply ended: settles what is held (an unclosed call that parses counts).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        if self.calls == 0 && !self.ws.is_empty() {
            out.push(Piece::Content(std::mem::take(&mut self.ws)));
        }
        out
    }

    fn drain(&mut self, out: &mut Vec<Piece>, end: bool) {
        match self.format {
            ToolFormat::Hermes => self.drain_hermes(out, end),
            ToolFormat::Llama3Json => self.drain_llama(out, end),
        }
    }

    fn drain_hermes(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            if self.state != State::Call {
                if let Some(at) = self.buf.find(OPEN) {
                    let before: String = self.buf.drain(..at + OPEN.len()).collect();
                    self.content(out, &before[..at]);
                    self.state = State::Call;
                    self.scan = CloseScan::default();
                    continue;
                }
                let keep = if end { 0 } else { partial_tag(&self.buf, OPEN) };
                let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content(out, &text);
                return;
            }
            let (body, closed) = match self.scan.find(&self.buf) {
                Some(at) => (self.buf[..at].to_string(), Some(at + CLOSE.len())),
                None if end => (self.buf.clone(), None),
                None => return,
            };
            match self.call(&body) {
                Some(c) => self.emit(out, c),
                None => {
                    let raw = format!("{OPEN}{body}{}", if closed.is_some() { CLOSE } else { "" });
                    self.content(out, &raw);
                }
            }
            self.buf.drain(..closed.unwrap_or(self.buf.len()));
            self.state = State::Text;
        }
    }

    fn drain_llama(&mut self, out: &mut Vec<Piece>, end: bool) {
        if self.state == State::Start {
            match self.buf.trim_start().chars().next() {
                Some('{') => self.state = State::Call,
                Some(_) => self.state = State::Text,
                None if end => self.state = State::Text,
                None => return,
            }
        }
        if self.state == State::Text {
            let all = std::mem::take(&mut self.buf);
            self.content(out, &all);
        } else if end {
            let all = std::mem::take(&mut self.buf);
            match self.call(&all) {
                Some(c) => self.emit(out, c),
                None => self.content(out, &all),
            }
        }
    }

    /// The call `json` holds, if it is one: `{"name": offered, "arguments" or "parameters": object}`.
    fn call(&self, json: &str) -> Option<ParsedCall> {
        let v: Value = serde_json::from_str(json.trim()).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let args = match v.get("arguments").or_else(|| v.get("parameters")) {
            None => Value::Object(Default::default()),
            Some(a @ Value::Object(_)) => a.clone(),
            // some models write the arguments as a JSON string
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
            Some(_) => return None,
        };
        Some(ParsedCall { name: name.to_string(), arguments: args.to_string() })
    }

    fn emit(&mut self, out: &mut Vec<Piece>, c: ParsedCall) {
        self.ws.clear();
        self.after_call = true;
        self.calls += 1;
        out.push(Piece::Call(c));
    }

    /// Gives out content, holding trailing whitespace until more text follows (space before a call is dropped
    /// with it, as is space right after a call).
    fn content(&mut self, out: &mut Vec<Piece>, text: &str) {
        let text = if self.after_call { text.trim_start() } else { text };
        let body = text.trim_end();
        if body.is_empty() {
            self.ws.push_str(text);
            return;
        }
        self.after_call = false;
        let lead = std::mem::take(&mut self.ws);
        self.ws = text[body.len()..].to_string();
        out.push(Piece::Content(format!("{lead}{body}")));
    }
}

/// Splits a whole reply (`ToolParse::parser` then push and finish): the content (`None` when empty) and the calls.
pub fn parse_reply(parse: &ToolParse, text: &str) -> (Option<String>, Vec<ParsedCall>) {
    let mut p = parse.parser();
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Content(s) => content.push_str(&s),
            Piece::Call(c) => calls.push(c),
        }
    }
    ((!content.is_empty()).then_some(content), calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hermes(prefix: &str) -> ToolParse {
        ToolParse { format: ToolFormat::Hermes, names: vec!["get_weather".into(), "add".into()], prefix: prefix.into() }
    }

    fn call(name: &str, args: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: args.into() }
    }

    #[test]
    fn formats_are_found_from_the_template_text() {
        assert_eq!(ToolFormat::detect("{% if tools %}<tool_call>{% endif %}"), Some(ToolFormat::Hermes));
        let llama = "<|start_header_id|>ipython<|end_header_id|>{{ tools }}";
        assert_eq!(ToolFormat::detect(llama), Some(ToolFormat::Llama3Json));
        assert_eq!(ToolFormat::detect("<|im_start|>{{ m.content }}"), None);
    }

    #[test]
    fn several_hermes_calls_and_the_text_around_them() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>";
        let (content, calls) = parse_reply(&hermes(""), text);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls, [call("get_weather", r#"{"city":"Paris"}"#), call("add", r#"{"a":1,"b":2}"#)]);
        // only calls: content is null
        let (content, calls) = parse_reply(&hermes(""), &text["Let me check.\n".len()..]);
        assert_eq!((content, calls.len()), (None, 2));
    }

    #[test]
    fn malformed_calls_stay_content() {
        let bad = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}\n</tool_call>";
        let (content, calls) = parse_reply(&hermes(""), bad);
        assert_eq!((content.as_deref(), calls.len()), (Some(bad), 0));
        // an unknown function, and non-object arguments
        for t in [
            "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"add\", \"arguments\": 3}</tool_call>",
        ] {
            assert_eq!(parse_reply(&hermes(""), t), (Some(t.to_string()), vec![]));
        }
        // a good call after a bad one is still taken
        let mixed = format!("{bad}\n<tool_call>{{\"name\": \"add\", \"arguments\": {{}}}}</tool_call>");
        let (content, calls) = parse_reply(&hermes(""), &mixed);
        assert_eq!((content.as_deref(), calls), (Some(bad), vec![call("add", "{}")]));
        // plain replies are untouched, whitespace included
        assert_eq!(parse_reply(&hermes(""), " Hi <tool\n"), (Some(" Hi <tool\n".into()), vec![]));
    }

    /// `text` pushed `step` characters at a time, then finished: the pieces, joined as [`parse_reply`] joins them.
    fn streamed(p: &ToolParse, text: &str, step: usize) -> (Option<String>, Vec<ParsedCall>) {
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        let mut s = p.parser();
        let mut pieces = Vec::new();
        for w in cuts.chunks(step).map(|c| c[0]).chain([text.len()]).collect::<Vec<_>>().windows(2) {
            let got = s.push(&text[w[0]..w[1]]);
            // no tag text ever leaks into content while it is arriving
            assert!(got.iter().all(|g| !matches!(g, Piece::Content(c) if c.contains('<'))), "{got:?}");
            pieces.extend(got);
        }
        pieces.extend(s.finish());
        let content: String =
            pieces.iter().filter_map(|x| if let Piece::Content(c) = x { Some(c.as_str()) } else { None }).collect();
        let calls = pieces.into_iter().filter_map(|x| if let Piece::Call(c) = x { Some(c) } else { None }).collect();
        ((!content.is_empty()).then_some(content), calls)
    }

    #[test]
    fn streaming_split_anywhere_gives_the_same_pieces() {
        let text = "Sure. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}</tool_call>";
        let whole = parse_reply(&hermes(""), text);
        for step in [1, 2, 3, 5, 7, 11] {
            assert_eq!(streamed(&hermes(""), text, step), whole, "step {step}");
        }
        // the content before the first call is given out before the call closes
        let mut p = hermes("").parser();
        assert_eq!(p.push("Sure. <tool"), [Piece::Content("Sure.".into())]);
        assert_eq!(p.push("_call>{\"name\": \"add\""), []);
        assert_eq!(p.push(", \"arguments\": {}}</tool_call>"), [Piece::Call(call("add", "{}"))]);
        assert_eq!(p.finish(), []);
    }

    #[test]
    fn the_closing_marker_inside_a_json_string_does_not_close_the_call() {
        // the marker in an argument, after an escaped quote, and a string ending in an escaped backslash
        let text = concat!(
            "Running it.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"code\": \"print('</tool_call>')\"}}\n",
            "</tool_call>\n<tool_call> \n {\"name\": \"add\", \"arguments\": {\"s\": \"a \\\"</tool_call>\\\" b\", ",
            "\"t\": \"c:\\\\\"}}</tool_call> done"
        );
        let want = (
            Some("Running it.done".to_string()),
            vec![
                call("add", r#"{"code":"print('</tool_call>')"}"#),
                call("add", r#"{"s":"a \"</tool_call>\" b","t":"c:\\"}"#),
            ],
        );
        assert_eq!(parse_reply(&hermes(""), text), want);
        for step in [1, 2, 3, 4, 5, 7, 13] {
            assert_eq!(streamed(&hermes(""), text, step), want, "step {step}");
        }
        // split inside an escape and inside the marker, in a string and after it: the call waits for the real one
        let mut p = hermes("").parser();
        assert_eq!(p.push("<tool_call>{\"name\": \"add\", \"arguments\": {\"s\": \"a \\"), []);
        assert_eq!(p.push("\"</tool_"), []);
        assert_eq!(p.push("call>\\\" b\"}}</tool"), []);
        assert_eq!(p.push("_call>"), [Piece::Call(call("add", r#"{"s":"a \"</tool_call>\" b"}"#))]);
        assert_eq!(p.finish(), []);
        // a forced opening is read the same way
        let forced = hermes(&ToolFormat::Hermes.forced_prefix(Some("add")));
        let t = "{\"x\": \"</tool_call>\"}}\n</tool_call>";
        assert_eq!(parse_reply(&forced, t), (None, vec![call("add", r#"{"x":"</tool_call>"}"#)]));
    }

    #[test]
    fn a_call_whose_string_never_closes_stays_content() {
        let text = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"s\": \"</tool_call> and on";
        assert_eq!(parse_reply(&hermes(""), text), (Some(text.to_string()), vec![]));
        for step in [1, 3, 8] {
            assert_eq!(streamed(&hermes(""), text, step), (Some(text.to_string()), vec![]), "step {step}");
        }
        // nothing of it is given out before the reply ends
        let mut p = hermes("").parser();
        assert_eq!(p.push(text), []);
        assert_eq!(p.finish(), [Piece::Content(text.to_string())]);
    }

    #[test]
    fn an_unclosed_call_that_parses_counts_at_the_end() {
        let t = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2}}\n";
        assert_eq!(parse_reply(&hermes(""), t), (None, vec![call("add", r#"{"a":2}"#)]));
    }

    #[test]
    fn a_forced_prefix_is_part_of_the_reply() {
        let p = hermes(&ToolFormat::Hermes.forced_prefix(Some("add")));
        assert_eq!(parse_reply(&p, "{\"a\": 1}}\n</tool_call>"), (None, vec![call("add", r#"{"a":1}"#)]));
        // the model did not finish the call: everything, prefix included, is content
        let (content, calls) = parse_reply(&p, "oops");
        assert_eq!((content.unwrap(), calls.len()), ("<tool_call>\n{\"name\": \"add\", \"arguments\": oops".into(), 0));
    }

    #[test]
    fn llama_json_replies() {
        let p = ToolParse { format: ToolFormat::Llama3Json, names: vec!["get_weather".into()], prefix: String::new() };
        let t = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
        assert_eq!(parse_reply(&p, t), (None, vec![call("get_weather", r#"{"city":"Oslo"}"#)]));
        // JSON that is not a call of an offered function, and plain text, stay content
        for t in ["{\"name\": \"other\", \"parameters\": {}}", "{\"answer\": 42}", "It is sunny {\"name\": 1}"] {
            assert_eq!(parse_reply(&p, t), (Some(t.to_string()), vec![]));
        }
        // streamed: text is given out at once, a JSON reply is held to the end
        let mut s = p.parser();
        assert_eq!(s.push("Hello"), [Piece::Content("Hello".into())]);
        let mut s2 = p.parser();
        assert_eq!(s2.push("  {\"name\": \"get_weather\","), []);
        assert_eq!(s2.push(" \"parameters\": {}}"), []);
        assert_eq!(s2.finish(), [Piece::Call(call("get_weather", "{}"))]);
    }
}
