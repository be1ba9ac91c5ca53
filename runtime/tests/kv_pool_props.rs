//! Property tests of the KV pool: random interleavings of allocate / append / read / hold /
//! release / cancel across many sequences and tenants.

use std::collections::HashSet;

use bulkhead_runtime::error::RuntimeError;
use bulkhead_runtime::kv::{KvLayout, KvPool, Owner, PageRef, SeqKv};
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
                        let owner = Owner { tenant: format!("t{tenant}").into(), request: next_request };
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
