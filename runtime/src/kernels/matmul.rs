//! `y[T, N] = x[T, K] * W[N, K]^T` with repacked quantized weights.
//!
//! Each activation row is quantized once per call; the output columns are split into chunks
//! across rayon's pool, and inside a chunk tiles of several activation rows against a group
//! of weight rows walk the chunk's weights once per tile, so batched decode and prefill
//! reuse them from cache. Weights are kept in groups of 8 rows (`BlockQ4_1x8`,
//! `BlockQ8_0x8`, `BlockQ4Kx8`, `BlockQ6Kx8`: one SIMD lane per weight row, no horizontal
//! sums); a Q4_1 or Q8_0 matrix whose row count is not a multiple of 8 keeps them row by row,
//! in 4x4 tiles, a K-quant one gets zero rows to fill its last group. The activations are
//! quantized to the blocks the weight format pairs with: Q8_1 (32 values) for Q4_1 and Q8_0,
//! Q8_K (256) for the K-quants.

use rayon::prelude::*;

use super::blocks::{
    BlockQ4_1, BlockQ4_1x8, BlockQ8_0, BlockQ8_0x8, BlockQ8_1, QK, RowGroup, deinterleave8,
    dequantize_q4_1, dequantize_q8_0, group_row, q4_1_from_gguf, q4_1_interleave8, q8_0_from_gguf,
    q8_0_interleave8, quantize_row_q8_0, quantize_row_q8_1,
};
use super::dot;
use super::kdot;
use super::kquants::{
    BlockQ4Kx8, BlockQ6Kx8, BlockQ8K, QK_K, dequantize_q4_k, dequantize_q6_k, q4_k_from_gguf,
    q4_k_interleave8, q6_k_from_gguf, q6_k_interleave8, quantize_row_q8_k,
};

/// Rows and columns of one tile.
const TR: usize = 4;
const TC: usize = 4;

/// A block type with a tile kernel.
trait TileBlock: Copy + Send + Sync {
    fn tile<const R: usize, const C: usize>(
        a: &[&[BlockQ8_1]; R],
        w: &[&[Self]; C],
        out: &mut [[f32; C]; R],
    );
}

impl TileBlock for BlockQ4_1 {
    #[inline(always)]
    fn tile<const R: usize, const C: usize>(
        a: &[&[BlockQ8_1]; R],
        w: &[&[Self]; C],
        out: &mut [[f32; C]; R],
    ) {
        dot::tile_q4_1(a, w, out)
    }
}

impl TileBlock for BlockQ8_0 {
    #[inline(always)]
    fn tile<const R: usize, const C: usize>(
        a: &[&[BlockQ8_1]; R],
        w: &[&[Self]; C],
        out: &mut [[f32; C]; R],
    ) {
        dot::tile_q8_0(a, w, out)
    }
}

/// The AMX kernels where this build has them (`amx_kernels`, from build.rs), else a trait
/// every type has and an `enabled` that says no.
#[cfg(amx_kernels)]
mod amx_path {
    pub use super::super::amx::AmxPair as MaybeAmx;
    pub use super::super::amx::*;
    pub use super::super::amx_k::AmxKPair as MaybeAmxK;
    pub mod k {
        pub use super::super::super::amx_k::*;
    }
}
#[cfg(not(amx_kernels))]
mod amx_path {
    pub trait MaybeAmx {}
    impl<T> MaybeAmx for T {}
    pub trait MaybeAmxK {}
    impl<T> MaybeAmxK for T {}
    pub fn enabled() -> bool {
        false
    }
}

/// Which kernels the quantized matmuls of 16 activation rows or more use on this machine:
/// "AMX" (Intel AMX tiles), "AVX-512", "AVX2" or "scalar", for logs and benchmarks.
pub fn matmul_path() -> &'static str {
    if amx_path::enabled() {
        "AMX"
    } else if cfg!(all(target_arch = "x86_64", target_feature = "avx512vl")) {
        "AVX-512"
    } else if cfg!(all(target_arch = "x86_64", target_feature = "avx2")) {
        "AVX2"
    } else {
        "scalar"
    }
}

/// A block type of 8 weight rows with a tile kernel against activation blocks `Act`.
trait GroupBlock: Copy + Send + Sync {
    type Act: Sync;
    fn tile<const R: usize>(a: &[&[Self::Act]; R], g: &[Self], out: &mut [[f32; 8]; R]);

    /// Runs the leading multiple of 16 of the `t` activation rows on AMX tiles where the
    /// format has them, this CPU has AMX and `amx` allows it; returns how many rows it ran.
    fn matmul_amx(
        _g: &[Self],
        _n: usize,
        _kb: usize,
        _acts: &[Self::Act],
        _t: usize,
        _y: &mut [f32],
        _amx: bool,
    ) -> usize {
        0
    }
}

/// [`GroupBlock::matmul_amx`] for the formats with AMX kernels.
#[allow(unused_variables)]
fn amx_rows<G: GroupBlock<Act = BlockQ8_1> + amx_path::MaybeAmx>(
    g: &[G],
    n: usize,
    kb: usize,
    acts: &[BlockQ8_1],
    t: usize,
    y: &mut [f32],
    amx: bool,
) -> usize {
    #[cfg(amx_kernels)]
    if amx && t >= amx_path::ROWS && n.is_multiple_of(2 * 8) && amx_path::enabled() {
        let done = t / amx_path::ROWS * amx_path::ROWS;
        run_amx(g, n, kb, &acts[..done * kb], done, y);
        return done;
    }
    0
}

impl GroupBlock for BlockQ4_1x8 {
    type Act = BlockQ8_1;
    #[inline(always)]
    fn tile<const R: usize>(a: &[&[BlockQ8_1]; R], g: &[Self], out: &mut [[f32; 8]; R]) {
        dot::tile_q4_1x8(a, g, out)
    }
    fn matmul_amx(
        g: &[Self],
        n: usize,
        kb: usize,
        acts: &[BlockQ8_1],
        t: usize,
        y: &mut [f32],
        amx: bool,
    ) -> usize {
        amx_rows(g, n, kb, acts, t, y, amx)
    }
}

impl GroupBlock for BlockQ8_0x8 {
    type Act = BlockQ8_1;
    #[inline(always)]
    fn tile<const R: usize>(a: &[&[BlockQ8_1]; R], g: &[Self], out: &mut [[f32; 8]; R]) {
        dot::tile_q8_0x8(a, g, out)
    }
    fn matmul_amx(
        g: &[Self],
        n: usize,
        kb: usize,
        acts: &[BlockQ8_1],
        t: usize,
        y: &mut [f32],
        amx: bool,
    ) -> usize {
        amx_rows(g, n, kb, acts, t, y, amx)
    }
}

impl GroupBlock for BlockQ4Kx8 {
    type Act = BlockQ8K;
    #[inline(always)]
    fn tile<const R: usize>(a: &[&[BlockQ8K]; R], g: &[Self], out: &mut [[f32; 8]; R]) {
        kdot::tile_q4_kx8(a, g, out)
    }
    fn matmul_amx(
        g: &[Self],
        n: usize,
        kb: usize,
        acts: &[BlockQ8K],
        t: usize,
        y: &mut [f32],
        amx: bool,
    ) -> usize {
        amx_k_rows(g, n, kb, acts, t, y, amx)
    }
}

impl GroupBlock for BlockQ6Kx8 {
    type Act = BlockQ8K;
    #[inline(always)]
    fn tile<const R: usize>(a: &[&[BlockQ8K]; R], g: &[Self], out: &mut [[f32; 8]; R]) {
        kdot::tile_q6_kx8(a, g, out)
    }
    fn matmul_amx(
        g: &[Self],
        n: usize,
        kb: usize,
        acts: &[BlockQ8K],
        t: usize,
        y: &mut [f32],
        amx: bool,
    ) -> usize {
        amx_k_rows(g, n, kb, acts, t, y, amx)
    }
}

