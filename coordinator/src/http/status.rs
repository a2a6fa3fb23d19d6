//! What an operator looks at and does: `GET /metrics` (Prometheus), `GET /v1/status`
//! (JSON), the live status page at `GET /` (HTML that polls `/v1/status` every second),
//! and `POST /admin/workers/{id}/drain`.

use actix_web::{web, HttpResponse};
use serde::Serialize;

use super::AppState;
use crate::actors::messages::ClusterStatus;
use crate::actors::registry::WorkerView;
use crate::api::error::ApiError;
use baton_common::ids::WorkerId;

/// The status page: one self-contained HTML file, no external assets.
const PAGE: &str = include_str!("status.html");

/// `GET /v1/status`.
#[derive(Debug, Serialize)]
struct Status {
    /// This coordinator's id.
    coordinator: String,
    /// Whether any worker was ever heard.
    synced: bool,
    /// Live workers.
    workers: Vec<WorkerView>,
    /// Streams with a client attached.
    streams_in_flight: i64,
    /// Tokens sent since start.
    tokens_total: u64,
    /// Tokens per second, one sample a second: `[unix seconds, rate]`.
    tokens_per_second: Vec<(u64, f64)>,
}

/// `GET /`.
pub async fn page() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body(PAGE)
}

/// `GET /v1/status`.
pub async fn status(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let view = state.registry.send(ClusterStatus).await?;
    Ok(HttpResponse::Ok().json(Status {
        coordinator: state.nats.coordinator().to_string(),
        synced: view.synced,
        workers: view.workers,
        streams_in_flight: state.metrics.streams_in_flight.get(),
        tokens_total: state.metrics.tokens.get(),
        tokens_per_second: state.metrics.history(),
    }))
}

/// Optional body of `POST /admin/workers/{id}/drain`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    /// How long the worker's streams may run on before they move to other workers, in
    /// milliseconds (0: at once); absent: the worker's `drain_handover_ms`.
    #[serde(default)]
    handover_after_ms: Option<u64>,
}

/// `POST /admin/workers/{id}/drain`: the worker stops taking work, lets what it runs
/// finish (handing over what still runs after `handover_after_ms`) and leaves. The body
/// is optional: `{"handover_after_ms": N}`.
pub async fn drain(
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let worker = path
        .parse::<WorkerId>()
        .map_err(|_| ApiError::WorkerNotFound(format!("{:?} is not a worker id", path.as_str())))?;
    let options: DrainBody = if body.iter().all(u8::is_ascii_whitespace) {
        DrainBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::invalid("handover_after_ms", format!("invalid drain body: {e}"))
        })?
    };
    let timeout = std::time::Duration::from_millis(state.config.submit_timeout_ms);
    let reply = state
        .nats
        .drain(
            worker,
            "drain requested over HTTP".into(),
            options.handover_after_ms,
            timeout,
        )
        .await
        .map_err(|e| ApiError::from_drain(worker, e))?;
    tracing::info!(%worker, running = reply.running, queued = reply.queued, "worker draining (HTTP)");
    Ok(HttpResponse::Ok().json(serde_json::json!({
        "worker": worker.to_string(),
        "draining": true,
        "running": reply.running,
        "queued": reply.queued,
    })))
}

/// `POST /admin/workers/{id}/models`: the worker loads a model file beside what it
/// serves and switches to it (or adds it, with `"add": true`); streams running finish on
/// the model they began on. Body: `{"path", "sha256"?, "name"?, "add"?}`. Answers once
/// the model serves, or with why not (the models served before still serve).
pub async fn load_model(
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let worker = worker_id(&path)?;
    let request: baton_common::public::LoadModelRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    if request.worker.is_some_and(|w| w != worker) {
        return Err(ApiError::invalid(
            "worker",
            "the body names another worker than the URL",
        ));
    }
    let changed = crate::api::models::load(&state.nats, worker, request).await?;
    tracing::info!(%worker, loaded = ?changed.loaded.as_ref().map(|m| &m.id), "model loaded on an operator's request (HTTP)");
    Ok(HttpResponse::Ok().json(changed))
}

/// `DELETE /admin/workers/{id}/models/{model}`: the worker stops serving `model`; its
/// streams finish on it.
pub async fn unload_model(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (worker, model) = path.into_inner();
    let worker = worker_id(&worker)?;
    let timeout = std::time::Duration::from_millis(state.config.submit_timeout_ms);
    let changed = crate::api::models::unload(&state.nats, worker, model, timeout).await?;
    tracing::info!(%worker, "model unloaded on an operator's request (HTTP)");
    Ok(HttpResponse::Ok().json(changed))
}

fn worker_id(text: &str) -> Result<WorkerId, ApiError> {
    text.parse::<WorkerId>()
        .map_err(|_| ApiError::WorkerNotFound(format!("{text:?} is not a worker id")))
}

/// `GET /metrics`: refreshes the cluster gauges, then encodes everything.
pub async fn metrics(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let view = state.registry.send(ClusterStatus).await?;
    let m = &state.metrics;
    m.sync_wire(state.nats.counters());
    m.sync_public(state.public.requests(), state.public.malformed());
    // Workers that left must not linger with their last values.
    m.set_workers(&view.workers);
    Ok(HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(m.encode()))
}
