//! The llama.cpp side: `llama-bench` and `llama-batched-bench` on the same file and threads.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::{KernelArgs, Rate};
use crate::error::BenchError;

/// Parses `llama-bench -o json` output: (n_prompt, n_gen, n_depth, avg_ts, stddev_ts).
pub fn parse_llama_bench(json: &str) -> Vec<(u64, u64, u64, f64, f64)> {
    let start = json.find('[').unwrap_or(0);
    let v: Value = serde_json::from_str(&json[start..]).unwrap_or(Value::Null);
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    (
                        t["n_prompt"].as_u64().unwrap_or(0),
                        t["n_gen"].as_u64().unwrap_or(0),
                        t["n_depth"].as_u64().unwrap_or(0),
                        t["avg_ts"].as_f64().unwrap_or(f64::NAN),
                        t["stddev_ts"].as_f64().unwrap_or(0.0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Parses `llama-batched-bench --output-format jsonl`: (pl, speed_tg).
pub fn parse_batched_bench(out: &str) -> Vec<(u64, f64)> {
    out.lines()
        .filter(|l| l.trim_start().starts_with('{') && l.contains("speed_tg"))
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .map(|v| {
            (
                v["pl"].as_u64().unwrap_or(0),
                v["speed_tg"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect()
}

fn run_tool(bin: &Path, args: &[String], cmds: &mut Vec<String>) -> Result<String, BenchError> {
    let line = format!("{} {}", bin.display(), args.join(" "));
    eprintln!("[kernel] {line}");
    cmds.push(line);
    let out = Command::new(bin)
        .args(args)
        .output()
        .map_err(|e| BenchError::io(format!("running {}", bin.display()), e))?;
    if !out.status.success() {
        return Err(BenchError::Peer(format!(
            "{} failed with {}: {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .chars()
                .rev()
                .take(1500)
                .collect::<String>()
                .chars()
                .rev()
                .collect::<String>()
        )));
    }
    Ok(format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

pub(super) type LlamaRates = Vec<(String, Rate, String)>;

pub(super) fn llama_side(
    a: &KernelArgs,
    model: &Path,
    cmds: &mut Vec<String>,
) -> Result<LlamaRates, BenchError> {
    let lb = crate::peer::find("llama-bench", a.llama_bench.as_ref())?;
    let m = model.display().to_string();
    let t = a.threads.to_string();
    let r = a.reps.max(1).to_string();
    let mut out = Vec::new();
    let s = |x: &str| x.to_string();
    let j1 = run_tool(
        &lb,
        &[
            s("-m"),
            m.clone(),
            s("-t"),
            t.clone(),
            s("-p"),
            a.prompt.to_string(),
            s("-n"),
            a.gen.to_string(),
            s("-r"),
            r.clone(),
            s("-o"),
            s("json"),
        ],
        cmds,
    )?;
    for (np, ng, _, avg, sd) in parse_llama_bench(&j1) {
        let rate = Rate { mean: avg, std: sd };
        if np > 0 && ng == 0 {
            out.push((
                format!("prefill pp{np}"),
                rate,
                format!("llama-bench pp{np}"),
            ));
        } else if ng > 0 && np == 0 {
            out.push((
                format!("decode tg{ng}, batch 1"),
                rate,
                format!("llama-bench tg{ng}"),
            ));
        }
    }
    let j2 = run_tool(
        &lb,
        &[
            s("-m"),
            m.clone(),
            s("-t"),
            t.clone(),
            s("-p"),
            s("0"),
            s("-n"),
            a.depth_steps.to_string(),
            s("-d"),
            a.depth.to_string(),
            s("-r"),
            r,
            s("-o"),
            s("json"),
        ],
        cmds,
    )?;
    for (_, ng, d, avg, sd) in parse_llama_bench(&j2) {
        out.push((
            format!("decode tg{ng} at depth {d}, batch 1"),
            Rate { mean: avg, std: sd },
            format!("llama-bench -p 0 -n {ng} -d {d}"),
        ));
    }
    let bb = match &a.llama_batched_bench {
        Some(p) => p.clone(),
        None => lb.with_file_name("llama-batched-bench"),
    };
    if bb.is_file() && !a.batches.is_empty() {
        let npl: Vec<String> = a.batches.iter().map(|b| b.to_string()).collect();
        let max_b = a.batches.iter().copied().max().unwrap_or(1);
        let ctx = (max_b * (a.batch_ctx + a.batch_steps) + 64).max(2048);
        let o = run_tool(
            &bb,
            &[
                s("-m"),
                m,
                s("-t"),
                t.clone(),
                s("-tb"),
                t,
                s("-c"),
                ctx.to_string(),
                s("-b"),
                s("2048"),
                s("-ub"),
                s("512"),
                s("-npp"),
                a.batch_ctx.to_string(),
                s("-ntg"),
                a.batch_steps.to_string(),
                s("-npl"),
                npl.join(","),
                s("--output-format"),
                s("jsonl"),
            ],
            cmds,
        )?;
        for (pl, tg) in parse_batched_bench(&o) {
            out.push((
                format!("decode batch {pl} at ctx {} (aggregate)", a.batch_ctx),
                Rate { mean: tg, std: 0.0 },
                format!(
                    "llama-batched-bench -npp {} -ntg {} (1 run)",
                    a.batch_ctx, a.batch_steps
                ),
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama_bench_json() {
        let j = r#"warming up
[
  {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 900.5, "stddev_ts": 12.0},
  {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 150.0, "stddev_ts": 3.0}
]"#;
        let v = parse_llama_bench(j);
        assert_eq!(v, vec![(512, 0, 0, 900.5, 12.0), (0, 128, 0, 150.0, 3.0)]);
    }

    #[test]
    fn parses_batched_bench_jsonl() {
        let o = "main: n_kv_max = 2048\n{\"n_kv_max\": 2048, \"pp\": 128, \"tg\": 32, \"pl\": 8, \"n_kv\": 1280, \"t_pp\": 1.0, \"speed_pp\": 1024.0, \"t_tg\": 1.0, \"speed_tg\": 256.0, \"t\": 2.0, \"speed\": 640.0}\n";
        assert_eq!(parse_batched_bench(o), vec![(8, 256.0)]);
    }
}
