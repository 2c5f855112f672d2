//! The placement plan of a model ([`crate::tiers::plan`]) computed from the loaded metadata and weights' sizes,
//! before the expert store and the GPU are set up (`strata-daemon --plan`, and the plan block logged at start).

use super::Model;
use crate::backend::GpuOptions;
use crate::tiers::plan::{plan, Memory, Plan, PlanInput};
use crate::tiers::profile::Profile;
use crate::tiers::store::{placement_order_of, ResidentMode};
use crate::tiers::vram::CacheSize;

/// The choices the plan is computed for (the daemon's flags).
#[derive(Debug, Clone)]
pub struct PlanOptions<'a> {
    /// The expert profile (`--expert-profile`): placement order and routing shares.
    pub profile: Option<&'a Profile>,
    /// The RAM copy's mode.
    pub mode: ResidentMode,
    /// Memory the RAM copy leaves free (bytes).
    pub headroom: u64,
    /// Whether the RAM copy is to be locked (`false`: `--no-mlock`).
    pub lock: bool,
    /// GPU use, the context and the prefill chunk.
    pub gpu: &'a GpuOptions,
    /// `--pcie-frac`.
    pub pcie_frac: f64,
}

impl Model {
    /// The placement plan for `o` on this machine's memory `mem`. Errors: the GPU driver failed while asked for
    /// its free memory.
    pub fn placement_plan(&self, o: &PlanOptions<'_>, mem: Memory) -> Result<Plan, String> {
        let layout = self.expert_layout();
        let (n_layer, ne) = layout.as_ref().map_or((0, 0), |l| (l.n_layer(), l.n_expert));
        let ranks = o.profile.map(|p| p.ranks());
        let order = placement_order_of(n_layer, ne, ranks.as_deref());
        // routing shares: each layer's heat over its sum (uniform for a layer the profile did not see)
        let share = o.profile.map(|p| {
            let mut heat = vec![0f64; n_layer * ne];
            for &(l, e, h) in &p.ranked {
                if let Some(x) = heat.get_mut(l as usize * ne + e as usize) {
                    *x = h.max(0.0) as f64;
                }
            }
            for row in heat.chunks_mut(ne.max(1)) {
                let sum: f64 = row.iter().sum();
                row.iter_mut().for_each(|x| *x = if sum > 0.0 { *x / sum } else { 1.0 / ne as f64 });
            }
            heat
        });
        let dense = self.file.tensors.iter().filter(|t| !t.name.contains("_exps"));
        let dense_bytes: u64 = dense.clone().map(|t| t.size_bytes).sum();
        // a token reads one row of the embeddings, unless the output head is the same matrix
        let tied = !self.file.tensors.iter().any(|t| t.name == "output.weight");
        let embd: u64 = self.file.tensors.iter().filter(|t| t.name == "token_embd.weight").map(|t| t.size_bytes).sum();
        let dense_read_bytes = if tied { dense_bytes } else { dense_bytes - embd };
        let c = &self.cfg;
        let kv_bytes = self.kv_type().cache_bytes(c.n_layer, o.gpu.n_ctx, c.n_head_kv * c.head_dim) as u64;
        let gpu = crate::backend::gpu_view(&self.model_ref(), o.gpu, layout.as_ref())?;
        Ok(plan(&PlanInput {
            layout: layout.as_ref(),
            top_k: c.n_expert_used,
            order,
            share,
            dense_bytes,
            dense_read_bytes,
            kv_bytes,
            n_ctx: o.gpu.n_ctx,
            mode: o.mode,
            headroom: o.headroom,
            lock: o.lock,
            cache: if gpu.is_some() { o.gpu.cache } else { CacheSize::Slots(0) },
            gpu,
            pcie_frac: o.pcie_frac,
            mem,
        }))
    }
}
