//! GGUF's K-quant weight formats (Q4_K, Q6_K) kept as stored, and the Q8_K activation blocks
//! their dot products take, following ggml's block math (`ggml-quants.c`).
//!
//! A K-quant block holds 256 values of one weight row with a second level of scales: Q4_K has
//! 8 sub-blocks of 32 values, each with a 6-bit scale and a 6-bit min (value `j` of sub-block
//! `s` is `d * sc_s * q_j - dmin * m_s`, `q_j` in 0..16); Q6_K has 16 sub-blocks of 16 values,
//! each with an int8 scale (value `j` is `d * sc_s * (q_j - 32)`, `q_j` in 0..64). Here the
//! blocks of 8 consecutive weight rows are interleaved as the Q4_1 and Q8_0 groups are
//! (`blocks::BlockQ4_1x8`): one 32-bit SIMD lane per row, 4 bytes of each row per vector, so
//! a dot product needs no horizontal sums. The quantized values stay GGUF's bytes, only
//! transposed; the sub-block scales are unpacked from their 6-bit packing into bytes (a few
//! bytes more per block, no bit-twiddling in the inner loop). A matrix whose row count is not a
//! multiple of 8 gets zero rows to fill its last group.

use half::f16;

/// Values per K-quant block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// GGUF's Q4_K block: f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes
/// of nibbles.
pub const GGUF_Q4_K_BYTES: usize = 144;
/// GGUF's Q6_K block: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
/// scales, f16 d.
pub const GGUF_Q6_K_BYTES: usize = 210;

/// An activation block (ggml's `block_q8_K`): value `j` is about `d * qs[j]`; `bsums[i]` is
/// the exact sum of `qs[16i..16i + 16]` (Q6_K's sub-blocks) and `bsums32[i]` that of
/// `qs[32i..32i + 32]` (Q4_K's).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(32))]
pub struct BlockQ8K {
    pub qs: [i8; QK_K],
    pub bsums: [i16; 16],
    pub bsums32: [i16; 8],
    pub d: f32,
}

impl BlockQ8K {
    pub const ZERO: BlockQ8K = BlockQ8K {
        qs: [0; QK_K],
        bsums: [0; 16],
        bsums32: [0; 8],
        d: 0.0,
    };
}

/// Quantize a row (length a multiple of 256) into activation blocks, as ggml's
/// `quantize_row_q8_K_ref`: the scale maps the first value of largest magnitude to -128
/// (`iscale = -128 / max`, so `d` has the opposite sign of that value), every value is
/// `iscale * x` rounded to nearest, ties to even (ggml's `nearest_int`), capped at 127.
/// Every activation row of a K-quant matmul goes through here, so it has a SIMD path
/// (bit-identical for finite inputs).
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        let x: &[f32; QK_K] = x.try_into().expect("a block is 256 values");
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
        // SAFETY: this build targets CPUs with AVX2 (the cfg above).
        unsafe {
            avx2::quantize_block_q8_k(x, b)
        };
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
        quantize_block_q8_k_scalar(x, b);
    }
}

/// One block of [`quantize_row_q8_k`], value by value: the reference of the SIMD path.
#[cfg_attr(all(target_arch = "x86_64", target_feature = "avx2"), allow(dead_code))]
fn quantize_block_q8_k_scalar(x: &[f32; QK_K], b: &mut BlockQ8K) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        *b = BlockQ8K::ZERO;
        return;
    }
    let iscale = -128.0 / max;
    for (q, &v) in b.qs.iter_mut().zip(x) {
        *q = (iscale * v).round_ties_even().min(127.0) as i8;
    }
    block_sums(b);
    b.d = 1.0 / iscale;
}

