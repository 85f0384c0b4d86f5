//! lockstep's stored state: the Responses API's stored responses (chained with
//! `previous_response_id`, run in the background, their streams resumable) and the Conversations
//! API's conversations and items.
//!
//! One database through sqlx's driver-agnostic pool: SQLite in a file by default (no setup),
//! Postgres for replicas that share it (`[state] url`). The schema is migrated at start from
//! the migrations embedded here (one portable SQL file serves both). Every row carries the
//! tenant that owns it and every read and write filters on it, so a tenant never reads, lists,
//! cancels or deletes another's object: an id of another tenant is answered as one that does
//! not exist. Ids carry 192 random bits. Every call is bounded by `[state] timeout_ms`; a
//! database that cannot be reached or fails is [`LockstepError::StateUnavailable`] (503), never
//! an answer made up without it.

mod conversations;
mod responses;

pub use conversations::{Conversation, ItemPage};
pub use responses::{Event, Finish, NewResponse, StoredResponse};

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::config::StateConfig;
use lockstep_core::error::LockstepError;
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;
use sqlx::migrate::{Migration, MigrationType, Migrator};

/// The migrations, in order (the same SQL for SQLite and Postgres).
const MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "responses and conversations",
    include_str!("../migrations/0001_responses_and_conversations.sql"),
)];

/// Statuses of a response still being generated (a background one).
const RUNNING: [&str; 2] = ["queued", "in_progress"];

/// The database of stored responses and conversations.
#[derive(Debug)]
pub struct Store {
    pool: AnyPool,
    timeout: Duration,
    retention: Option<Duration>,
    /// `sqlite` or `postgres`.
    backend: &'static str,
}

/// `LockstepError::StateUnavailable` for a failure of `what`.
fn unavailable(what: &str, e: impl std::fmt::Display) -> LockstepError {
    LockstepError::StateUnavailable {
        message: format!("the response state database failed ({what}): {e}"),
    }
}

/// Seconds since the epoch.
pub fn now_s() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    )
    .unwrap_or(i64::MAX)
}

fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis()),
    )
    .unwrap_or(i64::MAX)
}

/// A new id: `prefix`, `_`, 48 hex digits (192 random bits).
pub fn new_id(prefix: &str) -> String {
    use rand::RngCore;
    let mut b = [0u8; 24];
    rand::rng().fill_bytes(&mut b);
    let mut s = String::with_capacity(prefix.len() + 49);
    s.push_str(prefix);
    s.push('_');
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

impl Store {
    /// Opens the database `cfg` names (creating a SQLite file and its directory if needed) and
    /// migrates it. Several replicas (or processes on one SQLite file) may start at once: a
    /// migration that loses the race is tried again and finds the schema in place.
    pub async fn open(cfg: &StateConfig) -> Result<Store, String> {
        sqlx::any::install_default_drivers();
        let url = cfg.database_url();
        let backend = if url.starts_with("sqlite:") {
            let path = match cfg.url.trim() {
                "" => cfg.sqlite_path(),
                u => std::path::PathBuf::from(u.trim_start_matches("sqlite://")),
            };
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .map_err(|e| format!("state: cannot create {}: {e}", dir.display()))?;
            }
            "sqlite"
        } else {
            "postgres"
        };
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let pool = AnyPoolOptions::new()
            .max_connections(cfg.max_connections)
            .acquire_timeout(timeout)
            .connect(&url)
            .await
            .map_err(|e| format!("state: cannot open the {backend} database: {e}"))?;
        let store = Store {
            pool,
            timeout,
            retention: (cfg.retention_secs > 0).then(|| Duration::from_secs(cfg.retention_secs)),
            backend,
        };
        store.migrate().await?;
        tracing::info!(backend, "response state: database ready");
        Ok(store)
    }

    async fn migrate(&self) -> Result<(), String> {
        let migrations = MIGRATIONS
            .iter()
            .map(|(v, d, sql)| {
                Migration::new(
                    *v,
                    Cow::Borrowed(*d),
                    MigrationType::Simple,
                    sqlx::SqlSafeStr::into_sql_str(*sql),
                    false,
                )
            })
            .collect();
        let migrator = Migrator::with_migrations(migrations);
        let mut last = String::new();
        for attempt in 0..5u64 {
            match migrator.run(&self.pool).await {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(50 * (attempt + 1))).await;
        }
        Err(format!(
            "state: cannot migrate the {} database: {last}",
            self.backend
        ))
    }

    /// `sqlite` or `postgres`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// When an object created now expires (unix seconds; `None`: kept until deleted).
    fn expires_at(&self, created: i64) -> Option<i64> {
        self.retention
            .map(|r| created.saturating_add(i64::try_from(r.as_secs()).unwrap_or(i64::MAX)))
    }

    /// Runs one call within the timeout, mapping every failure to `StateUnavailable`.
    async fn call<T, F>(&self, what: &str, f: F) -> Result<T, LockstepError>
    where
        F: Future<Output = Result<T, sqlx::Error>>,
    {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(unavailable(what, e)),
            Err(_) => Err(unavailable(
                what,
                format!("no answer within {} ms", self.timeout.as_millis()),
            )),
        }
    }

    /// Deletes a tenant's row (`owned`: the `DELETE` of it by id `$1`, tenant `$2`, and not
    /// expired at `$3`) and then the rows that belong to it (`children`: by id `$1`), in one
    /// transaction (`false`: none of the tenant's own by that id, and nothing deleted).
    async fn delete_owned(
        &self,
        what: &str,
        owned: &'static str,
        children: &'static str,
        tenant: &str,
        id: &str,
    ) -> Result<bool, LockstepError> {
        let work = async {
            let mut tx = self.pool.begin().await?;
            let n = sqlx::query(owned)
                .bind(id)
                .bind(tenant)
                .bind(now_s())
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if n == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            sqlx::query(children).bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(true)
        };
        self.call(what, work).await
    }

    /// Deletes what expired (its retention passed) and fails background responses that have not
    /// moved for `stale` (their replica died): the number of rows deleted.
    pub async fn sweep(&self, stale: Duration) -> Result<u64, LockstepError> {
        let now = now_s();
        let mut n = 0;
        for sql in [
            "DELETE FROM response_events WHERE response_id IN (SELECT id FROM responses WHERE expires_at IS NOT NULL AND expires_at <= $1)",
            "DELETE FROM responses WHERE expires_at IS NOT NULL AND expires_at <= $1",
            "DELETE FROM conversation_items WHERE conversation_id IN (SELECT id FROM conversations WHERE expires_at IS NOT NULL AND expires_at <= $1)",
            "DELETE FROM conversations WHERE expires_at IS NOT NULL AND expires_at <= $1",
        ] {
            let r = self
                .call("sweep", sqlx::query(sql).bind(now).execute(&self.pool))
                .await?;
            n += r.rows_affected();
        }
        let before = now_ms().saturating_sub(i64::try_from(stale.as_millis()).unwrap_or(0));
        self.fail_stale(before).await?;
        Ok(n)
    }

    /// Sweeps every `every` until the store is dropped.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration, stale: Duration) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(store) = weak.upgrade() else { return };
                match store.sweep(stale).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(rows = n, "response state: expired rows deleted"),
                    Err(e) => tracing::warn!("response state: sweep failed: {e}"),
                }
            }
        });
    }
}
