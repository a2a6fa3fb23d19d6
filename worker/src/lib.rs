//! Baton worker: runs Llama-family models (llama, qwen2, qwen3, gemma3, phi3) from GGUF files,
//! on Baton's CPU kernels or burn.
//!
//! # Layout
//! - [`engine`]: everything that turns a prompt into tokens — GGUF reader, tokenizer,
//!   chat template, Llama forward pass, KV cache, sampler, stop conditions.
//! - [`backend`]: the burn backends a worker can run on (`flex` on CPU, `cuda` behind the
//!   `cuda` feature) and how one is chosen.
//! - [`bench`](mod@bench): `baton-worker bench`, the engine's speed and memory benchmark.
//! - [`cli`]: the `baton-worker` command line.
//! - [`compute`]: the threads that run the model on CPU and their scheduling class.
//! - [`fuzz`]: what the `gguf` fuzz target feeds arbitrary bytes to.
//! - [`serve`]: `baton-worker serve`, the worker that joins a cluster over NATS.

pub mod backend;
pub mod bench;
pub mod cli;
pub mod compute;
pub mod engine;
pub mod fuzz;
pub mod serve;
