//! GPU tests: run only with `STRATA_GPU_TESTS=1` on a machine with a CUDA driver (CI has none). They write a
//! small synthetic MoE, run `strata-tools gpu-check` on it (dense products of every format against the CPU
//! path on random inputs; the forward pass against the CPU in six tier configurations) and check the figures.

use std::process::Command;

fn enabled() -> bool {
    std::env::var("STRATA_GPU_TESTS").is_ok_and(|v| v == "1")
}

#[test]
fn gpu_matches_cpu() {
    if !enabled() {
        eprintln!("skipped: set STRATA_GPU_TESTS=1 on a GPU machine");
        return;
    }
    let bin = env!("CARGO_BIN_EXE_strata-tools");
    let dir = std::env::temp_dir().join(format!("strata-gpu-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    let st = Command::new(bin).args(["synth-moe", "--preset", "tiny", "--out"]).arg(&model).status().unwrap();
    assert!(st.success());
    let json = dir.join("check.json");
    let st = Command::new(bin)
        .args(["gpu-check", "--positions", "64", "--model"])
        .arg(&model)
        .arg("--json")
        .arg(&json)
        .status()
        .unwrap();
    assert!(st.success());
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let worst = r["kernels_worst_rel_err_vs_cpu"].as_f64().unwrap();
    assert!(worst < 1e-5, "dense or expert products differ from the CPU path: {worst}");
    // the expert kernels (gate/up + down from a VRAM slot) were checked: 4 formats × 4 shapes
    let experts = r["kernels"].as_array().unwrap().iter().filter(|k| k.get("expert_e").is_some()).count();
    assert_eq!(experts, 16);
    let rows = r["forward"].as_array().unwrap();
    assert_eq!(rows.len(), 8);
    let rows = &rows[1..]; // [0] is the CPU's own batch-vs-decode floor
    for row in rows {
        assert!(row.get("failed").is_none(), "{row}");
        assert!(row["positions"].as_u64().unwrap() >= 60, "{row}");
    }
    // static placement without PCIe: the same request gives the same bytes twice
    assert_eq!(rows[1]["digest"], rows[2]["digest"]);
    // every lookup a hit with all experts in VRAM; the adaptive tier swaps and raises the hit rate
    assert_eq!(rows[0]["vram_hits"], rows[0]["lookups"]);
    assert!(rows[3]["swaps"].as_u64().unwrap() > 0);
    assert!(rows[5]["pcie_entries"].as_u64().unwrap() > 0);
    // RAM adapt keeps working beside the VRAM tier: promotions happen, reads from the file happen
    assert!(rows[6]["promotions"].as_u64().unwrap() > 0, "{}", rows[6]);
    for row in rows {
        let kl = row["mean_kl"].as_f64().unwrap();
        assert!(kl < 0.05, "forward pass far from the CPU path: {row}");
    }
}
