//! `cachet generate` end to end on the simulated executor: spec §4 examples 1 and 2 through the
//! JSONL interface, and the final aggregate line.

use std::process::Command;

fn run(args: &[&str], input: &str) -> Vec<serde_json::Value> {
    let dir = std::env::temp_dir().join(format!("cachet-gen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("in-{}.jsonl", args.len()));
    std::fs::write(&path, input).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cachet"))
        .args([
            "generate",
            "--executor",
            "sim",
            "--output",
            "json",
            "--input",
        ])
        .arg(&path)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn prompt(n: u32) -> String {
    let ids: Vec<String> = (0..n).map(|i| (1000 + i).to_string()).collect();
    format!(
        "{{\"prompt_token_ids\": [{}], \"max_tokens\": 3, \"ignore_eos\": true}}\n",
        ids.join(",")
    )
}

#[test]
fn sequential_repeat_matches_spec_examples_1_and_2() {
    let input = prompt(100).repeat(2);
    let lines = run(
        &[
            "--sequential",
            "--block-size",
            "16",
            "--num-kv-blocks",
            "64",
        ],
        &input,
    );
    assert_eq!(lines.len(), 3);
    let a = &lines[0]["prefill_stats"];
    assert_eq!(a["computed_tokens"], 100);
    assert_eq!(a["cache_creation_tokens"], 96);
    assert_eq!(a["blocks_allocated"], 7);
    assert_eq!(a["blocks_filled"], 6);
    let b = &lines[1]["prefill_stats"];
    assert_eq!(b["local_cached_tokens"], 96);
    assert_eq!(b["computed_tokens"], 4);
    assert_eq!(b["cache_creation_tokens"], 0);
    assert_eq!(b["blocks_allocated"], 1);
    // Same greedy tokens with and without the hit.
    assert_eq!(lines[0]["output_token_ids"], lines[1]["output_token_ids"]);
    assert_eq!(lines[0]["finish_reason"], "length");
    let agg = &lines[2]["aggregate"];
    assert_eq!(agg["prefix_cache_queries"], 200);
    assert_eq!(agg["prefix_cache_hits"], 96);
    assert_eq!(agg["prompt_tokens_local_compute"], 104);
    assert_eq!(agg["cache_creation_tokens"], 96);
    assert_eq!(agg["generation_tokens"], 6);
}

#[test]
fn caching_disabled_flag_reports_no_queries() {
    let input = prompt(40).repeat(2);
    let lines = run(&["--sequential", "--no-enable-prefix-caching"], &input);
    assert_eq!(lines[1]["prefill_stats"]["local_cached_tokens"], 0);
    assert_eq!(lines[2]["aggregate"]["prefix_cache_queries"], 0);
    assert_eq!(lines[2]["aggregate"]["prompt_tokens"], 80);
}

#[test]
fn bad_input_line_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("cachet-gen-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jsonl");
    std::fs::write(&path, "{\"max_tokens\": 3}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cachet"))
        .args(["generate", "--executor", "sim", "--input"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 1"));
}
