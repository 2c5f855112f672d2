//! The placement plan (`strata-daemon --plan`, and a log block at every start): from the model and the free VRAM,
//! available RAM and `RLIMIT_MEMLOCK`, what goes where — dense weights, the KV cache at the context asked, VRAM
//! expert slots, the resident RAM copy, the file tier — with the bytes of each and the bytes one token is
//! expected to move over each link. Pure arithmetic over [`PlanInput`], with the same rules the load then applies
//! ([`super::vram::auto_slots`], [`super::store::choose_places`], [`super::store::fit_to_memory`]), so it is
//! tested without a GPU. Its RAM copy is the one the daemon allocates. With a GPU, the backend first makes the
//! load's allocations on the card (the kernel module, dense weights, KV cache, scratch and expert cache, nothing
//! uploaded) and frees them ([`Measured`]), so the VRAM slots are the load's, the driver's rounding and the
//! module's VRAM included; without that trial (it failed) they are an estimate from the sizes asked.

use std::fmt;

use super::layout::ExpertLayout;
use super::store::{choose_places, fit_to_memory, ResidentMode, EXCHANGE_PLACES};
use super::vram::{auto_slots, slot_bytes, CacheSize};

/// Host memory as the plan sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// `MemAvailable` of /proc/meminfo (bytes; `None`: unknown).
    pub ram_available: Option<u64>,
    /// The soft `RLIMIT_MEMLOCK` (bytes; `None`: unlimited).
    pub memlock: Option<u64>,
}

impl Memory {
    /// This machine's figures now.
    pub fn probe() -> Memory {
        use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
        let memlock = match getrlimit(Resource::RLIMIT_MEMLOCK) {
            Ok((soft, _)) if soft == RLIM_INFINITY => None,
            Ok((soft, _)) => Some(soft),
            Err(_) => Some(0),
        };
        Memory { ram_available: super::store::mem_available(), memlock }
    }
}

/// The GPU of a one-stage load as the plan sees it before the load (bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    /// The device's name.
    pub name: String,
    /// Free VRAM now.
    pub free: u64,
    /// The device's VRAM.
    pub total: u64,
    /// Dense weights as uploaded (attention, dense FFN or routers, shared experts, norms, output head).
    pub dense: u64,
    /// The KV cache at the context asked.
    pub kv: u64,
    /// Scratch buffers for the prefill chunk (an estimate: without the kernel module and the driver's rounding).
    pub scratch: u64,
    /// Staging slots of the expert cache (one blob each: misses uploaded over PCIe).
    pub staging_slots: usize,
    /// VRAM kept free by `--expert-cache auto` (`--vram-reserve-mib`).
    pub reserve: u64,
    /// What a trial of the load's allocations measured on the card (`None`: no trial; see `trial_error`).
    pub measured: Option<Measured>,
    /// Why the trial failed (the driver's error, e.g. out of memory), when it did.
    pub trial_error: Option<String>,
}

/// What a trial of a one-stage load's allocations measured on the card (bytes; each freed after).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// Free VRAM with the kernel module, dense weights, KV cache and scratch allocated.
    pub free_after_load: u64,
    /// Whether the kernel module was loaded (`false`: not compiled yet, so its VRAM is not counted).
    pub module: bool,
    /// Expert slots the cache took, by the load's rule.
    pub slots: usize,
    /// Free VRAM with the expert cache allocated too.
    pub free_after: u64,
}

impl GpuView {
    /// VRAM the load takes beyond the sizes it asks for (the kernel module, the driver's rounding), when
    /// measured.
    pub fn overhead(&self) -> Option<u64> {
        let m = self.measured?;
        Some(self.free.saturating_sub(m.free_after_load).saturating_sub(self.dense + self.kv + self.scratch))
    }
}