/// [`GroupBlock::matmul_amx`] for the K-quant formats.
#[allow(unused_variables)]
fn amx_k_rows<G: GroupBlock<Act = BlockQ8K> + amx_path::MaybeAmxK>(
    g: &[G],
    n: usize,
    kb: usize,
    acts: &[BlockQ8K],
    t: usize,
    y: &mut [f32],
    amx: bool,
) -> usize {
    #[cfg(amx_kernels)]
    if amx && t >= amx_path::ROWS && n.is_multiple_of(2 * 8) && amx_path::enabled() {
        let done = t / amx_path::ROWS * amx_path::ROWS;
        run_amx_k(g, n, kb, &acts[..done * kb], done, y);
        return done;
    }
    0
}

/// The blocks of a matrix: in groups of 8 rows, one lane per row (see `BlockQ4_1x8`), or
/// row by row when a Q4_1 or Q8_0 matrix's row count is not a multiple of 8; or, for
/// matrices of different formats stacked row-wise (`QWeight::concat`), the parts.
#[derive(Debug, Clone, PartialEq)]
enum Blocks {
    Q4_1(Vec<BlockQ4_1>),
    Q4_1x8(Vec<BlockQ4_1x8>),
    Q8_0(Vec<BlockQ8_0>),
    Q8_0x8(Vec<BlockQ8_0x8>),
    /// `ceil(n / 8)` groups per block column, the last one padded with zero rows.
    Q4Kx8(Vec<BlockQ4Kx8>),
    Q6Kx8(Vec<BlockQ6Kx8>),
    Stack(Vec<QWeight>),
}

/// A weight matrix `[n, k]` (k a multiple of the format's block size), row-major blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct QWeight {
    n: usize,
    k: usize,
    blocks: Blocks,
}

/// Which quantized format a [`QWeight`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QFormat {
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
    /// Parts of different formats, stacked.
    Mixed,
}

impl QWeight {
    fn check(n: usize, k: usize, blocks: usize) {
        Self::check_blocks(n, k, blocks, QK)
    }

    fn check_blocks(n: usize, k: usize, blocks: usize, size: usize) {
        assert!(
            k.is_multiple_of(size),
            "k = {k} is not a multiple of {size}"
        );
        assert_eq!(
            blocks,
            n * k / size,
            "{blocks} blocks for a [{n}, {k}] matrix"
        );
    }

    /// From GGUF Q4_K bytes of an `[n, k]` tensor (k a multiple of 256), kept as stored.
    pub fn from_gguf_q4_k(bytes: &[u8], n: usize, k: usize) -> Self {
        let rows = q4_k_from_gguf(bytes);
        Self::check_blocks(n, k, rows.len(), QK_K);
        let blocks = Blocks::Q4Kx8(q4_k_interleave8(&rows, k / QK_K));
        QWeight { n, k, blocks }
    }

    /// From GGUF Q6_K bytes of an `[n, k]` tensor (k a multiple of 256), kept as stored.
    pub fn from_gguf_q6_k(bytes: &[u8], n: usize, k: usize) -> Self {
        let rows = q6_k_from_gguf(bytes);
        Self::check_blocks(n, k, rows.len(), QK_K);
        let blocks = Blocks::Q6Kx8(q6_k_interleave8(&rows, k / QK_K));
        QWeight { n, k, blocks }
    }

    /// Values per block of this matrix's format.
    fn block_size(&self) -> usize {
        match &self.blocks {
            Blocks::Q4Kx8(_) | Blocks::Q6Kx8(_) => QK_K,
            _ => QK,
        }
    }

    /// From GGUF Q4_1 bytes of an `[n, k]` tensor.
    pub fn from_gguf_q4_1(bytes: &[u8], n: usize, k: usize) -> Self {
        let b = q4_1_from_gguf(bytes);
        Self::check(n, k, b.len());
        Self::q4_1_rows(b, n, k)
    }

    fn q4_1_rows(rows: Vec<BlockQ4_1>, n: usize, k: usize) -> Self {
        let blocks = if n.is_multiple_of(8) {
            Blocks::Q4_1x8(q4_1_interleave8(&rows, k / QK))
        } else {
            Blocks::Q4_1(rows)
        };
        QWeight { n, k, blocks }
    }

    fn q8_0_rows(rows: Vec<BlockQ8_0>, n: usize, k: usize) -> Self {
        let blocks = if n.is_multiple_of(8) {
            Blocks::Q8_0x8(q8_0_interleave8(&rows, k / QK))
        } else {
            Blocks::Q8_0(rows)
        };
        QWeight { n, k, blocks }
    }

    /// Q4_1 blocks row by row, whatever the layout.
    fn q4_1_row_blocks(&self) -> Option<Vec<BlockQ4_1>> {
        match &self.blocks {
            Blocks::Q4_1(b) => Some(b.clone()),
            Blocks::Q4_1x8(g) => Some(deinterleave8(g, self.k / QK)),
            _ => None,
        }
    }

    /// Q8_0 blocks row by row, whatever the layout.
    fn q8_0_row_blocks(&self) -> Option<Vec<BlockQ8_0>> {
        match &self.blocks {
            Blocks::Q8_0(b) => Some(b.clone()),
            Blocks::Q8_0x8(g) => Some(deinterleave8(g, self.k / QK)),
            _ => None,
        }
    }

    /// K-quant groups, rows in order, without the padding of a last group.
    fn k_row_blocks<G: RowGroup + Clone>(g: &[G], n: usize, kb: usize) -> Vec<G::Row> {
        let mut rows = deinterleave8(g, kb);
        rows.truncate(n * kb);
        rows
    }

    /// From GGUF Q8_0 bytes of an `[n, k]` tensor.
    pub fn from_gguf_q8_0(bytes: &[u8], n: usize, k: usize) -> Self {
        let b = q8_0_from_gguf(bytes);
        Self::check(n, k, b.len());
        Self::q8_0_rows(b, n, k)
    }

