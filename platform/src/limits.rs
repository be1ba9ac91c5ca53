//! Per-tenant rate limits per task type, in fixed one-minute windows (Workers AI's defaults:
//! text generation 300/min, embeddings 3000/min). Counted in Redis when it is configured, so
//! every replica shares one budget; in-process otherwise (and while Redis is unreachable).

use std::collections::HashMap;
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
    pub limit: u32,
    pub remaining: u32,
    /// Seconds until the window resets.
    pub reset_s: u64,
}

pub struct RateLimiter {
    limits: RateLimits,
    windows: Mutex<HashMap<(String, Task), (u64, u32)>>,
    redis: Option<crate::redis_bus::RedisBus>,
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
        match redis
            .hit(&format!("{tenant}:{}:{minute}", task.key()), 60)
            .await
        {
            Ok(count) => Decision {
                allowed: count <= limit as u64,
                limit,
                remaining: (limit as u64).saturating_sub(count) as u32,
                reset_s: 60 - now % 60,
            },
            Err(e) => {
                tracing::warn!("Redis rate limit unavailable, counting in-process: {e}");
                self.check_local(tenant, task)
            }
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
            limit,
            remaining: limit - entry.1.min(limit),
            reset_s: 60 - now % 60,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
