//! Intel AMX tiles for batched quantized matmuls: 16 activation rows against 16 weight rows
//! (two 8-row groups), one 32-value block at a time.
//!
//! Where the CPU has AMX-INT8 (Sapphire Rapids and later) and Linux grants the process the
//! tile registers, one `tdpbssd` computes a block's 16 x 16 exact integer dot products, work
//! that takes the AVX tiles 32 `vpdpbusd` and as many broadcasts. Per block, the float
//! epilogue that scales and adds those sums is the same sequence of operations, lane by lane,
//! as the AVX group tiles' (`dot::tile_q4_1x8`, `dot::tile_q8_0x8`), only 16 lanes wide, so
//! results are bit-identical to theirs. The epilogue of one block runs while the tile unit
//! multiplies the next (two accumulator tiles, used in turn).
//!
//! Rust has no stable AMX intrinsics, so the tile instructions are inline assembly; support
//! is CPUID plus `arch_prctl(ARCH_REQ_XCOMP_PERM)`. `BULKHEAD_CPU_AMX=off` turns the path
//! off (to compare, or to rule it out).
//!
//! Tile registers, configured per task with `ldtilecfg` and released after it:
//! tmm0/tmm1 the 16 x 16 i32 sums, tmm2/tmm3 the 16 x 32 activation bytes, tmm4/tmm5 the
//! 32 x 16 weight bytes in VNNI order (row `k / 4` holds, per weight row, values
//! `k..k + 4`), the pairs used for even and odd blocks.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::blocks::{BlockQ4_1x8, BlockQ8_0x8, BlockQ8_1, QK};

/// Activation (and weight) rows of one tile.
pub const ROWS: usize = 16;

/// Whether the AMX path is on: the CPU has AMX-INT8, Linux let this process use the tile
/// registers, and `BULKHEAD_CPU_AMX` is not `off`/`0`. Asked once per process.
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        let off = std::env::var("BULKHEAD_CPU_AMX")
            .is_ok_and(|v| matches!(v.trim(), "0" | "off" | "false" | "no"));
        !off && supported()
    })
}

/// CPUID says AMX-TILE and AMX-INT8, and the kernel grants the tile data state.
fn supported() -> bool {
    // CPUID leaf 7 exists on every x86-64 CPU that has AVX-512 (this module's cfg).
    let leaf7 = __cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx >> 24 & 1 == 1, leaf7.edx >> 25 & 1 == 1);
    if !(tile && int8) {
        return false;
    }
    // Linux (5.16+) hands out the 8 KiB tile state only on request; until then the first
    // tile instruction faults.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only changes which xstate features the process
    // may use; it reads no memory.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    } == 0;
    if !granted {
        tracing::info!("CPU has AMX but the OS refused the tile state; using AVX kernels");
    }
    granted
}

/// `ldtilecfg`'s 64-byte operand (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    _reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 6 {
        (colsb[t], rows[t]) = match t {
            // Sums: 16 rows of 16 i32.
            0 | 1 => (64, 16),
            // Activations: 16 rows of one block's 32 bytes.
            2 | 3 => (QK as u16, 16),
            // Weights: 32 / 4 rows of 16 x 4 bytes.
            _ => (64, (QK / 4) as u8),
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
};

