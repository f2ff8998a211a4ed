//! The Redis tier against a real `redis-server` on a free loopback port.

mod common;

use std::time::{Duration, Instant};

use cachet_tiers::format::encode_value;
use cachet_tiers::{
    CorruptKind, HostConfig, HostSave, LoadError, RedisTarget, SaveTarget, TierClient, TierConfig,
    TierKind, TierNamespace,
};
use common::*;

const BLOCK: usize = 4096;

fn save_all(c: &TierClient, range: std::ops::Range<u32>) {
    for i in range {
        assert!(c.save(hash(i), payload(i, BLOCK), SaveTarget::Redis));
    }
    assert!(c.flush(Duration::from_secs(10)), "saves did not drain");
}

#[test]
fn round_trip_ttl_and_one_round_trip_per_lookup_and_load() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut admin = server.conn();
    let c = redis_client(&server.url(), |_| {});
    assert!(c.redis_up());

    reset_stats(&mut admin);
    save_all(&c, 0..100);
    let s = c.stats();
    assert_eq!(s.redis.blocks_saved, 100);
    assert_eq!(s.redis.bytes_saved, 100 * BLOCK as u64);
    assert_eq!(s.save_failures, 0);
    assert_eq!(command_calls(&mut admin, "set"), 100);
    let dbsize: u64 = redis::cmd("DBSIZE").query(&mut admin).unwrap();
    assert_eq!(dbsize, 100);

    // Keys are namespaced and carry the TTL.
    let key = ns().redis_key("cachet", &hash(7));
    let pttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut admin).unwrap();
    assert!((55_000..=60_000).contains(&pttl), "PTTL {pttl}");

    // Lookup: 100 present then one absent then one present: the leading run is 100.
    let mut hashes: Vec<_> = (0..100).map(hash).collect();
    hashes.push(hash(1000));
    hashes.push(hash(5));
    reset_stats(&mut admin);
    let reads0 = info_u64(&mut admin, "stats", "total_reads_processed");
    let run = c.lookup(&hashes);
    let reads1 = info_u64(&mut admin, "stats", "total_reads_processed");
    assert_eq!(run, vec![TierKind::Redis; 100]);
    assert_eq!(command_calls(&mut admin, "exists"), 102);
    // One pipelined round trip: the server saw a handful of socket reads (the pipeline, maybe
    // split by the 16 KB read buffer, plus our INFO), not one per key.
    assert!(
        reads1 - reads0 <= 4,
        "{} reads for one lookup",
        reads1 - reads0
    );

    // Load: one MGET for all 100 blocks.
    reset_stats(&mut admin);
    let reads0 = info_u64(&mut admin, "stats", "total_reads_processed");
    c.start_load(1, (0..100).map(hash).collect());
    let done = wait_load(&c, 1, Duration::from_secs(5));
    let reads1 = info_u64(&mut admin, "stats", "total_reads_processed");
    assert_eq!(command_calls(&mut admin, "mget"), 1);
    assert_eq!(command_calls(&mut admin, "get"), 0);
    assert!(
        reads1 - reads0 <= 4,
        "{} reads for one load",
        reads1 - reads0
    );
    assert_eq!(done.results.len(), 100);
    for (i, r) in done.results.iter().enumerate() {
        let (p, k) = r.as_ref().unwrap();
        assert_eq!(*k, TierKind::Redis);
        assert_eq!(p, &payload(i as u32, BLOCK), "block {i}");
    }
    let s = c.stats();
    assert_eq!(s.redis.blocks_loaded, 100);
    assert_eq!(s.redis.bytes_loaded, 100 * BLOCK as u64);
    assert_eq!(s.redis.lookups, 1);
    assert_eq!(s.redis.lookup_blocks, 100);
    assert_eq!(s.redis.load_latency.count, 1);
    assert_eq!(s.load_failures.total(), 0);

    // A block that is not there is Missing, the others still load.
    c.start_load(2, vec![hash(3), hash(4242)]);
    let done = wait_load(&c, 2, Duration::from_secs(5));
    assert!(done.results[0].is_ok());
    assert_eq!(done.results[1].as_ref().unwrap_err(), &LoadError::Missing);
    assert_eq!(c.stats().load_failures.missing, 1);
}