    /// Quantize f32 weights `[n, k]` to Q8_0.
    pub fn quantize_q8_0(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k);
        let mut b = Vec::with_capacity(n * k / QK);
        quantize_row_q8_0(w, &mut b);
        Self::check(n, k, b.len());
        Self::q8_0_rows(b, n, k)
    }

    /// Stack matrices of the same `k` row-wise (e.g. Q, K and V projections), so one call
    /// computes all of them: one matrix where they share a format, the parts side by side
    /// where they do not (a K-quant mix often gives V another format than Q and K).
    pub fn concat(parts: Vec<QWeight>) -> Self {
        let k = parts[0].k;
        let n = parts.iter().map(|p| p.n).sum();
        assert!(parts.iter().all(|p| p.k == k), "concat needs one k");
        let format = parts[0].format();
        if parts.iter().any(|p| p.format() != format) || format == QFormat::Mixed {
            let parts = parts
                .into_iter()
                .flat_map(|p| match p.blocks {
                    Blocks::Stack(inner) => inner,
                    _ => vec![p],
                })
                .collect();
            return QWeight {
                n,
                k,
                blocks: Blocks::Stack(parts),
            };
        }
        match format {
            QFormat::Q4_1 => {
                let rows = parts
                    .iter()
                    .flat_map(|p| p.q4_1_row_blocks().expect("concat needs one format"))
                    .collect();
                Self::q4_1_rows(rows, n, k)
            }
            QFormat::Q8_0 => {
                let rows = parts
                    .iter()
                    .flat_map(|p| p.q8_0_row_blocks().expect("concat needs one format"))
                    .collect();
                Self::q8_0_rows(rows, n, k)
            }
            QFormat::Q4K => {
                let mut rows = Vec::with_capacity(n * k / QK_K);
                for p in &parts {
                    let Blocks::Q4Kx8(g) = &p.blocks else {
                        unreachable!("the format says Q4_K")
                    };
                    rows.extend(Self::k_row_blocks(g, p.n, k / QK_K));
                }
                let blocks = Blocks::Q4Kx8(q4_k_interleave8(&rows, k / QK_K));
                QWeight { n, k, blocks }
            }
            QFormat::Q6K => {
                let mut rows = Vec::with_capacity(n * k / QK_K);
                for p in &parts {
                    let Blocks::Q6Kx8(g) = &p.blocks else {
                        unreachable!("the format says Q6_K")
                    };
                    rows.extend(Self::k_row_blocks(g, p.n, k / QK_K));
                }
                let blocks = Blocks::Q6Kx8(q6_k_interleave8(&rows, k / QK_K));
                QWeight { n, k, blocks }
            }
            QFormat::Mixed => unreachable!("stacked above"),
        }
    }

    pub fn rows(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.k
    }
    pub fn format(&self) -> QFormat {
        match self.blocks {
            Blocks::Q4_1(_) | Blocks::Q4_1x8(_) => QFormat::Q4_1,
            Blocks::Q8_0(_) | Blocks::Q8_0x8(_) => QFormat::Q8_0,
            Blocks::Q4Kx8(_) => QFormat::Q4K,
            Blocks::Q6Kx8(_) => QFormat::Q6K,
            Blocks::Stack(_) => QFormat::Mixed,
        }
    }

    /// Row `r` as f32 (an embedding lookup on a tied embedding/output matrix).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let kb = self.k / self.block_size();
        match &self.blocks {
            Blocks::Q4_1(b) => dequantize_q4_1(&b[r * kb..(r + 1) * kb], out),
            Blocks::Q4_1x8(g) => {
                for (x, o) in group_row(g, kb, r).zip(out.chunks_exact_mut(QK)) {
                    dequantize_q4_1(&[x], o);
                }
            }
            Blocks::Q8_0(b) => dequantize_q8_0(&b[r * kb..(r + 1) * kb], out),
            Blocks::Q8_0x8(g) => {
                for (x, o) in group_row(g, kb, r).zip(out.chunks_exact_mut(QK)) {
                    dequantize_q8_0(&[x], o);
                }
            }
            Blocks::Q4Kx8(g) => {
                for (x, o) in group_row(g, kb, r).zip(out.chunks_exact_mut(QK_K)) {
                    dequantize_q4_k(&[x], o);
                }
            }
            Blocks::Q6Kx8(g) => {
                for (x, o) in group_row(g, kb, r).zip(out.chunks_exact_mut(QK_K)) {
                    dequantize_q6_k(&[x], o);
                }
            }
            Blocks::Stack(parts) => {
                let mut r = r;
                for p in parts {
                    if r < p.n {
                        return p.dequantize_row(r, out);
                    }
                    r -= p.n;
                }
                panic!("row out of range");
            }
        }
    }

    /// The whole matrix as f32 `[n, k]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        for (r, row) in out.chunks_exact_mut(self.k).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }

    /// `y[t, n] = x[t, k] * W^T`. `y` is overwritten.
    pub fn matmul(&self, x: &[f32], t: usize, y: &mut [f32]) {
        self.matmul_into(x, t, y, &mut Vec::new())
    }

    /// [`Self::matmul`] with the quantized activations in `acts`, a buffer the caller keeps
    /// from call to call (so the call allocates nothing once it is large enough).
    pub fn matmul_into(&self, x: &[f32], t: usize, y: &mut [f32], acts: &mut Vec<BlockQ8_1>) {
        self.matmul_on(x, t, y, amx_path::enabled(), acts)
    }

    /// [`Self::matmul_into`], with the AMX tiles allowed or not (they are used only where the
    /// CPU has them, for 16 activation rows or more).
    fn matmul_on(&self, x: &[f32], t: usize, y: &mut [f32], amx: bool, acts: &mut Vec<BlockQ8_1>) {
        assert_eq!(x.len(), t * self.k, "x is not [{t}, {}]", self.k);
        assert_eq!(y.len(), t * self.n, "y is not [{t}, {}]", self.n);
        if t == 0 {
            return;
        }
        match &self.blocks {
            Blocks::Q4Kx8(g) => return run_k(g, self.n, self.k, x, t, y, amx),
            Blocks::Q6Kx8(g) => return run_k(g, self.n, self.k, x, t, y, amx),
            Blocks::Stack(parts) => return self.matmul_stack(parts, x, t, y, amx, acts),
            _ => {}
        }
        let kb = self.k / QK;
        // Every block is written below before it is read.
        acts.resize(t * kb, BlockQ8_1::ZERO);
        let acts = &mut acts[..t * kb];
        if t >= 8 {
            acts.par_chunks_mut(kb)
                .zip(x.par_chunks(self.k))
                .for_each(|(a, x)| quantize_row_q8_1(x, a));
        } else {
            for (a, x) in acts.chunks_mut(kb).zip(x.chunks(self.k)) {
                quantize_row_q8_1(x, a);
            }
        }
        match &self.blocks {
            Blocks::Q4_1(b) => run(b, self.n, kb, acts, t, y),
            Blocks::Q4_1x8(g) => run_x8(g, self.n, kb, acts, t, y, amx),
            Blocks::Q8_0(b) => run(b, self.n, kb, acts, t, y),
            Blocks::Q8_0x8(g) => run_x8(g, self.n, kb, acts, t, y, amx),
            Blocks::Q4Kx8(_) | Blocks::Q6Kx8(_) | Blocks::Stack(_) => unreachable!("run above"),
        }
    }

    /// Each part's matmul into its own buffer, its columns copied into `y`.
    fn matmul_stack(
        &self,
        parts: &[QWeight],
        x: &[f32],
        t: usize,
        y: &mut [f32],
        amx: bool,
        acts: &mut Vec<BlockQ8_1>,
    ) {
        let mut col = 0;
        let mut part_y = Vec::new();
        for p in parts {
            part_y.resize(t * p.n, 0.0);
            p.matmul_on(x, t, &mut part_y, amx, acts);
            for (row, src) in y.chunks_exact_mut(self.n).zip(part_y.chunks_exact(p.n)) {
                row[col..col + p.n].copy_from_slice(src);
            }
            col += p.n;
        }
    }
}

/// A K-quant matmul: the activations quantized to Q8_K blocks, then the 8-row group tiles.
fn run_k<G: GroupBlock<Act = BlockQ8K>>(
    g: &[G],
    n: usize,
    k: usize,
    x: &[f32],
    t: usize,
    y: &mut [f32],
    amx: bool,
) {
    let kb = k / QK_K;
    let mut acts = vec![BlockQ8K::ZERO; t * kb];
    if t >= 8 {
        acts.par_chunks_mut(kb)
            .zip(x.par_chunks(k))
            .for_each(|(a, x)| quantize_row_q8_k(x, a));
    } else {
        for (a, x) in acts.chunks_mut(kb).zip(x.chunks(k)) {
            quantize_row_q8_k(x, a);
        }
    }
    run_x8(g, n, kb, &acts, t, y, amx);
}

