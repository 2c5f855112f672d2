//! The resident RAM mode (`--resident-experts`, seeds 001 and 003) on the split MoE fixture, with the VRAM cache's
//! slots in host memory ([`HostSlots`]) so the real store and exchange-round code runs without a GPU: the RAM copy
//! is the complement of the slots (VRAM, RAM and file disjoint); blocking rounds and the asynchronous round's
//! steps keep every RAM place and every slot holding exactly the bytes of the expert the residency says (compared
//! with the file), reads between the steps find the right bytes, RAM adapt waits for the flip, and a failed copy
//! leaves the store consistent. Greedy tokens with exchanges running equal the all-in-RAM mode's.

mod common;

use std::sync::Arc;

use common::*;
use strata::gguf::GgufFile;
use strata::model::Model;
use strata::tiers::exchange::{ExchangeRound, HostSlots, SlotCopier};
use strata::tiers::fileio::FileIo;
use strata::tiers::policy::Swap;
use strata::tiers::store::{ExpertStore, Refusal, ResidentMode, Source, Tier};

fn model() -> Model {
    let mut m = Model::load(Arc::new(GgufFile::open(fixture_path("split")).unwrap())).unwrap();
    m.set_threads(2).unwrap();
    m
}

fn blob_bytes(st: &ExpertStore) -> usize {
    st.layout().layers[0].blob_bytes()
}

/// A resident-mode store whose VRAM tier is `n_slots` host slots filled hottest-first, its RAM copy built after.
fn resident(m: &Model, n_slots: usize, budget: Option<u64>, exchange: usize) -> (ExpertStore, HostSlots) {
    let st = store_for(m, &fixture_path("split"), ResidentMode::Disjoint(budget), FileIo::Buffered, None);
    assert!(!st.ram_copy_built());
    let slots = HostSlots::new(n_slots, blob_bytes(&st));
    slots.fill(&st);
    st.build_ram_copy(exchange).unwrap();
    assert!(st.ram_copy_built());
    (st, slots)
}

/// Every fault of the tiers: RAM places against the file (and disjointness), slots against the file.
fn faults(st: &ExpertStore, slots: &HostSlots) -> Vec<String> {
    let mut f = st.verify_ram_copy();
    let b = blob_bytes(st);
    for (l, e, s) in st.slotted() {
        if slots.slot(s, b) != st.file_blob(l, e).unwrap() {
            f.push(format!("slot {s} does not hold expert ({l}, {e})"));
        }
    }
    f
}

/// Decode usage from a skewed routing that moves: window w favours experts shifted by w / 8.
fn route(st: &ExpertStore, windows: std::ops::Range<usize>) {
    let (nl, ne) = (st.layout().n_layer(), st.layout().n_expert);
    for w in windows {
        for l in 0..nl {
            let hot = [(w / 8 + l) % ne, (w / 8 + l + 3) % ne];
            st.plan_layer(l, &hot, &[2, 1], true);
        }
    }
}

#[test]
fn the_ram_copy_is_the_complement_of_the_vram_slots() {
    let m = model();
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let (st, slots) = resident(&m, nl * ne / 4, None, 8);
    assert!(faults(&st, &slots).is_empty(), "{:?}", faults(&st, &slots));
    let (mut vram, mut ram) = (0, 0);
    for l in 0..nl {
        for e in 0..ne {
            match st.tier(l, e) {
                Tier::Vram => vram += 1,
                Tier::Ram => ram += 1,
                Tier::File => panic!("({l}, {e}) left in the file without a budget"),
            }
        }
    }
    assert_eq!((vram, ram), (nl * ne / 4, nl * ne - nl * ne / 4));
    assert_eq!(st.exchange_places_free(), 8);
    // the hottest (placement order) are the ones in VRAM
    let order = st.placement_order();
    assert!(order[..nl * ne / 4].iter().all(|&(l, e)| st.tier(l, e) == Tier::Vram));

    // with a budget: the hottest non-VRAM experts up to it, the rest file-tier
    let b = blob_bytes(&st) as u64;
    let (st, slots) = resident(&m, nl * ne / 4, Some(10 * b), 4);
    assert!(faults(&st, &slots).is_empty());
    let in_ram: Vec<_> = order.iter().filter(|&&(l, e)| st.tier(l, e) == Tier::Ram).copied().collect();
    assert_eq!(in_ram, order[nl * ne / 4..nl * ne / 4 + 10].to_vec());
}

