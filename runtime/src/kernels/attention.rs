//! Causal attention of one query token straight over a sequence's KV pages (no copy of K/V).
//!
//! Scores for every position go into a small scratch row per head, then one softmax (max,
//! exp, normalise) per head and a pass over the V pages, with grouped-query heads sharing each
//! K/V row load. The float sums follow, step by step, the order of candle's CPU attention in
//! the reference forward (`softmax(q k^T / sqrt(d)) v` through the gemm crate and candle's
//! vector sum), because every later matmul re-quantizes activations to int8 and so turns
//! last-bit differences into visible ones:
//! - `q . k`: gemm's horizontal kernel (8 fused multiply-add lanes, then a pairwise lane sum)
//!   when the segment's score matrix has at most 256 entries, else one fused multiply-add
//!   chain along the head dimension;
//! - the softmax sum: candle's `vec_sum` over the segment's whole key length (masked entries
//!   are zeros there), 4 x 8 lanes per 32 values, then the tail in order;
//! - `p . v`: one fused multiply-add chain over the positions.

/// Head geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Sliding-window attention: a query sees only the last `window` positions, itself
    /// included (Gemma 3's local layers; llama.cpp's standard SWA). `None`: all of them.
    pub window: Option<usize>,
}

impl Heads {
    /// Floats per K (or V) row: all KV heads.
    fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// Query heads per KV head (grouped-query attention).
    fn rep(&self) -> usize {
        self.n_head / self.n_kv_head
    }

    /// The scores' scale, `1 / sqrt(head_dim)`.
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// The first position a query that sees positions `..len` attends to.
    pub fn first_visible(&self, len: usize) -> usize {
        self.window.map_or(0, |w| len.saturating_sub(w))
    }
}

/// One page's K and V of one layer, `[page_size, kv_dim]` each (slots past the sequence's
/// length are not read).
pub type PageKv<'a> = (&'a [f32], &'a [f32]);

/// The reference's score matrices up to this many entries use gemm's horizontal kernel.
const HORIZONTAL_MAX: usize = 16 * 16;

