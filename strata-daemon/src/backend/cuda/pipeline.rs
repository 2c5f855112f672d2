//! The CUDA backend's model: one [`Stage`] per card of a layer split (`--layer-split`, `--split-device`; one stage
//! over every layer without a split). Each stage holds the dense weights, KV cache, scratch and VRAM expert cache
//! of its own layers on its own streams; a chunk runs through the stages in order, each handing its hidden state
//! `x` (`t × n_embd` f32) to the next through page-locked host memory (no peer-to-peer access needed), the last
//! stage computing the logits. Two stages may share a card (`--split-device 0,0`): the bit-exact A/B of a split.
//!
//! The expert store's slot records are per stage ([`ExpertStore::init_slot_stages`]); an adaptive round's swaps
//! go to the stage owning each swap's layer, whose cache copies on its own card ([`ExpertStore::plan_by_stage`]).
//! The resident mode's RAM copy leaves out every stage's cached experts and is registered once, for every card.

use std::sync::Arc;

use super::driver::Device;
use super::model::{Stage, StageIn, EXCHANGE_PLACES};
use super::ops::MAX_NT;
use super::GpuConfig;
use super::GpuError;
use crate::backend::{Backend, BackendError, Body, KvCache, Logits, ModelRef, Scratch};
use crate::tiers::layout::ExpertLayout;
use crate::tiers::split::{share_slots, stage_ranges};
use crate::tiers::store::ExpertStore;
use crate::tiers::vram::{auto_slots, slot_bytes, CacheSize};

/// A model on one GPU or a pipeline of GPU stages.
pub struct GpuModel {
    stages: Vec<Stage>,
}

/// What one stage holds (logs, residency, benchmarks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageInfo {
    /// Its layers.
    pub layers: std::ops::Range<usize>,
    /// CUDA device ordinal.
    pub device: usize,
    /// Expert slots of its VRAM cache (0 without one).
    pub slots: usize,
}

