//! Block formats of the repacked weights and of the quantized activations.
//!
//! Weights keep GGUF's quantized values but hold their scales as f32 (converted once at load),
//! so the inner loops do no f16 conversion. Activations are quantized per matmul into
//! Q8_1-style blocks (int8 values, a scale and the sum of the values), which serve both
//! weight formats: Q4_1 uses the scaled sum for its offset `m`, Q8_0's VNNI kernel the exact
//! one to undo its unsigned shift.

use half::f16;

/// Values per block, for every format here.
pub const QK: usize = 32;

/// A Q4_1 block: value `j` is `d * q_j + m`; `qs[j]` holds `q_j` in its low nibble and
/// `q_{j+16}` in its high nibble (GGUF order).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f32,
    pub m: f32,
    pub qs: [u8; QK / 2],
}

/// Eight Q4_1 blocks at the same position of 8 consecutive weight rows, laid out so one
/// integer lane of a vector belongs to one row (no horizontal sums): `qs[v]` holds bytes
/// `4v..4v + 4` of each row's block, row after row, so its low nibbles are values
/// `4v..4v + 4` and its high nibbles values `16 + 4v..16 + 4v + 4` of the 8 rows. A dot
/// product multiplies each of these 8 vectors of values by 4 activation bytes broadcast to
/// every lane. Scales are kept as the GGUF's f16 bits (20 bytes per row block, as stored;
/// exact when widened), so one load and one widening give all 8.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(32))]
pub struct BlockQ4_1x8 {
    pub d: [u16; 8],
    pub m: [u16; 8],
    pub qs: [[u8; 32]; 4],
}

impl RowGroup for BlockQ4_1x8 {
    type Row = BlockQ4_1;

    /// Row `c`'s block, as stored in GGUF order.
    fn row(&self, c: usize) -> BlockQ4_1 {
        let f = |bits: u16| f16::from_bits(bits).to_f32();
        BlockQ4_1 {
            d: f(self.d[c]),
            m: f(self.m[c]),
            qs: std::array::from_fn(|j| self.qs[j / 4][4 * c + j % 4]),
        }
    }
}

/// Eight weight rows' blocks at one position, one 32-bit lane per row (`BlockQ4_1x8`,
/// `BlockQ8_0x8`).
pub trait RowGroup: Sized {
    /// The row-by-row block.
    type Row;
    /// Row `c`'s block (`c < 8`).
    fn row(&self, c: usize) -> Self::Row;
}

/// Groups of 8 rows from rows of blocks (`rows % 8 == 0`, `kb` blocks per row): group `g`,
/// block `b` at `g * kb + b`, made by `group` from the 8 rows' blocks at that position.
fn interleave8<R, G>(rows: &[R], kb: usize, group: impl Fn([&R; 8]) -> G) -> Vec<G> {
    let n = rows.len() / kb;
    assert!(n.is_multiple_of(8));
    let mut out = Vec::with_capacity(rows.len() / 8);
    for g in 0..n / 8 {
        for b in 0..kb {
            out.push(group(std::array::from_fn(|c| &rows[(g * 8 + c) * kb + b])));
        }
    }
    out
}

/// The inverse of the interleaving: rows of blocks again.
pub fn deinterleave8<G: RowGroup>(groups: &[G], kb: usize) -> Vec<G::Row> {
    let mut out = Vec::with_capacity(groups.len() * 8);
    for g in groups.chunks_exact(kb) {
        for c in 0..8 {
            out.extend(g.iter().map(|x| x.row(c)));
        }
    }
    out
}

/// Row `r`'s blocks, out of the groups (`kb` blocks per row).
pub fn group_row<G: RowGroup>(groups: &[G], kb: usize, r: usize) -> impl Iterator<Item = G::Row> {
    groups[r / 8 * kb..(r / 8 + 1) * kb]
        .iter()
        .map(move |x| x.row(r % 8))
}