/// gemm's horizontal dot: 8 fused lanes along the vectors, then `(l0+l4 + l2+l6) + (l1+l5 +
/// l3+l7)` as its `reduce_sum`.
#[inline]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    // A partial last chunk is loaded with zeros past the end: the same as these lanes alone.
    for (l, (x, y)) in ar.iter().zip(br).enumerate() {
        acc[l] = x.mul_add(*y, acc[l]);
    }
    let s: [f32; 4] = std::array::from_fn(|i| acc[i] + acc[i + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// One fused multiply-add chain (gemm's packed micro-kernel along the depth).
#[inline]
fn dot_chain(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |acc, (x, y)| x.mul_add(*y, acc))
}

/// [`dot_lanes`] of one query against `P` key rows: the same sums, side by side, so the
/// `P` chains of fused multiply-adds overlap instead of each waiting on the last.
#[inline(always)]
fn dot_lanes_n<const P: usize>(q: &[f32], ks: [&[f32]; P]) -> [f32; P] {
    let hd = q.len();
    let ks: [&[f32]; P] = std::array::from_fn(|p| &ks[p][..hd]);
    let whole = hd / 8 * 8;
    let mut acc = [[0f32; 8]; P];
    for i in (0..whole).step_by(8) {
        for (a, k) in acc.iter_mut().zip(&ks) {
            for l in 0..8 {
                a[l] = q[i + l].mul_add(k[i + l], a[l]);
            }
        }
    }
    for (a, k) in acc.iter_mut().zip(&ks) {
        for l in 0..hd - whole {
            a[l] = q[whole + l].mul_add(k[whole + l], a[l]);
        }
    }
    acc.map(|a| {
        let s: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
        (s[0] + s[2]) + (s[1] + s[3])
    })
}

/// [`dot_chain`] of one query against `P` key rows, side by side.
#[inline(always)]
fn dot_chain_n<const P: usize>(q: &[f32], ks: [&[f32]; P]) -> [f32; P] {
    let hd = q.len();
    let ks: [&[f32]; P] = std::array::from_fn(|p| &ks[p][..hd]);
    let mut acc = [0f32; P];
    for (i, &x) in q.iter().enumerate() {
        for (a, k) in acc.iter_mut().zip(&ks) {
            *a = x.mul_add(k[i], *a);
        }
    }
    acc
}

/// `out[pos] = scale * dot(q, keys[pos][koff..koff + hd])` for every position, `P` at a
/// time through `many`, the rest through `one` (the same sums either way).
#[inline(always)]
fn head_scores<const P: usize>(
    q: &[f32],
    keys: &[&[f32]],
    koff: usize,
    scale: f32,
    out: &mut [f32],
    many: impl Fn(&[f32], [&[f32]; P]) -> [f32; P],
    one: impl Fn(&[f32], &[f32]) -> f32,
) {
    let hd = q.len();
    let mut blocks = keys.chunks_exact(P);
    let mut outs = out.chunks_exact_mut(P);
    for (ks, o) in (&mut blocks).zip(&mut outs) {
        let ks: [&[f32]; P] = std::array::from_fn(|p| &ks[p][koff..koff + hd]);
        for (o, s) in o.iter_mut().zip(many(q, ks)) {
            *o = s * scale;
        }
    }
    for (k, o) in blocks.remainder().iter().zip(outs.into_remainder()) {
        *o = one(q, &k[koff..koff + hd]) * scale;
    }
}

/// `out = sum over positions of p[pos] * values[pos][voff..voff + D]`: one fused
/// multiply-add chain per element, over the positions in order, held in registers.
#[inline(always)]
fn head_values<const D: usize>(p: &[f32], values: &[&[f32]], voff: usize, out: &mut [f32]) {
    let mut acc = [0f32; D];
    for (&p, v) in p.iter().zip(values) {
        let v: &[f32; D] = v[voff..voff + D].try_into().expect("a head's value row");
        for i in 0..D {
            acc[i] = p.mul_add(v[i], acc[i]);
        }
    }
    out.copy_from_slice(&acc);
}

/// The rows of positions `lo..len` of the K (or V) pages. Two small allocations per token and
/// layer; walking the pages in place instead (a block of positions never crossing a page)
/// measured 3-4% slower at 16 streams.
fn rows_of<'a>(
    pages: impl Iterator<Item = &'a [f32]>,
    page_size: usize,
    lo: usize,
    len: usize,
    kv_dim: usize,
) -> Vec<&'a [f32]> {
    let mut rows = Vec::with_capacity(len - lo);
    // Pages wholly before the window are not walked.
    let skipped = lo / page_size;
    for_each_row(
        pages.skip(skipped),
        page_size,
        len - skipped * page_size,
        kv_dim,
        |pos, row| {
            if pos + skipped * page_size >= lo {
                rows.push(row)
            }
        },
    );
    rows
}

/// candle's AVX `vec_sum`: 4 accumulators of 8 lanes over each 32 values, combined as
/// `(x0+x1) + (x2+x3)`, then `(l0+l4 + l1+l5) + (l2+l6 + l3+l7)`, then the tail in order.
fn vec_sum(x: &[f32]) -> f32 {
    let np = x.len() / 32 * 32;
    let mut acc = [[0f32; 8]; 4];
    for chunk in x[..np].chunks_exact(32) {
        for (j, a) in acc.iter_mut().enumerate() {
            for l in 0..8 {
                a[l] += chunk[j * 8 + l];
            }
        }
    }
    let v: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let t: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
    let mut s = (t[0] + t[1]) + (t[2] + t[3]);
    for &v in &x[np..] {
        s += v;
    }
    s
}

/// Calls `f(position, row)` for positions `0..len` in order, `row` being that position's
/// `kv_dim` floats in `pages` (the K or the V of each page, `page_size` rows a page).
fn for_each_row<'a>(
    pages: impl Iterator<Item = &'a [f32]>,
    page_size: usize,
    len: usize,
    kv_dim: usize,
    mut f: impl FnMut(usize, &'a [f32]),
) {
    for (pi, rows) in pages.enumerate() {
        let base = pi * page_size;
        if base >= len {
            break;
        }
        for s in 0..page_size.min(len - base) {
            f(base + s, &rows[s * kv_dim..(s + 1) * kv_dim]);
        }
    }
}