impl Drop for GpuModel {
    fn drop(&mut self) {
        // every stage's stream idle and its cache's copies done before the first stage unregisters the RAM copy
        for st in &self.stages {
            let _ = st.sync();
        }
        for st in &mut self.stages {
            let _ = st.device().bind();
            st.cache = None;
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Staging slots of an expert cache for top-`k` routing over `n_expert` experts: one blob per routing of the
/// largest chunk that uploads its misses ([`MAX_NT`] tokens), at most one per expert.
pub fn staging_slots(k: usize, n_expert: usize) -> usize {
    (k * MAX_NT).min(n_expert)
}

/// Staging sets of [`staging_slots`] each an expert cache gets on a card of `card_bytes`, for sets of `set_bytes`:
/// two where the uploads ahead are `wanted` ([`ahead_wanted`]) and one set is at most 1/32 of the card (a prefill
/// chunk then uploads the next layer's RAM-resident experts into one set while a layer computes from the other, so
/// that the link runs beside the kernels: `Stage::hybrid_moe`), else one (the uploads wait for the routing, one
/// layer at a time). `STRATA_GPU_PREFILL_AHEAD=0` keeps one (read once; for A/B measurements).
pub fn staging_sets(set_bytes: u64, card_bytes: u64, wanted: bool) -> usize {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("STRATA_GPU_PREFILL_AHEAD").is_ok_and(|v| v == "0"));
    sets_for(set_bytes, card_bytes, wanted && !off)
}

/// [`staging_sets`] without the environment.
fn sets_for(set_bytes: u64, card_bytes: u64, wanted: bool) -> usize {
    if wanted && set_bytes.saturating_mul(32) <= card_bytes {
        2
    } else {
        1
    }
}

/// Whether an expert cache of `cfg.cache` over `entries` experts wants the second staging set: only where a prefill
/// may upload ahead at all (`cfg.prefill_ahead`: a RAM copy, `--pcie-prefill` on) and some experts stay off VRAM
/// (`auto`: `room`, the VRAM free for slots of `sb` bytes after one staging set, less the reserve `cfg.reserve`,
/// holds fewer than all of them). The plan's trial, the layer split's planning and the load decide with this.
pub fn ahead_wanted(cfg: &GpuConfig, entries: usize, room: u64, sb: u64) -> bool {
    let all_fit = match cfg.cache {
        CacheSize::Slots(k) => k >= entries,
        CacheSize::Auto => room.saturating_sub(cfg.reserve) >= entries as u64 * sb,
    };
    cfg.prefill_ahead && entries > 0 && !all_fit
}

/// Staging slots of an expert cache: sets of `set` slots of `sb` bytes ([`staging_sets`]), two where `cfg` wants the
/// uploads ahead over `entries` experts with `free` bytes of VRAM free for the cache (summed over the cards of a
/// split) on a card of `card` bytes (the smallest of a split), one otherwise. The one rule of the plan's trial, the
/// layer split's planning, the load and a rebuilt cache.
pub fn staging_total(cfg: &GpuConfig, set: usize, sb: usize, entries: usize, free: u64, card: u64) -> usize {
    let room = free.saturating_sub((set * sb) as u64);
    set * staging_sets((set * sb) as u64, card, ahead_wanted(cfg, entries, room, sb as u64))
}

/// The staging slots a one-stage load of a model with top-`k` routing over `lay`'s experts allocates, on a card of
/// `card` bytes with `free` bytes free for its cache ([`staging_total`]); the placement plan's estimate when no
/// trial ran.
pub fn staging_count(k: usize, lay: &ExpertLayout, cfg: &GpuConfig, free: u64, card: u64) -> usize {
    let sb = slot_bytes(lay.layers.iter().map(|l| l.blob_bytes()).max().unwrap_or(0));
    staging_total(cfg, staging_slots(k, lay.n_expert), sb, lay.n_layer() * lay.n_expert, free, card)
}

/// The smallest card's memory and the free memory summed over the distinct cards of `devs` (bytes), for
/// [`staging_total`] over a layer split. Errors: the driver's.
fn cards_free<'a>(devs: impl Iterator<Item = &'a Device>) -> Result<(u64, u64), GpuError> {
    let (mut card, mut free) = (u64::MAX, 0u64);
    let mut counted = Vec::new();
    for d in devs {
        let (f, total) = d.mem_info()?;
        card = card.min(total as u64);
        if !counted.contains(&d.ordinal) {
            counted.push(d.ordinal);
            free += f as u64;
        }
    }
    Ok((card, free))
}

/// One stage's claim on its card's expert slots.
#[derive(Debug, Clone, Copy)]
struct CardStage {
    /// Experts of the stage's layers.
    experts: usize,
    /// Slots asked (`--expert-cache N`, shared among the stages by their experts).
    asked: usize,
    /// VRAM an `auto` cache keeps free (bytes).
    reserve: u64,
}

/// The slots of each stage sharing one card with `room` bytes free (after the staging slots), slots of `sb`
/// bytes. `auto`: each stage takes its experts' share of `room` less its reserve; `N`: the asked slots, cut to
/// what fits with 64 MiB to spare — then the second value is that fit (for the warning).
fn card_slots(cache: CacheSize, room: u64, sb: u64, on: &[CardStage]) -> (Vec<usize>, Option<usize>) {
    let weight: usize = on.iter().map(|s| s.experts).sum();
    match cache {
        CacheSize::Auto => {
            let share = |s: &CardStage| {
                (room.saturating_sub(s.reserve) as u128 * s.experts as u128 / weight.max(1) as u128) as u64
            };
            (on.iter().map(|s| auto_slots(share(s), 0, sb, s.experts)).collect(), None)
        }
        CacheSize::Slots(_) => {
            let fit = (room.saturating_sub(64 << 20) / sb.max(1)) as usize;
            let asked: Vec<usize> = on.iter().map(|s| s.asked).collect();
            let sum: usize = asked.iter().sum();
            (share_slots(fit.min(sum), &asked), (sum > fit).then_some(fit))
        }
    }
}

/// What the placement plan's trial of a one-stage load found ([`trial_load`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trial {
    /// Free VRAM once the kernels, dense weights, KV cache and scratch are allocated (bytes).
    pub free_after_load: u64,
    /// Whether the kernel module was loaded for the trial (`false`: not in the disk cache yet, so its VRAM is
    /// not counted).
    pub module: bool,
    /// Expert slots the cache took.
    pub slots: usize,
    /// Free VRAM with the cache allocated too (bytes).
    pub free_after: u64,
    /// Staging slots the cache took (one or two sets: [`staging_sets`]).
    pub staging: usize,
}

