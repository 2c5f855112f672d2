//! The host expert store: where every expert's blob is (a place in the resident RAM copy, or the file), the
//! per-expert usage and heat, RAM adapt, and the tier counters (DESIGN.md §3-6).
//!
//! Threads: the engine thread computes (reading RAM places under the arena's read lock) and moves experts
//! (under its write lock); service threads only take snapshots of the state under its mutex.

use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};

use super::arena::{HostArena, Lock};
use super::fileio::{AlignedBuf, BlobReader, FileIo};
use super::knobs::Knobs;
use super::layout::ExpertLayout;
use super::lrfu::Lrfu;
use super::policy::{plan_adaptive_round, plan_ram_adapt, PolicyKind, Promotion, Swap, Usage};
use super::profile::{rank_by_heat, Geometry, Profile};
use crate::gguf::GgufFile;
use crate::pool::WorkerPool;

/// A base pointer shared by the read tasks of [`ExpertStore::read_blobs`], each writing its own byte range.
struct SyncBytes(*mut u8);
// SAFETY: the tasks write disjoint ranges through it (see read_blobs).
unsafe impl Sync for SyncBytes {}

thread_local! {
    /// Aligned bounce buffer of each reading thread (O_DIRECT reads).
    static SCRATCH: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::default());
}

/// Errors building the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The model file cannot be opened for blob reads.
    #[error("opening {path} for blob reads: {source}")]
    Open {
        /// Model file.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The RAM copy could not be allocated.
    #[error("allocating the resident RAM copy ({bytes} bytes): {source}")]
    Alloc {
        /// Requested bytes.
        bytes: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// Copying experts into RAM failed.
    #[error("reading expert ({layer}, {expert}) into RAM: {source}")]
    Load {
        /// Layer.
        layer: usize,
        /// Expert.
        expert: usize,
        /// OS error.
        source: std::io::Error,
    },
    /// The stages of a layer split do not partition the layers.
    #[error("layer split: {0}")]
    BadSplit(String),
}

/// How the RAM copy is chosen (DESIGN.md §4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResidentMode {
    /// Every expert in RAM (default).
    All,
    /// The hottest `bytes` of experts (by profile) in RAM, the rest read from the file (`--resident-budget-gib`).
    Budget(u64),
    /// No copy: experts are read through the file mapping (`--mmap-experts`).
    Mmap,
    /// The RAM copy holds exactly the experts no VRAM slot holds (`--resident-experts`; with `Some(bytes)`,
    /// `--resident-budget-gib` beside it: the hottest non-VRAM experts up to `bytes`, the rest file-tier), so
    /// VRAM, RAM and file are disjoint. The copy is built once the VRAM cache is filled
    /// ([`ExpertStore::build_ram_copy`]); adaptive swaps exchange bytes with it ([`super::exchange`]).
    Disjoint(Option<u64>),
}

impl ResidentMode {
    /// The mode's name as the API reports it (`all`, `budget`, `mmap`, `resident`, `resident-budget`).
    pub fn name(&self) -> &'static str {
        match self {
            ResidentMode::All => "all",
            ResidentMode::Budget(_) => "budget",
            ResidentMode::Mmap => "mmap",
            ResidentMode::Disjoint(None) => "resident",
            ResidentMode::Disjoint(Some(_)) => "resident-budget",
        }
    }
}

/// Store settings.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// RAM copy mode.
    pub mode: ResidentMode,
    /// Blob read mode.
    pub file_io: FileIo,
    /// Try to `mlock` the RAM copy.
    pub lock: bool,
    /// Memory kept free when sizing the RAM copy (bytes; default 4 GiB, REFERENCE.md §1).
    pub headroom: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig { mode: ResidentMode::All, file_io: FileIo::Buffered, lock: true, headroom: 4 << 30 }
    }
}

/// Tier of an expert now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// A VRAM slot (not in this build's host store).
    Vram,
    /// A place in the resident RAM copy.
    Ram,
    /// Read from the file (or through the mapping with `--mmap-experts`).
    File,
}

/// Running totals of the tiers (decode windows unless named otherwise).
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Decode windows.
    pub windows: AtomicU64,
    /// Distinct (layer, expert) lookups of decode windows.
    pub lookups: AtomicU64,
    /// VRAM hits (0 without a GPU tier).
    pub vram_hits: AtomicU64,
    /// Decode lookups computed from the RAM copy.
    pub ram_reads: AtomicU64,
    /// Decode lookups whose blob was read from the file (the "blob reads" of blob reads per token).
    pub file_blob_reads: AtomicU64,
    /// Prefill expert computations whose blob was read from the file.
    pub prefill_file_blob_reads: AtomicU64,
    /// Bytes read from the file for computations (decode and prefill; promotions not included).
    pub file_bytes_read: AtomicU64,
    /// Of those, the bytes read for prefill computations.
    pub prefill_file_bytes_read: AtomicU64,
    /// RAM promotions (RAM adapt moves).
    pub promotions: AtomicU64,
    /// Bytes read from the file by promotions.
    pub promotion_bytes: AtomicU64,
    /// Promotions refused (nothing changed).
    pub promotions_refused: AtomicU64,
    /// Adaptive-tier swaps landed (an expert moved into a VRAM slot).
    pub swaps: AtomicU64,
    /// Bytes copied into VRAM slots by swaps.
    pub swap_bytes: AtomicU64,
    /// Decode routing entries of missed experts computed on the GPU after an upload over PCIe (`--pcie-frac`).
    pub pcie_entries: AtomicU64,
    /// Experts uploaded ahead by the prefetch (`prefetch`): predicted for the next layer, in RAM and not in VRAM.
    pub prefetched: AtomicU64,
    /// Prefetched experts the next layer then routed to (computed on the GPU instead of the CPU).
    pub prefetch_hits: AtomicU64,
    /// Bytes of prefetched experts the next layer did not route to.
    pub prefetch_wasted_bytes: AtomicU64,
    /// Routed experts of decode layers that had a next-layer prediction (the prefetch's denominator).
    pub predicted_routed: AtomicU64,
    /// Of those, the ones the prediction named.
    pub predicted_named: AtomicU64,
}

/// A copy of [`TierCounters`] at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TierTotals {
    /// Decode windows.
    pub windows: u64,
    /// Decode lookups.
    pub lookups: u64,
    /// VRAM hits.
    pub vram_hits: u64,
    /// Decode lookups served from RAM.
    pub ram_reads: u64,
    /// Decode lookups read from the file.
    pub file_blob_reads: u64,
    /// Prefill computations read from the file.
    pub prefill_file_blob_reads: u64,
    /// Bytes read from the file for computations.
    pub file_bytes_read: u64,
    /// Of those, bytes read for prefill computations.
    pub prefill_file_bytes_read: u64,
    /// RAM promotions.
    pub promotions: u64,
    /// Bytes read by promotions.
    pub promotion_bytes: u64,
    /// Refused promotions.
    pub promotions_refused: u64,
    /// Adaptive-tier swaps.
    pub swaps: u64,
    /// Bytes copied into VRAM by swaps.
    pub swap_bytes: u64,
    /// Entries served over PCIe.
    pub pcie_entries: u64,
    /// Experts prefetched.
    pub prefetched: u64,
    /// Prefetched experts used.
    pub prefetch_hits: u64,
    /// Bytes prefetched and not used.
    pub prefetch_wasted_bytes: u64,
    /// Routed experts of layers with a prediction.
    pub predicted_routed: u64,
    /// Routed experts the prediction named.
    pub predicted_named: u64,
}

