//! Minimal GGUF v3 writer, used by fixture builders and tests (synthetic and
//! corrupt files, MoE files assembled from dense ones).

use super::value::{Value, ValueType};
use super::DEFAULT_ALIGNMENT;
use crate::quant::GgmlType;

/// A tensor to write: name, GGML-order dims, type and its raw bytes.
#[derive(Debug, Clone)]
pub struct WriteTensor {
    /// Tensor name.
    pub name: String,
    /// Dimensions in GGML order (`dims[0]` contiguous).
    pub dims: Vec<u64>,
    /// Element / block format.
    pub ggml_type: GgmlType,
    /// Raw data; its length must match dims and type.
    pub data: Vec<u8>,
}

/// Builds a GGUF v3 file in memory.
#[derive(Debug, Default)]
pub struct GgufWriter {
    /// Metadata in write order.
    pub metadata: Vec<(String, Value)>,
    /// Tensors in write order.
    pub tensors: Vec<WriteTensor>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(t, items) => {
            out.extend_from_slice(&(*t as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it);
            }
        }
    }
}

impl GgufWriter {
    /// Adds (or replaces) a metadata key.
    pub fn set(&mut self, key: &str, v: Value) {
        if let Some(e) = self.metadata.iter_mut().find(|(k, _)| k == key) {
            e.1 = v;
        } else {
            self.metadata.push((key.to_string(), v));
        }
    }

    /// Adds a tensor.
    pub fn add_tensor(&mut self, name: &str, dims: Vec<u64>, ggml_type: GgmlType, data: Vec<u8>) {
        self.tensors.push(WriteTensor { name: name.to_string(), dims, ggml_type, data });
    }

    /// The header of a file whose tensors (in `self.tensors`, data left empty) have `sizes` bytes: returns the
    /// header padded to the data section and each tensor's offset from the data section's start. Used to
    /// stream files too large to build in memory.
    pub fn header_for(&self, sizes: &[u64]) -> (Vec<u8>, Vec<u64>) {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut out, v);
        }
        let a = DEFAULT_ALIGNMENT;
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (t, &size) in self.tensors.iter().zip(sizes) {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&(t.ggml_type as u32).to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + size).div_ceil(a) * a;
        }
        let data_start = (out.len() as u64).div_ceil(a) * a;
        out.resize(data_start as usize, 0);
        (out, offsets)
    }

    /// Serializes the file (GGUF v3, alignment 32).
    pub fn to_bytes(&self) -> Vec<u8> {
        let sizes: Vec<u64> = self.tensors.iter().map(|t| t.data.len() as u64).collect();
        let (mut out, offsets) = self.header_for(&sizes);
        let data_start = out.len() as u64;
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }
}

/// Shorthand for a string-array metadata value.
pub fn string_array<I: IntoIterator<Item = S>, S: Into<String>>(items: I) -> Value {
    Value::Array(ValueType::String, items.into_iter().map(|s| Value::String(s.into())).collect())
}
