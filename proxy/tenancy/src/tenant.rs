//! Tenants: API keys (stored as sha256 in the config) map to tenants; each tenant may be limited
//! in models, requests per second (token bucket, `governor`) and concurrent pairs. With no tenant
//! configured lockstep is open (no key needed); with any, every generation request and
//! `/v1/models` needs a known key (`Authorization: Bearer KEY` or `x-api-key: KEY`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use http::HeaderMap;
use sha2::{Digest, Sha256};
use tokio::sync::OwnedSemaphorePermit;

use crate::budget::Limits;
use crate::shared::{Claimed, SharedLimits, SharedStore};
use lockstep_core::config::TenantConfig;
use lockstep_core::error::LockstepError;

/// The secret tenant salts are keyed with: `server.cache_salt_secret` where set (the first
/// router of the process to start sets it; share it between replicas in front of the same
/// workers), else drawn at random once per process.
static SALT_SECRET: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();

/// Sets the salt secret from the configuration (ignored once salts have been derived).
pub fn set_salt_secret(secret: &[u8]) {
    if SALT_SECRET.set(secret.to_vec()).is_err() {
        tracing::debug!("cache salt secret already set in this process");
    }
}

/// The prefix-cache namespace of a tenant (`None`: lockstep runs without tenants): the first 8
/// bytes of an HMAC-SHA256 of its name under the server's secret, so no one who knows a tenant's
/// name (every tenant knows its own) can compute, choose or probe another's namespace.
///
/// The secret never changes once drawn or set, so each thread remembers the salts it derived
/// (a bounded table; past it, salts are derived each time).
pub fn cache_salt(tenant: Option<&str>) -> u64 {
    const REMEMBERED: usize = 4096;
    thread_local! {
        /// The salt without a tenant, and by tenant name.
        static SALTS: std::cell::RefCell<Salts> =
            std::cell::RefCell::new((None, HashMap::new()));
    }
    let secret = SALT_SECRET.get_or_init(|| rand::random::<[u8; 32]>().to_vec());
    SALTS.with_borrow_mut(|(open, named)| match tenant {
        None => *open.get_or_insert_with(|| salt_with(secret, None)),
        Some(t) => {
            if let Some(s) = named.get(t) {
                return *s;
            }
            let s = salt_with(secret, Some(t));
            if named.len() < REMEMBERED {
                named.insert(t.into(), s);
            }
            s
        }
    })
}

/// What a tenant's prefix-cache salt is derived from: its `id` (its name where it has none) and
/// its `cache_epoch`. An id and a name never give the same namespace; epoch 0 of a tenant without
/// an id is its name alone (the namespaces of earlier versions).
pub fn namespace(t: &TenantConfig) -> String {
    let mut key = if t.id.is_empty() {
        t.name.clone()
    } else {
        format!("\0id\0{}", t.id)
    };
    if t.cache_epoch > 0 {
        key.push_str(&format!("\0epoch\0{}", t.cache_epoch));
    }
    key
}

/// A thread's remembered salts: without a tenant, and by tenant name.
type Salts = (Option<u64>, HashMap<Box<str>, u64>);

