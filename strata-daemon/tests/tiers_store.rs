//! The host expert store on the split MoE fixture (distinct experts: any wrong byte changes the output):
//! identical greedy tokens in every RAM-copy mode, file-I/O mode and with RAM adapt on; promotions move the
//! file's bytes and every refusal changes nothing; profiles round-trip and foreign or torn ones are refused.

mod common;

use std::sync::Arc;

use common::*;
use strata::gguf::GgufFile;
use strata::model::Model;
use strata::tiers::fileio::FileIo;
use strata::tiers::profile::{Geometry, Profile, ProfileError};
use strata::tiers::store::{ExpertStore, Refusal, ResidentMode, Tier};

fn geometry(m: &Model) -> Geometry {
    m.geometry()
}

fn model() -> Model {
    let mut m = Model::load(Arc::new(GgufFile::open(fixture_path("split")).unwrap())).unwrap();
    m.set_threads(2).unwrap();
    m
}

fn half(m: &Model) -> ResidentMode {
    ResidentMode::Budget(m.expert_layout().unwrap().total_bytes() / 2)
}

#[test]
fn every_mode_gives_the_same_tokens() {
    let path = fixture_path("split");
    let prompts: [&[u32]; 2] = [&[504, 3458, 282, 4649, 314], &[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]];
    let mut m = model();
    let base = greedy(&m, &prompts, 20);
    let modes = [
        (ResidentMode::All, FileIo::Buffered, 0),
        (half(&m), FileIo::Buffered, 0),
        (half(&m), FileIo::Direct, 0),
        (ResidentMode::Mmap, FileIo::Buffered, 0),
        (half(&m), FileIo::Buffered, 8),
        (ResidentMode::Budget(0), FileIo::Direct, 0),
    ];
    for (mode, io, ram_adapt) in modes {
        let st = store_for(&m, &path, mode, io, None);
        st.knobs.set("ram_adapt", &ram_adapt.to_string()).unwrap();
        st.knobs.set("adapt_every", "1").unwrap();
        m.experts = Some(Arc::new(st));
        let got = greedy(&m, &prompts, 20);
        let t = m.experts.as_ref().unwrap().counters.totals();
        println!("{mode:?} {io:?} ram_adapt {ram_adapt}: {t:?}");
        assert_eq!(got, base, "{mode:?} {io:?} ram_adapt {ram_adapt}");
        assert!(t.lookups > 0);
        match mode {
            ResidentMode::All => assert_eq!(t.file_blob_reads, 0),
            _ => assert!(t.file_blob_reads > 0),
        }
        if ram_adapt > 0 {
            assert!(t.promotions > 0, "RAM adapt moved nothing");
        }
        m.experts = None;
    }
}

fn file_blob(m: &Model, layer: usize, e: usize) -> Vec<u8> {
    let l = m.expert_layout().unwrap();
    let b = m.file.bytes();
    l.layers[layer].file_slices(e).iter().flat_map(|&(o, n)| b[o as usize..o as usize + n].to_vec()).collect()
}

fn ram_snapshot(st: &ExpertStore, n_layer: usize, n_expert: usize) -> Vec<Option<Vec<u8>>> {
    (0..n_layer).flat_map(|l| (0..n_expert).map(move |e| (l, e))).map(|(l, e)| st.ram_blob(l, e)).collect()
}

#[test]
fn promotions_move_the_files_bytes_and_refusals_change_nothing() {
    let m = model();
    let path = fixture_path("split");
    let st = store_for(&m, &path, half(&m), FileIo::Buffered, None);
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let in_ram: Vec<usize> = (0..ne).filter(|&e| st.tier(3, e) == Tier::Ram).collect();
    let on_file: Vec<usize> = (0..ne).filter(|&e| st.tier(3, e) == Tier::File).collect();
    assert!(!in_ram.is_empty() && !on_file.is_empty());
    let before = ram_snapshot(&st, nl, ne);
    // refusals
    assert_eq!(st.promote(3, on_file[0], on_file[1]), Err(Refusal::OutNotInRam(3, on_file[1])));
    assert_eq!(st.promote(3, in_ram[1], in_ram[0]), Err(Refusal::InAlreadyInRam(3, in_ram[1])));
    st.set_exchange_staged(true);
    assert_eq!(st.promote(3, on_file[0], in_ram[0]), Err(Refusal::ExchangeStaged));
    // two stages of a layer split with rounds in flight: the first ending does not end the second
    st.set_exchange_staged(true);
    st.set_exchange_staged(false);
    assert_eq!(st.promote(3, on_file[0], in_ram[0]), Err(Refusal::ExchangeStaged));
    st.set_exchange_staged(false);
    assert_eq!(ram_snapshot(&st, nl, ne), before, "a refusal changed the copy");
    assert_eq!(st.counters.totals().promotions, 0);
    assert_eq!(st.counters.totals().promotions_refused, 4);
    // a failed read (the file behind the store is shorter than the model) leaves the copy as it was
    let short = std::env::temp_dir().join(format!("strata-short-{}.gguf", std::process::id()));
    std::fs::write(&short, &std::fs::read(&path).unwrap()[..1 << 20]).unwrap();
    let st2 = store_for(&m, &short, half(&m), FileIo::Buffered, None);
    let before2 = ram_snapshot(&st2, nl, ne);
    let r = st2.promote(3, on_file[0], in_ram[0]);
    assert!(matches!(r, Err(Refusal::ReadFailed(..))), "{r:?}");
    assert_eq!(ram_snapshot(&st2, nl, ne), before2, "a failed read changed the copy");
    assert_eq!(st2.tier(3, in_ram[0]), Tier::Ram);
    assert_eq!(st2.tier(3, on_file[0]), Tier::File);
    std::fs::remove_file(&short).unwrap();
    // a promotion: the incoming expert's bytes are the file's, in the outgoing expert's place
    st.promote(3, on_file[0], in_ram[0]).unwrap();
    assert_eq!(st.tier(3, on_file[0]), Tier::Ram);
    assert_eq!(st.tier(3, in_ram[0]), Tier::File);
    assert_eq!(st.ram_blob(3, on_file[0]).unwrap(), file_blob(&m, 3, on_file[0]));
    let t = st.counters.totals();
    assert_eq!((t.promotions, t.promotion_bytes), (1, file_blob(&m, 3, 0).len() as u64));
    // the other experts' places are untouched
    let after = ram_snapshot(&st, nl, ne);
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        if i != 3 * ne + on_file[0] && i != 3 * ne + in_ram[0] {
            assert_eq!(a, b, "expert index {i} changed");
        }
    }
    // and every RAM place holds its expert's file bytes
    for l in 0..nl {
        for e in 0..ne {
            if let Some(b) = st.ram_blob(l, e) {
                assert!(b == file_blob(&m, l, e), "RAM place of ({l}, {e}) does not hold its bytes");
            }
        }
    }
}

