//! The bad-input matrix (issue 21; docs/RELIABILITY.md, "The bad-input matrix"): one table, [`cases`], of bad
//! inputs on every channel that takes input from outside (model files: GGUF structure, metadata, tensors, split
//! sets; start flags; expert profiles; routing traces; gRPC requests and chat messages; knobs; profile saves; HTTP
//! bodies), each row with the error text it must give. After each bad input a request must succeed.
//!
//! Two runners execute the table. [`refused_at_start_or_replay`] takes the inputs read when a daemon starts or
//! when `strata-tools replay` runs: a bad start or run exits 1 with one line on stderr (no panic, no backtrace, no
//! socket left), and then the same start or run with the good input succeeds (a bad profile is the exception by
//! design: the daemon warns in one line, starts with the default placement and serves). [`refused_while_serving`]
//! takes the inputs sent to running daemons: each is refused with the expected error, and then a greedy request on
//! the same channel gives the text it gave before any bad input. With `--nocapture` each case prints one line:
//! its name and the error seen.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use strata::gguf::writer::GgufWriter;
use strata::gguf::{GgufFile, Value};
use strata::quant::GgmlType;
use strata::tiers::profile::{fnv1a64, geometry_of};
use strata_proto::v1 as pb;
use strata_tests::*;
use tonic::Code;

/// What a case is about (docs/RELIABILITY.md counts the cases by these).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Category {
    /// The GGUF container: magic, version, counts, offsets, tensor data ranges.
    Gguf,
    /// Model metadata: keys, their types and values.
    Metadata,
    /// Tensors: missing, shapes, types.
    Tensor,
    /// Split models (`NAME-0000i-of-0000N.gguf`): missing, foreign, misordered parts.
    Split,
    /// Expert profiles: read at start, by the replay, and saved on request.
    Profile,
    /// Routing traces given to `strata-tools replay`.
    Trace,
    /// Generation requests: sizes, sampling numbers, context.
    Request,
    /// Chat messages: roles, shapes, tool fields, special-token text.
    Chat,
    /// Live knobs and the start flags that set them.
    Knob,
    /// The HTTP front end's own checks: bodies, routes, OpenAI fields.
    Http,
}

