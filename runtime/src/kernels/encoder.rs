//! The f32 operations of a BERT encoder between its matmuls: LayerNorm, GELU (erf) and
//! bidirectional attention over packed sequences.
//!
//! Sequences are packed, not padded: a batch's rows are every text's tokens one after the
//! other, so the matmuls see only real tokens, and attention runs per sequence over its own
//! rows (no mask to apply, no padded rows to compute).

use rayon::prelude::*;

use super::matmul::OutPtr;
use super::ops::dot;

/// `out = (x - mean) / sqrt(var + eps) * w + b` per row of `w.len()` (in place).
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_exact_mut(n) {
        let mean = row.iter().sum::<f32>() / n as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &w), &b) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * w + b;
        }
    }
}

/// `erf(x)` in f32 as a rational function of `x` on [-4, 4] (±1 past it, as f32 rounds it):
/// Eigen's `generic_fast_erf_float`, within a few ulp of the exact value, and branch-free so a
/// row of it vectorizes (libm's `erff` is a call per element).
#[inline(always)]
fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2.mul_add(-2.726_142_3e-10, 2.770_681_4e-8);
    p = x2.mul_add(p, -2.101_024_1e-6);
    p = x2.mul_add(p, -5.692_506_4e-5);
    p = x2.mul_add(p, -7.349_906_3e-4);
    p = x2.mul_add(p, -2.954_6e-3);
    p = x2.mul_add(p, -1.609_603_3e-2);
    let p = x * p;
    let mut q = x2.mul_add(-1.456_607_2e-5, -2.133_740_6e-4);
    q = x2.mul_add(q, -1.682_827e-3);
    q = x2.mul_add(q, -7.373_329_2e-3);
    q = x2.mul_add(q, -1.426_473_9e-2);
    p / q
}

/// `x = gelu(x + bias)` per row of `bias.len()`, with the exact (erf) GELU BERT uses.
pub fn bias_gelu(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, &b) in row.iter_mut().zip(bias) {
            let y = *v + b;
            *v = 0.5 * y * (1.0 + erf(y * std::f32::consts::FRAC_1_SQRT_2));
        }
    }
}

