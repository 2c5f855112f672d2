//! Expert profile: a ranking of all (layer, expert) pairs, hottest first, that seeds placement (RAM budget, VRAM
//! slots) and is learned from routing heat. Binary format (little-endian; docs/FORMATS.md):
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 8 | magic `STRATAPF` |
//! | 8 | 4 | u32 version = 1 |
//! | 12 | 4 | u32 n_layer |
//! | 16 | 4 | u32 n_expert (per layer) |
//! | 20 | 4 | u32 n_expert_used (top-k) |
//! | 24 | 8 | u64 model fingerprint ([`fingerprint`]) |
//! | 32 | 4 | u32 n_ranked (≤ n_layer × n_expert) |
//! | 36 | 4 | u32 reserved, 0 |
//! | 40 | 8 × n_ranked | entries in rank order: u16 layer, u16 expert, f32 heat |
//! | end | 8 | u64 FNV-1a 64 of every byte before it |
//!
//! Saving writes `PATH.tmp`, fsyncs it, renames it over `PATH` and fsyncs the folder, so a crash leaves the old
//! file or the new one, never a torn one; a torn or foreign file fails the checksum or the geometry check.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Magic bytes at offset 0.
pub const MAGIC: &[u8; 8] = b"STRATAPF";
/// Format version written and accepted.
pub const VERSION: u32 = 1;
const HEADER: usize = 40;

/// Errors reading or writing a profile.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Not a profile, torn, or corrupt; says what failed.
    #[error("{path}: not a valid expert profile: {msg}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What failed (magic, version, size, checksum, entry).
        msg: String,
    },
    /// A valid profile of another model.
    #[error("{path}: profile of another model ({msg})")]
    Foreign {
        /// The file.
        path: PathBuf,
        /// Which geometry field differs.
        msg: String,
    },
}

/// The model geometry a profile belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Layers with experts.
    pub n_layer: u32,
    /// Experts per layer.
    pub n_expert: u32,
    /// Experts per token.
    pub n_expert_used: u32,
    /// [`fingerprint`] of the model's expert tensors.
    pub fingerprint: u64,
}

/// FNV-1a 64-bit hash (Fowler–Noll–Vo; offset basis 0xcbf29ce484222325, prime 0x100000001b3).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Fingerprint of a model's experts: FNV-1a 64 over each expert tensor's name, GGML type id and dimensions, in
/// the order given (not their offsets or bytes, so re-saving the same model elsewhere keeps it).
pub fn fingerprint<'a>(tensors: impl IntoIterator<Item = (&'a str, u32, &'a [u64])>) -> u64 {
    let mut buf = Vec::new();
    for (name, ty, dims) in tensors {
        buf.extend_from_slice(name.as_bytes());
        buf.push(0);
        buf.extend_from_slice(&ty.to_le_bytes());
        for d in dims {
            buf.extend_from_slice(&d.to_le_bytes());
        }
    }
    fnv1a64(&buf)
}

/// The profile geometry of an MoE model: its expert counts and the [`fingerprint`] of its `*_exps` and
/// `ffn_gate_inp` tensors in file order.
pub fn geometry_of(file: &crate::gguf::GgufFile, cfg: &crate::arch::config::ModelConfig) -> Geometry {
    let tensors: Vec<_> = file
        .tensors
        .iter()
        .filter(|t| t.name.contains("_exps.") || t.name.contains("ffn_gate_inp"))
        .map(|t| (t.name.as_str(), t.ggml_type as u32, t.dims.as_slice()))
        .collect();
    Geometry {
        n_layer: cfg.n_layer as u32,
        n_expert: cfg.n_expert as u32,
        n_expert_used: cfg.n_expert_used as u32,
        fingerprint: fingerprint(tensors),
    }
}

/// A profile: geometry and the ranked pairs with their heat.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Model geometry.
    pub geometry: Geometry,
    /// `(layer, expert, heat)` hottest first; every pair at most once.
    pub ranked: Vec<(u16, u16, f32)>,
}

