//! Expert tiers (DESIGN.md §3-5): the placement policy shared by the engine and the replay tool, and the
//! replay of routing traces.

pub mod policy;
pub mod replay;
pub mod stats;
