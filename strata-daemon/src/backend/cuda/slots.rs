//! The VRAM expert cache: one device arena of blob-sized slots (plus staging slots for `--pcie-frac`
//! uploads), its device residency table, and the adaptive tier's data movement — blocking rounds, or
//! asynchronous rounds (`--adapt-async 1`, seed 003) whose copies run on a helper thread between windows.
//!
//! The residency record itself is the expert store's (`ExpertStore::{reserve,admit,evict}_slot`); this module
//! keeps the device copy of it in step and moves the bytes. Invariants (DESIGN.md §5): a slot is overwritten
//! only after its old expert stopped being planned for the GPU and the GPU work issued before that is done
//! (an event on the compute stream orders the copy); an incoming expert is planned for the GPU only after its
//! copy landed; a request starts with the round drained.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::driver::{DevBuf, Device, Event, PinnedBuf, Stream};
use super::GpuError;
use crate::quant::GgmlType;
use crate::tiers::arena::HostArena;
use crate::tiers::exchange::{ExchangeRound, SlotCopier};
use crate::tiers::policy::Swap;
use crate::tiers::store::{ExpertStore, ResidentMode};

/// One expert's copy into a slot.
#[derive(Clone, Copy)]
struct Move {
    layer: usize,
    incoming: usize,
    slot: u32,
}

/// What the helper thread of an asynchronous round reports.
enum Report {
    /// The first n moves' copies are issued and their events recorded.
    Recorded(usize),
    /// Every copy issued (or the round failed after `Recorded` moves).
    Finished(Result<(), GpuError>),
}

/// An asynchronous round in flight. Moves land in order (one copy stream); each has an event, so a landed
/// expert is admitted at the next poll — between windows or at any hybrid layer — not when the whole round is.
struct InFlight {
    moves: Vec<Move>,
    /// One event per move, recorded on the copy stream after its copy (valid once reported `Recorded`).
    events: Vec<Event>,
    /// Moves whose events are recorded.
    recorded: usize,
    /// Moves admitted so far.
    admitted: usize,
    /// The helper's final report, once received.
    finished: Option<Result<(), GpuError>>,
    reports: crossbeam_channel::Receiver<Report>,
    /// The store whose round this is (counted staged until it ends).
    store: Arc<ExpertStore>,
}

/// An asynchronous resident-mode round in flight: the helper thread is doing `phase` (1 copy back, 2 copy in,
/// 3 move the evicted blobs) and sends the round back when done.
struct ExchangeFlight {
    phase: u8,
    reports: crossbeam_channel::Receiver<(ExchangeRound, Result<(), String>)>,
    /// The compute-stream event phase 3 waits on (alive until the helper reports).
    _ready: Option<Arc<Event>>,
    /// The store the round belongs to (to settle it if the cache is dropped with it in flight).
    store: Arc<ExpertStore>,
}

/// Leaves a round the store can keep, whatever step it reached (no GPU work may still touch its slots or places):
/// cancelled before it landed; moved (if not yet) and flipped after.
fn settle_round(store: &ExpertStore, mut round: ExchangeRound) {
    use crate::tiers::exchange::Step;
    match round.step() {
        Step::Landed => {
            round.move_evicted(store);
            round.moved();
            round.flip(store);
        }
        Step::Moved => {
            round.flip(store);
        }
        _ => round.cancel(store),
    }
}

/// The copy stream and slot arena as the tiers' exchange rounds use them.
#[derive(Clone)]
struct StreamCopier {
    copy: Arc<Stream>,
    base: u64,
    slot_bytes: usize,
}

impl SlotCopier for StreamCopier {
    type Error = GpuError;

    unsafe fn copy_out(&self, slot: u32, dst: *mut u8, len: usize) -> Result<(), GpuError> {
        let src = self.base + slot as u64 * self.slot_bytes as u64;
        // SAFETY: the caller keeps `dst` valid and unshared until sync(); the slot lies in the arena.
        unsafe { self.copy.dtoh_raw(dst, src, len) }
    }

    unsafe fn copy_in(&self, slot: u32, src: *const u8, len: usize) -> Result<(), GpuError> {
        let dst = self.base + slot as u64 * self.slot_bytes as u64;
        // SAFETY: the caller keeps `src` valid and unwritten until sync(); the slot lies in the arena.
        unsafe { self.copy.htod_raw(dst, src, len) }
    }

    fn sync(&self) -> Result<(), GpuError> {
        self.copy.sync()
    }
}