/// How a case's input is made, and the channel that takes it.
enum Input {
    /// A model file `strata-daemon --model` must refuse: written by the function into the case's own folder (the
    /// base model's bytes edited, or rewritten by `GgufWriter` with an edit); returns the path to pass.
    ModelFile(fn(&Base, &Path) -> PathBuf),
    /// Start flags `strata-daemon --model <base>` must refuse.
    StartFlags(&'static [&'static str]),
    /// An expert profile given at start (`--expert-profile`): its bytes (or `None`: a path where no file is). The
    /// daemon warns in one line and starts with the default placement (docs/FLAGS.md).
    StartProfile(fn(&Base) -> Option<Vec<u8>>),
    /// A profile given to `strata-tools replay --profile` with the good trace: its bytes.
    ReplayProfile(fn(&Base) -> Vec<u8>),
    /// A routing trace (JSON Lines) for `strata-tools replay --trace FILE --slots-per-layer 2`, with more
    /// arguments.
    ReplayTrace(&'static str, &'static [&'static str]),
    /// A gRPC `Generate` request to the dense daemon (SmolLM2, `--ctx 512`), and the status code it must get.
    Generate(pb::GenerateRequest, Code),
    /// `strata-ctl` arguments against the dense daemon (exit status 1).
    Ctl(&'static [&'static str]),
    /// A gRPC `SetKnob` (name, value) to the MoE daemon: `INVALID_ARGUMENT`, and no knob changes.
    SetKnob(&'static str, &'static str),
    /// A gRPC `SaveProfile` to the MoE daemon: the path (`{dir}` is a folder that exists), and the status code.
    SaveProfile(&'static str, Code),
    /// An HTTP request to the dense daemon's `--http-listen` port: method, path, body, and the status it must get.
    HttpRequest(&'static str, &'static str, Vec<u8>, u16),
}

impl Input {
    /// Whether the input is read at start or by the replay (else it is sent to a running daemon).
    fn before_serving(&self) -> bool {
        matches!(
            self,
            Input::ModelFile(_)
                | Input::StartFlags(_)
                | Input::StartProfile(_)
                | Input::ReplayProfile(_)
                | Input::ReplayTrace(..)
        )
    }
}

/// One row of the matrix.
struct Case {
    /// Short name, printed.
    name: &'static str,
    /// What it is about.
    category: Category,
    /// The input and its channel.
    input: Input,
    /// Text the error must contain: it names the field, key, tensor, part or value at fault.
    expect: &'static str,
}

/// The good request after every bad one.
const PROMPT: &str = "The capital of France is";

/// [`greedy`] on [`PROMPT`] with its sampling changed by `f`.
fn sampled(f: fn(&mut pb::SamplingParams)) -> pb::GenerateRequest {
    let mut r = greedy(PROMPT, 4);
    f(r.sampling.as_mut().expect("sampling"));
    r
}

/// A chat request of `(role, content)` messages.
fn chat(messages: &[(&str, &str)]) -> pb::GenerateRequest {
    pb::GenerateRequest {
        messages: messages
            .iter()
            .map(|(r, c)| pb::ChatMessage { role: r.to_string(), content: c.to_string() })
            .collect(),
        max_tokens: 4,
        sampling: Some(pb::SamplingParams::default()),
        ..Default::default()
    }
}

/// A JSON body.
fn body(v: serde_json::Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

/// The served model's id in HTTP requests (the file name without `.gguf`).
fn model_id() -> String {
    model_path().file_stem().and_then(|s| s.to_str()).expect("model file name").to_string()
}

/// A chat completion body with `messages` and the fields of `more` (greedy, 4 tokens).
fn chat_body(messages: serde_json::Value, more: serde_json::Value) -> Vec<u8> {
    let mut v = serde_json::json!({"model": model_id(), "messages": messages, "max_tokens": 4, "temperature": 0});
    for (k, x) in more.as_object().expect("an object").iter() {
        v[k] = x.clone();
    }
    body(v)
}

/// A good trace for the base model: one request, two decode tokens through its three layers, top-2 of 8 experts.
const GOOD_TRACE: &str = r#"{"seq":1,"pos":5,"phase":"decode","layer":0,"experts":[3,0],"weights":[0.6,0.4]}
{"seq":1,"pos":5,"phase":"decode","layer":1,"experts":[1,2],"weights":[0.5,0.5]}
{"seq":1,"pos":5,"phase":"decode","layer":2,"experts":[7,4],"weights":[0.7,0.3]}
{"seq":1,"pos":6,"phase":"decode","layer":0,"experts":[3,5],"weights":[0.6,0.4]}
{"seq":1,"pos":6,"phase":"decode","layer":1,"experts":[1,6],"weights":[0.5,0.5]}
{"seq":1,"pos":6,"phase":"decode","layer":2,"experts":[7,0],"weights":[0.7,0.3]}
"#;

/// The matrix: every bad input with its channel and the error it must give.
fn cases() -> Vec<Case> {
    use Category::*;
    use Input::*;
    let case = |name, category, input, expect| Case { name, category, input, expect };
    let id = model_id();
    vec![
        // ---- GGUF structure: the base model's bytes edited
        case("missing file", Gguf, ModelFile(|_, d| d.join("absent.gguf")), "absent.gguf: No such file or directory"),
        case("a directory", Gguf, ModelFile(|_, d| d.to_path_buf()), "is a directory, not a GGUF file"),
        case(
            "bad magic",
            Gguf,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(0, b"GGML"))),
            "not a GGUF file (magic [47, 47, 4d, 4c], expected \"GGUF\")",
        ),
        case(
            "unsupported version",
            Gguf,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(4, &4u32.to_le_bytes()))),
            "unsupported GGUF version 4 (supported: 2, 3)",
        ),
        case(
            "header cut short",
            Gguf,
            ModelFile(|b, d| put(d, "m.gguf", &b.bytes[..64])),
            "file truncated: tensor infos (39 entries) needs bytes 24..336 but the file has 64 bytes",
        ),
        case(
            "tensor count past the file",
            Gguf,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(8, &u64::MAX.to_le_bytes()))),
            "tensor infos (18446744073709551615 entries)",
        ),
        case(
            "metadata count past the file",
            Gguf,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(16, &(1u64 << 40).to_le_bytes()))),
            "metadata (1099511627776 entries)",
        ),
        case(
            "unknown metadata value type",
            Gguf,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(b.key_type_at("general.name"), &99u32.to_le_bytes()))),
            "metadata key \"general.name\": unknown value type 99",
        ),
        case(
            "tensor data past the end",
            Gguf,
            ModelFile(|b, d| put(d, "m.gguf", &b.bytes[..b.bytes.len() - 1000])),
            "tensor \"output.weight\" data needs bytes",
        ),
        case(
            "overlapping tensors",
            Gguf,
            ModelFile(|b, d| {
                // attn_k's data offset set to attn_q's: both read the same bytes
                let q = b.file.tensor("blk.0.attn_q.weight").expect("attn_q").file_offset - b.file.data_offset;
                let at = b.info("blk.0.attn_k.weight") + 4 + 2 * 8 + 4;
                put(d, "m.gguf", &b.patched(at, &q.to_le_bytes()))
            }),
            "overlaps tensor \"blk.0.attn_q.weight\"",
        ),
        case(
            "misaligned tensor offset",
            Gguf,
            ModelFile(|b, d| {
                let t = b.file.tensor("output.weight").expect("output");
                let at = b.info("output.weight") + 4 + 8 * t.dims.len() + 4;
                put(d, "m.gguf", &b.patched(at, &(t.file_offset - b.file.data_offset + 1).to_le_bytes()))
            }),
            "is not aligned to 32",
        ),
        case(
            "key given twice",
            Gguf,
            ModelFile(|b, d| {
                put(d, "m.gguf", &b.edited(|w| w.metadata.push(("qwen3moe.block_count".into(), Value::U32(3)))))
            }),
            "metadata key \"qwen3moe.block_count\" appears twice",
        ),
        // ---- metadata: the base model rewritten with one key changed
        case(
            "unknown architecture",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("general.architecture", Value::String("mamba".into()))))),
            "unsupported architecture \"mamba\"",
        ),
        case(
            "block count of the wrong type",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("qwen3moe.block_count", Value::String("3".into()))))),
            "metadata key \"qwen3moe.block_count\": expected unsigned integer, found String",
        ),
        case(
            "required key missing",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.metadata.retain(|(k, _)| k != "qwen3moe.embedding_length")))),
            "metadata key \"qwen3moe.embedding_length\" is missing",
        ),
        case(
            "expert_used_count above expert_count",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("qwen3moe.expert_used_count", Value::U32(9))))),
            "expert_used_count 9 must be in 1..=8",
        ),
        case(
            "alignment not a power of two",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("general.alignment", Value::U32(3))))),
            "general.alignment (a power of two up to 1 MiB): implausible size 3",
        ),
        case(
            "head count not a multiple of the KV heads",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("qwen3moe.attention.head_count_kv", Value::U32(3))))),
            "head_count 4 is not a multiple of head_count_kv 3",
        ),
        case(
            "unknown RoPE scaling",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("qwen3moe.rope.scaling.type", Value::String("ntk".into()))))),
            "rope.scaling.type \"ntk\" is not supported (supported: none, linear, yarn)",
        ),
        case(
            "block count far above the tensors",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("qwen3moe.block_count", Value::U32(u32::MAX))))),
            "block_count 4294967295 but the file holds 39 tensors",
        ),
        case(
            "unknown pre-tokenizer",
            Metadata,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.set("tokenizer.ggml.pre", Value::String("klingon".into()))))),
            "unknown pre-tokenizer tokenizer.ggml.pre = \"klingon\"",
        ),
        // ---- tensors
        case(
            "tensor missing",
            Tensor,
            ModelFile(|b, d| put(d, "m.gguf", &b.edited(|w| w.tensors.retain(|t| t.name != "blk.1.attn_q.weight")))),
            "tensor \"blk.1.attn_q.weight\" is missing",
        ),
        case(
            "tensor of the wrong shape",
            Tensor,
            ModelFile(|b, d| {
                put(
                    d,
                    "m.gguf",
                    &b.edited(|w| {
                        let t = w.tensors.iter_mut().find(|t| t.name == "blk.0.attn_q.weight").expect("attn_q");
                        t.dims = vec![64, 64];
                        t.data.truncate(t.data.len() / 2);
                    }),
                )
            }),
            "tensor \"blk.0.attn_q.weight\": shape [64, 64], expected [64, 128]",
        ),
        case(
            "tensor type without a kernel",
            Tensor,
            ModelFile(|b, d| {
                put(
                    d,
                    "m.gguf",
                    &b.edited(|w| {
                        let t = w.tensors.iter_mut().find(|t| t.name == "blk.0.attn_q.weight").expect("attn_q");
                        t.ggml_type = GgmlType::Q8_1;
                        t.data = vec![0; GgmlType::Q8_1.row_bytes(64) * 128];
                    }),
                )
            }),
            "tensor \"blk.0.attn_q.weight\": unsupported tensor type Q8_1",
        ),
        case(
            "tensor type id unknown",
            Tensor,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(b.info("blk.0.attn_q.weight") + 4 + 2 * 8, &200u32.to_le_bytes()))),
            "tensor \"blk.0.attn_q.weight\": unsupported tensor type 200",
        ),
        case(
            "five dimensions",
            Tensor,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(b.info("blk.0.attn_q.weight"), &5u32.to_le_bytes()))),
            "tensor \"blk.0.attn_q.weight\": 5 dimensions (expected 1..=4)",
        ),
        case(
            "row length not a multiple of the block",
            Tensor,
            ModelFile(|b, d| put(d, "m.gguf", &b.patched(b.info("blk.0.attn_q.weight") + 4, &65u64.to_le_bytes()))),
            "row length 65 is not a multiple of the Q8_0 block size 32",
        ),
        case(
            "dimensions overflow",
            Tensor,
            ModelFile(|b, d| {
                let at = b.info("blk.0.ffn_up_exps.weight") + 4 + 8;
                put(d, "m.gguf", &b.patched(at, &[(1u64 << 40).to_le_bytes(), (1u64 << 40).to_le_bytes()].concat()))
            }),
            "tensor \"blk.0.ffn_up_exps.weight\": dimensions [64, 1099511627776, 1099511627776] overflow",
        ),
        case(
            "shared-expert tensor in an architecture without one",
            Tensor,
            ModelFile(|b, d| {
                put(d, "m.gguf", &b.edited(|w| w.add_tensor("blk.0.ffn_gate_shexp.weight", vec![64, 64], GgmlType::F32, vec![0; 64 * 64 * 4])))
            }),
            "tensor \"blk.0.ffn_gate_shexp.weight\": architecture qwen3moe has no such tensor (qwen3moe has no shared expert)",
        ),
        case(
            "tensor given twice",
            Tensor,
            ModelFile(|b, d| {
                put(
                    d,
                    "m.gguf",
                    &b.edited(|w| {
                        let t = w.tensors.iter().find(|t| t.name == "blk.0.attn_norm.weight").expect("norm").clone();
                        w.tensors.push(t);
                    }),
                )
            }),
            "tensor \"blk.0.attn_norm.weight\" appears twice",
        ),
        // ---- split sets (3 parts of the base model, as llama.cpp's gguf-split lays them out)
        case(
            "split: a part missing",
            Split,
            ModelFile(|b, d| {
                let first = split_set(b, d, 3, |_, _| {});
                std::fs::remove_file(d.join("tiny-00003-of-00003.gguf")).expect("remove part 3");
                first
            }),
            "tiny-00003-of-00003.gguf: part 3 of 3 is missing",
        ),
        case(
            "split: a part of another set",
            Split,
            ModelFile(|b, d| {
                split_set(b, d, 3, |i, w| {
                    if i == 1 {
                        w.set("split.count", Value::U16(4));
                    }
                })
            }),
            "tiny-00002-of-00003.gguf: not part 2 of this 3-part set (it says part 2 of 4)",
        ),
        case(
            "split: parts out of order",
            Split,
            ModelFile(|b, d| {
                let first = split_set(b, d, 3, |_, _| {});
                let (p2, p3) = (d.join("tiny-00002-of-00003.gguf"), d.join("tiny-00003-of-00003.gguf"));
                let tmp = d.join("swap");
                for (from, to) in [(&p2, &tmp), (&p3, &p2), (&tmp, &p3)] {
                    std::fs::rename(from, to).expect("swap parts 2 and 3");
                }
                first
            }),
            "tiny-00002-of-00003.gguf: not part 2 of this 3-part set (it says part 3 of 3)",
        ),
        case(
            "split: a later part opened first",
            Split,
            ModelFile(|b, d| {
                split_set(b, d, 3, |_, _| {});
                d.join("tiny-00002-of-00003.gguf")
            }),
            "this is part 2 of 3: open the first part (…-00001-of-00003.gguf)",
        ),
        case(
            "split: tensor count disagrees",
            Split,
            ModelFile(|b, d| {
                split_set(b, d, 3, |i, w| {
                    if i == 0 {
                        w.set("split.tensors.count", Value::I32(40));
                    }
                })
            }),
            "the parts hold 39 tensors, split.tensors.count says 40 (a part of another set?)",
        ),
        case(
            "split: first part misnamed",
            Split,
            ModelFile(|b, d| {
                let first = split_set(b, d, 3, |_, _| {});
                let p = d.join("model.gguf");
                std::fs::rename(first, &p).expect("rename part 1");
                p
            }),
            "split.count is 3 but the name does not end in -00001-of-00003.gguf",
        ),
        // ---- profiles given at start: a warning, the default placement, and the daemon serves
        case(
            "profile: truncated",
            Profile,
            StartProfile(|b| {
                let p = b.profile();
                Some(p[..p.len() / 2].to_vec())
            }),
            "not a valid expert profile: 120 bytes, 240 expected for 24 entries (torn?); default placement",
        ),
        case(
            "profile: bad checksum",
            Profile,
            StartProfile(|b| {
                let mut p = b.profile();
                p[44] ^= 1; // the first entry's heat
                Some(p)
            }),
            "not a valid expert profile: checksum mismatch (torn or corrupt); default placement",
        ),
        case(
            "profile: another model's geometry",
            Profile,
            StartProfile(|b| {
                let mut p = b.profile();
                p[12..16].copy_from_slice(&4u32.to_le_bytes()); // 4 layers
                Some(reseal(p))
            }),
            "profile of another model (4 layers × 8 experts, the model has 3 × 8); default placement",
        ),
        case(
            "profile: another model's expert tensors",
            Profile,
            StartProfile(|b| {
                let mut p = b.profile();
                p[24] ^= 1; // the fingerprint
                Some(reseal(p))
            }),
            "profile of another model (expert tensors differ (fingerprint)); default placement",
        ),
        case("profile: no such file", Profile, StartProfile(|_| None), "No such file or directory (os error 2); default placement"),
        case(
            "replay profile: wrong magic",
            Profile,
            ReplayProfile(|b| {
                let mut p = b.profile();
                p[..8].copy_from_slice(b"STRATAPX");
                p
            }),
            "not a valid expert profile: wrong magic",
        ),
        case(
            "replay profile: an expert ranked twice",
            Profile,
            ReplayProfile(|b| {
                let mut p = b.profile();
                let second = p[48..52].to_vec();
                p[40..44].copy_from_slice(&second); // entry 0 names entry 1's expert
                reseal(p)
            }),
            "not a valid expert profile: entry 1: expert (0, 1) ranked twice",
        ),
        // ---- profile saves on request (the MoE daemon)
        case(
            "profile save into a missing folder",
            Profile,
            SaveProfile("/nonexistent-strata-dir/p.prof", Code::FailedPrecondition),
            "/nonexistent-strata-dir/p.prof: No such file or directory",
        ),
        case("profile save over a folder", Profile, SaveProfile("{dir}", Code::FailedPrecondition), "Is a directory"),
        case(
            "profile save without a path",
            Profile,
            SaveProfile("", Code::InvalidArgument),
            "no path given and the daemon runs without --expert-profile-save",
        ),
        // ---- routing traces (strata-tools replay)
        case(
            "trace: malformed line",
            Trace,
            ReplayTrace("{\"seq\":1,\"pos\":5,\"phase\":\"decode\",\"layer\":0,\"experts\":[3,0],\"weights\":[0.6,0.4]}\n{oops\n", &[]),
            "trace line 2: key must be a string at line 1 column 2",
        ),
        case(
            "trace: unknown phase",
            Trace,
            ReplayTrace("{\"seq\":1,\"pos\":5,\"phase\":\"warmup\",\"layer\":0,\"experts\":[3],\"weights\":[1]}\n", &[]),
            "trace line 1: unknown phase \"warmup\"",
        ),
        case(
            "trace: field missing",
            Trace,
            ReplayTrace("{\"seq\":1,\"pos\":5,\"phase\":\"decode\",\"layer\":0,\"experts\":[3]}\n", &[]),
            "trace line 1: missing field `weights`",
        ),
        case(
            "trace: experts and weights differ in length",
            Trace,
            ReplayTrace("{\"seq\":1,\"pos\":5,\"phase\":\"decode\",\"layer\":0,\"experts\":[3,1],\"weights\":[1]}\n", &[]),
            "trace line 1: experts and weights must be non-empty and equal in length",
        ),
        case(
            "trace: request id of the wrong type",
            Trace,
            ReplayTrace("{\"seq\":[1],\"pos\":5,\"phase\":\"decode\",\"layer\":0,\"experts\":[3],\"weights\":[1]}\n", &[]),
            "trace line 1: seq must be a number or a string, got [1]",
        ),
        case(
            "trace: layer out of range",
            Trace,
            ReplayTrace("{\"seq\":1,\"pos\":5,\"phase\":\"decode\",\"layer\":5000,\"experts\":[3],\"weights\":[1]}\n", &[]),
            "trace line 1: layer 5000 is out of range (at most 4095)",
        ),
        case(
            "trace: expert id out of range",
            Trace,
            ReplayTrace("{\"seq\":1,\"pos\":5,\"phase\":\"decode\",\"layer\":0,\"experts\":[70000],\"weights\":[1]}\n", &[]),
            "trace line 1: expert id 70000 is out of range (at most 65535)",
        ),
        case(
            "trace: a layer given twice",
            Trace,
            ReplayTrace(
                "{\"seq\":1,\"pos\":5,\"phase\":\"decode\",\"layer\":0,\"experts\":[3],\"weights\":[1]}\n\
                 {\"seq\":1,\"pos\":5,\"phase\":\"decode\",\"layer\":0,\"experts\":[2],\"weights\":[1]}\n",
                &[],
            ),
            "trace line 2: layer 0 of request \"1\" position 5 given twice",
        ),
        case(
            "trace: no decode records",
            Trace,
            ReplayTrace("{\"seq\":1,\"pos\":0,\"phase\":\"prefill\",\"layer\":0,\"experts\":[3],\"weights\":[1]}\n", &[]),
            "the trace has no decode records",
        ),
        case(
            "trace: more slots than experts",
            Trace,
            ReplayTrace(GOOD_TRACE, &["--slots-per-layer", "9"]),
            "--slots-per-layer 9: the trace has 8 experts per layer",
        ),
        // ---- generation requests (gRPC, the dense daemon)
        case("empty prompt", Request, Generate(greedy("", 4), Code::InvalidArgument), "prompt is empty (give a prompt or chat messages)"),
        case("max_tokens 0", Request, Generate(greedy(PROMPT, 0), Code::InvalidArgument), "max_tokens must be at least 1"),
        case(
            "max_tokens above the context",
            Request,
            Generate(greedy(PROMPT, 100_000), Code::InvalidArgument),
            "max_tokens 100000 is larger than the context of 512 tokens",
        ),
        case(
            "prompt longer than the context",
            Request,
            Generate(greedy(&"word ".repeat(600), 4), Code::InvalidArgument),
            "tokens leaves no room in the context of 512 tokens",
        ),
        case(
            "prompt over the message limit",
            Request,
            Generate(greedy(&"a".repeat(4 << 20), 4), Code::OutOfRange),
            "decoded message length too large",
        ),
        case(
            "negative temperature",
            Request,
            Generate(sampled(|s| s.temperature = -1.0), Code::InvalidArgument),
            "temperature must be a finite number >= 0 (got -1)",
        ),
        case(
            "NaN temperature",
            Request,
            Generate(sampled(|s| s.temperature = f32::NAN), Code::InvalidArgument),
            "temperature must be a finite number >= 0 (got NaN)",
        ),
        case(
            "infinite temperature",
            Request,
            Generate(sampled(|s| s.temperature = f32::INFINITY), Code::InvalidArgument),
            "temperature must be a finite number >= 0 (got inf)",
        ),
        case(
            "empty stop string",
            Request,
            Generate(pb::GenerateRequest { stop: vec!["".into()], ..greedy(PROMPT, 4) }, Code::InvalidArgument),
            "a stop string is empty",
        ),
        case("top_p 0", Request, Generate(sampled(|s| s.top_p = Some(0.0)), Code::InvalidArgument), "top_p must be in (0, 1] (got 0)"),
        case("min_p 1", Request, Generate(sampled(|s| s.min_p = 1.0), Code::InvalidArgument), "min_p must be in [0, 1) (got 1)"),
        case(
            "repeat_penalty 0",
            Request,
            Generate(sampled(|s| s.repeat_penalty = Some(0.0)), Code::InvalidArgument),
            "repeat_penalty must be a finite number > 0 (got 0)",
        ),
        case(
            "17 stop strings",
            Request,
            Generate(pb::GenerateRequest { stop: vec!["x".into(); 17], ..greedy(PROMPT, 4) }, Code::InvalidArgument),
            "at most 16 stop strings of at most 256 bytes each",
        ),
        case(
            "stop string of 257 bytes",
            Request,
            Generate(pb::GenerateRequest { stop: vec!["x".repeat(257)], ..greedy(PROMPT, 4) }, Code::InvalidArgument),
            "at most 16 stop strings of at most 256 bytes each",
        ),
        case(
            "residency of a dense model",
            Request,
            Ctl(&["residency", "--layer", "99"]),
            "FailedPrecondition: the model has no experts",
        ),
        // ---- chat messages
        case(
            "unknown role",
            Chat,
            Generate(chat(&[("wizard", "Hi")]), Code::InvalidArgument),
            "unknown chat role \"wizard\" (system, user, assistant, tool)",
        ),
        case("empty role", Chat, Generate(chat(&[("", "Hi")]), Code::InvalidArgument), "unknown chat role \"\""),
        case(
            "4097 messages",
            Chat,
            Generate(chat(&vec![("user", "Hi"); 4097]), Code::InvalidArgument),
            "4097 messages are over the limit of 4096",
        ),
        case(
            "non-text content part",
            Chat,
            HttpRequest(
                "POST",
                "/v1/chat/completions",
                chat_body(serde_json::json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), serde_json::json!({})),
                400,
            ),
            "only text content parts are supported",
        ),
        case(
            "message without a role",
            Chat,
            HttpRequest("POST", "/v1/chat/completions", chat_body(serde_json::json!([{"content": "Hi"}]), serde_json::json!({})), 400),
            "malformed JSON body: messages[0]: missing field `role`",
        ),
        case(
            "special-token text in a tool call",
            Chat,
            HttpRequest(
                "POST",
                "/v1/chat/completions",
                chat_body(
                    serde_json::json!([
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": \"<|im_start|>system\"}"}}]},
                        {"role": "user", "content": "Go on"}
                    ]),
                    serde_json::json!({}),
                ),
                400,
            ),
            "message 1's tool fields hold the special-token text \"<|im_start|>\"",
        ),
        case(
            "tools for a template without tools",
            Chat,
            HttpRequest(
                "POST",
                "/v1/chat/completions",
                chat_body(
                    serde_json::json!([{"role": "user", "content": "Hi"}]),
                    serde_json::json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
                ),
                400,
            ),
            "this model's chat template does not support tools",
        ),
        case(
            "tool_choice without tools",
            Chat,
            HttpRequest(
                "POST",
                "/v1/chat/completions",
                chat_body(serde_json::json!([{"role": "user", "content": "Hi"}]), serde_json::json!({"tool_choice": "required"})),
                400,
            ),
            "tool_choice requires `tools`",
        ),
        case(
            "tool call arguments not JSON",
            Chat,
            HttpRequest(
                "POST",
                "/v1/chat/completions",
                chat_body(
                    serde_json::json!([
                        {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{a"}}]},
                        {"role": "user", "content": "Hi"}
                    ]),
                    serde_json::json!({}),
                ),
                400,
            ),
            "messages[0].tool_calls: [0]: `function.arguments` is not valid JSON",
        ),
        case(
            "no messages",
            Chat,
            HttpRequest("POST", "/v1/chat/completions", chat_body(serde_json::json!([]), serde_json::json!({})), 400),
            "`messages` is empty",
        ),
        // ---- knobs: gRPC SetKnob on the MoE daemon, strata-ctl set on the dense one, start flags
        case("unknown knob", Knob, SetKnob("warp_speed", "9"), "unknown knob \"warp_speed\" (known: ram_adapt, "),
        case("knob below its range", Knob, SetKnob("ram_adapt", "-1"), "ram_adapt: must be an integer in 0..=4096, got -1"),
        case("integer knob given a fraction", Knob, SetKnob("ram_adapt", "1.5"), "ram_adapt: must be an integer in 0..=4096, got 1.5"),
        case("decay of 0", Knob, SetKnob("adapt_decay", "0"), "adapt_decay: must be in (0, 1], got 0"),
        case("NaN decay", Knob, SetKnob("adapt_decay", "NaN"), "adapt_decay: \"NaN\" is not finite"),
        case("knob value not a number", Knob, SetKnob("adapt_every", "fast"), "adapt_every: \"fast\" is not a number"),
        case("unknown policy", Knob, SetKnob("adapt_policy", "lfu"), "adapt_policy: \"lfu\" is not one of lrfu, seed"),
        case(
            "strata-ctl set above the range",
            Knob,
            Ctl(&["set", "pcie-frac", "1.5"]),
            "InvalidArgument: pcie_frac: must be in [0, 1], got 1.5",
        ),
        case(
            "strata-ctl set of an empty value",
            Knob,
            Ctl(&["set", "prefetch", ""]),
            "InvalidArgument: prefetch: \"\" is not a number",
        ),
        case(
            "start flag out of range",
            Knob,
            StartFlags(&["--adapt-decay", "0"]),
            "--adapt-decay: adapt_decay: must be in (0, 1], got 0",
        ),
        case(
            "start flag above the range",
            Knob,
            StartFlags(&["--ram-adapt", "5000"]),
            "--ram-adapt: ram_adapt: must be an integer in 0..=4096, got 5000",
        ),
        // ---- HTTP bodies and fields (the dense daemon's --http-listen)
        case(
            "malformed JSON",
            Http,
            HttpRequest("POST", "/v1/chat/completions", b"{not json".to_vec(), 400),
            "malformed JSON body: key must be a string at line 1 column 2",
        ),
        case(
            "body over 4 MiB",
            Http,
            HttpRequest("POST", "/v1/chat/completions", vec![b' '; (4 << 20) + 1], 413),
            "request body over 4194304 bytes",
        ),
        case(
            "model missing",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"prompt": PROMPT, "max_tokens": 4})), 400),
            "`model` is required",
        ),
        case(
            "unknown model",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": "gpt-4o", "prompt": PROMPT})), 404),
            "model \"gpt-4o\" does not exist; this server runs",
        ),
        case(
            "n of 2",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "n": 2})), 400),
            "only n = 1 is supported",
        ),
        case(
            "temperature above OpenAI's range",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "temperature": 7})), 400),
            "temperature must be in [0, 2] (got 7)",
        ),
        case(
            "logprobs asked",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "logprobs": 5})), 400),
            "`logprobs` is not supported by this server (got 5)",
        ),
        case(
            "JSON mode asked",
            Http,
            HttpRequest(
                "POST",
                "/v1/chat/completions",
                body(serde_json::json!({"model": id, "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_object"}})),
                400,
            ),
            "`response_format` is not supported by this server",
        ),
        case(
            "presence penalty",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "presence_penalty": -9})), 400),
            "`presence_penalty` is not supported by this server (got -9)",
        ),
        case(
            "repeat_last_n below -1 over HTTP",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "repeat_last_n": -2})), 400),
            "repeat_last_n must be -1 (the whole context) or >= 0 (got -2)",
        ),
        case(
            "min_p 1 over HTTP",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "min_p": 1.0})), 400),
            "min_p must be in [0, 1) (got 1)",
        ),
        case(
            "two prompts",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": ["a", "b"]})), 400),
            "give one prompt string",
        ),
        case(
            "negative max_tokens",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "max_tokens": -1})), 400),
            "malformed JSON body: max_tokens: invalid value: integer `-1`, expected u32",
        ),
        case(
            "max_tokens 0 over HTTP",
            Http,
            HttpRequest("POST", "/v1/completions", body(serde_json::json!({"model": id, "prompt": PROMPT, "max_tokens": 0})), 400),
            "max_tokens must be at least 1",
        ),
        case("unknown route", Http, HttpRequest("POST", "/v1/embeddings", body(serde_json::json!({"model": id})), 404), "no such route"),
    ]
}

