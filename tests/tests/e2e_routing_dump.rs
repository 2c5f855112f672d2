//! `--dump-routing FILE` on an MoE model: one JSON line per (token, layer)
//! with the selected experts and renormalised weights; a bad path is an
//! error at start.

use std::time::Duration;

use strata_tests::*;

#[test]
fn dump_routing_records_every_token_and_layer() {
    let dense = strata::gguf::GgufFile::open(model_path()).unwrap();
    let moe = temp_path(".gguf");
    std::fs::write(&moe, strata::model::moe_copy::moe_copy(&dense, 4, 2, 3).unwrap().to_bytes()).unwrap();
    let dump = temp_path(".jsonl");
    let d = Daemon::start_with(&moe, &temp_path(".sock"), &["--dump-routing", dump.to_str().unwrap()]);
    let o = d.ctl(&["--json", "generate", "--max-tokens", "4", "The capital of France is"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["text"].as_str().unwrap().starts_with(" Paris"), "the MoE copy answers like the dense model: {v}");
    let windows = v["counters"]["windows"].as_u64().unwrap() as usize;
    d.signal(nix::sys::signal::Signal::SIGTERM);
    let (st, _) = d.wait(Duration::from_secs(20));
    assert!(st.success());
    let text = std::fs::read_to_string(&dump).unwrap();
    let recs: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("JSON line")).collect();
    let layers = 30;
    let prefill: Vec<_> = recs.iter().filter(|r| r["phase"] == "prefill").collect();
    let decode: Vec<_> = recs.iter().filter(|r| r["phase"] == "decode").collect();
    assert_eq!(prefill.len(), 5 * layers, "5 prompt tokens x 30 layers");
    assert_eq!(decode.len(), windows * layers);
    for r in &recs {
        assert_eq!(r["seq"], 1);
        let ex = r["experts"].as_array().unwrap();
        let w: Vec<f64> = r["weights"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(ex.len(), 2);
        assert_ne!(ex[0], ex[1]);
        assert!(ex.iter().all(|e| e.as_u64().unwrap() < 4));
        assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-5 && w[0] >= w[1], "{r}");
        assert!(r["layer"].as_u64().unwrap() < layers as u64);
    }
    // Positions: prefill 0..5, decode 5.. in order.
    assert_eq!(prefill.iter().map(|r| r["pos"].as_u64().unwrap()).max(), Some(4));
    assert_eq!(decode.first().map(|r| r["pos"].as_u64().unwrap()), Some(5));
    // Routing is not constant across tokens (the router is fitted to nothing, but varies).
    let sets: std::collections::HashSet<String> = recs.iter().map(|r| r["experts"].to_string()).collect();
    assert!(sets.len() > 1);
    std::fs::remove_file(&moe).unwrap();
    std::fs::remove_file(&dump).unwrap();

    let o = run_daemon(&[
        "--model",
        model_path().to_str().unwrap(),
        "--socket",
        temp_path(".sock").to_str().unwrap(),
        "--dump-routing",
        "/nonexistent/dir/r.jsonl",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--dump-routing /nonexistent/dir/r.jsonl"), "{}", stderr(&o));
}
