//! Split GGUF files (llama.cpp's `gguf-split`): a model stored as `<prefix>-00001-of-0000N.gguf` …
//! `<prefix>-0000N-of-0000N.gguf`, each part a GGUF file of its own whose tensor infos name the tensors it holds;
//! the first part carries the model's metadata, every part the keys `split.no` (u16, 0-based), `split.count` (u16)
//! and, in the first, `split.tensors.count` (i32, all parts' tensors). Opening the first part opens the set: the
//! parts are mapped back to back into one contiguous read-only range ([`Joined`]), each at a page-aligned base, so
//! every tensor keeps one offset into [`super::GgufFile::bytes`] whichever part holds it.

use std::fs::File;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use nix::sys::mman::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};

/// `split.no`, `split.count`, `split.tensors.count` (llama.cpp's `LLM_KV_SPLIT_*`).
pub const KEY_NO: &str = "split.no";
/// See [`KEY_NO`].
pub const KEY_COUNT: &str = "split.count";
/// See [`KEY_NO`].
pub const KEY_TENSORS: &str = "split.tensors.count";

/// One part of a (possibly single-part) model file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Where it was opened from.
    pub path: PathBuf,
    /// Offset of its first byte in the joined range.
    pub base: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// The path of part `no` (0-based) of `count` beside `first`, the first part's path, by llama.cpp's naming
/// (`<prefix>-%05d-of-%05d.gguf`). `None` when `first` does not end in `-00001-of-<count>.gguf`.
pub fn part_path(first: &Path, no: usize, count: usize) -> Option<PathBuf> {
    let name = first.file_name()?.to_str()?;
    let suffix = format!("-{:05}-of-{:05}.gguf", 1, count);
    let prefix = name.strip_suffix(&suffix)?;
    Some(first.with_file_name(format!("{prefix}-{:05}-of-{:05}.gguf", no + 1, count)))
}

/// The parts mapped back to back into one anonymous reservation (readable zeros between them); unmapped on drop.
pub struct Joined {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a read-only mapping owned by this value; shared references only read it.
unsafe impl Send for Joined {}
// SAFETY: as above.
unsafe impl Sync for Joined {}

/// The system's page size in bytes (4096 when it cannot be read).
pub(crate) fn page() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { nix::libc::sysconf(nix::libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

impl Joined {
    /// Maps `files` (open, with their lengths) at page-aligned bases one after the other. Returns the mapping and
    /// each file's base. Errors: the reservation or a mapping failed.
    pub fn map(files: &[(&File, u64)]) -> std::io::Result<(Joined, Vec<u64>)> {
        let pg = page();
        let mut bases = Vec::with_capacity(files.len());
        let mut end = 0u64;
        for &(_, len) in files {
            bases.push(end);
            end = (end + len).div_ceil(pg) * pg;
        }
        let total = NonZeroUsize::new(end.max(pg) as usize).expect("non-zero");
        // SAFETY: a fresh private anonymous reservation; no existing memory is touched.
        let base = unsafe { mmap_anonymous(None, total, ProtFlags::PROT_READ, MapFlags::MAP_PRIVATE) }
            .map_err(std::io::Error::from)?;
        let joined = Joined { ptr: base.cast(), len: total.get() };
        for (&(f, len), &b) in files.iter().zip(&bases) {
            let Some(n) = NonZeroUsize::new(len as usize) else { continue };
            // SAFETY: the target range [base + b, base + b + len) lies inside the reservation made above (b + len
            // ≤ end ≤ total), which this value owns; MAP_FIXED replaces only those reserved pages.
            let at = unsafe { joined.ptr.as_ptr().add(b as usize) };
            let addr = NonZeroUsize::new(at as usize).expect("mapped address");
            // SAFETY: as above; the file is mapped read-only and private.
            unsafe { mmap(Some(addr), n, ProtFlags::PROT_READ, MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED, f, 0) }
                .map_err(std::io::Error::from)?;
        }
        Ok((joined, bases))
    }

    /// The whole range (parts and the zero bytes between them).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the reservation is `len` readable bytes owned by self for its lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        // SAFETY: unmapping the reservation this value made (the parts' fixed mappings lie inside it); no borrow
        // outlives self.
        unsafe {
            let _ = munmap(self.ptr.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_named_as_llama_cpp_names_them() {
        let first = Path::new("/m/Qwen3-235B-A22B-Q4_K_M-00001-of-00003.gguf");
        assert_eq!(part_path(first, 2, 3).unwrap(), Path::new("/m/Qwen3-235B-A22B-Q4_K_M-00003-of-00003.gguf"));
        assert_eq!(part_path(first, 0, 3).unwrap(), first);
        assert!(part_path(Path::new("/m/model.gguf"), 1, 3).is_none());
        assert!(part_path(first, 1, 4).is_none(), "the count in the name must match split.count");
    }
}
