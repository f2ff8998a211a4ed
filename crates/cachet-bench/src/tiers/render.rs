//! The report as markdown: the TTFT table, the in-process breakdown, the throughput table.

use super::{TiersReport, BLOCK};

fn f1(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// The TTFT table, the breakdown and the throughput table, as markdown.
pub fn markdown(r: &TiersReport) -> String {
    let mut out = String::new();
    let loaded_mb = (r.loaded_tokens / BLOCK) as f64 * r.block_bytes as f64 / 1e6;
    out.push_str(&format!(
        "Time to first token of a {}-token prompt ({}, {} threads on {} CPUs, f16 KV, \
         `max_tokens` 1), {} interleaved rounds; a load brings {} tokens ({} blocks, {:.1} MB) and \
         computes the last {}. Server-side TTFT (`metrics.time_to_first_token_ms`); the client's \
         wall time beside it. Load average at the end: {}.\n\n",
        r.prompt_tokens,
        r.model,
        r.threads,
        r.cpus,
        r.rounds,
        r.loaded_tokens,
        r.loaded_tokens / BLOCK,
        loaded_mb,
        r.prompt_tokens - r.loaded_tokens,
        r.load_average,
    ));
    out.push_str(
        "| | TTFT median (ms) | p10–p90 | min–max | client median (ms) | computed / this |\n",
    );
    out.push_str("|---|---|---|---|---|---|\n");
    let base = r.ttft.first().map_or(f64::NAN, |c| c.server_ms.median);
    for c in &r.ttft {
        out.push_str(&format!(
            "| {} | {} | {}–{} | {}–{} | {} | {:.1}× |\n",
            c.name,
            f1(c.server_ms.median),
            f1(c.server_ms.p10),
            f1(c.server_ms.p90),
            f1(c.server_ms.min),
            f1(c.server_ms.max),
            f1(c.client_ms.median),
            base / c.server_ms.median,
        ));
    }
    if !r.breakdown.is_empty() {
        out.push_str(
            "\nWhere the time goes (in-process: the server's engine core, executor and tier \
             client, no HTTP; medians over the rounds, ms):\n\n| phase | median | p10–p90 |\n|---|---|---|\n",
        );
        for p in &r.breakdown {
            out.push_str(&format!(
                "| {} | {} | {}–{} |\n",
                p.name,
                f1(p.ms.median),
                f1(p.ms.p10),
                f1(p.ms.p90)
            ));
        }
    }
    if let Some(e) = &r.throughput_error {
        out.push_str(&format!("\nThe shared-prefix workload failed: {e}\n"));
    }
    if !r.throughput.is_empty() {
        out.push_str(
            "\nShared-prefix workload (`cachet bench serve`'s generator, streamed chat), the same \
             sessions on one instance or split between two; the system prompt was computed once \
             before the run, on the first instance:\n\n| setup | requests | s | output tok/s | total tok/s | cached | loaded from Redis (tokens) | TTFT p50 (ms) |\n|---|---|---|---|---|---|---|---|\n",
        );
        for t in &r.throughput {
            out.push_str(&format!(
                "| {} | {} | {:.1} | {:.1} | {:.0} | {:.1} % | {} | {} |\n",
                t.name,
                t.requests,
                t.duration_s,
                t.output_tok_s,
                t.total_tok_s,
                t.cached_fraction * 100.0,
                t.redis_tokens,
                f1(t.ttft_p50_ms)
            ));
        }
    }
    out
}
