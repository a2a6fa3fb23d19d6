//! GGUF files: reading (memory-mapped, validated), dequantizing, and writing.
//!
//! # Layout
//! - [`reader`]: [`GgufFile`] — header, metadata ([`MetaValue`]) and tensor-table
//!   ([`TensorInfo`]) parsing with every size checked — and [`GgufError`].
//! - [`dequant`]: [`GgmlType`] (ids and block layouts) and ggml data → f32, bit-exact with
//!   ggml's reference code.
//! - [`writer`]: [`GgufWriter`] (GGUF v3) and ggml's reference quantizers.

pub mod dequant;
pub mod reader;
pub mod writer;

pub use reader::{GgmlType, GgufError, GgufFile, MetaValue, TensorInfo};
pub use writer::GgufWriter;
