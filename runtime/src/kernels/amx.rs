//! Intel AMX tiles for batched quantized matmuls: 16 activation rows against 16 weight rows
//! (two 8-row groups), one 32-value block at a time.
//!
//! Where the CPU has AMX-INT8 (Sapphire Rapids and later) and Linux grants the process the
//! tile registers, one `tdpbssd` computes a block's 16 x 16 exact integer dot products, work
//! that takes the AVX-512 VNNI tiles 256 `vpdpbusd` on 8 lanes and as many broadcasts. Per block, the float
//! epilogue that scales and adds those sums is the same sequence of operations, lane by lane,
//! as the AVX group tiles' (`dot::tile_q4_1x8`, `dot::tile_q8_0x8`), only 16 lanes wide, so
//! results are bit-identical to theirs. Products run two blocks ahead of the epilogue (three
//! sum tiles in turn), and the next pair's weight tiles are laid out a block at a time
//! between them (a tile load waits for the stores before it to drain: a whole pair's tiles
//! written at once stalled its first product).
//!
//! Rust has no stable AMX intrinsics, so the tile instructions are inline assembly; support
//! is CPUID plus `arch_prctl(ARCH_REQ_XCOMP_PERM)`. `BULKHEAD_CPU_AMX=off` turns the path
//! off (to compare, or to rule it out).
//!
//! Tile registers, configured per task with `ldtilecfg` and released after it:
//! tmm0-tmm2 the 16 x 16 i32 sums (block `b` in `b % 3`), tmm3/tmm4 the 16 x 32 activation
//! bytes, tmm5/tmm6 the 32 x 16 weight bytes in VNNI order (row `k / 4` holds, per weight
//! row, values `k..k + 4`), the operand pairs used for even and odd blocks.

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
pub(super) struct TileConfig {
    pub(super) palette: u8,
    pub(super) start_row: u8,
    pub(super) _reserved: [u8; 14],
    pub(super) colsb: [u16; 16],
    pub(super) rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 7 {
        (colsb[t], rows[t]) = match t {
            // Sums: 16 rows of 16 i32.
            0..=2 => (64, 16),
            // Activations: 16 rows of one block's 32 bytes.
            3 | 4 => (QK as u16, 16),
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
        Self::with_config(&CONFIG)
    }

    /// Configures the tiles as `config` says (another module's kernels). `None` when the AMX
    /// path is off.
    pub(super) fn with_config(config: &TileConfig) -> Option<Tiles> {
        if !enabled() {
            return None;
        }
        assert_eq!(config.palette, 1, "palette 1 is the one AMX defines");
        // SAFETY: `enabled` checked the CPU has AMX and the process may use its state;
        // `config` is a palette-1 configuration (asserted; tile shapes the CPU refuses fault
        // at `ldtilecfg`, which the constant configurations here never are), 64 readable
        // bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config, options(nostack, readonly)) };
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

impl Sums {
    pub const ZERO: Sums = Sums([0; ROWS * ROWS]);

    /// Where a tile store writes the 16 rows of 64 bytes.
    pub(super) fn as_mut_ptr(&mut self) -> *mut i32 {
        self.0.as_mut_ptr()
    }

    /// Row `r`'s 16 sums.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn row(&self, r: usize) -> __m512i {
        assert!(r < ROWS);
        // SAFETY: row r is 16 i32 at a 64-byte aligned offset of the 64-byte aligned sums.
        unsafe { _mm512_load_si512(self.0.as_ptr().add(ROWS * r) as *const __m512i) }
    }
}

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
pub(super) fn join(lo: &[u8; 32], hi: &[u8; 32]) -> __m512i {
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

/// Starts block `b`'s tile product: loads the weight tile from `w` and the 16 activation
/// rows' block `b` from `a` (into tiles `3 + b % 2` and `5 + b % 2`), zeroes sum tile `b % 3`
/// and multiplies. Three sum tiles let two products run ahead of the epilogue; the operand
/// tiles can alternate, as a product reads them when it starts.
///
/// # Safety
/// The tiles are configured (`Tiles`); `a` holds 16 rows of `kb` blocks.
#[inline(always)]
unsafe fn start(a: &[BlockQ8_1], kb: usize, b: usize, w: &WeightTile) {
    debug_assert!(a.len() > (ROWS - 1) * kb + b);
    let stride = kb * size_of::<BlockQ8_1>();
    // From the whole slice, whose rows the tile load reads (not from block b's `qs` alone).
    let act = a[b..]
        .as_ptr()
        .cast::<u8>()
        .wrapping_add(std::mem::offset_of!(BlockQ8_1, qs));
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
    // SAFETY: the caller configured the tiles; the activation tile reads 32 bytes at `act +
    // r * stride` for r < 16, the `qs` of a[r * kb + b] (in bounds by the caller's
    // contract); the weight tile reads 8 rows of 64 bytes of `w`.
    unsafe {
        match b % 6 {
            0 => product!("0", "3", "5"),
            1 => product!("1", "4", "6"),
            2 => product!("2", "3", "5"),
            3 => product!("0", "4", "6"),
            4 => product!("1", "3", "5"),
            _ => product!("2", "4", "6"),
        }
    }
}

/// Stores block `b`'s 16 x 16 sums (sum tile `b % 3`).
///
/// # Safety
/// The tiles are configured (`Tiles`) and `start(.., b, ..)` ran.
#[inline(always)]
unsafe fn store(b: usize, sums: &mut Sums) {
    let (p, stride) = (sums.0.as_mut_ptr(), 64usize);
    // SAFETY: the tile is 16 rows of 64 bytes, written to the 1 KiB `sums`.
    unsafe {
        match b % 3 {
            0 => {
                asm!("tilestored [{p} + {s}], tmm0", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
            1 => {
                asm!("tilestored [{p} + {s}], tmm1", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
            _ => {
                asm!("tilestored [{p} + {s}], tmm2", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
        }
    }
}

/// The weight tiles of a pair of 8-row groups (`g0` rows 0..8, `g1` rows 8..16), one per
/// block position, into `out` (resized to `kb`), all at once: for a task's first pair (the
/// others are laid out during the pair before, see [`NextPair`]); used by every slab of
/// activation rows.
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
    for (b, w) in out.iter_mut().enumerate() {
        lay_out_block(g0, g1, next, b, w);
    }
}

/// Block `b`'s weight tile of the pair (`g0`, `g1`), with block `b` of the pair `after` it
/// prefetched.
#[inline(always)]
fn lay_out_block<G: AmxPair>(
    g0: &[G],
    g1: &[G],
    after: Option<(&[G], &[G])>,
    b: usize,
    out: &mut WeightTile,
) {
    if let Some((a0, a1)) = after {
        for x in [a0.get(b), a1.get(b)].into_iter().flatten() {
            prefetch(x);
        }
    }
    // SAFETY: this module is compiled only for targets with AVX-512 F and BW (its cfg).
    unsafe { G::weight_tile(&g0[b], &g1[b], out) };
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

/// The pair whose weight tiles a [`slab`] lays out as it goes, block by block (a tile load
/// waits for the stores before it to drain, so tiles made all at once before a pair's first
/// product stalled it; spread over the previous pair's blocks, each block's few stores drain
/// during its epilogue), and the pair after it, prefetched at the same pace.
pub struct NextPair<'a, G> {
    pub g0: &'a [G],
    pub g1: &'a [G],
    pub after: Option<(&'a [G], &'a [G])>,
    pub tiles: &'a mut [WeightTile],
}

/// A pair of 8-row groups (`g0` rows 0..8, `g1` rows 8..16) and its weight tiles.
pub struct Pair<'a, G> {
    pub g0: &'a [G],
    pub g1: &'a [G],
    pub tiles: &'a [WeightTile],
}

/// `out[r][c]` = the dot product of activation row `r` (row `r` of `a`, `kb` blocks a row)
/// with weight row `c` of `pair`, every term in the AVX group tile's order; meanwhile
/// `next`'s tiles are laid out.
#[inline]
pub fn slab<G: AmxPair>(
    tiles: &Tiles,
    a: &[BlockQ8_1],
    kb: usize,
    pair: Pair<'_, G>,
    next: Option<NextPair<'_, G>>,
    out: &mut [[f32; ROWS]; ROWS],
) {
    assert!(kb > 0 && a.len() >= ROWS * kb);
    assert!(pair.g0.len() >= kb && pair.g1.len() >= kb && pair.tiles.len() >= kb);
    if let Some(n) = &next {
        assert!(n.g0.len() >= kb && n.g1.len() >= kb && n.tiles.len() >= kb);
    }
    // SAFETY: this module is compiled only for targets with these features (its cfg).
    unsafe { slab_avx512(tiles, a, kb, pair, next, out) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,f16c,fma")]
fn slab_avx512<G: AmxPair>(
    _tiles: &Tiles,
    a: &[BlockQ8_1],
    kb: usize,
    Pair { g0, g1, tiles: w }: Pair<'_, G>,
    mut next: Option<NextPair<'_, G>>,
    out: &mut [[f32; ROWS]; ROWS],
) {
    let mut sums = Sums([0; ROWS * ROWS]);
    let mut acc = [_mm512_setzero_ps(); ROWS];
    // SAFETY (both blocks below): `_tiles` proves the tiles are configured on this thread
    // (and that AMX is usable); `a` holds 16 rows of `kb` blocks (the caller asserted).
    unsafe {
        start(a, kb, 0, &w[0]);
        if kb > 1 {
            start(a, kb, 1, &w[1]);
        }
    }
    for b in 0..kb {
        // SAFETY: as above; block b's product was started. Block b + 2's starts before
        // block b's epilogue, so products run two ahead of it.
        unsafe {
            store(b, &mut sums);
            if b + 2 < kb {
                start(a, kb, b + 2, &w[b + 2]);
            }
        }
        if let Some(n) = &mut next {
            lay_out_block(n.g0, n.g1, n.after, b, &mut n.tiles[b]);
        }
        // SAFETY: AVX-512F, DQ, F16C and FMA are enabled for this function.
        unsafe { G::epilogue(&g0[b], &g1[b], a, kb, b, &sums, &mut acc) };
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 16 writable f32; the store is unaligned.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
    }
}