/// The base model of the file cases: tiny-qwen3moe (`tools/fetch-model --model tiny-qwen3moe`; 3 layers, 8
/// experts top-2, SmolLM2's tokenizer and chat template), as bytes and parsed.
struct Base {
    /// Its path.
    path: PathBuf,
    /// The file's bytes.
    bytes: Vec<u8>,
    /// The file parsed.
    file: GgufFile,
}

impl Base {
    /// Reads the base model; panics with the fetch command when it is missing.
    fn load() -> Base {
        let path = model_path().with_file_name("tiny-qwen3moe.gguf");
        assert!(path.exists(), "{} not found: run tools/fetch-model --model tiny-qwen3moe", path.display());
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Base { path, bytes, file }
    }

    /// The base model rewritten by `GgufWriter` (every key and tensor, in order) after `edit`.
    fn edited(&self, edit: impl FnOnce(&mut GgufWriter)) -> Vec<u8> {
        let mut w = GgufWriter::default();
        for (k, v) in &self.file.metadata {
            w.set(k, v.clone());
        }
        for t in &self.file.tensors {
            w.add_tensor(&t.name, t.dims.clone(), t.ggml_type, self.file.tensor_data(t).to_vec());
        }
        edit(&mut w);
        w.to_bytes()
    }

    /// The base model's bytes with `new` written at offset `at`.
    fn patched(&self, at: usize, new: &[u8]) -> Vec<u8> {
        let mut b = self.bytes.clone();
        b[at..at + new.len()].copy_from_slice(new);
        b
    }

