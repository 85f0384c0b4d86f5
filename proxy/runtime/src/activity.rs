//! What is in flight on one connection, for the accept loop's idle timeout: a request counts
//! from the moment it reaches the service until its response body is dropped (finished,
//! failed or abandoned), so a long SSE stream keeps its connection busy.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use http_body_util::BodyExt;

/// One connection's requests in flight and when the last one ended. Nothing here wakes the
/// connection's task per request: the idle check sleeps and re-reads, so a busy connection pays
/// two atomic adds and a store per request.
pub(crate) struct Activity {
    active: AtomicUsize,
    /// When the last request ended (or the connection opened), in ms since `epoch`.
    last_ms: AtomicU64,
    epoch: Instant,
}

impl Activity {
    pub(crate) fn new() -> Activity {
        Activity {
            active: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn enter(self: &Arc<Self>) -> InFlight {
        self.active.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Resolves once nothing has been in flight for `idle`: between `idle` and twice `idle`
    /// after the last request ended when one was in flight at a check, exactly `idle` after it
    /// otherwise.
    pub(crate) async fn idle_for(&self, idle: Duration) {
        let idle_ms = idle.as_millis().max(1) as u64;
        loop {
            if self.active.load(Ordering::SeqCst) == 0 {
                let since = self
                    .now_ms()
                    .saturating_sub(self.last_ms.load(Ordering::SeqCst));
                if since >= idle_ms {
                    // Re-read: a request may have started while we looked.
                    if self.active.load(Ordering::SeqCst) == 0 {
                        return;
                    }
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(idle_ms - since)).await;
            } else {
                tokio::time::sleep(idle).await;
            }
        }
    }
}

/// One request in flight; dropping it ends it.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.last_ms.store(self.0.now_ms(), Ordering::SeqCst);
        self.0.active.fetch_sub(1, Ordering::SeqCst);
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