#[test]
fn without_a_gpu_the_resident_mode_is_the_all_in_ram_mode() {
    let mut m = model();
    let prompts: [&[u32]; 1] = [&[504, 3458, 282, 4649, 314]];
    let base = greedy(&m, &prompts, 12);
    let st = store_for(&m, &fixture_path("split"), ResidentMode::Disjoint(None), FileIo::Buffered, None);
    m.experts = Some(Arc::new(st));
    // attaching the backend (the CPU here) builds the copy: every expert, no exchange places
    let off = gpu_options(false, strata::tiers::vram::CacheSize::Auto);
    m.attach_gpu(&off).unwrap();
    let st = m.experts.clone().unwrap();
    assert!(st.ram_copy_built());
    assert_eq!(st.exchange_places_free(), 0);
    assert_eq!(greedy(&m, &prompts, 12), base);
    assert_eq!(st.counters.totals().file_blob_reads, 0);
    assert!(st.verify_ram_copy().is_empty());
}

#[test]
fn blocking_rounds_copy_back_and_every_byte_stays_true() {
    let m = model();
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let (st, slots) = resident(&m, nl * 2, None, 6);
    st.knobs.set("adapt_every", "1").unwrap();
    st.knobs.set("adapt_swaps", "64").unwrap();
    let mut swaps = 0;
    for w in 0..120 {
        route(&st, w..w + 1);
        let plan = st.end_decode_window();
        let (n, fills) = ExchangeRound::run_blocking(&st, &plan, &slots).unwrap();
        assert!(fills.is_empty(), "a full cache has no empty slot");
        assert!(n <= 6, "at most the exchange places per round");
        swaps += n;
        assert!(faults(&st, &slots).is_empty(), "window {w}: {:?}", faults(&st, &slots));
        assert_eq!(st.exchange_places_free(), 6);
    }
    assert!(swaps > 50, "the moving routing should swap (got {swaps})");
    // still disjoint and complete: every expert in exactly one of VRAM / RAM
    let vram = st.slotted().len();
    let ram = (0..nl).flat_map(|l| (0..ne).map(move |e| (l, e))).filter(|&(l, e)| st.tier(l, e) == Tier::Ram).count();
    assert_eq!((vram, ram), (nl * 2, nl * ne - nl * 2));
}

#[test]
fn asynchronous_steps_read_the_right_bytes_between_them() {
    let m = model();
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let (st, slots) = resident(&m, nl * 2, None, nl + 2);
    let b = blob_bytes(&st);
    // one exchange per layer: its coldest VRAM expert out, a RAM expert in
    let plan: Vec<Swap> = (0..nl)
        .map(|l| {
            let out = (0..ne).find(|&e| st.tier(l, e) == Tier::Vram).unwrap();
            let inc = (0..ne).find(|&e| st.tier(l, e) == Tier::Ram).unwrap();
            Swap { layer: l, outgoing: Some(out), incoming: inc, gain: 1.0 }
        })
        .collect();
    let reads = |l: usize, e: usize| -> Vec<u8> {
        match st.plan_layer(l, &[e], &[1], false)[0] {
            Source::Vram(s) => slots.slot(s, b),
            Source::Ram(off) => st.arena().slice(off, b).to_vec(),
            other => panic!("({l}, {e}) read from {other:?}"),
        }
    };
    let check_all = |step: &str| {
        for sw in &plan {
            for e in [sw.outgoing.unwrap(), sw.incoming] {
                assert_eq!(reads(sw.layer, e), st.file_blob(sw.layer, e).unwrap(), "{step}: ({}, {e})", sw.layer);
            }
        }
    };
    let (mut r, fills) = ExchangeRound::reserve(&st, &plan);
    assert!(fills.is_empty());
    assert_eq!(r.exchanges().len(), nl);
    // RAM adapt waits for the flip
    let (l0, in0) = (plan[0].layer, plan[0].incoming);
    assert_eq!(st.promote(l0, in0, in0), Err(Refusal::ExchangeStaged));
    check_all("reserved");
    r.copy_back(&st, &slots).unwrap();
    slots.sync().unwrap();
    check_all("copied back");
    r.stage(&st);
    for sw in &plan {
        assert_eq!(st.tier(sw.layer, sw.outgoing.unwrap()), Tier::Ram, "staged: read from its exchange place");
    }
    check_all("staged");
    r.copy_in(&st, &slots).unwrap();
    check_all("copied in");
    r.land(&st);
    for sw in &plan {
        assert_eq!(st.tier(sw.layer, sw.incoming), Tier::Vram);
    }
    check_all("landed");
    r.move_evicted(&st);
    r.moved();
    check_all("moved");
    assert_eq!(r.flip(&st), nl);
    check_all("flipped");
    assert!(faults(&st, &slots).is_empty(), "{:?}", faults(&st, &slots));
    assert_eq!(st.exchange_places_free(), nl + 2);
    assert_eq!(st.promote(l0, in0, in0), Err(Refusal::InVram(l0, in0)));
}

/// A copier whose copy-ins fail: the round must be undone with the store consistent.
struct FailingIn<'a>(&'a HostSlots);

