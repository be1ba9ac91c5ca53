//! Intel AMX tiles for the K-quant matmuls (`kquants`): 16 activation rows against 16 weight
//! rows (two 8-row groups), one sub-block at a time.
//!
//! A K-quant block's sub-blocks each have their own integer scale, applied to that
//! sub-block's exact integer dot product before the next is added (ggml's block math, see
//! `kdot`), so one tile product covers one sub-block: 32 bytes deep for Q4_K, 16 for Q6_K
//! (the tiles are configured to that depth). Per sub-block the 16 x 16 sums are scaled (and
//! Q6_K's offset of 32 taken off through the activations' sub-block sums) and added up in i32,
//! exactly as the AVX tiles do; per block the float steps are theirs, 16 lanes wide: results
//! are bit-identical to `kdot::tile_q4_kx8` / `tile_q6_kx8`.
//!
//! A pair's weight tiles are laid out once per task and pair, before its first product (a
//! tile load waits for the stores before it to drain) and used by every slab of 16
//! activation rows; the products run one sub-block ahead of their epilogue (two sets of tile
//! registers in turn).
//!
//! Tile registers: tmm0/tmm3 the 16 x 16 i32 sums, tmm1/tmm4 the 16 activation rows' bytes
//! of one sub-block, tmm2/tmm5 the weight bytes in VNNI order (row `k / 4` holds, per
//! weight row, values `k..k + 4`).

use std::arch::asm;
use std::arch::x86_64::*;

use super::amx::{ROWS, Sums, TileConfig, Tiles, join};
use super::kquants::{BlockQ4Kx8, BlockQ6Kx8, BlockQ8K};

/// The tile shapes for sub-blocks of `depth` bytes.
const fn config(depth: usize) -> TileConfig {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 6 {
        (colsb[t], rows[t]) = match t % 3 {
            0 => (64, 16),
            1 => (depth as u16, 16),
            _ => (64, (depth / 4) as u8),
        };
        t += 1;
    }
    TileConfig {
        palette: 1,
        start_row: 0,
        _reserved: [0; 14],
        colsb,
        rows,
    }
}

/// One sub-block position of a pair of groups as a weight tile: `depth / 4` rows of
/// 16 x 4 bytes (at most 8 rows).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct KWeightTile([u8; 8 * 64]);

impl KWeightTile {
    pub const ZERO: KWeightTile = KWeightTile([0; 8 * 64]);
}

/// A pair of 8-row K-quant groups AMX can multiply, a sub-block at a time.
pub trait AmxKPair: Copy {
    /// Bytes per sub-block (the tile depth).
    const DEPTH: usize;
    /// Sub-blocks per block.
    const SUBS: usize;

    /// Sub-block `s`'s weight tile of these two groups' blocks.
    ///
    /// # Safety
    /// AVX-512F and BW are available (this module's cfg).
    unsafe fn weight_tile(g0: &Self, g1: &Self, s: usize, out: &mut KWeightTile);

    /// Sub-block `s`'s scales of the 16 weight rows.
    ///
    /// # Safety
    /// AVX-512F is available.
    unsafe fn scales(g0: &Self, g1: &Self, s: usize) -> __m512i;

    /// What sub-block `s`'s integer sums against activation block `a` have taken off before
    /// scaling (Q6_K's offset of 32 times the sub-block's activation sum).
    fn offset(a: &BlockQ8K, s: usize) -> i32;

    /// Adds the block's float terms to `acc`: its scaled integer sum `isum` and whatever
    /// else the format adds (Q4_K's mins).
    ///
    /// # Safety
    /// AVX-512F, BW, DQ, F16C and FMA are available.
    unsafe fn finish(g0: &Self, g1: &Self, a: &BlockQ8K, isum: __m512i, acc: &mut __m512);
}

