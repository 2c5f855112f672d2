//! The engine's placement against `replay`: greedy decoding of the exact MoE fixture on the CPU with a VRAM expert
//! cache stood in by the store's slot records (the adaptive rounds carried out as the GPU backend does: evict,
//! then admit into the freed slot) counts the same hits as `replay` of the routing the pass recorded, for every
//! engine policy; and the recorded next-layer prediction names far more of the routed experts than chance.

mod common;

use std::io::Cursor;
use std::sync::Arc;

use common::*;
use strata::engine::routing_dump::{Phase, RoutingDump};
use strata::gguf::GgufFile;
use strata::model::forward::Scratch;
use strata::model::{Logits, Model};
use strata::tiers::fileio::FileIo;
use strata::tiers::policy::AdaptKnobs;
use strata::tiers::replay::{prediction_accuracy, replay, Outcome, PhaseFilter, Policy, Trace};
use strata::tiers::store::{ExpertStore, ResidentMode, TierTotals};

const SLOTS_PER_LAYER: usize = 4;

fn model() -> Model {
    let mut m = Model::load(Arc::new(GgufFile::open(fixture_path("exact")).unwrap())).unwrap();
    m.set_threads(2).unwrap();
    m
}

/// Decodes `n` greedy tokens after each prompt with the store's adaptive rounds carried out after every window
/// on the store's slot records (as the GPU backend does: evict, then admit into the freed slot); returns the
/// decode routing as `--dump-routing` JSON Lines (one request per prompt).
fn decode(m: &Model, st: &ExpertStore, prompts: &[Vec<u32>], n: usize) -> String {
    let end_window = || {
        for sw in st.end_decode_window() {
            let slot = match sw.outgoing {
                Some(o) => st.evict_slot(sw.layer, o),
                None => st.reserve_slot(sw.layer),
            };
            st.admit_slot(sw.layer, sw.incoming, slot.expect("a victim's or a free slot"));
        }
    };
    decode_with(m, st, prompts, n, end_window).0
}

