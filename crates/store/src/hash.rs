//! `HashStore`: a store inside one process, for threads of the same program.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{
    check_entry, check_key, compare_matches, counter_after_add, deadline_after, Store, StoreError,
    DEFAULT_TIMEOUT,
};

/// An in-memory [`Store`]; clone an `Arc<HashStore>` to share it between threads.
#[derive(Debug)]
pub struct HashStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    timeout: Duration,
}

impl Default for HashStore {
    fn default() -> Self {
        Self::new()
    }
}

impl HashStore {
    /// An empty store whose `get` waits [`DEFAULT_TIMEOUT`].
    pub fn new() -> Self {
        Self::with_timeout(DEFAULT_TIMEOUT)
    }

    /// An empty store whose `get` waits `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        HashStore {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            timeout,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the lock cannot leave the map half-updated
        // (every update is one insert or remove), so poisoning is ignored.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`Store::wait`], but also stops early, returning `Ok(false)`, once
    /// `give_up()` says so. `give_up` runs with the map locked, after every
    /// change and at least every `poll`; whoever makes it true must then call
    /// [`HashStore::wake_waiters`] so that no waiter sleeps through it.
    pub(crate) fn wait_or_give_up(
        &self,
        keys: &[&str],
        timeout: Duration,
        poll: Duration,
        mut give_up: impl FnMut() -> bool,
    ) -> Result<bool, StoreError> {
        let deadline = deadline_after(timeout);
        let mut map = self.lock();
        loop {
            if give_up() {
                return Ok(false);
            }
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(**k))
                .map(|k| k.to_string())
                .collect();
            if missing.is_empty() {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Timeout {
                    keys: missing,
                    timeout,
                });
            }
            map = self
                .changed
                .wait_timeout(map, (deadline - now).min(poll))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The value of `key` now, without waiting.
    pub(crate) fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.lock().get(key).cloned()
    }

    /// Wakes every waiter so that it runs its `give_up` check again.
    pub(crate) fn wake_waiters(&self) {
        // Taking the lock orders this after any waiter's check that is
        // about to sleep, so the notification cannot fall between the two.
        let _map = self.lock();
        self.changed.notify_all();
    }
}

impl Store for HashStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_entry(key, value)?;
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], self.timeout)?;
        Ok(self.lock().get(key).cloned().unwrap_or_default())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_key(key)?;
        let mut map = self.lock();
        let new = counter_after_add(key, map.get(key).map(Vec::as_slice), delta)?;
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        check_entry(key, desired)?;
        let mut map = self.lock();
        if compare_matches(map.get(key).map(Vec::as_slice), expected) {
            map.insert(key.to_string(), desired.to_vec());
            drop(map);
            self.changed.notify_all();
            return Ok(desired.to_vec());
        }
        Ok(map.get(key).cloned().unwrap_or_default())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.wait_or_give_up(keys, timeout, timeout, || false)
            .map(|_| ())
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let map = self.lock();
        Ok(keys.iter().all(|k| map.contains_key(*k)))
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.lock().remove(key).is_some())
    }

    fn num_keys(&self) -> Result<usize, StoreError> {
        Ok(self.lock().len())
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::check_store;
    use std::sync::Arc;

    #[test]
    fn meets_the_store_contract() {
        let store = HashStore::with_timeout(Duration::from_millis(100));
        check_store(&store, &store);
    }

    #[test]
    fn get_waits_for_a_later_set() {
        let store = Arc::new(HashStore::new());
        let writer = {
            let store = store.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                store.set("k", b"v").unwrap();
            })
        };
        assert_eq!(store.get("k").unwrap(), b"v");
        writer.join().unwrap();
    }

    #[test]
    fn wait_times_out_naming_missing_keys() {
        let store = HashStore::with_timeout(Duration::from_millis(20));
        store.set("present", b"").unwrap();
        let err = store.wait(&["present", "absent"], Duration::from_millis(20));
        match err {
            Err(StoreError::Timeout { keys, .. }) => assert_eq!(keys, vec!["absent"]),
            other => panic!("expected timeout, got {other:?}"),
        }
        assert!(store
            .get("absent")
            .unwrap_err()
            .to_string()
            .contains("absent"));
    }

    #[test]
    fn add_counts_and_rejects_non_counters() {
        let store = HashStore::new();
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(store.add("n", -5).unwrap(), -3);
        assert_eq!(store.get("n").unwrap(), b"-3");
        store.set("s", b"abc").unwrap();
        assert!(matches!(
            store.add("s", 1),
            Err(StoreError::NotACounter { .. })
        ));
    }

    #[test]
    fn compare_set_follows_pytorch() {
        let store = HashStore::new();
        assert_eq!(store.compare_set("k", b"x", b"y").unwrap(), b"");
        assert!(!store.check(&["k"]).unwrap());
        assert_eq!(store.compare_set("k", b"", b"a").unwrap(), b"a");
        assert_eq!(store.compare_set("k", b"zzz", b"b").unwrap(), b"a");
        assert_eq!(store.compare_set("k", b"a", b"b").unwrap(), b"b");
        assert_eq!(store.num_keys().unwrap(), 1);
        assert!(store.delete("k").unwrap());
        assert!(!store.delete("k").unwrap());
    }
}