/// Two rows' 8 bytes as 16 i32 lanes, unsigned or signed.
#[inline]
#[target_feature(enable = "avx512f")]
fn bytes16(lo: &[u8; 8], hi: &[u8; 8], signed: bool) -> __m512i {
    let v = _mm_set_epi64x(i64::from_le_bytes(*hi), i64::from_le_bytes(*lo));
    if signed {
        _mm512_cvtepi8_epi32(v)
    } else {
        _mm512_cvtepu8_epi32(v)
    }
}

/// The 16 rows' f16 scales as f32.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
fn f16x16(lo: &[u16; 8], hi: &[u16; 8]) -> __m512 {
    // SAFETY: each is 16 readable bytes; the loads are unaligned.
    unsafe {
        _mm512_cvtph_ps(_mm256_set_m128i(
            _mm_loadu_si128(hi.as_ptr() as *const __m128i),
            _mm_loadu_si128(lo.as_ptr() as *const __m128i),
        ))
    }
}

impl AmxKPair for BlockQ4Kx8 {
    const DEPTH: usize = 32;
    const SUBS: usize = 8;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn weight_tile(g0: &Self, g1: &Self, s: usize, out: &mut KWeightTile) {
        let low = _mm512_set1_epi8(0x0F);
        for u in 0..8 {
            // Values 32s + 4u.. of the 16 rows: low nibbles for even s, high for odd (see
            // `BlockQ4Kx8`).
            let v = 8 * (s / 2) + u;
            let q = join(&g0.qs[v], &g1.qs[v]);
            let w = if s.is_multiple_of(2) {
                _mm512_and_si512(q, low)
            } else {
                _mm512_and_si512(_mm512_srli_epi16(q, 4), low)
            };
            // SAFETY: row u is 64 bytes inside the 512-byte tile.
            unsafe { _mm512_storeu_si512(out.0.as_mut_ptr().add(64 * u) as *mut __m512i, w) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scales(g0: &Self, g1: &Self, s: usize) -> __m512i {
        bytes16(&g0.sc[s], &g1.sc[s], false)
    }

    fn offset(_: &BlockQ8K, _: usize) -> i32 {
        0
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,f16c,fma")]
    unsafe fn finish(g0: &Self, g1: &Self, a: &BlockQ8K, isum: __m512i, acc: &mut __m512) {
        let mut msum = _mm512_setzero_si512();
        for i in 0..4 {
            // Rows' min pairs of sub-blocks 2i and 2i + 1 (see `BlockQ4Kx8`) against the
            // activation's two sums.
            // SAFETY: each `m[i]` is 16 readable bytes; the loads are unaligned.
            let m = unsafe {
                _mm256_set_m128i(
                    _mm_loadu_si128(g1.m[i].as_ptr().cast()),
                    _mm_loadu_si128(g0.m[i].as_ptr().cast()),
                )
            };
            let pair =
                (a.bsums32[2 * i] as u16 as u32) | ((a.bsums32[2 * i + 1] as u16 as u32) << 16);
            let p = _mm512_madd_epi16(_mm512_cvtepu8_epi16(m), _mm512_set1_epi32(pair as i32));
            msum = _mm512_add_epi32(msum, p);
        }
        let ad = _mm512_set1_ps(a.d);
        // The AVX tile's steps: fma(d_w d_a, isum, acc), then fma(-(dmin_w d_a), msum, acc).
        let d = _mm512_mul_ps(f16x16(&g0.d, &g1.d), ad);
        *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), *acc);
        let dmin = _mm512_mul_ps(f16x16(&g0.dmin, &g1.dmin), ad);
        let dmin = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(dmin),
            _mm512_set1_epi32(i32::MIN),
        ));
        *acc = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(msum), *acc);
    }
}