/// [`decode`] with `end_window` run after every decode window; also returns the greedy tokens of each prompt.
fn decode_with(
    m: &Model,
    st: &ExpertStore,
    prompts: &[Vec<u32>],
    n: usize,
    end_window: impl Fn(),
) -> (String, Vec<Vec<u32>>) {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "strata-placement-{}-{}-{}.jsonl",
        std::process::id(),
        st.knobs.policy().name(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let mut dump = RoutingDump::create(&path).unwrap();
    let mut tokens = Vec::new();
    for (seq, p) in prompts.iter().enumerate() {
        let mut kv = m.new_kv(256);
        let mut s = Scratch::default();
        let mut logits = m.forward(p, &mut kv, Logits::Last, &mut s);
        s.routes = Some(Vec::new());
        let mut out = Vec::new();
        for _ in 0..n {
            let t = strata::engine::sampler::argmax(&logits);
            out.push(t);
            s.decode = true;
            logits = m.forward(&[t], &mut kv, Logits::Last, &mut s);
            end_window();
            dump.write(seq as u64, Phase::Decode, s.routes.as_mut().unwrap()).unwrap();
        }
        tokens.push(out);
    }
    dump.flush().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    (text, tokens)
}

/// Asserts that the engine's counters `d` over a decode run equal `replay`'s outcome `o` of the routing it recorded
/// (every lookup seen, the same hits) and that the cache moved; returns the line that reports both.
fn engine_equals_replay(name: &str, d: &TierTotals, o: &Outcome) -> String {
    assert_eq!(o.lookups, d.lookups, "{name}: the replay sees every lookup the engine counted");
    assert_eq!(o.hits, d.vram_hits, "{name}: the engine hits what the replay predicts");
    assert!(o.loads > 0, "{name}: the cache moved");
    format!(
        "{name}: engine {} hits of {} lookups ({:.1}%), replay {} of {} ({:.1}%), {} loads",
        d.vram_hits,
        d.lookups,
        100.0 * d.vram_hits as f64 / d.lookups as f64,
        o.hits,
        o.lookups,
        100.0 * o.hit_rate(),
        o.loads
    )
}

/// The engine policies the checks run, with the knobs `replay` is given for each.
fn policies() -> [(&'static str, Policy); 2] {
    [
        ("lrfu", Policy::Lrfu(AdaptKnobs::default())),
        ("seed", Policy::Seed(AdaptKnobs { every: 2, swaps: 96, decay: 0.9 })),
    ]
}

/// A store of the exact fixture (every expert in RAM) whose adaptive tier runs `policy` as `name`.
fn store_with(m: &Model, name: &str, policy: Policy) -> ExpertStore {
    let st = store_for(m, &fixture_path("exact"), ResidentMode::All, FileIo::Buffered, None);
    st.knobs.set("adapt_policy", name).unwrap();
    if let Policy::Seed(k) = policy {
        st.knobs.set("adapt_every", &k.every.to_string()).unwrap();
        st.knobs.set("adapt_decay", &k.decay.to_string()).unwrap();
    }
    st
}

#[test]
fn engine_hits_equal_the_replay_for_every_policy() {
    let m = model();
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|r| (0..12u32).map(|i| (i * 7919 + r * 104_729 + 13) % m.cfg.n_vocab as u32).collect()).collect();
    for (name, policy) in policies() {
        let st = store_with(&m, name, policy);
        // the VRAM cache as the GPU backend fills it: placement order, SLOTS_PER_LAYER × n_layer slots
        st.init_slots(SLOTS_PER_LAYER * nl);
        for (l, e) in st.placement_order().into_iter().take(SLOTS_PER_LAYER * nl) {
            let slot = st.reserve_slot(l).unwrap();
            st.admit_slot(l, e, slot);
        }
        let st = Arc::new(st);
        let mut m = model();
        m.experts = Some(st.clone());
        let before = st.counters.totals();
        let text = decode(&m, &st, &prompts, 40);
        let d = st.counters.totals().since(&before);
        let mut trace = Trace::read(Cursor::new(text), PhaseFilter::Decode).unwrap();
        // the model's geometry (the trace's maxima could be smaller)
        trace.n_expert = ne;
        assert_eq!(trace.n_layer, nl);
        let o = replay(&trace, policy, SLOTS_PER_LAYER);
        eprintln!("{}", engine_equals_replay(name, &d, &o));
        // the next-layer prediction: every MoE layer but the first carries one, and it names far more than
        // chance (top-4 of 16: 25%)
        let acc = prediction_accuracy(&trace).expect("the CPU backend predicts");
        eprintln!("{name}: next-layer prediction names {:.1}% of routed experts", acc * 100.0);
        assert!(acc > 0.5, "{acc}");
        assert!(trace.windows.iter().all(|w| w.predicted[0].is_none() && w.predicted[1..].iter().all(Option::is_some)));
    }
}

/// The same on the GPU backend (hybrid decode: VRAM hits on the GPU, the misses on the CPU pool, the adaptive
/// rounds carried out by the backend between windows), with the next-layer prefetch off and on (live knob
/// `prefetch` 8: the prediction made on the device, the predicted misses uploaded ahead): the engine's hits equal
/// `replay`'s for each policy; the prediction the GPU records names far more than chance; the prefetch uploads
/// experts that the next layer uses. Greedy tokens with the prefetch on and off are printed (a prefetched expert
/// is computed on the GPU instead of the CPU pool, so a near-tie may round the other way).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test placement -- --ignored (tools/gpu-placement)"]
fn engine_hits_equal_the_replay_on_the_gpu() {
    let m0 = model();
    let (nl, ne) = (m0.cfg.n_layer, m0.cfg.n_expert);
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|r| (0..12u32).map(|i| (i * 7919 + r * 104_729 + 13) % m0.cfg.n_vocab as u32).collect())
        .collect();
    // the CPU backend's prediction on the same prompts: the GPU's names as many routed experts
    let cpu_acc = {
        let st = Arc::new(store_for(&m0, &fixture_path("exact"), ResidentMode::All, FileIo::Buffered, None));
        let mut m = model();
        m.experts = Some(st.clone());
        let (text, _) = decode_with(&m, &st, &prompts, 40, || ());
        prediction_accuracy(&Trace::read(Cursor::new(text), PhaseFilter::Decode).unwrap()).unwrap()
    };
    let mut greedy: Vec<(String, Vec<Vec<u32>>)> = Vec::new();
    for prefetch in ["0", "8"] {
        for (name, policy) in policies() {
            let st = store_with(&m0, name, policy);
            st.knobs.set("prefetch", prefetch).unwrap();
            let st = Arc::new(st);
            let mut m = model();
            m.experts = Some(st.clone());
            let opts = gpu_options(true, strata::tiers::vram::CacheSize::Slots(SLOTS_PER_LAYER * nl));
            let line = m.attach_gpu(&opts).unwrap();
            eprintln!("{line}");
            assert_eq!(st.slot_table().iter().filter(|&&s| s >= 0).count(), SLOTS_PER_LAYER * nl, "{line}");
            let before = st.counters.totals();
            let (text, tokens) = decode_with(&m, &st, &prompts, 40, || m.end_decode_window().unwrap());
            let d = st.counters.totals().since(&before);
            let mut trace = Trace::read(Cursor::new(text), PhaseFilter::Decode).unwrap();
            trace.n_expert = ne;
            let o = replay(&trace, policy, SLOTS_PER_LAYER);
            let acc = prediction_accuracy(&trace).expect("the GPU backend records its prediction");
            let line = engine_equals_replay(&format!("gpu, {name}, prefetch {prefetch}"), &d, &o);
            eprintln!(
                "{line}; prediction names {:.1}% of routed experts (CPU {:.1}%); prefetched {}, used {}",
                100.0 * acc,
                100.0 * cpu_acc,
                d.prefetched,
                d.prefetch_hits
            );
            // (both over ~1,000 routed experts of greedy tokens that may part ways: a wide margin, which a broken
            // prediction, near chance at 25%, still misses)
            assert!((acc - cpu_acc).abs() < 0.1, "GPU {acc} vs CPU {cpu_acc}");
            assert!(trace.windows.iter().all(|w| w.predicted[1..].iter().all(Option::is_some)));
            if prefetch != "0" {
                assert!(d.prefetched > 0 && d.prefetch_hits > 0, "{d:?}");
                assert!(d.prefetch_hits <= d.prefetched);
            } else {
                assert_eq!(d.prefetched, 0);
            }
            // every VRAM slot and RAM place still holds its expert's bytes from the file
            let faults = m.verify_tiers().unwrap().expect("an expert store");
            assert!(faults.is_empty(), "{faults:?}");
            greedy.push((format!("{name}, prefetch {prefetch}"), tokens));
        }
    }
    // recording the routing makes every layer predict on the device (its ids copied after the routing's, the host
    // waiting for the routing alone): the same tokens as a pass that predicts nothing
    for (name, policy) in policies() {
        let st = Arc::new(store_with(&m0, name, policy));
        let mut m = model();
        m.experts = Some(st.clone());
        m.attach_gpu(&gpu_options(true, strata::tiers::vram::CacheSize::Slots(SLOTS_PER_LAYER * nl))).unwrap();
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let plain = greedy_with(&m, &refs, 40, |_| m.end_decode_window().unwrap());
        let recorded = &greedy.iter().find(|(n, _)| *n == format!("{name}, prefetch 0")).unwrap().1;
        assert_eq!(&plain, recorded, "{name}: the same tokens without the prediction");
    }
    for (name, tokens) in &greedy[2..] {
        let (_, off) = greedy.iter().find(|(n, _)| n.replace("prefetch 0", "prefetch 8") == *name).unwrap();
        let same = tokens.iter().zip(off).map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count());
        eprintln!("{name}: greedy tokens equal to prefetch off's for the first {:?} of 40", same.collect::<Vec<_>>());
    }
}

