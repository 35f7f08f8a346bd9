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
//! Released pages cost their kernel page faults and zero-filling again
//! when next written (on a VM, whose host may have taken the freed memory
//! back, slower still): several percent of a sharded GPT-2 small step, for
//! memory that the very next part fills again. [`SparePages`] keeps a
//! bounded amount of released memory resident instead and moves its pages
//! (page tables only, no copy) to the next range filled, as PyTorch's
//! caching allocator keeps freed blocks for the next tensor.
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

/// The unit [`SparePages`] moves: a transparent huge page on x86-64, so
/// that a page kept whole moves as one page-table entry and stays huge.
const CHUNK: usize = 2 << 20;

/// Allocations at least this large are always the allocator's own private
/// mappings (glibc maps anything above 32 MiB on its own), never a shared
/// heap whose growth and trimming could meet the moved pages.
pub(crate) const SPARE_PAGES_MIN_BUFFER: usize = 64 << 20;

/// Released memory kept resident for the next range to be filled: a
/// parking area of up to `capacity` bytes of pages, moved out of a buffer
/// on [`SparePages::release`] and into another range (of the same or
/// another buffer) on [`SparePages::refill`], with `mremap`: the physical
/// pages change address, nothing is copied, the kernel neither frees nor
/// zero-fills them. Resident memory grows by at most `capacity` over plain
/// [`release`].
///
/// Only 2 MiB-aligned chunks move; the rest of a range is released as by
/// [`release`]. Where the kernel lacks `MREMAP_DONTUNMAP` (Linux before
/// 5.7) or refuses a move, the pool turns itself off and everything is
/// released plainly. Use it only on buffers of at least
/// [`SPARE_PAGES_MIN_BUFFER`] bytes.
pub(crate) struct SparePages {
    /// The reserved address range (as mapped, for unmapping), or null.
    mapping: *mut libc::c_void,
    mapped_len: usize,
    /// The first 2 MiB boundary inside the mapping: chunk `i` is parked at
    /// `base + i * CHUNK`.
    base: usize,
    /// Chunks the parking area holds.
    slots: usize,
    /// Chunks parked, in slots `0..held`.
    held: usize,
}

// SAFETY: the pointer is this value's own private mapping, reached only
// through `&mut self`; nothing about it is tied to the creating thread.
unsafe impl Send for SparePages {}

impl SparePages {
    /// A pool parking up to `capacity` bytes (rounded down to whole 2 MiB
    /// chunks; none at all when that is zero or the address space cannot
    /// be reserved, and then it only releases).
    pub(crate) fn new(capacity: usize) -> SparePages {
        let slots = capacity / CHUNK;
        let mut pool = SparePages {
            mapping: std::ptr::null_mut(),
            mapped_len: 0,
            base: 0,
            slots: 0,
            held: 0,
        };
        if slots == 0 {
            return pool;
        }
        let len = (slots + 1) * CHUNK;
        // SAFETY: a fresh private anonymous mapping at an address the kernel
        // chooses; it overlaps nothing of ours. NORESERVE: only the pages
        // parked in it are ever resident.
        let mapping = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if mapping == libc::MAP_FAILED {
            return pool;
        }
        pool.mapping = mapping;
        pool.mapped_len = len;
        pool.base = (mapping as usize).next_multiple_of(CHUNK);
        pool.slots = slots;
        pool
    }

    /// Bytes parked now (resident, unless what was parked never was).
    #[cfg(test)]
    pub(crate) fn held_bytes(&self) -> usize {
        self.held * CHUNK
    }