/// Allocates on `dev` what a one-stage load of `model` allocates — the kernel module when the disk cache holds
/// it, the buffers of [`super::model::stage_sizes`] (nothing uploaded), then the expert cache of `layout`'s
/// experts by the load's rule — notes the free VRAM, and frees it all. The driver's rounding and the module's
/// VRAM are so measured rather than estimated. Errors: the driver's, out of VRAM included.
pub fn trial_load(
    model: &ModelRef<'_>,
    dev: &Arc<Device>,
    cfg: &GpuConfig,
    layout: Option<&ExpertLayout>,
) -> Result<Trial, GpuError> {
    dev.bind()?;
    let formats = super::kernels::FormatSet::of_model(model.weights);
    let img = super::kernels::cached_cubin(&dev.arch(), formats, super::kernels::mmq_pipe_on(dev.max_smem_optin))?;
    let kernels = img.as_deref().map(|img| super::model::load_kernels(model, dev, img)).transpose()?;
    let sizes = super::model::stage_sizes(model, cfg, 0..model.cfg.n_layer, true);
    let bufs = sizes.all().map(super::driver::DevBuf::alloc).collect::<Result<Vec<_>, _>>()?;
    let stream = super::driver::Stream::new()?;
    let (free, card) = dev.mem_info()?;
    let free = free as u64;
    let mut t = Trial { free_after_load: free, module: kernels.is_some(), slots: 0, free_after: free, staging: 0 };
    if let Some(lay) = layout.filter(|l| l.n_expert > 0) {
        let blob = Arc::new(lay.layers.iter().map(|l| l.blob_bytes()).collect::<Vec<_>>());
        let sb = slot_bytes(blob.iter().copied().max().unwrap_or(0));
        let entries = lay.n_layer() * lay.n_expert;
        let n_staging = staging_count(model.cfg.n_expert_used, lay, cfg, free, card as u64);
        let room = free.saturating_sub((n_staging * sb) as u64);
        let asked = match cfg.cache {
            CacheSize::Slots(k) => k.min(entries),
            CacheSize::Auto => entries,
        };
        let stage = CardStage { experts: entries, asked, reserve: cfg.reserve };
        let want = card_slots(cfg.cache, room, sb as u64, &[stage]).0[0];
        let reserve = (cfg.cache == CacheSize::Auto).then_some(cfg.reserve);
        let cache = super::model::alloc_cache_on(dev, (want, n_staging, sb, blob, entries), reserve)?;
        t.slots = cache.n_slots;
        t.staging = cache.n_staging;
        t.free_after = dev.mem_info()?.0 as u64;
    }
    drop((stream, bufs, kernels));
    Ok(t)
}

impl GpuModel {
    /// Loads `model` as stages starting at layers `starts` (`[0]`: one stage) on `devices` (one per stage): each
    /// stage's dense weights, KV cache and scratch, then (MoE models with a store) every stage's VRAM expert
    /// cache, sized from its card's free VRAM (stages sharing a card share it by their experts; the first stage
    /// keeps `cfg.reserve` of its share free, each later one `cfg.reserve_later`) and filled
    /// hottest-first from its own layers; then the resident mode's RAM copy. Errors: a tensor format without
    /// kernels, out of VRAM, driver/NVRTC failures.
    pub fn load(
        model: &ModelRef<'_>,
        devices: &[Arc<Device>],
        cfg: &GpuConfig,
        starts: &[usize],
    ) -> Result<GpuModel, GpuError> {
        assert_eq!(devices.len(), starts.len(), "one device per stage");
        let ranges = stage_ranges(starts, model.cfg.n_layer);
        let mut stages = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.iter().enumerate() {
            stages.push(Stage::load(model, devices[i].clone(), cfg, r.clone(), i + 1 == ranges.len())?);
        }
        let mut g = GpuModel { stages };
        if let Some(store) = &model.experts {
            g.make_caches(model, store, cfg, starts)?;
        }
        Ok(g)
    }

