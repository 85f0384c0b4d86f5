//! The bulk lane: upstream requests with long bodies (a long prompt's ids, for each half) are
//! sent, and their answers read, on one thread of their own at the kernel's idle priority, the
//! policy the tokenizer pool runs under (`admission::background`). Writing 160 KB of ids to each
//! half of a 128 KiB prompt costs the writing thread about 160 µs of kernel time (loopback TCP
//! does the receiver's work in the sender's context too); on a connection thread that is time a
//! short request waits for a core. Here a short request's work goes first and the long one takes
//! what is left, as its tokenizing does.
//!
//! The lane's connections are made on its own runtime as well (the connector runs there), so all
//! their I/O stays on its thread.

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use http::Uri;

/// Request bodies of at least this many bytes take the bulk lane.
pub(crate) const BULK_BODY_BYTES: usize = 64 << 10;

/// The lane's runtime: one worker thread, `lockstep-bulk`, at idle priority; started on first use
/// and kept for the life of the process (`None` where it could not start: the caller's runtime
/// is used then).
fn runtime() -> Option<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lockstep-bulk")
            .on_thread_start(lockstep_runtime::threads::lower_priority)
            .enable_all()
            .build()
            .inspect_err(|e| {
                tracing::warn!(error = %e, "no bulk upstream thread: long bodies are sent by the connection threads")
            })
            .ok()
    })
    .as_ref()
}

/// Whether the bulk lane has its thread.
pub(crate) fn available() -> bool {
    runtime().is_some()
}

/// Spawns the lane's connection tasks on its runtime.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Executor;

impl<F> hyper::rt::Executor<F> for Executor
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        match runtime() {
            Some(rt) => drop(rt.spawn(fut)),
            None => drop(tokio::spawn(fut)),
        }
    }
}

/// A connector whose connects run on the lane's runtime, so the socket is registered with its
/// I/O driver.
#[derive(Clone, Debug)]
pub(crate) struct OnLane<C>(pub(crate) C);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower::Service<Uri> for OnLane<C>
where
    C: tower::Service<Uri> + Clone + Send + 'static,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let fut = self.0.call(uri);
        let Some(rt) = runtime() else {
            return Box::pin(async move { fut.await.map_err(Into::into) });
        };
        let task = rt.spawn(async move { fut.await.map_err(Into::into) });
        Box::pin(async move {
            task.await
                .map_err(|e| BoxError::from(format!("connect task failed: {e}")))?
        })
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_lane_runs_on_its_own_idle_priority_thread() {
        assert!(super::available());
        let (tx, rx) = tokio::sync::oneshot::channel();
        hyper::rt::Executor::execute(&super::Executor, async move {
            // SAFETY: sched_getscheduler takes a plain integer; `0` is the calling thread.
            #[allow(unsafe_code)]
            let policy = unsafe { libc::sched_getscheduler(0) };
            let _ = tx.send((std::thread::current().name().map(str::to_string), policy));
        });
        let (name, policy) = rx.await.expect("ran");
        assert_eq!(name.as_deref(), Some("lockstep-bulk"));
        assert_eq!(policy, libc::SCHED_IDLE);
    }
}
