//! Token budgets per tenant (`tenants[].tokens_per_minute`, prompt + completion tokens). What
//! operators sell is tokens, and a limit that concurrent requests can overshoot is no limit: at
//! admission a request reserves its exact prompt count (lockstep has tokenized it) plus its
//! `max_tokens`, so requests in flight together can never spend more than the budget; when its
//! answer ends the reservation is settled on what was delivered (the prompt once the pair
//! committed, plus the completion tokens the client got) and the rest returns to the budget.
//!
//! The budget is a bucket of `tokens_per_minute` tokens refilled continuously (a full bucket a
//! minute). A request that does not fit gets 429 `rate_limited` with `Retry-After`: the seconds
//! until it would (one that can never fit, larger than the whole budget, says so).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::{Quota, RateLimiter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use lockstep_core::error::LockstepError;

/// A tenant's limits as configured: requests per second, burst, concurrent pairs, tokens per
/// minute (0: unlimited).
pub type LimitSpec = (u32, u32, u32, u64);

/// A request-rate limiter; each check reports what is left of the burst.
type Limiter = RateLimiter<
    governor::state::NotKeyed,
    governor::state::InMemoryState,
    DefaultClock,
    StateInformationMiddleware,
>;

/// One tenant's limits enforced in this process: the request rate (token bucket, `governor`),
/// the concurrent pairs (a semaphore) and the token budget.
#[derive(Debug)]
pub struct Limits {
    spec: LimitSpec,
    limiter: Option<Limiter>,
    concurrency: Option<Arc<Semaphore>>,
    /// The token budget (`tokens_per_minute`).
    pub tokens: Option<Arc<TokenBudget>>,
    /// Requests the rate limiter would still let through at once, as of the latest request
    /// (`x-ratelimit-remaining-requests`).
    requests_left: AtomicU32,
}

impl Limits {
    /// Fresh limits of `spec`.
    pub fn new(spec: LimitSpec) -> Limits {
        let (rps, burst, pairs, tpm) = spec;
        Limits {
            spec,
            limiter: NonZeroU32::new(rps).map(|r| {
                let burst = NonZeroU32::new(burst).unwrap_or(r);
                RateLimiter::direct(Quota::per_second(r).allow_burst(burst))
                    .with_middleware::<StateInformationMiddleware>()
            }),
            concurrency: (pairs > 0).then(|| Arc::new(Semaphore::new(pairs as usize))),
            tokens: (tpm > 0).then(|| TokenBudget::new(tpm)),
            requests_left: AtomicU32::new(burst.max(rps)),
        }
    }

    /// The limits as configured.
    pub fn spec(&self) -> LimitSpec {
        self.spec
    }

    /// Takes one request from the rate budget and one concurrent-pair slot (held by the returned
    /// permit until the response ends), or 429 with when to retry.
    pub fn take_permit(&self, tenant: &str) -> Result<Option<OwnedSemaphorePermit>, LockstepError> {
        if let Some(l) = &self.limiter {
            match l.check() {
                // What is left at once, for `x-ratelimit-remaining-requests`.
                Ok(snapshot) => self
                    .requests_left
                    .store(snapshot.remaining_burst_capacity(), Ordering::Relaxed),
                Err(not_until) => {
                    self.requests_left.store(0, Ordering::Relaxed);
                    let wait = not_until.wait_time_from(DefaultClock::default().now());
                    return Err(LockstepError::RateLimited {
                        message: format!("tenant `{tenant}`: request rate limit reached"),
                        retry_after_s: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
                    });
                }
            }
        }
        let Some(sem) = &self.concurrency else {
            return Ok(None);
        };
        sem.clone()
            .try_acquire_owned()
            .map(Some)
            .map_err(|_| LockstepError::RateLimited {
                message: format!(
                    "tenant `{tenant}`: {} concurrent requests already running",
                    self.spec.2
                ),
                retry_after_s: 1,
            })
    }