/// An output buffer written by parallel tasks that own disjoint parts of it (here column
/// ranges; in `encoder::attend_packed`, (sequence, head) blocks).
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: every user writes through it only at elements of its task's own part, and the
// buffer outlives the parallel section (the caller borrows it mutably for the whole call).
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two tasks touch the same element, and nobody reads during the call.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` is within the buffer and no other task writes element `i` concurrently.
    #[inline(always)]
    pub(super) unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *self.0.add(i) = v }
    }

    /// Writes an `R x C` tile at row `r`, column `c` of the `n`-column output.
    ///
    /// # Safety
    /// Rows `r..r + R` and columns `c..c + C` are within the output and written by no
    /// other task concurrently.
    #[inline(always)]
    unsafe fn write_tile<const R: usize, const C: usize>(
        self,
        n: usize,
        r: usize,
        c: usize,
        tile: &[[f32; C]; R],
    ) {
        for (i, row) in tile.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                // SAFETY: guaranteed by the caller.
                unsafe { self.write((r + i) * n + c + j, v) };
            }
        }
    }

    /// [`Self::write_tile`] of the tile's first `cols` columns only (a group padded with zero
    /// rows past the matrix's last).
    ///
    /// # Safety
    /// As for [`Self::write_tile`], for columns `c..c + cols`.
    #[inline(always)]
    unsafe fn write_tile_cols<const R: usize, const C: usize>(
        self,
        n: usize,
        r: usize,
        c: usize,
        tile: &[[f32; C]; R],
        cols: usize,
    ) {
        for (i, row) in tile.iter().enumerate() {
            for (j, &v) in row.iter().enumerate().take(cols) {
                // SAFETY: guaranteed by the caller.
                unsafe { self.write((r + i) * n + c + j, v) };
            }
        }
    }
}

fn run<B: TileBlock>(w: &[B], n: usize, kb: usize, acts: &[BlockQ8_1], t: usize, y: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    // Enough chunks to balance the threads, each a multiple of the tile width.
    let tasks = (threads * 8).min(n.div_ceil(4 * TC)).max(1);
    let chunk = n.div_ceil(tasks).div_ceil(TC) * TC;
    let tasks = n.div_ceil(chunk);
    let out = OutPtr(y.as_mut_ptr());
    debug_assert_eq!(y.len(), t * n);
    let body = |task: usize| {
        let c_begin = task * chunk;
        let c_end = (c_begin + chunk).min(n);
        let wrow = |c: usize| &w[c * kb..(c + 1) * kb];
        let arow = |r: usize| &acts[r * kb..(r + 1) * kb];
        let mut r = 0;
        while r < t {
            let rows = (t - r).min(TR);
            let mut c = c_begin;
            while c < c_end {
                let cols = (c_end - c).min(TC);
                if rows == TR && cols == TC {
                    let mut o = [[0f32; TC]; TR];
                    let a: [&[BlockQ8_1]; TR] = std::array::from_fn(|i| arow(r + i));
                    let ws: [&[B]; TC] = std::array::from_fn(|j| wrow(c + j));
                    B::tile(&a, &ws, &mut o);
                    // SAFETY: rows r.. < t and columns c.. in this task's own range.
                    unsafe { out.write_tile(n, r, c, &o) };
                } else if cols == TC {
                    // Leftover rows: one row against 4 columns.
                    for i in 0..rows {
                        let mut o = [[0f32; TC]; 1];
                        let ws: [&[B]; TC] = std::array::from_fn(|j| wrow(c + j));
                        B::tile(&[arow(r + i)], &ws, &mut o);
                        // SAFETY: row r+i < t and columns c.. in this task's own range.
                        unsafe { out.write_tile(n, r + i, c, &o) };
                    }
                } else {
                    // Leftover columns (n not a multiple of 4): one at a time.
                    for i in 0..rows {
                        for j in 0..cols {
                            let mut o = [[0f32; 1]; 1];
                            B::tile(&[arow(r + i)], &[wrow(c + j)], &mut o);
                            // SAFETY: row r+i < t and column c+j in this task's own range.
                            unsafe { out.write((r + i) * n + c + j, o[0][0]) };
                        }
                    }
                }
                c += cols;
            }
            r += rows;
        }
    };
    if tasks == 1 {
        body(0);
    } else {
        (0..tasks).into_par_iter().for_each(body);
    }
}

/// Whether [`run_x8`] uses tiles of 8 activation rows: only with AVX-512's 32 vector
/// registers, where their 8 integer and 8 float accumulators fit beside the unpacked weight
/// values; with AVX2's 16 they would spill, so tiles stop at 4 rows.
const WIDE_ROW_TILES: bool = cfg!(all(target_arch = "x86_64", target_feature = "avx512vl"));

/// [`run`] for 8-row groups (`ceil(n / 8)` of them, the last one's padding rows not written):
/// chunks of whole groups, tiles of 8, 4 or 1 activation rows against one group (each weight
/// block loaded once per tile). With `amx` (and a format and CPU that have it), whole slabs of
/// 16 activation rows go to the AMX tiles first.
fn run_x8<G: GroupBlock>(
    g: &[G],
    n: usize,
    kb: usize,
    acts: &[G::Act],
    t: usize,
    y: &mut [f32],
    amx: bool,
) {
    let done = G::matmul_amx(g, n, kb, acts, t, y, amx);
    if done == t {
        return;
    }
    let groups = n.div_ceil(8);
    let threads = rayon::current_num_threads().max(1);
    let tasks = (threads * 8).min(groups.div_ceil(2)).max(1);
    let chunk = groups.div_ceil(tasks);
    let tasks = groups.div_ceil(chunk);
    let out = OutPtr(y.as_mut_ptr());
    fn tiles<G: GroupBlock, const R: usize>(
        g: &[G],
        kb: usize,
        groups: std::ops::Range<usize>,
        a: [&[G::Act]; R],
        n: usize,
        r: usize,
        out: OutPtr,
    ) {
        for grp in groups {
            let mut o = [[0f32; 8]; R];
            G::tile(&a, &g[grp * kb..(grp + 1) * kb], &mut o);
            // SAFETY: rows r..r+R < t, columns of group grp below n, one of this task's.
            unsafe { out.write_tile_cols(n, r, grp * 8, &o, (n - grp * 8).min(8)) };
        }
    }
    let body = |task: usize| {
        let range = task * chunk..((task + 1) * chunk).min(groups);
        let arow = |r: usize| &acts[r * kb..(r + 1) * kb];
        let mut r = done;
        while r < t {
            let rows = match t - r {
                8.. if WIDE_ROW_TILES => 8,
                4.. => 4,
                _ => 1,
            };
            match rows {
                8 => tiles::<G, 8>(
                    g,
                    kb,
                    range.clone(),
                    std::array::from_fn(|i| arow(r + i)),
                    n,
                    r,
                    out,
                ),
                4 => tiles::<G, 4>(
                    g,
                    kb,
                    range.clone(),
                    std::array::from_fn(|i| arow(r + i)),
                    n,
                    r,
                    out,
                ),
                _ => tiles::<G, 1>(g, kb, range.clone(), [arow(r)], n, r, out),
            }
            r += rows;
        }
    };
    if tasks == 1 {
        body(0);
    } else {
        (0..tasks).into_par_iter().for_each(body);
    }
}

/// [`run_amx`] for the K-quant formats: each task lays out a pair's weight tiles once, then
/// runs every slab of 16 activation rows against them.
#[cfg(amx_kernels)]
fn run_amx_k<G: GroupBlock<Act = BlockQ8K> + amx_path::MaybeAmxK>(
    g: &[G],
    n: usize,
    kb: usize,
    acts: &[BlockQ8K],
    t: usize,
    y: &mut [f32],
) {
    use amx_path::ROWS;
    let pairs = n / (2 * 8);
    let threads = rayon::current_num_threads().max(1);
    let tasks = (threads * 4).min(pairs).max(1);
    let chunk = pairs.div_ceil(tasks);
    let tasks = pairs.div_ceil(chunk);
    let out = OutPtr(y.as_mut_ptr());
    let body = |task: usize| {
        let tiles = amx_path::k::tiles::<G>().expect("the caller checked that AMX is enabled");
        let mut w = Vec::new();
        for p in task * chunk..((task + 1) * chunk).min(pairs) {
            let g0 = &g[2 * p * kb..(2 * p + 1) * kb];
            let g1 = &g[(2 * p + 1) * kb..(2 * p + 2) * kb];
            amx_path::k::weight_tiles(g0, g1, kb, &mut w);
            for (s, a) in acts.chunks_exact(ROWS * kb).take(t / ROWS).enumerate() {
                let mut o = [[0f32; ROWS]; ROWS];
                amx_path::k::slab(&tiles, a, kb, (g0, g1, &w), &mut o);
                // SAFETY: rows of slab s (< t) and pair p's 16 columns, this task's own.
                unsafe { out.write_tile(n, s * ROWS, p * ROWS, &o) };
            }
        }
    };
    if tasks == 1 {
        body(0);
    } else {
        (0..tasks).into_par_iter().for_each(body);
    }
}

/// Slabs of 16 activation rows (`t % 16 == 0`) against pairs of 8-row groups
/// (`n % 16 == 0`) on AMX tiles: chunks of whole pairs across the pool, each task with its
/// own tile configuration; a pair's weights are walked once per slab, from cache after the
/// first.
#[cfg(amx_kernels)]
fn run_amx<G: GroupBlock<Act = BlockQ8_1> + amx_path::MaybeAmx>(
    g: &[G],
    n: usize,
    kb: usize,
    acts: &[BlockQ8_1],
    t: usize,
    y: &mut [f32],
) {
    use amx_path::ROWS;
    let pairs = n / (2 * 8);
    let threads = rayon::current_num_threads().max(1);
    let tasks = (threads * 4).min(pairs).max(1);
    let chunk = pairs.div_ceil(tasks);
    let tasks = pairs.div_ceil(chunk);
    let out = OutPtr(y.as_mut_ptr());
    let body = |task: usize| {
        let tiles = amx_path::Tiles::new().expect("the caller checked that AMX is enabled");
        let pair = |p: usize| {
            (
                &g[2 * p * kb..(2 * p + 1) * kb],
                &g[(2 * p + 1) * kb..(2 * p + 2) * kb],
            )
        };
        let range = task * chunk..((task + 1) * chunk).min(pairs);
        let slabs = t / ROWS;
        // The first pair's weight tiles up front; each next pair's during the last slab of
        // the one before (`amx::NextPair`).
        let (mut cur, mut next) = (Vec::with_capacity(kb), vec![amx_path::WeightTile::ZERO; kb]);
        if !range.is_empty() {
            let (g0, g1) = pair(range.start);
            let after = (range.start + 1 < pairs).then(|| pair(range.start + 1));
            amx_path::weight_tiles(g0, g1, after, kb, &mut cur);
        }
        for p in range.clone() {
            let (g0, g1) = pair(p);
            for (s, a) in acts.chunks_exact(ROWS * kb).take(slabs).enumerate() {
                let prep = (s + 1 == slabs && p + 1 < range.end).then(|| {
                    let (n0, n1) = pair(p + 1);
                    amx_path::NextPair {
                        g0: n0,
                        g1: n1,
                        after: (p + 2 < pairs).then(|| pair(p + 2)),
                        tiles: &mut next,
                    }
                });
                let mut o = [[0f32; ROWS]; ROWS];
                let this = amx_path::Pair {
                    g0,
                    g1,
                    tiles: &cur,
                };
                amx_path::slab(&tiles, a, kb, this, prep, &mut o);
                // SAFETY: rows of slab s (< t) and pair p's 16 columns, this task's own.
                unsafe { out.write_tile(n, s * ROWS, p * ROWS, &o) };
            }
            std::mem::swap(&mut cur, &mut next);
        }
    };
    if tasks == 1 {
        body(0);
    } else {
        (0..tasks).into_par_iter().for_each(body);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::kernels::dot::{tile_q4_1_scalar, tile_q8_0_scalar};

    /// Straightforward f32 matmul of x against the dequantized weights.
    fn reference(w: &QWeight, x: &[f32], t: usize) -> Vec<f32> {
        let wf = w.dequantize();
        let mut y = vec![0f32; t * w.rows()];
        for r in 0..t {
            for c in 0..w.rows() {
                y[r * w.rows() + c] = (0..w.cols())
                    .map(|i| x[r * w.cols() + i] as f64 * wf[c * w.cols() + i] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    /// GGUF Q4_1 bytes for random values, as a model file would hold them.
    fn q4_1_bytes(vals: &[u8], scales: &[(f32, f32)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, (d, m)) in scales.iter().enumerate() {
            out.extend_from_slice(&half::f16::from_f32(*d).to_le_bytes());
            out.extend_from_slice(&half::f16::from_f32(*m).to_le_bytes());
            out.extend_from_slice(&vals[i * 16..(i + 1) * 16]);
        }
        out
    }

    /// The error bound of quantizing the activations: each value is off by at most half a
    /// step plus the f16 rounding of the scale (< 0.6 d), times the weight's magnitude, summed
    /// over k; plus the f16 rounding (2^-10 relative) of the Q4_1 offset term `m * s`, with
    /// |m| at most 0.25 in these tests.
    fn bound(w: &QWeight, x: &[f32], t: usize) -> Vec<f32> {
        let wf = w.dequantize();
        let k = w.cols();
        let mut b = vec![0f32; t * w.rows()];
        for r in 0..t {
            for blk in 0..k / QK {
                let xs = &x[r * k + blk * QK..r * k + (blk + 1) * QK];
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                let half_step = amax / 127.0 * 0.6;
                let offset_term: f32 = 0.25 * 2e-3 * xs.iter().map(|v| v.abs()).sum::<f32>();
                for c in 0..w.rows() {
                    let ws: f32 = wf[c * k + blk * QK..c * k + (blk + 1) * QK]
                        .iter()
                        .map(|v| v.abs())
                        .sum();
                    b[r * w.rows() + c] += half_step * ws + offset_term;
                }
            }
        }
        // Plus float rounding: f16 scale of the sum term and summation order.
        b.iter().map(|v| v * 1.01 + 1e-3).collect()
    }

    fn check(w: &QWeight, x: &[f32], t: usize) {
        let mut y = vec![f32::NAN; t * w.rows()];
        w.matmul(x, t, &mut y);
        let want = reference(w, x, t);
        let tol = bound(w, x, t);
        for i in 0..y.len() {
            assert!(
                (y[i] - want[i]).abs() <= tol[i],
                "element {i}: {} vs {} (bound {})",
                y[i],
                want[i],
                tol[i]
            );
        }
    }

    fn shapes() -> impl Strategy<Value = (usize, usize, usize)> {
        (1usize..11, 1usize..23, 1usize..5).prop_map(|(t, n, kb)| (t, n, kb * QK))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn q4_1_matmul_matches_f32_reference((t, n, k) in shapes(), seed in any::<u64>()) {
            let mut rng = Lcg(seed);
            let nb = n * k / QK;
            let vals: Vec<u8> = (0..nb * 16).map(|_| rng.next() as u8).collect();
            let scales: Vec<(f32, f32)> =
                (0..nb).map(|_| (rng.f32() * 0.1, rng.f32() * 0.5 - 0.25)).collect();
            let w = QWeight::from_gguf_q4_1(&q4_1_bytes(&vals, &scales), n, k);
            let x: Vec<f32> = (0..t * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            check(&w, &x, t);
        }

        #[test]
        fn q8_0_matmul_matches_f32_reference((t, n, k) in shapes(), seed in any::<u64>()) {
            let mut rng = Lcg(seed);
            let wf: Vec<f32> = (0..n * k).map(|_| rng.f32() - 0.5).collect();
            let w = QWeight::quantize_q8_0(&wf, n, k);
            let x: Vec<f32> = (0..t * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            check(&w, &x, t);
        }
    }

    /// The SIMD tiles and the scalar tiles agree (Q8_0: same per-block terms, other add order).
    #[test]
    fn simd_and_scalar_tiles_agree() {
        let mut rng = Lcg(7);
        let kb = 18;
        let acts: Vec<Vec<BlockQ8_1>> = (0..4)
            .map(|_| {
                let x: Vec<f32> = (0..kb * QK).map(|_| rng.f32() * 2.0 - 1.0).collect();
                let mut a = vec![BlockQ8_1::ZERO; kb];
                quantize_row_q8_1(&x, &mut a);
                a
            })
            .collect();
        let w4: Vec<Vec<BlockQ4_1>> = (0..4)
            .map(|_| {
                let vals: Vec<u8> = (0..kb * 16).map(|_| rng.next() as u8).collect();
                let sc: Vec<(f32, f32)> = (0..kb).map(|_| (rng.f32() * 0.1, -0.3)).collect();
                q4_1_from_gguf(&q4_1_bytes(&vals, &sc))
            })
            .collect();
        let w8: Vec<Vec<BlockQ8_0>> = (0..4)
            .map(|_| {
                let wf: Vec<f32> = (0..kb * QK).map(|_| rng.f32() - 0.5).collect();
                let mut b = Vec::new();
                quantize_row_q8_0(&wf, &mut b);
                b
            })
            .collect();
        let a: [&[BlockQ8_1]; 4] = std::array::from_fn(|i| acts[i].as_slice());
        let (mut fast, mut slow) = ([[0f32; 4]; 4], [[0f32; 4]; 4]);
        let w: [&[BlockQ4_1]; 4] = std::array::from_fn(|i| w4[i].as_slice());
        dot::tile_q4_1(&a, &w, &mut fast);
        tile_q4_1_scalar(&a, &w, &mut slow);
        // Q4_1: the same float operations in the same order on every path.
        assert_eq!(fast, slow);
        let w: [&[BlockQ8_0]; 4] = std::array::from_fn(|i| w8[i].as_slice());
        dot::tile_q8_0(&a, &w, &mut fast);
        tile_q8_0_scalar(&a, &w, &mut slow);
        for (f, s) in fast.iter().flatten().zip(slow.iter().flatten()) {
            assert!((f - s).abs() <= 1e-4 * s.abs().max(1.0), "{f} vs {s}");
        }
    }

    /// 8-row groups give bit-identical results to row-by-row blocks, for tiles of 1, 4 and 8
    /// activation rows, on this build's path and the scalar one; the layout round-trips.
    #[test]
    fn eight_row_groups_are_bit_identical_to_rows() {
        let mut rng = Lcg(13);
        let kb = 7;
        let vals: Vec<u8> = (0..16 * kb * 16).map(|_| rng.next() as u8).collect();
        let sc: Vec<(f32, f32)> = (0..16 * kb)
            .map(|_| (rng.f32() * 0.1, rng.f32() - 0.5))
            .collect();
        let rows = q4_1_from_gguf(&q4_1_bytes(&vals, &sc));
        let groups = q4_1_interleave8(&rows, kb);
        assert_eq!(deinterleave8(&groups, kb), rows);
        let x: Vec<f32> = (0..8 * kb * QK).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let mut acts = vec![BlockQ8_1::ZERO; 8 * kb];
        for (a, x) in acts.chunks_mut(kb).zip(x.chunks(kb * QK)) {
            quantize_row_q8_1(x, a);
        }
        fn check<const R: usize>(
            acts: &[BlockQ8_1],
            rows: &[BlockQ4_1],
            g: &[BlockQ4_1x8],
            kb: usize,
        ) {
            let a: [&[BlockQ8_1]; R] = std::array::from_fn(|i| &acts[i * kb..(i + 1) * kb]);
            for grp in 0..2 {
                let gw = &g[grp * kb..(grp + 1) * kb];
                let w: [&[BlockQ4_1]; 8] =
                    std::array::from_fn(|c| &rows[(grp * 8 + c) * kb..(grp * 8 + c + 1) * kb]);
                let (mut plain, mut fast, mut slow) =
                    ([[0f32; 8]; R], [[0f32; 8]; R], [[0f32; 8]; R]);
                tile_q4_1_scalar(&a, &w, &mut plain);
                dot::tile_q4_1x8(&a, gw, &mut fast);
                dot::tile_q4_1x8_scalar(&a, gw, &mut slow);
                assert_eq!(fast, plain, "{R} rows, group {grp}");
                assert_eq!(slow, plain, "{R} rows, group {grp}");
            }
        }
        check::<1>(&acts, &rows, &groups, kb);
        check::<4>(&acts, &rows, &groups, kb);
        check::<8>(&acts, &rows, &groups, kb);
        // And through a whole matmul, whichever layout this build picks.
        let w = QWeight::q4_1_rows(rows.clone(), 16, kb * QK);
        let mut y = vec![0f32; 8 * 16];
        w.matmul(&x, 8, &mut y);
        let a: [&[BlockQ8_1]; 8] = std::array::from_fn(|i| &acts[i * kb..(i + 1) * kb]);
        for c in 0..16 {
            let mut o = [[0f32; 1]; 8];
            tile_q4_1_scalar(&a, &[&rows[c * kb..(c + 1) * kb]], &mut o);
            for r in 0..8 {
                assert_eq!(y[r * 16 + c], o[r][0], "row {r}, column {c}");
            }
        }
    }

    /// 8-row Q8_0 groups: this build's path and the scalar one are bit-identical, within
    /// float rounding of the row-by-row tiles (another add order), for tiles of 1, 4 and 8
    /// activation rows and every int8 weight value (-128 included: the VNNI path shifts
    /// weights by 128, the AVX2 one takes their magnitude); the layout round-trips.
    #[test]
    fn eight_row_q8_0_groups_match_rows() {
        let mut rng = Lcg(29);
        let kb = 9;
        let mut bytes = Vec::new();
        for i in 0..16 * kb {
            bytes.extend_from_slice(&half::f16::from_f32(rng.f32() * 0.02 + 1e-3).to_le_bytes());
            bytes.extend((0..QK).map(|j| {
                if (i + j) % 11 == 0 {
                    0x80
                } else {
                    rng.next() as u8
                }
            }));
        }
        let rows = q8_0_from_gguf(&bytes);
        assert!(rows.iter().any(|b| b.qs.contains(&-128)));
        let groups = q8_0_interleave8(&rows, kb);
        assert_eq!(deinterleave8(&groups, kb), rows);
        let x: Vec<f32> = (0..8 * kb * QK).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let mut acts = vec![BlockQ8_1::ZERO; 8 * kb];
        for (a, x) in acts.chunks_mut(kb).zip(x.chunks(kb * QK)) {
            quantize_row_q8_1(x, a);
        }
        fn check<const R: usize>(
            acts: &[BlockQ8_1],
            rows: &[BlockQ8_0],
            g: &[BlockQ8_0x8],
            kb: usize,
        ) {
            let a: [&[BlockQ8_1]; R] = std::array::from_fn(|i| &acts[i * kb..(i + 1) * kb]);
            for grp in 0..2 {
                let gw = &g[grp * kb..(grp + 1) * kb];
                let w: [&[BlockQ8_0]; 8] =
                    std::array::from_fn(|c| &rows[(grp * 8 + c) * kb..(grp * 8 + c + 1) * kb]);
                let (mut plain, mut fast, mut slow) =
                    ([[0f32; 8]; R], [[0f32; 8]; R], [[0f32; 8]; R]);
                tile_q8_0_scalar(&a, &w, &mut plain);
                dot::tile_q8_0x8(&a, gw, &mut fast);
                dot::tile_q8_0x8_scalar(&a, gw, &mut slow);
                assert_eq!(fast, slow, "{R} rows, group {grp}");
                for (f, p) in fast.iter().flatten().zip(plain.iter().flatten()) {
                    assert!((f - p).abs() <= 1e-5 * p.abs().max(1.0), "{f} vs {p}");
                }
            }
        }
        check::<1>(&acts, &rows, &groups, kb);
        check::<4>(&acts, &rows, &groups, kb);
        check::<8>(&acts, &rows, &groups, kb);
        // And through a whole matmul (8-row groups, as n = 16 picks).
        let w = QWeight::q8_0_rows(rows.clone(), 16, kb * QK);
        assert!(matches!(w.blocks, Blocks::Q8_0x8(_)));
        let mut y = vec![0f32; 8 * 16];
        w.matmul(&x, 8, &mut y);
        let a: [&[BlockQ8_1]; 8] = std::array::from_fn(|i| &acts[i * kb..(i + 1) * kb]);
        for grp in 0..2 {
            let mut o = [[0f32; 8]; 8];
            dot::tile_q8_0x8_scalar(&a, &groups[grp * kb..(grp + 1) * kb], &mut o);
            for r in 0..8 {
                assert_eq!(&y[r * 16 + grp * 8..r * 16 + grp * 8 + 8], &o[r], "row {r}");
            }
        }
    }

    /// Where the CPU has AMX: matmuls of 16 activation rows or more on its tiles give the
    /// same bits as the AVX group tiles, for both formats (every int8 weight value, -128
    /// included), with leftover rows (t % 16) on the AVX tiles and shapes of one block or
    /// many, one slab or several per pair, one pair or many per task (each pair's tiles laid
    /// out during the one before). Elsewhere there is nothing to compare, and the test says so.
    #[test]
    fn amx_tiles_are_bit_identical_to_avx_tiles() {
        if !amx_path::enabled() {
            eprintln!("no AMX on this CPU (or BULKHEAD_CPU_AMX=off): AVX tiles only");
            return;
        }
        let mut rng = Lcg(41);
        for (t, n, kb) in [
            (16, 16, 1),
            (16, 32, 18),
            (37, 48, 5),
            (16, 512, 7),
            (64, 960, 18),
        ] {
            let k = kb * QK;
            let nb = n * kb;
            let vals: Vec<u8> = (0..nb * 16).map(|_| rng.next() as u8).collect();
            let scales: Vec<(f32, f32)> = (0..nb)
                .map(|_| (rng.f32() * 0.1, rng.f32() * 0.5 - 0.25))
                .collect();
            let q4 = QWeight::from_gguf_q4_1(&q4_1_bytes(&vals, &scales), n, k);
            let mut bytes = Vec::new();
            for i in 0..nb {
                bytes.extend_from_slice(&half::f16::from_f32(rng.f32() * 0.02).to_le_bytes());
                bytes.extend((0..QK).map(|j| {
                    if (i + j) % 7 == 0 {
                        0x80
                    } else {
                        rng.next() as u8
                    }
                }));
            }
            let q8 = QWeight::from_gguf_q8_0(&bytes, n, k);
            let x: Vec<f32> = (0..t * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            for w in [&q4, &q8] {
                let (mut avx, mut amx) = (vec![f32::NAN; t * n], vec![f32::NAN; t * n]);
                w.matmul_on(&x, t, &mut avx, false, &mut Vec::new());
                w.matmul_on(&x, t, &mut amx, true, &mut Vec::new());
                for (i, (a, b)) in avx.iter().zip(&amx).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{:?} t={t} n={n} kb={kb}: element {i} (row {}, column {}): {a} vs {b}",
                        w.format(),
                        i / n,
                        i % n
                    );
                }
            }
        }
    }

    /// GGUF K-quant bytes of an `[n, k]` matrix with random values and small scales.
    fn k_quant_bytes(q4: bool, n: usize, k: usize, seed: u64) -> Vec<u8> {
        use crate::kernels::kquants::{GGUF_Q4_K_BYTES, GGUF_Q6_K_BYTES};
        let blocks = n * k / QK_K;
        let mut rng = Lcg(seed);
        let mut out = Vec::new();
        for _ in 0..blocks {
            let size = if q4 { GGUF_Q4_K_BYTES } else { GGUF_Q6_K_BYTES };
            let mut b: Vec<u8> = (0..size).map(|_| rng.next() as u8).collect();
            let scales: &[usize] = if q4 { &[0, 2] } else { &[208] };
            for &at in scales {
                let v = half::f16::from_f32(rng.f32() * 2e-3 + 1e-5);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
            out.extend(b);
        }
        out
    }

    fn k_quant(q4: bool, n: usize, k: usize, seed: u64) -> QWeight {
        let bytes = k_quant_bytes(q4, n, k, seed);
        if q4 {
            QWeight::from_gguf_q4_k(&bytes, n, k)
        } else {
            QWeight::from_gguf_q6_k(&bytes, n, k)
        }
    }

    /// The error bound of quantizing the activations to Q8_K: each value is off by at most
    /// half a step (`amax / 128 / 2`), times the weight's magnitude, summed over k; plus float
    /// rounding.
    fn k_bound(w: &QWeight, x: &[f32], t: usize) -> Vec<f32> {
        let wf = w.dequantize();
        let k = w.cols();
        let mut b = vec![0f32; t * w.rows()];
        for r in 0..t {
            for blk in 0..k / QK_K {
                let xs = &x[r * k + blk * QK_K..r * k + (blk + 1) * QK_K];
                let half_step = xs.iter().fold(0f32, |a, v| a.max(v.abs())) / 128.0 * 0.51;
                for c in 0..w.rows() {
                    let ws: f32 = wf[c * k + blk * QK_K..c * k + (blk + 1) * QK_K]
                        .iter()
                        .map(|v| v.abs())
                        .sum();
                    b[r * w.rows() + c] += half_step * ws;
                }
            }
        }
        b.iter().map(|v| v * 1.01 + 1e-4).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Q4_K and Q6_K matmuls (row counts that fill their last group or not) match the f32
        /// product of the stored values within the activations' quantization error.
        #[test]
        fn k_quant_matmuls_match_f32_reference(
            t in 1usize..11,
            n in 1usize..20,
            kb in 1usize..4,
            q4 in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let k = kb * QK_K;
            let w = k_quant(q4, n, k, seed);
            let mut rng = Lcg(seed ^ 0x5555);
            let x: Vec<f32> = (0..t * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            let mut y = vec![f32::NAN; t * n];
            w.matmul(&x, t, &mut y);
            let want = reference(&w, &x, t);
            let tol = k_bound(&w, &x, t);
            for i in 0..y.len() {
                prop_assert!(
                    (y[i] - want[i]).abs() <= tol[i],
                    "element {}: {} vs {} (bound {})", i, y[i], want[i], tol[i]
                );
            }
        }
    }

    /// The K-quant group tiles on this build's path (AVX2 or AVX-512 VNNI) give the scalar
    /// reference's bits, for tiles of 1, 4 and 8 activation rows, with activations at the
    /// extremes (-128 and 127) and every weight value; and a whole matmul gives the same bits
    /// as the reference row by row.
    #[test]
    fn k_quant_tiles_are_bit_identical_to_the_scalar_reference() {
        use crate::kernels::kdot;
        use crate::kernels::kquants::{BlockQ8K, quantize_row_q8_k};
        let (n, kb) = (16, 3);
        let k = kb * QK_K;
        let mut rng = Lcg(77);
        let x: Vec<f32> = (0..8 * k)
            .map(|i| match i % 97 {
                0 => 3.0,
                1 => -3.0,
                _ => rng.f32() * 2.0 - 1.0,
            })
            .collect();
        let mut acts = vec![BlockQ8K::ZERO; 8 * kb];
        for (a, x) in acts.chunks_mut(kb).zip(x.chunks(k)) {
            quantize_row_q8_k(x, a);
        }
        assert!(acts.iter().any(|b| b.qs.contains(&-128)));
        assert!(acts.iter().any(|b| b.qs.contains(&127)));
        fn check<const R: usize>(acts: &[BlockQ8K], q4: &QWeight, q6: &QWeight, kb: usize) {
            let a: [&[BlockQ8K]; R] = std::array::from_fn(|i| &acts[i * kb..(i + 1) * kb]);
            for grp in 0..2 {
                let (mut fast, mut slow) = ([[0f32; 8]; R], [[0f32; 8]; R]);
                let Blocks::Q4Kx8(g) = &q4.blocks else {
                    panic!("not Q4_K groups")
                };
                let g = &g[grp * kb..(grp + 1) * kb];
                kdot::tile_q4_kx8(&a, g, &mut fast);
                kdot::tile_q4_kx8_scalar(&a, g, &mut slow);
                assert_eq!(fast, slow, "Q4_K, {R} rows, group {grp}");
                let Blocks::Q6Kx8(g) = &q6.blocks else {
                    panic!("not Q6_K groups")
                };
                let g = &g[grp * kb..(grp + 1) * kb];
                kdot::tile_q6_kx8(&a, g, &mut fast);
                kdot::tile_q6_kx8_scalar(&a, g, &mut slow);
                assert_eq!(fast, slow, "Q6_K, {R} rows, group {grp}");
            }
        }
        let q4 = k_quant(true, n, k, 1);
        let q6 = k_quant(false, n, k, 2);
        check::<1>(&acts, &q4, &q6, kb);
        check::<4>(&acts, &q4, &q6, kb);
        check::<8>(&acts, &q4, &q6, kb);
        for w in [&q4, &q6] {
            let mut y = vec![0f32; 8 * n];
            w.matmul(&x, 8, &mut y);
            for c in 0..n {
                for r in 0..8 {
                    let a = &acts[r * kb..(r + 1) * kb];
                    let want = match &w.blocks {
                        Blocks::Q4Kx8(g) => {
                            kdot::dot_q4_k(a, &group_row(g, kb, c).collect::<Vec<_>>())
                        }
                        Blocks::Q6Kx8(g) => {
                            kdot::dot_q6_k(a, &group_row(g, kb, c).collect::<Vec<_>>())
                        }
                        _ => unreachable!(),
                    };
                    assert_eq!(
                        y[r * n + c].to_bits(),
                        want.to_bits(),
                        "row {r}, column {c}"
                    );
                }
            }
        }
    }

    /// The reference dot products agree with candle's (ggml's port) on the same blocks,
    /// within float rounding (another order of the float steps).
    #[test]
    fn k_quant_reference_agrees_with_candle() {
        use crate::kernels::kdot;
        use crate::kernels::kquants::{
            BlockQ8K, q4_k_from_gguf, q6_k_from_gguf, quantize_row_q8_k,
        };
        use candle_core::quantized::k_quants::{self, GgmlType};
        let kb = 4;
        let k = kb * QK_K;
        let mut rng = Lcg(3);
        let x: Vec<f32> = (0..k).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let mut ours = vec![BlockQ8K::ZERO; kb];
        quantize_row_q8_k(&x, &mut ours);
        // Candle's Q8_K blocks (`d`, `qs`, `bsums`, `repr(C)`) with our quantized values, so
        // only the dot products differ.
        let theirs: Vec<k_quants::BlockQ8K> = ours
            .iter()
            .map(|o| {
                let mut b = o.d.to_le_bytes().to_vec();
                b.extend(o.qs.map(|q| q as u8));
                b.extend(o.bsums.iter().flat_map(|s| s.to_le_bytes()));
                candle_block(&b)
            })
            .collect();
        let bytes = k_quant_bytes(true, 1, k, 9);
        let blocks: Vec<k_quants::BlockQ4K> = bytes
            .chunks_exact(std::mem::size_of::<k_quants::BlockQ4K>())
            .map(candle_block)
            .collect();
        let want = k_quants::BlockQ4K::vec_dot(k, &blocks, &theirs);
        let got = kdot::dot_q4_k(&ours, &q4_k_from_gguf(&bytes));
        assert!(
            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
            "Q4_K: {got} vs {want}"
        );
        let bytes = k_quant_bytes(false, 1, k, 10);
        let blocks: Vec<k_quants::BlockQ6K> = bytes
            .chunks_exact(std::mem::size_of::<k_quants::BlockQ6K>())
            .map(candle_block)
            .collect();
        let want = k_quants::BlockQ6K::vec_dot(k, &blocks, &theirs);
        let got = kdot::dot_q6_k(&ours, &q6_k_from_gguf(&bytes));
        assert!(
            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
            "Q6_K: {got} vs {want}"
        );
    }

    /// A candle block from its bytes (candle's block structs are `repr(C)` in GGUF's layout,
    /// their fields private; every bit pattern is a value).
    fn candle_block<T>(bytes: &[u8]) -> T {
        assert_eq!(bytes.len(), std::mem::size_of::<T>());
        // SAFETY: `bytes` is exactly one `T`; the read is unaligned; candle's K-quant blocks
        // are plain integers, f16s and f32s, for which every bit pattern is a value.
        unsafe { (bytes.as_ptr() as *const T).read_unaligned() }
    }

    /// Matrices of different formats stack side by side and give each part's results.
    #[test]
    fn concat_of_different_formats_runs_each_part() {
        let q4 = k_quant(true, 5, QK_K, 4);
        let q8 = QWeight::quantize_q8_0(&vec![127.0; 3 * QK_K], 3, QK_K);
        let c = QWeight::concat(vec![q4.clone(), q8.clone()]);
        assert_eq!((c.format(), c.rows(), c.cols()), (QFormat::Mixed, 8, QK_K));
        let x: Vec<f32> = (0..2 * QK_K).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        let (mut y, mut y4, mut y8) = (vec![0f32; 16], vec![0f32; 10], vec![0f32; 6]);
        c.matmul(&x, 2, &mut y);
        q4.matmul(&x, 2, &mut y4);
        q8.matmul(&x, 2, &mut y8);
        for r in 0..2 {
            assert_eq!(&y[r * 8..r * 8 + 5], &y4[r * 5..r * 5 + 5]);
            assert_eq!(&y[r * 8 + 5..r * 8 + 8], &y8[r * 3..r * 3 + 3]);
        }
        let mut row = vec![0f32; QK_K];
        c.dequantize_row(6, &mut row);
        assert_eq!(row, vec![127.0; QK_K]);
        // Same-format K-quant parts merge into one matrix of groups.
        let merged = QWeight::concat(vec![q4.clone(), k_quant(true, 6, QK_K, 5)]);
        assert_eq!((merged.format(), merged.rows()), (QFormat::Q4K, 11));
        let mut a = vec![0f32; QK_K];
        merged.dequantize_row(4, &mut a);
        let mut b = vec![0f32; QK_K];
        q4.dequantize_row(4, &mut b);
        assert_eq!(a, b);
    }

    /// Where the CPU has AMX: K-quant matmuls of 16 activation rows or more on its tiles give
    /// the same bits as the AVX tiles, with leftover rows on the AVX tiles, one block per row
    /// or several, one pair of groups per task or several. Elsewhere the test says so.
    #[test]
    fn amx_k_quant_tiles_are_bit_identical_to_avx_tiles() {
        if !amx_path::enabled() {
            eprintln!("no AMX on this CPU (or BULKHEAD_CPU_AMX=off): AVX tiles only");
            return;
        }
        let mut rng = Lcg(43);
        for (t, n, kb) in [(16, 16, 1), (37, 48, 2), (64, 640, 4), (32, 160, 8)] {
            let k = kb * QK_K;
            let x: Vec<f32> = (0..t * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            for q4 in [true, false] {
                let w = k_quant(q4, n, k, rng.next() as u64);
                let (mut avx, mut amx) = (vec![f32::NAN; t * n], vec![f32::NAN; t * n]);
                w.matmul_on(&x, t, &mut avx, false, &mut Vec::new());
                w.matmul_on(&x, t, &mut amx, true, &mut Vec::new());
                for (i, (a, b)) in avx.iter().zip(&amx).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{:?} t={t} n={n} kb={kb}: element {i}: {a} vs {b}",
                        w.format()
                    );
                }
            }
        }
    }

    #[test]
    fn concat_stacks_rows() {
        let a = QWeight::quantize_q8_0(&[0.5; 64], 2, 32);
        let b = QWeight::quantize_q8_0(&[-0.25; 96], 3, 32);
        let c = QWeight::concat(vec![a.clone(), b.clone()]);
        assert_eq!((c.rows(), c.cols()), (5, 32));
        let x = vec![1.0; 32];
        let mut y = vec![0.0; 5];
        c.matmul(&x, 1, &mut y);
        assert!(
            (y[0] - 16.0).abs() < 1e-2 && (y[4] + 8.0).abs() < 1e-2,
            "{y:?}"
        );
    }

    /// A tiny deterministic generator, so failures replay from proptest's seed.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) as u32
        }
        fn f32(&mut self) -> f32 {
            self.next() as f32 / (1u64 << 31) as f32
        }
    }
}
