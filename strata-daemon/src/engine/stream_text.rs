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

    /// Appends a token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Push {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(e) => {
                // Invalid bytes: replace them and move on.
                let upto = e.valid_up_to() + e.error_len().unwrap_or(1);
                let s = String::from_utf8_lossy(&self.pending[..upto]).into_owned();
                self.pending.drain(..upto);
                self.text.push_str(&s);
                return self.after_append();
            }
        };
        let s = std::str::from_utf8(&self.pending[..valid]).unwrap().to_string();
        self.pending.drain(..valid);
        self.text.push_str(&s);
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

    /// Text held back at the end (incomplete UTF-8 is replaced).
    pub fn finish(&mut self) -> String {
        if !self.pending.is_empty() {
            let s = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            self.text.push_str(&s);
        }
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
