//! Turns token bytes into text pieces for streaming: holds back incomplete
//! UTF-8 sequences and any tail that could be the start of a stop string.

/// Streaming text assembler for one request.
pub struct TextStream {
    pending: Vec<u8>,
    /// Text emitted so far plus held-back text (valid UTF-8).
    text: String,
    emitted: usize,
    stops: Vec<String>,
}

/// Result of pushing a token's bytes.
#[derive(Debug, PartialEq)]
pub enum Push {
    /// Text that may be sent now (possibly empty).
    Text(String),
    /// A stop string appeared: the text before it that was not yet sent.
    Stopped(String),
}

impl TextStream {
    /// New stream with the request's stop strings (empty ones are ignored).
    pub fn new(stops: &[String]) -> Self {
        TextStream {
            pending: Vec::new(),
            text: String::new(),
            emitted: 0,
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
        }
    }

    /// Appends a token's bytes: whole characters join the text, invalid bytes become U+FFFD where they are, and an
    /// incomplete sequence at the end waits for the next token.
    pub fn push(&mut self, bytes: &[u8]) -> Push {
        self.pending.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.text.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.text.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        // an incomplete sequence at the end: keep it for the next token
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        Some(bad) => {
                            self.text.push('\u{fffd}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        self.after_append()
    }

    fn after_append(&mut self) -> Push {
        // Search for a stop string in the not-yet-emitted part (allowing it to start in it).
        for st in &self.stops {
            let from = self.emitted.saturating_sub(st.len() - 1);
            let from = (0..=from).rev().find(|&i| self.text.is_char_boundary(i)).unwrap_or(0);
            if let Some(i) = self.text[from..].find(st.as_str()) {
                let cut = from + i;
                let out = if cut > self.emitted { self.text[self.emitted..cut].to_string() } else { String::new() };
                self.text.truncate(cut.max(self.emitted));
                self.emitted = self.text.len();
                return Push::Stopped(out);
            }
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut hold = 0;
        for st in &self.stops {
            for k in (1..st.len()).rev() {
                if k <= self.text.len() - self.emitted
                    && self.text.ends_with(&st[..k.min(st.len())])
                    && st.is_char_boundary(k)
                {
                    hold = hold.max(k);
                    break;
                }
            }
        }
        let upto = self.text.len() - hold;
        let out = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        Push::Text(out)
    }

    /// Text held back at the end. The bytes of a character the generation stopped inside (a token limit cut a
    /// multi-byte UTF-8 sequence) are dropped, not replaced with U+FFFD: the text ends at the last whole character.
    pub fn finish(&mut self) -> String {
        // `pending` holds only an incomplete sequence (invalid bytes are replaced as they arrive, in `push`)
        self.pending.clear();
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    /// All text produced (up to a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_split_utf8() {
        let mut s = TextStream::new(&[]);
        let e = "é".as_bytes();
        assert_eq!(s.push(&e[..1]), Push::Text(String::new()));
        assert_eq!(s.push(&e[1..]), Push::Text("é".into()));
    }

    #[test]
    fn a_character_cut_by_the_token_limit_is_dropped_not_replaced() {
        let mut s = TextStream::new(&[]);
        let e = "añ€".as_bytes(); // 1 + 2 + 3 bytes
        assert_eq!(s.push(&e[..4]), Push::Text("añ".into()));
        assert_eq!(s.finish(), "");
        assert_eq!(s.text(), "añ");
        assert!(!s.text().contains('\u{fffd}'));
        // invalid bytes (not a cut) are still replaced where they arrive
        let mut s = TextStream::new(&[]);
        assert_eq!(s.push(&[b'a', 0xff, b'b']), Push::Text("a\u{fffd}b".into()));
    }

    #[test]
    fn stop_string_across_tokens() {
        let mut s = TextStream::new(&["\nUser:".to_string()]);
        assert_eq!(s.push(b"Hello"), Push::Text("Hello".into()));
        assert_eq!(s.push(b"\nUs"), Push::Text(String::new()));
        assert_eq!(s.push(b"er: hi"), Push::Stopped(String::new()));
        assert_eq!(s.text(), "Hello");
        let mut s = TextStream::new(&["\nUser:".to_string()]);
        assert_eq!(s.push(b"Hi\nU"), Push::Text("Hi".into()));
        assert_eq!(s.push(b"nknown"), Push::Text("\nUnknown".into()));
        assert_eq!(s.finish(), "");
    }
}