    /// As [`release`]: every element of `buf` reads zero afterwards and its
    /// whole pages are no longer resident in `buf`, but the 2 MiB chunks
    /// inside it are parked (while room is left) instead of given back to
    /// the kernel. Returns the bytes taken out of `buf`.
    pub(crate) fn release(&mut self, buf: &mut [f32]) -> usize {
        let (first, chunks) = chunks_inside(buf);
        let mut moved = 0;
        while moved < chunks && self.held < self.slots {
            let from = first + moved * CHUNK;
            let to = self.base + self.held * CHUNK;
            // SAFETY: `from..from + CHUNK` lies inside `buf`, to which we
            // hold the only reference; `to` is a free slot of our own
            // mapping. The move takes the chunk's pages out of `buf`,
            // leaving the range mapped and reading zero (DONTUNMAP on private
            // anonymous memory), which is what releasing promises; the old
            // contents of the slot were parked pages nobody refers to.
            if !unsafe { move_chunk(from, to) } {
                self.turn_off();
                break;
            }
            self.held += 1;
            moved += 1;
        }
        let f32s = std::mem::size_of::<f32>();
        let start = buf.as_ptr() as usize;
        let cut = if moved == 0 {
            0
        } else {
            (first - start) / f32s
        };
        let (before, rest) = buf.split_at_mut(cut);
        let rest = &mut rest[moved * CHUNK / f32s..];
        release(before) + moved * CHUNK + release(rest)
    }

    /// Moves parked chunks into the 2 MiB chunks inside `buf`, which must
    /// hold nothing the caller needs (it was released, or is about to be
    /// overwritten whole): where a chunk arrives, `buf` holds whatever the
    /// parked pages held, unless `zero`, which writes zeros over them (still
    /// far cheaper than the kernel's faults). Elsewhere `buf` is untouched.
    pub(crate) fn refill(&mut self, buf: &mut [f32], zero: bool) {
        let (first, chunks) = chunks_inside(buf);
        let mut moved = 0;
        while moved < chunks && self.held > 0 {
            let from = self.base + (self.held - 1) * CHUNK;
            let to = first + moved * CHUNK;
            // SAFETY: `from` is the newest parked chunk of our own mapping;
            // `to..to + CHUNK` lies inside `buf`, to which we hold the only
            // reference and whose contents the caller gave up. The move
            // replaces the pages there (none, when released) with the
            // parked ones, any bits of which are a valid f32.
            if !unsafe { move_chunk(from, to) } {
                self.turn_off();
                break;
            }
            self.held -= 1;
            moved += 1;
        }
        if zero && moved > 0 {
            let f32s = std::mem::size_of::<f32>();
            let at = (first - buf.as_ptr() as usize) / f32s;
            buf[at..at + moved * CHUNK / f32s].fill(0.0);
        }
    }

    /// Gives every parked page back to the kernel; the pool parks again
    /// from the next release.
    pub(crate) fn give_back(&mut self) {
        if self.held == 0 {
            return;
        }
        // SAFETY: slots `0..held` are our own mapping's, holding parked
        // pages nobody refers to; dropping them affects nothing else.
        let rc = unsafe {
            libc::madvise(
                self.base as *mut libc::c_void,
                self.held * CHUNK,
                libc::MADV_DONTNEED,
            )
        };
        if rc != 0 {
            self.turn_off();
        }
        self.held = 0;
    }

    /// Gives every parked page back and parks nothing from now on.
    fn turn_off(&mut self) {
        if !self.mapping.is_null() {
            // SAFETY: the mapping is ours, made in `new` with this length,
            // and no slice refers into it.
            unsafe { libc::munmap(self.mapping, self.mapped_len) };
        }
        self.mapping = std::ptr::null_mut();
        self.mapped_len = 0;
        self.slots = 0;
        self.held = 0;
    }
}

impl Drop for SparePages {
    fn drop(&mut self) {
        self.turn_off();
    }
}

/// The first 2 MiB boundary inside `buf` and how many whole chunks follow
/// it inside `buf`.
fn chunks_inside(buf: &[f32]) -> (usize, usize) {
    let start = buf.as_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    let first = start.next_multiple_of(CHUNK);
    (first, end.saturating_sub(first) / CHUNK)
}