/// `out[n_head * head_dim]` = attention of `q[n_head * head_dim]` over positions `0..len`
/// (the last `window` of them under a sliding window), held `page_size` per page in `pages`. The query belongs to a segment of `rows` tokens whose
/// keys span `kv_len` positions (`len <= kv_len`): the shape the reference computes the
/// segment in, which decides its summation order. `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend_token(
    heads: Heads,
    q: &[f32],
    pages: &[PageKv<'_>],
    page_size: usize,
    len: usize,
    kv_len: usize,
    rows: usize,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let (n_head, hd) = (heads.n_head, heads.head_dim);
    let (kv_dim, rep, scale) = (heads.kv_dim(), heads.rep(), heads.scale());
    let kv_len = kv_len.max(len);
    let lanes = rows * kv_len <= HORIZONTAL_MAX;
    assert!(len <= pages.len() * page_size);
    scores.clear();
    scores.resize(n_head * kv_len, 0.0);
    let lo = heads.first_visible(len);
    let keys = rows_of(pages.iter().map(|p| p.0), page_size, lo, len, kv_dim);
    for h in 0..n_head {
        let (qh, koff) = (&q[h * hd..(h + 1) * hd], (h / rep) * hd);
        let row = &mut scores[h * kv_len + lo..h * kv_len + len];
        if lanes {
            head_scores(qh, &keys, koff, scale, row, dot_lanes_n::<4>, dot_lanes);
        } else {
            head_scores(qh, &keys, koff, scale, row, dot_chain_n::<8>, dot_chain);
        }
    }
    softmax_then_values(heads, scores, pages, page_size, len, kv_len, out);
}

