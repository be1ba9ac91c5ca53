//! Tile dot products of Q8_K activation rows against 8-row groups of K-quant weights
//! (`kquants::BlockQ4Kx8`, `BlockQ6Kx8`), one SIMD lane per weight row.
//!
//! The block math is ggml's (`ggml_vec_dot_q4_K_q8_K`, `ggml_vec_dot_q6_K_q8_K`): per block,
//! an exact integer sum over the sub-blocks, each sub-block's integer dot product times its
//! integer scale; Q4_K's mins enter through the activation's exact sub-block sums
//! (`sum_s m_s * bsum_s`), Q6_K's offset of 32 likewise (`sc_s * (dot_s - 32 bsum_s)`). Then
//! per block and weight row, the float steps in one fixed order:
//!
//! ```text
//! acc = fma(d_w * d_a, isum, acc)            (Q4_K and Q6_K)
//! acc = fma(-(dmin_w * d_a), msum, acc)      (Q4_K only)
//! ```
//!
//! as ggml's AVX2 path does with its fused multiply-adds. The scalar tiles here are that
//! math written plainly on row-by-row blocks, the reference the SIMD tiles are tested against
//! bit for bit: every integer sum is exact on every path, and the float steps are the same
//! operations in the same order.

use super::blocks::RowGroup;
use super::kquants::{
    BlockQ4K, BlockQ4Kx8, BlockQ6K, BlockQ6Kx8, BlockQ8K, q4_k_value, q6_k_value,
};

/// Q4_K block against an activation block: the scaled integer sum and the mins' sum.
#[inline(always)]
fn isums_q4_k(w: &BlockQ4K, a: &BlockQ8K) -> (i32, i32) {
    let mut isum = 0i32;
    for s in 0..8 {
        let dot: i32 = (32 * s..32 * s + 32)
            .map(|v| q4_k_value(w, v) as i32 * a.qs[v] as i32)
            .sum();
        isum += w.sc[s] as i32 * dot;
    }
    let msum = (0..8).map(|s| w.m[s] as i32 * a.bsums32[s] as i32).sum();
    (isum, msum)
}

/// Q6_K block against an activation block: the scaled integer sum, offset included.
#[inline(always)]
fn isum_q6_k(w: &BlockQ6K, a: &BlockQ8K) -> i32 {
    let mut isum = 0i32;
    for s in 0..16 {
        let dot: i32 = (16 * s..16 * s + 16)
            .map(|v| q6_k_value(w, v) as i32 * a.qs[v] as i32)
            .sum();
        isum += w.sc[s] as i32 * (dot - 32 * a.bsums[s] as i32);
    }
    isum
}

/// The reference: `dot(a, w)` over row-by-row Q4_K blocks, in the fixed float order.
pub fn dot_q4_k(a: &[BlockQ8K], w: &[BlockQ4K]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.iter().zip(a) {
        let (isum, msum) = isums_q4_k(wb, ab);
        acc = (wb.d * ab.d).mul_add(isum as f32, acc);
        acc = (-(wb.dmin * ab.d)).mul_add(msum as f32, acc);
    }
    acc
}

/// The reference: `dot(a, w)` over row-by-row Q6_K blocks, in the fixed float order.
pub fn dot_q6_k(a: &[BlockQ8K], w: &[BlockQ6K]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.iter().zip(a) {
        acc = (wb.d * ab.d).mul_add(isum_q6_k(wb, ab) as f32, acc);
    }
    acc
}

/// Scalar tile of R activation rows against one group of 8 Q4_K rows.
pub fn tile_q4_kx8_scalar<const R: usize>(
    a: &[&[BlockQ8K]; R],
    g: &[BlockQ4Kx8],
    out: &mut [[f32; 8]; R],
) {
    for (ar, o) in a.iter().zip(out.iter_mut()) {
        for (c, o) in o.iter_mut().enumerate() {
            let rows: Vec<BlockQ4K> = g.iter().map(|x| x.row(c)).collect();
            *o = dot_q4_k(ar, &rows);
        }
    }
}

