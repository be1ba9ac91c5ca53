//! Property tests of the KV pool: random interleavings of allocate / append / read / hold /
//! release / cancel across many sequences and tenants, and of the prefix cache's admit (with
//! hits) / prefill and publish / decode / read / release, where evictions happen whenever the
//! free list runs dry.

use std::collections::{HashMap, HashSet};

use bulkhead_runtime::error::RuntimeError;
use bulkhead_runtime::kv::{KvLayout, KvPool, Owner, PageRef, PromptKeys, SeqKv, prefix_hashes};
use proptest::prelude::*;

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    kv_dim: 3,
};
const PAGE: usize = 4;
const PAGES: usize = 12;

#[derive(Debug, Clone)]
enum Op {
    Open { tenant: u8, tokens: usize },
    Append { seq: usize, n: usize },
    Read { seq: usize },
    Hold { seq: usize },
    Unhold { hold: usize },
    Release { seq: usize },
    Forge { thief: usize, victim: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 1usize..20).prop_map(|(tenant, tokens)| Op::Open { tenant, tokens }),
        4 => (0usize..8, 1usize..7).prop_map(|(seq, n)| Op::Append { seq, n }),
        3 => (0usize..8).prop_map(|seq| Op::Read { seq }),
        1 => (0usize..8).prop_map(|seq| Op::Hold { seq }),
        1 => (0usize..8).prop_map(|hold| Op::Unhold { hold }),
        2 => (0usize..8).prop_map(|seq| Op::Release { seq }),
        1 => (0usize..8, 0usize..8).prop_map(|(thief, victim)| Op::Forge { thief, victim }),
    ]
}

/// The value a sequence writes at (layer, kind, position, lane): unique per request.
fn value(request: u64, layer: usize, kind: usize, pos: usize, lane: usize) -> f32 {
    (request * 100_000 + (layer * 2 + kind) as u64 * 10_000 + pos as u64 * 10 + lane as u64) as f32
}

struct Live {
    kv: SeqKv,
    limit: usize,
}

fn append(pool: &KvPool, live: &mut Live, n: usize) -> Result<(), RuntimeError> {
    let start = live.kv.len();
    let n = n.min(live.limit - start);
    if n == 0 {
        return Ok(());
    }
    pool.grow(&mut live.kv, n)?;
    let req = live.kv.owner().request;
    for layer in 0..LAYOUT.layers {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for pos in start..start + n {
            for lane in 0..LAYOUT.kv_dim {
                k.push(value(req, layer, 0, pos, lane));
                v.push(value(req, layer, 1, pos, lane));
            }
        }
        pool.write(&live.kv, layer, start, &k, &v)?;
    }
    pool.commit(&mut live.kv, n);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_never_leaks_between_owners_nor_loses_pages(ops in prop::collection::vec(op(), 1..80)) {
        let pool = KvPool::new(LAYOUT, PAGE, PAGES);
        let mut live: Vec<Live> = Vec::new();
        let mut holds: Vec<Vec<PageRef>> = Vec::new();
        let mut next_request = 1u64;
        let mut expected_violations = 0u64;
        for op in ops {
            match op {
                Op::Open { tenant, tokens } => {
                    if let Ok(r) = pool.try_reserve(tokens) {
                        let owner = Owner::new(format!("t{tenant}"), next_request);
                        next_request += 1;
                        live.push(Live { kv: pool.open(owner, r), limit: tokens });
                    }
                }
                Op::Append { seq, n } => {
                    if let Some(l) = live.get_mut(seq) {
                        append(&pool, l, n).expect("an owner may always append within its reservation");
                    }
                }
                Op::Read { seq } => {
                    if let Some(l) = live.get(seq) {
                        let req = l.kv.owner().request;
                        for layer in 0..LAYOUT.layers {
                            let (mut k, mut v) = (Vec::new(), Vec::new());
                            pool.read(&l.kv, layer, l.kv.len(), &mut k, &mut v).expect("owner read");
                            for pos in 0..l.kv.len() {
                                for lane in 0..LAYOUT.kv_dim {
                                    let i = pos * LAYOUT.kv_dim + lane;
                                    prop_assert_eq!(k[i], value(req, layer, 0, pos, lane));
                                    prop_assert_eq!(v[i], value(req, layer, 1, pos, lane));
                                }
                            }
                        }
                    }
                }
                Op::Hold { seq } => {
                    if let Some(l) = live.get(seq) {
                        holds.push(pool.hold(&l.kv).expect("owner hold"));
                    }
                }
                Op::Unhold { hold } => {
                    if hold < holds.len() {
                        let h = holds.swap_remove(hold);
                        pool.unhold(&h);
                    }
                }
                Op::Release { seq } => {
                    if seq < live.len() {
                        let mut l = live.swap_remove(seq);
                        pool.release(&mut l.kv);
                    }
                }
                Op::Forge { thief, victim } => {
                    if thief != victim && thief < live.len() && victim < live.len()
                        && !live[thief].kv.block_table().is_empty()
                        && !live[victim].kv.block_table().is_empty()
                    {
                        let stolen = live[victim].kv.block_table()[0];
                        let original = live[thief].kv.block_table()[0];
                        live[thief].kv.forge_block_table_entry(0, stolen);
                        let (mut k, mut v) = (Vec::new(), Vec::new());
                        let r = pool.read(&live[thief].kv, 0, 1, &mut k, &mut v);
                        prop_assert!(matches!(r, Err(RuntimeError::Isolation(_))));
                        prop_assert!(k.is_empty());
                        expected_violations += 1;
                        live[thief].kv.forge_block_table_entry(0, original);
                    }
                }
            }
            // No page is in two live block tables; every live page is out of the free list.
            let mut seen = HashSet::new();
            for l in &live {
                for p in l.kv.block_table() {
                    prop_assert!(seen.insert(p.page), "page {} in two block tables", p.page);
                }
            }
            let held: HashSet<u32> = holds.iter().flatten().map(|p| p.page).collect();
            let in_use = seen.union(&held).count();
            let s = pool.stats();
            prop_assert_eq!(s.pages_free + in_use, PAGES, "pages lost or double-freed");
            prop_assert_eq!(s.isolation_violations, expected_violations);
        }
        for mut l in live.drain(..) {
            pool.release(&mut l.kv);
        }
        for h in holds.drain(..) {
            pool.unhold(&h);
        }
        let s = pool.stats();
        prop_assert_eq!(s.pages_free, PAGES);
        prop_assert_eq!(s.pages_reserved, 0);
        for page in 0..PAGES as u32 {
            prop_assert!(pool.page_is_poisoned(page), "page {} not poisoned after release", page);
        }
    }
}