/// The block's sums of 16 and of 32 values, from its `qs`.
fn block_sums(b: &mut BlockQ8K) {
    for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    for (i, s) in b.bsums32.iter_mut().enumerate() {
        *s = b.bsums[2 * i] + b.bsums[2 * i + 1];
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ8K, QK_K, block_sums};

    /// [`super::quantize_block_q8_k_scalar`] 8 values at a time: the same largest magnitude
    /// (its first value found by a scan), the same products, rounded by `cvtps` (to nearest,
    /// ties to even, the default rounding mode), capped at 127 and packed to bytes.
    #[target_feature(enable = "avx2")]
    pub fn quantize_block_q8_k(x: &[f32; QK_K], b: &mut BlockQ8K) {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            // SAFETY: `c` is 8 readable f32; the load is unaligned.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let Some(&max) = x.iter().find(|v| v.abs() == amax).filter(|_| amax > 0.0) else {
            *b = BlockQ8K::ZERO;
            return;
        };
        let iscale = -128.0 / max;
        let is = _mm256_set1_ps(iscale);
        let cap = _mm256_set1_epi32(127);
        for (c, out) in x.chunks_exact(32).zip(b.qs.chunks_exact_mut(32)) {
            let q: [__m256i; 4] = std::array::from_fn(|i| {
                // SAFETY: `c` is 32 readable f32; 8i + 8 <= 32; the load is unaligned.
                let v = unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * i)) };
                _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, is)), cap)
            });
            // Saturating packs (nothing saturates: values lie in -128..=127) leave the
            // 4-byte groups interleaved by lane; one permute orders them.
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // SAFETY: `out` is 32 writable bytes; the store is unaligned.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, p) };
        }
        block_sums(b);
        b.d = 1.0 / iscale;
    }
}

/// A Q4_K block of one row, its scales unpacked: value `32 s + j` is
/// `d * sc[s] * q - dmin * m[s]`, `q` the low nibble of `qs[32 (s / 2) + j]` for even `s`,
/// the high nibble for odd `s` (GGUF order).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4K {
    pub d: f32,
    pub dmin: f32,
    pub sc: [u8; 8],
    pub m: [u8; 8],
    pub qs: [u8; QK_K / 2],
}

/// A Q6_K block of one row, as stored: value `v` is `d * sc[v / 16] * (q - 32)` with `q`
/// 6 bits from `ql` (low 4) and `qh` (high 2) in GGUF's order (see [`q6_k_value`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ6K {
    pub d: f32,
    pub sc: [i8; 16],
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Sub-block `j`'s 6-bit scale and min out of Q4_K's 12 packed bytes (ggml's
/// `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Repack GGUF Q4_K bytes.
pub fn q4_k_from_gguf(bytes: &[u8]) -> Vec<BlockQ4K> {
    bytes
        .chunks_exact(GGUF_Q4_K_BYTES)
        .map(|b| {
            let mut blk = BlockQ4K {
                d: f16_at(b, 0),
                dmin: f16_at(b, 2),
                sc: [0; 8],
                m: [0; 8],
                qs: [0; QK_K / 2],
            };
            for j in 0..8 {
                (blk.sc[j], blk.m[j]) = scale_min_k4(j, &b[4..16]);
            }
            blk.qs.copy_from_slice(&b[16..144]);
            blk
        })
        .collect()
}

/// Repack GGUF Q6_K bytes.
pub fn q6_k_from_gguf(bytes: &[u8]) -> Vec<BlockQ6K> {
    bytes
        .chunks_exact(GGUF_Q6_K_BYTES)
        .map(|b| {
            let mut blk = BlockQ6K {
                d: f16_at(b, 208),
                sc: [0; 16],
                ql: [0; QK_K / 2],
                qh: [0; QK_K / 4],
            };
            blk.ql.copy_from_slice(&b[..128]);
            blk.qh.copy_from_slice(&b[128..192]);
            for (s, &byte) in blk.sc.iter_mut().zip(&b[192..208]) {
                *s = byte as i8;
            }
            blk
        })
        .collect()
}

/// Q4_K value `v` (0..256) of a block, unsigned (0..16).
#[inline(always)]
pub fn q4_k_value(b: &BlockQ4K, v: usize) -> u8 {
    let byte = b.qs[32 * (v / 64) + v % 32];
    if (v / 32).is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

/// Q6_K value `v` (0..256) of a block, unsigned (0..64; the value is `q - 32`). ggml's
/// layout: each half of 128 values takes 64 bytes of `ql` and 32 of `qh`; value
/// `128 h + 32 k + l` (k in 0..4, l in 0..32) has its low 4 bits in byte `64 h + l + 32 (k % 2)`
/// of `ql` (low nibble for k < 2, high for k >= 2) and its high 2 bits at bit `2 k` of byte
/// `32 h + l` of `qh`.
#[inline(always)]
pub fn q6_k_value(b: &BlockQ6K, v: usize) -> u8 {
    let (h, k, l) = (v / 128, (v % 128) / 32, v % 32);
    let byte = b.ql[64 * h + l + 32 * (k % 2)];
    let low = if k < 2 { byte & 0x0F } else { byte >> 4 };
    let high = (b.qh[32 * h + l] >> (2 * k)) & 3;
    low | (high << 4)
}

/// Dequantize Q4_K blocks into `out` (`256 * blocks.len()` values), ggml's
/// `dequantize_row_q4_K`: `d * sc` and `dmin * m` are rounded to f32 first.
pub fn dequantize_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        for (v, o) in o.iter_mut().enumerate() {
            let (d, m) = (b.d * b.sc[v / 32] as f32, b.dmin * b.m[v / 32] as f32);
            *o = d * q4_k_value(b, v) as f32 - m;
        }
    }
}

