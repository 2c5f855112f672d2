//! Chat template rendering: the model's `tokenizer.chat_template` (a Jinja
//! template, as Hugging Face transformers defines it) rendered with minijinja
//! and its Python-compatibility methods.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// One chat message.
#[derive(Debug, Clone, Serialize)]
pub struct Message {
    /// "system", "user" or "assistant".
    pub role: String,
    /// Message text.
    pub content: String,
}

/// Errors from rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The model has no `tokenizer.chat_template`.
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoTemplate,
    /// The template failed to parse or render (or called raise_exception).
    #[error("chat template: {0}")]
    Template(String),
}

/// Renders `messages` with `template`. `add_generation_prompt` asks the
/// template to open the assistant's turn. `bos_token`/`eos_token` are the
/// texts of those tokens (templates often print them).
pub fn render(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, ChatError> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_template("chat", template).map_err(|e| ChatError::Template(e.to_string()))?;
    let t = env.get_template("chat").map_err(|e| ChatError::Template(e.to_string()))?;
    t.render(context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(|e| ChatError::Template(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml() {
        let tpl = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let out = render(tpl, &[Message { role: "user".into(), content: " Hi ".into() }], true, "", "").unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_and_raise() {
        let tpl = "{{ messages[0].content.strip().upper() }}{% if messages|length > 1 %}{{ raise_exception('too many') }}{% endif %}";
        let one = [Message { role: "user".into(), content: " ab ".into() }];
        assert_eq!(render(tpl, &one, false, "", "").unwrap(), "AB");
        let two = [one[0].clone(), one[0].clone()];
        let e = render(tpl, &two, false, "", "").unwrap_err();
        assert!(e.to_string().contains("too many"), "{e}");
    }
}