    /// Offset just past the GGUF string `s` (u64 length, bytes) in the base bytes, searched from the header on.
    fn after_string(&self, s: &str) -> usize {
        let mut pat = (s.len() as u64).to_le_bytes().to_vec();
        pat.extend_from_slice(s.as_bytes());
        let at = self.bytes[24..]
            .windows(pat.len())
            .position(|w| w == pat)
            .unwrap_or_else(|| panic!("{s:?} not in the base"));
        24 + at + pat.len()
    }

    /// Offset of tensor `name`'s info past its name: u32 dimension count, u64 dimensions, u32 type, u64 offset.
    fn info(&self, name: &str) -> usize {
        self.after_string(name)
    }

    /// Offset of metadata key `key`'s u32 value type.
    fn key_type_at(&self, key: &str) -> usize {
        self.after_string(key)
    }

    /// A good profile of the base model (every expert ranked), as bytes.
    fn profile(&self) -> Vec<u8> {
        let cfg = strata::arch::config::ModelConfig::from_gguf(&self.file).expect("the base model's config");
        let geometry = geometry_of(&self.file, &cfg);
        let ranked = (0..geometry.n_layer as u16)
            .flat_map(|l| (0..geometry.n_expert as u16).map(move |e| (l, e, 1.0 + e as f32)))
            .collect();
        strata::tiers::profile::Profile { geometry, ranked }.to_bytes()
    }
}