/// What the plan is computed from.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    /// The model's experts (`None`: a dense model).
    pub layout: Option<&'a ExpertLayout>,
    /// Experts per token in each MoE layer (top-k).
    pub top_k: usize,
    /// Placement order, hottest first (`layer × n_expert + expert`; the expert profile's ranks, then expert-major
    /// across layers, as the store orders them).
    pub order: Vec<usize>,
    /// Each expert's share of its layer's routings (`layer × n_expert + expert`; a layer's shares sum to 1), from
    /// the expert profile; `None`: uniform.
    pub share: Option<Vec<f64>>,
    /// Bytes of the tensors that are not experts (where the dense weights live: the file mapping on the CPU).
    pub dense_bytes: u64,
    /// Of those, the bytes a token reads (all but the token embeddings, of which it reads one row, unless the
    /// output head shares them).
    pub dense_read_bytes: u64,
    /// Bytes of the KV cache at `n_ctx` positions on the host (the CPU backend's; the GPU's is [`GpuView::kv`]).
    pub kv_bytes: u64,
    /// Context length asked (KV positions).
    pub n_ctx: usize,
    /// The RAM copy's mode (`--resident-experts`, `--resident-budget-gib`, `--mmap-experts`).
    pub mode: ResidentMode,
    /// Memory the RAM copy leaves free ([`super::store::StoreConfig::headroom`]).
    pub headroom: u64,
    /// Whether the RAM copy is to be locked (`false`: `--no-mlock`).
    pub lock: bool,
    /// `--expert-cache`.
    pub cache: CacheSize,
    /// The GPU (`None`: CPU only).
    pub gpu: Option<GpuView>,
    /// `--pcie-frac`: share of the RAM-resident misses' bytes uploaded and computed on the GPU.
    pub pcie_frac: f64,
    /// Host memory.
    pub mem: Memory,
}

/// Where one kind of data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Device memory.
    Vram,
    /// Host memory (the file mapping for weights, the heap for the KV cache).
    Ram,
}

/// The placement plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Where the dense weights and the KV cache live.
    pub dense_place: Place,
    /// Dense weights (bytes).
    pub dense_bytes: u64,
    /// KV cache at [`Plan::n_ctx`] positions (bytes).
    pub kv_bytes: u64,
    /// Context length.
    pub n_ctx: usize,
    /// GPU scratch (bytes; 0 without a GPU).
    pub scratch_bytes: u64,
    /// VRAM expert slots.
    pub slots: usize,
    /// Bytes of one slot (0 without a GPU or experts).
    pub slot_bytes: u64,
    /// Staging slots.
    pub staging_slots: usize,
    /// VRAM left free after the load (bytes; `None` without a GPU).
    pub vram_free_after: Option<u64>,
    /// Experts the RAM copy holds (in every mode but the resident one some may also be in VRAM).
    pub ram_copy_experts: usize,
    /// Bytes of the RAM copy's experts (without exchange places).
    pub ram_copy_bytes: u64,
    /// Exchange places of the resident mode (one largest blob each).
    pub exchange_places: usize,
    /// Bytes of the exchange places.
    pub exchange_bytes: u64,
    /// Whether `RLIMIT_MEMLOCK` lets the copy be locked.
    pub lockable: bool,
    /// Experts per tier, each counted once at its fastest tier: VRAM, RAM, file.
    pub experts: [usize; 3],
    /// Bytes per tier, as [`Plan::experts`].
    pub bytes: [u64; 3],
    /// Expected share of routings served from each tier (VRAM, RAM, file).
    pub hit_share: [f64; 3],
    /// Expected bytes one decode token moves at a full context: VRAM reads (dense, KV, VRAM experts), PCIe
    /// uploads, RAM reads by the CPU pool, file reads.
    pub per_token: Links,
    /// Whether the routing shares came from an expert profile (else uniform).
    pub profiled: bool,
    /// The inputs' memory figures.
    pub mem: Memory,
    /// The GPU.
    pub gpu: Option<GpuView>,
    /// Warnings (each one line).
    pub notes: Vec<String>,
}

/// Bytes per decode token over each link.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Links {
    /// Read from device memory.
    pub vram: f64,
    /// Uploaded host → device.
    pub pcie: f64,
    /// Read from host memory by the CPU.
    pub ram: f64,
    /// Read from the model file.
    pub file: f64,
}

