//! What makes a checkpoint trustworthy: fsync of every file and directory, atomic replacement
//! (temp file, fsync, rename, fsync), and a checksums file, written last and checked by every
//! reader.
//!
//! The checksums file is `CHECKSUMS` (format 2): the CRC-32C and the size of every other
//! file, the CRC computed from the bytes as they are written (one pass: nothing is read back).
//! Checkpoints written before it have `SHA256SUMS` (format 1, `sha256sum`'s), which every
//! reader still checks. The checksums detect damage (a truncated, overwritten or rotted file);
//! they authenticate nothing: whoever can rewrite a file can rewrite its checksum too, with
//! SHA-256 as with CRC-32C. CRC-32C is the hardware's (SSE 4.2's `crc32`, ARMv8's CRC
//! instructions: ~0.06 CPU seconds a GB against SHA-256's ~0.5), catches every burst of up to
//! 32 bits and misses random damage with probability 2^-32, and the size catches a truncation
//! outright; it is what cloud object stores check multi-GB objects with.
//!
//! Large files are written in windows whose writeback is started as soon as they are written
//! and whose pages are dropped from the page cache once on disk, so that a save of gigabytes
//! neither leaves gigabytes of dirty pages to throttle the writer nor evicts what the rest of
//! the machine caches (reclaiming pages costs the writer more than copying into them).
//!
//! This module never writes a file in place and never returns bytes that contradict the
//! checksums.

use super::*;
// The trait of `Sha256::digest`, `update` and `finalize`, by no name: `Digest` is ours below.
use sha2::Digest as _;

/// The checksums file of format 1 (checkpoints written before [`CHECKSUMS_FILE`]): SHA-256 of
/// every other file in `sha256sum`'s format. Read, never written.
pub const SHA256SUMS_FILE: &str = "SHA256SUMS";

/// The first line of a [`CHECKSUMS_FILE`]: what it is, for a reader with a text editor.
const CHECKSUMS_HEADER: &str = "# cohort checkpoint checksums, format 2: CRC-32C SIZE NAME";

/// A file's digest as a checksums file or a shard index records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Digest {
    /// CRC-32C (Castagnoli), written as `crc32c:` and 8 hex digits.
    Crc32c(u32),
    /// SHA-256, written as 64 hex digits (format 1).
    Sha256([u8; 32]),
}

impl Digest {
    /// Its algorithm's name, for messages.
    pub(super) fn algorithm(&self) -> &'static str {
        match self {
            Digest::Crc32c(_) => "CRC-32C",
            Digest::Sha256(_) => "SHA-256",
        }
    }

    /// A digest as [`Digest::to_string`] writes it; `None` when it is neither form.
    pub(super) fn parse(text: &str) -> Option<Digest> {
        let hex_digits =
            |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if let Some(h) = text.strip_prefix("crc32c:") {
            let crc = hex_digits(h, 8).then(|| u32::from_str_radix(h, 16).ok())??;
            return Some(Digest::Crc32c(crc));
        }
        if !hex_digits(text, 64) {
            return None;
        }
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Digest::Sha256(bytes))
    }

    /// The digest of `bytes` by this digest's algorithm.
    fn of(&self, bytes: &[u8]) -> Digest {
        match self {
            Digest::Crc32c(_) => Digest::Crc32c(crc32c::crc32c(bytes)),
            Digest::Sha256(_) => Digest::Sha256(Sha256::digest(bytes).into()),
        }
    }

    /// The digest of the file at `path` by this digest's algorithm, read in 1 MB pieces.
    fn of_file(&self, path: &Path) -> Result<Digest, CheckpointError> {
        let mut file = File::open(path).map_err(io("read", path))?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut crc, mut sha) = (0u32, Sha256::new());
        loop {
            let n = file.read(&mut buf).map_err(io("read", path))?;
            if n == 0 {
                break;
            }
            match self {
                Digest::Crc32c(_) => crc = crc32c::crc32c_append(crc, &buf[..n]),
                Digest::Sha256(_) => sha.update(&buf[..n]),
            }
        }
        Ok(match self {
            Digest::Crc32c(_) => Digest::Crc32c(crc),
            Digest::Sha256(_) => Digest::Sha256(sha.finalize().into()),
        })
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Digest::Crc32c(crc) => write!(f, "crc32c:{crc:08x}"),
            Digest::Sha256(bytes) => f.write_str(&hex(bytes)),
        }
    }
}

/// What a checksums file records of one file: its digest, and its size (format 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sum {
    pub(super) digest: Digest,
    pub(super) size: Option<u64>,
}

impl Sum {
    /// Checks `bytes`, read from `path`, against this sum (recorded in `list`).
    pub(super) fn check(
        &self,
        path: &Path,
        list: &'static str,
        bytes: &[u8],
    ) -> Result<(), CheckpointError> {
        let size = bytes.len() as u64;
        self.check_size(path, list, size)?;
        self.check_digest(path, list, self.digest.of(bytes), size)
    }