impl SlotCopier for FailingIn<'_> {
    type Error = String;
    unsafe fn copy_out(&self, slot: u32, dst: *mut u8, len: usize) -> Result<(), String> {
        // SAFETY: forwarded under the caller's guarantee.
        unsafe { self.0.copy_out(slot, dst, len) }.map_err(|e| e.to_string())
    }
    unsafe fn copy_in(&self, _: u32, _: *const u8, _: usize) -> Result<(), String> {
        Err("injected copy-in failure".into())
    }
    fn sync(&self) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn a_failed_copy_in_leaves_the_store_consistent() {
    let m = model();
    let nl = m.cfg.n_layer;
    let (st, slots) = resident(&m, nl * 2, None, 4);
    let ne = m.cfg.n_expert;
    let plan: Vec<Swap> = (0..2)
        .map(|l| {
            let out = (0..ne).find(|&e| st.tier(l, e) == Tier::Vram).unwrap();
            let inc = (0..ne).find(|&e| st.tier(l, e) == Tier::Ram).unwrap();
            Swap { layer: l, outgoing: Some(out), incoming: inc, gain: 1.0 }
        })
        .collect();
    let err = ExchangeRound::run_blocking(&st, &plan, &FailingIn(&slots)).unwrap_err();
    assert!(err.contains("injected"), "{err}");
    // the evicted experts stay readable from their exchange places; the slots went back to the free list
    assert!(st.verify_ram_copy().is_empty(), "{:?}", st.verify_ram_copy());
    for sw in &plan {
        assert_eq!(st.tier(sw.layer, sw.outgoing.unwrap()), Tier::Ram);
        assert_eq!(st.tier(sw.layer, sw.incoming), Tier::Ram);
    }
    assert_eq!(st.slotted().len(), nl * 2 - 2);
    assert_eq!(st.exchange_places_free(), 2);
    // and RAM adapt is no longer held back
    st.knobs.set("ram_adapt", "1").unwrap();
    assert!(st.promote(0, plan[0].incoming, plan[0].incoming).is_err_and(|r| r != Refusal::ExchangeStaged));
}

#[test]
fn a_budget_sends_evicted_experts_of_file_tier_swaps_to_the_file() {
    let m = model();
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let (st, slots) = resident(&m, nl * 2, Some(0), 4);
    // no budget at all: everything outside VRAM is file-tier
    let l = 1;
    let out = (0..ne).find(|&e| st.tier(l, e) == Tier::Vram).unwrap();
    let inc = (0..ne).find(|&e| st.tier(l, e) == Tier::File).unwrap();
    let plan = [Swap { layer: l, outgoing: Some(out), incoming: inc, gain: 1.0 }];
    let (n, _) = ExchangeRound::run_blocking(&st, &plan, &slots).unwrap();
    assert_eq!(n, 1);
    assert_eq!((st.tier(l, out), st.tier(l, inc)), (Tier::File, Tier::Vram));
    assert!(faults(&st, &slots).is_empty(), "{:?}", faults(&st, &slots));
}

#[test]
fn greedy_tokens_with_exchanges_running_equal_the_all_in_ram_modes() {
    let mut m = model();
    let prompts: [&[u32]; 2] = [&[504, 3458, 282, 4649, 314], &[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]];
    let base = greedy(&m, &prompts, 16);
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let (st, slots) = resident(&m, nl * ne / 3, None, 8);
    st.knobs.set("adapt_every", "1").unwrap();
    st.knobs.set("adapt_swaps", "8").unwrap();
    let st = Arc::new(st);
    m.experts = Some(st.clone());
    let mut swaps = 0;
    // this backend computes VRAM experts from the mapping: the RAM places are what is checked
    let got = greedy_with(&m, &prompts, 16, |_| {
        let plan = st.end_decode_window();
        swaps += ExchangeRound::run_blocking(&st, &plan, &slots).unwrap().0;
    });
    assert_eq!(got, base);
    assert!(swaps > 0, "the rounds should have swapped");
    assert!(faults(&st, &slots).is_empty(), "{:?}", faults(&st, &slots));
}

/// A resident-mode store whose VRAM tier is a layer split: stage `i` owns layers `starts[i]..` and `n_slots[i]`
/// host slots filled hottest-first from its own layers; the RAM copy built after every stage.
fn resident_split(m: &Model, starts: &[usize], n_slots: &[usize], exchange: usize) -> (ExpertStore, Vec<HostSlots>) {
    let st = store_for(m, &fixture_path("split"), ResidentMode::Disjoint(None), FileIo::Buffered, None);
    st.init_slot_stages(starts, n_slots).unwrap();
    let mut stages = Vec::new();
    for (range, &n) in st.stage_layers().into_iter().zip(n_slots) {
        let s = HostSlots::new(n, blob_bytes(&st));
        s.fill_layers(&st, range);
        stages.push(s);
    }
    st.build_ram_copy(exchange).unwrap();
    (st, stages)
}

