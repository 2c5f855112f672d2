//! GGUF reader: every metadata value type, tensor infos, alignment, and
//! typed errors (never a panic) for truncated or corrupt files.

use strata::gguf::writer::{string_array, GgufWriter};
use strata::gguf::{GgufError, GgufFile, Value, ValueType};
use strata::quant::GgmlType;

fn write_tmp(bytes: &[u8]) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let p = std::env::temp_dir().join(format!(
        "strata-gguf-{}-{}.gguf",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Opens `bytes` as a file and, through [`GgufFile::from_bytes`], from memory: both must agree (the same metadata,
/// tensors and bytes, or the same error), so every test here covers both.
fn open_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let p = write_tmp(bytes);
    let r = GgufFile::open(&p);
    std::fs::remove_file(&p).unwrap();
    let m = GgufFile::from_bytes(&p, bytes.to_vec());
    match (&r, &m) {
        (Ok(a), Ok(b)) => {
            assert_eq!(format!("{:?}", a.metadata), format!("{:?}", b.metadata));
            assert_eq!(format!("{:?}", a.tensors), format!("{:?}", b.tensors));
            assert_eq!((a.bytes(), a.data_offset, a.path()), (b.bytes(), b.data_offset, b.path()));
        }
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!("file and memory disagree: {:?} vs {:?}", r.as_ref().err(), m.as_ref().err()),
    }
    r
}

fn sample() -> GgufWriter {
    let mut w = GgufWriter::default();
    w.set("general.architecture", Value::String("llama".into()));
    w.set("t.u8", Value::U8(200));
    w.set("t.i8", Value::I8(-5));
    w.set("t.u16", Value::U16(60000));
    w.set("t.i16", Value::I16(-30000));
    w.set("t.u32", Value::U32(4_000_000_000));
    w.set("t.i32", Value::I32(-2_000_000_000));
    w.set("t.f32", Value::F32(1.5));
    w.set("t.bool", Value::Bool(true));
    w.set("t.string", Value::String("héllo ✓".into()));
    w.set("t.u64", Value::U64(1 << 40));
    w.set("t.i64", Value::I64(-(1 << 40)));
    w.set("t.f64", Value::F64(-2.25));
    w.set("t.arr", string_array(["a", "b", "c"]));
    w.set("t.arr_i32", Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]));
    w.set("t.nested", Value::Array(ValueType::Array, vec![Value::Array(ValueType::U8, vec![Value::U8(1)])]));
    w.set("t.empty", Value::Array(ValueType::F32, vec![]));
    w.add_tensor("tensor_a", vec![4], GgmlType::F32, vec![1u8; 16]);
    w.add_tensor("b", vec![64, 3], GgmlType::Q4_1, vec![2u8; GgmlType::Q4_1.row_bytes(64) * 3]);
    w.add_tensor("c", vec![32, 2, 2], GgmlType::Q8_0, vec![3u8; GgmlType::Q8_0.row_bytes(32) * 4]);
    w
}

