//! Measures what a rank pays the stores at start-up: TcpStore connect
//! (without and with the job-secret handshake) and set+get round trips on
//! loopback, and FileStore set+get, each as min, median and p99 over many
//! repetitions.
//!
//! `cargo run --release -p cohort-store --example store_latency [ITERS]`

use std::time::{Duration, Instant};

use cohort_store::{FileStore, Secret, Store, TcpStore, TcpStoreServer};

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{what:<34} n={:<6} min {:>7.1} us   median {:>7.1} us   p99 {:>7.1} us",
        samples.len(),
        samples[0].as_secs_f64() * 1e6,
        at(0.5).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
    );
}

/// Times `iters` runs of `f` after `iters / 10` warm-up runs.
fn time(iters: usize, mut f: impl FnMut(usize)) -> Vec<Duration> {
    for i in 0..iters / 10 {
        f(i);
    }
    (0..iters)
        .map(|i| {
            let started = Instant::now();
            f(i);
            started.elapsed()
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 10_000,
    };
    let timeout = Duration::from_secs(10);
    let server = TcpStoreServer::bind("127.0.0.1:0")?;
    let addr = server.local_addr();

    report(
        "tcp connect (incl. hello)",
        time(iters / 10, |_| {
            TcpStore::connect(addr, timeout).unwrap();
        }),
    );
    report(
        "tcp connect + set + get",
        time(iters / 10, |i| {
            let store = TcpStore::connect(addr, timeout).unwrap();
            let key = format!("fresh/{i}");
            store.set(&key, b"127.0.0.1:40000").unwrap();
            store.get(&key).unwrap();
        }),
    );
    let secret = Secret::generate()?;
    let guarded = TcpStoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone()))?;
    report(
        "tcp connect (handshake + hello)",
        time(iters / 10, |_| {
            TcpStore::connect_with_secret(guarded.local_addr(), timeout, Some(secret.clone()))
                .unwrap();
        }),
    );

    let store = TcpStore::connect(addr, timeout)?;
    report(
        "tcp set + get (same key)",
        time(iters, |_| {
            store.set("addr/0", b"127.0.0.1:40000").unwrap();
            store.get("addr/0").unwrap();
        }),
    );
    report(
        "tcp add",
        time(iters, |_| {
            store.add("counter", 1).unwrap();
        }),
    );

    let dir = tempfile::tempdir()?;
    let file = FileStore::new(dir.path().join("store"), timeout)?;
    report(
        "file set + get (same key)",
        time(iters, |_| {
            file.set("addr/0", b"127.0.0.1:40000").unwrap();
            file.get("addr/0").unwrap();
        }),
    );
    Ok(())
}
