//! Per-tenant rate limits per task type, in fixed one-minute windows (Workers AI's defaults:
//! text generation 300/min, embeddings 3000/min). Counted in Redis when it is configured, so
//! every replica shares one budget; in-process otherwise.
//!
//! While Redis is unreachable a replica spends what it has already leased and then fails
//! closed (503/3044, `Decision::unavailable`): counting in-process instead would let every
//! replica admit a whole limit of its own. It recovers by itself once Redis answers again.
//!
//! With Redis, a replica does not ask Redis on every request: it takes the budget in leases
//! of [`lease_size`] units (one `INCRBY` per lease) and spends them locally, so only one
//! request in a lease waits on a Redis round trip. A lease can only be taken out of what
//! is left of the window's limit, so all replicas together never admit more than the
//! limit; the cost is that units a replica leased but did not spend before the window
//! ends are lost (at most `lease_size - 1` per replica, tenant and task), so a tenant
//! spread over many replicas may be refused just short of its limit, never past it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimits {
    pub text_generation_per_min: u32,
    pub embeddings_per_min: u32,
}

impl Default for RateLimits {
    fn default() -> Self {
        RateLimits {
            text_generation_per_min: 300,
            embeddings_per_min: 3000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Task {
    TextGeneration,
    Embeddings,
}

/// The outcome of one check, with what the `x-ratelimit-*` headers report.
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    pub allowed: bool,
    /// Refused because the shared budget could not be read (Redis unreachable), not because
    /// the tenant used it up.
    pub unavailable: bool,
    pub limit: u32,
    pub remaining: u32,
    /// Seconds until the window resets.
    pub reset_s: u64,
}

pub struct RateLimiter {
    limits: RateLimits,
    windows: Mutex<HashMap<(String, Task), (u64, u32)>>,
    redis: Option<crate::redis_bus::RedisBus>,
    leases: Mutex<HashMap<(String, Task), SharedLease>>,
}

/// Units of a window's shared budget taken from Redis at once: 1/64 of the limit, between
/// 1 and 100 (so a small limit stays exact and a large one costs a round trip per 100).
pub fn lease_size(limit: u32) -> u64 {
    (u64::from(limit) / 64).clamp(1, 100)
}

/// A lease, locked across its refill's Redis round trip.
type SharedLease = Arc<tokio::sync::Mutex<Lease>>;

/// What this replica holds of one tenant's and task's shared budget in one window.
#[derive(Debug, Default)]
struct Lease {
    minute: u64,
    /// Units leased and not yet spent.
    left: u64,
    /// The window's shared count after this replica's last lease.
    total: u64,
}

impl Task {
    fn key(self) -> &'static str {
        match self {
            Task::TextGeneration => "text-generation",
            Task::Embeddings => "text-embeddings",
        }
    }
}

impl RateLimiter {
    pub fn new(limits: RateLimits, redis: Option<crate::redis_bus::RedisBus>) -> Self {
        RateLimiter {
            limits,
            windows: Mutex::new(HashMap::new()),
            redis,
            leases: Mutex::new(HashMap::new()),
        }
    }

    fn limit(&self, task: Task) -> u32 {
        match task {
            Task::TextGeneration => self.limits.text_generation_per_min,
            Task::Embeddings => self.limits.embeddings_per_min,
        }
    }