#[derive(Debug, Clone)]
enum CacheOp {
    /// A request of `tenant` whose prompt is the first `len` tokens of prompt `prompt` (so
    /// prompts of one number share prefixes), with room for `extra` generated tokens.
    Admit {
        tenant: u8,
        prompt: u8,
        len: usize,
        extra: usize,
    },
    /// Write the rest of the prompt, then publish its full pages.
    Prefill {
        seq: usize,
    },
    Decode {
        seq: usize,
        n: usize,
    },
    Read {
        seq: usize,
    },
    Release {
        seq: usize,
    },
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        3 => (0u8..3, 0u8..3, 1usize..24, 0usize..8).prop_map(|(tenant, prompt, len, extra)| {
            CacheOp::Admit { tenant, prompt, len, extra }
        }),
        3 => (0usize..6).prop_map(|seq| CacheOp::Prefill { seq }),
        2 => (0usize..6, 1usize..5).prop_map(|(seq, n)| CacheOp::Decode { seq, n }),
        2 => (0usize..6).prop_map(|seq| CacheOp::Read { seq }),
        2 => (0usize..6).prop_map(|seq| CacheOp::Release { seq }),
    ]
}

/// The K/V a tenant's sequence holds at a position: a function of the tenant, the token and
/// the position only, so a reused page holds what recomputing it would write, and a page of
/// another tenant reads as wrong.
fn cache_value(tenant: u8, token: u32, pos: usize, layer: usize, kind: usize, lane: usize) -> f32 {
    let mut x = (tenant as u64) << 56
        ^ (token as u64) << 24
        ^ (pos as u64) << 8
        ^ ((layer * 2 + kind) * 8 + lane) as u64;
    x = (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    // A finite positive float from 30 bits.
    f32::from_bits((x & 0x3FFF_FFFF) as u32)
}

struct CachedSeq {
    tenant: u8,
    kv: SeqKv,
    /// The prompt, then the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    keys: PromptKeys,
    limit: usize,
}

fn write_tokens(pool: &KvPool, s: &mut CachedSeq, upto: usize) -> Result<(), RuntimeError> {
    let start = s.kv.len();
    if upto <= start {
        return Ok(());
    }
    pool.grow(&mut s.kv, upto - start)?;
    for layer in 0..LAYOUT.layers {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for pos in start..upto {
            for lane in 0..LAYOUT.kv_dim {
                k.push(cache_value(s.tenant, s.tokens[pos], pos, layer, 0, lane));
                v.push(cache_value(s.tenant, s.tokens[pos], pos, layer, 1, lane));
            }
        }
        pool.write(&s.kv, layer, start, &k, &v)?;
    }
    pool.commit(&mut s.kv, upto - start);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_prefix_cache_shares_only_within_a_namespace_and_never_loses_a_page(
        ops in prop::collection::vec(cache_op(), 1..80)
    ) {
        let pool = KvPool::new(LAYOUT, PAGE, PAGES);
        let mut live: Vec<CachedSeq> = Vec::new();
        let mut next_request = 1u64;
        for op in ops {
            match op {
                CacheOp::Admit { tenant, prompt, len, extra } => {
                    let owner = Owner::new(format!("t{tenant}"), next_request);
                    next_request += 1;
                    let tokens: Vec<u32> = (0..len as u32).map(|i| prompt as u32 * 100 + i).collect();
                    let keys = prefix_hashes("m", &owner.namespace(), &tokens, PAGE, len / PAGE);
                    let reusable = len - 1;
                    if let Ok(hit) = pool.lookup_and_reserve(&owner.namespace(), &keys, &tokens, reusable, len + extra) {
                        let kv = pool.open_with_prefix(owner, hit).expect("a lookup's pages open");
                        prop_assert!(kv.len() <= reusable);
                        live.push(CachedSeq { tenant, kv, tokens, prompt_len: len, keys, limit: len + extra });
                    }
                }
                CacheOp::Prefill { seq } => {
                    if let Some(s) = live.get_mut(seq) {
                        let len = s.prompt_len;
                        write_tokens(&pool, s, len).expect("prefill within the reservation");
                        pool.publish_prefix(&s.kv, &s.keys, &s.tokens[..len]).expect("publish the prompt's pages");
                    }
                }
                CacheOp::Decode { seq, n } => {
                    if let Some(s) = live.get_mut(seq)
                        && s.kv.len() >= s.prompt_len
                    {
                        let upto = (s.kv.len() + n).min(s.limit);
                        while s.tokens.len() < upto {
                            s.tokens.push(10_000 + s.tokens.len() as u32);
                        }
                        write_tokens(&pool, s, upto).expect("decode within the reservation");
                    }
                }
                CacheOp::Read { seq } => {
                    if let Some(s) = live.get(seq) {
                        for layer in 0..LAYOUT.layers {
                            let (mut k, mut v) = (Vec::new(), Vec::new());
                            pool.read(&s.kv, layer, s.kv.len(), &mut k, &mut v).expect("own read");
                            for pos in 0..s.kv.len() {
                                for lane in 0..LAYOUT.kv_dim {
                                    let i = pos * LAYOUT.kv_dim + lane;
                                    prop_assert_eq!(k[i], cache_value(s.tenant, s.tokens[pos], pos, layer, 0, lane));
                                    prop_assert_eq!(v[i], cache_value(s.tenant, s.tokens[pos], pos, layer, 1, lane));
                                }
                            }
                        }
                    }
                }
                CacheOp::Release { seq } => {
                    if seq < live.len() {
                        let mut s = live.swap_remove(seq);
                        pool.release(&mut s.kv);
                    }
                }
            }
            // A page is shared only by sequences of one tenant; pages held plus pages free
            // (free or evictable) make the pool.
            let mut tenant_of: HashMap<PageRef, u8> = HashMap::new();
            for s in &live {
                for p in s.kv.block_table() {
                    let t = *tenant_of.entry(*p).or_insert(s.tenant);
                    prop_assert_eq!(t, s.tenant, "page {} shared across tenants", p.page);
                }
            }
            let held: HashSet<u32> = tenant_of.keys().map(|p| p.page).collect();
            let st = pool.stats();
            prop_assert_eq!(st.pages_free + held.len(), PAGES, "pages lost or double-counted");
            prop_assert_eq!(st.isolation_violations, 0);
        }
        for mut s in live.drain(..) {
            pool.release(&mut s.kv);
        }
        let st = pool.stats();
        prop_assert_eq!(st.pages_free, PAGES, "every page free or evictable");
        prop_assert_eq!(st.pages_reserved, 0);
        prop_assert_eq!(st.isolation_violations, 0);
        // A page neither free-listed nor cached is poisoned; a cached one is tagged.
        prop_assert!(st.pages_cached <= PAGES);
        let poisoned = (0..PAGES as u32).filter(|&p| pool.page_is_poisoned(p)).count();
        prop_assert!(poisoned + st.pages_cached >= PAGES, "{} poisoned, {} cached", poisoned, st.pages_cached);
    }
}
