//! Blob reads from the GGUF file (the file tier): `pread(2)` through the page cache (`buffered`), or `O_DIRECT`
//! reads of 4 KiB-aligned windows into an aligned buffer (`direct`), falling back to buffered reads with one
//! message when the file system refuses `O_DIRECT`.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::gguf::split::Part;
use std::sync::atomic::{AtomicBool, Ordering};

/// How blobs are read (`--file-io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FileIo {
    /// `pread` through the page cache.
    #[default]
    Buffered,
    /// `O_DIRECT` with aligned buffers (bypasses the page cache).
    Direct,
}

impl std::str::FromStr for FileIo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "buffered" => Ok(FileIo::Buffered),
            "direct" => Ok(FileIo::Direct),
            _ => Err(format!("--file-io must be buffered or direct, got {s:?}")),
        }
    }
}

/// Alignment of `O_DIRECT` offsets, lengths and buffers (bytes).
pub const DIRECT_ALIGN: usize = 4096;

/// One file of a [`BlobReader`]: its range in the model's offsets and its handles.
struct PartFile {
    base: u64,
    len: u64,
    buffered: File,
    direct: Option<File>,
}

/// Reads byte ranges of a model file, or of a split model's parts by their joined offsets
/// ([`crate::gguf::split`]).
pub struct BlobReader {
    parts: Vec<PartFile>,
    direct_failed: AtomicBool,
}

impl BlobReader {
    /// Opens `path` for reads in `mode`. Errors: the file cannot be opened. A refused `O_DIRECT` open is not an
    /// error: reads are buffered and a warning says so.
    pub fn open(path: &Path, mode: FileIo) -> std::io::Result<BlobReader> {
        BlobReader::open_parts(&[Part { path: path.to_path_buf(), base: 0, len: u64::MAX }], mode)
    }

    /// Opens every part (a read at a model offset goes to the part whose range holds it). Errors: a part cannot
    /// be opened.
    pub fn open_parts(parts: &[Part], mode: FileIo) -> std::io::Result<BlobReader> {
        let mut files = Vec::with_capacity(parts.len());
        for p in parts {
            let (buffered, direct) = open_file(&p.path, mode)?;
            files.push(PartFile { base: p.base, len: p.len, buffered, direct });
        }
        Ok(BlobReader { parts: files, direct_failed: AtomicBool::new(false) })
    }

    /// Whether reads use `O_DIRECT` now.
    pub fn is_direct(&self) -> bool {
        self.parts.iter().all(|p| p.direct.is_some()) && !self.direct_failed.load(Ordering::Relaxed)
    }

    /// Fills `out` with the model's bytes at `offset` (a range inside one part). `scratch` is reused between calls
    /// for direct reads. Errors: the read failed, hit the end of the file, or crosses a part boundary.
    pub fn read_at(&self, offset: u64, out: &mut [u8], scratch: &mut AlignedBuf) -> std::io::Result<()> {
        let p = self
            .parts
            .iter()
            .find(|p| offset >= p.base && offset - p.base < p.len)
            .ok_or_else(|| std::io::Error::other(format!("offset {offset} lies in no part of the model")))?;
        if (offset - p.base).saturating_add(out.len() as u64) > p.len {
            return Err(std::io::Error::other(format!("a read at {offset} crosses the end of its part")));
        }
        self.read_part(p, offset - p.base, out, scratch)
    }

    fn read_part(&self, p: &PartFile, offset: u64, out: &mut [u8], scratch: &mut AlignedBuf) -> std::io::Result<()> {
        if let (Some(f), false) = (&p.direct, self.direct_failed.load(Ordering::Relaxed)) {
            let start = offset & !(DIRECT_ALIGN as u64 - 1);
            let end = (offset + out.len() as u64).div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64;
            let win = (end - start) as usize;
            let buf = scratch.get(win);
            match read_direct(f, start, buf) {
                Ok(got) if got >= (offset - start) as usize + out.len() => {
                    let s = (offset - start) as usize;
                    out.copy_from_slice(&buf[s..s + out.len()]);
                    return Ok(());
                }
                Ok(_) => return Err(past_end(offset + out.len() as u64)),
                Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
                    if !self.direct_failed.swap(true, Ordering::Relaxed) {
                        tracing::warn!("O_DIRECT read refused ({e}); blob reads are buffered from now on");
                    }
                }
                Err(e) => return Err(e),
            }
        }
        p.buffered.read_exact_at(out, offset).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => past_end(offset + out.len() as u64),
            _ => e,
        })
    }
}

/// The error of a read that the end of the file cut short (`end`: the byte the read needed to reach).
fn past_end(end: u64) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("the file ends before byte {end} (truncated?)"))
}

/// Opens `path` buffered and, for `--file-io direct`, with `O_DIRECT` (a refusal is not an error: reads are
/// buffered and a warning says so).
fn open_file(path: &Path, mode: FileIo) -> std::io::Result<(File, Option<File>)> {
    let buffered = File::open(path)?;
    let direct = match mode {
        FileIo::Buffered => None,
        FileIo::Direct => match std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_DIRECT).open(path) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!("--file-io direct: {} refuses O_DIRECT ({e}); blob reads are buffered", path.display());
                None
            }
        },
    };
    Ok((buffered, direct))
}

/// Reads until `buf` is full or the end of the file; returns the bytes read.
fn read_direct(f: &File, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if done % DIRECT_ALIGN != 0 {
            break; // a short read ends at the end of the file
        }
    }
    Ok(done)
}

/// A growable buffer whose start is aligned to [`DIRECT_ALIGN`] bytes.
#[derive(Default)]
pub struct AlignedBuf {
    raw: Vec<u8>,
}

impl AlignedBuf {
    /// An aligned slice of `len` bytes (contents unspecified).
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if self.raw.len() < len + DIRECT_ALIGN {
            self.raw.resize(len + DIRECT_ALIGN, 0);
        }
        let off = self.raw.as_ptr().align_offset(DIRECT_ALIGN);
        &mut self.raw[off..off + len]
    }
}