#[test]
fn another_instance_of_the_same_model_loads_what_one_saved() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let a = redis_client(&server.url(), |_| {});
    let b = redis_client(&server.url(), |_| {});
    save_all(&a, 0..10);
    assert_eq!(b.lookup(&(0..10).map(hash).collect::<Vec<_>>()).len(), 10);
    b.start_load(9, (0..10).map(hash).collect());
    let done = wait_load(&b, 9, Duration::from_secs(5));
    assert!(done.results.iter().all(|r| r.is_ok()));

    // Another model (or layout) sees nothing of it: its keys differ.
    let mut other = ns();
    other.kv_layout = "q8_0:L30:H3:D64".into();
    let mut rc = redis_cfg(RedisTarget::parse(&server.url(), false).unwrap());
    rc.timeout = Duration::from_millis(500);
    let o = TierClient::open(TierConfig {
        disk: None,
        namespace: other,
        spare_bytes: cachet_tiers::DEFAULT_SPARE_BYTES,
        host: None,
        redis: Some(rc),
    })
    .unwrap();
    assert!(o.lookup(&[hash(0)]).is_empty());
}

#[test]
fn payloads_held_from_one_load_survive_the_next_loads() {
    // A plain redis:// load reads its reply into a buffer it reuses once the previous load's
    // payloads are dropped: payloads still held must keep their bytes while later loads run,
    // and once dropped the next loads still return the right bytes.
    let Some(server) = RedisServer::start() else {
        return;
    };
    let c = redis_client(&server.url(), |_| {});
    save_all(&c, 0..40);
    let load = |ticket: u64, range: std::ops::Range<u32>| {
        c.start_load(ticket, range.clone().map(hash).collect());
        let done = wait_load(&c, ticket, Duration::from_secs(5));
        range
            .zip(done.results)
            .map(|(i, r)| (i, r.unwrap().0))
            .collect::<Vec<_>>()
    };
    let held = load(1, 0..20);
    for (t, range) in [(2, 20..40), (3, 0..40), (4, 10..30)] {
        for (i, p) in load(t, range) {
            assert_eq!(p, payload(i, BLOCK), "load {t}, block {i}");
        }
    }
    for (i, p) in &held {
        assert_eq!(p, &payload(*i, BLOCK), "held block {i}");
    }
    drop(held);
    for (i, p) in load(5, 5..25) {
        assert_eq!(p, payload(i, BLOCK), "after the drop, block {i}");
    }
    assert_eq!(c.stats().redis.blocks_loaded, 20 + 20 + 40 + 20 + 20);
}

#[test]
fn a_block_just_loaded_or_stored_is_not_sent_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut admin = server.conn();
    let a = redis_client(&server.url(), |_| {});
    let b = redis_client(&server.url(), |_| {});
    save_all(&a, 0..10);
    b.start_load(1, (0..10).map(hash).collect());
    assert!(wait_load(&b, 1, Duration::from_secs(5))
        .results
        .iter()
        .all(|r| r.is_ok()));

    reset_stats(&mut admin);
    // b saves the blocks it loaded (they became its cache entries), a saves its own again:
    // nothing is sent; a new block is.
    save_all(&b, 0..10);
    save_all(&a, 0..10);
    save_all(&b, 10..11);
    assert_eq!(command_calls(&mut admin, "set"), 1);
    assert_eq!(b.stats().save_dedup_skips, 10);
    assert_eq!(a.stats().save_dedup_skips, 10);
    assert_eq!(b.stats().redis.blocks_saved, 1);

    // A block found missing is forgotten and saved again.
    redis::cmd("DEL")
        .arg(ns().redis_key("cachet", &hash(3)))
        .query::<()>(&mut admin)
        .unwrap();
    b.start_load(2, vec![hash(3)]);
    assert_eq!(
        wait_load(&b, 2, Duration::from_secs(5)).results[0]
            .as_ref()
            .unwrap_err(),
        &LoadError::Missing
    );
    save_all(&b, 3..4);
    assert_eq!(command_calls(&mut admin, "set"), 2);
}

