//! The inference engine: from a GGUF file and a prompt to tokens.
//!
//! # Layout
//! - [`gguf`]: the GGUF reader (mmap, validated), dequantization, and a writer.
//! - [`tokenizer`]: byte-level BPE and SentencePiece vocabularies of the GGUF, on HF
//!   `tokenizers`.
//! - [`chat`]: the model's own chat template, rendered with minijinja.
//! - [`cpu`]: weight matrices in their block formats and the CPU kernels of their
//!   products.
//! - [`llama`]: the Llama-family forward pass (llama, qwen2, qwen3, gemma3, phi3), the preflight
//!   of a file, and the KV cache.
//! - [`guide`]: structured output, a grammar's token mask per draw (llguidance).
//! - [`sampler`]: greedy and seeded sampling, counter-based per position.
//! - [`stops`]: stop strings over streamed text.
//! - [`prefix`]: the prefix cache, keys and values of shared prompt blocks.
//! - [`generate`]: sequences, stop conditions, the batched step and the decode loop.

pub mod chat;
pub mod cpu;
pub mod generate;
pub mod gguf;
pub mod guide;
pub mod llama;
pub mod prefix;
pub mod sampler;
pub mod stops;
pub mod tokenizer;

pub use generate::{
    Completion, Engine, EngineError, FinishReason, GenerateParams, Logprobs, Prompt, Sequence,
    TokenEvent, ToolUse,
};
