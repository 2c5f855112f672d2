//! Where each expert's bytes are in the GGUF file, and the blob layout (DESIGN.md §3): an expert's blob is its
//! gate | up | down slices, verbatim GGUF blocks, back to back; all experts of one layer have one blob size.
//!
//! In GGUF, `blk.L.ffn_{gate,up}_exps.weight` have dims `[n_embd, n_ff_exp, n_expert]` and
//! `blk.L.ffn_down_exps.weight` `[n_ff_exp, n_embd, n_expert]`; expert e's slice of each is contiguous at
//! `tensor offset + e × (tensor bytes / n_expert)`.

use crate::arch::weights::{Ffn, Weight, Weights};
use crate::quant::GgmlType;

/// One role's tensor in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleSlice {
    /// File offset of expert 0's slice (bytes).
    pub base: u64,
    /// Bytes of one expert's slice.
    pub bytes: usize,
    /// Block format.
    pub ty: GgmlType,
    /// Rows of one expert's matrix.
    pub rows: usize,
    /// Columns (row length in elements).
    pub cols: usize,
}

/// Blob geometry of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerLayout {
    /// `ffn_gate_exps`.
    pub gate: RoleSlice,
    /// `ffn_up_exps`.
    pub up: RoleSlice,
    /// `ffn_down_exps`.
    pub down: RoleSlice,
}

impl LayerLayout {
    /// Blob size: gate + up + down bytes of one expert.
    pub fn blob_bytes(&self) -> usize {
        self.gate.bytes + self.up.bytes + self.down.bytes
    }

    /// The three `(file offset, bytes)` slices of expert `e`, in blob order (gate, up, down).
    pub fn file_slices(&self, e: usize) -> [(u64, usize); 3] {
        [self.gate, self.up, self.down].map(|r| (r.base + (e * r.bytes) as u64, r.bytes))
    }
}

/// Expert geometry of a whole model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Experts per layer.
    pub n_expert: usize,
    /// Per layer (every layer of the model has experts).
    pub layers: Vec<LayerLayout>,
}

impl ExpertLayout {
    /// The layout of the `n_expert` experts per layer of an MoE model's `weights`; `None` for a dense model (or
    /// one whose layers are not all MoE).
    pub fn of(weights: &Weights, n_expert: usize) -> Option<ExpertLayout> {
        if n_expert == 0 {
            return None;
        }
        let mut layers = Vec::with_capacity(weights.blocks.len());
        for b in &weights.blocks {
            let Ffn::Moe(ex) = &b.ffn else { return None };
            let role = |w: &Weight| RoleSlice {
                base: w.offset as u64,
                bytes: w.bytes() / n_expert,
                ty: w.ty,
                rows: w.rows / n_expert,
                cols: w.cols,
            };
            layers.push(LayerLayout { gate: role(&ex.gate), up: role(&ex.up), down: role(&ex.down) });
        }
        Some(ExpertLayout { n_expert, layers })
    }

    /// Layers.
    pub fn n_layer(&self) -> usize {
        self.layers.len()
    }

    /// Total bytes of every expert's blob.
    pub fn total_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.blob_bytes() as u64 * self.n_expert as u64).sum()
    }
}
