//! The Redis tier against a real Redis Cluster (made with `redis-cli --cluster create`) on
//! loopback.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use cachet_tiers::{LoadError, SaveTarget, TierKind};
use common::*;

const BLOCK: usize = 2048;

#[test]
fn cluster_round_trip_spreads_keys_and_batches_per_slot() {
    let Some(cluster) = RedisCluster::start(3, 0) else {
        return;
    };
    let c = redis_client(&cluster.seeds(), |_| {});
    assert!(c.redis_up());
    let n = 60u32;
    for i in 0..n {
        assert!(c.save(hash(i), payload(i, BLOCK), SaveTarget::Redis));
    }
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(c.stats().redis.blocks_saved, n as u64);

    // Untagged keys spread over the masters.
    let sizes: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|s| redis::cmd("DBSIZE").query(&mut s.conn()).unwrap())
        .collect();
    assert_eq!(sizes.iter().sum::<u64>(), n as u64);
    assert!(sizes.iter().all(|s| *s > 0), "keys per master: {sizes:?}");

    for s in &cluster.nodes {
        reset_stats(&mut s.conn());
    }
    let hashes: Vec<_> = (0..n).map(hash).collect();
    assert_eq!(c.lookup(&hashes), vec![TierKind::Redis; n as usize]);
    c.start_load(1, hashes.clone());
    let done = wait_load(&c, 1, Duration::from_secs(5));
    for (i, r) in done.results.iter().enumerate() {
        assert_eq!(r.as_ref().unwrap().0, payload(i as u32, BLOCK), "block {i}");
    }

    // One MGET per slot (Redis refuses cross-slot MGETs), sent together per node; no GETs.
    let mut admin = cluster.nodes[0].conn();
    let slots: HashSet<u16> = hashes
        .iter()
        .map(|h| {
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(ns().redis_key("cachet", h))
                .query(&mut admin)
                .unwrap()
        })
        .collect();
    let calls = |cmd: &str| -> u64 {
        cluster
            .nodes
            .iter()
            .map(|s| command_calls(&mut s.conn(), cmd))
            .sum()
    };
    assert_eq!(calls("mget"), slots.len() as u64);
    assert_eq!(calls("get"), 0);
    assert_eq!(calls("exists"), n as u64);
}

#[test]
fn cluster_master_failover_keeps_the_client_working() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let Some(mut cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let c = redis_client(&cluster.seeds(), |r| r.timeout = Duration::from_millis(500));
    let n = 30u32;
    for i in 0..n {
        assert!(c.save(hash(i), payload(i, BLOCK), SaveTarget::Redis));
    }
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(c.stats().redis.blocks_saved, n as u64);

    // Wait until every replica holds its master's keys, then kill a master.
    let replicas = cluster.replicas();
    assert_eq!(replicas.len(), 3);
    wait_until("replication", Duration::from_secs(10), || {
        replicas.iter().all(|(r, mport)| {
            let m = cluster.nodes.iter().find(|s| s.port == *mport).unwrap();
            let a: u64 = redis::cmd("DBSIZE").query(&mut m.conn()).unwrap();
            let b: u64 = redis::cmd("DBSIZE")
                .query(&mut cluster.nodes[*r].conn())
                .unwrap();
            a == b
        })
    });
    let victim_port = replicas[0].1;
    let victim = cluster
        .nodes
        .iter()
        .position(|s| s.port == victim_port)
        .unwrap();
    cluster.nodes[victim].kill();

    // While the master is gone, calls fail within the bound; nothing hangs.
    let hashes: Vec<_> = (0..n).map(hash).collect();
    let t = Instant::now();
    c.start_load(1, hashes.clone());
    let done = wait_load(&c, 1, Duration::from_secs(3));
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "load took {:?}",
        t.elapsed()
    );
    assert!(
        done.results.iter().any(|r| matches!(
            r,
            Err(LoadError::Unavailable | LoadError::Timeout | LoadError::Failed)
        )),
        "some block lived on the dead master"
    );
    let t = Instant::now();
    let _ = c.lookup(&hashes);
    assert!(t.elapsed() < Duration::from_millis(700));
    assert!(c.stats().redis_outages >= 1);

    // The replica takes over (cluster-node-timeout 1 s); the client finds the new master.
    let mut ticket = 2;
    wait_until("every block to load again", Duration::from_secs(20), || {
        ticket += 1;
        if !c.redis_up() {
            return false;
        }
        c.start_load(ticket, hashes.clone());
        let done = wait_load(&c, ticket, Duration::from_secs(3));
        done.results.iter().all(|r| r.is_ok())
    });
    assert_eq!(c.lookup(&hashes).len(), n as usize);
    assert!(cluster.masters().len() == 3);
}