/// The VRAM expert cache of one GPU.
pub struct SlotCache {
    /// Slots back to back: `n_slots` cache slots, then `n_staging` staging slots.
    pub slots: DevBuf,
    /// Cache slots.
    pub n_slots: usize,
    /// Staging slots for PCIe-served misses (after the cache slots).
    pub n_staging: usize,
    /// Bytes per slot (the largest layer's blob size rounded up to 256 B).
    pub slot_bytes: usize,
    /// Bytes of the largest layer's blob (the slots and the bounce buffer are sized for it).
    pub blob_bytes: usize,
    /// Blob bytes of each layer (layers differ in mixed-format files such as Q4_K_M, whose `ffn_down_exps` are
    /// Q6_K on some layers): a slot holds its expert's blob at its start.
    pub layer_blob: Arc<Vec<usize>>,
    /// Device residency table: `layer × n_expert + expert` → slot or −1.
    pub table: DevBuf,
    copy: Arc<Stream>,
    bounce: Arc<Mutex<PinnedBuf>>,
    /// Blobs the bounce buffer holds.
    bounce_blobs: usize,
    in_flight: Mutex<Option<InFlight>>,
    exchange: Mutex<Option<ExchangeFlight>>,
    /// The device table lags the store's residency (moves since the last upload). Only the all-in-VRAM path
    /// reads the device table (its top-k builds the groups from it); hybrid layers plan from the store, so
    /// rounds mark it stale instead of uploading it (a synchronous copy per admission, up to one per layer
    /// while an asynchronous round lands) and [`SlotCache::sync_table`] uploads it before such a pass.
    table_stale: std::sync::atomic::AtomicBool,
    /// Asynchronous rounds on (`adapt_async`), and whether they can apply.
    pub async_ok: bool,
    /// The card. Declared last, so dropped last: the slots, streams and staging above are freed while its
    /// context lives.
    dev: Arc<Device>,
}

impl SlotCache {
    /// Allocates `n_slots + n_staging` slots of `slot_bytes` (at least the largest of `layer_blob`, each layer's
    /// blob bytes) and the table for `n_entries` experts.
    pub fn new(
        dev: Arc<Device>,
        n_slots: usize,
        n_staging: usize,
        slot_bytes: usize,
        layer_blob: Arc<Vec<usize>>,
        n_entries: usize,
        async_ok: bool,
    ) -> Result<SlotCache, GpuError> {
        let blob_bytes = layer_blob.iter().copied().max().unwrap_or(0);
        assert!(blob_bytes <= slot_bytes, "a blob larger than a slot");
        let slots = DevBuf::alloc((n_slots + n_staging) * slot_bytes)?;
        let table = DevBuf::from_slice(&vec![-1i32; n_entries])?;
        let bounce_blobs = 8;
        Ok(SlotCache {
            slots,
            n_slots,
            n_staging,
            slot_bytes,
            blob_bytes,
            layer_blob,
            table,
            dev,
            copy: Arc::new(Stream::new()?),
            bounce: Arc::new(Mutex::new(PinnedBuf::alloc(bounce_blobs * blob_bytes)?)),
            bounce_blobs,
            in_flight: Mutex::new(None),
            exchange: Mutex::new(None),
            table_stale: std::sync::atomic::AtomicBool::new(false),
            async_ok,
        })
    }

    /// Device address of slot `i`.
    pub fn slot_addr(&self, i: u32) -> u64 {
        self.slots.at(i as usize * self.slot_bytes)
    }

    /// Uploads the store's residency table (stream-ordered on `s`, then waits).
    pub fn upload_table(&self, store: &ExpertStore, s: &Stream) -> Result<(), GpuError> {
        // cleared before the snapshot: a move admitted meanwhile marks it stale again
        self.table_stale.store(false, Ordering::Release);
        let r = s.htod_sync(self.table.ptr, &store.slot_table());
        if r.is_err() {
            self.table_stale.store(true, Ordering::Release);
        }
        r
    }

    /// Uploads the residency table if a round changed it since the last upload; called before a pass that reads
    /// it (all experts in VRAM). No kernel that reads the table may be in flight on another stream.
    pub fn sync_table(&self, store: &ExpertStore, s: &Stream) -> Result<(), GpuError> {
        if self.table_stale.load(Ordering::Acquire) {
            self.upload_table(store, s)?;
        }
        Ok(())
    }

    /// Fills the cache hottest-first (profile order) at start with experts of `layers` (every layer without a
    /// split; the store's slots of this stage were just initialised, [`ExpertStore::init_slot_stages`]): each
    /// expert's bytes from the RAM copy, else the file. Returns how many experts it placed. Reads slot 0 back and
    /// compares it byte for byte.
    pub fn fill(&self, store: &ExpertStore, s: &Stream, layers: std::ops::Range<usize>) -> Result<usize, GpuError> {
        let order = store.placement_order();
        let mut placed = 0;
        let mut first: Option<Vec<u8>> = None;
        for &(l, e) in order.iter().filter(|(l, _)| layers.contains(l)).take(self.n_slots) {
            let slot = store.reserve_slot(l).expect("free slot");
            let bytes = blob_of(store, l, e)?;
            s.htod_sync(self.slot_addr(slot), &bytes)?;
            if first.is_none() {
                first = Some(bytes);
            }
            store.admit_slot(l, e, slot);
            placed += 1;
        }
        if let Some(b) = first {
            // slot 0 got the first expert (free list pops slot 0 first)
            let mut back = vec![0u8; b.len()];
            s.dtoh_sync(&mut back, self.slot_addr(0))?;
            if back != b {
                return Err(GpuError::Unsupported("VRAM slot 0 read back differs from its expert's bytes".into()));
            }
        }
        self.upload_table(store, s)?;
        Ok(placed)
    }