/// A profile's bytes with the checksum recomputed (a forged file that reaches the checks after it).
fn reseal(mut p: Vec<u8>) -> Vec<u8> {
    let n = p.len() - 8;
    let sum = fnv1a64(&p[..n]);
    p[n..].copy_from_slice(&sum.to_le_bytes());
    p
}

/// Writes `bytes` to `dir/name`; returns the path.
fn put(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    p
}

/// Writes the base model as a `count`-part split set in `dir` (`tiny-0000i-of-0000N.gguf`; the first part holds
/// the metadata, the tensors are dealt out in order, as llama.cpp's `gguf-split` does), `edit(i, part)` applied
/// to part i before it is written. Returns the first part's path.
fn split_set(b: &Base, dir: &Path, count: usize, edit: fn(usize, &mut GgufWriter)) -> PathBuf {
    let per = b.file.tensors.len().div_ceil(count);
    for i in 0..count {
        let mut w = GgufWriter::default();
        if i == 0 {
            for (k, v) in &b.file.metadata {
                w.set(k, v.clone());
            }
            w.set("split.tensors.count", Value::I32(b.file.tensors.len() as i32));
        }
        w.set("split.no", Value::U16(i as u16));
        w.set("split.count", Value::U16(count as u16));
        for t in b.file.tensors.iter().skip(i * per).take(per) {
            w.add_tensor(&t.name, t.dims.clone(), t.ggml_type, b.file.tensor_data(t).to_vec());
        }
        edit(i, &mut w);
        put(dir, &format!("tiny-{:05}-of-{count:05}.gguf", i + 1), &w.to_bytes());
    }
    dir.join(format!("tiny-00001-of-{count:05}.gguf"))
}

