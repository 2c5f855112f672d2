//! The VRAM tier's host side, without a GPU: the store's slot record (reserve, admit, evict), lookups planned
//! as VRAM hits, the adaptive round planned from usage on the slot record (DESIGN.md §5), residency and profile
//! order; and `synth-moe`'s router skew (the share of routing the hottest experts take grows with `--skew`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use strata::gguf::GgufFile;
use strata::model::forward::Scratch;
use strata::model::{Logits, Model};
use strata::tiers::knobs::Knobs;
use strata::tiers::store::{ExpertStore, Source, StoreConfig, Tier};

fn synth(dir: &Path, name: &str, skew: f32) -> PathBuf {
    let out = dir.join(name);
    let st = Command::new(env!("CARGO_BIN_EXE_strata-tools"))
        .args(["synth-moe", "--preset", "tiny", "--skew", &skew.to_string(), "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    out
}

fn tmp(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-vram-tier-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn load(path: &Path, knobs: Arc<Knobs>) -> Model {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let mut m = Model::load(file.clone()).unwrap();
    m.set_threads(2).unwrap();
    let layout = m.expert_layout().unwrap();
    let cfg = StoreConfig { lock: false, ..Default::default() };
    let g = m.geometry();
    m.experts = Some(Arc::new(ExpertStore::new(layout, file, path, g, None, &cfg, knobs).unwrap()));
    m
}

#[test]
fn slot_record_hits_adaptive_plan_residency_and_profile() {
    let dir = tmp("slots");
    let path = synth(&dir, "tiny.gguf", 1.0);
    let knobs = Arc::new(Knobs::default());
    knobs.set("adapt_every", "1").unwrap();
    knobs.set("adapt_policy", "seed").unwrap();
    let m = load(&path, knobs);
    let st = m.experts.clone().unwrap();
    let ne = st.layout().n_expert;
    // 4 slots, filled in placement order (expert-major across layers without a profile)
    st.init_slots(4);
    let order = st.placement_order();
    assert_eq!(order[0], (0, 0));
    assert_eq!(order[1], (1, 0), "expert-major across layers");
    for &(l, e) in order.iter().take(4) {
        let s = st.reserve_slot(l).unwrap();
        st.admit_slot(l, e, s);
    }
    assert!(st.reserve_slot(0).is_none(), "all slots taken");
    assert!(!st.all_in_vram());
    let table = st.slot_table();
    assert_eq!(table.iter().filter(|&&s| s >= 0).count(), 4);
    assert_eq!(st.tier(0, 0), Tier::Vram);
    assert_eq!(st.tier(0, 1), Tier::Ram);
    // lookups: a cached expert is a VRAM hit, the others RAM reads
    let before = st.counters.totals();
    let src = st.plan_layer(0, &[0, 5], &[1, 3], true);
    assert!(matches!(src[0], Source::Vram(_)));
    assert!(matches!(src[1], Source::Ram(_)));
    let d = st.counters.totals().since(&before);
    assert_eq!((d.lookups, d.vram_hits, d.ram_reads), (2, 1, 1));
    // expert 5 of layer 0 now has usage 3 ≥ 2 and ≥ 0 + 1.5 over the cached (0, 0) with usage 1: the round
    // swaps them; nothing else qualifies
    let plan = st.end_decode_window();
    assert_eq!(plan.len(), 1, "{plan:?}");
    assert_eq!((plan[0].layer, plan[0].outgoing, plan[0].incoming), (0, Some(0), 5));
    // carrying it out: evict (stops GPU planning), then admit into the same slot
    let slot = st.evict_slot(0, 0).unwrap();
    assert_eq!(st.tier(0, 0), Tier::Ram);
    assert!(matches!(st.plan_layer(0, &[0], &[1], false)[0], Source::Ram(_)));
    st.admit_slot(0, 5, slot);
    assert_eq!(st.slot_table()[5], slot as i32);
    assert_eq!(st.slot_table()[0], -1);
    // residency and profile: VRAM experts first
    let (layers, experts) = st.residency();
    assert_eq!(layers[0].experts[Tier::Vram as usize], 1);
    assert_eq!(experts.iter().filter(|x| x.tier == Tier::Vram).count(), 4);
    let prof = st.profile_now();
    let vram: Vec<(u16, u16)> = prof.ranked.iter().take(4).map(|r| (r.0, r.1)).collect();
    for (l, e) in vram {
        assert_eq!(st.tier(l as usize, e as usize), Tier::Vram, "profile ranks VRAM experts first");
    }
    // every expert in VRAM → no lookup can miss
    st.init_slots(st.layout().n_layer() * ne);
    for &(l, e) in &st.placement_order() {
        let s = st.reserve_slot(l).unwrap();
        st.admit_slot(l, e, s);
    }
    assert!(st.all_in_vram());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Share of routing entries that go to each layer's hottest quarter of experts, over a CPU forward pass.
fn top_quarter_share(path: &Path) -> f64 {
    let m = load(path, Arc::new(Knobs::default()));
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let mut kv = m.new_kv(300);
    let mut s = Scratch::default();
    s.routes = Some(Vec::new());
    let toks: Vec<u32> = (0..256u32).map(|i| (i * 7919 + 13) % m.cfg.n_vocab as u32).collect();
    m.forward(&toks, &mut kv, Logits::Last, &mut s);
    let mut counts = vec![vec![0u64; ne]; nl];
    for r in s.routes.unwrap() {
        for (e, _) in r.experts {
            counts[r.layer][e] += 1;
        }
    }
    let mut top = 0u64;
    let mut all = 0u64;
    for mut c in counts {
        c.sort_unstable_by(|a, b| b.cmp(a));
        top += c[..ne / 4].iter().sum::<u64>();
        all += c.iter().sum::<u64>();
    }
    top as f64 / all as f64
}

#[test]
fn synthetic_router_skew_follows_the_option() {
    let dir = tmp("skew");
    let flat = top_quarter_share(&synth(&dir, "s0.gguf", 0.0));
    let skewed = top_quarter_share(&synth(&dir, "s2.gguf", 2.0));
    eprintln!("top-25% share: skew 0 → {flat:.3}, skew 2 → {skewed:.3}");
    // tiny: 16 experts, top-4, 256 tokens; random weights alone already favour some experts (0.46 measured),
    // the bias of skew 2 (Zipf exponent 2) concentrates routing far more (0.80 measured)
    assert!(flat < 0.6, "skew 0 should not concentrate routing: {flat}");
    assert!(skewed > flat + 0.2, "skew 2 should concentrate routing: {flat} → {skewed}");
    let _ = std::fs::remove_dir_all(&dir);
}
