//! `FileStore`: a store in one file that every process of the job can open
//! (a local file for one node, a shared filesystem for several), like c10d's
//! FileStore.
//!
//! The file is an append-only log. Each `FileStore` keeps the map it has
//! replayed so far and the offset it has read up to; every operation takes an
//! advisory lock on the file (`flock`: shared to read, exclusive to write),
//! replays the records appended since, and an update appends one record
//! before unlocking. Updates from all processes are thus totally ordered and
//! `add`/`compare_set` are atomic across processes. `get` and `wait` poll,
//! with a short backoff, until their deadline.
//!
//! Layout, integers little-endian, blobs a u32 length then the bytes:
//!
//! ```text
//! "cohort-filestore v1\n"
//! records:  b'S' key:blob value:blob   set
//!           b'D' key:blob              delete
//!           b'U' delta:i32             a FileStore opened (+1) or was dropped (-1)
//! ```
//!
//! As in c10d, the file is removed when the last `FileStore` on it is
//! dropped, so that a later job on the same path does not read stale keys;
//! a job that crashed leaves it behind and the next job must use a fresh
//! path. The log only grows while in use (every `add` appends), which suits
//! rendezvous, not a database.
//!
//! This module must never write to the file without holding the exclusive
//! lock, never rewrite or remove bytes that others may have read (except
//! removing the whole file at the last close), and never believe a length in
//! the file beyond the file's size and the store's limits.

use std::collections::HashMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use crate::codec::{Decoder, Encoder};
use crate::{
    check_entry, check_key, compare_matches, counter_after_add, deadline_after, Store, StoreError,
    MAX_KEY_LEN, MAX_VALUE_LEN,
};

const MAGIC: &[u8] = b"cohort-filestore v1\n";
const TAG_SET: u8 = b'S';
const TAG_DELETE: u8 = b'D';
const TAG_USERS: u8 = b'U';

/// First and longest pause between two looks at the file while waiting.
const POLL_MIN: Duration = Duration::from_millis(1);
const POLL_MAX: Duration = Duration::from_millis(20);

/// A [`Store`] backed by a file shared by every process of the job.
///
/// ```
/// use cohort_store::{FileStore, Store};
/// use std::time::Duration;
///
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("store");
/// let a = FileStore::new(&path, Duration::from_secs(10)).unwrap();
/// let b = FileStore::new(&path, Duration::from_secs(10)).unwrap(); // e.g. in another process
/// a.set("addr/0", b"10.0.0.1:4000").unwrap();
/// assert_eq!(b.get("addr/0").unwrap(), b"10.0.0.1:4000");
/// assert_eq!(b.add("arrived", 1).unwrap(), 1);
/// drop((a, b));
/// assert!(!path.exists()); // removed with its last user
/// ```
pub struct FileStore {
    path: PathBuf,
    timeout: Duration,
    log: Mutex<Log>,
}

/// This process's view of the file. Behind a mutex because `flock` locks
/// belong to the open file, shared by all threads using this `FileStore`.
struct Log {
    file: File,
    map: HashMap<String, Vec<u8>>,
    /// How far the file has been replayed into `map`.
    read_to: u64,
    /// Open `FileStore`s on the file, across all processes.
    users: i64,
}