#[test]
fn a_value_signed_with_another_secret_or_unsigned_is_refused() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let alpha = redis_client(&server.url(), |r| r.secret = secret("alpha"));
    let beta = redis_client(&server.url(), |r| r.secret = secret("beta"));
    let open = redis_client(&server.url(), |_| {});
    save_all(&alpha, 0..2);
    save_all(&open, 2..3);

    // The lookup only sees keys; the load checks values.
    assert_eq!(beta.lookup(&[hash(0), hash(1), hash(2)]).len(), 3);
    beta.start_load(1, vec![hash(0), hash(1), hash(2)]);
    let done = wait_load(&beta, 1, Duration::from_secs(5));
    for r in &done.results {
        assert_eq!(r.as_ref().unwrap_err(), &LoadError::BadSignature);
    }
    let s = beta.stats();
    assert_eq!(s.load_failures.bad_signature, 3);
    assert_eq!(s.redis.blocks_loaded, 0);

    // The right secret accepts its own values and refuses the unsigned one.
    alpha.start_load(2, vec![hash(0), hash(1), hash(2)]);
    let done = wait_load(&alpha, 2, Duration::from_secs(5));
    assert_eq!(done.results[0].as_ref().unwrap().0, payload(0, BLOCK));
    assert_eq!(done.results[1].as_ref().unwrap().0, payload(1, BLOCK));
    assert_eq!(
        done.results[2].as_ref().unwrap_err(),
        &LoadError::BadSignature
    );
}

#[test]
fn truncated_foreign_and_alien_values_are_refused() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut admin = server.conn();
    let c = redis_client(&server.url(), |_| {});
    let key = |i| ns().redis_key("cachet", &hash(i));
    let full = encode_value(&ns(), &hash(1), &payload(1, BLOCK), None);
    let truncated = &full[..full.len() - 100];
    let foreign_ns = TierNamespace {
        kv_layout: "f32:L30:H3:D64".into(),
        ..ns()
    };
    let foreign = encode_value(&foreign_ns, &hash(2), &payload(2, BLOCK), None);
    let other_block = encode_value(&ns(), &hash(99), &payload(99, BLOCK), None);
    let good = encode_value(&ns(), &hash(5), &payload(5, BLOCK), None);
    let set = |k: Vec<u8>, v: &[u8], admin: &mut redis::Connection| {
        redis::cmd("SET").arg(k).arg(v).query::<()>(admin).unwrap();
    };
    set(key(1), truncated, &mut admin);
    set(key(2), &foreign, &mut admin);
    set(key(3), b"not a cachet value", &mut admin);
    set(key(4), &other_block, &mut admin);
    set(key(5), &good, &mut admin);
    // A value of another Redis type under our key.
    redis::cmd("RPUSH")
        .arg(key(6))
        .arg("x")
        .query::<()>(&mut admin)
        .unwrap();

    c.start_load(1, (1..=6).map(hash).collect());
    let done = wait_load(&c, 1, Duration::from_secs(5));
    let errs: Vec<_> = done
        .results
        .iter()
        .map(|r| r.as_ref().err().copied())
        .collect();
    assert_eq!(
        errs,
        vec![
            Some(LoadError::Corrupt(CorruptKind::Truncated)),
            Some(LoadError::ForeignLayout),
            Some(LoadError::Corrupt(CorruptKind::BadMagic)),
            Some(LoadError::Corrupt(CorruptKind::WrongBlock)),
            None,
            Some(LoadError::Missing),
        ]
    );
    assert_eq!(done.results[4].as_ref().unwrap().0, payload(5, BLOCK));
    let f = c.stats().load_failures;
    assert_eq!((f.corrupt, f.foreign_layout, f.missing), (3, 1, 1));
    assert_eq!(f.total(), 5);
}

