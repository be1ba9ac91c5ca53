//! Tile dot products: `R` quantized activation rows against `C` weight rows at once, so each
//! weight block loaded is used `R` times and each activation block `C` times.
//!
//! Per block the math is that of ggml's `vec_dot_q4_1_q8_1` / `vec_dot_q8_0_q8_0`:
//! `sum_j (dw*qw_j + mw) * da*qa_j = dw*da * sum_j qw_j*qa_j + mw * sa`, the integer sum
//! exact. For Q4_1 the float steps follow candle's generic `vec_dot_q4_1_q8_1` (the
//! reference forward's) operation by operation, one SIMD lane per weight row, so results are
//! bit-identical to it. For Q8_0 the row-by-row tiles follow candle's AVX2
//! `vec_dot_q8_0_q8_0` (8-lane fused multiply-add, then a horizontal sum; bit-identical);
//! the 8-row group tiles that serve every Q8_0 matrix of a model (row counts are multiples
//! of 8) add one fused multiply-add per block instead, which differs from it by float
//! rounding only (a relative 1e-6 or so) and lets a block's 32 products stay integer.
//! Without AVX2 the scalar paths are used (the same per-lane order as the group tiles,
//! candle's generic order for the rest).

use super::blocks::{BlockQ4_1, BlockQ4_1x8, BlockQ8_0, BlockQ8_0x8, BlockQ8_1, QK, RowGroup};

/// Integer dot product of a Q4_1 block's values with an activation block's values.
#[inline(always)]
fn isum_q4_1(w: &BlockQ4_1, a: &BlockQ8_1) -> i32 {
    let mut s = 0i32;
    for j in 0..QK / 2 {
        s += (w.qs[j] & 0x0F) as i32 * a.qs[j] as i32;
        s += (w.qs[j] >> 4) as i32 * a.qs[j + QK / 2] as i32;
    }
    s
}

#[inline(always)]
fn isum_q8_0(w: &BlockQ8_0, a: &BlockQ8_1) -> i32 {
    w.qs.iter()
        .zip(&a.qs)
        .map(|(&x, &y)| x as i32 * y as i32)
        .sum()
}

/// Scalar Q4_1 tile: `out[r][c] = dot(a[r], w[c])`.
pub fn tile_q4_1_scalar<const R: usize, const C: usize>(
    a: &[&[BlockQ8_1]; R],
    w: &[&[BlockQ4_1]; C],
    out: &mut [[f32; C]; R],
) {
    for r in 0..R {
        for c in 0..C {
            let mut sum = 0f32;
            for (wb, ab) in w[c].iter().zip(a[r]) {
                sum += isum_q4_1(wb, ab) as f32 * wb.d * ab.d + wb.m * ab.s;
            }
            out[r][c] = sum;
        }
    }
}

/// Scalar tile of R activation rows against one group of 8 Q4_1 rows.
pub fn tile_q4_1x8_scalar<const R: usize>(
    a: &[&[BlockQ8_1]; R],
    g: &[BlockQ4_1x8],
    out: &mut [[f32; 8]; R],
) {
    for (ar, o) in a.iter().zip(out.iter_mut()) {
        for (c, o) in o.iter_mut().enumerate() {
            let mut sum = 0f32;
            for (x, ab) in g.iter().zip(ar.iter()) {
                let wb = x.row(c);
                sum += isum_q4_1(&wb, ab) as f32 * wb.d * ab.d + wb.m * ab.s;
            }
            *o = sum;
        }
    }
}

/// Scalar Q8_0 tile: `out[r][c] = dot(a[r], w[c])`.
pub fn tile_q8_0_scalar<const R: usize, const C: usize>(
    a: &[&[BlockQ8_1]; R],
    w: &[&[BlockQ8_0]; C],
    out: &mut [[f32; C]; R],
) {
    for r in 0..R {
        for c in 0..C {
            let mut sum = 0f32;
            for (wb, ab) in w[c].iter().zip(a[r]) {
                sum += isum_q8_0(wb, ab) as f32 * wb.d * ab.d;
            }
            out[r][c] = sum;
        }
    }
}

