//! Load time of one 2,000-token prompt's KV from each tier: 125 blocks of 368,640 bytes (the
//! default model's f16 KV: 30 layers × 3 KV heads × 64 dims × K and V × 2 bytes × 16 tokens),
//! about 46 MB. Host, Redis (unsigned) and Redis (signed) are measured interleaved, round
//! after round, against a `redis-server` this example starts on a free loopback port.
//!
//! `cargo run --release -p cachet-tiers --example tier_load -- [rounds]`

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cachet_tiers::{
    BlockHash, HostConfig, HostSave, Payload, RedisConfig, RedisTarget, SaveTarget, Secret,
    TierClient, TierConfig, TierNamespace,
};

const BLOCKS: u32 = 125;
const BLOCK_BYTES: usize = 30 * 3 * 64 * 2 * 2 * 16;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> (Server, u16) {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port");
    let dir = std::env::temp_dir();
    let server = Server(
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/test-deps-redis.sh installs it)"),
    );
    let url = format!("redis://127.0.0.1:{port}");
    for _ in 0..250 {
        let ok = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok();
        if ok {
            return (server, port);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("redis-server did not start");
}

fn ns() -> TierNamespace {
    TierNamespace {
        model_fingerprint: *blake3::hash(b"bench model").as_bytes(),
        kv_layout: "f16:L30:H3:D64".into(),
        block_size: 16,
    }
}

fn redis_cfg(port: u16, secret: Option<Secret>) -> RedisConfig {
    RedisConfig {
        target: RedisTarget::Single(format!("redis://127.0.0.1:{port}")),
        secret,
        ttl: Some(Duration::from_secs(600)),
        budget_bytes: None,
        timeout: Duration::from_secs(5),
        save_queue: 512,
        probe_interval: Duration::from_millis(200),
        key_prefix: "bench".into(),
        ca_cert_pem: None,
    }
}

/// A tier client whose finished loads wake the waiting thread (as the engine would be woken),
/// so the measurement does not spin on a core that Redis needs.
struct Waiting {
    c: TierClient,
    rx: std::sync::mpsc::Receiver<()>,
}

fn waiting(c: TierClient) -> Waiting {
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    c.set_load_notify(move || {
        if let Ok(tx) = tx.lock() {
            let _ = tx.send(());
        }
    });
    Waiting { c, rx }
}

fn load(w: &Waiting, ticket: u64, hashes: &[BlockHash]) -> Duration {
    let t = Instant::now();
    w.c.start_load(ticket, hashes.to_vec());
    loop {
        if let Some(d) = w.c.poll().into_iter().find(|d| d.ticket == ticket) {
            let took = t.elapsed();
            assert!(
                d.results.iter().all(|r| r.is_ok()),
                "a block failed to load"
            );
            return took;
        }
        let _ = w.rx.recv_timeout(Duration::from_millis(100));
    }
}

fn summary(name: &str, v: &mut [f64], rate: bool) {
    v.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    let mb = BLOCKS as f64 * BLOCK_BYTES as f64 / 1e6;
    let rate = if rate {
        format!("({:.2} GB/s at the median)", mb / pct(0.5)) // MB per ms = GB/s
    } else {
        String::new()
    };
    println!(
        "{name:<11} median {:>8.3} ms   p10 {:>8.3}   p90 {:>8.3}   min {:>8.3}   max {:>8.3}   {rate}",
        pct(0.5),
        pct(0.1),
        pct(0.9),
        v[0],
        v[v.len() - 1],
    );
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let (_server, port) = start_redis();
    let hashes: Vec<BlockHash> = (0..BLOCKS)
        .map(|i| BlockHash(*blake3::hash(&i.to_le_bytes()).as_bytes()))
        .collect();
    let payloads: Vec<Payload> = (0..BLOCKS)
        .map(|i| Payload::from(vec![i as u8; BLOCK_BYTES]))
        .collect();

    let host = TierClient::open(TierConfig {
        disk: None,
        namespace: ns(),
        spare_bytes: cachet_tiers::DEFAULT_SPARE_BYTES,
        host: Some(HostConfig {
            capacity_bytes: 64 << 20,
            save: HostSave::Evicted,
        }),
        redis: None,
    })
    .expect("host tier");
    let plain = TierClient::open(TierConfig {
        disk: None,
        namespace: ns(),
        spare_bytes: cachet_tiers::DEFAULT_SPARE_BYTES,
        host: None,
        redis: Some(redis_cfg(port, None)),
    })
    .expect("redis tier");
    let mut signed_cfg = redis_cfg(port, Some(Secret::new(b"bench secret")));
    signed_cfg.key_prefix = "bench-signed".into();
    let signed = TierClient::open(TierConfig {
        disk: None,
        namespace: ns(),
        spare_bytes: cachet_tiers::DEFAULT_SPARE_BYTES,
        host: None,
        redis: Some(signed_cfg),
    })
    .expect("redis tier (signed)");

    let t = Instant::now();
    for (h, p) in hashes.iter().zip(&payloads) {
        assert!(host.save(*h, p.clone(), SaveTarget::Host));
    }
    let host_save = t.elapsed();
    let mut save_ms = Vec::new();
    for c in [&plain, &signed] {
        let t = Instant::now();
        for (h, p) in hashes.iter().zip(&payloads) {
            assert!(c.save(*h, p.clone(), SaveTarget::Redis));
        }
        assert!(c.flush(Duration::from_secs(30)));
        save_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }

    // One BLAKE3 pass over the bytes, the verification floor of a Redis load.
    let all: Vec<u8> = payloads.iter().flat_map(|p| p.iter().copied()).collect();
    let t = Instant::now();
    let d = blake3::hash(&all);
    let blake3_ms = t.elapsed().as_secs_f64() * 1e3;
    std::hint::black_box(d);

    let (host, plain, signed) = (waiting(host), waiting(plain), waiting(signed));
    // Warm up, then interleave.
    load(&host, 0, &hashes);
    load(&plain, 0, &hashes);
    load(&signed, 0, &hashes);
    let (mut h, mut p, mut s) = (Vec::new(), Vec::new(), Vec::new());
    let (mut lh, mut lr) = (Vec::new(), Vec::new());
    let lookup = |c: &TierClient| {
        let t = Instant::now();
        assert_eq!(c.lookup(&hashes).len(), BLOCKS as usize);
        t.elapsed().as_secs_f64() * 1e3
    };
    for r in 0..rounds as u64 {
        h.push(load(&host, r + 1, &hashes).as_secs_f64() * 1e3);
        p.push(load(&plain, r + 1, &hashes).as_secs_f64() * 1e3);
        s.push(load(&signed, r + 1, &hashes).as_secs_f64() * 1e3);
        lh.push(lookup(&host.c));
        lr.push(lookup(&plain.c));
    }
    println!(
        "{BLOCKS} blocks x {BLOCK_BYTES} B = {:.1} MB per load, {rounds} interleaved rounds",
        BLOCKS as f64 * BLOCK_BYTES as f64 / 1e6
    );
    // The host tier hands out shared payloads (no copy); the executor's copy into its blocks
    // is the engine's cost.
    println!("load (start_load until poll returns it):");
    summary("  host", &mut h, false);
    summary("  redis", &mut p, true);
    summary("  redis+hmac", &mut s, true);
    println!("lookup of {BLOCKS} blocks (the caller waits for it):");
    summary("  host", &mut lh, false);
    summary("  redis", &mut lr, false);
    println!(
        "saves: host {:.3} ms (all {BLOCKS}); redis write-behind drain {:.1} ms, signed {:.1} ms",
        host_save.as_secs_f64() * 1e3,
        save_ms[0],
        save_ms[1]
    );
    println!("BLAKE3 over the same bytes, one thread: {blake3_ms:.1} ms");
    let st = plain.c.stats();
    println!(
        "redis stats: {} blocks loaded, {:.1} MB, {:.3} s in loads",
        st.redis.blocks_loaded,
        st.redis.bytes_loaded as f64 / 1e6,
        st.redis.load_seconds
    );
}
