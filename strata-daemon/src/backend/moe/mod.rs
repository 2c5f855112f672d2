//! The MoE layer's parts that every backend shares, kept apart as routing and dispatch: [`router`] turns router
//! logits into each token's top-k experts and weights; [`dispatch`] groups a layer's routing entries by expert
//! and asks the expert store where each routed expert's bytes are (VRAM slot, RAM copy, file blob). Computing
//! the experts is the backends' (`cpu::experts`, the CUDA backend's hybrid layer).

pub mod dispatch;
pub mod router;
