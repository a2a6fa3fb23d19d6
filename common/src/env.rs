//! Environment variable names, in one place.

/// Path of the GGUF model file a worker serves.
pub const MODEL: &str = "BATON_MODEL";
/// Backend a worker runs on: `cpu` or `cuda`.
pub const BACKEND: &str = "BATON_BACKEND";
/// Log filter, in `tracing_subscriber::EnvFilter` syntax.
pub const LOG: &str = "RUST_LOG";