/// Scalar tile of R activation rows against one group of 8 Q6_K rows.
pub fn tile_q6_kx8_scalar<const R: usize>(
    a: &[&[BlockQ8K]; R],
    g: &[BlockQ6Kx8],
    out: &mut [[f32; 8]; R],
) {
    for (ar, o) in a.iter().zip(out.iter_mut()) {
        for (c, o) in o.iter_mut().enumerate() {
            let rows: Vec<BlockQ6K> = g.iter().map(|x| x.row(c)).collect();
            *o = dot_q6_k(ar, &rows);
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ4Kx8, BlockQ6Kx8, BlockQ8K};

    /// `acc` plus, per i32 lane, the sum of 4 products of unsigned weight bytes and signed
    /// activation bytes. One VNNI instruction where the build has AVX-512 VNNI; otherwise
    /// AVX2's `maddubs` (pairs to i16: weights below 64 times activations of magnitude at most
    /// 128 never saturate) and `madd` (pairs to i32). The sums are the same.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot4_acc(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        #[cfg(all(target_feature = "avx512vnni", target_feature = "avx512vl"))]
        // SAFETY: this build targets CPUs with AVX-512 VNNI and VL (the cfg above).
        unsafe {
            _mm256_dpbusd_epi32(acc, w, a)
        }
        #[cfg(not(all(target_feature = "avx512vnni", target_feature = "avx512vl")))]
        {
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
            _mm256_add_epi32(acc, p)
        }
    }

    /// Activation bytes `at..at + 4` of `a`, broadcast to every lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn act4(a: &BlockQ8K, at: usize) -> __m256i {
        debug_assert!(at + 4 <= a.qs.len());
        // SAFETY: `at + 4 <= 256`, within `qs`; the read is unaligned.
        let v = unsafe { (a.qs.as_ptr().add(at) as *const i32).read_unaligned() };
        _mm256_set1_epi32(v)
    }

    /// The activation's sums of sub-blocks `2i` and `2i + 1` as an i16 pair, broadcast (the
    /// other operand of a `madd` against pairs of mins).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn sum_pair(a: &BlockQ8K, i: usize) -> __m256i {
        let pair = (a.bsums32[2 * i] as u16 as u32) | ((a.bsums32[2 * i + 1] as u16 as u32) << 16);
        _mm256_set1_epi32(pair as i32)
    }

    /// 8 bytes widened to 8 i32 lanes, unsigned.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn u8x8_to_i32(b: &[u8; 8]) -> __m256i {
        // SAFETY: `b` is 8 readable bytes; the load is unaligned.
        _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(b.as_ptr() as *const __m128i) })
    }

    /// 8 bytes widened to 8 i32 lanes, signed.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn i8x8_to_i32(b: &[i8; 8]) -> __m256i {
        // SAFETY: `b` is 8 readable bytes; the load is unaligned.
        _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(b.as_ptr() as *const __m128i) })
    }

    /// 8 f16 values widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn f16x8(bits: &[u16; 8]) -> __m256 {
        // SAFETY: `bits` is 16 readable bytes; the load is unaligned.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(bits.as_ptr() as *const __m128i) })
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load(v: &[u8; 32]) -> __m256i {
        // SAFETY: `v` is 32 readable bytes at a 32-byte aligned offset of a 32-byte aligned
        // block (the group types are `align(32)` with their vectors first).
        unsafe { _mm256_load_si256(v.as_ptr() as *const __m256i) }
    }

    /// Q4_K tile of one 8-row group: per sub-block, the 8 vectors of its values (low or high
    /// nibbles of 8 `qs` vectors) times 4 activation bytes broadcast, summed per lane, times
    /// the lanes' scales; the mins against the activation's sub-block sums; then the float
    /// steps of [`super::dot_q4_k`], lane by lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn tile_q4_kx8<const R: usize>(
        a: &[&[BlockQ8K]; R],
        g: &[BlockQ4Kx8],
        out: &mut [[f32; 8]; R],
    ) {
        let nb = a[0].len();
        let a: [&[BlockQ8K]; R] = std::array::from_fn(|r| &a[r][..nb]);
        let g = &g[..nb];
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, x) in g.iter().enumerate() {
            let mut isum = [_mm256_setzero_si256(); R];
            for chunk in 0..4 {
                // Sub-blocks 2 chunk (low nibbles) and 2 chunk + 1 (high nibbles) of the same
                // 8 vectors, each loaded once.
                let mut dot_lo = [_mm256_setzero_si256(); R];
                let mut dot_hi = [_mm256_setzero_si256(); R];
                for u in 0..8 {
                    let q = load(&x.qs[8 * chunk + u]);
                    let lo = _mm256_and_si256(q, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                    for r in 0..R {
                        let at = 64 * chunk + 4 * u;
                        dot_lo[r] = dot4_acc(dot_lo[r], lo, act4(&a[r][b], at));
                        dot_hi[r] = dot4_acc(dot_hi[r], hi, act4(&a[r][b], at + 32));
                    }
                }
                let sc_lo = u8x8_to_i32(&x.sc[2 * chunk]);
                let sc_hi = u8x8_to_i32(&x.sc[2 * chunk + 1]);
                for r in 0..R {
                    let t = _mm256_add_epi32(
                        _mm256_mullo_epi32(dot_lo[r], sc_lo),
                        _mm256_mullo_epi32(dot_hi[r], sc_hi),
                    );
                    isum[r] = _mm256_add_epi32(isum[r], t);
                }
            }
            let wd = f16x8(&x.d);
            let wdmin = f16x8(&x.dmin);
            for r in 0..R {
                let ab = &a[r][b];
                let mut msum = _mm256_setzero_si256();
                for (i, m) in x.m.iter().enumerate() {
                    // SAFETY: `m` is 16 readable bytes; the load is unaligned.
                    let m = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(m.as_ptr().cast()) });
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, sum_pair(ab, i)));
                }
                let ad = _mm256_set1_ps(ab.d);
                let d = _mm256_mul_ps(wd, ad);
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[r]), acc[r]);
                // Negated by flipping the sign bit, as `-x` does in the reference.
                let dmin = _mm256_xor_ps(_mm256_mul_ps(wdmin, ad), _mm256_set1_ps(-0.0));
                acc[r] = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(msum), acc[r]);
            }
        }
        for r in 0..R {
            // SAFETY: `out[r]` is 8 writable f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
        }
    }

    /// Values `v0..v0 + 4` (`v0` a multiple of 4) of the group's 8 rows as bytes (0..64), one
    /// row per lane (see `kquants::q6_k_value` for the layout): the low 4 bits from a nibble
    /// of `ql`, the high 2 moved from bits `2k..2k + 2` of `qh` to bits 4..6 by one shift
    /// (bits shifted in from the neighbouring byte of a 16-bit lane are masked off).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn q6_values(x: &BlockQ6Kx8, v0: usize) -> __m256i {
        let (h, k, l) = (v0 / 128, (v0 % 128) / 32, v0 % 32);
        let ql = load(&x.ql[(64 * h + 32 * (k % 2) + l) / 4]);
        let qh = load(&x.qh[(32 * h + l) / 4]);
        let lo = if k < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
        let hi = match k {
            0 => _mm256_slli_epi16(qh, 4),
            1 => _mm256_slli_epi16(qh, 2),
            2 => qh,
            _ => _mm256_srli_epi16(qh, 2),
        };
        _mm256_or_si256(
            _mm256_and_si256(lo, _mm256_set1_epi8(0x0F)),
            _mm256_and_si256(hi, _mm256_set1_epi8(0x30)),
        )
    }

    /// Q6_K tile of one 8-row group: per sub-block of 16 values, 4 vectors of 6-bit values
    /// put together from `ql` (low 4 bits) and `qh` (high 2) times 4 activation bytes
    /// broadcast, summed per lane, less 32 times the activation's sub-block sum, times the
    /// lanes' scales; then the float step of [`super::dot_q6_k`], lane by lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn tile_q6_kx8<const R: usize>(
        a: &[&[BlockQ8K]; R],
        g: &[BlockQ6Kx8],
        out: &mut [[f32; 8]; R],
    ) {
        let nb = a[0].len();
        let a: [&[BlockQ8K]; R] = std::array::from_fn(|r| &a[r][..nb]);
        let g = &g[..nb];
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, x) in g.iter().enumerate() {
            let mut isum = [_mm256_setzero_si256(); R];
            for s in 0..16 {
                let mut dot = [_mm256_setzero_si256(); R];
                for u in 0..4 {
                    let v0 = 16 * s + 4 * u;
                    let w = q6_values(x, v0);
                    for r in 0..R {
                        dot[r] = dot4_acc(dot[r], w, act4(&a[r][b], v0));
                    }
                }
                let sc = i8x8_to_i32(&x.sc[s]);
                for r in 0..R {
                    let offset = _mm256_set1_epi32(32 * a[r][b].bsums[s] as i32);
                    let t = _mm256_sub_epi32(dot[r], offset);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(t, sc));
                }
            }
            let wd = f16x8(&x.d);
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
}

/// 8-row Q4_K group tile on the fastest path this build has (bit-identical to the scalar
/// one).
#[inline(always)]
pub fn tile_q4_kx8<const R: usize>(
    a: &[&[BlockQ8K]; R],
    g: &[BlockQ4Kx8],
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
        avx2::tile_q4_kx8(a, g, out)
    };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    )))]
    tile_q4_kx8_scalar(a, g, out);
}

/// 8-row Q6_K group tile on the fastest path this build has (bit-identical to the scalar
/// one).
#[inline(always)]
pub fn tile_q6_kx8<const R: usize>(
    a: &[&[BlockQ8K]; R],
    g: &[BlockQ6Kx8],
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
        avx2::tile_q6_kx8(a, g, out)
    };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    )))]
    tile_q6_kx8_scalar(a, g, out);
}