/// Moves the pages of the 2 MiB chunk at `from` to `to`, leaving `from`
/// mapped and empty (reading zero). Returns whether the kernel did it.
///
/// # Safety
/// Both must be `CHUNK`-aligned chunks of private anonymous memory that no
/// live reference other than the caller's exclusive one points into.
unsafe fn move_chunk(from: usize, to: usize) -> bool {
    // SAFETY: as the caller promises; MREMAP_FIXED replaces whatever `to`
    // held, MREMAP_DONTUNMAP keeps `from` mapped.
    let got = unsafe {
        libc::mremap(
            from as *mut libc::c_void,
            CHUNK,
            CHUNK,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP,
            to as *mut libc::c_void,
        )
    };
    got as usize == to
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

    /// Held by the tests that allocate or measure tens of megabytes, so that
    /// one's allocations do not land inside another's measurement.
    static BIG: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Page faults this thread has taken so far.
    fn faults() -> i64 {
        // SAFETY: rusage is plain integers, for which all-zero bits are valid.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: getrusage writes the struct we hand it and nothing else.
        unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
        usage.ru_minflt + usage.ru_majflt
    }

    #[test]
    fn spare_pages_move_released_memory_to_the_next_range_without_faults() {
        let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
        let n = SPARE_PAGES_MIN_BUFFER / 4;
        let mut a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut b = vec![0f32; n];
        let mut c = vec![0f32; n];
        let mut pool = SparePages::new(4 * CHUNK);
        let (lo, hi) = (1_001, n - 3_003);
        let given = pool.release(&mut a[lo..hi]);
        assert!(given + 2 * page_size() >= (hi - lo) * 4, "{given}");
        // Released as ever: zeros inside, untouched outside.
        assert!(a[lo..hi].iter().all(|&x| x == 0.0));
        assert!(a[..lo].iter().enumerate().all(|(i, &x)| x == i as f32));
        assert!((hi..n).all(|i| a[i] == i as f32));
        if pool.held_bytes() == 0 {
            // A kernel without MREMAP_DONTUNMAP: plain releasing, checked above.
            eprintln!("spare pages are off on this kernel");
            return;
        }
        assert_eq!(pool.held_bytes(), 4 * CHUNK, "parks up to its capacity");
        // The first parked chunk moves into b unzeroed: it still holds what
        // `a` held there, and writing it takes no fault.
        let (first, chunks) = chunks_inside(&b);
        assert!(chunks >= 2);
        let at = (first - b.as_ptr() as usize) / 4;
        let per = CHUNK / 4;
        pool.refill(&mut b[at..at + per], false);
        assert_eq!(pool.held_bytes(), 3 * CHUNK);
        let (a_first, _) = chunks_inside(&a[lo..hi]);
        let a_at = (a_first - a.as_ptr() as usize) / 4;
        // The newest parked chunk was the last of the four `a` gave.
        let from = a_at + 3 * per;
        assert!(
            b[at..at + per]
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (from + i) as f32),
            "the parked pages' contents moved with them"
        );
        let f = faults();
        b[at..at + per].fill(5.0);
        assert_eq!(faults() - f, 0, "resident already");
        // Zeroed on request; the rest of the range stays as it was.
        let (first, _) = chunks_inside(&c);
        let at = (first - c.as_ptr() as usize) / 4;
        c[at + 2 * per..at + 3 * per].fill(7.0);
        pool.refill(&mut c[at..at + 3 * per], true);
        assert_eq!(pool.held_bytes(), 0);
        assert!(c.iter().all(|&x| x == 0.0), "zero-filled chunks");
        // Given back: nothing parked, later releases park again.
        pool.release(&mut b);
        assert_eq!(pool.held_bytes(), 4 * CHUNK);
        pool.give_back();
        assert_eq!(pool.held_bytes(), 0);
        assert!(b.iter().all(|&x| x == 0.0));
        pool.refill(&mut b, true);
        assert!(b.iter().all(|&x| x == 0.0));
        // A pool of no capacity only releases.
        let mut none = SparePages::new(CHUNK - 1);
        a.fill(1.0);
        none.release(&mut a);
        assert_eq!(none.held_bytes(), 0);
        assert!(a.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn released_pages_leave_the_resident_set() {
        let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
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
