//! The Llama family forward pass (`llama`, `qwen2`, `qwen3`, `gemma3`, `phi3`), generic over the burn
//! backend.
//!
//! # Layout
//! - [`config`]: the architecture and hyper-parameters read from the GGUF metadata.
//! - [`preflight`]: what the file asks of the forward pass, checked before any weight
//!   is read.
//! - [`load`]: builds the model from a GGUF file (tensor naming, RoPE row order, tied
//!   embeddings).
//! - [`linear`]: a weight matrix in the dtype the worker keeps in memory.
//! - [`qmatrix`]: a weight matrix as runs of rows, each in its file's block format.
//! - [`qmatmul`]: CPU products against weights kept in GGUF block formats.
//! - [`packed`]: 5- and 6-bit blocks (Q5_0, Q5_1, Q5_K, Q6_K) kept packed, and their
//!   products.
//! - [`float16`]: F16 and BF16 matrices kept in 16 bits, and their products.
//! - [`scales`]: block scales, flat or as K-quant super-blocks.
//! - [`rope`]: rotary position embeddings.
//! - [`attention`]: grouped-query self-attention against a [`cache::KvCache`].
//! - [`host`]: the forward pass on host vectors, for weights kept in block form.
//! - [`mlp`]: the SwiGLU feed-forward block.
//! - [`cache`]: the per-sequence KV cache.
//! - [`model`]: the whole network and its batched forward pass.
//! - `team`: the parallel region and barrier of the host forward pass.
//! - [`synthetic`]: random-weight Llama files for tests and speed measurements.

pub mod attention;
pub mod cache;
pub mod config;
pub mod float16;
pub mod host;
pub mod linear;
pub mod load;
pub mod mlp;
pub mod model;
pub mod packed;
pub mod preflight;
pub mod qmatmul;
pub mod qmatrix;
pub mod rope;
pub mod scales;
pub mod synthetic;
pub(crate) mod team;

pub use cache::{KvCache, KvDtype};
pub use config::{Arch, LlamaConfig};
pub use load::{LoadError, WeightDtype};
pub use model::{Llama, SeqInput};