fn salt_with(secret: &[u8], tenant: Option<&str>) -> u64 {
    use hmac::Mac;
    let mut h = <hmac::Hmac<Sha256> as Mac>::new_from_slice(secret).expect("any key");
    h.update(b"lockstep prefix cache\0");
    if let Some(t) = tenant {
        h.update(b"tenant\0");
        h.update(t.as_bytes());
    }
    let d = h.finalize().into_bytes();
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// The prefix-cache salt of a request's tenant (`None`: the one namespace shared without
/// tenants).
pub fn salt_of(tenant: Option<&Tenant>) -> u64 {
    tenant.map_or_else(|| cache_salt(None), |t| t.salt)
}

/// One tenant and its limits.
pub struct Tenant {
    /// The tenant's name (audit log, errors).
    pub name: Arc<str>,
    /// Its prefix-cache namespace ([`cache_salt`] of its [`namespace`]).
    pub salt: u64,
    models: Option<HashSet<String>>,
    /// Its limits enforced in this process (kept by a reload that does not change them).
    pub limits: Arc<Limits>,
    /// Its limits shared with the other replicas (`[shared]`): then these decide, and
    /// [`Tenant::limits`] is not used.
    pub shared: Option<Arc<SharedLimits>>,
    /// Its share when requests wait for a slot (`weight`, at least 1).
    pub weight: u32,
    /// Its priority band when requests wait for a slot.
    pub priority: i32,
}

/// What a request holds of its tenant's limits while its answer lives: its concurrent-pair slot
/// and its token reservation (settled on what was delivered when it drops), in this process or
/// in the store the replicas share.
#[derive(Debug, Default)]
pub struct Held {
    /// The concurrent-pair slot.
    pub slot: Option<OwnedSemaphorePermit>,
    /// The token reservation.
    pub tokens: Option<crate::budget::Reservation>,
    /// The slot and reservation in the shared store.
    pub claim: Option<crate::shared::Claim>,
    /// Tokens to reserve in the shared store ([`Held::claim_shared`]).
    pub want_tokens: u64,
    /// The prompt's tokens, spent once the pair committed.
    prompt: u64,
}

impl Held {
    /// A concurrent-pair slot, nothing reserved yet.
    pub fn with_slot(slot: Option<OwnedSemaphorePermit>) -> Held {
        Held {
            slot,
            ..Held::default()
        }
    }

    /// Reserves `tokens` (the exact prompt and `max_tokens`) of `tenant`'s token budget: in this
    /// process now, or, where the limits are shared, checked and noted for
    /// [`Held::claim_shared`].
    pub fn reserve(&mut self, tenant: &Tenant, tokens: u64) -> Result<(), LockstepError> {
        if let Some(b) = tenant.local_tokens() {
            self.tokens = Some(b.reserve(tokens, &tenant.name)?);
        } else if let Some(s) = &tenant.shared {
            self.want_tokens = s.check_fits(tokens)?;
        }
        Ok(())
    }

    /// What one more choice of a request (`n` > 1) holds: one more request against the tenant's
    /// rate, one more concurrent slot and its own token reservation, as if sent on its own.
    pub fn another(tenant: Option<&Tenant>, tokens: u64) -> Result<Held, LockstepError> {
        let Some(t) = tenant else {
            return Ok(Held::default());
        };
        let mut h = Held::with_slot(t.take_permit()?);
        h.reserve(t, tokens)?;
        Ok(h)
    }

    /// The pair committed: its prompt's tokens are spent.
    pub fn committed(&mut self, prompt_tokens: u64) {
        self.prompt = prompt_tokens;
        self.spent(prompt_tokens);
    }

    /// `completion` tokens delivered so far.
    pub fn delivered(&self, completion: u64) {
        self.spent(self.prompt + completion);
    }

    fn spent(&self, total: u64) {
        if let Some(r) = &self.tokens {
            r.spent(total);
        }
        if let Some(c) = &self.claim {
            c.spent(total);
        }
    }

    /// Where the tenant's limits are shared (`[shared]`): takes its request, its concurrent
    /// slot and [`Held::want_tokens`] from the shared store in one step (or, the store gone, as
    /// `on_unavailable` says).
    pub async fn claim_shared(&mut self, tenant: &Tenant) -> Result<(), LockstepError> {
        let Some(shared) = &tenant.shared else {
            return Ok(());
        };
        match shared.claim(self.want_tokens).await? {
            Claimed::Store(c) => self.claim = Some(c),
            Claimed::Local { slot, tokens } => {
                self.slot = slot;
                self.tokens = tokens;
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The configured tenants by key hash.
#[derive(Debug, Default)]
pub struct Tenants {
    by_key: HashMap<[u8; 32], Arc<Tenant>>,
    /// The store the replicas share limits through (`[shared]`).
    shared: Option<Arc<SharedStore>>,
}

/// A key's sha256 as configured (lowercase hex).
pub fn key_hash_hex(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// 64 hex digits → 32 bytes.
pub fn parse_sha256_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Tenants {
    /// Builds the tenants of a validated configuration (invalid hashes were refused by `check`).
    pub fn new(cfg: &[TenantConfig]) -> Tenants {
        Tenants::default().reloaded(cfg)
    }

    /// [`Tenants::new`] with limits shared through `store`.
    pub fn shared(cfg: &[TenantConfig], store: Option<Arc<SharedStore>>) -> Tenants {
        Tenants {
            by_key: HashMap::new(),
            shared: store,
        }
        .reloaded(cfg)
    }

    /// The tenants of a reloaded configuration: a tenant whose limits did not change keeps its
    /// spent rate budget and its running pairs' slots (a reload is not a way around a limit);
    /// new or changed limits start fresh.
    pub fn reloaded(&self, cfg: &[TenantConfig]) -> Tenants {
        let old: HashMap<&str, &Arc<Tenant>> =
            self.by_key.values().map(|t| (&*t.name, t)).collect();
        let mut by_key = HashMap::new();
        for t in cfg {
            let spec = (
                t.requests_per_second,
                t.burst,
                t.max_concurrent_pairs,
                t.tokens_per_minute,
            );
            let limits = old
                .get(t.name.as_str())
                .filter(|o| o.limits.spec() == spec)
                .map_or_else(|| Arc::new(Limits::new(spec)), |o| o.limits.clone());
            // A tenant without limits has nothing to share.
            let limited = spec != (0, 0, 0, 0);
            let shared = self.shared.as_ref().filter(|_| limited).map(|store| {
                let key = if t.id.is_empty() { &t.name } else { &t.id };
                SharedLimits::new(store, key, &t.name, spec)
            });
            let tenant = Arc::new(Tenant {
                name: t.name.as_str().into(),
                salt: cache_salt(Some(&namespace(t))),
                models: (!t.models.iter().any(|m| m == "*"))
                    .then(|| t.models.iter().cloned().collect()),
                limits,
                shared,
                weight: t.weight.max(1),
                priority: t.priority,
            });
            for h in &t.api_keys_sha256 {
                if let Some(k) = parse_sha256_hex(h) {
                    by_key.insert(k, tenant.clone());
                }
            }
        }
        Tenants {
            by_key,
            shared: self.shared.clone(),
        }
    }

    /// The `[shared]` settings of the store in use (a reload does not change them).
    pub fn shared_config(&self) -> Option<&lockstep_core::config::SharedConfig> {
        self.shared.as_deref().map(SharedStore::config)
    }

    /// The store the replicas share (`[shared]`), if any.
    pub fn shared_store(&self) -> Option<Arc<SharedStore>> {
        self.shared.clone()
    }

    /// Whether keys are required (any tenant configured).
    pub fn required(&self) -> bool {
        !self.by_key.is_empty()
    }

    /// The request's tenant: `None` when lockstep is open; 401 for a missing or unknown key.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Arc<Tenant>>, LockstepError> {
        if !self.required() {
            return Ok(None);
        }
        let key = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim)
            .filter(|k| !k.is_empty());
        let Some(key) = key else {
            return Err(LockstepError::Unauthorized {
                message: "an API key is required (Authorization: Bearer KEY)".into(),
            });
        };
        let hash: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        self.by_key
            .get(&hash)
            .cloned()
            .map(Some)
            .ok_or_else(|| LockstepError::Unauthorized {
                message: "invalid API key".into(),
            })
    }
}

impl Tenant {
    /// The `x-ratelimit-*` headers of an answer to this tenant (OpenAI's names): the token trio
    /// where `tokens_per_minute` is set, the request trio where `requests_per_second` is; from
    /// the shared store where the limits are shared.
    pub fn rate_headers(&self) -> Vec<(&'static str, String)> {
        match &self.shared {
            Some(s) => s.rate_headers(),
            None => self.limits.rate_headers(),
        }
    }

    /// The token budget in this process, where one is set and the limits are not shared.
    pub fn local_tokens(&self) -> Option<&Arc<crate::budget::TokenBudget>> {
        self.limits
            .tokens
            .as_ref()
            .filter(|_| self.shared.is_none())
    }

    /// Whether this tenant may use `model`.
    pub fn allows(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.contains(model))
    }

    /// 403 unless this tenant may use `model`.
    pub fn check_model(&self, model: &str) -> Result<(), LockstepError> {
        if self.allows(model) {
            Ok(())
        } else {
            Err(LockstepError::ModelNotAllowed {
                model: model.to_string(),
            })
        }
    }

    /// Takes one request from the rate budget and one concurrent-pair slot (held by the returned
    /// permit until the response ends), or 429 with when to retry. Where the limits are shared
    /// nothing is taken here: [`Held::claim_shared`] takes it all once the prompt is known.
    pub fn take_permit(&self) -> Result<Option<OwnedSemaphorePermit>, LockstepError> {
        if self.shared.is_some() {
            return Ok(None);
        }
        self.limits.take_permit(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salts_are_keyed_by_the_server_secret() {
        let (a, b) = (
            salt_with(b"one", Some("acme")),
            salt_with(b"two", Some("acme")),
        );
        assert_ne!(a, b, "the name alone does not decide the salt");
        assert_ne!(salt_with(b"one", Some("other")), a);
        assert_ne!(salt_with(b"one", None), a);
        assert_eq!(salt_with(b"one", Some("acme")), a, "stable for one secret");
        // The unkeyed derivation of earlier versions, which anyone could compute.
        let mut h = Sha256::new();
        h.update(b"lockstep prefix cache\0tenant\0acme");
        let d = h.finalize();
        let unkeyed = u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
        assert_ne!(cache_salt(Some("acme")), unkeyed);
    }

    /// A tenant's namespace follows its id and epoch, not its name (second security review,
    /// finding 7): renamed, it keeps its salt; a newcomer given a freed name does not get it;
    /// an epoch bump starts afresh.
    #[test]
    fn salts_follow_the_stable_id_and_epoch_not_the_name() {
        let salt = |name: &str, id: &str, epoch: u32| {
            let key = format!("{name}-{id}-{epoch}");
            let c = TenantConfig {
                id: id.into(),
                cache_epoch: epoch,
                ..cfg(name, &key)
            };
            Tenants::new(&[c])
                .authenticate(&bearer(&key))
                .expect("known")
                .expect("a tenant")
                .salt
        };
        let acme = salt("acme", "t-1", 0);
        assert_eq!(salt("acme-corp", "t-1", 0), acme, "renamed: same namespace");
        assert_ne!(
            salt("acme", "t-2", 0),
            acme,
            "a reused name: another namespace"
        );
        assert_ne!(
            salt("acme", "t-1", 1),
            acme,
            "a new epoch: another namespace"
        );
        // Without an id: the name (as before), and an id equal to a name is not that name.
        assert_eq!(salt("acme", "", 0), cache_salt(Some("acme")));
        assert_ne!(salt("bob", "acme", 0), salt("acme", "", 0));
    }

    fn cfg(name: &str, key: &str) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            api_keys_sha256: vec![key_hash_hex(key)],
            ..TenantConfig::default()
        }
    }

    fn bearer(k: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {k}").parse().expect("header"),
        );
        h
    }

    #[test]
    fn keys_map_to_tenants_and_unknown_or_missing_keys_are_refused() {
        assert!(
            Tenants::new(&[])
                .authenticate(&HeaderMap::new())
                .expect("open")
                .is_none()
        );
        let t = Tenants::new(&[cfg("a", "ka"), cfg("b", "kb")]);
        assert_eq!(
            &*t.authenticate(&bearer("kb"))
                .expect("ok")
                .expect("tenant")
                .name,
            "b"
        );
        let mut x = HeaderMap::new();
        x.insert("x-api-key", "ka".parse().expect("header"));
        assert_eq!(&*t.authenticate(&x).expect("ok").expect("tenant").name, "a");
        for h in [HeaderMap::new(), bearer("kc"), bearer("")] {
            let e = t.authenticate(&h).expect_err("refused");
            assert_eq!((e.status().as_u16(), e.code()), (401, "invalid_api_key"));
        }
    }

    #[test]
    fn rate_and_concurrency_limits_refuse_with_a_retry_hint() {
        let t = Tenants::new(&[TenantConfig {
            requests_per_second: 1,
            burst: 2,
            max_concurrent_pairs: 1,
            models: vec!["m".into()],
            ..cfg("a", "k")
        }]);
        let a = t.authenticate(&bearer("k")).expect("ok").expect("tenant");
        assert!(a.check_model("m").is_ok());
        assert_eq!(
            a.check_model("other").expect_err("403").status().as_u16(),
            403
        );
        let first = a.take_permit().expect("first").expect("permit");
        // Second: rate allows (burst 2) but the one concurrent slot is taken.
        let e = a.take_permit().expect_err("concurrency");
        assert_eq!(
            (e.status().as_u16(), e.code()),
            (429, "rate_limit_exceeded")
        );
        drop(first);
        // Third: the burst is spent.
        let e = a.take_permit().expect_err("rate");
        assert!(
            matches!(
                e,
                LockstepError::RateLimited {
                    retry_after_s: 1,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn a_reload_keeps_spent_limits_unless_they_changed() {
        let limited = |rps| TenantConfig {
            requests_per_second: rps,
            burst: 1,
            max_concurrent_pairs: 1,
            ..cfg("a", "k")
        };
        let t = Tenants::new(&[limited(1)]);
        let a = t.authenticate(&bearer("k")).expect("ok").expect("tenant");
        let running = a.take_permit().expect("first").expect("permit");
        // Same limits: the spent budget and the running pair's slot carry over.
        let t2 = t.reloaded(&[limited(1)]);
        let a2 = t2.authenticate(&bearer("k")).expect("ok").expect("tenant");
        assert!(
            a2.take_permit().is_err(),
            "a reload is not a way around a limit"
        );
        drop(running);
        assert!(a2.take_permit().is_err(), "the rate budget is still spent");
        // Changed limits start fresh.
        let t3 = t2.reloaded(&[limited(5)]);
        let a3 = t3.authenticate(&bearer("k")).expect("ok").expect("tenant");
        assert!(a3.take_permit().is_ok());
    }
}