    /// Reads every occupied slot back and compares it with its expert's file bytes (the store's residency says
    /// which expert each slot holds). Returns one line per slot that differs. Reads the whole cache: a check for
    /// tests and benchmarks (no round may be in flight; `s` is idle after it).
    pub fn verify(
        &self,
        store: &ExpertStore,
        s: &Stream,
        layers: std::ops::Range<usize>,
    ) -> Result<Vec<String>, GpuError> {
        let mut faults = Vec::new();
        let mut back = Vec::new();
        for (l, e, slot) in store.slotted().into_iter().filter(|(l, _, _)| layers.contains(l)) {
            back.resize(self.blob(l), 0);
            s.dtoh_sync(&mut back, self.slot_addr(slot))?;
            match store.file_blob(l, e) {
                Ok(b) if b == back => {}
                Ok(_) => faults
                    .push(format!("VRAM slot {slot} of stage {} does not hold expert ({l}, {e})", store.stage_of(l))),
                Err(err) => {
                    faults.push(format!("expert ({l}, {e}): reading its bytes from the model file failed: {err}"))
                }
            }
        }
        Ok(faults)
    }

    /// Whether an asynchronous round is in flight.
    pub fn round_in_flight(&self) -> bool {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).is_some()
            || self.exchange.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn copier(&self) -> StreamCopier {
        StreamCopier { copy: self.copy.clone(), base: self.slot_addr(0), slot_bytes: self.slot_bytes }
    }

    /// The blob bytes of layer `l`'s experts.
    pub fn blob(&self, l: usize) -> usize {
        self.layer_blob[l]
    }

    /// Counts the swaps of experts of `layers` (one entry per swap) landed, and their bytes, and marks the device
    /// table stale.
    fn count_swaps(&self, store: &ExpertStore, layers: impl Iterator<Item = usize>) {
        let (mut n, mut bytes) = (0u64, 0u64);
        for l in layers {
            n += 1;
            bytes += self.blob(l) as u64;
        }
        store.counters.swaps.fetch_add(n, Ordering::Relaxed);
        store.counters.swap_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.table_stale.store(true, Ordering::Release);
    }

