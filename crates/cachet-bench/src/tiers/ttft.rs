//! Part 1: time to first token through `cachet serve` over HTTP — computed, loaded from the host
//! tier (with and without warm save buffers, and saving on fill), loaded from Redis — in
//! interleaved rounds.

use std::path::Path;

use super::rounds::interleaved;
use super::servers::{redis_flags, spawn, Answer, Http, RedisProc};
use super::{err, filler_tokens, host_pool_blocks, prompt_ids, TiersArgs, TtftCase, BLOCK};
use crate::compare::ServerProc;
use crate::error::BenchError;

/// The cases, in table order.
const CASES: [&str; 5] = [
    "computed",
    "host tier",
    "host tier, no spare buffers (`--kv-tier-spare-bytes 0`)",
    "Redis (loopback)",
    "host tier saving on fill (`--kv-tier-host-save filled`)",
];

/// The host-tier cases' indices in [`CASES`], in the order of [`Servers::host`].
const HOST_CASES: [usize; 3] = [1, 2, 4];

/// Checks a loaded answer against the computed one: the same first token, exactly `loaded`
/// external tokens, all from `tier`. Returns the external tokens.
fn check_loaded(a: &Answer, want: &Answer, tier: &str, loaded: usize) -> Result<u64, BenchError> {
    let ext = a.prefix["external_cached_tokens"].as_u64().unwrap_or(0);
    let from = a.prefix["external_sources"][tier].as_u64().unwrap_or(0);
    if ext != loaded as u64 || from != ext {
        return Err(err(format!(
            "{tier}: expected {loaded} external tokens from {tier}, got {}",
            a.prefix
        )));
    }
    if a.token_text != want.token_text {
        return Err(err(format!(
            "{tier}: first token {:?} differs from computing ({:?})",
            a.token_text, want.token_text
        )));
    }
    Ok(ext)
}

struct Servers {
    compute: ServerProc,
    /// Host tier with the default spare buffers, with none (the engine's saves into fresh
    /// allocations, as before warm buffers), and saving on fill (so the filler's eviction
    /// copies nothing).
    host: [ServerProc; 3],
    writer: ServerProc,
    reader: ServerProc,
}

/// A host-tier instance whose pool holds one prompt (and one block), so a filler evicts it.
async fn host_server(
    a: &TiersArgs,
    bin: &Path,
    model: &Path,
    name: &str,
    spare: &str,
    save: &str,
    http: &Http,
) -> Result<ServerProc, BenchError> {
    let flags: Vec<String> = [
        "--kv-tier",
        "host",
        "--num-kv-blocks",
        &host_pool_blocks(a.prompt_tokens).to_string(),
        "--kv-tier-spare-bytes",
        spare,
        "--kv-tier-host-save",
        save,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    spawn(a, bin, model, name, a.threads, &flags, http).await
}

pub(super) async fn ttft_part(
    a: &TiersArgs,
    bin: &Path,
    model: &Path,
    redis: &RedisProc,
    http: &Http,
) -> Result<Vec<TtftCase>, BenchError> {
    let n = a.prompt_tokens;
    let loaded = (n - 1) / BLOCK * BLOCK;
    let s = Servers {
        compute: spawn(a, bin, model, "compute", a.threads, &[], http).await?,
        host: [
            host_server(a, bin, model, "host", "64MiB", "evicted", http).await?,
            host_server(a, bin, model, "host-nospare", "0", "evicted", http).await?,
            host_server(a, bin, model, "host-fill", "64MiB", "filled", http).await?,
        ],
        writer: spawn(
            a,
            bin,
            model,
            "writer",
            a.threads,
            &redis_flags(&redis.url()),
            http,
        )
        .await?,
        reader: spawn(
            a,
            bin,
            model,
            "reader",
            a.threads,
            &redis_flags(&redis.url()),
            http,
        )
        .await?,
    };
    let k = CASES.len();
    // Series: the server's TTFT of each case, then the client's.
    let names: Vec<String> = CASES
        .iter()
        .map(|c| format!("{c} (server)"))
        .chain(CASES.iter().map(|c| format!("{c} (client)")))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut external: Vec<Vec<u64>> = vec![Vec::new(); k];
    // The computed answer of this round's prompt (every loaded one is checked against it),
    // made before the round's first case.
    let mut want: Option<(usize, Answer)> = None;
    let mut saved = 0.0;
    let spreads = interleaved(
        "TTFT",
        a.rounds,
        k,
        &names,
        &[0, 1, 2, 3, 4],
        async |round, case| {
            let p = prompt_ids(round as u64 * 2 + 1, n);
            if want.as_ref().is_none_or(|(r, _)| *r != round) {
                want = Some((round, http.complete(&s.compute.base_url, &p).await?));
            }
            let Some((_, want)) = want.as_ref() else {
                return Err(err("no computed answer"));
            };
            let host = HOST_CASES
                .iter()
                .position(|&h| h == case)
                .map(|i| &s.host[i]);
            let got = match (case, host) {
                (0, _) => {
                    let q = prompt_ids(1000 + round as u64, n);
                    http.complete(&s.compute.base_url, &q).await?
                }
                (_, Some(host)) => {
                    let filler = prompt_ids(round as u64 * 2 + 2, filler_tokens(n));
                    http.complete(&host.base_url, &p).await?;
                    http.complete(&host.base_url, &filler).await?;
                    let got = http.complete(&host.base_url, &p).await?;
                    external[case].push(check_loaded(&got, want, "host", loaded)?);
                    got
                }
                _ => {
                    http.complete(&s.writer.base_url, &p).await?;
                    saved += (loaded / BLOCK) as f64;
                    http.settled(&s.writer.base_url, saved).await?;
                    let got = http.complete(&s.reader.base_url, &p).await?;
                    external[case].push(check_loaded(&got, want, "redis", loaded)?);
                    got
                }
            };
            Ok(vec![(case, got.server_ms), (k + case, got.client_ms)])
        },
    )
    .await?;
    drop(s);
    let mut spreads = spreads.into_iter();
    let server: Vec<_> = spreads.by_ref().take(k).collect();
    let client: Vec<_> = spreads.collect();
    Ok(CASES
        .iter()
        .zip(server)
        .zip(client)
        .zip(external)
        .map(
            |(((name, server_ms), client_ms), external_tokens)| TtftCase {
                name: name.to_string(),
                server_ms,
                client_ms,
                external_tokens,
            },
        )
        .collect())
}
