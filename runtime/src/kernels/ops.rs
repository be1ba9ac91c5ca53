//! The f32 operations between the matmuls, as plain loops over rows (the same formulas as
//! candle's `rms_norm`, `rope_i` and `silu`, the reference's ops).

/// Dot product in 8 independent lanes, so it vectorizes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `out = x / sqrt(mean(x^2) + eps) * w`, row by row (rows of `w.len()`).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum2 = row.iter().map(|v| v * v).sum::<f32>();
        let m = (sum2 / n as f32 + eps).sqrt();
        for ((o, &v), &a) in o.iter_mut().zip(row).zip(w) {
            *o = v / m * a;
        }
    }
}

/// Rope tables `[positions][dim / 2]` (cos, sin), angles `pos * base^(-2i/dim)` in f32.
pub fn rope_tables(dim: usize, base: f32, positions: usize) -> (Vec<f32>, Vec<f32>) {
    let theta: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(positions * theta.len());
    let mut sin = Vec::with_capacity(positions * theta.len());
    for p in 0..positions {
        for &t in &theta {
            let a = p as f32 * t;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

/// Interleaved rope on one head (`x.len() == 2 * cos.len()`): pairs `(x[2i], x[2i+1])`
/// rotated by the position's angle `i`.
#[inline]
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for ((pair, &c), &s) in x.chunks_exact_mut(2).zip(cos).zip(sin) {
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * c - b * s;
        pair[1] = a * s + b * c;
    }
}

/// `gate = silu(gate) * up`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_a_plain_sum_for_all_lengths() {
        for n in 0..40 {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - want).abs() <= 1e-3 * want.abs().max(1.0));
        }
    }

    #[test]
    fn rms_norm_gives_unit_rms_times_weight() {
        let x = [3.0, -4.0, 3.0, -4.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let m = 12.5f32.sqrt();
        assert_eq!(out, [3.0 / m, -8.0 / m, 3.0 / m, -8.0 / m]);
    }

    #[test]
    fn rope_at_position_zero_is_the_identity_and_keeps_norms() {
        let (cos, sin) = rope_tables(8, 10_000.0, 5);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        rope_interleaved(&mut x, &cos[..4], &sin[..4]);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        rope_interleaved(&mut x, &cos[16..20], &sin[16..20]);
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 204.0).abs() < 1e-3);
    }
}