/// The experts `st` holds in VRAM, as (layer × n_expert + expert) ids.
fn held(st: &ExpertStore) -> Vec<usize> {
    st.slot_table().iter().enumerate().filter(|(_, &s)| s >= 0).map(|(i, _)| i).collect()
}

#[test]
fn lrfu_starts_fresh_when_it_plans_again_after_a_pause() {
    // lrfu for one request, a static placement for the next (adapt_every 0), lrfu again for a third: the third's
    // rounds are those of a fresh store that holds the same experts, not of scores frozen during the pause
    let m0 = model();
    let nl = m0.cfg.n_layer;
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|r| (0..10u32).map(|i| (i * 104_723 + r * 7_919 + 5) % m0.cfg.n_vocab as u32).collect())
        .collect();
    let fill = |st: &ExpertStore| {
        st.init_slots(SLOTS_PER_LAYER * nl);
        for (l, e) in st.placement_order().into_iter().take(SLOTS_PER_LAYER * nl) {
            let slot = st.reserve_slot(l).unwrap();
            st.admit_slot(l, e, slot);
        }
    };
    let a = Arc::new(store_for(&m0, &fixture_path("exact"), ResidentMode::All, FileIo::Buffered, None));
    a.knobs.set("adapt_policy", "lrfu").unwrap();
    fill(&a);
    let mut ma = model();
    ma.experts = Some(a.clone());
    decode(&ma, &a, &prompts[..1], 24);
    let after_first = held(&a);
    a.knobs.set("adapt_every", "0").unwrap();
    decode(&ma, &a, &prompts[1..2], 24);
    assert_eq!(held(&a), after_first, "a static placement does not move");
    a.knobs.set("adapt_every", "4").unwrap();
    decode(&ma, &a, &prompts[2..], 24);

    let b = Arc::new(store_for(&m0, &fixture_path("exact"), ResidentMode::All, FileIo::Buffered, None));
    b.knobs.set("adapt_policy", "lrfu").unwrap();
    b.init_slots(SLOTS_PER_LAYER * nl);
    let ne = m0.cfg.n_expert;
    for i in &after_first {
        let slot = b.reserve_slot(i / ne).unwrap();
        b.admit_slot(i / ne, i % ne, slot);
    }
    let mut mb = model();
    mb.experts = Some(b.clone());
    decode(&mb, &b, &prompts[2..], 24);
    assert_ne!(held(&b), after_first, "the third request moves the cache");
    assert_eq!(held(&a), held(&b), "after the pause lrfu plans as a fresh store does");
}