/// Dequantize Q6_K blocks into `out` (`256 * blocks.len()` values), ggml's
/// `dequantize_row_q6_K`.
pub fn dequantize_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        for (v, o) in o.iter_mut().enumerate() {
            *o = b.d * b.sc[v / 16] as f32 * (q6_k_value(b, v) as i32 - 32) as f32;
        }
    }
}

/// Eight Q4_K blocks at the same position of 8 consecutive weight rows, one 32-bit lane per
/// row: `qs[v]` holds bytes `4v..4v + 4` of each row's `qs`, row after row (so its low
/// nibbles are values `64 (v / 8) + 4 (v % 8) + i` of the 8 rows and its high nibbles the
/// same 32 later); `sc[s]` the 8 rows' scales of sub-block `s`; `m[i]` the mins of
/// sub-blocks `2i` and `2i + 1` in pairs, row after row (`m[i][2c + j]` is row `c`'s min of
/// sub-block `2i + j`: widened to i16, one `madd` against two activation sums gives each
/// row's two terms); `d` and `dmin` the rows' f16 scales as stored (exact when widened).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(32))]
pub struct BlockQ4Kx8 {
    pub qs: [[u8; 32]; 32],
    pub sc: [[u8; 8]; 8],
    pub m: [[u8; 16]; 4],
    pub d: [u16; 8],
    pub dmin: [u16; 8],
}

/// Eight Q6_K blocks at the same position of 8 consecutive weight rows, one 32-bit lane per
/// row: `ql[v]` holds bytes `4v..4v + 4` of each row's `ql` and `qh[v]` bytes `4v..4v + 4`
/// of each row's `qh`, row after row; `sc[s]` the 8 rows' scales of sub-block `s`; `d` their
/// f16 scales.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(32))]
pub struct BlockQ6Kx8 {
    pub ql: [[u8; 32]; 32],
    pub qh: [[u8; 32]; 16],
    pub sc: [[i8; 8]; 16],
    pub d: [u16; 8],
}

/// Eight rows' bytes as vectors of 4-byte runs: vector `v`, lane `c` holds bytes
/// `4v..4v + 4` of `rows[c]` (each row `4 V` bytes long).
fn lanes<const V: usize>(rows: [&[u8]; 8]) -> [[u8; 32]; V] {
    debug_assert!(rows.iter().all(|r| r.len() == 4 * V));
    std::array::from_fn(|v| std::array::from_fn(|i| rows[i / 4][4 * v + i % 4]))
}

/// Row `c`'s bytes out of vectors laid out by [`lanes`].
fn unlanes<const N: usize>(vectors: &[[u8; 32]], c: usize) -> [u8; N] {
    std::array::from_fn(|j| vectors[j / 4][4 * c + j % 4])
}

fn f16_bits(v: f32) -> u16 {
    f16::from_f32(v).to_bits()
}