#[test]
fn profile_save_and_restart_give_the_same_residency() {
    let mut m = model();
    let path = fixture_path("split");
    let st = Arc::new(store_for(&m, &path, half(&m), FileIo::Buffered, None));
    st.knobs.set("ram_adapt", "4").unwrap();
    m.experts = Some(st.clone());
    greedy(&m, &[&[504, 3458, 282, 4649, 314, 7042, 30]], 16);
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let prof_path = std::env::temp_dir().join(format!("strata-prof-{}.bin", std::process::id()));
    let prof = st.profile_now();
    assert_eq!(prof.ranked.len(), nl * ne);
    prof.save(&prof_path).unwrap();
    let loaded = Profile::load(&prof_path, &geometry(&m)).unwrap();
    assert_eq!(loaded, prof);
    // restart with the profile and the same budget: the RAM copy holds the profile's hottest experts
    let st2 = store_for(&m, &path, half(&m), FileIo::Buffered, Some(&loaded));
    let blob = m.expert_layout().unwrap().layers[0].blob_bytes() as u64;
    let n_ram = (m.expert_layout().unwrap().total_bytes() / 2 / blob) as usize;
    let want: std::collections::HashSet<(usize, usize)> =
        loaded.ranked.iter().take(n_ram).map(|&(l, e, _)| (l as usize, e as usize)).collect();
    let got: std::collections::HashSet<(usize, usize)> =
        (0..nl).flat_map(|l| (0..ne).map(move |e| (l, e))).filter(|&(l, e)| st2.tier(l, e) == Tier::Ram).collect();
    assert_eq!(got, want);
    // the saved heat ranks the experts this conversation used most first
    let (_, ex) = st.residency();
    let top = ex.iter().map(|e| e.heat).fold(f64::MIN, f64::max);
    let hottest = ex.iter().find(|e| e.heat == top).unwrap(); // ties: lowest index first, as the ranking
    assert_eq!((loaded.ranked[0].0 as u32, loaded.ranked[0].1 as u32), (hottest.layer, hottest.expert));
    // a torn profile and one of another model are refused
    let bytes = std::fs::read(&prof_path).unwrap();
    std::fs::write(&prof_path, &bytes[..bytes.len() - 5]).unwrap();
    assert!(matches!(Profile::load(&prof_path, &geometry(&m)), Err(ProfileError::Corrupt { .. })));
    let mut other = geometry(&m);
    other.n_expert = 8;
    std::fs::write(&prof_path, &bytes).unwrap();
    assert!(matches!(Profile::load(&prof_path, &other), Err(ProfileError::Foreign { .. })));
    other = geometry(&m);
    other.fingerprint ^= 1;
    assert!(matches!(Profile::load(&prof_path, &other), Err(ProfileError::Foreign { .. })));
    std::fs::remove_file(&prof_path).unwrap();
}

#[test]
fn saves_at_once_never_leave_a_torn_or_missing_profile() {
    let m = model();
    let st = store_for(&m, &fixture_path("split"), ResidentMode::All, FileIo::Buffered, None);
    let prof = st.profile_now();
    let path = std::env::temp_dir().join(format!("strata-concurrent-{}.prof", std::process::id()));
    prof.save(&path).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // a reader that must always find the whole file
        let reader = s.spawn(|| {
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let p = Profile::load(&path, &geometry(&m));
                assert!(p.is_ok(), "read {reads}: {:?}", p.err());
                reads += 1;
            }
            reads
        });
        let savers: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    for _ in 0..25 {
                        prof.save(&path).unwrap();
                    }
                })
            })
            .collect();
        for h in savers {
            h.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
    });
    assert_eq!(Profile::load(&path, &geometry(&m)).unwrap(), prof);
    // no temporary file is left behind
    let dir = std::fs::read_dir(std::env::temp_dir()).unwrap();
    let stem = path.file_name().unwrap().to_str().unwrap().to_string();
    assert!(dir.flatten().all(|e| !e.file_name().to_str().unwrap_or("").starts_with(&format!("{stem}.tmp"))));
    std::fs::remove_file(&path).unwrap();
}