/// Interleave rows of Q4_1 blocks into groups of 8 rows (see [`interleave8`]).
pub fn q4_1_interleave8(rows: &[BlockQ4_1], kb: usize) -> Vec<BlockQ4_1x8> {
    let bits = |v: f32| f16::from_f32(v).to_bits();
    interleave8(rows, kb, |blk| BlockQ4_1x8 {
        d: blk.map(|b| bits(b.d)),
        m: blk.map(|b| bits(b.m)),
        qs: std::array::from_fn(|v| std::array::from_fn(|i| blk[i / 4].qs[4 * v + i % 4])),
    })
}

/// A Q8_0 block: value `j` is `d * qs[j]`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f32,
    pub qs: [i8; QK],
}

/// Eight Q8_0 blocks at the same position of 8 consecutive weight rows, one 32-bit lane per
/// row as in [`BlockQ4_1x8`]: `qs[v]` holds values `4v..4v + 4` of each row's block, row
/// after row; `d` the 8 rows' scales.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(32))]
pub struct BlockQ8_0x8 {
    pub qs: [[i8; 32]; 8],
    pub d: [f32; 8],
}

impl RowGroup for BlockQ8_0x8 {
    type Row = BlockQ8_0;

    fn row(&self, c: usize) -> BlockQ8_0 {
        BlockQ8_0 {
            d: self.d[c],
            qs: std::array::from_fn(|j| self.qs[j / 4][4 * c + j % 4]),
        }
    }
}

/// Interleave rows of Q8_0 blocks into groups of 8 rows (see [`interleave8`]).
pub fn q8_0_interleave8(rows: &[BlockQ8_0], kb: usize) -> Vec<BlockQ8_0x8> {
    interleave8(rows, kb, |blk| BlockQ8_0x8 {
        qs: std::array::from_fn(|v| std::array::from_fn(|i| blk[i / 4].qs[4 * v + i % 4])),
        d: blk.map(|b| b.d),
    })
}

/// A quantized activation block: value `j` is about `d * qs[j]`; `s` is `d * sum(qs)` (as
/// the reference rounds it, for Q4_1's offset term) and `sum` the exact `sum(qs)`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(8))]
pub struct BlockQ8_1 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
    pub sum: i32,
}

impl BlockQ8_1 {
    pub const ZERO: BlockQ8_1 = BlockQ8_1 {
        d: 0.0,
        s: 0.0,
        qs: [0; QK],
        sum: 0,
    };
}

/// GGUF's Q4_1 block: f16 d, f16 m, 16 bytes of nibbles.
pub const GGUF_Q4_1_BYTES: usize = 20;
/// GGUF's Q8_0 block: f16 d, 32 int8.
pub const GGUF_Q8_0_BYTES: usize = 34;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Repack GGUF Q4_1 bytes.
pub fn q4_1_from_gguf(bytes: &[u8]) -> Vec<BlockQ4_1> {
    bytes
        .chunks_exact(GGUF_Q4_1_BYTES)
        .map(|b| {
            let mut qs = [0u8; QK / 2];
            qs.copy_from_slice(&b[4..20]);
            BlockQ4_1 {
                d: f16_at(b, 0),
                m: f16_at(b, 2),
                qs,
            }
        })
        .collect()
}

/// GGUF's Q5_0 block: f16 d, 4 bytes of high bits, 16 bytes of low nibbles.
pub const GGUF_Q5_0_BYTES: usize = 22;

/// GGUF Q5_0 bytes as GGUF Q8_0 bytes, exactly: both are 32 integers times one f16 scale,
/// and Q5_0's integers (-16..=15) fit an int8. So a Q5_0 matrix runs on the Q8_0 kernels
/// with the very values it stores (ggml's `dequantize_row_q5_0` block math).
pub fn q5_0_gguf_to_q8_0_gguf(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() / GGUF_Q5_0_BYTES * GGUF_Q8_0_BYTES);
    for b in bytes.chunks_exact(GGUF_Q5_0_BYTES) {
        out.extend_from_slice(&b[..2]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        let value = |j: usize| -> i8 {
            // Element j < 16 is the low nibble of byte j, element j + 16 its high nibble;
            // bit j of qh is the fifth bit of element j.
            let nibble = if j < QK / 2 {
                qs[j] & 0x0F
            } else {
                qs[j - QK / 2] >> 4
            };
            let high = ((qh >> j) & 1) as u8;
            (nibble | (high << 4)) as i8 - 16
        };
        out.extend((0..QK).map(|j| value(j) as u8));
    }
    out
}

