//! Replay of routing traces: hand-computed hit rates per policy, the dump format round trip, and the property
//! that Belady's optimum is never below another policy.

use std::io::Cursor;

use rand::{Rng, SeedableRng};
use strata::engine::routing_dump::{Phase, RoutingDump};
use strata::model::forward::RouteRecord;
use strata::tiers::policy::AdaptKnobs;
use strata::tiers::replay::{
    initial_fill, prediction_accuracy, replay, replay_with, PhaseFilter, Policy, ReplayOpts, Trace,
};
use strata::tiers::stats::{top_share, trace_stats};

/// JSON Lines for one layer, top-1, decode positions 0.. of request 1. Ids are shifted by one so that expert 0,
/// which the engine's default fill puts in a one-slot cache, is never routed to (the cache starts useless).
fn top1_trace(experts: &[u32]) -> String {
    experts
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let e = e + 1;
            format!(r#"{{"seq":1,"pos":{i},"phase":"decode","layer":0,"experts":[{e}],"weights":[1.0]}}"#) + "\n"
        })
        .collect()
}

#[test]
fn hand_computed_hit_rates() {
    // A B A A B C A (ids 1 2 1 1 2 3 1) with one slot; the cache starts with expert 0, never routed to.
    let t = Trace::read(Cursor::new(top1_trace(&[0, 1, 0, 0, 1, 2, 0])), PhaseFilter::Decode).unwrap();
    assert_eq!((t.windows.len(), t.n_layer, t.n_expert, t.top_k), (7, 1, 4, 1));
    assert_eq!(initial_fill(1, 4, 1, None), vec![vec![0]]);
    // LRU: only w3 (A after A) hits.
    let lru = replay(&t, Policy::Lru, 1);
    assert_eq!((lru.hits, lru.lookups), (1, 7));
    // Belady keeps A through B's one use (w1) and never caches B or C (next use farther / never): w2, w3, w6.
    let bel = replay(&t, Policy::Belady, 1);
    assert_eq!((bel.hits, bel.lookups), (3, 7));
    // Seed rule, one round per window, no decay: A reaches usage 2 at w2 and replaces expert 0 (usage 0); B
    // reaches 2 at w4 but 2 < 3 + 1.5; so w3 and w6 hit.
    let ad = replay(&t, Policy::Seed(AdaptKnobs { every: 1, swaps: 96, decay: 1.0 }), 1);
    assert_eq!((ad.hits, ad.lookups, ad.loads), (2, 7, 1));
    // With decay 0.5 no usage ever reaches 2: nothing moves.
    let ad = replay(&t, Policy::Seed(AdaptKnobs { every: 1, swaps: 96, decay: 0.5 }), 1);
    assert_eq!((ad.hits, ad.loads), (0, 0));
    // Static (every 0): the initial fill is kept, for every engine policy.
    for p in [
        Policy::Seed(AdaptKnobs { every: 0, swaps: 96, decay: 1.0 }),
        Policy::Lrfu(AdaptKnobs { every: 0, swaps: 96, decay: 1.0 }),
    ] {
        let o = replay(&t, p, 1);
        assert_eq!((o.hits, o.loads), (0, 0), "{}", p.name());
    }
    // lrfu: no shadow hits anything until w3, so it follows LRU: A enters after w0, B after w1, A after w2, w3 hits
    // (the only hit), B after w4, C after w5; the bypass shadows with λ ≥ 0.8 kept A through B and C and hit at w6,
    // a lead of one hit that the lead test's prior does not let the cache follow; LRU loads A over C: 6 loads.
    let lf = replay(&t, Policy::Lrfu(AdaptKnobs { every: 1, swaps: 96, decay: 1.0 }), 1);
    assert_eq!((lf.hits, lf.lookups, lf.loads), (1, 7, 6));
    // The frequency oracle knows the request's counts (A 4, B 2, C 1). Forcing each window's expert in is LRU here
    // (1 hit); without it the slot takes A after w0 and keeps it (A outcounts B and C): w2, w3, w6 hit, 1 load. It
    // reports the better of the two.
    let fo = replay(&t, Policy::FreqOracle, 1);
    assert_eq!((fo.hits, fo.lookups, fo.loads), (3, 7, 1));
    // Three slots start with experts 0, 1, 2 (holding A and B): every policy misses only C's one use.
    assert_eq!(initial_fill(1, 4, 3, None), vec![vec![0, 1, 2]]);
    assert_eq!(replay(&t, Policy::Lru, 3).hits, 6);
    assert_eq!(replay(&t, Policy::Belady, 3).hits, 6);
    assert_eq!(replay(&t, Policy::Seed(AdaptKnobs { every: 1, swaps: 96, decay: 1.0 }), 3).hits, 6);
    assert_eq!(replay(&t, Policy::Lrfu(AdaptKnobs { every: 1, swaps: 96, decay: 1.0 }), 3).hits, 6);
    assert_eq!(replay(&t, Policy::FreqOracle, 3).hits, 6);
}

