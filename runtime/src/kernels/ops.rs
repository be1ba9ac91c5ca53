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

/// Rope frequencies `base^(-2i/dim)` for `i < dim / 2`, in f32.
pub fn rope_theta(dim: usize, base: f32) -> Vec<f32> {
    (0..dim)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / dim as f32))
        .collect()
}

/// One position's rope angles `pos * theta[i]` (f32, as the reference's table) as cos and sin.
pub fn rope_angles(theta: &[f32], pos: usize, cos: &mut [f32], sin: &mut [f32]) {
    for ((c, s), &t) in cos.iter_mut().zip(sin.iter_mut()).zip(theta) {
        let a = pos as f32 * t;
        *c = a.cos();
        *s = a.sin();
    }
}

/// Rope tables `[positions][dim / 2]` (cos, sin), angles `pos * base^(-2i/dim)` in f32.
pub fn rope_tables(dim: usize, base: f32, positions: usize) -> (Vec<f32>, Vec<f32>) {
    let theta = rope_theta(dim, base);
    let half = theta.len();
    let mut cos = vec![0f32; positions * half];
    let mut sin = vec![0f32; positions * half];
    for p in 0..positions {
        let row = p * half..(p + 1) * half;
        rope_angles(&theta, p, &mut cos[row.clone()], &mut sin[row]);
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

/// Rope over halves on one head (`x.len() == 2 * cos.len()`, GPT-NeoX's layout, used by
/// Gemma): pairs `(x[i], x[i + half])` rotated by the position's angle `i`.
#[inline]
pub fn rope_halves(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let (a, b) = x.split_at_mut(cos.len());
    for (((a, b), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
        let (x0, x1) = (*a, *b);
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
    }
}

/// RMS norm of each `w.len()` chunk of `x` in place (Gemma's per-head Q and K norms).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_exact_mut(n) {
        let sum2 = row.iter().map(|v| v * v).sum::<f32>();
        let m = (sum2 / n as f32 + eps).sqrt();
        for (v, &a) in row.iter_mut().zip(w) {
            *v = *v / m * a;
        }
    }
}

/// `gate = gelu(gate) * up`, GELU's tanh approximation (`gelu_pytorch_tanh`, Gemma's).
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_TWO_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh()) * u;
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
    fn rope_over_halves_rotates_pairs_half_a_head_apart() {
        let theta = rope_theta(4, 10_000.0);
        let (mut cos, mut sin) = ([0f32; 2], [0f32; 2]);
        rope_angles(&theta, 3, &mut cos, &mut sin);
        let mut x = [1.0, 2.0, 3.0, 4.0];
        rope_halves(&mut x, &cos, &sin);
        // Pair (x[0], x[2]) at angle 3 * theta[0] = 3 rad; (x[1], x[3]) at 3 * theta[1].
        let a = 3f32;
        assert!((x[0] - (a.cos() - 3.0 * a.sin())).abs() < 1e-6);
        assert!((x[2] - (a.sin() + 3.0 * a.cos())).abs() < 1e-6);
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 30.0).abs() < 1e-4);
    }

    #[test]
    fn gelu_tanh_is_near_the_exact_gelu() {
        let mut g = [-3.0f32, -1.0, 0.0, 0.5, 2.0];
        gelu_tanh_mul(&mut g, &[1.0; 5]);
        // x * Phi(x), to the approximation's 1e-3.
        for (got, want) in g.iter().zip([-0.00405, -0.158655, 0.0, 0.345731, 1.9545]) {
            assert!((got - want).abs() < 1e-3, "{got} vs {want}");
        }
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
