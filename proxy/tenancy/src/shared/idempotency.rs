//! `Idempotency-Key` requests coordinated between the replicas through the shared store: a key
//! is claimed by the first replica to see it (`SET NX`, for the window), marked done with the
//! request's fingerprint when its answer ended, and its answer kept beside it for the other
//! replicas to replay when it is small enough. Keys are stored under a hash of the tenant and
//! the key, never the key itself.

use sha2::{Digest, Sha256};

use super::SharedStore;

/// `KEYS[1]`: the key's record, `KEYS[2]`: its answer; `ARGV[1]`: this replica's record,
/// `ARGV[2]`: the window (ms). Claims the key, or returns what another request left there.
const CLAIM: &str = r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {'ours', '', ''}
end
local rec = redis.call('GET', KEYS[1]) or ''
local ans = redis.call('GET', KEYS[2]) or ''
return {'seen', rec, ans}
"#;

/// What the store says of a key.
#[derive(Debug, PartialEq)]
pub enum Claim {
    /// This replica claimed it: run the request.
    Ours,
    /// Another request holds it: its fingerprint, whether it ended, and its answer if kept.
    Seen {
        /// The fingerprint it was claimed with (hex).
        fingerprint: String,
        /// Whether its answer ended.
        done: bool,
        /// Its answer, when kept.
        answer: Option<Vec<u8>>,
    },
}

impl SharedStore {
    fn idem_keys(&self, tenant: &str, key: &str) -> (String, String) {
        let mut h = Sha256::new();
        h.update(tenant.as_bytes());
        h.update([0]);
        h.update(key.as_bytes());
        let id: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let k = format!("{}:idem:{id}", self.cfg.key_prefix);
        (k.clone(), format!("{k}:answer"))
    }

    /// Claims `tenant`'s `key` for a request of `fingerprint` (hex) for `window_ms`.
    pub async fn idem_claim(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        window_ms: u64,
    ) -> Result<Claim, String> {
        let (k, a) = self.idem_keys(tenant, key);
        let script = redis::Script::new(CLAIM);
        let mut inv = script.prepare_invoke();
        inv.key(&k)
            .key(&a)
            .arg(format!("run:{fingerprint}:{}", self.replica))
            .arg(window_ms);
        let (what, rec, ans): (String, String, Vec<u8>) = self.call(inv).await?;
        if what == "ours" {
            return Ok(Claim::Ours);
        }
        let mut parts = rec.splitn(3, ':');
        let state = parts.next().unwrap_or_default();
        let fingerprint = parts.next().unwrap_or_default().to_string();
        Ok(Claim::Seen {
            fingerprint,
            done: state == "done",
            answer: (!ans.is_empty()).then_some(ans),
        })
    }

    /// Marks `tenant`'s `key` done, with its answer when it is kept (for the rest of the window).
    pub async fn idem_done(
        &self,
        tenant: &str,
        key: &str,
        fingerprint: &str,
        answer: Option<&[u8]>,
        window_ms: u64,
    ) -> Result<(), String> {
        let (k, a) = self.idem_keys(tenant, key);
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(&k)
            .arg(format!("done:{fingerprint}"))
            .arg("PX")
            .arg(window_ms)
            .ignore();
        if let Some(bytes) = answer {
            pipe.cmd("SET")
                .arg(&a)
                .arg(bytes)
                .arg("PX")
                .arg(window_ms)
                .ignore();
        }
        self.pipeline(pipe).await
    }

    /// Forgets `tenant`'s `key` (its answer may change on a retry).
    pub async fn idem_release(&self, tenant: &str, key: &str) -> Result<(), String> {
        let (k, a) = self.idem_keys(tenant, key);
        let mut pipe = redis::pipe();
        pipe.cmd("DEL").arg(&k).arg(&a).ignore();
        self.pipeline(pipe).await
    }

    /// Runs `pipe` within `timeout_ms`; a failure marks the store down.
    async fn pipeline(&self, pipe: redis::Pipeline) -> Result<(), String> {
        let mut conn = self.conn.clone();
        let timeout = std::time::Duration::from_millis(self.cfg.timeout_ms);
        let r = match tokio::time::timeout(timeout, pipe.query_async::<()>(&mut conn)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} ms", self.cfg.timeout_ms)),
        };
        match &r {
            Ok(()) => self.mark_up(),
            Err(e) => self.mark_down(e),
        }
        r
    }
}
