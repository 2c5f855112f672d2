//! The routing-trace reader and the replay over what it accepts: any bytes give a trace or an error naming the
//! line; an accepted trace replays through every policy (LRU never above Belady's optimum).
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::tiers::policy::AdaptKnobs;
use strata::tiers::replay::{replay, replay_with, PhaseFilter, Policy, ReplayOpts, Trace};

fuzz_target!(|data: &[u8]| {
    for filter in [PhaseFilter::Decode, PhaseFilter::All] {
        let Ok(t) = Trace::read(std::io::Cursor::new(data), filter) else { continue };
        // bound the work of one input (ids up to 2^16 and 4096 layers are accepted)
        if t.n_layer * t.n_expert > 1 << 16 || t.windows.len() > 2000 {
            continue;
        }
        let k = AdaptKnobs { every: 1, swaps: 8, decay: 0.9 };
        let bel = replay(&t, Policy::Belady, 2);
        // Belady bounds demand caches (LRU); the engine policies may also load an expert a window did not use, so
        // for them only the accounting is checked
        let lru = replay(&t, Policy::Lru, 2);
        assert!(lru.hits <= bel.hits, "LRU above the optimum");
        let fo = replay(&t, Policy::FreqOracle, 2);
        assert!(fo.hits <= bel.hits, "the frequency oracle (a demand cache) above the optimum");
        for p in [Policy::Seed(k), Policy::Lrfu(k), Policy::Lru] {
            let o = replay(&t, p, 2);
            assert_eq!(o.lookups, bel.lookups);
            assert!(o.hits + o.predicted_misses <= o.lookups);
        }
        let _ = replay_with(&t, Policy::Lrfu(k), &ReplayOpts { slots: 1, ranks: None, cold: true });
    }
});
