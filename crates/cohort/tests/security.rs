//! The rendezvous that lets no stranger in, end to end: a real
//! `cohort run -n 2 train` while a stranger hammers the store port and the
//! ranks' collective ports without the job secret, with a wrong one, with
//! garbage and with oversized frame headers. The job must finish with the
//! loss of an undisturbed run, and the launcher must log the refusals.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use cohort_store::auth::{authenticate_client, AuthError};
use cohort_store::{Secret, Store, StoreError, TcpStore};

mod support;

use support::free_port;

/// A tiny model for a few hundred steps: about a second per run, long
/// enough for the stranger to try everything many times over.
const TINY: &[&str] = &[
    "--steps",
    "300",
    "--warmup-steps",
    "10",
    "--log-interval",
    "100",
    "--eval-interval",
    "0",
    "--eval-batches",
    "1",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--d-model",
    "64",
    "--d-ff",
    "256",
    "--markov-vocab",
    "16",
    "--train-sequences",
    "96",
    "--val-sequences",
    "16",
];

/// `cohort run -n 2 train TINY` on `port` with `secret` in the launcher's
/// environment (so that this test can play an insider where it must).
fn train(port: u16, secret: &Secret) -> std::process::Child {
    let port = port.to_string();
    let mut args = vec!["run", "-n", "2", "--master-port", &port, "train"];
    args.extend_from_slice(TINY);
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .env_remove("RANK")
        .env_remove("COHORT_NUM_THREADS")
        .env("COHORT_SECRET", secret.to_hex())
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cohort runs")
}

fn finished(out: &Output) -> (String, String) {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// Rank 0's closing line's losses (`train loss X, val loss Y`).
fn final_losses(stdout: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.contains("done: 300 steps"))
        .unwrap_or_else(|| panic!("no closing line in:\n{stdout}"));
    let start = line.find("train loss").unwrap();
    let end = line[start..].find(';').map_or(line.len(), |e| start + e);
    line[start..end].to_string()
}

/// What the stranger tried, and what it got that it never should have.
#[derive(Default, Debug)]
struct Intrusion {
    /// Rounds of attacks on the store port.
    store_attempts: usize,
    /// Connections that reached rank 0's collective port while it was open.
    mesh_attempts: usize,
    /// Each answer that let the stranger in or told it more than a refusal.
    breaches: Vec<String>,
}