/// Computes the plan.
pub fn plan(p: &PlanInput<'_>) -> Plan {
    let mut notes = Vec::new();
    let gpu = p.gpu.clone();
    let (ne, entries) = p.layout.map_or((0, 0), |l| (l.n_expert, l.n_layer() * l.n_expert));
    let blob = |i: usize| p.layout.map_or(0, |l| l.layers[i / ne].blob_bytes() as u64);
    let max_blob = p.layout.and_then(|l| l.layers.iter().map(|x| x.blob_bytes()).max()).unwrap_or(0);
    // VRAM: dense weights, KV, scratch, staging, then slots by the load's rule
    let (mut slots, mut sb, mut staging, mut free_after, mut scratch) = (0usize, 0u64, 0usize, None, 0u64);
    let (dense_place, dense_bytes, kv_bytes) = match &gpu {
        Some(g) => (Place::Vram, g.dense, g.kv),
        None => (Place::Ram, p.dense_bytes, p.kv_bytes),
    };
    if let Some(g) = &gpu {
        scratch = g.scratch;
        let fixed = g.dense + g.kv + g.scratch;
        if fixed > g.free {
            notes.push(format!(
                "dense weights, KV cache and buffers ({}) do not fit in the GPU's free {}: lower --ctx or --batch, \
                 or run with --gpu off",
                size(fixed),
                size(g.free)
            ));
        }
        let mut room = g.free.saturating_sub(fixed);
        if entries > 0 {
            sb = slot_bytes(max_blob) as u64;
            staging = g.staging_slots;
            room = room.saturating_sub(staging as u64 * sb);
            slots = match p.cache {
                CacheSize::Auto => auto_slots(room, g.reserve, sb, entries),
                CacheSize::Slots(k) => k.min(entries).min((room.saturating_sub(64 << 20) / sb) as usize),
            };
            room = room.saturating_sub(slots as u64 * sb);
        }
        free_after = Some(room);
        match (&g.measured, &g.trial_error) {
            (Some(m), _) => {
                if entries > 0 {
                    slots = m.slots;
                }
                free_after = Some(m.free_after);
                if !m.module {
                    notes.push(
                        "the GPU kernels are not compiled yet (the load compiles them): their VRAM is not in the \
                         figures"
                            .into(),
                    );
                }
            }
            (None, Some(e)) => notes.push(format!(
                "the trial allocation on the GPU failed ({e}): VRAM figures are estimates from the sizes asked"
            )),
            (None, None) => {}
        }
    }
    let in_vram: Vec<bool> = {
        let mut v = vec![false; entries];
        for &i in p.order.iter().take(slots) {
            v[i] = true;
        }
        v
    };
    // the RAM copy, by the store's rule
    let total: u64 = (0..entries).map(blob).sum();
    let (order, budget, stop_at_first, exchange) = match p.mode {
        ResidentMode::Mmap => (Vec::new(), 0, true, 0),
        ResidentMode::All => (p.order.clone(), fit_to_memory(total, p.mem.ram_available, p.headroom), true, 0),
        ResidentMode::Budget(b) => {
            (p.order.clone(), fit_to_memory(b.min(total), p.mem.ram_available, p.headroom), false, 0)
        }
        ResidentMode::Disjoint(b) => {
            let rest: Vec<usize> = p.order.iter().copied().filter(|&i| !in_vram[i]).collect();
            let want =
                b.map_or_else(|| rest.iter().map(|&i| blob(i)).sum(), |b| b.min(rest.iter().map(|&i| blob(i)).sum()));
            let x = if slots == 0 { 0 } else { EXCHANGE_PLACES.min(rest.len()) };
            let extra = x as u64 * max_blob as u64;
            let fit = fit_to_memory(want + extra, p.mem.ram_available, p.headroom).saturating_sub(extra);
            (rest, fit, b.is_none(), x)
        }
    };
    let (place, used, chosen) = match p.layout {
        Some(l) => choose_places(l, &order, budget, stop_at_first),
        None => (Vec::new(), 0, Vec::new()),
    };
    let exchange_bytes = exchange as u64 * max_blob as u64;
    let lockable = p.lock && p.mem.memlock.is_none_or(|m| m >= used + exchange_bytes);
    if p.mode == ResidentMode::All && used < total {
        notes.push(format!(
            "not every expert fits in RAM ({} of {} in {} available less {} headroom): the rest are read from the \
             file; --resident-experts with a GPU keeps VRAM and RAM disjoint",
            size(used),
            size(total),
            p.mem.ram_available.map_or("?".into(), size),
            size(p.headroom)
        ));
    }
    if p.lock && !lockable && used > 0 {
        notes.push(format!(
            "RLIMIT_MEMLOCK ({}) is below the RAM copy ({}): it stays pageable (raise `ulimit -l`, or \
             LimitMEMLOCK=infinity in the systemd unit)",
            p.mem.memlock.map_or("unlimited".into(), size),
            size(used + exchange_bytes)
        ));
    }
    // tiers, and the routings each serves
    let mut experts = [0usize; 3];
    let mut bytes = [0u64; 3];
    let mut hit = [0f64; 3];
    let mut expert_bytes = [0f64; 3];
    let n_layer = p.layout.map_or(0, |l| l.n_layer());
    for i in 0..entries {
        let t = if in_vram[i] {
            0
        } else if place[i].is_some() {
            1
        } else {
            2
        };
        experts[t] += 1;
        bytes[t] += blob(i);
        let s = p.share.as_ref().map_or(1.0 / ne as f64, |s| s[i]);
        hit[t] += s / n_layer.max(1) as f64;
        expert_bytes[t] += p.top_k as f64 * s * blob(i) as f64;
    }
    let mut per_token = Links { file: expert_bytes[2], ..Default::default() };
    match dense_place {
        Place::Vram => {
            per_token.vram = (p.dense_read_bytes.min(dense_bytes) + kv_bytes) as f64 + expert_bytes[0];
            per_token.pcie = p.pcie_frac * expert_bytes[1];
            per_token.ram = (1.0 - p.pcie_frac) * expert_bytes[1];
        }
        Place::Ram => per_token.ram = (p.dense_read_bytes + kv_bytes) as f64 + expert_bytes[1],
    }
    Plan {
        dense_place,
        dense_bytes,
        kv_bytes,
        n_ctx: p.n_ctx,
        scratch_bytes: scratch,
        slots,
        slot_bytes: sb,
        staging_slots: staging,
        vram_free_after: free_after,
        ram_copy_experts: chosen.len(),
        ram_copy_bytes: used,
        exchange_places: exchange,
        exchange_bytes,
        lockable,
        experts,
        bytes,
        hit_share: hit,
        per_token,
        profiled: p.share.is_some(),
        mem: p.mem,
        gpu,
        notes,
    }
}

