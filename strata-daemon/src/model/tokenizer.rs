//! Tokenizer built from GGUF metadata (`tokenizer.ggml.*`) with the
//! `tokenizers` crate.
//!
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE from `tokens` + `merges`;
//!   the pre-tokenizer regexes are chosen by `tokenizer.ggml.pre` (the names
//!   and expressions are the ones llama.cpp uses in `llama-vocab.cpp`).
//! - `tokenizer.ggml.model = "llama"`: SentencePiece vocabulary (`tokens` +
//!   `scores`, `<0xXX>` byte tokens) as a byte-fallback BPE whose merges are
//!   derived from the scores (the merge producing the higher-scored piece first).
//!
//! Token types (`tokenizer.ggml.token_type`): 1 normal, 2 unknown, 3 control,
//! 4 user-defined, 5 unused, 6 byte. Control tokens are recognised in text
//! only when the caller asks to parse specials; user-defined ones always.

use std::collections::HashMap;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::arch::config::ModelError;
use crate::gguf::GgufFile;

/// Token type ids of `tokenizer.ggml.token_type`.
pub mod token_type {
    /// Normal token.
    pub const NORMAL: i64 = 1;
    /// Unknown token.
    pub const UNKNOWN: i64 = 2;
    /// Control token (BOS, EOS, chat markers).
    pub const CONTROL: i64 = 3;
    /// User-defined token (always matched in text).
    pub const USER_DEFINED: i64 = 4;
    /// Unused slot.
    pub const UNUSED: i64 = 5;
    /// Byte token `<0xXX>` (SentencePiece byte fallback).
    pub const BYTE: i64 = 6;
}

const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// o200k's expression (`tokenizer.ggml.pre = "gpt-4o"`: GPT-4o, gpt-oss), as its `tokenizer.json` writes it: a
/// word is an optional leading non-letter, then upper-case-like letters and lower-case-like letters (either run
/// may lead) with an English contraction attached; digits in threes; punctuation runs with trailing newlines or
/// slashes; whitespace runs.
const GPT4O_RE: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Pre-tokenizer regexes for a `tokenizer.ggml.pre` name: a list of regexes
/// applied in turn (each isolating its matches), the last of which is followed
/// by the byte-level mapping. `None` for unknown names.
fn pre_regexes(pre: &str) -> Option<Vec<&'static str>> {
    Some(match pre {
        "default" | "gpt-2" | "gpt2" | "olmo" | "jais" | "mpt" | "trillion" | "phi-2" => vec![GPT2_RE],
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            vec![r"\p{N}", GPT2_RE]
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => vec![LLAMA3_RE],
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" => vec![QWEN2_RE],
        "gpt-4o" | "minimax-m2" => vec![GPT4O_RE],
        _ => return None,
    })
}

/// GPT-2's reversible byte <-> printable-char table: byte -> char.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (b'!' as u32..=b'~' as u32).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            let c = char::from_u32(256 + n).unwrap();
            n += 1;
            c
        };
    }
    table
}

/// Vocabulary flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// Byte-level BPE (`gpt2`).
    Gpt2Bpe,
    /// SentencePiece (`llama`).
    SentencePiece,
}

/// Tokenizer for one model: text <-> token ids, token bytes for streaming,
/// special-token ids.
pub struct Tokenizer {
    with_special: tokenizers::Tokenizer,
    plain: tokenizers::Tokenizer,
    /// Raw bytes of each token's text (empty for control tokens).
    pieces: Vec<Vec<u8>>,
    tokens: Vec<String>,
    types: Vec<i64>,
    kind: VocabKind,
    /// SentencePiece with `tokenizer.ggml.add_space_prefix`: encoding
    /// prepends a space, so decoding drops one leading space.
    space_prefix: bool,
    /// Beginning-of-sequence id, if the model has one.
    pub bos: Option<u32>,
    /// End-of-sequence id (`tokenizer.ggml.eos_token_id`).
    pub eos: Option<u32>,
    /// Whether to prepend BOS to prompts (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// Every id that ends generation (EOS, EOT, EOM and the usual end markers).
    pub eog: Vec<u32>,
    /// Chat template (`tokenizer.chat_template`), if any.
    pub chat_template: Option<String>,
}