#[test]
fn redis_down_at_start_then_up() {
    let port = free_port();
    let Some(mut server) = RedisServer::not_started(port) else {
        return;
    };
    let t0 = Instant::now();
    let c = redis_client(&format!("redis://127.0.0.1:{port}"), |_| {});
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "open waited too long"
    );
    assert!(!c.redis_up());

    // Down: lookups answer 0 at once, loads fail fast, saves are accepted and fail.
    let t = Instant::now();
    assert!(c.lookup(&[hash(1)]).is_empty());
    // Far below the 1 s timeout: no call was made.
    assert!(t.elapsed() < Duration::from_millis(200));
    c.start_load(1, vec![hash(1)]);
    let done = wait_load(&c, 1, Duration::from_millis(100));
    assert_eq!(
        done.results[0].as_ref().unwrap_err(),
        &LoadError::Unavailable
    );
    assert!(c.save(hash(1), payload(1, BLOCK), SaveTarget::Redis));
    assert!(c.flush(Duration::from_secs(2)));
    let s = c.stats();
    assert_eq!(s.lookup_skips, 1);
    assert_eq!(s.lookup_failures, 0);
    assert_eq!(s.save_failures, 1);
    assert_eq!(s.load_failures.unavailable, 1);
    assert_eq!(s.redis_outages, 0, "never up, so never went down");

    server.restart();
    wait_until("the tier to connect", Duration::from_secs(5), || {
        c.redis_up()
    });
    save_all(&c, 1..3);
    assert_eq!(c.lookup(&[hash(1), hash(2)]).len(), 2);
}

#[test]
fn killed_mid_run_then_restarted_reconnects() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let c = redis_client(&server.url(), |_| {});
    save_all(&c, 0..4);
    assert_eq!(c.lookup(&[hash(0)]).len(), 1);
    // A load before the outage leaves an idle load connection behind; after the restart it is
    // dead, and must not be reused (it would fail the next load and count a second outage).
    c.start_load(0, vec![hash(0)]);
    let done = wait_load(&c, 0, Duration::from_secs(5));
    assert!(done.results.iter().all(|r| r.is_ok()));

    server.kill();
    // The first call finds the connection gone: counted, tier down (one state change).
    assert!(c.lookup(&[hash(0)]).is_empty());
    let s = c.stats();
    assert_eq!(s.lookup_failures, 1);
    assert_eq!(s.redis_outages, 1);
    assert!(!s.redis_up);
    // Later calls skip Redis without waiting; no new state change.
    for _ in 0..5 {
        assert!(c.lookup(&[hash(0)]).is_empty());
    }
    c.start_load(1, vec![hash(0), hash(1)]);
    let done = wait_load(&c, 1, Duration::from_millis(200));
    assert!(done
        .results
        .iter()
        .all(|r| r.as_ref().unwrap_err() == &LoadError::Unavailable));
    let s = c.stats();
    assert_eq!(s.lookup_skips, 5);
    assert_eq!(s.redis_outages, 1);

    server.restart();
    wait_until("the tier to reconnect", Duration::from_secs(5), || {
        c.redis_up()
    });
    // The restarted server is empty (no persistence); the tier works again.
    assert!(c.lookup(&[hash(0)]).is_empty());
    save_all(&c, 0..2);
    c.start_load(2, vec![hash(0), hash(1)]);
    let done = wait_load(&c, 2, Duration::from_secs(5));
    assert!(done.results.iter().all(|r| r.is_ok()));
    assert_eq!(c.stats().redis_outages, 1);
}