    /// A resident-mode round (`--resident-experts`): each swap an exchange with the RAM copy
    /// ([`crate::tiers::exchange`]). Blocking: all four steps now. Asynchronous: reserves the exchanges and starts
    /// step 1 on a helper thread; [`SlotCache::poll`] advances the steps. Swaps into empty slots (a cache larger
    /// than its experts) run as plain moves.
    fn run_exchange_round(
        &self,
        store: &Arc<ExpertStore>,
        plan: Vec<Swap>,
        compute: &Stream,
        asynchronous: bool,
    ) -> Result<usize, GpuError> {
        if self.round_in_flight() {
            if asynchronous {
                return Ok(0); // one round at a time: usage carries these swaps to a later round
            }
            // the knob turned to blocking while a round was in flight: finish that one first
            self.poll(store, compute, true)?;
        }
        // the GPU work that may still read the victims' slots or the exchange places was issued before this event
        let ready = Event::new()?;
        ready.record(compute)?;
        self.copy.wait(&ready)?;
        let (round, fills) = ExchangeRound::reserve(store, &plan);
        let mut done = 0;
        if !fills.is_empty() {
            done += self.run_round(store, fills, compute, false)?;
        }
        if round.is_empty() {
            return Ok(done);
        }
        let n = round.exchanges().len();
        if !asynchronous {
            let layers: Vec<usize> = round.exchanges().iter().map(|x| x.layer).collect();
            round.complete(store, &self.copier()).map_err(GpuError::Unsupported)?;
            self.count_swaps(store, layers.into_iter());
            return Ok(done + n);
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        if let Err((round, e)) = self.spawn_phase(store, round, 1, None, tx) {
            return Err(self.settle(store, compute, round, e));
        }
        *self.exchange.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(ExchangeFlight { phase: 1, reports: rx, _ready: None, store: store.clone() });
        Ok(done + n)
    }

    /// Runs phase `phase` of an asynchronous exchange round on a helper thread: 1 = copy back, 2 = copy in (both
    /// waiting for their copies), 3 = wait for `ready` (compute-stream work that may read the vacated places),
    /// then move the evicted blobs. The round comes back on `tx` with the phase's result.
    fn spawn_phase(
        &self,
        store: &Arc<ExpertStore>,
        round: ExchangeRound,
        phase: u8,
        ready: Option<Arc<Event>>,
        tx: crossbeam_channel::Sender<(ExchangeRound, Result<(), String>)>,
    ) -> Result<(), (ExchangeRound, GpuError)> {
        let (st, dev, c) = (store.clone(), self.dev.clone(), self.copier());
        // the round goes to the thread only once it runs, so a failed spawn hands it back
        let (give, take) = crossbeam_channel::bounded::<ExchangeRound>(1);
        let spawned = std::thread::Builder::new().name("strata-adapt".into()).spawn(move || {
            let Ok(mut round) = take.recv() else { return };
            let r = dev.bind().map_err(|e| e.to_string()).and_then(|_| match phase {
                1 => round.copy_back(&st, &c).and_then(|_| c.sync()).map_err(|e| e.to_string()),
                2 => round.copy_in(&st, &c).and_then(|_| c.sync().map_err(|e| e.to_string())),
                _ => ready.as_ref().map_or(Ok(()), |ev| ev.sync()).map_err(|e| e.to_string()),
            });
            // phase 3: the move itself cannot fail; after a failed wait the engine thread moves (after its own sync)
            if phase >= 3 && r.is_ok() {
                round.move_evicted(&st);
                round.moved();
            }
            // the copy stream and the event go before the device: this thread may hold its last reference
            drop((c, ready));
            let _ = tx.send((round, r));
            drop(dev);
        });
        match spawned {
            Ok(_) => {
                give.send(round).expect("the helper waits for its round");
                Ok(())
            }
            Err(e) => Err((round, GpuError::Unsupported(format!("adaptive helper thread: {e}")))),
        }
    }

    /// Finishes or undoes a round a transition could not hand on (a failed copy, event or thread): before it
    /// landed it is cancelled (the store stays consistent); a landed round is moved (after the GPU work is done)
    /// and flipped. Returns the error to report.
    fn settle(&self, store: &ExpertStore, compute: &Stream, round: ExchangeRound, e: GpuError) -> GpuError {
        let _ = compute.sync();
        let _ = self.copy.sync();
        settle_round(store, round);
        tracing::warn!("asynchronous exchange round stopped: {e}; its swaps were finished or undone");
        e
    }

    /// Advances an asynchronous exchange round: each phase the helper finished leads to the next step on this
    /// thread (2: stage, then the copy-in phase; 3: land, then the move phase; 4: flip). `wait` runs the round to
    /// its end (a request start drains it). Returns whether experts landed.
    fn poll_exchange(&self, store: &Arc<ExpertStore>, compute: &Stream, wait: bool) -> Result<bool, GpuError> {
        let mut g = self.exchange.lock().unwrap_or_else(|e| e.into_inner());
        let mut any = false;
        loop {
            let Some(f) = g.as_mut() else { return Ok(any) };
            let msg = if wait {
                f.reports.recv().ok()
            } else {
                match f.reports.try_recv() {
                    Ok(m) => Some(m),
                    Err(crossbeam_channel::TryRecvError::Empty) => return Ok(any),
                    Err(crossbeam_channel::TryRecvError::Disconnected) => None,
                }
            };
            let phase = f.phase;
            let Some((mut round, r)) = msg else {
                *g = None;
                return Err(GpuError::Unsupported("adaptive helper thread died".into()));
            };
            if let Err(e) = r {
                *g = None;
                return Err(self.settle(store, compute, round, GpuError::Unsupported(e)));
            }
            let (tx, rx) = crossbeam_channel::unbounded();
            match phase {
                1 => {
                    // step 2: victims leave the GPU plan; their slots are copied into once the GPU work issued so
                    // far (which may read them) is done
                    round.stage(store);
                    self.table_stale.store(true, Ordering::Release);
                    let ordered = Event::new().and_then(|ev| ev.record(compute).and_then(|_| self.copy.wait(&ev)));
                    if let Err(e) = ordered {
                        *g = None;
                        return Err(self.settle(store, compute, round, e));
                    }
                    if let Err((round, e)) = self.spawn_phase(store, round, 2, None, tx) {
                        *g = None;
                        return Err(self.settle(store, compute, round, e));
                    }
                    *g = Some(ExchangeFlight { phase: 2, reports: rx, _ready: None, store: store.clone() });
                }
                2 => {
                    // step 3: the new experts are planned for the GPU; the vacated places are rewritten once the
                    // work planned before (PCIe uploads from them on the compute stream) is done
                    round.land(store);
                    self.count_swaps(store, round.exchanges().iter().map(|x| x.layer));
                    any = true;
                    let ev = Event::new().map(Arc::new).and_then(|ev| ev.record(compute).map(|_| ev));
                    let ev = match ev {
                        Ok(ev) => ev,
                        Err(e) => {
                            *g = None;
                            return Err(self.settle(store, compute, round, e));
                        }
                    };
                    if let Err((round, e)) = self.spawn_phase(store, round, 3, Some(ev.clone()), tx) {
                        *g = None;
                        return Err(self.settle(store, compute, round, e));
                    }
                    *g = Some(ExchangeFlight { phase: 3, reports: rx, _ready: Some(ev), store: store.clone() });
                }
                _ => {
                    // step 4: flip the offsets (the helper moved the evicted blobs)
                    round.flip(store);
                    *g = None;
                    return Ok(any);
                }
            }
        }
    }

    /// Carries out an adaptive round's swaps. Blocking (`asynchronous == false`): evicts, copies, waits and
    /// admits before returning. Asynchronous: evicts now (step 2 marks victims non-resident), hands the copies
    /// to a helper thread and returns; [`SlotCache::poll`] admits them once landed (step 3). A new async round
    /// is not started while one is in flight (its swaps are dropped; usage carries them to the next round).
    /// `compute` is the stream the forward pass runs on.
    pub fn run_round(
        &self,
        store: &Arc<ExpertStore>,
        plan: Vec<Swap>,
        compute: &Stream,
        asynchronous: bool,
    ) -> Result<usize, GpuError> {
        if plan.is_empty() {
            return Ok(0);
        }
        if matches!(store.mode(), ResidentMode::Disjoint(_)) && plan.iter().any(|sw| sw.outgoing.is_some()) {
            return self.run_exchange_round(store, plan, compute, asynchronous);
        }
        if asynchronous && self.round_in_flight() {
            return Ok(0);
        }
        // step 1 (choose) was done by the store; step 2: victims stop being planned for the GPU
        let mut moves = Vec::new();
        for sw in &plan {
            let slot = match sw.outgoing {
                Some(o) => store.evict_slot(sw.layer, o),
                None => store.reserve_slot(sw.layer),
            };
            if let Some(slot) = slot {
                moves.push(Move { layer: sw.layer, incoming: sw.incoming, slot });
            }
        }
        if moves.is_empty() {
            return Ok(0);
        }
        self.table_stale.store(true, Ordering::Release);
        // the GPU work that may still read the victims' slots was issued on `compute` before this event
        let ready = Event::new()?;
        ready.record(compute)?;
        self.copy.wait(&ready)?;
        if !asynchronous {
            let mv: Vec<(usize, usize, u64)> =
                moves.iter().map(|m| (m.layer, m.incoming, self.slot_addr(m.slot))).collect();
            let copied =
                copy_moves(store, &mv, &self.layer_blob, &self.bounce, self.bounce_blobs, &self.copy, &mut |_| Ok(()))
                    .and_then(|_| self.copy.sync());
            if let Err(e) = copied {
                // the slots' contents are undefined now: give them back empty, the evicted experts stay on the CPU
                self.release(store, &moves);
                return Err(e);
            }
            self.admit(store, &moves);
            return Ok(plan.len());
        }
        store.set_exchange_staged(true);
        let events: Vec<Event> = (0..moves.len()).map(|_| Event::new()).collect::<Result<_, _>>()?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let job: Vec<(usize, usize, u64)> =
            moves.iter().map(|m| (m.layer, m.incoming, self.slot_addr(m.slot))).collect();
        let (st, dev, copy, bounce) = (store.clone(), self.dev.clone(), self.copy.clone(), self.bounce.clone());
        let blob = self.layer_blob.clone();
        let bounce_blobs = self.bounce_blobs;
        // SAFETY of the raw event handles crossing threads: the events live in `InFlight` until the helper sent
        // `Finished` (poll and Drop wait for that report before dropping them).
        let handles: Vec<DoneHandle> = events.iter().map(|e| DoneHandle(e.0)).collect();
        std::thread::Builder::new()
            .name("strata-adapt".into())
            .spawn(move || {
                let r = (|| {
                    dev.bind()?;
                    copy_moves(&st, &job, &blob, &bounce, bounce_blobs, &copy, &mut |i| {
                        let d = handles[i];
                        // SAFETY: the event outlives this thread's use (see above).
                        unsafe {
                            super::driver::check("cuEventRecord", cudarc::driver::sys::cuEventRecord(d.0, copy.0))?
                        };
                        let _ = tx.send(Report::Recorded(i + 1));
                        Ok(())
                    })
                })();
                // the stream and staging go before the device: this thread may hold its last reference
                drop((copy, bounce));
                let _ = tx.send(Report::Finished(r));
                drop(dev);
            })
            .map_err(|e| GpuError::Unsupported(format!("adaptive helper thread: {e}")))?;
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = Some(InFlight {
            moves,
            events,
            recorded: 0,
            admitted: 0,
            finished: None,
            reports: rx,
            store: store.clone(),
        });
        Ok(plan.len())
    }

    /// Returns the slots of failed moves to the free list (nothing was admitted into them).
    fn release(&self, store: &ExpertStore, moves: &[Move]) {
        if moves.is_empty() {
            return;
        }
        for m in moves {
            store.release_slot(m.layer, m.slot);
        }
        tracing::warn!(
            "adaptive round failed: {} slots returned empty; their experts are computed on the CPU",
            moves.len()
        );
    }

    /// Marks `moves` resident in the store (their copies have landed) and counts them.
    fn admit(&self, store: &ExpertStore, moves: &[Move]) {
        for m in moves {
            store.admit_slot(m.layer, m.incoming, m.slot);
        }
        self.count_swaps(store, moves.iter().map(|m| m.layer));
    }

    /// Step 3 of an asynchronous round: marks the experts whose copies have landed resident (step 4, the offset
    /// flip, has nothing to move: evicted experts keep their RAM places or the file) — each as soon as its own
    /// copy is done. `wait` blocks until the whole round is done (a request start drains the round). Returns
    /// whether any expert was admitted. Errors: the helper failed (its unissued moves give their slots back).
    /// Resident-mode rounds advance here too (`compute` is the stream the forward pass runs on).
    pub fn poll(&self, store: &Arc<ExpertStore>, compute: &Stream, wait: bool) -> Result<bool, GpuError> {
        let landed = self.poll_exchange(store, compute, wait)?;
        Ok(self.poll_moves(store, wait)? || landed)
    }

    fn poll_moves(&self, store: &ExpertStore, wait: bool) -> Result<bool, GpuError> {
        let mut g = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let Some(f) = g.as_mut() else { return Ok(false) };
        // the helper's reports so far (all of them when waiting)
        while f.finished.is_none() {
            let msg = if wait {
                f.reports.recv().map_err(|_| crossbeam_channel::TryRecvError::Disconnected)
            } else {
                f.reports.try_recv()
            };
            match msg {
                Ok(Report::Recorded(n)) => f.recorded = n,
                Ok(Report::Finished(r)) => f.finished = Some(r),
                Err(crossbeam_channel::TryRecvError::Empty) => break,
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    f.finished = Some(Err(GpuError::Unsupported("adaptive helper thread died".into())))
                }
            }
        }
        // recorded moves that landed, in order
        let first = f.admitted;
        while f.admitted < f.recorded {
            let ev = &f.events[f.admitted];
            let landed = if wait { ev.sync().map(|_| true) } else { ev.done() };
            match landed {
                Ok(true) => f.admitted += 1,
                Ok(false) => break,
                Err(e) => {
                    let f = g.take().expect("in flight");
                    store.set_exchange_staged(false);
                    self.admit(store, &f.moves[first..f.admitted]);
                    self.release(store, &f.moves[f.admitted..]);
                    return Err(e);
                }
            }
        }
        let any = f.admitted > first;
        if any {
            self.admit(store, &f.moves[first..f.admitted]);
        }
        if f.finished.is_some() && f.admitted == f.recorded {
            let f = g.take().expect("in flight");
            store.set_exchange_staged(false);
            if let Some(Err(e)) = f.finished {
                self.release(store, &f.moves[f.admitted..]);
                return Err(e);
            }
        }
        Ok(any)
    }

