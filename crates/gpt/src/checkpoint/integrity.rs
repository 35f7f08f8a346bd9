//! What makes a checkpoint trustworthy: fsync of every file and directory, atomic replacement
//! (temp file, fsync, rename, fsync), and SHA256SUMS, written last and checked by every reader.
//!
//! This module never writes a file in place and never returns bytes that contradict SHA256SUMS.

use super::*;

pub(super) fn fsync(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io("fsync", path))
}

/// Writes `bytes` at `path` and fsyncs it.
pub(super) fn write_bytes(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(io("create", path))?;
    f.write_all(bytes).map_err(io("write", path))?;
    f.sync_all().map_err(io("fsync", path))
}

/// Replaces `path` with `bytes` atomically: temp file in the same directory, fsync, rename,
/// fsync the directory.
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = parent(path);
    let name = path
        .file_name()
        .ok_or_else(|| format_err(path, "no file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    write_bytes(&tmp, bytes)?;
    fs::rename(&tmp, path).map_err(io("rename", &tmp))?;
    fsync(dir)
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the file at `path`, read back in 1 MB pieces (from the page cache, right after it
/// was written: the tensors are streamed to disk and never held whole in memory).
pub(super) fn sha256_file(path: &Path) -> Result<String, CheckpointError> {
    let mut file = File::open(path).map_err(io("read", path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io("read", path))?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// Writes `dir/SHA256SUMS` over `files` (names in `dir`) in `sha256sum`'s format, fsynced.
pub(super) fn write_checksums(dir: &Path, files: &[String]) -> Result<(), CheckpointError> {
    write_checksums_with(dir, files, &[])
}

/// As [`write_checksums`], plus the files `known` (name, digest) whose digests their writers
/// computed (the shards of a sharded checkpoint, written by other ranks).
pub(super) fn write_checksums_with(
    dir: &Path,
    files: &[String],
    known: &[(String, String)],
) -> Result<(), CheckpointError> {
    let mut text = String::new();
    for name in files {
        let digest = sha256_file(&dir.join(name))?;
        text.push_str(&format!("{digest}  {name}\n"));
    }
    for (name, digest) in known {
        text.push_str(&format!("{digest}  {name}\n"));
    }
    write_bytes(&dir.join(CHECKSUMS_FILE), text.as_bytes())
}

/// The digests `dir/SHA256SUMS` records, by file name; `None` when the checkpoint has none.
pub(super) fn read_checksums(
    dir: &Path,
) -> Result<Option<HashMap<String, String>>, CheckpointError> {
    let path = dir.join(CHECKSUMS_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("read", &path)(e)),
    };
    let mut sums = HashMap::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
        // `sha256sum` writes "DIGEST  NAME" (text mode) or "DIGEST *NAME" (binary mode).
        let parsed = line
            .split_once(' ')
            .map(|(digest, rest)| (digest, rest.strip_prefix([' ', '*']).unwrap_or(rest)));
        match parsed {
            Some((digest, name))
                if digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()) =>
            {
                sums.insert(name.to_string(), digest.to_ascii_lowercase());
            }
            _ => {
                return Err(format_err(
                    &path,
                    format!("line {}: expected \"SHA256  NAME\", found {line:?}", i + 1),
                ))
            }
        }
    }
    Ok(Some(sums))
}

/// Checks `bytes`, read from `dir/name`, against `dir/SHA256SUMS` (if the checkpoint has one and
/// lists the file).
pub(super) fn check_digest(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    let Some(expected) = read_checksums(dir)?.and_then(|mut sums| sums.remove(name)) else {
        return Ok(());
    };
    let found = hex(&Sha256::digest(bytes));
    if found != expected {
        return Err(CheckpointError::Corrupt {
            path: dir.join(name),
            expected,
            found,
            size: bytes.len() as u64,
        });
    }
    Ok(())
}

/// Reads `dir/name`, checked against the checkpoint's `SHA256SUMS`.
pub(super) fn read_verified(dir: &Path, name: &str) -> Result<Vec<u8>, CheckpointError> {
    let bytes = read_file(&dir.join(name))?;
    check_digest(dir, name, &bytes)?;
    Ok(bytes)
}

/// Checks every file `dir/SHA256SUMS` lists against its digest. Returns false when the checkpoint
/// has no `SHA256SUMS` (nothing to check); a missing or damaged file is an error naming it.
pub fn verify(dir: &Path) -> Result<bool, CheckpointError> {
    verify_except(dir, |_| false)
}

/// As [`verify`], passing over the files for which `skip` is true (a sharded checkpoint's
/// shards, which every reader checks as it reads them: a rank reads only the shards it needs).
pub fn verify_except(dir: &Path, skip: impl Fn(&str) -> bool) -> Result<bool, CheckpointError> {
    let Some(sums) = read_checksums(dir)? else {
        return Ok(false);
    };
    let mut names: Vec<_> = sums.into_iter().filter(|(name, _)| !skip(name)).collect();
    names.sort();
    for (name, expected) in names {
        let path = dir.join(&name);
        let found = sha256_file(&path)?;
        if found != expected {
            let size = fs::metadata(&path).map_err(io("stat", &path))?.len();
            return Err(CheckpointError::Corrupt {
                path,
                expected,
                found,
                size,
            });
        }
    }
    Ok(true)
}

pub(super) fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}