/// `x += bias` per row of `bias.len()`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// `y[t, n] = x[t, k] W^T` in f32 (`w` is `[n, k]` row-major), through the gemm crate (the
/// kernel candle's CPU matmul uses), on rayon's pool when it is worth it.
pub fn matmul_f32(w: &[f32], n: usize, k: usize, x: &[f32], t: usize, y: &mut [f32]) {
    assert_eq!((w.len(), x.len(), y.len()), (n * k, t * k, t * n));
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 && t * n * k > 1 << 18 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: `y` is `[t, n]` row-major (column stride 1, row stride n), `x` is `[t, k]`
    // row-major, and W^T `[k, n]` is read from `w` with column stride k and row stride 1; the
    // lengths are checked above. With `read_dst` false `y` is only written (y = 1 * x W^T).
    unsafe {
        gemm::gemm(
            t,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Bidirectional attention of each packed sequence over its own rows: for the sequence of
/// rows `starts[s]..starts[s + 1]` and each head, `ctx = softmax(q k^T / sqrt(d)) v`.
/// `qkv` is `[rows, 3 * hidden]` (Q, K, V side by side), `ctx` is `[rows, hidden]`.
pub fn attend_packed(qkv: &[f32], starts: &[usize], heads: usize, ctx: &mut [f32]) {
    let rows = *starts.last().expect("starts has the end");
    // Every sequence's rows lie inside `rows`, one after the other: the writes below stay in
    // ctx and no two tasks share a row.
    assert!(
        starts[0] == 0 && starts.windows(2).all(|w| w[0] <= w[1]),
        "sequence starts must rise from 0"
    );
    if rows == 0 {
        return;
    }
    let hidden = ctx.len() / rows;
    assert_eq!(ctx.len(), rows * hidden, "ctx is not [{rows}, hidden]");
    assert_eq!(
        qkv.len(),
        rows * 3 * hidden,
        "qkv is not [{rows}, 3 * {hidden}]"
    );
    assert!(
        hidden.is_multiple_of(heads),
        "{hidden} columns in {heads} heads"
    );
    let hd = hidden / heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let out = OutPtr(ctx.as_mut_ptr());
    let task = |(s, h): (usize, usize), scores: &mut Vec<f32>| {
        let (first, end) = (starts[s], starts[s + 1]);
        let len = end - first;
        let col = |r: usize, part: usize| {
            let at = r * 3 * hidden + part * hidden + h * hd;
            &qkv[at..at + hd]
        };
        scores.clear();
        scores.resize(len + hd, 0.0);
        let (scores, acc) = scores.split_at_mut(len);
        for i in first..end {
            let q = col(i, 0);
            let mut max = f32::NEG_INFINITY;
            for (j, s) in scores.iter_mut().enumerate() {
                *s = dot(q, col(first + j, 1)) * scale;
                max = max.max(*s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            acc.fill(0.0);
            for (j, &p) in scores.iter().enumerate() {
                for (a, &v) in acc.iter_mut().zip(col(first + j, 2)) {
                    *a = p.mul_add(v, *a);
                }
            }
            let inv = 1.0 / sum;
            for (c, &a) in acc.iter().enumerate() {
                // SAFETY: row i < rows of this task's sequence (starts rise to rows, asserted
                // above), column h * hd + c < hidden of its own head: within ctx (its length
                // is asserted) and written by no other task.
                unsafe { out.write(i * hidden + h * hd + c, a * inv) };
            }
        }
    };
    let pairs = (0..starts.len() - 1).flat_map(|s| (0..heads).map(move |h| (s, h)));
    // Parallel only where the scores are worth the hand-off (a short text's attention is
    // a few microseconds).
    let work: usize = starts.windows(2).map(|w| (w[1] - w[0]).pow(2)).sum();
    if work * heads < 4096 {
        let mut scores = Vec::new();
        pairs.for_each(|p| task(p, &mut scores));
    } else {
        pairs
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each_init(Vec::new, |scores, p| task(p, scores));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_within_a_few_ulp_of_libm() {
        let mut worst = 0f32;
        for i in -6000..=6000 {
            let x = i as f32 / 1000.0;
            worst = worst.max((erf(x) - libm::erff(x)).abs());
        }
        // Values near 1 have an ulp of 6e-8: a few ulp.
        assert!(worst < 5e-7, "max |erf - erff| = {worst}");
    }

    #[test]
    fn layer_norm_centres_and_scales_each_row() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0, -1.0, -1.0, 1.0, 1.0];
        layer_norm(&mut x, &[1.0; 4], &[0.5; 4], 1e-12);
        for row in x.chunks(4) {
            let mean = row.iter().sum::<f32>() / 4.0;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / 4.0;
            assert!(
                (mean - 0.5).abs() < 1e-6 && (var - 1.0).abs() < 1e-5,
                "{row:?}"
            );
        }
    }

    /// Packed attention equals each sequence's attention alone, computed plainly.
    #[test]
    fn packed_sequences_attend_only_to_themselves() {
        let (heads, hidden) = (2, 8);
        let lens = [3, 1, 5];
        let rows: usize = lens.iter().sum();
        let qkv: Vec<f32> = (0..rows * 3 * hidden)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let mut starts = vec![0];
        for l in lens {
            starts.push(starts.last().unwrap() + l);
        }
        let mut ctx = vec![0f32; rows * hidden];
        attend_packed(&qkv, &starts, heads, &mut ctx);
        let hd = hidden / heads;
        for w in starts.windows(2) {
            for i in w[0]..w[1] {
                for h in 0..heads {
                    let q = &qkv[i * 3 * hidden + h * hd..][..hd];
                    let s: Vec<f32> = (w[0]..w[1])
                        .map(|j| {
                            let k = &qkv[j * 3 * hidden + hidden + h * hd..][..hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
                    let z: f32 = e.iter().sum();
                    for c in 0..hd {
                        let want: f32 = (w[0]..w[1])
                            .zip(&e)
                            .map(|(j, p)| p / z * qkv[j * 3 * hidden + 2 * hidden + h * hd + c])
                            .sum();
                        let got = ctx[i * hidden + h * hd + c];
                        assert!(
                            (got - want).abs() < 1e-5,
                            "row {i} head {h}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
