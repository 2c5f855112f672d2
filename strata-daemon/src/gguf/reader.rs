//! GGUF reader over memmap2. Every offset and size is checked against the file
//! length before it is used; errors name the key or tensor.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::split::{self, Joined, Part};
use super::value::{Value, ValueType};
use super::{GgufError, DEFAULT_ALIGNMENT};
use crate::quant::GgmlType;

/// One tensor's description from the GGUF tensor-info section.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Tensor name as in GGUF (e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    /// Element / block format.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the file, in bytes.
    pub file_offset: u64,
    /// Size of the data in bytes.
    pub size_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (product of the dimensions).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row length (`dims[0]`), in elements.
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }
    /// Number of rows (product of `dims[1..]`).
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }
}

/// The bytes of a model: one mapped file, or the parts of a split one joined ([`split`]).
enum Mapping {
    One(Mmap),
    /// Bytes held in memory ([`GgufFile::from_bytes`]).
    Owned(Vec<u8>),
    Joined(Joined),
}

/// A GGUF file mapped in memory with its metadata and tensor infos decoded (a split model's parts joined: see
/// [`split`]).
pub struct GgufFile {
    path: PathBuf,
    map: Mapping,
    parts: Vec<Part>,
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Alignment of the data section in bytes (`general.alignment`, default 32).
    pub alignment: u64,
    /// Offset of the tensor data section from the start of the file, in bytes.
    pub data_offset: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: u64,
}

impl<'a> Cursor<'a> {
    fn len(&self) -> u64 {
        self.buf.len() as u64
    }
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).ok_or_else(|| GgufError::BadSize { what: what(), value: n })?;
        if end > self.len() {
            return Err(GgufError::Truncated { what: what(), offset: self.pos, end, len: self.len() });
        }
        let s = &self.buf[self.pos as usize..end as usize];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadString { what: what() })
    }
    fn value(&mut self, t: ValueType, key: &str, depth: u32) -> Result<Value, GgufError> {
        let w = || format!("metadata key {key:?}");
        Ok(match t {
            ValueType::U8 => Value::U8(self.take(1, &w)?[0]),
            ValueType::I8 => Value::I8(self.take(1, &w)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.take(2, &w)?.try_into().unwrap())),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.take(2, &w)?.try_into().unwrap())),
            ValueType::U32 => Value::U32(self.u32(&w)?),
            ValueType::I32 => Value::I32(self.u32(&w)? as i32),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32(&w)?)),
            ValueType::Bool => Value::Bool(self.take(1, &w)?[0] != 0),
            ValueType::String => Value::String(self.string(&w)?),
            ValueType::U64 => Value::U64(self.u64(&w)?),
            ValueType::I64 => Value::I64(self.u64(&w)? as i64),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64(&w)?)),
            ValueType::Array => {
                if depth > 4 {
                    return Err(GgufError::BadSize {
                        what: format!("metadata key {key:?}: array nesting"),
                        value: depth as u64,
                    });
                }
                let et_raw = self.u32(&w)?;
                let et = ValueType::from_u32(et_raw)
                    .ok_or_else(|| GgufError::UnknownValueType { key: key.to_string(), type_id: et_raw })?;
                let n = self.u64(&w)?;
                // Every element takes at least one byte: a count past the rest of the file is corrupt.
                if n > self.len() - self.pos {
                    return Err(GgufError::Truncated {
                        what: format!("metadata key {key:?}: array of {n}"),
                        offset: self.pos,
                        end: self.pos.saturating_add(n),
                        len: self.len(),
                    });
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(et, key, depth + 1)?);
                }
                Value::Array(et, v)
            }
        })
    }
}

