//! Keys of the tenant-scoped prefix cache: a cache namespace and the hash chain of a prompt's
//! full pages.
//!
//! A page's key hashes its parent page's key with its own tokens (vLLM's block hashing), so
//! two prompts share the keys of exactly their common full pages. The chain starts from the
//! model and the namespace, so the same tokens in two namespaces never share a key; the pool
//! also compares the namespace itself on every hit and every read.

use std::sync::Arc;

/// Whose cached prefix pages a sequence may reuse: its tenant, as the node was told by the
/// authenticated control plane, narrowed by the client's optional cache salt. Never wider
/// than the tenant: a salt only splits a tenant's cache, it cannot name another tenant's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheNamespace {
    pub tenant: Arc<str>,
    pub salt: Option<Arc<str>>,
}

/// The key of one full page of a prompt: a BLAKE3 hash over the chain up to it.
pub type BlockHash = [u8; 32];

/// A prompt's page keys and the root they hang from (the model and namespace's own key):
/// page `i`'s parent is page `i - 1`'s key, or the root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptKeys {
    pub root: BlockHash,
    pub pages: Vec<BlockHash>,
}

impl PromptKeys {
    /// The key page `index` hangs from.
    pub fn parent(&self, index: usize) -> BlockHash {
        match index {
            0 => self.root,
            i => self.pages[i - 1],
        }
    }
}

/// The keys of the first `pages` full pages of `tokens` (fewer if `tokens` holds fewer full
/// pages), for `model` in `namespace`.
pub fn prefix_hashes(
    model: &str,
    namespace: &CacheNamespace,
    tokens: &[u32],
    page_size: usize,
    pages: usize,
) -> PromptKeys {
    let mut root = blake3::Hasher::new();
    root.update(b"bulkhead prefix cache v1\0");
    // Length-prefixed fields, so no two (model, tenant, salt) triples hash the same bytes.
    for field in [
        Some(model),
        Some(&*namespace.tenant),
        namespace.salt.as_deref(),
    ] {
        match field {
            Some(f) => {
                root.update(&[1]);
                root.update(&(f.len() as u64).to_le_bytes());
                root.update(f.as_bytes());
            }
            None => {
                root.update(&[0]);
            }
        }
    }
    let root: BlockHash = *root.finalize().as_bytes();
    let mut parent = root;
    let pages = tokens
        .chunks_exact(page_size.max(1))
        .take(pages)
        .map(|page| {
            let mut h = blake3::Hasher::new();
            h.update(&parent);
            for t in page {
                h.update(&t.to_le_bytes());
            }
            parent = *h.finalize().as_bytes();
            parent
        })
        .collect();
    PromptKeys { root, pages }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(tenant: &str, salt: Option<&str>) -> CacheNamespace {
        CacheNamespace {
            tenant: tenant.into(),
            salt: salt.map(Into::into),
        }
    }

    #[test]
    fn a_chain_shares_exactly_the_common_full_pages_of_one_namespace() {
        let a: Vec<u32> = (0..20).collect();
        let mut b = a.clone();
        b[9] = 99; // differs in the third page of 4
        let h = |t: &[u32], n: &CacheNamespace| prefix_hashes("m", n, t, 4, usize::MAX).pages;
        let (ha, hb) = (h(&a, &ns("x", None)), h(&b, &ns("x", None)));
        assert_eq!(ha.len(), 5);
        assert_eq!(ha[..2], hb[..2]);
        assert!(ha[2..].iter().zip(&hb[2..]).all(|(x, y)| x != y));
        // Another tenant, a salt, another model: nothing shared.
        for other in [
            h(&a, &ns("y", None)),
            h(&a, &ns("x", Some("s"))),
            prefix_hashes("n", &ns("x", None), &a, 4, 5).pages,
        ] {
            assert!(ha.iter().zip(&other).all(|(x, y)| x != y));
        }
        // A tenant named like tenant + salt does not collide with the salted namespace.
        assert_ne!(h(&a, &ns("xs", None))[0], h(&a, &ns("x", Some("s")))[0]);
        let two = prefix_hashes("m", &ns("x", None), &a, 4, 2);
        assert_eq!(two.pages, ha[..2]);
        assert_eq!(two.parent(1), ha[0]);
        assert_ne!(
            two.parent(0),
            prefix_hashes("m", &ns("y", None), &a, 4, 2).root
        );
    }
}
