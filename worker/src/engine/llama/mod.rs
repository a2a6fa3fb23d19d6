//! The Llama family forward pass (`llama`, `qwen2`, `qwen3`, `gemma3`, `phi3`), on the
//! host engine ([`host::HostLlama`]) or the device engine ([`model::BurnLlama`], generic
//! over the burn backend), one chosen at load ([`model::Llama`]).
//!
//! # Layout
//! - [`config`]: the architecture and hyper-parameters read from the GGUF metadata.
//! - [`preflight`]: what the file asks of the forward pass, checked before any weight
//!   is read.
//! - [`load`]: builds the model from a GGUF file (tensor naming, RoPE row order, tied
//!   embeddings).
//! - [`linear`]: a device engine's weight matrix, in the dtype the worker keeps.
//! - [`rope`]: rotary position embeddings.
//! - [`attention`]: the device engine's grouped-query self-attention against a
//!   [`cache::DeviceKvCache`].
//! - [`host`]: the host engine: the forward pass on host vectors, for weights kept in
//!   block form.
//! - [`mlp`]: the SwiGLU feed-forward block.
//! - [`cache`]: the per-sequence KV cache, one store per engine.
//! - [`model`]: the whole network on its engine, and its batched forward pass.
//! - [`synthetic`]: random-weight Llama files for tests and speed measurements.

pub mod attention;
pub mod cache;
pub mod config;
pub mod host;
pub mod linear;
pub mod load;
pub mod mlp;
pub mod model;
pub mod preflight;
pub mod rope;
pub mod synthetic;

pub use cache::{DeviceKvCache, HostKvCache, KvCache, KvDtype};
pub use config::{Arch, LlamaConfig};
pub use load::{LoadError, WeightDtype};
pub use model::{Fetch, Head, Llama, SeqInput, StepLogits, HEAD};
