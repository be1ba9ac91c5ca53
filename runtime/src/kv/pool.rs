//! Fixed-capacity pool of KV pages with owner tags, deferred release and poisoning.
//!
//! Invariants (checked by the property tests at the bottom and in `tests/kv_pool_props.rs`):
//! - a page is handed to at most one owner at a time; its tag names that owner and the
//!   allocation epoch, and every read or write compares the tag with the asking sequence;
//! - a released page returns to the free list only when its last holder lets go (a running
//!   step or a KV transfer can hold a page past its owner's release), and is poisoned first;
//! - free pages are handed out first-in-first-out, so a just-freed page is the last reused;
//! - capacity is reserved up front at admission: a sequence never runs out of pages midway.
//!
//! The prefix cache (`lookup_and_reserve`, `publish_prefix`) adds shared pages: a full page of
//! a prompt, once published, is tagged with its cache namespace instead of its request, may
//! be read (never written) by any sequence of that namespace, and stays cached after its last
//! holder lets go, evictable least recently released first. Evictable pages count as free
//! for reservations; a page anyone holds is never evicted; eviction poisons like release.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use super::prefix::{BlockHash, CacheNamespace, PromptKeys};
use crate::error::RuntimeError;

/// Value written over a page's contents when it is freed. A stale read that slipped past the
/// tag check would surface as NaN logits, never as another tenant's data.
pub const POISON: f32 = f32::NAN;

/// Who a sequence is: the tenant, the node-unique request number, and the client's cache
/// salt, which narrows the tenant's prefix cache (see [`CacheNamespace`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    pub tenant: Arc<str>,
    pub request: u64,
    pub cache_salt: Option<Arc<str>>,
}

impl Owner {
    pub fn new(tenant: impl Into<Arc<str>>, request: u64) -> Owner {
        Owner {
            tenant: tenant.into(),
            request,
            cache_salt: None,
        }
    }

    /// The cached pages this sequence may read: its tenant's, narrowed by its salt.
    pub fn namespace(&self) -> CacheNamespace {
        CacheNamespace {
            tenant: self.tenant.clone(),
            salt: self.cache_salt.clone(),
        }
    }

    /// Whether `namespace` is this sequence's ([`Owner::namespace`] without building it: the
    /// page check runs for every page of every layer of every step).
    fn in_namespace(&self, namespace: &CacheNamespace) -> bool {
        *namespace.tenant == *self.tenant && namespace.salt == self.cache_salt
    }
}

/// Whom a page belongs to while allocated: one request, or (a published prefix page) every
/// sequence of one cache namespace, for reading only.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TagOwner {
    Request(Owner),
    Cache(CacheNamespace),
}

/// The owner tag a page carries while allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PageTag {
    owner: TagOwner,
    epoch: u64,
}

/// What a caller does with a page: a shared (cached) page may be read, never written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

/// An entry of a block table: which page, and which allocation of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub page: u32,
    pub epoch: u64,
}

/// Shape of one token's K/V across the model: layers x (K and V) x kv_dim floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvLayout {
    pub layers: usize,
    /// n_kv_heads * head_dim
    pub kv_dim: usize,
}

impl KvLayout {
    pub fn bytes_per_token(&self) -> usize {
        self.layers * 2 * self.kv_dim * std::mem::size_of::<f32>()
    }
}

struct PageData {
    tag: Option<PageTag>,
    /// [layer][k=0|v=1][slot][kv_dim]
    data: Box<[f32]>,
}

#[derive(Debug, Default, Clone)]
struct PageState {
    epoch: u64,
    allocated: bool,
    /// Every sequence whose block table has the page (the owner, or each sequence sharing a
    /// cached page) plus any extra holders (transfers).
    holders: u32,
    /// The page's prefix-cache key, while it is published.
    cached: Option<CachedPage>,
    /// Its place in the eviction order, while cached and held by no one.
    evictable_since: Option<u64>,
}

#[derive(Debug, Clone)]
struct CachedPage {
    hash: BlockHash,
    /// The key of the page before it in its prompt (or the prompt's root).
    parent: BlockHash,
    /// Its tokens: a prompt that shares only their beginning copies that much of it.
    tokens: Box<[u32]>,
    namespace: CacheNamespace,
}

struct Meta {
    free: VecDeque<u32>,
    state: Vec<PageState>,
    /// Pages promised to admitted sequences but not yet allocated.
    reserved: usize,
    /// Published prefix pages by key.
    cached: HashMap<BlockHash, u32>,
    /// Published pages by the key they hang from: where a partial match is looked for.
    children: HashMap<BlockHash, Vec<u32>>,
    /// Cached pages held by no one, by when they were last let go: evicted oldest first.
    evictable: BTreeMap<u64, u32>,
    clock: u64,
}

impl Meta {
    /// Pages a reservation may still promise: free ones and evictable cached ones.
    fn available(&self) -> usize {
        (self.free.len() + self.evictable.len()).saturating_sub(self.reserved)
    }

    /// The last holder of `page` let go: a cached page becomes evictable, any other goes to
    /// `to_free` (poisoned there before it is allocatable again).
    fn let_go(&mut self, page: u32, to_free: &mut Vec<u32>) {
        let st = &mut self.state[page as usize];
        if st.cached.is_some() {
            self.clock += 1;
            st.evictable_since = Some(self.clock);
            self.evictable.insert(self.clock, page);
        } else {
            to_free.push(page);
        }
    }
}

/// Pool-level figures, as reported by `state` and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolStats {
    pub page_size: usize,
    pub pages_total: usize,
    pub pages_free: usize,
    pub pages_reserved: usize,
    pub capacity_tokens: usize,
    pub isolation_violations: u64,
    /// Published prefix pages, held or not (`pages_free` counts those held by no one).
    #[serde(default)]
    pub pages_cached: usize,
    /// Prefix-cache lookups, in pages: found, not found, and cached pages evicted.
    #[serde(default)]
    pub cache_hits: u64,
    #[serde(default)]
    pub cache_misses: u64,
    #[serde(default)]
    pub cache_evictions: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV pool momentarily full: {wanted} pages wanted, {available} available")]
pub struct PoolFull {
    pub wanted: usize,
    pub available: usize,
}

/// A promise of `pages` pages, taken at admission. Dropped unused pages go back to the pool
/// through `KvPool::release`.
#[derive(Debug)]
pub struct Reservation {
    pages: usize,
}

/// A reservation together with the cached prefix pages a lookup found and took a hold on:
/// whole pages, then possibly a page whose first slots match the prompt (copied, not shared).
#[derive(Debug)]
pub struct PrefixHit {
    pub reservation: Reservation,
    pages: Vec<PageRef>,
    partial: Option<(PageRef, usize)>,
}

impl PrefixHit {
    /// Whole cached pages found, in prompt order.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }
    /// Tokens of a further cached page that match the prompt, to be copied.
    pub fn partial_tokens(&self) -> usize {
        self.partial.map_or(0, |(_, n)| n)
    }
}

impl From<Reservation> for PrefixHit {
    fn from(reservation: Reservation) -> PrefixHit {
        PrefixHit {
            reservation,
            pages: Vec::new(),
            partial: None,
        }
    }
}

