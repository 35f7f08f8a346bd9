//! What a save costs in CPU seconds per GB, stage by stage, counted with `getrusage`
//! (`RUSAGE_THREAD`: this thread's user and system time) rather than timed, so that the
//! figures hold on a machine whose cores other work shares. An ignored test, run by hand:
//!
//! ```text
//! cargo test -p cohort-gpt --lib -- --ignored --nocapture save_cpu_seconds_per_gb
//! ```
//!
//! `COHORT_CPU_COST_MB` sets the size (256 MB by default); the files go to `TMPDIR`, which
//! should be on the disk the checkpoints go to (a tmpfs makes fsync free). The kernel's
//! flusher threads, which write the dirty pages back when fsync does not, are not counted.

use super::*;
use sha2::Digest as _;

/// This thread's user + system CPU seconds so far.
fn thread_cpu() -> f64 {
    // SAFETY: getrusage writes a `rusage` into the zeroed struct we own and reads nothing else.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut ru), 0);
        ru
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// CPU seconds per GB of `bytes` that `f` costs this thread.
fn per_gb(bytes: usize, f: impl FnOnce()) -> f64 {
    let start = thread_cpu();
    f();
    (thread_cpu() - start) / (bytes as f64 / 1e9)
}

#[test]
#[ignore = "a CPU-time accounting run, by hand (see the module doc)"]
fn save_cpu_seconds_per_gb() {
    let mb: usize = std::env::var("COHORT_CPU_COST_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let n = mb * (1 << 20) / 4;
    let bytes = n * 4;
    let src: Vec<f32> = (0..n).map(|i| (i % 1013) as f32 * 0.37).collect();
    let mut dst = vec![1f32; n]; // written once: its pages are there before the copy is counted
    let root = tempfile::tempdir().unwrap();
    let mut rows: Vec<(&str, f64)> = Vec::new();

    rows.push((
        "staging copy (copy_from_slice)",
        per_gb(bytes, || dst.copy_from_slice(&src)),
    ));
    let mut le = Vec::new();
    rows.push((
        "f32 -> LE bytes, new Vec (before: every tensor)",
        per_gb(bytes, || {
            le = src
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>()
        }),
    ));
    let raw = root.path().join("raw");
    let mut file = File::create(&raw).unwrap();
    rows.push((
        "write() into the page cache",
        per_gb(bytes, || file.write_all(&le).unwrap()),
    ));
    rows.push(("fsync", per_gb(bytes, || file.sync_all().unwrap())));
    rows.push((
        "posix_fadvise(DONTNEED) after the fsync",
        per_gb(bytes, || {
            use std::os::fd::AsRawFd;
            // SAFETY: a plain syscall on a file this test owns.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }),
    ));
    drop(file);
    let raw2 = root.path().join("raw2");
    let mut file = File::create(&raw2).unwrap();
    rows.push((
        "write() into the pages just dropped",
        per_gb(bytes, || file.write_all(&le).unwrap()),
    ));
    drop(file);
    let _ = fs::remove_file(&raw2);
    let one_pass = root.path().join("one-pass");
    rows.push((
        "one pass: CRC + write + writeback + fsync",
        per_gb(bytes, || {
            let mut w = SumWriter::create(&one_pass).unwrap();
            w.write(&le).unwrap();
            w.finish().unwrap();
        }),
    ));
    let _ = fs::remove_file(&one_pass);
    rows.push((
        "read back + SHA-256 (before: every file)",
        per_gb(bytes, || {
            sha256_file_for_cost(&raw);
        }),
    ));
    rows.push((
        "SHA-256 in memory",
        per_gb(bytes, || {
            std::hint::black_box(Sha256::digest(&le));
        }),
    ));
    rows.push((
        "CRC-32C in memory",
        per_gb(bytes, || {
            std::hint::black_box(crc32c::crc32c(&le));
        }),
    ));
    let _ = fs::remove_file(&raw);
    rows.push((
        "save() of one tensor file, all told",
        per_gb(bytes, || {
            save(
                root.path(),
                "step-1",
                &Checkpoint {
                    tensor_files: vec![TensorFile {
                        name: "state.safetensors",
                        tensors: vec![("m".to_string(), &src[..])],
                        metadata: HashMap::new(),
                    }],
                    ..Default::default()
                },
            )
            .unwrap();
        }),
    ));
    rows.push((
        "verify() (every reader's check)",
        per_gb(bytes, || {
            assert!(verify(&root.path().join("step-1")).unwrap());
        }),
    ));
    eprintln!("CPU seconds per GB ({mb} MB, this thread's user + system time):");
    for (what, cost) in rows {
        eprintln!("  {what:<48} {cost:6.3}");
    }
}

/// The old read-back digest: the file read in 1 MB pieces into SHA-256.
fn sha256_file_for_cost(path: &Path) -> String {
    let mut file = File::open(path).unwrap();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            return hex(&hasher.finalize());
        }
        hasher.update(&buf[..n]);
    }
}
