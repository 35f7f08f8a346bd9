//! Giving the physical memory of part of a buffer back to the operating
//! system while the buffer itself stays allocated.
//!
//! The sharded strategies keep the model's one flat parameter buffer and one
//! flat gradient buffer, but hold only some of their elements at a time: a
//! part's gathered parameters while it runs, its gradient until it is
//! reduce-scattered. The buffers are virtual memory; [`release`] zeroes a
//! range, returning the whole pages inside it to the kernel, which maps them
//! again (zero-filled) only when they are next written. What is released
//! thus costs no resident memory until it is used again.
//!
//! This module must never touch memory outside the slice it is handed, and
//! never leave a released element other than zero.

/// The size of a memory page, asked once.
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a configuration value; it has no
        // preconditions and touches no memory of ours.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(size)
            .ok()
            .filter(|&s| s > 0)
            .unwrap_or(4096)
    })
}

/// Sets every element of `buf` to zero and returns the physical pages that
/// lie wholly inside it to the kernel. The few elements on pages shared with
/// neighbouring memory are zeroed in place (at most a page at each end stays
/// resident). Returns the bytes given back.
pub(crate) fn release(buf: &mut [f32]) -> usize {
    let page = page_size();
    let start = buf.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    let first = start.next_multiple_of(page);
    let last = end / page * page;
    if first >= last {
        buf.fill(0.0);
        return 0;
    }
    let f32s = std::mem::size_of::<f32>();
    // Page boundaries are multiples of 4 bytes, as is `start`: the cuts fall
    // between elements.
    let (head, rest) = buf.split_at_mut((first - start) / f32s);
    let (middle, tail) = rest.split_at_mut((last - first) / f32s);
    head.fill(0.0);
    tail.fill(0.0);
    // SAFETY: `middle` is exactly the page-aligned range first..last, which
    // lies inside `buf`, to which we hold the only (mutable) reference. The
    // memory is the global allocator's private anonymous memory, on which
    // MADV_DONTNEED makes the pages read as zeros from now on: the same as
    // writing 0.0 to every element (all-zero bits are a valid f32), which is
    // what the caller asked for. No other memory is affected.
    let rc = unsafe {
        libc::madvise(
            middle.as_mut_ptr().cast::<libc::c_void>(),
            last - first,
            libc::MADV_DONTNEED,
        )
    };
    if rc != 0 {
        // The kernel refused (it never should for heap memory): zero by hand.
        middle.fill(0.0);
        return 0;
    }
    last - first
}

/// Asks the kernel to back `buf` with transparent huge pages (2 MiB on
/// x86-64) where it can: the aligned interior of the buffer. A buffer whose
/// ranges are released and written again every step (the sharded
/// strategies' parameters and gradients) otherwise takes a page fault per
/// 4 KiB each time, hundreds of thousands a step, which cost more kernel
/// time than the collectives. Advice only: where the kernel has huge pages
/// off, or declines, nothing changes. Returns whether the kernel took it.
pub(crate) fn prefer_huge_pages(buf: &mut [f32]) -> bool {
    const HUGE: usize = 2 << 20;
    let start = buf.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    let first = start.next_multiple_of(HUGE);
    let last = end / HUGE * HUGE;
    if first >= last {
        return false;
    }
    // SAFETY: first..last lies inside `buf`, to which we hold the only
    // (mutable) reference, and is page-aligned. MADV_HUGEPAGE changes how the
    // kernel backs the range, never its contents, and touches no other memory.
    let rc = unsafe {
        libc::madvise(
            first as *mut libc::c_void,
            last - first,
            libc::MADV_HUGEPAGE,
        )
    };
    rc == 0
}

/// This process's resident memory in bytes (`VmRSS`), when the system says.
#[cfg(test)]
fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_ranges_read_zero_and_the_rest_is_untouched() {
        let mut buf: Vec<f32> = (0..200_000).map(|i| i as f32 + 1.0).collect();
        let (a, b) = (1_234, 150_001);
        let given = release(&mut buf[a..b]);
        assert!(given > 0 && given <= (b - a) * 4, "{given}");
        assert!(given + 2 * page_size() >= (b - a) * 4, "{given}");
        for (i, &x) in buf.iter().enumerate() {
            let want = if (a..b).contains(&i) {
                0.0
            } else {
                i as f32 + 1.0
            };
            assert_eq!(x, want, "element {i}");
        }
        // Written again, the pages hold what is written.
        buf[a..b].fill(2.0);
        assert!(buf[a..b].iter().all(|&x| x == 2.0));
        // Smaller than a page: zeroed in place.
        assert_eq!(release(&mut buf[10..20]), 0);
        assert!(buf[10..20].iter().all(|&x| x == 0.0) && buf[9] == 10.0 && buf[20] == 21.0);
    }

    #[test]
    fn huge_page_advice_changes_no_contents_and_release_still_zeroes() {
        let n = 8 << 20 >> 2; // 8 MiB of f32: at least one aligned 2 MiB page inside
        let mut buf: Vec<f32> = (0..n).map(|i| i as f32).collect();
        // Whether the kernel takes the advice depends on its configuration.
        let _ = prefer_huge_pages(&mut buf);
        assert!(buf.iter().enumerate().all(|(i, &x)| x == i as f32));
        let (a, b) = (1_000, n - 1_000);
        release(&mut buf[a..b]);
        assert!(buf[a..b].iter().all(|&x| x == 0.0));
        assert!(buf[..a].iter().enumerate().all(|(i, &x)| x == i as f32));
        buf[a..b].fill(3.0);
        assert!(buf[a..b].iter().all(|&x| x == 3.0));
        // Too small to hold an aligned huge page: declined.
        assert!(!prefer_huge_pages(&mut buf[..1000]));
    }

    #[test]
    fn released_pages_leave_the_resident_set() {
        let n = 64 << 20 >> 2; // 64 MiB of f32
        let mut buf = vec![1f32; n];
        let Some(before) = resident_bytes() else {
            return; // no /proc: nothing to measure
        };
        release(&mut buf);
        let after = resident_bytes().unwrap();
        // Other tests' threads allocate meanwhile; 64 MiB stands out.
        assert!(
            before > after + (48 << 20),
            "resident {before} -> {after} bytes"
        );
        assert!(buf.iter().all(|&x| x == 0.0));
    }
}
