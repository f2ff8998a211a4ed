//! Part 2: where a load's time goes, in-process — the server's engine core, executor and tier
//! client without HTTP, each engine step timed — beside the pieces measured alone: the copy of
//! 124 blocks out of the arena (into fresh and into warm buffers), and their write back in.

use std::time::{Duration, Instant};

use cachet_core::exec::{BlockLoad, ExecBatch};
use cachet_core::{Executor, RequestDraft, SamplingParams, SchedulerConfig};
use cachet_engine::step::{CoreOptions, EngineCore};
use cachet_engine::tier::KvTier;
use cachet_model::executor::{ExecutorConfig, KvDtype, LlamaExecutor};
use cachet_model::LoadedModel;
use cachet_tiers::{
    EngineTier, HostConfig, HostSave, RedisConfig, RedisTarget, TierClient, TierConfig,
    TierNamespace, DEFAULT_SPARE_BYTES,
};

use super::rounds::interleaved;
use super::servers::RedisProc;
use super::{err, filler_tokens, host_pool_blocks, prompt_ids, Phase, TiersArgs, BLOCK};
use crate::error::BenchError;

/// Which tiers a [`Core`] has.
struct TierSetup {
    host: bool,
    redis: Option<String>,
    spare_bytes: u64,
}

struct Core {
    core: EngineCore<LlamaExecutor>,
    tier: Option<TierClient>,
    wake: std::sync::mpsc::Receiver<()>,
    next_handle: u64,
    cfg: SchedulerConfig,
}

/// The steps of one request up to its first token.
struct Steps {
    /// Every step, in order: its milliseconds.
    steps: Vec<f64>,
    /// Time spent waiting for the tier between steps.
    waited_ms: f64,
    report: Option<Box<cachet_core::Report>>,
}

impl Steps {
    fn first(&self) -> f64 {
        self.steps.first().copied().unwrap_or(f64::NAN)
    }

    fn last(&self) -> f64 {
        self.steps.last().copied().unwrap_or(f64::NAN)
    }

    /// The steps' own time (without waits between them).
    fn total(&self) -> f64 {
        self.steps.iter().sum()
    }
}

fn tier_config(exec: &LlamaExecutor, t: TierSetup) -> TierConfig {
    TierConfig {
        disk: None,
        namespace: TierNamespace {
            model_fingerprint: exec.model_fingerprint(),
            kv_layout: exec.kv_layout(),
            block_size: BLOCK as u32,
        },
        host: t.host.then_some(HostConfig {
            capacity_bytes: 4 << 30,
            save: HostSave::Evicted,
        }),
        redis: t.redis.map(|url| RedisConfig {
            target: RedisTarget::Single(url),
            secret: None,
            ttl: Some(Duration::from_secs(3600)),
            budget_bytes: None,
            timeout: Duration::from_secs(2),
            save_queue: 1024,
            probe_interval: Duration::from_secs(1),
            key_prefix: "cachet-bench".into(),
            ca_cert_pem: None,
        }),
        spare_bytes: t.spare_bytes,
    }
}

impl Core {
    fn new(
        loaded: &LoadedModel,
        num_blocks: usize,
        tiers: Option<TierSetup>,
    ) -> Result<Core, BenchError> {
        let exec = loaded.executor(ExecutorConfig {
            block_size: BLOCK,
            num_blocks,
            kv_dtype: KvDtype::F16,
        })?;
        let (tx, wake) = std::sync::mpsc::channel();
        let tier = match tiers {
            None => None,
            Some(t) => {
                let c = TierClient::open(tier_config(&exec, t)).map_err(|e| err(e.to_string()))?;
                let tx = std::sync::Mutex::new(tx);
                c.set_load_notify(move || {
                    if let Ok(tx) = tx.lock() {
                        let _ = tx.send(());
                    }
                });
                Some(c)
            }
        };
        let cfg = SchedulerConfig {
            block_size: BLOCK,
            num_blocks,
            max_num_batched_tokens: 2048,
            max_model_len: num_blocks * BLOCK,
            eos_token_ids: Vec::new(),
            ..SchedulerConfig::default()
        };
        let core = EngineCore::new(
            cfg.clone(),
            exec,
            CoreOptions {
                tier: tier
                    .clone()
                    .map(|c| Box::new(EngineTier::new(c)) as Box<dyn KvTier>),
                ..Default::default()
            },
        );
        Ok(Core {
            core,
            tier,
            wake,
            next_handle: 1,
            cfg,
        })
    }

