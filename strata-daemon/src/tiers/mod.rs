//! Expert tiers (DESIGN.md §3-7): the host expert store (resident RAM copy and file tier), its layout, memory and
//! file reads, the placement policy shared by the engine and the replay tool, the expert profile, live knobs,
//! and the replay of routing traces.

pub mod arena;
pub mod exchange;
pub mod fileio;
pub mod knobs;
pub mod layout;
pub mod lrfu;
pub mod plan;
pub mod policy;
pub mod profile;
pub mod replay;
pub mod split;
pub mod stats;
pub mod store;
pub mod vram;