    /// Count one request of `tenant` for `task`, shared across replicas when Redis is there.
    pub async fn check(&self, tenant: &str, task: Task) -> Decision {
        let Some(redis) = &self.redis else {
            return self.check_local(tenant, task);
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let minute = now / 60;
        let limit = self.limit(task);
        let lease = {
            let mut leases = self.leases.lock();
            if leases.len() > 100_000 {
                leases.retain(|_, l| l.try_lock().map_or(true, |l| l.minute == minute));
            }
            leases
                .entry((tenant.to_string(), task))
                .or_default()
                .clone()
        };
        // One refill at a time per tenant and task: the others wait for it, not on Redis.
        let mut lease = lease.lock().await;
        if lease.minute != minute {
            *lease = Lease {
                minute,
                ..Lease::default()
            };
        }
        // Once the shared count has reached the limit nobody can be admitted until the next
        // window: refuse without asking Redis again.
        if lease.left == 0 && lease.total < u64::from(limit) {
            let n = lease_size(limit);
            let key = format!("{tenant}:{}:{minute}", task.key());
            match redis.hit(&key, n, 60).await {
                Ok(total) => {
                    // This lease is units total-n+1 ..= total; only those within the limit
                    // may be spent.
                    let first = total - n + 1;
                    lease.left = (u64::from(limit) + 1).saturating_sub(first).min(n);
                    lease.total = total;
                }
                Err(e) => {
                    tracing::warn!("Redis rate limit unavailable, refusing past the lease: {e}");
                    return Decision {
                        allowed: false,
                        unavailable: true,
                        limit,
                        remaining: 0,
                        reset_s: 60 - now % 60,
                    };
                }
            }
        }
        let allowed = lease.left > 0;
        if allowed {
            lease.left -= 1;
        }
        let unleased = u64::from(limit).saturating_sub(lease.total);
        Decision {
            allowed,
            unavailable: false,
            limit,
            remaining: (unleased + lease.left).min(u64::from(limit)) as u32,
            reset_s: 60 - now % 60,
        }
    }

    /// Count one request of `tenant` for `task` in this process, if the window has room.
    pub fn check_local(&self, tenant: &str, task: Task) -> Decision {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let minute = now / 60;
        let limit = self.limit(task);
        let mut windows = self.windows.lock();
        if windows.len() > 100_000 {
            windows.retain(|_, (m, _)| *m == minute);
        }
        let entry = windows
            .entry((tenant.to_string(), task))
            .or_insert((minute, 0));
        if entry.0 != minute {
            *entry = (minute, 0);
        }
        let allowed = entry.1 < limit;
        if allowed {
            entry.1 += 1;
        }
        Decision {
            allowed,
            unavailable: false,
            limit,
            remaining: limit - entry.1.min(limit),
            reset_s: 60 - now % 60,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two replicas (limiters) share one budget in Redis (127.0.0.1:6379): together they
    /// never admit more than the limit, and lose at most a lease's remainder each.
    #[tokio::test]
    async fn replicas_lease_the_shared_budget_and_never_exceed_it() {
        let prefix = format!("bulkhead-test-lease-{}", rand::random::<u64>());
        let limits = RateLimits {
            text_generation_per_min: 640,
            embeddings_per_min: 1,
        };
        let n = lease_size(640);
        assert_eq!(n, 10);
        let mut replicas = Vec::new();
        for _ in 0..2 {
            let bus = crate::redis_bus::RedisBus::connect("redis://127.0.0.1:6379", &prefix)
                .await
                .expect("Redis at 127.0.0.1:6379");
            replicas.push(RateLimiter::new(limits, Some(bus)));
        }
        let minute_now = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs()
                / 60
        };
        loop {
            let tenant = format!("t{}", rand::random::<u32>());
            let mut allowed = 0u64;
            let minute = minute_now();
            let first = replicas[0].check(&tenant, Task::TextGeneration).await;
            allowed += u64::from(first.allowed);
            let mut last = first;
            for i in 1..800 {
                last = replicas[i % 2].check(&tenant, Task::TextGeneration).await;
                allowed += u64::from(last.allowed);
            }
            if minute_now() != minute {
                continue; // crossed a minute boundary; the budget restarted, try again
            }
            assert!(allowed <= 640, "admitted {allowed} over the limit of 640");
            assert!(allowed > 640 - 2 * n, "admitted only {allowed} of 640");
            assert!(!last.allowed);
            assert_eq!(last.remaining, 0);
            // Redis saw leases, not requests: nothing past the limit's last lease.
            let key = format!("{prefix}:rl:{tenant}:text-generation:{minute}");
            let mut conn = redis::Client::open("redis://127.0.0.1:6379")
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let counted: u64 = redis::AsyncCommands::get(&mut conn, &key).await.unwrap();
            assert!(counted <= 640 + 2 * n, "Redis counted {counted} units");
            break;
        }
    }

    #[test]
    fn the_limit_is_per_tenant_and_per_task() {
        let l = RateLimiter::new(
            RateLimits {
                text_generation_per_min: 2,
                embeddings_per_min: 1,
            },
            None,
        );
        // The window may roll over mid-test at a minute boundary; then counts restart, which
        // only makes later checks more permissive, so check the refusal within one window.
        loop {
            let a1 = l.check_local("a", Task::TextGeneration);
            let a2 = l.check_local("a", Task::TextGeneration);
            let a3 = l.check_local("a", Task::TextGeneration);
            let b1 = l.check_local("b", Task::TextGeneration);
            let e1 = l.check_local("a", Task::Embeddings);
            if a1.reset_s < a3.reset_s {
                continue; // crossed a minute boundary; try again
            }
            assert!(a1.allowed && a2.allowed && !a3.allowed);
            assert_eq!(a3.remaining, 0);
            assert!(b1.allowed, "another tenant has its own budget");
            assert!(e1.allowed, "another task has its own budget");
            break;
        }
    }
}