    /// The staging slot that [`SlotCache::stage`] / [`SlotCache::stage_split`] use for their `j`-th item
    /// (`j < n_staging`).
    pub fn staging_slot(&self, j: usize) -> u32 {
        debug_assert!(j < self.n_staging);
        (self.n_slots + j) as u32
    }

    /// Uploads the blobs of PCIe-served misses into staging slots on `s` from `arena` (the RAM copy, registered
    /// with the driver; read-locked by the caller). `items` = (layer, expert, arena offset); item j goes to
    /// staging slot `first + j` ([`SlotCache::staging_slot`]; items past the last staging slot are left out);
    /// returns the slot index of each.
    /// Items of one layer whose places follow each other in the arena (ascending offsets, as a layer's places are
    /// laid out: [`crate::tiers::store::choose_places`]) go as one copy: a plain one when a slot is exactly a blob,
    /// else one pitched copy (blob-wide rows, a slot apart).
    pub fn stage(
        &self,
        arena: &HostArena,
        items: &[(usize, usize, usize)],
        first: usize,
        s: &Stream,
    ) -> Result<Vec<u32>, GpuError> {
        let items = &items[..items.len().min(self.n_staging.saturating_sub(first))];
        for (j, n) in copy_runs(items, |l| self.blob(l)) {
            let (l, _, off) = items[j];
            let blob = self.blob(l);
            let src = arena.slice(off, n * blob);
            let dst = self.slot_addr(self.staging_slot(first + j));
            // SAFETY: the places a window reads are not written while it runs: promotions happen between windows,
            // after the window's final synchronization, and a resident-mode round writes only exchange places no
            // expert reads yet and places whose expert stopped being planned (after an event on this stream). The
            // run's n staging slots (first + j .. first + j + n) lie in the slot arena (items were cut to fit).
            unsafe {
                if n == 1 || blob == self.slot_bytes {
                    s.htod_raw(dst, src.as_ptr(), src.len())?
                } else {
                    s.htod_2d_raw(dst, self.slot_bytes, src.as_ptr(), blob, blob, n)?
                }
            };
        }
        Ok((0..items.len()).map(|j| self.staging_slot(first + j)).collect())
    }
}

