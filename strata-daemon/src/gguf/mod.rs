//! GGUF container: reader over a memory map (with every offset checked against
//! the file length; split models joined, [`split`]) and a small writer for fixtures and tests.
//!
//! Format source: the GGUF specification in the ggml repository
//! (`docs/gguf.md`): magic `GGUF`, u32 version (2 or 3), u64 tensor count,
//! u64 metadata count, metadata key/values, tensor infos, padding to
//! `general.alignment` (default 32), tensor data. All integers little-endian.

mod reader;
pub mod split;
mod value;
pub mod writer;

pub use reader::{GgufFile, TensorInfo};
pub use value::{Value, ValueType};

/// Default alignment of the tensor data section and of each tensor, in bytes.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Errors from reading a GGUF file. Each names the key, tensor or offset involved.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot open {path}: {source}")]
    Io {
        /// Path of the file.
        path: String,
        /// Underlying OS error.
        source: std::io::Error,
    },
    /// A split model's parts do not form one set (a part missing, foreign or out of order).
    #[error("split GGUF {path}: {reason}")]
    Split {
        /// The part (or the first part) concerned.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file (magic {0:02x?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    /// GGUF version other than 2 or 3.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// A read ran past the end of the file.
    #[error("file truncated: {what} needs bytes {offset}..{end} but the file has {len} bytes")]
    Truncated {
        /// What was being read.
        what: String,
        /// Start offset in bytes.
        offset: u64,
        /// End offset in bytes (exclusive).
        end: u64,
        /// File length in bytes.
        len: u64,
    },
    /// A metadata value has a type id outside the specification.
    #[error("metadata key {key:?}: unknown value type {type_id}")]
    UnknownValueType {
        /// Metadata key.
        key: String,
        /// Raw type id.
        type_id: u32,
    },
    /// A string is not valid UTF-8.
    #[error("{what}: invalid UTF-8 string")]
    BadString {
        /// Which key or tensor name.
        what: String,
    },
    /// A count or size is implausible (would overflow or exceed the file).
    #[error("{what}: implausible size {value}")]
    BadSize {
        /// What was being read.
        what: String,
        /// The offending value.
        value: u64,
    },
    /// A tensor has a type id we cannot read.
    #[error("tensor {tensor:?}: unsupported tensor type {type_id}")]
    UnsupportedTensorType {
        /// Tensor name.
        tensor: String,
        /// Raw GGML type id.
        type_id: u32,
    },
    /// A tensor's shape does not fit its type's block size.
    #[error("tensor {tensor:?}: {reason}")]
    BadTensor {
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A metadata key or tensor name appears twice, or a key is empty (the last one would silently win).
    #[error("{what}")]
    Duplicate {
        /// What repeats.
        what: String,
    },
    /// A required metadata key is missing.
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),
    /// A metadata key has the wrong type.
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        /// Metadata key.
        key: String,
        /// Expected type.
        expected: &'static str,
        /// Found type.
        found: String,
    },
    /// A tensor the model needs is missing.
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
}