#[test]
fn reads_every_value_type_and_tensor() {
    let w = sample();
    let f = open_bytes(&w.to_bytes()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.metadata.len(), w.metadata.len());
    for (k, v) in &w.metadata {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.get_u32("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_f64("t.f32").unwrap(), 1.5);
    assert_eq!(f.get_str("t.string").unwrap(), "héllo ✓");
    assert!(matches!(f.get_u64("t.string"), Err(GgufError::WrongType { .. })));
    assert!(matches!(f.get_u64("t.missing"), Err(GgufError::MissingKey(_))));
    assert_eq!(f.alignment, 32);
    assert_eq!(f.data_offset % 32, 0);
    for t in &w.tensors {
        let info = f.require_tensor(&t.name).unwrap();
        assert_eq!(info.dims, t.dims);
        assert_eq!(info.ggml_type, t.ggml_type);
        assert_eq!(info.file_offset % 32, 0);
        assert_eq!(f.tensor_data(info), &t.data[..], "{}", t.name);
    }
    assert_eq!(f.require_tensor("c").unwrap().n_rows(), 4);
}

#[test]
fn every_truncation_is_a_typed_error() {
    let bytes = sample().to_bytes();
    for n in 0..bytes.len() {
        match open_bytes(&bytes[..n]) {
            Err(GgufError::Truncated { .. }) | Err(GgufError::BadMagic(_)) => {}
            Err(e) => panic!("cut at {n}: unexpected error {e}"),
            Ok(_) => panic!("cut at {n} of {} accepted", bytes.len()),
        }
    }
}

#[test]
fn corrupt_headers_are_typed_errors() {
    let good = sample().to_bytes();
    // Bad version.
    let mut b = good.clone();
    b[4..8].copy_from_slice(&7u32.to_le_bytes());
    assert!(matches!(open_bytes(&b), Err(GgufError::UnsupportedVersion(7))));
    // Huge tensor count.
    let mut b = good.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(open_bytes(&b), Err(GgufError::Truncated { .. })));
    // Unknown value type of the first key: header 24 bytes + u64 len + key bytes.
    let mut b = good.clone();
    let klen = u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize;
    let at = 32 + klen;
    b[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    match open_bytes(&b) {
        Err(GgufError::UnknownValueType { key, type_id: 99 }) => assert_eq!(key, "general.architecture"),
        other => panic!("{:?}", other.err()),
    }
    // Unknown tensor type and a tensor past the end of the file.
    let mut w = sample();
    w.tensors[0].ggml_type = GgmlType::F32;
    let mut b = w.to_bytes();
    let pos = find(&b, b"\x08\x00\x00\x00\x00\x00\x00\x00tensor_a").expect("tensor_a info") + 16;
    // n_dims(4) + dim(8) then type
    b[pos + 12..pos + 16].copy_from_slice(&77u32.to_le_bytes());
    match open_bytes(&b) {
        Err(GgufError::UnsupportedTensorType { tensor, type_id: 77 }) => assert_eq!(tensor, "tensor_a"),
        other => panic!("{:?}", other.err()),
    }
    let mut b = w.to_bytes();
    b[pos + 16..pos + 24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(open_bytes(&b), Err(GgufError::Truncated { .. })));
    // Garbage after the magic never panics.
    let mut x = 99u64;
    for len in [8usize, 64, 1000, 5000] {
        let mut g = b"GGUF\x03\x00\x00\x00".to_vec();
        while g.len() < len {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            g.push((x >> 56) as u8);
        }
        assert!(open_bytes(&g).is_err());
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// The offset field of tensor `name`'s info in `bytes` (after its name, dimension count, dimensions and type).
fn offset_field(bytes: &[u8], name: &str, n_dims: usize) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    find(bytes, &key).expect("tensor info") + key.len() + 4 + 8 * n_dims + 4
}

fn err_of(bytes: &[u8]) -> String {
    match open_bytes(bytes) {
        Ok(_) => panic!("opened"),
        Err(e) => e.to_string(),
    }
}

fn two_tensors() -> GgufWriter {
    let mut w = GgufWriter::default();
    w.set("general.architecture", Value::String("llama".into()));
    w.add_tensor("blk.0.ffn_gate.weight", vec![64, 2], GgmlType::F32, vec![1; 512]);
    w.add_tensor("blk.0.ffn_up.weight", vec![64, 2], GgmlType::F32, vec![2; 512]);
    w
}

#[test]
fn overlapping_tensors_are_refused() {
    let good = two_tensors().to_bytes();
    assert!(open_bytes(&good).is_ok());
    // ffn_up given ffn_gate's data (full overlap), then half of it (partial overlap)
    for off in [0u64, 256] {
        let mut b = good.clone();
        let at = offset_field(&b, "blk.0.ffn_up.weight", 2);
        b[at..at + 8].copy_from_slice(&off.to_le_bytes());
        let e = err_of(&b);
        assert!(e.contains("overlaps") && e.contains("ffn_gate") && e.contains("ffn_up"), "{e}");
    }
}

#[test]
fn byte_sizes_past_2_64_are_refused() {
    for dims in [vec![1u64 << 62], vec![1 << 31, (1 << 31) + 8]] {
        let mut w = two_tensors();
        w.add_tensor("extra", dims.clone(), GgmlType::F32, vec![]);
        let e = err_of(&w.to_bytes());
        assert!(e.contains("\"extra\"") && (e.contains("2^64") || e.contains("overflow")), "{dims:?}: {e}");
    }
}

#[test]
fn repeated_keys_and_tensors_and_empty_keys_are_refused() {
    let mut w = two_tensors();
    w.metadata.push(("general.architecture".into(), Value::String("qwen3".into())));
    let e = err_of(&w.to_bytes());
    assert!(e.contains("\"general.architecture\" appears twice"), "{e}");
    let mut w = two_tensors();
    w.metadata.push((String::new(), Value::U32(1)));
    assert!(err_of(&w.to_bytes()).contains("is empty"));
    let mut w = two_tensors();
    w.add_tensor("blk.0.ffn_up.weight", vec![64, 2], GgmlType::F32, vec![3; 512]);
    let e = err_of(&w.to_bytes());
    assert!(e.contains("\"blk.0.ffn_up.weight\" appears twice"), "{e}");
}

#[test]
fn an_alignment_of_the_wrong_type_says_so() {
    let mut w = two_tensors();
    w.set("general.alignment", Value::String("32".into()));
    let e = err_of(&w.to_bytes());
    assert!(
        e.contains("general.alignment") && e.contains("expected an unsigned integer") && e.contains("String"),
        "{e}"
    );
    let mut w = two_tensors();
    w.set("general.alignment", Value::U32(48));
    let e = err_of(&w.to_bytes());
    assert!(e.contains("power of two") && e.contains("48"), "{e}");
}

/// Inputs the fuzzer (tools/fuzz, target `gguf`) found crashing the load: a `block_count` of billions in a small
/// file sized the layer table before any tensor was looked up (an allocation of terabytes, an abort). Each must now
/// load to a one-line error.
#[test]
fn fuzz_findings_are_errors() {
    use strata::arch::config::ModelConfig;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/fuzz/gguf");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        let f = GgufFile::from_bytes(&p, std::fs::read(&p).unwrap()).expect("the header parses");
        let e = ModelConfig::from_gguf(&f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("block_count") && !e.contains('\n'), "{}: {e:?}", p.display());
        n += 1;
    }
    assert!(n >= 4, "{n} findings");
}

/// `detach` moves tensor ranges out of the file mapping with the same bytes: after the file is cut to nothing, the
/// detached ranges still read as before (a mapped page past the end would raise SIGBUS). A range past the end is an
/// error that moves nothing, and a model held in memory has nothing to detach.
#[test]
fn detached_ranges_keep_their_bytes_when_the_file_is_truncated() {
    // tensors of several pages each, with pseudo-random bytes
    let mut w = GgufWriter::default();
    w.set("general.architecture", Value::String("llama".into()));
    let mut x = 0x2545_f491u32;
    let mut noise = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    };
    for (name, rows) in [("a", 300), ("b", 7), ("c", 520)] {
        w.add_tensor(name, vec![32, rows], GgmlType::Q8_0, noise(GgmlType::Q8_0.row_bytes(32) * rows as usize));
    }
    let p = write_tmp(&w.to_bytes());
    let f = GgufFile::open(&p).unwrap();
    let range = |n: &str| {
        let t = f.tensors.iter().find(|t| t.name == n).unwrap();
        t.file_offset as usize..(t.file_offset + t.size_bytes) as usize
    };
    let (a, c) = (range("a"), range("c"));
    let (want_a, want_c) = (f.bytes()[a.clone()].to_vec(), f.bytes()[c.clone()].to_vec());
    let len = f.bytes().len();
    assert!(f.detach(&[0..len + 1]).is_err(), "a range past the end");
    let moved = f.detach(&[a.clone(), c.clone()]).unwrap();
    assert!(moved >= a.len() + c.len() && moved.is_multiple_of(4096), "{moved} bytes moved");
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(0).unwrap();
    assert_eq!(&f.bytes()[a], &want_a[..]);
    assert_eq!(&f.bytes()[c], &want_c[..]);
    drop(f);
    std::fs::remove_file(&p).unwrap();
    let m = GgufFile::from_bytes(&p, w.to_bytes()).unwrap();
    assert_eq!(m.detach(&[0..16]).unwrap(), 0);
}