/// Where an expert's first `k` intermediate rows go when split between the GPU and the CPU: geometry of the
/// packed sub-blob `gate[0..k) | up[0..k) | down[:, 0..k)` in a staging slot (row counts in rows, sizes in
/// bytes; verbatim GGUF blocks, so k must be a multiple of the format's block size). The down parts are
/// `down_pitch` bytes apart, `down_part` rounded up to 16, so that the staged kernels' 16-byte copies apply to
/// every k that is a multiple of 64 (see [`super::model::split_rows`]).
#[derive(Clone, Copy, Debug)]
pub struct SplitGeom {
    /// Intermediate rows on the GPU (k, a multiple of 64).
    pub k: usize,
    /// Bytes of one gate/up row (width n_embd).
    pub gate_row: usize,
    /// Rows of gate (and of up) in the full blob (n_ff_exp).
    pub ff: usize,
    /// Bytes of one full down row (width n_ff_exp).
    pub down_row: usize,
    /// Bytes of the first k columns of a down row.
    pub down_part: usize,
    /// Bytes from one packed down part to the next (`down_part` rounded up to a multiple of 16).
    pub down_pitch: usize,
    /// Down rows (n_embd).
    pub e: usize,
}

impl SplitGeom {
    /// The geometry of a split at `k` of an expert with `ff` intermediate rows, gate/up rows of `gate_row`
    /// bytes, and `e` down rows of `down_ty` (`down_ty.row_bytes(ff)` bytes, of which the first
    /// `down_ty.row_bytes(k)` are used; k must be a multiple of the format's block size).
    pub fn new(k: usize, gate_row: usize, ff: usize, down_ty: GgmlType, e: usize) -> SplitGeom {
        let down_part = down_ty.row_bytes(k);
        SplitGeom {
            k,
            gate_row,
            ff,
            down_row: down_ty.row_bytes(ff),
            down_part,
            down_pitch: down_part.next_multiple_of(16),
            e,
        }
    }
    /// Offset of the packed down part in the sub-blob (bytes).
    pub fn down_off(&self) -> usize {
        2 * self.k * self.gate_row
    }
    /// Size of the packed sub-blob (bytes); at most a slot.
    pub fn bytes(&self) -> usize {
        self.down_off() + self.e * self.down_pitch
    }
}

