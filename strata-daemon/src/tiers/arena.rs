//! The resident RAM copy's memory: one anonymous, page-aligned host mapping of blob places, locked in memory with
//! `mlock(2)` when `RLIMIT_MEMLOCK` allows it, otherwise left pageable with one warning that says how to raise
//! the limit.

use std::num::NonZeroUsize;
use std::ptr::NonNull;

use nix::sys::mman::{madvise, mlock, mmap_anonymous, munlock, munmap, MapFlags, MmapAdvise, ProtFlags};
use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};

/// Whether the arena is locked in RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// `mlock` succeeded: the pages never go to swap.
    Locked,
    /// Pageable: the limit was too low or `mlock` failed (the reason was logged once).
    Pageable,
    /// Nothing to lock (empty arena).
    Empty,
}

/// A zero-filled host memory region of `len` bytes (page-aligned), unmapped on drop.
pub struct HostArena {
    ptr: NonNull<u8>,
    len: usize,
    lock: Lock,
}

// SAFETY: the arena is plain memory owned by this value; access is coordinated by its owner (the expert store).
unsafe impl Send for HostArena {}
// SAFETY: as above; shared references only read through `as_slice`, writes need `&mut self` or the store's rules.
unsafe impl Sync for HostArena {}

impl HostArena {
    /// Maps `len` bytes and tries to lock them (`try_lock`). Errors: the mapping failed (out of memory).
    pub fn new(len: usize, try_lock: bool) -> std::io::Result<HostArena> {
        let Some(nz) = NonZeroUsize::new(len) else {
            return Ok(HostArena { ptr: NonNull::dangling(), len: 0, lock: Lock::Empty });
        };
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            mmap_anonymous(None, nz, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_PRIVATE)
                .map_err(std::io::Error::from)?
        };
        // transparent huge pages where the kernel allows them (`madvise` mode included): the pool streams
        // gigabytes of expert weights from here, and 4 KiB pages cost it TLB misses (H200 host, Qwen3-30B-A3B
        // geometry, CPU experts: 11.7 -> 10.4 ms per token). `STRATA_ARENA_THP=0` leaves the default pages.
        if std::env::var_os("STRATA_ARENA_THP").is_none_or(|v| v != "0") {
            // SAFETY: advice on this fresh mapping only.
            if let Err(e) = unsafe { madvise(p, len, MmapAdvise::MADV_HUGEPAGE) } {
                tracing::debug!("MADV_HUGEPAGE on the RAM copy: {e}");
            }
        }
        let mut a = HostArena { ptr: p.cast(), len, lock: Lock::Pageable };
        if try_lock {
            a.lock = a.try_lock();
        }
        Ok(a)
    }

    fn try_lock(&self) -> Lock {
        let mib = self.len as f64 / (1024.0 * 1024.0);
        match getrlimit(Resource::RLIMIT_MEMLOCK) {
            Ok((soft, _)) if soft != RLIM_INFINITY && (soft as u128) < self.len as u128 => {
                tracing::warn!(
                    "resident RAM copy ({mib:.0} MiB) stays pageable: RLIMIT_MEMLOCK is {} KiB; raise it with \
                     `ulimit -l unlimited` (shell) or `LimitMEMLOCK=infinity` (systemd unit) to lock it in RAM",
                    soft / 1024
                );
                return Lock::Pageable;
            }
            _ => {}
        }
        // SAFETY: the range is this arena's own mapping.
        match unsafe { mlock(self.ptr.cast(), self.len) } {
            Ok(()) => Lock::Locked,
            Err(e) => {
                tracing::warn!(
                    "resident RAM copy ({mib:.0} MiB) stays pageable: mlock failed ({e}); raise the memlock limit \
                     (`ulimit -l unlimited`, or `LimitMEMLOCK=infinity` in the systemd unit)"
                );
                Lock::Pageable
            }
        }
    }

    /// Start address (stable for the arena's life; for page-locking it with the GPU driver).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lock state.
    pub fn lock(&self) -> Lock {
        self.lock
    }

    /// `len` bytes at `off`. Panics when out of range.
    pub fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "arena range out of bounds");
        if len == 0 {
            return &[];
        }
        // SAFETY: in bounds (checked above) of a live mapping owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// Mutable `len` bytes at `off`. Panics when out of range.
    pub fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "arena range out of bounds");
        if len == 0 {
            return &mut [];
        }
        // SAFETY: in bounds of a live mapping owned by self; `&mut self` excludes other borrows.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: unlocking and unmapping this arena's own mapping, which no borrow outlives (they borrow self).
        unsafe {
            if self.lock == Lock::Locked {
                let _ = munlock(self.ptr.cast(), self.len);
            }
            let _ = munmap(self.ptr.cast(), self.len);
        }
    }
}