    fn make_caches(
        &mut self,
        model: &ModelRef<'_>,
        store: &Arc<ExpertStore>,
        cfg: &GpuConfig,
        starts: &[usize],
    ) -> Result<(), GpuError> {
        let lay = store.layout();
        // layers of a mixed-format file may have blobs of different sizes: slots fit the largest
        let blob = std::sync::Arc::new(lay.layers.iter().map(|l| l.blob_bytes()).collect::<Vec<_>>());
        let sb = slot_bytes(blob.iter().copied().max().unwrap_or(0));
        let ne = lay.n_expert;
        let entries = lay.n_layer() * ne;
        // every card of the split gets the same count (the smallest card decides; the free VRAM summed over the
        // cards tells whether every expert fits)
        let (card, free) = cards_free(self.stages.iter().map(|s| &**s.device()))?;
        let n_staging = staging_total(cfg, staging_slots(model.cfg.n_expert_used, ne), sb, entries, free, card);
        let staging_bytes = (n_staging * sb) as u64;
        let n = self.stages.len();
        let experts: Vec<usize> = self.stages.iter().map(|s| s.layer_range().len() * ne).collect();
        let ordinals: Vec<usize> = self.stages.iter().map(|s| s.device().ordinal).collect();
        // the first stage's reserve is --vram-reserve-mib, every later one's --vram-reserve-later-mib (per stage,
        // so that two stages on one card — the A/B of a split — show which caches the flag moves)
        let reserve_of = |i: usize| if i == 0 { cfg.reserve } else { cfg.reserve_later };
        // an explicit size is shared among the stages by their experts, then each card's share clamped to it;
        // `auto`: stage i of a card takes its experts' share of (free − its reserve) — a stage alone on its card
        // keeps the whole reserve free; stages sharing a card each keep their share of theirs, so a later stage's
        // reserve moves only that stage's cache there too
        let asked = match cfg.cache {
            CacheSize::Slots(k) => share_slots(k.min(entries), &experts),
            CacheSize::Auto => experts.clone(),
        };
        let mut want = vec![0usize; n];
        let mut seen = Vec::new();
        for i in 0..n {
            let ord = ordinals[i];
            if seen.contains(&ord) {
                continue;
            }
            seen.push(ord);
            let on: Vec<usize> = (0..n).filter(|&j| ordinals[j] == ord).collect();
            let (free, _) = self.stages[i].device().mem_info()?;
            let room = (free as u64).saturating_sub(staging_bytes * on.len() as u64);
            let here: Vec<CardStage> = on
                .iter()
                .map(|&j| CardStage { experts: experts[j], asked: asked[j], reserve: reserve_of(j) })
                .collect();
            let (got, short) = card_slots(cfg.cache, room, sb as u64, &here);
            if let (Some(fit), CacheSize::Slots(k)) = (short, cfg.cache) {
                let sum: usize = here.iter().map(|h| h.asked).sum();
                let what = if n == 1 { k.to_string() } else { format!("{sum} (this card's share)") };
                tracing::warn!("--expert-cache {what}: only {fit} slots fit in free VRAM; using {fit}");
            }
            for (&j, v) in on.iter().zip(got) {
                want[j] = v;
            }
        }
        let mut caches = Vec::with_capacity(n);
        for (i, st) in self.stages.iter().enumerate() {
            // `auto`: give slots back while less than the card's smallest reserve stays free (allocation overhead)
            let floor = (0..n).filter(|&j| ordinals[j] == ordinals[i]).map(reserve_of).min();
            let reserve = floor.filter(|_| cfg.cache == CacheSize::Auto);
            caches.push(st.alloc_cache((want[i], n_staging, sb, blob.clone(), entries), reserve)?);
        }
        let counts: Vec<usize> = caches.iter().map(|c| c.n_slots).collect();
        store.init_slot_stages(starts, &counts).map_err(|e| GpuError::Unsupported(e.to_string()))?;
        let mut placed = Vec::with_capacity(n);
        for (st, cache) in self.stages.iter().zip(&caches) {
            st.device().bind()?;
            placed.push(cache.fill(store, &st.s, st.layer_range())?);
        }
        // the resident mode's RAM copy: the experts no stage's cache took, and the exchange places of its swaps
        store.build_ram_copy(EXCHANGE_PLACES).map_err(|e| GpuError::Unsupported(e.to_string()))?;
        self.stages[0].device().bind()?;
        let pinned = self.stages[0].register_arena(store);
        for (st, mut cache) in self.stages.iter_mut().zip(caches) {
            cache.async_ok = pinned;
            st.cache = Some(cache);
        }
        let copy = if pinned { "page-locked" } else { "pageable" };
        for (i, st) in self.stages.iter().enumerate() {
            let (free_now, _) = st.device().mem_info()?;
            let (p, total) = (placed[i], experts[i]);
            let what = if n == 1 {
                format!("expert cache: {p} slots")
            } else {
                let r = st.layer_range();
                format!(
                    "stage {i} (layers {}..{}, CUDA {}): expert cache {p} slots",
                    r.start,
                    r.end,
                    st.device().ordinal
                )
            };
            tracing::info!(
                "{what} of {:.2} MiB ({:.2} GiB, {:.1}% of {total} experts) + {n_staging} staging slots; \
                 {:.0} MiB of VRAM free (reserve {:.0} MiB); RAM copy {copy}",
                mib(sb as u64),
                (p * sb) as f64 / (1u64 << 30) as f64,
                100.0 * p as f64 / total.max(1) as f64,
                mib(free_now as u64),
                mib(reserve_of(i)),
            );
            if (free_now as u64) < 256 << 20 {
                let flag = if i == 0 { "--vram-reserve-mib" } else { "--vram-reserve-later-mib" };
                tracing::warn!(
                    "VRAM LOW: {:.0} MiB free on CUDA {}; raise {flag}",
                    mib(free_now as u64),
                    st.device().ordinal
                );
            }
        }
        Ok(())
    }

