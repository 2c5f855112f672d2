//! Adaptive swaps in the resident RAM mode (`--resident-experts`, seeds 001 and 003): VRAM and RAM hold disjoint
//! experts, so an expert leaving a VRAM slot is copied back into the RAM place the incoming expert leaves.
//!
//! A round is four steps over the store's exchange records ([`Exchange`]):
//! 1. **choose and copy back** — the store planned the swaps; each gets an exchange place
//!    ([`ExchangeRound::reserve`]) and the outgoing expert's slot is copied into it ([`ExchangeRound::copy_back`]);
//! 2. **stage and copy in** — outgoing experts stop being planned for the GPU and are read from their exchange
//!    places ([`ExchangeRound::stage`]); the incoming experts' bytes are copied into the slots
//!    ([`ExchangeRound::copy_in`]);
//! 3. **mark resident and move** — incoming experts are planned for the GPU ([`ExchangeRound::land`]); the
//!    evicted blobs move into the RAM places the incoming ones left ([`ExchangeRound::move_evicted`]);
//! 4. **flip** the RAM copy's offsets ([`ExchangeRound::flip`]).
//!
//! Invariants: a slot is overwritten only after its old expert stopped being planned for the GPU (and the GPU
//! work issued before that is done — the caller orders it); a RAM place is reused only once its expert is planned
//! for the GPU. The blocking tier runs the four steps at once ([`ExchangeRound::run_blocking`]); the CUDA backend's
//! asynchronous tier advances them between windows, the copies on a helper thread. The slot memory is reached
//! through [`SlotCopier`]: the GPU's copy stream, or [`HostSlots`] (host memory) where tests check the
//! bookkeeping without a GPU.

use std::sync::Mutex;

use super::policy::Swap;
use super::store::{Exchange, ExchangeError, ExpertStore};

/// Copies between the slots of a VRAM expert cache and host memory, in the order queued.
pub trait SlotCopier {
    /// Why a copy failed.
    type Error: std::fmt::Display;

    /// Queues a copy of the first `len` bytes of slot `slot` to host memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes and neither read nor written by anyone else until [`SlotCopier::sync`]
    /// returns.
    unsafe fn copy_out(&self, slot: u32, dst: *mut u8, len: usize) -> Result<(), Self::Error>;

    /// Queues a copy of `len` bytes of host memory at `src` into slot `slot`.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes and not written until [`SlotCopier::sync`] returns.
    unsafe fn copy_in(&self, slot: u32, src: *const u8, len: usize) -> Result<(), Self::Error>;

    /// Waits until every queued copy is done.
    fn sync(&self) -> Result<(), Self::Error>;
}

/// A slot arena in host memory: `n` slots of `slot_bytes` (the test stand-in for the VRAM cache; copies are
/// done at once).
pub struct HostSlots {
    bytes: Mutex<Vec<u8>>,
    slot_bytes: usize,
}

impl HostSlots {
    /// `n` zeroed slots of `slot_bytes` bytes.
    pub fn new(n: usize, slot_bytes: usize) -> HostSlots {
        HostSlots { bytes: Mutex::new(vec![0; n * slot_bytes]), slot_bytes }
    }

    /// The first `len` bytes of slot `slot`.
    pub fn slot(&self, slot: u32, len: usize) -> Vec<u8> {
        let b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let o = slot as usize * self.slot_bytes;
        b[o..o + len].to_vec()
    }

    /// Fills the store's VRAM tier the way the GPU cache does at start: `n` slots in placement order, each with
    /// its expert's file bytes.
    pub fn fill(&self, store: &ExpertStore) {
        store.init_slots(self.n_slots());
        self.fill_layers(store, 0..store.layout().n_layer());
    }

    /// Slots of the arena.
    pub fn n_slots(&self) -> usize {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner()).len() / self.slot_bytes.max(1)
    }

    /// [`HostSlots::fill`] for one stage of a layer split (the store's stages already initialised,
    /// [`ExpertStore::init_slot_stages`]): the hottest experts of `layers` only.
    pub fn fill_layers(&self, store: &ExpertStore, layers: std::ops::Range<usize>) {
        let n = self.n_slots();
        let mut blob = Vec::new();
        let order = store.placement_order().into_iter().filter(|(l, _)| layers.contains(l));
        for (l, e) in order.take(n) {
            // the arena may hold more slots than the stage was given
            let Some(slot) = store.reserve_slot(l) else { break };
            store.read_blob_simple(l, e, &mut blob).expect("blob read");
            // SAFETY: `blob` lives across the copy, which is done at once.
            unsafe { self.copy_in(slot, blob.as_ptr(), blob.len()) }.expect("host copy");
            store.admit_slot(l, e, slot);
        }
    }
}