/// The tile registers, configured for this module's kernels on the current thread; released
/// (back to their initial state, cheap to context-switch) when dropped.
pub struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    /// Configures the tiles. `None` when the AMX path is off.
    pub fn new() -> Option<Tiles> {
        if !enabled() {
            return None;
        }
        // SAFETY: `enabled` checked the CPU has AMX and the process may use its state;
        // CONFIG is a valid palette-1 configuration, 64 readable bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
        Some(Tiles(std::marker::PhantomData))
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `new` on this thread (`Tiles` is not Send).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// One block position of a pair of groups as a weight tile: 32 / 4 rows of 16 x 4 bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct WeightTile([u8; QK * ROWS]);

impl WeightTile {
    pub const ZERO: WeightTile = WeightTile([0; QK * ROWS]);
}

/// The i32 sums of one tile product, 64-byte aligned.
#[repr(C, align(64))]
pub struct Sums([i32; ROWS * ROWS]);

/// A pair of 8-row weight groups that AMX can multiply: how to lay one block position out
/// as a weight tile, and the float epilogue of its integer sums.
pub trait AmxPair: Copy {
    /// The weight tile (VNNI order, 16 rows) of these two groups' blocks.
    ///
    /// # Safety
    /// AVX-512F and BW are available (this module's cfg).
    unsafe fn weight_tile(g0: &Self, g1: &Self, out: &mut WeightTile);

    /// Adds block `b`'s scaled sums to the accumulators, one per activation row, lane `c`
    /// for weight row `c`.
    ///
    /// # Safety
    /// AVX-512F and F16C are available (this module's cfg).
    unsafe fn epilogue(
        g0: &Self,
        g1: &Self,
        a: &[BlockQ8_1],
        kb: usize,
        b: usize,
        sums: &Sums,
        acc: &mut [__m512; ROWS],
    );
}

/// Two 32-byte halves as one 64-byte vector.
#[inline]
#[target_feature(enable = "avx512f")]
fn join(lo: &[u8; 32], hi: &[u8; 32]) -> __m512i {
    // SAFETY: each reference is 32 readable bytes; the loads are unaligned.
    unsafe {
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(lo.as_ptr() as *const __m256i)),
            _mm256_loadu_si256(hi.as_ptr() as *const __m256i),
            1,
        )
    }
}