/// Repack GGUF Q8_0 bytes.
pub fn q8_0_from_gguf(bytes: &[u8]) -> Vec<BlockQ8_0> {
    bytes
        .chunks_exact(GGUF_Q8_0_BYTES)
        .map(|b| {
            let mut qs = [0i8; QK];
            for (q, &byte) in qs.iter_mut().zip(&b[2..34]) {
                *q = byte as i8;
            }
            BlockQ8_0 {
                d: f16_at(b, 0),
                qs,
            }
        })
        .collect()
}

/// Quantize 32 values the way GGUF's (and candle's) `quantize_row_q8_0/q8_1` do: scale
/// `amax / 127` rounded to f16, values rounded half away from zero with the unrounded scale.
/// Returns (d, qs, sum of qs). Every activation row of every matmul goes through here, so
/// it has a SIMD path (bit-identical for finite inputs; `f32::round` is a libm call).
fn quantize_32(x: &[f32]) -> (f32, [i8; QK], i32) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    // SAFETY: this build targets CPUs with AVX2 (the cfg above).
    unsafe {
        avx2::quantize_32(x.try_into().expect("a block is 32 values"))
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    quantize_32_scalar(x)
}

// With AVX2 only the reference for the SIMD path's test.
#[cfg_attr(all(target_arch = "x86_64", target_feature = "avx2"), allow(dead_code))]
fn quantize_32_scalar(x: &[f32]) -> (f32, [i8; QK], i32) {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
        sum += *q as i32;
    }
    (f16::from_f32(d).to_f32(), qs, sum)
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::QK;

    /// [`super::quantize_32_scalar`] on 4 vectors: the same max, the same scale and product
    /// per value, and rounding half away from zero as `trunc(y) + (|y - trunc(y)| >= 0.5 ?
    /// ±1 : 0)` (`y - trunc(y)` is exact), then packed to bytes.
    #[target_feature(enable = "avx2")]
    pub fn quantize_32(x: &[f32; QK]) -> (f32, [i8; QK], i32) {
        // SAFETY: `x` is 32 readable f32; the loads are unaligned.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
        let sign = _mm256_set1_ps(-0.0);
        let abs = |v: __m256| _mm256_andnot_ps(sign, v);
        let m = _mm256_max_ps(
            _mm256_max_ps(abs(v[0]), abs(v[1])),
            _mm256_max_ps(abs(v[2]), abs(v[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let y = _mm256_mul_ps(v[i], id);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let away = _mm256_cmp_ps::<_CMP_GE_OQ>(abs(_mm256_sub_ps(y, t)), _mm256_set1_ps(0.5));
            let step = _mm256_or_ps(_mm256_and_ps(y, sign), _mm256_set1_ps(1.0));
            _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(away, step)))
        });
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
        // Saturating packs leave the 4-byte groups interleaved by lane; one permute orders them.
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        let mut qs = [0i8; QK];
        // SAFETY: `qs` is 32 writable bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, p) };
        (f16::from_f32(d).to_f32(), qs, sum)
    }
}

/// Quantize a row (length a multiple of 32) into activation blocks.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let (d, qs, sum) = quantize_32(x);
        // As in the reference: the sum goes through f16 and so does its product with d.
        let s = f16::from_f32(f16::from_f32(sum as f32).to_f32() * d).to_f32();
        *b = BlockQ8_1 { d, s, qs, sum };
    }
}