impl SlotCache {
    /// Uploads the first `g.k` intermediate rows of PCIe-served misses, packed (see [`SplitGeom`]), into staging
    /// slots on `s` from `arena` (the RAM copy, registered with the driver; read-locked by the caller): the gate
    /// and up rows as one pitched copy of two pieces, the down columns as one pitched copy of `e` pieces
    /// (`down_part` bytes each, `down_pitch` apart in the slot)
    /// (288-byte pieces ran at 48.8 GB/s on the H200 machine, 4032-byte ones at 55.1, as fast as a plain copy).
    /// `items` = (layer, expert, arena offset); returns each one's staging slot.
    pub fn stage_split(
        &self,
        arena: &HostArena,
        items: &[(usize, usize, usize)],
        g: &SplitGeom,
        s: &Stream,
    ) -> Result<Vec<u32>, GpuError> {
        assert!(g.bytes() <= self.slot_bytes, "split sub-blob larger than a slot");
        let mut out = Vec::with_capacity(items.len());
        let part = g.k * g.gate_row;
        for (j, &(l, _, off)) in items.iter().enumerate().take(self.n_staging) {
            let slot = self.staging_slot(j);
            let dst = self.slot_addr(slot);
            let src = arena.slice(off, self.blob(l));
            let down = &src[2 * g.ff * g.gate_row..];
            // SAFETY: as in `stage`: the places a window reads are not written while it runs; the ranges lie inside
            // the blob (k ≤ ff, down_part ≤ down_row) and inside the slot (asserted above).
            unsafe {
                s.htod_2d_raw(dst, part, src.as_ptr(), g.ff * g.gate_row, part, 2)?;
                s.htod_2d_raw(dst + g.down_off() as u64, g.down_pitch, down.as_ptr(), g.down_row, g.down_part, g.e)?;
            }
            out.push(slot);
        }
        Ok(out)
    }
}

impl Drop for SlotCache {
    fn drop(&mut self) {
        // a helper thread may still record into this round's event: wait for it first
        if let Some(x) = self.exchange.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            // the helper's phase ends with its copies synced (or its wait done); the store keeps the round undone
            // before it landed, moved and flipped after
            if let Ok((round, _)) = x.reports.recv() {
                let _ = self.dev.bind();
                let _ = self.copy.sync();
                settle_round(&x.store, round);
            }
        }
        let f = self.in_flight.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(f) = f {
            let _ = self.dev.bind();
            if f.finished.is_none() {
                while let Ok(Report::Recorded(_)) = f.reports.recv() {}
            }
            let _ = self.copy.sync();
            // the round ends with the cache (its moves are lost with the slots)
            f.store.set_exchange_staged(false);
        }
    }
}

#[derive(Clone, Copy)]
struct DoneHandle(cudarc::driver::sys::CUevent);
// SAFETY: an event handle may be recorded from any thread with the context current.
unsafe impl Send for DoneHandle {}

/// Runs of `items` (layer, expert, arena offset) that one copy can serve: `(first index, length)` in order, each
/// run of one layer whose places are adjacent (item j + 1's offset = item j's + `blob(layer)`). Covers every item.
pub fn copy_runs(items: &[(usize, usize, usize)], blob: impl Fn(usize) -> usize) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (j, &(l, _, off)) in items.iter().enumerate() {
        match runs.last_mut() {
            Some((first, n))
                if {
                    let (pl, _, poff) = items[*first + *n - 1];
                    pl == l && poff + blob(l) == off
                } =>
            {
                *n += 1
            }
            _ => runs.push((j, 1)),
        }
    }
    runs
}