    /// Runs `prompt` to its first token (max_tokens 1), as the core thread does.
    fn first_token(&mut self, prompt: &[u32], t0: Instant) -> Result<Steps, BenchError> {
        let h = self.next_handle;
        self.next_handle += 1;
        let d = RequestDraft::new(format!("b{h}"), prompt.to_vec(), SamplingParams::greedy(1));
        let v = self
            .cfg
            .limits()
            .validate(d)
            .map_err(|e| err(format!("{e:?}")))?;
        let now = move || t0.elapsed().as_secs_f64();
        self.core
            .add_request(h, now(), v)
            .map_err(|e| err(format!("{e:?}")))?;
        let mut out = Steps {
            steps: Vec::new(),
            waited_ms: 0.0,
            report: None,
        };
        while self.wake.try_recv().is_ok() {}
        for _ in 0..10_000 {
            let s0 = Instant::now();
            let ups = self.core.step(now).map_err(|e| err(format!("step: {e}")))?;
            out.steps.push(ms_since(s0));
            for u in ups {
                if u.finish.is_some() {
                    out.report = u.report;
                    return Ok(out);
                }
            }
            if self.core.last_step_idle() {
                // As the core thread does: sleep until a load finishes (2 ms at most).
                let w0 = Instant::now();
                let _ = self.wake.recv_timeout(Duration::from_millis(2));
                out.waited_ms += ms_since(w0);
            }
        }
        Err(err("the request did not finish"))
    }

