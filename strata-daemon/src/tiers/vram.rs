//! VRAM expert cache sizing (DESIGN.md §4, REFERENCE.md §1): `--expert-cache N|auto` and the reserve rule.
//! Pure arithmetic, so it is tested without a GPU; the cache itself is `backend::cuda::slots`.

use std::str::FromStr;

/// `--expert-cache`: a slot count, or `auto` = (free VRAM after dense weights, KV and buffers − reserve) /
/// slot size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSize {
    /// Size from free VRAM.
    Auto,
    /// Exactly this many slots (clamped to the experts of the model and to free VRAM).
    Slots(usize),
}

impl FromStr for CacheSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(CacheSize::Auto);
        }
        s.parse::<usize>().map(CacheSize::Slots).map_err(|_| format!("expected a slot count or `auto`, got `{s}`"))
    }
}

/// Slots for `auto`: `(free − reserve) / slot_bytes`, at most `n_experts`. `free`, `reserve`, `slot_bytes`
/// in bytes.
pub fn auto_slots(free: u64, reserve: u64, slot_bytes: u64, n_experts: usize) -> usize {
    if slot_bytes == 0 {
        return 0;
    }
    ((free.saturating_sub(reserve) / slot_bytes) as usize).min(n_experts)
}

/// After allocating the cache, `free_after` bytes are free: when that fell more than 64 MiB under the
/// reserve, the number of slots to give back (the shortfall plus 64 MiB, in slots); else 0.
pub fn shrink_slots(free_after: u64, reserve: u64, slot_bytes: u64) -> usize {
    const SLACK: u64 = 64 << 20;
    if slot_bytes == 0 || free_after + SLACK >= reserve {
        return 0;
    }
    (reserve - free_after + SLACK).div_ceil(slot_bytes) as usize
}

/// A slot's size for blobs of `blob_bytes`: rounded up to 256 B so every slot starts aligned.
pub fn slot_bytes(blob_bytes: usize) -> usize {
    blob_bytes.div_ceil(256) * 256
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!("auto".parse::<CacheSize>(), Ok(CacheSize::Auto));
        assert_eq!("AUTO".parse::<CacheSize>(), Ok(CacheSize::Auto));
        assert_eq!("12".parse::<CacheSize>(), Ok(CacheSize::Slots(12)));
        assert!("-1".parse::<CacheSize>().is_err());
        assert!("lots".parse::<CacheSize>().is_err());
    }

    #[test]
    fn auto_sizing() {
        let mib = 1u64 << 20;
        // 10 GiB free, 700 MiB reserve, 100 MiB slots: 95 slots
        assert_eq!(auto_slots(10240 * mib, 700 * mib, 100 * mib, 1000), 95);
        assert_eq!(auto_slots(10240 * mib, 700 * mib, 100 * mib, 50), 50);
        assert_eq!(auto_slots(500 * mib, 700 * mib, 100 * mib, 50), 0);
        assert_eq!(shrink_slots(800 * mib, 700 * mib, 100 * mib), 0);
        assert_eq!(shrink_slots(640 * mib, 700 * mib, 100 * mib), 0);
        // 300 MiB free under a 700 MiB reserve: give back (400 + 64) MiB = 5 slots of 100 MiB
        assert_eq!(shrink_slots(300 * mib, 700 * mib, 100 * mib), 5);
        assert_eq!(slot_bytes(1), 256);
        assert_eq!(slot_bytes(1_658_880), 1_658_880);
        assert_eq!(slot_bytes(1_658_881), 1_659_136);
    }
}