#[test]
fn the_initial_fill_follows_the_profile_then_expert_major_order() {
    // 2 layers × 3 experts, 1 slot per layer (2 slots): ranks put (1, 2) first, then (1, 0); unranked after
    let mut ranks = vec![None; 6];
    ranks[3 + 2] = Some(0);
    ranks[3] = Some(1);
    assert_eq!(initial_fill(2, 3, 1, Some(&ranks)), vec![vec![], vec![2, 0]]);
    // without ranks: expert 0 of every layer, then expert 1 of every layer ...
    assert_eq!(initial_fill(2, 3, 2, None), vec![vec![0, 1], vec![0, 1]]);
}

#[test]
fn seed_rounds_respect_every_and_swaps_across_layers() {
    // Two layers, expert 1 of layer 0 and expert 2 of layer 1 every token (the fill holds expert 0 of each);
    // rounds every 2 windows, 1 swap per round.
    let mut s = String::new();
    for pos in 0..6 {
        s += &format!(r#"{{"seq":7,"pos":{pos},"phase":"decode","layer":0,"experts":[1],"weights":[1]}}"#);
        s += "\n";
        s += &format!(r#"{{"seq":7,"pos":{pos},"phase":"decode","layer":1,"experts":[2],"weights":[1]}}"#);
        s += "\n";
    }
    let t = Trace::read(Cursor::new(s), PhaseFilter::Decode).unwrap();
    let o = replay(&t, Policy::Seed(AdaptKnobs { every: 2, swaps: 1, decay: 1.0 }), 1);
    // round 1 (after w1): both at usage 2, equal gain -> layer 0 first (one swap); round 2 (after w3): layer 1.
    // layer 0 hits w2..w5 (4), layer 1 hits w4, w5 (2).
    assert_eq!((o.hits, o.lookups, o.loads), (6, 12, 2));
}

#[test]
fn windows_are_grouped_by_request_and_position_wherever_the_records_are() {
    // the same records token-major and layer-major (and a string request id): the same windows and outcomes
    let mut recs = Vec::new();
    for pos in 0..40u32 {
        for l in 0..3u32 {
            let e = [(pos * 7 + l) % 5, (pos / 3 + l) % 5 + 5];
            recs.push((
                pos,
                l,
                serde_json::json!({"seq": "req-a", "pos": pos, "phase": "decode", "layer": l,
                "experts": e, "weights": [0.5, 0.5]})
                .to_string(),
            ));
        }
    }
    let token_major: String = recs.iter().map(|r| r.2.clone() + "\n").collect();
    let mut lm = recs.clone();
    lm.sort_by_key(|r| (r.1, r.0));
    let layer_major: String = lm.iter().map(|r| r.2.clone() + "\n").collect();
    let a = Trace::read(Cursor::new(token_major), PhaseFilter::Decode).unwrap();
    let b = Trace::read(Cursor::new(layer_major), PhaseFilter::Decode).unwrap();
    assert_eq!(b.windows.len(), 40, "one window per token, not per record");
    assert_eq!(a.windows[0].seq, "req-a");
    for (x, y) in a.windows.iter().zip(&b.windows) {
        assert_eq!((x.pos, &x.layers), (y.pos, &y.layers));
    }
    let knobs = AdaptKnobs::default();
    for p in [Policy::Seed(knobs), Policy::Lrfu(knobs), Policy::Lru, Policy::Belady, Policy::FreqOracle] {
        assert_eq!(replay(&a, p, 2), replay(&b, p, 2), "{}", p.name());
    }
    // a layer given twice for one token is refused with its line
    let dup = r#"{"seq":1,"pos":0,"phase":"decode","layer":0,"experts":[0],"weights":[1]}"#.to_string() + "\n";
    let e = Trace::read(Cursor::new(dup.repeat(2)), PhaseFilter::Decode).unwrap_err().to_string();
    assert!(e.contains("line 2") && e.contains("twice"), "{e}");
    let e = Trace::read(
        Cursor::new(r#"{"seq":[1],"pos":0,"phase":"decode","layer":0,"experts":[0],"weights":[1]}"#),
        PhaseFilter::Decode,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("seq must be a number or a string"), "{e}");
}

#[test]
fn cold_caches_start_every_request_from_the_fill() {
    // two requests of one layer, top-1, 2 experts, 1 slot (fill: expert 0): request a uses 1 1 1, request b
    // uses 1 1 1. Warm LRU: 1 enters after a's first use and hits 5 times; cold: every request misses once.
    let mut s = String::new();
    for (seq, pos) in [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)] {
        s += &format!(r#"{{"seq":"{seq}","pos":{pos},"phase":"decode","layer":0,"experts":[1],"weights":[1]}}"#);
        s += "\n";
    }
    let t = Trace::read(Cursor::new(s), PhaseFilter::Decode).unwrap();
    assert_eq!(t.requests().len(), 2);
    let warm = replay_with(&t, Policy::Lru, &ReplayOpts { slots: 1, ranks: None, cold: false });
    let cold = replay_with(&t, Policy::Lru, &ReplayOpts { slots: 1, ranks: None, cold: true });
    assert_eq!((warm.hits, cold.hits), (5, 4));
}

#[test]
fn prediction_accuracy_and_prefetch_hits() {
    // one layer, top-2, 4 experts, 1 slot (fill: expert 0); predictions name one of the two routed experts
    let mut s = String::new();
    for pos in 0..4 {
        s += &format!(
            r#"{{"seq":1,"pos":{pos},"phase":"decode","layer":0,"experts":[2,3],"weights":[0.5,0.5],"predicted":[3,1]}}"#
        );
        s += "\n";
    }
    let t = Trace::read(Cursor::new(s), PhaseFilter::Decode).unwrap();
    assert_eq!(prediction_accuracy(&t), Some(0.5));
    // static cache: every lookup misses; the predicted ones (expert 3, 4 of 8 lookups) would be prefetched
    let o = replay(&t, Policy::Seed(AdaptKnobs { every: 0, swaps: 1, decay: 1.0 }), 1);
    assert_eq!((o.hits, o.predicted_misses, o.lookups), (0, 4, 8));
    assert_eq!(o.prefetch_hit_rate(), 0.5);
    let plain = Trace::read(Cursor::new(top1_trace(&[0, 1])), PhaseFilter::Decode).unwrap();
    assert_eq!(prediction_accuracy(&plain), None);
}

#[test]
fn dump_format_round_trips_and_prefill_is_filtered() {
    let path = std::env::temp_dir().join(format!("strata-dump-{}.jsonl", std::process::id()));
    let mut d = RoutingDump::create(&path).unwrap();
    let rec = |pos, layer, ex: &[(usize, f32)]| RouteRecord { pos, layer, experts: ex.to_vec(), predicted: None };
    d.write(3, Phase::Prefill, &mut vec![rec(0, 0, &[(5, 0.75), (2, 0.25)]), rec(0, 1, &[(1, 0.5), (0, 0.5)])])
        .unwrap();
    d.write(3, Phase::Decode, &mut vec![rec(1, 0, &[(2, 0.6), (5, 0.4)]), rec(1, 1, &[(3, 0.9), (0, 0.1)])]).unwrap();
    d.flush().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let all = Trace::read(Cursor::new(text.clone()), PhaseFilter::All).unwrap();
    assert_eq!(all.windows.len(), 2);
    assert_eq!(all.windows[0].layers, vec![vec![5, 2], vec![1, 0]]);
    assert!(!all.windows[0].decode && all.windows[1].decode);
    assert_eq!((all.n_layer, all.n_expert, all.top_k), (2, 6, 2));
    let dec = Trace::read(Cursor::new(text.clone()), PhaseFilter::Decode).unwrap();
    assert_eq!(dec.windows.len(), 1);
    assert_eq!((dec.windows[0].seq.as_str(), dec.windows[0].pos), ("3", 1));
    assert_eq!(dec.windows[0].layers, vec![vec![2, 5], vec![3, 0]]);
    // every field as documented
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first["seq"], 3);
    assert_eq!(first["phase"], "prefill");
    assert_eq!(first["weights"][0], 0.75);
}

#[test]
fn malformed_traces_name_the_line() {
    let bad = top1_trace(&[0, 1]) + "{\"seq\":1}\n";
    let e = Trace::read(Cursor::new(bad), PhaseFilter::Decode).unwrap_err().to_string();
    assert!(e.contains("line 3"), "{e}");
    let bad = r#"{"seq":1,"pos":0,"phase":"verify","layer":0,"experts":[0],"weights":[1]}"#;
    assert!(Trace::read(Cursor::new(bad), PhaseFilter::Decode).unwrap_err().to_string().contains("phase"));
    let only_prefill = r#"{"seq":1,"pos":0,"phase":"prefill","layer":0,"experts":[0],"weights":[1]}"#;
    assert!(Trace::read(Cursor::new(only_prefill), PhaseFilter::Decode).is_err());
}

#[test]
fn reuse_and_skew() {
    // one layer, 5 experts (ids 1..4 routed, 0 never), top-1: 1 1 1 2 4 -> reuse 2 of 4 pairs
    let t = Trace::read(Cursor::new(top1_trace(&[0, 0, 0, 1, 3])), PhaseFilter::Decode).unwrap();
    let s = trace_stats(&t);
    assert!((s.reuse_next_token - 2.0 / 4.0).abs() < 1e-12, "{}", s.reuse_next_token);
    assert_eq!(s.reuse_uniform, 0.2);
    // counts [0, 3, 1, 0, 1]: hottest 25% (⌊1.25⌋ = 1 expert) = 3/5
    assert!((s.layers[0].top25 - 0.6).abs() < 1e-12);
    assert!((top_share(&[10, 0, 0, 0, 0, 0, 0, 0, 0, 10], 0.1) - 0.5).abs() < 1e-12);
    assert_eq!(top_share(&[], 0.25), 0.0);
}

/// Random skewed traces: several layers, top-k of E, runs of repeated experts.
fn random_trace(rng: &mut rand::rngs::StdRng) -> Trace {
    let n_layer = rng.random_range(1..4);
    let e = rng.random_range(2..12u32);
    let k = rng.random_range(1..=e.min(4));
    let n = rng.random_range(1..120);
    let mut s = String::new();
    let mut prev: Vec<Vec<u32>> = vec![Vec::new(); n_layer];
    for pos in 0..n {
        for (l, p) in prev.iter_mut().enumerate() {
            let mut ids: Vec<u32> = Vec::new();
            while ids.len() < k as usize {
                // reuse the previous token's choice half the time, else a skewed draw
                let c = if !p.is_empty() && rng.random_bool(0.5) {
                    p[rng.random_range(0..p.len())]
                } else {
                    let u: f64 = rng.random();
                    ((u * u * e as f64) as u32).min(e - 1)
                };
                if !ids.contains(&c) {
                    ids.push(c);
                }
            }
            let w = vec![1.0 / k as f32; k as usize];
            s +=
                &serde_json::json!({"seq": 1, "pos": pos, "phase": "decode", "layer": l, "experts": ids, "weights": w})
                    .to_string();
            s += "\n";
            *p = ids;
        }
    }
    Trace::read(Cursor::new(s), PhaseFilter::Decode).unwrap()
}

#[test]
fn belady_is_never_below_another_policy() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5EED);
    for case in 0..1500 {
        let t = random_trace(&mut rng);
        let slots = rng.random_range(1..=t.n_expert);
        let knobs = AdaptKnobs {
            every: rng.random_range(1..5),
            swaps: rng.random_range(1..100),
            decay: [0.5, 0.7, 0.9, 1.0][rng.random_range(0..4)],
        };
        let bel = replay(&t, Policy::Belady, slots);
        for p in [Policy::Lru, Policy::Seed(knobs), Policy::Lrfu(knobs), Policy::FreqOracle] {
            let o = replay(&t, p, slots);
            assert_eq!(o.lookups, bel.lookups);
            assert!(
                bel.hits >= o.hits,
                "case {case}: belady {} < {} {} (slots {slots}, {knobs:?})",
                bel.hits,
                p.name(),
                o.hits
            );
        }
        // more slots never hurt Belady or LRU (LRU is a stack algorithm)
        if slots < t.n_expert {
            assert!(replay(&t, Policy::Belady, slots + 1).hits >= bel.hits);
            assert!(replay(&t, Policy::Lru, slots + 1).hits >= replay(&t, Policy::Lru, slots).hits);
        }
    }
}