    /// The stages: layers, card and expert slots of each.
    pub fn stages(&self) -> Vec<StageInfo> {
        self.stages
            .iter()
            .map(|s| StageInfo {
                layers: s.layer_range(),
                device: s.device().ordinal,
                slots: s.cache.as_ref().map_or(0, |c| c.n_slots),
            })
            .collect()
    }

    /// Expert slots of every stage's VRAM cache together (0 without one).
    pub fn slots(&self) -> usize {
        self.stages.iter().filter_map(|s| s.cache.as_ref()).map(|c| c.n_slots).sum()
    }

    /// Whether the model has a VRAM expert cache.
    pub fn has_cache(&self) -> bool {
        self.stages.iter().any(|s| s.cache.is_some())
    }

    /// Replaces the VRAM expert cache with one of `size` (benchmarks; the store's usage is kept). Errors: the
    /// driver's, or a layer split (whose caches are sized at load).
    pub fn rebuild_cache(&mut self, store: &Arc<ExpertStore>, size: CacheSize) -> Result<(), GpuError> {
        match self.stages.as_mut_slice() {
            [one] => one.rebuild_cache(store, size),
            _ => Err(GpuError::Unsupported("the VRAM caches of a layer split are sized at load".into())),
        }
    }

    /// Bytes of the dense weights in VRAM over every stage (read once per token).
    pub fn dense_bytes(&self) -> usize {
        self.stages.iter().map(|s| s.dense_bytes()).sum()
    }

    /// The first stage's device.
    pub fn device(&self) -> &Arc<Device> {
        self.stages[0].device()
    }