/// Opens `path` for reading; a directory is refused as one (opening one succeeds on Linux, and mapping it then fails
/// with a device error that names no cause).
fn open_file(path: &Path) -> Result<File, GgufError> {
    let io = |source| GgufError::Io { path: path.display().to_string(), source };
    let file = File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.is_dir() {
        return Err(io(std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a directory, not a GGUF file")));
    }
    Ok(file)
}

impl GgufFile {
    /// Opens and maps `path`, decoding the header, metadata and tensor infos.
    ///
    /// Errors: [`GgufError`] for I/O failures, a bad magic or version, a
    /// truncated file, unknown value or tensor types, or tensors whose data
    /// lies outside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io { path: path.display().to_string(), source };
        let file = open_file(&path)?;
        // SAFETY: the file is mapped read-only; strata never writes model files while
        // they are mapped. A concurrent external truncation could fault, as with any mmap reader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let first = Self::parse(path, Mapping::One(mmap))?;
        match first.get(split::KEY_COUNT).and_then(|v| v.as_u64()) {
            Some(n) if n > 1 => Self::open_split(first, n as usize),
            _ => Ok(first),
        }
    }

    /// Opens the other parts of the split model whose first part is `first` (`count` parts), checks that they
    /// form its set, and joins them. Errors: [`GgufError::Split`] naming the part (missing, foreign, out of order,
    /// a tensor twice, a tensor count that disagrees), or the part's own parse error.
    fn open_split(first: GgufFile, count: usize) -> Result<GgufFile, GgufError> {
        let fp = first.path.clone();
        let err = |p: &Path, reason: String| GgufError::Split { path: p.display().to_string(), reason };
        let no = first.get(split::KEY_NO).and_then(|v| v.as_u64()).unwrap_or(0);
        if no != 0 {
            return Err(err(
                &fp,
                format!("this is part {} of {count}: open the first part (…-00001-of-{count:05}.gguf)", no + 1),
            ));
        }
        let want = first.get(split::KEY_TENSORS).and_then(|v| v.as_u64());
        let mut parts = vec![first];
        for i in 1..count {
            let p = split::part_path(&fp, i, count).ok_or_else(|| {
                err(&fp, format!("split.count is {count} but the name does not end in -00001-of-{count:05}.gguf"))
            })?;
            if !p.exists() {
                return Err(err(&p, format!("part {} of {count} is missing", i + 1)));
            }
            let part = GgufFile::open_one(&p)?;
            let (pno, pcount) =
                (part.get(split::KEY_NO).and_then(|v| v.as_u64()), part.get(split::KEY_COUNT).and_then(|v| v.as_u64()));
            if pno != Some(i as u64) || pcount != Some(count as u64) {
                let show = |v: Option<u64>, add: u64| v.map_or("missing".to_string(), |v| (v + add).to_string());
                return Err(err(
                    &p,
                    format!(
                        "not part {} of this {count}-part set (it says part {} of {})",
                        i + 1,
                        show(pno, 1),
                        show(pcount, 0)
                    ),
                ));
            }
            parts.push(part);
        }
        let n: usize = parts.iter().map(|p| p.tensors.len()).sum();
        if let Some(w) = want {
            if w != n as u64 {
                return Err(err(
                    &fp,
                    format!("the parts hold {n} tensors, split.tensors.count says {w} (a part of another set?)"),
                ));
            }
        }
        let files: Vec<File> = parts.iter().map(|p| open_file(&p.path)).collect::<Result<_, _>>()?;
        let lens: Vec<(&File, u64)> = files.iter().zip(&parts).map(|(f, p)| (f, p.file_len())).collect();
        let (joined, bases) =
            Joined::map(&lens).map_err(|source| GgufError::Io { path: fp.display().to_string(), source })?;
        let mut tensors = Vec::with_capacity(n);
        let mut tensor_index = HashMap::new();
        let mut part_list = Vec::with_capacity(parts.len());
        for (part, &base) in parts.iter().zip(&bases) {
            for t in &part.tensors {
                if tensor_index.insert(t.name.clone(), tensors.len()).is_some() {
                    return Err(err(&part.path, format!("tensor {:?} is in two parts", t.name)));
                }
                tensors.push(TensorInfo { file_offset: t.file_offset + base, ..t.clone() });
            }
            part_list.push(Part { path: part.path.clone(), base, len: part.file_len() });
        }
        let first = parts.swap_remove(0);
        Ok(GgufFile {
            path: first.path,
            map: Mapping::Joined(joined),
            parts: part_list,
            version: first.version,
            metadata: first.metadata,
            meta_index: first.meta_index,
            tensors,
            tensor_index,
            alignment: first.alignment,
            data_offset: first.data_offset,
        })
    }

    /// Opens one file without following a split.
    fn open_one(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.display().to_string(), source };
        let file = open_file(path)?;
        // SAFETY: as in `open`: mapped read-only, never written while mapped.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), Mapping::One(mmap))
    }

    /// Decodes a GGUF file held in memory (`name` stands for its path in errors and [`GgufFile::path`]), with the
    /// checks of [`GgufFile::open`]; a split model's other parts are not followed (they are files), so a split
    /// header reads as its first part alone. For checking bytes (tests, fuzzing): `path` and the parts name no
    /// real file, so nothing that reads blobs from the file (the expert store's file tier) may use the result.
    /// Errors: as [`GgufFile::open`]'s, without I/O.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(name.into(), Mapping::Owned(bytes))
    }

    fn parse(path: PathBuf, map: Mapping) -> Result<Self, GgufError> {
        let buf: &[u8] = match &map {
            Mapping::One(m) => &m[..],
            Mapping::Owned(v) => v,
            Mapping::Joined(j) => j.bytes(),
        };
        let mut c = Cursor { buf, pos: 0 };
        let magic: [u8; 4] = c.take(4, &|| "magic".into())?.try_into().unwrap();
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32(&|| "version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = c.u64(&|| "tensor count".into())?;
        let n_kv = c.u64(&|| "metadata count".into())?;
        // A tensor info or key/value takes at least 8 bytes.
        for (what, n) in [("tensor infos", n_tensors), ("metadata", n_kv)] {
            let need = n.saturating_mul(8);
            if need > c.len() - c.pos {
                return Err(GgufError::Truncated {
                    what: format!("{what} ({n} entries)"),
                    offset: c.pos,
                    end: c.pos.saturating_add(need),
                    len: c.len(),
                });
            }
        }
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let t_raw = c.u32(&|| format!("metadata key {key:?} type"))?;
            let t = ValueType::from_u32(t_raw)
                .ok_or_else(|| GgufError::UnknownValueType { key: key.clone(), type_id: t_raw })?;
            let v = c.value(t, &key, 0)?;
            if key.is_empty() {
                return Err(GgufError::Duplicate { what: format!("metadata key #{i} is empty") });
            }
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Duplicate { what: format!("metadata key {key:?} appears twice") });
            }
            metadata.push((key, v));
        }
        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                Some(a) => {
                    return Err(GgufError::BadSize {
                        what: "general.alignment (a power of two up to 1 MiB)".into(),
                        value: a,
                    })
                }
                None => {
                    return Err(GgufError::WrongType {
                        key: "general.alignment".into(),
                        expected: "an unsigned integer",
                        found: v.type_name(),
                    })
                }
            },
        };
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor info #{i}"))?;
            let w = || format!("tensor {name:?} info");
            let n_dims = c.u32(&w)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(GgufError::BadTensor {
                    tensor: name,
                    reason: format!("{n_dims} dimensions (expected 1..=4)"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&w)?);
            }
            let type_id = c.u32(&w)?;
            let offset = c.u64(&w)?;
            raw.push((name, dims, type_id, offset));
        }
        let data_offset = c.pos.div_ceil(alignment) * alignment;
        let file_len = c.len();
        if data_offset > file_len && n_tensors > 0 {
            return Err(GgufError::Truncated {
                what: "tensor data section".into(),
                offset: c.pos,
                end: data_offset,
                len: file_len,
            });
        }
        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::new();
        for (name, dims, type_id, offset) in raw {
            let ggml_type = GgmlType::from_u32(type_id)
                .ok_or_else(|| GgufError::UnsupportedTensorType { tensor: name.clone(), type_id })?;
            let n_el = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let n_el = n_el.ok_or_else(|| GgufError::BadTensor {
                tensor: name.clone(),
                reason: format!("dimensions {dims:?} overflow"),
            })?;
            let bs = ggml_type.block_size() as u64;
            if dims[0] % bs != 0 {
                return Err(GgufError::BadTensor {
                    tensor: name,
                    reason: format!(
                        "row length {} is not a multiple of the {:?} block size {}",
                        dims[0], ggml_type, bs
                    ),
                });
            }
            let size_bytes =
                (n_el / bs).checked_mul(ggml_type.type_size() as u64).ok_or_else(|| GgufError::BadTensor {
                    tensor: name.clone(),
                    reason: format!("dimensions {dims:?} give a byte size past 2^64"),
                })?;
            if offset % alignment != 0 {
                return Err(GgufError::BadTensor {
                    tensor: name,
                    reason: format!("offset {offset} is not aligned to {alignment}"),
                });
            }
            let start = data_offset.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(size_bytes));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_len => {
                    if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                        return Err(GgufError::Duplicate { what: format!("tensor {name:?} appears twice") });
                    }
                    tensors.push(TensorInfo { name, dims, ggml_type, file_offset: s, size_bytes });
                }
                _ => {
                    return Err(GgufError::Truncated {
                        what: format!("tensor {name:?} data"),
                        offset: data_offset.saturating_add(offset),
                        end: data_offset.saturating_add(offset).saturating_add(size_bytes),
                        len: file_len,
                    })
                }
            }
        }
        // tensors whose data overlap would alias each other's bytes (one written over the other, or a weight read
        // as another): refused, as llama.cpp does
        let mut by_start: Vec<&TensorInfo> = tensors.iter().filter(|t| t.size_bytes > 0).collect();
        by_start.sort_by_key(|t| t.file_offset);
        for w in by_start.windows(2) {
            if w[1].file_offset < w[0].file_offset + w[0].size_bytes {
                return Err(GgufError::BadTensor {
                    tensor: w[1].name.clone(),
                    reason: format!(
                        "its data (bytes {}..{}) overlaps tensor {:?} (bytes {}..{})",
                        w[1].file_offset,
                        w[1].file_offset + w[1].size_bytes,
                        w[0].name,
                        w[0].file_offset,
                        w[0].file_offset + w[0].size_bytes
                    ),
                });
            }
        }
        let parts = vec![Part { path: path.clone(), base: 0, len: file_len }];
        Ok(GgufFile { path, map, parts, version, metadata, meta_index, tensors, tensor_index, alignment, data_offset })
    }

    /// Path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File length in bytes (all parts' of a split model).
    pub fn file_len(&self) -> u64 {
        self.parts.iter().map(|p| p.len).sum()
    }

    /// The whole mapped file; a split model's parts back to back, each at its [`Part::base`] (zeros between them).
    /// Tensor offsets ([`TensorInfo::file_offset`]) index it.
    pub fn bytes(&self) -> &[u8] {
        match &self.map {
            Mapping::One(m) => &m[..],
            Mapping::Owned(v) => v,
            Mapping::Joined(j) => j.bytes(),
        }
    }

    /// The files the model was read from (one, or a split model's parts in order) and where each lies in
    /// [`GgufFile::bytes`].
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// A metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn req(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType { key: key.to_string(), expected, found: v.type_name() }
    }

    /// A required non-negative integer key. Errors: missing key or wrong type.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.req(key)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, "unsigned integer", v))
    }

    /// A required integer key that must fit in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.get_u64(key)?;
        u32::try_from(v).map_err(|_| GgufError::BadSize { what: key.to_string(), value: v })
    }

    /// A required float (or integer) key.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.req(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "number", v))
    }

    /// A required string key.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.req(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "string", v))
    }

    /// A required array key.
    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        let v = self.req(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, "array", v))
    }

    /// The architecture name (`general.architecture`).
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// A tensor's info, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A required tensor's info.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.to_string()))
    }

    /// Moves the byte ranges `ranges` (offsets into [`GgufFile::bytes`], widened to whole pages) of the file
    /// mapping into the process's own anonymous memory, at the same addresses and with the same bytes, so that a
    /// file truncated or rewritten under the running process no longer reaches them (a read of a truncated
    /// mapped page is a SIGBUS). Memory: the detached pages stop being shared with the page cache (they count
    /// in the process's RSS and cannot be evicted). A model held in memory ([`GgufFile::from_bytes`]) has
    /// nothing to detach. Returns the bytes detached. Errors: a range past the end of [`GgufFile::bytes`]
    /// (nothing is moved), or an anonymous mapping or a move failed (the ranges not yet moved stay mapped from the
    /// file). Aborts the process when a failed move left its pages unmapped and they cannot be mapped again.
    pub fn detach(&self, ranges: &[std::ops::Range<usize>]) -> std::io::Result<usize> {
        if matches!(self.map, Mapping::Owned(_)) {
            return Ok(0);
        }
        let bytes = self.bytes();
        if let Some(r) = ranges.iter().find(|r| r.end > bytes.len()) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("range {r:?} ends past the mapping's {} bytes", bytes.len()),
            ));
        }
        let pg = split::page() as usize;
        // the mapping covers whole pages: the last one's bytes past the end of the file read as zeros
        let end = bytes.len().div_ceil(pg) * pg;
        let mut pages: Vec<(usize, usize)> = ranges
            .iter()
            .filter(|r| r.start < r.end)
            .map(|r| (r.start / pg * pg, (r.end.div_ceil(pg) * pg).min(end)))
            .collect();
        pages.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(pages.len());
        for (a, b) in pages {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        let base = bytes.as_ptr() as *mut nix::libc::c_void;
        let mut done = 0;
        for (a, b) in merged {
            let n = b - a;
            // SAFETY: `base + a .. base + b` lies inside this value's mapping (ranges clamped to its whole pages);
            // the anonymous mapping is new and private. The move (`mremap` with MREMAP_FIXED) replaces the file's
            // pages by pages holding the same bytes in one step, so a concurrent reader of `bytes()` sees the same
            // values before and after (page faults wait on the address space's lock); the destination stays part
            // of the mapping that `Drop` unmaps. A failed move is repaired by mapping the same bytes there again
            // (MAP_FIXED over this value's own range) before any caller can read them.
            unsafe {
                let at = base.cast::<u8>().add(a).cast::<nix::libc::c_void>();
                let anon = nix::libc::mmap(
                    std::ptr::null_mut(),
                    n,
                    nix::libc::PROT_READ | nix::libc::PROT_WRITE,
                    nix::libc::MAP_PRIVATE | nix::libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                if anon == nix::libc::MAP_FAILED {
                    return Err(std::io::Error::last_os_error());
                }
                std::ptr::copy_nonoverlapping(at.cast::<u8>(), anon.cast::<u8>(), n);
                let moved = if nix::libc::mprotect(anon, n, nix::libc::PROT_READ) == 0 {
                    nix::libc::mremap(anon, n, n, nix::libc::MREMAP_MAYMOVE | nix::libc::MREMAP_FIXED, at)
                } else {
                    nix::libc::MAP_FAILED
                };
                if moved == nix::libc::MAP_FAILED {
                    let e = std::io::Error::last_os_error();
                    // a failed MREMAP_FIXED may already have unmapped the destination: map it again with the
                    // copy's bytes (still in `anon`), else no later read of these bytes could be served
                    let again = nix::libc::mmap(
                        at,
                        n,
                        nix::libc::PROT_READ | nix::libc::PROT_WRITE,
                        nix::libc::MAP_PRIVATE | nix::libc::MAP_ANONYMOUS | nix::libc::MAP_FIXED,
                        -1,
                        0,
                    );
                    if again != at {
                        eprintln!(
                            "strata: a failed move ({e}) left model bytes unmapped and they could not be mapped again"
                        );
                        std::process::abort();
                    }
                    std::ptr::copy_nonoverlapping(anon.cast::<u8>(), at.cast::<u8>(), n);
                    nix::libc::mprotect(at, n, nix::libc::PROT_READ);
                    nix::libc::munmap(anon, n);
                    return Err(e);
                }
            }
            done += n;
        }
        Ok(done)
    }

    /// A tensor's bytes (bounds were checked at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.bytes()[t.file_offset as usize..(t.file_offset + t.size_bytes) as usize]
    }
}
