//! The expert-profile loader: any bytes give a profile or a `Corrupt` error, never a panic or an allocation beyond
//! the input's size class. The checksum (FNV-1a over the rest) is recomputed over the mutated bytes, so that the
//! checks behind it (geometry, entries, duplicates) are reached, as a forged file would reach them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::tiers::profile::{fnv1a64, Profile};

fuzz_target!(|data: &[u8]| {
    let mut b = data.to_vec();
    if b.len() >= 8 {
        let n = b.len() - 8;
        let sum = fnv1a64(&b[..n]);
        b[n..].copy_from_slice(&sum.to_le_bytes());
    }
    if let Ok(p) = Profile::from_bytes(&b, std::path::Path::new("fuzz.profile")) {
        // a profile that parses serializes back to the same bytes and ranks every entry once
        assert_eq!(p.to_bytes(), b);
        let ranks = p.ranks();
        assert_eq!(ranks.iter().filter(|r| r.is_some()).count(), p.ranked.len());
    }
});