fn terr(m: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(m.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata. Errors: missing or
    /// inconsistent `tokenizer.ggml.*` keys, an unknown `tokenizer.ggml.pre`
    /// or vocabulary model.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let model = f.get_str("tokenizer.ggml.model")?.to_string();
        let tokens: Vec<String> = f
            .get_array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| terr("tokenizer.ggml.tokens holds a non-string")))
            .collect::<Result<_, _>>()?;
        let n = tokens.len();
        let types: Vec<i64> = match f.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .as_array()
                .ok_or_else(|| terr("tokenizer.ggml.token_type is not an array"))?
                .iter()
                .map(|v| v.as_i64().ok_or_else(|| terr("tokenizer.ggml.token_type holds a non-integer")))
                .collect::<Result<_, _>>()?,
            None => vec![token_type::NORMAL; n],
        };
        if types.len() != n {
            return Err(terr(format!("token_type has {} entries for {n} tokens", types.len())));
        }
        let id_key = |k: &str| -> Result<Option<u32>, ModelError> {
            match f.get(k) {
                None => Ok(None),
                Some(v) => {
                    let id = v.as_u64().ok_or_else(|| terr(format!("{k} is not an integer")))?;
                    if id as usize >= n {
                        return Err(terr(format!("{k} = {id} is outside the vocabulary of {n}")));
                    }
                    Ok(Some(id as u32))
                }
            }
        };
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let eot = id_key("tokenizer.ggml.eot_token_id")?;
        let eom = id_key("tokenizer.ggml.eom_token_id")?;
        let (kind, mut bpe_builder) = match model.as_str() {
            "gpt2" => {
                let merges: Vec<(String, String)> = f
                    .get_array("tokenizer.ggml.merges")?
                    .iter()
                    .map(|v| {
                        let s = v.as_str().ok_or_else(|| terr("tokenizer.ggml.merges holds a non-string"))?;
                        let (a, b) = s.split_once(' ').ok_or_else(|| terr(format!("merge {s:?} has no space")))?;
                        Ok((a.to_string(), b.to_string()))
                    })
                    .collect::<Result<_, ModelError>>()?;
                let vocab: tokenizers::models::bpe::Vocab =
                    tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
                (VocabKind::Gpt2Bpe, BPE::builder().vocab_and_merges(vocab, merges))
            }
            "llama" => {
                let scores: Vec<f32> = match f.get("tokenizer.ggml.scores") {
                    Some(v) => v
                        .as_array()
                        .ok_or_else(|| terr("tokenizer.ggml.scores is not an array"))?
                        .iter()
                        .map(|v| v.as_f64().map(|x| x as f32).ok_or_else(|| terr("scores holds a non-number")))
                        .collect::<Result<_, _>>()?,
                    None => vec![0.0; n],
                };
                if scores.len() != n {
                    return Err(terr(format!("scores has {} entries for {n} tokens", scores.len())));
                }
                let merges = spm_merges(&tokens, &types, &scores);
                let vocab: tokenizers::models::bpe::Vocab =
                    tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
                let mut b = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true);
                if let Some(u) = id_key("tokenizer.ggml.unknown_token_id")? {
                    b = b.unk_token(tokens[u as usize].clone());
                }
                (VocabKind::SentencePiece, b)
            }
            other => return Err(terr(format!("unsupported tokenizer.ggml.model {other:?} (supported: gpt2, llama)"))),
        };
        bpe_builder = bpe_builder.ignore_merges(false);
        let space_prefix = kind == VocabKind::SentencePiece
            && f.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.as_bool()).unwrap_or(true);
        let bpe = bpe_builder.build().map_err(terr)?;
        let mut base = tokenizers::Tokenizer::new(bpe);
        match kind {
            VocabKind::Gpt2Bpe => {
                let pre = f.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
                let res = pre_regexes(pre)
                    .ok_or_else(|| terr(format!("unknown pre-tokenizer tokenizer.ggml.pre = {pre:?}")))?;
                let mut seq: Vec<PreTokenizerWrapper> = Vec::new();
                let last_is_gpt2 = *res.last().unwrap() == GPT2_RE;
                let n_split = if last_is_gpt2 { res.len() - 1 } else { res.len() };
                for re in &res[..n_split] {
                    let split =
                        Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                            .map_err(terr)?;
                    seq.push(split.into());
                }
                // ByteLevel's own regex is GPT-2's; use it only when that is the last expression.
                seq.push(ByteLevel::new(false, false, last_is_gpt2).into());
                base.with_pre_tokenizer(Some(Sequence::new(seq)));
                base.with_decoder(Some(ByteLevelDecoder::default()));
            }
            VocabKind::SentencePiece => {
                let mut norms: Vec<NormalizerWrapper> = Vec::new();
                if space_prefix {
                    norms.push(Prepend::new("▁".into()).into());
                }
                norms.push(Replace::new(" ", "▁").map_err(terr)?.into());
                base.with_normalizer(Some(NormSequence::new(norms)));
            }
        }
        let mut plain = base.clone();
        let mut with_special = base;
        let mut always = Vec::new();
        let mut specials = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            match types[i] {
                token_type::CONTROL => specials.push(AddedToken::from(t.clone(), true).normalized(false)),
                token_type::USER_DEFINED => always.push(AddedToken::from(t.clone(), false).normalized(false)),
                _ => {}
            }
        }
        plain.add_tokens(&always);
        with_special.add_tokens(&always);
        with_special.add_special_tokens(&specials);

        let table = bytes_to_unicode();
        let mut inv: HashMap<char, u8> = HashMap::new();
        for (b, c) in table.iter().enumerate() {
            inv.insert(*c, b as u8);
        }
        let mut pieces: Vec<Vec<u8>> = tokens
            .iter()
            .zip(&types)
            .map(|(t, &ty)| match (kind, ty) {
                (_, token_type::CONTROL) | (_, token_type::UNUSED) => Vec::new(),
                (_, token_type::USER_DEFINED) => t.as_bytes().to_vec(),
                (VocabKind::Gpt2Bpe, _) => t.chars().map(|c| inv.get(&c).copied().unwrap_or(b'?')).collect(),
                (VocabKind::SentencePiece, token_type::BYTE) => {
                    let hex = t.trim_start_matches("<0x").trim_end_matches('>');
                    vec![u8::from_str_radix(hex, 16).unwrap_or(b'?')]
                }
                (VocabKind::SentencePiece, _) => t.replace('▁', " ").into_bytes(),
            })
            .collect();

        let mut eog: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
        for (i, t) in tokens.iter().enumerate() {
            if types[i] == token_type::CONTROL
                && matches!(
                    t.as_str(),
                    "<|endoftext|>"
                        | "<|im_end|>"
                        | "<|eot_id|>"
                        | "<|eom_id|>"
                        | "<|end|>"
                        | "<end_of_turn>"
                        | "</s>"
                        | "<|return|>"
                        | "<|call|>"
                )
                && !eog.contains(&(i as u32))
            {
                eog.push(i as u32);
            }
        }
        // fill-in-the-middle padding, repository and file separators end generation too: every token with one of the
        // names llama.cpp looks for (it takes the first of each kind, and `tokenizer.ggml.fim_*_token_id` first;
        // vocabularies hold at most one of each in practice)
        const FIM_EOG: &[&str] = &[
            "<|fim_pad|>",
            "<fim-pad>",
            "<fim_pad>",
            "<PAD>",
            "[PAD]",
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
            "<|file_sep|>",
        ];
        for (i, t) in tokens.iter().enumerate() {
            if FIM_EOG.contains(&t.as_str()) && !eog.contains(&(i as u32)) {
                eog.push(i as u32);
            }
        }
        // o200k_harmony (gpt-oss): `<|end|>` closes a message inside the assistant's turn (its analysis channel),
        // so with `<|return|>` and `<|call|>` ending the turn it does not end generation (as llama.cpp decides)
        let is = |id: &u32, text: &str| tokens.get(*id as usize).is_some_and(|t| t == text);
        let harmony = eog.iter().any(|id| is(id, "<|return|>")) && eog.iter().any(|id| is(id, "<|call|>"));
        if harmony {
            eog.retain(|id| !is(id, "<|end|>"));
        }
        // harmony's markers are printed in generated text, as llama.cpp prints them (it makes them user-defined): a
        // client reads the channels and message bounds from them. In input they stay special tokens (unlike
        // llama.cpp's), so that message content spelling them is text.
        for (i, t) in tokens.iter().enumerate() {
            let marker = matches!(t.as_str(), "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>");
            if marker || (harmony && t == "<|end|>") {
                pieces[i] = t.as_bytes().to_vec();
            }
        }
        let add_bos =
            f.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(kind == VocabKind::SentencePiece)
                && bos.is_some();
        let chat_template = f.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string);
        Ok(Tokenizer {
            with_special,
            plain,
            pieces,
            tokens,
            types,
            kind,
            space_prefix,
            bos,
            eos,
            add_bos,
            eog,
            chat_template,
        })
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    /// Vocabulary flavour.
    pub fn kind(&self) -> VocabKind {
        self.kind
    }

    /// Tokenizes `text`. `parse_special`: recognise control tokens written in
    /// the text (e.g. `<|im_start|>`). `add_bos`: prepend BOS when the model
    /// asks for it (`tokenizer.ggml.add_bos_token`).
    pub fn encode(&self, text: &str, parse_special: bool, add_bos: bool) -> Result<Vec<u32>, ModelError> {
        let tk = if parse_special { &self.with_special } else { &self.plain };
        let enc = tk.encode(text, false).map_err(terr)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The raw bytes a token contributes to generated text (empty for
    /// control tokens). May be part of a UTF-8 character.
    pub fn piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map(|v| v.as_slice()).unwrap_or(&[])
    }

    /// A token's vocabulary string (as stored in GGUF).
    pub fn token_str(&self, id: u32) -> &str {
        self.tokens.get(id as usize).map(|s| s.as_str()).unwrap_or("")
    }

    /// Tokenizes a rendered chat: as [`Tokenizer::encode`] with special tokens parsed, except that a control token
    /// (`<|im_end|>`, `<start_of_turn>`, …) whose text lies inside one of `plain` (byte ranges of `text`: the
    /// messages' contents) is tokenized as the plain text it is. Text without control-token strings in its contents
    /// gets exactly the ids of `encode(text, true, add_bos)`. Errors: the tokenizer failed.
    pub fn encode_chat(
        &self,
        text: &str,
        add_bos: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, ModelError> {
        let enc = self.with_special.encode(text, false).map_err(terr)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
            }
        }
        for (&id, &(a, b)) in enc.get_ids().iter().zip(enc.get_offsets()) {
            if self.is_control(id) && plain.iter().any(|r| r.start <= a && b <= r.end) {
                let text = text.get(a..b).unwrap_or_default();
                ids.extend_from_slice(self.plain.encode(text, false).map_err(terr)?.get_ids());
            } else {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    /// The first control token whose text occurs in `text` (tokenized with special tokens parsed), if any.
    pub fn control_text_in(&self, text: &str) -> Option<String> {
        let enc = self.with_special.encode(text, false).ok()?;
        enc.get_ids().iter().find(|&&id| self.is_control(id)).map(|&id| self.token_str(id).to_string())
    }

    /// Whether `id` is a control token.
    pub fn is_control(&self, id: u32) -> bool {
        self.types.get(id as usize) == Some(&token_type::CONTROL)
    }

    /// Whether `id` ends generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Detokenizes: the concatenated bytes of the pieces, as UTF-8 (invalid
    /// sequences replaced). With `render_special`, control tokens are written
    /// as their text. SentencePiece with `add_space_prefix` (as llama.cpp):
    /// one leading space of the first token's piece is dropped, the one the
    /// encoder prepended; without it (e.g. Gemma) spaces are kept.
    pub fn decode(&self, ids: &[u32], render_special: bool) -> String {
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            if render_special && self.is_control(id) {
                out.extend_from_slice(self.token_str(id).as_bytes());
            } else {
                let p = self.piece(id);
                let strip = i == 0 && self.space_prefix && p.first() == Some(&b' ');
                out.extend_from_slice(&p[strip as usize..]);
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Merges of a SentencePiece vocabulary for a BPE model: every split of a
/// normal token into two vocabulary pieces, ordered by the token's score
/// (highest first), ties by id.
fn spm_merges(tokens: &[String], types: &[i64], scores: &[f32]) -> Vec<(String, String)> {
    let index: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, usize, String, String)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if types[i] != token_type::NORMAL && types[i] != token_type::USER_DEFINED {
            continue;
        }
        let chars: Vec<(usize, char)> = t.char_indices().collect();
        for &(split, _) in chars.iter().skip(1) {
            let (a, b) = t.split_at(split);
            if let (Some(&ia), Some(&ib)) = (index.get(a), index.get(b)) {
                merges.push((scores[i], i, ia.max(ib), a.to_string(), b.to_string()));
            }
        }
    }
    merges.sort_by(|x, y| {
        y.0.partial_cmp(&x.0).unwrap_or(std::cmp::Ordering::Equal).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2))
    });
    merges.into_iter().map(|m| (m.3, m.4)).collect()
}