#[test]
fn a_slow_redis_times_out_and_recovers() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let c = redis_client(&server.url(), |r| r.timeout = Duration::from_millis(150));
    save_all(&c, 0..2);

    let sleeper = {
        let mut admin = server.conn();
        std::thread::spawn(move || {
            redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("0.8")
                .query::<()>(&mut admin)
                .unwrap();
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    assert!(c.lookup(&[hash(0)]).is_empty());
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(140) && took < Duration::from_millis(400),
        "lookup took {took:?}"
    );
    let s = c.stats();
    assert_eq!(
        (s.lookup_timeouts, s.lookup_failures, s.redis_outages),
        (1, 1, 1)
    );
    sleeper.join().unwrap();

    wait_until("the tier to come back", Duration::from_secs(5), || {
        c.redis_up()
    });
    assert_eq!(c.lookup(&[hash(0), hash(1)]).len(), 2);

    // A load that runs into a slow Redis times out per block.
    let sleeper = {
        let mut admin = server.conn();
        std::thread::spawn(move || {
            redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("0.5")
                .query::<()>(&mut admin)
                .unwrap();
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    c.start_load(7, vec![hash(0), hash(1)]);
    let done = wait_load(&c, 7, Duration::from_secs(2));
    assert!(done
        .results
        .iter()
        .all(|r| r.as_ref().unwrap_err() == &LoadError::Timeout));
    let s = c.stats();
    assert_eq!(s.load_failures.timeout, 2);
    assert_eq!(s.redis_outages, 2);
    sleeper.join().unwrap();
}

#[test]
fn a_full_save_queue_drops_and_counts_without_blocking() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let c = redis_client(&server.url(), |r| {
        r.save_queue = 4;
        r.timeout = Duration::from_secs(5);
    });
    // Stall the writer: Redis sleeps, the writer's first batch waits on it.
    let sleeper = {
        let mut admin = server.conn();
        std::thread::spawn(move || {
            redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("1.0")
                .query::<()>(&mut admin)
                .unwrap();
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(c.save(hash(0), payload(0, BLOCK), SaveTarget::Redis));
    wait_until(
        "the writer to take the first save",
        Duration::from_secs(2),
        || c.stats().save_queue_len == 0,
    );
    assert_eq!(c.stats().saves_pending, 1, "the first save is in flight");

    let t = Instant::now();
    let accepted: Vec<bool> = (1..=10)
        .map(|i| c.save(hash(i), payload(i, BLOCK), SaveTarget::Redis))
        .collect();
    let took = t.elapsed();
    // Far below the 1 s the writer is stuck for: nothing waited on it.
    assert!(
        took < Duration::from_millis(250),
        "saving blocked for {took:?}"
    );
    assert_eq!(accepted, [[true; 4].as_slice(), &[false; 6]].concat());
    let s = c.stats();
    assert_eq!(s.save_queue_drops, 6);
    assert_eq!(s.save_queue_len, 4);
    assert_eq!(s.saves_pending, 5);

    sleeper.join().unwrap();
    assert!(c.flush(Duration::from_secs(5)));
    let s = c.stats();
    assert_eq!(s.redis.blocks_saved, 5);
    assert_eq!(s.save_queue_drops, 6);
    assert_eq!(c.lookup(&(0..=4).map(hash).collect::<Vec<_>>()).len(), 5);
    assert!(c.lookup(&[hash(5)]).is_empty());
}

#[test]
fn the_byte_budget_skips_saves_beyond_it() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let overhead = cachet_tiers::format::value_overhead(&ns(), false) as u64;
    // Room for exactly three values.
    let c = redis_client(&server.url(), |r| {
        r.budget_bytes = Some(3 * (BLOCK as u64 + overhead) + 10)
    });
    save_all(&c, 0..5);
    let s = c.stats();
    assert_eq!(s.redis.blocks_saved, 3);
    assert_eq!(s.save_budget_drops, 2);
    assert_eq!(c.lookup(&(0..5).map(hash).collect::<Vec<_>>()).len(), 3);
}

#[test]
fn stacked_host_in_front_of_redis() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut admin = server.conn();
    let c = TierClient::open(TierConfig {
        disk: None,
        namespace: ns(),
        spare_bytes: cachet_tiers::DEFAULT_SPARE_BYTES,
        host: Some(HostConfig {
            capacity_bytes: 10 * BLOCK as u64,
            save: HostSave::Evicted,
        }),
        redis: Some(redis_cfg(RedisTarget::parse(&server.url(), false).unwrap())),
    })
    .unwrap();
    save_all(&c, 0..4);
    for i in 0..2 {
        assert!(c.save(hash(i), payload(i, BLOCK), SaveTarget::Host));
    }
    let hs: Vec<_> = (0..4).map(hash).collect();

    reset_stats(&mut admin);
    use TierKind::{Host, Redis};
    assert_eq!(c.lookup(&hs), vec![Host, Host, Redis, Redis]);
    // Redis was asked only about the blocks the host tier lacks.
    assert_eq!(command_calls(&mut admin, "exists"), 2);
    // Nothing to ask when the host tier has them all.
    assert_eq!(c.lookup(&hs[..2]), vec![Host, Host]);
    assert_eq!(command_calls(&mut admin, "exists"), 2);

    redis::cmd("DEL")
        .arg(ns().redis_key("cachet", &hash(3)))
        .query::<()>(&mut admin)
        .unwrap();
    assert_eq!(c.lookup(&hs), vec![Host, Host, Redis]);
    c.start_load(5, hs.clone());
    let done = wait_load(&c, 5, Duration::from_secs(5));
    let kinds: Vec<_> = done
        .results
        .iter()
        .map(|r| r.as_ref().map(|(_, k)| *k).map_err(|e| *e))
        .collect();
    assert_eq!(
        kinds,
        vec![Ok(Host), Ok(Host), Ok(Redis), Err(LoadError::Missing)]
    );
    assert_eq!(command_calls(&mut admin, "mget"), 1);
    for (i, r) in done.results.iter().take(3).enumerate() {
        assert_eq!(r.as_ref().unwrap().0, payload(i as u32, BLOCK));
    }
    let s = c.stats();
    assert_eq!((s.host.blocks_loaded, s.redis.blocks_loaded), (2, 1));
    assert_eq!(s.load_failures.missing, 1);

    // With Redis gone the host part still answers.
    drop(server);
    assert_eq!(c.lookup(&hs), vec![Host, Host]);
}

/// A CA and a server certificate for 127.0.0.1, made with the `openssl` CLI; `None` without it.
fn tls_material(dir: &std::path::Path) -> Option<()> {
    let run = |args: &[&str]| {
        std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").ok()?;
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let ok = run(&[
        &["req", "-x509"][..],
        &ec,
        &["-keyout", "ca.key", "-out", "ca.pem"],
        &["-days", "1", "-subj", "/CN=cachet test CA"],
    ]
    .concat())
        && run(&[
            &["req"][..],
            &ec,
            &["-keyout", "srv.key", "-out", "srv.csr"],
            &["-subj", "/CN=127.0.0.1"],
        ]
        .concat())
        && run(&[
            "x509",
            "-req",
            "-in",
            "srv.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "srv.pem",
            "-days",
            "1",
            "-extfile",
            "san.ext",
        ]);
    ok.then_some(())
}

#[test]
fn rediss_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    if tls_material(dir.path()).is_none() {
        eprintln!("SKIPPED: the openssl CLI is needed to make test certificates");
        return;
    }
    let tls_port = free_port();
    let p = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
    let Some(_server) = RedisServer::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &p("srv.pem"),
        "--tls-key-file",
        &p("srv.key"),
        "--tls-ca-cert-file",
        &p("ca.pem"),
        "--tls-auth-clients",
        "no",
    ]) else {
        return;
    };
    let url = format!("rediss://127.0.0.1:{tls_port}");
    let ca = std::fs::read(dir.path().join("ca.pem")).unwrap();
    let c = redis_client(&url, |r| r.ca_cert_pem = Some(ca));
    assert!(c.redis_up(), "TLS connection with the private CA");
    save_all(&c, 0..3);
    c.start_load(1, (0..3).map(hash).collect());
    let done = wait_load(&c, 1, Duration::from_secs(5));
    for (i, r) in done.results.iter().enumerate() {
        assert_eq!(r.as_ref().unwrap().0, payload(i as u32, BLOCK));
    }

    // Without the CA the server's certificate is not trusted: the tier stays down, nothing
    // breaks.
    let untrusting = redis_client(&url, |r| r.timeout = Duration::from_millis(300));
    assert!(!untrusting.redis_up());
    assert!(untrusting.lookup(&[hash(0)]).is_empty());
}
