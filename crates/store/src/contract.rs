//! The behaviour every store must share, written once and run against each
//! store's handles (test-only).
//!
//! It must only use the `Store` trait, so that a store passes exactly when it
//! behaves like the others.

use std::thread;
use std::time::{Duration, Instant};

use crate::{Store, StoreError, MAX_KEY_LEN, MAX_VALUE_LEN};

/// Runs the contract on two handles `a` and `b` on the same, empty data (two
/// clients, two opens of one file, or one store twice). Both must have a
/// `timeout()` of at most a second, which `get` of a missing key waits.
pub(crate) fn check_store(a: &dyn Store, b: &dyn Store) {
    let timeout = a.timeout();
    assert!(timeout <= Duration::from_secs(1), "use a short timeout");

    assert_eq!(a.num_keys().unwrap(), 0);
    assert!(a.check(&[]).unwrap());
    assert!(!a.check(&["k"]).unwrap());

    // set / get, visible through the other handle, binary-safe.
    a.set("k", b"v1").unwrap();
    assert_eq!(b.get("k").unwrap(), b"v1");
    b.set("k", b"v2").unwrap();
    assert_eq!(a.get("k").unwrap(), b"v2");
    a.set("empty", b"").unwrap();
    assert_eq!(b.get("empty").unwrap(), b"");
    let binary: Vec<u8> = (0..=255).cycle().take(1 << 20).collect();
    a.set("bin/ключ", &binary).unwrap();
    assert_eq!(b.get("bin/ключ").unwrap(), binary);
    assert!(b.check(&["k", "empty", "bin/ключ"]).unwrap());
    assert!(!b.check(&["k", "nope"]).unwrap());
    assert_eq!(b.num_keys().unwrap(), 3);

    // get of a missing key waits the store's timeout, then names the key.
    let started = Instant::now();
    match b.get("missing") {
        Err(StoreError::Timeout { keys, timeout: t }) => {
            assert_eq!(keys, vec!["missing"]);
            assert_eq!(t, timeout);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let waited = started.elapsed();
    assert!(waited >= timeout, "returned after {waited:?}");
    assert!(waited < timeout + Duration::from_secs(2), "took {waited:?}");

    // wait: immediate when present, names only the missing keys otherwise.
    a.wait(&["k", "empty"], Duration::from_secs(5)).unwrap();
    a.wait(&[], Duration::from_millis(1)).unwrap();
    let short = Duration::from_millis(30);
    match a.wait(&["k", "w1", "w2"], short) {
        Err(StoreError::Timeout { keys, timeout: t }) => {
            assert_eq!(keys, vec!["w1", "w2"]);
            assert_eq!(t, short);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let err = a.wait(&["w1"], short).unwrap_err().to_string();
    assert!(err.contains("w1") && err.contains("30ms"), "{err}");

    // get and wait wake up for a set made later through the other handle.
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(Duration::from_millis(50));
            b.set("late", b"here").unwrap();
        });
        assert_eq!(a.get("late").unwrap(), b"here");
    });
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(Duration::from_millis(50));
            b.add("late2", 1).unwrap();
        });
        a.wait(&["late", "late2"], Duration::from_secs(5)).unwrap();
    });

    // add: missing is 0, value is decimal ASCII, non-integers are refused.
    assert_eq!(a.add("n", 5).unwrap(), 5);
    assert_eq!(b.add("n", -7).unwrap(), -2);
    assert_eq!(a.get("n").unwrap(), b"-2");
    assert_eq!(a.add("n", 0).unwrap(), -2);
    match b.add("k", 1) {
        Err(StoreError::NotACounter { key, value }) => {
            assert_eq!(key, "k");
            assert_eq!(value, "v2");
        }
        other => panic!("expected NotACounter, got {other:?}"),
    }

    // Concurrent adds from both handles are never lost.
    thread::scope(|s| {
        for store in [a, b, a, b] {
            s.spawn(move || {
                for _ in 0..50 {
                    store.add("count", 1).unwrap();
                }
            });
        }
    });
    assert_eq!(a.get("count").unwrap(), b"200");

    // compare_set follows PyTorch: returns what the key holds afterwards.
    assert_eq!(a.compare_set("cas", b"x", b"y").unwrap(), b"");
    assert!(!a.check(&["cas"]).unwrap());
    assert_eq!(a.compare_set("cas", b"", b"first").unwrap(), b"first");
    assert_eq!(b.compare_set("cas", b"wrong", b"second").unwrap(), b"first");
    assert_eq!(
        b.compare_set("cas", b"first", b"second").unwrap(),
        b"second"
    );
    assert_eq!(a.get("cas").unwrap(), b"second");

    // delete.
    let before = a.num_keys().unwrap();
    assert!(a.delete("cas").unwrap());
    assert!(!b.delete("cas").unwrap());
    assert!(!b.check(&["cas"]).unwrap());
    assert_eq!(b.num_keys().unwrap(), before - 1);
    assert!(!a.delete("never-set").unwrap());

    // Size limits, the same in every store; nothing is stored on refusal.
    let big = vec![0u8; MAX_VALUE_LEN + 1];
    assert!(matches!(
        a.set("big", &big),
        Err(StoreError::TooLarge { what: "value", size, .. }) if size == MAX_VALUE_LEN + 1
    ));
    assert!(matches!(
        a.compare_set("big", b"", &big),
        Err(StoreError::TooLarge { what: "value", .. })
    ));
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    assert!(matches!(
        a.add(&long_key, 1),
        Err(StoreError::TooLarge { what: "key", .. })
    ));
    assert!(!b.check(&["big"]).unwrap());
}
