//! The OpenAI-compatible HTTP API.
//!
//! - [`cors`]: CORS for browser clients, outermost (preflights need no key).
//! - [`request_id`]: `X-Request-Id` on every response.
//! - [`clients`]: at most `max_connections_per_client` connections an address.
//! - [`auth`]: the API key check in front of every route.
//! - [`routes`]: handlers (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
//!   `/v1/streams/{id}`, `/health`).
//! - [`sse`]: Server-Sent Events framing of an answer's chunks.
//! - [`status`]: `/metrics`, `/v1/status` and the live status page at `/`.
//! - [`error`]: the one mapping from errors to status codes.
//!
//! Validation, answers and errors are the API's, shared with the NATS front
//! ([`crate::api`]).

pub mod auth;
pub mod clients;
pub mod cors;
pub mod error;
pub mod request_id;
pub mod routes;
pub mod sse;
pub mod status;

use std::sync::Arc;

use actix::Addr;
use baton_common::config::CoordinatorConfig;

use crate::actors::registry::Registry;
use crate::auth::Keys;
use crate::metrics::Metrics;
use crate::nats::NatsHandle;
use crate::sessions::Sessions;

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Limits and timeouts.
    pub config: Arc<CoordinatorConfig>,
    /// The API keys (none: the API is open) and their stream slots.
    pub keys: Arc<Keys>,
    /// The worker registry (and router).
    pub registry: Addr<Registry>,
    /// Open stream sessions.
    pub sessions: Addr<Sessions>,
    /// The NATS connection.
    pub nats: NatsHandle,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// The public NATS API's counters.
    pub public: Arc<crate::public::PublicCounters>,
}