fn from_f16_bits(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Groups of 8 rows from rows of blocks (`kb` blocks per row), the last group filled with
/// `zero` rows when the row count is not a multiple of 8: group `g`, block `b` at
/// `g * kb + b`.
fn interleave8_padded<R: Copy, G>(
    rows: &[R],
    kb: usize,
    zero: R,
    group: impl Fn([&R; 8]) -> G,
) -> Vec<G> {
    let n = rows.len() / kb;
    let mut out = Vec::with_capacity(n.div_ceil(8) * kb);
    for g in 0..n.div_ceil(8) {
        for b in 0..kb {
            let at = |c: usize| {
                let r = g * 8 + c;
                if r < n { &rows[r * kb + b] } else { &zero }
            };
            out.push(group(std::array::from_fn(at)));
        }
    }
    out
}

/// A Q4_K block of zeros (the padding rows of a last group).
const ZERO_Q4_K: BlockQ4K = BlockQ4K {
    d: 0.0,
    dmin: 0.0,
    sc: [0; 8],
    m: [0; 8],
    qs: [0; QK_K / 2],
};

/// A Q6_K block of zeros.
const ZERO_Q6_K: BlockQ6K = BlockQ6K {
    d: 0.0,
    sc: [0; 16],
    ql: [0; QK_K / 2],
    qh: [0; QK_K / 4],
};

/// Interleave rows of Q4_K blocks into groups of 8 rows (`kb` blocks per row).
pub fn q4_k_interleave8(rows: &[BlockQ4K], kb: usize) -> Vec<BlockQ4Kx8> {
    interleave8_padded(rows, kb, ZERO_Q4_K, |blk| BlockQ4Kx8 {
        qs: lanes::<32>(blk.map(|b| &b.qs[..])),
        sc: std::array::from_fn(|s| blk.map(|b| b.sc[s])),
        m: std::array::from_fn(|i| std::array::from_fn(|j| blk[j / 2].m[2 * i + j % 2])),
        d: blk.map(|b| f16_bits(b.d)),
        dmin: blk.map(|b| f16_bits(b.dmin)),
    })
}

/// Interleave rows of Q6_K blocks into groups of 8 rows (`kb` blocks per row).
pub fn q6_k_interleave8(rows: &[BlockQ6K], kb: usize) -> Vec<BlockQ6Kx8> {
    interleave8_padded(rows, kb, ZERO_Q6_K, |blk| BlockQ6Kx8 {
        ql: lanes::<32>(blk.map(|b| &b.ql[..])),
        qh: lanes::<16>(blk.map(|b| &b.qh[..])),
        sc: std::array::from_fn(|s| blk.map(|b| b.sc[s])),
        d: blk.map(|b| f16_bits(b.d)),
    })
}

impl super::blocks::RowGroup for BlockQ4Kx8 {
    type Row = BlockQ4K;

    fn row(&self, c: usize) -> BlockQ4K {
        BlockQ4K {
            d: from_f16_bits(self.d[c]),
            dmin: from_f16_bits(self.dmin[c]),
            sc: self.sc.map(|s| s[c]),
            m: std::array::from_fn(|s| self.m[s / 2][2 * c + s % 2]),
            qs: unlanes(&self.qs, c),
        }
    }
}

impl super::blocks::RowGroup for BlockQ6Kx8 {
    type Row = BlockQ6K;

    fn row(&self, c: usize) -> BlockQ6K {
        BlockQ6K {
            d: from_f16_bits(self.d[c]),
            sc: self.sc.map(|s| s[c]),
            ql: unlanes(&self.ql, c),
            qh: unlanes(&self.qh, c),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, ggml_file::qtensor_from_ggml};

    use super::super::blocks::{RowGroup, deinterleave8};
    use super::*;

    /// Random bytes for `blocks` GGUF blocks of `size` bytes each, with the f16 scales at
    /// `scales` set to small finite values (random bits could be NaN or huge).
    pub(crate) fn random_blocks(
        seed: u64,
        blocks: usize,
        size: usize,
        scales: &[usize],
    ) -> Vec<u8> {
        let mut s = seed;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let mut out = Vec::with_capacity(blocks * size);
        for _ in 0..blocks {
            let mut b: Vec<u8> = (0..size).map(|_| next() as u8).collect();
            for &at in scales {
                let v = (next() % 1000) as f32 * 1e-5 + 1e-4;
                b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
            out.extend(b);
        }
        out
    }

    fn candle_dequantize(dtype: GgmlDType, bytes: &[u8], values: usize) -> Vec<f32> {
        qtensor_from_ggml(dtype, bytes, vec![values], &candle_core::Device::Cpu)
            .unwrap()
            .dequantize(&candle_core::Device::Cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// The repacked blocks hold exactly the values ggml's (and candle's) dequantization gives
    /// the GGUF bytes, through the 8-row interleaving and back.
    #[test]
    fn repacked_k_quants_keep_the_stored_values() {
        let kb = 3;
        let bytes = random_blocks(11, 16 * kb, GGUF_Q4_K_BYTES, &[0, 2]);
        let rows = q4_k_from_gguf(&bytes);
        let mut got = vec![0f32; rows.len() * QK_K];
        dequantize_q4_k(&rows, &mut got);
        assert_eq!(got, candle_dequantize(GgmlDType::Q4K, &bytes, got.len()));
        assert_eq!(deinterleave8(&q4_k_interleave8(&rows, kb), kb), rows);

        let bytes = random_blocks(12, 16 * kb, GGUF_Q6_K_BYTES, &[208]);
        let rows = q6_k_from_gguf(&bytes);
        let mut got = vec![0f32; rows.len() * QK_K];
        dequantize_q6_k(&rows, &mut got);
        assert_eq!(got, candle_dequantize(GgmlDType::Q6K, &bytes, got.len()));
        assert_eq!(deinterleave8(&q6_k_interleave8(&rows, kb), kb), rows);
    }

    /// A last group of fewer than 8 rows is filled with zero rows.
    #[test]
    fn a_partial_last_group_is_padded_with_zero_rows() {
        let kb = 2;
        let rows = q4_k_from_gguf(&random_blocks(5, 11 * kb, GGUF_Q4_K_BYTES, &[0, 2]));
        let groups = q4_k_interleave8(&rows, kb);
        assert_eq!(groups.len(), 2 * kb);
        for b in 0..kb {
            assert_eq!(groups[kb + b].row(2), rows[10 * kb + b]);
            assert_eq!(groups[kb + b].row(3), ZERO_Q4_K);
        }
    }

    /// This build's quantizer (SIMD where the CPU has it) gives the scalar one's blocks bit
    /// for bit: random scales, halfway values (ties to even), the largest magnitude first
    /// positive or negative, all zeros.
    #[test]
    fn q8_k_quantizer_matches_the_scalar_one() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut blocks: Vec<Vec<f32>> = (0..500)
            .map(|i| {
                let scale = [1e-6, 0.01, 1.0, 37.0, 1e4][i % 5];
                (0..QK_K).map(|_| (next() * 2.0 - 1.0) * scale).collect()
            })
            .collect();
        // max 128 makes the scale -1: k + 0.5 lands exactly halfway.
        blocks.push(
            (0..QK_K)
                .map(|j| {
                    if j == 3 {
                        128.0
                    } else {
                        (j % 100) as f32 - 49.5
                    }
                })
                .collect(),
        );
        blocks.push(
            (0..QK_K)
                .map(|j| {
                    if j == 0 {
                        -128.0
                    } else {
                        127.5 - j as f32 / 2.0
                    }
                })
                .collect(),
        );
        blocks.push(vec![0.0; QK_K]);
        blocks.push(
            (0..QK_K)
                .map(|j| if j % 2 == 0 { -0.0 } else { 0.0 })
                .collect(),
        );
        for x in &blocks {
            let (mut fast, mut slow) = ([BlockQ8K::ZERO], BlockQ8K::ZERO);
            quantize_row_q8_k(x, &mut fast);
            quantize_block_q8_k_scalar(x.as_slice().try_into().unwrap(), &mut slow);
            assert_eq!(fast[0], slow, "{x:?}");
        }
    }

    #[test]
    fn activation_blocks_follow_ggml() {
        let mut x: Vec<f32> = (0..2 * QK_K)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.031)
            .collect();
        // The first value of largest magnitude is positive in block 0 (so `d` < 0) and
        // negative in block 1.
        x[7] = 9.0;
        x[9] = -9.0;
        x[QK_K + 3] = -5.0;
        let mut q = [BlockQ8K::ZERO; 2];
        quantize_row_q8_k(&x, &mut q);
        assert_eq!(q[0].qs[7], -128);
        assert_eq!(q[0].qs[9], 127);
        assert!(q[0].d < 0.0 && q[1].d > 0.0);
        for (b, x) in q.iter().zip(x.chunks_exact(QK_K)) {
            // Within half a step, except a value of the largest magnitude but the other sign
            // than the first: it would be 128 and is capped at 127, one step off.
            for (&v, &qv) in x.iter().zip(&b.qs) {
                let bound = if v.abs() == x.iter().fold(0f32, |a, v| a.max(v.abs())) {
                    b.d.abs()
                } else {
                    b.d.abs() * 0.5
                };
                assert!((v - b.d * qv as f32).abs() <= bound + 1e-6, "{v} {qv}");
            }
            for i in 0..16 {
                let s: i32 = b.qs[16 * i..16 * i + 16].iter().map(|&v| v as i32).sum();
                assert_eq!(b.bsums[i] as i32, s);
            }
            for i in 0..8 {
                assert_eq!(b.bsums32[i], b.bsums[2 * i] + b.bsums[2 * i + 1]);
            }
        }
        // Ties go to even, as ggml's `nearest_int`: with max 128 the scale is -1, so 2.5
        // becomes -2 and 3.5 becomes -4.
        let mut t = vec![0f32; QK_K];
        t[0] = 128.0;
        t[1] = 2.5;
        t[2] = 3.5;
        quantize_row_q8_k(&t, &mut q[..1]);
        assert_eq!((q[0].qs[0], q[0].qs[1], q[0].qs[2]), (-128, -2, -4));
        quantize_row_q8_k(&[0.0; QK_K], &mut q[..1]);
        assert_eq!(q[0], BlockQ8K::ZERO);
    }
}