impl fmt::Debug for FileStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.path)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl FileStore {
    /// Opens the store at `path`, creating the file if it does not exist (an
    /// existing empty file is fine too); `get` and `wait`'s keys wait up to
    /// `timeout`. Fails if the file holds something other than a store.
    pub fn new(path: impl AsRef<Path>, timeout: Duration) -> Result<FileStore, StoreError> {
        let path = path.as_ref().to_path_buf();
        let io_err = |source| StoreError::Io {
            location: path.display().to_string(),
            source,
        };
        loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io_err)?;
            let lock = Flock::exclusive(&file).map_err(io_err)?;
            // The last user of the previous job may have removed the file
            // between our open and our lock; then this file is an orphan.
            let current = std::fs::metadata(&path);
            let opened = file.metadata().map_err(io_err)?;
            match current {
                Ok(m) if m.dev() == opened.dev() && m.ino() == opened.ino() => {}
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err(e)),
            }
            if opened.len() == 0 {
                file.write_all_at(MAGIC, 0).map_err(io_err)?;
            } else {
                let mut head = vec![0; MAGIC.len()];
                let ok = opened.len() >= MAGIC.len() as u64
                    && file.read_exact_at(&mut head, 0).is_ok()
                    && head == MAGIC;
                if !ok {
                    return Err(StoreError::Protocol {
                        location: path.display().to_string(),
                        detail: "not a cohort FileStore file (use a new or empty file)".into(),
                    });
                }
            }
            let mut log = Log {
                file,
                map: HashMap::new(),
                read_to: MAGIC.len() as u64,
                users: 0,
            };
            log.append(&path, &users_record(1))?;
            drop(lock);
            return Ok(FileStore {
                path,
                timeout,
                log: Mutex::new(log),
            });
        }
    }

    /// The file backing the store.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io_err(&self, source: io::Error) -> StoreError {
        StoreError::Io {
            location: self.path.display().to_string(),
            source,
        }
    }

    fn log(&self) -> MutexGuard<'_, Log> {
        // Every update of `Log` is completed or rolled back (see
        // `Log::append`) before anything can panic, so poisoning is ignored.
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the replayed map under the shared lock.
    fn read<T>(&self, f: impl FnOnce(&HashMap<String, Vec<u8>>) -> T) -> Result<T, StoreError> {
        let mut log = self.log();
        let _lock = Flock::shared(&log.file).map_err(|e| self.io_err(e))?;
        log.refresh(&self.path)?;
        Ok(f(&log.map))
    }

    /// Runs `f` on the replayed map under the exclusive lock and appends the
    /// record it returns, if any.
    fn update<T>(
        &self,
        f: impl FnOnce(&HashMap<String, Vec<u8>>) -> Result<(Option<Vec<u8>>, T), StoreError>,
    ) -> Result<T, StoreError> {
        let mut log = self.log();
        let _lock = Flock::exclusive(&log.file).map_err(|e| self.io_err(e))?;
        log.refresh(&self.path)?;
        let (record, out) = f(&log.map)?;
        if let Some(record) = record {
            log.append(&self.path, &record)?;
        }
        Ok(out)
    }

    /// Polls until `f` returns `Some`, or the deadline; `f` gets the map and
    /// the keys still missing are reported by `missing`.
    fn poll<T>(
        &self,
        keys: &[&str],
        timeout: Duration,
        mut f: impl FnMut(&HashMap<String, Vec<u8>>) -> Option<T>,
    ) -> Result<T, StoreError> {
        let deadline = deadline_after(timeout);
        let mut pause = POLL_MIN;
        loop {
            let (found, missing) = self.read(|map| {
                let found = f(map);
                let missing: Vec<String> = keys
                    .iter()
                    .filter(|k| !map.contains_key(**k))
                    .map(|k| k.to_string())
                    .collect();
                (found, missing)
            })?;
            if let Some(found) = found {
                return Ok(found);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Timeout {
                    keys: missing,
                    timeout,
                });
            }
            thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(POLL_MAX);
        }
    }
}

impl Log {
    /// Replays the records appended since the last call. The caller holds
    /// the lock, shared or exclusive.
    fn refresh(&mut self, path: &Path) -> Result<(), StoreError> {
        let location = || path.display().to_string();
        let len = self
            .file
            .metadata()
            .map_err(|source| StoreError::Io {
                location: location(),
                source,
            })?
            .len();
        if len < self.read_to {
            return Err(StoreError::Protocol {
                location: location(),
                detail: format!(
                    "the file shrank from {} to {len} bytes behind the store's back",
                    self.read_to
                ),
            });
        }
        if len == self.read_to {
            return Ok(());
        }
        let mut buf = vec![0; (len - self.read_to) as usize];
        self.file
            .read_exact_at(&mut buf, self.read_to)
            .map_err(|source| StoreError::Io {
                location: location(),
                source,
            })?;
        let mut records = Decoder::new(&buf);
        while !records.is_empty() {
            let at = self.read_to + records.pos() as u64;
            self.apply(&mut records)
                .map_err(|detail| StoreError::Protocol {
                    location: location(),
                    detail: format!("corrupt record at offset {at}: {detail}"),
                })?;
        }
        self.read_to = len;
        Ok(())
    }