/// Bytes as `123 B`, `4.0 KiB`, `12.3 MiB` or `1.23 GiB`.
pub fn size(b: u64) -> String {
    let f = b as f64;
    if b < 1 << 10 {
        format!("{b} B")
    } else if b < 1 << 20 {
        format!("{:.1} KiB", f / 1024.0)
    } else if b < 1 << 30 {
        format!("{:.1} MiB", f / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", f / (1u64 << 30) as f64)
    }
}

impl fmt::Display for Plan {
    /// The plan as lines of text (the `--plan` output; the log block at start prints the same lines).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ram = self.mem.ram_available.map_or("unknown".into(), size);
        let lock = self.mem.memlock.map_or("unlimited".into(), size);
        write!(f, "memory: RAM available {ram}, memlock limit {lock}")?;
        match &self.gpu {
            Some(g) => writeln!(f, "; GPU {}: {} free of {}", g.name, size(g.free), size(g.total))?,
            None => writeln!(f, "; no GPU")?,
        }
        let (w, how) = match self.dense_place {
            Place::Vram => ("VRAM", "uploaded"),
            Place::Ram => ("RAM ", "file mapping"),
        };
        writeln!(f, "dense weights  {w}  {:>10}  ({how})", size(self.dense_bytes))?;
        writeln!(f, "KV cache       {w}  {:>10}  ({} positions)", size(self.kv_bytes), self.n_ctx)?;
        if let Some(g) = &self.gpu {
            match g.overhead() {
                Some(o) => writeln!(
                    f,
                    "GPU buffers    VRAM  {:>10}  (scratch; + {} kernels and driver rounding, measured)",
                    size(self.scratch_bytes),
                    size(o)
                )?,
                None => writeln!(f, "GPU buffers    VRAM  {:>10}  (scratch)", size(self.scratch_bytes))?,
            }
        }
        let total: usize = self.experts.iter().sum();
        if total > 0 {
            let pct = |n: usize| 100.0 * n as f64 / total as f64;
            if self.gpu.is_some() {
                writeln!(
                    f,
                    "expert slots   VRAM  {:>10}  ({} slots of {}, {:.1}% of {total} experts; + {} staging slots)",
                    size(self.slots as u64 * self.slot_bytes),
                    self.slots,
                    size(self.slot_bytes),
                    pct(self.slots),
                    self.staging_slots
                )?;
            }
            let lock = if self.ram_copy_bytes == 0 {
                ""
            } else if self.lockable {
                ", page-locked"
            } else if self.notes.iter().any(|n| n.starts_with("RLIMIT_MEMLOCK")) {
                ", pageable (memlock limit)"
            } else {
                ", pageable (--no-mlock)"
            };
            let x = if self.exchange_places > 0 {
                format!(" + {} exchange places ({})", self.exchange_places, size(self.exchange_bytes))
            } else {
                String::new()
            };
            writeln!(
                f,
                "RAM copy       RAM   {:>10}  ({} experts{x}{lock}; {} served from RAM)",
                size(self.ram_copy_bytes),
                self.ram_copy_experts,
                self.experts[1]
            )?;
            writeln!(f, "file tier      file  {:>10}  ({} experts)", size(self.bytes[2]), self.experts[2])?;
            writeln!(
                f,
                "routings (expected, {}): VRAM {:.1}%, RAM {:.1}%, file {:.1}%",
                if self.profiled { "expert profile" } else { "uniform routing" },
                100.0 * self.hit_share[0],
                100.0 * self.hit_share[1],
                100.0 * self.hit_share[2]
            )?;
        }
        let t = &self.per_token;
        let s = |x: f64| size(x.round() as u64);
        writeln!(
            f,
            "per decode token at a full context (expected): VRAM reads {}, PCIe {}, RAM reads {}, file reads {}",
            s(t.vram),
            s(t.pcie),
            s(t.ram),
            s(t.file)
        )?;
        if let Some(free) = self.vram_free_after {
            writeln!(f, "VRAM free after the load: {}", size(free))?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiers::layout::{LayerLayout, RoleSlice};

    fn layout(n_layer: usize, ne: usize, blob: usize) -> ExpertLayout {
        let r = RoleSlice { base: 0, bytes: blob / 3, ty: crate::quant::GgmlType::Q8_0, rows: 1, cols: 1 };
        ExpertLayout { n_expert: ne, layers: vec![LayerLayout { gate: r, up: r, down: r }; n_layer] }
    }

    fn input(l: &ExpertLayout) -> PlanInput<'_> {
        let ne = l.n_expert;
        let mut order: Vec<usize> = (0..l.n_layer() * ne).collect();
        order.sort_by_key(|&i| (i % ne, i / ne));
        PlanInput {
            layout: Some(l),
            top_k: 2,
            order,
            share: None,
            dense_bytes: 100 << 20,
            dense_read_bytes: 100 << 20,
            kv_bytes: 10 << 20,
            n_ctx: 4096,
            mode: ResidentMode::All,
            headroom: 4 << 30,
            lock: true,
            cache: CacheSize::Auto,
            gpu: None,
            pcie_frac: 0.0,
            mem: Memory { ram_available: Some(64 << 30), memlock: None },
        }
    }

    #[test]
    fn cpu_all_in_ram_and_clamped_to_memory() {
        let l = layout(4, 8, 3 << 20); // 32 experts of 3 MiB
        let p = plan(&input(&l));
        assert_eq!((p.slots, p.ram_copy_experts, p.ram_copy_bytes), (0, 32, 96 << 20));
        assert_eq!(p.experts, [0, 32, 0]);
        assert!((p.hit_share[1] - 1.0).abs() < 1e-12);
        // per token: dense + KV + top-2 of each of 4 layers
        assert_eq!(p.per_token.ram, ((110 << 20) + 4 * 2 * (3 << 20)) as f64);
        // 4 GiB + 50 MiB available: 50 MiB fit after the headroom, the hottest 16 experts (whole ones)
        let mut i = input(&l);
        i.mem.ram_available = Some((4 << 30) + (50 << 20));
        let p = plan(&i);
        assert_eq!((p.ram_copy_experts, p.ram_copy_bytes, p.experts[2]), (16, 48 << 20, 16));
        assert!(p.notes.iter().any(|n| n.contains("not every expert fits")), "{:?}", p.notes);
        assert!((p.per_token.file - 4.0 * 2.0 * 0.5 * (3 << 20) as f64).abs() < 1.0);
        // memlock below the copy
        let mut i = input(&l);
        i.mem.memlock = Some(8 << 20);
        let p = plan(&i);
        assert!(!p.lockable && p.notes.iter().any(|n| n.contains("RLIMIT_MEMLOCK")));
        let text = p.to_string();
        assert!(text.contains("96.0 MiB  (32 experts, pageable (memlock limit); 32 served from RAM)"), "{text}");
    }

    #[test]
    fn gpu_slots_by_the_auto_rule_and_disjoint_ram() {
        let l = layout(4, 8, 3 << 20);
        let mut i = input(&l);
        let g = GpuView {
            name: "Test".into(),
            free: 1 << 30,
            total: 2 << 30,
            dense: 200 << 20,
            kv: 40 << 20,
            scratch: 60 << 20,
            staging_slots: 8,
            reserve: 700 << 20,
            measured: None,
            trial_error: Some("out of memory".into()),
        };
        i.gpu = Some(g.clone());
        i.mode = ResidentMode::Disjoint(None);
        let p = plan(&i);
        // room = 1024 − 300 − 8 × 3 = 700 MiB... minus the 700 MiB reserve: no slots
        assert_eq!(p.slots, 0);
        i.gpu = Some(GpuView { reserve: 400 << 20, ..g.clone() });
        let p = plan(&i);
        // (700 − 400) / 3 = 100, at most the 32 experts
        assert_eq!(p.slots, 32);
        assert_eq!(p.experts, [32, 0, 0]);
        i.gpu = Some(GpuView { reserve: 640 << 20, ..g });
        let p = plan(&i);
        assert_eq!(p.slots, 20);
        // the resident mode's copy holds the 12 others and 12 exchange places (no more than the experts left)
        assert_eq!((p.ram_copy_experts, p.exchange_places), (12, 12));
        assert_eq!(p.experts, [20, 12, 0]);
        assert_eq!(p.vram_free_after, Some(640 << 20));
        // the slots are the first 20 in placement order: experts 0-4 of every layer → 5/8 of the routings
        assert!((p.hit_share[0] - 5.0 / 8.0).abs() < 1e-12, "{:?}", p.hit_share);
        // a PCIe share moves that part of the RAM misses' bytes to the link
        i.pcie_frac = 0.5;
        let q = plan(&i);
        assert!((q.per_token.pcie - q.per_token.ram).abs() < 1.0 && q.per_token.pcie > 0.0);
        assert!(
            q.to_string().contains("60.0 MiB  (20 slots of 3.0 MiB, 62.5% of 32 experts; + 8 staging slots)"),
            "{q}"
        );
        assert!(q.notes.iter().any(|n| n.contains("trial allocation on the GPU failed (out of memory)")), "{q}");
        assert!(q.to_string().contains("60.0 MiB  (scratch)\n"), "{q}");
    }

    #[test]
    fn a_measured_trial_sets_the_slots_and_the_ram_copy_follows() {
        let l = layout(4, 8, 3 << 20);
        let mut i = input(&l);
        // the trial found 30 MiB more taken than asked (module, rounding) and took 18 slots
        let m = Measured { free_after_load: (1024 - 330) << 20, module: true, slots: 18, free_after: 630 << 20 };
        i.gpu = Some(GpuView {
            name: "Test".into(),
            free: 1 << 30,
            total: 2 << 30,
            dense: 200 << 20,
            kv: 40 << 20,
            scratch: 60 << 20,
            staging_slots: 8,
            reserve: 640 << 20,
            measured: Some(m),
            trial_error: None,
        });
        i.mode = ResidentMode::Disjoint(None);
        let p = plan(&i);
        assert_eq!((p.slots, p.vram_free_after), (18, Some(630 << 20)));
        assert_eq!((p.ram_copy_experts, p.experts), (14, [18, 14, 0]));
        assert!(p.notes.is_empty(), "{:?}", p.notes);
        assert!(p.to_string().contains("(scratch; + 30.0 MiB kernels and driver rounding, measured)"), "{p}");
        // without the module in the disk cache, a note says its VRAM is left out
        i.gpu.as_mut().unwrap().measured = Some(Measured { module: false, ..m });
        assert!(plan(&i).notes.iter().any(|n| n.contains("not compiled yet")));
    }

    #[test]
    fn profile_shares_move_the_expected_hits() {
        let l = layout(1, 4, 3 << 20);
        let mut i = input(&l);
        // the hottest two by the profile take 90% of the routings
        i.order = vec![2, 3, 0, 1];
        i.share = Some(vec![0.05, 0.05, 0.5, 0.4]);
        i.mode = ResidentMode::Budget(6 << 20);
        let p = plan(&i);
        assert_eq!(p.experts, [0, 2, 2]);
        assert!((p.hit_share[1] - 0.9).abs() < 1e-12);
        assert!(p.to_string().contains("expert profile"));
    }
}