    /// Checks the file at `path` against this sum (recorded in `list`), reading it.
    fn check_file(&self, path: &Path, list: &'static str) -> Result<(), CheckpointError> {
        let size = fs::metadata(path).map_err(io("read", path))?.len();
        self.check_size(path, list, size)?;
        self.check_digest(path, list, self.digest.of_file(path)?, size)
    }

    fn check_size(
        &self,
        path: &Path,
        list: &'static str,
        size: u64,
    ) -> Result<(), CheckpointError> {
        match self.size {
            Some(expected) if expected != size => Err(CheckpointError::Corrupt {
                path: path.to_path_buf(),
                what: "size",
                expected: expected.to_string(),
                found: size.to_string(),
                list,
                size,
            }),
            _ => Ok(()),
        }
    }

    fn check_digest(
        &self,
        path: &Path,
        list: &'static str,
        found: Digest,
        size: u64,
    ) -> Result<(), CheckpointError> {
        if found == self.digest {
            return Ok(());
        }
        Err(CheckpointError::Corrupt {
            path: path.to_path_buf(),
            what: self.digest.algorithm(),
            expected: self.digest.to_string(),
            found: found.to_string(),
            list,
            size,
        })
    }
}

pub(super) fn fsync(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io("fsync", path))
}

/// The bytes a write hands to the kernel at a time, summed just before (small enough to stay
/// in the CPU's cache between the two).
const PIECE: usize = 1 << 20;
/// The bytes whose writeback is started together; each window is waited for and dropped from
/// the page cache one window later, so a file in writing holds about two windows of it.
const WINDOW: u64 = 8 << 20;

/// A file being written: every byte goes into its CRC-32C and to the file in one pass, and
/// [`SumWriter::finish`] fsyncs it and returns its [`Sum`].
pub(super) struct SumWriter {
    file: File,
    path: PathBuf,
    crc: u32,
    size: u64,
    /// Where the window whose writeback was started last begins.
    started: u64,
}

impl SumWriter {
    pub(super) fn create(path: &Path) -> Result<SumWriter, CheckpointError> {
        Ok(SumWriter {
            file: File::create(path).map_err(io("create", path))?,
            path: path.to_path_buf(),
            crc: 0,
            size: 0,
            started: 0,
        })
    }

    /// Appends `bytes`, in pieces each summed right before the kernel copies it (while it is
    /// still in the CPU's cache).
    pub(super) fn write(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        for piece in bytes.chunks(PIECE) {
            self.crc = crc32c::crc32c_append(self.crc, piece);
            self.file
                .write_all(piece)
                .map_err(io("write", &self.path))?;
            self.size += piece.len() as u64;
            if self.size - self.started >= 2 * WINDOW {
                self.flush_window();
            }
        }
        Ok(())
    }

    /// Starts the writeback of the window just written, then waits for the one before it and
    /// drops its pages from the page cache. Advice only: the fsync of
    /// [`SumWriter::finish`] is what makes the file durable, and reports what failed.
    fn flush_window(&mut self) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let fd = self.file.as_raw_fd();
            let (done, now) = (self.started, self.started + WINDOW);
            let len = WINDOW as libc::off64_t;
            // SAFETY: plain syscalls on a file descriptor this writer owns; they read no memory
            // of ours.
            unsafe {
                libc::sync_file_range(fd, now as libc::off64_t, len, libc::SYNC_FILE_RANGE_WRITE);
                libc::sync_file_range(
                    fd,
                    done as libc::off64_t,
                    len,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                );
                libc::posix_fadvise(fd, done as libc::off_t, len, libc::POSIX_FADV_DONTNEED);
            }
        }
        self.started += WINDOW;
    }

    /// Fsyncs the file, drops its pages from the page cache (they are on disk) and returns
    /// its sum.
    pub(super) fn finish(self) -> Result<Sum, CheckpointError> {
        self.file.sync_all().map_err(io("fsync", &self.path))?;
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: a plain syscall on a file descriptor this writer owns. Advice only.
            unsafe {
                libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
            }
        }
        Ok(Sum {
            digest: Digest::Crc32c(self.crc),
            size: Some(self.size),
        })
    }
}