/// The second half of attention for one query: `scores` (`[n_head][kv_len]`, live from
/// `heads.first_visible(len)` up to `len`, the rest zero) become probabilities, then `out` =
/// their weighted sum of V rows.
fn softmax_then_values(
    heads: Heads,
    scores: &mut [f32],
    pages: &[PageKv<'_>],
    page_size: usize,
    len: usize,
    kv_len: usize,
    out: &mut [f32],
) {
    let hd = heads.head_dim;
    let (kv_dim, rep) = (heads.kv_dim(), heads.rep());
    let lo = heads.first_visible(len);
    for row in scores.chunks_exact_mut(kv_len) {
        let live = &mut row[lo..len];
        let max = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for v in live.iter_mut() {
            *v = (*v - max).exp();
        }
        // Masked positions are exp(-inf) = 0 in the reference's row: zeros here.
        let sum = vec_sum(row);
        for v in row[lo..len].iter_mut() {
            *v /= sum;
        }
    }
    let values = rows_of(pages.iter().map(|p| p.1), page_size, lo, len, kv_dim);
    for h in 0..heads.n_head {
        let (p, voff) = (&scores[h * kv_len + lo..h * kv_len + len], (h / rep) * hd);
        let o = &mut out[h * hd..(h + 1) * hd];
        match hd {
            64 => head_values::<64>(p, &values, voff, o),
            256 => head_values::<256>(p, &values, voff, o),
            _ => {
                o.fill(0.0);
                for (&p, v) in p.iter().zip(&values) {
                    for (o, &x) in o.iter_mut().zip(&v[voff..voff + hd]) {
                        *o = p.mul_add(x, *o);
                    }
                }
            }
        }
    }
}

/// Query rows [`attend_rows`] scores side by side, one SIMD lane each.
pub const ROW_BLOCK: usize = 8;

/// [`attend_token`] for `ROW_BLOCK` consecutive query tokens of one segment at once, when the
/// reference uses one fused multiply-add chain per score (more than 256 score entries). Row
/// `r` is the query at position `first + r` (so it sees `first + r + 1` positions); `qs[r]`
/// and `outs[r]` are its query and output. Each score is the same chain as
/// [`attend_token`]'s, bit for bit, but the 8 rows' chains run in the 8 lanes of one vector,
/// with the query transposed once per block, instead of one scalar chain at a time.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows(
    heads: Heads,
    qs: &[&[f32]; ROW_BLOCK],
    pages: &[PageKv<'_>],
    page_size: usize,
    first: usize,
    kv_len: usize,
    outs: &mut [&mut [f32]; ROW_BLOCK],
    scratch: &mut Vec<f32>,
) {
    let (n_head, hd) = (heads.n_head, heads.head_dim);
    let (kv_dim, rep, scale) = (heads.kv_dim(), heads.rep(), heads.scale());
    let len = first + ROW_BLOCK; // positions the last row sees
    let kv_len = kv_len.max(len);
    assert!(len <= pages.len() * page_size);
    assert_eq!(
        heads.first_visible(len),
        0,
        "a sliding window cuts into the block"
    );
    // Scratch: the block's scores, `[row][head][kv_len]` (masked positions stay zero), then
    // its queries transposed, `qt[(h * hd + i) * 8 + r]`.
    let n_scores = ROW_BLOCK * n_head * kv_len;
    scratch.clear();
    scratch.resize(n_scores + n_head * hd * ROW_BLOCK, 0.0);
    let (rows_scores, qt) = scratch.split_at_mut(n_scores);
    for (r, q) in qs.iter().enumerate() {
        for (j, &v) in q[..n_head * hd].iter().enumerate() {
            qt[j * ROW_BLOCK + r] = v;
        }
    }
    let mut keys: Vec<&[f32]> = Vec::with_capacity(len);
    for_each_row(
        pages.iter().map(|p| p.0),
        page_size,
        len,
        kv_dim,
        |_, row| keys.push(row),
    );
    for h in 0..n_head {
        let koff = (h / rep) * hd;
        let qh = &qt[h * hd * ROW_BLOCK..(h + 1) * hd * ROW_BLOCK];
        let mut store = |pos: usize, acc: &[f32; ROW_BLOCK]| {
            for (r, &v) in acc.iter().enumerate() {
                // Row r sees positions 0..=first + r; later ones stay zero (masked).
                if pos <= first + r {
                    rows_scores[(r * n_head + h) * kv_len + pos] = v * scale;
                }
            }
        };
        // Four positions at a time: four independent chains keep the FMA units busy.
        let mut pos = 0;
        while pos + 4 <= len {
            let k: [&[f32]; 4] = std::array::from_fn(|p| &keys[pos + p][koff..koff + hd]);
            let mut acc = [[0f32; ROW_BLOCK]; 4];
            for i in 0..hd {
                let qv = &qh[i * ROW_BLOCK..(i + 1) * ROW_BLOCK];
                for p in 0..4 {
                    for r in 0..ROW_BLOCK {
                        acc[p][r] = qv[r].mul_add(k[p][i], acc[p][r]);
                    }
                }
            }
            for (p, a) in acc.iter().enumerate() {
                store(pos + p, a);
            }
            pos += 4;
        }
        while pos < len {
            let k = &keys[pos][koff..koff + hd];
            let mut acc = [0f32; ROW_BLOCK];
            for i in 0..hd {
                let qv = &qh[i * ROW_BLOCK..(i + 1) * ROW_BLOCK];
                for r in 0..ROW_BLOCK {
                    acc[r] = qv[r].mul_add(k[i], acc[r]);
                }
            }
            store(pos, &acc);
            pos += 1;
        }
    }
    for (r, out) in outs.iter_mut().enumerate() {
        let row_scores = &mut rows_scores[r * n_head * kv_len..(r + 1) * n_head * kv_len];
        softmax_then_values(
            heads,
            row_scores,
            pages,
            page_size,
            first + r + 1,
            kv_len,
            out,
        );
    }
}

/// Whether [`attend_rows`] computes the reference's sums for the block of query tokens at
/// `first..first + ROW_BLOCK` of a segment of `rows` tokens over `kv_len` keys (it uses the
/// single-chain scores) and every row of the block sees all earlier positions (no sliding
/// window cuts into them).
pub fn rows_block_applies(heads: Heads, first: usize, rows: usize, kv_len: usize) -> bool {
    rows * kv_len > HORIZONTAL_MAX && heads.first_visible(first + ROW_BLOCK) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain attention over contiguous K/V `[len, kv_dim]`.
    fn reference(heads: Heads, q: &[f32], k: &[f32], v: &[f32], len: usize) -> Vec<f32> {
        let hd = heads.head_dim;
        let kv_dim = heads.n_kv_head * hd;
        let rep = heads.n_head / heads.n_kv_head;
        let lo = heads.first_visible(len);
        let mut out = vec![0f32; heads.n_head * hd];
        for h in 0..heads.n_head {
            let g = h / rep;
            let s: Vec<f64> = (lo..len)
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
                out[h * hd + i] = (lo..len)
                    .map(|j| e[j - lo] / z * v[j * kv_dim + g * hd + i] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn paged_attention_matches_contiguous_attention() {
        paged_matches_contiguous(None);
    }

    #[test]
    fn a_sliding_window_attends_only_to_the_last_positions() {
        // Windows shorter than a page, one page, across pages, and longer than the sequence.
        for window in [1, 3, 4, 6, 64] {
            paged_matches_contiguous(Some(window));
        }
    }

    fn paged_matches_contiguous(window: Option<usize>) {
        let heads = Heads {
            n_head: 6,
            n_kv_head: 2,
            head_dim: 8,
            window,
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
            // Both summation orders: a small segment (horizontal dots) and a large one.
            attend_token(
                heads,
                &q,
                &pages,
                page_size,
                len,
                len,
                1,
                &mut out,
                &mut scratch,
            );
            let mut out2 = vec![0f32; heads.n_head * 8];
            attend_token(
                heads,
                &q,
                &pages,
                page_size,
                len,
                total,
                64,
                &mut out2,
                &mut scratch,
            );
            let want = reference(heads, &q, &k, &v, len);
            for ((a, b), c) in out.iter().zip(&want).zip(&out2) {
                assert!((a - b).abs() < 1e-5, "len {len}: {a} vs {b}");
                assert!((c - b).abs() < 1e-5, "len {len}: {c} vs {b}");
            }
        }
    }

    /// `attend_token` as first written: one score at a time, then the values position by
    /// position. The blocked code must give its results bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn attend_token_one_by_one(
        heads: Heads,
        q: &[f32],
        pages: &[PageKv<'_>],
        page_size: usize,
        len: usize,
        kv_len: usize,
        rows: usize,
        out: &mut [f32],
    ) {
        let (hd, rep, scale) = (heads.head_dim, heads.rep(), heads.scale());
        let kv_dim = heads.kv_dim();
        let kv_len = kv_len.max(len);
        let dot = if rows * kv_len <= HORIZONTAL_MAX {
            dot_lanes
        } else {
            dot_chain
        };
        let mut scores = vec![0f32; heads.n_head * kv_len];
        for_each_row(
            pages.iter().map(|p| p.0),
            page_size,
            len,
            kv_dim,
            |pos, row| {
                for h in 0..heads.n_head {
                    let kr = &row[(h / rep) * hd..(h / rep + 1) * hd];
                    scores[h * kv_len + pos] = dot(&q[h * hd..(h + 1) * hd], kr) * scale;
                }
            },
        );
        for row in scores.chunks_exact_mut(kv_len) {
            let max = row[..len].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for v in row[..len].iter_mut() {
                *v = (*v - max).exp();
            }
            let sum = vec_sum(row);
            for v in row[..len].iter_mut() {
                *v /= sum;
            }
        }
        out.fill(0.0);
        for_each_row(
            pages.iter().map(|p| p.1),
            page_size,
            len,
            kv_dim,
            |pos, row| {
                for h in 0..heads.n_head {
                    let p = scores[h * kv_len + pos];
                    let vr = &row[(h / rep) * hd..(h / rep + 1) * hd];
                    for (o, &x) in out[h * hd..(h + 1) * hd].iter_mut().zip(vr) {
                        *o = p.mul_add(x, *o);
                    }
                }
            },
        );
    }

    /// Scores several positions at a time and values a head at a time change no bit, for
    /// both summation orders, head sizes with and without a register-held path, pages that
    /// hold whole blocks of positions or not, and every length across pages.
    #[test]
    fn blocked_scores_and_values_are_bit_identical_to_one_by_one() {
        let mut seed = 11u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        let shapes = [
            Heads {
                n_head: 9,
                n_kv_head: 3,
                head_dim: 64,
                window: None,
            },
            Heads {
                n_head: 4,
                n_kv_head: 2,
                head_dim: 12,
                window: None,
            },
        ];
        // Pages of 16 hold whole blocks of 4 and 8 positions; pages of 6 end mid-block.
        for (heads, page_size) in shapes.into_iter().flat_map(|h| [(h, 16), (h, 6)]) {
            let (kv_dim, d) = (heads.kv_dim(), heads.n_head * heads.head_dim);
            let total = 3 * page_size;
            let pk: Vec<f32> = (0..total * kv_dim).map(|_| rnd() * 3.0).collect();
            let pv: Vec<f32> = (0..total * kv_dim).map(|_| rnd()).collect();
            let pages: Vec<PageKv> = pk
                .chunks(page_size * kv_dim)
                .zip(pv.chunks(page_size * kv_dim))
                .collect();
            let q: Vec<f32> = (0..d).map(|_| rnd() * 3.0).collect();
            let mut scratch = Vec::new();
            for len in 1..=total {
                for rows in [1, 64] {
                    let (mut got, mut want) = (vec![0f32; d], vec![0f32; d]);
                    attend_token(
                        heads,
                        &q,
                        &pages,
                        page_size,
                        len,
                        len,
                        rows,
                        &mut got,
                        &mut scratch,
                    );
                    attend_token_one_by_one(
                        heads, &q, &pages, page_size, len, len, rows, &mut want,
                    );
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{heads:?} pages of {page_size}, len {len} rows {rows}"
                    );
                }
            }
        }
    }

    /// A block of 8 query rows through `attend_rows` gives exactly (bit for bit) what each row
    /// gives through `attend_token`, for blocks at the start, in the middle, across pages,
    /// and ending on the last position, with the NaN-poisoned slots past the end unread.
    #[test]
    fn row_blocks_are_bit_identical_to_single_rows() {
        let heads = Heads {
            n_head: 9,
            n_kv_head: 3,
            head_dim: 64,
            window: None,
        };
        let kv_dim = heads.n_kv_head * heads.head_dim;
        let d = heads.n_head * heads.head_dim;
        let page_size = 16;
        let mut seed = 7u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        let total = 45; // the segment's key length: 3 pages, the last one part-filled
        let mut pk = vec![f32::NAN; 3 * page_size * kv_dim];
        let mut pv = vec![f32::NAN; 3 * page_size * kv_dim];
        for x in &mut pk[..total * kv_dim] {
            *x = rnd() * 3.0;
        }
        for x in &mut pv[..total * kv_dim] {
            *x = rnd();
        }
        let pages: Vec<PageKv> = pk
            .chunks(page_size * kv_dim)
            .zip(pv.chunks(page_size * kv_dim))
            .collect();
        let q: Vec<f32> = (0..ROW_BLOCK * d).map(|_| rnd() * 3.0).collect();
        let rows = 40; // query rows of the segment: 40 x 45 score entries, single chains
        assert!(rows_block_applies(heads, 0, rows, total));
        let mut scratch = Vec::new();
        for first in [0, 13, 16, total - ROW_BLOCK] {
            let qs: [&[f32]; ROW_BLOCK] = std::array::from_fn(|r| &q[r * d..(r + 1) * d]);
            let mut block = vec![0f32; ROW_BLOCK * d];
            let mut it = block.chunks_exact_mut(d);
            let mut outs: [&mut [f32]; ROW_BLOCK] = std::array::from_fn(|_| it.next().unwrap());
            attend_rows(
                heads,
                &qs,
                &pages,
                page_size,
                first,
                total,
                &mut outs,
                &mut scratch,
            );
            for r in 0..ROW_BLOCK {
                let mut one = vec![0f32; d];
                attend_token(
                    heads,
                    qs[r],
                    &pages,
                    page_size,
                    first + r + 1,
                    total,
                    rows,
                    &mut one,
                    &mut scratch,
                );
                let got = &block[r * d..(r + 1) * d];
                assert!(got.iter().all(|x| x.is_finite()), "first {first} row {r}");
                let same = got
                    .iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "first {first} row {r}: block and single row differ");
            }
        }
    }
}
