//! `strata-tools bench-experts` (the CPU pool's expert throughput, no model or GPU): every arm runs and reports
//! positive rates in its JSON, and bad arguments end with a clear error.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata-tools")).arg("bench-experts").args(args).output().unwrap()
}

#[test]
fn every_arm_reports_a_positive_rate() {
    let json = std::env::temp_dir().join(format!("strata-bench-experts-{}.json", std::process::id()));
    let out = bench(&[
        "--preset",
        "tiny",
        "--threads",
        "2",
        "--set-mib",
        "4",
        "--work-mib",
        "8",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("host RAM read"), "{stdout}");
    let d: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).ok();
    let arms = d["arms"].as_array().unwrap();
    let names: Vec<&str> = arms.iter().map(|a| a["arm"].as_str().unwrap()).collect();
    assert_eq!(names, ["cold, all threads", "hot, all threads", "cold, 1 thread"]);
    for a in arms {
        assert!(a["gbps"].as_f64().unwrap() > 0.0, "{a}");
        assert!(a["us_per_expert"].as_f64().unwrap() > 0.0, "{a}");
    }
    assert_eq!(arms[2]["threads"].as_u64(), Some(1));
    // the cold set is larger than one layer's experts (it holds at least two layers)
    assert!(d["set"].as_u64().unwrap() >= 2 * d["per_layer"].as_u64().unwrap());
    assert!(d["host_ram_read_gbps"].as_f64().unwrap() > 0.0);
}

#[test]
fn bad_arguments_are_refused_with_a_reason() {
    for (args, says) in [
        (&["--threads", "0"][..], "--threads"),
        (&["--type", "q5_k"][..], "q4_0 or q8_0"),
        (&["--preset", "gpt-oss"][..], "gpt-oss"),
        (&["--per-layer", "0"][..], "--per-layer"),
    ] {
        let out = bench(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