impl Profile {
    /// Serializes to the documented format.
    pub fn to_bytes(&self) -> Vec<u8> {
        let g = &self.geometry;
        let mut b = Vec::with_capacity(HEADER + 8 * self.ranked.len() + 8);
        b.extend_from_slice(MAGIC);
        for v in [VERSION, g.n_layer, g.n_expert, g.n_expert_used] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&g.fingerprint.to_le_bytes());
        b.extend_from_slice(&(self.ranked.len() as u32).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for &(l, e, h) in &self.ranked {
            b.extend_from_slice(&l.to_le_bytes());
            b.extend_from_slice(&e.to_le_bytes());
            b.extend_from_slice(&h.to_le_bytes());
        }
        let sum = fnv1a64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses and validates `bytes` (read from `path`, named in errors): magic, version, size, checksum, entries
    /// in range and unique. Errors: [`ProfileError::Corrupt`].
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Profile, ProfileError> {
        let bad = |msg: String| ProfileError::Corrupt { path: path.to_path_buf(), msg };
        if bytes.len() < HEADER + 8 {
            return Err(bad(format!("{} bytes, shorter than the header", bytes.len())));
        }
        if &bytes[..8] != MAGIC {
            return Err(bad("wrong magic".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        if u32_at(8) != VERSION {
            return Err(bad(format!("version {} (this build reads {VERSION})", u32_at(8))));
        }
        let n_ranked = u32_at(32) as usize;
        let want = HEADER + 8 * n_ranked + 8;
        if bytes.len() != want {
            return Err(bad(format!("{} bytes, {want} expected for {n_ranked} entries (torn?)", bytes.len())));
        }
        let body = &bytes[..want - 8];
        let sum = u64::from_le_bytes(bytes[want - 8..].try_into().expect("8 bytes"));
        if fnv1a64(body) != sum {
            return Err(bad("checksum mismatch (torn or corrupt)".into()));
        }
        let geometry = Geometry {
            n_layer: u32_at(12),
            n_expert: u32_at(16),
            n_expert_used: u32_at(20),
            fingerprint: u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes")),
        };
        if u32_at(36) != 0 {
            return Err(bad(format!("reserved field is {}, not 0", u32_at(36))));
        }
        // entries name layers and experts in 16 bits; a geometry beyond that (or beyond 2^24 experts in all, far
        // above any model) is not a profile this format can hold, and would size the tables below
        let total = geometry.n_layer as u64 * geometry.n_expert as u64;
        if geometry.n_layer > 1 << 16 || geometry.n_expert > 1 << 16 || total > 1 << 24 {
            return Err(bad(format!(
                "implausible geometry {} layers × {} experts",
                geometry.n_layer, geometry.n_expert
            )));
        }
        let total = total as usize;
        if n_ranked > total {
            return Err(bad(format!("{n_ranked} entries for {total} experts")));
        }
        let mut seen = vec![false; total];
        let mut ranked = Vec::with_capacity(n_ranked);
        for i in 0..n_ranked {
            let o = HEADER + 8 * i;
            let l = u16::from_le_bytes([bytes[o], bytes[o + 1]]);
            let e = u16::from_le_bytes([bytes[o + 2], bytes[o + 3]]);
            let h = f32::from_le_bytes(bytes[o + 4..o + 8].try_into().expect("4 bytes"));
            if l as u32 >= geometry.n_layer || e as u32 >= geometry.n_expert {
                return Err(bad(format!("entry {i}: expert ({l}, {e}) out of range")));
            }
            let idx = l as usize * geometry.n_expert as usize + e as usize;
            if std::mem::replace(&mut seen[idx], true) {
                return Err(bad(format!("entry {i}: expert ({l}, {e}) ranked twice")));
            }
            if !h.is_finite() {
                return Err(bad(format!("entry {i}: heat {h}")));
            }
            ranked.push((l, e, h));
        }
        Ok(Profile { geometry, ranked })
    }

    /// Reads and validates a profile and checks it belongs to `want`. Errors: unreadable
    /// ([`ProfileError::Io`]), invalid ([`ProfileError::Corrupt`]), another model ([`ProfileError::Foreign`]).
    pub fn load(path: &Path, want: &Geometry) -> Result<Profile, ProfileError> {
        let bytes = std::fs::read(path).map_err(|source| ProfileError::Io { path: path.to_path_buf(), source })?;
        let p = Profile::from_bytes(&bytes, path)?;
        let g = &p.geometry;
        let foreign = |msg: String| Err(ProfileError::Foreign { path: path.to_path_buf(), msg });
        if g.n_layer != want.n_layer || g.n_expert != want.n_expert {
            return foreign(format!(
                "{} layers × {} experts, the model has {} × {}",
                g.n_layer, g.n_expert, want.n_layer, want.n_expert
            ));
        }
        if g.fingerprint != want.fingerprint || g.n_expert_used != want.n_expert_used {
            return foreign("expert tensors differ (fingerprint)".into());
        }
        Ok(p)
    }

    /// Writes the profile atomically: `PATH.tmp`, fsync, rename over `PATH`, fsync of the folder.
    /// Errors: [`ProfileError::Io`] (the old file, if any, is left as it was).
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        let io = |source| ProfileError::Io { path: path.to_path_buf(), source };
        // a temporary name of this save's own (saves may run at once, in this process or another), renamed over
        // `path` when complete: `path` is always the old or the new whole file
        static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp.{}.{n}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let written = (|| {
            let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(&self.to_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// The rank of every `(layer, expert)`: index = layer × n_expert + expert, `None` = unranked.
    pub fn ranks(&self) -> Vec<Option<u32>> {
        let n_expert = self.geometry.n_expert as usize;
        let mut r = vec![None; self.geometry.n_layer as usize * n_expert];
        for (i, &(l, e, _)) in self.ranked.iter().enumerate() {
            r[l as usize * n_expert + e as usize] = Some(i as u32);
        }
        r
    }
}

/// Ranks every expert for a save: by `heat` (descending), then by the previous profile's rank (`prior`, ranked
/// before unranked), then by index. `heat` is indexed `layer × n_expert + expert`.
pub fn rank_by_heat(heat: &[f64], n_expert: usize, prior: Option<&[Option<u32>]>) -> Vec<(u16, u16, f32)> {
    let mut idx: Vec<usize> = (0..heat.len()).collect();
    let prior_rank = |i: usize| prior.and_then(|p| p.get(i).copied().flatten()).unwrap_or(u32::MAX);
    idx.sort_by(|&a, &b| heat[b].total_cmp(&heat[a]).then(prior_rank(a).cmp(&prior_rank(b))).then(a.cmp(&b)));
    idx.into_iter().map(|i| ((i / n_expert) as u16, (i % n_expert) as u16, heat[i] as f32)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> Geometry {
        Geometry { n_layer: 2, n_expert: 3, n_expert_used: 2, fingerprint: 0xABCD }
    }

    #[test]
    fn round_trip_and_every_truncation_is_refused() {
        let p = Profile { geometry: geo(), ranked: vec![(1, 2, 9.5), (0, 0, 3.0), (0, 1, 0.0)] };
        let b = p.to_bytes();
        let path = Path::new("x.prof");
        assert_eq!(Profile::from_bytes(&b, path).unwrap(), p);
        for cut in 0..b.len() {
            assert!(Profile::from_bytes(&b[..cut], path).is_err(), "cut at {cut}");
        }
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x40;
            assert!(Profile::from_bytes(&c, path).is_err(), "flip at {i}");
        }
    }

    #[test]
    fn duplicates_and_out_of_range_are_corrupt() {
        let dup = Profile { geometry: geo(), ranked: vec![(0, 1, 1.0), (0, 1, 1.0)] }.to_bytes();
        assert!(Profile::from_bytes(&dup, Path::new("d")).unwrap_err().to_string().contains("twice"));
        let oor = Profile { geometry: geo(), ranked: vec![(2, 0, 1.0)] }.to_bytes();
        assert!(Profile::from_bytes(&oor, Path::new("o")).unwrap_err().to_string().contains("out of range"));
        // a forged header (valid checksum) with a huge geometry or a reserved field not 0 is refused, not sized
        let reseal = |mut b: Vec<u8>| {
            let n = b.len() - 8;
            let sum = fnv1a64(&b[..n]);
            b[n..].copy_from_slice(&sum.to_le_bytes());
            b
        };
        let mut huge = Profile { geometry: geo(), ranked: vec![] }.to_bytes();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = Profile::from_bytes(&reseal(huge), Path::new("h")).unwrap_err().to_string();
        assert!(e.contains("implausible geometry"), "{e}");
        let mut res = Profile { geometry: geo(), ranked: vec![(0, 1, 1.0)] }.to_bytes();
        res[36] = 1;
        let e = Profile::from_bytes(&reseal(res), Path::new("r")).unwrap_err().to_string();
        assert!(e.contains("reserved"), "{e}");
    }

    #[test]
    fn ranking_by_heat_then_prior_then_index() {
        // heat: (0,0)=1 (0,1)=5 (0,2)=1 (1,0)=0 (1,1)=1 (1,2)=0; prior ranks (1,1) first, then (0,2)
        let heat = [1.0, 5.0, 1.0, 0.0, 1.0, 0.0];
        let prior = [None, None, Some(1), None, Some(0), None];
        let r = rank_by_heat(&heat, 3, Some(&prior));
        let order: Vec<(u16, u16)> = r.iter().map(|x| (x.0, x.1)).collect();
        assert_eq!(order, vec![(0, 1), (1, 1), (0, 2), (0, 0), (1, 0), (1, 2)]);
    }
}
