//! Connection threads: each accepted connection lives on one of a few threads, each running its
//! own event loop (a tokio current-thread runtime), the way nginx and Envoy place connections on
//! workers. A request is then read, handled, sent upstream (over that thread's own upstream
//! connections, see [`current`]) and answered on one thread: no work-stealing scheduler, no
//! cross-thread wake-ups per request.
//!
//! A new connection goes to the thread with the fewest live connections. HTTP/2 streams (gRPC
//! multiplexes a client's calls on one connection) are not pinned: the accept loop hands them to
//! the shared runtime, so one busy h2 connection still uses every core.

use std::cell::Cell;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Identifies a connection thread process-wide (never reused, never 0).
pub type ThreadKey = u64;

static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static CURRENT: Cell<ThreadKey> = const { Cell::new(0) };
}

/// The connection thread this code runs on, if it runs on one. State that must stay on one
/// thread (an upstream connection pool) is kept per key.
pub fn current() -> Option<ThreadKey> {
    let k = CURRENT.with(Cell::get);
    (k != 0).then_some(k)
}

#[derive(Debug)]
struct ConnThread {
    handle: tokio::runtime::Handle,
    live: Arc<AtomicUsize>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

/// A set of connection threads. Dropping it stops them: whatever still runs on them is dropped,
/// so a server drains (and its connections end) before it drops its threads.
#[derive(Debug)]
pub struct ConnThreads {
    threads: Box<[ConnThread]>,
}

impl ConnThreads {
    /// Starts `n` threads (at least one), named `{name}-{i}`.
    pub fn start(n: usize, name: &str) -> std::io::Result<ConnThreads> {
        Ok(ConnThreads::start_polling(n, name, None)?.0)
    }

    /// Starts `n` threads as [`ConnThreads::start`] does; with `busy_poll`, each polls for up to
    /// that long before it sleeps (see [`crate::busy_poll`]). Also returns how many threads
    /// poll: one whose event loop could not be found to poll runs without.
    pub fn start_polling(
        n: usize,
        name: &str,
        busy_poll: Option<std::time::Duration>,
    ) -> std::io::Result<(ConnThreads, usize)> {
        let mut threads = Vec::new();
        let mut polling = 0;
        for i in 0..n.max(1) {
            let rt = match busy_poll {
                None => tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?,
                Some(budget) => {
                    let (rt, on) = crate::busy_poll::runtime(budget)?;
                    polling += usize::from(on.is_some());
                    rt
                }
            };
            let handle = rt.handle().clone();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    CURRENT.with(|c| c.set(key));
                    // Until the set is dropped (the sender with it).
                    let _ = rt.block_on(stopped);
                    drop(rt);
                })?;
            threads.push(ConnThread {
                handle,
                live: Arc::new(AtomicUsize::new(0)),
                stop: Some(stop),
            });
        }
        Ok((
            ConnThreads {
                threads: threads.into(),
            },
            polling,
        ))
    }

    /// Live connections per thread, in thread order.
    pub fn load(&self) -> Vec<usize> {
        self.threads
            .iter()
            .map(|t| t.live.load(Ordering::Relaxed))
            .collect()
    }

    /// Runs `conn` (one connection's whole life) on the thread with the fewest live
    /// connections; it counts as live there until it ends or is dropped.
    pub fn spawn<F>(&self, conn: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let t = self
            .threads
            .iter()
            .min_by_key(|t| t.live.load(Ordering::Relaxed))
            .unwrap_or_else(|| unreachable!("a set has at least one thread"));
        let live = Live::new(t.live.clone());
        t.handle.spawn(async move {
            let _live = live;
            conn.await;
        });
    }
}

impl Drop for ConnThreads {
    fn drop(&mut self) {
        for t in self.threads.iter_mut() {
            if let Some(s) = t.stop.take() {
                let _ = s.send(());
            }
        }
    }
}

/// One live connection on a thread's count, released however the connection ends.
struct Live(Arc<AtomicUsize>);

impl Live {
    fn new(n: Arc<AtomicUsize>) -> Live {
        n.fetch_add(1, Ordering::Relaxed);
        Live(n)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs futures on a runtime given by handle: the shared runtime, for HTTP/2 streams of a
/// connection that lives on a connection thread.
#[derive(Clone, Debug)]
pub struct OnRuntime(pub tokio::runtime::Handle);

impl<F> hyper::rt::Executor<F> for OnRuntime
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        drop(self.0.spawn(fut));
    }
}

/// The nice value [`lower_priority`] falls back to where `SCHED_IDLE` is refused.
pub const NICE_LOWERED: i32 = 10;

/// Lowers the calling thread's priority to `SCHED_IDLE`, or nice +10 where that is refused, for
/// work that must not take the cores from serving (the router's tokenizer pool and bulk lane).
pub fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler reads `param` only during the call; `pid = 0` is the
        // calling thread (Linux keeps the policy per thread). A failure changes nothing.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        if rc == 0 {
            return;
        }
        let why = std::io::Error::last_os_error();
        // SAFETY: setpriority takes plain integers; `who = 0` is the calling thread.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICE_LOWERED) };
        if rc != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "could not lower a background thread's priority");
        } else {
            tracing::info!(error = %why, "background thread at nice +10: SCHED_IDLE refused");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connections_go_to_the_least_loaded_thread_and_run_on_it() {
        let threads = ConnThreads::start(2, "test-conn").expect("threads");
        assert_eq!(threads.load().len(), 2);
        assert_eq!(
            current(),
            None,
            "the test's own thread is no connection thread"
        );
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut holds = Vec::new();
        for _ in 0..4 {
            let (hold, held) = tokio::sync::oneshot::channel::<()>();
            holds.push(hold);
            let tx = tx.clone();
            threads.spawn(async move {
                let name = std::thread::current().name().map(str::to_owned);
                let _ = tx.send((current(), name));
                let _ = held.await;
            });
        }
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(rx.recv().await.expect("ran"));
        }
        // Two on each: the fewest-live rule alternates while all four are open.
        assert_eq!(threads.load(), vec![2, 2]);
        let keys: std::collections::HashSet<_> = seen.iter().map(|s| s.0).collect();
        assert_eq!(keys.len(), 2, "{seen:?}");
        assert!(keys.iter().all(Option::is_some));
        assert!(
            seen.iter()
                .all(|s| s.1.as_deref().is_some_and(|n| n.starts_with("test-conn-")))
        );
        // A finished connection leaves its thread's count.
        drop(holds.pop());
        for _ in 0..100 {
            if threads.load().iter().sum::<usize>() == 3 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(threads.load().iter().sum::<usize>(), 3);
        // The next one goes to the thread that has fewer.
        let lighter = threads
            .load()
            .iter()
            .position(|&n| n == 1)
            .expect("one thread has one");
        let (tx2, rx2) = tokio::sync::oneshot::channel();
        threads.spawn(async move {
            let _ = tx2.send(current());
            std::future::pending::<()>().await;
        });
        let key = rx2.await.expect("ran");
        assert_eq!(threads.load()[lighter], 2);
        assert!(key.is_some());
    }

    #[tokio::test]
    async fn dropping_the_set_stops_its_threads_and_what_runs_on_them() {
        let threads = ConnThreads::start(1, "test-stop").expect("threads");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        threads.spawn(async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        drop(threads);
        // The pending task was dropped with its runtime: its sender closed.
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), rx).await;
        assert!(matches!(r, Ok(Err(_))), "{r:?}");
    }
}
