//! A server's background tasks, owned so that none outlives the server.

use std::time::Duration;

use tokio::task::JoinHandle;

/// A server's background tasks, the serving task last. Dropping aborts them all.
#[derive(Debug, Default)]
pub struct ServerTasks(pub Vec<JoinHandle<()>>);

impl ServerTasks {
    /// Once the server was told to stop: waits for the serving task (bounded: 10 s), then
    /// aborts the others.
    pub async fn finish(&mut self) {
        if let Some(server) = self.0.pop() {
            let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
        }
        for t in self.0.drain(..) {
            t.abort();
        }
    }
}

impl Drop for ServerTasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}