/// A host slot copy out of range.
#[derive(Debug, thiserror::Error)]
#[error("host slot {0}: {1} bytes do not fit")]
pub struct HostSlotError(u32, usize);

impl SlotCopier for HostSlots {
    type Error = HostSlotError;

    unsafe fn copy_out(&self, slot: u32, dst: *mut u8, len: usize) -> Result<(), HostSlotError> {
        if len > self.slot_bytes {
            return Err(HostSlotError(slot, len));
        }
        let b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let o = slot as usize * self.slot_bytes;
        let src = b.get(o..o + len).ok_or(HostSlotError(slot, len))?;
        // SAFETY: the caller guarantees `dst` is valid for `len` bytes and unshared; `src` is our own memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len) };
        Ok(())
    }

    unsafe fn copy_in(&self, slot: u32, src: *const u8, len: usize) -> Result<(), HostSlotError> {
        if len > self.slot_bytes {
            return Err(HostSlotError(slot, len));
        }
        let mut b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let o = slot as usize * self.slot_bytes;
        let dst = b.get_mut(o..o + len).ok_or(HostSlotError(slot, len))?;
        // SAFETY: the caller guarantees `src` is valid for `len` bytes; `dst` is our own memory.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), len) };
        Ok(())
    }

    fn sync(&self) -> Result<(), HostSlotError> {
        Ok(())
    }
}

/// Where a round stands (each step's name is the last one done).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Exchanges reserved; nothing copied.
    Reserved,
    /// Copy-backs queued (landed once the copier synced).
    CopiedBack,
    /// Outgoing experts read from their exchange places.
    Staged,
    /// Copy-ins queued.
    CopiedIn,
    /// Incoming experts planned for the GPU.
    Landed,
    /// Evicted blobs moved into the vacated places.
    Moved,
}

/// One adaptive round in the resident mode: its exchanges and the step reached.
pub struct ExchangeRound {
    xs: Vec<Exchange>,
    step: Step,
    /// Blobs of file-tier incoming experts, kept alive until their copies are done.
    file_blobs: Vec<Vec<u8>>,
}

impl ExchangeRound {
    /// Step 1 (choose): reserves an exchange for each planned swap that evicts an expert, in plan order. Swaps that
    /// find no free exchange place wait for a later round (usage carries them); swaps into empty slots are not
    /// exchanges (the caller fills those as in the other modes) and are returned apart. Refusals other than a
    /// full exchange pool are logged at debug level and skipped.
    pub fn reserve(store: &ExpertStore, plan: &[Swap]) -> (ExchangeRound, Vec<Swap>) {
        let mut xs = Vec::new();
        let mut fills = Vec::new();
        for sw in plan {
            let Some(out) = sw.outgoing else {
                fills.push(*sw);
                continue;
            };
            match store.reserve_exchange(sw.layer, out, sw.incoming) {
                Ok(x) => xs.push(x),
                Err(ExchangeError::NoPlace) => break,
                Err(e) => tracing::debug!("swap skipped: {e}"),
            }
        }
        (ExchangeRound { xs, step: Step::Reserved, file_blobs: Vec::new() }, fills)
    }

    /// The round's exchanges.
    pub fn exchanges(&self) -> &[Exchange] {
        &self.xs
    }

    /// The last step done.
    pub fn step(&self) -> Step {
        self.step
    }

    /// Whether the round has no exchange.
    pub fn is_empty(&self) -> bool {
        self.xs.is_empty()
    }

    /// Step 1 (copy back): queues each outgoing expert's slot → its exchange place. The slots are only read, so
    /// the GPU may still compute from them. The exchange places must not be read by earlier GPU work still in
    /// flight (the caller orders the copier after it). Errors: the copier's; the caller then [`Self::cancel`]s.
    pub fn copy_back<C: SlotCopier>(&mut self, store: &ExpertStore, c: &C) -> Result<(), C::Error> {
        assert_eq!(self.step, Step::Reserved);
        for x in &self.xs {
            let len = store.layout().layers[x.layer].blob_bytes();
            // SAFETY: a reserved exchange place is nobody's RAM place until `stage` makes it the outgoing
            // expert's, and the copier is synced before `stage` (so before anyone reads it).
            unsafe { c.copy_out(x.slot, store.place_ptr(x.buffer, len), len)? };
        }
        self.step = Step::CopiedBack;
        Ok(())
    }

    /// Step 2 (stage), after the copy-backs landed: outgoing experts stop being planned for the GPU and are read
    /// from their exchange places. Their slots may be overwritten once the GPU work issued before this call is done.
    pub fn stage(&mut self, store: &ExpertStore) {
        assert_eq!(self.step, Step::CopiedBack);
        for x in &self.xs {
            store.stage_exchange(x);
        }
        self.step = Step::Staged;
    }