    /// Between decode windows: carries out an adaptive round's swaps, each in the cache of the stage owning its
    /// layer (blocking, or started asynchronously), and admits landed asynchronous rounds. `plan` comes from
    /// `ExpertStore::end_decode_window`.
    pub fn adapt(&self, store: &Arc<ExpertStore>, plan: Vec<crate::tiers::policy::Swap>) -> Result<(), GpuError> {
        for (st, part) in self.stages.iter().zip(store.plan_by_stage(plan)) {
            st.adapt(store, part)?;
        }
        Ok(())
    }

    /// The PCIe share that `pcie_auto` has settled on so far on the first stage (`None` before a split layer ran
    /// with it on).
    pub fn pcie_share(&self) -> Option<f32> {
        self.stages[0].pcie_share()
    }

    /// Checks the tiers' bytes against the file after draining any round: every VRAM slot of every stage and
    /// every RAM place holds the expert the residency says, and (resident mode) no expert is in both. One line
    /// per fault.
    pub fn verify_tiers(&self, store: &Arc<ExpertStore>) -> Result<Vec<String>, GpuError> {
        self.drain(store)?;
        for st in &self.stages {
            st.sync()?;
        }
        let mut f = store.verify_ram_copy();
        for st in &self.stages {
            f.extend(st.verify_slots(store)?);
        }
        Ok(f)
    }

    /// At a request's start: waits for every stage's asynchronous round in flight and admits it.
    pub fn drain(&self, store: &Arc<ExpertStore>) -> Result<(), GpuError> {
        for st in &self.stages {
            st.drain(store)?;
        }
        Ok(())
    }
}

impl Backend for GpuModel {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn reads_dense_on_host(&self) -> bool {
        false
    }

    fn new_kv(&self, m: &ModelRef<'_>, n_ctx: usize) -> KvCache {
        // K/V live in VRAM; the host cache only tracks the length
        KvCache::new(0, n_ctx, m.cfg.n_head_kv * m.cfg.head_dim)
    }

    fn forward(
        &self,
        m: &ModelRef<'_>,
        tokens: &[u32],
        kv: &mut KvCache,
        which: Logits,
        s: &mut Scratch,
        body: &mut Body<'_>,
    ) -> Result<Vec<f32>, BackendError> {
        // the host `kv` only tracks the length (K/V live in VRAM); chunks longer than the scratch are split
        let first = &self.stages[0];
        assert!(kv.len + tokens.len() <= first.n_ctx().min(kv.n_ctx), "KV cache overflow");
        let mut out = Vec::new();
        let n = tokens.len();
        let mut i = 0;
        while i < n {
            let end = (i + first.max_t()).min(n);
            let last = end == n;
            let w = match which {
                Logits::All => Some(Logits::All),
                Logits::Last if last => Some(Logits::Last),
                _ => None,
            };
            let mut h = first.chunk(m, StageIn::Tokens(&tokens[i..end]), kv.len, w, s, body)?;
            for st in &self.stages[1..] {
                h = st.chunk(m, StageIn::Hidden(&h), kv.len, w, s, body)?;
            }
            out.extend(h);
            kv.len += end - i;
            i = end;
        }
        Ok(out)
    }

    fn end_window(&self, store: &Arc<ExpertStore>, plan: Vec<crate::tiers::policy::Swap>) -> Result<(), BackendError> {
        Ok(self.adapt(store, plan)?)
    }

    fn drain(&self, store: &Arc<ExpertStore>) -> Result<(), BackendError> {
        Ok(GpuModel::drain(self, store)?)
    }