impl TierTotals {
    /// `self − earlier`, field by field (saturating).
    pub fn since(&self, earlier: &TierTotals) -> TierTotals {
        TierTotals {
            windows: self.windows.saturating_sub(earlier.windows),
            lookups: self.lookups.saturating_sub(earlier.lookups),
            vram_hits: self.vram_hits.saturating_sub(earlier.vram_hits),
            ram_reads: self.ram_reads.saturating_sub(earlier.ram_reads),
            file_blob_reads: self.file_blob_reads.saturating_sub(earlier.file_blob_reads),
            prefill_file_blob_reads: self.prefill_file_blob_reads.saturating_sub(earlier.prefill_file_blob_reads),
            file_bytes_read: self.file_bytes_read.saturating_sub(earlier.file_bytes_read),
            prefill_file_bytes_read: self.prefill_file_bytes_read.saturating_sub(earlier.prefill_file_bytes_read),
            promotions: self.promotions.saturating_sub(earlier.promotions),
            promotion_bytes: self.promotion_bytes.saturating_sub(earlier.promotion_bytes),
            promotions_refused: self.promotions_refused.saturating_sub(earlier.promotions_refused),
            swaps: self.swaps.saturating_sub(earlier.swaps),
            swap_bytes: self.swap_bytes.saturating_sub(earlier.swap_bytes),
            pcie_entries: self.pcie_entries.saturating_sub(earlier.pcie_entries),
            prefetched: self.prefetched.saturating_sub(earlier.prefetched),
            prefetch_hits: self.prefetch_hits.saturating_sub(earlier.prefetch_hits),
            prefetch_wasted_bytes: self.prefetch_wasted_bytes.saturating_sub(earlier.prefetch_wasted_bytes),
            predicted_routed: self.predicted_routed.saturating_sub(earlier.predicted_routed),
            predicted_named: self.predicted_named.saturating_sub(earlier.predicted_named),
        }
    }
}

impl TierCounters {
    /// A consistent-enough copy (each field read atomically).
    pub fn totals(&self) -> TierTotals {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierTotals {
            windows: g(&self.windows),
            lookups: g(&self.lookups),
            vram_hits: g(&self.vram_hits),
            ram_reads: g(&self.ram_reads),
            file_blob_reads: g(&self.file_blob_reads),
            prefill_file_blob_reads: g(&self.prefill_file_blob_reads),
            file_bytes_read: g(&self.file_bytes_read),
            prefill_file_bytes_read: g(&self.prefill_file_bytes_read),
            promotions: g(&self.promotions),
            promotion_bytes: g(&self.promotion_bytes),
            promotions_refused: g(&self.promotions_refused),
            swaps: g(&self.swaps),
            swap_bytes: g(&self.swap_bytes),
            pcie_entries: g(&self.pcie_entries),
            prefetched: g(&self.prefetched),
            prefetch_hits: g(&self.prefetch_hits),
            prefetch_wasted_bytes: g(&self.prefetch_wasted_bytes),
            predicted_routed: g(&self.predicted_routed),
            predicted_named: g(&self.predicted_named),
        }
    }
}

/// Why a promotion changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The outgoing expert has no RAM place.
    #[error("expert ({0}, {1}) is not in the RAM copy")]
    OutNotInRam(usize, usize),
    /// The incoming expert already has one.
    #[error("expert ({0}, {1}) is already in the RAM copy")]
    InAlreadyInRam(usize, usize),
    /// An exchange with the VRAM tier is staged.
    #[error("an exchange with the VRAM tier is staged")]
    ExchangeStaged,
    /// The file read failed; the copy is unchanged.
    #[error("reading expert ({0}, {1}) from the file failed: {2}")]
    ReadFailed(usize, usize, String),
    /// Layer or expert out of range.
    #[error("expert ({0}, {1}) does not exist")]
    OutOfRange(usize, usize),
    /// Resident mode: the incoming expert is in VRAM (it has no RAM place by design).
    #[error("expert ({0}, {1}) is in VRAM")]
    InVram(usize, usize),
}

/// Why an exchange could not be reserved (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    /// Not in the resident mode, or its RAM copy is not built yet.
    #[error("exchanges need the resident RAM mode (--resident-experts) with its copy built")]
    NotResidentMode,
    /// The outgoing expert holds no slot.
    #[error("expert ({0}, {1}) is not in VRAM")]
    NotInVram(usize, usize),
    /// The incoming expert already holds one.
    #[error("expert ({0}, {1}) is already in VRAM")]
    AlreadyInVram(usize, usize),
    /// Every exchange place is taken (the swap waits for a later round).
    #[error("no free exchange place")]
    NoPlace,
    /// Layer or expert out of range.
    #[error("expert ({0}, {1}) does not exist")]
    OutOfRange(usize, usize),
}

/// One exchange between a VRAM slot and the resident RAM copy: `outgoing` leaves `slot` for the RAM copy and
/// `incoming` takes the slot (seed 003's steps: [`super::exchange`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    /// Layer of both experts.
    pub layer: usize,
    /// Expert leaving VRAM.
    pub outgoing: usize,
    /// Expert entering VRAM.
    pub incoming: usize,
    /// The slot they exchange.
    pub slot: u32,
    /// Arena offset of the exchange place that holds `outgoing`'s bytes from the copy-back to the flip.
    pub buffer: usize,
    /// Arena offset of `incoming`'s RAM place (it becomes `outgoing`'s at the flip); `None` when `incoming` is
    /// file-tier (then `outgoing` becomes file-tier).
    pub vacated: Option<usize>,
}

/// Where one expert's bytes come from for a computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A VRAM slot of the GPU expert cache (a hit).
    Vram(u32),
    /// RAM copy at this arena offset.
    Ram(usize),
    /// The file: read the blob (buffered or direct).
    File,
    /// The file mapping (`--mmap-experts`).
    Mapped,
}

struct State {
    /// Arena offset of each expert's place, `layer × n_expert + expert`; `None` = file tier.
    place: Vec<Option<usize>>,
    usage: Usage,
    /// The `lrfu` policy's scores and shadow caches (aged while `lrfu` plans rounds: a VRAM cache, the adaptive
    /// tier active and `lrfu` the policy; otherwise each window's entries are dropped).
    lrfu: Lrfu,
    /// Whether `lrfu` planned at the last window: when it starts again (a live switch of `adapt_policy`, or
    /// `adapt_every`/`adapt_swaps` back above 0) its state starts fresh rather than from scores frozen meanwhile.
    lrfu_live: bool,
    /// The profile's ranks at start (ties of a save).
    prior: Option<Vec<Option<u32>>>,
    /// Asynchronous rounds of the VRAM tier in flight (one per stage of a layer split at most; 0 without one).
    rounds_staged: usize,
    /// Exchanges with the VRAM tier reserved and not yet flipped or cancelled (RAM adapt is refused while any
    /// is; [`ResidentMode::Disjoint`] only).
    exchanges: usize,
    /// Free exchange places (arena offsets; [`ResidentMode::Disjoint`] only).
    exchange_free: Vec<usize>,
    /// Whether the `Disjoint` RAM copy has been built (always true in the other modes).
    copy_built: bool,
    /// Windows since start, for the decay rounds.
    windows: u64,
    /// VRAM slot of each expert (`layer × n_expert + expert`); all `None` without a GPU expert cache.
    slot: Vec<Option<u32>>,
    /// Free slots of each VRAM cache, by stage of a layer split (one stage without a split; slot numbers are
    /// the stage's own).
    free_slots: Vec<Vec<u32>>,
    /// First layer of each stage (`[0]` without a split).
    stage_start: Vec<usize>,
}

/// Per-layer residency (for `GetResidency`).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerResidency {
    /// Experts in VRAM / RAM / file.
    pub experts: [u32; 3],
    /// Bytes in VRAM / RAM / file.
    pub bytes: [u64; 3],
    /// The stage of a layer split whose VRAM cache holds the layer's experts (0 without a split).
    pub stage: u32,
}

/// One expert's residency (for `GetResidency`).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertResidency {
    /// Layer.
    pub layer: u32,
    /// Expert.
    pub expert: u32,
    /// Tier now.
    pub tier: Tier,
    /// Decayed usage.
    pub usage: f32,
    /// Heat.
    pub heat: f64,
}