    /// Step 2 (copy in): queues each incoming expert's bytes → its slot: from its RAM place, else read from the file
    /// (kept by the round until the copies are done). Call once the GPU work that could read the outgoing experts'
    /// slots is done (the copier ordered after it). Errors: a blob read or the copier; the caller then
    /// [`Self::cancel`]s.
    pub fn copy_in<C: SlotCopier>(&mut self, store: &ExpertStore, c: &C) -> Result<(), String> {
        assert_eq!(self.step, Step::Staged);
        for x in &self.xs {
            let len = store.layout().layers[x.layer].blob_bytes();
            let src = match x.vacated {
                Some(off) => store.place_ptr(off, len) as *const u8,
                None => {
                    let mut b = Vec::new();
                    store
                        .read_blob_simple(x.layer, x.incoming, &mut b)
                        .map_err(|e| format!("blob read of ({}, {}): {e}", x.layer, x.incoming))?;
                    self.file_blobs.push(b);
                    self.file_blobs.last().expect("pushed").as_ptr()
                }
            };
            // SAFETY: the incoming expert's place is not written before its copy lands (RAM adapt is refused while
            // exchanges are reserved; the move into it comes after `land`); file blobs live in the round.
            unsafe { c.copy_in(x.slot, src, len) }.map_err(|e| e.to_string())?;
        }
        self.step = Step::CopiedIn;
        Ok(())
    }

    /// Step 3 (mark resident), after the copy-ins landed: incoming experts are planned for the GPU.
    pub fn land(&mut self, store: &ExpertStore) {
        assert_eq!(self.step, Step::CopiedIn);
        self.file_blobs.clear();
        for x in &self.xs {
            store.land_exchange(x);
        }
        self.step = Step::Landed;
    }

    /// Step 3 (move): copies each evicted blob from its exchange place into the RAM place its incoming expert
    /// left. Call once the work planned before [`Self::land`] that reads those places (CPU experts, PCIe uploads)
    /// is done; windows may run meanwhile. Takes `&self`: a helper thread may do it.
    pub fn move_evicted(&self, store: &ExpertStore) {
        assert_eq!(self.step, Step::Landed);
        for x in &self.xs {
            store.move_evicted(x);
        }
    }

    /// Marks the move done (after [`Self::move_evicted`] returned, on whichever thread).
    pub fn moved(&mut self) {
        assert_eq!(self.step, Step::Landed);
        self.step = Step::Moved;
    }

    /// Step 4 (flip): outgoing experts take the vacated places, the exchange places are freed. Returns the swaps
    /// done.
    pub fn flip(self, store: &ExpertStore) -> usize {
        assert_eq!(self.step, Step::Moved);
        let n = self.xs.len();
        for x in self.xs {
            store.flip_exchange(x);
        }
        n
    }

    /// Gives up a round whose copy failed, leaving the store consistent ([`ExpertStore::cancel_exchange`]). After
    /// `land` nothing can fail: a landed round is finished with `move_evicted` and `flip`.
    pub fn cancel(self, store: &ExpertStore) {
        assert!(matches!(self.step, Step::Reserved | Step::CopiedBack | Step::Staged | Step::CopiedIn));
        let staged = matches!(self.step, Step::Staged | Step::CopiedIn);
        for x in self.xs {
            store.cancel_exchange(x, staged);
        }
    }

    /// The blocking tier: every step at once, waiting for the copier between them. The caller has waited for the
    /// GPU work issued before (no window in flight). Returns the swaps done and the planned fills of empty slots
    /// (not exchanges); on a copy error the round is cancelled and the error returned.
    pub fn run_blocking<C: SlotCopier>(
        store: &ExpertStore,
        plan: &[Swap],
        c: &C,
    ) -> Result<(usize, Vec<Swap>), String> {
        let (r, fills) = ExchangeRound::reserve(store, plan);
        Ok((r.complete(store, c)?, fills))
    }

    /// Runs a reserved round's remaining steps at once (blocking), waiting for the copier between them. Returns
    /// the swaps done; on a copy error the round is cancelled and the error returned.
    pub fn complete<C: SlotCopier>(mut self, store: &ExpertStore, c: &C) -> Result<usize, String> {
        if self.is_empty() {
            return Ok(0);
        }
        let synced = |r: Result<(), String>| r.and_then(|_| c.sync().map_err(|e| e.to_string()));
        if let Err(e) = synced(self.copy_back(store, c).map_err(|e| e.to_string())) {
            self.cancel(store);
            return Err(e);
        }
        self.stage(store);
        if let Err(e) = synced(self.copy_in(store, c)) {
            self.cancel(store);
            return Err(e);
        }
        self.land(store);
        self.move_evicted(store);
        self.moved();
        Ok(self.flip(store))
    }
}