/// Quantize a row (length a multiple of 32) into Q8_0 weight blocks.
pub fn quantize_row_q8_0(x: &[f32], out: &mut Vec<BlockQ8_0>) {
    for x in x.chunks_exact(QK) {
        let (d, qs, _) = quantize_32(x);
        out.push(BlockQ8_0 { d, qs });
    }
}

/// Dequantize Q4_1 blocks into `out` (`32 * blocks.len()` values).
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        for j in 0..QK / 2 {
            o[j] = (b.qs[j] & 0x0F) as f32 * b.d + b.m;
            o[j + QK / 2] = (b.qs[j] >> 4) as f32 * b.d + b.m;
        }
    }
}

/// Dequantize Q8_0 blocks into `out` (`32 * blocks.len()` values).
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        for (v, &q) in o.iter_mut().zip(&b.qs) {
            *v = q as f32 * b.d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q5_0_becomes_q8_0_with_exactly_its_values() {
        // Random blocks (every bit pattern of qh and the nibbles is a valid Q5_0 block).
        let mut seed = 7u64;
        let mut bytes = Vec::new();
        for b in 0..64 {
            let d = f16::from_f32(0.01 + b as f32 * 0.003);
            bytes.extend_from_slice(&d.to_le_bytes());
            for _ in 0..20 {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                bytes.push((seed >> 56) as u8);
            }
        }
        let want = candle_core::quantized::ggml_file::qtensor_from_ggml(
            candle_core::quantized::GgmlDType::Q5_0,
            &bytes,
            vec![64 * QK],
            &candle_core::Device::Cpu,
        )
        .unwrap()
        .dequantize(&candle_core::Device::Cpu)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        let q8 = q8_0_from_gguf(&q5_0_gguf_to_q8_0_gguf(&bytes));
        let mut got = vec![0f32; 64 * QK];
        dequantize_q8_0(&q8, &mut got);
        assert_eq!(got, want);
    }

    #[test]
    fn activation_blocks_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .collect();
        let mut q = vec![BlockQ8_1::ZERO; 2];
        quantize_row_q8_1(&x, &mut q);
        for (b, x) in q.iter().zip(x.chunks_exact(QK)) {
            let sum: i32 = b.qs.iter().map(|&v| v as i32).sum();
            assert!((b.s - b.d * sum as f32).abs() <= 1e-2 * b.s.abs().max(b.d));
            for (&v, &qv) in x.iter().zip(&b.qs) {
                assert!((v - b.d * qv as f32).abs() <= b.d * 0.51 + 1e-3);
            }
        }
    }

    /// This build's quantizer (SIMD where the CPU has it) gives the scalar one's blocks bit
    /// for bit, halfway values (rounded away from zero) and tiny ones included.
    #[test]
    fn block_quantizer_matches_the_scalar_one() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut blocks: Vec<Vec<f32>> = (0..2000)
            .map(|i| {
                let scale = [1e-6, 0.01, 1.0, 37.0, 1e4][i % 5];
                (0..QK).map(|_| (next() * 2.0 - 1.0) * scale).collect()
            })
            .collect();
        // amax 127 makes the scale 1, so k + 0.5 lands exactly halfway.
        blocks.push(
            (0..QK)
                .map(|j| if j == 0 { 127.0 } else { j as f32 - 16.5 })
                .collect(),
        );
        blocks.push(
            (0..QK)
                .map(|j| if j == 0 { -127.0 } else { 0.5 - j as f32 })
                .collect(),
        );
        blocks.push(vec![0.0; QK]);
        blocks.push(
            (0..QK)
                .map(|j| if j % 2 == 0 { -0.0 } else { 0.0 })
                .collect(),
        );
        for x in &blocks {
            assert_eq!(quantize_32(x), quantize_32_scalar(x), "{x:?}");
        }
    }

    #[test]
    fn an_all_zero_block_quantizes_to_zero() {
        let mut q = vec![BlockQ8_1::ZERO; 1];
        quantize_row_q8_1(&[0.0; 32], &mut q);
        assert_eq!(q[0], BlockQ8_1::ZERO);
    }
}
