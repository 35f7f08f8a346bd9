//! `PrefixStore`: a namespace inside another store, so that process groups
//! sharing one store never read each other's keys.

use std::sync::Arc;
use std::time::Duration;

use crate::{Store, StoreError};

/// Prepends `"<prefix>/"` to every key before passing the call on.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// A view of `inner` where every key lives under `prefix`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn strip<'a>(&self, key: &'a str) -> &'a str {
        key.strip_prefix(&self.prefix)
            .and_then(|k| k.strip_prefix('/'))
            .unwrap_or(key)
    }

    /// Maps the keys an error names back to the caller's key names.
    fn unprefix(&self, err: StoreError) -> StoreError {
        match err {
            StoreError::Timeout { keys, timeout } => StoreError::Timeout {
                keys: keys.iter().map(|k| self.strip(k).to_string()).collect(),
                timeout,
            },
            StoreError::NotACounter { key, value } => StoreError::NotACounter {
                key: self.strip(&key).to_string(),
                value,
            },
            StoreError::TooLarge {
                what,
                key,
                size,
                limit,
            } => StoreError::TooLarge {
                what,
                key: self.strip(&key).to_string(),
                size,
                limit,
            },
            other => other,
        }
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner
            .set(&self.key(key), value)
            .map_err(|e| self.unprefix(e))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.inner.get(&self.key(key)).map_err(|e| self.unprefix(e))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner
            .add(&self.key(key), delta)
            .map_err(|e| self.unprefix(e))
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.inner
            .compare_set(&self.key(key), expected, desired)
            .map_err(|e| self.unprefix(e))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner
            .wait(&refs, timeout)
            .map_err(|e| self.unprefix(e))
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete(&self.key(key))
    }

    /// Counts the keys of the whole underlying store, as PyTorch's PrefixStore does.
    fn num_keys(&self) -> Result<usize, StoreError> {
        self.inner.num_keys()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::check_store;
    use crate::HashStore;

    #[test]
    fn meets_the_store_contract() {
        let base: Arc<dyn Store> = Arc::new(HashStore::with_timeout(Duration::from_millis(100)));
        let a = PrefixStore::new("group/0", base.clone());
        let b = PrefixStore::new("group/0", base);
        check_store(&a, &b);
    }

    #[test]
    fn prefixes_do_not_collide() {
        let base: Arc<dyn Store> = Arc::new(HashStore::new());
        let a = PrefixStore::new("a", base.clone());
        let b = PrefixStore::new("b", base.clone());
        a.set("k", b"1").unwrap();
        b.set("k", b"2").unwrap();
        assert_eq!(a.get("k").unwrap(), b"1");
        assert_eq!(base.get("b/k").unwrap(), b"2");
        let err = a.wait(&["missing"], Duration::from_millis(5)).unwrap_err();
        assert!(matches!(err, StoreError::Timeout { keys, .. } if keys == vec!["missing"]));
    }
}
