//! What the cache inspector asks the core thread: a snapshot of the recorder's totals and
//! insight (for `GET /v1/cache/stats/stream`), the pool and its hottest prefixes (`GET
//! /v1/cache`), and a recent request's block lifecycle (`GET /v1/cache/requests/{id}`). Each is
//! read off the recorder and the pool between steps; nothing here feeds a decision.

use serde::{Deserialize, Serialize};

use cachet_core::recorder::{HotPrefix, RecentRequest, RequestLifecycle};
use cachet_core::stats::{CounterTotals, Gauges, TenantTotals};
use cachet_core::{BlockPool, Recorder};

/// The local pool's blocks by state, and the tokens its cache entries hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolTotals {
    pub num_blocks: u64,
    /// Held by live requests (and parked sessions).
    pub blocks_in_use: u64,
    /// Free, but still holding a cache entry (a lookup can find them).
    pub blocks_cached_idle: u64,
    /// Free and holding nothing.
    pub blocks_free: u64,
    /// Cache entries (in use or idle).
    pub cached_blocks: u64,
    /// Tokens whose KV the cache entries hold (`cached_blocks · B`).
    pub tokens_held: u64,
    pub block_size: u64,
}

impl PoolTotals {
    pub fn of(pool: &BlockPool, block_size: usize) -> Self {
        let cached_idle = pool.num_cached_free() as u64;
        PoolTotals {
            num_blocks: pool.num_blocks() as u64,
            blocks_in_use: pool.num_used() as u64,
            blocks_cached_idle: cached_idle,
            blocks_free: pool.num_free() as u64 - cached_idle,
            cached_blocks: pool.num_cached() as u64,
            tokens_held: (pool.num_cached() * block_size) as u64,
            block_size: block_size as u64,
        }
    }
}

/// Everything the dashboard's stream shows, at one instant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheSnapshot {
    /// Monotonic totals since the engine started.
    pub totals: CounterTotals,
    pub gauges: Gauges,
    pub pool: PoolTotals,
    pub tenants: Vec<TenantTotals>,
    /// The last finished requests, newest first.
    pub recent: Vec<RecentRequest>,
}

/// `GET /v1/cache`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheOverview {
    pub pool: PoolTotals,
    pub hottest: Vec<HotPrefix>,
}

/// A question for the core thread.
#[derive(Clone, Debug)]
pub enum InspectQuery {
    Snapshot,
    Overview { hottest: usize },
    Request(String),
}

/// Its answer (`None` fields: reporting is off).
#[derive(Clone, Debug)]
pub enum InspectReply {
    Snapshot(Option<Box<CacheSnapshot>>),
    Overview(CacheOverview),
    Request(Option<Box<RequestLifecycle>>),
}

/// Answer `q` from the recorder (`None` with reporting off) and the pool at time `now`.
pub(crate) fn answer(
    q: InspectQuery,
    rec: Option<&mut Recorder>,
    pool: &BlockPool,
    block_size: usize,
    gauges: Gauges,
    now: f64,
) -> InspectReply {
    let pool_totals = PoolTotals::of(pool, block_size);
    match q {
        InspectQuery::Snapshot => InspectReply::Snapshot(rec.map(|r| {
            Box::new(CacheSnapshot {
                totals: r.totals(),
                gauges,
                pool: pool_totals,
                tenants: r.tenant_totals().to_vec(),
                recent: r.recent(),
            })
        })),
        InspectQuery::Overview { hottest } => InspectReply::Overview(CacheOverview {
            pool: pool_totals,
            hottest: rec.map_or_else(Vec::new, |r| r.hottest(now, hottest)),
        }),
        InspectQuery::Request(id) => {
            InspectReply::Request(rec.and_then(|r| r.lifecycle(&id)).map(Box::new))
        }
    }
}