/// Issues the copies of `moves` (layer, expert, slot address) on `copy`: from the page-locked RAM copy
/// directly, else through the pinned bounce buffer (file tier; places of the largest blob), `bounce_blobs` at a
/// time. `layer_blob`: each layer's blob bytes. `after(i)` runs once move i's copy is issued.
fn copy_moves(
    store: &ExpertStore,
    moves: &[(usize, usize, u64)],
    layer_blob: &[usize],
    bounce: &Mutex<PinnedBuf>,
    bounce_blobs: usize,
    copy: &Stream,
    after: &mut dyn FnMut(usize) -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let mut bounce = bounce.lock().unwrap_or_else(|e| e.into_inner());
    let place = layer_blob.iter().copied().max().unwrap_or(0);
    let mut used = 0usize;
    for (i, &(l, e, addr)) in moves.iter().enumerate() {
        let blob = layer_blob[l];
        match store.place_of(l, e) {
            Some(off) => {
                let arena = store.arena();
                let src = arena.slice(off, blob);
                // SAFETY: promotions are refused while a round is staged and the blocking path waits for the
                // copy, so the place is not rewritten before the copy completes.
                unsafe { copy.htod_raw(addr, src.as_ptr(), blob)? };
            }
            None => {
                if used == bounce_blobs {
                    copy.sync()?;
                    used = 0;
                }
                let mut v = Vec::new();
                store
                    .read_blob_simple(l, e, &mut v)
                    .map_err(|err| GpuError::Unsupported(format!("blob read of ({l}, {e}) failed: {err}")))?;
                let dst = &mut bounce.as_mut_slice()[used * place..used * place + blob];
                dst.copy_from_slice(&v[..blob]);
                // SAFETY: the bounce region is not reused before copy.sync() (above or the caller's).
                unsafe { copy.htod_raw(addr, dst.as_ptr(), blob)? };
                used += 1;
            }
        }
        after(i)?;
    }
    Ok(())
}

/// The bytes of expert `(l, e)`: its RAM place, else the file mapping.
pub fn blob_of(store: &ExpertStore, l: usize, e: usize) -> Result<Vec<u8>, GpuError> {
    if let Some(b) = store.ram_blob(l, e) {
        return Ok(b);
    }
    Ok(store.mapped_slices(l, e).concat())
}

#[cfg(test)]
mod tests {
    use super::{copy_runs, SplitGeom};
    use crate::quant::GgmlType;

    #[test]
    fn a_half_split_packs_half_the_blob_with_aligned_parts() {
        // Mixtral-8x7B expert in Q4_0: n_embd 4096, n_ff_exp 14336
        let (e, ff, k) = (4096, 14336, 7168);
        let ty = GgmlType::Q4_0;
        let g = SplitGeom::new(k, ty.row_bytes(e), ff, ty, e);
        assert_eq!(g.down_part, ty.row_bytes(k));
        let blob = 2 * ff * ty.row_bytes(e) + e * ty.row_bytes(ff);
        assert_eq!(blob, 99_090_432);
        assert_eq!(g.bytes() * 2, blob);
        // the staged kernels need 16-byte aligned rows in the packed sub-blob
        assert_eq!(g.down_off() % 16, 0);
        assert_eq!(g.down_part % 16, 0);
        assert_eq!(g.down_pitch, g.down_part);
        assert_eq!(g.gate_row % 16, 0);
    }

    #[test]
    fn a_split_off_the_256_row_grid_pads_its_down_parts_to_16_bytes() {
        // Qwen3-30B-A3B expert in Q4_0: n_embd 2048, n_ff_exp 768, split in half (k = 384: 12 blocks, 216 bytes)
        let (e, ff, k) = (2048, 768, 384);
        let ty = GgmlType::Q4_0;
        let g = SplitGeom::new(k, ty.row_bytes(e), ff, ty, e);
        assert_eq!((g.down_part, g.down_pitch), (216, 224));
        assert_eq!(g.bytes(), 2 * 384 * 1152 + 2048 * 224);
        assert_eq!(g.down_off() % 16, 0);
        // Q8_0 at k = 64: 2 blocks of 34 bytes → 80
        let g8 = SplitGeom::new(64, GgmlType::Q8_0.row_bytes(e), ff, GgmlType::Q8_0, e);
        assert_eq!((g8.down_part, g8.down_pitch), (68, 80));
    }

    #[test]
    fn adjacent_places_of_one_layer_make_one_copy() {
        // layer 0 blobs of 100 bytes, layer 1 of 60
        let blob = |l: usize| [100, 60][l];
        assert!(copy_runs(&[], blob).is_empty());
        let items = [
            (0, 5, 1000),
            (0, 6, 1100),
            (0, 7, 1200),
            (0, 9, 1400), // a gap (expert 8 not staged)
            (0, 10, 1500),
            (1, 0, 1600), // adjacent bytes, another layer
            (1, 1, 1660),
            (1, 3, 1600), // back to an earlier place
            (1, 4, 1660),
        ];
        assert_eq!(copy_runs(&items, blob), vec![(0, 3), (3, 2), (5, 2), (7, 2)]);
        // a run covers every item once
        let total: usize = copy_runs(&items, blob).iter().map(|r| r.1).sum();
        assert_eq!(total, items.len());
    }
}