    /// The `x-ratelimit-*` headers of an answer under these limits (OpenAI's names): the token
    /// trio where `tokens_per_minute` is set, the request trio where `requests_per_second` is.
    pub fn rate_headers(&self) -> Vec<(&'static str, String)> {
        let tokens = self.tokens.as_ref().map(|b| (b.remaining(), b.reset_in()));
        rate_headers(
            self.spec,
            tokens,
            self.requests_left.load(Ordering::Relaxed),
        )
    }
}

/// The `x-ratelimit-*` headers for limits `spec`: the tokens left and the time until the budget
/// is full again, and the requests the rate would let through at once.
pub fn rate_headers(
    spec: LimitSpec,
    tokens: Option<(u64, Duration)>,
    requests_left: u32,
) -> Vec<(&'static str, String)> {
    let (rps, burst, _, tpm) = spec;
    let mut out = Vec::new();
    if let Some((left, reset)) = tokens.filter(|_| tpm > 0) {
        out.push(("x-ratelimit-limit-tokens", tpm.to_string()));
        out.push(("x-ratelimit-remaining-tokens", left.to_string()));
        out.push(("x-ratelimit-reset-tokens", reset_text(reset)));
    }
    if rps > 0 {
        let burst = if burst == 0 { rps } else { burst };
        let left = requests_left.min(burst);
        // One request comes back every 1/rps seconds.
        let empty = f64::from(burst - left) / f64::from(rps);
        out.push(("x-ratelimit-limit-requests", burst.to_string()));
        out.push(("x-ratelimit-remaining-requests", left.to_string()));
        out.push((
            "x-ratelimit-reset-requests",
            reset_text(Duration::from_secs_f64(empty)),
        ));
    }
    out
}

/// 429 for a request of `n` tokens that can never fit a budget of `per_minute`.
pub fn never_fits(n: u64, per_minute: u64, tenant: &str) -> Option<LockstepError> {
    (n > per_minute).then(|| LockstepError::TokensExhausted {
        message: format!(
            "tenant `{tenant}`: the request needs {n} tokens (prompt + max_tokens), more than its whole budget of {per_minute} tokens per minute; lower max_tokens or the prompt"
        ),
        retry_after_s: 60,
    })
}

/// One tenant's token budget.
#[derive(Debug)]
pub struct TokenBudget {
    per_minute: u64,
    /// Tokens available now, and when that was computed.
    state: Mutex<(f64, Instant)>,
}

/// Tokens reserved by one request: what was not delivered goes back to the budget when it drops.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<TokenBudget>,
    reserved: u64,
    used: AtomicU64,
}

impl TokenBudget {
    /// A full budget of `per_minute` tokens.
    pub fn new(per_minute: u64) -> Arc<TokenBudget> {
        Arc::new(TokenBudget {
            per_minute,
            state: Mutex::new((per_minute as f64, Instant::now())),
        })
    }

    /// The configured tokens per minute.
    pub fn limit(&self) -> u64 {
        self.per_minute
    }

    fn rate(&self) -> f64 {
        self.per_minute as f64 / 60.0
    }