/// Hits `store` (and rank 0's collective port, found through the store as
/// an insider would) until `stop`, never with the right secret.
fn intrude(store: SocketAddr, secret: &Secret, stop: &AtomicBool) -> Intrusion {
    let mut got = Intrusion::default();
    let wrong = Secret::generate().unwrap();
    let quick = Duration::from_secs(2);
    // Connects and never speaks, for the whole run.
    let mut silent = Vec::new();
    let mut insider: Option<TcpStore> = None;
    let mut mesh_addr: Option<SocketAddr> = None;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    while !stop.load(Ordering::SeqCst) {
        let Ok(s) = TcpStream::connect(store) else {
            thread::sleep(Duration::from_millis(5));
            continue;
        };
        got.store_attempts += 1;
        if silent.len() < 4 {
            silent.push(s);
        }
        // A cohort client without the secret, and with another job's.
        match TcpStore::connect(store, quick) {
            Err(StoreError::Protocol { detail, .. }) if detail.contains("COHORT_SECRET") => {}
            Err(StoreError::Io { .. } | StoreError::Connect { .. }) => {}
            other => got.breaches.push(format!("no secret: {other:?}")),
        }
        match TcpStore::connect_with_secret(store, quick, Some(wrong.clone())) {
            Err(StoreError::Auth { source, .. })
                if matches!(*source, AuthError::WrongProof { .. }) => {}
            // A server busy with the flood, or closing at the job's end,
            // hangs up mid-handshake: refused all the same.
            Err(StoreError::Protocol { detail, .. }) if detail.contains("hung up") => {}
            Err(StoreError::Io { .. } | StoreError::Connect { .. }) => {}
            other => got.breaches.push(format!("wrong secret: {other:?}")),
        }
        // Garbage, then a frame header claiming 4 GB, then one claiming
        // 1 GB after a forged handshake opening.
        for bytes in [
            (0..64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect::<Vec<u8>>(),
            u32::MAX.to_le_bytes().to_vec(),
            [
                &b"COHAUTH1"[..],
                &[0u8; 32],
                &[0u8; 32],
                &(1u32 << 30).to_le_bytes(),
            ]
            .concat(),
        ] {
            if let Ok(mut s) = TcpStream::connect(store) {
                s.set_read_timeout(Some(quick)).unwrap();
                let _ = s.write_all(&bytes);
                let _ = s.shutdown(std::net::Shutdown::Write);
                let mut answer = Vec::new();
                let _ = s.read_to_end(&mut answer);
                // At most the server's half of a handshake or one refusal.
                if answer.len() > 64 + 4096 {
                    got.breaches
                        .push(format!("garbage got {} bytes back", answer.len()));
                }
            }
        }
        // Rank 0's collective port, published in the store, is open only
        // while the mesh forms: try it whenever it is known.
        if insider.is_none() {
            insider = TcpStore::connect_with_secret(store, quick, Some(secret.clone())).ok();
        }
        if let (None, Some(insider)) = (mesh_addr, &insider) {
            if let Ok(true) = insider.check(&["restart0/cohort/default/addr/0"]) {
                mesh_addr = insider
                    .get("restart0/cohort/default/addr/0")
                    .ok()
                    .and_then(|a| String::from_utf8(a).ok()?.parse().ok());
            }
        }
        if let Some(addr) = mesh_addr {
            for proof in [None, Some(&wrong)] {
                let Ok(mut s) = TcpStream::connect_timeout(&addr, quick) else {
                    continue;
                };
                got.mesh_attempts += 1;
                s.set_read_timeout(Some(quick)).unwrap();
                let outcome = match proof {
                    None => s.write_all(&[0x55; 32]),
                    Some(wrong) => match authenticate_client(&mut s, wrong, b"cohort-mesh") {
                        Err(AuthError::WrongProof { .. } | AuthError::Io(_)) => Ok(()),
                        other => {
                            got.breaches.push(format!("mesh, wrong secret: {other:?}"));
                            Ok(())
                        }
                    },
                };
                let mut answer = Vec::new();
                let _ = outcome.and_then(|()| s.read_to_end(&mut answer));
                if answer.len() > 64 {
                    got.breaches.push("mesh: a stranger got an answer".into());
                }
            }
        }
    }
    got
}

#[test]
fn strangers_cannot_join_or_disturb_a_training_job() {
    let secret = Secret::generate().unwrap();
    let baseline = finished(&train(free_port(), &secret).wait_with_output().unwrap());

    let port = free_port();
    let job = train(port, &secret);
    let stop = Arc::new(AtomicBool::new(false));
    let stranger = {
        let (stop, secret) = (stop.clone(), secret.clone());
        let store: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        thread::spawn(move || intrude(store, &secret, &stop))
    };
    let started = Instant::now();
    let out = job.wait_with_output().unwrap();
    stop.store(true, Ordering::SeqCst);
    let intrusion = stranger.join().unwrap();
    let (stdout, stderr) = finished(&out);

    assert!(intrusion.breaches.is_empty(), "{intrusion:?}");
    assert!(intrusion.store_attempts > 0, "{intrusion:?}");
    assert_eq!(
        final_losses(&stdout),
        final_losses(&baseline.0),
        "the intruded run must train exactly as the undisturbed one"
    );
    // The launcher's store summed up the refusals (one line per 10 s), naming the latest
    // stranger and why it was refused. Which of the stranger's attempts comes first and last
    // is up to the scheduler (a wrong secret, or a connection hung up mid-handshake), so the
    // line must give a reason, not a particular one.
    assert!(
        stderr.contains("without the job secret (latest 127.0.0.1:")
            && [
                "failed authentication",
                "handshake not completed",
                "protocol error"
            ]
            .iter()
            .any(|why| stderr.contains(why)),
        "{stderr}"
    );
    // The secret is on no log line.
    assert!(!stdout.contains(&secret.to_hex()) && !stderr.contains(&secret.to_hex()));
    eprintln!(
        "intruded run: {:.1} s, {} store attempts, {} on the collective port",
        started.elapsed().as_secs_f64(),
        intrusion.store_attempts,
        intrusion.mesh_attempts
    );
}

#[test]
fn workers_get_the_secret_only_through_their_environment() {
    // A single-node job makes its own secret: every worker sees the same
    // 64 hex characters in COHORT_SECRET, and none on its command line.
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .env_remove("COHORT_SECRET")
        .args([
            "run",
            "--standalone",
            "-n",
            "2",
            "--",
            "sh",
            "-c",
            "echo \"secret=$COHORT_SECRET\"; printf 'cmdline: '; tr '\\0' ' ' < /proc/$$/cmdline; echo",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = finished(&out);
    let secrets: Vec<&str> = stdout
        .lines()
        .filter(|l| !l.contains("cmdline: "))
        .filter_map(|l| l.split("secret=").nth(1))
        .collect();
    assert_eq!(secrets.len(), 2, "{stdout}");
    assert_eq!(secrets[0], secrets[1]);
    assert!(
        Secret::from_hex(secrets[0], "worker env").is_ok(),
        "{stdout}"
    );
    let cmdlines: Vec<&str> = stdout.lines().filter(|l| l.contains("cmdline: ")).collect();
    assert_eq!(cmdlines.len(), 2, "{stdout}");
    assert!(cmdlines.iter().all(|l| !l.contains(secrets[0])), "{stdout}");
    assert!(!stderr.contains(secrets[0]), "{stderr}");
}

#[test]
fn a_multi_node_job_on_the_network_needs_a_secret() {
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .env_remove("COHORT_SECRET")
        .args([
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "10.255.255.1",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--secret-file") && stderr.contains("COHORT_SECRET"),
        "{stderr}"
    );
}