impl AmxKPair for BlockQ6Kx8 {
    const DEPTH: usize = 16;
    const SUBS: usize = 16;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn weight_tile(g0: &Self, g1: &Self, s: usize, out: &mut KWeightTile) {
        let (low4, low2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x03));
        for u in 0..4 {
            // Values v0..v0 + 4 of the 16 rows (see `kquants::q6_k_value` for the layout).
            let v0 = 16 * s + 4 * u;
            let (h, k, l) = (v0 / 128, (v0 % 128) / 32, v0 % 32);
            let vl = (64 * h + 32 * (k % 2) + l) / 4;
            let vh = (32 * h + l) / 4;
            let ql = join(&g0.ql[vl], &g1.ql[vl]);
            let qh = join(&g0.qh[vh], &g1.qh[vh]);
            let lo = if k < 2 { ql } else { _mm512_srli_epi16(ql, 4) };
            let hi = _mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32));
            let w = _mm512_or_si512(
                _mm512_and_si512(lo, low4),
                _mm512_slli_epi16(_mm512_and_si512(hi, low2), 4),
            );
            // SAFETY: row u is 64 bytes inside the 512-byte tile.
            unsafe { _mm512_storeu_si512(out.0.as_mut_ptr().add(64 * u) as *mut __m512i, w) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scales(g0: &Self, g1: &Self, s: usize) -> __m512i {
        let (lo, hi) = (g0.sc[s].map(|v| v as u8), g1.sc[s].map(|v| v as u8));
        bytes16(&lo, &hi, true)
    }

    fn offset(a: &BlockQ8K, s: usize) -> i32 {
        32 * a.bsums[s] as i32
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,f16c,fma")]
    unsafe fn finish(g0: &Self, g1: &Self, a: &BlockQ8K, isum: __m512i, acc: &mut __m512) {
        let d = _mm512_mul_ps(f16x16(&g0.d, &g1.d), _mm512_set1_ps(a.d));
        *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), *acc);
    }
}

/// The tile registers configured for `G`'s sub-blocks on this thread (released when
/// dropped). `None` when the AMX path is off.
pub fn tiles<G: AmxKPair>() -> Option<Tiles> {
    let config = config(G::DEPTH);
    Tiles::with_config(&config)
}

/// Every sub-block's weight tile of a pair of 8-row groups (`g0` rows 0..8, `g1` rows
/// 8..16), block after block, into `out`.
pub fn weight_tiles<G: AmxKPair>(g0: &[G], g1: &[G], kb: usize, out: &mut Vec<KWeightTile>) {
    assert!(g0.len() >= kb && g1.len() >= kb);
    out.resize(kb * G::SUBS, KWeightTile::ZERO);
    for (i, w) in out.iter_mut().enumerate() {
        // SAFETY: this module is compiled only for targets with AVX-512 F and BW (its cfg).
        unsafe { G::weight_tile(&g0[i / G::SUBS], &g1[i / G::SUBS], i % G::SUBS, w) };
    }
}

/// Starts sub-block `i`'s (flattened: block `i / SUBS`, sub-block `i % SUBS`) tile product
/// in register set `i % 2`.
///
/// # Safety
/// The tiles are configured for `G` ([`tiles`]); `a` holds 16 rows of `kb` blocks.
#[inline(always)]
unsafe fn start<G: AmxKPair>(a: &[BlockQ8K], kb: usize, i: usize, w: &KWeightTile) {
    let (b, s) = (i / G::SUBS, i % G::SUBS);
    debug_assert!(a.len() > (ROWS - 1) * kb + b);
    let stride = kb * size_of::<BlockQ8K>();
    // From the whole slice, whose rows the tile load reads (not from block b's `qs` alone).
    let act = a[b..]
        .as_ptr()
        .cast::<u8>()
        .wrapping_add(std::mem::offset_of!(BlockQ8K, qs) + G::DEPTH * s);
    let (w, wstride) = (w.0.as_ptr(), 64usize);
    macro_rules! product {
        ($c:literal, $a:literal, $w:literal) => {
            asm!(
                concat!("tileloadd tmm", $w, ", [{w} + {ws}]"),
                concat!("tileloadd tmm", $a, ", [{a} + {s}]"),
                concat!("tilezero tmm", $c),
                concat!("tdpbssd tmm", $c, ", tmm", $a, ", tmm", $w),
                w = in(reg) w, ws = in(reg) wstride, a = in(reg) act, s = in(reg) stride,
                options(nostack, readonly),
            )
        };
    }
    // SAFETY: the caller configured the tiles; the activation tile reads DEPTH bytes at
    // `act + r * stride` for r < 16, bytes DEPTH s.. of the `qs` of a[r * kb + b] (in bounds
    // by the caller's contract); the weight tile reads DEPTH / 4 rows of 64 bytes of `w`.
    unsafe {
        if i.is_multiple_of(2) {
            product!("0", "1", "2")
        } else {
            product!("3", "4", "5")
        }
    }
}

