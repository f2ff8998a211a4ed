//! Terminal and Markdown tables.

use crate::serve::ServeReport;
use crate::stats::Summary;

/// A simple aligned table: first column left-aligned, the rest right-aligned.
pub fn render(header: &[String], rows: &[Vec<String>], markdown: bool) -> String {
    let ncol = header.len();
    let mut w = vec![0usize; ncol];
    for r in std::iter::once(header).chain(rows.iter().map(|r| r.as_slice())) {
        for (i, c) in r.iter().enumerate().take(ncol) {
            w[i] = w[i].max(c.chars().count());
        }
    }
    if markdown {
        for x in w.iter_mut() {
            *x = (*x).max(3);
        }
    }
    let fmt_row = |r: &[String]| {
        let cells: Vec<String> = (0..ncol)
            .map(|i| {
                let c = r.get(i).map(String::as_str).unwrap_or("");
                if i == 0 {
                    format!("{c:<width$}", width = w[i])
                } else {
                    format!("{c:>width$}", width = w[i])
                }
            })
            .collect();
        if markdown {
            format!("| {} |", cells.join(" | "))
        } else {
            cells.join("  ")
        }
    };
    let mut out = String::new();
    out.push_str(&fmt_row(header));
    out.push('\n');
    if markdown {
        let sep: Vec<String> = (0..ncol)
            .map(|i| {
                if i == 0 {
                    "-".repeat(w[i])
                } else {
                    format!("{}:", "-".repeat(w[i] - 1))
                }
            })
            .collect();
        out.push_str(&format!("| {} |\n", sep.join(" | ")));
    } else {
        out.push_str(&"-".repeat(w.iter().sum::<usize>() + 2 * (ncol - 1)));
        out.push('\n');
    }
    for r in rows {
        out.push_str(&fmt_row(r));
        out.push('\n');
    }
    out
}

/// Rows (metric name, value) of one serve report, lower-is-better flag per row.
pub fn metric_rows(r: &ServeReport) -> Vec<(String, f64, bool)> {
    let mut v = Vec::new();
    let mut lat = |name: &str, s: &Summary| {
        v.push((format!("{name} mean (ms)"), s.mean, true));
        v.push((format!("{name} p50 (ms)"), s.p50, true));
        v.push((format!("{name} p90 (ms)"), s.p90, true));
        v.push((format!("{name} p99 (ms)"), s.p99, true));
    };
    lat("TTFT", &r.ttft_ms);
    lat("ITL", &r.itl_ms);
    lat("E2E latency", &r.e2e_ms);
    v.push(("TPOT mean (ms)".into(), r.tpot_ms.mean, true));
    v.push((
        "output throughput (tok/s)".into(),
        r.output_throughput,
        false,
    ));
    v.push(("total throughput (tok/s)".into(), r.total_throughput, false));
    v.push((
        "request throughput (req/s)".into(),
        r.request_throughput,
        false,
    ));
    v.push((
        "cached-token fraction".into(),
        r.cached_fraction.unwrap_or(f64::NAN),
        false,
    ));
    v.push(("prompt tokens".into(), r.prompt_tokens as f64, false));
    v.push(("output tokens".into(), r.output_tokens as f64, false));
    v.push(("duration (s)".into(), r.duration_s, true));
    v
}

pub fn fmt_num(x: f64) -> String {
    if x.is_nan() {
        "n/a".into()
    } else if x.abs() >= 1000.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

pub fn serve_table(r: &ServeReport, markdown: bool) -> String {
    let header = vec!["metric".to_string(), r.label.clone()];
    let mut rows: Vec<Vec<String>> = metric_rows(r)
        .into_iter()
        .map(|(n, x, _)| vec![n, fmt_num(x)])
        .collect();
    rows.push(vec![
        "requests ok / failed".into(),
        format!("{} / {}", r.completed, r.failed),
    ]);
    let mut out = format!(
        "workload {} ({} requests, max_tokens {}, concurrency {}, rate {})\n",
        r.workload.as_str(),
        r.num_requests,
        r.max_tokens,
        r.concurrency.map_or("unlimited".into(), |c| c.to_string()),
        r.request_rate
            .map_or("all at once".into(), |x| format!("{x}/s")),
    );
    out.push_str(&render(&header, &rows, markdown));
    for e in &r.first_errors {
        out.push_str(&format!("error: {e}\n"));
    }
    out
}

/// Side by side: `a` (cachet) vs `b` (peer), with the ratio a/b.
pub fn compare_table(a: &ServeReport, b: &ServeReport, markdown: bool) -> String {
    let header = vec![
        "metric".to_string(),
        a.label.clone(),
        b.label.clone(),
        format!("{} / {}", a.label, b.label),
    ];
    let ra = metric_rows(a);
    let rb = metric_rows(b);
    let mut rows: Vec<Vec<String>> = ra
        .into_iter()
        .zip(rb)
        .map(|((n, x, _), (_, y, _))| {
            let ratio = if y != 0.0 && x.is_finite() && y.is_finite() {
                format!("{:.2}×", x / y)
            } else {
                "n/a".into()
            };
            vec![n, fmt_num(x), fmt_num(y), ratio]
        })
        .collect();
    rows.push(vec![
        "requests ok / failed".into(),
        format!("{} / {}", a.completed, a.failed),
        format!("{} / {}", b.completed, b.failed),
        String::new(),
    ]);
    render(&header, &rows, markdown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_markdown_and_plain() {
        let h = vec!["a".to_string(), "bb".to_string()];
        let rows = vec![vec!["x".to_string(), "1".to_string()]];
        assert_eq!(
            render(&h, &rows, true),
            "| a   |  bb |\n| --- | --: |\n| x   |   1 |\n"
        );
        assert_eq!(render(&h, &rows, false), "a  bb\n-----\nx   1\n");
    }
}