    fn verify_tiers(&self, store: &Arc<ExpertStore>) -> Result<Vec<String>, BackendError> {
        Ok(GpuModel::verify_tiers(self, store)?)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// VRAM a stage needs beside its layers' weights and KV cache (scratch, kernels, streams), as the auto split
/// counts it; REFERENCE.md §6 adds 96 MiB of window buffers on later stages.
const STAGE_FIXED: u64 = 256 << 20;
const LATER_STAGE_FIXED: u64 = 96 << 20;

/// The stages of `o`'s layer split: the first layer of each and its (opened) device — one stage on the probed
/// device without a split; `--split-device` without `--layer-split` splits `auto` over the devices named.
/// Errors (fatal at start, one line): split points outside `1..n_layer−1`, unsorted or repeated; more stages than
/// devices named (or fewer); a device ordinal that does not exist; no split whose dense weights fit.
pub fn plan_stages(
    m: &ModelRef<'_>,
    o: &crate::backend::GpuOptions,
    probe: &super::Probe,
    cfg: &GpuConfig,
) -> Result<(Vec<usize>, Vec<Arc<Device>>), String> {
    use crate::tiers::split::{auto_split, check_points, layer_ms, stage_devices, LayerSplit, SplitModel};
    use crate::tiers::split::{StageBudget, MISS_MS};
    let n_layer = m.cfg.n_layer;
    let split = match (&o.layer_split, o.split_devices.is_empty()) {
        (None, true) => return Ok((vec![0], vec![probe.device.clone()])),
        (None, false) => LayerSplit::Auto,
        (Some(s), _) => s.clone(),
    };
    let (starts, ordinals) = match split {
        LayerSplit::At(points) => {
            let starts = check_points(&points, n_layer).map_err(|e| e.to_string())?;
            let ords = stage_devices(starts.len(), &o.split_devices, probe.visible).map_err(|e| e.to_string())?;
            (Some(starts), ords)
        }
        LayerSplit::Auto => {
            let n = if o.split_devices.is_empty() { probe.visible } else { o.split_devices.len() };
            let ords = stage_devices(n, &o.split_devices, probe.visible).map_err(|e| e.to_string())?;
            (None, ords)
        }
    };
    let mut devs: Vec<Arc<Device>> = Vec::with_capacity(ordinals.len());
    for &ord in &ordinals {
        let d = match devs.iter().find(|d| d.ordinal == ord) {
            Some(d) => d.clone(),
            None if ord == probe.device.ordinal => probe.device.clone(),
            None => Device::open(ord).map_err(|e| format!("opening CUDA device {ord}: {e}"))?,
        };
        devs.push(d);
    }
    if let Some(starts) = starts {
        return Ok((starts, devs));
    }
    if devs.len() == 1 {
        tracing::info!("--layer-split auto: one device, no split");
        return Ok((vec![0], devs));
    }
    // auto (REFERENCE.md §6): every layer's dense weights and KV, the experts hottest first, each card's room
    let c = m.cfg;
    let q8 = m.kv_type == crate::backend::KvType::Q8_0;
    let kv = 2 * super::ops::KvPtrs::bytes(q8, o.n_ctx, c.n_head_kv * c.head_dim) as u64;
    let layer_bytes: Vec<u64> = m
        .weights
        .blocks
        .iter()
        .map(|b| {
            let mut n = (b.q.bytes() + b.k.bytes() + b.v.bytes() + b.o.bytes()) as u64;
            n += match &b.ffn {
                crate::arch::weights::Ffn::Dense { gate, up, down } => {
                    (gate.bytes() + up.bytes() + down.bytes()) as u64
                }
                crate::arch::weights::Ffn::Moe(ex) => {
                    let sh = ex.shared.as_ref().map_or(0, |s| s.gate.bytes() + s.up.bytes() + s.down.bytes());
                    (ex.router.bytes() + sh) as u64
                }
            };
            n + kv
        })
        .collect();
    let (sb, hot) = match m.experts {
        Some(st) => {
            let blob = st.layout().layers.iter().map(|l| l.blob_bytes()).max().unwrap_or(0);
            (slot_bytes(blob) as u64, st.placement_order())
        }
        None => (0, Vec::new()),
    };
    // as the caches are made (`make_caches`), with the free VRAM before the dense weights load (an upper bound)
    let (card, free) = cards_free(devs.iter().map(|d| &**d)).map_err(|e| e.to_string())?;
    let set = staging_slots(c.n_expert_used, c.n_expert);
    let n_staging = staging_total(cfg, set, sb as usize, c.n_layer * c.n_expert, free, card) as u64;
    let head = m.weights.output.bytes() as u64;
    let mut budgets = Vec::with_capacity(devs.len());
    for (i, d) in devs.iter().enumerate() {
        let (free, _) = d.mem_info().map_err(|e| e.to_string())?;
        let sharing = ordinals.iter().filter(|&&x| x == d.ordinal).count() as u64;
        let reserve = if i == 0 { cfg.reserve } else { cfg.reserve_later };
        let mut fixed = STAGE_FIXED + n_staging * sb;
        if i > 0 {
            fixed += LATER_STAGE_FIXED;
        }
        if i + 1 == devs.len() {
            fixed += head;
        }
        let capacity = ((free as u64) / sharing).saturating_sub(reserve / sharing + fixed);
        budgets.push(StageBudget { capacity, layer_ms: layer_ms(d.sms as u32, d.clock_khz as f64 / 1e6) });
    }
    let miss_ms = std::env::var("STRATA_SPLIT_MISS_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(MISS_MS);
    let model = SplitModel { layer_bytes: &layer_bytes, slot_bytes: sb, n_expert: c.n_expert, hot: &hot };
    let a = auto_split(&model, &budgets, miss_ms)
        .ok_or_else(|| format!("--layer-split auto: {} stages for {n_layer} layers", devs.len()))?;
    if !a.predicted_ms.is_finite() {
        return Err("--layer-split auto: no split fits every stage's dense weights and KV cache on its card".into());
    }
    tracing::info!(
        "--layer-split auto: stages start at layers {:?} on CUDA {:?} (predicted {:.1} ms per token; expert slots \
         {:?})",
        a.starts,
        ordinals,
        a.predicted_ms,
        a.slots
    );
    Ok((a.starts, devs))
}

#[cfg(test)]
mod tests {
    use super::{ahead_wanted, sets_for, staging_slots, CacheSize, GpuConfig};

    #[test]
    fn a_second_set_only_where_uploads_ahead_can_run() {
        let cfg = |cache, prefill_ahead| GpuConfig {
            cache,
            reserve: 700 << 20,
            reserve_later: 700 << 20,
            max_chunk: 512,
            n_ctx: 4096,
            prefill_ahead,
        };
        let (entries, sb) = (6144, 2_654_208u64);
        let all = entries as u64 * sb;
        // half the experts asked: wanted, unless the daemon runs without a RAM copy or --pcie-prefill 0
        assert!(ahead_wanted(&cfg(CacheSize::Slots(3072), true), entries, 80 << 30, sb));
        assert!(!ahead_wanted(&cfg(CacheSize::Slots(3072), false), entries, 80 << 30, sb));
        // every expert asked, or (auto) every expert fits beside the reserve: no
        assert!(!ahead_wanted(&cfg(CacheSize::Slots(6144), true), entries, 0, sb));
        assert!(!ahead_wanted(&cfg(CacheSize::Auto, true), entries, all + (700 << 20), sb));
        // auto, short of the reserve by a byte: yes
        assert!(ahead_wanted(&cfg(CacheSize::Auto, true), entries, all + (700 << 20) - 1, sb));
        // a dense model (no experts): no
        assert!(!ahead_wanted(&cfg(CacheSize::Auto, true), 0, 0, sb));
    }

    #[test]
    fn two_staging_sets_where_one_is_a_small_share_of_the_card() {
        // Qwen3-30B-A3B in Q4_0 (top-8 of 128, 2.53 MiB blobs): 64 slots, 170 MB a set
        let set = staging_slots(8, 128);
        assert_eq!(set, 64);
        let set_bytes = (set * 2_654_208) as u64;
        assert_eq!(sets_for(set_bytes, 80 << 30, true), 2);
        assert_eq!(sets_for(set_bytes, 80 << 30, false), 1, "not wanted: one");
        // a set over 1/32 of the card: one (a 4 GiB card here)
        assert_eq!(sets_for(set_bytes, 4 << 30, true), 1);
        assert_eq!(sets_for(128 << 20, 4 << 30, true), 2);
        // top-2 of 8: every expert fits in one set
        assert_eq!(staging_slots(2, 8), 8);
    }
}