/// Writes `bytes` at `path` and fsyncs it; returns its sum.
pub(super) fn write_bytes(path: &Path, bytes: &[u8]) -> Result<Sum, CheckpointError> {
    let mut f = SumWriter::create(path)?;
    f.write(bytes)?;
    f.finish()
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

/// Writes `dir/CHECKSUMS` over `files` (name, sum as its writer computed it), fsynced.
pub(super) fn write_checksums(dir: &Path, files: &[(String, Sum)]) -> Result<(), CheckpointError> {
    let mut text = format!("{CHECKSUMS_HEADER}\n");
    for (name, sum) in files {
        let size = sum.size.map_or("-".to_string(), |s| s.to_string());
        text.push_str(&format!("{} {size} {name}\n", sum.digest));
    }
    write_bytes(&dir.join(CHECKSUMS_FILE), text.as_bytes())?;
    Ok(())
}

/// The sums a checkpoint's checksums file records, by file name, and the file's name.
pub(super) struct Sums {
    pub(super) list: &'static str,
    pub(super) sums: HashMap<String, Sum>,
}

impl Sums {
    /// Checks `bytes`, read from `dir/name`, against the sum of `name` (if listed).
    pub(super) fn check(
        &self,
        dir: &Path,
        name: &str,
        bytes: &[u8],
    ) -> Result<(), CheckpointError> {
        match self.sums.get(name) {
            Some(sum) => sum.check(&dir.join(name), self.list, bytes),
            None => Ok(()),
        }
    }
}

/// The checksums of checkpoint `dir`: its `CHECKSUMS`, else its `SHA256SUMS` (an older
/// checkpoint); `None` when it has neither.
pub(super) fn read_checksums(dir: &Path) -> Result<Option<Sums>, CheckpointError> {
    for (list, parse) in [
        (
            CHECKSUMS_FILE,
            parse_checksums as fn(&str) -> Option<(String, Sum)>,
        ),
        (SHA256SUMS_FILE, parse_sha256sums),
    ] {
        let path = dir.join(list);
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io("read", &path)(e)),
        };
        let mut sums = HashMap::new();
        let lines = text.lines().enumerate();
        for (i, line) in lines.filter(|(_, l)| !l.is_empty() && !l.starts_with('#')) {
            let Some((name, sum)) = parse(line) else {
                let form = if list == CHECKSUMS_FILE {
                    "crc32c:HEX SIZE NAME"
                } else {
                    "SHA256  NAME"
                };
                return Err(format_err(
                    &path,
                    format!("line {}: expected \"{form}\", found {line:?}", i + 1),
                ));
            };
            sums.insert(name, sum);
        }
        return Ok(Some(Sums { list, sums }));
    }
    Ok(None)
}

/// A line of `CHECKSUMS`: "DIGEST SIZE NAME".
fn parse_checksums(line: &str) -> Option<(String, Sum)> {
    let mut parts = line.splitn(3, ' ');
    let digest = Digest::parse(parts.next()?)?;
    let size = match parts.next()? {
        "-" => None,
        s => Some(s.parse().ok()?),
    };
    let name = parts.next().filter(|n| !n.is_empty())?;
    Some((name.to_string(), Sum { digest, size }))
}

/// A line of `SHA256SUMS`: "DIGEST  NAME" (`sha256sum`'s text mode) or "DIGEST *NAME" (binary).
fn parse_sha256sums(line: &str) -> Option<(String, Sum)> {
    let (digest, rest) = line.split_once(' ')?;
    let name = rest.strip_prefix([' ', '*']).unwrap_or(rest);
    let digest @ Digest::Sha256(_) = Digest::parse(digest)? else {
        return None;
    };
    Some((name.to_string(), Sum { digest, size: None }))
}

/// Checks `bytes`, read from `dir/name`, against the checkpoint's checksums (if it has them
/// and they list the file).
pub(super) fn check_digest(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    match read_checksums(dir)? {
        Some(sums) => sums.check(dir, name, bytes),
        None => Ok(()),
    }
}

/// Reads `dir/name`, checked against the checkpoint's checksums.
pub(super) fn read_verified(dir: &Path, name: &str) -> Result<Vec<u8>, CheckpointError> {
    let bytes = read_file(&dir.join(name))?;
    check_digest(dir, name, &bytes)?;
    Ok(bytes)
}

/// Checks every file the checkpoint's checksums list against its sum. Returns false when the
/// checkpoint has no checksums (nothing to check); a missing or damaged file is an error
/// naming it.
pub fn verify(dir: &Path) -> Result<bool, CheckpointError> {
    verify_except(dir, |_| false)
}

/// As [`verify`], passing over the files for which `skip` is true (a sharded checkpoint's
/// shards, which every reader checks as it reads them: a rank reads only the shards it needs).
pub fn verify_except(dir: &Path, skip: impl Fn(&str) -> bool) -> Result<bool, CheckpointError> {
    let Some(Sums { list, sums }) = read_checksums(dir)? else {
        return Ok(false);
    };
    let mut names: Vec<_> = sums.into_iter().filter(|(name, _)| !skip(name)).collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, sum) in names {
        sum.check_file(&dir.join(&name), list)?;
    }
    Ok(true)
}

pub(super) fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}
