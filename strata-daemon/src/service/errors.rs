//! Errors as the binaries print them: one line.

/// `err` and its causes (`source()` chain) joined by ": " on one line, leaving out a cause whose text the line
/// already ends with (an error that prints its source, as `cannot open F: No such file` does, would otherwise show the
/// cause twice). Line breaks inside a message become spaces.
pub fn one_line(err: &(dyn std::error::Error + 'static)) -> String {
    let mut line = err.to_string().replace('\n', " ");
    let mut cause = err.source();
    while let Some(c) = cause {
        let text = c.to_string().replace('\n', " ");
        if !text.is_empty() && !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open {path}: {source}")]
    struct Open {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_printed_is_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = anyhow::Error::new(Open { path: "m.gguf".into(), source: io }).context("loading model m.gguf");
        assert_eq!(one_line(e.as_ref()), "loading model m.gguf: cannot open m.gguf: No such file");
        let e = anyhow::anyhow!("line one\nline two").context("outer");
        assert_eq!(one_line(e.as_ref()), "outer: line one line two");
    }
}
