//! The response state this process keeps (`[state]`): the database (`lockstep-state`) and the
//! background responses running here, so a cancel can stop one at once and a reader resuming its
//! stream wakes as its events are stored rather than polling.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use lockstep_core::config::StateConfig;
use lockstep_core::error::LockstepError;
use lockstep_state::Store;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

/// Whether responses can be stored here.
#[derive(Debug)]
pub enum ResponseState {
    /// `[state] enabled = false`: nothing is stored; asking for state is a 400.
    Off,
    /// The default SQLite file could not be opened (why): responses that leave `store` out are
    /// not stored, and asking for state is a 503.
    Down(String),
    /// The database is open.
    On(Arc<Stored>),
}

/// How often expired rows are deleted.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// How long a running background response may go without storing anything before the sweep
/// fails it (its replica stopped): far beyond any generation timeout.
const STALLED: Duration = Duration::from_secs(15 * 60);

impl ResponseState {
    /// Opens the database `cfg` names. A configured `url` or `path` that cannot be opened stops
    /// the start; the default file under the user's data directory only turns state off with a
    /// warning (a read-only home must not stop a proxy that is never asked to store).
    pub async fn open(cfg: &StateConfig) -> Result<ResponseState, String> {
        if !cfg.enabled {
            return Ok(ResponseState::Off);
        }
        match Store::open(cfg).await {
            Ok(store) => {
                let store = Arc::new(store);
                store.spawn_sweeper(SWEEP_EVERY, STALLED);
                Ok(ResponseState::On(Arc::new(Stored {
                    store,
                    running: DashMap::new(),
                })))
            }
            Err(e) if cfg.url.trim().is_empty() && cfg.path.is_none() => {
                tracing::warn!(
                    "{e}; responses are not stored (set [state] path or url, or enabled = false)"
                );
                Ok(ResponseState::Down(e))
            }
            Err(e) => Err(e),
        }
    }

    /// The state, for a request that asks for it: 400 when it is off, 503 when it is down.
    pub fn get(&self, param: &str) -> Result<&Arc<Stored>, LockstepError> {
        match self {
            ResponseState::On(s) => Ok(s),
            ResponseState::Off => Err(LockstepError::Unsupported {
                message: format!(
                    "`{param}`: response state is off here (`[state] enabled = false`)"
                ),
                param: Some(param.to_string()),
            }),
            ResponseState::Down(why) => Err(LockstepError::StateUnavailable {
                message: why.clone(),
            }),
        }
    }
}

/// The open database and the background responses running in this process.
#[derive(Debug)]
pub struct Stored {
    /// The database.
    pub store: Arc<Store>,
    running: DashMap<String, Running>,
}

#[derive(Debug)]
struct Running {
    abort: Option<AbortHandle>,
    stored: Arc<Notify>,
}

impl Stored {
    /// Marks background response `id` as running here.
    pub fn start(&self, id: &str) {
        self.running.insert(
            id.to_string(),
            Running {
                abort: None,
                stored: Arc::new(Notify::new()),
            },
        );
    }

    /// The task running `id`, so a cancel can stop it (nothing if it already ended).
    pub fn set_task(&self, id: &str, abort: AbortHandle) {
        if let Some(mut r) = self.running.get_mut(id) {
            r.abort = Some(abort);
        }
    }

    /// Wakes the readers of `id`'s stream: events were stored.
    pub fn stored(&self, id: &str) {
        if let Some(r) = self.running.get(id) {
            r.stored.notify_waiters();
        }
    }

    /// What a reader of `id`'s stream waits on, while it runs here.
    pub fn waiter(&self, id: &str) -> Option<Arc<Notify>> {
        self.running.get(id).map(|r| r.stored.clone())
    }

    /// `id` ended here: its readers wake a last time.
    pub fn ended(&self, id: &str) {
        if let Some((_, r)) = self.running.remove(id) {
            r.stored.notify_waiters();
        }
    }

    /// Stops `id`'s task if it runs here (dropping its pair aborts both halves).
    pub fn stop(&self, id: &str) {
        if let Some((_, r)) = self.running.remove(id) {
            if let Some(a) = r.abort {
                a.abort();
            }
            r.stored.notify_waiters();
        }
    }
}