/// One sequence's view of the pool: its owner, its block table and how many tokens it holds.
#[derive(Debug)]
pub struct SeqKv {
    owner: Owner,
    table: Vec<PageRef>,
    len: usize,
    reservation: Reservation,
    released: bool,
}

impl SeqKv {
    pub fn owner(&self) -> &Owner {
        &self.owner
    }
    /// Tokens whose K/V have been written.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn block_table(&self) -> &[PageRef] {
        &self.table
    }
    /// Test hook for the forged-block-table test: replace an entry of the block table.
    #[doc(hidden)]
    pub fn forge_block_table_entry(&mut self, index: usize, page: PageRef) {
        self.table[index] = page;
    }
    /// Test hook: append a forged entry to the block table.
    #[doc(hidden)]
    pub fn forge_block_table_entry_push(&mut self, page: PageRef) {
        self.table.push(page);
    }
}

pub struct KvPool {
    layout: KvLayout,
    page_size: usize,
    pages: Vec<RwLock<PageData>>,
    meta: Mutex<Meta>,
    isolation_violations: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    cache_evictions: AtomicU64,
    /// Woken whenever pages or reserved room go back to the pool.
    room: tokio::sync::Notify,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("layout", &self.layout)
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvPool {
    /// A pool of `pages` pages of `page_size` tokens each.
    pub fn new(layout: KvLayout, page_size: usize, pages: usize) -> Self {
        assert!(
            page_size > 0 && pages > 0,
            "pool needs at least one page of one token"
        );
        let floats = layout.layers * 2 * page_size * layout.kv_dim;
        let pages_vec = (0..pages)
            .map(|_| {
                RwLock::new(PageData {
                    tag: None,
                    data: vec![POISON; floats].into_boxed_slice(),
                })
            })
            .collect();
        KvPool {
            layout,
            page_size,
            pages: pages_vec,
            meta: Mutex::new(Meta {
                free: (0..pages as u32).collect(),
                state: vec![PageState::default(); pages],
                reserved: 0,
                cached: HashMap::new(),
                children: HashMap::new(),
                evictable: BTreeMap::new(),
                clock: 0,
            }),
            isolation_violations: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            cache_evictions: AtomicU64::new(0),
            room: tokio::sync::Notify::new(),
        }
    }

    /// A pool holding at least `tokens` tokens (rounded up to whole pages).
    pub fn with_capacity_tokens(layout: KvLayout, page_size: usize, tokens: usize) -> Self {
        Self::new(layout, page_size, tokens.div_ceil(page_size).max(1))
    }

    /// How many tokens fit in a memory budget of `bytes`, rounded down to whole pages.
    pub fn tokens_for_budget(layout: KvLayout, page_size: usize, bytes: usize) -> usize {
        let page_bytes = layout.bytes_per_token() * page_size;
        (bytes / page_bytes) * page_size
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn capacity_tokens(&self) -> usize {
        self.pages.len() * self.page_size
    }
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    pub fn stats(&self) -> PoolStats {
        let meta = self.meta.lock();
        PoolStats {
            page_size: self.page_size,
            pages_total: self.pages.len(),
            pages_free: meta.free.len() + meta.evictable.len(),
            pages_reserved: meta.reserved,
            capacity_tokens: self.capacity_tokens(),
            isolation_violations: self.isolation_violations.load(Ordering::Relaxed),
            pages_cached: meta.cached.len(),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            cache_misses: self.cache_misses.load(Ordering::Relaxed),
            cache_evictions: self.cache_evictions.load(Ordering::Relaxed),
        }
    }

    pub fn isolation_violations(&self) -> u64 {
        self.isolation_violations.load(Ordering::Relaxed)
    }

    /// Reserve room for `tokens` tokens. Fails (without side effects) when the free pages not
    /// already promised to others are too few.
    pub fn try_reserve(&self, tokens: usize) -> Result<Reservation, PoolFull> {
        let wanted = self.pages_for(tokens);
        let mut meta = self.meta.lock();
        let available = meta.available();
        if wanted > available {
            return Err(PoolFull { wanted, available });
        }
        meta.reserved += wanted;
        Ok(Reservation { pages: wanted })
    }

    /// [`KvPool::try_reserve`], waiting until `deadline` for releases to make room (woken
    /// by each release rather than polling). Fails with the last shortfall at the deadline.
    pub async fn reserve_by(
        &self,
        tokens: usize,
        deadline: tokio::time::Instant,
    ) -> Result<Reservation, PoolFull> {
        loop {
            // Registered before the check, so a release between the two is not missed.
            let released = self.room.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            match self.try_reserve(tokens) {
                Ok(r) => return Ok(r),
                Err(full) => {
                    if tokio::time::timeout_at(deadline, released).await.is_err() {
                        return Err(full);
                    }
                }
            }
        }
    }

    /// Start a sequence on a reservation.
    pub fn open(&self, owner: Owner, reservation: Reservation) -> SeqKv {
        SeqKv {
            owner,
            table: Vec::new(),
            len: 0,
            reservation,
            released: false,
        }
    }

    /// Find the longest run of `prompt`'s pages cached in `namespace` (by `keys`, see
    /// [`super::prefix_hashes`]), then the cached page after them whose tokens match the
    /// prompt's furthest, hold them, and reserve room for the rest of `tokens` — all at once
    /// or nothing. At most the first `reusable` prompt tokens come from the cache. Holding an
    /// evictable page takes it out of what reservations may promise, so it costs one page of
    /// room like a new one.
    pub fn lookup_and_reserve(
        &self,
        namespace: &CacheNamespace,
        keys: &PromptKeys,
        prompt: &[u32],
        reusable: usize,
        tokens: usize,
    ) -> Result<PrefixHit, PoolFull> {
        let ps = self.page_size;
        let reusable = reusable.min(prompt.len());
        let whole = (reusable / ps).min(keys.pages.len());
        let mut meta = self.meta.lock();
        let ours = |meta: &Meta, page: u32| {
            let st = &meta.state[page as usize];
            // The key already names the namespace; the page's own record must agree.
            st.allocated
                && st
                    .cached
                    .as_ref()
                    .is_some_and(|c| c.namespace == *namespace)
        };
        let mut found = Vec::new();
        for hash in &keys.pages[..whole] {
            match meta.cached.get(hash) {
                Some(&page) if ours(&meta, page) => found.push(page),
                _ => break,
            }
        }
        // The next page: the cached child of the last hit that shares the most tokens.
        let next = &prompt[found.len() * ps..reusable.min((found.len() + 1) * ps)];
        let partial = match (
            next.is_empty(),
            meta.children.get(&keys.parent(found.len())),
        ) {
            (false, Some(children)) => children
                .iter()
                .filter(|&&page| ours(&meta, page))
                .map(|&page| {
                    let cached = meta.state[page as usize].cached.as_ref();
                    let tokens = cached.map_or(&[][..], |c| &c.tokens);
                    let shared = tokens.iter().zip(next).take_while(|(a, b)| a == b).count();
                    (page, shared)
                })
                .max_by_key(|&(_, shared)| shared)
                .filter(|&(_, shared)| shared > 0),
            _ => None,
        };
        let pages = self.pages_for(tokens).max(found.len());
        let evictable = |p: &u32| meta.state[*p as usize].holders == 0;
        let wanted = pages - found.len()
            + found.iter().filter(|p| evictable(p)).count()
            + partial.iter().filter(|(p, _)| evictable(p)).count();
        let available = meta.available();
        if wanted > available {
            return Err(PoolFull { wanted, available });
        }
        let mut hold = |page: u32| {
            let st = &mut meta.state[page as usize];
            if let Some(since) = st.evictable_since.take() {
                meta.evictable.remove(&since);
            }
            let st = &mut meta.state[page as usize];
            st.holders += 1;
            PageRef {
                page,
                epoch: st.epoch,
            }
        };
        let held: Vec<PageRef> = found.iter().map(|&p| hold(p)).collect();
        let partial = partial.map(|(page, shared)| (hold(page), shared));
        meta.reserved += pages - found.len();
        drop(meta);
        self.cache_hits
            .fetch_add(found.len() as u64, Ordering::Relaxed);
        self.cache_misses
            .fetch_add((whole - found.len()) as u64, Ordering::Relaxed);
        Ok(PrefixHit {
            reservation: Reservation {
                pages: pages - found.len(),
            },
            pages: held,
            partial,
        })
    }

    /// Start a sequence on a lookup's result: its block table begins with the cached pages,
    /// whose tokens count as written; a partly matching page's slots are copied into the
    /// sequence's first own page (copy on write: the cached page stays as it is).
    pub fn open_with_prefix(&self, owner: Owner, hit: PrefixHit) -> Result<SeqKv, RuntimeError> {
        let mut seq = SeqKv {
            owner,
            len: hit.pages.len() * self.page_size,
            table: hit.pages,
            reservation: hit.reservation,
            released: false,
        };
        if let Some((source, tokens)) = hit.partial {
            let copied = self.copy_slots(&mut seq, source, tokens);
            self.unhold(&[source]);
            if let Err(e) = copied {
                self.release(&mut seq);
                return Err(e);
            }
        }
        Ok(seq)
    }

    /// Append the first `tokens` slots of cached page `source` to `seq`, every layer.
    fn copy_slots(
        &self,
        seq: &mut SeqKv,
        source: PageRef,
        tokens: usize,
    ) -> Result<(), RuntimeError> {
        let kv_dim = self.layout.kv_dim;
        let run = tokens * kv_dim;
        let layers: Vec<(Vec<f32>, Vec<f32>)> = {
            let page = self.pages[source.page as usize].read();
            self.check_tag(&seq.owner, source, &page, Access::Read)?;
            (0..self.layout.layers)
                .map(|layer| {
                    let (k, v) = (self.offset(layer, 0, 0), self.offset(layer, 1, 0));
                    (
                        page.data[k..k + run].to_vec(),
                        page.data[v..v + run].to_vec(),
                    )
                })
                .collect()
        };
        self.grow(seq, tokens)?;
        for (layer, (k, v)) in layers.iter().enumerate() {
            self.write(seq, layer, seq.len, k, v)?;
        }
        self.commit(seq, tokens);
        Ok(())
    }

    /// Publish the full pages of `seq`'s prompt under their `keys` (all written), so later
    /// sequences of its namespace can reuse them. A page becomes read-only for `seq` too,
    /// which writes only past its prompt. Pages already cached and keys another sequence
    /// published first are left as they are.
    pub fn publish_prefix(
        &self,
        seq: &SeqKv,
        keys: &PromptKeys,
        prompt: &[u32],
    ) -> Result<(), RuntimeError> {
        let ps = self.page_size;
        let n = keys.pages.len();
        if n * ps > seq.len || n > seq.table.len() || n * ps > prompt.len() {
            return Err(RuntimeError::Internal(format!(
                "publishing {n} pages of a sequence of {} tokens",
                seq.len
            )));
        }
        let namespace = seq.owner.namespace();
        for (i, (hash, &page_ref)) in keys.pages.iter().zip(&seq.table).enumerate() {
            {
                let meta = self.meta.lock();
                let st = &meta.state[page_ref.page as usize];
                if st.cached.is_some() || meta.cached.contains_key(hash) {
                    continue;
                }
            }
            // Retag first, then make the key findable: a sequence that finds the page must
            // find it tagged with its namespace.
            {
                let mut page = self.pages[page_ref.page as usize].write();
                self.check_tag(&seq.owner, page_ref, &page, Access::Write)?;
                page.tag = Some(PageTag {
                    owner: TagOwner::Cache(namespace.clone()),
                    epoch: page_ref.epoch,
                });
            }
            let parent = keys.parent(i);
            let mut meta = self.meta.lock();
            meta.state[page_ref.page as usize].cached = Some(CachedPage {
                hash: *hash,
                parent,
                tokens: prompt[i * ps..(i + 1) * ps].into(),
                namespace: namespace.clone(),
            });
            meta.cached.insert(*hash, page_ref.page);
            meta.children.entry(parent).or_default().push(page_ref.page);
        }
        Ok(())
    }

    /// Take a page for a growing sequence: the oldest free page, else the least recently
    /// released cached one, whose key is dropped (it is poisoned before its new owner's tag
    /// goes on). The caller holds a reservation, so one of the two exists.
    fn take_page(&self, meta: &mut Meta) -> (u32, bool) {
        if let Some(page) = meta.free.pop_front() {
            return (page, false);
        }
        let (_, page) = meta
            .evictable
            .pop_first()
            .expect("a reservation guarantees a free or evictable page");
        let st = &mut meta.state[page as usize];
        st.evictable_since = None;
        let cached = st.cached.take().expect("an evictable page is cached");
        st.allocated = false;
        meta.cached.remove(&cached.hash);
        if let Some(siblings) = meta.children.get_mut(&cached.parent) {
            siblings.retain(|&p| p != page);
            if siblings.is_empty() {
                meta.children.remove(&cached.parent);
            }
        }
        self.cache_evictions.fetch_add(1, Ordering::Relaxed);
        (page, true)
    }

    /// Make room for `n` more tokens in `seq`, allocating pages from its reservation.
    pub fn grow(&self, seq: &mut SeqKv, n: usize) -> Result<(), RuntimeError> {
        if seq.released {
            return Err(RuntimeError::Internal("grow on a released sequence".into()));
        }
        let need_pages = self.pages_for(seq.len + n);
        while seq.table.len() < need_pages {
            if seq.reservation.pages == 0 {
                return Err(RuntimeError::Internal(format!(
                    "sequence {} outgrew its reservation",
                    seq.owner.request
                )));
            }
            let mut meta = self.meta.lock();
            let (page, evicted) = self.take_page(&mut meta);
            meta.reserved -= 1;
            let state = &mut meta.state[page as usize];
            assert!(
                !state.allocated && state.holders == 0,
                "a free page was still in use"
            );
            state.epoch += 1;
            state.allocated = true;
            state.holders = 1;
            let epoch = state.epoch;
            drop(meta);
            let mut data = self.pages[page as usize].write();
            if evicted {
                data.data.fill(POISON);
            }
            data.tag = Some(PageTag {
                owner: TagOwner::Request(seq.owner.clone()),
                epoch,
            });
            drop(data);
            seq.reservation.pages -= 1;
            seq.table.push(PageRef { page, epoch });
        }
        Ok(())
    }

    fn violation(&self, seq_owner: &Owner, page: PageRef, found: Option<&PageTag>) -> RuntimeError {
        self.isolation_violations.fetch_add(1, Ordering::Relaxed);
        let found = match found {
            Some(PageTag {
                owner: TagOwner::Request(o),
                epoch,
            }) => format!("owner request {} epoch {epoch}", o.request),
            Some(PageTag {
                owner: TagOwner::Cache(_),
                epoch,
            }) => format!("a cached page (epoch {epoch}) it may not use so"),
            None => "a free page".to_string(),
        };
        tracing::error!(
            request = seq_owner.request,
            page = page.page,
            "KV isolation violation: block table points at {found}"
        );
        RuntimeError::Isolation(format!(
            "KV page {} is not owned by request {}",
            page.page, seq_owner.request
        ))
    }

    /// A page may be used by the request it is tagged with, and a cached page read by any
    /// sequence of its namespace; anything else is an isolation violation.
    fn check_tag(
        &self,
        seq_owner: &Owner,
        page: PageRef,
        data: &PageData,
        access: Access,
    ) -> Result<(), RuntimeError> {
        let allowed = data.tag.as_ref().is_some_and(|tag| {
            tag.epoch == page.epoch
                && match &tag.owner {
                    TagOwner::Request(o) => o == seq_owner,
                    TagOwner::Cache(ns) => access == Access::Read && seq_owner.in_namespace(ns),
                }
        });
        if allowed {
            Ok(())
        } else {
            Err(self.violation(seq_owner, page, data.tag.as_ref()))
        }
    }

    fn offset(&self, layer: usize, kind: usize, slot: usize) -> usize {
        ((layer * 2 + kind) * self.page_size + slot) * self.layout.kv_dim
    }

    /// Write K/V of `n` consecutive tokens starting at position `start` for one layer.
    /// `k` and `v` are `[n, kv_dim]` row-major. Pages must already be allocated (`grow`).
    pub fn write(
        &self,
        seq: &SeqKv,
        layer: usize,
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), RuntimeError> {
        let kv_dim = self.layout.kv_dim;
        let n = k.len() / kv_dim;
        assert_eq!(k.len(), v.len(), "K and V of different lengths");
        let mut pos = start;
        while pos < start + n {
            let page_ref = *seq.table.get(pos / self.page_size).ok_or_else(|| {
                RuntimeError::Internal(format!("position {pos} beyond the block table"))
            })?;
            let slot = pos % self.page_size;
            let run = (self.page_size - slot).min(start + n - pos);
            let mut page = self.pages[page_ref.page as usize].write();
            self.check_tag(&seq.owner, page_ref, &page, Access::Write)?;
            let src = (pos - start) * kv_dim..(pos - start + run) * kv_dim;
            let ko = self.offset(layer, 0, slot);
            page.data[ko..ko + run * kv_dim].copy_from_slice(&k[src.clone()]);
            let vo = self.offset(layer, 1, slot);
            page.data[vo..vo + run * kv_dim].copy_from_slice(&v[src]);
            pos += run;
        }
        Ok(())
    }

    /// Record that `n` more tokens of `seq` are written in every layer.
    pub fn commit(&self, seq: &mut SeqKv, n: usize) {
        seq.len += n;
        assert!(
            seq.len <= seq.table.len() * self.page_size,
            "committed past the block table"
        );
    }

    /// Copy K and V of positions `0..len` of one layer into `k_out` and `v_out`
    /// (`[len, kv_dim]` each), checking every page's owner tag first.
    pub fn read(
        &self,
        seq: &SeqKv,
        layer: usize,
        len: usize,
        k_out: &mut Vec<f32>,
        v_out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        let kv_dim = self.layout.kv_dim;
        k_out.clear();
        v_out.clear();
        let mut pos = 0;
        while pos < len {
            let page_ref = *seq.table.get(pos / self.page_size).ok_or_else(|| {
                RuntimeError::Internal(format!("position {pos} beyond the block table"))
            })?;
            let run = self.page_size.min(len - pos);
            let page = self.pages[page_ref.page as usize].read();
            self.check_tag(&seq.owner, page_ref, &page, Access::Read)?;
            let ko = self.offset(layer, 0, 0);
            k_out.extend_from_slice(&page.data[ko..ko + run * kv_dim]);
            let vo = self.offset(layer, 1, 0);
            v_out.extend_from_slice(&page.data[vo..vo + run * kv_dim]);
            pos += run;
        }
        Ok(())
    }

    /// Lend the K and V of positions `0..len` of one layer in place, page by page: every
    /// page's owner tag is checked against `seq` first (the same check and alarm as
    /// [`KvPool::read`]), and the pages stay read-locked while the view lives. A mismatch on
    /// any page hands out nothing and returns the isolation error.
    pub fn read_layer(
        &self,
        seq: &SeqKv,
        layer: usize,
        len: usize,
    ) -> Result<LayerView<'_>, RuntimeError> {
        let pages = self.pages_for(len);
        let mut guards = Vec::with_capacity(pages);
        for i in 0..pages {
            let page_ref = *seq.table.get(i).ok_or_else(|| {
                RuntimeError::Internal(format!(
                    "position {} beyond the block table",
                    i * self.page_size
                ))
            })?;
            let page = self.pages[page_ref.page as usize].read();
            self.check_tag(&seq.owner, page_ref, &page, Access::Read)?;
            guards.push(page);
        }
        Ok(LayerView {
            guards,
            k_at: self.offset(layer, 0, 0),
            v_at: self.offset(layer, 1, 0),
            floats: self.page_size * self.layout.kv_dim,
            len,
        })
    }

    /// Bytes of one page's K/V for `tokens` slots on the transfer wire.
    pub fn wire_bytes(&self, tokens: usize) -> usize {
        self.layout.layers * 2 * tokens * self.layout.kv_dim * std::mem::size_of::<f32>()
    }

    /// Append the K/V of the first `tokens` slots of a page `owner` holds to `out`, in wire
    /// order (`[layer][k|v][slot][kv_dim]`, f32 little-endian), checking the owner tag first.
    /// Used by the prefill side of a KV transfer on pages it holds after its own release.
    pub fn export_page(
        &self,
        owner: &Owner,
        page_ref: PageRef,
        tokens: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), RuntimeError> {
        if tokens > self.page_size {
            return Err(RuntimeError::Internal(format!(
                "{tokens} tokens do not fit a page of {}",
                self.page_size
            )));
        }
        let page = self.pages[page_ref.page as usize].read();
        self.check_tag(owner, page_ref, &page, Access::Read)?;
        let run = tokens * self.layout.kv_dim;
        out.reserve(self.wire_bytes(tokens));
        for layer in 0..self.layout.layers {
            for kind in 0..2 {
                let o = self.offset(layer, kind, 0);
                out.extend_from_slice(bytemuck::cast_slice(&page.data[o..o + run]));
            }
        }
        Ok(())
    }

    /// Write received K/V (wire order, as `export_page` writes it) into page `index` of
    /// `seq`'s block table, checking the owner tag. Pages must be allocated (`grow`).
    /// The page is the receiving sequence's own and is not read before the whole transfer is
    /// verified (its MACs, `transfer::wire`), so forged bytes only fail that sequence.
    pub fn import_page(
        &self,
        seq: &SeqKv,
        index: usize,
        tokens: usize,
        data: &[u8],
    ) -> Result<(), RuntimeError> {
        if tokens > self.page_size || data.len() != self.wire_bytes(tokens) {
            return Err(RuntimeError::Internal(format!(
                "page data of {} bytes for {tokens} tokens does not match the layout",
                data.len()
            )));
        }
        let page_ref = *seq.table.get(index).ok_or_else(|| {
            RuntimeError::Internal(format!("page {index} beyond the block table"))
        })?;
        let mut page = self.pages[page_ref.page as usize].write();
        self.check_tag(&seq.owner, page_ref, &page, Access::Write)?;
        let run = tokens * self.layout.kv_dim;
        let bytes = run * std::mem::size_of::<f32>();
        let mut chunks = data.chunks_exact(bytes);
        for layer in 0..self.layout.layers {
            for kind in 0..2 {
                let o = self.offset(layer, kind, 0);
                let src = chunks.next().expect("length checked above");
                bytemuck::cast_slice_mut::<f32, u8>(&mut page.data[o..o + run])
                    .copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// Run `f` on the bytes of a full page that `owner` holds, in wire order (for a full page
    /// that is its memory order), under the page's read lock and after its owner check. For
    /// sending a page without copying it out first; `f` runs under the lock, so it must not
    /// block (a non-blocking socket write, a MAC update).
    pub fn with_full_page<R>(
        &self,
        owner: &Owner,
        page_ref: PageRef,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RuntimeError> {
        let page = self.pages[page_ref.page as usize].read();
        self.check_tag(owner, page_ref, &page, Access::Read)?;
        Ok(f(bytemuck::cast_slice(&page.data)))
    }

    /// Run `f` on the bytes of page `index` of `seq`'s block table, all `page_size` slots in
    /// wire order, under the page's write lock and after its owner check. For receiving a
    /// full page straight into the pool; `f` must not block (a non-blocking socket read).
    pub fn with_full_page_mut<R>(
        &self,
        seq: &SeqKv,
        index: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RuntimeError> {
        let page_ref = *seq.table.get(index).ok_or_else(|| {
            RuntimeError::Internal(format!("page {index} beyond the block table"))
        })?;
        let mut page = self.pages[page_ref.page as usize].write();
        self.check_tag(&seq.owner, page_ref, &page, Access::Write)?;
        Ok(f(bytemuck::cast_slice_mut(&mut page.data)))
    }

    /// Take an extra hold on the pages of `seq` (a transfer or reader), checked against the
    /// owner. The pages stay out of the free list until `unhold`, even after `release`.
    pub fn hold(&self, seq: &SeqKv) -> Result<Vec<PageRef>, RuntimeError> {
        for &page_ref in &seq.table {
            let page = self.pages[page_ref.page as usize].read();
            self.check_tag(&seq.owner, page_ref, &page, Access::Read)?;
        }
        let mut meta = self.meta.lock();
        for p in &seq.table {
            meta.state[p.page as usize].holders += 1;
        }
        Ok(seq.table.clone())
    }

    /// Drop a hold taken with `hold`.
    pub fn unhold(&self, pages: &[PageRef]) {
        let mut to_free = Vec::new();
        {
            let mut meta = self.meta.lock();
            for p in pages {
                let st = &mut meta.state[p.page as usize];
                if st.epoch == p.epoch && st.holders > 0 {
                    st.holders -= 1;
                    if st.holders == 0 {
                        meta.let_go(p.page, &mut to_free);
                    }
                }
            }
        }
        self.free_pages(&to_free);
    }

    /// End a sequence: drop the owner's hold on each page and return unused reservation.
    /// Pages with no other holder are poisoned and go to the back of the free list.
    /// Idempotent.
    pub fn release(&self, seq: &mut SeqKv) {
        if seq.released {
            return;
        }
        seq.released = true;
        let mut table = std::mem::take(&mut seq.table);
        // A forged entry may name a live page of another sequence, even with its epoch: letting
        // go of it would free (or unpin) what that sequence still uses. Check each tag first.
        table.retain(|&p| {
            let page = self.pages[p.page as usize].read();
            self.check_tag(&seq.owner, p, &page, Access::Read).is_ok()
        });
        let mut to_free = Vec::new();
        {
            let mut meta = self.meta.lock();
            meta.reserved -= seq.reservation.pages;
            seq.reservation.pages = 0;
            for p in &table {
                let st = &mut meta.state[p.page as usize];
                // A stale or forged entry names a page this sequence does not hold: releasing
                // it would free someone else's page. Refuse, and raise the alarm.
                if !st.allocated || st.epoch != p.epoch || st.holders == 0 {
                    self.isolation_violations.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(page = p.page, "release of a page not held by its sequence");
                    continue;
                }
                st.holders -= 1;
                if st.holders == 0 {
                    meta.let_go(p.page, &mut to_free);
                }
            }
        }
        // Wakes `reserve_by` waiters: the unused reservation is room again.
        self.free_pages(&to_free);
    }

    fn free_pages(&self, pages: &[u32]) {
        for &page in pages {
            // Poison and untag before the page becomes allocatable again.
            let mut data = self.pages[page as usize].write();
            data.tag = None;
            data.data.fill(POISON);
        }
        let mut meta = self.meta.lock();
        for &page in pages {
            meta.state[page as usize].allocated = false;
            meta.free.push_back(page);
        }
        drop(meta);
        self.room.notify_waiters();
    }

    /// Whether a page (for tests and audits) is free and poisoned.
    pub fn page_is_poisoned(&self, page: u32) -> bool {
        let data = self.pages[page as usize].read();
        data.tag.is_none() && data.data.iter().all(|x| x.is_nan())
    }
}

/// One layer's K/V of a sequence's pages, owner-checked and read-locked (see
/// [`KvPool::read_layer`]).
pub struct LayerView<'a> {
    guards: Vec<RwLockReadGuard<'a, PageData>>,
    k_at: usize,
    v_at: usize,
    floats: usize,
    len: usize,
}

impl LayerView<'_> {
    /// Positions covered.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Each page's K and V, `[page_size, kv_dim]` row-major; slots at or past `len()` in
    /// the last page hold nothing of this sequence's past and must not be read.
    pub fn pages(&self) -> Vec<(&[f32], &[f32])> {
        self.guards
            .iter()
            .map(|g| {
                (
                    &g.data[self.k_at..self.k_at + self.floats],
                    &g.data[self.v_at..self.v_at + self.floats],
                )
            })
            .collect()
    }
}

impl Drop for SeqKv {
    fn drop(&mut self) {
        // A sequence must be released through its pool; one dropped without that would pin
        // its pages. The scheduler always releases; this names the bug if that changes.
        if !(std::thread::panicking()
            || self.released
            || (self.table.is_empty() && self.reservation.pages == 0))
        {
            tracing::error!(
                request = %self.owner.request,
                pages = self.table.len(),
                "a KV sequence was dropped without release: its pages stay pinned"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_dim: 4,
        }
    }
    fn owner(t: &str, r: u64) -> Owner {
        Owner::new(t, r)
    }

    fn ns(t: &str) -> CacheNamespace {
        owner(t, 0).namespace()
    }

    /// Writes `tokens` positions of `seq` with values that name `tag` and the position.
    fn fill(pool: &KvPool, seq: &mut SeqKv, tokens: usize, tag: f32) {
        pool.grow(seq, tokens).unwrap();
        let start = seq.len();
        let k: Vec<f32> = (0..tokens * 4)
            .map(|i| tag + (start * 4 + i) as f32)
            .collect();
        for layer in 0..2 {
            pool.write(seq, layer, start, &k, &k).unwrap();
        }
        pool.commit(seq, tokens);
    }

    #[test]
    fn a_published_prefix_is_reused_by_its_namespace_alone() {
        let pool = KvPool::new(layout(), 4, 8);
        let prompt: Vec<u32> = (0..9).collect();
        let keys = |t: &str| crate::kv::prefix_hashes("m", &ns(t), &prompt, 4, 2);
        let mut a = pool.open(owner("a", 1), pool.try_reserve(9).unwrap());
        fill(&pool, &mut a, 9, 1000.0);
        pool.publish_prefix(&a, &keys("a"), &prompt).unwrap();
        // The owner still reads its published pages, and may no longer write them.
        let (mut k, mut v) = (Vec::new(), Vec::new());
        pool.read(&a, 0, 9, &mut k, &mut v).unwrap();
        assert!(matches!(
            pool.write(&a, 0, 0, &[0.0; 4], &[0.0; 4]),
            Err(RuntimeError::Isolation(_))
        ));
        let cached = a.block_table()[0];
        pool.release(&mut a);
        let s = pool.stats();
        assert_eq!((s.pages_free, s.pages_cached), (8, 2), "{s:?}");
        assert!(!pool.page_is_poisoned(cached.page), "kept for reuse");

        // Same namespace: both pages found, held, and read as written; only the rest reserved.
        let hit = pool
            .lookup_and_reserve(&ns("a"), &keys("a"), &prompt, 9, 12)
            .unwrap();
        assert_eq!((hit.pages(), hit.reservation.pages), (2, 1));
        let mut again = pool.open_with_prefix(owner("a", 2), hit).unwrap();
        assert_eq!(again.len(), 8);
        let (mut k2, mut v2) = (Vec::new(), Vec::new());
        pool.read(&again, 0, 8, &mut k2, &mut v2).unwrap();
        assert_eq!(k2, k[..32]);
        fill(&pool, &mut again, 4, 5000.0);

        // Another tenant (or a salt) finds nothing: its keys differ, and so does its namespace.
        let other = pool
            .lookup_and_reserve(&ns("b"), &keys("b"), &prompt, 9, 12)
            .unwrap();
        assert_eq!((other.pages(), other.partial_tokens()), (0, 0));
        let mut b = pool.open_with_prefix(owner("b", 3), other).unwrap();
        let salted = Owner {
            cache_salt: Some("s".into()),
            ..owner("a", 4)
        };
        let none = pool
            .lookup_and_reserve(&salted.namespace(), &keys("a"), &prompt, 9, 4)
            .unwrap();
        assert_eq!((none.pages(), none.partial_tokens()), (0, 0));
        let mut s = pool.open_with_prefix(salted, none).unwrap();
        // Even with a's keys, a lookup in b's namespace hands out nothing of a's pages.
        let forged_key = pool
            .lookup_and_reserve(&ns("b"), &keys("a"), &prompt, 9, 4)
            .unwrap();
        assert_eq!((forged_key.pages(), forged_key.partial_tokens()), (0, 0));
        let mut f = pool.open_with_prefix(owner("b", 5), forged_key).unwrap();
        // A forged block-table entry to the cached page: refused, with the alarm.
        for thief in [&mut b, &mut s] {
            thief.forge_block_table_entry_push(cached);
            let before = pool.isolation_violations();
            assert!(matches!(
                pool.read(thief, 0, 4, &mut k2, &mut v2),
                Err(RuntimeError::Isolation(_))
            ));
            assert_eq!(pool.isolation_violations(), before + 1);
            pool.release(thief); // refuses to let go of the forged entry (one more alarm)
        }
        pool.release(&mut f);
        pool.release(&mut again);
        assert_eq!(pool.stats().pages_free, 8);
        assert_eq!(pool.stats().pages_cached, 2);
        assert_eq!((pool.stats().cache_hits, pool.stats().cache_misses), (2, 6));
    }

    #[test]
    fn a_partly_matching_page_is_copied_not_shared() {
        let pool = KvPool::new(layout(), 4, 8);
        let prompt: Vec<u32> = (0..8).collect();
        let keys = crate::kv::prefix_hashes("m", &ns("a"), &prompt, 4, 2);
        let mut a = pool.open(owner("a", 1), pool.try_reserve(8).unwrap());
        fill(&pool, &mut a, 8, 1000.0);
        pool.publish_prefix(&a, &keys, &prompt).unwrap();
        let (mut written, mut v) = (Vec::new(), Vec::new());
        pool.read(&a, 1, 8, &mut written, &mut v).unwrap();
        pool.release(&mut a);
        // Shares the first page and two tokens of the second.
        let other: Vec<u32> = vec![0, 1, 2, 3, 4, 5, 99, 98, 97];
        let other_keys = crate::kv::prefix_hashes("m", &ns("a"), &other, 4, 2);
        let hit = pool
            .lookup_and_reserve(&ns("a"), &other_keys, &other, 8, 12)
            .unwrap();
        assert_eq!((hit.pages(), hit.partial_tokens()), (1, 2));
        let mut b = pool.open_with_prefix(owner("a", 2), hit).unwrap();
        assert_eq!(b.len(), 6);
        assert_eq!(b.block_table().len(), 2);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        pool.read(&b, 1, 6, &mut k, &mut v).unwrap();
        assert_eq!(k, written[..24], "the copied slots hold what was written");
        // b's second page is its own: it writes on; the cached page is unchanged.
        fill(&pool, &mut b, 3, 5000.0);
        let hit = pool
            .lookup_and_reserve(&ns("a"), &keys, &prompt, 7, 8)
            .unwrap();
        assert_eq!((hit.pages(), hit.partial_tokens()), (1, 3));
        let mut c = pool.open_with_prefix(owner("a", 3), hit).unwrap();
        pool.read(&c, 1, 7, &mut k, &mut v).unwrap();
        assert_eq!(k, written[..28]);
        pool.release(&mut b);
        pool.release(&mut c);
        let s = pool.stats();
        assert_eq!(
            (s.pages_free, s.pages_cached, s.isolation_violations),
            (8, 2, 0)
        );
    }

    #[test]
    fn eviction_takes_only_pages_no_one_holds_and_poisons_them() {
        let pool = KvPool::new(layout(), 4, 4);
        let prompt: Vec<u32> = (0..8).collect();
        let keys = crate::kv::prefix_hashes("m", &ns("a"), &prompt, 4, 2);
        let mut a = pool.open(owner("a", 1), pool.try_reserve(8).unwrap());
        fill(&pool, &mut a, 8, 1000.0);
        pool.publish_prefix(&a, &keys, &prompt).unwrap();
        pool.release(&mut a);
        // One cached page in use, one evictable, two free: three pages of room.
        let hit = pool
            .lookup_and_reserve(&ns("a"), &keys, &prompt[..4], 4, 4)
            .unwrap();
        assert_eq!((hit.pages(), hit.partial_tokens()), (1, 0));
        let mut user = pool.open_with_prefix(owner("a", 2), hit).unwrap();
        assert_eq!(
            pool.try_reserve(16).unwrap_err(),
            PoolFull {
                wanted: 4,
                available: 3
            }
        );
        let mut b = pool.open(owner("b", 3), pool.try_reserve(12).unwrap());
        pool.grow(&mut b, 12).unwrap();
        let s = pool.stats();
        assert_eq!((s.cache_evictions, s.pages_cached, s.pages_free), (1, 1, 0));
        // The evicted page is b's now and holds nothing of a's; the held one is intact.
        let (mut k, mut v) = (Vec::new(), Vec::new());
        pool.read(&b, 0, 12, &mut k, &mut v).unwrap();
        assert!(k.iter().all(|x| x.is_nan()), "evicted pages are poisoned");
        pool.read(&user, 0, 4, &mut k, &mut v).unwrap();
        assert_eq!(k[0], 1000.0);
        // The evicted key is gone: a lookup finds the first page only.
        pool.release(&mut user);
        pool.release(&mut b);
        let hit = pool
            .lookup_and_reserve(&ns("a"), &keys, &prompt, 8, 8)
            .unwrap();
        assert_eq!((hit.pages(), hit.partial_tokens()), (1, 0));
        let mut last = pool.open_with_prefix(owner("a", 4), hit).unwrap();
        pool.release(&mut last);
        assert_eq!(pool.stats().pages_free, 4);
    }

    #[test]
    fn holding_an_evictable_page_costs_room_a_reservation_was_promised() {
        let pool = KvPool::new(layout(), 4, 2);
        let prompt: Vec<u32> = (0..4).collect();
        let keys = crate::kv::prefix_hashes("m", &ns("a"), &prompt, 4, 1);
        let mut a = pool.open(owner("a", 1), pool.try_reserve(4).unwrap());
        fill(&pool, &mut a, 4, 1.0);
        pool.publish_prefix(&a, &keys, &prompt).unwrap();
        pool.release(&mut a);
        // b is promised both pages (one free, one evictable); a hit may not take the second.
        let mut b = pool.open(owner("b", 2), pool.try_reserve(8).unwrap());
        assert_eq!(
            pool.lookup_and_reserve(&ns("a"), &keys, &prompt, 4, 4)
                .unwrap_err(),
            PoolFull {
                wanted: 1,
                available: 0
            }
        );
        pool.grow(&mut b, 8).unwrap();
        pool.release(&mut b);
    }

    #[test]
    fn read_layer_lends_the_written_pages_and_refuses_a_forged_one() {
        let pool = KvPool::new(layout(), 4, 8);
        let mut a = pool.open(owner("a", 1), pool.try_reserve(6).unwrap());
        let mut b = pool.open(owner("b", 2), pool.try_reserve(6).unwrap());
        pool.grow(&mut a, 6).unwrap();
        pool.grow(&mut b, 6).unwrap();
        let k: Vec<f32> = (0..24).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..24).map(|x| -(x as f32)).collect();
        pool.write(&a, 1, 0, &k, &v).unwrap();
        pool.commit(&mut a, 6);
        {
            let view = pool.read_layer(&a, 1, 6).unwrap();
            let pages = view.pages();
            assert_eq!(pages.len(), 2);
            assert_eq!(pages[0].0, &k[..16]);
            assert_eq!(&pages[1].1[..8], &v[16..]);
        }
        let own = b.block_table()[1];
        b.forge_block_table_entry(1, a.block_table()[0]);
        assert!(matches!(
            pool.read_layer(&b, 0, 6),
            Err(RuntimeError::Isolation(_))
        ));
        assert_eq!(pool.isolation_violations(), 1);
        b.forge_block_table_entry(1, own);
        pool.release(&mut a);
        pool.release(&mut b);
    }

    #[test]
    fn write_then_read_round_trips_across_pages() {
        let pool = KvPool::new(layout(), 4, 8);
        let mut seq = pool.open(owner("a", 1), pool.try_reserve(10).unwrap());
        pool.grow(&mut seq, 10).unwrap();
        let k: Vec<f32> = (0..40).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..40).map(|x| -(x as f32)).collect();
        pool.write(&seq, 1, 0, &k, &v).unwrap();
        pool.commit(&mut seq, 10);
        let (mut ko, mut vo) = (Vec::new(), Vec::new());
        pool.read(&seq, 1, 10, &mut ko, &mut vo).unwrap();
        assert_eq!(ko, k);
        assert_eq!(vo, v);
        pool.release(&mut seq);
        assert_eq!(pool.stats().pages_free, 8);
    }

    #[test]
    fn exported_pages_import_as_the_same_bytes() {
        let (src, dst) = (KvPool::new(layout(), 4, 4), KvPool::new(layout(), 4, 4));
        let mut a = src.open(owner("a", 1), src.try_reserve(6).unwrap());
        src.grow(&mut a, 6).unwrap();
        for layer in 0..2 {
            let k: Vec<f32> = (0..24).map(|x| (x + 100 * layer) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            src.write(&a, layer, 0, &k, &v).unwrap();
        }
        src.commit(&mut a, 6);
        let mut b = dst.open(owner("b", 9), dst.try_reserve(6).unwrap());
        dst.grow(&mut b, 6).unwrap();
        for (i, tokens) in [(0, 4), (1, 2)] {
            let mut wire = Vec::new();
            src.export_page(a.owner(), a.block_table()[i], tokens, &mut wire)
                .unwrap();
            assert_eq!(wire.len(), src.wire_bytes(tokens));
            dst.import_page(&b, i, tokens, &wire).unwrap();
            let mut back = Vec::new();
            dst.export_page(b.owner(), b.block_table()[i], tokens, &mut back)
                .unwrap();
            assert_eq!(back, wire, "page {i} arrives as sent");
        }
        // A full page is the same bytes in place as exported, and writable in place.
        let mut wire = Vec::new();
        src.export_page(a.owner(), a.block_table()[0], 4, &mut wire)
            .unwrap();
        let in_place = src
            .with_full_page(a.owner(), a.block_table()[0], <[u8]>::to_vec)
            .unwrap();
        assert_eq!(in_place, wire);
        dst.with_full_page_mut(&b, 0, |page| page.copy_from_slice(&wire))
            .unwrap();
        let mut back = Vec::new();
        dst.export_page(b.owner(), b.block_table()[0], 4, &mut back)
            .unwrap();
        assert_eq!(back, wire);
        // Another owner cannot touch a's page, in place or not.
        assert!(matches!(
            src.with_full_page(&owner("x", 3), a.block_table()[0], |_| ()),
            Err(RuntimeError::Isolation(_))
        ));
        let mut forged = src.open(owner("x", 4), src.try_reserve(0).unwrap());
        forged.forge_block_table_entry_push(a.block_table()[0]);
        assert!(matches!(
            src.with_full_page_mut(&forged, 0, |page| page.fill(0)),
            Err(RuntimeError::Isolation(_))
        ));
        forged.forge_block_table_entry(
            0,
            PageRef {
                page: 0,
                epoch: u64::MAX,
            },
        );
        src.release(&mut forged); // refuses to free the forged entry (one more alarm)
        let intact = src
            .with_full_page(a.owner(), a.block_table()[0], <[u8]>::to_vec)
            .unwrap();
        assert_eq!(intact, wire, "the refused write changed nothing");
        let mut out = Vec::new();
        assert!(matches!(
            src.export_page(&owner("x", 3), a.block_table()[0], 4, &mut out),
            Err(RuntimeError::Isolation(_))
        ));
        assert!(out.is_empty());
        src.release(&mut a);
        dst.release(&mut b);
    }

    #[tokio::test]
    async fn reserve_by_waits_for_a_release_and_gives_up_at_its_deadline() {
        let pool = Arc::new(KvPool::new(layout(), 4, 2));
        let mut holder = pool.open(owner("a", 1), pool.try_reserve(8).unwrap());
        pool.grow(&mut holder, 8).unwrap();
        let soon = tokio::time::Instant::now() + std::time::Duration::from_millis(20);
        let full = pool.reserve_by(4, soon).await.unwrap_err();
        assert_eq!((full.wanted, full.available), (1, 0));
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let later = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
                pool.reserve_by(8, later).await
            })
        };
        tokio::task::yield_now().await;
        pool.release(&mut holder);
        let r = waiter.await.unwrap().expect("woken by the release");
        let mut seq = pool.open(owner("b", 2), r);
        pool.release(&mut seq);
        assert_eq!(pool.stats().pages_free, 2);
    }

    #[test]
    fn forged_block_table_is_refused_and_counted() {
        let pool = KvPool::new(layout(), 4, 8);
        let mut victim = pool.open(owner("victim", 1), pool.try_reserve(4).unwrap());
        pool.grow(&mut victim, 4).unwrap();
        pool.write(&victim, 0, 0, &[7.0; 16], &[7.0; 16]).unwrap();
        pool.commit(&mut victim, 4);
        let mut thief = pool.open(owner("thief", 2), pool.try_reserve(4).unwrap());
        pool.grow(&mut thief, 4).unwrap();
        let own = thief.block_table()[0];
        thief.forge_block_table_entry(0, victim.block_table()[0]);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        let err = pool.read(&thief, 0, 4, &mut k, &mut v).unwrap_err();
        assert!(matches!(err, RuntimeError::Isolation(_)), "{err:?}");
        assert!(k.is_empty(), "no data of the victim may be copied out");
        assert_eq!(pool.isolation_violations(), 1);
        // A forged write is refused too, and the victim's data is intact.
        assert!(pool.write(&thief, 0, 0, &[0.0; 4], &[0.0; 4]).is_err());
        pool.read(&victim, 0, 4, &mut k, &mut v).unwrap();
        assert!(k.iter().all(|&x| x == 7.0));
        thief.forge_block_table_entry(0, own);
        pool.release(&mut thief);
        pool.release(&mut victim);
    }

    #[test]
    fn stale_epoch_is_refused_after_reuse() {
        let pool = KvPool::new(layout(), 4, 1);
        let mut first = pool.open(owner("a", 1), pool.try_reserve(4).unwrap());
        pool.grow(&mut first, 4).unwrap();
        let stale = first.block_table()[0];
        pool.release(&mut first);
        assert!(pool.page_is_poisoned(stale.page));
        // Same tenant, same request id even: the epoch differs, so the old ref is dead.
        let mut second = pool.open(owner("a", 1), pool.try_reserve(4).unwrap());
        pool.grow(&mut second, 4).unwrap();
        let current = second.block_table()[0];
        assert_ne!(current.epoch, stale.epoch);
        second.forge_block_table_entry(0, stale);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        assert!(pool.read(&second, 0, 1, &mut k, &mut v).is_err());
        // Releasing through the stale entry must not free the page now held under a new epoch.
        let mut stale_holder = pool.open(owner("a", 1), pool.try_reserve(0).unwrap());
        stale_holder.forge_block_table_entry_push(stale);
        pool.release(&mut stale_holder);
        assert_eq!(pool.stats().pages_free, 0, "the live page stays allocated");
        second.forge_block_table_entry(0, current);
        pool.release(&mut second);
        assert_eq!(pool.stats().pages_free, 1);
    }

    #[test]
    fn release_is_deferred_while_a_holder_remains() {
        let pool = KvPool::new(layout(), 4, 2);
        let mut seq = pool.open(owner("a", 1), pool.try_reserve(8).unwrap());
        pool.grow(&mut seq, 8).unwrap();
        let held = pool.hold(&seq).unwrap();
        pool.release(&mut seq);
        assert_eq!(
            pool.stats().pages_free,
            0,
            "held pages stay out of the free list"
        );
        assert!(pool.try_reserve(1).is_err());
        pool.unhold(&held);
        assert_eq!(pool.stats().pages_free, 2);
        assert!(held.iter().all(|p| pool.page_is_poisoned(p.page)));
    }

    #[test]
    fn freed_pages_are_reused_first_in_first_out() {
        let pool = KvPool::new(layout(), 1, 3);
        let mut a = pool.open(owner("a", 1), pool.try_reserve(1).unwrap());
        pool.grow(&mut a, 1).unwrap();
        let freed = a.block_table()[0].page;
        pool.release(&mut a);
        let mut b = pool.open(owner("b", 2), pool.try_reserve(1).unwrap());
        pool.grow(&mut b, 1).unwrap();
        assert_ne!(
            b.block_table()[0].page,
            freed,
            "a just-freed page is not reused first"
        );
        pool.release(&mut b);
    }

    #[test]
    fn reservation_is_all_or_nothing() {
        let pool = KvPool::new(layout(), 4, 4);
        let r = pool.try_reserve(12).unwrap();
        let err = pool.try_reserve(8).unwrap_err();
        assert_eq!(
            err,
            PoolFull {
                wanted: 2,
                available: 1
            }
        );
        let mut s = pool.open(owner("a", 1), r);
        pool.release(&mut s);
        assert_eq!(pool.stats().pages_reserved, 0);
        assert!(pool.try_reserve(16).is_ok_and(|r| {
            let mut s = pool.open(owner("a", 2), r);
            pool.release(&mut s);
            true
        }));
    }
}