    /// The state brought up to `now`.
    fn refilled(&self) -> std::sync::MutexGuard<'_, (f64, Instant)> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let grown = s.0 + now.saturating_duration_since(s.1).as_secs_f64() * self.rate();
        *s = (grown.min(self.per_minute as f64), now);
        s
    }

    /// Reserves `n` tokens for a request of `tenant`, or 429 `rate_limited` with when it would
    /// fit.
    pub fn reserve(self: &Arc<Self>, n: u64, tenant: &str) -> Result<Reservation, LockstepError> {
        if let Some(e) = never_fits(n, self.per_minute, tenant) {
            return Err(e);
        }
        let mut s = self.refilled();
        if s.0 >= n as f64 {
            s.0 -= n as f64;
            return Ok(Reservation {
                budget: self.clone(),
                reserved: n,
                used: AtomicU64::new(0),
            });
        }
        let wait = (n as f64 - s.0) / self.rate();
        Err(LockstepError::TokensExhausted {
            message: format!(
                "tenant `{tenant}`: token budget of {} per minute reached ({} available, {n} needed: prompt + max_tokens)",
                self.per_minute, s.0 as u64
            ),
            retry_after_s: wait.ceil().max(1.0) as u64,
        })
    }

    /// Tokens available now.
    pub fn remaining(&self) -> u64 {
        self.refilled().0 as u64
    }

    /// How long until the budget is full again.
    pub fn reset_in(&self) -> Duration {
        let s = self.refilled();
        Duration::from_secs_f64((self.per_minute as f64 - s.0).max(0.0) / self.rate())
    }

    fn give_back(&self, n: u64) {
        let mut s = self.refilled();
        s.0 = (s.0 + n as f64).min(self.per_minute as f64);
    }
}

impl Reservation {
    /// Records that `total` of the reserved tokens were spent so far (prompt and completion
    /// tokens delivered); never more than were reserved.
    pub fn spent(&self, total: u64) {
        self.used
            .fetch_max(total.min(self.reserved), Ordering::AcqRel);
    }

    /// Tokens reserved.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let used = self.used.load(Ordering::Acquire);
        self.budget.give_back(self.reserved - used);
    }
}

/// A duration as OpenAI writes `x-ratelimit-reset-*`: `6m0s`, `1s`, `20ms`.
pub fn reset_text(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = d.as_secs_f64();
    let m = (s / 60.0).floor() as u64;
    let rest = s - (m * 60) as f64;
    let rest = if rest.fract() == 0.0 {
        format!("{}s", rest as u64)
    } else {
        format!("{rest:.3}s")
    };
    if m > 0 { format!("{m}m{rest}") } else { rest }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrent_reservations_never_overshoot_and_settlement_returns_the_rest() {
        let b = TokenBudget::new(1000);
        let a = b.reserve(600, "t").expect("fits");
        // The second does not fit while the first holds its reservation.
        let e = b.reserve(600, "t").expect_err("over the budget");
        assert_eq!(e.code(), "rate_limited");
        assert_eq!(e.status().as_u16(), 429);
        let LockstepError::TokensExhausted { retry_after_s, .. } = e else {
            panic!("{e:?}")
        };
        // 200 tokens short at 1000/min: 12 s.
        assert!((12..=13).contains(&retry_after_s), "{retry_after_s}");
        // It delivered 100 of its 600: 500 come back.
        a.spent(100);
        drop(a);
        let left = b.remaining();
        assert!((900..=901).contains(&left), "{left}");
        // Spent counts only what was reserved.
        let c = b.reserve(10, "t").expect("fits");
        c.spent(1_000_000);
        drop(c);
        assert!(b.remaining() <= 891, "{}", b.remaining());
        // Never more than the whole budget.
        let e = b.reserve(1001, "t").expect_err("never fits");
        assert!(e.to_string().contains("more than its whole budget"), "{e}");
    }

    #[test]
    fn the_budget_refills_at_its_rate_and_stops_full() {
        let b = TokenBudget::new(60_000);
        let r = b.reserve(60_000, "t").expect("fits");
        r.spent(60_000);
        drop(r);
        assert!(b.remaining() < 100);
        std::thread::sleep(Duration::from_millis(50));
        // 1000 tokens a second.
        let after = b.remaining();
        assert!((40..=200).contains(&after), "{after}");
        assert!(b.reset_in() > Duration::from_secs(55));
        assert_eq!(reset_text(Duration::from_millis(20)), "20ms");
        assert_eq!(reset_text(Duration::from_secs(1)), "1s");
        assert_eq!(reset_text(Duration::from_secs(360)), "6m0s");
        assert_eq!(reset_text(Duration::from_millis(61_500)), "1m1.500s");
    }
}
