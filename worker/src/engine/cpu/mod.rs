//! The host engine's CPU side: weight matrices kept in the file's block formats, the
//! products against them, and the parallel region the forward pass runs in. Nothing here
//! knows a model family; `llama` builds its forward pass from these parts.
//!
//! # Layout
//! - [`blocks`]: a matrix in one block format ([`Blocks`]), repacked at load, and the
//!   input rows prepared for it ([`Prepared`]); `product` holds its products.
//! - `kernels`: the block dot products and panel products, portable and vectorised
//!   (`kernels::avx2`, `kernels::avx512`), the one place that runs ISA-specific code;
//!   each path gives the same bits.
//! - [`packed`]: 5- and 6-bit blocks (Q5_0, Q5_1, Q5_K, Q6_K) kept packed, and their
//!   products.
//! - [`float16`]: F16 and BF16 matrices kept in 16 bits, and their products.
//! - [`scales`]: block scales, flat or as K-quant super-blocks.
//! - [`qmatrix`]: a weight matrix as runs of rows, each in its file's format.
//! - `attention`, `activation`, `transpose`: the host forward pass's other kernels
//!   (attention against cached keys and values, RMSNorm and gated activations, layout
//!   changes between products).
//! - `team`: the parallel region and barrier of the host forward pass.

pub(crate) mod activation;
pub(crate) mod attention;
pub mod blocks;
pub mod float16;
mod kernels;
pub mod packed;
mod product;
pub mod qmatrix;
pub mod scales;
pub(crate) mod team;
pub(crate) mod transpose;

pub use blocks::{Blocks, Prepared, QKind, BLOCK};
#[cfg(target_arch = "x86_64")]
pub(crate) use kernels::avx2::{hsum, load_tail};
pub(crate) use kernels::{IntRows, WEIGHT_SLICE};