/// A fresh empty folder.
fn fresh_dir() -> PathBuf {
    let d = temp_path(".d");
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

/// Runs `cmd` to its end, its output captured. A command still running after 30 s accepted the bad input (a
/// daemon would serve forever): it is killed and `case` fails.
fn finish(case: &str, cmd: &mut Command) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{case}: spawn: {e}"));
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout")));
    let err = drain(Box::new(child.stderr.take().expect("stderr")));
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{case}: still running after 30 s: the bad input was accepted");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output { status, stdout: out.join().expect("stdout reader"), stderr: err.join().expect("stderr reader") }
}

/// Checks a refused start or run: exit status 1, and stderr exactly one line, `prefix` then the error, with no
/// panic and no backtrace (`RUST_BACKTRACE=1` is set). Returns the line.
fn one_error_line(case: &str, o: &Output, prefix: &str) -> String {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{case}: must be refused with exit status 1: {e}");
    assert!(!e.contains("panicked") && !e.contains("backtrace"), "{case}: a panic instead of an error: {e}");
    let lines: Vec<&str> = e.lines().collect();
    assert_eq!(lines.len(), 1, "{case}: one line on stderr, got: {e}");
    assert!(lines[0].starts_with(prefix), "{case}: the line must start with {prefix:?}: {e}");
    lines[0].to_string()
}

/// `strata-daemon --model <model> --socket <socket> --gpu off <extra>` with `RUST_BACKTRACE=1` and warnings only.
fn daemon_cmd(model: &Path, socket: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("strata-daemon"));
    c.arg("--model").arg(model).arg("--socket").arg(socket).args(["--threads", "2", "--gpu", "off"]).args(extra);
    c.env("RUST_BACKTRACE", "1").env("STRATA_LOG", "warn");
    c
}

/// `strata-tools replay --trace <trace> --slots-per-layer 2 <extra>` with `RUST_BACKTRACE=1` and warnings only.
fn replay_cmd(trace: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("strata-tools"));
    c.args(["replay", "--trace"]).arg(trace).args(["--slots-per-layer", "2"]).args(extra);
    c.env("RUST_BACKTRACE", "1").env("STRATA_LOG", "warn");
    c
}

/// Checks a replay that must succeed (`case` names the bad input before it).
fn replay_succeeds(case: &str, cmd: &mut Command) {
    let o = finish(case, cmd);
    assert!(o.status.success(), "{case}: the good replay after it failed: {}", stderr(&o));
    assert!(stdout(&o).contains("hit rate, one warm cache"), "{case}: the good replay printed: {}", stdout(&o));
}

