//! Process-wide memory settings, applied once at start.
//!
//! **No transparent huge pages.** mimalloc asks the kernel for huge pages on its arenas
//! (`madvise(MADV_HUGEPAGE)`), so each first touch of a fresh 2 MiB range zeroes all of it. A
//! router's large buffers are short-lived (a long prompt's body, its text, its ids: a few hundred
//! KB to a few MB per request) and land on fresh ranges again and again: on this project's
//! 2-core VM, zeroing pages was a quarter of lockstep's CPU time for a 128 KiB prompt. With huge
//! pages off, a unique 128 KiB prompt costs lockstep about 20% less CPU and a 1 MiB one about 25%
//! less (`bench/RESULTS.md`), and the short-request path measured the same. The embedded engine's
//! own benchmark (`bench_model`, on the system allocator) never had huge pages either.

/// Turns transparent huge pages off for this process (Linux `PR_SET_THP_DISABLE`; later faults
/// get normal pages, whatever the allocator advised). Returns whether they are off now; on other
/// systems, or where the kernel refuses, nothing changes.
pub fn no_huge_pages() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl with these integer arguments reads and writes no memory of ours.
        #[allow(unsafe_code)]
        let set = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        if set != 0 {
            return false;
        }
        // SAFETY: as above.
        #[allow(unsafe_code)]
        unsafe {
            libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn huge_pages_are_off_for_the_process_afterwards() {
        assert!(super::no_huge_pages());
        // What the kernel reports for the process.
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let line = status
            .lines()
            .find(|l| l.starts_with("THP_enabled:"))
            .expect("the kernel reports THP_enabled");
        assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
    }
}