    fn tier_stats(&self) -> cachet_tiers::TierStats {
        self.tier.as_ref().map(|t| t.stats()).unwrap_or_default()
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Checks an in-process load brought exactly `want` external tokens, all from `tier`.
fn check_report(s: &Steps, tier: &str, want: usize) -> Result<(), BenchError> {
    let Some(rep) = &s.report else {
        return Err(err("no report"));
    };
    let ext = rep
        .prefill_stats
        .as_ref()
        .map_or(0, |p| p.external_cached_tokens);
    let by_tier = match tier {
        "host" => rep.external.host,
        _ => rep.external.redis,
    };
    if ext as usize != want || by_tier != ext {
        return Err(err(format!(
            "in-process {tier} load: {ext} external tokens ({by_tier} from {tier}), expected {want}"
        )));
    }
    Ok(())
}

/// The series of the breakdown, in table order (milliseconds unless the name says otherwise).
const SERIES: [&str; 18] = [
    "compute: the whole prompt (one step)",
    "compute: the last 16 tokens, 1984 cached locally (one step)",
    "copy 124 blocks out of the arena into fresh buffers (the offload before warm buffers)",
    "copy 124 blocks out of the arena into warm buffers",
    "write 124 blocks into the arena (a batch of loads alone)",
    "host: step 1 (lookup, allocate, offload the evicted filler, start the load)",
    "host: tier load (the client's own time)",
    "host: engine waiting between step 1 and step 2",
    "host: step 2 (write 124 blocks into the arena, compute 16 tokens)",
    "host: first token, in-process total",
    "host: step 1's saves into warm buffers (count, of 124)",
    "host, no spare buffers: step 1 (offload into fresh buffers)",
    "host, no spare buffers: first token, in-process total",
    "Redis: step 1 (lookup: one EXISTS pipeline; allocate; start the load)",
    "Redis: tier load (MGET + verify, the client's own time)",
    "Redis: engine waiting for the load",
    "Redis: step 2 (write 124 blocks into the arena, compute 16 tokens)",
    "Redis: first token, in-process total",
];

/// One host load as the TTFT part does it: `p` computed, evicted by a filler, loaded back.
struct HostLoad {
    steps: Steps,
    /// The load's wall time, from adding the request to its first token.
    total_ms: f64,
    /// The tier client's own time.
    tier_ms: f64,
    /// Saves of the load's steps that got a warm buffer.
    warm_saves: f64,
}

fn host_load(h: &mut Core, p: &[u32], filler: &[u32], t0: Instant) -> Result<HostLoad, BenchError> {
    h.first_token(p, t0)?;
    h.first_token(filler, t0)?;
    let before = h.tier_stats();
    let l0 = Instant::now();
    let steps = h.first_token(p, t0)?;
    let total_ms = ms_since(l0);
    let after = h.tier_stats();
    check_report(&steps, "host", (p.len() - 1) / BLOCK * BLOCK)?;
    Ok(HostLoad {
        steps,
        total_ms,
        tier_ms: (after.host.load_seconds - before.host.load_seconds) * 1e3,
        warm_saves: (after.buffers.warm - before.buffers.warm) as f64,
    })
}

pub(super) fn breakdown_part(
    a: &TiersArgs,
    loaded: &LoadedModel,
    redis: &RedisProc,
) -> Result<Vec<Phase>, BenchError> {
    let n = a.prompt_tokens;
    let nb = (n - 1) / BLOCK;
    let blocks = n.div_ceil(BLOCK) + 2;
    let t0 = Instant::now();
    let spare = |spare_bytes| TierSetup {
        host: true,
        redis: None,
        spare_bytes,
    };
    let redis_only = || TierSetup {
        host: false,
        redis: Some(redis.url()),
        spare_bytes: DEFAULT_SPARE_BYTES,
    };
    let mut c = Core::new(loaded, 2 * blocks + 8, None)?;
    let mut hw = Core::new(
        loaded,
        host_pool_blocks(n),
        Some(spare(DEFAULT_SPARE_BYTES)),
    )?;
    let mut hc = Core::new(loaded, host_pool_blocks(n), Some(spare(0)))?;
    let mut w = Core::new(loaded, 2 * blocks + 8, Some(redis_only()))?;
    let mut r = Core::new(loaded, 2 * blocks + 8, Some(redis_only()))?;
    // The arena the loads-alone case writes into, and 124 warm buffers for the copy case.
    let mut arena = loaded.executor(ExecutorConfig {
        block_size: BLOCK,
        num_blocks: blocks,
        kv_dtype: KvDtype::F16,
    })?;
    let bytes = c.core.executor().block_bytes();
    let mut warm: Vec<Vec<u8>> = (0..nb).map(|_| vec![0x5a; bytes]).collect();
    let rt = tokio::runtime::Handle::current();
    let spreads = rt.block_on(interleaved(
        "breakdown",
        a.rounds,
        6,
        &SERIES,
        &[0, 9, 12, 17],
        async |round, case| {
            let p = prompt_ids(5000 + round as u64 * 7 + case as u64, n);
            let filler = prompt_ids(6000 + round as u64 * 7 + case as u64, filler_tokens(n));
            Ok(match case {
                0 => {
                    // Computing, then the same prompt again (a local hit: the last 16 tokens).
                    let full = c.first_token(&p, t0)?.total();
                    let hit = c.first_token(&p, t0)?.total();
                    vec![(0, full), (1, hit)]
                }
                1 => {
                    // The copy of 124 blocks as the offload did it, then into warm buffers.
                    let x = c.core.executor();
                    let k0 = Instant::now();
                    let mut kept = Vec::with_capacity(nb);
                    for b in 0..nb {
                        let mut buf = Vec::with_capacity(bytes);
                        x.save_block(b as u32, &mut buf)
                            .map_err(|e| err(e.to_string()))?;
                        kept.push(buf);
                    }
                    let fresh = ms_since(k0);
                    drop(kept);
                    let k0 = Instant::now();
                    for (b, buf) in warm.iter_mut().enumerate() {
                        buf.clear();
                        x.save_block(b as u32, buf)
                            .map_err(|e| err(e.to_string()))?;
                    }
                    vec![(2, fresh), (3, ms_since(k0))]
                }
                2 => {
                    let batch = ExecBatch {
                        loads: warm
                            .iter()
                            .enumerate()
                            .map(|(b, data)| BlockLoad {
                                block: b as u32,
                                data,
                            })
                            .collect(),
                        ..ExecBatch::default()
                    };
                    let k0 = Instant::now();
                    arena.execute(&batch).map_err(|e| err(e.to_string()))?;
                    vec![(4, ms_since(k0))]
                }
                3 => {
                    let l = host_load(&mut hw, &p, &filler, t0)?;
                    vec![
                        (5, l.steps.first()),
                        (6, l.tier_ms),
                        (7, l.steps.waited_ms),
                        (8, l.steps.last()),
                        (9, l.total_ms),
                        (10, l.warm_saves),
                    ]
                }
                4 => {
                    let l = host_load(&mut hc, &p, &filler, t0)?;
                    vec![(11, l.steps.first()), (12, l.total_ms)]
                }
                _ => {
                    // Redis: w computes p and writes it; r loads it.
                    w.first_token(&p, t0)?;
                    if let Some(t) = &w.tier {
                        t.flush(Duration::from_secs(30));
                    }
                    let before = r.tier_stats();
                    let l0 = Instant::now();
                    let s = r.first_token(&p, t0)?;
                    let total = ms_since(l0);
                    let after = r.tier_stats();
                    check_report(&s, "redis", nb * BLOCK)?;
                    vec![
                        (13, s.first()),
                        (
                            14,
                            (after.redis.load_seconds - before.redis.load_seconds) * 1e3,
                        ),
                        (15, s.waited_ms),
                        (16, s.last()),
                        (17, total),
                    ]
                }
            })
        },
    ))?;
    Ok(SERIES
        .iter()
        .zip(spreads)
        .map(|(n, ms)| Phase {
            name: n.to_string(),
            ms,
        })
        .collect())
}