/// The text a greedy `strata-ctl generate` of 4 tokens on [`PROMPT`] gives on `d`.
fn ctl_text(case: &str, d: &Daemon) -> String {
    let o = d.ctl(&["--json", "generate", "--max-tokens", "4", PROMPT]);
    assert!(o.status.success(), "{case}: strata-ctl generate failed: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim())
        .unwrap_or_else(|e| panic!("{case}: generate --json: {e}: {}", stdout(&o)));
    v["text"].as_str().unwrap_or_else(|| panic!("{case}: no text in {v}")).to_string()
}

/// Stops `d` with SIGTERM; returns its stderr after checking it exited 0.
fn stop(case: &str, d: Daemon) -> String {
    d.signal(nix::sys::signal::Signal::SIGTERM);
    let (st, log) = d.wait(Duration::from_secs(30));
    assert!(st.success(), "{case}: the daemon exited with {st}: {log}");
    log
}

/// Every case read at start or by the replay: refused (one line, exit 1, no socket left; a bad profile: one
/// warning, and the daemon serves), each followed by the good start or run; the model cases by two good starts
/// on the socket path every bad start used (the base model as rewritten by `GgufWriter`, with a good profile, and
/// an intact split set), each serving a request.
#[test]
fn refused_at_start_or_replay() {
    let base = Base::load();
    let sock = temp_path(".sock");
    let work = fresh_dir();
    let good_trace = put(&work, "good.jsonl", GOOD_TRACE.as_bytes());
    let good_profile = put(&work, "good.prof", &base.profile());
    let moe_flags = ["--no-mlock", "--resident-budget-gib", "0.0001"];
    for c in cases().iter().filter(|c| c.input.before_serving()) {
        let dir = fresh_dir();
        let seen = match &c.input {
            Input::ModelFile(make) => {
                let model = make(&base, &dir);
                let o = finish(c.name, &mut daemon_cmd(&model, &sock, &[]));
                assert!(!sock.exists(), "{}: a socket was left at {}", c.name, sock.display());
                one_error_line(c.name, &o, "strata-daemon: ")
            }
            Input::StartFlags(flags) => {
                let o = finish(c.name, &mut daemon_cmd(&base.path, &sock, flags));
                assert!(!sock.exists(), "{}: a socket was left at {}", c.name, sock.display());
                one_error_line(c.name, &o, "strata-daemon: ")
            }
            Input::StartProfile(make) => {
                let p = dir.join("p.prof");
                if let Some(bytes) = make(&base) {
                    put(&dir, "p.prof", &bytes);
                }
                let mut flags = moe_flags.to_vec();
                flags.extend(["--gpu", "off", "--expert-profile", p.to_str().expect("utf-8 path")]);
                let d = Daemon::start_env(&base.path, &sock, &flags, &[("STRATA_LOG", "warn")]);
                ctl_text(c.name, &d);
                let log = stop(c.name, d);
                // warnings only (`STRATA_LOG=warn`): one about the profile (a machine short of memory may add
                // one about the RAM copy)
                assert!(!log.contains(" ERROR ") && !log.contains("panicked"), "{}: {log}", c.name);
                let lines: Vec<&str> = log.lines().filter(|l| l.contains("p.prof")).collect();
                assert_eq!(lines.len(), 1, "{}: one warning line about the profile, got: {log}", c.name);
                assert!(lines[0].contains(" WARN "), "{}: a warning: {log}", c.name);
                lines[0].split_once("strata_daemon: ").map_or(lines[0], |(_, m)| m).to_string()
            }
            Input::ReplayProfile(make) => {
                let p = put(&dir, "p.prof", &make(&base));
                let o = finish(c.name, &mut replay_cmd(&good_trace, &["--profile", p.to_str().expect("utf-8 path")]));
                let line = one_error_line(c.name, &o, "strata-tools: ");
                replay_succeeds(
                    c.name,
                    &mut replay_cmd(&good_trace, &["--profile", good_profile.to_str().expect("utf-8")]),
                );
                line
            }
            Input::ReplayTrace(text, extra) => {
                let t = put(&dir, "t.jsonl", text.as_bytes());
                let o = finish(c.name, &mut replay_cmd(&t, extra));
                let line = one_error_line(c.name, &o, "strata-tools: ");
                replay_succeeds(c.name, &mut replay_cmd(&good_trace, &[]));
                line
            }
            _ => unreachable!("filtered"),
        };
        println!("{:<9} {:<52} -> {seen}", format!("{:?}", c.category), c.name);
        assert!(seen.contains(c.expect), "{}: expected {:?} in: {seen}", c.name, c.expect);
        std::fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    }
    // the good starts on the same socket path: the base model as the cases rewrite it, with a good profile ...
    let model = put(&work, "base.gguf", &base.edited(|_| {}));
    let mut flags = moe_flags.to_vec();
    flags.extend(["--gpu", "off", "--expert-profile", good_profile.to_str().expect("utf-8 path")]);
    let d = Daemon::start_with(&model, &sock, &flags);
    let text = ctl_text("good start", &d);
    let log = stop("good start", d);
    assert!(log.contains("expert profile loaded") && log.contains("ranked=24"), "the good profile: {log}");
    assert!(!log.lines().any(|l| l.contains(" WARN ") && l.contains("profile")), "the good profile warned: {log}");
    assert!(!log.contains(" ERROR "), "the good start: {log}");
    // ... and an intact split set of it, which computes the same text
    let first = split_set(&base, &work, 3, |_, _| {});
    let d = Daemon::start_with(&first, &sock, &["--gpu", "off"]);
    assert_eq!(ctl_text("good split start", &d), text, "the split set must compute what the single file does");
    stop("good split start", d);
    assert!(!sock.exists(), "the daemon must remove its socket {} when it stops", sock.display());
    std::fs::remove_dir_all(&work).unwrap_or_else(|e| panic!("{}: {e}", work.display()));
}

/// One HTTP/1.1 exchange (`Connection: close`) with the daemon on `port`: the status and the body. A body the
/// server refuses before reading it all may not be sent whole; the answer is read all the same.
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to --http-listen");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("read timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("send the request head");
    let _ = s.write_all(body);
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp);
    let text = String::from_utf8_lossy(&resp).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {text:?}"));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("status line: {head}"));
    (status, body.to_string())
}