/// Stores sub-block `i`'s 16 x 16 sums (register set `i % 2`).
///
/// # Safety
/// The tiles are configured and `start(.., i, ..)` ran.
#[inline(always)]
unsafe fn store(i: usize, sums: &mut Sums) {
    let (p, stride) = (sums.as_mut_ptr(), 64usize);
    // SAFETY: the tile is 16 rows of 64 bytes, written to the 1 KiB `sums`.
    unsafe {
        if i.is_multiple_of(2) {
            asm!("tilestored [{p} + {s}], tmm0", p = in(reg) p, s = in(reg) stride, options(nostack))
        } else {
            asm!("tilestored [{p} + {s}], tmm3", p = in(reg) p, s = in(reg) stride, options(nostack))
        }
    }
}

/// `out[r][c]` = the dot product of activation row `r` (row `r` of `a`, `kb` blocks a row)
/// with weight row `c` of the pair (`g0` rows 0..8, `g1` rows 8..16, `w` its
/// [`weight_tiles`]), every term in the AVX tile's order.
pub fn slab<G: AmxKPair>(
    tiles: &Tiles,
    a: &[BlockQ8K],
    kb: usize,
    (g0, g1, w): (&[G], &[G], &[KWeightTile]),
    out: &mut [[f32; ROWS]; ROWS],
) {
    assert!(kb > 0 && a.len() >= ROWS * kb);
    assert!(g0.len() >= kb && g1.len() >= kb && w.len() >= kb * G::SUBS);
    // SAFETY: this module is compiled only for targets with these features (its cfg).
    unsafe { slab_avx512(tiles, a, kb, (g0, g1, w), out) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,f16c,fma")]
fn slab_avx512<G: AmxKPair>(
    _tiles: &Tiles,
    a: &[BlockQ8K],
    kb: usize,
    (g0, g1, w): (&[G], &[G], &[KWeightTile]),
    out: &mut [[f32; ROWS]; ROWS],
) {
    let mut sums = Sums::ZERO;
    let mut isum = [_mm512_setzero_si512(); ROWS];
    let mut acc = [_mm512_setzero_ps(); ROWS];
    let n = kb * G::SUBS;
    // SAFETY (the unsafe blocks below): `_tiles` proves the tiles are configured on this
    // thread for G (`tiles::<G>`); `a` holds 16 rows of `kb` blocks (asserted by `slab`).
    unsafe { start::<G>(a, kb, 0, &w[0]) };
    for i in 0..n {
        let (b, s) = (i / G::SUBS, i % G::SUBS);
        // SAFETY: as above; sub-block i's product was started, i + 1's starts before i's
        // epilogue.
        unsafe {
            if i + 1 < n {
                start::<G>(a, kb, i + 1, &w[i + 1]);
            }
            store(i, &mut sums);
        }
        // SAFETY: AVX-512F, DQ, F16C and FMA are enabled for this function.
        let sc = unsafe { G::scales(&g0[b], &g1[b], s) };
        for (r, isum) in isum.iter_mut().enumerate() {
            let t = sums.row(r);
            let t = _mm512_sub_epi32(t, _mm512_set1_epi32(G::offset(&a[r * kb + b], s)));
            *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(t, sc));
        }
        if s + 1 == G::SUBS {
            for (r, (isum, acc)) in isum.iter_mut().zip(acc.iter_mut()).enumerate() {
                // SAFETY: as above.
                unsafe { G::finish(&g0[b], &g1[b], &a[r * kb + b], *isum, acc) };
                *isum = _mm512_setzero_si512();
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 16 writable f32; the store is unaligned.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
    }
}