impl AmxPair for BlockQ4_1x8 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn weight_tile(g0: &Self, g1: &Self, out: &mut WeightTile) {
        let low = _mm512_set1_epi8(0x0F);
        for v in 0..4 {
            // Bytes 4v..4v+4 of the 16 rows: values 4v..4v+4 in the low nibbles (tile row
            // v), 16 + 4v.. in the high ones (tile row 4 + v); see `BlockQ4_1x8`.
            let q = join(&g0.qs[v], &g1.qs[v]);
            let lo = _mm512_and_si512(q, low);
            let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
            // SAFETY: rows v and 4 + v are 64 bytes each inside the 512-byte tile.
            unsafe {
                _mm512_storeu_si512(out.0.as_mut_ptr().add(64 * v) as *mut __m512i, lo);
                _mm512_storeu_si512(out.0.as_mut_ptr().add(64 * (4 + v)) as *mut __m512i, hi);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,f16c,fma")]
    unsafe fn epilogue(
        g0: &Self,
        g1: &Self,
        a: &[BlockQ8_1],
        kb: usize,
        b: usize,
        sums: &Sums,
        acc: &mut [__m512; ROWS],
    ) {
        // SAFETY: `d` and `m` are 16 readable bytes each; the loads are unaligned.
        let (wd, wm) = unsafe {
            let f16x16 = |lo: &[u16; 8], hi: &[u16; 8]| {
                _mm512_cvtph_ps(_mm256_set_m128i(
                    _mm_loadu_si128(hi.as_ptr() as *const __m128i),
                    _mm_loadu_si128(lo.as_ptr() as *const __m128i),
                ))
            };
            (f16x16(&g0.d, &g1.d), f16x16(&g0.m, &g1.m))
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            let ab = &a[r * kb + b];
            // SAFETY: row r of the sums is 16 i32 at a 64-byte aligned offset.
            let i = unsafe { _mm512_load_si512(sums.0.as_ptr().add(ROWS * r) as *const __m512i) };
            // The reference's order: (isum * dw) * da + mw * sa, then into the sum. `mw * sa`
            // is exact in f32 (both are f16 values: at most 22 significant bits), so one
            // fused multiply-add gives the same bits as its multiply and add.
            let t = _mm512_mul_ps(
                _mm512_mul_ps(_mm512_cvtepi32_ps(i), wd),
                _mm512_set1_ps(ab.d),
            );
            let t = _mm512_fmadd_ps(wm, _mm512_set1_ps(ab.s), t);
            *acc = _mm512_add_ps(*acc, t);
        }
    }
}

impl AmxPair for BlockQ8_0x8 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn weight_tile(g0: &Self, g1: &Self, out: &mut WeightTile) {
        for v in 0..8 {
            let q = join(bytemuck::cast_ref(&g0.qs[v]), bytemuck::cast_ref(&g1.qs[v]));
            // SAFETY: row v is 64 bytes inside the 512-byte tile.
            unsafe { _mm512_storeu_si512(out.0.as_mut_ptr().add(64 * v) as *mut __m512i, q) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,f16c,fma")]
    unsafe fn epilogue(
        g0: &Self,
        g1: &Self,
        a: &[BlockQ8_1],
        kb: usize,
        b: usize,
        sums: &Sums,
        acc: &mut [__m512; ROWS],
    ) {
        // SAFETY: `d` is 8 readable f32 in each group; the loads are unaligned.
        let wd = unsafe {
            _mm512_insertf32x8(
                _mm512_castps256_ps512(_mm256_loadu_ps(g0.d.as_ptr())),
                _mm256_loadu_ps(g1.d.as_ptr()),
                1,
            )
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row r of the sums is 16 i32 at a 64-byte aligned offset.
            let i = unsafe { _mm512_load_si512(sums.0.as_ptr().add(ROWS * r) as *const __m512i) };
            // As the AVX group tile: fma(dw * da, isum, acc).
            let d = _mm512_mul_ps(wd, _mm512_set1_ps(a[r * kb + b].d));
            *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(i), *acc);
        }
    }
}

/// Starts block `b`'s tile product in accumulator tile `slot` (0 or 1): loads the weight tile
/// from `w` and the 16 activation rows' block `b` from `a`, zeroes the sums and multiplies.
///
/// # Safety
/// The tiles are configured (`Tiles`); `a` holds 16 rows of `kb` blocks.
#[inline(always)]
unsafe fn start(slot: usize, a: &[BlockQ8_1], kb: usize, b: usize, w: &WeightTile) {
    debug_assert!(a.len() > (ROWS - 1) * kb + b);
    let stride = kb * size_of::<BlockQ8_1>();
    let act = a[b].qs.as_ptr();
    let (w, wstride) = (w.0.as_ptr(), 64usize);
    // SAFETY: the caller configured the tiles; the activation tile reads 32 bytes at `act +
    // r * stride` for r < 16, the `qs` of a[r * kb + b] (in bounds by the caller's
    // contract); the weight tile reads 8 rows of 64 bytes of `w`.
    unsafe {
        if slot == 0 {
            asm!(
                "tileloadd tmm4, [{w} + {ws}]",
                "tileloadd tmm2, [{a} + {s}]",
                "tilezero tmm0",
                "tdpbssd tmm0, tmm2, tmm4",
                w = in(reg) w, ws = in(reg) wstride, a = in(reg) act, s = in(reg) stride,
                options(nostack, readonly),
            );
        } else {
            asm!(
                "tileloadd tmm5, [{w} + {ws}]",
                "tileloadd tmm3, [{a} + {s}]",
                "tilezero tmm1",
                "tdpbssd tmm1, tmm3, tmm5",
                w = in(reg) w, ws = in(reg) wstride, a = in(reg) act, s = in(reg) stride,
                options(nostack, readonly),
            );
        }
    }
}

/// Stores accumulator tile `slot`'s 16 x 16 sums.
///
/// # Safety
/// The tiles are configured (`Tiles`) and `start(slot, ..)` ran.
#[inline(always)]
unsafe fn store(slot: usize, sums: &mut Sums) {
    let (p, stride) = (sums.0.as_mut_ptr(), 64usize);
    // SAFETY: the tile is 16 rows of 64 bytes, written to the 1 KiB `sums`.
    unsafe {
        if slot == 0 {
            asm!("tilestored [{p} + {s}], tmm0", p = in(reg) p, s = in(reg) stride, options(nostack));
        } else {
            asm!("tilestored [{p} + {s}], tmm1", p = in(reg) p, s = in(reg) stride, options(nostack));
        }
    }
}

/// The weight tiles of a pair of 8-row groups (`g0` rows 0..8, `g1` rows 8..16), one per
/// block position, into `out` (resized to `kb`): made once per pair, used by every slab of
/// activation rows (and read long after they were written, not straight out of the store
/// buffer).
///
/// `next` is the pair after this one, when there is one: its blocks are prefetched as
/// these are laid out, so the weights' trip from memory (a 16-stream decode step reads every
/// weight once, and at that batch the tiles leave little else to wait for) overlaps this
/// pair's work instead of stalling the next.
pub fn weight_tiles<G: AmxPair>(
    g0: &[G],
    g1: &[G],
    next: Option<(&[G], &[G])>,
    kb: usize,
    out: &mut Vec<WeightTile>,
) {
    assert!(g0.len() >= kb && g1.len() >= kb);
    out.resize(kb, WeightTile::ZERO);
    for (b, ((w, x0), x1)) in out.iter_mut().zip(g0).zip(g1).enumerate() {
        if let Some((n0, n1)) = next {
            for x in [n0.get(b), n1.get(b)].into_iter().flatten() {
                prefetch(x);
            }
        }
        // SAFETY: this module is compiled only for targets with AVX-512 F and BW (its cfg).
        unsafe { G::weight_tile(x0, x1, w) };
    }
}

/// Asks for every cache line of `x` (a hint: it reads nothing and cannot fault).
#[inline(always)]
fn prefetch<T>(x: &T) {
    let p = (x as *const T).cast::<i8>();
    for off in (0..size_of::<T>()).step_by(64) {
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing and never faults, and
        // `wrapping_add` stays inside `x` (off < size_of::<T>()).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
    }
}

/// `out[r][c]` = the dot product of activation row `r` (row `r` of `a`, `kb` blocks a row)
/// with weight row `c` of the group pair (`g0` rows 0..8, `g1` rows 8..16; `w` their weight
/// tiles from [`weight_tiles`]), every term in the AVX group tile's order.
#[inline]
pub fn slab<G: AmxPair>(
    tiles: &Tiles,
    a: &[BlockQ8_1],
    kb: usize,
    w: &[WeightTile],
    g0: &[G],
    g1: &[G],
    out: &mut [[f32; ROWS]; ROWS],
) {
    assert!(kb > 0 && a.len() >= ROWS * kb && w.len() >= kb && g0.len() >= kb && g1.len() >= kb);
    // SAFETY: this module is compiled only for targets with these features (its cfg).
    unsafe { slab_avx512(tiles, a, kb, w, g0, g1, out) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,f16c,fma")]
fn slab_avx512<G: AmxPair>(
    _tiles: &Tiles,
    a: &[BlockQ8_1],
    kb: usize,
    w: &[WeightTile],
    g0: &[G],
    g1: &[G],
    out: &mut [[f32; ROWS]; ROWS],
) {
    let mut sums = [Sums([0; ROWS * ROWS]), Sums([0; ROWS * ROWS])];
    let mut acc = [_mm512_setzero_ps(); ROWS];
    // SAFETY (both blocks below): `_tiles` proves the tiles are configured on this thread
    // (and that AMX is usable); `a` holds 16 rows of `kb` blocks (the caller asserted).
    unsafe { start(0, a, kb, 0, &w[0]) };
    for b in 0..kb {
        let slot = b % 2;
        // SAFETY: as above; block b's product was started in `slot`. Block b + 1's starts
        // in the other slot before block b's epilogue, so they overlap.
        unsafe {
            store(slot, &mut sums[slot]);
            if b + 1 < kb {
                start(1 - slot, a, kb, b + 1, &w[b + 1]);
            }
        }
        // SAFETY: AVX-512F, DQ, F16C and FMA are enabled for this function.
        unsafe { G::epilogue(&g0[b], &g1[b], a, kb, b, &sums[slot], &mut acc) };
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 16 writable f32; the store is unaligned.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
    }
}
