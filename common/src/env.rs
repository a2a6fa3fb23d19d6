//! Environment variable names, in one place.

/// Path of `cluster.toml`.
pub const CONFIG: &str = "BATON_CONFIG";
/// NATS server URL (overrides `nats.url`).
pub const NATS_URL: &str = "BATON_NATS_URL";
/// Coordinator HTTP base URL the `baton` client uses (`http://host:port`).
pub const URL: &str = "BATON_URL";
/// Subject prefix (overrides `nats.subject_prefix`).
pub const SUBJECT_PREFIX: &str = "BATON_SUBJECT_PREFIX";
/// Coordinator HTTP listen address (overrides `coordinator.listen`).
pub const LISTEN: &str = "BATON_LISTEN";
/// Directory of the coordinator's checkpoint store (overrides `coordinator.store_path`).
pub const STORE: &str = "BATON_STORE";
/// Checkpoint mode: `sync`, `async` or `off` (overrides `coordinator.checkpoint`).
pub const CHECKPOINT: &str = "BATON_CHECKPOINT";
/// Path of the GGUF model file a worker serves (overrides `worker.model`).
pub const MODEL: &str = "BATON_MODEL";
/// Public model name (overrides `worker.model_name`).
pub const MODEL_NAME: &str = "BATON_MODEL_NAME";
/// Backend a worker runs on: `cpu` or `cuda` (overrides `worker.backend`).
pub const BACKEND: &str = "BATON_BACKEND";
/// Weight format: `native`, `f16`, `f32` (overrides `worker.weights`).
pub const WEIGHTS: &str = "BATON_WEIGHTS";
/// API keys of the coordinator's HTTP API, comma-separated (replace `auth.api_keys`
/// when they hold at least one key).
pub const API_KEYS: &str = "BATON_API_KEYS";
/// Admin keys of the coordinator's HTTP API, comma-separated (replace
/// `auth.admin_keys` when they hold at least one key).
pub const ADMIN_KEYS: &str = "BATON_ADMIN_KEYS";
/// The key the `baton` client sends (`Authorization: Bearer <key>`).
pub const API_KEY: &str = "BATON_API_KEY";
/// Log filter, in `tracing_subscriber::EnvFilter` syntax.
pub const LOG: &str = "RUST_LOG";
/// Log format: `text` (default) or `json`.
pub const LOG_FORMAT: &str = "BATON_LOG_FORMAT";
