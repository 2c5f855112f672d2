//! Split GGUF files (`<prefix>-00001-of-0000N.gguf`, llama.cpp's `gguf-split` layout) made here from the tiny
//! qwen3moe fixture: opening the first part loads the whole model with the same logits and the same expert-tier
//! reads as the single file; a missing part, a foreign part, a part opened first, or a tensor count that disagrees
//! is refused naming the part.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use strata::backend::{Logits, Scratch};
use strata::gguf::writer::GgufWriter;
use strata::gguf::{GgufFile, Value};
use strata::model::Model;
use strata::tiers::fileio::FileIo;
use strata::tiers::store::ResidentMode;

/// Writes `src` as `count` parts in a fresh folder (tensors dealt out in order); `edit(i, w)` may change part i
/// before it is written. Returns the first part's path.
fn write_split(src: &GgufFile, count: usize, tag: &str, edit: impl Fn(usize, &mut GgufWriter)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-split-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let per = src.tensors.len().div_ceil(count);
    for i in 0..count {
        let mut w = GgufWriter::default();
        if i == 0 {
            for (k, v) in &src.metadata {
                w.set(k, v.clone());
            }
            w.set("split.tensors.count", Value::I32(src.tensors.len() as i32));
        }
        w.set("split.no", Value::U16(i as u16));
        w.set("split.count", Value::U16(count as u16));
        for t in src.tensors.iter().skip(i * per).take(per) {
            w.add_tensor(&t.name, t.dims.clone(), t.ggml_type, src.tensor_data(t).to_vec());
        }
        edit(i, &mut w);
        std::fs::write(dir.join(format!("tiny-{:05}-of-{:05}.gguf", i + 1, count)), w.to_bytes()).unwrap();
    }
    dir.join(format!("tiny-00001-of-{count:05}.gguf"))
}

fn load(p: &Path) -> Model {
    let mut m = Model::load(Arc::new(GgufFile::open(p).unwrap())).unwrap();
    m.set_threads(2).unwrap();
    m
}

fn logits(m: &Model) -> Vec<f32> {
    let mut kv = m.new_kv(64);
    m.forward(&[1, 17, 300, 42, 9, 1000, 77], &mut kv, Logits::All, &mut Scratch::default())
}

#[test]
fn the_first_part_loads_the_whole_model() {
    let src = GgufFile::open(arch_fixture_path("qwen3moe")).unwrap();
    let first = write_split(&src, 3, "ok", |_, _| {});
    let f = GgufFile::open(&first).unwrap();
    assert_eq!(f.parts().len(), 3);
    assert_eq!(f.tensors.len(), src.tensors.len());
    for t in &src.tensors {
        assert_eq!(f.tensor_data(f.tensor(&t.name).unwrap()), src.tensor_data(t), "{}", t.name);
    }
    let (whole, split) = (load(&arch_fixture_path("qwen3moe")), load(&first));
    assert_eq!(logits(&split), logits(&whole), "a split file computes the same bits");
    // the file tier reads blobs from whichever part holds them
    let prompts: [&[u32]; 1] = [&[1, 17, 300, 42, 9]];
    let base = greedy(&whole, &prompts, 8);
    let mut split = split;
    for io in [FileIo::Buffered, FileIo::Direct] {
        let st = store_for(&split, &first, ResidentMode::Budget(0), io, None);
        split.experts = Some(Arc::new(st));
        assert_eq!(greedy(&split, &prompts, 8), base, "{io:?}");
        assert!(split.experts.as_ref().unwrap().counters.totals().file_blob_reads > 0);
    }
    std::fs::remove_dir_all(first.parent().unwrap()).unwrap();
}

fn open_err(p: &Path) -> String {
    match GgufFile::open(p) {
        Ok(_) => panic!("{} opened", p.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_sets_are_refused_naming_the_part() {
    let src = GgufFile::open(arch_fixture_path("qwen3moe")).unwrap();
    // a part missing
    let first = write_split(&src, 3, "missing", |_, _| {});
    let third = first.with_file_name("tiny-00003-of-00003.gguf");
    std::fs::remove_file(&third).unwrap();
    let e = open_err(&first);
    assert!(e.contains("part 3 of 3 is missing") && e.contains("tiny-00003-of-00003.gguf"), "{e}");
    // a later part opened first
    let e = open_err(&first.with_file_name("tiny-00002-of-00003.gguf"));
    assert!(e.contains("open the first part"), "{e}");
    // a part of another set: its own numbering disagrees
    let first = write_split(&src, 3, "foreign", |i, w| {
        if i == 1 {
            w.set("split.count", Value::U16(4));
        }
    });
    let e = open_err(&first);
    assert!(e.contains("tiny-00002-of-00003.gguf") && e.contains("not part 2 of this 3-part set"), "{e}");
    // a tensor count that disagrees (a part swapped for one holding other tensors)
    let first = write_split(&src, 3, "count", |i, w| {
        if i == 0 {
            w.set("split.tensors.count", Value::I32(src.tensors.len() as i32 + 1));
        }
    });
    let e = open_err(&first);
    assert!(e.contains("split.tensors.count"), "{e}");
    // the same tensor in two parts
    let first = write_split(&src, 2, "twice", |i, w| {
        if i == 1 {
            let t = &src.tensors[0];
            w.add_tensor(&t.name, t.dims.clone(), t.ggml_type, src.tensor_data(t).to_vec());
        }
    });
    let e = open_err(&first);
    assert!(e.contains("in two parts") || e.contains("split.tensors.count"), "{e}");
    for tag in ["missing", "foreign", "count", "twice"] {
        let _ =
            std::fs::remove_dir_all(std::env::temp_dir().join(format!("strata-split-{}-{tag}", std::process::id())));
    }
}
