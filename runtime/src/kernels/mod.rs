//! CPU kernels for the llama forward: repacked quantized weights and their matmul, and the
//! small f32 operations around it.
//!
//! - `blocks`: the block formats (Q4_1 and Q8_0 weights with f32 scales, Q8_1 activations),
//!   repacking from GGUF bytes, quantizing and dequantizing;
//! - `amx`: Intel AMX tiles for matmuls of 16 activation rows or more, where the CPU has them;
//!   `amx_k` the same for the K-quant formats, a sub-block per tile product;
//! - `dot`: tile dot products, AVX2 (`_mm256_maddubs_epi16`, as ggml) with a scalar fallback;
//! - `kquants`: GGUF's K-quant formats (Q4_K, Q6_K) kept as stored, in 8-row groups, and
//!   their Q8_K activation blocks;
//! - `kdot`: their tile dot products (ggml's block math), AVX2 or AVX-512 VNNI, tested bit
//!   for bit against the scalar reference beside them;
//! - `matmul`: `QWeight` and the parallel `y = x W^T` over rayon's pool.
//! - `ops`: RMSNorm, rope, SiLU, residual adds on f32 rows;
//! - `attention`: one query token's causal attention over KV page slices;
//! - `encoder`: a BERT encoder's LayerNorm, GELU, packed bidirectional attention and f32
//!   matmul.
//!
//! Everything `unsafe` in the crate lives here, each use with its `SAFETY:` reason.

// Only where the build has AVX-512 (every CPU with AMX does; `amx_kernels` comes from
// build.rs); whether the CPU has AMX is asked at run time (`amx::enabled`).
#[cfg(amx_kernels)]
pub mod amx;
#[cfg(amx_kernels)]
pub mod amx_k;
pub mod attention;
pub mod blocks;
pub mod dot;
pub mod encoder;
pub mod kdot;
pub mod kquants;
pub mod matmul;
pub mod ops;

pub use matmul::{QFormat, QWeight, matmul_path};