    fn apply(&mut self, records: &mut Decoder<'_>) -> Result<(), String> {
        match records.u8("record tag")? {
            TAG_SET => {
                let key = records.str("key", MAX_KEY_LEN)?;
                let value = records.blob("value", MAX_VALUE_LEN)?;
                self.map.insert(key.to_string(), value.to_vec());
            }
            TAG_DELETE => {
                self.map.remove(records.str("key", MAX_KEY_LEN)?);
            }
            TAG_USERS => self.users += i64::from(records.i32("user count change")?),
            tag => return Err(format!("unknown record tag {tag:#04x}")),
        }
        Ok(())
    }

    /// Appends `record` at the end of the file and replays it. The caller
    /// holds the exclusive lock, so after the refresh the end of the
    /// replayed file is the end of the file.
    fn append(&mut self, path: &Path, record: &[u8]) -> Result<(), StoreError> {
        self.refresh(path)?;
        if let Err(source) = self.file.write_all_at(record, self.read_to) {
            // Cut off a partial record so that readers never see it.
            let _ = self.file.set_len(self.read_to);
            return Err(StoreError::Io {
                location: path.display().to_string(),
                source,
            });
        }
        self.refresh(path)
    }
}

fn set_record(key: &str, value: &[u8]) -> Vec<u8> {
    let mut e = Encoder::new();
    e.u8(TAG_SET).blob(key.as_bytes()).blob(value);
    e.finish()
}