/// The expert store of one MoE model.
pub struct ExpertStore {
    layout: ExpertLayout,
    file: Arc<GgufFile>,
    reader: Option<BlobReader>,
    arena: RwLock<HostArena>,
    state: Mutex<State>,
    mode: ResidentMode,
    cfg: StoreConfig,
    geometry: Geometry,
    /// Running totals.
    pub counters: TierCounters,
    /// Live knobs (RAM adapt, adaptive-tier rounds, ...).
    pub knobs: Arc<Knobs>,
}

/// Exchange places of the resident mode's RAM copy with a VRAM cache: one round at the default `adapt_swaps`
/// (REFERENCE.md §4 caps a round at 96); swaps beyond them wait for a later round.
pub const EXCHANGE_PLACES: usize = 96;

/// MemAvailable from /proc/meminfo in bytes, if readable.
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl ExpertStore {
    /// Builds the store for `layout` of the model in `file` (opened at `path`; blob reads go to `path`, or to each
    /// part of a split model): chooses the RAM copy (profile order, else expert-major across layers), allocates,
    /// locks and fills it. Errors: [`StoreError`].
    pub fn new(
        layout: ExpertLayout,
        file: Arc<GgufFile>,
        path: &Path,
        geometry: Geometry,
        profile: Option<&Profile>,
        cfg: &StoreConfig,
        knobs: Arc<Knobs>,
    ) -> Result<ExpertStore, StoreError> {
        let n_layer = layout.n_layer();
        let ne = layout.n_expert;
        let total = layout.total_bytes();
        // placement order: profile rank, then expert-major across layers
        let ranks = profile.map(|p| p.ranks());
        let order = placement_order_of(n_layer, ne, ranks.as_deref());
        let budget = match cfg.mode {
            ResidentMode::Mmap | ResidentMode::Disjoint(_) => 0,
            ResidentMode::All => total,
            ResidentMode::Budget(b) => clamp_to_total(b, total),
        };
        let budget = clamp_to_memory(budget, cfg.headroom);
        let reader = if cfg.mode != ResidentMode::Mmap {
            Some(
                // a split model reads each blob from the part that holds it; one file is read at `path`
                if file.parts().len() > 1 {
                    BlobReader::open_parts(file.parts(), cfg.file_io)
                } else {
                    BlobReader::open(path, cfg.file_io)
                }
                .map_err(|source| StoreError::Open { path: path.display().to_string(), source })?,
            )
        } else {
            None
        };
        let copy = RamCopy::fill(&layout, &file, &order, budget, cfg.mode == ResidentMode::All, 0, cfg.lock)?;
        let (place, arena, used, in_ram) = (copy.place, copy.arena, copy.used, copy.chosen);
        if matches!(cfg.mode, ResidentMode::Disjoint(_)) {
            tracing::info!(
                experts_total = n_layer * ne,
                "expert store ready (resident mode: the RAM copy is built once the VRAM cache is filled)"
            );
        } else {
            tracing::info!(
                mode = cfg.mode.name(),
                experts_in_ram = in_ram,
                experts_total = n_layer * ne,
                ram_gib = format!("{:.2}", gib(used)),
                locked = arena.lock() == Lock::Locked,
                file_io = ?cfg.file_io,
                "expert store ready"
            );
        }
        Ok(ExpertStore {
            layout,
            file,
            reader,
            arena: RwLock::new(arena),
            state: Mutex::new(State {
                place,
                usage: Usage::new(n_layer, ne),
                lrfu: Lrfu::new(n_layer, ne),
                lrfu_live: false,
                prior: ranks,
                rounds_staged: 0,
                exchanges: 0,
                exchange_free: Vec::new(),
                copy_built: !matches!(cfg.mode, ResidentMode::Disjoint(_)),
                windows: 0,
                slot: vec![None; n_layer * ne],
                free_slots: vec![Vec::new()],
                stage_start: vec![0],
            }),
            mode: cfg.mode,
            cfg: cfg.clone(),
            geometry,
            counters: TierCounters::default(),
            knobs,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The RAM copy mode.
    pub fn mode(&self) -> ResidentMode {
        self.mode
    }

    /// The blob geometry.
    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    /// The profile geometry of this model.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The RAM copy's lock state.
    pub fn ram_lock(&self) -> Lock {
        self.arena.read().unwrap_or_else(|e| e.into_inner()).lock()
    }

    /// Where each of `experts` (distinct, in routing order: token by token, each token's by rank) of `layer` comes
    /// from now; counts decode lookups and RAM/file reads and, for decode windows, adds `entries[j]` routing entries
    /// to expert j's usage (the order is the order of use the `lrfu` policy's LRU keeps, the first the latest).
    pub fn plan_layer(&self, layer: usize, experts: &[usize], entries: &[u32], decode: bool) -> Vec<Source> {
        let ne = self.layout.n_expert;
        let mut st = self.state();
        let blob = self.layout.layers[layer].blob_bytes() as u64;
        let mut out = Vec::with_capacity(experts.len());
        let (mut ram, mut file, mut vram) = (0u64, 0u64, 0u64);
        for (j, &e) in experts.iter().enumerate() {
            let src = match (self.mode, st.place[layer * ne + e]) {
                _ if st.slot[layer * ne + e].is_some() => Source::Vram(st.slot[layer * ne + e].expect("slot")),
                (_, Some(off)) => Source::Ram(off),
                (ResidentMode::Mmap, None) => Source::Mapped,
                (_, None) => Source::File,
            };
            match src {
                Source::Vram(_) => vram += 1,
                Source::Ram(_) => ram += 1,
                _ => file += 1,
            }
            if decode {
                let n = entries.get(j).copied().unwrap_or(1);
                for _ in 0..n {
                    st.usage.record(layer, e);
                }
                st.lrfu.record(layer, e, n);
            }
            out.push(src);
        }
        drop(st);
        let c = &self.counters;
        if decode {
            c.lookups.fetch_add(experts.len() as u64, Ordering::Relaxed);
            c.vram_hits.fetch_add(vram, Ordering::Relaxed);
            c.ram_reads.fetch_add(ram, Ordering::Relaxed);
            c.file_blob_reads.fetch_add(file, Ordering::Relaxed);
        } else {
            c.prefill_file_blob_reads.fetch_add(file, Ordering::Relaxed);
            c.prefill_file_bytes_read.fetch_add(file * blob, Ordering::Relaxed);
        }
        c.file_bytes_read.fetch_add(file * blob, Ordering::Relaxed);
        out
    }

    /// Read access to the RAM copy for the duration of a layer's computation.
    pub fn arena(&self) -> RwLockReadGuard<'_, HostArena> {
        self.arena.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The mapped bytes of expert `e`'s three slices (gate, up, down) in the file.
    pub fn mapped_slices(&self, layer: usize, e: usize) -> [&[u8]; 3] {
        let b = self.file.bytes();
        self.layout.layers[layer].file_slices(e).map(|(o, n)| &b[o as usize..o as usize + n])
    }

    /// Reads expert `e`'s blob (gate | up | down) of `layer` from the file into `out` (resized to the blob).
    /// Errors: the read failed.
    pub fn read_blob(
        &self,
        layer: usize,
        e: usize,
        out: &mut Vec<u8>,
        scratch: &mut AlignedBuf,
    ) -> std::io::Result<()> {
        let ll = &self.layout.layers[layer];
        out.resize(ll.blob_bytes(), 0);
        let mut o = 0;
        for (fo, len) in ll.file_slices(e) {
            match &self.reader {
                Some(r) => r.read_at(fo, &mut out[o..o + len], scratch)?,
                None => out[o..o + len].copy_from_slice(&self.file.bytes()[fo as usize..fo as usize + len]),
            }
            o += len;
        }
        Ok(())
    }

    /// [`ExpertStore::read_blob`] with its own aligned scratch (one-off reads).
    pub fn read_blob_simple(&self, layer: usize, e: usize, out: &mut Vec<u8>) -> std::io::Result<()> {
        self.read_blob(layer, e, out, &mut AlignedBuf::default())
    }

    /// Arena offset of `(layer, e)`'s RAM place, if it has one.
    pub fn place_of(&self, layer: usize, e: usize) -> Option<usize> {
        self.state().place[layer * self.layout.n_expert + e]
    }

    /// Start address and length of the RAM copy (for registering it with the GPU driver).
    pub fn arena_range(&self) -> (*mut u8, usize) {
        let a = self.arena();
        (a.as_ptr(), a.len())
    }

    /// Reads the blobs of `experts` (file-tier experts of `layer`) together, spread over `pool`'s threads, into
    /// `out` (resized to `experts.len()` blobs back to back; blob j at `j × blob_bytes`). Returns, per expert,
    /// its read's error, or `None` when it succeeded.
    pub fn read_blobs(
        &self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<u8>,
        pool: &WorkerPool,
    ) -> Vec<Option<std::io::Error>> {
        let blob = self.layout.layers[layer].blob_bytes();
        out.resize(experts.len() * blob, 0);
        let errs: Vec<Mutex<Option<std::io::Error>>> = experts.iter().map(|_| Mutex::new(None)).collect();
        let base = SyncBytes(out.as_mut_ptr());
        let base = &base;
        pool.run(experts.len(), |j| {
            // SAFETY: task j writes only bytes [j × blob, (j + 1) × blob) of `out`, which holds
            // experts.len() × blob bytes and outlives `pool.run`; no two tasks share a range.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.0.add(j * blob), blob) };
            let r = SCRATCH.with(|sc| self.read_blob_into(layer, experts[j], dst, &mut sc.borrow_mut()));
            if let Err(e) = r {
                tracing::warn!("blob read of expert ({layer}, {}) failed: {e}", experts[j]);
                *errs[j].lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        });
        errs.into_iter().map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner())).collect()
    }

    fn read_blob_into(&self, layer: usize, e: usize, out: &mut [u8], scratch: &mut AlignedBuf) -> std::io::Result<()> {
        let mut o = 0;
        for (fo, len) in self.layout.layers[layer].file_slices(e) {
            match &self.reader {
                Some(r) => r.read_at(fo, &mut out[o..o + len], scratch)?,
                None => out[o..o + len].copy_from_slice(&self.file.bytes()[fo as usize..fo as usize + len]),
            }
            o += len;
        }
        Ok(())
    }

    /// Ends a decode window: counts it and runs the adaptive tier's policy (`adapt_policy`) on the VRAM cache,
    /// if there is one. `lrfu` ([`super::lrfu`]) ages its scores and plans a round every window while it is the
    /// policy and the tier is active (`adapt_every` and `adapt_swaps` above 0), starting from fresh state each
    /// time it becomes so; the seed rule (DESIGN.md §5, REFERENCE.md §4) plans every `adapt_every`
    /// windows on the usage before it decays. Every `adapt_every` windows usage decays by `adapt_decay` (heat
    /// accumulates; RAM adapt reads it). A round plans at most `adapt_swaps` swaps. Returns the planned swaps
    /// (empty without a VRAM cache or between rounds); the caller carries them out
    /// ([`ExpertStore::evict_slot`], [`ExpertStore::admit_slot`]).
    pub fn end_decode_window(&self) -> Vec<Swap> {
        self.counters.windows.fetch_add(1, Ordering::Relaxed);
        let k = self.knobs.adapt();
        let policy = self.knobs.policy();
        let ne = self.layout.n_expert;
        let mut st = self.state();
        st.windows += 1;
        // experts each layer holds in VRAM, counted once per window (the policies read it per layer)
        let held: Vec<usize> = st.slot.chunks(ne.max(1)).map(|c| c.iter().filter(|s| s.is_some()).count()).collect();
        let n_free: usize = st.free_slots.iter().map(Vec::len).sum();
        let n_slots = held.iter().sum::<usize>() + n_free;
        let mut plan = Vec::new();
        if n_slots > 0 {
            let st = &mut *st;
            let (slot, free, starts) = (&st.slot, &st.free_slots, &st.stage_start);
            let cached = |l: usize| (0..ne).filter(|&e| slot[l * ne + e].is_some()).collect::<Vec<_>>();
            let free_of = |l: usize| free[stage_in(starts, l)].len();
            let due = k.every > 0 && st.windows.is_multiple_of(k.every as u64);
            if k.active() {
                match policy {
                    PolicyKind::Lrfu => {
                        if !st.lrfu_live {
                            // scores and shadows frozen while another policy or a static placement ran would
                            // misjudge the present: start as a fresh engine does (the window just ended is kept)
                            let mut fresh = Lrfu::new(self.layout.n_layer(), ne);
                            fresh.take_window(&mut st.lrfu);
                            st.lrfu = fresh;
                            st.lrfu_live = true;
                        }
                        // a layer's size: its slots and the stage's free ones (equal to the replay's per-layer size
                        // once the cache is full, as it is after the fill whenever not every expert fits)
                        st.lrfu.end_window(cached, |l| held[l] + free_of(l));
                        plan = st.lrfu.plan(cached, free_of, k.swaps as usize);
                    }
                    PolicyKind::Seed if due => plan = plan_adaptive_round(&st.usage, cached, free_of, k.swaps as usize),
                    PolicyKind::Seed => {}
                }
            }
        }
        if n_slots == 0 || !k.active() || policy != PolicyKind::Lrfu {
            // the lrfu state (scores, shadows) follows only the windows it plans for: a static placement or the
            // seed policy does not pay for its bookkeeping (about 0.7 ms per token at 48 layers × 128 experts)
            st.lrfu.clear_window();
            st.lrfu_live = false;
        }
        if k.every > 0 && st.windows.is_multiple_of(k.every as u64) {
            st.usage.decay(k.decay);
        }
        plan
    }

    /// Forgets usage and heat (benchmarks start each arm cold).
    pub fn reset_usage(&self) {
        let mut st = self.state();
        st.usage = Usage::new(self.layout.n_layer(), self.layout.n_expert);
        st.lrfu = Lrfu::new(self.layout.n_layer(), self.layout.n_expert);
        st.windows = 0;
    }

    /// Gives the store a VRAM cache of `n_slots` slots, all empty (replaces an earlier one; one stage).
    pub fn init_slots(&self, n_slots: usize) {
        self.init_slot_stages(&[0], &[n_slots]).expect("one stage from layer 0");
    }

    /// Gives the store the VRAM caches of a layer split, all empty (replaces earlier ones): stage `i` holds the
    /// experts of layers `starts[i] .. starts[i + 1]` (the last to the final layer) in its own `n_slots[i]`
    /// slots, numbered from 0 in each stage. Errors: `starts` not `0` followed by strictly increasing layers
    /// below `n_layer`, or a count per stage that differs.
    pub fn init_slot_stages(&self, starts: &[usize], n_slots: &[usize]) -> Result<(), StoreError> {
        let nl = self.layout.n_layer();
        let ok = starts.first() == Some(&0)
            && starts.windows(2).all(|w| w[0] < w[1])
            && starts.last().is_some_and(|&s| s < nl.max(1))
            && starts.len() == n_slots.len();
        if !ok {
            return Err(StoreError::BadSplit(format!(
                "stages starting at layers {starts:?} with {n_slots:?} slots for {nl} layers"
            )));
        }
        let mut st = self.state();
        st.slot.iter_mut().for_each(|s| *s = None);
        st.free_slots = n_slots.iter().map(|&n| (0..n as u32).rev().collect()).collect();
        st.stage_start = starts.to_vec();
        Ok(())
    }

    /// The stage of a layer split whose VRAM cache holds `layer`'s experts (0 without a split).
    pub fn stage_of(&self, layer: usize) -> usize {
        stage_in(&self.state().stage_start, layer)
    }

    /// Layers of each stage of the split (one range over every layer without a split).
    pub fn stage_layers(&self) -> Vec<std::ops::Range<usize>> {
        let st = self.state();
        let nl = self.layout.n_layer();
        let s = &st.stage_start;
        (0..s.len()).map(|i| s[i]..s.get(i + 1).copied().unwrap_or(nl)).collect()
    }

    /// Splits a round's swaps by the stage that owns each swap's layer (`out[i]` for stage `i`, in plan order):
    /// each stage's cache carries out its own, on its own card's streams.
    pub fn plan_by_stage(&self, plan: Vec<Swap>) -> Vec<Vec<Swap>> {
        let st = self.state();
        let mut out: Vec<Vec<Swap>> = vec![Vec::new(); st.stage_start.len()];
        for sw in plan {
            out[stage_in(&st.stage_start, sw.layer)].push(sw);
        }
        out
    }

    /// Takes a free slot of the stage owning `layer` off its free list without giving it to any expert yet (the
    /// caller copies a blob in, then [`ExpertStore::admit_slot`]s it); `None` when that stage has no free slot.
    pub fn reserve_slot(&self, layer: usize) -> Option<u32> {
        let mut st = self.state();
        let i = stage_in(&st.stage_start, layer);
        st.free_slots[i].pop()
    }

    /// Marks `(layer, e)` resident in `slot` (its bytes have landed): from now on it is planned for the GPU.
    pub fn admit_slot(&self, layer: usize, e: usize, slot: u32) {
        let ne = self.layout.n_expert;
        self.state().slot[layer * ne + e] = Some(slot);
    }

    /// Stops planning `(layer, e)` for the GPU and returns its slot (the caller may overwrite the slot once
    /// the GPU work issued before this call is done). `None` if it had no slot.
    pub fn evict_slot(&self, layer: usize, e: usize) -> Option<u32> {
        let ne = self.layout.n_expert;
        self.state().slot[layer * ne + e].take()
    }

    /// Returns a slot of the stage owning `layer` to its free list.
    pub fn release_slot(&self, layer: usize, slot: u32) {
        let mut st = self.state();
        let i = stage_in(&st.stage_start, layer);
        st.free_slots[i].push(slot);
    }

    /// The residency table for the GPU: `layer × n_expert + expert` → slot, −1 when not in VRAM.
    pub fn slot_table(&self) -> Vec<i32> {
        self.state().slot.iter().map(|s| s.map(|v| v as i32).unwrap_or(-1)).collect()
    }

    /// Whether every expert has a VRAM slot (no lookup can miss).
    pub fn all_in_vram(&self) -> bool {
        self.state().slot.iter().all(|s| s.is_some())
    }

    /// Placement order for filling a VRAM cache: profile rank, then expert-major across layers (the same
    /// order as the RAM copy's).
    pub fn placement_order(&self) -> Vec<(usize, usize)> {
        let st = self.state();
        let ne = self.layout.n_expert;
        let order = placement_order_of(self.layout.n_layer(), ne, st.prior.as_deref());
        order.into_iter().map(|i| (i / ne, i % ne)).collect()
    }

    /// Records decode usage for routing entries whose lookups were not planned through
    /// [`ExpertStore::plan_layer`] (every expert in VRAM: the GPU routed on its own): `routed` are the
    /// layer's routing entries of the window (expert ids in routing order, token by token, each token's by rank;
    /// repeats allowed); counts lookups and VRAM hits.
    pub fn record_vram_window(&self, layer: usize, routed: impl IntoIterator<Item = usize>) {
        let ne = self.layout.n_expert;
        let mut distinct = vec![false; ne];
        let mut st = self.state();
        for e in routed {
            st.usage.record(layer, e);
            st.lrfu.record(layer, e, 1);
            distinct[e] = true;
        }
        drop(st);
        let n = distinct.iter().filter(|&&d| d).count() as u64;
        self.counters.lookups.fetch_add(n, Ordering::Relaxed);
        self.counters.vram_hits.fetch_add(n, Ordering::Relaxed);
    }

    /// RAM adapt before a decode window (DESIGN.md §5, seed 000): plans at most `ram_adapt` promotions and
    /// carries them out. Does nothing in a request's first window (`first_window`) or when the knob is 0.
    /// Returns the promotions made.
    pub fn ram_adapt(&self, first_window: bool) -> Vec<Promotion> {
        let n = self.knobs.ram_adapt();
        if n == 0 || first_window || self.mode == ResidentMode::Mmap {
            return Vec::new();
        }
        let plan = {
            let st = self.state();
            if st.rounds_staged > 0 || st.exchanges > 0 {
                return Vec::new();
            }
            let ne = self.layout.n_expert;
            // resident mode: a VRAM expert is neither RAM nor file tier (VRAM, RAM and file stay disjoint)
            let disjoint = matches!(self.mode, ResidentMode::Disjoint(_));
            plan_ram_adapt(
                &st.usage,
                |l, e| st.place[l * ne + e].is_some(),
                |l, e| !disjoint || st.slot[l * ne + e].is_none(),
                n,
            )
        };
        let mut done = Vec::new();
        for p in plan {
            match self.promote(p.layer, p.incoming, p.outgoing) {
                Ok(()) => done.push(p),
                Err(r) => tracing::debug!("RAM adapt refused: {r}"),
            }
        }
        done
    }

    /// Moves file-tier expert `incoming` of `layer` into the RAM place of `outgoing`: reads the blob from the
    /// file beside the copy, then writes it into the place. Refused (nothing changes): `outgoing` not in RAM,
    /// `incoming` already in RAM, an exchange staged, or the read failed.
    pub fn promote(&self, layer: usize, incoming: usize, outgoing: usize) -> Result<(), Refusal> {
        let r = self.promote_inner(layer, incoming, outgoing);
        if r.is_err() {
            self.counters.promotions_refused.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn promote_inner(&self, layer: usize, incoming: usize, outgoing: usize) -> Result<(), Refusal> {
        let ne = self.layout.n_expert;
        if layer >= self.layout.n_layer() || incoming >= ne || outgoing >= ne {
            return Err(Refusal::OutOfRange(layer, incoming.max(outgoing)));
        }
        let off = {
            let st = self.state();
            if st.rounds_staged > 0 || st.exchanges > 0 {
                return Err(Refusal::ExchangeStaged);
            }
            if st.place[layer * ne + incoming].is_some() {
                return Err(Refusal::InAlreadyInRam(layer, incoming));
            }
            if matches!(self.mode, ResidentMode::Disjoint(_)) && st.slot[layer * ne + incoming].is_some() {
                return Err(Refusal::InVram(layer, incoming));
            }
            st.place[layer * ne + outgoing].ok_or(Refusal::OutNotInRam(layer, outgoing))?
        };
        let mut buf = Vec::new();
        self.read_blob(layer, incoming, &mut buf, &mut AlignedBuf::default())
            .map_err(|e| Refusal::ReadFailed(layer, incoming, e.to_string()))?;
        {
            let mut a = self.arena.write().unwrap_or_else(|e| e.into_inner());
            a.slice_mut(off, buf.len()).copy_from_slice(&buf);
        }
        let mut st = self.state();
        st.place[layer * ne + outgoing] = None;
        st.place[layer * ne + incoming] = Some(off);
        drop(st);
        self.counters.promotions.fetch_add(1, Ordering::Relaxed);
        self.counters.promotion_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Counts an asynchronous round of a VRAM cache starting (`true`) or ending (`false`); promotions are refused
    /// while any is in flight (the stages of a layer split each run their own). The GPU tier calls it once each
    /// way per round; without one no round is ever counted.
    pub fn set_exchange_staged(&self, staged: bool) {
        let mut st = self.state();
        st.rounds_staged = if staged { st.rounds_staged + 1 } else { st.rounds_staged.saturating_sub(1) };
    }

    /// Builds the [`ResidentMode::Disjoint`] RAM copy once the VRAM cache is filled: the experts no slot holds,
    /// chosen in placement order (profile rank, then expert-major) and laid out layer-major ([`choose_places`]),
    /// all of them or — with a budget — the hottest up to it,
    /// clamped to available memory minus the headroom; the rest are file-tier. `n_exchange` exchange places of the
    /// largest blob follow them (none without VRAM slots): they hold evicted experts' bytes during adaptive swaps
    /// ([`super::exchange`]). Replaces an earlier copy (no exchange may be reserved; whoever registered the old
    /// arena with a driver unregisters it first). Returns the experts placed. A no-op (0) in the other modes.
    /// Errors: [`StoreError`] (allocation or a read past the file).
    pub fn build_ram_copy(&self, n_exchange: usize) -> Result<usize, StoreError> {
        let ResidentMode::Disjoint(budget) = self.mode else { return Ok(0) };
        let ne = self.layout.n_expert;
        let placement = self.placement_order();
        let (order, n_slotted) = {
            let st = self.state();
            assert_eq!(st.exchanges, 0, "RAM copy rebuilt with exchanges reserved");
            let n_slotted = st.slot.iter().filter(|s| s.is_some()).count();
            let order: Vec<usize> =
                placement.into_iter().map(|(l, e)| l * ne + e).filter(|&i| st.slot[i].is_none()).collect();
            (order, n_slotted)
        };
        let rest: u64 = order.iter().map(|&i| self.layout.layers[i / ne].blob_bytes() as u64).sum();
        let want = match budget {
            Some(b) => clamp_to_total(b, rest),
            None => rest,
        };
        let n_exchange = if n_slotted == 0 { 0 } else { n_exchange.min(order.len()) };
        let max_blob = self.layout.layers.iter().map(|l| l.blob_bytes()).max().unwrap_or(0) as u64;
        let extra = n_exchange as u64 * max_blob;
        {
            // an earlier copy goes first (its memory counts as available for the new one); until the new one is
            // filled every expert outside VRAM reads from the file
            let mut a = self.arena.write().unwrap_or_else(|e| e.into_inner());
            let mut st = self.state();
            *a = HostArena::new(0, false).map_err(|source| StoreError::Alloc { bytes: 0, source })?;
            st.place.iter_mut().for_each(|p| *p = None);
            st.exchange_free.clear();
        }
        let fit = clamp_to_memory(want + extra, self.cfg.headroom).saturating_sub(extra);
        let copy = RamCopy::fill(&self.layout, &self.file, &order, fit, budget.is_none(), n_exchange, self.cfg.lock)?;
        let (used, placed) = (copy.used, copy.chosen);
        let locked = copy.arena.lock() == Lock::Locked;
        {
            let mut a = self.arena.write().unwrap_or_else(|e| e.into_inner());
            let mut st = self.state();
            *a = copy.arena;
            st.place = copy.place;
            st.exchange_free = (0..n_exchange).rev().map(|k| (used + k as u64 * max_blob) as usize).collect();
            st.copy_built = true;
        }
        tracing::info!(
            "resident RAM copy (disjoint from the {n_slotted} VRAM experts): {placed} experts, {:.2} GiB + {n_exchange} \
             exchange places ({:.0} MiB), {}; {} experts file-tier",
            gib(used),
            extra as f64 / (1u64 << 20) as f64,
            if locked { "locked" } else { "pageable" },
            order.len() - placed
        );
        Ok(placed)
    }

    /// Whether the RAM copy is complete: always, except in [`ResidentMode::Disjoint`] before
    /// [`ExpertStore::build_ram_copy`].
    pub fn ram_copy_built(&self) -> bool {
        self.state().copy_built
    }

    /// Free exchange places now (reserved ones not counted).
    pub fn exchange_places_free(&self) -> usize {
        self.state().exchange_free.len()
    }

    /// Reserves an exchange for the swap `incoming` ⇄ `outgoing` of `layer` (resident mode, step 1): `outgoing`
    /// must hold a slot and `incoming` none; takes a free exchange place. Nothing moves yet; RAM adapt is refused
    /// until the exchange is flipped or cancelled. Errors: [`ExchangeError`].
    pub fn reserve_exchange(&self, layer: usize, outgoing: usize, incoming: usize) -> Result<Exchange, ExchangeError> {
        let ne = self.layout.n_expert;
        if layer >= self.layout.n_layer() || outgoing >= ne || incoming >= ne {
            return Err(ExchangeError::OutOfRange(layer, outgoing.max(incoming)));
        }
        let mut st = self.state();
        if !matches!(self.mode, ResidentMode::Disjoint(_)) || !st.copy_built {
            return Err(ExchangeError::NotResidentMode);
        }
        let slot = st.slot[layer * ne + outgoing].ok_or(ExchangeError::NotInVram(layer, outgoing))?;
        if st.slot[layer * ne + incoming].is_some() {
            return Err(ExchangeError::AlreadyInVram(layer, incoming));
        }
        let buffer = st.exchange_free.pop().ok_or(ExchangeError::NoPlace)?;
        st.exchanges += 1;
        Ok(Exchange { layer, outgoing, incoming, slot, buffer, vacated: st.place[layer * ne + incoming] })
    }

    /// Address of `len` bytes at arena offset `off` of the RAM copy, for copies the caller orders itself (a GPU
    /// copy-back into an exchange place, a copy-in from a place). The address stays valid until the copy is
    /// rebuilt. Panics when out of range.
    pub fn place_ptr(&self, off: usize, len: usize) -> *mut u8 {
        let a = self.arena();
        assert!(off.checked_add(len).is_some_and(|end| end <= a.len()), "RAM place out of range");
        // SAFETY: in bounds of the arena's live mapping (checked above); only an address is formed here.
        unsafe { a.as_ptr().add(off) }
    }

    /// Step 2 of an exchange, once `outgoing`'s bytes are in its exchange place: `outgoing` stops being planned
    /// for the GPU and is read from the exchange place (its slot now belongs to the exchange: the caller overwrites
    /// it once the GPU work issued before this call is done).
    pub fn stage_exchange(&self, x: &Exchange) {
        let ne = self.layout.n_expert;
        let mut st = self.state();
        let i = x.layer * ne + x.outgoing;
        debug_assert_eq!(st.slot[i], Some(x.slot));
        st.slot[i] = None;
        st.place[i] = Some(x.buffer);
    }

    /// Step 3 of an exchange, once `incoming`'s bytes are in the slot: `incoming` is planned for the GPU. Its RAM
    /// place (`x.vacated`) is then read by nobody planned from now on.
    pub fn land_exchange(&self, x: &Exchange) {
        let ne = self.layout.n_expert;
        self.state().slot[x.layer * ne + x.incoming] = Some(x.slot);
    }

    /// Step 3 (the copy): moves `outgoing`'s bytes from the exchange place into the place `incoming` vacated
    /// (nothing when `incoming` came from the file). Called after [`ExpertStore::land_exchange`] and after every
    /// read of the vacated place planned before it (CPU work and GPU copies) is done; may run on another thread
    /// while windows run, since no window plans a read of the vacated place any more.
    pub fn move_evicted(&self, x: &Exchange) {
        let Some(dst) = x.vacated else { return };
        let len = self.layout.layers[x.layer].blob_bytes();
        let (src, dst) = (self.place_ptr(x.buffer, len), self.place_ptr(dst, len));
        // SAFETY: both ranges lie in the arena (place_ptr checks) and do not overlap (an exchange place is never an
        // expert's place while reserved). Nobody writes the exchange place between the copy-back and the flip;
        // nobody reads or writes the vacated place after land_exchange (the caller waited for earlier readers).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    }

    /// Step 4: flips the offsets — `outgoing`'s RAM place becomes the vacated one (file tier when `incoming` came
    /// from the file), `incoming` keeps none — and frees the exchange place.
    pub fn flip_exchange(&self, x: Exchange) {
        let ne = self.layout.n_expert;
        let mut st = self.state();
        st.place[x.layer * ne + x.outgoing] = x.vacated;
        st.place[x.layer * ne + x.incoming] = None;
        st.exchange_free.push(x.buffer);
        st.exchanges -= 1;
    }

    /// Undoes an exchange whose copy failed. Before [`ExpertStore::stage_exchange`] (`staged == false`) nothing
    /// moved: the exchange place is freed. After it, the slot's contents are undefined: `incoming` keeps its tier,
    /// `outgoing` keeps the exchange place as its RAM place (one fewer exchange place from now on), and the slot
    /// stays unused until the cache is rebuilt (a free slot would be filled by a plain move, which in this mode
    /// would leave its expert in VRAM and RAM at once).
    pub fn cancel_exchange(&self, x: Exchange, staged: bool) {
        let mut st = self.state();
        if !staged {
            st.exchange_free.push(x.buffer);
        }
        st.exchanges -= 1;
    }

    /// Checks the RAM copy against the file: every expert with a RAM place holds exactly its file bytes there, no
    /// two experts share a place, and in the resident mode no expert has both a slot and a place (the exchange
    /// rounds in flight excepted: call it with none). Returns one line per fault (empty = consistent); a file read
    /// that fails (a file truncated under the daemon) is a fault line too. Reads the whole copy and every RAM-held
    /// expert's bytes from the file (with `pread`, as promotions do, so a truncated file cannot fault a mapped
    /// page): between requests only (the daemon's `VerifyTiers`, tests, benchmarks).
    pub fn verify_ram_copy(&self) -> Vec<String> {
        let ne = self.layout.n_expert;
        let (place, slot) = {
            let st = self.state();
            (st.place.clone(), st.slot.clone())
        };
        let mut faults = Vec::new();
        let mut owners = std::collections::HashMap::new();
        let (mut blob, mut scratch) = (Vec::new(), AlignedBuf::default());
        let arena = self.arena();
        for (i, p) in place.iter().enumerate() {
            let (l, e) = (i / ne, i % ne);
            if matches!(self.mode, ResidentMode::Disjoint(_)) && p.is_some() && slot[i].is_some() {
                faults.push(format!("expert ({l}, {e}) is in VRAM and in RAM"));
            }
            let Some(off) = *p else { continue };
            if let Some((l2, e2)) = owners.insert(off, (l, e)) {
                faults.push(format!("experts ({l2}, {e2}) and ({l}, {e}) share the RAM place at {off}"));
            }
            match self.read_blob(l, e, &mut blob, &mut scratch) {
                Ok(()) if arena.slice(off, blob.len()) == &blob[..] => {}
                Ok(()) => faults.push(format!("expert ({l}, {e}): its RAM place at {off} holds other bytes")),
                Err(err) => {
                    faults.push(format!("expert ({l}, {e}): reading its bytes from the model file failed: {err}"))
                }
            }
        }
        faults
    }

    /// Experts with a RAM place and occupied VRAM slots per stage of the layer split, now (what
    /// [`ExpertStore::verify_ram_copy`] and a backend's slot check compare).
    pub fn copies(&self) -> (usize, Vec<usize>) {
        let ne = self.layout.n_expert;
        let st = self.state();
        let mut per_stage = vec![0usize; st.stage_start.len().max(1)];
        for (i, s) in st.slot.iter().enumerate() {
            if s.is_some() {
                per_stage[stage_in(&st.stage_start, i / ne)] += 1;
            }
        }
        (st.place.iter().filter(|p| p.is_some()).count(), per_stage)
    }

    /// The file's bytes of `(layer, expert)`'s blob (gate | up | down), read from the file ([`ExpertStore::read_blob`]).
    /// Errors: the read failed (a truncated file).
    pub fn file_blob(&self, layer: usize, expert: usize) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_blob_simple(layer, expert, &mut out)?;
        Ok(out)
    }

    /// The VRAM residency now: `(layer, expert, slot)` of every expert that holds a slot.
    pub fn slotted(&self) -> Vec<(usize, usize, u32)> {
        let ne = self.layout.n_expert;
        let st = self.state();
        st.slot.iter().enumerate().filter_map(|(i, s)| s.map(|s| (i / ne, i % ne, s))).collect()
    }

    /// The experts of `layer` in the RAM tier (a RAM place and no VRAM slot), with their places (arena offsets), by
    /// expert id; one look at the state.
    pub fn ram_tier(&self, layer: usize) -> Vec<(usize, usize)> {
        let st = self.state();
        let ne = self.layout.n_expert;
        (0..ne)
            .filter(|&x| st.slot[layer * ne + x].is_none())
            .filter_map(|x| st.place[layer * ne + x].map(|off| (x, off)))
            .collect()
    }

    /// Tier of `(layer, expert)`.
    pub fn tier(&self, layer: usize, expert: usize) -> Tier {
        let st = self.state();
        let i = layer * self.layout.n_expert + expert;
        if st.slot[i].is_some() {
            Tier::Vram
        } else if st.place[i].is_some() {
            Tier::Ram
        } else {
            Tier::File
        }
    }

    /// The RAM copy's bytes of `(layer, expert)`, if it has a place (a copy).
    pub fn ram_blob(&self, layer: usize, expert: usize) -> Option<Vec<u8>> {
        let off = self.state().place[layer * self.layout.n_expert + expert]?;
        Some(self.arena().slice(off, self.layout.layers[layer].blob_bytes()).to_vec())
    }

    /// Per-layer totals and per-expert tier, usage and heat.
    pub fn residency(&self) -> (Vec<LayerResidency>, Vec<ExpertResidency>) {
        let st = self.state();
        let ne = self.layout.n_expert;
        let mut layers = Vec::new();
        let mut experts = Vec::new();
        for (l, ll) in self.layout.layers.iter().enumerate() {
            let blob = ll.blob_bytes() as u64;
            let stage = stage_in(&st.stage_start, l) as u32;
            let mut lr = LayerResidency { experts: [0; 3], bytes: [0; 3], stage };
            for e in 0..ne {
                let tier = if st.slot[l * ne + e].is_some() {
                    Tier::Vram
                } else if st.place[l * ne + e].is_some() {
                    Tier::Ram
                } else {
                    Tier::File
                };
                let t = tier as usize;
                lr.experts[t] += 1;
                lr.bytes[t] += blob;
                experts.push(ExpertResidency {
                    layer: l as u32,
                    expert: e as u32,
                    tier,
                    usage: st.usage.usage(l, e),
                    heat: st.usage.heat(l, e),
                });
            }
            layers.push(lr);
        }
        (layers, experts)
    }

    /// The profile to save now: VRAM-resident experts first (REFERENCE.md §3), then every expert ranked by
    /// heat, then the start profile's order, then index.
    pub fn profile_now(&self) -> Profile {
        let st = self.state();
        let ne = self.layout.n_expert;
        // a VRAM expert ranks above every other (heat stays far below 1e15 routing entries)
        let boost = |i: usize| if st.slot[i].is_some() { 1e15 } else { 0.0 };
        let heat: Vec<f64> =
            (0..self.layout.n_layer() * ne).map(|i| st.usage.heat(i / ne, i % ne) + boost(i)).collect();
        Profile { geometry: self.geometry, ranked: rank_by_heat(&heat, ne, st.prior.as_deref()) }
    }
}

/// A RAM copy chosen and filled: each expert's place, the arena, the bytes of the places and the experts placed.
struct RamCopy {
    place: Vec<Option<usize>>,
    arena: HostArena,
    used: u64,
    chosen: usize,
}

impl RamCopy {
    /// Chooses experts (`layer × n_expert + expert`; laid out layer-major: [`choose_places`]) in `order` while they
    /// fit in `budget` bytes — stopping at the
    /// first that does not (`stop_at_first`) or skipping it — then `extra` places of the largest blob after them
    /// (exchange places); allocates the arena (locked when `lock`) and fills the places from the file mapping.
    fn fill(
        layout: &ExpertLayout,
        file: &GgufFile,
        order: &[usize],
        budget: u64,
        stop_at_first: bool,
        extra: usize,
        lock: bool,
    ) -> Result<RamCopy, StoreError> {
        let ne = layout.n_expert;
        let (place, used, chosen) = choose_places(layout, order, budget, stop_at_first);
        let max_blob = layout.layers.iter().map(|l| l.blob_bytes()).max().unwrap_or(0) as u64;
        let len = used + extra as u64 * max_blob;
        let mut arena =
            HostArena::new(len as usize, lock).map_err(|source| StoreError::Alloc { bytes: len, source })?;
        // fill the copy from the mapping (sequential, through the page cache)
        let bytes = file.bytes();
        // a progress line every 5 s for a copy that takes that long (a large model read from a cold disk)
        let t0 = std::time::Instant::now();
        let mut said = t0;
        let mut done = 0u64;
        for &i in &chosen {
            if said.elapsed().as_secs() >= 5 {
                said = std::time::Instant::now();
                let rate = done as f64 / t0.elapsed().as_secs_f64().max(1e-9);
                tracing::info!(
                    "reading experts into RAM: {:.2} of {:.2} GiB ({:.0}%, {:.0} MiB/s)",
                    gib(done),
                    gib(used),
                    100.0 * done as f64 / used.max(1) as f64,
                    rate / (1u64 << 20) as f64
                );
            }
            let (l, e) = (i / ne, i % ne);
            let off = place[i].expect("chosen");
            let ll = &layout.layers[l];
            let dst = arena.slice_mut(off, ll.blob_bytes());
            let mut o = 0;
            for (fo, len) in ll.file_slices(e) {
                let src = bytes.get(fo as usize..fo as usize + len).ok_or_else(|| StoreError::Load {
                    layer: l,
                    expert: e,
                    source: std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                })?;
                dst[o..o + len].copy_from_slice(src);
                o += len;
            }
            done += o as u64;
        }
        Ok(RamCopy { place, arena, used, chosen: chosen.len() })
    }
}

/// The stage of `layer` given each stage's first layer (ascending, from 0).
fn stage_in(starts: &[usize], layer: usize) -> usize {
    starts.partition_point(|&s| s <= layer).saturating_sub(1)
}

/// `budget` clamped to `total` bytes of experts (said once when it was more).
fn clamp_to_total(budget: u64, total: u64) -> u64 {
    if budget > total {
        tracing::info!(
            "--resident-budget-gib {:.2} is more than all experts ({:.2} GiB): clamped",
            gib(budget),
            gib(total)
        );
    }
    budget.min(total)
}

/// Placement order of `n_layer × n_expert` experts (`layer × n_expert + expert`), hottest first: by `ranks` (an
/// expert profile's rank of each; unranked ones after), then expert-major across layers (expert 0 of every layer,
/// then expert 1, ...). The VRAM cache and the RAM copy fill in this order.
pub fn placement_order_of(n_layer: usize, n_expert: usize, ranks: Option<&[Option<u32>]>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n_layer * n_expert).collect();
    order.sort_by_key(|&i| (ranks.and_then(|r| r[i]).unwrap_or(u32::MAX), i % n_expert, i / n_expert));
    order
}

/// The RAM copy's places: experts (`layer × n_expert + expert`) are chosen in `order` while they fit in `budget`
/// bytes, stopping at the first that does not (`stop_at_first`) or skipping it; the chosen ones are then laid out
/// back to back layer-major (by `layer × n_expert + expert`), so that one layer's experts sit together and a GPU
/// prefill that uploads a layer's RAM-resident experts copies runs of adjacent blobs at once (and the fill reads
/// the file in its own order). Returns each expert's byte offset in the copy (`None`: not placed), the bytes used
/// and the experts placed, in layout order. The placement plan ([`super::plan`]) sizes the copy with the same
/// rule.
pub fn choose_places(
    layout: &ExpertLayout,
    order: &[usize],
    budget: u64,
    stop_at_first: bool,
) -> (Vec<Option<usize>>, u64, Vec<usize>) {
    let ne = layout.n_expert;
    let blob = |i: usize| layout.layers[i / ne].blob_bytes() as u64;
    let mut used = 0u64;
    let mut chosen = Vec::new();
    for &i in order {
        let b = blob(i);
        if used + b > budget {
            if stop_at_first {
                break; // clamped: the hottest that fit
            }
            continue;
        }
        chosen.push(i);
        used += b;
    }
    chosen.sort_unstable();
    let mut place = vec![None; layout.n_layer() * ne];
    let mut off = 0u64;
    for &i in &chosen {
        place[i] = Some(off as usize);
        off += blob(i);
    }
    (place, used, chosen)
}

/// `budget` bytes clamped to `available` memory minus `headroom` (unclamped when the available memory is unknown).
pub fn fit_to_memory(budget: u64, available: Option<u64>, headroom: u64) -> u64 {
    available.map_or(budget, |a| budget.min(a.saturating_sub(headroom)))
}

/// `budget` clamped to the available memory minus `headroom` bytes (said when it was more).
fn clamp_to_memory(budget: u64, headroom: u64) -> u64 {
    match mem_available() {
        Some(avail) if budget > fit_to_memory(budget, Some(avail), headroom) => {
            let c = fit_to_memory(budget, Some(avail), headroom);
            tracing::warn!(
                "resident RAM copy of {:.2} GiB does not fit in available memory ({:.2} GiB) minus {:.2} GiB \
                 headroom: clamped to {:.2} GiB, the rest is read from the file",
                gib(budget),
                gib(avail),
                gib(headroom),
                gib(c)
            );
            c
        }
        _ => budget,
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::tiers::layout::{LayerLayout, RoleSlice};

    /// `n_layer` layers of `n_expert` experts; layer l's blob is `blob[l]` bytes (all in the gate slice).
    fn layout(n_expert: usize, blob: &[usize]) -> ExpertLayout {
        let role = |bytes| RoleSlice { base: 0, bytes, ty: GgmlType::F32, rows: 1, cols: bytes / 4 };
        let layers = blob.iter().map(|&b| LayerLayout { gate: role(b), up: role(0), down: role(0) }).collect();
        ExpertLayout { n_expert, layers }
    }

    #[test]
    fn places_are_chosen_in_order_and_laid_out_layer_major() {
        // 3 layers × 4 experts, blobs of 10, 20 and 10 bytes; hottest first: expert 2 of every layer, then 0
        let lay = layout(4, &[10, 20, 10]);
        let order = placement_order_of(3, 4, None);
        assert_eq!(&order[..6], &[0, 4, 8, 1, 5, 9]);
        let hot = [2, 6, 10, 0, 4, 8, 1, 5, 9, 3, 7, 11];
        // 75 bytes, stopping at the first that does not fit: 2, 6, 10, 0, 4 (70 bytes); 8 would make 80
        let (place, used, chosen) = choose_places(&lay, &hot, 75, true);
        assert_eq!(used, 70);
        assert_eq!(chosen, vec![0, 2, 4, 6, 10]);
        let want = [Some(0), None, Some(10), None, Some(20), None, Some(40), None, None, None, Some(60), None];
        assert_eq!(place, want);
        // 100 bytes, skipping: 8 and 1 fit (90), the 20-byte 5 does not, the 10-byte 9 does (100)
        let (place, used, chosen) = choose_places(&lay, &hot, 100, false);
        assert_eq!(used, 100);
        assert_eq!(chosen, vec![0, 1, 2, 4, 6, 8, 9, 10]);
        assert_eq!((place[5], place[8], place[9], place[10]), (None, Some(70), Some(80), Some(90)));
        // every place lies after the previous chosen one's end, without gaps
        let mut end = 0;
        for &i in &chosen {
            assert_eq!(place[i], Some(end));
            end += lay.layers[i / 4].blob_bytes();
        }
        assert_eq!(end as u64, used);
    }
}
