//! The paged KV pool: the isolation core of a node.
//!
//! K/V of every running sequence live only here, in fixed-size pages. Each page carries an
//! owner tag; each read and write checks it against the sequence that asks. See `pool.rs`.

mod pool;
mod prefix;

pub use pool::{
    KvLayout, KvPool, LayerView, Owner, POISON, PageRef, PoolFull, PoolStats, PrefixHit,
    Reservation, SeqKv,
};
pub use prefix::{BlockHash, CacheNamespace, PromptKeys, prefix_hashes};