/// Every fault of a split's tiers: RAM places against the file, each slot against the file in its own stage.
fn split_faults(st: &ExpertStore, stages: &[HostSlots]) -> Vec<String> {
    let mut f = st.verify_ram_copy();
    let b = blob_bytes(st);
    for (l, e, s) in st.slotted() {
        if stages[st.stage_of(l)].slot(s, b) != st.file_blob(l, e).unwrap() {
            f.push(format!("stage {} slot {s} does not hold expert ({l}, {e})", st.stage_of(l)));
        }
    }
    f
}

#[test]
fn a_split_fills_each_stage_from_its_own_layers() {
    let m = model();
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let starts = [0, nl / 2];
    let (st, stages) = resident_split(&m, &starts, &[nl / 2 * 2, (nl - nl / 2) * 3], 4);
    assert!(split_faults(&st, &stages).is_empty(), "{:?}", split_faults(&st, &stages));
    assert_eq!(st.stage_layers(), vec![0..nl / 2, nl / 2..nl]);
    for l in 0..nl {
        let vram = (0..ne).filter(|&e| st.tier(l, e) == Tier::Vram).count();
        // each stage's slots over its own layers, hottest first (expert-major without a profile: 2 or 3 per layer)
        assert_eq!(vram, if l < nl / 2 { 2 } else { 3 }, "layer {l}");
        assert_eq!(st.stage_of(l), usize::from(l >= nl / 2));
    }
    // slot numbers are each stage's own, from 0
    let mut per_stage = [Vec::new(), Vec::new()];
    for (l, _, s) in st.slotted() {
        per_stage[st.stage_of(l)].push(s);
    }
    for (i, mut v) in per_stage.into_iter().enumerate() {
        v.sort();
        assert_eq!(v, (0..stages[i].n_slots() as u32).collect::<Vec<_>>(), "stage {i}");
    }
    // VRAM (either stage) and RAM disjoint and complete
    let ram = (0..nl).flat_map(|l| (0..ne).map(move |e| (l, e))).filter(|&(l, e)| st.tier(l, e) == Tier::Ram).count();
    assert_eq!(ram + st.slotted().len(), nl * ne);
    // bad stage lists are refused
    assert!(st.init_slot_stages(&[1, 3], &[1, 1]).is_err());
    assert!(st.init_slot_stages(&[0, 3, 3], &[1, 1, 1]).is_err());
    assert!(st.init_slot_stages(&[0, nl], &[1, 1]).is_err());
    assert!(st.init_slot_stages(&[0, 2], &[1]).is_err());
}

#[test]
fn split_rounds_copy_back_from_the_owning_stage() {
    let m = model();
    let nl = m.cfg.n_layer;
    let starts = [0, nl / 3, 2 * nl / 3];
    let n_slots: Vec<usize> = strata::tiers::split::stage_ranges(&starts, nl).iter().map(|r| r.len() * 2).collect();
    let (st, stages) = resident_split(&m, &starts, &n_slots, 6);
    st.knobs.set("adapt_every", "1").unwrap();
    st.knobs.set("adapt_swaps", "64").unwrap();
    let mut swaps = [0usize; 3];
    for w in 0..90 {
        route(&st, w..w + 1);
        let plan = st.end_decode_window();
        let n_plan = plan.len();
        let parts = st.plan_by_stage(plan);
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), n_plan);
        for (i, part) in parts.iter().enumerate() {
            assert!(part.iter().all(|sw| st.stage_of(sw.layer) == i), "a swap in another stage's plan");
            // each stage's swaps copy back from (and into) its own slots
            let (n, fills) = ExchangeRound::run_blocking(&st, part, &stages[i]).unwrap();
            assert!(fills.is_empty());
            swaps[i] += n;
        }
        assert!(split_faults(&st, &stages).is_empty(), "window {w}: {:?}", split_faults(&st, &stages));
    }
    assert!(swaps.iter().all(|&n| n > 5), "every stage swaps: {swaps:?}");

    // the seed's bug: a later stage's swap copied back from the first stage's cache — the byte check catches it
    let (st, stages) = resident_split(&m, &starts, &n_slots, 6);
    let l = nl - 1;
    let ne = m.cfg.n_expert;
    let out = (0..ne).find(|&e| st.tier(l, e) == Tier::Vram).unwrap();
    let inc = (0..ne).find(|&e| st.tier(l, e) == Tier::Ram).unwrap();
    let plan = [Swap { layer: l, outgoing: Some(out), incoming: inc, gain: 1.0 }];
    ExchangeRound::run_blocking(&st, &plan, &stages[0]).unwrap();
    let f = split_faults(&st, &stages);
    assert!(!f.is_empty(), "a copy-back from the wrong stage's slots must show as a fault");
}
