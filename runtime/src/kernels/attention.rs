//! Causal attention of one query token straight over a sequence's KV pages (no copy of K/V).
//!
//! Scores for every position go into a small scratch row per head, then one softmax (max,
//! exp, normalise) per head and a pass over the V pages: the reference's order of operations
//! (`softmax(q k^T / sqrt(d)) v`), with grouped-query heads sharing each K/V row load.

use super::ops::dot;

/// Head geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

/// One page's K and V of one layer, `[page_size, kv_dim]` each (slots past the sequence's
/// length are not read).
pub type PageKv<'a> = (&'a [f32], &'a [f32]);

/// `out[n_head * head_dim]` = attention of `q[n_head * head_dim]` over positions `0..len`,
/// held `page_size` per page in `pages`. `scores` is scratch.
pub fn attend_token(
    heads: Heads,
    q: &[f32],
    pages: &[PageKv<'_>],
    page_size: usize,
    len: usize,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let Heads {
        n_head,
        n_kv_head,
        head_dim: hd,
    } = heads;
    let kv_dim = n_kv_head * hd;
    let rep = n_head / n_kv_head;
    let scale = 1.0 / (hd as f32).sqrt();
    debug_assert!(len <= pages.len() * page_size);
    scores.clear();
    scores.resize(n_head * len, 0.0);
    for (pi, (k, _)) in pages.iter().enumerate() {
        let base = pi * page_size;
        if base >= len {
            break;
        }
        let cnt = page_size.min(len - base);
        for s in 0..cnt {
            let row = &k[s * kv_dim..(s + 1) * kv_dim];
            for g in 0..n_kv_head {
                let kr = &row[g * hd..(g + 1) * hd];
                for h in g * rep..(g + 1) * rep {
                    scores[h * len + base + s] = dot(&q[h * hd..(h + 1) * hd], kr) * scale;
                }
            }
        }
    }
    for row in scores.chunks_exact_mut(len) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v /= sum;
        }
    }
    out.fill(0.0);
    for (pi, (_, v)) in pages.iter().enumerate() {
        let base = pi * page_size;
        if base >= len {
            break;
        }
        let cnt = page_size.min(len - base);
        for s in 0..cnt {
            let row = &v[s * kv_dim..(s + 1) * kv_dim];
            for g in 0..n_kv_head {
                let vr = &row[g * hd..(g + 1) * hd];
                for h in g * rep..(g + 1) * rep {
                    let p = scores[h * len + base + s];
                    for (o, &x) in out[h * hd..(h + 1) * hd].iter_mut().zip(vr) {
                        *o += p * x;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain attention over contiguous K/V `[len, kv_dim]`.
    fn reference(heads: Heads, q: &[f32], k: &[f32], v: &[f32], len: usize) -> Vec<f32> {
        let hd = heads.head_dim;
        let kv_dim = heads.n_kv_head * hd;
        let rep = heads.n_head / heads.n_kv_head;
        let mut out = vec![0f32; heads.n_head * hd];
        for h in 0..heads.n_head {
            let g = h / rep;
            let s: Vec<f64> = (0..len)
                .map(|j| {
                    (0..hd)
                        .map(|i| q[h * hd + i] as f64 * k[j * kv_dim + g * hd + i] as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..hd {
                out[h * hd + i] = (0..len)
                    .map(|j| e[j] / z * v[j * kv_dim + g * hd + i] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn paged_attention_matches_contiguous_attention() {
        let heads = Heads {
            n_head: 6,
            n_kv_head: 2,
            head_dim: 8,
        };
        let kv_dim = 16;
        let page_size = 4;
        let mut seed = 1u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        let total = 11;
        let k: Vec<f32> = (0..total * kv_dim).map(|_| rnd() * 3.0).collect();
        let v: Vec<f32> = (0..total * kv_dim).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..heads.n_head * 8).map(|_| rnd() * 3.0).collect();
        // Pages with garbage (NaN) past the end, as poisoned slots would be.
        let mut pk = vec![f32::NAN; 3 * page_size * kv_dim];
        let mut pv = vec![f32::NAN; 3 * page_size * kv_dim];
        pk[..k.len()].copy_from_slice(&k);
        pv[..v.len()].copy_from_slice(&v);
        let pages: Vec<PageKv> = pk
            .chunks(page_size * kv_dim)
            .zip(pv.chunks(page_size * kv_dim))
            .collect();
        let mut scratch = Vec::new();
        for len in 1..=total {
            let mut out = vec![0f32; heads.n_head * 8];
            attend_token(heads, &q, &pages, page_size, len, &mut out, &mut scratch);
            let want = reference(heads, &q, &k, &v, len);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "len {len}: {a} vs {b}");
            }
        }
    }
}
