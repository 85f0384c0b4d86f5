//! The thread pool long prompts are tokenized on. Its threads run at a lower scheduling
//! priority (nice +10 on Linux), so a short request, tokenized on an async runtime thread, is
//! not made to wait behind a long one's tokenizing for a core: the kernel runs it first, and
//! the long prompts take what the short ones leave.

/// The nice value the pool's threads run at.
pub(crate) const NICE: i32 = 10;

/// A pool of `threads` threads (named `lockstep-tokenize-N`) that lower their own priority.
pub(crate) fn pool(threads: usize) -> std::io::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lockstep-tokenize-{i}"))
        .start_handler(|_| lower_priority())
        .build()
        .map_err(std::io::Error::other)
}

/// Lowers the calling thread's priority (per thread on Linux; elsewhere nothing).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority takes plain integers; `who = 0` is the calling thread (Linux
        // keeps the nice value per thread). A failure leaves the priority as it was.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICE) };
        if rc != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "could not lower the tokenizer threads' priority");
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    fn nice() -> i32 {
        // SAFETY: getpriority takes plain integers; `who = 0` is the calling thread.
        #[allow(unsafe_code)]
        unsafe {
            libc::getpriority(libc::PRIO_PROCESS, 0)
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_pool_runs_below_the_callers_priority() {
        let before = nice();
        let pool = super::pool(2).expect("pool");
        let inside: Vec<i32> = pool.broadcast(|_| nice());
        assert_eq!(inside.len(), 2);
        assert!(inside.iter().all(|n| *n >= super::NICE), "{inside:?}");
        // Work handed to it from outside runs there too, and the caller keeps its priority.
        assert!(pool.install(nice) >= super::NICE);
        assert_eq!(nice(), before);
    }
}
