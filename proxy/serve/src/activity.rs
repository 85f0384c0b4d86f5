//! What is in flight on one connection, for the accept loop's idle timeout: a request counts
//! from the moment it reaches the service until its response body is dropped (finished,
//! failed or abandoned), so a long SSE stream keeps its connection busy.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use http_body_util::BodyExt;
use tokio::sync::Notify;

/// One connection's requests in flight and when the last one ended.
pub(crate) struct Activity {
    active: AtomicUsize,
    last: Mutex<Instant>,
    changed: Notify,
}

impl Activity {
    pub(crate) fn new() -> Activity {
        Activity {
            active: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
            changed: Notify::new(),
        }
    }

    fn enter(self: &Arc<Self>) -> InFlight {
        self.active.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
        InFlight(self.clone())
    }

    fn last(&self) -> Instant {
        *self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves once nothing has been in flight for `idle`.
    pub(crate) async fn idle_for(&self, idle: Duration) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so a change between the check and the wait is seen.
            changed.as_mut().enable();
            if self.active.load(Ordering::SeqCst) == 0 {
                let since = self.last().elapsed();
                if since >= idle {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(idle - since) => {}
                    _ = changed => {}
                }
            } else {
                changed.await;
            }
        }
    }
}

/// One request in flight; dropping it ends it.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.0.active.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// `inner` with every request and its response body counted in `activity`.
#[derive(Clone)]
pub(crate) struct Tracked {
    inner: axum::Router,
    activity: Arc<Activity>,
}

impl Tracked {
    pub(crate) fn new(inner: axum::Router, activity: Arc<Activity>) -> Tracked {
        Tracked { inner, activity }
    }
}

impl<B> tower::Service<http::Request<B>> for Tracked
where
    B: axum::body::HttpBody<Data = axum::body::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        tower::Service::<http::Request<B>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let held = self.activity.enter();
        let fut = tower::Service::call(&mut self.inner, req);
        Box::pin(async move {
            let res = fut.await?;
            Ok(res.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _held = &held;
                    frame
                }))
            }))
        })
    }
}
