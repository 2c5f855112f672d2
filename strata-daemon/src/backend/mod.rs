//! Compute backends. `cpu` is always built: a spinning fork-join worker pool running the
//! quantized kernels of [`crate::quant`].

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kv;

use crate::model::Model;
use crate::tiers::vram::CacheSize;

/// How the daemon uses a GPU (flags of DESIGN.md §4).
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// Try the GPU (`--gpu auto`); false = CPU only (`--gpu off`).
    pub enabled: bool,
    /// CUDA device ordinal.
    pub device: usize,
    /// `--expert-cache N|auto`.
    pub cache: CacheSize,
    /// `--vram-reserve-mib` (MiB).
    pub reserve_mib: u64,
    /// Context length (KV positions in VRAM).
    pub n_ctx: usize,
    /// Prefill chunk (tokens per pass).
    pub max_chunk: usize,
}

/// Attaches the CUDA backend to `model` when a driver, NVRTC and a device are found; otherwise leaves the
/// model on the CPU. Returns the one line to log (what runs where, or why the CPU). Errors: a GPU was found
/// but loading onto it failed (out of VRAM, a format without kernels): the caller decides whether that is
/// fatal.
pub fn attach_gpu(model: &mut Model, o: &GpuOptions) -> Result<String, String> {
    if !o.enabled {
        return Ok("GPU off (--gpu off): running on the CPU".into());
    }
    #[cfg(feature = "cuda")]
    {
        let probe = match cuda::probe(o.device) {
            Ok(p) => p,
            Err(e) => return Ok(format!("{e}: running on the CPU")),
        };
        let d = probe.device.clone();
        let (free, total) = d.mem_info().map_err(|e| e.to_string())?;
        let cfg =
            cuda::GpuConfig { cache: o.cache, reserve: o.reserve_mib << 20, max_chunk: o.max_chunk, n_ctx: o.n_ctx };
        let g = match cuda::GpuModel::load(model, d.clone(), &cfg) {
            Ok(g) => g,
            Err(e @ cuda::GpuError::Architecture { .. }) => {
                return Ok(format!("GPU {}: {e}: running on the CPU", d.name))
            }
            Err(e) => return Err(format!("loading onto {}: {e}", d.name)),
        };
        let slots = g.cache.as_ref().map(|c| c.n_slots).unwrap_or(0);
        if g.cache.is_some() {
            crate::tiers::knobs::GPU_TIER.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        model.gpu = Some(Box::new(g));
        Ok(format!(
            "GPU: {} ({}, {} SMs, {:.1} of {:.1} GiB free at start; {} and {}): dense weights and KV cache in VRAM{}",
            d.name,
            d.arch(),
            d.sms,
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64,
            probe.libcuda,
            probe.libnvrtc,
            if slots > 0 { format!(", {slots} expert slots") } else { String::new() }
        ))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = model;
        Ok("built without the `cuda` feature: running on the CPU".into())
    }
}