fn users_record(delta: i32) -> Vec<u8> {
    let mut e = Encoder::new();
    e.u8(TAG_USERS).i32(delta);
    e.finish()
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_entry(key, value)?;
        self.update(|_| Ok((Some(set_record(key, value)), ())))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.poll(&[key], self.timeout, |map| map.get(key).cloned())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_key(key)?;
        self.update(|map| {
            let new = counter_after_add(key, map.get(key).map(Vec::as_slice), delta)?;
            Ok((Some(set_record(key, new.to_string().as_bytes())), new))
        })
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        check_entry(key, desired)?;
        self.update(|map| {
            let current = map.get(key);
            if compare_matches(current.map(Vec::as_slice), expected) {
                Ok((Some(set_record(key, desired)), desired.to_vec()))
            } else {
                Ok((None, current.cloned().unwrap_or_default()))
            }
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.poll(keys, timeout, |map| {
            keys.iter().all(|k| map.contains_key(*k)).then_some(())
        })
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.read(|map| keys.iter().all(|k| map.contains_key(*k)))
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.update(|map| {
            if !map.contains_key(key) {
                return Ok((None, false));
            }
            let mut e = Encoder::new();
            e.u8(TAG_DELETE).blob(key.as_bytes());
            Ok((Some(e.finish()), true))
        })
    }

    fn num_keys(&self) -> Result<usize, StoreError> {
        self.read(HashMap::len)
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        // Errors cannot be returned from here; the worst outcome is a file
        // left behind, which is what a crashed job leaves too.
        let mut log = self.log();
        let Ok(_lock) = Flock::exclusive(&log.file) else {
            return;
        };
        if log.append(&self.path, &users_record(-1)).is_ok() && log.users <= 0 {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// An advisory `flock` on a file, released when dropped. Whoever holds it
/// must not close the file first (the guard keeps only its descriptor).
struct Flock {
    fd: RawFd,
}

impl Flock {
    fn shared(file: &File) -> io::Result<Flock> {
        Flock::acquire(file, libc::LOCK_SH)
    }

    fn exclusive(file: &File) -> io::Result<Flock> {
        Flock::acquire(file, libc::LOCK_EX)
    }

    fn acquire(file: &File, op: libc::c_int) -> io::Result<Flock> {
        let fd = file.as_raw_fd();
        loop {
            // safety: `fd` is an open descriptor owned by `file`, and flock
            // touches no memory.
            if unsafe { libc::flock(fd, op) } == 0 {
                return Ok(Flock { fd });
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }
}

impl Drop for Flock {
    fn drop(&mut self) {
        // safety: as in `acquire`; the file outlives the guard.
        unsafe { libc::flock(self.fd, libc::LOCK_UN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::check_store;

    const SHORT: Duration = Duration::from_millis(150);

    #[test]
    fn meets_the_store_contract() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let a = FileStore::new(&path, SHORT).unwrap();
        let b = FileStore::new(&path, SHORT).unwrap();
        check_store(&a, &b);
    }

    #[test]
    fn reopening_sees_the_data_and_the_last_close_removes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let a = FileStore::new(&path, SHORT).unwrap();
        a.set("k", b"v").unwrap();
        a.add("n", 3).unwrap();
        {
            let b = FileStore::new(&path, SHORT).unwrap();
            assert_eq!(b.get("k").unwrap(), b"v");
            assert_eq!(b.get("n").unwrap(), b"3");
            assert_eq!(b.num_keys().unwrap(), 2);
        }
        assert!(path.exists(), "removed while `a` still uses it");
        drop(a);
        assert!(!path.exists());
        let fresh = FileStore::new(&path, SHORT).unwrap();
        assert_eq!(fresh.num_keys().unwrap(), 0);
    }

    #[test]
    fn closing_keeps_what_others_wrote_since_our_last_look() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let a = FileStore::new(&path, SHORT).unwrap();
        let b = FileStore::new(&path, SHORT).unwrap();
        b.set("k", b"written after a's last read").unwrap();
        drop(a);
        let c = FileStore::new(&path, SHORT).unwrap();
        assert_eq!(c.get("k").unwrap(), b"written after a's last read");
        assert_eq!(c.num_keys().unwrap(), 1);
        drop((b, c));
        assert!(!path.exists());
    }

    #[test]
    fn an_existing_empty_file_is_accepted() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let store = FileStore::new(file.path(), SHORT).unwrap();
        store.set("k", b"v").unwrap();
        assert_eq!(store.get("k").unwrap(), b"v");
    }

    #[test]
    fn a_foreign_file_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notes.txt");
        std::fs::write(&path, b"my precious notes").unwrap();
        let err = FileStore::new(&path, SHORT).unwrap_err();
        assert!(matches!(err, StoreError::Protocol { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("notes.txt") && msg.contains("not a cohort FileStore"));
        assert_eq!(std::fs::read(&path).unwrap(), b"my precious notes");
    }

    #[test]
    fn errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/dir/store");
        let err = FileStore::new(&path, SHORT).unwrap_err();
        assert!(matches!(err, StoreError::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("no/such/dir/store"), "{err}");
    }

    #[test]
    fn corrupt_records_are_reported_with_their_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let store = FileStore::new(&path, SHORT).unwrap();
        store.set("k", b"v").unwrap();
        let end = std::fs::metadata(&path).unwrap().len();
        // A set record whose value length claims far more than the file holds.
        let mut torn = vec![TAG_SET];
        torn.extend_from_slice(&1u32.to_le_bytes());
        torn.push(b'x');
        torn.extend_from_slice(&(MAX_VALUE_LEN as u32).to_le_bytes());
        let other = OpenOptions::new().write(true).open(&path).unwrap();
        other.write_all_at(&torn, end).unwrap();
        let err = store.check(&["k"]).unwrap_err().to_string();
        assert!(
            err.contains(&format!("corrupt record at offset {end}")),
            "{err}"
        );
        assert!(err.contains(&path.display().to_string()), "{err}");
        // An oversized length is refused before anything is read or allocated.
        other.set_len(end).unwrap();
        let mut huge = vec![TAG_SET];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        other.write_all_at(&huge, end).unwrap();
        let err = store.check(&["k"]).unwrap_err().to_string();
        assert!(err.contains("over the limit"), "{err}");
    }
}
