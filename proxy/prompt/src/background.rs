//! The thread pool long prompts are tokenized on. Its threads run under the kernel's idle
//! scheduling policy (`SCHED_IDLE` on Linux), so a short request, tokenized on a connection
//! thread, never waits behind a long one's tokenizing for a core: any normal thread that wakes
//! preempts an idle-policy one at once, where a niced thread may keep its core until its slice
//! ends (nice +10 measured short requests' p99 at 4-5x unloaded while 128 KiB prompts
//! tokenized, `bench/long_prompts.sh`). The long prompts take what the short ones leave; on a
//! machine saturated by short requests they wait, bounded by the admission slots and the
//! request deadlines. Where the policy cannot be set, the threads fall back to nice +10.

use std::sync::Arc;

use tokio::sync::Semaphore;

use lockstep_core::error::LockstepError;

/// A pool of `threads` threads (named `lockstep-tokenize-N`) that lower their own priority.
/// Each thread registers for the placement of chunked encodes' helpers
/// ([`super::placement`]).
pub fn threads(threads: usize) -> std::io::Result<rayon::ThreadPool> {
    let siblings = super::placement::Siblings::new(threads);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lockstep-tokenize-{i}"))
        .start_handler(move |i| {
            lockstep_runtime::threads::lower_priority();
            super::placement::register(&siblings, i);
        })
        .build()
        .map_err(std::io::Error::other)
}

/// Runs `work` on `pool` once one of `slots` is free. The job goes straight to a pool thread and
/// its result straight back to the waiting task (no blocking-pool thread in between: each hop
/// is a thread wake-up, tens of µs on a busy VM). A panic in `work` is an error, not a lost
/// process; the slot is given back either way.
pub async fn run<T: Send + 'static>(
    slots: &Arc<Semaphore>,
    pool: &rayon::ThreadPool,
    work: impl FnOnce() -> Result<T, LockstepError> + Send + 'static,
) -> Result<T, LockstepError> {
    let slot = slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| LockstepError::Unavailable {
            message: "lockstep is shutting down".into(),
        })?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    pool.spawn(move || {
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        // The slot is free before the waiting task hears back.
        drop(slot);
        // The request may be gone (its client left): the answer then has nobody to go to.
        let _ = tx.send(done);
    });
    match rx.await {
        Ok(Ok(done)) => done,
        Ok(Err(panic)) => Err(LockstepError::Unavailable {
            message: format!("background task failed: {}", panic_message(&*panic)),
        }),
        Err(_) => Err(LockstepError::Unavailable {
            message: "background task failed: the pool dropped it".into(),
        }),
    }
}

/// The text of a caught panic's payload.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use lockstep_core::error::LockstepError;

    #[tokio::test]
    async fn work_runs_on_the_pool_and_a_panic_comes_back_as_an_error() {
        let pool = super::threads(2).expect("pool");
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        let name = super::run(&slots, &pool, || {
            Ok(std::thread::current().name().map(str::to_string))
        })
        .await
        .expect("runs");
        assert_eq!(
            name.as_deref().map(|n| n.starts_with("lockstep-tokenize-")),
            Some(true)
        );
        let e = super::run(&slots, &pool, || -> Result<(), LockstepError> {
            panic!("the tokenizer broke")
        })
        .await
        .expect_err("a panic is an error");
        assert!(
            matches!(&e, LockstepError::Unavailable { message } if message.contains("the tokenizer broke")),
            "{e:?}"
        );
        // The slot came back both times, and the pool still works.
        assert_eq!(slots.available_permits(), 1);
        assert_eq!(super::run(&slots, &pool, || Ok(7)).await.expect("runs"), 7);
    }

    #[cfg(target_os = "linux")]
    fn nice() -> i32 {
        // SAFETY: getpriority takes plain integers; `who = 0` is the calling thread.
        #[allow(unsafe_code)]
        unsafe {
            libc::getpriority(libc::PRIO_PROCESS, 0)
        }
    }

    #[cfg(target_os = "linux")]
    fn policy() -> i32 {
        // SAFETY: sched_getscheduler takes a plain integer; `0` is the calling thread.
        #[allow(unsafe_code)]
        unsafe {
            libc::sched_getscheduler(0)
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_pool_runs_below_the_callers_priority() {
        let (before, before_policy) = (nice(), policy());
        let pool = super::threads(2).expect("pool");
        let inside: Vec<i32> = pool.broadcast(|_| policy());
        // Linux lets any thread move itself to the idle policy (no privilege needed), so the
        // nice fallback is not accepted here.
        assert_eq!(inside, vec![libc::SCHED_IDLE; 2]);
        // Work handed to it from outside runs there too, and the caller keeps its priority.
        assert_eq!(pool.install(policy), libc::SCHED_IDLE);
        assert_eq!((nice(), policy()), (before, before_policy));
        assert_ne!(before_policy, libc::SCHED_IDLE);
    }
}
