//! Signals of a lockstep process: SIGINT and SIGTERM stop it, SIGHUP asks for a reload.

/// SIGTERM and SIGHUP streams, installed before a listener opens so that a signal arriving right
/// after "listening" reaches them, not the default action (`None` where they cannot be installed:
/// then only Ctrl-C stops).
#[derive(Debug)]
pub struct Signals(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

impl Signals {
    /// Installs the handlers.
    pub fn install() -> Signals {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(t), Ok(h)) => Signals(Some((t, h))),
            _ => Signals(None),
        }
    }

    /// Waits for SIGINT or SIGTERM, running `on_hup` at each SIGHUP.
    pub async fn until_stop<F: Future<Output = ()>>(self, mut on_hup: impl FnMut() -> F) {
        let Some((mut term, mut hup)) = self.0 else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => return,
                _ = term.recv() => return,
                _ = hup.recv() => on_hup().await,
            }
        }
    }
}