/// Scalar tile of R activation rows against one group of 8 Q8_0 rows: per block, the exact
/// integer sum, then `acc = fma(dw * da, isum, acc)` (the SIMD path's per-lane order).
pub fn tile_q8_0x8_scalar<const R: usize>(
    a: &[&[BlockQ8_1]; R],
    g: &[BlockQ8_0x8],
    out: &mut [[f32; 8]; R],
) {
    for (ar, o) in a.iter().zip(out.iter_mut()) {
        for (c, o) in o.iter_mut().enumerate() {
            let mut sum = 0f32;
            for (x, ab) in g.iter().zip(ar.iter()) {
                let wb = x.row(c);
                sum = (wb.d * ab.d).mul_add(isum_q8_0(&wb, ab) as f32, sum);
            }
            *o = sum;
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ4_1, BlockQ4_1x8, BlockQ8_0, BlockQ8_0x8, BlockQ8_1};

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load_i8x32(qs: &[i8; 32]) -> __m256i {
        // SAFETY: `qs` is 32 readable bytes; the load is unaligned.
        unsafe { _mm256_loadu_si256(qs.as_ptr() as *const __m256i) }
    }

    /// The 32 4-bit values of a Q4_1 block as bytes, in value order (low nibbles, then high).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn nibbles(qs: &[u8; 16]) -> __m256i {
        // SAFETY: `qs` is 16 readable bytes; the load is unaligned.
        let lo = unsafe { _mm_loadu_si128(qs.as_ptr() as *const __m128i) };
        let hi = _mm_srli_epi16(lo, 4);
        _mm256_and_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(0x0F))
    }

    /// Unsigned bytes times signed bytes, each group of 4 products summed into one of 8 i32
    /// lanes. One VNNI instruction where the CPU has AVX-512 VNNI; otherwise AVX2's
    /// `maddubs` (pairs to i16) and `madd` (pairs to i32). The sums are the same: with
    /// unsigned values below 128 and signed ones of magnitude at most 127, no i16 pair
    /// saturates.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot4_u8_i8(ux: __m256i, sy: __m256i) -> __m256i {
        #[cfg(all(target_feature = "avx512vnni", target_feature = "avx512vl"))]
        // SAFETY: this build targets CPUs with AVX-512 VNNI and VL (the cfg above).
        unsafe {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), ux, sy)
        }
        #[cfg(not(all(target_feature = "avx512vnni", target_feature = "avx512vl")))]
        {
            _mm256_madd_epi16(_mm256_maddubs_epi16(ux, sy), _mm256_set1_epi16(1))
        }
    }

    /// [`dot4_u8_i8`] as floats.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_u8_i8(ux: __m256i, sy: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(dot4_u8_i8(ux, sy))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The four i32 lane sums of `v[0..4]` (exact), as one vector.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum4_epi32(v: &[__m256i; 4]) -> __m128i {
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
    }

    /// Q4_1 tile of 4 weight rows. The integer block sums come from SIMD (exact); the float
    /// terms are added in the reference's order (`sum += isum * dw * da + mw * sa`, block after
    /// block, no fused multiply-add), one lane per weight row, so results are bit-identical
    /// to the scalar path and to ggml's/candle's generic `vec_dot_q4_1_q8_1`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn tile_q4_1<const R: usize>(
        a: &[&[BlockQ8_1]; R],
        w: &[&[BlockQ4_1]; 4],
        out: &mut [[f32; 4]; R],
    ) {
        let nb = a[0].len();
        let a: [&[BlockQ8_1]; R] = std::array::from_fn(|r| &a[r][..nb]);
        let w: [&[BlockQ4_1]; 4] = std::array::from_fn(|c| &w[c][..nb]);
        let mut acc = [_mm_setzero_ps(); R];
        let rows = w[0].iter().zip(w[1]).zip(w[2]).zip(w[3]);
        for (b, (((w0, w1), w2), w3)) in rows.enumerate() {
            let x = [w0, w1, w2, w3];
            let wx: [__m256i; 4] = std::array::from_fn(|c| nibbles(&x[c].qs));
            let wd = _mm_set_ps(w3.d, w2.d, w1.d, w0.d);
            let wm = _mm_set_ps(w3.m, w2.m, w1.m, w0.m);
            q4_1_block(&a, b, &wx, wd, wm, &mut acc);
        }
        for r in 0..R {
            // SAFETY: `out[r]` is 4 writable f32; the store is unaligned.
            unsafe { _mm_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
        }
    }

    /// Adds block `b` of each activation row to `acc[r]` (one lane per weight row): the
    /// integer dot against the 4 unpacked weight rows `wx`, then `d_w d_a isum + m_w s_a`,
    /// in ggml's order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn q4_1_block<const R: usize>(
        a: &[&[BlockQ8_1]; R],
        b: usize,
        wx: &[__m256i; 4],
        wd: __m128,
        wm: __m128,
        acc: &mut [__m128; R],
    ) {
        for r in 0..R {
            let ab = &a[r][b];
            let y = load_i8x32(&ab.qs);
            let v: [__m256i; 4] = std::array::from_fn(|c| dot4_u8_i8(wx[c], y));
            let isum = _mm_cvtepi32_ps(hsum4_epi32(&v));
            let t = _mm_mul_ps(_mm_mul_ps(isum, wd), _mm_set1_ps(ab.d));
            let t = _mm_add_ps(t, _mm_mul_ps(wm, _mm_set1_ps(ab.s)));
            acc[r] = _mm_add_ps(acc[r], t);
        }
    }

    /// Q4_1 tile of one 8-row group (`BlockQ4_1x8`). Per block, each of the 8 vectors of
    /// weight values is unpacked once and multiplied by 4 bytes of every activation row,
    /// broadcast, which leaves row `c`'s products in lane `c`: no horizontal sums. With
    /// AVX-512 VNNI one `vpdpbusd` per vector accumulates in i32; on AVX2 `maddubs` pairs
    /// accumulate in i16 (8 vectors x 2 products of at most 15 x 127 each is 30480, so no
    /// pair saturates and no sum overflows) and one `madd` widens them at the end. The float
    /// terms are then added in the reference's order, one lane per weight row, as in
    /// [`tile_q4_1`]: bit-identical to the scalar path.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn tile_q4_1x8<const R: usize>(
        a: &[&[BlockQ8_1]; R],
        g: &[BlockQ4_1x8],
        out: &mut [[f32; 8]; R],
    ) {
        let nb = a[0].len();
        let a: [&[BlockQ8_1]; R] = std::array::from_fn(|r| &a[r][..nb]);
        let g = &g[..nb];
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, x) in g.iter().enumerate() {
            // SAFETY: `d` and `m` are 16 readable bytes each; the loads are unaligned.
            let (wd, wm) = unsafe {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(x.d.as_ptr() as *const __m128i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(x.m.as_ptr() as *const __m128i)),
                )
            };
            let mut isum = [_mm256_setzero_si256(); R];
            for v in 0..8 {
                // SAFETY: `qs[v % 4]` is 32 bytes at a 32-byte aligned offset of a 32-byte
                // aligned block.
                let q = unsafe { _mm256_load_si256(x.qs[v % 4].as_ptr() as *const __m256i) };
                // Values 4v..4v+4 of each row: low nibbles for v < 4, high ones after
                // (16 + 4(v - 4) = 4v), so they pair with activation bytes 4v..4v+4.
                let wv = if v < 4 {
                    _mm256_and_si256(q, low)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), low)
                };
                for r in 0..R {
                    // SAFETY: `qs` is 32 readable bytes; 4v + 4 <= 32.
                    let y = unsafe { (a[r][b].qs.as_ptr() as *const i32).add(v).read_unaligned() };
                    let y = _mm256_set1_epi32(y);
                    #[cfg(all(target_feature = "avx512vnni", target_feature = "avx512vl"))]
                    // SAFETY: this build targets CPUs with AVX-512 VNNI and VL (the cfg above).
                    unsafe {
                        isum[r] = _mm256_dpbusd_epi32(isum[r], wv, y);
                    }
                    #[cfg(not(all(target_feature = "avx512vnni", target_feature = "avx512vl")))]
                    {
                        isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(wv, y));
                    }
                }
            }
            for r in 0..R {
                let ab = &a[r][b];
                #[cfg(all(target_feature = "avx512vnni", target_feature = "avx512vl"))]
                let i = isum[r];
                #[cfg(not(all(target_feature = "avx512vnni", target_feature = "avx512vl")))]
                let i = _mm256_madd_epi16(isum[r], _mm256_set1_epi16(1));
                let t = _mm256_mul_ps(
                    _mm256_mul_ps(_mm256_cvtepi32_ps(i), wd),
                    _mm256_set1_ps(ab.d),
                );
                let t = _mm256_add_ps(t, _mm256_mul_ps(wm, _mm256_set1_ps(ab.s)));
                acc[r] = _mm256_add_ps(acc[r], t);
            }
        }
        for r in 0..R {
            // SAFETY: `out[r]` is 8 writable f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
        }
    }

    /// Q8_0 tile of one 8-row group (`BlockQ8_0x8`), laid out as the Q4_1 groups: each
    /// vector of 4 values of 8 rows times 4 activation bytes broadcast, row `c`'s sum in lane
    /// `c`. VNNI's `vpdpbusd` multiplies unsigned by signed bytes, so the weights go in
    /// shifted by 128 (`w ^ 0x80` is `w + 128` as an unsigned byte) and the sum starts at
    /// `-128 * sum(a)`, which cancels the shift exactly. On AVX2 the sign moves onto the
    /// activations (`|w| * sign(a, w)`, ggml's trick) and each `maddubs` pair (at most
    /// 2 x 128 x 127) widens to i32 at once. Then one fused multiply-add per block and lane,
    /// as [`super::tile_q8_0x8_scalar`] does: bit-identical to it.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn tile_q8_0x8<const R: usize>(
        a: &[&[BlockQ8_1]; R],
        g: &[BlockQ8_0x8],
        out: &mut [[f32; 8]; R],
    ) {
        let nb = a[0].len();
        let a: [&[BlockQ8_1]; R] = std::array::from_fn(|r| &a[r][..nb]);
        let g = &g[..nb];
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, x) in g.iter().enumerate() {
            // SAFETY: `d` is 8 f32 at a 32-byte aligned offset of a 32-byte aligned block.
            let wd = unsafe { _mm256_load_ps(x.d.as_ptr()) };
            #[cfg(all(target_feature = "avx512vnni", target_feature = "avx512vl"))]
            let mut isum: [__m256i; R] =
                std::array::from_fn(|r| _mm256_set1_epi32(-128 * a[r][b].sum));
            #[cfg(not(all(target_feature = "avx512vnni", target_feature = "avx512vl")))]
            let mut isum = [_mm256_setzero_si256(); R];
            for v in 0..8 {
                // SAFETY: `qs[v]` is 32 bytes at a 32-byte aligned offset of a 32-byte
                // aligned block.
                let q = unsafe { _mm256_load_si256(x.qs[v].as_ptr() as *const __m256i) };
                #[cfg(all(target_feature = "avx512vnni", target_feature = "avx512vl"))]
                let u = _mm256_xor_si256(q, _mm256_set1_epi8(-128));
                #[cfg(not(all(target_feature = "avx512vnni", target_feature = "avx512vl")))]
                let u = _mm256_abs_epi8(q);
                for r in 0..R {
                    // SAFETY: `qs` is 32 readable bytes; 4v + 4 <= 32.
                    let y = unsafe { (a[r][b].qs.as_ptr() as *const i32).add(v).read_unaligned() };
                    let y = _mm256_set1_epi32(y);
                    #[cfg(all(target_feature = "avx512vnni", target_feature = "avx512vl"))]
                    // SAFETY: this build targets CPUs with AVX-512 VNNI and VL (the cfg above).
                    unsafe {
                        isum[r] = _mm256_dpbusd_epi32(isum[r], u, y);
                    }
                    #[cfg(not(all(target_feature = "avx512vnni", target_feature = "avx512vl")))]
                    {
                        let p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(y, q));
                        isum[r] =
                            _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                    }
                }
            }
            for r in 0..R {
                let d = _mm256_mul_ps(wd, _mm256_set1_ps(a[r][b].d));
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        for r in 0..R {
            // SAFETY: `out[r]` is 8 writable f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn tile_q8_0<const R: usize, const C: usize>(
        a: &[&[BlockQ8_1]; R],
        w: &[&[BlockQ8_0]; C],
        out: &mut [[f32; C]; R],
    ) {
        let nb = a[0].len();
        let a: [&[BlockQ8_1]; R] = std::array::from_fn(|r| &a[r][..nb]);
        let w: [&[BlockQ8_0]; C] = std::array::from_fn(|c| &w[c][..nb]);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for b in 0..nb {
            // |w| as unsigned bytes; the sign moves onto the activations (ggml's trick for
            // a signed x signed maddubs). Values lie in -127..=127, so |w| fits.
            let wx: [__m256i; C] = std::array::from_fn(|c| load_i8x32(&w[c][b].qs));
            let ax: [__m256i; C] = std::array::from_fn(|c| _mm256_sign_epi8(wx[c], wx[c]));
            for r in 0..R {
                let ab = &a[r][b];
                let y = load_i8x32(&ab.qs);
                for c in 0..C {
                    let p = dot_u8_i8(ax[c], _mm256_sign_epi8(y, wx[c]));
                    let d = _mm256_set1_ps(w[c][b].d * ab.d);
                    acc[r][c] = _mm256_fmadd_ps(d, p, acc[r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                out[r][c] = hsum(acc[r][c]);
            }
        }
    }
}

/// Q4_1 tile on the fastest path this build has.
#[inline(always)]
pub fn tile_q4_1<const R: usize, const C: usize>(
    a: &[&[BlockQ8_1]; R],
    w: &[&[BlockQ4_1]; C],
    out: &mut [[f32; C]; R],
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if C == 4 {
        let w4 = <&[&[BlockQ4_1]; 4]>::try_from(&w[..]).expect("C == 4");
        let mut o = [[0f32; 4]; R];
        // SAFETY: this build targets CPUs with AVX2 and FMA (the cfg above), so the
        // target-feature function runs on a CPU that has them.
        unsafe { avx2::tile_q4_1(a, w4, &mut o) };
        for (dst, src) in out.iter_mut().zip(&o) {
            dst.copy_from_slice(&src[..C]);
        }
        return;
    }
    tile_q4_1_scalar(a, w, out);
}

/// 8-row Q4_1 group tile on the fastest path this build has (bit-identical to the scalar
/// one).
#[inline(always)]
pub fn tile_q4_1x8<const R: usize>(
    a: &[&[BlockQ8_1]; R],
    g: &[BlockQ4_1x8],
    out: &mut [[f32; 8]; R],
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ))]
    // SAFETY: this build targets CPUs with AVX2, FMA and F16C (the cfg above), so the
    // target-feature function runs on a CPU that has them.
    unsafe {
        avx2::tile_q4_1x8(a, g, out)
    };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    )))]
    tile_q4_1x8_scalar(a, g, out);
}

/// 8-row Q8_0 group tile on the fastest path this build has (bit-identical to the scalar
/// one).
#[inline(always)]
pub fn tile_q8_0x8<const R: usize>(
    a: &[&[BlockQ8_1]; R],
    g: &[BlockQ8_0x8],
    out: &mut [[f32; 8]; R],
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    // SAFETY: this build targets CPUs with AVX2 and FMA (the cfg above), so the
    // target-feature function runs on a CPU that has them.
    unsafe {
        avx2::tile_q8_0x8(a, g, out)
    };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    tile_q8_0x8_scalar(a, g, out);
}

/// Q8_0 tile on the fastest path this build has.
#[inline(always)]
pub fn tile_q8_0<const R: usize, const C: usize>(
    a: &[&[BlockQ8_1]; R],
    w: &[&[BlockQ8_0]; C],
    out: &mut [[f32; C]; R],
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    // SAFETY: this build targets CPUs with AVX2 and FMA (the cfg above), so the
    // target-feature function runs on a CPU that has them.
    unsafe {
        avx2::tile_q8_0(a, w, out)
    };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    tile_q8_0_scalar(a, w, out);
}