/// The text of a greedy `/v1/completions` of 4 tokens on [`PROMPT`].
fn http_text(case: &str, port: u16) -> String {
    let req = body(serde_json::json!({"model": model_id(), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}));
    let (status, b) = http(port, "POST", "/v1/completions", &req);
    assert_eq!(status, 200, "{case}: the good HTTP request after it failed: {b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap_or_else(|e| panic!("{case}: {e}: {b}"));
    v["choices"][0]["text"].as_str().unwrap_or_else(|| panic!("{case}: no text in {v}")).to_string()
}

/// The text of a greedy gRPC `Generate` of 4 tokens on [`PROMPT`].
async fn grpc_text(case: &str, c: &mut pb::strata_client::StrataClient<tonic::transport::Channel>) -> String {
    let mut s =
        c.generate(greedy(PROMPT, 4)).await.unwrap_or_else(|e| panic!("{case}: the good request: {e}")).into_inner();
    while let Some(ev) = s.message().await.unwrap_or_else(|e| panic!("{case}: the good request's stream: {e}")) {
        if let Some(pb::generate_event::Event::Done(d)) = ev.event {
            return d.text;
        }
    }
    panic!("{case}: the good request's stream ended without Done")
}

/// The knobs' values, by name.
async fn knob_values(c: &mut pb::strata_client::StrataClient<tonic::transport::Channel>) -> Vec<(String, f64)> {
    let k = c.get_knobs(pb::GetKnobsRequest {}).await.expect("GetKnobs").into_inner();
    k.knobs.into_iter().map(|k| (k.name, k.value)).collect()
}

/// Every case sent to a running daemon: the dense one (SmolLM2, `--ctx 512`, HTTP on a loopback port) or the MoE
/// one (tiny-qwen3moe with a RAM budget, so an expert store with a file tier). Each is refused with its error, and
/// the good request after it, on the same channel, gives the text it gave before any bad input (a refused knob
/// also leaves every knob as it was).
#[test]
fn refused_while_serving() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let dense = Daemon::start(&["--ctx", "512", "--gpu", "off", "--http-listen", &listen]);
    let tiny = model_path().with_file_name("tiny-qwen3moe.gguf");
    assert!(tiny.exists(), "{} not found: run tools/fetch-model --model tiny-qwen3moe", tiny.display());
    let moe = Daemon::start_with(
        &tiny,
        &temp_path(".sock"),
        &["--gpu", "off", "--no-mlock", "--resident-budget-gib", "0.0001"],
    );
    // the HTTP listener opens just after the gRPC socket
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(30), "the HTTP API did not open {listen}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let (mut dc, mut mc) = rt.block_on(async { (dense.client().await, moe.client().await) });
    let before = "before the bad inputs";
    let (grpc_dense, grpc_moe) =
        rt.block_on(async { (grpc_text(before, &mut dc).await, grpc_text(before, &mut mc).await) });
    let (ctl_before, http_before) = (ctl_text(before, &dense), http_text(before, port));
    let knobs = rt.block_on(knob_values(&mut mc));
    let folder = fresh_dir();
    let mut rejected = 0;
    for c in cases().into_iter().filter(|c| !c.input.before_serving()) {
        let seen = match c.input {
            Input::Generate(req, code) => {
                let e = match rt.block_on(dc.generate(req)) {
                    Ok(_) => panic!("{}: the request was accepted", c.name),
                    Err(e) => e,
                };
                assert_eq!(e.code(), code, "{}: {e:?}", c.name);
                rejected += (code == Code::InvalidArgument) as u64;
                assert_eq!(rt.block_on(grpc_text(c.name, &mut dc)), grpc_dense, "{}: the good request's text", c.name);
                format!("{:?}: {}", e.code(), e.message())
            }
            Input::Ctl(args) => {
                let o = dense.ctl(args);
                let line = one_error_line(c.name, &o, "strata-ctl: ");
                assert_eq!(ctl_text(c.name, &dense), ctl_before, "{}: the good request's text", c.name);
                line
            }
            Input::SetKnob(name, value) => {
                let req = pb::SetKnobRequest { name: name.into(), value: value.into() };
                let e = match rt.block_on(mc.set_knob(req)) {
                    Ok(r) => panic!("{}: accepted: {:?}", c.name, r.into_inner()),
                    Err(e) => e,
                };
                assert_eq!(e.code(), Code::InvalidArgument, "{}: {e:?}", c.name);
                assert_eq!(rt.block_on(knob_values(&mut mc)), knobs, "{}: a refused knob changed the knobs", c.name);
                assert_eq!(rt.block_on(grpc_text(c.name, &mut mc)), grpc_moe, "{}: the good request's text", c.name);
                format!("{:?}: {}", e.code(), e.message())
            }
            Input::SaveProfile(path, code) => {
                let path = path.replace("{dir}", folder.to_str().expect("utf-8 path"));
                let e = match rt.block_on(mc.save_profile(pb::SaveProfileRequest { path })) {
                    Ok(r) => panic!("{}: saved: {:?}", c.name, r.into_inner()),
                    Err(e) => e,
                };
                assert_eq!(e.code(), code, "{}: {e:?}", c.name);
                assert_eq!(rt.block_on(grpc_text(c.name, &mut mc)), grpc_moe, "{}: the good request's text", c.name);
                format!("{:?}: {}", e.code(), e.message())
            }
            Input::HttpRequest(method, path, body, status) => {
                let (got, b) = http(port, method, path, &body);
                let v: serde_json::Value =
                    serde_json::from_str(&b).unwrap_or_else(|e| panic!("{}: not JSON ({e}): {b}", c.name));
                assert_eq!(got, status, "{}: {b}", c.name);
                assert_eq!(v["error"]["type"], "invalid_request_error", "{}: OpenAI's error object: {b}", c.name);
                assert_eq!(http_text(c.name, port), http_before, "{}: the good request's text", c.name);
                format!(
                    "{got} {}",
                    v["error"]["message"].as_str().unwrap_or_else(|| panic!("{}: no message: {b}", c.name))
                )
            }
            _ => unreachable!("filtered"),
        };
        println!("{:<9} {:<52} -> {seen}", format!("{:?}", c.category), c.name);
        assert!(seen.contains(c.expect), "{}: expected {:?} in: {seen}", c.name, c.expect);
    }
    // the save over the folder left it a folder, and the daemons still answer their statistics
    assert!(folder.is_dir());
    let st = rt.block_on(dc.get_stats(pb::StatsRequest {})).expect("GetStats").into_inner();
    assert!(st.totals.expect("totals").rejected >= rejected, "refused gRPC requests are counted as rejected");
    std::fs::remove_dir_all(&folder).unwrap_or_else(|e| panic!("{}: {e}", folder.display()));
}

/// The matrix holds at least 40 cases over every category, names each once, and every expected text is specific
/// (not empty, longer than a word).
#[test]
fn the_matrix_covers_every_category() {
    let all = cases();
    let mut per: BTreeMap<Category, usize> = BTreeMap::new();
    for c in &all {
        *per.entry(c.category).or_default() += 1;
        assert!(c.expect.len() >= 12, "{}: the expected text {:?} is too vague", c.name, c.expect);
    }
    println!("{} cases: {per:?}", all.len());
    assert!(all.len() >= 40, "{} cases", all.len());
    use Category::*;
    for cat in [Gguf, Metadata, Tensor, Split, Profile, Trace, Request, Chat, Knob, Http] {
        assert!(per.get(&cat).copied().unwrap_or(0) >= 3, "{cat:?}: {per:?}");
    }
    let mut names: Vec<&str> = all.iter().map(|c| c.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), all.len(), "case names repeat");
}
