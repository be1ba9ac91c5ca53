//! A replica's memory of recently authenticated tokens, so that a request does not wait on a
//! database round trip to learn who it is.
//!
//! Only successful lookups are kept (a new token works at once; a bad one is looked up every
//! time). Revocation must win over the cache: revoking bumps the shared state version in the
//! same transaction, and every replica drops its whole cache when it sees the version move
//! (at once on the replica that revoked and, with Redis, on the others; within one catalog
//! poll otherwise). A lookup that raced with such a drop is not cached: entries are only
//! inserted under the generation that was current before the database was asked. A TTL bounds
//! how long any entry lives regardless.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Principal;

/// How long a cached token is trusted before the database is asked again.
pub const TOKEN_CACHE_TTL: Duration = Duration::from_secs(60);
/// Entries kept at most; the cache starts over when it is full.
const MAX_ENTRIES: usize = 65_536;

#[derive(Default)]
pub struct TokenCache {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Bumped by every [`TokenCache::clear`]; an insert carries the generation it started in.
    generation: u64,
    /// sha256(secret) -> who it is and when it was looked up.
    entries: HashMap<String, (Principal, Instant)>,
}

impl std::fmt::Debug for TokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.lock();
        f.debug_struct("TokenCache")
            .field("generation", &inner.generation)
            .field("entries", &inner.entries.len())
            .finish()
    }
}

impl TokenCache {
    /// The cached principal for a secret's hash, if fresh.
    pub fn get(&self, hash: &str) -> Option<Principal> {
        let inner = self.inner.lock();
        let (p, at) = inner.entries.get(hash)?;
        (at.elapsed() < TOKEN_CACHE_TTL).then(|| p.clone())
    }

    /// The generation to pass to [`TokenCache::insert`] after asking the database.
    pub fn generation(&self) -> u64 {
        self.inner.lock().generation
    }

    /// Remember a lookup made while `generation` was current; dropped if the cache was
    /// cleared since (the answer may predate a revocation).
    pub fn insert(&self, generation: u64, hash: String, principal: Principal) {
        let mut inner = self.inner.lock();
        if inner.generation != generation {
            return;
        }
        if inner.entries.len() >= MAX_ENTRIES {
            inner.entries.clear();
        }
        inner.entries.insert(hash, (principal, Instant::now()));
    }

    /// Forget everything (a token was revoked somewhere).
    pub fn clear(&self) {
        let mut inner = self.inner.lock();
        inner.generation += 1;
        inner.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Scope;

    fn principal() -> Principal {
        Principal {
            token_id: "t".into(),
            tenant_id: "a".into(),
            scope: Scope::Tenant,
            node_id: None,
        }
    }

    #[test]
    fn a_lookup_that_raced_with_a_clear_is_not_cached() {
        let c = TokenCache::default();
        let g = c.generation();
        c.clear(); // a revocation lands while the database is being asked
        c.insert(g, "h".into(), principal());
        assert_eq!(c.get("h"), None);
        let g = c.generation();
        c.insert(g, "h".into(), principal());
        assert_eq!(c.get("h"), Some(principal()));
        c.clear();
        assert_eq!(c.get("h"), None);
    }
}
