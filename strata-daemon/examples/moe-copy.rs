//! Writes an MoE GGUF exactly equivalent to a dense llama GGUF (every expert
//! a copy of the FFN): `cargo run --release --example moe-copy -- DENSE OUT [N_EXPERT] [N_USED]`.
fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    anyhow::ensure!(a.len() >= 3, "usage: moe-copy DENSE.gguf OUT.gguf [N_EXPERT=4] [N_USED=2]");
    let dense = strata::gguf::GgufFile::open(&a[1])?;
    let ne = a.get(3).map(|s| s.parse()).transpose()?.unwrap_or(4);
    let nu = a.get(4).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let w = strata::model::moe_copy::moe_copy(&dense, ne, nu, 1)?;
    std::fs::write(&a[2], w.to_bytes())?;
    println!("{} ({} experts, top-{})", a[2], ne, nu);
    Ok(())
}
